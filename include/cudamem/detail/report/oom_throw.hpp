// cudamem/detail/report/oom_throw.hpp — what a resource needs to throw `out_of_memory`, without
// the report's types and code: the throwing functions and format_bytes, declared.
//
//   // device_resource.hpp, pinned_resource.hpp and detail/cuda/cuda_upstream.hpp include this
//   // and call, as before:
//   cudamem::throw_out_of_memory(*this, bytes, alignment, "cudaMalloc returned ...");
//
// Why. Building a report is the heaviest code a device_buffer's header brings in: the report's
// structs (vectors, optionals and strings of each resource's figures) and the functions that
// measure and format them cost a translation unit ~0.45 s under nvcc, wherever a buffer is
// declared, though they run only when memory runs out. In compiled mode (detail/compiled.hpp)
// these functions are compiled once, in the cudamem::compiled library, and device_resource.hpp,
// pinned_resource.hpp and detail/cuda/cuda_upstream.hpp include only this header (the other
// resources still include out_of_memory.hpp). Header-only, out_of_memory.hpp defines them
// (inline) and those three include it too: nothing changes.
//
// Contract: out_of_memory.hpp's (throw_out_of_memory, rethrow_out_of_memory) and figures.hpp's
// (format_bytes). In compiled mode, a file that names `out_of_memory` or reads a report (to
// catch it, say) includes <cudamem/out_of_memory.hpp> or <cudamem/memory_report.hpp>.
#pragma once

#include <cudamem/detail/compiled.hpp>

#include <cstddef>
#include <optional>
#include <string>

namespace cudamem {

class memory_resource;
struct memory_report;
enum class oom_verdict;  // figures.hpp

/// Builds the report for a failed request to `resource` and throws it (out_of_memory.hpp).
[[noreturn]] CUDAMEM_DEFINITION void throw_out_of_memory(
    const memory_resource& resource, std::size_t bytes, std::size_t alignment,
    std::string cause = {}, std::optional<oom_verdict> verdict = std::nullopt);

/// Passes on the failure of a resource below `resource` (out_of_memory.hpp).
[[noreturn]] CUDAMEM_DEFINITION void rethrow_out_of_memory(const memory_resource& resource,
                                                           std::size_t bytes,
                                                           std::size_t alignment,
                                                           const memory_report& below);

/// Bytes as a report prints them: "512 B", "1.50 MiB" (figures.hpp).
[[nodiscard]] CUDAMEM_DEFINITION std::string format_bytes(std::size_t bytes);

}  // namespace cudamem
