// multi_gpu — one job split across every GPU: a worker thread per device, each with its
// device's pool, the results gathered on device 0 with peer copies.
//
//   ./run example multi_gpu
//
// The failure it avoids: the current device belongs to the *thread*. A new thread starts on
// device 0, so a worker that "owns GPU k" but never calls cudaSetDevice allocates its share on
// GPU 0 and runs its kernel there: every GPU's work piles onto GPU 0 (and GPU 0 runs out of
// memory first), while the other GPUs idle. The raw part below does exactly that and counts
// where each worker's memory landed. The cudamem part gives each device its own pool
// (per_device_resources, current for its device), each worker a device_guard, and gathers the
// slices on device 0 with copy() ordered after each worker's stream, under peer_access guards
// that leave peer access as they found it. Buffers made by the workers are freed on the main
// thread, with device 0 current: each goes back to its own device's pool.
// Peer access is enabled before anything is allocated: CUDA allows it later too, but
// compute-sanitizer then loses track of the pool blocks that already exist (docs/debugging.md,
// "Several GPUs").
// With one GPU it still runs (the whole job on device 0) and says so.
#include <cudamem/cudamem.hpp>

#include <cstdio>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <vector>

namespace {

__global__ void square_plus(cudamem::device_span<float> x, float offset) {
  const std::size_t i = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x;
  if (i < x.size()) {
    x[i] = x[i] * x[i] + offset;
  }
}

int device_of(const void* p) {
  cudaPointerAttributes attributes{};
  cudamem::check(cudaPointerGetAttributes(&attributes, p), "cudaPointerGetAttributes");
  return attributes.device;
}

}  // namespace

int main() try {
  const int gpus = cudamem::device_count();
  if (gpus == 0) {
    throw cudamem::no_device_error(cudaErrorNoDevice, "multi_gpu");
  }
  constexpr std::size_t n = std::size_t{1} << 24;  // 64 MiB of floats in all
  const std::size_t share = (n + gpus - 1) / gpus;
  for (int d = 0; d < gpus; ++d) {
    std::printf("device %d: %s\n", d, cudamem::get_device_properties(d).name.c_str());
  }

  // --- raw: workers that forget cudaSetDevice --------------------------------------------------
  std::vector<int> raw_device(gpus, -1);
  {
    std::vector<std::thread> workers;
    for (int k = 0; k < gpus; ++k) {
      workers.emplace_back([&, k] {
        float* mine = nullptr;  // "GPU k's share", but the thread's device is 0
        if (cudaMalloc(&mine, share * sizeof(float)) == cudaSuccess) {
          raw_device[k] = device_of(mine);
          cudaFree(mine);
        }
      });
    }
    for (auto& w : workers) {
      w.join();
    }
  }
  int raw_right = 0;
  for (int k = 0; k < gpus; ++k) {
    raw_right += raw_device[k] == k ? 1 : 0;
    std::printf("raw:     worker %d's buffer landed on device %d\n", k, raw_device[k]);
  }

  // --- cudamem: a pool per device, a guard per worker, peer copies to gather --------------------
  // Peer access first, both ways between device 0 and every other device that has a path.
  std::vector<cudamem::peer_access> reach;
  int direct = 0;
  for (int k = 1; k < gpus; ++k) {
    if (cudamem::can_access_peer(0, k) && cudamem::can_access_peer(k, 0)) {
      reach.emplace_back(0, k);
      reach.emplace_back(k, 0);
      ++direct;
    }
  }
  auto pools = cudamem::per_device_resources::pools();  // current resource of every device
  std::vector<float> input(n);
  for (std::size_t i = 0; i < n; ++i) {
    input[i] = static_cast<float>(i % 1000);
  }
  std::vector<cudamem::stream> streams;
  for (int k = 0; k < gpus; ++k) {
    streams.emplace_back(cudamem::stream_options{.device = k, .non_blocking = true});
  }
  std::vector<std::optional<cudamem::device_buffer<float>>> slices(gpus);
  std::vector<int> cudamem_device(gpus, -1);
  {
    std::vector<std::thread> workers;
    for (int k = 0; k < gpus; ++k) {
      workers.emplace_back([&, k] {
        const cudamem::device_guard on{k};  // this thread now works on device k
        const std::size_t begin = std::min(n, k * share);
        const std::size_t count = std::min(n, begin + share) - begin;
        // From device k's pool (the current resource), filled from the host on k's stream.
        auto& x = slices[k].emplace(std::span<const float>(input).subspan(begin, count), streams[k]);
        cudamem_device[k] = device_of(x.data());
        square_plus<<<static_cast<unsigned>((count + 255) / 256), 256, 0, streams[k].get()>>>(
            x, static_cast<float>(k));
        cudamem::check(cudaGetLastError(), "launching square_plus");
      });
    }
    for (auto& w : workers) {
      w.join();
    }
  }

  // Gather on device 0: each slice copied after its worker's stream, directly between GPUs
  // where a peer path exists (the guards above enabled it; they restore it at the end).
  const cudamem::device_guard on_0{0};
  std::vector<float> host(n);
  {
    cudamem::device_buffer<float> result(n, streams[0]);  // device 0's pool
    for (int k = 0; k < gpus; ++k) {
      const std::size_t begin = std::min(n, k * share);
      cudamem::copy(result.span().subspan(begin, slices[k]->size()), *slices[k], streams[0],
                    streams[k]);
    }
    cudamem::copy(host, result, streams[0]);
    streams[0].synchronize();
  }
  slices.clear();  // freed here, on the main thread with device 0 current: each to its pool
  reach.clear();   // peer access back as it was

  std::size_t wrong = 0;
  for (std::size_t i = 0; i < n; ++i) {
    const float x = static_cast<float>(i % 1000);
    const float expected = x * x + static_cast<float>(i / share);
    wrong += host[i] != expected ? 1 : 0;
  }
  int cudamem_right = 0;
  for (int k = 0; k < gpus; ++k) {
    cudamem_right += cudamem_device[k] == k ? 1 : 0;
    std::printf("cudamem: worker %d's buffer landed on device %d\n", k, cudamem_device[k]);
  }
  std::size_t still_used = 0;
  for (const int d : pools.devices()) {
    still_used += pools.get(d).stats().used_bytes;
  }
  if (gpus == 1) {
    std::printf("one GPU: the whole job ran on device 0; no copies between GPUs to make\n");
  } else {
    std::printf("gathered %d slices on device 0 (%d of %d peers direct, the rest staged by the "
                "driver); pool bytes still in use after the job: %zu\n",
                gpus, direct, gpus - 1, still_used);
  }
  const bool ok = wrong == 0 && still_used == 0;
  std::printf("multi_gpu: %d GPU(s), result %s, buffers on their own GPU: raw %d of %d, cudamem "
              "all %d\n",
              gpus, ok ? "ok" : "WRONG", raw_right, gpus, cudamem_right == gpus ? gpus : -1);
  return ok && cudamem_right == gpus ? 0 : 1;
} catch (const cudamem::no_device_error& e) {
  std::printf("multi_gpu: no usable CUDA device here (%s), nothing to run\n", e.name());
  return 69;
} catch (const std::exception& e) {
  std::fprintf(stderr, "multi_gpu failed: %s\n", e.what());
  return 1;
}
