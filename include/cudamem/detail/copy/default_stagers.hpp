// cudamem/detail/copy/default_stagers.hpp — when cudamem::copy (and a device_buffer made from a
// host range) stages a copy, and the stagers it stages through: `direct_copy_max_bytes` and its
// setter, one `default_copy_stager` per device, made on first use and never destroyed,
// `release_default_copy_stagers`, and `detail::copy_host_device`, the copy both call.
//
// Part of copy_stager.hpp, whose contract says what each does (default_copy_stager,
// direct_copy_max_bytes). Everything that reaches the stager is a template of one instantiation
// (copy_stager.hpp, "Why a template"): the class is only declared here, and is defined by the
// time a file that calls these is compiled through them.
#pragma once

#include <cudamem/detail/cuda/cuda_upstream.hpp>
#include <cudamem/detail/cuda/stream_ops.hpp>
#include <cudamem/detail/sync/atomic.hpp>
#include <cudamem/detail/sync/mutex.hpp>
#include <cudamem/error.hpp>
#include <cudamem/stream.hpp>

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdlib>
#include <vector>

namespace cudamem {

template <class Deferred>
class basic_copy_stager;  // copy_stager.hpp

/// cudamem::copy's threshold by default: 1 MiB. Measured on the H100 (bench_buffers, section 3,
/// the stager forced at every size against the driver's pageable copy): to the device, staging
/// loses at 256 KiB and 1 MiB (0.92x, 0.95x) and wins from 4 MiB (1.08x, then 1.6-2.9x); from
/// the device it wins at every size (1.08x at 4 KiB, 1.25x at 1 MiB), but below 1 MiB a copy
/// takes microseconds either way, and one threshold both ways keeps small copies plain CUDA.
inline constexpr std::size_t default_direct_copy_max_bytes = std::size_t{1} << 20;

namespace detail {

inline detail::atomic<std::size_t>& direct_copy_limit() noexcept {
  static detail::atomic<std::size_t> limit{default_direct_copy_max_bytes};
  return limit;
}

/// The default stagers, one per device; never destroyed (see the contract).
template <class Deferred>
struct default_stager_table {
  detail::mutex mutex;
  std::vector<basic_copy_stager<Deferred>*> per_device;
  detail::atomic<bool> retired{false};  // set at exit: copies go direct from then on
};

template <class Deferred = void>
inline default_stager_table<Deferred>& default_stagers() {
  static default_stager_table<Deferred>* const table = new default_stager_table<Deferred>;
  return *table;
}

template <class Deferred = void>
inline void release_stagers(bool retire) noexcept {
  default_stager_table<Deferred>& table = default_stagers<Deferred>();
  std::vector<basic_copy_stager<Deferred>*> stagers;
  {
    const detail::lock_guard lock{table.mutex};
    if (retire) {
      table.retired = true;
    }
    stagers = table.per_device;  // may throw bad_alloc: noexcept ends the program, as it should
  }
  for (basic_copy_stager<Deferred>* stager : stagers) {
    if (stager != nullptr) {
      stager->release();
    }
  }
}

template <class Deferred = void>
inline void retire_default_stagers_at_exit() noexcept {
  release_stagers<Deferred>(true);
}

}  // namespace detail

/// Copies of at most this many bytes are never staged by cudamem::copy.
[[nodiscard]] inline std::size_t direct_copy_max_bytes() noexcept {
  return detail::direct_copy_limit().load(detail::memory_order_relaxed);
}

/// Sets cudamem::copy's threshold for every thread (SIZE_MAX: never stage).
inline void set_direct_copy_max_bytes(std::size_t bytes) noexcept {
  detail::direct_copy_limit().store(bytes, detail::memory_order_relaxed);
}

/// The stager of `device` (-1: the current one), made on first use; see the contract. (Call it
/// as a function: `default_copy_stager()`, `default_copy_stager(1)`; the template parameter
/// only defers its compilation, see "Why a template".)
template <class Deferred = void>
[[nodiscard]] inline basic_copy_stager<Deferred>& default_copy_stager(int device = -1) {
  device = detail::resolve_device(device);
  detail::default_stager_table<Deferred>& table = detail::default_stagers<Deferred>();
  const detail::lock_guard lock{table.mutex};
  if (table.per_device.size() <= static_cast<std::size_t>(device)) {
    table.per_device.resize(static_cast<std::size_t>(device) + 1, nullptr);
  }
  basic_copy_stager<Deferred>*& stager = table.per_device[static_cast<std::size_t>(device)];
  if (stager == nullptr) {
    static const bool registered =
        std::atexit(&detail::retire_default_stagers_at_exit<Deferred>) == 0;
    static_cast<void>(registered);
    stager = new basic_copy_stager<Deferred>(device);
  }
  return *stager;
}

/// Frees every default stager's chunks and joins their threads (they start again if used).
template <class Deferred = void>
inline void release_default_copy_stagers() noexcept {
  detail::release_stagers<Deferred>(false);
}

namespace detail {

/// What cudamem::copy and device_buffer call for a copy with a host side and a device side:
/// one cudaMemcpyAsync, or a staged copy when it is large and between pageable and device
/// memory (see the contract).
template <class Deferred = void>
inline void copy_host_device(void* dst, const void* src, std::size_t bytes, stream_view stream) {
  if (bytes <= direct_copy_max_bytes() || default_stagers<Deferred>().retired) {
    copy_bytes(dst, src, bytes, stream);
    return;
  }
  cudaPointerAttributes to{};
  cudaPointerAttributes from{};
  check(cudaPointerGetAttributes(&to, dst), "cudaPointerGetAttributes (copy destination)");
  check(cudaPointerGetAttributes(&from, src), "cudaPointerGetAttributes (copy source)");
  const bool upload = from.type == cudaMemoryTypeUnregistered && to.type == cudaMemoryTypeDevice;
  const bool download = from.type == cudaMemoryTypeDevice && to.type == cudaMemoryTypeUnregistered;
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  if (upload || download) {
    check(cudaStreamIsCapturing(stream.get(), &capture), "cudaStreamIsCapturing");
  }
  if ((!upload && !download) || capture != cudaStreamCaptureStatusNone) {
    copy_bytes(dst, src, bytes, stream);
    return;
  }
  basic_copy_stager<Deferred>& stager = default_copy_stager<Deferred>(stream_device(stream));
  if (upload) {
    stager.copy_to_device(dst, src, bytes, stream);
  } else {
    stager.copy_to_host(dst, src, bytes, stream);
  }
}

}  // namespace detail

}  // namespace cudamem
