// cudamem/_torch/allocator_ipc.hpp — memory other GPUs and other processes see: peer access
// to cudamem's virtual memory, copies between GPUs, and tensors sent to other processes
// (torch.multiprocessing) in PyTorch's own handle format, so a receiver with or without cudamem
// maps them.
//
//   q.put(x)                       # shareIpcHandle: POSIX file descriptors of x's physical memory
//   y = q.get()                    # getIpcDevPtr: mapped here (cudamem_ipc_import), cached
//
// Owns: enablePeerAccess, memcpyAsync, shareIpcHandle, getIpcDevPtr and the handle format
// (version 2: 'c' a cudaMalloc'd range, 'e' an expandable segment's handles). The same in every
// release 2.7-2.15.
#pragma once

#include "allocator_class.hpp"

#include <sys/syscall.h>
#include <unistd.h>

#include <cstring>

namespace {

/// The IPC handle format PyTorch's own allocator writes and reads (version 2).
constexpr char ipc_version = 2;
constexpr char ipc_cuda_malloc = 'c';
constexpr char ipc_expandable = 'e';
struct ipc_share_header {  // as PyTorch's expandable segments write it: 24 bytes
  std::int32_t pid;
  std::int32_t padding;
  std::uint64_t segment_size;
  std::uint64_t num_handles;
};
static_assert(sizeof(ipc_share_header) == 24);


void cudamem_torch_allocator::enablePeerAccess(DeviceIndex dev, DeviceIndex dev_to_access) {
  {
    const c10::cuda::CUDAGuard on{dev};
    const cudaError_t e = cudaDeviceEnablePeerAccess(dev_to_access, 0);
    if (e == cudaErrorPeerAccessAlreadyEnabled) {
      static_cast<void>(cudaGetLastError());
    } else {
      C10_CUDA_CHECK(e);
    }
  }
  // cudamem's memory on dev_to_access is virtual memory: `dev` needs access to its mappings,
  // the present ones and those to come.
  check_status(cudamem_add_peer(process_allocator, dev_to_access, dev), "peer access");
  const std::lock_guard lock(ipc_mutex_);
  for (const auto& [base, m] : imported_) {
    if (m.device == dev_to_access) {
      check_status(cudamem_ipc_add_peer(base, dev), "peer access to an imported block");
    }
  }
}

cudaError_t cudamem_torch_allocator::memcpyAsync(void* dst, int dst_device, const void* src,
                                                 int src_device, std::size_t count,
                                                 cudaStream_t stream, bool p2p_enabled) {
  if (p2p_enabled || dst_device == src_device) {
    return cudaMemcpyAsync(dst, src, count, cudaMemcpyDeviceToDevice, stream);
  }
  // Without peer access, virtual memory is copied by the peer form only.
  return cudaMemcpyPeerAsync(dst, dst_device, src, src_device, count, stream);
}

cca::ShareableHandle cudamem_torch_allocator::shareIpcHandle(void* ptr) {
  std::unique_lock lock(mutex_);
  block* b = find_containing(ptr);
  TORCH_CHECK(b != nullptr, "invalid device pointer: ", ptr);
  const std::ptrdiff_t into = static_cast<char*>(ptr) - static_cast<char*>(b->address);
  if (!b->rare().ipc_handle.empty()) {  // shared before: the same bytes (receivers cache them)
    return {b->rare().ipc_offset + into, b->rare().ipc_handle};
  }
  void* const address = b->address;
  const std::size_t size = b->size;
  const DeviceIndex device = b->device;
  lock.unlock();
  cudamem_ipc_export e{};
  e.struct_size = sizeof(e);
  // Handles are whole granules of at least 2 MiB: this many fds are enough.
  std::vector<int> fds(size / (std::size_t{2} << 20) + 2);
  std::size_t fd_count = 0;
  const cudamem_status s = cudamem_ipc_export_range(process_allocator, device, address, size, &e,
                                                    fds.data(), fds.size(), &fd_count);
  TORCH_CHECK(s == CUDAMEM_OK, "cudamem: this tensor cannot be sent to another process: ",
              last_error());
  fds.resize(fd_count);
  std::string bytes;
  bytes.push_back(ipc_version);
  if (e.kind == CUDAMEM_IPC_CUDA_MALLOC) {
    bytes.push_back(ipc_cuda_malloc);
    bytes.append(reinterpret_cast<const char*>(e.ipc_mem_handle), sizeof(e.ipc_mem_handle));
  } else {
    bytes.push_back(ipc_expandable);
    const ipc_share_header header{static_cast<std::int32_t>(::getpid()), 0, e.handle_bytes,
                                  fds.size()};
    bytes.append(reinterpret_cast<const char*>(&header), sizeof(header));
    for (const int fd : fds) {
      const auto fd32 = static_cast<std::int32_t>(fd);
      bytes.append(reinterpret_cast<const char*>(&fd32), sizeof(fd32));
    }
  }
  const auto offset = static_cast<std::ptrdiff_t>(e.offset);
  lock.lock();
  b = find_containing(ptr);
  if (b == nullptr) {  // freed meanwhile by another thread: nothing to keep open
    for (const int fd : fds) {
      ::close(fd);
    }
    TORCH_CHECK(false, "invalid device pointer: ", ptr);
  }
  b->more().exported_fds = std::move(fds);
  b->more().ipc_handle = bytes;
  b->more().ipc_offset = offset;
  return {offset + into, bytes};
}

std::shared_ptr<void> cudamem_torch_allocator::getIpcDevPtr(std::string handle) {
  const std::lock_guard lock(ipc_mutex_);
  if (const auto it = imported_by_handle_.find(handle); it != imported_by_handle_.end()) {
    if (std::shared_ptr<void> alive = it->second.lock()) {
      return alive;
    }
  }
  const DeviceIndex device = c10::cuda::current_device();
  std::shared_ptr<void> mapped;
  if (handle.size() == sizeof(cudaIpcMemHandle_t) ||
      (handle.size() >= 2 && handle[1] == ipc_cuda_malloc)) {
    TORCH_CHECK(handle.size() == sizeof(cudaIpcMemHandle_t) ||
                    handle.size() == 2 + sizeof(cudaIpcMemHandle_t),
                "cudamem: an ill-formed CUDA IPC handle");
    cudaIpcMemHandle_t h;
    std::memcpy(&h, handle.data() + (handle.size() == sizeof(h) ? 0 : 2), sizeof(h));
    void* p = nullptr;
    C10_CUDA_CHECK(cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess));
    mapped = std::shared_ptr<void>(p, [this, handle, device](void* q) {
      {
        const std::lock_guard inner(ipc_mutex_);
        imported_by_handle_.erase(handle);
      }
      const c10::cuda::CUDAGuard on{device};
      C10_CUDA_CHECK_WARN(cudaIpcCloseMemHandle(q));
    });
  } else {
    TORCH_CHECK(handle.size() >= 2 + sizeof(ipc_share_header), "cudamem: an ill-formed handle");
    TORCH_CHECK(handle[0] <= ipc_version,
                "received sharable handle from a future version of torch that this version "
                "does not know how to handle");
    TORCH_CHECK(handle[1] == ipc_expandable, "cudamem: unexpected or ill-formed shareable handle");
    ipc_share_header header{};
    std::memcpy(&header, handle.data() + 2, sizeof(header));
    TORCH_CHECK(handle.size() == 2 + sizeof(header) + header.num_handles * sizeof(std::int32_t),
                "cudamem: an ill-formed handle (its file descriptors)");
    std::vector<int> fds(header.num_handles);
    for (std::size_t i = 0; i < fds.size(); ++i) {
      std::int32_t fd = 0;
      std::memcpy(&fd, handle.data() + 2 + sizeof(header) + i * sizeof(fd), sizeof(fd));
      fds[i] = fd;
    }
    void* base = nullptr;
    check_status(cudamem_ipc_import(device, header.pid, fds.data(), fds.size(),
                                    header.segment_size, &base),
                 "mapping another process's memory");
    imported_.emplace(base, imported_mapping{device});
    mapped = std::shared_ptr<void>(base, [this, handle](void* q) {
      const std::lock_guard inner(ipc_mutex_);
      imported_by_handle_.erase(handle);
      imported_.erase(q);
      if (cudamem_ipc_unmap(q) != CUDAMEM_OK) {
        TORCH_WARN("cudamem: unmapping another process's memory: ", last_error());
      }
    });
  }
  imported_by_handle_[handle] = mapped;
  return mapped;
}

}  // namespace
