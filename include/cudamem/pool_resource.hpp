// cudamem/pool_resource.hpp — a fast, thread-safe, stream-ordered pool over any upstream
// resource: device, pinned, managed, host or simulated memory.
//
//   cudamem::device_resource device;
//   cudamem::pool_resource pool{device, {.initial_size = 1ull << 30}};
//   cudamem::stream s;
//   void* p = pool.allocate(4 << 20, 256, s);   // ~tens of ns: no cudaMalloc, no sync
//   kernel<<<g, b, 0, s.get()>>>(p);
//   pool.deallocate(p, 4 << 20, 256, s);         // s may reuse it at once, other streams once
//                                               // the kernel has finished
//   pool.release();                              // hand every wholly free block back upstream
//
//   cudamem::pinned_resource pinned;             // cudaMallocHost of 64 MiB costs ~34 ms:
//   cudamem::pool_resource pinned_pool{pinned};  // pay it once, not per buffer
//
// Contract (memory_resource.hpp's, plus)
// - Kind and device are the upstream's. Every block is a multiple of 256 bytes and aligned to
//   at least 256 (any power-of-two alignment may be asked for). A block reused from the cache
//   (below) may be up to 1/8 larger than the request rounded to 256; `stats().used_bytes`
//   counts the blocks' real sizes, so reserved = used + free always holds. The cache never
//   holds more than is in use (`cache_follows_use`, on by default): once a run of work has
//   freed what it held, the next run is cut from merged memory, not from blocks scattered
//   where the last one left them.
// - Growth: the pool asks its upstream for memory only when no free block fits. Requests up
//   to `small_block_limit` come from chunks of `small_chunk_size`; larger ones from chunks of
//   `growth_step`, or of the request's own size when it is larger. Small and large blocks never
//   share a chunk, so long-lived small blocks cannot pin the chunks large blocks come and go
//   in (the classic cause of "2 GiB fails with 6 GiB free"). The pool never holds more than
//   `maximum_size` from its upstream. `initial_size` is reserved at construction (large tier).
//   A request of at least growth_step (and initial_size) does not cut a cached free block more
//   than 1.25 times its size while the upstream can supply a fresh one (the rest would stay
//   pinned while it lives); and before a new small chunk is taken, wholly free large chunks
//   go back upstream, so small chunks land where large blocks were rather than between them.
// - When the upstream fails (or `maximum_size` is reached) the pool asks again for just the
//   request, then releases every wholly free chunk it holds and asks once more, then looks in
//   every shard's free blocks; only then it throws `out_of_memory`, whose report carries the
//   pool's reserved, used and peak bytes, free block count and largest free block.
// - `release()` returns every chunk in which nothing is allocated (exact, unlike a cache that
//   only empties wholly unused size classes) and keeps the rest.
// - Stream order. `deallocate(p, n, a, s)` says the last use of p was submitted to s. A later
//   request on s may get p at once (stream order separates them). A request on another
//   stream t gets it only once the free is known complete: the pool records an event on s
//   (lazily — only when a block freed on s is about to go to another stream, so single-stream
//   code never calls CUDA) and either finds it complete or makes t wait for it with
//   cudaStreamWaitEvent, which costs t nothing if s is already past that point. The
//   synchronous allocate waits on the host for such events; the synchronous deallocate
//   promises the memory is idle. Blocks freed on different streams may merge; a merged block
//   remembers up to 4 streams, and one freed on more is ordered after every stream with frees
//   not known complete. cudaStreamPerThread (and 0 in a `--default-stream per-thread` build) is
//   each thread's own stream, and never taken for an ended thread's (detail/stream_tag.hpp);
//   frees on it record their event at once (another thread cannot name that stream later).
// - Which block, across streams. When the block a request would get needs a wait for another
//   stream's work, the pool looks a little further for one that needs none (freed on the
//   requesting stream, known complete, or already waited for) and takes it instead; only when
//   there is none does the request's stream wait — or, with `stream_reuse =
//   stream_reuse_policy::when_complete`, the pool asks which frees have completed and, if none
//   will do, grows instead (waiting only once the upstream cannot supply). A stream waits for a given recording of
//   another stream's event once, not once per block. `stream_stats()` counts what the pool did:
//   blocks that crossed streams, event records, queries, stream waits (and those skipped),
//   host waits, device synchronisations, chunks taken and given back.
// - Events are recorded lazily, so the pool remembers the streams it owes an event on. A
//   `cudamem::stream` tells the pool when it is destroyed (the pool settles up then, while
//   the handle is still valid); a raw cudaStream_t you destroy yourself must first be passed
//   to `retire_stream(s)` if pool memory was freed on it.
// - Stream capture: the pool works on the host, so a block freed while a stream is captured
//   into a CUDA graph returns at once, before the graph has run. Memory a graph uses after its
//   capture ends must come from async_resource (graph allocation nodes). exec_policy and
//   with_temp_storage switch to graph memory by themselves (detail/interop/graph_temporary.hpp).
//   No event can be recorded on a stream while it is captured, so a block last freed on such a
//   stream before its capture, with no event recorded since, cannot go to another stream
//   during the capture (cuda_error, cudaErrorStreamCaptureUnsupported, saying what to do):
//   call `cudamem::prepare_for_graph_capture()` before beginning a capture (cudamem's PyTorch
//   allocator does, in beginAllocateToPool). Streams being captured are never recorded on.
// - Upstream memory of kind host, or device memory of device -1 (simulated_resource), is not
//   stream-ordered: streams are ignored and the pool never calls CUDA.
// - release() and the destructor return chunks with the synchronous upstream deallocate; if
//   any returned memory was freed on a stream and not yet known complete, they first
//   synchronise the device. The destructor reports blocks still allocated to the error handler
//   and returns their chunks anyway.
// - Bad input: SIZE_MAX or more than `maximum_size` throws `out_of_memory`; a pointer the pool
//   never gave out, a double free, or a size that does not match the allocation (the block is
//   smaller, or more than 1/8 larger, than the size rounded to 256) goes to the error handler
//   (the mismatched one is freed with its real size; the others change nothing).
// - compute-sanitizer sees into the pool: over cudaMalloc'd memory (device_resource, or
//   adaptors over it) each chunk is an NVTX heap and each block a region of it from allocate
//   to deallocate (detail/nvtx.hpp), so memcheck reports an access past a block's requested
//   size or after its free, as it does for cudaMalloc'd memory; a block reused at once on the
//   same stream is a new region. Not over VMM memory (vm_pool_resource): the tool refuses
//   heaps there. Nothing is called with no tool attached; CUDAMEM_NVTX=0 compiles it out.
//
// Design: a thin class over named parts (each header says what it owns and why)
// - detail/pool/pool_shard.hpp      a shard: lock, two TLSF heaps (small and large tier), the
//                                   front-end cache of whole freed blocks, the live-block map;
//                                   a thread always starts at its own shard
// - detail/pool/stream_ledger.hpp   stream order: per-stream free counts, lazy events, tags,
//                                   the waits each stream already made
// - detail/pool/stream_events.hpp   the CUDA calls behind stream order (host_stream_events.hpp:
//                                   a host model of them, for tests)
// - detail/pool/chunk_set.hpp       chunks from the upstream: growth, the out-of-memory
//                                   fallbacks, release; which shard owns which chunk
// - detail/pool/tlsf_heap.hpp, block_cache.hpp, address_map.hpp: the data structures
// Limits: memory free in one shard serves another only when the upstream is full (the last
// step before out_of_memory); with several shards `peak_used_bytes` is the sum of the shards'
// peaks, an upper bound of the true peak.
#pragma once

#include <cudamem/detail/pool/chunk_set.hpp>
#include <cudamem/detail/pool/pool_options.hpp>  // pool_options, pool_stream_stats
#include <cudamem/detail/pool/pool_shard.hpp>
#include <cudamem/detail/sync/mutex.hpp>
#include <cudamem/detail/unique_owner.hpp>
#include <cudamem/error.hpp>
#include <cudamem/memory_resource.hpp>
#include <cudamem/out_of_memory.hpp>
#include <cudamem/stream.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <string>
#include <utility>
#include <vector>

namespace cudamem {

/// A sharded TLSF pool over any upstream resource; see the contract above.
class pool_resource final : public memory_resource, private detail::stream_listener {
 public:
  /// Every block is a multiple of this many bytes, and aligned to it.
  static constexpr std::size_t granule = detail::pool_policy::granule;

  /// A pool over `upstream` (referred to, not owned). Throws std::invalid_argument for bad options,
  /// `out_of_memory` when `options.initial_size` cannot be had.
  explicit pool_resource(memory_resource& upstream, pool_options options = {})
      : memory_resource(upstream.kind(), upstream.device()),
        options_(detail::validated_pool_options(options)),
        policy_(detail::pool_policy::from(options_, upstream)),
        shards_(detail::make_pool_shards(options_.shards, policy_)),
        chunks_(upstream, policy_) {
    if (options_.initial_size > 0) {
      std::string cause;
      if (!chunks_.obtain(*shards_[0], detail::large_tier, policy_.round_up(options_.initial_size),
                          cause)) {
        throw_out_of_memory(*this, options_.initial_size, granule,
                            "pool_resource: initial_size: " + cause);
      }
    }
    if (policy_.tracks_streams) {  // last, so that a constructor that throws leaves no registration
      detail::stream_listener_registry::instance().add(this);
    }
  }

  ~pool_resource() override {
    if (policy_.tracks_streams) {
      detail::stream_listener_registry::instance().remove(this);
    }
    chunks_.return_all(shards_);  // reports blocks still allocated
  }

  pool_resource(const pool_resource&) = delete;
  pool_resource& operator=(const pool_resource&) = delete;

  /// Returns every chunk in which nothing is allocated to the upstream. Returns the bytes.
  std::size_t release() noexcept { return chunks_.release_free(shards_); }

  /// Records, for every block freed on `s`, that it is done once `s` reaches this point, so
  /// `s` may be destroyed afterwards (see the contract). Throws cuda_error on a CUDA error.
  void retire_stream(stream_view s) {
    if (!policy_.tracks_streams) {
      return;
    }
    for (auto& sh : shards_) {
      const detail::lock_guard lock(sh->mutex);
      sh->ledger.retire(s);
    }
  }

  /// Records an event on every stream this pool's frees were made on that no event covers
  /// yet (streams being captured now excepted), so that a request can later be ordered after
  /// those frees without recording on their streams, which a capture forbids. Returns how
  /// many events it recorded. prepare_for_graph_capture() does it for every pool. Throws
  /// cuda_error on a CUDA error.
  std::size_t cover_frees() {
    std::size_t recorded = 0;
    if (!policy_.tracks_streams) {
      return recorded;
    }
    for (auto& sh : shards_) {
      const detail::lock_guard lock(sh->mutex);
      recorded += sh->ledger.cover_frees();
    }
    return recorded;
  }

  /// What the pool did to keep stream order (see the contract). Takes each shard's lock once:
  /// not for hot loops.
  [[nodiscard]] pool_stream_stats stream_stats() const {
    detail::stream_counters c;
    for (const auto& sh : shards_) {
      const detail::lock_guard lock(sh->mutex);
      c.add(sh->ledger.counters());
    }
    const detail::chunk_set::counts chunks = chunks_.activity();
    pool_stream_stats s;
    s.cross_stream_blocks = c.cross_stream_blocks;
    s.preferred_blocks = c.preferred_blocks;
    s.event_records = c.event_records;
    s.event_queries = c.event_queries;
    s.stream_waits = c.stream_waits;
    s.waits_skipped = c.waits_skipped;
    s.host_waits = c.host_waits;
    s.wide_tags = c.wide_tags;
    s.device_syncs = chunks.device_syncs;
    s.upstream_allocations = chunks.upstream_allocations;
    s.upstream_returns = chunks.upstream_returns;
    return s;
  }

  /// The options, as validated.
  [[nodiscard]] const pool_options& options() const noexcept { return options_; }
  /// The number of shards (each a lock and its heaps).
  [[nodiscard]] std::size_t shard_count() const noexcept { return shards_.size(); }
  /// Number of chunks held from the upstream.
  [[nodiscard]] std::size_t chunk_count() const { return chunks_.count(); }
  /// The most held from the upstream since construction or reset_peak_reserved().
  [[nodiscard]] std::size_t peak_reserved_bytes() { return chunks_.peak_reserved(); }
  /// Starts peak_reserved_bytes() again from what is held now.
  void reset_peak_reserved() { chunks_.reset_peak_reserved(); }
  /// The chunks held from the upstream, as (base, size) by address (a snapshot's segments).
  [[nodiscard]] std::vector<std::pair<std::uintptr_t, std::size_t>> chunk_ranges() const {
    return chunks_.ranges();
  }

 private:
  using shard = detail::pool_shard;
  using block = detail::pool_block;

  [[nodiscard]] shard& home_shard() const noexcept {
    return *shards_[detail::pool_thread_slot() & (shards_.size() - 1)];
  }

  // --- allocate -----------------------------------------------------------------------------

  // With a tool attached (policy_.annotates) requests take a path of their own that tells it
  // which blocks are live (see the contract); the test comes first, so that without a tool
  // the fast paths are exactly what they were (one predictable branch each).
  void* do_allocate(std::size_t bytes, std::size_t alignment, stream_view stream) override {
    if (detail::nvtx_compiled && policy_.annotates) [[unlikely]] {
      return allocate_annotated(bytes, alignment, &stream);
    }
    return allocate_block(bytes, alignment, &stream);
  }
  void* do_allocate_sync(std::size_t bytes, std::size_t alignment) override {
    if (detail::nvtx_compiled && policy_.annotates) [[unlikely]] {
      return allocate_annotated(bytes, alignment, nullptr);
    }
    return allocate_block(bytes, alignment, nullptr);
  }

  [[gnu::noinline]] void* allocate_annotated(std::size_t bytes, std::size_t alignment,
                                             const stream_view* stream) {
    void* p = allocate_block(bytes, alignment, stream);
    chunks_.annotate_block(p, bytes);
    return p;
  }

  /// `stream` null: the synchronous form (ready for everyone on return). The fast path,
  /// inline: a cache hit whose block is free of pending frees on other streams (the common
  /// case) costs a lock, a pop and a few stores. Everything else is out of line.
  void* allocate_block(std::size_t bytes, std::size_t alignment, const stream_view* stream) {
    const std::size_t padding = alignment > granule ? alignment - granule : 0;
    const std::size_t size = policy_.round_up(bytes);
    if (size == 0 || size > options_.maximum_size || padding > options_.maximum_size - size)
        [[unlikely]] {
      throw_too_large(bytes, alignment);
    }
    shard& home = home_shard();
    home.mutex.lock();
    if (size <= policy_.cache_limit) {
      if (block* b = home.cached.pop(size, alignment - 1)) {
        if (b->tag.empty() || b->tag.only_on(stream)) [[likely]] {
          b->tag.clear();
          home.count_in(b->size);
          home.mutex.unlock();
          return reinterpret_cast<void*>(b->address);
        }
        return allocate_cached_slow(home, b, bytes, size, alignment, stream);
      }
    }
    return allocate_uncached(home, bytes, size, alignment, stream);
  }

  /// A cache hit whose block has frees pending on another stream. Called with home's lock
  /// held; releases it. (Under stream_reuse_policy::when_complete the cache may decline: then
  /// the request goes on as a miss.)
  [[gnu::noinline]] void* allocate_cached_slow(shard& home, block* b, std::size_t bytes,
                                               std::size_t size, std::size_t alignment,
                                               const stream_view* stream) {
    {
      detail::unique_lock lock(home.mutex, detail::adopt_lock);
      if (void* p = home.hand_out_cached(policy_, b, size, alignment, stream)) {
        return p;
      }
      lock.release();  // still held: allocate_uncached releases it
    }
    return allocate_uncached(home, bytes, size, alignment, stream);
  }

  [[noreturn, gnu::noinline]] void throw_too_large(std::size_t bytes, std::size_t alignment) const {
    throw_out_of_memory(*this, bytes, alignment,
                        "pool_resource: larger than the pool's maximum size (" +
                            format_bytes(options_.maximum_size) + ")");
  }

  /// A request the cache could not serve: from home's heap (flushing its cache if need be),
  /// else from the upstream. Called with home's lock held; releases it.
  [[gnu::noinline]] void* allocate_uncached(shard& home, std::size_t bytes, std::size_t size,
                                            std::size_t alignment, const stream_view* stream) {
    const detail::pool_tier t = policy_.tier_of(size);
    {
      const detail::lock_guard lock(home.mutex, detail::adopt_lock);
      if (void* p = home.take_flushing(policy_, t, size, alignment, stream)) {
        return p;
      }
    }
    return chunks_.grow_and_allocate(*this, shards_, home, t, bytes, size, alignment, stream);
  }

  // --- deallocate ---------------------------------------------------------------------------

  void do_deallocate(void* p, std::size_t bytes, std::size_t /*alignment*/,
                     stream_view stream) noexcept override {
    if (detail::nvtx_compiled && policy_.annotates) [[unlikely]] {
      return free_annotated(p, bytes, &stream);
    }
    free_block(p, bytes, &stream);
  }
  void do_deallocate_sync(void* p, std::size_t bytes, std::size_t /*alignment*/) noexcept override {
    if (detail::nvtx_compiled && policy_.annotates) [[unlikely]] {
      return free_annotated(p, bytes, nullptr);
    }
    free_block(p, bytes, nullptr);
  }

  /// A free with a tool attached: the block's region goes once the block is known to be live
  /// (a bad free unregisters nothing) and before anyone can be handed it again.
  [[gnu::noinline]] void free_annotated(void* p, std::size_t bytes,
                                        const stream_view* stream) noexcept {
    const auto address = reinterpret_cast<std::uintptr_t>(p);
    if (shard* owner = chunks_.owner_of(address)) {
      owner->mutex.lock();
      if (block* b = owner->live.find(address); b != nullptr && !b->cached) {
        detail::memory_annotations::remove_region(policy_.device, p);
        finish_free_slow(*owner, b, bytes, stream);  // the general case serves any free
        return;
      }
      owner->mutex.unlock();
    }
    free_elsewhere(address, bytes, stream);  // reports the bad pointer or double free
  }

  /// The fast path, inline like allocate_block's: a block of this thread's shard, freed with
  /// its own size on the stream the shard saw last, into a cache with room. (always_inline:
  /// the compiler's own choice varies with what else do_deallocate holds, by ~10 instructions
  /// per free.)
  [[gnu::always_inline]] void free_block(void* p, std::size_t bytes,
                                         const stream_view* stream) noexcept {
    const auto address = reinterpret_cast<std::uintptr_t>(p);
    shard& home = home_shard();
    home.mutex.lock();
    if (block* b = home.live.find(address); b != nullptr && !b->cached) [[likely]] {
      finish_free(home, b, bytes, stream);
      return;
    }
    home.mutex.unlock();
    free_elsewhere(address, bytes, stream);
  }

  /// A block another thread's shard gave out (found through the chunk directory), or a bad
  /// pointer.
  [[gnu::noinline]] void free_elsewhere(std::uintptr_t address, std::size_t bytes,
                                        const stream_view* stream) noexcept {
    shard* owner = chunks_.owner_of(address);
    if (owner == nullptr) {
      report_problem("pool_resource: deallocate of a pointer this pool did not give out; ignored");
      return;
    }
    owner->mutex.lock();
    block* b = owner->live.find(address);
    if (b == nullptr || b->cached) {
      owner->mutex.unlock();
      report_problem("pool_resource: deallocate of a block that is not allocated (a double free, "
                     "or a pointer into the middle of a block); ignored");
      return;
    }
    finish_free(*owner, b, bytes, stream);
  }

  /// Frees `b` (found in sh.live, handed out). Called with sh's lock held; releases it. Inline:
  /// the size matches, the cache has room and the stream is the one whose record the shard
  /// looked up last (a handed-out block has no pending frees, so its tag gets one entry).
  [[gnu::always_inline]] void finish_free(shard& sh, block* b, std::size_t bytes,
                                         const stream_view* stream) noexcept {
    const std::size_t size = policy_.round_up(bytes);
    const bool size_matches = size <= b->size && b->size - size <= size / 8;
    const bool tracked = policy_.tracks_streams && stream != nullptr;
    detail::stream_record* rec = tracked ? sh.ledger.last_if(stream->get()) : nullptr;
    if (size_matches && policy_.cacheable(b->size, sh.cached.bytes(), sh.used - b->size) &&
        (!tracked || rec)) [[likely]] {
      if (tracked) {
        ++rec->frees;
        b->tag.add(rec, rec->frees);
      }
      sh.used -= b->size;
      sh.cached.push(b);
      sh.mutex.unlock();
      return;
    }
    finish_free_slow(sh, b, bytes, stream);
  }

  [[gnu::noinline]] void finish_free_slow(shard& sh, block* b, std::size_t bytes,
                                          const stream_view* stream) noexcept {
    const detail::lock_guard lock(sh.mutex, detail::adopt_lock);
    sh.free_block(policy_, b, bytes, stream);
  }

  // --- streams, destruction, what it is -----------------------------------------------------

  /// A cudamem::stream is about to be destroyed: settle what the pool owes on it now.
  void on_stream_destroy(cudaStream_t handle) noexcept override {
    try {
      retire_stream(stream_view{handle});
    } catch (const cuda_error& e) {
      report_error(e.code(), "pool_resource: recording an event on a stream being destroyed");
    } catch (...) {
      report_problem("pool_resource: could not settle a stream being destroyed");
    }
  }

  void before_graph_capture() noexcept override {
    try {
      static_cast<void>(cover_frees());
    } catch (const cuda_error& e) {
      report_error(e.code(), "pool_resource: recording events before a graph capture");
    } catch (...) {
      report_problem("pool_resource: could not record events before a graph capture");
    }
  }

  std::string_view do_name() const noexcept override { return "pool_resource"; }
  memory_resource* do_upstream() const noexcept override { return &chunks_.upstream(); }

  resource_stats do_stats() const override {
    resource_stats s;
    for (const auto& sh : shards_) {
      const detail::lock_guard lock(sh->mutex);
      sh->add_stats(s);
    }
    return s;
  }

  pool_options options_;
  detail::pool_policy policy_;
  std::vector<detail::unique_owner<shard>> shards_;
  mutable detail::chunk_set chunks_;  // mutable: upstream() hands out a non-const resource
};

/// Before a stream is captured into a CUDA graph: every pool_resource of the process that
/// tracks streams records an event on each stream whose frees no event covers yet (streams
/// already being captured are left alone), so that during the capture a block freed before it
/// can be ordered after those frees without touching the captured stream. Cheap (an event
/// record per such stream); errors go to the error handler.
inline void prepare_for_graph_capture() noexcept {
  detail::stream_listener_registry::instance().notify_before_graph_capture();
}

}  // namespace cudamem
