// cudamem/_torch/chunk_sources.hpp — where a graph pool's or MemPool's chunks come from:
// cudamem's stack (on the allocator's own stream while the requesting stream is captured), a
// MemPool's own allocator, nothing (a use_on_oom pool lends only its free blocks), or either
// under the memory fraction.
//
//   pool_chunks chunks(device, mem_pool_allocator);   // nullptr: cudamem's stack
//   chunks_within_fraction source(chunks, room);      // refuses what would pass the fraction
//   void* p = pool.allocate(bytes, stream, source);   // graph_pool.hpp asks it for chunks
//
// Owns: is_capturing, relaxed_capture_mode, chunk_stream, and the chunk sources pool_chunks,
// no_chunks and chunks_within_fraction (graph_pool.hpp's chunk_source interface).
#pragma once

#include "graph_pool.hpp"
#include "torch_interface.hpp"

#include <map>
#include <memory>
#include <mutex>
#include <optional>

namespace {

/// Whether work on `stream` is being captured into a CUDA graph now.
inline bool is_capturing(cudaStream_t stream) {
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
inline cudaStream_t chunk_stream(DeviceIndex device) {
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
  /// PyTorch 2.7: a MemPool's allocator is known only at the pool's first allocation (the
  /// active MemPoolContext's); taken then, before the pool holds a chunk.
  void adopt(std::shared_ptr<cca::CUDAAllocator> custom) { custom_ = std::move(custom); }

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

}  // namespace
