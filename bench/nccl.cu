// bench/nccl.cu — NCCL all-reduce over registered and unregistered buffers, and what
// registering a pool's chunks (cudamem/nccl.hpp) saves in registrations.
//
//   ./run bench nccl [--rounds R] [--min-mib M] [--max-mib M] [--gpus N] [--legacy-register]
//                    [--skip-bandwidth]
//
// One process, one rank per GPU (ncclCommInitAll over the first N visible GPUs, all by
// default), NCCL_NVLS_ENABLE=0 unless set: NVLink multicast stays off. Two parts:
//
// 1. Bus bandwidth of an out-of-place float sum all-reduce, M = 1 MiB .. 1 GiB (doubling), on
//    every rank over, in the same run:
//      cudaMalloc       cudaMalloc'd send and receive buffers, not registered
//      cudaMalloc+reg   the same, each registered (ncclCommRegister). NCCL 2.24+ uses such a
//                       registration only with NCCL_LEGACY_CUDA_REGISTER=1 (--legacy-register
//                       sets it; the program prints what NCCL sees)
//      ncclMemAlloc+reg ncclMemAlloc'd buffers, each registered: NCCL's documented way
//      pool             blocks of a pool_resource over nccl_mem_resource, its chunks registered
//                       by an nccl_registering_adaptor (registered once, when made)
//      vm_pool          blocks of a vm_pool_resource with nccl_vm_pool_options (chunks and
//                       blocks of a 64 MiB handle or more registered as they are made)
//      nccl_pool        blocks of an nccl_pool (nccl_pool.hpp): 8-256 MiB from a pool of
//                       registered ncclMemAlloc chunks, other sizes from a plain cudaMalloc pool
//    Each round times one batch of each variant, in an order that rotates from round to round;
//    a batch is back-to-back all-reduces (one NCCL group per all-reduce over the ranks) timed
//    with events on every rank's stream, the slowest rank's time counting. Bus bandwidth =
//    bytes x 2 (n - 1) / n / time (NCCL's tests' definition); with one rank that factor is 0,
//    so the program says bus bandwidth is not meaningful and prints algorithm bandwidth
//    (bytes / time: a device copy) instead. Medians over rounds; the ratio pool / best is the
//    median over rounds of pool / (the best of the other variants in that round); likewise for
//    vm_pool and nccl_pool. Target: pooled blocks >= 0.98 x the best of the others
//    at every size; judged on nccl_pool, cudamem's stack for NCCL buffers (the pool of
//    registered chunks alone follows NCCL's registered path at every size, slower at some).
//    Each variant's first all-reduce (outside the timing) pays NCCL's lazy registration work.
//
// 2. Registrations per 1,000 allocations, on rank 0: a trace of 1,000 allocations, sizes
//    log-uniform 256 KiB .. 256 MiB, each freed again with probability 0.45 per step (a
//    uniformly chosen live one) while under 4 GiB live, all freed at the end (fixed seed),
//    through: ncclMemAlloc + ncclCommRegister per buffer; the registered pool; the registered
//    vm_pool; the nccl_pool. Prints the registrations made and the host time per allocation + free. Then the
//    cost of one ncclCommRegister + ncclCommDeregister pair (median of 200), and of the first
//    all-reduce on freshly registered buffers against the next ones (NCCL maps a registered
//    buffer for its peers on first use; one rank has no peers).
#include <cudamem/device.hpp>
#include <cudamem/device_buffer.hpp>
#include <cudamem/device_resource.hpp>
#include <cudamem/event.hpp>
#include <cudamem/nccl.hpp>
#include <cudamem/nccl_pool.hpp>
#include <cudamem/pool_resource.hpp>
#include <cudamem/stream.hpp>
#include <cudamem/vm_pool_resource.hpp>

#include "median.hpp"

#include <nccl.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <vector>

namespace {

constexpr std::size_t MiB = std::size_t{1} << 20;

using cudamem_bench::median;

std::string size_name(std::size_t bytes) {
  return bytes >= (std::size_t{1} << 30) ? std::to_string(bytes >> 30) + " GiB"
                                         : std::to_string(bytes >> 20) + " MiB";
}

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

struct options {
  int rounds = 7;
  std::size_t min_bytes = MiB;
  std::size_t max_bytes = std::size_t{1} << 30;
  int gpus = 0;  // 0: all
  bool legacy_register = false;
  bool bandwidth = true;
};

options parse(int argc, char** argv) {
  options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    const auto next = [&]() -> long long {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "bench_nccl: %s needs a value\n", a.c_str());
        std::exit(2);
      }
      return std::atoll(argv[++i]);
    };
    if (a == "--rounds") {
      o.rounds = static_cast<int>(std::max(3LL, next()));
    } else if (a == "--min-mib") {
      o.min_bytes = static_cast<std::size_t>(std::max(1LL, next())) * MiB;
    } else if (a == "--max-mib") {
      o.max_bytes = static_cast<std::size_t>(std::max(1LL, next())) * MiB;
    } else if (a == "--gpus") {
      o.gpus = static_cast<int>(std::max(1LL, next()));
    } else if (a == "--legacy-register") {
      o.legacy_register = true;
    } else if (a == "--skip-bandwidth") {
      o.bandwidth = false;
    } else {
      std::fprintf(stderr,
                   "usage: bench_nccl [--rounds R] [--min-mib M] [--max-mib M] [--gpus N] "
                   "[--legacy-register] [--skip-bandwidth]\n");
      std::exit(2);
    }
  }
  return o;
}

// --- the variants ---------------------------------------------------------------------------

/// Send and receive buffers on every rank, of one kind; `prepare(bytes)` makes them.
class variant {
 public:
  explicit variant(std::string name) : name_(std::move(name)) {}
  virtual ~variant() = default;
  variant(const variant&) = delete;
  variant& operator=(const variant&) = delete;

  [[nodiscard]] const std::string& name() const { return name_; }
  /// Buffers of `bytes` on every rank, ready (filled) once the streams are synchronised.
  void prepare(std::size_t bytes, std::vector<cudamem::stream>& streams) {
    release();
    const std::size_t count = bytes / sizeof(float);
    for (std::size_t r = 0; r < streams.size(); ++r) {
      const cudamem::device_guard on{static_cast<int>(r)};
      send_.emplace_back(count, 1.0f, streams[r], memory_resource_for(r));
      recv_.emplace_back(count, cudamem::zero_fill, streams[r], memory_resource_for(r));
      after_allocation(r, bytes);
    }
  }
  /// Frees the buffers (the caller has synchronised: nothing uses them).
  void release() {
    registrations_.clear();  // deregistered before the memory goes
    send_.clear();
    recv_.clear();
  }
  [[nodiscard]] float* send(std::size_t r) { return send_[r].data(); }
  [[nodiscard]] float* recv(std::size_t r) { return recv_[r].data(); }

 protected:
  virtual cudamem::memory_resource& memory_resource_for(std::size_t rank) = 0;
  virtual void after_allocation(std::size_t /*rank*/, std::size_t /*bytes*/) {}
  std::vector<cudamem::nccl_registration> registrations_;
  std::vector<cudamem::device_buffer<float>> send_;
  std::vector<cudamem::device_buffer<float>> recv_;

 private:
  std::string name_;
};

/// Buffers straight from an upstream per rank; registered one by one when `register_each`.
class plain_variant final : public variant {
 public:
  plain_variant(std::string name, std::vector<std::unique_ptr<cudamem::memory_resource>> upstreams,
                const std::vector<cudamem::nccl_communicator>* register_with)
      : variant(std::move(name)), upstreams_(std::move(upstreams)), comms_(register_with) {}
  ~plain_variant() override { release(); }

 private:
  cudamem::memory_resource& memory_resource_for(std::size_t rank) override {
    return *upstreams_[rank];
  }
  void after_allocation(std::size_t rank, std::size_t bytes) override {
    if (comms_ != nullptr) {
      registrations_.emplace_back((*comms_)[rank].get(), send_.back().data(), bytes);
      registrations_.emplace_back((*comms_)[rank].get(), recv_.back().data(), bytes);
    }
  }
  std::vector<std::unique_ptr<cudamem::memory_resource>> upstreams_;
  const std::vector<cudamem::nccl_communicator>* comms_;
};

/// Blocks of a registered pool_resource per rank (nccl_mem_resource -> adaptor -> pool).
class pool_variant final : public variant {
 public:
  explicit pool_variant(const std::vector<cudamem::nccl_communicator>& comms)
      : variant("pool") {
    for (std::size_t r = 0; r < comms.size(); ++r) {
      stacks_.push_back(std::make_unique<stack>(static_cast<int>(r), comms[r].get()));
    }
  }
  ~pool_variant() override { release(); }

  struct stack {
    stack(int device, ncclComm_t comm)
        : memory(device), registered(memory, comm), pool(registered) {}
    cudamem::nccl_mem_resource memory;
    cudamem::nccl_registering_adaptor registered;
    cudamem::pool_resource pool;
  };
  std::vector<std::unique_ptr<stack>> stacks_;

 private:
  cudamem::memory_resource& memory_resource_for(std::size_t rank) override {
    return stacks_[rank]->pool;
  }
};

/// Blocks of a vm_pool_resource per rank, with nccl_vm_pool_options.
class vm_pool_variant final : public variant {
 public:
  explicit vm_pool_variant(const std::vector<cudamem::nccl_communicator>& comms)
      : variant("vm_pool") {
    for (std::size_t r = 0; r < comms.size(); ++r) {
      pools_.push_back(std::make_unique<cudamem::vm_pool_resource>(
          static_cast<int>(r), cudamem::nccl_vm_pool_options(comms[r].get())));
    }
  }
  ~vm_pool_variant() override { release(); }
  std::vector<std::unique_ptr<cudamem::vm_pool_resource>> pools_;

 private:
  cudamem::memory_resource& memory_resource_for(std::size_t rank) override {
    return *pools_[rank];
  }
};

/// Blocks of an nccl_pool per rank: registered chunks for 8-256 MiB, plain memory otherwise.
class nccl_pool_variant final : public variant {
 public:
  explicit nccl_pool_variant(const std::vector<cudamem::nccl_communicator>& comms)
      : variant("nccl_pool") {
    for (const auto& comm : comms) {
      pools_.push_back(std::make_unique<cudamem::nccl_pool>(comm.get()));
    }
  }
  ~nccl_pool_variant() override { release(); }
  std::vector<std::unique_ptr<cudamem::nccl_pool>> pools_;

 private:
  cudamem::memory_resource& memory_resource_for(std::size_t rank) override {
    return pools_[rank]->resource();
  }
};

template <class Resource>
std::vector<std::unique_ptr<cudamem::memory_resource>> per_rank(std::size_t ranks) {
  std::vector<std::unique_ptr<cudamem::memory_resource>> v;
  for (std::size_t r = 0; r < ranks; ++r) {
    v.push_back(std::make_unique<Resource>(static_cast<int>(r)));
  }
  return v;
}

// --- timing ---------------------------------------------------------------------------------

/// One all-reduce of `count` floats on every rank (one NCCL group).
void all_reduce(variant& v, std::size_t count, const std::vector<cudamem::nccl_communicator>& comms,
                std::vector<cudamem::stream>& streams) {
  cudamem::check_nccl(ncclGroupStart(), "ncclGroupStart");
  for (std::size_t r = 0; r < comms.size(); ++r) {
    cudamem::check_nccl(ncclAllReduce(v.send(r), v.recv(r), count, ncclFloat, ncclSum,
                                      comms[r].get(), streams[r].get()),
                        "ncclAllReduce");
  }
  cudamem::check_nccl(ncclGroupEnd(), "ncclGroupEnd");
}

void synchronize_all(std::vector<cudamem::stream>& streams) {
  for (auto& s : streams) {
    s.synchronize();
  }
}

/// Seconds per all-reduce over a batch of `iterations`: the slowest rank's events.
double time_batch(variant& v, std::size_t count, int iterations,
                  const std::vector<cudamem::nccl_communicator>& comms,
                  std::vector<cudamem::stream>& streams, std::vector<cudamem::event>& start,
                  std::vector<cudamem::event>& stop) {
  for (std::size_t r = 0; r < streams.size(); ++r) {
    start[r].record(streams[r]);
  }
  for (int i = 0; i < iterations; ++i) {
    all_reduce(v, count, comms, streams);
  }
  double slowest = 0;
  for (std::size_t r = 0; r < streams.size(); ++r) {
    stop[r].record(streams[r]);
  }
  for (std::size_t r = 0; r < streams.size(); ++r) {
    stop[r].synchronize();
    slowest = std::max(slowest, static_cast<double>(cudamem::elapsed_ms(start[r], stop[r])));
  }
  return slowest * 1e-3 / iterations;
}

/// Elements of rank 0's receive buffer that are not n (every rank sent ones).
std::size_t wrong_results(variant& v, std::size_t count, std::size_t ranks,
                          std::vector<cudamem::stream>& streams) {
  std::vector<float> host(count);
  const cudamem::device_guard on{0};
  cudamem::check(cudaMemcpyAsync(host.data(), v.recv(0), count * sizeof(float),
                                 cudaMemcpyDeviceToHost, streams[0].get()));
  streams[0].synchronize();
  return static_cast<std::size_t>(std::count_if(
      host.begin(), host.end(), [&](float x) { return x != static_cast<float>(ranks); }));
}

void bandwidth_part(const options& o, const std::vector<cudamem::nccl_communicator>& comms,
                    std::vector<cudamem::stream>& streams) {
  const std::size_t n = comms.size();
  std::vector<std::unique_ptr<variant>> variants;
  variants.push_back(std::make_unique<plain_variant>(
      "cudaMalloc", per_rank<cudamem::device_resource>(n), nullptr));
  variants.push_back(std::make_unique<plain_variant>(
      "cudaMalloc+reg", per_rank<cudamem::device_resource>(n), &comms));
  variants.push_back(std::make_unique<plain_variant>(
      "ncclMemAlloc+reg", per_rank<cudamem::nccl_mem_resource>(n), &comms));
  variants.push_back(std::make_unique<pool_variant>(comms));
  variants.push_back(std::make_unique<vm_pool_variant>(comms));
  variants.push_back(std::make_unique<nccl_pool_variant>(comms));
  const std::size_t pool_index = 3;
  const std::size_t vm_pool_index = 4;
  const std::size_t nccl_pool_index = 5;
  const std::size_t count_of_variants = variants.size();

  std::vector<cudamem::event> start;
  std::vector<cudamem::event> stop;
  for (std::size_t r = 0; r < n; ++r) {
    start.emplace_back(cudamem::event_options{.device = static_cast<int>(r)});
    stop.emplace_back(cudamem::event_options{.device = static_cast<int>(r)});
  }
  const bool bus = n > 1;
  const double factor = bus ? 2.0 * static_cast<double>(n - 1) / static_cast<double>(n) : 1.0;
  if (!bus) {
    std::printf("one rank: bus bandwidth (x 2(n-1)/n = 0) is not meaningful; the table shows "
                "algorithm bandwidth (bytes / time: a device copy), for the record only\n");
  }
  std::printf("%s GB/s, median of %d rounds; ratio: median over rounds of (variant / best of "
              "the others in that round); verdict on nccl_pool\n\n",
              bus ? "bus" : "algorithm", o.rounds);
  std::printf("%-8s", "size");
  for (const auto& v : variants) {
    std::printf(" %16s", v->name().c_str());
  }
  std::printf(" %10s %12s %14s  %s\n", "pool/best", "vm_pool/best", "nccl_pool/best", "verdict");

  bool all_ok = true;
  std::size_t sizes = 0;
  for (std::size_t bytes = o.min_bytes; bytes <= o.max_bytes; bytes *= 2) {
    ++sizes;
    const std::size_t count = bytes / sizeof(float);
    // A batch of at least ~2 GiB moved (at most 400 all-reduces): a 1 MiB all-reduce takes
    // ~15 us, and 50 of them (what this was) left batches of under a millisecond whose noise
    // alone put every variant at 0.96-0.97 of "the best of the others".
    const int iterations =
        static_cast<int>(std::clamp<std::size_t>((std::size_t{2} << 30) / bytes, 5, 400));
    std::size_t wrong = 0;
    for (auto& v : variants) {
      v->prepare(bytes, streams);
      synchronize_all(streams);
      all_reduce(*v, count, comms, streams);  // first use: NCCL's lazy registration work
      all_reduce(*v, count, comms, streams);
      synchronize_all(streams);
      wrong += wrong_results(*v, count, n, streams);
    }
    std::vector<std::vector<double>> rates(count_of_variants);
    std::vector<std::vector<double>> ratios(count_of_variants);  // variant / best other
    for (int round = 0; round < o.rounds; ++round) {
      std::vector<double> now(count_of_variants);
      for (std::size_t k = 0; k < count_of_variants; ++k) {
        const std::size_t which = (k + static_cast<std::size_t>(round)) % count_of_variants;
        const double seconds =
            time_batch(*variants[which], count, iterations, comms, streams, start, stop);
        now[which] = static_cast<double>(bytes) * factor / seconds * 1e-9;
      }
      for (std::size_t k = 0; k < count_of_variants; ++k) {
        rates[k].push_back(now[k]);
        double best_other = 0;
        for (std::size_t j = 0; j < count_of_variants; ++j) {
          best_other = j != k ? std::max(best_other, now[j]) : best_other;
        }
        ratios[k].push_back(now[k] / best_other);
      }
    }
    const double ratio = median(ratios[nccl_pool_index]);
    const bool ok = ratio >= 0.98 && wrong == 0;
    all_ok = all_ok && ok;
    std::printf("%-8s", size_name(bytes).c_str());
    for (std::size_t k = 0; k < count_of_variants; ++k) {
      std::printf(" %16.1f", median(rates[k]));
    }
    const char* verdict = wrong != 0 ? "WRONG RESULTS"
                          : !bus     ? "(one rank)"
                          : ok       ? "ok (>= 0.98)"
                                     : "BELOW 0.98";
    std::printf(" %10.3f %12.3f %14.3f  %s\n", median(ratios[pool_index]),
                median(ratios[vm_pool_index]), ratio, verdict);
    for (auto& v : variants) {
      v->release();
    }
  }
  auto& pools = dynamic_cast<pool_variant&>(*variants[pool_index]);
  auto& vm_pools = dynamic_cast<vm_pool_variant&>(*variants[vm_pool_index]);
  auto& nccl_pools = dynamic_cast<nccl_pool_variant&>(*variants[nccl_pool_index]);
  std::size_t pool_registrations = 0;
  std::size_t vm_pool_registrations = 0;
  std::size_t nccl_pool_registrations = 0;
  for (std::size_t r = 0; r < n; ++r) {
    pool_registrations += pools.stacks_[r]->registered.registrations_made();
    nccl_pool_registrations += nccl_pools.pools_[r]->registrations_made();
    auto* adaptor = dynamic_cast<cudamem::nccl_registering_adaptor*>(
        vm_pools.pools_[r]->upstream_adaptor());
    vm_pool_registrations += adaptor != nullptr ? adaptor->registrations_made() : 0;
  }
  std::printf("\nregistrations over the whole table, all ranks: one by one %zu each for "
              "cudaMalloc+reg and ncclMemAlloc+reg, pool %zu, vm_pool %zu, nccl_pool %zu\n",
              2 * n * sizes, pool_registrations, vm_pool_registrations, nccl_pool_registrations);
  std::printf("nccl_pool blocks vs the best of the others: %s\n\n",
              !bus ? "not judged with one rank"
                   : all_ok ? "ok at every size (>= 0.98)" : "BELOW TARGET at some size");
}

// --- registrations per 1,000 allocations ----------------------------------------------------

struct trace_step {
  bool allocate;
  std::size_t bytes;  ///< allocate: its size
  std::size_t which;  ///< free: index into the live list at that moment
};

std::vector<trace_step> make_trace() {
  std::mt19937_64 rng(42);
  std::uniform_real_distribution<double> log_size(18.0, 28.0);  // 256 KiB .. 256 MiB
  std::uniform_real_distribution<double> coin(0.0, 1.0);
  std::vector<trace_step> steps;
  std::vector<std::size_t> live;
  std::size_t live_bytes = 0;
  int allocations = 0;
  while (allocations < 1000) {
    if (live.empty() || (coin(rng) < 0.55 && live_bytes < (std::size_t{4} << 30))) {
      const auto bytes = static_cast<std::size_t>(std::exp2(log_size(rng)));
      steps.push_back({true, bytes, 0});
      live.push_back(bytes);
      live_bytes += bytes;
      ++allocations;
    } else {
      const std::size_t k = std::uniform_int_distribution<std::size_t>(0, live.size() - 1)(rng);
      steps.push_back({false, 0, k});
      live_bytes -= live[k];
      live.erase(live.begin() + static_cast<std::ptrdiff_t>(k));
    }
  }
  while (!live.empty()) {
    steps.push_back({false, 0, live.size() - 1});
    live.pop_back();
  }
  return steps;
}

/// Runs the trace with `take` / `give` (host time per allocation + free, in µs).
template <class Take, class Give>
double run_trace(const std::vector<trace_step>& steps, Take take, Give give) {
  std::vector<std::pair<void*, std::size_t>> live;
  const auto start = std::chrono::steady_clock::now();
  for (const trace_step& s : steps) {
    if (s.allocate) {
      live.emplace_back(take(s.bytes), s.bytes);
    } else {
      give(live[s.which].first, live[s.which].second);
      live.erase(live.begin() + static_cast<std::ptrdiff_t>(s.which));
    }
  }
  return seconds_since(start) * 1e6 / 1000.0;
}

void registration_part(const std::vector<cudamem::nccl_communicator>& comms,
                       std::vector<cudamem::stream>& streams) {
  ncclComm_t comm = comms[0].get();
  const cudamem::device_guard on{0};
  const auto steps = make_trace();
  std::printf("registrations per 1,000 allocations (rank 0; 256 KiB .. 256 MiB, up to 4 GiB "
              "live, seed 42):\n");
  std::printf("%-18s %14s %22s\n", "", "registrations", "us per alloc + free");

  {  // one by one
    cudamem::nccl_mem_resource memory{0};
    int registrations = 0;
    std::vector<std::pair<void*, cudamem::nccl_registration>> owned;
    const double us = run_trace(
        steps,
        [&](std::size_t bytes) {
          void* p = memory.allocate(bytes);
          owned.emplace_back(p, cudamem::nccl_registration{comm, p, bytes});
          ++registrations;
          return p;
        },
        [&](void* p, std::size_t bytes) {
          const auto it = std::find_if(owned.begin(), owned.end(),
                                       [p](const auto& e) { return e.first == p; });
          owned.erase(it);  // deregistered
          memory.deallocate(p, bytes);
        });
    std::printf("%-18s %14d %22.1f\n", "ncclMemAlloc+reg", registrations, us);
  }
  {
    cudamem::nccl_mem_resource memory{0};
    cudamem::nccl_registering_adaptor registered{memory, comm};
    cudamem::pool_resource pool{registered};
    const double us = run_trace(
        steps, [&](std::size_t bytes) { return pool.allocate(bytes, 256, streams[0]); },
        [&](void* p, std::size_t bytes) { pool.deallocate(p, bytes, 256, streams[0]); });
    std::printf("%-18s %14zu %22.1f   (%zu chunks held at the end)\n", "pool",
                registered.registrations_made(), us, pool.chunk_count());
  }
  {
    cudamem::vm_pool_resource pool{0, cudamem::nccl_vm_pool_options(comm)};
    auto* registered =
        dynamic_cast<cudamem::nccl_registering_adaptor*>(pool.upstream_adaptor());
    const double us = run_trace(
        steps, [&](std::size_t bytes) { return pool.allocate(bytes, 256, streams[0]); },
        [&](void* p, std::size_t bytes) { pool.deallocate(p, bytes, 256, streams[0]); });
    std::printf("%-18s %14zu %22.1f   (blocks of 64 MiB or more are registered one by one)\n",
                "vm_pool", registered != nullptr ? registered->registrations_made() : 0, us);
  }
  {
    cudamem::nccl_pool pool{comm};
    cudamem::memory_resource& mr = pool.resource();
    const double us = run_trace(
        steps, [&](std::size_t bytes) { return mr.allocate(bytes, 256, streams[0]); },
        [&](void* p, std::size_t bytes) { mr.deallocate(p, bytes, 256, streams[0]); });
    std::printf("%-18s %14zu %22.1f   (only its 8-256 MiB side registers: %zu + %zu chunks held)\n",
                "nccl_pool", pool.registrations_made(), us, pool.registered_pool().chunk_count(),
                pool.plain_pool().chunk_count());
  }

  // One register + deregister pair, and the first all-reduce on fresh registrations.
  cudamem::nccl_mem_resource memory{0};
  void* p = memory.allocate(64 * MiB);
  std::vector<double> pair_us;
  for (int i = 0; i < 200; ++i) {
    const auto start = std::chrono::steady_clock::now();
    {
      const cudamem::nccl_registration r{comm, p, 64 * MiB};
    }
    pair_us.push_back(seconds_since(start) * 1e6);
  }
  memory.deallocate(p, 64 * MiB);
  std::printf("\nncclCommRegister + ncclCommDeregister of 64 MiB: %.1f us (median of 200; NCCL "
              "defers the mapping work to the first collective)\n",
              median(pair_us));

  plain_variant fresh{"fresh", per_rank<cudamem::nccl_mem_resource>(comms.size()), &comms};
  std::vector<double> first_us;
  std::vector<double> later_us;
  for (int i = 0; i < 5; ++i) {
    fresh.prepare(MiB, streams);
    synchronize_all(streams);
    for (int k = 0; k < 6; ++k) {
      const auto start = std::chrono::steady_clock::now();
      all_reduce(fresh, MiB / sizeof(float), comms, streams);
      synchronize_all(streams);
      (k == 0 ? first_us : later_us).push_back(seconds_since(start) * 1e6);
    }
    fresh.release();
  }
  std::printf("1 MiB all-reduce on freshly registered ncclMemAlloc buffers: first %.1f us, "
              "later %.1f us (medians; host time to completion)\n",
              median(first_us), median(later_us));
}

}  // namespace

int main(int argc, char** argv) try {
  const options o = parse(argc, argv);
  ::setenv("NCCL_NVLS_ENABLE", "0", 0);  // before NCCL reads its settings
  if (o.legacy_register) {
    ::setenv("NCCL_LEGACY_CUDA_REGISTER", "1", 1);
  }
  const int visible = cudamem::device_count();
  if (visible == 0) {
    std::printf("SKIPPED: bench_nccl needs a GPU (none visible)\n");
    return 69;
  }
  const int gpus = o.gpus == 0 ? visible : std::min(o.gpus, visible);
  std::vector<int> devices;
  for (int d = 0; d < gpus; ++d) {
    devices.push_back(d);
  }
  int version = 0;
  cudamem::check_nccl(ncclGetVersion(&version), "ncclGetVersion");
  const char* nvls = std::getenv("NCCL_NVLS_ENABLE");
  const char* legacy = std::getenv("NCCL_LEGACY_CUDA_REGISTER");
  std::printf("bench_nccl: NCCL %d, %d rank(s) on %s%s; NCCL_NVLS_ENABLE=%s, "
              "NCCL_LEGACY_CUDA_REGISTER=%s\n",
              version, gpus, cudamem::get_device_properties(0).name.c_str(),
              gpus > 1 ? " and the next ones" : "", nvls != nullptr ? nvls : "(unset)",
              legacy != nullptr ? legacy : "(unset: cudaMalloc'd registrations unused)");
  const auto comms = cudamem::nccl_communicator::init_all(devices);
  std::vector<cudamem::stream> streams;
  for (int d = 0; d < gpus; ++d) {
    streams.emplace_back(cudamem::stream_options{.device = d, .non_blocking = true});
  }
  if (o.bandwidth) {
    bandwidth_part(o, comms, streams);
  }
  registration_part(comms, streams);
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "bench_nccl failed: %s\n", e.what());
  return 1;
}
