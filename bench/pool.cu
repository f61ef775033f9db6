// bench/pool.cu — pool_resource, vm_pool_resource and arena_resource against their peers on
// the standard traces of DESIGN.md, all in one run on one device: ns per operation (median of
// the reps) and the ratio of each peer to the pool.
//
//   ./run bench pool                   # on a GPU machine
//   ./run bench pool --simulated       # no GPU: the pool, vm_pool and arena over a simulated
//                                      # device, i.e. the host-side cost of their bookkeeping
//   options: --reps N (default 7), --trace NAME (only that trace), --only-pool (no peers),
//            --only NAME (one of pool, vm_pool, arena: that row alone, for callgrind),
//            --pool-cache-follows-use 0|1 (the pool row's pool_options::cache_follows_use),
//            --csv FILE (the results also as CSV, with the device, date and command line:
//            what bench/plots/make_figures.py draws; its data file is bench/plots/data/
//            pool_ns_per_op.csv)
//   bench/nvtx_cost.sh BUILD_DIR      # the pool with and without its NVTX annotations
//                                      # (bench_pool_nvtx_off: -DCUDAMEM_NVTX=0), interleaved
//
// Peers: cudaMalloc/cudaFree; cudaMallocAsync/cudaFreeAsync on the device's default memory
// pool with release threshold UINT64_MAX; cub::CachingDeviceAllocator(8, 3, 22, 64 GiB);
// thrust::mr::disjoint_unsynchronized_pool_resource (default options, over
// thrust::device_memory_resource; single-thread traces only, it is not thread-safe). The
// stream-aware ones (pool, cudaMallocAsync, CUB) run on one non-default stream (mt16: one per
// thread). Each allocator replays each trace once untimed (so every cache is warm: the steady
// state), then `reps` timed runs; every block is freed at the end of each run, and each
// allocator is destroyed (its cache emptied) before the next one starts.
// vm_pool is vm_pool_resource with its default options (growth ahead on over a real device,
// as a user gets it; off over the simulated one, which has no driver time to hide); its
// blocks below 64 MiB come from its pool, the rest straight from its vm_resource.
// The arena is measured where it fits: every allocation of the trace from one arena (frees are
// no-ops), rewound after each run; a row is "-" when the trace's bytes exceed a quarter of the
// device. With no GPU and no --simulated it prints one line and exits 69.
#include <cudamem/arena_resource.hpp>
#include <cudamem/detail/vm/simulated_mapping.hpp>
#include <cudamem/device_resource.hpp>
#include <cudamem/pool_resource.hpp>
#include <cudamem/simulated_resource.hpp>
#include <cudamem/stream.hpp>
#include <cudamem/vm_pool_resource.hpp>

#include "csv_results.hpp"
#include "peers.hpp"
#include "traces.hpp"

#include <cub/util_allocator.cuh>
#include <thrust/device_ptr.h>
#include <thrust/mr/device_memory_resource.h>
#include <thrust/mr/disjoint_pool.h>
#include <thrust/mr/new.h>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

using namespace cudamem_bench;

namespace {

using clock_type = std::chrono::steady_clock;

/// Median ns/op of `reps` timed runs of `run_once` (after one untimed run). `run_once` returns
/// the number of operations it made and its own elapsed ns.
template <class Run>
double median_ns_per_op(int reps, Run&& run_once) {
  run_once();  // warm-up: caches filled, pages touched
  std::vector<double> samples;
  for (int i = 0; i < reps; ++i) {
    const auto [ops, ns] = run_once();
    samples.push_back(ns / static_cast<double>(ops));
  }
  return median(samples);
}

/// Replays the traces of `spec` (one per thread) through alloc/release; returns {ops, wall ns}.
template <class MakeWorker>
std::pair<std::size_t, double> timed_replay(const std::vector<trace>& traces, MakeWorker&& make_worker) {
  const std::size_t threads = traces.size();
  std::size_t ops = 0;
  for (const trace& t : traces) {
    ops += t.ops.size();
  }
  if (threads == 1) {
    auto worker = make_worker(0);
    std::vector<void*> slots(traces[0].blocks);
    const auto start = clock_type::now();
    replay(traces[0], slots, [&](std::size_t n) { return worker.allocate(n); },
           [&](void* p, std::size_t n) { worker.deallocate(p, n); });
    worker.finish();
    return {ops, std::chrono::duration<double, std::nano>(clock_type::now() - start).count()};
  }
  const double ns = run_together(threads, [&](std::size_t i, const auto& start) {
    auto worker = make_worker(i);
    std::vector<void*> slots(traces[i].blocks);
    start();
    replay(traces[i], slots, [&](std::size_t n) { return worker.allocate(n); },
           [&](void* p, std::size_t n) { worker.deallocate(p, n); });
    worker.finish();
  });
  return {ops, ns};
}

// --- the allocators, each as a per-thread "worker" with allocate/deallocate/finish --------------
// (the peers' workers are in support/peers.hpp, shared with bench_workload)

using thrust_pool = thrust::mr::disjoint_unsynchronized_pool_resource<thrust::device_memory_resource,
                                                                      thrust::mr::new_delete_resource>;
struct thrust_worker {
  thrust_pool* pool;
  void* allocate(std::size_t n) { return pool->do_allocate(n, 256).get(); }
  void deallocate(void* p, std::size_t n) {
    pool->do_deallocate(thrust::device_ptr<void>(p), n, 256);
  }
  void finish() {}
};

struct options {
  bool simulated = false;
  int reps = 7;
  std::string only;
  bool only_pool = false;  ///< --only-pool: no peers (the NVTX on/off comparison)
  std::string only_row;    ///< --only NAME: that row alone (pool, vm_pool or arena)
  /// --pool-cache-follows-use 0|1: the pool row's pool_options::cache_follows_use (the A/B of
  /// that default; unset: the default).
  int pool_cache_follows_use = -1;
  std::string csv_path;  ///< --csv FILE: the results as CSV too
};

options parse(int argc, char** argv) {
  options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--simulated") {
      o.simulated = true;
    } else if (a == "--reps" && i + 1 < argc) {
      o.reps = std::max(1, std::atoi(argv[++i]));
    } else if (a == "--trace" && i + 1 < argc) {
      o.only = argv[++i];
    } else if (a == "--only-pool") {
      o.only_pool = true;
    } else if (a == "--only" && i + 1 < argc) {
      o.only_row = argv[++i];
      o.only_pool = true;
    } else if (a == "--pool-cache-follows-use" && i + 1 < argc &&
               (std::strcmp(argv[i + 1], "0") == 0 || std::strcmp(argv[i + 1], "1") == 0)) {
      o.pool_cache_follows_use = std::atoi(argv[++i]);
    } else if (a == "--csv" && i + 1 < argc) {
      o.csv_path = argv[++i];
    } else {
      std::fprintf(stderr, "usage: bench_pool [--simulated] [--reps N] [--trace NAME] "
                           "[--only-pool] [--only pool|vm_pool|arena] "
                           "[--pool-cache-follows-use 0|1] [--csv FILE]\n");
      std::exit(2);
    }
  }
  return o;
}

std::size_t allocated_bytes(const std::vector<trace>& traces) {
  std::size_t total = 0;
  for (const trace& t : traces) {
    for (const trace_op& op : t.ops) {
      total += op.allocate ? (op.bytes + 255) / 256 * 256 : 0;
    }
  }
  return total;
}

void print_row(const std::string& trace_name, const std::vector<std::string>& names,
               const std::map<std::string, double>& results) {
  std::printf("%-24s", trace_name.c_str());
  for (const std::string& n : names) {
    auto it = results.find(n);
    if (it == results.end()) {
      std::printf(" %14s", "-");
    } else {
      std::printf(" %14.1f", it->second);
    }
  }
  std::printf("\n");
  const auto pool = results.find("pool");
  if (pool == results.end()) {
    return;
  }
  std::printf("%-24s", "  peer / pool");
  for (const std::string& n : names) {
    auto it = results.find(n);
    if (it == results.end() || n == "pool") {
      std::printf(" %14s", "-");
    } else {
      std::printf(" %13.1fx", it->second / pool->second);
    }
  }
  std::printf("\n");
}

}  // namespace

int main(int argc, char** argv) {
  const options opt = parse(argc, argv);
  int devices = 0;
  const cudaError_t probe = cudaGetDeviceCount(&devices);
  if (!opt.simulated && (probe != cudaSuccess || devices == 0)) {
    std::printf("SKIPPED: no CUDA device (%s); run with --simulated for the host-side cost\n",
                probe != cudaSuccess ? cudaGetErrorName(probe) : "0 devices");
    return 69;
  }
  static_cast<void>(cudaGetLastError());

  const std::vector<std::string> names =
      opt.simulated || opt.only_pool
          ? std::vector<std::string>{"pool", "vm_pool", "arena"}
          : std::vector<std::string>{"pool", "vm_pool", "arena", "cudaMalloc", "cudaMallocAsync",
                                     "CUB", "thrust"};
  const auto wanted = [&](const char* row) { return opt.only_row.empty() || opt.only_row == row; };
  // Opened before anything is measured: a path that cannot be written fails at once.
  std::optional<csv_results> csv;
  if (!opt.csv_path.empty()) {
    csv.emplace(opt.csv_path, argc, argv);
    if (!*csv) {
      std::fprintf(stderr, "bench_pool: --csv: %s\n", csv->error().c_str());
      return 2;
    }
  }
  std::size_t device_free = 0;
  std::size_t device_total = 0;
  char device[512];
  if (opt.simulated) {
    std::snprintf(device, sizeof device,
                  "simulated device (no GPU): host-side cost of the bookkeeping only");
  } else {
    cudaDeviceProp prop{};
    require(cudaGetDeviceProperties(&prop, 0), "cudaGetDeviceProperties");
    require(cudaMemGetInfo(&device_free, &device_total), "cudaMemGetInfo");
    std::snprintf(device, sizeof device, "%s, %.1f GiB free of %.1f GiB, %u host threads",
                  prop.name, static_cast<double>(device_free) / GiB,
                  static_cast<double>(device_total) / GiB, std::thread::hardware_concurrency());
  }
  std::printf("bench_pool: %s\n", device);
  char measured[128];
  std::snprintf(measured, sizeof measured,
                "ns per operation, median of %d runs (mt16: wall time over all threads' ops)",
                opt.reps);
  std::printf("%s\n", measured);
  if (csv) {
    int runtime = 0;
    int driver = 0;
    static_cast<void>(cudaRuntimeGetVersion(&runtime));
    static_cast<void>(cudaDriverGetVersion(&driver));  // 0 where there is no driver
    static_cast<void>(cudaGetLastError());
    char cuda[96];
    if (driver == 0) {
      std::snprintf(cuda, sizeof cuda, "runtime %d.%d, no driver", runtime / 1000,
                    runtime % 1000 / 10);
    } else {
      std::snprintf(cuda, sizeof cuda, "runtime %d.%d, driver %d.%d", runtime / 1000,
                    runtime % 1000 / 10, driver / 1000, driver % 1000 / 10);
    }
    csv->describe("measured", std::string("bench_pool: ") + measured);
    csv->describe("device", device);
    csv->describe("cuda", cuda);
    csv->columns({"trace", "allocator", "ns_per_op"});
  }
  if (opt.pool_cache_follows_use >= 0) {
    std::printf("pool row: pool_options::cache_follows_use = %s\n",
                opt.pool_cache_follows_use == 1 ? "true" : "false");
  }
  std::printf("%-24s", "trace");
  for (const std::string& n : names) {
    std::printf(" %14s", n.c_str());
  }
  std::printf("\n");

  for (const trace_spec& spec : standard_traces()) {
    if (!opt.only.empty() && spec.name != opt.only) {
      continue;
    }
    std::vector<trace> traces;
    for (unsigned t = 0; t < spec.threads; ++t) {
      traces.push_back(make_trace(spec, t));
    }
    const bool multi = spec.threads > 1;
    std::map<std::string, double> results;
    std::vector<cudaStream_t> streams(spec.threads, nullptr);
    if (!opt.simulated) {
      for (auto& s : streams) {
        require(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreate");
      }
    }
    auto stream_of = [&](std::size_t i) { return streams[i]; };

    // --- cudamem pool ---
    if (wanted("pool")) {
      std::unique_ptr<cudamem::memory_resource> upstream;
      if (opt.simulated) {
        upstream = std::make_unique<cudamem::simulated_resource>(cudamem::simulated_options{
            .capacity = std::size_t{1} << 44, .layout = cudamem::simulated_layout::paged});
      } else {
        upstream = std::make_unique<cudamem::device_resource>(0);
      }
      cudamem::pool_options pool_opt;
      if (opt.pool_cache_follows_use >= 0) {
        pool_opt.cache_follows_use = opt.pool_cache_follows_use == 1;
      }
      cudamem::pool_resource pool{*upstream, pool_opt};
      results["pool"] = median_ns_per_op(opt.reps, [&] {
        return timed_replay(traces, [&](std::size_t i) { return resource_worker{&pool, stream_of(i)}; });
      });
    }
    // --- cudamem vm_pool ---
    if (wanted("vm_pool")) {
      std::unique_ptr<cudamem::vm_pool_resource> vm;
      if (opt.simulated) {
        vm = std::make_unique<cudamem::vm_pool_resource>(
            std::make_unique<cudamem::detail::simulated_vm_mapping>(
                cudamem::detail::simulated_vm_options{.capacity = std::size_t{80} << 30}));
      } else {
        vm = std::make_unique<cudamem::vm_pool_resource>(0);
      }
      results["vm_pool"] = median_ns_per_op(opt.reps, [&] {
        return timed_replay(traces,
                            [&](std::size_t i) { return resource_worker{vm.get(), stream_of(i)}; });
      });
    }
    // --- cudamem arena (allocation cost; where it fits) ---
    const std::size_t arena_bytes = allocated_bytes(traces);
    if (wanted("arena") && !multi && (opt.simulated || arena_bytes < device_free / 4)) {
      std::unique_ptr<cudamem::memory_resource> upstream;
      if (opt.simulated) {
        upstream = std::make_unique<cudamem::simulated_resource>(cudamem::simulated_options{
            .capacity = std::size_t{1} << 44, .layout = cudamem::simulated_layout::paged});
      } else {
        upstream = std::make_unique<cudamem::device_resource>(0);
      }
      cudamem::arena_resource arena{*upstream, {.initial_chunk_size = std::size_t{64} << 20}};
      results["arena"] = median_ns_per_op(opt.reps, [&] {
        return timed_replay(traces, [&](std::size_t) { return arena_worker{&arena}; });
      });
    }
    if (!opt.simulated && !opt.only_pool) {
      results["cudaMalloc"] = median_ns_per_op(opt.reps, [&] {
        return timed_replay(traces, [&](std::size_t) { return cuda_malloc_worker{}; });
      });
      {
        const malloc_async_peer async_pool;  // trims the pool when the row is done
        results["cudaMallocAsync"] = median_ns_per_op(opt.reps, [&] {
          return timed_replay(traces, [&](std::size_t i) { return malloc_async_worker{stream_of(i)}; });
        });
      }
      {
        const auto cub = make_cub_peer();
        results["CUB"] = median_ns_per_op(opt.reps, [&] {
          return timed_replay(traces, [&](std::size_t i) { return cub_worker{cub.get(), stream_of(i)}; });
        });
        require(cub->FreeAllCached(), "CUB FreeAllCached");
      }
      if (!multi) {
        thrust::device_memory_resource upstream;
        thrust::mr::new_delete_resource bookkeeper;
        thrust_pool pool(&upstream, &bookkeeper);
        results["thrust"] = median_ns_per_op(opt.reps, [&] {
          return timed_replay(traces, [&](std::size_t) { return thrust_worker{&pool}; });
        });
        pool.release();
      }
    }
    if (!opt.simulated) {
      for (auto s : streams) {
        require(cudaStreamDestroy(s), "cudaStreamDestroy");
      }
    }
    print_row(spec.name, names, results);
    for (const std::string& n : names) {  // in the table's order; "-" cells have no row
      if (csv && results.count(n) != 0) {
        csv->row({spec.name, n}, results.at(n));
      }
    }
  }
  if (csv) {
    if (!csv->finish()) {
      std::fprintf(stderr, "bench_pool: --csv: %s\n", csv->error().c_str());
      return 1;
    }
    std::printf("results written to %s\n", opt.csv_path.c_str());
  }
  return 0;
}
