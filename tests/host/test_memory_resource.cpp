// memory_resource.hpp's contract, checked on host_resource and on a resource that records
// what reaches its do_* functions.
#include <cudamem/host_resource.hpp>
#include <cudamem/memory_resource.hpp>
#include <cudamem/out_of_memory.hpp>

#include <catch2/catch.hpp>

#include <cstdint>
#include <limits>
#include <vector>

using namespace cudamem;

namespace {

/// Records every call that reaches the virtual functions; hands out host memory.
class recording_resource final : public memory_resource {
 public:
  recording_resource() : memory_resource(memory_kind::host, -1) {}
  int allocations = 0;
  int deallocations = 0;
  stream_view last_stream{};

 private:
  void* do_allocate(std::size_t bytes, std::size_t alignment, stream_view s) override {
    ++allocations;
    last_stream = s;
    return host_.allocate(bytes, alignment);
  }
  void do_deallocate(void* p, std::size_t bytes, std::size_t alignment,
                     stream_view s) noexcept override {
    ++deallocations;
    last_stream = s;
    host_.deallocate(p, bytes, alignment);
  }
  void* do_allocate_sync(std::size_t bytes, std::size_t alignment) override {
    return do_allocate(bytes, alignment, stream_view{});
  }
  void do_deallocate_sync(void* p, std::size_t bytes, std::size_t alignment) noexcept override {
    do_deallocate(p, bytes, alignment, stream_view{});
  }
  host_resource host_;
};

}  // namespace

TEST_CASE("zero bytes gives nullptr and calls nothing; freeing nullptr is a no-op") {
  recording_resource mr;
  CHECK(mr.allocate(0) == nullptr);
  CHECK(mr.allocate(0, 64, stream_view::per_thread()) == nullptr);
  mr.deallocate(nullptr, 100);
  mr.deallocate(nullptr, 100, 64, stream_view::per_thread());
  CHECK(mr.allocations == 0);
  CHECK(mr.deallocations == 0);
}

TEST_CASE("alignment must be a non-zero power of two") {
  recording_resource mr;
  for (std::size_t bad : {std::size_t{0}, std::size_t{3}, std::size_t{48}, std::size_t{1000},
                          std::numeric_limits<std::size_t>::max()}) {
    CAPTURE(bad);
    CHECK_THROWS_AS(mr.allocate(64, bad), std::invalid_argument);
    CHECK_THROWS_AS(mr.allocate(64, bad, stream_view{}), std::invalid_argument);
    CHECK_THROWS_WITH(mr.allocate(64, bad), Catch::Contains("not a power of two"));
  }
  CHECK(mr.allocations == 0);
}

TEST_CASE("the stream reaches the resource; the synchronous form uses none") {
  recording_resource mr;
  void* p = mr.allocate(128, 16, stream_view::per_thread());
  CHECK(mr.last_stream == stream_view::per_thread());
  mr.deallocate(p, 128, 16, stream_view::per_thread());
  void* q = mr.allocate_sync(128, 16);
  CHECK(mr.last_stream == stream_view{});
  mr.deallocate_sync(q, 128, 16);
  CHECK(mr.allocations == 2);
  CHECK(mr.deallocations == 2);
}

TEST_CASE("host_resource: every alignment honoured, bytes counted, nothing left behind") {
  host_resource mr;
  CHECK(mr.kind() == memory_kind::host);
  CHECK(mr.device() == -1);
  CHECK(mr.name() == "host_resource");
  std::vector<std::pair<void*, std::size_t>> live;
  for (std::size_t align = 1; align <= 4096; align *= 2) {
    void* p = mr.allocate(align * 3 + 1, align, stream_view{});
    REQUIRE(p != nullptr);
    CHECK(reinterpret_cast<std::uintptr_t>(p) % align == 0);
    live.emplace_back(p, align);
  }
  CHECK(mr.stats().used_bytes > 0);
  for (auto [p, align] : live) {
    mr.deallocate(p, align * 3 + 1, align, stream_view{});
  }
  CHECK(mr.stats().used_bytes == 0);
  CHECK(mr.stats().peak_used_bytes > 0);
}

TEST_CASE("host_resource: an impossible request is out_of_memory, a std::bad_alloc") {
  host_resource mr;
  const std::size_t huge = std::numeric_limits<std::size_t>::max() / 2;
  CHECK_THROWS_AS(mr.allocate(huge), out_of_memory);
  CHECK_THROWS_AS(mr.allocate(huge), std::bad_alloc);
  try {
    static_cast<void>(mr.allocate(huge, 64));
  } catch (const out_of_memory& e) {
    CHECK(e.requested_bytes() == huge);
    CHECK(e.report().alignment == 64);
    CHECK(std::string(e.what()).find("could not allocate") != std::string::npos);
  }
  CHECK(mr.stats().used_bytes == 0);
}

TEST_CASE("is_equal: host resources are interchangeable, others are not") {
  host_resource a;
  host_resource b;
  recording_resource c;
  CHECK(a == b);
  CHECK(a.is_equal(b));
  CHECK_FALSE(a == c);
  CHECK(c == c);
}

TEST_CASE("memory kinds say who can touch them") {
  CHECK(is_device_accessible(memory_kind::device));
  CHECK_FALSE(is_host_accessible(memory_kind::device));
  CHECK(is_host_accessible(memory_kind::pinned));
  CHECK(is_device_accessible(memory_kind::pinned));
  CHECK(is_host_accessible(memory_kind::managed));
  CHECK(is_device_accessible(memory_kind::managed));
  CHECK(is_host_accessible(memory_kind::host));
  CHECK_FALSE(is_device_accessible(memory_kind::host));
  CHECK(to_string(memory_kind::pinned) == "pinned host");
}

TEST_CASE("resource_stats: free bytes and fragmentation") {
  resource_stats s;
  CHECK(s.fragmentation() == 0.0);
  s.reserved_bytes = 1000;
  s.used_bytes = 600;
  CHECK(s.free_bytes() == 400);
  CHECK(s.fragmentation() == 0.0);  // a resource that cannot tell its blocks
  s.largest_free_block = 100;
  CHECK(s.fragmentation() == Approx(0.75));
  s.largest_free_block = 400;
  CHECK(s.fragmentation() == Approx(0.0));
}

namespace {
/// Remembers the allocation site it saw in do_allocate.
class site_recording_resource final : public memory_resource {
 public:
  site_recording_resource() : memory_resource(memory_kind::host, -1) {}
  std::source_location seen;

 private:
  void* do_allocate(std::size_t bytes, std::size_t alignment, stream_view) override {
    seen = current_allocation_site();
    return host_.allocate(bytes, alignment);  // nested: must not replace the user's site
  }
  void do_deallocate(void* p, std::size_t bytes, std::size_t alignment,
                     stream_view) noexcept override {
    host_.deallocate(p, bytes, alignment);
  }
  void* do_allocate_sync(std::size_t bytes, std::size_t alignment) override {
    return do_allocate(bytes, alignment, stream_view{});
  }
  void do_deallocate_sync(void* p, std::size_t bytes, std::size_t alignment) noexcept override {
    do_deallocate(p, bytes, alignment, stream_view{});
  }
  host_resource host_;
};
}  // namespace

TEST_CASE("the caller's line reaches the resource, through nested calls, and is cleared after") {
  site_recording_resource mr;
  const unsigned line = __LINE__ + 1;
  void* p = mr.allocate(64, 8, stream_view{});
  CHECK(mr.seen.line() == line);
  CHECK(std::string(mr.seen.file_name()).find("test_memory_resource.cpp") != std::string::npos);
  mr.deallocate(p, 64, 8, stream_view{});
  const unsigned line2 = __LINE__ + 1;
  void* q = mr.allocate_sync(64, 8);
  CHECK(mr.seen.line() == line2);
  mr.deallocate_sync(q, 64, 8);
  CHECK(current_allocation_site().line() == 0);
}
