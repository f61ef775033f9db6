// cudamem/detail/allocation_table.hpp — the tracking adaptor's record of live allocations:
// a table from pointer to a compact 64-byte record, split into lock-striped shards so that
// threads freeing different pointers rarely meet, and each shard an open-addressing hash
// table so that a lookup touches one or two cache lines and no node is allocated per entry.
//
//   detail::allocation_shard& shard = table.shard_for(p);
//   const std::lock_guard lock(shard.mutex());
//   tracked_allocation& r = shard.add(p, bytes, alignment_log2, was_live);  // fill in the rest
//   shard.release(p, bytes, alignment_log2)   // freed / size_mismatch / double_free...
//   shard.used_bytes()                        // this shard's share of the bytes in use
//
// What is in here, and why each is shaped the way it is:
// - Each shard's lock is a `spin_lock` (detail/spin_lock.hpp): it is held for a few dozen
//   instructions, so one exchange to take it and a store to drop it beat a std::mutex.
// - `read_ticks()`: a timestamp as cheap as the CPU allows (the x86 time-stamp counter, the
//   ARM virtual counter; steady_clock elsewhere). Ticks become nanoseconds only when a report
//   is written (`tick_calibration`), so the hot path never pays for a clock call.
// - `tracked_allocation`: what is stored per allocation, trivially copyable, one cache line.
// - `allocation_shard`: a linear-probing table of small keys (pointer, bytes, alignment,
//   record index) kept at most half full, deleted from by backward shift (no tombstones, so a
//   table that sees millions of allocate/free pairs never degrades); the full records beside
//   it, in slots that do not move; and a ring of the shard's recent frees for telling a
//   double free from a stray pointer. A pointer always maps to the same shard, so its frees
//   are remembered exactly where a second free will look. Arrays grow by doubling, the only
//   host allocation (amortised, never per request); a free checks and removes a pointer
//   touching one cache line of keys, which is what keeps large live sets fast.
// - Bytes in use are counted per shard, under the lock the shard already holds: a plain
//   add, not an atomic one on a line every thread writes. Readers add the shards up.
// - `next_allocation_sequence()`: a per-thread counter, for ordering records without a
//   global atomic (order is exact within a thread; see tracked_allocation::sequence).
#pragma once

#include <cudamem/detail/spin_lock.hpp>
#include <cudamem/stream.hpp>

#include <array>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <new>
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
/// exactly, so a lookup that finds its entry touches one line.
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
// Copied under a lock on every allocate and free: it must stay plain data, one cache line.
static_assert(std::is_trivially_copyable_v<tracked_allocation>);
static_assert(sizeof(tracked_allocation) == 64);

/// Where `p` goes: the top bits of a multiplicative hash choose the shard, the next bits the
/// slot. (Allocations are aligned, so the pointer's own low bits carry nothing.)
inline std::uint64_t hash_pointer(const void* p) noexcept {
  return static_cast<std::uint64_t>(reinterpret_cast<std::uintptr_t>(p)) * 0x9E3779B97F4A7C15ull;
}

/// What `allocation_shard::release` found.
enum class release_result {
  freed,          ///< live, bytes and alignment matched: removed
  size_mismatch,  ///< live, but allocated with other bytes or alignment: left live
  double_free,    ///< among the shard's recent frees
  unknown,        ///< never seen (or freed long ago)
};

/// One lock stripe of the table. Every member but the lock is guarded by the lock.
///
/// Two arrays, so that the hot path touches as few cache lines as it can:
/// - `keys_`, the hash table proper: pointer, bytes, alignment and where the full record is,
///   32 bytes a slot. A free is checked and removed using this line alone.
/// - `records_`, the full records, each in a slot of its own that never moves while the
///   allocation lives. A freed record is not reused at once: its index goes into a ring of the
///   shard's last `remembered_frees` frees (which is how a double free is recognised, record
///   and all), and only when it falls out of the ring is it handed to a new allocation.
class alignas(64) allocation_shard {
 public:
  /// Frees remembered per shard, to recognise a double free.
  static constexpr std::size_t remembered_frees = 64;

  spin_lock& mutex() noexcept { return mutex_; }

  [[nodiscard]] std::size_t size() const noexcept { return size_; }

  /// The bytes of this shard's live allocations. May be read without the lock (a relaxed
  /// load: a report, not a decision); only written under it.
  [[nodiscard]] std::size_t used_bytes() const noexcept {
    return used_bytes_.load(std::memory_order_relaxed);
  }

  /// Counts `added` bytes in and `removed` out (a live pointer handed out again replaces its
  /// old bytes). Call with the lock held. True if the shard now holds more than when the
  /// shards were last added up (mark_summed): only then can the total be above every total
  /// seen so far. (If no shard holds more than it did at the last sum, the total is at most
  /// that sum. A shard's own most is not enough: a shard below its most, refilled after
  /// others grew, can carry the total past the peak.)
  bool count_allocation(std::size_t added, std::size_t removed = 0) noexcept {
    // Load and store, not fetch_add: the lock already orders the writers, so no locked
    // instruction is needed; the atomic is only there for lock-free readers.
    const std::size_t used = used_bytes_.load(std::memory_order_relaxed) + added - removed;
    used_bytes_.store(used, std::memory_order_relaxed);
    return used > bytes_at_last_sum_.load(std::memory_order_relaxed);
  }

  /// Reads this shard's bytes in use for a sum of all shards, and remembers them as the mark
  /// count_allocation compares with.
  std::size_t mark_summed() noexcept {
    const std::size_t used = used_bytes_.load(std::memory_order_relaxed);
    bytes_at_last_sum_.store(used, std::memory_order_relaxed);
    return used;
  }

  /// The live record of `p`, or nullptr.
  [[nodiscard]] tracked_allocation* find(const void* p) noexcept {
    const live_key* key = find_key(p);
    return key == nullptr ? nullptr : &records_[key->record];
  }

  /// The record for the new allocation `p`, with pointer, bytes and alignment set; the caller
  /// fills in the rest (straight into the table: no copy of a record on the way). If `p` is
  /// already live, `was_live` is set and the record still holds the old entry until the
  /// caller overwrites it. Throws std::bad_alloc (leaving the shard as it was) only when the
  /// shard must grow and cannot.
  tracked_allocation& add(void* p, std::size_t bytes, std::uint8_t alignment_log2,
                          bool& was_live) {
    // Everything that can throw comes first, so a failure changes nothing.
    if ((size_ + 1) * 2 > keys_.size()) {
      grow_keys();
    }
    if (reusable_.empty() && records_.size() == records_.capacity()) {
      grow_records();
    }
    std::size_t i = home_of(p);
    while (keys_[i].pointer != nullptr && keys_[i].pointer != p) {
      i = (i + 1) & mask_;
    }
    live_key& key = keys_[i];
    was_live = key.pointer != nullptr;
    if (!was_live) {
      key.pointer = p;
      key.record = take_record();
      ++size_;
    }
    key.bytes = bytes;
    key.alignment_log2 = alignment_log2;
    tracked_allocation& record = records_[key.record];
    if (!was_live) {
      record.pointer = p;
      record.bytes = bytes;
      record.alignment_log2 = alignment_log2;
    }
    return record;
  }

  /// Frees `p` from the record if it is live with these bytes and alignment; otherwise says
  /// why not (and find / find_recent_free give the record concerned).
  release_result release(const void* p, std::size_t bytes, std::uint8_t alignment_log2) noexcept {
    live_key* key = find_key(p);
    if (key == nullptr) [[unlikely]] {
      return find_recent_free(p) != nullptr ? release_result::double_free
                                            : release_result::unknown;
    }
    if (key->bytes != bytes || key->alignment_log2 != alignment_log2) [[unlikely]] {
      return release_result::size_mismatch;
    }
    remember_free(key->record);
    erase(key);
    used_bytes_.store(used_bytes_.load(std::memory_order_relaxed) - bytes,
                      std::memory_order_relaxed);  // under the lock: see count_allocation
    return release_result::freed;
  }

  /// The most recent remembered free of `p`, or nullptr. Linear, but only bad frees ask.
  [[nodiscard]] const tracked_allocation* find_recent_free(const void* p) const noexcept {
    // Newest first: the ring's order is the shard's order of frees (sequence numbers are
    // per thread, so they cannot tell which of two threads' frees came last).
    for (std::size_t back = 1; back <= remembered_frees; ++back) {
      const std::uint32_t index = recent_frees_[(next_recent_free_ - back) % remembered_frees];
      if (index != no_record && records_[index].pointer == p) {
        return &records_[index];
      }
    }
    return nullptr;
  }

  /// Calls `visit(record)` for every live allocation.
  template <class Visit>
  void for_each(Visit&& visit) const {
    for (const live_key& key : keys_) {
      if (key.pointer != nullptr) {
        visit(records_[key.record]);
      }
    }
  }

 private:
  static constexpr unsigned shard_bits = 4;  // 16 shards: see allocation_table
  static constexpr std::uint32_t no_record = ~std::uint32_t{0};

  struct alignas(32) live_key {  // two to a cache line, none across two
    void* pointer = nullptr;  // nullptr: an empty slot
    std::size_t bytes = 0;
    std::uint32_t record = 0;  // index into records_
    std::uint8_t alignment_log2 = 0;
  };

  [[nodiscard]] std::size_t home_of(const void* p) const noexcept {
    return static_cast<std::size_t>(hash_pointer(p) >> (64 - shard_bits - table_bits_)) & mask_;
  }

  [[nodiscard]] live_key* find_key(const void* p) noexcept {
    if (keys_.empty()) {
      return nullptr;
    }
    for (std::size_t i = home_of(p);; i = (i + 1) & mask_) {
      if (keys_[i].pointer == p) {
        return &keys_[i];
      }
      if (keys_[i].pointer == nullptr) {
        return nullptr;
      }
    }
  }

  /// Removes `found`. Later keys of its probe run move back into the hole, so lookups never
  /// need tombstones. (Only keys move: records stay where they are.)
  void erase(live_key* found) noexcept {
    auto hole = static_cast<std::size_t>(found - keys_.data());
    for (std::size_t next = (hole + 1) & mask_; keys_[next].pointer != nullptr;
         next = (next + 1) & mask_) {
      const std::size_t home = home_of(keys_[next].pointer);
      // The key may move back to the hole if the hole is not before its home slot
      // (cyclically): its distance from home is at least its distance from the hole.
      if (((next - home) & mask_) >= ((next - hole) & mask_)) {
        keys_[hole] = keys_[next];
        hole = next;
      }
    }
    keys_[hole].pointer = nullptr;
    --size_;
  }

  /// A record slot for a new allocation: one that fell out of the recent-free ring, else a
  /// new one (add() made sure there is room, so this cannot throw).
  std::uint32_t take_record() noexcept {
    if (!reusable_.empty()) {
      const std::uint32_t index = reusable_.back();
      reusable_.pop_back();
      return index;
    }
    records_.emplace_back();
    return static_cast<std::uint32_t>(records_.size() - 1);
  }

  /// Puts a freed record in the ring; the one it pushes out becomes reusable. `reusable_`
  /// has room for every record (grow_records), so this cannot throw.
  void remember_free(std::uint32_t index) noexcept {
    std::uint32_t& oldest = recent_frees_[next_recent_free_ % remembered_frees];
    if (oldest != no_record) {
      reusable_.push_back(oldest);
    }
    oldest = index;
    ++next_recent_free_;
  }

  void grow_keys() {
    const unsigned bits = keys_.empty() ? 6 : table_bits_ + 1;  // 64 slots to start
    std::vector<live_key> old(std::size_t{1} << bits);
    old.swap(keys_);  // the only step that can throw is done: nothing below can
    table_bits_ = bits;
    mask_ = keys_.size() - 1;
    for (const live_key& key : old) {
      if (key.pointer != nullptr) {
        std::size_t i = home_of(key.pointer);
        while (keys_[i].pointer != nullptr) {
          i = (i + 1) & mask_;
        }
        keys_[i] = key;
      }
    }
  }

  void grow_records() {
    const std::size_t capacity = records_.empty() ? 64 : 2 * records_.capacity();
    if (capacity > no_record) {
      throw std::bad_alloc{};
    }
    reusable_.reserve(capacity);  // first: if the next throws, a larger reserve is harmless
    records_.reserve(capacity);
  }

  friend class allocation_table;

  spin_lock mutex_;
  std::vector<live_key> keys_;  // a power of two long, at most half full
  std::size_t size_ = 0;
  std::size_t mask_ = 0;
  unsigned table_bits_ = 0;
  std::vector<tracked_allocation> records_;  // never shrinks; reserved ahead (grow_records)
  std::vector<std::uint32_t> reusable_;      // record slots free for new allocations
  std::array<std::uint32_t, remembered_frees> recent_frees_ = filled_with_no_record();
  std::size_t next_recent_free_ = 0;
  std::atomic<std::size_t> used_bytes_{0};  // written under the lock only (count_allocation)
  std::atomic<std::size_t> bytes_at_last_sum_{0};  // see count_allocation and mark_summed

  static constexpr std::array<std::uint32_t, remembered_frees> filled_with_no_record() {
    std::array<std::uint32_t, remembered_frees> ring{};
    ring.fill(no_record);
    return ring;
  }
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
