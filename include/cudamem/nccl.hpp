// cudamem/nccl.hpp — NCCL on cudamem memory: communicators and buffer registrations as owners,
// pools whose chunks are registered with a communicator as they are made, and NCCL's own
// allocator as an upstream. Optional: it needs NCCL (2.19 or newer), which cudamem itself
// does not; it is not part of cudamem.hpp.
//
//   #include <cudamem/nccl.hpp>          // nccl.h on the include path; link the NCCL you use
//
//   setenv("NCCL_NVLS_ENABLE", "0", 0);  // NCCL's settings are the program's (see below)
//   auto comms = cudamem::nccl_communicator::init_all();          // one per visible GPU
//
//   // Device 0: a pool on NCCL's allocator, every chunk registered with comms[0] once.
//   cudamem::nccl_mem_resource nccl_memory{0};                      // ncclMemAlloc/ncclMemFree
//   cudamem::nccl_registering_adaptor registered{nccl_memory, comms[0].get()};
//   cudamem::pool_resource pool{registered};
//   cudamem::device_buffer<float> x(n, s, pool);                    // in a registered chunk
//   cudamem::check_nccl(ncclAllReduce(x.data(), x.data(), n, ncclFloat, ncclSum,
//                                     comms[0].get(), s.get()), "ncclAllReduce");
//
//   // The same with a vm_pool: its chunks and its large blocks are registered.
//   cudamem::vm_pool_resource vm_pool{0, cudamem::nccl_vm_pool_options(comms[0].get())};
//
//   // One buffer by hand: ncclCommRegister now, ncclCommDeregister at the end of the scope.
//   cudamem::nccl_registration r{comms[0].get(), p, bytes};
//
// Why. NCCL moves data fastest between buffers it has registered: it can then read and write
// the user's memory directly instead of staging it through its own buffers. A registration
// must be undone (ncclCommDeregister) before the memory is freed, and each costs NCCL work on
// first use (mapping the memory for the peers). A pool turns "one registration per buffer" into
// "one per chunk": the chunks live long, the blocks in them come and go, and NCCL finds which
// registered range a block lies in by its address.
//
// How NCCL is loaded: linked, not opened at run time. NVML (detail/nvml/nvml.hpp) is dlopen'd
// because every cudamem program may write an out-of-memory report and must not need the
// library to start. Here the program already calls NCCL (it made the communicator), and the
// communicator is a pointer into *that* NCCL's state: our calls must reach the same copy. A
// dlopen("libnccl.so.2") could load a second copy beside one linked statically into the
// program (some frameworks' builds are) and hand it a communicator it never made; a direct
// call resolves to the NCCL the program links, and a program that links none fails at link
// time, not at run time.
//
// Contract
// - Lifetimes: a communicator must outlive every registration made with it, and so every
//   nccl_registering_adaptor over it and every pool over such an adaptor: destroy pools and
//   buffers first, then the communicators (declare the communicators first).
// - NCCL's communicators are not thread-safe, and a registration is a call on the
//   communicator: allocating from a registering pool (when it grows), release() and
//   destruction may register or deregister. Do them on the thread that issues the
//   communicator's collectives, or serialise them with it. cudamem serialises its own
//   registration calls process-wide (one mutex), so two pools never race each other.
// - Registration needs memory NCCL can map for its peers: NCCL's documentation (User Buffer
//   Registration) asks for CUDA virtual memory created shareable as POSIX file descriptors
//   (and as fabric handles where the fabric exists), its address and size multiples of the
//   recommended granularity — what ncclMemAlloc gives (nccl_mem_resource), and what
//   nccl_vm_pool_options asks of a vm_pool. cudaMalloc'd memory is accepted by
//   ncclCommRegister, but NCCL 2.24+ uses it for its local zero-copy paths only with
//   NCCL_LEGACY_CUDA_REGISTER=1. NCCL also asks that, in one collective, either every rank's
//   buffers are registered or none are.
// - cudamem never sets NCCL's environment. Its programs and tests set NCCL_NVLS_ENABLE=0 (if
//   unset) before the first communicator: NVLink multicast can take a shared host's GPUs out
//   of service, and cudamem never calls the multicast API itself.
// - Errors: a failing NCCL call throws `nccl_error` (the code, NCCL's text and its last
//   warning — process-wide, so possibly older than the call —, what was being done, where);
//   in destructors and frees it goes to the error handler (error.hpp). Every owner's
//   constructor either owns what it made or throws having left nothing behind. Bad arguments (a null communicator or pointer, zero bytes, memory of
//   another device or kind than the communicator's) throw `std::invalid_argument` before NCCL
//   is called.
// - NCCL changes the calling thread's current device in some calls (ncclCommDeregister
//   leaves it on the communicator's device); every call here restores it.
//
// The parts, in order: nccl_error and check_nccl; nccl_communicator; nccl_registration;
// nccl_registering_adaptor (and nccl_vm_pool_options); nccl_mem_resource.
#pragma once

#if !__has_include(<nccl.h>)
#error "cudamem/nccl.hpp needs NCCL's nccl.h on the include path (pip install nvidia-nccl-cu13 \
puts it under site-packages/nvidia/nccl/include) and NCCL's library at link time"
#endif

#include <cudamem/detail/adaptors/adaptor_base.hpp>
#include <cudamem/detail/cuda/cuda_upstream.hpp>
#include <cudamem/device.hpp>
#include <cudamem/error.hpp>
#include <cudamem/memory_report.hpp>
#include <cudamem/memory_resource.hpp>
#include <cudamem/out_of_memory.hpp>
#include <cudamem/vm_pool_resource.hpp>
#include <cudamem/vm_resource.hpp>

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <source_location>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#if NCCL_VERSION_CODE < 21900
#error "cudamem/nccl.hpp needs NCCL 2.19 or newer (ncclCommRegister, ncclMemAlloc)"
#endif

namespace cudamem {

namespace detail {

/// The NCCL calls the owners below make, as a table: the library's by default; tests give a
/// fake one (no GPU, no communicator) or one that counts and forwards.
struct nccl_calls {
  ncclResult_t (*comm_register)(ncclComm_t, void*, std::size_t, void**);
  ncclResult_t (*comm_deregister)(ncclComm_t, void*);
  ncclResult_t (*comm_device)(ncclComm_t, int*);
  const char* (*error_string)(ncclResult_t);
  const char* (*last_error)(ncclComm_t);
};

[[nodiscard]] inline const nccl_calls& nccl_library_calls() noexcept {
  static const nccl_calls calls{&ncclCommRegister, &ncclCommDeregister, &ncclCommCuDevice,
                                &ncclGetErrorString, &ncclGetLastError};
  return calls;
}

/// cudamem's registration calls, one at a time in the whole process (see the contract).
[[nodiscard]] inline std::mutex& nccl_registration_mutex() noexcept {
  static std::mutex m;
  return m;
}

[[nodiscard]] constexpr std::string_view nccl_result_name(ncclResult_t code) noexcept {
  switch (code) {
    case ncclSuccess: return "ncclSuccess";
    case ncclUnhandledCudaError: return "ncclUnhandledCudaError";
    case ncclSystemError: return "ncclSystemError";
    case ncclInternalError: return "ncclInternalError";
    case ncclInvalidArgument: return "ncclInvalidArgument";
    case ncclInvalidUsage: return "ncclInvalidUsage";
    case ncclRemoteError: return "ncclRemoteError";
    case ncclInProgress: return "ncclInProgress";
    default: return "ncclResult";
  }
}

/// "context: ncclInvalidUsage (NCCL's text); NCCL's last warning: ..." (no location).
[[nodiscard]] inline std::string describe_nccl(const nccl_calls& calls, ncclResult_t code,
                                               std::string_view context) {
  std::string text;
  if (!context.empty()) {
    text.append(context).append(": ");
  }
  text.append(nccl_result_name(code));
  if (code >= ncclNumResults) {
    text.append(" ").append(std::to_string(static_cast<int>(code)));
  }
  const char* what = calls.error_string(code);
  text.append(" (").append(what != nullptr ? what : "no description").append(")");
  // NCCL keeps the text of its last warning (from any thread): often the real cause.
  const char* last = calls.last_error(nullptr);
  if (last != nullptr && *last != '\0') {
    text.append("; NCCL's last warning: ").append(last);
  }
  return text;
}

/// Makes `device` current on this thread, with its primary context (NCCL's driver calls need
/// one), for the scope, and then restores the previous device: NCCL may have changed it. A
/// negative device (a fake communicator in tests) calls no CUDA at all.
class nccl_device_scope {
 public:
  explicit nccl_device_scope(int device) noexcept {
    if (device < 0) {
      return;
    }
    error_ = cudaGetDevice(&previous_);
    if (error_ == cudaSuccess) {
      error_ = cudaSetDevice(device);  // also when already current: binds the context
      restore_ = true;
    }
  }
  ~nccl_device_scope() {
    if (restore_) {
      report_error(cudaSetDevice(previous_), "cudamem: restoring the device after an NCCL call");
    }
  }
  nccl_device_scope(const nccl_device_scope&) = delete;
  nccl_device_scope& operator=(const nccl_device_scope&) = delete;

  [[nodiscard]] cudaError_t error() const noexcept { return error_; }

 private:
  int previous_ = 0;
  cudaError_t error_ = cudaSuccess;
  bool restore_ = false;
};

}  // namespace detail

// --- errors ---------------------------------------------------------------------------------

/// A failed NCCL call.
class nccl_error : public std::runtime_error {
 public:
  /// `message` as composed by check_nccl: what was being done, the code, NCCL's text.
  nccl_error(ncclResult_t code, std::string_view message,
             std::source_location where = std::source_location::current())
      : std::runtime_error(std::string(message) + " at " + where.file_name() + ":" +
                           std::to_string(where.line())),
        code_(code),
        where_(where) {}

  /// NCCL's result code.
  [[nodiscard]] ncclResult_t code() const noexcept { return code_; }
  /// Where the failing call was made.
  [[nodiscard]] const std::source_location& where() const noexcept { return where_; }

 private:
  ncclResult_t code_;
  std::source_location where_;
};

namespace detail {
inline void check_nccl_with(const nccl_calls& calls, ncclResult_t code, std::string_view context,
                            std::source_location where) {
  if (code != ncclSuccess) [[unlikely]] {
    throw nccl_error(code, describe_nccl(calls, code, context), where);
  }
}
}  // namespace detail

/// Throws `nccl_error` unless `code` is ncclSuccess. `context` says what was being done.
/// (Non-blocking communicators return ncclInProgress from their calls: check those with
/// ncclCommGetAsyncError yourself.)
inline void check_nccl(ncclResult_t code, std::string_view context = {},
                       std::source_location where = std::source_location::current()) {
  detail::check_nccl_with(detail::nccl_library_calls(), code, context, where);
}

// --- communicators --------------------------------------------------------------------------

/// Owns an ncclComm_t: ncclCommDestroy when it goes. Move-only.
class nccl_communicator {
 public:
  nccl_communicator() noexcept = default;
  /// Takes ownership of `comm` (may be null: an empty owner).
  explicit nccl_communicator(ncclComm_t comm) noexcept : comm_(comm) {}
  ~nccl_communicator() { reset(); }

  nccl_communicator(nccl_communicator&& other) noexcept
      : comm_(std::exchange(other.comm_, nullptr)) {}
  nccl_communicator& operator=(nccl_communicator&& other) noexcept {
    if (this != &other) {
      reset();
      comm_ = std::exchange(other.comm_, nullptr);
    }
    return *this;
  }
  nccl_communicator(const nccl_communicator&) = delete;
  nccl_communicator& operator=(const nccl_communicator&) = delete;

  /// One communicator per device in `devices`, rank i on devices[i], for one process that
  /// drives them all (ncclCommInitAll). Empty `devices`: every visible device. A device that
  /// does not exist throws std::out_of_range, one listed twice std::invalid_argument (before
  /// NCCL is called); NCCL's failures throw nccl_error.
  [[nodiscard]] static std::vector<nccl_communicator> init_all(std::span<const int> devices = {}) {
    std::vector<int> list(devices.begin(), devices.end());
    if (list.empty()) {
      const int count = device_count();
      if (count == 0) {
        throw no_device_error(cudaErrorNoDevice, "nccl_communicator::init_all");
      }
      for (int d = 0; d < count; ++d) {
        list.push_back(d);
      }
    }
    for (std::size_t i = 0; i < list.size(); ++i) {
      validate_device(list[i]);
      if (std::find(list.begin(), list.begin() + static_cast<std::ptrdiff_t>(i), list[i]) !=
          list.begin() + static_cast<std::ptrdiff_t>(i)) {
        throw std::invalid_argument("cudamem: nccl_communicator::init_all: device " +
                                    std::to_string(list[i]) + " is listed twice");
      }
    }
    std::vector<ncclComm_t> raw(list.size(), nullptr);
    std::vector<nccl_communicator> owners;
    owners.reserve(list.size());  // nothing below throws once NCCL has made them
    const detail::nccl_device_scope keep{current_device()};  // restored afterwards
    check_nccl(ncclCommInitAll(raw.data(), static_cast<int>(raw.size()), list.data()),
               "ncclCommInitAll");
    for (ncclComm_t c : raw) {
      owners.emplace_back(c);
    }
    return owners;
  }

  [[nodiscard]] ncclComm_t get() const noexcept { return comm_; }
  explicit operator bool() const noexcept { return comm_ != nullptr; }

  /// The communicator's CUDA device (ncclCommCuDevice).
  [[nodiscard]] int device() const { return query(&ncclCommCuDevice, "ncclCommCuDevice"); }
  /// Its rank (ncclCommUserRank) and the number of ranks (ncclCommCount).
  [[nodiscard]] int rank() const { return query(&ncclCommUserRank, "ncclCommUserRank"); }
  [[nodiscard]] int size() const { return query(&ncclCommCount, "ncclCommCount"); }

  /// Destroys the communicator now (ncclCommDestroy); a failure goes to the error handler.
  void reset() noexcept {
    if (comm_ == nullptr) {
      return;
    }
    int device = -1;
    if (ncclCommCuDevice(comm_, &device) != ncclSuccess) {
      device = -1;
    }
    const detail::nccl_device_scope on{device};
    const ncclResult_t code = ncclCommDestroy(comm_);
    comm_ = nullptr;
    if (code != ncclSuccess) {
      try {
        report_problem(detail::describe_nccl(detail::nccl_library_calls(), code,
                                             "nccl_communicator: ncclCommDestroy"));
      } catch (...) {  // no memory for the text: say less
        report_problem("nccl_communicator: ncclCommDestroy failed");
      }
    }
  }
  /// Gives up ownership; the caller destroys the communicator.
  [[nodiscard]] ncclComm_t release() noexcept { return std::exchange(comm_, nullptr); }

 private:
  int query(ncclResult_t (*call)(ncclComm_t, int*), std::string_view what) const {
    if (comm_ == nullptr) {
      throw std::invalid_argument("cudamem: nccl_communicator: empty (no communicator)");
    }
    int value = 0;
    check_nccl(call(comm_, &value), what);
    return value;
  }

  ncclComm_t comm_ = nullptr;
};

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
    const std::lock_guard lock(detail::nccl_registration_mutex());
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

  nccl_registration(nccl_registration&& other) noexcept { take(other); }
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
      const std::lock_guard lock(detail::nccl_registration_mutex());
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
  [[nodiscard]] ncclComm_t communicator() const noexcept { return comm_; }
  [[nodiscard]] void* address() const noexcept { return address_; }
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

// --- registering what passes through --------------------------------------------------------

/// An adaptor between a pool and its upstream: every allocation it passes up is registered
/// with the communicator, and deregistered before it goes back down. Under a pool_resource
/// (or a vm_pool_resource: nccl_vm_pool_options) that makes every chunk registered once, as it
/// is made, so every block the pool hands out lies in registered memory.
///
/// Contract (memory_resource.hpp's, plus)
/// - Same kind and device as the upstream, which must be device memory of the communicator's
///   device (else std::invalid_argument; a null communicator too).
/// - allocate: the upstream's memory, registered; if the registration fails the memory goes
///   back and `nccl_error` is thrown; an upstream failure passes through (nothing registered).
/// - deallocate: deregisters, then frees. A stream-ordered free first waits for the stream on
///   the host: NCCL unmaps the memory from its peers when it deregisters, which must not
///   happen while a collective may still use it. (A pool returns chunks with the synchronous
///   free after settling its streams, so this costs a pool nothing.) A pointer it did not hand
///   out is passed down unregistered: the upstream judges it.
/// - Several communicators: stack one adaptor per communicator.
/// - `registrations()` / `registered_bytes()`: live now; `registrations_made()`: since
///   construction (what bench/nccl.cu reports per 1,000 allocations).
/// - Destroyed with registrations still live (memory allocated through it and not freed): they
///   are deregistered and reported; the memory stays with the upstream.
/// - Thread-safe, with the communicator caveat of the header's contract.
class nccl_registering_adaptor final : public detail::adaptor_base<nccl_registering_adaptor> {
 public:
  nccl_registering_adaptor(memory_resource& upstream, ncclComm_t comm,
                           const detail::nccl_calls& calls = detail::nccl_library_calls())
      : adaptor_base(upstream), comm_(comm), calls_(&calls) {
    if (comm == nullptr) {
      throw std::invalid_argument("cudamem: nccl_registering_adaptor: null communicator");
    }
    if (upstream.kind() != memory_kind::device) {
      throw std::invalid_argument("cudamem: nccl_registering_adaptor: NCCL registers device "
                                  "memory; the upstream gives " +
                                  std::string(to_string(upstream.kind())) + " memory");
    }
    int comm_device = -1;
    detail::check_nccl_with(calls, calls.comm_device(comm, &comm_device), "ncclCommCuDevice",
                            std::source_location::current());
    if (comm_device != upstream.device()) {
      throw std::invalid_argument(
          "cudamem: nccl_registering_adaptor: the communicator is on device " +
          std::to_string(comm_device) + ", the upstream's memory on device " +
          std::to_string(upstream.device()));
    }
  }

  ~nccl_registering_adaptor() override {
    const std::lock_guard lock(mutex_);
    if (!live_.empty()) {
      try {
        report_problem("nccl_registering_adaptor destroyed with " +
                       std::to_string(live_.size()) + " registration(s) (" +
                       format_bytes(registered_bytes_) +
                       ") still live: memory allocated through it was not freed; deregistered "
                       "now, the memory stays with the upstream");
      } catch (...) {  // no memory for the text: say less
        report_problem("nccl_registering_adaptor destroyed with registrations still live");
      }
    }
    live_.clear();  // each registration deregisters
  }

  nccl_registering_adaptor(const nccl_registering_adaptor&) = delete;
  nccl_registering_adaptor& operator=(const nccl_registering_adaptor&) = delete;

  [[nodiscard]] ncclComm_t communicator() const noexcept { return comm_; }
  /// Registrations live now, and their bytes.
  [[nodiscard]] std::size_t registrations() const {
    const std::lock_guard lock(mutex_);
    return live_.size();
  }
  [[nodiscard]] std::size_t registered_bytes() const {
    const std::lock_guard lock(mutex_);
    return registered_bytes_;
  }
  /// Registrations made since construction.
  [[nodiscard]] std::size_t registrations_made() const {
    const std::lock_guard lock(mutex_);
    return made_;
  }
  /// Whether `p` is the start of an allocation it registered and has not yet freed.
  [[nodiscard]] bool is_registered(const void* p) const {
    const std::lock_guard lock(mutex_);
    return live_.find(reinterpret_cast<std::uintptr_t>(p)) != live_.end();
  }

 private:
  friend class detail::adaptor_base<nccl_registering_adaptor>;

  void* adapt_allocate(std::size_t bytes, std::size_t alignment, detail::request_stream stream) {
    void* p = forward_allocate(bytes, alignment, stream);
    try {
      nccl_registration registration{comm_, p, bytes, *calls_};
      const std::lock_guard lock(mutex_);
      // If the map cannot take it, `registration` (or the node it moved into) deregisters.
      live_.emplace(reinterpret_cast<std::uintptr_t>(p), std::move(registration));
      registered_bytes_ += bytes;
      ++made_;
    } catch (...) {
      forward_deallocate(p, bytes, alignment, stream);
      throw;
    }
    return p;
  }

  void adapt_deallocate(void* p, std::size_t bytes, std::size_t alignment,
                        detail::request_stream stream) noexcept {
    nccl_registration registration;
    {
      const std::lock_guard lock(mutex_);
      const auto it = live_.find(reinterpret_cast<std::uintptr_t>(p));
      if (it != live_.end()) {
        registration = std::move(it->second);
        registered_bytes_ -= registration.bytes();
        live_.erase(it);
      }
    }
    if (registration && stream && device() >= 0) {
      detail::wait_for_stream_before_free(
          *stream, "nccl_registering_adaptor: waiting for the stream before deregistering");
    }
    registration.reset();  // before the memory goes back
    forward_deallocate(p, bytes, alignment, stream);
  }

  std::string_view do_name() const noexcept override { return "nccl_registering_adaptor"; }
  resource_stats do_stats() const override { return upstream_resource().stats(); }

  ncclComm_t comm_;
  const detail::nccl_calls* calls_;
  mutable std::mutex mutex_;  ///< guards the three below
  std::unordered_map<std::uintptr_t, nccl_registration> live_;
  std::size_t registered_bytes_ = 0;
  std::size_t made_ = 0;
};

/// vm_pool_options for a vm_pool_resource whose memory NCCL can register and use: handles
/// created shareable as POSIX file descriptors (`exportable`, what NCCL asks of cuMem memory),
/// and every pool chunk and every large block registered with `comm` as it leaves the
/// vm_resource, deregistered before it goes back (an nccl_registering_adaptor as the vm_pool's
/// upstream_adaptor). `options` may not have an upstream_adaptor of its own
/// (std::invalid_argument). The vm_pool's device must be the communicator's.
[[nodiscard]] inline vm_pool_options nccl_vm_pool_options(
    ncclComm_t comm, vm_pool_options options = {},
    const detail::nccl_calls& calls = detail::nccl_library_calls()) {
  if (comm == nullptr) {
    throw std::invalid_argument("cudamem: nccl_vm_pool_options: null communicator");
  }
  if (options.upstream_adaptor) {
    throw std::invalid_argument("cudamem: nccl_vm_pool_options: the options already have an "
                                "upstream_adaptor");
  }
  options.exportable = true;
  options.upstream_adaptor = [comm, &calls](vm_resource& vm) -> std::unique_ptr<memory_resource> {
    return std::make_unique<nccl_registering_adaptor>(vm, comm, calls);
  };
  return options;
}

// --- NCCL's allocator as an upstream --------------------------------------------------------

/// Device memory from ncclMemAlloc / ncclMemFree: CUDA virtual memory created the way NCCL
/// wants to register it (shareable handles, the recommended granularity, access for every
/// peer GPU). Each allocation is at least one granule (2 MiB on current GPUs): put a pool
/// over it (through an nccl_registering_adaptor) rather than allocating small buffers here.
///
/// Contract (memory_resource.hpp's, plus)
/// - Kind `device`; the constructor resolves and validates the device (no GPU:
///   `no_device_error`; an id that does not exist: std::out_of_range). Every call runs on it,
///   whatever device is current.
/// - Alignment up to 256 bytes (what every path of ncclMemAlloc guarantees; it falls back to
///   cudaMalloc where CUDA's virtual memory is off); more throws std::invalid_argument.
/// - Out of device memory throws `out_of_memory`, once the process's vm_resources gave back what
///   they held ahead of need on the device and it was tried again (detail/held_ahead.hpp); any
///   other NCCL failure `nccl_error`.
/// - Synchronous like cudaMalloc: the stream-ordered allocate ignores the stream, the
///   stream-ordered deallocate waits for its stream first. A failing ncclMemFree goes to the
///   error handler.
/// - stats(): bytes asked for (ncclMemAlloc rounds each up to a granule).
class nccl_mem_resource final : public memory_resource {
 public:
  explicit nccl_mem_resource(int device = -1)
      : memory_resource(memory_kind::device, detail::resolve_device(device)) {}

 private:
  void* do_allocate(std::size_t bytes, std::size_t alignment, stream_view /*stream*/) override {
    return do_allocate_sync(bytes, alignment);
  }

  void* do_allocate_sync(std::size_t bytes, std::size_t alignment) override {
    detail::check_cuda_alignment("nccl_mem_resource", alignment);
    const device_guard on{device()};
    void* p = nullptr;
    ncclResult_t code = ncclMemAlloc(&p, bytes);
    std::size_t given_back = 0;  // by the process's vm_resources (detail/held_ahead.hpp)
    for (bool tried_again = false; code != ncclSuccess; tried_again = true) {
      static_cast<void>(cudaGetLastError());  // the cudaMalloc fallback's error is not sticky
      std::string text =
          detail::describe_nccl(detail::nccl_library_calls(), code, "ncclMemAlloc");
      if (code != ncclUnhandledCudaError || !out_of_device_memory(text, bytes)) {
        throw nccl_error(code, text);
      }
      if (!tried_again) {  // memory held ahead of need gives way, then once more
        given_back = detail::give_back_held_ahead(detail::memory_domain{device(), nullptr});
        if (given_back != 0) {
          code = ncclMemAlloc(&p, bytes);
          continue;
        }
      }
      if (given_back != 0) {
        text += ", tried again after vm_resources gave back " + format_bytes(given_back) +
                " held ahead of need";
      }
      throw_out_of_memory(*this, bytes, alignment, text);
    }
    usage_.add(bytes);
    return p;
  }

  void do_deallocate(void* p, std::size_t bytes, std::size_t alignment,
                     stream_view stream) noexcept override {
    const detail::quiet_device_scope on{device(), "nccl_mem_resource: switching device to free"};
    detail::wait_for_stream_before_free(
        stream, "nccl_mem_resource: waiting for the stream before ncclMemFree");
    do_deallocate_sync(p, bytes, alignment);
  }

  void do_deallocate_sync(void* p, std::size_t bytes, std::size_t /*alignment*/) noexcept override {
    const ncclResult_t code = ncclMemFree(p);  // on the pointer's device, restored by NCCL
    if (code != ncclSuccess) {
      try {
        report_problem(detail::describe_nccl(detail::nccl_library_calls(), code,
                                             "nccl_mem_resource: ncclMemFree"));
      } catch (...) {
        report_problem("nccl_mem_resource: ncclMemFree failed");
      }
    }
    usage_.subtract(bytes);
  }

  /// NCCL reports a failed cuMemCreate or cudaMalloc as ncclUnhandledCudaError; its last
  /// warning names CUDA's error. Out of memory when it says so, or when the device has less
  /// free than was asked.
  [[nodiscard]] bool out_of_device_memory(const std::string& text, std::size_t bytes) const {
    if (text.find("out of memory") != std::string::npos) {
      return true;
    }
    std::size_t free = 0;
    std::size_t total = 0;
    if (cudaMemGetInfo(&free, &total) != cudaSuccess) {
      static_cast<void>(cudaGetLastError());
      return false;
    }
    return bytes > free;
  }

  bool do_is_equal(const memory_resource& other) const noexcept override {
    const auto* same = dynamic_cast<const nccl_mem_resource*>(&other);
    return same != nullptr && same->device() == device();
  }
  std::string_view do_name() const noexcept override { return "nccl_mem_resource"; }
  resource_stats do_stats() const override { return usage_.leaf_stats(); }

  detail::usage_counter usage_;
};

}  // namespace cudamem
