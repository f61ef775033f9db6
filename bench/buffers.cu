// bench/buffers.cu — what the typed owners cost over the raw calls they wrap.
//
//   ./run bench buffers            (or build-*/bench/bench_buffers [rounds])
//
// Peers are measured interleaved, round by round, and compared within each round: a round
// runs the raw call and its wrapped form back to back (in alternating order, so neither is
// always first), and the ratios reported are medians of the per-round ratios. A slow spell of
// the machine, or one slow transfer, then moves both sides of a ratio alike instead of one
// (a single raw copy at 29.9 GB/s once made a median-of-separate-runs ratio read 0.775).
// (1) Construct + destroy a device_buffer<float> of 1 MiB from a resource, against calling
//     the same resource's allocate/deallocate directly, for async_resource (a warm pool,
//     threshold UINT64_MAX: the path where overhead would show) and device_resource
//     (cudaMalloc/cudaFree). Per round: 20,000 ops of each (2,000 for cudaMalloc). Median
//     ns per construct+destroy and the median per-round ratio; the target is <= 1.10.
// (2) 256 MiB host<->device copies: cudamem::copy between a pinned_buffer and a
//     device_buffer, raw cudaMemcpyAsync between the same pointers, and cudamem::copy with a
//     pageable std::vector. Per round one copy of each, each way, timed with events. Median
//     GB/s and the median per-round ratio to raw; the target for pinned is >= 0.95 of raw.
// `rounds` defaults to 15 (at least 5), after one untimed warm-up round.
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
  const std::size_t n = v.size();
  return n % 2 == 1 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

/// ns per call of `body` run `ops` times.
double ns_per_op(int ops, const std::function<void()>& body) {
  const auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < ops; ++i) {
    body();
  }
  const auto stop = std::chrono::steady_clock::now();
  return std::chrono::duration<double, std::nano>(stop - start).count() / ops;
}

/// Per-round samples of a peer and the raw call it is compared with.
struct paired_samples {
  std::vector<double> raw;
  std::vector<double> peer;

  /// Median of peer / raw, round by round.
  [[nodiscard]] double ratio() const {
    std::vector<double> r;
    for (std::size_t i = 0; i < raw.size(); ++i) {
      r.push_back(peer[i] / raw[i]);
    }
    return median(r);
  }
};

void owner_overhead(cudamem::memory_resource& mr, cudamem::stream_view s, int rounds, int ops) {
  constexpr std::size_t n = (1 << 20) / sizeof(float);
  const auto raw = [&] {
    void* p = mr.allocate(n * sizeof(float), cudamem::device_buffer<float>::alignment, s);
    mr.deallocate(p, n * sizeof(float), cudamem::device_buffer<float>::alignment, s);
  };
  const auto owned = [&] { cudamem::device_buffer<float> b(n, s, mr); };
  paired_samples ns;
  for (int round = -1; round < rounds; ++round) {  // round -1: warm-up, not kept
    double r = 0;
    double o = 0;
    if (round % 2 == 0) {
      r = ns_per_op(ops, raw);
      o = ns_per_op(ops, owned);
    } else {
      o = ns_per_op(ops, owned);
      r = ns_per_op(ops, raw);
    }
    if (round >= 0) {
      ns.raw.push_back(r);
      ns.peer.push_back(o);
    }
  }
  const double ratio = ns.ratio();
  std::printf("%-18s %14.1f %18.1f %8.3f  %s\n", std::string(mr.name()).c_str(), median(ns.raw),
              median(ns.peer), ratio, ratio <= 1.10 ? "ok (<= 1.10)" : "OVER 1.10");
}

/// GB/s of one `copy_once` moving `bytes`, timed with events on `s`.
double gb_per_s(std::size_t bytes, cudamem::stream_view s, const std::function<void()>& copy_once) {
  cudamem::event start;
  cudamem::event stop;
  start.record(s);
  copy_once();
  stop.record(s);
  stop.synchronize();
  return static_cast<double>(bytes) / (cudamem::elapsed_ms(start, stop) * 1e6);
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
  const int rounds = std::max(5, argc > 1 ? std::atoi(argv[1]) : 15);  // interleaved rounds
  const cudamem::device_properties props = cudamem::get_device_properties(0);
  std::printf("bench_buffers on %s, %d interleaved rounds (after a warm-up round)\n\n",
              props.name.c_str(), rounds);

  cudamem::stream s{{.non_blocking = true}};

  std::printf("(1) device_buffer<float>(1 MiB) construct+destroy vs the resource's own calls: "
              "median ns/op; ratio: median over rounds of device_buffer / raw\n");
  std::printf("%-18s %14s %18s %8s\n", "resource", "raw ns/op", "device_buffer ns/op", "ratio");
  {
    cudamem::async_resource pool{{.release_threshold = std::numeric_limits<std::uint64_t>::max()}};
    owner_overhead(pool, s, rounds, 20000);
    cudamem::device_resource plain;
    owner_overhead(plain, s, rounds, 2000);
  }

  constexpr std::size_t n = (std::size_t{256} << 20) / sizeof(float);
  constexpr std::size_t bytes = n * sizeof(float);
  cudamem::pinned_buffer<float> pinned(n, 1.0f, s);
  cudamem::device_buffer<float> device(n, 2.0f, s);
  std::vector<float> pageable(n, 3.0f);

  // Each round: every copy once, each way; the raw copy first in even rounds, last in odd.
  struct copy_kind {
    const char* name;
    std::function<void()> h2d;
    std::function<void()> d2h;
  };
  const std::vector<copy_kind> kinds = {
      {"raw cudaMemcpyAsync, pinned",
       [&] {
         cudamem::check(cudaMemcpyAsync(device.data(), pinned.data(), bytes,
                                        cudaMemcpyHostToDevice, s.get()));
       },
       [&] {
         cudamem::check(cudaMemcpyAsync(pinned.data(), device.data(), bytes,
                                        cudaMemcpyDeviceToHost, s.get()));
       }},
      {"cudamem::copy pinned_buffer <-> device_buffer", [&] { cudamem::copy(device, pinned, s); },
       [&] { cudamem::copy(pinned, device, s); }},
      {"cudamem::copy std::vector <-> device_buffer", [&] { cudamem::copy(device, pageable, s); },
       [&] { cudamem::copy(pageable, device, s); }},
  };
  std::vector<std::vector<double>> h2d(kinds.size());
  std::vector<std::vector<double>> d2h(kinds.size());
  for (int round = -1; round < rounds; ++round) {  // round -1: warm-up, not kept
    for (std::size_t j = 0; j < kinds.size(); ++j) {
      const std::size_t k = round % 2 == 0 ? j : kinds.size() - 1 - j;
      const double up = gb_per_s(bytes, s, kinds[k].h2d);
      const double down = gb_per_s(bytes, s, kinds[k].d2h);
      if (round >= 0) {
        h2d[k].push_back(up);
        d2h[k].push_back(down);
      }
    }
  }

  std::printf("\n(2) 256 MiB copies, %d interleaved rounds: median GB/s; ratio: median over rounds "
              "of GB/s / the same round's raw cudaMemcpyAsync (same pinned memory)\n",
              rounds);
  std::printf("%-44s %10s %7s %10s %7s\n", "", "H2D GB/s", "ratio", "D2H GB/s", "ratio");
  std::vector<double> up_ratio(kinds.size());
  std::vector<double> down_ratio(kinds.size());
  for (std::size_t k = 0; k < kinds.size(); ++k) {
    up_ratio[k] = paired_samples{h2d[0], h2d[k]}.ratio();
    down_ratio[k] = paired_samples{d2h[0], d2h[k]}.ratio();
    std::printf("%-44s %10.2f %7.3f %10.2f %7.3f\n", kinds[k].name, median(h2d[k]), up_ratio[k],
                median(d2h[k]), down_ratio[k]);
  }
  const bool ok = up_ratio[1] >= 0.95 && down_ratio[1] >= 0.95;
  std::printf("\npinned copy vs raw: %s (target >= 0.95 each way, median of per-round ratios)\n",
              ok ? "ok" : "BELOW TARGET");
  return 0;
}
