// cudamem/log_format.hpp — the line format of logging_adaptor's event log, and a reader for
// it (used by `bench_replay`, the Chrome-trace export, and your own tools).
//
//   std::ifstream in{"run.log"};
//   std::vector<cudamem::log_event> events = cudamem::read_log(in);
//   for (const auto& e : events)
//     if (e.kind == cudamem::log_event_kind::out_of_memory) std::printf("OOM at %llu ns\n", ...);
//
// The format (one event per line, comma-separated, no spaces):
//
//   # cudamem log v1
//   kind,t_ns,thread,stream,ptr,bytes,align,reserved
//   A,1520,1,0x7f2c3c000b20,0x7f2a00000000,1048576,256,2097152
//   F,2310,1,0x7f2c3c000b20,0x7f2a00000000,1048576,256,
//   A,2900,2,sync,0x7f2a00200000,4096,256,
//   O,3100,2,sync,0x0,85899345920,256,
//
//   kind      A an allocation, F a free, O an allocation that failed (out of memory)
//   t_ns      nanoseconds since the log was opened (steady clock), non-decreasing down the file
//   thread    a small number per thread, 1, 2, ... in the order threads first appear
//   stream    the stream handle in hex (0x0 the legacy default stream), or `sync` for the
//             synchronous forms allocate(bytes, align) / deallocate(p, bytes, align)
//   ptr       the pointer in hex (0x0 for O)
//   bytes     bytes requested (for F: the bytes passed to deallocate)
//   align     alignment requested
//   reserved  bytes the upstream chain's leaf held just after the event, if the logger was
//             asked to sample it; empty otherwise
//
// Lines starting with `#` and blank lines are comments. The header line is optional when
// reading. Frees are logged before they reach the upstream, allocations after they return, so
// an address freed and handed out again always appears as F before its new A.
//
// Contract
// - `format_log_line` writes exactly one line (with '\n'); `parse_log_line` reads it back
//   (round trip exact). `read_log` throws `std::runtime_error` naming the line number and the
//   text of the first line it cannot parse.
#pragma once

#include <charconv>
#include <cstddef>
#include <cstdint>
#include <istream>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <system_error>
#include <vector>

namespace cudamem {

/// What a line records.
enum class log_event_kind : char {
  allocate = 'A',       ///< an allocation
  free = 'F',           ///< a free
  out_of_memory = 'O',  ///< an allocation that failed
};

/// One line of the log.
struct log_event {
  /// A, F or O.
  log_event_kind kind = log_event_kind::allocate;
  std::uint64_t t_ns = 0;               ///< nanoseconds since the log was opened
  std::uint32_t thread = 0;             ///< 1, 2, ... in the order threads first appear
  bool synchronous = false;             ///< the synchronous form: `stream` is meaningless
  std::uint64_t stream = 0;             ///< the stream handle, as a number
  std::uint64_t pointer = 0;            ///< as a number (0 for out_of_memory)
  std::size_t bytes = 0;                ///< bytes requested (for F: passed to deallocate)
  std::size_t alignment = 0;            ///< alignment requested
  std::optional<std::size_t> reserved;  ///< bytes the chain's leaf held after it, if sampled

  /// Field by field.
  friend bool operator==(const log_event&, const log_event&) = default;
};

/// The first two lines of every log.
inline constexpr std::string_view log_header =
    "# cudamem log v1\nkind,t_ns,thread,stream,ptr,bytes,align,reserved\n";

/// The longest line `format_log_line` writes, with its newline.
inline constexpr std::size_t max_log_line = 160;  // 8 fields of at most 20 digits, and more

namespace detail {

/// Appends characters to a fixed buffer, never past its end (a full buffer drops the rest;
/// max_log_line leaves room for the longest line, so it never does).
class log_line_writer {
 public:
  log_line_writer(char* begin, std::size_t capacity) noexcept
      : begin_(begin), next_(begin), end_(begin + capacity) {}
  void put(char c) noexcept {
    if (next_ != end_) {
      *next_++ = c;
    }
  }
  void put(std::string_view text) noexcept {
    for (const char c : text) {
      put(c);
    }
  }
  void put_number(std::uint64_t value, int base = 10) noexcept {
    char digits[24];
    const auto result = std::to_chars(digits, digits + sizeof digits, value, base);
    put(std::string_view(digits, static_cast<std::size_t>(result.ptr - digits)));
  }
  [[nodiscard]] std::size_t size() const noexcept {
    return static_cast<std::size_t>(next_ - begin_);
  }

 private:
  char* begin_;
  char* next_;
  char* end_;
};

}  // namespace detail

/// Writes `e` as one line into `out` (at least max_log_line chars); returns the length.
inline std::size_t format_log_line(const log_event& e, char* out) noexcept {
  detail::log_line_writer line{out, max_log_line};
  line.put(static_cast<char>(e.kind));
  line.put(',');
  line.put_number(e.t_ns);
  line.put(',');
  line.put_number(e.thread);
  if (e.synchronous) {
    line.put(",sync");
  } else {
    line.put(",0x");
    line.put_number(e.stream, 16);
  }
  line.put(",0x");
  line.put_number(e.pointer, 16);
  line.put(',');
  line.put_number(e.bytes);
  line.put(',');
  line.put_number(e.alignment);
  line.put(',');
  if (e.reserved) {
    line.put_number(*e.reserved);
  }
  line.put('\n');
  return line.size();
}

/// The line for `e`, as a string.
[[nodiscard]] inline std::string to_log_line(const log_event& e) {
  char line[max_log_line];
  return std::string(line, format_log_line(e, line));
}

/// Parses one line (with or without its newline). Empty for a comment, blank or header line;
/// throws std::invalid_argument for anything else that is not an event.
[[nodiscard]] inline std::optional<log_event> parse_log_line(std::string_view line) {
  while (!line.empty() && (line.back() == '\n' || line.back() == '\r')) {
    line.remove_suffix(1);
  }
  if (line.empty() || line.front() == '#' || line.starts_with("kind,")) {
    return std::nullopt;
  }
  auto bad = [&](const char* what) {
    return std::invalid_argument(std::string("cudamem log: ") + what + " in \"" +
                                 std::string(line) + "\"");
  };
  std::string_view fields[8];
  std::size_t count = 0;
  std::string_view rest = line;
  for (;;) {
    const std::size_t comma = rest.find(',');
    if (count == 8) {
      throw bad("more than 8 fields");
    }
    fields[count++] = rest.substr(0, comma);
    if (comma == std::string_view::npos) {
      break;
    }
    rest.remove_prefix(comma + 1);
  }
  if (count != 8) {
    throw bad("fewer than 8 fields");
  }
  auto number = [&](std::string_view text, int base, const char* name) -> std::uint64_t {
    if (base == 16) {
      if (!text.starts_with("0x")) {
        throw bad(name);
      }
      text.remove_prefix(2);
    }
    std::uint64_t value = 0;
    const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), value, base);
    if (error != std::errc{} || end != text.data() + text.size() || text.empty()) {
      throw bad(name);
    }
    return value;
  };
  log_event e;
  if (fields[0] == "A") {
    e.kind = log_event_kind::allocate;
  } else if (fields[0] == "F") {
    e.kind = log_event_kind::free;
  } else if (fields[0] == "O") {
    e.kind = log_event_kind::out_of_memory;
  } else {
    throw bad("an unknown event kind (A, F or O expected)");
  }
  e.t_ns = number(fields[1], 10, "a bad t_ns");
  e.thread = static_cast<std::uint32_t>(number(fields[2], 10, "a bad thread"));
  if (fields[3] == "sync") {
    e.synchronous = true;
  } else {
    e.stream = number(fields[3], 16, "a bad stream");
  }
  e.pointer = number(fields[4], 16, "a bad ptr");
  e.bytes = number(fields[5], 10, "a bad bytes");
  e.alignment = number(fields[6], 10, "a bad align");
  if (!fields[7].empty()) {
    e.reserved = number(fields[7], 10, "a bad reserved");
  }
  return e;
}

/// Every event in `in`, in order. Throws std::runtime_error("... line N: ...") on a bad line.
[[nodiscard]] inline std::vector<log_event> read_log(std::istream& in) {
  std::vector<log_event> events;
  std::string line;
  std::size_t number = 0;
  while (std::getline(in, line)) {
    ++number;
    try {
      if (auto e = parse_log_line(line)) {
        events.push_back(*e);
      }
    } catch (const std::invalid_argument& error) {
      throw std::runtime_error("line " + std::to_string(number) + ": " + error.what());
    }
  }
  return events;
}

}  // namespace cudamem
