// The nvcc consumer: a kernel on a cudamem stream. On a machine with a GPU it prints
// "consumer_cu: OK ..."; on one without, the no-device message and exit code 69.
#include <cudamem/cudamem.hpp>

#include <cstdio>
#include <exception>

namespace {
constexpr int exit_no_device = 69;

__global__ void iota(int* out, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) {
    out[i] = i;
  }
}
}  // namespace

int main() try {
  std::printf("consumer_cu: cudamem %s\n", CUDAMEM_VERSION_STRING);
  constexpr int n = 1000;
  cudamem::stream s;  // throws cudamem::no_device_error where there is no usable device
  int* values = nullptr;
  cudamem::check(cudaMallocAsync(reinterpret_cast<void**>(&values), n * sizeof(int), s.get()));
  iota<<<(n + 127) / 128, 128, 0, s.get()>>>(values, n);
  cudamem::check(cudaGetLastError(), "iota launch");
  int last = -1;
  cudamem::check(cudaMemcpyAsync(&last, values + n - 1, sizeof(int), cudaMemcpyDeviceToHost,
                                 s.get()));
  cudamem::check(cudaFreeAsync(values, s.get()));
  s.synchronize();
  if (last != n - 1) {
    std::fprintf(stderr, "consumer_cu failed: the kernel wrote %d, expected %d\n", last, n - 1);
    return 1;
  }
  std::printf("consumer_cu: OK, a kernel ran on device %d\n", s.device());
  return 0;
} catch (const cudamem::no_device_error& e) {
  std::printf("consumer_cu: %s\n", e.what());
  return exit_no_device;
} catch (const std::exception& e) {
  std::fprintf(stderr, "consumer_cu failed: %s\n", e.what());
  return 1;
}
