// Helpers shared by the GPU tests.
#pragma once

#include <cudamem/device.hpp>
#include <cudamem/error.hpp>

#include "captured_errors.hpp"

#include <catch2/catch.hpp>

#include <cuda_runtime_api.h>

#include <cstddef>

namespace cudamem_test {

/// Device 0's free memory after everything submitted has finished.
inline std::size_t free_device_memory() {
  cudamem::check(cudaDeviceSynchronize());
  return cudamem::device_memory(0).free;
}

}  // namespace cudamem_test
