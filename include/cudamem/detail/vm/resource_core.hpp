// cudamem/detail/vm/resource_core.hpp — vm_resource's state and what it does: the code behind
// vm_resource.hpp's declarations.
//
//   // vm_resource.hpp includes this at its end (header-only), or the cudamem::compiled library
//   // compiles it once (detail/compiled.hpp); nothing else includes it.
//   vm_resource_core& c = core();                       // in place, inside the vm_resource
//   void* p = c.allocate_range(bytes, alignment, stream_tag, /*sync=*/false);
//   c.free_range_at(p, bytes, stream_tag, /*sync=*/false);
//
// What it owns: the mapping layer, the validated options, the handles, the address space, the
// free ranges, the live blocks, the compactor that recycles handles, and the growth thread. The
// vm_resource constructs it inside itself and destroys it first. It is the process's held-ahead
// holder (detail/held_ahead.hpp) and the growth thread's work (growth_thread.hpp) on the
// resource's behalf; the resource (`owner`) is what its failures and reports name.
#pragma once

#include <cudamem/detail/compiled.hpp>
#include <cudamem/detail/held_ahead.hpp>
#include <cudamem/detail/stream_tag.hpp>
#include <cudamem/detail/sync/mutex.hpp>
#include <cudamem/detail/vm/address_space.hpp>
#include <cudamem/detail/vm/compactor.hpp>
#include <cudamem/detail/vm/config.hpp>
#include <cudamem/detail/vm/driver_mapping.hpp>
#include <cudamem/detail/vm/free_ranges.hpp>
#include <cudamem/detail/vm/grow_ahead.hpp>
#include <cudamem/detail/vm/growth_thread.hpp>
#include <cudamem/detail/vm/handle_set.hpp>
#include <cudamem/detail/vm/live_blocks.hpp>
#include <cudamem/detail/vm/mapping.hpp>
#include <cudamem/detail/vm/options.hpp>
#include <cudamem/detail/vm/placement.hpp>
#include <cudamem/detail/vm/stats.hpp>
#include <cudamem/error.hpp>
#include <cudamem/memory_resource.hpp>
#include <cudamem/out_of_memory.hpp>
#include <cudamem/vm_resource.hpp>

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <exception>
#include <memory>
#include <new>
#include <optional>
#include <source_location>
#include <string>
#include <utility>
#include <vector>

namespace cudamem::detail {

/// vm_resource's state and code; see above.
class vm_resource_core final : private held_ahead_holder, private growth_work {
 public:
  vm_resource_core(memory_resource& owner, std::unique_ptr<vm_mapping_layer> layer,
                   vm_resource_options options)
      : owner_(owner),
        layer_(std::move(layer)),
        options_(std::move(options)),
        config_(vm_config::from(layer_.get(), options_)),  // throws for bad options
        handles_(config_.handle),
        space_(config_.reservation, config_.reservation_alignment()),
        compactor_(*layer_, config_, free_, handles_, space_),
        blocks_(*layer_, config_, free_, handles_, config_.recent_frees),
        grow_ahead_bytes_(options_.grow_ahead_bytes.value_or(
            layer_->device() >= 0 ? default_grow_ahead_bytes : 0)) {
    if (grow_ahead_bytes_ != 0) {
      auto& work = static_cast<growth_work&>(*this);  // a private base
      ahead_ = std::make_unique<growth_thread>(mutex_, work);
    }
    // Last, so that a constructor that throws leaves no registration behind.
    held_ahead_registry::instance().add(this, layer_->domain());
  }

  ~vm_resource_core() {
    held_ahead_registry::instance().remove(this);  // waits for a give-back under way
    if (ahead_) {
      ahead_->stop();  // its batch in flight is published first, then released below
    }
    const lock_guard lock(mutex_);
    if (blocks_.count() != 0) {
      report_problem("vm_resource destroyed with " + std::to_string(blocks_.count()) +
                     " range(s) (" + format_bytes(blocks_.used_bytes()) +
                     ") still allocated; their memory is released anyway");
    }
    compactor_.release_all();
  }

  vm_resource_core(const vm_resource_core&) = delete;
  vm_resource_core& operator=(const vm_resource_core&) = delete;

  // --- what vm_resource's members do (vm_resource.hpp documents each) ----------------------

  std::size_t release() {
    unique_lock lock(mutex_);
    if (ahead_) {
      ahead_->cancel(lock);  // what is made ahead is given back too, and not made again at once
      ahead_->wait_step(lock);
    }
    blocks_.flush_recent();
    return compactor_.release_idle();
  }

  std::size_t trim() {
    unique_lock lock(mutex_);
    if (ahead_) {
      ahead_->cancel(lock);
      ahead_->wait_step(lock);
    }
    blocks_.flush_recent();
    return compactor_.release_tail();
  }

  void wait_for_growth() const {
    unique_lock lock(mutex_);
    if (ahead_) {
      ahead_->wait_idle(lock);
    }
  }

  [[nodiscard]] vm_resource_stats vm_stats() const {
    const lock_guard lock(mutex_);
    blocks_.flush_recent();
    return collect_vm_stats(config_, space_, handles_, blocks_, free_, compactor_);
  }

  [[nodiscard]] resource_stats stats() const {
    const lock_guard lock(mutex_);
    blocks_.flush_recent();
    return collect_resource_stats(*layer_, options_, handles_, blocks_, free_);
  }

  void reset_peak_mapped() {
    const lock_guard lock(mutex_);
    handles_.mapped_bytes.reset_peak();
  }

  [[nodiscard]] std::vector<std::pair<std::uintptr_t, std::size_t>> mapped_ranges() const {
    const lock_guard lock(mutex_);
    return handles_.ranges();
  }

  [[nodiscard]] std::size_t granularity() const noexcept { return config_.granule; }
  [[nodiscard]] std::size_t handle_bytes() const noexcept { return config_.handle; }
  [[nodiscard]] const vm_resource_options& options() const noexcept { return options_; }
  [[nodiscard]] vm_mapping_layer& mapping_layer() const noexcept { return *layer_; }

  [[nodiscard]] vm_block_handles block_handles(const void* p) const {
    const lock_guard lock(mutex_);
    return blocks_.handles_of(reinterpret_cast<std::uintptr_t>(p));
  }

  [[nodiscard]] vm_block_handles handles_covering(const void* p, std::size_t bytes) const {
    const lock_guard lock(mutex_);
    return blocks_.handles_covering(reinterpret_cast<std::uintptr_t>(p), bytes);
  }

  void add_peer(int device) {
    layer_->add_peer(device);  // growth from now on maps with the peer's access
    unique_lock lock(mutex_);
    if (ahead_) {
      ahead_->wait_idle(lock);  // a batch mapped before the peer was added is adopted by now
    }
    for (const auto& [address, bytes] : handles_.ranges()) {
      layer_->set_peer_access(address, bytes, device);  // (its own device: nothing)
    }
  }

  // --- allocation -------------------------------------------------------------------------

  /// A block of `bytes` (`stream`: the request's stream tag; `sync`: the synchronous form),
  /// recorded with `mark`; out_of_memory, naming the resource, when none can be had.
  void* allocate_range(std::size_t bytes, std::size_t alignment, cudaStream_t stream, bool sync,
                       std::uint8_t mark = 0) {
    const std::size_t limit = options_.physical_limit.value_or(layer_->device_total());
    if (bytes > limit || alignment > limit) {
      throw_out_of_memory(owner_, bytes, alignment,
                          "vm_resource: larger than it can ever map (" + format_bytes(limit) + ")");
    }
    const std::size_t granule = config_.granule;
    const std::size_t size = vm_config::round_up(bytes, granule);
    const vm_request r{size, alignment <= granule ? size : size + alignment - granule, alignment,
                       vm_request::whole_handles(size, alignment, config_.handle, granule),
                       granule};
    unique_lock lock(mutex_);
    if (void* p = blocks_.take_recent(r, bytes, stream, sync, mark)) {
      return p;  // nothing left the frontier: no need to look at growth ahead
    }
    if (void* p = blocks_.take_fit(r, bytes, stream, sync, mark)) {
      return grew_ahead(lock, p);
    }
    std::size_t given_back = 0;  // by the other vm_resources of the process (below)
    std::string cause;
    for (bool others_asked = false;; others_asked = true) {
      // While memory is being made ahead, wait for each batch and look again: a growth of our
      // own would only queue behind the thread's in the driver, and it maps at the frontier,
      // where the thread's batch goes (make_room runs only once the thread is idle).
      while (ahead_ && ahead_->busy()) {
        ahead_->wait_next_step(lock);
        if (void* p = blocks_.take_fit(r, bytes, stream, sync, mark)) {
          return grew_ahead(lock, p);
        }
      }
      // The thread is idle now, and cannot begin a step while this lock is held. Blocks kept
      // aside go back among the free ranges: merged there, they may hold the request.
      if (blocks_.flush_recent()) {
        if (void* p = blocks_.take_fit(r, bytes, stream, sync, mark)) {
          return grew_ahead(lock, p);
        }
      }
      cause.clear();
      // Growth, neighbours merged by a host wait, a compaction (detail/vm/compactor.hpp).
      if (compactor_.make_room(r.needed, r.whole, cause,
                               [&] { return blocks_.settle_run(r, stream, sync); },
                               ordered_on(stream, sync))) {
        if (void* p = blocks_.take_fit(r, bytes, stream, sync, mark)) {
          return grew_ahead(lock, p);
        }
      }
      // Short of device memory, not of the physical limit or of address space?
      const bool device_full = handles_.device_full &&
                               handles_.mapped_bytes + config_.handle <= config_.limit;
      lock.unlock();  // the report reads stats(), which locks; the registry locks the others
      // Before failing for want of device memory: what the process's other vm_resources
      // hold ahead of need on this device, then once more.
      if (others_asked || !device_full) {
        break;
      }
      given_back = give_back_held_ahead(layer_->domain(), this);
      if (given_back == 0) {
        break;
      }
      lock.lock();
    }
    if (given_back != 0) {
      cause += "; other vm_resources gave back " + format_bytes(given_back) +
               " held ahead of need first";
    }
    throw_out_of_memory(owner_, bytes, alignment, "vm_resource: " + cause);
  }

  /// Frees the block at `p`; with a mark, only one that carries it (deallocate_marked's
  /// result; without one, a bad free is reported and the result is meaningless).
  std::optional<std::size_t> free_range_at(void* p, std::size_t bytes, cudaStream_t stream,
                                           bool sync,
                                           std::optional<std::uint8_t> mark = {}) noexcept {
    const auto address = reinterpret_cast<std::uintptr_t>(p);
    try {
      const lock_guard lock(mutex_);
      if (mark) {
        return blocks_.free_marked(address, bytes, stream, sync, *mark);
      }
      blocks_.free(address, bytes, stream, sync);
    } catch (const cuda_error& e) {
      report_error(e.code(), std::string(e.what()) + " (the range is kept: it may be in use)");
    } catch (const std::exception& e) {
      report_problem(std::string("vm_resource: ") + e.what());
    }
    return 0;
  }

 private:
  /// After an allocation (`p`): wakes the growth thread when too little is left mapped ahead.
  void* grew_ahead(unique_lock<mutex>& lock, void* p) {
    if (ahead_ && !ahead_->stepping() && compactor_.wants_ahead(grow_ahead_bytes_)) {
      ahead_->wake(lock);
    }
    return p;
  }

  // --- growth ahead (growth_thread.hpp: the thread calls these) ---------------------------

  void growth_thread_started() override {  // cuMem* needs the device
    check(layer_->device() < 0 ? cudaSuccess : cudaSetDevice(layer_->device()),
          "vm_resource: cudaSetDevice on the growth thread");
  }

  /// One step of the growth thread (growth_work): a batch planned under the lock, made
  /// without it, published under it. True while more is wanted.
  bool growth_step(unique_lock<mutex>& lock) override {
    blocks_.flush_recent();  // blocks kept aside at the frontier are free memory there
    auto batch = compactor_.plan_ahead(grow_ahead_bytes_);
    if (!batch) {
      return false;
    }
    lock.unlock();
    compactor_.make_ahead(*batch);
    lock.lock();
    compactor_.publish_ahead(*batch);  // throws the batch's error: the thread stops
    return !batch->device_full && !batch->at_floor;
  }

  // --- memory held ahead gives way (held_ahead.hpp) ---------------------------------------

  /// Another resource of the process is short of device memory: give back what is held ahead.
  /// Called with the registry's lock held, never with ours.
  std::size_t give_back_ahead() noexcept override {
    try {
      return trim();
    } catch (const std::exception& e) {
      report_problem(std::string("vm_resource: giving back memory held ahead: ") + e.what());
    } catch (...) {
      report_problem("vm_resource: giving back memory held ahead failed");
    }
    return 0;
  }
  [[nodiscard]] std::size_t bytes_held_ahead() const noexcept override {
    try {
      const lock_guard lock(mutex_);
      blocks_.flush_recent();
      return compactor_.tail_bytes();
    } catch (...) {
      return 0;
    }
  }

  memory_resource& owner_;  ///< the vm_resource this is the state of: what failures name
  std::unique_ptr<vm_mapping_layer> layer_;
  vm_resource_options options_;
  vm_config config_;

  mutable mutex mutex_;  ///< guards everything below
  // mutable: reading the free ranges puts blocks kept aside back first (live_blocks.hpp).
  mutable free_range_index free_;
  handle_set handles_;
  address_space space_;
  vm_compactor compactor_;
  mutable vm_live_blocks blocks_;
  std::size_t grow_ahead_bytes_;  ///< options_.grow_ahead_bytes, resolved
  std::unique_ptr<growth_thread> ahead_;  ///< grow_ahead_bytes; last: stopped first
};

}  // namespace cudamem::detail

namespace cudamem {

// --- vm_resource's members (declared in vm_resource.hpp) ------------------------------------

CUDAMEM_DEFINITION detail::vm_resource_core& vm_resource::core() noexcept {
  static_assert(sizeof(detail::vm_resource_core) <= core_bytes &&
                    alignof(detail::vm_resource_core) <= 8,
                "vm_resource::core_bytes is too small for detail::vm_resource_core");
  return *std::launder(reinterpret_cast<detail::vm_resource_core*>(core_));
}
CUDAMEM_DEFINITION const detail::vm_resource_core& vm_resource::core() const noexcept {
  return *std::launder(reinterpret_cast<const detail::vm_resource_core*>(core_));
}

CUDAMEM_DEFINITION vm_resource::vm_resource(int device, vm_resource_options options,
                                            std::source_location where)
    // A copy, not a move: the arguments' order of evaluation is unspecified.
    : vm_resource(detail::driver_vm_mapping::for_resource(device, options, where), options) {}

CUDAMEM_DEFINITION vm_resource::vm_resource(std::unique_ptr<detail::vm_mapping_layer> layer,
                                            vm_resource_options options)
    : memory_resource(memory_kind::device, layer ? layer->device() : -1) {
  new (core_) detail::vm_resource_core(*this, std::move(layer), std::move(options));
}

CUDAMEM_DEFINITION vm_resource::~vm_resource() { core().~vm_resource_core(); }

CUDAMEM_DEFINITION std::size_t vm_resource::release() { return core().release(); }
CUDAMEM_DEFINITION std::size_t vm_resource::trim() { return core().trim(); }
CUDAMEM_DEFINITION void vm_resource::wait_for_growth() const { core().wait_for_growth(); }
CUDAMEM_DEFINITION vm_resource_stats vm_resource::vm_stats() const { return core().vm_stats(); }
CUDAMEM_DEFINITION void vm_resource::reset_peak_mapped() { core().reset_peak_mapped(); }
CUDAMEM_DEFINITION std::vector<std::pair<std::uintptr_t, std::size_t>>
vm_resource::mapped_ranges() const {
  return core().mapped_ranges();
}
CUDAMEM_DEFINITION std::size_t vm_resource::granularity() const noexcept {
  return core().granularity();
}
CUDAMEM_DEFINITION std::size_t vm_resource::handle_bytes() const noexcept {
  return core().handle_bytes();
}
CUDAMEM_DEFINITION const vm_resource_options& vm_resource::options() const noexcept {
  return core().options();
}
CUDAMEM_DEFINITION vm_block_handles vm_resource::block_handles(const void* p) const {
  return core().block_handles(p);
}
CUDAMEM_DEFINITION vm_block_handles vm_resource::handles_covering(const void* p,
                                                                  std::size_t bytes) const {
  return core().handles_covering(p, bytes);
}
CUDAMEM_DEFINITION void vm_resource::add_peer(int device) { core().add_peer(device); }

CUDAMEM_DEFINITION void* vm_resource::allocate_marked(std::size_t bytes, std::size_t alignment,
                                                      const stream_view* stream,
                                                      std::uint8_t mark) {
  if (bytes == 0) {
    return nullptr;
  }
  validate_alignment(alignment);
  return core().allocate_range(bytes, alignment,
                               stream ? detail::stream_tag(stream->get()) : nullptr,
                               stream == nullptr, mark);
}
CUDAMEM_DEFINITION std::optional<std::size_t> vm_resource::deallocate_marked(
    void* p, std::size_t bytes, const stream_view* stream, std::uint8_t mark) noexcept {
  return core().free_range_at(p, bytes, stream ? detail::stream_tag(stream->get()) : nullptr,
                              stream == nullptr, mark);
}

CUDAMEM_DEFINITION detail::vm_mapping_layer& vm_resource::mapping_layer() const noexcept {
  return core().mapping_layer();
}

// The memory_resource interface: a stream-ordered request carries its stream's tag.
CUDAMEM_DEFINITION void* vm_resource::do_allocate(std::size_t bytes, std::size_t alignment,
                                                  stream_view stream) {
  return core().allocate_range(bytes, alignment, detail::stream_tag(stream.get()), false);
}
CUDAMEM_DEFINITION void* vm_resource::do_allocate_sync(std::size_t bytes, std::size_t alignment) {
  return core().allocate_range(bytes, alignment, nullptr, true);
}
CUDAMEM_DEFINITION void vm_resource::do_deallocate(void* p, std::size_t bytes,
                                                   std::size_t /*alignment*/,
                                                   stream_view stream) noexcept {
  core().free_range_at(p, bytes, detail::stream_tag(stream.get()), false);
}
CUDAMEM_DEFINITION void vm_resource::do_deallocate_sync(void* p, std::size_t bytes,
                                                        std::size_t /*alignment*/) noexcept {
  core().free_range_at(p, bytes, nullptr, true);
}
CUDAMEM_DEFINITION resource_stats vm_resource::do_stats() const { return core().stats(); }

}  // namespace cudamem
