// cudamem/_torch/torch_allocator.cpp — cudamem as PyTorch's CUDA allocator: the whole of
// c10::cuda::CUDACachingAllocator::CUDAAllocator over libcudamem_c, so that a program runs
// under cudamem.torch.install() as it does under PyTorch's own allocator: memory statistics,
// snapshots and history, CUDA graphs and their pools, torch.compile's CUDA graph trees, the
// memory fraction, copies between GPUs, tensors sent to other processes.
//
//   # Python: cudamem.torch.install() builds this file against the installed PyTorch (once per
//   # version, cached) and calls cudamem_torch_allocator_install(...) before PyTorch's first
//   # CUDA allocation.
//   x = torch.empty(1 << 30, device="cuda")     # cudamem's vm_pool, through allocate() below
//   torch.cuda.memory_stats()                   # getDeviceStats(): PyTorch's keys, cudamem's memory
//   with torch.cuda.graph(g): y = f(x)          # beginAllocateToPool: the graph's own pool
//
// What each part of PyTorch's interface means here
// - Memory: every block comes from libcudamem_c's allocator 0 (the same per-device stacks as
//   cudamem.torch.stats() and CuPy), in stream order on the stream PyTorch names. Requests are
//   rounded as PyTorch rounds (512 bytes; roundup_power2_divisions when set), so that tensor
//   sizes add up as users expect.
// - Statistics (stats.hpp): allocation/active/requested counted here; reserved is what cudamem
//   holds from the device (its mapped memory), with its peak; segments are graph-pool chunks.
// - Graph pools and MemPools (graph_pool.hpp): chunks from cudamem, kept for the pool's owner.
//   Allocations go to the newest pool whose filter takes their stream (beginAllocateToPool);
//   a pool lives while its use count is above zero or a block of it is live.
// - Frees that wait for other streams (Tensor.record_stream): events on those streams, polled
//   at later allocations, never while a stream is being captured (an event query would break
//   the capture); frees during a capture that would need one wait until it ends.
// - Out of memory: before failing, pending frees are waited for, PyTorch's free-memory
//   callbacks run (IPC limbo), dead pools go back; then torch.OutOfMemoryError with PyTorch's
//   first line and cudamem's report, the OOM observers called first.
// - Snapshots (snapshot_layout.hpp): segments are cudamem's mapped ranges (PyTorch's
//   "expandable" segments) and graph-pool chunks; blocks the tensors, gaps "inactive".
// - Several GPUs: enablePeerAccess gives the peer access to the virtual memory of cudamem's
//   stack too (cudaDeviceEnablePeerAccess covers only cudaMalloc'd memory).
// - Other processes: handles in PyTorch's own format (POSIX file descriptors of the physical
//   memory, as expandable segments share), so a receiver with or without cudamem maps them.
//
// Contract: nothing here is called before init() but install; every public method is
// thread-safe (one mutex; no CUDA call that can block and no Python callback is made under it,
// but for graph pools' chunk growth). Exceptions are c10's (TORCH_CHECK): PyTorch's callers
// expect them. A destructor's path (releasePool, setUseOnOOM) never throws.
#include <c10/core/Allocator.h>
#include <c10/core/AllocatorConfig.h>
#include <c10/core/impl/GPUTrace.h>
#include <c10/cuda/CUDAAllocatorConfig.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/ApproximateClock.h>
#include <c10/util/Exception.h>
#include <torch/csrc/cuda/CUDAPluggableAllocator.h>

#include <cuda_runtime_api.h>
#include <cudamem_c.h>

#include "capture_order.hpp"
#include "graph_pool.hpp"
#include "snapshot_layout.hpp"
#include "stats.hpp"
#include "trace_ring.hpp"

#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <type_traits>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

namespace {

namespace cca = c10::cuda::CUDACachingAllocator;
namespace cda = c10::CachingDeviceAllocator;
using c10::DeviceIndex;
using c10::MempoolId_t;
using cudamem::torch_bridge::device_figures;
using cudamem::torch_bridge::graph_pool;
using cudamem::torch_bridge::span;

constexpr MempoolId_t default_pool{0, 0};
constexpr int process_allocator = 0;  // libcudamem_c's allocator 0

std::string last_error() { return cudamem_last_error(); }

/// PyTorch's `graph_capture_record_stream_reuse` setting (PYTORCH_CUDA_ALLOC_CONF), where the
/// PyTorch compiled against has it (2.9 and later); false where it does not.
template <class Config, class = void>
struct has_capture_reuse_setting : std::false_type {};
template <class Config>
struct has_capture_reuse_setting<
    Config, std::void_t<decltype(Config::graph_capture_record_stream_reuse())>>
    : std::true_type {};

bool capture_reuse_setting() {
  using config = c10::cuda::CUDACachingAllocator::CUDAAllocatorConfig;
  if constexpr (has_capture_reuse_setting<config>::value) {
    return config::graph_capture_record_stream_reuse();
  } else {
    return false;
  }
}

/// A cudamem status that is not OK as PyTorch's exception (out of memory is handled apart).
void check_status(cudamem_status s, const char* what) {
  TORCH_CHECK(s == CUDAMEM_OK, "cudamem: ", what, ": ", last_error());
}

/// Bytes as PyTorch prints them ("1.50 GiB"), without iostreams: a compiler that links its own
/// libstdc++ statically crashed formatting a double through a stream in PyTorch's process.
std::string size_text(std::uint64_t bytes) {
  char text[64];
  if (bytes <= 1024) {
    std::snprintf(text, sizeof(text), "%llu bytes", static_cast<unsigned long long>(bytes));
  } else if (bytes <= (std::uint64_t{1} << 20)) {
    std::snprintf(text, sizeof(text), "%.2f KiB", static_cast<double>(bytes) / 1024.0);
  } else if (bytes <= (std::uint64_t{1} << 30)) {
    std::snprintf(text, sizeof(text), "%.2f MiB", static_cast<double>(bytes) / 1048576.0);
  } else {
    std::snprintf(text, sizeof(text), "%.2f GiB", static_cast<double>(bytes) / 1073741824.0);
  }
  return text;
}

std::string fraction_text(double f) {
  char text[32];
  std::snprintf(text, sizeof(text), "%g", f);
  return text;
}

std::string pool_name(MempoolId_t id) {
  return "(" + std::to_string(id.first) + ", " + std::to_string(id.second) + ")";
}

/// The IPC handle format PyTorch's own allocator writes and reads (version 2).
constexpr char ipc_version = 2;
constexpr char ipc_cuda_malloc = 'c';
constexpr char ipc_expandable = 'e';
struct ipc_share_header {  // as PyTorch's expandable segments write it: 24 bytes
  std::int32_t pid;
  std::int32_t padding;
  std::uint64_t segment_size;
  std::uint64_t num_handles;
};
static_assert(sizeof(ipc_share_header) == 24);

class cudamem_torch_allocator;
cudamem_torch_allocator* the_allocator = nullptr;  // the deleter's way back (one per process)
void delete_block(void* ptr);
void delete_uncached(void* ptr);

/// Whether work on `stream` is being captured into a CUDA graph now.
bool is_capturing(cudaStream_t stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  const bool active = cudaStreamIsCapturing(stream, &status) == cudaSuccess &&
                      status == cudaStreamCaptureStatusActive;
  static_cast<void>(cudaGetLastError());
  return active;
}

/// This thread's stream-capture interaction mode, relaxed for a scope: what cudamem does to
/// find a chunk (a query, a host wait) is then not taken for part of a capture elsewhere.
class relaxed_capture_mode {
 public:
  relaxed_capture_mode() { C10_CUDA_CHECK(cudaThreadExchangeStreamCaptureMode(&previous_)); }
  ~relaxed_capture_mode() { static_cast<void>(cudaThreadExchangeStreamCaptureMode(&previous_)); }
  relaxed_capture_mode(const relaxed_capture_mode&) = delete;
  relaxed_capture_mode& operator=(const relaxed_capture_mode&) = delete;

 private:
  cudaStreamCaptureMode previous_ = cudaStreamCaptureModeRelaxed;
};

/// A stream of the allocator's own on `device` (made once, kept for the process): where a graph
/// pool's chunk is asked for while the requesting stream is captured. Its table is never
/// destroyed, as the allocator is not: graphs torn down at exit still reach it.
cudaStream_t chunk_stream(DeviceIndex device) {
  struct stream_table {
    std::mutex mutex;
    std::map<DeviceIndex, cudaStream_t> streams;
  };
  static auto* const table = new stream_table;
  const std::lock_guard lock(table->mutex);
  cudaStream_t& s = table->streams[device];
  if (s == nullptr) {
    const c10::cuda::CUDAGuard on{device};
    C10_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  }
  return s;
}

/// A chunk source for a graph pool: cudamem's stack, or a MemPool's own allocator.
///
/// A chunk asked for during a capture: cudamem may have to order it after work of other
/// streams that last used the memory (a cudaStreamWaitEvent, or a host wait). Made on the
/// capturing stream, such a wait would join uncaptured work to the graph (the capture fails
/// with cudaErrorStreamCaptureIsolation). So the chunk is asked for on the allocator's own
/// stream, in relaxed capture mode, and that stream is synchronised: the memory is idle before
/// the graph can first run. (PyTorch's allocator, for the same reason, calls cudaMalloc there
/// in relaxed mode.)
class pool_chunks final : public cudamem::torch_bridge::chunk_source {
 public:
  pool_chunks(DeviceIndex device, std::shared_ptr<cca::CUDAAllocator> custom)
      : device_(device), custom_(std::move(custom)) {}
  void* allocate_chunk(std::size_t bytes, void* stream) override {
    if (custom_) {
      const c10::cuda::CUDAGuard on{device_};
      return custom_->raw_alloc_with_stream(bytes, static_cast<cudaStream_t>(stream));
    }
    const bool capturing = is_capturing(static_cast<cudaStream_t>(stream));
    std::optional<relaxed_capture_mode> relaxed;
    if (capturing) {
      relaxed.emplace();
    }
    void* const on = capturing ? static_cast<void*>(chunk_stream(device_)) : stream;
    void* p = nullptr;
    const cudamem_status s = cudamem_allocate(process_allocator, bytes, device_, on, &p);
    if (s == CUDAMEM_ERROR_OUT_OF_MEMORY) {
      return nullptr;
    }
    check_status(s, capturing ? "a graph pool's chunk (during a capture)" : "a graph pool's chunk");
    if (capturing) {
      const cudaError_t done = cudaStreamSynchronize(static_cast<cudaStream_t>(on));
      if (done != cudaSuccess) {
        static_cast<void>(cudaGetLastError());
        static_cast<void>(cudamem_deallocate(process_allocator, p, bytes, device_, on));
        C10_CUDA_CHECK(done);
      }
    }
    return p;
  }
  void deallocate_chunk(void* p, std::size_t bytes, void* stream) noexcept override {
    if (custom_) {
      try {
        custom_->raw_delete(p);
      } catch (const std::exception& e) {
        TORCH_WARN("cudamem: a MemPool's allocator could not free a chunk: ", e.what());
      }
      return;
    }
    if (cudamem_deallocate(process_allocator, p, bytes, device_, stream) != CUDAMEM_OK) {
      TORCH_WARN("cudamem: freeing a graph pool's chunk: ", last_error());
    }
  }
  [[nodiscard]] bool custom() const noexcept { return custom_ != nullptr; }

 private:
  DeviceIndex device_;
  std::shared_ptr<cca::CUDAAllocator> custom_;
};

/// A source with no memory: a use_on_oom pool serves from its free blocks only.
class no_chunks final : public cudamem::torch_bridge::chunk_source {
 public:
  void* allocate_chunk(std::size_t, void*) override { return nullptr; }
  void deallocate_chunk(void*, std::size_t, void*) noexcept override {}
};

/// A pool's chunk source under the memory fraction. PyTorch counts a MemPool's segments (its
/// own allocator's included) against the fraction, so a chunk that would pass it is refused
/// here, before the pool's allocator is asked.
class chunks_within_fraction final : public cudamem::torch_bridge::chunk_source {
 public:
  chunks_within_fraction(chunk_source& source, std::optional<std::size_t> room)
      : source_(source), room_(room) {}
  void* allocate_chunk(std::size_t bytes, void* stream) override {
    if (room_ && bytes > *room_) {
      refused_ = true;
      return nullptr;
    }
    return source_.allocate_chunk(bytes, stream);
  }
  void deallocate_chunk(void* p, std::size_t bytes, void* stream) noexcept override {
    source_.deallocate_chunk(p, bytes, stream);
  }
  /// True if the last chunk asked for was refused by the fraction.
  [[nodiscard]] bool refused() const noexcept { return refused_; }

 private:
  chunk_source& source_;
  std::optional<std::size_t> room_;
  bool refused_ = false;
};

class cudamem_torch_allocator final : public cca::CUDAAllocator {
 public:
  explicit cudamem_torch_allocator(std::string resource) : resource_(std::move(resource)) {}

  // --- c10::Allocator ----------------------------------------------------------------------

  c10::DataPtr allocate(std::size_t n) override {
    const DeviceIndex device = c10::cuda::current_device();
    const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device).stream();
    if (!enabled_) {
      void* p = uncached_malloc(n, device);
      return {p, p, &delete_uncached, c10::Device(c10::DeviceType::CUDA, device)};
    }
    void* p = malloc(device, n, stream);
    return {p, p, &delete_block, c10::Device(c10::DeviceType::CUDA, device)};
  }
  c10::DeleterFnPtr raw_deleter() const override {
    return enabled_ ? &delete_block : &delete_uncached;
  }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    C10_CUDA_CHECK(cudaMemcpy(dest, src, count, cudaMemcpyDeviceToDevice));
  }

  // --- c10::DeviceAllocator ----------------------------------------------------------------

  bool initialized() override { return initialized_; }

  void emptyCache(MempoolId_t id) override {
    std::vector<std::pair<span, DeviceIndex>> unused;
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
      note_segment_changes(before, nullptr, maybe_gather(cda::RecordContext::ALL));
    }
  }

  void recordStream(const c10::DataPtr& ptr, c10::cuda::CUDAStream stream) override {
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

  cda::DeviceStats getDeviceStats(DeviceIndex device) override {
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
    return s;
  }

  void resetAccumulatedStats(DeviceIndex device) override {
    check_device(device);
    const cudamem_stats c = cudamem_figures(device);
    const std::lock_guard lock(mutex_);
    device_figures& f = devices_[device].figures;
    f.reset_accumulated();
    f.reserved_allocated_base = static_cast<std::int64_t>(c.device_allocated_bytes);
    f.reserved_freed_base = static_cast<std::int64_t>(c.device_freed_bytes);
    f.device_alloc_base = static_cast<std::int64_t>(c.device_allocations);
    f.device_free_base = static_cast<std::int64_t>(c.device_frees);
  }

  void resetPeakStats(DeviceIndex device) override {
    check_device(device);
    check_status(cudamem_reset_peak_reserved(process_allocator, device), "reset_peak_memory_stats");
    const std::lock_guard lock(mutex_);
    devices_[device].figures.reset_peaks();
    devices_[device].small_reserved_peak = 0;
  }

  // --- CUDAAllocator -----------------------------------------------------------------------

  void* raw_alloc(std::size_t nbytes) override {
    const DeviceIndex device = c10::cuda::current_device();
    return raw_alloc_with_stream(nbytes, c10::cuda::getCurrentCUDAStream(device).stream());
  }
  void* raw_alloc_with_stream(std::size_t nbytes, cudaStream_t stream) override {
    const DeviceIndex device = c10::cuda::current_device();
    if (!enabled_) {
      return uncached_malloc(nbytes, device);
    }
    return malloc(device, nbytes, stream);
  }
  void raw_delete(void* ptr) override { free(ptr); }

  void init(int device_count) override {
    const std::lock_guard lock(mutex_);
    if (static_cast<int>(devices_.size()) < device_count) {
      devices_.resize(static_cast<std::size_t>(device_count));
      rings_.resize(static_cast<std::size_t>(device_count));
      for (auto& ring : rings_) {
        ring.set_capacity(trace_capacity_);
      }
    }
    initialized_ = true;
    const double fraction = cca::CUDAAllocatorConfig::per_process_memory_fraction();
    if (fraction < 1.0) {
      for (int d = 0; d < device_count; ++d) {
        devices_[d].allowed = static_cast<std::size_t>(fraction * device_total(d));
      }
    }
  }

  double getMemoryFraction(DeviceIndex device) override {
    check_device(device);
    const std::lock_guard lock(mutex_);
    const std::optional<std::size_t> allowed = devices_[device].allowed;
    return allowed ? static_cast<double>(*allowed) / static_cast<double>(device_total(device))
                   : 1.0;
  }

  void setMemoryFraction(double fraction, DeviceIndex device) override {
    check_device(device);
    TORCH_CHECK(fraction >= 0 && fraction <= 1, "invalid fraction:", fraction,
                ". Please set within [0, 1].");
    const std::size_t total = device_total(device);
    const std::lock_guard lock(mutex_);
    devices_[device].fraction = fraction;
    devices_[device].allowed =
        fraction < 1.0 ? std::optional<std::size_t>(static_cast<std::size_t>(fraction * total))
                       : std::nullopt;
  }

  std::vector<cca::StreamSegmentSize> getExpandableSegmentSizes(DeviceIndex device) override {
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

  void enable(bool value) override { enabled_ = value; }
  bool isEnabled() const override { return enabled_; }

  void cacheInfo(DeviceIndex device, std::size_t* largest) override {
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

  void* getBaseAllocation(void* ptr, std::size_t* size) override {
    const std::lock_guard lock(mutex_);
    const block* b = find_containing(ptr);
    TORCH_CHECK(b != nullptr, "invalid device pointer: ", ptr);
    if (size != nullptr) {
      *size = b->size;
    }
    return b->address;
  }

  void recordStream(const c10::DataPtr& ptr, c10::Stream stream) override {
    recordStream(ptr, c10::cuda::CUDAStream(stream));
  }

  cca::SnapshotInfo snapshot(MempoolId_t id, bool include_traces) override;

  void beginAllocateToPool(DeviceIndex device, MempoolId_t id,
                           std::function<bool(cudaStream_t)> filter) override {
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
  }

  void endAllocateToPool(DeviceIndex device, MempoolId_t id) override {
    std::unique_lock lock(mutex_);
    const auto it = std::find_if(captures_.begin(), captures_.end(), [&](const capture& c) {
      return c.device == device && c.pool == id;
    });
    TORCH_CHECK(it != captures_.end(), "endAllocatePool: not currently recording to mempool_id");
    captures_.erase(it);
    if (captures_.empty()) {
      finish_deferred(lock);  // frees that had to wait for the capture to end
    }
  }

  void releasePool(DeviceIndex device, MempoolId_t id) override {
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

  int getPoolUseCount(DeviceIndex /*device*/, MempoolId_t id) override {
    const std::lock_guard lock(mutex_);
    const auto it = pools_.find(id);
    TORCH_CHECK(it != pools_.end(), "Could not find pool of id ", pool_name(id));
    return static_cast<int>(it->second.use_count);
  }

  void createOrIncrefPool(DeviceIndex device, MempoolId_t id,
                          std::shared_ptr<cca::CUDAAllocator> allocator) override {
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

  void setUseOnOOM(DeviceIndex /*device*/, MempoolId_t id, bool use_on_oom) override {
    const std::lock_guard lock(mutex_);  // ~MemPool calls this: never throw
    if (const auto it = pools_.find(id); it != pools_.end()) {
      it->second.use_on_oom = use_on_oom;
    }
  }

  void setNoSplit(DeviceIndex /*device*/, MempoolId_t id) override {
    const std::lock_guard lock(mutex_);
    const auto it = pools_.find(id);
    TORCH_CHECK(it != pools_.end(), "Could not find pool of id ", pool_name(id));
    TORCH_CHECK(!it->second.pool.has_chunks(),
                "cudamem: no_split must be set before the pool holds memory");
    it->second.pool.set_no_split();
  }

  bool checkPoolLiveAllocations(DeviceIndex /*device*/, MempoolId_t id,
                                const std::unordered_set<void*>& expected) override {
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

  cca::ShareableHandle shareIpcHandle(void* ptr) override;
  std::shared_ptr<void> getIpcDevPtr(std::string handle) override;

  bool isHistoryEnabled() override { return record_history_; }

  void recordHistory(bool enabled, cda::CreateContextFn recorder, std::size_t max_entries,
                     cda::RecordContext when, bool clear_history,
                     const std::vector<std::string>& skip_actions) override {
    TORCH_CHECK(when == cda::RecordContext::NEVER || recorder != nullptr,
                "cudamem: recording stacks needs a context recorder");
    const std::lock_guard lock(mutex_);
    record_history_ = enabled;
    recorder_ = enabled ? recorder : nullptr;
    record_context_ = enabled ? when : cda::RecordContext::NEVER;
    trace_capacity_ = std::max<std::size_t>(max_entries, 1);
    for (auto& ring : rings_) {
      ring.set_capacity(trace_capacity_);
    }
    annotations_.set_capacity(trace_capacity_);
    if (!enabled || clear_history) {
      for (auto& ring : rings_) {
        ring.clear();
      }
      annotations_.clear();
    }
    skipped_.clear();
    for (const std::string& name : skip_actions) {
      for (const auto& [text, action] : action_names()) {
        if (name == text) {
          skipped_.insert(action);
        }
      }
    }
  }

  void recordAnnotation(const std::vector<std::pair<std::string, std::string>>& md) override {
    if (!record_history_) {
      return;
    }
    cda::AnnotationEntry e(c10::cuda::current_device(), c10::getApproximateTime());
    for (const auto& [name, value] : md) {
      e.recordUserMetadata(name, value);
    }
    const std::lock_guard lock(mutex_);
    annotations_.push(std::move(e));
  }
  void pushCompileContext(std::string& md) override {
    thread_annotations* mine = annotations_of_this_thread();
    if (record_history_ && mine != nullptr) {
      mine->compile_contexts.push_back(md);
    }
  }
  void popCompileContext() override {
    thread_annotations* mine = annotations_of_this_thread();
    if (mine != nullptr && !mine->compile_contexts.empty()) {
      mine->compile_contexts.pop_back();
    }
  }
  void setUserMetadata(const std::string& metadata) override {
    if (thread_annotations* mine = annotations_of_this_thread()) {
      mine->user_metadata = metadata;
    }
  }
  std::string getUserMetadata() override {
    const thread_annotations* mine = annotations_of_this_thread();
    return mine != nullptr ? mine->user_metadata : std::string{};
  }

  void attachOutOfMemoryObserver(cca::OutOfMemoryObserver observer) override {
    const std::lock_guard lock(mutex_);
    oom_observers_.push_back(std::move(observer));
  }
  void attachAllocatorTraceTracker(cca::AllocatorTraceTracker tracker) override {
    const std::lock_guard lock(mutex_);
    trackers_.push_back(std::move(tracker));
    tracking_ = true;
  }

  void enablePeerAccess(DeviceIndex dev, DeviceIndex dev_to_access) override {
    {
      const c10::cuda::CUDAGuard on{dev};
      const cudaError_t e = cudaDeviceEnablePeerAccess(dev_to_access, 0);
      if (e == cudaErrorPeerAccessAlreadyEnabled) {
        static_cast<void>(cudaGetLastError());
      } else {
        C10_CUDA_CHECK(e);
      }
    }
    // cudamem's memory on dev_to_access is virtual memory: `dev` needs access to its mappings,
    // the present ones and those to come.
    check_status(cudamem_add_peer(process_allocator, dev_to_access, dev), "peer access");
    const std::lock_guard lock(ipc_mutex_);
    for (const auto& [base, m] : imported_) {
      if (m.device == dev_to_access) {
        check_status(cudamem_ipc_add_peer(base, dev), "peer access to an imported block");
      }
    }
  }

  cudaError_t memcpyAsync(void* dst, int dst_device, const void* src, int src_device,
                          std::size_t count, cudaStream_t stream, bool p2p_enabled) override {
    if (p2p_enabled || dst_device == src_device) {
      return cudaMemcpyAsync(dst, src, count, cudaMemcpyDeviceToDevice, stream);
    }
    // Without peer access, virtual memory is copied by the peer form only.
    return cudaMemcpyPeerAsync(dst, dst_device, src, src_device, count, stream);
  }

  std::shared_ptr<cca::AllocatorState> getCheckpointState(DeviceIndex device,
                                                          MempoolId_t id) override;
  cca::CheckpointDelta setCheckpointPoolState(DeviceIndex device,
                                              std::shared_ptr<cca::AllocatorState> pps) override;

  std::string name() override { return "cudamem"; }

  // --- the deleters' entry, and Python's --------------------------------------------------

  void free(void* ptr);
  void free_uncached(void* ptr) {
    if (ptr == nullptr) {
      return;
    }
    {
      const std::lock_guard lock(mutex_);
      TORCH_CHECK(uncached_.erase(ptr) == 1, "invalid device pointer: ", ptr);
    }
    C10_CUDA_CHECK(cudaFree(ptr));
  }
  [[nodiscard]] std::string last_oom_report() {
    const std::lock_guard lock(mutex_);
    return last_oom_report_;
  }

 private:
  struct block {
    block(void* p, std::size_t size_, std::size_t requested_, DeviceIndex device_,
          cudaStream_t stream_, MempoolId_t pool_, std::shared_ptr<c10::GatheredContext> c)
        : address(p), size(size_), requested(requested_), device(device_), stream(stream_),
          pool(pool_), context(std::move(c)) {}
    void* address;
    std::size_t size;       ///< as handed out (rounded)
    std::size_t requested;  ///< as PyTorch asked
    DeviceIndex device;
    cudaStream_t stream;
    MempoolId_t pool;
    std::shared_ptr<c10::GatheredContext> context;
    bool pending = false;  ///< freed by PyTorch, waiting for its uses (record_stream)
    /// What few blocks need: other streams' uses, the events of a free that waits for them,
    /// graph markers, what other processes were given. Kept apart, made on first need, so
    /// that a block's record stays two cache lines: every allocation writes one and every
    /// free reads it, with the framework's work in between evicting it (torch_replay.py).
    struct rare_fields {
      std::vector<cudaStream_t> uses;  ///< other streams (record_stream)
      std::vector<cudaEvent_t> events;  ///< recorded on `uses` at the free
      /// Freed during a capture after record_stream, with graph_capture_record_stream_reuse:
      /// the capture's last nodes on its streams then (capture_order.hpp); empty: none.
      std::vector<cudaGraphNode_t> free_markers;
      std::string ipc_handle;         ///< shared with other processes: the handle given
      std::ptrdiff_t ipc_offset = 0;  ///< and the block's offset in what it maps
      std::vector<int> exported_fds;  ///< open while the block lives (receivers import them)
    };
    std::unique_ptr<rare_fields> extra;  ///< null until one of them is needed

    /// The rare fields to change (made now if they were not).
    rare_fields& more() {
      if (!extra) {
        extra = std::make_unique<rare_fields>();
      }
      return *extra;
    }
    /// The rare fields to read (empty ones if never made).
    [[nodiscard]] const rare_fields& rare() const {
      static const rare_fields none;
      return extra ? *extra : none;
    }
    [[nodiscard]] bool has_uses() const { return extra && !extra->uses.empty(); }
  };
  struct pool_state {
    DeviceIndex device = 0;
    std::size_t use_count = 0;
    graph_pool pool;
    pool_chunks chunks;
    bool use_on_oom = false;
    std::size_t live_blocks = 0;
    pool_state(DeviceIndex d, std::shared_ptr<cca::CUDAAllocator> custom)
        : device(d), chunks(d, std::move(custom)) {}
  };
  struct capture {
    DeviceIndex device;
    MempoolId_t pool;
    std::function<bool(cudaStream_t)> filter;
  };
  struct device_state {
    device_figures figures;
    std::optional<std::size_t> allowed;  ///< the memory fraction's bytes
    double fraction = 1.0;
    std::size_t last_reserved = 0;  ///< cudamem's reserved bytes when last read
    std::int64_t small_reserved_peak = 0;
    std::vector<span> known_segments;  ///< for the history's segment events
  };
  struct imported_mapping {
    DeviceIndex device;
  };
  struct checkpoint final : cca::AllocatorState {
    MempoolId_t pool;
    DeviceIndex device;
    struct live {
      void* address;
      std::size_t size;
      std::size_t requested;
      cudaStream_t stream;
      std::shared_ptr<c10::GatheredContext> context;
    };
    std::vector<live> blocks;
    std::vector<std::uintptr_t> chunks;
  };

  // --- allocation ----------------------------------------------------------------------------

  void* malloc(DeviceIndex device, std::size_t n, cudaStream_t stream);
  /// live_[p] = b, in a spare node if there is one.
  block& remember(void* p, block b) {
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
  void forget(std::unordered_map<void*, block>::iterator it) {
    constexpr std::size_t kept_nodes = 4096;  // a training step frees ~700 blocks
    if (spare_nodes_.size() < kept_nodes) {
      spare_nodes_.push_back(live_.extract(it));
    } else {
      live_.erase(it);
    }
  }
  /// What counts against the memory fraction on `device`, with the lock held. PyTorch counts
  /// its segments. Here: the default pool's live blocks (cudamem's own cache is given back
  /// when they need it, so it is not counted), and every MemPool's and graph pool's chunks,
  /// which only that pool can use.
  [[nodiscard]] std::size_t held_under_fraction(DeviceIndex device) const {
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
  [[nodiscard]] std::optional<std::size_t> room_under_fraction(DeviceIndex device) const {
    const std::optional<std::size_t> allowed = devices_[device].allowed;
    if (!allowed) {
      return std::nullopt;
    }
    const std::size_t held = held_under_fraction(device);
    return held < *allowed ? *allowed - held : 0;
  }
  [[nodiscard]] std::string fraction_cause(DeviceIndex device, std::size_t bytes) const {
    const device_state& d = devices_[device];
    return "the memory fraction set by torch.cuda.set_per_process_memory_fraction(" +
           fraction_text(d.fraction) + ") allows " + size_text(d.allowed.value_or(0)) +
           " on this device; PyTorch's tensors and memory pools hold " +
           size_text(held_under_fraction(device)) + " of it, and " + size_text(bytes) +
           " more would pass it. Verdict: memory fraction. Raise the fraction, or free tensors "
           "(and memory pools) you no longer need.";
  }
  [[noreturn]] void out_of_memory(DeviceIndex device, std::size_t size, cudaStream_t stream,
                                  MempoolId_t pool, std::string cause,
                                  const std::shared_ptr<c10::GatheredContext>& context);
  void complete_free(std::unique_lock<std::mutex>& lock, block b);
  void finish_pending_frees(std::unique_lock<std::mutex>& lock, bool wait);
  void finish_deferred(std::unique_lock<std::mutex>& lock);
  void reclaim_in_capture(std::unique_lock<std::mutex>& lock, cudaStream_t stream);
  void wait_for_uses(block& b);
  void release_dead_pools(MempoolId_t id, bool capturing);
  void release_pool_memory(std::map<MempoolId_t, pool_state>::iterator it);
  bool try_free_memory(std::unique_lock<std::mutex>& lock, DeviceIndex device);

  void* uncached_malloc(std::size_t n, DeviceIndex device) {
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

  /// The pool a request on `stream` goes to: the newest capture whose filter takes it.
  MempoolId_t route(DeviceIndex device, cudaStream_t stream) {
    for (auto c = captures_.rbegin(); c != captures_.rend(); ++c) {
      if (c->device == device && c->filter(stream)) {
        return c->pool;
      }
    }
    return default_pool;
  }

  pool_state& pool_for(DeviceIndex device, MempoolId_t id,
                       std::shared_ptr<cca::CUDAAllocator> custom) {
    auto it = pools_.find(id);
    if (it == pools_.end()) {
      it = pools_.emplace(std::piecewise_construct, std::forward_as_tuple(id),
                          std::forward_as_tuple(device, std::move(custom)))
               .first;
    }
    return it->second;
  }

  block* find_containing(const void* ptr) {
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

  // --- devices and cudamem's figures ------------------------------------------------------

  [[nodiscard]] DeviceIndex device_count() const noexcept {
    return static_cast<DeviceIndex>(devices_.size());
  }
  void check_device(DeviceIndex device) const {
    TORCH_CHECK(device >= 0 && device < device_count(), "Invalid device argument ", device,
                ": did you call init?");
  }
  static std::size_t device_total(int device) {
    const c10::cuda::CUDAGuard on{static_cast<DeviceIndex>(device)};
    std::size_t free = 0;
    std::size_t total = 0;
    C10_CUDA_CHECK(cudaMemGetInfo(&free, &total));
    return total;
  }
  static cudamem_stats cudamem_figures(DeviceIndex device) {
    cudamem_stats s{};
    s.struct_size = sizeof(s);
    check_status(cudamem_get_stats(process_allocator, device, &s), "statistics");
    return s;
  }
  /// cudamem's mapped ranges (or chunks) on `device`; empty when the resource cannot tell.
  static std::vector<span> cudamem_segments_of(DeviceIndex device) {
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
  std::vector<std::vector<span>> all_segments() {
    std::vector<std::vector<span>> out;
    for (DeviceIndex d = 0; d < device_count(); ++d) {
      out.push_back(cudamem_segments_of(d));
    }
    return out;
  }

  static void copy(const cudamem::torch_bridge::stat_array& from, c10::CachingAllocator::StatArray& to) {
    for (std::size_t k = 0; k < 3; ++k) {
      to[k].current = from[k].current;
      to[k].peak = from[k].peak;
      to[k].allocated = from[k].allocated;
      to[k].freed = from[k].freed;
    }
  }

  // --- history --------------------------------------------------------------------------------

  [[nodiscard]] bool recording() const noexcept { return record_history_ || tracking_; }

  /// The caller's stack, when the user asked for stacks at this level (outside the lock: the
  /// recorder takes the GIL).
  std::shared_ptr<c10::GatheredContext> maybe_gather(cda::RecordContext level) {
    const cda::CreateContextFn recorder = recorder_;
    if (recorder == nullptr || static_cast<int>(record_context_.load()) < static_cast<int>(level)) {
      return nullptr;
    }
    return recorder();
  }

  static std::vector<std::pair<const char*, cda::TraceEntry::Action>> action_names() {
    using A = cda::TraceEntry::Action;
    return {{"alloc", A::ALLOC},           {"free_requested", A::FREE_REQUESTED},
            {"free_completed", A::FREE_COMPLETED}, {"segment_alloc", A::SEGMENT_ALLOC},
            {"segment_free", A::SEGMENT_FREE}, {"oom", A::OOM},
            {"snapshot", A::SNAPSHOT}};
  }

  /// Adds an event to the history and tells the trackers (under the lock, as PyTorch does).
  void record_trace(cda::TraceEntry::Action action, DeviceIndex device, std::uintptr_t addr,
                    std::size_t size, cudaStream_t stream, MempoolId_t pool,
                    std::shared_ptr<c10::GatheredContext> context) {
    if (!recording()) {
      return;
    }
    const bool keep_stack = static_cast<int>(record_context_.load()) >=
                            static_cast<int>(cda::RecordContext::ALLOC);
    const thread_annotations* mine = annotations_of_this_thread();
    const bool compiling = mine != nullptr && !mine->compile_contexts.empty();
    cda::TraceEntry te(action, device, addr, size, stream, pool, c10::getApproximateTime(),
                       keep_stack ? std::move(context) : nullptr,
                       compiling ? mine->compile_contexts.back() : "N/A",
                       mine != nullptr ? mine->user_metadata : std::string{});
    for (const auto& tracker : trackers_) {
      tracker(te);
    }
    if (record_history_ && skipped_.count(action) == 0 &&
        device >= 0 && device < device_count()) {
      rings_[device].push(std::move(te));
    }
  }

  /// Segment events for what cudamem mapped or unmapped since `before` (history only).
  void note_segment_changes(const std::vector<std::vector<span>>& before, cudaStream_t stream,
                            const std::shared_ptr<c10::GatheredContext>& context) {
    std::vector<std::vector<span>> after = all_segments();
    const std::lock_guard lock(mutex_);
    for (DeviceIndex d = 0; d < device_count() && d < static_cast<DeviceIndex>(after.size()); ++d) {
      const std::vector<span>& old = d < static_cast<DeviceIndex>(before.size())
                                         ? before[d] : devices_[d].known_segments;
      for (const span& s : cudamem::torch_bridge::subtract(after[d], old)) {
        record_trace(cda::TraceEntry::SEGMENT_MAP, d, s.address, s.bytes, stream, default_pool,
                     context);
      }
      for (const span& s : cudamem::torch_bridge::subtract(old, after[d])) {
        record_trace(cda::TraceEntry::SEGMENT_UNMAP, d, s.address, s.bytes, stream,
                     default_pool, context);
      }
      devices_[d].known_segments = std::move(after[d]);
    }
  }

  /// This thread's compile contexts and user metadata (PyTorch keeps them per thread), or
  /// nullptr once the thread's thread_local objects are destroyed: frees from static
  /// destructors at exit still reach record_trace on the main thread, after them.
  struct thread_annotations {
    std::vector<std::string> compile_contexts;
    std::string user_metadata;
    ~thread_annotations() { gone() = true; }
    static bool& gone() {
      thread_local bool flag = false;  // no destructor: valid to the thread's very end
      return flag;
    }
  };
  static thread_annotations* annotations_of_this_thread() {
    if (thread_annotations::gone()) {
      return nullptr;
    }
    thread_local thread_annotations mine;
    return &mine;
  }

  // --- state --------------------------------------------------------------------------------

  const std::string resource_;     ///< vm_pool, pool or async: what the segments are
  std::mutex mutex_;
  bool initialized_ = false;
  std::atomic<bool> enabled_{true};
  std::vector<device_state> devices_;
  std::unordered_map<void*, block> live_;
  /// Nodes of live_ whose blocks were freed, for the next allocations (remember / forget):
  /// an allocation and a free then cost no host allocation of their own.
  std::vector<std::unordered_map<void*, block>::node_type> spare_nodes_;
  std::unordered_set<void*> uncached_;
  std::vector<void*> pending_;   ///< blocks waiting for their events
  std::vector<void*> deferred_;  ///< frees that wait for the captures to end
  cudamem::torch_bridge::capture_order capture_order_;  ///< for deferred_'s free_markers
  /// How many of deferred_ have free_markers: at least that many, never fewer (a pool's
  /// release may drop some unseen; the next reclaim_in_capture recounts).
  std::size_t deferred_with_markers_ = 0;
  std::map<MempoolId_t, pool_state> pools_;
  std::vector<capture> captures_;  ///< oldest first
  std::string last_oom_report_;
  // History.
  std::atomic<bool> record_history_{false};
  std::atomic<cda::CreateContextFn> recorder_{nullptr};
  std::atomic<cda::RecordContext> record_context_{cda::RecordContext::NEVER};
  std::size_t trace_capacity_ = 1;
  std::vector<cudamem::torch_bridge::trace_ring<cda::TraceEntry>> rings_;
  cudamem::torch_bridge::trace_ring<cda::AnnotationEntry> annotations_;
  std::set<cda::TraceEntry::Action> skipped_;
  std::vector<cca::OutOfMemoryObserver> oom_observers_;
  std::vector<cca::AllocatorTraceTracker> trackers_;
  std::atomic<bool> tracking_{false};  ///< trackers_ is not empty (read without the lock)
  c10::ApproximateClockToUnixTimeConverter clock_;
  // Other processes' memory mapped here (getIpcDevPtr), by base address, and by handle.
  std::mutex ipc_mutex_;
  std::map<void*, imported_mapping> imported_;
  std::unordered_map<std::string, std::weak_ptr<void>> imported_by_handle_;
};

// --- allocation -----------------------------------------------------------------------------

void* cudamem_torch_allocator::malloc(DeviceIndex device, std::size_t n, cudaStream_t stream) {
  TORCH_CHECK_WITH(OutOfMemoryError, n < (std::size_t{1} << 60),
                   "CUDA out of memory. Tried to allocate more than 1EB memory.");
  if (n == 0) {
    return nullptr;
  }
  // PyTorch's roundup_power2_divisions setting (PYTORCH_CUDA_ALLOC_CONF), as its allocator
  // applies it: without it, a multiple of 512 bytes.
  const std::size_t size = cudamem::torch_bridge::rounded_block_size(
      n, c10::CachingAllocator::AcceleratorAllocatorConfig::roundup_power2_divisions(n));
  std::shared_ptr<c10::GatheredContext> context = maybe_gather(cda::RecordContext::STATE);
  const bool watch_segments = recording();
  std::vector<std::vector<span>> segments_before =
      watch_segments ? all_segments() : std::vector<std::vector<span>>{};

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
  std::string cause;
  for (int attempt = 0;; ++attempt) {
    const std::optional<std::size_t> room = room_under_fraction(device);
    if (pool == default_pool && room && size > *room) {
      cause = fraction_cause(device, size);  // as a failed allocation: the pools may lend
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
      block_size = ps.pool.block_size_for(size);
      chunks_within_fraction source(ps.chunks, room);
      p = ps.pool.allocate(size, stream, source);
      if (p == nullptr && source.refused()) {
        cause = fraction_cause(device, ps.pool.chunk_size_for(size));
      } else if (p == nullptr) {
        cause = "the memory pool " + pool_name(pool) + " could not get a chunk of " +
                size_text(ps.pool.chunk_size_for(size)) + " (" +
                (ps.chunks.custom() ? std::string("its allocator returned none")
                                    : last_error()) + ")";
      } else if (const std::uintptr_t base = ps.pool.last_new_chunk(); base != 0) {
        const graph_pool::chunk& c = ps.pool.chunks().at(base);
        d.figures.segment.increase(c.small ? cudamem::torch_bridge::small_pool
                                           : cudamem::torch_bridge::large_pool, 1);
        record_trace(cda::TraceEntry::SEGMENT_ALLOC, device, base, c.bytes, stream, pool,
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
          record_trace(cda::TraceEntry::ALLOC, device, reinterpret_cast<std::uintptr_t>(p), n,
                       stream, id, live_.at(p).context);
          return p;
        }
      }
    }
    lock.unlock();
    out_of_memory(device, size, stream, pool, cause, context);
  }
  if (pool != default_pool) {
    ++pools_.at(pool).live_blocks;
  }
  d.figures.on_allocate(block_size, n);
  block& b = remember(p, block{p, block_size, n, device, stream, pool, std::move(context)});
  record_trace(cda::TraceEntry::ALLOC, device, reinterpret_cast<std::uintptr_t>(p), n, stream,
               pool, b.context);
  const std::size_t allocated = static_cast<std::size_t>(d.figures.allocated_bytes[0].current);
  const std::size_t reserved = d.last_reserved;
  lock.unlock();
  if (watch_segments) {
    note_segment_changes(segments_before, stream, nullptr);
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
    std::string cause, const std::shared_ptr<c10::GatheredContext>& context) {
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
    record_trace(cda::TraceEntry::OOM, device, free, size, stream, pool, context);
    observers = oom_observers_;
  }
  c10::reportOutOfMemoryToProfiler(static_cast<std::int64_t>(size),
                                   static_cast<std::size_t>(0), static_cast<std::size_t>(0),
                                   c10::Device(c10::DeviceType::CUDA, device));
  for (const auto& observer : observers) {  // may take the GIL, may throw: outside the lock
    observer(device, size, allowed_or_total, free);
  }
  TORCH_CHECK_WITH(OutOfMemoryError, false, message);
}

// --- frees ------------------------------------------------------------------------------------

void cudamem_torch_allocator::free(void* ptr) {
  if (ptr == nullptr) {
    return;
  }
  std::shared_ptr<c10::GatheredContext> context = maybe_gather(cda::RecordContext::ALL);
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
  record_trace(cda::TraceEntry::FREE_REQUESTED, b.device, reinterpret_cast<std::uintptr_t>(ptr),
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
    return;
  }
  block done = std::move(b);
  forget(it);
  if (context) {
    done.context = std::move(context);  // completed now: the free's stack, as PyTorch records
  }
  complete_free(lock, std::move(done));
}

/// The block goes back: to its pool, or to cudamem (outside the lock). Called with the lock.
void cudamem_torch_allocator::complete_free(std::unique_lock<std::mutex>& lock, block b) {
  devices_[b.device].figures.on_free_completed(b.size, b.requested);
  record_trace(cda::TraceEntry::FREE_COMPLETED, b.device,
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
  lock.lock();
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

void cudamem_torch_allocator::release_pool_memory(std::map<MempoolId_t, pool_state>::iterator it) {
  pool_state& ps = it->second;
  for (const auto& [base, chunk] : ps.pool.release(ps.chunks)) {
    devices_[ps.device].figures.segment.decrease(
        chunk.small ? cudamem::torch_bridge::small_pool : cudamem::torch_bridge::large_pool, 1);
    record_trace(cda::TraceEntry::SEGMENT_FREE, ps.device, base, chunk.bytes,
                 static_cast<cudaStream_t>(chunk.stream), it->first, nullptr);
  }
  if (ps.live_blocks == 0 && !ps.pool.has_chunks() && ps.use_count == 0) {
    pools_.erase(it);
  }
}

// --- snapshots --------------------------------------------------------------------------------

cca::SnapshotInfo cudamem_torch_allocator::snapshot(MempoolId_t id, bool include_traces) {
  std::vector<std::vector<span>> held = all_segments();
  cca::SnapshotInfo info;
  const std::lock_guard lock(mutex_);
  const auto to_unix = clock_.makeConverter();
  if (include_traces) {
    for (auto& ring : rings_) {
      std::vector<cda::TraceEntry> entries = ring.entries();
      for (cda::TraceEntry& te : entries) {
        te.time_.t_ = to_unix(te.time_.approx_t_) / 1000;
      }
      info.device_traces.push_back(std::move(entries));
    }
    for (cda::AnnotationEntry e : annotations_.entries()) {
      e.time_.t_ = to_unix(e.time_.approx_t_) / 1000;
      info.external_annotations.push_back(std::move(e));
    }
  }
  auto block_info = [](const block& b) {
    cda::BlockInfo bi;
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
    cda::SegmentInfo s;
    s.device = device;
    s.address = range.address;
    s.total_size = range.bytes;
    s.stream = stream;
    s.is_large = large;
    s.is_expandable = expandable;
    s.owner_private_pool_id = owner;
    for (const auto& piece : pieces) {
      if (piece.block == cudamem::torch_bridge::npos) {
        cda::BlockInfo gap;
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
            [](const cda::SegmentInfo& a, const cda::SegmentInfo& b) {
              return a.address < b.address;
            });
  if (include_traces) {  // after the traces were taken, as PyTorch does
    for (DeviceIndex device = 0; device < device_count(); ++device) {
      std::size_t active = 0;
      for (const auto& [p, b] : live_) {
        active += b.device == device ? b.size : 0;
      }
      record_trace(cda::TraceEntry::SNAPSHOT, device, 0, active, nullptr, default_pool, nullptr);
    }
  }
  info.config_metadata.garbage_collection_threshold = 0;
  info.config_metadata.max_split_size = SIZE_MAX;
  info.config_metadata.expandable_segments = resource_ == "vm_pool";
  info.config_metadata.last_allocator_settings = "cudamem resource=" + resource_;
  return info;
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
  std::shared_ptr<c10::GatheredContext> context = maybe_gather(cda::RecordContext::STATE);
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

// --- other processes ----------------------------------------------------------------------------

cca::ShareableHandle cudamem_torch_allocator::shareIpcHandle(void* ptr) {
  std::unique_lock lock(mutex_);
  block* b = find_containing(ptr);
  TORCH_CHECK(b != nullptr, "invalid device pointer: ", ptr);
  const std::ptrdiff_t into = static_cast<char*>(ptr) - static_cast<char*>(b->address);
  if (!b->rare().ipc_handle.empty()) {  // shared before: the same bytes (receivers cache them)
    return {b->rare().ipc_offset + into, b->rare().ipc_handle};
  }
  void* const address = b->address;
  const std::size_t size = b->size;
  const DeviceIndex device = b->device;
  lock.unlock();
  cudamem_ipc_export e{};
  e.struct_size = sizeof(e);
  // Handles are whole granules of at least 2 MiB: this many fds are enough.
  std::vector<int> fds(size / (std::size_t{2} << 20) + 2);
  std::size_t fd_count = 0;
  const cudamem_status s = cudamem_ipc_export_range(process_allocator, device, address, size, &e,
                                                    fds.data(), fds.size(), &fd_count);
  TORCH_CHECK(s == CUDAMEM_OK, "cudamem: this tensor cannot be sent to another process: ",
              last_error());
  fds.resize(fd_count);
  std::string bytes;
  bytes.push_back(ipc_version);
  if (e.kind == CUDAMEM_IPC_CUDA_MALLOC) {
    bytes.push_back(ipc_cuda_malloc);
    bytes.append(reinterpret_cast<const char*>(e.ipc_mem_handle), sizeof(e.ipc_mem_handle));
  } else {
    bytes.push_back(ipc_expandable);
    const ipc_share_header header{static_cast<std::int32_t>(::getpid()), 0, e.handle_bytes,
                                  fds.size()};
    bytes.append(reinterpret_cast<const char*>(&header), sizeof(header));
    for (const int fd : fds) {
      const auto fd32 = static_cast<std::int32_t>(fd);
      bytes.append(reinterpret_cast<const char*>(&fd32), sizeof(fd32));
    }
  }
  const auto offset = static_cast<std::ptrdiff_t>(e.offset);
  lock.lock();
  b = find_containing(ptr);
  if (b == nullptr) {  // freed meanwhile by another thread: nothing to keep open
    for (const int fd : fds) {
      ::close(fd);
    }
    TORCH_CHECK(false, "invalid device pointer: ", ptr);
  }
  b->more().exported_fds = std::move(fds);
  b->more().ipc_handle = bytes;
  b->more().ipc_offset = offset;
  return {offset + into, bytes};
}

std::shared_ptr<void> cudamem_torch_allocator::getIpcDevPtr(std::string handle) {
  const std::lock_guard lock(ipc_mutex_);
  if (const auto it = imported_by_handle_.find(handle); it != imported_by_handle_.end()) {
    if (std::shared_ptr<void> alive = it->second.lock()) {
      return alive;
    }
  }
  const DeviceIndex device = c10::cuda::current_device();
  std::shared_ptr<void> mapped;
  if (handle.size() == sizeof(cudaIpcMemHandle_t) ||
      (handle.size() >= 2 && handle[1] == ipc_cuda_malloc)) {
    TORCH_CHECK(handle.size() == sizeof(cudaIpcMemHandle_t) ||
                    handle.size() == 2 + sizeof(cudaIpcMemHandle_t),
                "cudamem: an ill-formed CUDA IPC handle");
    cudaIpcMemHandle_t h;
    std::memcpy(&h, handle.data() + (handle.size() == sizeof(h) ? 0 : 2), sizeof(h));
    void* p = nullptr;
    C10_CUDA_CHECK(cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess));
    mapped = std::shared_ptr<void>(p, [this, handle, device](void* q) {
      {
        const std::lock_guard inner(ipc_mutex_);
        imported_by_handle_.erase(handle);
      }
      const c10::cuda::CUDAGuard on{device};
      C10_CUDA_CHECK_WARN(cudaIpcCloseMemHandle(q));
    });
  } else {
    TORCH_CHECK(handle.size() >= 2 + sizeof(ipc_share_header), "cudamem: an ill-formed handle");
    TORCH_CHECK(handle[0] <= ipc_version,
                "received sharable handle from a future version of torch that this version "
                "does not know how to handle");
    TORCH_CHECK(handle[1] == ipc_expandable, "cudamem: unexpected or ill-formed shareable handle");
    ipc_share_header header{};
    std::memcpy(&header, handle.data() + 2, sizeof(header));
    TORCH_CHECK(handle.size() == 2 + sizeof(header) + header.num_handles * sizeof(std::int32_t),
                "cudamem: an ill-formed handle (its file descriptors)");
    std::vector<int> fds(header.num_handles);
    for (std::size_t i = 0; i < fds.size(); ++i) {
      std::int32_t fd = 0;
      std::memcpy(&fd, handle.data() + 2 + sizeof(header) + i * sizeof(fd), sizeof(fd));
      fds[i] = fd;
    }
    void* base = nullptr;
    check_status(cudamem_ipc_import(device, header.pid, fds.data(), fds.size(),
                                    header.segment_size, &base),
                 "mapping another process's memory");
    imported_.emplace(base, imported_mapping{device});
    mapped = std::shared_ptr<void>(base, [this, handle](void* q) {
      const std::lock_guard inner(ipc_mutex_);
      imported_by_handle_.erase(handle);
      imported_.erase(q);
      if (cudamem_ipc_unmap(q) != CUDAMEM_OK) {
        TORCH_WARN("cudamem: unmapping another process's memory: ", last_error());
      }
    });
  }
  imported_by_handle_[handle] = mapped;
  return mapped;
}

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
