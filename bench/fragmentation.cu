// bench/fragmentation.cu — how much of the device's free memory a program can use before its
// first failure, for pool_resource and its peers, in one run on one device:
//   swiss cheese: 64 MiB blocks until failure, free every other one, 128 MiB blocks until
//                 failure; bytes obtained / bytes freed;
//   mixed:        bench/support/fragmentation.hpp's trace (large short-lived blocks between
//                 small long-lived ones) to its first failure; live bytes at the failure /
//                 free memory at the start; and ns per operation for both.
//
//   ./run bench fragmentation               # on a GPU machine: pool, cudaMalloc,
//                                           # cudaMallocAsync, CUB, thrust's pool
//   ./run bench fragmentation --simulated   # no GPU: an 80 GiB simulated device — the pool
//                                           # over a first-fit and over a paged device, and
//                                           # the naive first-fit reference
//
// Everything an allocator holds is freed, and its cache emptied, before the next one starts;
// the free memory is measured again for each. With no GPU and no --simulated it prints one
// line and exits 69.
#include <cudamem/device_resource.hpp>
#include <cudamem/out_of_memory.hpp>
#include <cudamem/pool_resource.hpp>
#include <cudamem/simulated_resource.hpp>

#include "fragmentation.hpp"

#include <cub/util_allocator.cuh>
#include <thrust/device_ptr.h>
#include <thrust/mr/device_memory_resource.h>
#include <thrust/mr/disjoint_pool.h>
#include <thrust/mr/new.h>

#include <cuda_runtime_api.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <new>
#include <string>

using namespace cudamem_bench;

namespace {

void require(cudaError_t code, const char* what) {
  if (code != cudaSuccess) {
    std::fprintf(stderr, "bench_fragmentation: %s: %s\n", what, cudaGetErrorString(code));
    std::exit(1);
  }
}

std::size_t device_free_now() {
  require(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  std::size_t free = 0;
  std::size_t total = 0;
  require(cudaMemGetInfo(&free, &total), "cudaMemGetInfo");
  return free;
}

void print(const std::string& who, const fragmentation_result& swiss, const fragmentation_result& mix) {
  std::printf("%-26s %8.3f %10.0f %8.3f %10.0f %12.2f\n", who.c_str(), swiss.ratio,
              swiss.ns_per_op, mix.ratio, mix.ns_per_op,
              static_cast<double>(mix.numerator) / static_cast<double>(GiB));
}

/// Runs both experiments with alloc (nullptr on failure) and release; `free_at_start` is the
/// mixed trace's denominator and scale.
void run(const std::string& who, std::size_t free_at_start,
         const std::function<void*(std::size_t)>& alloc,
         const std::function<void(void*, std::size_t)>& release,
         const std::function<void()>& between = [] {}) {
  const fragmentation_result swiss = swiss_cheese(alloc, release, 64 * MiB, 128 * MiB);
  between();
  const fragmentation_result mix = mixed(mixed_spec_for(free_at_start), alloc, release);
  print(who, swiss, mix);
}

template <class F>
void* or_null(F&& f) {
  try {
    return f();
  } catch (const std::bad_alloc&) {  // cudamem::out_of_memory and thrust's bad_alloc
    return nullptr;
  } catch (const std::exception&) {  // thrust's system_error for cudaErrorMemoryAllocation
    static_cast<void>(cudaGetLastError());
    return nullptr;
  }
}

using thrust_pool = thrust::mr::disjoint_unsynchronized_pool_resource<thrust::device_memory_resource,
                                                                      thrust::mr::new_delete_resource>;

void run_simulated() {
  constexpr std::size_t capacity = 80 * GiB;
  std::printf("simulated 80 GiB device (no GPU)\n");
  std::printf("%-26s %8s %10s %8s %10s %12s\n", "allocator", "swiss", "ns/op", "mixed", "ns/op",
              "live GiB");
  {
    cudamem::simulated_resource device;
    run("first fit (reference)", capacity,
        [&](std::size_t n) { return or_null([&] { return device.allocate(n); }); },
        [&](void* p, std::size_t n) { device.deallocate(p, n); });
  }
  for (auto layout : {cudamem::simulated_layout::first_fit, cudamem::simulated_layout::paged}) {
    cudamem::simulated_resource device{{.capacity = capacity, .layout = layout}};
    cudamem::pool_resource pool{device};
    run(layout == cudamem::simulated_layout::paged ? "pool over paged device" : "pool over first fit",
        capacity, [&](std::size_t n) { return or_null([&] { return pool.allocate(n); }); },
        [&](void* p, std::size_t n) { pool.deallocate(p, n); }, [&] { pool.release(); });
  }
}

}  // namespace

int main(int argc, char** argv) {
  const bool simulated = argc > 1 && std::string(argv[1]) == "--simulated";
  if (simulated) {
    run_simulated();
    return 0;
  }
  int devices = 0;
  const cudaError_t probe = cudaGetDeviceCount(&devices);
  if (probe != cudaSuccess || devices == 0) {
    std::printf("SKIPPED: no CUDA device (%s); run with --simulated for the 80 GiB simulation\n",
                probe != cudaSuccess ? cudaGetErrorName(probe) : "0 devices");
    return 69;
  }
  cudaDeviceProp prop{};
  require(cudaGetDeviceProperties(&prop, 0), "cudaGetDeviceProperties");
  std::printf("bench_fragmentation: %s, %.1f GiB free at start\n", prop.name,
              static_cast<double>(device_free_now()) / GiB);
  std::printf("%-26s %8s %10s %8s %10s %12s\n", "allocator", "swiss", "ns/op", "mixed", "ns/op",
              "live GiB");
  cudaStream_t stream = nullptr;
  require(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");

  {
    cudamem::device_resource device{0};
    cudamem::pool_resource pool{device};
    run("cudamem pool", device_free_now(),
        [&](std::size_t n) { return or_null([&] { return pool.allocate(n, 256, stream); }); },
        [&](void* p, std::size_t n) { pool.deallocate(p, n, 256, stream); },
        [&] { pool.release(); });
  }
  run("cudaMalloc", device_free_now(),
      [](std::size_t n) -> void* {
        void* p = nullptr;
        if (cudaMalloc(&p, n) != cudaSuccess) {
          static_cast<void>(cudaGetLastError());
          return nullptr;
        }
        return p;
      },
      [](void* p, std::size_t) { require(cudaFree(p), "cudaFree"); });
  {
    cudaMemPool_t mempool = nullptr;
    require(cudaDeviceGetDefaultMemPool(&mempool, 0), "cudaDeviceGetDefaultMemPool");
    std::uint64_t threshold = UINT64_MAX;
    require(cudaMemPoolSetAttribute(mempool, cudaMemPoolAttrReleaseThreshold, &threshold),
            "cudaMemPoolSetAttribute");
    run("cudaMallocAsync", device_free_now(),
        [&](std::size_t n) -> void* {
          void* p = nullptr;
          if (cudaMallocAsync(&p, n, stream) != cudaSuccess) {
            static_cast<void>(cudaGetLastError());
            return nullptr;
          }
          return p;
        },
        [&](void* p, std::size_t) { require(cudaFreeAsync(p, stream), "cudaFreeAsync"); },
        [&] {
          require(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
          require(cudaMemPoolTrimTo(mempool, 0), "cudaMemPoolTrimTo");
        });
    require(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
    require(cudaMemPoolTrimTo(mempool, 0), "cudaMemPoolTrimTo");
  }
  {
    cub::CachingDeviceAllocator cub(8, 3, 22, std::size_t{64} << 30);
    run("CUB caching allocator", device_free_now(),
        [&](std::size_t n) -> void* {
          void* p = nullptr;
          if (cub.DeviceAllocate(&p, n, stream) != cudaSuccess) {
            static_cast<void>(cudaGetLastError());
            return nullptr;
          }
          return p;
        },
        [&](void* p, std::size_t) { require(cub.DeviceFree(p), "CUB DeviceFree"); },
        [&] { require(cub.FreeAllCached(), "CUB FreeAllCached"); });
    require(cub.FreeAllCached(), "CUB FreeAllCached");
  }
  {
    thrust::device_memory_resource upstream;
    thrust::mr::new_delete_resource bookkeeper;
    thrust_pool pool(&upstream, &bookkeeper);
    run("thrust disjoint pool", device_free_now(),
        [&](std::size_t n) { return or_null([&] { return pool.do_allocate(n, 256).get(); }); },
        [&](void* p, std::size_t n) { pool.do_deallocate(thrust::device_ptr<void>(p), n, 256); },
        [&] { pool.release(); });
  }
  require(cudaStreamDestroy(stream), "cudaStreamDestroy");
  return 0;
}
