// cudamem/_torch/allocator_pools.hpp — PyTorch's private pools: a CUDA graph's pool, a
// torch.cuda.MemPool (with or without an allocator of its own), torch.compile's checkpoints of
// them, and torch.cuda.empty_cache().
//
//   with torch.cuda.graph(g): y = f(x)          # beginAllocateToPool .. endAllocateToPool
//   pool = torch.cuda.MemPool(allocator)        # createOrIncrefPool (2.8+; 2.7: ensureExists...)
//   with torch.cuda.use_mem_pool(pool): ...     # beginAllocateToPool with a filter of any stream
//
// Owns: empty_cache, begin/endAllocateToPool, releasePool, getPoolUseCount, the pool's creation
// in each release's form (2.7: no allocator given, the active MemPoolContext's allocator taken
// at the pool's first allocation; 2.8-2.10: a raw pointer the MemPool keeps alive; 2.11: a
// shared pointer), setUseOnOOM, setNoSplit (2.10+), checkPoolLiveAllocations, a pool's end
// (release_dead_pools, release_pool_memory) and the checkpoints of torch.compile's CUDA graph
// trees (getCheckpointState, setCheckpointPoolState). A pool's chunks and blocks are placed by
// graph_pool.hpp.
#pragma once

#include "allocator_class.hpp"

#include <algorithm>
#include <tuple>

namespace {

void cudamem_torch_allocator::empty_cache(MempoolId_t id) {
  {
    std::unique_lock lock(mutex_);
    const bool capturing = !captures_.empty();
    if (!capturing) {
      finish_pending_frees(lock, /*wait=*/true);
      for (DeviceIndex d = 0; d < device_count(); ++d) {
        ++devices_[d].figures.num_sync_all_streams;
      }
    }
    release_dead_pools(id, capturing);
    if (capturing || id != default_pool) {
      return;
    }
  }
  const std::vector<std::vector<span>> before =
      recording() ? all_segments() : std::vector<std::vector<span>>{};
  check_status(cudamem_release(process_allocator, -1, nullptr), "empty_cache");
  if (recording()) {
    note_segment_changes(before, nullptr, maybe_gather(hist::RecordContext::ALL));
  }
}

void cudamem_torch_allocator::beginAllocateToPool(DeviceIndex device, MempoolId_t id,
                                                  std::function<bool(cudaStream_t)> filter) {
  // A graph capture calls this just before cudaStreamBeginCapture: the last moment an event
  // can be recorded on the stream it will capture. cudamem's pools record one wherever they
  // owe one, so a chunk asked for during the capture can be ordered after frees made there.
  // (use_mem_pool calls it too, with no capture to follow: a few event records, no more.)
  if (cudamem_prepare_for_graph_capture() != CUDAMEM_OK) {
    TORCH_WARN("cudamem: before a graph capture: ", last_error());
  }
  const std::lock_guard lock(mutex_);
  for (const capture& c : captures_) {
    TORCH_CHECK(!(c.device == device && c.pool == id),
                "beginAllocateToPool: already recording to mempool_id");
  }
  pool_state& p = pool_for(device, id, nullptr);
  ++p.use_count;
  captures_.push_back({device, id, std::move(filter)});
  refresh_plain_malloc();
}

void cudamem_torch_allocator::endAllocateToPool(DeviceIndex device, MempoolId_t id) {
  std::unique_lock lock(mutex_);
  const auto it = std::find_if(captures_.begin(), captures_.end(), [&](const capture& c) {
    return c.device == device && c.pool == id;
  });
  TORCH_CHECK(it != captures_.end(), "endAllocatePool: not currently recording to mempool_id");
  captures_.erase(it);
  refresh_plain_malloc();
  if (captures_.empty()) {
    finish_deferred(lock);  // frees that had to wait for the capture to end
  }
}

void cudamem_torch_allocator::releasePool(DeviceIndex device, MempoolId_t id) {
  try {
    const std::lock_guard lock(mutex_);
    const auto it = pools_.find(id);
    if (it == pools_.end() || it->second.use_count == 0) {
      return;
    }
    --it->second.use_count;
    if (it->second.use_count == 0 && captures_.empty()) {
      release_pool_memory(it);  // what no live tensor holds goes back now
    }
  } catch (const std::exception& e) {  // called from destructors (~CUDAGraph, ~MemPool)
    TORCH_WARN("cudamem: releasing memory pool ", pool_name(id), " on device ", device, ": ",
               e.what());
  }
}

int cudamem_torch_allocator::getPoolUseCount(DeviceIndex /*device*/, MempoolId_t id) {
  const std::lock_guard lock(mutex_);
  const auto it = pools_.find(id);
  TORCH_CHECK(it != pools_.end(), "Could not find pool of id ", pool_name(id));
  return static_cast<int>(it->second.use_count);
}

void cudamem_torch_allocator::create_or_incref_pool(
    DeviceIndex device, MempoolId_t id, std::shared_ptr<cca::CUDAAllocator> allocator) {
  const std::lock_guard lock(mutex_);
  const auto it = pools_.find(id);
  if (it != pools_.end()) {
    TORCH_CHECK(allocator == nullptr, "cudamem: memory pool ", pool_name(id),
                " exists already; its allocator cannot change");
    ++it->second.use_count;
    return;
  }
  ++pool_for(device, id, std::move(allocator)).use_count;
}

void cudamem_torch_allocator::set_use_on_oom(DeviceIndex /*device*/, MempoolId_t id,
                                             bool use_on_oom) noexcept {
  const std::lock_guard lock(mutex_);  // ~MemPool calls this: never throw
  if (const auto it = pools_.find(id); it != pools_.end()) {
    it->second.use_on_oom = use_on_oom;
  }
}

#if CUDAMEM_TORCH_AT_LEAST(2, 10)
void cudamem_torch_allocator::setNoSplit(DeviceIndex /*device*/, MempoolId_t id) {
  const std::lock_guard lock(mutex_);
  const auto it = pools_.find(id);
  TORCH_CHECK(it != pools_.end(), "Could not find pool of id ", pool_name(id));
  TORCH_CHECK(!it->second.pool.has_chunks(),
              "cudamem: no_split must be set before the pool holds memory");
  it->second.pool.set_no_split();
}
#endif

bool cudamem_torch_allocator::checkPoolLiveAllocations(
    DeviceIndex /*device*/, MempoolId_t id, const std::unordered_set<void*>& expected) {
  const std::lock_guard lock(mutex_);
  TORCH_CHECK(pools_.count(id) != 0, "Could not find pool of id ", pool_name(id));
  std::size_t live = 0;
  for (const auto& [ptr, b] : live_) {
    if (b.pool == id && !b.pending) {
      if (expected.count(ptr) == 0) {
        return false;
      }
      ++live;
    }
  }
  return live == expected.size();
}

cudamem_torch_allocator::pool_state& cudamem_torch_allocator::pool_for(
    DeviceIndex device, MempoolId_t id, std::shared_ptr<cca::CUDAAllocator> custom) {
  auto it = pools_.find(id);
  if (it == pools_.end()) {
    it = pools_.emplace(std::piecewise_construct, std::forward_as_tuple(id),
                        std::forward_as_tuple(device, std::move(custom)))
             .first;
  }
  return it->second;
}

/// PyTorch 2.7: a MemPool's allocator reaches the allocator only through the MemPoolContext
/// active while use_mem_pool runs: taken at the pool's first allocation, before it holds a
/// chunk. From 2.8 the allocator comes with createOrIncrefPool, and this does nothing.
void cudamem_torch_allocator::adopt_active_mem_pool_allocator(pool_state& ps, MempoolId_t id) {
#if CUDAMEM_TORCH_AT_LEAST(2, 8)
  static_cast<void>(ps);
  static_cast<void>(id);
#else
  if (ps.chunks.custom() || ps.pool.has_chunks()) {
    return;
  }
  c10::cuda::MemPool* const active = c10::cuda::MemPoolContext::getActiveMemPool();
  if (active != nullptr && active->id() == id && active->allocator() != nullptr) {
    ps.chunks.adopt(not_owned(active->allocator()));
  }
#endif
}
/// Pools no graph or MemPool uses any more give back their free chunks; a pool with no chunk
/// and no live block is gone. `id` the default pool: every such pool; else that one.
void cudamem_torch_allocator::release_dead_pools(MempoolId_t id, bool capturing) {
  if (capturing) {
    return;  // a chunk given back during a capture could be freed on a captured stream
  }
  for (auto it = pools_.begin(); it != pools_.end();) {
    auto next = std::next(it);
    if ((id == default_pool || it->first == id) && it->second.use_count == 0) {
      release_pool_memory(it);
    }
    it = next;
  }
}

void cudamem_torch_allocator::release_pool_memory(
    std::map<MempoolId_t, pool_state>::iterator it) {
  pool_state& ps = it->second;
  for (const auto& [base, chunk] : ps.pool.release(ps.chunks)) {
    devices_[ps.device].figures.segment.decrease(
        chunk.small ? cudamem::torch_bridge::small_pool : cudamem::torch_bridge::large_pool, 1);
    record_trace(hist::TraceEntry::SEGMENT_FREE, ps.device, base, chunk.bytes,
                 static_cast<cudaStream_t>(chunk.stream), it->first, nullptr);
  }
  if (ps.live_blocks == 0 && !ps.pool.has_chunks() && ps.use_count == 0) {
    pools_.erase(it);
  }
}

// --- checkpoints (torch.compile's CUDA graph trees) -------------------------------------------

std::shared_ptr<cca::AllocatorState> cudamem_torch_allocator::getCheckpointState(
    DeviceIndex device, MempoolId_t id) {
  std::unique_lock lock(mutex_);
  if (captures_.empty()) {
    finish_deferred(lock);
  }
  const auto it = pools_.find(id);
  TORCH_CHECK(it != pools_.end(), "Could not find pool of id ", pool_name(id));
  TORCH_CHECK(it->second.use_count != 0, "Not expected to checkpoint freeable graph");
  auto state = std::make_shared<checkpoint>();
  state->pool = id;
  state->device = device;
  for (const auto& [p, b] : live_) {
    if (b.pool == id && !b.pending) {
      state->blocks.push_back({b.address, b.size, b.requested, b.stream, b.context});
    }
  }
  for (const auto& [base, chunk] : it->second.pool.chunks()) {
    state->chunks.push_back(base);
  }
  return state;
}

cca::CheckpointDelta cudamem_torch_allocator::setCheckpointPoolState(
    DeviceIndex device, std::shared_ptr<cca::AllocatorState> pps) {
  auto* state = dynamic_cast<checkpoint*>(pps.get());
  TORCH_CHECK(state != nullptr, "cudamem: not a checkpoint of cudamem's allocator");
  std::shared_ptr<c10::GatheredContext> context = maybe_gather(hist::RecordContext::STATE);
  std::unique_lock lock(mutex_);
  const auto it = pools_.find(state->pool);
  TORCH_CHECK(it != pools_.end(), "Could not find pool of id ", pool_name(state->pool));
  pool_state& ps = it->second;
  cca::CheckpointDelta delta;
  // Every block of the pool live now is freed (into the pool: nothing leaves it) ...
  for (auto b = live_.begin(); b != live_.end();) {
    if (b->second.pool != state->pool) {
      ++b;
      continue;
    }
    delta.ptrs_freed.push_back(b->first);
    block gone = std::move(b->second);
    b = live_.erase(b);
    device_figures& f = devices_[gone.device].figures;
    if (!gone.pending) {
      f.on_free_requested(gone.size);
    }
    f.on_free_completed(gone.size, gone.requested);
    for (const cudaEvent_t e : gone.rare().events) {
      static_cast<void>(cudaEventDestroy(e));
    }
    ps.pool.deallocate(gone.address, gone.size);
    --ps.live_blocks;
  }
  pending_.erase(std::remove_if(pending_.begin(), pending_.end(),
                                [&](void* p) { return live_.count(p) == 0; }),
                 pending_.end());
  refresh_plain_malloc();
  deferred_.erase(std::remove_if(deferred_.begin(), deferred_.end(),
                                 [&](void* p) { return live_.count(p) == 0; }),
                  deferred_.end());
  for (const std::uintptr_t base : state->chunks) {
    TORCH_CHECK(ps.pool.chunks().count(base) != 0, "could not find ",
                reinterpret_cast<void*>(base));
  }
  // ... and the blocks live at the checkpoint are live again, at their addresses.
  for (const checkpoint::live& l : state->blocks) {
    TORCH_CHECK(ps.pool.allocate_at(l.address, l.size), "cudamem: could not restore the block at ",
                l.address, " of the checkpoint");
    ++ps.live_blocks;
    devices_[device].figures.on_allocate(l.size, l.requested);
    live_.emplace(l.address, block{l.address, l.size, l.requested, device, l.stream,
                                   state->pool, l.context ? l.context : context});
    delta.dataptrs_allocd.emplace_back(l.address, l.address, &delete_block,
                                       c10::Device(c10::DeviceType::CUDA, device));
  }
  return delta;
}

}  // namespace
