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

namespace cudamem::capi {

class device_stack {
 public:
  device_stack(const allocator_config& config, int device) : device_(device) {
    switch (config.resource) {
      case resource_choice::vm_pool: {
        vm_pool_options o;
        o.grow_ahead_bytes = config.grow_ahead_bytes;
        o.handle_bytes = config.handle_bytes.value_or(default_handle_bytes);
        o.keep_free_bytes = config.keep_free_bytes.value_or(default_keep_free_bytes);
        if (config.simulate_bytes) {
          cudamem::detail::simulated_vm_options sim;
          sim.capacity = *config.simulate_bytes;
          auto vm = std::make_unique<vm_pool_resource>(
              std::make_unique<cudamem::detail::simulated_vm_mapping>(sim), o);
          vm_pool_ = vm.get();
          resource_ = std::move(vm);
        } else {
          auto vm = std::make_unique<vm_pool_resource>(device, o);
          vm_pool_ = vm.get();
          resource_ = std::move(vm);
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
    if (vm_pool_ != nullptr) {
      const vm_pool_stats v = vm_pool_->vm_stats();
      s.reserved_bytes = v.mapped_bytes;  // physical memory held, free or not
      s.largest_free_block = std::max<std::uint64_t>(v.largest_free_range,
                                                     v.pool_largest_free_block);
      s.held_ahead_bytes = v.held_ahead_bytes;  // whole handles free at the frontier
    }
    s.limit_bytes = limit_ ? limit_->budget() : 0;
    return s;
  }

  /// What the resource itself counts as handed out (exact even after a refused free).
  [[nodiscard]] std::size_t resource_used_bytes() const { return resource_->stats().used_bytes; }

  /// cudamem's report on this chain for a request of `bytes`.
  [[nodiscard]] std::string report(std::size_t bytes) const {
    return make_memory_report(*statistics_, bytes).to_text();
  }

 private:
  int device_;
  std::unique_ptr<memory_resource> upstream_;  ///< pool's upstream (device or simulated)
  std::unique_ptr<memory_resource> resource_;
  std::unique_ptr<limiting_adaptor> limit_;
  std::unique_ptr<statistics_adaptor> statistics_;
  vm_pool_resource* vm_pool_ = nullptr;  ///< resource_, when it is one (for its stats)
  pool_resource* pool_ = nullptr;
  async_resource* async_ = nullptr;
};

}  // namespace cudamem::capi
