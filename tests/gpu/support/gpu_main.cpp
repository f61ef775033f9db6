// The main() of every GPU test. With no usable device it prints why and exits 77, which ctest
// (SKIP_RETURN_CODE 77) reports as skipped: a GPU test is never counted as passed without a GPU.
// A test binary that needs several devices says so once, at namespace scope:
//   CUDAMEM_TEST_NEEDS_DEVICES(2)        // gpu_test.hpp
// and with fewer it prints "SKIPPED: needs 2 GPUs (...)" and exits 77 the same way.
#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>

#include <cuda_runtime_api.h>

#include <cstdio>

// The devices a binary needs: 1 unless the binary defines its own (a strong definition wins
// over this weak one at link time).
extern "C" __attribute__((weak)) int cudamem_test_devices_needed() { return 1; }

int main(int argc, char* argv[]) {
  int count = 0;
  const cudaError_t code = cudaGetDeviceCount(&count);
  if (code != cudaSuccess || count == 0) {
    std::printf("SKIPPED: no CUDA device (%s: %s)\n",
                code != cudaSuccess ? cudaGetErrorName(code) : "cudaGetDeviceCount",
                code != cudaSuccess ? cudaGetErrorString(code) : "0 devices");
    return 77;
  }
  if (const int needed = cudamem_test_devices_needed(); count < needed) {
    std::printf("SKIPPED: needs %d GPUs (%d visible)\n", needed, count);
    return 77;
  }
  return Catch::Session().run(argc, argv);
}
