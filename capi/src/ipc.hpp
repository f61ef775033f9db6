// capi/src/ipc.hpp — memory of one process mapped by another, in the form PyTorch's own CUDA
// IPC uses: the physical handles of virtual memory as POSIX file descriptors (what PyTorch's
// expandable segments send), or a cudaIpcMemHandle_t for cudaMalloc'd memory.
//
//   // Sender: the handles under a tensor's block, as fds that stay open while it lives.
//   std::vector<unique_fd> fds;
//   ipc_export e = export_range(stack, p, bytes, fds);       // e.kind, e.offset, e.handle_bytes
//   // ... PyTorch sends (pid, fd numbers, handle size) to the receiver ...
//   // Receiver: the same physical memory, mapped here.
//   void* base = imported_ranges::instance().import(device, sender_pid, fd_numbers, handle_bytes);
//   imported_ranges::instance().unmap(base);                 // when the tensor is gone
//
// Why file descriptors by number: PyTorch's receiver (with or without cudamem) takes them from
// the sender with pidfd_getfd, so the sender only has to keep them open while the block lives
// (PyTorch keeps a sent block alive until every receiver has let go of it). The format being
// PyTorch's, a receiver that never heard of cudamem maps cudamem's memory.
//
// Contract
// - export_range: p..p+bytes must lie in memory `stack` handed out. A vm_pool made exportable
//   gives its handles (all of one size; each exported once, as an fd the caller owns); a pool
//   over cudaMalloc (or a vm_pool under compute-sanitizer) gives the cudaIpcMemHandle_t of the
//   chunk p lies in and p's offset in it; an async pool cannot share (state_error naming it).
//   Nothing is left open on failure.
// - import: pidfd_open/pidfd_getfd need the sender alive and this process allowed to trace it
//   (same user; Linux's Yama may restrict it to descendants): each failure is an ipc_error
//   saying which call failed and why. The handles are mapped side by side and made readable
//   and writable by `device`; add_peer grants another device. unmap waits for the device
//   (cudaDeviceSynchronize: no kernel may still use the range), then unmaps and releases.
// - Thread-safe (one mutex for the table of imported ranges).
#pragma once

#include "device_stack.hpp"

#include <cudamem/detail/cuda/driver.hpp>
#include <cudamem/device.hpp>
#include <cudamem/error.hpp>
#include <cudamem/fd_passing.hpp>

#include <cuda.h>
#include <cuda_runtime_api.h>

#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <map>
#include <optional>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

namespace cudamem::capi {

/// A request the peer process or this machine cannot serve (the sender gone, no permission).
class ipc_failure : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

struct ipc_export {
  bool vmm = false;               ///< handles as fds (else a cudaIpcMemHandle_t)
  std::uint64_t offset = 0;       ///< from the start of what is shared to p
  std::uint64_t handle_bytes = 0;  ///< vmm: each handle's size
  cudaIpcMemHandle_t memory_handle{};  ///< !vmm
};

/// The memory under [p, p + bytes) of `stack`, shareable; see the contract.
template <class StateError>
ipc_export export_range(const device_stack& stack, const void* p, std::size_t bytes,
                        std::vector<unique_fd>& fds) {
  ipc_export out;
  if (stack.is_async()) {
    throw StateError(
        "cudamem: memory of resource=async (a cudaMallocAsync pool) cannot be shared with "
        "other processes; use resource=vm_pool (the default) or pool");
  }
  if (vm_pool_resource* vm = stack.vm_pool()) {
    vm_resource& holder = vm->upstream_vm_of(p);  // the bulk blocks' vm_resource, or the other
    if (!holder.options().exportable) {
      throw StateError("cudamem: device " + std::to_string(stack.device()) +
                       " cannot export memory as POSIX file descriptors, which sharing it "
                       "with other processes needs");
    }
    const vm_block_handles h = holder.handles_covering(p, bytes);
    const cudamem::detail::driver_api& cu = cudamem::detail::driver();
    std::vector<unique_fd> made;
    made.reserve(h.handles.size());
    for (const auto& [handle, size] : h.handles) {
      if (size != h.handles.front().second) {
        throw StateError("cudamem: the memory to share lies on handles of different sizes");
      }
      int fd = -1;
      cudamem::detail::check_driver(
          cu.mem_export_to_shareable_handle(&fd, static_cast<CUmemGenericAllocationHandle>(handle),
                                            CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0),
          "cuMemExportToShareableHandle");
      made.emplace_back(fd);
    }
    out.vmm = true;
    out.offset = h.offset;
    out.handle_bytes = h.handles.front().second;
    fds = std::move(made);
    return out;
  }
  const auto address = reinterpret_cast<std::uintptr_t>(p);
  const std::optional<std::vector<address_range>> held = stack.segments();
  for (const address_range& r : held.value_or(std::vector<address_range>{})) {
    if (address >= r.address && address + bytes <= r.address + r.bytes) {
      const device_guard on{stack.device()};
      check(cudaIpcGetMemHandle(&out.memory_handle, reinterpret_cast<void*>(r.address)),
            "cudaIpcGetMemHandle");
      out.offset = address - r.address;
      return out;
    }
  }
  throw std::invalid_argument("cudamem: the memory to share is not memory this allocator holds");
}

/// Other processes' memory mapped here, by base address.
class imported_ranges {
 public:
  static imported_ranges& instance() {
    static auto* table = new imported_ranges;  // never destroyed: mappings may outlive statics
    return *table;
  }

  /// Maps the sender's handles (fd numbers in process `pid`) on `device`; returns the base.
  void* import(int device, int pid, const std::vector<int>& sender_fds, std::size_t handle_bytes) {
    validate_device(device);
    if (sender_fds.empty() || handle_bytes == 0) {
      throw std::invalid_argument("cudamem: an IPC handle with no memory in it");
    }
    const cudamem::detail::driver_api& cu = cudamem::detail::driver();
    const device_guard on{device};
    check(cudaFree(nullptr), "creating the primary context");
    mapping m;
    m.device = device;
    m.handle_bytes = handle_bytes;
    m.bytes = handle_bytes * sender_fds.size();
    try {
      const unique_fd pidfd{static_cast<int>(::syscall(SYS_pidfd_open, pid, 0))};
      if (!pidfd) {
        throw ipc_failure("cudamem: pidfd_open of the sending process " + std::to_string(pid) +
                          " failed: " + std::strerror(errno) +
                          (errno == ENOSYS ? " (the kernel is older than Linux 5.6)" : ""));
      }
      m.handles.reserve(sender_fds.size());
      for (const int fd : sender_fds) {
        const unique_fd mine{static_cast<int>(::syscall(SYS_pidfd_getfd, pidfd.get(), fd, 0))};
        if (!mine) {
          throw ipc_failure("cudamem: pidfd_getfd of descriptor " + std::to_string(fd) +
                            " of process " + std::to_string(pid) + " failed: " +
                            std::strerror(errno) +
                            " (the sender must be alive, and this process allowed to trace it)");
        }
        CUmemGenericAllocationHandle h = 0;
        cudamem::detail::check_driver(
            cu.mem_import_from_shareable_handle(
                &h, reinterpret_cast<void*>(static_cast<std::uintptr_t>(mine.get())),
                CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR),
            "cuMemImportFromShareableHandle");
        m.handles.push_back(h);
      }
      CUdeviceptr base = 0;
      cudamem::detail::check_driver(cu.mem_address_reserve(&base, m.bytes, 0, 0, 0), "cuMemAddressReserve");
      m.base = static_cast<std::uintptr_t>(base);
      for (std::size_t i = 0; i < m.handles.size(); ++i) {
        cudamem::detail::check_driver(cu.mem_map(static_cast<CUdeviceptr>(m.base + i * handle_bytes),
                                        handle_bytes, 0, m.handles[i], 0),
                             "cuMemMap");
        ++m.mapped;
      }
      grant(m, device);
      m.access.push_back(device);
    } catch (...) {
      undo(m);
      throw;
    }
    const std::lock_guard lock(mutex_);
    mappings_.emplace(m.base, m);
    return reinterpret_cast<void*>(m.base);
  }

  /// Gives `peer` read-write access to the mapping at `base`.
  void add_peer(void* base, int peer) {
    const std::lock_guard lock(mutex_);
    mapping& m = at(base);
    if (std::find(m.access.begin(), m.access.end(), peer) == m.access.end()) {
      grant(m, peer);
      m.access.push_back(peer);
    }
  }

  void unmap(void* base) {
    mapping m;
    {
      const std::lock_guard lock(mutex_);
      m = at(base);
      mappings_.erase(m.base);
    }
    for (const int d : m.access) {
      const device_guard on{d};
      report_error(cudaDeviceSynchronize(), "cudamem: waiting before unmapping IPC memory");
    }
    undo(m);
  }

 private:
  struct mapping {
    int device = -1;
    std::uintptr_t base = 0;
    std::size_t bytes = 0;         ///< of address space: every handle's
    std::size_t handle_bytes = 0;
    std::vector<CUmemGenericAllocationHandle> handles;
    std::size_t mapped = 0;
    std::vector<int> access;
  };

  mapping& at(void* base) {
    const auto it = mappings_.find(reinterpret_cast<std::uintptr_t>(base));
    if (it == mappings_.end()) {
      throw std::invalid_argument("cudamem: no memory of another process is mapped there");
    }
    return it->second;
  }

  static void grant(const mapping& m, int device) {
    CUmemAccessDesc desc{};
    desc.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    desc.location.id = device;
    desc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    cudamem::detail::check_driver(
        cudamem::detail::driver().mem_set_access(static_cast<CUdeviceptr>(m.base), m.bytes, &desc, 1),
        "cuMemSetAccess");
  }

  /// Unmaps, frees the range, releases the handles: what was done of the import.
  static void undo(const mapping& m) noexcept {
    const cudamem::detail::driver_api& cu = cudamem::detail::driver();
    for (std::size_t i = 0; i < m.mapped; ++i) {
      cudamem::detail::report_driver_error(
          cu.mem_unmap(static_cast<CUdeviceptr>(m.base + i * m.handle_bytes), m.handle_bytes),
          "cudamem: cuMemUnmap of IPC memory");
    }
    if (m.base != 0) {
      cudamem::detail::report_driver_error(cu.mem_address_free(static_cast<CUdeviceptr>(m.base), m.bytes),
                                  "cudamem: cuMemAddressFree of IPC memory");
    }
    for (const CUmemGenericAllocationHandle h : m.handles) {
      cudamem::detail::report_driver_error(cu.mem_release(h), "cudamem: cuMemRelease of IPC memory");
    }
  }

  std::mutex mutex_;
  std::map<std::uintptr_t, mapping> mappings_;
};

}  // namespace cudamem::capi
