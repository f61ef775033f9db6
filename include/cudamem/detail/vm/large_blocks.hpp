// cudamem/detail/vm/large_blocks.hpp — a vm_pool_resource's blocks of a handle or more: which
// resource each goes back to, and the bytes they hold.
//
//   detail::large_block_ledger large{source, vm, bulk};   // bulk: nullptr when there is none
//   void* p = large.marked()
//                 ? vm.allocate_marked(bytes, alignment, &stream, detail::large_block_ledger::mark)
//                 : source.allocate(bytes, alignment, stream);
//   large.record(p, bytes, /*bulk=*/false);  // std::bad_alloc: then give_back_unrecorded(p, ...)
//   large.give_back(p, bytes, alignment, &stream);        // null stream: the synchronous form
//   std::size_t in_use = large.used_bytes();
//
// Two ways to know, at a free, that a pointer is a large block and where it came from:
// - Marked, when the pool's source is its own vm_resource (the usual case): the vm_resource
//   that holds the block records it anyway, so it records it with the pool's mark too
//   (vm_resource::allocate_marked), and nothing else does. A free asks the bulk resource or
//   the other one to free a block with that mark. Why: a training step frees ~300 large blocks,
//   and when the framework's work between two calls has evicted the allocator's records, each
//   record a free touches is a cache miss or two (PyTorch's training loop; bench_capi_replay_cost
//   --touch-kib measures it). A second record here was ~25 of the ~170 misses of an
//   allocation and a free of a large block (valgrind's cache simulation of a recorded step).
// - Recorded, when an adaptor (options.upstream_adaptor) or cudaMalloc (under
//   compute-sanitizer) is between: their blocks carry no mark, so a map here holds each one
//   (address -> bytes, and whether the bulk resource holds it).
// Either way a pointer that is not one of its large blocks (one of the pool's chunks, a block
// already freed, an interior pointer) is a bad free: reported once, nothing freed.
//
// Part of vm_pool_resource.hpp, which decides where a block comes from (pool_sources.hpp).
#pragma once

#include <cudamem/detail/spare_nodes.hpp>
#include <cudamem/detail/sync/mutex.hpp>
#include <cudamem/detail/usage_counter.hpp>
#include <cudamem/error.hpp>  // report_problem
#include <cudamem/memory_resource.hpp>
#include <cudamem/vm_resource.hpp>

#include <cstddef>
#include <cstdint>
#include <optional>
#include <unordered_map>
#include <utility>
#include <vector>

namespace cudamem::detail {

class large_block_ledger {
 public:
  /// The pool's vm_resource's mark for its large blocks (its chunks carry none).
  static constexpr std::uint8_t mark = 1;

  /// Large blocks from `source` (marked when it is `vm`) or from `bulk` (may be null).
  large_block_ledger(memory_resource& source, vm_resource& vm, vm_resource* bulk) noexcept
      : source_(source),
        vm_(vm),
        bulk_(bulk),
        bulk_handle_(bulk != nullptr ? bulk->handle_bytes() : 0),
        marked_(&source == &vm) {}

  large_block_ledger(const large_block_ledger&) = delete;
  large_block_ledger& operator=(const large_block_ledger&) = delete;

  /// Whether blocks are marked (allocate them with vm_resource::allocate_marked and `mark`).
  [[nodiscard]] bool marked() const noexcept { return marked_; }

  /// Whether a block of `bytes` is asked of the bulk resource first: a whole multiple of its
  /// handle. (Its handle size is kept here: reading it from the bulk resource's options, a
  /// cache line of their own, cost a miss on every large allocation and free.)
  [[nodiscard]] bool bulk_sized(std::size_t bytes) const noexcept {
    return bulk_handle_ != 0 && bytes % bulk_handle_ == 0;
  }

  /// Counts the block at `p`, just allocated (from the bulk resource if `bulk`); unmarked, also
  /// records it. Throws std::bad_alloc (no host memory for the record) having counted nothing.
  void record(void* p, std::size_t bytes, bool bulk) {
    if (!marked_) {
      const detail::lock_guard lock(mutex_);
      spare_.insert(recorded_, reinterpret_cast<std::uintptr_t>(p), block{bytes, bulk});
    }
    usage_.add(bytes);
  }

  /// Frees the large block at `p` where it came from (`stream` null: the synchronous form); a
  /// pointer that is none is reported, and nothing is freed.
  void give_back(void* p, std::size_t bytes, std::size_t alignment,
                 const stream_view* stream) noexcept {
    if (marked_) {
      give_back_marked(p, bytes, stream);
      return;
    }
    const std::optional<block> recorded = forget(p);
    if (!recorded) {
      report_bad_free();
      return;
    }
    memory_resource& from = recorded->bulk ? *bulk_ : source_;
    if (stream != nullptr) {
      from.deallocate(p, bytes, alignment, *stream);
    } else {
      from.deallocate(p, bytes, alignment);
    }
  }

  /// Frees a block that record() could not count (synchronously: nobody has used it yet).
  void give_back_unrecorded(void* p, std::size_t bytes, std::size_t alignment,
                            bool bulk) noexcept {
    (bulk ? static_cast<memory_resource&>(*bulk_) : source_).deallocate(p, bytes, alignment);
  }

  /// Bytes asked for by the live large blocks, and the most at once.
  [[nodiscard]] std::size_t used_bytes() const noexcept { return usage_.used(); }
  [[nodiscard]] std::size_t peak_bytes() const noexcept { return usage_.peak(); }

  /// Appends the recorded blocks as (address, bytes): none when marked (they are in the
  /// vm_resources' mapped ranges).
  void append_recorded(std::vector<std::pair<std::uintptr_t, std::size_t>>& out) const {
    const detail::lock_guard lock(mutex_);
    for (const auto& [address, b] : recorded_) {
      out.emplace_back(address, b.bytes);
    }
  }

 private:
  struct block {
    std::size_t bytes = 0;
    bool bulk = false;
  };
  using block_map = std::unordered_map<std::uintptr_t, block>;

  /// The bulk resource first for a whole multiple of its handle, the other next (a size that
  /// differs from the allocation's, a bulk block declined); neither holds it: a bad free.
  void give_back_marked(void* p, std::size_t bytes, const stream_view* stream) noexcept {
    vm_resource* first = bulk_sized(bytes) ? bulk_ : &vm_;
    std::optional<std::size_t> freed = first->deallocate_marked(p, bytes, stream, mark);
    if (!freed && bulk_ != nullptr) {
      freed = (first == &vm_ ? bulk_ : &vm_)->deallocate_marked(p, bytes, stream, mark);
    }
    if (!freed) {
      report_bad_free();
      return;
    }
    usage_.subtract(*freed);
  }

  /// The record of `p`, erased; nullopt if there is none (or the mutex could not be locked).
  std::optional<block> forget(const void* p) noexcept {
    try {
      const detail::lock_guard lock(mutex_);
      const auto it = recorded_.find(reinterpret_cast<std::uintptr_t>(p));
      if (it != recorded_.end()) {
        const block b = it->second;
        usage_.subtract(b.bytes);
        spare_.erase(recorded_, it);
        return b;
      }
    } catch (...) {
    }
    return std::nullopt;
  }

  static void report_bad_free() noexcept {
    report_problem(
        "vm_pool_resource: deallocate of a block of a handle or more that it did not allocate, "
        "or already freed (or a size other than the one allocated); ignored");
  }

  memory_resource& source_;
  vm_resource& vm_;
  vm_resource* bulk_;
  std::size_t bulk_handle_;  ///< bulk_'s handle bytes; 0 when there is no bulk resource
  bool marked_;
  mutable detail::mutex mutex_;  ///< guards the two below (unmarked only)
  block_map recorded_;
  spare_nodes<block_map> spare_;  ///< nodes of freed records, for the next ones
  usage_counter usage_;  ///< the bytes asked for by the live large blocks
};

}  // namespace cudamem::detail
