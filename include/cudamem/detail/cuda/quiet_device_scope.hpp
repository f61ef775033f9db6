// cudamem/detail/cuda/quiet_device_scope.hpp — a device_guard for noexcept paths: destructors
// and frees, which must run on their own device whatever device the calling thread has
// current, and may not throw when switching fails.
//
//   void free_it() noexcept {
//     const cudamem::detail::quiet_device_scope on{device_, "my_owner: switching device"};
//     report_error(cudaFree(p_), "my_owner: cudaFree");   // on device_, then back
//   }
//
// Its own header (it needs only error.hpp) so that the lowest owners, stream and event, can
// use it as well as the resources (detail/cuda/cuda_upstream.hpp).
#pragma once

#include <cudamem/error.hpp>

#include <cuda_runtime_api.h>

#include <string_view>

namespace cudamem::detail {

/// Makes `device` current for the scope and restores the previous device; a failure to switch
/// is reported, not thrown, and `ok()` says whether the device is the wanted one. Costs one
/// cudaGetDevice when the device is already current.
class quiet_device_scope {
 public:
  quiet_device_scope(int device, std::string_view who) noexcept {
    if (!report(cudaGetDevice(&previous_), who)) {
      return;
    }
    if (previous_ == device) {
      ok_ = true;
      return;
    }
    ok_ = report(cudaSetDevice(device), who);
    changed_ = ok_;
  }
  ~quiet_device_scope() {
    if (changed_) {
      report_error(cudaSetDevice(previous_), "cudamem: restoring the device after a free");
    }
  }
  quiet_device_scope(const quiet_device_scope&) = delete;
  quiet_device_scope& operator=(const quiet_device_scope&) = delete;

  [[nodiscard]] bool ok() const noexcept { return ok_; }

 private:
  static bool report(cudaError_t code, std::string_view who) noexcept {
    if (code != cudaSuccess) {
      report_error(code, who);
      return false;
    }
    return true;
  }
  int previous_ = -1;
  bool ok_ = false;
  bool changed_ = false;
};

}  // namespace cudamem::detail
