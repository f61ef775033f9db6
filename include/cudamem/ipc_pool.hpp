// cudamem/ipc_pool.hpp — a stream-ordered memory pool whose allocations another process can
// map: the exporter allocates as from any resource, the importer gets the same memory, and
// each side's owners give back what they hold. Linux (POSIX file-descriptor handles).
//
//   #include <cudamem/ipc_pool.hpp>
//
//   // Exporting process:
//   cudamem::ipc_pool_resource pool{{.device = 0}};         // cudaMemPoolCreate, shareable
//   cudamem::device_buffer<float> x(n, 1.0f, s, pool);      // stream-ordered, as usual
//   s.synchronize();                                        // the importer must not run ahead
//   cudamem::ipc_pool_export shared = pool.export_pool();   // fd + descriptor
//   cudamem::ipc_pointer token = pool.export_pointer(x.data());
//   cudamem::send_fds(socket, {shared.fd.get()}, cudamem::as_bytes_of(shared.descriptor));
//   cudamem::send_fds(socket, {}, cudamem::as_bytes_of(token));   // any channel will do
//   // ... wait until the importer says it is done (or is gone), then free x as usual.
//
//   // Importing process:
//   cudamem::received_fds r = cudamem::receive_fds(socket);
//   cudamem::imported_pool pool{std::move(r.fds[0]), r.payload_as<cudamem::ipc_pool_descriptor>()};
//   cudamem::imported_pointer p = pool.import(token);        // the exporter's memory, mapped
//   kernel<<<g, b, 0, s.get()>>>(p.span<float>());         // on this thread's GPU, whichever
//   // p's destructor unmaps it (waits for the devices, frees); pool's closes the import.
//
// Why. CUDA's pools can be shared (cudaMemPoolExportToShareableHandle, cudaMemPoolExportPointer,
// and the import functions), but each side must release in the right order and on every path:
// an importer that forgets its free keeps the exporter's memory mapped (held by "no process"
// once the exporter is done), an exporter that frees first pulls the memory from under a
// running kernel. Here each side has owners: `ipc_pool_resource` (a memory_resource), and
// `imported_pool` / `imported_pointer` in the importer.
//
// Contract — exporter (`ipc_pool_resource`)
// - A memory_resource of kind device on `options.device` (the current device by default): a
//   CUDA pool of its own created with cudaMemHandleTypePosixFileDescriptor, allocation and
//   free stream-ordered (cudaMallocFromPoolAsync / cudaFreeAsync), alignment up to 256 bytes,
//   out of memory as `out_of_memory` (once memory held ahead by vm_resources has given way:
//   detail/held_ahead.hpp). A device whose pools cannot export POSIX descriptors
//   throws `cuda_error` (cudaErrorNotSupported); no GPU `no_device_error`; a bad id
//   `std::out_of_range`.
// - `export_pool()` returns a new descriptor for the pool (an `ipc_pool_export`: its `fd`, a
//   `unique_fd`, plus an `ipc_pool_descriptor` naming the device by UUID and the pool by a
//   random id). Send both (fd_passing.hpp); the exporter's copy of the fd is closed with the
//   `ipc_pool_export`.
// - `export_pointer(p)` returns an `ipc_pointer` (trivially copyable, any channel) for `p`, the
//   start of an allocation this resource made and has not freed; anything else throws
//   `std::invalid_argument` (a pointer the exporter never gave), before CUDA is asked. The
//   pool must have been exported first: CUDA shares allocations only of a pool already shared
//   (cudaMemPoolExportPointer fails with a bare cudaErrorInvalidValue otherwise, seen on the
//   H100), so export_pointer before any export_pool throws `std::logic_error` saying so.
// - The memory stays valid in the exporter until it frees it, whatever the importer does or
//   whether it is still alive. CUDA's rule: every importer must have freed (unmapped) its
//   import before the exporter frees the allocation: wait for the importer to say so, or to be
//   gone. (When an importer dies, its mappings go with its context.) Access must also follow
//   stream order: synchronise the allocating stream before the importer uses the memory.
// - IPC pools never give free memory back to the device while they live (CUDA: trim is a
//   no-op for them); destroying the resource does. The destructor reports allocations still
//   outstanding to the error handler.
//
// Contract — importer (`imported_pool`, `imported_pointer`)
// - `imported_pool(fd, descriptor, options)` imports the pool (cudaMemPoolImportFromShareableHandle)
//   and takes the fd (closed once imported). The memory lives on the device named by the
//   descriptor's UUID. Importers on any GPU: the importing thread's current device gets access
//   (cudaMemPoolSetAccess) when it is not the memory's device, so a process that runs on GPU 1
//   can import GPU 0's memory and use it in its kernels as it is; `options.access_from` lists
//   more devices of this process that will use it. `access_devices()` lists every device with
//   access, the memory's own first. Each needs a peer path to the memory (can_access_peer).
//   Errors, nothing left behind on any: an fd that is not open `std::invalid_argument`; a
//   device id in `access_from` that does not exist `std::out_of_range`; a device this process
//   cannot see, or a current device or one in `access_from` with no peer path to the memory,
//   `ipc_error` (a std::invalid_argument) naming both devices — at the import, never as a fault
//   in a kernel later; an fd that is not a pool handle: `cuda_error` from CUDA.
// - `import(token)` maps one exported allocation (cudaMemPoolImportPointer) and returns its
//   owner, `imported_pointer`: `get()`, `bytes()`, `span<T>()`; its destructor frees the
//   mapping as cudaFree would (waits for every device with access, then frees, complete
//   before it returns, as CUDA requires before the exporter frees). A token of another pool
//   throws `ipc_error`; one CUDA does not know (a pointer the exporter never exported, or
//   already freed) `cuda_error`.
// - The imported_pool must outlive its imported_pointers (its destructor reports any left).
//   Both are move-only; the destructors are noexcept and report failures to the error handler.
#pragma once

#if defined(__linux__)

#include <cudamem/detail/cuda/cuda_upstream.hpp>
#include <cudamem/detail/cuda/quiet_device_scope.hpp>
#include <cudamem/detail/ipc/ipc_common.hpp>
#include <cudamem/detail/sync/atomic.hpp>
#include <cudamem/detail/sync/mutex.hpp>
#include <cudamem/device.hpp>
#include <cudamem/device_span.hpp>
#include <cudamem/error.hpp>
#include <cudamem/fd_passing.hpp>
#include <cudamem/memory_resource.hpp>
#include <cudamem/peer_access.hpp>

#include <cuda_runtime_api.h>

#include <fcntl.h>

#include <cstddef>
#include <cstdint>
#include <random>
#include <stdexcept>
#include <string>
#include <string_view>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <vector>

namespace cudamem {

/// How to create an `ipc_pool_resource`.
struct ipc_pool_options {
  int device = -1;  ///< -1: the current device
};

/// What the importer needs besides the pool's fd. Trivially copyable: send it as the payload.
struct ipc_pool_descriptor {
  std::uint32_t version = 1;     ///< the layout's version; importers refuse others
  detail::device_uuid device{};  ///< where the memory lives
  std::uint64_t pool_id = 0;     ///< which pool (random, chosen at creation)
};

/// A pool exported for one importer: the fd to send and its descriptor.
struct ipc_pool_export {
  unique_fd fd;                    ///< the pool's handle, to send (fd_passing.hpp)
  ipc_pool_descriptor descriptor;  ///< to send with it, as the payload
};

/// One exported allocation. Trivially copyable: any channel will do (it is not a capability:
/// only a process that imported the pool can use it).
struct ipc_pointer {
  cudaMemPoolPtrExportData data{};  ///< CUDA's token for the allocation
  std::uint64_t pool_id = 0;        ///< the pool it belongs to
  std::uint64_t bytes = 0;          ///< its size
};
static_assert(std::is_trivially_copyable_v<ipc_pool_descriptor>);
static_assert(std::is_trivially_copyable_v<ipc_pointer>);

/// A stream-ordered pool whose allocations other processes can import; see the contract.
class ipc_pool_resource final : public memory_resource {
 public:
  /// A shareable pool of its own on `options.device`; throws cuda_error on a device whose pools
  /// cannot export POSIX file descriptors.
  explicit ipc_pool_resource(ipc_pool_options options = {})
      : memory_resource(memory_kind::device, detail::resolve_device(options.device)) {
    const device_guard on{device()};
    int pools = 0;
    check(cudaDeviceGetAttribute(&pools, cudaDevAttrMemoryPoolsSupported, device()),
          "cudaDeviceGetAttribute(MemoryPoolsSupported)");
    int handle_types = 0;
    if (pools != 0) {
      check(cudaDeviceGetAttribute(&handle_types, cudaDevAttrMemoryPoolSupportedHandleTypes,
                                   device()),
            "cudaDeviceGetAttribute(MemoryPoolSupportedHandleTypes)");
    }
    if ((handle_types & cudaMemHandleTypePosixFileDescriptor) == 0) {
      throw cuda_error(cudaErrorNotSupported,
                       "ipc_pool_resource: device " + std::to_string(device()) +
                           " has no memory pools that export POSIX file descriptors");
    }
    cudaMemPoolProps props{};
    props.allocType = cudaMemAllocationTypePinned;
    props.handleTypes = cudaMemHandleTypePosixFileDescriptor;  // what makes it shareable
    props.location.type = cudaMemLocationTypeDevice;
    props.location.id = device();
    check(cudaMemPoolCreate(&pool_, &props), "ipc_pool_resource: cudaMemPoolCreate");
    descriptor_.device = detail::uuid_of(device());
    std::random_device entropy;
    descriptor_.pool_id = (std::uint64_t{entropy()} << 32) ^ entropy() ^
                          reinterpret_cast<std::uintptr_t>(pool_);
  }

  ~ipc_pool_resource() override {
    {
      const detail::lock_guard lock(mutex_);
      if (!live_.empty()) {
        report_problem("ipc_pool_resource destroyed with " + std::to_string(live_.size()) +
                       " allocation(s) outstanding (leaked; CUDA releases the pool when they "
                       "are freed)");
      }
    }
    const detail::quiet_device_scope on{device(), "ipc_pool_resource: switching device"};
    report_error(cudaMemPoolDestroy(pool_), "ipc_pool_resource: cudaMemPoolDestroy");
  }

  ipc_pool_resource(const ipc_pool_resource&) = delete;
  ipc_pool_resource& operator=(const ipc_pool_resource&) = delete;

  /// A new shareable descriptor for the pool, and what the importer needs with it.
  [[nodiscard]] ipc_pool_export export_pool() const {
    int fd = -1;
    check(cudaMemPoolExportToShareableHandle(&fd, pool_, cudaMemHandleTypePosixFileDescriptor, 0),
          "cudaMemPoolExportToShareableHandle");
    exported_.store(true, detail::memory_order_release);
    return {unique_fd{fd}, descriptor_};
  }

  /// The token for `p`, an allocation of this resource not yet freed; else std::invalid_argument.
  [[nodiscard]] ipc_pointer export_pointer(const void* p) const {
    if (!exported_.load(detail::memory_order_acquire)) {
      throw std::logic_error(
          "cudamem: ipc_pool_resource::export_pointer: call export_pool() first (CUDA exports "
          "allocations only of a pool that has been shared)");
    }
    ipc_pointer token;
    {
      const detail::lock_guard lock(mutex_);
      const auto found = live_.find(p);
      if (found == live_.end()) {
        throw std::invalid_argument(
            "cudamem: ipc_pool_resource::export_pointer: not the start of a live allocation of "
            "this pool (a pointer it never gave, or one already freed)");
      }
      token.bytes = found->second;
    }
    check(cudaMemPoolExportPointer(&token.data, const_cast<void*>(p)), "cudaMemPoolExportPointer");
    token.pool_id = descriptor_.pool_id;
    return token;
  }

  /// What an importer needs besides the fd (also in each export_pool()).
  [[nodiscard]] const ipc_pool_descriptor& descriptor() const noexcept { return descriptor_; }
  /// The CUDA pool, for calls cudamem does not make.
  [[nodiscard]] cudaMemPool_t pool_handle() const noexcept { return pool_; }

 private:
  void* do_allocate(std::size_t bytes, std::size_t alignment, stream_view stream) override {
    detail::check_cuda_alignment("ipc_pool_resource", alignment);
    const device_guard on{device()};
    void* p = nullptr;
    std::size_t given_back = 0;
    const cudaError_t code = detail::allocate_giving_way(device(), given_back, [&] {
      return cudaMallocFromPoolAsync(&p, bytes, pool_, stream.get());
    });
    detail::throw_if_allocation_failed(code, *this, bytes, alignment, "cudaMallocFromPoolAsync",
                                       given_back);
    try {
      const detail::lock_guard lock(mutex_);
      live_.emplace(p, bytes);
    } catch (...) {
      report_error(cudaFreeAsync(p, stream.get()), "ipc_pool_resource: cudaFreeAsync");
      throw;
    }
    usage_.add(bytes);
    return p;
  }

  void do_deallocate(void* p, std::size_t bytes, std::size_t /*alignment*/,
                     stream_view stream) noexcept override {
    {
      const detail::lock_guard lock(mutex_);
      if (live_.erase(p) == 0) {
        report_problem("ipc_pool_resource: deallocate of a pointer it did not allocate, or "
                       "already freed; ignored");
        return;
      }
    }
    const detail::quiet_device_scope on{device(), "ipc_pool_resource: switching device to free"};
    report_error(cudaFreeAsync(p, stream.get()), "ipc_pool_resource: cudaFreeAsync");
    usage_.subtract(bytes);
  }

  void* do_allocate_sync(std::size_t bytes, std::size_t alignment) override {
    const device_guard on{device()};  // the legacy stream below is this device's
    void* p = do_allocate(bytes, alignment, stream_view{});
    const cudaError_t code = cudaStreamSynchronize(nullptr);
    if (code != cudaSuccess) {
      do_deallocate(p, bytes, alignment, stream_view{});
      check(code, "ipc_pool_resource: cudaStreamSynchronize after a synchronous allocation");
    }
    return p;
  }
  void do_deallocate_sync(void* p, std::size_t bytes, std::size_t alignment) noexcept override {
    do_deallocate(p, bytes, alignment, stream_view{});
  }

  bool do_is_equal(const memory_resource& other) const noexcept override { return this == &other; }
  std::string_view do_name() const noexcept override { return "ipc_pool_resource"; }
  resource_stats do_stats() const override {
    resource_stats s = usage_.leaf_stats();
    std::uint64_t reserved = 0;
    if (cudaMemPoolGetAttribute(pool_, cudaMemPoolAttrReservedMemCurrent, &reserved) == cudaSuccess) {
      s.reserved_bytes = static_cast<std::size_t>(reserved);
    } else {
      static_cast<void>(cudaGetLastError());
    }
    return s;
  }

  cudaMemPool_t pool_ = nullptr;
  ipc_pool_descriptor descriptor_;
  mutable detail::mutex mutex_;
  std::unordered_map<const void*, std::size_t> live_;  ///< what export_pointer may export
  mutable detail::atomic<bool> exported_{false};           ///< export_pool has succeeded once
  detail::usage_counter usage_;
};

class imported_pool;

/// One allocation of another process's pool, mapped here; freed (unmapped) on destruction.
class imported_pointer {
 public:
  imported_pointer() noexcept = default;
  ~imported_pointer() { reset(); }

  imported_pointer(const imported_pointer&) = delete;
  imported_pointer& operator=(const imported_pointer&) = delete;
  /// Takes `other`'s mapping; `other` holds nothing after.
  imported_pointer(imported_pointer&& other) noexcept
      : ptr_(std::exchange(other.ptr_, nullptr)),
        bytes_(std::exchange(other.bytes_, 0)),
        device_(other.device_),
        access_(std::exchange(other.access_, nullptr)),
        live_(std::exchange(other.live_, nullptr)) {}
  /// Frees the mapping held, then takes `other`'s.
  imported_pointer& operator=(imported_pointer&& other) noexcept {
    if (this != &other) {
      reset();
      ptr_ = std::exchange(other.ptr_, nullptr);
      bytes_ = std::exchange(other.bytes_, 0);
      device_ = other.device_;
      access_ = std::exchange(other.access_, nullptr);
      live_ = std::exchange(other.live_, nullptr);
    }
    return *this;
  }

  /// The memory, mapped in this process; nullptr when empty.
  [[nodiscard]] void* get() const noexcept { return ptr_; }
  /// Its size in bytes.
  [[nodiscard]] std::size_t bytes() const noexcept { return bytes_; }
  /// The device (in this process) the memory lives on.
  [[nodiscard]] int device() const noexcept { return device_; }
  /// False when empty (default-made or moved from).
  [[nodiscard]] explicit operator bool() const noexcept { return ptr_ != nullptr; }
  /// The memory as `bytes() / sizeof(T)` elements of T, for kernels.
  template <class T>
  [[nodiscard]] device_span<T> span() const noexcept {
    return {static_cast<T*>(ptr_), bytes_ / sizeof(T)};
  }

  /// Unmaps now (complete on return, after all work on every device with access); the owner
  /// is left empty.
  void reset() noexcept {
    if (ptr_ == nullptr) {
      return;
    }
    // Kernels on the other devices with access may still use the memory: wait for them too.
    for (const int d : *access_) {
      if (d != device_) {
        const detail::quiet_device_scope on{d, "imported_pointer: switching device to wait"};
        report_error(cudaDeviceSynchronize(), "imported_pointer: waiting for a device to free");
      }
    }
    const detail::quiet_device_scope on{device_, "imported_pointer: switching device to free"};
    // What cudaFree does (wait for the device, then free), spelled out: compute-sanitizer
    // (2025.3) reports an import freed by cudaFree as leaked and one freed by cudaFreeAsync as
    // freed (a probe on the H100 showed both, same program otherwise).
    report_error(cudaDeviceSynchronize(), "imported_pointer: waiting for the device to free");
    report_error(cudaFreeAsync(ptr_, cudaStreamLegacy),
                 "imported_pointer: cudaFreeAsync of an imported allocation");
    report_error(cudaStreamSynchronize(cudaStreamLegacy),
                 "imported_pointer: waiting for the free of an imported allocation");
    live_->fetch_sub(1, detail::memory_order_relaxed);
    ptr_ = nullptr;
    bytes_ = 0;
    access_ = nullptr;
    live_ = nullptr;
  }

 private:
  friend class imported_pool;
  imported_pointer(void* ptr, std::size_t bytes, int device, const std::vector<int>* access,
                   detail::atomic<long>* live) noexcept
      : ptr_(ptr), bytes_(bytes), device_(device), access_(access), live_(live) {
    live_->fetch_add(1, detail::memory_order_relaxed);
  }

  void* ptr_ = nullptr;
  std::size_t bytes_ = 0;
  int device_ = -1;
  const std::vector<int>* access_ = nullptr;  ///< the pool's devices with access
  detail::atomic<long>* live_ = nullptr;         ///< the pool's count of live imports
};

/// How to import a pool.
struct imported_pool_options {
  /// More devices of this process that will use the memory, besides the importing thread's
  /// current device (which gets access by itself).
  std::vector<int> access_from{};
};

/// Another process's pool, imported; see the contract above.
class imported_pool {
 public:
  /// Imports the pool `handle` refers to, taking the fd. Throws std::invalid_argument for a
  /// closed fd, ipc_error for a descriptor of another version.
  imported_pool(unique_fd handle, const ipc_pool_descriptor& descriptor,
                imported_pool_options options = {})
      : descriptor_(descriptor) {
    if (!handle || ::fcntl(handle.get(), F_GETFD) == -1) {
      throw std::invalid_argument("cudamem: imported_pool: the pool's descriptor (fd " +
                                  std::to_string(handle.get()) + ") is not open");
    }
    if (descriptor.version != 1) {
      throw ipc_error("imported_pool: descriptor version " + std::to_string(descriptor.version) +
                      " is not one this cudamem reads");
    }
    device_ = detail::require_device_with_uuid(descriptor.device, "imported_pool");
    // The importing thread's device (when another) and access_from: checked before the import.
    const std::vector<int> others = detail::import_access("imported_pool", device_,
                                                         options.access_from);
    access_.reserve(others.size() + 1);
    access_.push_back(device_);
    access_.insert(access_.end(), others.begin(), others.end());
    const device_guard on{device_};
    check(cudaMemPoolImportFromShareableHandle(
              &pool_, reinterpret_cast<void*>(static_cast<std::intptr_t>(handle.get())),
              cudaMemHandleTypePosixFileDescriptor, 0),
          "cudaMemPoolImportFromShareableHandle");
    handle.reset();  // the imported pool holds what it needs
    try {
      std::vector<cudaMemAccessDesc> access;
      for (const int d : others) {
        cudaMemAccessDesc desc{};
        desc.location.type = cudaMemLocationTypeDevice;
        desc.location.id = d;
        desc.flags = cudaMemAccessFlagsProtReadWrite;
        access.push_back(desc);
      }
      if (!access.empty()) {
        check(cudaMemPoolSetAccess(pool_, access.data(), access.size()), "cudaMemPoolSetAccess");
      }
    } catch (...) {
      report_error(cudaMemPoolDestroy(pool_), "imported_pool: cudaMemPoolDestroy");
      throw;
    }
  }

  ~imported_pool() {
    if (const long left = live_.load(); left != 0) {
      report_problem("imported_pool destroyed with " + std::to_string(left) +
                     " imported pointer(s) alive: destroy them first");
    }
    const detail::quiet_device_scope on{device_, "imported_pool: switching device"};
    report_error(cudaMemPoolDestroy(pool_), "imported_pool: cudaMemPoolDestroy");
  }

  imported_pool(const imported_pool&) = delete;
  imported_pool& operator=(const imported_pool&) = delete;
  imported_pool(imported_pool&&) = delete;
  imported_pool& operator=(imported_pool&&) = delete;

  /// Maps one allocation the exporter exported; see the contract above.
  [[nodiscard]] imported_pointer import(const ipc_pointer& token) {
    if (token.pool_id != descriptor_.pool_id) {
      throw ipc_error("imported_pool::import: the pointer was exported from another pool");
    }
    const device_guard on{device_};
    void* p = nullptr;
    ipc_pointer copy = token;  // CUDA takes the export data by non-const pointer
    check(cudaMemPoolImportPointer(&p, pool_, &copy.data), "cudaMemPoolImportPointer");
    return imported_pointer{p, static_cast<std::size_t>(token.bytes), device_, &access_, &live_};
  }

  /// The device (in this process) the pool's memory lives on.
  [[nodiscard]] int device() const noexcept { return device_; }
  /// The devices that may use the memory: device() first, then the importing thread's device
  /// (when another) and access_from's, each once.
  [[nodiscard]] const std::vector<int>& access_devices() const noexcept { return access_; }
  /// The descriptor it was imported with.
  [[nodiscard]] const ipc_pool_descriptor& descriptor() const noexcept { return descriptor_; }
  /// Imported pointers alive now.
  [[nodiscard]] long live_imports() const noexcept { return live_.load(); }

 private:
  ipc_pool_descriptor descriptor_;
  int device_ = -1;
  std::vector<int> access_;  ///< device_ first; what imported_pointer waits for before a free
  cudaMemPool_t pool_ = nullptr;
  detail::atomic<long> live_{0};
};

}  // namespace cudamem

#endif  // __linux__
