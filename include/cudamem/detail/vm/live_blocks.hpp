// cudamem/detail/vm/live_blocks.hpp — the blocks a vm_resource has handed out, and the two
// moves between them and free memory: taking the place best fit found (carved out of its free
// range, made ready in stream order for the request's stream) and freeing a block (its range
// back among the free ranges, tagged with the stream it was freed on).
//
//   detail::vm_live_blocks blocks{layer, config, free, handles};
//   void* p = blocks.take_recent(request, bytes, stream, /*sync=*/false);  // kept aside, or
//   if (!p) p = blocks.take_fit(request, bytes, stream, false);  // nullptr: none fits
//   blocks.free(address, bytes, stream, false);   // a bad free goes to the error handler
//   void* q = blocks.take_fit(request, bytes, stream, false, /*mark=*/1);  // an owner's mark
//   blocks.free_marked(address, bytes, stream, false, 1);  // only if it carries that mark
//   vm_block_handles h = blocks.handles_of(address);  // for export (vm_ipc.hpp)
//   blocks.flush_recent();   // the blocks kept aside back among the free ranges (see below)
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
// - Recent frees (vm_resource_options::recent_frees; recent_frees.hpp says why): a freed block
//   of whole handles is kept aside as it is, its record flagged `recent`, and take_recent gives
//   it to the next request of its size that may have it without a wait (vm_resource asks it
//   before take_fit). Kept while the blocks kept hold at most 1/16 of what is mapped (the
//   oldest go back to make room) and the resource may still grow (options.hpp says why both).
//   Kept aside, it is free: not in used_bytes(), not in count(), not live to a free (a second
//   free of it is a bad free) nor to handles_of. Its free is recorded by the layer as any other
//   (an event on its stream). What reads or reshapes the free ranges — growth, compaction and
//   failure once placement found nothing, release, trim, statistics, growth ahead — calls
//   flush_recent() first (vm_resource does, at the top of each), and then finds every free
//   byte among the free ranges, merged with its neighbours.
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
#include <cudamem/detail/vm/recent_frees.hpp>
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
  /// Keeps up to `recent` freed blocks aside (0: none). Throws std::bad_alloc.
  vm_live_blocks(vm_mapping_layer& layer, const vm_config& config, free_range_index& free,
                 handle_set& handles, std::size_t recent = 0)
      : layer_(layer), config_(config), free_(free), handles_(handles), recent_(recent) {}

  vm_live_blocks(const vm_live_blocks&) = delete;
  vm_live_blocks& operator=(const vm_live_blocks&) = delete;

  /// A block kept aside (see the header) that `r` may have without a wait: its size as
  /// placed, freed on `stream` or complete; nullptr when none is. The block carries `mark`.
  void* take_recent(const vm_request& r, std::size_t requested, cudaStream_t stream, bool sync,
                    std::uint8_t mark = 0) noexcept {
    if (!r.whole || recent_.empty()) {
      return nullptr;
    }
    const auto kept = recent_.take(vm_config::round_up(r.size, config_.handle), stream, sync);
    if (!kept) {
      return nullptr;
    }
    *static_cast<block*>(kept->record) = block{kept->bytes, requested, mark, true};
    count_used(kept->bytes, requested);
    ++recent_reuses_;
    return reinterpret_cast<void*>(kept->address);
  }

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
    spare_.insert(live_, fit->spot.start, block{bytes, requested, mark, r.whole});
    free_.carve(node, fit->spot.start, fit->spot.end);
    count_used(bytes, requested);
    return reinterpret_cast<void*>(fit->spot.start);
  }

  /// Puts every block kept aside back among the free ranges (merged with their neighbours),
  /// oldest first. True if there was any. Throws std::bad_alloc (a free range's record): the
  /// blocks not put back yet stay kept, still free.
  bool flush_recent() {
    if (recent_.empty()) {
      return false;
    }
    recent_.drain([this](const recent_free& f) { put_back(f); });
    return true;
  }

  /// Blocks kept aside now, and how many requests one has served.
  [[nodiscard]] std::size_t recent_count() const noexcept { return recent_.count(); }
  [[nodiscard]] std::size_t recent_reuses() const noexcept { return recent_reuses_; }

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
    if (it == live_.end() || it->second.recent) {
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
    if (it == live_.end() || it->second.mark != mark || it->second.recent) {
      return std::nullopt;
    }
    const std::size_t requested = it->second.requested;
    free_live(it, bytes, stream, sync);
    return requested;
  }

  /// The handles under the live block at `address`; std::invalid_argument if none starts
  /// there, or the resource is not exportable.
  [[nodiscard]] vm_block_handles handles_of(std::uintptr_t address) const {
    require_exportable("block_handles");
    const auto live = live_.find(address);
    if (live == live_.end() || live->second.recent) {
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
  /// std::invalid_argument if any of it is not mapped, or the resource is not exportable.
  [[nodiscard]] vm_block_handles handles_covering(std::uintptr_t address, std::size_t bytes) const {
    require_exportable("handles_covering");
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

  [[nodiscard]] std::size_t count() const noexcept { return live_.size() - recent_.count(); }
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
    bool whole;             ///< placed as whole handles (may be kept aside once freed)
    bool recent = false;    ///< freed, kept aside (recent_frees): free, not live
  };
  using block_map = std::unordered_map<std::uintptr_t, block>;

  void require_exportable(const char* who) const {
    if (!config_.exportable) {
      throw std::invalid_argument(std::string("cudamem::vm_resource::") + who +
                                  ": the resource was not made exportable "
                                  "(vm_resource_options::exportable)");
    }
  }

  /// Frees the live block at `it` (asked to free `bytes` of it: another size is reported, and
  /// the block freed as placed).
  void free_live(block_map::iterator it, std::size_t bytes, cudaStream_t stream, bool sync) {
    const std::uintptr_t address = it->first;
    const block b = it->second;
    const bool as_allocated = vm_config::round_up(bytes, config_.granule) ==
                              vm_config::round_up(b.requested, config_.granule);
    if (!as_allocated) {
      report_problem("vm_resource: deallocate with " + std::to_string(bytes) +
                     " bytes of a range allocated with " + std::to_string(b.requested) +
                     "; freeing the allocated range");
    }
    // Kept aside: a block of whole handles freed with its size, while the blocks kept hold at
    // most a share of what is mapped (options.hpp: recent_frees_share says why).
    const std::size_t most = handles_.mapped_bytes / recent_frees_share;
    const bool keep = b.whole && as_allocated && recent_.capacity() != 0 && b.bytes <= most &&
                      !handles_.device_full &&
                      handles_.mapped_bytes + config_.handle <= config_.limit;
    while (keep && (recent_.full() || recent_.bytes() + b.bytes > most)) {
      // Room first: the oldest go back (throws for lack of host memory: this block stays).
      put_back(recent_.oldest());
      recent_.drop_oldest();
    }
    if (!sync) {
      layer_.record_free(stream, address, b.bytes);  // throws: the range stays live
    }
    used_bytes_ -= b.bytes;
    requested_bytes_ -= b.requested;
    if (keep) {
      it->second.recent = true;
      recent_.put({address, b.bytes, stream, sync, &it->second});
      return;
    }
    spare_.erase(live_, it);  // its node records the next block: no allocation
    free_.insert(address, {b.bytes, stream, sync});
  }

  /// A block kept aside goes back among the free ranges; its record goes (throws
  /// std::bad_alloc for the free range's record: nothing changed).
  void put_back(const recent_free& f) {
    free_.insert(f.address, {f.bytes, f.stream, f.complete});
    spare_.erase(live_, live_.find(f.address));
  }

  void count_used(std::size_t bytes, std::size_t requested) noexcept {
    used_bytes_ += bytes;
    requested_bytes_ += requested;
    peak_used_bytes_ = std::max(peak_used_bytes_, used_bytes_);
  }

  vm_mapping_layer& layer_;
  const vm_config& config_;
  free_range_index& free_;
  handle_set& handles_;
  block_map live_;
  spare_nodes<block_map> spare_;  ///< records of freed blocks, for the next ones
  recent_frees recent_;           ///< freed blocks kept aside (their records stay in live_)
  std::size_t recent_reuses_ = 0;
  std::size_t used_bytes_ = 0;
  std::size_t requested_bytes_ = 0;
  std::size_t peak_used_bytes_ = 0;
};

}  // namespace cudamem::detail
