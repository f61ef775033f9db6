// cudamem_c.h on a GPU: allocators over the real device (vm_pool, pool, async), stream order
// with record_stream, out of memory with the device's report, and PyTorch's entry points.
#include <cudamem_c.h>

#include <catch2/catch.hpp>

#include <cuda_runtime_api.h>

#include <cstdint>
#include <new>
#include <string>
#include <vector>

namespace {
constexpr std::size_t MiB = std::size_t{1} << 20;
constexpr std::size_t GiB = std::size_t{1} << 30;

__global__ void spin(long long cycles) {
  const long long start = clock64();
  while (clock64() - start < cycles) {
  }
}
__global__ void fill(float* p, std::size_t n, float v) {
  for (std::size_t i = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x; i < n;
       i += std::size_t{gridDim.x} * blockDim.x) {
    p[i] = v;
  }
}
__global__ void twice_into(const float* in, float* out, std::size_t n) {
  for (std::size_t i = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x; i < n;
       i += std::size_t{gridDim.x} * blockDim.x) {
    out[i] = 2 * in[i];
  }
}

struct owned_stream {
  cudaStream_t s = nullptr;
  owned_stream() { REQUIRE(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) == cudaSuccess); }
  ~owned_stream() { cudaStreamDestroy(s); }
};

int make(const char* config) {
  int id = -1;
  INFO(cudamem_last_error());
  REQUIRE(cudamem_allocator_create(config, &id) == CUDAMEM_OK);
  return id;
}

cudamem_stats stats_of(int id) {
  cudamem_stats s{};
  s.struct_size = sizeof(s);
  REQUIRE(cudamem_get_stats(id, 0, &s) == CUDAMEM_OK);
  return s;
}

/// Cycles for about `ms` milliseconds of GPU time.
long long cycles_for(int ms) {
  int khz = 0;
  cudaDeviceGetAttribute(&khz, cudaDevAttrClockRate, 0);
  return static_cast<long long>(khz) * ms;
}
}  // namespace

TEST_CASE("c api gpu: each resource allocates device memory that kernels use") {
  for (const char* config : {"resource=vm_pool", "resource=pool", "resource=async"}) {
    INFO(config);
    const int id = make(config);
    owned_stream s;
    void* p = nullptr;
    REQUIRE(cudamem_allocate(id, 64 * MiB, 0, s.s, &p) == CUDAMEM_OK);
    fill<<<256, 256, 0, s.s>>>(static_cast<float*>(p), 16 * MiB, 3.0f);
    float back = 0;
    REQUIRE(cudaMemcpyAsync(&back, static_cast<float*>(p) + 16 * MiB - 1, sizeof back,
                            cudaMemcpyDeviceToHost, s.s) == cudaSuccess);
    REQUIRE(cudaStreamSynchronize(s.s) == cudaSuccess);
    CHECK(back == 3.0f);
    CHECK(stats_of(id).in_use_bytes == 64 * MiB);
    CHECK(cudamem_deallocate(id, p, 64 * MiB, 0, s.s) == CUDAMEM_OK);
    REQUIRE(cudaStreamSynchronize(s.s) == cudaSuccess);
    uint64_t released = 0;
    CHECK(cudamem_release(id, 0, &released) == CUDAMEM_OK);
    CHECK(cudamem_allocator_destroy(id) == CUDAMEM_OK);
  }
}

TEST_CASE("c api gpu: record_stream holds a free back until the other stream is done") {
  const int id = make("resource=vm_pool, grow_ahead_bytes=0");
  owned_stream main_stream, side;
  const std::size_t n = 4 * MiB;  // floats: 16 MiB
  void* x = nullptr;
  void* y = nullptr;
  REQUIRE(cudamem_allocate(id, n * 4, 0, main_stream.s, &x) == CUDAMEM_OK);
  REQUIRE(cudamem_allocate(id, n * 4, 0, side.s, &y) == CUDAMEM_OK);
  fill<<<256, 256, 0, main_stream.s>>>(static_cast<float*>(x), n, 1.0f);
  cudaEvent_t filled = nullptr;
  REQUIRE(cudaEventCreate(&filled) == cudaSuccess);
  REQUIRE(cudaEventRecord(filled, main_stream.s) == cudaSuccess);
  REQUIRE(cudaStreamWaitEvent(side.s, filled) == cudaSuccess);
  spin<<<1, 1, 0, side.s>>>(cycles_for(200));  // the side stream reads x 0.2 s from now
  twice_into<<<256, 256, 0, side.s>>>(static_cast<float*>(x), static_cast<float*>(y), n);
  REQUIRE(cudamem_record_stream(id, x, side.s) == CUDAMEM_OK);
  REQUIRE(cudamem_deallocate(id, x, n * 4, 0, main_stream.s) == CUDAMEM_OK);
  CHECK(stats_of(id).pending_frees == 1);
  CHECK(cudaStreamQuery(side.s) == cudaErrorNotReady);

  void* z = nullptr;  // same size, same stream: x's block if the free had gone through
  REQUIRE(cudamem_allocate(id, n * 4, 0, main_stream.s, &z) == CUDAMEM_OK);
  CHECK(z != x);
  fill<<<256, 256, 0, main_stream.s>>>(static_cast<float*>(z), n, 7.0f);
  REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
  std::vector<float> out(n);
  REQUIRE(cudaMemcpy(out.data(), y, n * 4, cudaMemcpyDeviceToHost) == cudaSuccess);
  std::size_t wrong = 0;
  for (const float v : out) {
    wrong += v != 2.0f ? 1 : 0;
  }
  CHECK(wrong == 0);
  void* w = nullptr;  // the next call retires the free: its stream is done now
  REQUIRE(cudamem_allocate(id, 256, 0, main_stream.s, &w) == CUDAMEM_OK);
  CHECK(stats_of(id).pending_frees == 0);
  CHECK(stats_of(id).in_use_bytes == 2 * n * 4 + 256);
  for (auto [p, b] : {std::pair{y, n * 4}, std::pair{z, n * 4}, std::pair{w, std::size_t{256}}}) {
    CHECK(cudamem_deallocate(id, p, b, 0, main_stream.s) == CUDAMEM_OK);
  }
  REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
  cudaEventDestroy(filled);
  CHECK(cudamem_allocator_destroy(id) == CUDAMEM_OK);
}

TEST_CASE("c api gpu: out of memory is the device's report, and the allocator goes on",
          "[expected-api-error]") {
  const int id = make("resource=vm_pool, grow_ahead_bytes=0");
  std::size_t free = 0;
  std::size_t total = 0;
  REQUIRE(cudaMemGetInfo(&free, &total) == cudaSuccess);
  void* p = nullptr;
  CHECK(cudamem_allocate(id, total + GiB, 0, nullptr, &p) == CUDAMEM_ERROR_OUT_OF_MEMORY);
  const std::string report = cudamem_last_error();
  CHECK_THAT(report, Catch::Contains("Verdict: larger_than_device"));
  CHECK_THAT(report, Catch::Contains("This process (pid"));
  REQUIRE(cudamem_allocate(id, MiB, 0, nullptr, &p) == CUDAMEM_OK);
  CHECK(cudamem_deallocate(id, p, MiB, 0, nullptr) == CUDAMEM_OK);
  CHECK(cudamem_allocator_destroy(id) == CUDAMEM_OK);
}

TEST_CASE("c api gpu: PyTorch's entry points throw at a failed allocation",
          "[expected-api-error]") {
  const int id = make("resource=pool, limit_bytes=64MiB");
  REQUIRE(id >= 1);
  REQUIRE(id <= 15);
  // The entry points of allocator `id`: only the first few are spelled out here.
  using malloc_fn = void* (*)(size_t, int, cudamem_stream_t);
  using free_fn = void (*)(void*, size_t, int, cudamem_stream_t);
  const malloc_fn mallocs[] = {nullptr, cudamem_torch_malloc_1, cudamem_torch_malloc_2,
                               cudamem_torch_malloc_3};
  const free_fn frees[] = {nullptr, cudamem_torch_free_1, cudamem_torch_free_2,
                           cudamem_torch_free_3};
  REQUIRE(id <= 3);
  void* p = mallocs[id](32 * MiB, 0, nullptr);
  CHECK(p != nullptr);
  try {
    static_cast<void>(mallocs[id](64 * MiB, 0, nullptr));
    FAIL("no exception");
  } catch (const std::bad_alloc& e) {
    CHECK_THAT(e.what(), Catch::Contains("Verdict: budget"));
  }
  frees[id](p, 32 * MiB, 0, nullptr);
  CHECK(cudamem_allocator_destroy(id) == CUDAMEM_OK);
}
