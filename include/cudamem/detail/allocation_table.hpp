// cudamem/detail/allocation_table.hpp — the tracking adaptor's record of live allocations:
// a table from pointer to a compact 64-byte entry, split into lock-striped shards so that
// threads freeing different pointers rarely meet, and each shard an open-addressing hash
// table so that a lookup touches one or two cache lines and no node is allocated per entry.
//
//   detail::allocation_table table;
//   table.shard_for(p).lock() ... insert / find / erase, remember_free / find_recent_free
//
// What is in here, and why each is shaped the way it is:
// - `spin_mutex`: a shard's lock is held for a few dozen instructions, so a waiter spins a
//   little, then yields (on a 2-core machine with 8 threads, spinning on a preempted holder
//   would burn the holder's time slice). One atomic exchange to take it, one store to drop it.
// - `read_ticks()`: a timestamp as cheap as the CPU allows (the x86 time-stamp counter, the
//   ARM virtual counter; steady_clock elsewhere). Ticks become nanoseconds only when a report
//   is written (`tick_calibration`), so the hot path never pays for a clock call.
// - `tracked_allocation`: what is stored per allocation, trivially copyable, one cache line.
// - `allocation_shard`: a linear-probing table kept at most half full (grown by doubling,
//   the only host allocation, amortised), deleted from by backward shift (no tombstones, so
//   a table that sees millions of allocate/free pairs never degrades), plus a fixed ring of
//   the shard's recent frees for telling a double free from a stray pointer. A pointer always
//   maps to the same shard, so its frees are remembered exactly where a second free will look.
#pragma once

#include <cudamem/stream.hpp>

#include <array>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <source_location>
#include <thread>
#include <type_traits>
#include <vector>

namespace cudamem::detail {

/// A test-and-test-and-set lock for critical sections a few dozen instructions long.
class spin_mutex {
 public:
  void lock() noexcept {
    while (locked_.exchange(true, std::memory_order_acquire)) {
      // Wait reading (not writing) the flag, so waiters do not steal the line from the holder.
      for (unsigned spins = 0; locked_.load(std::memory_order_relaxed); ++spins) {
        if (spins >= 64) {
          std::this_thread::yield();
        }
      }
    }
  }
  void unlock() noexcept { locked_.store(false, std::memory_order_release); }

 private:
  std::atomic<bool> locked_{false};
};

/// A monotonic tick count, as cheap as this CPU allows; see tick_calibration for its unit.
inline std::uint64_t read_ticks() noexcept {
#if defined(__x86_64__) || defined(__i386__)
  return __builtin_ia32_rdtsc();  // constant-rate on every x86 of the last fifteen years
#elif defined(__aarch64__)
  std::uint64_t ticks = 0;
  asm volatile("mrs %0, cntvct_el0" : "=r"(ticks));
  return ticks;
#else
  return static_cast<std::uint64_t>(
      std::chrono::steady_clock::now().time_since_epoch() / std::chrono::nanoseconds{1});
#endif
}

/// Turns ticks into time since a start, by measuring both clocks at the start and again when
/// a report is made: ticks run at a constant rate, so the two readings give the rate.
class tick_calibration {
 public:
  tick_calibration() noexcept
      : start_time_(std::chrono::steady_clock::now()), start_ticks_(read_ticks()) {}

  [[nodiscard]] std::uint64_t start_ticks() const noexcept { return start_ticks_; }

  /// The rate now: nanoseconds per tick, measured over the whole life so far.
  [[nodiscard]] double nanoseconds_per_tick() const noexcept {
    const std::uint64_t ticks = read_ticks() - start_ticks_;
    const auto elapsed = std::chrono::steady_clock::now() - start_time_;
    if (ticks == 0) {
      return 0.0;
    }
    return std::chrono::duration<double, std::nano>(elapsed).count() /
           static_cast<double>(ticks);
  }

  /// `ticks` as time since the start, at the rate `ns_per_tick`.
  [[nodiscard]] std::chrono::nanoseconds since_start(std::uint64_t ticks,
                                                     double ns_per_tick) const noexcept {
    if (ticks <= start_ticks_) {
      return std::chrono::nanoseconds{0};
    }
    return std::chrono::nanoseconds{
        static_cast<std::int64_t>(static_cast<double>(ticks - start_ticks_) * ns_per_tick)};
  }

 private:
  std::chrono::steady_clock::time_point start_time_;
  std::uint64_t start_ticks_;
};

/// One live (or recently freed) allocation, as the tracking adaptor keeps it: one cache line
/// exactly, so a lookup that finds its entry touches one line.
struct alignas(64) tracked_allocation {
  void* pointer = nullptr;  ///< nullptr: an empty slot
  std::size_t bytes = 0;
  cudaStream_t stream = nullptr;
  std::source_location site;
  std::thread::id thread;
  std::uint64_t ticks = 0;     ///< read_ticks() when it was made (0: not timed)
  std::uint64_t sequence = 0;  ///< the adaptor's allocation counter
  std::uint8_t alignment_log2 = 0;
  bool synchronous = true;

  [[nodiscard]] std::size_t alignment() const noexcept { return std::size_t{1} << alignment_log2; }
};
// Copied under a lock on every allocate and free: it must stay plain data, one cache line.
static_assert(std::is_trivially_copyable_v<tracked_allocation>);
static_assert(sizeof(tracked_allocation) == 64);

/// Where `p` goes: the top bits of a multiplicative hash choose the shard, the next bits the
/// slot. (Allocations are aligned, so the pointer's own low bits carry nothing.)
inline std::uint64_t hash_pointer(const void* p) noexcept {
  return static_cast<std::uint64_t>(reinterpret_cast<std::uintptr_t>(p)) * 0x9E3779B97F4A7C15ull;
}

/// One lock stripe of the table. Every member but the lock is guarded by the lock.
class alignas(64) allocation_shard {
 public:
  /// Frees remembered per shard, to recognise a double free.
  static constexpr std::size_t remembered_frees = 64;

  spin_mutex& mutex() noexcept { return mutex_; }

  [[nodiscard]] std::size_t size() const noexcept { return size_; }

  /// The live entry for `p`, or nullptr.
  [[nodiscard]] tracked_allocation* find(const void* p) noexcept {
    if (slots_.empty()) {
      return nullptr;
    }
    for (std::size_t i = home_of(p);; i = (i + 1) & mask_) {
      if (slots_[i].pointer == p) {
        return &slots_[i];
      }
      if (slots_[i].pointer == nullptr) {
        return nullptr;
      }
    }
  }

  /// The slot where the new allocation `p` goes, its pointer set; the caller fills in the
  /// rest (written straight into the table: no copy of a record on the way). If `p` is
  /// already live, `was_live` is set and the slot still holds the old entry. Throws
  /// std::bad_alloc (leaving the table as it was) only when the table must grow and cannot.
  tracked_allocation& slot_for(void* p, bool& was_live) {
    if ((size_ + 1) * 2 > slots_.size()) {
      grow();
    }
    std::size_t i = home_of(p);
    while (slots_[i].pointer != nullptr) {
      if (slots_[i].pointer == p) {
        was_live = true;
        return slots_[i];
      }
      i = (i + 1) & mask_;
    }
    was_live = false;
    slots_[i].pointer = p;
    ++size_;
    return slots_[i];
  }

  /// Removes the entry `found` (from find()). Later entries of its probe run move back into
  /// the hole, so lookups never need tombstones.
  void erase(tracked_allocation* found) noexcept {
    auto hole = static_cast<std::size_t>(found - slots_.data());
    for (std::size_t next = (hole + 1) & mask_; slots_[next].pointer != nullptr;
         next = (next + 1) & mask_) {
      const std::size_t home = home_of(slots_[next].pointer);
      // The entry may move back to the hole if the hole is not before its home slot
      // (cyclically): its distance from home is at least its distance from the hole.
      if (((next - home) & mask_) >= ((next - hole) & mask_)) {
        slots_[hole] = slots_[next];
        hole = next;
      }
    }
    slots_[hole].pointer = nullptr;
    --size_;
  }

  /// Calls `visit(entry)` for every live entry.
  template <class Visit>
  void for_each(Visit&& visit) const {
    for (const tracked_allocation& entry : slots_) {
      if (entry.pointer != nullptr) {
        visit(entry);
      }
    }
  }

  /// Keeps `entry` among this shard's recent frees (the oldest is forgotten).
  void remember_free(const tracked_allocation& entry) noexcept {
    recent_frees_[next_recent_free_ % remembered_frees] = entry;
    ++next_recent_free_;
  }

  /// The most recent remembered free of `p`, or nullptr. Linear, but only bad frees ask.
  [[nodiscard]] const tracked_allocation* find_recent_free(const void* p) const noexcept {
    const tracked_allocation* latest = nullptr;
    for (const tracked_allocation& entry : recent_frees_) {
      if (entry.pointer == p && (latest == nullptr || entry.sequence > latest->sequence)) {
        latest = &entry;
      }
    }
    return latest;
  }

 private:
  static constexpr unsigned shard_bits = 4;  // 16 shards: see allocation_table

  [[nodiscard]] std::size_t home_of(const void* p) const noexcept {
    return static_cast<std::size_t>(hash_pointer(p) >> (64 - shard_bits - table_bits_)) & mask_;
  }

  void grow() {
    const unsigned bits = slots_.empty() ? 6 : table_bits_ + 1;  // 64 slots to start
    std::vector<tracked_allocation> old(std::size_t{1} << bits);
    old.swap(slots_);  // the only step that can throw is done: nothing below can
    table_bits_ = bits;
    mask_ = slots_.size() - 1;
    for (const tracked_allocation& entry : old) {
      if (entry.pointer != nullptr) {
        std::size_t i = home_of(entry.pointer);
        while (slots_[i].pointer != nullptr) {
          i = (i + 1) & mask_;
        }
        slots_[i] = entry;
      }
    }
  }

  friend class allocation_table;

  spin_mutex mutex_;
  std::vector<tracked_allocation> slots_;  // a power of two long, at most half full
  std::size_t size_ = 0;
  std::size_t mask_ = 0;
  unsigned table_bits_ = 0;
  std::array<tracked_allocation, remembered_frees> recent_frees_{};
  std::size_t next_recent_free_ = 0;
};

/// The shards together. 16 stripes: enough that a handful of threads rarely wait on each
/// other, few enough that a leak report (which visits them all) stays cheap.
class allocation_table {
 public:
  static constexpr std::size_t shard_count = std::size_t{1} << allocation_shard::shard_bits;

  allocation_table() : shards_(std::make_unique<allocation_shard[]>(shard_count)) {}

  [[nodiscard]] allocation_shard& shard_for(const void* p) const noexcept {
    return shards_[hash_pointer(p) >> (64 - allocation_shard::shard_bits)];
  }
  [[nodiscard]] allocation_shard& shard(std::size_t i) const noexcept { return shards_[i]; }

 private:
  std::unique_ptr<allocation_shard[]> shards_;  // on the heap: 16 x (lock + 4 KiB ring)
};

}  // namespace cudamem::detail
