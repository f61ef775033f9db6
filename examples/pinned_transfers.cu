// pinned_transfers — copies between host and device run several times
// faster from page-locked (pinned) memory than from ordinary pageable memory, because the GPU
// can read pinned pages directly while pageable ones are first staged through a hidden pinned
// buffer by the driver, one chunk at a time on one thread. Pinning itself is slow, though:
// take pinned buffers from a pool.
//
//   ./run example pinned_transfers
//
// Part 1 copies 256 MiB each way, five times, and prints the bandwidth of three ways:
//   - a std::vector (pageable) through cudaMemcpyAsync: the driver's staging;
//   - the same std::vector through cudamem::copy, which stages large pageable copies itself
//     (copy_stager.hpp: pinned chunks kept for reuse, several threads copying into them while
//     the DMA engine moves the previous chunk): the same data, typically 2-4x the driver;
//   - a pinned_buffer: no staging at all, the fastest.
// Part 2 gets a 64 MiB pinned buffer four times: with cudaMallocHost + cudaFreeHost each time
// (the raw way), and as a pinned_buffer from a pool_resource over pinned memory, which pins
// once and then reuses.
#include <cudamem/cudamem.hpp>

#include <chrono>
#include <cstdio>
#include <vector>

namespace {

constexpr std::size_t MiB = std::size_t{1} << 20;
constexpr std::size_t copy_floats = 256 * MiB / sizeof(float);
constexpr int repeats = 5;

using clock_type = std::chrono::steady_clock;

double seconds_since(clock_type::time_point start) {
  return std::chrono::duration<double>(clock_type::now() - start).count();
}

// GB/s of `repeats` calls of `one_copy` (256 MiB each), timed on the host from submission to
// completion.
template <class Copy>
double bandwidth(Copy one_copy, cudamem::stream_view s) {
  one_copy();  // warm-up: first-touch costs are not bandwidth
  s.synchronize();
  const auto start = clock_type::now();
  for (int i = 0; i < repeats; ++i) {
    one_copy();
  }
  s.synchronize();
  return static_cast<double>(repeats * copy_floats * sizeof(float)) / seconds_since(start) / 1e9;
}

}  // namespace

int main() try {
  std::printf("device 0: %s\n", cudamem::get_device_properties(0).name.c_str());
  cudamem::stream s;  // first: it must outlive the pool below, which frees on it
  cudamem::pinned_resource pinned;
  cudamem::pool_resource pinned_pool{pinned};

  // --- part 1: bandwidth ---------------------------------------------------------------------
  std::vector<float> pageable(copy_floats, 1.0F);                            // every page touched
  cudamem::pinned_buffer<float> page_locked(copy_floats, 1.0F, s, pinned_pool);
  cudamem::device_buffer<float> device(copy_floats, s);

  const std::size_t bytes = copy_floats * sizeof(float);
  // The raw way: cudaMemcpyAsync from pageable memory, which the driver stages by itself.
  const auto driver_bandwidth = [&](void* to, const void* from, cudaMemcpyKind kind) {
    return bandwidth(
        [&] { cudamem::check(cudaMemcpyAsync(to, from, bytes, kind, s.get()), "cudaMemcpyAsync"); },
        s);
  };
  const double driver_h2d =
      driver_bandwidth(device.data(), pageable.data(), cudaMemcpyHostToDevice);
  const double driver_d2h =
      driver_bandwidth(pageable.data(), device.data(), cudaMemcpyDeviceToHost);
  // cudamem::copy: the same pageable vector, staged by cudamem through reused pinned chunks.
  const double staged_h2d = bandwidth([&] { cudamem::copy(device, pageable, s); }, s);
  const double staged_d2h = bandwidth([&] { cudamem::copy(pageable, device, s); }, s);
  // Pinned memory: the DMA engine reads and writes it directly.
  const double pinned_h2d = bandwidth([&] { cudamem::copy(device, page_locked, s); }, s);
  const double pinned_d2h = bandwidth([&] { cudamem::copy(page_locked, device, s); }, s);
  std::printf("256 MiB copies, GB/s:                     host->device   device->host\n");
  std::printf("  pageable std::vector, cudaMemcpyAsync  %12.1f   %12.1f\n", driver_h2d,
              driver_d2h);
  std::printf("  pageable std::vector, cudamem::copy    %12.1f   %12.1f\n", staged_h2d,
              staged_d2h);
  std::printf("  pinned_buffer                          %12.1f   %12.1f\n", pinned_h2d,
              pinned_d2h);

  // --- part 2: the price of pinning, paid per buffer or once ---------------------------------
  constexpr std::size_t staging_floats = 64 * MiB / sizeof(float);
  std::printf("a 64 MiB pinned staging buffer, four times (ms each):\n");
  std::printf("  cudaMallocHost+cudaFreeHost");
  for (int i = 0; i < 4; ++i) {
    const auto start = clock_type::now();
    void* p = nullptr;
    cudamem::check(cudaMallocHost(&p, staging_floats * sizeof(float)), "cudaMallocHost");
    cudamem::check(cudaFreeHost(p), "cudaFreeHost");
    std::printf(" %8.3f", 1e3 * seconds_since(start));
  }
  std::printf("\n  pinned_buffer from pool    ");
  for (int i = 0; i < 4; ++i) {
    const auto start = clock_type::now();
    { cudamem::pinned_buffer<float> staging(staging_floats, s, pinned_pool); }
    std::printf(" %8.3f", 1e3 * seconds_since(start));
  }
  std::printf("   (the first one pins, the rest reuse)\n");

  std::printf("cudamem::copy vs cudaMemcpyAsync from pageable memory: H2D %.1fx, D2H %.1fx\n",
              staged_h2d / driver_h2d, staged_d2h / driver_d2h);
  std::printf("pinned vs pageable: H2D %.1fx, D2H %.1fx faster\n", pinned_h2d / driver_h2d,
              pinned_d2h / driver_d2h);
  return pinned_h2d > driver_h2d && pinned_d2h > driver_d2h ? 0 : 1;
} catch (const cudamem::no_device_error& e) {
  std::printf("pinned_transfers: no usable CUDA device here (%s), nothing to run\n", e.name());
  return 69;
} catch (const std::exception& e) {
  std::fprintf(stderr, "pinned_transfers failed: %s\n", e.what());
  return 1;
}
