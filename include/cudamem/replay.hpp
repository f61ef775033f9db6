// cudamem/replay.hpp — replays a logged run (logging_adaptor's log) through another resource
// stack, usually on a simulated device: "would a pool, an arena, a bigger budget have avoided
// this OOM? what would it have reserved?" — answered on a laptop, for an 80 GiB run.
//
//   std::ifstream in{"run.log"};
//   const std::vector<cudamem::log_event> log = cudamem::read_log(in);
//   cudamem::simulated_resource h100{{.capacity = 80ull << 30}};
//   cudamem::pool_resource pool{h100};
//   const cudamem::replay_result r = cudamem::replay_log(log, pool);
//   std::puts(r.to_text().c_str());      // peaks, and where (if anywhere) it ran out
//
// (`bench_replay LOG --resource pool|arena|direct --capacity 80GiB` does exactly this.)
//
// Contract
// - Events are replayed in log order with the synchronous forms (a log's stream handles mean
//   nothing in another process; a simulated device ignores streams anyway). Logged pointers
//   are mapped to the ones the new stack returns.
// - `A` lines allocate. The first `A` that fails stops the replay (the original program had
//   that memory and went on using it; past that point the replay would be fiction): its event
//   index, time, bytes, verdict and report are in `failure`.
// - `O` lines (requests that failed in the original run) are tried too: if the new stack
//   serves one, it is freed at once and counted in `logged_failures_avoided`; if not, the
//   replay goes on (the original program survived it).
// - `F` lines of pointers the replay does not hold (never logged, or whose allocation was an
//   O) are counted in `unmatched_frees` and skipped.
// - Peaks: `peak_in_use` is the most requested bytes live at once through the replay;
//   `peak_reserved` the most the stack's leaf (the device) held, read after every allocation.
// - Everything still live at the end (or at the failure) is freed, so the stack is left as
//   it was found (bar what a pool keeps cached).
// - With `options.trace`, a counter sample per resource of the chain (its `stats()` in use
//   and reserved) is added every `sample_every` events, and the failure as a marker.
#pragma once

#include <cudamem/log_format.hpp>
#include <cudamem/memory_resource.hpp>
#include <cudamem/memory_report.hpp>  // the whole report, in what a replay shows
#include <cudamem/out_of_memory.hpp>
#include <cudamem/trace_export.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdio>
#include <cstdint>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

namespace cudamem {

/// Where a replay ran out.
struct replay_failure {
  std::size_t event_index = 0;                 ///< 0-based index into the events
  std::uint64_t t_ns = 0;                      ///< the event's time in the original run
  std::size_t bytes = 0;                       ///< bytes of the request that failed
  oom_verdict verdict = oom_verdict::unknown;  ///< the out_of_memory's verdict
  std::string report;                          ///< the out_of_memory's text
};

/// What a `replay` did: how far it got, and what the new stack held.
struct replay_result {
  std::size_t events = 0;                   ///< events replayed (up to and including a failure)
  std::size_t allocations = 0;              ///< successful allocations
  std::size_t frees = 0;                    ///< frees replayed
  std::size_t unmatched_frees = 0;          ///< F lines of pointers not held: skipped
  std::size_t logged_failures = 0;          ///< O lines seen
  std::size_t logged_failures_avoided = 0;  ///< ... that the new stack served
  std::size_t peak_in_use = 0;              ///< most requested bytes live at once
  std::size_t peak_reserved = 0;            ///< most the stack's leaf held
  std::optional<replay_failure> failure;    ///< where it ran out, if it did

  /// A few lines: counts, peaks in human units, and the failure if there was one.
  [[nodiscard]] std::string to_text() const {
    std::string text = "events replayed: " + std::to_string(events) + " (" +
                       std::to_string(allocations) + " allocations, " + std::to_string(frees) +
                       " frees";
    if (unmatched_frees != 0) {
      text += ", " + std::to_string(unmatched_frees) + " unmatched frees skipped";
    }
    text += ")\npeak in use:   " + format_bytes(peak_in_use) +
            "\npeak reserved: " + format_bytes(peak_reserved) + "\n";
    if (logged_failures != 0) {
      text += "logged out-of-memory events: " + std::to_string(logged_failures) + ", " +
              std::to_string(logged_failures_avoided) + " served by this stack\n";
    }
    if (failure) {
      char when[48];
      std::snprintf(when, sizeof when, "%.3f ms", static_cast<double>(failure->t_ns) / 1e6);
      text += "result: OUT OF MEMORY at event " + std::to_string(failure->event_index) + " (" +
              when + " into the run): " + format_bytes(failure->bytes) + " requested, verdict " +
              std::string(to_string(failure->verdict)) + "\n  " + failure->report + "\n";
    } else {
      text += "result: completed without running out of memory\n";
    }
    return text;
  }
};

/// How `replay` runs a log.
struct replay_options {
  chrome_trace* trace = nullptr;  ///< if set, receives counter samples and the failure
  std::size_t sample_every = 1;   ///< events between trace samples
};

/// Replays `events` through `stack`; see the contract above.
[[nodiscard]] inline replay_result replay_log(const std::vector<log_event>& events,
                                              memory_resource& stack,
                                              const replay_options& options = {}) {
  struct live_block {
    void* pointer;
    std::size_t bytes;
    std::size_t alignment;
  };
  std::vector<const memory_resource*> chain;
  for (const memory_resource* r = &stack; r != nullptr; r = r->upstream()) {
    chain.push_back(r);
  }
  const memory_resource& leaf = *chain.back();
  auto sample = [&](std::uint64_t t_ns) {
    for (const memory_resource* r : chain) {
      const resource_stats s = r->stats();
      options.trace->add_sample(r->name(), t_ns, s.used_bytes, s.reserved_bytes);
    }
  };

  replay_result result;
  std::unordered_map<std::uint64_t, live_block> live;  // logged pointer -> replayed block
  std::size_t in_use = 0;
  for (std::size_t i = 0; i < events.size(); ++i) {
    const log_event& e = events[i];
    ++result.events;
    if (e.kind == log_event_kind::free) {
      const auto it = live.find(e.pointer);
      if (it == live.end()) {
        ++result.unmatched_frees;
      } else {
        stack.deallocate(it->second.pointer, it->second.bytes, it->second.alignment);
        in_use -= it->second.bytes;
        live.erase(it);
        ++result.frees;
      }
    } else {
      const bool logged_failure = e.kind == log_event_kind::out_of_memory;
      const std::size_t alignment = e.alignment == 0 ? default_alignment : e.alignment;
      result.logged_failures += logged_failure ? 1 : 0;
      void* p = nullptr;
      try {
        p = stack.allocate(e.bytes, alignment);
      } catch (const out_of_memory& error) {
        if (!logged_failure) {
          result.failure =
              replay_failure{i, e.t_ns, e.bytes, error.verdict(), std::string(error.what())};
          if (options.trace != nullptr) {
            options.trace->add_out_of_memory(stack.name(), e.t_ns, e.bytes,
                                             to_string(error.verdict()));
          }
          break;
        }
      }
      if (p != nullptr) {
        result.peak_reserved = std::max(result.peak_reserved, leaf.stats().reserved_bytes);
        if (logged_failure) {
          ++result.logged_failures_avoided;
          stack.deallocate(p, e.bytes, alignment);
        } else {
          ++result.allocations;
          auto [it, inserted] = live.try_emplace(e.pointer, live_block{p, e.bytes, alignment});
          if (!inserted) {
            // The log hands out an address that is still live, so its free went unlogged
            // (a log cut short and appended to?): free the older block here.
            stack.deallocate(it->second.pointer, it->second.bytes, it->second.alignment);
            in_use -= it->second.bytes;
            it->second = live_block{p, e.bytes, alignment};
          }
          in_use += e.bytes;
          result.peak_in_use = std::max(result.peak_in_use, in_use);
        }
      }
    }
    if (options.trace != nullptr && (i % std::max<std::size_t>(options.sample_every, 1) == 0)) {
      sample(e.t_ns);
    }
  }
  for (const auto& [logged, block] : live) {
    stack.deallocate(block.pointer, block.bytes, block.alignment);
  }
  return result;
}

}  // namespace cudamem
