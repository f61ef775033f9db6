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
// Contract
// - Every request is forwarded unchanged (same form: stream-ordered or synchronous). An
//   allocation is counted after it succeeded (a failed one counts nothing, and its
//   `out_of_memory` passes through with a report that now starts at this adaptor); a free is
//   counted before it is forwarded. So the count never holds bytes the upstream has already
//   handed to someone else: the peak never passes what the upstream held.
// - `counters()`: bytes in use now (`current_bytes`), the most there has been (`peak_bytes`),
//   the sum of all bytes allocated and freed, and the number of allocations and frees.
//   Counted in requested bytes (what callers asked for, not what the upstream rounded to).
// - Thread-safe, and every counter is exact, the peak included, however threads race. A
//   `counters()` taken while other threads allocate may mix moments (e.g. current from just
//   before a free whose count is already in).
// - Cost. Totals and counts: plain adds to a slot of the calling thread's own (one cache
//   line), never a locked instruction; the first 64 threads that use an adaptor get a slot
//   each (a thread that ends leaves its slot to the next thread given its id), further
//   threads share one, updated with atomic adds. Bytes in use and the peak: one counter,
//   which the first thread to use the adaptor updates with plain stores while it is the only
//   one (detail/adaptors/owner_bias.hpp); once a second thread has used it, every thread adds to it
//   atomically (one locked instruction per request; the exact peak needs every thread's
//   bytes in one place). Switching costs the second thread one system call, once.
//   `owned_by_one_thread()` says which it is.
// - `scope` counts what passes through the adaptor, from any thread, between its construction
//   and its destruction; scopes nest and overlap freely. Its `peak_bytes` is the most that
//   `current_bytes` rose above its value when the scope opened. Scopes cost nothing while none
//   is open; while one is, each allocation also takes a mutex to update the scopes' peaks.
//   A scope must not outlive its adaptor; it is neither copyable nor movable.
// - `stats()` reports the bytes in use through this adaptor as both reserved and used (an
//   adaptor holds nothing of its own), so a `memory_report` shows what passed through here.
#pragma once

#include <cudamem/detail/adaptors/adaptor_base.hpp>
#include <cudamem/detail/adaptors/owner_bias.hpp>
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

namespace detail {

/// The totals and counts one thread has added to a statistics_adaptor. Written only by the
/// thread that owns it (plain load + store, no locked instruction) unless `shared` is set,
/// when every thread without a slot of its own adds to it atomically.
struct alignas(64) counter_slot {
  std::atomic<std::thread::id> owner{};  // default id: free
  bool shared = false;
  std::atomic<std::size_t> allocated_bytes{0};
  std::atomic<std::size_t> freed_bytes{0};
  std::atomic<std::size_t> allocations{0};
  std::atomic<std::size_t> deallocations{0};

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
  static std::atomic<std::uint64_t> next{1};
  return next.fetch_add(1, std::memory_order_relaxed);
}

}  // namespace detail

class statistics_adaptor final : public detail::adaptor_base<statistics_adaptor> {
 public:
  /// Threads that get a counter slot of their own (see the contract).
  static constexpr std::size_t thread_slots = 64;

  explicit statistics_adaptor(memory_resource& upstream)
      : adaptor_base(upstream),
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
    c.current_bytes = current_bytes_.load(std::memory_order_relaxed);
    c.peak_bytes = peak_bytes_.load(std::memory_order_relaxed);
    return c;
  }

  /// True while one thread has used this adaptor and counts the bytes in use without atomic
  /// instructions (see the contract); false once a second thread has, or where the system
  /// cannot support it.
  [[nodiscard]] bool owned_by_one_thread() const noexcept { return bias_.owned(); }

  /// Counts what passes through `adaptor` while it lives; see the contract.
  class scope {
   public:
    explicit scope(statistics_adaptor& adaptor) : adaptor_(&adaptor) {
      const std::lock_guard lock(adaptor.scopes_mutex_);
      start_ = adaptor.counters();
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
      c.peak_bytes = highest_current_ - start_.current_bytes;
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
    this_thread_slot().count_allocation(bytes);
    const bool alone = bias_.enter();  // this thread is the only one: no atomic instruction
    const std::size_t now = detail::add_to_counter(current_bytes_, bytes, alone);
    detail::raise_peak(peak_bytes_, now, alone);
    if (alone) {
      bias_.leave();
    }
    if (any_scope_open_.load(std::memory_order_relaxed)) [[unlikely]] {
      raise_scopes(now);
    }
    return p;
  }

  void adapt_deallocate(void* p, std::size_t bytes, std::size_t alignment,
                        detail::request_stream stream) noexcept {
    // Counted before it is forwarded: once the upstream has it back, another thread may be
    // given the same bytes, and counting both at once would show a total that never was.
    this_thread_slot().count_free(bytes);
    const bool alone = bias_.enter();
    detail::add_to_counter(current_bytes_, std::size_t{0} - bytes, alone);  // wraps: subtracts
    if (alone) {
      bias_.leave();
    }
    forward_deallocate(p, bytes, alignment, stream);
  }

  [[gnu::noinline]] void raise_scopes(std::size_t current) {
    const std::lock_guard lock(scopes_mutex_);
    for (scope* s : open_scopes_) {
      s->highest_current_ = std::max(s->highest_current_, current);
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
  detail::owner_bias bias_;  // who may update the two below without atomic instructions
  std::atomic<std::size_t> current_bytes_{0};
  std::atomic<std::size_t> peak_bytes_{0};

  std::atomic<bool> any_scope_open_{false};
  mutable std::mutex scopes_mutex_;
  std::vector<scope*> open_scopes_;  // guarded by scopes_mutex_
};

}  // namespace cudamem
