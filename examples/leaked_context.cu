// leaked_context — "out of memory, yet no process is running". A CUDA
// context created by hand and skipped by an exception keeps everything it holds — the memory
// allocated in it *and* its own overhead — until the process exits. cudamem::context destroys
// it on every path, and everything made in it goes with it.
//
//   ./run example leaked_context
//
// Two jobs each create a context, allocate 256 MiB in it and fail. The raw version calls
// cuCtxCreate and would call cuCtxDestroy at the end; the cudamem version owns the context
// and makes it current with a context_guard. The device's free memory is measured around each.
// (The driver API is reached through cudamem's loader, detail::driver(), so this example needs
// no libcuda at link time and still starts on a machine with no driver.)
#include <cudamem/cudamem.hpp>

#include <cstdio>
#include <stdexcept>
#include <vector>

namespace {

constexpr std::size_t MiB = std::size_t{1} << 20;
constexpr std::size_t job_bytes = 256 * MiB;
constexpr int jobs = 2;
constexpr std::size_t tolerance = 4 * MiB;  // driver bookkeeping; see device_scope.hpp

struct job_failed : std::runtime_error {
  job_failed() : std::runtime_error("job failed") {}
};

// The job's body, the same in both versions: allocate in whatever context is current, fail
// before the cudaFree. (Destroying the context frees even this.)
void work_in_current_context(bool input_is_bad) {
  void* data = nullptr;
  cudamem::check(cudaMalloc(&data, job_bytes), "cudaMalloc in the job's context");
  if (input_is_bad) {
    throw job_failed{};
  }
  cudamem::check(cudaFree(data), "cudaFree");
}

std::vector<CUcontext> lost_contexts;  // only so the example can clean up at the end

// The usual pattern: create a context, work, destroy it at the end — which the exception skips.
void raw_job() {
  const cudamem::detail::driver_api& cu = cudamem::detail::driver();
  CUdevice device = 0;
  cudamem::detail::check_driver(cu.device_get(&device, 0), "cuDeviceGet");
  CUcontext ctx = nullptr;
  cudamem::detail::check_driver(cu.ctx_create(&ctx, nullptr, 0, device), "cuCtxCreate");
  lost_contexts.push_back(ctx);
  work_in_current_context(true);                                       // throws, so...
  cudamem::detail::check_driver(cu.ctx_destroy(ctx), "cuCtxDestroy");  // ...this never runs
}

// The same job with owners: the guard pops the context, then ~context destroys it.
void cudamem_job() {
  cudamem::context ctx{{.device = 0}};
  cudamem::context_guard in_ctx{ctx};
  work_in_current_context(true);
}

std::size_t free_device_memory() {
  cudamem::check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  return cudamem::device_memory(0).free;
}

template <class Job>
std::size_t held_after(const char* what, Job job) {
  const std::size_t before = free_device_memory();
  for (int i = 0; i < jobs; ++i) {
    try {
      job();
    } catch (const job_failed&) {
      // The raw job also left its context current on this thread (cuCtxCreate pushes it).
      // Take it off the stack so that the rest of the program runs in the primary context.
      CUcontext current = cudamem::current_context();
      if (current != nullptr && !lost_contexts.empty() && current == lost_contexts.back()) {
        cudamem::detail::check_driver(cudamem::detail::driver().ctx_pop_current(&current),
                                      "cuCtxPopCurrent");
      }
    }
  }
  const std::size_t after = free_device_memory();
  const std::size_t shortfall = before > after ? before - after : 0;
  std::printf("%-30s free %s before, %s after %d failed jobs: %s held (%s of it per job beyond "
              "its data)\n",
              what, cudamem::format_bytes(before).c_str(), cudamem::format_bytes(after).c_str(),
              jobs, cudamem::format_bytes(shortfall).c_str(),
              cudamem::format_bytes(shortfall / jobs > job_bytes ? shortfall / jobs - job_bytes : 0)
                  .c_str());
  return shortfall > tolerance ? shortfall : 0;
}

}  // namespace

int main() try {
  std::printf("device 0: %s\n", cudamem::get_device_properties(0).name.c_str());
  { cudamem::context warm_up{{.device = 0}}; }  // the driver's first-context set-up, not a leak

  const std::size_t raw = held_after("raw cuCtxCreate + throw:", raw_job);
  const std::size_t owned = held_after("cudamem::context + throw:", cudamem_job);

  for (CUcontext ctx : lost_contexts) {  // give back what the raw version lost
    cudamem::detail::check_driver(cudamem::detail::driver().ctx_destroy(ctx), "cuCtxDestroy");
  }
  std::printf("cleanup: destroyed the %zu contexts the raw version lost; %s free now\n",
              lost_contexts.size(), cudamem::format_bytes(free_device_memory()).c_str());

  std::printf("context leak bytes: raw %zu, cudamem %zu\n", raw, owned);
  return raw >= jobs * job_bytes && owned == 0 ? 0 : 1;
} catch (const cudamem::no_device_error& e) {
  std::printf("leaked_context: no usable CUDA device here (%s), nothing to run\n", e.name());
  return 69;
} catch (const std::exception& e) {
  std::fprintf(stderr, "leaked_context failed: %s\n", e.what());
  return 1;
}
