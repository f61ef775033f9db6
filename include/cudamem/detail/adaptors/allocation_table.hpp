// cudamem/detail/adaptors/allocation_table.hpp — the tracking adaptor's record of live
// allocations: a table from pointer to a 64-byte record, split into lock-striped shards, one
// per thread (up to 16), so that threads that allocate and free their own memory never touch
// each other's cache lines; each shard an open-addressing hash table whose probed keys are 16
// bytes, so that a lookup touches one line of keys and no node is allocated per entry.
//
//   detail::allocation_shard& shard = table.home_shard();   // this thread's
//   const std::lock_guard lock(shard.mutex());   // (the adaptor: a biased_lock_guard)
//   tracked_allocation& r = shard.add(p, bytes, alignment_log2, was_live);  // fill in the rest
//   shard.release(p, bytes, alignment)        // freed / size_mismatch / unknown (not here)
//
// What is in here, and why each is shaped the way it is:
// - A thread records its allocations in its *home* shard (threads are numbered as they first
//   come, thread n gets shard n mod 16), and a free looks there first: the common case, a
//   thread freeing what it allocated, touches one shard, its own. A free from another thread
//   misses there and looks in the shard a hint names (the shard where the last such free in
//   the same 2 MiB of address space found its record, `region_hints`), then in every shard.
//   A record stays in the shard it was made in until freed, so its frees are remembered (the
//   ring below) where its record was.
// - Each shard's lock is a `spin_lock` (detail/spin_lock.hpp): it is held for a few dozen
//   instructions, so one exchange to take it and a store to drop it beat a std::mutex.
// - Each shard keeps its part of the bytes in use (`usage`, detail/adaptors/bytes_in_use.hpp),
//   written under its lock: summed when read.
// - `read_ticks()`: a timestamp as cheap as the CPU allows (the x86 time-stamp counter, the
//   ARM virtual counter; steady_clock elsewhere). Ticks become nanoseconds only when a report
//   is written (`tick_calibration`), so the hot path never pays for a clock call.
// - `tracked_allocation`: what is stored per allocation, trivially copyable, one cache line.
// - `allocation_shard`: a linear-probing table kept at most half full and deleted from by
//   backward shift (no tombstones, so a table that sees millions of allocate/free pairs never
//   degrades). Its keys (pointer, bytes) and its records sit in two arrays side by side (see
//   the class); and a ring of copies of the shard's last frees tells a double free from a
//   stray pointer. The arrays grow by doubling, the only host allocation (amortised, never
//   per request).
// - `next_allocation_sequence()`: a per-thread counter, for ordering records without a
//   global atomic (order is exact within a thread; see tracked_allocation::sequence).
#pragma once

#include <cudamem/detail/adaptors/bytes_in_use.hpp>
#include <cudamem/detail/adaptors/owner_bias.hpp>  // this_thread_token
#include <cudamem/detail/spin_lock.hpp>
#include <cudamem/detail/sync/atomic.hpp>
#include <cudamem/stream.hpp>

#include <array>
#include <bit>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <source_location>
#include <thread>
#include <type_traits>
#include <vector>

namespace cudamem::detail {

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

/// The next sequence number for an allocation made on this thread: 0, 1, 2... per thread,
/// shared by every tracking adaptor. A plain thread-local increment: no atomic, no shared line.
inline std::uint64_t next_allocation_sequence() noexcept {
  static thread_local std::uint64_t next = 0;
  return next++;
}

/// One live (or recently freed) allocation, as the tracking adaptor keeps it: one cache line
/// exactly, so a lookup that finds its entry touches one line. `pointer == nullptr`: an empty
/// slot of the table.
struct alignas(64) tracked_allocation {
  void* pointer = nullptr;  ///< nullptr: an empty slot
  std::size_t bytes = 0;
  cudaStream_t stream = nullptr;
  std::source_location site;
  std::thread::id thread;
  std::uint64_t ticks = 0;     ///< read_ticks() when it was made (0: not timed)
  std::uint64_t sequence = 0;  ///< next_allocation_sequence(): orders one thread's allocations
  std::uint8_t alignment_log2 = 0;
  bool synchronous = true;

  [[nodiscard]] std::size_t alignment() const noexcept { return std::size_t{1} << alignment_log2; }
};
// Moved within the table and copied into the ring of frees under a lock: it must stay plain
// data, one cache line.
static_assert(std::is_trivially_copyable_v<tracked_allocation>);
static_assert(sizeof(tracked_allocation) == 64);

/// log2 of `alignment`, a power of two (checked where the request entered the chain): one
/// instruction, without the zero test std::countr_zero must make.
[[nodiscard]] inline std::uint8_t log2_of_power_of_two(std::size_t alignment) noexcept {
#if defined(__GNUC__) || defined(__clang__)
  return static_cast<std::uint8_t>(__builtin_ctzll(alignment));
#else
  return static_cast<std::uint8_t>(std::countr_zero(alignment));
#endif
}

/// Where `p` goes in a shard's table: the top bits of a multiplicative hash choose the slot.
/// (Allocations are aligned, so the pointer's own low bits carry nothing.)
inline std::uint64_t hash_pointer(const void* p) noexcept {
  return static_cast<std::uint64_t>(reinterpret_cast<std::uintptr_t>(p)) * 0x9E3779B97F4A7C15ull;
}

/// What a free found.
enum class release_result {
  freed,          ///< live, bytes and alignment matched: removed
  size_mismatch,  ///< live, but allocated with other bytes or alignment: left live
  double_free,    ///< live nowhere, among a shard's recent frees
  unknown,        ///< not live (in this shard; in none, for the adaptor); never seen, or
                  ///< freed long ago
};

/// One lock stripe of the table. Every member but the lock is guarded by the lock.
///
/// Two arrays side by side, slot i of one beside slot i of the other:
/// - `keys_`, what a lookup probes: pointer and bytes, 16 bytes a slot, so four slots share a
///   cache line and a thousand live allocations fit in the CPU's L1 cache.
/// - `records_`, the whole record (alignment, site, stream, thread...), 64 bytes a slot. An
///   allocation writes it (a store, which the CPU does not wait for); a free reads it, to
///   check the alignment and to copy it into the ring of recent frees. Its line is prefetched
///   when the lookup starts, so that its miss overlaps the key's instead of following it.
class alignas(64) allocation_shard {
 public:
  /// Frees remembered per shard, to recognise a double free.
  static constexpr std::size_t remembered_frees = 64;

  /// Throws std::bad_alloc if there is no host memory for the first 16 slots.
  allocation_shard() { grow(); }

  spin_lock& mutex() noexcept { return mutex_; }

  [[nodiscard]] std::size_t size() const noexcept { return size_; }

  /// The live record of `p`, or nullptr.
  [[nodiscard]] tracked_allocation* find(const void* p) noexcept {
    const std::size_t i = slot_of(p, home_of(p));
    return i == no_slot ? nullptr : &records_[i];
  }

  /// Records the new allocation `p` of `bytes` with alignment 2^`alignment_log2` and returns
  /// its record, pointer, bytes and alignment set; the caller fills in the rest (straight
  /// into the table: no copy of a record on the way). If `p` is already live, `was_live` is
  /// set and the record still holds the old allocation until the caller overwrites it (the
  /// caller does). Throws std::bad_alloc (leaving the shard as it was) only when the table
  /// must grow and cannot.
  tracked_allocation& add(void* p, std::size_t bytes, std::uint8_t alignment_log2,
                          bool& was_live) {
    if ((size_ + 1) * 2 > keys_.size()) {  // first: a failure to grow changes nothing
      grow();
    }
    std::size_t i = home_of(p);
    prefetch_record(i);
    while (keys_[i].pointer != nullptr && keys_[i].pointer != p) {
      i = (i + 1) & mask_;
    }
    was_live = keys_[i].pointer != nullptr;
    if (!was_live) {
      ++size_;
      records_[i].pointer = p;
      records_[i].bytes = bytes;
      records_[i].alignment_log2 = alignment_log2;
    }
    keys_[i] = {p, bytes};
    return records_[i];
  }

  /// Frees `p` from this shard's record if it is live here with these bytes and alignment;
  /// otherwise says why not: size_mismatch (find gives the record), or unknown (not live
  /// here: another shard may have it, or find_recent_free may know it).
  [[gnu::always_inline]] release_result release(const void* p, std::size_t bytes,
                                                std::size_t alignment) noexcept {
    const std::size_t home = home_of(p);
    prefetch_record(home);
    const std::size_t i = slot_of(p, home);
    if (i == no_slot) [[unlikely]] {
      return release_result::unknown;
    }
    // (An alignment that is not a power of two equals no record's.)
    if (keys_[i].bytes != bytes || records_[i].alignment() != alignment) [[unlikely]] {
      return release_result::size_mismatch;
    }
    recent_frees_[next_recent_free_ % remembered_frees] = records_[i];
    ++next_recent_free_;
    erase(i);
    return release_result::freed;
  }

  /// The most recent remembered free of `p`, or nullptr. Linear, but only bad frees ask.
  [[nodiscard]] const tracked_allocation* find_recent_free(const void* p) const noexcept {
    // Newest first: the ring's order is the shard's order of frees (sequence numbers are
    // per thread, so they cannot tell which of two threads' frees came last).
    for (std::size_t back = 1; back <= remembered_frees; ++back) {
      const tracked_allocation& freed =
          recent_frees_[(next_recent_free_ - back) % remembered_frees];
      if (freed.pointer == p && p != nullptr) {
        return &freed;
      }
    }
    return nullptr;
  }

  /// This shard's part of the bytes in use (guarded by the lock, like everything here).
  usage_part usage;

  /// Calls `visit(record)` for every live allocation.
  template <class Visit>
  void for_each(Visit&& visit) const {
    for (std::size_t i = 0; i < keys_.size(); ++i) {
      if (keys_[i].pointer != nullptr) {
        visit(records_[i]);
      }
    }
  }

 private:
  static constexpr unsigned shard_bits = 4;  // 16 shards: see allocation_table
  static constexpr std::size_t no_slot = ~std::size_t{0};

  struct live_key {
    const void* pointer = nullptr;  // nullptr: an empty slot
    std::size_t bytes = 0;
  };
  static_assert(sizeof(live_key) == 16);

  [[nodiscard]] std::size_t home_of(const void* p) const noexcept {
    return static_cast<std::size_t>(hash_pointer(p) >> (64 - table_bits_));
  }

  /// Starts loading the record in slot `i` (where an entry usually is: at its home) while the
  /// key is probed, so that the two cache misses of a lookup overlap instead of following one
  /// another.
  void prefetch_record(std::size_t i) const noexcept {
#if defined(__GNUC__) || defined(__clang__)
    __builtin_prefetch(&records_[i], 1);
#else
    (void)i;
#endif
  }

  /// Where `p` is (its probe run starts at `home`), or no_slot.
  [[nodiscard]] std::size_t slot_of(const void* p, std::size_t home) const noexcept {
    for (std::size_t i = home;; i = (i + 1) & mask_) {
      if (keys_[i].pointer == p) {
        return i;
      }
      if (keys_[i].pointer == nullptr) {
        return no_slot;
      }
    }
  }

  /// Empties slot `hole`. Later entries of its probe run move back into the hole, so lookups
  /// never need tombstones.
  void erase(std::size_t hole) noexcept {
    for (std::size_t next = (hole + 1) & mask_; keys_[next].pointer != nullptr;
         next = (next + 1) & mask_) {
      const std::size_t home = home_of(keys_[next].pointer);
      // The entry may move back to the hole if the hole is not before its home slot
      // (cyclically): its distance from home is at least its distance from the hole.
      if (((next - home) & mask_) >= ((next - hole) & mask_)) {
        keys_[hole] = keys_[next];
        records_[hole] = records_[next];
        hole = next;
      }
    }
    keys_[hole].pointer = nullptr;
    --size_;
  }

  void grow() {
    const unsigned bits = keys_.empty() ? 4 : table_bits_ + 1;  // 16 slots to start
    std::vector<live_key> keys(std::size_t{1} << bits);
    std::vector<tracked_allocation> records(keys.size());
    // Both allocated: nothing below can throw.
    keys.swap(keys_);
    records.swap(records_);
    table_bits_ = bits;
    mask_ = keys_.size() - 1;
    for (std::size_t old = 0; old < keys.size(); ++old) {
      if (keys[old].pointer != nullptr) {
        std::size_t i = home_of(keys[old].pointer);
        while (keys_[i].pointer != nullptr) {
          i = (i + 1) & mask_;
        }
        keys_[i] = keys[old];
        records_[i] = records[old];
      }
    }
  }

  friend class allocation_table;

  spin_lock mutex_;
  std::size_t size_ = 0;
  std::size_t mask_ = 0;
  unsigned table_bits_ = 0;
  std::vector<live_key> keys_;               // a power of two long, at most half full
  std::vector<tracked_allocation> records_;  // as long as keys_: records_[i] is keys_[i]'s
  std::size_t next_recent_free_ = 0;
  std::array<tracked_allocation, remembered_frees> recent_frees_{};  // a ring, oldest overwritten
};

/// The shards together. 16: a shard per thread for up to 16 threads (more share), few enough
/// that a leak report (which visits them all) stays cheap.
class allocation_table {
 public:
  static constexpr std::size_t shard_count = std::size_t{1} << allocation_shard::shard_bits;

  allocation_table()
      : shards_(std::make_unique<allocation_shard[]>(shard_count)),
        region_hints_(std::make_unique<detail::atomic<std::uint8_t>[]>(hint_count)) {}

  /// The calling thread's shard: where it records what it allocates.
  [[nodiscard]] allocation_shard& home_shard() const noexcept {
    return shards_[this_thread_token() & (shard_count - 1)];
  }
  [[nodiscard]] allocation_shard& shard(std::size_t i) const noexcept { return shards_[i]; }
  [[nodiscard]] std::size_t index_of(const allocation_shard& s) const noexcept {
    return static_cast<std::size_t>(&s - shards_.get());
  }

  /// The shard where a record near `p` (in the same 2 MiB) was last found by a free from
  /// another thread, or shard_count if none was. A hint only: the caller checks.
  [[nodiscard]] std::size_t hinted_shard(const void* p) const noexcept {
    const std::uint8_t hint = region_hints_[region_of(p)].load(detail::memory_order_relaxed);
    return hint == 0 ? shard_count : std::size_t{hint} - 1;
  }
  /// Remembers that the record of `p` was in shard `i` (see hinted_shard). Written only when
  /// it changes, so that hints read by many threads stay in their caches.
  void set_hint(const void* p, std::size_t i) const noexcept {
    detail::atomic<std::uint8_t>& hint = region_hints_[region_of(p)];
    const auto value = static_cast<std::uint8_t>(i + 1);
    if (hint.load(detail::memory_order_relaxed) != value) {
      hint.store(value, detail::memory_order_relaxed);
    }
  }

 private:
  static constexpr std::size_t hint_count = 4096;  // 2 MiB regions: 8 GiB, then they repeat

  static std::size_t region_of(const void* p) noexcept {
    return (reinterpret_cast<std::uintptr_t>(p) >> 21) & (hint_count - 1);
  }

  std::unique_ptr<allocation_shard[]> shards_;  // on the heap: 16 x (lock + 4 KiB ring)
  std::unique_ptr<detail::atomic<std::uint8_t>[]> region_hints_;  // shard + 1; 0: no hint
};

}  // namespace cudamem::detail
