// cudamem_c.h on a GPU: allocators over the real device (vm_pool, pool, async), stream order
// with record_stream, out of memory with the device's report, and PyTorch's entry points.
#include <cudamem/detail/nvtx.hpp>
#include <cudamem_c.h>

#include <catch2/catch.hpp>

#include <cuda_runtime_api.h>

#include <unistd.h>

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

/// Whether a vm_pool of the C API's stacks is on virtual memory: under compute-sanitizer it
/// takes cudaMalloc'd memory instead (vm_pool_resource.hpp says why), with no handles to export
/// and no mapped ranges to list.
bool vm_pool_on_virtual_memory() { return !cudamem::detail::compute_sanitizer_attached(); }

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

namespace {
std::vector<cudamem_segment> segments_of(int id, int device = 0) {
  std::size_t count = 0;
  REQUIRE(cudamem_segments(id, device, nullptr, 0, &count) == CUDAMEM_OK);
  std::vector<cudamem_segment> out(count);
  REQUIRE(cudamem_segments(id, device, out.data(), out.size(), &count) == CUDAMEM_OK);
  return out;
}
}  // namespace

TEST_CASE("c api gpu: segments are the vm_pool's mapped ranges and the pool's chunks") {
  for (const char* config : {"resource=vm_pool, grow_ahead_bytes=0", "resource=pool"}) {
    INFO(config);  // (under compute-sanitizer, vm_pool's ranges are its cudaMalloc'd memory)
    const int id = make(config);
    void* p = nullptr;
    REQUIRE(cudamem_allocate(id, 100 * MiB, 0, nullptr, &p) == CUDAMEM_OK);
    std::uint64_t total = 0;
    bool inside = false;
    for (const cudamem_segment& s : segments_of(id)) {
      total += s.bytes;
      const auto a = reinterpret_cast<std::uintptr_t>(p);
      inside = inside || (a >= s.address && a + 100 * MiB <= s.address + s.bytes);
      // The range is real device memory: a kernel may write its first and last bytes.
      fill<<<1, 1>>>(reinterpret_cast<float*>(s.address), 1, 1.0f);
      fill<<<1, 1>>>(reinterpret_cast<float*>(s.address + s.bytes) - 1, 1, 1.0f);
    }
    CHECK(cudaDeviceSynchronize() == cudaSuccess);
    CHECK(inside);
    CHECK(total == stats_of(id).reserved_bytes);
    CHECK(cudamem_deallocate(id, p, 100 * MiB, 0, nullptr) == CUDAMEM_OK);
    CHECK(cudamem_allocator_destroy(id) == CUDAMEM_OK);
  }
  const int async = make("resource=async");
  void* p = nullptr;
  REQUIRE(cudamem_allocate(async, MiB, 0, nullptr, &p) == CUDAMEM_OK);
  std::size_t count = 0;
  CHECK(cudamem_segments(async, 0, nullptr, 0, &count) == CUDAMEM_ERROR_STATE);
  CHECK_THAT(std::string(cudamem_last_error()), Catch::Contains("resource=async cannot list"));
  CHECK(cudamem_deallocate(async, p, MiB, 0, nullptr) == CUDAMEM_OK);
  CHECK(cudamem_allocator_destroy(async) == CUDAMEM_OK);
}

TEST_CASE("c api gpu: memory exported as PyTorch's IPC handles maps again, the same memory") {
  // The receiving side runs in this process (pidfd_getfd of our own fds): the same driver
  // calls as in another process, and the data must be the same bytes.
  void* p = nullptr;
  cudamem_ipc_export e{};
  e.struct_size = sizeof(e);
  std::vector<int> fds(64);
  std::size_t needed = 0;
  if (!vm_pool_on_virtual_memory()) {
    // Its memory is cudaMalloc'd then, and goes out as the cudaIpcMemHandle of its block.
    const int id = make("resource=vm_pool, grow_ahead_bytes=0");
    REQUIRE(cudamem_allocate(id, 24 * MiB, 0, nullptr, &p) == CUDAMEM_OK);
    CHECK(cudamem_ipc_export_range(id, 0, p, 24 * MiB, &e, fds.data(), fds.size(), &needed) ==
          CUDAMEM_OK);
    CHECK(e.kind == CUDAMEM_IPC_CUDA_MALLOC);
    CHECK(needed == 0);
    CHECK(cudamem_deallocate(id, p, 24 * MiB, 0, nullptr) == CUDAMEM_OK);
    CHECK(cudamem_allocator_destroy(id) == CUDAMEM_OK);
  } else {
    const int id = make("resource=vm_pool, grow_ahead_bytes=0");
    constexpr std::size_t n = (24 * MiB) / sizeof(float);
    REQUIRE(cudamem_allocate(id, n * sizeof(float), 0, nullptr, &p) == CUDAMEM_OK);
    fill<<<64, 256>>>(static_cast<float*>(p), n, 7.0f);
    REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
    std::size_t fd_count = 0;
    REQUIRE(cudamem_ipc_export_range(id, 0, p, n * sizeof(float), &e, fds.data(), fds.size(),
                                     &fd_count) == CUDAMEM_OK);
    CHECK(e.kind == CUDAMEM_IPC_VMM);
    CHECK(e.handle_bytes == 4 * MiB);
    CHECK(fd_count >= 6);
    void* base = nullptr;
    REQUIRE(cudamem_ipc_import(0, static_cast<int32_t>(getpid()), fds.data(), fd_count,
                               e.handle_bytes, &base) == CUDAMEM_OK);
    auto* mapped = reinterpret_cast<float*>(static_cast<char*>(base) + e.offset);
    CHECK(mapped != static_cast<float*>(p));  // another mapping of the same memory
    twice_into<<<64, 256>>>(mapped, mapped, n);  // written through the import ...
    REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
    std::vector<float> host(n);
    REQUIRE(cudaMemcpy(host.data(), p, n * sizeof(float), cudaMemcpyDeviceToHost) == cudaSuccess);
    CHECK(host.front() == 14.0f);  // ... read through the exporter's pointer
    CHECK(host.back() == 14.0f);
    CHECK(cudamem_ipc_unmap(base) == CUDAMEM_OK);
    CHECK(cudamem_ipc_unmap(base) == CUDAMEM_ERROR_INVALID_ARGUMENT);  // once only
    for (std::size_t i = 0; i < fd_count; ++i) {
      close(fds[i]);
    }
    // Too little room for the descriptors: refused, and it says how many.
    int one = -1;
    CHECK(cudamem_ipc_export_range(id, 0, p, n * sizeof(float), &e, &one, 1, &needed) ==
          CUDAMEM_ERROR_INVALID_ARGUMENT);
    CHECK(needed == fd_count);
    // Memory the allocator does not hold; a process that does not exist.
    int outside = 0;
    CHECK(cudamem_ipc_export_range(id, 0, &outside, 4, &e, fds.data(), fds.size(), &needed) ==
          CUDAMEM_ERROR_INVALID_ARGUMENT);
    int bogus_fd = 3;
    CHECK(cudamem_ipc_import(0, 999999999, &bogus_fd, 1, 4 * MiB, &base) ==
          CUDAMEM_ERROR_INVALID_ARGUMENT);
    CHECK_THAT(std::string(cudamem_last_error()), Catch::Contains("pidfd_open"));
    CHECK(cudamem_deallocate(id, p, n * sizeof(float), 0, nullptr) == CUDAMEM_OK);
    CHECK(cudamem_allocator_destroy(id) == CUDAMEM_OK);
  }
  // A pool over cudaMalloc shares the chunk's cudaIpcMemHandle; async cannot share at all.
  const int pool = make("resource=pool");
  REQUIRE(cudamem_allocate(pool, MiB, 0, nullptr, &p) == CUDAMEM_OK);
  REQUIRE(cudamem_ipc_export_range(pool, 0, p, MiB, &e, fds.data(), fds.size(), &needed) ==
          CUDAMEM_OK);
  CHECK(e.kind == CUDAMEM_IPC_CUDA_MALLOC);
  CHECK(needed == 0);
  CHECK(cudamem_deallocate(pool, p, MiB, 0, nullptr) == CUDAMEM_OK);
  CHECK(cudamem_allocator_destroy(pool) == CUDAMEM_OK);
  const int async = make("resource=async");
  REQUIRE(cudamem_allocate(async, MiB, 0, nullptr, &p) == CUDAMEM_OK);
  CHECK(cudamem_ipc_export_range(async, 0, p, MiB, &e, fds.data(), fds.size(), &needed) ==
        CUDAMEM_ERROR_STATE);
  CHECK_THAT(std::string(cudamem_last_error()), Catch::Contains("cannot be shared"));
  CHECK(cudamem_deallocate(async, p, MiB, 0, nullptr) == CUDAMEM_OK);
  CHECK(cudamem_allocator_destroy(async) == CUDAMEM_OK);
}
