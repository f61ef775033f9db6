// bench/support/peers.hpp — the allocators cudamem is measured against, set up once the way
// DESIGN.md says, for every benchmark that runs them (bench_pool, bench_workload), plus the
// small helpers those benchmarks share.
//
//   cudamem_bench::malloc_async_peer async;      // device 0's default pool keeps everything
//   cudamem_bench::malloc_async_worker w{stream}; // cudaMallocAsync / cudaFreeAsync on `stream`
//   auto cub = cudamem_bench::make_cub_peer();    // cub::CachingDeviceAllocator(8, 3, 22, 64 GiB)
//   cudamem_bench::cub_worker c{cub.get(), stream};
//   double m = cudamem_bench::median(samples);
//   auto d = cudamem_bench::difference(pool.stream_stats(), before);  // counts over a span
//
// Peers (DESIGN.md): cudaMalloc/cudaFree; cudaMallocAsync/cudaFreeAsync on the device's
// default memory pool with release threshold UINT64_MAX (so it never gives memory back while
// running); cub::CachingDeviceAllocator(8, 3, 22, 64 GiB) (every size cached, rounded up to a
// power of 8). A worker is one stream's (or one thread's) view of an allocator:
// allocate(bytes), deallocate(p, bytes), finish(). A CUDA error ends the program (exit 1) with
// the failing call named: a benchmark that goes on after one measures nonsense.
#pragma once

#include <cudamem/arena_resource.hpp>
#include <cudamem/memory_resource.hpp>
#include <cudamem/pool_resource.hpp>

#include "median.hpp"

#include <cub/util_allocator.cuh>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <vector>

namespace cudamem_bench {

/// Ends the program with the call's name and CUDA's message unless `code` is cudaSuccess.
inline void require(cudaError_t code, const char* what) {
  if (code != cudaSuccess) {
    std::fprintf(stderr, "bench: %s: %s\n", what, cudaGetErrorString(code));
    std::exit(1);
  }
}

/// `after` - `before`, count by count: what a pool did over a span of a benchmark.
inline cudamem::pool_stream_stats difference(const cudamem::pool_stream_stats& after,
                                             const cudamem::pool_stream_stats& before) {
  cudamem::pool_stream_stats d;
  d.cross_stream_blocks = after.cross_stream_blocks - before.cross_stream_blocks;
  d.preferred_blocks = after.preferred_blocks - before.preferred_blocks;
  d.event_records = after.event_records - before.event_records;
  d.event_queries = after.event_queries - before.event_queries;
  d.stream_waits = after.stream_waits - before.stream_waits;
  d.waits_skipped = after.waits_skipped - before.waits_skipped;
  d.host_waits = after.host_waits - before.host_waits;
  d.wide_tags = after.wide_tags - before.wide_tags;
  d.device_syncs = after.device_syncs - before.device_syncs;
  d.upstream_allocations = after.upstream_allocations - before.upstream_allocations;
  d.upstream_returns = after.upstream_returns - before.upstream_returns;
  return d;
}

// --- workers: one stream's view of an allocator ---------------------------------------------------

struct resource_worker {
  cudamem::memory_resource* mr;
  cudaStream_t stream;
  void* allocate(std::size_t n) { return mr->allocate(n, 256, stream); }
  void deallocate(void* p, std::size_t n) { mr->deallocate(p, n, 256, stream); }
  void finish() {}
};

struct arena_worker {
  cudamem::arena_resource* arena;
  void* allocate(std::size_t n) { return arena->allocate(n, 256); }
  void deallocate(void* p, std::size_t n) { arena->deallocate(p, n, 256); }
  void finish() { arena->rewind({}); }
};

struct cuda_malloc_worker {
  void* allocate(std::size_t n) {
    void* p = nullptr;
    require(cudaMalloc(&p, n), "cudaMalloc");
    return p;
  }
  void deallocate(void* p, std::size_t) { require(cudaFree(p), "cudaFree"); }
  void finish() {}
};

struct malloc_async_worker {
  cudaStream_t stream;
  void* allocate(std::size_t n) {
    void* p = nullptr;
    require(cudaMallocAsync(&p, n, stream), "cudaMallocAsync");
    return p;
  }
  void deallocate(void* p, std::size_t) { require(cudaFreeAsync(p, stream), "cudaFreeAsync"); }
  void finish() { require(cudaStreamSynchronize(stream), "cudaStreamSynchronize"); }
};

struct cub_worker {
  cub::CachingDeviceAllocator* cub;
  cudaStream_t stream;
  void* allocate(std::size_t n) {
    void* p = nullptr;
    require(cub->DeviceAllocate(&p, n, stream), "CUB DeviceAllocate");
    return p;
  }
  void deallocate(void* p, std::size_t) { require(cub->DeviceFree(p), "CUB DeviceFree"); }
  void finish() {}
};

// --- the peers' set-up ------------------------------------------------------------------------

/// cudaMallocAsync as DESIGN.md measures it: while this object lives, `device`'s default memory
/// pool keeps everything freed to it (release threshold UINT64_MAX). Destruction waits for the
/// device and trims the pool to nothing, so the next allocator starts from an empty device.
class malloc_async_peer {
 public:
  explicit malloc_async_peer(int device = 0) {
    require(cudaDeviceGetDefaultMemPool(&pool_, device), "cudaDeviceGetDefaultMemPool");
    std::uint64_t threshold = UINT64_MAX;
    require(cudaMemPoolSetAttribute(pool_, cudaMemPoolAttrReleaseThreshold, &threshold),
            "cudaMemPoolSetAttribute(ReleaseThreshold)");
  }
  ~malloc_async_peer() {
    require(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
    require(cudaMemPoolTrimTo(pool_, 0), "cudaMemPoolTrimTo");
  }
  malloc_async_peer(const malloc_async_peer&) = delete;
  malloc_async_peer& operator=(const malloc_async_peer&) = delete;

  [[nodiscard]] cudaMemPool_t pool() const noexcept { return pool_; }
  /// The most the pool has held from the device since it was last reset (the driver's count).
  [[nodiscard]] std::uint64_t reserved_high() const {
    std::uint64_t bytes = 0;
    require(cudaMemPoolGetAttribute(pool_, cudaMemPoolAttrReservedMemHigh, &bytes),
            "cudaMemPoolGetAttribute(ReservedMemHigh)");
    return bytes;
  }

 private:
  cudaMemPool_t pool_ = nullptr;
};

/// CUB's caching allocator as DESIGN.md measures it: bin growth 8, bins 8^3 .. 8^22, up to
/// 64 GiB cached, so every size is cached (rounded up to a power of 8).
inline std::unique_ptr<cub::CachingDeviceAllocator> make_cub_peer() {
  return std::make_unique<cub::CachingDeviceAllocator>(8, 3, 22, std::size_t{64} << 30);
}

}  // namespace cudamem_bench
