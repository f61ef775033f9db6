// cudamem/peer_access.hpp — scoped, reference-counted peer access between two GPUs: kernels on
// one device reading and writing another device's memory, for as long as someone needs it.
//
//   #include <cudamem/peer_access.hpp>
//
//   if (cudamem::can_access_peer(0, 1)) {
//     cudamem::peer_access reach{0, 1};     // kernels on device 0 may use device 1's memory
//     kernel_on_0<<<g, b, 0, s0.get()>>>(buffer_on_1.span());
//     s0.synchronize();
//   }                                       // access as it was before the first guard: off,
//                                           // unless something else had turned it on
//   std::vector<cudamem::peer_access> all;  // movable: one per ordered pair
//   for (int a = 0; a < n; ++a)
//     for (int b = 0; b < n; ++b)
//       if (a != b && cudamem::can_access_peer(a, b)) all.emplace_back(a, b);
//
// Why a guard. cudaDeviceEnablePeerAccess is process-wide state with no owner: two libraries
// that both enable and later disable it switch each other's access off; one that enables and
// never disables leaves it on for everyone (and enabled access costs: every cudaMalloc on the
// owner must then be mapped for the accessor too). A guard counts its holders per ordered pair
// of devices, enables on the first and restores on the last, and never disables what it did
// not enable.
//
// Contract
// - `peer_access(accessor, owner)` lets device `accessor` access memory of device `owner` for
//   the guard's lifetime (cudaDeviceEnablePeerAccess(owner) with `accessor` current; the caller's
//   device is restored). Access is one-way: make a second guard (owner, accessor) for the other.
// - Reference counted per ordered pair, process-wide, thread-safe: the first guard of a pair
//   enables access, later ones only count; when the last ends, access is disabled — only if
//   the first guard enabled it. If access was already on (cudaErrorPeerAccessAlreadyEnabled:
//   another library or raw CUDA owns it), the guards leave it on. If something else disabled
//   it meanwhile, the last guard's disable finds it off (cudaErrorPeerAccessNotEnabled) and
//   says nothing: the state is already the one to restore. A library that enables access while
//   a guard of ours holds it gets cudaErrorPeerAccessAlreadyEnabled and cannot know that our
//   last guard will switch it off: hold a guard for as long as you use access.
// - `accessor == owner`: a device always reaches its own memory; the guard does nothing.
// - Errors (the constructor changes nothing when it throws): no GPU `no_device_error`; an id that
//   does not exist `std::out_of_range`; a pair with no peer path (cudaDeviceCanAccessPeer says 0:
//   different PCIe root complexes, some virtualised set-ups) `peer_access_error` naming both;
//   any other CUDA failure `cuda_error`. The destructor is noexcept; a failing disable goes to
//   the error handler.
// - What it covers: memory from cudaMalloc (device_resource, and pool_resource over it).
//   Memory-pool memory (async_resource) is governed by cudaMemPoolSetAccess and virtual memory
//   (vm_resource, vm_pool_resource) by cuMemSetAccess — `vm_resource_options::peers` — instead.
//   Copies between devices (`copy`, cudaMemcpyPeerAsync) need no peer access: without it the
//   driver stages them through the host; with it they go directly over NVLink or PCIe.
// - Movable (a moved-from guard holds nothing), not copyable.
#pragma once

#include <cudamem/detail/cuda/quiet_device_scope.hpp>
#include <cudamem/detail/sync/mutex.hpp>
#include <cudamem/device.hpp>
#include <cudamem/error.hpp>

#include <cuda_runtime_api.h>

#include <map>
#include <source_location>
#include <string>
#include <utility>

namespace cudamem {

/// Two devices that cannot access each other's memory (no peer path between them).
class peer_access_error : public cuda_error {
 public:
  /// `accessor` cannot reach `owner`'s memory (cudaErrorPeerAccessUnsupported).
  peer_access_error(int accessor, int owner,
                    std::source_location where = std::source_location::current())
      : cuda_error(cudaErrorPeerAccessUnsupported,
                   "device " + std::to_string(accessor) + " cannot access device " +
                       std::to_string(owner) +
                       "'s memory (cudaDeviceCanAccessPeer is 0: no peer path between them); "
                       "copies between them still work, staged through the host",
                   where),
        accessor_(accessor),
        owner_(owner) {}

  /// The device that asked for access.
  [[nodiscard]] int accessor() const noexcept { return accessor_; }
  /// The device whose memory it asked for.
  [[nodiscard]] int owner() const noexcept { return owner_; }

 private:
  int accessor_;
  int owner_;
};

/// Whether kernels on `accessor` can be given access to `owner`'s memory (true for a device
/// and itself). Invalid ids throw as everywhere: `std::out_of_range`, `no_device_error`.
[[nodiscard]] inline bool can_access_peer(int accessor, int owner) {
  validate_device(accessor);
  validate_device(owner);
  if (accessor == owner) {
    return true;
  }
  int can = 0;
  check(cudaDeviceCanAccessPeer(&can, accessor, owner), "cudaDeviceCanAccessPeer");
  return can != 0;
}

namespace detail {

/// The process's holders of peer access, per ordered pair. Never destroyed, so that guards in
/// static objects can still end during static destruction.
class peer_access_registry {
 public:
  static peer_access_registry& instance() {
    static auto* registry = new peer_access_registry;  // deliberately never deleted
    return *registry;
  }

  /// One more holder of (accessor, owner); enables access for the first. Strong guarantee.
  void acquire(int accessor, int owner) {
    const detail::lock_guard lock(mutex_);
    const auto key = std::make_pair(accessor, owner);
    if (const auto found = pairs_.find(key); found != pairs_.end()) {
      ++found->second.holders;
      return;
    }
    int can = 0;
    check(cudaDeviceCanAccessPeer(&can, accessor, owner), "cudaDeviceCanAccessPeer");
    if (can == 0) {
      throw peer_access_error(accessor, owner);
    }
    bool enabled_here = false;
    {
      const device_guard on{accessor};
      const cudaError_t code = cudaDeviceEnablePeerAccess(owner, 0);
      if (code == cudaErrorPeerAccessAlreadyEnabled) {
        static_cast<void>(cudaGetLastError());  // an answer, not an error: someone else owns it
      } else {
        check(code, "cudaDeviceEnablePeerAccess");
        enabled_here = true;
      }
    }
    try {
      pairs_.emplace(key, pair_state{1, enabled_here});
    } catch (...) {  // out of host memory: undo, so that nothing changed
      if (enabled_here) {
        const quiet_device_scope on{accessor, "peer_access: undoing an enable"};
        report_error(cudaDeviceDisablePeerAccess(owner), "peer_access: cudaDeviceDisablePeerAccess");
      }
      throw;
    }
  }

  /// One holder fewer; the last restores the state found by the first.
  void release(int accessor, int owner) noexcept {
    const detail::lock_guard lock(mutex_);
    const auto found = pairs_.find(std::make_pair(accessor, owner));
    if (found == pairs_.end()) {
      report_problem("peer_access: released a pair nobody holds");
      return;
    }
    if (--found->second.holders > 0) {
      return;
    }
    const bool enabled_here = found->second.enabled_here;
    pairs_.erase(found);
    if (!enabled_here) {
      return;  // it was on before us: leave it on
    }
    const quiet_device_scope on{accessor, "peer_access: switching device to disable access"};
    const cudaError_t code = cudaDeviceDisablePeerAccess(owner);
    if (code == cudaErrorPeerAccessNotEnabled) {
      static_cast<void>(cudaGetLastError());  // someone disabled it already: nothing to restore
      return;
    }
    report_error(code, "peer_access: cudaDeviceDisablePeerAccess");
  }

  /// Live guards of (accessor, owner); and whether the first of them enabled access.
  [[nodiscard]] int holders(int accessor, int owner) const {
    const detail::lock_guard lock(mutex_);
    const auto found = pairs_.find(std::make_pair(accessor, owner));
    return found == pairs_.end() ? 0 : found->second.holders;
  }
  [[nodiscard]] bool enabled_here(int accessor, int owner) const {
    const detail::lock_guard lock(mutex_);
    const auto found = pairs_.find(std::make_pair(accessor, owner));
    return found != pairs_.end() && found->second.enabled_here;
  }

 private:
  struct pair_state {
    int holders;
    bool enabled_here;  ///< the first guard enabled access (so the last one disables it)
  };
  peer_access_registry() = default;

  mutable detail::mutex mutex_;
  std::map<std::pair<int, int>, pair_state> pairs_;
};

}  // namespace detail

/// Access from one device to another's memory for one scope; see the contract above.
class peer_access {
 public:
  /// Device `accessor` may access memory of device `owner` until the guard ends.
  peer_access(int accessor, int owner) : accessor_(accessor), owner_(owner) {
    validate_device(accessor);
    validate_device(owner);
    if (accessor != owner) {
      detail::peer_access_registry::instance().acquire(accessor, owner);
      holds_ = true;
    }
  }

  ~peer_access() { end(); }

  peer_access(const peer_access&) = delete;
  peer_access& operator=(const peer_access&) = delete;

  /// Takes `other`'s hold on the pair; `other` holds nothing after.
  peer_access(peer_access&& other) noexcept
      : accessor_(other.accessor_), owner_(other.owner_), holds_(std::exchange(other.holds_, false)) {}

  /// Ends this guard's hold (disabling access if it was the last), then takes `other`'s.
  peer_access& operator=(peer_access&& other) noexcept {
    if (this != &other) {
      end();
      accessor_ = other.accessor_;
      owner_ = other.owner_;
      holds_ = std::exchange(other.holds_, false);
    }
    return *this;
  }

  /// The device whose kernels access the owner's memory.
  [[nodiscard]] int accessor() const noexcept { return accessor_; }
  /// The device whose memory is accessed.
  [[nodiscard]] int owner() const noexcept { return owner_; }
  /// False for a moved-from guard and for a device and itself.
  [[nodiscard]] bool holds() const noexcept { return holds_; }

  /// Guards alive now for the pair (accessor, owner), in the whole process.
  [[nodiscard]] static int holders(int accessor, int owner) {
    return detail::peer_access_registry::instance().holders(accessor, owner);
  }
  /// Whether the guards of the pair enabled access themselves (and so will disable it);
  /// false when access was already on when the first came, or when none is alive.
  [[nodiscard]] static bool enabled_by_guards(int accessor, int owner) {
    return detail::peer_access_registry::instance().enabled_here(accessor, owner);
  }

 private:
  // Out of line on purpose. Inlined into the destructor of a std::optional<peer_access> (or any
  // holder whose engaged flag it must trust), g++ 12 at -O1..-O3 cannot tie this read of holds_
  // to the holder's flag and warns that holds_ "may be used uninitialized" (a false positive,
  // -Wmaybe-uninitialized), which fails a user's -Werror build. A call here costs nothing: a
  // guard ends rarely, and ending takes a lock.
  [[gnu::noinline]] void end() noexcept {
    if (holds_) {
      detail::peer_access_registry::instance().release(accessor_, owner_);
      holds_ = false;
    }
  }

  int accessor_;
  int owner_;
  bool holds_ = false;
};

}  // namespace cudamem
