// cudamem/detail/report/measure.hpp — measuring a failed request into a memory_report, with
// what every translation unit that throws can afford: each resource of the chain as it is (its
// resource_stats), the device's free and total memory, what this process's vm_resources hold
// ahead of need, and the verdict (diagnose, verdict_subject). The rest of a whole report is
// a `report_completion`, compiled only where <cudamem/memory_report.hpp> is included:
//   holders   who holds the device (NVML) and what the CUDA context reserves;
//   advise    the chain's own advice (memory_resource::oom_hint);
//   to_text   the paragraph what() shows.
//
//   // memory_report.hpp, once per translation unit that includes it, as the program starts:
//   inline const bool registered = detail::register_report_completion(whole_report);
//   // out_of_memory.hpp, where a resource throws:
//   memory_report r = detail::measure_report(resource, bytes, alignment, cause, verdict, 0,
//                                            detail::registered_report_completion());
//
// Why the split: NVML's loader, the report's text and JSON and the advice are about half of
// what cudamem's owners cost a translation unit under nvcc (bench/compile_time.py), and a
// file that declares a buffer never formats a report. A program in which no file includes
// memory_report.hpp (or cudamem.hpp, which does) throws reports with these figures and the
// verdict, and a what() that says, in one sentence, what is missing and which header brings it.
//
// Part of memory_report.hpp and out_of_memory.hpp, whose contracts say what each figure means.
#pragma once

#include <cudamem/detail/held_ahead.hpp>
#include <cudamem/detail/report/figures.hpp>
#include <cudamem/detail/sync/atomic.hpp>
#include <cudamem/memory_resource.hpp>

#include <cuda_runtime_api.h>

#include <cstddef>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace cudamem {

// The member of memory_report this part defines (declared, with what it says, in figures.hpp):
// the resources' own advice reads it, and they are compiled wherever a resource is.

inline std::optional<std::size_t> memory_report::verdict_subject() const noexcept {
  for (std::size_t i = 0; i < chain.size(); ++i) {
    const resource_stats& s = chain[i].stats;
    if (verdict == oom_verdict::budget && s.budget &&
        s.used_bytes + requested_bytes > *s.budget) {
      return i;
    }
    if (verdict == oom_verdict::fragmentation && s.largest_free_block &&
        s.free_bytes() >= requested_bytes && *s.largest_free_block < requested_bytes) {
      return i;
    }
  }
  if (verdict == oom_verdict::fragmentation && !chain.empty()) {
    return chain.size() - 1;  // the device itself: the leaf got what the device has
  }
  return std::nullopt;
}

namespace detail {

/// What a whole report adds to the measured one (see above). Each function is called with the
/// report as measured so far; none may throw out (each catches what it cannot do).
struct report_completion {
  /// Fills in `holders` and `context` for CUDA device `device`, which is current.
  void (*holders)(memory_report& report, int device) noexcept;
  /// Fills in `resource_hint`, asking `resources` (the chain, top first) in turn.
  void (*advise)(memory_report& report,
                 const std::vector<const memory_resource*>& resources) noexcept;
  /// The paragraph what() shows (memory_report::to_text).
  std::string (*to_text)(const memory_report& report);
};

/// The completion every out_of_memory thrown in this process uses; null until a translation
/// unit that includes memory_report.hpp has been initialised.
inline constinit atomic<const report_completion*> registered_completion{nullptr};

/// Makes `completion` the process's (see above); returns true, for an initialiser.
inline bool register_report_completion(const report_completion& completion) noexcept {
  registered_completion.store(&completion, memory_order_release);
  return true;
}

/// The registered completion, or null.
[[nodiscard]] inline const report_completion* registered_report_completion() noexcept {
  return registered_completion.load(memory_order_acquire);
}

/// Decides the verdict from the figures already in `r`, in the order of memory_report.hpp's
/// contract.
[[nodiscard]] inline oom_verdict diagnose(const memory_report& r) {
  const std::size_t bytes = r.requested_bytes;
  for (const resource_snapshot& s : r.chain) {
    if (s.stats.budget && s.stats.used_bytes + bytes > *s.stats.budget) {
      return oom_verdict::budget;
    }
  }
  if (!r.device_total || !r.device_free) {
    return oom_verdict::unknown;
  }
  if (bytes > *r.device_total) {
    return oom_verdict::larger_than_device;
  }
  // A pool with enough free bytes in total but no block large enough, on a device that could
  // not make up the difference: the memory exists, in the wrong shape.
  for (const resource_snapshot& s : r.chain) {
    if (s.stats.largest_free_block && s.stats.free_bytes() >= bytes &&
        *s.stats.largest_free_block < bytes && *r.device_free < bytes) {
      return oom_verdict::fragmentation;
    }
  }
  // The device itself fragmented: it has enough free, yet the chain could not get the request
  // from it, so no free range is large enough (the leaf may say so with largest_free_block; a
  // simulated first-fit device does). On real GPUs virtual memory makes this rare.
  if (*r.device_free >= bytes) {
    return oom_verdict::fragmentation;
  }
  // Whoever holds more of the used memory is what stands in the way.
  const std::size_t ours = r.held_by_chain();
  return r.held_by_others().value_or(0) > ours ? oom_verdict::held_by_others
                                               : oom_verdict::exhausted;
}

/// Measures `resource`, its upstreams and the device for a request of `bytes` that failed
/// (`cause`: what the failing resource said). `verdict`, when given, replaces the diagnosis;
/// `origin_below_top` is how far below `resource` the resource that failed first sits.
/// `completion` (may be null) adds the holders and the advice.
inline memory_report measure_report(const memory_resource& resource, std::size_t bytes,
                                    std::size_t alignment, std::string cause,
                                    std::optional<oom_verdict> verdict,
                                    std::size_t origin_below_top,
                                    const report_completion* completion) {
  memory_report report;
  report.requested_bytes = bytes;
  report.alignment = alignment;
  report.device = resource.device();
  report.cause = std::move(cause);
  std::vector<const memory_resource*> resources;
  for (const memory_resource* r = &resource; r != nullptr; r = r->upstream()) {
    resource_snapshot snap{std::string(r->name()), r->kind(), r->device(), {}};
    try {
      snap.stats = r->stats();
    } catch (...) {  // a resource that cannot report still leaves the rest of the report useful
    }
    report.chain.push_back(std::move(snap));
    resources.push_back(r);
  }
  const memory_resource* leaf = resources.back();
  const std::size_t deepest = report.chain.size() - 1;
  report.origin = origin_below_top < deepest ? origin_below_top : deepest;
  const resource_stats& leaf_stats = report.chain.back().stats;
  if (leaf_stats.capacity) {  // a simulated device: its capacity is the whole device
    report.device_total = *leaf_stats.capacity;
    const std::size_t not_free = report.held_by_chain() + leaf_stats.held_elsewhere.value_or(0);
    report.device_free = *leaf_stats.capacity > not_free ? *leaf_stats.capacity - not_free : 0;
    report.held_ahead = held_ahead_bytes(memory_domain{-1, leaf});
  } else if (leaf->device() >= 0 && leaf->kind() != memory_kind::host &&
             leaf->kind() != memory_kind::pinned) {
    int previous = -1;
    std::size_t free = 0;
    std::size_t total = 0;
    if (cudaGetDevice(&previous) == cudaSuccess && cudaSetDevice(leaf->device()) == cudaSuccess &&
        cudaMemGetInfo(&free, &total) == cudaSuccess) {
      report.device_free = free;
      report.device_total = total;
      report.held_ahead = held_ahead_bytes(memory_domain{leaf->device(), nullptr});
      if (completion != nullptr) {
        completion->holders(report, leaf->device());
      }
    }
    if (previous >= 0) {
      static_cast<void>(cudaSetDevice(previous));
    }
    static_cast<void>(cudaGetLastError());
  }
  report.verdict = verdict ? *verdict : diagnose(report);
  if (completion != nullptr) {
    completion->advise(report, resources);
  }
  return report;
}

/// What what() says when no completion is registered: the request, the cause, the device and
/// the verdict, and the one sentence that says what is missing and how to get it.
[[nodiscard]] inline std::string measured_report_text(const memory_report& r) {
  std::string text = request_sentences(r);
  if (r.device_free && r.device_total) {
    text += " Device: " + format_bytes(*r.device_free) + " free of " +
            format_bytes(*r.device_total) + "; this chain holds " +
            format_bytes(r.held_by_chain()) + ".";
  }
  if (!r.chain.empty()) {
    text += " " + r.chain[r.origin].name + " failed first.";
  }
  text += " Verdict: " + std::string(to_string(r.verdict)) +
          ". Who holds the device, each resource's figures and the advice are left out: "
          "no file of this program includes <cudamem/memory_report.hpp>, which compiles them.";
  return text;
}

/// The text of `r`: the registered completion's (the whole paragraph), else the measured one.
[[nodiscard]] inline std::string report_text(const memory_report& r) {
  const report_completion* completion = registered_report_completion();
  return completion != nullptr ? completion->to_text(r) : measured_report_text(r);
}

}  // namespace detail

}  // namespace cudamem
