// The scoped guards on a real device: each one with an exception inside its scope, and the
// state checked after. Limits restored (and the malloc heap's documented exception: fixed once
// a kernel has used `new`), sync guards that really wait for work in flight.
#include <cudamem/context.hpp>
#include <cudamem/limit_guard.hpp>
#include <cudamem/stream.hpp>
#include <cudamem/sync_guard.hpp>

#include "gpu_test.hpp"

#include <cuda_runtime_api.h>

#include <cstddef>
#include <stdexcept>

using namespace cudamem;

namespace {

constexpr std::size_t MiB = std::size_t{1} << 20;

struct planned_failure : std::runtime_error {
  planned_failure() : std::runtime_error("planned failure") {}
};

/// Keeps one SM busy for `cycles` clock cycles (200 M cycles: ~0.1 s at 1.5-2 GHz).
__global__ void spin_for(long long cycles) {
  const long long start = clock64();
  while (clock64() - start < cycles) {
  }
}

/// A common pattern: device-side `new`, which draws on the device malloc heap.
__global__ void uses_new(int* ok) {
  int* p = new int[16];
  ok[threadIdx.x] = p != nullptr ? 1 : 0;
  delete[] p;
}

}  // namespace

TEST_CASE("limit_guard restores a limit on the exception path") {
  const std::size_t before = get_limit(cudaLimitStackSize);
  try {
    limit_guard stack{cudaLimitStackSize, before * 2};
    CHECK(stack.changed());
    CHECK(stack.previous() == before);
    CHECK(get_limit(cudaLimitStackSize) == stack.value());
    CHECK(stack.value() >= before * 2);
    throw planned_failure{};
  } catch (const planned_failure&) {
  }
  CHECK(get_limit(cudaLimitStackSize) == before);
  {
    limit_guard same{cudaLimitStackSize, before};  // no change: nothing to restore
    CHECK_FALSE(same.changed());
  }
  CHECK(get_limit(cudaLimitStackSize) == before);
}

TEST_CASE("limit_guard: bad limits are refused and change nothing", "[expected-api-error]") {
  CHECK_THROWS_AS(limit_guard(static_cast<cudaLimit>(0x7777), 1), cuda_error);
  CHECK_THROWS_AS(get_limit(static_cast<cudaLimit>(0x7777)), cuda_error);
}

TEST_CASE("limit_guard restores on the device it was made on") {
  if (device_count() < 2) {
    SUCCEED("one device: nothing to switch");
    return;
  }
  device_guard on0{0};
  const std::size_t before = get_limit(cudaLimitStackSize);
  {
    limit_guard stack{cudaLimitStackSize, before * 2};
    check(cudaSetDevice(1));  // another device is current when the guard ends
  }
  CHECK(current_device() == 1);  // the guard left the current device alone
  check(cudaSetDevice(0));
  CHECK(get_limit(cudaLimitStackSize) == before);
}

TEST_CASE("heap_limit_guard raises, never lowers, and restores before first use") {
  const std::size_t before = get_limit(cudaLimitMallocHeapSize);
  try {
    heap_limit_guard heap{before + 64 * MiB};
    CHECK(heap.changed());
    CHECK(get_limit(cudaLimitMallocHeapSize) >= before + 64 * MiB);
    throw planned_failure{};
  } catch (const planned_failure&) {
  }
  CHECK(get_limit(cudaLimitMallocHeapSize) == before);
  {
    heap_limit_guard small{1024};  // already larger: left alone
    CHECK_FALSE(small.changed());
    CHECK(small.value() == before);
  }
  CHECK(get_limit(cudaLimitMallocHeapSize) == before);
}

TEST_CASE("heap_limit_guard: once a kernel used new, the heap is fixed; restore says so quietly",
          "[expected-api-error]") {
  // In a context of its own, so that fixing the heap does not affect the rest of this process.
  const cudamem_test::captured_errors captured;
  context ctx{{.device = 0}};
  context_guard on{ctx};
  const std::size_t before = get_limit(cudaLimitMallocHeapSize);
  int* ok = nullptr;
  check(cudaMalloc(&ok, 32 * sizeof(int)));
  {
    heap_limit_guard heap{before + 32 * MiB};
    uses_new<<<1, 32>>>(ok);
    check(cudaGetLastError());
    check(cudaDeviceSynchronize());
    CHECK_FALSE(heap.restore());  // refused: a kernel used the heap
    CHECK(get_limit(cudaLimitMallocHeapSize) >= before + 32 * MiB);
  }
  CHECK(captured.messages().empty());  // the documented refusal is not an error report
  // And asking for a new size now is refused at construction, with CUDA's error.
  CHECK_THROWS_AS(heap_limit_guard{before + 128 * MiB}, cuda_error);
  int host[32] = {};
  check(cudaMemcpy(host, ok, sizeof(host), cudaMemcpyDeviceToHost));
  for (const int value : host) {
    CHECK(value == 1);
  }
  check(cudaFree(ok));
}

TEST_CASE("synchronize_on_exit waits for work in flight when an exception leaves the scope") {
  stream s;
  // Control: right after a launch, the stream is busy (else this test could not fail).
  spin_for<<<1, 1, 0, s.get()>>>(200'000'000);
  check(cudaGetLastError());
  CHECK_FALSE(s.is_idle());
  s.synchronize();

  try {
    synchronize_on_exit wait_for{s};
    spin_for<<<1, 1, 0, s.get()>>>(200'000'000);
    check(cudaGetLastError());
    throw planned_failure{};
  } catch (const planned_failure&) {
  }
  CHECK(s.is_idle());

  {
    synchronize_on_exit wait_for{s};
    spin_for<<<1, 1, 0, s.get()>>>(200'000'000);
    wait_for.finish();  // the normal path: waits now, throws on error
    CHECK(s.is_idle());
  }
}

TEST_CASE("synchronize_device_on_exit waits for every stream of the device") {
  stream a{{.non_blocking = true}};
  stream b{{.non_blocking = true}};
  try {
    synchronize_device_on_exit wait_for_all{0};
    spin_for<<<1, 1, 0, a.get()>>>(200'000'000);
    spin_for<<<1, 1, 0, b.get()>>>(200'000'000);
    check(cudaGetLastError());
    throw planned_failure{};
  } catch (const planned_failure&) {
  }
  CHECK(a.is_idle());
  CHECK(b.is_idle());
  CHECK(current_device() == 0);
  CHECK_THROWS_AS(synchronize_device_on_exit{device_count()}, std::out_of_range);
  CHECK_THROWS_AS(synchronize_device_on_exit{-1}, std::out_of_range);
}
