// cudamem/detail/pool/stream_ledger.hpp — pool_resource's stream-order ledger: which streams
// blocks were freed on, the events that tell when those frees are complete, and which
// streams already wait for them.
//
//   stream_ledger ledger{driver, device};        // one per shard, under the shard's lock
//   ledger.note_free(block.tag, s);              // "the last use of this block was put on s"
//   if (ledger.ready_for(block.tag, &t)) ...     // no wait needed: prefer this block for t
//   ledger.make_ready(block.tag, &t);            // before the block goes to a request on t
//   ledger.retire(s);                            // s is about to be destroyed
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
// A tag remembers up to 4 streams; a block merged from frees on more is ordered after every
// stream with frees not known complete (it used to wait for the whole device, which CUDA
// refuses while a stream is being captured). A record is kept per stream *tag*
// (detail/stream_tag.hpp): cudaStreamPerThread, and 0 in a `--default-stream per-thread`
// build, is a different stream on each thread, and a thread's tag is never reused, so a thread
// that starts after another has ended never takes that thread's pending frees as its own. Frees
// on a thread's own stream record their event at once: no other thread can name that stream,
// so no one could record it later.
//
// Waits are made once. A stream-step of a multi-stream program takes dozens of
// blocks another stream freed, all covered by one recording of that stream's event. Each used
// to cost a cudaEventQuery and a cudaStreamWaitEvent: two driver calls per block, on the host
// thread that also launches the kernels. Now each record remembers, for the last few streams
// that waited on its event, how many frees that wait covered (`stream_record::waiters`); a
// block whose frees are covered needs no call at all for that stream. A stream handle can be
// destroyed and the value reused by a new stream the pool never heard of, which has waited for
// nothing: so a remembered wait names the stream by its id (cudaStreamGetId, unique for the
// process's life), checked before it is trusted. Default streams are never remembered (the
// per-thread one is a different stream on each thread, the legacy one on each device).
//
// Counts (`stream_counters`): plain integers under the shard's lock, on the slow paths only.
//
// Not thread-safe: the owning shard's lock guards its ledger and its blocks' tags.
#pragma once

#include <cudamem/detail/pool/stream_events.hpp>
#include <cudamem/detail/stream_tag.hpp>
#include <cudamem/detail/unique_owner.hpp>
#include <cudamem/error.hpp>
#include <cudamem/stream.hpp>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <vector>

namespace cudamem::detail {

/// A stream that waited on a record's event, and how many of the record's frees that wait
/// covered.
struct stream_waiter {
  cudaStream_t handle = nullptr;
  std::uint64_t id = 0;      ///< the stream's id when it waited (0: empty slot)
  std::uint64_t covers = 0;  ///< frees on the record's stream the wait covers
};

/// One stream frees were made on. A block freed on it remembers `frees` just after that free,
/// and is safe for other streams once an event recorded after it has completed.
struct stream_record {
  static constexpr std::size_t waiter_capacity = 4;

  cudaStream_t handle = nullptr;    ///< the stream's tag (stream_tag.hpp), not always a handle
  int device = -1;                  ///< the pool's device: a default stream's device
  std::uint64_t frees = 0;          ///< frees made on this stream so far
  cudaEvent_t event = nullptr;      ///< created when first needed
  std::uint64_t event_covers = 0;   ///< frees before the last record of `event`
  std::uint64_t done = 0;           ///< frees known complete
  bool retired = false;
  std::uint8_t next_waiter = 0;     ///< the slot the next new waiter replaces
  std::array<stream_waiter, waiter_capacity> waiters{};  ///< streams made to wait on `event`

  [[nodiscard]] bool is(stream_view s) const noexcept { return stream_tag(s.get()) == handle; }
  /// The slot remembering a wait by a stream with this handle, or nullptr.
  [[nodiscard]] stream_waiter* waiter(cudaStream_t h) noexcept {
    for (stream_waiter& w : waiters) {
      if (w.id != 0 && w.handle == h) {
        return &w;
      }
    }
    return nullptr;
  }
  [[nodiscard]] const stream_waiter* waiter(cudaStream_t h) const noexcept {
    return const_cast<stream_record*>(this)->waiter(h);
  }
  void remember_waiter(cudaStream_t h, std::uint64_t id, std::uint64_t covers) noexcept {
    stream_waiter* w = waiter(h);
    if (w == nullptr) {
      w = &waiters[next_waiter];
      next_waiter = static_cast<std::uint8_t>((next_waiter + 1) % waiter_capacity);
    }
    *w = {h, id, covers};
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
  bool overflow = false;  ///< more streams than fit: ordered after every stream (make_ready)
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

/// What a shard's ledger did to keep stream order (pool_resource::stream_stats sums them).
struct stream_counters {
  std::uint64_t cross_stream_blocks = 0;  ///< blocks handed out with another stream's frees pending
  std::uint64_t preferred_blocks = 0;     ///< a block needing no wait taken in place of the first pick
  std::uint64_t event_records = 0;
  std::uint64_t event_queries = 0;
  std::uint64_t stream_waits = 0;         ///< cudaStreamWaitEvent calls
  std::uint64_t waits_skipped = 0;        ///< the stream already waited for those frees: no call
  std::uint64_t host_waits = 0;           ///< cudaEventSynchronize (the synchronous allocate)
  std::uint64_t wide_tags = 0;            ///< a tag of more streams than it holds, made ready

  void add(const stream_counters& o) noexcept {
    cross_stream_blocks += o.cross_stream_blocks;
    preferred_blocks += o.preferred_blocks;
    event_records += o.event_records;
    event_queries += o.event_queries;
    stream_waits += o.stream_waits;
    waits_skipped += o.waits_skipped;
    host_waits += o.host_waits;
    wide_tags += o.wide_tags;
  }
};

/// One shard's streams: a record per stream frees were made on, and the one looked up last
/// (nearly every free is on it).
class stream_ledger {
 public:
  /// `device`: the pool's (a default stream's device).
  /// `remember_waits` false: every block that crosses streams is checked with the driver (the
  /// naive choice, for benchmarks: detail::scoped_pool_stream_choices).
  explicit stream_ledger(stream_event_driver& driver = cuda_stream_events(), int device = -1,
                         bool remember_waits = true) noexcept
      : driver_(&driver), device_(device), remember_waits_(remember_waits) {}
  stream_ledger(const stream_ledger&) = delete;
  stream_ledger& operator=(const stream_ledger&) = delete;
  ~stream_ledger() {
    for (const auto& rec : streams_) {
      if (rec->event != nullptr) {
        driver_->destroy(rec->event);
      }
    }
  }

  /// The record of `handle` when it is the one looked up last and a free on it needs nothing
  /// more than a count (the inline fast path); nullptr otherwise.
  [[nodiscard]] stream_record* last_if(cudaStream_t handle) const noexcept {
    stream_record* rec = last_;
    return rec != nullptr && rec->handle == handle && !names_thread_stream(handle) &&
                   !rec->retired
               ? rec
               : nullptr;
  }

  /// Tags `tag` with a free on `s`. On any failure, waits for `s` instead (then nothing is
  /// pending).
  void note_free(pending_frees& tag, stream_view s) noexcept {
    stream_record* rec = nullptr;
    try {
      rec = &record_for(s);
      ++rec->frees;
      if (is_thread_tag(rec->handle)) {
        record_event(*rec);  // no other thread can name this stream later
      }
      tag.add(rec, rec->frees);
    } catch (...) {
      const cudaError_t waited = driver_->synchronize_stream(s.get());
      report_error(waited, "pool_resource: waiting for the stream after failing to track a free");
      if (rec != nullptr && waited == cudaSuccess) {
        rec->done = rec->frees;  // all complete: nothing on this stream is left to record
      }
    }
  }

  /// Whether a block tagged `tag` can go to a request on `stream` (null: the synchronous
  /// form) with no wait: every pending free is known done, on `stream` itself, or covered by
  /// a wait `stream` already made (remembered; make_ready checks the stream's id). No calls.
  [[nodiscard]] bool ready_for(const pending_frees& tag, const stream_view* stream) const noexcept {
    if (tag.overflow) {
      return false;
    }
    for (std::size_t i = 0; i < tag.count; ++i) {
      const stream_record& rec = *tag.entries[i].stream;
      const std::uint64_t n = tag.entries[i].free_count;
      if (n <= rec.done) {
        continue;
      }
      if (stream == nullptr) {
        return false;
      }
      if (rec.is(*stream) && !rec.retired) {
        continue;
      }
      const stream_waiter* w = rememberable(stream->get()) ? rec.waiter(stream->get()) : nullptr;
      if (w == nullptr || w->covers < n) {
        return false;
      }
    }
    return true;
  }

  /// Makes a block tagged `pending` (not empty) safe to hand out on `stream` (null: to
  /// everyone, waiting on the host), then clears the tag. Throws cuda_error; the tag is then
  /// unchanged but for what is known complete.
  ///
  /// A tag that overflowed (frees from more streams than it holds) is ordered after every
  /// stream with frees not known complete: all that the block can be made of, each as an entry
  /// of its own would be (recorded, queried, waited for on `stream` or on the host). It used
  /// to synchronise the device: a wait for unrelated work too, and a call CUDA refuses while
  /// any stream of the device is being captured into a graph.
  void make_ready(pending_frees& pending, const stream_view* stream) {
    bool crossed = false;
    std::uint64_t stream_id = 0;  // asked at most once per block
    if (pending.overflow) {
      ++counters_.wide_tags;
      for (auto& rec : streams_) {
        crossed = order_after(*rec, rec->frees, stream, stream_id) || crossed;
      }
    } else {
      for (std::size_t i = 0; i < pending.count; ++i) {
        crossed = order_after(*pending.entries[i].stream, pending.entries[i].free_count, stream,
                              stream_id) ||
                  crossed;
      }
    }
    if (crossed) {
      ++counters_.cross_stream_blocks;
    }
    pending.clear();
  }

  /// Learns which other streams' frees are complete by now: queries the event of every stream
  /// (but `requester`) with frees not known complete, recording it first where no record
  /// covers them yet. Returns whether it learnt anything. Unless `always`, at most once in a
  /// run of requests on one stream (the first request of a stream-step whose first pick would
  /// need a wait); `always` before the pool grows instead of waiting (growth costs far more).
  bool refresh(const stream_view* requester, bool always = false) {
    const cudaStream_t who = requester != nullptr ? stream_tag(requester->get()) : nullptr;
    if (!always && requester != nullptr && refreshed_for_ == who) {
      return false;
    }
    refreshed_for_ = who;
    bool learnt = false;
    for (auto& rec : streams_) {
      if (rec->frees <= rec->done || (requester != nullptr && rec->is(*requester))) {
        continue;
      }
      if (rec->event_covers < rec->frees) {
        if (driver_->capturing(cuda_stream(rec->handle))) {
          continue;  // nothing can be learnt of it until its capture ends
        }
        record_event(*rec);
      }
      ++counters_.event_queries;
      if (driver_->query(rec->event)) {
        learnt = learnt || rec->done < rec->event_covers;
        rec->done = std::max(rec->done, rec->event_covers);
      }
    }
    return learnt;
  }

  /// Records an event on every stream whose frees no event covers yet, but streams being
  /// captured into a graph now; returns how many it recorded. After it, a request can be
  /// ordered after those frees without recording on their streams: what a stream about to be
  /// captured needs (pool_resource's prepare_for_graph_capture). Throws cuda_error.
  std::size_t cover_frees() {
    std::size_t recorded = 0;
    for (auto& rec : streams_) {
      if (!rec->retired && rec->frees > rec->done && rec->event_covers < rec->frees &&
          !driver_->capturing(cuda_stream(rec->handle))) {
        record_event(*rec);
        ++recorded;
      }
    }
    return recorded;
  }

  /// `s` is about to be destroyed: records an event covering its frees (if any is not yet
  /// covered) and stops using its record for new frees; waits it made are forgotten. Throws
  /// cuda_error.
  void retire(stream_view s) {
    for (auto& rec : streams_) {
      if (!rec->retired && rec->is(s)) {
        if (rec->frees > rec->event_covers) {
          record_event(*rec);
        }
        rec->retired = true;
        last_ = nullptr;
      }
      if (stream_waiter* w = rec->waiter(s.get())) {
        *w = {};
      }
    }
  }

  /// Whether a free on any stream is not yet known complete.
  [[nodiscard]] bool owes_any() const noexcept {
    return std::any_of(streams_.begin(), streams_.end(),
                       [](const auto& rec) { return rec->frees > rec->done; });
  }

  [[nodiscard]] const stream_counters& counters() const noexcept { return counters_; }
  stream_counters& counters() noexcept { return counters_; }

 private:
  /// Whether a wait by `s` may be remembered: not a default stream (see the header comment).
  [[nodiscard]] bool rememberable(cudaStream_t s) const noexcept {
    return remember_waits_ && !is_default_stream(s);
  }

  /// Orders a request on `stream` (null: the synchronous form) after the frees on rec's
  /// stream up to its n-th. False when nothing was needed: they are known complete, or they
  /// were made on `stream` itself (stream order). Otherwise: a wait `stream` already made for
  /// them (remembered, its id checked), or the event found complete, or a new wait (on the
  /// device for a stream, on the host for the synchronous form). Throws cuda_error.
  bool order_after(stream_record& rec, std::uint64_t n, const stream_view* stream,
                   std::uint64_t& stream_id) {
    if (n <= rec.done || (stream != nullptr && rec.is(*stream) && !rec.retired)) {
      return false;
    }
    if (rec.event_covers < n && driver_->capturing(cuda_stream(rec.handle))) {
      throw cuda_error(cudaErrorStreamCaptureUnsupported,
                       "pool_resource: a block was last freed on a stream that is now being "
                       "captured into a CUDA graph, and no event marks that free; call "
                       "cudamem::prepare_for_graph_capture() before the capture begins");
    }
    if (stream == nullptr) {
      if (rec.event_covers < n) {
        record_event(rec);
      }
      ++counters_.host_waits;
      driver_->synchronize(rec.event);
      rec.done = std::max(rec.done, rec.event_covers);
      return true;
    }
    const cudaStream_t t = stream->get();
    const bool remember = rememberable(t);
    if (stream_waiter* w = remember ? rec.waiter(t) : nullptr; w != nullptr && w->covers >= n) {
      if (stream_id == 0) {
        stream_id = driver_->stream_id(t);
      }
      if (stream_id != 0 && stream_id == w->id) {
        ++counters_.waits_skipped;  // t already waits for these frees
        return true;
      }
      *w = {};  // another stream with the same handle: it waited for nothing
    }
    if (rec.event_covers < n) {
      record_event(rec);
    }
    ++counters_.event_queries;
    if (driver_->query(rec.event)) {
      rec.done = std::max(rec.done, rec.event_covers);
      return true;
    }
    ++counters_.stream_waits;
    driver_->wait(t, rec.event);
    if (remember) {
      if (stream_id == 0) {
        stream_id = driver_->stream_id(t);
      }
      if (stream_id != 0) {
        rec.remember_waiter(t, stream_id, rec.event_covers);
      }
    }
    return true;
  }

  /// Records rec's event on its stream now, covering every free made on it so far.
  void record_event(stream_record& rec) {
    // A thread's tag is recorded at each free, on its own thread (note_free), never here later.
    driver_->record(rec.event, cuda_stream(rec.handle), rec.device);
    ++counters_.event_records;
    rec.event_covers = rec.frees;
  }

  stream_record& record_for(stream_view s) {
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
    auto fresh = detail::make_unique_owner<stream_record>();
    fresh->handle = stream_tag(s.get());
    fresh->device = device_;
    streams_.push_back(std::move(fresh));
    last_ = streams_.back().get();
    return *last_;
  }

  stream_event_driver* driver_;
  int device_;
  bool remember_waits_;
  std::vector<detail::unique_owner<stream_record>> streams_;
  stream_record* last_ = nullptr;
  cudaStream_t refreshed_for_ = nullptr;  ///< the stream refresh() last ran for
  stream_counters counters_;
};

}  // namespace cudamem::detail
