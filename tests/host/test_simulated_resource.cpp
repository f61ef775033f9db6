// simulated_resource: a pretend device — first fit, merging, paged layout, capacity, reports,
// bad input.
#include <cudamem/memory_report.hpp>
#include <cudamem/out_of_memory.hpp>
#include <cudamem/simulated_resource.hpp>

#include "captured_errors.hpp"

#include <catch2/catch.hpp>

#include <cstdint>
#include <vector>

using namespace cudamem;

namespace {
constexpr std::size_t MiB = std::size_t{1} << 20;
constexpr std::size_t GiB = std::size_t{1} << 30;
std::uintptr_t address(void* p) { return reinterpret_cast<std::uintptr_t>(p); }
}  // namespace

TEST_CASE("simulated: an 80 GiB device with no memory behind it") {
  simulated_resource device;
  CHECK(device.kind() == memory_kind::device);
  CHECK(device.device() == -1);
  CHECK(device.capacity() == 80 * GiB);
  CHECK(device.stats().capacity == 80 * GiB);
  std::vector<void*> blocks;
  for (int i = 0; i < 79; ++i) {
    blocks.push_back(device.allocate(GiB));
  }
  CHECK(device.used_bytes() == 79 * GiB);
  CHECK(device.contains(blocks[0]));
  int local = 0;
  CHECK_FALSE(device.contains(&local));
  for (void* p : blocks) {
    device.deallocate(p, GiB);
  }
  CHECK(device.used_bytes() == 0);
  CHECK(device.free_range_count() == 1);
  CHECK(device.stats().peak_used_bytes == 79 * GiB);
}

TEST_CASE("simulated first fit: lowest range first, neighbours merge, holes fragment") {
  simulated_resource device{{.capacity = 1 * GiB}};
  void* a = device.allocate(64 * MiB);
  void* b = device.allocate(64 * MiB);
  void* c = device.allocate(64 * MiB);
  CHECK(address(b) == address(a) + 64 * MiB);
  CHECK(address(c) == address(b) + 64 * MiB);
  device.deallocate(a, 64 * MiB);
  CHECK(device.allocate(32 * MiB) == a);  // the lowest hole that fits
  device.deallocate(a, 32 * MiB);
  device.deallocate(b, 64 * MiB);  // merges with the hole below
  CHECK(device.free_range_count() == 2);
  CHECK(device.allocate(128 * MiB) == a);
  device.deallocate(a, 128 * MiB);
  device.deallocate(c, 64 * MiB);
  CHECK(device.free_range_count() == 1);
  CHECK(device.largest_free_range() == 1 * GiB);

  // Swiss cheese: half the device free in 64 MiB holes, yet 128 MiB fails.
  std::vector<void*> blocks;
  for (int i = 0; i < 16; ++i) {
    blocks.push_back(device.allocate(64 * MiB));
  }
  for (int i = 0; i < 16; i += 2) {
    device.deallocate(blocks[i], 64 * MiB);
  }
  CHECK(device.largest_free_range() == 64 * MiB);
  CHECK_THROWS_AS(device.allocate(128 * MiB), out_of_memory);
  for (int i = 1; i < 16; i += 2) {
    device.deallocate(blocks[i], 64 * MiB);
  }
}

TEST_CASE("simulated paged: like cudaMalloc with virtual memory, free bytes are always usable") {
  simulated_resource device{{.capacity = 1 * GiB, .layout = simulated_layout::paged}};
  std::vector<void*> blocks;
  for (int i = 0; i < 16; ++i) {
    blocks.push_back(device.allocate(64 * MiB));
  }
  CHECK_THROWS_AS(device.allocate(1), out_of_memory);
  for (int i = 0; i < 16; i += 2) {
    device.deallocate(blocks[i], 64 * MiB);
  }
  void* big = device.allocate(512 * MiB);  // 8 holes of 64 MiB make one 512 MiB block
  CHECK(address(big) % 256 == 0);
  device.deallocate(big, 512 * MiB);
  for (int i = 1; i < 16; i += 2) {
    device.deallocate(blocks[i], 64 * MiB);
  }
  CHECK(device.used_bytes() == 0);
}

TEST_CASE("simulated: alignment, out-of-memory report, bad input") {
  simulated_resource device{{.capacity = 1 * GiB}};
  void* small = device.allocate(100);
  void* aligned = device.allocate(100, 1 << 20);
  CHECK(address(aligned) % (1 << 20) == 0);
  try {
    static_cast<void>(device.allocate(2 * GiB));
    FAIL("expected out_of_memory");
  } catch (const out_of_memory& e) {
    CHECK(e.verdict() == oom_verdict::larger_than_device);
    CHECK(e.report().device_total == 1 * GiB);
  }
  cudamem_test::captured_errors errors;
  int local = 0;
  device.deallocate(&local, 4);
  device.deallocate(small, 100);
  device.deallocate(small, 100);  // double free
  REQUIRE(errors.messages().size() == 2);
  CHECK_THAT(errors.messages()[0], Catch::Contains("did not give out"));
  device.deallocate(aligned, 5000);  // wrong size: reported, its own size freed
  REQUIRE(errors.messages().size() == 3);
  CHECK(device.used_bytes() == 0);
  CHECK(device.free_range_count() == 1);
  CHECK_THROWS_AS(simulated_resource({.capacity = 1 * GiB, .granularity = 3}), std::invalid_argument);
  CHECK_THROWS_AS(simulated_resource({.capacity = 0}), std::invalid_argument);
  simulated_resource other;
  void* p = other.allocate(10);
  CHECK_FALSE(device.contains(p));
  other.deallocate(p, 10);
}
