// cudamem/detail/vm/create_ahead.hpp — physical memory created ahead of demand, on a thread of
// its own, so that a growing vm_resource finds its next handles already made.
//
//   cudamem::detail::create_ahead_layer ahead{inner, 64 << 20, 256 << 20, limit};
//   auto h = ahead.create(64 << 20);  // a handle made ahead if there is one; the thread then
//                                     // makes the next ones while the caller works
//   ahead.give_back();                // release(): handles made ahead go back to the driver
//
// Why: a cold vm_resource fills the device one handle at a time, and each cuMemCreate costs the
// driver 25-35 µs once the device fills (64 MiB handles on an H100; bench_vmm_driver). On the
// mixed trace of bench_fragmentation that is ~40 ms of a cold run's ~150. The call cannot be
// batched or made asynchronous, and two threads creating at once gain little (the driver
// serialises them), but a create on another thread runs while the allocating thread does its
// own host work.
//
// Contract
// - It is a mapping layer (detail/vm/mapping.hpp) over `inner`, and forwards every call to it
//   but create and release.
// - Every handle is `handle_bytes` (vm_resource's are). create(handle_bytes) returns a handle
//   made ahead if there is one; if the thread is making one now, it waits for that one; else it
//   asks `inner`. Any other size goes straight to `inner`. Handles are interchangeable: where
//   blocks go, and how much of the device a trace can use, are the same with or without it.
// - Each create that gives a handle wakes the thread, which makes handles until `ahead_bytes`
//   are ready, or one more would take the bytes held (handed out and not released, plus
//   ready) past `limit`, or the device says no (nullopt, or an error: the caller's own create
//   will meet that error). After a "no" it makes nothing until a create() gives a handle
//   again; a create() that gets nullopt from `inner` stops it too.
// - give_back() (vm_resource::release): stops it until the next create() that gives a handle,
//   waits for the create in flight, and releases every ready handle; returns their bytes.
// - Destruction stops and joins the thread, then releases the ready handles.
// - Threads: the owner calls it from one thread at a time (vm_resource's mutex). The thread
//   calls only inner.create(). A layer that cannot take a create() beside its other calls
//   (`concurrent_create() == false`: the simulated one) has every call serialised by a lock
//   here; the driver's layer can, and then the owner's calls take no lock but this class's
//   own, in create and release only.
#pragma once

#include <cudamem/detail/vm/mapping.hpp>

#include <condition_variable>
#include <cstddef>
#include <mutex>
#include <optional>
#include <system_error>
#include <thread>
#include <utility>
#include <vector>

namespace cudamem::detail {

class create_ahead_layer final : public vm_mapping_layer {
 public:
  /// Throws std::bad_alloc (room for the ready handles); the thread starts at the first
  /// create() that gives a handle.
  create_ahead_layer(vm_mapping_layer& inner, std::size_t handle_bytes, std::size_t ahead_bytes,
                     std::size_t limit)
      : inner_(inner),
        handle_(handle_bytes),
        ahead_(handle_bytes == 0 ? 0 : ahead_bytes / handle_bytes),
        limit_(limit),
        serialise_(!inner.concurrent_create()) {
    ready_.reserve(ahead_);  // so that the thread never allocates
  }

  ~create_ahead_layer() override {
    {
      const std::lock_guard lock(mutex_);
      stop_ = true;
    }
    work_.notify_all();
    if (thread_.joinable()) {
      thread_.join();
    }
    for (const vm_handle h : ready_) {
      inner_.release(h);
    }
  }

  /// Bytes of the handles made ahead and not yet handed out.
  [[nodiscard]] std::size_t ready_bytes() const {
    const std::lock_guard lock(mutex_);
    return ready_.size() * handle_;
  }

  /// Stops making handles until the next create() that gives one, waits for the one in
  /// flight, and releases every ready handle; returns their bytes.
  std::size_t give_back() noexcept {
    std::unique_lock lock(mutex_);
    paused_ = true;
    idle_.wait(lock, [&] { return !busy_; });
    const std::size_t bytes = ready_.size() * handle_;
    while (!ready_.empty()) {
      const vm_handle h = ready_.back();
      ready_.pop_back();
      const auto inner_lock = lock_inner();
      inner_.release(h);
    }
    return bytes;
  }

  /// Waits until the thread has nothing left to do (tests: then the counts hold still).
  void settle() {
    std::unique_lock lock(mutex_);
    idle_.wait(lock, [&] { return !busy_ && !wants_more(); });
  }

  // --- the layer ----------------------------------------------------------------------------
  [[nodiscard]] int device() const noexcept override { return inner_.device(); }
  [[nodiscard]] std::size_t granularity() const noexcept override { return inner_.granularity(); }
  [[nodiscard]] std::size_t device_total() const noexcept override {
    return inner_.device_total();
  }
  [[nodiscard]] std::optional<std::size_t> simulated_capacity() const noexcept override {
    return inner_.simulated_capacity();
  }

  [[nodiscard]] std::optional<vm_handle> create(std::size_t bytes) override {
    if (bytes != handle_ || ahead_ == 0) {
      const auto inner_lock = lock_inner();
      return inner_.create(bytes);
    }
    std::optional<vm_handle> h;
    {
      std::unique_lock lock(mutex_);
      if (ready_.empty() && busy_) {
        idle_.wait(lock, [&] { return !busy_; });  // the handle being made now is the nearest
      }
      if (!ready_.empty()) {
        h = ready_.back();
        ready_.pop_back();
      }
    }
    if (!h) {
      {
        const auto inner_lock = lock_inner();
        h = inner_.create(bytes);  // throws: nothing has changed
      }
      if (!h) {
        const std::lock_guard lock(mutex_);
        paused_ = true;  // the device is full: making more ahead would only fail
        return std::nullopt;
      }
    }
    {
      const std::lock_guard lock(mutex_);
      held_ += handle_;
      paused_ = false;
      start_thread();
    }
    work_.notify_one();
    return h;
  }

  void release(vm_handle handle) noexcept override {
    {
      const auto inner_lock = lock_inner();
      inner_.release(handle);
    }
    const std::lock_guard lock(mutex_);
    held_ = held_ >= handle_ ? held_ - handle_ : 0;
  }

  [[nodiscard]] std::uintptr_t reserve(std::size_t bytes) override {
    const auto inner_lock = lock_inner();
    return inner_.reserve(bytes);
  }
  void free_reservation(std::uintptr_t base, std::size_t bytes) noexcept override {
    const auto inner_lock = lock_inner();
    inner_.free_reservation(base, bytes);
  }
  void map(std::uintptr_t va, std::size_t bytes, vm_handle handle) override {
    const auto inner_lock = lock_inner();
    inner_.map(va, bytes, handle);
  }
  void unmap(std::uintptr_t va, std::size_t bytes) noexcept override {
    const auto inner_lock = lock_inner();
    inner_.unmap(va, bytes);
  }
  void set_access(std::uintptr_t va, std::size_t bytes) override {
    const auto inner_lock = lock_inner();
    inner_.set_access(va, bytes);
  }
  void record_free(cudaStream_t stream, std::uintptr_t va, std::size_t bytes) override {
    const auto inner_lock = lock_inner();
    inner_.record_free(stream, va, bytes);
  }
  void order_after_free(cudaStream_t user, cudaStream_t freed_on) override {
    const auto inner_lock = lock_inner();
    inner_.order_after_free(user, freed_on);
  }
  void wait_for_free(cudaStream_t freed_on) override {
    const auto inner_lock = lock_inner();
    inner_.wait_for_free(freed_on);
  }
  void wait_for_all_frees() noexcept override {
    const auto inner_lock = lock_inner();
    inner_.wait_for_all_frees();
  }

 private:
  /// A lock on the inner layer when it needs one (see the contract); otherwise an empty one.
  [[nodiscard]] std::unique_lock<std::mutex> lock_inner() {
    return serialise_ ? std::unique_lock(inner_mutex_) : std::unique_lock<std::mutex>();
  }

  /// Whether the thread should make another handle (mutex_ held).
  [[nodiscard]] bool wants_more() const noexcept {
    return !stop_ && !paused_ && ready_.size() < ahead_ &&
           held_ + (ready_.size() + 1) * handle_ <= limit_;
  }

  /// Starts the thread if it is not running (mutex_ held). A thread that cannot start leaves
  /// everything to the caller's own creates: slower, not wrong.
  void start_thread() noexcept {
    if (started_) {
      return;
    }
    started_ = true;
    try {
      thread_ = std::thread([this] { run(); });
    } catch (const std::system_error&) {
      ahead_ = 0;
    }
  }

  void run() noexcept {
    inner_.prepare_thread();
    std::unique_lock lock(mutex_);
    for (;;) {
      work_.wait(lock, [&] { return stop_ || wants_more(); });
      if (stop_) {
        return;
      }
      busy_ = true;
      lock.unlock();
      std::optional<vm_handle> h;
      try {
        const auto inner_lock = lock_inner();
        h = inner_.create(handle_);
      } catch (...) {  // an error: the owner's own create will meet it and report it
      }
      lock.lock();
      busy_ = false;
      if (h) {
        ready_.push_back(*h);  // room reserved at construction
      } else {
        paused_ = true;
      }
      idle_.notify_all();
    }
  }

  vm_mapping_layer& inner_;
  const std::size_t handle_;
  std::size_t ahead_;  ///< handles to keep ready (0 once the thread could not start)
  const std::size_t limit_;
  const bool serialise_;
  std::mutex inner_mutex_;  ///< serialises the inner layer's calls when it needs that

  mutable std::mutex mutex_;  ///< guards everything below
  std::condition_variable work_;  ///< the thread waits here for something to do
  std::condition_variable idle_;  ///< owners wait here for the create in flight
  std::vector<vm_handle> ready_;
  std::size_t held_ = 0;  ///< bytes of the handles handed out and not released
  bool busy_ = false;     ///< the thread is inside inner.create()
  bool paused_ = false;   ///< the device said no, or give_back(): wait for the next create()
  bool stop_ = false;
  bool started_ = false;
  std::thread thread_;
};

}  // namespace cudamem::detail
