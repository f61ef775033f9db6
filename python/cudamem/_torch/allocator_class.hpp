// cudamem/_torch/allocator_class.hpp — the class cudamem_torch_allocator: PyTorch's
// CUDAAllocator interface as the PyTorch compiled against declares it, and the state behind it.
//
//   auto a = std::make_shared<cudamem_torch_allocator>("vm_pool");
//   torch::cuda::CUDAPluggableAllocator::changeCurrentAllocator(a);   // torch_allocator.cpp
//
// Owns: the declaration of every method PyTorch calls, each under the guard of the releases
// whose interface has it in that form (the table is in torch_allocator.cpp's opening comment),
// the records of blocks, pools, captures and devices, and the members that hold them. The
// methods' bodies are in the parts named beside each group.
#pragma once

#include "call_timer.hpp"
#include "capture_order.hpp"
#include "chunk_sources.hpp"
#include "graph_pool.hpp"
#include "snapshot_layout.hpp"
#include "stats.hpp"
#include "torch_interface.hpp"
#include "trace_ring.hpp"

#include <array>
#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

namespace {

using cudamem::torch_bridge::device_figures;
using cudamem::torch_bridge::graph_pool;
using cudamem::torch_bridge::span;

class cudamem_torch_allocator;
cudamem_torch_allocator* the_allocator = nullptr;  // the deleters' way back (one per process)
void delete_block(void* ptr);
void delete_uncached(void* ptr);

class cudamem_torch_allocator final : public cca::CUDAAllocator {
 public:
  explicit cudamem_torch_allocator(std::string resource) : resource_(std::move(resource)) {}

  // --- memory (allocator_malloc.hpp) -------------------------------------------------------
  c10::DataPtr allocate(std::size_t n) override;
  c10::DeleterFnPtr raw_deleter() const override {
    return enabled_ ? &delete_block : &delete_uncached;
  }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    C10_CUDA_CHECK(cudaMemcpy(dest, src, count, cudaMemcpyDeviceToDevice));
  }
  void* raw_alloc(std::size_t nbytes) override;
  void* raw_alloc_with_stream(std::size_t nbytes, cudaStream_t stream) override;
  void raw_delete(void* ptr) override { free(ptr); }
  void enable(bool value) override { enabled_ = value; }
  bool isEnabled() const override { return enabled_; }
  void* getBaseAllocation(void* ptr, std::size_t* size) override;

  // --- frees that wait for streams (allocator_frees.hpp) -----------------------------------
  void recordStream(const c10::DataPtr& ptr, c10::cuda::CUDAStream stream) override;
#if CUDAMEM_TORCH_AT_LEAST(2, 9)  // DeviceAllocator's device-generic form
  void recordStream(const c10::DataPtr& ptr, c10::Stream stream) override {
    recordStream(ptr, c10::cuda::CUDAStream(stream));
  }
#endif

  // --- devices, statistics, the memory fraction (allocator_stats.hpp) ----------------------
  void init(int device_count) override;
  bool initialized() override { return initialized_; }
  cda::DeviceStats getDeviceStats(DeviceIndex device) override;
  void resetAccumulatedStats(DeviceIndex device) override;
  void resetPeakStats(DeviceIndex device) override;
  double getMemoryFraction(DeviceIndex device) override;
  void setMemoryFraction(double fraction, DeviceIndex device) override;
  void cacheInfo(DeviceIndex device, std::size_t* largest) override;
#if CUDAMEM_TORCH_AT_LEAST(2, 10)
  std::vector<cca::StreamSegmentSize> getExpandableSegmentSizes(DeviceIndex device) override;
#endif

  // --- pools: CUDA graphs, MemPools, empty_cache (allocator_pools.hpp) ---------------------
#if CUDAMEM_TORCH_AT_LEAST(2, 8)
  void emptyCache(MempoolId_t id) override { empty_cache(id); }
#else
  void emptyCache() override { empty_cache(default_pool); }
#endif
  void beginAllocateToPool(DeviceIndex device, MempoolId_t id,
                           std::function<bool(cudaStream_t)> filter) override;
  void endAllocateToPool(DeviceIndex device, MempoolId_t id) override;
  void releasePool(DeviceIndex device, MempoolId_t id) override;
  int getPoolUseCount(DeviceIndex device, MempoolId_t id) override;
#if CUDAMEM_TORCH_AT_LEAST(2, 11)
  void createOrIncrefPool(DeviceIndex device, MempoolId_t id,
                          std::shared_ptr<cca::CUDAAllocator> allocator) override {
    create_or_incref_pool(device, id, std::move(allocator));
  }
  void setUseOnOOM(DeviceIndex device, MempoolId_t id, bool use_on_oom) override {
    set_use_on_oom(device, id, use_on_oom);
  }
#elif CUDAMEM_TORCH_AT_LEAST(2, 8)
  void createOrIncrefPool(DeviceIndex device, MempoolId_t id,
                          cca::CUDAAllocator* allocator) override {
    create_or_incref_pool(device, id, not_owned(allocator));
  }
  void setUseOnOOM(DeviceIndex device, MempoolId_t id) override {
    set_use_on_oom(device, id, true);
  }
#else
  void ensureExistsAndIncrefPool(DeviceIndex device, MempoolId_t id) override {
    create_or_incref_pool(device, id, nullptr);
  }
#endif
#if CUDAMEM_TORCH_AT_LEAST(2, 10)
  void setNoSplit(DeviceIndex device, MempoolId_t id) override;
#endif
  bool checkPoolLiveAllocations(DeviceIndex device, MempoolId_t id,
                                const std::unordered_set<void*>& expected) override;
  std::shared_ptr<cca::AllocatorState> getCheckpointState(DeviceIndex device,
                                                          MempoolId_t id) override;
  cca::CheckpointDelta setCheckpointPoolState(DeviceIndex device,
                                              std::shared_ptr<cca::AllocatorState> pps) override;

  // --- history and snapshots (allocator_history.hpp, allocator_snapshot.hpp) ---------------
#if CUDAMEM_TORCH_AT_LEAST(2, 11)
  cca::SnapshotInfo snapshot(MempoolId_t id, bool include_traces) override {
    return take_snapshot(id, include_traces);
  }
#elif CUDAMEM_TORCH_AT_LEAST(2, 8)
  cca::SnapshotInfo snapshot(MempoolId_t id) override { return take_snapshot(id, true); }
#else
  cca::SnapshotInfo snapshot() override;  // MemPool.snapshot(): the active MemPoolContext's
#endif
  bool isHistoryEnabled() override { return record_history_; }
#if CUDAMEM_TORCH_AT_LEAST(2, 11)
  void recordHistory(bool enabled, hist::CreateContextFn recorder, std::size_t max_entries,
                     hist::RecordContext when, bool clear_history,
                     const std::vector<std::string>& skip_actions) override;
#elif CUDAMEM_TORCH_AT_LEAST(2, 8)
  void recordHistory(bool enabled, hist::CreateContextFn recorder, std::size_t max_entries,
                     hist::RecordContext when, bool clear_history) override {
    record_history(enabled, recorder, max_entries, when, clear_history, {});
  }
#else
  void recordHistory(bool enabled, hist::CreateContextFn recorder, std::size_t max_entries,
                     hist::RecordContext when) override {
    record_history(enabled, recorder, max_entries, when, /*clear_history=*/true, {});
  }
#endif
  void recordAnnotation(const std::vector<std::pair<std::string, std::string>>& md) override;
#if CUDAMEM_TORCH_AT_LEAST(2, 8)
  void pushCompileContext(std::string& md) override;
  void popCompileContext() override;
#endif
#if CUDAMEM_TORCH_AT_LEAST(2, 10)
  void setUserMetadata(const std::string& metadata) override;
  std::string getUserMetadata() override;
#endif
#if CUDAMEM_TORCH_AT_LEAST(2, 12)
  std::shared_ptr<c10::GatheredContext> getContextForPointer(const void* ptr) override;
  void attachOomRejectionObserver(cca::OomRejectionObserver observer) override {
    const std::lock_guard lock(mutex_);
    oom_rejection_observers_.push_back(std::move(observer));
  }
#endif
#if CUDAMEM_TORCH_AT_LEAST(2, 14)
  bool supportsUserMetadata() override { return true; }
  void annotateMemory(const void* ptr, const std::string& metadata) override;
#endif
  void attachOutOfMemoryObserver(cca::OutOfMemoryObserver observer) override {
    const std::lock_guard lock(mutex_);
    oom_observers_.push_back(std::move(observer));
  }
  void attachAllocatorTraceTracker(hist::AllocatorTraceTracker tracker) override {
    const std::lock_guard lock(mutex_);
    trackers_.push_back(std::move(tracker));
    tracking_ = true;
  }

  // --- other GPUs, other processes (allocator_ipc.hpp) -------------------------------------
  void enablePeerAccess(DeviceIndex dev, DeviceIndex dev_to_access) override;
  cudaError_t memcpyAsync(void* dst, int dst_device, const void* src, int src_device,
                          std::size_t count, cudaStream_t stream, bool p2p_enabled) override;
  cca::ShareableHandle shareIpcHandle(void* ptr) override;
  std::shared_ptr<void> getIpcDevPtr(std::string handle) override;

  std::string name() override { return "cudamem"; }

  // --- the deleters' entry, and Python's ---------------------------------------------------
  void free(void* ptr);
  void free_uncached(void* ptr);
  [[nodiscard]] std::string last_oom_report() {
    const std::lock_guard lock(mutex_);
    return last_oom_report_;
  }
  /// Counting the host time of each malloc and free (call_timer.hpp) from now on, or not.
  void time_calls(bool on) noexcept { time_calls_.store(on, std::memory_order_relaxed); }
  /// {allocations, their ns, frees, their ns}, counted while time_calls was on.
  [[nodiscard]] std::array<std::uint64_t, 4> call_times() const noexcept {
    return {malloc_times_.calls.load(std::memory_order_relaxed),
            malloc_times_.ns.load(std::memory_order_relaxed),
            free_times_.calls.load(std::memory_order_relaxed),
            free_times_.ns.load(std::memory_order_relaxed)};
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
    std::int64_t oom_rejections = 0;  ///< requests the fraction refused (2.12's statistic)
    std::map<MempoolId_t, std::int64_t> pool_reserved_peaks;  ///< per private pool (2.13's)
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

  // --- allocation (allocator_malloc.hpp) ---------------------------------------------------
  void* malloc(DeviceIndex device, std::size_t n, cudaStream_t stream);
  void* hand_out(std::unique_lock<std::mutex>& lock, void* p, std::size_t block_size,
                 std::size_t n, DeviceIndex device, cudaStream_t stream, MempoolId_t pool,
                 std::shared_ptr<c10::GatheredContext> context,
                 const std::vector<std::vector<span>>* segments_before);
  /// Under the lock, after pending_, captures_ or a memory fraction changed: whether malloc
  /// may allocate before it takes the lock (plain_malloc_).
  void refresh_plain_malloc() noexcept {
    bool fraction = false;
    for (const device_state& d : devices_) {
      fraction = fraction || d.allowed.has_value();
    }
    plain_malloc_.store(pending_.empty() && captures_.empty() && !fraction,
                        std::memory_order_release);
  }
  void* uncached_malloc(std::size_t n, DeviceIndex device);
  block& remember(void* p, block b);
  void forget(std::unordered_map<void*, block>::iterator it);
  MempoolId_t route(DeviceIndex device, cudaStream_t stream);
  block* find_containing(const void* ptr);
  bool try_free_memory(std::unique_lock<std::mutex>& lock, DeviceIndex device);
  [[noreturn]] void out_of_memory(DeviceIndex device, std::size_t size, cudaStream_t stream,
                                  MempoolId_t pool, std::string cause, bool past_fraction,
                                  const std::shared_ptr<c10::GatheredContext>& context);

  // --- frees (allocator_frees.hpp) ---------------------------------------------------------
  /// After it the lock is held again, unless `relock` is false: a free() that has nothing
  /// left to do under the lock skips taking it once more.
  void complete_free(std::unique_lock<std::mutex>& lock, block b, bool relock = true);
  void finish_pending_frees(std::unique_lock<std::mutex>& lock, bool wait);
  void finish_deferred(std::unique_lock<std::mutex>& lock);
  void reclaim_in_capture(std::unique_lock<std::mutex>& lock, cudaStream_t stream);
  void wait_for_uses(block& b);

  // --- devices and the fraction (allocator_stats.hpp) --------------------------------------
  [[nodiscard]] DeviceIndex device_count() const noexcept {
    return static_cast<DeviceIndex>(devices_.size());
  }
  void check_device(DeviceIndex device) const {
    TORCH_CHECK(device >= 0 && device < device_count(), "Invalid device argument ", device,
                ": did you call init?");
  }
  static std::size_t device_total(int device);
  static cudamem_stats cudamem_figures(DeviceIndex device);
  static std::vector<span> cudamem_segments_of(DeviceIndex device);
  std::vector<std::vector<span>> all_segments();
  [[nodiscard]] std::size_t held_under_fraction(DeviceIndex device) const;
  [[nodiscard]] std::optional<std::size_t> room_under_fraction(DeviceIndex device) const;
  [[nodiscard]] std::string fraction_cause(DeviceIndex device, std::size_t bytes) const;

  // --- pools (allocator_pools.hpp) ---------------------------------------------------------
  void empty_cache(MempoolId_t id);
  void create_or_incref_pool(DeviceIndex device, MempoolId_t id,
                             std::shared_ptr<cca::CUDAAllocator> allocator);
  void set_use_on_oom(DeviceIndex device, MempoolId_t id, bool use_on_oom) noexcept;
  pool_state& pool_for(DeviceIndex device, MempoolId_t id,
                       std::shared_ptr<cca::CUDAAllocator> custom);
  void adopt_active_mem_pool_allocator(pool_state& ps, MempoolId_t id);
  void release_dead_pools(MempoolId_t id, bool capturing);
  void release_pool_memory(std::map<MempoolId_t, pool_state>::iterator it);

  // --- history (allocator_history.hpp) and snapshots (allocator_snapshot.hpp) --------------
  struct thread_annotations;
  [[nodiscard]] bool recording() const noexcept { return record_history_ || tracking_; }
  std::shared_ptr<c10::GatheredContext> maybe_gather(hist::RecordContext level);
  void record_history(bool enabled, hist::CreateContextFn recorder, std::size_t max_entries,
                      hist::RecordContext when, bool clear_history,
                      const std::set<hist::TraceEntry::Action>& skipped);
  void record_trace(hist::TraceEntry::Action action, DeviceIndex device, std::uintptr_t addr,
                    std::size_t size, cudaStream_t stream, MempoolId_t pool,
                    std::shared_ptr<c10::GatheredContext> context,
                    const std::string* metadata = nullptr);
  void note_segment_changes(const std::vector<std::vector<span>>& before, cudaStream_t stream,
                            const std::shared_ptr<c10::GatheredContext>& context);
  static thread_annotations* annotations_of_this_thread();
  cca::SnapshotInfo take_snapshot(MempoolId_t id, bool include_traces);

  // --- state -------------------------------------------------------------------------------
  const std::string resource_;  ///< vm_pool, pool or async: what the segments are
  std::mutex mutex_;
  bool initialized_ = false;
  std::atomic<bool> enabled_{true};
  std::vector<device_state> devices_;
  /// devices_.size() once init() has sized it, read by malloc before it takes the lock.
  std::atomic<DeviceIndex> known_devices_{0};
  /// No free waits for a stream, no capture routes requests, no fraction is set: malloc's
  /// common case, which allocates first and takes the lock once (refresh_plain_malloc).
  std::atomic<bool> plain_malloc_{false};
  // The host time of malloc and free, counted when asked (cudamem.torch.time_calls).
  std::atomic<bool> time_calls_{false};
  cudamem::torch_bridge::timed_calls malloc_times_;
  cudamem::torch_bridge::timed_calls free_times_;
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
  std::atomic<hist::CreateContextFn> recorder_{nullptr};
  std::atomic<hist::RecordContext> record_context_{hist::RecordContext::NEVER};
  std::size_t trace_capacity_ = 1;
  std::vector<cudamem::torch_bridge::trace_ring<hist::TraceEntry>> rings_;
  cudamem::torch_bridge::trace_ring<hist::AnnotationEntry> annotations_;
  std::set<hist::TraceEntry::Action> skipped_;
  std::vector<cca::OutOfMemoryObserver> oom_observers_;
#if CUDAMEM_TORCH_AT_LEAST(2, 12)
  std::vector<cca::OomRejectionObserver> oom_rejection_observers_;
#endif
  std::vector<hist::AllocatorTraceTracker> trackers_;
  std::atomic<bool> tracking_{false};  ///< trackers_ is not empty (read without the lock)
  c10::ApproximateClockToUnixTimeConverter clock_;
  // Other processes' memory mapped here (getIpcDevPtr), by base address, and by handle.
  std::mutex ipc_mutex_;
  std::map<void*, imported_mapping> imported_;
  std::unordered_map<std::string, std::weak_ptr<void>> imported_by_handle_;
};

}  // namespace
