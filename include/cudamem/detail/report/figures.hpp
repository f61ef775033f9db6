// cudamem/detail/report/figures.hpp — what a memory_report holds: the request, each resource
// of the chain as it was (its resource_stats), the device's free and total memory, who holds
// the device, what this process's context reserves, and the figures derived from them (what
// the chain holds, what others hold, what no process accounts for). Nothing here asks the
// device or decides anything: this is what an out_of_memory carries.
//
// Part of memory_report.hpp, whose contract says what each figure means. The struct declares
// its whole surface; each member is defined in the part it belongs to:
//   here                        held_by_chain, held_by_others, process_outside_chain,
//                               unattributed (the figures derived from the others)
//   detail/report/measure.hpp   verdict_subject
//   detail/report/verdict.hpp   explanation, hint, general_hint
//   detail/report/text.hpp      to_text, to_json
// The last two are memory_report.hpp's parts: include it to read a report's text and advice.
// Filling one in is measure.hpp's (the chain and the device) and memory_report.hpp's (the
// holders from NVML, detail/report/holders.hpp).
#pragma once

#include <cudamem/detail/report/oom_throw.hpp>
#include <cudamem/memory_resource.hpp>

#include <cstddef>
#include <cstdio>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace cudamem {

/// Why a request failed: memory_report.hpp's contract says what each means;
/// detail/report/verdict.hpp decides it.
enum class oom_verdict {
  unknown,             ///< not enough information (e.g. no device to ask)
  budget,              ///< a limiting resource's budget would be exceeded
  larger_than_device,  ///< the request is larger than the device's total memory
  fragmentation,       ///< enough is free, but not in one piece
  held_by_others,      ///< memory the chain does not hold is more than what it holds
  exhausted,           ///< the chain itself holds the memory
};

/// The verdict's name, as reports print it: "budget", "fragmentation", ...
[[nodiscard]] constexpr std::string_view to_string(oom_verdict verdict) noexcept {
  switch (verdict) {
    case oom_verdict::budget: return "budget";
    case oom_verdict::larger_than_device: return "larger_than_device";
    case oom_verdict::fragmentation: return "fragmentation";
    case oom_verdict::held_by_others: return "held_by_others";
    case oom_verdict::exhausted: return "exhausted";
    case oom_verdict::unknown: return "unknown";
  }
  return "unknown";
}

#if CUDAMEM_DEFINITIONS_IN_HEADERS
/// "1.50 GiB", "512 B": bytes in the largest binary unit that keeps the number >= 1.
/// (Declared in oom_throw.hpp; in compiled mode defined in the library alone.)
CUDAMEM_DEFINITION std::string format_bytes(std::size_t bytes) {
  static constexpr const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  double value = static_cast<double>(bytes);
  std::size_t unit = 0;
  while (value >= 1024.0 && unit + 1 < std::size(units)) {
    value /= 1024.0;
    ++unit;
  }
  char text[48];
  if (unit == 0) {
    std::snprintf(text, sizeof text, "%zu B", bytes);
  } else {
    std::snprintf(text, sizeof text, "%.2f %s", value, units[unit]);
  }
  return text;
}
#endif

/// One resource of the chain, as it was when the report was made.
struct resource_snapshot {
  std::string name;                        ///< the resource's name()
  memory_kind kind = memory_kind::device;  ///< its kind()
  int device = -1;                         ///< its device()
  resource_stats stats;                    ///< its stats()
};

/// A process that holds device memory, as NVML reports it.
struct process_holding {
  unsigned int pid = 0;              ///< the process id
  std::string name;                  ///< empty when it could not be found out
  std::optional<std::size_t> bytes;  ///< empty when NVML does not say (e.g. Windows' WDDM)
};

/// Who holds the device's memory, from NVML (found by detail/report/holders.hpp).
struct device_holders {
  bool listed = false;   ///< NVML listed the processes and this one among them
  std::string reason;    ///< when not listed: why, in one plain sentence
  unsigned int this_pid = 0;                ///< this process's id
  std::optional<std::size_t> this_process;  ///< what NVML says this process holds
  std::vector<process_holding> others;      ///< the other processes, largest first (when not
                                            ///< listed but hidden: their ids, no names)

  /// What the other processes hold together.
  [[nodiscard]] std::size_t others_bytes() const noexcept {
    std::size_t sum = 0;
    for (const process_holding& p : others) {
      sum += p.bytes.value_or(0);
    }
    return sum;
  }
};

/// What the CUDA context reserves for kernels, from the runtime's limits (found by
/// detail/report/holders.hpp).
struct context_reservations {
  std::size_t stack_per_thread = 0;  ///< cudaLimitStackSize
  std::size_t threads = 0;           ///< threads the device runs at once (SMs x per SM)
  std::size_t heap_bytes = 0;        ///< cudaLimitMallocHeapSize
  std::size_t printf_bytes = 0;      ///< cudaLimitPrintfFifoSize

  /// Stack for every thread the device runs at once: stack_per_thread * threads.
  [[nodiscard]] std::size_t stack_bytes() const noexcept { return stack_per_thread * threads; }
  /// All of it: stack, heap and printf FIFO.
  [[nodiscard]] std::size_t total() const noexcept {
    return stack_bytes() + heap_bytes + printf_bytes;
  }
};

/// A diagnosis of a (failed) request; see memory_report.hpp's contract.
struct memory_report {
  std::size_t requested_bytes = 0;            ///< bytes of the request that failed
  std::size_t alignment = 0;                  ///< its alignment
  int device = -1;                            ///< -1: host memory, or a simulated device
  std::optional<std::size_t> device_free;     ///< bytes free on the device now
  std::optional<std::size_t> device_total;    ///< the device's total memory
  std::vector<resource_snapshot> chain;       ///< the resource asked first, then its upstreams
  oom_verdict verdict = oom_verdict::unknown;  ///< why it failed (see the contract)
  std::string cause;                          ///< what the failing resource said
  std::size_t origin = 0;                     ///< chain[origin] failed first (0: the top)
  std::optional<device_holders> holders;      ///< who holds the device (real devices only)
  std::optional<context_reservations> context;  ///< this process's context (real devices)
  std::string resource_hint;                  ///< a resource's own advice (see hint())
  /// Device memory this process's vm_resources hold ahead of need (detail/held_ahead.hpp) as
  /// the report is made: a failing resource asked them to give it back first, so after a
  /// failure it is what they made again since. Empty for host memory.
  std::optional<std::size_t> held_ahead;

  /// Bytes the chain's leaf holds from the device (what "this process" holds through it).
  /// Plus what resources of the chain hold beside it (resource_stats::held_beside).
  [[nodiscard]] std::size_t held_by_chain() const noexcept {
    std::size_t beside = 0;
    for (const resource_snapshot& r : chain) {
      beside += r.stats.held_beside;
    }
    return chain.empty() ? 0 : chain.back().stats.reserved_bytes + beside;
  }

  /// Device memory in use that this chain does not hold (other processes, contexts and
  /// resources); empty without device figures.
  [[nodiscard]] std::optional<std::size_t> held_by_others() const noexcept {
    if (!device_total || !device_free) {
      return std::nullopt;
    }
    const std::size_t used = *device_total > *device_free ? *device_total - *device_free : 0;
    return used > held_by_chain() ? used - held_by_chain() : 0;
  }

  /// What this process holds on the device outside this chain (NVML's figure for it less the
  /// chain's): its context, other resources, other allocations. Empty without NVML.
  [[nodiscard]] std::optional<std::size_t> process_outside_chain() const noexcept {
    if (!holders || !holders->this_process) {
      return std::nullopt;
    }
    return *holders->this_process > held_by_chain() ? *holders->this_process - held_by_chain()
                                                    : 0;
  }

  /// Device memory in use that no process accounts for (the driver's own reservations, or
  /// processes NVML does not show). Empty unless the processes were listed.
  [[nodiscard]] std::optional<std::size_t> unattributed() const noexcept {
    if (!holders || !holders->listed || !device_total || !device_free) {
      return std::nullopt;
    }
    const std::size_t used = *device_total > *device_free ? *device_total - *device_free : 0;
    const std::size_t named = holders->others_bytes() + holders->this_process.value_or(0);
    return used > named ? used - named : 0;
  }

  // The verdict's subject: detail/report/measure.hpp; the advice: detail/report/verdict.hpp.
  /// The position in `chain` the verdict points at: the resource over its budget, the pool
  /// whose free blocks are too small, the leaf for the device's own fragmentation; nothing
  /// for the other verdicts.
  [[nodiscard]] inline std::optional<std::size_t> verdict_subject() const noexcept;
  /// One sentence with the numbers behind the verdict.
  [[nodiscard]] inline std::string explanation() const;
  /// The advice that fits the resource and the verdict: a resource's own (`resource_hint`,
  /// see memory_report.hpp's contract), else the general one for the verdict.
  [[nodiscard]] inline std::string hint() const;
  /// The advice for the verdict that holds whatever the resource.
  [[nodiscard]] inline std::string general_hint() const;

  // The text: detail/report/text.hpp.
  /// A short paragraph: the request, the device, the chain, the verdict and its hint.
  [[nodiscard]] inline std::string to_text() const;
  /// The report as a JSON object.
  [[nodiscard]] inline std::string to_json() const;

 private:
  // Defined with what uses them: quote and the holders' text in detail/report/text.hpp, the
  // general hints in detail/report/verdict.hpp.
  static inline std::string quote(std::string_view s);

  /// "pid 4242 (python3) 6.50 GiB"
  static std::string describe(const process_holding& p) {
    std::string text = "pid " + std::to_string(p.pid);
    if (!p.name.empty()) {
      text += " (" + p.name + ")";
    }
    return text + " " + (p.bytes ? format_bytes(*p.bytes) : std::string("(bytes not reported)"));
  }

  /// The sentences that name the holders (empty when none were asked for).
  [[nodiscard]] inline std::string holders_text() const;
  [[nodiscard]] inline std::string holders_json() const;
  [[nodiscard]] inline std::string context_json() const;
  /// fragmentation's general hint: about the pool whose blocks are too small, or the device.
  [[nodiscard]] inline std::string fragmentation_hint() const;
  /// held_by_others' general hint, from what the holders say.
  [[nodiscard]] inline std::string held_by_others_hint() const;
};

namespace detail {

/// How every out-of-memory text opens, with or without the whole report: "cudamem: out of
/// memory: could not allocate 2.00 GiB (alignment 512) on device 0. <cause>."
[[nodiscard]] inline std::string request_sentences(const memory_report& r) {
  std::string text =
      "cudamem: out of memory: could not allocate " + format_bytes(r.requested_bytes);
  if (r.alignment != 0) {
    text += " (alignment " + std::to_string(r.alignment) + ")";
  }
  if (r.device >= 0) {
    text += " on device " + std::to_string(r.device);
  }
  text += ".";
  if (!r.cause.empty()) {
    text += " " + r.cause + ".";
  }
  return text;
}

}  // namespace detail

}  // namespace cudamem
