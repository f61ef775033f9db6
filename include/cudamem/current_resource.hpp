// cudamem/current_resource.hpp — the resource each device's owners use when none is given,
// and a scoped guard to change it.
//
//   #include <cudamem/current_resource.hpp>
//
//   cudamem::memory_resource& mr = cudamem::get_current_resource();   // current device's
//   cudamem::async_resource fast;
//   {
//     cudamem::resource_guard use{fast};          // device_buffer & co. now allocate from fast
//     cudamem::device_buffer<float> a(1 << 20);   // ...on the current device
//   }                                             // the previous resource again, however the
//                                                 // scope was left
//   cudamem::set_current_resource(&fast, 1);      // device 1's, until set again
//   cudamem::set_current_resource(nullptr, 1);    // back to device 1's default
//
// Contract
// - One current resource per device, shared by all threads (like RMM's, unlike the current
//   device, which is per thread). `device` -1 means the calling thread's current device; an
//   id that does not exist throws `std::out_of_range`; no GPU throws `no_device_error`.
// - The default for a device is a `device_resource` of that device, created on first use and
//   never destroyed, so owners destroyed during static destruction can still free into it.
// - `set_current_resource(mr, device)` makes `*mr` current (nullptr: the default) and
//   returns the resource that was current before. The table holds a plain pointer: the
//   resource must outlive its time as current, and every owner that allocated from it.
// - Get and set are thread-safe (atomics; the default is created exactly once).
// - `resource_guard` sets a resource for one scope and restores the previous one on every
//   exit path, exceptions included. Not copyable or movable: it belongs to its scope. Guards
//   on one device must nest (a guard restores what was current when *it* was made).
#pragma once

#include <cudamem/device.hpp>
#include <cudamem/device_resource.hpp>
#include <cudamem/memory_resource.hpp>

#include <cudamem/detail/sync/atomic.hpp>

#include <cstddef>
#include <stdexcept>
#include <string>

namespace cudamem {

namespace detail {

/// The per-device table behind get/set_current_resource. A class of its own (with the way to
/// make a default passed in) so its logic is testable with no GPU.
class current_resource_table {
 public:
  using default_factory = memory_resource* (*)(int device);

  current_resource_table(int devices, default_factory make_default)
      : devices_(devices),
        make_default_(make_default),
        slots_(new slot[static_cast<std::size_t>(devices)]) {}  // value-initialised: nullptrs

  ~current_resource_table() { delete[] slots_; }
  current_resource_table(const current_resource_table&) = delete;
  current_resource_table& operator=(const current_resource_table&) = delete;

  [[nodiscard]] int devices() const noexcept { return devices_; }

  [[nodiscard]] memory_resource& get(int device) {
    const std::size_t slot = index(device);
    memory_resource* mr = slots_[slot].current.load(memory_order_acquire);
    return mr != nullptr ? *mr : default_for(slot);
  }

  /// Sets `mr` (nullptr: the default) and returns what was current before.
  memory_resource& exchange(memory_resource* mr, int device) {
    const std::size_t slot = index(device);
    memory_resource* before = slots_[slot].current.exchange(mr, memory_order_acq_rel);
    return before != nullptr ? *before : default_for(slot);
  }

 private:
  std::size_t index(int device) const {
    if (device < 0 || device >= devices_) {
      throw std::out_of_range("cudamem: current resource: device " + std::to_string(device) +
                              " does not exist; valid ids are 0.." + std::to_string(devices_ - 1));
    }
    return static_cast<std::size_t>(device);
  }

  /// The default resource of a device, made on first use. Two threads may race to make it:
  /// one wins the compare-exchange, the other deletes its own and uses the winner's.
  memory_resource& default_for(std::size_t slot) {
    memory_resource* existing = slots_[slot].made.load(memory_order_acquire);
    if (existing != nullptr) {
      return *existing;
    }
    memory_resource* made = make_default_(static_cast<int>(slot));
    if (slots_[slot].made.compare_exchange_strong(existing, made, memory_order_acq_rel)) {
      return *made;  // owned by the table from now on, and never destroyed
    }
    delete made;
    return *existing;
  }

  /// One device's current resource (nullptr: its default) and its default once made.
  struct slot {
    atomic<memory_resource*> current;
    atomic<memory_resource*> made;
  };

  int devices_;
  default_factory make_default_;
  slot* slots_;  // devices_ of them
};

/// The process's table, sized by the devices visible. Made on first use and never destroyed
/// (a plain `static` object would be destroyed at exit while owners in other static objects
/// may still free into the resources it hands out).
inline current_resource_table& current_resources() {
  static current_resource_table* const table = [] {
    const int devices = device_count();
    if (devices == 0) {
      throw no_device_error(cudaErrorNoDevice, "the current device resource was asked for");
    }
    return new current_resource_table(devices, [](int device) -> memory_resource* {
      return new device_resource(device);
    });
  }();
  return *table;
}

inline int device_or_current(int device) { return device < 0 ? current_device() : device; }

}  // namespace detail

/// The resource owners of `device` (-1: the current device) allocate from by default.
[[nodiscard]] inline memory_resource& get_current_resource(int device = -1) {
  detail::current_resource_table& table = detail::current_resources();
  return table.get(detail::device_or_current(device));
}

/// Makes `*mr` (nullptr: the default) current for `device` (-1: the current device); returns
/// the resource current before.
inline memory_resource& set_current_resource(memory_resource* mr, int device = -1) {
  detail::current_resource_table& table = detail::current_resources();
  return table.exchange(mr, detail::device_or_current(device));
}

/// Makes a resource current for one scope; see the contract above.
class resource_guard {
 public:
  /// Makes `mr` current for `device` (-1: the device current now, remembered) until the
  /// guard is destroyed.
  explicit resource_guard(memory_resource& mr, int device = -1)
      : device_(detail::device_or_current(device)),
        previous_(&set_current_resource(&mr, device_)) {}

  ~resource_guard() {
    try {
      static_cast<void>(detail::current_resources().exchange(previous_, device_));
    } catch (...) {  // the table exists and device_ is valid, so this is not expected
      report_problem("resource_guard: could not restore the previous resource");
    }
  }

  resource_guard(const resource_guard&) = delete;
  resource_guard& operator=(const resource_guard&) = delete;
  resource_guard(resource_guard&&) = delete;
  resource_guard& operator=(resource_guard&&) = delete;

  /// The resource that was current before the guard and will be again after it.
  [[nodiscard]] memory_resource& previous() const noexcept { return *previous_; }
  /// The device whose current resource the guard set.
  [[nodiscard]] int device() const noexcept { return device_; }

 private:
  int device_;
  memory_resource* previous_;
};

}  // namespace cudamem
