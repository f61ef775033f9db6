// cudamem/detail/ipc/ipc_common.hpp — what both kinds of memory shared between processes need
// (ipc_pool.hpp: CUDA memory pools; vm_ipc.hpp: virtual-memory handles): naming a device in a
// way another process understands, and the error for input that names the wrong thing.
//
// Device ordinals are not portable between processes: CUDA_VISIBLE_DEVICES may differ, and
// with it the numbering. A device's UUID is the same everywhere, so descriptors carry the UUID
// of the device the memory lives on, and the importer looks for it among its own devices.
#pragma once

#include <cudamem/device.hpp>
#include <cudamem/error.hpp>

#include <cuda_runtime_api.h>

#include <array>
#include <cstdint>
#include <cstdio>
#include <optional>
#include <stdexcept>
#include <string>

namespace cudamem {

/// Input to an import that does not fit what it is imported into: memory of a device this
/// process cannot see or cannot reach, a pointer of another pool, a descriptor that does not
/// match its handles. A `std::invalid_argument`: the input is wrong, not the system.
class ipc_error : public std::invalid_argument {
 public:
  explicit ipc_error(const std::string& what) : std::invalid_argument("cudamem: " + what) {}
};

namespace detail {

/// A device's UUID: the same in every process, whatever its ordinal there.
using device_uuid = std::array<unsigned char, 16>;

[[nodiscard]] inline device_uuid uuid_of(int device) {
  validate_device(device);
  cudaDeviceProp prop{};
  check(cudaGetDeviceProperties(&prop, device), "cudaGetDeviceProperties (uuid)");
  device_uuid out{};
  for (std::size_t i = 0; i < out.size(); ++i) {
    out[i] = static_cast<unsigned char>(prop.uuid.bytes[i]);
  }
  return out;
}

/// The ordinal, in this process, of the device with `uuid`; nullopt when none is visible.
[[nodiscard]] inline std::optional<int> device_with_uuid(const device_uuid& uuid) {
  for (int d = 0; d < device_count(); ++d) {
    if (uuid_of(d) == uuid) {
      return d;
    }
  }
  return std::nullopt;
}

/// "GPU-1a2b3c4d-...", as nvidia-smi prints it.
[[nodiscard]] inline std::string to_string(const device_uuid& uuid) {
  std::string text = "GPU-";
  char hex[3];
  for (std::size_t i = 0; i < uuid.size(); ++i) {
    std::snprintf(hex, sizeof hex, "%02x", uuid[i]);
    text += hex;
    if (i == 3 || i == 5 || i == 7 || i == 9) {
      text += '-';
    }
  }
  return text;
}

/// The ordinal of the device with `uuid`, or ipc_error naming it.
[[nodiscard]] inline int require_device_with_uuid(const device_uuid& uuid, const char* what) {
  if (const auto d = device_with_uuid(uuid)) {
    return *d;
  }
  throw ipc_error(std::string(what) + ": the memory lives on device " + to_string(uuid) +
                  ", which this process cannot see (check CUDA_VISIBLE_DEVICES)");
}

}  // namespace detail
}  // namespace cudamem
