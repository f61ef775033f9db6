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
//                         holds: other processes, this process's context and other resources)
//                         is more than what the chain holds;
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
#pragma once

#include <cudamem/detail/held_ahead.hpp>
#include <cudamem/detail/json.hpp>
#include <cudamem/detail/nvml/nvml.hpp>
#include <cudamem/memory_resource.hpp>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstddef>
#include <cstdio>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace cudamem {

/// Why a request failed; see the contract above.
enum class oom_verdict { unknown, budget, larger_than_device, fragmentation, held_by_others, exhausted };

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

/// "1.50 GiB", "512 B": bytes in the largest binary unit that keeps the number >= 1.
[[nodiscard]] inline std::string format_bytes(std::size_t bytes) {
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

/// One resource of the chain, as it was when the report was made.
struct resource_snapshot {
  std::string name;
  memory_kind kind = memory_kind::device;
  int device = -1;
  resource_stats stats;
};

/// A process that holds device memory, as NVML reports it.
struct process_holding {
  unsigned int pid = 0;
  std::string name;                  ///< empty when it could not be found out
  std::optional<std::size_t> bytes;  ///< empty when NVML does not say (e.g. Windows' WDDM)
};

/// Who holds the device's memory, from NVML; see the contract above.
struct device_holders {
  bool listed = false;   ///< NVML listed the processes and this one among them
  std::string reason;    ///< when not listed: why, in one plain sentence
  unsigned int this_pid = 0;
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

/// What the CUDA context reserves for kernels, from the runtime's limits; see the contract.
struct context_reservations {
  std::size_t stack_per_thread = 0;  ///< cudaLimitStackSize
  std::size_t threads = 0;           ///< threads the device runs at once (SMs x per SM)
  std::size_t heap_bytes = 0;        ///< cudaLimitMallocHeapSize
  std::size_t printf_bytes = 0;      ///< cudaLimitPrintfFifoSize

  [[nodiscard]] std::size_t stack_bytes() const noexcept { return stack_per_thread * threads; }
  [[nodiscard]] std::size_t total() const noexcept {
    return stack_bytes() + heap_bytes + printf_bytes;
  }
};

/// A diagnosis of a (failed) request; see the contract above.
struct memory_report {
  std::size_t requested_bytes = 0;
  std::size_t alignment = 0;
  int device = -1;                            ///< -1: host memory, or a simulated device
  std::optional<std::size_t> device_free;     ///< bytes free on the device now
  std::optional<std::size_t> device_total;    ///< the device's total memory
  std::vector<resource_snapshot> chain;       ///< the resource asked first, then its upstreams
  oom_verdict verdict = oom_verdict::unknown;
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
  [[nodiscard]] std::size_t held_by_chain() const noexcept {
    return chain.empty() ? 0 : chain.back().stats.reserved_bytes;
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

  /// The position in `chain` the verdict points at: the resource over its budget, the pool
  /// whose free blocks are too small, the leaf for the device's own fragmentation; nothing
  /// for the other verdicts.
  [[nodiscard]] std::optional<std::size_t> verdict_subject() const noexcept {
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

  /// One sentence with the numbers behind the verdict.
  [[nodiscard]] std::string explanation() const {
    switch (verdict) {
      case oom_verdict::budget:
        for (const resource_snapshot& r : chain) {
          if (r.stats.budget && r.stats.used_bytes + requested_bytes > *r.stats.budget) {
            return r.name + " has " + format_bytes(r.stats.used_bytes) + " in use; " +
                   format_bytes(requested_bytes) + " more would pass its budget of " +
                   format_bytes(*r.stats.budget) + ".";
          }
        }
        return "A budget in the chain would be exceeded.";
      case oom_verdict::larger_than_device:
        return "The request is larger than the device's " +
               (device_total ? format_bytes(*device_total) : std::string("memory")) + ".";
      case oom_verdict::fragmentation:
        for (const resource_snapshot& r : chain) {
          if (r.stats.largest_free_block && *r.stats.largest_free_block < requested_bytes) {
            const std::size_t free =
                &r == &chain.back() && device_free ? *device_free : r.stats.free_bytes();
            return r.name + " has " + format_bytes(free) +
                   " free in total, but its largest free block is " +
                   format_bytes(*r.stats.largest_free_block) + ".";
          }
        }
        if (device_free) {
          return "The device has " + format_bytes(*device_free) + " free, enough for " +
                 format_bytes(requested_bytes) + ", but no free range that large.";
        }
        return "Enough memory is free, but not in one piece.";
      case oom_verdict::held_by_others: {
        std::string text = format_bytes(held_by_others().value_or(0)) +
                           " of the device is held outside this chain, against " +
                           format_bytes(held_by_chain()) + " held by it";
        if (holders && holders->listed) {
          text += ": " + format_bytes(holders->others_bytes()) + " by other processes, " +
                  format_bytes(process_outside_chain().value_or(0)) +
                  " by this process outside this chain";
        }
        return text + ".";
      }
      case oom_verdict::exhausted:
        return "This chain holds " + format_bytes(held_by_chain()) +
               (device_total ? " of the device's " + format_bytes(*device_total) : std::string()) +
               ".";
      case oom_verdict::unknown:
        break;
    }
    return "The device's free and total memory are not known.";
  }

  /// The advice that fits the resource and the verdict: a resource's own (`resource_hint`,
  /// see the contract), else the general one for the verdict.
  [[nodiscard]] std::string hint() const {
    return resource_hint.empty() ? general_hint() : resource_hint;
  }

  /// The advice for the verdict that holds whatever the resource.
  [[nodiscard]] std::string general_hint() const {
    switch (verdict) {
      case oom_verdict::budget:
        return "A budget set on this chain would be exceeded: raise the budget, or free "
               "buffers before this request.";
      case oom_verdict::larger_than_device:
        return "No allocator can satisfy this on this device: split the work into smaller "
               "pieces, or use managed memory (managed_resource), which may exceed the device.";
      case oom_verdict::fragmentation:
        return fragmentation_hint();
      case oom_verdict::held_by_others:
        return held_by_others_hint();
      case oom_verdict::exhausted:
        return "This process holds the memory through this resource chain: free buffers you no "
               "longer need, or lower the working set.";
      case oom_verdict::unknown:
        break;
    }
    return "Not enough information to say more (no device to ask).";
  }

  /// A short paragraph: the request, the device, the chain, the verdict and its hint.
  [[nodiscard]] std::string to_text() const {
    std::string text = "cudamem: out of memory: could not allocate " + format_bytes(requested_bytes);
    if (alignment != 0) {
      text += " (alignment " + std::to_string(alignment) + ")";
    }
    if (device >= 0) {
      text += " on device " + std::to_string(device);
    }
    text += ".";
    if (!cause.empty()) {
      text += " " + cause + ".";
    }
    if (device_free && device_total) {
      text += " Device: " + format_bytes(*device_free) + " free of " + format_bytes(*device_total) +
              "; this chain holds " + format_bytes(held_by_chain()) + ", others (processes, " +
              "contexts, other resources) hold " + format_bytes(held_by_others().value_or(0)) +
              ".";
    }
    if (held_ahead && *held_ahead != 0) {
      text += " vm_resources of this process hold " + format_bytes(*held_ahead) +
              " of the device ahead of need (trim() gives it back).";
    }
    text += holders_text();
    for (const resource_snapshot& r : chain) {
      text += " " + r.name + ": " + format_bytes(r.stats.reserved_bytes) + " reserved, " +
              format_bytes(r.stats.used_bytes) + " in use";
      if (r.stats.largest_free_block) {
        char frag[32];
        std::snprintf(frag, sizeof frag, "%.0f%%", 100.0 * r.stats.fragmentation());
        text += ", largest free block " + format_bytes(*r.stats.largest_free_block) +
                ", fragmentation " + frag;
      }
      if (r.stats.budget) {
        text += ", budget " + format_bytes(*r.stats.budget);
      }
      text += ".";
    }
    text += " Verdict: " + std::string(to_string(verdict)) + ". " + explanation() + " " +
            hint();
    return text;
  }

  /// The report as a JSON object.
  [[nodiscard]] std::string to_json() const {
    auto number = [](std::optional<std::size_t> v) {
      return v ? std::to_string(*v) : std::string("null");
    };
    std::string json = "{\"requested_bytes\":" + std::to_string(requested_bytes) +
                       ",\"alignment\":" + std::to_string(alignment) +
                       ",\"device\":" + std::to_string(device) +
                       ",\"device_free\":" + number(device_free) +
                       ",\"device_total\":" + number(device_total) + ",\"verdict\":\"" +
                       std::string(to_string(verdict)) + "\",\"cause\":" + quote(cause) +
                       ",\"explanation\":" + quote(explanation()) + ",\"hint\":" + quote(hint()) +
            ",\"held_by_chain\":" + std::to_string(held_by_chain()) +
            ",\"held_by_others\":" + number(held_by_others()) +
            ",\"held_ahead\":" + number(held_ahead) +
            ",\"origin\":" + std::to_string(origin) + ",\"holders\":" + holders_json() +
            ",\"context\":" + context_json() + ",\"chain\":[";
    for (std::size_t i = 0; i < chain.size(); ++i) {
      const resource_snapshot& r = chain[i];
      char frag[32];
      std::snprintf(frag, sizeof frag, "%.6f", r.stats.fragmentation());
      json += (i == 0 ? "" : ",");
      json += "{\"name\":" + quote(r.name) + ",\"kind\":" + quote(std::string(to_string(r.kind))) +
              ",\"device\":" + std::to_string(r.device) +
              ",\"reserved_bytes\":" + std::to_string(r.stats.reserved_bytes) +
              ",\"used_bytes\":" + std::to_string(r.stats.used_bytes) +
              ",\"peak_used_bytes\":" + std::to_string(r.stats.peak_used_bytes) +
              ",\"free_blocks\":" + number(r.stats.free_blocks) +
              ",\"largest_free_block\":" + number(r.stats.largest_free_block) +
              ",\"fragmentation\":" + frag + ",\"budget\":" + number(r.stats.budget) +
              ",\"capacity\":" + number(r.stats.capacity) +
              ",\"held_elsewhere\":" + number(r.stats.held_elsewhere) + "}";
    }
    json += "]}";
    return json;
  }

 private:
  static std::string quote(std::string_view s) { return detail::json_quote(s); }

  /// "pid 4242 (python3) 6.50 GiB"
  static std::string describe(const process_holding& p) {
    std::string text = "pid " + std::to_string(p.pid);
    if (!p.name.empty()) {
      text += " (" + p.name + ")";
    }
    return text + " " + (p.bytes ? format_bytes(*p.bytes) : std::string("(bytes not reported)"));
  }

  /// The sentences that name the holders (empty when none were asked for).
  [[nodiscard]] std::string holders_text() const {
    if (!holders) {
      return {};
    }
    const device_holders& h = *holders;
    if (!h.listed && h.others.empty()) {
      return " Which processes hold the device's memory is not known: " + h.reason + ".";
    }
    std::string text;
    if (!h.listed) {  // hidden: ids that cannot be matched here
      text += " NVML reports " + std::to_string(h.others.size()) + " process" +
              (h.others.size() == 1 ? "" : "es") + " holding " + format_bytes(h.others_bytes()) +
              ", but cannot name them: " + h.reason + ".";
      return text;
    }
    if (h.others.empty()) {
      text += " No other process uses the device.";
    } else {
      text += " Other processes: ";
      for (std::size_t i = 0; i < h.others.size(); ++i) {
        text += (i == 0 ? "" : ", ") + describe(h.others[i]);
      }
      text += ".";
    }
    if (h.this_process) {
      const std::size_t outside = process_outside_chain().value_or(0);
      text += " This process (pid " + std::to_string(h.this_pid) + ") holds " +
              format_bytes(*h.this_process) + ": " + format_bytes(held_by_chain()) +
              " through this chain";
      if (context) {
        const std::size_t reserved = std::min(context->total(), outside);
        text += ", " + format_bytes(reserved) + " reserved by its CUDA context for kernels (" +
                "stacks " + format_bytes(context->stack_per_thread) + " x " +
                std::to_string(context->threads) + " threads, malloc heap " +
                format_bytes(context->heap_bytes) + ", printf " +
                format_bytes(context->printf_bytes) + "), " + format_bytes(outside - reserved) +
                " otherwise (other resources and allocations of this process, the driver's "
                "structures for its context)";
      } else {
        text += ", " + format_bytes(outside) + " otherwise (its CUDA context, other resources "
                "and allocations)";
      }
      text += ".";
    }
    if (const auto rest = unattributed(); rest && *rest > 0) {
      text += " No process accounts for " + format_bytes(*rest) +
              " (the driver's own reservations).";
    }
    return text;
  }

  [[nodiscard]] std::string holders_json() const {
    if (!holders) {
      return "null";
    }
    const device_holders& h = *holders;
    auto number = [](std::optional<std::size_t> v) {
      return v ? std::to_string(*v) : std::string("null");
    };
    std::string json = std::string("{\"listed\":") + (h.listed ? "true" : "false") +
                       ",\"reason\":" + quote(h.reason) +
                       ",\"this_pid\":" + std::to_string(h.this_pid) +
                       ",\"this_process\":" + number(h.this_process) +
                       ",\"process_outside_chain\":" + number(process_outside_chain()) +
                       ",\"unattributed\":" + number(unattributed()) + ",\"others\":[";
    for (std::size_t i = 0; i < h.others.size(); ++i) {
      json += (i == 0 ? "" : ",");
      json += "{\"pid\":" + std::to_string(h.others[i].pid) + ",\"name\":" +
              quote(h.others[i].name) + ",\"bytes\":" + number(h.others[i].bytes) + "}";
    }
    return json + "]}";
  }

  [[nodiscard]] std::string context_json() const {
    if (!context) {
      return "null";
    }
    return "{\"stack_per_thread\":" + std::to_string(context->stack_per_thread) +
           ",\"threads\":" + std::to_string(context->threads) +
           ",\"stack_bytes\":" + std::to_string(context->stack_bytes()) +
           ",\"heap_bytes\":" + std::to_string(context->heap_bytes) +
           ",\"printf_bytes\":" + std::to_string(context->printf_bytes) +
           ",\"total\":" + std::to_string(context->total()) + "}";
  }

  /// fragmentation's general hint: about the pool whose blocks are too small, or the device.
  [[nodiscard]] std::string fragmentation_hint() const {
    const auto subject = verdict_subject();
    if (subject && *subject + 1 < chain.size()) {  // a pool over an upstream
      const resource_snapshot& pool = chain[*subject];
      std::string text = pool.name + " has " + format_bytes(pool.stats.free_bytes()) +
                         " free, in blocks of at most " +
                         format_bytes(pool.stats.largest_free_block.value_or(0)) +
                         ": what is free lies between blocks still in use. Free long-lived "
                         "blocks, or allocate the largest buffers first";
      // A leaf that keeps free ranges of its own manages its address space (virtual memory):
      // moving to a pool that remaps would change nothing.
      if (!chain.back().stats.largest_free_block) {
        text += ", or use vm_pool_resource, which maps free physical memory behind one fresh "
                "range wherever the frees left it";
      }
      return text + ".";
    }
    return "Enough memory is free but not in one piece" +
           (device_free ? " (" + format_bytes(*device_free) + " on the device)" : std::string()) +
           ": allocate the largest buffers first, take memory early in large chunks (a pool "
           "with initial_size), and free long-lived blocks.";
  }

  /// held_by_others' general hint, from what the holders say.
  [[nodiscard]] std::string held_by_others_hint() const {
    if (holders && holders->listed) {
      const std::size_t others = holders->others_bytes();
      const std::size_t mine = process_outside_chain().value_or(0);
      if (others >= mine && !holders->others.empty()) {
        return "Other processes hold most of it (the largest: " + describe(holders->others[0]) +
               "): stop or wait for them, or run on another GPU (CUDA_VISIBLE_DEVICES).";
      }
      std::string text = "This process holds " + format_bytes(mine) +
                         " outside this chain: release other pools and resources (release()), "
                         "free buffers allocated without this chain, destroy contexts you no "
                         "longer need";
      if (context && context->stack_per_thread > 1024) {
        text += ", and lower cudaLimitStackSize (" + format_bytes(context->stack_per_thread) +
                " per thread reserves " + format_bytes(context->stack_bytes()) + ")";
      }
      return text + ".";
    }
    return "Memory outside this resource chain stands in the way: check nvidia-smi for other "
           "processes, destroy contexts you no longer need, and release other pools.";
  }
};

namespace detail {

/// Decides the verdict from the figures already in `r`.
inline oom_verdict diagnose(const memory_report& r) {
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

/// Who holds the memory of CUDA device `device` (current already), from NVML.
inline device_holders find_holders(int device) {
  device_holders h;
  h.this_pid = nvml::this_process_id();
  char bus_id[64] = {};
  if (cudaDeviceGetPCIBusId(bus_id, static_cast<int>(sizeof bus_id), device) != cudaSuccess) {
    static_cast<void>(cudaGetLastError());
    h.reason = "the device's PCI bus id is not known (cudaDeviceGetPCIBusId failed)";
    return h;
  }
  nvml::device_processes found = nvml::list_processes(nvml::process_library(), bus_id, h.this_pid);
  h.listed = found.status == nvml::listing::listed;
  h.reason = std::move(found.reason);
  for (nvml::process_usage& p : found.processes) {
    if (h.listed && p.pid == h.this_pid) {
      h.this_process = p.bytes;
    } else {
      h.others.push_back({p.pid, std::move(p.name), p.bytes});
    }
  }
  return h;
}

/// What the context on the current device reserves for kernels (see the contract).
inline std::optional<context_reservations> find_context_reservations(int device) {
  context_reservations c;
  std::size_t stack = 0;
  std::size_t heap = 0;
  std::size_t fifo = 0;
  int sms = 0;
  int per_sm = 0;
  if (cudaDeviceGetLimit(&stack, cudaLimitStackSize) != cudaSuccess ||
      cudaDeviceGetLimit(&heap, cudaLimitMallocHeapSize) != cudaSuccess ||
      cudaDeviceGetLimit(&fifo, cudaLimitPrintfFifoSize) != cudaSuccess ||
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&per_sm, cudaDevAttrMaxThreadsPerMultiProcessor, device) !=
          cudaSuccess) {
    static_cast<void>(cudaGetLastError());
    return std::nullopt;
  }
  c.stack_per_thread = stack;
  c.threads = static_cast<std::size_t>(sms) * static_cast<std::size_t>(per_sm);
  c.heap_bytes = heap;
  c.printf_bytes = fifo;
  return c;
}

/// Asks the chain's resources for their own advice, in the order of the contract; the first
/// answer becomes `r.resource_hint`. A resource that throws while answering is skipped.
inline void ask_for_hint(memory_report& r, const std::vector<const memory_resource*>& resources) {
  std::vector<std::size_t> order;
  order.push_back(r.origin);
  if (const auto subject = r.verdict_subject()) {
    order.push_back(*subject);
  }
  for (std::size_t i = 0; i < resources.size(); ++i) {
    order.push_back(i);
  }
  std::vector<bool> asked(resources.size(), false);
  for (const std::size_t i : order) {
    if (i >= resources.size() || asked[i]) {
      continue;
    }
    asked[i] = true;
    try {
      std::string advice = resources[i]->oom_hint(r, i);
      if (!advice.empty()) {
        r.resource_hint = std::move(advice);
        return;
      }
    } catch (...) {  // a resource that cannot advise leaves the rest of the report useful
    }
  }
}

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
  report.origin = std::min(origin_below_top, report.chain.size() - 1);
  const resource_stats& leaf_stats = report.chain.back().stats;
  if (leaf_stats.capacity) {  // a simulated device: its capacity is the whole device
    report.device_total = *leaf_stats.capacity;
    const std::size_t not_free =
        leaf_stats.reserved_bytes + leaf_stats.held_elsewhere.value_or(0);
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

}  // namespace cudamem
