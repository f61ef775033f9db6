// bench/workload.cu — what a program that runs kernels gains from cudamem: a training-step-like
// loop on 4 streams, the same kernels and sizes for every allocator, measured in one run; then
// a loop of small thrust sorts, thrust's default temporaries against exec_policy.
//
//   ./run bench workload                  # the full run: ~1-2 minutes on an H100
//   ./run bench workload --quick          # a smoke run (30 steps, 3 reps, 200 sorts)
//   options: --steps N (default 200) --reps N (default 5) --sorts N (default 1000)
//            --only NAME (one row: cudaMalloc, cudaMallocAsync, CUB, pool+thrust, pool,
//            vm_pool, arena; or `sort` for the sort loop alone)
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
// The rows (the peers of DESIGN.md, then ours):
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
//   vm_pool          the same over cudamem vm_pool_resource
//   arena            one cudamem arena_resource per stream (over cudaMalloc'd chunks of
//                    160 MiB), rewound after every stream-step by an arena_scope: allocation is
//                    a pointer bump and the stream-step's frees cost nothing
//
// Measured: steps per second (a step = one stream-step on each of the 4 streams), wall time
// from the first allocation to the end of a cudaDeviceSynchronize after the last step; median
// of the repetitions, which follow one untimed pass (so caches and pools are warm: the steady
// state). Peak reserved: how much device memory the allocator held at most, measured the same
// way for every row — from cudaMemGetInfo (total - free) minus the same reading taken before
// the allocator was made, sampled right after each stream-step's allocations (its live set is
// largest there) during the untimed pass, and once more after the timed passes (caching
// allocators still hold whatever those took). cudaMemGetInfo is used because it is the one count
// every allocator is subject to (cudaMalloc has no counter of its own; CUB rounds to bins; the
// driver's pools and vm_pool map memory in their own granules); each allocator's own count is
// printed beside it where it has one, as a cross-check. Sampling is kept out of the timed reps.
//
// Then the sort loop: thrust::sort of 64 Ki uint32 keys, `sorts` times in a row on one stream
// (the same buffer: radix sort does the same passes whatever the order), timed from the first
// call to a stream synchronisation after the last; median of 5 repetitions after a warm-up,
// for thrust's default policy (par.on(s)), par_nosync.on(s) (cudaMallocAsync temporaries),
// thrust's par with cudamem's temporary allocator (pool temporaries, but thrust still waits
// for the stream after each sort), and cudamem::exec_policy.
//
// Every allocator is destroyed (its memory given back) before the next one starts. With no GPU
// the program prints one line and exits 69.
#include <cudamem/arena_resource.hpp>
#include <cudamem/device_resource.hpp>
#include <cudamem/error.hpp>
#include <cudamem/exec_policy.hpp>
#include <cudamem/pool_resource.hpp>
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

/// Runs `count` steps of the plan (from step 0); samples device memory when `usage` is given.
void run_steps(workload_allocator& a, const plan& p, std::size_t count,
               const std::array<cudaStream_t, stream_count>& streams, device_usage* usage) {
  std::vector<void*> tensors;
  for (std::size_t step = 0; step < count; ++step) {
    for (int i = 0; i < stream_count; ++i) {
      const cudaStream_t s = streams[static_cast<std::size_t>(i)];
      const stream_step& plan_here = p.steps[step][static_cast<std::size_t>(i)];
      tensors.clear();
      for (std::size_t bytes : plan_here.tensor_bytes) {
        tensors.push_back(a.allocate(bytes, i));
      }
      auto* keys = static_cast<std::uint32_t*>(a.allocate(step_sort_keys * sizeof(std::uint32_t), i));
      if (usage != nullptr) {
        usage->sample();
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
      a.sort(keys, step_sort_keys, i);
      a.deallocate(keys, step_sort_keys * sizeof(std::uint32_t), i);
      for (std::size_t k = 0; k < tensors.size(); ++k) {
        a.deallocate(tensors[k], plan_here.tensor_bytes[k], i);
      }
      a.end_stream_step(i);
    }
  }
  require(cudaDeviceSynchronize(), "cudaDeviceSynchronize after the steps");
}

struct row_result {
  std::string name;
  double steps_per_second = 0;
  std::size_t peak_reserved = 0;
  std::optional<std::size_t> own_reserved;
  bool ran = false;
  std::string note;
};

/// The untimed pass (memory sampled), then `reps` timed passes; the allocator made by `make`
/// lives through all of them and is destroyed before this returns.
template <class Make>
row_result measure_row(const std::string& name, const plan& p, std::size_t steps, int reps,
                       const std::array<cudaStream_t, stream_count>& streams, Make&& make) {
  row_result r;
  r.name = name;
  require(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  device_usage usage;
  usage.baseline = device_usage::used_now();
  try {
    auto holder = make();  // owns the allocator's state; .allocator is the row's interface
    workload_allocator& a = holder->allocator;
    run_steps(a, p, steps, streams, &usage);
    r.peak_reserved = usage.peak;
    r.own_reserved = a.own_reserved();
    std::vector<double> rates;
    for (int rep = 0; rep < reps; ++rep) {
      const auto start = clock_type::now();
      run_steps(a, p, steps, streams, nullptr);
      const double seconds = std::chrono::duration<double>(clock_type::now() - start).count();
      rates.push_back(static_cast<double>(steps) / seconds);
    }
    r.steps_per_second = median(rates);
    // Caching allocators never give memory back while they live, so memory taken during the
    // timed passes is still held now: one more reading (and the own count) covers them too.
    usage.sample();
    r.peak_reserved = usage.peak;
    r.own_reserved = a.own_reserved();
    r.ran = true;
  } catch (const std::exception& e) {
    r.note = e.what();
  }
  require(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  return r;
}

// --- each row's state -------------------------------------------------------------------------------

struct cuda_malloc_row {
  workload_allocator allocator;
  explicit cuda_malloc_row(const std::array<cudaStream_t, stream_count>& streams) {
    allocator.allocate = [](std::size_t bytes, int) { return cuda_malloc_worker{}.allocate(bytes); };
    allocator.deallocate = [](void* p, std::size_t bytes, int) { cuda_malloc_worker{}.deallocate(p, bytes); };
    allocator.sort = [streams](std::uint32_t* keys, std::size_t n, int i) {
      thrust::sort(thrust::cuda::par.on(streams[static_cast<std::size_t>(i)]), keys, keys + n);
    };
  }
};

struct malloc_async_row {
  malloc_async_peer peer;  // threshold UINT64_MAX now; sync and trim at the end of the row
  workload_allocator allocator;
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

struct cub_row {
  std::unique_ptr<cub::CachingDeviceAllocator> cub = make_cub_peer();
  workload_allocator allocator;
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
  ~cub_row() {
    require(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
    require(cub->FreeAllCached(), "CUB FreeAllCached");
  }
  cub_row(const cub_row&) = delete;
  cub_row& operator=(const cub_row&) = delete;
};

/// Tensors from a cudamem resource; the sort under exec_policy, or thrust's default policy.
struct resource_row {
  std::unique_ptr<cudamem::memory_resource> upstream;
  std::unique_ptr<cudamem::memory_resource> mr;
  workload_allocator allocator;
  resource_row(std::unique_ptr<cudamem::memory_resource> up, std::unique_ptr<cudamem::memory_resource> top,
               const std::array<cudaStream_t, stream_count>& streams, bool thrust_default_sort,
               std::function<std::size_t(cudamem::memory_resource&)> reserved)
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
  }
  ~resource_row() {
    if (mr) {
      require(cudaDeviceSynchronize(), "cudaDeviceSynchronize");  // frees are stream-ordered
    }
  }
  resource_row(const resource_row&) = delete;
  resource_row& operator=(const resource_row&) = delete;
};

/// One arena per stream over cudaMalloc'd chunks, rewound after each of its stream-steps.
struct arena_row {
  cudamem::device_resource device;
  std::vector<std::unique_ptr<cudamem::arena_resource>> arenas;
  std::vector<cudamem::arena_mark> marks;
  workload_allocator allocator;
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
  ~arena_row() {
    require(cudaDeviceSynchronize(), "cudaDeviceSynchronize");  // before the chunks go back
  }
  arena_row(const arena_row&) = delete;
  arena_row& operator=(const arena_row&) = delete;
};

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
  int reps = 5;
  int sorts = 1000;
  std::string only;
};

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
      o.only = argv[++i];
    } else {
      std::fprintf(stderr,
                   "usage: bench_workload [--quick] [--steps N] [--reps N] [--sorts N] [--only NAME]\n");
      std::exit(2);
    }
  }
  return o;
}

double mib(std::size_t bytes) { return static_cast<double>(bytes) / static_cast<double>(MiB); }

}  // namespace

int main(int argc, char** argv) try {
  const options opt = parse(argc, argv);
  int devices = 0;
  const cudaError_t probe = cudaGetDeviceCount(&devices);
  if (probe != cudaSuccess || devices == 0) {
    std::printf("SKIPPED: no CUDA device (%s): bench_workload needs a GPU\n",
                probe != cudaSuccess ? cudaGetErrorName(probe) : "0 devices");
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
  std::printf("%zu steps per pass, median of %d timed passes after one untimed (memory-sampled) pass\n\n",
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
  struct row_spec {
    std::string name;
    std::function<row_result()> run;
  };
  const std::vector<row_spec> specs = {
      {"cudaMalloc",
       [&] { return measure_row("cudaMalloc", p, opt.steps, opt.reps, streams,
                                [&] { return std::make_unique<cuda_malloc_row>(streams); }); }},
      {"cudaMallocAsync",
       [&] { return measure_row("cudaMallocAsync", p, opt.steps, opt.reps, streams,
                                [&] { return std::make_unique<malloc_async_row>(streams); }); }},
      {"CUB",
       [&] { return measure_row("CUB", p, opt.steps, opt.reps, streams,
                                [&] { return std::make_unique<cub_row>(streams); }); }},
      {"pool+thrust",
       [&] {
         return measure_row("pool+thrust", p, opt.steps, opt.reps, streams, [&] {
           auto device = std::make_unique<cudamem::device_resource>(0);
           resource_ptr pool = std::make_unique<cudamem::pool_resource>(*device);
           return std::make_unique<resource_row>(std::move(device), std::move(pool), streams, true,
                                                 pool_reserved);
         });
       }},
      {"pool",
       [&] {
         return measure_row("pool", p, opt.steps, opt.reps, streams, [&] {
           auto device = std::make_unique<cudamem::device_resource>(0);
           resource_ptr pool = std::make_unique<cudamem::pool_resource>(*device);
           return std::make_unique<resource_row>(std::move(device), std::move(pool), streams, false,
                                                 pool_reserved);
         });
       }},
      {"vm_pool",
       [&] {
         return measure_row("vm_pool", p, opt.steps, opt.reps, streams, [&] {
           return std::make_unique<resource_row>(nullptr, std::make_unique<cudamem::vm_pool_resource>(0),
                                                 streams, false, vm_mapped);
         });
       }},
      {"arena",
       [&] { return measure_row("arena", p, opt.steps, opt.reps, streams,
                                [&] { return std::make_unique<arena_row>(streams); }); }},
  };

  std::map<std::string, row_result> rows;
  std::printf("%-16s %12s %20s %18s\n", "allocator", "steps/s", "peak reserved MiB", "own count MiB");
  for (const row_spec& spec : specs) {
    if (!opt.only.empty() && spec.name != opt.only) {
      continue;
    }
    const row_result r = spec.run();
    rows[r.name] = r;
    if (!r.ran) {
      std::printf("%-16s %12s %20s %18s  (%s)\n", r.name.c_str(), "-", "-", "-", r.note.c_str());
      continue;
    }
    char own[32] = "-";
    if (r.own_reserved) {
      std::snprintf(own, sizeof own, "%.1f", mib(*r.own_reserved));
    }
    std::printf("%-16s %12.1f %20.1f %18s\n", r.name.c_str(), r.steps_per_second,
                mib(r.peak_reserved), own);
    std::fflush(stdout);
  }

  // --- the sort loop ---
  std::map<std::string, double> sort_ms;
  if (opt.only.empty() || opt.only == "sort") {
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

  // --- the final table ---
  std::printf("\n=== bench_workload: results (%s) ===\n", prop.name);
  const std::vector<std::string> peers = {"cudaMalloc", "cudaMallocAsync", "CUB"};
  const std::vector<std::string> ours = {"pool", "vm_pool", "arena"};
  std::optional<std::size_t> best_peer_peak;
  std::string best_peer;
  for (const std::string& name : peers) {
    const auto it = rows.find(name);
    if (it != rows.end() && it->second.ran &&
        (!best_peer_peak || it->second.peak_reserved < *best_peer_peak)) {
      best_peer_peak = it->second.peak_reserved;
      best_peer = name;
    }
  }
  std::printf("%-10s %10s %14s %17s %10s %14s %13s %14s\n", "ours", "steps/s", "x cudaMalloc",
              "x cudaMallocAsync", "x CUB", "x pool+thrust", "peak MiB", "peak / best");
  const auto ratio = [&](const row_result& r, const std::string& peer) {
    const auto it = rows.find(peer);
    if (it == rows.end() || !it->second.ran || it->second.steps_per_second <= 0) {
      return std::string("-");
    }
    char text[32];
    std::snprintf(text, sizeof text, "%.2fx", r.steps_per_second / it->second.steps_per_second);
    return std::string(text);
  };
  for (const std::string& name : ours) {
    const auto it = rows.find(name);
    if (it == rows.end() || !it->second.ran) {
      continue;
    }
    const row_result& r = it->second;
    char peak_vs_best[48] = "-";
    if (best_peer_peak && *best_peer_peak > 0) {
      std::snprintf(peak_vs_best, sizeof peak_vs_best, "%.2f (%s)",
                    static_cast<double>(r.peak_reserved) / static_cast<double>(*best_peer_peak),
                    best_peer.c_str());
    }
    std::printf("%-10s %10.1f %14s %17s %10s %14s %13.1f %14s\n", name.c_str(), r.steps_per_second,
                ratio(r, "cudaMalloc").c_str(), ratio(r, "cudaMallocAsync").c_str(),
                ratio(r, "CUB").c_str(), ratio(r, "pool+thrust").c_str(), mib(r.peak_reserved),
                peak_vs_best);
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

  // The issue's goals, read off the table above (the pool row).
  const auto pool = rows.find("pool");
  if (pool != rows.end() && pool->second.ran) {
    const auto speedup = [&](const std::string& peer) {
      const auto it = rows.find(peer);
      return it != rows.end() && it->second.ran && it->second.steps_per_second > 0
                 ? pool->second.steps_per_second / it->second.steps_per_second
                 : 0.0;
    };
    const double vs_malloc = speedup("cudaMalloc");
    const double vs_async = speedup("cudaMallocAsync");
    const double peak_ratio = best_peer_peak && *best_peer_peak > 0
                                  ? static_cast<double>(pool->second.peak_reserved) /
                                        static_cast<double>(*best_peer_peak)
                                  : 0.0;
    std::printf("\ngoals (pool): >= 2x cudaMalloc steps/s: %s (%.2fx); >= 1.2x cudaMallocAsync: %s "
                "(%.2fx); peak reserved within 10%% of the best peer (%s): %s (%.2f)\n",
                vs_malloc >= 2.0 ? "yes" : "no", vs_malloc, vs_async >= 1.2 ? "yes" : "no", vs_async,
                best_peer.empty() ? "-" : best_peer.c_str(), peak_ratio > 0 && peak_ratio <= 1.1 ? "yes" : "no",
                peak_ratio);
  }
  if (!sort_ms.empty() && sort_ms["cudamem exec_policy"] > 0) {
    const double x = sort_ms["thrust default (par)"] / sort_ms["cudamem exec_policy"];
    std::printf("goal (sort loop): exec_policy >= 3x thrust's default: %s (%.2fx)\n",
                x >= 3.0 ? "yes" : "no", x);
  }
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "bench_workload failed: %s\n", e.what());
  return 1;
}
