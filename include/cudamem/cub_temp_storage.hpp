// cudamem/cub_temp_storage.hpp — CUB's two-phase temporary-storage pattern (ask the size,
// allocate, run, free) in one call, with the storage from a cudamem resource in stream order.
//
//   #include <cudamem/cub_temp_storage.hpp>
//   #include <cub/device/device_radix_sort.cuh>
//
//   cudamem::with_temp_storage(pool, s, [&](void* temp, std::size_t& bytes) {
//     return cub::DeviceRadixSort::SortKeys(temp, bytes, keys_in, keys_out, n, 0, 32, s.get());
//   });
//   cudamem::with_temp_storage(pool, s, [&](void* temp, std::size_t& bytes) {
//     return cub::DeviceReduce::Sum(temp, bytes, in, out, n, s.get());
//   });
//
// Without it, every CUB call is written twice around a cudaMalloc and a cudaFree (which waits
// for the whole device), and an exception between the two leaks the storage.
//
// Contract
// - `call(void* temp, std::size_t& bytes)` returns a cudaError_t and is called twice: first
//   with `temp == nullptr` (CUB's size query, which sets `bytes`), then with `bytes` bytes from
//   `mr.allocate(bytes, 256, stream)`. The callable must queue its work on `stream` (pass the
//   same stream to CUB).
// - The storage is freed with `mr.deallocate(p, bytes, 256, stream)` as soon as the second call
//   returns — its kernels may still be running. That is the stream-order contract of
//   memory_resource.hpp: the resource hands the bytes to later work on `stream` at once and to
//   other streams only once those kernels are done. No device-wide synchronisation, no host
//   wait.
// - Under stream capture the storage is graph memory instead (cudaMallocAsync / cudaFreeAsync
//   on the capturing stream: allocation and free nodes the graph owns), and `mr` is not asked:
//   a resource would take the block back at capture time, before the graph has run
//   (detail/interop/graph_temporary.hpp says why).
// - A query that answers 0 bytes still gets a non-null pointer (1 byte is asked for): CUB
//   reads a null pointer as "query only", so passing one again would silently skip the work.
// - Errors: a call returning anything but cudaSuccess throws `cuda_error` naming the phase
//   (size query or run); the resource's `out_of_memory` passes through (the run is then never
//   called); an exception from the callable passes through. In every case the storage
//   allocated so far is freed first (stream-ordered, on `stream`).
// - `mr` must give device-accessible memory: `std::invalid_argument` before the first call.
// - Returns the bytes of storage the query asked for.
// - Thread-safety: as the resource's; the function holds no state.
// - Plain C++: the header needs no CUB and compiles with g++; only the callable names CUB.
#pragma once

#include <cudamem/detail/interop/device_accessible.hpp>
#include <cudamem/detail/interop/graph_temporary.hpp>
#include <cudamem/error.hpp>
#include <cudamem/memory_resource.hpp>
#include <cudamem/stream.hpp>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <concepts>
#include <cstddef>
#include <source_location>
#include <type_traits>
#include <utility>

namespace cudamem {

/// Something CUB-shaped: `call(temp, bytes)` that answers the size when `temp` is null.
template <class Call>
concept two_phase_call =
    std::invocable<Call&, void*, std::size_t&> &&
    std::same_as<std::invoke_result_t<Call&, void*, std::size_t&>, cudaError_t>;

namespace detail {

/// One block of temporary storage, freed on its stream however the scope is left.
class temp_storage_block {
 public:
  temp_storage_block(memory_resource& mr, std::size_t bytes, stream_view stream,
                     const std::source_location& where)
      : mr_(&mr), stream_(stream), bytes_(bytes), in_graph_(is_capturing(stream)),
        ptr_(in_graph_ ? allocate_graph_temporary(bytes, stream, "with_temp_storage")
                       : mr.allocate(bytes, default_alignment, stream, where)) {}
  ~temp_storage_block() {
    if (in_graph_) {
      free_graph_temporary(ptr_, stream_);
    } else {
      mr_->deallocate(ptr_, bytes_, default_alignment, stream_);
    }
  }
  temp_storage_block(const temp_storage_block&) = delete;
  temp_storage_block& operator=(const temp_storage_block&) = delete;

  [[nodiscard]] void* get() const noexcept { return ptr_; }

 private:
  memory_resource* mr_;
  stream_view stream_;
  std::size_t bytes_;
  bool in_graph_;  ///< graph memory: the stream was capturing (graph_temporary.hpp)
  void* ptr_;
};

}  // namespace detail

/// Runs a CUB-style two-phase call with its temporary storage from `mr`, stream-ordered on
/// `stream`; see the contract above. Returns the bytes the size query asked for.
template <two_phase_call Call>
std::size_t with_temp_storage(memory_resource& mr, stream_view stream, Call&& call,
                              std::source_location where = std::source_location::current()) {
  detail::require_device_accessible(mr, "with_temp_storage");
  std::size_t bytes = 0;
  check(call(static_cast<void*>(nullptr), bytes), "with_temp_storage: the size query (first call)",
        where);
  const std::size_t asked = bytes;
  // Never a null pointer for the run: CUB would take it for another size query.
  const detail::temp_storage_block storage(mr, std::max<std::size_t>(asked, 1), stream, where);
  std::size_t run_bytes = asked;  // CUB may read it; its own copy, so the free uses our size
  check(call(storage.get(), run_bytes), "with_temp_storage: the run (second call)", where);
  return asked;
}

}  // namespace cudamem
