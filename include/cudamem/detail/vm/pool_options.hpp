// cudamem/detail/vm/pool_options.hpp — vm_pool_resource's options and figures:
// vm_pool_options (the vm_resource's options, the pool's, an adaptor, bulk blocks),
// vm_pool_chunking() (the pool's chunking over virtual memory) and vm_pool_stats.
//
//   cudamem::vm_pool_options o;                 // vm_resource_options plus:
//   o.pool = cudamem::vm_pool_chunking();       //   the pool's options (this is the default)
//   o.bulk_handle_bytes = 32 << 20;             //   bulk blocks (vm_pool_resource.hpp)
//
// Why apart: as vm_resource_options (detail/vm/options.hpp), so that the resource's header is
// its contract and its code. What each option does is said in vm_pool_resource.hpp's contract.
#pragma once

#include <cudamem/detail/vm/options.hpp>
#include <cudamem/memory_resource.hpp>
#include <cudamem/pool_resource.hpp>

#include <cstddef>
#include <functional>
#include <memory>
#include <optional>

namespace cudamem {

class vm_resource;

/// The pool's chunking under a vm_resource: requests up to 4 MiB share 64 MiB small chunks
/// (one handle each), so long-lived blocks of up to 4 MiB never sit in the chunks that medium
/// blocks come and go in; medium requests use 64 MiB chunks (blocks of 64 MiB and more do not
/// reach the pool). Every chunk is whole handles, so a wholly free chunk is wholly recyclable.
/// The front-end cache follows use (see the header comment).
[[nodiscard]] inline pool_options vm_pool_chunking() noexcept {
  pool_options o;
  o.small_block_limit = std::size_t{4} << 20;
  o.small_chunk_size = std::size_t{64} << 20;
  o.growth_step = std::size_t{64} << 20;
  o.cache_follows_use = true;
  return o;
}

/// How to build a vm_pool_resource: the upstream's options (handle and growth sizes,
/// reservations, physical limit, peers; see vm_resource_options) and the pool's.
struct vm_pool_options : vm_resource_options {
  /// The pool's options (see vm_pool_chunking). Keep chunk sizes multiples of handle_bytes,
  /// so a wholly free chunk is whole handles the upstream can recycle.
  pool_options pool = vm_pool_chunking();
  /// Optional: makes the adaptor that the pool's chunks and the large blocks pass through,
  /// over the vm_resource it is given (see the contract). Empty: none.
  std::function<std::unique_ptr<memory_resource>(vm_resource&)> upstream_adaptor;
  /// Blocks whose size is a whole multiple of this come from a second vm_resource whose
  /// handles are this big (see the contract: bulk blocks). 0, the default: none.
  std::size_t bulk_handle_bytes = 0;
};

/// What a vm_pool_resource holds: the upstream's virtual-memory figures, the pool's blocks.
struct vm_pool_stats : vm_resource_stats {
  std::optional<vm_resource_stats> bulk;  ///< the bulk blocks' vm_resource, when there is one
  std::size_t bulk_declined = 0;  ///< bulk-sized requests sent to the upstream (keep_free held)
  std::size_t large_used_bytes = 0;      ///< blocks of a handle or more (the upstream's)
  std::size_t large_peak_bytes = 0;      ///< the most large_used_bytes has been
  std::size_t pool_used_bytes = 0;       ///< blocks handed out by the pool
  std::size_t pool_free_bytes = 0;       ///< free in the pool's chunks
  std::size_t pool_largest_free_block = 0;  ///< the largest of those free blocks
  std::size_t pool_chunks = 0;           ///< chunks the pool holds from the upstream
};

}  // namespace cudamem
