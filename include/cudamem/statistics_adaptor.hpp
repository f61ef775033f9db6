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
//   cudamem::statistics_adaptor exact{pool, {.peak_slack = 0}};  // an exact peak however
//                                                                 // threads race (see below)
//
// Contract
// - Every request is forwarded unchanged (same form: stream-ordered or synchronous). An
//   allocation is counted after it succeeded (a failed one counts nothing, and its
//   `out_of_memory` passes through with a report that now starts at this adaptor); a free is
//   counted before it is forwarded.
// - `counters()`: bytes in use now (`current_bytes`), the most there has been (`peak_bytes`),
//   the sum of all bytes allocated and freed, and the number of allocations and frees.
//   Counted in requested bytes (what callers asked for, not what the upstream rounded them to).
// - Thread-safe. Totals, counts and bytes in use are exact however threads race (each thread
//   counts in a slot of its own; `counters()` sums the slots). A `counters()` taken while
//   other threads allocate may mix moments (e.g. current from just before a free whose count
//   is already in).
// - The peak. Used from one thread (one slot), it is exact. When threads share the adaptor it
//   is a bound: never below the most bytes that were in use at once (counting an allocation
//   from its return and a free from its call), never above it by more than
//   `peak_error_bound()` = (2n - 1) x `peak_slack`, n being the threads that have counted
//   here (at most thread_slots; 4 MiB x 31 = 124 MiB for 16 threads with the default).
//   It is usually much closer: it is also never above the sum of each thread's own most,
//   which is the true peak when the threads' bytes rise and fall together. With
//   `peak_slack = 0` it is exact however threads race, and never passes what the upstream
//   held, at the cost of an atomic add on one shared cache line per request
//   (detail/adaptors/bytes_in_use.hpp explains the bound).
// - Cost. Each thread counts in a slot of its own (one cache line, plain adds, no locked
//   instruction); the first 64 threads that use an adaptor get a slot each (a thread that
//   ends leaves its slot to the next thread given its id), further threads share one, updated
//   with atomic adds. A thread's bytes in use reach the shared peak only when they have moved
//   by `peak_slack` since they last did (an atomic add and a compare-and-swap then), so threads
//   that share the adaptor do not take turns on one cache line.
// - `scope` counts what passes through the adaptor, from any thread, between its construction
//   and its destruction; scopes nest and overlap freely. Its `peak_bytes` is the most that
//   the bytes in use rose above their value when the scope opened, exact however threads race
//   (a request racing the scope's opening counts as before it). Scopes cost nothing while none
//   is open; while one is, each request also takes a mutex to update the open scopes.
//   A scope must not outlive its adaptor; it is neither copyable nor movable.
// - `stats()` reports the bytes in use through this adaptor as both reserved and used (an
//   adaptor holds nothing of its own), so a `memory_report` shows what passed through here.
#pragma once

#include <cudamem/detail/adaptors/adaptor_base.hpp>
#include <cudamem/detail/adaptors/bytes_in_use.hpp>
#include <cudamem/detail/sync/atomic.hpp>
#include <cudamem/detail/sync/mutex.hpp>
#include <cudamem/memory_resource.hpp>

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
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

/// How a statistics_adaptor counts the peak; see the contract.
struct statistics_options {
  /// How far one thread's bytes in use may move before the shared peak hears of it, when
  /// threads share the adaptor. The peak is then at most (2n - 1) x this above the true peak
  /// (n threads). 0: an exact peak, at one atomic add on a shared line per request.
  std::size_t peak_slack = std::size_t{4} << 20;
};

namespace detail {

/// What one thread has counted in a statistics_adaptor. Written only by the thread that owns
/// it (plain load + store, no locked instruction) unless `shared` is set, when every thread
/// without a slot of its own adds to it atomically.
struct alignas(64) counter_slot {
  detail::atomic<std::thread::id> owner{};  // default id: free
  bool shared = false;
  detail::atomic<std::size_t> allocated_bytes{0};
  detail::atomic<std::size_t> freed_bytes{0};
  detail::atomic<std::size_t> allocations{0};
  detail::atomic<std::size_t> deallocations{0};
  usage_part usage;  // this thread's bytes in use (see bytes_in_use.hpp)

  void count_allocation(std::size_t bytes) noexcept {
    add_to_counter(allocations, std::size_t{1}, !shared);
    add_to_counter(allocated_bytes, bytes, !shared);
  }
  void count_free(std::size_t bytes) noexcept {
    add_to_counter(deallocations, std::size_t{1}, !shared);
    add_to_counter(freed_bytes, bytes, !shared);
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
  static detail::atomic<std::uint64_t> next{1};
  return next.fetch_add(1, detail::memory_order_relaxed);
}

}  // namespace detail

/// Forwards to its upstream and counts: bytes and allocations in use, peaks, totals.
class statistics_adaptor final : public detail::adaptor_base<statistics_adaptor> {
 public:
  /// Threads that get a counter slot of their own (see the contract).
  static constexpr std::size_t thread_slots = 64;

  /// Counts what passes to `upstream` (referred to, not owned).
  explicit statistics_adaptor(memory_resource& upstream, statistics_options options = {})
      : adaptor_base(upstream),
        id_(detail::next_statistics_adaptor_id()),
        slots_(std::make_unique<detail::counter_slot[]>(thread_slots + 1)),
        usage_(options.peak_slack) {
    // The last one: for threads beyond the first 64. It publishes every change at once, so
    // it is never pending and need not be activated (see bytes_in_use.hpp).
    slots_[thread_slots].shared = true;
  }

  /// Everything since construction; see the contract for how exact it is under concurrency.
  [[nodiscard]] allocation_counters counters() const noexcept {
    allocation_counters c;
    std::size_t sum_of_most = 0;
    for (std::size_t i = 0; i <= thread_slots; ++i) {
      const detail::counter_slot& slot = slots_[i];
      c.allocated_bytes += slot.allocated_bytes.load(detail::memory_order_relaxed);
      c.freed_bytes += slot.freed_bytes.load(detail::memory_order_relaxed);
      c.allocations += slot.allocations.load(detail::memory_order_relaxed);
      c.deallocations += slot.deallocations.load(detail::memory_order_relaxed);
      c.current_bytes += slot.usage.balance();  // two's complement: a negative part subtracts
      sum_of_most += slot.usage.most();
    }
    // (Read while requests are in flight, the sum may have moved past the peak's last update.)
    c.peak_bytes = std::max(usage_.peak(sum_of_most), c.current_bytes);
    return c;
  }

  /// The most counters().peak_bytes may be above the true peak now (see the contract): 0
  /// while one thread has counted here, or with peak_slack 0.
  [[nodiscard]] std::size_t peak_error_bound() const noexcept {
    return usage_.peak_error_bound();
  }

  /// Counts what passes through `adaptor` while it lives; see the contract.
  class scope {
   public:
    /// Starts counting what passes through `adaptor` from now; it must outlive the scope.
    explicit scope(statistics_adaptor& adaptor) : adaptor_(&adaptor) {
      const detail::lock_guard lock(adaptor.scopes_mutex_);
      start_ = adaptor.counters();
      adaptor.open_scopes_.push_back(this);
      adaptor.any_scope_open_.store(true, detail::memory_order_relaxed);
    }
    ~scope() {
      const detail::lock_guard lock(adaptor_->scopes_mutex_);
      std::erase(adaptor_->open_scopes_, this);
      adaptor_->any_scope_open_.store(!adaptor_->open_scopes_.empty(), detail::memory_order_relaxed);
    }
    scope(const scope&) = delete;
    scope& operator=(const scope&) = delete;

    /// What passed through the adaptor since this scope opened.
    [[nodiscard]] allocation_counters counters() const {
      const detail::lock_guard lock(adaptor_->scopes_mutex_);
      const allocation_counters now = adaptor_->counters();
      allocation_counters c;
      c.allocated_bytes = now.allocated_bytes - start_.allocated_bytes;
      c.freed_bytes = now.freed_bytes - start_.freed_bytes;
      c.allocations = now.allocations - start_.allocations;
      c.deallocations = now.deallocations - start_.deallocations;
      c.current_bytes = detail::as_signed(change_) > 0 ? change_ : 0;
      c.peak_bytes = highest_change_;
      return c;
    }

   private:
    friend class statistics_adaptor;
    statistics_adaptor* adaptor_;
    allocation_counters start_;
    // Guarded by the adaptor's scopes_mutex_: the bytes in use since the scope opened (two's
    // complement), and the most that has been.
    std::size_t change_ = 0;
    std::size_t highest_change_ = 0;
  };

 private:
  friend class detail::adaptor_base<statistics_adaptor>;

  void* adapt_allocate(std::size_t bytes, std::size_t alignment, detail::request_stream stream) {
    void* p = forward_allocate(bytes, alignment, stream);
    detail::counter_slot& slot = this_thread_slot();
    slot.count_allocation(bytes);
    count_in_use(slot, bytes);
    return p;
  }

  void adapt_deallocate(void* p, std::size_t bytes, std::size_t alignment,
                        detail::request_stream stream) noexcept {
    // Counted before it is forwarded: once the upstream has it back, another thread may be
    // given the same bytes, and counting both at once would show a total that never was.
    detail::counter_slot& slot = this_thread_slot();
    slot.count_free(bytes);
    count_in_use(slot, std::size_t{0} - bytes);  // two's complement: subtracts
    forward_deallocate(p, bytes, alignment, stream);
  }

  /// Changes the bytes in use by `delta`, in `slot` and in the open scopes.
  void count_in_use(detail::counter_slot& slot, std::size_t delta) noexcept {
    if (!slot.shared) [[likely]] {
      usage_.add(slot.usage, delta);
    } else {
      usage_.add_shared(slot.usage, delta);
    }
    if (any_scope_open_.load(detail::memory_order_relaxed)) [[unlikely]] {
      count_in_scopes(delta);
    }
  }

  [[gnu::noinline]] void count_in_scopes(std::size_t delta) {
    const detail::lock_guard lock(scopes_mutex_);
    for (scope* s : open_scopes_) {
      s->change_ += delta;
      if (detail::as_signed(s->change_) > detail::as_signed(s->highest_change_)) {
        s->highest_change_ = s->change_;
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
      if (slots_[i].owner.load(detail::memory_order_relaxed) == me) {
        return &slots_[i];
      }
    }
    for (std::size_t i = 0; i < thread_slots; ++i) {
      std::thread::id free{};
      if (slots_[i].owner.compare_exchange_strong(free, me, detail::memory_order_relaxed)) {
        usage_.activate(slots_[i].usage);  // a new part of the bytes in use, once per slot
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

  const std::uint64_t id_;                         // see counter_slot_cache
  std::unique_ptr<detail::counter_slot[]> slots_;  // thread_slots own, then the shared one
  detail::bytes_in_use usage_;                     // the peak's shared side

  detail::atomic<bool> any_scope_open_{false};
  mutable detail::mutex scopes_mutex_;
  std::vector<scope*> open_scopes_;  // guarded by scopes_mutex_
};

}  // namespace cudamem
