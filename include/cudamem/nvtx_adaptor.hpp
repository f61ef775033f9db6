// cudamem/nvtx_adaptor.hpp — a resource's allocations on the Nsight Systems timeline: an NVTX
// range around every allocate and deallocate, and a "bytes in use" counter, under the name you
// give it.
//
//   cudamem::pool_resource pool{device};
//   cudamem::nvtx_adaptor activations{pool, "activations"};   // the one switch: wrap it
//   void* p = activations.allocate(64 << 20, 256, s);
//   // nsys profile --trace=cuda,nvtx ./app: ranges "activations: allocate" (payload: bytes)
//   // in the domain "cudamem", and the counter "activations: bytes in use"
//
// Why an adaptor and not a flag on every resource: allocations through a pool cost tens of
// nanoseconds, and a range costs a tool's bookkeeping per call when Nsight is attached; so the
// timeline is opt-in, per resource, where you want to see it, and costs nothing where you did
// not ask for it. Wrap the resources you name (a pool per subsystem, say) and pass the adaptor
// wherever the resource went.
//
// Contract
// - Forwards every request to the upstream in the form it arrived in (stream-ordered or not);
//   out_of_memory from below is rethrown with this adaptor at the head of its report.
// - With a tool attached: a range `<name>: allocate` / `<name>: deallocate` (payload: the
//   bytes) on the calling thread around the upstream call, and after it a sample of the
//   counter `<name>: bytes in use` (the bytes allocated through this adaptor and not yet
//   freed, exact whatever the threads). A failed allocation ends its range and changes no
//   count.
// - With no tool attached no NVTX function is called; the adaptor still keeps its exact count
//   of bytes in use, one atomic add per request: +16 to +18 ns per operation over a pool on an
//   H100 host (bench_adaptors, row "nvtx"). With CUDAMEM_NVTX=0 it only forwards and counts.
// - Thread-safe when the upstream is. The name is copied.
#pragma once

#include <cudamem/detail/adaptors/adaptor_base.hpp>
#include <cudamem/detail/nvtx.hpp>
#include <cudamem/detail/sync/atomic.hpp>
#include <cudamem/memory_resource.hpp>

#if CUDAMEM_NVTX
#include <nvtx3/nvToolsExtCounters.h>
#endif

#include <cstddef>
#include <cstdint>
#include <mutex>  // std::call_once
#include <string>
#include <string_view>

namespace cudamem {

/// Forwards to its upstream inside NVTX ranges, and counts its bytes in use for Nsight.
class nvtx_adaptor final : public detail::adaptor_base<nvtx_adaptor> {
 public:
  /// Throws std::invalid_argument for an empty name (a timeline row needs one).
  nvtx_adaptor(memory_resource& upstream, std::string_view name)
      : adaptor_base(upstream), name_(name) {
    if (name_.empty()) {
      throw std::invalid_argument("nvtx_adaptor: the name is empty");
    }
  }

  /// The name its ranges and counter are shown under.
  [[nodiscard]] const std::string& label() const noexcept { return name_; }
  /// Bytes allocated through this adaptor and not yet freed.
  [[nodiscard]] std::int64_t bytes_in_use() const noexcept {
    return in_use_.load(detail::memory_order_relaxed);
  }

  /// Its part of every allocate (called by the adaptor base): the upstream's, inside a range.
  void* adapt_allocate(std::size_t bytes, std::size_t alignment, detail::request_stream stream) {
    const bool traced = begin_range(true, bytes);
    void* p = nullptr;
    try {
      p = forward_allocate(bytes, alignment, stream);
    } catch (...) {
      end_range(traced, 0);
      throw;
    }
    end_range(traced, static_cast<std::int64_t>(bytes));
    return p;
  }

  /// Its part of every deallocate (called by the adaptor base): the upstream's, inside a range.
  void adapt_deallocate(void* p, std::size_t bytes, std::size_t alignment,
                        detail::request_stream stream) noexcept {
    const bool traced = begin_range(false, bytes);
    forward_deallocate(p, bytes, alignment, stream);
    end_range(traced, -static_cast<std::int64_t>(bytes));
  }

 private:
  std::string_view do_name() const noexcept override { return "nvtx_adaptor"; }
  resource_stats do_stats() const override { return upstream_resource().stats(); }

#if CUDAMEM_NVTX
  /// Pushes the range when a tool is attached; returns whether it did.
  bool begin_range(bool allocate, std::size_t bytes) noexcept {
    std::call_once(setup_, [this] { setup(); });
    if (!traced_) {
      return false;
    }
    nvtxEventAttributes_t attr{};
    attr.version = NVTX_VERSION;
    attr.size = NVTX_EVENT_ATTRIB_STRUCT_SIZE;
    attr.messageType = NVTX_MESSAGE_TYPE_REGISTERED;
    attr.message.registered = allocate ? allocate_label_ : deallocate_label_;
    attr.payloadType = NVTX_PAYLOAD_TYPE_UNSIGNED_INT64;
    attr.payload.ullValue = bytes;
    nvtxDomainRangePushEx(domain_, &attr);
    return true;
  }

  /// Counts `delta` bytes in use; with a tool, pops the range and samples the counter.
  void end_range(bool traced, std::int64_t delta) noexcept {
    const std::int64_t now = in_use_.fetch_add(delta, detail::memory_order_relaxed) + delta;
    if (traced) {
      nvtxDomainRangePop(domain_);
      nvtxCounterSampleInt64(domain_, counter_, now);
    }
  }

  /// On first use (the CUDA runtime is up by then in any program that allocates device memory).
  void setup() noexcept {
    traced_ = detail::nvtx_tool_attached();
    if (!traced_) {
      return;
    }
    domain_ = detail::nvtx_domain();
    allocate_label_ = nvtxDomainRegisterStringA(domain_, (name_ + ": allocate").c_str());
    deallocate_label_ = nvtxDomainRegisterStringA(domain_, (name_ + ": deallocate").c_str());
    counter_name_ = name_ + ": bytes in use";
    nvtxCounterAttr_t attr{};
    attr.structSize = sizeof(attr);
    attr.schemaId = NVTX_PAYLOAD_ENTRY_TYPE_INT64;
    attr.name = counter_name_.c_str();
    attr.scopeId = NVTX_SCOPE_NONE;
    attr.counterId = NVTX_COUNTER_ID_NONE;
    counter_ = nvtxCounterRegister(domain_, &attr);
  }

  std::once_flag setup_;
  bool traced_ = false;  ///< a tool is attached (set once, in setup)
  nvtxDomainHandle_t domain_ = nullptr;
  nvtxStringHandle_t allocate_label_ = nullptr;
  nvtxStringHandle_t deallocate_label_ = nullptr;
  std::string counter_name_;
  std::uint64_t counter_ = 0;
#else
  static bool begin_range(bool, std::size_t) noexcept { return false; }
  void end_range(bool, std::int64_t delta) noexcept {
    in_use_.fetch_add(delta, detail::memory_order_relaxed);
  }
#endif

  std::string name_;
  detail::atomic<std::int64_t> in_use_{0};
};

}  // namespace cudamem
