// thrust on cudamem resources: exec_policy (thrust's temporaries from a resource, in stream
// order) and thrust_allocator (a device_vector's memory and its own work). Results are checked
// against the host; the resource's statistics show where the temporaries went; a stream capture
// shows that no cudaMalloc, cudaFree or synchronisation happens inside an algorithm; fault
// injection shows that nothing leaks when an allocation inside an algorithm fails.
#include <cudamem/device_resource.hpp>
#include <cudamem/exec_policy.hpp>
#include <cudamem/failing_adaptor.hpp>
#include <cudamem/host_resource.hpp>
#include <cudamem/pool_resource.hpp>
#include <cudamem/statistics_adaptor.hpp>
#include <cudamem/stream.hpp>
#include <cudamem/thrust_allocator.hpp>

#include "gpu_test.hpp"
#include "graph_nodes.hpp"

#include <thrust/copy.h>
#include <thrust/device_vector.h>
#include <thrust/reduce.h>
#include <thrust/sort.h>

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

template <class T>
using device_vector = thrust::device_vector<T, thrust_allocator<T>>;

struct is_even {
  __host__ __device__ bool operator()(std::uint32_t x) const { return x % 2 == 0; }
};

std::vector<std::uint32_t> random_keys(std::size_t n, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<std::uint32_t> keys(n);
  for (auto& k : keys) {
    k = static_cast<std::uint32_t>(rng());
  }
  return keys;
}

template <class T>
std::vector<T> to_host(const device_vector<T>& v, const stream& s) {
  std::vector<T> host(v.size());
  check(cudaMemcpyAsync(host.data(), thrust::raw_pointer_cast(v.data()), v.size() * sizeof(T),
                        cudaMemcpyDeviceToHost, s.get()));
  s.synchronize();
  return host;
}

}  // namespace

TEST_CASE("exec_policy: sort, reduce and copy_if are right, and their temporaries come from the resource") {
  device_resource device;
  pool_resource pool{device};
  statistics_adaptor counted{pool};
  stream s;
  const std::size_t n = 1 << 20;
  const std::vector<std::uint32_t> host = random_keys(n, 1);

  device_vector<std::uint32_t> keys(host.begin(), host.end(), thrust_allocator<std::uint32_t>{counted, s});
  const allocation_counters after_vector = counted.counters();
  CHECK(after_vector.current_bytes == n * sizeof(std::uint32_t));  // the vector, from the resource

  SECTION("sort") {
    thrust::sort(exec_policy(counted, s), keys.begin(), keys.end());
    const allocation_counters c = counted.counters();
    // Radix sort takes a second key buffer and CUB's storage as temporaries: >= n keys' bytes.
    CHECK(c.allocations > after_vector.allocations);
    CHECK(c.allocated_bytes - after_vector.allocated_bytes >= n * sizeof(std::uint32_t));
    CHECK(c.current_bytes == after_vector.current_bytes);  // freed (in stream order) on return
    std::vector<std::uint32_t> expected = host;
    std::sort(expected.begin(), expected.end());
    CHECK(to_host(keys, s) == expected);
  }
  SECTION("reduce") {
    const std::uint64_t sum = thrust::reduce(exec_policy(counted, s), keys.begin(), keys.end(),
                                             std::uint64_t{0});
    CHECK(sum == std::accumulate(host.begin(), host.end(), std::uint64_t{0}));
    CHECK(counted.counters().allocations > after_vector.allocations);
    CHECK(counted.counters().current_bytes == after_vector.current_bytes);
  }
  SECTION("copy_if") {
    device_vector<std::uint32_t> evens(n, thrust_allocator<std::uint32_t>{counted, s});
    const allocation_counters before = counted.counters();
    auto end = thrust::copy_if(exec_policy(counted, s), keys.begin(), keys.end(), evens.begin(),
                               is_even{});
    evens.resize(static_cast<std::size_t>(end - evens.begin()));
    std::vector<std::uint32_t> expected;
    std::copy_if(host.begin(), host.end(), std::back_inserter(expected), is_even{});
    CHECK(to_host(evens, s) == expected);
    CHECK(counted.counters().allocations > before.allocations);
  }
  s.synchronize();
}

TEST_CASE("thrust_allocator: a device_vector's memory and its own work go through the resource on its stream") {
  device_resource device;
  pool_resource pool{device};
  statistics_adaptor counted{pool};
  stream s;
  const thrust_allocator<float> alloc{counted, s};
  {
    device_vector<float> v(1000, 1.5f, alloc);  // filled on s, by a kernel under exec_policy
    CHECK(counted.counters().current_bytes == 1000 * sizeof(float));
    CHECK(v.get_allocator() == alloc);
    CHECK(to_host(v, s) == std::vector<float>(1000, 1.5f));
    v.resize(3000, 2.5f);  // a new block, the old elements copied on s, the old block freed
    CHECK(counted.counters().current_bytes == v.capacity() * sizeof(float));
    CHECK(counted.counters().live_allocations() == 1);
    std::vector<float> expected(3000, 2.5f);
    std::fill(expected.begin(), expected.begin() + 1000, 1.5f);
    CHECK(to_host(v, s) == expected);

    device_vector<float> copy = v;  // copy-construction: the allocator is copied too
    CHECK(copy.get_allocator() == alloc);
    CHECK(to_host(copy, s) == expected);

    const std::vector<float> host{1, 2, 3, 4, 5};
    device_vector<float> w(host.begin(), host.end(), alloc);  // a host range copied on s
    CHECK(to_host(w, s) == host);
    copy = w;  // copy-assignment keeps the target's allocator and reuses its memory
    CHECK(to_host(copy, s) == host);
    device_vector<float> moved = std::move(w);  // the memory travels with its allocator
    CHECK(moved.get_allocator() == alloc);
    CHECK(to_host(moved, s) == host);
  }
  CHECK(counted.counters().current_bytes == 0);
  CHECK(counted.counters().live_allocations() == 0);

  host_resource host_memory;
  CHECK_THROWS_AS(thrust_allocator<int>(host_memory, s), std::invalid_argument);
  CHECK_THROWS_AS(exec_policy(host_memory, s), std::invalid_argument);
  s.synchronize();
}

TEST_CASE("exec_policy: under stream capture a sort records into a graph that owns its temporaries") {
  // A capturing stream refuses cudaFree, cudaStreamSynchronize and every call that would
  // synchronise the device, in this thread (global mode): thrust's default policy, which
  // takes temporaries with cudaMalloc, cannot be captured. Under exec_policy the sort is
  // captured, and its temporaries become the graph's own memory (allocation and free nodes):
  // a pool's blocks would go back to the pool at capture time, before the graph has run.
  device_resource device;
  pool_resource pool{device};
  statistics_adaptor counted{pool};
  stream s{{.non_blocking = true}};
  const std::size_t n = 1 << 16;
  const std::vector<std::uint32_t> host = random_keys(n, 2);
  device_vector<std::uint32_t> keys(host.begin(), host.end(), thrust_allocator<std::uint32_t>{counted, s});
  s.synchronize();

  const std::size_t allocations_before = counted.counters().allocations;
  check(cudaStreamBeginCapture(s.get(), cudaStreamCaptureModeGlobal));
  bool sorted_without_error = true;
  try {
    thrust::sort(exec_policy(counted, s), keys.begin(), keys.end());
  } catch (const std::exception& e) {
    sorted_without_error = false;
    INFO("thrust::sort under capture threw: " << e.what());
  }
  cudaGraph_t graph = nullptr;
  const cudaError_t ended = cudaStreamEndCapture(s.get(), &graph);
  REQUIRE(sorted_without_error);
  REQUIRE(ended == cudaSuccess);
  CHECK(counted.counters().allocations == allocations_before);  // the pool was not asked

  const std::size_t allocation_nodes = count_nodes(graph, cudaGraphNodeTypeMemAlloc);
  CHECK(allocation_nodes > 0);
  CHECK(count_nodes(graph, cudaGraphNodeTypeMemFree) == allocation_nodes);  // all freed inside

  // Other work takes memory from the pool before the graph runs: had the temporaries been
  // pool blocks, freed at capture time, `other` would now hold them and the graph would sort
  // through its contents. The graph runs twice; `other` stays intact.
  device_vector<std::uint32_t> other(n, 0xffffffffu, thrust_allocator<std::uint32_t>{counted, s});
  cudaGraphExec_t exec = nullptr;
  check(cudaGraphInstantiate(&exec, graph, 0));
  std::vector<std::uint32_t> expected = host;
  std::sort(expected.begin(), expected.end());
  for (int run = 0; run < 2; ++run) {
    check(cudaMemcpyAsync(thrust::raw_pointer_cast(keys.data()), host.data(),
                          n * sizeof(std::uint32_t), cudaMemcpyHostToDevice, s.get()));
    check(cudaGraphLaunch(exec, s.get()));
    CHECK(to_host(keys, s) == expected);
  }
  CHECK(to_host(other, s) == std::vector<std::uint32_t>(n, 0xffffffffu));
  check(cudaGraphExecDestroy(exec));
  check(cudaGraphDestroy(graph));
  check(cudaDeviceGraphMemTrim(current_device()));  // the graph's memory back to the device
}

TEST_CASE("exec_policy: nothing leaks when an allocation inside a thrust algorithm fails") {
  device_resource device;
  pool_resource pool{device};
  statistics_adaptor counted{pool};
  failing_adaptor faults{counted};
  stream s;
  const std::size_t n = 1 << 18;
  const std::vector<std::uint32_t> host = random_keys(n, 3);
  device_vector<std::uint32_t> keys(host.begin(), host.end(), thrust_allocator<std::uint32_t>{counted, s});
  const std::size_t vector_bytes = n * sizeof(std::uint32_t);

  // Sorting a reversed range: thrust copies it into a temporary (allocation 1), then asks for
  // the radix sort's storage (allocation 2), then copies back. Failing allocation 2 unwinds
  // while allocation 1 is live and its copy kernel queued.
  std::size_t failed_runs = 0;
  std::size_t calls_in_run_failing_the_second = 0;
  for (std::size_t k = 1;; ++k) {
    REQUIRE(k < 10);
    faults.fail_call(k);
    try {
      thrust::sort(exec_policy(faults, s), keys.rbegin(), keys.rend());
      break;  // reached the end: no k-th allocation
    } catch (const std::bad_alloc&) {
      ++failed_runs;
      if (k == 2) {
        calls_in_run_failing_the_second = faults.allocate_calls();
      }
    }
    INFO("after failing allocation " << k);
    REQUIRE(counted.counters().current_bytes == vector_bytes);  // every temporary came back
  }
  CHECK(failed_runs >= 2);
  CHECK(calls_in_run_failing_the_second == 2);  // allocation 1 succeeded, allocation 2 failed
  std::vector<std::uint32_t> expected = host;
  std::sort(expected.rbegin(), expected.rend());  // ascending when read backwards
  CHECK(to_host(keys, s) == expected);

  // A container whose allocation fails holds nothing.
  faults.fail_call(1);
  CHECK_THROWS_AS(device_vector<std::uint32_t>(n, thrust_allocator<std::uint32_t>{faults, s}),
                  std::bad_alloc);
  CHECK(counted.counters().current_bytes == vector_bytes);
  s.synchronize();
}
