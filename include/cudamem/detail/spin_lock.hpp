// cudamem/detail/spin_lock.hpp — a test-and-test-and-set lock for critical sections of a few
// dozen instructions: the lock of each pool_resource shard.
//
//   cudamem::detail::spin_lock lock;
//   { const std::lock_guard guard(lock); ...short work... }
//
// Why not std::mutex (for a student): an uncontended std::mutex costs a call into the C
// library and two atomic read-modify-write instructions (lock and unlock). Here the unlock is
// a plain release store, and lock() is one exchange when the lock is free, all inline. When it
// is taken, the waiter reads (not writes) the flag, so the cache line is not bounced between
// cores, pausing the CPU between reads, and after a while yields its time slice, so a holder
// that was descheduled, or that waits (pool_resource holds a shard's lock around its rare
// slow steps: CUDA event calls and upstream allocations when it grows), gets the CPU instead
// of being spun against.
//
// Contract: BasicLockable and Lockable (lock, try_lock, unlock); not recursive; noexcept.
#pragma once

#include <cudamem/detail/sync/atomic.hpp>
#include <cudamem/detail/sync/thread.hpp>


namespace cudamem::detail {

class spin_lock {
 public:
  void lock() noexcept {
    while (locked_.exchange(true, detail::memory_order_acquire)) {
      wait_until_free();
    }
  }
  [[nodiscard]] bool try_lock() noexcept {
    return !locked_.load(detail::memory_order_relaxed) &&
           !locked_.exchange(true, detail::memory_order_acquire);
  }
  void unlock() noexcept { locked_.store(false, detail::memory_order_release); }

 private:
  [[gnu::noinline]] void wait_until_free() const noexcept {  // out of line: lock() stays small
    constexpr unsigned spins_before_yield = 64;
    for (unsigned spins = 0; locked_.load(detail::memory_order_relaxed); ++spins) {
      if (spins < spins_before_yield) {
        cpu_relax();
      } else {
        detail::yield_thread();
      }
    }
  }

  static void cpu_relax() noexcept {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    asm volatile("yield");
#endif
  }

  detail::atomic<bool> locked_{false};
};

}  // namespace cudamem::detail
