// cudamem/detail/unique_owner.hpp — the one owner of a heap object (std::unique_ptr's core:
// move-only, deletes in its destructor), without including <memory>.
//
//   cudamem::detail::unique_owner<shard> s{new shard(...)};   // or make_unique_owner<shard>(...)
//   s->take(...);
//   shard* raw = s.release();                                 // the caller owns it now
//
// Why not std::unique_ptr: in C++20 <memory> brings atomic shared pointers, and with them
// <bits/atomic_wait.h>, <bits/chrono.h> and <ostream>; under nvcc 13 with g++ 12 that adds about
// 0.6 s to every translation unit (bench/compile_time.py). cudamem's resources need only a
// single owner of a heap object, with `delete` as the deleter.
//
// Contract: as std::unique_ptr<T> (and <T[]>) with the default deleter, for what is here. A unique_owner
// of a derived type converts to one of its base (the base must have a virtual destructor, as
// with unique_ptr).
#pragma once

#include <cstddef>
#include <type_traits>
#include <utility>

namespace cudamem::detail {

template <class T>
class unique_owner {
 public:
  constexpr unique_owner() noexcept = default;
  constexpr unique_owner(std::nullptr_t) noexcept {}  // NOLINT: as unique_ptr
  explicit unique_owner(T* p) noexcept : p_(p) {}
  unique_owner(unique_owner&& other) noexcept : p_(other.release()) {}
  template <class U>
    requires std::is_convertible_v<U*, T*>
  unique_owner(unique_owner<U>&& other) noexcept : p_(other.release()) {}  // NOLINT: as unique_ptr
  unique_owner& operator=(unique_owner&& other) noexcept {
    reset(other.release());
    return *this;
  }
  unique_owner(const unique_owner&) = delete;
  unique_owner& operator=(const unique_owner&) = delete;
  ~unique_owner() { delete p_; }

  [[nodiscard]] T* get() const noexcept { return p_; }
  T* operator->() const noexcept { return p_; }
  T& operator*() const noexcept { return *p_; }
  explicit operator bool() const noexcept { return p_ != nullptr; }
  friend bool operator==(const unique_owner& a, std::nullptr_t) noexcept { return a.p_ == nullptr; }

  /// Gives up ownership and returns the object (the caller deletes it).
  [[nodiscard]] T* release() noexcept { return std::exchange(p_, nullptr); }
  /// Deletes what it owned and owns `p` instead.
  void reset(T* p = nullptr) noexcept { delete std::exchange(p_, p); }

 private:
  T* p_ = nullptr;
};

/// The owner of a heap array (std::unique_ptr<T[]>): `new T[n]()`, `delete[]`.
template <class T>
class unique_owner<T[]> {
 public:
  constexpr unique_owner() noexcept = default;
  explicit unique_owner(T* p) noexcept : p_(p) {}
  unique_owner(unique_owner&& other) noexcept : p_(std::exchange(other.p_, nullptr)) {}
  unique_owner& operator=(unique_owner&& other) noexcept {
    delete[] std::exchange(p_, std::exchange(other.p_, nullptr));
    return *this;
  }
  unique_owner(const unique_owner&) = delete;
  unique_owner& operator=(const unique_owner&) = delete;
  ~unique_owner() { delete[] p_; }

  [[nodiscard]] T* get() const noexcept { return p_; }
  T& operator[](std::size_t i) const noexcept { return p_[i]; }
  explicit operator bool() const noexcept { return p_ != nullptr; }

 private:
  T* p_ = nullptr;
};

/// `new T(args...)`, owned (std::make_unique).
template <class T, class... Args>
  requires(!std::is_array_v<T>)
[[nodiscard]] unique_owner<T> make_unique_owner(Args&&... args) {
  return unique_owner<T>(new T(std::forward<Args>(args)...));
}

/// `new T[n]()` (value-initialised), owned (std::make_unique<T[]>).
template <class T>
  requires std::is_unbounded_array_v<T>
[[nodiscard]] unique_owner<T> make_unique_owner(std::size_t n) {
  return unique_owner<T>(new std::remove_extent_t<T>[n]());
}

}  // namespace cudamem::detail
