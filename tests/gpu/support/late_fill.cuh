// A kernel shared by the GPU tests of ordering between streams and devices: a late producer.
#pragma once

#include <cudamem/device_span.hpp>

#include <cstddef>

namespace cudamem_test {

/// Waits `ns` on the GPU (one thread), then writes `value` everywhere: a late producer, so a
/// consumer that is not ordered after it reads the old values.
__global__ void late_fill(cudamem::device_span<int> x, int value, unsigned long long ns) {
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    unsigned long long start = 0;
    unsigned long long now = 0;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    do {
      asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    } while (now - start < ns);
    for (std::size_t i = 0; i < x.size(); ++i) {
      x[i] = value;
    }
  }
}

}  // namespace cudamem_test
