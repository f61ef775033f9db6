// cudamem/detail/vm/stats.hpp — vm_resource's figures (vm_resource_stats, and the
// resource_stats every memory_resource gives), gathered from the parts that keep them: the handles (what is mapped, and its peak), the live blocks (what is
// handed out), the free ranges, the compactor (its driver-call counts, what is held ahead) and
// the address space.
//
//   vm_resource_stats s = collect_vm_stats(config, space, handles, blocks, free, compactor);
//   resource_stats r = collect_resource_stats(layer, options, handles, blocks, free);
//
// Why apart: vm_resource holds the parts; what each figure means is said once, here and in
// vm_resource_stats (detail/vm/options.hpp). Walks the free ranges (largest, recyclable): not
// for hot loops. Not thread-safe: vm_resource's mutex guards the parts.
#pragma once

#include <cudamem/detail/vm/address_space.hpp>
#include <cudamem/detail/vm/compactor.hpp>
#include <cudamem/detail/vm/config.hpp>
#include <cudamem/detail/vm/free_ranges.hpp>
#include <cudamem/detail/vm/grow_ahead.hpp>  // vm_compactor::tail_bytes
#include <cudamem/detail/vm/handle_set.hpp>
#include <cudamem/detail/vm/live_blocks.hpp>
#include <cudamem/detail/vm/mapping.hpp>
#include <cudamem/detail/vm/options.hpp>
#include <cudamem/memory_resource.hpp>  // resource_stats

namespace cudamem::detail {

/// memory_resource::stats() of a vm_resource: mapped, in use and its peak, the free ranges,
/// the simulated device's capacity, the physical limit.
[[nodiscard]] inline resource_stats collect_resource_stats(const vm_mapping_layer& layer,
                                                           const vm_resource_options& options,
                                                           const handle_set& handles,
                                                           const vm_live_blocks& blocks,
                                                           const free_range_index& free) {
  resource_stats s;
  s.reserved_bytes = handles.mapped_bytes;
  s.used_bytes = blocks.used_bytes();
  s.peak_used_bytes = blocks.peak_used_bytes();
  s.free_blocks = free.count();
  s.largest_free_block = free.largest();
  if (const auto capacity = layer.simulated_capacity()) {
    s.capacity = *capacity;
  }
  if (options.physical_limit) {
    s.budget = *options.physical_limit;
  }
  return s;
}

[[nodiscard]] inline vm_resource_stats collect_vm_stats(const vm_config& config,
                                                        const address_space& space,
                                                        const handle_set& handles,
                                                        const vm_live_blocks& blocks,
                                                        const free_range_index& free,
                                                        const vm_compactor& compactor) {
  vm_resource_stats s;
  s.granularity = config.granule;
  s.handle_bytes = config.handle;
  s.reserved_virtual_bytes = space.reserved_bytes();
  s.mapped_bytes = handles.mapped_bytes;
  s.peak_mapped_bytes = handles.mapped_bytes.peak();
  s.used_bytes = blocks.used_bytes();
  s.requested_bytes = blocks.requested_bytes();
  s.partial_granule_bytes = s.used_bytes - s.requested_bytes;
  s.peak_used_bytes = blocks.peak_used_bytes();
  s.free_bytes = handles.mapped_bytes - s.used_bytes;
  s.largest_free_range = free.largest();
  s.recyclable_bytes = compactor.recyclable_bytes();
  s.stranded_bytes = s.free_bytes - s.recyclable_bytes;
  s.handles = handles.count();
  s.stale_aliases = handles.stale.size();
  const vm_call_counts& calls = compactor.counts();
  s.compactions = calls.compactions;
  s.handles_created = calls.handles_created;
  s.maps = calls.maps;
  s.access_calls = calls.access_calls;
  s.unmaps = calls.unmaps;
  s.handles_created_ahead = calls.handles_created_ahead;
  s.held_ahead_bytes = compactor.tail_bytes();
  s.given_back_ahead_bytes = calls.bytes_given_back_ahead;
  s.kept_free_compactions = calls.kept_free_compactions;
  s.recent_reuses = blocks.recent_reuses();
  s.growth_ahead_held_back = compactor.ahead_held_back();
  return s;
}

}  // namespace cudamem::detail
