// bench/buffers.cu — what the typed owners cost over the raw calls they wrap, and how fast
// copies between ordinary (pageable) host memory and the device go through copy_stager.
//
//   ./run bench buffers [rounds] [--copies-only]
//   (or build-*/bench/bench_buffers [rounds] [--copies-only]; --copies-only skips (1))
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
//     pageable std::vector (staged, copy_stager.hpp). Per round one copy of each, each way,
//     timed with events. Median GB/s and the median per-round ratio to raw; the target for
//     pinned is >= 0.95 of raw.
// (3) Pageable copies by size, 4 KiB to 1 GiB (x4 steps), each way; per size and round, in
//     alternating order: raw cudaMemcpyAsync from/to pageable memory (the driver's staging),
//     cudamem::copy (direct up to direct_copy_max_bytes(), staged above), the default stager
//     forced at every size (copy_to_device / copy_to_host: where staging starts to win, which
//     is how the threshold is chosen), raw cudaMemcpyAsync from/to pinned memory (the ceiling),
//     and cudaHostRegister + cudaMemcpyAsync + cudaHostUnregister of pageable memory of its own.
//     Wall time from the call to cudaStreamSynchronize returning, repeated so that one sample
//     moves at least 64 MiB (4 KiB: 16,384 copies). Median GB/s; ratios are medians of
//     per-round ratios to the same round's raw pageable copy, and of staged / pinned.
//     Then what registration alone costs: cudaHostRegister and cudaHostUnregister of 64 MiB,
//     256 MiB and 1 GiB, ms and ms per GiB (medians).
// (4) The stager's knobs at 256 MiB: threads (1, 2, 4, 6, 8) x chunk_bytes (1, 2, 4, 8,
//     16 MiB), chunk_count 4, each way; every configuration (a stager of its own) once per
//     round with raw pageable as the baseline. Median GB/s and ratio to raw.
// The targets are printed after (3): 64 MiB and more >= 2x raw pageable each way
// (cudamem::copy column), 4 KiB - 1 MiB never below 0.95x.
// `rounds` defaults to 15 (at least 5), after one untimed warm-up round; 1 GiB copies use
// at most 7 rounds (about a minute in all).
// With no GPU it prints one line and exits 69.
#include <cudamem/async_resource.hpp>
#include <cudamem/copy.hpp>
#include <cudamem/copy_stager.hpp>
#include <cudamem/device_buffer.hpp>
#include <cudamem/device_resource.hpp>
#include <cudamem/event.hpp>
#include <cudamem/pinned_buffer.hpp>
#include <cudamem/stream.hpp>

#include "median.hpp"

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <functional>
#include <limits>
#include <string>
#include <string_view>
#include <vector>

namespace {

using cudamem_bench::median;

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


// --- (3) and (4): pageable copies -------------------------------------------------------------

constexpr std::size_t kib = 1024;
constexpr std::size_t mib = 1024 * kib;

/// Ordinary host memory, page-aligned (cudaHostRegister pins whole pages) and touched, so that
/// no copy pays for first-touch page faults.
class pageable_memory {
 public:
  explicit pageable_memory(std::size_t bytes)
      : bytes_((bytes + 4095) / 4096 * 4096),
        data_(static_cast<unsigned char*>(std::aligned_alloc(4096, bytes_)), &std::free) {
    if (data_ == nullptr) {
      throw std::bad_alloc();
    }
    std::memset(data_.get(), 1, bytes_);
  }
  [[nodiscard]] unsigned char* data() const noexcept { return data_.get(); }

 private:
  std::size_t bytes_;
  std::unique_ptr<unsigned char, decltype(&std::free)> data_;
};

/// GB/s of `reps` runs of `op`, each followed by a stream synchronisation, by the wall clock.
double wall_gb_per_s(std::size_t bytes, int reps, cudamem::stream_view s,
                     const std::function<void()>& op) {
  s.synchronize();
  const auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < reps; ++i) {
    op();
    s.synchronize();
  }
  const auto stop = std::chrono::steady_clock::now();
  const double seconds = std::chrono::duration<double>(stop - start).count();
  return static_cast<double>(bytes) * reps / (seconds * 1e9);
}

struct named_op {
  std::string name;
  std::function<void()> op;
};

/// Per-kind GB/s samples over `rounds` interleaved rounds (kind order reversed every other
/// round), after one warm-up round.
std::vector<std::vector<double>> interleaved(const std::vector<named_op>& kinds, std::size_t bytes,
                                             int reps, int rounds, cudamem::stream_view s) {
  std::vector<std::vector<double>> samples(kinds.size());
  for (int round = -1; round < rounds; ++round) {
    for (std::size_t j = 0; j < kinds.size(); ++j) {
      const std::size_t k = round % 2 == 0 ? j : kinds.size() - 1 - j;
      const double rate = wall_gb_per_s(bytes, reps, s, kinds[k].op);
      if (round >= 0) {
        samples[k].push_back(rate);
      }
    }
  }
  return samples;
}

std::string size_name(std::size_t bytes) {
  if (bytes >= 1024 * mib) {
    return std::to_string(bytes / (1024 * mib)) + " GiB";
  }
  return bytes >= mib ? std::to_string(bytes / mib) + " MiB" : std::to_string(bytes / kib) + " KiB";
}

/// (3): every size, both ways; returns false if a target (printed after it) is missed.
bool pageable_by_size(cudamem::stream_view s, int rounds) {
  constexpr std::size_t largest = 1024 * mib;
  pageable_memory host(largest);
  // The register peer pins and unpins memory of its own: a user's vector is not pinned and
  // unpinned between copies, so no other peer copies into memory that was. (When they shared
  // one buffer, the stager's 256 MiB device -> host copy ran at 29.6 GB/s in this table and
  // 40.6 in (2) on the same H100; with separate buffers, on another H100, 26.1 and 25.8:
  // not shown to be the cause, but one variable fewer.)
  pageable_memory registered_host(largest);
  cudamem::pinned_buffer<unsigned char> pinned(largest, static_cast<unsigned char>(2));
  cudamem::device_buffer<unsigned char> device(largest, static_cast<unsigned char>(3), s);
  cudamem::copy_stager& stager = cudamem::default_copy_stager();
  const cudamem::copy_stager_options o = stager.options();
  std::printf("\n(3) pageable <-> device by size: wall GB/s (call to cudaStreamSynchronize), "
              "medians of interleaved rounds; ratios: medians of per-round ratios\n"
              "    direct_copy_max_bytes %zu; default stager: chunk_bytes %zu, chunk_count %u, "
              "threads %u\n",
              cudamem::direct_copy_max_bytes(), o.chunk_bytes, o.chunk_count, o.threads);
  bool ok = true;
  for (const bool up : {true, false}) {
    std::printf("\n%s\n%-8s %9s %9s %8s %9s %8s %9s %8s %9s %8s\n",
                up ? "host -> device (H2D)" : "device -> host (D2H)", "size", "raw", "copy",
                "copy/raw", "stager", "stg/raw", "pinned", "copy/pin", "register", "reg/raw");
    for (std::size_t bytes = 4 * kib; bytes <= largest; bytes *= 4) {
      unsigned char* d = device.data();
      unsigned char* h = host.data();
      unsigned char* p = pinned.data();
      unsigned char* r = registered_host.data();
      const cudaMemcpyKind kind = up ? cudaMemcpyHostToDevice : cudaMemcpyDeviceToHost;
      // One plain copy between device memory and host memory `mem`, the way `up` says.
      const auto raw = [=](void* dev, void* mem) {
        return up ? cudaMemcpyAsync(dev, mem, bytes, kind, s.get())
                  : cudaMemcpyAsync(mem, dev, bytes, kind, s.get());
      };
      const std::vector<named_op> kinds = {
          {"raw", [=] { cudamem::check(raw(d, h), "raw pageable copy"); }},
          {"copy",
           [=, &s] {
             const cudamem::device_span<unsigned char> dev{d, bytes};
             const gsl::span<unsigned char> mem{h, bytes};
             if (up) {
               cudamem::copy(dev, mem, s);
             } else {
               cudamem::copy(mem, dev, s);
             }
           }},
          {"stager",
           [=, &stager] {
             if (up) {
               stager.copy_to_device(d, h, bytes, s);
             } else {
               stager.copy_to_host(h, d, bytes, s);
             }
           }},
          {"pinned", [=] { cudamem::check(raw(d, p), "raw pinned copy"); }},
          {"register",
           [=] {
             cudamem::check(cudaHostRegister(r, bytes, cudaHostRegisterDefault),
                            "cudaHostRegister");
             cudamem::check(raw(d, r), "copy of registered memory");
             cudamem::check(cudaStreamSynchronize(s.get()), "cudaStreamSynchronize");
             cudamem::check(cudaHostUnregister(r), "cudaHostUnregister");
           }},
      };
      const int reps = static_cast<int>(std::clamp<std::size_t>(16 * mib / bytes, 1, 1024));
      const int size_rounds = bytes >= largest ? std::min(rounds, 7) : rounds;
      const auto samples = interleaved(kinds, bytes, reps, size_rounds, s);
      const auto ratio = [&](std::size_t k, std::size_t base) {
        return paired_samples{samples[base], samples[k]}.ratio();
      };
      const double copy_vs_raw = ratio(1, 0);
      std::printf("%-8s %9.2f %9.2f %8.3f %9.2f %8.3f %9.2f %8.3f %9.2f %8.3f\n",
                  size_name(bytes).c_str(), median(samples[0]), median(samples[1]), copy_vs_raw,
                  median(samples[2]), ratio(2, 0), median(samples[3]), ratio(1, 3),
                  median(samples[4]), ratio(4, 0));
      if ((bytes >= 64 * mib && copy_vs_raw < 2.0) || (bytes <= mib && copy_vs_raw < 0.95)) {
        std::printf("         ^ BELOW TARGET (%s)\n",
                    bytes >= 64 * mib ? ">= 2x raw" : ">= 0.95x raw");
        ok = false;
      }
    }
  }

  std::printf("\n    what pinning the user's memory costs: cudaHostRegister / cudaHostUnregister, "
              "median of %d\n%-8s %12s %12s %14s\n", rounds, "size", "register ms", "unregister ms",
              "both ms/GiB");
  for (const std::size_t bytes : {64 * mib, 256 * mib, largest}) {
    std::vector<double> reg;
    std::vector<double> unreg;
    for (int round = 0; round < std::min(rounds, 9); ++round) {
      const auto t0 = std::chrono::steady_clock::now();
      cudamem::check(cudaHostRegister(registered_host.data(), bytes, cudaHostRegisterDefault),
                     "cudaHostRegister");
      const auto t1 = std::chrono::steady_clock::now();
      cudamem::check(cudaHostUnregister(registered_host.data()), "cudaHostUnregister");
      const auto t2 = std::chrono::steady_clock::now();
      reg.push_back(std::chrono::duration<double, std::milli>(t1 - t0).count());
      unreg.push_back(std::chrono::duration<double, std::milli>(t2 - t1).count());
    }
    const double gib = static_cast<double>(bytes) / static_cast<double>(1024 * mib);
    std::printf("%-8s %12.2f %12.2f %14.1f\n", size_name(bytes).c_str(), median(reg), median(unreg),
                (median(reg) + median(unreg)) / gib);
  }
  return ok;
}

/// (4): threads x chunk_bytes at 256 MiB, each way, beside raw pageable.
void stager_sweep(cudamem::stream_view s, int rounds) {
  constexpr std::size_t bytes = 256 * mib;
  pageable_memory host(bytes);
  cudamem::device_buffer<unsigned char> device(bytes, static_cast<unsigned char>(3), s);
  const unsigned thread_counts[] = {1, 2, 4, 6, 8};
  const std::size_t chunk_sizes[] = {1 * mib, 2 * mib, 4 * mib, 8 * mib, 16 * mib};
  std::vector<std::unique_ptr<cudamem::copy_stager>> stagers;
  std::vector<std::string> names;
  for (const unsigned t : thread_counts) {
    for (const std::size_t c : chunk_sizes) {
      stagers.push_back(std::make_unique<cudamem::copy_stager>(
          -1, cudamem::copy_stager_options{.chunk_bytes = c, .chunk_count = 4, .threads = t}));
      names.push_back(std::to_string(t) + " threads, " + size_name(c));
    }
  }
  std::printf("\n(4) copy_stager at 256 MiB by threads x chunk_bytes (chunk_count 4): median GB/s; "
              "ratio: median per-round ratio to raw pageable\n%-24s %9s %8s %9s %8s\n", "",
              "H2D GB/s", "ratio", "D2H GB/s", "ratio");
  unsigned char* d = device.data();
  unsigned char* h = host.data();
  std::vector<std::vector<double>> results[2];
  for (const bool up : {true, false}) {
    std::vector<named_op> kinds = {
        {"raw pageable", [=] {
           cudamem::check(up ? cudaMemcpyAsync(d, h, bytes, cudaMemcpyHostToDevice, s.get())
                             : cudaMemcpyAsync(h, d, bytes, cudaMemcpyDeviceToHost, s.get()));
         }}};
    for (std::size_t i = 0; i < stagers.size(); ++i) {
      cudamem::copy_stager* stager = stagers[i].get();
      kinds.push_back({names[i], [=] {
                         if (up) {
                           stager->copy_to_device(d, h, bytes, s);
                         } else {
                           stager->copy_to_host(h, d, bytes, s);
                         }
                       }});
    }
    results[up ? 0 : 1] = interleaved(kinds, bytes, 1, rounds, s);
  }
  for (std::size_t k = 0; k <= stagers.size(); ++k) {
    const auto& up = results[0];
    const auto& down = results[1];
    std::printf("%-24s %9.2f %8.3f %9.2f %8.3f\n", k == 0 ? "raw pageable" : names[k - 1].c_str(),
                median(up[k]), paired_samples{up[0], up[k]}.ratio(), median(down[k]),
                paired_samples{down[0], down[k]}.ratio());
  }
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
  int rounds = 15;  // interleaved rounds
  bool copies_only = false;
  for (int i = 1; i < argc; ++i) {
    if (std::string_view(argv[i]) == "--copies-only") {
      copies_only = true;
    } else {
      rounds = std::atoi(argv[i]);
    }
  }
  rounds = std::max(5, rounds);
  const cudamem::device_properties props = cudamem::get_device_properties(0);
  std::printf("bench_buffers on %s, %d interleaved rounds (after a warm-up round)\n\n",
              props.name.c_str(), rounds);

  cudamem::stream s{{.non_blocking = true}};

  if (!copies_only) {
    std::printf("(1) device_buffer<float>(1 MiB) construct+destroy vs the resource's own calls: "
                "median ns/op; ratio: median over rounds of device_buffer / raw\n");
    std::printf("%-18s %14s %18s %8s\n", "resource", "raw ns/op", "device_buffer ns/op", "ratio");
    {
      cudamem::async_resource pool{
          {.release_threshold = std::numeric_limits<std::uint64_t>::max()}};
      owner_overhead(pool, s, rounds, 20000);
      cudamem::device_resource plain;
      owner_overhead(plain, s, rounds, 2000);
    }
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
  std::printf("staged std::vector copy as a fraction of raw pinned: %.3f H2D, %.3f D2H\n",
              up_ratio[2], down_ratio[2]);

  const bool targets = pageable_by_size(s, rounds);
  std::printf("\ntargets (cudamem::copy vs raw pageable: >= 2x from 64 MiB, >= 0.95x "
              "for 4 KiB - 1 MiB): %s\n", targets ? "ok" : "BELOW TARGET (marked above)");
  stager_sweep(s, rounds);
  return 0;
}
