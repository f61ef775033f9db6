// cudamem/managed_resource.hpp — unified (managed) memory from cudaMallocManaged: one pointer
// valid on the host and on every device, migrated on demand by the driver.
//
//   #include <cudamem/managed_resource.hpp>
//
//   cudamem::managed_resource mr;                       // cudaMemAttachGlobal
//   auto* v = static_cast<float*>(mr.allocate(n * sizeof(float)));
//   v[0] = 1.0f;                                        // host writes...
//   kernel<<<g, b>>>(v);                                // ...the device reads
//   cudaDeviceSynchronize();
//   mr.deallocate(v, n * sizeof(float));
//
// Contract (memory_resource.hpp's, plus)
// - Kind `managed` (host- and device-accessible). `device()` is the device current during
//   allocation; the memory itself may migrate anywhere.
// - `attach` is cudaMallocManaged's flag: cudaMemAttachGlobal (any stream on any device may
//   use it) or cudaMemAttachHost (the host, and streams it is attached to later); anything
//   else throws `std::invalid_argument`. A device without managed memory throws
//   `cuda_error` (cudaErrorNotSupported); no GPU throws `no_device_error`.
// - Alignment up to 256 bytes; more throws `std::invalid_argument`. Failure throws
//   `out_of_memory` naming cudaMallocManaged.
// - Streams: as device_resource — allocation is synchronous; the stream-ordered deallocate
//   waits for `stream` before cudaFree.
// - managed_resources of one device with the same flag are interchangeable.
#pragma once

#include <cudamem/detail/cuda/cuda_upstream.hpp>
#include <cudamem/out_of_memory.hpp>
#include <cudamem/memory_resource.hpp>

#include <cuda_runtime_api.h>

#include <cstddef>
#include <stdexcept>
#include <string>
#include <string_view>

namespace cudamem {

/// Unified memory from cudaMallocManaged / cudaFree, reachable from host and device.
class managed_resource final : public memory_resource {
 public:
  /// Managed memory with cudaMallocManaged flag `attach`, allocated with `device` current
  /// (-1: the device current now).
  explicit managed_resource(unsigned attach = cudaMemAttachGlobal, int device = -1)
      : memory_resource(memory_kind::managed, detail::resolve_device(device)),
        attach_(attach) {
    if (attach != cudaMemAttachGlobal && attach != cudaMemAttachHost) {
      throw std::invalid_argument(
          "cudamem: managed_resource: attach must be cudaMemAttachGlobal or cudaMemAttachHost, "
          "not " + std::to_string(attach));
    }
    int supported = 0;
    check(cudaDeviceGetAttribute(&supported, cudaDevAttrManagedMemory, this->device()),
          "cudaDeviceGetAttribute(ManagedMemory)");
    if (supported == 0) {
      throw cuda_error(cudaErrorNotSupported, "managed_resource: device " +
                                                  std::to_string(this->device()) +
                                                  " does not support managed memory");
    }
  }

  /// The cudaMallocManaged flag.
  [[nodiscard]] unsigned attach() const noexcept { return attach_; }

 private:
  void* do_allocate(std::size_t bytes, std::size_t alignment, stream_view /*stream*/) override {
    return do_allocate_sync(bytes, alignment);  // cudaMallocManaged is synchronous
  }

  void do_deallocate(void* p, std::size_t bytes, std::size_t alignment,
                     stream_view stream) noexcept override {
    const detail::quiet_device_scope on{device(), "managed_resource: switching device to free"};
    detail::wait_for_stream_before_free(stream, "managed_resource: waiting for the stream before cudaFree");
    do_deallocate_sync(p, bytes, alignment);
  }

  void* do_allocate_sync(std::size_t bytes, std::size_t alignment) override {
    detail::check_cuda_alignment("managed_resource", alignment);
    const device_guard on{device()};
    void* p = nullptr;
    detail::throw_if_allocation_failed(cudaMallocManaged(&p, bytes, attach_), *this, bytes,
                                       alignment, "cudaMallocManaged");
    usage_.add(bytes);
    return p;
  }

  void do_deallocate_sync(void* p, std::size_t bytes, std::size_t /*alignment*/) noexcept override {
    const detail::quiet_device_scope on{device(), "managed_resource: switching device to free"};
    report_error(cudaFree(p), "managed_resource: cudaFree");
    usage_.subtract(bytes);
  }

  bool do_is_equal(const memory_resource& other) const noexcept override {
    const auto* same = dynamic_cast<const managed_resource*>(&other);
    return same != nullptr && same->device() == device() && same->attach_ == attach_;
  }
  std::string_view do_name() const noexcept override { return "managed_resource"; }
  std::string do_oom_hint(const memory_report& report, std::size_t /*position*/) const override {
    if (report.verdict != oom_verdict::larger_than_device &&
        report.verdict != oom_verdict::exhausted && report.verdict != oom_verdict::unknown) {
      return {};
    }
    return "cudaMallocManaged could not give " + format_bytes(report.requested_bytes) +
           ": managed memory exceeds the device only where the driver pages it (Linux, a GPU "
           "with concurrent managed access), and host memory and swap bound it there too. "
           "Split the work, or free managed buffers no longer needed.";
  }
  resource_stats do_stats() const override { return usage_.leaf_stats(); }

  unsigned attach_;
  detail::usage_counter usage_;
};

}  // namespace cudamem
