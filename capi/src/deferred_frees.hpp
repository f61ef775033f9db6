// capi/src/deferred_frees.hpp — frees that wait for the other streams a block was used on:
// what PyTorch's Tensor.record_stream asks of an allocator.
//
//   stream_uses uses;                                  // one per allocator
//   deferred_frees<cuda_events> waiting{cuda_events{0}};   // one per device
//   uses.add(p, side_stream);                          // record_stream(p, side_stream)
//   // free(p) on main_stream:
//   if (!(uses.any() && waiting.defer(p, bytes, main_stream, uses.take(p)))) {
//     mr.deallocate(p, bytes, 256, main_stream);       // no other stream used it: free now
//   }
//   waiting.retire_completed(free_to_mr);              // later, cheaply: frees now safe
//   waiting.retire_all(free_to_mr);                    // before giving up on an allocation
//
// Why. A stream-ordered resource is told, at a free, the one stream that last used the block;
// it may hand the block out again at once to that stream. PyTorch frees a tensor on the stream
// it was allocated on, and `record_stream(s)` is how a program says "s uses it too". Without
// this, a block freed on stream A while a kernel on stream B still reads it could be given to
// the next request on A and overwritten early.
//
// How. stream_uses keeps the extra streams per block (a map, touched only for blocks that had
// record_stream called: the free path first tests one atomic counter). At the free, an event
// is recorded on each extra stream and the free waits in a list; it is given to the resource
// once every event has completed (so the work submitted to those streams before the free is
// done), on the stream it was freed on. No stream waits for another: they run on, as with
// PyTorch's own allocator. retire_completed polls the events (cudaEventQuery) and is called on
// allocations and frees while the list is not empty; retire_all waits for them
// (cudaEventSynchronize), before an allocation reports out of memory and on release().
//
// Contract
// - Thread-safe (a mutex each, taken only when a block has extra streams or frees wait).
// - If an event cannot be recorded (a CUDA error), the free waits on the host for the extra
//   streams (Events::synchronize) and happens at once: never too early.
// - `Events` is the policy that talks to CUDA (cuda_events below); host tests give a fake one.
#pragma once

#include <cudamem/device.hpp>
#include <cudamem/error.hpp>

#include <cuda_runtime_api.h>

#include <atomic>
#include <cstddef>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace cudamem::capi {

/// The extra streams each block is used on (record_stream), until its free takes them.
class stream_uses {
 public:
  /// Whether any block has extra streams: the free path's one check.
  [[nodiscard]] bool any() const noexcept {
    return blocks_.load(std::memory_order_relaxed) != 0;
  }

  /// `stream` uses the block at p too.
  void add(void* p, cudaStream_t stream) {
    const std::lock_guard lock(mutex_);
    auto [it, fresh] = uses_.try_emplace(p);
    if (fresh) {
      blocks_.fetch_add(1, std::memory_order_relaxed);
    }
    for (cudaStream_t s : it->second) {
      if (s == stream) {
        return;
      }
    }
    it->second.push_back(stream);
  }

  /// The extra streams of p, forgotten now (empty if none).
  [[nodiscard]] std::vector<cudaStream_t> take(void* p) {
    const std::lock_guard lock(mutex_);
    const auto it = uses_.find(p);
    if (it == uses_.end()) {
      return {};
    }
    std::vector<cudaStream_t> streams = std::move(it->second);
    uses_.erase(it);
    blocks_.fetch_sub(1, std::memory_order_relaxed);
    return streams;
  }

 private:
  std::mutex mutex_;
  std::unordered_map<void*, std::vector<cudaStream_t>> uses_;
  std::atomic<std::size_t> blocks_{0};
};

/// Events on one device through the CUDA runtime, reused from a free list. Over a simulated
/// device (`simulated`) no work ever runs: every event is complete at once and no CUDA call
/// is made.
class cuda_events {
 public:
  using token = cudaEvent_t;

  explicit cuda_events(int device, bool simulated = false)
      : device_(device), simulated_(simulated) {}
  cuda_events(const cuda_events&) = delete;
  cuda_events& operator=(const cuda_events&) = delete;
  ~cuda_events() {
    for (cudaEvent_t e : spare_) {
      report_error(cudaEventDestroy(e), "cudamem C API: cudaEventDestroy");
    }
  }

  /// An event recorded on `stream` (of this device); throws cuda_error when CUDA cannot.
  token record(cudaStream_t stream) {
    if (simulated_) {
      return nullptr;
    }
    const device_guard on{device_};  // events belong to the current device
    cudaEvent_t e = nullptr;
    if (!spare_.empty()) {
      e = spare_.back();
      spare_.pop_back();
    } else {
      check(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "cudaEventCreateWithFlags");
    }
    if (const cudaError_t code = cudaEventRecord(e, stream); code != cudaSuccess) {
      spare_.push_back(e);
      check(code, "cudaEventRecord for a block used on another stream");
    }
    return e;
  }
  /// Whether the work before `e` has finished. An error counts as finished (and is reported):
  /// the stream it was recorded on is broken, nothing more will run there.
  bool done(token e) noexcept {
    if (simulated_) {
      return true;
    }
    const cudaError_t code = cudaEventQuery(e);
    if (code == cudaErrorNotReady) {
      return false;
    }
    report_error(code, "cudamem C API: cudaEventQuery");
    return true;
  }
  void wait(token e) noexcept {
    if (!simulated_) {
      report_error(cudaEventSynchronize(e), "cudamem C API: cudaEventSynchronize");
    }
  }
  void recycle(token e) noexcept {
    if (simulated_) {
      return;
    }
    try {
      spare_.push_back(e);
    } catch (...) {  // no memory to keep it: destroy it instead
      report_error(cudaEventDestroy(e), "cudamem C API: cudaEventDestroy");
    }
  }
  /// The fallback when no event can be recorded: wait on the host.
  void synchronize(cudaStream_t stream) noexcept {
    if (!simulated_) {
      report_error(cudaStreamSynchronize(stream), "cudamem C API: cudaStreamSynchronize");
    }
  }

 private:
  int device_;
  bool simulated_;
  std::vector<cudaEvent_t> spare_;
};

/// One device's frees that wait for their blocks' extra streams; see the header comment.
template <class Events>
class deferred_frees {
 public:
  using token = typename Events::token;

  /// A free waiting for its extra streams.
  struct waiting_free {
    void* p;
    std::size_t bytes;
    cudaStream_t stream;        ///< the stream it was freed on
    std::vector<token> events;  ///< one per extra stream
  };

  template <class... Args>
  explicit deferred_frees(Args&&... event_args) : events_(std::forward<Args>(event_args)...) {}

  /// Frees waiting for their streams.
  [[nodiscard]] std::size_t waiting() const noexcept {
    return waiting_count_.load(std::memory_order_relaxed);
  }

  /// p, used also on `streams`, is freed on `stream`: true if its free must wait (it is kept
  /// here), false if it may happen now (no other stream, or they were waited for on the host).
  bool defer(void* p, std::size_t bytes, cudaStream_t stream,
             const std::vector<cudaStream_t>& streams) {
    if (streams.empty()) {
      return false;
    }
    const std::lock_guard lock(mutex_);
    waiting_free w{p, bytes, stream, {}};
    try {
      for (cudaStream_t s : streams) {
        if (s != stream) {
          w.events.push_back(events_.record(s));
        }
      }
      if (w.events.empty()) {
        return false;
      }
      waiting_.push_back(std::move(w));
    } catch (const std::exception& e) {  // no event, or no memory to keep the free
      wait_on_host(w, streams, e.what());
      return false;
    } catch (...) {
      wait_on_host(w, streams, "unknown exception");
      return false;
    }
    waiting_count_.store(waiting_.size(), std::memory_order_relaxed);
    return true;
  }

  /// Hands every free whose streams are done to `free(p, bytes, stream)`.
  template <class Free>
  void retire_completed(Free&& free) {
    retire(std::forward<Free>(free), false);
  }
  /// Waits for every waiting free's streams, then hands it to `free`.
  template <class Free>
  void retire_all(Free&& free) {
    retire(std::forward<Free>(free), true);
  }

 private:
  template <class Free>
  void retire(Free&& free, bool wait) {
    std::vector<waiting_free> ready;
    {
      std::unique_lock lock(mutex_, std::defer_lock);
      if (wait) {
        lock.lock();
      } else if (!lock.try_lock()) {
        return;  // another thread is at it; the next call will do
      }
      ready.reserve(waiting_.size());  // (may throw: before anything changed)
      for (std::size_t i = 0; i < waiting_.size();) {
        waiting_free& w = waiting_[i];
        bool all_done = true;
        for (token e : w.events) {
          if (wait) {
            events_.wait(e);
          } else if (!events_.done(e)) {
            all_done = false;
            break;
          }
        }
        if (!all_done) {
          ++i;
          continue;
        }
        ready.push_back(std::move(w));  // (reserved: does not throw)
        for (token e : ready.back().events) {
          events_.recycle(e);
        }
        if (i + 1 != waiting_.size()) {
          waiting_[i] = std::move(waiting_.back());
        }
        waiting_.pop_back();
      }
      waiting_count_.store(waiting_.size(), std::memory_order_relaxed);
    }
    for (const waiting_free& w : ready) {  // outside the lock: the resource takes its own
      free(w.p, w.bytes, w.stream);
    }
  }

  /// The fallback: the free happens now, once the host has waited for every extra stream.
  void wait_on_host(waiting_free& w, const std::vector<cudaStream_t>& streams,
                    const char* why) noexcept {
    for (token e : w.events) {
      events_.recycle(e);
    }
    for (cudaStream_t s : streams) {
      events_.synchronize(s);
    }
    report_problem(std::string("cudamem: a free that waits for other streams (record_stream) "
                               "could not record an event (") + why +
                   "); the host waited for those streams instead");
  }

  Events events_;
  std::mutex mutex_;
  std::vector<waiting_free> waiting_;
  std::atomic<std::size_t> waiting_count_{0};
};

}  // namespace cudamem::capi
