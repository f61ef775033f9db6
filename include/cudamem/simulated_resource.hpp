// cudamem/simulated_resource.hpp — a pretend device: hands out address ranges of a device of
// any capacity with no memory behind them, so pools, arenas and fragmentation experiments run
// at 80 GiB scale on a laptop or a CI machine with no GPU.
//
//   cudamem::simulated_resource h100;                     // 80 GiB, first fit, like cudaMalloc
//   cudamem::pool_resource pool{h100};                    // the pool's logic, no GPU needed
//   void* p = pool.allocate(1ull << 30);                   // an address, never to be dereferenced
//   pool.deallocate(p, 1ull << 30);
//
//   cudamem::simulated_resource paged{{.capacity = 80ull << 30,
//                                      .layout = cudamem::simulated_layout::paged}};
//
// Contract
// - Kind `device`, device -1 (no real device), `stats().capacity` = the capacity, so
//   memory_report treats the capacity as the device's total and (capacity - reserved) as free.
// - The addresses lie in a range of the address space no process can map (above 2^62), a
//   different range for each instance; nothing is ever read or written there, and a pointer
//   from one simulated_resource is foreign to every other.
// - Layouts:
//   `first_fit` (default) — one contiguous address range of `capacity` bytes; a request takes
//     the lowest free range that holds it (sizes rounded to `granularity`). Frees merge with
//     free neighbours. It fragments the way a device without virtual memory would: with
//     enough free bytes in total, a request fails when no single range is large enough. Used
//     directly it is the naive first-fit allocator that pools are compared with.
//   `paged` — like cudaMalloc on a modern GPU, which maps physical pages behind fresh virtual
//     addresses: a request fails only when the rounded bytes in use would exceed the capacity.
// - A request that does not fit throws `out_of_memory`, once vm_resources that draw their
//   physical memory from this device (simulated_vm_options::physical) have given back what
//   they hold ahead of need and it was tried again (detail/held_ahead.hpp), as on a real
//   device. Freeing a pointer it never gave out
//   (or twice), or with a size that does not match, goes to the error handler and changes
//   nothing.
// - Streams are ignored and no CUDA API is ever called: there is no device behind it.
// - Thread-safe (one mutex). The first-fit search is linear in the number of free ranges: it
//   is a model and a reference, not a fast allocator.
#pragma once

#include <cudamem/detail/held_ahead.hpp>
#include <cudamem/detail/sync/atomic.hpp>
#include <cudamem/detail/sync/mutex.hpp>
#include <cudamem/error.hpp>
#include <cudamem/memory_resource.hpp>
#include <cudamem/out_of_memory.hpp>

#include <bit>
#include <cstddef>
#include <cstdint>
#include <iterator>
#include <map>
#include <stdexcept>
#include <string>
#include <unordered_map>

namespace cudamem {

/// How a simulated device lays out its memory; see the contract above.
enum class simulated_layout {
  first_fit,  ///< one address range, lowest free range that fits: fragments like raw memory
  paged,      ///< fresh addresses for every request, capacity as a byte count: never fragments
};

/// How to create a `simulated_resource`.
struct simulated_options {
  std::size_t capacity = std::size_t{80} << 30;  ///< the pretend device's total memory
  simulated_layout layout = simulated_layout::first_fit;  ///< first fit (fragments) or paged
  std::size_t granularity = 256;  ///< sizes and addresses are multiples of it (power of two)
};

/// A pretend device with no memory behind it; see the contract above.
class simulated_resource final : public memory_resource {
 public:
  /// A pretend device of `options.capacity` bytes. Throws std::invalid_argument for a granularity
  /// that is not a power of two or a capacity outside [granularity, 2^46].
  explicit simulated_resource(simulated_options options = {})
      : memory_resource(memory_kind::device, -1), options_(options), base_(next_base()) {
    if (!std::has_single_bit(options_.granularity)) {
      throw std::invalid_argument("cudamem::simulated_resource: granularity " +
                                  std::to_string(options_.granularity) +
                                  " is not a power of two");
    }
    if (options_.capacity < options_.granularity || options_.capacity > address_range) {
      throw std::invalid_argument("cudamem::simulated_resource: capacity " +
                                  std::to_string(options_.capacity) + " is outside [" +
                                  std::to_string(options_.granularity) + ", 2^46]");
    }
    options_.capacity &= ~(options_.granularity - 1);
    free_ranges_.emplace(base_, options_.capacity);
  }

  ~simulated_resource() override = default;

  /// The pretend device's total memory.
  [[nodiscard]] std::size_t capacity() const noexcept { return options_.capacity; }
  /// How it lays out its memory.
  [[nodiscard]] simulated_layout layout() const noexcept { return options_.layout; }

  /// Bytes handed out and not yet freed (rounded to the granularity).
  [[nodiscard]] std::size_t used_bytes() const {
    const detail::lock_guard lock(mutex_);
    return used_;
  }
  /// The largest request that would succeed now.
  [[nodiscard]] std::size_t largest_free_range() const {
    const detail::lock_guard lock(mutex_);
    if (options_.layout == simulated_layout::paged) {
      return options_.capacity - used_;
    }
    std::size_t largest = 0;
    for (const auto& [start, size] : free_ranges_) {
      largest = size > largest ? size : largest;
    }
    return largest;
  }
  /// Number of separate free ranges (1 when nothing is allocated; first_fit layout).
  [[nodiscard]] std::size_t free_range_count() const {
    const detail::lock_guard lock(mutex_);
    return free_ranges_.size();
  }
  /// Whether `p` lies in this device's address range (given out or not).
  [[nodiscard]] bool contains(const void* p) const noexcept {
    const auto a = reinterpret_cast<std::uintptr_t>(p);
    return a >= base_ && a < base_ + address_range;
  }

 private:
  /// Every instance gets its own 2^46-byte (64 TiB) slice above 2^62: addresses there are not
  /// canonical on x86-64 (nor mappable on other 64-bit systems), so no real pointer equals one.
  static constexpr std::uintptr_t address_range = std::uintptr_t{1} << 46;

  static std::uintptr_t next_base() noexcept {
    static detail::atomic<std::uintptr_t> instances{0};
    const std::uintptr_t index = instances.fetch_add(1, detail::memory_order_relaxed) % 4096;
    return (std::uintptr_t{1} << 62) + index * address_range;
  }

  void* do_allocate(std::size_t bytes, std::size_t alignment, stream_view /*stream*/) override {
    return do_allocate_sync(bytes, alignment);
  }
  void do_deallocate(void* p, std::size_t bytes, std::size_t alignment,
                     stream_view /*stream*/) noexcept override {
    do_deallocate_sync(p, bytes, alignment);
  }

  void* do_allocate_sync(std::size_t bytes, std::size_t alignment) override {
    const std::size_t g = options_.granularity;
    if (bytes > options_.capacity) {
      throw_out_of_memory(*this, bytes, alignment, "simulated device: larger than the capacity");
    }
    const std::size_t size = (bytes + g - 1) & ~(g - 1);
    const std::size_t align = alignment > g ? alignment : g;
    detail::unique_lock lock(mutex_);
    std::uintptr_t address = take(size, align);
    if (address == 0) {
      // As a real device's resources do: memory vm_resources hold ahead of need on this
      // pretend device (simulated_vm_options::physical) gives way, then once more.
      lock.unlock();
      const std::size_t given_back = detail::give_back_held_ahead({-1, this});
      lock.lock();
      address = given_back != 0 ? take(size, align) : 0;
      if (address == 0) {
        lock.unlock();
        std::string cause = options_.layout == simulated_layout::paged
                                ? "simulated device: capacity exhausted"
                                : "simulated device: no free range large enough";
        if (given_back != 0) {
          cause += ", after vm_resources gave back " + format_bytes(given_back) +
                   " held ahead of need";
        }
        throw_out_of_memory(*this, bytes, alignment, std::move(cause));
      }
    }
    try {
      live_.emplace(address, size);
    } catch (...) {  // out of host memory for the bookkeeping: undo, then let bad_alloc out
      if (options_.layout == simulated_layout::first_fit) {
        give_back(address, size);
      }
      throw;
    }
    used_ += size;
    peak_ = used_ > peak_ ? used_ : peak_;
    return reinterpret_cast<void*>(address);
  }

  void do_deallocate_sync(void* p, std::size_t bytes, std::size_t /*alignment*/) noexcept override {
    const auto address = reinterpret_cast<std::uintptr_t>(p);
    const std::size_t g = options_.granularity;
    const std::size_t size = (bytes + g - 1) & ~(g - 1);
    const detail::lock_guard lock(mutex_);
    const auto it = live_.find(address);
    if (it == live_.end()) {
      report_problem("simulated_resource: deallocate of a pointer it did not give out (or a "
                     "double free); ignored");
      return;
    }
    if (it->second != size) {
      report_problem("simulated_resource: deallocate with a size that does not match the "
                     "allocation; the allocation's own size is freed");
    }
    const std::size_t freed = it->second;
    live_.erase(it);
    used_ -= freed;
    if (options_.layout == simulated_layout::first_fit) {
      give_back(address, freed);
    }
  }

  /// Where `size` bytes at `align` go (carved out of the free ranges); 0 when they do not fit.
  std::uintptr_t take(std::size_t size, std::size_t align) {
    if (options_.layout == simulated_layout::paged) {
      if (used_ + size > options_.capacity || paged_next_ + size + align > address_range) {
        return 0;
      }
      const std::uintptr_t start = base_ + paged_next_;
      const std::uintptr_t address = (start + align - 1) & ~(align - 1);
      paged_next_ = address + size - base_;
      return address;
    }
    return take_first_fit(size, align);
  }

  /// Lowest free range that holds `size` bytes at `align`; carves it out. 0 when none.
  std::uintptr_t take_first_fit(std::size_t size, std::size_t align) {
    for (auto it = free_ranges_.begin(); it != free_ranges_.end(); ++it) {
      const std::uintptr_t start = it->first;
      const std::size_t length = it->second;
      const std::uintptr_t aligned = (start + align - 1) & ~(align - 1);
      const std::size_t padding = aligned - start;
      if (length < padding || length - padding < size) {
        continue;
      }
      const std::size_t after = length - padding - size;
      free_ranges_.erase(it);
      if (padding != 0) {
        free_ranges_.emplace(start, padding);
      }
      if (after != 0) {
        free_ranges_.emplace(aligned + size, after);
      }
      return aligned;
    }
    return 0;
  }

  /// Returns [address, address + size) to the free ranges, merging with neighbours.
  void give_back(std::uintptr_t address, std::size_t size) noexcept {
    auto next = free_ranges_.lower_bound(address);
    if (next != free_ranges_.begin()) {
      auto prev = std::prev(next);
      if (prev->first + prev->second == address) {
        address = prev->first;
        size += prev->second;
        free_ranges_.erase(prev);
      }
    }
    if (next != free_ranges_.end() && address + size == next->first) {
      size += next->second;
      free_ranges_.erase(next);
    }
    try {
      free_ranges_.emplace(address, size);
    } catch (...) {  // a lost range is lost capacity, not corruption; say so
      report_problem("simulated_resource: out of host memory while freeing; range lost");
    }
  }

  std::string_view do_name() const noexcept override { return "simulated_resource"; }
  std::string do_oom_hint(const memory_report& report, std::size_t position) const override {
    // Only its own fragmentation (not a pool's above it) is the layout's to explain.
    if (report.verdict != oom_verdict::fragmentation || report.verdict_subject() != position ||
        options_.layout != simulated_layout::first_fit) {
      return {};
    }
    return "This simulated device lays memory out first fit (simulated_layout::first_fit), as "
           "memory without virtual addressing would: its free memory lies in ranges smaller "
           "than " + format_bytes(report.requested_bytes) + ". A real GPU's cudaMalloc maps "
           "pages behind fresh addresses instead (simulated_layout::paged); a pool or arena "
           "that takes its memory early in large chunks avoids asking for large ranges late.";
  }

  resource_stats do_stats() const override {
    const detail::lock_guard lock(mutex_);
    resource_stats s;
    s.reserved_bytes = used_;
    s.used_bytes = used_;
    s.peak_used_bytes = peak_;
    s.capacity = options_.capacity;
    return s;
  }

  bool do_is_equal(const memory_resource& other) const noexcept override { return this == &other; }

  simulated_options options_;
  std::uintptr_t base_;
  mutable detail::mutex mutex_;
  std::map<std::uintptr_t, std::size_t> free_ranges_;      ///< start -> length (first_fit)
  std::unordered_map<std::uintptr_t, std::size_t> live_;  ///< start -> rounded length
  std::uintptr_t paged_next_ = 0;                         ///< offset of the next fresh address
  std::size_t used_ = 0;
  std::size_t peak_ = 0;
};

}  // namespace cudamem
