// cudamem/memory_resource.hpp — the stream-ordered memory resource interface every allocator
// in cudamem implements, in the shape of std::pmr::memory_resource.
//
//   #include <cudamem/memory_resource.hpp>
//
//   void work(cudamem::memory_resource& mr, cudamem::stream_view s) {
//     void* p = mr.allocate(1 << 20, 256, s);   // usable by work on `s` at once
//     kernel<<<g, b, 0, s.get()>>>(p);
//     mr.deallocate(p, 1 << 20, 256, s);         // reusable by `s` at once; by other streams
//   }                                           // only after the kernel has finished
//
//   // Writing a resource: derive, pass the kind of memory and the device, implement do_*.
//   class my_resource final : public cudamem::memory_resource {
//    public:
//     my_resource() : memory_resource(cudamem::memory_kind::device, 0) {}
//    private:
//     void* do_allocate(std::size_t bytes, std::size_t align, cudamem::stream_view s) override;
//     void do_deallocate(void* p, std::size_t bytes, std::size_t align,
//                        cudamem::stream_view s) noexcept override;
//   };
//
// Contract (for callers; every resource in cudamem keeps it, and the tests check it)
// - Zero bytes: `allocate(0, ...)` returns nullptr and calls nothing; `deallocate(nullptr, ...)`
//   is a no-op.
// - Alignment must be a non-zero power of two, else `std::invalid_argument`. The pointer
//   returned is aligned to at least `alignment`. `default_alignment` (256 bytes, what
//   cudaMalloc guarantees) is used when none is given.
// - A request the resource cannot meet throws `cudamem::out_of_memory` (a std::bad_alloc)
//   carrying a `memory_report` (bytes asked, device free/total, what each resource in the chain
//   holds, and a verdict). Nothing is leaked when it is thrown.
// - `deallocate` takes the same bytes and alignment that `allocate` was given, is noexcept,
//   and reports a failure (a CUDA error, a pointer it never gave out) to the error handler.
// - Stream order: memory from `allocate(bytes, align, s)` may be used at once by work
//   submitted to `s` afterwards, and by other streams or the host only after synchronising
//   with `s`. `deallocate(p, bytes, align, s)` says "the last use of p was submitted to s":
//   the resource may give p out again at once to a request on `s` (stream order keeps the
//   two apart), and to any other stream only once that work has finished (a resource tracks
//   this with events or synchronises; it never guesses).
// - The synchronous forms `allocate(bytes, align)` / `deallocate(p, bytes, align)` need no
//   stream: the memory is usable by any stream and the host on return, and the caller
//   promises no work still uses memory it frees.
// - `kind()` says what memory it gives (device, pinned host, managed, host), `device()` which
//   device it belongs to (-1 for plain host memory); owners use them to refuse a resource of
//   the wrong kind with a clear error. The resource allocates on its own device whatever
//   device is current.
// - A resource must outlive every allocation it made and every owner that refers to it.
// - Every allocate takes the caller's `std::source_location` as a defaulted last argument, so
//   a tracking adaptor anywhere down the chain can name the user's line
//   (`current_allocation_site()`); owners pass their own caller's location through.
// - `oom_hint(report, position)`: a resource may advise on its own failures (what its options
//   and calls can do); memory_report.hpp asks it. Default: nothing.
// - The CCCL names are here too (`allocate_async`/`deallocate_async`, `allocate_sync`/
//   `deallocate_sync`), so cudamem resources satisfy `cuda::mr::async_resource`.
#pragma once

#include <cudamem/stream.hpp>

#include <bit>
#include <cstddef>
#include <optional>
#include <source_location>
#include <stdexcept>
#include <string>
#include <string_view>

namespace cudamem {

struct memory_report;  // memory_report.hpp: what a resource is asked to advise on

/// The alignment used when none is given: what cudaMalloc guarantees.
inline constexpr std::size_t default_alignment = 256;

/// What kind of memory a resource gives out.
enum class memory_kind {
  device,   ///< device memory: kernels only
  pinned,   ///< page-locked host memory: host, kernels (mapped), and fast copies
  managed,  ///< unified memory: host and kernels, migrated on demand
  host,     ///< ordinary host memory: host only
};

/// Whether the host can read and write memory of this kind (all kinds but `device`).
[[nodiscard]] constexpr bool is_host_accessible(memory_kind kind) noexcept {
  return kind != memory_kind::device;
}
/// Whether kernels can read and write memory of this kind (all kinds but `host`).
[[nodiscard]] constexpr bool is_device_accessible(memory_kind kind) noexcept {
  return kind != memory_kind::host;
}
/// The kind as messages name it: "device", "pinned host", "managed", "host".
[[nodiscard]] constexpr std::string_view to_string(memory_kind kind) noexcept {
  switch (kind) {
    case memory_kind::device: return "device";
    case memory_kind::pinned: return "pinned host";
    case memory_kind::managed: return "managed";
    case memory_kind::host: return "host";
  }
  return "unknown";
}

/// What a resource can say about the memory it holds. Leaf resources (that get memory
/// straight from CUDA or the OS) hold exactly what they handed out; pools and arenas hold more.
struct resource_stats {
  std::size_t reserved_bytes = 0;  ///< held from the upstream (or the device)
  std::size_t used_bytes = 0;      ///< handed out and not yet freed
  std::size_t peak_used_bytes = 0; ///< the most `used_bytes` has been
  std::optional<std::size_t> free_blocks;         ///< pools only: free blocks held
  std::optional<std::size_t> largest_free_block;  ///< pools only: the largest of them
  std::optional<std::size_t> budget;              ///< limiting resources: the byte budget
  std::optional<std::size_t> capacity;            ///< simulated devices: their whole size
  std::optional<std::size_t> held_elsewhere;      ///< simulated devices: bytes "other processes"
                                                  ///< hold (not free, not ours)
  std::size_t held_beside = 0;  ///< device memory held outside its chain of upstreams (a
                                ///< vm_pool's bulk blocks): a report counts it as the chain's

  /// Bytes held but not handed out.
  [[nodiscard]] std::size_t free_bytes() const noexcept {
    return reserved_bytes > used_bytes ? reserved_bytes - used_bytes : 0;
  }
  /// 1 - largest free block / free bytes: 0 when all free memory is one block, near 1 when
  /// it is scattered in small pieces. 0 when nothing is free or the resource cannot tell.
  [[nodiscard]] double fragmentation() const noexcept {
    const std::size_t free = free_bytes();
    if (free == 0 || !largest_free_block) {
      return 0.0;
    }
    return 1.0 - static_cast<double>(*largest_free_block) / static_cast<double>(free);
  }
};

namespace detail {

/// The call site of the outermost `allocate` running on this thread (nullptr when none).
inline thread_local const std::source_location* outermost_allocation_site = nullptr;

/// Records `where` as the allocation site for the duration of one outermost allocate call.
/// Nested calls (a pool asking its upstream) leave the user's site in place.
class allocation_site_scope {
 public:
  explicit allocation_site_scope(const std::source_location& where) noexcept
      : owner_(outermost_allocation_site == nullptr) {
    if (owner_) {
      outermost_allocation_site = &where;
    }
  }
  ~allocation_site_scope() {
    if (owner_) {
      outermost_allocation_site = nullptr;
    }
  }
  allocation_site_scope(const allocation_site_scope&) = delete;
  allocation_site_scope& operator=(const allocation_site_scope&) = delete;

 private:
  bool owner_;
};

}  // namespace detail

/// Where the allocation being served on this thread was requested: the user's line, passed in
/// through `allocate(..., where)` (owners such as device_buffer forward their own caller's).
/// Tracking adaptors call this from their do_allocate. Empty location outside an allocate.
[[nodiscard]] inline std::source_location current_allocation_site() noexcept {
  const std::source_location* site = detail::outermost_allocation_site;
  return site != nullptr ? *site : std::source_location{};
}

/// The base of every cudamem memory resource; see the contract above.
class memory_resource {
 public:
  virtual ~memory_resource() = default;

  memory_resource(const memory_resource&) = delete;
  memory_resource& operator=(const memory_resource&) = delete;

  // --- stream-ordered -----------------------------------------------------------------------

  /// `bytes` of memory aligned to `alignment`, usable in stream order on `stream`.
  /// `where` is the caller's line, kept for tracking adaptors (see current_allocation_site).
  [[nodiscard]] void* allocate(std::size_t bytes, std::size_t alignment, stream_view stream,
                               std::source_location where = std::source_location::current()) {
    if (bytes == 0) {
      return nullptr;
    }
    validate_alignment(alignment);
    const detail::allocation_site_scope site{where};
    return do_allocate(bytes, alignment, stream);
  }

  /// Returns memory whose last use was submitted to `stream`.
  void deallocate(void* p, std::size_t bytes, std::size_t alignment, stream_view stream) noexcept {
    if (p != nullptr) {
      do_deallocate(p, bytes, alignment, stream);
    }
  }

  // --- synchronous ----------------------------------------------------------------------------

  /// `bytes` of memory usable by any stream and the host on return.
  [[nodiscard]] void* allocate(std::size_t bytes, std::size_t alignment = default_alignment,
                               std::source_location where = std::source_location::current()) {
    if (bytes == 0) {
      return nullptr;
    }
    validate_alignment(alignment);
    const detail::allocation_site_scope site{where};
    return do_allocate_sync(bytes, alignment);
  }

  /// Returns memory that no pending work uses any more.
  void deallocate(void* p, std::size_t bytes, std::size_t alignment = default_alignment) noexcept {
    if (p != nullptr) {
      do_deallocate_sync(p, bytes, alignment);
    }
  }

  // --- the names CCCL's cuda::mr concepts look for ----------------------------------------------

  /// The stream-ordered `allocate`, under CCCL's name.
  [[nodiscard]] void* allocate_async(std::size_t bytes, std::size_t alignment, stream_view s,
                                     std::source_location where = std::source_location::current()) {
    return allocate(bytes, alignment, s, where);
  }
  /// The stream-ordered `deallocate`, under CCCL's name.
  void deallocate_async(void* p, std::size_t bytes, std::size_t alignment, stream_view s) noexcept {
    deallocate(p, bytes, alignment, s);
  }
  /// The synchronous `allocate`, under CCCL's name.
  [[nodiscard]] void* allocate_sync(std::size_t bytes, std::size_t alignment = default_alignment,
                                    std::source_location where = std::source_location::current()) {
    return allocate(bytes, alignment, where);
  }
  /// The synchronous `deallocate`, under CCCL's name.
  void deallocate_sync(void* p, std::size_t bytes,
                       std::size_t alignment = default_alignment) noexcept {
    deallocate(p, bytes, alignment);
  }

  // --- what it is -----------------------------------------------------------------------------

  /// Whether memory from `other` may be freed through this resource and vice versa.
  [[nodiscard]] bool is_equal(const memory_resource& other) const noexcept {
    return this == &other || do_is_equal(other);
  }
  /// `a.is_equal(b)`.
  friend bool operator==(const memory_resource& a, const memory_resource& b) noexcept {
    return a.is_equal(b);
  }

  /// What kind of memory it gives out: who can reach it (device, host or both).
  [[nodiscard]] memory_kind kind() const noexcept { return kind_; }
  /// The device the memory belongs to; -1 for plain host memory.
  [[nodiscard]] int device() const noexcept { return device_; }
  /// A short name for reports ("pool_resource").
  [[nodiscard]] std::string_view name() const noexcept { return do_name(); }
  /// What the resource holds now.
  [[nodiscard]] resource_stats stats() const { return do_stats(); }
  /// The resource this one gets its memory from; nullptr for a leaf.
  [[nodiscard]] memory_resource* upstream() const noexcept { return do_upstream(); }
  /// Whether a sub-allocator over this resource may describe its chunks to compute-sanitizer
  /// as NVTX heaps (detail/nvtx.hpp). Only plain device allocations qualify: the tool refuses
  /// a heap inside another heap's region (a pool's block) or inside VMM-mapped memory, and
  /// counts each refusal as an error. false unless a resource says otherwise; adaptors ask
  /// their upstream.
  [[nodiscard]] bool allows_nvtx_heaps() const noexcept { return do_allows_nvtx_heaps(); }

  /// Advice of this resource's own for a failed request, or empty: what its options and
  /// calls can do about `report`'s verdict. `position` is where it stands in report.chain.
  /// The report asks (memory_report.hpp's contract); a resource overrides do_oom_hint.
  [[nodiscard]] std::string oom_hint(const memory_report& report, std::size_t position) const {
    return do_oom_hint(report, position);
  }

 protected:
  /// For derived resources: the kind and device of the memory they give out.
  memory_resource(memory_kind kind, int device) noexcept : kind_(kind), device_(device) {}

  /// For adaptors, which pass on a request their own `allocate` has already checked (bytes
  /// non-zero, alignment valid, call site recorded): straight to `upstream`'s implementation,
  /// without checking it a second time at every level of a chain.
  static void* allocate_checked(memory_resource& upstream, std::size_t bytes,
                                std::size_t alignment, stream_view stream) {
    return upstream.do_allocate(bytes, alignment, stream);
  }
  /// The synchronous form: to `upstream`'s synchronous implementation.
  static void* allocate_checked(memory_resource& upstream, std::size_t bytes,
                                std::size_t alignment) {
    return upstream.do_allocate_sync(bytes, alignment);
  }

  /// Throws std::invalid_argument unless `alignment` is a non-zero power of two.
  static void validate_alignment(std::size_t alignment) {
    // The bit trick, not std::has_single_bit: without -mpopcnt that is a call into libgcc on
    // every allocate, at every level of an adaptor chain.
    if (alignment == 0 || (alignment & (alignment - 1)) != 0) [[unlikely]] {
      throw std::invalid_argument("cudamem: alignment " + std::to_string(alignment) +
                                  " is not a power of two");
    }
  }

 private:
  /// Implements the stream-ordered `allocate` (bytes non-zero, alignment checked).
  virtual void* do_allocate(std::size_t bytes, std::size_t alignment, stream_view stream) = 0;
  /// Implements the stream-ordered `deallocate` (p non-null); reports failures, never throws.
  virtual void do_deallocate(void* p, std::size_t bytes, std::size_t alignment,
                             stream_view stream) noexcept = 0;

  /// Default: allocate on the legacy default stream, then wait for it, so the memory is ready
  /// for everyone. Host-only resources override this to touch no CUDA API.
  virtual void* do_allocate_sync(std::size_t bytes, std::size_t alignment) {
    void* p = do_allocate(bytes, alignment, stream_view{});
    const cudaError_t code = cudaStreamSynchronize(nullptr);
    if (code != cudaSuccess) {
      do_deallocate(p, bytes, alignment, stream_view{});
      check(code, "cudaStreamSynchronize after a synchronous allocation");
    }
    return p;
  }
  /// Default: the caller promised no pending work uses `p`, so the legacy stream will do.
  virtual void do_deallocate_sync(void* p, std::size_t bytes, std::size_t alignment) noexcept {
    do_deallocate(p, bytes, alignment, stream_view{});
  }

  /// Implements `is_equal` for another object. Default: only the same object is equal.
  virtual bool do_is_equal(const memory_resource& /*other*/) const noexcept { return false; }
  /// Implements `name()`.
  virtual std::string_view do_name() const noexcept { return "memory_resource"; }
  /// Implements `stats()`. Default: all zero.
  virtual resource_stats do_stats() const { return {}; }
  /// Implements `upstream()`. Default: nullptr, a leaf.
  virtual memory_resource* do_upstream() const noexcept { return nullptr; }
  /// Implements `allows_nvtx_heaps()`. Default: false.
  virtual bool do_allows_nvtx_heaps() const noexcept { return false; }
  /// Default: nothing of its own to say; the report's general advice for the verdict stands.
  virtual std::string do_oom_hint(const memory_report& /*report*/,
                                  std::size_t /*position*/) const {
    return {};
  }

  memory_kind kind_;
  int device_;
};

}  // namespace cudamem
