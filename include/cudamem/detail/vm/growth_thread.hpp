// cudamem/detail/vm/growth_thread.hpp — the thread on which vm_resource grows ahead of need
// (vm_resource_options::grow_ahead_bytes): it runs one step at a time, when woken, beside the
// threads that allocate.
//
//   detail::mutex mutex;                               // the owner's: guards its state
//   cudamem::detail::growth_thread ahead{mutex, work};  // work: a growth_work (step, on_start)
//   detail::unique_lock lock(mutex);
//   ahead.wake(lock);          // after an allocation left too little mapped ahead
//   ahead.wait_next_step(lock);  // a thread that needs memory waits for the next batch
//   ahead.stop();              // without the lock: the destructor's first act
//
// Why a thread: a cold vm_resource fills the device with physical memory, and each 64 MiB
// handle costs the driver ~60 µs (cuMemCreate ~22 µs, its share of cuMemSetAccess ~37 µs on
// an H100; bench_vmm_driver). Over bench_fragmentation's mixed trace that is ~75 ms, paid on
// top of the pool's own ~50 ms of host work, because the allocating thread waits in the
// driver. Made on another thread, the driver's time and the pool's host work overlap. Only
// one thread at a time makes driver calls for a growth (the allocating thread waits for the
// step in flight rather than grow beside it): two threads mapping at once gain nothing, as
// the driver serialises them (measured: a create-ahead thread, 2dab59c).
//
// Contract
// - `step(lock)` is called on the thread with the owner's mutex held through `lock`; it may
//   unlock it and lock it again (it does its driver calls unlocked), and returns true when it
//   wants to run again at once (unless `cancel` was called meanwhile). An exception from it
//   stops the thread for good, and is reported (report_problem, without the owner's lock): the
//   owner then grows on its own threads, as without it.
// - `on_start()` runs once on the thread before any step, without the lock (the driver's
//   layer makes its device current there). An exception stops the thread as above.
// - With the owner's mutex held: `wake` asks for a step (and starts the thread at the first
//   call; if it cannot start, nothing happens and it is never tried again); `stepping()` says
//   whether a step is running now, `busy()` whether one is running or asked for;
//   `wait_step` waits until none is running; `wait_next_step` until the next one ends or
//   none is running nor asked for; `wait_idle` until none is running nor asked for; `cancel`
//   drops a step asked for and not yet begun (and wakes those waiting for it).
// - `stop()`, without the lock: the step in flight finishes, no other begins, the thread is
//   joined. Idempotent; the destructor calls it.
#pragma once

#include <cudamem/detail/sync/mutex.hpp>
#include <cudamem/detail/sync/thread.hpp>
#include <cudamem/error.hpp>

#include <cstddef>
#include <exception>
#include <stdexcept>
#include <string>

namespace cudamem::detail {

/// What the thread runs, the owner's side (vm_resource): `growth_step` and
/// `growth_thread_started` are the contract's `step` and `on_start`.
class growth_work {
 public:
  virtual bool growth_step(unique_lock<mutex>& lock) = 0;
  virtual void growth_thread_started() = 0;

 protected:
  growth_work() = default;
  growth_work(const growth_work&) = default;
  growth_work& operator=(const growth_work&) = default;
  ~growth_work() = default;
};

class growth_thread {
 public:
  /// `work` must outlive the thread (the owner stops it first thing in its destructor).
  growth_thread(detail::mutex& owner, growth_work& work) : owner_(owner), work_to_do_(work) {}

  growth_thread(const growth_thread&) = delete;
  growth_thread& operator=(const growth_thread&) = delete;
  ~growth_thread() { stop(); }

  void wake(detail::unique_lock<detail::mutex>& /*held*/) {
    if (broken_ || stopping_) {
      return;
    }
    wanted_ = true;
    if (!thread_.joinable()) {
      try {
        thread_ = detail::thread([this] { run(); });
      } catch (const std::runtime_error&) {  // no thread to be had: grow on the callers' threads
        broken_ = true;
        wanted_ = false;
        return;
      }
    }
    work_.notify_one();
  }

  [[nodiscard]] bool stepping() const noexcept { return stepping_; }
  /// A step is running or asked for: memory is on its way.
  [[nodiscard]] bool busy() const noexcept { return stepping_ || wanted_; }

  /// Waits until no step is running.
  void wait_step(detail::unique_lock<detail::mutex>& held) {
    done_.wait(held, [this] { return !stepping_; });
  }

  /// Waits until the next step ends, or the thread has nothing running nor asked for.
  void wait_next_step(detail::unique_lock<detail::mutex>& held) {
    const std::size_t seen = steps_;
    done_.wait(held, [&] { return steps_ != seen || !busy(); });
  }

  void wait_idle(detail::unique_lock<detail::mutex>& held) {
    done_.wait(held, [this] { return !stepping_ && !wanted_; });
  }

  void cancel(detail::unique_lock<detail::mutex>& /*held*/) noexcept {
    wanted_ = false;
    ++cancels_;  // and the step in flight does not ask for another when it ends
    done_.notify_all();  // a thread waiting for the step asked for waits no more
  }

  void stop() noexcept {
    {
      const detail::lock_guard lock(owner_);
      stopping_ = true;
      wanted_ = false;
    }
    work_.notify_all();
    if (thread_.joinable()) {
      thread_.join();
    }
  }

 private:
  void run() noexcept {
    try {
      work_to_do_.growth_thread_started();
    } catch (const std::exception& e) {
      give_up("the growth thread could not start: ", e.what());
      return;
    } catch (...) {
      give_up("the growth thread could not start: ", "an exception that is not a std::exception");
      return;
    }
    detail::unique_lock lock(owner_);
    while (true) {
      work_.wait(lock, [this] { return stopping_ || wanted_; });
      if (stopping_) {
        break;
      }
      wanted_ = false;
      stepping_ = true;
      const std::size_t cancels_before = cancels_;
      const char* failure = nullptr;  // what() lives as long as the exception: report inside
      bool again = false;
      try {
        again = work_to_do_.growth_step(lock);
      } catch (const std::exception& e) {
        failure = e.what();
        report_unlocked(lock, "growth ahead stopped: ", failure);
      } catch (...) {
        failure = "an exception that is not a std::exception";
        report_unlocked(lock, "growth ahead stopped: ", failure);
      }
      if (!lock.owns_lock()) {
        lock.lock();  // a step that threw half-way may have left it unlocked
      }
      broken_ = failure != nullptr;
      stepping_ = false;
      ++steps_;
      wanted_ = !broken_ && (wanted_ || (again && !stopping_ && cancels_ == cancels_before));
      done_.notify_all();
      if (broken_) {
        break;
      }
    }
    lock.unlock();
    done_.notify_all();
  }

  /// Reports a failure without the owner's lock (the handler may call the owner), while the
  /// thread still counts as stepping: whoever waits for it to be idle sees the report made.
  static void report_unlocked(detail::unique_lock<detail::mutex>& lock, const char* what,
                              const char* why) noexcept {
    if (lock.owns_lock()) {
      lock.unlock();
    }
    report(what, why);
  }

  static void report(const char* what, const char* why) noexcept {
    try {
      report_problem(std::string("vm_resource: ") + what + why);
    } catch (...) {  // no memory for the message: the failure still stops the thread
    }
  }

  void give_up(const char* what, const char* why) noexcept {
    report(what, why);
    {
      const detail::lock_guard lock(owner_);
      broken_ = true;
      wanted_ = false;
    }
    done_.notify_all();
  }

  detail::mutex& owner_;
  growth_work& work_to_do_;
  detail::condition_variable work_;  ///< wakes the thread: a step wanted, or stop
  detail::condition_variable done_;  ///< wakes waiters: a step finished
  bool wanted_ = false;           ///< guarded by owner_, as the three below
  bool stepping_ = false;
  bool stopping_ = false;
  bool broken_ = false;           ///< a step or the start failed: never again
  std::size_t steps_ = 0;         ///< steps finished
  std::size_t cancels_ = 0;       ///< cancel() calls
  detail::thread thread_;
};

}  // namespace cudamem::detail
