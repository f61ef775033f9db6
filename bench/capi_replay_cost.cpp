// What a recorded program's allocations cost on the host, through the C API (the stack
// cudamem.torch.install() uses), on a simulated device: no GPU needed. The log is replayed
// several times; the first pass grows the device, the others are timed. Between two calls the
// bench can touch a buffer of the given size, which evicts the allocator's structures from the
// caches as the framework's own work between two calls does inside a training step: a loop of
// allocations alone runs with everything in L1 and shows a different cost.
//
//   bench_capi_replay_cost LOG [--config "simulate_bytes=16GiB"] [--touch-kib 4096] [--passes 5]
//
//   LOG          a cudamem log (logging_adaptor's format; bench/python/trace.py writes one
//                from a PyTorch run; gunzip a .gz first). bench/traces/train_b26.log.gz is
//                one: 60 steps of bench/python/train.py at batch 26, recorded on an H200
//   --config     the C API configuration (cudamem_c.h); must contain simulate_bytes (default
//                "simulate_bytes=16GiB": the C API's defaults otherwise, 4 MiB handles)
//   --touch-kib  bytes touched between calls, in KiB (default 0)
//   --passes     passes over the log, the first untimed (default 5)
//
// Prints, per timed pass, ns per call for allocations and frees of a handle (4 MiB) or more
// and below, the compactions the pass made and the allocations served by recent frees
// (cudamem_stats::recent_reuses); then the medians over the timed passes, how many calls of
// each kind a pass makes, and the device memory held (the peak, and at the end). Only the
// calls are timed, not the touching. All calls are on the legacy stream, as the log's stream
// is (trace.py records one stream). The simulated layer keeps its own bookkeeping of frees in
// flight (the driver's layer does not: it records lazily), so compare builds with each other
// on this bench, not with a GPU. Exit status: 0, 1 for bad arguments or a log it cannot read,
// 2 when an allocation fails.
//
// Instructions per call, repeatable where wall times are not (a loaded host): each kind of
// timed call goes through a function of its own (never inlined nor merged), so callgrind's
// inclusive cost of each over its calls is that kind's instructions per call:
//   valgrind --tool=callgrind --callgrind-out-file=cg.out bench_capi_replay_cost LOG
//   callgrind_annotate --inclusive=yes cg.out | grep timed_
// The bench calls the library through its shared object, so one build of the bench measures
// two builds of libcudamem_c (LD_LIBRARY_PATH picks one).
#include <cudamem/log_format.hpp>

#include <cudamem_c.h>

#include "median.hpp"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <fstream>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

namespace {

using clock_type = std::chrono::steady_clock;
constexpr std::size_t large = std::size_t{4} << 20;  // the C API's handle size

/// ns per call in each of the four kinds, for one pass.
struct pass_cost {
  double ns[4] = {0, 0, 0, 0};  // large alloc, small alloc, large free, small free
  long calls[4] = {0, 0, 0, 0};
  std::uint64_t compactions = 0;
  std::uint64_t recent_reuses = 0;
  [[nodiscard]] double per_call(int k) const { return calls[k] ? ns[k] / calls[k] : 0.0; }
};

using cudamem_bench::median;

// The timed calls, one function per kind (see the top: instructions per call). noipa, not
// only noinline: identical bodies would otherwise be folded into one function.
[[gnu::noipa]] cudamem_status timed_large_alloc(int id, std::size_t bytes, void** p) {
  return cudamem_allocate(id, bytes, 0, nullptr, p);
}
[[gnu::noipa]] cudamem_status timed_small_alloc(int id, std::size_t bytes, void** p) {
  return cudamem_allocate(id, bytes, 0, nullptr, p);
}
[[gnu::noipa]] void timed_large_free(int id, void* p, std::size_t bytes) {
  cudamem_deallocate(id, p, bytes, 0, nullptr);
}
[[gnu::noipa]] void timed_small_free(int id, void* p, std::size_t bytes) {
  cudamem_deallocate(id, p, bytes, 0, nullptr);
}

int usage(const char* why) {
  std::fprintf(stderr,
               "bench_capi_replay_cost: %s\n"
               "usage: bench_capi_replay_cost LOG [--config TEXT] [--touch-kib N] [--passes N]\n",
               why);
  return 1;
}

cudamem_stats stats(int id) {
  cudamem_stats s{};
  s.struct_size = sizeof s;
  if (cudamem_get_stats(id, 0, &s) != CUDAMEM_OK) {
    s = cudamem_stats{};
  }
  return s;
}

}  // namespace

int main(int argc, char** argv) try {
  std::string log_path;
  std::string config = "simulate_bytes=16GiB";
  std::size_t touch_kib = 0;
  int passes = 5;
  for (int i = 1; i < argc; ++i) {
    const std::string_view a = argv[i];
    const bool has_value = i + 1 < argc;
    if (a == "--config" && has_value) {
      config = argv[++i];
    } else if (a == "--touch-kib" && has_value) {
      touch_kib = std::strtoull(argv[++i], nullptr, 10);
    } else if (a == "--passes" && has_value) {
      passes = std::atoi(argv[++i]);
    } else if (!a.starts_with("--") && log_path.empty()) {
      log_path = a;
    } else {
      return usage(("unknown or incomplete argument " + std::string(a)).c_str());
    }
  }
  if (log_path.empty() || passes < 2) {
    return usage(log_path.empty() ? "no log given" : "--passes must be at least 2");
  }
  if (config.find("simulate_bytes") == std::string::npos) {
    return usage("--config must contain simulate_bytes (this bench never uses a GPU)");
  }
  std::ifstream in{log_path};
  if (!in) {
    return usage(("cannot open " + log_path).c_str());
  }
  const std::vector<cudamem::log_event> events = cudamem::read_log(in);
  int id = 0;
  if (cudamem_allocator_create(config.c_str(), &id) != CUDAMEM_OK) {
    return usage(cudamem_last_error());
  }

  std::vector<unsigned char> touched(touch_kib * 1024 + 64, 1);
  volatile unsigned sink = 0;  // the touching is kept, not optimised away
  const auto touch = [&] {
    for (std::size_t i = 0; i < touched.size(); i += 64) {
      sink = sink + ++touched[i];
    }
  };
  std::vector<pass_cost> costs;
  for (int pass = 0; pass < passes; ++pass) {
    pass_cost cost;
    const cudamem_stats before = stats(id);
    std::unordered_map<std::uint64_t, std::pair<void*, std::size_t>> live;  // log ptr -> ours
    for (const cudamem::log_event& e : events) {
      if (e.kind == cudamem::log_event_kind::out_of_memory) {
        continue;
      }
      const bool is_large = e.bytes >= large;
      void* p = nullptr;
      if (e.kind == cudamem::log_event_kind::free) {
        const auto it = live.find(e.pointer);
        if (it == live.end()) {
          continue;  // allocated before the log began
        }
        p = it->second.first;
        const std::size_t bytes = it->second.second;
        live.erase(it);
        touch();
        const int k = is_large ? 2 : 3;
        const auto start = clock_type::now();
        if (pass == 0) {
          cudamem_deallocate(id, p, bytes, 0, nullptr);  // untimed: not counted as a kind
        } else if (is_large) {
          timed_large_free(id, p, bytes);
        } else {
          timed_small_free(id, p, bytes);
        }
        cost.ns[k] += std::chrono::duration<double, std::nano>(clock_type::now() - start).count();
        ++cost.calls[k];
        continue;
      }
      touch();
      const int k = is_large ? 0 : 1;
      const auto start = clock_type::now();
      const cudamem_status s = pass == 0 ? cudamem_allocate(id, e.bytes, 0, nullptr, &p)
                               : is_large ? timed_large_alloc(id, e.bytes, &p)
                                          : timed_small_alloc(id, e.bytes, &p);
      cost.ns[k] += std::chrono::duration<double, std::nano>(clock_type::now() - start).count();
      ++cost.calls[k];
      if (s != CUDAMEM_OK) {
        std::fprintf(stderr, "bench_capi_replay_cost: allocation of %zu bytes failed: %s\n",
                     e.bytes, cudamem_last_error());
        return 2;
      }
      live[e.pointer] = {p, e.bytes};
    }
    for (const auto& [pointer, block] : live) {  // what the log left live: freed, untimed
      cudamem_deallocate(id, block.first, block.second, 0, nullptr);
    }
    const cudamem_stats after = stats(id);
    cost.compactions = after.compactions - before.compactions;
    cost.recent_reuses = after.recent_reuses - before.recent_reuses;
    if (pass > 0) {
      costs.push_back(cost);
      std::printf("pass %d: ns per call: 4 MiB+ alloc %.0f, below alloc %.0f, 4 MiB+ free %.0f, "
                  "below free %.0f; %llu compactions, %llu reused recent frees\n",
                  pass, cost.per_call(0), cost.per_call(1), cost.per_call(2), cost.per_call(3),
                  static_cast<unsigned long long>(cost.compactions),
                  static_cast<unsigned long long>(cost.recent_reuses));
    }
  }
  double m[4];
  for (int k = 0; k < 4; ++k) {
    std::vector<double> v;
    for (const pass_cost& c : costs) {
      v.push_back(c.per_call(k));
    }
    m[k] = median(v);
  }
  std::printf("median of %zu passes (%s, %zu KiB touched between calls): 4 MiB+ alloc %.0f ns, "
              "below alloc %.0f, 4 MiB+ free %.0f, below free %.0f\n",
              costs.size(), config.c_str(), touch_kib, m[0], m[1], m[2], m[3]);
  const pass_cost& last = costs.back();
  std::printf("calls per timed pass: 4 MiB+ alloc %ld, below alloc %ld, 4 MiB+ free %ld, "
              "below free %ld\n",
              last.calls[0], last.calls[1], last.calls[2], last.calls[3]);
  const cudamem_stats end = stats(id);
  std::printf("device: peak reserved %.0f MiB, reserved at the end %.0f MiB\n",
              static_cast<double>(end.peak_reserved_bytes) / (1 << 20),
              static_cast<double>(end.reserved_bytes) / (1 << 20));
  cudamem_allocator_destroy(id);
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "bench_capi_replay_cost: %s\n", e.what());
  return 1;
}
