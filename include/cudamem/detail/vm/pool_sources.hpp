// cudamem/detail/vm/pool_sources.hpp — where a vm_pool_resource's memory comes from, besides
// its vm_resource: the caller's adaptor over it, plain cudaMalloc'd memory under
// compute-sanitizer, and the second vm_resource of larger handles for bulk blocks.
//
//   auto adaptor = make_pool_adaptor(vm, options.upstream_adaptor);       // or nullptr
//   auto plain = plain_memory_under_sanitizer(vm, adaptor != nullptr, options.physical_limit);
//   auto bulk = make_bulk_vm(vm, std::move(bulk_layer), options, adaptor || plain);
//
// Why apart: each is a decision made once, at construction, with rules of its own (what an
// adaptor must lead to, when the tool is attached, when a bulk resource may exist); the
// vm_pool_resource holds what they return and routes requests. Its contract
// (vm_pool_resource.hpp) says what each means to a user.
#pragma once

#include <cudamem/detail/nvtx.hpp>  // compute_sanitizer_attached
#include <cudamem/detail/vm/driver_mapping.hpp>
#include <cudamem/detail/vm/mapping.hpp>
#include <cudamem/device_resource.hpp>
#include <cudamem/limiting_adaptor.hpp>
#include <cudamem/memory_report.hpp>  // format_bytes
#include <cudamem/memory_resource.hpp>
#include <cudamem/vm_resource.hpp>

#include <cstddef>
#include <functional>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>

namespace cudamem::detail {

/// Plain device memory for the pool's chunks and the large blocks, held to physical_limit when
/// there is one (counted in the bytes handed out, where a vm_resource counts handles).
struct plain_memory {
  plain_memory(int device, std::optional<std::size_t> limit) : device_memory(device) {
    if (limit) {
      budget.emplace(device_memory, *limit);
    }
  }
  memory_resource& source() noexcept {
    return budget ? static_cast<memory_resource&>(*budget) : device_memory;
  }
  device_resource device_memory;
  std::optional<limiting_adaptor> budget;
};

/// Under compute-sanitizer, with no adaptor of the caller's, over the real driver: plain
/// memory; else none.
[[nodiscard]] inline std::unique_ptr<plain_memory> plain_memory_under_sanitizer(
    const vm_resource& vm, bool has_adaptor, std::optional<std::size_t> limit) {
  const bool real_device = dynamic_cast<const driver_vm_mapping*>(&vm.mapping_layer()) != nullptr;
  if (has_adaptor || !real_device || !compute_sanitizer_attached()) {
    return nullptr;
  }
  return std::make_unique<plain_memory>(vm.device(), limit);
}

/// Calls the factory (none: nullptr) and checks that what it made leads to `vm`.
[[nodiscard]] inline std::unique_ptr<memory_resource> make_pool_adaptor(
    vm_resource& vm, const std::function<std::unique_ptr<memory_resource>(vm_resource&)>& factory) {
  if (!factory) {
    return nullptr;
  }
  std::unique_ptr<memory_resource> adaptor = factory(vm);
  if (!adaptor) {
    throw std::invalid_argument("cudamem: vm_pool_options::upstream_adaptor made no resource");
  }
  for (const memory_resource* r = adaptor.get(); r != &vm; r = r->upstream()) {
    if (r == nullptr) {
      throw std::invalid_argument("cudamem: vm_pool_options::upstream_adaptor made a resource "
                                  "whose upstreams do not lead to the vm_pool's vm_resource");
    }
  }
  return adaptor;
}

/// The vm_resource for bulk blocks: `vm`'s options with handles of `bulk_bytes`, over `layer`.
/// Checks bulk_bytes first (a multiple of vm's handle, larger than it: std::invalid_argument
/// otherwise); then none when bulk_bytes is 0, when the memory is not vm's own (an adaptor of
/// the caller's would not see the bulk blocks; under compute-sanitizer there are no handles),
/// or under physical_limit (one limit cannot be split between two resources ahead of time).
[[nodiscard]] inline std::unique_ptr<vm_resource> make_bulk_vm(
    const vm_resource& vm, std::unique_ptr<vm_mapping_layer> layer, std::size_t bulk_bytes,
    bool memory_not_vm_own) {
  if (bulk_bytes == 0) {
    return nullptr;
  }
  const std::size_t handle = vm.handle_bytes();
  if (bulk_bytes <= handle || bulk_bytes % handle != 0) {
    throw std::invalid_argument("cudamem: vm_pool_options::bulk_handle_bytes (" +
                                format_bytes(bulk_bytes) + ") must be a multiple of the "
                                "handle size (" + format_bytes(handle) + ") larger than it");
  }
  if (memory_not_vm_own || vm.options().physical_limit) {
    return nullptr;
  }
  if (!layer) {
    throw std::invalid_argument("cudamem: vm_pool_resource: bulk_handle_bytes needs a mapping "
                                "layer for the bulk blocks (the constructor's bulk_layer)");
  }
  vm_resource_options options = vm.options();
  options.handle_bytes = bulk_bytes;
  return std::make_unique<vm_resource>(std::move(layer), std::move(options));
}

}  // namespace cudamem::detail
