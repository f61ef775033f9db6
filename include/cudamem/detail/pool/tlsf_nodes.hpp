// cudamem/detail/pool/tlsf_nodes.hpp — the host-side nodes of tlsf_heap.hpp: a block (free or
// in use) and a region (one range given to the heap), the per-block tag and the search reach
// the heap's users pass in, and the storage that hands out nodes without calling new on the
// allocation path.
//
//   tlsf_node_store<tlsf_block<no_tag>> nodes;
//   nodes.reserve(2);                 // may throw std::bad_alloc: before anything changes
//   auto* b = nodes.take();           // cannot fail now: links cleared, the rest is the caller's
//   nodes.recycle(b);                 // back to the free list
//
// Why apart: what a node holds (and in which cache line) is read by pool_resource's cache as
// much as by the heap; the slabs are how the heap keeps splitting and merging free of the
// system allocator. Not thread-safe: the heap's owner locks.
#pragma once

#include <cudamem/detail/unique_owner.hpp>

#include <cassert>
#include <cstddef>
#include <cstdint>
#include <vector>

namespace cudamem::detail {

/// The empty per-block tag.
struct no_tag {
  void absorb(const no_tag& /*other*/) noexcept {}
};

/// How allocate() looks for a block its caller prefers: `classes` non-empty size classes at
/// or above the first whose every block fits, `depth` blocks of each; `only`: a preferred
/// block or none (nullptr); `within_twice`: never a preferred block more than twice the
/// request (or than the usual pick, when that is larger and `only` is off).
struct tlsf_reach {
  unsigned classes = 8;
  unsigned depth = 4;
  bool only = false;
  bool within_twice = true;
};

template <class Tag>
struct tlsf_region;

/// One block of a region: free or in use. Host-side only. The fields a user touches when it
/// reuses a block whole (pool_resource's cache) come first, in the first cache line.
template <class Tag>
struct alignas(64) tlsf_block {
  std::uintptr_t address = 0;
  std::size_t size = 0;
  /// Free for the heap's user while the block is in use (pool_resource: its block_cache).
  tlsf_block* next_cached = nullptr;
  tlsf_region<Tag>* region = nullptr;  ///< here, not below: a user that frees reads it at once
  bool free = false;
  bool cached = false;  ///< also the user's, like next_cached
  Tag tag{};
  tlsf_block* prev_phys = nullptr;  ///< the block just below in the same region, or nullptr
  tlsf_block* next_phys = nullptr;  ///< the block just above in the same region, or nullptr
  tlsf_block* prev_free = nullptr;  ///< size-class list links, meaningful while free
  tlsf_block* next_free = nullptr;
};

/// One contiguous range given to the heap.
template <class Tag>
struct tlsf_region {
  std::uintptr_t base = 0;
  std::size_t size = 0;
  tlsf_block<Tag>* first = nullptr;
  tlsf_block<Tag>* last = nullptr;
  tlsf_region* prev = nullptr;
  tlsf_region* next = nullptr;
  tlsf_region* prev_idle = nullptr;  ///< links in the heap's list of wholly free regions
  tlsf_region* next_idle = nullptr;
  std::uint32_t owner = 0;  ///< free for the user (pool_resource: which tier the region is in)
};

/// Nodes in slabs of 256 and a free list, so that splitting a block never calls new.
template <class Block>
class tlsf_node_store {
 public:
  /// Makes sure `count` nodes can be taken without allocating; throws std::bad_alloc (with
  /// nothing changed) when host memory runs out.
  void reserve(std::size_t count) {
    while (spare_count_ < count) {
      constexpr std::size_t slab_size = 256;
      slabs_.push_back(detail::make_unique_owner<Block[]>(slab_size));  // may throw: nothing changed yet
      for (std::size_t i = 0; i < slab_size; ++i) {
        recycle(&slabs_.back()[i]);
      }
    }
  }
  /// A spare node with its links cleared. The caller sets address, size, region and tag; the
  /// rest is left as it was (not `*b = Block{}`: zeroing all three cache lines of a node
  /// cost more than the split it is for).
  Block* take() noexcept {
    assert(spare_ != nullptr);
    Block* b = spare_;
    spare_ = b->next_free;
    --spare_count_;
    b->next_cached = nullptr;
    b->free = false;
    b->cached = false;
    b->prev_phys = nullptr;
    b->next_phys = nullptr;
    b->prev_free = nullptr;
    b->next_free = nullptr;
    return b;
  }
  void recycle(Block* b) noexcept {
    b->next_free = spare_;
    spare_ = b;
    ++spare_count_;
  }

 private:
  std::vector<detail::unique_owner<Block[]>> slabs_;
  Block* spare_ = nullptr;
  std::size_t spare_count_ = 0;
};

}  // namespace cudamem::detail
