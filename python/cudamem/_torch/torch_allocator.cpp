// cudamem/_torch/torch_allocator.cpp — cudamem as PyTorch's CUDA allocator: the whole of
// c10::cuda::CUDACachingAllocator::CUDAAllocator over libcudamem_c, so that a program runs
// under cudamem.torch.install() as it does under PyTorch's own allocator: memory statistics,
// snapshots and history, CUDA graphs and their pools, torch.compile's CUDA graph trees, the
// memory fraction, copies between GPUs, tensors sent to other processes. PyTorch 2.7 to 2.15.
//
//   # Python: cudamem.torch.install() builds this file against the installed PyTorch (once per
//   # version, cached) and calls cudamem_torch_allocator_install(...) before PyTorch's first
//   # CUDA allocation.
//   x = torch.empty(1 << 30, device="cuda")     # cudamem's vm_pool, through allocate()
//   torch.cuda.memory_stats()                   # getDeviceStats(): PyTorch's keys
//   with torch.cuda.graph(g): y = f(x)          # beginAllocateToPool: the graph's own pool
//
// The parts, in the order they build on each other:
//   torch_interface.hpp    PyTorch's headers, the version guards, settings in each release's form
//   chunk_sources.hpp      where a graph pool's or MemPool's chunks come from
//   allocator_class.hpp    the class: PyTorch's interface as the release declares it, the state
//   allocator_malloc.hpp   a request: rounding, routing to a pool, the fraction, out of memory
//   allocator_frees.hpp    a free: at once, after other streams (record_stream), after a capture
//   allocator_stats.hpp    memory_stats(), the memory fraction, cudamem's figures
//   allocator_pools.hpp    CUDA graph pools, MemPools, empty_cache, torch.compile's checkpoints
//   allocator_history.hpp  _record_memory_history: events, stacks, annotations
//   allocator_snapshot.hpp memory_snapshot(): cudamem's memory as PyTorch's segments and blocks
//   allocator_ipc.hpp      peer access, copies between GPUs, tensors sent to other processes
// and PyTorch-free parts tested alone (tests/host/test_torch_bridge.cpp): call_timer.hpp,
// capture_order.hpp, graph_pool.hpp, snapshot_layout.hpp, stats.hpp, trace_ring.hpp.
//
// What differs between releases (each guard is CUDAMEM_TORCH_AT_LEAST(major, minor), from
// PyTorch's own version header; a release newer than 2.15 takes the newest path):
//   2.7   base c10::Allocator; emptyCache(), snapshot() of the active MemPoolContext;
//         ensureExistsAndIncrefPool; recordHistory without a clear flag; no compile contexts
//   2.8   emptyCache(pool), snapshot(pool); createOrIncrefPool(raw allocator), setUseOnOOM(on)
//   2.9   base c10::DeviceAllocator; graph_capture_record_stream_reuse
//   2.10  getExpandableSegmentSizes, setNoSplit, user metadata; per_process_memory_fraction
//   2.11  history types in c10::CachingDeviceAllocator; snapshot(pool, traces); shared
//         allocators; setUseOnOOM(bool); recordHistory's skip list
//   2.12  attachOomRejectionObserver (called when the fraction refuses a request),
//         num_oom_rejections, getContextForPointer
//   2.13  reserved bytes per private pool (markCaptureBegin/End and allocateWithAddress keep
//         PyTorch's defaults: no-ops, and "does not yet support")
//   2.14  C++20 headers; supportsUserMetadata, annotateMemory
//
// What each part of PyTorch's interface means here
// - Memory: every block comes from libcudamem_c's allocator 0 (the same per-device stacks as
//   cudamem.torch.stats() and CuPy), in stream order on the stream PyTorch names. Requests are
//   rounded as PyTorch rounds (512 bytes; roundup_power2_divisions when set).
// - Statistics: allocation/active/requested counted here; reserved is what cudamem holds from
//   the device (its mapped memory), with its peak; segments are graph-pool chunks.
// - Graph pools and MemPools: chunks from cudamem, kept for the pool's owner. Allocations go to
//   the newest pool whose filter takes their stream; a pool lives while its use count is above
//   zero or a block of it is live.
// - Out of memory: before failing, pending frees are waited for, PyTorch's free-memory
//   callbacks run (IPC limbo), dead pools go back; then torch.OutOfMemoryError with PyTorch's
//   first line and cudamem's report, the OOM observers called first.
//
// Contract: nothing here is called before init() but install; every public method is
// thread-safe (one mutex; no CUDA call that can block and no Python callback is made under it,
// but for graph pools' chunk growth). Exceptions are c10's (TORCH_CHECK): PyTorch's callers
// expect them. A destructor's path (releasePool, setUseOnOOM) never throws.
#include "torch_interface.hpp"
#include "chunk_sources.hpp"
#include "allocator_class.hpp"
#include "allocator_malloc.hpp"
#include "allocator_frees.hpp"
#include "allocator_stats.hpp"
#include "allocator_pools.hpp"
#include "allocator_history.hpp"
#include "allocator_snapshot.hpp"
#include "allocator_ipc.hpp"

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>

namespace {

void delete_block(void* ptr) { the_allocator->free(ptr); }
void delete_uncached(void* ptr) { the_allocator->free_uncached(ptr); }

/// Kept for the life of the process (PyTorch keeps a raw pointer in SetAllocator).
std::shared_ptr<cudamem_torch_allocator>& installed() {
  static auto* kept = new std::shared_ptr<cudamem_torch_allocator>();
  return *kept;
}

void copy_text(const std::string& text, char* buf, std::size_t size) {
  if (buf != nullptr && size > 0) {
    const std::size_t n = std::min(text.size(), size - 1);
    std::memcpy(buf, text.data(), n);
    buf[n] = '\0';
  }
}

}  // namespace

// --- the C entry points cudamem.torch calls (ctypes): no exception crosses them ------------------

extern "C" __attribute__((visibility("default"))) int cudamem_torch_allocator_install(
    const char* resource, char* error, std::size_t error_size) {
  try {
    if (installed()) {
      return 0;
    }
    auto made = std::make_shared<cudamem_torch_allocator>(resource != nullptr ? resource : "");
    torch::cuda::CUDAPluggableAllocator::changeCurrentAllocator(made);
    // Also the allocator PyTorch's device-generic code asks for (torch.accelerator.*):
    // changeCurrentAllocator sets only the CUDA one.
    c10::SetAllocator(c10::DeviceType::CUDA, made.get(), /*priority=*/1);
    the_allocator = made.get();
    installed() = std::move(made);
    return 0;
  } catch (const std::exception& e) {
    copy_text(e.what(), error, error_size);
  } catch (...) {
    copy_text("unknown exception", error, error_size);
  }
  return 1;
}

extern "C" __attribute__((visibility("default"))) std::size_t cudamem_torch_allocator_last_oom(
    char* buf, std::size_t size) {
  try {
    const std::string text = the_allocator != nullptr ? the_allocator->last_oom_report() : "";
    copy_text(text, buf, size);
    return text.size() + 1;
  } catch (...) {
    return 0;
  }
}

extern "C" __attribute__((visibility("default"))) int cudamem_torch_allocator_time_calls(int on) {
  if (the_allocator == nullptr) {
    return 1;
  }
  the_allocator->time_calls(on != 0);
  return 0;
}

/// out[4]: allocations, their host ns, frees, their host ns (time_calls). 1: not installed.
extern "C" __attribute__((visibility("default"))) int cudamem_torch_allocator_call_times(
    std::uint64_t* out) {
  if (the_allocator == nullptr || out == nullptr) {
    return 1;
  }
  const std::array<std::uint64_t, 4> times = the_allocator->call_times();
  std::copy(times.begin(), times.end(), out);
  return 0;
}
