// cudamem/detail/pool/block_cache.hpp — the front end of pool_resource: blocks just freed, kept
// whole in last-in-first-out stacks by size class, so that the next request of about the same
// size takes one in O(1) without searching, splitting or merging in the TLSF heap behind it.
//
//   cudamem::detail::block_cache<block> cache{256};     // sizes are multiples of 256
//   cache.push(b);                                      // b stays "in use" for the heap
//   block* again = cache.pop(size, alignment - 1);      // size <= again->size <= size + size/8
//   cache.drain([&](block* c) { heap.free(c); });       // flush: merge them back
//   cache.drain_until([&](block* c) { return heap.free(c)->size >= n; });  // until room for n
//   block* mine = cache.pop_if(size, alignment - 1, [&](const block& c) { return ok(c); }, 8);
//
// Why (for a student)
// - Programs free and allocate the same few sizes over and over. A general heap pays for that
//   every time: find a block, split it, and on free look up its neighbours and merge. A cache
//   of whole blocks skips all of it, if a cached block is close enough in size to the next
//   request. Blocks are filed by size class: below 32 granules every size is its own class,
//   above it each power of two is split into 16 classes (2^`steps_log2`). A request looks at
//   the top of its own class's stack (taken if at least as large) and of the next two classes
//   up (taken if at most 1/8 larger than the request), so a block from the cache wastes less than 1/8
//   (12.5 %) of the request, and blocks that come from the heap waste nothing.
// - Cached blocks are "in use" as far as the heap knows: they are not merged with their free
//   neighbours, so the owner flushes the cache (drain) before it concludes that the heap has
//   no room, and before it looks for wholly free chunks to return upstream.
// - The stacks are intrusive (linked through the block's `next_cached`), so push and pop never
//   allocate and cannot fail.
//
// Contract
// - `Block` has `std::size_t size` (a multiple of the granule), `std::uintptr_t address`,
//   `Block* next_cached` and `bool cached`; push sets `cached`, pop and drain clear it (the
//   owner's double-free check).
// - pop(size, mask) returns a block b with size <= b->size <= size + size / 8 and
//   (b->address & mask) == 0, or nullptr; it looks at three blocks at most.
// - pop_if(size, mask, wanted, depth) returns a block pop could have returned had it been on
//   top, for which wanted(b) holds, looking `depth` blocks deep into each of the same three
//   stacks; or nullptr. (pool_resource: a block another stream freed is on top, and a block
//   freed on the requesting stream a little further down needs no wait.)
// - Not thread-safe: the owner locks. Counts and bytes are exact at every moment.
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>

namespace cudamem::detail {

template <class Block>
class block_cache {
 public:
  static constexpr unsigned steps_log2 = 4;  ///< 16 classes per power of two
  static constexpr std::size_t exact_below = std::size_t{2} << steps_log2;  ///< in granules
  static constexpr std::size_t class_count = std::size_t{64 - steps_log2 + 1} << steps_log2;
  /// How many classes above its own a request looks at (blocks there are at most 1/8 larger).
  static constexpr std::size_t classes_above = 2;

  explicit block_cache(std::size_t granule) noexcept
      : granule_log2_(static_cast<unsigned>(std::countr_zero(granule))) {}

  /// The stack a block of `units` granules lives in: units itself below exact_below, then 16
  /// consecutive stacks per power of two (the class is the top 1 + steps_log2 bits).
  [[nodiscard]] static constexpr std::size_t class_index(std::size_t units) noexcept {
    if (units < exact_below) {
      return units;
    }
    const auto msb = static_cast<unsigned>(std::bit_width(units)) - 1U;
    return (std::size_t{msb - steps_log2 + 1} << steps_log2) |
           ((units >> (msb - steps_log2)) & ((std::size_t{1} << steps_log2) - 1));
  }

  [[gnu::always_inline]] void push(Block* b) noexcept {
    const std::size_t index = class_index(b->size >> granule_log2_);
    b->cached = true;
    b->next_cached = heads_[index];
    heads_[index] = b;
    bytes_ += b->size;
    ++count_;
    top_index_ = index > top_index_ ? index : top_index_;
  }

  /// A cached block of `size` to `size + size / 8` bytes whose address & mask is 0, or nullptr.
  [[nodiscard]] Block* pop(std::size_t size, std::uintptr_t address_mask) noexcept {
    const std::size_t index = class_index(size >> granule_log2_);
    if (index > top_index_) {
      return nullptr;
    }
    Block* b = heads_[index];
    if (b != nullptr && b->size >= size && (b->address & address_mask) == 0) {
      return unlink(index);
    }
    // Every block of the next classes is larger: take one if it is close enough.
    const std::size_t last = index + classes_above < top_index_ ? index + classes_above : top_index_;
    for (std::size_t next = index + 1; next <= last; ++next) {
      b = heads_[next];
      if (b != nullptr && b->size - size <= size / 8 && (b->address & address_mask) == 0) {
        return unlink(next);
      }
    }
    return nullptr;
  }

  /// A block as pop would take, but only one for which `wanted(const Block&)` holds, found up
  /// to `depth` blocks down each stack pop looks at; nullptr when there is none. The stacks
  /// keep their order otherwise.
  template <class Wanted>
  [[nodiscard]] Block* pop_if(std::size_t size, std::uintptr_t address_mask, Wanted&& wanted,
                              unsigned depth) noexcept {
    const std::size_t index = class_index(size >> granule_log2_);
    if (index > top_index_) {
      return nullptr;
    }
    const std::size_t last = index + classes_above < top_index_ ? index + classes_above : top_index_;
    for (std::size_t i = index; i <= last; ++i) {
      Block** link = &heads_[i];
      for (unsigned seen = 0; *link != nullptr && seen < depth; ++seen) {
        Block* b = *link;
        const bool fits = i == index ? b->size >= size : b->size - size <= size / 8;
        if (fits && (b->address & address_mask) == 0 && wanted(static_cast<const Block&>(*b))) {
          *link = b->next_cached;
          b->next_cached = nullptr;
          b->cached = false;
          bytes_ -= b->size;
          --count_;
          return b;
        }
        link = &b->next_cached;
      }
    }
    return nullptr;
  }

  /// Empties the cache, handing every block to `f(Block*)` (which must not throw).
  template <class F>
  void drain(F&& f) noexcept {
    if (count_ == 0) {
      return;
    }
    for (std::size_t i = 0; i <= top_index_; ++i) {
      for (Block* b = heads_[i]; b != nullptr;) {
        Block* next = b->next_cached;
        b->next_cached = nullptr;
        b->cached = false;
        f(b);
        b = next;
      }
      heads_[i] = nullptr;
    }
    bytes_ = 0;
    count_ = 0;
    top_index_ = 0;
  }

  /// Hands cached blocks to `f(Block*) -> bool` (which must not throw), largest classes first,
  /// until f returns true; returns false when the cache ran empty first. (An owner that wants
  /// room for one request need not give up the whole cache for it.)
  template <class F>
  bool drain_until(F&& f) noexcept {
    for (std::size_t i = top_index_ + 1; i-- > 0;) {
      while (heads_[i] != nullptr) {
        top_index_ = i;  // every stack above i is empty now
        if (f(unlink(i))) {
          return true;
        }
      }
    }
    top_index_ = 0;
    return false;
  }

  [[nodiscard]] std::size_t bytes() const noexcept { return bytes_; }
  [[nodiscard]] std::size_t count() const noexcept { return count_; }

  /// The largest cached block (0 when empty): looks through the top non-empty stack.
  [[nodiscard]] std::size_t largest() const noexcept {
    for (std::size_t i = top_index_ + 1; i-- > 0;) {
      std::size_t largest = 0;
      for (const Block* b = heads_[i]; b != nullptr; b = b->next_cached) {
        largest = b->size > largest ? b->size : largest;
      }
      if (largest != 0) {
        return largest;
      }
    }
    return 0;
  }

 private:
  Block* unlink(std::size_t index) noexcept {
    Block* b = heads_[index];
    heads_[index] = b->next_cached;
    b->next_cached = nullptr;
    b->cached = false;
    bytes_ -= b->size;
    --count_;
    return b;
  }

  unsigned granule_log2_;
  Block* heads_[class_count] = {};
  std::size_t bytes_ = 0;
  std::size_t count_ = 0;
  std::size_t top_index_ = 0;  ///< no stack above this index is non-empty
};

}  // namespace cudamem::detail
