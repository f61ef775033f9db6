// GPU: the adaptors over real device memory — tracking -> statistics -> limiting -> pool ->
// device_resource with device_buffers on a stream; a leaked device_buffer named at this file's
// line; out-of-memory reports with the device's real figures; a logged GPU run replayed on a
// simulated device.
#include "gpu_test.hpp"

#include <cudamem/device_buffer.hpp>
#include <cudamem/device_resource.hpp>
#include <cudamem/limiting_adaptor.hpp>
#include <cudamem/memory_report.hpp>  // the whole report: what() is its text
#include <cudamem/log_format.hpp>
#include <cudamem/logging_adaptor.hpp>
#include <cudamem/out_of_memory.hpp>
#include <cudamem/pool_resource.hpp>
#include <cudamem/replay.hpp>
#include <cudamem/simulated_resource.hpp>
#include <cudamem/statistics_adaptor.hpp>
#include <cudamem/stream.hpp>
#include <cudamem/tracking_adaptor.hpp>

#include <cuda_runtime_api.h>

#include <sstream>
#include <string>
#include <vector>

using namespace cudamem;
using cudamem_test::captured_errors;

namespace {
constexpr std::size_t MiB = std::size_t{1} << 20;
bool has(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}
}  // namespace

TEST_CASE("the chain over device memory: buffers work, every layer counts, all comes back") {
  const std::size_t free_before = cudamem_test::free_device_memory();
  {
    device_resource device;
    pool_resource pool{device};
    limiting_adaptor capped{pool, 64 * MiB};
    statistics_adaptor counted{capped};
    tracking_adaptor tracked{counted};
    stream s;
    {
      device_buffer<int> a(MiB, zero_fill, s, tracked);         // 4 MiB
      device_buffer<int> b(std::size_t{2} * MiB, 7, s, tracked);  // 8 MiB of sevens
      std::vector<int> host(2 * MiB);
      check(cudaMemcpyAsync(host.data(), b.data(), host.size() * sizeof(int),
                            cudaMemcpyDeviceToHost, s.get()));
      s.synchronize();
      CHECK(host.front() == 7);
      CHECK(host.back() == 7);
      CHECK(tracked.live_count() == 2);
      CHECK(tracked.find(b.data())->stream == s.get());
      CHECK(counted.counters().current_bytes == 12 * MiB);
      CHECK(capped.used_bytes() == 12 * MiB);
      try {
        device_buffer<char> too_much(60 * MiB, s, tracked);
        FAIL("no throw");
      } catch (const out_of_memory& e) {
        CHECK(e.verdict() == oom_verdict::budget);
        REQUIRE(e.report().chain.size() == 5);
        CHECK(e.report().chain[4].name == device.name());
        REQUIRE(e.report().device_total.has_value());  // real figures from cudaMemGetInfo
        CHECK(*e.report().device_total > 0);
        CHECK(has(e.what(), "budget of 64.00 MiB"));
      }
      CHECK(counted.counters().allocations == 2);
    }
    s.synchronize();
    CHECK(tracked.live_count() == 0);
    CHECK(counted.counters().current_bytes == 0);
    CHECK(counted.counters().peak_bytes == 12 * MiB);
    CHECK(capped.used_bytes() == 0);
    CHECK(pool.stats().used_bytes == 0);
  }
  CHECK(cudamem_test::free_device_memory() >= free_before - 2 * MiB);  // the pool gave it back
}

TEST_CASE("a leaked device_buffer is reported at this file's line") {
  captured_errors errors;
  device_resource device;
  released_memory leaked;
  unsigned line = 0;
  {
    tracking_adaptor tracked{device};
    stream s;
    line = __LINE__ + 1;
    device_buffer<float> buffer(MiB, s, tracked);
    leaked = buffer.release();  // ownership dropped: a leak, as far as the adaptor can tell
    s.synchronize();
  }
  REQUIRE(errors.messages().size() == 1);
  CHECK(has(errors.messages()[0], "test_adaptor_chain.cpp:" + std::to_string(line)));
  CHECK(has(errors.messages()[0], "4.00 MiB"));
  device.deallocate(leaked.ptr, leaked.bytes, leaked.alignment);  // tidy up for real
}

// cudaMalloc fails on purpose (an expected API error for compute-sanitizer).
TEST_CASE("larger than the device: the verdict and the device's real size",
          "[expected-api-error]") {
  device_resource device;
  tracking_adaptor tracked{device};
  const std::size_t total = device_memory(0).total;
  try {
    static_cast<void>(tracked.allocate(total + total / 2));
    FAIL("no throw");
  } catch (const out_of_memory& e) {
    CHECK(e.verdict() == oom_verdict::larger_than_device);
    CHECK(*e.report().device_total == total);
    CHECK(has(e.what(), "larger than the device's " + format_bytes(total)));
  }
  CHECK(tracked.live_count() == 0);
}

TEST_CASE("a logged GPU run replays on a simulated device") {
  device_resource device;
  pool_resource pool{device};
  std::ostringstream out;
  {
    logging_adaptor logged{pool, out, logging_options{.sample_reserved = true}};
    stream s;
    for (int i = 0; i < 20; ++i) {
      device_buffer<char> step(MiB * static_cast<std::size_t>(1 + i % 4), s, logged);
    }
    s.synchronize();
  }
  std::istringstream in{out.str()};
  const std::vector<log_event> events = read_log(in);
  REQUIRE(events.size() == 40);
  CHECK_FALSE(events[0].synchronous);
  CHECK(events[0].reserved.value_or(0) >= MiB);  // the device resource's bytes under the pool
  simulated_resource h100{{.capacity = 80ull << 30}};
  const replay_result r = replay_log(events, h100);
  CHECK_FALSE(r.failure);
  CHECK(r.peak_in_use == 4 * MiB);
}
