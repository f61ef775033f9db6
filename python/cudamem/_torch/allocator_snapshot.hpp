// cudamem/_torch/allocator_snapshot.hpp — torch.cuda.memory_snapshot() (and MemPool.snapshot()):
// cudamem's memory as PyTorch's segments and blocks, with the history's events.
//
//   torch.cuda.memory._snapshot()   # segments: cudamem's mapped ranges (PyTorch's "expandable"
//                                   # segments) and graph-pool chunks; blocks: the tensors,
//                                   # gaps "inactive"; device_traces: allocator_history.hpp's
//
// Owns: take_snapshot (one pool, or every pool when the id is the default one), and the
// snapshot() of each release: 2.7's takes the pool from the active MemPoolContext, 2.8-2.10's
// a pool id, 2.11's a pool id and whether to include the traces. The segments' layout is
// computed by snapshot_layout.hpp (no PyTorch there, tested alone). PyTorch 2.14's host
// (pinned) segments are not cudamem's: left empty.
#pragma once

#include "allocator_class.hpp"

#include <algorithm>

namespace {

#if !CUDAMEM_TORCH_AT_LEAST(2, 8)
cca::SnapshotInfo cudamem_torch_allocator::snapshot() {
  c10::cuda::MemPool* const active = c10::cuda::MemPoolContext::getActiveMemPool();
  return take_snapshot(active != nullptr ? active->id() : default_pool, true);
}
#endif

cca::SnapshotInfo cudamem_torch_allocator::take_snapshot(MempoolId_t id,
                                                         bool include_traces) {
  std::vector<std::vector<span>> held = all_segments();
  cca::SnapshotInfo info{};  // value-initialised: every setting PyTorch reads has a value
  const std::lock_guard lock(mutex_);
  const auto to_unix = clock_.makeConverter();
  if (include_traces) {
    for (auto& ring : rings_) {
      std::vector<hist::TraceEntry> entries = ring.entries();
      for (hist::TraceEntry& te : entries) {
        te.time_.t_ = to_unix(te.time_.approx_t_) / 1000;
      }
      info.device_traces.push_back(std::move(entries));
    }
    for (hist::AnnotationEntry e : annotations_.entries()) {
      e.time_.t_ = to_unix(e.time_.approx_t_) / 1000;
      info.external_annotations.push_back(std::move(e));
    }
  }
  auto block_info = [](const block& b) {
    hist::BlockInfo bi;
    bi.size = b.size;
    bi.requested_size = b.requested;
    bi.allocated = !b.pending;
    bi.active = true;
    bi.context_when_allocated = b.context;
    return bi;
  };
  auto add_segment = [&](DeviceIndex device, span range, cudaStream_t stream, bool large,
                         bool expandable, MempoolId_t owner,
                         const std::vector<cudamem::torch_bridge::laid_piece>& pieces,
                         const std::vector<const block*>& blocks) {
    hist::SegmentInfo s;
    s.device = device;
    s.address = range.address;
    s.total_size = range.bytes;
    s.stream = stream;
    s.is_large = large;
    s.is_expandable = expandable;
    s.owner_private_pool_id = owner;
    for (const auto& piece : pieces) {
      if (piece.block == cudamem::torch_bridge::npos) {
        hist::BlockInfo gap;
        gap.size = piece.bytes;
        s.blocks.push_back(gap);
        continue;
      }
      const block& b = *blocks[piece.block];
      s.blocks.push_back(block_info(b));
      s.allocated_size += b.pending ? 0 : b.size;
      s.active_size += b.size;
      s.requested_size += b.requested;
    }
    info.segments.push_back(std::move(s));
  };
  for (DeviceIndex device = 0; device < device_count(); ++device) {
    // The graph pools' chunks are segments of their own; cudamem's mapped memory around them
    // is the default pool's.
    std::vector<span> chunk_spans;
    for (const auto& [pid, ps] : pools_) {
      if (ps.device != device || ps.chunks.custom()) {
        continue;
      }
      for (const auto& [base, chunk] : ps.pool.chunks()) {
        chunk_spans.push_back({base, chunk.bytes});
      }
    }
    std::sort(chunk_spans.begin(), chunk_spans.end(),
              [](const span& a, const span& b) { return a.address < b.address; });
    if (id == default_pool) {
      std::vector<const block*> blocks;
      for (const auto& [p, b] : live_) {
        if (b.device == device && b.pool == default_pool) {
          blocks.push_back(&b);
        }
      }
      std::sort(blocks.begin(), blocks.end(),
                [](const block* a, const block* b) { return a->address < b->address; });
      std::vector<span> block_spans;
      for (const block* b : blocks) {
        block_spans.push_back({reinterpret_cast<std::uintptr_t>(b->address), b->size});
      }
      const std::vector<span> mine = cudamem::torch_bridge::subtract(
          device < static_cast<DeviceIndex>(held.size()) ? held[device] : std::vector<span>{},
          chunk_spans);
      const cudamem::torch_bridge::layout l = cudamem::torch_bridge::lay_out(mine, block_spans);
      for (const auto& seg : l.segments) {
        add_segment(device, seg.range, nullptr, true, resource_ == "vm_pool", default_pool,
                    seg.pieces, blocks);
      }
      for (const std::size_t i : l.loose) {  // a resource that cannot list its memory
        add_segment(device, block_spans[i], blocks[i]->stream, blocks[i]->size > graph_pool::small_request,
                    false, default_pool, {{block_spans[i].address, block_spans[i].bytes, i}},
                    blocks);
      }
    }
    for (const auto& [pid, ps] : pools_) {
      if (ps.device != device || (id != default_pool && pid != id)) {
        continue;
      }
      for (const auto& [base, chunk] : ps.pool.chunks()) {
        std::vector<const block*> blocks;
        std::vector<cudamem::torch_bridge::laid_piece> pieces;
        for (const graph_pool::piece& piece : ps.pool.pieces_of(base)) {
          if (piece.free) {
            pieces.push_back({piece.address, piece.bytes, cudamem::torch_bridge::npos});
          } else {  // one used range may hold several blocks side by side
            const auto block_bytes = [this](std::uintptr_t a) -> std::size_t {
              const auto b = live_.find(reinterpret_cast<void*>(a));
              return b == live_.end() ? 0 : b->second.size;
            };
            for (const cudamem::torch_bridge::span& b : cudamem::torch_bridge::blocks_tiling(
                     {piece.address, piece.bytes}, block_bytes)) {
              pieces.push_back({b.address, b.bytes, blocks.size()});
              blocks.push_back(&live_.at(reinterpret_cast<void*>(b.address)));
            }
          }
        }
        add_segment(device, {base, chunk.bytes}, static_cast<cudaStream_t>(chunk.stream),
                    !chunk.small, false, pid, pieces, blocks);
      }
    }
  }
  std::sort(info.segments.begin(), info.segments.end(),
            [](const hist::SegmentInfo& a, const hist::SegmentInfo& b) {
              return a.address < b.address;
            });
  if (include_traces) {  // after the traces were taken, as PyTorch does
    for (DeviceIndex device = 0; device < device_count(); ++device) {
      std::size_t active = 0;
      for (const auto& [p, b] : live_) {
        active += b.device == device ? b.size : 0;
      }
      record_trace(hist::TraceEntry::SNAPSHOT, device, 0, active, nullptr, default_pool, nullptr);
    }
  }
  cca::AllocatorConfigInfo& settings = info.config_metadata;
  settings.garbage_collection_threshold = 0;
  settings.max_split_size = SIZE_MAX;
  settings.expandable_segments = resource_ == "vm_pool";
  settings.release_lock_on_malloc = true;  // no lock is held over a device allocation
  settings.pinned_use_host_register = cca::CUDAAllocatorConfig::pinned_use_cuda_host_register();
  settings.pinned_num_register_threads = cca::CUDAAllocatorConfig::pinned_num_register_threads();
  settings.roundup_power2_divisions = roundup_divisions_table();
#if CUDAMEM_TORCH_AT_LEAST(2, 9)
  settings.graph_capture_record_stream_reuse = capture_reuse_setting();
#endif
  settings.last_allocator_settings = "cudamem resource=" + resource_;
  return info;
}

}  // namespace
