// cudamem/vm_ipc.hpp — a vm_resource block mapped by another process: the exporter turns the
// block's physical handles into POSIX file descriptors, the importer maps them into an address
// range of its own. Linux.
//
//   #include <cudamem/vm_ipc.hpp>
//
//   // Exporting process:
//   cudamem::vm_resource vm{0, {.exportable = true}};      // handles created shareable
//   void* p = vm.allocate(256 << 20);
//   ... fill p, synchronise ...
//   cudamem::vm_block_export shared = cudamem::export_block(vm, p);
//   cudamem::send_fds(socket, shared.fd_numbers(), cudamem::as_bytes_of(shared.descriptor));
//   // shared's fds close with it; the importer has its own copies.
//   // ... wait until the importer is done (or gone), then vm.deallocate(p, 256 << 20).
//
//   // Importing process:
//   cudamem::received_fds r = cudamem::receive_fds(socket);
//   cudamem::imported_vm_block block{std::move(r.fds),
//                                    r.payload_as<cudamem::vm_block_descriptor>()};
//   kernel<<<g, b, 0, s.get()>>>(block.span<float>());     // on this thread's GPU, whichever
//   // block's destructor waits for its devices, unmaps, releases the handles and the range.
//
// Why. Virtual memory is the one kind of CUDA memory whose physical pages are objects of their
// own (handles) that can travel as file descriptors: the importer maps them wherever it likes,
// and each side's references keep the pages alive — memory survives the death of the process
// that made it for as long as another still maps it, and goes back to the device when the
// last reference goes. Raw, that is a dozen driver calls per side with a release path for each
// failure; here it is one owner per side.
//
// Contract — exporter
// - `export_block(vm, p)`: `vm` must have been made with `vm_resource_options::exportable` and
//   `p` must start a block it gave out and has not freed (else `std::invalid_argument`, from
//   vm_resource::block_handles), on a real device (a simulated one: `std::invalid_argument`).
//   Returns a `vm_block_export`: one `unique_fd` per physical handle under the block (at most
//   `max_vm_export_handles`: a larger block throws `std::invalid_argument`) and a
//   `vm_block_descriptor` (trivially copyable: the payload to send with them) naming the
//   device by UUID, the handles' sizes, and where in them the block starts. Driver failures
//   throw `driver_error`; nothing is left open.
// - The importer maps whole handles: a small block shares its handle with its neighbours, and
//   the importer can reach them too. Export blocks of `handle_bytes` or more (they own their
//   handles) when that matters.
// - The exporter's memory stays valid until it frees it, whatever the importer does. Free only
//   once the importer is done or gone: after the free, the exporter may give the same physical
//   memory to another block (and vm_resource may recycle it) while the importer still maps it.
//   When the exporter dies first, the importer's mapping keeps the memory alive.
//
// Contract — importer (`imported_vm_block`)
// - Takes the fds and the descriptor; imports every handle (cuMemImportFromShareableHandle),
//   reserves one range, maps them side by side, and grants read-write access to the memory's
//   device, to the importing thread's current device when it is another (importers on any
//   GPU: a process on GPU 1 maps GPU 0's block and uses it in its kernels as it is), and to
//   `options.access_from`; `access_devices()` lists them, the memory's own first. `get()` /
//   `span<T>()` is the block, `bytes()` what the exporter asked for. The fds are closed once
//   imported.
// - Errors, nothing left behind on any (handles released, range freed, mappings undone): an fd
//   that is not open `std::invalid_argument`; a device id in `access_from` that does not exist
//   `std::out_of_range`; a descriptor that does not match its fds (count, sizes, offset), of an
//   unknown version, or naming a device this process cannot see, a handle that lives on
//   another device than the descriptor says, or a current device or `access_from` device with
//   no peer path to the memory (the error names both devices: at the import, never as a fault
//   in a kernel later): `ipc_error` (a std::invalid_argument); driver failures `driver_error`.
// - The destructor waits for the devices with access (cudaDeviceSynchronize: no kernel may
//   still use the range), unmaps, releases the imported handles and frees the range; failures
//   go to the error handler. Neither copyable nor movable.
#pragma once

#if defined(__linux__)

#include <cudamem/detail/cuda/driver.hpp>
#include <cudamem/detail/cuda/quiet_device_scope.hpp>
#include <cudamem/detail/ipc/ipc_common.hpp>
#include <cudamem/device.hpp>
#include <cudamem/device_span.hpp>
#include <cudamem/error.hpp>
#include <cudamem/fd_passing.hpp>
#include <cudamem/peer_access.hpp>
#include <cudamem/vm_resource.hpp>

#include <cuda.h>
#include <cuda_runtime_api.h>

#include <fcntl.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace cudamem {

/// Most physical handles one exported block may span (fits one fd_passing message).
inline constexpr std::size_t max_vm_export_handles = 240;

/// What the importer needs besides the fds. Trivially copyable: send it as the payload.
struct vm_block_descriptor {
  std::uint32_t version = 1;       ///< the layout's version; importers refuse others
  std::uint32_t handle_count = 0;  ///< physical handles under the block (fds sent)
  detail::device_uuid device{};  ///< where the physical memory lives
  std::uint64_t granularity = 0;  ///< the exporter's mapping granularity
  std::uint64_t bytes = 0;        ///< the block, as its caller asked for it
  std::uint64_t offset = 0;       ///< from the first handle's start to the block's start
  std::uint64_t handle_bytes[max_vm_export_handles]{};  ///< each handle's size, in order
};
static_assert(std::is_trivially_copyable_v<vm_block_descriptor>);

/// One block exported: an fd per handle (in order) and the descriptor.
struct vm_block_export {
  std::vector<unique_fd> fds;      ///< one per handle, in order, to send (fd_passing.hpp)
  vm_block_descriptor descriptor;  ///< to send with them, as the payload

  /// The fd numbers, as send_fds takes them.
  [[nodiscard]] std::vector<int> fd_numbers() const {
    std::vector<int> out;
    out.reserve(fds.size());
    for (const unique_fd& fd : fds) {
      out.push_back(fd.get());
    }
    return out;
  }
};

/// Exports the block at `p` of `vm`; see the contract above.
[[nodiscard]] inline vm_block_export export_block(const vm_resource& vm, const void* p) {
  if (vm.device() < 0) {
    throw std::invalid_argument("cudamem: export_block: a simulated device has no memory to export");
  }
  const vm_block_handles handles = vm.block_handles(p);
  if (handles.handles.size() > max_vm_export_handles) {
    throw std::invalid_argument("cudamem: export_block: the block spans " +
                                std::to_string(handles.handles.size()) + " handles; at most " +
                                std::to_string(max_vm_export_handles) +
                                " travel together (use larger handle_bytes)");
  }
  vm_block_export out;
  out.descriptor.handle_count = static_cast<std::uint32_t>(handles.handles.size());
  out.descriptor.device = detail::uuid_of(vm.device());
  out.descriptor.granularity = vm.granularity();
  out.descriptor.bytes = handles.requested;
  out.descriptor.offset = handles.offset;
  out.fds.reserve(handles.handles.size());
  const detail::driver_api& cu = detail::driver();
  const device_guard on{vm.device()};
  for (std::size_t i = 0; i < handles.handles.size(); ++i) {
    int fd = -1;
    detail::check_driver(
        cu.mem_export_to_shareable_handle(
            &fd, static_cast<CUmemGenericAllocationHandle>(handles.handles[i].first),
            CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0),
        "cuMemExportToShareableHandle");
    out.fds.emplace_back(fd);  // reserved: cannot throw
    out.descriptor.handle_bytes[i] = handles.handles[i].second;
  }
  return out;
}

/// How to import a block.
struct imported_vm_options {
  /// More devices of this process that will use the memory, besides the importing thread's
  /// current device (which gets access by itself).
  std::vector<int> access_from{};
};

/// Another process's vm block, mapped here; see the contract above.
class imported_vm_block {
 public:
  /// Maps the block the `fds` (taken) and `descriptor` describe; throws ipc_error for a descriptor
  /// that does not match them, std::invalid_argument for a closed fd.
  imported_vm_block(std::vector<unique_fd> fds, const vm_block_descriptor& descriptor,
                    imported_vm_options options = {}) {
    const std::size_t total = validate(fds, descriptor);
    device_ = detail::require_device_with_uuid(descriptor.device, "imported_vm_block");
    // The importing thread's device (when another) and access_from: checked before the import.
    const std::vector<int> others = detail::import_access("imported_vm_block", device_,
                                                         options.access_from);
    access_.reserve(others.size() + 1);
    access_.push_back(device_);
    access_.insert(access_.end(), others.begin(), others.end());
    const detail::driver_api& cu = detail::driver();
    const device_guard on{device_};
    check(cudaFree(nullptr), "creating the primary context");
    handles_.reserve(fds.size());  // so that keeping a handle cannot throw and leak it
    try {
      for (std::size_t i = 0; i < fds.size(); ++i) {
        CUmemGenericAllocationHandle handle = 0;
        detail::check_driver(
            cu.mem_import_from_shareable_handle(
                &handle, reinterpret_cast<void*>(static_cast<std::uintptr_t>(fds[i].get())),
                CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR),
            "cuMemImportFromShareableHandle");
        handles_.push_back({handle, static_cast<std::size_t>(descriptor.handle_bytes[i])});
        fds[i].reset();  // the handle holds the memory now
        CUmemAllocationProp prop{};
        detail::check_driver(cu.mem_get_allocation_properties_from_handle(&prop, handle),
                             "cuMemGetAllocationPropertiesFromHandle");
        if (prop.location.type != CU_MEM_LOCATION_TYPE_DEVICE || prop.location.id != device_) {
          throw ipc_error("imported_vm_block: handle " + std::to_string(i) +
                          " lives on device " + std::to_string(prop.location.id) +
                          ", the descriptor says device " + std::to_string(device_) +
                          " (a handle from another device)");
        }
      }
      CUdeviceptr base = 0;
      detail::check_driver(
          cu.mem_address_reserve(&base, total, static_cast<std::size_t>(descriptor.granularity), 0, 0),
          "cuMemAddressReserve");
      base_ = static_cast<std::uintptr_t>(base);
      reserved_ = total;
      for (handle_mapping& h : handles_) {
        detail::check_driver(
            cu.mem_map(static_cast<CUdeviceptr>(base_ + mapped_bytes_), h.bytes, 0, h.handle, 0),
            "cuMemMap");
        h.mapped = true;
        mapped_bytes_ += h.bytes;
      }
      std::vector<CUmemAccessDesc> access;
      for (const int d : access_) {
        CUmemAccessDesc desc{};
        desc.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
        desc.location.id = d;
        desc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
        access.push_back(desc);
      }
      detail::check_driver(cu.mem_set_access(static_cast<CUdeviceptr>(base_), total,
                                             access.data(), access.size()),
                           "cuMemSetAccess");
    } catch (...) {
      undo();
      throw;
    }
    ptr_ = reinterpret_cast<void*>(base_ + static_cast<std::uintptr_t>(descriptor.offset));
    bytes_ = static_cast<std::size_t>(descriptor.bytes);
  }

  ~imported_vm_block() {
    for (const int d : access_) {
      const detail::quiet_device_scope on{d, "imported_vm_block: switching device"};
      report_error(cudaDeviceSynchronize(), "imported_vm_block: waiting before the unmap");
    }
    undo();
  }

  imported_vm_block(const imported_vm_block&) = delete;
  imported_vm_block& operator=(const imported_vm_block&) = delete;
  imported_vm_block(imported_vm_block&&) = delete;
  imported_vm_block& operator=(imported_vm_block&&) = delete;

  /// The block, mapped in this process.
  [[nodiscard]] void* get() const noexcept { return ptr_; }
  /// The block's bytes, as the exporter's caller asked for them.
  [[nodiscard]] std::size_t bytes() const noexcept { return bytes_; }
  /// The device (in this process) the memory lives on.
  [[nodiscard]] int device() const noexcept { return device_; }
  /// The devices that may use the memory: device() first, then the importing thread's device
  /// (when another) and access_from's, each once.
  [[nodiscard]] const std::vector<int>& access_devices() const noexcept { return access_; }
  /// The whole range mapped here (every handle of the block).
  [[nodiscard]] std::size_t mapped_bytes() const noexcept { return mapped_bytes_; }
  /// The block as `bytes() / sizeof(T)` elements of T, for kernels.
  template <class T>
  [[nodiscard]] device_span<T> span() const noexcept {
    return {static_cast<T*>(ptr_), bytes_ / sizeof(T)};
  }

 private:
  struct handle_mapping {
    CUmemGenericAllocationHandle handle;
    std::size_t bytes;
    bool mapped = false;
  };

  /// Checks the fds and the descriptor against each other; returns the bytes of all handles.
  static std::size_t validate(const std::vector<unique_fd>& fds, const vm_block_descriptor& d) {
    if (d.version != 1) {
      throw ipc_error("imported_vm_block: descriptor version " + std::to_string(d.version) +
                      " is not one this cudamem reads");
    }
    if (d.handle_count == 0 || d.handle_count > max_vm_export_handles ||
        d.handle_count != fds.size()) {
      throw ipc_error("imported_vm_block: the descriptor lists " + std::to_string(d.handle_count) +
                      " handles, " + std::to_string(fds.size()) + " descriptors came with it");
    }
    for (const unique_fd& fd : fds) {
      if (!fd || ::fcntl(fd.get(), F_GETFD) == -1) {
        throw std::invalid_argument("cudamem: imported_vm_block: descriptor (fd " +
                                    std::to_string(fd.get()) + ") is not open");
      }
    }
    const std::uint64_t g = d.granularity;
    if (g == 0 || (g & (g - 1)) != 0) {
      throw ipc_error("imported_vm_block: granularity " + std::to_string(g) +
                      " is not a power of two");
    }
    std::uint64_t total = 0;
    for (std::uint32_t i = 0; i < d.handle_count; ++i) {
      if (d.handle_bytes[i] == 0 || d.handle_bytes[i] % g != 0) {
        throw ipc_error("imported_vm_block: handle " + std::to_string(i) + " of " +
                        std::to_string(d.handle_bytes[i]) + " bytes is not a granule multiple");
      }
      total += d.handle_bytes[i];
    }
    if (d.bytes == 0 || d.offset > total || d.bytes > total - d.offset) {
      throw ipc_error("imported_vm_block: a block of " + std::to_string(d.bytes) +
                      " bytes at offset " + std::to_string(d.offset) + " does not fit in its " +
                      std::to_string(total) + " bytes of handles");
    }
    return static_cast<std::size_t>(total);
  }

  /// Unmaps what was mapped, frees the range, releases the handles: noexcept, reported.
  void undo() noexcept {
    const detail::driver_api* cu = nullptr;
    try {
      cu = &detail::driver();
    } catch (...) {
      return;  // no driver: nothing can have been imported
    }
    std::size_t offset = 0;
    for (handle_mapping& h : handles_) {
      if (h.mapped) {
        detail::report_driver_error(
            cu->mem_unmap(static_cast<CUdeviceptr>(base_ + offset), h.bytes),
            "imported_vm_block: cuMemUnmap");
        h.mapped = false;
      }
      offset += h.bytes;
    }
    if (reserved_ != 0) {
      detail::report_driver_error(
          cu->mem_address_free(static_cast<CUdeviceptr>(base_), reserved_),
          "imported_vm_block: cuMemAddressFree");
      reserved_ = 0;
    }
    for (const handle_mapping& h : handles_) {
      detail::report_driver_error(cu->mem_release(h.handle), "imported_vm_block: cuMemRelease");
    }
    handles_.clear();
    mapped_bytes_ = 0;
  }

  int device_ = -1;
  std::vector<int> access_;
  std::vector<handle_mapping> handles_;
  std::uintptr_t base_ = 0;
  std::size_t reserved_ = 0;
  std::size_t mapped_bytes_ = 0;
  void* ptr_ = nullptr;
  std::size_t bytes_ = 0;
};

}  // namespace cudamem

#endif  // __linux__
