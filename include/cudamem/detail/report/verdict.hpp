// cudamem/detail/report/verdict.hpp — what to say about a verdict: the sentence with the
// numbers behind it (explanation), and the advice (hint): a resource's own, asked of the
// chain's resources in turn (ask_for_hint, which calls memory_resource::oom_hint), else the
// general one for the verdict (general_hint). The verdict itself, and the resource it points
// at (diagnose, verdict_subject), are measure.hpp's: every file that throws decides it.
//
// Part of memory_report.hpp. It reads only the figures already in the report (figures.hpp) and
// asks neither the device nor NVML, so a report an exception carries can explain itself.
#pragma once

#include <cudamem/detail/report/figures.hpp>
#include <cudamem/detail/report/measure.hpp>
#include <cudamem/memory_resource.hpp>

#include <cstddef>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace cudamem {

// The members of memory_report this part defines; each is declared, with what it says, in
// figures.hpp.

inline std::string memory_report::explanation() const {
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

inline std::string memory_report::hint() const {
  return resource_hint.empty() ? general_hint() : resource_hint;
}

inline std::string memory_report::general_hint() const {
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

inline std::string memory_report::fragmentation_hint() const {
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

inline std::string memory_report::held_by_others_hint() const {
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

namespace detail {

/// Asks the chain's resources for their own advice, in the order of memory_report.hpp's
/// contract; the first answer becomes `r.resource_hint`. A resource that throws while
/// answering is skipped.
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

}  // namespace detail

}  // namespace cudamem
