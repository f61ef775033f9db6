// cudamem/detail/pool/stream_events.hpp — the CUDA calls pool_resource makes to keep stream
// order (events, stream waits, synchronisation), behind one small interface, and what it
// counts of them.
//
//   stream_event_driver& calls = cuda_stream_events();  // the CUDA runtime's (the default)
//   calls.record(event, stream, device);                 // creates the event on first use
//   if (!calls.query(event)) calls.wait(other, event);   // cudaEventQuery, cudaStreamWaitEvent
//
//   host_stream_events model;                            // tests and simulations: no CUDA
//   const scoped_pool_stream_events use{model};          // pools built in this scope use it
//   pool_resource pool{simulated};                       // ...and track streams, over any memory
//
// Why an interface. The ledger's logic (which block may go to which stream, when a wait is
// needed, when one can be skipped) is what decides whether a multi-stream program loses its
// streams' overlap; it deserves host tests like the rest of the pool. The calls sit on the
// pool's slow paths only (a block crossing streams), where one virtual call is nothing beside
// the driver call behind it. A pool reads the driver once, when it is built.
//
// `host_stream_events` is a model of a device that is always behind the host: a recorded event
// completes only when the test (or the simulation) says so (`complete_all`, or `complete_after`
// records), so a test can say exactly which waits a request must produce.
//
// Contract: the CUDA driver is thread-safe as CUDA is; the host model locks itself. Events
// made by one driver are only ever given back to it.
#pragma once

#include <cudamem/detail/stream_tag.hpp>
#include <cudamem/error.hpp>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <unordered_map>
#include <unordered_set>

namespace cudamem::detail {

/// The stream-order calls of pool_resource's ledger. Every call but destroy, stream_id and
/// synchronize_stream throws cuda_error on failure.
class stream_event_driver {
 public:
  virtual ~stream_event_driver() = default;
  /// Records `event` on `stream` (creating it on `device`, the stream's, when it is null).
  virtual void record(cudaEvent_t& event, cudaStream_t stream, int device) = 0;
  /// True when the work the event's last record covers is complete; false while it is not.
  virtual bool query(cudaEvent_t event) = 0;
  /// Makes later work on `stream` wait, on the device, for the event's last record.
  virtual void wait(cudaStream_t stream, cudaEvent_t event) = 0;
  /// Waits on the host for the event's last record.
  virtual void synchronize(cudaEvent_t event) = 0;
  /// Waits on the host for all work on `device` (-1: the current one).
  virtual void synchronize_device(int device) = 0;
  /// Waits on the host for `stream` (the fallback when a free cannot be tracked); noexcept.
  virtual cudaError_t synchronize_stream(cudaStream_t stream) noexcept = 0;
  /// A number naming `stream` for its whole life, never given to another stream, even one
  /// created later with the same handle (cudaStreamGetId); 0 when it cannot tell.
  virtual std::uint64_t stream_id(cudaStream_t stream) noexcept = 0;
  virtual void destroy(cudaEvent_t event) noexcept = 0;
  /// Whether `stream` is being captured into a CUDA graph now. No event may be recorded on it
  /// then: the record would become a node of the graph, not a point in the stream's work (and
  /// the runtime refuses some of the calls around it, failing the capture). noexcept; a model
  /// device without graphs says false.
  virtual bool capturing(cudaStream_t /*stream*/) noexcept { return false; }

 protected:
  stream_event_driver() = default;
  stream_event_driver(const stream_event_driver&) = default;
  stream_event_driver& operator=(const stream_event_driver&) = default;
};

/// The CUDA runtime's calls.
class cuda_stream_event_driver final : public stream_event_driver {
 public:
  /// Events are created and recorded on the stream's own device, whatever device is current:
  /// a default stream's device is `device` (the pool's), since the handle alone names
  /// whichever device is current.
  void record(cudaEvent_t& event, cudaStream_t stream, int device) override {
    if (device < 0 || !is_default_stream(stream)) {
      check(cudaStreamGetDevice(stream, &device), "pool_resource: cudaStreamGetDevice");
    }
    int previous = 0;
    check(cudaGetDevice(&previous), "pool_resource: cudaGetDevice");
    if (previous != device) {
      check(cudaSetDevice(device), "pool_resource: cudaSetDevice");
    }
    cudaError_t code = cudaSuccess;
    if (event == nullptr) {
      code = cudaEventCreateWithFlags(&event, cudaEventDisableTiming);
    }
    if (code == cudaSuccess) {
      code = cudaEventRecord(event, stream);
    }
    if (previous != device) {
      static_cast<void>(cudaSetDevice(previous));
    }
    check(code, "pool_resource: recording an event after a free");
  }
  bool query(cudaEvent_t event) override {
    const cudaError_t state = cudaEventQuery(event);
    if (state == cudaErrorNotReady) {
      static_cast<void>(cudaGetLastError());
      return false;
    }
    check(state, "pool_resource: cudaEventQuery");
    return true;
  }
  void wait(cudaStream_t stream, cudaEvent_t event) override {
    check(cudaStreamWaitEvent(stream, event, 0),
          "pool_resource: cudaStreamWaitEvent before cross-stream reuse");
  }
  void synchronize(cudaEvent_t event) override {
    check(cudaEventSynchronize(event), "pool_resource: cudaEventSynchronize");
  }
  void synchronize_device(int device) override {
    int previous = 0;
    check(cudaGetDevice(&previous), "pool_resource: cudaGetDevice");
    const int target = device >= 0 ? device : previous;
    if (previous != target) {
      check(cudaSetDevice(target), "pool_resource: cudaSetDevice");
    }
    const cudaError_t code = cudaDeviceSynchronize();
    if (previous != target) {
      static_cast<void>(cudaSetDevice(previous));
    }
    check(code, "pool_resource: cudaDeviceSynchronize");
  }
  cudaError_t synchronize_stream(cudaStream_t stream) noexcept override {
    return cudaStreamSynchronize(stream);
  }
  std::uint64_t stream_id(cudaStream_t stream) noexcept override {
    unsigned long long id = 0;  // NOLINT(google-runtime-int): the runtime's type
    if (cudaStreamGetId(stream, &id) != cudaSuccess) {
      static_cast<void>(cudaGetLastError());
      return 0;
    }
    return id;
  }
  void destroy(cudaEvent_t event) noexcept override {
    report_error(cudaEventDestroy(event), "pool_resource: cudaEventDestroy");
  }
  bool capturing(cudaStream_t stream) noexcept override {
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    const cudaError_t code = cudaStreamIsCapturing(stream, &status);
    if (code != cudaSuccess) {
      // The legacy default stream while another stream captures, or a capture already
      // invalidated: nothing can be recorded on it either.
      static_cast<void>(cudaGetLastError());
      return code == cudaErrorStreamCaptureImplicit || code == cudaErrorStreamCaptureInvalidated;
    }
    return status != cudaStreamCaptureStatusNone;
  }
};

/// The process's CUDA driver object (stateless; never destroyed, so pools destroyed at exit
/// can still use it).
[[nodiscard]] inline stream_event_driver& cuda_stream_events() noexcept {
  static auto* driver = new cuda_stream_event_driver;
  return *driver;
}

/// Tests and simulations: the driver pools built from now on use, with stream tracking on
/// whatever their upstream (see scoped_pool_stream_events). Null: the CUDA runtime's, and
/// streams tracked only over stream-ordered device memory.
inline std::atomic<stream_event_driver*> pool_stream_events_override{nullptr};

/// While it lives, pools built (on any thread) use `driver` and track streams.
class scoped_pool_stream_events {
 public:
  explicit scoped_pool_stream_events(stream_event_driver& driver) noexcept
      : previous_(pool_stream_events_override.exchange(&driver)) {}
  ~scoped_pool_stream_events() { pool_stream_events_override.store(previous_); }
  scoped_pool_stream_events(const scoped_pool_stream_events&) = delete;
  scoped_pool_stream_events& operator=(const scoped_pool_stream_events&) = delete;

 private:
  stream_event_driver* previous_;
};

/// Benchmarks: how pools built from now on choose blocks across streams (both on by default,
/// as pool_resource's contract says). Off, a pool behaves as it did before issue 39 — the
/// first pick whatever it waits for; a query and a wait for every block that crosses streams —
/// so that bench_workload can measure both in one run. Not for programs.
struct pool_stream_choices {
  bool prefer_ready = true;    ///< look for a block that needs no wait before waiting
  bool remember_waits = true;  ///< a stream waits once per recording of another's event
};
inline std::atomic<unsigned> pool_stream_choices_bits{3};  // bit 0: prefer_ready, 1: remember

[[nodiscard]] inline pool_stream_choices current_pool_stream_choices() noexcept {
  const unsigned bits = pool_stream_choices_bits.load();
  return {(bits & 1U) != 0, (bits & 2U) != 0};
}

/// While it lives, pools built (on any thread) make the given choices.
class scoped_pool_stream_choices {
 public:
  explicit scoped_pool_stream_choices(pool_stream_choices c) noexcept
      : previous_(pool_stream_choices_bits.exchange((c.prefer_ready ? 1U : 0U) |
                                                    (c.remember_waits ? 2U : 0U))) {}
  ~scoped_pool_stream_choices() { pool_stream_choices_bits.store(previous_); }
  scoped_pool_stream_choices(const scoped_pool_stream_choices&) = delete;
  scoped_pool_stream_choices& operator=(const scoped_pool_stream_choices&) = delete;

 private:
  unsigned previous_;
};

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
    const std::lock_guard lock(mutex_);
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
    const std::lock_guard lock(mutex_);
    ++calls_.query;
    return events_[event].complete;
  }
  void wait(cudaStream_t stream, cudaEvent_t event) override {
    const std::lock_guard lock(mutex_);
    ++calls_.wait;
    const state& s = events_[event];
    last_wait_ = {stream, event, s.records};
    ++wait_distances_[tick_ >= s.recorded_at ? tick_ - s.recorded_at : 0];
  }
  void synchronize(cudaEvent_t event) override {
    const std::lock_guard lock(mutex_);
    ++calls_.synchronize;
    events_[event].complete = true;
  }
  void synchronize_device(int /*device*/) override {
    const std::lock_guard lock(mutex_);
    ++calls_.synchronize_device;
    for (auto& [event, s] : events_) {
      s.complete = true;
    }
  }
  cudaError_t synchronize_stream(cudaStream_t stream) noexcept override {
    const std::lock_guard lock(mutex_);
    ++calls_.synchronize_stream;
    for (auto& [event, s] : events_) {
      s.complete = s.complete || s.recorded_on == stream;
    }
    return cudaSuccess;
  }
  std::uint64_t stream_id(cudaStream_t stream) noexcept override {
    const std::lock_guard lock(mutex_);
    ++calls_.stream_id;
    const auto it = generations_.find(stream);
    const std::uint64_t generation = it == generations_.end() ? 0 : it->second;
    return (reinterpret_cast<std::uint64_t>(stream) << 8) + generation + 1;
  }
  void destroy(cudaEvent_t event) noexcept override {
    const std::lock_guard lock(mutex_);
    ++calls_.destroy;
    events_.erase(event);
  }
  bool capturing(cudaStream_t stream) noexcept override {
    const std::lock_guard lock(mutex_);
    ++calls_.capturing;
    return captured_.count(stream) != 0;
  }

  // --- what tests and simulations drive and read --------------------------------------------

  /// Every event recorded so far is complete (the device caught up).
  void complete_all() {
    const std::lock_guard lock(mutex_);
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
    const std::lock_guard lock(mutex_);
    tick_ = tick;
  }
  void note_work(cudaStream_t stream, std::uint64_t tick) {
    const std::lock_guard lock(mutex_);
    last_work_[stream] = tick;
  }
  /// Waits by distance in ticks (see set_tick).
  [[nodiscard]] std::map<std::uint64_t, std::size_t> wait_distances() const {
    const std::lock_guard lock(mutex_);
    return wait_distances_;
  }
  void complete_recorded_before(std::uint64_t tick) {
    const std::lock_guard lock(mutex_);
    completed_before_ = std::max(completed_before_, tick);
    for (auto& [event, s] : events_) {
      s.complete = s.complete || s.recorded_at < tick;
    }
  }
  /// From now on, records complete at once (an idle device) or not (the default: busy).
  void complete_at_record(bool yes) {
    const std::lock_guard lock(mutex_);
    complete_at_record_ = yes;
  }
  /// `stream` is being captured into a graph (until set false): capturing() says so, and a
  /// record on it fails as CUDA's would (cuda_error, cudaErrorStreamCaptureUnsupported).
  void set_capturing(cudaStream_t stream, bool yes) {
    const std::lock_guard lock(mutex_);
    if (yes) {
      captured_.insert(stream);
    } else {
      captured_.erase(stream);
    }
  }
  /// `stream` was destroyed and a new stream created with the same handle.
  void recreate(cudaStream_t stream) {
    const std::lock_guard lock(mutex_);
    ++generations_[stream];
  }
  [[nodiscard]] call_counts calls() const {
    const std::lock_guard lock(mutex_);
    return calls_;
  }
  [[nodiscard]] wait_record last_wait() const {
    const std::lock_guard lock(mutex_);
    return last_wait_;
  }
  /// Which stream `event` was last recorded on (nullptr if never).
  [[nodiscard]] cudaStream_t recorded_on(cudaEvent_t event) const {
    const std::lock_guard lock(mutex_);
    const auto it = events_.find(event);
    return it == events_.end() ? nullptr : it->second.recorded_on;
  }
  [[nodiscard]] std::size_t live_events() const {
    const std::lock_guard lock(mutex_);
    return events_.size();
  }

 private:
  struct state {
    std::uint64_t records = 0;
    cudaStream_t recorded_on = nullptr;
    std::uint64_t recorded_at = 0;
    bool complete = false;
  };
  mutable std::mutex mutex_;
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
