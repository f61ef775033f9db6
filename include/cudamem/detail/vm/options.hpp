// cudamem/detail/vm/options.hpp — what a vm_resource is told and what it reports: its options
// (`vm_resource_options`, each with what it costs and buys), the defaults of growth ahead and
// the measurements behind its floor, its statistics (`vm_resource_stats`) and the handles under
// one block (`vm_block_handles`, what vm_ipc.hpp exports).
//
//   cudamem::vm_resource vm{0, {.handle_bytes = 4 << 20, .keep_free_bytes = 1ull << 30}};
//   cudamem::vm_resource_stats st = vm.vm_stats();   // mapped, in use, recyclable, stranded...
//
// Part of vm_resource.hpp, whose contract says what the options do to the resource's
// behaviour (and which values it refuses); the parts that act on them are the other headers
// of detail/vm/.
#pragma once

#include <cudamem/detail/vm/mapping.hpp>  // vm_handle

#include <cstddef>
#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

namespace cudamem {

/// grow_ahead_bytes when left unset, over a real device: 4 GiB.
inline constexpr std::size_t default_grow_ahead_bytes = std::size_t{4} << 30;

/// The least free device memory growth ahead leaves, whatever the device: 2 GiB.
/// Why. Memory made ahead is a guess. What the floor keeps free is for the rest of the
/// process, which cannot ask us to give memory back (cuBLAS, NCCL and a framework's own
/// caching allocator call cudaMalloc, not cudamem: only cudamem's resources ask,
/// detail/held_ahead.hpp), and whose needs come in the middle of a run, once our pools have
/// grown. Measured by bench/grow_ahead_floor.cu on the H100 (80 GiB, CUDA 13.0, NCCL 2.28.3),
/// each step on top of the ones before, as device memory lost:
/// - the first launch of a kernel of the program (lazy loading): 140 MiB;
/// - a kernel needing 4 KiB of stack per thread (the driver grows local memory for every
///   resident thread, 132 SMs x 2048): 792 MiB; one needing 16 KiB: 3,168 MiB more;
/// - the device heap at the first in-kernel malloc: 10 MiB;
/// - cuBLAS, a handle and an SGEMM on each of 8 streams (a framework's): 518 MiB;
/// - NCCL, a one-rank communicator and its first all-reduce: 494 MiB (more ranks, more
///   buffers: NCCL documents a few hundred MiB to about 1 GiB per communicator on 8 GPUs).
/// A training process with all of these but the 16 KiB stack: 1.9 GiB; 2 GiB covers it. A
/// program whose kernels need tens of KiB of stack per thread sets grow_ahead_floor_bytes
/// higher (or grow_ahead_bytes to 0): that alone is more than the floor.
inline constexpr std::size_t grow_ahead_floor_min_bytes = std::size_t{2} << 30;

/// Above that minimum, the floor is this fraction's inverse of the device (1/32): a
/// framework's caching allocator beside us grows by its largest tensors, and those scale with
/// the device (2.5 GiB on an 80 GiB H100, 4.4 GiB on a 141 GiB H200).
inline constexpr std::size_t grow_ahead_floor_device_share = 32;

/// grow_ahead_floor_bytes when left unset: growth ahead leaves at least this much of a device
/// of `device_total` bytes free (the larger of the two constants above). What it costs: the
/// last handles of a cold fill of the whole device are made on the allocating thread, as
/// without growth ahead (on an 80 GiB H100, 2.5 GiB: 40 handles of 64 MiB, of ~1260).
[[nodiscard]] constexpr std::size_t default_grow_ahead_floor(std::size_t device_total) noexcept {
  const std::size_t share = device_total / grow_ahead_floor_device_share;
  return share > grow_ahead_floor_min_bytes ? share : grow_ahead_floor_min_bytes;
}

/// recent_frees when left unset.
inline constexpr std::size_t default_recent_frees = 16;
/// The most recent_frees accepts: a request scans every kept block.
inline constexpr std::size_t max_recent_frees = 256;

/// The blocks kept aside by recent_frees hold at most this fraction's inverse of the memory
/// mapped (1/16); a larger block is not kept. Why. A block kept aside is free memory that best
/// fit does not see: a request of another size that finds room elsewhere takes it there, and
/// while a resource grows, that elsewhere is memory the next growth would have spared. So
/// blocks kept add to the footprint, up to their bytes. Measured on 2026-11-29 with
/// `bench_capi_replay_cost bench/traces/train_b26.log` (a PyTorch training loop's log, the C
/// API's stack: 4 MiB handles, a simulated 16 GiB device; counts, the same on any host): with
/// no bound (this constant's test removed from live_blocks.hpp), the last 16 blocks of any size
/// served 64% of the allocations of 4 MiB or more and the most held grew from 10064 MiB to
/// 10960 (+8.9%); the last 64, 75% and 12600 MiB (+25%). With 1/16: 54% and 10156 MiB (+0.9%,
/// within what placement alone moves it); 1/32: 46% and 10028 MiB.
inline constexpr std::size_t recent_frees_share = 16;

/// How to build a vm_resource.
struct vm_resource_options {
  /// Size of each physical handle: the unit of growth and of recycling (rounded up to the
  /// granularity). Larger handles cost fewer driver calls per byte (giving access costs ~23 µs
  /// per handle); smaller ones strand less free memory next to live blocks, and a free hole
  /// smaller than a handle cannot be recycled. Every handle has this size, the last one too
  /// (the device's last part-handle is left to the driver; see detail/vm/compactor.hpp).
  std::size_t handle_bytes = std::size_t{64} << 20;
  /// Least physical memory a growth creates (when the device has it): fewer, larger batches of
  /// driver calls. What is not needed yet stays mapped and free for the next request.
  std::size_t growth_bytes = std::size_t{256} << 20;
  /// Size of each virtual reservation; 0: four times the device's memory.
  std::size_t reserve_bytes = 0;
  /// Reservations it may hold before running out of address space makes it unmap its stale
  /// aliases (a host wait, then one cuMemUnmap per alias, ~20 µs each, on the allocation path)
  /// rather than reserve another range (one cuMemAddressReserve, ~80 µs). The default, 8
  /// reservations of four times the device, is 4.4 TiB of address space for a 139 GiB device:
  /// far below the 128 TiB a process has, and enough that the bench's traces never sweep.
  std::size_t reservations_before_sweep = 8;
  /// Most physical bytes it may hold, used in whole handles (at least one); nullopt: as much
  /// as the device gives. Below the limit it grows before it recycles; at it, it recycles.
  std::optional<std::size_t> physical_limit;
  /// Other devices that get read-write access to its memory.
  std::vector<int> peers;
  /// Create physical memory shareable as POSIX file descriptors, so that blocks can be
  /// exported to other processes (vm_ipc.hpp). A device that cannot throws `cuda_error`
  /// (cudaErrorNotSupported) from the constructor.
  bool exportable = false;
  /// Most free memory to keep mapped ahead of need while the device has room; 0: never. The
  /// headroom is a quarter of what the resource holds, up to this: after an allocation leaves
  /// less than that free at the end of what is mapped, a thread of the resource's own (started
  /// then) creates and maps the next handles, so that the driver's ~60 µs per handle of a cold
  /// fill runs beside the callers' work instead of in it (bench_fragmentation's mixed trace,
  /// cold, on an H100: ~0.2-0.4 µs per operation less). So a growing resource holds up to a
  /// quarter more than it would (never past `physical_limit`), until the device is full or
  /// release() gives it back. nullopt: `default_grow_ahead_bytes` over a real device, 0 over
  /// the simulated one (its tests count driver calls). See detail/vm/growth_thread.hpp.
  std::optional<std::size_t> grow_ahead_bytes;
  /// Free device memory growth ahead never takes the device below (it asks the device once per
  /// batch); nullopt: default_grow_ahead_floor(the device's total memory). The resource's own
  /// growth for a request is not bounded by it (see keep_free_bytes).
  std::optional<std::size_t> grow_ahead_floor_bytes;
  /// Free device memory the resource's own growth for a request leaves to the rest of the
  /// process while its own free memory can serve the request instead; 0 (the default): grow
  /// while the device has room. Why. Below this, a request that finds no fit recycles free
  /// handles first (a compaction: the host waits for the frees on them) and creates only what
  /// recycling cannot give, so the footprint stays near what is in use, and the memory that
  /// libraries take outside every allocator in the middle of a run (cuDNN's and cuBLAS's
  /// kernels loaded on first use, the local memory a new kernel needs; the grow_ahead floor's
  /// comment measures them) is still there. Without it, a resource that has once filled the
  /// device keeps it full: it recycles what a request lacks, never more. It is not a limit:
  /// a request that recycling cannot serve still grows into the reserve, as it would without
  /// it. Growth ahead keeps at least this much free too. Costs one cudaMemGetInfo per growth.
  std::size_t keep_free_bytes = 0;
  /// How many of the last blocks of whole handles freed are kept aside, as they are, for the
  /// next request of their size on their stream (0: none; at most max_recent_frees). Such a
  /// request then costs the host a scan of their sizes instead of a best fit among the free
  /// ranges, and the free no merge (detail/vm/recent_frees.hpp). They hold at most 1/16 of what
  /// is mapped (recent_frees_share), and none are kept once the resource cannot grow (the
  /// device has said full, or physical_limit is reached): there a block kept aside could cost
  /// a compaction. They are free memory all the same: whatever reads or reshapes free memory
  /// (a request nothing else fits, growth, release(), trim(), the statistics) puts them back
  /// among the free ranges first.
  std::size_t recent_frees = default_recent_frees;
};

/// The physical handles under one block, in address order: they tile
/// [address - offset, address - offset + sum of their bytes). See vm_resource::block_handles.
struct vm_block_handles {
  std::uintptr_t address = 0;  ///< the block's start
  std::size_t bytes = 0;       ///< the block's size as placed (granule multiple)
  std::size_t requested = 0;   ///< what its caller asked for
  std::size_t offset = 0;      ///< from the first handle's start to the block's start
  std::vector<std::pair<detail::vm_handle, std::size_t>> handles;  ///< handle, its bytes
};

/// What a vm_resource holds, in the terms of virtual memory.
struct vm_resource_stats {
  std::size_t granularity = 0;             ///< mapping granularity (2 MiB on current GPUs)
  std::size_t handle_bytes = 0;            ///< size of a physical handle
  std::size_t reserved_virtual_bytes = 0;  ///< address space reserved
  std::size_t mapped_bytes = 0;            ///< physical memory held
  std::size_t peak_mapped_bytes = 0;       ///< the most held since construction or
                                           ///< reset_peak_mapped()
  std::size_t used_bytes = 0;              ///< in ranges handed out (granule multiples)
  std::size_t requested_bytes = 0;         ///< what the callers of those ranges asked for
  std::size_t partial_granule_bytes = 0;   ///< used - requested: waste from partly used
                                           ///< granules (and handles, for whole-handle ranges)
  std::size_t peak_used_bytes = 0;         ///< the most used_bytes has been
  std::size_t free_bytes = 0;              ///< mapped, not handed out
  std::size_t largest_free_range = 0;      ///< the largest free range, in bytes
  std::size_t recyclable_bytes = 0;        ///< free bytes in handles with nothing handed out
  std::size_t stranded_bytes = 0;          ///< free bytes in handles shared with live ranges
  std::size_t handles = 0;                 ///< physical handles held
  std::size_t stale_aliases = 0;           ///< retired mappings awaiting release()
  std::size_t compactions = 0;             ///< times free handles were remapped together
  std::size_t handles_created = 0;         ///< cuMemCreate calls that succeeded
  std::size_t maps = 0;                    ///< cuMemMap calls
  std::size_t access_calls = 0;            ///< cuMemSetAccess calls
  std::size_t unmaps = 0;                  ///< cuMemUnmap calls
  std::size_t handles_created_ahead = 0;   ///< of handles_created: by the growth thread
  std::size_t held_ahead_bytes = 0;        ///< of free_bytes: whole handles free at the end
                                           ///< of what is mapped, made ahead of need (by the
                                           ///< growth thread, or the rest of a growth)
  std::size_t given_back_ahead_bytes = 0;  ///< held ahead and given back: trim(), and for
                                           ///< other resources of the process short of memory
  std::size_t kept_free_compactions = 0;   ///< of compactions: recycled rather than grown
                                           ///< because growth would have left the device
                                           ///< less free than keep_free_bytes
  std::size_t recent_reuses = 0;           ///< requests served by a block kept aside
                                           ///< (recent_frees), not from the free ranges
  bool growth_ahead_held_back = false;     ///< growth ahead waits for a growth of its own
                                           ///< (after a give-back, or at the floor)
};

}  // namespace cudamem
