// cudamem/tracking_adaptor.hpp — remembers every live allocation and where it was made, so
// leaks name the user's line, and bad frees are caught before they corrupt anything.
//
//   cudamem::tracking_adaptor tracked{pool};
//   {
//     cudamem::device_buffer<float> a(1 << 20, tracked);   // allocated at main.cpp:12
//     void* raw = tracked.allocate(4096);                   // main.cpp:13, never freed
//   }
//   std::puts(tracked.leaks().to_text().c_str());
//   cudamem::tracking_adaptor timed{pool, {.timestamps = true}};  // "..., 0.012 ms after the
//                                                                  // adaptor was made" too
//   std::size_t in_use = tracked.stats().used_bytes;               // exact, from any thread
//   //   tracking_adaptor: 1 live allocation (4.00 KiB):
//   //     4.00 KiB at 0x7f3a00000000 (alignment 256) allocated at main.cpp:13 in `int main()`,
//   //       synchronous, thread 0x7f3b...
//   // and when `tracked` is destroyed, each leak goes to the error handler, with the leak's
//   // allocation site as the report's location.
//
// Contract
// - Records, for every allocation that succeeded: pointer, bytes, alignment, stream (or
//   "synchronous"), the call site (`current_allocation_site()`: the line that called
//   `allocate`, or the user's line an owner such as device_buffer passed through), the
//   thread, and, with `tracking_options::timestamps`, the time since the adaptor was made.
//   Time is opt-in because it is the one item that costs: reading even the CPU's tick counter
//   takes 5-15 ns, as much as the rest of the record together.
// - `leaks()` lists the live allocations, oldest first within each thread (sequence numbers
//   count per thread, so two threads' allocations are ordered by their own counts), with
//   their total; its `to_text()` is
//   the readable form. At destruction each live allocation is reported through the error
//   handler (`report_problem`, location = the allocation's call site); nothing is thrown and
//   the leaked memory is left alone (it may still be in use: freeing it could corrupt).
// - Bad frees are reported through the error handler and NOT forwarded to the upstream, so the
//   upstream never sees them and nothing is corrupted:
//     a pointer this adaptor never gave out  ("never allocated here");
//     a pointer already freed                 ("double free", naming where it was allocated;
//                                              recognised among the last 64 frees of its
//                                              shard: `remembered_frees` in all);
//     the wrong bytes or alignment            ("size mismatch": the allocation stays live and
//                                              tracked, so a correct free later still works,
//                                              and it is reported as a leak if none comes).
//   `bad_frees()` counts them.
// - When this chain holds the memory a request failed for (verdict `exhausted`), its
//   out-of-memory advice counts the live allocations and points at leaks().
// - Thread-safe: the record is split into 16 shards, one per thread (threads are numbered as
//   they first come; the 17th shares the first's), each with its own lock. A thread records
//   what it allocates in its own shard and looks there first when it frees, so threads that
//   free their own memory never touch each other's cache lines. A free from another thread
//   finds the record in the shard it was made in (the shard where a free nearby last found
//   one first, then every shard). The upstream is called outside every lock. Sequence numbers
//   follow the order of allocation within a thread.
// - One thread skips the locks: the first thread that uses the adaptor owns it, and takes no
//   shard lock until another thread touches the record (a request, or leaks(), find(),
//   live_count() from another thread). That thread waits, once, for the owner to finish the
//   request it is in, and from then on every thread locks (detail/adaptors/owner_bias.hpp: a
//   Linux membarrier call, microseconds, once per adaptor; elsewhere every thread always
//   locks). `owned_by_one_thread()` says which it is. stats() and bad_frees() never take a
//   lock.
// - stats(): `used_bytes` is exact however threads race (each shard counts its part under its
//   lock; stats() sums them). `peak_used_bytes` is exact while one thread allocates (one
//   shard), and with `tracking_options::peak_slack = 0`; otherwise a bound: never below the
//   most bytes that were live at once, never above it by more than `peak_error_bound()` =
//   (2n - 1) x peak_slack, n being the shards that have held allocations (at most 16: 124 MiB
//   with the default 4 MiB), and never above the sum of each shard's own most
//   (detail/adaptors/bytes_in_use.hpp).
// - An upstream that returns a pointer still live is reported when the same thread gets it
//   (the record is in its shard); across threads the second record is kept beside the first.
// - Cost (per request, on top of the upstream): for the owning thread no atomic instruction at
//   all; once threads share the adaptor, the lock of the thread's own shard (one exchange on
//   a line no other thread uses), and a free from another thread one more shard or, rarely,
//   all of them. One cache line of keys (16 bytes each: a thousand live allocations fit in
//   L1) and one of records; the CPU's tick counter if timestamps are on (turned into time
//   only for a report). Sequence numbers are counted per thread. Bytes in use are published
//   to the shared peak once a shard's have moved by peak_slack (one atomic add). No host
//   memory is allocated per request: a shard's table grows by doubling, and that is all.
//
// Parts (detail/adaptors/; each opens with what it owns)
//   leak_report.hpp       what it reports and how it is told to record: allocation_record,
//                         leak_report, tracking_options
//   allocation_table.hpp  the record: per-thread shards of 64-byte entries, recent frees
//   owner_bias.hpp        the lock the one thread using an adaptor need not take
//   bytes_in_use.hpp      bytes in use per shard, and the shared peak
// Here: the adaptor, its hot paths (allocate, and the free a thread makes of its own memory)
// and its cold ones (frees from other threads, bad frees, reports).
#pragma once

#include <cudamem/detail/adaptors/adaptor_base.hpp>
#include <cudamem/detail/adaptors/allocation_table.hpp>
#include <cudamem/detail/adaptors/bytes_in_use.hpp>
#include <cudamem/detail/adaptors/leak_report.hpp>
#include <cudamem/detail/adaptors/owner_bias.hpp>
#include <cudamem/detail/sync/atomic.hpp>
#include <cudamem/error.hpp>
#include <cudamem/out_of_memory.hpp>
#include <cudamem/memory_resource.hpp>

#include <algorithm>
#include <bit>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <optional>
#include <source_location>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

namespace cudamem {

/// Forwards to its upstream and remembers every live allocation and where it was made.
class tracking_adaptor final : public detail::adaptor_base<tracking_adaptor> {
 public:
  /// How many recent frees are remembered, in all, to tell a double free from a stray
  /// pointer: the last 64 frees of each of the record's 16 shards (see the contract).
  static constexpr std::size_t remembered_frees =
      detail::allocation_shard::remembered_frees * detail::allocation_table::shard_count;

  /// Tracks what passes to `upstream` (referred to, not owned).
  explicit tracking_adaptor(memory_resource& upstream, tracking_options options = {})
      : adaptor_base(upstream), timestamps_(options.timestamps), usage_(options.peak_slack) {}

  /// Reports every allocation still live through the error handler (see the contract).
  ~tracking_adaptor() override { report_leaks(); }

  tracking_adaptor(const tracking_adaptor&) = delete;
  tracking_adaptor& operator=(const tracking_adaptor&) = delete;

  /// The allocations live now, oldest first (within a thread; see the contract).
  [[nodiscard]] leak_report leaks() const {
    leak_report report;
    report.resource = "tracking_adaptor";
    const double ns_per_tick = clock_.nanoseconds_per_tick();
    for (std::size_t i = 0; i < detail::allocation_table::shard_count; ++i) {
      detail::allocation_shard& shard = table_.shard(i);
      const detail::biased_lock_guard guard(bias_, shard.mutex());
      report.leaks.reserve(report.leaks.size() + shard.size());
      shard.for_each([&](const detail::tracked_allocation& entry) {
        report.leaks.push_back(to_record(entry, ns_per_tick));
      });
    }
    std::sort(report.leaks.begin(), report.leaks.end(),
              [](const allocation_record& a, const allocation_record& b) {
                return a.sequence != b.sequence ? a.sequence < b.sequence
                                                : a.pointer < b.pointer;  // a stable order
              });
    for (const allocation_record& r : report.leaks) {
      report.total_bytes += r.bytes;
    }
    return report;
  }

  /// The record of one live allocation, if `p` is one.
  [[nodiscard]] std::optional<allocation_record> find(const void* p) const {
    std::optional<detail::tracked_allocation> entry;
    visit_shards_for(p, [&](detail::allocation_shard& shard) {
      const detail::biased_lock_guard guard(bias_, shard.mutex());
      if (const detail::tracked_allocation* found = shard.find(p)) {
        entry = *found;
        return true;
      }
      return false;
    });
    if (!entry) {
      return std::nullopt;
    }
    return to_record(*entry, clock_.nanoseconds_per_tick());
  }

  /// How many allocations are live.
  [[nodiscard]] std::size_t live_count() const {
    std::size_t count = 0;
    for (std::size_t i = 0; i < detail::allocation_table::shard_count; ++i) {
      detail::allocation_shard& shard = table_.shard(i);
      const detail::biased_lock_guard guard(bias_, shard.mutex());
      count += shard.size();
    }
    return count;
  }

  /// True while one thread has used this adaptor's record and skips its locks (see the
  /// contract); false once a second thread has, or where the system cannot support it.
  [[nodiscard]] bool owned_by_one_thread() const noexcept { return bias_.owned(); }

  /// The most stats().peak_used_bytes may be above the true peak now (see the contract): 0
  /// while one shard has held allocations, or with peak_slack 0.
  [[nodiscard]] std::size_t peak_error_bound() const noexcept {
    return usage_.peak_error_bound();
  }

  /// How many bad frees (stray pointer, double free, size mismatch) have been reported.
  [[nodiscard]] std::size_t bad_frees() const noexcept {
    return bad_frees_.load(detail::memory_order_relaxed);
  }

  /// Reports each live allocation through the error handler, its call site as the location.
  /// Returns how many there were. Never throws.
  std::size_t report_leaks() const noexcept {
    try {
      const leak_report report = leaks();
      for (const allocation_record& r : report.leaks) {
        report_problem("leak: " + r.to_text() + ", never freed", r.site);
      }
      return report.leaks.size();
    } catch (...) {  // out of host memory while describing leaks: say so, briefly
      report_problem("tracking_adaptor: could not describe the live allocations (out of host "
                     "memory)");
      return 0;
    }
  }

 private:
  friend class detail::adaptor_base<tracking_adaptor>;

  void* adapt_allocate(std::size_t bytes, std::size_t alignment, detail::request_stream stream) {
    const std::source_location site = current_allocation_site();
    void* p = forward_allocate(bytes, alignment, stream);
    if (p == nullptr) {  // nothing to track (and nothing will be freed)
      return p;
    }
    const std::thread::id thread = std::this_thread::get_id();
    const std::uint64_t ticks = timestamps_ ? detail::read_ticks() : 0;
    const std::uint64_t sequence = detail::next_allocation_sequence();
    const std::uint8_t alignment_log2 = detail::log2_of_power_of_two(alignment);

    std::unique_ptr<detail::tracked_allocation> displaced;  // an upstream bug's evidence
    bool was_live = false;
    detail::allocation_shard& shard = table_.home_shard();
    try {
      const detail::biased_lock_guard guard(bias_, shard.mutex());
      detail::tracked_allocation& entry = shard.add(p, bytes, alignment_log2, was_live);
      std::size_t added = bytes;
      if (was_live) [[unlikely]] {
        displaced = copy_of(entry);
        added -= entry.bytes;  // wraps if the old was larger: an add of the difference
        entry.bytes = bytes;
        entry.alignment_log2 = alignment_log2;
      }
      entry.stream = stream ? stream->get() : nullptr;
      entry.site = site;
      entry.thread = thread;
      entry.ticks = ticks;
      entry.sequence = sequence;
      entry.synchronous = !stream;
      // Bytes in use: this shard's part, written under its lock (or by the owning thread).
      if (!shard.usage.active()) [[unlikely]] {
        usage_.activate(shard.usage);
      }
      usage_.add(shard.usage, added);
    } catch (...) {  // no host memory to grow the record: give the memory back, not lose it
      forward_deallocate(p, bytes, alignment, stream);
      throw;
    }
    if (was_live) [[unlikely]] {  // the upstream handed out a live pointer twice: its bug
      report_displaced(p, displaced.get());
    }
    return p;
  }

  // The cold paths live in functions of their own (never inlined), so that the hot paths
  // stay small: no message building, no 64-byte record on their stack frames.

  /// A heap copy of `entry`, or nullptr if there is no memory for one.
  [[gnu::noinline]] static std::unique_ptr<detail::tracked_allocation> copy_of(
      const detail::tracked_allocation& entry) noexcept {
    try {
      return std::make_unique<detail::tracked_allocation>(entry);
    } catch (...) {
      return nullptr;
    }
  }

  [[gnu::noinline]] void report_displaced(const void* p,
                                          const detail::tracked_allocation* old) const noexcept {
    try {
      report_problem("tracking_adaptor: the upstream " + std::string(upstream_resource().name()) +
                     " returned " + describe(p) + ", which was still live" +
                     (old != nullptr
                          ? " (" + to_record(*old, clock_.nanoseconds_per_tick()).to_text() + ")"
                          : std::string{}));
    } catch (...) {  // p is the caller's now: never lose it over a message
      report_problem("tracking_adaptor: the upstream returned a pointer that was still live");
    }
  }

  // Inlined into both forms of deallocate: the common case is a few dozen instructions.
  [[gnu::always_inline]] void adapt_deallocate(void* p, std::size_t bytes, std::size_t alignment,
                                               detail::request_stream stream) noexcept {
    using detail::release_result;
    // The common case: this thread frees what it allocated, recorded in its own shard.
    detail::allocation_shard& home = table_.home_shard();
    release_result found;
    {
      const detail::biased_lock_guard guard(bias_, home.mutex());
      found = home.release(p, bytes, alignment);
      if (found == release_result::freed) [[likely]] {
        usage_.add(home.usage, std::size_t{0} - bytes);  // two's complement: subtracts
      }
    }
    if (found == release_result::freed) [[likely]] {
      forward_deallocate(p, bytes, alignment, stream);
      return;
    }
    if (found == release_result::size_mismatch) {
      report_bad_free(home, p, bytes, alignment, found);
      return;
    }
    free_elsewhere(home, p, bytes, alignment, stream);
  }

  /// A free whose record is not in the calling thread's shard: another thread allocated it,
  /// or it is a bad free. Looks in the other shards (the hinted one first), then in every
  /// shard's recent frees.
  [[gnu::noinline]] void free_elsewhere(detail::allocation_shard& home, void* p,
                                        std::size_t bytes, std::size_t alignment,
                                        detail::request_stream stream) noexcept {
    using detail::release_result;
    release_result found = release_result::unknown;
    detail::allocation_shard* where = nullptr;
    visit_shards_for(p, [&](detail::allocation_shard& shard) {
      if (&shard == &home) {
        return false;  // looked there already
      }
      const detail::biased_lock_guard guard(bias_, shard.mutex());
      found = shard.release(p, bytes, alignment);
      if (found == release_result::freed) {
        usage_.add(shard.usage, std::size_t{0} - bytes);
      }
      where = &shard;
      return found != release_result::unknown;
    });
    if (found == release_result::freed) {
      table_.set_hint(p, table_.index_of(*where));
      forward_deallocate(p, bytes, alignment, stream);
      return;
    }
    if (found == release_result::unknown) {  // live nowhere: freed twice, or never ours
      where = &home;
      for (std::size_t i = 0; i < detail::allocation_table::shard_count; ++i) {
        detail::allocation_shard& shard = table_.shard(i);
        const detail::biased_lock_guard guard(bias_, shard.mutex());
        if (shard.find_recent_free(p) != nullptr) {
          found = release_result::double_free;
          where = &shard;
          break;
        }
      }
    }
    report_bad_free(*where, p, bytes, alignment, found);
  }

  /// Calls `look(shard)` for the shard hinted for `p`, the calling thread's own, then every
  /// other shard, until it returns true.
  template <class Look>
  void visit_shards_for(const void* p, Look&& look) const {
    const std::size_t home = table_.index_of(table_.home_shard());
    const std::size_t hinted = table_.hinted_shard(p);
    if (hinted < detail::allocation_table::shard_count && hinted != home &&
        look(table_.shard(hinted))) {
      return;
    }
    if (look(table_.shard(home))) {
      return;
    }
    for (std::size_t i = 0; i < detail::allocation_table::shard_count; ++i) {
      if (i != home && i != hinted && look(table_.shard(i))) {
        return;
      }
    }
  }

  /// Reports a free that was not forwarded, with the record it concerns. The record is looked
  /// up again (the lock was dropped in between): only a program already racing a free against
  /// another use of the same pointer could see it changed, and then the message says less.
  [[gnu::noinline]] void report_bad_free(detail::allocation_shard& shard, const void* p,
                                         std::size_t bytes, std::size_t alignment,
                                         detail::release_result found) const noexcept {
    using detail::release_result;
    bad_frees_.fetch_add(1, detail::memory_order_relaxed);
    std::optional<detail::tracked_allocation> entry;
    {
      const detail::biased_lock_guard guard(bias_, shard.mutex());
      const detail::tracked_allocation* record = found == release_result::size_mismatch
                                                     ? shard.find(p)
                                                     : shard.find_recent_free(p);
      if (record != nullptr) {
        entry.emplace(*record);
      }
    }
    if (!entry) {  // changed under us: describe it as one never given out
      found = release_result::unknown;
    }
    try {
      std::string problem;
      switch (found) {
        case release_result::size_mismatch:
          problem = "size mismatch freeing " + describe(p) + ": deallocate(" +
                    std::to_string(bytes) + " bytes, alignment " + std::to_string(alignment) +
                    ") but it was allocated as " + std::to_string(entry->bytes) +
                    " bytes, alignment " + std::to_string(entry->alignment()) + " at " +
                    allocation_record::describe_site(entry->site) +
                    ". Not forwarded to the upstream; the allocation stays live.";
          break;
        case release_result::double_free:
          problem = "double free of " + describe(p) + " (" + std::to_string(bytes) +
                    " bytes), already freed; it was allocated as " +
                    to_record(*entry, clock_.nanoseconds_per_tick()).to_text() +
                    ". Not forwarded to the upstream.";
          break;
        default:
          problem = "deallocate of " + describe(p) + " (" + std::to_string(bytes) +
                    " bytes), which this tracking_adaptor never gave out (or freed long ago). "
                    "Not forwarded to the upstream.";
          break;
      }
      report_problem("tracking_adaptor: " + problem);
    } catch (...) {  // no host memory to describe it: still say that it happened
      report_problem("tracking_adaptor: bad free (not forwarded to the upstream)");
    }
  }

  /// The public form of a stored entry, its ticks turned into time since construction.
  allocation_record to_record(const detail::tracked_allocation& entry,
                              double ns_per_tick) const noexcept {
    allocation_record r;
    r.pointer = entry.pointer;
    r.bytes = entry.bytes;
    r.alignment = entry.alignment();
    if (!entry.synchronous) {
      r.stream = entry.stream;
    }
    r.site = entry.site;
    r.thread = entry.thread;
    if (timestamps_) {
      r.time = clock_.since_start(entry.ticks, ns_per_tick);
    }
    r.sequence = entry.sequence;
    return r;
  }

  static std::string describe(const void* p) {
    char text[32];
    std::snprintf(text, sizeof text, "%p", p);
    return text;
  }

  std::string_view do_name() const noexcept override { return "tracking_adaptor"; }
  std::string do_oom_hint(const memory_report& report, std::size_t position) const override {
    if (report.verdict != oom_verdict::exhausted) {
      return {};
    }
    const std::size_t live = live_count();
    if (live == 0) {
      return {};
    }
    return "This process holds the memory through this chain: the tracking_adaptor has " +
           std::to_string(live) + " live allocation" + (live == 1 ? "" : "s") + " (" +
           format_bytes(report.chain[position].stats.used_bytes) +
           "); leaks() lists them, oldest first, each with the line that made it: free those "
           "no longer needed, or lower the working set.";
  }
  resource_stats do_stats() const override {
    std::size_t used = 0;
    std::size_t sum_of_most = 0;
    for (std::size_t i = 0; i < detail::allocation_table::shard_count; ++i) {
      const detail::usage_part& part = table_.shard(i).usage;
      used += part.balance();  // two's complement: a shard that freed others' subtracts
      sum_of_most += part.most();
    }
    resource_stats s;
    s.reserved_bytes = s.used_bytes = used;
    // (Read while requests are in flight, the sum may have moved past the peak's last update.)
    s.peak_used_bytes = std::max(usage_.peak(sum_of_most), used);
    return s;
  }

  // Speed: the record is sharded by thread (detail::allocation_table), so an allocate or a
  // free takes the lock of the thread's own shard (unless its thread owns the adaptor:
  // owner_bias) and touches one line of keys, one of records and the shard's part of the
  // bytes in use; no host memory is allocated per request (a shard's table only grows, by
  // doubling). The timestamp is the CPU's tick counter, not a clock call.
  bool timestamps_;
  mutable detail::owner_bias bias_;  // the thread that uses this adaptor alone skips the locks
  detail::tick_calibration clock_;  // construction time, in both clocks
  detail::allocation_table table_;   // the live allocations and the recent frees
  detail::bytes_in_use usage_;       // the peak's shared side (the parts are in the shards)
  mutable detail::atomic<std::size_t> bad_frees_{0};  // rare: a bad free
};

}  // namespace cudamem
