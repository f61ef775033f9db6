// Test helper: a small, strict JSON reader (RFC 8259 values; numbers as double; \u escapes
// of ASCII only), so tests can check that what cudamem writes is JSON and look inside it
// without a JSON library.
#pragma once

#include <cctype>
#include <cstdlib>
#include <map>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

namespace cudamem_test {

struct json_value {
  enum class type { null, boolean, number, string, array, object } kind = type::null;
  bool boolean = false;
  double number = 0;
  std::string text;
  std::vector<json_value> items;
  std::map<std::string, json_value> members;

  /// The member `key` of an object; throws std::out_of_range if there is none.
  [[nodiscard]] const json_value& operator[](const std::string& key) const {
    const auto it = members.find(key);
    if (kind != type::object || it == members.end()) {
      throw std::out_of_range("json: no member " + key);
    }
    return it->second;
  }
  [[nodiscard]] bool has(const std::string& key) const {
    return kind == type::object && members.count(key) != 0;
  }
};

namespace detail {

class json_parser {
 public:
  explicit json_parser(std::string_view text) : text_(text) {}

  json_value document() {
    json_value v = value();
    skip_space();
    if (pos_ != text_.size()) {
      throw error("trailing characters");
    }
    return v;
  }

 private:
  std::runtime_error error(const char* what) const {
    return std::runtime_error(std::string("json: ") + what + " at offset " + std::to_string(pos_));
  }
  void skip_space() {
    while (pos_ < text_.size() && std::string_view(" \t\r\n").find(text_[pos_]) != std::string_view::npos) {
      ++pos_;
    }
  }
  bool take(char c) {
    skip_space();
    if (pos_ < text_.size() && text_[pos_] == c) {
      ++pos_;
      return true;
    }
    return false;
  }
  void expect(char c) {
    if (!take(c)) {
      throw error("unexpected character");
    }
  }

  json_value value() {
    skip_space();
    if (pos_ >= text_.size()) {
      throw error("unexpected end");
    }
    json_value v;
    if (take('{')) {
      v.kind = json_value::type::object;
      if (take('}')) {
        return v;
      }
      do {
        std::string key = string();
        expect(':');
        v.members[key] = value();
      } while (take(','));
      expect('}');
    } else if (take('[')) {
      v.kind = json_value::type::array;
      if (take(']')) {
        return v;
      }
      do {
        v.items.push_back(value());
      } while (take(','));
      expect(']');
    } else if (text_[pos_] == '"') {
      v.kind = json_value::type::string;
      v.text = string();
    } else if (word("true")) {
      v.kind = json_value::type::boolean;
      v.boolean = true;
    } else if (word("false")) {
      v.kind = json_value::type::boolean;
    } else if (!word("null")) {
      v.kind = json_value::type::number;
      v.number = number();
    }
    return v;
  }

  bool word(std::string_view w) {
    if (text_.substr(pos_).starts_with(w)) {
      pos_ += w.size();
      return true;
    }
    return false;
  }

  void digits() {
    const std::size_t from = pos_;
    while (pos_ < text_.size() && std::isdigit(static_cast<unsigned char>(text_[pos_])) != 0) {
      ++pos_;
    }
    if (pos_ == from) {
      throw error("bad number");
    }
  }

  double number() {
    const std::size_t start = pos_;
    if (text_[pos_] == '-') {
      ++pos_;
    }
    digits();
    if (pos_ < text_.size() && text_[pos_] == '.') {
      ++pos_;
      digits();
    }
    if (pos_ < text_.size() && (text_[pos_] == 'e' || text_[pos_] == 'E')) {
      ++pos_;
      if (pos_ < text_.size() && (text_[pos_] == '+' || text_[pos_] == '-')) {
        ++pos_;
      }
      digits();
    }
    return std::strtod(std::string(text_.substr(start, pos_ - start)).c_str(), nullptr);
  }

  std::string string() {
    expect('"');
    std::string out;
    for (;;) {
      if (pos_ >= text_.size()) {
        throw error("unterminated string");
      }
      const char c = text_[pos_++];
      if (c == '"') {
        return out;
      }
      if (static_cast<unsigned char>(c) < 0x20) {
        throw error("control character in a string");
      }
      if (c != '\\') {
        out += c;
        continue;
      }
      if (pos_ >= text_.size()) {
        throw error("bad escape");
      }
      const char e = text_[pos_++];
      if (e == '"' || e == '\\' || e == '/') {
        out += e;
      } else if (e == 'n') {
        out += '\n';
      } else if (e == 't') {
        out += '\t';
      } else if (e == 'r') {
        out += '\r';
      } else if (e == 'u' && pos_ + 4 <= text_.size()) {
        const unsigned long code = std::strtoul(std::string(text_.substr(pos_, 4)).c_str(), nullptr, 16);
        pos_ += 4;
        if (code >= 0x80) {
          throw error("non-ASCII \\u escape");
        }
        out += static_cast<char>(code);
      } else {
        throw error("bad escape");
      }
    }
  }

  std::string_view text_;
  std::size_t pos_ = 0;
};

}  // namespace detail

/// Parses one JSON document; throws std::runtime_error naming the offset if it is not valid.
inline json_value parse_json(std::string_view text) { return detail::json_parser{text}.document(); }

}  // namespace cudamem_test
