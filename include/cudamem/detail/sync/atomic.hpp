// cudamem/detail/sync/atomic.hpp — std::atomic's interface for words (integers, pointers,
// enums, bool), on the compiler's __atomic builtins, without including <atomic>.
//
//   cudamem::detail::atomic<std::size_t> used{0};
//   used.fetch_add(n, cudamem::detail::memory_order_relaxed);
//   std::size_t seen = used.load(cudamem::detail::memory_order_acquire);
//   while (!peak.compare_exchange_weak(seen, seen + 1)) {}
//
// Why not std::atomic: in C++20, <atomic> brings atomic waiting and with it <bits/chrono.h>,
// <bits/std_mutex.h> and more. Under nvcc 13 with g++ 12 that adds about 0.6 s to every
// translation unit that includes it (bench/compile_time.py), more than cuda_runtime.h costs
// alone, and cudamem's owners are included everywhere. What cudamem needs of an atomic is
// loads, stores, exchanges, compare-exchanges and fetch-ops on one word; the builtins below are
// exactly what libstdc++'s own std::atomic compiles to, and GCC, Clang and nvcc's host compiler
// all have them. (cudamem needs a GCC-compatible host compiler anyway: it is Linux-only.)
//
// Contract
// - Same names, arguments and meaning as std::atomic<T> and std::memory_order for what is here;
//   the default order is seq_cst, as there. T must be trivially copyable and lock-free at its
//   size (checked at compile time). fetch_* exist for integers (and fetch_add/sub for pointers,
//   in elements).
// - Not copyable, not movable; default construction value-initialises (as C++20's std::atomic).
#pragma once

#include <cstddef>
#include <type_traits>

namespace cudamem::detail {

/// std::memory_order's values, as the builtins take them.
enum class memory_order : int {
  relaxed = __ATOMIC_RELAXED,
  consume = __ATOMIC_CONSUME,
  acquire = __ATOMIC_ACQUIRE,
  release = __ATOMIC_RELEASE,
  acq_rel = __ATOMIC_ACQ_REL,
  seq_cst = __ATOMIC_SEQ_CST,
};
inline constexpr memory_order memory_order_relaxed = memory_order::relaxed;
inline constexpr memory_order memory_order_acquire = memory_order::acquire;
inline constexpr memory_order memory_order_release = memory_order::release;
inline constexpr memory_order memory_order_acq_rel = memory_order::acq_rel;
inline constexpr memory_order memory_order_seq_cst = memory_order::seq_cst;

/// The strongest order a failed compare-exchange may use, given the success order (as
/// std::atomic derives it when only one order is given).
constexpr memory_order failure_order(memory_order success) noexcept {
  return success == memory_order::acq_rel   ? memory_order::acquire
         : success == memory_order::release ? memory_order::relaxed
                                            : success;
}

/// A compiler-only fence (std::atomic_signal_fence).
inline void atomic_signal_fence(memory_order order) noexcept {
  __atomic_signal_fence(static_cast<int>(order));
}

/// What fetch_add/fetch_sub take: the integer itself, or elements for a pointer.
template <class T>
using atomic_difference_t = std::conditional_t<std::is_pointer_v<T>, std::ptrdiff_t, T>;

template <class T>
class atomic {
  static_assert(std::is_trivially_copyable_v<T>, "detail::atomic<T> needs a trivially copyable T");
  static_assert(sizeof(T) == 1 || sizeof(T) == 2 || sizeof(T) == 4 || sizeof(T) == 8,
                "detail::atomic<T> holds words of 1, 2, 4 or 8 bytes");
  static constexpr bool is_integer = std::is_integral_v<T> && !std::is_same_v<T, bool>;

 public:
  constexpr atomic() noexcept : value_() {}
  constexpr atomic(T desired) noexcept : value_(desired) {}  // NOLINT: as std::atomic
  atomic(const atomic&) = delete;
  atomic& operator=(const atomic&) = delete;

  static constexpr bool is_always_lock_free = __atomic_always_lock_free(sizeof(T), 0);
  static_assert(is_always_lock_free, "detail::atomic<T>: T is not lock-free on this target");

  [[nodiscard]] T load(memory_order order = memory_order::seq_cst) const noexcept {
    T out;
    __atomic_load(&value_, &out, static_cast<int>(order));
    return out;
  }
  void store(T desired, memory_order order = memory_order::seq_cst) noexcept {
    __atomic_store(&value_, &desired, static_cast<int>(order));
  }
  T exchange(T desired, memory_order order = memory_order::seq_cst) noexcept {
    T out;
    __atomic_exchange(&value_, &desired, &out, static_cast<int>(order));
    return out;
  }
  bool compare_exchange_weak(T& expected, T desired, memory_order success,
                             memory_order failure) noexcept {
    return __atomic_compare_exchange(&value_, &expected, &desired, true,
                                     static_cast<int>(success), static_cast<int>(failure));
  }
  bool compare_exchange_weak(T& expected, T desired,
                             memory_order order = memory_order::seq_cst) noexcept {
    return compare_exchange_weak(expected, desired, order, failure_order(order));
  }
  bool compare_exchange_strong(T& expected, T desired, memory_order success,
                               memory_order failure) noexcept {
    return __atomic_compare_exchange(&value_, &expected, &desired, false,
                                     static_cast<int>(success), static_cast<int>(failure));
  }
  bool compare_exchange_strong(T& expected, T desired,
                               memory_order order = memory_order::seq_cst) noexcept {
    return compare_exchange_strong(expected, desired, order, failure_order(order));
  }

  // --- the operators (seq_cst, as std::atomic's) ------------------------------------------------
  T operator=(T desired) noexcept {  // NOLINT: returns the value, as std::atomic's
    store(desired);
    return desired;
  }
  operator T() const noexcept { return load(); }  // NOLINT: implicit, as std::atomic's

  // --- integers (add/sub also for pointers, in elements) ---------------------------------------
  template <class U = T>
    requires(is_integer || std::is_pointer_v<U>)
  T fetch_add(atomic_difference_t<U> delta, memory_order order = memory_order::seq_cst) noexcept {
    return __atomic_fetch_add(&value_, scaled(delta), static_cast<int>(order));
  }
  template <class U = T>
    requires(is_integer || std::is_pointer_v<U>)
  T fetch_sub(atomic_difference_t<U> delta, memory_order order = memory_order::seq_cst) noexcept {
    return __atomic_fetch_sub(&value_, scaled(delta), static_cast<int>(order));
  }
  template <class U = T>
    requires(is_integer || std::is_pointer_v<U>)
  T operator++() noexcept {
    return fetch_add(1) + 1;
  }
  template <class U = T>
    requires(is_integer || std::is_pointer_v<U>)
  T operator++(int) noexcept {
    return fetch_add(1);
  }
  template <class U = T>
    requires(is_integer || std::is_pointer_v<U>)
  T operator--() noexcept {
    return fetch_sub(1) - 1;
  }
  template <class U = T>
    requires(is_integer || std::is_pointer_v<U>)
  T operator--(int) noexcept {
    return fetch_sub(1);
  }
  template <class U = T>
    requires(is_integer || std::is_pointer_v<U>)
  T operator+=(atomic_difference_t<U> delta) noexcept {
    return fetch_add(delta) + delta;
  }
  template <class U = T>
    requires(is_integer || std::is_pointer_v<U>)
  T operator-=(atomic_difference_t<U> delta) noexcept {
    return fetch_sub(delta) - delta;
  }
  template <class U = T>
    requires is_integer
  T fetch_or(T bits, memory_order order = memory_order::seq_cst) noexcept {
    return __atomic_fetch_or(&value_, bits, static_cast<int>(order));
  }
  template <class U = T>
    requires is_integer
  T fetch_and(T bits, memory_order order = memory_order::seq_cst) noexcept {
    return __atomic_fetch_and(&value_, bits, static_cast<int>(order));
  }

 private:
  /// The builtins add bytes to a pointer; std::atomic<T*> adds elements.
  template <class D>
  static constexpr auto scaled(D delta) noexcept {
    if constexpr (std::is_pointer_v<T>) {
      return delta * static_cast<std::ptrdiff_t>(sizeof(std::remove_pointer_t<T>));
    } else {
      return delta;
    }
  }

  alignas(sizeof(T)) T value_;
};

}  // namespace cudamem::detail
