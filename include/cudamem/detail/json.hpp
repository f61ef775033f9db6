// cudamem/detail/json.hpp — the one JSON helper the reports and trace exports share.
#pragma once

#include <cstdio>
#include <string>
#include <string_view>

namespace cudamem::detail {

/// `s` as a JSON string literal: quotes and backslashes escaped, control characters as \uXXXX.
inline std::string json_quote(std::string_view s) {
  std::string out = "\"";
  for (const char c : s) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      char escaped[8];
      std::snprintf(escaped, sizeof escaped, "\\u%04x", static_cast<unsigned>(c));
      out += escaped;
    } else {
      out += c;
    }
  }
  return out + "\"";
}

}  // namespace cudamem::detail
