// cudamem/detail/pool/tlsf_heap.hpp — a two-level segregated fit (TLSF) heap over address ranges
// whose bytes it never touches: the free-block index behind pool_resource (and any allocator
// that carves blocks out of device memory, which the host cannot read).
//
//   cudamem::detail::tlsf_heap<> heap{256};                  // every block a multiple of 256 B
//   auto* region = heap.add_region(base, 64 << 20);          // 64 MiB at `base` (not read)
//   auto* b = heap.allocate(1000, 256);                      // block of 1024 B, or nullptr
//   use(b->address);
//   heap.free(b);                                            // coalesces with free neighbours
//   if (heap.is_wholly_free(region)) heap.remove_region(region);  // give it back upstream
//
// How it works (for a student)
// - Every block (free or in use) is a host-side node (tlsf_nodes.hpp): address, size, its
//   neighbours in the same region and, when free, its place in a size-class list. The managed
//   memory is never read or written, so it may be device memory or a fake range.
// - Free blocks are binned in two levels: the power of two, then 32 equal classes within it.
//   One bit per non-empty list in two bitmaps makes "the smallest non-empty class that is large
//   enough" two find-first-set instructions: O(1) whatever the number of free blocks.
// - allocate() looks at a few blocks of the request's own class (one may fit exactly), then
//   takes the head of the next class up, where every block fits (TLSF's "good fit": at most
//   1/32 too large); the rest of the block stays free. free() merges with free neighbours at
//   once: no two free blocks are adjacent. A cut or merge that leaves a free block in its class
//   keeps its node and its place in its list (a large chunk's free tail: no relinking).
// - A caller may say which blocks it would rather have (pool_resource: one that needs no wait
//   for another stream's work): allocate(..., prefer, reach) looks further only when prefer()
//   refuses its usual pick (own class, then a few blocks of a few classes up, never more than
//   twice the request), taking the first block prefer() accepts, else the usual pick.
// - A region is one contiguous range (an upstream allocation). Blocks never merge across
//   regions, so a region whose one block is free can be handed back whole. extend_region()
//   grows a region at its end (a pool over a growable range); the new bytes merge.
//
// Contract
// - Sizes and addresses are multiples of `granule` (a power of two); region sizes round down.
// - allocate(bytes, alignment[, largest_split]) returns a block of exactly round_up(bytes,
//   granule) bytes aligned to `alignment` (a power of two), or nullptr when no free block
//   holds it; it throws only std::bad_alloc (nodes), leaving the heap unchanged.
// - free(b) takes a block allocate() returned and not yet freed; noexcept. Not thread-safe.
// - `Tag`: per-block data kept with free blocks (pool_resource: which streams' frees are
//   pending); default-constructible, copyable, with `void absorb(const Tag&)` (merged blocks
//   absorb each other's, split ones copy). `no_tag` is the empty default.
#pragma once

#include <cudamem/detail/pool/tlsf_nodes.hpp>
#include <cudamem/detail/unique_owner.hpp>

#include <algorithm>
#include <bit>
#include <cassert>
#include <cstddef>
#include <cstdint>
#include <limits>

namespace cudamem::detail {

template <class Tag = no_tag>
class tlsf_heap {
 public:
  using block = tlsf_block<Tag>;
  using region = tlsf_region<Tag>;

  static constexpr unsigned second_level_log2 = 5;
  static constexpr unsigned second_level_count = 1U << second_level_log2;
  static constexpr unsigned first_level_count = 64;
  /// How many blocks of the request's own class allocate() inspects before rounding up.
  static constexpr unsigned exact_class_probes = 8;

  explicit tlsf_heap(std::size_t granule = 256) : granule_(granule) {
    assert(std::has_single_bit(granule));
    granule_log2_ = static_cast<unsigned>(std::countr_zero(granule));
  }

  ~tlsf_heap() {
    for (region* r = regions_; r != nullptr;) {
      region* next = r->next;
      delete r;
      r = next;
    }
  }

  tlsf_heap(const tlsf_heap&) = delete;
  tlsf_heap& operator=(const tlsf_heap&) = delete;

  [[nodiscard]] std::size_t granule() const noexcept { return granule_; }

  /// Adds [base, base + size) as one free block. Returns the region (owned by the heap).
  region* add_region(std::uintptr_t base, std::size_t size, std::uint32_t owner = 0) {
    assert(base % granule_ == 0);
    size &= ~(granule_ - 1);
    assert(size > 0);
    nodes_.reserve(1);
    auto holder = detail::make_unique_owner<region>();
    region* r = holder.release();
    r->base = base;
    r->size = size;
    r->owner = owner;
    block* b = nodes_.take();
    b->address = base;
    b->size = size;
    b->region = r;
    b->tag = Tag{};
    r->first = r->last = b;
    r->next = regions_;
    if (regions_ != nullptr) {
      regions_->prev = r;
    }
    regions_ = r;
    ++region_count_;
    total_bytes_ += size;
    insert_free(b);
    return r;
  }

  /// Grows region `r` by `extra` bytes at its end (the caller made them usable). The new
  /// bytes merge with a free tail block.
  void extend_region(region* r, std::size_t extra) {
    extra &= ~(granule_ - 1);
    if (extra == 0) {
      return;
    }
    nodes_.reserve(1);
    block* tail = r->last;
    r->size += extra;
    total_bytes_ += extra;
    if (tail->free) {
      remove_free(tail);
      tail->size += extra;
      insert_free(tail);
      return;
    }
    block* b = nodes_.take();
    b->address = tail->address + tail->size;
    b->size = extra;
    b->region = r;
    b->tag = Tag{};
    b->prev_phys = tail;
    tail->next_phys = b;
    r->last = b;
    insert_free(b);
  }

  /// True when the whole region is one free block.
  [[nodiscard]] static bool is_wholly_free(const region* r) noexcept {
    return r->first == r->last && r->first->free;
  }

  /// Forgets a wholly free region (the caller then returns its memory).
  void remove_region(region* r) noexcept {
    assert(is_wholly_free(r));
    remove_free(r->first);
    nodes_.recycle(r->first);
    (r->prev != nullptr ? r->prev->next : regions_) = r->next;
    if (r->next != nullptr) {
      r->next->prev = r->prev;
    }
    total_bytes_ -= r->size;
    --region_count_;
    delete r;
  }

  /// The regions, newest first (a singly walked list: `for (r = first_region(); r; r = r->next)`).
  [[nodiscard]] region* first_region() const noexcept { return regions_; }
  [[nodiscard]] std::size_t region_count() const noexcept { return region_count_; }

  /// The wholly free regions (`for (r = first_idle_region(); r; r = r->next_idle)`): what a
  /// pool can hand back upstream, found without looking at the others.
  [[nodiscard]] region* first_idle_region() const noexcept { return idle_; }
  [[nodiscard]] std::size_t idle_region_count() const noexcept { return idle_count_; }

  /// A block of round_up(bytes, granule) bytes aligned to `alignment`, or nullptr. With
  /// `largest_split`, a free block larger than that is not cut (nullptr instead): the caller
  /// would rather get fresh memory than leave a large remainder pinned by a long-lived block.
  [[nodiscard]] block* allocate(std::size_t bytes, std::size_t alignment,
                                std::size_t largest_split = std::numeric_limits<std::size_t>::max()) {
    const std::size_t size = round_up(bytes);
    if (size == 0) {
      return nullptr;  // bytes == 0 or rounding overflowed: nothing can hold it
    }
    const std::size_t padding = alignment > granule_ ? alignment - granule_ : 0;
    if (size > std::numeric_limits<std::size_t>::max() - padding) {
      return nullptr;
    }
    nodes_.reserve(2);  // the two splits below must not fail half-way
    block* b = find_free(size + padding, size, alignment);
    if (b == nullptr || b->size > largest_split) {
      return nullptr;
    }
    return hand_out(b, size, alignment);
  }

  /// The same, but when `prefer(const block&)` refuses the usual pick, the first block within
  /// `reach` that it accepts (see the header comment and tlsf_reach); `*switched` (if given)
  /// says whether that happened.
  template <class Prefer>
  [[nodiscard]] block* allocate(std::size_t bytes, std::size_t alignment,
                                std::size_t largest_split, Prefer&& prefer, tlsf_reach reach,
                                bool* switched) {
    const std::size_t size = round_up(bytes);
    if (size == 0) {
      return nullptr;  // bytes == 0 or rounding overflowed: nothing can hold it
    }
    const std::size_t padding = alignment > granule_ ? alignment - granule_ : 0;
    if (size > std::numeric_limits<std::size_t>::max() - padding) {
      return nullptr;
    }
    nodes_.reserve(2);  // the two splits below must not fail half-way
    block* b = find_free(size + padding, size, alignment);
    if (b == nullptr || b->size > largest_split) {
      return nullptr;
    }
    const std::size_t twice = size + padding > std::numeric_limits<std::size_t>::max() / 2
                                  ? std::numeric_limits<std::size_t>::max()
                                  : 2 * (size + padding);
    const std::size_t cap =
        !reach.within_twice ? largest_split
                            : std::min(largest_split, reach.only ? twice : std::max(b->size, twice));
    if (b->size > cap || !prefer(static_cast<const block&>(*b))) {
      if (block* other = find_preferred(size + padding, size, alignment, cap, prefer, reach)) {
        b = other;
        if (switched != nullptr) {
          *switched = true;
        }
      } else if (reach.only) {
        return nullptr;
      }
    }
    return hand_out(b, size, alignment);
  }

  /// Returns a block; merges it with free neighbours. Returns the resulting free block.
  block* free(block* b) noexcept {
    assert(!b->free);
    block* below = b->prev_phys != nullptr && b->prev_phys->free ? b->prev_phys : nullptr;
    block* above = b->next_phys != nullptr && b->next_phys->free ? b->next_phys : nullptr;
    // One free neighbour whose size class the merge does not change: it absorbs b where it
    // is in its free list (no unlinking and relinking).
    if ((below == nullptr) != (above == nullptr)) {
      block* neighbour = below != nullptr ? below : above;
      if (same_class(neighbour->size, neighbour->size + b->size) &&
          (neighbour == below ? below->prev_phys != nullptr || b->next_phys != nullptr
                              : b->prev_phys != nullptr || above->next_phys != nullptr)) {
        absorb_in_place(neighbour, b);
        return neighbour;
      }
    }
    if (below != nullptr) {
      remove_free(below);
      below->tag.absorb(b->tag);
      merge_into(below, b);
      b = below;
    }
    if (above != nullptr) {
      remove_free(above);
      b->tag.absorb(above->tag);
      merge_into(b, above);
    }
    insert_free(b);
    return b;
  }

  // --- what it holds ------------------------------------------------------------------------

  [[nodiscard]] std::size_t total_bytes() const noexcept { return total_bytes_; }
  [[nodiscard]] std::size_t free_bytes() const noexcept { return free_bytes_; }
  [[nodiscard]] std::size_t free_block_count() const noexcept { return free_blocks_; }

  /// The largest free block: scans only the highest non-empty size class.
  [[nodiscard]] std::size_t largest_free_block() const noexcept {
    if (first_level_map_ == 0) {
      return 0;
    }
    const unsigned fl = 63U - static_cast<unsigned>(std::countl_zero(first_level_map_));
    const unsigned sl = 31U - static_cast<unsigned>(std::countl_zero(second_level_map_[fl]));
    std::size_t largest = 0;
    for (const block* b = heads_[fl][sl]; b != nullptr; b = b->next_free) {
      largest = b->size > largest ? b->size : largest;
    }
    return largest;
  }

  /// round_up(bytes, granule), or 0 when that overflows.
  [[nodiscard]] std::size_t round_up(std::size_t bytes) const noexcept {
    if (bytes > std::numeric_limits<std::size_t>::max() - (granule_ - 1)) {
      return 0;
    }
    return (bytes + granule_ - 1) & ~(granule_ - 1);
  }

 private:
  // --- size classes -------------------------------------------------------------------------

  struct size_class {
    unsigned first;
    unsigned second;
  };

  /// The class a block of `size` bytes is filed under.
  [[nodiscard]] size_class class_of(std::size_t size) const noexcept {
    const std::size_t units = size >> granule_log2_;
    if (units < second_level_count) {  // small blocks: one class per granule
      return {0, static_cast<unsigned>(units)};
    }
    const unsigned msb = 63U - static_cast<unsigned>(std::countl_zero(units));
    return {msb - second_level_log2 + 1,
            static_cast<unsigned>((units >> (msb - second_level_log2)) - second_level_count)};
  }

  /// The first class in which every block holds `size` bytes (`size` rounded up to a class
  /// boundary), or {first_level_count, 0} when there is none.
  [[nodiscard]] size_class class_holding(std::size_t size) const noexcept {
    std::size_t units = size >> granule_log2_;
    if (units >= second_level_count) {
      const unsigned msb = 63U - static_cast<unsigned>(std::countl_zero(units));
      const std::size_t step = std::size_t{1} << (msb - second_level_log2);
      units = (units + step - 1) & ~(step - 1);
    }
    if (units == 0 || units > (std::numeric_limits<std::size_t>::max() >> granule_log2_)) {
      return {first_level_count, 0};
    }
    return class_of(units << granule_log2_);
  }

  /// A free block that can hold `needed` bytes (`size` bytes at `alignment`), or nullptr.
  [[gnu::always_inline]] block* find_free(std::size_t needed, std::size_t size,
                                          std::size_t alignment) const noexcept {
    // Near best fit: a block of the request's own class may already be large enough.
    const size_class own = class_of(needed);
    unsigned probes = 0;
    for (block* b = heads_[own.first][own.second]; b != nullptr && probes < exact_class_probes;
         b = b->next_free, ++probes) {
      if (b->size >= size + aligned_offset(b->address, alignment)) {
        return b;
      }
    }
    // Good fit: the head of the first class whose every block is large enough.
    size_class c = class_holding(needed);
    if (c.first >= first_level_count) {
      return nullptr;
    }
    std::uint32_t second_map = second_level_map_[c.first] & (~std::uint32_t{0} << c.second);
    if (second_map == 0) {
      const std::uint64_t first_map =
          c.first + 1 >= first_level_count ? 0 : first_level_map_ & (~std::uint64_t{0} << (c.first + 1));
      if (first_map == 0) {
        return nullptr;
      }
      c.first = static_cast<unsigned>(std::countr_zero(first_map));
      second_map = second_level_map_[c.first];
    }
    c.second = static_cast<unsigned>(std::countr_zero(second_map));
    return heads_[c.first][c.second];
  }

  /// Cuts `size` bytes at `alignment` out of free block `b` (which holds them) and returns
  /// them as an in-use block; the rest stays free. Nodes for two splits are reserved.
  [[gnu::always_inline]] block* hand_out(block* b, std::size_t size, std::size_t alignment) noexcept {
    const std::size_t front = aligned_offset(b->address, alignment);
    if (front == 0 && b->size > size && !is_whole_region(b) &&
        same_class(b->size, b->size - size)) {
      return cut_below(b, size);  // the rest keeps b's node and its place in its list
    }
    remove_free(b);
    if (front != 0) {  // give the bytes below the aligned address back as a free block
      block* aligned = split(b, front);
      insert_free(b);
      b = aligned;
    }
    if (b->size > size) {
      insert_free(split(b, size));
    }
    return b;  // remove_free marked it in use
  }

  /// A free block that can hold `needed` bytes (`size` at `alignment`), of at most `cap`
  /// bytes, that `prefer` accepts: among the first blocks of the request's own class, then
  /// among the first `reach.depth` blocks of up to `reach.classes` non-empty classes from the
  /// first whose every block fits, upward. nullptr when none is found.
  template <class Prefer>
  block* find_preferred(std::size_t needed, std::size_t size, std::size_t alignment,
                        std::size_t cap, Prefer& prefer, tlsf_reach reach) const {
    const size_class own = class_of(needed);
    unsigned probes = 0;
    for (block* b = heads_[own.first][own.second]; b != nullptr && probes < exact_class_probes;
         b = b->next_free, ++probes) {
      if (b->size >= size + aligned_offset(b->address, alignment) && b->size <= cap &&
          prefer(static_cast<const block&>(*b))) {
        return b;
      }
    }
    size_class c = class_holding(needed);
    for (unsigned visited = 0; visited < reach.classes; ++visited) {
      c = first_nonempty_from(c);
      if (c.first >= first_level_count || class_floor(c) > cap) {
        return nullptr;
      }
      unsigned seen = 0;
      for (block* b = heads_[c.first][c.second]; b != nullptr && seen < reach.depth;
           b = b->next_free, ++seen) {
        if (b->size <= cap && prefer(static_cast<const block&>(*b))) {
          return b;
        }
      }
      c = c.second + 1 < second_level_count ? size_class{c.first, c.second + 1}
                                            : size_class{c.first + 1, 0};
    }
    return nullptr;
  }

  /// The first non-empty class at or above `c`, or {first_level_count, 0} when none is.
  [[nodiscard]] size_class first_nonempty_from(size_class c) const noexcept {
    if (c.first >= first_level_count) {
      return {first_level_count, 0};
    }
    std::uint32_t second_map = second_level_map_[c.first] & (~std::uint32_t{0} << c.second);
    if (second_map == 0) {
      const std::uint64_t first_map =
          c.first + 1 >= first_level_count ? 0 : first_level_map_ & (~std::uint64_t{0} << (c.first + 1));
      if (first_map == 0) {
        return {first_level_count, 0};
      }
      c.first = static_cast<unsigned>(std::countr_zero(first_map));
      second_map = second_level_map_[c.first];
    }
    c.second = static_cast<unsigned>(std::countr_zero(second_map));
    return c;
  }

  /// The smallest size a block of class `c` can have (class_of's inverse, rounded down).
  [[nodiscard]] std::size_t class_floor(size_class c) const noexcept {
    const std::size_t units = c.first == 0 ? std::size_t{c.second}
                                           : std::size_t{second_level_count + c.second} << (c.first - 1);
    return units << granule_log2_;
  }

  [[nodiscard]] static std::size_t aligned_offset(std::uintptr_t address,
                                                  std::size_t alignment) noexcept {
    return (alignment - (address & (alignment - 1))) & (alignment - 1);
  }

  // --- free lists ---------------------------------------------------------------------------

  void insert_free(block* b) noexcept {
    const size_class c = class_of(b->size);
    b->free = true;
    b->prev_free = nullptr;
    b->next_free = heads_[c.first][c.second];
    if (b->next_free != nullptr) {
      b->next_free->prev_free = b;
    }
    heads_[c.first][c.second] = b;
    first_level_map_ |= std::uint64_t{1} << c.first;
    second_level_map_[c.first] |= std::uint32_t{1} << c.second;
    free_bytes_ += b->size;
    ++free_blocks_;
    if (b->prev_phys == nullptr && b->next_phys == nullptr) {  // the region is wholly free
      region* r = b->region;
      r->prev_idle = nullptr;
      r->next_idle = idle_;
      if (idle_ != nullptr) {
        idle_->prev_idle = r;
      }
      idle_ = r;
      ++idle_count_;
    }
  }

  void remove_free(block* b) noexcept {
    const size_class c = class_of(b->size);
    if (b->prev_free != nullptr) {
      b->prev_free->next_free = b->next_free;
    } else {
      heads_[c.first][c.second] = b->next_free;
      if (b->next_free == nullptr) {
        second_level_map_[c.first] &= ~(std::uint32_t{1} << c.second);
        if (second_level_map_[c.first] == 0) {
          first_level_map_ &= ~(std::uint64_t{1} << c.first);
        }
      }
    }
    if (b->next_free != nullptr) {
      b->next_free->prev_free = b->prev_free;
    }
    b->free = false;
    free_bytes_ -= b->size;
    --free_blocks_;
    if (b->prev_phys == nullptr && b->next_phys == nullptr) {  // the region was wholly free
      region* r = b->region;
      (r->prev_idle != nullptr ? r->prev_idle->next_idle : idle_) = r->next_idle;
      if (r->next_idle != nullptr) {
        r->next_idle->prev_idle = r->prev_idle;
      }
      --idle_count_;
    }
  }

  // --- splitting and merging ----------------------------------------------------------------

  [[nodiscard]] static bool is_whole_region(const block* b) noexcept {
    return b->prev_phys == nullptr && b->next_phys == nullptr;
  }
  [[nodiscard]] bool same_class(std::size_t a, std::size_t b) const noexcept {
    const size_class ca = class_of(a);
    const size_class cb = class_of(b);
    return ca.first == cb.first && ca.second == cb.second;
  }

  /// Cuts `size` bytes off the bottom of free block `b` (not a whole region, and still in the
  /// same size class afterwards) as a new in-use block; b keeps the rest, staying in its list.
  block* cut_below(block* b, std::size_t size) noexcept {
    block* lower = nodes_.take();
    lower->address = b->address;
    lower->size = size;
    lower->region = b->region;
    lower->tag = b->tag;
    lower->prev_phys = b->prev_phys;
    lower->next_phys = b;
    if (lower->prev_phys != nullptr) {
      lower->prev_phys->next_phys = lower;
    } else {
      b->region->first = lower;
    }
    b->prev_phys = lower;
    b->address += size;
    b->size -= size;
    free_bytes_ -= size;
    return lower;
  }

  /// Merges in-use block `b` into its free address neighbour `n` (below or above it), whose
  /// size class stays the same and which does not become its whole region: n stays where it
  /// is in its free list.
  void absorb_in_place(block* n, block* b) noexcept {
    n->tag.absorb(b->tag);
    if (n == b->prev_phys) {
      n->next_phys = b->next_phys;
      if (n->next_phys != nullptr) {
        n->next_phys->prev_phys = n;
      } else {
        n->region->last = n;
      }
    } else {
      n->address = b->address;
      n->prev_phys = b->prev_phys;
      if (n->prev_phys != nullptr) {
        n->prev_phys->next_phys = n;
      } else {
        n->region->first = n;
      }
    }
    n->size += b->size;
    free_bytes_ += b->size;
    nodes_.recycle(b);
  }

  /// Cuts `b` (not in a free list) at `offset`; returns the upper part, linked after `b`.
  block* split(block* b, std::size_t offset) noexcept {
    block* upper = nodes_.take();
    upper->address = b->address + offset;
    upper->size = b->size - offset;
    upper->region = b->region;
    upper->tag = b->tag;
    upper->prev_phys = b;
    upper->next_phys = b->next_phys;
    if (upper->next_phys != nullptr) {
      upper->next_phys->prev_phys = upper;
    } else {
      b->region->last = upper;
    }
    b->next_phys = upper;
    b->size = offset;
    return upper;
  }

  /// Appends `upper` (b's next neighbour, not in a free list) to `b` and recycles its node.
  void merge_into(block* b, block* upper) noexcept {
    b->size += upper->size;
    b->next_phys = upper->next_phys;
    if (b->next_phys != nullptr) {
      b->next_phys->prev_phys = b;
    } else {
      b->region->last = b;
    }
    nodes_.recycle(upper);
  }

  std::size_t granule_;
  unsigned granule_log2_ = 0;
  std::uint64_t first_level_map_ = 0;
  std::uint32_t second_level_map_[first_level_count] = {};
  block* heads_[first_level_count][second_level_count] = {};
  region* regions_ = nullptr;
  std::size_t region_count_ = 0;
  region* idle_ = nullptr;
  std::size_t idle_count_ = 0;
  std::size_t total_bytes_ = 0;
  std::size_t free_bytes_ = 0;
  std::size_t free_blocks_ = 0;
  tlsf_node_store<block> nodes_;  ///< every block's node (tlsf_nodes.hpp)
};

}  // namespace cudamem::detail
