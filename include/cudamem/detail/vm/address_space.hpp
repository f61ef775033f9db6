// cudamem/detail/vm/address_space.hpp — vm_resource's virtual address space: the ranges it
// has reserved, and the frontier where new mappings go.
//
//   address_space space{reservation_bytes, alignment};
//   if (space.room() < needed) space.reserve(layer, std::max(...));  // a new active range
//   layer.map(space.frontier(), bytes, h);  space.advance(bytes);
//
// What it owns. Address space is cheap (one cuMemAddressReserve of 158 GiB costs ~22 µs on
// an H100) and physical memory can be mapped anywhere in it, so the resource reserves a range
// four times the device's memory once, and more ranges if it ever runs out. Growth and
// compaction map at the *frontier*: the lowest never-used address of the active range, where
// new mappings extend the free range that ends there. A reservation with nothing mapped in it
// is given back (the active one starts over from its base instead). Reservations start at a
// multiple of `alignment`: the handle size when it is a power of two, so that handles, mapped
// one after another from a reservation's base, each sit at a multiple of their size
// (handle_set's placement is arithmetic then).
//
// Not thread-safe: vm_resource's mutex guards it.
#pragma once

#include <cudamem/detail/vm/mapping.hpp>

#include <cstddef>
#include <cstdint>
#include <vector>

namespace cudamem::detail {

class address_space {
 public:
  address_space(std::size_t reservation_bytes, std::size_t alignment) noexcept
      : reservation_bytes_(reservation_bytes), alignment_(alignment) {}

  /// The size of one reservation (when a request needs no more).
  [[nodiscard]] std::size_t reservation_bytes() const noexcept { return reservation_bytes_; }
  /// Where the next mapping goes; 0 before the first reservation.
  [[nodiscard]] std::uintptr_t frontier() const noexcept { return frontier_; }
  /// Address space left at the frontier.
  [[nodiscard]] std::size_t room() const noexcept {
    return frontier_ == 0 ? 0 : static_cast<std::size_t>(frontier_end_ - frontier_);
  }
  [[nodiscard]] std::size_t count() const noexcept { return reservations_.size(); }
  [[nodiscard]] std::size_t reserved_bytes() const noexcept {
    std::size_t total = 0;
    for (const reservation& r : reservations_) {
      total += r.bytes;
    }
    return total;
  }

  /// `bytes` were mapped at the frontier.
  void advance(std::size_t bytes) noexcept { frontier_ += bytes; }
  /// Everything mapped from `address` (in the active reservation) to the frontier was given
  /// back: new mappings go there again.
  void retreat_to(std::uintptr_t address) noexcept {
    for (const reservation& r : reservations_) {
      if (r.base + r.bytes == frontier_end_ && address >= r.base && address < frontier_) {
        frontier_ = address;
      }
    }
  }

  /// Reserves a new range of `bytes` and makes it the active one. Throws what the layer throws.
  void reserve(vm_mapping_layer& layer, std::size_t bytes) {
    reservations_.reserve(reservations_.size() + 1);  // so the push cannot throw and leak
    const std::uintptr_t base = layer.reserve(bytes, alignment_);
    reservations_.push_back({base, bytes});
    frontier_ = base;
    frontier_end_ = base + bytes;
  }

  /// Frees reservations with nothing mapped in them (`holds_mappings(base, bytes)` says);
  /// an empty active one starts over from its base.
  template <class HoldsMappings>
  void drop_empty(vm_mapping_layer& layer, HoldsMappings&& holds_mappings) noexcept {
    for (auto it = reservations_.begin(); it != reservations_.end();) {
      const bool active = frontier_end_ == it->base + it->bytes;
      if (holds_mappings(it->base, it->bytes)) {
        ++it;
      } else if (active) {
        frontier_ = it->base;
        ++it;
      } else {
        layer.free_reservation(it->base, it->bytes);
        it = reservations_.erase(it);
      }
    }
  }

  /// Destruction: every reservation goes back (everything in them is unmapped by now).
  void free_all(vm_mapping_layer& layer) noexcept {
    for (const reservation& r : reservations_) {
      layer.free_reservation(r.base, r.bytes);
    }
    reservations_.clear();
  }

 private:
  struct reservation {
    std::uintptr_t base;
    std::size_t bytes;
  };
  std::vector<reservation> reservations_;
  std::size_t reservation_bytes_;
  std::size_t alignment_;  ///< of every reservation's base
  std::uintptr_t frontier_ = 0;      ///< lowest never-mapped address of the active reservation
  std::uintptr_t frontier_end_ = 0;  ///< its end
};

}  // namespace cudamem::detail
