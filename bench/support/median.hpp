// bench/support/median.hpp — the one median every benchmark reports.
//
//   const double m = cudamem_bench::median(ns_per_round);  // 0 for no samples
//
// Benchmarks report medians of interleaved rounds (DESIGN.md), not means: one slow round (a
// frequency change, another tenant on the host) moves a mean and not a median. For an even
// count it is the mean of the middle two. A header of its own so that the benchmarks that do
// not build the peers (peers.hpp pulls in CUB) share it too.
#pragma once

#include <algorithm>
#include <cstddef>
#include <vector>

namespace cudamem_bench {

/// The median of `samples`; 0 when there are none.
inline double median(std::vector<double> samples) {
  if (samples.empty()) {
    return 0.0;
  }
  std::sort(samples.begin(), samples.end());
  const std::size_t n = samples.size();
  return n % 2 == 1 ? samples[n / 2] : (samples[n / 2 - 1] + samples[n / 2]) / 2;
}

}  // namespace cudamem_bench
