// cudamem/_torch/allocator_malloc.hpp — how a request becomes a block: PyTorch's rounding, the
// pool it goes to (the newest capture or use_mem_pool whose filter takes its stream, else
// cudamem's stack), the memory fraction, what is freed before a request fails, and the
// out-of-memory error PyTorch's callers expect.
//
//   x = torch.empty(n, device="cuda")   # allocate(n) -> malloc(device, n, current stream)
//
// Owns: allocate, raw_alloc(_with_stream), getBaseAllocation, malloc, the uncached path
// (torch.cuda's allocator disabled), the record of live blocks (remember / forget /
// find_containing), try_free_memory and out_of_memory (with the OOM observers, and from
// PyTorch 2.12 the OOM rejection observers: cudamem refuses a request past the memory fraction
// before it allocates, as PyTorch's throw_on_cudamalloc_oom policy does).
#pragma once

#include "allocator_class.hpp"

#include <algorithm>
#include <cstring>
#include <utility>

namespace {

// --- PyTorch's entry points --------------------------------------------------------------------

c10::DataPtr cudamem_torch_allocator::allocate(std::size_t n) {
  const DeviceIndex device = c10::cuda::current_device();
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device).stream();
  if (!enabled_) {
    void* p = uncached_malloc(n, device);
    return {p, p, &delete_uncached, c10::Device(c10::DeviceType::CUDA, device)};
  }
  void* p = malloc(device, n, stream);
  return {p, p, &delete_block, c10::Device(c10::DeviceType::CUDA, device)};
}

void* cudamem_torch_allocator::raw_alloc(std::size_t nbytes) {
  const DeviceIndex device = c10::cuda::current_device();
  return raw_alloc_with_stream(nbytes, c10::cuda::getCurrentCUDAStream(device).stream());
}

void* cudamem_torch_allocator::raw_alloc_with_stream(std::size_t nbytes, cudaStream_t stream) {
  const DeviceIndex device = c10::cuda::current_device();
  if (!enabled_) {
    return uncached_malloc(nbytes, device);
  }
  return malloc(device, nbytes, stream);
}

void* cudamem_torch_allocator::getBaseAllocation(void* ptr, std::size_t* size) {
  const std::lock_guard lock(mutex_);
  const block* b = find_containing(ptr);
  TORCH_CHECK(b != nullptr, "invalid device pointer: ", ptr);
  if (size != nullptr) {
    *size = b->size;
  }
  return b->address;
}

// --- torch.cuda's allocator disabled: plain cudaMalloc ------------------------------------------

void* cudamem_torch_allocator::uncached_malloc(std::size_t n, DeviceIndex device) {
  if (n == 0) {
    return nullptr;
  }
  const c10::cuda::CUDAGuard on{device};
  void* p = nullptr;
  C10_CUDA_CHECK(cudaMalloc(&p, n));
  const std::lock_guard lock(mutex_);
  uncached_.insert(p);
  return p;
}

void cudamem_torch_allocator::free_uncached(void* ptr) {
  if (ptr == nullptr) {
    return;
  }
  {
    const std::lock_guard lock(mutex_);
    TORCH_CHECK(uncached_.erase(ptr) == 1, "invalid device pointer: ", ptr);
  }
  C10_CUDA_CHECK(cudaFree(ptr));
}

// --- the record of live blocks -------------------------------------------------------------------

/// live_[p] = b, in a spare node if there is one.
cudamem_torch_allocator::block& cudamem_torch_allocator::remember(void* p, block b) {
  if (spare_nodes_.empty()) {
    return live_.emplace(p, std::move(b)).first->second;
  }
  auto node = std::move(spare_nodes_.back());
  spare_nodes_.pop_back();
  node.key() = p;
  node.mapped() = std::move(b);
  return live_.insert(std::move(node)).position->second;
}

/// Erases `it` (its block moved out already), keeping the node for remember().
void cudamem_torch_allocator::forget(std::unordered_map<void*, block>::iterator it) {
  constexpr std::size_t kept_nodes = 4096;  // a training step frees ~700 blocks
  if (spare_nodes_.size() < kept_nodes) {
    spare_nodes_.push_back(live_.extract(it));
  } else {
    live_.erase(it);
  }
}

/// The pool a request on `stream` goes to: the newest capture whose filter takes it.
MempoolId_t cudamem_torch_allocator::route(DeviceIndex device, cudaStream_t stream) {
  for (auto c = captures_.rbegin(); c != captures_.rend(); ++c) {
    if (c->device == device && c->filter(stream)) {
      return c->pool;
    }
  }
  return default_pool;
}

cudamem_torch_allocator::block* cudamem_torch_allocator::find_containing(const void* ptr) {
  if (const auto it = live_.find(const_cast<void*>(ptr)); it != live_.end()) {
    return &it->second;
  }
  const auto a = reinterpret_cast<std::uintptr_t>(ptr);
  for (auto& [p, b] : live_) {  // an interior pointer: rare (IPC of a storage's view)
    const auto start = reinterpret_cast<std::uintptr_t>(p);
    if (a >= start && a < start + b.size) {
      return &b;
    }
  }
  return nullptr;
}

// --- a request ----------------------------------------------------------------------------

void* cudamem_torch_allocator::malloc(DeviceIndex device, std::size_t n, cudaStream_t stream) {
  const cudamem::torch_bridge::call_timer timed(time_calls_, malloc_times_);
  TORCH_CHECK_WITH(OutOfMemoryError, n < (std::size_t{1} << 60),
                   "CUDA out of memory. Tried to allocate more than 1EB memory.");
  if (n == 0) {
    return nullptr;
  }
  // PyTorch's roundup_power2_divisions setting (PYTORCH_CUDA_ALLOC_CONF), as its allocator
  // applies it: without it, a multiple of 512 bytes.
  const std::size_t size = cudamem::torch_bridge::rounded_block_size(
      n, roundup_divisions(n));
  std::shared_ptr<c10::GatheredContext> context = maybe_gather(hist::RecordContext::STATE);
  const bool watch_segments = recording();
  std::vector<std::vector<span>> segments_before =
      watch_segments ? all_segments() : std::vector<std::vector<span>>{};

  // The common case takes the lock once, after the allocation: no free waits for a stream,
  // no capture or MemPool routes requests, no memory fraction is set (plain_malloc_, kept by
  // refresh_plain_malloc() wherever one of those changes). A capture begun meanwhile on
  // another thread orders after this request, as if it had begun a moment later.
  bool refused = false;  // tried here and the device had no room: the path below goes on
  std::string cause;
  if (plain_malloc_.load(std::memory_order_acquire) && device >= 0 &&
      device < known_devices_.load(std::memory_order_acquire)) {
    void* p = nullptr;
    const cudamem_status s = cudamem_allocate(process_allocator, size, device, stream, &p);
    if (s == CUDAMEM_OK) {
      std::unique_lock lock(mutex_);
      return hand_out(lock, p, size, n, device, stream, default_pool, std::move(context),
                      watch_segments ? &segments_before : nullptr);
    }
    if (s != CUDAMEM_ERROR_OUT_OF_MEMORY) {
      check_status(s, "allocation");
    }
    refused = true;
    cause = last_error();
  }

  std::unique_lock lock(mutex_);
  check_device(device);
  if (!pending_.empty() && captures_.empty()) {
    finish_pending_frees(lock, /*wait=*/false);
  }
  device_state& d = devices_[device];
  const MempoolId_t pool = captures_.empty() ? default_pool : route(device, stream);
  if (pool != default_pool) {
    reclaim_in_capture(lock, stream);
  }
  void* p = nullptr;
  std::size_t block_size = size;
  bool past_fraction = false;  // refused by the memory fraction, before any device allocation
  for (int attempt = 0;; ++attempt) {
    const std::optional<std::size_t> room = room_under_fraction(device);
    if (pool == default_pool && room && size > *room) {
      cause = fraction_cause(device, size);  // as a failed allocation: the pools may lend
      past_fraction = true;
    } else if (pool == default_pool && std::exchange(refused, false)) {
      // Refused above a moment ago, with the same cause: free what can be freed first.
    } else if (pool == default_pool) {
      lock.unlock();
      const cudamem_status s = cudamem_allocate(process_allocator, size, device, stream, &p);
      lock.lock();
      if (s != CUDAMEM_OK && s != CUDAMEM_ERROR_OUT_OF_MEMORY) {
        lock.unlock();
        check_status(s, "allocation");
      }
      if (s == CUDAMEM_ERROR_OUT_OF_MEMORY) {
        cause = last_error();
      }
    } else {
      pool_state& ps = pools_.at(pool);
      adopt_active_mem_pool_allocator(ps, pool);
      block_size = ps.pool.block_size_for(size);
      chunks_within_fraction source(ps.chunks, room);
      p = ps.pool.allocate(size, stream, source);
      if (p == nullptr && source.refused()) {
        cause = fraction_cause(device, ps.pool.chunk_size_for(size));
        past_fraction = true;
      } else if (p == nullptr) {
        cause = "the memory pool " + pool_name(pool) + " could not get a chunk of " +
                size_text(ps.pool.chunk_size_for(size)) + " (" +
                (ps.chunks.custom() ? std::string("its allocator returned none")
                                    : last_error()) + ")";
      } else if (const std::uintptr_t base = ps.pool.last_new_chunk(); base != 0) {
        const graph_pool::chunk& c = ps.pool.chunks().at(base);
        d.figures.segment.increase(c.small ? cudamem::torch_bridge::small_pool
                                           : cudamem::torch_bridge::large_pool, 1);
        record_trace(hist::TraceEntry::SEGMENT_ALLOC, device, base, c.bytes, stream, pool,
                     context);
      }
    }
    if (p != nullptr) {
      break;
    }
    if (attempt == 0 && try_free_memory(lock, device)) {
      ++d.figures.num_alloc_retries;
      continue;
    }
    // Pools marked use_on_oom lend their free blocks before the request fails.
    if (pool == default_pool) {
      for (auto& [id, ps] : pools_) {
        no_chunks none;
        if (ps.use_on_oom && ps.device == device && (p = ps.pool.allocate(size, stream, none))) {
          block_size = ps.pool.block_size_for(size);
          ++ps.live_blocks;
          device_figures& f = d.figures;
          f.on_allocate(block_size, n);
          live_.emplace(p, block{p, block_size, n, device, stream, id, std::move(context)});
          record_trace(hist::TraceEntry::ALLOC, device, reinterpret_cast<std::uintptr_t>(p), n,
                       stream, id, live_.at(p).context);
          return p;
        }
      }
    }
    lock.unlock();
    out_of_memory(device, size, stream, pool, cause, past_fraction, context);
  }
  if (pool != default_pool) {
    ++pools_.at(pool).live_blocks;
  }
  return hand_out(lock, p, block_size, n, device, stream, pool, std::move(context),
                  watch_segments ? &segments_before : nullptr);
}

/// The allocation's record, figures and trace (under `lock`, which it lets go), then what
/// PyTorch's profiler and GPU trace are told; returns `p`. `segments_before`: the segments
/// before the request, when the history watches them (else null).
void* cudamem_torch_allocator::hand_out(std::unique_lock<std::mutex>& lock, void* p,
                                        std::size_t block_size, std::size_t n,
                                        DeviceIndex device, cudaStream_t stream,
                                        MempoolId_t pool,
                                        std::shared_ptr<c10::GatheredContext> context,
                                        const std::vector<std::vector<span>>* segments_before) {
  device_state& d = devices_[device];
  d.figures.on_allocate(block_size, n);
  block& b = remember(p, block{p, block_size, n, device, stream, pool, std::move(context)});
  record_trace(hist::TraceEntry::ALLOC, device, reinterpret_cast<std::uintptr_t>(p), n, stream,
               pool, b.context);
  const std::size_t allocated = static_cast<std::size_t>(d.figures.allocated_bytes[0].current);
  const std::size_t reserved = d.last_reserved;
  lock.unlock();
  if (segments_before != nullptr) {
    note_segment_changes(*segments_before, stream, nullptr);
  }
  c10::reportMemoryUsageToProfiler(p, static_cast<std::int64_t>(block_size), allocated, reserved,
                                   c10::Device(c10::DeviceType::CUDA, device));
  if (const c10::impl::PyInterpreter* interp = c10::impl::GPUTrace::get_trace()) {
    (*interp)->trace_gpu_memory_allocation(c10::DeviceType::CUDA,
                                           reinterpret_cast<std::uintptr_t>(p));
  }
  return p;
}

/// Frees memory before a request fails: waits for pending frees, runs PyTorch's callbacks
/// (IPC blocks other processes let go of), gives back dead pools. True if anything was freed.
bool cudamem_torch_allocator::try_free_memory(std::unique_lock<std::mutex>& lock,
                                              DeviceIndex /*device*/) {
  bool freed = false;
  if (captures_.empty() && !pending_.empty()) {
    finish_pending_frees(lock, /*wait=*/true);
    freed = true;
  }
  lock.unlock();
  for (const std::string& key : c10::FreeCudaMemoryCallbacksRegistry()->Keys()) {
    freed = c10::FreeCudaMemoryCallbacksRegistry()->Create(key)->Execute() || freed;
  }
  lock.lock();
  if (captures_.empty()) {
    const std::size_t pools = pools_.size();
    release_dead_pools(default_pool, false);
    freed = freed || pools_.size() != pools;
  }
  return freed;
}

void cudamem_torch_allocator::out_of_memory(
    DeviceIndex device, std::size_t size, cudaStream_t stream, MempoolId_t pool,
    std::string cause, bool past_fraction, const std::shared_ptr<c10::GatheredContext>& context) {
  std::size_t free = 0;
  std::size_t total = 0;
  {
    const c10::cuda::CUDAGuard on{device};
    static_cast<void>(cudaMemGetInfo(&free, &total));
    static_cast<void>(cudaGetLastError());
  }
  std::size_t needed = 0;
  std::string report;
  if (cudamem_report(process_allocator, device, size, nullptr, 0, &needed) == CUDAMEM_OK) {
    report.resize(needed);
    if (cudamem_report(process_allocator, device, size, report.data(), needed, &needed) ==
        CUDAMEM_OK) {
      report.resize(needed - 1);
    }
  }
  std::vector<cca::OutOfMemoryObserver> observers;
#if CUDAMEM_TORCH_AT_LEAST(2, 12)
  std::vector<cca::OomRejectionObserver> rejection_observers;
  std::size_t held = 0;
#endif
  std::string message;
  std::size_t allowed_or_total = total;
  {
    const std::lock_guard lock(mutex_);
    device_state& d = devices_[device];
    if (d.allowed) {
      allowed_or_total = *d.allowed;
    }
    const auto allocated = static_cast<std::size_t>(d.figures.allocated_bytes[0].current);
    std::size_t in_pools = 0;
    for (const auto& [id, b] : live_) {
      if (b.device == device && b.pool != default_pool && !b.pending) {
        in_pools += b.size;
      }
    }
    message = "CUDA out of memory. Tried to allocate " + size_text(size) + ". GPU " +
              std::to_string(device) + " has a total capacity of " + size_text(total) +
              " of which " + size_text(free) + " is free. " +
              (d.allowed ? size_text(*d.allowed) + " allowed; " : std::string()) +
              "Of the allocated memory " + size_text(allocated) + " is allocated by PyTorch" +
              (in_pools != 0 ? ", with " + size_text(in_pools) +
                                   " allocated in private pools (e.g., CUDA Graphs)"
                             : std::string()) +
              ", in cudamem's memory.\n" + (cause.empty() ? std::string() : cause + "\n") +
              report;
    last_oom_report_ = message;
    ++d.figures.num_ooms;
    record_trace(hist::TraceEntry::OOM, device, free, size, stream, pool, context);
    observers = oom_observers_;
#if CUDAMEM_TORCH_AT_LEAST(2, 12)
    if (past_fraction) {  // refused before any device allocation: PyTorch 2.12's rejection
      ++d.oom_rejections;
      rejection_observers = oom_rejection_observers_;
      held = held_under_fraction(device);
    }
#endif
  }
  c10::reportOutOfMemoryToProfiler(static_cast<std::int64_t>(size),
                                   static_cast<std::size_t>(0), static_cast<std::size_t>(0),
                                   c10::Device(c10::DeviceType::CUDA, device));
#if CUDAMEM_TORCH_AT_LEAST(2, 12)
  for (const auto& observer : rejection_observers) {  // (device, size, held, device total)
    observer(device, size, held, total);
  }
#else
  static_cast<void>(past_fraction);
#endif
  for (const auto& observer : observers) {  // may take the GIL, may throw: outside the lock
    observer(device, size, allowed_or_total, free);
  }
  TORCH_CHECK_WITH(OutOfMemoryError, false, message);
}

}  // namespace
