// Threads that race through phases whose true peak is known: for testing the bound that
// statistics_adaptor and tracking_adaptor put on their peak when threads share them.
//
//   const std::size_t truth = cudamem_test::run_phases(adaptor);   // the true peak
//   CHECK(adaptor.stats().peak_used_bytes >= truth);
//   CHECK(adaptor.stats().peak_used_bytes <= truth + adaptor.peak_error_bound());
//
// Each phase: every thread allocates at once (racing the others), a barrier, then threads free
// at once — light blocks that *another* thread allocated a phase before — and a barrier.
// Bytes in use only rise while threads allocate and only fall while they free, so the true
// peak is the largest total at an allocation barrier, whatever the interleaving. In phase k
// one thread (k mod threads) also allocates a heavy share, which it frees in the same phase,
// so each thread's own most is reached in a different phase: the sum of the threads' most is
// about `threads` times the true peak, and only the shared mark keeps the peak near the truth.
#pragma once

#include <cudamem/memory_resource.hpp>

#include <barrier>
#include <cstddef>
#include <thread>
#include <vector>

namespace cudamem_test {

struct phase_plan {
  std::size_t threads = 4;
  std::size_t phases = 12;
  std::size_t heavy_bytes = 600 << 10;  ///< one thread's extra share in each phase (8 blocks),
                                        ///< freed by it in the same phase
  std::size_t light_bytes = 16 << 10;   ///< every thread's share per phase (4 blocks), freed a
                                        ///< phase later by the next thread
};

/// Runs `plan` through `mr` and returns the true peak. Leaves nothing allocated.
inline std::size_t run_phases(cudamem::memory_resource& mr, const phase_plan& plan = {}) {
  const std::size_t heavy_block = plan.heavy_bytes / 8;
  const std::size_t light_block = plan.light_bytes / 4;
  // blocks[phase][thread]: what that thread allocated in that phase (light, then heavy).
  std::vector<std::vector<std::vector<void*>>> light(
      plan.phases, std::vector<std::vector<void*>>(plan.threads));
  std::vector<std::vector<void*>> heavy(plan.phases);
  std::barrier sync{static_cast<std::ptrdiff_t>(plan.threads)};
  std::vector<std::thread> workers;
  for (std::size_t t = 0; t < plan.threads; ++t) {
    workers.emplace_back([&, t] {
      const std::size_t next = (t + 1) % plan.threads;
      for (std::size_t k = 0; k < plan.phases; ++k) {
        const bool is_heavy = k % plan.threads == t;
        for (int i = 0; i < 4; ++i) {
          light[k][t].push_back(mr.allocate(light_block, 16));
          if (is_heavy) {
            heavy[k].push_back(mr.allocate(heavy_block, 16));
            heavy[k].push_back(mr.allocate(heavy_block, 16));
          }
        }
        sync.arrive_and_wait();  // the most bytes in use: every thread has allocated
        if (is_heavy) {
          for (void* p : heavy[k]) {
            mr.deallocate(p, heavy_block, 16);
          }
        }
        if (k > 0) {  // the next thread's light blocks of the phase before
          for (void* p : light[k - 1][next]) {
            mr.deallocate(p, light_block, 16);
          }
        }
        sync.arrive_and_wait();
      }
      for (void* p : light[plan.phases - 1][next]) {  // the last phase's light blocks
        mr.deallocate(p, light_block, 16);
      }
    });
  }
  for (std::thread& w : workers) {
    w.join();
  }
  // At phase k's allocation barrier: this phase's and (from phase 1) the last phase's light
  // blocks, and this phase's heavy ones.
  const std::size_t lights = plan.phases > 1 ? 2 : 1;
  return lights * plan.threads * 4 * light_block + 8 * heavy_block;
}

}  // namespace cudamem_test
