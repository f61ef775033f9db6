// cudamem/device_scope.hpp — a scope of GPU work that leaves the device as it found it.
//
//   #include <cudamem/device_scope.hpp>
//
//   {
//     cudamem::device_scope scope{{.device = 0, .verify_memory = true}};
//     auto& pool = scope.make<cudamem::pool_resource>(upstream, options);  // owned by the scope
//     auto& s = scope.make<cudamem::stream>();
//     scope.adopt(std::move(some_unique_ptr));                           // owned too
//     run(pool, s);                                                       // may throw
//   }  // in reverse order: s, pool, ... destroyed; device 0 synchronised; its free memory
//      // compared with where it began and any shortfall reported to the error handler
//
//   // Or close it yourself and look at the result:
//   cudamem::memory_check check = scope.close();
//   if (!check.ok()) std::printf("%zu bytes not returned\n", check.missing_bytes());
//
// Why: memory held after the work is done — owners that were never destroyed,
// contexts left behind, a cudaDeviceReset expected to clean up after an exception. A scope
// that owns what was made in it, waits for the device, and then *measures* whether the memory
// came back turns "no processes running but the GPU is full" into a message naming the scope.
//
// Contract
// - Construction makes `options.device` (-1: the current one) current for the scope's
//   lifetime, like `device_guard`, and, when `verify_memory` is set, synchronises it and
//   records its free memory as the baseline (this creates the primary context if there was
//   none, so the context's own overhead is not counted against the scope).
// - `make<T>(args...)` constructs a T owned by the scope and returns a reference; `adopt(p)`
//   takes ownership of a `std::unique_ptr<T>`. Any type with a noexcept destructor will do:
//   memory resources, buffers, streams, events, contexts. Owned objects are destroyed in the
//   reverse order of creation, so a buffer made after its resource goes first. If `make`
//   throws, nothing is added and nothing leaks.
// - Ending the scope — `close()` or the destructor, whichever comes first — does, in order:
//   destroy every owned object; cudaDeviceSynchronize; measure free memory and compare with
//   the baseline (if `verify_memory`); cudaDeviceReset (if `reset_on_exit`); restore the
//   previous device. `close()` throws on a CUDA error and returns the `memory_check`; the
//   destructor reports errors and a failed check to the error handler instead.
// - The check: `ok()` when free memory is at most `tolerance` bytes below the baseline. More
//   free than before is never a failure (another process freed memory, or the scope freed
//   something older). The tolerance (default 4 MiB) absorbs what the driver keeps for the
//   context and does not give back at synchronisation: device code loaded lazily on a
//   kernel's first launch, a malloc heap or printf FIFO sized by a first use, and the 2 MiB
//   granularity in which free memory moves. Other processes on the same GPU change the
//   number too: run a verifying scope on a device you have to yourself, or raise the
//   tolerance. The check runs before the reset, so it measures what the scope's owners gave
//   back, not what a reset tore down.
// - Reset is off by default: cudaDeviceReset destroys the primary context of the whole
//   process — every allocation, stream and resource anyone made on the device — so it is only
//   safe when the scope is the only user of the device.
// - Neither copyable nor movable: it belongs to its scope (and its thread, whose current
//   device it sets).
#pragma once

#include <cudamem/device.hpp>
#include <cudamem/error.hpp>

#include <cuda_runtime_api.h>

#include <cstddef>
#include <memory>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace cudamem {

/// How a `device_scope` behaves.
struct device_scope_options {
  int device = -1;                 ///< -1: the current device
  bool verify_memory = false;      ///< compare free memory at the end with the start
  std::size_t tolerance = std::size_t{4} << 20;  ///< bytes of shortfall still counted as ok
  bool reset_on_exit = false;      ///< cudaDeviceReset at the end (see the contract)
};

/// What a verifying scope found: free memory at its start and at its end.
struct memory_check {
  int device = -1;              ///< the device checked
  std::size_t free_before = 0;  ///< free bytes when the scope began
  std::size_t free_after = 0;   ///< free bytes after it ended
  std::size_t tolerance = 0;    ///< shortfall still counted as ok
  bool verified = false;        ///< false when the scope was not asked to verify

  /// Bytes of free memory that did not come back (0 when as much or more is free).
  [[nodiscard]] std::size_t missing_bytes() const noexcept {
    return free_before > free_after ? free_before - free_after : 0;
  }
  /// True when not verified, or when the shortfall is within the tolerance.
  [[nodiscard]] bool ok() const noexcept { return !verified || missing_bytes() <= tolerance; }
  /// One line: "device 0: 96.0 MiB of free memory did not come back (tolerance 4.0 MiB)".
  [[nodiscard]] std::string describe() const {
    const auto mib = [](std::size_t bytes) {
      const double value = static_cast<double>(bytes) / (1024.0 * 1024.0);
      std::string text = std::to_string(value);
      return text.substr(0, text.find('.') + 2) + " MiB";  // one decimal is enough here
    };
    if (!verified) {
      return "device " + std::to_string(device) + ": memory not verified";
    }
    if (ok()) {
      return "device " + std::to_string(device) + ": free memory back to its baseline (" +
             mib(free_after) + " free, " + mib(missing_bytes()) + " below, tolerance " +
             mib(tolerance) + ")";
    }
    return "device " + std::to_string(device) + ": " + mib(missing_bytes()) +
           " of free memory did not come back (free " + mib(free_before) + " at the start, " +
           mib(free_after) + " at the end, tolerance " + mib(tolerance) + ")";
  }
};

/// A scope that owns what was made in it and leaves the device as it found it; see above.
class device_scope {
 public:
  /// Makes `options.device` current for the scope (and measures free memory, if asked to verify).
  explicit device_scope(device_scope_options options = {})
      : options_(options), device_(options.device < 0 ? current_device() : options.device) {
    validate_device(device_);
    check(cudaGetDevice(&previous_device_), "cudaGetDevice");
    if (previous_device_ != device_) {
      check(cudaSetDevice(device_), "cudaSetDevice");
    }
    try {
      if (options_.verify_memory) {
        check(cudaDeviceSynchronize(), "device_scope: cudaDeviceSynchronize at the start");
        check(cudaMemGetInfo(&result_.free_before, &total_), "cudaMemGetInfo");
      }
    } catch (...) {
      static_cast<void>(cudaSetDevice(previous_device_));  // a throwing constructor runs no
      throw;                                               // destructor: undo by hand
    }
    result_.device = device_;
    result_.tolerance = options_.tolerance;
  }

  ~device_scope() { end_quietly(); }

  device_scope(const device_scope&) = delete;
  device_scope& operator=(const device_scope&) = delete;
  device_scope(device_scope&&) = delete;
  device_scope& operator=(device_scope&&) = delete;

  /// Constructs a T owned by the scope (destroyed before the scope ends, newest first).
  template <class T, class... Args>
  T& make(Args&&... args) {
    return adopt(std::make_unique<T>(std::forward<Args>(args)...));
  }

  /// Takes ownership of `object`; returns a reference to it. Null throws std::invalid_argument.
  template <class T>
  T& adopt(std::unique_ptr<T> object) {
    static_assert(std::is_nothrow_destructible_v<T>,
                  "device_scope owns only types whose destructor cannot throw");
    if (object == nullptr) {
      throw std::invalid_argument("cudamem::device_scope::adopt: null object");
    }
    if (closed_) {
      throw std::logic_error("cudamem::device_scope: adopt or make after close()");
    }
    owned_.reserve(owned_.size() + 1);  // may throw: then `object` still owns (no leak)
    T& ref = *object;
    owned_.emplace_back(object.release(), [](void* p) noexcept { delete static_cast<T*>(p); });
    return ref;
  }

  /// Ends the scope now (see the contract) and returns the check; throws on a CUDA error.
  /// A failed check is returned, not thrown: the caller decides.
  memory_check close() {
    if (closed_) {
      return result_;
    }
    check(end(), "device_scope: ending the scope");
    return result_;
  }

  /// How many objects the scope owns now.
  [[nodiscard]] std::size_t size() const noexcept { return owned_.size(); }
  /// The device the scope works on.
  [[nodiscard]] int device() const noexcept { return device_; }
  /// The free memory recorded at the start (0 unless verifying).
  [[nodiscard]] std::size_t baseline() const noexcept { return result_.free_before; }

 private:
  // Out of line on purpose, as event::destroy() and stream::destroy(): inlined into a
  // std::optional<device_scope>'s destructor, g++ 12 at -O3 warned that members "may be used
  // uninitialized" (a false positive that fails a user's -Werror build).
  [[gnu::noinline]] void end_quietly() noexcept {
    if (closed_) {
      return;
    }
    const cudaError_t code = end();
    report_error(code, "device_scope: ending the scope");
    if (!result_.ok()) {
      report_leak();
    }
  }

  using owner = std::unique_ptr<void, void (*)(void*) noexcept>;

  /// Everything the contract lists, in order, noexcept; returns the first CUDA error.
  cudaError_t end() noexcept {
    closed_ = true;
    while (!owned_.empty()) {
      owned_.pop_back();  // newest first
    }
    cudaError_t first = cudaSuccess;
    const auto keep = [&first](cudaError_t code) {
      if (first == cudaSuccess) {
        first = code;
      }
    };
    keep(cudaDeviceSynchronize());
    if (options_.verify_memory && first == cudaSuccess) {
      std::size_t total = 0;
      const cudaError_t code = cudaMemGetInfo(&result_.free_after, &total);
      keep(code);
      result_.verified = code == cudaSuccess;
    }
    if (options_.reset_on_exit) {
      keep(cudaDeviceReset());
    }
    if (previous_device_ != device_) {
      keep(cudaSetDevice(previous_device_));
    }
    return first;
  }

  void report_leak() const noexcept {
    try {
      report_problem("device_scope: " + result_.describe());
    } catch (...) {
      report_problem("device_scope: free device memory did not come back to its baseline");
    }
  }

  device_scope_options options_;
  int device_;
  int previous_device_ = -1;
  std::size_t total_ = 0;
  memory_check result_;
  std::vector<owner> owned_;
  bool closed_ = false;
};

}  // namespace cudamem
