// host_leak — the device memory is freed, the host staging buffer is not.
// Every batch leaves its input behind in host RAM, and the process grows until the machine
// (and, with it, CUDA) runs short. A pinned_buffer frees itself — and copies faster.
//
//   ./run example host_leak
//
// Each version runs eight batches of 64 MiB: fill a host buffer, copy it to the device, work
// there, free. The raw version is the seed's: `new float[]`, cudaMalloc, cudaMemcpy, cudaFree,
// and no `delete[]`. The cudamem version holds both sides in owners (pinned_buffer on the
// host, device_buffer on the device); a std::vector would fix the leak as well, but pinned
// memory is what fast copies need (see pinned_transfers). Growth of the process's resident
// memory (RSS, what `top` shows) is measured around each version.
#include <cudamem/cudamem.hpp>

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <stdexcept>
#include <vector>

namespace {

constexpr std::size_t MiB = std::size_t{1} << 20;
constexpr std::size_t batch_floats = 64 * MiB / sizeof(float);
constexpr int batches = 8;
// RSS also moves with the runtime's own small allocations; a few MiB of noise is not a leak.
constexpr std::size_t tolerance = 4 * MiB;

__global__ void scale(cudamem::device_span<float> x, float by) {
  const std::size_t i = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x;
  if (i < x.size()) {
    x[i] *= by;
  }
}

// Resident memory of this process, from /proc/self/statm (pages in RAM now).
std::size_t resident_bytes() {
  std::ifstream statm("/proc/self/statm");
  std::size_t pages = 0;
  std::size_t resident = 0;
  statm >> pages >> resident;
  return resident * static_cast<std::size_t>(sysconf(_SC_PAGESIZE));
}

std::vector<float*> lost_pointers;  // only so the example can clean up at the end

// The usual pattern: the device side is cleaned up, the host side is forgotten.
void raw_batch() {
  float* h_data = new float[batch_floats];
  lost_pointers.push_back(h_data);
  std::fill(h_data, h_data + batch_floats, 1.0F);  // the input: every page now in RAM
  float* d_data = nullptr;
  cudamem::check(cudaMalloc(&d_data, batch_floats * sizeof(float)), "cudaMalloc");
  cudamem::check(cudaMemcpy(d_data, h_data, batch_floats * sizeof(float), cudaMemcpyHostToDevice),
                 "cudaMemcpy");
  scale<<<(batch_floats + 255) / 256, 256>>>(cudamem::device_span<float>(d_data, batch_floats),
                                             2.0F);
  cudamem::check(cudaDeviceSynchronize(), "the batch's kernel");
  cudamem::check(cudaFree(d_data), "cudaFree");  // device memory released...
  // ...and `delete[] h_data;` is missing: 64 MiB of host memory lost per batch.
}

// The same batch with owners: nothing to forget.
void cudamem_batch(cudamem::stream_view s) {
  cudamem::pinned_buffer<float> h_data(batch_floats, 1.0F);  // page-locked host memory
  cudamem::device_buffer<float> d_data(batch_floats, s);
  cudamem::copy(d_data, h_data, s);
  scale<<<(batch_floats + 255) / 256, 256, 0, s.get()>>>(d_data, 2.0F);
  cudamem::check(cudaGetLastError(), "launching scale");
  s.synchronize();
}  // both freed here, on every path

template <class Batch>
std::size_t growth_of(const char* what, Batch batch) {
  const std::size_t before = resident_bytes();
  for (int i = 0; i < batches; ++i) {
    batch();
  }
  const std::size_t after = resident_bytes();
  const std::size_t growth = after > before ? after - before : 0;
  std::printf("%-32s RSS %s before, %s after %d batches: +%s\n", what,
              cudamem::format_bytes(before).c_str(), cudamem::format_bytes(after).c_str(), batches,
              cudamem::format_bytes(growth).c_str());
  return growth > tolerance ? growth : 0;
}

}  // namespace

int main() try {
  std::printf("device 0: %s\n", cudamem::get_device_properties(0).name.c_str());
  cudamem::stream s;
  // Warm-up: the runtime's own first-use allocations (such as the staging buffers for copies
  // from pageable memory) are not ours to count.
  cudamem_batch(s);
  { cudamem::device_buffer<float> from_pageable(std::vector<float>(1024, 1.0F), s); }

  const std::size_t raw = growth_of("raw new[] without delete[]:", [] { raw_batch(); });
  const std::size_t owned = growth_of("pinned_buffer + device_buffer:", [&] { cudamem_batch(s); });

  for (float* p : lost_pointers) {  // give back what the raw version lost
    delete[] p;
  }
  std::printf("cleanup: deleted the %zu host buffers the raw version lost; RSS %s now\n",
              lost_pointers.size(), cudamem::format_bytes(resident_bytes()).c_str());

  std::printf("leaked host bytes: raw %zu, cudamem %zu\n", raw, owned);
  return raw >= batches * batch_floats * sizeof(float) && owned == 0 ? 0 : 1;
} catch (const cudamem::no_device_error& e) {
  std::printf("host_leak: no usable CUDA device here (%s), nothing to run\n", e.name());
  return 69;
} catch (const std::exception& e) {
  std::fprintf(stderr, "host_leak failed: %s\n", e.what());
  return 1;
}
