// cudamem/_torch/allocator_frees.hpp — how a block PyTorch frees goes back: at once on its own
// stream, after the other streams that used it (Tensor.record_stream: events polled at later
// allocations), or, during a CUDA graph capture, once the capture ends (or, with PyTorch's
// graph_capture_record_stream_reuse, once the capture's graph orders every use first).
//
//   y.record_stream(s); del y    # recordStream, then free(): an event on s, the free waits
//
// Owns: recordStream, free, complete_free, finish_pending_frees, wait_for_uses,
// reclaim_in_capture and finish_deferred. No event is recorded or queried while a stream is
// captured (it would break the capture).
#pragma once

#include "allocator_class.hpp"

#include <algorithm>
#include <unistd.h>

namespace {

void cudamem_torch_allocator::recordStream(const c10::DataPtr& ptr,
                                           c10::cuda::CUDAStream stream) {
  if (ptr.get() == nullptr || ptr.get_deleter() != &delete_block) {
    return;  // not ours (a tensor from another process, from_blob...): nothing to hold back
  }
  const std::lock_guard lock(mutex_);
  const auto it = live_.find(ptr.get());
  TORCH_CHECK(it != live_.end(), "cudamem: record_stream of a block it does not know");
  block& b = it->second;
  const cudaStream_t s = stream.stream();
  const std::vector<cudaStream_t>& uses = b.rare().uses;
  if (s != b.stream && std::find(uses.begin(), uses.end(), s) == uses.end()) {
    b.more().uses.push_back(s);
  }
}

void cudamem_torch_allocator::free(void* ptr) {
  if (ptr == nullptr) {
    return;
  }
  const cudamem::torch_bridge::call_timer timed(time_calls_, free_times_);
  std::shared_ptr<c10::GatheredContext> context = maybe_gather(hist::RecordContext::ALL);
  std::unique_lock lock(mutex_);
  const auto it = live_.find(ptr);
  if (it == live_.end()) {
    const bool uncached = uncached_.count(ptr) != 0;
    lock.unlock();
    if (uncached) {
      free_uncached(ptr);
      return;
    }
    TORCH_CHECK(false, "invalid device pointer: ", ptr);
  }
  block& b = it->second;
  TORCH_CHECK(!b.pending, "cudamem: a block freed twice: ", ptr);
  device_state& d = devices_[b.device];
  d.figures.on_free_requested(b.size);
  record_trace(hist::TraceEntry::FREE_REQUESTED, b.device, reinterpret_cast<std::uintptr_t>(ptr),
               b.requested, b.stream, b.pool, context ? context : b.context);
  if (const c10::impl::PyInterpreter* interp = c10::impl::GPUTrace::get_trace()) {
    (*interp)->trace_gpu_memory_deallocation(c10::DeviceType::CUDA,
                                             reinterpret_cast<std::uintptr_t>(ptr));
  }
  b.pending = true;
  if (!captures_.empty() && (b.has_uses() || b.pool == default_pool)) {
    // No event may be recorded or queried while a stream is captured; and a default-pool
    // block freed on a capturing stream is only free once the graph has run. Later.
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    const bool on_capturing_stream =
        cudaStreamIsCapturing(b.stream, &status) == cudaSuccess &&
        status != cudaStreamCaptureStatusNone;
    static_cast<void>(cudaGetLastError());
    if (b.has_uses() || on_capturing_stream) {
      if (b.has_uses() && b.pool != default_pool && capture_reuse_setting()) {
        // PyTorch's graph_capture_record_stream_reuse: the graph may show, at a later
        // allocation of the capture, that every use came first (reclaim_in_capture).
        std::vector<cudaStream_t> streams = b.rare().uses;
        streams.push_back(b.stream);
        b.more().free_markers = cudamem::torch_bridge::capture_markers(streams).value_or(
            std::vector<cudaGraphNode_t>{});
        deferred_with_markers_ += b.rare().free_markers.empty() ? 0 : 1;
      }
      deferred_.push_back(ptr);
      return;
    }
  }
  if (b.has_uses()) {
    wait_for_uses(b);
    pending_.push_back(ptr);
    refresh_plain_malloc();
    return;
  }
  block done = std::move(b);
  forget(it);
  if (context) {
    done.context = std::move(context);  // completed now: the free's stack, as PyTorch records
  }
  complete_free(lock, std::move(done), /*relock=*/false);
}

/// The block goes back: to its pool, or to cudamem (outside the lock). Called with the lock;
/// holds it again on return unless `relock` is false.
void cudamem_torch_allocator::complete_free(std::unique_lock<std::mutex>& lock, block b,
                                            bool relock) {
  devices_[b.device].figures.on_free_completed(b.size, b.requested);
  record_trace(hist::TraceEntry::FREE_COMPLETED, b.device,
               reinterpret_cast<std::uintptr_t>(b.address), b.requested, b.stream, b.pool,
               b.context);
  for (const int fd : b.rare().exported_fds) {
    ::close(fd);  // every receiver has let go (PyTorch counts them before it frees)
  }
  if (b.pool != default_pool) {
    const auto it = pools_.find(b.pool);
    pool_state& ps = it->second;
    ps.pool.deallocate(b.address, b.size);
    --ps.live_blocks;
    if (ps.use_count == 0 && ps.live_blocks == 0 && captures_.empty()) {
      release_pool_memory(it);
    }
    return;
  }
  lock.unlock();
  const cudamem_status s =
      cudamem_deallocate(process_allocator, b.address, b.size, b.device, b.stream);
  if (relock) {
    lock.lock();
  }
  if (s != CUDAMEM_OK) {
    TORCH_WARN("cudamem: freeing a block: ", last_error());
  }
}

/// Frees whose streams are done (wait: all of them, waiting for their events).
void cudamem_torch_allocator::finish_pending_frees(std::unique_lock<std::mutex>& lock,
                                                   bool wait) {
  std::vector<void*> still;
  std::vector<void*> ready;
  for (void* p : pending_) {
    block& b = live_.at(p);
    bool done = true;
    for (const cudaEvent_t e : b.rare().events) {
      const cudaError_t r = wait ? cudaEventSynchronize(e) : cudaEventQuery(e);
      if (r == cudaErrorNotReady) {
        static_cast<void>(cudaGetLastError());
        done = false;
        break;
      }
      C10_CUDA_CHECK(r);
    }
    (done ? ready : still).push_back(p);
  }
  pending_ = std::move(still);
  refresh_plain_malloc();
  for (void* p : ready) {
    auto it = live_.find(p);
    if (it == live_.end()) {
      continue;  // gone meanwhile (a checkpoint restored while the lock was let go)
    }
    block b = std::move(it->second);
    live_.erase(it);
    for (const cudaEvent_t e : b.rare().events) {
      C10_CUDA_CHECK(cudaEventDestroy(e));
    }
    if (b.extra) {
      b.extra->events.clear();
    }
    complete_free(lock, std::move(b));
  }
}

/// A block freed while other streams still use it (record_stream): an event recorded on each
/// of them now; the free completes once they have all passed it (finish_pending_frees).
void cudamem_torch_allocator::wait_for_uses(block& b) {
  const c10::cuda::CUDAGuard on{b.device};
  for (const cudaStream_t s : b.more().uses) {
    cudaEvent_t e = nullptr;
    C10_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    b.more().events.push_back(e);
    C10_CUDA_CHECK(cudaEventRecord(e, s));
  }
}

/// graph_capture_record_stream_reuse: the blocks of `stream` freed during this capture whose
/// uses the capture's graph now orders before whatever `stream` captures next are free for
/// it, with no event (capture_order.hpp). Each such block was allocated on `stream` from a
/// graph pool, whose chunks serve their own stream alone.
void cudamem_torch_allocator::reclaim_in_capture(std::unique_lock<std::mutex>& lock,
                                                 cudaStream_t stream) {
  if (deferred_with_markers_ == 0) {
    return;  // the common case (no record_stream free in this capture): no lookups at all
  }
  // One pass: the ready blocks leave live_ and deferred_ together, before any is completed.
  std::vector<block> ready;
  std::size_t still_marked = 0;
  auto kept = deferred_.begin();
  for (void* p : deferred_) {
    const auto it = live_.find(p);
    if (it == live_.end()) {
      continue;  // already gone with its pool
    }
    block& b = it->second;
    if (b.stream == stream && !b.rare().free_markers.empty() &&
        capture_order_.all_before_next(stream, b.rare().free_markers)) {
      ready.push_back(std::move(b));
      live_.erase(it);
      continue;
    }
    still_marked += b.rare().free_markers.empty() ? 0 : 1;
    *kept++ = p;
  }
  deferred_.erase(kept, deferred_.end());
  deferred_with_markers_ = still_marked;
  for (block& done : ready) {
    if (done.extra) {
      done.extra->uses.clear();  // the graph orders them: no event to wait for
    }
    complete_free(lock, std::move(done));
  }
}

/// Frees that waited for the captures to end: their events now, or the free itself.
void cudamem_torch_allocator::finish_deferred(std::unique_lock<std::mutex>& lock) {
  capture_order_.forget();
  std::vector<void*> deferred = std::move(deferred_);
  deferred_.clear();
  deferred_with_markers_ = 0;
  for (void* p : deferred) {
    auto it = live_.find(p);
    if (it == live_.end()) {
      continue;
    }
    block& b = it->second;
    if (b.extra) {
      b.extra->free_markers.clear();
    }
    if (!b.has_uses()) {
      block done = std::move(b);
      live_.erase(it);
      complete_free(lock, std::move(done));
      continue;
    }
    wait_for_uses(b);
    pending_.push_back(p);
  }
  refresh_plain_malloc();
}


}  // namespace
