// cudamem/detail/sync/thread.hpp — a joinable thread, the machine's hardware threads and
// yielding the processor, on POSIX threads, without including <thread>.
//
//   cudamem::detail::thread worker{[this] { run(); }};   // as std::thread
//   worker.join();
//   unsigned n = cudamem::detail::hardware_threads();     // as std::thread::hardware_concurrency
//   cudamem::detail::yield_thread();                      // as std::this_thread::yield
//
// Why not <thread>: in C++20 it brings <stop_token>, <semaphore>, <bits/chrono.h> and
// <atomic>; under nvcc 13 with g++ 12 that adds about 1 s to every translation unit that
// includes it (bench/compile_time.py), and cudamem's resources start threads of their own (a
// vm_pool's growth thread, the copy stager's memcpy workers). libstdc++'s std::thread is this
// same pthread_create; cudamem is Linux-only.
//
// Contract
// - `thread{f}` runs `f()` (a callable taking nothing, returning nothing, that must not throw:
//   an exception leaving it ends the process, as with std::thread) on a new thread. If the
//   thread cannot be started it throws std::runtime_error, and `f` is not run.
// - A thread must be joined (or never started: default-constructed, moved from) before it is
//   destroyed or assigned to; otherwise the process ends, as with std::thread.
// - `hardware_threads()` is the number of processors online, at least 1.
#pragma once

#include <cudamem/detail/sync/mutex.hpp>  // check_pthread

#include <pthread.h>
#include <sched.h>
#include <unistd.h>

#include <exception>
#include <new>
#include <type_traits>
#include <utility>

namespace cudamem::detail {

class thread {
 public:
  thread() noexcept = default;

  template <class Function>
    requires(!std::is_same_v<std::remove_cvref_t<Function>, thread>)
  explicit thread(Function&& f) {
    using task = std::remove_cvref_t<Function>;
    auto* work = new task(std::forward<Function>(f));
    const int code = pthread_create(&handle_, nullptr, &run<task>, work);
    if (code != 0) {
      delete work;
      check_pthread(code, "pthread_create");
    }
    started_ = true;
  }

  thread(thread&& other) noexcept
      : handle_(other.handle_), started_(std::exchange(other.started_, false)) {}
  thread& operator=(thread&& other) noexcept {
    if (started_) {
      std::terminate();  // as std::thread: a running thread must be joined first
    }
    handle_ = other.handle_;
    started_ = std::exchange(other.started_, false);
    return *this;
  }
  thread(const thread&) = delete;
  thread& operator=(const thread&) = delete;

  ~thread() {
    if (started_) {
      std::terminate();  // as std::thread: never joined
    }
  }

  [[nodiscard]] bool joinable() const noexcept { return started_; }

  /// Waits for the thread to finish.
  void join() {
    check_pthread(pthread_join(handle_, nullptr), "pthread_join");
    started_ = false;
  }

 private:
  template <class Task>
  static void* run(void* arg) noexcept {
    Task* work = static_cast<Task*>(arg);
    (*work)();
    delete work;
    return nullptr;
  }

  pthread_t handle_{};
  bool started_ = false;
};

/// The processors online now (std::thread::hardware_concurrency), at least 1.
[[nodiscard]] inline unsigned hardware_threads() noexcept {
  const long online = sysconf(_SC_NPROCESSORS_ONLN);
  return online > 0 ? static_cast<unsigned>(online) : 1u;
}

/// Lets another thread run (std::this_thread::yield).
inline void yield_thread() noexcept { sched_yield(); }

}  // namespace cudamem::detail
