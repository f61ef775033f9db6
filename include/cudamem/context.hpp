// cudamem/context.hpp — an owning CUDA context, and a scope in which a context is current.
//
//   #include <cudamem/context.hpp>
//
//   cudamem::context ctx{{.device = 0, .flags = CU_CTX_SCHED_BLOCKING_SYNC}};
//   {
//     cudamem::context_guard on{ctx};   // ctx is current on this thread in this scope: driver
//     run_work();                       // and runtime calls (cudaMalloc, launches) use it...
//   }                                   // ...and whatever was current before is again, however
//                                       // the scope is left
//   auto [free, total] = ctx.memory();  // its device's memory, asked from inside ctx
//                                       // ~context destroys it and everything made in it
//
// Why own contexts. A context holds device memory for itself (hundreds of MiB for code,
// local memory, printf and malloc heaps) plus every allocation made in it. Created raw and
// skipped by an exception, it keeps all of it until the process exits: the device reports
// that memory as used by a process that looks idle. `context` destroys it on every
// path.
//
// Contract
// - `context{options}` creates a context on `options.device` (-1: the current device) with
//   `options.flags` (CU_CTX_* bits: one scheduling mode and any of CU_CTX_MAP_HOST,
//   CU_CTX_LMEM_RESIZE_TO_MAX, CU_CTX_COREDUMP_ENABLE, CU_CTX_USER_COREDUMP_ENABLE,
//   CU_CTX_SYNC_MEMOPS). Unlike cuCtxCreate it does NOT leave the new context current: the
//   thread's current context is the same after the constructor as before it, so creating a
//   context is not a hidden global change. Use `context_guard` to work in it.
// - Bad input throws before anything is created: an unknown flag bit or two scheduling modes
//   `std::invalid_argument`, an invalid device `std::out_of_range`, no device or no driver
//   `no_device_error`. A failure after creation (rare) destroys the context before throwing.
// - Move-only; a moved-from context holds nothing. Move-assignment destroys the context held
//   before. The destructor is noexcept: cuCtxDestroy, failures to the error handler, quiet at
//   process exit. Destroying a context frees everything allocated in it, so every owner of
//   memory or streams made inside it must be gone first; the context must not be current on
//   another thread when it is destroyed (if it is current on this thread, the driver pops it).
// - `context_guard{ctx}` pushes `ctx` onto the calling thread's context stack; the destructor
//   pops it, so the previous current context (or none) is current again, on every exit path.
//   It takes a `context`, a `primary_context`, or a raw CUcontext (not null). Neither
//   copyable nor movable: it belongs to its scope and its thread. Declare it after the
//   context it pushes, so the context outlives it. Before popping, the guard checks that its
//   context is still the current one; if not — code in the scope pushed a context and left it
//   pushed, or destroyed the guard's context (the driver pops a destroyed current context
//   itself) — popping would remove someone else's context, so the guard leaves the stack
//   alone and reports the broken nesting to the error handler rather than guess.
#pragma once

#include <cudamem/detail/cuda/driver.hpp>
#include <cudamem/device.hpp>
#include <cudamem/error.hpp>
#include <cudamem/primary_context.hpp>

#include <cuda.h>

#include <stdexcept>
#include <string>
#include <utility>

namespace cudamem {

/// How to create a `context`.
struct context_options {
  int device = -1;                 ///< -1: the current device
  unsigned flags = CU_CTX_SCHED_AUTO;  ///< CU_CTX_* bits, see the contract
};

/// Throws std::invalid_argument unless `flags` is a valid CU_CTX_* combination for creation.
inline void validate_context_flags(unsigned flags) {
  if ((flags & ~static_cast<unsigned>(CU_CTX_FLAGS_MASK)) != 0) {
    throw std::invalid_argument("cudamem::context: flags " + std::to_string(flags) +
                                " have bits outside CU_CTX_FLAGS_MASK");
  }
  const unsigned schedule = flags & static_cast<unsigned>(CU_CTX_SCHED_MASK);
  if (schedule != CU_CTX_SCHED_AUTO && schedule != CU_CTX_SCHED_SPIN &&
      schedule != CU_CTX_SCHED_YIELD && schedule != CU_CTX_SCHED_BLOCKING_SYNC) {
    throw std::invalid_argument("cudamem::context: flags " + std::to_string(flags) +
                                " name more than one scheduling mode (CU_CTX_SCHED_*)");
  }
}

/// The calling thread's current driver context; nullptr when there is none.
[[nodiscard]] inline CUcontext current_context() {
  CUcontext current = nullptr;
  detail::check_driver(detail::driver().ctx_get_current(&current), "cuCtxGetCurrent");
  return current;
}

/// An owning CUDA context; see the contract above.
class context {
 public:
  /// Creates a context on `options.device` (-1: the current one) and leaves it not current.
  explicit context(context_options options = {}) {
    validate_context_flags(options.flags);
    const int device = options.device < 0 ? current_device() : options.device;
    const CUdevice handle = detail::driver_device(device);
    const detail::driver_api& cu = detail::driver();
    // nullptr parameters: no execution affinity, no graphics interop (CUDA 13's cuCtxCreate_v4).
    detail::check_driver(cu.ctx_create(&context_, nullptr, options.flags, handle),
                         "cuCtxCreate on device " + std::to_string(device));
    // cuCtxCreate pushed the new context; pop it so the caller's current context is unchanged.
    CUcontext popped = nullptr;
    const CUresult result = cu.ctx_pop_current(&popped);
    if (result != CUDA_SUCCESS) {
      destroy();  // never leave a context behind a failed constructor
      detail::check_driver(result, "cuCtxPopCurrent after cuCtxCreate");
    }
    device_ = device;
  }

  ~context() { destroy(); }

  context(const context&) = delete;
  context& operator=(const context&) = delete;

  /// Takes `other`'s context; `other` holds nothing after.
  context(context&& other) noexcept
      : context_(std::exchange(other.context_, nullptr)), device_(std::exchange(other.device_, -1)) {}

  /// Destroys the context held (and everything made in it), then takes `other`'s.
  context& operator=(context&& other) noexcept {
    if (this != &other) {
      destroy();
      context_ = std::exchange(other.context_, nullptr);
      device_ = std::exchange(other.device_, -1);
    }
    return *this;
  }

  /// The context; nullptr for a moved-from one.
  [[nodiscard]] CUcontext get() const noexcept { return context_; }
  /// The runtime device id it was created on; -1 for a moved-from one.
  [[nodiscard]] int device() const noexcept { return device_; }
  /// False for a moved-from context.
  [[nodiscard]] explicit operator bool() const noexcept { return context_ != nullptr; }

  /// Waits for all work in this context (pushes it for the call).
  inline void synchronize() const;
  /// Free and total memory of its device, as seen from inside this context.
  [[nodiscard]] inline memory_usage memory() const;

 private:
  void destroy() noexcept {
    if (context_ == nullptr) {
      return;
    }
    // driver() cannot throw here: it loaded when the context was created.
    detail::report_driver_error(detail::driver().ctx_destroy(context_),
                                "cudamem::context: cuCtxDestroy");
    context_ = nullptr;
    device_ = -1;
  }

  CUcontext context_ = nullptr;
  int device_ = -1;
};

/// Makes a context current on the calling thread for a scope; see the contract above.
class context_guard {
 public:
  /// Pushes `ctx` (not null, else std::invalid_argument) onto this thread's context stack.
  explicit context_guard(CUcontext ctx) : context_(ctx) {
    if (ctx == nullptr) {
      throw std::invalid_argument(
          "cudamem::context_guard: null context (a moved-from owner?)");
    }
    detail::check_driver(detail::driver().ctx_push_current(ctx), "cuCtxPushCurrent");
  }
  /// Pushes `ctx`'s context.
  explicit context_guard(const context& ctx) : context_guard(ctx.get()) {}
  /// Pushes `ctx`'s primary context.
  explicit context_guard(const primary_context& ctx) : context_guard(ctx.get()) {}

  ~context_guard() {
    const detail::driver_api& cu = detail::driver();  // loaded: the constructor used it
    CUcontext current = nullptr;
    CUresult result = cu.ctx_get_current(&current);
    if (result == CUDA_SUCCESS && current != context_) {
      report_problem(
          "cudamem::context_guard: the guard's context is no longer current at the end of its "
          "scope (a context pushed and left pushed, or the guard's context destroyed inside "
          "the scope); the context stack is left as it is");
      return;
    }
    CUcontext popped = nullptr;
    if (result == CUDA_SUCCESS) {
      result = cu.ctx_pop_current(&popped);
    }
    detail::report_driver_error(result, "cudamem::context_guard: restoring the previous context");
  }

  context_guard(const context_guard&) = delete;
  context_guard& operator=(const context_guard&) = delete;
  context_guard(context_guard&&) = delete;
  context_guard& operator=(context_guard&&) = delete;

  /// The context current in this scope.
  [[nodiscard]] CUcontext get() const noexcept { return context_; }

 private:
  CUcontext context_;
};

inline void context::synchronize() const {
  const context_guard on{*this};
  detail::check_driver(detail::driver().ctx_synchronize(), "cuCtxSynchronize");
}

inline memory_usage context::memory() const {
  const context_guard on{*this};
  memory_usage usage;
  detail::check_driver(detail::driver().mem_get_info(&usage.free, &usage.total), "cuMemGetInfo");
  return usage;
}

}  // namespace cudamem
