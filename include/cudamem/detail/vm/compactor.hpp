// cudamem/detail/vm/compactor.hpp — how vm_resource makes room when no free range fits:
// creating handles, then recycling idle ones to the frontier (a compaction); and giving memory
// back.
//
//   vm_compactor compactor{layer, config, free, handles, space};
//   std::string cause;
//   if (!compactor.make_room(needed, whole, cause, merge_neighbours)) { ... cause says why ... }
//   compactor.release_idle();                   // release(): idle handles go to the driver
//
// What it owns: the choices that cost driver calls, and the call counts that show them.
// - Growth first, while the device (and `physical_limit`) has room: physical memory in handles
//   of `handle_bytes`, at least `growth_bytes` per growth (fewer, larger batches). A handle is
//   created once; a recycled one would be moved again at the next shortfall, and each move
//   costs the driver ~34 µs (a cuMemMap and the handle's share of cuMemSetAccess, which is
//   paid per handle, not per byte: bench_vmm_driver). Every handle is `handle_bytes`, the
//   last one too: the device's last part-handle stays with the driver, so that a free run of
//   k handles holds the same blocks wherever it lies and however often it was reused (a
//   smaller handle inside a run would change how many handles a block spans: the reason a
//   second run of a trace used to strand more than the first). `physical_limit` bounds the
//   footprint: past it, recycling only.
// - Then, once growth cannot give what is missing, neighbours freed on different streams that
//   together hold the request are merged by a host wait (vm_resource decides which: the
//   `merge_neighbours` callable), and nothing moves.
// - Then recycling, and only what is missing. Handles that lie wholly in free memory are
//   mapped again at the frontier, next to each other and to the free range already there, so
//   they become one contiguous free range. Only as many as the request lacks are moved, from
//   the smallest free runs first: a large free run serves later requests where it is, for
//   nothing. The host waits first for every stream whose frees cover the handles moved, but
//   the request's own (the legacy stream too): stream order puts the request after its frees,
//   and the range keeps its tag (make_room says when). Once the device has said "full",
//   recycling comes first, and the device is probed (one create) only for what it cannot give.
// - keep_free_bytes (0 by default): while growth would leave the device less free than that,
//   recycling comes first too, and only what it cannot give is created (into the reserve), so
//   the footprint stays near what is in use and the rest of the process keeps the reserve
//   (vm_resource_options::keep_free_bytes says why). A growth never rounds up into it; under
//   no_growth_into_reserve_scope (config.hpp) a request does not grow into it at all.
// - Everything new is mapped at the frontier with one cuMemSetAccess per batch. A failure
//   half-way undoes the batch: new mappings go, fresh handles go back, recycled ones return
//   to where they were.
// - Address space: when the active reservation lacks room, another is reserved; only past
//   `reservations_before_sweep` of them are the stale aliases unmapped (after a host wait).
// - Growth ahead (vm_resource_options::grow_ahead_bytes): the same fresh handles, made by the
//   growth thread before a request needs them (plan_ahead, make_ahead, publish_ahead), above
//   a floor of free memory (grow_ahead_floor_bytes). Whole handles free at the frontier are
//   held ahead of need: release_tail gives them back when another resource of the process
//   needs the device (detail/held_ahead.hpp) or on trim(); growth ahead then waits until the
//   resource grows for a request of its own.
//
// Not thread-safe: vm_resource's mutex guards it and every part it works on, but make_ahead,
// which calls only the layer (beside other threads' record_free and the like) and touches only
// its batch. Growth-ahead members: detail/vm/grow_ahead.hpp; sizes, counts: config.hpp.
#pragma once

#include <cudamem/detail/vm/address_space.hpp>
#include <cudamem/detail/vm/config.hpp>
#include <cudamem/detail/vm/free_ranges.hpp>
#include <cudamem/detail/vm/handle_set.hpp>
#include <cudamem/detail/vm/mapping.hpp>
#include <cudamem/error.hpp>
#include <cudamem/out_of_memory.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <optional>
#include <string>
#include <vector>

namespace cudamem::detail {

class vm_compactor {
 public:
  vm_compactor(vm_mapping_layer& layer, const vm_config& config, free_range_index& free,
               handle_set& handles, address_space& space) noexcept
      : layer_(layer), config_(config), free_(free), handles_(handles), space_(space) {}

  [[nodiscard]] const vm_call_counts& counts() const noexcept { return counts_; }

  /// Bytes of whole handles lying in free memory: what recycling could move (stats).
  [[nodiscard]] std::size_t recyclable_bytes() const {
    std::size_t total = 0;
    free_.for_each_run([&](std::uintptr_t begin, std::uintptr_t end) {
      total += handles_.bytes_inside(begin, end);
    });
    return total;
  }

  /// Makes a free range of at least `needed` bytes at the frontier (`whole`: for a block of
  /// whole handles, which starts at a handle's start): creates handles while the device has
  /// room; when that falls short, first calls `merge_neighbours()` (vm_resource: adjacent
  /// ranges freed on different streams, merged by a host wait; true if they now hold the
  /// request, and then nothing is recycled), then recycles idle handles. False (with `cause`,
  /// nothing changed) when even that is not enough. Throws what the layer throws (nothing
  /// changed then either). `requester`: the request's stream (placement.hpp's ordered_on:
  /// none when synchronous; the legacy stream 0 is one). Its recycled frees need no host wait
  /// (which drains the queue): stream order puts the request after them, the new mapping is an
  /// alias that work through the old one never sees, and the frontier range keeps the tag
  /// (others wait on the device).
  template <class MergeNeighbours>
  bool make_room(std::size_t needed, bool whole, std::string& cause,
                 MergeNeighbours&& merge_neighbours,
                 std::optional<cudaStream_t> requester = std::nullopt) {
    ahead_held_back_ = false;  // the resource grows for a request: growth ahead may follow it
    const auto usable_at_frontier = [&] {
      const auto tail = free_.ending_at(space_.frontier());
      if (tail == free_.end()) {
        return std::size_t{0};
      }
      const auto first = whole ? handles_.first_from(tail->first) : handles_.end();
      const std::uintptr_t start =
          !whole ? tail->first : (first == handles_.end() ? space_.frontier() : first->first);
      return static_cast<std::size_t>(space_.frontier() - start);
    };
    std::size_t have = usable_at_frontier();
    // Room for the worst case at the frontier: what is missing, recycled with up to a handle
    // to spare, or a whole growth created.
    const std::size_t room =
        needed + vm_config::round_up(config_.growth, config_.handle) + 2 * config_.handle;
    if (space_.room() < room) {
      drop_empty_reservations();
      if (!handles_.stale.empty() && space_.count() >= config_.reservations_before_sweep) {
        // Address space is cheap, but not endless: past the limit, the stale aliases go
        // (a host wait and one cuMemUnmap each). Below it, a fresh reservation is cheaper.
        wait_and_unmap_stale();
        drop_empty_reservations();
      }
      if (space_.room() < room) {
        drop_empty_reservations();
        space_.reserve(layer_, std::max(space_.reservation_bytes(),
                                        vm_config::round_up(room, config_.granule)));
      }
      have = usable_at_frontier();
    }
    const std::size_t missing =
        vm_config::round_up(needed > have ? needed - have : 1, config_.granule);
    // Growth first while the device has room above keep_free; once it has said "full", or
    // growth would take it below keep_free, recycling first, and growth (or a probe of the
    // device) only for what recycling cannot give (see the header).
    std::vector<moved_handle> all;
    std::size_t created = 0;
    std::vector<recyclable_run> runs;
    std::size_t recyclable = 0;
    const std::size_t growable = handles_.device_full ? 0 : growable_bytes();
    const bool growth_first = !handles_.device_full && growable >= missing;
    growth_held_back = growth_held_back || !growth_first;  // config.hpp says who asks
    try {
      if (growth_first) {
        created = create_handles(missing, all, cause, growable);
      }
      if (created < missing && merge_neighbours()) {
        map_at_frontier(all, created);  // what growth gave stays free at the frontier
        return true;
      }
      if (created < missing) {
        recyclable = find_recyclable(missing - created, runs);
        if (!growth_first && recyclable < missing &&
            (!growth_into_reserve_refused || growable_bytes() >= missing - recyclable)) {
          created = create_handles(missing - recyclable, all, cause, 0);  // only what is missing
        }
      }
    } catch (...) {
      release_fresh(all);
      throw;
    }
    if (created + recyclable < missing) {
      release_fresh(all);
      cause += " (" + format_bytes(recyclable) + " recyclable, " + format_bytes(have) +
               " free at the frontier, " + format_bytes(free_bytes_held()) +
               " free in all; recycling and growth " +
               (growth_into_reserve_refused ? "above keep_free tried)" : "both tried)");
      return false;
    }
    // Recycle only what growth did not give.
    std::optional<cudaStream_t> carried;  // whose pending frees the frontier range keeps
    if (missing > created) {
      // The requester's frees may stay pending if the new range merges with the frontier's.
      const auto tail = free_.ending_at(space_.frontier());
      const bool may_carry = requester && (tail == free_.end() || tail->second.complete ||
                                           tail->second.stream == *requester);
      std::vector<moved_handle> recycled;
      try {
        recycled = take_recyclable(std::move(runs), missing - created,
                                   may_carry ? requester : std::nullopt, &carried);
        ++counts_.compactions;
        if (!growth_first && !handles_.device_full) {
          ++counts_.kept_free_compactions;  // the device had room: keep_free chose this
        }
        // Room first, so recording the aliases below cannot throw once mapped. Geometric: an
        // exact reserve copies the list each compaction (quadratic).
        const std::size_t aliases = handles_.stale.size() + recycled.size();
        if (aliases > handles_.stale.capacity()) {
          handles_.stale.reserve(std::max(aliases, 2 * handles_.stale.capacity()));
        }
        all.reserve(all.size() + recycled.size());
      } catch (...) {
        undo_mapping(recycled, 0, carried);  // puts recycled handles back where they were
        release_fresh(all);
        throw;
      }
      for (const moved_handle& h : recycled) {
        handles_.stale.push_back({h.old_address, h.bytes});
        all.push_back(h);
      }
    }
    map_at_frontier(all, created, carried);
    return true;
  }

  // --- growth ahead of need (vm_resource_options::grow_ahead_bytes; growth_thread.hpp) -------
  // Defined in detail/vm/grow_ahead.hpp. A batch of fresh handles for the frontier, made in
  // three parts so that the driver's calls run with no lock held: plan_ahead (under
  // vm_resource's mutex: how many, and where: the frontier, which nobody else maps at until
  // the batch is published, because every other path that maps or gives address space back
  // waits for the batch first), make_ahead (no lock: cuMemCreate, cuMemMap, cuMemSetAccess,
  // and nothing else), publish_ahead (under the mutex: the batch becomes free memory at the
  // frontier, exactly as a growth by make_room would have left it). A failure in any part
  // leaves nothing made.

  /// A batch of handles made ahead; see above.
  struct ahead_batch {
    std::uintptr_t start = 0;        ///< the frontier when it was planned
    std::size_t handles = 0;         ///< how many to make
    handle_set::map_type made;       ///< made, mapped and accessible, by address
    std::size_t mapped = 0;          ///< their bytes
    bool device_full = false;        ///< a create said "out of memory"
    bool at_floor = false;           ///< fewer made: the device is at grow_ahead_floor_bytes
    vm_call_counts calls;            ///< what the driver was asked, counted at publish
    std::exception_ptr error;        ///< a driver call failed (nothing is left made)
  };

  /// The free memory to keep at the frontier: a quarter of what is held, at least a handle,
  /// at most `most` (grow_ahead_bytes). Geometric, as a vector grows: a small footprint holds
  /// little more than it uses, and a fill of the device overlaps the driver from early on.
  [[nodiscard]] inline std::size_t headroom(std::size_t most) const noexcept;

  /// Whether less than the headroom lies free at the frontier while the device (and the limit)
  /// has room for another handle and growth ahead is not held back (by the floor, or after
  /// giving memory back: until make_room grows for a request): the test after an allocation,
  /// before waking the thread.
  [[nodiscard]] inline bool wants_ahead(std::size_t most);

  /// Whether growth ahead waits for the resource's next growth of its own (see wants_ahead).
  [[nodiscard]] bool ahead_held_back() const noexcept { return ahead_held_back_; }

  /// Bytes of the whole handles lying in the free range that ends at the frontier: memory
  /// mapped ahead of need (by the growth thread, or the rest of a growth) that nothing uses.
  [[nodiscard]] inline std::size_t tail_bytes() const;

  /// Gives back the whole handles of the free range that ends at the frontier (tail_bytes):
  /// waits on the host for frees pending on them (and, if recycling left stale aliases, for
  /// every free, to unmap those first: a released handle's memory is the device's again only
  /// once its last mapping is gone), unmaps and releases them, and moves the frontier back to
  /// where they began. Growth ahead then waits for the next growth of the resource's own.
  /// Returns the bytes given back.
  inline std::size_t release_tail();

  /// The next batch: enough handles to bring the free memory at the frontier up to the
  /// headroom, a quarter of it (or a growth, if more) at a time: few cuMemSetAccess calls,
  /// and a thread waiting for the batch waits for little. nullopt when nothing is wanted, or
  /// the device, the limit or the address space has no room (the allocating path's cases).
  [[nodiscard]] inline std::optional<ahead_batch> plan_ahead(std::size_t most);

  /// Makes the batch: creates its handles (fewer when the device says no, or when more would
  /// leave it less free than the floor: one cudaMemGetInfo per batch), maps them side by side
  /// from its start and gives access with one cuMemSetAccess. Calls the layer and nothing
  /// else: no lock is held. A failure undoes what it made and is kept in `b.error`.
  inline void make_ahead(ahead_batch& b) noexcept;

  /// Adds the batch's calls to the counts and its memory to the frontier as one free range;
  /// rethrows the batch's error, if it had one, once its counts are in. A failure here (no
  /// host memory for the free range's record) undoes the batch and throws; nothing changed.
  inline void publish_ahead(ahead_batch& b);

  /// release(): waits for every recorded free, unmaps every stale alias, and gives every
  /// handle lying wholly in free memory back to the driver; returns the bytes given back.
  std::size_t release_idle() {
    wait_and_unmap_stale();
    std::size_t released = 0;
    for (const moved_handle& h : take_recyclable(recyclable_runs(false))) {
      layer_.unmap(h.old_address, h.bytes);
      ++counts_.unmaps;
      layer_.release(h.handle);
      released += h.bytes;
    }
    handles_.mapped_bytes -= released;
    handles_.device_full = false;
    drop_empty_reservations();
    return released;
  }

  /// Destruction: waits for every recorded free, then unmaps and releases everything.
  void release_all() noexcept {
    layer_.wait_for_all_frees();
    for (const vm_alias& m : handles_.stale) {
      layer_.unmap(m.address, m.bytes);
    }
    for (const auto& [address, h] : handles_.all()) {
      layer_.unmap(address, h.bytes);
      layer_.release(h.handle);
    }
    space_.free_all(layer_);
  }

 private:
  /// A handle on its way to the frontier: freshly created (old_address 0) or recycled.
  struct moved_handle {
    vm_handle handle;
    std::size_t bytes;
    std::uintptr_t old_address;  ///< 0: freshly created, never mapped
  };

  /// A maximal run of free memory and the bytes of the handles lying wholly inside it: what a
  /// compaction may recycle from it.
  struct recyclable_run {
    std::uintptr_t begin;
    std::uintptr_t end;
    std::size_t bytes;
  };

  /// Bytes of the free range that ends at the frontier (0 if none does).
  [[nodiscard]] std::size_t free_at_frontier() {
    const auto tail = free_.ending_at(space_.frontier());
    return tail == free_.end() ? 0 : tail->second.bytes;
  }

  [[nodiscard]] std::size_t free_bytes_held() const {
    std::size_t total = 0;
    free_.for_each_run([&](std::uintptr_t begin, std::uintptr_t end) { total += end - begin; });
    return total;
  }

  [[nodiscard]] static std::size_t total_bytes(const std::vector<recyclable_run>& runs) noexcept {
    std::size_t total = 0;
    for (const recyclable_run& r : runs) {
      total += r.bytes;
    }
    return total;
  }

  /// Maps `all` (fresh handles, `created` bytes of them, and recycled ones) side by side at
  /// the frontier with one cuMemSetAccess, as one free range. On a failure the batch is
  /// undone (see undo_mapping) and the error rethrown. Nothing to map: nothing happens.
  /// `pending_on`: a stream whose frees the recycled handles carry (their range keeps its
  /// tag); none: everything mapped is idle.
  void map_at_frontier(const std::vector<moved_handle>& all, std::size_t created,
                       const std::optional<cudaStream_t>& pending_on = std::nullopt) {
    if (all.empty()) {
      return;
    }
    const std::uintptr_t start = space_.frontier();
    std::size_t mapped = 0;
    try {
      for (const moved_handle& h : all) {
        layer_.map(start + mapped, h.bytes, h.handle);
        ++counts_.maps;
        mapped += h.bytes;
      }
      layer_.set_access(start, mapped);
      ++counts_.access_calls;
    } catch (...) {
      undo_mapping(all, mapped, pending_on);
      throw;
    }
    std::size_t offset = 0;
    for (const moved_handle& h : all) {
      handles_.add(start + offset, mapped_handle{h.handle, h.bytes});
      offset += h.bytes;
    }
    handles_.mapped_bytes += created;
    space_.advance(mapped);
    free_.insert(start, {mapped, pending_on.value_or(nullptr), !pending_on});
  }

  /// What growth may create without taking the device below keep_free_bytes: unbounded when
  /// that is 0 or the device does not say how much it has free (one cudaMemGetInfo).
  [[nodiscard]] std::size_t growable_bytes() const noexcept {
    if (config_.keep_free == 0) {
      return ~std::size_t{0};
    }
    const std::optional<std::size_t> free = layer_.device_free();
    if (!free) {
      return ~std::size_t{0};
    }
    return *free > config_.keep_free ? *free - config_.keep_free : 0;
  }

  /// Creates handles for at least `required` bytes into `out`; returns the bytes created
  /// (less than required, with `cause`, when the device or the limit says no). Every handle
  /// is `handle` bytes: then any free run of k handles holds the same blocks wherever it lies,
  /// and a run that has been freed and reused many times places a block exactly as a fresh
  /// one would (a smaller handle in the middle of a run would change how many handles a
  /// block spans). So the device's last part-handle is left to the driver. A growth creates
  /// at least `growth` bytes while the device gives them and `spare` bytes (growable_bytes)
  /// allow; make_room passes 0 once the device has said "full" or growth would cut into
  /// keep_free, and then only what is required is created (once full, usually one failing
  /// call: the probe).
  std::size_t create_handles(std::size_t required, std::vector<moved_handle>& out,
                             std::string& cause, std::size_t spare) {
    const std::size_t handle = config_.handle;
    const std::size_t growth =
        std::min(vm_config::round_up(config_.growth, handle), spare / handle * handle);
    const std::size_t wanted =
        required == 0 ? 0 : std::max(vm_config::round_up(required, handle), growth);
    std::size_t created = 0;
    while (created < wanted) {
      if (handles_.mapped_bytes + created + handle > config_.limit) {
        if (created < required) {
          cause = "the physical limit (" + format_bytes(config_.limit) + ") is reached";
        }
        break;
      }
      out.reserve(out.size() + 1);  // so the push below cannot throw and leak the handle
      const auto h = layer_.create(handle);
      handles_.device_full = !h;
      if (!h) {
        if (created < required) {
          cause = "the device has no physical memory left";
        }
        break;
      }
      out.push_back({*h, handle, 0});
      created += handle;
      ++counts_.handles_created;
    }
    return created;
  }

  /// Free runs whose whole handles add up to `wanted` bytes, into `runs`: the smallest free
  /// ranges first, just enough (a short walk); only if they do not add up, every free run,
  /// exactly (a walk of the whole index). Returns their bytes (less than wanted when there
  /// are not enough).
  std::size_t find_recyclable(std::size_t wanted, std::vector<recyclable_run>& runs) {
    runs = smallest_recyclable(wanted);
    std::size_t recyclable = total_bytes(runs);
    if (recyclable < wanted) {
      runs = recyclable_runs(true);
      recyclable = total_bytes(runs);
    }
    return recyclable;
  }

  /// Every free run holding a whole handle, in address order (one walk of the free ranges).
  /// With `keep_tail`, the free range at the frontier is left out: it is already where a
  /// compaction puts things.
  [[nodiscard]] std::vector<recyclable_run> recyclable_runs(bool keep_tail) {
    const auto tail = keep_tail ? free_.ending_at(space_.frontier()) : free_.end();
    const std::uintptr_t tail_start = tail != free_.end() ? tail->first : 0;
    std::vector<recyclable_run> runs;
    free_.for_each_run([&](std::uintptr_t begin, std::uintptr_t end) {
      if (tail_start != 0 && end == space_.frontier()) {
        end = tail_start;
      }
      if (const std::size_t bytes = handles_.bytes_inside(begin, end); bytes != 0) {
        runs.push_back({begin, end, bytes});
      }
    });
    return runs;
  }

  /// Free ranges holding whole handles, smallest first, until their handles add up to
  /// `wanted` bytes (fewer if there are not enough); the frontier's tail is left out. Ranges
  /// smaller than a handle hold none and are not looked at.
  [[nodiscard]] std::vector<recyclable_run> smallest_recyclable(std::size_t wanted) {
    const auto tail = free_.ending_at(space_.frontier());
    const std::uintptr_t tail_start = tail != free_.end() ? tail->first : 0;
    std::vector<recyclable_run> runs;
    std::size_t total = 0;
    for (auto it = free_.smallest_from(config_.handle); it != free_.size_end() && total < wanted;
         ++it) {
      const std::uintptr_t begin = it->second;
      if (begin == tail_start) {
        continue;
      }
      const std::uintptr_t end = begin + it->first;
      if (const std::size_t bytes = handles_.bytes_inside(begin, end); bytes != 0) {
        runs.push_back({begin, end, bytes});
        total += bytes;
      }
    }
    return runs;
  }

  /// Takes handles of `runs` out of the index, at least `wanted` bytes (all by default),
  /// smallest runs first, cutting them out of the free ranges (remnants keep their tags). The
  /// host waits for every stream whose frees cover them but `own` (if not null; then their
  /// frees on `own` stay pending, and `*carried` says so): after this, the rest is idle.
  std::vector<moved_handle> take_recyclable(std::vector<recyclable_run> runs,
                                            std::size_t wanted = ~std::size_t{0},
                                            std::optional<cudaStream_t> own = std::nullopt,
                                            std::optional<cudaStream_t>* carried = nullptr) {
    if (wanted < total_bytes(runs)) {
      std::stable_sort(runs.begin(), runs.end(),
                       [](const recyclable_run& a, const recyclable_run& b) {
                         return a.end - a.begin < b.end - b.begin;
                       });
    }
    std::vector<moved_handle> out;
    std::size_t taken = 0;
    for (const recyclable_run& r : runs) {
      if (taken >= wanted) {
        break;
      }
      handles_.for_each_inside(r.begin, r.end, [&](std::uintptr_t address, const mapped_handle& h) {
        if (taken < wanted) {
          out.push_back({h.handle, h.bytes, address});
          taken += h.bytes;
        }
      });
    }
    std::vector<cudaStream_t> pending;
    for (const moved_handle& t : out) {
      free_.cut(t.old_address, t.bytes, pending);
      handles_.erase(t.old_address);
    }
    for (cudaStream_t s : pending) {
      if (own && s == *own) {
        *carried = own;  // the request on `own` is ordered after these frees by the stream
        continue;
      }
      layer_.wait_for_free(s);  // recycled memory must be idle wherever it is mapped next
      free_.mark_complete(s);   // and so is everything else freed on s
    }
    return out;
  }

  void release_fresh(const std::vector<moved_handle>& fresh) noexcept {
    for (const moved_handle& h : fresh) {
      if (h.old_address == 0) {
        layer_.release(h.handle);
      }
    }
  }

  /// A map or set_access failed: the new mappings go, fresh handles go back, recycled ones
  /// return to their old addresses (still mapped there) as free memory. Recycled frees still
  /// pending on `pending_on` are waited for first: even an unused alias is unmapped only once
  /// no work can touch its memory (a rare path). If that wait fails they stay pending.
  void undo_mapping(const std::vector<moved_handle>& all, std::size_t mapped,
                    const std::optional<cudaStream_t>& pending_on = std::nullopt) noexcept {
    bool pending = pending_on.has_value();
    const cudaStream_t freed_on = pending_on.value_or(nullptr);
    if (pending) {
      try {
        layer_.wait_for_free(freed_on);
        free_.mark_complete(freed_on);
        pending = false;
      } catch (...) {
      }
    }
    std::size_t offset = 0;
    for (const moved_handle& h : all) {
      if (offset >= mapped) {
        break;
      }
      layer_.unmap(space_.frontier() + offset, h.bytes);  // never used: nothing in flight
      ++counts_.unmaps;
      offset += h.bytes;
    }
    release_fresh(all);
    for (const moved_handle& h : all) {
      if (h.old_address == 0) {
        continue;
      }
      std::erase_if(handles_.stale, [&](const vm_alias& m) { return m.address == h.old_address; });
      try {
        handles_.add(h.old_address, mapped_handle{h.handle, h.bytes});
        free_.insert(h.old_address, {h.bytes, freed_on, !pending});
      } catch (...) {  // out of host memory while undoing: the handle stays mapped, unused
      }
    }
  }

  /// Waits for every recorded free, then unmaps every stale alias.
  void wait_and_unmap_stale() noexcept {
    layer_.wait_for_all_frees();
    free_.mark_all_complete();
    for (const vm_alias& m : handles_.stale) {
      layer_.unmap(m.address, m.bytes);
      ++counts_.unmaps;
    }
    handles_.stale.clear();
  }

  void drop_empty_reservations() noexcept {
    space_.drop_empty(layer_, [this](std::uintptr_t base, std::size_t bytes) {
      return handles_.any_mapped_in(base, bytes);
    });
  }

  vm_mapping_layer& layer_;
  const vm_config& config_;
  free_range_index& free_;
  handle_set& handles_;
  address_space& space_;
  vm_call_counts counts_;
  bool ahead_held_back_ = false;  ///< see wants_ahead
};

}  // namespace cudamem::detail
