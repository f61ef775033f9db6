// cudamem/detail/adaptors/owner_bias.hpp — locks that the one thread using an object need not take,
// until a second thread comes: the tracking adaptor's shard locks cost a locked instruction
// per request, as much as the rest of its work, and most programs call a memory resource
// from one host thread.
//
//   detail::owner_bias bias;                       // beside the locks it can stand in for
//   {
//     const detail::biased_lock_guard guard(bias, shard.mutex());  // takes the lock, unless
//     ...touch what the lock guards...                             // this thread owns `bias`
//   }
//   if (bias.enter()) {  // the same without a lock: a counter the owner writes plainly,
//     detail::add_to_counter(total, bytes, /*sole_writer=*/true);   // and others atomically
//     bias.leave();
//   } else {
//     detail::add_to_counter(total, bytes, /*sole_writer=*/false);
//   }
//
// Contract
// - The first thread that takes a biased_lock_guard on an owner_bias owns it: its guards then
//   take no lock and execute no locked instruction (two plain stores and two loads).
// - The first guard taken on another thread revokes the bias, once and for good: it waits
//   for the owner to finish what it is doing without the lock, and from then on every guard
//   on every thread, the owner's included, takes the lock. Revoking costs one system call
//   (Linux membarrier) and microseconds; it happens at most once per object.
// - Where the system offers no such call (not Linux, or a sandbox that forbids it), nobody
//   ever owns: every guard takes the lock, as if the bias were not there.
// - Guards may not nest on one thread (the owner's second guard would not wait for its first:
//   there is nothing to wait for, but nothing checks it either).
//
// How it works (for a student): the classic two-flag handshake (Dekker's) between the owner
// and a thread that wants in. The owner raises `busy_`, then checks that it still owns; the
// other thread first takes ownership away, then checks `busy_`, and waits while it is up.
// Each side writes one flag and then reads the other's, so at least one of them sees the
// other's write: the owner sees it lost ownership (and takes the lock instead), or the other
// thread sees the owner busy (and waits). That needs each side's write to be visible before
// its read, which a CPU does not promise without a fence — and a full fence costs about what
// the lock did. The trick is to make the fence *asymmetric*: the owner's side has only a
// compiler barrier, and the other side, once, asks the kernel to interrupt every running
// thread of the process (membarrier), which acts as a full fence on each of them, the owner
// included, at whatever point it had reached. Userspace RCU and folly use the same device.
#pragma once

#include <cudamem/detail/sync/atomic.hpp>
#include <cudamem/detail/sync/mutex.hpp>
#include <cudamem/detail/sync/thread.hpp>
#include <cudamem/detail/usage_counter.hpp>  // raise_to

#include <cstdint>

#if defined(__linux__)
#include <linux/membarrier.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace cudamem::detail {

/// A number for the calling thread that no other thread of the process ever has, even after
/// this one ends (a std::thread::id may be given to a new thread; an owner must not be).
inline std::uint64_t this_thread_token() noexcept {
  static detail::atomic<std::uint64_t> next{1};
  static thread_local std::uint64_t token = 0;  // constant-initialised: no guard to check
  if (token == 0) [[unlikely]] {
    token = next.fetch_add(1, detail::memory_order_relaxed);
  }
  return token;
}

/// Whether this process can fence every one of its running threads at once (and is
/// registered to, the first time this is asked).
inline bool asymmetric_fence_available() noexcept {
  static const bool available = [] {
#if defined(__linux__) && defined(SYS_membarrier)
    const long commands = syscall(SYS_membarrier, MEMBARRIER_CMD_QUERY, 0, 0);
    return commands > 0 && (commands & MEMBARRIER_CMD_PRIVATE_EXPEDITED) != 0 &&
           syscall(SYS_membarrier, MEMBARRIER_CMD_REGISTER_PRIVATE_EXPEDITED, 0, 0) == 0;
#else
    return false;
#endif
  }();
  return available;
}

/// A full memory fence on every running thread of this process. Only called once
/// asymmetric_fence_available() said yes; retried if the kernel is briefly out of memory.
inline void fence_all_threads() noexcept {
#if defined(__linux__) && defined(SYS_membarrier)
  while (syscall(SYS_membarrier, MEMBARRIER_CMD_PRIVATE_EXPEDITED, 0, 0) != 0) {
    detail::yield_thread();
  }
#endif
}

class owner_bias {
 public:
  owner_bias() = default;
  owner_bias(const owner_bias&) = delete;
  owner_bias& operator=(const owner_bias&) = delete;

  /// True: the calling thread owns this object, and no other thread touches what the locks
  /// guard until leave(). False: take the lock (and every thread does, from now on).
  bool enter() noexcept {
    const std::uint64_t me = this_thread_token();
    if (owner_.load(detail::memory_order_relaxed) == me) [[likely]] {
      busy_.store(true, detail::memory_order_relaxed);
      // Only the compiler is fenced here: the CPU's half is revoke()'s fence_all_threads().
      detail::atomic_signal_fence(detail::memory_order_seq_cst);
      if (owner_.load(detail::memory_order_relaxed) == me) [[likely]] {
        return true;
      }
      busy_.store(false, detail::memory_order_release);  // revoked meanwhile: lock after all
    }
    if (revoked_.load(detail::memory_order_acquire)) [[likely]] {  // threads share it: lock
      return false;
    }
    return enter_slow(me);
  }

  /// Ends what enter() began when it returned true.
  void leave() noexcept { busy_.store(false, detail::memory_order_release); }

  /// Whether some thread owns this object now (false once revoked, or where no thread can).
  [[nodiscard]] bool owned() const noexcept {
    const std::uint64_t owner = owner_.load(detail::memory_order_relaxed);
    return owner != unowned && owner != nobody;
  }

 private:
  static constexpr std::uint64_t unowned = 0;              // nobody has come yet
  static constexpr std::uint64_t nobody = ~std::uint64_t{0};  // revoked: everyone locks

  [[gnu::noinline]] bool enter_slow(std::uint64_t me) noexcept {
    if (revoked_.load(detail::memory_order_acquire)) {
      return false;
    }
    std::uint64_t expected = unowned;
    if (asymmetric_fence_available() &&
        owner_.compare_exchange_strong(expected, me, detail::memory_order_acquire)) {
      return enter();  // the first thread here: it owns from now on
    }
    revoke();
    return false;
  }

  /// Takes ownership away and waits until the owner is not working without the lock.
  [[gnu::noinline]] void revoke() noexcept {
    const detail::lock_guard lock(revoke_mutex_);  // a second revoker waits for the first
    if (revoked_.load(detail::memory_order_relaxed)) {
      return;
    }
    const std::uint64_t previous = owner_.exchange(nobody, detail::memory_order_acq_rel);
    if (previous != unowned) {
      // The owner may be between raising busy_ and checking owner_: after this fence, either
      // its busy_ is visible here or its check sees `nobody`.
      fence_all_threads();
      while (busy_.load(detail::memory_order_acquire)) {  // its release: its writes are ours
        detail::yield_thread();
      }
    }
    revoked_.store(true, detail::memory_order_release);
  }

  // The owner reads owner_ and writes busy_ on every request: one line, its own.
  alignas(64) detail::atomic<std::uint64_t> owner_{unowned};
  detail::atomic<bool> busy_{false};
  alignas(64) detail::atomic<bool> revoked_{false};
  detail::mutex revoke_mutex_;
};

/// Adds `delta` to `counter` (a negative delta in two's complement subtracts) and returns the
/// sum: a plain load and store when the caller is the counter's only writer (it owns the bias
/// and is inside enter()/leave()), an atomic add when threads share it.
template <class T>
T add_to_counter(detail::atomic<T>& counter, T delta, bool sole_writer) noexcept {
  if (sole_writer) [[likely]] {
    const T sum = counter.load(detail::memory_order_relaxed) + delta;
    counter.store(sum, detail::memory_order_relaxed);
    return sum;
  }
  return counter.fetch_add(delta, detail::memory_order_relaxed) + delta;
}

/// Raises `peak` to at least `value`, the same two ways as add_to_counter.
template <class T>
void raise_peak(detail::atomic<T>& peak, T value, bool sole_writer) noexcept {
  if (!sole_writer) [[unlikely]] {
    raise_to(peak, value);
  } else if (value > peak.load(detail::memory_order_relaxed)) {
    peak.store(value, detail::memory_order_relaxed);
  }
}

/// Locks `lock` for the guard's life, unless the calling thread owns `bias`.
template <class Lock>
class [[nodiscard]] biased_lock_guard {
 public:
  biased_lock_guard(owner_bias& bias, Lock& lock) noexcept(noexcept(lock.lock()))
      : bias_(bias), lock_(bias.enter() ? nullptr : &lock) {
    if (lock_ != nullptr) {
      lock_->lock();
    }
  }
  ~biased_lock_guard() {
    if (lock_ != nullptr) {
      lock_->unlock();
    } else {
      bias_.leave();
    }
  }
  biased_lock_guard(const biased_lock_guard&) = delete;
  biased_lock_guard& operator=(const biased_lock_guard&) = delete;

  /// True if this thread owns the bias (no lock was taken): it is the only writer of whatever
  /// only the guarded code writes.
  [[nodiscard]] bool owner() const noexcept { return lock_ == nullptr; }

 private:
  owner_bias& bias_;
  Lock* lock_;
};

}  // namespace cudamem::detail
