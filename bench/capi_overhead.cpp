// What the C ABI (libcudamem_c) adds per allocation: the same stack — a statistics adaptor over
// a vm_pool_resource — called through cudamem_allocate/cudamem_deallocate, through PyTorch's
// entry points (cudamem_torch_malloc_N/free_N, what CUDAPluggableAllocator calls), and
// directly in C++; plus the vm_pool alone; every stack configured as the C API's users get it
// (4 MiB handles, 1 GiB kept free). ns per allocate+free pair, median of interleaved rounds,
// one stream, on device 0.
//
//   bench_capi_overhead [rounds] [pairs per round]
#include <cudamem/statistics_adaptor.hpp>
#include <cudamem/stream.hpp>
#include <cudamem/vm_pool_resource.hpp>

#include <cudamem_c.h>

#include "median.hpp"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

namespace {

using clock_type = std::chrono::steady_clock;

struct variant {
  std::string name;
  std::function<void*(std::size_t)> allocate;
  std::function<void(void*, std::size_t)> deallocate;
  std::vector<double> ns;  ///< per round
};

double run_round(variant& v, const std::vector<std::size_t>& sizes, std::size_t pairs) {
  const auto start = clock_type::now();
  for (std::size_t i = 0; i < pairs; ++i) {
    const std::size_t n = sizes[i % sizes.size()];
    v.deallocate(v.allocate(n), n);
  }
  const auto ns = std::chrono::duration<double, std::nano>(clock_type::now() - start).count();
  return ns / static_cast<double>(pairs);
}

using cudamem_bench::median;

void check_status(cudamem_status s) {
  if (s != CUDAMEM_OK) {
    std::fprintf(stderr, "bench_capi_overhead: %s\n", cudamem_last_error());
    std::exit(1);
  }
}

}  // namespace

int main(int argc, char** argv) try {
  const int rounds = argc > 1 ? std::atoi(argv[1]) : 9;
  const std::size_t pairs = argc > 2 ? std::strtoull(argv[2], nullptr, 10) : 200000;
  if (cudamem::device_count() == 0) {
    std::puts("bench_capi_overhead: no CUDA device");
    return 69;
  }
  cudamem::stream s;
  const auto stream = static_cast<cudamem_stream_t>(s.get());

  // The C API's stack and the C++ ones are configured alike, and as the C API's users get it
  // by default (4 MiB handles, 1 GiB kept free): with vm_pool_resource's own defaults (64 MiB
  // handles) the C++ stacks served blocks of 4-16 MiB from the pool while the C API's vm_pool
  // sent them to its vm_resource, and the difference (+330 ns per pair on the mixed sizes)
  // was read as the C side's cost.
  int id = 0;
  check_status(cudamem_allocator_create(
      "resource=vm_pool, handle_bytes=4MiB, keep_free_bytes=1GiB, grow_ahead_bytes=4GiB", &id));
  if (id != 1) {
    std::fprintf(stderr, "bench_capi_overhead: expected allocator 1, got %d\n", id);
    return 1;
  }
  cudamem::vm_pool_options same_as_c;
  same_as_c.handle_bytes = std::size_t{4} << 20;
  same_as_c.keep_free_bytes = std::size_t{1} << 30;
  same_as_c.grow_ahead_bytes = std::size_t{4} << 30;
  cudamem::vm_pool_resource direct_pool{0, same_as_c};
  cudamem::statistics_adaptor direct_stats{direct_pool};
  cudamem::vm_pool_resource alone{0, same_as_c};

  std::vector<variant> variants;
  variants.push_back({"C API (cudamem_allocate)",
                      [&](std::size_t n) {
                        void* p = nullptr;
                        check_status(cudamem_allocate(id, n, 0, stream, &p));
                        return p;
                      },
                      [&](void* p, std::size_t n) {
                        check_status(cudamem_deallocate(id, p, n, 0, stream));
                      },
                      {}});
  variants.push_back({"PyTorch entry points",
                      [&](std::size_t n) { return cudamem_torch_malloc_1(n, 0, stream); },
                      [&](void* p, std::size_t n) { cudamem_torch_free_1(p, n, 0, stream); },
                      {}});
  variants.push_back({"C++ statistics_adaptor over vm_pool",
                      [&](std::size_t n) { return direct_stats.allocate(n, 256, s); },
                      [&](void* p, std::size_t n) { direct_stats.deallocate(p, n, 256, s); },
                      {}});
  variants.push_back({"C++ vm_pool alone",
                      [&](std::size_t n) { return alone.allocate(n, 256, s); },
                      [&](void* p, std::size_t n) { alone.deallocate(p, n, 256, s); },
                      {}});

  const std::vector<std::pair<const char*, std::vector<std::size_t>>> traces = {
      {"1 MiB", {std::size_t{1} << 20}},
      {"4 KiB..16 MiB", [] {
         std::vector<std::size_t> v;
         for (int i = 0; i < 13; ++i) v.push_back(std::size_t{4096} << i);
         return v;
       }()}};
  for (const auto& [trace, sizes] : traces) {
    for (variant& v : variants) {
      v.ns.clear();
      run_round(v, sizes, pairs / 10);  // warm: every pool holds what the loop needs
    }
    for (int r = 0; r < rounds; ++r) {
      for (variant& v : variants) {  // interleaved: drift hits every variant alike
        v.ns.push_back(run_round(v, sizes, pairs));
      }
    }
    const double reference = median(variants[2].ns);
    std::printf("\n%s, ns per allocate+free pair (median of %d rounds of %zu):\n", trace, rounds,
                pairs);
    for (const variant& v : variants) {
      const double m = median(v.ns);
      std::printf("  %-40s %8.1f   (%+.1f vs the same stack in C++)\n", v.name.c_str(), m,
                  m - reference);
    }
  }
  check_status(cudamem_allocator_destroy(id));
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "bench_capi_overhead: %s\n", e.what());
  return 1;
}
