// Test helper: what test_ipc.cu and its child process (tests/gpu/ipc_child) say to each other
// over their socket, beside the descriptors fd_passing.hpp carries.
#pragma once

#include <cstdint>

namespace cudamem_test {

/// What the child answers after each step.
struct child_report {
  std::uint32_t step = 0;         ///< which step this answers (see each role)
  std::uint64_t good_elements = 0;  ///< elements that held what the parent wrote
  std::uint32_t passed = 0;       ///< bad-input roles: one bit per check that behaved
  std::uint32_t device = 0;       ///< the device the child's import lives on (its ordinal)
  std::uint32_t kernel_device = 0;   ///< the device the child's kernel ran on (read, hold roles)
  std::uint32_t access_devices = 0;  ///< one bit per device with access to the child's import
};

/// Steps the child reports.
enum child_step : std::uint32_t {
  step_imported = 1,  ///< imported, data checked, its own value written (read roles)
  step_busy = 2,      ///< a kernel is running on the imported memory (hold roles)
  step_checked = 3,   ///< bad-input checks done (bad roles)
  step_exported = 4,  ///< the child exported memory for the parent (export roles)
  step_refused = 5,   ///< the import was refused: no peer path (passed: check_no_peer_path)
};

/// Bits of child_report::passed for the bad-input roles.
enum bad_input_check : std::uint32_t {
  check_other_pool = 1u << 0,      ///< a token of another pool: ipc_error
  check_unknown_pointer = 1u << 1, ///< a token CUDA never issued: cuda_error
  check_closed_fd = 1u << 2,       ///< a closed descriptor: std::invalid_argument
  check_other_device = 1u << 3,    ///< a descriptor naming a device not visible: ipc_error
  check_mismatch = 1u << 4,        ///< handles that do not match their descriptor: ipc_error
  check_no_peer_path = 1u << 5,    ///< an importer's device cannot reach the memory: ipc_error
                                   ///< naming both devices
};

}  // namespace cudamem_test
