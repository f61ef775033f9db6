// capi/src/allocator.hpp — an allocator of the C ABI: a configuration, fixed at the first
// allocation, and per device a stack of resources (device_stack.hpp) with the frees that wait
// for other streams (deferred_frees.hpp).
//
//   allocator a;
//   a.configure("resource=pool", "cudamem_allocator_configure");
//   void* p = a.allocate(n, 0, stream);        // throws out_of_memory with cudamem's report
//   a.record_stream(p, side);                  // its free will wait for `side`
//   a.deallocate(p, n, 0, stream);
//
// Contract
// - configure() after the first allocation throws state_error; so does destroying (the C
//   layer's check) while anything is allocated.
// - A device's stack is made at its first allocation, under a mutex; afterwards the fast
//   path is one acquire load. Devices: 0..device_count-1 (the real count, or 0..7 over a
//   simulated device); another id throws std::out_of_range.
// - allocate: 0 bytes gives nullptr. Out of memory: waits for the frees held back by
//   record_stream, tries once more, then throws the out_of_memory (and keeps its text for
//   last_oom_report()).
// - deallocate of a device that never allocated is a bad free: reported, nothing happens.
// - segments(device): what the stack holds from the device, by address — the vm_pool's mapped
//   ranges or the pool's chunks; an async stack cannot tell (state_error).
#pragma once

#include "config.hpp"
#include "deferred_frees.hpp"
#include "device_stack.hpp"

#include <cudamem/device.hpp>
#include <cudamem/error.hpp>
#include <cudamem/out_of_memory.hpp>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstddef>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

namespace cudamem::capi {

/// A call that the allocator's state forbids (configure after allocating, ...).
class state_error : public std::logic_error {
 public:
  using std::logic_error::logic_error;
};

/// The most devices an allocator serves (device ids 0..max_devices-1).
inline constexpr int max_devices = 64;
/// Devices a simulated allocator pretends to have.
inline constexpr int simulated_devices = 8;

/// Alignment of every block: what cudaMalloc guarantees, and what PyTorch's kernels assume.
inline constexpr std::size_t block_alignment = 256;

class allocator {
 public:
  explicit allocator(allocator_config config = {}) : config_(std::move(config)) {}
  allocator(const allocator&) = delete;
  allocator& operator=(const allocator&) = delete;
  ~allocator() {
    for (auto& slot : devices_) {
      delete slot.load(std::memory_order_acquire);
    }
  }

  /// Applies configuration text; refused once anything was allocated.
  void configure(std::string_view text, std::string_view source) {
    const std::lock_guard lock(mutex_);
    if (started_.load(std::memory_order_relaxed)) {
      throw state_error(
          "cudamem: the allocator is configured at its first allocation and cannot change "
          "afterwards (" + describe(config_) + ")");
    }
    apply_config_text(config_, text, source);
  }
  /// Applies CUDAMEM_<KEY> environment variables; refused once anything was allocated.
  template <class Getenv>
  void configure_from_environment(Getenv&& getenv) {
    const std::lock_guard lock(mutex_);
    if (!started_.load(std::memory_order_relaxed)) {
      apply_environment(config_, std::forward<Getenv>(getenv));
    }
  }

  [[nodiscard]] allocator_config config() const {
    const std::lock_guard lock(mutex_);
    return config_;
  }
  /// Whether PyTorch's entry points throw at a failed allocation (else return null).
  [[nodiscard]] bool raise_on_oom() const { return config().raise_on_oom; }
  /// Whether anything was ever allocated (the configuration is fixed).
  [[nodiscard]] bool started() const noexcept { return started_.load(); }

  void* allocate(std::size_t bytes, int device, cudaStream_t stream) {
    if (bytes == 0) {
      return nullptr;
    }
    per_device& d = on(device);
    if (d.frees.waiting() != 0) {
      d.frees.retire_completed(free_to{d});
    }
    try {
      return d.stack.top().allocate(bytes, block_alignment, stream);
    } catch (const out_of_memory& first) {
      if (d.frees.waiting() == 0) {
        keep_oom_report(first.what());
        throw;
      }
    }
    d.frees.retire_all(free_to{d});  // memory that waited for other streams, then once more
    try {
      return d.stack.top().allocate(bytes, block_alignment, stream);
    } catch (const out_of_memory& e) {
      keep_oom_report(e.what());
      throw;
    }
  }

  void deallocate(void* p, std::size_t bytes, int device, cudaStream_t stream) {
    if (p == nullptr) {
      return;
    }
    per_device* d = existing(device);
    if (d == nullptr) {
      throw std::invalid_argument("cudamem: free of " + std::to_string(bytes) +
                                  " bytes on device " + std::to_string(device) +
                                  ", where this allocator never allocated");
    }
    if (!(uses_.any() && d->frees.defer(p, bytes, stream, uses_.take(p)))) {
      d->stack.top().deallocate(p, bytes, block_alignment, stream);
    }
    if (d->frees.waiting() != 0) {
      d->frees.retire_completed(free_to{*d});
    }
  }

  /// `stream` uses the live block at p too. (PyTorch names no device here: the table is the
  /// allocator's, and the free, which knows the device, takes the streams out of it.)
  void record_stream(void* p, cudaStream_t stream) {
    if (p == nullptr) {
      return;
    }
    if (!started()) {
      throw std::invalid_argument("cudamem: record_stream of a pointer before any allocation");
    }
    uses_.add(p, stream);
  }

  /// Gives wholly free memory back (device -1: all), after waiting frees are done.
  std::size_t release(int device) {
    std::size_t released = 0;
    for_each_existing([&](per_device& d) {
      if (device < 0 || d.stack.device() == device) {
        d.frees.retire_all(free_to{d});
        released += d.stack.release();
      }
    });
    return released;
  }

  /// `device`'s figures (stack_exists 0 when it never allocated).
  [[nodiscard]] cudamem_stats stats(int device) {
    per_device* d = existing(device);
    if (d == nullptr) {
      const allocator_config c = config();
      check_device(device, c.simulate_bytes.has_value());
      cudamem_stats s{};
      s.device = device;
      s.limit_bytes = c.limit_bytes.value_or(0);
      return s;
    }
    cudamem_stats s = d->stack.stats();
    s.pending_frees = d->frees.waiting();
    return s;
  }

  /// What `device`'s stack holds from the device, by address (none before its first use).
  [[nodiscard]] std::vector<address_range> segments(int device) {
    per_device* d = existing(device);
    if (d == nullptr) {
      check_device(device, config().simulate_bytes.has_value());
      return {};
    }
    std::optional<std::vector<address_range>> held = d->stack.segments();
    if (!held) {
      throw state_error("cudamem: resource=async cannot list the memory it holds (a "
                        "cudaMallocAsync pool does not tell); use vm_pool or pool");
    }
    return std::move(*held);
  }

  /// Gives `peer` access to `device`'s memory, now and later (see device_stack::add_peer).
  void add_peer(int device, int peer) {
    const bool simulated = config().simulate_bytes.has_value();
    check_device(device, simulated);
    check_device(peer, simulated);
    const std::lock_guard lock(mutex_);  // against the stack's creation with the peer list
    auto& list = peers_[static_cast<std::size_t>(device)];
    if (std::find(list.begin(), list.end(), peer) == list.end() && peer != device) {
      if (per_device* d = existing(device)) {
        d->stack.add_peer(peer);
      }
      list.push_back(peer);
    }
  }

  /// `device`'s stack, or nullptr before its first allocation.
  [[nodiscard]] const device_stack* stack_of(int device) noexcept {
    per_device* d = existing(device);
    return d != nullptr ? &d->stack : nullptr;
  }

  /// Starts `device`'s peak of reserved bytes again from now (nothing before its first use).
  void reset_peak_reserved(int device) {
    if (per_device* d = existing(device)) {
      d->stack.reset_peak_reserved();
    } else {
      check_device(device, config().simulate_bytes.has_value());
    }
  }

  [[nodiscard]] std::string report(int device, std::size_t bytes) {
    return on(device).stack.report(bytes);
  }
  [[nodiscard]] std::string last_oom_report() const {
    const std::lock_guard lock(report_mutex_);
    return last_oom_report_;
  }

  /// Bytes the resources say are handed out, on every device, plus frees still waiting for
  /// other streams (destroy's check). The resources' own figures, not the statistics': those
  /// count a free before the resource checks it, so a refused free would hide a live block.
  [[nodiscard]] std::size_t in_use_bytes() {
    std::size_t total = 0;
    for_each_existing([&](per_device& d) {
      total += d.stack.resource_used_bytes() + d.frees.waiting();
    });
    return total;
  }

 private:
  struct per_device {
    per_device(const allocator_config& c, int device, const std::vector<int>& peers)
        : stack(c, device, peers), frees(device, c.simulate_bytes.has_value()) {}
    device_stack stack;
    deferred_frees<cuda_events> frees;
  };

  /// The free a waiting block gets once its streams are done.
  struct free_to {
    per_device& d;
    void operator()(void* p, std::size_t bytes, cudaStream_t stream) const {
      d.stack.top().deallocate(p, bytes, block_alignment, stream);
    }
  };


  /// Throws std::out_of_range unless `device` exists (simulated: 0..simulated_devices-1),
  /// no_device_error when there is no device at all.
  void check_device(int device, bool simulated) {
    // (Asked each time: only a device's first allocation and stats() before it come here.)
    const int count =
        simulated ? simulated_devices : std::min(cudamem::device_count(), max_devices);
    if (count == 0) {  // no GPU, no driver, a driver too old: CUDAMEM_ERROR_NO_DEVICE
      throw cudamem::no_device_error(cudaErrorNoDevice,
                                     "device " + std::to_string(device) + " requested");
    }
    if (device < 0 || device >= count) {
      throw std::out_of_range("cudamem: device " + std::to_string(device) + " does not exist (" +
                              std::to_string(count) + (simulated ? " simulated" : "") +
                              " device" + (count == 1 ? "" : "s") + ")");
    }
  }

  per_device& on(int device) {
    if (device >= 0 && device < max_devices) {
      if (per_device* d = devices_[static_cast<std::size_t>(device)].load(
              std::memory_order_acquire)) {
        return *d;
      }
    }
    const std::lock_guard lock(mutex_);
    check_device(device, config_.simulate_bytes.has_value());
    auto& slot = devices_[static_cast<std::size_t>(device)];
    if (per_device* d = slot.load(std::memory_order_acquire)) {
      return *d;
    }
    auto made = std::make_unique<per_device>(config_, device, peers_[static_cast<std::size_t>(device)]);
    started_.store(true);
    slot.store(made.get(), std::memory_order_release);
    return *made.release();
  }

  per_device* existing(int device) noexcept {
    if (device < 0 || device >= max_devices) {
      return nullptr;
    }
    return devices_[static_cast<std::size_t>(device)].load(std::memory_order_acquire);
  }
  template <class F>
  void for_each_existing(F&& f) {
    for (auto& slot : devices_) {
      if (per_device* d = slot.load(std::memory_order_acquire)) {
        f(*d);
      }
    }
  }

  void keep_oom_report(const char* text) {
    try {
      const std::lock_guard lock(report_mutex_);
      last_oom_report_ = text;
    } catch (...) {  // no memory for a copy: the exception still carries it
    }
  }

  mutable std::mutex mutex_;  ///< configuration and stack creation
  allocator_config config_;
  std::atomic<bool> started_{false};
  std::array<std::atomic<per_device*>, max_devices> devices_{};
  std::array<std::vector<int>, max_devices> peers_{};  ///< add_peer's, by device (mutex_)
  stream_uses uses_;  ///< record_stream's extra streams, for every device
  mutable std::mutex report_mutex_;
  std::string last_oom_report_;
};

}  // namespace cudamem::capi
