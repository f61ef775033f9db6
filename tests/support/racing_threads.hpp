// Threads that allocate and free at random from one resource at once, against a shared model of
// the blocks live: for testing that no block a resource hands out overlaps another while work of
// its own (growth ahead, recent frees) runs beside them.
//
//   const cudamem_test::race_result r = cudamem_test::race(
//       {.threads = 4, .operations = 600, .allocate_percent = 55},
//       [](std::mt19937_64& rng) { return std::size_t{4 << 20} + rng() % 4096; },  // a size
//       [&](std::size_t bytes, cudaStream_t s) { return vm.allocate(bytes, 256, s); },
//       [&](void* p, std::size_t bytes, cudaStream_t s) { vm.deallocate(p, bytes, 256, s); });
//   CHECK_FALSE(r.overlap);
//
// Thread t (1 to threads) draws from a generator seeded with t and works on a stream of its own
// (the pretend handle t * 0x1000). An allocation that throws out_of_memory is skipped; each
// thread frees what it still holds at the end. `check(address, bytes)`, when given, is asked of
// every block as it is handed out (is its memory accessible, say); a false is counted.
#pragma once

#include <cudamem/out_of_memory.hpp>

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <iterator>
#include <map>
#include <mutex>
#include <random>
#include <thread>
#include <utility>
#include <vector>

namespace cudamem_test {

struct race_plan {
  std::uint32_t threads = 4;
  int operations = 400;      ///< per thread
  int allocate_percent = 60;  ///< of the operations while a thread holds something
};

struct race_result {
  bool overlap = false;            ///< a block was handed out over one still live
  std::size_t failed_checks = 0;   ///< blocks `check` said false of
};

template <class Size, class Allocate, class Deallocate>
race_result race(const race_plan& plan, Size size, Allocate allocate, Deallocate deallocate,
                 auto check) {
  std::mutex model_mutex;
  std::map<std::uintptr_t, std::size_t> live;  // the model: address -> bytes, all threads
  race_result result;
  const auto address = [](void* p) { return reinterpret_cast<std::uintptr_t>(p); };
  const auto worker = [&](std::uint32_t seed) {
    std::mt19937_64 rng{seed};
    const auto stream = reinterpret_cast<cudaStream_t>(std::uintptr_t{0x1000} * seed);
    std::vector<std::pair<void*, std::size_t>> mine;
    const auto forget = [&](void* p) {
      const std::lock_guard lock(model_mutex);
      live.erase(address(p));
    };
    for (int op = 0; op < plan.operations; ++op) {
      if (mine.empty() || static_cast<int>(rng() % 100) < plan.allocate_percent) {
        const std::size_t bytes = size(rng);
        void* p = nullptr;
        try {
          p = allocate(bytes, stream);
        } catch (const cudamem::out_of_memory&) {
          continue;
        }
        const std::lock_guard lock(model_mutex);
        const std::uintptr_t at = address(p);
        const bool checked = check(at, bytes);
        const auto next = live.lower_bound(at);
        result.overlap = result.overlap || (next != live.end() && at + bytes > next->first) ||
                         (next != live.begin() &&
                          std::prev(next)->first + std::prev(next)->second > at);
        result.failed_checks += checked ? 0 : 1;
        live.emplace(at, bytes);
        mine.emplace_back(p, bytes);
      } else {
        const std::size_t i = rng() % mine.size();
        forget(mine[i].first);  // before the free: another thread may get it at once
        deallocate(mine[i].first, mine[i].second, stream);
        mine[i] = mine.back();
        mine.pop_back();
      }
    }
    for (const auto& [p, bytes] : mine) {
      forget(p);
      deallocate(p, bytes, stream);
    }
  };
  std::vector<std::thread> threads;
  for (std::uint32_t t = 1; t <= plan.threads; ++t) {
    threads.emplace_back(worker, t);
  }
  for (std::thread& t : threads) {
    t.join();
  }
  return result;
}

/// The same, with no check of each block.
template <class Size, class Allocate, class Deallocate>
race_result race(const race_plan& plan, Size size, Allocate allocate, Deallocate deallocate) {
  return race(plan, size, allocate, deallocate, [](std::uintptr_t, std::size_t) { return true; });
}

}  // namespace cudamem_test
