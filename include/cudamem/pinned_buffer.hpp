// cudamem/pinned_buffer.hpp — a typed, move-only owner of page-locked host memory: a host
// range like std::vector, and the fast end of host<->device copies.
//
//   #include <cudamem/pinned_buffer.hpp>
//
//   cudamem::stream s;
//   cudamem::pinned_buffer<float> h(n, 0.5f);        // n copies of 0.5f, ready on the host
//   for (float& x : h) x *= 2;                       // an ordinary host range
//   gsl::span<float> view = h;                       // or h.span()
//   cudamem::device_buffer<float> d(n, s);
//   cudamem::copy(d, h, s);                          // copy.hpp: host -> device at full speed
//   cudamem::copy(h, d, s);
//   s.synchronize();                                 // before the host reads h again
//
// Contract
// - `T` is trivially copyable. The resource's kind must be `pinned` (std::invalid_argument
//   naming the kind otherwise). The default resource is `default_pinned_resource()`: one
//   pinned_resource (portable, so every device can use it), made on first use and never
//   destroyed. Pinning is slow; put a pool in front of it for buffers made often.
// - Memory is allocated with the resource's synchronous form, so it is ready for the host
//   when the constructor returns; initialisation (zero, value, host range) is done by the
//   host. The buffer remembers a stream and frees on it in its noexcept destructor: pending
//   copies into or out of it on that stream finish before the memory goes back.
// - `resize`, `reserve` and `clone` copy on the host, after waiting (on the host) for the
//   work submitted to the buffer's stream so far, so an in-flight copy into the buffer is
//   not lost. `resize`, `reserve` and `set_stream` adopt the given stream; `set_stream` makes
//   it wait for the old one (an event, not a host wait).
// - Overflow (`std::length_error`), exception safety, moved-from state, `release()` and
//   source locations: as device_buffer.
#pragma once

#include <cudamem/detail/buffers/owned_block.hpp>
#include <cudamem/detail/cuda/stream_ops.hpp>
#include <cudamem/detail/host_range.hpp>
#include <cudamem/memory_resource.hpp>
#include <cudamem/pinned_resource.hpp>
#include <cudamem/stream.hpp>

#include <gsl/gsl>

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <limits>
#include <source_location>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>

namespace cudamem {

/// The resource pinned_buffer uses when none is given: made on first use (on the device
/// current then; portable, so every device can use it) and never destroyed, so buffers in
/// static objects can still free into it at exit.
[[nodiscard]] inline memory_resource& default_pinned_resource() {
  static pinned_resource* const resource = new pinned_resource(cudaHostAllocPortable);
  return *resource;
}

/// A typed, move-only owner of `n` elements of page-locked host memory.
template <class T>
class pinned_buffer {
  static_assert(std::is_trivially_copyable_v<T>,
                "pinned_buffer<T> needs a trivially copyable T: it is copied as bytes to and "
                "from the device");
  static_assert(!std::is_const_v<T> && !std::is_volatile_v<T>,
                "pinned_buffer<T>: T must not be const or volatile");

 public:
  using value_type = T;             ///< the element type
  using size_type = std::size_t;    ///< sizes and counts of elements
  using iterator = T*;              ///< a plain pointer
  using const_iterator = const T*;  ///< a plain pointer to const

  /// The alignment every buffer asks for: enough for T, and at least `default_alignment`.
  static constexpr std::size_t alignment = std::max(alignof(T), default_alignment);

  /// `n` uninitialised elements from `mr`, freed later on `stream`.
  explicit pinned_buffer(std::size_t n, stream_view stream = {},
                         memory_resource& mr = default_pinned_resource(),
                         std::source_location where = std::source_location::current())
      : block_(allocate_block(n, stream, mr, where)), size_(n) {}

  /// `n` elements set to zero bytes.
  pinned_buffer(std::size_t n, zero_fill_t, stream_view stream = {},
                memory_resource& mr = default_pinned_resource(),
                std::source_location where = std::source_location::current())
      : pinned_buffer(n, stream, mr, where) {
    if (n != 0) {
      std::memset(data(), 0, size_bytes());
    }
  }

  /// `n` copies of `value`.
  pinned_buffer(std::size_t n, const T& value, stream_view stream = {},
                memory_resource& mr = default_pinned_resource(),
                std::source_location where = std::source_location::current())
      : pinned_buffer(n, stream, mr, where) {
    std::fill(begin(), end(), value);
  }

  /// A copy of the host range `host`.
  template <detail::contiguous_range_of<T> Range>
  explicit pinned_buffer(const Range& host, stream_view stream = {},
                         memory_resource& mr = default_pinned_resource(),
                         std::source_location where = std::source_location::current())
      : pinned_buffer(static_cast<std::size_t>(std::ranges::size(host)), stream, mr, where) {
    if (size_ != 0) {
      std::memcpy(data(), std::ranges::data(host), size_bytes());
    }
  }

  pinned_buffer(const pinned_buffer&) = delete;  ///< copies are explicit: clone()
  pinned_buffer& operator=(const pinned_buffer&) = delete;

  /// Takes `other`'s memory, resource and stream; `other` is left empty.
  pinned_buffer(pinned_buffer&& other) noexcept
      : block_(std::move(other.block_)), size_(std::exchange(other.size_, 0)) {}

  /// Frees what this buffer held (on its own stream), then takes `other`'s memory.
  pinned_buffer& operator=(pinned_buffer&& other) noexcept {
    if (this != &other) {
      block_ = std::move(other.block_);
      size_ = std::exchange(other.size_, 0);
    }
    return *this;
  }

  ~pinned_buffer() = default;

  // --- a host range ---------------------------------------------------------------------------

  /// Elements held.
  [[nodiscard]] std::size_t size() const noexcept { return size_; }
  /// Bytes held: size() * sizeof(T).
  [[nodiscard]] std::size_t size_bytes() const noexcept { return size_ * sizeof(T); }
  /// Elements the memory has room for without another allocation.
  [[nodiscard]] std::size_t capacity() const noexcept { return block_.bytes() / sizeof(T); }
  /// Whether size() is 0.
  [[nodiscard]] bool empty() const noexcept { return size_ == 0; }
  /// The most elements whose bytes size_t can count.
  [[nodiscard]] static constexpr std::size_t max_size() noexcept {
    return std::numeric_limits<std::size_t>::max() / sizeof(T);
  }

  /// The first element; nullptr when nothing is allocated.
  [[nodiscard]] T* data() noexcept { return static_cast<T*>(block_.get()); }
  /// The first element, read-only.
  [[nodiscard]] const T* data() const noexcept { return static_cast<const T*>(block_.get()); }
  /// The first element, for range-for and the standard algorithms.
  [[nodiscard]] T* begin() noexcept { return data(); }
  /// One past the last element.
  [[nodiscard]] T* end() noexcept { return data() + size_; }
  /// The first element, read-only.
  [[nodiscard]] const T* begin() const noexcept { return data(); }
  /// One past the last element, read-only.
  [[nodiscard]] const T* end() const noexcept { return data() + size_; }
  /// Unchecked, like std::vector's.
  [[nodiscard]] T& operator[](std::size_t i) noexcept { return data()[i]; }
  /// Element `i`, read-only; unchecked.
  [[nodiscard]] const T& operator[](std::size_t i) const noexcept { return data()[i]; }

  /// The elements as a host span.
  [[nodiscard]] gsl::span<T> span() noexcept { return {data(), size_}; }
  /// The elements as a read-only host span.
  [[nodiscard]] gsl::span<const T> span() const noexcept { return {data(), size_}; }
  /// The span, implicitly: a buffer passes where a gsl::span is taken.
  operator gsl::span<T>() noexcept { return span(); }              // NOLINT: implicit by design
  /// The read-only span, implicitly.
  operator gsl::span<const T>() const noexcept { return span(); }  // NOLINT: implicit by design

  /// The stream the buffer will be freed on (and that resize and clone wait for).
  [[nodiscard]] stream_view stream() const noexcept { return block_.stream(); }
  /// The resource it came from.
  [[nodiscard]] memory_resource& resource() const noexcept { return block_.resource(); }
  /// The resource's device: the one whose context allocated the memory.
  [[nodiscard]] int device() const noexcept { return resource().device(); }

  // --- changing it ----------------------------------------------------------------------------

  /// Makes `stream` the buffer's stream; it waits for the old one's work first.
  void set_stream(stream_view stream) {
    if (block_.get() != nullptr) {
      detail::order_after(stream, block_.stream());
    }
    block_.set_stream(stream);
  }

  /// `n` elements, the first min(n, size()) kept (copied on the host); see the contract.
  void resize(std::size_t n, stream_view stream,
              std::source_location where = std::source_location::current()) {
    grow_to(n, stream, where);
    size_ = n;
  }

  /// Room for `n` elements without another allocation; the size is unchanged.
  void reserve(std::size_t n, stream_view stream,
               std::source_location where = std::source_location::current()) {
    grow_to(n, stream, where);
  }

  /// A deep copy from the same resource, freed later on `stream`; made on the host after
  /// waiting for this buffer's stream.
  [[nodiscard]] pinned_buffer clone(stream_view stream,
                                    std::source_location where = std::source_location::current()) const {
    pinned_buffer copy(size_, stream, resource(), where);
    if (size_ != 0) {
      block_.stream().synchronize();
      std::memcpy(copy.data(), data(), size_bytes());
    }
    return copy;
  }

  /// Gives up ownership: the buffer is left empty and frees nothing; see device_buffer::release.
  [[nodiscard]] released_memory release() noexcept {
    size_ = 0;
    return block_.release();
  }

 private:
  static detail::owned_block allocate_block(std::size_t n, stream_view stream, memory_resource& mr,
                                            const std::source_location& where) {
    if (mr.kind() != memory_kind::pinned) {
      throw std::invalid_argument("cudamem: pinned_buffer needs pinned host memory, but " +
                                  std::string(mr.name()) + " gives " +
                                  std::string(to_string(mr.kind())) + " memory");
    }
    const std::size_t bytes = detail::checked_bytes(n, sizeof(T), "pinned_buffer");
    return detail::owned_block(mr, bytes, alignment, stream, detail::allocation_form::synchronous,
                               where);
  }

  void grow_to(std::size_t n, stream_view stream, const std::source_location& where) {
    if (n <= capacity()) {
      set_stream(stream);
      return;
    }
    detail::owned_block bigger = allocate_block(n, stream, resource(), where);
    if (block_.get() != nullptr) {
      block_.stream().synchronize();  // an in-flight copy into the old block lands first
      std::memcpy(bigger.get(), data(), size_bytes());
    }
    block_.swap(bigger);
  }  // `bigger` now holds the old block (idle: we waited) and frees it on the old stream

  detail::owned_block block_;
  std::size_t size_;
};

}  // namespace cudamem
