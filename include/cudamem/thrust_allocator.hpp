// cudamem/thrust_allocator.hpp — an allocator for thrust containers: a
// `thrust::device_vector<T, cudamem::thrust_allocator<T>>` takes its memory from any cudamem
// resource, in stream order on the stream the allocator carries, and does its own work (fill,
// copy) on that stream with its temporaries from the same resource.
//
//   #include <cudamem/thrust_allocator.hpp>
//
//   template <class T>
//   using device_vector = thrust::device_vector<T, cudamem::thrust_allocator<T>>;
//
//   cudamem::pool_resource pool{device};
//   cudamem::stream s;
//   cudamem::thrust_allocator<float> alloc{pool, s};
//   device_vector<float> v(1 << 20, 0.0f, alloc);           // from the pool, zeroed on s
//   device_vector<float> w(host.begin(), host.end(), alloc); // a copy of a host range, on s
//   thrust::sort(cudamem::exec_policy(pool, s), v.begin(), v.end());
//   s.synchronize();                                         // before reading on the host
//   }                                                        // v, w back to the pool, on s
//
// Contract
// - `T` is trivially copyable (thrust copies bytes into a device_vector and, with this
//   allocator, never runs constructors in device code). Checked at compile time.
// - `thrust_allocator<T>{mr, s}` hands out `thrust::device_ptr<T>` from
//   `mr.allocate(n * sizeof(T), max(alignof(T), 256), s)` and frees with
//   `mr.deallocate(..., s)`. The default constructor uses the current device's current
//   resource (current_resource.hpp) and the legacy default stream, like device_buffer.
// - The resource's kind must be device-accessible: `std::invalid_argument` otherwise, at
//   construction. `n * sizeof(T)` overflowing size_t throws `std::length_error` before the
//   resource is asked. Out of memory is the resource's `out_of_memory`; a container whose
//   allocation throws holds nothing.
// - Stream order: the container's memory is stream-ordered on `s`, as a device_buffer's. Its
//   destructor frees on `s`: work on other streams that uses the memory must be ordered before
//   the end of `s`'s work (synchronise, or an event) before the container goes. The
//   container's own work that thrust dispatches through the allocator — value-initialisation,
//   fills, copies from the host — runs on `s` under `cudamem::exec_policy(mr, s)` (thrust asks
//   the allocator's `system()` for it). Work thrust dispatches by the *iterators'* system runs
//   on thrust's default stream and waits for it: element access (`v[i]`), `thrust::copy` to the
//   host, and the device-to-device copies of copy-construction, assignment and a resize that
//   moves the elements (thrust picks the source iterator's system there). That work is ordered
//   with `s` when `s` is a blocking stream (the default kind of `cudamem::stream`) and the
//   program uses the legacy default stream (not `--default-stream per-thread`); otherwise
//   synchronise `s` first.
// - Equality: two allocators are equal when they use equal resources on the same stream
//   (memory from one may be freed through the other). Move-assignment and swap of containers
//   carry the allocator with the memory; copy-assignment keeps the target's allocator.
// - The resource must outlive every allocator and container that uses it.
// - The allocator remembers the line it was made on and passes it as the allocation site.
#pragma once

#include <cudamem/current_resource.hpp>
#include <cudamem/detail/buffers/owned_block.hpp>
#include <cudamem/exec_policy.hpp>
#include <cudamem/memory_resource.hpp>
#include <cudamem/stream.hpp>

#include <thrust/device_ptr.h>

#include <algorithm>
#include <cstddef>
#include <limits>
#include <source_location>
#include <type_traits>

namespace cudamem {

/// An allocator of `T` for thrust containers, over a cudamem resource and a stream.
template <class T>
class thrust_allocator {
  static_assert(std::is_trivially_copyable_v<T>,
                "thrust_allocator<T> needs a trivially copyable T: thrust copies bytes into the "
                "container and no constructor runs in device code");

 public:
  using value_type = T;                               ///< the element type
  using pointer = thrust::device_ptr<T>;              ///< device memory, as thrust marks it
  using const_pointer = thrust::device_ptr<const T>;  ///< read-only device memory
  using size_type = std::size_t;                      ///< counts of elements
  using difference_type = std::ptrdiff_t;             ///< pointer differences
  /// The container's own work (fill, copy, resize) runs under this policy: see the contract.
  using system_type = exec_policy;
  /// A copied-to container keeps its allocator.
  using propagate_on_container_copy_assignment = std::false_type;
  /// A moved-to container takes the other's allocator.
  using propagate_on_container_move_assignment = std::true_type;
  /// Swapped containers swap allocators.
  using propagate_on_container_swap = std::true_type;
  /// Equal only with the same resource and stream.
  using is_always_equal = std::false_type;

  /// The same allocator for elements of type `U`.
  template <class U>
  struct rebind {
    using other = thrust_allocator<U>;  ///< the rebound allocator
  };

  /// The alignment every allocation asks for: enough for T, and at least what cudaMalloc gives.
  static constexpr std::size_t alignment = std::max(alignof(T), default_alignment);

  /// The current device's current resource, on the legacy default stream.
  explicit thrust_allocator(std::source_location where = std::source_location::current())
      : thrust_allocator(get_current_resource(), stream_view{}, where) {}

  /// From `mr` (device-accessible, else std::invalid_argument), in stream order on `stream`.
  thrust_allocator(memory_resource& mr, stream_view stream,
                   std::source_location where = std::source_location::current())
      : policy_(detail::require_device_accessible(mr, "thrust_allocator"), stream, where) {}

  /// The same resource and stream, for another element type.
  template <class U>
  thrust_allocator(const thrust_allocator<U>& other) noexcept  // NOLINT: implicit, as allocators
      : policy_(other.resource(), other.stream(), other.site()) {}

  /// Room for `n` elements (a null pointer for 0), usable in stream order on the stream.
  [[nodiscard]] pointer allocate(size_type n) {
    const std::size_t bytes = detail::checked_bytes(n, sizeof(T), "thrust_allocator");
    return pointer(static_cast<T*>(resource().allocate(bytes, alignment, stream(), site())));
  }

  /// Gives back what `allocate(n)` returned; its last use was submitted to the stream.
  void deallocate(pointer p, size_type n) noexcept {
    resource().deallocate(p.get(), n * sizeof(T), alignment, stream());
  }

  /// The most elements whose bytes size_t can count.
  [[nodiscard]] static constexpr size_type max_size() noexcept {
    return std::numeric_limits<std::size_t>::max() / sizeof(T);
  }

  /// What thrust runs the container's own algorithms under (see the contract). Not const:
  /// thrust's allocator_system looks for exactly `system_type& system()`.
  [[nodiscard]] exec_policy& system() noexcept { return policy_; }

  /// The resource it allocates from.
  [[nodiscard]] memory_resource& resource() const noexcept { return policy_.resource(); }
  /// The stream its allocations are ordered on.
  [[nodiscard]] stream_view stream() const noexcept { return policy_.stream(); }
  /// The line that made it, passed to the resource as every allocation's call site.
  [[nodiscard]] const std::source_location& site() const noexcept { return policy_.site(); }

  /// Whether each can free what the other allocated: equal resources and the same stream.
  template <class U>
  friend bool operator==(const thrust_allocator& a, const thrust_allocator<U>& b) noexcept {
    return a.resource().is_equal(b.resource()) && a.stream() == b.stream();
  }

 private:
  exec_policy policy_;  // holds the resource, the stream and the call site
};

}  // namespace cudamem
