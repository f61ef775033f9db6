// cudamem/vm_pool_resource.hpp — a pool whose address space is virtual: pool_resource's speed,
// and free memory that is always usable, wherever the frees left it.
//
//   #include <cudamem/vm_pool_resource.hpp>
//
//   cudamem::vm_pool_resource pool{0};                   // device 0
//   cudamem::stream s;
//   void* a = pool.allocate(64 << 20, 256, s);           // pool-fast once memory is mapped
//   pool.deallocate(a, 64 << 20, 256, s);
//   cudamem::vm_pool_stats st = pool.vm_stats();         // virtual, mapped, in use, waste
//   pool.release();                                      // give wholly free memory back
//
//   cudamem::vm_pool_resource shared{0, {.peers = {1}}}; // device 1 may read and write it too
//
// What it is: a `pool_resource` over a `vm_resource`, owned together.
// - The pool (pool_resource.hpp) does every allocate and deallocate: TLSF, shards, stream
//   order; it asks its upstream only for chunks (64 MiB chunks, apart, for requests up to
//   4 MiB and for medium ones; a chunk of its own for every request of 64 MiB or more: see
//   vm_pool_chunking()).
// - The upstream (vm_resource.hpp) maps physical memory behind fresh virtual ranges. When it
//   cannot supply a chunk (the device is full), the pool gives back every chunk it holds
//   wholly free and asks again; the upstream then recycles as many of those chunks' physical
//   handles as the request lacks into one contiguous range. So two free 64 MiB chunks become a
//   128 MiB one (two handles moved: ~50-80 µs of driver time), and the memory that
//   frees left behind serves whatever comes next: swiss cheese and mixed traces use nearly
//   all of the device, at the pool's speed (the upstream is called per chunk, not per block).
// - Chunks of a handle (64 MiB) or more are placed on whole handles, so a wholly free chunk is
//   wholly recyclable; only chunks smaller than a handle share one (`stranded_bytes` reports
//   free memory held that way). Measured over the simulated 80 GiB device: swiss cheese 1.00,
//   the mixed trace of bench/support/fragmentation.hpp 0.99 of the device live at failure.
//
// Contract (memory_resource.hpp's, pool_resource.hpp's and vm_resource.hpp's, plus)
// - Construction: as vm_resource (`no_device_error`, `std::out_of_range`,
//   `vm_not_supported_error`, `std::invalid_argument`); `pool` options as pool_resource's.
// - Stream order is the pool's: the pool synchronises the device before it gives the upstream
//   a chunk with frees still pending (once per give-back, not per chunk), so physical memory
//   is never recycled, nor unmapped, while a kernel may still use it.
// - `release()` returns the pool's wholly free chunks and then every wholly free handle to the
//   driver; returns the physical bytes given back.
// - Failure throws `out_of_memory` once the pool has given back what it could and the
//   upstream has recycled and grown as far as it can; its report names both, and its hint
//   (for fragmentation: what release() and the options can and cannot do; over
//   physical_limit: that limit) is this resource's own.
#pragma once

#include <cudamem/detail/vm/driver_mapping.hpp>
#include <cudamem/device.hpp>
#include <cudamem/memory_report.hpp>
#include <cudamem/memory_resource.hpp>
#include <cudamem/out_of_memory.hpp>
#include <cudamem/pool_resource.hpp>
#include <cudamem/vm_resource.hpp>

#include <cstddef>
#include <memory>
#include <optional>
#include <source_location>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace cudamem {

/// The pool's chunking under a vm_resource: requests up to 4 MiB share 64 MiB small chunks
/// (one handle each), so long-lived blocks of up to 4 MiB never sit in the chunks that large
/// blocks come and go in; medium requests use 64 MiB chunks; 64 MiB and more get chunks of
/// their own. Every chunk is whole handles, so a wholly free chunk is wholly recyclable.
[[nodiscard]] inline pool_options vm_pool_chunking() noexcept {
  pool_options o;
  o.small_block_limit = std::size_t{4} << 20;
  o.small_chunk_size = std::size_t{64} << 20;
  o.growth_step = std::size_t{64} << 20;
  return o;
}

/// How to build a vm_pool_resource: the upstream's options (handle and growth sizes,
/// reservations, physical limit, peers; see vm_resource_options) and the pool's.
struct vm_pool_options : vm_resource_options {
  /// The pool's options (see vm_pool_chunking). Keep chunk sizes multiples of handle_bytes,
  /// so a wholly free chunk is whole handles the upstream can recycle.
  pool_options pool = vm_pool_chunking();
};

/// What a vm_pool_resource holds: the upstream's virtual-memory figures, the pool's blocks.
struct vm_pool_stats : vm_resource_stats {
  std::size_t pool_used_bytes = 0;       ///< blocks handed out by the pool
  std::size_t pool_free_bytes = 0;       ///< free in the pool's chunks
  std::size_t pool_largest_free_block = 0;
  std::size_t pool_chunks = 0;           ///< chunks the pool holds from the upstream
};

/// A pool_resource over a vm_resource; see the contract above.
class vm_pool_resource final : public memory_resource {
 public:
  /// A pool on `device` (the current device by default).
  explicit vm_pool_resource(int device = -1, vm_pool_options options = {},
                            std::source_location where = std::source_location::current())
      : vm_pool_resource(std::make_unique<detail::driver_vm_mapping>(
                             device >= 0 ? device : current_device(), options.peers,
                             options.exportable, where),
                         options) {}

  /// A pool over any mapping layer (tests: detail::simulated_vm_mapping).
  explicit vm_pool_resource(std::unique_ptr<detail::vm_mapping_layer> layer,
                            vm_pool_options options = {})
      : memory_resource(memory_kind::device, layer ? layer->device() : -1),
        vm_(std::move(layer), static_cast<const vm_resource_options&>(options)),
        pool_(vm_, options.pool) {}

  vm_pool_resource(const vm_pool_resource&) = delete;
  vm_pool_resource& operator=(const vm_pool_resource&) = delete;
  ~vm_pool_resource() override = default;  // the pool goes first, then the upstream

  /// Gives the pool's wholly free chunks back to the upstream, then the upstream's wholly free
  /// handles back to the driver; returns the physical bytes given back.
  std::size_t release() {
    pool_.release();
    return vm_.release();
  }

  /// The upstream's virtual-memory figures and the pool's blocks (walks lists: not for hot loops).
  [[nodiscard]] vm_pool_stats vm_stats() const {
    vm_pool_stats s;
    static_cast<vm_resource_stats&>(s) = vm_.vm_stats();
    const resource_stats p = pool_.stats();
    s.pool_used_bytes = p.used_bytes;
    s.pool_free_bytes = p.free_bytes();
    s.pool_largest_free_block = p.largest_free_block.value_or(0);
    s.pool_chunks = pool_.chunk_count();
    return s;
  }

  [[nodiscard]] pool_resource& pool() noexcept { return pool_; }
  [[nodiscard]] vm_resource& upstream_vm() noexcept { return vm_; }
  /// The mapping layer (tests inspect the simulated one).
  [[nodiscard]] detail::vm_mapping_layer& mapping_layer() const noexcept {
    return vm_.mapping_layer();
  }

 private:
  // A failure is re-reported from here, so the report's chain starts at the resource the
  // caller used (this, then the upstream) and keeps the pool's cause.
  void* do_allocate(std::size_t bytes, std::size_t alignment, stream_view stream) override {
    try {
      return pool_.allocate(bytes, alignment, stream);
    } catch (const out_of_memory& e) {
      throw_out_of_memory(*this, bytes, alignment, e.report().cause);
    }
  }
  void* do_allocate_sync(std::size_t bytes, std::size_t alignment) override {
    try {
      return pool_.allocate(bytes, alignment);
    } catch (const out_of_memory& e) {
      throw_out_of_memory(*this, bytes, alignment, e.report().cause);
    }
  }
  void do_deallocate(void* p, std::size_t bytes, std::size_t alignment,
                     stream_view stream) noexcept override {
    pool_.deallocate(p, bytes, alignment, stream);
  }
  void do_deallocate_sync(void* p, std::size_t bytes, std::size_t alignment) noexcept override {
    pool_.deallocate(p, bytes, alignment);
  }
  bool do_is_equal(const memory_resource& other) const noexcept override { return this == &other; }
  std::string_view do_name() const noexcept override { return "vm_pool_resource"; }
  resource_stats do_stats() const override { return pool_.stats(); }
  memory_resource* do_upstream() const noexcept override {
    return const_cast<vm_resource*>(&vm_);  // the chain a report walks: this, then the upstream
  }
  // Advice on its own failures (memory_report asks): what release() and the options can do.
  std::string do_oom_hint(const memory_report& report, std::size_t /*position*/) const override {
    const vm_pool_stats s = vm_stats();
    const resource_stats& vm = report.chain.back().stats;  // the upstream vm_resource
    if (report.verdict == oom_verdict::budget && vm.budget &&
        vm.used_bytes + report.requested_bytes > *vm.budget) {
      return "This vm_pool_resource may map at most " + format_bytes(*vm.budget) +
             " (vm_pool_options::" +
             "physical_limit) and has " + format_bytes(s.mapped_bytes) + " mapped: raise "
             "physical_limit, or free blocks before this request.";
    }
    if (report.verdict != oom_verdict::fragmentation) {
      return {};
    }
    return "This vm_pool_resource has " + format_bytes(s.pool_free_bytes) + " free in its " +
           std::to_string(s.pool_chunks) + " chunks, in blocks of at most " +
           format_bytes(s.pool_largest_free_block) + ": before failing it gave its wholly free "
           "chunks back and recycled their handles into one range, so what stays free shares "
           "chunks with blocks in use (" + format_bytes(s.stranded_bytes) + " in " +
           format_bytes(s.handle_bytes) + " handles shared with live blocks). release() "
           "returns wholly free handles to the driver, for other processes and resources; it "
           "cannot move live blocks. Smaller handles and chunks pin less beside a live block "
           "(vm_pool_options::handle_bytes, pool.small_chunk_size, pool.growth_step); or free "
           "long-lived blocks, or allocate the largest buffers first.";
  }

  vm_resource vm_;
  pool_resource pool_;
};

}  // namespace cudamem
