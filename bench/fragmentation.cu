// bench/fragmentation.cu — how much of the device's free memory a program can use before its
// first failure, and at what cost per operation, for cudamem's pools and their peers, in one
// run on one device; then the standard single-thread traces, vm_pool against the plain pool.
//   swiss cheese: 64 MiB blocks until failure, free every other one, 128 MiB blocks until
//                 failure; bytes obtained / bytes freed (what the freed blocks really held:
//                 CUB rounds 64 MiB up to its 128 MiB bin);
//   mixed:        bench/support/fragmentation.hpp's GPU trace (large short-lived blocks between
//                 small long-lived ones) to its first failure; live bytes at the failure / the
//                 device's free memory before the allocator took anything.
//
//   ./run bench fragmentation               # on a GPU: ~2 minutes on an 80 GB H100
//   ./run bench fragmentation --simulated   # no GPU: an 80 GiB simulated device, seconds
//   bench_fragmentation --only vm_pool --detail   # one allocator; where its time goes
//
// Rows: "cold" is an allocator's first run (each experiment starts from an empty allocator:
// its cache is emptied before each); "warm" runs both experiments again on the same object
// without emptying it, starting with what the cold mixed trace left cached (the steady state
// of a long-running program). Under each vm_pool row: the driver work of each experiment
// (compactions, cuMemCreate, cuMemMap, cuMemSetAccess, cuMemUnmap calls). Peers: cudaMalloc,
// cudaMallocAsync (the device's default pool, release threshold UINT64_MAX, trimmed between),
// cub::CachingDeviceAllocator(8, 3, 22, 64 GiB) (FreeAllCached between), thrust's
// disjoint_unsynchronized_pool_resource (release() between). Stream-aware allocators run on one
// non-blocking stream. Every allocator is destroyed, and the device's free memory checked,
// before the next starts. Lines are printed (and flushed) as they are measured. With no GPU
// and no --simulated it prints one line and exits 69.
#include <cudamem/detail/vm/driver_mapping.hpp>
#include <cudamem/device_resource.hpp>
#include <cudamem/out_of_memory.hpp>
#include <cudamem/pool_resource.hpp>
#include <cudamem/simulated_resource.hpp>
#include <cudamem/vm_pool_resource.hpp>

#include "fragmentation.hpp"
#include "traces.hpp"

#include <cub/util_allocator.cuh>
#include <thrust/device_ptr.h>
#include <thrust/mr/device_memory_resource.h>
#include <thrust/mr/disjoint_pool.h>
#include <thrust/mr/new.h>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <memory>
#include <new>
#include <string>
#include <vector>

using namespace cudamem_bench;

namespace {

using clock_type = std::chrono::steady_clock;

void require(cudaError_t code, const char* what) {
  if (code != cudaSuccess) {
    std::fprintf(stderr, "bench_fragmentation: %s: %s\n", what, cudaGetErrorString(code));
    std::exit(1);
  }
}

std::size_t device_free_now() {
  require(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  std::size_t free = 0;
  std::size_t total = 0;
  require(cudaMemGetInfo(&free, &total), "cudaMemGetInfo");
  return free;
}

/// One allocator under test: alloc returns nullptr on failure and must not throw.
struct allocator_under_test {
  std::string name;
  std::function<void*(std::size_t)> alloc;
  std::function<void(void*, std::size_t)> release;
  std::function<void()> empty_cache = [] {};     ///< between experiments of a cold run
  std::function<std::size_t(std::size_t)> footprint = [](std::size_t n) { return n; };
  /// Driver work done since the last call, printed under each row (vm_pool's call counts).
  std::function<std::string()> counters = [] { return std::string{}; };
  /// With --detail: the driver calls' time since the last call (vm_pool), and the last two.
  std::function<std::string(const char*)> driver_detail = [](const char*) { return std::string{}; };
  std::string swiss_detail;
  std::string mixed_detail;
};

double seconds_since(clock_type::time_point start) {
  return std::chrono::duration<double>(clock_type::now() - start).count();
}

void print_header() {
  std::printf("%-24s %-4s %8s %10s %8s %10s %9s %7s\n", "allocator", "run", "swiss", "ns/op",
              "mixed", "ns/op", "live GiB", "secs");
  std::fflush(stdout);
}

void print_row(const std::string& name, const char* run, const fragmentation_result& swiss,
               const fragmentation_result& mix, double secs) {
  std::printf("%-24s %-4s %8.4f %10.0f %8.4f %10.0f %9.2f %7.1f\n", name.c_str(), run, swiss.ratio,
              swiss.ns_per_op, mix.ratio, mix.ns_per_op,
              static_cast<double>(mix.numerator) / static_cast<double>(GiB), secs);
  if (swiss.ratio > 1.0001 || mix.ratio > 1.0001) {
    std::printf("  ^ a fraction above 1: the experiment is measuring something else, check it\n");
  }
  std::fflush(stdout);
}

/// Runs swiss cheese then the mixed trace; `free_at_start` is the mixed trace's denominator
/// and scale. A cold run starts each experiment from an empty allocator (it empties the cache
/// before each); it leaves what the mixed trace cached in place, so that the warm run after it
/// starts with the memory a long-running program's allocator would hold.
void run(allocator_under_test& a, const char* label, std::size_t free_at_start, bool cold) {
  const auto start = clock_type::now();
  if (cold) {
    a.empty_cache();
  }
  const fragmentation_result swiss =
      swiss_cheese(a.alloc, a.release, 64 * MiB, 128 * MiB, a.footprint);
  const std::string swiss_counters = a.counters();
  a.swiss_detail = a.driver_detail("swiss");
  if (cold) {
    a.empty_cache();
  }
  static_cast<void>(a.counters());  // the cache's release is not part of either experiment
  const fragmentation_result mix = mixed(mixed_spec_gpu_for(free_at_start), a.alloc, a.release);
  const std::string mixed_counters = a.counters();
  a.mixed_detail = a.driver_detail("mixed");
  print_row(a.name, label, swiss, mix, seconds_since(start));
  if (!swiss_counters.empty()) {
    std::printf("    swiss: %s\n    mixed: %s\n", swiss_counters.c_str(), mixed_counters.c_str());
  }
  if (profile_ops) {
    const auto detail = [](const char* what, const fragmentation_result& r) {
      std::printf("    %s: %zu ops, %zu over %.0f us taking %.1f ms of %.1f ms, worst %.0f us", what,
                  r.ops, r.slow_ops, slow_op_ns / 1e3, r.slow_ns / 1e6,
                  r.ns_per_op * static_cast<double>(r.ops) / 1e6, r.worst_ns / 1e3);
      if (!r.phase_ns.empty()) {
        std::printf("; phases (fill, holes, large, free) ms:");
        for (double ns : r.phase_ns) {
          std::printf(" %.1f", ns / 1e6);
        }
      }
      std::printf("\n");
    };
    detail("swiss", swiss);
    detail("mixed", mix);
    if (!swiss_counters.empty()) {
      std::printf("    %s\n    %s\n", a.swiss_detail.c_str(), a.mixed_detail.c_str());
    }
  }
  std::fflush(stdout);
}

/// vm_pool's driver work since the previous call: compactions, and the calls that cost.
std::function<std::string()> vm_counters(const cudamem::vm_pool_resource& vm) {
  auto last = std::make_shared<cudamem::vm_resource_stats>(vm.vm_stats());
  return [&vm, last] {
    const cudamem::vm_resource_stats now = vm.vm_stats();
    char line[256];
    std::snprintf(line, sizeof line,
                  "%zu compactions, %zu handles created, %zu maps, %zu set_access, %zu unmaps",
                  now.compactions - last->compactions, now.handles_created - last->handles_created,
                  now.maps - last->maps, now.access_calls - last->access_calls,
                  now.unmaps - last->unmaps);
    *last = now;
    return std::string{line};
  };
}

template <class F>
void* or_null(F&& f) {
  try {
    return f();
  } catch (const std::bad_alloc&) {  // cudamem::out_of_memory and thrust's bad_alloc
    return nullptr;
  } catch (const std::exception&) {  // thrust's system_error for cudaErrorMemoryAllocation
    static_cast<void>(cudaGetLastError());
    return nullptr;
  }
}

allocator_under_test from_resource(const std::string& name, cudamem::memory_resource& mr,
                                   cudaStream_t stream) {
  allocator_under_test a;
  a.name = name;
  a.alloc = [&mr, stream](std::size_t n) {
    return or_null([&] { return mr.allocate(n, 256, cudamem::stream_view{stream}); });
  };
  a.release = [&mr, stream](void* p, std::size_t n) {
    mr.deallocate(p, n, 256, cudamem::stream_view{stream});
  };
  return a;
}

/// CUB's bin for a request: the smallest power of 8 (from 8^3) that holds it.
std::size_t cub_bin(std::size_t bytes) {
  std::size_t bin = 512;
  while (bin < bytes) {
    bin *= 8;
  }
  return bin;
}

// --- the mapping layer, timed --------------------------------------------------------------

/// Forwards to the driver's mapping layer and adds up the time spent in each kind of call, so
/// the bench can say where vm_pool's time goes.
class timed_mapping final : public cudamem::detail::vm_mapping_layer {
 public:
  enum call {
    reserve_call, create_call, map_call, access_call, unmap_call, release_call, record_call,
    order_call, wait_call, wait_all_call, call_kinds
  };
  static constexpr std::array<const char*, call_kinds> names{
      "reserve", "create", "map", "set_access", "unmap", "release", "record_free",
      "order_after_free", "wait_for_free", "wait_for_all"};
  std::array<double, call_kinds> ns{};
  std::array<std::size_t, call_kinds> count{};

  explicit timed_mapping(int device) : inner_(device) {}

  int device() const noexcept override { return inner_.device(); }
  std::size_t granularity() const noexcept override { return inner_.granularity(); }
  std::size_t device_total() const noexcept override { return inner_.device_total(); }
  std::uintptr_t reserve(std::size_t bytes) override {
    const stopwatch w{*this, reserve_call};
    return inner_.reserve(bytes);
  }
  void free_reservation(std::uintptr_t base, std::size_t bytes) noexcept override {
    inner_.free_reservation(base, bytes);
  }
  std::optional<cudamem::detail::vm_handle> create(std::size_t bytes) override {
    const stopwatch w{*this, create_call};
    return inner_.create(bytes);
  }
  void release(cudamem::detail::vm_handle h) noexcept override {
    const stopwatch w{*this, release_call};
    inner_.release(h);
  }
  void map(std::uintptr_t va, std::size_t bytes, cudamem::detail::vm_handle h) override {
    const stopwatch w{*this, map_call};
    inner_.map(va, bytes, h);
  }
  void unmap(std::uintptr_t va, std::size_t bytes) noexcept override {
    const stopwatch w{*this, unmap_call};
    inner_.unmap(va, bytes);
  }
  void set_access(std::uintptr_t va, std::size_t bytes) override {
    const stopwatch w{*this, access_call};
    inner_.set_access(va, bytes);
  }
  void record_free(cudaStream_t s, std::uintptr_t va, std::size_t bytes) override {
    const stopwatch w{*this, record_call};
    inner_.record_free(s, va, bytes);
  }
  void order_after_free(cudaStream_t user, cudaStream_t freed_on) override {
    const stopwatch w{*this, order_call};
    inner_.order_after_free(user, freed_on);
  }
  void wait_for_free(cudaStream_t freed_on) override {
    const stopwatch w{*this, wait_call};
    inner_.wait_for_free(freed_on);
  }
  void wait_for_all_frees() noexcept override {
    const stopwatch w{*this, wait_all_call};
    inner_.wait_for_all_frees();
  }

  /// The calls since the last delta(): count x mean us (total ms).
  std::string delta(const char* what) {
    std::string line = std::string(what) + " driver calls:";
    for (std::size_t k = 0; k < call_kinds; ++k) {
      const std::size_t n = count[k] - seen_count_[k];
      const double t = ns[k] - seen_ns_[k];
      if (n != 0) {
        char part[128];
        std::snprintf(part, sizeof part, " %s %zu x %.1f us (%.1f ms);", names[k], n,
                      t / 1e3 / static_cast<double>(n), t / 1e6);
        line += part;
      }
    }
    seen_count_ = count;
    seen_ns_ = ns;
    return line;
  }

  void print(const char* indent) const {
    std::printf("%sdriver calls:", indent);
    for (std::size_t k = 0; k < call_kinds; ++k) {
      if (count[k] != 0) {
        std::printf(" %s %zu x %.1f us;", names[k], count[k], ns[k] / 1e3 / static_cast<double>(count[k]));
      }
    }
    std::printf("\n");
  }

 private:
  /// Adds the time from its construction to its destruction to call kind `k`.
  struct stopwatch {
    timed_mapping& owner;
    call k;
    clock_type::time_point start = clock_type::now();
    ~stopwatch() {
      owner.ns[k] += std::chrono::duration<double, std::nano>(clock_type::now() - start).count();
      ++owner.count[k];
    }
  };

  cudamem::detail::driver_vm_mapping inner_;
  std::array<double, call_kinds> seen_ns_{};
  std::array<std::size_t, call_kinds> seen_count_{};
};

void print_vm_stats(const cudamem::vm_pool_resource& vm, const char* indent) {
  const cudamem::vm_pool_stats st = vm.vm_stats();
  std::printf("%svm_pool holds %.2f GiB mapped in %zu handles, %.0f GiB virtual; %zu "
              "compactions, %zu handles created, %zu maps, %zu set_access, %zu unmaps, %zu stale "
              "aliases; pool: %zu chunks\n",
              indent, static_cast<double>(st.mapped_bytes) / GiB, st.handles,
              static_cast<double>(st.reserved_virtual_bytes) / GiB, st.compactions,
              st.handles_created, st.maps, st.access_calls, st.unmaps, st.stale_aliases,
              st.pool_chunks);
  std::fflush(stdout);
}

// --- standard traces ----------------------------------------------------------------------

/// Median ns/op of `reps` timed replays of `t` on `mr` (after one untimed replay).
double trace_ns(cudamem::memory_resource& mr, const trace& t, cudaStream_t s, int reps = 5) {
  std::vector<void*> slots(t.blocks, nullptr);
  const cudamem::stream_view stream{s};
  auto alloc = [&](std::size_t n) { return mr.allocate(n, 256, stream); };
  auto release = [&](void* p, std::size_t n) { mr.deallocate(p, n, 256, stream); };
  replay(t, slots, alloc, release);
  std::vector<double> samples;
  for (int i = 0; i < reps; ++i) {
    const auto start = clock_type::now();
    replay(t, slots, alloc, release);
    samples.push_back(std::chrono::duration<double, std::nano>(clock_type::now() - start).count() /
                      static_cast<double>(t.ops.size()));
  }
  std::sort(samples.begin(), samples.end());
  return samples[samples.size() / 2];
}

/// pool vs vm_pool on the single-thread standard traces; make_pool/make_vm build fresh ones.
void standard_traces_section(const std::function<std::unique_ptr<cudamem::memory_resource>()>& make_pool,
                             const std::function<std::unique_ptr<cudamem::memory_resource>()>& make_vm,
                             cudaStream_t s) {
  std::printf("\nstandard traces (single thread, ns/op, median of 5 after a warm-up)\n");
  std::printf("%-24s %10s %10s %8s\n", "trace", "pool", "vm_pool", "vm/pool");
  std::fflush(stdout);
  for (const trace_spec& spec : standard_traces()) {
    if (spec.threads > 1) {
      continue;  // the multi-thread trace is bench_pool's
    }
    const trace t = make_trace(spec);
    double pool_ns = 0;
    double vm_ns = 0;
    {
      const auto pool = make_pool();
      pool_ns = trace_ns(*pool, t, s);
    }
    {
      const auto vm = make_vm();
      vm_ns = trace_ns(*vm, t, s);
    }
    std::printf("%-24s %10.0f %10.0f %8.2f\n", spec.name.c_str(), pool_ns, vm_ns, vm_ns / pool_ns);
    std::fflush(stdout);
  }
}

// --- no GPU: a simulated 80 GiB device ---------------------------------------------------

void run_simulated() {
  constexpr std::size_t capacity = 80 * GiB;
  std::printf("simulated 80 GiB device (no GPU): host-side bookkeeping only, no driver costs\n");
  print_header();
  {
    cudamem::simulated_resource device{{.capacity = capacity}};
    allocator_under_test a = from_resource("first fit (reference)", device, nullptr);
    run(a, "cold", capacity, true);
  }
  for (auto layout : {cudamem::simulated_layout::first_fit, cudamem::simulated_layout::paged}) {
    cudamem::simulated_resource device{{.capacity = capacity, .layout = layout}};
    cudamem::pool_resource pool{device};
    allocator_under_test a = from_resource(
        layout == cudamem::simulated_layout::paged ? "pool over paged" : "pool over first fit",
        pool, nullptr);
    a.empty_cache = [&] { pool.release(); };
    run(a, "cold", capacity, true);
    run(a, "warm", capacity, false);
  }
  const auto make_vm = [] {
    return std::make_unique<cudamem::vm_pool_resource>(
        std::make_unique<cudamem::detail::simulated_vm_mapping>(
            cudamem::detail::simulated_vm_options{.capacity = capacity}));
  };
  {
    const auto vm = make_vm();
    allocator_under_test a = from_resource("cudamem vm_pool", *vm, nullptr);
    a.empty_cache = [&] { vm->release(); };
    a.counters = vm_counters(*vm);
    run(a, "cold", capacity, true);
    run(a, "warm", capacity, false);
    print_vm_stats(*vm, "  ");
  }
  // The traces' peak live bytes (16 GiB) fit the simulated device; streams are ignored there.
  static cudamem::simulated_resource trace_device{{.capacity = capacity, .layout = cudamem::simulated_layout::paged}};
  standard_traces_section(
      [] { return std::make_unique<cudamem::pool_resource>(trace_device); },
      [&] { return std::unique_ptr<cudamem::memory_resource>(make_vm()); }, nullptr);
}

}  // namespace

int main(int argc, char** argv) {
  std::setvbuf(stdout, nullptr, _IOLBF, 0);  // progress shows even through a pipe
  bool simulated = false;
  std::string only;  // run only the allocators whose name contains this (and no traces)
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--simulated") {
      simulated = true;
    } else if (arg == "--detail") {
      profile_ops = true;
    } else if (arg == "--only" && i + 1 < argc) {
      only = argv[++i];
    } else {
      std::fprintf(stderr, "usage: bench_fragmentation [--simulated] [--detail] [--only NAME]\n");
      return 1;
    }
  }
  const auto wanted = [&only](const char* name) {
    return only.empty() || std::string(name).find(only) != std::string::npos;
  };
  if (simulated) {
    run_simulated();
    return 0;
  }
  int devices = 0;
  const cudaError_t probe = cudaGetDeviceCount(&devices);
  if (probe != cudaSuccess || devices == 0) {
    std::printf("SKIPPED: no CUDA device (%s); run with --simulated for the 80 GiB simulation\n",
                probe != cudaSuccess ? cudaGetErrorName(probe) : "0 devices");
    return 69;
  }
  const auto bench_start = clock_type::now();
  cudaDeviceProp prop{};
  require(cudaGetDeviceProperties(&prop, 0), "cudaGetDeviceProperties");
  const std::size_t free_at_start = device_free_now();
  std::printf("bench_fragmentation: %s, %.1f GiB free at start\n", prop.name,
              static_cast<double>(free_at_start) / GiB);
  print_header();
  cudaStream_t stream = nullptr;
  require(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
  const auto check_returned = [&](const char* who) {
    const std::size_t now = device_free_now();
    if (now + 64 * MiB < free_at_start) {
      std::printf("  note: %.2f GiB not back on the device after %s\n",
                  static_cast<double>(free_at_start - now) / GiB, who);
    }
  };

  if (wanted("cudaMalloc")) {
    allocator_under_test a;
    a.name = "cudaMalloc";
    a.alloc = [](std::size_t n) -> void* {
      void* p = nullptr;
      if (cudaMalloc(&p, n) != cudaSuccess) {
        static_cast<void>(cudaGetLastError());
        return nullptr;
      }
      return p;
    };
    a.release = [](void* p, std::size_t) { require(cudaFree(p), "cudaFree"); };
    run(a, "-", device_free_now(), true);
    check_returned("cudaMalloc");
  }
  if (wanted("cudaMallocAsync")) {
    cudaMemPool_t mempool = nullptr;
    require(cudaDeviceGetDefaultMemPool(&mempool, 0), "cudaDeviceGetDefaultMemPool");
    std::uint64_t threshold = UINT64_MAX;
    require(cudaMemPoolSetAttribute(mempool, cudaMemPoolAttrReleaseThreshold, &threshold),
            "cudaMemPoolSetAttribute");
    allocator_under_test a;
    a.name = "cudaMallocAsync";
    a.alloc = [&](std::size_t n) -> void* {
      void* p = nullptr;
      if (cudaMallocAsync(&p, n, stream) != cudaSuccess) {
        static_cast<void>(cudaGetLastError());
        return nullptr;
      }
      return p;
    };
    a.release = [&](void* p, std::size_t) { require(cudaFreeAsync(p, stream), "cudaFreeAsync"); };
    a.empty_cache = [&] {
      require(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
      require(cudaMemPoolTrimTo(mempool, 0), "cudaMemPoolTrimTo");
    };
    const std::size_t free = device_free_now();
    run(a, "cold", free, true);
    run(a, "warm", free, false);
    a.empty_cache();
    check_returned("cudaMallocAsync");
  }
  if (wanted("CUB caching")) {
    {  // the allocator is destroyed before its memory is counted back
      cub::CachingDeviceAllocator cub(8, 3, 22, std::size_t{64} << 30);
      allocator_under_test a;
      a.name = "CUB caching";
      a.alloc = [&](std::size_t n) -> void* {
        void* p = nullptr;
        if (cub.DeviceAllocate(&p, n, stream) != cudaSuccess) {
          static_cast<void>(cudaGetLastError());
          return nullptr;
        }
        return p;
      };
      a.release = [&](void* p, std::size_t) { require(cub.DeviceFree(p), "CUB DeviceFree"); };
      a.empty_cache = [&] { require(cub.FreeAllCached(), "CUB FreeAllCached"); };
      a.footprint = cub_bin;
      run(a, "cold", device_free_now(), true);
      a.empty_cache();
    }
    check_returned("CUB");
  }
  if (wanted("thrust disjoint pool")) {
    {  // the allocator is destroyed before its memory is counted back
      using thrust_pool =
          thrust::mr::disjoint_unsynchronized_pool_resource<thrust::device_memory_resource,
                                                            thrust::mr::new_delete_resource>;
      thrust::device_memory_resource upstream;
      thrust::mr::new_delete_resource bookkeeper;
      thrust_pool pool(&upstream, &bookkeeper);
      allocator_under_test a;
      a.name = "thrust disjoint pool";
      a.alloc = [&](std::size_t n) { return or_null([&] { return pool.do_allocate(n, 256).get(); }); };
      a.release = [&](void* p, std::size_t n) {
        pool.do_deallocate(thrust::device_ptr<void>(p), n, 256);
      };
      a.empty_cache = [&] { pool.release(); };
      run(a, "cold", device_free_now(), true);
      a.empty_cache();
    }
    check_returned("thrust's pool");
  }
  if (wanted("cudamem pool")) {
    {  // the allocator is destroyed before its memory is counted back
      cudamem::device_resource device{0};
      cudamem::pool_resource pool{device};
      allocator_under_test a = from_resource("cudamem pool", pool, stream);
      a.empty_cache = [&] { pool.release(); };
      const std::size_t free = device_free_now();
      run(a, "cold", free, true);
      run(a, "warm", free, false);
    }
    check_returned("cudamem pool");
  }
  if (wanted("cudamem vm_pool")) {
    {  // the allocator is destroyed before its memory is counted back
      auto layer = std::make_unique<timed_mapping>(0);
      timed_mapping& timing = *layer;
      const std::size_t free = device_free_now();
      cudamem::vm_pool_resource vm{std::move(layer)};
      allocator_under_test a = from_resource("cudamem vm_pool", vm, stream);
      a.empty_cache = [&] { vm.release(); };
      a.counters = vm_counters(vm);
      a.driver_detail = [&timing](const char* what) { return timing.delta(what); };
      run(a, "cold", free, true);
      run(a, "warm", free, false);
      print_vm_stats(vm, "  ");
      timing.print("  ");
    }
    check_returned("cudamem vm_pool");
  }
  if (only.empty()) {
    standard_traces_section(
        [] {
          static cudamem::device_resource device{0};
          return std::make_unique<cudamem::pool_resource>(device);
        },
        [] { return std::make_unique<cudamem::vm_pool_resource>(0); }, stream);
  }
  require(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
  require(cudaStreamDestroy(stream), "cudaStreamDestroy");
  std::printf("\nbench_fragmentation: done in %.0f s\n", seconds_since(bench_start));
  return 0;
}
