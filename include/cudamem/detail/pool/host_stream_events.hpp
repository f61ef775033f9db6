// cudamem/detail/pool/host_stream_events.hpp — a host model of the device behind pool_resource's
// stream-order calls (stream_events.hpp), for tests and simulations: no CUDA, and a device that
// is always behind the host.
//
//   cudamem::detail::host_stream_events model;
//   const cudamem::detail::scoped_pool_stream_events use{model};  // pools built now use it
//   cudamem::pool_resource pool{simulated};   // tracks streams over any memory
//   ... pool.allocate(n, 256, s1); pool.deallocate(p, n, 256, s1); ...
//   model.complete_all();                     // the "device" catches up
//
// A recorded event completes only when the test (or the simulation) says so (`complete_all`, or
// `complete_after` records), so a test can say exactly which waits a request must produce.
// A header of its own, included only where it is used: its maps are a measurable share of the
// compile time of every translation unit that includes the pool.
//
// Contract: it locks itself (any thread may call it). Events it made are only ever given back
// to it.
#pragma once

#include <cudamem/detail/pool/stream_events.hpp>
#include <cudamem/detail/sync/mutex.hpp>
#include <cudamem/error.hpp>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <map>
#include <unordered_map>
#include <unordered_set>

namespace cudamem::detail {

/// A host model of the device for tests and simulations: events are numbers, and a recorded
/// event completes only when told (the device is always behind the host until then). Counts
/// every call. Stream ids: the handle's value plus a generation that `recreate(stream)` bumps
/// (a stream destroyed and created again with the same handle).
class host_stream_events final : public stream_event_driver {
 public:
  struct call_counts {
    std::size_t record = 0, query = 0, wait = 0, synchronize = 0, synchronize_device = 0,
                synchronize_stream = 0, stream_id = 0, destroy = 0, capturing = 0;
  };

  /// What a stream was last made to wait for: the record number of each event it waited on.
  struct wait_record {
    cudaStream_t stream;
    cudaEvent_t event;
    std::uint64_t record;  ///< which record of the event (1, 2, ...)
  };

  void record(cudaEvent_t& event, cudaStream_t stream, int /*device*/) override {
    const detail::lock_guard lock(mutex_);
    ++calls_.record;
    if (captured_.count(stream) != 0) {
      throw cuda_error(cudaErrorStreamCaptureUnsupported, "host_stream_events: a record on a "
                                                          "stream being captured");
    }
    if (event == nullptr) {
      event = reinterpret_cast<cudaEvent_t>(++next_event_);  // a number, never dereferenced
    }
    state& s = events_[event];
    ++s.records;
    s.recorded_on = stream;
    const auto work = last_work_.find(stream);
    s.recorded_at = work != last_work_.end() ? work->second : tick_;
    s.complete = complete_at_record_ || s.recorded_at < completed_before_;
  }
  bool query(cudaEvent_t event) override {
    const detail::lock_guard lock(mutex_);
    ++calls_.query;
    return events_[event].complete;
  }
  void wait(cudaStream_t stream, cudaEvent_t event) override {
    const detail::lock_guard lock(mutex_);
    ++calls_.wait;
    const state& s = events_[event];
    last_wait_ = {stream, event, s.records};
    ++wait_distances_[tick_ >= s.recorded_at ? tick_ - s.recorded_at : 0];
  }
  void synchronize(cudaEvent_t event) override {
    const detail::lock_guard lock(mutex_);
    ++calls_.synchronize;
    events_[event].complete = true;
  }
  void synchronize_device(int /*device*/) override {
    const detail::lock_guard lock(mutex_);
    ++calls_.synchronize_device;
    for (auto& [event, s] : events_) {
      s.complete = true;
    }
  }
  cudaError_t synchronize_stream(cudaStream_t stream) noexcept override {
    const detail::lock_guard lock(mutex_);
    ++calls_.synchronize_stream;
    for (auto& [event, s] : events_) {
      s.complete = s.complete || s.recorded_on == stream;
    }
    return cudaSuccess;
  }
  std::uint64_t stream_id(cudaStream_t stream) noexcept override {
    const detail::lock_guard lock(mutex_);
    ++calls_.stream_id;
    const auto it = generations_.find(stream);
    const std::uint64_t generation = it == generations_.end() ? 0 : it->second;
    return (reinterpret_cast<std::uint64_t>(stream) << 8) + generation + 1;
  }
  void destroy(cudaEvent_t event) noexcept override {
    const detail::lock_guard lock(mutex_);
    ++calls_.destroy;
    events_.erase(event);
  }
  bool capturing(cudaStream_t stream) noexcept override {
    const detail::lock_guard lock(mutex_);
    ++calls_.capturing;
    return captured_.count(stream) != 0;
  }

  // --- what tests and simulations drive and read --------------------------------------------

  /// Every event recorded so far is complete (the device caught up).
  void complete_all() {
    const detail::lock_guard lock(mutex_);
    for (auto& [event, s] : events_) {
      s.complete = true;
    }
  }
  /// The simulated device's clock: records are stamped with the tick of the last work put on
  /// their stream (`note_work`; the current tick if none was noted), and
  /// `complete_recorded_before(t)` completes those stamped before `t` (a device `lag` ticks
  /// behind the host completes, at tick t, what was recorded before t - lag). Each wait is
  /// filed under how many ticks back the work it waits for was put on its stream.
  void set_tick(std::uint64_t tick) {
    const detail::lock_guard lock(mutex_);
    tick_ = tick;
  }
  void note_work(cudaStream_t stream, std::uint64_t tick) {
    const detail::lock_guard lock(mutex_);
    last_work_[stream] = tick;
  }
  /// Waits by distance in ticks (see set_tick).
  [[nodiscard]] std::map<std::uint64_t, std::size_t> wait_distances() const {
    const detail::lock_guard lock(mutex_);
    return wait_distances_;
  }
  void complete_recorded_before(std::uint64_t tick) {
    const detail::lock_guard lock(mutex_);
    completed_before_ = std::max(completed_before_, tick);
    for (auto& [event, s] : events_) {
      s.complete = s.complete || s.recorded_at < tick;
    }
  }
  /// From now on, records complete at once (an idle device) or not (the default: busy).
  void complete_at_record(bool yes) {
    const detail::lock_guard lock(mutex_);
    complete_at_record_ = yes;
  }
  /// `stream` is being captured into a graph (until set false): capturing() says so, and a
  /// record on it fails as CUDA's would (cuda_error, cudaErrorStreamCaptureUnsupported).
  void set_capturing(cudaStream_t stream, bool yes) {
    const detail::lock_guard lock(mutex_);
    if (yes) {
      captured_.insert(stream);
    } else {
      captured_.erase(stream);
    }
  }
  /// `stream` was destroyed and a new stream created with the same handle.
  void recreate(cudaStream_t stream) {
    const detail::lock_guard lock(mutex_);
    ++generations_[stream];
  }
  [[nodiscard]] call_counts calls() const {
    const detail::lock_guard lock(mutex_);
    return calls_;
  }
  [[nodiscard]] wait_record last_wait() const {
    const detail::lock_guard lock(mutex_);
    return last_wait_;
  }
  /// Which stream `event` was last recorded on (nullptr if never).
  [[nodiscard]] cudaStream_t recorded_on(cudaEvent_t event) const {
    const detail::lock_guard lock(mutex_);
    const auto it = events_.find(event);
    return it == events_.end() ? nullptr : it->second.recorded_on;
  }
  [[nodiscard]] std::size_t live_events() const {
    const detail::lock_guard lock(mutex_);
    return events_.size();
  }

 private:
  struct state {
    std::uint64_t records = 0;
    cudaStream_t recorded_on = nullptr;
    std::uint64_t recorded_at = 0;
    bool complete = false;
  };
  mutable detail::mutex mutex_;
  call_counts calls_;
  std::unordered_map<cudaEvent_t, state> events_;
  std::unordered_map<cudaStream_t, std::uint64_t> generations_;
  std::unordered_set<cudaStream_t> captured_;
  std::unordered_map<cudaStream_t, std::uint64_t> last_work_;
  std::map<std::uint64_t, std::size_t> wait_distances_;
  std::uintptr_t next_event_ = 0;
  std::uint64_t tick_ = 0;
  std::uint64_t completed_before_ = 0;  ///< work of earlier ticks is done
  wait_record last_wait_{nullptr, nullptr, 0};
  bool complete_at_record_ = false;
};

}  // namespace cudamem::detail
