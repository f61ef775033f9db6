// cudamem/detail/nvtx.hpp — telling compute-sanitizer (and other NVIDIA tools) which parts of
// a sub-allocator's memory are live blocks, through the NVTX memory API (header-only: nothing
// to link; NVTX finds the tool at run time).
//
//   memory_annotations notes;                       // one per sub-allocating resource
//   void* heap = notes.add_heap(chunk, bytes);      // after the chunk came from the upstream
//   if (notes.active()) notes.add_region(heap, p, n);   // a block handed out
//   if (notes.active()) notes.remove_region(p);         // ... and freed, before it can be reused
//   notes.remove_heap(heap);                        // the chunk goes back upstream
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
// Cost. With no tool attached NVTX's functions return at once, but the pools' hot paths do not
// even call them: whether a tool is there is decided once, at the first heap (NVTX's domain is
// created then, after the first upstream allocation has initialised the CUDA runtime, which
// compute-sanitizer requires), and kept in a flag that the fast paths test: one load and a
// branch that is never taken. bench_pool measures it (README: "Debugging with
// compute-sanitizer").
//
// The switch. Define CUDAMEM_NVTX=0 (before any cudamem header, or -DCUDAMEM_NVTX=0) and
// no NVTX header is included and every function here is an empty inline: the pools compile to
// what they were without annotations. It is 1 (on) by default.
//
// Contract: the functions are thread-safe as NVTX is. `add_heap` returns nullptr when no tool
// is attached (then `active()` is false for good: a tool cannot attach later). A heap is
// registered once and removed once; a region is removed only after it was added, with the
// pointer it was added with.
#pragma once

#ifndef CUDAMEM_NVTX
#define CUDAMEM_NVTX 1
#endif

#if CUDAMEM_NVTX
#include <nvtx3/nvToolsExt.h>
#include <nvtx3/nvToolsExtMem.h>
#endif

#include <atomic>
#include <cstddef>
#include <cstdint>

namespace cudamem::detail {

#if CUDAMEM_NVTX

/// cudamem's NVTX domain, created on first use; nullptr when no tool is attached. Call it only
/// once the CUDA runtime is initialised (compute-sanitizer's requirement).
[[nodiscard]] inline nvtxDomainHandle_t nvtx_domain() noexcept {
  static const nvtxDomainHandle_t domain = nvtxDomainCreateA("cudamem");
  return domain;
}

class memory_annotations {
 public:
  /// Whether a tool is attached and heaps are registered: the hot paths' only test.
  [[nodiscard]] bool active() const noexcept { return active_.load(std::memory_order_relaxed); }

  /// Registers [base, base + bytes) as a sub-allocator's heap: nothing in it is usable until a
  /// region is added. Returns the heap's handle, or nullptr with no tool attached.
  void* add_heap(void* base, std::size_t bytes, const char* what) noexcept {
    const nvtxDomainHandle_t domain = nvtx_domain();
    if (domain == nullptr) {
      return nullptr;
    }
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
    const nvtxMemHeapHandle_t heap = nvtxMemHeapRegister(domain, &desc);
    // (NVTX_MEM_HEAP_HANDLE_NO_TOOL, -1, is spelled out: its macro is a static_cast from an
    // integer to a pointer, which C++ rejects.)
    if (heap != nullptr && heap != reinterpret_cast<nvtxMemHeapHandle_t>(std::intptr_t{-1})) {
      active_.store(true, std::memory_order_relaxed);
      return heap;
    }
    return nullptr;
  }

  /// Unregisters a heap (and every region still in it). `heap` may be nullptr: nothing.
  void remove_heap(void* heap) const noexcept {
    if (heap != nullptr) {
      nvtxMemHeapUnregister(nvtx_domain(), static_cast<nvtxMemHeapHandle_t>(heap));
    }
  }

  /// Forgets every region of a heap (an arena's rewind to the start of a chunk).
  void reset_heap(void* heap) const noexcept {
    if (heap != nullptr) {
      nvtxMemHeapReset(nvtx_domain(), static_cast<nvtxMemHeapHandle_t>(heap));
    }
  }

  /// [p, p + bytes), inside `heap`, is a live block.
  void add_region(void* heap, const void* p, std::size_t bytes) const noexcept {
    if (heap == nullptr || bytes == 0) {
      return;
    }
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
  void remove_region(const void* p) const noexcept {
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
  std::atomic<bool> active_{false};
};

#else  // CUDAMEM_NVTX == 0: no NVTX at all

class memory_annotations {
 public:
  [[nodiscard]] static constexpr bool active() noexcept { return false; }
  static void* add_heap(void*, std::size_t, const char*) noexcept { return nullptr; }
  static void remove_heap(void*) noexcept {}
  static void reset_heap(void*) noexcept {}
  static void add_region(void*, const void*, std::size_t) noexcept {}
  static void remove_region(const void*) noexcept {}
};

#endif

}  // namespace cudamem::detail
