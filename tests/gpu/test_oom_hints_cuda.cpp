// Advice that fits, for the resources that call CUDA's allocators (they need a device to
// exist): each asked about every verdict, as tests/host/test_oom_hints.cpp does for the rest.
#include <cudamem/async_resource.hpp>
#include <cudamem/device_resource.hpp>
#include <cudamem/managed_resource.hpp>
#include <cudamem/memory_report.hpp>
#include <cudamem/out_of_memory.hpp>
#include <cudamem/pinned_resource.hpp>
#include <cudamem/stream.hpp>

#include "gpu_test.hpp"

#include <catch2/catch.hpp>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

using namespace cudamem;

namespace {

constexpr std::size_t MiB = std::size_t{1} << 20;

bool has(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

const std::vector<oom_verdict> all_verdicts = {
    oom_verdict::unknown,       oom_verdict::budget,         oom_verdict::larger_than_device,
    oom_verdict::fragmentation, oom_verdict::held_by_others, oom_verdict::exhausted};

/// `resource`'s own advice on a failed request of 100 MiB with `verdict` (the figures its own).
std::string advice_of(const memory_resource& resource, oom_verdict verdict) {
  memory_report r = make_memory_report(resource, 100 * MiB);
  r.verdict = verdict;
  return resource.oom_hint(r, 0);
}

/// Checks that `resource` advises, with `says`, exactly on `verdicts`.
void check_advice(const memory_resource& resource, const std::vector<oom_verdict>& verdicts,
                  const std::string& says) {
  for (const oom_verdict v : all_verdicts) {
    CAPTURE(resource.name(), to_string(v));
    const std::string advice = advice_of(resource, v);
    if (std::find(verdicts.begin(), verdicts.end(), v) != verdicts.end()) {
      CHECK(has(advice, says));
    } else {
      CHECK(advice.empty());
    }
  }
}

}  // namespace

TEST_CASE("device_resource advises on fragmentation of the device only") {
  device_resource device;
  check_advice(device, {oom_verdict::fragmentation}, "cudaMalloc could not find 100.00 MiB");
}

TEST_CASE("async_resource names the memory its CUDA pool keeps unused") {
  async_resource mr{{.release_threshold = UINT64_MAX}};
  stream s;
  void* p = mr.allocate(64 * MiB, 256, s);
  mr.deallocate(p, 64 * MiB, 256, s);
  s.synchronize();  // the pool keeps the 64 MiB (threshold), none of it in use
  check_advice(mr, {oom_verdict::fragmentation, oom_verdict::held_by_others, oom_verdict::exhausted},
               "The CUDA memory pool under this async_resource holds");
  CHECK(has(advice_of(mr, oom_verdict::exhausted), "trim(0)"));
  mr.trim(0);  // nothing kept: nothing to advise
  CHECK(advice_of(mr, oom_verdict::exhausted).empty());
}

TEST_CASE("managed_resource and pinned_resource advise on their own limits") {
  int managed = 0;
  check(cudaDeviceGetAttribute(&managed, cudaDevAttrManagedMemory, 0));
  if (managed != 0) {
    managed_resource mr;
    check_advice(mr, {oom_verdict::larger_than_device, oom_verdict::exhausted, oom_verdict::unknown},
                 "cudaMallocManaged could not give 100.00 MiB");
  }
  pinned_resource pinned;
  check_advice(pinned, {oom_verdict::unknown}, "Pinning 100.00 MiB of host memory failed");
}

// cudaMalloc fails on purpose (an expected API error for compute-sanitizer).
TEST_CASE("device_resource larger than the device: the general advice, and the holders asked",
          "[expected-api-error]") {
  device_resource device;
  const std::size_t total = device_memory(0).total;
  try {
    static_cast<void>(device.allocate(total + total / 2));
    FAIL("expected out_of_memory");
  } catch (const out_of_memory& e) {
    CHECK(e.verdict() == oom_verdict::larger_than_device);
    CHECK(e.report().resource_hint.empty());
    CHECK(has(e.what(), "split the work"));
    REQUIRE(e.report().holders.has_value());  // a real device: NVML was asked
    if (!e.report().holders->listed) {
      CHECK(has(e.what(), e.report().holders->reason));
    }
  }
}
