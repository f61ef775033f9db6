// cudamem/detail/pool/address_map.hpp — a small open-addressing hash map from a non-zero address
// to a pointer: how a pool finds the host-side record of a block from the pointer the user
// gives back (the block's own memory may be device memory, which the host cannot read).
//
//   cudamem::detail::address_map<node> live;
//   live.insert(address, n);          // address != 0
//   node* n = live.erase(address);    // nullptr when it was not there
//
// Linear probing in a power-of-two table kept at most half full, Fibonacci hashing (addresses
// are multiples of 256, so their low bits carry nothing), and deletion by shifting later
// entries back (no tombstones: the table never degrades however many inserts and erases).
// Not thread-safe: the owner locks.
#pragma once

#include <cudamem/detail/unique_owner.hpp>

#include <bit>
#include <cstddef>
#include <cstdint>

namespace cudamem::detail {

template <class T>
class address_map {
 public:
  address_map() = default;
  address_map(const address_map&) = delete;
  address_map& operator=(const address_map&) = delete;

  [[nodiscard]] std::size_t size() const noexcept { return size_; }

  /// Makes room for one more entry; throws std::bad_alloc (and changes nothing) on failure.
  void reserve_one() {
    if ((size_ + 1) * 2 > capacity_) {
      rehash(capacity_ == 0 ? 64 : capacity_ * 2);
    }
  }

  /// Adds `key` (not present, non-zero). Call reserve_one() first.
  void insert(std::uintptr_t key, T* value) noexcept {
    std::size_t i = home(key);
    while (slots_[i].key != 0) {
      i = (i + 1) & mask_;
    }
    slots_[i] = {key, value};
    ++size_;
  }

  [[nodiscard]] T* find(std::uintptr_t key) const noexcept {
    if (capacity_ == 0) {
      return nullptr;
    }
    for (std::size_t i = home(key);; i = (i + 1) & mask_) {
      if (slots_[i].key == key) {
        return slots_[i].value;
      }
      if (slots_[i].key == 0) {
        return nullptr;
      }
    }
  }

  /// Removes `key`; returns its value, or nullptr when it was not there.
  T* erase(std::uintptr_t key) noexcept {
    if (capacity_ == 0) {
      return nullptr;
    }
    std::size_t i = home(key);
    while (slots_[i].key != key) {
      if (slots_[i].key == 0) {
        return nullptr;
      }
      i = (i + 1) & mask_;
    }
    T* value = slots_[i].value;
    // Backward-shift: move later entries of the probe run into the hole when their home
    // position allows it, so lookups never need tombstones.
    std::size_t hole = i;
    for (std::size_t j = (i + 1) & mask_; slots_[j].key != 0; j = (j + 1) & mask_) {
      const std::size_t h = home(slots_[j].key);
      const bool movable = hole <= j ? (h <= hole || h > j) : (h <= hole && h > j);
      if (movable) {
        slots_[hole] = slots_[j];
        hole = j;
      }
    }
    slots_[hole] = {};
    --size_;
    return value;
  }

  /// Calls f(key, value) for every entry.
  template <class F>
  void for_each(F&& f) const {
    for (std::size_t i = 0; i < capacity_; ++i) {
      if (slots_[i].key != 0) {
        f(slots_[i].key, slots_[i].value);
      }
    }
  }

 private:
  struct slot {
    std::uintptr_t key = 0;
    T* value = nullptr;
  };

  [[nodiscard]] std::size_t home(std::uintptr_t key) const noexcept {
    return static_cast<std::size_t>((static_cast<std::uint64_t>(key) * 0x9E3779B97F4A7C15ULL) >>
                                    shift_);
  }

  void rehash(std::size_t capacity) {
    auto fresh = detail::make_unique_owner<slot[]>(capacity);
    detail::unique_owner<slot[]> old = std::move(slots_);
    const std::size_t old_capacity = capacity_;
    slots_ = std::move(fresh);
    capacity_ = capacity;
    mask_ = capacity - 1;
    shift_ = 64U - static_cast<unsigned>(std::countr_zero(capacity));
    size_ = 0;
    for (std::size_t i = 0; i < old_capacity; ++i) {
      if (old[i].key != 0) {
        insert(old[i].key, old[i].value);
      }
    }
  }

  detail::unique_owner<slot[]> slots_;
  std::size_t capacity_ = 0;
  std::size_t mask_ = 0;
  unsigned shift_ = 64;
  std::size_t size_ = 0;
};

}  // namespace cudamem::detail
