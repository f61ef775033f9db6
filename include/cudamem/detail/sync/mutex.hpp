// cudamem/detail/sync/mutex.hpp — a mutex, a reader-writer mutex, their scoped locks and a
// condition variable, on POSIX threads, without including <mutex>, <shared_mutex> or
// <condition_variable>.
//
//   cudamem::detail::mutex m;
//   cudamem::detail::condition_variable changed;
//   {
//     cudamem::detail::lock_guard lock{m};            // as std::lock_guard
//   }
//   cudamem::detail::unique_lock lock{m};             // as std::unique_lock
//   m.lock(); cudamem::detail::lock_guard held{m, cudamem::detail::adopt_lock};
//   changed.wait(lock, [&] { return ready; });        // as std::condition_variable
//
// Why not the standard headers: in C++20 each of them brings <bits/chrono.h> (timed waits) and
// more; under nvcc 13 with g++ 12 <mutex> alone adds about 0.3 s to every translation unit, and
// cudamem's streams and resources are included everywhere (bench/compile_time.py). libstdc++'s
// std::mutex is this same pthread_mutex_t; cudamem is Linux-only (it loads NVML with dlopen,
// passes file descriptors over Unix sockets), so POSIX threads are always there.
//
// Contract
// - Same names and meaning as the std:: types for what is here: `mutex` and `shared_mutex` are
//   constant-initialised (usable in static storage from the first instruction), neither
//   copyable nor movable; `lock_guard`, `unique_lock` and `shared_lock` lock in their
//   constructor and unlock in their destructor; `condition_variable::wait` takes a
//   `unique_lock<mutex>` and, with a predicate, returns once it holds.
// - A failing lock call (it cannot fail on a valid mutex locked in the right order: pthreads'
//   normal mutexes report nothing else) throws std::runtime_error naming the call, as
//   std::mutex throws std::system_error. Unlock and notify never fail on a valid object.
#pragma once

#include <pthread.h>

#include <cstring>
#include <stdexcept>
#include <string>
#include <utility>

namespace cudamem::detail {

/// Throws for a pthread call that failed with `code` (see the contract).
inline void check_pthread(int code, const char* call) {
  if (code != 0) [[unlikely]] {
    throw std::runtime_error(std::string("cudamem: ") + call + " failed: " + std::strerror(code));
  }
}

class mutex {
 public:
  constexpr mutex() noexcept = default;
  mutex(const mutex&) = delete;
  mutex& operator=(const mutex&) = delete;
  // No pthread_mutex_destroy: a statically initialised mutex needs none on Linux, and skipping
  // it keeps the destructor trivial, as std::mutex's is.

  void lock() { check_pthread(pthread_mutex_lock(&handle_), "pthread_mutex_lock"); }
  [[nodiscard]] bool try_lock() noexcept { return pthread_mutex_trylock(&handle_) == 0; }
  void unlock() noexcept { pthread_mutex_unlock(&handle_); }
  [[nodiscard]] pthread_mutex_t* native_handle() noexcept { return &handle_; }

 private:
  pthread_mutex_t handle_ = PTHREAD_MUTEX_INITIALIZER;
};

/// Many readers or one writer (std::shared_mutex).
class shared_mutex {
 public:
  constexpr shared_mutex() noexcept = default;
  shared_mutex(const shared_mutex&) = delete;
  shared_mutex& operator=(const shared_mutex&) = delete;

  void lock() { check_pthread(pthread_rwlock_wrlock(&handle_), "pthread_rwlock_wrlock"); }
  void unlock() noexcept { pthread_rwlock_unlock(&handle_); }
  void lock_shared() { check_pthread(pthread_rwlock_rdlock(&handle_), "pthread_rwlock_rdlock"); }
  void unlock_shared() noexcept { pthread_rwlock_unlock(&handle_); }

 private:
  pthread_rwlock_t handle_ = PTHREAD_RWLOCK_INITIALIZER;
};

/// Tag: the lock takes over a mutex the caller has locked already (std::adopt_lock).
struct adopt_lock_t {
  explicit adopt_lock_t() = default;
};
inline constexpr adopt_lock_t adopt_lock{};

/// Holds `Mutex` for its scope (std::lock_guard).
template <class Mutex>
class [[nodiscard]] lock_guard {
 public:
  explicit lock_guard(Mutex& m) : mutex_(m) { mutex_.lock(); }
  lock_guard(Mutex& m, adopt_lock_t) noexcept : mutex_(m) {}
  ~lock_guard() { mutex_.unlock(); }
  lock_guard(const lock_guard&) = delete;
  lock_guard& operator=(const lock_guard&) = delete;

 private:
  Mutex& mutex_;
};

/// A lock that may be released and taken again, and moved (std::unique_lock).
template <class Mutex>
class [[nodiscard]] unique_lock {
 public:
  explicit unique_lock(Mutex& m) : mutex_(&m) {
    mutex_->lock();
    owns_ = true;
  }
  unique_lock(Mutex& m, adopt_lock_t) noexcept : mutex_(&m), owns_(true) {}
  ~unique_lock() {
    if (owns_) {
      mutex_->unlock();
    }
  }
  unique_lock(unique_lock&& other) noexcept
      : mutex_(std::exchange(other.mutex_, nullptr)), owns_(std::exchange(other.owns_, false)) {}
  unique_lock& operator=(unique_lock&& other) noexcept {
    if (this != &other) {
      if (owns_) {
        mutex_->unlock();
      }
      mutex_ = std::exchange(other.mutex_, nullptr);
      owns_ = std::exchange(other.owns_, false);
    }
    return *this;
  }
  unique_lock(const unique_lock&) = delete;
  unique_lock& operator=(const unique_lock&) = delete;

  void lock() {
    mutex_->lock();
    owns_ = true;
  }
  void unlock() noexcept {
    mutex_->unlock();
    owns_ = false;
  }
  /// Lets go of the mutex without unlocking it; returns it (the caller unlocks it later).
  Mutex* release() noexcept {
    owns_ = false;
    return std::exchange(mutex_, nullptr);
  }
  [[nodiscard]] bool owns_lock() const noexcept { return owns_; }
  [[nodiscard]] Mutex* mutex() const noexcept { return mutex_; }

 private:
  Mutex* mutex_;
  bool owns_ = false;
};

/// Holds a shared_mutex for reading for its scope (std::shared_lock).
class [[nodiscard]] shared_lock {
 public:
  explicit shared_lock(shared_mutex& m) : mutex_(m) { mutex_.lock_shared(); }
  ~shared_lock() { mutex_.unlock_shared(); }
  shared_lock(const shared_lock&) = delete;
  shared_lock& operator=(const shared_lock&) = delete;

 private:
  shared_mutex& mutex_;
};

/// Waits for a change another thread announces (std::condition_variable).
class condition_variable {
 public:
  constexpr condition_variable() noexcept = default;
  condition_variable(const condition_variable&) = delete;
  condition_variable& operator=(const condition_variable&) = delete;
  ~condition_variable() { pthread_cond_destroy(&handle_); }

  /// Releases `lock`, waits for a notification (or a spurious wake-up), takes it again.
  void wait(unique_lock<mutex>& lock) {
    check_pthread(pthread_cond_wait(&handle_, lock.mutex()->native_handle()),
                  "pthread_cond_wait");
  }
  /// Waits until `ready()` holds (checked with the lock held, before each wait).
  template <class Predicate>
  void wait(unique_lock<mutex>& lock, Predicate ready) {
    while (!ready()) {
      wait(lock);
    }
  }
  void notify_one() noexcept { pthread_cond_signal(&handle_); }
  void notify_all() noexcept { pthread_cond_broadcast(&handle_); }

 private:
  pthread_cond_t handle_ = PTHREAD_COND_INITIALIZER;
};

}  // namespace cudamem::detail
