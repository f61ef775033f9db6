// failing_adaptor over host_resource: which calls fail, what the failure says, and that
// everything else passes through untouched.
#include <cudamem/failing_adaptor.hpp>
#include <cudamem/host_resource.hpp>
#include <cudamem/out_of_memory.hpp>

#include <catch2/catch.hpp>

#include <limits>
#include <string>
#include <vector>

using namespace cudamem;

namespace {
/// Runs `calls` allocations of 64 bytes through `mr`; returns which ones (1-based) failed and
/// frees the rest.
std::vector<std::size_t> failing_calls(failing_adaptor& mr, std::size_t calls) {
  std::vector<std::size_t> failed;
  for (std::size_t i = 1; i <= calls; ++i) {
    try {
      void* p = mr.allocate(64, 16);
      mr.deallocate(p, 64, 16);
    } catch (const out_of_memory&) {
      failed.push_back(i);
    }
  }
  return failed;
}
}  // namespace

TEST_CASE("failing_adaptor: passes everything through until told otherwise") {
  host_resource host;
  failing_adaptor faults{host};
  CHECK(faults.kind() == memory_kind::host);
  CHECK(faults.device() == -1);
  CHECK(faults.upstream() == &host);
  CHECK(faults.name() == "failing_adaptor");
  CHECK(failing_calls(faults, 5).empty());
  CHECK(faults.allocate_calls() == 5);
  CHECK(faults.deallocate_calls() == 5);
  void* p = faults.allocate(100, 8, stream_view{});
  CHECK(faults.stats().used_bytes == 100);  // the upstream's figures
  faults.deallocate(p, 100, 8, stream_view{});
  CHECK(host.stats().used_bytes == 0);
}

TEST_CASE("failing_adaptor: fail_call(k) fails exactly the k-th call after the plan is set") {
  host_resource host;
  failing_adaptor faults{host};
  static_cast<void>(failing_calls(faults, 3));  // earlier calls do not count toward the plan
  for (std::size_t k = 1; k <= 4; ++k) {
    faults.fail_call(k);
    CHECK(failing_calls(faults, 6) == std::vector<std::size_t>{k});
    CHECK(faults.injected_failures() == 1);
    CHECK(faults.allocate_calls() == 6);
  }
  CHECK(host.stats().used_bytes == 0);
}

TEST_CASE("failing_adaptor: fail_from(k) fails the k-th call and every later one") {
  host_resource host;
  failing_adaptor faults{host};
  faults.fail_from(3);
  CHECK(failing_calls(faults, 6) == std::vector<std::size_t>{3, 4, 5, 6});
  faults.never_fail();
  CHECK(failing_calls(faults, 3).empty());
}

TEST_CASE("failing_adaptor: the failure is an out_of_memory that says it was injected") {
  host_resource host;
  failing_adaptor faults{host};
  faults.fail_call(1);
  try {
    static_cast<void>(faults.allocate(4096, 64, stream_view{}));
    FAIL("the first call should have failed");
  } catch (const out_of_memory& e) {
    CHECK(e.requested_bytes() == 4096);
    CHECK(e.report().alignment == 64);
    CHECK(e.report().cause.find("injected") != std::string::npos);
    CHECK(e.report().cause.find("call 1") != std::string::npos);
    REQUIRE(e.report().chain.size() == 2);
    CHECK(e.report().chain[0].name == "failing_adaptor");
    CHECK(e.report().chain[1].name == "host_resource");
  }
  CHECK(host.stats().used_bytes == 0);  // the upstream was never asked
  CHECK(host.stats().peak_used_bytes == 0);
}

TEST_CASE("failing_adaptor: random failures are deterministic for a seed and near p") {
  host_resource host;
  failing_adaptor faults{host};
  faults.fail_randomly(0.25, 42);
  const auto first = failing_calls(faults, 2000);
  faults.fail_randomly(0.25, 42);
  CHECK(failing_calls(faults, 2000) == first);
  CHECK(first.size() > 400);
  CHECK(first.size() < 600);
  faults.fail_randomly(0.25, 43);
  CHECK(failing_calls(faults, 2000) != first);
  faults.fail_randomly(0.0, 1);
  CHECK(failing_calls(faults, 100).empty());
  faults.fail_randomly(1.0, 1);
  CHECK(failing_calls(faults, 100).size() == 100);
}

TEST_CASE("failing_adaptor: bad plans are refused") {
  host_resource host;
  failing_adaptor faults{host};
  CHECK_THROWS_AS(faults.fail_call(0), std::invalid_argument);
  CHECK_THROWS_AS(faults.fail_from(0), std::invalid_argument);
  CHECK_THROWS_AS(faults.fail_randomly(-0.1, 1), std::invalid_argument);
  CHECK_THROWS_AS(faults.fail_randomly(1.5, 1), std::invalid_argument);
  CHECK_THROWS_AS(faults.fail_randomly(std::numeric_limits<double>::quiet_NaN(), 1), std::invalid_argument);
}

TEST_CASE("failing_adaptor: zero bytes and bad alignment never reach it") {
  host_resource host;
  failing_adaptor faults{host};
  faults.fail_from(1);
  CHECK(faults.allocate(0) == nullptr);
  CHECK_THROWS_AS(faults.allocate(64, 3), std::invalid_argument);
  CHECK(faults.allocate_calls() == 0);
}
