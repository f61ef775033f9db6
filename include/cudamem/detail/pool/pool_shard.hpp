// cudamem/detail/pool/pool_shard.hpp — one shard of pool_resource: the memory one thread
// (usually) allocates from, behind one lock.
//
//   pool_shard& home = *shards[pool_thread_slot() & mask];
//   home.mutex.lock();
//   void* p = home.take(policy, small_tier, size, alignment, &stream);   // or nullptr
//   ...
//   home.free_block(policy, b, bytes, &stream);                          // under the lock
//   home.mutex.unlock();
//
// What it owns. The pool is split into shards (a power of two, by default one per hardware
// thread up to 16) so that threads rarely touch each other's cache lines, let alone locks. A
// thread always starts at the same shard (threads are numbered as they first allocate). A
// shard has
// - a lock (detail/spin_lock.hpp: one atomic exchange per operation), held for a few dozen
//   instructions except around CUDA calls;
// - two TLSF heaps (detail/pool/tlsf_heap.hpp), one per tier: blocks up to the small-block
//   limit come from small chunks, larger ones from large chunks, so that long-lived small
//   blocks cannot pin the chunks large blocks come and go in. O(1) search however many holes,
//   splitting, and immediate merging of address neighbours. Block records are host-side nodes:
//   the pool never reads or writes the memory it manages;
// - the front-end cache (detail/pool/block_cache.hpp): freed blocks up to `cache_limit` kept
//   whole, at most `cache_bytes` of them, tagged with their stream like any free block. A hit
//   costs a lock, a few loads and no heap work. Cached blocks count as free; they merge with
//   their neighbours only when flushed (with pool_options::cache_follows_use, also at a free
//   that finds more cached than in use);
// - the map from address to block of everything handed out or cached (the double-free check);
// - bytes in use and their peak;
// - its stream ledger (detail/pool/stream_ledger.hpp).
// Chunks, and which shard each belongs to, are the chunk set's (detail/pool/chunk_set.hpp).
//
// Which free block a request gets, when streams are tracked. The cache's pick (the
// top of a size class's stack: the block freed last) and the heap's (TLSF's good fit) do not
// look at streams. In a program that runs stream-steps on several streams in turn, the block
// freed last was nearly always freed by the stream that ran just before, so every request
// then made its stream wait for that stream's whole stream-step: the streams ran one after
// another. So when the first pick needs a wait, the shard looks a little further — a few
// blocks deeper in the same stacks, a few blocks of a few more size classes of the heap, never
// a block more than twice the request (or than the first pick) — for one that needs none:
// freed on the requesting stream, known complete, or covered by a wait the stream already
// made. Only when none is found does the first pick go out, with its wait. Nothing changes
// where streams are not tracked (host and simulated memory), nor when the first pick needs no
// wait, so single-stream programs and the fragmentation figures place blocks as before.
//
// Every member function is called with `mutex` held, and leaves it held.
#pragma once

#include <cudamem/detail/nvtx.hpp>
#include <cudamem/detail/pool/address_map.hpp>
#include <cudamem/detail/pool/block_cache.hpp>
#include <cudamem/detail/pool/pool_options.hpp>
#include <cudamem/detail/pool/stream_events.hpp>
#include <cudamem/detail/pool/stream_ledger.hpp>
#include <cudamem/detail/pool/tlsf_heap.hpp>
#include <cudamem/detail/spin_lock.hpp>
#include <cudamem/detail/sync/atomic.hpp>
#include <cudamem/detail/sync/thread.hpp>
#include <cudamem/detail/unique_owner.hpp>
#include <cudamem/error.hpp>
#include <cudamem/memory_resource.hpp>
#include <cudamem/stream.hpp>

#include <algorithm>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <new>
#include <stdexcept>
#include <string>
#include <vector>

namespace cudamem::detail {

/// The calling thread's number, given in order of first use (for picking a shard).
inline detail::atomic<unsigned> next_pool_thread_slot{0};
inline thread_local unsigned this_pool_thread_slot = std::numeric_limits<unsigned>::max();

[[nodiscard]] inline unsigned pool_thread_slot() noexcept {
  if (this_pool_thread_slot == std::numeric_limits<unsigned>::max()) [[unlikely]] {
    this_pool_thread_slot = next_pool_thread_slot.fetch_add(1, detail::memory_order_relaxed);
  }
  return this_pool_thread_slot;
}

using pool_heap = tlsf_heap<pending_frees>;
using pool_block = pool_heap::block;

enum pool_tier : std::uint32_t { small_tier = 0, large_tier = 1 };

/// What the shards' operations need of the pool's options, fixed at construction.
struct pool_policy {
  static constexpr std::size_t granule = pool_granule;
  std::size_t initial_size = 0;
  std::size_t maximum_size = 0;
  std::size_t growth_step = 0;
  std::size_t small_block_limit = 0;
  std::size_t small_chunk_size = 0;
  std::size_t cache_limit = 0;  ///< largest cached block (a class size); 0: no cache
  std::size_t cache_bytes = 0;  ///< most bytes one shard caches
  /// How many bytes more than the shard has in use its cache may hold before a free flushes
  /// it (pool_options::cache_follows_use: 0; else more than any shard can hold: never).
  std::size_t cache_over_use = 0;
  bool tracks_streams = false;  ///< false: host or simulated memory, streams are ignored
  bool annotates = false;       ///< chunks and blocks are told to an NVTX tool (detail/nvtx.hpp)
  int device = -1;              ///< for device-wide synchronisation
  /// The stream-order calls (detail/pool/stream_events.hpp): CUDA's, or a test's model.
  stream_event_driver* events = nullptr;
  /// Look for a block that needs no wait before waiting; remember waits (both on but where a
  /// benchmark measures the pool as it was before: detail::scoped_pool_stream_choices).
  bool prefers_ready = true;
  bool remembers_waits = true;
  /// How far a request whose first pick needs a wait looks for a block that needs none (see
  /// the header comment): blocks per cache stack, heap size classes, blocks per class.
  static constexpr unsigned ready_cache_depth = 8;
  static constexpr unsigned ready_heap_classes = 8;
  static constexpr unsigned ready_heap_depth = 4;
  /// stream_reuse::when_complete: reuse only what needs no wait, else grow (see pool_options).
  bool reuse_when_complete = false;
  /// ...and look further for it, since the alternative is more memory.
  static constexpr unsigned complete_heap_classes = 64;
  static constexpr unsigned complete_heap_depth = 8;

  /// The policy of a pool with options `o` (a validated pool_options) over `upstream`.
  template <class Options>
  [[nodiscard]] static pool_policy from(const Options& o, const memory_resource& upstream) noexcept {
    pool_policy p;
    p.initial_size = o.initial_size;
    p.maximum_size = o.maximum_size;
    p.growth_step = o.growth_step;
    p.small_block_limit = o.small_block_limit;
    p.small_chunk_size = o.small_chunk_size;
    p.cache_limit = o.cache_bytes > 0 ? std::min(o.cache_block_limit, std::size_t{1} << 50) : 0;
    p.cache_bytes = o.cache_bytes;
    p.cache_over_use = o.cache_follows_use ? 0 : std::numeric_limits<std::size_t>::max() / 2;
    // A test or simulation may have installed a model of the device's stream calls: then
    // streams are tracked over any memory (scoped_pool_stream_events).
    stream_event_driver* model = pool_stream_events_override.load();
    p.events = model != nullptr ? model : &cuda_stream_events();
    p.tracks_streams = model != nullptr ||
                       (upstream.kind() != memory_kind::host &&
                        !(upstream.kind() == memory_kind::device && upstream.device() < 0));
    p.device = upstream.device();
    p.reuse_when_complete = o.stream_reuse == decltype(o.stream_reuse)::when_complete;
    const pool_stream_choices choices = current_pool_stream_choices();
    p.prefers_ready = choices.prefer_ready;
    p.remembers_waits = choices.remember_waits;
    p.annotates = annotates_sub_allocations(
        upstream.kind() == memory_kind::device && upstream.device() >= 0,
        upstream.allows_nvtx_heaps());
    return p;
  }

  /// `bytes` rounded up to the granule; 0 when that overflows.
  [[nodiscard]] static std::size_t round_up(std::size_t bytes) noexcept {
    return bytes > std::numeric_limits<std::size_t>::max() - (granule - 1)
               ? 0
               : (bytes + granule - 1) & ~(granule - 1);
  }

  [[nodiscard]] pool_tier tier_of(std::size_t size) const noexcept {
    return size <= small_block_limit ? small_tier : large_tier;
  }

  /// Whether a free block of `size` bytes goes straight to a cache that holds `cached` bytes,
  /// in a shard left with `in_use` bytes handed out (the cache may have to be flushed first:
  /// `cache_outgrew`).
  [[nodiscard]] bool cacheable(std::size_t size, std::size_t cached,
                               std::size_t in_use) const noexcept {
    return size <= cache_limit && cached + size <= cache_bytes &&
           cached <= in_use + cache_over_use;
  }
  /// Whether a cache of `cached` bytes, in a shard with `in_use` bytes handed out, is to be
  /// flushed before the next block goes in (pool_options::cache_follows_use).
  [[nodiscard]] bool cache_outgrew(std::size_t cached, std::size_t in_use) const noexcept {
    return cached > in_use + cache_over_use;
  }

  /// The largest free block a request may cut. Requests of at least `growth_step` (the ones
  /// that get chunks of their own) and of `initial_size` do not cut a free block more than
  /// 1.25 times their size while the upstream can still supply: the rest of the block would
  /// stay pinned as long as the request lives, and large blocks come and go. (PyTorch's
  /// allocator has the same rule: max_split_size.) Once the upstream is out, any block will do.
  [[nodiscard]] std::size_t oversize_limit(std::size_t bytes) const noexcept {
    if (bytes < growth_step || bytes < initial_size) {
      return std::numeric_limits<std::size_t>::max();
    }
    const std::size_t size = round_up(bytes);
    return size + size / 4;
  }
};

/// How pool_shard::take may choose: `any_block` also cuts a free block much larger than the
/// request (pool_policy::oversize_limit) and, under stream_reuse_policy::when_complete, one
/// that needs a wait (the last resort before out_of_memory); `ready_only`: only a block that
/// needs no wait for the stream, of at most twice the request (the cache has another in hand).
struct pool_take_mode {
  bool any_block = false;
  bool ready_only = false;
};

/// One shard; see the header comment. Public members: pool_resource's inline fast paths use
/// them directly.
struct alignas(64) pool_shard {
  spin_lock mutex;
  pool_heap tiers[2] = {pool_heap{pool_policy::granule}, pool_heap{pool_policy::granule}};
  address_map<pool_block> live;  ///< address -> block, for blocks handed out or cached
  block_cache<pool_block> cached{pool_policy::granule};  ///< freed blocks kept whole (in `live`)
  std::size_t used = 0;
  std::size_t peak = 0;
  stream_ledger ledger;

  explicit pool_shard(const pool_policy& policy) noexcept
      : ledger(*policy.events, policy.device, policy.remembers_waits) {}

  /// A block of `size` bytes (rounded to the granule) from tier `t`, made ready for `stream`,
  /// or nullptr (see take_mode).
  void* take(const pool_policy& policy, pool_tier t, std::size_t size, std::size_t alignment,
             const stream_view* stream, pool_take_mode mode = {}) {
    live.reserve_one();  // the only step that can fail for want of host memory: do it first
    const std::size_t largest_split =
        mode.any_block ? std::numeric_limits<std::size_t>::max() : policy.oversize_limit(size);
    pool_block* b = nullptr;
    if (!policy.tracks_streams || !policy.prefers_ready) [[likely]] {
      b = tiers[t].allocate(size, alignment, largest_split);
    } else {  // prefer a block that needs no wait (header comment)
      // Under when_complete nothing that needs a wait will do (but as the last resort): look
      // further (take_flushing asks what completed before the pool grows).
      const bool complete_only = policy.reuse_when_complete && !mode.any_block;
      tlsf_reach reach{pool_policy::ready_heap_classes, pool_policy::ready_heap_depth,
                       mode.ready_only || complete_only, !complete_only};
      if (complete_only) {
        reach.classes = pool_policy::complete_heap_classes;
        reach.depth = pool_policy::complete_heap_depth;
      }
      bool switched = false;
      b = tiers[t].allocate(
          size, alignment, largest_split,
          [&](const pool_block& c) { return c.tag.empty() || ledger.ready_for(c.tag, stream); },
          reach, &switched);
      ledger.counters().preferred_blocks += switched && !mode.ready_only ? 1 : 0;
    }
    if (b == nullptr) {
      return nullptr;
    }
    if (!b->tag.empty()) {
      try {
        if (b->tag.only_on(stream)) {
          b->tag.clear();
        } else {
          ledger.make_ready(b->tag, stream);
        }
      } catch (...) {
        tiers[t].free(b);
        throw;
      }
    }
    live.insert(b->address, b);
    count_in(b->size);
    return reinterpret_cast<void*>(b->address);
  }

  /// From the heap of tier `t`, else after flushing cached blocks — largest first, only until
  /// one merges into a free block of that tier that can hold the request (a miss then costs a
  /// few cached blocks, not the whole cache; under when_complete, one that needs no wait) — or
  /// nullptr: the pool must grow.
  void* take_flushing(const pool_policy& policy, pool_tier t, std::size_t size,
                      std::size_t alignment, const stream_view* stream) {
    if (void* p = take(policy, t, size, alignment, stream)) {
      return p;
    }
    const bool complete_only = policy.tracks_streams && policy.reuse_when_complete;
    // Under when_complete the alternative is growth: first learn what completed since.
    if (complete_only && ledger.refresh(stream, true)) {
      if (void* p = take(policy, t, size, alignment, stream)) {
        return p;
      }
    }
    const std::size_t needed =
        size + (alignment > pool_policy::granule ? alignment - pool_policy::granule : 0);
    while (cached.count() != 0) {
      cached.drain_until([&](pool_block* c) {
        live.erase(c->address);
        const pool_block* merged = tiers[c->region->owner].free(c);
        return merged->region->owner == t && merged->size >= needed &&
               (!complete_only || merged->tag.empty() || ledger.ready_for(merged->tag, stream));
      });
      if (void* p = take(policy, t, size, alignment, stream)) {
        return p;
      }
    }
    return nullptr;
  }

  /// Hands out `b`, just popped from the cache (still in `live`) for a request of `size` bytes
  /// at `alignment`, whose pending frees need an event check. If b would need a wait, a block
  /// that needs none goes out instead — from the same stacks, else from the heap (at most
  /// twice the request) — and b back on top of its stack (header comment). Under
  /// when_complete, if there is none, b goes back too and the result is nullptr (the caller
  /// goes on as on a miss). On failure the block goes back to the cache.
  void* hand_out_cached(const pool_policy& policy, pool_block* b, std::size_t size,
                        std::size_t alignment, const stream_view* stream) {
    if (policy.prefers_ready && !ledger.ready_for(b->tag, stream)) {
      if (policy.reuse_when_complete) {
        ledger.refresh(stream);
      }
      if (!ledger.ready_for(b->tag, stream)) {
        pool_block* other = cached.pop_if(
            size, alignment - 1,
            [&](const pool_block& c) { return c.tag.empty() || ledger.ready_for(c.tag, stream); },
            pool_policy::ready_cache_depth);
        if (other != nullptr) {
          cached.push(b);
          ++ledger.counters().preferred_blocks;
          b = other;
        } else {
          void* p = nullptr;
          try {
            p = take(policy, policy.tier_of(size), size, alignment, stream, {.ready_only = true});
          } catch (const std::bad_alloc&) {  // no host memory for the heap's nodes: b will do
          } catch (...) {
            cached.push(b);
            throw;
          }
          if (p != nullptr || policy.reuse_when_complete) {
            cached.push(b);
            ledger.counters().preferred_blocks += p != nullptr ? 1 : 0;
            return p;
          }
        }
      }
    }
    if (!b->tag.empty()) {
      try {
        ledger.make_ready(b->tag, stream);
      } catch (...) {
        cached.push(b);
        throw;
      }
    }
    count_in(b->size);
    return reinterpret_cast<void*>(b->address);
  }

  /// Frees `b` (handed out, found in `live`) in the general case: a size mismatch, a full
  /// cache, a stream other than the one looked up last.
  void free_block(const pool_policy& policy, pool_block* b, std::size_t bytes,
                  const stream_view* stream) noexcept {
    const std::size_t size = pool_policy::round_up(bytes);
    if (size > b->size || b->size - size > size / 8) {  // from the cache: up to 1/8 larger
      report_problem("pool_resource: deallocate with a size that does not match the allocation; "
                     "the allocation's own size is freed");
    }
    used -= b->size;
    if (policy.tracks_streams && stream != nullptr) {
      ledger.note_free(b->tag, *stream);
    }
    if (policy.cache_outgrew(cached.bytes(), used)) {
      flush_cache();  // most of what was live is free: a new phase starts from merged memory
    }
    if (policy.cacheable(b->size, cached.bytes(), used)) {
      cached.push(b);
      return;
    }
    live.erase(b->address);
    tiers[b->region->owner].free(b);
  }

  /// Returns every cached block to its heap, where it merges with its neighbours.
  void flush_cache() noexcept {
    cached.drain([this](pool_block* b) {
      live.erase(b->address);
      tiers[b->region->owner].free(b);
    });
  }

  /// Blocks handed out (cached ones are in `live` too).
  [[nodiscard]] std::size_t blocks_in_use() const noexcept { return live.size() - cached.count(); }

  /// Adds this shard's bytes and free blocks to `s` (cached blocks are free blocks too: a
  /// request that needs them flushes the cache).
  void add_stats(resource_stats& s) const noexcept {
    std::size_t free_blocks = s.free_blocks.value_or(0) + cached.count();
    std::size_t largest = std::max(s.largest_free_block.value_or(0), cached.largest());
    for (const pool_heap& h : tiers) {
      s.reserved_bytes += h.total_bytes();
      free_blocks += h.free_block_count();
      largest = std::max(largest, h.largest_free_block());
    }
    s.free_blocks = free_blocks;
    s.largest_free_block = largest;
    s.used_bytes += used;
    s.peak_used_bytes += peak;
  }

  void count_in(std::size_t bytes) noexcept {
    used += bytes;
    peak = std::max(peak, used);
  }
};

/// `o` (a pool_options) with 0 shards replaced by one per hardware thread (at most 16);
/// throws std::invalid_argument for options no pool can work with.
template <class Options>
[[nodiscard]] Options validated_pool_options(Options o) {
  auto fail = [](const std::string& what) {
    throw std::invalid_argument("cudamem::pool_resource: " + what);
  };
  if (o.shards == 0) {
    const unsigned hw = std::max(1U, detail::hardware_threads());
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
  using reuse = decltype(o.stream_reuse);
  if (o.stream_reuse != reuse::wait && o.stream_reuse != reuse::when_complete) {
    fail("stream_reuse must be stream_reuse::wait or stream_reuse::when_complete, not " +
         std::to_string(static_cast<int>(o.stream_reuse)));
  }
  return o;
}

/// `count` empty shards, each on cache lines of its own.
[[nodiscard]] inline std::vector<detail::unique_owner<pool_shard>> make_pool_shards(
    unsigned count, const pool_policy& policy) {
  std::vector<detail::unique_owner<pool_shard>> shards;
  shards.reserve(count);
  for (unsigned i = 0; i < count; ++i) {
    shards.push_back(detail::make_unique_owner<pool_shard>(policy));
  }
  return shards;
}

}  // namespace cudamem::detail
