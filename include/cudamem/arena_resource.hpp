// cudamem/arena_resource.hpp — a monotonic bump allocator, the shape of
// std::pmr::monotonic_buffer_resource: allocation is a pointer bump, frees do nothing, and
// everything goes back at release() or destruction. Plus `arena_scope`, which rewinds the
// arena when a scope ends: per-iteration scratch memory for nothing.
//
//   cudamem::pool_resource pool{device};
//   cudamem::arena_resource arena{pool, {.initial_chunk_size = 64 << 20}};
//   for (int step = 0; step < steps; ++step) {
//     cudamem::arena_scope scratch{arena};        // remembers where the arena is
//     float* a = static_cast<float*>(arena.allocate(n * sizeof(float), 256, s));
//     float* b = static_cast<float*>(arena.allocate(m * sizeof(float), 256, s));
//     kernel<<<g, t, 0, s.get()>>>(a, b);
//   }                                              // rewinds: the next step reuses the bytes
//   arena.release();                               // chunks back to the pool
//
// Contract (memory_resource.hpp's, plus)
// - Kind and device are the upstream's. allocate is O(1): it bumps an offset in the current
//   chunk. When the chunk is full the arena moves to its next chunk (kept from before a
//   rewind) or asks the upstream for a new one: `initial_chunk_size` first, then each new
//   chunk `growth_factor` times the last, up to `maximum_chunk_size` — or the request's size
//   when that is larger. A failing upstream's out_of_memory comes out with a report that
//   starts at the arena (its cause names the chunk asked for), and the arena is unchanged;
//   when the arena holds chunks it is not using, the report's hint says rewind/release.
// - deallocate does nothing (the size and pointer are not even checked).
// - release() returns every chunk to the upstream; the destructor does too. rewind(mark) (and
//   arena_scope's destructor) makes every byte allocated after the mark available again but
//   keeps the chunks, so a loop that rewinds every iteration stops calling the upstream after
//   its first iteration.
// - Stream order: an arena is for one stream (or for work the caller synchronises). Memory
//   handed out before a rewind may be handed out again at once; that is safe when all work
//   using the arena runs in order on one stream. release() uses the synchronous upstream
//   deallocate (the caller promises no pending work uses the memory); release(s) returns the
//   chunks in stream order on `s` instead (the last work using them was submitted to s).
// - A request no chunk could ever hold (near SIZE_MAX) throws out_of_memory.
// - Not thread-safe: use one arena per thread (it is the cheapest object there is).
// - Stats: reserved = bytes of the chunks held, used = bytes handed out since the last
//   rewind/release (alignment padding included), peak = the most `used` has been.
// - compute-sanitizer: over cudaMalloc'd memory (device_resource) each chunk is an NVTX heap
//   and each allocation a region of it until a rewind past it or release() (detail/nvtx.hpp),
//   so memcheck reports an access past an allocation's size, or to memory rewound away, as it
//   does for cudaMalloc. Over a pool the tool sees each arena chunk as one pool block (it
//   refuses heaps inside heaps). Off with CUDAMEM_NVTX=0; nothing is called with no tool.
#pragma once

#include <cudamem/detail/nvtx.hpp>
#include <cudamem/memory_resource.hpp>
#include <cudamem/out_of_memory.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

namespace cudamem {

/// How an `arena_resource` grows; see the contract above.
struct arena_options {
  std::size_t initial_chunk_size = std::size_t{1} << 20;   ///< first chunk asked for
  double growth_factor = 2.0;                              ///< each new chunk vs the last
  std::size_t maximum_chunk_size = std::size_t{1} << 30;   ///< chunks grow no larger
};

/// A point in an arena to rewind to (from `arena_resource::mark()`).
struct arena_mark {
  std::size_t chunk = 0;   ///< index of the chunk being bumped in
  std::size_t offset = 0;  ///< bytes used in that chunk
  std::size_t used = 0;    ///< bytes handed out in all
};

/// A monotonic bump allocator; see the contract above.
class arena_resource final : public memory_resource {
 public:
  /// An arena over `upstream` (referred to, not owned). Throws std::invalid_argument for a chunk
  /// size of 0 or a growth factor below 1.
  explicit arena_resource(memory_resource& upstream, arena_options options = {})
      : memory_resource(upstream.kind(), upstream.device()), upstream_(&upstream),
        options_(options), next_chunk_size_(options.initial_chunk_size),
        annotates_(detail::annotates_sub_allocations(
            upstream.kind() == memory_kind::device && upstream.device() >= 0,
            upstream.allows_nvtx_heaps())) {
    if (options_.initial_chunk_size == 0 || options_.maximum_chunk_size == 0 ||
        !(options_.growth_factor >= 1.0)) {
      throw std::invalid_argument(
          "cudamem::arena_resource: chunk sizes must be positive and growth_factor >= 1");
    }
  }

  ~arena_resource() override { release(); }

  arena_resource(const arena_resource&) = delete;
  arena_resource& operator=(const arena_resource&) = delete;

  /// Returns every chunk to the upstream (synchronous deallocate).
  void release() noexcept { release_chunks(nullptr); }
  /// Returns every chunk to the upstream in stream order on `s`.
  void release(stream_view s) noexcept { release_chunks(&s); }

  /// Where the arena is now; pass it to rewind().
  [[nodiscard]] arena_mark mark() const noexcept { return {current_, offset_, used_}; }

  /// Makes everything allocated after `m` available again; keeps the chunks.
  void rewind(const arena_mark& m) noexcept {
    if (m.chunk > current_ || (m.chunk == current_ && m.offset > offset_) ||
        (m.chunk >= chunks_.size() && !chunks_.empty())) {
      return;  // a mark from after the current point (or from before a release): nothing to do
    }
    current_ = m.chunk;
    offset_ = m.offset;
    used_ = m.used;
    if (detail::nvtx_compiled && annotates_) [[unlikely]] {
      forget_regions_after(m);
    }
  }

  /// Number of chunks held.
  [[nodiscard]] std::size_t chunk_count() const noexcept { return chunks_.size(); }

 private:
  struct chunk {
    std::uintptr_t base;
    std::size_t size;
    void* heap = nullptr;  ///< its NVTX heap; nullptr when not annotated
  };
  /// An allocation registered with a tool: where it is, for rewind.
  struct region {
    std::size_t chunk;
    std::uintptr_t address;
  };

  void* do_allocate(std::size_t bytes, std::size_t alignment, stream_view /*stream*/) override {
    if (detail::nvtx_compiled && annotates_) [[unlikely]] {
      return bump_annotated(bytes, alignment);
    }
    return bump(bytes, alignment);
  }
  void* do_allocate_sync(std::size_t bytes, std::size_t alignment) override {
    if (detail::nvtx_compiled && annotates_) [[unlikely]] {
      return bump_annotated(bytes, alignment);
    }
    return bump(bytes, alignment);
  }

  /// With a tool attached: tells it the allocation is live, and remembers it for rewind.
  [[gnu::noinline]] void* bump_annotated(std::size_t bytes, std::size_t alignment) {
    regions_.reserve(regions_.size() + 1);  // before the bump: a bad_alloc here loses nothing
    void* p = bump(bytes, alignment);
    regions_.push_back({current_, reinterpret_cast<std::uintptr_t>(p)});
    detail::memory_annotations::add_region(device(), chunks_[current_].heap, p, bytes);
    return p;
  }

  /// A rewind to `m`: regions allocated after it are free again (newest first).
  void forget_regions_after(const arena_mark& m) noexcept {
    while (!regions_.empty()) {
      const region& r = regions_.back();
      if (r.chunk < m.chunk ||
          (r.chunk == m.chunk && r.address < chunks_[r.chunk].base + m.offset)) {
        break;
      }
      detail::memory_annotations::remove_region(device(),
                                                reinterpret_cast<const void*>(r.address));
      regions_.pop_back();
    }
  }
  void do_deallocate(void*, std::size_t, std::size_t, stream_view) noexcept override {}
  void do_deallocate_sync(void*, std::size_t, std::size_t) noexcept override {}

  void* bump(std::size_t bytes, std::size_t alignment) {
    if (current_ < chunks_.size()) [[likely]] {
      const chunk& c = chunks_[current_];
      const std::uintptr_t start = (c.base + offset_ + alignment - 1) & ~(alignment - 1);
      const std::size_t end = start - c.base + bytes;
      if (end <= c.size && end >= bytes) {  // (end >= bytes: no wrap-around)
        used_ += end - offset_;
        offset_ = end;
        peak_ = used_ > peak_ ? used_ : peak_;
        return reinterpret_cast<void*>(start);
      }
    }
    return bump_slow(bytes, alignment);
  }

  /// The current chunk is full: the next kept chunk that fits, or a new one.
  void* bump_slow(std::size_t bytes, std::size_t alignment) {
    if (bytes > std::numeric_limits<std::size_t>::max() / 2 ||
        alignment > std::numeric_limits<std::size_t>::max() / 4) {
      throw_out_of_memory(*this, bytes, alignment, "arena_resource: request too large");
    }
    const std::size_t needed = bytes + (alignment > default_alignment ? alignment : 0);
    std::size_t next = current_ < chunks_.size() ? current_ + 1 : 0;
    for (; next < chunks_.size(); ++next) {  // chunks kept from before a rewind
      if (chunks_[next].size >= needed) {
        break;
      }
    }
    if (next == chunks_.size()) {
      const std::size_t size = std::max(needed, next_chunk_size_);
      chunks_.reserve(chunks_.size() + 1);  // before asking: a bad_alloc here leaks nothing
      void* p = nullptr;
      try {
        p = upstream_->allocate(size, std::max(alignment, default_alignment));
      } catch (const out_of_memory& below) {  // reported from here: the chain shows the arena
        memory_report chunk_failure = below.report();
        chunk_failure.cause += " (arena_resource asked it for a chunk of " + format_bytes(size) + ")";
        rethrow_out_of_memory(*this, bytes, alignment, chunk_failure);
      }
      void* heap = annotates_ ? detail::memory_annotations::add_heap(
                                    device(), p, size, "cudamem::arena_resource chunk")
                              : nullptr;
      chunks_.push_back({reinterpret_cast<std::uintptr_t>(p), size, heap});
      reserved_ += size;
      const double grown = static_cast<double>(next_chunk_size_) * options_.growth_factor;
      next_chunk_size_ = grown >= static_cast<double>(options_.maximum_chunk_size)
                             ? options_.maximum_chunk_size
                             : static_cast<std::size_t>(grown);
    }
    // Bytes skipped at the end of the chunks passed over count as used until a rewind.
    for (std::size_t i = current_; i < next && i < chunks_.size(); ++i) {
      used_ += chunks_[i].size - (i == current_ ? offset_ : 0);
    }
    current_ = next;
    offset_ = 0;
    return bump(bytes, alignment);
  }

  void release_chunks(const stream_view* s) noexcept {
    regions_.clear();
    for (const chunk& c : chunks_) {
      detail::memory_annotations::remove_heap(device(), c.heap);  // and every region in it
      if (s != nullptr) {
        upstream_->deallocate(reinterpret_cast<void*>(c.base), c.size, default_alignment, *s);
      } else {
        upstream_->deallocate(reinterpret_cast<void*>(c.base), c.size, default_alignment);
      }
    }
    chunks_.clear();
    current_ = 0;
    offset_ = 0;
    used_ = 0;
    reserved_ = 0;
    next_chunk_size_ = options_.initial_chunk_size;
  }

  std::string_view do_name() const noexcept override { return "arena_resource"; }
  std::string do_oom_hint(const memory_report& report, std::size_t /*position*/) const override {
    if (report.verdict == oom_verdict::budget || report.verdict == oom_verdict::larger_than_device ||
        report.verdict == oom_verdict::unknown || reserved_ <= used_) {
      return {};
    }
    return "This arena_resource holds " + format_bytes(reserved_) + " in " +
           std::to_string(chunks_.size()) + " chunk" + (chunks_.size() == 1 ? "" : "s") +
           ", of which " + format_bytes(used_) + " were handed out since the last rewind: an "
           "arena frees nothing until rewind() (arena_scope) or release(). Rewind it every "
           "iteration so its chunks are reused, or release() them when the phase ends.";
  }
  memory_resource* do_upstream() const noexcept override { return upstream_; }
  resource_stats do_stats() const override {
    resource_stats s;
    s.reserved_bytes = reserved_;
    s.used_bytes = used_;
    s.peak_used_bytes = peak_;
    return s;
  }

  memory_resource* upstream_;
  arena_options options_;
  std::vector<chunk> chunks_;
  std::size_t current_ = 0;  ///< index of the chunk being bumped in (== size(): none)
  std::size_t offset_ = 0;   ///< bytes used in it
  std::size_t used_ = 0;
  std::size_t peak_ = 0;
  std::size_t reserved_ = 0;
  std::size_t next_chunk_size_;
  bool annotates_;  ///< chunks and allocations are told to an NVTX tool (detail/nvtx.hpp)
  std::vector<region> regions_;  ///< registered allocations, oldest first (only with a tool)
};

/// Rewinds an arena to where it was when the scope began; see arena_resource's contract.
class arena_scope {
 public:
  /// Marks `arena` now; the destructor rewinds it there.
  explicit arena_scope(arena_resource& arena) noexcept : arena_(&arena), mark_(arena.mark()) {}
  ~arena_scope() { arena_->rewind(mark_); }
  arena_scope(const arena_scope&) = delete;
  arena_scope& operator=(const arena_scope&) = delete;

 private:
  arena_resource* arena_;
  arena_mark mark_;
};

}  // namespace cudamem
