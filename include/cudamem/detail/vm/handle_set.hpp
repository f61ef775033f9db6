// cudamem/detail/vm/handle_set.hpp — vm_resource's physical memory: every handle it holds,
// where each is mapped now, and the stale aliases recycling left behind.
//
//   handle_set handles{64 << 20};                          // the resource's handle size
//   handles.add(address, {h, 64 << 20});                   // mapped at `address`
//   auto spot = handles.place_whole(begin, end, size);     // whole handles inside a free range
//   std::size_t idle = handles.bytes_inside(begin, end);   // what a compaction could move
//
// What it owns
// - The map from the address a handle is mapped at now to the handle and its size. Handles
//   tile every mapped range, free or live, so a free range's recyclable memory is exactly the
//   handles lying wholly inside it.
// - Placement of whole-handle blocks: a request of a handle or more starts at a handle's start
//   and ends at a handle's end, so that once freed every handle under it is wholly free and can
//   be recycled; the rest of its last handle is waste while it lives (at most one handle).
//   While every handle has the resource's size and is mapped at a multiple of it (reservations
//   are aligned to a power-of-two handle: address_space), a handle's start is arithmetic and
//   placement reads no map. The map has one node per handle (1,700 at 7 GiB of 4 MiB handles);
//   inside a training step its walk missed the cache at every level and was the largest part
//   of a large allocation's host time. Otherwise (a handle size that is not a power of two)
//   placement looks the first handle up.
// - Stale aliases: the old address of a recycled handle stays mapped (a cuMemUnmap costs
//   17-31 µs and is unsafe while a kernel may read) until release(), destruction, or an
//   address-space sweep unmaps it.
// - Physical accounting: bytes held, and whether the device said "full" at the last create
//   (then recycling comes first, and the device is probed only for what it cannot give).
//
// Not thread-safe: vm_resource's mutex guards it.
#pragma once

#include <cudamem/detail/held_bytes.hpp>
#include <cudamem/detail/vm/config.hpp>
#include <cudamem/detail/vm/mapping.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <map>
#include <optional>
#include <stdexcept>
#include <utility>
#include <vector>

namespace cudamem::detail {

struct mapped_handle {
  vm_handle handle;
  std::size_t bytes;
};

/// A mapping with no handle bookkeeping left: a stale alias awaiting its unmap.
struct vm_alias {
  std::uintptr_t address;
  std::size_t bytes;
};

/// Where a block goes inside a free range: [start, end).
struct vm_placement {
  std::uintptr_t start;
  std::uintptr_t end;
};

class handle_set {
 public:
  using map_type = std::map<std::uintptr_t, mapped_handle>;

  /// `handle_bytes`: the size of the resource's handles (0: none known; placement looks up).
  explicit handle_set(std::size_t handle_bytes = 0) noexcept : uniform_(handle_bytes) {}

  [[nodiscard]] std::size_t count() const noexcept { return by_address_.size(); }
  [[nodiscard]] const map_type& all() const noexcept { return by_address_; }
  [[nodiscard]] map_type::const_iterator first_from(std::uintptr_t address) const {
    return by_address_.lower_bound(address);
  }
  [[nodiscard]] map_type::const_iterator end() const noexcept { return by_address_.end(); }

  void add(std::uintptr_t address, mapped_handle h) {
    if (by_address_.emplace(address, h).second && !aligned(address, h.bytes)) {
      ++unaligned_;
    }
  }
  void erase(std::uintptr_t address) noexcept {
    const auto it = by_address_.find(address);
    if (it != by_address_.end()) {
      unaligned_ -= aligned(address, it->second.bytes) ? 0 : 1;
      by_address_.erase(it);
    }
  }
  /// Moves every entry of `made` in (their nodes: no allocation); addresses must be new.
  void adopt(map_type& made) noexcept {
    for (const auto& [address, h] : made) {
      unaligned_ += aligned(address, h.bytes) ? 0 : 1;
    }
    by_address_.merge(made);
  }
  /// Whether every handle has the resource's size and sits at a multiple of it (placement is
  /// arithmetic then).
  [[nodiscard]] bool all_aligned() const noexcept { return uniform_ != 0 && unaligned_ == 0; }

  /// Where a block of `size` bytes of whole handles goes inside the free range [begin, end),
  /// or nullopt: from the first handle starting in it to the end of the last handle it needs.
  /// Handles tile every free range and all have one size (detail/vm/compactor.hpp), so the
  /// last handle's end follows from the first's start: one lookup at most, not two (this runs
  /// for every candidate range of every large request), and none while all_aligned(): the
  /// first handle starting in a mapped range is then its start rounded up to a handle.
  [[nodiscard]] std::optional<vm_placement> place_whole(std::uintptr_t begin, std::uintptr_t end,
                                                        std::size_t size) const {
    if (all_aligned()) {
      const std::uintptr_t start = vm_config::round_up(begin, uniform_);
      const std::uintptr_t stop = start + vm_config::round_up(size, uniform_);
      if (stop > end) {
        return std::nullopt;
      }
      return vm_placement{start, stop};
    }
    const auto first = by_address_.lower_bound(begin);
    if (first == by_address_.end()) {
      return std::nullopt;
    }
    const std::size_t handle = first->second.bytes;
    const std::uintptr_t stop = first->first + (size + handle - 1) / handle * handle;
    if (stop > end) {
      return std::nullopt;
    }
    return vm_placement{first->first, stop};
  }

  /// Calls f(address, handle) for every handle mapped wholly inside [begin, end).
  template <class F>
  void for_each_inside(std::uintptr_t begin, std::uintptr_t end, F&& f) const {
    for (auto h = by_address_.lower_bound(begin);
         h != by_address_.end() && h->first + h->second.bytes <= end; ++h) {
      f(h->first, h->second);
    }
  }

  /// Bytes of the handles mapped wholly inside [begin, end).
  [[nodiscard]] std::size_t bytes_inside(std::uintptr_t begin, std::uintptr_t end) const {
    std::size_t bytes = 0;
    for_each_inside(begin, end, [&](std::uintptr_t, const mapped_handle& h) { bytes += h.bytes; });
    return bytes;
  }

  /// Appends to `out` the handles under [address, address + bytes) (a live block: handles tile
  /// the mapped memory), in address order, as (handle, bytes); returns how far `address` lies
  /// into the first. Throws std::logic_error if they are not adjacent.
  std::size_t handles_under(std::uintptr_t address, std::size_t bytes,
                            std::vector<std::pair<vm_handle, std::size_t>>& out) const {
    auto h = by_address_.upper_bound(address);
    if (h == by_address_.begin()) {
      throw std::logic_error("cudamem::vm_resource: no handle under a live block");
    }
    --h;
    const std::size_t offset = address - h->first;
    std::uintptr_t next = h->first;
    for (; h != by_address_.end() && h->first < address + bytes; ++h) {
      if (h->first != next) {
        throw std::logic_error("cudamem::vm_resource: a live block over non-adjacent handles");
      }
      out.emplace_back(h->second.handle, h->second.bytes);
      next = h->first + h->second.bytes;
    }
    return offset;
  }

  /// The mapped memory as ranges of adjacent handles, by address: (start, bytes).
  [[nodiscard]] std::vector<std::pair<std::uintptr_t, std::size_t>> ranges() const {
    std::vector<std::pair<std::uintptr_t, std::size_t>> out;
    for (const auto& [address, h] : by_address_) {
      if (!out.empty() && out.back().first + out.back().second == address) {
        out.back().second += h.bytes;
      } else {
        out.emplace_back(address, h.bytes);
      }
    }
    return out;
  }

  /// Appends to `out` the handles under [address, address + bytes) and returns how far
  /// `address` lies into the first, if the range lies in adjacent mapped handles; else
  /// nullopt (out unchanged).
  std::optional<std::size_t> covering(std::uintptr_t address, std::size_t bytes,
                                      std::vector<std::pair<vm_handle, std::size_t>>& out) const {
    auto h = by_address_.upper_bound(address);
    if (bytes == 0 || h == by_address_.begin()) {
      return std::nullopt;
    }
    --h;
    const std::size_t offset = address - h->first;
    std::vector<std::pair<vm_handle, std::size_t>> found;
    for (std::uintptr_t next = h->first; next < address + bytes; ++h) {
      if (h == by_address_.end() || h->first != next) {
        return std::nullopt;  // a gap: not one mapped range
      }
      found.emplace_back(h->second.handle, h->second.bytes);
      next = h->first + h->second.bytes;
    }
    out.insert(out.end(), found.begin(), found.end());
    return offset;
  }

  /// Whether a handle or a stale alias is mapped in [base, base + bytes).
  [[nodiscard]] bool any_mapped_in(std::uintptr_t base, std::size_t bytes) const {
    const auto h = by_address_.lower_bound(base);
    if (h != by_address_.end() && h->first < base + bytes) {
      return true;
    }
    return std::any_of(stale.begin(), stale.end(), [&](const vm_alias& m) {
      return m.address >= base && m.address < base + bytes;
    });
  }

  std::vector<vm_alias> stale;                   ///< retired aliases to unmap later
  held_bytes mapped_bytes;                       ///< physical memory held, and its peak
  bool device_full = false;                      ///< the last create found the device full

 private:
  [[nodiscard]] bool aligned(std::uintptr_t address, std::size_t bytes) const noexcept {
    return uniform_ != 0 && bytes == uniform_ && address % uniform_ == 0;
  }

  map_type by_address_;         ///< current address -> handle
  std::size_t uniform_;         ///< the resource's handle size (0: unknown)
  std::size_t unaligned_ = 0;   ///< handles of another size, or not at a multiple of it
};

}  // namespace cudamem::detail
