// cudamem/detail/copy/transfer_engine.hpp — the few CUDA operations copy_stager's pipeline
// needs, behind an interface: the real one below calls CUDA; host tests give the stager a fake
// that simulates asynchronous copies with a thread, and fails on request, so the pipeline, its
// error paths and its threading are tested on machines with no GPU.
//
//   auto engine = std::make_unique<detail::cuda_transfer_engine>(device);
//   void* chunk = engine->allocate_chunk(4 << 20);     // pinned (cudaHostAlloc, portable)
//   detail::transfer_engine::fence done = engine->make_fence();   // a cudaEvent_t
//   engine->copy_async(device_ptr, chunk, 4 << 20, stream);      // cudaMemcpyAsync
//   engine->record(done, stream);                                // cudaEventRecord
//   engine->wait(done);                                          // cudaEventSynchronize
//
// Contract for every engine
// - Every member may be called from several threads at once.
// - `copy_async` is stream-ordered on `stream` and returns before the copy is done; `record`
//   marks the point `stream` has reached, `wait` blocks the host until it is passed. Errors of
//   the copy itself may surface in `copy_async` or in a later `wait`; both throw.
// - `synchronize` waits for `stream` and says whether that worked; it never throws (it is
//   what the stager uses to clean up after a failure).
#pragma once

#include <cudamem/device.hpp>
#include <cudamem/error.hpp>
#include <cudamem/memory_resource.hpp>
#include <cudamem/pinned_resource.hpp>
#include <cudamem/stream.hpp>

#include <cuda_runtime_api.h>

#include <cstddef>

namespace cudamem::detail {

class transfer_engine {
 public:
  /// Marks a point in a stream (a cudaEvent_t in the CUDA engine).
  using fence = void*;

  transfer_engine() = default;
  transfer_engine(const transfer_engine&) = delete;
  transfer_engine& operator=(const transfer_engine&) = delete;
  virtual ~transfer_engine() = default;

  /// Page-locked host memory for one chunk; throws if there is none.
  virtual void* allocate_chunk(std::size_t bytes) = 0;
  virtual void deallocate_chunk(void* chunk, std::size_t bytes) noexcept = 0;
  virtual fence make_fence() = 0;
  virtual void destroy_fence(fence f) noexcept = 0;
  virtual void copy_async(void* dst, const void* src, std::size_t bytes, stream_view stream) = 0;
  virtual void record(fence f, stream_view stream) = 0;
  virtual void wait(fence f) = 0;
  [[nodiscard]] virtual bool synchronize(stream_view stream) noexcept = 0;
};

/// The engine of real copies: chunks from a portable pinned_resource of `device`, events made
/// on `device`, which must be the device of the streams the stager is used with.
class cuda_transfer_engine final : public transfer_engine {
 public:
  explicit cuda_transfer_engine(int device)
      : device_(device), chunks_(cudaHostAllocPortable, device) {}

  void* allocate_chunk(std::size_t bytes) override { return chunks_.allocate_sync(bytes); }

  void deallocate_chunk(void* chunk, std::size_t bytes) noexcept override {
    chunks_.deallocate_sync(chunk, bytes);
  }

  fence make_fence() override {
    const device_guard on{device_};
    cudaEvent_t event = nullptr;
    check(cudaEventCreateWithFlags(&event, cudaEventDisableTiming),
          "copy_stager: cudaEventCreateWithFlags");
    return event;
  }

  void destroy_fence(fence f) noexcept override {
    report_error(cudaEventDestroy(static_cast<cudaEvent_t>(f)), "copy_stager: cudaEventDestroy");
  }

  void copy_async(void* dst, const void* src, std::size_t bytes, stream_view stream) override {
    check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, stream.get()),
          "copy_stager: cudaMemcpyAsync of a staged chunk");
  }

  void record(fence f, stream_view stream) override {
    check(cudaEventRecord(static_cast<cudaEvent_t>(f), stream.get()),
          "copy_stager: cudaEventRecord after a staged chunk");
  }

  void wait(fence f) override {
    check(cudaEventSynchronize(static_cast<cudaEvent_t>(f)),
          "copy_stager: waiting for a staged chunk's copy (cudaEventSynchronize)");
  }

  bool synchronize(stream_view stream) noexcept override {
    const cudaError_t code = cudaStreamSynchronize(stream.get());
    report_error(code, "copy_stager: waiting for the stream after a failed copy");
    return code == cudaSuccess;
  }

 private:
  int device_;
  pinned_resource chunks_;
};

}  // namespace cudamem::detail
