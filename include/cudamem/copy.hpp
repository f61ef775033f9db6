// cudamem/copy.hpp — stream-ordered copy and fill between device and host memory, with the
// direction read from the argument types and sizes checked.
//
//   #include <cudamem/copy.hpp>
//
//   std::vector<float> host(n, 1.0f);
//   cudamem::pinned_buffer<float> staging(n);
//   cudamem::device_buffer<float> dev(n, s);
//   cudamem::copy(dev, host, s);                    // host (pageable) -> device
//   cudamem::copy(staging, dev, s);                 // device -> pinned host, fully async
//   cudamem::copy(dev.span().first(10), gsl::span<const float>(host).first(10), s);
//   cudamem::fill(dev, 3.0f, s);                    // every element 3.0f, on s
//   cudamem::fill_zero(dev, s);                     // cudaMemsetAsync(0) on s
//   cudamem::copy(dev, std::vector<float>(n + 1), s);   // throws std::invalid_argument:
//                                                       // "destination has n elements, ..."
//
//   // Between GPUs: on_1 lives on device 1, written by a kernel on s1 (a stream of device 1).
//   cudamem::copy(on_0, on_1, s0, s1);              // on s0, after the work already on s1
//
// Contract
// - Operands: device side — `device_buffer<T>`, `device_span<T>`; host side —
//   `pinned_buffer<T>`, `gsl::span<T>`, `std::span<T>`, `std::vector<T>`, `std::array<T, N>`.
//   Any pair works (host->device, device->host, device->device, host->host). Element types
//   must be the same (a compile error otherwise), and the destination writable.
// - Sizes must match: a mismatch throws `std::invalid_argument` naming both sizes, before any
//   CUDA call. Zero elements is a no-op (no CUDA call).
// - The copy is one cudaMemcpyAsync on `stream` with cudaMemcpyDefault: unified addressing
//   lets CUDA see where each pointer lives, which also covers managed memory and a
//   device_buffer over pinned memory; the types decide what is accepted. Except: a copy of
//   more than `direct_copy_max_bytes()` (1 MiB) between pageable host memory and
//   device memory is staged through `default_copy_stager()` of the stream's device
//   (copy_stager.hpp: pinned chunks kept for reuse, a few host threads, DMA overlapped with
//   the host's memcpy; several times the driver's pageable speed). Same timing as below.
// - Between devices: device-side operands may live on different GPUs (device_buffers of two
//   devices' resources, vm memory mapped for a peer). It is the same single cudaMemcpyAsync:
//   unified addressing makes it a peer copy, direct over NVLink or PCIe when the devices have a
//   peer path, staged through the host by the driver when they have none; no peer access
//   (peer_access.hpp) is needed for copies. `stream` may be a stream of either device, or of
//   none, whatever device is current; a default-stream handle is the *current* device's.
//   The copy is in stream order on `stream` only: work on other streams (the other device's
//   producer of `src`, a kernel still reading `dst`) is not waited for. Pass that stream as
//   `after` (the four-argument form): `stream` then first waits for the work submitted to
//   `after` so far, without blocking the host (an event recorded on `after`'s device, waited
//   for by `stream`; about the cost of one cudaEventCreate/Record/Destroy). Without `after`
//   the copy costs what cudaMemcpyAsync / cudaMemcpyPeerAsync cost (bench/peer_copy.cu).
// - Timing follows CUDA: with pinned or device memory on both ends the call returns at once
//   and the copy runs in stream order; a pageable source is staged before the call returns
//   (you may reuse it at once); a pageable destination is written before the call returns.
//   Everything else is yours to synchronise: read a pinned destination after `stream`
//   has reached the copy.
// - `fill(dst, value, stream)` / `fill_zero(dst, stream)`: device-side operands are filled in
//   stream order (cudaMemsetAsync when every byte of the value is the same, else copies that
//   double the filled part); host-side operands are filled by the host after waiting for
//   `stream`, so a pending copy into them cannot overwrite the fill.
// - CUDA errors throw `cuda_error`.
#pragma once

#include <cudamem/copy_stager.hpp>
#include <cudamem/detail/cuda/stream_ops.hpp>
#include <cudamem/device_buffer.hpp>
#include <cudamem/device_span.hpp>
#include <cudamem/error.hpp>
#include <cudamem/pinned_buffer.hpp>
#include <cudamem/stream.hpp>

#include <gsl/gsl>

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstring>
#include <span>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

namespace cudamem {

namespace detail {

enum class memory_side { host, device };

/// A copy operand reduced to what the copy needs.
template <class T>
struct copy_operand {
  T* data;
  std::size_t size;
  memory_side side;
};

// One `as_operand` per accepted type: const objects give const elements, which can only be
// a source.
template <class T>
copy_operand<T> as_operand(device_buffer<T>& b) noexcept { return {b.data(), b.size(), memory_side::device}; }
template <class T>
copy_operand<const T> as_operand(const device_buffer<T>& b) noexcept { return {b.data(), b.size(), memory_side::device}; }
template <class T>
copy_operand<T> as_operand(device_span<T> s) noexcept { return {s.data(), s.size(), memory_side::device}; }
template <class T>
copy_operand<T> as_operand(pinned_buffer<T>& b) noexcept { return {b.data(), b.size(), memory_side::host}; }
template <class T>
copy_operand<const T> as_operand(const pinned_buffer<T>& b) noexcept { return {b.data(), b.size(), memory_side::host}; }
template <class T, std::size_t Extent>
copy_operand<T> as_operand(gsl::span<T, Extent> s) noexcept { return {s.data(), s.size(), memory_side::host}; }
template <class T, std::size_t Extent>
copy_operand<T> as_operand(std::span<T, Extent> s) noexcept { return {s.data(), s.size(), memory_side::host}; }
template <class T, class Allocator>
copy_operand<T> as_operand(std::vector<T, Allocator>& v) noexcept { return {v.data(), v.size(), memory_side::host}; }
template <class T, class Allocator>
copy_operand<const T> as_operand(const std::vector<T, Allocator>& v) noexcept { return {v.data(), v.size(), memory_side::host}; }
template <class T, std::size_t N>
copy_operand<T> as_operand(std::array<T, N>& a) noexcept { return {a.data(), a.size(), memory_side::host}; }
template <class T, std::size_t N>
copy_operand<const T> as_operand(const std::array<T, N>& a) noexcept { return {a.data(), a.size(), memory_side::host}; }

template <class X>
concept copyable_operand = requires(X& x) { as_operand(x); };

template <class X>
using operand_element = std::remove_pointer_t<decltype(as_operand(std::declval<X&>()).data)>;

constexpr const char* side_name(memory_side side) noexcept {
  return side == memory_side::device ? "device" : "host";
}

}  // namespace detail

/// Copies `src` into `dst` in stream order on `stream`; see the contract above.
template <class Dst, class Src>
  requires detail::copyable_operand<std::remove_reference_t<Dst>> &&
           detail::copyable_operand<std::remove_reference_t<Src>>
void copy(Dst&& dst, Src&& src, stream_view stream) {
  using to_element = detail::operand_element<std::remove_reference_t<Dst>>;
  using from_element = detail::operand_element<std::remove_reference_t<Src>>;
  static_assert(!std::is_const_v<to_element>,
                "cudamem::copy: the destination is read-only (const elements or a const object)");
  static_assert(std::is_same_v<to_element, std::remove_const_t<from_element>>,
                "cudamem::copy: source and destination must have the same element type");
  const auto to = detail::as_operand(dst);
  const auto from = detail::as_operand(src);
  if (to.size != from.size) {
    throw std::invalid_argument("cudamem::copy: the " + std::string(detail::side_name(to.side)) +
                                " destination has " + std::to_string(to.size) + " elements, the " +
                                detail::side_name(from.side) + " source has " +
                                std::to_string(from.size));
  }
  const std::size_t bytes = to.size * sizeof(to_element);
  if (to.side != from.side) {
    detail::copy_host_device(to.data, from.data, bytes, stream);  // staged when it pays
  } else {
    detail::copy_bytes(to.data, from.data, bytes, stream);
  }
}

/// Copies `src` into `dst` on `stream` once the work submitted to `after` so far is done (for
/// copies between devices: `after` is the other device's stream); see the contract above.
template <class Dst, class Src>
  requires detail::copyable_operand<std::remove_reference_t<Dst>> &&
           detail::copyable_operand<std::remove_reference_t<Src>>
void copy(Dst&& dst, Src&& src, stream_view stream, stream_view after) {
  {
    // Sizes first: a mismatch throws before anything is enqueued, as in the 3-argument form.
    const auto to = detail::as_operand(dst);
    const auto from = detail::as_operand(src);
    if (to.size != from.size || to.size == 0) {
      copy(std::forward<Dst>(dst), std::forward<Src>(src), stream);  // throws, or a no-op
      return;
    }
  }
  detail::order_after(stream, after);
  copy(std::forward<Dst>(dst), std::forward<Src>(src), stream);
}

/// Sets every element of `dst` to `value`; see the contract above.
template <class Dst>
  requires detail::copyable_operand<std::remove_reference_t<Dst>>
void fill(Dst&& dst, const detail::operand_element<std::remove_reference_t<Dst>>& value,
          stream_view stream) {
  using element = detail::operand_element<std::remove_reference_t<Dst>>;
  static_assert(!std::is_const_v<element>, "cudamem::fill: the destination is read-only");
  const auto to = detail::as_operand(dst);
  if (to.size == 0) {
    return;
  }
  if (to.side == detail::memory_side::device) {
    detail::fill_bytes(to.data, to.size, &value, sizeof(element), stream);
  } else {
    stream.synchronize();
    std::fill(to.data, to.data + to.size, value);
  }
}

/// Sets every byte of `dst` to zero; see the contract above.
template <class Dst>
  requires detail::copyable_operand<std::remove_reference_t<Dst>>
void fill_zero(Dst&& dst, stream_view stream) {
  using element = detail::operand_element<std::remove_reference_t<Dst>>;
  static_assert(!std::is_const_v<element>, "cudamem::fill_zero: the destination is read-only");
  const auto to = detail::as_operand(dst);
  if (to.size == 0) {
    return;
  }
  if (to.side == detail::memory_side::device) {
    check(cudaMemsetAsync(to.data, 0, to.size * sizeof(element), stream.get()), "cudaMemsetAsync");
  } else {
    stream.synchronize();
    std::memset(static_cast<void*>(to.data), 0, to.size * sizeof(element));
  }
}

}  // namespace cudamem
