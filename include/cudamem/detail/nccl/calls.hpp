// cudamem/detail/nccl/calls.hpp — how cudamem calls NCCL: the calls its owners make, as a
// table (the library's by default; host tests give a fake one with no GPU and no communicator),
// one registration call at a time in the whole process, the communicator's device made current
// around each call and the caller's restored, and what a failure says (`nccl_error`: the code,
// NCCL's text, its last warning; `check_nccl`).
//
//   cudamem::check_nccl(ncclAllReduce(...), "ncclAllReduce");   // nccl_error unless success
//   const detail::nccl_device_scope on{device};                  // restores the caller's device
//   detail::check_nccl_with(calls, calls.comm_register(...), "ncclCommRegister", where);
//
// Part of nccl.hpp, whose contract says why NCCL is linked rather than opened at run time, and
// which calls restore the device. Needs nccl.h (2.19 or newer) on the include path.
#pragma once

#if !__has_include(<nccl.h>)
#error "cudamem/nccl.hpp needs NCCL's nccl.h on the include path (pip install nvidia-nccl-cu13 \
puts it under site-packages/nvidia/nccl/include) and NCCL's library at link time"
#endif

#include <cudamem/detail/sync/mutex.hpp>
#include <cudamem/error.hpp>

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <cstddef>
#include <source_location>
#include <stdexcept>
#include <string>
#include <string_view>

#if NCCL_VERSION_CODE < 21900
#error "cudamem/nccl.hpp needs NCCL 2.19 or newer (ncclCommRegister, ncclMemAlloc)"
#endif

namespace cudamem {

namespace detail {

/// The NCCL calls the owners make, as a table: the library's by default; tests give a
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
[[nodiscard]] inline detail::mutex& nccl_registration_mutex() noexcept {
  static detail::mutex m;
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

}  // namespace cudamem
