// bench/vm_fragmentation.cu — vm_pool_resource against its peers, in one run on one device:
// swiss cheese (64 MiB blocks to failure, free every other, 128 MiB blocks to failure), the
// mixed trace to its first failure (live bytes / free memory at the start), ns per operation;
// then the standard single-thread traces, vm_pool vs the plain pool (ratio).
//
//   ./run bench vm_fragmentation
//
// Pools are measured twice on the same object: "cold" (the first run pays for getting memory
// from the device) and "warm" (the steady state: the pool already holds it). Exits 69 with no
// GPU. Every figure comes from this run; nothing is copied from elsewhere.
#include <cudamem/device.hpp>
#include <cudamem/device_resource.hpp>
#include <cudamem/pool_resource.hpp>
#include <cudamem/vm_pool_resource.hpp>

#include "fragmentation.hpp"
#include "traces.hpp"

#include <cub/util_allocator.cuh>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <memory>
#include <string>
#include <vector>

using namespace cudamem_bench;

namespace {

struct allocator_under_test {
  std::string name;
  std::function<void*(std::size_t)> alloc;  // nullptr on failure
  std::function<void(void*, std::size_t)> release;
};

void print_row(const std::string& name, const char* phase, const fragmentation_result& swiss,
               const fragmentation_result& mixed_result) {
  std::printf("%-22s %-5s %10.4f %12.0f %10.4f %12.0f\n", name.c_str(), phase, swiss.ratio,
              swiss.ns_per_op, mixed_result.ratio, mixed_result.ns_per_op);
  std::fflush(stdout);
}

std::size_t free_now() {
  cudamem::check(cudaDeviceSynchronize());
  return cudamem::device_memory(0).free;
}

void run_fragmentation(allocator_under_test& a, bool twice) {
  for (int round = 0; round < (twice ? 2 : 1); ++round) {
    const fragmentation_result swiss = swiss_cheese(a.alloc, a.release, 64 * MiB, 128 * MiB);
    const fragmentation_result mix = mixed(mixed_spec_for(free_now()), a.alloc, a.release);
    print_row(a.name, twice ? (round == 0 ? "cold" : "warm") : "-", swiss, mix);
  }
}

/// Median ns/op of `t` replayed three times on `mr` (after one warm-up replay).
double trace_ns(cudamem::memory_resource& mr, const trace& t, cudaStream_t s) {
  std::vector<void*> slots(t.blocks, nullptr);
  auto alloc = [&](std::size_t n) { return mr.allocate(n, 256, s); };
  auto release = [&](void* p, std::size_t n) { mr.deallocate(p, n, 256, s); };
  replay(t, slots, alloc, release);
  std::vector<double> runs;
  for (int i = 0; i < 3; ++i) {
    const auto start = std::chrono::steady_clock::now();
    replay(t, slots, alloc, release);
    runs.push_back(std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - start)
                       .count() /
                   static_cast<double>(t.ops.size()));
  }
  std::sort(runs.begin(), runs.end());
  return runs[1];
}

}  // namespace

int main() {
  if (cudamem::device_count() == 0) {
    std::printf("SKIPPED: no CUDA device: vm_fragmentation needs a GPU\n");
    return 69;
  }
  const auto props = cudamem::get_device_properties(0);
  std::printf("device 0: %s, %.1f GiB; free at start %.1f GiB\n", props.name.c_str(),
              static_cast<double>(props.total_memory) / GiB, static_cast<double>(free_now()) / GiB);
  cudaStream_t s = nullptr;
  cudamem::check(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));

  std::printf("\n%-22s %-5s %10s %12s %10s %12s\n", "allocator", "run", "swiss", "swiss ns/op",
              "mixed", "mixed ns/op");
  {
    allocator_under_test a{"cudaMalloc",
                           [](std::size_t n) -> void* {
                             void* p = nullptr;
                             if (cudaMalloc(&p, n) != cudaSuccess) {
                               static_cast<void>(cudaGetLastError());
                               return nullptr;
                             }
                             return p;
                           },
                           [](void* p, std::size_t) { static_cast<void>(cudaFree(p)); }};
    run_fragmentation(a, false);
  }
  {
    cudaMemPool_t pool = nullptr;
    cudaMemPoolProps props_pool{};
    props_pool.allocType = cudaMemAllocationTypePinned;
    props_pool.location.type = cudaMemLocationTypeDevice;
    props_pool.location.id = 0;
    cudamem::check(cudaMemPoolCreate(&pool, &props_pool));
    std::uint64_t threshold = UINT64_MAX;
    cudamem::check(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &threshold));
    allocator_under_test a{"cudaMallocAsync",
                           [&](std::size_t n) -> void* {
                             void* p = nullptr;
                             if (cudaMallocFromPoolAsync(&p, n, pool, s) != cudaSuccess) {
                               static_cast<void>(cudaGetLastError());
                               return nullptr;
                             }
                             return p;
                           },
                           [&](void* p, std::size_t) { static_cast<void>(cudaFreeAsync(p, s)); }};
    run_fragmentation(a, true);
    cudamem::check(cudaStreamSynchronize(s));
    cudamem::check(cudaMemPoolDestroy(pool));
  }
  {
    cub::CachingDeviceAllocator cub_alloc(8, 3, 22, 64 * GiB);
    allocator_under_test a{"CUB caching",
                           [&](std::size_t n) -> void* {
                             void* p = nullptr;
                             if (cub_alloc.DeviceAllocate(&p, n, s) != cudaSuccess) {
                               static_cast<void>(cudaGetLastError());
                               return nullptr;
                             }
                             return p;
                           },
                           [&](void* p, std::size_t) { static_cast<void>(cub_alloc.DeviceFree(p)); }};
    run_fragmentation(a, true);
    static_cast<void>(cub_alloc.FreeAllCached());
  }
  const auto as_test = [&](const std::string& name, cudamem::memory_resource& mr) {
    return allocator_under_test{name,
                                [&mr, s](std::size_t n) -> void* {
                                  try {
                                    return mr.allocate(n, 256, s);
                                  } catch (const std::bad_alloc&) {
                                    return nullptr;
                                  }
                                },
                                [&mr, s](void* p, std::size_t n) { mr.deallocate(p, n, 256, s); }};
  };
  {
    cudamem::device_resource device{0};
    cudamem::pool_resource pool{device};
    allocator_under_test a = as_test("cudamem pool", pool);
    run_fragmentation(a, true);
  }
  {
    cudamem::vm_pool_resource vm{0};
    allocator_under_test a = as_test("cudamem vm_pool", vm);
    run_fragmentation(a, true);
    const cudamem::vm_pool_stats st = vm.vm_stats();
    std::printf("vm_pool after both runs: %.1f GiB mapped, %.1f GiB virtual, %zu handles, %zu "
                "compactions, %zu stale aliases\n",
                static_cast<double>(st.mapped_bytes) / GiB,
                static_cast<double>(st.reserved_virtual_bytes) / GiB, st.handles, st.compactions,
                st.stale_aliases);
  }

  std::printf("\nstandard traces (single-thread; ns/op, median of 3 after a warm-up)\n");
  std::printf("%-24s %12s %12s %8s\n", "trace", "pool", "vm_pool", "vm/pool");
  for (const trace_spec& spec : standard_traces()) {
    if (spec.threads > 1) {
      continue;  // the multi-thread trace is the pool bench's
    }
    const trace t = make_trace(spec);
    double pool_ns = 0;
    double vm_ns = 0;
    {
      cudamem::device_resource device{0};
      cudamem::pool_resource pool{device};
      pool_ns = trace_ns(pool, t, s);
    }
    {
      cudamem::vm_pool_resource vm{0};
      vm_ns = trace_ns(vm, t, s);
    }
    std::printf("%-24s %12.0f %12.0f %8.2f\n", spec.name.c_str(), pool_ns, vm_ns, vm_ns / pool_ns);
  }
  cudamem::check(cudaStreamSynchronize(s));
  cudamem::check(cudaStreamDestroy(s));
  return 0;
}
