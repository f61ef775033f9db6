// bench_adaptors — what each adaptor costs on top of the pool it wraps, in ns per operation,
// on the standard traces (DESIGN.md): over a pool on a simulated device (CPU only: the pool's
// own logic, no CUDA), and over a pool on real device memory when there is a GPU.
//
//   bench_adaptors [--repeat N] [--cpu-only] [--threads-only] [--threads T]
//
// --threads-only runs the multi-thread section alone; --threads T runs it with T threads
// instead of the trace's 16 (each thread still replays its own 20,000-operation trace).
// For each trace and stack: the median ns/op of N timed replays (after one warm-up round, so
// the pool has reserved what the trace needs); the stacks take turns replay by replay, and the
// added ns/op and the ratio are medians of each round's difference and ratio to the bare pool
// (a slow spell of a shared machine then moves both sides of a comparison alike). Targets: statistics <= +10 ns/op, tracking <= 2x the pool's cost; the
// last column says "ok" or "MISSED" on those two rows.
// The stacks: pool; statistics, limiting, tracking, tracking with timestamps (the option that
// reads the CPU's tick counter per allocation), logging (to a stream that discards: the cost
// of formatting and locking, not of a disk), retry, nvtx (nvtx_adaptor with no tool attached:
// its ranges and counter are skipped, its count of bytes in use is kept) — each alone over
// the pool; and the chain
// tracking -> statistics -> limiting -> pool.
// Then the multi-thread trace (mt16: 16 threads, each its own trace, over one pool with a shard
// per hardware thread, CPU only): wall time per operation over all threads, for the pool alone,
// statistics and tracking (each counting in a slot or shard of its own thread; target
// <= 2x the pool), and the same two with peak_slack 0 (an exact peak: one atomic add on a
// shared line per request, what both did before). Run it where there are 16 cores
// (`bench_adaptors --cpu-only`): with fewer, threads queue for cores and the ratios say little.
#include <cudamem/device.hpp>
#include <cudamem/device_resource.hpp>
#include <cudamem/limiting_adaptor.hpp>
#include <cudamem/logging_adaptor.hpp>
#include <cudamem/nvtx_adaptor.hpp>
#include <cudamem/pool_resource.hpp>
#include <cudamem/retry_adaptor.hpp>
#include <cudamem/simulated_resource.hpp>
#include <cudamem/statistics_adaptor.hpp>
#include <cudamem/stream.hpp>
#include <cudamem/tracking_adaptor.hpp>

#include "traces.hpp"
#include "median.hpp"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <memory>
#include <optional>
#include <ostream>
#include <streambuf>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace {

using cudamem::memory_resource;

/// A stream buffer that throws everything away (so logging is timed without a disk).
class discard_buffer final : public std::streambuf {
 protected:
  std::streamsize xsputn(const char* /*s*/, std::streamsize n) override { return n; }
  int_type overflow(int_type c) override { return traits_type::not_eof(c); }
};

/// One replay of `t` through `mr`, in ns per operation.
double replay_ns(const cudamem_bench::trace& t, memory_resource& mr,
                 std::optional<cudamem::stream_view> stream, std::vector<void*>& slots) {
  const auto start = std::chrono::steady_clock::now();
  if (stream) {
    cudamem_bench::replay(
        t, slots, [&](std::size_t n) { return mr.allocate(n, 256, *stream); },
        [&](void* p, std::size_t n) { mr.deallocate(p, n, 256, *stream); });
  } else {
    cudamem_bench::replay(
        t, slots, [&](std::size_t n) { return mr.allocate(n); },
        [&](void* p, std::size_t n) { mr.deallocate(p, n); });
  }
  const auto end = std::chrono::steady_clock::now();
  return std::chrono::duration<double, std::nano>(end - start).count() /
         static_cast<double>(t.ops.size());
}

using cudamem_bench::median;

/// Times every stack over `pool` on the single-thread standard traces and prints the table.
/// The stacks are interleaved: each round replays the trace once through every stack, in
/// turn, so a slow spell of the machine (another tenant, a frequency change) hits all of them
/// alike; the added ns and the ratio are medians of the per-round differences and ratios to the
/// bare pool's replay in the same round, not differences of medians taken minutes apart.
void measure(const char* title, memory_resource& pool, std::optional<cudamem::stream_view> stream,
             int repeat) {
  discard_buffer discard;
  std::ostream nowhere{&discard};

  struct stack {
    const char* name;
    std::function<std::unique_ptr<memory_resource>()> make;  // null: the bare pool
  };
  std::vector<std::unique_ptr<memory_resource>> keep;  // inner parts of the chain
  const std::vector<stack> stacks = {
      {"pool", nullptr},
      {"statistics", [&] { return std::make_unique<cudamem::statistics_adaptor>(pool); }},
      {"limiting",
       [&] { return std::make_unique<cudamem::limiting_adaptor>(pool, std::size_t{1} << 50); }},
      {"tracking", [&] { return std::make_unique<cudamem::tracking_adaptor>(pool); }},
      {"tracking+time",
       [&] {
         return std::make_unique<cudamem::tracking_adaptor>(
             pool, cudamem::tracking_options{.timestamps = true});
       }},
      {"logging", [&] { return std::make_unique<cudamem::logging_adaptor>(pool, nowhere); }},
      {"retry",
       [&] {
         return std::make_unique<cudamem::retry_adaptor>(
             pool, [](const cudamem::out_of_memory&) { return false; });
       }},
      {"nvtx", [&] { return std::make_unique<cudamem::nvtx_adaptor>(pool, "bench"); }},
      {"chain t>s>l>pool",
       [&]() -> std::unique_ptr<memory_resource> {
         keep.push_back(std::make_unique<cudamem::limiting_adaptor>(pool, std::size_t{1} << 50));
         keep.push_back(std::make_unique<cudamem::statistics_adaptor>(*keep.back()));
         return std::make_unique<cudamem::tracking_adaptor>(*keep.back());
       }},
  };

  std::printf("\n%s — %d interleaved rounds: median ns/op; median over rounds of (stack - pool)"
              " and stack/pool\n",
              title, repeat);
  std::printf("%-22s %-18s %10s %10s %8s  %s\n", "trace", "stack", "ns/op", "+ns/op", "ratio",
              "target");
  std::vector<std::unique_ptr<memory_resource>> tops;
  for (const stack& s : stacks) {
    tops.push_back(s.make ? s.make() : nullptr);
  }
  for (const cudamem_bench::trace_spec& spec : cudamem_bench::standard_traces()) {
    if (spec.threads != 1 || spec.name == "random_1KiB-64MiB") {
      continue;  // single-thread traces within a 2 GiB cap: the adaptors' cost, not the device's
    }
    const cudamem_bench::trace t = cudamem_bench::make_trace(spec);
    std::vector<void*> slots(t.blocks);
    // ns[stack][round]; one untimed round first, so the pool has reserved what the trace needs
    // and every adaptor has grown its tables.
    std::vector<std::vector<double>> ns(stacks.size());
    for (int round = -1; round < repeat; ++round) {
      for (std::size_t k = 0; k < stacks.size(); ++k) {
        const double v = replay_ns(t, tops[k] ? *tops[k] : pool, stream, slots);
        if (round >= 0) {
          ns[k].push_back(v);
        }
      }
    }
    for (std::size_t k = 0; k < stacks.size(); ++k) {
      std::vector<double> added;
      std::vector<double> ratio;
      for (int r = 0; r < repeat; ++r) {
        added.push_back(ns[k][r] - ns[0][r]);
        ratio.push_back(ns[k][r] / ns[0][r]);
      }
      const double plus = median(added);
      const double times = median(ratio);
      const std::string name = stacks[k].name;
      const char* target = "";
      if (name == "statistics") {
        target = plus <= 10.0 ? "ok (<= +10 ns)" : "MISSED (> +10 ns)";
      } else if (name == "tracking") {
        target = times <= 2.0 ? "ok (<= 2x)" : "MISSED (> 2x)";
      }
      std::printf("%-22s %-18s %10.1f %+10.1f %7.2fx  %s\n", spec.name.c_str(), stacks[k].name,
                  median(ns[k]), plus, times, target);
    }
    std::fflush(stdout);
  }
  tops.clear();
  keep.clear();
}

/// Wall ns per operation of every thread of `spec` replaying its own trace through `mr` at once.
double threaded_replay_ns(const std::vector<cudamem_bench::trace>& traces, memory_resource& mr) {
  std::size_t ops = 0;
  for (const cudamem_bench::trace& t : traces) {
    ops += t.ops.size();
  }
  const auto run = [&](std::size_t i, const auto& start) {
    const cudamem_bench::trace& t = traces[i];
    std::vector<void*> slots(t.blocks);
    start();
    cudamem_bench::replay(
        t, slots, [&](std::size_t n) { return mr.allocate(n); },
        [&](void* p, std::size_t n) { mr.deallocate(p, n); });
  };
  return cudamem_bench::run_together(traces.size(), run) / static_cast<double>(ops);
}

/// The multi-thread trace through the pool and the adaptors that count on every thread.
void measure_threads(int repeat, unsigned threads) {
  cudamem::simulated_resource device{{.capacity = std::size_t{80} << 30,
                                      .layout = cudamem::simulated_layout::paged}};
  cudamem::pool_resource pool{device};  // a shard per hardware thread
  cudamem::statistics_adaptor statistics{pool};
  cudamem::tracking_adaptor tracking{pool};
  cudamem::statistics_adaptor statistics_exact{pool, {.peak_slack = 0}};
  cudamem::tracking_adaptor tracking_exact{pool, {.peak_slack = 0}};
  struct stack {
    const char* name;
    memory_resource* resource;
    bool target;  // the target applies: <= 2x the pool
  };
  const std::vector<stack> stacks = {{"pool", &pool, false},
                                     {"statistics", &statistics, true},
                                     {"tracking", &tracking, true},
                                     {"statistics, exact peak", &statistics_exact, false},
                                     {"tracking, exact peak", &tracking_exact, false}};
  for (cudamem_bench::trace_spec spec : cudamem_bench::standard_traces()) {
    if (spec.threads == 1) {
      continue;
    }
    if (threads != 0) {  // --threads: the same trace with fewer (or more) threads
      spec.threads = threads;
    }
    std::vector<cudamem_bench::trace> traces;
    for (unsigned t = 0; t < spec.threads; ++t) {
      traces.push_back(cudamem_bench::make_trace(spec, t));
    }
    const unsigned cores = std::thread::hardware_concurrency();
    std::printf("\n%s, %u threads at once over one pool (CPU; %u hardware threads here) — %d "
                "interleaved rounds: median wall ns/op over all threads' operations; ratio: "
                "median over rounds of stack/pool\n",
                spec.name.c_str(), spec.threads, cores, repeat);
    if (cores < spec.threads) {
      std::printf("NOTE: fewer hardware threads than the trace's %u threads: the threads take "
                  "turns on the cores, so these ratios are not the 16-core figure the target is for\n",
                  spec.threads);
    }
    std::printf("%-22s %-24s %10s %8s  %s\n", "trace", "stack", "wall ns/op", "ratio", "target");
    std::vector<std::vector<double>> ns(stacks.size());
    for (int round = -1; round < repeat; ++round) {
      for (std::size_t k = 0; k < stacks.size(); ++k) {
        const double v = threaded_replay_ns(traces, *stacks[k].resource);
        if (round >= 0) {
          ns[k].push_back(v);
        }
      }
    }
    for (std::size_t k = 0; k < stacks.size(); ++k) {
      std::vector<double> ratio;
      for (int r = 0; r < repeat; ++r) {
        ratio.push_back(ns[k][r] / ns[0][r]);
      }
      const double times = median(ratio);
      const char* target = !stacks[k].target ? ""
                           : times <= 2.0    ? "ok (<= 2x)"
                                             : "MISSED (> 2x)";
      std::printf("%-22s %-24s %10.1f %7.2fx  %s\n", spec.name.c_str(), stacks[k].name,
                  median(ns[k]), times, target);
    }
    std::printf("peak bounds after the runs: statistics %s, tracking %s (exact-peak stacks: 0)\n",
                cudamem::format_bytes(statistics.peak_error_bound()).c_str(),
                cudamem::format_bytes(tracking.peak_error_bound()).c_str());
    std::fflush(stdout);
  }
}

}  // namespace

int main(int argc, char** argv) {
  int repeat = 15;
  bool cpu_only = false;
  bool threads_only = false;  // the multi-thread section alone
  unsigned threads = 0;       // 0: the trace's own (16)
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--repeat" && i + 1 < argc) {
      repeat = std::max(1, std::atoi(argv[++i]));
    } else if (a == "--cpu-only") {
      cpu_only = true;
    } else if (a == "--threads-only") {
      threads_only = true;
    } else if (a == "--threads" && i + 1 < argc) {
      threads = static_cast<unsigned>(std::max(1, std::atoi(argv[++i])));
    } else {
      std::fprintf(stderr, "usage: bench_adaptors [--repeat N] [--cpu-only] [--threads-only] "
                           "[--threads T]\n");
      return 1;
    }
  }
  if (threads_only) {
    measure_threads(repeat, threads);
    return 0;
  }
  {
    cudamem::simulated_resource device{{.capacity = std::size_t{80} << 30,
                                        .layout = cudamem::simulated_layout::paged}};
    cudamem::pool_resource pool{device, {.shards = 1}};
    measure("pool over a simulated 80 GiB device (CPU; synchronous forms)", pool, std::nullopt,
            repeat);
  }
  measure_threads(repeat, threads);
  if (cpu_only) {
    return 0;
  }
  if (cudamem::device_count() == 0) {
    std::printf("\nGPU part SKIPPED: no CUDA device\n");
    return 0;
  }
  cudamem::device_resource device;
  cudamem::pool_resource pool{device, {.shards = 1}};
  cudamem::stream s;
  measure("pool over device memory (GPU; stream-ordered on one stream)", pool, s, repeat);
  s.synchronize();
  return 0;
}
