// cudamem/cccl_span.hpp — device memory as CCCL's standard views, `cuda::std::span` and
// `cuda::std::mdspan`: trivially copyable, so kernels take them by value, and usable in host
// and device code alike.
//
//   #include <cudamem/cccl_span.hpp>
//
//   __global__ void scale(cuda::std::mdspan<float, cuda::std::dextents<std::size_t, 2>> m) {
//     const std::size_t i = blockIdx.y, j = blockIdx.x * blockDim.x + threadIdx.x;
//     if (j < m.extent(1)) m(i, j) *= 2.0f;
//   }
//   cudamem::device_buffer<float> buf(rows * cols, s);
//   auto m = cudamem::as_mdspan(buf, rows, cols);            // row-major rows x cols
//   scale<<<dim3(blocks, rows), 256, 0, s.get()>>>(m);
//   auto t = cudamem::as_mdspan<cuda::std::layout_left>(buf, rows, cols);   // column-major
//   cuda::std::span<float> v = cudamem::as_span(buf);        // whole buffer, 1-D
//   using rows_of_4 = cuda::std::extents<std::size_t, cuda::std::dynamic_extent, 4>;
//   auto fixed = cudamem::as_mdspan(buf, rows_of_4{rows});   // static extents too
//
// Contract
// - `as_span(x)` views all of a device_buffer or device_span: same data pointer, same size;
//   a const buffer gives a span of const T. For a device_span it is __host__ __device__.
// - `as_mdspan<Layout>(x, e0, e1, ...)` views the first e0*e1*... elements of x as a
//   rank-N array with `std::size_t` extents (`cuda::std::dextents<std::size_t, N>`), in
//   `Layout` (default `layout_right`, row-major; `layout_left` is column-major, as BLAS).
//   An `extents` object may be passed instead, for static extents.
// - Checked on the host when the view is made: extents that need more elements than x holds,
//   or whose product overflows, throw `std::invalid_argument`, naming both sizes. Fewer is
//   allowed (a view of a prefix, e.g. of a buffer with spare capacity). Indexing is not
//   checked (no checks in device code), as with std::mdspan.
// - The views own nothing: the buffer must outlive them (a view of a temporary buffer does
//   not compile), and stream order is the buffer's (see device_buffer.hpp) — a view does not
//   make memory ready on another stream.
// - Dereferencing on the host is for host-accessible memory only (managed, pinned).
// - `cuda::std::mdspan` in C++20 indexes with `m(i, j)` (CCCL's extension; `m[i, j]` needs
//   C++23).
#pragma once

#include <cudamem/device_buffer.hpp>
#include <cudamem/device_span.hpp>

#include <cuda/std/mdspan>
#include <cuda/std/span>

#include <concepts>
#include <cstddef>
#include <limits>
#include <stdexcept>
#include <string>

namespace cudamem {

// --- spans -------------------------------------------------------------------------------------

/// All of `s` as a `cuda::std::span`; host and device code.
template <class T>
[[nodiscard]] CUDAMEM_HOST_DEVICE constexpr cuda::std::span<T> as_span(device_span<T> s) noexcept {
  return cuda::std::span<T>(s.data(), s.size());
}
/// All of `b` as a `cuda::std::span`.
template <class T>
[[nodiscard]] cuda::std::span<T> as_span(device_buffer<T>& b) noexcept {
  return cuda::std::span<T>(b.data(), b.size());
}
/// All of `b` as a `cuda::std::span` of const T.
template <class T>
[[nodiscard]] cuda::std::span<const T> as_span(const device_buffer<T>& b) noexcept {
  return cuda::std::span<const T>(b.data(), b.size());
}
template <class T>
cuda::std::span<T> as_span(device_buffer<T>&&) = delete;  ///< a view of a buffer about to die

// --- mdspans -----------------------------------------------------------------------------------

namespace detail {

/// Elements `extents` needs (product; 0 if any is 0), or std::invalid_argument when it
/// overflows or exceeds `available`. (The message is built only on failure: views are made
/// per kernel launch.)
template <class Extents>
std::size_t require_elements(const Extents& extents, std::size_t available) {
  std::size_t needed = 1;
  bool overflow = false;
  for (std::size_t r = 0; r < Extents::rank(); ++r) {
    const auto e = static_cast<std::size_t>(extents.extent(r));
    if (e == 0) {
      return 0;  // a zero extent: nothing is needed
    }
    if (needed > std::numeric_limits<std::size_t>::max() / e) {
      overflow = true;
    } else {
      needed *= e;
    }
  }
  if (overflow || needed > available) [[unlikely]] {
    std::string shape;
    for (std::size_t r = 0; r < Extents::rank(); ++r) {
      shape += (r == 0 ? "" : " x ") + std::to_string(static_cast<std::size_t>(extents.extent(r)));
    }
    throw std::invalid_argument("cudamem: as_mdspan: extents " + shape + " need " +
                                (overflow ? std::string("more than SIZE_MAX")
                                          : std::to_string(needed)) +
                                " elements, but the memory holds " + std::to_string(available));
  }
  return needed;
}

}  // namespace detail

/// A view of `s` with the given extents object (static or dynamic extents).
template <class Layout = cuda::std::layout_right, class T, class IndexType, std::size_t... Extents>
[[nodiscard]] cuda::std::mdspan<T, cuda::std::extents<IndexType, Extents...>, Layout> as_mdspan(
    device_span<T> s, const cuda::std::extents<IndexType, Extents...>& extents) {
  detail::require_elements(extents, s.size());
  return cuda::std::mdspan<T, cuda::std::extents<IndexType, Extents...>, Layout>(s.data(), extents);
}

/// A view of `s` as an array of `extents...` (each a std::size_t).
template <class Layout = cuda::std::layout_right, class T,
          std::convertible_to<std::size_t>... Sizes>
  requires(sizeof...(Sizes) > 0)
[[nodiscard]] cuda::std::mdspan<T, cuda::std::dextents<std::size_t, sizeof...(Sizes)>, Layout>
as_mdspan(device_span<T> s, Sizes... extents) {
  return as_mdspan<Layout>(
      s, cuda::std::dextents<std::size_t, sizeof...(Sizes)>(static_cast<std::size_t>(extents)...));
}

/// `as_mdspan` of `b.span()`: extents as sizes or as an extents object.
template <class Layout = cuda::std::layout_right, class T, class... Args>
[[nodiscard]] auto as_mdspan(device_buffer<T>& b, const Args&... args)
    -> decltype(as_mdspan<Layout>(device_span<T>{}, args...)) {
  return as_mdspan<Layout>(b.span(), args...);
}
/// `as_mdspan` of `b.span()`, of const T.
template <class Layout = cuda::std::layout_right, class T, class... Args>
[[nodiscard]] auto as_mdspan(const device_buffer<T>& b, const Args&... args)
    -> decltype(as_mdspan<Layout>(device_span<const T>{}, args...)) {
  return as_mdspan<Layout>(b.span(), args...);
}
template <class Layout = cuda::std::layout_right, class T, class... Args>
void as_mdspan(device_buffer<T>&&, const Args&...) = delete;  ///< a view of a buffer about to die

}  // namespace cudamem
