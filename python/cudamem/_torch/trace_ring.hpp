// cudamem/_torch/trace_ring.hpp — the allocator's history for memory snapshots: the last N
// events (allocations, frees, out-of-memory errors...), oldest first.
//
//   trace_ring<event> ring;
//   ring.set_capacity(100000);        // torch.cuda.memory._record_memory_history(max_entries=...)
//   ring.push(event{...});            // past the capacity, the oldest event is overwritten
//   for (const event& e : ring.entries()) { ... }   // oldest first
//
// Why a ring: a long run records millions of events and a snapshot wants the recent ones; the
// memory they take is bounded by the capacity the user chose. Not thread-safe: the allocator's
// lock guards it.
#pragma once

#include <algorithm>
#include <cstddef>
#include <utility>
#include <vector>

namespace cudamem::torch_bridge {

template <class Entry>
class trace_ring {
 public:
  /// At most `n` entries (at least 1). Entries beyond a smaller capacity are dropped, oldest
  /// first.
  void set_capacity(std::size_t n) {
    n = std::max<std::size_t>(n, 1);
    if (n < entries_.size()) {
      std::vector<Entry> kept = entries();
      kept.erase(kept.begin(), kept.end() - static_cast<std::ptrdiff_t>(n));
      entries_ = std::move(kept);
      next_ = 0;
    }
    capacity_ = n;
  }
  [[nodiscard]] std::size_t capacity() const noexcept { return capacity_; }

  void push(Entry e) {
    if (entries_.size() < capacity_) {
      entries_.push_back(std::move(e));
      return;
    }
    entries_[next_] = std::move(e);
    next_ = (next_ + 1) % capacity_;
  }

  /// Every entry, oldest first.
  [[nodiscard]] std::vector<Entry> entries() const {
    std::vector<Entry> out;
    out.reserve(entries_.size());
    for (std::size_t i = 0; i < entries_.size(); ++i) {
      out.push_back(entries_[(next_ + i) % entries_.size()]);
    }
    return out;
  }
  [[nodiscard]] std::size_t size() const noexcept { return entries_.size(); }

  void clear() noexcept {
    entries_.clear();
    next_ = 0;
  }

 private:
  std::vector<Entry> entries_;
  std::size_t capacity_ = 1;
  std::size_t next_ = 0;  ///< where the next entry goes once full (the oldest entry)
};

}  // namespace cudamem::torch_bridge
