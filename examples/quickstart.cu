// quickstart: the README's main example. A typed device buffer from a pool, on a stream; a
// kernel; the result copied back and checked. Nothing here is freed by hand, and nothing leaks
// if any line throws.
//
//   ./run example quickstart
#include <cudamem/cudamem.hpp>

#include <cstdio>
#include <vector>

namespace {

// Kernels take a device_span: a pointer and a size, trivially copyable, no ownership.
__global__ void square(cudamem::device_span<float> x) {
  const std::size_t i = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x;
  if (i < x.size()) {
    x[i] = x[i] * x[i];
  }
}

}  // namespace

int main() try {
  constexpr std::size_t n = 1 << 20;

  // A stream, and a pool over the device's memory: cudaMalloc is paid once, then allocations
  // cost nanoseconds.
  cudamem::stream s;
  cudamem::device_resource device;
  cudamem::pool_resource pool{device};

  std::vector<float> host(n);
  for (std::size_t i = 0; i < n; ++i) {
    host[i] = static_cast<float>(i % 100);
  }

  cudamem::device_buffer<float> x(host, s, pool);  // allocated and filled in stream order on s
  square<<<(n + 255) / 256, 256, 0, s.get()>>>(x);
  cudamem::check(cudaGetLastError(), "launching square");
  cudamem::copy(host, x, s);                       // device -> host, on s
  s.synchronize();

  std::printf("squared %zu floats on %s: x[7] = %.0f, x[99] = %.0f\n", n,
              cudamem::get_device_properties(device.device()).name.c_str(), host[7], host[99]);
  return host[7] == 49.0F && host[99] == 9801.0F ? 0 : 1;
} catch (const cudamem::no_device_error& e) {
  std::printf("quickstart: no usable CUDA device here (%s), nothing to run\n", e.name());
  return 69;  // EX_UNAVAILABLE: "skipped", not "failed"
} catch (const std::exception& e) {
  std::fprintf(stderr, "quickstart failed: %s\n", e.what());
  return 1;
}
