// The main() of every GPU test. With no usable device it prints why and exits 77, which ctest
// (SKIP_RETURN_CODE 77) reports as skipped: a GPU test is never counted as passed without a GPU.
#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>

#include <cuda_runtime_api.h>

#include <cstdio>

int main(int argc, char* argv[]) {
  int count = 0;
  const cudaError_t code = cudaGetDeviceCount(&count);
  if (code != cudaSuccess || count == 0) {
    std::printf("SKIPPED: no CUDA device (%s: %s)\n",
                code != cudaSuccess ? cudaGetErrorName(code) : "cudaGetDeviceCount",
                code != cudaSuccess ? cudaGetErrorString(code) : "0 devices");
    return 77;
  }
  return Catch::Session().run(argc, argv);
}
