// cudamem/detail/adaptors/leak_report.hpp — what a tracking_adaptor tells you, and how it is
// told to record: one live allocation as a record (`allocation_record`: pointer, bytes,
// alignment, stream, the user's line, thread, time), the live allocations at one moment
// (`leak_report`, with the text a leak is reported in), and `tracking_options`.
//
//   cudamem::leak_report r = tracked.leaks();
//   for (const cudamem::allocation_record& a : r.leaks) std::puts(a.to_text().c_str());
//   //   4.00 KiB at 0x7f3a00000000 (alignment 256) allocated at main.cpp:13 in `int main()`,
//   //     synchronous, thread 0x7f3b...
//
// Part of tracking_adaptor.hpp, whose contract says what is recorded and when. These are the
// public forms only: what the adaptor stores per allocation, and how, is
// detail/adaptors/allocation_table.hpp (a 64-byte record per allocation, turned into an
// allocation_record only when a report is written).
#pragma once

#include <cudamem/detail/report/figures.hpp>  // format_bytes

#include <cuda_runtime_api.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <optional>
#include <source_location>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

namespace cudamem {

/// One allocation, as the tracking adaptor saw it made.
struct allocation_record {
  void* pointer = nullptr;             ///< what allocate returned
  std::size_t bytes = 0;               ///< bytes asked for
  std::size_t alignment = 0;           ///< alignment asked for
  std::optional<cudaStream_t> stream;  ///< empty: the synchronous form
  std::source_location site;           ///< where the user asked for it
  std::thread::id thread;                        ///< the thread that asked
  std::optional<std::chrono::nanoseconds> time;  ///< since the adaptor was made, when it
                                                 ///< records timestamps
  std::uint64_t sequence = 0;  ///< 0, 1, 2... in the order this thread made its allocations

  /// "1.00 MiB at 0x... (alignment 256) allocated at file:line in `function`, stream 0x...,
  /// thread ..." and, with a time, ", 1.234 ms after the adaptor was made".
  [[nodiscard]] std::string to_text() const {
    std::ostringstream text;
    text << format_bytes(bytes) << " at " << pointer << " (alignment " << alignment
         << ") allocated at " << describe_site(site) << ", ";
    if (stream) {
      text << "stream " << static_cast<const void*>(*stream);
    } else {
      text << "synchronous";
    }
    text << ", thread " << thread;
    if (time) {
      char ms[32];
      std::snprintf(ms, sizeof ms, "%.3f",
                    std::chrono::duration<double, std::milli>(*time).count());
      text << ", " << ms << " ms after the adaptor was made";
    }
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
  std::size_t total_bytes = 0;              ///< the leaks' bytes together

  /// Whether nothing is live.
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

/// How a tracking_adaptor records.
struct tracking_options {
  bool timestamps = false;  ///< record when each allocation was made (costs a tick-counter read)
  /// How far one shard's bytes in use may move before the shared peak hears of it, when
  /// threads share the adaptor (see the contract). 0: an exact peak, at one atomic add on a
  /// shared line per request.
  std::size_t peak_slack = std::size_t{4} << 20;
};

}  // namespace cudamem
