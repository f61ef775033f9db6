// cudamem/detail/cuda/cuda_upstream.hpp — what the resources that call CUDA directly
// (device_resource, async_resource, pinned_resource, managed_resource) have in common:
// resolving their device, counting bytes, asking the process's memory held ahead to give way
// before a device allocation fails (detail/held_ahead.hpp), turning a failed CUDA allocation
// into `out_of_memory`, and switching device inside noexcept frees (quiet_device_scope.hpp).
#pragma once

#include <cudamem/detail/cuda/quiet_device_scope.hpp>
#include <cudamem/detail/held_ahead.hpp>
#include <cudamem/detail/usage_counter.hpp>
#include <cudamem/device.hpp>
#include <cudamem/error.hpp>
#include <cudamem/memory_resource.hpp>
#include <cudamem/detail/compiled.hpp>
#include <cudamem/detail/report/oom_throw.hpp>
#if CUDAMEM_DEFINITIONS_IN_HEADERS  // in compiled mode the report is the library's
#include <cudamem/out_of_memory.hpp>
#endif
#include <cudamem/stream.hpp>

#include <cuda_runtime_api.h>

#include <cstddef>
#include <stdexcept>
#include <string>
#include <string_view>

namespace cudamem::detail {

/// -1 means "the current device"; anything else is validated (no_device_error with no GPU,
/// std::out_of_range for an id that does not exist).
[[nodiscard]] inline int resolve_device(int requested) {
  const int device = requested < 0 ? current_device() : requested;
  validate_device(device);
  return device;
}

/// CUDA's allocators promise 256-byte alignment and no more; a larger request is refused
/// rather than silently under-aligned. (Pools and arenas on top can give more.)
inline void check_cuda_alignment(std::string_view resource, std::size_t alignment) {
  if (alignment > default_alignment) {
    throw std::invalid_argument("cudamem: " + std::string(resource) + " supports alignments up to " +
                                std::to_string(default_alignment) + " bytes (what CUDA's allocators "
                                "guarantee); " + std::to_string(alignment) + " was asked");
  }
}

/// After a CUDA allocation call: success returns; cudaErrorMemoryAllocation throws
/// out_of_memory whose cause names the call (and what the process's vm_resources gave back
/// before it was tried again: `given_back`); anything else throws cuda_error (no_device_error
/// for "no device").
inline void throw_if_allocation_failed(cudaError_t code, const memory_resource& resource,
                                       std::size_t bytes, std::size_t alignment,
                                       std::string_view call, std::size_t given_back = 0) {
  if (code == cudaSuccess) [[likely]] {
    return;
  }
  if (code == cudaErrorMemoryAllocation) {
    static_cast<void>(cudaGetLastError());  // not sticky: later calls must not see it again
    std::string cause = std::string(call) + " returned cudaErrorMemoryAllocation (" +
                        cudaGetErrorString(code) + ")";
    if (given_back != 0) {
      cause += ", tried again after vm_resources gave back " + format_bytes(given_back) +
               " held ahead of need";
    }
    throw_out_of_memory(resource, bytes, alignment, std::move(cause));
  }
  check(code, call);
}

/// Device memory from CUDA (`call()`: cudaMalloc and the like, returning its cudaError_t) on
/// `device`. If it fails for lack of memory, the process's vm_resources on that device give
/// back what they hold ahead of need (detail/held_ahead.hpp) and, if they held any, it is
/// called once more. Returns the last call's code; `given_back` the bytes given back.
template <class Call>
[[nodiscard]] cudaError_t allocate_giving_way(int device, std::size_t& given_back, Call&& call) {
  const cudaError_t code = call();
  if (code != cudaErrorMemoryAllocation) [[likely]] {
    return code;
  }
  static_cast<void>(cudaGetLastError());
  given_back = give_back_held_ahead(memory_domain{device, nullptr});
  return given_back != 0 ? call() : code;
}

/// Waits for the work submitted to `stream` so far; reports (does not throw) a failure. Used
/// before the synchronous frees (cudaFree, cudaFreeHost) when the caller gave a stream: the
/// memory's last use is on that stream and must be finished before the memory goes back.
inline void wait_for_stream_before_free(stream_view stream, std::string_view who) noexcept {
  const cudaError_t code = cudaStreamSynchronize(stream.get());
  if (code != cudaSuccess) {
    report_error(code, who);
  }
}

}  // namespace cudamem::detail
