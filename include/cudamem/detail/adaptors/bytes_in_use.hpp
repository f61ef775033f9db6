// cudamem/detail/adaptors/bytes_in_use.hpp — bytes in use and their peak, counted by threads
// that never write a shared cache line on the common path: what statistics_adaptor and
// tracking_adaptor count with.
//
//   detail::bytes_in_use usage{/*slack=*/4 << 20};
//   detail::usage_part& mine = ...;             // a part only this thread writes now (a
//                                               // thread's slot, or a shard under its lock)
//   usage.activate(mine);                       // once, before the part's first add
//   usage.add(mine, bytes);                     // an allocation
//   usage.add(mine, std::size_t{0} - bytes);    // a free (two's complement: subtracts)
//   std::size_t now = 0, most = 0;
//   for (const usage_part& p : parts) { now += p.balance(); most += p.most(); }
//   std::size_t peak = usage.peak(most);        // see the contract
//
// Why. A counter that every thread adds to is one cache line that moves from core to core on
// every request: over a pool shared by 16 threads, one atomic add per request made the
// statistics adaptor cost 17 times the pool (bench/README.md). So bytes in use live in
// *parts*, each written by one thread at a time, and are summed when someone reads them:
// exact, and nobody's hot path touches another's line. The peak cannot be had that way —
// the most the *sum* ever was is a fact about moments, and no part sees the others' moments
// — so it is bounded instead:
//
// Contract
// - A part's balance (bytes allocated minus bytes freed through it; "negative" in two's
//   complement when it frees what other parts allocated) is written only by the one thread
//   that writes the part at that moment, with plain stores; the sum of the balances is the
//   bytes in use, exact when no request is in flight.
// - `peak(sum of the parts' most)` is never below the most bytes that were ever in use at
//   once (the true peak), and never above it by more than (2n - 1) x slack, n being the parts
//   activated so far. With one part it is exact (the part's own most); with slack 0 it is
//   exact for any number of parts, and every add is an atomic add on one shared line.
// - Cost of an add: two plain loads and stores of the part's line, and, when the part has
//   moved by `slack` bytes since it last did, an atomic add and a compare-and-swap on the
//   shared line (`publish`).
//
// How the bound works (for a student). Each part tells a shared total G the moves it has
// made, but only once they add up to `slack` bytes either way; what it has not told yet, its
// *pending* bytes, is always less than `slack`. So at any moment the true total T is less
// than G + n x slack, and whoever changes G (or activates a part, which adds a new source of
// pending bytes) raises the shared mark P to G + n x slack: P >= T at every moment, so P is at
// least the true peak. And when P was last raised, G was within (n - 1) x slack of the true
// total of that moment, so P exceeds the true peak by less than (2n - 1) x slack. A second
// bound comes for free: the sum over the parts of the most each part's balance ever was is
// at least the true peak too (no moment's sum exceeds the sum of each part's most), and is
// exact when one part does all the work; the peak reported is the smaller of the two.
#pragma once

#include <cudamem/detail/adaptors/owner_bias.hpp>  // raise_to
#include <cudamem/detail/sync/atomic.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>

namespace cudamem::detail {

/// Bytes as a signed amount (a part's balance may be "negative"; see the contract).
[[nodiscard]] constexpr std::int64_t as_signed(std::size_t bytes) noexcept {
  return static_cast<std::int64_t>(bytes);
}

/// One part of the bytes in use: written by one thread at a time, read by anyone. Embedded in
/// the structure that has that writer (a thread's counter slot, a record shard), so that it
/// shares the writer's cache line.
class usage_part {
 public:
  /// Bytes allocated minus bytes freed through this part (two's complement).
  [[nodiscard]] std::size_t balance() const noexcept {
    return balance_.load(detail::memory_order_relaxed);
  }
  /// The most balance() has been (as a signed amount; 0 at least).
  [[nodiscard]] std::size_t most() const noexcept { return most_.load(detail::memory_order_relaxed); }
  [[nodiscard]] bool active() const noexcept { return active_; }

 private:
  friend class bytes_in_use;
  detail::atomic<std::size_t> balance_{0};
  detail::atomic<std::size_t> most_{0};
  std::size_t published_ = 0;  // the part of balance_ the shared total has heard of
  bool active_ = false;        // activate() has been called (the writer's own flag)
};

/// The shared side: the total the parts have published, the peak mark and the part count.
class bytes_in_use {
 public:
  /// `slack`: how far a part's balance may move before it tells the shared total.
  explicit bytes_in_use(std::size_t slack) noexcept
      : slack_(slack), offset_(slack == 0 ? 0 : slack - 1), span_(slack == 0 ? 0 : 2 * slack - 2) {}

  [[nodiscard]] std::size_t slack() const noexcept { return slack_; }

  /// Makes `part` count in the bound (once, by its writer, before its first add).
  void activate(usage_part& part) noexcept {
    part.active_ = true;
    // Sequentially consistent, with publish(): of an activation and a publication racing,
    // at least one sees the other's write (the count, the total), so one of their raises
    // covers both. (On x86 these are the same instructions as relaxed ones.)
    const std::size_t parts = parts_.fetch_add(1, detail::memory_order_seq_cst) + 1;
    raise_to(mark_, total_.load(detail::memory_order_seq_cst) + parts * slack_);
  }

  /// Adds `delta` (two's complement to subtract) to `part`, whose only writer the caller is.
  void add(usage_part& part, std::size_t delta) noexcept {
    const std::size_t balance = part.balance_.load(detail::memory_order_relaxed) + delta;
    part.balance_.store(balance, detail::memory_order_relaxed);
    if (as_signed(balance) > as_signed(part.most_.load(detail::memory_order_relaxed))) {
      part.most_.store(balance, detail::memory_order_relaxed);
    }
    // |pending| >= slack, in one unsigned compare: pending + (slack - 1) lies in
    // [0, 2 slack - 2] exactly when -slack < pending < slack. (Slack 0: pending is the
    // request's non-zero bytes, always published.)
    const std::size_t pending = balance - part.published_;
    if (pending + offset_ > span_) [[unlikely]] {
      part.published_ = balance;
      publish(pending);
    }
  }

  /// Adds `delta` to a part that several threads write at once (atomically), publishing it at
  /// once: such a part never has pending bytes. (statistics_adaptor's slot for threads
  /// beyond its own slots.)
  void add_shared(usage_part& part, std::size_t delta) noexcept {
    const std::size_t balance = part.balance_.fetch_add(delta, detail::memory_order_relaxed) + delta;
    std::size_t most = part.most_.load(detail::memory_order_relaxed);
    while (as_signed(balance) > as_signed(most) &&
           !part.most_.compare_exchange_weak(most, balance, detail::memory_order_relaxed)) {
    }
    publish(delta);
  }

  /// The peak (see the contract), given the sum of every part's most().
  [[nodiscard]] std::size_t peak(std::size_t sum_of_most) const noexcept {
    return std::min(mark_.load(detail::memory_order_relaxed), sum_of_most);
  }

  /// How far above the true peak peak() may be now: (2n - 1) x slack for n parts.
  [[nodiscard]] std::size_t peak_error_bound() const noexcept {
    const std::size_t parts = parts_.load(detail::memory_order_relaxed);
    return parts <= 1 ? 0 : (2 * parts - 1) * slack_;
  }

  /// Parts activated so far.
  [[nodiscard]] std::size_t parts() const noexcept {
    return parts_.load(detail::memory_order_relaxed);
  }

 private:
  /// Adds a part's pending bytes to the shared total and raises the mark to cover every
  /// part's pending bytes from now on. (The total may be "negative" for a moment, two's
  /// complement; total + parts x slack is not.)
  [[gnu::noinline]] void publish(std::size_t pending) noexcept {
    const std::size_t total = total_.fetch_add(pending, detail::memory_order_seq_cst) + pending;
    raise_to(mark_, total + parts_.load(detail::memory_order_seq_cst) * slack_);
  }

  const std::size_t slack_;
  const std::size_t offset_;  // slack - 1 (see add)
  const std::size_t span_;    // 2 slack - 2
  // The one line every part writes now and then: the published total, the mark, the count.
  alignas(64) detail::atomic<std::size_t> total_{0};
  detail::atomic<std::size_t> mark_{0};
  detail::atomic<std::size_t> parts_{0};
};

}  // namespace cudamem::detail
