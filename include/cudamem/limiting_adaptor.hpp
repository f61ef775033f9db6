// cudamem/limiting_adaptor.hpp — a byte budget over any resource: a request that would take
// the bytes in use past the budget fails with `out_of_memory` (verdict `budget`) before the
// upstream is asked.
//
//   cudamem::limiting_adaptor capped{pool, 4ull << 30};      // this component: 4 GiB at most
//   try {
//     void* p = capped.allocate(6ull << 30, 256, stream);
//   } catch (const cudamem::out_of_memory& e) {
//     // e.verdict() == oom_verdict::budget; e.report() shows the budget and the bytes in use
//   }
//
// Contract
// - Counts requested bytes (not what the upstream rounds them to). An allocation succeeds
//   only if bytes in use + bytes <= budget, and the upstream gives the memory; either failure
//   leaves the count unchanged. Frees return their bytes to the budget.
// - Over the budget: `out_of_memory` whose report starts at this adaptor, with
//   `stats().budget` set and the verdict `budget`. A failure of the upstream passes through
//   with the upstream's verdict (the report starts here, so it shows the budget too).
// - Thread-safe and exact under concurrency: the budget is reserved with one atomic
//   compare-and-swap before the upstream is asked, so two threads can never both pass it.
// - `set_budget` may lower the budget below what is in use: nothing is taken back, later
//   requests fail until enough is freed.
// - Its out-of-memory advice (memory_report's hint) names the budget, what is in use through
//   it, and set_budget().
#pragma once

#include <cudamem/detail/adaptors/adaptor_base.hpp>
#include <cudamem/detail/adaptors/owner_bias.hpp>
#include <cudamem/detail/sync/atomic.hpp>
#include <cudamem/memory_resource.hpp>
#include <cudamem/out_of_memory.hpp>

#include <cstddef>
#include <string>
#include <string_view>

namespace cudamem {

/// A byte budget over its upstream: a request past the budget throws `out_of_memory`.
class limiting_adaptor final : public detail::adaptor_base<limiting_adaptor> {
 public:
  /// At most `budget_bytes` in use through it, from `upstream` (referred to, not owned).
  limiting_adaptor(memory_resource& upstream, std::size_t budget_bytes) noexcept
      : adaptor_base(upstream), budget_(budget_bytes) {}

  /// The budget now, in bytes.
  [[nodiscard]] std::size_t budget() const noexcept {
    return budget_.load(detail::memory_order_relaxed);
  }
  /// A new budget, from the next request on; nothing in use is taken back.
  void set_budget(std::size_t budget_bytes) noexcept {
    budget_.store(budget_bytes, detail::memory_order_relaxed);
  }
  /// Bytes handed out through this adaptor and not yet freed.
  [[nodiscard]] std::size_t used_bytes() const noexcept {
    return used_.load(detail::memory_order_relaxed);
  }

 private:
  friend class detail::adaptor_base<limiting_adaptor>;

  void* adapt_allocate(std::size_t bytes, std::size_t alignment, detail::request_stream stream) {
    std::size_t used = used_.load(detail::memory_order_relaxed);
    for (;;) {
      const std::size_t budget = budget_.load(detail::memory_order_relaxed);
      if (bytes > budget || used > budget - bytes) {  // written so that it cannot overflow
        throw_out_of_memory(*this, bytes, alignment,
                            "limiting_adaptor: " + format_bytes(used) + " in use + " +
                                format_bytes(bytes) + " requested > budget " +
                                format_bytes(budget),
                            oom_verdict::budget);
      }
      if (used_.compare_exchange_weak(used, used + bytes, detail::memory_order_relaxed)) {
        break;
      }
    }
    try {
      void* p = forward_allocate(bytes, alignment, stream);
      detail::raise_to(peak_, used + bytes);
      return p;
    } catch (...) {
      used_.fetch_sub(bytes, detail::memory_order_relaxed);  // the upstream failed: give it back
      throw;
    }
  }

  void adapt_deallocate(void* p, std::size_t bytes, std::size_t alignment,
                        detail::request_stream stream) noexcept {
    forward_deallocate(p, bytes, alignment, stream);
    used_.fetch_sub(bytes, detail::memory_order_relaxed);
  }

  std::string_view do_name() const noexcept override { return "limiting_adaptor"; }
  std::string do_oom_hint(const memory_report& report, std::size_t position) const override {
    const resource_stats& here = report.chain[position].stats;
    if (report.verdict != oom_verdict::budget || !here.budget ||
        here.used_bytes + report.requested_bytes <= *here.budget) {
      return {};  // not this budget: the rest of the chain knows better
    }
    return "This limiting_adaptor allows " + format_bytes(*here.budget) + " and has " +
           format_bytes(here.used_bytes) + " in use (" + format_bytes(here.peak_used_bytes) +
           " at most so far): raise its budget with set_budget(), or free buffers allocated "
           "through it before this request. The memory below it was not asked for.";
  }
  resource_stats do_stats() const override {
    resource_stats s;
    s.reserved_bytes = s.used_bytes = used_bytes();
    s.peak_used_bytes = peak_.load(detail::memory_order_relaxed);
    s.budget = budget();
    return s;
  }

  detail::atomic<std::size_t> budget_;
  detail::atomic<std::size_t> used_{0};
  detail::atomic<std::size_t> peak_{0};
};

}  // namespace cudamem
