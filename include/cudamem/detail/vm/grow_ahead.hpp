// cudamem/detail/vm/grow_ahead.hpp — growth ahead of need (vm_resource_options::
// grow_ahead_bytes): what the growth thread (growth_thread.hpp) makes, one batch of fresh
// handles at the frontier at a time, and the memory held ahead that gives way.
//
//   if (auto batch = compactor.plan_ahead(most)) {     // under vm_resource's mutex
//     lock.unlock();
//     compactor.make_ahead(*batch);                    // the driver's calls, no lock held
//     lock.lock();
//     compactor.publish_ahead(*batch);                 // free memory at the frontier
//   }
//   compactor.release_tail();                          // trim(): give what is held ahead back
//
// What it owns: how much to hold ahead (a quarter of what is held, up to grow_ahead_bytes,
// never taking the device below grow_ahead_floor_bytes), the three parts of a batch (planned
// under the lock, made without it, published under it: compactor.hpp says why each part is
// safe), and giving back what lies free at the frontier in whole handles, after which growth
// ahead waits for a growth of the resource's own.
//
// Part of compactor.hpp: these are members of vm_compactor, declared there with what each
// says, and working on the same parts (the free ranges, the handles, the address space).
#pragma once

#include <cudamem/detail/vm/compactor.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <optional>
#include <stdexcept>
#include <vector>

namespace cudamem::detail {

// The members of vm_compactor this part defines; each is declared, with what it says, in
// compactor.hpp.

inline std::size_t vm_compactor::headroom(std::size_t most) const noexcept {
  return std::min(most, std::max(config_.handle, handles_.mapped_bytes / 4));
}

inline bool vm_compactor::wants_ahead(std::size_t most) {
  return !handles_.device_full && !ahead_held_back_ &&
         handles_.mapped_bytes + config_.handle <= config_.limit &&
         free_at_frontier() < headroom(most);
}

inline std::size_t vm_compactor::tail_bytes() const {
  const std::uintptr_t start = free_.start_of_range_ending_at(space_.frontier());
  return start == 0 ? 0 : handles_.bytes_inside(start, space_.frontier());
}

inline std::size_t vm_compactor::release_tail() {
  ahead_held_back_ = true;
  const std::uintptr_t start = free_.start_of_range_ending_at(space_.frontier());
  if (start == 0) {
    return 0;
  }
  const std::size_t bytes = handles_.bytes_inside(start, space_.frontier());
  if (bytes == 0) {
    return 0;
  }
  if (!handles_.stale.empty()) {
    wait_and_unmap_stale();
  }
  std::uintptr_t lowest = space_.frontier();
  std::size_t released = 0;
  for (const moved_handle& h : take_recyclable({{start, space_.frontier(), bytes}})) {
    layer_.unmap(h.old_address, h.bytes);
    ++counts_.unmaps;
    layer_.release(h.handle);
    released += h.bytes;
    lowest = std::min(lowest, h.old_address);
  }
  handles_.mapped_bytes -= released;
  counts_.bytes_given_back_ahead += released;
  space_.retreat_to(lowest);
  return released;
}

inline std::optional<vm_compactor::ahead_batch> vm_compactor::plan_ahead(std::size_t most) {
  if (!wants_ahead(most)) {
    return std::nullopt;
  }
  const std::size_t handle = config_.handle;
  const std::size_t room = headroom(most);
  const std::size_t step = std::max(vm_config::round_up(config_.growth, handle),
                                    vm_config::round_up(room / 4, handle));
  std::size_t bytes = std::min(vm_config::round_up(room - free_at_frontier(), handle), step);
  bytes = std::min(bytes, (config_.limit - handles_.mapped_bytes) / handle * handle);
  if (bytes == 0 || space_.room() < bytes) {
    return std::nullopt;
  }
  ahead_batch b;
  b.start = space_.frontier();
  b.handles = bytes / handle;
  return b;
}

inline void vm_compactor::make_ahead(ahead_batch& b) noexcept {
  const std::size_t handle = config_.handle;
  std::vector<vm_handle> created;
  std::size_t mapped = 0;
  try {
    // What the device has free now, less the floor (unknown: nothing is made ahead).
    const std::optional<std::size_t> free = layer_.device_free();
    const std::size_t above_floor =
        free && *free > config_.ahead_floor ? (*free - config_.ahead_floor) / handle : 0;
    if (above_floor < b.handles) {
      b.handles = above_floor;
      b.at_floor = true;
    }
    created.reserve(b.handles);
    while (created.size() < b.handles) {
      const auto h = layer_.create(handle);
      if (!h) {
        b.device_full = true;
        break;
      }
      created.push_back(*h);
      ++b.calls.handles_created;
    }
    for (const vm_handle h : created) {
      layer_.map(b.start + mapped, handle, h);
      ++b.calls.maps;
      mapped += handle;
    }
    if (mapped != 0) {
      layer_.set_access(b.start, mapped);
      ++b.calls.access_calls;
    }
    std::size_t offset = 0;
    for (const vm_handle h : created) {
      b.made.emplace(b.start + offset, mapped_handle{h, handle});
      offset += handle;
    }
    b.mapped = mapped;
  } catch (...) {
    b.error = std::current_exception();
    b.made.clear();
    b.mapped = 0;
    for (std::size_t offset = 0; offset < mapped; offset += handle) {
      layer_.unmap(b.start + offset, handle);  // never handed out: nothing in flight
      ++b.calls.unmaps;
    }
    for (const vm_handle h : created) {
      layer_.release(h);
    }
  }
}

inline void vm_compactor::publish_ahead(ahead_batch& b) {
  counts_.handles_created += b.calls.handles_created;
  counts_.maps += b.calls.maps;
  counts_.access_calls += b.calls.access_calls;
  counts_.unmaps += b.calls.unmaps;
  counts_.handles_created_ahead += b.calls.handles_created;
  handles_.device_full = handles_.device_full || b.device_full;
  ahead_held_back_ = ahead_held_back_ || b.at_floor;
  if (b.error) {
    std::rethrow_exception(b.error);
  }
  if (b.made.empty()) {
    return;
  }
  try {
    if (space_.frontier() != b.start) {
      throw std::logic_error("vm_resource: the frontier moved while a batch was made ahead");
    }
    free_.insert(b.start, {b.mapped, nullptr, true});
  } catch (...) {
    for (const auto& [address, h] : b.made) {
      layer_.unmap(address, h.bytes);
      ++counts_.unmaps;
      layer_.release(h.handle);
    }
    b.made.clear();
    throw;
  }
  handles_.adopt(b.made);  // moves the nodes: cannot fail
  handles_.mapped_bytes += b.mapped;
  space_.advance(b.mapped);
}

}  // namespace cudamem::detail
