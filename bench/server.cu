// bench/server.cu — a workload of another shape than bench_workload's (many threads): a small-graph
// inference server. Many host threads, each with its own stream; each request allocates a few
// dozen tensors, runs a handful of small kernels over them, and frees them all. Requests per
// second for each allocator, against the limit (every thread's tensors made once, before
// anything is timed), measured in the same run.
//
//   ./run bench server                    # the full run: ~1-2 minutes on an H100
//   ./run bench server --quick            # a smoke run (40 requests per thread, 3 rounds)
//   options: --threads N (default 16) --requests N (per thread and pass, default 400)
//            --reps N (rounds, default 7) --touch-kib N (bytes each kernel touches per tensor,
//            default 64 KiB; 0: whole tensors) --only A,B,... (rows; `limit` always runs)
//
// The workload. `threads` host threads (16), each with a non-blocking stream of its own,
// started once and kept for the whole run (so each keeps its pool shard and its stream). A
// request, on its thread's stream:
//   - allocates 10-40 tensors (uniform), each 4 KiB - 8 MiB (log-uniform, rounded up to 256
//     bytes): about 27 MiB per request on average;
//   - runs 2-5 kernels (uniform): the first writes every tensor, each next one reads and
//     writes them (x = 0.5 x + k), each over the first `touch` bytes of every tensor (a small
//     graph at batch size 1 touches little of what it allocates: the kernels are launch-bound,
//     so the allocator's own cost shows; --touch-kib 0 makes them bandwidth-bound instead);
//   - frees every tensor, in stream order, in allocation order.
// Every request's counts and sizes are drawn before anything is timed, from fixed seeds per
// thread and request, and replayed identically for every allocator and every round.
//
// The rows (one allocator shared by all threads, as a server would have it):
//   limit            no allocator: each thread gets, before anything is timed, one buffer per
//                    tensor slot (the largest size that slot takes in its requests) and reuses
//                    them in every request (stream order keeps that safe on its own stream)
//   cudaMalloc       cudaMalloc/cudaFree (each free waits for the device): passes of 1/16 of
//                    the requests, to keep the run short; requests/s is still comparable
//   cudaMallocAsync  cudaMallocAsync/cudaFreeAsync on the thread's stream, default pool with
//                    release threshold UINT64_MAX
//   CUB              one cub::CachingDeviceAllocator(8, 3, 22, 64 GiB), the thread's stream
//   pool             one cudamem pool_resource over device_resource (shards: one per hardware
//                    thread, at most 16, so every thread has a shard of its own)
//   vm_pool          one cudamem vm_pool_resource
// (RMM is not on the GPU machine: its figures are not measured here.)
//
// Measured: requests per second over all threads: a pass is every thread serving its requests,
// from a barrier that starts them all to the last thread's cudaStreamSynchronize after its last
// request. Every row's allocator is made and warmed by one untimed pass first (memory sampled
// as in bench_workload: cudaMemGetInfo against the reading before it was made, after each
// request's allocations on thread 0, and the allocator's own count after the timed passes);
// then `reps` rounds of one timed pass per row, in an order that rotates each round. Each row:
// the median of its passes and their spread (min-max), and its rate as a fraction of the
// limit's in the same round (median and spread). For the pools, pool_resource::stream_stats()
// over the timed passes, per request (nothing should cross streams: each thread has a shard).
//
// With no GPU the program prints one line and exits 69.
#include <cudamem/device_resource.hpp>
#include <cudamem/error.hpp>
#include <cudamem/pool_resource.hpp>
#include <cudamem/vm_pool_resource.hpp>

#include "peers.hpp"
#include "traces.hpp"

#include <cub/util_allocator.cuh>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <atomic>
#include <barrier>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

using namespace cudamem_bench;

namespace {

using clock_type = std::chrono::steady_clock;

constexpr std::size_t max_tensors = 40;

// --- the plan ------------------------------------------------------------------------------------

struct request {
  std::vector<std::size_t> bytes;  ///< tensor sizes, in allocation order
  int kernels = 0;
};

/// requests[thread][k]: drawn once, before anything is timed.
using server_plan = std::vector<std::vector<request>>;

server_plan make_plan(int threads, std::size_t per_thread) {
  server_plan plan(static_cast<std::size_t>(threads));
  for (int t = 0; t < threads; ++t) {
    for (std::size_t k = 0; k < per_thread; ++k) {
      cudamem_bench::random rng(0x39'0000 + static_cast<std::uint64_t>(t) * 100003 + k);
      request r;
      const std::size_t count = 10 + rng.below(31);
      for (std::size_t i = 0; i < count; ++i) {
        r.bytes.push_back((rng.log_uniform(4 * KiB, 8 * MiB) + 255) / 256 * 256);
      }
      r.kernels = 2 + static_cast<int>(rng.below(4));
      plan[static_cast<std::size_t>(t)].push_back(std::move(r));
    }
  }
  return plan;
}

// --- the kernels ---------------------------------------------------------------------------------

/// Up to 40 tensors, passed by value (488 bytes of parameters: no copy to the device).
struct tensor_batch {
  float* data[max_tensors];
  unsigned elements[max_tensors];  ///< how many floats of each the kernel touches
  int count;
};

/// Block row y works on tensor y: step 0 writes, later steps read and write.
__global__ void touch(tensor_batch batch, int step) {
  const int t = static_cast<int>(blockIdx.y);
  if (t >= batch.count) {
    return;
  }
  float* x = batch.data[t];
  const unsigned n = batch.elements[t];
  for (unsigned i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
    x[i] = step == 0 ? 1.0f : 0.5f * x[i] + static_cast<float>(step);
  }
}

/// Runs request `r`'s kernels over `tensors` on `s`.
void run_kernels(const request& r, void* const* tensors, std::size_t touch_bytes, cudaStream_t s) {
  tensor_batch batch{};
  batch.count = static_cast<int>(r.bytes.size());
  unsigned largest = 0;
  for (std::size_t i = 0; i < r.bytes.size(); ++i) {
    batch.data[i] = static_cast<float*>(tensors[i]);
    const std::size_t bytes = touch_bytes == 0 ? r.bytes[i] : std::min(r.bytes[i], touch_bytes);
    batch.elements[i] = static_cast<unsigned>(bytes / sizeof(float));
    largest = std::max(largest, batch.elements[i]);
  }
  const dim3 grid(std::min(64U, std::max(1U, (largest + 255) / 256)), static_cast<unsigned>(batch.count));
  for (int k = 0; k < r.kernels; ++k) {
    touch<<<grid, 256, 0, s>>>(batch, k);
  }
  require(cudaPeekAtLastError(), "a server kernel launch");
}

// --- the allocators ------------------------------------------------------------------------------

/// One row: how a thread allocates and frees (thread index and its stream given).
struct server_allocator {
  std::function<void*(std::size_t bytes, int thread, cudaStream_t s)> allocate;
  std::function<void(void* p, std::size_t bytes, int thread, cudaStream_t s)> deallocate;
  std::function<void(int thread)> end_request = [](int) {};
  std::function<std::optional<std::size_t>()> own_reserved = [] { return std::nullopt; };
  std::function<std::optional<cudamem::pool_stream_stats>()> stream_stats = [] {
    return std::nullopt;
  };
  std::size_t request_divisor = 1;  ///< passes of requests / this (cudaMalloc: slow)
};

struct row_base {
  server_allocator allocator;
  row_base() = default;
  virtual ~row_base() = default;
  row_base(const row_base&) = delete;
  row_base& operator=(const row_base&) = delete;
};

struct limit_row : row_base {
  cudamem::device_resource device;
  struct thread_buffers {
    std::vector<void*> slots;
    std::vector<std::size_t> sizes;
    std::size_t next = 0;
  };
  std::vector<thread_buffers> buffers;

  explicit limit_row(const server_plan& plan) : buffers(plan.size()) {
    for (std::size_t t = 0; t < plan.size(); ++t) {
      thread_buffers& b = buffers[t];
      b.sizes.assign(max_tensors, 0);
      for (const request& r : plan[t]) {
        for (std::size_t i = 0; i < r.bytes.size(); ++i) {
          b.sizes[i] = std::max(b.sizes[i], r.bytes[i]);
        }
      }
      for (std::size_t bytes : b.sizes) {
        b.slots.push_back(bytes > 0 ? device.allocate(bytes) : nullptr);
      }
    }
    allocator.allocate = [this](std::size_t bytes, int thread, cudaStream_t) {
      thread_buffers& b = buffers[static_cast<std::size_t>(thread)];
      if (b.next >= b.slots.size() || b.sizes[b.next] < bytes) {
        std::fprintf(stderr, "bench_server: the limit row's plan does not match the requests\n");
        std::exit(1);
      }
      return b.slots[b.next++];
    };
    allocator.deallocate = [](void*, std::size_t, int, cudaStream_t) {};
    allocator.end_request = [this](int thread) { buffers[static_cast<std::size_t>(thread)].next = 0; };
    allocator.own_reserved = [this] {
      std::size_t total = 0;
      for (const thread_buffers& b : buffers) {
        for (std::size_t bytes : b.sizes) {
          total += bytes;
        }
      }
      return std::optional<std::size_t>(total);
    };
  }
  ~limit_row() override {
    require(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
    for (thread_buffers& b : buffers) {
      for (std::size_t k = 0; k < b.slots.size(); ++k) {
        if (b.slots[k] != nullptr) {
          device.deallocate(b.slots[k], b.sizes[k]);
        }
      }
    }
  }
};

struct cuda_malloc_row : row_base {
  cuda_malloc_row() {
    allocator.allocate = [](std::size_t bytes, int, cudaStream_t) {
      return cuda_malloc_worker{}.allocate(bytes);
    };
    allocator.deallocate = [](void* p, std::size_t bytes, int, cudaStream_t) {
      cuda_malloc_worker{}.deallocate(p, bytes);
    };
    allocator.request_divisor = 16;
  }
};

struct malloc_async_row : row_base {
  malloc_async_peer peer;
  malloc_async_row() {
    allocator.allocate = [](std::size_t bytes, int, cudaStream_t s) {
      return malloc_async_worker{s}.allocate(bytes);
    };
    allocator.deallocate = [](void* p, std::size_t bytes, int, cudaStream_t s) {
      malloc_async_worker{s}.deallocate(p, bytes);
    };
    allocator.own_reserved = [this] { return std::optional<std::size_t>(peer.reserved_high()); };
  }
};

struct cub_row : row_base {
  std::unique_ptr<cub::CachingDeviceAllocator> cub = make_cub_peer();
  cub_row() {
    allocator.allocate = [this](std::size_t bytes, int, cudaStream_t s) {
      return cub_worker{cub.get(), s}.allocate(bytes);
    };
    allocator.deallocate = [this](void* p, std::size_t bytes, int, cudaStream_t s) {
      cub_worker{cub.get(), s}.deallocate(p, bytes);
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

struct resource_row : row_base {
  std::unique_ptr<cudamem::memory_resource> upstream;
  std::unique_ptr<cudamem::memory_resource> mr;
  resource_row(std::unique_ptr<cudamem::memory_resource> up, std::unique_ptr<cudamem::memory_resource> top,
               std::function<std::size_t(cudamem::memory_resource&)> reserved,
               std::function<cudamem::pool_stream_stats(cudamem::memory_resource&)> counts)
      : upstream(std::move(up)), mr(std::move(top)) {
    allocator.allocate = [this](std::size_t bytes, int, cudaStream_t s) {
      return mr->allocate(bytes, 256, s);
    };
    allocator.deallocate = [this](void* p, std::size_t bytes, int, cudaStream_t s) {
      mr->deallocate(p, bytes, 256, s);
    };
    allocator.own_reserved = [this, reserved] { return std::optional<std::size_t>(reserved(*mr)); };
    allocator.stream_stats = [this, counts] {
      return std::optional<cudamem::pool_stream_stats>(counts(*mr));
    };
  }
  ~resource_row() override { require(cudaDeviceSynchronize(), "cudaDeviceSynchronize"); }
};

// --- the server's threads --------------------------------------------------------------------------

/// `count` threads started once; run(task) has every thread call task(index) once, all
/// released together, and returns the wall time from the release to the last one's end.
class worker_threads {
 public:
  explicit worker_threads(int count)
      : start_(count + 1), end_(count + 1) {
    for (int i = 0; i < count; ++i) {
      threads_.emplace_back([this, i] {
        for (;;) {
          start_.arrive_and_wait();
          if (quit_) {
            return;
          }
          try {
            task_(i);
          } catch (const std::exception& e) {
            const std::lock_guard lock(error_mutex_);
            error_ = e.what();
          }
          end_.arrive_and_wait();
        }
      });
    }
  }
  ~worker_threads() {
    quit_ = true;
    start_.arrive_and_wait();
    for (std::thread& t : threads_) {
      t.join();
    }
  }
  worker_threads(const worker_threads&) = delete;
  worker_threads& operator=(const worker_threads&) = delete;

  /// Seconds from releasing the threads to the last one finishing. Throws what a task threw.
  double run(std::function<void(int)> task) {
    task_ = std::move(task);
    error_.clear();
    start_.arrive_and_wait();
    const auto t0 = clock_type::now();
    end_.arrive_and_wait();
    const double seconds = std::chrono::duration<double>(clock_type::now() - t0).count();
    if (!error_.empty()) {
      throw std::runtime_error(error_);
    }
    return seconds;
  }

 private:
  std::barrier<> start_;
  std::barrier<> end_;
  std::function<void(int)> task_;
  std::atomic<bool> quit_{false};
  std::mutex error_mutex_;
  std::string error_;
  std::vector<std::thread> threads_;
};

struct device_usage {
  std::size_t baseline = 0;
  std::atomic<std::size_t> peak{0};
  static std::size_t used_now() {
    std::size_t free = 0;
    std::size_t total = 0;
    require(cudaMemGetInfo(&free, &total), "cudaMemGetInfo");
    return total - free;
  }
  void sample() {
    const std::size_t used = used_now();
    const std::size_t d = used > baseline ? used - baseline : 0;
    std::size_t seen = peak.load();
    while (d > seen && !peak.compare_exchange_weak(seen, d)) {
    }
  }
};

struct settings {
  int threads = 16;
  std::size_t requests = 400;
  int reps = 7;
  std::size_t touch_bytes = 64 * KiB;
  std::vector<std::string> only;
  [[nodiscard]] bool wants(const std::string& name) const {
    return only.empty() || std::find(only.begin(), only.end(), name) != only.end();
  }
};

/// One pass of every thread's requests through `a`; returns requests per second.
double run_pass(worker_threads& workers, server_allocator& a, const server_plan& plan,
                const settings& o, const std::vector<cudaStream_t>& streams, device_usage* usage) {
  const std::size_t per_thread = std::max<std::size_t>(1, o.requests / a.request_divisor);
  const double seconds = workers.run([&](int t) {
    const cudaStream_t s = streams[static_cast<std::size_t>(t)];
    const std::vector<request>& mine = plan[static_cast<std::size_t>(t)];
    void* tensors[max_tensors];
    for (std::size_t k = 0; k < per_thread; ++k) {
      const request& r = mine[k];
      for (std::size_t i = 0; i < r.bytes.size(); ++i) {
        tensors[i] = a.allocate(r.bytes[i], t, s);
      }
      if (usage != nullptr && t == 0) {
        usage->sample();
      }
      run_kernels(r, tensors, o.touch_bytes, s);
      for (std::size_t i = 0; i < r.bytes.size(); ++i) {
        a.deallocate(tensors[i], r.bytes[i], t, s);
      }
      a.end_request(t);
    }
    require(cudaStreamSynchronize(s), "cudaStreamSynchronize after the requests");
  });
  return static_cast<double>(per_thread) * static_cast<double>(o.threads) / seconds;
}

struct row_result {
  std::string name;
  bool ran = false;
  std::string note;
  std::vector<double> rates;
  std::vector<double> limit_fractions;
  std::size_t peak_reserved = 0;
  std::optional<std::size_t> own_reserved;
  std::optional<cudamem::pool_stream_stats> counts;
  std::size_t timed_requests = 0;
};

struct row_spec {
  std::string name;
  std::function<std::unique_ptr<row_base>()> make;
};

settings parse(int argc, char** argv) {
  settings o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--quick") {
      o.requests = 40;
      o.reps = 3;
    } else if (a == "--threads" && i + 1 < argc) {
      o.threads = std::max(1, std::atoi(argv[++i]));
    } else if (a == "--requests" && i + 1 < argc) {
      o.requests = static_cast<std::size_t>(std::max(1, std::atoi(argv[++i])));
    } else if (a == "--reps" && i + 1 < argc) {
      o.reps = std::max(1, std::atoi(argv[++i]));
    } else if (a == "--touch-kib" && i + 1 < argc) {
      o.touch_bytes = static_cast<std::size_t>(std::max(0, std::atoi(argv[++i]))) * KiB;
    } else if (a == "--only" && i + 1 < argc) {
      std::stringstream names(argv[++i]);
      for (std::string name; std::getline(names, name, ',');) {
        if (!name.empty()) {
          o.only.push_back(name);
        }
      }
    } else {
      std::fprintf(stderr,
                   "usage: bench_server [--quick] [--threads N] [--requests N] [--reps N] "
                   "[--touch-kib N] [--only A,B,...]\n"
                   "rows: limit cudaMalloc cudaMallocAsync CUB pool vm_pool\n");
      std::exit(2);
    }
  }
  return o;
}

std::string spread(const std::vector<double>& v, int digits) {
  if (v.empty()) {
    return "-";
  }
  const auto [lo, hi] = std::minmax_element(v.begin(), v.end());
  char text[96];
  std::snprintf(text, sizeof text, "%.*f (%.*f-%.*f)", digits, median(v), digits, *lo, digits, *hi);
  return text;
}

double mib(std::size_t bytes) { return static_cast<double>(bytes) / static_cast<double>(MiB); }

}  // namespace

int main(int argc, char** argv) try {
  const settings o = parse(argc, argv);
  int devices = 0;
  const cudaError_t found = cudaGetDeviceCount(&devices);
  if (found != cudaSuccess || devices == 0) {
    std::printf("SKIPPED: no CUDA device (%s): bench_server needs a GPU\n",
                found != cudaSuccess ? cudaGetErrorName(found) : "0 devices");
    return 69;
  }
  require(cudaSetDevice(0), "cudaSetDevice");
  cudaDeviceProp prop{};
  require(cudaGetDeviceProperties(&prop, 0), "cudaGetDeviceProperties");

  const server_plan plan = make_plan(o.threads, o.requests);
  double mean_tensors = 0;
  double mean_bytes = 0;
  for (const auto& mine : plan) {
    for (const request& r : mine) {
      mean_tensors += static_cast<double>(r.bytes.size());
      for (std::size_t b : r.bytes) {
        mean_bytes += static_cast<double>(b);
      }
    }
  }
  const double total_requests = static_cast<double>(o.threads) * static_cast<double>(o.requests);
  std::printf("bench_server: %s; %d threads, each its own stream; %zu requests per thread and pass, "
              "each %.1f tensors (%.1f MiB) on average, 2-5 kernels touching %s of each tensor\n",
              prop.name, o.threads, o.requests, mean_tensors / total_requests,
              mean_bytes / total_requests / static_cast<double>(MiB),
              o.touch_bytes == 0 ? "all" : (std::to_string(o.touch_bytes / KiB) + " KiB").c_str());
  std::printf("every row made and warmed by one untimed pass, then %d rounds of one timed pass per "
              "row in rotating order; medians and spread (min-max)\n\n", o.reps);

  std::vector<cudaStream_t> streams(static_cast<std::size_t>(o.threads));
  for (auto& s : streams) {
    require(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
  }
  {  // the kernel once before any row (lazy loading)
    void* warm = nullptr;
    require(cudaMalloc(&warm, MiB), "cudaMalloc (warm-up)");
    request r;
    r.bytes = {MiB};
    r.kernels = 2;
    run_kernels(r, &warm, 0, streams[0]);
    require(cudaStreamSynchronize(streams[0]), "cudaStreamSynchronize (warm-up)");
    require(cudaFree(warm), "cudaFree (warm-up)");
  }

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
  const std::vector<row_spec> all = {
      {"limit", [&] { return std::make_unique<limit_row>(plan); }},  // first: the reference
      {"cudaMalloc", [] { return std::make_unique<cuda_malloc_row>(); }},
      {"cudaMallocAsync", [] { return std::make_unique<malloc_async_row>(); }},
      {"CUB", [] { return std::make_unique<cub_row>(); }},
      {"pool",
       [&]() -> std::unique_ptr<row_base> {
         auto device = std::make_unique<cudamem::device_resource>(0);
         std::unique_ptr<cudamem::memory_resource> pool = std::make_unique<cudamem::pool_resource>(*device);
         return std::make_unique<resource_row>(std::move(device), std::move(pool), pool_reserved,
                                               pool_counts);
       }},
      {"vm_pool",
       [&]() -> std::unique_ptr<row_base> {
         return std::make_unique<resource_row>(nullptr, std::make_unique<cudamem::vm_pool_resource>(0),
                                               vm_mapped, vm_counts);
       }},
  };
  std::vector<row_spec> specs;
  for (const row_spec& spec : all) {
    if (spec.name == "limit" || o.wants(spec.name)) {
      specs.push_back(spec);
    }
  }

  worker_threads workers(o.threads);
  // CUDA's context is made current on each worker at its first call; do it now, untimed.
  workers.run([&](int) { require(cudaSetDevice(0), "cudaSetDevice (worker)"); });

  const std::size_t n = specs.size();
  std::vector<row_result> results(n);
  std::vector<std::unique_ptr<row_base>> rows(n);
  std::vector<cudamem::pool_stream_stats> counts_before(n);
  for (std::size_t r = 0; r < n; ++r) {
    results[r].name = specs[r].name;
    require(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
    device_usage usage;
    usage.baseline = device_usage::used_now();
    try {
      rows[r] = specs[r].make();
      run_pass(workers, rows[r]->allocator, plan, o, streams, &usage);
      results[r].peak_reserved = usage.peak.load();
      if (auto c = rows[r]->allocator.stream_stats()) {
        counts_before[r] = *c;
      }
      results[r].ran = true;
    } catch (const std::exception& e) {
      results[r].note = e.what();
      rows[r].reset();
    }
    std::printf("  made and warmed: %s\n", specs[r].name.c_str());
    std::fflush(stdout);
  }
  for (int round = 0; round < o.reps; ++round) {
    std::vector<double> rate(n, 0.0);
    for (std::size_t k = 0; k < n; ++k) {
      const std::size_t r = (k + static_cast<std::size_t>(round)) % n;
      if (!rows[r]) {
        continue;
      }
      try {
        rate[r] = run_pass(workers, rows[r]->allocator, plan, o, streams, nullptr);
        results[r].rates.push_back(rate[r]);
        results[r].timed_requests += std::max<std::size_t>(1, o.requests / rows[r]->allocator.request_divisor) *
                                     static_cast<std::size_t>(o.threads);
      } catch (const std::exception& e) {
        results[r].note = e.what();
        results[r].ran = false;
        rows[r].reset();
      }
    }
    for (std::size_t r = 0; r < n; ++r) {
      if (rate[r] > 0 && rate[0] > 0) {
        results[r].limit_fractions.push_back(rate[r] / rate[0]);
      }
    }
    std::printf("  round %d of %d done\n", round + 1, o.reps);
    std::fflush(stdout);
  }
  for (std::size_t r = 0; r < n; ++r) {
    if (!rows[r]) {
      continue;
    }
    if (auto c = rows[r]->allocator.stream_stats()) {
      results[r].counts = difference(*c, counts_before[r]);
    }
    results[r].own_reserved = rows[r]->allocator.own_reserved();
    if (results[r].own_reserved) {
      results[r].peak_reserved = std::max(results[r].peak_reserved, *results[r].own_reserved);
    }
  }
  for (std::size_t r = n; r-- > 0;) {
    rows[r].reset();
  }
  for (cudaStream_t s : streams) {
    require(cudaStreamDestroy(s), "cudaStreamDestroy");
  }

  std::printf("\n=== bench_server: results (%s) ===\n", prop.name);
  std::printf("%-16s %28s %24s %14s %14s\n", "allocator", "requests/s median (min-max)",
              "x limit median (min-max)", "peak res. MiB", "own count MiB");
  std::map<std::string, const row_result*> by_name;
  for (const row_result& r : results) {
    if (!r.ran || r.rates.empty()) {
      std::printf("%-16s %28s %24s %14s %14s  (%s)\n", r.name.c_str(), "-", "-", "-", "-", r.note.c_str());
      continue;
    }
    by_name[r.name] = &r;
    char own[32] = "-";
    if (r.own_reserved) {
      std::snprintf(own, sizeof own, "%.1f", mib(*r.own_reserved));
    }
    std::printf("%-16s %28s %24s %14.1f %14s\n", r.name.c_str(), spread(r.rates, 0).c_str(),
                spread(r.limit_fractions, 3).c_str(), mib(r.peak_reserved), own);
  }
  bool header = false;
  for (const row_result& r : results) {
    if (!r.counts || r.timed_requests == 0) {
      continue;
    }
    if (!header) {
      std::printf("\npool counts per 1,000 requests over the timed passes (stream_stats): crossed "
                  "streams, stream waits, event records, device syncs; chunks taken/given back in all\n");
      header = true;
    }
    const double per = 1000.0 / static_cast<double>(r.timed_requests);
    std::printf("%-16s crossed %.2f  waits %.2f  records %.2f  device syncs %.2f  chunks %llu/%llu\n",
                r.name.c_str(), per * static_cast<double>(r.counts->cross_stream_blocks),
                per * static_cast<double>(r.counts->stream_waits),
                per * static_cast<double>(r.counts->event_records),
                per * static_cast<double>(r.counts->device_syncs),
                static_cast<unsigned long long>(r.counts->upstream_allocations),
                static_cast<unsigned long long>(r.counts->upstream_returns));
  }
  const auto median_of = [&](const std::string& name) {
    const auto it = by_name.find(name);
    return it != by_name.end() ? median(it->second->rates) : 0.0;
  };
  for (const std::string& name : {std::string("pool"), std::string("vm_pool")}) {
    const auto it = by_name.find(name);
    if (it == by_name.end()) {
      continue;
    }
    const double fraction = median(it->second->limit_fractions);
    const double async = median_of("cudaMallocAsync");
    const double cub = median_of("CUB");
    std::printf("\ngoal (%s): >= 0.95x the limit: %s (%.3f); x cudaMallocAsync %.2f; x CUB %.2f",
                name.c_str(), fraction >= 0.95 ? "yes" : "no", fraction,
                async > 0 ? median(it->second->rates) / async : 0.0,
                cub > 0 ? median(it->second->rates) / cub : 0.0);
  }
  std::printf("\n");
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "bench_server failed: %s\n", e.what());
  return 1;
}
