// stream_ordered — memory freed on one stream and reused on another.
// "Freed" only means the host has *submitted* the last use; the GPU may still be running it.
// Reuse the memory on another stream without ordering the two, and one stream's data lands
// in another stream's result.
//
//   ./run example stream_ordered
//
// Four streams take turns with one buffer. Each fills it with its own number, holds it for
// 20 ms (a stand-in for real work), copies it back, and frees it. The raw version uses the
// naive cache many hand-written allocators are: "free" puts the pointer on a list, "allocate"
// takes it off — no streams, no events. The cudamem version uses a pool_resource that holds
// exactly one buffer, so every stream must reuse the same memory too; the pool makes each
// stream wait (on the GPU, not the host) until the previous stream's free has completed.
#include <cudamem/cudamem.hpp>

#include <cstdio>
#include <vector>

namespace {

constexpr std::size_t n = std::size_t{1} << 20;  // 4 MiB of ints
constexpr int streams = 4;
constexpr unsigned long long hold_ns = 20'000'000;  // 20 ms

__global__ void fill(cudamem::device_span<int> x, int value) {
  const std::size_t i = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x;
  if (i < x.size()) {
    x[i] = value;
  }
}

// One thread that waits on the GPU: the stream is busy, the rest of the GPU is free.
__global__ void hold(unsigned long long ns) {
  unsigned long long start = 0;
  unsigned long long now = 0;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
  do {
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  } while (now - start < ns);
}

// What every stream does with the buffer it was given, in its own stream order.
void use(cudamem::device_span<int> buffer, int value, cudamem::pinned_buffer<int>& result,
         cudamem::stream_view s) {
  fill<<<(n + 255) / 256, 256, 0, s.get()>>>(buffer, value);
  hold<<<1, 1, 0, s.get()>>>(hold_ns);
  cudamem::check(cudaGetLastError(), "launching the stream's work");
  cudamem::copy(result, buffer, s);  // device -> pinned host, in order on s
}

// Elements of stream k's result that are not k + 1.
std::size_t corrupted(const std::vector<cudamem::pinned_buffer<int>>& results) {
  std::size_t wrong = 0;
  for (int k = 0; k < streams; ++k) {
    for (const int value : results[k]) {
      wrong += value != k + 1 ? 1 : 0;
    }
  }
  return wrong;
}

}  // namespace

int main() try {
  std::printf("device 0: %s\n", cudamem::get_device_properties(0).name.c_str());
  std::vector<cudamem::stream> s(streams);  // made first: they must outlive the pool
  std::vector<cudamem::pinned_buffer<int>> results;
  for (int k = 0; k < streams; ++k) {
    results.emplace_back(n, 0);
  }

  // Raw: a one-buffer naive cache. Stream k "frees" right after submitting its work, and
  // stream k + 1 gets the same memory while stream k's work is still running.
  std::vector<int*> naive_cache(1);
  cudamem::check(cudaMalloc(&naive_cache[0], n * sizeof(int)), "cudaMalloc");
  for (int k = 0; k < streams; ++k) {
    int* buffer = naive_cache.back();  // "allocate": take it off the list
    naive_cache.pop_back();
    use({buffer, n}, k + 1, results[k], s[k]);
    naive_cache.push_back(buffer);  // "free": back on the list, the GPU still using it
  }
  for (auto& stream : s) {
    stream.synchronize();
  }
  const std::size_t raw = corrupted(results);
  cudamem::check(cudaFree(naive_cache[0]), "cudaFree");
  std::printf("naive cache:   %zu of %zu elements hold another stream's number\n", raw,
              streams * n);

  // cudamem: the pool holds one buffer; each device_buffer is freed on its stream.
  cudamem::device_resource device;
  cudamem::pool_resource pool{device, {.initial_size = n * sizeof(int),
                                       .maximum_size = n * sizeof(int)}};
  std::vector<const void*> addresses;
  for (int k = 0; k < streams; ++k) {
    cudamem::device_buffer<int> buffer(n, s[k], pool);  // waits for the previous free, on s[k]
    addresses.push_back(buffer.data());
    use(buffer, k + 1, results[k], s[k]);
  }  // ~device_buffer: freed in stream order on s[k]
  for (auto& stream : s) {
    stream.synchronize();
  }
  const std::size_t owned = corrupted(results);
  const bool same_memory = addresses == std::vector<const void*>(streams, addresses[0]);
  std::printf("pool_resource: %zu of %zu elements hold another stream's number (every stream "
              "got the same memory: %s)\n",
              owned, streams * n, same_memory ? "yes" : "no");

  std::printf("corrupted elements: raw %zu, cudamem %zu\n", raw, owned);
  return raw > 0 && owned == 0 && same_memory ? 0 : 1;
} catch (const cudamem::no_device_error& e) {
  std::printf("stream_ordered: no usable CUDA device here (%s), nothing to run\n", e.name());
  return 69;
} catch (const std::exception& e) {
  std::fprintf(stderr, "stream_ordered failed: %s\n", e.what());
  return 1;
}
