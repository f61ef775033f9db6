// cudamem/detail/vm/stream_tag.hpp — the stream identity vm_resource tags frees with: one per
// stream, the per-thread default stream included, which is one stream per thread.
//
//   const cudaStream_t tag = stream_tag(stream);  // at vm_resource's entry points, once
//   ... free ranges, the layer's events and recycling compare tags ...
//   cudaStreamWaitEvent(cuda_stream(tag), ev, 0); // tag back to a handle: calling thread's
//
// Why. vm_resource orders a request after earlier frees by comparing streams: a range freed on
// the request's own stream needs nothing (stream order), one freed on another stream needs an
// event wait, on the device or on the host. A handle names one stream, with one exception:
// cudaStreamPerThread names *the calling thread's* default stream (and so does 0 in a build
// with `nvcc --default-stream per-thread`). Two threads' frees on that handle are on two
// streams. Compared by handle, thread B's request would take thread A's freshly freed range as
// its own, with no wait, while A's kernels still read it; and one event per handle would be
// recorded by both threads in turn, each record dropping what the other's covered.
//
// The contract.
// - stream_tag(s): for a handle naming the calling thread's own stream, a value unique to the
//   thread for the life of the process; for every other handle (a created stream, the legacy
//   stream 0 or cudaStreamLegacy), the handle itself. A thread's tag is a counter with the top
//   bit set: user-space addresses are in the lower half of the address space on every platform
//   CUDA runs on, so a tag never equals a real stream handle. Tags are never reused, so a
//   thread that ended leaves frees nobody mistakes for their own (the layer's event for its
//   tag, recorded on its last free, still orders them).
// - cuda_stream(tag): the calling thread's tag back to cudaStreamPerThread; any other value is
//   returned as it is. Only the thread a tag belongs to passes it to CUDA: a request's stream
//   and a free's record are the calling thread's; another thread's frees are reached through
//   the layer's events only.
// The rule for handle 0 under `--default-stream per-thread` lives here and only here.
#pragma once

#include <cuda_runtime_api.h>

#include <atomic>
#include <cstdint>
#include <limits>

namespace cudamem::detail {

/// The top bit, set in every thread's tag and in no user-space address.
inline constexpr std::uintptr_t thread_tag_bit = ~(std::numeric_limits<std::uintptr_t>::max() >> 1);

/// Whether `s` names the calling thread's own default stream.
[[nodiscard]] inline bool names_thread_stream(cudaStream_t s) noexcept {
#if defined(CUDA_API_PER_THREAD_DEFAULT_STREAM)
  return s == cudaStreamPerThread || s == nullptr;
#else
  return s == cudaStreamPerThread;
#endif
}

/// The calling thread's tag (see above): made on its first use, unique for the process's life.
[[nodiscard]] inline cudaStream_t this_thread_stream_tag() noexcept {
  static std::atomic<std::uintptr_t> threads_tagged{0};
  thread_local const std::uintptr_t tag =
      thread_tag_bit | threads_tagged.fetch_add(1, std::memory_order_relaxed);
  return reinterpret_cast<cudaStream_t>(tag);  // NOLINT: an identity, never dereferenced
}

/// The identity vm_resource keeps for `s` (see above).
[[nodiscard]] inline cudaStream_t stream_tag(cudaStream_t s) noexcept {
  return names_thread_stream(s) ? this_thread_stream_tag() : s;
}

/// The handle to give CUDA for `tag`, on the thread the tag belongs to (see above).
[[nodiscard]] inline cudaStream_t cuda_stream(cudaStream_t tag) noexcept {
  const bool a_thread_tag = (reinterpret_cast<std::uintptr_t>(tag) & thread_tag_bit) != 0;
  return a_thread_tag && tag == this_thread_stream_tag() ? cudaStreamPerThread : tag;
}

}  // namespace cudamem::detail
