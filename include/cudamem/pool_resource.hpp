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
//   counts the blocks' real sizes, so reserved = used + free always holds.
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
//   remembers up to 4 streams, and one freed on more is handed out after a device-wide sync.
//   Frees on cudaStreamPerThread record their event at once (another thread cannot name that
//   stream later).
// - Events are recorded lazily, so the pool remembers the streams it owes an event on. A
//   `cudamem::stream` tells the pool when it is destroyed (the pool settles up then, while
//   the handle is still valid); a raw cudaStream_t you destroy yourself must first be passed
//   to `retire_stream(s)` if pool memory was freed on it.
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
//
// Design, and its limits
// - Front end: a freed block of at most `cache_block_limit` bytes is kept whole in its
//   shard's cache (detail/pool/block_cache.hpp: a stack per size class, 16 classes per power of
//   two), tagged with its stream like any free block, while the shard caches at most
//   `cache_bytes`. A request first looks at the top of its class's stack: a hit costs a
//   lock, a few loads and no heap work, and a block freed on another stream goes through the
//   same event check as any other. Cached blocks count as free in stats() (free_blocks,
//   largest_free_block). They do not merge with their neighbours until flushed. When the heap
//   cannot serve a request, cached blocks go back to it largest first until one merges into a
//   free block that can hold the request (so a miss costs a few cached blocks, not the whole
//   cache); the whole cache is flushed before the pool grows, before chunks are released
//   (release(), the retry after an upstream failure, making room for a small chunk) and
//   before the last look through every shard, so growth, release and out_of_memory behave as
//   without the cache.
// - Each chunk's free blocks live in a TLSF index (detail/pool/tlsf_heap.hpp): O(1) search however
//   many holes, splitting, and immediate merging of address neighbours. Block records are
//   host-side nodes; the pool never reads or writes the memory it manages.
// - Threads: the pool is split into shards (a power of two, by default one per hardware thread
//   up to 16), each with its own lock (a spin lock, detail/spin_lock.hpp: one atomic exchange
//   per operation), cache, chunks, free-block index and map of live blocks. A
//   thread always starts at the same shard (threads are numbered as they first allocate), so
//   16 threads on 16 shards rarely touch each other's cache lines, let alone locks. A block
//   freed by another thread goes back to the shard it came from (found through a directory of
//   chunks). Limits: memory free in one shard serves another only when the upstream is full
//   (the last step before out_of_memory); with several shards `peak_used_bytes` is the sum of
//   the shards' peaks, an upper bound of the true peak.
// - Upstream calls are serialised by one mutex, so the upstream need not be thread-safe.
#pragma once

#include <cudamem/detail/pool/address_map.hpp>
#include <cudamem/detail/pool/block_cache.hpp>
#include <cudamem/detail/spin_lock.hpp>
#include <cudamem/detail/pool/tlsf_heap.hpp>
#include <cudamem/error.hpp>
#include <cudamem/memory_resource.hpp>
#include <cudamem/out_of_memory.hpp>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace cudamem {

/// How a `pool_resource` grows; see the contract above.
struct pool_options {
  std::size_t initial_size = 0;                                    ///< reserved at construction
  std::size_t maximum_size = std::numeric_limits<std::size_t>::max();  ///< most it holds
  std::size_t growth_step = std::size_t{64} << 20;   ///< least a large-tier chunk holds
  /// Largest request of the small tier. 4 MiB, not less: blocks of 1..4 MiB are the typical
  /// long-lived "medium" tensors, and in large-tier chunks they pin the chunks that large
  /// short-lived blocks come and go in (measured on the mixed fragmentation trace over a
  /// paged device: 0.67 of the device usable with a 1 MiB limit, 0.99 with 4 MiB).
  std::size_t small_block_limit = std::size_t{4} << 20;
  std::size_t small_chunk_size = std::size_t{16} << 20;  ///< small-tier chunk size
  unsigned shards = 0;  ///< a power of two; 0: one per hardware thread, at most 16
  /// Largest block kept whole in the front-end cache (rounded up to a size class); 0: no cache.
  std::size_t cache_block_limit = std::size_t{4} << 20;
  /// Most bytes cached per shard. Cached blocks are the shard's free memory, flushed before
  /// the pool grows, so a large bound costs no upstream memory: it bounds how much a full
  /// flush (release(), growth) has to merge. Below a few hundred MiB, traces whose live set is
  /// larger miss the cache more often (random_256B-4MiB: 196 instructions per operation with
  /// 64 MiB, 168 with 1 GiB).
  std::size_t cache_bytes = std::size_t{1} << 30;
};

namespace detail {

/// The calling thread's number, given in order of first use (for picking a shard).
inline std::atomic<unsigned> next_pool_thread_slot{0};
inline thread_local unsigned this_pool_thread_slot = std::numeric_limits<unsigned>::max();

[[nodiscard]] inline unsigned pool_thread_slot() noexcept {
  if (this_pool_thread_slot == std::numeric_limits<unsigned>::max()) [[unlikely]] {
    this_pool_thread_slot = next_pool_thread_slot.fetch_add(1, std::memory_order_relaxed);
  }
  return this_pool_thread_slot;
}

}  // namespace detail

/// A sharded TLSF pool over any upstream resource; see the contract above.
class pool_resource final : public memory_resource, private detail::stream_listener {
 public:
  static constexpr std::size_t granule = 256;

  explicit pool_resource(memory_resource& upstream, pool_options options = {})
      : memory_resource(upstream.kind(), upstream.device()),
        upstream_(&upstream),
        options_(validated(options)),
        tracks_streams_(upstream.kind() != memory_kind::host &&
                        !(upstream.kind() == memory_kind::device && upstream.device() < 0)) {
    if (options_.cache_bytes > 0) {
      cache_limit_ = std::min(options_.cache_block_limit, std::size_t{1} << 50);
    }
    const unsigned count = options_.shards;
    shard_mask_ = count - 1;
    shards_.reserve(count);
    for (unsigned i = 0; i < count; ++i) {
      shards_.push_back(std::make_unique<shard>());
    }
    if (options_.initial_size > 0) {
      const std::size_t size = round_up(options_.initial_size);
      std::string cause;
      if (!obtain_chunk(*shards_[0], large_tier, size, cause)) {
        throw_out_of_memory(*this, options_.initial_size, granule,
                            "pool_resource: initial_size: " + cause);
      }
    }
    if (tracks_streams_) {  // last, so that a constructor that throws leaves no registration
      detail::stream_listener_registry::instance().add(this);
    }
  }

  ~pool_resource() override { destroy(); }

  pool_resource(const pool_resource&) = delete;
  pool_resource& operator=(const pool_resource&) = delete;

  /// Returns every chunk in which nothing is allocated to the upstream. Returns the bytes.
  std::size_t release() noexcept { return release_free_chunks(); }

  /// Records, for every block freed on `s`, that it is done once `s` reaches this point, so
  /// `s` may be destroyed afterwards (see the contract). Throws cuda_error on a CUDA error.
  void retire_stream(stream_view s) {
    if (!tracks_streams_) {
      return;
    }
    for (auto& sh : shards_) {
      const std::lock_guard lock(sh->mutex);
      for (auto& rec : sh->streams) {
        if (!rec->retired && rec->is(s)) {
          if (rec->frees > rec->event_covers) {
            record_event(*rec);
          }
          rec->retired = true;
          sh->last_record = nullptr;
        }
      }
    }
  }

  [[nodiscard]] const pool_options& options() const noexcept { return options_; }
  [[nodiscard]] std::size_t shard_count() const noexcept { return shards_.size(); }
  /// Number of chunks held from the upstream.
  [[nodiscard]] std::size_t chunk_count() const {
    const std::shared_lock lock(directory_mutex_);
    return directory_.size();
  }

 private:
  // --- stream bookkeeping -------------------------------------------------------------------

  /// One stream frees were made on (per shard). `frees` counts them; a block freed on the
  /// stream remembers the count, and is safe for other streams once an event recorded after
  /// that free has completed.
  struct stream_record {
    cudaStream_t handle = nullptr;
    std::thread::id thread;           ///< the owner, for cudaStreamPerThread only
    std::uint64_t frees = 0;          ///< frees made on this stream so far
    cudaEvent_t event = nullptr;      ///< created when first needed
    std::uint64_t event_covers = 0;   ///< frees before the last record of `event`
    std::uint64_t done = 0;           ///< frees known complete
    bool retired = false;

    [[nodiscard]] bool is(stream_view s) const noexcept {
      return s.get() == handle &&
             (handle != cudaStreamPerThread || thread == std::this_thread::get_id());
    }
  };

  /// Per free block: the frees it is made of that may still be pending, by stream. The count
  /// and the first entry come first: with the block's own fields they share one cache line.
  struct pending_frees {
    static constexpr std::size_t capacity = 4;
    struct entry {
      stream_record* stream;
      std::uint64_t free_count;  ///< rec->frees just after the last free on it in this block
    };
    std::uint8_t count = 0;
    bool overflow = false;  ///< more streams than fit: hand out only after a device sync
    std::array<entry, capacity> entries{};

    void absorb(const pending_frees& other) noexcept {
      overflow = overflow || other.overflow;
      for (std::size_t i = 0; i < other.count; ++i) {
        add(other.entries[i].stream, other.entries[i].free_count);
      }
    }
    void add(stream_record* rec, std::uint64_t n) noexcept {
      for (std::size_t j = 0; j < count; ++j) {
        if (entries[j].stream == rec) {
          entries[j].free_count = std::max(entries[j].free_count, n);
          return;
        }
      }
      if (count == capacity) {
        overflow = true;
        return;
      }
      entries[count] = {rec, n};
      ++count;
    }
    [[nodiscard]] bool empty() const noexcept { return count == 0 && !overflow; }
    void clear() noexcept {  // the arrays past `count` are never read
      count = 0;
      overflow = false;
    }
    /// True when the only pending frees were made on `stream` (not retired): stream order
    /// alone separates them from a request on it (the common case, checked inline).
    [[nodiscard]] bool only_on(const stream_view* s) const noexcept {
      return count == 1 && !overflow && s != nullptr && entries[0].stream->is(*s) &&
             !entries[0].stream->retired;
    }
  };

  using heap = detail::tlsf_heap<pending_frees>;
  using block = heap::block;
  using cache = detail::block_cache<block>;

  enum tier : std::uint32_t { small_tier = 0, large_tier = 1 };

  struct alignas(64) shard {
    detail::spin_lock mutex;  ///< held for a few dozen instructions, except around CUDA calls
    heap tiers[2] = {heap{granule}, heap{granule}};
    detail::address_map<block> live;  ///< address -> block, for blocks handed out or cached
    cache cached{granule};            ///< freed blocks kept whole (still in `live`)
    std::size_t used = 0;
    std::size_t peak = 0;
    std::vector<std::unique_ptr<stream_record>> streams;
    stream_record* last_record = nullptr;
  };

  struct chunk_entry {
    std::size_t size;
    shard* owner;
  };

  // --- options ------------------------------------------------------------------------------

  static pool_options validated(pool_options o) {
    auto fail = [](const std::string& what) {
      throw std::invalid_argument("cudamem::pool_resource: " + what);
    };
    if (o.shards == 0) {
      const unsigned hw = std::max(1U, std::thread::hardware_concurrency());
      o.shards = std::min(16U, std::bit_floor(hw));
    }
    if (!std::has_single_bit(o.shards) || o.shards > 256) {
      fail("shards must be a power of two up to 256, not " + std::to_string(o.shards));
    }
    if (o.growth_step == 0 || o.small_chunk_size == 0) {
      fail("growth_step and small_chunk_size must be positive");
    }
    if (o.small_block_limit > o.small_chunk_size) {
      fail("small_block_limit (" + std::to_string(o.small_block_limit) +
           ") must not exceed small_chunk_size (" + std::to_string(o.small_chunk_size) + ")");
    }
    if (o.initial_size > o.maximum_size) {
      fail("initial_size exceeds maximum_size");
    }
    return o;
  }

  [[nodiscard]] static std::size_t round_up(std::size_t bytes) noexcept {
    return bytes > std::numeric_limits<std::size_t>::max() - (granule - 1)
               ? 0
               : (bytes + granule - 1) & ~(granule - 1);
  }

  // --- allocate -----------------------------------------------------------------------------

  void* do_allocate(std::size_t bytes, std::size_t alignment, stream_view stream) override {
    return allocate_block(bytes, alignment, &stream);
  }
  void* do_allocate_sync(std::size_t bytes, std::size_t alignment) override {
    return allocate_block(bytes, alignment, nullptr);
  }

  /// `stream` null: the synchronous form (ready for everyone on return).
  /// The fast path, inline: a cache hit whose block is free of pending frees on other streams
  /// (the common case) costs a lock, a pop and a few stores. Everything else is in functions
  /// of its own, kept out of line so that this one needs few registers and no stack frame.
  void* allocate_block(std::size_t bytes, std::size_t alignment, const stream_view* stream) {
    const std::size_t padding = alignment > granule ? alignment - granule : 0;
    const std::size_t size = round_up(bytes);
    if (size == 0 || size > options_.maximum_size || padding > options_.maximum_size - size)
        [[unlikely]] {
      throw_too_large(bytes, alignment);
    }
    shard& home = *shards_[detail::pool_thread_slot() & shard_mask_];
    home.mutex.lock();
    if (size <= cache_limit_) {
      if (block* b = home.cached.pop(size, alignment - 1)) {
        if (b->tag.empty() || b->tag.only_on(stream)) [[likely]] {
          b->tag.clear();
          home.used += b->size;
          home.peak = std::max(home.peak, home.used);
          home.mutex.unlock();
          return reinterpret_cast<void*>(b->address);
        }
        return hand_out_cached(home, b, stream);
      }
    }
    return allocate_uncached(home, bytes, size, alignment, stream);
  }

  [[noreturn, gnu::noinline]] void throw_too_large(std::size_t bytes, std::size_t alignment) const {
    throw_out_of_memory(*this, bytes, alignment,
                        "pool_resource: larger than the pool's maximum size (" +
                            format_bytes(options_.maximum_size) + ")");
  }

  /// A request the cache could not serve: from sh's heap, else after flushing the cache, else
  /// from the upstream. Called with home's lock held; releases it.
  [[gnu::noinline]] void* allocate_uncached(shard& home, std::size_t bytes, std::size_t size,
                                            std::size_t alignment, const stream_view* stream) {
    const tier t = size <= options_.small_block_limit ? small_tier : large_tier;
    {
      const std::lock_guard lock(home.mutex, std::adopt_lock);
      if (void* p = take(home, t, size, alignment, stream)) {
        return p;
      }
      // Cached blocks may merge into room for it. Flush them, largest first, only until one
      // merges into a free block of this tier that can hold the request: a miss then costs
      // a few blocks of the cache, not all of it. The whole cache goes before the pool grows.
      const std::size_t needed = size + (alignment > granule ? alignment - granule : 0);
      while (home.cached.count() != 0) {
        home.cached.drain_until([&](block* c) {
          home.live.erase(c->address);
          const block* merged = home.tiers[c->region->owner].free(c);
          return merged->region->owner == t && merged->size >= needed;
        });
        if (void* p = take(home, t, size, alignment, stream)) {
          return p;
        }
      }
    }
    return grow_and_allocate(home, t, bytes, size, alignment, stream);
  }

  /// Hands out block `b` just popped from sh's cache (still in sh.live) whose pending frees
  /// need an event check. Called with sh's lock held; releases it.
  [[gnu::noinline]] void* hand_out_cached(shard& sh, block* b, const stream_view* stream) {
    const std::lock_guard lock(sh.mutex, std::adopt_lock);
    try {
      make_ready(sh, *b, stream);
    } catch (...) {
      sh.cached.push(b);
      throw;
    }
    sh.used += b->size;
    sh.peak = std::max(sh.peak, sh.used);
    return reinterpret_cast<void*>(b->address);
  }

  /// Returns every block of sh's cache to its heap, where it merges with its neighbours.
  /// Caller holds sh's lock.
  static void flush_cache(shard& sh) noexcept {
    sh.cached.drain([&sh](block* b) {
      sh.live.erase(b->address);
      sh.tiers[b->region->owner].free(b);
    });
  }

  /// A block of `size` bytes (rounded to the granule) from `sh`'s tier `t`, made ready for
  /// `stream`, or nullptr. Caller holds the lock.
  /// `any_block`: also cut a free block much larger than the request (see oversize_limit).
  void* take(shard& sh, tier t, std::size_t size, std::size_t alignment,
             const stream_view* stream, bool any_block = false) {
    sh.live.reserve_one();  // the only step that can fail for want of host memory: do it first
    block* b = sh.tiers[t].allocate(size, alignment,
                                    any_block ? std::numeric_limits<std::size_t>::max()
                                              : oversize_limit(size));
    if (b == nullptr) {
      return nullptr;
    }
    if (!b->tag.empty()) {
      try {
        if (b->tag.only_on(stream)) {
          b->tag.clear();
        } else {
          make_ready(sh, *b, stream);
        }
      } catch (...) {
        sh.tiers[t].free(b);
        throw;
      }
    }
    sh.live.insert(b->address, b);
    sh.used += b->size;
    sh.peak = std::max(sh.peak, sh.used);
    return reinterpret_cast<void*>(b->address);
  }

  /// The largest free block a request may cut. Requests of at least `growth_step` (the ones
  /// that get chunks of their own) and of `initial_size` do not cut a free block more than 1.25 times their size
  /// while the upstream can still supply: the rest of the block would stay pinned as long as
  /// the request lives, and large blocks come and go. (PyTorch's allocator has the same rule:
  /// max_split_size.) Once the upstream is out, any block will do.
  [[nodiscard]] std::size_t oversize_limit(std::size_t bytes) const noexcept {
    if (bytes < options_.growth_step || bytes < options_.initial_size) {
      return std::numeric_limits<std::size_t>::max();
    }
    const std::size_t size = round_up(bytes);
    return size + size / 4;
  }

  /// The slow path: more memory from the upstream, or from elsewhere in the pool.
  /// `bytes` as asked (for the report), `size` rounded to the granule.
  void* grow_and_allocate(shard& home, tier t, std::size_t bytes, std::size_t size,
                          std::size_t alignment, const stream_view* stream) {
    const std::size_t padding = alignment > granule ? alignment - granule : 0;
    const std::size_t needed = size + padding;
    const std::size_t preferred =
        std::max(needed, t == small_tier ? round_up(options_.small_chunk_size)
                                         : round_up(options_.growth_step));
    std::string cause;
    for (int attempt = 0; attempt < 3; ++attempt) {
      if (attempt == 1 && preferred == needed) {
        continue;  // the same request again would fail the same way
      }
      if (attempt == 2 && release_free_chunks() == 0) {
        break;
      }
      const std::size_t chunk = attempt == 0 ? preferred : needed;
      if (attempt == 0 && t == small_tier) {
        // Make room where cached large chunks are, rather than beside them: a new small chunk
        // then lands where a first-fit upstream would put it, and cached large chunks do not
        // push small ones out between future large blocks. (Cheap when there are none.)
        release_free_chunks(&home, large_tier);
      }
      const std::lock_guard lock(home.mutex);
      if (obtain_chunk(home, t, chunk, cause)) {
        if (void* p = take(home, t, size, alignment, stream)) {
          return p;
        }
      }
    }
    // The upstream is out: any free block anywhere in the pool will do.
    for (std::size_t i = 0; i < shards_.size(); ++i) {
      shard& sh = *shards_[(detail::pool_thread_slot() + i) & shard_mask_];
      const std::lock_guard lock(sh.mutex);
      flush_cache(sh);
      for (tier other : {t, t == small_tier ? large_tier : small_tier}) {
        if (void* p = take(sh, other, size, alignment, stream, true)) {
          return p;
        }
      }
    }
    throw_out_of_memory(*this, bytes, alignment, "pool_resource: " + cause);
  }

  /// Adds a chunk of `size` bytes from the upstream to `sh`'s tier `t` (caller holds sh's
  /// lock). False, with `cause` set, when the upstream or the maximum size says no.
  bool obtain_chunk(shard& sh, tier t, std::size_t size, std::string& cause) {
    const std::lock_guard upstream_lock(upstream_mutex_);
    if (size > options_.maximum_size - reserved_) {
      cause = "the pool's maximum size (" + format_bytes(options_.maximum_size) +
              ") would be exceeded";
      return false;
    }
    void* p = nullptr;
    try {
      p = upstream_->allocate(size, granule);
    } catch (const out_of_memory&) {
      cause = "upstream " + std::string(upstream_->name()) + " could not supply " +
              format_bytes(size);
      return false;
    }
    try {
      const auto base = reinterpret_cast<std::uintptr_t>(p);
      {
        const std::unique_lock lock(directory_mutex_);
        directory_.emplace(base, chunk_entry{size, &sh});
      }
      try {
        sh.tiers[t].add_region(base, size, t);
      } catch (...) {
        const std::unique_lock lock(directory_mutex_);
        directory_.erase(base);
        throw;
      }
    } catch (...) {
      upstream_->deallocate(p, size, granule);
      throw;
    }
    reserved_ += size;
    return true;
  }

  /// Makes block `b` (tag not empty) safe to hand out on `stream` (null: to everyone).
  void make_ready(shard& sh, block& b, const stream_view* stream) {
    pending_frees& pending = b.tag;
    if (pending.overflow) {
      synchronize_device();
      pending.clear();
      return;
    }
    for (std::size_t i = 0; i < pending.count; ++i) {
      stream_record& rec = *pending.entries[i].stream;
      const std::uint64_t n = pending.entries[i].free_count;
      if (n <= rec.done || (stream != nullptr && rec.is(*stream) && !rec.retired)) {
        continue;  // complete, or ordered before this request by the stream itself
      }
      if (rec.event_covers < n) {
        record_event(rec);
      }
      if (stream == nullptr) {
        check(cudaEventSynchronize(rec.event), "pool_resource: cudaEventSynchronize");
        rec.done = std::max(rec.done, rec.event_covers);
        continue;
      }
      const cudaError_t state = cudaEventQuery(rec.event);
      if (state == cudaSuccess) {
        rec.done = std::max(rec.done, rec.event_covers);
      } else if (state == cudaErrorNotReady) {
        static_cast<void>(cudaGetLastError());
        check(cudaStreamWaitEvent(stream->get(), rec.event, 0),
              "pool_resource: cudaStreamWaitEvent before cross-stream reuse");
      } else {
        check(state, "pool_resource: cudaEventQuery");
      }
    }
    (void)sh;
    pending.clear();
  }

  /// Records rec's event on its stream now, covering every free made on it so far.
  void record_event(stream_record& rec) {
    if (rec.event == nullptr) {
      int device = 0;
      check(cudaStreamGetDevice(rec.handle, &device), "pool_resource: cudaStreamGetDevice");
      int previous = 0;
      check(cudaGetDevice(&previous), "pool_resource: cudaGetDevice");
      if (previous != device) {
        check(cudaSetDevice(device), "pool_resource: cudaSetDevice");
      }
      const cudaError_t code = cudaEventCreateWithFlags(&rec.event, cudaEventDisableTiming);
      if (previous != device) {
        static_cast<void>(cudaSetDevice(previous));
      }
      check(code, "pool_resource: cudaEventCreateWithFlags");
    }
    check(cudaEventRecord(rec.event, rec.handle), "pool_resource: cudaEventRecord");
    rec.event_covers = rec.frees;
  }

  void synchronize_device() {
    int previous = 0;
    check(cudaGetDevice(&previous), "pool_resource: cudaGetDevice");
    const int device = this->device() >= 0 ? this->device() : previous;
    if (previous != device) {
      check(cudaSetDevice(device), "pool_resource: cudaSetDevice");
    }
    const cudaError_t code = cudaDeviceSynchronize();
    if (previous != device) {
      static_cast<void>(cudaSetDevice(previous));
    }
    check(code, "pool_resource: cudaDeviceSynchronize");
  }

  // --- deallocate ---------------------------------------------------------------------------

  void do_deallocate(void* p, std::size_t bytes, std::size_t /*alignment*/,
                     stream_view stream) noexcept override {
    free_block(p, bytes, &stream);
  }
  void do_deallocate_sync(void* p, std::size_t bytes, std::size_t /*alignment*/) noexcept override {
    free_block(p, bytes, nullptr);
  }

  /// The fast path, inline like allocate_block's: a block of this thread's shard, freed with
  /// its own size on the stream the shard saw last, into a cache with room.
  void free_block(void* p, std::size_t bytes, const stream_view* stream) noexcept {
    const auto address = reinterpret_cast<std::uintptr_t>(p);
    shard& home = *shards_[detail::pool_thread_slot() & shard_mask_];
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
    shard* owner = nullptr;
    {
      const std::shared_lock lock(directory_mutex_);
      auto it = directory_.upper_bound(address);
      if (it != directory_.begin()) {
        --it;
        if (address < it->first + it->second.size) {
          owner = it->second.owner;
        }
      }
    }
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
  void finish_free(shard& sh, block* b, std::size_t bytes, const stream_view* stream) noexcept {
    const std::size_t size = round_up(bytes);
    const bool size_matches = size <= b->size && b->size - size <= size / 8;
    const bool cacheable =
        b->size <= cache_limit_ && sh.cached.bytes() + b->size <= options_.cache_bytes;
    const bool tracked = tracks_streams_ && stream != nullptr;
    stream_record* rec = sh.last_record;
    const bool known_stream = !tracked || (rec != nullptr && rec->handle == stream->get() &&
                                           rec->handle != cudaStreamPerThread && !rec->retired);
    if (size_matches && cacheable && known_stream) [[likely]] {
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

  /// finish_free's general case: a size mismatch, a full cache, another stream. Called with
  /// sh's lock held; releases it.
  [[gnu::noinline]] void finish_free_slow(shard& sh, block* b, std::size_t bytes,
                                          const stream_view* stream) noexcept {
    const std::lock_guard lock(sh.mutex, std::adopt_lock);
    const std::size_t size = round_up(bytes);
    if (size > b->size || b->size - size > size / 8) {  // from the cache: up to 1/8 larger
      report_problem("pool_resource: deallocate with a size that does not match the allocation; "
                     "the allocation's own size is freed");
    }
    sh.used -= b->size;
    if (tracks_streams_ && stream != nullptr) {
      note_stream_free(sh, *b, *stream);
    }
    if (b->size <= cache_limit_ && sh.cached.bytes() + b->size <= options_.cache_bytes) {
      sh.cached.push(b);
      return;
    }
    sh.live.erase(b->address);
    sh.tiers[b->region->owner].free(b);
  }

  /// Tags `b` as freed on `s`. On any failure, waits for `s` instead (then nothing is pending).
  void note_stream_free(shard& sh, block& b, stream_view s) noexcept {
    try {
      stream_record* rec = sh.last_record;
      if (rec == nullptr || !rec->is(s) || rec->retired) {
        rec = nullptr;
        for (auto& r : sh.streams) {
          if (!r->retired && r->is(s)) {
            rec = r.get();
            break;
          }
        }
        if (rec == nullptr) {
          auto fresh = std::make_unique<stream_record>();
          fresh->handle = s.get();
          fresh->thread = std::this_thread::get_id();
          sh.streams.push_back(std::move(fresh));
          rec = sh.streams.back().get();
        }
        sh.last_record = rec;
      }
      ++rec->frees;
      if (rec->handle == cudaStreamPerThread) {
        record_event(*rec);  // no other thread can name this stream later
      }
      b.tag.add(rec, rec->frees);
    } catch (...) {
      report_error(cudaStreamSynchronize(s.get()),
                   "pool_resource: waiting for the stream after failing to track a free");
    }
  }

  // --- release and destruction --------------------------------------------------------------

  struct returned_chunk {
    std::uintptr_t base;
    std::size_t size;
    bool pending;
  };

  /// Returns the wholly free chunks (of shard `only` and tier `only_tier`, when given).
  std::size_t release_free_chunks(const shard* only = nullptr, int only_tier = -1) noexcept {
    std::vector<returned_chunk> chunks;
    try {
      for (auto& sh : shards_) {
        if (only != nullptr && sh.get() != only) {
          continue;
        }
        const std::lock_guard lock(sh->mutex);
        flush_cache(*sh);  // cached blocks may be all that keeps a chunk from being wholly free
        for (heap& h : sh->tiers) {
          if (only_tier >= 0 && &h != &sh->tiers[only_tier]) {
            continue;
          }
          while (auto* r = h.first_idle_region()) {
            if (chunks.size() == chunks.capacity()) {  // geometric growth: many chunks at once
              chunks.reserve(2 * chunks.size() + 16);   // may throw: the region is still held
            }
            chunks.push_back({r->base, r->size, !r->first->tag.empty()});
            h.remove_region(r);
          }
        }
      }
    } catch (...) {  // out of host memory: return what was collected
    }
    return return_chunks(chunks);
  }

  std::size_t return_chunks(const std::vector<returned_chunk>& chunks) noexcept {
    std::size_t total = 0;
    const bool any_pending =
        std::any_of(chunks.begin(), chunks.end(), [](const returned_chunk& c) { return c.pending; });
    if (any_pending) {
      try {
        synchronize_device();
      } catch (const cuda_error& e) {
        report_error(e.code(), "pool_resource: synchronising before returning memory");
      }
    }
    const std::lock_guard upstream_lock(upstream_mutex_);
    for (const returned_chunk& c : chunks) {
      upstream_->deallocate(reinterpret_cast<void*>(c.base), c.size, granule);
      reserved_ -= c.size;
      total += c.size;
      const std::unique_lock lock(directory_mutex_);
      directory_.erase(c.base);
    }
    return total;
  }

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

  void destroy() noexcept {
    if (tracks_streams_) {
      detail::stream_listener_registry::instance().remove(this);
    }
    std::size_t leaked_blocks = 0;
    std::size_t leaked_bytes = 0;
    bool pending = false;
    for (auto& sh : shards_) {
      leaked_blocks += sh->live.size() - sh->cached.count();
      leaked_bytes += sh->used;
      for (auto& rec : sh->streams) {
        pending = pending || rec->frees > rec->done;
      }
    }
    if (leaked_blocks != 0) {
      report_problem("pool_resource destroyed with " + std::to_string(leaked_blocks) +
                     " block(s) (" + format_bytes(leaked_bytes) +
                     ") still allocated; their memory is returned to the upstream");
    }
    if (pending || leaked_blocks != 0) {
      if (tracks_streams_) {
        try {
          synchronize_device();
        } catch (const cuda_error& e) {
          report_error(e.code(), "pool_resource: synchronising before returning memory");
        }
      }
    }
    const std::lock_guard upstream_lock(upstream_mutex_);
    for (const auto& [base, entry] : directory_) {
      upstream_->deallocate(reinterpret_cast<void*>(base), entry.size, granule);
    }
    for (auto& sh : shards_) {
      for (auto& rec : sh->streams) {
        if (rec->event != nullptr) {
          report_error(cudaEventDestroy(rec->event), "pool_resource: cudaEventDestroy");
        }
      }
    }
  }

  // --- what it is ---------------------------------------------------------------------------

  std::string_view do_name() const noexcept override { return "pool_resource"; }
  memory_resource* do_upstream() const noexcept override { return upstream_; }

  resource_stats do_stats() const override {
    resource_stats s;
    std::size_t free_blocks = 0;
    std::size_t largest = 0;
    for (const auto& sh : shards_) {
      const std::lock_guard lock(sh->mutex);
      for (const heap& h : sh->tiers) {
        s.reserved_bytes += h.total_bytes();
        free_blocks += h.free_block_count();
        largest = std::max(largest, h.largest_free_block());
      }
      // Cached blocks are free blocks too (a request that needs them flushes the cache).
      free_blocks += sh->cached.count();
      largest = std::max(largest, sh->cached.largest());
      s.used_bytes += sh->used;
      s.peak_used_bytes += sh->peak;
    }
    s.free_blocks = free_blocks;
    s.largest_free_block = largest;
    return s;
  }

  memory_resource* upstream_;
  pool_options options_;
  bool tracks_streams_;
  std::size_t cache_limit_ = 0;  ///< largest cached block (a class size); 0: no cache
  unsigned shard_mask_ = 0;
  std::vector<std::unique_ptr<shard>> shards_;
  std::mutex upstream_mutex_;
  std::size_t reserved_ = 0;  ///< held from the upstream (guarded by upstream_mutex_)
  mutable std::shared_mutex directory_mutex_;
  std::map<std::uintptr_t, chunk_entry> directory_;  ///< chunk base -> size and shard
};

}  // namespace cudamem
