// cudamem/per_device_resources.hpp — one resource stack per GPU, owned together, each made the
// current resource of its device: code that allocates "on the current device" gets that
// device's pool, from any thread.
//
//   #include <cudamem/per_device_resources.hpp>
//
//   auto pools = cudamem::per_device_resources::pools();   // pool over cudaMalloc, every GPU
//   std::vector<std::thread> workers;
//   for (const int d : pools.devices()) {
//     workers.emplace_back([d] {
//       cudamem::device_guard on{d};                // the current device is per thread
//       cudamem::stream s;
//       cudamem::device_buffer<float> x(1 << 20, s);   // from device d's pool
//     });
//   }
//   for (auto& w : workers) w.join();
//   pools.get(1).stats();                            // device 1's stack (its top resource)
//
//   // Any stack, built once per device (objects made in the stack live as long as it does):
//   cudamem::per_device_resources stats{[](cudamem::resource_stack& stack, int device)
//                                           -> cudamem::memory_resource& {
//     auto& cuda = stack.make<cudamem::device_resource>(device);
//     auto& pool = stack.make<cudamem::pool_resource>(cuda);
//     return stack.make<cudamem::statistics_adaptor>(pool);
//   }};
//   stats.find<cudamem::pool_resource>(0).release();  // reach an object inside device 0's stack
//
// Contract
// - Devices: `options.devices`, or every visible device when it is empty. No GPU throws
//   `no_device_error`, an id that does not exist `std::out_of_range`, an id listed twice
//   `std::invalid_argument`.
// - The builder is called once per device, in the order listed, with that device current (so
//   anything in it that defaults to "the current device" gets the right one; the caller's
//   device is restored). It makes the stack's objects with `stack.make<T>(...)` and returns the
//   resource to hand out, which must belong to that device (`device() == d`), else
//   `std::invalid_argument`. If the builder, or anything else, throws, every object made so
//   far is destroyed (newest first) and no current resource has changed: nothing leaks.
// - With `options.make_current` (the default), each device's resource becomes its current
//   resource (`get_current_resource(d)`, what device_buffer & co. use by default) for the
//   object's lifetime. The destructor puts back, per device, the resource that was current
//   before — unless another resource was made current since and not restored (a guard that did
//   not nest): then that one stays, and the error handler hears of it.
// - Destruction order: current resources restored first, then each device's stack destroyed,
//   its objects newest first (a pool before the upstream it holds chunks of). Every owner that
//   allocated from the stacks must be gone by then, as with any resource.
// - `get(d)` (also `[d]`) returns device d's resource, `std::out_of_range` for a device it does
//   not hold; `current()` the current device's. Reading is thread-safe (nothing changes after
//   construction); the resources themselves are as thread-safe as they are (all of cudamem's
//   pools are). Neither copyable nor movable: the current-resource table points into it.
// - Ready-made stacks: `pools()` (pool_resource over device_resource), `async()` (an
//   async_resource of its own pool per device), `vm_pools()` (vm_pool_resource).
#pragma once

#include <cudamem/async_resource.hpp>
#include <cudamem/current_resource.hpp>
#include <cudamem/device.hpp>
#include <cudamem/device_resource.hpp>
#include <cudamem/error.hpp>
#include <cudamem/memory_resource.hpp>
#include <cudamem/pool_resource.hpp>
#include <cudamem/vm_pool_resource.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace cudamem {

/// Objects that make up one device's resource stack, destroyed newest first.
class resource_stack {
 public:
  resource_stack() = default;
  ~resource_stack() {
    while (!objects_.empty()) {
      objects_.pop_back();  // newest first: an adaptor before its upstream
    }
  }
  resource_stack(const resource_stack&) = delete;
  resource_stack& operator=(const resource_stack&) = delete;

  /// Constructs a T owned by the stack and returns it. If the constructor throws, nothing is
  /// added.
  template <class T, class... Args>
  T& make(Args&&... args) {
    static_assert(std::is_nothrow_destructible_v<T>,
                  "resource_stack owns only types whose destructor cannot throw");
    objects_.reserve(objects_.size() + 1);  // so that the push below cannot throw and leak
    auto made = std::make_unique<holder<T>>(std::forward<Args>(args)...);
    T& ref = made->value;
    objects_.push_back(std::move(made));
    return ref;
  }

  /// The first object of exactly type T in the stack (oldest first); nullptr when none.
  template <class T>
  [[nodiscard]] T* find() const noexcept {
    for (const auto& object : objects_) {
      if (auto* h = dynamic_cast<holder<T>*>(object.get())) {
        return &h->value;
      }
    }
    return nullptr;
  }

  /// The number of objects in the stack.
  [[nodiscard]] std::size_t size() const noexcept { return objects_.size(); }

 private:
  struct holder_base {
    virtual ~holder_base() = default;
  };
  template <class T>
  struct holder final : holder_base {
    template <class... Args>
    explicit holder(Args&&... args) : value(std::forward<Args>(args)...) {}
    T value;
  };

  std::vector<std::unique_ptr<holder_base>> objects_;
};

/// How a per_device_resources is set up.
struct per_device_options {
  std::vector<int> devices{};  ///< empty: every visible device
  bool make_current = true;  ///< each device's resource current for the object's lifetime
};

/// One resource stack per device; see the contract above.
class per_device_resources {
 public:
  /// Builds one stack per device: `build(stack, device)` makes its objects and returns the
  /// resource to hand out for that device.
  using builder = std::function<memory_resource&(resource_stack& stack, int device)>;

  /// Builds a stack on each device with `build` (not empty, else std::invalid_argument).
  explicit per_device_resources(const builder& build, per_device_options options = {})
      : devices_(resolve_devices(std::move(options.devices))) {
    if (!build) {
      throw std::invalid_argument("cudamem::per_device_resources: no builder");
    }
    try {
      entries_.reserve(devices_.size());
      for (const int d : devices_) {
        auto stack = std::make_unique<resource_stack>();
        memory_resource* top = nullptr;
        {
          const device_guard on{d};
          top = &build(*stack, d);
        }
        if (top->device() != d) {
          throw std::invalid_argument(
              "cudamem::per_device_resources: the stack built for device " + std::to_string(d) +
              " hands out memory of device " + std::to_string(top->device()) + " (" +
              std::string(top->name()) + ")");
        }
        entries_.push_back(entry{d, std::move(stack), top, nullptr});
      }
      if (options.make_current) {
        for (entry& e : entries_) {
          e.previous = &set_current_resource(e.top, e.device);
        }
      }
    } catch (...) {
      restore_current();
      destroy_stacks();
      throw;
    }
  }

  ~per_device_resources() {
    restore_current();
    destroy_stacks();
  }

  per_device_resources(const per_device_resources&) = delete;
  per_device_resources& operator=(const per_device_resources&) = delete;
  per_device_resources(per_device_resources&&) = delete;
  per_device_resources& operator=(per_device_resources&&) = delete;

  // --- ready-made stacks ------------------------------------------------------------------------

  /// A pool_resource over a device_resource (cudaMalloc) on every device.
  [[nodiscard]] static per_device_resources pools(pool_options pool = {},
                                                  per_device_options options = {}) {
    return per_device_resources(
        [pool](resource_stack& stack, int device) -> memory_resource& {
          auto& cuda = stack.make<device_resource>(device);
          return stack.make<pool_resource>(cuda, pool);
        },
        std::move(options));
  }

  /// An async_resource (a CUDA memory pool of its own) on every device; `release_threshold`
  /// as async_resource's (unset: CUDA's default, 0).
  [[nodiscard]] static per_device_resources async(
      std::optional<std::uint64_t> release_threshold = std::nullopt,
      per_device_options options = {}) {
    return per_device_resources(
        [release_threshold](resource_stack& stack, int device) -> memory_resource& {
          return stack.make<async_resource>(
              async_resource_options{.device = device, .release_threshold = release_threshold});
        },
        std::move(options));
  }

  /// A vm_pool_resource on every device. `vm.peers` applies to every device's pool (a device
  /// is never its own peer: it is left out of its own pool's list).
  [[nodiscard]] static per_device_resources vm_pools(vm_pool_options vm = {},
                                                     per_device_options options = {}) {
    return per_device_resources(
        [vm](resource_stack& stack, int device) -> memory_resource& {
          vm_pool_options mine = vm;
          std::erase(mine.peers, device);
          return stack.make<vm_pool_resource>(device, std::move(mine));
        },
        std::move(options));
  }

  // --- what it holds ----------------------------------------------------------------------------

  /// Device `device`'s resource; std::out_of_range if it holds none for it.
  [[nodiscard]] memory_resource& get(int device) const { return *find_entry(device).top; }
  /// `get(device)`.
  [[nodiscard]] memory_resource& operator[](int device) const { return get(device); }
  /// The calling thread's current device's resource.
  [[nodiscard]] memory_resource& current() const { return get(current_device()); }

  /// The first object of exactly type T in device `device`'s stack (`std::out_of_range` for a
  /// device it does not hold, `std::invalid_argument` when the stack has no T).
  template <class T>
  [[nodiscard]] T& find(int device) const {
    T* object = find_entry(device).stack->template find<T>();
    if (object == nullptr) {
      throw std::invalid_argument("cudamem::per_device_resources: device " +
                                  std::to_string(device) + "'s stack has no object of that type");
    }
    return *object;
  }

  /// The devices it holds stacks for, in the order they were built.
  [[nodiscard]] const std::vector<int>& devices() const noexcept { return devices_; }
  /// The number of devices it holds stacks for.
  [[nodiscard]] std::size_t size() const noexcept { return devices_.size(); }

 private:
  struct entry {
    int device;
    std::unique_ptr<resource_stack> stack;
    memory_resource* top;
    memory_resource* previous;  ///< current before us; nullptr when we did not set it
  };

  static std::vector<int> resolve_devices(std::vector<int> devices) {
    if (devices.empty()) {
      const int count = device_count();
      if (count == 0) {
        throw no_device_error(cudaErrorNoDevice, "per_device_resources: no device to build for");
      }
      for (int d = 0; d < count; ++d) {
        devices.push_back(d);
      }
      return devices;
    }
    for (std::size_t i = 0; i < devices.size(); ++i) {
      validate_device(devices[i]);
      if (std::find(devices.begin(), devices.begin() + static_cast<std::ptrdiff_t>(i),
                    devices[i]) != devices.begin() + static_cast<std::ptrdiff_t>(i)) {
        throw std::invalid_argument("cudamem::per_device_resources: device " +
                                    std::to_string(devices[i]) + " is listed twice");
      }
    }
    return devices;
  }

  [[nodiscard]] const entry& find_entry(int device) const {
    for (const entry& e : entries_) {
      if (e.device == device) {
        return e;
      }
    }
    throw std::out_of_range("cudamem::per_device_resources: no resource for device " +
                            std::to_string(device));
  }

  /// Puts back what was current before, where ours is still current.
  void restore_current() noexcept {
    for (auto it = entries_.rbegin(); it != entries_.rend(); ++it) {
      if (it->previous == nullptr) {
        continue;
      }
      try {
        memory_resource& was = set_current_resource(it->previous, it->device);
        if (&was != it->top) {
          // Someone made another resource current and did not restore ours: theirs stays.
          static_cast<void>(set_current_resource(&was, it->device));
          report_problem("per_device_resources: device " + std::to_string(it->device) +
                         "'s current resource was changed and not restored; left as it is");
        }
      } catch (...) {
        report_problem("per_device_resources: could not restore a device's current resource");
      }
      it->previous = nullptr;
    }
  }

  void destroy_stacks() noexcept {
    while (!entries_.empty()) {
      entries_.pop_back();  // the last device's stack first
    }
  }

  std::vector<int> devices_;
  std::vector<entry> entries_;
};

}  // namespace cudamem
