// cudamem/detail/vm/pool_sources.hpp — where a vm_pool_resource's memory comes from, besides
// its vm_resource: the caller's adaptor over it, plain cudaMalloc'd memory under
// compute-sanitizer, and the second vm_resource of larger handles for bulk blocks.
//
//   auto adaptor = make_pool_adaptor(vm, options.upstream_adaptor);       // or nullptr
//   auto plain = plain_memory_under_sanitizer(vm, adaptor != nullptr, options.physical_limit);
//   auto bulk = make_bulk_vm(vm, std::move(bulk_layer), options.bulk_handle_bytes,
//                            adaptor || plain);
//
//   void* p = ask_upstream(bulk.get(), [&] { return upstream.allocate(bytes); });
//
// Why apart: each is a decision made once, at construction, with rules of its own (what an
// adaptor must lead to, when the tool is attached, when a bulk resource may exist); the
// vm_pool_resource holds what they return and routes requests. Its contract
// (vm_pool_resource.hpp) says what each means to a user.
//
// Bulk blocks (vm_pool_options::bulk_handle_bytes). Why: cuMemSetAccess is paid per handle
// (~34 µs), so a 128 MiB block remapped from freed memory costs 32 in 4 MiB handles, 4 in
// 32 MiB ones, while small handles strand less beside blocks of other sizes (bench/README.md,
// "Handle size"); a bulk block is whole handles, nothing at its end. How free memory moves
// between the two vm_resources, each holding its own:
// - The bulk resource never grows into keep_free_bytes for a block (it recycles its own free
//   handles, and grows above the reserve): the block then comes from the upstream, which
//   holds the rest of the memory (vm_pool_stats::bulk_declined counts them).
// - When the upstream's growth is held back (by keep_free_bytes or a full device), the bulk
//   resource gives back its wholly free handles after that request (ask_upstream), so the
//   upstream grows next time instead of recycling again. As the bulk resource cannot take
//   them back below the reserve, this happens once, not at every change of shape: with each
//   resource keeping its own free memory near a full device, the training loop of
//   bench/python/README.md compacted 72 times in 250 steps against 28 with one resource.
// - When the upstream cannot supply at all, the pool's wholly free chunks and the bulk
//   resource's wholly free handles go back (release()) and it is asked once more.
#pragma once

#include <cudamem/detail/nvtx.hpp>  // compute_sanitizer_attached
#include <cudamem/detail/vm/config.hpp>
#include <cudamem/detail/vm/driver_mapping.hpp>
#include <cudamem/detail/vm/mapping.hpp>
#include <cudamem/device_resource.hpp>
#include <cudamem/error.hpp>  // report_problem
#include <cudamem/limiting_adaptor.hpp>
#include <cudamem/out_of_memory.hpp>  // format_bytes
#include <cudamem/memory_resource.hpp>
#include <cudamem/vm_resource.hpp>

#include <cstddef>
#include <exception>
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

/// `ask()`, which takes memory from a vm_pool's upstream; then, where there is a bulk
/// resource and the upstream's growth was held back (detail/vm/config.hpp: growth_held_back),
/// the bulk resource gives back its wholly free handles (see above). Its failure to do so is
/// reported (report_problem), and the block is returned all the same.
template <class Ask>
void* ask_upstream(vm_resource* bulk, const Ask& ask) {
  if (bulk == nullptr) {
    return ask();
  }
  growth_held_back = false;
  void* p = ask();
  if (std::exchange(growth_held_back, false)) {
    try {
      bulk->release();
    } catch (const std::exception& e) {  // the block is good; the memory stays where it was
      report_problem(std::string("vm_pool_resource: the bulk resource's release failed: ") +
                     e.what());
    }
  }
  return p;
}

}  // namespace cudamem::detail
