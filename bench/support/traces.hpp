// bench/support/traces.hpp — the standard allocation traces of DESIGN.md, generated ahead of
// time (so a benchmark times the allocator, not the random numbers), a replayer, and a way to
// start the threads of a multi-thread trace at once.
//
//   for (const auto& spec : cudamem_bench::standard_traces()) {
//     const cudamem_bench::trace t = cudamem_bench::make_trace(spec);
//     std::vector<void*> slots(t.blocks);
//     cudamem_bench::replay(t, slots, [&](std::size_t n) { return mr.allocate(n); },
//                           [&](void* p, std::size_t n) { mr.deallocate(p, n); });
//   }
//
// A trace: `ops` operations; sizes log-uniform in [min_bytes, max_bytes]; allocate with
// probability 0.55 while the live bytes are under `cap`, else free a uniformly chosen live
// block; then every block still live is freed (those frees are part of the trace and count as
// operations). `pairs` traces allocate and free one block in turn. The random numbers come
// from splitmix64 with a fixed seed, so every machine and every compiler replays the same
// trace.
#pragma once

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace cudamem_bench {

/// splitmix64: tiny, fast, and the same everywhere (unlike std::uniform_*_distribution).
class random {
 public:
  explicit random(std::uint64_t seed) noexcept : state_(seed) {}
  std::uint64_t next() noexcept {
    std::uint64_t z = (state_ += 0x9E3779B97F4A7C15ULL);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
  }
  /// Uniform in [0, 1).
  double unit() noexcept { return static_cast<double>(next() >> 11) * 0x1.0p-53; }
  /// Uniform in [0, n).
  std::size_t below(std::size_t n) noexcept { return static_cast<std::size_t>(unit() * static_cast<double>(n)); }
  /// Log-uniform in [lo, hi].
  std::size_t log_uniform(std::size_t lo, std::size_t hi) noexcept {
    if (lo >= hi) {
      return lo;
    }
    const double l = std::log(static_cast<double>(lo));
    const double h = std::log(static_cast<double>(hi));
    const auto v = static_cast<std::size_t>(std::exp(l + unit() * (h - l)));
    return v < lo ? lo : (v > hi ? hi : v);
  }

 private:
  std::uint64_t state_;
};

struct trace_spec {
  std::string name;
  std::size_t ops = 0;        ///< operations before the final frees
  std::size_t min_bytes = 0;
  std::size_t max_bytes = 0;
  std::size_t cap = 0;        ///< live-byte cap (0: none)
  std::uint64_t seed = 1;
  bool pairs = false;         ///< allocate and free one block in turn
  unsigned threads = 1;       ///< >1: every thread replays its own trace (seed + thread index)
};

/// One operation: allocate block `id` of `bytes`, or free block `id`.
struct trace_op {
  std::uint32_t id;
  bool allocate;
  std::size_t bytes;
};

struct trace {
  std::string name;
  std::vector<trace_op> ops;
  std::size_t blocks = 0;          ///< number of distinct block ids
  std::size_t peak_live_bytes = 0;
};

inline constexpr std::size_t KiB = std::size_t{1} << 10;
inline constexpr std::size_t MiB = std::size_t{1} << 20;
inline constexpr std::size_t GiB = std::size_t{1} << 30;

/// The standard traces of DESIGN.md.
inline std::vector<trace_spec> standard_traces() {
  return {
      {"pair_1MiB", 40000, MiB, MiB, 0, 1, true, 1},
      {"random_256B-4MiB", 100000, 256, 4 * MiB, 2 * GiB, 2, false, 1},
      {"random_1KiB-64MiB", 20000, KiB, 64 * MiB, 16 * GiB, 3, false, 1},
      {"mt16_random_256B-1MiB", 20000, 256, MiB, 256 * MiB, 4, false, 16},
  };
}

/// The trace `spec` describes (for thread `thread` of a multi-thread spec).
inline trace make_trace(const trace_spec& spec, unsigned thread = 0) {
  trace t;
  t.name = spec.name;
  random rng(spec.seed * 1000003ULL + thread);
  std::vector<std::pair<std::uint32_t, std::size_t>> live;  // (id, bytes)
  std::size_t live_bytes = 0;
  std::uint32_t next_id = 0;
  t.ops.reserve(spec.ops + spec.ops / 2);
  if (spec.pairs) {
    for (std::size_t i = 0; i + 1 < spec.ops + 1; i += 2) {
      const std::size_t bytes = rng.log_uniform(spec.min_bytes, spec.max_bytes);
      t.ops.push_back({next_id, true, bytes});
      t.ops.push_back({next_id, false, bytes});
      ++next_id;
    }
    t.blocks = next_id;
    t.peak_live_bytes = spec.max_bytes;
    return t;
  }
  for (std::size_t i = 0; i < spec.ops; ++i) {
    const bool under_cap = spec.cap == 0 || live_bytes < spec.cap;
    if (live.empty() || (under_cap && rng.unit() < 0.55)) {
      const std::size_t bytes = rng.log_uniform(spec.min_bytes, spec.max_bytes);
      t.ops.push_back({next_id, true, bytes});
      live.emplace_back(next_id++, bytes);
      live_bytes += bytes;
      t.peak_live_bytes = live_bytes > t.peak_live_bytes ? live_bytes : t.peak_live_bytes;
    } else {
      const std::size_t k = rng.below(live.size());
      t.ops.push_back({live[k].first, false, live[k].second});
      live_bytes -= live[k].second;
      live[k] = live.back();
      live.pop_back();
    }
  }
  for (const auto& [id, bytes] : live) {
    t.ops.push_back({id, false, bytes});
  }
  t.blocks = next_id;
  return t;
}

/// Replays `t`: alloc(bytes) -> void*, release(void*, bytes). `slots` has t.blocks entries.
template <class Alloc, class Free>
void replay(const trace& t, std::vector<void*>& slots, Alloc&& alloc, Free&& release) {
  for (const trace_op& op : t.ops) {
    if (op.allocate) {
      slots[op.id] = alloc(op.bytes);
    } else {
      release(slots[op.id], op.bytes);
    }
  }
}

/// Runs `body(i, start)` on `threads` threads at once: each does its own set-up, then calls
/// `start()`, which waits until every thread is ready. Returns the wall time in ns from the
/// moment they are all released to the end of the last one.
template <class Body>
double run_together(std::size_t threads, Body&& body) {
  std::atomic<std::size_t> ready{0};
  std::atomic<bool> go{false};
  const auto start = [&] {
    ready.fetch_add(1);
    while (!go.load(std::memory_order_acquire)) {
      std::this_thread::yield();
    }
  };
  std::vector<std::thread> workers;
  for (std::size_t i = 0; i < threads; ++i) {
    workers.emplace_back([&, i] { body(i, start); });
  }
  while (ready.load() != threads) {
    std::this_thread::yield();
  }
  const auto begin = std::chrono::steady_clock::now();
  go.store(true, std::memory_order_release);
  for (std::thread& worker : workers) {
    worker.join();
  }
  return std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - begin)
      .count();
}

}  // namespace cudamem_bench
