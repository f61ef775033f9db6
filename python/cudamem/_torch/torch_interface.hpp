// cudamem/_torch/torch_interface.hpp — which PyTorch the allocator is compiled against, and the
// few names and calls whose form differs between PyTorch 2.7 and 2.15: one place for every
// version guard that is not a method's own signature (those are in allocator_class.hpp).
//
//   #if CUDAMEM_TORCH_AT_LEAST(2, 12)     // PyTorch 2.12 or newer
//   hist::TraceEntry te = make_trace_entry(action, device, ...);   // any release's form
//
// Owns: PyTorch's headers (the ones each release has), CUDAMEM_TORCH_AT_LEAST, the namespace
// `hist` (history and snapshot types: c10::CachingDeviceAllocator from 2.11, the CUDA allocator's
// own namespace before), the allocator settings read from PYTORCH_CUDA_ALLOC_CONF in each
// release's form, and small helpers every part uses (sizes as text, a cudamem status as
// PyTorch's exception).
//
// The version comes from PyTorch's own header (TORCH_VERSION_MAJOR/MINOR, in
// torch/csrc/api/include/torch/version.h in every release). A release newer than the newest
// one checked takes the newest path of every guard.
#pragma once

#include <torch/csrc/api/include/torch/version.h>

#include <c10/core/Allocator.h>
#include <c10/core/impl/GPUTrace.h>
#include <c10/cuda/CUDAAllocatorConfig.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/ApproximateClock.h>
#include <c10/util/Exception.h>
#include <torch/csrc/cuda/CUDAPluggableAllocator.h>

#define CUDAMEM_TORCH_AT_LEAST(major, minor)                 \
  (TORCH_VERSION_MAJOR > (major) ||                          \
   (TORCH_VERSION_MAJOR == (major) && TORCH_VERSION_MINOR >= (minor)))

#if !CUDAMEM_TORCH_AT_LEAST(2, 7)
#error "cudamem's PyTorch allocator supports PyTorch 2.7 and newer"
#endif
#if CUDAMEM_TORCH_AT_LEAST(2, 9)
#include <c10/core/AllocatorConfig.h>  // AcceleratorAllocatorConfig (2.9 and later)
#endif

#include <cuda_runtime_api.h>
#include <cudamem_c.h>

#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace {

namespace cca = c10::cuda::CUDACachingAllocator;
namespace cda = c10::CachingDeviceAllocator;  // DeviceStats in every release
#if CUDAMEM_TORCH_AT_LEAST(2, 11)
namespace hist = c10::CachingDeviceAllocator;  // TraceEntry, SegmentInfo, ... moved here in 2.11
#else
namespace hist = c10::cuda::CUDACachingAllocator;
#endif
using c10::DeviceIndex;
#if CUDAMEM_TORCH_AT_LEAST(2, 9)
using c10::MempoolId_t;
#else
using c10::cuda::MempoolId_t;  // moved to c10 in 2.9
#endif

constexpr MempoolId_t default_pool{0, 0};
constexpr int process_allocator = 0;  // libcudamem_c's allocator 0

// --- PYTORCH_CUDA_ALLOC_CONF, as each release reads it -------------------------------------------

/// roundup_power2_divisions for a request of `size` bytes (0: none): CUDAAllocatorConfig's own
/// up to 2.9, the device-generic AcceleratorAllocatorConfig's from 2.10 (the CUDA one is
/// deprecated there and forwards to it).
inline std::size_t roundup_divisions(std::size_t size) {
#if CUDAMEM_TORCH_AT_LEAST(2, 10)
  return c10::CachingAllocator::AcceleratorAllocatorConfig::roundup_power2_divisions(size);
#else
  return cca::CUDAAllocatorConfig::roundup_power2_divisions(size);
#endif
}

/// The whole roundup_power2_divisions table (for snapshots' allocator settings).
inline std::vector<std::size_t> roundup_divisions_table() {
#if CUDAMEM_TORCH_AT_LEAST(2, 10)
  return c10::CachingAllocator::AcceleratorAllocatorConfig::roundup_power2_divisions();
#else
  return cca::CUDAAllocatorConfig::roundup_power2_divisions();
#endif
}

/// graph_capture_record_stream_reuse (2.9 and later; false before).
inline bool capture_reuse_setting() {
#if CUDAMEM_TORCH_AT_LEAST(2, 9)
  return cca::CUDAAllocatorConfig::graph_capture_record_stream_reuse();
#else
  return false;
#endif
}

/// per_process_memory_fraction from the environment (2.10 and later; 1 before, where only
/// torch.cuda.set_per_process_memory_fraction sets one).
inline double configured_memory_fraction() {
#if CUDAMEM_TORCH_AT_LEAST(2, 10)
  return cca::CUDAAllocatorConfig::per_process_memory_fraction();
#else
  return 1.0;
#endif
}

// --- history entries ----------------------------------------------------------------------------

/// A trace entry in the release's form: the pool (2.8+), the compile context (2.8+) and the
/// user's metadata (2.10+) are kept where the release has them.
inline hist::TraceEntry make_trace_entry(hist::TraceEntry::Action action, DeviceIndex device,
                                         std::uintptr_t addr, std::size_t size,
                                         cudaStream_t stream, MempoolId_t pool,
                                         std::shared_ptr<c10::GatheredContext> context,
                                         const std::string& compile_context,
                                         const std::string& user_metadata) {
#if CUDAMEM_TORCH_AT_LEAST(2, 10)
  return {action, device, addr, size, stream, pool, c10::getApproximateTime(),
          std::move(context), compile_context, user_metadata};
#elif CUDAMEM_TORCH_AT_LEAST(2, 8)
  static_cast<void>(user_metadata);
  return {action, device, addr, size, stream, pool, c10::getApproximateTime(),
          std::move(context), compile_context};
#else
  static_cast<void>(pool);
  static_cast<void>(compile_context);
  static_cast<void>(user_metadata);
  return {action, device, addr, size, stream, c10::getApproximateTime(), std::move(context)};
#endif
}

// --- small helpers ------------------------------------------------------------------------

inline std::string last_error() { return cudamem_last_error(); }

/// A cudamem status that is not OK as PyTorch's exception (out of memory is handled apart).
inline void check_status(cudamem_status s, const char* what) {
  TORCH_CHECK(s == CUDAMEM_OK, "cudamem: ", what, ": ", last_error());
}

/// Bytes as PyTorch prints them ("1.50 GiB"), without iostreams: a compiler that links its own
/// libstdc++ statically crashed formatting a double through a stream in PyTorch's process.
inline std::string size_text(std::uint64_t bytes) {
  char text[64];
  if (bytes <= 1024) {
    std::snprintf(text, sizeof(text), "%llu bytes", static_cast<unsigned long long>(bytes));
  } else if (bytes <= (std::uint64_t{1} << 20)) {
    std::snprintf(text, sizeof(text), "%.2f KiB", static_cast<double>(bytes) / 1024.0);
  } else if (bytes <= (std::uint64_t{1} << 30)) {
    std::snprintf(text, sizeof(text), "%.2f MiB", static_cast<double>(bytes) / 1048576.0);
  } else {
    std::snprintf(text, sizeof(text), "%.2f GiB", static_cast<double>(bytes) / 1073741824.0);
  }
  return text;
}

inline std::string fraction_text(double f) {
  char text[32];
  std::snprintf(text, sizeof(text), "%g", f);
  return text;
}

inline std::string pool_name(MempoolId_t id) {
  return "(" + std::to_string(id.first) + ", " + std::to_string(id.second) + ")";
}

/// A pointer to an allocator someone else keeps alive (a MemPool's, before 2.11 PyTorch passed
/// it as a raw pointer): shared_ptr's form with no owner.
inline std::shared_ptr<cca::CUDAAllocator> not_owned(cca::CUDAAllocator* allocator) {
  return allocator != nullptr
             ? std::shared_ptr<cca::CUDAAllocator>(std::shared_ptr<void>{}, allocator)
             : nullptr;
}

}  // namespace
