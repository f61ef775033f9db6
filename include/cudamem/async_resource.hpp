// cudamem/async_resource.hpp — stream-ordered device memory from a CUDA memory pool
// (cudaMallocFromPoolAsync / cudaFreeAsync): allocation and free cost well under a
// microsecond once the pool is warm, and neither blocks the host.
//
//   #include <cudamem/async_resource.hpp>
//
//   cudamem::async_resource mr{{.release_threshold = 1ull << 30}};  // its own pool, keeps 1 GiB
//   cudamem::stream s;
//   void* p = mr.allocate(64 << 20, 256, s);    // usable by work on s at once
//   kernel<<<g, b, 0, s.get()>>>(p);
//   mr.deallocate(p, 64 << 20, 256, s);         // returns at once; the pool reuses p on s at
//                                               // once and on other streams once s passes it
//   mr.trim(0);                                 // give unused pool memory back to the device
//   auto usage = mr.pool_usage();               // reserved / used, as the driver counts them
//
//   cudamem::async_resource shared{{.use_default_pool = true}};  // the device's default pool
//
// Contract (memory_resource.hpp's, plus)
// - Kind `device`. By default the resource creates a pool of its own on its device and
//   destroys it with itself; with `use_default_pool` it wraps the device's default pool
//   (cudaDeviceGetDefaultMemPool), which it never destroys and shares with every
//   cudaMallocAsync in the process. A device without memory-pool support throws `cuda_error`
//   (cudaErrorNotSupported) from the constructor; no GPU throws `no_device_error`.
// - Release threshold: the pool keeps up to this many unused bytes when a stream
//   synchronises, instead of returning them to the device. CUDA's default is 0 (give
//   everything back at every synchronisation, which makes the pool slow); pass
//   `release_threshold` to change it, e.g. UINT64_MAX to keep everything. `trim(keep)` returns
//   unused memory until at most `keep` bytes are held unused.
// - Streams: allocate and free are stream-ordered (cudaMallocFromPoolAsync / cudaFreeAsync).
//   Cross-stream reuse is made safe by the driver: a block freed on stream A is reused on
//   stream B only after the free has completed (the pool follows event dependencies, or it
//   uses a block whose free is already finished). The synchronous forms use the legacy
//   default stream of the resource's device and wait for it on allocation.
// - Alignment up to 256 bytes; more throws `std::invalid_argument`. Out of memory throws
//   `out_of_memory` naming cudaMallocFromPoolAsync, once the process's vm_resources have
//   given back what they held ahead of need on the device and the call was tried again
//   (detail/held_ahead.hpp).
// - `stats()`: `used_bytes` / `peak_used_bytes` count what this object handed out (exact
//   request sizes); `reserved_bytes` is the pool's reserved memory as the driver reports it
//   (for the default pool that includes every other user's share). `pool_usage()` gives the
//   driver's own figures (cudaMemPoolGetAttribute), which round each block up.
// - Destroying the resource while allocations are outstanding reports a leak through the
//   error handler; CUDA then releases the pool when its last block is freed.
#pragma once

#include <cudamem/detail/cuda/cuda_upstream.hpp>
#include <cudamem/out_of_memory.hpp>
#include <cudamem/memory_resource.hpp>

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace cudamem {

/// How to create an `async_resource`.
struct async_resource_options {
  int device = -1;                                  ///< -1: the current device
  bool use_default_pool = false;                    ///< wrap the device's default pool
  std::optional<std::uint64_t> release_threshold{}; ///< unset: leave the pool's own setting
};

/// What the driver says a pool holds (cudaMemPoolGetAttribute).
struct memory_pool_usage {
  std::uint64_t reserved = 0;       ///< backing memory held by the pool now
  std::uint64_t used = 0;           ///< of that, in blocks handed out
  std::uint64_t reserved_high = 0;  ///< high-water mark of `reserved`
  std::uint64_t used_high = 0;      ///< high-water mark of `used`
};

/// Stream-ordered device memory from a CUDA memory pool of its own (or the device's default pool).
class async_resource final : public memory_resource {
 public:
  /// A pool of its own on `options.device` (or the device's default pool). Throws cuda_error when
  /// the device has no memory pools.
  explicit async_resource(async_resource_options options = {})
      : memory_resource(memory_kind::device, detail::resolve_device(options.device)),
        owns_pool_(!options.use_default_pool) {
    const device_guard on{device()};
    int supported = 0;
    check(cudaDeviceGetAttribute(&supported, cudaDevAttrMemoryPoolsSupported, device()),
          "cudaDeviceGetAttribute(MemoryPoolsSupported)");
    if (supported == 0) {
      throw cuda_error(cudaErrorNotSupported, "async_resource: device " +
                                                  std::to_string(device()) +
                                                  " does not support memory pools");
    }
    if (owns_pool_) {
      cudaMemPoolProps props{};
      props.allocType = cudaMemAllocationTypePinned;  // "pinned" = ordinary device memory here
      props.handleTypes = cudaMemHandleTypeNone;
      props.location.type = cudaMemLocationTypeDevice;
      props.location.id = device();
      check(cudaMemPoolCreate(&pool_, &props), "cudaMemPoolCreate");
    } else {
      check(cudaDeviceGetDefaultMemPool(&pool_, device()), "cudaDeviceGetDefaultMemPool");
    }
    if (options.release_threshold) {
      try {
        set_release_threshold(*options.release_threshold);
      } catch (...) {
        destroy_pool();
        throw;
      }
    }
  }

  ~async_resource() override {
    if (usage_.used() != 0) {
      report_problem("async_resource destroyed with " + std::to_string(usage_.used()) +
                     " bytes still allocated from it (leaked; the pool is released when they "
                     "are freed)");
    }
    destroy_pool();
  }

  /// The pool handle, for calls cudamem does not wrap. Owned by this resource unless it wraps
  /// the default pool.
  [[nodiscard]] cudaMemPool_t pool_handle() const noexcept { return pool_; }
  /// Whether this resource created (and will destroy) its pool.
  [[nodiscard]] bool owns_pool() const noexcept { return owns_pool_; }

  /// Unused bytes the pool keeps at a synchronisation instead of returning them to the device.
  void set_release_threshold(std::uint64_t bytes) {
    check(cudaMemPoolSetAttribute(pool_, cudaMemPoolAttrReleaseThreshold, &bytes),
          "cudaMemPoolSetAttribute(ReleaseThreshold)");
  }
  /// The pool's release threshold now, in bytes.
  [[nodiscard]] std::uint64_t release_threshold() const { return attribute(cudaMemPoolAttrReleaseThreshold); }

  /// Returns unused pool memory to the device until at most `bytes_to_keep` unused bytes are
  /// held. Blocks still in use, or freed but not yet completed in stream order, stay.
  void trim(std::size_t bytes_to_keep = 0) {
    check(cudaMemPoolTrimTo(pool_, bytes_to_keep), "cudaMemPoolTrimTo");
  }

  /// The driver's figures for the pool.
  [[nodiscard]] memory_pool_usage pool_usage() const {
    return {attribute(cudaMemPoolAttrReservedMemCurrent), attribute(cudaMemPoolAttrUsedMemCurrent),
            attribute(cudaMemPoolAttrReservedMemHigh), attribute(cudaMemPoolAttrUsedMemHigh)};
  }

 private:
  std::uint64_t attribute(cudaMemPoolAttr which) const {
    std::uint64_t value = 0;
    check(cudaMemPoolGetAttribute(pool_, which, &value), "cudaMemPoolGetAttribute");
    return value;
  }

  void destroy_pool() noexcept {
    if (owns_pool_ && pool_ != nullptr) {
      report_error(cudaMemPoolDestroy(pool_), "async_resource: cudaMemPoolDestroy");
    }
    pool_ = nullptr;
  }

  void* do_allocate(std::size_t bytes, std::size_t alignment, stream_view stream) override {
    detail::check_cuda_alignment("async_resource", alignment);
    const device_guard on{device()};
    void* p = nullptr;
    std::size_t given_back = 0;
    const cudaError_t code = detail::allocate_giving_way(device(), given_back, [&] {
      return cudaMallocFromPoolAsync(&p, bytes, pool_, stream.get());
    });
    detail::throw_if_allocation_failed(code, *this, bytes, alignment, "cudaMallocFromPoolAsync",
                                       given_back);
    usage_.add(bytes);
    return p;
  }

  void do_deallocate(void* p, std::size_t bytes, std::size_t /*alignment*/,
                     stream_view stream) noexcept override {
    const detail::quiet_device_scope on{device(), "async_resource: switching device to free"};
    report_error(cudaFreeAsync(p, stream.get()), "async_resource: cudaFreeAsync");
    usage_.subtract(bytes);
  }

  void* do_allocate_sync(std::size_t bytes, std::size_t alignment) override {
    const device_guard on{device()};  // so that the legacy stream below is this device's
    void* p = do_allocate(bytes, alignment, stream_view{});
    const cudaError_t code = cudaStreamSynchronize(nullptr);
    if (code != cudaSuccess) {
      do_deallocate(p, bytes, alignment, stream_view{});
      check(code, "async_resource: cudaStreamSynchronize after a synchronous allocation");
    }
    return p;
  }

  void do_deallocate_sync(void* p, std::size_t bytes, std::size_t alignment) noexcept override {
    do_deallocate(p, bytes, alignment, stream_view{});  // no pending work uses p: any stream
  }

  bool do_is_equal(const memory_resource& other) const noexcept override {
    const auto* same = dynamic_cast<const async_resource*>(&other);
    return same != nullptr && same->pool_ == pool_;  // the same pool frees the same blocks
  }
  std::string_view do_name() const noexcept override { return "async_resource"; }
  std::string do_oom_hint(const memory_report& report, std::size_t position) const override {
    const resource_stats& here = report.chain[position].stats;
    if (report.verdict == oom_verdict::budget || report.verdict == oom_verdict::larger_than_device ||
        report.verdict == oom_verdict::unknown || here.reserved_bytes <= here.used_bytes) {
      return {};
    }
    std::string text = "The CUDA memory pool under this async_resource holds " +
                       format_bytes(here.reserved_bytes) + ", of which " +
                       format_bytes(here.used_bytes) + " is in use through it";
    if (!owns_pool_) {
      text += " (it is the device's default pool: every cudaMallocAsync of the process shares "
              "it)";
    }
    return text + ": trim(0) gives the unused memory back to the device, and a release "
                  "threshold below UINT64_MAX (set_release_threshold) lets each "
                  "synchronisation do so.";
  }
  resource_stats do_stats() const override {
    resource_stats s = usage_.leaf_stats();
    s.reserved_bytes = static_cast<std::size_t>(attribute(cudaMemPoolAttrReservedMemCurrent));
    return s;
  }

  cudaMemPool_t pool_ = nullptr;
  bool owns_pool_;
  detail::usage_counter usage_;
};

}  // namespace cudamem
