// bench/workload.cu — what a program that runs kernels gains from cudamem: a training-step-like
// loop on 4 streams, the same kernels and sizes for every allocator, measured in one run
// against the no-allocator limit; then a loop of small thrust sorts, thrust's default
// temporaries against exec_policy.
//
//   ./run bench workload                  # the full run: ~2-3 minutes on an H100
//   ./run bench workload --quick          # a smoke run (30 steps, 3 rounds, 200 sorts)
//   options: --steps N (default 200) --reps N (rounds of timed passes, default 7, at least 5
//            for figures to quote) --sorts N (default 1000) --only A,B,... (rows, by name;
//            `limit` always runs: every row is measured against it; `sort` for the sort loop
//            alone) --no-probe (skip the instrumented pass)
//   ./run bench workload --simulated      # no GPU: the allocation pattern alone over a
//            simulated device and a model of the event calls, at several device lags (below)
//
// The workload. One host thread drives 4 non-blocking streams. A step gives each stream, in
// turn, one "stream-step" (the sizes are drawn once, before anything is timed, from fixed
// seeds, and replayed identically for every allocator and every repetition):
//   - 24 small tensors, 1 KiB - 64 KiB (biases, norms, scalars),
//     8 medium tensors, 256 KiB - 4 MiB (activations of small layers),
//     2 large tensors, 16 MiB - 64 MiB (big activations, gradients);
//     each size log-uniform in its range, rounded up to 16 bytes, the 34 in shuffled order;
//     on average about 80 MiB per stream-step;
//   - every tensor filled (a kernel), then axpy y = 0.5 x + y over each consecutive pair
//     (tensor k += 0.5 * tensor k-1, over the shorter of the two);
//   - 256 Ki uint32 keys (1 MiB, a medium array from the same allocator) filled with hashed
//     values and sorted with thrust::sort, whose temporaries come from the allocator under
//     test where it has a way to give them (see the rows below);
//   - every tensor and the keys freed, in stream order, in allocation order.
// The kernels are memory-bound grid-stride loops; about 70 launches per stream-step.
//
// The rows (the limit, the peers of DESIGN.md, then ours):
//   limit            no allocator at all: before anything is timed, every stream gets
//                    one buffer per tensor slot (the largest size that slot takes in the
//                    plan), one for the keys and one for the sort's temporaries (rewound after
//                    each stream-step); every stream-step reuses its own stream's buffers. No
//                    allocator can do better: every row reports its steps/s as a fraction of
//                    this one's, measured in the same rounds
//   cudaMalloc       tensors cudaMalloc/cudaFree; sort under thrust::cuda::par.on(s), whose
//                    temporaries are cudaMalloc/cudaFree too (what "cudaMalloc code" is)
//   cudaMallocAsync  cudaMallocAsync/cudaFreeAsync on s, default pool with release threshold
//                    UINT64_MAX; sort under thrust::cuda::par_nosync.on(s), which takes its
//                    temporaries with cudaMallocAsync on s
//   CUB              cub::CachingDeviceAllocator(8, 3, 22, 64 GiB) for tensors and (through a
//                    thrust allocator) the sort's temporaries, under par_nosync.on(s)
//   pool+thrust      cudamem pool_resource for tensors, but the sort under thrust's default
//                    par.on(s): the cost of thrust's default temporaries alone
//   pool             cudamem pool_resource for everything: sort under cudamem::exec_policy
//   pool-naive       the same pool built to choose blocks naively (the first
//                    pick whatever it waits for; a query and a wait per block that crosses
//                    streams: detail::scoped_pool_stream_choices): what preferring blocks
//                    that need no wait, and waiting once per recording, buy, in the same run
//   pool-complete    the pool with pool_options::stream_reuse = when_complete: memory freed on
//                    another stream is reused only once known complete, else the pool grows
//                    (no cross-stream waits; more memory): what the waits cost, in the same run
//   pool-cache-kept  the pool with pool_options::cache_follows_use = false, the default until
//                    2026-11-27: its cache keeps a finished stream-step's blocks where they
//                    were, rather than merging them (peak reserved: 192 MiB against 160 MiB in
//                    the model)
//   vm_pool          the same over cudamem vm_pool_resource (and vm_pool-naive,
//                    vm_pool-complete)
//   arena            one cudamem arena_resource per stream (over cudaMalloc'd chunks of
//                    160 MiB), rewound after every stream-step by an arena_scope: allocation is
//                    a pointer bump and the stream-step's frees cost nothing
//
// Measured: steps per second (a step = one stream-step on each of the 4 streams), wall time
// from the first allocation to the end of a cudaDeviceSynchronize after the last step. Every
// row's allocator is made first, one after the other, each followed by its untimed pass (so
// caches and pools are warm: the steady state); then `reps` rounds, each one timed pass of
// every row, in an order that rotates by one row each round (so no row always runs first or
// after the same neighbour). Each row: the median of its passes, their spread (min-max), and
// its steps/s as a fraction of the limit's in the same round (the median of those fractions,
// and their spread).
// Peak reserved: how much device memory the allocator held at most — cudaMemGetInfo
// (total - free) minus the reading taken just before the allocator was made, sampled right
// after each stream-step's allocations (its live set is largest there) during its untimed pass
// (no other row runs then); and, since the timed passes run beside the other rows, the
// allocator's own count after them where it has one (caching allocators still hold whatever
// those passes took), whichever is larger. cudaMemGetInfo is the one count every allocator is
// subject to (cudaMalloc has no counter of its own; CUB rounds to bins; the driver's pools and
// vm_pool map memory in their own granules); the own count is printed beside it.
//
// The probe (where does the time go?). After the rounds, one more pass per row, not
// in the figures above: three timing events per stream-step on its stream (before its
// allocations, after them, after its frees), and the host's clock around the whole
// stream-step and around each allocate and free call. Per stream-step it reports the host's
// time and the part of it spent in the allocator; the GPU's time from the stream reaching the
// stream-step to its end; the GPU time between "before its allocations" and "after them" —
// nothing but waits the allocator inserted (cudaStreamWaitEvent, the driver's own dependencies
// for cudaMallocAsync) can stand there, so it is ~0 for the limit; and the streams' overlap
// (the sum of the stream-steps' GPU times over the pass's GPU span: 1 = one at a time). For the
// pools, the counts of pool_resource::stream_stats() over the timed passes, per step: blocks
// that crossed streams, blocks chosen because they needed no wait, event records, queries,
// stream waits made and skipped, host waits, device synchronisations, chunks taken and given
// back (these last should be 0 in the steady state).
//
// Then the sort loop: thrust::sort of 64 Ki uint32 keys, `sorts` times in a row on one stream
// (the same buffer: radix sort does the same passes whatever the order), timed from the first
// call to a stream synchronisation after the last; median of 5 repetitions after a warm-up,
// for thrust's default policy (par.on(s)), par_nosync.on(s) (cudaMallocAsync temporaries),
// thrust's par with cudamem's temporary allocator (pool temporaries, but thrust still waits
// for the stream after each sort), and cudamem::exec_policy.
//
// --simulated (no GPU): the same plan's allocations and frees (tensors, keys, and one
// temporary of 1 MiB + 96 KiB for the sort) through pool, pool-naive, pool-complete and the
// three vm_pool rows over a simulated 80 GiB device, with the pools' event calls answered by a
// model of a device that is `lag` stream-steps behind the host (lag 0: idle, every event is
// complete when asked; lag 4: a stream-step's work is done when its stream's next one starts).
// `--growth-mib N` and `--cache-mib N` set the pools' growth_step and cache_block_limit there
// (what a different default would do to the waits and the peak). `--vm-handle-mib N`,
// `--vm-growth-mib N` and `--vm-small-chunk-mib N` set, for the vm_pool rows only, the
// vm_resource's handle_bytes and growth_bytes and the pool's small_chunk_size and growth_step
// (powers of two; the chunk a multiple of the handle, at least the pool's 4 MiB
// small_block_limit; the handle at least the 2 MiB granule); `--vm-limit-mib N` their
// physical_limit (a multiple of the handle: at the limit the vm_resource recycles rather than
// grows); `--vm-grow-ahead-mib N` their grow_ahead_bytes (0 over the simulated device unless
// given; a real device's default is 4 GiB: a thread keeps up to a quarter of what is held
// mapped ahead; its timing in the model is not a GPU's, so figures with it vary run to run).
// With any of them the vm_pool rows also print the vm_resource's peak mapped MiB (what
// the device holds: whole growth batches, and the free ranges it grew past rather than merge
// or recycle, where `peak` counts only the pool's chunks and the large blocks in use), that
// over the largest stream-step, and its driver calls over both passes (cuMemCreate / cuMemMap
// / cuMemSetAccess: the cold fill; cN: compactions). It prints the counts above
// per step, which stream-steps the waits were on (how many
// stream-steps back: 1 = the one just before, which serialises the streams), and the peak
// reserved beside the largest stream-step (what a cudaMalloc program holds, about). It shows
// the host side of the hypotheses with no GPU; the times are the GPU run's.
//
// With no GPU (and no --simulated) the program prints one line and exits 69.
#include <cudamem/arena_resource.hpp>
#include <cudamem/detail/pool/host_stream_events.hpp>
#include <cudamem/detail/vm/simulated_mapping.hpp>
#include <cudamem/device_resource.hpp>
#include <cudamem/error.hpp>
#include <cudamem/exec_policy.hpp>
#include <cudamem/pool_resource.hpp>
#include <cudamem/simulated_resource.hpp>
#include <cudamem/vm_pool_resource.hpp>

#include "peers.hpp"
#include "traces.hpp"

#include <cub/util_allocator.cuh>
#include <thrust/execution_policy.h>
#include <thrust/sort.h>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

using namespace cudamem_bench;

namespace {

using clock_type = std::chrono::steady_clock;

constexpr int stream_count = 4;
constexpr std::size_t small_tensors = 24;
constexpr std::size_t medium_tensors = 8;
constexpr std::size_t large_tensors = 2;
constexpr std::size_t step_sort_keys = std::size_t{256} << 10;  // 1 MiB of uint32
constexpr std::size_t loop_sort_keys = std::size_t{64} << 10;   // the sort loop's 64 Ki keys
/// --simulated: what thrust's sort of the step's 256 Ki keys takes as a temporary, about.
constexpr std::size_t sort_temporary = MiB + 96 * KiB;
/// --simulated: what a request of `bytes` holds in the pools (whole 256-byte blocks).
constexpr std::size_t pool_block_bytes(std::size_t bytes) {
  return (bytes + 255) & ~std::size_t{255};
}
constexpr std::size_t tensors_per_stream_step = small_tensors + medium_tensors + large_tensors;

// --- the plan: every size, drawn before anything is timed ----------------------------------------

/// One stream's share of a step: tensor sizes in bytes, in allocation order.
struct stream_step {
  std::vector<std::size_t> tensor_bytes;
};

struct plan {
  std::vector<std::array<stream_step, stream_count>> steps;
  double mean_bytes_per_stream_step = 0;
};

plan make_plan(std::size_t steps) {
  plan p;
  double total = 0;
  for (std::size_t step = 0; step < steps; ++step) {
    std::array<stream_step, stream_count> one;
    for (int i = 0; i < stream_count; ++i) {
      cudamem_bench::random rng(0x16'0000 + step * stream_count + static_cast<std::size_t>(i));
      std::vector<std::size_t>& bytes = one[static_cast<std::size_t>(i)].tensor_bytes;
      const auto draw = [&](std::size_t count, std::size_t lo, std::size_t hi) {
        for (std::size_t k = 0; k < count; ++k) {
          bytes.push_back((rng.log_uniform(lo, hi) + 15) / 16 * 16);
        }
      };
      draw(small_tensors, KiB, 64 * KiB);
      draw(medium_tensors, 256 * KiB, 4 * MiB);
      draw(large_tensors, 16 * MiB, 64 * MiB);
      for (std::size_t k = bytes.size() - 1; k > 0; --k) {  // Fisher-Yates, our generator
        std::swap(bytes[k], bytes[rng.below(k + 1)]);
      }
      for (std::size_t b : bytes) {
        total += static_cast<double>(b);
      }
      total += static_cast<double>(step_sort_keys * sizeof(std::uint32_t));
    }
    p.steps.push_back(std::move(one));
  }
  p.mean_bytes_per_stream_step = total / static_cast<double>(steps * stream_count);
  return p;
}

// --- the kernels: the same for every allocator ---------------------------------------------------

unsigned grid_for(std::size_t n) {
  return static_cast<unsigned>(std::min<std::size_t>((n + 255) / 256, 2048));
}

__global__ void fill(float* x, std::size_t n, float value) {
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < n;
       i += stride) {
    x[i] = value;
  }
}

__global__ void axpy(float* y, const float* x, std::size_t n, float a) {
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < n;
       i += stride) {
    y[i] = a * x[i] + y[i];
  }
}

__global__ void fill_keys(std::uint32_t* keys, std::size_t n, std::uint32_t seed) {
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < n;
       i += stride) {
    std::uint32_t h = static_cast<std::uint32_t>(i) * 0x9E3779B1u ^ seed;
    h ^= h >> 16;
    h *= 0x85EBCA6Bu;
    h ^= h >> 13;
    keys[i] = h;
  }
}

// --- the allocators under test: allocate / deallocate / sort on stream i -------------------------

/// thrust temporaries from CUB's caching allocator (what a CUB user would write).
struct cub_temporary_allocator {
  using value_type = char;
  cub::CachingDeviceAllocator* cub;
  cudaStream_t stream;
  char* allocate(std::size_t n) {
    void* p = nullptr;
    require(cub->DeviceAllocate(&p, n, stream), "CUB DeviceAllocate (thrust temporary)");
    return static_cast<char*>(p);
  }
  void deallocate(char* p, std::size_t) noexcept {
    require(cub->DeviceFree(p), "CUB DeviceFree (thrust temporary)");
  }
};

/// One row of the table: how its tensors are allocated and freed, and how it sorts.
struct workload_allocator {
  std::function<void*(std::size_t bytes, int stream)> allocate;
  std::function<void(void* p, std::size_t bytes, int stream)> deallocate;
  std::function<void(std::uint32_t* keys, std::size_t n, int stream)> sort;
  std::function<void(int stream)> end_stream_step = [](int) {};
  std::function<std::optional<std::size_t>()> own_reserved = [] { return std::nullopt; };
  /// The pool's stream counts, for the rows that are pools.
  std::function<std::optional<cudamem::pool_stream_stats>()> stream_stats = [] {
    return std::nullopt;
  };
};

/// What every row's state derives from: the allocator it offers.
struct row_base {
  workload_allocator allocator;
  row_base() = default;
  virtual ~row_base() = default;
  row_base(const row_base&) = delete;
  row_base& operator=(const row_base&) = delete;
};

struct device_usage {
  std::size_t baseline = 0;
  std::size_t peak = 0;  // the most (total - free) seen, minus baseline

  static std::size_t used_now() {
    std::size_t free = 0;
    std::size_t total = 0;
    require(cudaMemGetInfo(&free, &total), "cudaMemGetInfo");
    return total - free;
  }
  void sample() {
    const std::size_t used = used_now();
    peak = std::max(peak, used > baseline ? used - baseline : 0);
  }
};

/// The probe pass's record: three timing events per stream-step, and host times.
struct probe {
  cudaEvent_t origin = nullptr;             ///< recorded before the pass, on stream 0
  std::vector<cudaEvent_t> events;          ///< 3 per stream-step, in issue order
  std::vector<double> host_us;              ///< per stream-step: the whole stream-step
  std::vector<double> allocator_us;         ///< per stream-step: allocate and free calls
  double pass_seconds = 0;

  explicit probe(std::size_t stream_steps) : events(3 * stream_steps) {
    require(cudaEventCreate(&origin), "cudaEventCreate (probe)");
    for (cudaEvent_t& e : events) {
      require(cudaEventCreate(&e), "cudaEventCreate (probe)");
    }
    host_us.reserve(stream_steps);
    allocator_us.reserve(stream_steps);
  }
  ~probe() {
    static_cast<void>(cudaEventDestroy(origin));
    for (cudaEvent_t e : events) {
      static_cast<void>(cudaEventDestroy(e));
    }
  }
  probe(const probe&) = delete;
  probe& operator=(const probe&) = delete;
};

/// Runs `count` steps of the plan (from step 0); samples device memory when `usage` is given;
/// records the probe's events and times when `pr` is given.
void run_steps(workload_allocator& a, const plan& p, std::size_t count,
               const std::array<cudaStream_t, stream_count>& streams, device_usage* usage,
               probe* pr = nullptr) {
  std::vector<void*> tensors;
  if (pr != nullptr) {
    require(cudaEventRecord(pr->origin, streams[0]), "cudaEventRecord (probe)");
  }
  const auto pass_start = clock_type::now();
  double allocator_seconds = 0;
  // Around every allocate and free when probing: the allocator's share of the host's time.
  const auto timed = [&](auto&& call) {
    if (pr == nullptr) {
      return call();
    }
    const auto t0 = clock_type::now();
    struct add_on_exit {
      clock_type::time_point t0;
      double& total;
      ~add_on_exit() { total += std::chrono::duration<double>(clock_type::now() - t0).count(); }
    } add{t0, allocator_seconds};
    return call();
  };
  for (std::size_t step = 0; step < count; ++step) {
    for (int i = 0; i < stream_count; ++i) {
      const cudaStream_t s = streams[static_cast<std::size_t>(i)];
      const stream_step& plan_here = p.steps[step][static_cast<std::size_t>(i)];
      const std::size_t index = step * stream_count + static_cast<std::size_t>(i);
      const auto host_start = clock_type::now();
      allocator_seconds = 0;
      if (pr != nullptr) {
        require(cudaEventRecord(pr->events[3 * index], s), "cudaEventRecord (probe)");
      }
      tensors.clear();
      for (std::size_t bytes : plan_here.tensor_bytes) {
        tensors.push_back(timed([&] { return a.allocate(bytes, i); }));
      }
      auto* keys = static_cast<std::uint32_t*>(
          timed([&] { return a.allocate(step_sort_keys * sizeof(std::uint32_t), i); }));
      if (usage != nullptr) {
        usage->sample();
      }
      if (pr != nullptr) {
        require(cudaEventRecord(pr->events[3 * index + 1], s), "cudaEventRecord (probe)");
      }
      for (std::size_t k = 0; k < tensors.size(); ++k) {
        const std::size_t n = plan_here.tensor_bytes[k] / sizeof(float);
        fill<<<grid_for(n), 256, 0, s>>>(static_cast<float*>(tensors[k]), n, static_cast<float>(k));
      }
      for (std::size_t k = 1; k < tensors.size(); ++k) {
        const std::size_t n =
            std::min(plan_here.tensor_bytes[k], plan_here.tensor_bytes[k - 1]) / sizeof(float);
        axpy<<<grid_for(n), 256, 0, s>>>(static_cast<float*>(tensors[k]),
                                         static_cast<const float*>(tensors[k - 1]), n, 0.5f);
      }
      fill_keys<<<grid_for(step_sort_keys), 256, 0, s>>>(keys, step_sort_keys,
                                                          static_cast<std::uint32_t>(step * 4 + i));
      require(cudaPeekAtLastError(), "a workload kernel launch");
      a.sort(keys, step_sort_keys, i);  // its temporaries' allocations are not in allocator_us
      timed([&] {
        a.deallocate(keys, step_sort_keys * sizeof(std::uint32_t), i);
        for (std::size_t k = 0; k < tensors.size(); ++k) {
          a.deallocate(tensors[k], plan_here.tensor_bytes[k], i);
        }
        a.end_stream_step(i);
      });
      if (pr != nullptr) {
        require(cudaEventRecord(pr->events[3 * index + 2], s), "cudaEventRecord (probe)");
        pr->host_us.push_back(
            1e6 * std::chrono::duration<double>(clock_type::now() - host_start).count());
        pr->allocator_us.push_back(1e6 * allocator_seconds);
      }
    }
  }
  require(cudaDeviceSynchronize(), "cudaDeviceSynchronize after the steps");
  if (pr != nullptr) {
    pr->pass_seconds = std::chrono::duration<double>(clock_type::now() - pass_start).count();
  }
}

/// What the probe pass showed, per stream-step (medians unless said otherwise).
struct probe_summary {
  double steps_per_second = 0;
  double host_us = 0;          ///< the host's time per stream-step
  double allocator_us = 0;     ///< of which in allocate / deallocate calls
  double gpu_us = 0;           ///< GPU: the stream reaching the stream-step to its end
  double blocked_us = 0;       ///< GPU: before its allocations to after them (median)
  double blocked_mean_us = 0;  ///< the same, mean (a few long waits show here)
  double overlap = 0;          ///< sum of stream-step GPU times / the pass's GPU span
};

probe_summary summarize(const probe& pr, std::size_t steps) {
  const std::size_t n = pr.events.size() / 3;
  std::vector<double> gpu;
  std::vector<double> blocked;
  double first = 1e30;
  double last = 0;
  double sum = 0;
  double blocked_sum = 0;
  for (std::size_t k = 0; k < n; ++k) {
    float begin = 0;
    float after_alloc = 0;
    float end = 0;
    require(cudaEventElapsedTime(&begin, pr.origin, pr.events[3 * k]), "cudaEventElapsedTime");
    require(cudaEventElapsedTime(&after_alloc, pr.origin, pr.events[3 * k + 1]), "cudaEventElapsedTime");
    require(cudaEventElapsedTime(&end, pr.origin, pr.events[3 * k + 2]), "cudaEventElapsedTime");
    gpu.push_back(1e3 * (end - begin));
    blocked.push_back(1e3 * (after_alloc - begin));
    blocked_sum += 1e3 * (after_alloc - begin);
    sum += 1e3 * (end - begin);
    first = std::min(first, 1e3 * static_cast<double>(begin));
    last = std::max(last, 1e3 * static_cast<double>(end));
  }
  probe_summary s;
  s.steps_per_second = static_cast<double>(steps) / pr.pass_seconds;
  s.host_us = median(pr.host_us);
  s.allocator_us = median(pr.allocator_us);
  s.gpu_us = median(gpu);
  s.blocked_us = median(blocked);
  s.blocked_mean_us = n > 0 ? blocked_sum / static_cast<double>(n) : 0;
  s.overlap = last > first ? sum / (last - first) : 0;
  return s;
}

// --- each row's state -------------------------------------------------------------------------------

/// No allocator: every stream's buffers made once (see the header comment).
struct limit_row : row_base {
  cudamem::device_resource device;
  struct stream_buffers {
    std::vector<void*> slots;      ///< one per tensor of a stream-step, then the keys
    std::vector<std::size_t> sizes;
    std::size_t next = 0;          ///< the slot the next allocation of this stream-step gets
    char* temporaries = nullptr;   ///< the sort's, a bump allocator rewound per stream-step
    std::size_t temporary_bytes = 0;
    std::size_t temporary_used = 0;
  };
  std::array<stream_buffers, stream_count> buffers;

  /// The sort's temporaries from stream i's buffer (nothing is freed until the rewind).
  struct bump_allocator {
    using value_type = char;
    stream_buffers* b;
    char* allocate(std::size_t n) {
      const std::size_t at = (b->temporary_used + 255) & ~std::size_t{255};
      if (at + n > b->temporary_bytes) {
        std::fprintf(stderr, "bench_workload: the limit row's temporary buffer is too small\n");
        std::exit(1);
      }
      b->temporary_used = at + n;
      return b->temporaries + at;
    }
    void deallocate(char*, std::size_t) noexcept {}
  };

  limit_row(const plan& p, const std::array<cudaStream_t, stream_count>& streams) {
    for (int i = 0; i < stream_count; ++i) {
      stream_buffers& b = buffers[static_cast<std::size_t>(i)];
      b.sizes.assign(tensors_per_stream_step + 1, 0);
      for (const auto& step : p.steps) {
        const auto& bytes = step[static_cast<std::size_t>(i)].tensor_bytes;
        for (std::size_t k = 0; k < bytes.size(); ++k) {
          b.sizes[k] = std::max(b.sizes[k], bytes[k]);
        }
      }
      b.sizes.back() = step_sort_keys * sizeof(std::uint32_t);
      for (std::size_t bytes : b.sizes) {
        b.slots.push_back(device.allocate(bytes));
      }
      b.temporary_bytes = 16 * MiB;  // thrust's sort of 256 Ki keys takes ~1.1 MiB
      b.temporaries = static_cast<char*>(device.allocate(b.temporary_bytes));
    }
    allocator.allocate = [this](std::size_t bytes, int i) {
      stream_buffers& b = buffers[static_cast<std::size_t>(i)];
      if (b.next >= b.slots.size() || b.sizes[b.next] < bytes) {
        std::fprintf(stderr, "bench_workload: the limit row's plan does not match the steps\n");
        std::exit(1);
      }
      return b.slots[b.next++];
    };
    allocator.deallocate = [](void*, std::size_t, int) {};
    allocator.sort = [this, streams](std::uint32_t* keys, std::size_t n, int i) {
      const cudaStream_t s = streams[static_cast<std::size_t>(i)];
      thrust::sort(thrust::cuda::par_nosync(bump_allocator{&buffers[static_cast<std::size_t>(i)]}).on(s),
                   keys, keys + n);
    };
    // Stream order makes reuse safe: the next stream-step on stream i runs after this one.
    allocator.end_stream_step = [this](int i) {
      buffers[static_cast<std::size_t>(i)].next = 0;
      buffers[static_cast<std::size_t>(i)].temporary_used = 0;
    };
    allocator.own_reserved = [this] {
      std::size_t total = 0;
      for (const stream_buffers& b : buffers) {
        for (std::size_t bytes : b.sizes) {
          total += bytes;
        }
        total += b.temporary_bytes;
      }
      return std::optional<std::size_t>(total);
    };
  }
  ~limit_row() override {
    require(cudaDeviceSynchronize(), "cudaDeviceSynchronize");  // before the buffers go back
    for (stream_buffers& b : buffers) {
      for (std::size_t k = 0; k < b.slots.size(); ++k) {
        device.deallocate(b.slots[k], b.sizes[k]);
      }
      device.deallocate(b.temporaries, b.temporary_bytes);
    }
  }
};

struct cuda_malloc_row : row_base {
  explicit cuda_malloc_row(const std::array<cudaStream_t, stream_count>& streams) {
    allocator.allocate = [](std::size_t bytes, int) { return cuda_malloc_worker{}.allocate(bytes); };
    allocator.deallocate = [](void* p, std::size_t bytes, int) { cuda_malloc_worker{}.deallocate(p, bytes); };
    allocator.sort = [streams](std::uint32_t* keys, std::size_t n, int i) {
      thrust::sort(thrust::cuda::par.on(streams[static_cast<std::size_t>(i)]), keys, keys + n);
    };
  }
};

struct malloc_async_row : row_base {
  malloc_async_peer peer;  // threshold UINT64_MAX now; sync and trim at the end of the row
  explicit malloc_async_row(const std::array<cudaStream_t, stream_count>& streams) {
    allocator.allocate = [streams](std::size_t bytes, int i) {
      return malloc_async_worker{streams[static_cast<std::size_t>(i)]}.allocate(bytes);
    };
    allocator.deallocate = [streams](void* p, std::size_t bytes, int i) {
      malloc_async_worker{streams[static_cast<std::size_t>(i)]}.deallocate(p, bytes);
    };
    allocator.sort = [streams](std::uint32_t* keys, std::size_t n, int i) {
      thrust::sort(thrust::cuda::par_nosync.on(streams[static_cast<std::size_t>(i)]), keys, keys + n);
    };
    allocator.own_reserved = [this] { return std::optional<std::size_t>(peer.reserved_high()); };
  }
};

struct cub_row : row_base {
  std::unique_ptr<cub::CachingDeviceAllocator> cub = make_cub_peer();
  explicit cub_row(const std::array<cudaStream_t, stream_count>& streams) {
    allocator.allocate = [this, streams](std::size_t bytes, int i) {
      return cub_worker{cub.get(), streams[static_cast<std::size_t>(i)]}.allocate(bytes);
    };
    allocator.deallocate = [this, streams](void* p, std::size_t bytes, int i) {
      cub_worker{cub.get(), streams[static_cast<std::size_t>(i)]}.deallocate(p, bytes);
    };
    allocator.sort = [this, streams](std::uint32_t* keys, std::size_t n, int i) {
      const cudaStream_t s = streams[static_cast<std::size_t>(i)];
      thrust::sort(thrust::cuda::par_nosync(cub_temporary_allocator{cub.get(), s}).on(s), keys, keys + n);
    };
    allocator.own_reserved = [this] {
      const auto& bytes = cub->cached_bytes[0];
      return std::optional<std::size_t>(bytes.free + bytes.live);
    };
  }
  ~cub_row() override {
    require(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
    require(cub->FreeAllCached(), "CUB FreeAllCached");
  }
};

/// Tensors from a cudamem resource; the sort under exec_policy, or thrust's default policy.
struct resource_row : row_base {
  std::unique_ptr<cudamem::memory_resource> upstream;
  std::unique_ptr<cudamem::memory_resource> mr;
  resource_row(std::unique_ptr<cudamem::memory_resource> up, std::unique_ptr<cudamem::memory_resource> top,
               const std::array<cudaStream_t, stream_count>& streams, bool thrust_default_sort,
               std::function<std::size_t(cudamem::memory_resource&)> reserved,
               std::function<cudamem::pool_stream_stats(cudamem::memory_resource&)> counts)
      : upstream(std::move(up)), mr(std::move(top)) {
    allocator.allocate = [this, streams](std::size_t bytes, int i) {
      return resource_worker{mr.get(), streams[static_cast<std::size_t>(i)]}.allocate(bytes);
    };
    allocator.deallocate = [this, streams](void* p, std::size_t bytes, int i) {
      resource_worker{mr.get(), streams[static_cast<std::size_t>(i)]}.deallocate(p, bytes);
    };
    if (thrust_default_sort) {
      allocator.sort = [streams](std::uint32_t* keys, std::size_t n, int i) {
        thrust::sort(thrust::cuda::par.on(streams[static_cast<std::size_t>(i)]), keys, keys + n);
      };
    } else {
      allocator.sort = [this, streams](std::uint32_t* keys, std::size_t n, int i) {
        thrust::sort(cudamem::exec_policy(*mr, streams[static_cast<std::size_t>(i)]), keys, keys + n);
      };
    }
    allocator.own_reserved = [this, reserved] { return std::optional<std::size_t>(reserved(*mr)); };
    allocator.stream_stats = [this, counts] {
      return std::optional<cudamem::pool_stream_stats>(counts(*mr));
    };
  }
  ~resource_row() override {
    if (mr) {
      require(cudaDeviceSynchronize(), "cudaDeviceSynchronize");  // frees are stream-ordered
    }
  }
};

/// One arena per stream over cudaMalloc'd chunks, rewound after each of its stream-steps.
struct arena_row : row_base {
  cudamem::device_resource device;
  std::vector<std::unique_ptr<cudamem::arena_resource>> arenas;
  std::vector<cudamem::arena_mark> marks;
  explicit arena_row(const std::array<cudaStream_t, stream_count>& streams) {
    for (int i = 0; i < stream_count; ++i) {
      cudamem::arena_options chunks;
      chunks.initial_chunk_size = 160 * MiB;  // a whole stream-step fits one chunk, mostly
      chunks.growth_factor = 1.0;
      arenas.push_back(std::make_unique<cudamem::arena_resource>(device, chunks));
      marks.push_back(arenas.back()->mark());
    }
    allocator.allocate = [this, streams](std::size_t bytes, int i) {
      return arenas[static_cast<std::size_t>(i)]->allocate(bytes, 256, streams[static_cast<std::size_t>(i)]);
    };
    allocator.deallocate = [](void*, std::size_t, int) {};  // an arena frees at the rewind
    allocator.sort = [this, streams](std::uint32_t* keys, std::size_t n, int i) {
      thrust::sort(cudamem::exec_policy(*arenas[static_cast<std::size_t>(i)], streams[static_cast<std::size_t>(i)]),
                   keys, keys + n);
    };
    // Stream order makes the rewind safe: the next stream-step on stream i runs after this one.
    allocator.end_stream_step = [this](int i) {
      arenas[static_cast<std::size_t>(i)]->rewind(marks[static_cast<std::size_t>(i)]);
    };
    allocator.own_reserved = [this] {
      std::size_t total = 0;
      for (const auto& arena : arenas) {
        total += arena->stats().reserved_bytes;
      }
      return std::optional<std::size_t>(total);
    };
  }
  ~arena_row() override {
    require(cudaDeviceSynchronize(), "cudaDeviceSynchronize");  // before the chunks go back
  }
};

// --- the rounds: every row made and warmed, then timed passes interleaved -------------------------

struct row_result {
  std::string name;
  bool ran = false;
  std::string note;
  std::vector<double> rates;             ///< steps/s of each timed pass, by round
  std::vector<double> limit_fractions;   ///< rate / the limit's rate in the same round
  std::size_t peak_reserved = 0;
  std::optional<std::size_t> own_reserved;
  std::optional<cudamem::pool_stream_stats> counts;  ///< over the timed passes (pools)
  std::optional<probe_summary> probed;

  [[nodiscard]] double steps_per_second() const { return median(rates); }
  [[nodiscard]] double fraction_of_limit() const { return median(limit_fractions); }
};

struct row_spec {
  std::string name;
  std::function<std::unique_ptr<row_base>()> make;
};

/// Makes every row (each followed by its memory-sampled untimed pass), then `reps` rounds of
/// one timed pass per row in rotating order, then (with `probing`) one probe pass per row.
/// The rows live until every pass is done, and are destroyed before this returns.
std::vector<row_result> run_rounds(const std::vector<row_spec>& specs, const plan& p,
                                   std::size_t steps, int reps, bool probing,
                                   const std::array<cudaStream_t, stream_count>& streams) {
  std::vector<row_result> results(specs.size());
  std::vector<std::unique_ptr<row_base>> rows(specs.size());
  std::vector<cudamem::pool_stream_stats> counts_before(specs.size());
  for (std::size_t r = 0; r < specs.size(); ++r) {
    results[r].name = specs[r].name;
    require(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
    device_usage usage;
    usage.baseline = device_usage::used_now();
    try {
      rows[r] = specs[r].make();
      run_steps(rows[r]->allocator, p, steps, streams, &usage);
      results[r].peak_reserved = usage.peak;
      if (auto c = rows[r]->allocator.stream_stats()) {
        counts_before[r] = *c;
      }
      results[r].ran = true;
    } catch (const std::exception& e) {
      results[r].note = e.what();
      rows[r].reset();
      require(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
    }
    std::printf("  made and warmed: %s\n", specs[r].name.c_str());
    std::fflush(stdout);
  }
  const std::size_t n = specs.size();
  for (int round = 0; round < reps; ++round) {
    std::vector<double> rate(n, 0.0);
    for (std::size_t k = 0; k < n; ++k) {
      const std::size_t r = (k + static_cast<std::size_t>(round)) % n;
      if (!rows[r]) {
        continue;
      }
      try {
        const auto start = clock_type::now();
        run_steps(rows[r]->allocator, p, steps, streams, nullptr);
        const double seconds = std::chrono::duration<double>(clock_type::now() - start).count();
        rate[r] = static_cast<double>(steps) / seconds;
        results[r].rates.push_back(rate[r]);
      } catch (const std::exception& e) {  // e.g. out of memory beside the other rows
        results[r].note = e.what();
        results[r].ran = false;
        rows[r].reset();
        require(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
      }
    }
    const double limit_rate = rate[0];  // the limit is always the first row
    for (std::size_t r = 0; r < n; ++r) {
      if (rate[r] > 0 && limit_rate > 0) {
        results[r].limit_fractions.push_back(rate[r] / limit_rate);
      }
    }
    std::printf("  round %d of %d done\n", round + 1, reps);
    std::fflush(stdout);
  }
  for (std::size_t r = 0; r < n; ++r) {
    if (!rows[r]) {
      continue;
    }
    if (auto c = rows[r]->allocator.stream_stats()) {
      results[r].counts = difference(*c, counts_before[r]);
    }
    // Caching allocators never give memory back while they live: their own count now covers
    // the timed passes too (cudaMemGetInfo cannot tell the rows apart any more).
    results[r].own_reserved = rows[r]->allocator.own_reserved();
    if (results[r].own_reserved) {
      results[r].peak_reserved = std::max(results[r].peak_reserved, *results[r].own_reserved);
    }
    if (probing) {
      probe pr(steps * stream_count);
      run_steps(rows[r]->allocator, p, steps, streams, nullptr, &pr);
      results[r].probed = summarize(pr, steps);
    }
  }
  for (std::size_t r = n; r-- > 0;) {
    rows[r].reset();  // in reverse: the limit, made first, goes last
    require(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  }
  return results;
}

// --- the sort loop ------------------------------------------------------------------------------------

template <class Policy>
double time_sort_loop(Policy&& policy, std::uint32_t* keys, int sorts, cudaStream_t s) {
  const auto start = clock_type::now();
  for (int k = 0; k < sorts; ++k) {
    thrust::sort(policy, keys, keys + loop_sort_keys);
  }
  require(cudaStreamSynchronize(s), "cudaStreamSynchronize after the sort loop");
  return std::chrono::duration<double, std::milli>(clock_type::now() - start).count();
}

template <class MakePolicy>
double median_sort_loop(MakePolicy&& make_policy, std::uint32_t* keys, int sorts, cudaStream_t s) {
  time_sort_loop(make_policy(), keys, std::max(1, sorts / 10), s);  // warm-up
  std::vector<double> ms;
  for (int rep = 0; rep < 5; ++rep) {
    ms.push_back(time_sort_loop(make_policy(), keys, sorts, s));
  }
  return median(ms);
}

// --- options and printing -----------------------------------------------------------------------------

struct options {
  std::size_t steps = 200;
  int reps = 7;
  int sorts = 1000;
  std::vector<std::string> only;  ///< empty: every row
  bool probe = true;
  bool simulated = false;
  std::size_t growth_mib = 0;  ///< --simulated: the pools' growth_step (0: default)
  int cache_mib = -1;          ///< --simulated: the pools' cache_block_limit (-1: default)
  /// --simulated, vm_pool rows only: handle_bytes, growth_bytes, small_chunk_size (and the
  /// pool's growth_step) in MiB; 0: the default.
  std::size_t vm_handle_mib = 0;
  std::size_t vm_growth_mib = 0;
  std::size_t vm_small_chunk_mib = 0;
  std::size_t vm_limit_mib = 0;  ///< physical_limit (0: none)
  /// grow_ahead_bytes in MiB (nullopt: the default, 0 over the simulated device).
  std::optional<std::size_t> vm_grow_ahead_mib;

  [[nodiscard]] bool vm_configured() const {
    return vm_handle_mib != 0 || vm_growth_mib != 0 || vm_small_chunk_mib != 0 ||
           vm_limit_mib != 0 || vm_grow_ahead_mib.has_value();
  }

  [[nodiscard]] bool wants(const std::string& name) const {
    return only.empty() || std::find(only.begin(), only.end(), name) != only.end();
  }
};

/// The value of a --vm-*-mib option, a whole number of MiB: with `power_of_two`, a power of two
/// of at least `least`; otherwise from `least` (0 or 1) up. Anything else: one line and exit 2
/// (a table must never name a size the run did not use).
std::size_t parse_vm_mib(const char* option, const char* text, std::size_t least,
                         bool power_of_two = true) {
  const unsigned long long most = power_of_two ? (1ull << 20) : (1ull << 30);
  char* end = nullptr;
  const unsigned long long mib = std::strtoull(text, &end, 10);
  if (text[0] < '0' || text[0] > '9' || *end != '\0' || mib < least || mib > most ||
      (power_of_two && (mib & (mib - 1)) != 0)) {
    if (power_of_two) {
      std::fprintf(stderr, "bench_workload: %s %s: must be a power of two of at least %zu (MiB)\n",
                   option, text, least);
    } else {
      std::fprintf(stderr, "bench_workload: %s %s: must be %s number of MiB%s\n", option, text,
                   least == 0 ? "a" : "a positive", least == 0 ? " (0: off)" : "");
    }
    std::exit(2);
  }
  return static_cast<std::size_t>(mib);
}

options parse(int argc, char** argv) {
  options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--quick") {
      o.steps = 30;
      o.reps = 3;
      o.sorts = 200;
    } else if (a == "--steps" && i + 1 < argc) {
      o.steps = static_cast<std::size_t>(std::max(1, std::atoi(argv[++i])));
    } else if (a == "--reps" && i + 1 < argc) {
      o.reps = std::max(1, std::atoi(argv[++i]));
    } else if (a == "--sorts" && i + 1 < argc) {
      o.sorts = std::max(1, std::atoi(argv[++i]));
    } else if (a == "--only" && i + 1 < argc) {
      std::stringstream names(argv[++i]);
      for (std::string name; std::getline(names, name, ',');) {
        if (!name.empty()) {
          o.only.push_back(name);
        }
      }
    } else if (a == "--no-probe") {
      o.probe = false;
    } else if (a == "--simulated") {
      o.simulated = true;
    } else if (a == "--growth-mib" && i + 1 < argc) {
      o.growth_mib = static_cast<std::size_t>(std::max(0, std::atoi(argv[++i])));
    } else if (a == "--cache-mib" && i + 1 < argc) {
      o.cache_mib = std::max(0, std::atoi(argv[++i]));
    } else if (a == "--vm-handle-mib" && i + 1 < argc) {
      o.vm_handle_mib = parse_vm_mib("--vm-handle-mib", argv[++i], 2);  // whole 2 MiB granules
    } else if (a == "--vm-growth-mib" && i + 1 < argc) {
      o.vm_growth_mib = parse_vm_mib("--vm-growth-mib", argv[++i], 1);
    } else if (a == "--vm-grow-ahead-mib" && i + 1 < argc) {
      o.vm_grow_ahead_mib = parse_vm_mib("--vm-grow-ahead-mib", argv[++i], 0, false);
    } else if (a == "--vm-limit-mib" && i + 1 < argc) {
      // Any whole number of MiB; a multiple of the handle is checked below.
      o.vm_limit_mib = parse_vm_mib("--vm-limit-mib", argv[++i], 1, false);
    } else if (a == "--vm-small-chunk-mib" && i + 1 < argc) {
      // At least the pool's small_block_limit (4 MiB), which must fit in a small chunk.
      o.vm_small_chunk_mib = parse_vm_mib("--vm-small-chunk-mib", argv[++i], 4);
    } else {
      std::fprintf(stderr,
                   "usage: bench_workload [--quick] [--steps N] [--reps N] [--sorts N] "
                   "[--only A,B,...] [--no-probe] [--simulated [--growth-mib N] [--cache-mib N]\n"
                   "       [--vm-handle-mib N] [--vm-growth-mib N] [--vm-small-chunk-mib N] "
                   "[--vm-limit-mib N]\n"
                   "       [--vm-grow-ahead-mib N]]\n"
                   "rows: limit cudaMalloc cudaMallocAsync CUB pool+thrust pool pool-naive "
                   "pool-complete pool-cache-kept vm_pool vm_pool-naive vm_pool-complete arena; sort: the sort loop\n");
      std::exit(2);
    }
  }
  // A wholly free chunk must be whole handles, or the upstream could not recycle it.
  const std::size_t handle = o.vm_handle_mib != 0 ? o.vm_handle_mib : 64;
  const std::size_t chunk = o.vm_small_chunk_mib != 0 ? o.vm_small_chunk_mib : 64;
  if (chunk % handle != 0) {
    std::fprintf(stderr,
                 "bench_workload: the vm_pool's small chunk (%zu MiB) must be a multiple of its "
                 "handle (%zu MiB): give --vm-small-chunk-mib and --vm-handle-mib to match\n",
                 chunk, handle);
    std::exit(2);
  }
  if (o.vm_limit_mib % handle != 0) {  // physical_limit is used in whole handles
    std::fprintf(stderr,
                 "bench_workload: --vm-limit-mib %zu: must be a multiple of the vm_pool's handle "
                 "(%zu MiB)\n",
                 o.vm_limit_mib, handle);
    std::exit(2);
  }
  return o;
}

double mib(std::size_t bytes) { return static_cast<double>(bytes) / static_cast<double>(MiB); }

/// "median (min-max)" of `v` with `digits` decimals.
std::string spread(const std::vector<double>& v, int digits) {
  if (v.empty()) {
    return "-";
  }
  const auto [lo, hi] = std::minmax_element(v.begin(), v.end());
  char text[96];
  std::snprintf(text, sizeof text, "%.*f (%.*f-%.*f)", digits, median(v), digits, *lo, digits, *hi);
  return text;
}

/// Counts per step: `total` over `steps` steps.
double per_step(std::uint64_t total, std::size_t steps) {
  return steps > 0 ? static_cast<double>(total) / static_cast<double>(steps) : 0.0;
}

void print_counts_header() {
  std::printf("%-16s %8s %8s %8s %8s %8s %8s %8s %8s %11s\n", "pool row", "crossed", "preferred",
              "records", "queries", "waits", "skipped", "host w.", "dev sync", "chunks +/-");
}

void print_counts(const std::string& name, const cudamem::pool_stream_stats& c, std::size_t steps) {
  std::printf("%-16s %8.2f %8.2f %8.2f %8.2f %8.2f %8.2f %8.2f %8.2f %5llu/%-5llu\n", name.c_str(),
              per_step(c.cross_stream_blocks, steps), per_step(c.preferred_blocks, steps),
              per_step(c.event_records, steps), per_step(c.event_queries, steps),
              per_step(c.stream_waits, steps), per_step(c.waits_skipped, steps),
              per_step(c.host_waits, steps), per_step(c.device_syncs, steps),
              static_cast<unsigned long long>(c.upstream_allocations),
              static_cast<unsigned long long>(c.upstream_returns));
}

// --- --simulated: the allocation pattern alone, over a model of the device -----------------------

/// One pool of the simulation: pool_resource or vm_pool_resource over simulated memory.
struct simulated_pool {
  cudamem::simulated_resource device;
  std::unique_ptr<cudamem::memory_resource> mr;
  cudamem::pool_resource* pool = nullptr;  ///< the pool inside (vm_pool's own)
};

/// Replays two passes of the plan (the first warms, the second is counted) through `mr` with
/// the device `lag` stream-steps behind the host (0: idle), and prints one line.
void simulate(const std::string& name, bool vm, bool naive, bool when_complete,
              std::size_t lag, const plan& p, std::size_t steps,
              cudamem::pool_options pool_opt, const options& opt) {
  if (when_complete) {
    pool_opt.stream_reuse = cudamem::stream_reuse_policy::when_complete;
  }
  cudamem::detail::host_stream_events events;
  const cudamem::detail::scoped_pool_stream_events use{events};
  const cudamem::detail::scoped_pool_stream_choices choices{
      {.prefer_ready = !naive, .remember_waits = !naive}};
  simulated_pool sp;
  if (vm) {
    cudamem::vm_pool_options vo;
    vo.pool.growth_step = pool_opt.growth_step;
    vo.pool.cache_block_limit = pool_opt.cache_block_limit;
    vo.pool.stream_reuse = pool_opt.stream_reuse;
    if (opt.vm_handle_mib != 0) {
      vo.handle_bytes = opt.vm_handle_mib * MiB;
    }
    if (opt.vm_growth_mib != 0) {
      vo.growth_bytes = opt.vm_growth_mib * MiB;
    }
    if (opt.vm_limit_mib != 0) {
      vo.physical_limit = opt.vm_limit_mib * MiB;
    }
    if (opt.vm_grow_ahead_mib) {
      vo.grow_ahead_bytes = *opt.vm_grow_ahead_mib * MiB;
    }
    if (opt.vm_small_chunk_mib != 0) {
      vo.pool.small_chunk_size = opt.vm_small_chunk_mib * MiB;
      vo.pool.growth_step = opt.vm_small_chunk_mib * MiB;
    }
    auto v = std::make_unique<cudamem::vm_pool_resource>(
        std::make_unique<cudamem::detail::simulated_vm_mapping>(), vo);
    sp.pool = &v->pool();
    sp.mr = std::move(v);
  } else {
    auto pool = std::make_unique<cudamem::pool_resource>(sp.device, pool_opt);
    sp.pool = pool.get();
    sp.mr = std::move(pool);
  }
  events.complete_at_record(lag == 0);
  std::array<cudaStream_t, stream_count> streams{};
  for (int i = 0; i < stream_count; ++i) {
    streams[static_cast<std::size_t>(i)] = reinterpret_cast<cudaStream_t>(std::uintptr_t{0x1000} * (i + 1));
  }
  std::size_t peak = 0;
  std::size_t largest_step = 0;
  cudamem::pool_stream_stats before{};
  std::map<std::uint64_t, std::size_t> distances_before;
  std::vector<void*> tensors;
  std::uint64_t tick = 0;
  for (int pass = 0; pass < 2; ++pass) {
    if (pass == 1) {
      before = sp.pool->stream_stats();
      distances_before = events.wait_distances();
    }
    for (std::size_t step = 0; step < steps; ++step) {
      for (int i = 0; i < stream_count; ++i) {
        ++tick;
        events.set_tick(tick);
        if (lag > 0 && tick > lag) {
          events.complete_recorded_before(tick - lag + 1);
        }
        const cudaStream_t s = streams[static_cast<std::size_t>(i)];
        events.note_work(s, tick);
        const auto& bytes = p.steps[step][static_cast<std::size_t>(i)].tensor_bytes;
        std::size_t live = 0;
        tensors.clear();
        for (std::size_t b : bytes) {
          tensors.push_back(sp.mr->allocate(b, 256, s));
          live += pool_block_bytes(b);
        }
        void* keys = sp.mr->allocate(step_sort_keys * sizeof(std::uint32_t), 256, s);
        live += step_sort_keys * sizeof(std::uint32_t) + sort_temporary;
        peak = std::max(peak, sp.mr->stats().reserved_bytes);
        void* temporary = sp.mr->allocate(sort_temporary, 256, s);
        sp.mr->deallocate(temporary, sort_temporary, 256, s);
        sp.mr->deallocate(keys, step_sort_keys * sizeof(std::uint32_t), 256, s);
        for (std::size_t k = 0; k < bytes.size(); ++k) {
          sp.mr->deallocate(tensors[k], bytes[k], 256, s);
        }
        largest_step = std::max(largest_step, live);
      }
    }
  }
  const cudamem::pool_stream_stats c = difference(sp.pool->stream_stats(), before);
  std::string distances;
  for (const auto& [d, count] : events.wait_distances()) {
    const auto it = distances_before.find(d);
    const std::size_t counted = count - (it != distances_before.end() ? it->second : 0);
    if (counted > 0) {
      distances += " " + std::to_string(d) + ":" + std::to_string(counted);
    }
  }
  char lag_text[16];
  std::snprintf(lag_text, sizeof lag_text, "%zu", lag);
  std::printf("%-16s %4s", name.c_str(), lag == 0 ? "idle" : lag_text);
  std::printf(" %8.2f %8.2f %8.2f %8.2f %8.2f %8.2f %7.1f %7.1f %6.2f",
              per_step(c.cross_stream_blocks, steps), per_step(c.preferred_blocks, steps),
              per_step(c.event_records, steps), per_step(c.event_queries, steps),
              per_step(c.stream_waits, steps), per_step(c.waits_skipped, steps), mib(peak),
              mib(largest_step), static_cast<double>(peak) / static_cast<double>(largest_step));
  if (opt.vm_configured()) {  // the vm_resource's own figures: only when asked for
    if (vm) {
      const cudamem::vm_pool_stats v = static_cast<cudamem::vm_pool_resource&>(*sp.mr).vm_stats();
      char calls[64];
      std::snprintf(calls, sizeof calls, "%zu/%zu/%zu c%zu", v.handles_created, v.maps, v.access_calls, v.compactions);
      std::printf(" %7.1f %6.2f %18s", mib(v.peak_mapped_bytes),
                  static_cast<double>(v.peak_mapped_bytes) / static_cast<double>(largest_step),
                  calls);
    } else {
      std::printf(" %7s %6s %18s", "-", "-", "-");
    }
  }
  std::printf("  %s\n", distances.empty() ? "-" : distances.c_str());
}

/// The least memory a pool of two tiers can hold on this plan, whatever its placement: a tier's
/// chunks serve only that tier and are kept once taken, so the pool holds at least the most
/// the small tier ever has live plus the most the large tier ever has live, even when the two
/// peaks fall in different stream-steps (cudaMalloc needs only the largest stream-step). One
/// stream-step live at a time, as when every free waits for the device: the floor with no
/// stream overlap at all. Sizes rounded to the pool's 256-byte blocks; `small_limit`: the
/// largest request of the small tier (pool_options::small_block_limit).
void print_tier_floor(const plan& p, std::size_t small_limit) {
  std::size_t most_small = 0;
  std::size_t most_large = 0;
  std::size_t most_total = 0;
  for (const auto& step : p.steps) {
    for (const stream_step& ss : step) {
      // The keys and the sort's temporary are small-tier blocks (1 MiB, 1.1 MiB).
      std::size_t small =
          pool_block_bytes(step_sort_keys * sizeof(std::uint32_t)) + pool_block_bytes(sort_temporary);
      std::size_t large = 0;
      for (std::size_t b : ss.tensor_bytes) {
        (b <= small_limit ? small : large) += pool_block_bytes(b);
      }
      most_small = std::max(most_small, small);
      most_large = std::max(most_large, large);
      most_total = std::max(most_total, small + large);
    }
  }
  std::printf("two-tier floor: the small tier's most live %.1f MiB + the large tier's most live "
              "%.1f MiB = %.1f MiB, %.2fx the largest stream-step (%.1f MiB); chunks of whole "
              "2 MiB granules only add to it\n\n",
              mib(most_small), mib(most_large), mib(most_small + most_large),
              static_cast<double>(most_small + most_large) / static_cast<double>(most_total),
              mib(most_total));
}

int run_simulated(const options& opt) {
  const plan p = make_plan(opt.steps);
  cudamem::pool_options pool_opt;  // the defaults, but for what the command line says
  if (opt.growth_mib > 0) {
    pool_opt.growth_step = opt.growth_mib * MiB;
  }
  if (opt.cache_mib >= 0) {
    pool_opt.cache_block_limit = static_cast<std::size_t>(opt.cache_mib) * MiB;
  }
  std::printf("pool options: growth_step %zu MiB, cache_block_limit %zu MiB (vm_pool: the same "
              "over its own defaults)\n",
              pool_opt.growth_step / MiB, pool_opt.cache_block_limit / MiB);
  std::printf("bench_workload --simulated: the allocation pattern of %zu steps x %d streams over a "
              "simulated device; pools' event calls answered by a model of a device `lag` "
              "stream-steps behind the host (idle: every event complete when asked). Counts per "
              "step of the second pass (the first warms).\n",
              opt.steps, stream_count);
  std::printf("waits by distance: how many stream-steps back the work waited for was issued "
              "(1: the stream-step just before: the streams run one after another)\n\n");
  print_tier_floor(p, pool_opt.small_block_limit);
  if (opt.vm_configured()) {
    const cudamem::vm_resource_options defaults;
    const cudamem::pool_options chunking = cudamem::vm_pool_chunking();
    std::printf("vm_pool rows: handle_bytes %zu MiB, growth_bytes %zu MiB, small_chunk_size %zu "
                "MiB, growth_step %zu MiB, physical_limit %s, grow_ahead_bytes %s (--vm-handle-mib, "
                "--vm-growth-mib, --vm-small-chunk-mib, --vm-limit-mib, --vm-grow-ahead-mib)\n\n",
                (opt.vm_handle_mib != 0 ? opt.vm_handle_mib * MiB : defaults.handle_bytes) / MiB,
                (opt.vm_growth_mib != 0 ? opt.vm_growth_mib * MiB : defaults.growth_bytes) / MiB,
                (opt.vm_small_chunk_mib != 0 ? opt.vm_small_chunk_mib * MiB
                                             : chunking.small_chunk_size) / MiB,
                (opt.vm_small_chunk_mib != 0 ? opt.vm_small_chunk_mib * MiB
                                             : pool_opt.growth_step) / MiB,
                opt.vm_limit_mib != 0 ? (std::to_string(opt.vm_limit_mib) + " MiB").c_str()
                                      : "none",
                opt.vm_grow_ahead_mib ? (std::to_string(*opt.vm_grow_ahead_mib) + " MiB").c_str()
                                      : "default (0 here)");
  }
  std::printf("%-16s %4s %8s %8s %8s %8s %8s %8s %7s %7s %6s", "pool", "lag", "crossed",
              "preferred", "records", "queries", "waits", "skipped", "peak", "1 step", "ratio");
  if (opt.vm_configured()) {
    std::printf(" %7s %6s %18s", "mapped", "m.rat.", "create/map/acc cN");
  }
  std::printf("  %s\n", "waits by distance");
  for (const std::size_t lag : {std::size_t{0}, std::size_t{1}, std::size_t{2}, std::size_t{4},
                                std::size_t{8}}) {
    for (const bool vm : {false, true}) {
      for (const std::string variant : {"-naive", "", "-complete", "-cache-kept"}) {
        const std::string name = std::string(vm ? "vm_pool" : "pool") + variant;
        const bool cache_kept = variant == "-cache-kept";
        if (!opt.wants(name) || (vm && cache_kept)) {  // vm_pool's cache always follows use
          continue;
        }
        cudamem::pool_options row_opt = pool_opt;
        row_opt.cache_follows_use = !cache_kept;
        simulate(name, vm, variant == "-naive", variant == "-complete", lag, p, opt.steps,
                 row_opt, opt);
      }
    }
  }
  std::printf("\npeak: the pool's reserved MiB (sampled after each stream-step's allocations); "
              "1 step: the largest stream-step's live bytes (about what cudaMalloc holds, whose "
              "frees wait for the device); ratio: peak / 1 step\n");
  if (opt.vm_configured()) {
    std::printf("mapped: the vm_pool's vm_resource's peak mapped MiB (whole handles and growth "
                "batches: what the device holds); m.rat.: mapped / 1 step; create/map/acc: its "
                "cuMemCreate / cuMemMap / cuMemSetAccess calls over both passes, cN its "
                "compactions\n");
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) try {
  const options opt = parse(argc, argv);
  if (opt.simulated) {
    return run_simulated(opt);
  }
  int devices = 0;
  const cudaError_t found = cudaGetDeviceCount(&devices);
  if (found != cudaSuccess || devices == 0) {
    std::printf("SKIPPED: no CUDA device (%s): bench_workload needs a GPU (--simulated: none)\n",
                found != cudaSuccess ? cudaGetErrorName(found) : "0 devices");
    return 69;
  }
  require(cudaSetDevice(0), "cudaSetDevice");
  cudaDeviceProp prop{};
  require(cudaGetDeviceProperties(&prop, 0), "cudaGetDeviceProperties");
  std::size_t device_free = 0;
  std::size_t device_total = 0;
  require(cudaMemGetInfo(&device_free, &device_total), "cudaMemGetInfo");

  const plan p = make_plan(opt.steps);
  std::printf("bench_workload: %s, %.1f GiB free of %.1f GiB\n", prop.name,
              static_cast<double>(device_free) / GiB, static_cast<double>(device_total) / GiB);
  std::printf("workload: %d streams; per stream and step %zu small (1-64 KiB) + %zu medium "
              "(256 KiB-4 MiB) + %zu large (16-64 MiB) tensors, mean %.1f MiB with the keys; fill "
              "+ axpy over each, thrust::sort of %zu Ki keys\n",
              stream_count, small_tensors, medium_tensors, large_tensors,
              p.mean_bytes_per_stream_step / static_cast<double>(MiB), step_sort_keys >> 10);
  std::printf("%zu steps per pass; every row made and warmed by one untimed (memory-sampled) pass, "
              "then %d rounds of one timed pass per row, in rotating order; medians and spread "
              "(min-max) over the rounds\n\n",
              opt.steps, opt.reps);

  std::array<cudaStream_t, stream_count> streams{};
  for (auto& s : streams) {
    require(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
  }
  {
    // Every kernel once before any row: CUDA loads modules on first launch (lazy loading), and
    // the first row should not pay for it in time or in device memory.
    void* warm = nullptr;
    require(cudaMalloc(&warm, step_sort_keys * sizeof(std::uint32_t)), "cudaMalloc (warm-up)");
    auto* keys = static_cast<std::uint32_t*>(warm);
    fill<<<grid_for(step_sort_keys), 256, 0, streams[0]>>>(static_cast<float*>(warm), step_sort_keys, 1.0f);
    axpy<<<grid_for(step_sort_keys), 256, 0, streams[0]>>>(static_cast<float*>(warm),
                                                           static_cast<const float*>(warm), step_sort_keys, 0.5f);
    fill_keys<<<grid_for(step_sort_keys), 256, 0, streams[0]>>>(keys, step_sort_keys, 1);
    thrust::sort(thrust::cuda::par.on(streams[0]), keys, keys + step_sort_keys);
    thrust::sort(thrust::cuda::par.on(streams[0]), keys, keys + loop_sort_keys);
    require(cudaStreamSynchronize(streams[0]), "cudaStreamSynchronize (warm-up)");
    require(cudaFree(warm), "cudaFree (warm-up)");
  }

  using resource_ptr = std::unique_ptr<cudamem::memory_resource>;
  const auto pool_reserved = [](cudamem::memory_resource& mr) { return mr.stats().reserved_bytes; };
  const auto vm_mapped = [](cudamem::memory_resource& mr) {
    return static_cast<cudamem::vm_pool_resource&>(mr).vm_stats().mapped_bytes;
  };
  const auto pool_counts = [](cudamem::memory_resource& mr) {
    return static_cast<cudamem::pool_resource&>(mr).stream_stats();
  };
  const auto vm_counts = [](cudamem::memory_resource& mr) {
    return static_cast<cudamem::vm_pool_resource&>(mr).pool().stream_stats();
  };
  // A pool row; `naive`: built to choose blocks naively (see the header);
  // `when_complete`: pool_options::stream_reuse = stream_reuse_policy::when_complete.
  // `cache_kept`: pool_options::cache_follows_use = false (the default before 2026-11-27).
  const auto pool_row = [&](bool thrust_default_sort, bool naive, bool when_complete,
                            bool cache_kept = false) {
    return [&, thrust_default_sort, naive, when_complete,
            cache_kept]() -> std::unique_ptr<row_base> {
      const cudamem::detail::scoped_pool_stream_choices choices{
          {.prefer_ready = !naive, .remember_waits = !naive}};
      auto device = std::make_unique<cudamem::device_resource>(0);
      cudamem::pool_options o;
      if (when_complete) {
        o.stream_reuse = cudamem::stream_reuse_policy::when_complete;
      }
      o.cache_follows_use = !cache_kept;
      resource_ptr pool = std::make_unique<cudamem::pool_resource>(*device, o);
      return std::make_unique<resource_row>(std::move(device), std::move(pool), streams,
                                            thrust_default_sort, pool_reserved, pool_counts);
    };
  };
  const auto vm_pool_row = [&](bool naive, bool when_complete) {
    return [&, naive, when_complete]() -> std::unique_ptr<row_base> {
      const cudamem::detail::scoped_pool_stream_choices choices{
          {.prefer_ready = !naive, .remember_waits = !naive}};
      cudamem::vm_pool_options o;
      if (when_complete) {
        o.pool.stream_reuse = cudamem::stream_reuse_policy::when_complete;
      }
      return std::make_unique<resource_row>(nullptr, std::make_unique<cudamem::vm_pool_resource>(0, o),
                                            streams, false, vm_mapped, vm_counts);
    };
  };
  const std::vector<row_spec> all = {
      {"limit", [&] { return std::make_unique<limit_row>(p, streams); }},  // first: the reference
      {"cudaMalloc", [&] { return std::make_unique<cuda_malloc_row>(streams); }},
      {"cudaMallocAsync", [&] { return std::make_unique<malloc_async_row>(streams); }},
      {"CUB", [&] { return std::make_unique<cub_row>(streams); }},
      {"pool+thrust", pool_row(true, false, false)},
      {"pool", pool_row(false, false, false)},
      {"pool-naive", pool_row(false, true, false)},
      {"pool-complete", pool_row(false, false, true)},
      {"pool-cache-kept", pool_row(false, false, false, true)},
      {"vm_pool", vm_pool_row(false, false)},
      {"vm_pool-naive", vm_pool_row(true, false)},
      {"vm_pool-complete", vm_pool_row(false, true)},
      {"arena", [&] { return std::make_unique<arena_row>(streams); }},
  };
  std::vector<row_spec> specs;
  for (const row_spec& spec : all) {
    if (spec.name == "limit" || opt.wants(spec.name)) {
      specs.push_back(spec);
    }
  }
  const bool rows_wanted = opt.only.empty() || specs.size() > 1 ||
                           std::find(opt.only.begin(), opt.only.end(), "limit") != opt.only.end();
  std::vector<row_result> results;
  if (rows_wanted) {
    results = run_rounds(specs, p, opt.steps, opt.reps, opt.probe, streams);
  }
  std::map<std::string, const row_result*> rows;
  for (const row_result& r : results) {
    rows[r.name] = &r;
  }

  // --- the sort loop ---
  std::map<std::string, double> sort_ms;
  if (opt.wants("sort")) {
    cudaStream_t s = streams[0];
    void* raw_keys = nullptr;
    require(cudaMalloc(&raw_keys, loop_sort_keys * sizeof(std::uint32_t)), "cudaMalloc keys");
    auto* keys = static_cast<std::uint32_t*>(raw_keys);
    fill_keys<<<grid_for(loop_sort_keys), 256, 0, s>>>(keys, loop_sort_keys, 7);
    require(cudaStreamSynchronize(s), "cudaStreamSynchronize");
    {
      const malloc_async_peer async_pool;  // par_nosync's temporaries: the default pool
      sort_ms["thrust default (par)"] =
          median_sort_loop([&] { return thrust::cuda::par.on(s); }, keys, opt.sorts, s);
      sort_ms["thrust par_nosync"] =
          median_sort_loop([&] { return thrust::cuda::par_nosync.on(s); }, keys, opt.sorts, s);
    }
    {
      cudamem::device_resource device{0};
      cudamem::pool_resource pool{device};
      sort_ms["cudamem allocator, par"] = median_sort_loop(
          [&] { return thrust::cuda::par(cudamem::thrust_temporary_allocator{pool, s}).on(s); }, keys,
          opt.sorts, s);
      sort_ms["cudamem exec_policy"] =
          median_sort_loop([&] { return cudamem::exec_policy(pool, s); }, keys, opt.sorts, s);
      require(cudaStreamSynchronize(s), "cudaStreamSynchronize");
    }
    require(cudaFree(raw_keys), "cudaFree keys");
  }

  for (auto& s : streams) {
    require(cudaStreamDestroy(s), "cudaStreamDestroy");
  }

  // --- the tables ---
  std::printf("\n=== bench_workload: results (%s) ===\n", prop.name);
  const auto find = [&](const std::string& name) -> const row_result* {
    const auto it = rows.find(name);
    return it != rows.end() && it->second->ran && !it->second->rates.empty() ? it->second : nullptr;
  };
  if (!results.empty()) {
    std::printf("%-16s %26s %24s %14s %14s\n", "allocator", "steps/s median (min-max)",
                "x limit median (min-max)", "peak res. MiB", "own count MiB");
    for (const row_result& r : results) {
      if (!r.ran || r.rates.empty()) {
        std::printf("%-16s %26s %24s %14s %14s  (%s)\n", r.name.c_str(), "-", "-", "-", "-",
                    r.note.c_str());
        continue;
      }
      char own[32] = "-";
      if (r.own_reserved) {
        std::snprintf(own, sizeof own, "%.1f", mib(*r.own_reserved));
      }
      std::printf("%-16s %26s %24s %14.1f %14s\n", r.name.c_str(), spread(r.rates, 1).c_str(),
                  spread(r.limit_fractions, 3).c_str(), mib(r.peak_reserved), own);
    }
  }

  // Ours against each peer: ratios of medians (steps/s), and peak reserved against the best peer
  // and against cudaMalloc's (the target printed below).
  const std::vector<std::string> peers = {"cudaMalloc", "cudaMallocAsync", "CUB"};
  const std::vector<std::string> ours = {"pool",          "pool-naive",       "pool-complete",
                                         "pool-cache-kept",
                                         "vm_pool",       "vm_pool-naive",    "vm_pool-complete",
                                         "arena"};
  std::optional<std::size_t> best_peer_peak;
  std::string best_peer;
  for (const std::string& name : peers) {
    if (const row_result* r = find(name); r != nullptr && (!best_peer_peak || r->peak_reserved < *best_peer_peak)) {
      best_peer_peak = r->peak_reserved;
      best_peer = name;
    }
  }
  const auto ratio = [&](const row_result& r, const std::string& peer) {
    const row_result* other = find(peer);
    if (other == nullptr || other->steps_per_second() <= 0) {
      return std::string("-");
    }
    char text[32];
    std::snprintf(text, sizeof text, "%.2fx", r.steps_per_second() / other->steps_per_second());
    return std::string(text);
  };
  const auto peak_against = [&](const row_result& r, const std::string& peer) {
    const row_result* other = find(peer);
    if (other == nullptr || other->peak_reserved == 0) {
      return std::string("-");
    }
    char text[32];
    std::snprintf(text, sizeof text, "%.2f", static_cast<double>(r.peak_reserved) /
                                                 static_cast<double>(other->peak_reserved));
    return std::string(text);
  };
  bool printed_header = false;
  for (const std::string& name : ours) {
    const row_result* r = find(name);
    if (r == nullptr) {
      continue;
    }
    if (!printed_header) {
      std::printf("\n%-16s %10s %8s %13s %17s %8s %14s %10s %13s\n", "ours", "steps/s", "x limit",
                  "x cudaMalloc", "x cudaMallocAsync", "x CUB", "x pool+thrust", "peak MiB",
                  "peak / cudaMalloc");
      printed_header = true;
    }
    std::printf("%-16s %10.1f %8.3f %13s %17s %8s %14s %10.1f %13s\n", name.c_str(),
                r->steps_per_second(), r->fraction_of_limit(), ratio(*r, "cudaMalloc").c_str(),
                ratio(*r, "cudaMallocAsync").c_str(), ratio(*r, "CUB").c_str(),
                ratio(*r, "pool+thrust").c_str(), mib(r->peak_reserved),
                peak_against(*r, "cudaMalloc").c_str());
  }
  if (best_peer_peak) {
    std::printf("(the best peer's peak reserved: %s, %.1f MiB)\n", best_peer.c_str(), mib(*best_peer_peak));
  }

  // The probe: where the time goes.
  bool probed = false;
  for (const row_result& r : results) {
    if (!r.ran || !r.probed) {
      continue;
    }
    if (!probed) {
      std::printf("\nprobe: one more pass per row with timing events and host clocks, per "
                  "stream-step (medians; blocked: GPU time between the stream-step's start and the "
                  "end of its allocations, i.e. waits the allocator inserted; overlap: sum of "
                  "stream-step GPU times / GPU span, 1 = one stream at a time)\n");
      std::printf("%-16s %9s %9s %12s %9s %18s %8s\n", "allocator", "steps/s", "host us",
                  "allocator us", "GPU us", "blocked us med/avg", "overlap");
      probed = true;
    }
    const probe_summary& s = *r.probed;
    std::printf("%-16s %9.1f %9.1f %12.1f %9.1f %9.1f/%-8.1f %8.2f\n", r.name.c_str(),
                s.steps_per_second, s.host_us, s.allocator_us, s.gpu_us, s.blocked_us,
                s.blocked_mean_us, s.overlap);
  }
  bool counted = false;
  for (const row_result& r : results) {
    if (!r.ran || !r.counts) {
      continue;
    }
    if (!counted) {
      std::printf("\npool counts per step over the timed passes (pool_resource::stream_stats): "
                  "blocks that crossed streams, taken because they needed no wait, event records, "
                  "queries, cudaStreamWaitEvent made and skipped (already waited), host waits, "
                  "device syncs; chunks taken/given back in all\n");
      print_counts_header();
      counted = true;
    }
    print_counts(r.name, *r.counts, opt.steps * r.rates.size());
  }

  if (!sort_ms.empty()) {
    std::printf("\nsort loop: %d x thrust::sort of %zu Ki uint32 keys on one stream, ms (median of 5)\n",
                opt.sorts, loop_sort_keys >> 10);
    const double ours_ms = sort_ms["cudamem exec_policy"];
    for (const char* name : {"thrust default (par)", "thrust par_nosync", "cudamem allocator, par",
                             "cudamem exec_policy"}) {
      std::printf("  %-26s %10.2f   exec_policy is %.2fx faster\n", name, sort_ms[name],
                  ours_ms > 0 ? sort_ms[name] / ours_ms : 0.0);
    }
  }

  // The targets for multi-stream programs, read off the tables above.
  for (const std::string& name : {std::string("pool"), std::string("vm_pool")}) {
    const row_result* r = find(name);
    if (r == nullptr) {
      continue;
    }
    const row_result* async = find("cudaMallocAsync");
    const double vs_async = async != nullptr && async->steps_per_second() > 0
                                ? r->steps_per_second() / async->steps_per_second()
                                : 0.0;
    const row_result* malloc_row = find("cudaMalloc");
    const double peak = malloc_row != nullptr && malloc_row->peak_reserved > 0
                            ? static_cast<double>(r->peak_reserved) /
                                  static_cast<double>(malloc_row->peak_reserved)
                            : 0.0;
    std::printf("\ngoals (%s): >= 0.97x the limit: %s (%.3f); >= 1.3x cudaMallocAsync: %s "
                "(%.2fx); peak reserved <= 1.2x cudaMalloc's: %s (%.2f)",
                name.c_str(), r->fraction_of_limit() >= 0.97 ? "yes" : "no", r->fraction_of_limit(),
                vs_async >= 1.3 ? "yes" : "no", vs_async, peak > 0 && peak <= 1.2 ? "yes" : "no", peak);
  }
  if (!sort_ms.empty() && sort_ms["thrust par_nosync"] > 0) {
    const double x = sort_ms["cudamem exec_policy"] / sort_ms["thrust par_nosync"];
    std::printf("\ngoal (sort loop): exec_policy at par_nosync's time: %s (%.3f of it)",
                x <= 1.02 ? "yes" : "no", x);
  }
  std::printf("\n");
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "bench_workload failed: %s\n", e.what());
  return 1;
}
