// cudamem/vm_pool_resource.hpp — a stream-ordered pool whose address space is virtual: free
// memory is always usable, wherever the frees left it, at a pool's speed.
//
//   #include <cudamem/vm_pool_resource.hpp>
//
//   cudamem::vm_pool_resource pool{0};                   // device 0
//   cudamem::stream s;
//   void* a = pool.allocate(64 << 20, 256, s);           // pool-fast once memory is mapped
//   pool.deallocate(a, 64 << 20, 256, s);
//   cudamem::vm_pool_stats st = pool.vm_stats();         // virtual, mapped, in use, stranded
//   pool.release();                                      // give wholly free memory back
//
//   cudamem::vm_pool_resource shared{0, {.peers = {1}}}; // device 1 may read and write it too
//
// Why. A pool that holds fixed address ranges cannot turn two free 64 MiB holes into one
// 128 MiB block: "out of memory while memory is free". cudaMalloc can (the driver maps
// physical pages into a fresh address range), but costs 50-170 µs per call. This pool does
// what the driver does, in bulk and rarely:
// - It reserves a virtual range several times the device's memory, once (22 µs for 158 GiB).
// - Physical memory is created in handles of `chunk_bytes` (32 MiB by default; smaller near
//   the end of the device) and mapped at the *frontier*, the lowest never-used address of the
//   range; one cuMemSetAccess covers each batch (it is the expensive call).
// - Sub-allocation is an ordinary free-block index over the mapped virtual range: best fit,
//   split, coalesce. Free memory keeps its mapping, so reuse costs nothing from the driver.
// - When no mapped free block fits, the pool first creates more physical memory. When the
//   device is full, it *compacts*: every handle that lies wholly inside free memory is mapped
//   again at the frontier, next to the others, so all recyclable free memory becomes one
//   contiguous block. Its old address is retired (never handed out again) and stays mapped as
//   a stale alias until the next release(): so no unmap ever runs while a kernel may still read
//   through the old address, and compaction costs one cuMemMap (~1 µs) per handle plus one
//   cuMemSetAccess, with no host wait. Swiss cheese (64 MiB holes, 128 MiB requests) compacts
//   once, then every request is pool-fast.
// - What cannot be recycled is memory in a handle that also holds a live block: `vm_stats()`
//   reports it as `stranded_bytes`. Smaller chunks strand less but cost more calls.
//
// Contract (memory_resource.hpp's, plus)
// - Construction: `vm_pool_resource(device, options)` throws `no_device_error` with no device,
//   `std::out_of_range` for a device or peer that does not exist, `vm_not_supported_error` on
//   a device without virtual memory management, `std::invalid_argument` for bad options (a
//   peer that cannot reach the device, chunk_bytes 0). The second constructor takes any
//   mapping layer (tests pass `detail::simulated_vm_mapping`: no GPU needed).
// - Stream order, as memory_resource.hpp says. Each free records an event on its stream (one
//   event per stream, owned by the pool, so streams may be destroyed after freeing). A block
//   freed on stream A and given to stream B makes B wait for that event (cudaStreamWaitEvent:
//   no host wait). Compaction makes the requesting stream wait for every stream whose frees it
//   recycles. The synchronous forms wait on the host instead. Free blocks of different streams
//   are not merged unless one of them is already complete (a synchronous free).
// - Memory is never unmapped while work may touch it: `release()` and the destructor first wait
//   (on the host) for every free the pool has recorded, then unmap. That wait is release()'s
//   cost; allocate and deallocate never unmap.
// - `release()` unmaps stale aliases and gives every handle that is wholly free back to the
//   driver; returns the physical bytes given back. Memory in use is untouched.
// - Failure throws `out_of_memory` after growth and compaction have both been tried; its report
//   counts the pool's mapped bytes as held and names stranded bytes in the cause.
// - Bad frees (a pointer the pool did not give out, a double free, a size that differs from the
//   allocation's) go to the error handler; a size mismatch still frees the block it names.
// - Thread-safe: one mutex. Destruction with blocks still allocated reports a leak, then gives
//   everything back anyway.
// - Limits: address space retired by compaction is reused only once its reservation holds
//   nothing; a fresh reservation is made when the current one is used up (release() lets
//   reservations go). A stream handle reused by a new stream after destruction looks like the
//   old one (as in every pool that keys on streams).
#pragma once

#include <cudamem/detail/vm_driver_mapping.hpp>
#include <cudamem/detail/vm_mapping.hpp>
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

/// How to build a vm_pool_resource.
struct vm_pool_options {
  /// Size of each physical handle: the unit of growth and of recycling (rounded up to the
  /// granularity). Near the end of the device, smaller handles are made down to one granule.
  std::size_t chunk_bytes = std::size_t{32} << 20;
  /// Size of each virtual reservation; 0: four times the device's memory.
  std::size_t reserve_bytes = 0;
  /// Most physical bytes the pool may hold; nullopt: as much as the device gives.
  std::optional<std::size_t> physical_limit;
  /// Other devices that get read-write access to the pool's memory.
  std::vector<int> peers;
};

/// What a vm_pool_resource holds, in the terms of virtual memory.
struct vm_pool_stats {
  std::size_t granularity = 0;             ///< mapping granularity (2 MiB on current GPUs)
  std::size_t chunk_bytes = 0;             ///< size of a physical handle
  std::size_t reserved_virtual_bytes = 0;  ///< address space reserved
  std::size_t mapped_bytes = 0;            ///< physical memory held (created and mapped)
  std::size_t used_bytes = 0;              ///< handed out and not freed
  std::size_t peak_used_bytes = 0;
  std::size_t free_bytes = 0;              ///< mapped, not in use
  std::size_t largest_free_block = 0;      ///< largest mapped free block
  std::size_t recyclable_bytes = 0;        ///< free bytes in handles with no live block
  std::size_t stranded_bytes = 0;          ///< free bytes in handles that also hold live blocks
  std::size_t partial_granule_bytes = 0;   ///< free bytes in granules that hold live bytes
  std::size_t handles = 0;                 ///< physical handles held
  std::size_t stale_aliases = 0;           ///< retired mappings awaiting release()
  std::size_t compactions = 0;             ///< times free memory was remapped together
  std::size_t growths = 0;                 ///< times physical memory was created
};

/// A pool over a virtual address range; see the contract above.
class vm_pool_resource final : public memory_resource {
 public:
  /// A pool on `device` (the current device by default).
  explicit vm_pool_resource(int device = -1, vm_pool_options options = {},
                            std::source_location where = std::source_location::current())
      : vm_pool_resource(make_driver_layer(device, options, where), options) {}

  /// A pool over any mapping layer (tests: detail::simulated_vm_mapping).
  explicit vm_pool_resource(std::unique_ptr<detail::vm_mapping_layer> layer,
                            vm_pool_options options = {})
      : memory_resource(memory_kind::device, layer ? layer->device() : -1),
        layer_(std::move(layer)),
        options_(std::move(options)) {
    if (!layer_) {
      throw std::invalid_argument("cudamem::vm_pool_resource: null mapping layer");
    }
    granule_ = layer_->granularity();
    if (options_.chunk_bytes == 0) {
      throw std::invalid_argument("cudamem::vm_pool_resource: chunk_bytes must not be 0");
    }
    chunk_ = round_up(options_.chunk_bytes, granule_);
    reservation_bytes_ = options_.reserve_bytes != 0 ? round_up(options_.reserve_bytes, granule_)
                                                     : round_up(4 * layer_->device_total(), granule_);
  }

  ~vm_pool_resource() override {
    const std::lock_guard lock(mutex_);
    if (!live_.empty()) {
      report_problem("vm_pool_resource destroyed with " + std::to_string(live_.size()) +
                     " block(s) (" + std::to_string(used_bytes_) +
                     " bytes) still allocated; their memory is released anyway");
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

  vm_pool_resource(const vm_pool_resource&) = delete;
  vm_pool_resource& operator=(const vm_pool_resource&) = delete;

  /// Gives back every wholly free handle and every stale alias, after waiting on the host for
  /// all recorded frees; returns the physical bytes given back. See the contract.
  std::size_t release() {
    const std::lock_guard lock(mutex_);
    layer_->wait_for_all_frees();
    for (const mapping& m : stale_) {
      layer_->unmap(m.address, m.bytes);
    }
    stale_.clear();
    recyclable found = take_recyclable(0);
    std::size_t released = 0;
    for (const moved_handle& m : found.handles) {
      layer_->unmap(m.old_address, m.bytes);
      layer_->release(m.handle);
      released += m.bytes;
    }
    mapped_bytes_ -= released;
    device_full_ = false;
    drop_empty_reservations();
    return released;
  }

  /// What the pool holds, in virtual-memory terms (walks the free blocks: not for hot loops).
  [[nodiscard]] vm_pool_stats vm_stats() const {
    const std::lock_guard lock(mutex_);
    vm_pool_stats s;
    s.granularity = granule_;
    s.chunk_bytes = chunk_;
    for (const reservation& r : reservations_) {
      s.reserved_virtual_bytes += r.bytes;
    }
    s.mapped_bytes = mapped_bytes_;
    s.used_bytes = used_bytes_;
    s.peak_used_bytes = peak_used_bytes_;
    s.free_bytes = mapped_bytes_ - used_bytes_;
    s.largest_free_block = free_by_size_.empty() ? 0 : free_by_size_.rbegin()->first;
    s.handles = handles_.size();
    s.stale_aliases = stale_.size();
    s.compactions = compactions_;
    s.growths = growths_;
    for_each_free_region([&](std::uintptr_t begin, std::uintptr_t end) {
      for (auto h = handles_.lower_bound(begin);
           h != handles_.end() && h->first + h->second.bytes <= end; ++h) {
        s.recyclable_bytes += h->second.bytes;
      }
      // The granules at the region's two ends are shared with live bytes unless the region
      // starts or ends on a granule boundary.
      const std::uintptr_t first_full = round_up(begin, granule_);
      const std::uintptr_t last_full = end / granule_ * granule_;
      s.partial_granule_bytes +=
          first_full >= last_full ? end - begin : (first_full - begin) + (end - last_full);
    });
    s.stranded_bytes = s.free_bytes - s.recyclable_bytes;
    return s;
  }

  /// The mapping layer (tests inspect the simulated one).
  [[nodiscard]] detail::vm_mapping_layer& mapping_layer() const noexcept { return *layer_; }

 private:
  static constexpr std::size_t block_unit = default_alignment;  ///< every block is a multiple

  struct free_block {
    std::size_t bytes;
    cudaStream_t stream;  ///< the stream its last free was recorded on
    bool complete;        ///< freed synchronously: no pending work, any stream may use it
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
  struct moved_handle {
    detail::vm_handle handle;
    std::size_t bytes;
    std::uintptr_t old_address;
  };
  struct recyclable {
    std::vector<moved_handle> handles;
    std::vector<std::pair<cudaStream_t, bool>> streams;  ///< (stream, complete) of their frees
  };

  static std::unique_ptr<detail::vm_mapping_layer> make_driver_layer(
      int device, const vm_pool_options& options, const std::source_location& where) {
    const int id = device >= 0 ? device : current_device();
    return std::make_unique<detail::driver_vm_mapping>(id, options.peers, where);
  }

  [[nodiscard]] static constexpr std::size_t round_up(std::size_t n, std::size_t unit) noexcept {
    return (n + unit - 1) / unit * unit;
  }

  // --- the memory_resource interface ------------------------------------------------------

  void* do_allocate(std::size_t bytes, std::size_t alignment, stream_view stream) override {
    return allocate_for(bytes, alignment, stream.get(), false);
  }
  void* do_allocate_sync(std::size_t bytes, std::size_t alignment) override {
    return allocate_for(bytes, alignment, nullptr, true);
  }
  void do_deallocate(void* p, std::size_t bytes, std::size_t /*alignment*/,
                     stream_view stream) noexcept override {
    free_block_of(p, bytes, stream.get(), false);
  }
  void do_deallocate_sync(void* p, std::size_t bytes, std::size_t /*alignment*/) noexcept override {
    free_block_of(p, bytes, nullptr, true);
  }
  std::string_view do_name() const noexcept override { return "vm_pool_resource"; }
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

  void* allocate_for(std::size_t bytes, std::size_t alignment, cudaStream_t stream, bool sync) {
    const std::size_t limit = options_.physical_limit.value_or(layer_->device_total());
    if (bytes > limit || alignment > limit) {
      throw_out_of_memory(*this, bytes, alignment, "larger than the pool can ever map");
    }
    const std::size_t size = round_up(bytes, block_unit);
    std::unique_lock lock(mutex_);
    if (void* p = take_fit(size, alignment, stream, sync)) {
      return p;
    }
    const std::size_t needed = alignment <= block_unit ? size : size + alignment - block_unit;
    make_room(needed, stream, sync);
    if (void* p = take_fit(size, alignment, stream, sync)) {
      return p;
    }
    const std::size_t free = mapped_bytes_ - used_bytes_;
    lock.unlock();
    const vm_pool_stats s = vm_stats();
    throw_out_of_memory(*this, bytes, alignment,
                        "vm_pool_resource: growth and compaction could not find " +
                            format_bytes(needed) + " (" + format_bytes(free) + " free, " +
                            format_bytes(s.stranded_bytes) +
                            " of it stranded in handles that also hold live blocks)");
  }

  /// Best fit among the mapped free blocks; nullptr when none is large enough.
  void* take_fit(std::size_t size, std::size_t alignment, cudaStream_t stream, bool sync) {
    const std::size_t needed = alignment <= block_unit ? size : size + alignment - block_unit;
    const auto fit = free_by_size_.lower_bound({needed, 0});
    if (fit == free_by_size_.end()) {
      return nullptr;
    }
    const std::uintptr_t address = fit->second;
    const auto node = free_by_address_.find(address);
    const free_block block = node->second;
    // Order first: if it throws, nothing has changed.
    if (!block.complete) {
      if (sync) {
        layer_->wait_for_free(block.stream);
      } else if (block.stream != stream) {
        layer_->order_after_free(stream, block.stream);
      }
    }
    const std::uintptr_t start = round_up(address, alignment);
    live_.emplace(start, size);
    free_by_size_.erase(fit);
    free_by_address_.erase(node);
    if (start > address) {
      insert_free_node(address, {start - address, block.stream, block.complete});
    }
    if (start + size < address + block.bytes) {
      insert_free_node(start + size, {address + block.bytes - start - size, block.stream,
                                      block.complete});
    }
    used_bytes_ += size;
    peak_used_bytes_ = std::max(peak_used_bytes_, used_bytes_);
    return reinterpret_cast<void*>(start);
  }

  void free_block_of(void* p, std::size_t bytes, cudaStream_t stream, bool sync) noexcept {
    try {
      const std::lock_guard lock(mutex_);
      const auto it = live_.find(reinterpret_cast<std::uintptr_t>(p));
      if (it == live_.end()) {
        report_problem("vm_pool_resource: deallocate of a pointer this pool did not allocate, "
                       "or already freed");
        return;
      }
      const std::size_t size = it->second;
      if (round_up(bytes, block_unit) != size) {
        report_problem("vm_pool_resource: deallocate with " + std::to_string(bytes) +
                       " bytes of a block allocated with " + std::to_string(size) +
                       " (rounded); freeing the allocated size");
      }
      if (!sync) {
        layer_->record_free(stream);
      }
      live_.erase(it);
      used_bytes_ -= size;
      insert_free(reinterpret_cast<std::uintptr_t>(p), {size, stream, sync});
    } catch (const cuda_error& e) {
      report_error(e.code(), e.what());
    } catch (const std::exception& e) {
      report_problem(e.what());
    }
  }

  // --- the free-block index ---------------------------------------------------------------

  /// Blocks merge when both have the same stream or one of them is complete.
  static bool mergeable(const free_block& a, const free_block& b) noexcept {
    return a.complete || b.complete || a.stream == b.stream;
  }
  static free_block merged(const free_block& a, const free_block& b) noexcept {
    const free_block& tag = a.complete ? b : a;
    return {a.bytes + b.bytes, tag.stream, a.complete && b.complete};
  }

  void insert_free_node(std::uintptr_t address, free_block block) {
    free_by_address_.emplace(address, block);
    free_by_size_.emplace(block.bytes, address);
  }
  void erase_free_node(std::map<std::uintptr_t, free_block>::iterator it) noexcept {
    free_by_size_.erase({it->second.bytes, it->first});
    free_by_address_.erase(it);
  }

  /// Inserts a free block, merging it with mergeable address neighbours.
  void insert_free(std::uintptr_t address, free_block block) {
    const auto next = free_by_address_.find(address + block.bytes);
    if (next != free_by_address_.end() && mergeable(block, next->second)) {
      block = merged(block, next->second);
      erase_free_node(next);
    }
    const auto after = free_by_address_.lower_bound(address);
    if (after != free_by_address_.begin()) {
      const auto prev = std::prev(after);
      if (prev->first + prev->second.bytes == address && mergeable(prev->second, block)) {
        address = prev->first;
        block = merged(prev->second, block);
        erase_free_node(prev);
      }
    }
    insert_free_node(address, block);
  }

  /// Calls f(begin, end) for every maximal run of address-adjacent free blocks.
  template <class F>
  void for_each_free_region(F&& f) const {
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

  /// Takes out of the free index every handle that lies wholly inside free memory (except
  /// the range [keep, frontier), which is already where compaction puts things) and returns
  /// them with the streams of the frees that covered them. Pieces of free blocks outside
  /// those handles stay free.
  recyclable take_recyclable(std::uintptr_t keep) {
    recyclable out;
    std::vector<mapping> taken;
    for_each_free_region([&](std::uintptr_t begin, std::uintptr_t end) {
      if (keep != 0 && end == frontier_) {
        end = std::min(end, keep);
      }
      for (auto h = handles_.lower_bound(begin);
           h != handles_.end() && h->first + h->second.bytes <= end; ++h) {
        out.handles.push_back({h->second.handle, h->second.bytes, h->first});
        taken.push_back({h->first, h->second.bytes});
      }
    });
    if (taken.empty()) {
      return out;
    }
    // Cut the taken ranges out of the free blocks; the remnants keep their tags.
    std::vector<std::pair<std::uintptr_t, free_block>> remnants;
    for (const mapping& t : taken) {
      auto it = free_by_address_.upper_bound(t.address);
      if (it != free_by_address_.begin()) {
        --it;
      }
      while (it != free_by_address_.end() && it->first < t.address + t.bytes) {
        const std::uintptr_t b0 = it->first;
        const std::uintptr_t b1 = b0 + it->second.bytes;
        const free_block tag = it->second;
        if (b1 <= t.address) {
          ++it;
          continue;
        }
        note_stream(out, tag);
        const auto next = std::next(it);
        erase_free_node(it);
        if (b0 < t.address) {
          insert_free_node(b0, {t.address - b0, tag.stream, tag.complete});
        }
        if (b1 > t.address + t.bytes) {
          insert_free_node(t.address + t.bytes, {b1 - t.address - t.bytes, tag.stream,
                                                 tag.complete});
        }
        it = next;
      }
      handles_.erase(t.address);
    }
    return out;
  }

  static void note_stream(recyclable& r, const free_block& tag) {
    for (const auto& s : r.streams) {
      if (s.first == tag.stream && s.second == tag.complete) {
        return;
      }
    }
    r.streams.emplace_back(tag.stream, tag.complete);
  }

  // --- growth and compaction --------------------------------------------------------------

  /// Makes a mapped free block of at least `needed` bytes at the frontier: grows from the
  /// device, then compacts. Leaves the pool as it was (but perhaps holding more free memory)
  /// when it cannot.
  void make_room(std::size_t needed, cudaStream_t stream, bool sync) {
    // The free block that ends at the frontier is extended rather than moved.
    std::uintptr_t tail = frontier_;
    std::optional<free_block> tail_block;
    if (frontier_ != 0) {
      const auto after = free_by_address_.lower_bound(frontier_);
      if (after != free_by_address_.begin()) {
        const auto last = std::prev(after);
        if (last->first + last->second.bytes == frontier_) {
          tail = last->first;
          tail_block = last->second;
        }
      }
    }
    const std::size_t have = frontier_ - tail;
    std::size_t missing = round_up(needed > have ? needed - have : 1, granule_);
    // Room for the worst case: every mapped byte recycled to the frontier, plus growth.
    if (frontier_ == 0 || frontier_end_ - frontier_ < missing + mapped_bytes_) {
      add_reservation(std::max(reservation_bytes_, round_up(needed, granule_) + mapped_bytes_));
      tail = frontier_;
      tail_block.reset();
      missing = round_up(needed, granule_);
    }
    // 1. Grow: new physical memory, in chunks, smaller ones when the device is nearly full.
    std::vector<moved_handle> fresh;  // old_address 0: never mapped
    std::size_t gathered = 0;
    const std::size_t limit = options_.physical_limit.value_or(~std::size_t{0});
    try {
      // Once the device has said "full", one probe per shortfall: no ladder of failing calls
      // (each costs the driver as much as a successful one) until memory comes back.
      std::size_t piece = device_full_ ? std::min(chunk_, missing) : chunk_;
      while (gathered < missing && frontier_ + gathered + granule_ <= frontier_end_) {
        piece = std::min(piece, frontier_end_ - frontier_ - gathered);
        if (mapped_bytes_ + gathered + piece > limit) {
          piece = limit > mapped_bytes_ + gathered ? (limit - mapped_bytes_ - gathered) / granule_ * granule_ : 0;
          if (piece == 0) {
            break;
          }
        }
        if (const auto h = layer_->create(piece)) {
          fresh.push_back({*h, piece, 0});
          gathered += piece;
          device_full_ = false;
        } else if (device_full_) {
          break;
        } else if (piece > granule_) {
          piece = std::max(granule_, piece / 2 / granule_ * granule_);
        } else {
          device_full_ = true;
          break;
        }
      }
    } catch (...) {
      for (const moved_handle& h : fresh) {
        layer_->release(h.handle);
      }
      throw;
    }
    if (!fresh.empty()) {
      ++growths_;
    }
    // 2. Compact: when the device could not give enough, recycle free handles.
    recyclable recycled;
    if (gathered < missing) {
      std::size_t available = 0;
      for_each_free_region([&](std::uintptr_t begin, std::uintptr_t end) {
        if (end == frontier_) {
          end = tail;
        }
        for (auto h = handles_.lower_bound(begin);
             h != handles_.end() && h->first + h->second.bytes <= end; ++h) {
          available += h->second.bytes;
        }
      });
      if (gathered + available >= missing) {
        recycled = take_recyclable(tail);
        ++compactions_;
      }
    }
    if (tail_block) {
      note_stream(recycled, *tail_block);
    }
    // 3. Map everything at the frontier, set access once, order the stream after the frees.
    std::vector<moved_handle> all = fresh;
    all.insert(all.end(), recycled.handles.begin(), recycled.handles.end());
    std::size_t mapped = 0;
    try {
      for (const moved_handle& h : all) {
        layer_->map(frontier_ + mapped, h.bytes, h.handle);
        mapped += h.bytes;
      }
      if (mapped > 0) {
        layer_->set_access(frontier_, mapped);
      }
      bool waited = false;
      for (const auto& [freed_on, complete] : recycled.streams) {
        if (complete) {
          continue;
        }
        if (sync) {
          layer_->wait_for_free(freed_on);
        } else if (freed_on != stream) {
          layer_->order_after_free(stream, freed_on);
          waited = true;
        }
      }
      if (waited) {
        layer_->record_free(stream);  // so later users of this block wait for all of it
      }
    } catch (...) {
      // Undo: the new mappings go, fresh handles go back, recycled ones return to their old
      // addresses (still mapped there) as free memory.
      std::size_t offset = 0;
      for (const moved_handle& h : all) {
        if (offset >= mapped) {
          break;
        }
        layer_->unmap(frontier_ + offset, h.bytes);
        offset += h.bytes;
      }
      for (const moved_handle& h : fresh) {
        layer_->release(h.handle);
      }
      // Their frees' streams were merged into one list: wait for them all, so the restored
      // blocks can be marked complete (an error path; the host wait does not matter here).
      if (!recycled.handles.empty()) {
        layer_->wait_for_all_frees();
      }
      for (const moved_handle& h : recycled.handles) {
        handles_.emplace(h.old_address, mapped_handle{h.handle, h.bytes});
        insert_free(h.old_address, {h.bytes, nullptr, true});
      }
      throw;
    }
    if (mapped == 0) {
      return;
    }
    std::size_t offset = 0;
    for (const moved_handle& h : all) {
      handles_.emplace(frontier_ + offset, mapped_handle{h.handle, h.bytes});
      if (h.old_address != 0) {
        stale_.push_back({h.old_address, h.bytes});
      }
      offset += h.bytes;
    }
    mapped_bytes_ += gathered;
    const bool any_pending = std::any_of(recycled.streams.begin(), recycled.streams.end(),
                                         [](const auto& s) { return !s.second; });
    const bool complete = sync || !any_pending;
    if (tail_block) {
      erase_free_node(free_by_address_.find(tail));
    }
    frontier_ += mapped;
    insert_free_node(tail, {frontier_ - tail, stream, complete});
  }

  void add_reservation(std::size_t bytes) {
    drop_empty_reservations();
    const std::uintptr_t base = layer_->reserve(bytes);
    try {
      reservations_.push_back({base, bytes});
    } catch (...) {
      layer_->free_reservation(base, bytes);
      throw;
    }
    frontier_ = base;
    frontier_end_ = base + bytes;
  }

  /// Frees reservations with nothing mapped in them; resets the frontier if the active one
  /// is empty (its whole range is usable again).
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
      const bool active = frontier_ >= it->base && frontier_ <= it->base + it->bytes &&
                          frontier_end_ == it->base + it->bytes;
      if (holds_mappings(*it)) {
        ++it;
      } else if (active) {
        frontier_ = it->base;  // nothing in it: start again from its base
        ++it;
      } else {
        layer_->free_reservation(it->base, it->bytes);
        it = reservations_.erase(it);
      }
    }
  }

  std::unique_ptr<detail::vm_mapping_layer> layer_;
  vm_pool_options options_;
  std::size_t granule_ = 0;
  std::size_t chunk_ = 0;
  std::size_t reservation_bytes_ = 0;

  mutable std::mutex mutex_;
  std::map<std::uintptr_t, free_block> free_by_address_;
  std::set<std::pair<std::size_t, std::uintptr_t>> free_by_size_;
  std::unordered_map<std::uintptr_t, std::size_t> live_;  ///< address -> rounded size
  std::map<std::uintptr_t, mapped_handle> handles_;      ///< current address -> handle
  std::vector<mapping> stale_;                           ///< retired aliases to unmap later
  std::vector<reservation> reservations_;
  std::uintptr_t frontier_ = 0;      ///< lowest never-mapped address of the active reservation
  std::uintptr_t frontier_end_ = 0;  ///< its end
  std::size_t mapped_bytes_ = 0;
  std::size_t used_bytes_ = 0;
  std::size_t peak_used_bytes_ = 0;
  std::size_t compactions_ = 0;
  std::size_t growths_ = 0;
  bool device_full_ = false;  ///< the last growth found the device full
};

}  // namespace cudamem
