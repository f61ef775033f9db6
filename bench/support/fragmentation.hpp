// bench/support/fragmentation.hpp — two fragmentation experiments, written against two
// callables so the same code measures a pool, a peer, a simulated device or a real one:
//   alloc(bytes) -> void*   (nullptr when the allocator fails; it must not throw)
//   release(void*, bytes)
//
// swiss_cheese: fill with `small` blocks until the first failure, free every other one, then
//   allocate `large` blocks until failure. Result: bytes obtained / bytes freed. An allocator
//   that cannot put two freed neighbours' worth of memory back together scores 0; one whose
//   free memory is always usable scores ~1. "Bytes freed" counts what each freed block really
//   held: `footprint(bytes)` (identity by default; CUB's caching allocator rounds a request up
//   to its bin, 64 MiB to 128 MiB, and would otherwise score 2.0 by reusing its own rounding).
// mixed: seeds 001/004 in miniature — each step allocates one large, short-lived block
//   (log-uniform in [large_min, large_max]; only the last `large_window` stay alive) and a few
//   small, long-lived ones (log-uniform in [small_min, small_max]) that accumulate, like a
//   training loop whose activations come and go between parameters, caches and logs that stay.
//   It runs to the first failure. Result: live bytes at the failure / `start_free` (the
//   device's free memory before the allocator under test took anything). A first-fit
//   allocator puts the small blocks in the holes the large ones leave and soon has no hole
//   large enough; a pool that keeps small and large blocks apart lasts longer.
//   With `streams` > 1, step k's blocks are allocated and freed on stream k % streams: the
//   callables then take the stream's index as a last argument (alloc(bytes, s), release(p,
//   bytes, s)); callables that take none are called without it.
// mixed_variants(): the mixed trace and the variants bench_fragmentation and the tests run
//   it in (other size ranges, more long-lived small blocks, more large blocks alive at once,
//   several streams), each with a name.
// Both free everything they allocated before returning.
#pragma once

#include "traces.hpp"

#include <array>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <deque>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace cudamem_bench {

struct fragmentation_result {
  double ratio = 0;            ///< the experiment's figure (see above)
  std::size_t numerator = 0;   ///< bytes obtained (swiss cheese) / live at failure (mixed)
  std::size_t denominator = 0; ///< bytes freed (swiss cheese) / free memory at the start
  std::size_t ops = 0;         ///< allocations and frees made
  double ns_per_op = 0;
  // With profile_ops on (bench_fragmentation --detail): where the time went.
  std::size_t slow_ops = 0;    ///< operations that took more than slow_op_ns
  double slow_ns = 0;          ///< their time together
  double worst_ns = 0;         ///< the slowest operation
  /// The slowest operations, slowest first: (ns, index of the operation in the trace).
  std::vector<std::pair<double, std::size_t>> slowest;
  std::vector<std::size_t> phase_ops;  ///< swiss cheese: operations done when each phase ended
  /// mixed: time and count of each kind of operation (see mixed_op_kinds).
  std::array<double, 4> kind_ns{};
  std::array<std::size_t, 4> kind_ops{};
  std::vector<double> phase_ns;  ///< swiss cheese: fill, make holes, large blocks, clean up
  std::size_t small_blocks = 0;  ///< swiss cheese: blocks of the fill
  std::size_t large_blocks = 0;  ///< swiss cheese: large blocks obtained from the holes
};

/// Time every operation (two clock reads each: ~40 ns, so off for the headline figures).
inline bool profile_ops = false;
inline constexpr double slow_op_ns = 20'000;
inline constexpr std::size_t slowest_kept = 6;

/// The kinds of operation the mixed trace counts apart (fragmentation_result::kind_ns).
inline constexpr std::array<const char*, 4> mixed_op_kinds{"large alloc", "small alloc",
                                                           "large free", "final frees"};

/// Runs `op` and, with profile_ops on, adds its time to r's slow-op figures (and to kind
/// `kind`'s time, when given).
template <class Op>
auto timed_op(fragmentation_result& r, Op&& op, int kind = -1) {
  if (!profile_ops) {
    return op();
  }
  const auto start = std::chrono::steady_clock::now();
  struct on_exit {
    fragmentation_result& r;
    std::chrono::steady_clock::time_point start;
    int kind;
    ~on_exit() {
      const double ns =
          std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - start).count();
      if (kind >= 0) {
        r.kind_ns[static_cast<std::size_t>(kind)] += ns;
        ++r.kind_ops[static_cast<std::size_t>(kind)];
      }
      r.worst_ns = ns > r.worst_ns ? ns : r.worst_ns;
      if (ns > slow_op_ns) {
        ++r.slow_ops;
        r.slow_ns += ns;
      }
      if (r.slowest.size() < slowest_kept || ns > r.slowest.back().first) {
        if (r.slowest.size() == slowest_kept) {
          r.slowest.pop_back();
        }
        auto at = r.slowest.begin();
        while (at != r.slowest.end() && at->first >= ns) {
          ++at;
        }
        r.slowest.insert(at, {ns, r.ops});  // r.ops: this operation's index (counted after)
      }
    }
  } guard{r, start, kind};
  return op();
}

inline std::size_t same_size(std::size_t bytes) noexcept { return bytes; }

template <class Alloc, class Free, class Footprint = std::size_t (*)(std::size_t) noexcept>
fragmentation_result swiss_cheese(Alloc&& alloc, Free&& release, std::size_t small,
                                  std::size_t large, Footprint footprint = &same_size,
                                  std::size_t max_blocks = 1 << 20) {
  using clock = std::chrono::steady_clock;
  const auto start = clock::now();
  fragmentation_result r;
  auto phase_start = start;
  const auto end_phase = [&] {
    const auto now = clock::now();
    r.phase_ns.push_back(std::chrono::duration<double, std::nano>(now - phase_start).count());
    r.phase_ops.push_back(r.ops);
    phase_start = now;
  };
  std::vector<void*> smalls;
  while (smalls.size() < max_blocks) {
    void* p = timed_op(r, [&] { return alloc(small); });
    ++r.ops;
    if (p == nullptr) {
      break;
    }
    smalls.push_back(p);
  }
  end_phase();
  for (std::size_t i = 1; i < smalls.size(); i += 2) {
    timed_op(r, [&] { release(smalls[i], small); });
    smalls[i] = nullptr;
    r.denominator += footprint(small);
    ++r.ops;
  }
  end_phase();
  r.small_blocks = smalls.size();
  std::vector<void*> larges;
  while (larges.size() < max_blocks) {
    void* p = timed_op(r, [&] { return alloc(large); });
    ++r.ops;
    if (p == nullptr) {
      break;
    }
    larges.push_back(p);
    r.numerator += large;
  }
  r.large_blocks = larges.size();
  end_phase();
  for (void* p : larges) {
    timed_op(r, [&] { release(p, large); });
    ++r.ops;
  }
  for (void* p : smalls) {
    if (p != nullptr) {
      timed_op(r, [&] { release(p, small); });
      ++r.ops;
    }
  }
  end_phase();
  const auto ns = std::chrono::duration<double, std::nano>(clock::now() - start).count();
  r.ns_per_op = r.ops ? ns / static_cast<double>(r.ops) : 0;
  r.ratio = r.denominator ? static_cast<double>(r.numerator) / static_cast<double>(r.denominator) : 0;
  return r;
}

struct mixed_spec {
  std::size_t start_free = 0;  ///< free memory when the experiment starts (the denominator)
  std::size_t large_min = 0;
  std::size_t large_max = 0;
  std::size_t small_min = 0;
  std::size_t small_max = 0;
  std::size_t smalls_per_step = 3;
  std::size_t large_window = 4;
  double large_growth = 0.0;   ///< large sizes grow by this fraction per step (batches grow)
  std::uint64_t seed = 42;
  std::size_t max_steps = 1 << 20;
  std::size_t streams = 1;     ///< step k's blocks live on stream k % streams (see above)
};

/// The mixed trace scaled to a device of `free_bytes`: large blocks 1/640..1/80 of it (128 MiB
/// to 1 GiB on 80 GiB), three small ones of 64 KiB..1 MiB per step. Filling 80 GiB takes
/// ~600,000 operations: right for simulated devices, too long for the slow peers on a GPU.
inline mixed_spec mixed_spec_for(std::size_t free_bytes) {
  mixed_spec s;
  s.start_free = free_bytes;
  s.large_min = free_bytes / 640;
  s.large_max = free_bytes / 80;
  s.small_min = 64 * KiB;
  s.small_max = MiB;
  return s;
}

/// The GPU bench's variant: the same large blocks, four long-lived ones of 256 KiB..4 MiB per
/// step, so ~145,000 operations fill 80 GiB and cudaMalloc (~100 µs a call) finishes in ~15 s.
/// Its long-lived blocks of 1..4 MiB are "medium" for pool_resource's default chunking (they
/// share chunks with large blocks), which is part of what it measures.
inline mixed_spec mixed_spec_gpu_for(std::size_t free_bytes) {
  mixed_spec s = mixed_spec_for(free_bytes);
  s.small_min = 256 * KiB;
  s.small_max = 4 * MiB;
  s.smalls_per_step = 4;
  return s;
}

/// One named variant of the mixed trace, scaled to a device of `free` bytes.
struct mixed_variant {
  std::string name;
  std::string what;
  mixed_spec (*make)(std::size_t free);
};

/// The variants bench_fragmentation runs cold and warm (and the tests check): the GPU trace,
/// and four departures from it, one thing changed each.
inline const std::vector<mixed_variant>& mixed_variants() {
  static const std::vector<mixed_variant> variants = {
      {"bench", "large 1/640..1/80 of the device, 4 small 256 KiB..4 MiB per step",
       [](std::size_t free) { return mixed_spec_gpu_for(free); }},
      {"wide", "large 8 MiB..1/80 of the device (medium blocks too)",
       [](std::size_t free) {
         mixed_spec s = mixed_spec_gpu_for(free);
         s.large_min = 8 * MiB;
         return s;
       }},
      {"many-small", "12 long-lived small blocks per step",
       [](std::size_t free) {
         mixed_spec s = mixed_spec_gpu_for(free);
         s.smalls_per_step = 12;
         return s;
       }},
      {"tiny", "16 long-lived small blocks of 4..256 KiB per step",
       [](std::size_t free) {
         mixed_spec s = mixed_spec_gpu_for(free);
         s.small_min = 4 * KiB;
         s.small_max = 256 * KiB;
         s.smalls_per_step = 16;
         return s;
       }},
      {"window16", "16 large blocks alive, 1/2560..1/160 of the device",
       [](std::size_t free) {
         mixed_spec s = mixed_spec_gpu_for(free);
         s.large_min = free / 2560;
         s.large_max = free / 160;
         s.large_window = 16;
         return s;
       }},
      {"streams4", "the bench trace on 4 streams, step k on stream k % 4",
       [](std::size_t free) {
         mixed_spec s = mixed_spec_gpu_for(free);
         s.streams = 4;
         return s;
       }},
  };
  return variants;
}

/// Calls f(args..., stream) when f takes the stream's index, else f(args...).
template <class F, class... Args>
decltype(auto) call_on_stream(F& f, std::size_t stream, Args&&... args) {
  if constexpr (std::is_invocable_v<F&, Args..., std::size_t>) {
    return f(std::forward<Args>(args)..., stream);
  } else {
    return f(std::forward<Args>(args)...);
  }
}

template <class Alloc, class Free>
fragmentation_result mixed(const mixed_spec& spec, Alloc&& alloc, Free&& release) {
  using clock = std::chrono::steady_clock;
  const auto start = clock::now();
  fragmentation_result r;
  r.denominator = spec.start_free;
  random rng(spec.seed);
  struct block {
    void* p;
    std::size_t bytes;
    std::size_t stream;
  };
  std::deque<block> larges;
  std::vector<block> smalls;
  const std::size_t streams = spec.streams == 0 ? 1 : spec.streams;
  const auto allocate = [&](std::size_t n, std::size_t s, int kind) {
    return timed_op(r, [&] { return call_on_stream(alloc, s, n); }, kind);
  };
  const auto free_block = [&](const block& b) { call_on_stream(release, b.stream, b.p, b.bytes); };
  std::size_t live = 0;
  bool failed = false;
  for (std::size_t step = 0; step < spec.max_steps && !failed; ++step) {
    const std::size_t s = step % streams;
    const double scale = std::pow(1.0 + spec.large_growth, static_cast<double>(step));
    const auto big = static_cast<std::size_t>(
        static_cast<double>(rng.log_uniform(spec.large_min, spec.large_max)) * scale);
    void* p = allocate(big, s, 0);
    ++r.ops;
    if (p == nullptr) {
      failed = true;
      break;
    }
    larges.push_back({p, big, s});
    live += big;
    for (std::size_t k = 0; k < spec.smalls_per_step; ++k) {
      const std::size_t n = rng.log_uniform(spec.small_min, spec.small_max);
      void* q = allocate(n, s, 1);
      ++r.ops;
      if (q == nullptr) {
        failed = true;
        break;
      }
      smalls.push_back({q, n, s});
      live += n;
    }
    while (!failed && larges.size() > spec.large_window) {
      timed_op(r, [&] { free_block(larges.front()); }, 2);
      live -= larges.front().bytes;
      larges.pop_front();
      ++r.ops;
    }
  }
  r.numerator = live;
  for (const block& b : larges) {
    timed_op(r, [&] { free_block(b); }, 3);
    ++r.ops;
  }
  for (const block& b : smalls) {
    timed_op(r, [&] { free_block(b); }, 3);
    ++r.ops;
  }
  const auto ns = std::chrono::duration<double, std::nano>(clock::now() - start).count();
  r.ns_per_op = r.ops ? ns / static_cast<double>(r.ops) : 0;
  r.ratio = r.denominator ? static_cast<double>(r.numerator) / static_cast<double>(r.denominator) : 0;
  return r;
}

}  // namespace cudamem_bench
