// cudamem's resources satisfy the cuda::mr resource concepts of the CCCL shipped with the
// toolkit, and are passed where CCCL takes `cuda::mr::resource_ref` / `async_resource_ref`;
// device memory is viewed as cuda::std::span and cuda::std::mdspan in kernels.
// CCCL 3.0 (CUDA 13.0) keeps cuda::mr behind a macro; only this translation unit defines it
// (see cudamem/cccl_resource.hpp) — cudamem's own headers never need it.
#define LIBCUDACXX_ENABLE_EXPERIMENTAL_MEMORY_RESOURCE
#include <cuda/memory_resource>

#include <cudamem/async_resource.hpp>
#include <cudamem/cccl_resource.hpp>
#include <cudamem/cccl_span.hpp>
#include <cudamem/device_buffer.hpp>
#include <cudamem/device_resource.hpp>
#include <cudamem/failing_adaptor.hpp>
#include <cudamem/host_resource.hpp>
#include <cudamem/managed_resource.hpp>
#include <cudamem/pinned_resource.hpp>
#include <cudamem/pool_resource.hpp>
#include <cudamem/statistics_adaptor.hpp>

#include "gpu_test.hpp"

#include <cstring>
#include <stdexcept>
#include <type_traits>
#include <vector>

using device_ref = cuda::mr::async_resource_ref<cuda::mr::device_accessible>;
using host_device_ref = cuda::mr::resource_ref<cuda::mr::host_accessible, cuda::mr::device_accessible>;
using matrix = cuda::std::mdspan<int, cuda::std::dextents<std::size_t, 2>>;

static_assert(cuda::mr::async_resource<cudamem::memory_resource>);
static_assert(cuda::mr::async_resource<cudamem::device_resource>);
static_assert(cuda::mr::async_resource<cudamem::async_resource>);
static_assert(cuda::mr::async_resource<cudamem::pinned_resource>);
static_assert(cuda::mr::async_resource<cudamem::managed_resource>);
static_assert(cuda::mr::async_resource<cudamem::host_resource>);
static_assert(cuda::mr::async_resource<cudamem::failing_adaptor>);
static_assert(cuda::mr::resource<cudamem::device_resource>);

// The leaf resources carry the properties their kind implies, and no others.
static_assert(cuda::mr::async_resource_with<cudamem::device_resource, cuda::mr::device_accessible>);
static_assert(cuda::mr::async_resource_with<cudamem::async_resource, cuda::mr::device_accessible>);
static_assert(cuda::mr::async_resource_with<cudamem::pinned_resource, cuda::mr::host_accessible,
                                            cuda::mr::device_accessible>);
static_assert(cuda::mr::async_resource_with<cudamem::managed_resource, cuda::mr::host_accessible,
                                            cuda::mr::device_accessible>);
static_assert(cuda::mr::resource_with<cudamem::host_resource, cuda::mr::host_accessible>);
static_assert(!cuda::mr::resource_with<cudamem::host_resource, cuda::mr::device_accessible>);
static_assert(!cuda::mr::resource_with<cudamem::device_resource, cuda::mr::host_accessible>);
static_assert(!cuda::mr::resource_with<cudamem::pool_resource, cuda::mr::device_accessible>);  // run-time kind
static_assert(std::is_convertible_v<cudamem::device_resource&, device_ref>);
static_assert(!std::is_convertible_v<cudamem::host_resource&, device_ref>);
static_assert(std::is_convertible_v<cudamem::cccl_resource<cuda::mr::device_accessible>&, device_ref>);

// The views are kernel arguments: trivially copyable.
static_assert(std::is_trivially_copyable_v<matrix>);
static_assert(std::is_trivially_copyable_v<cuda::std::span<float>>);

namespace {

/// Stands for a CCCL-based library that takes its memory as an async_resource_ref: fills
/// `n` ints with `value` in memory from `mr`, on `s`, and returns what it read back.
std::vector<int> library_fill(device_ref mr, cuda::stream_ref s, std::size_t n, int value) {
  void* p = mr.allocate_async(n * sizeof(int), 256, s);
  cudamem::check(cudaMemsetAsync(p, 0, n * sizeof(int), s.get()));
  std::vector<int> pattern(n, value);
  cudamem::check(cudaMemcpyAsync(p, pattern.data(), n * sizeof(int), cudaMemcpyHostToDevice, s.get()));
  std::vector<int> back(n);
  cudamem::check(cudaMemcpyAsync(back.data(), p, n * sizeof(int), cudaMemcpyDeviceToHost, s.get()));
  mr.deallocate_async(p, n * sizeof(int), 256, s);
  s.wait();
  return back;
}

__global__ void number_cells(matrix m) {
  const std::size_t i = blockIdx.x;
  for (std::size_t j = threadIdx.x; j < m.extent(1); j += blockDim.x) {
    m(i, j) = static_cast<int>(i * 1000 + j);
  }
}

__global__ void add_one(cuda::std::span<int> v) {
  const std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x;
  if (i < v.size()) {
    v[i] += 1;
  }
}

}  // namespace

TEST_CASE("a cudamem resource is used through CCCL's concept-constrained interface") {
  cudamem::async_resource mr;
  cudamem::stream s;
  cuda::stream_ref ref{s.get()};
  auto use = []<class R>(R& r, cuda::stream_ref where)
    requires cuda::mr::async_resource<R>
  {
    void* p = r.allocate_async(4096, 256, where);
    r.deallocate_async(p, 4096, 256, where);
    return p != nullptr;
  };
  CHECK(use(mr, ref));
  s.synchronize();
  CHECK(mr.stats().used_bytes == 0);
}

TEST_CASE("cudamem resources are passed where CCCL takes resource_ref and async_resource_ref") {
  cudamem::stream s;
  const cuda::stream_ref ref{s.get()};

  cudamem::device_resource device;  // a leaf: its type says device_accessible
  CHECK(library_fill(device, ref, 1000, 7) == std::vector<int>(1000, 7));
  CHECK(device.stats().used_bytes == 0);

  cudamem::pool_resource pool{device};  // kind known at run time: vouched for, and checked
  cudamem::statistics_adaptor counted{pool};
  cudamem::cccl_resource<cuda::mr::device_accessible> counted_ref{counted};
  CHECK(library_fill(counted_ref, ref, 5000, -3) == std::vector<int>(5000, -3));
  CHECK(counted.counters().allocations == 1);
  CHECK(counted.counters().current_bytes == 0);
  CHECK(&counted_ref.resource() == &counted);

  device_ref a = counted_ref;
  device_ref b = counted_ref;
  CHECK(a == b);

  cudamem::pinned_resource pinned;  // host and device: the host may write it directly
  host_device_ref both = pinned;
  auto* p = static_cast<int*>(both.allocate(64 * sizeof(int), 256));
  for (int i = 0; i < 64; ++i) {
    p[i] = i;
  }
  add_one<<<1, 64, 0, s.get()>>>(cuda::std::span<int>(p, 64));
  s.synchronize();
  CHECK(p[63] == 64);
  both.deallocate(p, 64 * sizeof(int), 256);
  CHECK(pinned.stats().used_bytes == 0);

  // A property the resource's memory does not have is refused when the handle is made.
  using host_ref_handle = cudamem::cccl_resource<cuda::mr::host_accessible>;
  CHECK_THROWS_AS(host_ref_handle{pool}, std::invalid_argument);
  cudamem::host_resource host_memory;
  using device_ref_handle = cudamem::cccl_resource<cuda::mr::device_accessible>;
  CHECK_THROWS_AS(device_ref_handle{host_memory}, std::invalid_argument);
  s.synchronize();
}

TEST_CASE("a device_buffer as cuda::std::mdspan and span, written and read in kernels") {
  cudamem::device_resource device;
  cudamem::pool_resource pool{device};
  cudamem::stream s;
  const std::size_t rows = 37;
  const std::size_t cols = 300;
  cudamem::device_buffer<int> buf(rows * cols + 5, cudamem::zero_fill, s, pool);

  const matrix m = cudamem::as_mdspan(buf, rows, cols);
  CHECK(m.data_handle() == buf.data());
  CHECK(m.extent(0) == rows);
  CHECK(m.extent(1) == cols);
  number_cells<<<static_cast<unsigned>(rows), 128, 0, s.get()>>>(m);
  const cuda::std::span<int> v = cudamem::as_span(buf);
  CHECK(v.size() == buf.size());
  add_one<<<static_cast<unsigned>((v.size() + 255) / 256), 256, 0, s.get()>>>(v);

  std::vector<int> host(buf.size());
  cudamem::check(cudaMemcpyAsync(host.data(), buf.data(), buf.size_bytes(), cudaMemcpyDeviceToHost, s.get()));
  s.synchronize();
  CHECK(host[0] == 1);
  CHECK(host[1 * cols + 2] == 1000 + 2 + 1);       // row-major: (1, 2)
  CHECK(host[36 * cols + 299] == 36299 + 1);
  CHECK(host[rows * cols] == 1);                    // past the matrix: only add_one touched it

  // Column-major over the same memory: (i, j) is element j * rows + i.
  auto t = cudamem::as_mdspan<cuda::std::layout_left>(buf, rows, cols);
  CHECK(&t(1, 2) == buf.data() + 2 * rows + 1);
  CHECK_THROWS_AS(cudamem::as_mdspan(buf, rows + 1, cols), std::invalid_argument);
}
