// cudamem/detail/nccl/registration.hpp — `nccl_registration`, the owner of one registration of
// a memory range with a communicator: ncclCommRegister when made, ncclCommDeregister when it
// goes, move-only; the bad arguments refused before NCCL is called (including pageable host
// memory, which NCCL accepts at registration and fails on later, in a collective).
//
//   cudamem::nccl_registration r{comm, p, bytes};   // registered until the end of the scope
//   r.reset();                                       // or deregistered now
//
// Part of nccl.hpp, whose contract says what memory NCCL can register and why registration
// calls are serialised; nccl_registering_adaptor (there) keeps one of these per chunk.
#pragma once

#include <cudamem/detail/nccl/calls.hpp>
#include <cudamem/detail/report/figures.hpp>  // format_bytes
#include <cudamem/detail/sync/mutex.hpp>
#include <cudamem/error.hpp>

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <cstddef>
#include <source_location>
#include <stdexcept>
#include <string>
#include <utility>

namespace cudamem {

// --- one registration -----------------------------------------------------------------------

/// Owns one registration of [address, address + bytes) with a communicator: ncclCommRegister
/// in the constructor, ncclCommDeregister in the destructor (or reset()). Move-only. The
/// communicator must outlive it, and the memory must stay allocated while it is registered.
class nccl_registration {
 public:
  /// Nothing registered.
  nccl_registration() noexcept = default;

  /// Registers the range with `comm`. Throws std::invalid_argument for a null communicator or
  /// address, zero bytes, or memory CUDA does not know (pageable host memory: NCCL 2.28 accepts
  /// it at registration and fails later, in a collective), nccl_error when NCCL refuses
  /// (nothing is registered then).
  nccl_registration(ncclComm_t comm, void* address, std::size_t bytes,
                    std::source_location where = std::source_location::current())
      : nccl_registration(comm, address, bytes, detail::nccl_library_calls(), where) {}

  /// The same through a table of calls (tests; see detail::nccl_calls).
  nccl_registration(ncclComm_t comm, void* address, std::size_t bytes,
                    const detail::nccl_calls& calls,
                    std::source_location where = std::source_location::current())
      : calls_(&calls) {
    if (comm == nullptr || address == nullptr || bytes == 0) {
      throw std::invalid_argument(
          std::string("cudamem: nccl_registration: ") +
          (comm == nullptr ? "null communicator"
                           : address == nullptr ? "null address" : "zero bytes"));
    }
    int device = -1;
    detail::check_nccl_with(calls, calls.comm_device(comm, &device), "ncclCommCuDevice", where);
    const detail::lock_guard lock(detail::nccl_registration_mutex());
    const detail::nccl_device_scope on{device};
    check(on.error(), "nccl_registration: making the communicator's device current", where);
    if (&calls == &detail::nccl_library_calls()) {  // a fake NCCL (tests) takes any memory
      refuse_memory_cuda_does_not_know(address, bytes);
    }
    void* handle = nullptr;
    detail::check_nccl_with(calls, calls.comm_register(comm, address, bytes, &handle),
                            "ncclCommRegister of " + format_bytes(bytes), where);
    comm_ = comm;
    address_ = address;
    bytes_ = bytes;
    handle_ = handle;
    device_ = device;
  }

  ~nccl_registration() { reset(); }

  /// Takes `other`'s registration; `other` is left empty.
  nccl_registration(nccl_registration&& other) noexcept { take(other); }
  /// Deregisters what it holds, then takes `other`'s registration.
  nccl_registration& operator=(nccl_registration&& other) noexcept {
    if (this != &other) {
      reset();
      take(other);
    }
    return *this;
  }
  nccl_registration(const nccl_registration&) = delete;
  nccl_registration& operator=(const nccl_registration&) = delete;

  /// Deregisters now (nothing if empty); a failure goes to the error handler.
  void reset() noexcept {
    if (comm_ == nullptr) {
      return;
    }
    ncclResult_t code = ncclSuccess;
    {
      const detail::lock_guard lock(detail::nccl_registration_mutex());
      const detail::nccl_device_scope on{device_};
      report_error(on.error(), "nccl_registration: making the communicator's device current");
      // NCCL's handle may be null (registration switched off: NCCL_LOCAL_REGISTER=0); it
      // deregisters that as a no-op, so the call is made either way.
      code = calls_->comm_deregister(comm_, handle_);
    }
    if (code != ncclSuccess) {
      try {
        report_problem(detail::describe_nccl(*calls_, code,
                                             "nccl_registration: ncclCommDeregister of " +
                                                 format_bytes(bytes_)));
      } catch (...) {
        report_problem("nccl_registration: ncclCommDeregister failed");
      }
    }
    comm_ = nullptr;
    address_ = nullptr;
    bytes_ = 0;
    handle_ = nullptr;
  }

  /// Whether a range is registered.
  explicit operator bool() const noexcept { return comm_ != nullptr; }
  /// The communicator the range is registered with; null when empty.
  [[nodiscard]] ncclComm_t communicator() const noexcept { return comm_; }
  /// The start of the registered range.
  [[nodiscard]] void* address() const noexcept { return address_; }
  /// The registered range's size in bytes.
  [[nodiscard]] std::size_t bytes() const noexcept { return bytes_; }
  /// NCCL's handle (what ncclCommDeregister takes); null also when NCCL registered nothing.
  [[nodiscard]] void* handle() const noexcept { return handle_; }

 private:
  void take(nccl_registration& other) noexcept {
    comm_ = std::exchange(other.comm_, nullptr);
    address_ = std::exchange(other.address_, nullptr);
    bytes_ = std::exchange(other.bytes_, 0);
    handle_ = std::exchange(other.handle_, nullptr);
    device_ = other.device_;
    calls_ = other.calls_;
  }

  /// NCCL registers only memory CUDA made or pinned; measured on the H100 with NCCL 2.28.3,
  /// ncclCommRegister of a std::vector's bytes returns ncclSuccess (the mapping work is
  /// deferred to the first collective), so the mistake would surface far from its cause. Where
  /// CUDA cannot answer, NCCL is left to decide.
  static void refuse_memory_cuda_does_not_know(const void* address, std::size_t bytes) {
    cudaPointerAttributes attributes{};
    if (cudaPointerGetAttributes(&attributes, address) != cudaSuccess) {
      static_cast<void>(cudaGetLastError());
      return;
    }
    if (attributes.type == cudaMemoryTypeUnregistered) {
      throw std::invalid_argument(
          "cudamem: nccl_registration: the " + format_bytes(bytes) +
          " at this address are not memory CUDA allocated or pinned (pageable host memory?); "
          "NCCL can register only device memory (cudaMalloc, ncclMemAlloc, a cudamem device "
          "resource)");
    }
  }

  ncclComm_t comm_ = nullptr;
  void* address_ = nullptr;
  std::size_t bytes_ = 0;
  void* handle_ = nullptr;
  int device_ = -1;
  const detail::nccl_calls* calls_ = &detail::nccl_library_calls();
};

}  // namespace cudamem
