// The app's CUDA part (see main.cpp): a kernel on a cudamem stream, into a device_buffer.
#include <cudamem/cudamem.hpp>

#include <vector>

namespace {
__global__ void iota(cudamem::device_span<int> out) {
  const std::size_t i = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x;
  if (i < out.size()) {
    out[i] = static_cast<int>(i);
  }
}
}  // namespace

int iota_on(cudamem::stream& s, int n) {
  cudamem::device_buffer<int> values(static_cast<std::size_t>(n), s);
  iota<<<(n + 127) / 128, 128, 0, s.get()>>>(values);
  cudamem::check(cudaGetLastError(), "iota launch");
  std::vector<int> host(static_cast<std::size_t>(n));
  cudamem::copy(host, values, s);
  s.synchronize();
  return host.back();
}
