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
// - detail/pool/pool_core.hpp       the pool's state and its allocate and free paths; this
//                                   header declares the class, and includes that one unless
//                                   the program links cudamem::compiled (detail/compiled.hpp)
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

#include <cudamem/detail/compiled.hpp>
#include <cudamem/detail/pool/pool_options.hpp>  // pool_options, pool_stream_stats
#include <cudamem/memory_resource.hpp>
#include <cudamem/stream.hpp>

#include <cstddef>
#include <cstdint>
#include <string_view>
#include <utility>
#include <vector>

namespace cudamem {

namespace detail {
class pool_core;
}  // namespace detail

/// A sharded TLSF pool over any upstream resource; see the contract above.
class pool_resource final : public memory_resource, private detail::stream_listener {
 public:
  /// Every block is a multiple of this many bytes, and aligned to it.
  static constexpr std::size_t granule = detail::pool_granule;

  /// A pool over `upstream` (referred to, not owned). Throws std::invalid_argument for bad options,
  /// `out_of_memory` when `options.initial_size` cannot be had.
  explicit pool_resource(memory_resource& upstream, pool_options options = {});
  ~pool_resource() override;

  pool_resource(const pool_resource&) = delete;
  pool_resource& operator=(const pool_resource&) = delete;

  /// Returns every chunk in which nothing is allocated to the upstream. Returns the bytes.
  std::size_t release() noexcept;

  /// Records, for every block freed on `s`, that it is done once `s` reaches this point, so
  /// `s` may be destroyed afterwards (see the contract). Throws cuda_error on a CUDA error.
  void retire_stream(stream_view s);

  /// Records an event on every stream this pool's frees were made on that no event covers
  /// yet (streams being captured now excepted), so that a request can later be ordered after
  /// those frees without recording on their streams, which a capture forbids. Returns how
  /// many events it recorded. prepare_for_graph_capture() does it for every pool. Throws
  /// cuda_error on a CUDA error.
  std::size_t cover_frees();

  /// What the pool did to keep stream order (see the contract). Takes each shard's lock once:
  /// not for hot loops.
  [[nodiscard]] pool_stream_stats stream_stats() const;

  /// The options, as validated.
  [[nodiscard]] const pool_options& options() const noexcept;
  /// The number of shards (each a lock and its heaps).
  [[nodiscard]] std::size_t shard_count() const noexcept;
  /// Number of chunks held from the upstream.
  [[nodiscard]] std::size_t chunk_count() const;
  /// The most held from the upstream since construction or reset_peak_reserved().
  [[nodiscard]] std::size_t peak_reserved_bytes();
  /// Starts peak_reserved_bytes() again from what is held now.
  void reset_peak_reserved();
  /// The chunks held from the upstream, as (base, size) by address (a snapshot's segments).
  [[nodiscard]] std::vector<std::pair<std::uintptr_t, std::size_t>> chunk_ranges() const;

 private:
  void* do_allocate(std::size_t bytes, std::size_t alignment, stream_view stream) override;
  void* do_allocate_sync(std::size_t bytes, std::size_t alignment) override;
  void do_deallocate(void* p, std::size_t bytes, std::size_t alignment,
                     stream_view stream) noexcept override;
  void do_deallocate_sync(void* p, std::size_t bytes, std::size_t alignment) noexcept override;

  /// A cudamem::stream is about to be destroyed: settle what the pool owes on it now.
  void on_stream_destroy(cudaStream_t handle) noexcept override;
  void before_graph_capture() noexcept override;

  std::string_view do_name() const noexcept override { return "pool_resource"; }
  memory_resource* do_upstream() const noexcept override;
  resource_stats do_stats() const override;

  detail::pool_core& core() noexcept;
  const detail::pool_core& core() const noexcept;

  // The state (detail::pool_core) lives here, in place: no allocation and no pointer to follow
  // on a call. pool_core.hpp checks that it fits.
  static constexpr std::size_t core_bytes = 384;
  alignas(8) unsigned char core_[core_bytes];
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

#if CUDAMEM_DEFINITIONS_IN_HEADERS
#include <cudamem/detail/pool/pool_core.hpp>
#endif
