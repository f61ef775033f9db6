// cudamem/trace_export.hpp — memory over time as a Chrome trace (the JSON "Trace Event
// Format"), which opens in https://ui.perfetto.dev and chrome://tracing: one counter track per
// resource (bytes in use, and reserved when known) and a marker at every out-of-memory.
//
//   // 1. Log a run with a logging_adaptor (sample_reserved adds the pool's reserved bytes):
//   cudamem::logging_adaptor logged{pool, "run.log", {.sample_reserved = true}};
//   ...
//   // 2. Turn the log into a trace, and open trace.json in ui.perfetto.dev:
//   std::ifstream in{"run.log"};
//   cudamem::chrome_trace trace;
//   trace.add_log("pool", cudamem::read_log(in));
//   trace.write_file("trace.json");
//
//   // Or feed it samples yourself (bench_replay --trace does, per resource of the stack):
//   trace.add_sample("arena", t_ns, in_use_bytes, reserved_bytes);
//   trace.add_out_of_memory("arena", t_ns, requested_bytes, "fragmentation");
//
// Contract
// - A track is named by the string you give; each track becomes one counter ("ph":"C") named
//   "<track> bytes" with the series `in_use` and, when given, `reserved`, all in bytes.
//   Out-of-memory events are instant events ("ph":"i", process scope) named
//   "out of memory: <track>" with the requested bytes and your detail text as arguments.
// - Times are nanoseconds as in the log; the file holds microseconds (the format's unit) with
//   three decimals, so no precision is lost.
// - `add_log` replays the log's A/F lines to compute bytes in use (frees of pointers it never
//   saw allocated are ignored), uses the `reserved` column when present, and marks O lines.
// - The output is one JSON object {"traceEvents":[...],"displayTimeUnit":"ns"}; track names
//   and detail text are escaped, so any string is safe. `write_file` throws
//   `std::runtime_error` if the file cannot be written.
#pragma once

#include <cudamem/detail/json.hpp>
#include <cudamem/log_format.hpp>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <optional>
#include <ostream>
#include <stdexcept>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace cudamem {

/// A Chrome trace being built: memory over time per track, and out-of-memory markers.
class chrome_trace {
 public:
  /// One point of a track's counter: bytes in use (and reserved, if known) at `t_ns`.
  void add_sample(std::string_view track, std::uint64_t t_ns, std::size_t in_use,
                  std::optional<std::size_t> reserved = std::nullopt) {
    std::string event = R"({"name":)" + quote(std::string(track) + " bytes") +
                        R"(,"ph":"C","pid":1,"ts":)" + microseconds(t_ns) +
                        R"(,"args":{"in_use":)" + std::to_string(in_use);
    if (reserved) {
      event += R"(,"reserved":)" + std::to_string(*reserved);
    }
    events_.push_back(event + "}}");
  }

  /// A marker: `track` could not allocate `bytes` at `t_ns`; `detail` (a verdict, a message)
  /// is shown with it.
  void add_out_of_memory(std::string_view track, std::uint64_t t_ns, std::size_t bytes,
                         std::string_view detail = {}) {
    events_.push_back(R"({"name":)" + quote("out of memory: " + std::string(track)) +
                      R"(,"ph":"i","s":"p","pid":1,"tid":1,"ts":)" + microseconds(t_ns) +
                      R"(,"args":{"requested_bytes":)" + std::to_string(bytes) +
                      R"(,"detail":)" + quote(detail) + "}}");
  }

  /// Every event of a log (see log_format.hpp) as the track `track`; see the contract.
  void add_log(std::string_view track, const std::vector<log_event>& events) {
    std::unordered_map<std::uint64_t, std::size_t> live;  // pointer -> bytes
    std::size_t in_use = 0;
    for (const log_event& e : events) {
      switch (e.kind) {
        case log_event_kind::allocate:
          if (live.insert_or_assign(e.pointer, e.bytes).second) {
            in_use += e.bytes;
          }
          break;
        case log_event_kind::free:
          if (const auto it = live.find(e.pointer); it != live.end()) {
            in_use -= it->second;
            live.erase(it);
          }
          break;
        case log_event_kind::out_of_memory:
          add_out_of_memory(track, e.t_ns, e.bytes, "logged failure");
          continue;
      }
      add_sample(track, e.t_ns, in_use, e.reserved);
    }
  }

  /// How many events the trace holds (counter samples and markers).
  [[nodiscard]] std::size_t size() const noexcept { return events_.size(); }

  /// The whole trace as one JSON document.
  [[nodiscard]] std::string to_json() const {
    std::string json = R"({"displayTimeUnit":"ns","traceEvents":[)";
    json += R"({"name":"process_name","ph":"M","pid":1,"args":{"name":"cudamem memory"}})";
    for (const std::string& event : events_) {
      json += ",\n";
      json += event;
    }
    return json + "]}\n";
  }

  /// Writes to_json() to `out`.
  void write(std::ostream& out) const { out << to_json(); }

  /// Writes to_json() to the file `path` (replaced); throws std::runtime_error if it cannot.
  void write_file(const std::string& path) const {
    std::ofstream out{path, std::ios::out | std::ios::trunc};
    out << to_json();
    out.close();
    if (!out) {
      throw std::runtime_error("chrome_trace: cannot write " + path);
    }
  }

 private:
  static std::string microseconds(std::uint64_t t_ns) {
    char text[32];
    std::snprintf(text, sizeof text, "%llu.%03llu",
                  static_cast<unsigned long long>(t_ns / 1000),
                  static_cast<unsigned long long>(t_ns % 1000));
    return text;
  }

  static std::string quote(std::string_view s) { return detail::json_quote(s); }

  std::vector<std::string> events_;
};

}  // namespace cudamem
