// bench/buffers.cu — what the typed owners cost over the raw calls they wrap.
//
//   ./run bench buffers            (or build-*/bench/bench_buffers [reps])
//
// (1) Construct + destroy a device_buffer<float> of 1 MiB from a resource, against calling
//     the same resource's allocate/deallocate directly, for async_resource (a warm pool,
//     threshold UINT64_MAX: the path where overhead would show) and device_resource
//     (cudaMalloc/cudaFree). ns per construct+destroy, median of `reps` runs of 20,000 ops
//     (2,000 for cudaMalloc), and the ratio; the target is <= 1.10.
// (2) 256 MiB host<->device copies: cudamem::copy between a pinned_buffer and a
//     device_buffer, raw cudaMemcpyAsync between the same pointers, and cudamem::copy with a
//     pageable std::vector. GB/s each way, median of `reps` (>= 5), ratio to raw; the target
//     for pinned is >= 0.95 of raw.
// With no GPU it prints one line and exits 69.
#include <cudamem/async_resource.hpp>
#include <cudamem/copy.hpp>
#include <cudamem/device_buffer.hpp>
#include <cudamem/device_resource.hpp>
#include <cudamem/event.hpp>
#include <cudamem/pinned_buffer.hpp>
#include <cudamem/stream.hpp>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <limits>
#include <string>
#include <vector>

namespace {

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

/// Median over `reps` of the ns per call of `body` run `ops` times.
double ns_per_op(int reps, int ops, const std::function<void()>& body) {
  std::vector<double> samples;
  for (int r = 0; r < reps; ++r) {
    const auto start = std::chrono::steady_clock::now();
    for (int i = 0; i < ops; ++i) {
      body();
    }
    const auto stop = std::chrono::steady_clock::now();
    samples.push_back(std::chrono::duration<double, std::nano>(stop - start).count() / ops);
  }
  return median(samples);
}

/// Median GB/s over `reps` of `copy_once` moving `bytes`, timed with events on `s`.
double gb_per_s(int reps, std::size_t bytes, cudamem::stream_view s,
                const std::function<void()>& copy_once) {
  cudamem::event start;
  cudamem::event stop;
  copy_once();  // warm-up
  s.synchronize();
  std::vector<double> samples;
  for (int r = 0; r < reps; ++r) {
    start.record(s);
    copy_once();
    stop.record(s);
    stop.synchronize();
    samples.push_back(static_cast<double>(bytes) / (cudamem::elapsed_ms(start, stop) * 1e6));
  }
  return median(samples);
}

void owner_overhead(cudamem::memory_resource& mr, cudamem::stream_view s, int reps, int ops) {
  constexpr std::size_t n = (1 << 20) / sizeof(float);
  const double raw = ns_per_op(reps, ops, [&] {
    void* p = mr.allocate(n * sizeof(float), cudamem::device_buffer<float>::alignment, s);
    mr.deallocate(p, n * sizeof(float), cudamem::device_buffer<float>::alignment, s);
  });
  const double owned = ns_per_op(reps, ops, [&] { cudamem::device_buffer<float> b(n, s, mr); });
  std::printf("%-18s %14.1f %18.1f %8.3f  %s\n", std::string(mr.name()).c_str(), raw, owned,
              owned / raw, owned / raw <= 1.10 ? "ok (<= 1.10)" : "OVER 1.10");
}

}  // namespace

int main(int argc, char** argv) {
  int devices = 0;
  const cudaError_t code = cudaGetDeviceCount(&devices);
  if (code != cudaSuccess || devices == 0) {
    std::printf("SKIPPED: no CUDA device (%s): bench_buffers needs a GPU\n",
                code != cudaSuccess ? cudaGetErrorName(code) : "0 devices");
    return 69;
  }
  const int reps = std::max(5, argc > 1 ? std::atoi(argv[1]) : 7);
  const cudamem::device_properties props = cudamem::get_device_properties(0);
  std::printf("bench_buffers on %s, median of %d reps\n\n", props.name.c_str(), reps);

  cudamem::stream s{{.non_blocking = true}};

  std::printf("(1) device_buffer<float>(1 MiB) construct+destroy vs the resource's own calls\n");
  std::printf("%-18s %14s %18s %8s\n", "resource", "raw ns/op", "device_buffer ns/op", "ratio");
  {
    cudamem::async_resource pool{{.release_threshold = std::numeric_limits<std::uint64_t>::max()}};
    owner_overhead(pool, s, reps, 20000);
    cudamem::device_resource plain;
    owner_overhead(plain, s, reps, 2000);
  }

  constexpr std::size_t n = (std::size_t{256} << 20) / sizeof(float);
  constexpr std::size_t bytes = n * sizeof(float);
  cudamem::pinned_buffer<float> pinned(n, 1.0f, s);
  cudamem::device_buffer<float> device(n, 2.0f, s);
  std::vector<float> pageable(n, 3.0f);

  const double raw_h2d = gb_per_s(reps, bytes, s, [&] {
    cudamem::check(cudaMemcpyAsync(device.data(), pinned.data(), bytes, cudaMemcpyHostToDevice, s.get()));
  });
  const double raw_d2h = gb_per_s(reps, bytes, s, [&] {
    cudamem::check(cudaMemcpyAsync(pinned.data(), device.data(), bytes, cudaMemcpyDeviceToHost, s.get()));
  });
  const double pinned_h2d = gb_per_s(reps, bytes, s, [&] { cudamem::copy(device, pinned, s); });
  const double pinned_d2h = gb_per_s(reps, bytes, s, [&] { cudamem::copy(pinned, device, s); });
  const double pageable_h2d = gb_per_s(reps, bytes, s, [&] { cudamem::copy(device, pageable, s); });
  const double pageable_d2h = gb_per_s(reps, bytes, s, [&] { cudamem::copy(pageable, device, s); });

  std::printf("\n(2) 256 MiB copies, GB/s (ratio to raw cudaMemcpyAsync from/to the same pinned memory)\n");
  std::printf("%-44s %10s %7s %10s %7s\n", "", "H2D GB/s", "ratio", "D2H GB/s", "ratio");
  auto row = [&](const char* what, double h2d, double d2h) {
    std::printf("%-44s %10.2f %7.3f %10.2f %7.3f\n", what, h2d, h2d / raw_h2d, d2h, d2h / raw_d2h);
  };
  row("raw cudaMemcpyAsync, pinned", raw_h2d, raw_d2h);
  row("cudamem::copy pinned_buffer <-> device_buffer", pinned_h2d, pinned_d2h);
  row("cudamem::copy std::vector <-> device_buffer", pageable_h2d, pageable_d2h);
  const bool ok = pinned_h2d >= 0.95 * raw_h2d && pinned_d2h >= 0.95 * raw_d2h;
  std::printf("\npinned copy vs raw: %s (target >= 0.95 each way)\n", ok ? "ok" : "BELOW TARGET");
  return 0;
}
