// cudamem/detail/nvtx.hpp — telling compute-sanitizer (and other NVIDIA tools) which parts of
// a sub-allocator's memory are live blocks, through the NVTX memory API (header-only: nothing
// to link; NVTX finds the tool at run time).
//
//   const bool annotates = annotates_sub_allocations(device_memory, upstream.allows_nvtx_heaps());
//   void* heap = memory_annotations::add_heap(device, chunk, bytes, "my pool chunk");  // new chunk
//   if (annotates) memory_annotations::add_region(device, heap, p, n);  // a block handed out
//   if (annotates) memory_annotations::remove_region(device, p);        // freed, before any reuse
//   memory_annotations::remove_heap(device, heap);                      // the chunk goes back
//
// Why. A pool hands out pieces of one large cudaMalloc. To compute-sanitizer that is one
// allocation: a kernel writing one element past a pooled block into its neighbour, or reading
// a block after it went back to the pool, is reported by nobody. Registering each chunk as an
// NVTX *heap* of the sub-allocator kind tells the tool that only its registered *regions* are
// usable; registering each block as a region when it is handed out, and unregistering it when
// it is freed, makes memcheck report exactly what it reports for cudaMalloc'd memory:
// out-of-bounds accesses past a block's requested size, and use after free. (Initcheck sees a
// never-written block read as uninitialised either way.)
//
// Which memory. compute-sanitizer accepts a heap only inside a plain device allocation
// (cudaMalloc): it refuses one inside another heap's region (an arena over a pool) or inside
// VMM-mapped memory (vm_pool_resource), and counts each refusal as an error. So a resource
// annotates only when its upstream says it may (memory_resource::allows_nvtx_heaps: true for
// device_resource, and for adaptors over it); an arena over a pool is then checked at the
// pool's granularity (its chunk is one live block).
//
// Virtual memory, probed form by form (compute-sanitizer 2025.3.1, CUDA 13.0, an H100; a 64
// MiB handle mapped with cuMemMap and given access with cuMemSetAccess, the probe's kernel
// writing past a 4000-byte region): every one of these NVTX calls was refused ("Call to
// nvtxMemHeapRegister failed: One or more of the parameters is invalid", an error each):
//   - a heap over one mapped handle, registered after cuMemSetAccess;
//   - the same registered between cuMemMap and cuMemSetAccess;
//   - a heap over two handles mapped by two cuMemMap calls side by side;
//   - a heap over the whole reservation, part of it unmapped;
//   - one heap per handle, and a region across the two;
//   - regions registered straight into the process-wide heap (NVTX_MEM_HEAP_HANDLE_PROCESS_WIDE).
// With no annotation, memcheck sees each cuMemMap'd range as one allocation: a write past a
// block into the rest of the mapping is not reported, and one past the mapping into reserved,
// unmapped addresses is ("Invalid __global__ write ... 1 bytes after the nearest allocation
// ... of size 67,108,864 bytes"; the kernel then faults). So no annotation of virtual memory
// can make its blocks visible: vm_pool_resource, when compute-sanitizer is attached
// (compute_sanitizer_attached below), takes its memory from cudaMalloc instead, annotated as
// pool_resource's, so its blocks are checked like everyone else's (vm_pool_resource.hpp).
//
// Which device. On two H200s, compute-sanitizer refused ("One or more of the parameters is
// invalid", counted as an error) the heap and region calls about device 1's memory made while
// device 0 was current (a chunk of device 1's pool registered, or its block freed, by a thread
// with device 0 current), and accepted the same calls made with device 1 current. Then the
// heap is not there, and the tool sees the chunk as one allocation. So every call here takes
// the memory's device and makes it current around the NVTX call (quiet_device_scope: one
// cudaGetDevice when it already is), on the annotated paths only (device memory of a known
// device: annotates_sub_allocations).
//
// Peer access. Also seen on two H200s (CUDA 13.0): once peer access is enabled between the
// devices, the tool no longer knows the regions registered before it (their unregister is
// refused, on either device), and initcheck fails inside itself ("Internal Sanitizer Error")
// when annotated memory is copied between the GPUs (the same copy of plain cudaMalloc'd
// buffers runs clean: planted_bugs probe-peer-*-raw). Nothing here can mend the first: enable
// peer access before the pools allocate (examples/multi_gpu.cu does); tests/gpu/sanitize.sh
// runs such copies under memcheck, racecheck and synccheck, not initcheck.
//
// Cost. NVTX's functions return at once with no tool attached, but the hot paths do not even
// call them: a tool attaches through the environment variable NVTX_INJECTION64_PATH (that is
// how compute-sanitizer and Nsight do it), which a resource reads once, when it is built, into
// a constant flag; with no tool the hot path pays one predictable branch on it.
// bench/nvtx_cost.sh measures it (docs/debugging.md).
//
// The switch. Define CUDAMEM_NVTX=0 (before any cudamem header, or -DCUDAMEM_NVTX=0) and no
// NVTX header is included, every function here is an empty inline, and `nvtx_compiled` is
// false, so the resources' checks compile away. It is 1 (on) by default.
//
// Contract: thread-safe as NVTX is. NVTX is first called (the domain created) at the first
// heap, after the first upstream allocation has initialised the CUDA runtime, which
// compute-sanitizer requires. A heap is registered once and removed once; a region is removed
// only after it was added, with the pointer it was added with.
#pragma once

#ifndef CUDAMEM_NVTX
#define CUDAMEM_NVTX 1
#endif

#if CUDAMEM_NVTX
#include <nvtx3/nvToolsExt.h>
#include <nvtx3/nvToolsExtMem.h>
#endif

#include <cudamem/detail/cuda/quiet_device_scope.hpp>

#include <cstdlib>
#include <string_view>
#include <cstddef>
#include <cstdint>

namespace cudamem::detail {

/// Whether NVTX annotations are compiled in (CUDAMEM_NVTX).
inline constexpr bool nvtx_compiled = CUDAMEM_NVTX != 0;

#if CUDAMEM_NVTX

/// Whether an NVTX tool is attached: NVTX loads the one NVTX_INJECTION64_PATH names. Read
/// once; calls no NVTX function (safe before the CUDA runtime is initialised).
[[nodiscard]] inline bool nvtx_tool_attached() noexcept {
  static const bool attached = std::getenv("NVTX_INJECTION64_PATH") != nullptr;
  return attached;
}

/// Whether the tool attached is compute-sanitizer: it injects libsanitizer-collection.so through
/// NVTX_INJECTION64_PATH (seen with 2025.3.1), where Nsight Systems and Nsight Compute inject
/// their own libraries. CUDAMEM_VM_UNDER_SANITIZER=vmm answers false, for a run that must keep
/// vm_pool_resource on virtual memory under the tool. Read once.
[[nodiscard]] inline bool compute_sanitizer_attached() noexcept {
  static const bool attached = [] {
    const char* injection = std::getenv("NVTX_INJECTION64_PATH");
    const char* keep_vmm = std::getenv("CUDAMEM_VM_UNDER_SANITIZER");
    const bool opted_out = keep_vmm != nullptr && std::string_view(keep_vmm) == "vmm";
    return injection != nullptr && std::string_view(injection).find("sanitizer") !=
                                       std::string_view::npos && !opted_out;
  }();
  return attached;
}

/// cudamem's NVTX domain, created on first use (nullptr, NVTX's default domain, when the tool
/// creates none: compute-sanitizer does not). Call it only once the CUDA runtime is
/// initialised (compute-sanitizer's requirement).
[[nodiscard]] inline nvtxDomainHandle_t nvtx_domain() noexcept {
  static const nvtxDomainHandle_t domain = nvtxDomainCreateA("cudamem");
  return domain;
}

/// The calls a sub-allocator makes; out of line, so the hot paths that call them (behind their
/// flag) stay small. `device`: the memory's device, current during the call.
struct memory_annotations {
  /// Registers [base, base + bytes) as a sub-allocator's heap: nothing in it is usable until a
  /// region is added. Returns the heap's handle (for virtual addresses, NVTX's contract makes
  /// it the base address; a tool may also return it).
  [[gnu::noinline]] static void* add_heap(int device, void* base, std::size_t bytes,
                                          const char* what) noexcept {
    const quiet_device_scope on{device, annotation_scope_name};
    nvtxMemVirtualRangeDesc_t range{};
    range.ptr = base;
    range.size = bytes;
    nvtxMemHeapDesc_t desc{};
    desc.extCompatID = NVTX_EXT_COMPATID_MEM;
    desc.structSize = sizeof(desc);
    desc.usage = NVTX_MEM_HEAP_USAGE_TYPE_SUB_ALLOCATOR;
    desc.type = NVTX_MEM_TYPE_VIRTUAL_ADDRESS;
    desc.typeSpecificDescSize = sizeof(range);
    desc.typeSpecificDesc = &range;
    desc.messageType = NVTX_MESSAGE_TYPE_ASCII;
    desc.message.ascii = what;
    const nvtxMemHeapHandle_t heap = nvtxMemHeapRegister(nvtx_domain(), &desc);
    // (NVTX_MEM_HEAP_HANDLE_NO_TOOL, -1, is spelled out: its macro is a static_cast from an
    // integer to a pointer, which C++ rejects.)
    const bool returned = heap != nullptr &&
                          heap != reinterpret_cast<nvtxMemHeapHandle_t>(std::intptr_t{-1});
    return returned ? static_cast<void*>(heap) : base;
  }

  /// Unregisters a heap (and every region still in it). `heap` may be nullptr: nothing.
  [[gnu::noinline]] static void remove_heap(int device, void* heap) noexcept {
    if (heap != nullptr) {
      const quiet_device_scope on{device, annotation_scope_name};
      nvtxMemHeapUnregister(nvtx_domain(), static_cast<nvtxMemHeapHandle_t>(heap));
    }
  }

  /// [p, p + bytes), inside `heap`, is a live block.
  [[gnu::noinline]] static void add_region(int device, void* heap, const void* p,
                                           std::size_t bytes) noexcept {
    if (heap == nullptr || bytes == 0) {
      return;
    }
    const quiet_device_scope on{device, annotation_scope_name};
    nvtxMemVirtualRangeDesc_t range{};
    range.ptr = p;
    range.size = bytes;
    nvtxMemRegionsRegisterBatch_t batch{};
    batch.extCompatID = NVTX_EXT_COMPATID_MEM;
    batch.structSize = sizeof(batch);
    batch.regionType = NVTX_MEM_TYPE_VIRTUAL_ADDRESS;
    batch.heap = static_cast<nvtxMemHeapHandle_t>(heap);
    batch.regionCount = 1;
    batch.regionDescElementSize = sizeof(range);
    batch.regionDescElements = &range;
    nvtxMemRegionsRegister(nvtx_domain(), &batch);
  }

  /// The block at `p` (added with add_region) is free.
  [[gnu::noinline]] static void remove_region(int device, const void* p) noexcept {
    const quiet_device_scope on{device, annotation_scope_name};
    nvtxMemRegionRef_t ref{};
    ref.pointer = p;
    nvtxMemRegionsUnregisterBatch_t batch{};
    batch.extCompatID = NVTX_EXT_COMPATID_MEM;
    batch.structSize = sizeof(batch);
    batch.refType = NVTX_MEM_REGION_REF_TYPE_POINTER;
    batch.refCount = 1;
    batch.refElementSize = sizeof(ref);
    batch.refElements = &ref;
    nvtxMemRegionsUnregister(nvtx_domain(), &batch);
  }

 private:
  static constexpr const char* annotation_scope_name =
      "cudamem: making a pool's device current for an NVTX annotation";
};

#else  // CUDAMEM_NVTX == 0: no NVTX at all

[[nodiscard]] constexpr bool nvtx_tool_attached() noexcept { return false; }
[[nodiscard]] constexpr bool compute_sanitizer_attached() noexcept { return false; }

struct memory_annotations {
  static void* add_heap(int, void*, std::size_t, const char*) noexcept { return nullptr; }
  static void remove_heap(int, void*) noexcept {}
  static void add_region(int, void*, const void*, std::size_t) noexcept {}
  static void remove_region(int, const void*) noexcept {}
};

#endif

/// Whether a sub-allocator of `kind` memory on `device` over an upstream that `allows` heaps
/// annotates its blocks: compiled in, device memory, the upstream allows it, a tool attached.
[[nodiscard]] inline bool annotates_sub_allocations(bool device_memory, bool allows) noexcept {
  return nvtx_compiled && device_memory && allows && nvtx_tool_attached();
}

}  // namespace cudamem::detail
