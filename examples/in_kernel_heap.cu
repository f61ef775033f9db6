// in_kernel_heap — `new` inside a kernel draws on the device's malloc
// heap, which is only 8 MiB unless you say otherwise. When it runs out, device `new` does not
// throw: it returns nullptr, and a kernel that does not check writes through it.
//
//   ./run example in_kernel_heap
//
// 16384 threads each take 4 KiB of scratch with `new float[1024]` (64 MiB in all) and keep it
// until a second kernel deletes it. The raw version launches with the default heap; the
// cudamem version first sizes the heap for the batch with a heap_limit_guard. Each thread
// records the pointer it got, and the host counts the nullptrs.
//
// The heap's size can only be set before the first kernel that uses it; after that it is fixed
// for the life of the context. So each version runs in a fresh context of its own
// (cudamem::context), and the example also shows what the guard can and cannot restore.
#include <cudamem/cudamem.hpp>

#include <cstdio>
#include <string>
#include <vector>

namespace {

constexpr std::size_t MiB = std::size_t{1} << 20;
constexpr int blocks = 64;
constexpr int threads = 256;
constexpr std::size_t scratch_floats = 1024;  // 4 KiB per thread
constexpr std::size_t batch_bytes = std::size_t{blocks} * threads * scratch_floats * sizeof(float);

// The usual kernel, with the check it lacks: record what `new` returned.
__global__ void take_scratch(cudamem::device_span<float*> scratch) {
  const std::size_t i = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x;
  float* temp = new float[scratch_floats];  // nullptr when the heap is exhausted
  if (temp != nullptr) {
    temp[0] = 1.0F;  // ...processing using temp...
  }
  scratch[i] = temp;
}

__global__ void give_back_scratch(cudamem::device_span<float*> scratch) {
  const std::size_t i = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x;
  delete[] scratch[i];  // delete[] of nullptr does nothing, as on the host
}

// Runs the batch in the current context; returns how many threads got nullptr.
std::size_t run_batch() {
  cudamem::device_buffer<float*> scratch(std::size_t{blocks} * threads, cudamem::zero_fill);
  take_scratch<<<blocks, threads>>>(scratch);
  cudamem::check(cudaGetLastError(), "launching take_scratch");
  std::vector<float*> got(scratch.size());
  cudamem::copy(got, scratch, {});
  give_back_scratch<<<blocks, threads>>>(scratch);
  cudamem::check(cudaDeviceSynchronize(), "the batch");
  std::size_t failed = 0;
  for (const float* p : got) {
    failed += p == nullptr ? 1 : 0;
  }
  return failed;
}

std::string heap_size() {
  return cudamem::format_bytes(cudamem::get_limit(cudaLimitMallocHeapSize));
}

}  // namespace

int main() try {
  std::printf("device 0: %s; the batch needs %s of device heap\n",
              cudamem::get_device_properties(0).name.c_str(),
              cudamem::format_bytes(batch_bytes).c_str());
  const std::size_t total = std::size_t{blocks} * threads;

  std::size_t raw = 0;
  {
    cudamem::context ctx{{.device = 0}};  // a fresh context: the default heap
    cudamem::context_guard in_ctx{ctx};
    std::printf("raw:     heap %s (the default)\n", heap_size().c_str());
    raw = run_batch();
    std::printf("raw:     %zu of %zu threads got nullptr from new\n", raw, total);
  }

  std::size_t owned = 0;
  {
    cudamem::context ctx{{.device = 0}};
    cudamem::context_guard in_ctx{ctx};
    {  // before any kernel used the heap, a guard's change is undone at the end of its scope
      cudamem::heap_limit_guard probe{1024 * MiB};
      std::printf("cudamem: heap %s -> %s inside a guard's scope", heap_size().c_str(),
                  cudamem::format_bytes(probe.value()).c_str());
    }
    std::printf(" -> %s after it (restored)\n", heap_size().c_str());

    // Device malloc rounds sizes and keeps headers: give it room beyond the bytes asked for.
    cudamem::heap_limit_guard heap{4 * batch_bytes};
    std::printf("cudamem: heap %s for the batch\n", heap_size().c_str());
    owned = run_batch();
    std::printf("cudamem: %zu of %zu threads got nullptr from new\n", owned, total);
    const bool restored = heap.restore();  // refused: a kernel has used the heap
    std::printf("cudamem: after the batch the heap stays %s (restored: %s) until its context "
                "goes, which the context owner does next\n",
                heap_size().c_str(), restored ? "yes" : "no, fixed once used");
  }

  std::printf("failed device new: raw %zu of %zu, cudamem %zu of %zu\n", raw, total, owned, total);
  return raw > 0 && owned == 0 ? 0 : 1;
} catch (const cudamem::no_device_error& e) {
  std::printf("in_kernel_heap: no usable CUDA device here (%s), nothing to run\n", e.name());
  return 69;
} catch (const std::exception& e) {
  std::fprintf(stderr, "in_kernel_heap failed: %s\n", e.what());
  return 1;
}
