// cudamem/device_span.hpp — a non-owning, trivially copyable view of device memory that
// kernels take by value.
//
//   #include <cudamem/device_span.hpp>
//
//   __global__ void scale(cudamem::device_span<float> v, float by) {
//     const std::size_t i = blockIdx.x * blockDim.x + threadIdx.x;
//     if (i < v.size()) v[i] *= by;
//   }
//   cudamem::device_buffer<float> buf(n, s);
//   scale<<<blocks, 256, 0, s.get()>>>(buf.span(), 2.0f);   // or simply `buf`: it converts
//
// Contract
// - `device_span<T>` is a pointer and a count; it owns nothing and checks nothing about the
//   memory (the owner that made it does). It is trivially copyable, so it can be a kernel
//   argument, and its members are __host__ __device__ when compiled by nvcc; the header
//   compiles in plain C++ as well, where the span is just carried around.
// - Dereferencing (`operator[]`, `front`, `back`, iterating) is for device code, or for
//   host code when the memory is host-accessible (managed, pinned).
// - `device_span<T>` converts to `device_span<const T>`, never the other way.
// - `first`, `last`, `subspan` make narrower views; out-of-range arguments are the caller's
//   error (no checks in device code), as with std::span.
// - Unlike gsl::span and std::span, `device_span` says in its type that the memory is
//   the device's, which is how `copy()` (copy.hpp) tells directions apart.
#pragma once

#include <cstddef>
#include <type_traits>

#if defined(__CUDACC__)
#define CUDAMEM_HOST_DEVICE __host__ __device__
#else
#define CUDAMEM_HOST_DEVICE
#endif

namespace cudamem {

/// A non-owning view of `size()` elements of device memory: a pointer and a count.
template <class T>
class device_span {
 public:
  using element_type = T;                  ///< the element type, const or not
  using value_type = std::remove_cv_t<T>;  ///< the element type without const
  using size_type = std::size_t;           ///< sizes and counts of elements
  using pointer = T*;                      ///< a pointer to an element
  using reference = T&;                    ///< a reference to an element
  using iterator = T*;                     ///< a plain pointer

  constexpr device_span() noexcept = default;
  /// The `size` elements at `data` (a device-accessible pointer; not checked).
  CUDAMEM_HOST_DEVICE constexpr device_span(T* data, std::size_t size) noexcept
      : data_(data), size_(size) {}

  /// device_span<T> -> device_span<const T>.
  template <class U>
    requires std::is_convertible_v<U (*)[], T (*)[]>
  CUDAMEM_HOST_DEVICE constexpr device_span(const device_span<U>& other) noexcept  // NOLINT
      : data_(other.data()), size_(other.size()) {}

  /// The first element.
  CUDAMEM_HOST_DEVICE constexpr T* data() const noexcept { return data_; }
  /// Elements viewed.
  CUDAMEM_HOST_DEVICE constexpr std::size_t size() const noexcept { return size_; }
  /// Bytes viewed: size() * sizeof(T).
  CUDAMEM_HOST_DEVICE constexpr std::size_t size_bytes() const noexcept { return size_ * sizeof(T); }
  /// Whether size() is 0.
  CUDAMEM_HOST_DEVICE constexpr bool empty() const noexcept { return size_ == 0; }

  /// Element `i`; unchecked. Device code, or host code over host-accessible memory.
  CUDAMEM_HOST_DEVICE constexpr T& operator[](std::size_t i) const noexcept { return data_[i]; }
  /// The first element; the span must not be empty.
  CUDAMEM_HOST_DEVICE constexpr T& front() const noexcept { return data_[0]; }
  /// The last element; the span must not be empty.
  CUDAMEM_HOST_DEVICE constexpr T& back() const noexcept { return data_[size_ - 1]; }
  /// The first element, for range-for in device code.
  CUDAMEM_HOST_DEVICE constexpr T* begin() const noexcept { return data_; }
  /// One past the last element.
  CUDAMEM_HOST_DEVICE constexpr T* end() const noexcept { return data_ + size_; }

  /// The first `n` elements (`n` at most size(); unchecked).
  CUDAMEM_HOST_DEVICE constexpr device_span first(std::size_t n) const noexcept {
    return {data_, n};
  }
  /// The last `n` elements (`n` at most size(); unchecked).
  CUDAMEM_HOST_DEVICE constexpr device_span last(std::size_t n) const noexcept {
    return {data_ + (size_ - n), n};
  }
  /// The `n` elements from `offset` (within the span; unchecked).
  CUDAMEM_HOST_DEVICE constexpr device_span subspan(std::size_t offset, std::size_t n) const noexcept {
    return {data_ + offset, n};
  }
  /// The elements from `offset` to the end (`offset` at most size(); unchecked).
  CUDAMEM_HOST_DEVICE constexpr device_span subspan(std::size_t offset) const noexcept {
    return {data_ + offset, size_ - offset};
  }

 private:
  T* data_ = nullptr;
  std::size_t size_ = 0;
};

static_assert(std::is_trivially_copyable_v<device_span<float>>);

}  // namespace cudamem
