// cudamem/detail/vm/live_blocks.hpp — the blocks a vm_resource has handed out, and the two
// moves between them and free memory: taking the place best fit found (carved out of its free
// range, made ready in stream order for the request's stream) and freeing a block (its range
// back among the free ranges, tagged with the stream it was freed on).
//
//   detail::vm_live_blocks blocks{layer, config, free, handles};
//   void* p = blocks.take_fit(request, bytes, stream, /*sync=*/false);  // nullptr: none fits
//   blocks.free(address, bytes, stream, false);   // a bad free goes to the error handler
//   void* q = blocks.take_fit(request, bytes, stream, false, /*mark=*/1);  // an owner's mark
//   blocks.free_marked(address, bytes, stream, false, 1);  // only if it carries that mark
//   vm_block_handles h = blocks.handles_of(address);  // for export (vm_ipc.hpp)
//
// What it owns: the record of each live block (its size as placed and what was asked: a free
// with another size is reported, and frees the block as placed), the bytes in use, asked for
// and the peak, and the stream-order rules of vm_resource's contract at the two moves:
// - A range freed on stream s and taken for stream t makes t wait for s's free (no host
//   wait); taken synchronously, the host waits, and everything freed on s is then idle.
// - Neighbours freed on different streams that together hold a request merge after the host
//   waits for their streams, all but the request's own (settle_run): cheaper than moving
//   handles, which would wait for them too.
// - A free on a stream is recorded by the layer first (an event on the stream); if that
//   fails, the block stays live: it may still be in use.
// - The records reuse the nodes of freed blocks (detail/spare_nodes.hpp): once warm, taking
//   and freeing allocates no host memory.
// - A block may carry its owner's mark (a byte, 0 by default): vm_pool_resource marks its
//   large blocks, so that it frees them without a record of its own and never frees one of its
//   pool's chunks (mark 0) for a large block (vm_resource::deallocate_marked says why).
//
// Part of vm_resource.hpp, which holds the lock around every call; where a block goes inside
// the free ranges is placement.hpp, making room when nothing fits is compactor.hpp.
#pragma once

#include <cudamem/detail/spare_nodes.hpp>
#include <cudamem/detail/vm/config.hpp>
#include <cudamem/detail/vm/free_ranges.hpp>
#include <cudamem/detail/vm/handle_set.hpp>
#include <cudamem/detail/vm/mapping.hpp>
#include <cudamem/detail/vm/options.hpp>
#include <cudamem/detail/vm/placement.hpp>
#include <cudamem/error.hpp>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <vector>

namespace cudamem::detail {

class vm_live_blocks {
 public:
  vm_live_blocks(vm_mapping_layer& layer, const vm_config& config, free_range_index& free,
                 handle_set& handles) noexcept
      : layer_(layer), config_(config), free_(free), handles_(handles) {}

  vm_live_blocks(const vm_live_blocks&) = delete;
  vm_live_blocks& operator=(const vm_live_blocks&) = delete;

  /// The best-fitting free range for `r` (placement.hpp), carved and made ready for `stream`
  /// (null with sync: for everyone); nullptr when none fits. Throws only for lack of host
  /// memory, before anything has changed. The block carries `mark` (see free_marked).
  void* take_fit(const vm_request& r, std::size_t requested, cudaStream_t stream, bool sync,
                 std::uint8_t mark = 0) {
    const auto fit = best_fit(free_, handles_, r, sync);
    if (!fit) {
      return nullptr;
    }
    auto node = free_.find(fit->range);
    if (!node->second.complete) {
      if (sync) {
        const cudaStream_t freed_on = node->second.stream;
        layer_.wait_for_free(freed_on);
        free_.mark_complete(freed_on);  // the host waited: all freed on it is idle, remnants too
        node = free_.containing(fit->spot.start);  // it may have merged with its neighbours
      } else if (node->second.stream != stream) {
        layer_.order_after_free(stream, node->second.stream);
      }
    }
    const std::size_t bytes = fit->spot.end - fit->spot.start;
    // May throw (no host memory): nothing has changed yet.
    spare_.insert(live_, fit->spot.start, block{bytes, requested, mark});
    free_.carve(node, fit->spot.start, fit->spot.end);
    used_bytes_ += bytes;
    requested_bytes_ += requested;
    peak_used_bytes_ = std::max(peak_used_bytes_, used_bytes_);
    return reinterpret_cast<void*>(fit->spot.start);
  }

  /// No free range holds `r`, growth cannot give it, but adjacent ranges freed on different
  /// streams may hold it together (placement.hpp, best_run): the host waits for their
  /// streams, all but one (the request's own, if it is one: stream order covers it), and they
  /// merge. True if they now hold it.
  bool settle_run(const vm_request& r, cudaStream_t stream, bool sync) {
    const auto run = best_run(free_, handles_, r);
    if (!run) {
      return false;
    }
    std::vector<cudaStream_t> pending = free_.pending_streams(run->start, run->end);
    if (!sync && !pending.empty()) {
      const auto own = std::find(pending.begin(), pending.end(), stream);
      pending.erase(own != pending.end() ? own : pending.end() - 1);  // ordered on the device
    }
    for (const cudaStream_t s : pending) {
      layer_.wait_for_free(s);
      free_.mark_complete(s);
    }
    return best_fit(free_, handles_, r).has_value();
  }

  /// Frees the block at `address`: a pointer that is not one goes to the error handler, and so
  /// does a size other than the allocation's (the block is freed as placed). Throws what the
  /// layer throws recording a stream's free (cuda_error: the block stays live) and for lack of
  /// host memory.
  void free(std::uintptr_t address, std::size_t bytes, cudaStream_t stream, bool sync) {
    const auto it = live_.find(address);
    if (it == live_.end()) {
      report_problem("vm_resource: deallocate of a pointer it did not allocate, or already freed");
      return;
    }
    free_live(it, bytes, stream, sync);
  }

  /// free() of a block taken with `mark`: the bytes it was asked with, once freed; nullopt,
  /// with nothing freed and nothing reported, when no live block starts at `address` or it
  /// carries another mark. Throws as free().
  std::optional<std::size_t> free_marked(std::uintptr_t address, std::size_t bytes,
                                         cudaStream_t stream, bool sync, std::uint8_t mark) {
    const auto it = live_.find(address);
    if (it == live_.end() || it->second.mark != mark) {
      return std::nullopt;
    }
    const std::size_t requested = it->second.requested;
    free_live(it, bytes, stream, sync);
    return requested;
  }

  /// The handles under the live block at `address`; std::invalid_argument if none starts
  /// there.
  [[nodiscard]] vm_block_handles handles_of(std::uintptr_t address) const {
    const auto live = live_.find(address);
    if (live == live_.end()) {
      throw std::invalid_argument(
          "cudamem::vm_resource::block_handles: not the start of a live block of this resource "
          "(a pointer it never gave, or one already freed)");
    }
    vm_block_handles out;
    out.address = address;
    out.bytes = live->second.bytes;
    out.requested = live->second.requested;
    out.offset = handles_.handles_under(address, out.bytes, out.handles);
    return out;
  }

  /// The handles under [address, address + bytes) of mapped memory (live or not);
  /// std::invalid_argument if any of it is not mapped.
  [[nodiscard]] vm_block_handles handles_covering(std::uintptr_t address, std::size_t bytes) const {
    vm_block_handles out;
    out.address = address;
    out.bytes = out.requested = bytes;
    const std::optional<std::size_t> offset = handles_.covering(address, bytes, out.handles);
    if (!offset) {
      throw std::invalid_argument("cudamem::vm_resource::handles_covering: the range is not in "
                                  "memory this resource has mapped");
    }
    out.offset = *offset;
    return out;
  }

  [[nodiscard]] std::size_t count() const noexcept { return live_.size(); }
  /// Bytes of the live blocks as placed (granule multiples), what their callers asked for,
  /// and the most ever placed at once.
  [[nodiscard]] std::size_t used_bytes() const noexcept { return used_bytes_; }
  [[nodiscard]] std::size_t requested_bytes() const noexcept { return requested_bytes_; }
  [[nodiscard]] std::size_t peak_used_bytes() const noexcept { return peak_used_bytes_; }

 private:
  struct block {
    std::size_t bytes;      ///< granule multiple
    std::size_t requested;  ///< what the caller asked for
    std::uint8_t mark;      ///< its owner's (take_fit), 0 by default
  };
  using block_map = std::unordered_map<std::uintptr_t, block>;

  /// Frees the live block at `it` (asked to free `bytes` of it: another size is reported, and
  /// the block freed as placed).
  void free_live(block_map::iterator it, std::size_t bytes, cudaStream_t stream, bool sync) {
    const std::uintptr_t address = it->first;
    const block b = it->second;
    if (vm_config::round_up(bytes, config_.granule) !=
        vm_config::round_up(b.requested, config_.granule)) {
      report_problem("vm_resource: deallocate with " + std::to_string(bytes) +
                     " bytes of a range allocated with " + std::to_string(b.requested) +
                     "; freeing the allocated range");
    }
    if (!sync) {
      layer_.record_free(stream, address, b.bytes);  // throws: the range stays live
    }
    spare_.erase(live_, it);  // its node records the next block: no allocation
    used_bytes_ -= b.bytes;
    requested_bytes_ -= b.requested;
    free_.insert(address, {b.bytes, stream, sync});
  }

  vm_mapping_layer& layer_;
  const vm_config& config_;
  free_range_index& free_;
  handle_set& handles_;
  block_map live_;
  spare_nodes<block_map> spare_;  ///< records of freed blocks, for the next ones
  std::size_t used_bytes_ = 0;
  std::size_t requested_bytes_ = 0;
  std::size_t peak_used_bytes_ = 0;
};

}  // namespace cudamem::detail
