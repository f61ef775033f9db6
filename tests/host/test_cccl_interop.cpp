// CCCL interop without a GPU, in plain C++: device memory as cuda::std::span / mdspan (over
// host memory that claims to be device memory, so the host can read what the views address),
// and cudamem resources as cuda::mr resource_refs.
//
// The include order is the test of cccl_resource.hpp's guard: it comes first without
// LIBCUDACXX_ENABLE_EXPERIMENTAL_MEMORY_RESOURCE (so it declares nothing), the macro is defined
// after it, and including cccl_resource.hpp again must then declare everything (a `#pragma
// once` header would stay empty and this file would not compile). The CCCL interop headers are
// not in cudamem.hpp: a translation unit that uses them includes them.
#include <cudamem/cudamem.hpp>
#include <cudamem/cccl_resource.hpp>

#define LIBCUDACXX_ENABLE_EXPERIMENTAL_MEMORY_RESOURCE
#include <cudamem/cccl_resource.hpp>
#include <cudamem/cccl_span.hpp>  // not in cudamem.hpp: it brings libcu++

#include "fake_device_memory.hpp"

#include <catch2/catch.hpp>

#include <cstdint>
#include <limits>
#include <numeric>
#include <stdexcept>
#include <string>
#include <type_traits>

using namespace cudamem;
using cudamem_test::fake_device_memory;

namespace {
template <class Buffer>
concept viewable = requires(Buffer&& b) { as_span(std::forward<Buffer>(b)); };
const stream_view stream_a{reinterpret_cast<cudaStream_t>(std::uintptr_t{0x1000})};
using device_ref = cuda::mr::async_resource_ref<cuda::mr::device_accessible>;
}  // namespace

static_assert(std::is_same_v<decltype(as_span(std::declval<device_buffer<int>&>())), cuda::std::span<int>>);
static_assert(std::is_same_v<decltype(as_span(std::declval<const device_buffer<int>&>())),
                             cuda::std::span<const int>>);
static_assert(std::is_same_v<decltype(as_mdspan(std::declval<const device_buffer<int>&>(), 2, 3)),
                             cuda::std::mdspan<const int, cuda::std::dextents<std::size_t, 2>>>);
static_assert(viewable<device_buffer<int>&>);
static_assert(!viewable<device_buffer<int>>);  // no view of a buffer about to be destroyed
static_assert(std::is_trivially_copyable_v<cuda::std::mdspan<float, cuda::std::dextents<std::size_t, 3>>>);

TEST_CASE("as_span and as_mdspan view a device_buffer's memory, row- or column-major") {
  fake_device_memory mr;  // host memory: the host may read through the views
  device_buffer<int> buf(12, stream_a, mr);
  const cuda::std::span<int> all = as_span(buf);
  CHECK(all.data() == buf.data());
  CHECK(all.size() == 12);
  std::iota(all.begin(), all.end(), 0);

  const auto rows = as_mdspan(buf, 3, 4);  // row-major 3 x 4
  CHECK(rows.extent(0) == 3);
  CHECK(rows.extent(1) == 4);
  CHECK(rows(1, 2) == 6);
  CHECK(rows(2, 3) == 11);
  const auto cols = as_mdspan<cuda::std::layout_left>(buf, 3, 4);  // column-major 3 x 4
  CHECK(cols(1, 2) == 7);
  const auto fixed = as_mdspan(buf, cuda::std::extents<std::size_t, cuda::std::dynamic_extent, 4>{2});
  static_assert(decltype(fixed)::static_extent(1) == 4);
  CHECK(fixed(1, 0) == 4);
  const auto cube = as_mdspan(buf.span().subspan(4), 2, 2, 2);  // a view of part of it
  CHECK(cube(1, 1, 1) == 11);
  CHECK(as_span(buf.span().first(3)).back() == 2);

  const device_buffer<int>& constant = buf;
  CHECK(as_mdspan(constant, 2, 6)(1, 5) == 11);
  CHECK(as_mdspan(buf, 0, 100).size() == 0);  // nothing needed
}

TEST_CASE("as_mdspan: extents larger than the memory, or overflowing, are refused with both sizes") {
  fake_device_memory mr;
  device_buffer<float> buf(12, stream_a, mr);
  try {
    static_cast<void>(as_mdspan(buf, 4, 4));
    FAIL("accepted 16 elements of 12");
  } catch (const std::invalid_argument& e) {
    CHECK(std::string(e.what()) ==
          "cudamem: as_mdspan: extents 4 x 4 need 16 elements, but the memory holds 12");
  }
  const std::size_t huge = std::numeric_limits<std::size_t>::max() / 2;
  CHECK_THROWS_AS(as_mdspan(buf, huge, 3), std::invalid_argument);
  CHECK_THROWS_AS(as_mdspan(buf, cuda::std::extents<std::size_t, 13>{}), std::invalid_argument);
  CHECK_NOTHROW(as_mdspan(buf, 2, 5));  // a prefix is fine
}

TEST_CASE("cccl_resource: any cudamem resource behind an async_resource_ref, checked against its kind") {
  fake_device_memory mr;
  cccl_resource<cuda::mr::device_accessible> handle{mr};
  device_ref ref = handle;
  void* p = ref.allocate_async(1000, 256, cuda::stream_ref{stream_a.get()});
  CHECK(mr.used_bytes() == 1000);
  ref.deallocate_async(p, 1000, 256, cuda::stream_ref{stream_a.get()});
  CHECK(mr.last_free_stream == stream_a);
  void* q = ref.allocate(64, 64);  // the synchronous form
  ref.deallocate(q, 64, 64);
  CHECK(mr.synchronous_allocations == 1);
  CHECK(mr.used_bytes() == 0);
  CHECK(ref == device_ref{handle});

  fake_device_memory pinned{memory_kind::pinned};
  using both = cccl_resource<cuda::mr::host_accessible, cuda::mr::device_accessible>;
  CHECK_NOTHROW(both{pinned});
  CHECK_THROWS_AS(both{mr}, std::invalid_argument);  // device memory is not host_accessible
  host_resource host;
  try {
    cccl_resource<cuda::mr::device_accessible> bad{host};
    FAIL("host memory accepted as device_accessible");
  } catch (const std::invalid_argument& e) {
    CHECK(std::string(e.what()) ==
          "cudamem: cccl_resource: host_resource gives host memory, which is not device_accessible");
  }
  // The leaf resources' properties come from their type.
  cuda::mr::resource_ref<cuda::mr::host_accessible> host_ref = host;
  void* h = host_ref.allocate(32, 16);
  host_ref.deallocate(h, 32, 16);
  CHECK(host.stats().used_bytes == 0);
}
