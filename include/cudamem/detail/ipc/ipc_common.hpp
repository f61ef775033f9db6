// cudamem/detail/ipc/ipc_common.hpp — what both kinds of memory shared between processes need
// (ipc_pool.hpp: CUDA memory pools; vm_ipc.hpp: virtual-memory handles): naming a device in a
// way another process understands, the error for input that names the wrong thing, and which
// of the importer's devices get access to the memory.
//
// Device ordinals are not portable between processes: CUDA_VISIBLE_DEVICES may differ, and
// with it the numbering. A device's UUID is the same everywhere, so descriptors carry the UUID
// of the device the memory lives on, and the importer looks for it among its own devices.
//
// Access. Imported memory is reachable from the device it lives on and from no other until
// access is granted (cudaMemPoolSetAccess, cuMemSetAccess). An importer that runs its kernels
// on another device (one process per GPU, importing a neighbour's memory) would fault on the
// first touch, and the fault is sticky: the process is lost. So the importing thread's current
// device is granted access by itself when it is not the memory's device, and a device that
// cannot reach the memory is refused at the import, naming both devices (import_access).
#pragma once

#include <cudamem/device.hpp>
#include <cudamem/error.hpp>
#include <cudamem/peer_access.hpp>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstdio>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

namespace cudamem {

/// Input to an import that does not fit what it is imported into: memory of a device this
/// process cannot see or cannot reach, a pointer of another pool, a descriptor that does not
/// match its handles. A `std::invalid_argument`: the input is wrong, not the system.
class ipc_error : public std::invalid_argument {
 public:
  /// `what` is wrong with the input (what() starts with "cudamem: ").
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

/// The devices of this process that get access to imported memory living on `memory_device`,
/// besides that device (which always has it), in order and each once: the importing thread's
/// `current` device when it differs, then each device of `access_from`. `device_count` is how
/// many devices this process sees, `can_access(a, b)` whether device a can reach device b's
/// memory (can_access_peer; host tests pass fakes). Throws, before anything is granted:
/// `std::out_of_range` for an id in access_from that does not exist, and `ipc_error` naming
/// both devices for one with no peer path to the memory. `what` names the importer.
template <class CanAccess>
[[nodiscard]] std::vector<int> import_access(const char* what, int memory_device, int current,
                                             std::span<const int> access_from, int device_count,
                                             CanAccess&& can_access) {
  std::vector<int> out;
  const auto add = [&](int d, bool is_current) {
    if (d == memory_device || std::find(out.begin(), out.end(), d) != out.end()) {
      return;
    }
    if (!can_access(d, memory_device)) {
      throw ipc_error(std::string(what) + ": " +
                      (is_current ? "the importing thread's current device " : "device ") +
                      std::to_string(d) + " has no peer path to device " +
                      std::to_string(memory_device) + ", where the memory lives" +
                      (is_current ? " (make device " + std::to_string(memory_device) +
                                        " current to import it, or a device that can reach it)"
                                  : ""));
    }
    out.push_back(d);
  };
  for (const int d : access_from) {  // every id checked before any peer path is asked about
    if (d < 0 || d >= device_count) {
      throw std::out_of_range(std::string("cudamem: ") + what + ": access_from names device " +
                              std::to_string(d) + ", which does not exist; valid ids are 0.." +
                              std::to_string(device_count - 1));
    }
  }
  add(current, true);
  for (const int d : access_from) {
    add(d, false);
  }
  return out;
}

/// import_access for this process: its current device, its device count, CUDA's peer paths.
[[nodiscard]] inline std::vector<int> import_access(const char* what, int memory_device,
                                                    std::span<const int> access_from) {
  return import_access(what, memory_device, current_device(), access_from, device_count(),
                       [](int a, int b) { return can_access_peer(a, b); });
}

}  // namespace detail
}  // namespace cudamem
