// cudamem/detail/vm/pool_core.hpp — vm_pool_resource's state and its code: the code behind
// vm_pool_resource.hpp's declarations.
//
//   // vm_pool_resource.hpp includes this at its end (header-only), or the cudamem::compiled
//   // library compiles it once (detail/compiled.hpp); nothing else includes it.
//   vm_pool_core& c = core();                          // in place, inside the vm_pool_resource
//   void* p = bytes >= c.large ? allocate_large(bytes, alignment, &stream)  // the resource's
//                              : allocate_small(bytes, alignment, &stream);  // own members
//
// What it owns, in the order it makes them (and destroys them in reverse: the pool first, then
// the adaptor, then the upstream): the vm_resource, the upstream_adaptor's resource, the
// cudaMalloc'd memory used under compute-sanitizer, the bulk blocks' vm_resource, the pool,
// and the ledger of blocks of a handle or more (large_blocks.hpp). vm_pool_resource.hpp's
// contract says what each is for.
#pragma once

#include <cudamem/detail/compiled.hpp>
#include <cudamem/detail/nvtx.hpp>
#include <cudamem/detail/sync/atomic.hpp>
#include <cudamem/detail/vm/driver_mapping.hpp>
#include <cudamem/detail/vm/large_blocks.hpp>
#include <cudamem/detail/vm/pool_options.hpp>
#include <cudamem/detail/vm/pool_sources.hpp>
#include <cudamem/device.hpp>
#include <cudamem/device_resource.hpp>
#include <cudamem/memory_resource.hpp>
#include <cudamem/out_of_memory.hpp>
#include <cudamem/pool_resource.hpp>
#include <cudamem/vm_pool_resource.hpp>
#include <cudamem/vm_resource.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <new>
#include <source_location>
#include <string>
#include <utility>
#include <vector>

namespace cudamem::detail {

class vm_pool_core {
 public:
  vm_pool_core(std::unique_ptr<vm_mapping_layer> layer,
               std::unique_ptr<vm_mapping_layer> bulk_layer, const vm_pool_options& options)
      : vm(std::move(layer), static_cast<const vm_resource_options&>(options)),
        adaptor(make_pool_adaptor(vm, options.upstream_adaptor)),
        plain(plain_memory_under_sanitizer(vm, adaptor != nullptr, options.physical_limit)),
        source(adaptor  ? adaptor.get()
               : plain  ? &plain->source()
                        : static_cast<memory_resource*>(&vm)),
        bulk(make_bulk_vm(vm, std::move(bulk_layer), options.bulk_handle_bytes, source != &vm)),
        pool(*source, options.pool),
        large(vm.handle_bytes()),
        large_blocks(*source, vm, bulk.get()) {}

  vm_resource vm;
  std::unique_ptr<memory_resource> adaptor;  ///< options.upstream_adaptor's, or none
  std::unique_ptr<plain_memory> plain;  ///< under compute-sanitizer: cudaMalloc
  memory_resource* source;  ///< where chunks and large blocks come from: adaptor, plain, vm
  std::unique_ptr<vm_resource> bulk;  ///< bulk blocks' (bulk_handle_bytes), or none
  pool_resource pool;
  std::size_t large;  ///< blocks of this many bytes or more are the upstream's (a handle)
  large_block_ledger large_blocks;  ///< the blocks of `large` bytes or more
  atomic<std::size_t> bulk_declined{0};  ///< vm_pool_stats::bulk_declined
};

}  // namespace cudamem::detail

namespace cudamem {

// --- vm_pool_resource's members (declared in vm_pool_resource.hpp) ---------------------------

CUDAMEM_DEFINITION detail::vm_pool_core& vm_pool_resource::core() noexcept {
  static_assert(sizeof(detail::vm_pool_core) <= core_bytes && alignof(detail::vm_pool_core) <= 8,
                "vm_pool_resource::core_bytes is too small for detail::vm_pool_core");
  return *std::launder(reinterpret_cast<detail::vm_pool_core*>(core_));
}
CUDAMEM_DEFINITION const detail::vm_pool_core& vm_pool_resource::core() const noexcept {
  return *std::launder(reinterpret_cast<const detail::vm_pool_core*>(core_));
}

CUDAMEM_DEFINITION vm_pool_resource::vm_pool_resource(int device, vm_pool_options options,
                                                      std::source_location where)
    : vm_pool_resource(detail::driver_vm_mapping::for_resource(device, options, where),
                       options.bulk_handle_bytes != 0 && !options.physical_limit
                           ? detail::driver_vm_mapping::for_resource(device, options, where)
                           : nullptr,
                       options) {}

CUDAMEM_DEFINITION vm_pool_resource::vm_pool_resource(
    std::unique_ptr<detail::vm_mapping_layer> layer, vm_pool_options options)
    : vm_pool_resource(std::move(layer), nullptr, std::move(options)) {}

CUDAMEM_DEFINITION vm_pool_resource::vm_pool_resource(
    std::unique_ptr<detail::vm_mapping_layer> layer,
    std::unique_ptr<detail::vm_mapping_layer> bulk_layer, vm_pool_options options)
    : memory_resource(memory_kind::device, layer ? layer->device() : -1) {
  new (core_) detail::vm_pool_core(std::move(layer), std::move(bulk_layer), options);
}

CUDAMEM_DEFINITION vm_pool_resource::~vm_pool_resource() { core().~vm_pool_core(); }

CUDAMEM_DEFINITION std::size_t vm_pool_resource::release() {
  detail::vm_pool_core& c = core();
  c.pool.release();
  return c.vm.release() + (c.bulk ? c.bulk->release() : 0);
}

CUDAMEM_DEFINITION std::size_t vm_pool_resource::trim() {
  detail::vm_pool_core& c = core();
  return c.vm.trim() + (c.bulk ? c.bulk->trim() : 0);
}

CUDAMEM_DEFINITION vm_pool_stats vm_pool_resource::vm_stats() const {
  const detail::vm_pool_core& c = core();
  vm_pool_stats s;
  static_cast<vm_resource_stats&>(s) = c.vm.vm_stats();
  if (c.bulk) {
    s.bulk = c.bulk->vm_stats();
  }
  s.large_used_bytes = c.large_blocks.used_bytes();
  s.large_peak_bytes = c.large_blocks.peak_bytes();
  s.bulk_declined = c.bulk_declined.load(detail::memory_order_relaxed);
  const resource_stats p = c.pool.stats();
  s.pool_used_bytes = p.used_bytes;
  s.pool_free_bytes = p.free_bytes();
  s.pool_largest_free_block = p.largest_free_block.value_or(0);
  s.pool_chunks = c.pool.chunk_count();
  return s;
}

CUDAMEM_DEFINITION std::vector<std::pair<std::uintptr_t, std::size_t>>
vm_pool_resource::held_ranges() const {
  const detail::vm_pool_core& c = core();
  std::vector<std::pair<std::uintptr_t, std::size_t>> out;
  if (c.plain == nullptr) {
    out = c.vm.mapped_ranges();
    if (c.bulk) {
      const auto bulk = c.bulk->mapped_ranges();
      out.insert(out.end(), bulk.begin(), bulk.end());
    }
  } else {
    out = c.pool.chunk_ranges();
    c.large_blocks.append_recorded(out);
  }
  std::sort(out.begin(), out.end());
  return out;
}

CUDAMEM_DEFINITION void vm_pool_resource::add_peer(int device) {
  detail::vm_pool_core& c = core();
  if (c.plain == nullptr) {
    c.vm.add_peer(device);
    if (c.bulk) {
      c.bulk->add_peer(device);
    }
  }
}

CUDAMEM_DEFINITION pool_resource& vm_pool_resource::pool() noexcept { return core().pool; }
CUDAMEM_DEFINITION vm_resource& vm_pool_resource::upstream_vm() noexcept { return core().vm; }
CUDAMEM_DEFINITION vm_resource* vm_pool_resource::bulk_vm() noexcept { return core().bulk.get(); }

CUDAMEM_DEFINITION vm_resource& vm_pool_resource::upstream_vm_of(const void* p) {
  detail::vm_pool_core& c = core();
  const auto address = reinterpret_cast<std::uintptr_t>(p);
  if (c.bulk) {
    for (const auto& [start, bytes] : c.bulk->mapped_ranges()) {
      if (address >= start && address - start < bytes) {
        return *c.bulk;
      }
    }
  }
  return c.vm;
}

CUDAMEM_DEFINITION memory_resource* vm_pool_resource::upstream_adaptor() const noexcept {
  return core().adaptor.get();
}
CUDAMEM_DEFINITION bool vm_pool_resource::uses_plain_memory() const noexcept {
  return core().plain != nullptr;
}
CUDAMEM_DEFINITION detail::vm_mapping_layer& vm_pool_resource::mapping_layer() const noexcept {
  return core().vm.mapping_layer();
}

CUDAMEM_DEFINITION void* vm_pool_resource::do_allocate(std::size_t bytes, std::size_t alignment,
                                                       stream_view stream) {
  detail::vm_pool_core& c = core();
  if (bytes >= c.large) {
    return allocate_large(bytes, alignment, &stream);
  }
  return allocate_small(bytes, alignment, &stream);
}

CUDAMEM_DEFINITION void* vm_pool_resource::do_allocate_sync(std::size_t bytes,
                                                            std::size_t alignment) {
  detail::vm_pool_core& c = core();
  if (bytes >= c.large) {
    return allocate_large(bytes, alignment, nullptr);
  }
  return allocate_small(bytes, alignment, nullptr);
}

CUDAMEM_DEFINITION void vm_pool_resource::do_deallocate(void* p, std::size_t bytes,
                                                        std::size_t alignment,
                                                        stream_view stream) noexcept {
  detail::vm_pool_core& c = core();
  if (bytes < c.large) {
    c.pool.deallocate(p, bytes, alignment, stream);
  } else {
    c.large_blocks.give_back(p, bytes, alignment, &stream);
  }
}

CUDAMEM_DEFINITION void vm_pool_resource::do_deallocate_sync(void* p, std::size_t bytes,
                                                             std::size_t alignment) noexcept {
  detail::vm_pool_core& c = core();
  if (bytes < c.large) {
    c.pool.deallocate(p, bytes, alignment);
  } else {
    c.large_blocks.give_back(p, bytes, alignment, nullptr);
  }
}

/// A block from the c.pool; `stream` null: the synchronous form. If the c.pool cannot have a
/// chunk (it gave back its wholly free ones first), the c.bulk resource gives back its wholly
/// free handles, and the c.pool asks once more.
CUDAMEM_DEFINITION void* vm_pool_resource::allocate_small(std::size_t bytes,
                                                         std::size_t alignment,
                                                         const stream_view* stream) {
  detail::vm_pool_core& c = core();
  const auto ask = [&] {
    const detail::discarded_report_scope discarded{c.pool};
    return stream != nullptr ? allocate_checked(c.pool, bytes, alignment, *stream)
                             : allocate_checked(c.pool, bytes, alignment);
  };
  try {
    return detail::ask_upstream(c.bulk.get(), ask);
  } catch (const out_of_memory& first) {
    if (!c.bulk || c.bulk->release() == 0) {
      throw_out_of_memory(*this, bytes, alignment, first.report().cause);
    }
  }
  try {
    return detail::ask_upstream(c.bulk.get(), ask);
  } catch (const out_of_memory& e) {
    throw_out_of_memory(*this, bytes, alignment, e.report().cause);
  }
}

/// A block of a handle or more; `stream` null: the synchronous form. A whole multiple of
/// the c.bulk handle comes from the c.bulk resource if it can supply it without growing into
/// keep_free, else from the upstream (detail/vm/pool_sources.hpp). If that cannot, the c.pool
/// gives back its wholly free chunks, the c.bulk resource its wholly free handles, and the
/// upstream is asked once more.
/// Over its own vm_resource the block is marked as the c.pool's (detail/vm/c.large_blocks.hpp).
CUDAMEM_DEFINITION void* vm_pool_resource::allocate_large(std::size_t bytes,
                                                         std::size_t alignment,
                                                         const stream_view* stream) {
  detail::vm_pool_core& c = core();
  const auto ask = [&](memory_resource& from) {
    const detail::discarded_report_scope discarded{from};  // reported from here, if at all
    if (c.large_blocks.marked()) {  // `from` is the vm_resource or the bulk one
      return static_cast<vm_resource&>(from).allocate_marked(
          bytes, alignment, stream, detail::large_block_ledger::mark);
    }
    return stream != nullptr ? allocate_checked(from, bytes, alignment, *stream)
                             : allocate_checked(from, bytes, alignment);
  };
  bool from_bulk = c.large_blocks.bulk_sized(bytes);
  void* p = nullptr;
  if (from_bulk) {
    try {
      const detail::no_growth_into_reserve_scope above_reserve;
      p = ask(*c.bulk);
    } catch (const out_of_memory&) {
      from_bulk = false;
      c.bulk_declined.fetch_add(1, detail::memory_order_relaxed);
    }
  }
  if (p == nullptr) {
    try {
      p = detail::ask_upstream(c.bulk.get(), [&] { return ask(*c.source); });
    } catch (const out_of_memory& first) {
      if (c.pool.release() + (c.bulk ? c.bulk->release() : 0) == 0) {
        throw_out_of_memory(*this, bytes, alignment, "upstream " + first.report().cause);
      }
      try {
        p = detail::ask_upstream(c.bulk.get(), [&] { return ask(*c.source); });
      } catch (const out_of_memory& e) {
        throw_out_of_memory(*this, bytes, alignment, "upstream " + e.report().cause);
      }
    }
  }
  try {
    c.large_blocks.record(p, bytes, from_bulk);
  } catch (...) {  // no host memory to record it: give it back, nothing happened
    c.large_blocks.give_back_unrecorded(p, bytes, alignment, from_bulk);
    throw;
  }
  return p;
}

CUDAMEM_DEFINITION resource_stats vm_pool_resource::do_stats() const {
  const detail::vm_pool_core& c = core();
  resource_stats s = c.pool.stats();
  s.held_beside = c.bulk ? c.bulk->stats().reserved_bytes : 0;  // not under upstream()
  const std::size_t large_used = c.large_blocks.used_bytes();
  s.reserved_bytes += large_used;
  s.used_bytes += large_used;
  s.peak_used_bytes += c.large_blocks.peak_bytes();
  return s;
}

CUDAMEM_DEFINITION memory_resource* vm_pool_resource::do_upstream() const noexcept {
  return core().source;  // the chain a report walks: this, (the adaptor,) the vm_resource
}

CUDAMEM_DEFINITION std::string vm_pool_resource::do_oom_hint(const memory_report& report,
                                                             std::size_t /*position*/) const {
  const detail::vm_pool_core& c = core();
  const vm_pool_stats s = vm_stats();
  if (c.plain != nullptr && c.plain->budget && report.verdict == oom_verdict::budget) {
    return "Under compute-sanitizer this vm_pool_resource takes cudaMalloc'd memory, at most " +
           format_bytes(c.plain->budget->budget()) + " of it (vm_pool_options::physical_limit), "
           "and holds " + format_bytes(c.plain->budget->used_bytes()) + ": raise "
           "physical_limit, or free blocks before this request.";
  }
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

}  // namespace cudamem
