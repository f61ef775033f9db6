// cudamem/detail/held_bytes.hpp — a count of bytes held from below, with its peak.
//
//   held_bytes reserved;
//   reserved += 64 << 20;            // a chunk or a handle taken
//   reserved -= 64 << 20;            // given back
//   reserved.peak();                 // 64 MiB: the most held since the last reset_peak()
//
// Why: "peak reserved" (torch.cuda.max_memory_reserved, a snapshot's figures) is the most a
// resource held at any moment, which no later reading can recover. The owners' counts were
// plain integers changed in a few places under their locks; this keeps those places as they
// were (+=, -=, read as a number) and the peak with them.
//
// Not thread-safe: the owner's lock guards it, as it guarded the count.
#pragma once

#include <algorithm>
#include <cstddef>

namespace cudamem::detail {

/// Bytes held, and the most held since the last reset_peak().
class held_bytes {
 public:
  operator std::size_t() const noexcept { return bytes_; }  // NOLINT: a count, read as one
  held_bytes& operator+=(std::size_t n) noexcept {
    bytes_ += n;
    peak_ = std::max(peak_, bytes_);
    return *this;
  }
  held_bytes& operator-=(std::size_t n) noexcept {
    bytes_ -= n;
    return *this;
  }
  [[nodiscard]] std::size_t peak() const noexcept { return peak_; }
  void reset_peak() noexcept { peak_ = bytes_; }

 private:
  std::size_t bytes_ = 0;
  std::size_t peak_ = 0;
};

}  // namespace cudamem::detail
