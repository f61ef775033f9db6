// Test helper: collects what cudamem's error handler receives while alive, instead of printing.
#pragma once

#include <cudamem/error.hpp>

#include <mutex>
#include <string>
#include <vector>

namespace cudamem_test {

/// Collects what the error handler receives while it is alive, instead of printing it.
class captured_errors {
 public:
  captured_errors() : previous_(cudamem::set_error_handler(&capture)) { messages().clear(); }
  ~captured_errors() { cudamem::set_error_handler(previous_); }
  captured_errors(const captured_errors&) = delete;
  captured_errors& operator=(const captured_errors&) = delete;

  static std::vector<std::string>& messages() {
    static std::vector<std::string> list;
    return list;
  }

 private:
  static void capture(const cudamem::error_report& r) noexcept {
    try {
      const std::lock_guard lock(mutex());
      messages().emplace_back(r.message);
    } catch (...) {
    }
  }
  static std::mutex& mutex() {
    static std::mutex m;
    return m;
  }
  cudamem::error_handler previous_;
};

}  // namespace cudamem_test
