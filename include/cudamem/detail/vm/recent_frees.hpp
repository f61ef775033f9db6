// cudamem/detail/vm/recent_frees.hpp — vm_resource's blocks of whole handles freed last, kept
// aside as they are for the next request of their size on their stream, before they go back
// among the free ranges.
//
//   detail::recent_frees recent{16};                       // at most 16 blocks; 0: none
//   if (recent.full()) { put_back(recent.oldest()); recent.drop_oldest(); }
//   recent.put({address, bytes, stream, complete, record});
//   auto hit = recent.take(bytes, stream, /*sync=*/false);  // newest first; nullopt: none
//   recent.drain([&](const recent_free& f) { put_back(f); });  // all back, oldest first
//
// Why. A training step frees and allocates the same large tensors again and again, each time
// on the same stream. Through the free ranges, such a free is a merge into two ordered trees
// (by address and by size) and the allocation a best-fit walk and a carve in both, plus an
// erase and an insert of the live block's record: most of what a large block costs the host
// beyond a small one. Kept here, the free is a few stores and the allocation a scan of a few
// cache lines; the live block's record stays where it is, flagged. On a PyTorch training
// loop's log (`bench_capi_replay_cost bench/traces/train_b26.log`: the C API's stack, 4 MiB
// handles, a simulated device; 2026-11-29), 54% of the allocations of 4 MiB or more took a
// block kept here (16 of them, at most 1/16 of what is mapped: options.hpp says why the
// bound), and the instructions per call (callgrind; for frees, the simulated layer's own
// bookkeeping left out) went from 1321 to 1028 for such an allocation, from 1094 to 840 for
// such a free, against 616 and 418 for the smaller ones (recent_frees=0, then the default).
//
// What it owns: which blocks are kept and in what order; nothing about free memory. The rule
// for who may take one is the free ranges' stream rule, restricted to what needs no wait: a
// block freed on stream s goes to a request on s (stream order), a block freed synchronously
// (complete) to any request. A request on another stream, or a synchronous request for a
// block whose free is pending, does not find it here; it finds it among the free ranges once
// they are put back (vm_live_blocks::flush_recent), and then waits as the ranges' tags say.
// At most `capacity` blocks, in the order they were freed; a block taken leaves no gap (the
// shorter side of it moves over); a free when it is full first has the oldest block put back
// (the caller does: put_back above). Everything here is O(1) but `take`, a scan of the sizes
// only, newest first (one array: 16 of them are two cache lines), and its closing of the gap.
//
// Not thread-safe: vm_resource's mutex guards it. Allocates only at construction.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <optional>
#include <vector>

namespace cudamem::detail {

/// A block kept aside: where it is, its size as placed, the stream it was freed on, whether
/// its free is complete (synchronous), and its owner's record of it (opaque here).
struct recent_free {
  std::uintptr_t address = 0;
  std::size_t bytes = 0;  ///< as placed; never 0
  cudaStream_t stream = nullptr;
  bool complete = false;
  void* record = nullptr;
};

class recent_frees {
 public:
  /// Keeps at most `capacity` blocks (0: none). Throws std::bad_alloc.
  explicit recent_frees(std::size_t capacity) : bytes_(capacity, 0), slots_(capacity) {}

  recent_frees(const recent_frees&) = delete;
  recent_frees& operator=(const recent_frees&) = delete;

  [[nodiscard]] std::size_t capacity() const noexcept { return bytes_.size(); }
  /// Blocks kept now.
  [[nodiscard]] std::size_t count() const noexcept { return count_; }
  [[nodiscard]] bool empty() const noexcept { return count_ == 0; }
  /// Their bytes, as placed.
  [[nodiscard]] std::size_t bytes() const noexcept { return bytes_kept_; }
  /// Whether put() needs drop_oldest() first.
  [[nodiscard]] bool full() const noexcept { return count_ == bytes_.size(); }
  /// The oldest block kept (not empty()).
  [[nodiscard]] const recent_free& oldest() const noexcept { return slots_[head_]; }

  /// Keeps `f` (bytes not 0) as the newest; not full(), nor capacity 0.
  void put(const recent_free& f) noexcept {
    const std::size_t tail = at(count_);
    bytes_[tail] = f.bytes;
    slots_[tail] = f;
    ++count_;
    bytes_kept_ += f.bytes;
  }

  /// Forgets the oldest block kept (not empty()): the caller has put it back.
  void drop_oldest() noexcept {
    bytes_kept_ -= bytes_[head_];
    bytes_[head_] = 0;
    head_ = at(1);
    --count_;
  }

  /// The newest block of `bytes` that a request on `stream` (`sync`: synchronous, which waits
  /// for nothing) may take without a wait (see the header), taken out; nullopt if none.
  [[nodiscard]] std::optional<recent_free> take(std::size_t bytes, cudaStream_t stream,
                                                bool sync) noexcept {
    for (std::size_t k = count_; k-- > 0;) {
      const std::size_t i = at(k);
      if (bytes_[i] != bytes) {
        continue;
      }
      const recent_free& f = slots_[i];
      if (f.complete || (!sync && f.stream == stream)) {
        const recent_free out = f;
        close_gap(k);
        return out;
      }
    }
    return std::nullopt;
  }

  /// Calls f(block) for every block kept, oldest first, forgetting each once f returns; if f
  /// throws, that block and the newer ones stay kept.
  template <class F>
  void drain(F&& f) {
    while (count_ != 0) {
      f(oldest());
      drop_oldest();
    }
  }

 private:
  /// The slot of the k-th block kept, oldest first (k <= capacity).
  [[nodiscard]] std::size_t at(std::size_t k) const noexcept {
    const std::size_t i = head_ + k;
    return i >= bytes_.size() ? i - bytes_.size() : i;
  }

  /// Removes the k-th block kept: the blocks on the shorter side of it move one slot over, so
  /// the rest stay in order without a gap.
  void close_gap(std::size_t k) noexcept {
    bytes_kept_ -= bytes_[at(k)];
    if (k < count_ - 1 - k) {
      for (std::size_t j = k; j > 0; --j) {  // the older ones move up; the head follows
        bytes_[at(j)] = bytes_[at(j - 1)];
        slots_[at(j)] = slots_[at(j - 1)];
      }
      bytes_[head_] = 0;
      head_ = at(1);
    } else {
      for (std::size_t j = k; j + 1 < count_; ++j) {  // the newer ones move down
        bytes_[at(j)] = bytes_[at(j + 1)];
        slots_[at(j)] = slots_[at(j + 1)];
      }
      bytes_[at(count_ - 1)] = 0;
    }
    --count_;
  }

  std::vector<std::size_t> bytes_;  ///< each slot's block size, 0 when empty (take scans it)
  std::vector<recent_free> slots_;  ///< each slot's block
  std::size_t head_ = 0;            ///< the slot of the oldest block
  std::size_t count_ = 0;           ///< blocks kept, in the slots from head_ on (wrapping)
  std::size_t bytes_kept_ = 0;      ///< their bytes
};

}  // namespace cudamem::detail
