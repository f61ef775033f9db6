// cudamem/out_of_memory.hpp — the exception every cudamem resource throws when a request
// cannot be met, carrying a `memory_report` that explains why.
//
//   try {
//     cudamem::device_buffer<float> big(n);
//   } catch (const cudamem::out_of_memory& e) {
//     std::puts(e.what());                       // a short paragraph: numbers, verdict, hint
//     if (e.report().verdict == cudamem::oom_verdict::fragmentation) mr.release();
//   }
//
// Contract
// - `out_of_memory` is a `std::bad_alloc`, so code that already catches bad_alloc keeps working.
// - `report()` is the structured diagnosis (see memory_report.hpp); `what()` is its short text.
// - Throwing one is for the resource that failed, or one passing a failure on:
//   `throw_out_of_memory` / `rethrow_out_of_memory`, in memory_report.hpp (they make the
//   report, which asks the device and NVML). Carrying and reading one asks nothing: this
//   header needs only the report's figures, verdict and text (detail/report/).
#pragma once

#include <cudamem/detail/report/figures.hpp>
#include <cudamem/detail/report/text.hpp>
#include <cudamem/detail/report/verdict.hpp>

#include <cstddef>
#include <new>
#include <string>
#include <utility>

namespace cudamem {

/// A request a resource could not meet; see the contract above.
class out_of_memory : public std::bad_alloc {
 public:
  /// A failure, explained by `report`; what() is its text (memory_report::to_text()).
  explicit out_of_memory(memory_report report)
      : report_(std::move(report)), what_(report_.to_text()) {}

  /// The report as text: the request, the verdict, what each resource holds, the advice.
  [[nodiscard]] const char* what() const noexcept override { return what_.c_str(); }
  /// The structured diagnosis (memory_report.hpp).
  [[nodiscard]] const memory_report& report() const noexcept { return report_; }
  /// The bytes of the request that failed.
  [[nodiscard]] std::size_t requested_bytes() const noexcept { return report_.requested_bytes; }
  /// Why it failed, in one word (the report's verdict).
  [[nodiscard]] oom_verdict verdict() const noexcept { return report_.verdict; }

 private:
  memory_report report_;
  std::string what_;
};

}  // namespace cudamem
