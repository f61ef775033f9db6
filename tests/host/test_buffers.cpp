// device_buffer, pinned_buffer, device_span and copy() logic that needs no GPU: sizes, moves,
// release, the stream and resource a free goes to, overflow, kind refusal, size mismatches,
// and clear errors (never a crash, never a leak) where CUDA itself is needed and absent.
#include <cudamem/copy.hpp>
#include <cudamem/device.hpp>
#include <cudamem/device_buffer.hpp>
#include <cudamem/device_span.hpp>
#include <cudamem/host_resource.hpp>
#include <cudamem/pinned_buffer.hpp>

#include "fake_device_memory.hpp"

#include <catch2/catch.hpp>

#include <array>
#include <cstdint>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

using namespace cudamem;
using cudamem_test::fake_device_memory;

namespace {
const stream_view stream_a{reinterpret_cast<cudaStream_t>(std::uintptr_t{0x1000})};
const stream_view stream_b{reinterpret_cast<cudaStream_t>(std::uintptr_t{0x2000})};
struct pair_of_ints {
  int a;
  int b;
};
}  // namespace

static_assert(std::is_trivially_copyable_v<device_span<int>>);
static_assert(std::is_convertible_v<device_span<int>, device_span<const int>>);
static_assert(!std::is_convertible_v<device_span<const int>, device_span<int>>);
static_assert(!std::is_copy_constructible_v<device_buffer<int>>);
static_assert(std::is_nothrow_move_constructible_v<device_buffer<int>>);
static_assert(std::is_nothrow_move_assignable_v<device_buffer<int>>);
static_assert(std::is_nothrow_destructible_v<device_buffer<int>>);
static_assert(!std::is_copy_constructible_v<pinned_buffer<int>>);
static_assert(std::is_nothrow_move_constructible_v<pinned_buffer<int>>);
static_assert(std::is_convertible_v<device_buffer<int>&, device_span<int>>);
static_assert(std::is_convertible_v<const device_buffer<int>&, device_span<const int>>);
static_assert(!std::is_convertible_v<const device_buffer<int>&, device_span<int>>);
static_assert(std::is_convertible_v<pinned_buffer<int>&, gsl::span<int>>);
static_assert(device_buffer<double>::alignment == default_alignment);

TEST_CASE("device_span: a pointer and a count, with narrower views") {
  std::array<int, 6> storage{0, 1, 2, 3, 4, 5};
  device_span<int> s{storage.data(), storage.size()};
  CHECK(s.size() == 6);
  CHECK(s.size_bytes() == 6 * sizeof(int));
  CHECK_FALSE(s.empty());
  CHECK(s[2] == 2);
  CHECK(s.front() == 0);
  CHECK(s.back() == 5);
  CHECK(s.first(2).size() == 2);
  CHECK(s.last(2).front() == 4);
  CHECK(s.subspan(1, 3).back() == 3);
  CHECK(s.subspan(4).size() == 2);
  device_span<const int> c = s;
  CHECK(c.data() == storage.data());
  CHECK(device_span<int>{}.empty());
}

TEST_CASE("device_buffer: owns n elements from its resource and frees them on its stream") {
  fake_device_memory mr;
  {
    device_buffer<int> b(100, stream_a, mr);
    CHECK(b.size() == 100);
    CHECK(b.size_bytes() == 400);
    CHECK(b.capacity() == 100);
    CHECK_FALSE(b.empty());
    CHECK(b.data() != nullptr);
    CHECK(b.stream() == stream_a);
    CHECK(&b.resource() == &mr);
    CHECK(b.device() == 0);
    CHECK(b.span().data() == b.data());
    CHECK(b.span().size() == 100);
    CHECK(mr.used_bytes() == 400);
    CHECK(mr.last_alignment == default_alignment);
  }
  CHECK(mr.used_bytes() == 0);
  CHECK(mr.deallocations == 1);
  CHECK(mr.last_free_stream == stream_a);
}

TEST_CASE("device_buffer: zero elements allocate nothing") {
  fake_device_memory mr;
  device_buffer<int> b(0, stream_a, mr);
  CHECK(b.empty());
  CHECK(b.data() == nullptr);
  CHECK(mr.allocations == 0);
  device_buffer<int> z(0, zero_fill, stream_a, mr);   // no CUDA call for nothing to fill
  device_buffer<int> v(0, 7, stream_a, mr);
  device_buffer<int> h(std::vector<int>{}, stream_a, mr);
  CHECK(mr.allocations == 0);
}

TEST_CASE("device_buffer: moves transfer ownership; move-assignment frees the old memory") {
  fake_device_memory mr;
  device_buffer<int> a(10, stream_a, mr);
  int* const p = a.data();
  device_buffer<int> b(std::move(a));
  CHECK(b.data() == p);
  CHECK(b.size() == 10);
  CHECK(a.empty());            // NOLINT: checking the moved-from state is the point
  CHECK(a.data() == nullptr);  // NOLINT
  CHECK(&a.resource() == &mr); // NOLINT: still knows where memory would come from
  device_buffer<int> c(20, stream_b, mr);
  CHECK(mr.used_bytes() == 120);
  c = std::move(b);
  CHECK(mr.deallocations == 1);
  CHECK(mr.last_free_stream == stream_b);  // c's old block, on c's old stream
  CHECK(mr.used_bytes() == 40);
  CHECK(c.data() == p);
  CHECK(c.stream() == stream_a);
  auto& alias = c;  // through a reference, so that -Wself-move sees no mistake
  c = std::move(alias);  // self-move: no change
  CHECK(c.data() == p);
}

TEST_CASE("device_buffer: release hands back everything needed to free later") {
  fake_device_memory mr;
  released_memory r;
  {
    device_buffer<double> b(8, stream_b, mr);
    r = b.release();
    CHECK(b.empty());
    CHECK(b.data() == nullptr);
  }
  CHECK(mr.deallocations == 0);
  CHECK(r.ptr != nullptr);
  CHECK(r.bytes == 64);
  CHECK(r.alignment == device_buffer<double>::alignment);
  CHECK(r.stream == stream_b);
  CHECK(r.resource == &mr);
  r.resource->deallocate(r.ptr, r.bytes, r.alignment, r.stream);
  CHECK(mr.used_bytes() == 0);
}

TEST_CASE("device_buffer: n * sizeof(T) overflow is a length_error, not a small allocation") {
  fake_device_memory mr;
  const std::size_t too_many = std::numeric_limits<std::size_t>::max() / sizeof(double) + 1;
  CHECK_THROWS_AS(device_buffer<double>(too_many, stream_a, mr), std::length_error);
  CHECK_THROWS_WITH(device_buffer<double>(too_many, stream_a, mr), Catch::Contains("overflow"));
  CHECK_THROWS_AS(device_buffer<double>(too_many, 1.0, stream_a, mr), std::length_error);
  CHECK_THROWS_AS(device_buffer<double>(too_many, zero_fill, stream_a, mr), std::length_error);
  device_buffer<double> b(4, stream_a, mr);
  CHECK_THROWS_AS(b.resize(too_many, stream_a), std::length_error);
  CHECK_THROWS_AS(b.reserve(too_many, stream_a), std::length_error);
  CHECK(b.size() == 4);
  CHECK(mr.allocations == 1);  // nothing reached the resource
  CHECK(device_buffer<double>::max_size() == too_many - 1);
}

TEST_CASE("device_buffer: host memory is refused, naming the kind") {
  host_resource host;
  CHECK_THROWS_AS(device_buffer<int>(4, stream_a, host), std::invalid_argument);
  CHECK_THROWS_WITH(device_buffer<int>(4, stream_a, host), Catch::Contains("host memory"));
  for (auto kind : {memory_kind::device, memory_kind::managed, memory_kind::pinned}) {
    fake_device_memory ok{kind};
    CHECK_NOTHROW(device_buffer<int>(4, stream_a, ok));
  }
  CHECK(host.stats().peak_used_bytes == 0);
}

TEST_CASE("device_buffer: resize and reserve within the capacity allocate nothing") {
  fake_device_memory mr;
  device_buffer<int> b(10, stream_a, mr);
  int* const p = b.data();
  b.resize(4, stream_a);
  CHECK(b.size() == 4);
  CHECK(b.capacity() == 10);
  b.reserve(8, stream_a);
  CHECK(b.size() == 4);
  b.resize(10, stream_a);
  CHECK(b.data() == p);
  CHECK(mr.allocations == 1);
}

TEST_CASE("pinned_buffer: a host range, initialised by the host, freed on its stream") {
  fake_device_memory mr{memory_kind::pinned};
  {
    pinned_buffer<int> z(5, zero_fill, stream_a, mr);
    pinned_buffer<int> v(5, 7, stream_a, mr);
    const std::vector<int> source{1, 2, 3};
    pinned_buffer<int> h(source, stream_b, mr);
    CHECK(std::vector<int>(z.begin(), z.end()) == std::vector<int>(5, 0));
    CHECK(std::vector<int>(v.begin(), v.end()) == std::vector<int>(5, 7));
    CHECK(std::vector<int>(h.begin(), h.end()) == source);
    v[2] = 9;
    gsl::span<int> view = v;
    CHECK(view[2] == 9);
    CHECK(view.size() == 5);
    const pinned_buffer<int>& cv = v;
    CHECK(cv.span()[2] == 9);
    CHECK(mr.synchronous_allocations == 3);  // ready for the host on return
    pinned_buffer<pair_of_ints> pairs(3, pair_of_ints{1, 2}, stream_a, mr);
    CHECK(pairs[2].b == 2);
  }
  CHECK(mr.used_bytes() == 0);
  CHECK(mr.last_free_stream == stream_a);
}

TEST_CASE("pinned_buffer: only pinned memory; overflow; move and release") {
  fake_device_memory device_memory{memory_kind::device};
  host_resource host;
  CHECK_THROWS_WITH(pinned_buffer<int>(4, stream_a, device_memory), Catch::Contains("device memory"));
  CHECK_THROWS_AS(pinned_buffer<int>(4, stream_a, host), std::invalid_argument);
  fake_device_memory mr{memory_kind::pinned};
  CHECK_THROWS_AS(pinned_buffer<std::uint64_t>(std::numeric_limits<std::size_t>::max() / 4, stream_a, mr),
                  std::length_error);
  pinned_buffer<int> a(3, 1, stream_a, mr);
  pinned_buffer<int> b = std::move(a);
  CHECK(a.empty());  // NOLINT
  CHECK(b.size() == 3);
  released_memory r = b.release();
  CHECK(r.bytes == 12);
  r.resource->deallocate(r.ptr, r.bytes, r.alignment, r.stream);
  CHECK(mr.used_bytes() == 0);
}

TEST_CASE("copy: sizes must match, checked before any CUDA call") {
  fake_device_memory mr;
  device_buffer<int> d(4, stream_a, mr);
  std::vector<int> host(5);
  CHECK_THROWS_AS(copy(d, host, stream_a), std::invalid_argument);
  CHECK_THROWS_WITH(copy(d, host, stream_a),
                    Catch::Contains("device destination has 4 elements") &&
                        Catch::Contains("host source has 5"));
  CHECK_THROWS_WITH(copy(host, d, stream_a), Catch::Contains("host destination has 5"));
  // Zero elements: nothing to do, and no CUDA call (this machine may have no driver).
  device_buffer<int> empty(0, stream_a, mr);
  std::vector<int> none;
  CHECK_NOTHROW(copy(empty, none, stream_a));
  CHECK_NOTHROW(copy(gsl::span<int>(none), empty.span(), stream_a));
  CHECK_NOTHROW(fill(empty, 3, stream_a));
  CHECK_NOTHROW(fill_zero(empty.span(), stream_a));
}

TEST_CASE("with no usable device: clear errors, no crash, nothing leaked") {
  if (has_device()) {
    SUCCEED("this machine has a GPU: the GPU tests cover these paths");
    return;
  }
  CHECK_THROWS_AS(device_buffer<int>(4), no_device_error);        // default resource
  CHECK_THROWS_AS(pinned_buffer<int>(4), no_device_error);        // default pinned resource
  fake_device_memory mr;
  // The allocation succeeds (fake memory); initialising needs CUDA, fails, and frees it.
  CHECK_THROWS_AS(device_buffer<int>(4, zero_fill, stream_a, mr), no_device_error);
  CHECK_THROWS_AS(device_buffer<int>(4, 7, stream_a, mr), no_device_error);
  CHECK_THROWS_AS(device_buffer<int>(std::vector<int>{1, 2}, stream_a, mr), no_device_error);
  CHECK(mr.used_bytes() == 0);
  CHECK(mr.allocations == mr.deallocations);
  // Growing copies the old elements: that fails, and the buffer is as it was.
  device_buffer<int> b(4, stream_a, mr);
  int* const p = b.data();
  CHECK_THROWS_AS(b.resize(100, stream_a), no_device_error);
  CHECK(b.size() == 4);
  CHECK(b.capacity() == 4);
  CHECK(b.data() == p);
  CHECK(b.stream() == stream_a);
  CHECK(mr.used_bytes() == 16);
  CHECK_THROWS_AS(b.clone(stream_a), no_device_error);
  CHECK_THROWS_AS(b.set_stream(stream_b), no_device_error);
  CHECK(b.stream() == stream_a);
  CHECK(mr.used_bytes() == 16);
  fake_device_memory pinned{memory_kind::pinned};
  pinned_buffer<int> h(4, 1, stream_a, pinned);
  CHECK_THROWS_AS(h.resize(10, stream_a), no_device_error);  // waits for the stream first
  CHECK(h.size() == 4);
  CHECK(h[3] == 1);
  CHECK(pinned.used_bytes() == 16);
}
