// out_of_memory in a program where no file includes memory_report.hpp (out_of_memory.hpp's
// contract): the report carries the request, the cause, the chain's figures, the device's free
// and total memory and the verdict; what() says what is left out and which header brings it.
// This test binary must stay without memory_report.hpp (and cudamem.hpp), in every file it
// links: the first test checks that nothing registered the whole report.
#include <cudamem/limiting_adaptor.hpp>
#include <cudamem/out_of_memory.hpp>
#include <cudamem/pool_resource.hpp>
#include <cudamem/simulated_resource.hpp>

#include <catch2/catch.hpp>

#include <string>

using namespace cudamem;

namespace {
constexpr std::size_t MiB = std::size_t{1} << 20;
constexpr std::size_t GiB = std::size_t{1} << 30;
const std::string left_out =
    "Who holds the device, each resource's figures and the advice are left out: no file of "
    "this program includes <cudamem/memory_report.hpp>, which compiles them.";

bool has(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}
}  // namespace

TEST_CASE("no memory_report.hpp in the program: nothing registered the whole report") {
  CHECK(detail::registered_report_completion() == nullptr);
}

TEST_CASE("without memory_report.hpp: the device exhausted, measured and said so") {
  simulated_resource device{{.capacity = 1 * GiB}};
  void* held = device.allocate(768 * MiB);
  try {
    static_cast<void>(device.allocate(512 * MiB));
    FAIL("512 MiB fitted in the 256 MiB left");
  } catch (const out_of_memory& e) {
    const memory_report& r = e.report();
    CHECK(e.requested_bytes() == 512 * MiB);
    CHECK(e.verdict() == oom_verdict::exhausted);
    REQUIRE(r.chain.size() == 1);
    CHECK(r.chain[0].stats.used_bytes == 768 * MiB);
    CHECK(r.device_total == 1 * GiB);
    CHECK(r.device_free == 256 * MiB);
    CHECK(r.resource_hint.empty());  // advice is the whole report's
    CHECK_FALSE(r.holders);
    const std::string what = e.what();
    INFO(what);
    CHECK(has(what, "cudamem: out of memory: could not allocate 512.00 MiB (alignment 256)."));
    CHECK(has(what, "Device: 256.00 MiB free of 1.00 GiB; this chain holds 768.00 MiB."));
    CHECK(has(what, "Verdict: exhausted."));
    CHECK(has(what, left_out));
  }
  // Nothing was lost: the device still has its 256 MiB, and gives everything back.
  void* rest = device.allocate(256 * MiB);
  device.deallocate(rest, 256 * MiB);
  device.deallocate(held, 768 * MiB);
  CHECK(device.used_bytes() == 0);
}

TEST_CASE("without memory_report.hpp: a request larger than the device") {
  simulated_resource device{{.capacity = 1 * GiB}};
  try {
    static_cast<void>(device.allocate(2 * GiB));
    FAIL("2 GiB fitted in a 1 GiB device");
  } catch (const out_of_memory& e) {
    CHECK(e.verdict() == oom_verdict::larger_than_device);
    CHECK(has(e.what(), "could not allocate 2.00 GiB"));
    CHECK(has(e.what(), left_out));
  }
}

TEST_CASE("without memory_report.hpp: a budget passed, through an adaptor and a pool") {
  simulated_resource device{{.capacity = 4 * GiB}};
  limiting_adaptor limit{device, 1 * GiB};
  pool_resource pool{limit};
  void* a = pool.allocate(768 * MiB);
  try {
    static_cast<void>(pool.allocate(512 * MiB));
    FAIL("the budget let 1.25 GiB through");
  } catch (const out_of_memory& e) {
    const memory_report& r = e.report();
    CHECK(e.verdict() == oom_verdict::budget);
    REQUIRE(r.chain.size() == 3);  // the pool, the limit, the device
    CHECK(r.chain[1].stats.budget == 1 * GiB);
    CHECK(r.verdict_subject() == std::size_t{1});
    CHECK(has(e.what(), "Verdict: budget."));
    CHECK(has(e.what(), r.chain[r.origin].name + " failed first."));
    CHECK(has(e.what(), left_out));
  }
  pool.deallocate(a, 768 * MiB);
  pool.release();
  CHECK(device.used_bytes() == 0);
}
