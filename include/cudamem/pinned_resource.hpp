// cudamem/pinned_resource.hpp — page-locked host memory from cudaHostAlloc / cudaFreeHost:
// the memory host<->device copies run fastest from, and that kernels can read directly.
//
//   #include <cudamem/pinned_resource.hpp>
//
//   cudamem::pinned_resource pinned;                           // cudaHostAllocDefault
//   cudamem::pinned_resource portable{cudaHostAllocPortable};  // usable from every context
//   void* p = pinned.allocate(64 << 20);                        // cudaHostAlloc
//   std::memset(p, 0, 64 << 20);                                // plain host memory to the CPU
//   pinned.deallocate(p, 64 << 20);                             // cudaFreeHost
//
// Contract (memory_resource.hpp's, plus)
// - Kind `pinned`: host-accessible, and device-accessible (with unified addressing, which
//   every platform CUDA 12+ supports, pinned memory is mapped into the device's address
//   space at the same address). `device()` is the device whose context allocates it.
// - `flags` are cudaHostAlloc's (cudaHostAllocDefault, Portable, Mapped, WriteCombined, or'ed);
//   other bits throw `std::invalid_argument` from the constructor. No GPU (or no driver):
//   `no_device_error` from the constructor.
// - Alignment up to 256 bytes; more throws `std::invalid_argument`.
// - Failure to pin throws `out_of_memory` naming cudaHostAlloc (verdict `unknown`: the
//   device's memory is not what ran out); other CUDA errors throw `cuda_error`.
// - Streams: cudaHostAlloc is synchronous (memory usable everywhere on return); the
//   stream-ordered deallocate waits for `stream` before cudaFreeHost, like device_resource,
//   so a pending copy into the memory cannot outlive it. Pinning is slow (tens of ms for
//   64 MiB): put a pool in front for anything allocated often.
// - pinned_resources of one device with the same flags are interchangeable (`is_equal`).
#pragma once

#include <cudamem/detail/cuda/cuda_upstream.hpp>
#include <cudamem/detail/compiled.hpp>
#include <cudamem/detail/report/oom_throw.hpp>
#if CUDAMEM_DEFINITIONS_IN_HEADERS  // in compiled mode the report is the library's
#include <cudamem/out_of_memory.hpp>
#endif
#include <cudamem/memory_resource.hpp>

#include <cuda_runtime_api.h>

#include <cstddef>
#include <stdexcept>
#include <string>
#include <string_view>

namespace cudamem {

/// Page-locked host memory from cudaHostAlloc / cudaFreeHost.
class pinned_resource final : public memory_resource {
 public:
  /// Pinned memory allocated with cudaHostAlloc `flags` in the context of `device`
  /// (-1: the device current now).
  explicit pinned_resource(unsigned flags = cudaHostAllocDefault, int device = -1)
      : memory_resource(memory_kind::pinned, detail::resolve_device(device)),
        flags_(validated(flags)) {}

  /// The cudaHostAlloc flags.
  [[nodiscard]] unsigned flags() const noexcept { return flags_; }

 private:
  static unsigned validated(unsigned flags) {
    constexpr unsigned known =
        cudaHostAllocPortable | cudaHostAllocMapped | cudaHostAllocWriteCombined;
    if ((flags & ~known) != 0) {
      throw std::invalid_argument("cudamem: pinned_resource: unknown cudaHostAlloc flags " +
                                  std::to_string(flags & ~known));
    }
    return flags;
  }

  void* do_allocate(std::size_t bytes, std::size_t alignment, stream_view /*stream*/) override {
    return do_allocate_sync(bytes, alignment);  // cudaHostAlloc is synchronous
  }

  void do_deallocate(void* p, std::size_t bytes, std::size_t alignment,
                     stream_view stream) noexcept override {
    const detail::quiet_device_scope on{device(), "pinned_resource: switching device to free"};
    detail::wait_for_stream_before_free(stream, "pinned_resource: waiting for the stream before cudaFreeHost");
    do_deallocate_sync(p, bytes, alignment);
  }

  void* do_allocate_sync(std::size_t bytes, std::size_t alignment) override {
    detail::check_cuda_alignment("pinned_resource", alignment);
    const device_guard on{device()};
    void* p = nullptr;
    detail::throw_if_allocation_failed(cudaHostAlloc(&p, bytes, flags_), *this, bytes, alignment,
                                       "cudaHostAlloc");
    usage_.add(bytes);
    return p;
  }

  void do_deallocate_sync(void* p, std::size_t bytes, std::size_t /*alignment*/) noexcept override {
    const detail::quiet_device_scope on{device(), "pinned_resource: switching device to free"};
    report_error(cudaFreeHost(p), "pinned_resource: cudaFreeHost");
    usage_.subtract(bytes);
  }

  bool do_is_equal(const memory_resource& other) const noexcept override {
    const auto* same = dynamic_cast<const pinned_resource*>(&other);
    return same != nullptr && same->device() == device() && same->flags_ == flags_;
  }
  std::string_view do_name() const noexcept override { return "pinned_resource"; }
  std::string do_oom_hint(const memory_report& report, std::size_t position) const override;
  resource_stats do_stats() const override { return usage_.leaf_stats(); }

  unsigned flags_;
  detail::usage_counter usage_;
};

// Reads the report: defined where the report's code is (detail/report/oom_throw.hpp says why).
#if CUDAMEM_DEFINITIONS_IN_HEADERS
CUDAMEM_DEFINITION std::string pinned_resource::do_oom_hint(const memory_report& report,
                                                          std::size_t position) const {
  if (report.verdict != oom_verdict::unknown) {
    return {};
  }
  return "Pinning " + format_bytes(report.requested_bytes) + " of host memory failed (" +
         format_bytes(report.chain[position].stats.used_bytes) +
         " pinned through this resource): page-locked memory is bounded by the machine's "
         "memory and by the locked-memory limit (ulimit -l). Pin once and reuse it (a "
         "pool_resource over this pinned_resource), pin less, or copy rarely used data "
         "from pageable memory.";
}
#endif

}  // namespace cudamem
