// cudamem/detail/vm/driver_mapping.hpp — the real mapping layer under vm_resource: CUDA's
// virtual memory management, through the driver table in detail/cuda/driver.hpp (no libcuda link).
//
//   cudamem::detail::driver_vm_mapping layer{0, {1}};   // device 0, readable by device 1 too
//   std::uintptr_t va = layer.reserve(1ull << 30, layer.granularity());
//   auto h = layer.create(2ull << 20);                  // nullopt: the device is full
//   layer.map(va, 2ull << 20, *h);
//   layer.set_access(va, 2ull << 20);                   // now kernels may touch it
//
// The contract is detail/vm/mapping.hpp's. Specific to the driver:
// - Construction throws `no_device_error` with no device, `std::out_of_range` for a device or
//   peer id that does not exist, `vm_not_supported_error` on a device without virtual memory
//   management (CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED = 0), and
//   `std::invalid_argument` for a peer that cannot access the device.
// - Physical memory is pinned device memory on the layer's device (CU_MEM_ALLOCATION_TYPE_PINNED);
//   access is granted read-write to the device and every peer, in one cuMemSetAccess per call.
//   With `exportable`, every handle is created shareable as a POSIX file descriptor
//   (requestedHandleTypes), which cuMemExportToShareableHandle needs (vm_ipc.hpp).
// - Costs measured on an H100 (driver 580): cuMemAddressReserve of 158 GiB 22 µs, cuMemCreate
//   10-18 µs, cuMemMap ~1 µs, cuMemSetAccess 25-47 µs, cuMemUnmap 17-31 µs, cuMemRelease
//   11-250 µs. vm_resource is designed so that none of them is on the per-operation path of
//   a pool over it.
// - Ordering uses one event per stream (cudaEventDisableTiming), re-recorded at every free on
//   that stream, as other stream-ordered pools do: waiting for it waits for that free and for
//   anything submitted to the stream before the latest free (never less than needed). Streams
//   come as vm_resource's tags (stream_tag.hpp): a thread's per-thread stream has its own.
// - Except on the legacy default stream (0, cudaStreamLegacy), where a free records nothing:
//   the event is recorded when something needs it (another stream takes the range, or the host
//   waits before recycling), and covers every free on it so far, and whatever the stream was
//   given since (more than needed, never less). That stream lives as long as the device's
//   context, so a record owed on it can always be made later, while a stream of the user's
//   might be gone by then. It is the stream a PyTorch or CuPy program uses unless it asks for
//   another, and there frees come hundreds of times per training step: an eager record cost
//   ~1 µs of the host thread that launches the kernels, each time (0.3 ms a training step).
//   Records owed are made before a stream is captured into a graph
//   (cudamem::prepare_for_graph_capture, which cudamem's PyTorch allocator calls): no event
//   can be recorded on the legacy stream while another is captured.
#pragma once

#include <cudamem/detail/cuda/driver.hpp>
#include <cudamem/detail/cuda/quiet_device_scope.hpp>
#include <cudamem/detail/stream_tag.hpp>
#include <cudamem/detail/sync/mutex.hpp>
#include <cudamem/detail/vm/mapping.hpp>
#include <cudamem/device.hpp>
#include <cudamem/error.hpp>
#include <cudamem/stream.hpp>

#include <cuda.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace cudamem {

/// The device cannot back a virtual-memory pool (no VMM support: some older GPUs, some vGPU
/// and WSL set-ups). Use pool_resource over device memory there instead.
class vm_not_supported_error : public cuda_error {
 public:
  /// `device` has no VMM; what() says to use pool_resource over device_resource there.
  explicit vm_not_supported_error(int device,
                                  std::source_location where = std::source_location::current())
      : cuda_error(cudaErrorNotSupported,
                   "device " + std::to_string(device) +
                       " does not support CUDA virtual memory management "
                       "(CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED is 0): use "
                       "pool_resource over device_resource instead",
                   where),
        device_(device) {}
  /// The device without VMM support.
  [[nodiscard]] int device() const noexcept { return device_; }

 private:
  int device_;
};

namespace detail {

/// The real mapping layer; see the contracts above and in detail/vm/mapping.hpp.
class driver_vm_mapping final : public vm_mapping_layer, private stream_listener {
 public:
  explicit driver_vm_mapping(int device, std::vector<int> peers = {},
                             std::source_location where = std::source_location::current())
      : driver_vm_mapping(device, std::move(peers), false, where) {}

  /// The layer of a vm_resource on `device` (-1: the current one) with options `o` (a
  /// vm_resource_options: its peers and exportable).
  template <class Options>
  static std::unique_ptr<vm_mapping_layer> for_resource(int device, const Options& o,
                                                        std::source_location where) {
    return std::make_unique<driver_vm_mapping>(device >= 0 ? device : current_device(), o.peers,
                                               o.exportable, where);
  }

  /// `exportable`: physical memory is created with CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
  /// requested, so that its handles can be exported to other processes (vm_ipc.hpp); a device
  /// that cannot throws `cuda_error` (cudaErrorNotSupported).
  driver_vm_mapping(int device, std::vector<int> peers, bool exportable,
                    std::source_location where = std::source_location::current())
      : device_(device), peers_(std::move(peers)) {
    validate_device(device, where);
    const driver_api& cu = driver(where);
    const device_guard on{device};  // the primary context must exist for the cuMem* calls
    check(cudaFree(nullptr), "creating the primary context");
    check_driver(cu.device_get(&cu_device_, device), "cuDeviceGet", where);
    int supported = 0;
    check_driver(cu.device_get_attribute(
                     &supported, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED,
                     cu_device_),
                 "cuDeviceGetAttribute(VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED)", where);
    if (supported == 0) {
      throw vm_not_supported_error(device, where);
    }
    for (const int peer : peers_) {
      if (peer == device) {
        throw std::invalid_argument("cudamem::vm_resource: device " +
                                    std::to_string(peer) + " is the pool's own device, not a peer");
      }
      check_peer(peer, where);
    }
    properties_.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    properties_.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    properties_.location.id = cu_device_;
    properties_.requestedHandleTypes = CU_MEM_HANDLE_TYPE_NONE;
    if (exportable) {
      int posix_fd = 0;
      check_driver(cu.device_get_attribute(
                       &posix_fd, CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED,
                       cu_device_),
                   "cuDeviceGetAttribute(HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED)", where);
      if (posix_fd == 0) {
        throw cuda_error(cudaErrorNotSupported,
                         "vm_resource: device " + std::to_string(device) +
                             " cannot export memory as POSIX file descriptors (exportable)",
                         where);
      }
      properties_.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    }
    check_driver(cu.mem_get_allocation_granularity(&granularity_, &properties_,
                                                   CU_MEM_ALLOC_GRANULARITY_RECOMMENDED),
                 "cuMemGetAllocationGranularity", where);
    device_total_ = device_memory(device).total;
    access_.push_back(read_write_on(device));
    for (const int peer : peers_) {
      access_.push_back(read_write_on(peer));
    }
    stream_listener_registry::instance().add(this);  // last: nothing after it can throw
  }

  ~driver_vm_mapping() override {
    stream_listener_registry::instance().remove(this);
    for (const stream_event& e : events_) {
      report_error(cudaEventDestroy(e.event), "vm_resource: cudaEventDestroy");
    }
  }

  [[nodiscard]] int device() const noexcept override { return device_; }
  [[nodiscard]] std::size_t granularity() const noexcept override { return granularity_; }
  [[nodiscard]] std::size_t device_total() const noexcept override { return device_total_; }
  [[nodiscard]] std::optional<std::size_t> device_free() const noexcept override {
    std::size_t free = 0;
    std::size_t total = 0;
    const quiet_device_scope on{device_, "vm_resource: switching device to read free memory"};
    if (!on.ok() || cudaMemGetInfo(&free, &total) != cudaSuccess) {
      static_cast<void>(cudaGetLastError());
      return std::nullopt;
    }
    return free;
  }
  [[nodiscard]] memory_domain domain() const noexcept override { return {device_, nullptr}; }

  [[nodiscard]] std::uintptr_t reserve(std::size_t bytes, std::size_t alignment) override {
    CUdeviceptr base = 0;
    check_driver(driver().mem_address_reserve(&base, bytes, alignment, 0, 0),
                 "cuMemAddressReserve of " + std::to_string(bytes) + " bytes");
    return static_cast<std::uintptr_t>(base);
  }

  void free_reservation(std::uintptr_t base, std::size_t bytes) noexcept override {
    report_driver_error(driver().mem_address_free(static_cast<CUdeviceptr>(base), bytes),
                        "vm_resource: cuMemAddressFree");
  }

  [[nodiscard]] std::optional<vm_handle> create(std::size_t bytes) override {
    CUmemGenericAllocationHandle handle = 0;
    const CUresult result = driver().mem_create(&handle, bytes, &properties_, 0);
    if (result == CUDA_ERROR_OUT_OF_MEMORY) {
      return std::nullopt;
    }
    check_driver(result, "cuMemCreate of " + std::to_string(bytes) + " bytes");
    return static_cast<vm_handle>(handle);
  }

  void release(vm_handle handle) noexcept override {
    report_driver_error(driver().mem_release(static_cast<CUmemGenericAllocationHandle>(handle)),
                        "vm_resource: cuMemRelease");
  }

  void map(std::uintptr_t va, std::size_t bytes, vm_handle handle) override {
    check_driver(driver().mem_map(static_cast<CUdeviceptr>(va), bytes, 0,
                                  static_cast<CUmemGenericAllocationHandle>(handle), 0),
                 "cuMemMap");
  }

  void unmap(std::uintptr_t va, std::size_t bytes) noexcept override {
    report_driver_error(driver().mem_unmap(static_cast<CUdeviceptr>(va), bytes),
                        "vm_resource: cuMemUnmap");
  }

  void set_access(std::uintptr_t va, std::size_t bytes) override {
    const detail::lock_guard lock(access_mutex_);  // add_peer may grow the list meanwhile
    check_driver(driver().mem_set_access(static_cast<CUdeviceptr>(va), bytes, access_.data(),
                                         access_.size()),
                 "cuMemSetAccess");
  }

  void add_peer(int peer) override {
    const detail::lock_guard lock(access_mutex_);
    if (peer == device_ || std::find(peers_.begin(), peers_.end(), peer) != peers_.end()) {
      return;
    }
    check_peer(peer, std::source_location::current());
    access_.reserve(access_.size() + 1);
    peers_.reserve(peers_.size() + 1);
    access_.push_back(read_write_on(peer));
    peers_.push_back(peer);
  }

  void set_peer_access(std::uintptr_t va, std::size_t bytes, int peer) override {
    if (peer == device_) {
      return;
    }
    const CUmemAccessDesc desc = read_write_on(peer);
    check_driver(driver().mem_set_access(static_cast<CUdeviceptr>(va), bytes, &desc, 1),
                 "cuMemSetAccess (peer " + std::to_string(peer) + ")");
  }

  void record_free(cudaStream_t stream, std::uintptr_t /*va*/, std::size_t /*bytes*/) override {
    const detail::lock_guard lock(events_mutex_);
    stream_event& e = event_for(stream);
    if (records_lazily(stream)) {
      e.owed = true;  // recorded when needed (see above)
      return;
    }
    record(e);
  }

  void order_after_free(cudaStream_t user, cudaStream_t freed_on) override {
    const cudaEvent_t ev = settled_event(freed_on);
    const device_guard on{device_};
    check(cudaStreamWaitEvent(cuda_stream(user), ev, 0), "vm_resource: cudaStreamWaitEvent");
  }

  void wait_for_free(cudaStream_t freed_on) override {
    check(cudaEventSynchronize(settled_event(freed_on)), "vm_resource: cudaEventSynchronize");
  }

  void wait_for_all_frees() noexcept override {
    std::vector<cudaEvent_t> all;
    try {
      const detail::lock_guard lock(events_mutex_);
      all.reserve(events_.size());
      for (stream_event& e : events_) {
        settle(e);
        all.push_back(e.event);
      }
    } catch (const cuda_error& e) {
      report_error(e.code(), e.what());
      report_error(cudaDeviceSynchronize(), "vm_resource: cudaDeviceSynchronize");  // no event
      return;
    } catch (...) {
      report_error(cudaDeviceSynchronize(), "vm_resource: cudaDeviceSynchronize");
      return;
    }
    for (const cudaEvent_t ev : all) {  // without the lock: another thread may settle meanwhile
      report_error(cudaEventSynchronize(ev), "vm_resource: cudaEventSynchronize");
    }
  }

 private:
  /// Throws unless `peer` is a device with a path to this one.
  void check_peer(int peer, const std::source_location& where) const {
    validate_device(peer, where);
    int can_access = 0;
    check(cudaDeviceCanAccessPeer(&can_access, peer, device_), "cudaDeviceCanAccessPeer");
    if (can_access == 0) {
      throw std::invalid_argument("cudamem::vm_resource: device " + std::to_string(peer) +
                                  " cannot access device " + std::to_string(device_) +
                                  " (no peer access between them)");
    }
  }

  static CUmemAccessDesc read_write_on(int device) {
    CUmemAccessDesc desc{};
    desc.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    desc.location.id = device;  // runtime and driver ordinals agree (both honour VISIBLE_DEVICES)
    desc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    return desc;
  }

  /// A stream's event, and whether a record is owed on it (frees no record covers yet).
  struct stream_event {
    cudaStream_t stream;
    cudaEvent_t event;
    bool owed = false;
  };

  /// The legacy default stream: it outlives every use of the layer (see above). A per-thread
  /// stream (handle 0 too, built with `--default-stream per-thread`) comes as its thread's tag,
  /// which a record made later on another thread could not name: never lazy.
  static bool records_lazily(cudaStream_t s) noexcept {
    return s == nullptr || s == cudaStreamLegacy;
  }

  /// This stream's event, created on first use. A flat list: a pool sees a handful of streams.
  /// Called with events_mutex_ held.
  stream_event& event_for(cudaStream_t stream) {
    for (stream_event& e : events_) {
      if (e.stream == stream) {
        return e;
      }
    }
    const device_guard on{device_};
    events_.reserve(events_.size() + 1);  // so the push below cannot throw and leak the event
    cudaEvent_t ev = nullptr;
    check(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming), "vm_resource: cudaEventCreate");
    events_.push_back({stream, ev, false});
    return events_.back();
  }

  /// Records the stream's event now. Called with events_mutex_ held.
  void record(stream_event& e) {
    const cudaStream_t stream = cuda_stream(e.stream);  // lazy records are never a thread's tag
    if (is_default_stream(stream)) {
      // The legacy and per-thread streams are the *current* device's: make ours current.
      const device_guard on{device_};
      check(cudaEventRecord(e.event, stream), "vm_resource: cudaEventRecord");
    } else {
      check(cudaEventRecord(e.event, stream), "vm_resource: cudaEventRecord");
    }
  }

  /// Makes the record owed on `e`, if one is. Called with events_mutex_ held.
  void settle(stream_event& e) {
    if (e.owed) {
      record(e);
      e.owed = false;
    }
  }

  /// The event that covers every free on `stream` so far.
  cudaEvent_t settled_event(cudaStream_t stream) {
    const detail::lock_guard lock(events_mutex_);
    stream_event& e = event_for(stream);
    settle(e);
    return e.event;
  }

  /// A stream is about to be captured (prepare_for_graph_capture): every record owed now.
  void before_graph_capture() noexcept override {
    const detail::lock_guard lock(events_mutex_);
    for (stream_event& e : events_) {
      try {
        settle(e);
      } catch (const cuda_error& error) {
        report_error(error.code(), error.what());
      }
    }
  }
  /// Only default streams are recorded lazily, and they are never destroyed.
  void on_stream_destroy(cudaStream_t /*handle*/) noexcept override {}

  int device_;
  std::vector<int> peers_;
  CUdevice cu_device_ = 0;
  CUmemAllocationProp properties_{};
  std::size_t granularity_ = 0;
  std::size_t device_total_ = 0;
  detail::mutex access_mutex_;               ///< guards peers_ and access_ once constructed
  std::vector<CUmemAccessDesc> access_;
  detail::mutex events_mutex_;  ///< guards events_: before_graph_capture comes from any thread
  std::vector<stream_event> events_;
};

}  // namespace detail
}  // namespace cudamem
