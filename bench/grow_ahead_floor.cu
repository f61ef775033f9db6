// bench_grow_ahead_floor — what the rest of a CUDA program takes from the device in the middle
// of a run, measured, to check the floor that vm_pool's growth ahead leaves free
// (cudamem::default_grow_ahead_floor, vm_resource.hpp: max(2 GiB, device/32)).
//
//   ./run bench grow_ahead_floor            # the steps below, once, in one fresh process
//
// Why this program. Memory a vm_pool makes ahead of need is a guess; the floor is what it leaves
// for the parts of the process that call cudaMalloc, not cudamem, and so cannot ask it to give
// memory back (detail/held_ahead.hpp). Each step below is one such part, as a training or
// inference program meets it after start-up; the device's free memory (cudaMemGetInfo) is read
// before and after each one, and the difference is what that part took and kept. Run it on a
// GPU nobody else is using: the figures are the device's, not the process's.
//
// Steps (in this order, each on top of the ones before):
//   context            the primary context (cudaFree(nullptr)) — before the baseline, shown
//   lazy load          the first launch of a kernel of this program (CUDA_MODULE_LOADING=LAZY)
//   local memory 1/4/16 KiB   a kernel whose threads each need that much stack: the driver
//                      grows its local memory reservation for every resident thread
//   device heap        the first kernel calling malloc (cudaLimitMallocHeapSize, 8 MiB default)
//   cuBLAS, 1 stream   cublasCreate and one SGEMM (its workspace, its kernels loaded)
//   cuBLAS, 8 streams  one handle per stream, an SGEMM on each (a framework's streams)
//   NCCL               a one-rank communicator from ncclCommInitAll and an all-reduce of
//                      64 MiB (its buffers; where NCCL was found at build time)
// The table ends with the total and the floor on this device, and their ratio.
#include <cudamem/device.hpp>
#include <cudamem/error.hpp>
#include <cudamem/vm_resource.hpp>

#include <cublas_v2.h>
#include <cuda_runtime.h>
#ifdef CUDAMEM_BENCH_WITH_NCCL
#include <nccl.h>
#endif

#include <cstddef>
#include <cstdio>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

constexpr double mib = 1024.0 * 1024.0;

/// The device's free memory once the work queued so far (a step's kernels) has run.
std::size_t free_now() {
  cudamem::check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  return cudamem::device_memory(0).free;
}

void check_cublas(cublasStatus_t status, const char* what) {
  if (status != CUBLAS_STATUS_SUCCESS) {
    throw std::runtime_error(std::string(what) + " failed: cuBLAS status " +
                             std::to_string(static_cast<int>(status)));
  }
}

__global__ void touch(int* out) { *out = 1; }

/// Each thread fills and reads back an array of `Ints` ints indexed at run time, so the
/// compiler must keep it in local memory: the launch needs that much stack per thread.
template <int Ints>
__global__ void needs_local_memory(int* out, int seed) {
  volatile int local[Ints];
  for (int i = 0; i < Ints; ++i) {
    local[i] = seed + i;
  }
  const int pick = (seed + static_cast<int>(threadIdx.x)) % Ints;
  if (local[pick] == -1) {
    *out = local[pick];
  }
}

__global__ void heap_malloc(int* out) {
  void* p = malloc(64);
  *out = p != nullptr ? 1 : 0;
  free(p);
}

struct step {
  std::string name;
  double taken_mib;
};

class meter {
 public:
  meter() : last_(free_now()) {}
  /// Runs `work`, then records what the device lost over it.
  template <class Work>
  void measure(const std::string& name, Work&& work) {
    work();
    const std::size_t now = free_now();
    steps_.push_back({name, (static_cast<double>(last_) - static_cast<double>(now)) / mib});
    last_ = now;
  }
  [[nodiscard]] const std::vector<step>& steps() const { return steps_; }

 private:
  std::size_t last_;
  std::vector<step> steps_;
};

}  // namespace

int main() {
  if (cudamem::device_count() == 0) {
    std::printf("SKIPPED: no CUDA device\n");
    return 69;  // every benchmark's "nothing measured" (bench/README.md)
  }
  cudamem::check(cudaSetDevice(0), "cudaSetDevice");
  const cudamem::memory_usage at_start = cudamem::device_memory(0);  // makes the context
  cudaDeviceProp prop{};  // for the resident threads per SM, which device_properties lacks
  cudamem::check(cudaGetDeviceProperties(&prop, 0), "cudaGetDeviceProperties");
  const std::size_t total = at_start.total;
  std::printf("device 0: %s, %d SMs x %d resident threads, %.0f MiB total, %.0f MiB free with "
              "this process's context\n",
              prop.name, prop.multiProcessorCount, prop.maxThreadsPerMultiProcessor,
              static_cast<double>(total) / mib, static_cast<double>(at_start.free) / mib);

  int* flag = nullptr;
  meter m;
  m.measure("lazy load (first launch of a kernel)", [&] {
    cudamem::check(cudaMalloc(&flag, 256), "cudaMalloc");
    touch<<<1, 1>>>(flag);
  });
  m.measure("local memory: 1 KiB per thread", [&] { needs_local_memory<256><<<1, 32>>>(flag, 3); });
  m.measure("local memory: 4 KiB per thread", [&] { needs_local_memory<1024><<<1, 32>>>(flag, 3); });
  m.measure("local memory: 16 KiB per thread",
            [&] { needs_local_memory<4096><<<1, 32>>>(flag, 3); });
  m.measure("device heap (first in-kernel malloc)", [&] { heap_malloc<<<1, 1>>>(flag); });

  std::vector<cublasHandle_t> handles;
  std::vector<cudaStream_t> streams;
  constexpr int n = 1024;
  float* matrices = nullptr;
  const auto gemm_on = [&](cudaStream_t s) {
    cublasHandle_t h = nullptr;
    check_cublas(cublasCreate(&h), "cublasCreate");
    handles.push_back(h);
    check_cublas(cublasSetStream(h, s), "cublasSetStream");
    const float one = 1.0f;
    const float zero = 0.0f;
    check_cublas(cublasSgemm(h, CUBLAS_OP_N, CUBLAS_OP_N, n, n, n, &one, matrices, n,
                             matrices + n * n, n, &zero, matrices + 2 * n * n, n),
                 "cublasSgemm");
  };
  cudamem::check(cudaMalloc(&matrices, 3 * sizeof(float) * n * n), "cudaMalloc");
  cudamem::check(cudaMemset(matrices, 0, 3 * sizeof(float) * n * n), "cudaMemset");
  m.measure("cuBLAS: a handle and one SGEMM (+12 MiB of our matrices)", [&] {
    streams.push_back(nullptr);
    cudamem::check(cudaStreamCreate(&streams.back()), "cudaStreamCreate");
    gemm_on(streams.back());
  });
  m.measure("cuBLAS: 7 more handles, one per stream", [&] {
    for (int i = 0; i < 7; ++i) {
      streams.push_back(nullptr);
      cudamem::check(cudaStreamCreate(&streams.back()), "cudaStreamCreate");
      gemm_on(streams.back());
    }
  });

#ifdef CUDAMEM_BENCH_WITH_NCCL
  ncclComm_t comm = nullptr;
  float* reduced = nullptr;
  m.measure("NCCL: one-rank communicator and a 64 MiB all-reduce (+64 MiB of ours)", [&] {
    int only = 0;
    if (ncclCommInitAll(&comm, 1, &only) != ncclSuccess) {
      throw std::runtime_error("ncclCommInitAll failed");
    }
    cudamem::check(cudaMalloc(&reduced, 64u << 20), "cudaMalloc");
    if (ncclAllReduce(reduced, reduced, (64u << 20) / sizeof(float), ncclFloat, ncclSum, comm,
                      streams.front()) != ncclSuccess) {
      throw std::runtime_error("ncclAllReduce failed");
    }
  });
#else
  std::printf("(NCCL not found at build time: its step is not measured)\n");
#endif

  std::printf("\n%-72s %10s\n", "step (each on top of the ones before)", "MiB taken");
  double sum = 0;
  for (const step& s : m.steps()) {
    std::printf("%-72s %10.1f\n", s.name.c_str(), s.taken_mib);
    sum += s.taken_mib;
  }
  const double floor_mib = static_cast<double>(cudamem::default_grow_ahead_floor(total)) / mib;
  std::printf("%-72s %10.1f\n", "total", sum);
  std::printf("%-72s %10.1f\n", "default_grow_ahead_floor on this device", floor_mib);
  std::printf("floor / total taken: %.2f\n", sum > 0 ? floor_mib / sum : 0.0);

#ifdef CUDAMEM_BENCH_WITH_NCCL
  ncclCommDestroy(comm);
  cudaFree(reduced);
#endif
  for (cublasHandle_t h : handles) {
    cublasDestroy(h);
  }
  for (cudaStream_t s : streams) {
    cudaStreamDestroy(s);
  }
  cudaFree(matrices);
  cudaFree(flag);
  return 0;
}
