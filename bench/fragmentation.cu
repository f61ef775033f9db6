// bench/fragmentation.cu — how much of the device's free memory a program can use before its
// first failure, and at what cost per operation, for cudamem's pools and their peers, in one
// run on one device; then the mixed trace's variants, cold and warm, seed by seed; then the
// standard single-thread traces, vm_pool against the plain pool.
//   swiss cheese: 64 MiB blocks until failure, free every other one, 128 MiB blocks until
//                 failure; bytes obtained / bytes freed (what the freed blocks really held:
//                 CUB rounds 64 MiB up to its 128 MiB bin);
//   mixed:        bench/support/fragmentation.hpp's GPU trace (large short-lived blocks between
//                 small long-lived ones) to its first failure; live bytes at the failure / the
//                 device's free memory before the allocator took anything.
//
//   ./run bench fragmentation               # on a GPU: ~3-4 minutes on an 80 GB H100
//   ./run bench fragmentation --simulated   # no GPU: an 80 GiB simulated device, seconds
//   bench_fragmentation --simulated --stream-model busy   # ... with the pools tracking streams
//                     # over a model device: `busy`, `idle`, or `naive` (busy, the pools
//                     # choosing blocks naively: the first pick, whatever it waits for)
//   bench_fragmentation --only vm_pool --detail   # one allocator; where its time goes
//   bench_fragmentation --only vm_pool --variant bench,wide --seeds 42,1,2   # just those rows
//   bench_fragmentation --only vm_pool --pause-ms 2000   # cold runs start 2 s after a release
//   bench_fragmentation --only vm_pool --grow-ahead-mib 1024   # vm_pools that grow ahead
//   bench_fragmentation --only vm_pool --grow-ahead-floor-mib 0  # ... down to the last handle
//   bench_fragmentation --simulated --handle-mib 16   # vm_pools with 16 MiB handles (default
//                     # 64; the C API's PyTorch stack: 4): stranded memory against moves
//   bench_fragmentation --simulated --handle-mib 16 --small-chunk-mib 16   # ... and the pool's
//                     # small chunks and growth_step of 16 MiB (default 64; whole handles)
//   bench_fragmentation --simulated --handle-mib 4 --bulk-mib 32   # ... with bulk blocks
//                     # (vm_pool_options::bulk_handle_bytes, the C API's default), both
//                     # vm_resources over one simulated device
//   bench_fragmentation --only vm_pool --variants-only --variant bench --seeds 42
//                     # one fresh vm_pool, cold then warm, as the process's first allocator:
//                     # a cold start on a device at rest (the main table's cold mixed run
//                     # comes right after the swiss run gave 78 GiB back)
//
// Main table. "cold" is an allocator's first run (each experiment starts from an empty
// allocator: its cache is emptied before each); "warm" runs both experiments again on the
// same object without emptying it, starting with what the cold mixed trace left cached (the
// steady state of a long-running program). Under each vm_pool row: the driver work of each
// experiment (compactions, cuMemCreate, cuMemMap, cuMemSetAccess, cuMemUnmap calls), and for
// swiss cheese the driver's floor: the handles it must create (cold) and move (two per 128 MiB
// block: two 64 MiB holes are never side by side) times what one create, map and
// cuMemSetAccess cost, measured just before the run (the driver's costs drift with what the
// device did before: the peers' frees); measured/floor is printed. vm_pool runs `--vm-runs`
// times (5 by default), a fresh resource each time, and its rows in the tables are the
// medians (ns/op, and measured/floor taken run by run; fractions are the lowest).
// Variants table (mixed_variants() in bench/support/fragmentation.hpp: other size ranges, more
// long-lived small blocks, more large blocks alive, several streams): for each variant and
// seed, a fresh allocator runs the trace to its first failure (cold), then again on the same
// object (warm); vm_pool's driver calls per operation beside it. Peers there: cudaMallocAsync.
// At the end, both tables again in markdown, for bench/README.md.
// Peers: cudaMalloc, cudaMallocAsync (the device's default pool, release threshold UINT64_MAX,
// trimmed between), cub::CachingDeviceAllocator(8, 3, 22, 64 GiB) (FreeAllCached between),
// thrust's disjoint_unsynchronized_pool_resource (release() between). Stream-aware allocators
// run on non-blocking streams (four; the traces use the first unless a variant says
// otherwise). Every allocator is destroyed, and the device's free memory checked, before the
// next starts. Lines are printed (and flushed) as they are measured. With no GPU and no
// --simulated it prints one line and exits 69.
#include <cudamem/detail/pool/host_stream_events.hpp>
#include <cudamem/detail/vm/driver_mapping.hpp>
#include <cudamem/detail/vm/simulated_mapping.hpp>
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
#include <list>
#include <memory>
#include <mutex>
#include <new>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
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

/// One allocator under test: alloc returns nullptr on failure and must not throw. Both take
/// the index of the stream to work on (0 unless a variant of the mixed trace says otherwise).
/// What the driver charges for one handle, measured in this run (vm_pool's swiss floor).
struct handle_costs {
  double create_us = 0;
  double map_us = 0;
  double access_us = 0;  ///< one cuMemSetAccess for the handle alone
};

struct allocator_under_test {
  std::string name;
  std::function<void*(std::size_t, std::size_t)> alloc;
  std::function<void(void*, std::size_t, std::size_t)> release;
  std::function<void()> empty_cache = [] {};     ///< between experiments of a cold run
  std::function<std::size_t(std::size_t)> footprint = [](std::size_t n) { return n; };
  /// Driver work done since the last call, printed under each row (vm_pool's call counts).
  std::function<std::string()> counters = [] { return std::string{}; };
  /// With --detail: the driver calls' time since the last call (vm_pool), and the last two.
  std::function<std::string(const char*)> driver_detail = [](const char*) { return std::string{}; };
  std::string swiss_detail;
  std::string mixed_detail;
  /// vm_pool: handles created and moved since the last call (the swiss floor's counts), and
  /// the size of its handles.
  std::function<std::pair<std::size_t, std::size_t>()> handle_work;
  std::size_t handle_bytes = 0;
  /// vm_pool on a GPU: what one handle cost the driver in the calls since the last call.
  std::function<handle_costs()> costs_since;
};

/// The handles an experiment made and moved, and the driver's floor for them.
struct swiss_floor {
  std::size_t created = 0;
  std::size_t moved = 0;
  std::size_t needed_creates = 0;
  std::size_t needed_moves = 0;
  double floor_ns_per_op = 0;  ///< 0: no costs measured (the simulated device)
  double median_ratio = 0;     ///< a row of medians: the median of measured/floor, run by run
  /// The same floor at what the driver charged per handle during the experiment itself.
  double in_run_ns_per_op = 0;
  double in_run_median_ratio = 0;
};

/// One row of the main table, kept for the markdown at the end.
struct main_row {
  std::string name;
  std::string run;
  fragmentation_result swiss;
  fragmentation_result mix;
  std::optional<swiss_floor> floor;
};
std::vector<main_row> main_rows;
std::optional<handle_costs> measured_costs;  ///< set on a GPU before vm_pool runs

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

/// `--pause-ms N`: how long a cold experiment waits after its allocator emptied its cache.
int cold_pause_ms = 0;

/// `--grow-ahead-mib N`: the vm_pools' grow_ahead_bytes (nullopt: the default).
std::optional<std::size_t> vm_grow_ahead_bytes;
/// `--grow-ahead-floor-mib N`: the vm_pools' grow_ahead_floor_bytes (nullopt: the default).
std::optional<std::size_t> vm_grow_ahead_floor_bytes;
/// `--growth-mib N`: the vm_pools' growth_bytes (0: the default).
std::size_t vm_growth_bytes = 0;
/// `--handle-mib N`: the vm_pools' handle_bytes (0: the default, vm_resource_options's 64 MiB;
/// the C API's PyTorch and CuPy stacks use 4 MiB). The handle is the unit of recycling: a
/// recycled handle costs the driver ~34 us whatever its size, so larger handles make a 128 MiB
/// block out of fewer moves, and may strand more memory next to live blocks. This lets the
/// simulated device show both sides.
std::size_t vm_handle_bytes = 0;
/// `--bulk-mib N` (--simulated only): the vm_pools' bulk_handle_bytes (0: none, the default).
std::size_t vm_bulk_bytes = 0;
/// `--small-chunk-mib N`: the vm_pools' pool.small_chunk_size and pool.growth_step (0: the
/// default, vm_pool_chunking()'s 64 MiB); a multiple of the handle, so that a wholly free chunk
/// is whole handles the upstream can recycle.
std::size_t vm_small_chunk_bytes = 0;
/// `--simulated-driver-us C,A`: with --simulated, each create takes C us and each set_access A
/// us per handle (an H100's are ~22-35 and ~37): what overlaps the driver, studied on the host.
unsigned sim_create_us = 0;
unsigned sim_access_us = 0;

/// The options every vm_pool of this benchmark is built with.
cudamem::vm_pool_options bench_vm_options() {
  cudamem::vm_pool_options o;
  if (vm_grow_ahead_bytes) {
    o.grow_ahead_bytes = vm_grow_ahead_bytes;
  }
  if (vm_growth_bytes != 0) {
    o.growth_bytes = vm_growth_bytes;
  }
  if (vm_handle_bytes != 0) {
    o.handle_bytes = vm_handle_bytes;
  }
  if (vm_small_chunk_bytes != 0) {
    o.pool.small_chunk_size = vm_small_chunk_bytes;
    o.pool.growth_step = vm_small_chunk_bytes;
  }
  o.grow_ahead_floor_bytes = vm_grow_ahead_floor_bytes;
  o.bulk_handle_bytes = vm_bulk_bytes;
  return o;
}

/// Empties `a`'s cache and waits `cold_pause_ms`: a fill right after a release pays a tail of
/// slow cuMemCreate calls (bench_vmm_driver measures it: the driver seems to clear what was
/// given back), which a program starting on a device at rest does not.
void empty_for_cold_start(allocator_under_test& a) {
  a.empty_cache();
  if (cold_pause_ms > 0) {
    cudaDeviceSynchronize();
    std::this_thread::sleep_for(std::chrono::milliseconds(cold_pause_ms));
  }
}

/// Runs swiss cheese then the mixed trace; `free_at_start` is the mixed trace's denominator
/// and scale. A cold run starts each experiment from an empty allocator (it empties the cache
/// before each); it leaves what the mixed trace cached in place, so that the warm run after it
/// starts with the memory a long-running program's allocator would hold.
void run(allocator_under_test& a, const char* label, std::size_t free_at_start, bool cold) {
  if (cold) {
    empty_for_cold_start(a);
  }
  const auto start = clock_type::now();
  if (a.handle_work) {
    static_cast<void>(a.handle_work());  // count the experiment's handles only
  }
  if (a.costs_since) {
    static_cast<void>(a.costs_since());  // and their costs
  }
  const fragmentation_result swiss =
      swiss_cheese([&](std::size_t n) { return a.alloc(n, 0); },
                   [&](void* p, std::size_t n) { a.release(p, n, 0); }, 64 * MiB, 128 * MiB,
                   a.footprint);
  std::optional<swiss_floor> floor;
  if (a.handle_work) {
    const auto [created, moved] = a.handle_work();
    floor = swiss_floor{created, moved, 0, 0, 0};
    // Cold: the fill's memory, created once; warm, it is all mapped already. Every 128 MiB
    // block needs its handles moved: the 64 MiB holes are never side by side.
    const std::size_t per_handle = std::max<std::size_t>(1, a.handle_bytes);
    const std::size_t per_small = (64 * MiB + per_handle - 1) / per_handle;
    floor->needed_creates = cold ? swiss.small_blocks * per_small : 0;
    floor->needed_moves = swiss.large_blocks * ((128 * MiB + per_handle - 1) / per_handle);
    const auto floor_for = [&](const handle_costs& c) {
      return 1e3 *
             (static_cast<double>(floor->needed_creates) * (c.create_us + c.map_us + c.access_us) +
              static_cast<double>(floor->needed_moves) * (c.map_us + c.access_us)) /
             static_cast<double>(swiss.ops);
    };
    if (measured_costs && swiss.ops != 0) {
      floor->floor_ns_per_op = floor_for(*measured_costs);
    }
    if (a.costs_since && swiss.ops != 0) {
      const handle_costs in_run = a.costs_since();
      floor->in_run_ns_per_op = floor_for(in_run);
      std::printf("    swiss driver costs per handle in this run: create %.1f us, map %.1f us, "
                  "cuMemSetAccess %.1f us\n",
                  in_run.create_us, in_run.map_us, in_run.access_us);
    }
  }
  const std::string swiss_counters = a.counters();
  a.swiss_detail = a.driver_detail("swiss");
  if (cold) {
    empty_for_cold_start(a);
  }
  static_cast<void>(a.counters());  // the cache's release is not part of either experiment
  const fragmentation_result mix = mixed(mixed_spec_gpu_for(free_at_start), a.alloc, a.release);
  const std::string mixed_counters = a.counters();
  a.mixed_detail = a.driver_detail("mixed");
  print_row(a.name, label, swiss, mix, seconds_since(start));
  main_rows.push_back({a.name, label, swiss, mix, floor});
  if (!swiss_counters.empty()) {
    std::printf("    swiss: %s\n    mixed: %s\n", swiss_counters.c_str(), mixed_counters.c_str());
  }
  if (floor) {
    std::printf("    swiss floor: %zu handles created (%zu needed), %zu moved (%zu needed)",
                floor->created, floor->needed_creates, floor->moved, floor->needed_moves);
    if (floor->floor_ns_per_op > 0) {
      std::printf(": %.0f ns/op, measured/floor %.2fx", floor->floor_ns_per_op,
                  swiss.ns_per_op / floor->floor_ns_per_op);
    }
    if (floor->in_run_ns_per_op > 0) {
      std::printf("; at this run's own costs %.0f ns/op, %.2fx", floor->in_run_ns_per_op,
                  swiss.ns_per_op / floor->in_run_ns_per_op);
    }
    std::printf("\n");
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
      std::printf("\n      slowest ops, us (operation #, phase):");
      for (const auto& [ns, index] : r.slowest) {
        const auto phase = std::upper_bound(r.phase_ops.begin(), r.phase_ops.end(), index);
        std::printf(" %.0f (#%zu", ns / 1e3, index);
        if (!r.phase_ops.empty()) {
          std::printf(", %s", std::array{"fill", "holes", "large", "free", "?"}[std::min<std::size_t>(
                                  static_cast<std::size_t>(phase - r.phase_ops.begin()), 4)]);
        }
        std::printf(")");
      }
      if (r.kind_ops[0] != 0) {
        std::printf("\n      by kind, mean us (count):");
        for (std::size_t k = 0; k < r.kind_ops.size(); ++k) {
          if (r.kind_ops[k] != 0) {
            std::printf(" %s %.2f (%zu);", mixed_op_kinds[k],
                        r.kind_ns[k] / 1e3 / static_cast<double>(r.kind_ops[k]), r.kind_ops[k]);
          }
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
                  "%zu compactions, %zu handles created (%zu ahead), %zu maps, %zu set_access, "
                  "%zu unmaps",
                  now.compactions - last->compactions, now.handles_created - last->handles_created,
                  now.handles_created_ahead - last->handles_created_ahead, now.maps - last->maps, now.access_calls - last->access_calls,
                  now.unmaps - last->unmaps);
    *last = now;
    return std::string{line};
  };
}

/// vm_pool's handles created and moved since the previous call (a map is a creation's or a
/// move's).
std::function<std::pair<std::size_t, std::size_t>()> vm_handle_work(
    const cudamem::vm_pool_resource& vm) {
  auto last = std::make_shared<cudamem::vm_resource_stats>(vm.vm_stats());
  return [&vm, last] {
    const cudamem::vm_resource_stats now = vm.vm_stats();
    const std::size_t created = now.handles_created - last->handles_created;
    const std::size_t maps = now.maps - last->maps;
    *last = now;
    return std::pair<std::size_t, std::size_t>{created, maps > created ? maps - created : 0};
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

/// `mr` on `streams` (stream index s works on streams[s % size]; none: the null stream).
allocator_under_test from_resource(const std::string& name, cudamem::memory_resource& mr,
                                   std::vector<cudaStream_t> streams) {
  if (streams.empty()) {
    streams.push_back(nullptr);
  }
  allocator_under_test a;
  a.name = name;
  a.alloc = [&mr, streams](std::size_t n, std::size_t s) {
    const cudamem::stream_view on{streams[s % streams.size()]};
    return or_null([&] { return mr.allocate(n, 256, on); });
  };
  a.release = [&mr, streams](void* p, std::size_t n, std::size_t s) {
    mr.deallocate(p, n, 256, cudamem::stream_view{streams[s % streams.size()]});
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
  std::size_t access_bytes = 0;  ///< bytes given access, all calls together

  explicit timed_mapping(int device) : inner_(device) {}

  int device() const noexcept override { return inner_.device(); }
  std::size_t granularity() const noexcept override { return inner_.granularity(); }
  std::size_t device_total() const noexcept override { return inner_.device_total(); }
  std::optional<std::size_t> device_free() const noexcept override {
    return inner_.device_free();
  }
  cudamem::detail::memory_domain domain() const noexcept override { return inner_.domain(); }
  std::uintptr_t reserve(std::size_t bytes, std::size_t alignment) override {
    const stopwatch w{*this, reserve_call};
    return inner_.reserve(bytes, alignment);
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
  void add_peer(int device) override { inner_.add_peer(device); }
  void set_peer_access(std::uintptr_t va, std::size_t bytes, int device) override {
    inner_.set_peer_access(va, bytes, device);
  }
  void set_access(std::uintptr_t va, std::size_t bytes) override {
    const stopwatch w{*this, access_call};
    inner_.set_access(va, bytes);
    const std::lock_guard lock(mutex_);
    access_bytes += bytes;
  }

  /// What one handle of `handle` bytes cost the driver since the last call: the mean create and
  /// map, and cuMemSetAccess's time per handle it covered.
  handle_costs costs_since(std::size_t handle) {
    const auto mean = [&](call k) {
      const std::size_t n = count[k] - costs_count_[k];
      return n == 0 ? 0.0 : (ns[k] - costs_ns_[k]) / 1e3 / static_cast<double>(n);
    };
    const std::size_t handles = (access_bytes - costs_access_bytes_) / handle;
    handle_costs c{mean(create_call), mean(map_call),
                   handles == 0 ? 0.0
                                : (ns[access_call] - costs_ns_[access_call]) / 1e3 /
                                      static_cast<double>(handles)};
    costs_ns_ = ns;
    costs_count_ = count;
    costs_access_bytes_ = access_bytes;
    return c;
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
      const double spent =
          std::chrono::duration<double, std::nano>(clock_type::now() - start).count();
      const std::lock_guard lock(owner.mutex_);  // the growth thread times its calls too
      owner.ns[k] += spent;
      ++owner.count[k];
    }
  };

  std::mutex mutex_;  ///< guards ns, count and access_bytes while calls are made
  cudamem::detail::driver_vm_mapping inner_;
  std::array<double, call_kinds> seen_ns_{};
  std::array<std::size_t, call_kinds> seen_count_{};
  std::array<double, call_kinds> costs_ns_{};
  std::array<std::size_t, call_kinds> costs_count_{};
  std::size_t costs_access_bytes_ = 0;
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

// --- what one handle costs the driver (the swiss floor) -------------------------------------

/// Creates `count` handles of `handle` bytes on `device`, maps each at a fresh address and
/// gives it access alone (one cuMemSetAccess per handle, as a move of one handle pays), then
/// gives everything back; returns the median cost of each call.
handle_costs measure_handle_costs(int device, std::size_t handle, std::size_t count = 16) {
  cudamem::detail::driver_vm_mapping layer{device};
  const std::uintptr_t va = layer.reserve(count * handle, layer.granularity());
  std::vector<cudamem::detail::vm_handle> handles;
  std::vector<double> create_us;
  std::vector<double> map_us;
  std::vector<double> access_us;
  const auto us = [](clock_type::time_point from) {
    return std::chrono::duration<double, std::micro>(clock_type::now() - from).count();
  };
  for (std::size_t i = 0; i < count; ++i) {
    auto start = clock_type::now();
    const auto h = layer.create(handle);
    if (!h) {
      break;
    }
    create_us.push_back(us(start));
    handles.push_back(*h);
    start = clock_type::now();
    layer.map(va + i * handle, handle, *h);
    map_us.push_back(us(start));
    start = clock_type::now();
    layer.set_access(va + i * handle, handle);
    access_us.push_back(us(start));
  }
  for (std::size_t i = 0; i < handles.size(); ++i) {
    layer.unmap(va + i * handle, handle);
    layer.release(handles[i]);
  }
  layer.free_reservation(va, count * handle);
  const auto median = [](std::vector<double> v) {
    if (v.empty()) {
      return 0.0;
    }
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };
  return {median(create_us), median(map_us), median(access_us)};
}

// --- the mixed trace's variants, cold and warm ------------------------------------------------

/// Driver calls per operation of one run of a trace (vm_pool).
struct call_rates {
  double creates = 0;
  double maps = 0;
  double access = 0;
};

struct variant_run {
  fragmentation_result cold;
  fragmentation_result warm;
  std::optional<call_rates> cold_calls;
  std::optional<call_rates> warm_calls;
};

/// An allocator of the variants table: builds a fresh one, runs the trace cold then warm on it.
struct variant_allocator {
  std::string name;
  std::function<variant_run(const mixed_spec&)> run;
};

struct variant_row {
  std::string variant;
  std::uint64_t seed;
  std::string allocator;
  variant_run result;
};
std::vector<variant_row> variant_rows;

/// vm_pool's driver calls per operation since `before`.
call_rates rates_since(const cudamem::vm_resource_stats& before,
                       const cudamem::vm_resource_stats& now, std::size_t ops) {
  const double n = ops == 0 ? 1.0 : static_cast<double>(ops);
  return {static_cast<double>(now.handles_created - before.handles_created) / n,
          static_cast<double>(now.maps - before.maps) / n,
          static_cast<double>(now.access_calls - before.access_calls) / n};
}

/// Runs `spec` cold then warm through `a` (a fresh allocator), counting vm_pool's calls.
variant_run cold_then_warm(const mixed_spec& spec, allocator_under_test& a,
                           const cudamem::vm_pool_resource* vm) {
  variant_run r;
  empty_for_cold_start(a);  // empty: a fresh allocator, or the device pool trimmed here
  const auto before = vm ? vm->vm_stats() : cudamem::vm_pool_stats{};
  r.cold = mixed(spec, a.alloc, a.release);
  const auto between = vm ? vm->vm_stats() : cudamem::vm_pool_stats{};
  r.warm = mixed(spec, a.alloc, a.release);
  if (vm != nullptr) {
    r.cold_calls = rates_since(before, between, r.cold.ops);
    r.warm_calls = rates_since(between, vm->vm_stats(), r.warm.ops);
  }
  return r;
}

void print_variant_header() {
  std::printf("\nmixed trace variants: live fraction at the first failure, cold (a fresh "
              "allocator) then warm (the same one again); vm_pool's driver calls per op "
              "(create/map/access)\n");
  std::printf("%-11s %5s %-18s %8s %8s %8s %8s %22s %22s\n", "variant", "seed", "allocator", "cold",
              "ns/op", "warm", "ns/op", "cold calls/op", "warm calls/op");
  std::fflush(stdout);
}

std::string rates_text(const std::optional<call_rates>& c) {
  if (!c) {
    return "-";
  }
  char text[64];
  std::snprintf(text, sizeof text, "%.4f/%.4f/%.4f", c->creates, c->maps, c->access);
  return text;
}

/// For every variant and seed, every allocator: fresh, cold, warm; rows printed as measured.
void run_variants(const std::vector<variant_allocator>& allocators,
                  const std::vector<const mixed_variant*>& variants,
                  const std::vector<std::uint64_t>& seeds,
                  const std::function<std::size_t()>& free_now) {
  if (allocators.empty() || variants.empty()) {
    return;
  }
  print_variant_header();
  for (const mixed_variant* v : variants) {
    for (const std::uint64_t seed : seeds) {
      for (const variant_allocator& a : allocators) {
        mixed_spec spec = v->make(free_now());
        spec.seed = seed;
        const variant_run r = a.run(spec);
        std::printf("%-11s %5llu %-18s %8.4f %8.0f %8.4f %8.0f %22s %22s%s\n", v->name.c_str(),
                    static_cast<unsigned long long>(seed), a.name.c_str(), r.cold.ratio,
                    r.cold.ns_per_op, r.warm.ratio, r.warm.ns_per_op,
                    rates_text(r.cold_calls).c_str(), rates_text(r.warm_calls).c_str(),
                    r.warm.ratio + 1e-9 < r.cold.ratio ? "  <- warm below cold" : "");
        std::fflush(stdout);
        variant_rows.push_back({v->name, seed, a.name, r});
      }
    }
  }
}

/// Replaces the main table's rows of `name`'s `run` (one per fresh resource) by one row of
/// their medians: ns/op of both experiments and the floor (with measured/floor taken run by
/// run), the lowest fractions. Prints it.
void keep_medians(const std::string& name, const std::string& run) {
  std::vector<main_row> rows;
  std::erase_if(main_rows, [&](const main_row& r) {
    if (r.name == name && r.run == run) {
      rows.push_back(r);
      return true;
    }
    return false;
  });
  if (rows.empty()) {
    return;
  }
  const auto median = [&](auto field) {
    std::vector<double> v;
    for (const main_row& r : rows) {
      v.push_back(field(r));
    }
    std::sort(v.begin(), v.end());
    return v.size() % 2 ? v[v.size() / 2] : (v[v.size() / 2 - 1] + v[v.size() / 2]) / 2;
  };
  const auto lowest = [&](auto field) {
    double low = field(rows.front());
    for (const main_row& r : rows) {
      low = std::min(low, field(r));
    }
    return low;
  };
  main_row m = rows.front();
  m.run = run + " (median of " + std::to_string(rows.size()) + ")";
  m.swiss.ns_per_op = median([](const main_row& r) { return r.swiss.ns_per_op; });
  m.mix.ns_per_op = median([](const main_row& r) { return r.mix.ns_per_op; });
  m.swiss.ratio = lowest([](const main_row& r) { return r.swiss.ratio; });
  m.mix.ratio = lowest([](const main_row& r) { return r.mix.ratio; });
  std::printf("%s %s over %zu fresh resources: swiss %.0f ns/op (runs", name.c_str(),
              run.c_str(), rows.size(), m.swiss.ns_per_op);
  for (const main_row& r : rows) {
    std::printf(" %.0f", r.swiss.ns_per_op);
  }
  if (m.floor && m.floor->floor_ns_per_op > 0) {
    m.floor->floor_ns_per_op = median([](const main_row& r) { return r.floor->floor_ns_per_op; });
    m.floor->median_ratio =
        median([](const main_row& r) { return r.swiss.ns_per_op / r.floor->floor_ns_per_op; });
    std::printf("), measured/floor median %.2fx (runs", m.floor->median_ratio);
    for (const main_row& r : rows) {
      std::printf(" %.2f", r.swiss.ns_per_op / r.floor->floor_ns_per_op);
    }
  }
  if (m.floor && m.floor->in_run_ns_per_op > 0) {
    m.floor->in_run_ns_per_op =
        median([](const main_row& r) { return r.floor->in_run_ns_per_op; });
    m.floor->in_run_median_ratio =
        median([](const main_row& r) { return r.swiss.ns_per_op / r.floor->in_run_ns_per_op; });
    std::printf("), at each run's own costs median %.2fx (runs", m.floor->in_run_median_ratio);
    for (const main_row& r : rows) {
      std::printf(" %.2f", r.swiss.ns_per_op / r.floor->in_run_ns_per_op);
    }
  }
  std::printf("); mixed %.0f ns/op (runs", m.mix.ns_per_op);
  for (const main_row& r : rows) {
    std::printf(" %.0f", r.mix.ns_per_op);
  }
  std::printf("); lowest fractions %.4f / %.4f\n", m.swiss.ratio, m.mix.ratio);
  main_rows.push_back(std::move(m));
}

/// Both tables in markdown, for bench/README.md.
void print_markdown() {
  std::printf("\nmarkdown for bench/README.md:\n\n");
  if (!main_rows.empty()) {
    std::printf("| allocator | run | swiss | ns/op | swiss floor ns/op (x) | floor at the run's "
                "own costs (x) | mixed | ns/op |\n");
    std::printf("|---|---|---|---|---|---|---|---|\n");
    for (const main_row& r : main_rows) {
      std::string in_run = "-";
      if (r.floor && r.floor->in_run_ns_per_op > 0) {
        char text[64];
        std::snprintf(text, sizeof text, "%.0f (%.2fx)", r.floor->in_run_ns_per_op,
                      r.floor->in_run_median_ratio > 0
                          ? r.floor->in_run_median_ratio
                          : r.swiss.ns_per_op / r.floor->in_run_ns_per_op);
        in_run = text;
      }
      std::string floor = "-";
      if (r.floor && r.floor->floor_ns_per_op > 0) {
        char text[64];
        std::snprintf(text, sizeof text, "%.0f (%.2fx)", r.floor->floor_ns_per_op,
                      r.floor->median_ratio > 0 ? r.floor->median_ratio
                                                : r.swiss.ns_per_op / r.floor->floor_ns_per_op);
        floor = text;
      }
      std::printf("| %s | %s | %.4f | %.0f | %s | %s | %.4f | %.0f |\n", r.name.c_str(),
                  r.run.c_str(), r.swiss.ratio, r.swiss.ns_per_op, floor.c_str(), in_run.c_str(),
                  r.mix.ratio, r.mix.ns_per_op);
    }
  }
  if (!variant_rows.empty()) {
    std::printf("\n| variant | seed | allocator | cold | ns/op | warm | ns/op "
                "| vm calls/op cold (create/map/access) | warm |\n");
    std::printf("|---|---|---|---|---|---|---|---|---|\n");
    for (const variant_row& r : variant_rows) {
      std::printf("| %s | %llu | %s | %.4f | %.0f | %.4f | %.0f | %s | %s |\n", r.variant.c_str(),
                  static_cast<unsigned long long>(r.seed), r.allocator.c_str(), r.result.cold.ratio,
                  r.result.cold.ns_per_op, r.result.warm.ratio, r.result.warm.ns_per_op,
                  rates_text(r.result.cold_calls).c_str(), rates_text(r.result.warm_calls).c_str());
    }
  }
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

/// What to run: allocators (a name filter), the variants and seeds of the variants table.
struct selection {
  std::string only;  ///< run only the allocators whose name contains this (and no traces)
  std::vector<const mixed_variant*> variants;
  std::vector<std::uint64_t> seeds = {42, 1};
  int vm_runs = 5;  ///< fresh vm_pools in the main table (medians)
  bool variants_only = false;  ///< skip the main table (--variants-only)

  [[nodiscard]] bool wants(const char* name) const {
    return only.empty() || std::string(name).find(only) != std::string::npos;
  }
  [[nodiscard]] bool wants_in_main_table(const char* name) const {
    return !variants_only && wants(name);
  }
};

void run_simulated(const selection& what) {
  constexpr std::size_t capacity = 80 * GiB;
  std::printf("simulated 80 GiB device (no GPU): host-side bookkeeping only, no driver costs\n");
  if (vm_handle_bytes != 0) {  // said only when asked for: the default output stays as it was
    std::printf("vm_pool handles: %zu MiB (--handle-mib)\n", vm_handle_bytes / MiB);
  }
  if (vm_bulk_bytes != 0) {  // likewise
    std::printf("vm_pool bulk blocks: %zu MiB handles (--bulk-mib)\n", vm_bulk_bytes / MiB);
  }
  if (vm_growth_bytes != 0) {  // likewise
    std::printf("vm_pool growth: %zu MiB (--growth-mib)\n", vm_growth_bytes / MiB);
  }
  if (vm_small_chunk_bytes != 0) {  // likewise
    std::printf("vm_pool small chunks and growth_step: %zu MiB (--small-chunk-mib)\n",
                vm_small_chunk_bytes / MiB);
  }
  if (!what.variants_only) {
    print_header();
  }
  if (what.wants_in_main_table("first fit (reference)")) {
    cudamem::simulated_resource device{{.capacity = capacity}};
    allocator_under_test a = from_resource("first fit (reference)", device, {});
    run(a, "cold", capacity, true);
  }
  for (auto layout : {cudamem::simulated_layout::first_fit, cudamem::simulated_layout::paged}) {
    const char* name =
        layout == cudamem::simulated_layout::paged ? "pool over paged" : "pool over first fit";
    if (!what.wants_in_main_table(name)) {
      continue;
    }
    cudamem::simulated_resource device{{.capacity = capacity, .layout = layout}};
    cudamem::pool_resource pool{device};
    allocator_under_test a = from_resource(name, pool, {});
    a.empty_cache = [&] { pool.release(); };
    run(a, "cold", capacity, true);
    run(a, "warm", capacity, false);
  }
  // With bulk blocks the vm_pool's two vm_resources draw on one simulated device each time
  // (kept here, so that it outlives every vm_pool made below), at addresses 1 TiB apart.
  std::list<cudamem::simulated_resource> bulk_devices;
  const auto make_vm = [&bulk_devices] {
    const auto layer = [](cudamem::memory_resource* physical, std::uintptr_t nth) {
      return std::make_unique<cudamem::detail::simulated_vm_mapping>(
          cudamem::detail::simulated_vm_options{.capacity = capacity,
                                                .create_us = sim_create_us,
                                                .access_us = sim_access_us,
                                                .physical = physical,
                                                .first_address = nth << 40});
    };
    if (vm_bulk_bytes == 0) {
      return std::make_unique<cudamem::vm_pool_resource>(layer(nullptr, 1), bench_vm_options());
    }
    cudamem::simulated_resource& device = bulk_devices.emplace_back(cudamem::simulated_options{
        .capacity = capacity, .layout = cudamem::simulated_layout::paged});
    return std::make_unique<cudamem::vm_pool_resource>(layer(&device, 1), layer(&device, 2),
                                                       bench_vm_options());
  };
  // Streams are only numbers to the simulated layer (which tracks which frees are pending).
  const std::vector<cudaStream_t> fake_streams = {
      reinterpret_cast<cudaStream_t>(0x1000), reinterpret_cast<cudaStream_t>(0x2000),
      reinterpret_cast<cudaStream_t>(0x3000), reinterpret_cast<cudaStream_t>(0x4000)};
  if (what.wants_in_main_table("cudamem vm_pool")) {
    const auto vm = make_vm();
    allocator_under_test a = from_resource("cudamem vm_pool", *vm, fake_streams);
    a.empty_cache = [&] { vm->release(); };
    a.counters = vm_counters(*vm);
    a.handle_work = vm_handle_work(*vm);
    a.handle_bytes = vm->upstream_vm().handle_bytes();
    run(a, "cold", capacity, true);
    run(a, "warm", capacity, false);
    print_vm_stats(*vm, "  ");
  }
  std::vector<variant_allocator> variant_allocators;
  if (what.wants("cudamem vm_pool")) {
    variant_allocators.push_back({"cudamem vm_pool", [&](const mixed_spec& spec) {
                                    const auto vm = make_vm();
                                    allocator_under_test a =
                                        from_resource("cudamem vm_pool", *vm, fake_streams);
                                    return cold_then_warm(spec, a, vm.get());
                                  }});
  }
  run_variants(variant_allocators, what.variants, what.seeds, [] { return capacity; });
  if (what.only.empty()) {
    // The traces' peak live bytes (16 GiB) fit the simulated device; streams are ignored there.
    static cudamem::simulated_resource trace_device{
        {.capacity = capacity, .layout = cudamem::simulated_layout::paged}};
    standard_traces_section(
        [] { return std::make_unique<cudamem::pool_resource>(trace_device); },
        [&] { return std::unique_ptr<cudamem::memory_resource>(make_vm()); }, nullptr);
  }
  print_markdown();
}

/// "a,b,c" -> {"a", "b", "c"}.
std::vector<std::string> split_list(const std::string& text) {
  std::vector<std::string> parts;
  std::stringstream in(text);
  for (std::string part; std::getline(in, part, ',');) {
    if (!part.empty()) {
      parts.push_back(part);
    }
  }
  return parts;
}

/// `text` as a power of two of MiB from `least` to `most`; 0 when it is not one (the caller
/// says why and refuses it rather than round: a table never names a size the run did not use).
std::size_t power_of_two_mib(const char* text, unsigned long long least, unsigned long long most) {
  char* end = nullptr;
  const unsigned long long mib = std::strtoull(text, &end, 10);
  if (text[0] < '0' || text[0] > '9' || *end != '\0' || mib < least || mib > most ||
      (mib & (mib - 1)) != 0) {
    return 0;
  }
  return static_cast<std::size_t>(mib);
}

}  // namespace

int main(int argc, char** argv) {
  std::setvbuf(stdout, nullptr, _IOLBF, 0);  // progress shows even through a pipe
  bool simulated = false;
  std::string stream_model;  ///< --stream-model (with --simulated): empty, busy, idle, naive
  selection what;
  std::string variant_list = "all";
  const auto usage = [] {
    std::fprintf(stderr,
                 "usage: bench_fragmentation [--simulated] [--detail] [--only NAME] [--vm-runs N]\n"
                 "         [--pause-ms N] [--grow-ahead-mib N] [--grow-ahead-floor-mib N]\n"
                 "         [--growth-mib N] [--handle-mib 2|4|8|16|32|64]\n"
                 "         [--bulk-mib N (--simulated; a power of two larger than the handle)]\n"
                 "         [--small-chunk-mib 4|8|...|N (a multiple of the handle)]\n"
                 "         [--simulated-driver-us C,A] [--stream-model busy|idle|naive]\n"
                 "         [--variants-only]\n"
                 "         [--variant all|none|NAME[,NAME...]] [--seeds N[,N...]]\n"
                 "variants:");
    for (const mixed_variant& v : mixed_variants()) {
      std::fprintf(stderr, " %s", v.name.c_str());
    }
    std::fprintf(stderr, "\n");
    return 1;
  };
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--simulated") {
      simulated = true;
    } else if (arg == "--detail") {
      profile_ops = true;
    } else if (arg == "--only" && i + 1 < argc) {
      what.only = argv[++i];
    } else if (arg == "--pause-ms" && i + 1 < argc) {
      cold_pause_ms = std::max(0, std::atoi(argv[++i]));
    } else if (arg == "--grow-ahead-mib" && i + 1 < argc) {
      vm_grow_ahead_bytes = static_cast<std::size_t>(std::max(0, std::atoi(argv[++i]))) * MiB;
    } else if (arg == "--grow-ahead-floor-mib" && i + 1 < argc) {
      vm_grow_ahead_floor_bytes =
          static_cast<std::size_t>(std::max(0, std::atoi(argv[++i]))) * MiB;
    } else if (arg == "--growth-mib" && i + 1 < argc) {
      vm_growth_bytes = static_cast<std::size_t>(std::max(0, std::atoi(argv[++i]))) * MiB;
    } else if (arg == "--handle-mib" && i + 1 < argc) {
      // A handle is whole granules (2 MiB on current GPUs), and the pool's 64 MiB chunks must
      // be whole handles (vm_pool_options::pool) or a wholly free chunk could not be recycled:
      // so a power of two from 2 to 64. Anything else is refused rather than rounded, so that
      // a table never names a size the run did not use.
      const char* text = argv[++i];
      const std::size_t mib = power_of_two_mib(text, 2, 64);
      if (mib == 0) {
        std::fprintf(stderr,
                     "bench_fragmentation: --handle-mib %s: the handle size must be a power of "
                     "two from 2 to 64 (MiB): whole 2 MiB granules, and the pool's 64 MiB "
                     "chunks whole handles\n",
                     text);
        return usage();
      }
      vm_handle_bytes = mib * MiB;
    } else if (arg == "--bulk-mib" && i + 1 < argc) {
      // Checked against the handle once every option is read.
      const char* text = argv[++i];
      const std::size_t mib = power_of_two_mib(text, 4, 1ull << 20);
      if (mib == 0) {
        std::fprintf(stderr, "bench_fragmentation: --bulk-mib %s: a power of two of at least "
                             "4 (MiB)\n", text);
        return usage();
      }
      vm_bulk_bytes = mib * MiB;
    } else if (arg == "--small-chunk-mib" && i + 1 < argc) {
      // A power of two, at least the pool's 4 MiB small_block_limit (which must fit in a small
      // chunk); whether it is whole handles is checked once every option is read.
      const char* text = argv[++i];
      const std::size_t mib = power_of_two_mib(text, 4, 1ull << 20);
      if (mib == 0) {
        std::fprintf(stderr,
                     "bench_fragmentation: --small-chunk-mib %s: the chunk size must be a power "
                     "of two of at least 4 (MiB): the pool's small_block_limit\n",
                     text);
        return usage();
      }
      vm_small_chunk_bytes = mib * MiB;
    } else if (arg == "--simulated-driver-us" && i + 1 < argc) {
      const std::vector<std::string> us = split_list(argv[++i]);
      if (us.size() != 2) {
        return usage();
      }
      sim_create_us = static_cast<unsigned>(std::atoi(us[0].c_str()));
      sim_access_us = static_cast<unsigned>(std::atoi(us[1].c_str()));
    } else if (arg == "--stream-model" && i + 1 < argc) {
      stream_model = argv[++i];
      if (stream_model != "busy" && stream_model != "idle" && stream_model != "naive") {
        return usage();
      }
    } else if (arg == "--variants-only") {
      what.variants_only = true;
    } else if (arg == "--vm-runs" && i + 1 < argc) {
      what.vm_runs = std::max(1, std::atoi(argv[++i]));
    } else if (arg == "--variant" && i + 1 < argc) {
      variant_list = argv[++i];
    } else if (arg == "--seeds" && i + 1 < argc) {
      what.seeds.clear();
      for (const std::string& seed : split_list(argv[++i])) {
        char* end = nullptr;
        const unsigned long long n = std::strtoull(seed.c_str(), &end, 10);
        if (end == seed.c_str() || *end != '\0') {
          return usage();
        }
        what.seeds.push_back(n);
      }
    } else {
      return usage();
    }
  }
  if (vm_small_chunk_bytes != 0 || vm_handle_bytes != 0) {
    const std::size_t handle = vm_handle_bytes != 0 ? vm_handle_bytes : 64 * MiB;
    const std::size_t chunk = vm_small_chunk_bytes != 0 ? vm_small_chunk_bytes : 64 * MiB;
    if (chunk % handle != 0) {
      std::fprintf(stderr,
                   "bench_fragmentation: the vm_pool's small chunk (%zu MiB) must be a multiple "
                   "of its handle (%zu MiB): give --small-chunk-mib and --handle-mib to match\n",
                   chunk / MiB, handle / MiB);
      return usage();
    }
  }
  if (vm_bulk_bytes != 0) {
    const std::size_t handle = vm_handle_bytes != 0 ? vm_handle_bytes : 64 * MiB;
    if (!simulated || vm_bulk_bytes <= handle) {
      std::fprintf(stderr,
                   "bench_fragmentation: --bulk-mib (%zu) needs --simulated and a size larger "
                   "than the handle (%zu MiB; --handle-mib)\n",
                   vm_bulk_bytes / MiB, handle / MiB);
      return usage();
    }
  }
  if (variant_list != "none") {
    for (const mixed_variant& v : mixed_variants()) {
      if (variant_list == "all") {
        what.variants.push_back(&v);
      }
    }
    if (variant_list != "all") {
      for (const std::string& name : split_list(variant_list)) {
        const auto it = std::find_if(mixed_variants().begin(), mixed_variants().end(),
                                     [&](const mixed_variant& v) { return v.name == name; });
        if (it == mixed_variants().end()) {
          return usage();
        }
        what.variants.push_back(&*it);
      }
    }
  }
  if (simulated) {
    // --stream-model: the pools over simulated memory track streams too, their event calls
    // answered by a model device that is `busy` (no free on another stream completes
    // until a device synchronisation) or `idle` (every event complete when asked); `naive`:
    // busy, with the pools taking their first pick whatever it waits for. Where blocks land depends
    // on streams (the streams4 variant and the main table's vm_pool, which run on four).
    cudamem::detail::host_stream_events model;
    std::optional<cudamem::detail::scoped_pool_stream_events> use;
    std::optional<cudamem::detail::scoped_pool_stream_choices> choices;
    if (!stream_model.empty()) {
      model.complete_at_record(stream_model == "idle");
      use.emplace(model);
      if (stream_model == "naive") {
        choices.emplace(cudamem::detail::pool_stream_choices{false, false});
      }
      std::printf("stream model: %s\n", stream_model.c_str());
    }
    run_simulated(what);
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
  if (cold_pause_ms > 0) {
    std::printf("cold experiments start %d ms after the allocator emptied its cache\n",
                cold_pause_ms);
  }
  if (vm_handle_bytes != 0) {
    std::printf("vm_pool handles: %zu MiB (--handle-mib)\n", vm_handle_bytes / MiB);
  }
  if (vm_growth_bytes != 0) {  // likewise
    std::printf("vm_pool growth: %zu MiB (--growth-mib)\n", vm_growth_bytes / MiB);
  }
  if (vm_small_chunk_bytes != 0) {  // likewise
    std::printf("vm_pool small chunks and growth_step: %zu MiB (--small-chunk-mib)\n",
                vm_small_chunk_bytes / MiB);
  }
  if (!what.variants_only) {
    print_header();
  }
  std::vector<cudaStream_t> streams(4, nullptr);
  for (cudaStream_t& s : streams) {
    require(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreate");
  }
  const cudaStream_t stream = streams[0];
  const auto on = [&](std::size_t s) { return streams[s % streams.size()]; };
  const auto check_returned = [&](const char* who) {
    const std::size_t now = device_free_now();
    if (now + 64 * MiB < free_at_start) {
      std::printf("  note: %.2f GiB not back on the device after %s\n",
                  static_cast<double>(free_at_start - now) / GiB, who);
    }
  };

  if (what.wants_in_main_table("cudaMalloc")) {
    allocator_under_test a;
    a.name = "cudaMalloc";
    a.alloc = [](std::size_t n, std::size_t) -> void* {
      void* p = nullptr;
      if (cudaMalloc(&p, n) != cudaSuccess) {
        static_cast<void>(cudaGetLastError());
        return nullptr;
      }
      return p;
    };
    a.release = [](void* p, std::size_t, std::size_t) { require(cudaFree(p), "cudaFree"); };
    run(a, "-", device_free_now(), true);
    check_returned("cudaMalloc");
  }
  cudaMemPool_t mempool = nullptr;
  require(cudaDeviceGetDefaultMemPool(&mempool, 0), "cudaDeviceGetDefaultMemPool");
  std::uint64_t threshold = UINT64_MAX;
  require(cudaMemPoolSetAttribute(mempool, cudaMemPoolAttrReleaseThreshold, &threshold),
          "cudaMemPoolSetAttribute");
  const auto malloc_async = [&] {
    allocator_under_test a;
    a.name = "cudaMallocAsync";
    a.alloc = [&](std::size_t n, std::size_t s) -> void* {
      void* p = nullptr;
      if (cudaMallocAsync(&p, n, on(s)) != cudaSuccess) {
        static_cast<void>(cudaGetLastError());
        return nullptr;
      }
      return p;
    };
    a.release = [&](void* p, std::size_t, std::size_t s) {
      require(cudaFreeAsync(p, on(s)), "cudaFreeAsync");
    };
    a.empty_cache = [&] {
      require(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
      require(cudaMemPoolTrimTo(mempool, 0), "cudaMemPoolTrimTo");
    };
    return a;
  };
  if (what.wants_in_main_table("cudaMallocAsync")) {
    allocator_under_test a = malloc_async();
    const std::size_t free = device_free_now();
    run(a, "cold", free, true);
    run(a, "warm", free, false);
    a.empty_cache();
    check_returned("cudaMallocAsync");
  }
  if (what.wants_in_main_table("CUB caching")) {
    {  // the allocator is destroyed before its memory is counted back
      cub::CachingDeviceAllocator cub(8, 3, 22, std::size_t{64} << 30);
      allocator_under_test a;
      a.name = "CUB caching";
      a.alloc = [&](std::size_t n, std::size_t s) -> void* {
        void* p = nullptr;
        if (cub.DeviceAllocate(&p, n, on(s)) != cudaSuccess) {
          static_cast<void>(cudaGetLastError());
          return nullptr;
        }
        return p;
      };
      a.release = [&](void* p, std::size_t, std::size_t) {
        require(cub.DeviceFree(p), "CUB DeviceFree");
      };
      a.empty_cache = [&] { require(cub.FreeAllCached(), "CUB FreeAllCached"); };
      a.footprint = cub_bin;
      run(a, "cold", device_free_now(), true);
      a.empty_cache();
    }
    check_returned("CUB");
  }
  if (what.wants_in_main_table("thrust disjoint pool")) {
    {  // the allocator is destroyed before its memory is counted back
      using thrust_pool =
          thrust::mr::disjoint_unsynchronized_pool_resource<thrust::device_memory_resource,
                                                            thrust::mr::new_delete_resource>;
      thrust::device_memory_resource upstream;
      thrust::mr::new_delete_resource bookkeeper;
      thrust_pool pool(&upstream, &bookkeeper);
      allocator_under_test a;
      a.name = "thrust disjoint pool";
      a.alloc = [&](std::size_t n, std::size_t) {
        return or_null([&] { return pool.do_allocate(n, 256).get(); });
      };
      a.release = [&](void* p, std::size_t n, std::size_t) {
        pool.do_deallocate(thrust::device_ptr<void>(p), n, 256);
      };
      a.empty_cache = [&] { pool.release(); };
      run(a, "cold", device_free_now(), true);
      a.empty_cache();
    }
    check_returned("thrust's pool");
  }
  if (what.wants_in_main_table("cudamem pool")) {
    {  // the allocator is destroyed before its memory is counted back
      cudamem::device_resource device{0};
      cudamem::pool_resource pool{device};
      allocator_under_test a = from_resource("cudamem pool", pool, streams);
      a.empty_cache = [&] { pool.release(); };
      const std::size_t free = device_free_now();
      run(a, "cold", free, true);
      run(a, "warm", free, false);
    }
    check_returned("cudamem pool");
  }
  for (int rep = 0; what.wants_in_main_table("cudamem vm_pool") && rep < what.vm_runs; ++rep) {
    {
      // The floor's costs, now: the device is empty again, and the driver's costs drift with
      // what it did before (another allocator's frees, the previous run's).
      const std::size_t handle = bench_vm_options().handle_bytes;  // the runs' own handles
      measured_costs = measure_handle_costs(0, handle);
      std::printf("vm_pool run %d of %d; one %zu MiB handle costs the driver: cuMemCreate "
                  "%.1f us, cuMemMap %.1f us, cuMemSetAccess %.1f us (medians of 16, now)\n",
                  rep + 1, what.vm_runs, handle / MiB, measured_costs->create_us,
                  measured_costs->map_us, measured_costs->access_us);
    }
    {  // the allocator is destroyed before its memory is counted back
      auto layer = std::make_unique<timed_mapping>(0);
      timed_mapping& timing = *layer;
      const std::size_t free = device_free_now();
      cudamem::vm_pool_resource vm{std::move(layer), bench_vm_options()};
      allocator_under_test a = from_resource("cudamem vm_pool", vm, streams);
      a.empty_cache = [&] { vm.release(); };
      a.counters = vm_counters(vm);
      a.handle_work = vm_handle_work(vm);
      a.handle_bytes = vm.upstream_vm().handle_bytes();
      a.driver_detail = [&timing](const char* what) { return timing.delta(what); };
      a.costs_since = [&timing, handle = a.handle_bytes] { return timing.costs_since(handle); };
      run(a, "cold", free, true);
      run(a, "warm", free, false);
      print_vm_stats(vm, "  ");
      timing.print("  ");
    }
    check_returned("cudamem vm_pool");
  }
  if (what.vm_runs > 1) {
    keep_medians("cudamem vm_pool", "cold");
    keep_medians("cudamem vm_pool", "warm");
  }

  std::vector<variant_allocator> variant_allocators;
  if (what.wants("cudamem vm_pool")) {
    variant_allocators.push_back({"cudamem vm_pool", [&](const mixed_spec& spec) {
                                    variant_run r;
                                    {
                                      cudamem::vm_pool_resource vm{0, bench_vm_options()};
                                      allocator_under_test a =
                                          from_resource("cudamem vm_pool", vm, streams);
                                      r = cold_then_warm(spec, a, &vm);
                                    }
                                    check_returned("cudamem vm_pool");
                                    return r;
                                  }});
  }
  if (what.wants("cudaMallocAsync")) {
    variant_allocators.push_back({"cudaMallocAsync", [&](const mixed_spec& spec) {
                                    allocator_under_test a = malloc_async();
                                    const variant_run r = cold_then_warm(spec, a, nullptr);
                                    a.empty_cache();
                                    check_returned("cudaMallocAsync");
                                    return r;
                                  }});
  }
  run_variants(variant_allocators, what.variants, what.seeds, [] { return device_free_now(); });

  if (what.only.empty()) {
    standard_traces_section(
        [] {
          static cudamem::device_resource device{0};
          return std::make_unique<cudamem::pool_resource>(device);
        },
        [] { return std::make_unique<cudamem::vm_pool_resource>(0, bench_vm_options()); },
        stream);
  }
  print_markdown();
  for (const cudaStream_t s : streams) {
    require(cudaStreamSynchronize(s), "cudaStreamSynchronize");
    require(cudaStreamDestroy(s), "cudaStreamDestroy");
  }
  std::printf("\nbench_fragmentation: done in %.0f s\n", seconds_since(bench_start));
  return 0;
}
