// cudamem/detail/vm/mapping.hpp — the mapping layer under vm_resource: everything that
// touches the device (address space, physical memory, page mappings, access rights, and the
// events that order reuse), behind one small interface with two implementations:
//
//   driver_vm_mapping     (vm/driver_mapping.hpp) the real thing: cuMemAddressReserve,
//                         cuMemCreate, cuMemMap, cuMemSetAccess, cuMemUnmap, cuMemRelease,
//                         and CUDA events.
//   simulated_vm_mapping  (vm/simulated_mapping.hpp) host bookkeeping only: fake addresses, a
//                         byte budget for "physical memory", and checks that every call is
//                         legal. The pool's granule and handle bookkeeping runs on it in CI,
//                         with no GPU. A header of its own: only tests and simulations use it,
//                         and its maps and timers are a measurable share of the compile time
//                         of every translation unit that includes a vm_pool.
//
//   auto layer = std::make_unique<cudamem::detail::simulated_vm_mapping>(
//       cudamem::detail::simulated_vm_options{.capacity = 80ull << 30});
//   cudamem::vm_resource vm{std::move(layer)};      // or vm_pool_resource pool{std::move(layer)}
//
// Contract (what vm_resource relies on; both implementations keep it)
// - Addresses are plain integers (std::uintptr_t); the layer never dereferences them.
// - `reserve(bytes)` returns a granule-aligned range of address space with nothing behind it,
//   or throws. `free_reservation` gives it back; everything in it must be unmapped first.
// - `create(bytes)` makes a physical allocation (a "handle") of `bytes`, a multiple of the
//   granularity. It returns nullopt when the device is out of memory (a normal answer the
//   pool acts on) and throws for any other failure.
// - `map(va, bytes, h)` maps the whole handle at `va`. A handle may be mapped at several
//   addresses at once (vm_resource keeps a stale alias rather than pay for an unmap at once).
//   `unmap(va, bytes)` undoes exactly one earlier `map`. `release(h)` drops the handle; its
//   memory goes back to the device once its last mapping is gone.
// - `set_access(va, bytes)` makes a range of fresh mappings readable and writable by the
//   layer's device and its peers. A range may cover several adjacent mappings: vm_resource
//   calls it once per batch, because it is the expensive call.
// - `add_peer(d)` gives device d read-write access to what set_access covers from now on, and
//   `set_peer_access(va, bytes, d)` to a range mapped before (vm_resource::add_peer). The
//   driver refuses a device with no peer path (std::invalid_argument); a peer already there
//   (or the layer's own device) is not added twice. The simulated layer has no other devices:
//   it records the peers, and checks that each range given to one is wholly mapped.
// - Ordering: `record_free(s, va, bytes)` notes that the last use of [va, va + bytes) was
//   submitted to `s` (the driver records an event on `s`, or on the legacy stream owes one
//   until an order or a wait needs it; the simulated layer marks the
//   handles behind the range "in flight" until the host has waited for `s`, and counts an
//   unmap of an in-flight handle as a violation: the bug this layer exists to catch);
//   `order_after_free(user, freed_on)` makes later work on `user` wait for the last free
//   recorded on `freed_on` (no host wait); `wait_for_free(freed_on)` blocks the host until it
//   has finished; `wait_for_all_frees()` does so for every stream seen. Events belong to the
//   layer, so a stream may be destroyed after freeing on it.
// - `device_free()` is what the device has free now (the growth thread keeps it above a
//   floor; nullopt when it cannot be known); `domain()` names the memory the layer draws
//   from, for detail/held_ahead.hpp: the device, or for a simulated layer the simulated
//   device it shares (`simulated_vm_options::physical`) or itself.
// - Threads: vm_resource calls the layer under its mutex, except its growth thread
//   (vm_resource_options::grow_ahead_bytes), which calls device_free, create, map,
//   set_access, and on a failure unmap and release, with no lock held. So those may run
//   beside record_free, order_after_free and wait_for_free on another thread (never beside
//   another create or map: the other threads wait for the growth thread's batch before they
//   map). The driver is thread-safe; the simulated layer takes a lock of its own in every
//   call.
#pragma once

#include <cudamem/detail/held_ahead.hpp>  // memory_domain

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <optional>

namespace cudamem::detail {

/// An opaque physical allocation (a CUmemGenericAllocationHandle for the driver).
using vm_handle = unsigned long long;

/// What the pool needs from the device; see the contract above.
class vm_mapping_layer {
 public:
  virtual ~vm_mapping_layer() = default;
  vm_mapping_layer(const vm_mapping_layer&) = delete;
  vm_mapping_layer& operator=(const vm_mapping_layer&) = delete;

  /// The device the memory lives on; -1 for a simulated one.
  [[nodiscard]] virtual int device() const noexcept = 0;
  /// The mapping granularity (2 MiB on current GPUs): sizes and addresses are multiples.
  [[nodiscard]] virtual std::size_t granularity() const noexcept = 0;
  /// The device's whole memory (reports, and the default reservation size).
  [[nodiscard]] virtual std::size_t device_total() const noexcept = 0;
  /// A simulated device's capacity (memory_report uses it as the device); nullopt for real.
  [[nodiscard]] virtual std::optional<std::size_t> simulated_capacity() const noexcept {
    return std::nullopt;
  }
  /// The device's free memory now; nullopt when it cannot be known.
  [[nodiscard]] virtual std::optional<std::size_t> device_free() const noexcept = 0;
  /// The memory it draws from (see the contract).
  [[nodiscard]] virtual memory_domain domain() const noexcept = 0;

  /// Reserves `bytes` of address space starting at a multiple of `alignment` (a power of two,
  /// a multiple of the granularity).
  [[nodiscard]] virtual std::uintptr_t reserve(std::size_t bytes, std::size_t alignment) = 0;
  virtual void free_reservation(std::uintptr_t base, std::size_t bytes) noexcept = 0;
  [[nodiscard]] virtual std::optional<vm_handle> create(std::size_t bytes) = 0;
  virtual void release(vm_handle handle) noexcept = 0;
  virtual void map(std::uintptr_t va, std::size_t bytes, vm_handle handle) = 0;
  virtual void unmap(std::uintptr_t va, std::size_t bytes) noexcept = 0;
  virtual void set_access(std::uintptr_t va, std::size_t bytes) = 0;
  /// Whether `device` can be given access (own device, known peer or peer path): it is added.
  virtual void add_peer(int device) = 0;
  virtual void set_peer_access(std::uintptr_t va, std::size_t bytes, int device) = 0;

  virtual void record_free(cudaStream_t stream, std::uintptr_t va, std::size_t bytes) = 0;
  virtual void order_after_free(cudaStream_t user, cudaStream_t freed_on) = 0;
  virtual void wait_for_free(cudaStream_t freed_on) = 0;
  virtual void wait_for_all_frees() noexcept = 0;

 protected:
  vm_mapping_layer() = default;
};

}  // namespace cudamem::detail
