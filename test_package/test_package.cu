// nvcc use of the packaged cudamem: a kernel on a cudamem stream, or the no-device message and
// exit 69.
#include <cudamem/cudamem.hpp>

#include <cstdio>

__global__ void store_answer(int* out) { *out = 42; }

int main() try {
  cudamem::stream s;
  int* answer = nullptr;
  cudamem::check(cudaMallocAsync(reinterpret_cast<void**>(&answer), sizeof(int), s.get()));
  store_answer<<<1, 1, 0, s.get()>>>(answer);
  cudamem::check(cudaGetLastError(), "store_answer launch");
  int host = 0;
  cudamem::check(cudaMemcpyAsync(&host, answer, sizeof(int), cudaMemcpyDeviceToHost, s.get()));
  cudamem::check(cudaFreeAsync(answer, s.get()));
  s.synchronize();
  std::printf("test_package_cu: %s, cudamem %s, the kernel wrote %d\n", host == 42 ? "OK" : "WRONG",
              CUDAMEM_VERSION_STRING, host);
  return host == 42 ? 0 : 1;
} catch (const cudamem::no_device_error& e) {
  std::printf("test_package_cu: %s\n", e.what());
  return 69;
}
