// cudamem/detail/vm/simulated_mapping.hpp — a mapping layer for vm_resource (vm/mapping.hpp)
// with no device behind it: host bookkeeping only, fake addresses, a byte budget for "physical
// memory", and checks that every call is one the driver would accept. The pool's granule and
// handle bookkeeping runs on it in CI, with no GPU; simulations replay 80 GiB traces on it.
//
//   auto layer = std::make_unique<cudamem::detail::simulated_vm_mapping>(
//       cudamem::detail::simulated_vm_options{.capacity = 80ull << 30});
//   cudamem::vm_resource vm{std::move(layer)};      // or vm_pool_resource pool{std::move(layer)}
//
// Contract: vm/mapping.hpp's, which both layers keep; and what is said of each member below.
#pragma once

#include <cudamem/detail/held_ahead.hpp>
#include <cudamem/detail/sync/mutex.hpp>
#include <cudamem/detail/vm/mapping.hpp>
#include <cudamem/memory_resource.hpp>
#include <cudamem/out_of_memory.hpp>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <iterator>
#include <map>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

namespace cudamem::detail {

/// What a simulated layer held when it was destroyed (tests check that its owner gave
/// everything back).
struct simulated_vm_final_state {
  bool destroyed = false;
  std::size_t physical_in_use = 0;
  std::size_t mappings = 0;
  std::size_t reservations = 0;
  std::size_t violations = 0;
};

/// How to build a simulated mapping layer.
struct simulated_vm_options {
  std::size_t capacity = std::size_t{80} << 30;    ///< "physical" bytes the device has
  std::size_t granularity = std::size_t{2} << 20;  ///< must be a power of two
  simulated_vm_final_state* final_state = nullptr;  ///< written at destruction when set
  /// The driver's time, for benchmarks of what overlaps it (0: none, as in tests): each
  /// create keeps its thread busy `create_us`, each set_access `access_us` per mapping it
  /// covers (the driver's costs are per handle: bench_vmm_driver). The layer's lock is not
  /// held meanwhile.
  unsigned create_us = 0;
  unsigned access_us = 0;
  /// The pretend device whose memory the handles are (a `simulated_resource`, say; it must
  /// outlive the layer): each handle is an allocation of it, so other resources over it share
  /// the device with this layer, and `capacity` becomes its capacity. Null: a device of the
  /// layer's own. (Tests of memory held ahead giving way: detail/held_ahead.hpp.)
  memory_resource* physical = nullptr;
  /// Where its address space starts. Layers of one test that share addresses between them (a
  /// vm_pool's two vm_resources) need ranges apart, as a process's layers have.
  std::uintptr_t first_address = std::uintptr_t{1} << 40;
};

/// Host bookkeeping only: the device is a byte budget, addresses are numbers. Every call is
/// checked against the rules the driver enforces (a violation throws std::logic_error, or is
/// counted in `violations` where the call is noexcept), so tests catch bugs that the real
/// driver would catch, plus a few it would not (a handle released twice, a leak, an unmap of
/// memory that work still in flight may touch: `unmaps_in_flight`).
class simulated_vm_mapping final : public vm_mapping_layer {
 public:
  explicit simulated_vm_mapping(simulated_vm_options options = {})
      : options_(options), next_address_(options.first_address) {
    if (options_.granularity == 0 || (options_.granularity & (options_.granularity - 1)) != 0) {
      throw std::invalid_argument("simulated_vm_mapping: granularity must be a power of two");
    }
    if (options_.physical != nullptr) {
      options_.capacity = options_.physical->stats().capacity.value_or(options_.capacity);
    }
  }

  ~simulated_vm_mapping() override {
    if (options_.final_state != nullptr) {
      *options_.final_state = {true, physical_in_use_, mappings_.size(),
                               reservations_.size(), violations};
    }
  }

  // --- what tests read ----------------------------------------------------------------------
  struct call_counts {
    std::size_t reserve = 0, free_reservation = 0, create = 0, release = 0, map = 0, unmap = 0,
                set_access = 0, record_free = 0, order_after_free = 0, wait_for_free = 0,
                wait_for_all_frees = 0;
  };
  call_counts calls;  ///< read them when no growth thread is calling (wait_for_growth)
  std::size_t violations = 0;  ///< illegal noexcept calls (unmap of no mapping, double release)
  std::size_t unmaps_in_flight = 0;  ///< unmaps of a handle freed on a stream not yet waited for
  std::vector<int> peers;                 ///< devices given access (add_peer)
  std::size_t peer_access_mappings = 0;   ///< mappings set_peer_access covered

  /// Physical bytes created and not yet given back (released and unmapped everywhere).
  [[nodiscard]] std::size_t physical_in_use() const {
    const detail::lock_guard lock(mutex_);
    return physical_in_use_;
  }
  [[nodiscard]] std::size_t reserved_bytes() const {
    const detail::lock_guard lock(mutex_);
    std::size_t total = 0;
    for (const auto& [base, bytes] : reservations_) {
      total += bytes;
    }
    return total;
  }
  [[nodiscard]] std::size_t mapping_count() const {
    const detail::lock_guard lock(mutex_);
    return mappings_.size();
  }
  [[nodiscard]] std::size_t live_handle_count() const {
    const detail::lock_guard lock(mutex_);
    return handles_.size();
  }

  /// True when every byte of [va, va + bytes) is mapped and has had access set.
  [[nodiscard]] bool is_accessible(std::uintptr_t va, std::size_t bytes) const {
    const detail::lock_guard lock(mutex_);
    std::uintptr_t at = va;
    const std::uintptr_t end = va + bytes;
    while (at < end) {
      auto it = mappings_.upper_bound(at);
      if (it == mappings_.begin()) {
        return false;
      }
      --it;
      const std::uintptr_t map_end = it->first + it->second.bytes;
      if (map_end <= at || !it->second.accessible) {
        return false;
      }
      at = map_end;
    }
    return true;
  }

  /// The handle mapped at `va` (tests use it to see that memory moved, not copied).
  [[nodiscard]] std::optional<vm_handle> handle_at(std::uintptr_t va) const {
    const detail::lock_guard lock(mutex_);
    return handle_at_unlocked(va);
  }

  /// Makes the next `count` calls to create() answer "out of memory" (tests of the fallback).
  void fail_next_creates(std::size_t count) {
    const detail::lock_guard lock(mutex_);
    failing_creates_ = count;
  }
  /// Makes the map() call after the next `skip` ones throw std::runtime_error, as a driver
  /// error would (tests that a failure half-way through a batch leaks nothing).
  void fail_map_after(std::size_t skip) {
    const detail::lock_guard lock(mutex_);
    maps_before_failure_ = skip + 1;
  }

  // --- the layer ----------------------------------------------------------------------------
  [[nodiscard]] int device() const noexcept override { return -1; }
  [[nodiscard]] std::size_t granularity() const noexcept override { return options_.granularity; }
  [[nodiscard]] std::size_t device_total() const noexcept override { return options_.capacity; }
  [[nodiscard]] std::optional<std::size_t> simulated_capacity() const noexcept override {
    return options_.capacity;
  }
  [[nodiscard]] std::optional<std::size_t> device_free() const noexcept override {
    if (options_.physical != nullptr) {
      try {
        const resource_stats s = options_.physical->stats();
        return options_.capacity > s.reserved_bytes ? options_.capacity - s.reserved_bytes : 0;
      } catch (...) {
        return std::nullopt;
      }
    }
    const detail::lock_guard lock(mutex_);
    return options_.capacity - physical_in_use_;
  }
  [[nodiscard]] memory_domain domain() const noexcept override {
    return {-1, options_.physical != nullptr ? static_cast<const void*>(options_.physical)
                                             : static_cast<const void*>(this)};
  }

  [[nodiscard]] std::uintptr_t reserve(std::size_t bytes, std::size_t alignment) override {
    const detail::lock_guard lock(mutex_);
    ++calls.reserve;
    require(bytes > 0 && bytes % options_.granularity == 0, "reserve: size not granular");
    require(alignment != 0 && (alignment & (alignment - 1)) == 0 &&
                alignment % options_.granularity == 0,
            "reserve: alignment not a power-of-two multiple of the granularity");
    const std::uintptr_t base = (next_address_ + alignment - 1) / alignment * alignment;
    next_address_ = base + bytes + options_.granularity;  // a gap: reservations never touch
    reservations_.emplace(base, bytes);
    return base;
  }

  void free_reservation(std::uintptr_t base, std::size_t bytes) noexcept override {
    const detail::lock_guard lock(mutex_);
    ++calls.free_reservation;
    const auto it = reservations_.find(base);
    if (it == reservations_.end() || it->second != bytes) {
      ++violations;
      return;
    }
    const auto inside = mappings_.lower_bound(base);
    if (inside != mappings_.end() && inside->first < base + bytes) {
      ++violations;  // the driver refuses to free address space that is still mapped
      return;
    }
    reservations_.erase(it);
  }

  [[nodiscard]] std::optional<vm_handle> create(std::size_t bytes) override {
    pretend_to_work(options_.create_us);
    const detail::lock_guard lock(mutex_);
    ++calls.create;
    require(bytes > 0 && bytes % options_.granularity == 0, "create: size not granular");
    if (failing_creates_ > 0) {
      --failing_creates_;
      return std::nullopt;
    }
    void* block = nullptr;
    if (options_.physical != nullptr) {
      // The device's memory, asked for as the driver asks for it: a failure is an answer (no
      // report built), and the process's held-ahead memory is not asked for (the vm_resource
      // calling may hold its lock; only the allocating paths above the layer may ask).
      const no_give_back_scope quiet;
      const discarded_report_scope discarded{*options_.physical};
      try {
        block = options_.physical->allocate(bytes);
      } catch (const out_of_memory&) {
        return std::nullopt;
      }
    } else if (physical_in_use_ + bytes > options_.capacity) {
      return std::nullopt;
    }
    physical_in_use_ += bytes;
    const vm_handle h = next_handle_++;
    handles_.emplace(h, handle_state{bytes, 0, false, {}, block});
    return h;
  }

  void release(vm_handle handle) noexcept override {
    const detail::lock_guard lock(mutex_);
    ++calls.release;
    const auto it = handles_.find(handle);
    if (it == handles_.end() || it->second.released) {
      ++violations;
      return;
    }
    it->second.released = true;
    forget_if_unused(it);
  }

  void map(std::uintptr_t va, std::size_t bytes, vm_handle handle) override {
    const detail::lock_guard lock(mutex_);
    ++calls.map;
    if (maps_before_failure_ > 0 && --maps_before_failure_ == 0) {
      throw std::runtime_error("simulated_vm_mapping: injected map failure");
    }
    const auto h = handles_.find(handle);
    require(h != handles_.end() && !h->second.released, "map: unknown or released handle");
    require(h->second.bytes == bytes, "map: size differs from the handle's");
    require(va % options_.granularity == 0, "map: address not granular");
    require(inside_reservation(va, bytes), "map: range not inside one reservation");
    const auto next = mappings_.lower_bound(va);
    require(next == mappings_.end() || next->first >= va + bytes, "map: overlaps a mapping");
    if (next != mappings_.begin()) {
      const auto prev = std::prev(next);
      require(prev->first + prev->second.bytes <= va, "map: overlaps a mapping");
    }
    mappings_.emplace(va, mapping_state{bytes, handle, false});
    ++h->second.mappings;
  }

  void unmap(std::uintptr_t va, std::size_t bytes) noexcept override {
    const detail::lock_guard lock(mutex_);
    ++calls.unmap;
    const auto it = mappings_.find(va);
    if (it == mappings_.end() || it->second.bytes != bytes) {
      ++violations;
      return;
    }
    const auto h = handles_.find(it->second.handle);
    mappings_.erase(it);
    if (h != handles_.end() && !h->second.in_flight_on.empty()) {
      ++unmaps_in_flight;  // a kernel may still read through this mapping
      ++violations;
    }
    if (h != handles_.end()) {
      --h->second.mappings;
      forget_if_unused(h);
    }
  }

  void set_access(std::uintptr_t va, std::size_t bytes) override {
    std::size_t covered = 0;
    {
      const detail::lock_guard lock(mutex_);
      ++calls.set_access;
      // Like the driver: the whole range must be mapped (possibly by several mappings).
      std::uintptr_t at = va;
      const std::uintptr_t end = va + bytes;
      while (at < end) {
        const auto it = mappings_.find(at);
        require(it != mappings_.end(), "set_access: range not wholly mapped");
        it->second.accessible = true;
        at += it->second.bytes;
        ++covered;
      }
      require(at == end, "set_access: range ends inside a mapping");
    }
    pretend_to_work(options_.access_us * covered);
  }

  void add_peer(int device) override {
    const detail::lock_guard lock(mutex_);
    if (std::find(peers.begin(), peers.end(), device) == peers.end()) {
      peers.push_back(device);
    }
  }

  void set_peer_access(std::uintptr_t va, std::size_t bytes, int device) override {
    const detail::lock_guard lock(mutex_);
    if (device == this->device()) {
      return;
    }
    require(std::find(peers.begin(), peers.end(), device) != peers.end(),
            "set_peer_access: not a peer (add_peer first)");
    std::uintptr_t at = va;
    const std::uintptr_t end = va + bytes;
    while (at < end) {
      const auto it = mappings_.find(at);
      require(it != mappings_.end(), "set_peer_access: range not wholly mapped");
      require(it->second.accessible, "set_peer_access: a mapping its own device cannot access");
      at += it->second.bytes;
      ++peer_access_mappings;
    }
    require(at == end, "set_peer_access: range ends inside a mapping");
  }

  void record_free(cudaStream_t stream, std::uintptr_t va, std::size_t bytes) override {
    const detail::lock_guard lock(mutex_);
    ++calls.record_free;
    // Every handle mapped under the range may still be touched by work on `stream`.
    auto it = mappings_.upper_bound(va);
    if (it != mappings_.begin()) {
      --it;
    }
    for (; it != mappings_.end() && it->first < va + bytes; ++it) {
      if (it->first + it->second.bytes > va) {
        auto& streams = handles_.at(it->second.handle).in_flight_on;
        if (std::find(streams.begin(), streams.end(), stream) == streams.end()) {
          streams.push_back(stream);
        }
      }
    }
  }
  void order_after_free(cudaStream_t /*user*/, cudaStream_t /*freed_on*/) override {
    const detail::lock_guard lock(mutex_);
    ++calls.order_after_free;  // GPU-side ordering: the host still may not unmap
  }
  void wait_for_free(cudaStream_t freed_on) override {
    const detail::lock_guard lock(mutex_);
    ++calls.wait_for_free;
    for (auto& [h, state] : handles_) {
      std::erase(state.in_flight_on, freed_on);
    }
  }
  void wait_for_all_frees() noexcept override {
    const detail::lock_guard lock(mutex_);
    ++calls.wait_for_all_frees;
    for (auto& [h, state] : handles_) {
      state.in_flight_on.clear();
    }
  }

  /// Whether work on some stream may still touch the handle mapped at `va` (tests).
  [[nodiscard]] bool in_flight(std::uintptr_t va) const {
    const detail::lock_guard lock(mutex_);
    const auto h = handle_at_unlocked(va);
    return h && !handles_.at(*h).in_flight_on.empty();
  }

 private:
  struct handle_state {
    std::size_t bytes;
    std::size_t mappings;
    bool released;
    std::vector<cudaStream_t> in_flight_on;  ///< streams whose frees the host has not awaited
    void* physical_block = nullptr;          ///< its memory in options_.physical, if any
  };
  struct mapping_state {
    std::size_t bytes;
    vm_handle handle;
    bool accessible;
  };

  /// Busy for `us`: the driver's time is CPU time too (in the kernel and the driver), so a
  /// sleep would make it look cheaper to overlap than it is.
  static void pretend_to_work(std::size_t us) {
    if (us == 0) {
      return;
    }
    const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(us);
    while (std::chrono::steady_clock::now() < until) {
    }
  }

  [[nodiscard]] std::optional<vm_handle> handle_at_unlocked(std::uintptr_t va) const {
    auto it = mappings_.upper_bound(va);
    if (it == mappings_.begin()) {
      return std::nullopt;
    }
    --it;
    if (va >= it->first + it->second.bytes) {
      return std::nullopt;
    }
    return it->second.handle;
  }

  static void require(bool ok, const char* what) {
    if (!ok) {
      throw std::logic_error(std::string("simulated_vm_mapping: ") + what);
    }
  }

  [[nodiscard]] bool inside_reservation(std::uintptr_t va, std::size_t bytes) const {
    auto it = reservations_.upper_bound(va);
    if (it == reservations_.begin()) {
      return false;
    }
    --it;
    return va + bytes <= it->first + it->second;
  }

  void forget_if_unused(std::map<vm_handle, handle_state>::iterator it) noexcept {
    if (it->second.released && it->second.mappings == 0) {
      physical_in_use_ -= it->second.bytes;
      if (it->second.physical_block != nullptr) {
        options_.physical->deallocate(it->second.physical_block, it->second.bytes);
      }
      handles_.erase(it);
    }
  }

  simulated_vm_options options_;
  mutable detail::mutex mutex_;  ///< guards everything: a growth thread calls beside the others
  std::uintptr_t next_address_;
  vm_handle next_handle_ = 1;
  std::size_t physical_in_use_ = 0;
  std::size_t failing_creates_ = 0;
  std::size_t maps_before_failure_ = 0;  ///< 0: no failure planned
  std::map<std::uintptr_t, std::size_t> reservations_;
  std::map<std::uintptr_t, mapping_state> mappings_;
  std::map<vm_handle, handle_state> handles_;
};

}  // namespace cudamem::detail
