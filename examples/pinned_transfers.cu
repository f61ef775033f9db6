// pinned_transfers — seed 002, example 2: copies between host and device run several times
// faster from page-locked (pinned) memory than from ordinary pageable memory, because the GPU
// can read pinned pages directly while pageable ones are first staged through a hidden pinned
// buffer by the driver. Pinning itself is slow, though: take pinned buffers from a pool.
//
//   ./run example pinned_transfers
//
// Part 1 copies 256 MiB each way, five times, from a std::vector (pageable) and from a
// pinned_buffer, and prints the bandwidth of each. Part 2 gets a 64 MiB pinned buffer four
// times: with cudaMallocHost + cudaFreeHost each time (the raw way), and as a pinned_buffer
// from a pool_resource over pinned memory, which pins once and then reuses.
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

// GB/s of `repeats` copies between `host` and `device` in one direction, timed on the host
// from submission to completion.
template <class Host>
double bandwidth(Host& host, cudamem::device_buffer<float>& device, bool to_device,
                 cudamem::stream_view s) {
  auto one_copy = [&] {
    if (to_device) {
      cudamem::copy(device, host, s);
    } else {
      cudamem::copy(host, device, s);
    }
  };
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

  const double pageable_h2d = bandwidth(pageable, device, true, s);
  const double pageable_d2h = bandwidth(pageable, device, false, s);
  const double pinned_h2d = bandwidth(page_locked, device, true, s);
  const double pinned_d2h = bandwidth(page_locked, device, false, s);
  std::printf("256 MiB copies, GB/s:   host->device   device->host\n");
  std::printf("  pageable std::vector  %12.1f   %12.1f\n", pageable_h2d, pageable_d2h);
  std::printf("  pinned_buffer         %12.1f   %12.1f\n", pinned_h2d, pinned_d2h);

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

  std::printf("pinned vs pageable: H2D %.1fx, D2H %.1fx faster\n", pinned_h2d / pageable_h2d,
              pinned_d2h / pageable_d2h);
  return pinned_h2d > pageable_h2d && pinned_d2h > pageable_d2h ? 0 : 1;
} catch (const cudamem::no_device_error& e) {
  std::printf("pinned_transfers: no usable CUDA device here (%s), nothing to run\n", e.name());
  return 69;
} catch (const std::exception& e) {
  std::fprintf(stderr, "pinned_transfers failed: %s\n", e.what());
  return 1;
}
