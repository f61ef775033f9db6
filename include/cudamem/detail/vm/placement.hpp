// cudamem/detail/vm/placement.hpp — where vm_resource puts a block: which free range, and
// where inside it.
//
//   auto fit = best_fit(free, handles, {size, needed, alignment, whole, granule});
//   if (fit) { ... carve fit->spot out of the range at fit->range ... }
//
// What it owns: the placement policy, nothing else (no state).
// - Best fit: the smallest free range of at least `needed` bytes in which the block can be
//   placed (ranges are walked up by size; a range large enough may still not hold a block of
//   whole handles, then the next one is tried).
// - A block of a handle or more (`whole`) gets whole handles: it starts at a handle's start
//   and ends at a handle's end, so that once freed all of its physical memory can be
//   recycled (the rest of its last handle is waste while it lives).
// - Smaller blocks, and blocks with an alignment above the granule, go at granule precision
//   at the start of the range, so best fit packs them into handles already shared.
#pragma once

#include <cudamem/detail/vm/free_ranges.hpp>
#include <cudamem/detail/vm/handle_set.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <optional>

namespace cudamem::detail {

/// A request as placement sees it.
struct vm_request {
  std::size_t size;       ///< bytes, rounded up to the granule
  std::size_t needed;     ///< size plus what the alignment may cost
  std::size_t alignment;
  bool whole;             ///< whole handles (see above)
  std::size_t granule;

  /// Whether a block of `size` (a granule multiple) at `alignment` gets whole handles.
  [[nodiscard]] static constexpr bool whole_handles(std::size_t size, std::size_t alignment,
                                                    std::size_t handle,
                                                    std::size_t granule) noexcept {
    return size >= handle && alignment <= granule;
  }
};

/// A place found: the free range's address, and the block's span inside it.
struct vm_fit {
  std::uintptr_t range;
  vm_placement spot;
};

/// Where the request goes inside the free range [begin, end), or nullopt.
[[nodiscard]] inline std::optional<vm_placement> place(const handle_set& handles,
                                                      std::uintptr_t begin, std::uintptr_t end,
                                                      const vm_request& r) {
  if (r.whole) {
    return handles.place_whole(begin, end, r.size);
  }
  const std::size_t unit = std::max(r.alignment, r.granule);
  const std::uintptr_t start = (begin + unit - 1) / unit * unit;
  if (start + r.size > end) {
    return std::nullopt;
  }
  return vm_placement{start, start + r.size};
}

/// The best-fitting free range for the request, or nullopt when none holds it. With
/// `prefer_idle` (a synchronous request, which would wait on the host for a range's pending
/// frees), the best-fitting idle range, and a pending one only when no idle one holds it.
[[nodiscard]] inline std::optional<vm_fit> best_fit(free_range_index& free,
                                                   const handle_set& handles,
                                                   const vm_request& r,
                                                   bool prefer_idle = false) {
  std::optional<vm_fit> pending;
  for (auto it = free.smallest_from(r.needed); it != free.size_end(); ++it) {
    if (const auto spot = place(handles, it->second, it->second + it->first, r)) {
      if (!prefer_idle || free.find(it->second)->second.complete) {
        return vm_fit{it->second, *spot};
      }
      if (!pending) {
        pending = vm_fit{it->second, *spot};
      }
    }
  }
  return pending;
}

}  // namespace cudamem::detail
