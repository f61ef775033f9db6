// with_temp_storage on real CUB calls: DeviceRadixSort, DeviceReduce and DeviceScan get their
// temporary storage from a cudamem resource, give the right results, and give the storage back
// (in stream order) whether the call succeeds, fails in CUB, or cannot get its storage.
#include <cudamem/cub_temp_storage.hpp>
#include <cudamem/device_buffer.hpp>
#include <cudamem/device_resource.hpp>
#include <cudamem/failing_adaptor.hpp>
#include <cudamem/host_resource.hpp>
#include <cudamem/pool_resource.hpp>
#include <cudamem/statistics_adaptor.hpp>
#include <cudamem/stream.hpp>

#include "gpu_test.hpp"
#include "graph_nodes.hpp"

#include <cub/device/device_radix_sort.cuh>
#include <cub/device/device_reduce.cuh>
#include <cub/device/device_scan.cuh>

#include <algorithm>
#include <cstdint>
#include <new>
#include <numeric>
#include <random>
#include <stdexcept>
#include <vector>

using namespace cudamem;
using cudamem_test::count_nodes;

namespace {

std::vector<std::uint32_t> random_values(std::size_t n, std::uint64_t seed, std::uint32_t below) {
  std::mt19937_64 rng(seed);
  std::vector<std::uint32_t> v(n);
  for (auto& x : v) {
    x = static_cast<std::uint32_t>(rng() % below);
  }
  return v;
}

template <class T>
std::vector<T> to_host(const device_buffer<T>& b, const stream& s) {
  std::vector<T> host(b.size());
  check(cudaMemcpyAsync(host.data(), b.data(), b.size_bytes(), cudaMemcpyDeviceToHost, s.get()));
  s.synchronize();
  return host;
}

}  // namespace

TEST_CASE("with_temp_storage: CUB sort, reduce and scan are right; the storage comes from the resource and goes back") {
  device_resource device;
  pool_resource pool{device};
  statistics_adaptor counted{pool};
  stream s;
  const std::size_t n = 1 << 20;
  const std::vector<std::uint32_t> host = random_values(n, 7, 1000);
  device_buffer<std::uint32_t> in(host, s, pool);
  device_buffer<std::uint32_t> out(n, s, pool);

  SECTION("DeviceRadixSort::SortKeys") {
    const std::size_t bytes = with_temp_storage(counted, s, [&](void* temp, std::size_t& size) {
      return cub::DeviceRadixSort::SortKeys(temp, size, in.data(), out.data(), static_cast<int>(n),
                                            0, 32, s.get());
    });
    CHECK(bytes > 0);
    CHECK(counted.counters().allocations == 1);
    CHECK(counted.counters().allocated_bytes == bytes);
    CHECK(counted.counters().current_bytes == 0);  // freed, in stream order, on return
    std::vector<std::uint32_t> expected = host;
    std::sort(expected.begin(), expected.end());
    CHECK(to_host(out, s) == expected);
  }
  SECTION("DeviceReduce::Sum") {
    device_buffer<std::uint64_t> sum(1, s, pool);
    with_temp_storage(counted, s, [&](void* temp, std::size_t& size) {
      return cub::DeviceReduce::Sum(temp, size, in.data(), sum.data(), static_cast<int>(n), s.get());
    });
    CHECK(counted.counters().allocations == 1);
    CHECK(counted.counters().current_bytes == 0);
    CHECK(to_host(sum, s).front() == std::accumulate(host.begin(), host.end(), std::uint64_t{0}));
  }
  SECTION("DeviceScan::ExclusiveSum") {
    with_temp_storage(counted, s, [&](void* temp, std::size_t& size) {
      return cub::DeviceScan::ExclusiveSum(temp, size, in.data(), out.data(), static_cast<int>(n),
                                           s.get());
    });
    std::vector<std::uint32_t> expected(n);
    std::exclusive_scan(host.begin(), host.end(), expected.begin(), std::uint32_t{0});
    CHECK(to_host(out, s) == expected);
    CHECK(counted.counters().current_bytes == 0);
  }
  s.synchronize();
}

TEST_CASE("with_temp_storage: a failed allocation never runs the call; a CUB error frees the storage") {
  device_resource device;
  pool_resource pool{device};
  statistics_adaptor counted{pool};
  failing_adaptor faults{counted};
  stream s;
  const std::size_t n = 1 << 16;
  device_buffer<std::uint32_t> in(n, zero_fill, s, pool);
  device_buffer<std::uint32_t> out(n, s, pool);

  int calls = 0;
  faults.fail_call(1);
  CHECK_THROWS_AS(with_temp_storage(faults, s,
                                    [&](void* temp, std::size_t& size) {
                                      ++calls;
                                      return cub::DeviceRadixSort::SortKeys(
                                          temp, size, in.data(), out.data(), static_cast<int>(n),
                                          0, 32, s.get());
                                    }),
                  std::bad_alloc);
  CHECK(calls == 1);  // the size query only
  CHECK(counted.counters().current_bytes == 0);

  // CUB validates little on the host, so the run's failure is staged: the size query is
  // CUB's, the run returns the error a failing launch would.
  faults.never_fail();
  CHECK_THROWS_AS(with_temp_storage(faults, s,
                                    [&](void* temp, std::size_t& size) {
                                      if (temp == nullptr) {
                                        return cub::DeviceRadixSort::SortKeys(
                                            temp, size, in.data(), out.data(),
                                            static_cast<int>(n), 0, 32, s.get());
                                      }
                                      return cudaErrorInvalidValue;
                                    }),
                  cuda_error);
  CHECK(counted.counters().allocations == 1);
  CHECK(counted.counters().current_bytes == 0);

  host_resource host_memory;
  calls = 0;
  CHECK_THROWS_AS(with_temp_storage(host_memory, s,
                                    [&](void*, std::size_t&) {
                                      ++calls;
                                      return cudaSuccess;
                                    }),
                  std::invalid_argument);
  CHECK(calls == 0);
  s.synchronize();
}

TEST_CASE("with_temp_storage under stream capture: the graph owns the storage, the pool is not asked") {
  device_resource device;
  pool_resource pool{device};
  statistics_adaptor counted{pool};
  stream s{{.non_blocking = true}};
  const std::size_t n = 1 << 16;
  const std::vector<std::uint32_t> host = random_values(n, 11, 1u << 30);
  device_buffer<std::uint32_t> in(host, s, pool);
  device_buffer<std::uint32_t> out(n, s, pool);
  s.synchronize();

  check(cudaStreamBeginCapture(s.get(), cudaStreamCaptureModeGlobal));
  std::size_t bytes = 0;
  bool ran = true;
  try {
    bytes = with_temp_storage(counted, s, [&](void* temp, std::size_t& size) {
      return cub::DeviceRadixSort::SortKeys(temp, size, in.data(), out.data(),
                                            static_cast<int>(n), 0, 32, s.get());
    });
  } catch (const std::exception& e) {
    ran = false;
    INFO("with_temp_storage under capture threw: " << e.what());
  }
  cudaGraph_t graph = nullptr;
  const cudaError_t ended = cudaStreamEndCapture(s.get(), &graph);
  REQUIRE(ran);
  REQUIRE(ended == cudaSuccess);
  CHECK(bytes > 0);
  CHECK(counted.counters().allocations == 0);
  CHECK(count_nodes(graph, cudaGraphNodeTypeMemAlloc) == 1);
  CHECK(count_nodes(graph, cudaGraphNodeTypeMemFree) == 1);

  // Work that takes pool memory before the graph runs keeps its contents.
  device_buffer<std::uint32_t> other(n, 5u, s, counted);
  cudaGraphExec_t exec = nullptr;
  check(cudaGraphInstantiate(&exec, graph, 0));
  check(cudaGraphLaunch(exec, s.get()));
  check(cudaGraphLaunch(exec, s.get()));  // twice: each launch has its storage
  std::vector<std::uint32_t> expected = host;
  std::sort(expected.begin(), expected.end());
  CHECK(to_host(out, s) == expected);
  CHECK(to_host(other, s) == std::vector<std::uint32_t>(n, 5));
  check(cudaGraphExecDestroy(exec));
  check(cudaGraphDestroy(graph));
  check(cudaDeviceGraphMemTrim(current_device()));
}
