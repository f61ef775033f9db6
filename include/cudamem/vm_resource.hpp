// cudamem/vm_resource.hpp — device memory from CUDA's virtual memory management: an upstream
// whose free physical memory can always be put behind a fresh address range, wherever the
// frees left it. Meant to sit under a pool_resource (that is what vm_pool_resource is).
//
//   #include <cudamem/vm_resource.hpp>
//
//   cudamem::vm_resource vm{0};                       // device 0; reserves address space once
//   cudamem::pool_resource pool{vm};                  // the pool calls vm rarely: chunks only
//   void* a = vm.allocate(64 << 20);                  // or directly: maps physical memory
//   vm.deallocate(a, 64 << 20);                       // stays mapped, free, reusable
//   cudamem::vm_resource_stats st = vm.vm_stats();    // virtual, mapped, in use, waste
//   vm.release();                                     // give wholly free memory back
//
//   cudamem::vm_resource shared{0, {.peers = {1}}};   // device 1 may read and write it too
//   cudamem::vm_resource ipc{0, {.exportable = true}}; // blocks other processes may map
//                                                     // (vm_ipc.hpp: export_block)
//
// Why. Memory behind fixed address ranges cannot turn two free 64 MiB holes into one 128 MiB
// block ("out of memory while memory is free"). The driver's cudaMalloc can, by mapping physical
// pages into a fresh range, at 50-170 µs a call. This resource does the same, rarely, and only
// for what a request lacks. The parts, each in its own header with what it owns and why:
// - detail/vm/address_space.hpp  a virtual range four times the device's memory, reserved once
//                                (22 µs for 158 GiB on an H100), more if it runs out; new
//                                mappings go at its *frontier*
// - detail/vm/handle_set.hpp     physical memory in handles of `handle_bytes` (64 MiB); a
//                                request of a handle or more gets whole handles, so that once
//                                freed all of it can be recycled; stale aliases
// - detail/vm/free_ranges.hpp    freed ranges stay mapped and free, merge with neighbours, and
//                                serve the next request that fits at no driver cost
// - detail/vm/placement.hpp      which free range a block goes to (best fit), and where in it
// - detail/vm/live_blocks.hpp    the blocks handed out; taking a fit, freeing, stream order
// - detail/vm/recent_frees.hpp   the last blocks freed, kept aside for a request of their size
// - detail/vm/compactor.hpp      when nothing fits: create handles while the device has room;
//                                then recycle idle handles to the frontier (only what the
//                                request lacks, smallest free runs first); giving memory back
// - detail/vm/grow_ahead.hpp     batches of handles made ahead of need, and the memory held
//                                ahead that gives way (members of the compactor)
// - detail/vm/growth_thread.hpp  the thread that makes those batches while the callers work
//                                (grow_ahead_bytes: a quarter of what is held, up to 4 GiB)
// - detail/vm/mapping.hpp        the device behind one interface: driver_mapping.hpp (cuMem*),
//                                simulated_mapping.hpp (for tests, with no GPU)
// - detail/vm/options.hpp, config.hpp  vm_resource_options and vm_resource_stats, and the
//                                sizes resolved from the options
// What a move costs, measured (bench_vmm_driver): cuMemMap ~1 µs, and cuMemSetAccess ~23-40 µs
// *per handle* in the range whatever its size: giving access is paid per handle, not per byte.
// Hence 64 MiB handles, growth before recycling, moving only what is missing, and stale
// aliases instead of cuMemUnmap (17-31 µs, unsafe while a kernel may read) on the allocation
// path. And a growing resource makes its next handles on a thread of its own, ahead of need
// (cuMemCreate plus a handle's cuMemSetAccess: ~60 µs), so that a cold fill's driver time
// runs beside the callers' work rather than in it.
//
// Contract (memory_resource.hpp's, plus; the options are in detail/vm/options.hpp)
// - Construction: `vm_resource(device, options)` throws `no_device_error` with no device,
//   `std::out_of_range` for a device or peer that does not exist, `vm_not_supported_error` on a
//   device without VMM (CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED = 0),
//   `std::invalid_argument` for bad options (a peer that cannot reach the device, the device
//   itself as a peer, handle_bytes 0, a physical_limit below one handle,
//   reservations_before_sweep 0, a null layer). The second constructor takes any mapping
//   layer (tests pass `detail::simulated_vm_mapping`: no GPU needed). Each vm_resource maps on
//   its own device; `peers` get read-write access to everything it maps.
// - Blocks are granule multiples, whole handles from `handle_bytes` up (a request is rounded up;
//   `vm_stats().partial_granule_bytes` is that waste), aligned to the granule, or to any larger
//   power-of-two alignment asked for.
// - Stream order. A free on stream s records an event on s (one per stream, the layer's, so s may
//   be destroyed after; on the legacy stream only once needed: driver_mapping.hpp). A range freed
//   on s and taken by a request on t makes t wait for that event (no host wait). Recycling a handle
//   freed on another stream than the request's waits *on the host* for that stream's last free
//   (cudaEventSynchronize); freed on the request's own, it waits for nothing (stream order; the new
//   mapping is an alias) and keeps that stream's tag. So does merging neighbours freed on different
//   streams when no single free range holds a request (the host waits for their streams, all but
//   the request's own). After a host wait for a stream, everything freed on it is idle and merges
//   with its neighbours. Synchronous forms wait on the host, and take an idle range first; a
//   synchronous free promises idle. cudaStreamPerThread is each thread's own (stream_tag.hpp).
// - Physical memory is never unmapped while work may touch it: release(), the destructor and
//   the address-space sweep wait on the host for every recorded free first.
// - `release()` unmaps stale aliases and gives every wholly free handle back to the driver;
//   returns the physical bytes given back. Memory in use, and handles shared with it, stay.
// - Failure throws `out_of_memory` (recycling and growth both tried; nothing changes); a
//   request larger than the device or than `physical_limit` is refused before anything is
//   tried. Bad frees (a pointer not from here, a double free, a size that differs from the
//   allocation's) go to the error handler; a size mismatch still frees the block.
// - Export (`exportable`): physical memory is created shareable as POSIX file descriptors, and
//   `block_handles(p)` lists the handles under the block at `p` (what vm_ipc.hpp's export_block
//   turns into descriptors for another process). A block's handles stay where they are while
//   it is allocated (only wholly free handles are recycled). `block_handles` throws
//   `std::invalid_argument` for a resource not made exportable and for a pointer that is not
//   the start of a block it gave out and has not freed; `handles_covering(p, n)`, of any mapped
//   range. `add_peer(d)`: device d may use all that is mapped, now and later.
// - Host memory: the records of blocks and free ranges reuse the nodes of freed ones
//   (detail/spare_nodes.hpp), so once warm, taking and freeing blocks allocates none.
// - Thread-safe: one mutex (a pool above calls it for chunks only).
// - Growth ahead (`grow_ahead_bytes`: 4 GiB by default over a real device, 0 over the simulated
//   one): once an allocation leaves less than a quarter of what is held (at most that) free at
//   the frontier, a thread of its own maps the next handles with no lock held, where a growth
//   would have put them. A request that finds no fit meanwhile waits for its batches, then grows
//   itself if still short. The thread stops at "device full" and at `physical_limit`; a driver
//   error ends it for good (reported). `wait_for_growth()` waits for it to be idle; the
//   destructor joins it; vm_stats().handles_created_ahead counts its handles.
// - Memory held ahead gives way. The thread never takes the device below
//   `grow_ahead_floor_bytes` free (default_grow_ahead_floor: 2 GiB or 1/32 of the device). What
//   is held ahead (whole free handles at the end of what is mapped: held_ahead_bytes) is given
//   back before any cudamem resource of the process fails for lack of memory on this device,
//   which then tries once more (detail/held_ahead.hpp lists them); `trim()` and `release()` give
//   it back on demand. Growth ahead then waits for a growth of the resource's own.
// - Marked blocks: `allocate_marked` records a byte with the block; `deallocate_marked` frees
//   only a block with that mark, and otherwise frees and reports nothing (its owner does).
// - A reserve for the rest of the process (`keep_free_bytes`, 0 by default): growth for a
//   request that would leave the device less free than that recycles free handles first and
//   creates only what they cannot give (into the reserve: it is not a limit); growth ahead
//   stops there too. vm_stats().kept_free_compactions counts the compactions it chose.
// - Recent frees (`recent_frees`, 16, at most 1/16 of what is mapped, while it can grow): the last
//   blocks of whole handles freed are kept aside, free, for the next request of their size on
//   their stream (or any, freed synchronously): no wait, by stream order. Whatever else uses free
//   memory (a request no free range holds, before it grows, recycles or fails; release(), trim(),
//   growth ahead, the statistics) puts them back among the free ranges first (live_blocks.hpp).
// Code: this header declares the class; detail/vm/resource_core.hpp is its state and its code,
// and is included at the end unless the program links cudamem::compiled (detail/compiled.hpp).
#pragma once

#include <cudamem/detail/compiled.hpp>
#include <cudamem/detail/vm/options.hpp>  // vm_resource_options, vm_resource_stats, ...
#include <cudamem/memory_resource.hpp>
#include <cudamem/stream.hpp>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <source_location>
#include <string_view>
#include <utility>
#include <vector>

namespace cudamem {

namespace detail {
class vm_mapping_layer;  // detail/vm/mapping.hpp
class vm_resource_core;  // detail/vm/resource_core.hpp
}  // namespace detail

/// Device memory over a virtual address range; see the contract above.
class vm_resource final : public memory_resource {
 public:
  /// Memory on `device` (the current device by default).
  explicit vm_resource(int device = -1, vm_resource_options options = {},
                       std::source_location where = std::source_location::current());

  /// Memory from any mapping layer (tests: detail::simulated_vm_mapping).
  explicit vm_resource(std::unique_ptr<detail::vm_mapping_layer> layer,
                       vm_resource_options options = {});

  ~vm_resource() override;

  vm_resource(const vm_resource&) = delete;
  vm_resource& operator=(const vm_resource&) = delete;

  /// Gives back every wholly free handle and every stale alias, after waiting on the host for
  /// all recorded frees; returns the physical bytes given back. See the contract.
  std::size_t release();

  /// Gives back the memory held ahead of need (vm_stats().held_ahead_bytes: whole handles free
  /// at the end of what is mapped, made by the growth thread or left by a growth) after the
  /// growth step under way, if any, has ended; growth ahead then waits until the resource
  /// grows for a request of its own. What another resource of the process does by itself
  /// before it fails for lack of device memory (see the contract). Returns the bytes.
  std::size_t trim();

  /// Blocks until no growth ahead is asked for or under way (grow_ahead_bytes; for tests and
  /// benchmarks that read the device's state). Returns at once without it.
  void wait_for_growth() const;

  /// What it holds, in virtual-memory terms (walks the free ranges: not for hot loops).
  [[nodiscard]] vm_resource_stats vm_stats() const;

  /// Starts vm_stats().peak_mapped_bytes again from now.
  void reset_peak_mapped();
  /// What is mapped now: ranges of adjacent handles, (start, bytes) by address.
  [[nodiscard]] std::vector<std::pair<std::uintptr_t, std::size_t>> mapped_ranges() const;
  /// The device's mapping granularity: block sizes and addresses are multiples of it.
  [[nodiscard]] std::size_t granularity() const noexcept;
  /// The size of every physical handle: handle_bytes rounded up to the granularity.
  [[nodiscard]] std::size_t handle_bytes() const noexcept;
  /// The options it was made with.
  [[nodiscard]] const vm_resource_options& options() const noexcept;

  /// The handles under the live block starting at `p`, for export (vm_ipc.hpp); see the
  /// contract. Throws std::invalid_argument unless the resource is exportable and `p` starts
  /// a block it gave out and has not freed.
  [[nodiscard]] vm_block_handles block_handles(const void* p) const;

  /// The handles under [p, p + bytes) of mapped memory; std::invalid_argument otherwise.
  [[nodiscard]] vm_block_handles handles_covering(const void* p, std::size_t bytes) const;

  /// Peer access for virtual memory (cudaDeviceEnablePeerAccess covers cudaMalloc'd only).
  void add_peer(int device);

  // --- blocks an owner marks (vm_pool_resource's large blocks) -----------------------------

  /// allocate() (`stream` null: synchronous), the block recorded with `mark`. Why: an owner
  /// that also takes blocks it cuts up (a pool's chunks, mark 0) then frees its own blocks
  /// without a record of its own (a lookup fewer per block) and never frees a chunk for one.
  [[nodiscard]] void* allocate_marked(std::size_t bytes, std::size_t alignment,
                                      const stream_view* stream, std::uint8_t mark);
  /// deallocate() of a block from allocate_marked with the same `mark`: returns the bytes it
  /// was asked with, or 0 when the free failed (reported; the block stays live); nullopt, with
  /// nothing freed and nothing reported, when no live block with that mark starts at `p`.
  std::optional<std::size_t> deallocate_marked(void* p, std::size_t bytes,
                                               const stream_view* stream,
                                               std::uint8_t mark) noexcept;

  /// The mapping layer (tests inspect the simulated one).
  [[nodiscard]] detail::vm_mapping_layer& mapping_layer() const noexcept;

 private:
  void* do_allocate(std::size_t bytes, std::size_t alignment, stream_view stream) override;
  void* do_allocate_sync(std::size_t bytes, std::size_t alignment) override;
  void do_deallocate(void* p, std::size_t bytes, std::size_t alignment,
                     stream_view stream) noexcept override;
  void do_deallocate_sync(void* p, std::size_t bytes, std::size_t alignment) noexcept override;
  bool do_is_equal(const memory_resource& other) const noexcept override { return this == &other; }
  std::string_view do_name() const noexcept override { return "vm_resource"; }
  resource_stats do_stats() const override;

  detail::vm_resource_core& core() noexcept;
  const detail::vm_resource_core& core() const noexcept;

  // The state (detail::vm_resource_core: the mapping layer, the handles, the free ranges, the
  // live blocks, the growth thread, ...) lives here, in place: no allocation and no pointer to
  // follow on a call. resource_core.hpp checks that it fits.
  static constexpr std::size_t core_bytes = 944;
  alignas(8) unsigned char core_[core_bytes];
};

}  // namespace cudamem

#if CUDAMEM_DEFINITIONS_IN_HEADERS
#include <cudamem/detail/vm/resource_core.hpp>
#endif
