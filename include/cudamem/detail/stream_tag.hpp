// cudamem/detail/stream_tag.hpp — which stream is which: the identity pool_resource's ledger
// and vm_resource tag frees with (one per stream, the per-thread default stream included, which
// is one stream per thread), and which handles name a default stream.
//
//   const cudaStream_t tag = stream_tag(stream);  // where a free or a request is noted
//   ... records, free ranges and recycling compare tags ...
//   cudaStreamWaitEvent(cuda_stream(tag), ev, 0); // tag back to a handle: calling thread's
//   if (is_default_stream(s)) ...                 // whose device it is depends on the current one
//
// Why. A stream-ordered allocator orders a request after earlier frees by comparing streams: a
// block freed on the request's own stream needs nothing (stream order), one freed on another
// stream needs an event wait, on the device or on the host. A handle names one stream, with one
// exception: cudaStreamPerThread names *the calling thread's* default stream (and so does 0 in
// a build with `nvcc --default-stream per-thread`). Two threads' frees on that handle are on
// two streams. Compared by handle, thread B's request would take thread A's freshly freed block
// as its own, with no wait, while A's kernels still read it; and one event per handle would be
// recorded by both threads in turn, each record dropping what the other's covered. Nor can the
// thread's id stand in for the stream: once a thread has ended, the next one often gets the
// same std::thread::id (glibc reuses the thread's descriptor), while the ended thread's
// kernels may still run.
//
// The contract.
// - stream_tag(s): for a handle naming the calling thread's own stream, a value unique to the
//   thread for the life of the process; for every other handle (a created stream, the legacy
//   stream 0 or cudaStreamLegacy), the handle itself. A thread's tag is a counter with the top
//   bit set: user-space addresses are in the lower half of the address space on every platform
//   CUDA runs on, so a tag never equals a real stream handle. Tags are never reused, so a
//   thread that ended leaves frees nobody mistakes for their own (the event recorded on its
//   last free still orders them).
// - cuda_stream(tag): the calling thread's tag back to cudaStreamPerThread; any other value is
//   returned as it is. Only the thread a tag belongs to passes it to CUDA: a request's stream
//   and a free's record are the calling thread's; another thread's frees are reached through
//   events recorded at the free.
// - is_thread_tag(tag): whether a tag is some thread's (not a handle CUDA knows).
// - is_default_stream(s): 0, cudaStreamLegacy or cudaStreamPerThread: the device it belongs to
//   is the current device's, so a call on it must make the right device current first.
// The rule for handle 0 under `--default-stream per-thread` lives here and only here.
#pragma once

#include <cudamem/detail/sync/atomic.hpp>

#include <cuda_runtime_api.h>

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
  static detail::atomic<std::uintptr_t> threads_tagged{0};
  thread_local const std::uintptr_t tag =
      thread_tag_bit | threads_tagged.fetch_add(1, detail::memory_order_relaxed);
  return reinterpret_cast<cudaStream_t>(tag);  // NOLINT: an identity, never dereferenced
}

/// The identity vm_resource keeps for `s` (see above).
[[nodiscard]] inline cudaStream_t stream_tag(cudaStream_t s) noexcept {
  return names_thread_stream(s) ? this_thread_stream_tag() : s;
}

/// Whether `tag` is a thread's (see above), which CUDA does not know.
[[nodiscard]] inline bool is_thread_tag(cudaStream_t tag) noexcept {
  return (reinterpret_cast<std::uintptr_t>(tag) & thread_tag_bit) != 0;
}

/// The handle to give CUDA for `tag`, on the thread the tag belongs to (see above).
[[nodiscard]] inline cudaStream_t cuda_stream(cudaStream_t tag) noexcept {
  return is_thread_tag(tag) && tag == this_thread_stream_tag() ? cudaStreamPerThread : tag;
}

/// Whether `s` names a default stream: which device's it is depends on the current device.
[[nodiscard]] inline bool is_default_stream(cudaStream_t s) noexcept {
  return s == nullptr || s == cudaStreamLegacy || s == cudaStreamPerThread;
}

}  // namespace cudamem::detail
