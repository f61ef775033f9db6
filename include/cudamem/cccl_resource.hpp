// cudamem/cccl_resource.hpp — cudamem resources where CCCL takes a memory resource:
// `cuda::mr::resource_ref<Properties...>` and `cuda::mr::async_resource_ref<Properties...>`.
//
//   // CCCL 3.0 (CUDA 13.0) keeps cuda::mr behind a macro: define it in this translation unit,
//   // before its first #include (or -D on this source file only), then include this header.
//   #define LIBCUDACXX_ENABLE_EXPERIMENTAL_MEMORY_RESOURCE
//   #include <cudamem/cccl_resource.hpp>
//
//   void library_call(cuda::mr::async_resource_ref<cuda::mr::device_accessible> mr);
//
//   cudamem::device_resource device;
//   library_call(device);                     // leaf resources carry their properties
//   cudamem::pool_resource pool{device};      // a pool's kind is its upstream's, known only
//   cudamem::cccl_resource<cuda::mr::device_accessible> pool_ref{pool};  // at run time: say it
//   library_call(pool_ref);                   // (checked when pool_ref is made)
//
// The macro
// - CCCL 3.0 declares `cuda::mr` (concepts, properties, resource_ref) only when
//   LIBCUDACXX_ENABLE_EXPERIMENTAL_MEMORY_RESOURCE is defined before <cuda/memory_resource> is
//   first included. cudamem never defines it and no cudamem header needs it: without it this
//   header declares nothing (so cudamem.hpp, which includes it, compiles anywhere). Define it
//   only in the translation units that pass cudamem resources to CCCL, before any #include
//   (CCCL's headers have include guards: once included without it, they stay without it).
// - For that reason this header has a guard of its own that opens only with the macro, not
//   `#pragma once`: included first without the macro (e.g. through cudamem.hpp) and again
//   after it is defined, the second inclusion declares everything.
// - CCCL 3.1 and later renamed the resource calls (`allocate(stream, bytes, align)`,
//   `allocate_sync`); this header is for the toolkit in use, CUDA 13.0's CCCL 3.0.
//
// Contract
// - Every cudamem resource satisfies `cuda::mr::resource` and `cuda::mr::async_resource`
//   (memory_resource.hpp has the names CCCL looks for; tests/gpu/test_cccl_concepts.cu checks).
// - Properties of the leaf resources, whose kind is fixed by their type:
//   device_resource, async_resource: device_accessible; pinned_resource, managed_resource:
//   host_accessible and device_accessible; host_resource: host_accessible. So they convert to
//   `resource_ref` / `async_resource_ref` with those properties (or fewer) directly.
// - Pools, arenas and adaptors take their kind from their upstream at run time, so their type
//   cannot promise a property. `cccl_resource<Properties...>{mr}` is a non-owning handle to
//   any cudamem resource that carries the given (stateless) properties; its constructor
//   checks `mr.kind()` against device_accessible and host_accessible and throws
//   `std::invalid_argument` (naming the resource and its kind) when the memory is not
//   accessible where a property says. A `resource_ref` made from it refers to the handle:
//   keep the handle alive as long as the ref, and the resource longer than both.
// - Calls go straight to the resource: `allocate(bytes, align)` is the synchronous form,
//   `allocate_async(bytes, align, stream)` the stream-ordered one (memory_resource.hpp's
//   contract, errors included). Equality is the resources' `is_equal`.
// - Owning wrappers: CUDA 13.0's CCCL has none (`any_resource` lives in CUDA Experimental,
//   cudax, which the toolkit does not ship); `resource_ref` and `async_resource_ref` are all
//   it takes.
// - Plain C++ (g++) and nvcc alike.
#if defined(LIBCUDACXX_ENABLE_EXPERIMENTAL_MEMORY_RESOURCE) && !defined(CUDAMEM_CCCL_RESOURCE_HPP)
#define CUDAMEM_CCCL_RESOURCE_HPP

#include <cudamem/async_resource.hpp>
#include <cudamem/device_resource.hpp>
#include <cudamem/host_resource.hpp>
#include <cudamem/managed_resource.hpp>
#include <cudamem/memory_resource.hpp>
#include <cudamem/pinned_resource.hpp>
#include <cudamem/stream.hpp>

#include <cuda/memory_resource>
#include <cuda/stream_ref>

#include <concepts>
#include <cstddef>
#include <stdexcept>
#include <string>

namespace cudamem {

// --- the leaf resources' properties (found by argument-dependent lookup) -----------------------

///@{
/// What each leaf resource's memory is, for CCCL's property checks: device_resource and
/// async_resource device_accessible; pinned_resource and managed_resource both; host_resource
/// host_accessible.
inline void get_property(const device_resource&, cuda::mr::device_accessible) noexcept {}
inline void get_property(const async_resource&, cuda::mr::device_accessible) noexcept {}
inline void get_property(const pinned_resource&, cuda::mr::device_accessible) noexcept {}
inline void get_property(const pinned_resource&, cuda::mr::host_accessible) noexcept {}
inline void get_property(const managed_resource&, cuda::mr::device_accessible) noexcept {}
inline void get_property(const managed_resource&, cuda::mr::host_accessible) noexcept {}
inline void get_property(const host_resource&, cuda::mr::host_accessible) noexcept {}
///@}

// --- any resource, with the properties its user vouches for ------------------------------------

/// A non-owning handle to a cudamem resource that CCCL sees with `Properties`; see the contract.
template <class... Properties>
class cccl_resource {
 public:
  /// Refers to `mr`; std::invalid_argument when its kind contradicts a property.
  explicit cccl_resource(memory_resource& mr) : mr_(&mr) {
    if constexpr ((std::same_as<Properties, cuda::mr::device_accessible> || ...)) {
      require(is_device_accessible(mr.kind()), "device_accessible");
    }
    if constexpr ((std::same_as<Properties, cuda::mr::host_accessible> || ...)) {
      require(is_host_accessible(mr.kind()), "host_accessible");
    }
  }

  /// The resource's synchronous allocate.
  [[nodiscard]] void* allocate(std::size_t bytes, std::size_t alignment = default_alignment) {
    return mr_->allocate(bytes, alignment);
  }
  /// The resource's synchronous deallocate.
  void deallocate(void* p, std::size_t bytes, std::size_t alignment = default_alignment) noexcept {
    mr_->deallocate(p, bytes, alignment);
  }
  /// The resource's stream-ordered allocate, on `s`.
  [[nodiscard]] void* allocate_async(std::size_t bytes, std::size_t alignment, cuda::stream_ref s) {
    return mr_->allocate(bytes, alignment, stream_view{s.get()});
  }
  /// The resource's stream-ordered deallocate, on `s`.
  void deallocate_async(void* p, std::size_t bytes, std::size_t alignment,
                        cuda::stream_ref s) noexcept {
    mr_->deallocate(p, bytes, alignment, stream_view{s.get()});
  }

  /// The resource this handle refers to.
  [[nodiscard]] memory_resource& resource() const noexcept { return *mr_; }

  /// Whether the two resources are equal (memory_resource::is_equal).
  friend bool operator==(const cccl_resource& a, const cccl_resource& b) noexcept {
    return a.mr_->is_equal(*b.mr_);
  }

  /// The properties it was given (stateless ones: CCCL 3.0's device_accessible,
  /// host_accessible, or your own tags).
  template <class Property>
    requires(std::same_as<Property, Properties> || ...)
  friend void get_property(const cccl_resource&, Property) noexcept {}

 private:
  void require(bool holds, const char* property) const {
    if (!holds) {
      throw std::invalid_argument("cudamem: cccl_resource: " + std::string(mr_->name()) +
                                  " gives " + std::string(to_string(mr_->kind())) +
                                  " memory, which is not " + property);
    }
  }

  memory_resource* mr_;
};

}  // namespace cudamem

#endif  // LIBCUDACXX_ENABLE_EXPERIMENTAL_MEMORY_RESOURCE && !CUDAMEM_CCCL_RESOURCE_HPP
