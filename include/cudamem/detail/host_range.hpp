// cudamem/detail/host_range.hpp — the concept owners take a host range by: a contiguous,
// sized range of exactly T (a std::vector<T>, std::array<T, N>, std::span<T>, gsl::span<T>,
// a built-in array, ...), with std::ranges' own meaning.
//
//   template <detail::contiguous_range_of<T> Range>
//   explicit device_buffer(const Range& host, ...);   // std::ranges::data(host), size(host)
//
// Why a header of its own: the concepts live in <ranges>, whose views and adaptors cost about
// 0.3 s of every translation unit under nvcc 13 (bench/compile_time.py), and an owner needs
// only the concepts. libstdc++ keeps them apart, in the internal header its <span> includes;
// so with libstdc++ this includes <span>, and with another standard library <ranges> itself.
#pragma once

#include <cstddef>  // defines __GLIBCXX__ with libstdc++

#if defined(__GLIBCXX__)
#include <span>  // libstdc++: <bits/ranges_base.h>, std::ranges' concepts and accessors
#else
#include <ranges>
#endif

#include <concepts>

namespace cudamem::detail {

/// A contiguous, sized range whose elements are exactly T.
template <class Range, class T>
concept contiguous_range_of = std::ranges::contiguous_range<Range> &&
                              std::ranges::sized_range<Range> &&
                              std::same_as<std::ranges::range_value_t<Range>, T>;

}  // namespace cudamem::detail
