// cudamem/pmr_resource.hpp — a host-accessible cudamem resource seen as a
// `std::pmr::memory_resource`, so standard containers can live in pinned, managed or host
// memory from any cudamem resource chain.
//
//   #include <cudamem/pinned_resource.hpp>
//   #include <cudamem/pmr_resource.hpp>
//
//   cudamem::pinned_resource pinned;
//   cudamem::pmr_resource as_pmr{pinned};
//   std::pmr::vector<int> v{&as_pmr};      // elements in page-locked memory
//   v.assign(1 << 20, 7);
//   cudaMemcpyAsync(dev, v.data(), v.size() * sizeof(int), cudaMemcpyHostToDevice, s);
//
// Contract
// - Wraps (does not own) a cudamem resource, which must outlive it and everything allocated
//   through it. Memory the host cannot touch (kind `device`) is refused with
//   `std::invalid_argument` naming the resource: a std container would dereference it.
// - Uses the resource's synchronous form: std containers have no streams, and their memory
//   must be usable by the host as soon as allocate returns.
// - Errors are those of the resource: `out_of_memory` is a std::bad_alloc, as std::pmr
//   expects; an alignment that is not a power of two cannot come from std::pmr.
// - A zero-byte request gets a real (1-byte) allocation, since std::pmr promises a usable
//   pointer for every request, where cudamem's interface answers nullptr.
// - Two pmr_resources compare equal when their resources do (`is_equal`), so containers
//   using them may exchange memory.
#pragma once

#include <cudamem/memory_resource.hpp>

#include <cstddef>
#include <memory_resource>
#include <stdexcept>
#include <string>

namespace cudamem {

/// A host-accessible cudamem resource as a `std::pmr::memory_resource` (not owned).
class pmr_resource final : public std::pmr::memory_resource {
 public:
  /// Serves std::pmr requests from `resource`, which must give host-accessible memory.
  explicit pmr_resource(cudamem::memory_resource& resource) : resource_(&resource) {
    if (!is_host_accessible(resource.kind())) {
      throw std::invalid_argument("cudamem: pmr_resource needs host-accessible memory, but " +
                                  std::string(resource.name()) + " gives " +
                                  std::string(to_string(resource.kind())) +
                                  " memory, which the host cannot touch");
    }
  }

  /// The cudamem resource behind this one.
  [[nodiscard]] cudamem::memory_resource& resource() const noexcept { return *resource_; }

 private:
  static std::size_t at_least_one(std::size_t bytes) noexcept { return bytes == 0 ? 1 : bytes; }

  void* do_allocate(std::size_t bytes, std::size_t alignment) override {
    return resource_->allocate(at_least_one(bytes), alignment);
  }
  void do_deallocate(void* p, std::size_t bytes, std::size_t alignment) override {
    resource_->deallocate(p, at_least_one(bytes), alignment);
  }
  bool do_is_equal(const std::pmr::memory_resource& other) const noexcept override {
    const auto* same = dynamic_cast<const pmr_resource*>(&other);
    return same != nullptr && resource_->is_equal(*same->resource_);
  }

  cudamem::memory_resource* resource_;
};

}  // namespace cudamem
