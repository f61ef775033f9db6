// nccl_allreduce — one process drives every visible GPU; each step all-reduces a "gradient"
// across them with NCCL, on buffers NCCL has registered (so it can read and write them
// directly instead of staging them through buffers of its own).
//
//   ./run example nccl_allreduce          (needs NCCL: see cmake/cudamem_nccl.cmake)
//
// The raw way registers every buffer: ncclMemAlloc, ncclCommRegister, the all-reduce,
// ncclCommDeregister, ncclMemFree — five calls to pair by hand per buffer, on every path (a
// buffer freed while still registered leaves NCCL holding mappings of freed memory), and one
// registration for every buffer. The cudamem way gives each GPU a pool on NCCL's allocator
// whose chunks are registered as they are made (nccl_registering_adaptor), made current for its
// device by per_device_resources: a device_buffer is the whole story, and a handful of
// registrations serve every buffer of the run. Both ways check every element of every result.
// With one GPU it still runs (one rank: the all-reduce copies) and says so.
// NCCL_NVLS_ENABLE=0 is set (if unset) before NCCL starts: NVLink multicast stays off.
#include <cudamem/cudamem.hpp>
#include <cudamem/nccl.hpp>

#include <nccl.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <vector>

namespace {

constexpr int steps = 16;

/// Floats in step k's gradient: 1, 2, 3 or 4 Mi (4 to 16 MiB).
std::size_t gradient_size(int step) { return static_cast<std::size_t>(1 + step % 4) << 20; }

/// Fills rank r's send buffer with r + 1 + step on its stream.
void fill(float* p, std::size_t count, int rank, int step, cudaStream_t s) {
  const auto value = static_cast<float>(rank + 1 + step);
  cudamem::detail::fill_bytes(p, count, &value, sizeof value, s);
}

/// All-reduces send into recv on every rank (one NCCL group), then counts the wrong elements.
std::size_t reduce_and_check(const std::vector<cudamem::nccl_communicator>& comms,
                             const std::vector<float*>& send, const std::vector<float*>& recv,
                             std::size_t count, int step, std::vector<cudamem::stream>& streams) {
  const int n = static_cast<int>(comms.size());
  cudamem::check_nccl(ncclGroupStart(), "ncclGroupStart");
  for (int r = 0; r < n; ++r) {
    cudamem::check_nccl(ncclAllReduce(send[r], recv[r], count, ncclFloat, ncclSum,
                                      comms[r].get(), streams[r].get()),
                        "ncclAllReduce");
  }
  cudamem::check_nccl(ncclGroupEnd(), "ncclGroupEnd");
  // sum over ranks of (r + 1 + step)
  const auto expected = static_cast<float>(n * (n + 1) / 2 + n * step);
  std::size_t wrong = 0;
  std::vector<float> host(count);
  for (int r = 0; r < n; ++r) {
    const cudamem::device_guard on{r};
    cudamem::check(cudaMemcpyAsync(host.data(), recv[r], count * sizeof(float),
                                   cudaMemcpyDeviceToHost, streams[r].get()));
    streams[r].synchronize();
    wrong += static_cast<std::size_t>(
        std::count_if(host.begin(), host.end(), [&](float x) { return x != expected; }));
  }
  return wrong;
}

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace

int main() try {
  ::setenv("NCCL_NVLS_ENABLE", "0", 0);  // before NCCL reads its settings
  const int gpus = cudamem::device_count();
  if (gpus == 0) {
    throw cudamem::no_device_error(cudaErrorNoDevice, "nccl_allreduce");
  }
  for (int d = 0; d < gpus; ++d) {
    std::printf("device %d: %s\n", d, cudamem::get_device_properties(d).name.c_str());
  }
  // Declared first, destroyed last: every registration must go before its communicator.
  const std::vector<cudamem::nccl_communicator> comms = cudamem::nccl_communicator::init_all();
  std::vector<cudamem::stream> streams;
  for (int d = 0; d < gpus; ++d) {
    streams.emplace_back(cudamem::stream_options{.device = d, .non_blocking = true});
  }

  // --- raw: every buffer allocated, registered, deregistered and freed by hand ----------------
  std::size_t raw_wrong = 0;
  int raw_registrations = 0;
  const auto raw_start = std::chrono::steady_clock::now();
  for (int step = 0; step < steps; ++step) {
    const std::size_t count = gradient_size(step);
    std::vector<float*> send(gpus, nullptr);
    std::vector<float*> recv(gpus, nullptr);
    std::vector<void*> send_handle(gpus, nullptr);
    std::vector<void*> recv_handle(gpus, nullptr);
    for (int r = 0; r < gpus; ++r) {
      const cudamem::device_guard on{r};
      // (An exception below would leak all of this: the raw way has no owner for any of it.)
      cudamem::check_nccl(ncclMemAlloc(reinterpret_cast<void**>(&send[r]), count * sizeof(float)));
      cudamem::check_nccl(ncclMemAlloc(reinterpret_cast<void**>(&recv[r]), count * sizeof(float)));
      cudamem::check_nccl(ncclCommRegister(comms[r].get(), send[r], count * sizeof(float),
                                           &send_handle[r]));
      cudamem::check_nccl(ncclCommRegister(comms[r].get(), recv[r], count * sizeof(float),
                                           &recv_handle[r]));
      raw_registrations += 2;
      fill(send[r], count, r, step, streams[r].get());
    }
    raw_wrong += reduce_and_check(comms, send, recv, count, step, streams);
    for (int r = 0; r < gpus; ++r) {
      // Deregister before freeing, on every path, in this order: by hand.
      cudamem::check_nccl(ncclCommDeregister(comms[r].get(), send_handle[r]));
      cudamem::check_nccl(ncclCommDeregister(comms[r].get(), recv_handle[r]));
      cudamem::check_nccl(ncclMemFree(send[r]));
      cudamem::check_nccl(ncclMemFree(recv[r]));
    }
  }
  const double raw_seconds = seconds_since(raw_start);

  // --- cudamem: a registered pool per GPU, current for its device ----------------------------
  std::size_t cudamem_wrong = 0;
  int cudamem_registrations = 0;
  int still_registered = 0;
  double cudamem_seconds = 0;
  {
    cudamem::per_device_resources pools{
        [&comms](cudamem::resource_stack& stack, int d) -> cudamem::memory_resource& {
          auto& nccl_memory = stack.make<cudamem::nccl_mem_resource>(d);  // ncclMemAlloc
          auto& registered =
              stack.make<cudamem::nccl_registering_adaptor>(nccl_memory, comms[d].get());
          return stack.make<cudamem::pool_resource>(registered);  // chunks registered once
        }};
    const auto start = std::chrono::steady_clock::now();
    for (int step = 0; step < steps; ++step) {
      const std::size_t count = gradient_size(step);
      std::vector<cudamem::device_buffer<float>> send;
      std::vector<cudamem::device_buffer<float>> recv;
      std::vector<float*> send_ptr;
      std::vector<float*> recv_ptr;
      for (int r = 0; r < gpus; ++r) {
        const cudamem::device_guard on{r};  // device r's pool is its current resource
        send.emplace_back(count, streams[r]);
        recv.emplace_back(count, streams[r]);
        send_ptr.push_back(send.back().data());
        recv_ptr.push_back(recv.back().data());
        fill(send_ptr.back(), count, r, step, streams[r].get());
      }
      cudamem_wrong += reduce_and_check(comms, send_ptr, recv_ptr, count, step, streams);
    }  // buffers back to their pools, on their streams; the chunks stay registered
    cudamem_seconds = seconds_since(start);
    for (const int d : pools.devices()) {
      auto& registered = pools.find<cudamem::nccl_registering_adaptor>(d);
      cudamem_registrations += static_cast<int>(registered.registrations_made());
      pools.find<cudamem::pool_resource>(d).release();  // deregistered, then ncclMemFree
      still_registered += static_cast<int>(registered.registrations());
    }
  }  // the pools, then (at the end of main) the communicators

  const int buffers = 2 * steps * gpus;
  if (gpus == 1) {
    std::printf("one GPU: a one-rank all-reduce copies its input; the registrations are the "
                "same as on many GPUs\n");
  }
  std::printf("%d steps of 4-16 MiB gradients: raw %.1f ms, cudamem %.1f ms (both check every "
              "element on the host)\n",
              steps, raw_seconds * 1e3, cudamem_seconds * 1e3);
  const bool ok = raw_wrong == 0 && cudamem_wrong == 0;
  std::printf("nccl_allreduce: %d GPU(s), results %s, registrations for %d buffers: raw %d, "
              "cudamem %d, still registered after release %d\n",
              gpus, ok ? "ok" : "WRONG", buffers, raw_registrations, cudamem_registrations,
              still_registered);
  return ok && still_registered == 0 && cudamem_registrations < raw_registrations ? 0 : 1;
} catch (const cudamem::no_device_error& e) {
  std::printf("nccl_allreduce: no usable CUDA device here (%s), nothing to run\n", e.name());
  return 69;
} catch (const std::exception& e) {
  std::fprintf(stderr, "nccl_allreduce failed: %s\n", e.what());
  return 1;
}
