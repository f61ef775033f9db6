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
// - Every request is forwarded unchanged (same form: stream-ordered or synchronous) and
//   counted after it succeeded; a failed allocation counts nothing and its `out_of_memory`
//   passes through (with a report that now starts at this adaptor).
// - `counters()`: bytes in use now (`current_bytes`), the most there has been (`peak_bytes`),
//   the sum of all bytes allocated and freed, and the number of allocations and frees.
//   Counted in requested bytes (what callers asked for, not what the upstream rounded to).
// - Thread-safe. The counters are relaxed atomics: each is exact, but a `counters()` taken
//   while other threads allocate may mix moments (e.g. current from just before a free whose
//   count is already in). Cost: a few uncontended atomic adds per request.
// - `scope` counts what passes through the adaptor, from any thread, between its construction
//   and its destruction; scopes nest and overlap freely. Its `peak_bytes` is the most that
//   `current_bytes` rose above its value when the scope opened. Scopes cost nothing while none
//   is open; while one is, each allocation also takes a mutex to update the scopes' peaks.
//   A scope must not outlive its adaptor; it is neither copyable nor movable.
// - `stats()` reports the bytes in use through this adaptor as both reserved and used (an
//   adaptor holds nothing of its own), so a `memory_report` shows what passed through here.
#pragma once

#include <cudamem/detail/adaptor_base.hpp>
#include <cudamem/memory_resource.hpp>

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <mutex>
#include <string_view>
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

class statistics_adaptor final : public detail::adaptor_base<statistics_adaptor> {
 public:
  explicit statistics_adaptor(memory_resource& upstream) noexcept : adaptor_base(upstream) {}

  /// Everything since construction; see the contract for how exact it is under concurrency.
  [[nodiscard]] allocation_counters counters() const noexcept {
    allocation_counters c;
    c.allocated_bytes = allocated_bytes_.load(std::memory_order_relaxed);
    c.freed_bytes = freed_bytes_.load(std::memory_order_relaxed);
    c.current_bytes = c.allocated_bytes > c.freed_bytes ? c.allocated_bytes - c.freed_bytes : 0;
    c.peak_bytes = peak_bytes_.load(std::memory_order_relaxed);
    c.allocations = allocations_.load(std::memory_order_relaxed);
    c.deallocations = deallocations_.load(std::memory_order_relaxed);
    return c;
  }

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
    allocations_.fetch_add(1, std::memory_order_relaxed);
    const std::size_t allocated =
        allocated_bytes_.fetch_add(bytes, std::memory_order_relaxed) + bytes;
    // Current = allocated - freed; reading `freed` late can only overstate the current value by
    // frees that raced with us, never invent a peak that was not (almost) reached.
    const std::size_t freed = freed_bytes_.load(std::memory_order_relaxed);
    const std::size_t current = allocated > freed ? allocated - freed : 0;
    detail::raise_to(peak_bytes_, current);
    if (any_scope_open_.load(std::memory_order_relaxed)) [[unlikely]] {
      const std::lock_guard lock(scopes_mutex_);
      for (scope* s : open_scopes_) {
        s->highest_current_ = std::max(s->highest_current_, current);
      }
    }
    return p;
  }

  void adapt_deallocate(void* p, std::size_t bytes, std::size_t alignment,
                        detail::request_stream stream) noexcept {
    forward_deallocate(p, bytes, alignment, stream);
    freed_bytes_.fetch_add(bytes, std::memory_order_relaxed);
    deallocations_.fetch_add(1, std::memory_order_relaxed);
  }

  std::string_view do_name() const noexcept override { return "statistics_adaptor"; }
  resource_stats do_stats() const override {
    const allocation_counters c = counters();
    resource_stats s;
    s.reserved_bytes = s.used_bytes = c.current_bytes;
    s.peak_used_bytes = c.peak_bytes;
    return s;
  }

  // Bytes are counted as two running sums rather than one "current" counter: then an
  // allocation is one atomic add for the bytes and one for the count, and "current" and
  // "total" both come out of the same two numbers.
  std::atomic<std::size_t> allocated_bytes_{0};
  std::atomic<std::size_t> freed_bytes_{0};
  std::atomic<std::size_t> peak_bytes_{0};
  std::atomic<std::size_t> allocations_{0};
  std::atomic<std::size_t> deallocations_{0};

  std::atomic<bool> any_scope_open_{false};
  mutable std::mutex scopes_mutex_;
  std::vector<scope*> open_scopes_;  // guarded by scopes_mutex_
};

}  // namespace cudamem
