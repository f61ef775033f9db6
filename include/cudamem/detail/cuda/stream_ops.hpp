// cudamem/detail/cuda/stream_ops.hpp — the few CUDA operations the typed owners and copy.hpp
// build on: ordering one stream after another, copying bytes, and filling with a value
// without a kernel (so that every header compiles with a plain C++ compiler).
#pragma once

#include <cudamem/detail/cuda/quiet_device_scope.hpp>
#include <cudamem/device.hpp>
#include <cudamem/error.hpp>
#include <cudamem/stream.hpp>

#include <cuda_runtime_api.h>

#include <cstddef>

namespace cudamem::detail {

/// The device `stream` belongs to: its own, or the current device for a default-stream handle
/// (which names whichever device is current).
[[nodiscard]] inline int stream_device(stream_view stream) {
  int device = -1;
  if (stream.is_default()) {
    check(cudaGetDevice(&device), "cudaGetDevice");
  } else {
    check(cudaStreamGetDevice(stream.get(), &device), "cudaStreamGetDevice");
  }
  return device;
}

/// Makes work submitted to `later` from now on wait for the work submitted to `earlier` so
/// far, without blocking the host (an event recorded on one, waited on by the other). Nothing
/// when they are the same stream: stream order already does it. The two may belong to
/// different devices: the event is made and recorded on `earlier`'s device (CUDA refuses an
/// event and a stream of different devices), and `later` may wait for an event of any device.
/// A default-stream handle is the current device's stream, as everywhere in CUDA.
inline void order_after(stream_view later, stream_view earlier) {
  if (later == earlier) {
    return;
  }
  const int device = stream_device(earlier);
  cudaEvent_t marker = nullptr;
  cudaError_t recorded = cudaSuccess;
  {
    const device_guard on{device};
    check(cudaEventCreateWithFlags(&marker, cudaEventDisableTiming), "cudaEventCreateWithFlags");
    recorded = cudaEventRecord(marker, earlier.get());
  }
  // Back on the caller's device: a default `later` is the caller's stream.
  const cudaError_t waited =
      recorded == cudaSuccess ? cudaStreamWaitEvent(later.get(), marker, 0) : recorded;
  {
    // Destroying right away is allowed: the wait already enqueued keeps what it needs.
    const quiet_device_scope on{device, "cudaEventDestroy: switching to the event's device"};
    report_error(cudaEventDestroy(marker), "cudaEventDestroy");
  }
  check(waited, "ordering one stream after another (cudaEventRecord / cudaStreamWaitEvent)");
}

/// Stream-ordered copy of `bytes`; the direction comes from the pointers (unified addressing).
inline void copy_bytes(void* dst, const void* src, std::size_t bytes, stream_view stream) {
  if (bytes == 0) {
    return;
  }
  check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, stream.get()), "cudaMemcpyAsync");
}

/// True when every byte of `value` is the same, so cudaMemsetAsync can write it.
inline bool single_byte_pattern(const void* value, std::size_t size, unsigned char& byte) noexcept {
  const auto* bytes = static_cast<const unsigned char*>(value);
  byte = bytes[0];
  for (std::size_t i = 1; i < size; ++i) {
    if (bytes[i] != byte) {
      return false;
    }
  }
  return true;
}

/// Stream-ordered fill of `count` copies of the `size`-byte `value` at device-accessible
/// `dst`. A single repeated byte (zero, all-ones) is one cudaMemsetAsync. Anything else is
/// written once, then doubled: copy [0, k) to [k, 2k) until full — about log2(count) copies
/// moving `count` elements in total, at copy bandwidth, with no kernel needed. `value` may be
/// a host temporary: CUDA stages a pageable source before cudaMemcpyAsync returns.
inline void fill_bytes(void* dst, std::size_t count, const void* value, std::size_t size,
                       stream_view stream) {
  if (count == 0) {
    return;
  }
  unsigned char byte = 0;
  if (single_byte_pattern(value, size, byte)) {
    check(cudaMemsetAsync(dst, byte, count * size, stream.get()), "cudaMemsetAsync");
    return;
  }
  auto* out = static_cast<unsigned char*>(dst);
  copy_bytes(out, value, size, stream);
  std::size_t filled = 1;
  while (filled < count) {
    const std::size_t chunk = filled < count - filled ? filled : count - filled;
    copy_bytes(out + filled * size, out, chunk * size, stream);
    filled += chunk;
  }
}

}  // namespace cudamem::detail
