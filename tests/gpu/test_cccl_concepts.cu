// cudamem's resources satisfy the cuda::mr resource concepts of the CCCL shipped with the
// toolkit. CCCL 3.0 (CUDA 13.0) keeps them behind a macro; only this test defines it —
// cudamem's own headers never need it.
#define LIBCUDACXX_ENABLE_EXPERIMENTAL_MEMORY_RESOURCE
#include <cuda/memory_resource>

#include <cudamem/async_resource.hpp>
#include <cudamem/device_resource.hpp>
#include <cudamem/failing_adaptor.hpp>
#include <cudamem/host_resource.hpp>
#include <cudamem/managed_resource.hpp>
#include <cudamem/pinned_resource.hpp>

#include "gpu_test.hpp"

static_assert(cuda::mr::async_resource<cudamem::memory_resource>);
static_assert(cuda::mr::async_resource<cudamem::device_resource>);
static_assert(cuda::mr::async_resource<cudamem::async_resource>);
static_assert(cuda::mr::async_resource<cudamem::pinned_resource>);
static_assert(cuda::mr::async_resource<cudamem::managed_resource>);
static_assert(cuda::mr::async_resource<cudamem::host_resource>);
static_assert(cuda::mr::async_resource<cudamem::failing_adaptor>);
static_assert(cuda::mr::resource<cudamem::device_resource>);

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
