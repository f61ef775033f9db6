// cudamem/memory_report.hpp — a snapshot of what a chain of resources and the device hold,
// with a verdict on why a request failed. `out_of_memory` carries one; you can also ask for
// one at any time.
//
//   cudamem::memory_report r = cudamem::make_memory_report(pool, 2ull << 30);
//   std::puts(r.to_text().c_str());   // human-readable paragraph
//   write_file("mem.json", r.to_json());
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
//                         holds: other processes, other contexts, other resources) is more than
//                         what the chain holds;
//     exhausted           this chain itself holds the memory;
//     unknown             not enough information (e.g. no device to ask).
// - `to_text()` is one short paragraph in human units (B, KiB, MiB, GiB): the request, the
//   device (free, total, held by this chain, held by others), each resource of the chain, the
//   verdict with the numbers that decided it, and one hint that fits the verdict.
//   `to_json()` is the same as one JSON object (all figures in bytes).
// - Making a report never throws for lack of a device: figures it cannot get are left empty.
#pragma once

#include <cudamem/detail/json.hpp>
#include <cudamem/memory_resource.hpp>

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdio>
#include <optional>
#include <string>
#include <string_view>
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
      case oom_verdict::held_by_others:
        return format_bytes(held_by_others().value_or(0)) +
               " of the device is held outside this chain, against " +
               format_bytes(held_by_chain()) + " held by it.";
      case oom_verdict::exhausted:
        return "This chain holds " + format_bytes(held_by_chain()) +
               (device_total ? " of the device's " + format_bytes(*device_total) : std::string()) +
               ".";
      case oom_verdict::unknown:
        break;
    }
    return "The device's free and total memory are not known.";
  }

  /// The hint that fits the verdict.
  [[nodiscard]] std::string hint() const {
    switch (verdict) {
      case oom_verdict::budget:
        return "The budget set on this resource would be exceeded: raise the budget, or free "
               "buffers before this request.";
      case oom_verdict::larger_than_device:
        return "No allocator can satisfy this on this device: split the work into smaller "
               "pieces, or use managed memory to oversubscribe.";
      case oom_verdict::fragmentation:
        return "Enough memory is free in total but no single free block is large enough: call "
               "release() on the pool to return wholly free blocks, or use a virtual-memory "
               "pool (vm_pool_resource), whose free memory is always usable.";
      case oom_verdict::held_by_others:
        return "Memory outside this resource chain stands in the way: check nvidia-smi for other "
               "processes, destroy contexts you no longer need, and release other pools.";
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
            ",\"held_by_others\":" + number(held_by_others()) + ",\"chain\":[";
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

}  // namespace detail

/// A report on `resource` and its upstreams for a request of `bytes` (see the contract).
[[nodiscard]] inline memory_report make_memory_report(const memory_resource& resource,
                                                      std::size_t bytes,
                                                      std::size_t alignment = default_alignment,
                                                      std::string cause = {}) {
  memory_report report;
  report.requested_bytes = bytes;
  report.alignment = alignment;
  report.device = resource.device();
  report.cause = std::move(cause);
  const memory_resource* leaf = &resource;
  for (const memory_resource* r = &resource; r != nullptr; r = r->upstream()) {
    resource_snapshot snap{std::string(r->name()), r->kind(), r->device(), {}};
    try {
      snap.stats = r->stats();
    } catch (...) {  // a resource that cannot report still leaves the rest of the report useful
    }
    report.chain.push_back(std::move(snap));
    leaf = r;
  }
  const resource_stats& leaf_stats = report.chain.back().stats;
  if (leaf_stats.capacity) {  // a simulated device: its capacity is the whole device
    report.device_total = *leaf_stats.capacity;
    const std::size_t not_free =
        leaf_stats.reserved_bytes + leaf_stats.held_elsewhere.value_or(0);
    report.device_free = *leaf_stats.capacity > not_free ? *leaf_stats.capacity - not_free : 0;
  } else if (leaf->device() >= 0 && leaf->kind() != memory_kind::host &&
             leaf->kind() != memory_kind::pinned) {
    int previous = -1;
    std::size_t free = 0;
    std::size_t total = 0;
    if (cudaGetDevice(&previous) == cudaSuccess && cudaSetDevice(leaf->device()) == cudaSuccess &&
        cudaMemGetInfo(&free, &total) == cudaSuccess) {
      report.device_free = free;
      report.device_total = total;
    }
    if (previous >= 0) {
      static_cast<void>(cudaSetDevice(previous));
    }
    static_cast<void>(cudaGetLastError());
  }
  report.verdict = detail::diagnose(report);
  return report;
}

}  // namespace cudamem
