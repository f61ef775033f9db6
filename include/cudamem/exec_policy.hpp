// cudamem/exec_policy.hpp — a thrust execution policy whose temporary storage comes from a
// cudamem resource, in stream order on one stream: no cudaMalloc, no cudaFree, no device-wide
// synchronisation inside thrust::sort, reduce, scan, copy_if...
//
//   #include <cudamem/exec_policy.hpp>
//
//   cudamem::device_resource device;
//   cudamem::pool_resource pool{device};
//   cudamem::stream s;
//   thrust::sort(cudamem::exec_policy(pool, s), keys.begin(), keys.end());    // temporaries
//   int total = thrust::reduce(cudamem::exec_policy(pool, s), v.begin(), v.end());  // from pool
//
//   // The allocator alone, under a policy of thrust's own — here `par`, which also waits
//   // for the stream after each algorithm. Give `.on()` the allocator's stream.
//   cudamem::thrust_temporary_allocator temp{pool, s};
//   thrust::sort(thrust::cuda::par(temp).on(s.get()), keys.begin(), keys.end());
//
// Why: thrust's default policies (`thrust::device`, `thrust::cuda::par`) take every temporary
// buffer with cudaMalloc and give it back with cudaFree, which waits for the whole device;
// a loop of small sorts spends most of its time there. Under `exec_policy` thrust asks the
// resource instead (thrust's `execute_with_allocator` mechanism, the one behind
// `thrust::cuda::par_nosync(alloc).on(stream)`), and a pool answers in nanoseconds.
//
// Contract
// - `exec_policy(mr, s)` is `thrust::cuda::par_nosync(thrust_temporary_allocator{mr, s}).on(s)`
//   with one difference: `.on(t)` moves the algorithms *and* the temporaries to `t` (thrust's
//   own `.on` would leave the allocator on `s` while the kernels run on `t`, a race in a
//   stream-ordered pool). It is a small value: make one per call or keep one; copies are cheap.
// - Temporaries are allocated with `mr.allocate(bytes, 256, s)` and freed with
//   `mr.deallocate(p, bytes, 256, s)` as soon as thrust has *submitted* the last kernel that
//   uses them — before that kernel has run. This is exactly the stream-order contract of
//   memory_resource.hpp: the resource gives the bytes to later work on `s` at once and to
//   other streams only once the kernel is done. A resource that is not stream-ordered in
//   that sense (one that reuses memory freed on `s` for another stream without waiting) must
//   not be used here; every cudamem resource is. (Over device_resource each free waits for
//   `s`, as its contract says: correct, and slow. Use a pool.)
// - Synchronisation: like `par_nosync`, an algorithm returns as soon as its work is queued,
//   unless its result is needed on the host (reduce's value, copy_if's end iterator), when
//   thrust waits for `s` — never for the whole device. Read results on the host only after
//   synchronising `s` (thrust's own iterators copy on thrust's default stream: with a
//   blocking `s`, the default kind of `cudamem::stream`, the legacy default stream waits for
//   it; with a non-blocking one, synchronise first).
// - Under stream capture (the stream is capturing when thrust asks for a temporary), the
//   temporary is graph memory instead: cudaMallocAsync / cudaFreeAsync on the capturing stream
//   become allocation and free nodes of the graph, which owns the memory each time it runs.
//   `mr` is not asked. Why: a resource's free returns the block at once, at capture time, and
//   the graph runs later, perhaps many times — a pool would hand the block to other work while
//   the graph still uses it (compute-sanitizer reports exactly that: the graph's kernels
//   touch a block the pool has freed; detail/interop/graph_temporary.hpp says more). A
//   temporary is allocated and freed within one thrust call, so both happen in the same
//   capture; the allocator used by hand must keep that rule. Outside capture the check is
//   one cudaStreamIsCapturing per allocation and per free.
// - The resource's kind must be device-accessible (device, managed, pinned):
//   `std::invalid_argument` otherwise, when the policy or allocator is made. A failed
//   allocation throws the resource's `out_of_memory` out of the thrust call; thrust frees the
//   temporaries it already holds while the exception unwinds (the GPU tests check it).
// - The resource must outlive every policy, allocator and algorithm call that uses it.
// - The policy remembers the line it was made on and passes it as the allocation site, so a
//   tracking_adaptor names the user's line for thrust's temporaries.
// - Plain C++ (g++) can include this header and make policies; running thrust algorithms
//   needs nvcc, as always with thrust's CUDA backend.
#pragma once

#include <cudamem/detail/interop/device_accessible.hpp>
#include <cudamem/detail/interop/graph_temporary.hpp>
#include <cudamem/memory_resource.hpp>
#include <cudamem/stream.hpp>

#include <thrust/system/cuda/execution_policy.h>

#include <cuda_runtime_api.h>

#include <cstddef>
#include <source_location>
#include <utility>

namespace cudamem {

/// The allocator thrust calls for temporary storage: bytes from `mr`, stream-ordered on one
/// stream. Meets thrust's allocator requirements for `thrust::cuda::par(alloc)` and
/// `par_nosync(alloc)`; see the contract above.
class thrust_temporary_allocator {
 public:
  using value_type = std::byte;            ///< bytes
  using size_type = std::size_t;           ///< counts of bytes
  using difference_type = std::ptrdiff_t;  ///< pointer differences

  /// Every temporary is aligned like cudaMalloc's memory (CUB relies on 256 bytes).
  static constexpr std::size_t alignment = default_alignment;

  /// From `mr` (device-accessible, else std::invalid_argument), in stream order on `stream`.
  thrust_temporary_allocator(memory_resource& mr, stream_view stream,
                             std::source_location where = std::source_location::current())
      : mr_(&detail::require_device_accessible(mr, "thrust_temporary_allocator")),
        stream_(stream),
        where_(where) {}

  /// `bytes` bytes of temporary storage (nullptr for 0), usable by work on the stream; graph
  /// memory while the stream is capturing.
  [[nodiscard]] std::byte* allocate(std::size_t bytes) {
    if (bytes != 0 && detail::is_capturing(stream_)) {
      return static_cast<std::byte*>(
          detail::allocate_graph_temporary(bytes, stream_, "thrust_temporary_allocator"));
    }
    return static_cast<std::byte*>(mr_->allocate(bytes, alignment, stream_, where_));
  }
  /// Gives back what `allocate(bytes)` returned; its last use was submitted to the stream.
  void deallocate(std::byte* p, std::size_t bytes) noexcept {
    if (p != nullptr && detail::is_capturing(stream_)) {
      detail::free_graph_temporary(p, stream_, where_);
      return;
    }
    mr_->deallocate(p, bytes, alignment, stream_);
  }

  /// The resource it allocates from.
  [[nodiscard]] memory_resource& resource() const noexcept { return *mr_; }
  /// The stream its temporaries are ordered on.
  [[nodiscard]] stream_view stream() const noexcept { return stream_; }
  /// The line that made it: every temporary's call site for the resource.
  [[nodiscard]] const std::source_location& site() const noexcept { return where_; }

  /// Equal allocators can free each other's memory in the same stream order.
  friend bool operator==(const thrust_temporary_allocator& a,
                         const thrust_temporary_allocator& b) noexcept {
    return a.mr_->is_equal(*b.mr_) && a.stream_ == b.stream_;
  }

 private:
  memory_resource* mr_;
  stream_view stream_;
  std::source_location where_;
};

namespace detail {

/// thrust's type for `thrust::cuda::par_nosync(allocator).on(stream)`: named through the
/// public call, not thrust's internal class names.
using thrust_nosync_policy =
    decltype(thrust::cuda::par_nosync(std::declval<const thrust_temporary_allocator&>()));

}  // namespace detail

/// A thrust execution policy on `stream` whose temporaries come from `mr`; see the contract.
class exec_policy : public detail::thrust_nosync_policy {
 public:
  /// Algorithms on `stream`, temporaries from `mr` (device-accessible, else std::invalid_argument).
  exec_policy(memory_resource& mr, stream_view stream,
              std::source_location where = std::source_location::current())
      : detail::thrust_nosync_policy(
            thrust::cuda::par_nosync(thrust_temporary_allocator{mr, stream, where})
                .on(stream.get())),
        mr_(&mr),
        stream_(stream),
        where_(where) {}

  /// The same resource, with the algorithms and their temporaries on `stream`.
  [[nodiscard]] exec_policy on(stream_view stream) const {
    return exec_policy(*mr_, stream, where_);
  }

  /// The resource temporaries come from.
  [[nodiscard]] memory_resource& resource() const noexcept { return *mr_; }
  /// The stream the algorithms and their temporaries run on.
  [[nodiscard]] stream_view stream() const noexcept { return stream_; }
  /// The line that made it: every temporary's call site for the resource.
  [[nodiscard]] const std::source_location& site() const noexcept { return where_; }

 private:
  memory_resource* mr_;
  stream_view stream_;
  std::source_location where_;
};

}  // namespace cudamem
