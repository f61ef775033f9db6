// The thrust interop types without a GPU (plain C++, as a .cpp consumer sees them): what
// thrust_temporary_allocator and thrust_allocator ask of their resource (sizes, alignment, the
// stream of every free, the call site), that exec_policy keeps the algorithms and their
// temporaries on one stream through `.on()`, that thrust picks the allocator's policy for a
// container's own work, and their bad inputs.
#include <cudamem/exec_policy.hpp>
#include <cudamem/failing_adaptor.hpp>
#include <cudamem/host_resource.hpp>
#include <cudamem/statistics_adaptor.hpp>
#include <cudamem/thrust_allocator.hpp>
#include <cudamem/tracking_adaptor.hpp>

#include "fake_device_memory.hpp"
#include "hidden_devices.hpp"

#include <catch2/catch.hpp>

#include <cstdint>
#include <limits>
#include <stdexcept>
#include <string>
#include <type_traits>

using namespace cudamem;
using cudamem_test::fake_device_memory;

namespace {
const stream_view stream_a{reinterpret_cast<cudaStream_t>(std::uintptr_t{0x1000})};
const stream_view stream_b{reinterpret_cast<cudaStream_t>(std::uintptr_t{0x2000})};
}  // namespace

// thrust runs a container's own work (fill, copy) under the allocator's system(): ours.
static_assert(std::is_same_v<thrust::detail::allocator_system<thrust_allocator<int>>::get_result_type,
                             exec_policy&>);
static_assert(std::is_same_v<thrust::detail::allocator_traits<thrust_allocator<int>>::pointer,
                             thrust::device_ptr<int>>);
static_assert(std::is_same_v<thrust::detail::allocator_traits<thrust_allocator<int>>::rebind_alloc<double>,
                             thrust_allocator<double>>);
static_assert(thrust_allocator<char>::alignment == default_alignment);
static_assert(thrust_allocator<std::max_align_t>::alignment >= alignof(std::max_align_t));

TEST_CASE("thrust_temporary_allocator: bytes from the resource, 256-aligned, freed on its stream") {
  REQUIRE(cudamem_test::devices_hidden);  // the stream handles here are made up
  fake_device_memory mr;
  thrust_temporary_allocator temp{mr, stream_a};
  std::byte* p = temp.allocate(1000);
  REQUIRE(p != nullptr);
  CHECK(reinterpret_cast<std::uintptr_t>(p) % 256 == 0);
  CHECK(mr.last_alignment == 256);
  CHECK(mr.used_bytes() == 1000);
  temp.deallocate(p, 1000);
  CHECK(mr.used_bytes() == 0);
  CHECK(mr.last_free_stream == stream_a);
  CHECK(temp.allocate(0) == nullptr);  // the resource's zero-byte rule: nothing asked
  CHECK(mr.allocations == 1);

  CHECK(temp == thrust_temporary_allocator{mr, stream_a});
  CHECK_FALSE(temp == thrust_temporary_allocator{mr, stream_b});
  fake_device_memory other;
  CHECK_FALSE(temp == thrust_temporary_allocator{other, stream_a});
}

TEST_CASE("exec_policy: .on() moves the algorithms and the temporaries to the new stream together") {
  fake_device_memory mr;
  exec_policy policy{mr, stream_a};
  CHECK(&policy.resource() == &mr);
  CHECK(policy.stream() == stream_a);
  CHECK(get_stream(policy) == stream_a.get());                  // where thrust runs kernels
  CHECK(policy.get_allocator().stream() == stream_a);           // where the temporaries live
  const exec_policy moved = policy.on(stream_b);
  CHECK(get_stream(moved) == stream_b.get());
  CHECK(const_cast<exec_policy&>(moved).get_allocator().stream() == stream_b);
  CHECK(&moved.resource() == &mr);
  // thrust's own `.on` keeps the allocator where it was: the race exec_policy::on prevents.
  auto raw = thrust::cuda::par_nosync(thrust_temporary_allocator{mr, stream_a}).on(stream_b.get());
  CHECK(raw.get_allocator().stream() == stream_a);

  std::byte* p = policy.get_allocator().allocate(64);
  policy.get_allocator().deallocate(p, 64);
  CHECK(mr.last_free_stream == stream_a);
}

TEST_CASE("exec_policy and thrust_allocator name the user's line to a tracking adaptor") {
  fake_device_memory mr;
  tracking_adaptor tracked{mr};
  exec_policy policy{tracked, stream_a};
  const unsigned line = __LINE__ - 1;
  std::byte* p = policy.get_allocator().allocate(128);
  {
    const leak_report live = tracked.leaks();
    REQUIRE(live.leaks.size() == 1);
    CHECK(live.leaks.front().site.line() == line);
    CHECK(std::string(live.leaks.front().site.file_name()).find("test_thrust_interop.cpp") !=
          std::string::npos);
  }
  policy.get_allocator().deallocate(p, 128);
  thrust_allocator<int> alloc{tracked, stream_a};
  const unsigned alloc_line = __LINE__ - 1;
  thrust::device_ptr<int> q = alloc.allocate(4);
  CHECK(tracked.leaks().leaks.front().site.line() == alloc_line);
  alloc.deallocate(q, 4);
}

TEST_CASE("thrust_allocator: device_ptr from the resource, freed on its stream, equality and rebind") {
  fake_device_memory mr;
  statistics_adaptor counted{mr};
  thrust_allocator<std::uint32_t> a{counted, stream_a};
  thrust::device_ptr<std::uint32_t> p = a.allocate(100);
  REQUIRE(p.get() != nullptr);
  CHECK(reinterpret_cast<std::uintptr_t>(p.get()) % 256 == 0);
  CHECK(counted.counters().current_bytes == 400);
  a.deallocate(p, 100);
  CHECK(counted.counters().current_bytes == 0);
  CHECK(mr.last_free_stream == stream_a);
  CHECK(a.allocate(0).get() == nullptr);

  CHECK(a == thrust_allocator<std::uint32_t>{counted, stream_a});
  CHECK_FALSE(a == thrust_allocator<std::uint32_t>{counted, stream_b});
  const thrust_allocator<double> d{a};  // rebind: same resource, same stream
  CHECK(d == a);
  CHECK(&d.resource() == &counted);
  CHECK(d.stream() == stream_a);
  CHECK(&a.system().resource() == &counted);
  CHECK(a.system().stream() == stream_a);
  CHECK(get_stream(a.system()) == stream_a.get());
}

TEST_CASE("thrust interop: bad inputs are typed errors and ask the resource for nothing") {
  fake_device_memory mr;
  thrust_allocator<std::uint64_t> a{mr, stream_a};
  CHECK_THROWS_AS(a.allocate(std::numeric_limits<std::size_t>::max() / 4), std::length_error);
  CHECK(mr.allocations == 0);
  CHECK(thrust_allocator<std::uint64_t>::max_size() == std::numeric_limits<std::size_t>::max() / 8);

  host_resource host;
  CHECK_THROWS_AS(thrust_allocator<int>(host, stream_a), std::invalid_argument);
  CHECK_THROWS_AS(thrust_temporary_allocator(host, stream_a), std::invalid_argument);
  CHECK_THROWS_AS(exec_policy(host, stream_a), std::invalid_argument);
  try {
    exec_policy bad{host, stream_a};
    FAIL("a host resource was accepted");
  } catch (const std::invalid_argument& e) {
    CHECK(std::string(e.what()).find("host memory") != std::string::npos);
  }

  // Pinned and managed memory are device-accessible: accepted.
  fake_device_memory pinned{memory_kind::pinned};
  CHECK_NOTHROW(exec_policy(pinned, stream_a));

  // A failing resource: out_of_memory out of allocate, nothing held.
  failing_adaptor faults{mr};
  faults.fail_call(1);
  thrust_allocator<int> f{faults, stream_a};
  CHECK_THROWS_AS(f.allocate(10), out_of_memory);
  CHECK(mr.used_bytes() == 0);
}
