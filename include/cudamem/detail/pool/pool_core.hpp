// cudamem/detail/pool/pool_core.hpp — pool_resource's state and its allocate and free paths:
// the code behind pool_resource.hpp's declarations.
//
//   // pool_resource.hpp includes this at its end (header-only), or the cudamem::compiled
//   // library compiles it once (detail/compiled.hpp); nothing else includes it.
//   pool_core& c = core();                               // in place, inside the pool_resource
//   void* p = c.allocate_block(*this, bytes, alignment, &stream);
//   c.free_block(p, bytes, &stream);
//
// What it owns: the validated options, the policy made from them, the shards (each a lock, its
// heaps, its cache and its live blocks: pool_shard.hpp) and the chunks held from the upstream
// (chunk_set.hpp). pool_resource constructs it inside itself and destroys it last.
//
// Why the hot paths look as they do: a cache hit (the common case) costs a lock, a pop and a
// few stores, inline in do_allocate and do_deallocate; everything else is out of line
// (gnu::noinline) so that the inline part stays small. With a tool attached (policy.annotates)
// requests take a path of their own that tells it which blocks are live; the test comes first,
// so that without a tool the fast paths are exactly what they were (one predictable branch).
#pragma once

#include <cudamem/detail/compiled.hpp>
#include <cudamem/detail/nvtx.hpp>
#include <cudamem/detail/pool/chunk_set.hpp>
#include <cudamem/detail/pool/pool_options.hpp>
#include <cudamem/detail/pool/pool_shard.hpp>
#include <cudamem/detail/sync/mutex.hpp>
#include <cudamem/detail/unique_owner.hpp>
#include <cudamem/error.hpp>
#include <cudamem/memory_resource.hpp>
#include <cudamem/out_of_memory.hpp>
#include <cudamem/pool_resource.hpp>
#include <cudamem/stream.hpp>

#include <cstddef>
#include <cstdint>
#include <new>
#include <string>
#include <utility>
#include <vector>

namespace cudamem::detail {

class pool_core {
 public:
  using shard = pool_shard;
  using block = pool_block;

  pool_core(memory_resource& upstream, const pool_options& requested)
      : options(validated_pool_options(requested)),
        policy(pool_policy::from(this->options, upstream)),
        shards(make_pool_shards(this->options.shards, policy)),
        chunks(upstream, policy) {}

  pool_options options;
  pool_policy policy;
  std::vector<unique_owner<shard>> shards;
  mutable chunk_set chunks;  // mutable: upstream() hands out a non-const resource

  [[nodiscard]] shard& home_shard() const noexcept {
    return *shards[pool_thread_slot() & (shards.size() - 1)];
  }

  // --- allocate -----------------------------------------------------------------------------
  // `owner`: the pool_resource, named in an out-of-memory report.

  // allocate and free are the bodies of do_allocate and do_deallocate, always_inline so that
  // no call is added between the virtual call and the fast path: do_allocate tests for a tool
  // and calls allocate_block; do_deallocate holds free_block and finish_free inline.
  [[gnu::always_inline]] void* allocate(const memory_resource& owner, std::size_t bytes,
                                        std::size_t alignment, const stream_view* stream) {
    if (nvtx_compiled && policy.annotates) [[unlikely]] {
      return allocate_annotated(owner, bytes, alignment, stream);
    }
    return allocate_block(owner, bytes, alignment, stream);
  }

  [[gnu::noinline]] void* allocate_annotated(const memory_resource& owner, std::size_t bytes,
                                             std::size_t alignment, const stream_view* stream) {
    void* p = allocate_block(owner, bytes, alignment, stream);
    chunks.annotate_block(p, bytes);
    return p;
  }

  /// `stream` null: the synchronous form (ready for everyone on return). The fast path,
  /// inline: a cache hit whose block is free of pending frees on other streams (the common
  /// case) costs a lock, a pop and a few stores. Everything else is out of line.
  void* allocate_block(const memory_resource& owner, std::size_t bytes, std::size_t alignment,
                       const stream_view* stream) {
    const std::size_t padding = alignment > pool_granule ? alignment - pool_granule : 0;
    const std::size_t size = policy.round_up(bytes);
    if (size == 0 || size > options.maximum_size || padding > options.maximum_size - size)
        [[unlikely]] {
      throw_too_large(owner, bytes, alignment);
    }
    shard& home = home_shard();
    home.mutex.lock();
    if (size <= policy.cache_limit) {
      if (block* b = home.cached.pop(size, alignment - 1)) {
        if (b->tag.empty() || b->tag.only_on(stream)) [[likely]] {
          b->tag.clear();
          home.count_in(b->size);
          home.mutex.unlock();
          return reinterpret_cast<void*>(b->address);
        }
        return allocate_cached_slow(owner, home, b, bytes, size, alignment, stream);
      }
    }
    return allocate_uncached(owner, home, bytes, size, alignment, stream);
  }

  /// A cache hit whose block has frees pending on another stream. Called with home's lock
  /// held; releases it. (Under stream_reuse_policy::when_complete the cache may decline: then
  /// the request goes on as a miss.)
  [[gnu::noinline]] void* allocate_cached_slow(const memory_resource& owner, shard& home, block* b,
                                               std::size_t bytes, std::size_t size,
                                               std::size_t alignment, const stream_view* stream) {
    {
      unique_lock lock(home.mutex, adopt_lock);
      if (void* p = home.hand_out_cached(policy, b, size, alignment, stream)) {
        return p;
      }
      lock.release();  // still held: allocate_uncached releases it
    }
    return allocate_uncached(owner, home, bytes, size, alignment, stream);
  }

  [[noreturn, gnu::noinline]] void throw_too_large(const memory_resource& owner, std::size_t bytes,
                                                   std::size_t alignment) const {
    throw_out_of_memory(owner, bytes, alignment,
                        "pool_resource: larger than the pool's maximum size (" +
                            format_bytes(options.maximum_size) + ")");
  }

  /// A request the cache could not serve: from home's heap (flushing its cache if need be),
  /// else from the upstream. Called with home's lock held; releases it.
  [[gnu::noinline]] void* allocate_uncached(const memory_resource& owner, shard& home,
                                            std::size_t bytes, std::size_t size,
                                            std::size_t alignment, const stream_view* stream) {
    const pool_tier t = policy.tier_of(size);
    {
      const lock_guard lock(home.mutex, adopt_lock);
      if (void* p = home.take_flushing(policy, t, size, alignment, stream)) {
        return p;
      }
    }
    return chunks.grow_and_allocate(owner, shards, home, t, bytes, size, alignment, stream);
  }

  // --- deallocate ---------------------------------------------------------------------------

  [[gnu::always_inline]] void free(void* p, std::size_t bytes, const stream_view* stream) noexcept {
    if (nvtx_compiled && policy.annotates) [[unlikely]] {
      return free_annotated(p, bytes, stream);
    }
    free_block(p, bytes, stream);
  }

  /// A free with a tool attached: the block's region goes once the block is known to be live
  /// (a bad free unregisters nothing) and before anyone can be handed it again.
  [[gnu::noinline]] void free_annotated(void* p, std::size_t bytes,
                                        const stream_view* stream) noexcept {
    const auto address = reinterpret_cast<std::uintptr_t>(p);
    if (shard* owner = chunks.owner_of(address)) {
      owner->mutex.lock();
      if (block* b = owner->live.find(address); b != nullptr && !b->cached) {
        memory_annotations::remove_region(policy.device, p);
        finish_free_slow(*owner, b, bytes, stream);  // the general case serves any free
        return;
      }
      owner->mutex.unlock();
    }
    free_elsewhere(address, bytes, stream);  // reports the bad pointer or double free
  }

  /// The fast path, inline like allocate_block's: a block of this thread's shard, freed with
  /// its own size on the stream the shard saw last, into a cache with room. (always_inline:
  /// the compiler's own choice varies with what else the caller holds, by ~10 instructions
  /// per free.)
  [[gnu::always_inline]] void free_block(void* p, std::size_t bytes,
                                         const stream_view* stream) noexcept {
    const auto address = reinterpret_cast<std::uintptr_t>(p);
    shard& home = home_shard();
    home.mutex.lock();
    if (block* b = home.live.find(address); b != nullptr && !b->cached) [[likely]] {
      finish_free(home, b, bytes, stream);
      return;
    }
    home.mutex.unlock();
    free_elsewhere(address, bytes, stream);
  }

  /// A block another thread's shard gave out (found through the chunk directory), or a bad
  /// pointer.
  [[gnu::noinline]] void free_elsewhere(std::uintptr_t address, std::size_t bytes,
                                        const stream_view* stream) noexcept {
    shard* owner = chunks.owner_of(address);
    if (owner == nullptr) {
      report_problem("pool_resource: deallocate of a pointer this pool did not give out; ignored");
      return;
    }
    owner->mutex.lock();
    block* b = owner->live.find(address);
    if (b == nullptr || b->cached) {
      owner->mutex.unlock();
      report_problem("pool_resource: deallocate of a block that is not allocated (a double free, "
                     "or a pointer into the middle of a block); ignored");
      return;
    }
    finish_free(*owner, b, bytes, stream);
  }

  /// Frees `b` (found in sh.live, handed out). Called with sh's lock held; releases it. Inline:
  /// the size matches, the cache has room and the stream is the one whose record the shard
  /// looked up last (a handed-out block has no pending frees, so its tag gets one entry).
  [[gnu::always_inline]] void finish_free(shard& sh, block* b, std::size_t bytes,
                                         const stream_view* stream) noexcept {
    const std::size_t size = policy.round_up(bytes);
    const bool size_matches = size <= b->size && b->size - size <= size / 8;
    const bool tracked = policy.tracks_streams && stream != nullptr;
    stream_record* rec = tracked ? sh.ledger.last_if(stream->get()) : nullptr;
    if (size_matches && policy.cacheable(b->size, sh.cached.bytes(), sh.used - b->size) &&
        (!tracked || rec)) [[likely]] {
      if (tracked) {
        ++rec->frees;
        b->tag.add(rec, rec->frees);
      }
      sh.used -= b->size;
      sh.cached.push(b);
      sh.mutex.unlock();
      return;
    }
    finish_free_slow(sh, b, bytes, stream);
  }

  [[gnu::noinline]] void finish_free_slow(shard& sh, block* b, std::size_t bytes,
                                          const stream_view* stream) noexcept {
    const lock_guard lock(sh.mutex, adopt_lock);
    sh.free_block(policy, b, bytes, stream);
  }
};

}  // namespace cudamem::detail

namespace cudamem {

// --- pool_resource's members (declared in pool_resource.hpp) ---------------------------------

CUDAMEM_DEFINITION detail::pool_core& pool_resource::core() noexcept {
  static_assert(sizeof(detail::pool_core) <= core_bytes && alignof(detail::pool_core) <= 8,
                "pool_resource::core_bytes is too small for detail::pool_core");
  return *std::launder(reinterpret_cast<detail::pool_core*>(core_));
}
CUDAMEM_DEFINITION const detail::pool_core& pool_resource::core() const noexcept {
  return *std::launder(reinterpret_cast<const detail::pool_core*>(core_));
}

CUDAMEM_DEFINITION pool_resource::pool_resource(memory_resource& upstream, pool_options options)
    : memory_resource(upstream.kind(), upstream.device()) {
  detail::pool_core& c = *new (core_) detail::pool_core(upstream, options);
  try {
    if (c.options.initial_size > 0) {
      std::string cause;
      if (!c.chunks.obtain(*c.shards[0], detail::large_tier,
                           c.policy.round_up(c.options.initial_size), cause)) {
        throw_out_of_memory(*this, c.options.initial_size, granule,
                            "pool_resource: initial_size: " + cause);
      }
    }
    if (c.policy.tracks_streams) {  // last: a constructor that throws leaves no registration
      detail::stream_listener_registry::instance().add(this);
    }
  } catch (...) {
    c.~pool_core();  // as the members' destructors would: the chunks go back
    throw;
  }
}

CUDAMEM_DEFINITION pool_resource::~pool_resource() {
  detail::pool_core& c = core();
  if (c.policy.tracks_streams) {
    detail::stream_listener_registry::instance().remove(this);
  }
  c.chunks.return_all(c.shards);  // reports blocks still allocated
  c.~pool_core();
}

CUDAMEM_DEFINITION std::size_t pool_resource::release() noexcept {
  detail::pool_core& c = core();
  return c.chunks.release_free(c.shards);
}

CUDAMEM_DEFINITION void pool_resource::retire_stream(stream_view s) {
  detail::pool_core& c = core();
  if (!c.policy.tracks_streams) {
    return;
  }
  for (auto& sh : c.shards) {
    const detail::lock_guard lock(sh->mutex);
    sh->ledger.retire(s);
  }
}

CUDAMEM_DEFINITION std::size_t pool_resource::cover_frees() {
  detail::pool_core& c = core();
  std::size_t recorded = 0;
  if (!c.policy.tracks_streams) {
    return recorded;
  }
  for (auto& sh : c.shards) {
    const detail::lock_guard lock(sh->mutex);
    recorded += sh->ledger.cover_frees();
  }
  return recorded;
}

CUDAMEM_DEFINITION pool_stream_stats pool_resource::stream_stats() const {
  const detail::pool_core& core_state = core();
  detail::stream_counters c;
  for (const auto& sh : core_state.shards) {
    const detail::lock_guard lock(sh->mutex);
    c.add(sh->ledger.counters());
  }
  const detail::chunk_set::counts chunks = core_state.chunks.activity();
  pool_stream_stats s;
  s.cross_stream_blocks = c.cross_stream_blocks;
  s.preferred_blocks = c.preferred_blocks;
  s.event_records = c.event_records;
  s.event_queries = c.event_queries;
  s.stream_waits = c.stream_waits;
  s.waits_skipped = c.waits_skipped;
  s.host_waits = c.host_waits;
  s.wide_tags = c.wide_tags;
  s.device_syncs = chunks.device_syncs;
  s.upstream_allocations = chunks.upstream_allocations;
  s.upstream_returns = chunks.upstream_returns;
  return s;
}

CUDAMEM_DEFINITION const pool_options& pool_resource::options() const noexcept {
  return core().options;
}
CUDAMEM_DEFINITION std::size_t pool_resource::shard_count() const noexcept {
  return core().shards.size();
}
CUDAMEM_DEFINITION std::size_t pool_resource::chunk_count() const { return core().chunks.count(); }
CUDAMEM_DEFINITION std::size_t pool_resource::peak_reserved_bytes() {
  return core().chunks.peak_reserved();
}
CUDAMEM_DEFINITION void pool_resource::reset_peak_reserved() {
  core().chunks.reset_peak_reserved();
}
CUDAMEM_DEFINITION std::vector<std::pair<std::uintptr_t, std::size_t>>
pool_resource::chunk_ranges() const {
  return core().chunks.ranges();
}

CUDAMEM_DEFINITION void* pool_resource::do_allocate(std::size_t bytes, std::size_t alignment,
                                                    stream_view stream) {
  return core().allocate(*this, bytes, alignment, &stream);
}
CUDAMEM_DEFINITION void* pool_resource::do_allocate_sync(std::size_t bytes, std::size_t alignment) {
  return core().allocate(*this, bytes, alignment, nullptr);
}
CUDAMEM_DEFINITION void pool_resource::do_deallocate(void* p, std::size_t bytes,
                                                     std::size_t /*alignment*/,
                                                     stream_view stream) noexcept {
  core().free(p, bytes, &stream);
}
CUDAMEM_DEFINITION void pool_resource::do_deallocate_sync(void* p, std::size_t bytes,
                                                          std::size_t /*alignment*/) noexcept {
  core().free(p, bytes, nullptr);
}

CUDAMEM_DEFINITION void pool_resource::on_stream_destroy(cudaStream_t handle) noexcept {
  try {
    retire_stream(stream_view{handle});
  } catch (const cuda_error& e) {
    report_error(e.code(), "pool_resource: recording an event on a stream being destroyed");
  } catch (...) {
    report_problem("pool_resource: could not settle a stream being destroyed");
  }
}

CUDAMEM_DEFINITION void pool_resource::before_graph_capture() noexcept {
  try {
    static_cast<void>(cover_frees());
  } catch (const cuda_error& e) {
    report_error(e.code(), "pool_resource: recording events before a graph capture");
  } catch (...) {
    report_problem("pool_resource: could not record events before a graph capture");
  }
}

CUDAMEM_DEFINITION memory_resource* pool_resource::do_upstream() const noexcept {
  return &core().chunks.upstream();
}

CUDAMEM_DEFINITION resource_stats pool_resource::do_stats() const {
  resource_stats s;
  for (const auto& sh : core().shards) {
    const detail::lock_guard lock(sh->mutex);
    sh->add_stats(s);
  }
  return s;
}

}  // namespace cudamem
