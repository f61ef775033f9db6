// cudamem/detail/vm/free_ranges.hpp — vm_resource's index of free ranges: mapped memory that
// is not handed out, by address (to merge neighbours) and by size (best fit).
//
//   free_range_index free;
//   free.insert(address, {bytes, stream, false});       // merges with free neighbours
//   auto fit = free.smallest_from(needed);              // best fit: walk up by size
//   free.cut(address, bytes, pending_streams);          // a handle leaves: cut it out
//
// What it owns. Each free range carries a tag: the stream its last free was recorded on, and
// whether it is `complete` (no work may still touch it: a synchronous free, or the host
// waited). Tags decide merging: two address neighbours merge when they were freed on the same
// stream or one of them is complete, and the merged range then waits for the other's stream —
// never less than needed. Ranges freed on different streams, both pending, stay apart, so a
// request on one stream never waits for another's work without cause; once the host has
// waited for a stream (mark_complete), its ranges are idle and merge with their neighbours.
// The index does not know about handles or the frontier: vm_resource and the compactor
// (detail/vm/compactor.hpp) decide what to take; this keeps both orders exact. It also counts
// the places where one free range ends where another begins (`adjacent_pairs`): ranges kept
// apart by their tags. Usually there are none, and then no run of several ranges can serve a
// request that no single range could: vm_resource skips that walk of the whole index, which
// it would otherwise pay before every compaction.
//
// Not thread-safe: vm_resource's mutex guards it.
#pragma once

#include <cudamem/detail/spare_nodes.hpp>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <iterator>
#include <map>
#include <set>
#include <utility>
#include <vector>

namespace cudamem::detail {

/// A free range: mapped, not handed out. `stream` is where its last free was recorded;
/// `complete` means no work may still touch it.
struct free_range {
  std::size_t bytes;
  cudaStream_t stream;
  bool complete;
};

class free_range_index {
 public:
  using by_address = std::map<std::uintptr_t, free_range>;
  using by_size = std::set<std::pair<std::size_t, std::uintptr_t>>;

  [[nodiscard]] std::size_t count() const noexcept { return by_address_.size(); }
  /// How many free ranges end where the next one begins (neighbours kept apart by their tags).
  [[nodiscard]] std::size_t adjacent_pairs() const noexcept { return adjacent_pairs_; }
  [[nodiscard]] std::size_t largest() const noexcept {
    return by_size_.empty() ? 0 : by_size_.rbegin()->first;
  }

  [[nodiscard]] by_address::iterator begin() noexcept { return by_address_.begin(); }
  [[nodiscard]] by_address::iterator end() noexcept { return by_address_.end(); }
  [[nodiscard]] by_address::iterator find(std::uintptr_t address) {
    return by_address_.find(address);
  }
  [[nodiscard]] by_address::const_iterator find(std::uintptr_t address) const {
    return by_address_.find(address);
  }

  /// Free ranges of at least `bytes`, smallest first (best fit walks up from here).
  [[nodiscard]] by_size::const_iterator smallest_from(std::size_t bytes) const {
    return by_size_.lower_bound({bytes, 0});
  }
  [[nodiscard]] by_size::const_iterator size_end() const noexcept { return by_size_.end(); }

  /// Inserts a free range, merging it with mergeable address neighbours. A merge reuses the
  /// neighbour's nodes (a free next to free memory, the common case, allocates nothing).
  void insert(std::uintptr_t address, free_range range) {
    const auto next = by_address_.find(address + range.bytes);
    const bool with_next = next != by_address_.end() && mergeable(range, next->second);
    if (with_next) {
      range = merged(range, next->second);
    }
    const auto after = with_next ? next : by_address_.lower_bound(address);
    if (after != by_address_.begin()) {
      const auto prev = std::prev(after);
      if (prev->first + prev->second.bytes == address && mergeable(prev->second, range)) {
        if (with_next) {
          erase(next);
        }
        resize(prev, prev->first, merged(prev->second, range));
        return;
      }
    }
    if (with_next) {
      resize(next, address, range);
      return;
    }
    insert_unmerged(address, range);
  }

  /// Inserts a range as it is (a remnant of a range just taken apart: its neighbours were not
  /// mergeable with the whole, and are not with the part).
  void insert_unmerged(std::uintptr_t address, free_range range) {
    const auto sized = spare_sizes_.insert(by_size_, std::pair{range.bytes, address});
    by_address::iterator it;
    try {
      it = spare_addresses_.insert(by_address_, address, range);
    } catch (...) {  // out of host memory: the index stays as it was
      spare_sizes_.erase(by_size_, sized);
      throw;
    }
    adjacent_pairs_ += touching_neighbours(it);
  }

  /// Removes the range at `it` (its nodes are kept for the next inserts).
  void erase(by_address::iterator it) noexcept {
    adjacent_pairs_ -= touching_neighbours(it);
    spare_sizes_.keep(by_size_.extract({it->second.bytes, it->first}));
    spare_addresses_.erase(by_address_, it);
  }

  /// Takes [start, end) out of the free range at `node`; the remnants on either side keep its
  /// tag. The caller has checked that the range holds [start, end).
  void carve(by_address::iterator node, std::uintptr_t start, std::uintptr_t end) {
    const std::uintptr_t address = node->first;
    const free_range range = node->second;
    erase(node);
    if (start > address) {
      insert_unmerged(address, {start - address, range.stream, range.complete});
    }
    if (end < address + range.bytes) {
      insert_unmerged(end, {address + range.bytes - end, range.stream, range.complete});
    }
  }

  /// Cuts [begin, begin + bytes) out of every free range it overlaps (a handle being moved
  /// away); adds to `pending` each stream whose frees in it are not known complete.
  void cut(std::uintptr_t begin, std::size_t bytes, std::vector<cudaStream_t>& pending) {
    auto it = by_address_.upper_bound(begin);
    if (it != by_address_.begin()) {
      --it;
    }
    while (it != by_address_.end() && it->first < begin + bytes) {
      const std::uintptr_t b0 = it->first;
      const std::uintptr_t b1 = b0 + it->second.bytes;
      const free_range tag = it->second;
      if (b1 <= begin) {
        ++it;
        continue;
      }
      if (!tag.complete && std::find(pending.begin(), pending.end(), tag.stream) == pending.end()) {
        pending.push_back(tag.stream);
      }
      const auto next = std::next(it);
      erase(it);
      if (b0 < begin) {
        insert_unmerged(b0, {begin - b0, tag.stream, tag.complete});
      }
      if (b1 > begin + bytes) {
        insert_unmerged(begin + bytes, {b1 - begin - bytes, tag.stream, tag.complete});
      }
      it = next;
    }
  }

  /// The host has waited for the last free recorded on `stream`: every range freed on it is
  /// idle. They are marked complete, and merged with the neighbours they may merge with now
  /// (two pending streams' ranges that met stayed apart; once one is idle they are one range,
  /// and a request that needs both fits without a move).
  void mark_complete(cudaStream_t stream) noexcept {
    settle([stream](const free_range& r) { return r.stream == stream; });
  }

  /// The host has waited for every free: every range is idle (and merged with its neighbours).
  void mark_all_complete() noexcept {
    settle([](const free_range&) { return true; });
  }

  /// The streams whose frees in the ranges starting in [begin, end) are pending, each once.
  [[nodiscard]] std::vector<cudaStream_t> pending_streams(std::uintptr_t begin,
                                                          std::uintptr_t end) const {
    std::vector<cudaStream_t> streams;
    for (auto it = by_address_.lower_bound(begin); it != by_address_.end() && it->first < end;
         ++it) {
      if (!it->second.complete &&
          std::find(streams.begin(), streams.end(), it->second.stream) == streams.end()) {
        streams.push_back(it->second.stream);
      }
    }
    return streams;
  }

  /// The free range holding `address`, or end().
  [[nodiscard]] by_address::iterator containing(std::uintptr_t address) {
    auto it = by_address_.upper_bound(address);
    if (it == by_address_.begin()) {
      return by_address_.end();
    }
    --it;
    return address < it->first + it->second.bytes ? it : by_address_.end();
  }

  /// Where the free range that ends at `frontier` starts; 0 when none does.
  [[nodiscard]] std::uintptr_t start_of_range_ending_at(std::uintptr_t frontier) const {
    const auto after = by_address_.lower_bound(frontier);
    if (frontier == 0 || after == by_address_.begin()) {
      return 0;
    }
    const auto last = std::prev(after);
    return last->first + last->second.bytes == frontier ? last->first : 0;
  }

  /// The free range that ends at `frontier` (new mappings extend it), or end().
  [[nodiscard]] by_address::iterator ending_at(std::uintptr_t frontier) {
    if (frontier == 0) {
      return by_address_.end();
    }
    const auto after = by_address_.lower_bound(frontier);
    if (after == by_address_.begin()) {
      return by_address_.end();
    }
    const auto last = std::prev(after);
    return last->first + last->second.bytes == frontier ? last : by_address_.end();
  }

  /// Calls f(begin, end) for every maximal run of address-adjacent free ranges.
  template <class F>
  void for_each_run(F&& f) const {
    auto it = by_address_.begin();
    while (it != by_address_.end()) {
      const std::uintptr_t begin = it->first;
      std::uintptr_t end = begin + it->second.bytes;
      for (++it; it != by_address_.end() && it->first == end; ++it) {
        end += it->second.bytes;
      }
      f(begin, end);
    }
  }

 private:
  /// Gives the range at `it` a new start and tag, in place: both index nodes are reused.
  void resize(by_address::iterator it, std::uintptr_t address, free_range range) noexcept {
    adjacent_pairs_ -= touching_neighbours(it);
    auto sized = by_size_.extract({it->second.bytes, it->first});
    sized.value() = {range.bytes, address};
    by_size_.insert(std::move(sized));
    if (it->first != address) {
      auto node = by_address_.extract(it);
      node.key() = address;
      it = by_address_.insert(std::move(node)).position;
    }
    it->second = range;
    adjacent_pairs_ += touching_neighbours(it);
  }

  /// How many of `it`'s address neighbours touch it (0, 1 or 2).
  [[nodiscard]] std::size_t touching_neighbours(by_address::const_iterator it) const noexcept {
    std::size_t n = 0;
    if (it != by_address_.begin()) {
      const auto prev = std::prev(it);
      n += prev->first + prev->second.bytes == it->first ? 1 : 0;
    }
    const auto next = std::next(it);
    n += next != by_address_.end() && it->first + it->second.bytes == next->first ? 1 : 0;
    return n;
  }

  static bool mergeable(const free_range& a, const free_range& b) noexcept {
    return a.complete || b.complete || a.stream == b.stream;
  }
  static free_range merged(const free_range& a, const free_range& b) noexcept {
    const free_range& tag = a.complete ? b : a;
    return {a.bytes + b.bytes, tag.stream, a.complete && b.complete};
  }

  /// Marks complete every range `idle` says the host has waited for, then merges address
  /// neighbours that may merge now. Reuses the size index's nodes: allocates nothing.
  template <class Idle>
  void settle(Idle&& idle) noexcept {
    for (auto& [address, range] : by_address_) {
      if (!range.complete && idle(range)) {
        range.complete = true;
      }
    }
    for (auto it = by_address_.begin(); it != by_address_.end(); ++it) {
      for (auto next = std::next(it); next != by_address_.end() &&
                                      it->first + it->second.bytes == next->first &&
                                      mergeable(it->second, next->second);
           next = std::next(it)) {
        auto node = by_size_.extract({it->second.bytes, it->first});
        spare_sizes_.keep(by_size_.extract({next->second.bytes, next->first}));
        it->second = merged(it->second, next->second);
        spare_addresses_.erase(by_address_, next);
        --adjacent_pairs_;  // the pair merged; `it` now touches what `next` touched
        node.value() = {it->second.bytes, it->first};
        by_size_.insert(std::move(node));
      }
    }
  }

  by_address by_address_;
  by_size by_size_;
  std::size_t adjacent_pairs_ = 0;  ///< see adjacent_pairs()
  // Nodes of erased ranges, reused by the next inserts: a block carved out of a free range
  // and freed again (the steady state of a trace) allocates nothing.
  spare_nodes<by_address> spare_addresses_;
  spare_nodes<by_size> spare_sizes_;
};

}  // namespace cudamem::detail
