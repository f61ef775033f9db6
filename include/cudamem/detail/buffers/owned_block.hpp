// cudamem/detail/buffers/owned_block.hpp — one allocation from a resource, freed on its stream when
// the block is destroyed: the single owning piece inside device_buffer and pinned_buffer.
// Keeping ownership in one small type is what makes the buffers exception-safe without a
// try/catch in every member: a block made before a step that throws frees itself.
//
// Several devices. A block may be freed by a thread that has another device current (a
// worker driving several GPUs, a buffer handed between threads). Resources allocate and free
// on their own device whatever device is current, but a *default* stream handle (0, legacy,
// per-thread) names a stream of the current device, not of the resource's: a pool that
// records an event on it, or makes it wait, would order the wrong device's stream. So a block
// on a default stream makes its resource's device current around the allocate and the free
// (one cudaGetDevice when it already is); a block on an ordinary stream, which carries its
// own device, calls nothing extra.
#pragma once

#include <cudamem/detail/cuda/quiet_device_scope.hpp>
#include <cudamem/device.hpp>
#include <cudamem/memory_resource.hpp>
#include <cudamem/stream.hpp>

#include <cuda_runtime_api.h>

#include <cstddef>
#include <limits>
#include <source_location>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>

namespace cudamem {

/// What a buffer's `release()` hands back: everything needed to free the memory later,
/// exactly as the buffer would have (`resource->deallocate(ptr, bytes, alignment, stream)`).
struct released_memory {
  void* ptr = nullptr;                  ///< the memory (nullptr: there was none)
  std::size_t bytes = 0;                ///< its size, as allocated
  std::size_t alignment = 0;            ///< the alignment it was allocated with
  stream_view stream;                   ///< the stream to free it on
  memory_resource* resource = nullptr;  ///< the resource to free it with
};

/// Tag for device_buffer and pinned_buffer: construct filled with zero bytes.
struct zero_fill_t {
  explicit zero_fill_t() = default;
};
/// The tag value: `device_buffer<float> z(n, cudamem::zero_fill, s)`.
inline constexpr zero_fill_t zero_fill{};

namespace detail {

/// `n` elements of `element_size` bytes in bytes; std::length_error (naming the owner) when
/// the product does not fit in size_t, instead of a silently wrapped, small allocation.
inline std::size_t checked_bytes(std::size_t n, std::size_t element_size, std::string_view owner) {
  if (element_size != 0 && n > std::numeric_limits<std::size_t>::max() / element_size) {
    throw std::length_error("cudamem: " + std::string(owner) + ": " + std::to_string(n) +
                            " elements of " + std::to_string(element_size) +
                            " bytes do not fit in size_t (overflow)");
  }
  return n * element_size;
}

/// How a block asks its resource: in stream order on its stream, or synchronously (ready for
/// the host on return; what pinned_buffer uses).
enum class allocation_form { stream_ordered, synchronous };

class owned_block {
 public:
  /// An empty block that remembers where future memory comes from.
  owned_block(memory_resource& resource, stream_view stream) noexcept
      : resource_(&resource), stream_(stream) {}

  /// `bytes` (may be 0: no memory, no call) from `resource`.
  owned_block(memory_resource& resource, std::size_t bytes, std::size_t alignment,
              stream_view stream, allocation_form form, const std::source_location& where)
      : resource_(&resource), stream_(stream), alignment_(alignment) {
    if (form == allocation_form::synchronous) {
      ptr_ = resource.allocate(bytes, alignment, where);
    } else if (names_current_device(resource, stream) && bytes != 0) {
      const device_guard on{resource.device()};  // the default stream of the resource's device
      ptr_ = resource.allocate(bytes, alignment, stream, where);
    } else {
      ptr_ = resource.allocate(bytes, alignment, stream, where);
    }
    bytes_ = ptr_ != nullptr ? bytes : 0;
  }

  ~owned_block() { reset(); }

  owned_block(const owned_block&) = delete;
  owned_block& operator=(const owned_block&) = delete;

  owned_block(owned_block&& other) noexcept
      : resource_(other.resource_),
        stream_(other.stream_),
        ptr_(std::exchange(other.ptr_, nullptr)),
        bytes_(std::exchange(other.bytes_, 0)),
        alignment_(other.alignment_) {}

  owned_block& operator=(owned_block&& other) noexcept {
    if (this != &other) {
      reset();  // free what we hold before taking the other block
      resource_ = other.resource_;
      stream_ = other.stream_;
      ptr_ = std::exchange(other.ptr_, nullptr);
      bytes_ = std::exchange(other.bytes_, 0);
      alignment_ = other.alignment_;
    }
    return *this;
  }

  /// Frees the memory (on the block's stream) and leaves the block empty.
  void reset() noexcept {
    if (ptr_ == nullptr) {
      return;
    }
    if (names_current_device(*resource_, stream_)) {
      const quiet_device_scope on{resource_->device(), "cudamem: freeing a buffer on its device"};
      resource_->deallocate(ptr_, bytes_, alignment_, stream_);
    } else {
      resource_->deallocate(ptr_, bytes_, alignment_, stream_);
    }
    ptr_ = nullptr;
    bytes_ = 0;
  }

  /// Gives up ownership without freeing.
  released_memory release() noexcept {
    released_memory out{ptr_, bytes_, alignment_, stream_, resource_};
    ptr_ = nullptr;
    bytes_ = 0;
    return out;
  }

  void swap(owned_block& other) noexcept {
    std::swap(resource_, other.resource_);
    std::swap(stream_, other.stream_);
    std::swap(ptr_, other.ptr_);
    std::swap(bytes_, other.bytes_);
    std::swap(alignment_, other.alignment_);
  }

  [[nodiscard]] void* get() const noexcept { return ptr_; }
  [[nodiscard]] std::size_t bytes() const noexcept { return bytes_; }
  [[nodiscard]] std::size_t alignment() const noexcept { return alignment_; }
  [[nodiscard]] stream_view stream() const noexcept { return stream_; }
  void set_stream(stream_view stream) noexcept { stream_ = stream; }
  [[nodiscard]] memory_resource& resource() const noexcept { return *resource_; }

 private:
  /// True when `stream` is a default-stream handle (whose device is whatever is current) and
  /// the resource belongs to a real device: then that device must be current (see the top).
  /// With no usable device there is nothing to switch to: the resource gives its own error.
  static bool names_current_device(const memory_resource& resource, stream_view stream) noexcept {
    if (!stream.is_default() || resource.device() < 0) {
      return false;
    }
    try {
      return device_count() > 0;  // cached after the first call
    } catch (...) {
      return false;
    }
  }

  memory_resource* resource_;
  stream_view stream_;
  void* ptr_ = nullptr;
  std::size_t bytes_ = 0;
  std::size_t alignment_ = default_alignment;
};

}  // namespace detail
}  // namespace cudamem
