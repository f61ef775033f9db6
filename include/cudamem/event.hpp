// cudamem/event.hpp — an owning CUDA event: mark a point in a stream, wait for it, time it.
//
//   #include <cudamem/event.hpp>
//
//   cudamem::stream s;
//   cudamem::event start, stop;          // timing events on the current device
//   start.record(s);
//   kernel<<<g, b, 0, s.get()>>>(...);
//   stop.record(s);
//   stop.synchronize();
//   float ms = cudamem::elapsed_ms(start, stop);
//
//   cudamem::event done{{.timing = false}};  // cheapest kind: for ordering only
//   done.record(producer);
//   done.make_wait(consumer);            // consumer's later work starts after producer's
//
// Contract
// - `event` owns one cudaEvent_t created on `options.device` (the current device by default);
//   move-only, with the same moved-from and move-assignment rules as `stream`; the destructor
//   is noexcept, destroys the event on its own device whatever device is current, and reports
//   failures to the error handler.
// - `record(s)` marks the point in `s` reached by the work submitted so far. `s` must be a
//   stream of the event's device (CUDA refuses an event and a stream of different devices);
//   a default stream (`stream_view{}`, legacy, per-thread) is taken as the event's device's,
//   whatever device is current. `is_complete()`
//   says whether that point has been reached (an event never recorded counts as complete, as
//   in CUDA); `synchronize()` blocks the host until it is; `make_wait(s)` makes later work on
//   `s` wait for it without blocking the host.
// - `elapsed_ms(a, b)` needs two timing events, both recorded and complete; otherwise CUDA's
//   error is thrown as `cuda_error`.
#pragma once

#include <cudamem/detail/cuda/quiet_device_scope.hpp>
#include <cudamem/device.hpp>
#include <cudamem/error.hpp>
#include <cudamem/stream.hpp>

#include <cuda_runtime_api.h>

#include <utility>

namespace cudamem {

/// How to create an `event`.
struct event_options {
  int device = -1;             ///< -1: the current device
  bool timing = true;          ///< false: cheaper, but `elapsed_ms` cannot be used
  bool blocking_sync = false;  ///< true: `synchronize()` sleeps instead of spinning
};

/// An owning CUDA event; see the contract above.
class event {
 public:
  /// Creates an event on `options.device` (-1: the current device).
  explicit event(event_options options = {}) {
    const int device = options.device < 0 ? current_device() : options.device;
    device_guard on{device};
    unsigned flags = options.timing ? cudaEventDefault : cudaEventDisableTiming;
    if (options.blocking_sync) {
      flags |= cudaEventBlockingSync;
    }
    check(cudaEventCreateWithFlags(&handle_, flags), "cudaEventCreateWithFlags");
    device_ = device;
  }

  ~event() { destroy(); }

  event(const event&) = delete;
  event& operator=(const event&) = delete;

  /// Takes `other`'s event; `other` holds nothing after.
  event(event&& other) noexcept
      : handle_(std::exchange(other.handle_, nullptr)), device_(std::exchange(other.device_, -1)) {}

  /// Destroys the event held, then takes `other`'s.
  event& operator=(event&& other) noexcept {
    if (this != &other) {
      destroy();
      handle_ = std::exchange(other.handle_, nullptr);
      device_ = std::exchange(other.device_, -1);
    }
    return *this;
  }

  /// The CUDA handle; nullptr for a moved-from event.
  [[nodiscard]] cudaEvent_t get() const noexcept { return handle_; }
  /// The device the event was created on; -1 for a moved-from event.
  [[nodiscard]] int device() const noexcept { return device_; }
  /// False for a moved-from event.
  [[nodiscard]] explicit operator bool() const noexcept { return handle_ != nullptr; }

  /// Marks the point `s` has reached (all work submitted to it so far).
  void record(stream_view s) {
    if (s.is_default()) {
      // A default-stream handle names the *current* device's stream: make it the event's.
      const device_guard on{device_};
      check(cudaEventRecord(handle_, s.get()), "cudaEventRecord");
      return;
    }
    check(cudaEventRecord(handle_, s.get()), "cudaEventRecord");
  }

  /// Makes work submitted to `s` after this call wait for the recorded point. Host returns at once.
  void make_wait(stream_view s) const {
    check(cudaStreamWaitEvent(s.get(), handle_, 0), "cudaStreamWaitEvent");
  }

  /// Blocks the host until the recorded point is reached.
  void synchronize() const { check(cudaEventSynchronize(handle_), "cudaEventSynchronize"); }

  /// Whether the recorded point has been reached. Throws on a real error.
  [[nodiscard]] bool is_complete() const {
    const cudaError_t code = cudaEventQuery(handle_);
    if (code == cudaErrorNotReady) {
      static_cast<void>(cudaGetLastError());
      return false;
    }
    check(code, "cudaEventQuery");
    return true;
  }

 private:
  // Out of line on purpose, as peer_access::end(): inlined into a std::optional<event>'s
  // destructor, g++ 12 at -O2 warns that handle_ "may be used uninitialized" (a false positive
  // that fails a user's -Werror build). Destroying an event is a driver call anyway.
  [[gnu::noinline]] void destroy() noexcept {
    if (handle_ != nullptr) {
      const detail::quiet_device_scope on{device_, "cudamem::event: switching to its device"};
      report_error(cudaEventDestroy(handle_), "cudamem::event: cudaEventDestroy");
      handle_ = nullptr;
      device_ = -1;
    }
  }

  cudaEvent_t handle_ = nullptr;
  int device_ = -1;
};

/// Milliseconds between two recorded, completed timing events.
[[nodiscard]] inline float elapsed_ms(const event& start, const event& stop) {
  float ms = 0.0F;
  check(cudaEventElapsedTime(&ms, start.get(), stop.get()), "cudaEventElapsedTime");
  return ms;
}

}  // namespace cudamem
