// cudamem/_torch/snapshot_layout.hpp — a memory snapshot's picture of cudamem: segments (what
// cudamem holds from the device), each cut into the blocks PyTorch holds and the free gaps
// between them.
//
//   std::vector<span> held = subtract(mapped_ranges, graph_pool_chunks);  // the default pool's
//   layout l = lay_out(held, live_blocks);       // live_blocks: (address, bytes) by address
//   for (const laid_segment& s : l.segments) {
//     for (const laid_piece& p : s.pieces) { ... p.block is an index into live_blocks, or
//                                            npos for free memory ... }
//   }
//   // l.loose: live blocks inside no segment (a resource that cannot list its memory):
//   //          each becomes a segment of its own.
//
// Why this shape: PyTorch's snapshot format (and torch.cuda._memory_viz, and CUDA graph trees)
// rebuilds each block's address by adding up the sizes of the blocks before it in its segment,
// so a segment's blocks must cover it exactly, in address order. cudamem's own picture is
// different — mapped ranges of virtual memory, with blocks wherever the pool put them — and
// this turns one into the other.
//
// Contract: inputs sorted by address; blocks do not overlap. A block that lies across a
// segment's edge is treated as loose (never cut). Pure functions: no CUDA, no locks.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <vector>

namespace cudamem::torch_bridge {

struct span {
  std::uintptr_t address = 0;
  std::size_t bytes = 0;
  [[nodiscard]] std::uintptr_t end() const noexcept { return address + bytes; }
};

inline constexpr std::size_t npos = std::numeric_limits<std::size_t>::max();

struct laid_piece {
  std::uintptr_t address;
  std::size_t bytes;
  std::size_t block;  ///< index into the blocks given, or npos: free memory
};

struct laid_segment {
  span range;
  std::vector<laid_piece> pieces;  ///< cover `range` exactly, in address order
};

struct layout {
  std::vector<laid_segment> segments;
  std::vector<std::size_t> loose;  ///< indices of blocks inside no segment
};

/// `ranges` with every `hole` taken out (holes lie inside ranges, or are ignored where not).
[[nodiscard]] inline std::vector<span> subtract(const std::vector<span>& ranges,
                                                const std::vector<span>& holes) {
  std::vector<span> out;
  auto h = holes.begin();
  for (const span& r : ranges) {
    std::uintptr_t at = r.address;
    while (h != holes.end() && h->end() <= r.address) {
      ++h;
    }
    for (auto k = h; k != holes.end() && k->address < r.end(); ++k) {
      const std::uintptr_t begin = std::max(k->address, r.address);
      const std::uintptr_t end = std::min(k->end(), r.end());
      if (begin > at) {
        out.push_back({at, begin - at});
      }
      at = std::max(at, end);
    }
    if (at < r.end()) {
      out.push_back({at, r.end() - at});
    }
  }
  return out;
}

/// Lays `blocks` out in `segments` (both sorted by address; see the contract).
[[nodiscard]] inline layout lay_out(const std::vector<span>& segments,
                                    const std::vector<span>& blocks) {
  layout l;
  l.segments.reserve(segments.size());
  std::vector<bool> placed(blocks.size(), false);
  std::size_t b = 0;
  for (const span& s : segments) {
    laid_segment seg{s, {}};
    while (b < blocks.size() && blocks[b].address < s.address) {
      ++b;  // before this segment: loose, unless an earlier segment took it
    }
    std::uintptr_t at = s.address;
    for (; b < blocks.size() && blocks[b].address < s.end(); ++b) {
      if (blocks[b].end() > s.end()) {
        continue;  // across the edge: loose
      }
      if (blocks[b].address > at) {
        seg.pieces.push_back({at, blocks[b].address - at, npos});
      }
      seg.pieces.push_back({blocks[b].address, blocks[b].bytes, b});
      placed[b] = true;
      at = blocks[b].end();
    }
    if (at < s.end()) {
      seg.pieces.push_back({at, s.end() - at, npos});
    }
    l.segments.push_back(std::move(seg));
  }
  for (std::size_t i = 0; i < blocks.size(); ++i) {
    if (!placed[i]) {
      l.loose.push_back(i);
    }
  }
  return l;
}

/// A used range of a graph pool's chunk, cut into the blocks that tile it, in address order.
/// (The pool knows its free ranges, not its blocks: two blocks side by side are one used range,
/// and a snapshot that showed them as one block would count one tensor where there are two.)
/// `block_bytes(address)` is the size of the live block that starts there, 0 if none does.
/// Where no block starts, the rest of the range stays with the block before it (or, at the
/// start, the range is returned whole): what cannot be told apart is shown as before.
template <class BlockBytes>
std::vector<span> blocks_tiling(span used, BlockBytes block_bytes) {
  std::vector<span> out;
  std::uintptr_t at = used.address;
  while (at < used.end()) {
    const std::size_t bytes = block_bytes(at);
    if (bytes == 0 || bytes > used.end() - at) {
      if (out.empty()) {
        out.push_back(used);
      } else {
        out.back().bytes = used.end() - out.back().address;
      }
      break;
    }
    out.push_back({at, bytes});
    at += bytes;
  }
  return out;
}

}  // namespace cudamem::torch_bridge
