// cudamem/statistics_adaptor.hpp — cheap counters over any resource: bytes in use now, the
// peak, the totals, and how many allocations and frees; plus scopes that answer "how much did
// this phase allocate?".
//
//   cudamem::statistics_adaptor counted{pool};
//   {
//     cudamem::statistics_adaptor::scope forward_pass{counted};
//     run_forward(counted);
//     auto c = forward_pass.counters();   // what this phase did, from every thread
//     std::printf("forward: peak +%zu bytes, %zu allocations\n", c.peak_bytes, c.allocations);
//   }
//   auto all = counted.counters();        // since the adaptor was made
//
//   // Threads racing each other, and a peak that must be exact anyway (one atomic per request):
//   cudamem::statistics_adaptor strict{pool, {.exact_peak = true}};
//
// Contract
// - Every request is forwarded unchanged (same form: stream-ordered or synchronous). An
//   allocation is counted after it succeeded (a failed one counts nothing, and its
//   `out_of_memory` passes through with a report that now starts at this adaptor); a free is
//   counted before it is forwarded. So the count never holds bytes the upstream has already
//   handed to someone else: with `exact_peak`, the peak never passes what the upstream held.
// - `counters()`: bytes in use now (`current_bytes`), the most there has been (`peak_bytes`),
//   the sum of all bytes allocated and freed, and the number of allocations and frees.
//   Counted in requested bytes (what callers asked for, not what the upstream rounded to).
// - Thread-safe. Totals and counts are exact. `current_bytes` is exact whenever no request is
//   in flight. `peak_bytes` is exact whenever requests do not overlap in time: one thread, or
//   threads that take turns (a mutex, a join, a queue between them). Requests that do overlap
//   can move it by at most the bytes they carry, either way: a peak that lasted only while a
//   free on one thread raced an allocation on another may be missed, or one may be seen that
//   never quite existed. `statistics_options::exact_peak` makes it exact under any
//   concurrency, for one atomic instruction per request on a counter every thread writes.
// - Cost (default): no atomic read-modify-write instruction and no write to a cache line that
//   another thread writes. Each thread counts in a slot of its own (one cache line): its
//   totals, its counts and its balance (bytes it allocated minus bytes it freed; negative for
//   a thread that frees what others allocated). The bytes in use are the balances added up.
//   The peak is recomputed (balances added up) only when an allocation takes its thread's
//   balance above what it was at the last such sum: if no balance is above its mark, the
//   total is at most the last sum, which the peak already holds. A thread in steady state
//   (allocating and freeing around a level it has reached before) never sums. A thread whose
//   balance only grows (it allocates what other threads free) sums at every allocation,
//   reading lines the other threads write: about what the shared counter of `exact_peak`
//   would cost it, and never worse for the threads that free.
//   The first 64 threads that use an adaptor get a slot each (a thread that ends leaves its
//   slot to the next thread given its id); further threads share one slot, updated with
//   atomic adds (exact, a little slower).
// - `scope` counts what passes through the adaptor, from any thread, between its construction
//   and its destruction; scopes nest and overlap freely. Its `peak_bytes` is the most that
//   `current_bytes` rose above its value when the scope opened (exact as the adaptor's peak
//   is). Opening a scope sums the balances; while one is open, each sum also takes a mutex to
//   raise the scopes' peaks. A scope must not outlive its adaptor; it is neither copyable nor
//   movable.
// - `stats()` reports the bytes in use through this adaptor as both reserved and used (an
//   adaptor holds nothing of its own), so a `memory_report` shows what passed through here.
#pragma once

#include <cudamem/detail/adaptor_base.hpp>
#include <cudamem/memory_resource.hpp>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string_view>
#include <thread>
#include <vector>

namespace cudamem {

/// What a statistics_adaptor (or one of its scopes) has seen.
struct allocation_counters {
  std::size_t current_bytes = 0;    ///< in use now (for a scope: in use now minus at its start,
                                    ///< 0 if less)
  std::size_t peak_bytes = 0;       ///< the most in use (for a scope: the most above its start)
  std::size_t allocated_bytes = 0;  ///< the sum of all bytes allocated
  std::size_t freed_bytes = 0;      ///< the sum of all bytes freed
  std::size_t allocations = 0;      ///< successful allocations
  std::size_t deallocations = 0;    ///< frees

  /// Allocations not yet freed (for a scope: allocations in it minus frees in it, 0 if less).
  [[nodiscard]] std::size_t live_allocations() const noexcept {
    return allocations > deallocations ? allocations - deallocations : 0;
  }
};

/// How a statistics_adaptor counts.
struct statistics_options {
  /// Keep the bytes in use in one counter that every thread updates atomically, so the peak
  /// is exact even while threads allocate and free at once (see the contract for what the
  /// default gives instead, and what this costs).
  bool exact_peak = false;
};

namespace detail {

/// What one thread has added to a statistics_adaptor. Written only by the thread that owns it
/// (plain load + store, no locked instruction) unless `shared` is set, when every thread
/// without a slot of its own adds to it atomically.
struct alignas(64) counter_slot {
  std::atomic<std::thread::id> owner{};  // default id: free
  bool shared = false;
  std::atomic<std::int64_t> balance{0};  // bytes allocated minus bytes freed, by this thread
  std::atomic<std::int64_t> mark{0};     // the balance at the last sum that set marks
  std::atomic<std::size_t> allocated_bytes{0};
  std::atomic<std::size_t> freed_bytes{0};
  std::atomic<std::size_t> allocations{0};
  std::atomic<std::size_t> deallocations{0};

  /// Counts an allocation of `bytes`; returns the balance after it.
  std::int64_t count_allocation(std::size_t bytes) noexcept {
    const auto signed_bytes = static_cast<std::int64_t>(bytes);
    if (shared) [[unlikely]] {
      allocations.fetch_add(1, std::memory_order_relaxed);
      allocated_bytes.fetch_add(bytes, std::memory_order_relaxed);
      return balance.fetch_add(signed_bytes, std::memory_order_relaxed) + signed_bytes;
    }
    bump(allocations, std::size_t{1});
    bump(allocated_bytes, bytes);
    return bump(balance, signed_bytes);
  }

  /// Counts a free of `bytes`.
  void count_free(std::size_t bytes) noexcept {
    const auto signed_bytes = static_cast<std::int64_t>(bytes);
    if (shared) [[unlikely]] {
      deallocations.fetch_add(1, std::memory_order_relaxed);
      freed_bytes.fetch_add(bytes, std::memory_order_relaxed);
      balance.fetch_sub(signed_bytes, std::memory_order_relaxed);
      return;
    }
    bump(deallocations, std::size_t{1});
    bump(freed_bytes, bytes);
    bump(balance, -signed_bytes);
  }

 private:
  /// Only this thread writes `counter`: a plain read-modify-write is exact. (Other threads
  /// read it with relaxed loads; the atomic type is what makes that read well-defined.)
  template <class T>
  static T bump(std::atomic<T>& counter, T value) noexcept {
    const T sum = counter.load(std::memory_order_relaxed) + value;
    counter.store(sum, std::memory_order_relaxed);
    return sum;
  }
};

/// Which slot this thread uses in the adaptors it used last (most recent first). Keyed by an
/// id no other adaptor in the process ever has, so a new adaptor at a dead one's address
/// never finds the dead one's slot.
struct counter_slot_cache {
  static constexpr std::size_t ways = 4;
  std::array<std::uint64_t, ways> adaptor{};  // 0: empty
  std::array<counter_slot*, ways> slot{};
};
inline thread_local counter_slot_cache this_thread_counter_slots;

/// A process-wide unique id for each statistics_adaptor (never 0).
inline std::uint64_t next_statistics_adaptor_id() noexcept {
  static std::atomic<std::uint64_t> next{1};
  return next.fetch_add(1, std::memory_order_relaxed);
}

}  // namespace detail

class statistics_adaptor final : public detail::adaptor_base<statistics_adaptor> {
 public:
  /// Threads that get a counter slot of their own (see the contract).
  static constexpr std::size_t thread_slots = 64;

  explicit statistics_adaptor(memory_resource& upstream, statistics_options options = {})
      : adaptor_base(upstream),
        exact_peak_(options.exact_peak),
        id_(detail::next_statistics_adaptor_id()),
        slots_(std::make_unique<detail::counter_slot[]>(thread_slots + 1)) {
    slots_[thread_slots].shared = true;  // the last one: for threads beyond the first 64
  }

  /// Everything since construction; see the contract for how exact it is under concurrency.
  [[nodiscard]] allocation_counters counters() const noexcept {
    allocation_counters c;
    for (std::size_t i = 0; i <= thread_slots; ++i) {
      const detail::counter_slot& slot = slots_[i];
      c.allocated_bytes += slot.allocated_bytes.load(std::memory_order_relaxed);
      c.freed_bytes += slot.freed_bytes.load(std::memory_order_relaxed);
      c.allocations += slot.allocations.load(std::memory_order_relaxed);
      c.deallocations += slot.deallocations.load(std::memory_order_relaxed);
    }
    c.current_bytes = current_bytes(/*mark=*/false);
    detail::raise_to(peak_bytes_, c.current_bytes);  // a sum is a moment the peak may not know
    c.peak_bytes = peak_bytes_.load(std::memory_order_relaxed);
    return c;
  }

  /// Counts what passes through `adaptor` while it lives; see the contract.
  class scope {
   public:
    explicit scope(statistics_adaptor& adaptor) : adaptor_(&adaptor) {
      const std::lock_guard lock(adaptor.scopes_mutex_);
      start_ = adaptor.counters();
      // Sum with marks, so that from here the total cannot rise above start_ without a sum
      // that raises this scope's highest (see the contract).
      start_.current_bytes = adaptor.current_bytes(/*mark=*/true);
      highest_current_ = start_.current_bytes;
      adaptor.open_scopes_.push_back(this);
      adaptor.any_scope_open_.store(true, std::memory_order_relaxed);
    }
    ~scope() {
      const std::lock_guard lock(adaptor_->scopes_mutex_);
      std::erase(adaptor_->open_scopes_, this);
      adaptor_->any_scope_open_.store(!adaptor_->open_scopes_.empty(), std::memory_order_relaxed);
    }
    scope(const scope&) = delete;
    scope& operator=(const scope&) = delete;

    /// What passed through the adaptor since this scope opened.
    [[nodiscard]] allocation_counters counters() const {
      const std::lock_guard lock(adaptor_->scopes_mutex_);
      const allocation_counters now = adaptor_->counters();
      allocation_counters c;
      c.allocated_bytes = now.allocated_bytes - start_.allocated_bytes;
      c.freed_bytes = now.freed_bytes - start_.freed_bytes;
      c.allocations = now.allocations - start_.allocations;
      c.deallocations = now.deallocations - start_.deallocations;
      c.current_bytes = now.current_bytes > start_.current_bytes
                            ? now.current_bytes - start_.current_bytes
                            : 0;
      c.peak_bytes = std::max(highest_current_, now.current_bytes) - start_.current_bytes;
      return c;
    }

   private:
    friend class statistics_adaptor;
    statistics_adaptor* adaptor_;
    allocation_counters start_;
    std::size_t highest_current_ = 0;  // guarded by the adaptor's scopes_mutex_
  };

 private:
  friend class detail::adaptor_base<statistics_adaptor>;

  void* adapt_allocate(std::size_t bytes, std::size_t alignment, detail::request_stream stream) {
    void* p = forward_allocate(bytes, alignment, stream);
    detail::counter_slot& mine = this_thread_slot();
    const std::int64_t balance = mine.count_allocation(bytes);
    if (exact_peak_) [[unlikely]] {
      const std::size_t now = exact_current_.fetch_add(bytes, std::memory_order_relaxed) + bytes;
      if (now > peak_bytes_.load(std::memory_order_relaxed) ||
          any_scope_open_.load(std::memory_order_relaxed)) {
        new_total(now);
      }
    } else if (balance > mine.mark.load(std::memory_order_relaxed)) [[unlikely]] {
      new_total(current_bytes(/*mark=*/true));  // only now can the total pass every sum
    }
    return p;
  }

  void adapt_deallocate(void* p, std::size_t bytes, std::size_t alignment,
                        detail::request_stream stream) noexcept {
    // Counted before it is forwarded: once the upstream has it back, another thread may be
    // given the same bytes, and counting both at once would show a total that never was.
    this_thread_slot().count_free(bytes);
    if (exact_peak_) [[unlikely]] {
      exact_current_.fetch_sub(bytes, std::memory_order_relaxed);
    }
    forward_deallocate(p, bytes, alignment, stream);
  }

  /// The bytes in use: the exact counter, or the slots' balances added up (0 if a sum taken
  /// while threads race comes out below zero). With `mark`, each slot's balance is remembered
  /// as its mark, which adapt_allocate compares with.
  [[nodiscard]] std::size_t current_bytes(bool mark) const noexcept {
    if (exact_peak_) {
      return exact_current_.load(std::memory_order_relaxed);
    }
    std::int64_t total = 0;
    const auto add = [&](std::size_t i) {
      const std::int64_t balance = slots_[i].balance.load(std::memory_order_relaxed);
      // (A sum writes a mark only where it changed: rewriting the same value would still
      // take the line from the slot's owner.)
      if (mark && slots_[i].mark.load(std::memory_order_relaxed) != balance) {
        slots_[i].mark.store(balance, std::memory_order_relaxed);
      }
      total += balance;
    };
    const std::size_t claimed = slots_claimed_.load(std::memory_order_relaxed);
    for (std::size_t i = 0; i < claimed; ++i) {
      add(i);
    }
    add(thread_slots);  // the shared slot
    return total > 0 ? static_cast<std::size_t>(total) : 0;
  }

  /// A sum that may be a new peak: raises the adaptor's and every open scope's.
  [[gnu::noinline]] void new_total(std::size_t total) noexcept {
    detail::raise_to(peak_bytes_, total);
    if (any_scope_open_.load(std::memory_order_relaxed)) {
      const std::lock_guard lock(scopes_mutex_);
      for (scope* s : open_scopes_) {
        s->highest_current_ = std::max(s->highest_current_, total);
      }
    }
  }


  /// The calling thread's slot: from its cache when it used this adaptor lately, else found
  /// or claimed (see the contract).
  detail::counter_slot& this_thread_slot() noexcept {
    detail::counter_slot_cache& cache = detail::this_thread_counter_slots;
    if (cache.adaptor[0] == id_) [[likely]] {
      return *cache.slot[0];
    }
    return find_slot(cache);
  }

  [[gnu::noinline]] detail::counter_slot& find_slot(detail::counter_slot_cache& cache) noexcept {
    std::size_t way = 1;
    while (way + 1 < detail::counter_slot_cache::ways && cache.adaptor[way] != id_) {
      ++way;
    }
    detail::counter_slot* slot = cache.adaptor[way] == id_ ? cache.slot[way] : claim_slot();
    // Most recent first: shift the others down over `way` (the oldest falls out if missed).
    for (; way > 0; --way) {
      cache.adaptor[way] = cache.adaptor[way - 1];
      cache.slot[way] = cache.slot[way - 1];
    }
    cache.adaptor[0] = id_;
    cache.slot[0] = slot;
    return *slot;
  }

  /// The slot this thread owns (a thread that ended with this id left it), a free one, or the
  /// shared one.
  detail::counter_slot* claim_slot() noexcept {
    const std::thread::id me = std::this_thread::get_id();
    for (std::size_t i = 0; i < thread_slots; ++i) {
      if (slots_[i].owner.load(std::memory_order_relaxed) == me) {
        return &slots_[i];
      }
    }
    for (std::size_t i = 0; i < thread_slots; ++i) {
      std::thread::id free{};
      if (slots_[i].owner.compare_exchange_strong(free, me, std::memory_order_relaxed)) {
        detail::raise_to(slots_claimed_, i + 1);  // sums read slots [0, slots_claimed_)
        return &slots_[i];
      }
    }
    return &slots_[thread_slots];
  }

  std::string_view do_name() const noexcept override { return "statistics_adaptor"; }
  resource_stats do_stats() const override {
    const allocation_counters c = counters();
    resource_stats s;
    s.reserved_bytes = s.used_bytes = c.current_bytes;
    s.peak_used_bytes = c.peak_bytes;
    return s;
  }

  const bool exact_peak_;
  const std::uint64_t id_;                          // see counter_slot_cache
  std::unique_ptr<detail::counter_slot[]> slots_;   // thread_slots own, then the shared one
  std::atomic<std::size_t> slots_claimed_{0};       // slots [0, this) have had an owner
  mutable std::atomic<std::size_t> peak_bytes_{0};  // raised by new_total and counters()
  std::atomic<std::size_t> exact_current_{0};       // the bytes in use, with exact_peak only

  std::atomic<bool> any_scope_open_{false};
  mutable std::mutex scopes_mutex_;
  std::vector<scope*> open_scopes_;  // guarded by scopes_mutex_
};

}  // namespace cudamem
