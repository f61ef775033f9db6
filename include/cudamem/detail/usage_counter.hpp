// cudamem/detail/usage_counter.hpp — the bytes a resource has handed out and the most it ever
// had, counted without a lock, and raise_to, the peak update they share with the adaptors.
//
//   cudamem::detail::usage_counter usage;
//   usage.add(bytes);                 // after an allocation succeeded
//   usage.subtract(bytes);            // after the free
//   resource_stats s = usage.leaf_stats();
//
//   std::atomic<std::size_t> peak{0};
//   cudamem::detail::raise_to(peak, now);   // peak = max(peak, now), whoever else raises it
//
// Why a compare-exchange loop and not a load and a store: two threads that each read the old
// peak and store their own value can lower it. The loop stores only while its value is still
// larger than what it last read, so the peak only ever rises. Relaxed order throughout: these
// are statistics, read for reports, never to decide who owns memory.
#pragma once

#include <cudamem/detail/sync/atomic.hpp>
#include <cudamem/memory_resource.hpp>

#include <cstddef>

namespace cudamem::detail {

/// Raises `peak` to at least `value` whoever else raises it at the same time.
template <class Atomic, class Value>
void raise_to(Atomic& peak, Value value) noexcept {
  Value seen = peak.load(memory_order_relaxed);
  while (value > seen && !peak.compare_exchange_weak(seen, value, memory_order_relaxed)) {
  }
}

/// Bytes handed out and not yet returned, and the most there ever were. Lock-free.
class usage_counter {
 public:
  void add(std::size_t bytes) noexcept {
    raise_to(peak_, used_.fetch_add(bytes, memory_order_relaxed) + bytes);
  }
  void subtract(std::size_t bytes) noexcept { used_.fetch_sub(bytes, memory_order_relaxed); }
  [[nodiscard]] std::size_t used() const noexcept { return used_.load(memory_order_relaxed); }
  [[nodiscard]] std::size_t peak() const noexcept { return peak_.load(memory_order_relaxed); }

  /// reserved == used: leaf resources hold exactly what they handed out.
  [[nodiscard]] resource_stats leaf_stats() const noexcept {
    resource_stats s;
    s.used_bytes = s.reserved_bytes = used();
    s.peak_used_bytes = peak();
    return s;
  }

 private:
  atomic<std::size_t> used_{0};
  atomic<std::size_t> peak_{0};
};

}  // namespace cudamem::detail
