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
// - Throwing one (`throw_out_of_memory`, `rethrow_out_of_memory`) is out_of_memory.hpp's.
//   Including this header anywhere in a program makes every out_of_memory the program throws
//   carry the whole report, holders and advice included, with to_text() as its what(): the
//   parts a report needs only to be formatted are compiled here, not in every file that
//   declares a buffer (out_of_memory.hpp's contract says what a report is without them).
//
// Parts (detail/report/; each opens with what it owns)
//   figures.hpp   what is measured: memory_report, resource_snapshot, the holders' figures,
//                 format_bytes
//   measure.hpp   measuring a chain and the device into a report, the verdict (diagnose), and
//                 the completion this header registers
//   holders.hpp   who holds the device: NVML's processes, the context's reservations
//   verdict.hpp   the explanation and the advice (explanation, hint, ask_for_hint)
//   text.hpp      to_text and to_json
// Here: the whole report (make_memory_report) and its registration.
#pragma once

#include <cudamem/detail/json.hpp>
#include <cudamem/detail/nvml/nvml.hpp>
#include <cudamem/detail/report/figures.hpp>
#include <cudamem/detail/report/holders.hpp>
#include <cudamem/detail/report/measure.hpp>
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

/// The whole report's completion (detail/report/measure.hpp): holders, advice and text.
inline void find_report_holders(memory_report& report, int device) noexcept {
  try {
    report.holders = find_holders(device);
    report.context = find_context_reservations(device);
  } catch (...) {  // out of host memory: the report goes without the holders
  }
}

inline void advise_report(memory_report& report,
                          const std::vector<const memory_resource*>& resources) noexcept {
  try {
    ask_for_hint(report, resources);
  } catch (...) {  // out of host memory: the report goes with the general hint
  }
}

[[nodiscard]] inline std::string whole_report_text(const memory_report& report) {
  return report.to_text();
}

inline constexpr report_completion whole_report{&find_report_holders, &advise_report,
                                                &whole_report_text};

/// Every translation unit that includes this header registers the whole report as the program
/// starts (they all register the same one).
inline const bool whole_report_registered = register_report_completion(whole_report);

}  // namespace detail

/// A report on `resource` and its upstreams for a request of `bytes` (see the contract).
[[nodiscard]] inline memory_report make_memory_report(const memory_resource& resource,
                                                      std::size_t bytes,
                                                      std::size_t alignment = default_alignment,
                                                      std::string cause = {}) {
  return detail::measure_report(resource, bytes, alignment, std::move(cause), std::nullopt, 0,
                                &detail::whole_report);
}

}  // namespace cudamem
