// quickstart: the README's main example. A stream, device memory, a kernel, the result back.
// (This grows into "a typed device buffer from a pool on a stream" as those parts land.)
#include <cudamem/cudamem.hpp>

#include <cstdio>
#include <vector>

namespace {
constexpr int exit_no_device = 69;  // EX_UNAVAILABLE: distinct from a failure (1)

__global__ void square(float* x, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) {
    x[i] = x[i] * x[i];
  }
}
}  // namespace

int main() try {
  constexpr int n = 1 << 20;
  cudamem::stream s;
  std::vector<float> host(n);
  for (int i = 0; i < n; ++i) {
    host[i] = static_cast<float>(i % 100);
  }
  float* device = nullptr;
  cudamem::check(cudaMallocAsync(reinterpret_cast<void**>(&device), n * sizeof(float), s.get()));
  cudamem::check(cudaMemcpyAsync(device, host.data(), n * sizeof(float), cudaMemcpyHostToDevice,
                                 s.get()));
  square<<<(n + 255) / 256, 256, 0, s.get()>>>(device, n);
  cudamem::check(cudaGetLastError());
  cudamem::check(cudaMemcpyAsync(host.data(), device, n * sizeof(float), cudaMemcpyDeviceToHost,
                                 s.get()));
  cudamem::check(cudaFreeAsync(device, s.get()));
  s.synchronize();
  std::printf("squared %d floats on %s: x[7] = %.0f, x[99] = %.0f\n", n,
              cudamem::get_device_properties(s.device()).name.c_str(), host[7], host[99]);
  return host[7] == 49.0F && host[99] == 9801.0F ? 0 : 1;
} catch (const cudamem::no_device_error& e) {
  std::printf("quickstart: no usable CUDA device here (%s), nothing to run\n", e.name());
  return exit_no_device;
} catch (const std::exception& e) {
  std::fprintf(stderr, "quickstart failed: %s\n", e.what());
  return 1;
}
