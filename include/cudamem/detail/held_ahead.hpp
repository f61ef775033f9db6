// cudamem/detail/held_ahead.hpp — memory held ahead of need gives way to the rest of the
// process: a process-wide list of the resources that hold device memory nobody has asked for
// yet (vm_resource: handles made ahead by its growth thread, or the rest of a growth, lying
// free at its frontier), which a resource about to fail for lack of memory asks to give it
// back first.
//
//   // a resource whose cudaMalloc just failed for lack of memory:
//   if (detail::give_back_held_ahead(detail::memory_domain{device}) != 0) {
//     code = cudaMalloc(&p, bytes);   // once more: the device has that much more free
//   }
//
// Why. A vm_resource grows ahead of need (vm_resource_options::grow_ahead_bytes): up to 4 GiB
// mapped before anyone asks, so that a growing pool does not wait for the driver. A
// cudaMallocAsync pool, a pool over device_resource or a second vm_pool beside it in the same
// process cannot use that memory, and failed on traces that fitted before growth ahead
// existed. Memory made ahead is a guess; memory another resource needs now is not. So before
// any cudamem resource throws `out_of_memory` for device memory, the holders on that device
// give back what they hold ahead, and the request is tried once more.
//
// Contract
// - A holder (`held_ahead_holder`) is registered with the memory domain it draws from
//   (`memory_domain`: a real device by id, or a simulated device by the address of the
//   object that stands for it) for its whole life: `add` at the end of its constructor,
//   `remove` at the start of its destructor (which then waits for a give-back in progress).
// - `give_back_held_ahead(domain, except)` asks every holder of `domain` but `except` to give
//   back what it holds ahead and returns the bytes they gave back; `held_ahead_bytes(domain)`
//   says how much they hold ahead now (out-of-memory reports name it). Neither throws.
// - Lock order. Both hold the registry's lock while they call the holders, which take their
//   own locks. So a caller must hold no holder's lock: a vm_resource that fails unlocks itself
//   first. Other locks may be held (a pool's shard lock around its upstream's allocation):
//   holders never take them.
// - Re-entry: on a thread that is already inside either call (a holder giving back, a
//   simulated device's memory asked for by a vm layer: `no_give_back_scope`), both return 0
//   at once instead of locking the registry again.
#pragma once

#include <cudamem/detail/sync/mutex.hpp>
#include <cudamem/detail/thread_flag_scope.hpp>

#include <cstddef>
#include <new>
#include <vector>

namespace cudamem::detail {

/// Which memory a resource draws from: a real device (`device` >= 0), or a simulated one
/// (`device` -1 and the address of what stands for its physical memory).
struct memory_domain {
  int device = -1;
  const void* simulated = nullptr;

  friend bool operator==(const memory_domain&, const memory_domain&) = default;
};

/// What the registry asks of a resource that holds memory ahead of need.
class held_ahead_holder {
 public:
  /// Gives back what it holds ahead of need and has not handed out; returns the bytes. Called
  /// with the registry's lock held and none of the holder's own.
  virtual std::size_t give_back_ahead() noexcept = 0;
  /// What it holds ahead of need now.
  [[nodiscard]] virtual std::size_t bytes_held_ahead() const noexcept = 0;

 protected:
  held_ahead_holder() = default;
  ~held_ahead_holder() = default;
  held_ahead_holder(const held_ahead_holder&) = default;
  held_ahead_holder& operator=(const held_ahead_holder&) = default;
};

/// True on a thread inside a registry call (see the contract: re-entry).
inline thread_local bool inside_held_ahead_registry = false;

/// While it lives, the registry's calls on this thread return 0 at once (see the contract).
class no_give_back_scope : thread_flag_scope {
 public:
  no_give_back_scope() noexcept : thread_flag_scope(inside_held_ahead_registry) {}
};

/// The process-wide list of holders; see the contract.
class held_ahead_registry {
 public:
  /// Constructed at its first use, in static storage, and never destroyed, so that it outlives
  /// every holder: also those that live to the end of the process (libcudamem_c's stacks are
  /// never destroyed), which a program's last frees and allocations reach while static
  /// destruction runs. Allocates nothing (a noexcept give-back may be the first use).
  static held_ahead_registry& instance() noexcept {
    alignas(held_ahead_registry) static unsigned char storage[sizeof(held_ahead_registry)];
    static held_ahead_registry* const registry = ::new (storage) held_ahead_registry;
    return *registry;
  }

  void add(held_ahead_holder* holder, memory_domain domain) {
    const lock_guard lock(mutex_);
    holders_.push_back({holder, domain});
  }
  void remove(const held_ahead_holder* holder) noexcept {
    const lock_guard lock(mutex_);
    std::erase_if(holders_, [&](const entry& e) { return e.holder == holder; });
  }

  std::size_t give_back(memory_domain domain, const held_ahead_holder* except) noexcept {
    if (inside_held_ahead_registry) {
      return 0;
    }
    const no_give_back_scope inside;
    const lock_guard lock(mutex_);
    std::size_t given = 0;
    for (const entry& e : holders_) {
      if (e.domain == domain && e.holder != except) {
        given += e.holder->give_back_ahead();
      }
    }
    return given;
  }

  [[nodiscard]] std::size_t held(memory_domain domain) const noexcept {
    if (inside_held_ahead_registry) {
      return 0;
    }
    const no_give_back_scope inside;
    const lock_guard lock(mutex_);
    std::size_t total = 0;
    for (const entry& e : holders_) {
      if (e.domain == domain) {
        total += e.holder->bytes_held_ahead();
      }
    }
    return total;
  }

 private:
  held_ahead_registry() = default;

  struct entry {
    held_ahead_holder* holder;
    memory_domain domain;
  };
  mutable mutex mutex_;
  std::vector<entry> holders_;
};

/// Every holder of `domain` but `except` gives back what it holds ahead; returns the bytes.
inline std::size_t give_back_held_ahead(memory_domain domain,
                                        const held_ahead_holder* except = nullptr) noexcept {
  return held_ahead_registry::instance().give_back(domain, except);
}

/// What the holders of `domain` hold ahead of need now.
[[nodiscard]] inline std::size_t held_ahead_bytes(memory_domain domain) noexcept {
  return held_ahead_registry::instance().held(domain);
}

}  // namespace cudamem::detail
