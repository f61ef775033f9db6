// cudamem/device.hpp — which GPUs there are, what they have, and a scoped current device.
//
//   #include <cudamem/device.hpp>
//
//   if (cudamem::device_count() == 0) { std::puts("no GPU"); return; }
//   auto props = cudamem::get_device_properties(0);
//   std::printf("%s, %zu bytes, sm_%d%d\n", props.name.c_str(), props.total_memory,
//               props.major, props.minor);
//   auto [free, total] = cudamem::device_memory(0);
//   {
//     cudamem::device_guard on_1{1};   // device 1 is current in this scope...
//     launch_work();
//   }                                  // ...and the previous device again after it, however
//                                      // the scope is left
//
// Contract
// - `device_count()` is 0 (not an exception) on a machine with no usable device, so that
//   "is there a GPU?" is a plain question. Everything that needs a device throws
//   `no_device_error` there instead.
// - A device id that is negative or not below `device_count()` throws `std::out_of_range`
//   naming the id and the devices that exist.
// - `device_guard` calls cudaSetDevice only when the requested device is not already current,
//   and in its destructor only if it changed the device. It restores on every exit path,
//   exceptions included. It is neither copyable nor movable: it belongs to its scope.
// - The guard restores the *device*, which is how the runtime API names a primary context.
//   A context made current with the driver API is restored by `context_guard`, not this.
#pragma once

#include <cudamem/error.hpp>

#include <cuda_runtime_api.h>

#include <cstddef>
#include <stdexcept>
#include <string>

namespace cudamem {

/// Number of CUDA devices this process can see; 0 when there is no usable device.
[[nodiscard]] inline int device_count() {
  // The visible devices are fixed when the runtime initialises (CUDA_VISIBLE_DEVICES is read
  // once), so the answer is cached: device-id validation then costs no API call.
  static const int count = [] {
    int n = 0;
    const cudaError_t code = cudaGetDeviceCount(&n);
    if (code == cudaSuccess) {
      return n;
    }
    static_cast<void>(cudaGetLastError());
    if (is_no_device(code) || code == cudaErrorInitializationError) {
      return 0;
    }
    check(code, "cudaGetDeviceCount");
    return 0;
  }();
  return count;
}

/// True when at least one usable CUDA device exists.
[[nodiscard]] inline bool has_device() { return device_count() > 0; }

/// Throws `no_device_error` when there is no device, `std::out_of_range` when `device` is not
/// one of them.
inline void validate_device(int device,
                            std::source_location where = std::source_location::current()) {
  const int count = device_count();
  if (count == 0) {
    throw no_device_error(cudaErrorNoDevice, "device " + std::to_string(device) + " requested",
                          where);
  }
  if (device < 0 || device >= count) {
    throw std::out_of_range("cudamem: device " + std::to_string(device) +
                            " does not exist; valid ids are 0.." + std::to_string(count - 1));
  }
}

/// The calling thread's current device.
[[nodiscard]] inline int current_device() {
  int device = 0;
  check(cudaGetDevice(&device), "cudaGetDevice");
  return device;
}

/// What a device is.
struct device_properties {
  int id = 0;                     ///< the runtime device id
  std::string name;               ///< the device's name, e.g. "NVIDIA H100 80GB HBM3"
  std::size_t total_memory = 0;   ///< bytes of device memory
  int major = 0;                  ///< compute capability, major
  int minor = 0;                  ///< compute capability, minor
  int multiprocessors = 0;        ///< streaming multiprocessors (SMs)
  bool managed_memory = false;    ///< supports cudaMallocManaged
  bool memory_pools = false;      ///< supports cudaMallocAsync / memory pools
};

/// The properties of `device`.
[[nodiscard]] inline device_properties get_device_properties(int device) {
  validate_device(device);
  cudaDeviceProp prop{};
  check(cudaGetDeviceProperties(&prop, device), "cudaGetDeviceProperties");
  int pools = 0;
  check(cudaDeviceGetAttribute(&pools, cudaDevAttrMemoryPoolsSupported, device),
        "cudaDeviceGetAttribute(MemoryPoolsSupported)");
  device_properties out;
  out.id = device;
  out.name = prop.name;
  out.total_memory = prop.totalGlobalMem;
  out.major = prop.major;
  out.minor = prop.minor;
  out.multiprocessors = prop.multiProcessorCount;
  out.managed_memory = prop.managedMemory != 0;
  out.memory_pools = pools != 0;
  return out;
}

/// Free and total device memory, as the driver sees it now (all processes included).
struct memory_usage {
  std::size_t free = 0;   ///< bytes free on the device
  std::size_t total = 0;  ///< bytes of device memory in all
};

/// Restores the calling thread's current device on scope exit; see the contract above.
class device_guard {
 public:
  /// Makes `device` current until the guard is destroyed.
  explicit device_guard(int device) : previous_(current_device()) {
    if (device != previous_) {
      validate_device(device);
      check(cudaSetDevice(device), "cudaSetDevice");
      changed_ = true;
    }
  }

  ~device_guard() {
    if (changed_) {
      report_error(cudaSetDevice(previous_), "device_guard: restoring the previous device");
    }
  }

  device_guard(const device_guard&) = delete;
  device_guard& operator=(const device_guard&) = delete;
  device_guard(device_guard&&) = delete;
  device_guard& operator=(device_guard&&) = delete;

  /// The device that was current before the guard and will be again after it.
  [[nodiscard]] int previous() const noexcept { return previous_; }

 private:
  int previous_;
  bool changed_ = false;
};

/// Free and total memory of `device` now. This creates the device's primary context if the
/// process has none yet (the driver cannot answer without one).
[[nodiscard]] inline memory_usage device_memory(int device) {
  device_guard on{device};
  memory_usage usage;
  check(cudaMemGetInfo(&usage.free, &usage.total), "cudaMemGetInfo");
  return usage;
}

/// Free and total memory of the current device now.
[[nodiscard]] inline memory_usage device_memory() { return device_memory(current_device()); }

}  // namespace cudamem
