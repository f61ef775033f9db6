// cudamem/out_of_memory.hpp — the exception every cudamem resource throws when a request
// cannot be met, carrying a `memory_report` that explains why, and how a resource throws it.
//
//   try {
//     cudamem::device_buffer<float> big(n);
//   } catch (const cudamem::out_of_memory& e) {
//     std::puts(e.what());                       // a short paragraph: numbers, verdict, hint
//     if (e.verdict() == cudamem::oom_verdict::fragmentation) mr.release();
//   }
//
//   // In a resource that cannot meet a request:
//   cudamem::throw_out_of_memory(*this, bytes, alignment, "cudaMalloc returned ...");
//
// Contract
// - `out_of_memory` is a `std::bad_alloc`, so code that already catches bad_alloc keeps working.
// - `report()` is the structured diagnosis (memory_report.hpp's contract says what each figure
//   means); `verdict()` is why it failed; `what()` is the report's text.
// - `throw_out_of_memory(resource, ...)` is for the resource that failed;
//   `rethrow_out_of_memory(resource, ..., below)` for one passing on a failure from below
//   (adaptors): the report then starts at it and keeps the cause, the verdict and which
//   resource failed first. Throwing never allocates device memory; it asks the device for its
//   free and total memory (cudaMemGetInfo) when the memory is device-side.
// - The whole report and the paragraph what() shows are compiled where they are formatted:
//   in the files that include <cudamem/memory_report.hpp> (cudamem.hpp does). If one file of
//   the program includes it, every out_of_memory the program throws carries the whole report:
//   who holds the device (NVML), what the context reserves, each resource's advice, and
//   what() is memory_report::to_text(). If none does, a report carries the request, the
//   cause, the chain's figures, the device's free and total memory and the verdict, and what()
//   says so in one sentence that names the header. Reading the report's own text and advice
//   (to_text, to_json, hint, explanation) is memory_report.hpp's.
// - An owner that will catch its upstream's failure and try something else (a pool growing, a
//   vm_pool giving chunks back and asking again) opens a `detail::discarded_report_scope` for
//   that upstream: a failure the upstream throws itself (throw_out_of_memory) then carries
//   only its cause (no chain, no NVML query: ~250 µs on an H100, saved at each failed growth),
//   and the owner reports from itself if it fails in the end. A failure passed on from below
//   (rethrow_out_of_memory: adaptors) and every resource further down still build whole
//   reports, so a retry_adaptor's callback or a log sees what it always saw.
// - Compiled mode (detail/compiled.hpp): the throwing functions are the library's, and the
//   resources that call CUDA include only their declarations (detail/report/oom_throw.hpp), so
//   a file that catches `out_of_memory` includes this header itself.
#pragma once

#include <cudamem/detail/compiled.hpp>
#include <cudamem/detail/report/figures.hpp>
#include <cudamem/detail/report/measure.hpp>
#include <cudamem/detail/report/oom_throw.hpp>
#include <cudamem/memory_resource.hpp>

#include <cstddef>
#include <new>
#include <optional>
#include <string>
#include <utility>

namespace cudamem {

/// A request a resource could not meet; see the contract above.
class out_of_memory : public std::bad_alloc {
 public:
  /// A failure, explained by `report`; what() is its text (see the contract).
  explicit out_of_memory(memory_report report)
      : report_(std::move(report)), what_(detail::report_text(report_)) {}

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

namespace detail {

/// The resource whose failures on this thread its caller catches and replaces (see the
/// contract); nullptr when none. Per thread, because a request runs on its caller's thread.
inline thread_local const memory_resource* report_discarded_for = nullptr;

/// While it lives, a failure `upstream` throws itself (throw_out_of_memory with it as the
/// resource) on this thread carries only its cause. Scopes nest: each restores the one it
/// replaced.
class discarded_report_scope {
 public:
  explicit discarded_report_scope(const memory_resource& upstream) noexcept
      : previous_(report_discarded_for) {
    report_discarded_for = &upstream;
  }
  ~discarded_report_scope() { report_discarded_for = previous_; }
  discarded_report_scope(const discarded_report_scope&) = delete;
  discarded_report_scope& operator=(const discarded_report_scope&) = delete;

 private:
  const memory_resource* previous_;
};

/// The report of a failure its caller discards: what was asked, and why it failed.
[[nodiscard]] inline memory_report cause_only_report(const memory_resource& resource,
                                                     std::size_t bytes, std::size_t alignment,
                                                     std::string cause,
                                                     std::optional<oom_verdict> verdict) {
  memory_report report;
  report.requested_bytes = bytes;
  report.alignment = alignment;
  report.device = resource.device();
  report.cause = std::move(cause);
  report.verdict = verdict.value_or(oom_verdict::unknown);
  return report;
}

}  // namespace detail

// The throwing functions are declared in detail/report/oom_throw.hpp (with their default
// arguments). Header-only they are defined here, inline; in compiled mode the
// cudamem::compiled library defines them (detail/compiled.hpp), and a file that includes this
// header to catch out_of_memory compiles only the class above.
#if CUDAMEM_DEFINITIONS_IN_HEADERS

/// Builds the report for a failed request to `resource` and throws it. `cause` is a short
/// line from the resource that failed ("cudaMalloc returned cudaErrorMemoryAllocation");
/// `verdict`, when given, replaces the report's own diagnosis.
[[noreturn]] CUDAMEM_DEFINITION void throw_out_of_memory(const memory_resource& resource,
                                                         std::size_t bytes, std::size_t alignment,
                                                         std::string cause,
                                                         std::optional<oom_verdict> verdict) {
  if (&resource == detail::report_discarded_for) [[unlikely]] {
    throw out_of_memory(
        detail::cause_only_report(resource, bytes, alignment, std::move(cause), verdict));
  }
  throw out_of_memory(detail::measure_report(resource, bytes, alignment, std::move(cause),
                                             verdict, 0, detail::registered_report_completion()));
}

/// For a resource passing on the failure of one below it: throws a report that starts at
/// `resource` (so it shows the whole chain from there) and keeps what `below` knew — its
/// cause, its verdict, and which resource failed first.
[[noreturn]] CUDAMEM_DEFINITION void rethrow_out_of_memory(const memory_resource& resource,
                                                           std::size_t bytes,
                                                           std::size_t alignment,
                                                           const memory_report& below) {
  // The resources from the one that failed down to the leaf are the same in both chains.
  const std::size_t from_leaf = below.chain.empty() ? 0 : below.chain.size() - 1 - below.origin;
  std::size_t depth = 0;
  for (const memory_resource* r = resource.upstream(); r != nullptr; r = r->upstream()) {
    ++depth;
  }
  throw out_of_memory(detail::measure_report(resource, bytes, alignment, below.cause,
                                             below.verdict,
                                             depth >= from_leaf ? depth - from_leaf : 0,
                                             detail::registered_report_completion()));
}

#endif  // CUDAMEM_DEFINITIONS_IN_HEADERS

}  // namespace cudamem
