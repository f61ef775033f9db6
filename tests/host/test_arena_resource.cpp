// arena_resource and arena_scope: bump allocation, no-op frees, growth in geometric chunks,
// rewinding, release, bad input, and an upstream failing.
#include <cudamem/arena_resource.hpp>
#include <cudamem/host_resource.hpp>
#include <cudamem/out_of_memory.hpp>
#include <cudamem/simulated_resource.hpp>

#include <catch2/catch.hpp>

#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

using namespace cudamem;

namespace {
constexpr std::size_t KiB = 1024;
constexpr std::size_t MiB = std::size_t{1} << 20;

std::uintptr_t address(void* p) { return reinterpret_cast<std::uintptr_t>(p); }
}  // namespace

TEST_CASE("arena: consecutive allocations are bumped, aligned, and disjoint") {
  host_resource host;
  arena_resource arena{host, {.initial_chunk_size = 64 * KiB}};
  CHECK(arena.kind() == memory_kind::host);
  CHECK(arena.upstream() == &host);
  auto* a = static_cast<char*>(arena.allocate(100, 8));
  auto* b = static_cast<char*>(arena.allocate(100, 64));
  auto* c = static_cast<char*>(arena.allocate(1, 1));
  CHECK(address(b) % 64 == 0);
  CHECK(b >= a + 100);
  CHECK(c >= b + 100);
  CHECK(c < a + 64 * KiB);  // all from the first chunk
  std::memset(a, 1, 100);
  std::memset(b, 2, 100);
  CHECK(a[99] == 1);
  CHECK(arena.chunk_count() == 1);
  CHECK(arena.stats().reserved_bytes == 64 * KiB);
  CHECK(arena.stats().used_bytes >= 201);
  arena.deallocate(a, 100, 8);  // a no-op
  CHECK(arena.stats().used_bytes >= 201);
  CHECK(host.stats().used_bytes == 64 * KiB);
}

TEST_CASE("arena: chunks grow geometrically up to the maximum, or to the request") {
  simulated_resource device;
  arena_resource arena{device, {.initial_chunk_size = MiB, .growth_factor = 2.0,
                                .maximum_chunk_size = 4 * MiB}};
  std::vector<std::size_t> reserved;
  for (int i = 0; i < 5; ++i) {
    static_cast<void>(arena.allocate(MiB));  // each fills what is left of a chunk, or a new one
    reserved.push_back(arena.stats().reserved_bytes);
  }
  // chunks of 1, 2 (holds 2 requests), 4 (holds 4) MiB
  CHECK(reserved == std::vector<std::size_t>{MiB, 3 * MiB, 3 * MiB, 7 * MiB, 7 * MiB});
  static_cast<void>(arena.allocate(100 * MiB));  // larger than any chunk: its own size
  CHECK(arena.stats().reserved_bytes == 107 * MiB);
  CHECK(arena.chunk_count() == 4);
  arena.release();
  CHECK(arena.stats().reserved_bytes == 0);
  CHECK(arena.stats().used_bytes == 0);
  CHECK(device.used_bytes() == 0);
  static_cast<void>(arena.allocate(10));  // usable again after release, from the first size
  CHECK(arena.stats().reserved_bytes == MiB);
}

TEST_CASE("arena_scope rewinds: the next iteration reuses the same memory, no upstream call") {
  simulated_resource device;
  arena_resource arena{device, {.initial_chunk_size = MiB}};
  void* persistent = arena.allocate(1000);
  std::vector<void*> first;
  for (int iteration = 0; iteration < 3; ++iteration) {
    const arena_scope scratch{arena};
    std::vector<void*> these;
    for (int i = 0; i < 10; ++i) {
      these.push_back(arena.allocate(300 * KiB));  // spills into later chunks
    }
    if (iteration == 0) {
      first = these;
    } else {
      CHECK(these == first);  // the same addresses every iteration
    }
  }
  const std::size_t chunks = arena.chunk_count();
  const std::size_t reserved = device.used_bytes();
  {
    const arena_scope scratch{arena};
    static_cast<void>(arena.allocate(300 * KiB));
  }
  CHECK(arena.chunk_count() == chunks);
  CHECK(device.used_bytes() == reserved);
  CHECK(arena.stats().used_bytes < 2000);  // back to the persistent block only
  void* after = arena.allocate(8);
  CHECK(address(after) > address(persistent));
}

TEST_CASE("arena: nested scopes rewind to their own marks") {
  host_resource host;
  arena_resource arena{host, {.initial_chunk_size = 64 * KiB}};
  const arena_scope outer{arena};
  void* a = arena.allocate(100);
  void* b_first = nullptr;
  {
    const arena_scope inner{arena};
    b_first = arena.allocate(100);
  }
  void* b_again = arena.allocate(100);
  CHECK(b_again == b_first);
  CHECK(a != b_again);
}

TEST_CASE("arena: bad input and a failing upstream") {
  simulated_resource device{{.capacity = 8 * MiB}};
  arena_resource arena{device, {.initial_chunk_size = MiB}};
  CHECK(arena.allocate(0) == nullptr);
  CHECK_THROWS_AS(arena.allocate(10, 3), std::invalid_argument);
  CHECK_THROWS_AS(arena.allocate(std::numeric_limits<std::size_t>::max()), out_of_memory);
  static_cast<void>(arena.allocate(100));
  const resource_stats before = arena.stats();
  CHECK_THROWS_AS(arena.allocate(16 * MiB), out_of_memory);  // the upstream says no
  CHECK(arena.stats().reserved_bytes == before.reserved_bytes);
  CHECK(arena.stats().used_bytes == before.used_bytes);
  static_cast<void>(arena.allocate(100));  // still works
  CHECK_THROWS_AS((arena_resource{device, {.initial_chunk_size = 0}}), std::invalid_argument);
  CHECK_THROWS_AS((arena_resource{device, {.growth_factor = 0.5}}), std::invalid_argument);
}

TEST_CASE("arena: release in stream order and destruction return everything") {
  simulated_resource device;
  {
    arena_resource arena{device};
    static_cast<void>(arena.allocate(3 * MiB, 256, stream_view{}));
    arena.release(stream_view{});
    CHECK(device.used_bytes() == 0);
    static_cast<void>(arena.allocate(5 * MiB));
  }
  CHECK(device.used_bytes() == 0);
}
