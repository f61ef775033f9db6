// cudamem/device_buffer.hpp — a typed, move-only owner of device memory, allocated and freed
// in stream order from a memory resource. The RAII answer to "an exception skipped my
// cudaFree".
//
//   #include <cudamem/device_buffer.hpp>
//
//   cudamem::stream s;
//   cudamem::device_buffer<float> a(n, s);                       // uninitialised, current resource
//   cudamem::device_buffer<float> z(n, cudamem::zero_fill, s);   // zeros
//   cudamem::device_buffer<float> ones(n, 1.0f, s);              // n copies of 1.0f
//   cudamem::device_buffer<float> h(host_vector, s);             // a copy of a host range
//   kernel<<<g, b, 0, s.get()>>>(a.span());                     // a device_span<float>
//   a.resize(2 * n, s);                                          // keeps the first n
//   auto b = a.clone(s);                                         // explicit deep copy
//   cudamem::device_buffer<float> c(n, s, my_pool);              // from any resource
//   throw std::runtime_error("oops");                            // all of them freed, on s
//
// Contract
// - `T` is trivially copyable (the buffer copies bytes, and never runs constructors or
//   destructors on the device). Checked at compile time.
// - The buffer remembers its resource (default: `get_current_resource()` of the current
//   device), its device (the resource's) and its stream, and frees on them in a noexcept
//   destructor — whatever device or resource is current by then, on whatever thread. The
//   resource must outlive the buffer. A default stream (`stream_view{}`, legacy, per-thread)
//   is taken as the buffer's device's default stream: allocation, initialisation and free
//   run with that device current, and the caller's device is restored.
// - The resource's kind must be device-accessible (device, managed or pinned memory);
//   host memory is refused with `std::invalid_argument` naming the kind.
// - `n * sizeof(T)` overflowing size_t throws `std::length_error` before anything is asked
//   of the resource. Out of memory is the resource's `out_of_memory`.
// - Every allocation is stream-ordered on the buffer's stream; initialisation (zero, value,
//   host copy) is enqueued on that stream too. The memory is then usable at once by work on
//   that stream; other streams and the host must synchronise with it first, as with any
//   CUDA work. A host range is copied as cudamem::copy does (copy.hpp): pageable memory is
//   staged before the constructor returns (above 1 MiB through copy_stager.hpp's pinned
//   chunks, several times faster than the driver); pinned memory must stay unchanged until
//   the stream reaches the copy.
// - Members that take a stream (`resize`, `reserve`, `clone`, `set_stream`) first make that
//   stream wait for the work already submitted to the buffer's stream (an event, not a host
//   wait), so switching streams cannot race. `resize`, `reserve` and `set_stream` then adopt
//   the new stream: later frees happen on it.
// - Strong exception guarantee: a constructor that throws leaks nothing; `resize`, `reserve`
//   and `clone` that throw leave the buffer as it was.
// - `resize(n)` keeps the first min(n, size()) elements; new elements are uninitialised.
//   Shrinking keeps the capacity (like std::vector); growing allocates exactly n.
// - `release()` gives up ownership and returns what is needed to free the memory later.
// - A moved-from buffer is empty (size 0, no memory) and keeps its resource and stream; it
//   may be used again, e.g. resized.
// - Every allocating member takes the caller's `std::source_location` as its last, defaulted
//   parameter and hands it to the resource, so tracking adaptors name the user's line.
#pragma once

#include <cudamem/copy_stager.hpp>
#include <cudamem/current_resource.hpp>
#include <cudamem/detail/buffers/owned_block.hpp>
#include <cudamem/detail/cuda/stream_ops.hpp>
#include <cudamem/detail/host_range.hpp>
#include <cudamem/device.hpp>
#include <cudamem/device_span.hpp>
#include <cudamem/memory_resource.hpp>
#include <cudamem/stream.hpp>

#include <cstddef>
#include <limits>
#include <source_location>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>

namespace cudamem {

/// A typed, move-only owner of `n` elements of device memory, freed in stream order.
template <class T>
class device_buffer {
  static_assert(std::is_trivially_copyable_v<T>,
                "device_buffer<T> needs a trivially copyable T: it copies bytes and never runs "
                "constructors or destructors on the device");
  static_assert(!std::is_const_v<T> && !std::is_volatile_v<T>,
                "device_buffer<T>: T must not be const or volatile");

 public:
  using value_type = T;           ///< the element type
  using size_type = std::size_t;  ///< sizes and counts of elements

  /// The alignment every buffer asks for: enough for T, and at least what cudaMalloc gives.
  static constexpr std::size_t alignment =
      alignof(T) > default_alignment ? alignof(T) : default_alignment;

  /// `n` uninitialised elements, in stream order on `stream`, from `mr`.
  explicit device_buffer(std::size_t n, stream_view stream = {},
                         memory_resource& mr = get_current_resource(),
                         std::source_location where = std::source_location::current())
      : block_(allocate_block(n, stream, mr, where)), size_(n) {}

  /// `n` elements set to zero bytes.
  device_buffer(std::size_t n, zero_fill_t, stream_view stream = {},
                memory_resource& mr = get_current_resource(),
                std::source_location where = std::source_location::current())
      : device_buffer(n, stream, mr, where) {
    if (n != 0) {
      const device_guard on{device()};
      check(cudaMemsetAsync(data(), 0, size_bytes(), stream.get()), "device_buffer: cudaMemsetAsync");
    }
  }

  /// `n` copies of `value`.
  device_buffer(std::size_t n, const T& value, stream_view stream = {},
                memory_resource& mr = get_current_resource(),
                std::source_location where = std::source_location::current())
      : device_buffer(n, stream, mr, where) {
    if (n != 0) {
      const device_guard on{device()};
      detail::fill_bytes(data(), n, &value, sizeof(T), stream);
    }
  }

  /// A copy of the host range `host` (a std::vector, std::array, gsl::span, ... of T).
  template <detail::contiguous_range_of<T> Range>
  explicit device_buffer(const Range& host, stream_view stream = {},
                         memory_resource& mr = get_current_resource(),
                         std::source_location where = std::source_location::current())
      : device_buffer(static_cast<std::size_t>(std::ranges::size(host)), stream, mr, where) {
    if (size_ != 0) {
      const device_guard on{device()};
      detail::copy_host_device(data(), std::ranges::data(host), size_bytes(), stream);
    }
  }

  device_buffer(const device_buffer&) = delete;             ///< copies are explicit: clone()
  device_buffer& operator=(const device_buffer&) = delete;

  /// Takes `other`'s memory, resource and stream; `other` is left empty.
  device_buffer(device_buffer&& other) noexcept
      : block_(std::move(other.block_)), size_(std::exchange(other.size_, 0)) {}

  /// Frees what this buffer held (on its own stream), then takes `other`'s memory.
  device_buffer& operator=(device_buffer&& other) noexcept {
    if (this != &other) {
      block_ = std::move(other.block_);  // frees what this buffer held, on its own stream
      size_ = std::exchange(other.size_, 0);
    }
    return *this;
  }

  ~device_buffer() = default;  // owned_block frees on the remembered stream and resource

  // --- what it holds ----------------------------------------------------------------------

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

  /// The device pointer to the first element; nullptr when nothing is allocated.
  [[nodiscard]] T* data() noexcept { return static_cast<T*>(block_.get()); }
  /// The device pointer to the first element, read-only.
  [[nodiscard]] const T* data() const noexcept { return static_cast<const T*>(block_.get()); }

  /// A view for kernels.
  [[nodiscard]] device_span<T> span() noexcept { return {data(), size_}; }
  /// A read-only view for kernels.
  [[nodiscard]] device_span<const T> span() const noexcept { return {data(), size_}; }
  /// The view, implicitly: a buffer passes where a device_span is taken.
  operator device_span<T>() noexcept { return span(); }              // NOLINT: implicit by design
  /// The read-only view, implicitly.
  operator device_span<const T>() const noexcept { return span(); }  // NOLINT: implicit by design

  /// The stream the memory is ordered on, and will be freed on.
  [[nodiscard]] stream_view stream() const noexcept { return block_.stream(); }
  /// The resource it came from.
  [[nodiscard]] memory_resource& resource() const noexcept { return block_.resource(); }
  /// The device the memory belongs to (the resource's).
  [[nodiscard]] int device() const noexcept { return resource().device(); }

  // --- changing it --------------------------------------------------------------------------

  /// Makes `stream` the buffer's stream: it waits for the work already on the old one, and
  /// the buffer is later freed on it.
  void set_stream(stream_view stream) {
    adopt_stream(stream);
  }

  /// `n` elements, the first min(n, size()) kept; see the contract.
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

  /// A deep copy on `stream`, from the same resource; this buffer keeps its own stream.
  [[nodiscard]] device_buffer clone(stream_view stream,
                                    std::source_location where = std::source_location::current()) const {
    device_buffer copy(size_, stream, resource(), where);
    if (size_ != 0) {
      const device_guard on{device()};
      detail::order_after(stream, block_.stream());
      detail::copy_bytes(copy.data(), data(), size_bytes(), stream);
    }
    return copy;
  }

  /// Gives up ownership: the buffer is left empty and frees nothing; the caller frees the
  /// memory with `r.resource->deallocate(r.ptr, r.bytes, r.alignment, r.stream)`.
  [[nodiscard]] released_memory release() noexcept {
    size_ = 0;
    return block_.release();
  }

 private:
  static detail::owned_block allocate_block(std::size_t n, stream_view stream, memory_resource& mr,
                                            const std::source_location& where) {
    if (!is_device_accessible(mr.kind())) {
      throw std::invalid_argument("cudamem: device_buffer needs device-accessible memory, but " +
                                  std::string(mr.name()) + " gives " +
                                  std::string(to_string(mr.kind())) + " memory");
    }
    const std::size_t bytes = detail::checked_bytes(n, sizeof(T), "device_buffer");
    return detail::owned_block(mr, bytes, alignment, stream, detail::allocation_form::stream_ordered,
                               where);
  }

  void adopt_stream(stream_view stream) {
    if (block_.get() != nullptr && stream != block_.stream()) {
      const device_guard on{device()};
      detail::order_after(stream, block_.stream());
    }
    block_.set_stream(stream);
  }

  /// Makes capacity at least `n` on `stream`, keeping the elements; strong guarantee.
  void grow_to(std::size_t n, stream_view stream, const std::source_location& where) {
    if (n <= capacity()) {
      adopt_stream(stream);
      return;
    }
    detail::owned_block bigger = allocate_block(n, stream, resource(), where);
    if (block_.get() != nullptr) {
      const device_guard on{device()};
      detail::order_after(stream, block_.stream());  // old work first, then copy and free
      detail::copy_bytes(bigger.get(), data(), size_bytes(), stream);
    }
    // The old block's last use (the copy) is on `stream`: free it there.
    block_.set_stream(stream);
    block_.swap(bigger);
  }  // `bigger` now holds the old block and frees it

  detail::owned_block block_;
  std::size_t size_;
};

}  // namespace cudamem
