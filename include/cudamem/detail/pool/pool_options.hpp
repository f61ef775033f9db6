// cudamem/detail/pool/pool_options.hpp — the public types pool_resource.hpp's contract
// speaks of, kept apart so that the pool's header stays one reading: how a pool grows and
// caches (`pool_options`), whether a request may take another stream's memory
// (`stream_reuse_policy`), and what the pool did to keep stream order (`pool_stream_stats`).
// Include <cudamem/pool_resource.hpp>, not this part.
//
//   cudamem::pool_options o;
//   o.initial_size = 1ull << 30;                           // reserved at construction
//   o.stream_reuse = cudamem::stream_reuse_policy::when_complete;
//   cudamem::pool_resource pool{upstream, o};
//   cudamem::pool_stream_stats st = pool.stream_stats();   // waits, records, host waits...
#pragma once

#include <cstddef>
#include <cstdint>
#include <limits>

namespace cudamem {

namespace detail {
/// Every block of a pool_resource is a multiple of this many bytes, and aligned to it.
inline constexpr std::size_t pool_granule = 256;
}  // namespace detail

/// Whether a request may take memory freed on another stream before that free is known
/// complete (pool_options::stream_reuse; see the contract).
enum class stream_reuse_policy {
  /// Yes: the request's stream waits for it on the device (cudaStreamWaitEvent). The pool
  /// holds no more than its blocks need; streams that take each other's memory run in turn.
  wait,
  /// No: only memory freed on the requesting stream, or known complete (the pool asks); else
  /// the pool grows, and waits only when the upstream cannot supply. Streams keep their
  /// overlap; the pool holds about as much as the streams have in flight at once.
  when_complete,
};

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
  /// The cache never holds more than the shard has in use: a free that finds it holding more
  /// flushes it first (merging its blocks into the heap), then caches the block it frees. So
  /// once most of what was live has been freed — a run of work ended — the next requests are
  /// cut from merged memory, as in a fresh pool, rather than handed freed blocks from all over
  /// the chunks; a block freed and taken again at once (a loop) still hits. On by default
  /// (since 2026-11-27): where a finished run's blocks land decides whether the next run's
  /// larger blocks fit between them. bench_workload (four streams, every stream-step freeing
  /// what it took) holds 160 MiB with it and 192 MiB without, for 141 MiB that two tiers must
  /// hold at the least; the price is the merging, ~12-14% more instructions per operation on
  /// bench_pool's random traces, which end every run by freeing everything. Off: freed blocks
  /// stay whole in the cache until a request or a growth flushes it.
  bool cache_follows_use = true;
  /// Memory freed on another stream and not yet known complete: waited for, or left alone
  /// while the upstream can supply (stream_reuse_policy). A value outside the enumeration
  /// throws std::invalid_argument.
  stream_reuse_policy stream_reuse = stream_reuse_policy::wait;
};

/// What a pool_resource did to keep stream order, since it was made (stream_stats()): counts
/// summed over its shards. Every count is 0 over memory whose streams are not tracked.
struct pool_stream_stats {
  std::uint64_t cross_stream_blocks = 0;  ///< blocks handed out with another stream's frees pending
  std::uint64_t preferred_blocks = 0;  ///< a block needing no wait taken instead of the first pick
  std::uint64_t event_records = 0;     ///< cudaEventRecord after frees
  std::uint64_t event_queries = 0;     ///< cudaEventQuery before a cross-stream reuse
  std::uint64_t stream_waits = 0;      ///< cudaStreamWaitEvent inserted
  std::uint64_t waits_skipped = 0;     ///< the stream already waited for those frees: no call
  std::uint64_t host_waits = 0;        ///< cudaEventSynchronize (the synchronous allocate)
  std::uint64_t wide_tags = 0;  ///< blocks freed on more streams than a tag holds, made ready
  std::uint64_t device_syncs = 0;      ///< cudaDeviceSynchronize (before giving chunks back)
  std::uint64_t upstream_allocations = 0;  ///< chunks taken from the upstream
  std::uint64_t upstream_returns = 0;      ///< chunks given back to it
};

}  // namespace cudamem
