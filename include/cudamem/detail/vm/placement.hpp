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
// - A synchronous request prefers an idle range (no host wait) to a pending one.
// - When no range holds a block, the smallest run of adjacent ranges (freed on different
//   streams) that does: waiting for those streams merges it (vm_resource does the waiting).
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

/// The stream a request is ordered on, for recycling (compactor.hpp's make_room): none for
/// the synchronous form; otherwise the stream's tag (stream_tag.hpp: a per-thread stream's is
/// its thread's), the legacy default stream (0) included.
[[nodiscard]] inline std::optional<cudaStream_t> ordered_on(cudaStream_t tag, bool sync) noexcept {
  return sync ? std::nullopt : std::optional<cudaStream_t>{tag};
}

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
[[nodiscard]] inline std::optional<vm_fit> best_fit(const free_range_index& free,
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

/// When no free range holds the request: the smallest run of address-adjacent free ranges that
/// does, or nullopt. Such a run is ranges freed on different streams, kept apart while both are
/// pending; once the host has waited for their streams they are one range. That is cheaper
/// than a compaction, which would wait for the streams of the handles it moves, and move them.
[[nodiscard]] inline std::optional<vm_placement> best_run(const free_range_index& free,
                                                         const handle_set& handles,
                                                         const vm_request& r) {
  std::optional<vm_placement> best;
  if (free.adjacent_pairs() == 0) {
    // Every run is one range (the usual case): the best run is the best fit, found by size
    // without walking the whole index.
    if (const auto fit = best_fit(free, handles, r)) {
      best = vm_placement{fit->range, fit->range + free.find(fit->range)->second.bytes};
    }
    return best;
  }
  free.for_each_run([&](std::uintptr_t begin, std::uintptr_t end) {
    if (end - begin < r.needed || (best && end - begin >= best->end - best->start)) {
      return;
    }
    if (place(handles, begin, end, r)) {
      best = vm_placement{begin, end};
    }
  });
  return best;
}

}  // namespace cudamem::detail
