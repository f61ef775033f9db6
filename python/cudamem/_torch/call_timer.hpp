// cudamem/_torch/call_timer.hpp — the host time of the allocator's own calls, counted only
// when asked (cudamem.torch.time_calls(True)): how many allocations and frees there were, and
// the nanoseconds each took from entry to return, in the thread that made it.
//
//   timed_calls mallocs;
//   std::atomic<bool> timing{true};
//   { const call_timer timed(timing, mallocs); ...the call... }   // counted: timing was on
//   mallocs.calls.load(); mallocs.ns.load();
//
// Why: a training process that runs slower than its twin with the same work (steps/s pairs)
// may lose the time in the allocator, or anywhere else. Counted inside the slow process, the
// allocator's share per step says which, where steps/s alone cannot.
//
// Contract: off (the default), a timer costs one relaxed load and a branch. On, it reads
// std::chrono::steady_clock twice (tens of ns, counted in the figures) and adds to two relaxed
// atomics: the counts are exact, and readable at any time from any thread. A call that throws
// (an out-of-memory error) is counted too. PyTorch-free.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>

namespace cudamem::torch_bridge {

/// Calls of one kind, and the host nanoseconds they took in all.
struct timed_calls {
  std::atomic<std::uint64_t> calls{0};
  std::atomic<std::uint64_t> ns{0};
};

/// Counts the scope it lives in into `into`, if `on` was set when it began.
class call_timer {
 public:
  call_timer(const std::atomic<bool>& on, timed_calls& into) noexcept
      : into_(on.load(std::memory_order_relaxed) ? &into : nullptr),
        start_(into_ != nullptr ? clock::now() : clock::time_point{}) {}
  ~call_timer() {
    if (into_ != nullptr) {
      const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(clock::now() - start_);
      into_->calls.fetch_add(1, std::memory_order_relaxed);
      into_->ns.fetch_add(static_cast<std::uint64_t>(ns.count()), std::memory_order_relaxed);
    }
  }
  call_timer(const call_timer&) = delete;
  call_timer& operator=(const call_timer&) = delete;

 private:
  using clock = std::chrono::steady_clock;
  timed_calls* into_;
  clock::time_point start_;
};

}  // namespace cudamem::torch_bridge
