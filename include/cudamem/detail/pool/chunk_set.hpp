// cudamem/detail/pool/chunk_set.hpp — the chunks pool_resource holds from its upstream: how it
// grows, what it does when the upstream says no, and how it gives memory back.
//
//   chunk_set chunks{upstream, policy};
//   void* p = chunks.grow_and_allocate(pool, shards, home, tier, bytes, size, alignment, &s);
//   pool_shard* owner = chunks.owner_of(address);     // a block freed by another thread
//   chunks.release_free(shards);                      // every wholly free chunk goes back
//
// What it owns
// - The directory: chunk base -> size and owning shard (a free from another thread finds the
//   block's shard through it), and the bytes held from the upstream.
// - Growth: the pool asks its upstream only when no free block fits. Requests up to the
//   small-block limit come from chunks of `small_chunk_size`; larger ones from chunks of
//   `growth_step`, or of the request's own size when it is larger. Before a new small chunk
//   is taken, wholly free large chunks go back upstream, so small chunks land where large
//   blocks were rather than between them. The pool never holds more than `maximum_size`.
// - The out-of-memory fallbacks, in order: ask again for just the request; release every
//   wholly free chunk and ask once more; look in every shard's free blocks, cutting any block
//   however large. Only then `out_of_memory`.
// - Giving back: release() returns every chunk in which nothing is allocated (exact, unlike a
//   cache that only empties wholly unused size classes). If returned memory was freed on a
//   stream and is not yet known complete, the device is synchronised first.
// - What compute-sanitizer sees (detail/nvtx.hpp): each chunk of device memory is registered
//   as an NVTX heap, each block handed out as a region of it (annotate_block) until it is
//   freed; so out-of-bounds accesses and use after free inside a chunk are reported as they
//   are for cudaMalloc'd memory. Decided at the first chunk; nothing is called with no tool.
// Upstream calls are serialised by one mutex, so the upstream need not be thread-safe.
#pragma once

#include <cudamem/detail/held_bytes.hpp>
#include <cudamem/detail/nvtx.hpp>
#include <cudamem/detail/pool/pool_shard.hpp>
#include <cudamem/detail/sync/atomic.hpp>
#include <cudamem/detail/sync/mutex.hpp>
#include <cudamem/detail/unique_owner.hpp>
#include <cudamem/error.hpp>
#include <cudamem/memory_resource.hpp>
#include <cudamem/out_of_memory.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <iterator>
#include <map>
#include <span>
#include <string>
#include <utility>
#include <vector>

namespace cudamem::detail {

class chunk_set {
 public:
  using shard_list = std::span<const detail::unique_owner<pool_shard>>;

  chunk_set(memory_resource& upstream, const pool_policy& policy) noexcept
      : upstream_(&upstream), policy_(&policy) {}
  chunk_set(const chunk_set&) = delete;
  chunk_set& operator=(const chunk_set&) = delete;

  [[nodiscard]] memory_resource& upstream() const noexcept { return *upstream_; }

  /// Registers the block [p, p + bytes) handed out with the tool (policy.annotates).
  [[gnu::noinline]] void annotate_block(void* p, std::size_t bytes) const {
    void* heap = nullptr;
    {
      const detail::shared_lock lock(directory_mutex_);
      auto it = directory_.upper_bound(reinterpret_cast<std::uintptr_t>(p));
      heap = it != directory_.begin() ? std::prev(it)->second.heap : nullptr;
    }
    memory_annotations::add_region(policy_->device, heap, p, bytes);
  }

  /// What the chunk set did since construction: chunks taken from and given back to the
  /// upstream, and device-wide synchronisations before a give-back (frees still pending).
  struct counts {
    std::uint64_t upstream_allocations = 0;
    std::uint64_t upstream_returns = 0;
    std::uint64_t device_syncs = 0;
  };
  [[nodiscard]] counts activity() const noexcept {
    return {upstream_allocations_.load(detail::memory_order_relaxed),
            upstream_returns_.load(detail::memory_order_relaxed),
            device_syncs_.load(detail::memory_order_relaxed)};
  }

  [[nodiscard]] std::size_t count() const {
    const detail::shared_lock lock(directory_mutex_);
    return directory_.size();
  }

  /// The most held from the upstream since construction or reset_peak_reserved().
  [[nodiscard]] std::size_t peak_reserved() {
    const detail::lock_guard lock(upstream_mutex_);
    return reserved_.peak();
  }
  void reset_peak_reserved() {
    const detail::lock_guard lock(upstream_mutex_);
    reserved_.reset_peak();
  }

  /// Every chunk held, as (base, size), by address.
  [[nodiscard]] std::vector<std::pair<std::uintptr_t, std::size_t>> ranges() const {
    const detail::shared_lock lock(directory_mutex_);
    std::vector<std::pair<std::uintptr_t, std::size_t>> out;
    out.reserve(directory_.size());
    for (const auto& [base, e] : directory_) {
      out.emplace_back(base, e.size);
    }
    return out;
  }

  /// The shard whose chunk holds `address`, or nullptr when no chunk does.
  [[nodiscard]] pool_shard* owner_of(std::uintptr_t address) const {
    const detail::shared_lock lock(directory_mutex_);
    auto it = directory_.upper_bound(address);
    if (it == directory_.begin()) {
      return nullptr;
    }
    --it;
    return address < it->first + it->second.size ? it->second.owner : nullptr;
  }

  /// Adds a chunk of `size` bytes from the upstream to `sh`'s tier `t` (caller holds sh's
  /// lock). False, with `cause` set, when the upstream or the maximum size says no.
  bool obtain(pool_shard& sh, pool_tier t, std::size_t size, std::string& cause) {
    const detail::lock_guard upstream_lock(upstream_mutex_);
    if (size > policy_->maximum_size - reserved_) {
      cause = "the pool's maximum size (" + format_bytes(policy_->maximum_size) +
              ") would be exceeded";
      return false;
    }
    void* p = nullptr;
    try {
      // The pool tries smaller chunks, a give-back, then reports from itself: the upstream's
      // own report would be thrown away (memory_report.hpp).
      const discarded_report_scope discarded{*upstream_};
      p = upstream_->allocate(size, pool_policy::granule);
    } catch (const out_of_memory&) {
      cause = "upstream " + std::string(upstream_->name()) + " could not supply " +
              format_bytes(size);
      return false;
    }
    try {
      const auto base = reinterpret_cast<std::uintptr_t>(p);
      {
        const detail::unique_lock lock(directory_mutex_);
        directory_.emplace(base, entry{size, &sh, nullptr});
      }
      try {
        sh.tiers[t].add_region(base, size, t);
      } catch (...) {
        const detail::unique_lock lock(directory_mutex_);
        directory_.erase(base);
        throw;
      }
    } catch (...) {
      upstream_->deallocate(p, size, pool_policy::granule);
      throw;
    }
    reserved_ += size;
    upstream_allocations_.fetch_add(1, detail::memory_order_relaxed);
    if (policy_->annotates) {  // the upstream allocated: the CUDA runtime is initialised
      void* heap = memory_annotations::add_heap(policy_->device, p, size,
                                                      "cudamem::pool_resource chunk");
      const detail::unique_lock lock(directory_mutex_);
      directory_.find(reinterpret_cast<std::uintptr_t>(p))->second.heap = heap;
    }
    return true;
  }

  /// The slow path of a request no shard's free blocks could serve: more memory from the
  /// upstream, with the fallbacks above, else `out_of_memory` (reported as `pool`'s). Takes
  /// the shards' locks itself. `bytes` as asked (for the report), `size` rounded.
  void* grow_and_allocate(const memory_resource& pool, shard_list shards, pool_shard& home,
                          pool_tier t, std::size_t bytes, std::size_t size,
                          std::size_t alignment, const stream_view* stream) {
    const std::size_t padding = alignment > pool_policy::granule ? alignment - pool_policy::granule : 0;
    const std::size_t needed = size + padding;
    const std::size_t preferred =
        std::max(needed, pool_policy::round_up(t == small_tier ? policy_->small_chunk_size
                                                               : policy_->growth_step));
    std::string cause;
    for (int attempt = 0; attempt < 3; ++attempt) {
      if (attempt == 1 && preferred == needed) {
        continue;  // the same request again would fail the same way
      }
      if (attempt == 2 && release_free(shards) == 0) {
        break;
      }
      const std::size_t chunk = attempt == 0 ? preferred : needed;
      if (attempt == 0 && t == small_tier) {
        // Make room where cached large chunks are, rather than beside them: a new small chunk
        // then lands where a first-fit upstream would put it, and cached large chunks do not
        // push small ones out between future large blocks. (Cheap when there are none.)
        release_free(shards, &home, large_tier);
      }
      const detail::lock_guard lock(home.mutex);
      if (obtain(home, t, chunk, cause)) {
        if (void* p = home.take(*policy_, t, size, alignment, stream)) {
          return p;
        }
      }
    }
    // The upstream is out: any free block anywhere in the pool will do.
    for (std::size_t i = 0; i < shards.size(); ++i) {
      pool_shard& sh = *shards[(pool_thread_slot() + i) & (shards.size() - 1)];
      const detail::lock_guard lock(sh.mutex);
      sh.flush_cache();
      for (pool_tier other : {t, t == small_tier ? large_tier : small_tier}) {
        if (void* p = sh.take(*policy_, other, size, alignment, stream, {.any_block = true})) {
          return p;
        }
      }
    }
    throw_out_of_memory(pool, bytes, alignment, "pool_resource: " + cause);
  }

  /// Returns the wholly free chunks (of shard `only` and tier `only_tier`, when given) to the
  /// upstream; returns their bytes. Takes the shards' locks itself.
  std::size_t release_free(shard_list shards, const pool_shard* only = nullptr,
                           int only_tier = -1) noexcept {
    std::vector<returned_chunk> chunks;
    try {
      for (const auto& sh : shards) {
        if (only != nullptr && sh.get() != only) {
          continue;
        }
        const detail::lock_guard lock(sh->mutex);
        sh->flush_cache();  // cached blocks may be all that keeps a chunk from being wholly free
        for (pool_heap& h : sh->tiers) {
          if (only_tier >= 0 && &h != &sh->tiers[only_tier]) {
            continue;
          }
          while (auto* r = h.first_idle_region()) {
            if (chunks.size() == chunks.capacity()) {  // geometric growth: many chunks at once
              chunks.reserve(2 * chunks.size() + 16);   // may throw: the region is still held
            }
            chunks.push_back({r->base, r->size, !r->first->tag.empty()});
            h.remove_region(r);
          }
        }
      }
    } catch (...) {  // out of host memory: return what was collected
    }
    // In address order: neighbours then merge one after another in the upstream's index.
    std::sort(chunks.begin(), chunks.end(),
              [](const returned_chunk& a, const returned_chunk& b) { return a.base < b.base; });
    return give_back(chunks);
  }

  /// Destruction: every chunk goes back, whatever is still allocated in it (blocks still
  /// allocated are reported to the error handler); the device is synchronised first when a
  /// free may still be in flight.
  void return_all(shard_list shards) noexcept {
    std::size_t leaked_blocks = 0;
    std::size_t leaked_bytes = 0;
    bool pending = false;
    for (const auto& sh : shards) {
      leaked_blocks += sh->blocks_in_use();
      leaked_bytes += sh->used;
      pending = pending || sh->ledger.owes_any();
    }
    if (leaked_blocks != 0) {
      report_problem("pool_resource destroyed with " + std::to_string(leaked_blocks) +
                     " block(s) (" + format_bytes(leaked_bytes) +
                     ") still allocated; their memory is returned to the upstream");
    }
    if ((pending || leaked_blocks != 0) && policy_->tracks_streams) {
      synchronize_reporting();
    }
    const detail::lock_guard upstream_lock(upstream_mutex_);
    for (const auto& [base, e] : directory_) {
      memory_annotations::remove_heap(policy_->device, e.heap);
      upstream_->deallocate(reinterpret_cast<void*>(base), e.size, pool_policy::granule);
    }
  }

 private:
  struct entry {
    std::size_t size;
    pool_shard* owner;
    void* heap;  ///< its NVTX heap; nullptr when not annotated
  };
  struct returned_chunk {
    std::uintptr_t base;
    std::size_t size;
    bool pending;  ///< a free in it may not be complete yet
  };

  std::size_t give_back(const std::vector<returned_chunk>& chunks) noexcept {
    std::size_t total = 0;
    if (std::any_of(chunks.begin(), chunks.end(),
                    [](const returned_chunk& c) { return c.pending; })) {
      synchronize_reporting();
    }
    const detail::lock_guard upstream_lock(upstream_mutex_);
    for (const returned_chunk& c : chunks) {
      {
        const detail::unique_lock lock(directory_mutex_);
        const auto it = directory_.find(c.base);
        memory_annotations::remove_heap(policy_->device, it->second.heap);
        directory_.erase(it);
      }
      upstream_->deallocate(reinterpret_cast<void*>(c.base), c.size, pool_policy::granule);
      reserved_ -= c.size;
      total += c.size;
      upstream_returns_.fetch_add(1, detail::memory_order_relaxed);
    }
    return total;
  }

  void synchronize_reporting() noexcept {
    device_syncs_.fetch_add(1, detail::memory_order_relaxed);
    try {
      policy_->events->synchronize_device(policy_->device);
    } catch (const cuda_error& e) {
      report_error(e.code(), "pool_resource: synchronising before returning memory");
    }
  }

  memory_resource* upstream_;
  const pool_policy* policy_;
  detail::mutex upstream_mutex_;
  held_bytes reserved_;  ///< held from the upstream, and its peak (guarded by upstream_mutex_)
  mutable detail::shared_mutex directory_mutex_;
  std::map<std::uintptr_t, entry> directory_;  ///< chunk base -> size and shard
  // Counts for pool_resource::stream_stats (relaxed: read for reports, never to decide).
  detail::atomic<std::uint64_t> upstream_allocations_{0};
  detail::atomic<std::uint64_t> upstream_returns_{0};
  detail::atomic<std::uint64_t> device_syncs_{0};
};

}  // namespace cudamem::detail
