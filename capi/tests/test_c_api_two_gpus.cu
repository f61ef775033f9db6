// cudamem_c.h on two GPUs (skipped, exit 77, with fewer: tests/gpu/support/gpu_main.cpp):
// cudamem_add_peer gives a device access to another's vm_pool memory, mapped before and after;
// cudamem_current_device follows cudaSetDevice.
#include <cudamem_c.h>

#include <gpu_test.hpp>

#include <catch2/catch.hpp>

#include <cuda_runtime_api.h>

#include <cstddef>

CUDAMEM_TEST_NEEDS_DEVICES(2)

namespace {
constexpr std::size_t MiB = std::size_t{1} << 20;

__global__ void fill(float* p, std::size_t n, float v) {
  for (std::size_t i = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x; i < n;
       i += std::size_t{gridDim.x} * blockDim.x) {
    p[i] = v;
  }
}

int make(const char* config) {
  int id = -1;
  INFO(cudamem_last_error());
  REQUIRE(cudamem_allocator_create(config, &id) == CUDAMEM_OK);
  return id;
}
}  // namespace

TEST_CASE("c api gpu: a peer reads and writes a vm_pool's memory once it was added") {
  int can = 0;
  REQUIRE(cudaDeviceCanAccessPeer(&can, 1, 0) == cudaSuccess);
  REQUIRE(can == 1);  // the two-GPU machines are NVLinked; no peer path would be refused
  const int id = make("resource=vm_pool, grow_ahead_bytes=0");
  void* before = nullptr;
  REQUIRE(cudamem_allocate(id, 8 * MiB, 0, nullptr, &before) == CUDAMEM_OK);  // mapped earlier
  REQUIRE(cudamem_add_peer(id, 0, 1) == CUDAMEM_OK);
  void* after = nullptr;
  REQUIRE(cudamem_allocate(id, 64 * MiB, 0, nullptr, &after) == CUDAMEM_OK);  // mapped later
  REQUIRE(cudaSetDevice(1) == cudaSuccess);
  fill<<<64, 256>>>(static_cast<float*>(before), (8 * MiB) / 4, 3.0f);  // device 1's kernels
  fill<<<64, 256>>>(static_cast<float*>(after), (64 * MiB) / 4, 5.0f);
  CHECK(cudaDeviceSynchronize() == cudaSuccess);
  REQUIRE(cudaSetDevice(0) == cudaSuccess);
  float a = 0;
  float b = 0;
  REQUIRE(cudaMemcpy(&a, before, 4, cudaMemcpyDeviceToHost) == cudaSuccess);
  REQUIRE(cudaMemcpy(&b, static_cast<char*>(after) + 64 * MiB - 4, 4, cudaMemcpyDeviceToHost) ==
          cudaSuccess);
  CHECK(a == 3.0f);
  CHECK(b == 5.0f);
  CHECK(cudamem_deallocate(id, before, 8 * MiB, 0, nullptr) == CUDAMEM_OK);
  CHECK(cudamem_deallocate(id, after, 64 * MiB, 0, nullptr) == CUDAMEM_OK);
  CHECK(cudamem_allocator_destroy(id) == CUDAMEM_OK);
}

TEST_CASE("c api gpu: current_device is the device the thread chose") {
  int device = -1;
  REQUIRE(cudaSetDevice(1) == cudaSuccess);
  CHECK(cudamem_current_device(&device) == CUDAMEM_OK);
  CHECK(device == 1);
  REQUIRE(cudaSetDevice(0) == cudaSuccess);
  CHECK(cudamem_current_device(&device) == CUDAMEM_OK);
  CHECK(device == 0);
}
