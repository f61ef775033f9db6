// cudamem/vm_resource.hpp — device memory from CUDA's virtual memory management: an upstream
// whose free physical memory can always be put behind a fresh address range, wherever the
// frees left it. Meant to sit under a pool_resource (that is what vm_pool_resource is).
//
//   #include <cudamem/vm_resource.hpp>
//
//   cudamem::vm_resource vm{0};                       // device 0; reserves address space once
//   cudamem::pool_resource pool{vm};                  // the pool calls vm rarely: chunks only
//   void* a = vm.allocate(64 << 20);                  // or directly: maps physical memory
//   vm.deallocate(a, 64 << 20);                       // stays mapped, free, reusable
//   cudamem::vm_resource_stats st = vm.vm_stats();    // virtual, mapped, in use, waste
//   vm.release();                                     // give wholly free memory back
//
//   cudamem::vm_resource shared{0, {.peers = {1}}};   // device 1 may read and write it too
//   cudamem::vm_resource ipc{0, {.exportable = true}}; // blocks other processes may map
//                                                     // (vm_ipc.hpp: export_block)
//
// Why. Memory behind fixed address ranges cannot turn two free 64 MiB holes into one 128 MiB
// block ("out of memory while memory is free"). The driver's cudaMalloc can, by mapping physical
// pages into a fresh range, at 50-170 µs a call. This resource does the same, rarely, and only
// for what a request lacks:
// - It reserves a virtual range four times the device's memory, once (22 µs for 158 GiB on an
//   H100), and more ranges if it ever runs out.
// - Physical memory is created in handles of `handle_bytes` (64 MiB by default, smaller near
//   the end of the device), at least `growth_bytes` (256 MiB) per growth while the device has
//   it, mapped at the *frontier* (the lowest never-used address of the active range), with one
//   cuMemSetAccess per batch.
// - A request of a handle or more gets whole handles (it starts at a handle's start and ends at
//   a handle's end), so that once freed all its physical memory can be recycled; smaller ones
//   are placed at granule precision (2 MiB on current GPUs) and best fit packs them into
//   handles already shared. A freed range stays mapped and free: the next request that fits
//   takes it at no cost to the driver. Neighbouring free ranges merge.
// - When no free range fits, handles that lie wholly in free memory are *recycled*: mapped
//   again at the frontier, next to each other and to the free range already there, so they
//   become one contiguous free range (a *compaction*). Only as many as the request lacks are
//   moved, from the smallest free runs first (a large free run serves later requests where it
//   is, for nothing). Only then is new physical memory created for what is still missing; when
//   the device has none, the request fails with `out_of_memory`. (Recycling first keeps the
//   footprint at what is in use.)
// - What a move costs, measured (bench_vmm_driver, H200): cuMemMap ~0.5-1 µs, and
//   cuMemSetAccess ~23 µs *per handle* in the range, whatever the handle's size up to 64 MiB
//   (31 µs at 256 MiB, 51 µs at 1 GiB): giving access is paid per handle, not per byte. Hence
//   64 MiB handles (half the calls of 32 MiB for the same bytes; larger ones could not be
//   recycled out of 64 MiB holes), and moving only what is missing.
// - The old address of a recycled handle is retired and stays mapped, as a *stale alias*,
//   until release() or destruction: so no cuMemUnmap (17-31 µs each, and unsafe while a kernel
//   may read) is on the allocation path. When the active reservation is used up, another is
//   reserved; only past `reservations_before_sweep` of them are the stale aliases unmapped
//   (after a host wait) so their address space can be used again.
//
// Contract (memory_resource.hpp's, plus)
// - Construction: `vm_resource(device, options)` throws `no_device_error` with no device,
//   `std::out_of_range` for a device or peer that does not exist, `vm_not_supported_error` on a
//   device without VMM (CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED = 0),
//   `std::invalid_argument` for bad options (a peer that cannot reach the device, the device
//   itself as a peer, handle_bytes 0, reservations_before_sweep 0). The second constructor takes any mapping layer (tests
//   pass `detail::simulated_vm_mapping`: no GPU needed). Each vm_resource maps on its own
//   device; `peers` get read-write access to everything it maps.
// - Blocks are granule multiples, whole handles from `handle_bytes` up (a request is rounded up;
//   `vm_stats().partial_granule_bytes` is that waste), aligned to the granule, or to any larger
//   power-of-two alignment asked for.
// - Stream order. A free on stream s records an event on s (one event per stream, owned by
//   the mapping layer, so streams may be destroyed after freeing). A range freed on s and
//   taken by a request on t makes t wait for that event (cudaStreamWaitEvent, no host wait).
//   Recycling a handle freed on a stream waits *on the host* for that stream's last free
//   (cudaEventSynchronize): the cost of moving memory that work may still touch. The
//   synchronous forms wait on the host; a synchronous free promises the memory is idle, so a
//   pool over this resource (which frees synchronously, after its own stream bookkeeping) never
//   makes it wait.
// - Physical memory is never unmapped while work may touch it: release(), the destructor and
//   the address-space sweep wait on the host for every recorded free first.
// - `release()` unmaps stale aliases and gives every wholly free handle back to the driver;
//   returns the physical bytes given back. Memory in use, and handles shared with it, stay.
// - Failure throws `out_of_memory` (recycling and growth both tried; nothing changes); a
//   request larger than the device or than `physical_limit` is refused before anything is
//   tried. Bad frees (a pointer not from here, a double free, a size that differs from the
//   allocation's) go to the error handler; a size mismatch still frees the block.
// - Export (`exportable`): physical memory is created shareable as POSIX file descriptors, and
//   `block_handles(p)` lists the handles under the block at `p` (what vm_ipc.hpp's export_block
//   turns into descriptors for another process). A block's handles stay where they are while
//   it is allocated (only wholly free handles are recycled). `block_handles` throws
//   `std::invalid_argument` for a resource not made exportable and for a pointer that is not
//   the start of a block it gave out and has not freed.
// - Thread-safe: one mutex (a pool above calls it for chunks only).
#pragma once

#include <cudamem/detail/vm/driver_mapping.hpp>
#include <cudamem/detail/vm/mapping.hpp>
#include <cudamem/device.hpp>
#include <cudamem/error.hpp>
#include <cudamem/memory_resource.hpp>
#include <cudamem/out_of_memory.hpp>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <iterator>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace cudamem {

/// How to build a vm_resource.
struct vm_resource_options {
  /// Size of each physical handle: the unit of growth and of recycling (rounded up to the
  /// granularity). Larger handles cost fewer driver calls per byte (giving access costs ~23 µs
  /// per handle); smaller ones strand less free memory next to live blocks, and a free hole
  /// smaller than a handle cannot be recycled. Near the end of the device smaller ones are made.
  std::size_t handle_bytes = std::size_t{64} << 20;
  /// Least physical memory a growth creates (when the device has it): fewer, larger batches of
  /// driver calls. What is not needed yet stays mapped and free for the next request.
  std::size_t growth_bytes = std::size_t{256} << 20;
  /// Size of each virtual reservation; 0: four times the device's memory.
  std::size_t reserve_bytes = 0;
  /// Reservations it may hold before running out of address space makes it unmap its stale
  /// aliases (a host wait, then one cuMemUnmap per alias, ~20 µs each, on the allocation path)
  /// rather than reserve another range (one cuMemAddressReserve, ~80 µs). The default, 8
  /// reservations of four times the device, is 4.4 TiB of address space for a 139 GiB device:
  /// far below the 128 TiB a process has, and enough that the bench's traces never sweep.
  std::size_t reservations_before_sweep = 8;
  /// Most physical bytes it may hold; nullopt: as much as the device gives.
  std::optional<std::size_t> physical_limit;
  /// Other devices that get read-write access to its memory.
  std::vector<int> peers;
  /// Create physical memory shareable as POSIX file descriptors, so that blocks can be
  /// exported to other processes (vm_ipc.hpp). A device that cannot throws `cuda_error`
  /// (cudaErrorNotSupported) from the constructor.
  bool exportable = false;
};

/// The physical handles under one block, in address order: they tile
/// [address - offset, address - offset + sum of their bytes). See vm_resource::block_handles.
struct vm_block_handles {
  std::uintptr_t address = 0;  ///< the block's start
  std::size_t bytes = 0;       ///< the block's size as placed (granule multiple)
  std::size_t requested = 0;   ///< what its caller asked for
  std::size_t offset = 0;      ///< from the first handle's start to the block's start
  std::vector<std::pair<detail::vm_handle, std::size_t>> handles;  ///< handle, its bytes
};

/// What a vm_resource holds, in the terms of virtual memory.
struct vm_resource_stats {
  std::size_t granularity = 0;             ///< mapping granularity (2 MiB on current GPUs)
  std::size_t handle_bytes = 0;            ///< size of a physical handle
  std::size_t reserved_virtual_bytes = 0;  ///< address space reserved
  std::size_t mapped_bytes = 0;            ///< physical memory held
  std::size_t used_bytes = 0;              ///< in ranges handed out (granule multiples)
  std::size_t requested_bytes = 0;         ///< what the callers of those ranges asked for
  std::size_t partial_granule_bytes = 0;   ///< used - requested: waste from partly used
                                           ///< granules (and handles, for whole-handle ranges)
  std::size_t peak_used_bytes = 0;
  std::size_t free_bytes = 0;              ///< mapped, not handed out
  std::size_t largest_free_range = 0;
  std::size_t recyclable_bytes = 0;        ///< free bytes in handles with nothing handed out
  std::size_t stranded_bytes = 0;          ///< free bytes in handles shared with live ranges
  std::size_t handles = 0;                 ///< physical handles held
  std::size_t stale_aliases = 0;           ///< retired mappings awaiting release()
  std::size_t compactions = 0;             ///< times free handles were remapped together
  std::size_t handles_created = 0;         ///< cuMemCreate calls that succeeded
  std::size_t maps = 0;                    ///< cuMemMap calls
  std::size_t access_calls = 0;            ///< cuMemSetAccess calls
  std::size_t unmaps = 0;                  ///< cuMemUnmap calls
};

/// Device memory over a virtual address range; see the contract above.
class vm_resource final : public memory_resource {
 public:
  /// Memory on `device` (the current device by default).
  explicit vm_resource(int device = -1, vm_resource_options options = {},
                       std::source_location where = std::source_location::current())
      : vm_resource(make_driver_layer(device, options, where), std::move(options)) {}

  /// Memory from any mapping layer (tests: detail::simulated_vm_mapping).
  explicit vm_resource(std::unique_ptr<detail::vm_mapping_layer> layer,
                       vm_resource_options options = {})
      : memory_resource(memory_kind::device, layer ? layer->device() : -1),
        layer_(std::move(layer)),
        options_(std::move(options)) {
    if (!layer_) {
      throw std::invalid_argument("cudamem::vm_resource: null mapping layer");
    }
    if (options_.handle_bytes == 0) {
      throw std::invalid_argument("cudamem::vm_resource: handle_bytes must not be 0");
    }
    if (options_.reservations_before_sweep == 0) {
      throw std::invalid_argument(
          "cudamem::vm_resource: reservations_before_sweep must not be 0");
    }
    granule_ = layer_->granularity();
    handle_ = round_up(options_.handle_bytes, granule_);
    reservation_bytes_ = options_.reserve_bytes != 0
                             ? round_up(options_.reserve_bytes, granule_)
                             : round_up(4 * layer_->device_total(), granule_);
  }

  ~vm_resource() override {
    const std::lock_guard lock(mutex_);
    if (!live_.empty()) {
      report_problem("vm_resource destroyed with " + std::to_string(live_.size()) +
                     " range(s) (" + format_bytes(used_bytes_) +
                     ") still allocated; their memory is released anyway");
    }
    layer_->wait_for_all_frees();
    for (const mapping& m : stale_) {
      layer_->unmap(m.address, m.bytes);
    }
    for (const auto& [address, h] : handles_) {
      layer_->unmap(address, h.bytes);
      layer_->release(h.handle);
    }
    for (const reservation& r : reservations_) {
      layer_->free_reservation(r.base, r.bytes);
    }
  }

  vm_resource(const vm_resource&) = delete;
  vm_resource& operator=(const vm_resource&) = delete;

  /// Gives back every wholly free handle and every stale alias, after waiting on the host for
  /// all recorded frees; returns the physical bytes given back. See the contract.
  std::size_t release() {
    const std::lock_guard lock(mutex_);
    wait_and_unmap_stale();
    std::vector<recycled_handle> found = take_recyclable(recyclable_runs(false));
    std::size_t released = 0;
    for (const recycled_handle& h : found) {
      layer_->unmap(h.old_address, h.bytes);
      ++unmaps_;
      layer_->release(h.handle);
      released += h.bytes;
    }
    mapped_bytes_ -= released;
    device_full_ = false;
    drop_empty_reservations();
    return released;
  }

  /// What it holds, in virtual-memory terms (walks the free ranges: not for hot loops).
  [[nodiscard]] vm_resource_stats vm_stats() const {
    const std::lock_guard lock(mutex_);
    vm_resource_stats s;
    s.granularity = granule_;
    s.handle_bytes = handle_;
    for (const reservation& r : reservations_) {
      s.reserved_virtual_bytes += r.bytes;
    }
    s.mapped_bytes = mapped_bytes_;
    s.used_bytes = used_bytes_;
    s.requested_bytes = requested_bytes_;
    s.partial_granule_bytes = used_bytes_ - requested_bytes_;
    s.peak_used_bytes = peak_used_bytes_;
    s.free_bytes = mapped_bytes_ - used_bytes_;
    s.largest_free_range = free_by_size_.empty() ? 0 : free_by_size_.rbegin()->first;
    for_each_free_run([&](std::uintptr_t begin, std::uintptr_t end) {
      s.recyclable_bytes += handle_bytes_inside(begin, end);
    });
    s.stranded_bytes = s.free_bytes - s.recyclable_bytes;
    s.handles = handles_.size();
    s.stale_aliases = stale_.size();
    s.compactions = compactions_;
    s.handles_created = handles_created_;
    s.maps = maps_;
    s.access_calls = access_calls_;
    s.unmaps = unmaps_;
    return s;
  }

  [[nodiscard]] std::size_t granularity() const noexcept { return granule_; }
  [[nodiscard]] const vm_resource_options& options() const noexcept { return options_; }

  /// The handles under the live block starting at `p`, for export (vm_ipc.hpp); see the
  /// contract. Throws std::invalid_argument unless the resource is exportable and `p` starts
  /// a block it gave out and has not freed.
  [[nodiscard]] vm_block_handles block_handles(const void* p) const {
    const std::lock_guard lock(mutex_);
    if (!options_.exportable) {
      throw std::invalid_argument(
          "cudamem::vm_resource::block_handles: the resource was not made exportable "
          "(vm_resource_options::exportable)");
    }
    const auto address = reinterpret_cast<std::uintptr_t>(p);
    const auto live = live_.find(address);
    if (live == live_.end()) {
      throw std::invalid_argument(
          "cudamem::vm_resource::block_handles: not the start of a live block of this resource "
          "(a pointer it never gave, or one already freed)");
    }
    vm_block_handles out;
    out.address = address;
    out.bytes = live->second.bytes;
    out.requested = live->second.requested;
    auto h = handles_.upper_bound(address);  // handles tile the mapped memory: one holds p
    --h;
    out.offset = address - h->first;
    std::uintptr_t next = h->first;
    for (; h != handles_.end() && h->first < address + out.bytes; ++h) {
      if (h->first != next) {
        throw std::logic_error("cudamem::vm_resource: a live block over non-adjacent handles");
      }
      out.handles.emplace_back(h->second.handle, h->second.bytes);
      next = h->first + h->second.bytes;
    }
    return out;
  }

  /// The mapping layer (tests inspect the simulated one).
  [[nodiscard]] detail::vm_mapping_layer& mapping_layer() const noexcept { return *layer_; }

 private:
  /// A free range: mapped, not handed out. `stream` is where its last free was recorded;
  /// `complete` means no work may still touch it (a synchronous free, or the host waited).
  struct free_range {
    std::size_t bytes;
    cudaStream_t stream;
    bool complete;
  };
  struct live_range {
    std::size_t bytes;      ///< granule multiple
    std::size_t requested;  ///< what the caller asked for
  };
  struct mapped_handle {
    detail::vm_handle handle;
    std::size_t bytes;
  };
  struct mapping {
    std::uintptr_t address;
    std::size_t bytes;
  };
  struct reservation {
    std::uintptr_t base;
    std::size_t bytes;
  };
  struct recycled_handle {
    detail::vm_handle handle;
    std::size_t bytes;
    std::uintptr_t old_address;  ///< 0: freshly created, never mapped
  };

  static std::unique_ptr<detail::vm_mapping_layer> make_driver_layer(
      int device, const vm_resource_options& options, const std::source_location& where) {
    const int id = device >= 0 ? device : current_device();
    return std::make_unique<detail::driver_vm_mapping>(id, options.peers, options.exportable,
                                                       where);
  }

  [[nodiscard]] static constexpr std::size_t round_up(std::size_t n, std::size_t unit) noexcept {
    return (n + unit - 1) / unit * unit;
  }

  // --- the memory_resource interface ------------------------------------------------------

  void* do_allocate(std::size_t bytes, std::size_t alignment, stream_view stream) override {
    return allocate_range(bytes, alignment, stream.get(), false);
  }
  void* do_allocate_sync(std::size_t bytes, std::size_t alignment) override {
    return allocate_range(bytes, alignment, nullptr, true);
  }
  void do_deallocate(void* p, std::size_t bytes, std::size_t /*alignment*/,
                     stream_view stream) noexcept override {
    free_range_at(p, bytes, stream.get(), false);
  }
  void do_deallocate_sync(void* p, std::size_t bytes, std::size_t /*alignment*/) noexcept override {
    free_range_at(p, bytes, nullptr, true);
  }
  bool do_is_equal(const memory_resource& other) const noexcept override { return this == &other; }
  std::string_view do_name() const noexcept override { return "vm_resource"; }
  resource_stats do_stats() const override {
    const std::lock_guard lock(mutex_);
    resource_stats s;
    s.reserved_bytes = mapped_bytes_;
    s.used_bytes = used_bytes_;
    s.peak_used_bytes = peak_used_bytes_;
    s.free_blocks = free_by_address_.size();
    s.largest_free_block = free_by_size_.empty() ? 0 : free_by_size_.rbegin()->first;
    if (const auto capacity = layer_->simulated_capacity()) {
      s.capacity = *capacity;
    }
    if (options_.physical_limit) {
      s.budget = *options_.physical_limit;
    }
    return s;
  }

  // --- allocation -------------------------------------------------------------------------

  void* allocate_range(std::size_t bytes, std::size_t alignment, cudaStream_t stream, bool sync) {
    const std::size_t limit = options_.physical_limit.value_or(layer_->device_total());
    if (bytes > limit || alignment > limit) {
      throw_out_of_memory(*this, bytes, alignment,
                          "vm_resource: larger than it can ever map (" + format_bytes(limit) + ")");
    }
    const std::size_t size = round_up(bytes, granule_);
    const std::size_t needed = alignment <= granule_ ? size : size + alignment - granule_;
    std::unique_lock lock(mutex_);
    if (void* p = take_fit(size, needed, bytes, alignment, stream, sync)) {
      return p;
    }
    std::string cause;
    if (make_room(needed, whole_handles(size, alignment), cause)) {
      if (void* p = take_fit(size, needed, bytes, alignment, stream, sync)) {
        return p;
      }
    }
    lock.unlock();  // the report reads stats(), which locks
    throw_out_of_memory(*this, bytes, alignment, "vm_resource: " + cause);
  }

  /// Where a block of `size` goes inside the free range [begin, end), or nullopt. A block of
  /// whole handles (`whole`) starts at a handle's start and ends at a handle's end, so that
  /// when it is freed every handle under it is wholly free and can be recycled; the rest of
  /// its last handle is waste while it lives (at most one handle). Smaller blocks go at granule
  /// precision and share handles, which best fit packs together.
  struct placement {
    std::uintptr_t start;
    std::uintptr_t end;
  };
  [[nodiscard]] std::optional<placement> place(std::uintptr_t begin, std::uintptr_t end,
                                               std::size_t size, std::size_t alignment,
                                               bool whole) const {
    if (!whole) {
      const std::uintptr_t start = round_up(begin, std::max(alignment, granule_));
      if (start + size > end) {
        return std::nullopt;
      }
      return placement{start, start + size};
    }
    const auto first = handles_.lower_bound(begin);  // handles tile every free range
    if (first == handles_.end() || first->first + size > end) {
      return std::nullopt;
    }
    auto last = handles_.upper_bound(first->first + size - 1);
    --last;
    const std::uintptr_t stop = last->first + last->second.bytes;
    if (stop > end) {
      return std::nullopt;
    }
    return placement{first->first, stop};
  }

  /// Whether a block of `size` at `alignment` is placed in whole handles (see place()).
  [[nodiscard]] bool whole_handles(std::size_t size, std::size_t alignment) const noexcept {
    return size >= handle_ && alignment <= granule_;
  }

  /// The best-fitting free range of at least `needed` bytes where a block of `size` can be
  /// placed, carved and made ready for `stream` (null with sync: for everyone); nullptr when
  /// none fits.
  void* take_fit(std::size_t size, std::size_t needed, std::size_t requested, std::size_t alignment,
                 cudaStream_t stream, bool sync) {
    const bool whole = whole_handles(size, alignment);
    auto fit = free_by_size_.lower_bound({needed, 0});
    std::optional<placement> spot;
    for (; fit != free_by_size_.end(); ++fit) {
      spot = place(fit->second, fit->second + fit->first, size, alignment, whole);
      if (spot) {
        break;
      }
    }
    if (!spot) {
      return nullptr;
    }
    const auto node = free_by_address_.find(fit->second);
    const std::uintptr_t address = node->first;
    free_range range = node->second;
    if (!range.complete) {
      if (sync) {
        layer_->wait_for_free(range.stream);
        range.complete = true;  // the host waited: the remnants are idle too
      } else if (range.stream != stream) {
        layer_->order_after_free(stream, range.stream);
      }
    }
    const std::size_t bytes = spot->end - spot->start;
    live_.emplace(spot->start, live_range{bytes, requested});  // may throw: nothing changed yet
    free_by_size_.erase(fit);
    free_by_address_.erase(node);
    if (spot->start > address) {
      insert_free_node(address, {spot->start - address, range.stream, range.complete});
    }
    if (spot->end < address + range.bytes) {
      insert_free_node(spot->end, {address + range.bytes - spot->end, range.stream, range.complete});
    }
    used_bytes_ += bytes;
    requested_bytes_ += requested;
    peak_used_bytes_ = std::max(peak_used_bytes_, used_bytes_);
    return reinterpret_cast<void*>(spot->start);
  }

  void free_range_at(void* p, std::size_t bytes, cudaStream_t stream, bool sync) noexcept {
    try {
      const std::lock_guard lock(mutex_);
      const auto address = reinterpret_cast<std::uintptr_t>(p);
      const auto it = live_.find(address);
      if (it == live_.end()) {
        report_problem("vm_resource: deallocate of a pointer it did not allocate, or already freed");
        return;
      }
      const live_range range = it->second;
      if (round_up(bytes, granule_) != round_up(range.requested, granule_)) {
        report_problem("vm_resource: deallocate with " + std::to_string(bytes) +
                       " bytes of a range allocated with " + std::to_string(range.requested) +
                       "; freeing the allocated range");
      }
      if (!sync) {
        layer_->record_free(stream, address, range.bytes);  // throws: the range stays live
      }
      live_.erase(it);
      used_bytes_ -= range.bytes;
      requested_bytes_ -= range.requested;
      insert_free(address, {range.bytes, stream, sync});
    } catch (const cuda_error& e) {
      report_error(e.code(), std::string(e.what()) + " (the range is kept: it may still be in use)");
    } catch (const std::exception& e) {
      report_problem(std::string("vm_resource: ") + e.what());
    }
  }

  // --- the free-range index ---------------------------------------------------------------

  /// Ranges merge when both were freed on the same stream or one of them is complete (the
  /// merged range then waits for the other's stream: never less than needed).
  static bool mergeable(const free_range& a, const free_range& b) noexcept {
    return a.complete || b.complete || a.stream == b.stream;
  }
  static free_range merged(const free_range& a, const free_range& b) noexcept {
    const free_range& tag = a.complete ? b : a;
    return {a.bytes + b.bytes, tag.stream, a.complete && b.complete};
  }

  void insert_free_node(std::uintptr_t address, free_range range) {
    free_by_address_.emplace(address, range);
    free_by_size_.emplace(range.bytes, address);
  }
  void erase_free_node(std::map<std::uintptr_t, free_range>::iterator it) noexcept {
    free_by_size_.erase({it->second.bytes, it->first});
    free_by_address_.erase(it);
  }

  /// Inserts a free range, merging it with mergeable address neighbours.
  void insert_free(std::uintptr_t address, free_range range) {
    const auto next = free_by_address_.find(address + range.bytes);
    if (next != free_by_address_.end() && mergeable(range, next->second)) {
      range = merged(range, next->second);
      erase_free_node(next);
    }
    const auto after = free_by_address_.lower_bound(address);
    if (after != free_by_address_.begin()) {
      const auto prev = std::prev(after);
      if (prev->first + prev->second.bytes == address && mergeable(prev->second, range)) {
        address = prev->first;
        range = merged(prev->second, range);
        erase_free_node(prev);
      }
    }
    insert_free_node(address, range);
  }

  /// Calls f(begin, end) for every maximal run of address-adjacent free ranges.
  template <class F>
  void for_each_free_run(F&& f) const {
    auto it = free_by_address_.begin();
    while (it != free_by_address_.end()) {
      const std::uintptr_t begin = it->first;
      std::uintptr_t end = begin + it->second.bytes;
      for (++it; it != free_by_address_.end() && it->first == end; ++it) {
        end += it->second.bytes;
      }
      f(begin, end);
    }
  }

  /// Calls f(address, handle) for every handle mapped wholly inside [begin, end).
  template <class F>
  void for_each_handle_inside(std::uintptr_t begin, std::uintptr_t end, F&& f) const {
    for (auto h = handles_.lower_bound(begin);
         h != handles_.end() && h->first + h->second.bytes <= end; ++h) {
      f(h->first, h->second);
    }
  }

  /// The free range that ends at the frontier (new mappings extend it), or free_by_address_.end().
  [[nodiscard]] std::map<std::uintptr_t, free_range>::iterator frontier_tail() {
    if (frontier_ == 0) {
      return free_by_address_.end();
    }
    const auto after = free_by_address_.lower_bound(frontier_);
    if (after == free_by_address_.begin()) {
      return free_by_address_.end();
    }
    const auto last = std::prev(after);
    return last->first + last->second.bytes == frontier_ ? last : free_by_address_.end();
  }

  /// A maximal run of free memory and the bytes of the handles lying wholly inside it: what
  /// a compaction may recycle from it.
  struct recyclable_run {
    std::uintptr_t begin;
    std::uintptr_t end;
    std::size_t bytes;
  };

  /// Every free run holding a whole handle, in address order (one walk of the free ranges).
  /// With `keep_tail`, the free range at the frontier is left out: it is already where a
  /// compaction puts things.
  [[nodiscard]] std::vector<recyclable_run> recyclable_runs(bool keep_tail) {
    const auto tail = keep_tail ? frontier_tail() : free_by_address_.end();
    const std::uintptr_t tail_start = tail != free_by_address_.end() ? tail->first : 0;
    std::vector<recyclable_run> runs;
    for_each_free_run([&](std::uintptr_t begin, std::uintptr_t end) {
      if (tail_start != 0 && end == frontier_) {
        end = tail_start;
      }
      if (const std::size_t bytes = handle_bytes_inside(begin, end); bytes != 0) {
        runs.push_back({begin, end, bytes});
      }
    });
    return runs;
  }

  /// Bytes of the handles mapped wholly inside [begin, end).
  [[nodiscard]] std::size_t handle_bytes_inside(std::uintptr_t begin, std::uintptr_t end) const {
    std::size_t bytes = 0;
    for_each_handle_inside(begin, end,
                           [&](std::uintptr_t, const mapped_handle& h) { bytes += h.bytes; });
    return bytes;
  }

  [[nodiscard]] static std::size_t total_bytes(const std::vector<recyclable_run>& runs) noexcept {
    std::size_t total = 0;
    for (const recyclable_run& r : runs) {
      total += r.bytes;
    }
    return total;
  }

  /// Free ranges holding whole handles, smallest first, until their handles add up to
  /// `wanted` bytes (fewer if there are not enough); the frontier's tail is left out. Ranges
  /// smaller than the smallest handle ever made hold none and are not looked at.
  [[nodiscard]] std::vector<recyclable_run> smallest_recyclable(std::size_t wanted) {
    const auto tail = frontier_tail();
    const std::uintptr_t tail_start = tail != free_by_address_.end() ? tail->first : 0;
    std::vector<recyclable_run> runs;
    std::size_t total = 0;
    for (auto it = free_by_size_.lower_bound({smallest_handle_, 0});
         it != free_by_size_.end() && total < wanted; ++it) {
      const std::uintptr_t begin = it->second;
      if (begin == tail_start) {
        continue;
      }
      const std::uintptr_t end = begin + it->first;
      if (const std::size_t bytes = handle_bytes_inside(begin, end); bytes != 0) {
        runs.push_back({begin, end, bytes});
        total += bytes;
      }
    }
    return runs;
  }

  /// Takes handles of `runs` (from recyclable_runs or smallest_recyclable) out of the index, at least `wanted` bytes
  /// of them (all by default), cutting their bytes out of the free ranges (the remnants keep
  /// their tags). Handles come from the smallest free runs first: a large free run serves later
  /// requests where it is, at no cost, while moving a handle costs the driver ~25-40 us (a
  /// cuMemMap, and the handle's share of cuMemSetAccess, which is paid per handle, not per
  /// byte: bench_vmm_driver). The host waits first for every stream whose frees cover them:
  /// after this, their memory is idle.
  std::vector<recycled_handle> take_recyclable(std::vector<recyclable_run> runs,
                                               std::size_t wanted = ~std::size_t{0}) {
    if (wanted < total_bytes(runs)) {
      std::stable_sort(runs.begin(), runs.end(), [](const recyclable_run& a, const recyclable_run& b) {
        return a.end - a.begin < b.end - b.begin;
      });
    }
    std::vector<recycled_handle> out;
    std::size_t taken = 0;
    for (const recyclable_run& r : runs) {
      if (taken >= wanted) {
        break;
      }
      for_each_handle_inside(r.begin, r.end, [&](std::uintptr_t address, const mapped_handle& h) {
        if (taken < wanted) {
          out.push_back({h.handle, h.bytes, address});
          taken += h.bytes;
        }
      });
    }
    std::vector<cudaStream_t> pending;
    for (const recycled_handle& t : out) {
      // Cut [old_address, +bytes) out of the free ranges it overlaps.
      auto it = free_by_address_.upper_bound(t.old_address);
      if (it != free_by_address_.begin()) {
        --it;
      }
      while (it != free_by_address_.end() && it->first < t.old_address + t.bytes) {
        const std::uintptr_t b0 = it->first;
        const std::uintptr_t b1 = b0 + it->second.bytes;
        const free_range tag = it->second;
        if (b1 <= t.old_address) {
          ++it;
          continue;
        }
        if (!tag.complete &&
            std::find(pending.begin(), pending.end(), tag.stream) == pending.end()) {
          pending.push_back(tag.stream);
        }
        const auto next = std::next(it);
        erase_free_node(it);
        if (b0 < t.old_address) {
          insert_free_node(b0, {t.old_address - b0, tag.stream, tag.complete});
        }
        if (b1 > t.old_address + t.bytes) {
          insert_free_node(t.old_address + t.bytes,
                           {b1 - t.old_address - t.bytes, tag.stream, tag.complete});
        }
        it = next;
      }
      handles_.erase(t.old_address);
    }
    for (cudaStream_t s : pending) {
      layer_->wait_for_free(s);  // recycled memory must be idle wherever it is mapped next
    }
    return out;
  }

  // --- growth and compaction --------------------------------------------------------------

  /// Makes a free range of at least `needed` bytes at the frontier: recycles every wholly free
  /// handle there, then creates what is still missing. False (with `cause`, nothing changed)
  /// when even that is not enough.
  bool make_room(std::size_t needed, bool whole, std::string& cause) {
    // What the free range at the frontier already offers (whole-handle blocks start at a
    // handle's start).
    const auto usable_at_frontier = [&] {
      const auto tail = frontier_tail();
      if (tail == free_by_address_.end()) {
        return std::size_t{0};
      }
      const auto first = whole ? handles_.lower_bound(tail->first) : handles_.end();
      const std::uintptr_t start = !whole ? tail->first
                                          : (first == handles_.end() ? frontier_ : first->first);
      return static_cast<std::size_t>(frontier_ - start);
    };
    std::size_t have = usable_at_frontier();
    // Room for the worst case at the frontier: what is missing, recycled with up to a handle
    // to spare, or a whole growth created.
    const std::size_t room = needed + round_up(options_.growth_bytes, handle_) + 2 * handle_;
    if (frontier_ == 0 || frontier_end_ - frontier_ < room) {
      drop_empty_reservations();
      if (!stale_.empty() && reservations_.size() >= options_.reservations_before_sweep) {
        // Address space is cheap, but not endless: past the limit, the stale aliases go
        // (a host wait and one cuMemUnmap each). Below it, a fresh reservation is cheaper.
        wait_and_unmap_stale();
        drop_empty_reservations();
      }
      if (frontier_ == 0 || frontier_end_ - frontier_ < room) {
        add_reservation(std::max(reservation_bytes_, round_up(room, granule_)));
      }
      have = usable_at_frontier();
    }
    const std::size_t missing = round_up(needed > have ? needed - have : 1, granule_);
    // What recycling can give: the smallest free ranges' handles, just enough (a short walk);
    // only if they do not add up, every free run, exactly (a walk of the whole index).
    std::vector<recyclable_run> runs = smallest_recyclable(missing);
    std::size_t recyclable = total_bytes(runs);
    if (recyclable < missing) {
      runs = recyclable_runs(true);
      recyclable = total_bytes(runs);
    }
    const std::size_t required = missing > recyclable ? missing - recyclable : 0;
    // 1. New physical memory for what recycling cannot cover, in handles. A growth creates at
    //    least `growth_bytes` while the device gives it (the calls and the one cuMemSetAccess
    //    are paid per growth, not per request); near the end of the device smaller handles
    //    are made, down to one granule. Once the device has said "full", one probe per
    //    shortfall: no ladder of failing calls until memory comes back.
    std::vector<recycled_handle> all;
    std::size_t created = 0;
    const std::size_t limit = options_.physical_limit.value_or(~std::size_t{0});
    try {
      // Whole handles: what is created beyond the request stays free for the next one.
      const std::size_t wanted =
          required == 0 || device_full_
              ? required
              : std::max(round_up(required, handle_), round_up(options_.growth_bytes, handle_));
      std::size_t piece = device_full_ ? std::min(handle_, round_up(required, granule_)) : handle_;
      while (created < wanted) {
        const std::size_t held = mapped_bytes_ + created;
        if (held + piece > limit) {
          piece = limit > held ? (limit - held) / granule_ * granule_ : 0;
          if (piece == 0) {
            cause = "the physical limit (" + format_bytes(limit) + ") is reached";
            break;
          }
        }
        all.reserve(all.size() + 1);  // so the push below cannot throw and leak the handle
        if (const auto h = layer_->create(piece)) {
          all.push_back({*h, piece, 0});
          smallest_handle_ = std::min(smallest_handle_, piece);
          created += piece;
          ++handles_created_;
        } else if (created >= required) {
          break;  // what was needed is there; the extra is not
        } else if (device_full_ || piece == granule_) {
          device_full_ = true;
          cause = "the device has no physical memory left";
          break;
        } else {
          piece = std::max(granule_, piece / 2 / granule_ * granule_);
        }
      }
    } catch (...) {
      release_fresh(all);
      throw;
    }
    if (created < required) {
      release_fresh(all);
      cause += " (" + format_bytes(recyclable) + " recyclable, " + format_bytes(have) +
               " free at the frontier, " + format_bytes(mapped_bytes_ - used_bytes_) +
               " free in all; recycling and growth both tried)";
      return false;
    }
    device_full_ = device_full_ && created == 0;
    // 2. Recycle: only when growth alone is not enough, and only what is missing.
    if (missing > created) {
      std::vector<recycled_handle> recycled;
      try {
        recycled = take_recyclable(std::move(runs), missing - created);
        ++compactions_;
        stale_.reserve(stale_.size() + recycled.size());
        all.reserve(all.size() + recycled.size());
      } catch (...) {
        undo_mapping(recycled, 0);  // puts recycled handles back where they were
        release_fresh(all);
        throw;
      }
      for (const recycled_handle& h : recycled) {
        stale_.push_back({h.old_address, h.bytes});
        all.push_back(h);
      }
    }
    // 3. Map everything at the frontier; set access once.
    std::size_t mapped = 0;
    try {
      for (const recycled_handle& h : all) {
        layer_->map(frontier_ + mapped, h.bytes, h.handle);
        ++maps_;
        mapped += h.bytes;
      }
      layer_->set_access(frontier_, mapped);
      ++access_calls_;
    } catch (...) {
      undo_mapping(all, mapped);
      throw;
    }
    std::size_t offset = 0;
    for (const recycled_handle& h : all) {
      handles_.emplace(frontier_ + offset, mapped_handle{h.handle, h.bytes});
      offset += h.bytes;
    }
    mapped_bytes_ += created;
    const std::uintptr_t start = frontier_;
    frontier_ += mapped;
    insert_free(start, {mapped, nullptr, true});
    return true;
  }

  void release_fresh(const std::vector<recycled_handle>& fresh) noexcept {
    for (const recycled_handle& h : fresh) {
      if (h.old_address == 0) {
        layer_->release(h.handle);
      }
    }
  }

  /// A map or set_access failed: the new mappings go, fresh handles go back, recycled ones
  /// return to their old addresses (still mapped there) as free, idle memory.
  void undo_mapping(const std::vector<recycled_handle>& all, std::size_t mapped) noexcept {
    std::size_t offset = 0;
    for (const recycled_handle& h : all) {
      if (offset >= mapped) {
        break;
      }
      layer_->unmap(frontier_ + offset, h.bytes);  // never used: nothing can be in flight
      ++unmaps_;
      offset += h.bytes;
    }
    release_fresh(all);
    for (const recycled_handle& h : all) {
      if (h.old_address == 0) {
        continue;
      }
      std::erase_if(stale_, [&](const mapping& m) { return m.address == h.old_address; });
      try {
        handles_.emplace(h.old_address, mapped_handle{h.handle, h.bytes});
        insert_free(h.old_address, {h.bytes, nullptr, true});
      } catch (...) {  // out of host memory while undoing: the handle stays mapped, unused
      }
    }
  }

  /// Waits for every recorded free, then unmaps every stale alias.
  void wait_and_unmap_stale() noexcept {
    layer_->wait_for_all_frees();
    for (auto& [address, range] : free_by_address_) {
      range.complete = true;
    }
    for (const mapping& m : stale_) {
      layer_->unmap(m.address, m.bytes);
      ++unmaps_;
    }
    stale_.clear();
  }

  void add_reservation(std::size_t bytes) {
    drop_empty_reservations();
    reservations_.reserve(reservations_.size() + 1);  // so the push cannot throw and leak
    const std::uintptr_t base = layer_->reserve(bytes);
    reservations_.push_back({base, bytes});
    frontier_ = base;
    frontier_end_ = base + bytes;
  }

  /// Frees reservations with nothing mapped in them; an empty active one starts over from its
  /// base.
  void drop_empty_reservations() noexcept {
    const auto holds_mappings = [this](const reservation& r) {
      const auto h = handles_.lower_bound(r.base);
      if (h != handles_.end() && h->first < r.base + r.bytes) {
        return true;
      }
      return std::any_of(stale_.begin(), stale_.end(), [&r](const mapping& m) {
        return m.address >= r.base && m.address < r.base + r.bytes;
      });
    };
    for (auto it = reservations_.begin(); it != reservations_.end();) {
      const bool active = frontier_end_ == it->base + it->bytes;
      if (holds_mappings(*it)) {
        ++it;
      } else if (active) {
        frontier_ = it->base;
        ++it;
      } else {
        layer_->free_reservation(it->base, it->bytes);
        it = reservations_.erase(it);
      }
    }
  }

  std::unique_ptr<detail::vm_mapping_layer> layer_;
  vm_resource_options options_;
  std::size_t granule_ = 0;
  std::size_t handle_ = 0;
  std::size_t reservation_bytes_ = 0;

  mutable std::mutex mutex_;
  std::map<std::uintptr_t, free_range> free_by_address_;
  std::set<std::pair<std::size_t, std::uintptr_t>> free_by_size_;
  std::unordered_map<std::uintptr_t, live_range> live_;
  std::map<std::uintptr_t, mapped_handle> handles_;  ///< current address -> handle
  std::vector<mapping> stale_;                       ///< retired aliases to unmap later
  std::vector<reservation> reservations_;
  std::uintptr_t frontier_ = 0;      ///< lowest never-mapped address of the active reservation
  std::uintptr_t frontier_end_ = 0;  ///< its end
  std::size_t mapped_bytes_ = 0;
  std::size_t used_bytes_ = 0;
  std::size_t requested_bytes_ = 0;
  std::size_t peak_used_bytes_ = 0;
  std::size_t compactions_ = 0;
  std::size_t handles_created_ = 0;
  std::size_t maps_ = 0;
  std::size_t access_calls_ = 0;
  std::size_t unmaps_ = 0;
  bool device_full_ = false;  ///< the last growth found the device full
  std::size_t smallest_handle_ = ~std::size_t{0};  ///< smallest handle ever created
};

}  // namespace cudamem
