// cudamem/_torch/graph_pool.hpp — memory kept for one CUDA graph (or torch.cuda.MemPool) until
// it is gone: chunks from cudamem, cut into blocks that no one else may take.
//
//   graph_pool pool;
//   void* p = pool.allocate(1 << 20, capture_stream, source);  // a chunk from `source` first
//   pool.deallocate(p);                       // free again: the next request on the same
//                                             // stream may take it (the graph orders them)
//   bool ok = pool.allocate_at(p, 1 << 20);   // the same block again (a checkpoint restored)
//   pool.release(source);                     // wholly free chunks back where they came from
//
// Why. A captured graph reads and writes, at every replay, the addresses it was captured with,
// long after the tensors that named them were freed on the host. Its memory must not go back
// to the shared pool, and blocks freed during its capture may be reused by later allocations
// of the capture (the graph runs them in order). torch.compile's CUDA graph trees also roll a
// pool back to an earlier state ("checkpoint"): the blocks live then must be live again, at the
// same addresses — so the pool can place a block at a given address (allocate_at).
//
// How. Chunks come from `chunk_source` (cudamem's stack, in stream order on the stream that
// asked). As PyTorch's own allocator does: requests of 1 MiB or less share 2 MiB chunks, larger
// ones under 10 MiB share 20 MiB chunks, the rest get a chunk of their size rounded up to
// 2 MiB; a chunk serves one stream, so a block freed on stream s is reused on s alone and the
// pool never has to order one stream after another (no CUDA call at all: it is used while a
// stream is being captured, when an event query would break the capture). Within a chunk,
// free ranges merge with their neighbours, and a request takes the smallest free range of its
// stream and size class that fits.
//
// Contract
// - Sizes are multiples of 512 (the caller rounds). allocate returns nullptr when the source
//   has no memory for a new chunk; every other failure (host memory) throws.
// - deallocate takes a block this pool handed out (the caller's table knows); allocate_at takes
//   a range that is free in one chunk, else returns false and changes nothing.
// - `no_split`: every block is a chunk of its own (torch.cuda.MemPool(no_split=True)).
// - Not thread-safe: the allocator's lock guards it.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <iterator>
#include <map>
#include <set>
#include <tuple>
#include <utility>
#include <vector>

namespace cudamem::torch_bridge {

/// Where a graph pool's chunks come from (cudamem's stack, or a MemPool's own allocator).
class chunk_source {
 public:
  virtual ~chunk_source() = default;
  /// `bytes` usable in stream order on `stream`; nullptr when there is no memory.
  virtual void* allocate_chunk(std::size_t bytes, void* stream) = 0;
  virtual void deallocate_chunk(void* p, std::size_t bytes, void* stream) noexcept = 0;
};

class graph_pool {
 public:
  static constexpr std::size_t small_request = std::size_t{1} << 20;
  static constexpr std::size_t small_chunk = std::size_t{2} << 20;
  static constexpr std::size_t medium_request = std::size_t{10} << 20;
  static constexpr std::size_t medium_chunk = std::size_t{20} << 20;
  static constexpr std::size_t chunk_rounding = std::size_t{2} << 20;

  struct chunk {
    std::size_t bytes = 0;
    void* stream = nullptr;
    bool small = false;
    std::size_t used = 0;  ///< bytes in blocks handed out
  };
  /// A range of a chunk: free, or a block handed out.
  struct piece {
    std::uintptr_t address;
    std::size_t bytes;
    bool free;
  };

  explicit graph_pool(bool no_split = false) : no_split_(no_split) {}
  /// Every block a chunk of its own from now on (before the pool holds memory).
  void set_no_split() noexcept { no_split_ = true; }
  graph_pool(const graph_pool&) = delete;
  graph_pool& operator=(const graph_pool&) = delete;
  ~graph_pool() = default;  // chunks left are the owner's to release first (release())

  /// The chunk size a request of `size` bytes gets.
  [[nodiscard]] std::size_t chunk_size_for(std::size_t size) const noexcept {
    if (!no_split_ && size <= small_request) {
      return small_chunk;
    }
    if (!no_split_ && size < medium_request) {
      return medium_chunk;
    }
    return (size + chunk_rounding - 1) / chunk_rounding * chunk_rounding;
  }

  void* allocate(std::size_t size, void* stream, chunk_source& source) {
    last_new_chunk_ = 0;
    const bool small = size <= small_request;
    if (!no_split_) {
      const auto fit = by_size_.lower_bound(key{id(stream), small, size, 0});
      if (fit != by_size_.end() && std::get<0>(*fit) == id(stream) &&
          std::get<1>(*fit) == small) {
        const std::uintptr_t at = std::get<3>(*fit);
        take(at, size);
        return reinterpret_cast<void*>(at);
      }
    }
    const std::size_t bytes = chunk_size_for(size);
    void* p = source.allocate_chunk(bytes, stream);
    if (p == nullptr) {
      return nullptr;
    }
    const auto base = reinterpret_cast<std::uintptr_t>(p);
    try {
      chunks_.emplace(base, chunk{bytes, stream, small, 0});
      add_free(base, bytes);
    } catch (...) {
      chunks_.erase(base);
      source.deallocate_chunk(p, bytes, stream);
      throw;
    }
    reserved_ += bytes;
    take(base, no_split_ ? bytes : size);
    last_new_chunk_ = base;
    return p;
  }

  /// The size a block of `size` takes here (no_split: its whole chunk).
  [[nodiscard]] std::size_t block_size_for(std::size_t size) const noexcept {
    return no_split_ ? chunk_size_for(size) : size;
  }

  /// Takes [p, p + size) if it is free in one chunk (a checkpoint's block, live again).
  bool allocate_at(const void* p, std::size_t size) {
    const auto at = reinterpret_cast<std::uintptr_t>(p);
    auto it = free_.upper_bound(at);
    if (it == free_.begin()) {
      return false;
    }
    --it;
    if (at + size > it->first + it->second) {
      return false;
    }
    take(at, size);
    return true;
  }

  void deallocate(const void* p, std::size_t size) {
    const auto at = reinterpret_cast<std::uintptr_t>(p);
    chunk& c = chunk_of(at)->second;
    c.used -= size;
    used_ -= size;
    add_free(at, size);  // merges with the free neighbours in the same chunk
  }

  /// The chunk the last allocate() took from the source (its base), or 0 if none.
  [[nodiscard]] std::uintptr_t last_new_chunk() const noexcept { return last_new_chunk_; }

  /// Gives every wholly free chunk back to `source`; returns them (base and chunk).
  std::vector<std::pair<std::uintptr_t, chunk>> release(chunk_source& source) {
    std::vector<std::pair<std::uintptr_t, chunk>> released;
    for (auto it = chunks_.begin(); it != chunks_.end();) {
      if (it->second.used != 0) {
        ++it;
        continue;
      }
      remove_free(it->first);  // one free range covers a wholly free chunk
      source.deallocate_chunk(reinterpret_cast<void*>(it->first), it->second.bytes,
                              it->second.stream);
      released.emplace_back(it->first, it->second);
      reserved_ -= it->second.bytes;
      it = chunks_.erase(it);
    }
    return released;
  }

  [[nodiscard]] bool has_chunks() const noexcept { return !chunks_.empty(); }
  [[nodiscard]] std::size_t reserved_bytes() const noexcept { return reserved_; }
  [[nodiscard]] std::size_t used_bytes() const noexcept { return used_; }
  [[nodiscard]] const std::map<std::uintptr_t, chunk>& chunks() const noexcept { return chunks_; }

  /// The largest free range of any chunk.
  [[nodiscard]] std::size_t largest_free() const noexcept {
    std::size_t most = 0;
    for (const auto& [address, bytes] : free_) {
      most = std::max(most, bytes);
    }
    return most;
  }

  /// The chunk at `base` as consecutive pieces, free or handed out, covering it exactly.
  [[nodiscard]] std::vector<piece> pieces_of(std::uintptr_t base) const {
    std::vector<piece> out;
    const auto c = chunks_.find(base);
    if (c == chunks_.end()) {
      return out;
    }
    const std::uintptr_t end = base + c->second.bytes;
    std::uintptr_t at = base;
    for (auto f = free_.lower_bound(base); f != free_.end() && f->first < end; ++f) {
      if (f->first > at) {
        out.push_back({at, f->first - at, false});
      }
      out.push_back({f->first, f->second, true});
      at = f->first + f->second;
    }
    if (at < end) {
      out.push_back({at, end - at, false});
    }
    return out;
  }

 private:
  /// (stream, small, free bytes, address): best fit is the first key at or after a request.
  using key = std::tuple<std::uintptr_t, bool, std::size_t, std::uintptr_t>;
  static std::uintptr_t id(void* stream) noexcept { return reinterpret_cast<std::uintptr_t>(stream); }

  std::map<std::uintptr_t, chunk>::iterator chunk_of(std::uintptr_t at) {
    auto it = chunks_.upper_bound(at);
    --it;  // the caller's block lies in a chunk of this pool
    return it;
  }

  /// Marks [at, at + size), which lies in one free range, as handed out.
  void take(std::uintptr_t at, std::size_t size) {
    auto f = free_.upper_bound(at);
    --f;
    const std::uintptr_t start = f->first;
    const std::size_t bytes = f->second;
    remove_free(start);
    if (at > start) {
      add_free_unmerged(start, at - start);
    }
    if (at + size < start + bytes) {
      add_free_unmerged(at + size, start + bytes - (at + size));
    }
    chunk_of(at)->second.used += size;
    used_ += size;
  }

  /// Adds a free range, merged with free neighbours of the same chunk.
  void add_free(std::uintptr_t at, std::size_t size) {
    const auto c = chunk_of(at);
    const std::uintptr_t chunk_begin = c->first;
    const std::uintptr_t chunk_end = c->first + c->second.bytes;
    auto next = free_.lower_bound(at);
    if (next != free_.end() && next->first == at + size && next->first < chunk_end) {
      size += next->second;
      remove_free(next->first);
    }
    auto prev = free_.lower_bound(at);
    if (prev != free_.begin()) {
      --prev;
      if (prev->first >= chunk_begin && prev->first + prev->second == at) {
        at = prev->first;
        size += prev->second;
        remove_free(at);
      }
    }
    add_free_unmerged(at, size);
  }

  void add_free_unmerged(std::uintptr_t at, std::size_t size) {
    const chunk& c = chunk_of(at)->second;
    free_.emplace(at, size);
    by_size_.emplace(id(c.stream), c.small, size, at);
  }

  void remove_free(std::uintptr_t at) {
    const auto f = free_.find(at);
    const chunk& c = chunk_of(at)->second;
    by_size_.erase(key{id(c.stream), c.small, f->second, at});
    free_.erase(f);
  }

  bool no_split_;
  std::map<std::uintptr_t, chunk> chunks_;   ///< by base address
  std::map<std::uintptr_t, std::size_t> free_;  ///< free ranges by address
  std::set<key> by_size_;                    ///< the same, by stream, class and size
  std::size_t reserved_ = 0;
  std::size_t used_ = 0;
  std::uintptr_t last_new_chunk_ = 0;
};

}  // namespace cudamem::torch_bridge
