// cudamem/tracking_adaptor.hpp — remembers every live allocation and where it was made, so
// leaks name the user's line, and bad frees are caught before they corrupt anything.
//
//   cudamem::tracking_adaptor tracked{pool};
//   {
//     cudamem::device_buffer<float> a(1 << 20, tracked);   // allocated at main.cpp:12
//     void* raw = tracked.allocate(4096);                   // main.cpp:13, never freed
//   }
//   std::puts(tracked.leaks().to_text().c_str());
//   //   tracking_adaptor: 1 live allocation (4.00 KiB):
//   //     4.00 KiB at 0x7f3a00000000 (alignment 256) allocated at main.cpp:13 in `int main()`,
//   //       synchronous, thread 0x7f3b..., 0.012 ms after the adaptor was made
//   // and when `tracked` is destroyed, each leak goes to the error handler, with the leak's
//   // allocation site as the report's location.
//
// Contract
// - Records, for every allocation that succeeded: pointer, bytes, alignment, stream (or
//   "synchronous"), the call site (`current_allocation_site()`: the line that called
//   `allocate`, or the user's line an owner such as device_buffer passed through), the
//   thread, and the time since the adaptor was made.
// - `leaks()` lists the live allocations, oldest first, with their total; its `to_text()` is
//   the readable form. At destruction each live allocation is reported through the error
//   handler (`report_problem`, location = the allocation's call site); nothing is thrown and
//   the leaked memory is left alone (it may still be in use: freeing it could corrupt).
// - Bad frees are reported through the error handler and NOT forwarded to the upstream, so the
//   upstream never sees them and nothing is corrupted:
//     a pointer this adaptor never gave out  ("never allocated here");
//     a pointer already freed                 ("double free", naming where it was allocated;
//                                              recognised among the last
//                                              `remembered_frees` frees);
//     the wrong bytes or alignment            ("size mismatch": the allocation stays live and
//                                              tracked, so a correct free later still works,
//                                              and it is reported as a leak if none comes).
//   `bad_frees()` counts them.
// - Thread-safe: one mutex guards the record; the upstream is called outside it.
// - Cost: one hash-map insert and erase per allocation, under the mutex, with the map's nodes
//   recycled so that no host memory is allocated per request once warm.
#pragma once

#include <cudamem/detail/adaptor_base.hpp>
#include <cudamem/error.hpp>
#include <cudamem/memory_report.hpp>
#include <cudamem/memory_resource.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <mutex>
#include <optional>
#include <source_location>
#include <sstream>
#include <string>
#include <string_view>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

namespace cudamem {

/// One allocation, as the tracking adaptor saw it made.
struct allocation_record {
  void* pointer = nullptr;
  std::size_t bytes = 0;
  std::size_t alignment = 0;
  std::optional<cudaStream_t> stream;  ///< empty: the synchronous form
  std::source_location site;           ///< where the user asked for it
  std::thread::id thread;
  std::chrono::nanoseconds time{0};  ///< since the tracking adaptor was made
  std::uint64_t sequence = 0;        ///< 0, 1, 2... in the order the allocations were made

  /// "1.00 MiB at 0x... (alignment 256) allocated at file:line in `function`, stream 0x...,
  /// thread ..., 1.234 ms after the adaptor was made".
  [[nodiscard]] std::string to_text() const {
    std::ostringstream text;
    text << format_bytes(bytes) << " at " << pointer << " (alignment " << alignment
         << ") allocated at " << describe_site(site) << ", ";
    if (stream) {
      text << "stream " << static_cast<const void*>(*stream);
    } else {
      text << "synchronous";
    }
    char ms[32];
    std::snprintf(ms, sizeof ms, "%.3f", std::chrono::duration<double, std::milli>(time).count());
    text << ", thread " << thread << ", " << ms << " ms after the adaptor was made";
    return text.str();
  }

  /// "file:line in `function`", or "an unknown place" for an empty location.
  [[nodiscard]] static std::string describe_site(const std::source_location& where) {
    if (where.file_name() == nullptr || where.file_name()[0] == '\0') {
      return "an unknown place";
    }
    std::string text = std::string(where.file_name()) + ":" + std::to_string(where.line());
    if (where.function_name() != nullptr && where.function_name()[0] != '\0') {
      text.append(" in `").append(where.function_name()).append("`");
    }
    return text;
  }
};

/// The live allocations of a tracking adaptor at one moment.
struct leak_report {
  std::string resource;                     ///< the adaptor's name
  std::vector<allocation_record> leaks;     ///< oldest first
  std::size_t total_bytes = 0;

  [[nodiscard]] bool empty() const noexcept { return leaks.empty(); }

  /// A header line, then one line per live allocation.
  [[nodiscard]] std::string to_text() const {
    std::string text = resource + ": " + std::to_string(leaks.size()) + " live allocation" +
                       (leaks.size() == 1 ? "" : "s") + " (" + format_bytes(total_bytes) + ")" +
                       (leaks.empty() ? "." : ":");
    for (const allocation_record& r : leaks) {
      text += "\n  " + r.to_text();
    }
    return text;
  }
};

class tracking_adaptor final : public detail::adaptor_base<tracking_adaptor> {
 public:
  /// How many recent frees are remembered to tell a double free from a stray pointer.
  static constexpr std::size_t remembered_frees = 1024;

  explicit tracking_adaptor(memory_resource& upstream)
      : adaptor_base(upstream), start_(std::chrono::steady_clock::now()) {}

  /// Reports every allocation still live through the error handler (see the contract).
  ~tracking_adaptor() override { report_leaks(); }

  tracking_adaptor(const tracking_adaptor&) = delete;
  tracking_adaptor& operator=(const tracking_adaptor&) = delete;

  /// The allocations live now, oldest first.
  [[nodiscard]] leak_report leaks() const {
    leak_report report;
    report.resource = "tracking_adaptor";
    {
      const std::lock_guard lock(mutex_);
      report.leaks.reserve(live_.size());
      for (const auto& entry : live_) {
        report.leaks.push_back(entry.second);
      }
    }
    std::sort(report.leaks.begin(), report.leaks.end(),
              [](const allocation_record& a, const allocation_record& b) {
                return a.sequence < b.sequence;
              });
    for (const allocation_record& r : report.leaks) {
      report.total_bytes += r.bytes;
    }
    return report;
  }

  /// The record of one live allocation, if `p` is one.
  [[nodiscard]] std::optional<allocation_record> find(const void* p) const {
    const std::lock_guard lock(mutex_);
    const auto it = live_.find(const_cast<void*>(p));
    return it == live_.end() ? std::nullopt : std::optional<allocation_record>{it->second};
  }

  /// How many allocations are live.
  [[nodiscard]] std::size_t live_count() const {
    const std::lock_guard lock(mutex_);
    return live_.size();
  }

  /// How many bad frees (stray pointer, double free, size mismatch) have been reported.
  [[nodiscard]] std::size_t bad_frees() const noexcept {
    return bad_frees_.load(std::memory_order_relaxed);
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
    allocation_record record;
    record.site = current_allocation_site();
    void* p = forward_allocate(bytes, alignment, stream);
    record.pointer = p;
    record.bytes = bytes;
    record.alignment = alignment;
    if (stream) {
      record.stream = stream->get();
    }
    record.thread = std::this_thread::get_id();
    record.time = std::chrono::steady_clock::now() - start_;
    std::optional<allocation_record> displaced;  // an upstream bug, reported after the lock
    try {
      const std::lock_guard lock(mutex_);
      record.sequence = next_sequence_++;
      const auto [it, inserted] = insert_live(record);
      if (!inserted) {  // the upstream handed out a live pointer twice: its bug, not the user's
        displaced = it->second;
        used_bytes_ -= it->second.bytes;
        it->second = record;
      }
      used_bytes_ += bytes;
      peak_used_bytes_ = std::max(peak_used_bytes_, used_bytes_);
    } catch (...) {  // no host memory for the record: give the memory back rather than lose it
      forward_deallocate(p, bytes, alignment, stream);
      throw;
    }
    if (displaced) {
      try {
        report_problem("tracking_adaptor: the upstream " +
                       std::string(upstream_resource().name()) + " returned " + describe(p) +
                       ", which was still live (" + displaced->to_text() + ")");
      } catch (...) {  // p is the caller's now: never lose it over a message
      }
    }
    return p;
  }

  void adapt_deallocate(void* p, std::size_t bytes, std::size_t alignment,
                        detail::request_stream stream) noexcept {
    enum class verdict { good, mismatch, double_free, stray };
    verdict found = verdict::stray;
    allocation_record record;  // plain data: copying it under the lock allocates nothing
    {
      const std::lock_guard lock(mutex_);
      if (const auto it = live_.find(p); it != live_.end()) {
        record = it->second;
        if (record.bytes == bytes && record.alignment == alignment) {
          found = verdict::good;
          used_bytes_ -= bytes;
          remember_free(record);
          recycle(live_.extract(it));
        } else {
          found = verdict::mismatch;
        }
      } else if (const allocation_record* freed = find_recent_free(p)) {
        record = *freed;
        found = verdict::double_free;
      }
    }
    if (found == verdict::good) {
      forward_deallocate(p, bytes, alignment, stream);
      return;
    }
    bad_frees_.fetch_add(1, std::memory_order_relaxed);
    try {
      std::string problem;
      switch (found) {
        case verdict::mismatch:
          problem = "size mismatch freeing " + describe(p) + ": deallocate(" +
                    std::to_string(bytes) + " bytes, alignment " + std::to_string(alignment) +
                    ") but it was allocated as " + std::to_string(record.bytes) +
                    " bytes, alignment " + std::to_string(record.alignment) + " at " +
                    allocation_record::describe_site(record.site) +
                    ". Not forwarded to the upstream; the allocation stays live.";
          break;
        case verdict::double_free:
          problem = "double free of " + describe(p) + " (" + std::to_string(bytes) +
                    " bytes), already freed; it was allocated as " + record.to_text() +
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

  // Speed: the record is a hash map from pointer to allocation_record. Its nodes are recycled
  // (extracted on free, reused on the next allocation), so the steady state allocates no host
  // memory per request; recent frees live in a fixed ring, searched only when a free is bad.

  using live_map = std::unordered_map<void*, allocation_record>;

  /// Inserts `record` into the live map, reusing a spare node when there is one (mutex held).
  std::pair<live_map::iterator, bool> insert_live(const allocation_record& record) {
    if (spare_nodes_.empty()) {
      return live_.try_emplace(record.pointer, record);
    }
    live_map::node_type node = std::move(spare_nodes_.back());
    spare_nodes_.pop_back();
    node.key() = record.pointer;
    node.mapped() = record;
    auto result = live_.insert(std::move(node));
    if (!result.inserted) {
      recycle(std::move(result.node));
    }
    return {result.position, result.inserted};
  }

  /// Keeps a freed node for the next allocation (mutex held); a bounded number of them.
  void recycle(live_map::node_type node) noexcept {
    if (spare_nodes_.size() < max_spare_nodes) {
      try {
        spare_nodes_.push_back(std::move(node));
      } catch (...) {  // no room to keep it: the node is simply freed
      }
    }
  }

  /// Keeps `record` among the recent frees (mutex held). If the ring cannot grow, the free
  /// still happens; only the double-free diagnosis for this pointer is lost.
  void remember_free(const allocation_record& record) noexcept {
    if (recent_frees_.size() < remembered_frees) {
      try {
        recent_frees_.push_back(record);
      } catch (...) {
      }
      return;
    }
    recent_frees_[next_recent_free_] = record;
    next_recent_free_ = (next_recent_free_ + 1) % remembered_frees;
  }

  /// The most recent remembered free of `p`, or null (mutex held). Linear, but only bad frees
  /// get here.
  const allocation_record* find_recent_free(const void* p) const noexcept {
    const allocation_record* latest = nullptr;
    for (const allocation_record& r : recent_frees_) {
      if (r.pointer == p && (latest == nullptr || r.sequence > latest->sequence)) {
        latest = &r;
      }
    }
    return latest;
  }

  static std::string describe(const void* p) {
    char text[32];
    std::snprintf(text, sizeof text, "%p", p);
    return text;
  }

  std::string_view do_name() const noexcept override { return "tracking_adaptor"; }
  resource_stats do_stats() const override {
    resource_stats s;
    const std::lock_guard lock(mutex_);
    s.reserved_bytes = s.used_bytes = used_bytes_;
    s.peak_used_bytes = peak_used_bytes_;
    return s;
  }

  const std::chrono::steady_clock::time_point start_;
  mutable std::mutex mutex_;
  static constexpr std::size_t max_spare_nodes = 4096;
  live_map live_;                                  // guarded by mutex_
  std::vector<live_map::node_type> spare_nodes_;  // guarded by mutex_
  std::vector<allocation_record> recent_frees_;    // a ring once full, guarded by mutex_
  std::size_t next_recent_free_ = 0;               // the ring's oldest entry, guarded by mutex_
  std::uint64_t next_sequence_ = 0;                     // guarded by mutex_
  std::size_t used_bytes_ = 0;                          // guarded by mutex_
  std::size_t peak_used_bytes_ = 0;                     // guarded by mutex_
  std::atomic<std::size_t> bad_frees_{0};
};

}  // namespace cudamem
