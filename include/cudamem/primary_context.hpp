// cudamem/primary_context.hpp — hold a device's primary context alive for a scope.
//
//   #include <cudamem/primary_context.hpp>
//
//   cudamem::primary_context ctx{0};          // retains device 0's primary context
//   CUcontext raw = ctx.get();                // the one the runtime API uses on device 0
//   {
//     cudamem::context_guard on{ctx};         // (context.hpp) make it current for a scope
//     ...                                     // driver and runtime calls use it
//   }
//   auto state = cudamem::primary_context_state(0);   // {active, flags}
//
// What a primary context is. Each device has one primary context per process, shared by
// the runtime API (every cudaMalloc, kernel and stream on the device lives in it) and by
// driver-API code that retains it. The driver counts retains: the context exists while the
// count is above zero (the runtime holds one retain of its own once it has initialised the
// device), and is destroyed — with every allocation made in it — when the last one is
// released. A library that retains and forgets keeps that memory alive until process exit;
// one that releases what it never retained pulls the context out from under the runtime.
//
// Contract
// - `primary_context{device}` retains the device's primary context (creating it if it was
//   inactive) and the destructor releases exactly that one retain: never more, never a
//   retain it did not make. Move-only; a moved-from owner holds nothing and releases nothing.
//   Move-assignment releases the retain it held first.
// - Constructing does not make the context current (use `context_guard`).
// - Bad input: an invalid device id throws `std::out_of_range`; no device or no driver throws
//   `no_device_error` before anything is retained.
// - The destructor is noexcept; a failed release goes to the error handler, and at process
//   exit (the driver already unloading) it is dropped silently.
// - `primary_context_state(device)` reads the primary context's flags and whether it is
//   active, without retaining or creating it.
#pragma once

#include <cudamem/detail/cuda/driver.hpp>
#include <cudamem/device.hpp>
#include <cudamem/error.hpp>

#include <cuda.h>

#include <string>
#include <utility>

namespace cudamem {

namespace detail {
/// The driver's handle for runtime device `device` (the ordinals agree: both APIs number the
/// devices CUDA_VISIBLE_DEVICES leaves visible in the same order). Validates the id first.
[[nodiscard]] inline CUdevice driver_device(int device,
                                            std::source_location where = std::source_location::current()) {
  validate_device(device, where);
  CUdevice handle = 0;
  check_driver(driver(where).device_get(&handle, device), "cuDeviceGet", where);
  return handle;
}
}  // namespace detail

/// A device's primary context: whether it exists now, and with what flags.
struct primary_context_info {
  bool active = false;  ///< true while someone (the runtime, a primary_context) retains it
  unsigned flags = 0;   ///< CU_CTX_* flags it has or will be created with
};

/// The state of `device`'s primary context, without retaining or creating it.
[[nodiscard]] inline primary_context_info primary_context_state(int device) {
  const CUdevice handle = detail::driver_device(device);
  primary_context_info info;
  int active = 0;
  detail::check_driver(detail::driver().device_primary_ctx_get_state(handle, &info.flags, &active),
                       "cuDevicePrimaryCtxGetState");
  info.active = active != 0;
  return info;
}

/// One retain of a device's primary context, released by the destructor; see the contract.
class primary_context {
 public:
  /// Retains `device`'s primary context.
  explicit primary_context(int device) : handle_(detail::driver_device(device)) {
    detail::check_driver(detail::driver().device_primary_ctx_retain(&context_, handle_),
                         "cuDevicePrimaryCtxRetain on device " + std::to_string(device));
    device_ = device;
  }

  ~primary_context() { release(); }

  primary_context(const primary_context&) = delete;
  primary_context& operator=(const primary_context&) = delete;

  /// Takes `other`'s retain; `other` holds nothing after.
  primary_context(primary_context&& other) noexcept
      : context_(std::exchange(other.context_, nullptr)),
        handle_(std::exchange(other.handle_, 0)),
        device_(std::exchange(other.device_, -1)) {}

  /// Releases the retain held, then takes `other`'s.
  primary_context& operator=(primary_context&& other) noexcept {
    if (this != &other) {
      release();
      context_ = std::exchange(other.context_, nullptr);
      handle_ = std::exchange(other.handle_, 0);
      device_ = std::exchange(other.device_, -1);
    }
    return *this;
  }

  /// The context; nullptr for a moved-from owner.
  [[nodiscard]] CUcontext get() const noexcept { return context_; }
  /// The runtime device id; -1 for a moved-from owner.
  [[nodiscard]] int device() const noexcept { return device_; }
  /// False for a moved-from owner.
  [[nodiscard]] explicit operator bool() const noexcept { return context_ != nullptr; }

 private:
  void release() noexcept {
    if (context_ == nullptr) {
      return;  // moved from, or never retained: nothing of ours to release
    }
    // driver() cannot throw here: it loaded when this owner retained the context.
    detail::report_driver_error(detail::driver().device_primary_ctx_release(handle_),
                                "cudamem::primary_context: cuDevicePrimaryCtxRelease");
    context_ = nullptr;
    handle_ = 0;
    device_ = -1;
  }

  CUcontext context_ = nullptr;
  CUdevice handle_ = 0;
  int device_ = -1;
};

}  // namespace cudamem
