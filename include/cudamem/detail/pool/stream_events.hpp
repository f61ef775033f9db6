// cudamem/detail/pool/stream_events.hpp — the CUDA calls pool_resource makes to keep stream
// order (events, stream waits, synchronisation), behind one small interface, and what it
// counts of them.
//
//   stream_event_driver& calls = cuda_stream_events();  // the CUDA runtime's (the default)
//   calls.record(event, stream, device);                 // creates the event on first use
//   if (!calls.query(event)) calls.wait(other, event);   // cudaEventQuery, cudaStreamWaitEvent
//
//   host_stream_events model;                            // host_stream_events.hpp: no CUDA
//   const scoped_pool_stream_events use{model};          // pools built in this scope use it
//   pool_resource pool{simulated};                       // ...and track streams, over any memory
//
// Why an interface. The ledger's logic (which block may go to which stream, when a wait is
// needed, when one can be skipped) is what decides whether a multi-stream program loses its
// streams' overlap; it deserves host tests like the rest of the pool. The calls sit on the
// pool's slow paths only (a block crossing streams), where one virtual call is nothing beside
// the driver call behind it. A pool reads the driver once, when it is built.
//
// `host_stream_events` (host_stream_events.hpp, included by the tests and simulations that use
// it, not by the pool) is a model of a device that is always behind the host.
//
// Contract: the CUDA driver is thread-safe as CUDA is; the host model locks itself. Events
// made by one driver are only ever given back to it.
#pragma once

#include <cudamem/detail/stream_tag.hpp>
#include <cudamem/detail/sync/atomic.hpp>
#include <cudamem/detail/sync/mutex.hpp>
#include <cudamem/error.hpp>

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

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
inline detail::atomic<stream_event_driver*> pool_stream_events_override{nullptr};

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
/// as pool_resource's contract says). Off, a pool chooses blocks naively — the
/// first pick whatever it waits for; a query and a wait for every block that crosses streams —
/// so that bench_workload can measure both in one run. Not for programs.
struct pool_stream_choices {
  bool prefer_ready = true;    ///< look for a block that needs no wait before waiting
  bool remember_waits = true;  ///< a stream waits once per recording of another's event
};
inline detail::atomic<unsigned> pool_stream_choices_bits{3};  // bit 0: prefer_ready, 1: remember

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

}  // namespace cudamem::detail
