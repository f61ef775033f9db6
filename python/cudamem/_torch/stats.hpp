// cudamem/_torch/stats.hpp — PyTorch's memory statistics, kept by cudamem's allocator for
// PyTorch: the counters behind torch.cuda.memory_stats(), memory_allocated() and the rest.
//
//   device_figures f;
//   f.on_allocate(1 << 20, 1000000);          // a block of 1 MiB (rounded) for 1000000 bytes
//   f.on_free_requested(1 << 20);             // the tensor is gone: no longer "allocated"
//   f.on_free_completed(1 << 20, 1000000);    // and no stream uses it: no longer "active"
//   f.allocated_bytes[all].current;           // torch.cuda.memory_allocated()
//   f.reset_peaks();                          // torch.cuda.reset_peak_memory_stats()
//
// What the figures mean here (PyTorch's names, cudamem's memory):
// - allocation / allocated_bytes: blocks handed to PyTorch and not yet freed, in number and
//   bytes as handed out (requests are rounded up to 512 bytes, as PyTorch's own allocator
//   does, so that tensor sizes add up the same way). They drop when PyTorch frees a block.
// - active / active_bytes / requested_bytes: blocks allocated or still waiting for a stream
//   that used them (Tensor.record_stream) to finish; requested_bytes in the bytes PyTorch asked
//   for. They drop when the block really goes back.
// - Each is kept for all blocks, small ones (1 MiB or less: PyTorch's "small pool") and large.
// - segment / reserved_bytes / inactive_split are read from cudamem when asked
//   (torch_allocator.cpp): what cudamem holds from the device, not counted here.
//
// Not thread-safe: the allocator's lock guards it.
#pragma once

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>

namespace cudamem::torch_bridge {

/// PyTorch's StatType: index 0 all blocks, 1 the small pool, 2 the large pool.
enum stat_kind : std::size_t { all = 0, small_pool = 1, large_pool = 2 };

/// Blocks of this many bytes or less (rounded) are "small", as PyTorch counts them.
inline constexpr std::size_t small_block_limit = std::size_t{1} << 20;
/// Every block is a multiple of this, and at least this: PyTorch's own rounding.
inline constexpr std::size_t block_rounding = 512;

/// A request's size as handed out: at least 512 bytes, a multiple of 512.
[[nodiscard]] constexpr std::size_t rounded_block_size(std::size_t bytes) noexcept {
  return bytes < block_rounding ? block_rounding
                                : (bytes + block_rounding - 1) / block_rounding * block_rounding;
}

/// The same under PyTorch's `roundup_power2_divisions` setting, `divisions` being what it says
/// for this size (0 or 1: none). The interval between the powers of two around `bytes` is cut
/// into `divisions` equal steps, and the request goes up to the next step: 84 MiB with 4
/// divisions of [64, 128) MiB becomes 96 MiB. A power of two stays as it is. Sizes too small
/// for a step of a whole 512 bytes keep the plain rounding, as PyTorch's allocator does.
[[nodiscard]] constexpr std::size_t rounded_block_size(std::size_t bytes,
                                                       std::size_t divisions) noexcept {
  if (divisions <= 1 || bytes <= block_rounding * divisions) {
    return rounded_block_size(bytes);
  }
  std::size_t below = 1;  // the largest power of two not above `bytes`
  while (below <= bytes / 2) {
    below *= 2;
  }
  if (below == bytes) {
    return bytes;
  }
  const std::size_t step = below / divisions;
  const std::size_t steps = (bytes - below + step - 1) / step;
  return rounded_block_size(below + steps * step);
}

/// One counter as PyTorch keeps it.
struct stat {
  std::int64_t current = 0;
  std::int64_t peak = 0;
  std::int64_t allocated = 0;  ///< everything ever added
  std::int64_t freed = 0;      ///< everything ever taken away

  void increase(std::int64_t n) noexcept {
    current += n;
    allocated += n;
    peak = std::max(peak, current);
  }
  void decrease(std::int64_t n) noexcept {
    current -= n;
    freed += n;
  }
  void reset_peak() noexcept { peak = current; }
  void reset_accumulated() noexcept { allocated = freed = 0; }
};

/// all, small_pool, large_pool.
struct stat_array {
  std::array<stat, 3> by_kind{};

  stat& operator[](std::size_t k) noexcept { return by_kind[k]; }
  const stat& operator[](std::size_t k) const noexcept { return by_kind[k]; }

  /// Counts `n` for all blocks and for the block's pool.
  void increase(std::size_t block_size, std::int64_t n) noexcept {
    by_kind[all].increase(n);
    by_kind[kind_of(block_size)].increase(n);
  }
  void decrease(std::size_t block_size, std::int64_t n) noexcept {
    by_kind[all].decrease(n);
    by_kind[kind_of(block_size)].decrease(n);
  }
  /// Counts `n` for all and for the pool `k` (a chunk's kind is its own, not its size's).
  void increase(stat_kind k, std::int64_t n) noexcept {
    by_kind[all].increase(n);
    by_kind[k].increase(n);
  }
  void decrease(stat_kind k, std::int64_t n) noexcept {
    by_kind[all].decrease(n);
    by_kind[k].decrease(n);
  }
  void reset_peak() noexcept {
    for (stat& s : by_kind) {
      s.reset_peak();
    }
  }
  void reset_accumulated() noexcept {
    for (stat& s : by_kind) {
      s.reset_accumulated();
    }
  }
  [[nodiscard]] static stat_kind kind_of(std::size_t block_size) noexcept {
    return block_size <= small_block_limit ? small_pool : large_pool;
  }
};

/// What one device's allocator counts itself (the rest comes from cudamem when asked).
struct device_figures {
  stat_array allocation;       ///< blocks allocated
  stat_array allocated_bytes;  ///< their bytes, as handed out
  stat_array active;           ///< blocks allocated or waiting for a stream
  stat_array active_bytes;
  stat_array requested_bytes;  ///< of active blocks, as PyTorch asked
  stat_array segment;          ///< chunks of graph pools and MemPools (cudamem's own memory
                               ///< is virtual memory: PyTorch's "expandable segments")
  std::int64_t num_alloc_retries = 0;   ///< allocations tried again after freeing memory
  std::int64_t num_ooms = 0;            ///< out-of-memory errors raised
  std::int64_t num_sync_all_streams = 0;  ///< waits for every pending free (empty_cache)
  /// Reserved bytes are cudamem's (mapped memory); their accumulated figures restart from
  /// these at reset_accumulated().
  std::int64_t reserved_allocated_base = 0;
  std::int64_t reserved_freed_base = 0;
  std::int64_t device_alloc_base = 0;
  std::int64_t device_free_base = 0;

  void on_allocate(std::size_t block_size, std::size_t requested) noexcept {
    const auto b = static_cast<std::int64_t>(block_size);
    allocation.increase(block_size, 1);
    allocated_bytes.increase(block_size, b);
    active.increase(block_size, 1);
    active_bytes.increase(block_size, b);
    requested_bytes.increase(block_size, static_cast<std::int64_t>(requested));
  }
  /// PyTorch freed the block (it may still wait for streams that used it).
  void on_free_requested(std::size_t block_size) noexcept {
    allocation.decrease(block_size, 1);
    allocated_bytes.decrease(block_size, static_cast<std::int64_t>(block_size));
  }
  /// The block went back to cudamem.
  void on_free_completed(std::size_t block_size, std::size_t requested) noexcept {
    active.decrease(block_size, 1);
    active_bytes.decrease(block_size, static_cast<std::int64_t>(block_size));
    requested_bytes.decrease(block_size, static_cast<std::int64_t>(requested));
  }

  void reset_peaks() noexcept {
    for (stat_array* a : arrays()) {
      a->reset_peak();
    }
  }
  void reset_accumulated() noexcept {
    for (stat_array* a : arrays()) {
      a->reset_accumulated();
    }
    num_alloc_retries = num_ooms = num_sync_all_streams = 0;
  }

 private:
  std::array<stat_array*, 6> arrays() noexcept {
    return {&allocation, &allocated_bytes, &active, &active_bytes, &requested_bytes, &segment};
  }
};

}  // namespace cudamem::torch_bridge
