// cudamem/device_resource.hpp — device memory straight from cudaMalloc / cudaFree.
//
//   #include <cudamem/device_resource.hpp>
//
//   cudamem::device_resource mr;            // the current device, remembered from now on
//   cudamem::device_resource on_1{1};       // device 1, whatever device is current later
//   void* p = mr.allocate(1 << 20);         // cudaMalloc on mr's device
//   mr.deallocate(p, 1 << 20);              // cudaFree
//   mr.stats().used_bytes;                  // bytes handed out and not yet freed
//
// Contract (memory_resource.hpp's, plus)
// - Kind `device`. The constructor resolves and validates the device: no GPU throws
//   `no_device_error`, an id that does not exist `std::out_of_range`.
// - Every call switches to the resource's device for the duration of the call and back, so
//   the current device does not matter.
// - Alignment up to 256 bytes (cudaMalloc's guarantee); more throws `std::invalid_argument`.
// - cudaMalloc failing for lack of memory is tried once more if the process's vm_resources
//   held memory ahead of need on the device and gave it back (detail/held_ahead.hpp); then it
//   throws `out_of_memory` ("cudaMalloc returned cudaErrorMemoryAllocation ..."); any other
//   CUDA error throws `cuda_error`. A failing cudaFree goes to the error handler.
// - Streams: cudaMalloc is synchronous, so the stream-ordered allocate ignores the stream —
//   the memory is usable by every stream at once. cudaFree is synchronous too, but whether it
//   waits for work on every stream is the driver's business; we do not rely on it. The
//   stream-ordered deallocate first waits for `stream` (cudaStreamSynchronize), so the free
//   cannot overtake the memory's last use on that stream. The synchronous deallocate does not
//   wait: the caller promised no pending work uses the memory.
//   This makes device_resource slow for stream-ordered code (every free blocks the host);
//   use async_resource or a pool there. It is the right default for simple programs.
// - All device_resources of one device are interchangeable (`is_equal`).
// - Destroying a device_resource frees nothing (it holds no state but counters): memory it
//   gave out stays valid and may be freed by another device_resource of the same device.
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
#include <string>
#include <string_view>

namespace cudamem {

/// Device memory from cudaMalloc / cudaFree on one device.
class device_resource final : public memory_resource {
 public:
  /// Device memory of `device` (-1: the device current now).
  explicit device_resource(int device = -1)
      : memory_resource(memory_kind::device, detail::resolve_device(device)) {}

 private:
  void* do_allocate(std::size_t bytes, std::size_t alignment, stream_view /*stream*/) override {
    return do_allocate_sync(bytes, alignment);  // cudaMalloc is synchronous: ready everywhere
  }

  void do_deallocate(void* p, std::size_t bytes, std::size_t alignment,
                     stream_view stream) noexcept override {
    const detail::quiet_device_scope on{device(), "device_resource: switching device to free"};
    detail::wait_for_stream_before_free(stream, "device_resource: waiting for the stream before cudaFree");
    do_deallocate_sync(p, bytes, alignment);
  }

  void* do_allocate_sync(std::size_t bytes, std::size_t alignment) override {
    detail::check_cuda_alignment("device_resource", alignment);
    const device_guard on{device()};
    void* p = nullptr;
    std::size_t given_back = 0;
    const cudaError_t code =
        detail::allocate_giving_way(device(), given_back, [&] { return cudaMalloc(&p, bytes); });
    detail::throw_if_allocation_failed(code, *this, bytes, alignment, "cudaMalloc", given_back);
    usage_.add(bytes);
    return p;
  }

  void do_deallocate_sync(void* p, std::size_t bytes, std::size_t /*alignment*/) noexcept override {
    const detail::quiet_device_scope on{device(), "device_resource: switching device to free"};
    report_error(cudaFree(p), "device_resource: cudaFree");
    usage_.subtract(bytes);
  }

  bool do_is_equal(const memory_resource& other) const noexcept override {
    const auto* same = dynamic_cast<const device_resource*>(&other);
    return same != nullptr && same->device() == device();
  }
  std::string_view do_name() const noexcept override { return "device_resource"; }
  /// cudaMalloc'd memory: a pool over it may register its chunks as NVTX heaps.
  bool do_allows_nvtx_heaps() const noexcept override { return true; }
  std::string do_oom_hint(const memory_report& report, std::size_t position) const override;
  resource_stats do_stats() const override { return usage_.leaf_stats(); }

  detail::usage_counter usage_;
};

// Reads the report: defined where the report's code is (detail/report/oom_throw.hpp says why).
#if CUDAMEM_DEFINITIONS_IN_HEADERS
CUDAMEM_DEFINITION std::string device_resource::do_oom_hint(const memory_report& report,
                                                          std::size_t position) const {
  // Only the device's own fragmentation (not a pool's above it) is cudaMalloc's to explain.
  if (report.verdict != oom_verdict::fragmentation || report.verdict_subject() != position ||
      !report.device_free) {
    return {};
  }
  return "cudaMalloc could not find " + format_bytes(report.requested_bytes) +
         " in one piece although the device reports " + format_bytes(*report.device_free) +
         " free: that memory lies in pieces between other allocations, or part of it is the "
         "driver's own. Take large buffers first, or through a pool that holds its memory "
         "from the start (pool_resource with initial_size), or use vm_pool_resource, which "
         "maps free physical memory behind a fresh range.";
}
#endif

}  // namespace cudamem
