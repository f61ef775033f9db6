// cudamem/sync_guard.hpp — wait for a stream or a device when a scope ends, however it ends.
//
//   #include <cudamem/sync_guard.hpp>
//
//   std::vector<float> host(n);                    // the kernel reads this through a mapping
//   cudamem::synchronize_on_exit wait_for{s};      // declared AFTER what the work uses...
//   launch_reading(host.data(), s);
//   may_throw();                                   // ...so unwinding waits for the work
//   wait_for.finish();                             // before `host` is destroyed; finish() is the
//                                                  // normal path and throws on a CUDA error
//
//   cudamem::synchronize_device_on_exit all{0};    // the same for all work on device 0
//
// Why. Asynchronous work outlives the C++ scope that started it. When an exception unwinds a
// scope, destructors free host buffers, pinned staging memory or pool blocks that a kernel or
// copy still in flight is using: a use-after-free on the device that shows up as corrupted
// results, far from its cause. Objects are destroyed in reverse order of declaration, so a
// sync guard declared after the buffers makes every exit path wait for the work first.
//
// Contract
// - `synchronize_on_exit{s}` calls cudaStreamSynchronize(s) in its destructor;
//   `synchronize_device_on_exit{device}` calls cudaDeviceSynchronize on `device` (the current
//   device by default; the current device is restored afterwards).
// - `finish()` synchronises now and throws `cuda_error` if the work failed; the destructor
//   then does nothing. Call it on the normal path: a destructor cannot throw, so an error it
//   finds goes to the error handler instead (quietly during process exit).
// - `dismiss()` cancels the wait (the caller has synchronised some other way).
// - What it restores: nothing — it changes no state; it orders destruction after the work.
//   What it cannot do: wait for work submitted to other streams or devices, or undo a kernel
//   fault (a sticky error stays; the guard reports it).
// - Neither copyable nor movable: it belongs to its scope. An invalid device throws
//   `std::out_of_range`, no device `no_device_error`.
#pragma once

#include <cudamem/device.hpp>
#include <cudamem/error.hpp>
#include <cudamem/stream.hpp>

#include <cuda_runtime_api.h>

namespace cudamem {

/// Synchronises a stream when the scope ends; see the contract above.
class synchronize_on_exit {
 public:
  /// Waits for `stream` when the scope ends.
  explicit synchronize_on_exit(stream_view stream) noexcept : stream_(stream) {}

  ~synchronize_on_exit() {
    if (armed_) {
      report_error(cudaStreamSynchronize(stream_.get()),
                   "synchronize_on_exit: cudaStreamSynchronize at scope exit");
    }
  }

  synchronize_on_exit(const synchronize_on_exit&) = delete;
  synchronize_on_exit& operator=(const synchronize_on_exit&) = delete;
  synchronize_on_exit(synchronize_on_exit&&) = delete;
  synchronize_on_exit& operator=(synchronize_on_exit&&) = delete;

  /// Synchronises now, throwing on error; the destructor then has nothing to do.
  void finish() {
    armed_ = false;
    stream_.synchronize();
  }
  /// The caller has made sure the work is done: skip the wait.
  void dismiss() noexcept { armed_ = false; }

  /// The stream it waits for.
  [[nodiscard]] stream_view stream() const noexcept { return stream_; }

 private:
  stream_view stream_;
  bool armed_ = true;
};

/// Synchronises a whole device when the scope ends; see the contract above.
class synchronize_device_on_exit {
 public:
  /// The current device.
  synchronize_device_on_exit() : device_(current_device()) {}
  /// Waits for `device` when the scope ends; throws std::out_of_range for an invalid id.
  explicit synchronize_device_on_exit(int device) : device_(device) { validate_device(device); }

  ~synchronize_device_on_exit() {
    if (armed_) {
      report_error(synchronize_device(device_),
                   "synchronize_device_on_exit: cudaDeviceSynchronize at scope exit");
    }
  }

  synchronize_device_on_exit(const synchronize_device_on_exit&) = delete;
  synchronize_device_on_exit& operator=(const synchronize_device_on_exit&) = delete;
  synchronize_device_on_exit(synchronize_device_on_exit&&) = delete;
  synchronize_device_on_exit& operator=(synchronize_device_on_exit&&) = delete;

  /// Synchronises now, throwing on error; the destructor then has nothing to do.
  void finish() {
    armed_ = false;
    check(synchronize_device(device_), "cudaDeviceSynchronize");
  }
  /// The caller has made sure the work is done: skip the wait.
  void dismiss() noexcept { armed_ = false; }

  /// The device it waits for.
  [[nodiscard]] int device() const noexcept { return device_; }

 private:
  /// cudaDeviceSynchronize on `device`, leaving the current device as it was. noexcept: the
  /// destructor's path; returns the first error.
  static cudaError_t synchronize_device(int device) noexcept {
    int current = -1;
    cudaError_t code = cudaGetDevice(&current);
    if (code != cudaSuccess) {
      return code;
    }
    if (current != device && (code = cudaSetDevice(device)) != cudaSuccess) {
      return code;
    }
    code = cudaDeviceSynchronize();
    if (current != device) {
      const cudaError_t back = cudaSetDevice(current);
      if (code == cudaSuccess) {
        code = back;
      }
    }
    return code;
  }

  int device_;
  bool armed_ = true;
};

}  // namespace cudamem
