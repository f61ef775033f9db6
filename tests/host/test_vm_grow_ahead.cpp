// vm_resource's growth ahead of need (vm_resource_options::grow_ahead_bytes) over the simulated
// mapping layer: the headroom it keeps and where it stops (the device, physical_limit,
// release), that its memory is the same memory a growth would have made (placement, access,
// the fraction of the device a trace keeps live), failures on its thread, destruction while a
// batch is in flight, and several allocating threads beside it.
#include <cudamem/detail/vm/simulated_mapping.hpp>
#include <cudamem/vm_pool_resource.hpp>
#include <cudamem/vm_resource.hpp>

#include "../../bench/support/fragmentation.hpp"
#include "captured_errors.hpp"
#include "racing_threads.hpp"

#include <catch2/catch.hpp>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <random>
#include <vector>

using namespace cudamem;
using detail::simulated_vm_mapping;
using detail::simulated_vm_options;

namespace {

constexpr std::size_t MiB = std::size_t{1} << 20;
constexpr std::size_t GiB = std::size_t{1} << 30;

/// 32 MiB handles, growths of 64 MiB, and `ahead` bytes of headroom at most; no floor of free
/// memory (these are tests of the thread itself, on small devices; the floor has tests of its
/// own in test_vm_held_ahead.cpp).
vm_resource_options ahead_options(std::size_t ahead) {
  vm_resource_options o;
  o.handle_bytes = 32 * MiB;
  o.growth_bytes = 64 * MiB;
  o.grow_ahead_bytes = ahead;
  o.grow_ahead_floor_bytes = 0;
  return o;
}

/// A vm_resource over a simulated device, and a view of its layer.
struct sim_vm {
  explicit sim_vm(std::size_t capacity, vm_resource_options options,
                  simulated_vm_options layer_options = {},
                  detail::simulated_vm_final_state* final_state = nullptr)
      : vm(make_layer(capacity, layer_options, final_state), std::move(options)),
        layer(dynamic_cast<simulated_vm_mapping&>(vm.mapping_layer())) {}

  static std::unique_ptr<simulated_vm_mapping> make_layer(
      std::size_t capacity, simulated_vm_options o, detail::simulated_vm_final_state* final_state) {
    o.capacity = capacity;
    o.granularity = 2 * MiB;
    o.final_state = final_state;
    return std::make_unique<simulated_vm_mapping>(o);
  }

  vm_resource vm;
  simulated_vm_mapping& layer;
};

std::uintptr_t addr(void* p) { return reinterpret_cast<std::uintptr_t>(p); }

}  // namespace

TEST_CASE("grow ahead: off over the simulated layer unless asked for; 0 turns it off") {
  vm_resource_options unset;
  unset.handle_bytes = 32 * MiB;
  unset.growth_bytes = 64 * MiB;
  for (const auto& options : {unset, ahead_options(0)}) {
    sim_vm s{4 * GiB, options};
    void* p = s.vm.allocate(60 * MiB);
    s.vm.wait_for_growth();
    CHECK(s.vm.vm_stats().handles_created_ahead == 0);
    CHECK(s.vm.vm_stats().mapped_bytes == 64 * MiB);  // one growth, nothing more
    s.vm.deallocate(p, 60 * MiB);
  }
}

TEST_CASE("grow ahead: keeps a quarter of what it holds free at the frontier, up to the most") {
  sim_vm s{16 * GiB, ahead_options(512 * MiB)};
  std::vector<void*> blocks;
  blocks.push_back(s.vm.allocate(60 * MiB));  // a growth of its own; then the thread's
  s.vm.wait_for_growth();
  vm_resource_stats st = s.vm.vm_stats();
  CHECK(st.handles_created_ahead > 0);
  // Headroom: a quarter of what is held, at least a handle; 64 MiB held -> one handle.
  CHECK(st.free_bytes >= 32 * MiB);
  // Allocate 3 GiB in 96 MiB blocks: the headroom grows to its most (512 MiB) and stays.
  for (int i = 0; i < 32; ++i) {
    blocks.push_back(s.vm.allocate(96 * MiB));
    REQUIRE(s.layer.is_accessible(addr(blocks.back()), 96 * MiB));
  }
  s.vm.wait_for_growth();
  st = s.vm.vm_stats();
  CHECK(st.free_bytes >= 512 * MiB);
  // Never more than the most plus one batch (a quarter of the most, or a growth) beyond it.
  CHECK(st.free_bytes <= 512 * MiB + 128 * MiB);
  CHECK(st.handles_created_ahead * 32 * MiB >= st.mapped_bytes - st.used_bytes);
  CHECK(st.mapped_bytes == s.layer.physical_in_use());
  for (void* p : blocks) {
    s.vm.deallocate(p, p == blocks.front() ? 60 * MiB : 96 * MiB);
  }
  CHECK(s.layer.violations == 0);
}

TEST_CASE("grow ahead: a fill uses the whole device; the memory made ahead strands nothing") {
  for (const std::size_t ahead : {std::size_t{0}, 1 * GiB}) {
    CAPTURE(ahead);
    sim_vm s{4 * GiB, ahead_options(ahead)};
    std::vector<void*> blocks;
    while (true) {
      try {
        blocks.push_back(s.vm.allocate(32 * MiB));
      } catch (const out_of_memory&) {
        break;
      }
    }
    CHECK(blocks.size() == 128);  // every handle of the device, with or without the thread
    s.vm.wait_for_growth();
    CHECK(s.vm.vm_stats().mapped_bytes == 4 * GiB);
    if (ahead != 0) {
      CHECK(s.vm.vm_stats().handles_created_ahead > 64);  // most of the fill
    }
    for (void* p : blocks) {
      s.vm.deallocate(p, 32 * MiB);
    }
    CHECK(s.layer.violations == 0);
  }
}

TEST_CASE("grow ahead: physical_limit bounds it") {
  vm_resource_options o = ahead_options(1 * GiB);
  o.physical_limit = 512 * MiB;
  sim_vm s{8 * GiB, o};
  void* a = s.vm.allocate(200 * MiB);
  void* b = s.vm.allocate(200 * MiB);
  s.vm.wait_for_growth();
  CHECK(s.vm.vm_stats().mapped_bytes <= 512 * MiB);
  CHECK(s.layer.physical_in_use() <= 512 * MiB);
  CHECK_THROWS_AS(s.vm.allocate(200 * MiB), out_of_memory);
  s.vm.deallocate(a, 200 * MiB);
  s.vm.deallocate(b, 200 * MiB);
}

TEST_CASE("grow ahead: release gives back what was made ahead, and nothing is made again until "
          "an allocation asks") {
  sim_vm s{8 * GiB, ahead_options(1 * GiB)};
  std::vector<void*> blocks;
  for (int i = 0; i < 40; ++i) {
    blocks.push_back(s.vm.allocate(64 * MiB));
  }
  s.vm.wait_for_growth();
  REQUIRE(s.vm.vm_stats().free_bytes > 0);
  const std::size_t given_back = s.vm.release();
  CHECK(given_back > 0);
  s.vm.wait_for_growth();
  vm_resource_stats st = s.vm.vm_stats();
  CHECK(st.mapped_bytes == st.used_bytes);  // 64 MiB blocks: whole handles, nothing free
  CHECK(s.layer.physical_in_use() == st.used_bytes);
  blocks.push_back(s.vm.allocate(64 * MiB));  // and the next growth brings the headroom back
  s.vm.wait_for_growth();
  CHECK(s.vm.vm_stats().free_bytes > 0);
  for (void* p : blocks) {
    s.vm.deallocate(p, 64 * MiB);
  }
  CHECK(s.layer.violations == 0);
}

TEST_CASE("grow ahead: a driver failure on the thread leaks nothing; the resource grows alone") {
  detail::simulated_vm_final_state final_state;
  {
    const cudamem_test::captured_errors errors;
    sim_vm s{4 * GiB, ahead_options(1 * GiB), {}, &final_state};
    void* first = s.vm.allocate(32 * MiB);  // grows 64 MiB itself, then wakes the thread
    s.vm.wait_for_growth();
    const std::size_t before = s.vm.vm_stats().mapped_bytes;
    s.layer.fail_map_after(1);  // the thread's next batch fails at its second map
    std::vector<void*> blocks;
    for (int i = 0; i < 20; ++i) {
      blocks.push_back(s.vm.allocate(32 * MiB));
    }
    s.vm.wait_for_growth();
    // One report, from the thread; it stopped, and the resource kept growing on its own.
    REQUIRE(errors.messages().size() == 1);
    CHECK(errors.messages()[0].find("growth ahead stopped") != std::string::npos);
    CHECK(errors.messages()[0].find("injected map failure") != std::string::npos);
    const vm_resource_stats st = s.vm.vm_stats();
    CHECK(st.mapped_bytes >= before);
    CHECK(st.mapped_bytes == s.layer.physical_in_use());  // the failed batch went back
    for (void* p : blocks) {
      REQUIRE(s.layer.is_accessible(addr(p), 32 * MiB));
    }
    const std::size_t ahead_then = st.handles_created_ahead;
    for (int i = 0; i < 20; ++i) {
      blocks.push_back(s.vm.allocate(32 * MiB));
    }
    s.vm.wait_for_growth();
    CHECK(s.vm.vm_stats().handles_created_ahead == ahead_then);  // never again
    s.vm.deallocate(first, 32 * MiB);
    for (void* p : blocks) {
      s.vm.deallocate(p, 32 * MiB);
    }
    CHECK(s.layer.violations == 0);
  }
  CHECK(final_state.physical_in_use == 0);
  CHECK(final_state.mappings == 0);
  CHECK(final_state.reservations == 0);
  CHECK(final_state.violations == 0);
}

TEST_CASE("grow ahead: a device that says full to the thread is probed again by a request") {
  sim_vm s{4 * GiB, ahead_options(1 * GiB)};
  void* first = s.vm.allocate(32 * MiB);
  s.vm.wait_for_growth();
  s.layer.fail_next_creates(1);  // the thread's next create hears "full": it stops there
  std::vector<void*> blocks;
  for (int i = 0; i < 60; ++i) {  // 1.9 GiB: more than was made ahead
    blocks.push_back(s.vm.allocate(32 * MiB));
  }
  s.vm.wait_for_growth();
  for (void* p : blocks) {
    REQUIRE(s.layer.is_accessible(addr(p), 32 * MiB));
  }
  s.vm.deallocate(first, 32 * MiB);
  for (void* p : blocks) {
    s.vm.deallocate(p, 32 * MiB);
  }
  CHECK(s.layer.violations == 0);
}

TEST_CASE("grow ahead: destruction while a batch is in flight waits for it and frees all") {
  detail::simulated_vm_final_state final_state;
  {
    // Creates that take 2 ms: the thread is mid-batch when the resource goes.
    sim_vm s{8 * GiB, ahead_options(2 * GiB), {.create_us = 2000}, &final_state};
    void* p = s.vm.allocate(1 * GiB);
    s.vm.deallocate(p, 1 * GiB);
  }
  CHECK(final_state.destroyed);
  CHECK(final_state.physical_in_use == 0);
  CHECK(final_state.mappings == 0);
  CHECK(final_state.reservations == 0);
  CHECK(final_state.violations == 0);
}

TEST_CASE("grow ahead: several threads allocate and free beside it; no block overlaps another") {
  detail::simulated_vm_final_state final_state;
  {
    const std::size_t capacity = 2 * GiB;
    sim_vm s{capacity, ahead_options(512 * MiB), {.create_us = 20, .access_us = 30},
             &final_state};
    const cudamem_test::race_result r = cudamem_test::race(
        {.threads = 4, .operations = 400, .allocate_percent = 60},
        [](std::mt19937_64& rng) { return (std::size_t{1} << (12 + rng() % 16)) + rng() % 4096; },
        [&](std::size_t bytes, cudaStream_t stream) { return s.vm.allocate(bytes, 256, stream); },
        [&](void* p, std::size_t bytes, cudaStream_t stream) {
          s.vm.deallocate(p, bytes, 256, stream);
        },
        [&](std::uintptr_t at, std::size_t bytes) { return s.layer.is_accessible(at, bytes); });
    s.vm.wait_for_growth();
    CHECK_FALSE(r.overlap);
    CHECK(r.failed_checks == 0);
    CHECK(s.vm.stats().used_bytes == 0);
    CHECK(s.vm.vm_stats().mapped_bytes == s.layer.physical_in_use());
    CHECK(s.vm.vm_stats().handles_created_ahead > 0);
  }
  CHECK(final_state.physical_in_use == 0);
  CHECK(final_state.violations == 0);
}

TEST_CASE("grow ahead: a vm_pool keeps the bench's mixed trace as live, cold and warm") {
  // The same trace, to its first failure on a fresh vm_pool and again on the same one, with
  // and without the thread: memory made ahead is placed as a growth would place it.
  const std::size_t capacity = 80 * GiB;
  const cudamem_bench::mixed_spec spec = cudamem_bench::mixed_spec_gpu_for(capacity);
  double without = 0;
  for (const std::size_t ahead : {std::size_t{0}, default_grow_ahead_bytes}) {
    CAPTURE(ahead);
    vm_pool_options o;
    o.grow_ahead_bytes = ahead;
    vm_pool_resource pool{std::make_unique<simulated_vm_mapping>(simulated_vm_options{
                              .capacity = capacity, .granularity = 2 * MiB}),
                          o};
    const auto alloc = [&](std::size_t n) -> void* {
      try {
        return pool.allocate(n);
      } catch (const out_of_memory&) {
        return nullptr;
      }
    };
    const auto release = [&](void* p, std::size_t n) { pool.deallocate(p, n); };
    const auto cold = cudamem_bench::mixed(spec, alloc, release);
    const auto warm = cudamem_bench::mixed(spec, alloc, release);
    CAPTURE(cold.ratio, warm.ratio);
    CHECK(cold.ratio >= 0.97);
    CHECK(warm.ratio >= cold.ratio);
    if (ahead == 0) {
      without = cold.ratio;
    } else {
      CHECK(cold.ratio >= without - 0.002);
      CHECK(pool.vm_stats().handles_created_ahead > 0);
    }
    pool.upstream_vm().wait_for_growth();
  }
}
