// cudamem/detail/report/text.hpp — a report written out. `to_text()` is the one paragraph an
// out_of_memory's what() shows, in human units: the request, the device (free, total, held by
// this chain and by others, and who they are), each resource of the chain, the verdict with the
// numbers that decided it, and the hint. `to_json()` is the same as one JSON object, every
// figure in bytes.
//
// Part of memory_report.hpp, which makes to_text() every out_of_memory's what() (see
// measure.hpp). The sentences about the verdict come from detail/report/verdict.hpp.
#pragma once

#include <cudamem/detail/json.hpp>
#include <cudamem/detail/report/figures.hpp>
#include <cudamem/detail/report/verdict.hpp>

#include <cstddef>
#include <cstdio>
#include <optional>
#include <string>
#include <string_view>

namespace cudamem {

// The members of memory_report this part defines; each is declared, with what it says, in
// figures.hpp.

inline std::string memory_report::to_text() const {
  std::string text = detail::request_sentences(*this);
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

inline std::string memory_report::to_json() const {
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
            ",\"held_elsewhere\":" + number(r.stats.held_elsewhere) +
            ",\"held_beside\":" + std::to_string(r.stats.held_beside) + "}";
  }
  json += "]}";
  return json;
}

inline std::string memory_report::quote(std::string_view s) { return detail::json_quote(s); }

inline std::string memory_report::holders_text() const {
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
      const std::size_t reserved = context->total() < outside ? context->total() : outside;
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

inline std::string memory_report::holders_json() const {
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

inline std::string memory_report::context_json() const {
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

}  // namespace cudamem
