// cudamem/detail/pool/stream_ledger.hpp — pool_resource's stream-order ledger: which streams
// blocks were freed on, and the events that tell when those frees are complete.
//
//   stream_ledger ledger;                      // one per shard, under the shard's lock
//   ledger.note_free(block.tag, s, device);    // "the last use of this block was put on s"
//   make_ready(block.tag, &t, device);         // before the block goes to a request on t
//   ledger.retire(s);                          // s is about to be destroyed
//
// What it owns. A free on stream s only says that s's work up to that point uses the block:
// the memory may be reused at once on s (stream order), and on another stream t once that work
// is done. Per stream, the ledger counts the frees (`stream_record::frees`) and owns one event;
// each free block carries a tag (`pending_frees`): the count on each stream just after its
// last free there. A block is ready for t when every entry is known done, or is on t itself.
// Events are recorded lazily — only when a block freed on s is about to go to another stream —
// so single-stream code never calls CUDA; one recording then covers every free made so far.
// `make_ready` either finds the event complete or makes t wait on it (cudaStreamWaitEvent,
// free for t if s is already past it); the synchronous form (no stream) waits on the host.
// A tag remembers up to 4 streams; a block merged from frees on more is handed out only after
// a device-wide synchronisation. Frees on cudaStreamPerThread record their event at once
// (another thread can never name that stream later).
//
// Not thread-safe: the owning shard's lock guards its ledger and its blocks' tags.
#pragma once

#include <cudamem/error.hpp>
#include <cudamem/stream.hpp>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <thread>
#include <vector>

namespace cudamem::detail {

/// One stream frees were made on. A block freed on it remembers `frees` just after that free,
/// and is safe for other streams once an event recorded after it has completed.
struct stream_record {
  cudaStream_t handle = nullptr;
  int device = -1;                  ///< the pool's device: a default stream's device
  std::thread::id thread;           ///< the owner, for cudaStreamPerThread only
  std::uint64_t frees = 0;          ///< frees made on this stream so far
  cudaEvent_t event = nullptr;      ///< created when first needed
  std::uint64_t event_covers = 0;   ///< frees before the last record of `event`
  std::uint64_t done = 0;           ///< frees known complete
  bool retired = false;

  [[nodiscard]] bool is(stream_view s) const noexcept {
    return s.get() == handle &&
           (handle != cudaStreamPerThread || thread == std::this_thread::get_id());
  }
};

/// A free block's tag: the frees it is made of that may still be pending, by stream. The count
/// and the first entry come first: with the block's own fields they share one cache line.
struct pending_frees {
  static constexpr std::size_t capacity = 4;
  struct entry {
    stream_record* stream;
    std::uint64_t free_count;  ///< stream->frees just after the last free on it in this block
  };
  std::uint8_t count = 0;
  bool overflow = false;  ///< more streams than fit: hand out only after a device sync
  std::array<entry, capacity> entries{};

  /// Two free blocks merged: the result waits for both.
  void absorb(const pending_frees& other) noexcept {
    overflow = overflow || other.overflow;
    for (std::size_t i = 0; i < other.count; ++i) {
      add(other.entries[i].stream, other.entries[i].free_count);
    }
  }
  void add(stream_record* rec, std::uint64_t n) noexcept {
    for (std::size_t j = 0; j < count; ++j) {
      if (entries[j].stream == rec) {
        entries[j].free_count = std::max(entries[j].free_count, n);
        return;
      }
    }
    if (count == capacity) {
      overflow = true;
      return;
    }
    entries[count] = {rec, n};
    ++count;
  }
  [[nodiscard]] bool empty() const noexcept { return count == 0 && !overflow; }
  void clear() noexcept {  // the entries past `count` are never read
    count = 0;
    overflow = false;
  }
  /// True when the only pending frees were made on `stream` (not retired): stream order
  /// alone separates them from a request on it (the common case, checked inline).
  [[nodiscard]] bool only_on(const stream_view* s) const noexcept {
    return count == 1 && !overflow && s != nullptr && entries[0].stream->is(*s) &&
           !entries[0].stream->retired;
  }
};

/// Waits on the host for all work on `device` (-1: the current one), restoring the current
/// device. Throws cuda_error.
inline void synchronize_device(int device) {
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

/// Whether `s` names a default stream: which device's it is depends on the current device.
[[nodiscard]] inline bool is_default_stream(cudaStream_t s) noexcept {
  return s == nullptr || s == cudaStreamLegacy || s == cudaStreamPerThread;
}

/// Records rec's event on its stream now, covering every free made on it so far. The event is
/// created and recorded on the stream's own device, whatever device is current: a default
/// stream's device is the pool's (`rec.device`), since the handle alone names whichever device
/// is current. Throws cuda_error.
inline void record_event(stream_record& rec) {
  int device = rec.device;
  if (device < 0 || !is_default_stream(rec.handle)) {
    check(cudaStreamGetDevice(rec.handle, &device), "pool_resource: cudaStreamGetDevice");
  }
  int previous = 0;
  check(cudaGetDevice(&previous), "pool_resource: cudaGetDevice");
  if (previous != device) {
    check(cudaSetDevice(device), "pool_resource: cudaSetDevice");
  }
  cudaError_t code = cudaSuccess;
  if (rec.event == nullptr) {
    code = cudaEventCreateWithFlags(&rec.event, cudaEventDisableTiming);
  }
  if (code == cudaSuccess) {
    code = cudaEventRecord(rec.event, rec.handle);
  }
  if (previous != device) {
    static_cast<void>(cudaSetDevice(previous));
  }
  check(code, "pool_resource: recording an event after a free");
  rec.event_covers = rec.frees;
}

/// Makes a block tagged `pending` (not empty) safe to hand out on `stream` (null: to everyone,
/// waiting on the host), then clears the tag. `device` is the pool's, for the device-wide
/// synchronisation an overflowing tag needs. Throws cuda_error; the tag is then unchanged
/// but for what is known complete.
inline void make_ready(pending_frees& pending, const stream_view* stream, int device) {
  if (pending.overflow) {
    synchronize_device(device);
    pending.clear();
    return;
  }
  for (std::size_t i = 0; i < pending.count; ++i) {
    stream_record& rec = *pending.entries[i].stream;
    const std::uint64_t n = pending.entries[i].free_count;
    if (n <= rec.done || (stream != nullptr && rec.is(*stream) && !rec.retired)) {
      continue;  // complete, or ordered before this request by the stream itself
    }
    if (rec.event_covers < n) {
      record_event(rec);
    }
    if (stream == nullptr) {
      check(cudaEventSynchronize(rec.event), "pool_resource: cudaEventSynchronize");
      rec.done = std::max(rec.done, rec.event_covers);
      continue;
    }
    const cudaError_t state = cudaEventQuery(rec.event);
    if (state == cudaSuccess) {
      rec.done = std::max(rec.done, rec.event_covers);
    } else if (state == cudaErrorNotReady) {
      static_cast<void>(cudaGetLastError());
      check(cudaStreamWaitEvent(stream->get(), rec.event, 0),
            "pool_resource: cudaStreamWaitEvent before cross-stream reuse");
    } else {
      check(state, "pool_resource: cudaEventQuery");
    }
  }
  pending.clear();
}

/// One shard's streams: a record per stream frees were made on, and the one looked up last
/// (nearly every free is on it).
class stream_ledger {
 public:
  stream_ledger() = default;
  stream_ledger(const stream_ledger&) = delete;
  stream_ledger& operator=(const stream_ledger&) = delete;
  ~stream_ledger() {
    for (const auto& rec : streams_) {
      if (rec->event != nullptr) {
        report_error(cudaEventDestroy(rec->event), "pool_resource: cudaEventDestroy");
      }
    }
  }

  /// The record of `handle` when it is the one looked up last and a free on it needs nothing
  /// more than a count (the inline fast path); nullptr otherwise.
  [[nodiscard]] stream_record* last_if(cudaStream_t handle) const noexcept {
    stream_record* rec = last_;
    return rec != nullptr && rec->handle == handle && handle != cudaStreamPerThread &&
                   !rec->retired
               ? rec
               : nullptr;
  }

  /// Tags `tag` with a free on `s` (`device`: the pool's). On any failure, waits for `s`
  /// instead (then nothing is pending).
  void note_free(pending_frees& tag, stream_view s, int device) noexcept {
    try {
      stream_record& rec = record_for(s, device);
      ++rec.frees;
      if (rec.handle == cudaStreamPerThread) {
        record_event(rec);  // no other thread can name this stream later
      }
      tag.add(&rec, rec.frees);
    } catch (...) {
      report_error(cudaStreamSynchronize(s.get()),
                   "pool_resource: waiting for the stream after failing to track a free");
    }
  }

  /// `s` is about to be destroyed: records an event covering its frees (if any is not yet
  /// covered) and stops using its record for new frees. Throws cuda_error.
  void retire(stream_view s) {
    for (auto& rec : streams_) {
      if (!rec->retired && rec->is(s)) {
        if (rec->frees > rec->event_covers) {
          record_event(*rec);
        }
        rec->retired = true;
        last_ = nullptr;
      }
    }
  }

  /// Whether a free on any stream is not yet known complete.
  [[nodiscard]] bool owes_any() const noexcept {
    return std::any_of(streams_.begin(), streams_.end(),
                       [](const auto& rec) { return rec->frees > rec->done; });
  }

 private:
  stream_record& record_for(stream_view s, int device) {
    stream_record* rec = last_;
    if (rec != nullptr && rec->is(s) && !rec->retired) {
      return *rec;
    }
    for (auto& r : streams_) {
      if (!r->retired && r->is(s)) {
        last_ = r.get();
        return *r;
      }
    }
    auto fresh = std::make_unique<stream_record>();
    fresh->handle = s.get();
    fresh->device = device;
    fresh->thread = std::this_thread::get_id();
    streams_.push_back(std::move(fresh));
    last_ = streams_.back().get();
    return *last_;
  }

  std::vector<std::unique_ptr<stream_record>> streams_;
  stream_record* last_ = nullptr;
};

}  // namespace cudamem::detail
