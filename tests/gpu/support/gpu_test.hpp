// Helpers shared by the GPU tests.
#pragma once

#include <cudamem/device.hpp>
#include <cudamem/error.hpp>

#include "captured_errors.hpp"

#include <catch2/catch.hpp>

#include <cuda_runtime_api.h>

#include <cstddef>

/// At namespace scope in a GPU test: the binary needs `n` devices; with fewer, gpu_main prints
/// "SKIPPED: needs n GPUs (...)" and exits 77 (ctest: skipped) before any test case runs.
#define CUDAMEM_TEST_NEEDS_DEVICES(n) \
  extern "C" int cudamem_test_devices_needed() { return (n); }

namespace cudamem_test {

/// Device 0's free memory after everything submitted has finished.
inline std::size_t free_device_memory() {
  cudamem::check(cudaDeviceSynchronize());
  return cudamem::device_memory(0).free;
}

}  // namespace cudamem_test
