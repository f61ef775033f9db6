// cudamem/logging_adaptor.hpp — writes every allocation, free and failed allocation that
// passes through it as one line of an event log (format: log_format.hpp), to a std::ostream
// or a file. `bench_replay` replays such a log through another resource stack ("would an
// arena have avoided this OOM?"), and trace_export.hpp draws it as memory over time.
//
//   cudamem::logging_adaptor logged{pool, "run.log"};            // or: {pool, std::cerr}
//   cudamem::logging_adaptor sampled{pool, "run.log",
//                                    cudamem::logging_options{.sample_reserved = true}};
//   train(logged);                                              // every request goes in the log
//
//   $ bench_replay run.log --resource arena --capacity 80GiB
//
// Contract
// - Writes the header (`log_header`) when made, then one line per event: `A` after the
//   upstream returned memory, `F` before the free is forwarded (so a reused address reads F
//   then A), `O` when the upstream threw out_of_memory (which is then rethrown unchanged but
//   for a report that starts here). Times are nanoseconds since the adaptor was made.
// - Thread-safe: one mutex orders the lines, so times never go backwards down the file.
//   Lines are buffered by the stream; `flush()` pushes them out, the destructor does too.
// - `sample_reserved` adds the bytes the chain's leaf (e.g. the device upstream under a pool)
//   holds at each event (read just before the line is written): what a pool reserves over
//   time. It costs a `stats()` call per event.
// - A stream that fails (disk full, exceptions enabled on it) never breaks an allocation or
//   a free: the first failure goes to the error handler, later lines are dropped.
// - The ostream must outlive the adaptor; with a path, the adaptor owns the file and throws
//   `std::runtime_error` from the constructor if it cannot be opened.
#pragma once

#include <cudamem/detail/adaptors/adaptor_base.hpp>
#include <cudamem/detail/sync/mutex.hpp>
#include <cudamem/error.hpp>
#include <cudamem/log_format.hpp>
#include <cudamem/memory_resource.hpp>
#include <cudamem/out_of_memory.hpp>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <fstream>
#include <memory>
#include <ostream>
#include <stdexcept>
#include <string>
#include <string_view>
#include <thread>
#include <unordered_map>

namespace cudamem {

/// How a logging_adaptor logs.
struct logging_options {
  bool sample_reserved = false;  ///< log the bytes the chain's leaf holds at each event
};

/// Forwards to its upstream and writes one line per allocation, free and failure.
class logging_adaptor final : public detail::adaptor_base<logging_adaptor> {
 public:
  /// Logs to `out`, which must outlive the adaptor.
  logging_adaptor(memory_resource& upstream, std::ostream& out, logging_options opts = {})
      : adaptor_base(upstream), out_(&out), options_(opts), start_(clock::now()) {
    write_header();
  }

  /// Logs to the file at `path` (created or truncated).
  logging_adaptor(memory_resource& upstream, const std::string& path, logging_options opts = {})
      : adaptor_base(upstream),
        file_(std::make_unique<std::ofstream>(path, std::ios::out | std::ios::trunc)),
        out_(file_.get()),
        options_(opts),
        start_(clock::now()) {
    if (!*file_) {
      throw std::runtime_error("logging_adaptor: cannot open " + path + " for writing");
    }
    write_header();
  }

  ~logging_adaptor() override { flush(); }

  logging_adaptor(const logging_adaptor&) = delete;
  logging_adaptor& operator=(const logging_adaptor&) = delete;

  /// Pushes buffered lines to the stream's destination.
  void flush() noexcept {
    const detail::lock_guard lock(mutex_);
    guarded([this] { out_->flush(); });
  }

  /// Events written so far (allocations, frees and failures).
  [[nodiscard]] std::size_t events() const {
    const detail::lock_guard lock(mutex_);
    return events_;
  }

 private:
  friend class detail::adaptor_base<logging_adaptor>;
  using clock = std::chrono::steady_clock;

  void* adapt_allocate(std::size_t bytes, std::size_t alignment, detail::request_stream stream) {
    void* p = nullptr;
    try {
      p = forward_allocate(bytes, alignment, stream);
    } catch (const out_of_memory&) {
      log(log_event_kind::out_of_memory, nullptr, bytes, alignment, stream);
      throw;
    }
    log(log_event_kind::allocate, p, bytes, alignment, stream);
    return p;
  }

  void adapt_deallocate(void* p, std::size_t bytes, std::size_t alignment,
                        detail::request_stream stream) noexcept {
    log(log_event_kind::free, p, bytes, alignment, stream);
    forward_deallocate(p, bytes, alignment, stream);
  }

  void log(log_event_kind kind, void* p, std::size_t bytes, std::size_t alignment,
           detail::request_stream stream) noexcept {
    log_event e;
    e.kind = kind;
    e.pointer = reinterpret_cast<std::uintptr_t>(p);
    e.bytes = bytes;
    e.alignment = alignment;
    e.synchronous = !stream.has_value();
    e.stream = stream ? reinterpret_cast<std::uintptr_t>(stream->get()) : 0;
    if (options_.sample_reserved) {
      try {
        e.reserved = leaf().stats().reserved_bytes;
      } catch (...) {  // a leaf that cannot report leaves the field empty
      }
    }
    const detail::lock_guard lock(mutex_);
    // Taken under the lock, so times are in file order.
    e.t_ns = static_cast<std::uint64_t>(
        std::chrono::duration_cast<std::chrono::nanoseconds>(clock::now() - start_).count());
    e.thread = thread_number();
    if (kind == log_event_kind::allocate) {
      used_ += bytes;
      peak_ = std::max(peak_, used_);
    } else if (kind == log_event_kind::free) {
      used_ -= std::min(used_, bytes);
    }
    char line[max_log_line];
    const std::size_t length = format_log_line(e, line);
    guarded([&] { out_->write(line, static_cast<std::streamsize>(length)); });
    ++events_;
  }

  /// 1, 2, ... per thread in order of first appearance (mutex held).
  std::uint32_t thread_number() noexcept {
    try {
      const auto [it, inserted] = threads_.try_emplace(
          std::this_thread::get_id(), static_cast<std::uint32_t>(threads_.size() + 1));
      return it->second;
    } catch (...) {
      return 0;  // no memory to number a new thread: 0 means "unknown"
    }
  }

  const memory_resource& leaf() const noexcept {
    const memory_resource* r = this;
    while (r->upstream() != nullptr) {
      r = r->upstream();
    }
    return *r;
  }

  void write_header() {
    out_->write(log_header.data(), static_cast<std::streamsize>(log_header.size()));
  }

  /// Runs a stream operation; reports the first failure, then stops writing (mutex held).
  template <class Operation>
  void guarded(Operation op) noexcept {
    if (broken_) {
      return;
    }
    try {
      op();
      if (!out_->fail()) {
        return;
      }
    } catch (...) {
    }
    broken_ = true;
    report_problem("logging_adaptor: writing the log failed; later events are not logged");
  }

  std::string_view do_name() const noexcept override { return "logging_adaptor"; }
  resource_stats do_stats() const override {
    const detail::lock_guard lock(mutex_);
    resource_stats s;
    s.reserved_bytes = s.used_bytes = used_;
    s.peak_used_bytes = peak_;
    return s;
  }

  std::unique_ptr<std::ofstream> file_;  // set when the adaptor owns its file
  std::ostream* out_;
  logging_options options_;
  const clock::time_point start_;
  mutable detail::mutex mutex_;
  std::unordered_map<std::thread::id, std::uint32_t> threads_;  // guarded by mutex_
  std::size_t events_ = 0;                                      // guarded by mutex_
  std::size_t used_ = 0;                                        // guarded by mutex_
  std::size_t peak_ = 0;                                        // guarded by mutex_
  bool broken_ = false;                                         // guarded by mutex_
};

}  // namespace cudamem
