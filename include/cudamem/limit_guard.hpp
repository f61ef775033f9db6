// cudamem/limit_guard.hpp — change a device limit (cudaDeviceSetLimit) for a scope.
//
//   #include <cudamem/limit_guard.hpp>
//
//   {
//     cudamem::limit_guard stack{cudaLimitStackSize, 16 * 1024};  // deep recursion here...
//     recursive_kernel<<<g, b>>>(...);
//   }                                                           // ...the old stack size after
//
//   // Kernels that call malloc/new need a heap large enough *before* their first launch:
//   cudamem::heap_limit_guard heap{512 << 20};   // at least 512 MiB (kept if already larger)
//   kernel_that_uses_new<<<g, b>>>(...);
//
// Why. Limits are global to the device's context: one library raising the stack size or the
// printf FIFO changes them for every later kernel in the process, and the memory they reserve
// (stack size × resident threads can be gigabytes) is no longer free for allocations.
//
// Contract
// - `limit_guard{limit, value}` reads the current value of `limit` on the current device,
//   sets `value`, and restores the old value on scope exit, on every exit path, on the device
//   that was current at construction (whatever device is current then). The driver may round
//   or clamp the value: `value()` is what it actually set; `previous()` what it will restore.
// - `heap_limit_guard{bytes}` is a limit_guard for cudaLimitMallocHeapSize that only ever
//   raises the heap: a heap already at least `bytes` large is left alone (lowering it could
//   break the code that sized it), and then there is nothing to restore.
// - What cannot be restored: cudaLimitMallocHeapSize and cudaLimitPrintfFifoSize can only be
//   set before the first launch of a kernel that uses device malloc/new or printf in the
//   context. Once such a kernel has run, the size is fixed for the life of the context and
//   CUDA refuses to change it (cudaErrorInvalidValue): the restore is then skipped, silently,
//   because that is the documented behaviour of the limit and not a failure. Call
//   `restore()` yourself to learn whether it took; only cudaDeviceReset (or destroying the
//   context) gives back a fixed heap. The same refusal at construction is thrown: the caller
//   asked for a size CUDA cannot give.
// - Bad input: an unknown limit or one the device does not support throws `cuda_error`
//   (cudaErrorUnsupportedLimit), no device `no_device_error`; nothing is changed then.
// - Neither copyable nor movable. The destructor is noexcept: other restore failures go to the
//   error handler.
#pragma once

#include <cudamem/device.hpp>
#include <cudamem/error.hpp>

#include <cuda_runtime_api.h>

#include <cstddef>
#include <string>

namespace cudamem {

/// The value of `limit` on the current device.
[[nodiscard]] inline std::size_t get_limit(cudaLimit limit) {
  std::size_t value = 0;
  check(cudaDeviceGetLimit(&value, limit), "cudaDeviceGetLimit");
  return value;
}

/// True for the limits whose size is fixed once a kernel has used them (see the contract).
[[nodiscard]] constexpr bool is_fixed_after_use(cudaLimit limit) noexcept {
  return limit == cudaLimitMallocHeapSize || limit == cudaLimitPrintfFifoSize;
}

/// Sets a device limit for a scope; see the contract above.
class limit_guard {
 public:
  /// Sets `limit` to `value` on the current device; the destructor restores the old value.
  limit_guard(cudaLimit limit, std::size_t value) : limit_guard(limit, value, false) {}

  // restore() reports anything that is not the documented "fixed after use".
  ~limit_guard() { static_cast<void>(restore()); }

  limit_guard(const limit_guard&) = delete;
  limit_guard& operator=(const limit_guard&) = delete;
  limit_guard(limit_guard&&) = delete;
  limit_guard& operator=(limit_guard&&) = delete;

  /// Restores the previous value now (the destructor then does nothing). True when the
  /// previous value is in place (or nothing had changed); false when CUDA refused — for the
  /// heap and printf FIFO after a kernel used them, silently; for anything else, reported.
  bool restore() noexcept {
    if (!changed_) {
      return true;
    }
    changed_ = false;
    int current = -1;
    cudaError_t code = cudaGetDevice(&current);
    const bool switch_device = code == cudaSuccess && current != device_;
    if (switch_device) {
      code = cudaSetDevice(device_);
    }
    if (code == cudaSuccess) {
      code = cudaDeviceSetLimit(limit_, previous_);
    }
    if (switch_device) {
      report_error(cudaSetDevice(current), "limit_guard: switching back to the current device");
    }
    if (code == cudaSuccess) {
      return true;
    }
    if (code == cudaErrorInvalidValue && is_fixed_after_use(limit_)) {
      static_cast<void>(cudaGetLastError());  // documented: the size is fixed now
      return false;
    }
    report_error(code, "limit_guard: restoring a device limit with cudaDeviceSetLimit");
    return false;
  }

  /// The limit it guards.
  [[nodiscard]] cudaLimit limit() const noexcept { return limit_; }
  /// The value in force in the scope, as the driver set it (it may round or clamp).
  [[nodiscard]] std::size_t value() const noexcept { return value_; }
  /// The value before the guard: what the destructor restores.
  [[nodiscard]] std::size_t previous() const noexcept { return previous_; }
  /// Whether the guard changed the limit (and so has something to restore).
  [[nodiscard]] bool changed() const noexcept { return changed_; }
  /// The device whose limit it is.
  [[nodiscard]] int device() const noexcept { return device_; }

 protected:
  /// `only_raise`: leave a limit that is already at least `value` alone.
  limit_guard(cudaLimit limit, std::size_t value, bool only_raise)
      : limit_(limit), device_(current_device()), previous_(get_limit(limit)) {
    if ((only_raise && previous_ >= value) || previous_ == value) {
      value_ = previous_;
      return;
    }
    check(cudaDeviceSetLimit(limit, value),
          "cudaDeviceSetLimit to " + std::to_string(value) +
              (is_fixed_after_use(limit)
                   ? " (refused if a kernel using malloc/printf already ran in this context)"
                   : ""));
    changed_ = true;
    try {
      value_ = get_limit(limit);  // what the driver made of the request
    } catch (...) {
      static_cast<void>(restore());  // a throwing constructor runs no destructor: undo here
      throw;
    }
  }

 private:
  cudaLimit limit_;
  int device_;
  std::size_t previous_;
  std::size_t value_ = 0;
  bool changed_ = false;
};

/// At least `bytes` of device malloc/new heap for a scope; see the contract above.
class heap_limit_guard : public limit_guard {
 public:
  /// Raises the heap to at least `bytes` (a larger heap is left alone).
  explicit heap_limit_guard(std::size_t bytes) : limit_guard(cudaLimitMallocHeapSize, bytes, true) {}
};

}  // namespace cudamem
