// capi/src/device_stack.hpp — one device's resources for a C-ABI allocator: the resource its
// configuration chose, a budget over it if asked, and a statistics adaptor on top.
//
//   device_stack s{config, 0};                 // device 0: vm_pool_resource{0} under the others
//   void* p = s.top().allocate(n, 256, stream);
//   cudamem_stats st = s.stats();              // in use, peak, reserved, largest free block, ...
//   std::string text = s.report(n);            // make_memory_report(top, n).to_text()
//
// The chain, top first:  statistics_adaptor -> [limiting_adaptor] -> resource
//   resource = vm_pool_resource{device}                      resource=vm_pool
//              pool_resource{device_resource{device}}        resource=pool
//              async_resource{device, release threshold max} resource=async
// With simulate_bytes, vm_pool sits on a simulated mapping layer and pool on a
// simulated_resource of that size: the same code paths, no GPU (the C API's host tests).
//
// Contract: the constructor throws what the resources throw (no_device_error, cuda_error,
// std::invalid_argument for options they refuse, ...); members are destroyed top first.
#pragma once

#include "config.hpp"

#include <cudamem/async_resource.hpp>
#include <cudamem/detail/vm/mapping.hpp>
#include <cudamem/detail/vm/simulated_mapping.hpp>
#include <cudamem/device_resource.hpp>
#include <cudamem/limiting_adaptor.hpp>
#include <cudamem/memory_report.hpp>
#include <cudamem/pool_resource.hpp>
#include <cudamem/simulated_resource.hpp>
#include <cudamem/statistics_adaptor.hpp>
#include <cudamem/vm_pool_resource.hpp>

#include <cudamem_c.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace cudamem::capi {

/// An address range held from the device: a vm_pool's mapped range, a pool's chunk.
struct address_range {
  std::uintptr_t address = 0;
  std::size_t bytes = 0;
};

class device_stack {
 public:
  /// `peers`: devices given access to the memory from the start (cudamem_add_peer before it).
  device_stack(const allocator_config& config, int device, const std::vector<int>& peers = {})
      : device_(device) {
    switch (config.resource) {
      case resource_choice::vm_pool: {
        vm_pool_options o;
        o.grow_ahead_bytes = config.grow_ahead_bytes;
        o.handle_bytes = config.handle_bytes.value_or(default_handle_bytes);
        o.keep_free_bytes = config.keep_free_bytes.value_or(default_keep_free_bytes);
        o.bulk_handle_bytes = bulk_handle_bytes(config);
        o.recent_frees = config.recent_frees.value_or(o.recent_frees);
        if (config.simulate_bytes) {
          // The vm_pool's two vm_resources (bulk blocks) share one pretend device.
          upstream_ = std::make_unique<simulated_resource>(simulated_options{
              .capacity = *config.simulate_bytes, .layout = simulated_layout::paged});
          const auto layer = [this](std::uintptr_t first_address) {
            cudamem::detail::simulated_vm_options sim;
            sim.physical = upstream_.get();
            sim.first_address = first_address;
            return std::make_unique<cudamem::detail::simulated_vm_mapping>(sim);
          };
          auto vm = std::make_unique<vm_pool_resource>(layer(std::uintptr_t{1} << 40),
                                                       layer(std::uintptr_t{2} << 40), o);
          vm_pool_ = vm.get();
          resource_ = std::move(vm);
        } else {
          o.peers = peers;
          vm_pool_ = make_real_vm_pool(device, o);
        }
        break;
      }
      case resource_choice::pool: {
        if (config.simulate_bytes) {
          simulated_options sim;
          sim.capacity = *config.simulate_bytes;
          upstream_ = std::make_unique<simulated_resource>(sim);
        } else {
          upstream_ = std::make_unique<device_resource>(device);
        }
        auto pool = std::make_unique<pool_resource>(*upstream_);
        pool_ = pool.get();
        resource_ = std::move(pool);
        break;
      }
      case resource_choice::async: {
        async_resource_options o;
        o.device = device;
        o.release_threshold = std::numeric_limits<std::uint64_t>::max();  // keep what it has
        auto async = std::make_unique<async_resource>(o);
        async_ = async.get();
        resource_ = std::move(async);
        break;
      }
    }
    for (const int peer : peers) {
      if (vm_pool_ == nullptr) {
        add_peer(peer);
      }
    }
    memory_resource* below = resource_.get();
    if (config.limit_bytes) {
      limit_ = std::make_unique<limiting_adaptor>(*below, *config.limit_bytes);
      below = limit_.get();
    }
    statistics_ = std::make_unique<statistics_adaptor>(*below);
  }

  device_stack(const device_stack&) = delete;
  device_stack& operator=(const device_stack&) = delete;
  ~device_stack() = default;  // statistics, limit, resource, upstream: top first

  [[nodiscard]] memory_resource& top() noexcept { return *statistics_; }
  [[nodiscard]] int device() const noexcept { return device_; }

  /// Gives wholly free memory back to the device; the bytes given back when the resource says.
  std::size_t release() {
    if (vm_pool_ != nullptr) {
      return vm_pool_->release();
    }
    if (pool_ != nullptr) {
      return pool_->release();
    }
    const std::size_t before = async_->stats().reserved_bytes;
    check(cudaStreamSynchronize(nullptr), "cudaStreamSynchronize before trimming");
    async_->trim(0);
    const std::size_t after = async_->stats().reserved_bytes;
    return before > after ? before - after : 0;
  }

  /// What it holds (struct_size and the pending count are the caller's to fill).
  static void add_stream_stats(cudamem_stats& s, const pool_stream_stats& p) noexcept {
    s.stream_waits += p.stream_waits;
    s.host_waits += p.host_waits;
    s.device_syncs += p.device_syncs;
  }

  [[nodiscard]] cudamem_stats stats() const {
    cudamem_stats s{};
    s.device = device_;
    s.stack_exists = 1;
    const allocation_counters c = statistics_->counters();
    s.in_use_bytes = c.current_bytes;
    s.peak_in_use_bytes = c.peak_bytes;
    s.allocations = c.allocations;
    s.deallocations = c.deallocations;
    s.allocated_bytes = c.allocated_bytes;
    const resource_stats r = resource_->stats();
    s.reserved_bytes = r.reserved_bytes;
    s.largest_free_block =
        r.largest_free_block ? *r.largest_free_block : std::numeric_limits<std::uint64_t>::max();
    if (pool_ != nullptr) {
      s.peak_reserved_bytes = pool_->peak_reserved_bytes();
      s.segments = pool_->chunk_count();
      add_stream_stats(s, pool_->stream_stats());
    }
    if (async_ != nullptr) {
      s.peak_reserved_bytes = async_->pool_usage().reserved_high;
    }
    if (vm_pool_ != nullptr) {
      const vm_pool_stats v = vm_pool_->vm_stats();
      const vm_resource_stats b = v.bulk.value_or(vm_resource_stats{});  // bulk blocks'
      s.reserved_bytes = v.mapped_bytes + b.mapped_bytes;  // physical memory held, free or not
      // With bulk blocks the two resources keep their peaks apart: the sum, never less than
      // the true peak.
      s.peak_reserved_bytes = v.peak_mapped_bytes + b.peak_mapped_bytes;
      if (vm_pool_->uses_plain_memory()) {
        // Under compute-sanitizer the pool's chunks and the large blocks are cudaMalloc'd and
        // the vm_resource holds nothing: reserved is what those hold. Their peaks are kept
        // apart, so the peak given is their sum: never less than the true one.
        s.reserved_bytes = r.reserved_bytes;
        s.peak_reserved_bytes = vm_pool_->pool().peak_reserved_bytes() + v.large_peak_bytes;
      }
      s.segments = vm_pool_->held_ranges().size();
      // Each handle made and not held now was freed; a resource's handles are one size.
      s.device_allocations = v.handles_created + b.handles_created;
      s.device_frees = (v.handles_created - v.handles) + (b.handles_created - b.handles);
      s.device_allocated_bytes =
          v.handles_created * v.handle_bytes + b.handles_created * b.handle_bytes;
      s.device_freed_bytes = (v.handles_created - v.handles) * v.handle_bytes +
                             (b.handles_created - b.handles) * b.handle_bytes;
      s.largest_free_block = std::max<std::uint64_t>(
          {v.largest_free_range, b.largest_free_range, v.pool_largest_free_block});
      s.held_ahead_bytes = v.held_ahead_bytes + b.held_ahead_bytes;  // free at the frontiers
      s.compactions = v.compactions + b.compactions;
      s.kept_free_compactions = v.kept_free_compactions + b.kept_free_compactions;
      s.bulk_declined = v.bulk_declined;
      s.recent_reuses = v.recent_reuses + b.recent_reuses;
      add_stream_stats(s, vm_pool_->pool().stream_stats());
    }
    s.limit_bytes = limit_ ? limit_->budget() : 0;
    return s;
  }

  /// What it holds from the device, by address: the vm_pool's mapped ranges, the pool's
  /// chunks; nullopt for async (a cudaMallocAsync pool does not tell).
  [[nodiscard]] std::optional<std::vector<address_range>> segments() const {
    std::vector<std::pair<std::uintptr_t, std::size_t>> ranges;
    if (vm_pool_ != nullptr) {
      ranges = vm_pool_->held_ranges();
    } else if (pool_ != nullptr) {
      ranges = pool_->chunk_ranges();
    } else {
      return std::nullopt;
    }
    std::vector<address_range> out;
    out.reserve(ranges.size());
    for (const auto& [address, bytes] : ranges) {
      out.push_back({address, bytes});
    }
    return out;
  }

  /// Gives `peer` access to the memory, now and later. A vm_pool grants it on its mappings;
  /// an async pool with cudaMemPoolSetAccess; a pool's cudaMalloc'd chunks are the peer's once
  /// the caller has enabled peer access (cudaDeviceEnablePeerAccess).
  void add_peer(int peer) {
    if (vm_pool_ != nullptr) {
      vm_pool_->add_peer(peer);
    } else if (async_ != nullptr && peer != device_) {
      cudaMemAccessDesc desc{};
      desc.location.type = cudaMemLocationTypeDevice;
      desc.location.id = peer;
      desc.flags = cudaMemAccessFlagsProtReadWrite;
      check(cudaMemPoolSetAccess(async_->pool_handle(), &desc, 1), "cudaMemPoolSetAccess");
    }
  }

  /// The physical memory under [p, p + bytes) in a form another process can map
  /// (capi/src/ipc.hpp): the vm_pool's handles, or the cudaMalloc'd chunk p lies in.
  [[nodiscard]] vm_pool_resource* vm_pool() const noexcept {
    return vm_pool_ != nullptr && !vm_pool_->uses_plain_memory() ? vm_pool_ : nullptr;
  }
  [[nodiscard]] bool is_async() const noexcept { return async_ != nullptr; }

  /// Starts the peak of reserved_bytes again from now.
  void reset_peak_reserved() {
    if (vm_pool_ != nullptr) {
      vm_pool_->upstream_vm().reset_peak_mapped();
      if (vm_resource* bulk = vm_pool_->bulk_vm()) {
        bulk->reset_peak_mapped();
      }
    } else if (pool_ != nullptr) {
      pool_->reset_peak_reserved();
    } else {
      const device_guard on{device_};
      cudaMemPool_t handle = async_->pool_handle();
      std::uint64_t zero = 0;
      check(cudaMemPoolSetAttribute(handle, cudaMemPoolAttrReservedMemHigh, &zero),
            "cudaMemPoolSetAttribute(ReservedMemHigh)");
    }
  }

  /// What the resource itself counts as handed out (exact even after a refused free).
  [[nodiscard]] std::size_t resource_used_bytes() const { return resource_->stats().used_bytes; }

  /// cudamem's report on this chain for a request of `bytes`.
  [[nodiscard]] std::string report(std::size_t bytes) const {
    return make_memory_report(*statistics_, bytes).to_text();
  }

 private:
  /// A vm_pool on a real device whose handles other processes can map (cudamem.torch sends
  /// tensors to them), where the device can export POSIX file descriptors; else a plain one.
  vm_pool_resource* make_real_vm_pool(int device, vm_pool_options o) {
    o.exportable = true;
    std::unique_ptr<vm_pool_resource> vm;
    try {
      vm = std::make_unique<vm_pool_resource>(device, o);
    } catch (const cuda_error& e) {
      if (e.code() != cudaErrorNotSupported) {
        throw;
      }
      o.exportable = false;
      vm = std::make_unique<vm_pool_resource>(device, o);
    }
    vm_pool_resource* raw = vm.get();
    resource_ = std::move(vm);
    return raw;
  }

  int device_;
  std::unique_ptr<memory_resource> upstream_;  ///< pool's upstream, or a vm_pool's simulated device
  std::unique_ptr<memory_resource> resource_;
  std::unique_ptr<limiting_adaptor> limit_;
  std::unique_ptr<statistics_adaptor> statistics_;
  vm_pool_resource* vm_pool_ = nullptr;  ///< resource_, when it is one (for its stats)
  pool_resource* pool_ = nullptr;
  async_resource* async_ = nullptr;
};

}  // namespace cudamem::capi
