// cudamem/error.hpp — CUDA errors as typed C++ exceptions, and a handler for errors that
// cannot be thrown.
//
//   #include <cudamem/error.hpp>
//
//   float* p = nullptr;
//   cudamem::check(cudaMalloc(&p, 1 << 20));        // throws cudamem::cuda_error on failure,
//                                                  // naming this file and line
//   try {
//     cudamem::check(cudaSetDevice(0));
//   } catch (const cudamem::no_device_error& e) {  // no GPU, no driver, or a stub driver
//     std::puts(e.what());
//   }
//
//   // Destructors cannot throw; they report through the error handler instead:
//   cudamem::set_error_handler([](const cudamem::error_report& r) noexcept { log(r.message); });
//
// Contract
// - `check(code)` does nothing for cudaSuccess and otherwise throws. It clears CUDA's
//   "last error" first so the failure does not resurface in an unrelated later call.
// - `cuda_error` carries the code, its name (`cudaErrorMemoryAllocation`), CUDA's message,
//   what was being done, and the caller's source location. `what()` puts them in one line.
// - "No usable device" (cudaErrorNoDevice, cudaErrorInsufficientDriver, cudaErrorStubLibrary,
//   and an invalid device ordinal when no device exists at all) throws `no_device_error`, a
//   `cuda_error`, whose message tells the user what to check. `is_no_device(code)` tests a code.
// - `report_error(...)` hands an error to the current handler. The default handler prints one
//   line to stderr. Errors that mean the CUDA runtime is already unloading
//   (cudaErrorCudartUnloading, during static destruction at exit) are dropped silently: the
//   memory goes back to the driver with the process anyway, and a message or abort there helps
//   nobody.
// - Handlers must not throw (they are called from destructors); the type says so.
#pragma once

#if __cplusplus < 202002L
#error "cudamem needs C++20. With CMake set CXX_STANDARD 20 (and CUDA_STANDARD 20 for .cu files)."
#endif

#include <cudamem/detail/sync/atomic.hpp>

#include <cuda_runtime_api.h>

#include <cstdio>
#include <source_location>
#include <stdexcept>
#include <string>
#include <string_view>

namespace cudamem {

/// True for the codes that mean "this machine has no usable CUDA device".
[[nodiscard]] constexpr bool is_no_device(cudaError_t code) noexcept {
  return code == cudaErrorNoDevice || code == cudaErrorInsufficientDriver ||
         code == cudaErrorStubLibrary;
}

/// True for the codes CUDA returns while the runtime is being torn down at process exit.
[[nodiscard]] constexpr bool is_teardown(cudaError_t code) noexcept {
  return code == cudaErrorCudartUnloading;
}

/// A failed CUDA runtime or driver call.
class cuda_error : public std::runtime_error {
 public:
  /// An error for `code`; what() reads "<context>: <name> (<description>) at <file>:<line>".
  cuda_error(cudaError_t code, std::string_view context,
             std::source_location where = std::source_location::current())
      : std::runtime_error(compose(code, context, where)), code_(code), where_(where) {}

  /// The CUDA error code.
  [[nodiscard]] cudaError_t code() const noexcept { return code_; }
  /// The code's name, e.g. "cudaErrorMemoryAllocation".
  [[nodiscard]] const char* name() const noexcept { return cudaGetErrorName(code_); }
  /// CUDA's own description, e.g. "out of memory".
  [[nodiscard]] const char* description() const noexcept { return cudaGetErrorString(code_); }
  /// Where the failing call was made (the caller of `check`, not cudamem's internals).
  [[nodiscard]] const std::source_location& where() const noexcept { return where_; }

 private:
  static std::string compose(cudaError_t code, std::string_view context,
                             const std::source_location& where) {
    std::string text;
    if (!context.empty()) {
      text.append(context).append(": ");
    }
    text.append(cudaGetErrorName(code)).append(" (").append(cudaGetErrorString(code)).append(")");
    text.append(" at ").append(where.file_name()).append(":").append(std::to_string(where.line()));
    return text;
  }

  cudaError_t code_;
  std::source_location where_;
};

/// "This machine has no usable CUDA device": no GPU, no driver, a driver too old for this
/// runtime, or the stub library that ships with the toolkit for building without a driver.
class no_device_error : public cuda_error {
 public:
  /// An error for `code`, with a hint of what to check (the driver, nvidia-smi) in what().
  no_device_error(cudaError_t code, std::string_view context,
                  std::source_location where = std::source_location::current())
      : cuda_error(code, with_hint(code, context), where) {}

 private:
  static std::string with_hint(cudaError_t code, std::string_view context) {
    std::string text = "no usable CUDA device";
    if (!context.empty()) {
      text.append(" (").append(context).append(")");
    }
    // cudaErrorInsufficientDriver is also what a machine with no driver at all reports.
    text.append(code == cudaErrorInsufficientDriver
                    ? " - no NVIDIA driver, or one older than this CUDA runtime: install or "
                      "update the driver and check `nvidia-smi`"
                    : " - check `nvidia-smi`, the NVIDIA driver, and CUDA_VISIBLE_DEVICES");
    return text;
  }
};

/// Throws `no_device_error` or `cuda_error` unless `code` is cudaSuccess.
/// `context` says what was being done ("cudaMalloc of 1 GiB"); `where` defaults to the caller.
inline void check(cudaError_t code, std::string_view context = {},
                  std::source_location where = std::source_location::current()) {
  if (code == cudaSuccess) [[likely]] {
    return;
  }
  // Reset the runtime's "last error" so that a later, unrelated cudaGetLastError() does not
  // report this failure a second time (sticky errors stay, as CUDA decides).
  static_cast<void>(cudaGetLastError());
  if (is_no_device(code)) {
    throw no_device_error(code, context, where);
  }
  throw cuda_error(code, context, where);
}

// --- errors that cannot be thrown -------------------------------------------------------------

/// What the error handler receives. `code` is cudaSuccess for problems found by cudamem
/// itself rather than returned by CUDA (a leak, a double free).
struct error_report {
  cudaError_t code;            ///< the CUDA code, or cudaSuccess for a problem cudamem found
  std::string_view message;    ///< what went wrong, one line
  std::source_location where;  ///< where it was reported from
};

/// An error handler: called for failures in destructors and other places that cannot throw.
using error_handler = void (*)(const error_report&) noexcept;

/// The default handler: one line on stderr.
inline void print_error(const error_report& report) noexcept {
  if (report.code == cudaSuccess) {
    std::fprintf(stderr, "cudamem: %.*s [%s:%u]\n", static_cast<int>(report.message.size()),
                 report.message.data(), report.where.file_name(),
                 static_cast<unsigned>(report.where.line()));
  } else {
    std::fprintf(stderr, "cudamem: %.*s: %s (%s) [%s:%u]\n",
                 static_cast<int>(report.message.size()), report.message.data(),
                 cudaGetErrorName(report.code), cudaGetErrorString(report.code),
                 report.where.file_name(), static_cast<unsigned>(report.where.line()));
  }
}

namespace detail {
inline atomic<error_handler>& handler_slot() noexcept {
  static atomic<error_handler> slot{&print_error};
  return slot;
}
}  // namespace detail

/// Replaces the error handler (null restores the default) and returns the previous one.
inline error_handler set_error_handler(error_handler handler) noexcept {
  return detail::handler_slot().exchange(handler != nullptr ? handler : &print_error);
}

/// The current error handler.
[[nodiscard]] inline error_handler get_error_handler() noexcept {
  return detail::handler_slot().load();
}

/// Reports an error that cannot be thrown. Teardown errors are dropped (see the contract).
inline void report_error(cudaError_t code, std::string_view message,
                         std::source_location where = std::source_location::current()) noexcept {
  if (code == cudaSuccess || is_teardown(code)) {
    return;
  }
  static_cast<void>(cudaGetLastError());
  get_error_handler()(error_report{code, message, where});
}

/// Reports a problem cudamem found itself (no CUDA code): a leak, a bad free.
inline void report_problem(std::string_view message,
                           std::source_location where = std::source_location::current()) noexcept {
  get_error_handler()(error_report{cudaSuccess, message, where});
}

}  // namespace cudamem
