// cudamem/detail/interop/graph_temporary.hpp — where thrust's and CUB's temporaries come from
// while their stream is being captured into a CUDA graph: from the graph itself.
//
// Why. A temporary is freed as soon as its last kernel is *submitted*. Outside capture that is
// the stream-order contract of every cudamem resource: the bytes go to later work on the same
// stream at once, to other streams once the kernel is done. Under capture nothing runs: the
// free happens at capture time and the kernels run when the graph is launched, later, perhaps
// many times. A pool would take the block back at the free and could hand it to other work
// before the graph has run — the graph's kernels would then write into somebody else's memory
// (compute-sanitizer reports it as an access to a freed block). cudaMallocAsync and
// cudaFreeAsync on a capturing stream instead become allocation and free nodes of the graph:
// the memory belongs to each launch of the graph, and CUDA orders it.
#pragma once

#include <cudamem/error.hpp>
#include <cudamem/stream.hpp>

#include <cuda_runtime_api.h>

#include <cstddef>
#include <source_location>
#include <string>

namespace cudamem::detail {

/// Whether `stream` is capturing now. A query CUDA cannot answer (no device; the legacy
/// stream while another stream captures globally) counts as "not capturing": the resource is
/// asked then, and reports its own error if there is one.
[[nodiscard]] inline bool is_capturing(stream_view stream) noexcept {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(stream.get(), &status) != cudaSuccess) {
    static_cast<void>(cudaGetLastError());  // the answer was "unknown", not a failure
    return false;
  }
  return status == cudaStreamCaptureStatusActive;
}

/// `bytes` of graph memory: an allocation node of the graph `stream` is capturing into.
[[nodiscard]] inline void* allocate_graph_temporary(std::size_t bytes, stream_view stream,
                                                    const char* who) {
  void* p = nullptr;
  check(cudaMallocAsync(&p, bytes, stream.get()),
        std::string(who) + ": cudaMallocAsync under stream capture");
  return p;
}

/// The matching free node, in the same capture. `where` is the caller's line, for the report.
inline void free_graph_temporary(
    void* p, stream_view stream,
    std::source_location where = std::source_location::current()) noexcept {
  report_error(cudaFreeAsync(p, stream.get()),
               "cudaFreeAsync of a temporary under stream capture", where);
}

}  // namespace cudamem::detail
