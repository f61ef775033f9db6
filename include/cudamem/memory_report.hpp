// cudamem/memory_report.hpp — a snapshot of what a chain of resources and the device hold,
// who else holds the device's memory, and a verdict on why a request failed, with advice that
// fits the resource that failed. `out_of_memory` carries one; you can also ask for one at any
// time.
//
//   cudamem::memory_report r = cudamem::make_memory_report(pool, 2ull << 30);
//   std::puts(r.to_text().c_str());   // human-readable paragraph
//   write_file("mem.json", r.to_json());
//   for (const cudamem::process_holding& p : r.holders->others) ...  // pid, name, bytes
//
//   // In a resource that cannot meet a request:
//   cudamem::throw_out_of_memory(*this, bytes, alignment, "cudaMalloc returned ...");
//
// Contract
// - `make_memory_report(resource, bytes, alignment)` walks `resource` and its upstreams
//   (`memory_resource::upstream()`), records each one's `resource_stats`, reads the device's
//   free/total memory (the simulated device's capacity when the leaf has one, less what it
//   says others hold; the real device via cudaMemGetInfo otherwise; nothing for host memory),
//   and decides a verdict, checked in this order:
//     budget              a limiting resource's budget would be exceeded (bytes in use there +
//                         the request > its `stats().budget`);
//     larger_than_device  the request is larger than the device's total memory;
//     fragmentation       enough is free, in the wrong shape: a pool holds enough free bytes in
//                         total but no block large enough and the device cannot supply the
//                         difference; or the device itself reports enough free memory and yet
//                         the request failed: its free memory is not in one piece;
//     held_by_others      memory this chain does not hold (device used - what the chain's leaf
//                         holds and its resources hold beside it, resource_stats::held_beside:
//                         other processes, this process's context and other resources) is more
//                         than what the chain holds;
//     exhausted           this chain itself holds the memory;
//     unknown             not enough information (e.g. no device to ask).
// - Every holder named. On a real device the report also asks NVML (the driver's management
//   library, loaded at run time: detail/nvml/nvml.hpp) which processes use the device and how
//   much each holds (`holders`): the other processes, largest first, with pid, name and bytes;
//   and this process's own share, split into what this chain holds, what the CUDA context
//   reserves for kernels (`context`: the per-thread stack times the threads the device can
//   run at once, the device malloc heap and the printf buffer, from cudaDeviceGetLimit — what
//   the runtime's limits make the driver reserve; the driver's own per-context structures
//   come on top, and are counted with the rest), and the rest (other resources and
//   allocations of this process). When NVML cannot say, `holders` says why in one plain
//   sentence (no library, no permission, a container whose process ids are not this
//   process's). Host memory and simulated devices have no holders (`holders` is empty).
//   `held_ahead`: what this process's vm_resources hold of the device ahead of need.
// - Advice that fits. `hint()` is written for the resource the verdict concerns: the report
//   asks, in turn, the resource that failed first (`origin`), the one the verdict points at
//   (the limiting resource over budget, the pool whose blocks are too small), then every
//   resource of the chain from the top, for its own advice (`memory_resource::oom_hint`, a
//   virtual a resource overrides to say what its options and calls can do); the first answer
//   is the hint. If none answers, the hint is the general one for the verdict.
// - `to_text()` is one short paragraph in human units (B, KiB, MiB, GiB): the request, the
//   device (free, total, held by this chain, held by others and who they are), each resource
//   of the chain, the verdict with the numbers that decided it, and the hint. `to_json()` is
//   the same as one JSON object (all figures in bytes).
// - Making a report never throws for lack of a device or of NVML: figures it cannot get are
//   left empty. The first report on a real device loads NVML (tens of milliseconds, once per
//   process); set CUDAMEM_NO_NVML to skip it.
// - Throwing an `out_of_memory` never allocates device memory; building the report queries the
//   device's free/total memory (cudaMemGetInfo) and who holds it (NVML) when the memory is
//   device-side.
// - `throw_out_of_memory(resource, ...)` is for the resource that failed;
//   `rethrow_out_of_memory(resource, ..., below)` for one passing on a failure from below
//   (adaptors): the report then starts at it and keeps the cause, the verdict and which
//   resource failed first.
// - An owner that will catch its upstream's failure and try something else (a pool growing, a
//   vm_pool giving chunks back and asking again) opens a `detail::discarded_report_scope` for
//   that upstream: a failure the upstream throws itself (throw_out_of_memory) then carries
//   only its cause (no chain, no NVML query: ~250 µs on an H100, saved at each failed growth),
//   and the owner reports from itself if it fails in the end. A failure passed on from below
//   (rethrow_out_of_memory: adaptors) and every resource further down still build whole
//   reports, so a retry_adaptor's callback or a log sees what it always saw.
//
// Parts (detail/report/; each opens with what it owns)
//   figures.hpp   what is measured: memory_report, resource_snapshot, the holders' figures,
//                 format_bytes
//   holders.hpp   who holds the device: NVML's processes, the context's reservations
//   verdict.hpp   the verdict and the advice (diagnose, explanation, hint, ask_for_hint)
//   text.hpp      to_text and to_json
// Here: measuring a chain and the device into a report (make_memory_report), and throwing it.
// out_of_memory.hpp needs only figures, verdict and text: carrying a report asks nothing.
#pragma once

#include <cudamem/detail/held_ahead.hpp>
#include <cudamem/detail/json.hpp>
#include <cudamem/detail/nvml/nvml.hpp>
#include <cudamem/detail/report/figures.hpp>
#include <cudamem/detail/report/holders.hpp>
#include <cudamem/detail/report/text.hpp>
#include <cudamem/detail/report/verdict.hpp>
#include <cudamem/memory_resource.hpp>
#include <cudamem/out_of_memory.hpp>

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdio>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace cudamem {

namespace detail {

/// make_memory_report's work, for throw_out_of_memory and rethrow_out_of_memory too:
/// `verdict`, when given, replaces the diagnosis; `origin_below_top` is how far below
/// `resource` the resource that failed first sits (0: `resource` itself).
inline memory_report build_report(const memory_resource& resource, std::size_t bytes,
                                  std::size_t alignment, std::string cause,
                                  std::optional<oom_verdict> verdict,
                                  std::size_t origin_below_top) {
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
      try {
        report.holders = find_holders(leaf->device());
        report.context = find_context_reservations(leaf->device());
      } catch (...) {  // out of host memory: the report goes without the holders
      }
    }
    if (previous >= 0) {
      static_cast<void>(cudaSetDevice(previous));
    }
    static_cast<void>(cudaGetLastError());
  }
  report.verdict = verdict ? *verdict : diagnose(report);
  ask_for_hint(report, resources);
  return report;
}

}  // namespace detail

/// A report on `resource` and its upstreams for a request of `bytes` (see the contract).
[[nodiscard]] inline memory_report make_memory_report(const memory_resource& resource,
                                                      std::size_t bytes,
                                                      std::size_t alignment = default_alignment,
                                                      std::string cause = {}) {
  return detail::build_report(resource, bytes, alignment, std::move(cause), std::nullopt, 0);
}

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

/// Builds the report for a failed request to `resource` and throws it. `cause` is a short
/// line from the resource that failed ("cudaMalloc returned cudaErrorMemoryAllocation");
/// `verdict`, when given, replaces the report's own diagnosis.
[[noreturn]] inline void throw_out_of_memory(const memory_resource& resource, std::size_t bytes,
                                             std::size_t alignment, std::string cause = {},
                                             std::optional<oom_verdict> verdict = std::nullopt) {
  if (&resource == detail::report_discarded_for) [[unlikely]] {
    throw out_of_memory(
        detail::cause_only_report(resource, bytes, alignment, std::move(cause), verdict));
  }
  throw out_of_memory(
      detail::build_report(resource, bytes, alignment, std::move(cause), verdict, 0));
}

/// For a resource passing on the failure of one below it: throws a report that starts at
/// `resource` (so it shows the whole chain from there) and keeps what `below` knew — its
/// cause, its verdict, and which resource failed first.
[[noreturn]] inline void rethrow_out_of_memory(const memory_resource& resource, std::size_t bytes,
                                               std::size_t alignment, const memory_report& below) {
  // The resources from the one that failed down to the leaf are the same in both chains.
  const std::size_t from_leaf = below.chain.empty() ? 0 : below.chain.size() - 1 - below.origin;
  std::size_t depth = 0;
  for (const memory_resource* r = resource.upstream(); r != nullptr; r = r->upstream()) {
    ++depth;
  }
  throw out_of_memory(detail::build_report(resource, bytes, alignment, below.cause,
                                           below.verdict, depth >= from_leaf ? depth - from_leaf : 0));
}

}  // namespace cudamem
