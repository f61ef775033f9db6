// cudamem/_torch/allocator_stats.hpp — PyTorch's view of the devices: torch.cuda.memory_stats()
// and its resets, the memory fraction (torch.cuda.set_per_process_memory_fraction, and from
// PyTorch 2.10 per_process_memory_fraction in PYTORCH_CUDA_ALLOC_CONF), the largest free
// block, and cudamem's own figures and mapped ranges these are made from.
//
//   torch.cuda.memory_stats()["reserved_bytes.all.current"]   # cudamem's mapped bytes
//
// Owns: init, getDeviceStats, resetAccumulatedStats, resetPeakStats, getMemoryFraction,
// setMemoryFraction, cacheInfo, getExpandableSegmentSizes (2.10+), what counts against the
// fraction (held_under_fraction) and what a refusal by it says (fraction_cause).
#pragma once

#include "allocator_class.hpp"

#include <algorithm>

namespace {

/// cudamem's counters into one of PyTorch's statistics (its type differs between releases).
template <class PyTorchStatArray>
void copy(const cudamem::torch_bridge::stat_array& from, PyTorchStatArray& to) {
  for (std::size_t k = 0; k < 3; ++k) {
    to[k].current = from[k].current;
    to[k].peak = from[k].peak;
    to[k].allocated = from[k].allocated;
    to[k].freed = from[k].freed;
  }
}

cda::DeviceStats cudamem_torch_allocator::getDeviceStats(DeviceIndex device) {
  check_device(device);
  const cudamem_stats c = cudamem_figures(device);
  const std::lock_guard lock(mutex_);
  device_state& d = devices_[device];
  d.last_reserved = c.reserved_bytes;
  cda::DeviceStats s;
  copy(d.figures.allocation, s.allocation);
  copy(d.figures.allocated_bytes, s.allocated_bytes);
  copy(d.figures.active, s.active);
  copy(d.figures.active_bytes, s.active_bytes);
  copy(d.figures.requested_bytes, s.requested_bytes);
  copy(d.figures.segment, s.segment);
  // Reserved: what cudamem holds from the device. The part in small graph-pool chunks is
  // the "small pool"; the rest large.
  std::size_t small_reserved = 0;
  std::size_t split_free_bytes = 0;
  std::int64_t split_free_count = 0;
  for (const auto& [id, p] : pools_) {
    if (p.device != device) {
      continue;
    }
#if CUDAMEM_TORCH_AT_LEAST(2, 13)
    {  // PyTorch 2.13's reserved bytes per private pool: its current size and its peak
      const auto pool_reserved = static_cast<std::int64_t>(p.pool.reserved_bytes());
      std::int64_t& pool_peak = d.pool_reserved_peaks[id];
      pool_peak = std::max(pool_peak, pool_reserved);
    }
#endif
    for (const auto& [base, chunk] : p.pool.chunks()) {
      if (chunk.small) {
        small_reserved += chunk.bytes;
      }
      if (chunk.used != 0 && chunk.used != chunk.bytes) {
        for (const graph_pool::piece& piece : p.pool.pieces_of(base)) {
          if (piece.free) {
            split_free_bytes += piece.bytes;
            ++split_free_count;
          }
        }
      }
    }
  }
  const auto reserved = static_cast<std::int64_t>(c.reserved_bytes);
  const auto peak = static_cast<std::int64_t>(std::max(c.peak_reserved_bytes, c.reserved_bytes));
  const auto mapped = static_cast<std::int64_t>(c.device_allocated_bytes);
  const auto unmapped = static_cast<std::int64_t>(c.device_freed_bytes);
  auto& r = s.reserved_bytes;
  r[0] = {reserved, peak, mapped - d.figures.reserved_allocated_base,
          unmapped - d.figures.reserved_freed_base};
  r[1].current = static_cast<std::int64_t>(small_reserved);
  r[1].peak = std::max<std::int64_t>(d.small_reserved_peak, r[1].current);
  d.small_reserved_peak = r[1].peak;
  r[2].current = reserved - r[1].current;
  r[2].peak = std::max(peak - r[1].current, r[2].current);
  s.inactive_split[0].current = s.inactive_split[2].current = split_free_count;
  s.inactive_split_bytes[0].current = s.inactive_split_bytes[2].current =
      static_cast<std::int64_t>(split_free_bytes);
  if (resource_ == "pool") {  // cudaMalloc'd chunks: segments in PyTorch's sense
    s.segment[0].current += static_cast<std::int64_t>(c.segments);
    s.segment[2].current += static_cast<std::int64_t>(c.segments);
  }
  s.num_alloc_retries = d.figures.num_alloc_retries;
  s.num_ooms = d.figures.num_ooms;
  s.num_sync_all_streams = d.figures.num_sync_all_streams;
  s.num_device_alloc = static_cast<std::int64_t>(c.device_allocations) - d.figures.device_alloc_base;
  s.num_device_free = static_cast<std::int64_t>(c.device_frees) - d.figures.device_free_base;
  s.max_split_size = -1;  // no block is too large to split: cudamem's pools place, not split
#if CUDAMEM_TORCH_AT_LEAST(2, 12)
  s.num_oom_rejections = d.oom_rejections;
#endif
#if CUDAMEM_TORCH_AT_LEAST(2, 13)
  for (const auto& [id, peak_bytes] : d.pool_reserved_peaks) {  // a pool gone: current 0
    const auto it = pools_.find(id);
    const bool here = it != pools_.end() && it->second.device == device;
    auto& pool_stat = s.reserved_bytes_by_private_pools[id][0];
    pool_stat.current = here ? static_cast<std::int64_t>(it->second.pool.reserved_bytes()) : 0;
    pool_stat.peak = peak_bytes;
  }
#endif
  return s;
}

void cudamem_torch_allocator::resetAccumulatedStats(DeviceIndex device) {
  check_device(device);
  const cudamem_stats c = cudamem_figures(device);
  const std::lock_guard lock(mutex_);
  device_figures& f = devices_[device].figures;
  f.reset_accumulated();
  devices_[device].oom_rejections = 0;
  f.reserved_allocated_base = static_cast<std::int64_t>(c.device_allocated_bytes);
  f.reserved_freed_base = static_cast<std::int64_t>(c.device_freed_bytes);
  f.device_alloc_base = static_cast<std::int64_t>(c.device_allocations);
  f.device_free_base = static_cast<std::int64_t>(c.device_frees);
}

void cudamem_torch_allocator::resetPeakStats(DeviceIndex device) {
  check_device(device);
  check_status(cudamem_reset_peak_reserved(process_allocator, device), "reset_peak_memory_stats");
  const std::lock_guard lock(mutex_);
  devices_[device].figures.reset_peaks();
  devices_[device].small_reserved_peak = 0;
  devices_[device].pool_reserved_peaks.clear();  // read again from the pools' present sizes
}

void cudamem_torch_allocator::init(int device_count) {
  const std::lock_guard lock(mutex_);
  if (static_cast<int>(devices_.size()) < device_count) {
    devices_.resize(static_cast<std::size_t>(device_count));
    rings_.resize(static_cast<std::size_t>(device_count));
    for (auto& ring : rings_) {
      ring.set_capacity(trace_capacity_);
    }
  }
  initialized_ = true;
  const double fraction = configured_memory_fraction();
  if (fraction < 1.0) {
    for (int d = 0; d < device_count; ++d) {
      devices_[d].allowed = static_cast<std::size_t>(fraction * device_total(d));
    }
  }
  known_devices_.store(static_cast<DeviceIndex>(devices_.size()), std::memory_order_release);
  refresh_plain_malloc();
}

double cudamem_torch_allocator::getMemoryFraction(DeviceIndex device) {
  check_device(device);
  const std::lock_guard lock(mutex_);
  const std::optional<std::size_t> allowed = devices_[device].allowed;
  return allowed ? static_cast<double>(*allowed) / static_cast<double>(device_total(device))
                 : 1.0;
}

void cudamem_torch_allocator::setMemoryFraction(double fraction, DeviceIndex device) {
  check_device(device);
  TORCH_CHECK(fraction >= 0 && fraction <= 1, "invalid fraction:", fraction,
              ". Please set within [0, 1].");
  const std::size_t total = device_total(device);
  const std::lock_guard lock(mutex_);
  devices_[device].fraction = fraction;
  devices_[device].allowed =
      fraction < 1.0 ? std::optional<std::size_t>(static_cast<std::size_t>(fraction * total))
                     : std::nullopt;
  refresh_plain_malloc();
}

#if CUDAMEM_TORCH_AT_LEAST(2, 10)
std::vector<cca::StreamSegmentSize> cudamem_torch_allocator::getExpandableSegmentSizes(
    DeviceIndex device) {
  check_device(device);
  std::vector<cca::StreamSegmentSize> out;
  if (resource_ != "vm_pool") {
    return out;
  }
  for (const span& s : cudamem_segments_of(device)) {
    out.emplace_back(nullptr, false, s.bytes);
  }
  return out;
}
#endif

void cudamem_torch_allocator::cacheInfo(DeviceIndex device, std::size_t* largest) {
  check_device(device);
  if (*largest == 0) {  // PyTorch's first guess: what the device has free
    const c10::cuda::CUDAGuard on{device};
    std::size_t free = 0;
    std::size_t total = 0;
    C10_CUDA_CHECK(cudaMemGetInfo(&free, &total));
    *largest = free;
  }
  const cudamem_stats c = cudamem_figures(device);
  if (c.largest_free_block != UINT64_MAX) {
    *largest = std::max<std::size_t>(*largest, c.largest_free_block);
  }
  const std::lock_guard lock(mutex_);
  for (const auto& [id, p] : pools_) {
    if (p.device == device) {
      *largest = std::max(*largest, p.pool.largest_free());
    }
  }
}

std::size_t cudamem_torch_allocator::held_under_fraction(DeviceIndex device) const {
  std::size_t in_pools = 0;
  std::size_t pools_reserve = 0;
  for (const auto& [id, ps] : pools_) {
    if (ps.device == device) {
      in_pools += ps.pool.used_bytes();
      pools_reserve += ps.pool.reserved_bytes();
    }
  }
  // Active bytes, not allocated: a block freed but still used by a stream is still held.
  const auto active = static_cast<std::size_t>(devices_[device].figures.active_bytes[0].current);
  return (active > in_pools ? active - in_pools : 0) + pools_reserve;
}

/// The bytes the fraction still allows on `device`; nullopt when no fraction is set.
std::optional<std::size_t> cudamem_torch_allocator::room_under_fraction(
    DeviceIndex device) const {
  const std::optional<std::size_t> allowed = devices_[device].allowed;
  if (!allowed) {
    return std::nullopt;
  }
  const std::size_t held = held_under_fraction(device);
  return held < *allowed ? *allowed - held : 0;
}

std::string cudamem_torch_allocator::fraction_cause(DeviceIndex device,
                                                    std::size_t bytes) const {
  const device_state& d = devices_[device];
  return "the memory fraction set by torch.cuda.set_per_process_memory_fraction(" +
         fraction_text(d.fraction) + ") allows " + size_text(d.allowed.value_or(0)) +
         " on this device; PyTorch's tensors and memory pools hold " +
         size_text(held_under_fraction(device)) + " of it, and " + size_text(bytes) +
         " more would pass it. Verdict: memory fraction. Raise the fraction, or free tensors "
         "(and memory pools) you no longer need.";
}

std::size_t cudamem_torch_allocator::device_total(int device) {
  const c10::cuda::CUDAGuard on{static_cast<DeviceIndex>(device)};
  std::size_t free = 0;
  std::size_t total = 0;
  C10_CUDA_CHECK(cudaMemGetInfo(&free, &total));
  return total;
}

cudamem_stats cudamem_torch_allocator::cudamem_figures(DeviceIndex device) {
  cudamem_stats s{};
  s.struct_size = sizeof(s);
  check_status(cudamem_get_stats(process_allocator, device, &s), "statistics");
  return s;
}

/// cudamem's mapped ranges (or chunks) on `device`; empty when the resource cannot tell.
std::vector<span> cudamem_torch_allocator::cudamem_segments_of(DeviceIndex device) {
  std::size_t count = 0;
  if (cudamem_segments(process_allocator, device, nullptr, 0, &count) != CUDAMEM_OK) {
    return {};
  }
  std::vector<cudamem_segment> raw(count + 16);  // room for growth meanwhile
  check_status(cudamem_segments(process_allocator, device, raw.data(), raw.size(), &count),
               "segments");
  std::vector<span> out;
  for (std::size_t i = 0; i < std::min(count, raw.size()); ++i) {
    out.push_back({static_cast<std::uintptr_t>(raw[i].address),
                   static_cast<std::size_t>(raw[i].bytes)});
  }
  return out;
}

std::vector<std::vector<span>> cudamem_torch_allocator::all_segments() {
  std::vector<std::vector<span>> out;
  for (DeviceIndex d = 0; d < device_count(); ++d) {
    out.push_back(cudamem_segments_of(d));
  }
  return out;
}

}  // namespace
