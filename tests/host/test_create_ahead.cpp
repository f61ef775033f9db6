// vm_resource's create-ahead thread (detail/vm/create_ahead.hpp) over the simulated mapping
// layer: a growth leaves handles made ahead and the next growth takes them; it stops when the
// device is full and under physical_limit; release() gives them back; nothing leaks when the
// resource is destroyed while the thread works or a growth fails half-way; and blocks go
// exactly where they go without it.
#include <cudamem/vm_pool_resource.hpp>
#include <cudamem/vm_resource.hpp>

#include <catch2/catch.hpp>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <random>
#include <stdexcept>
#include <utility>
#include <vector>

using namespace cudamem;
using detail::simulated_vm_mapping;
using detail::simulated_vm_options;

namespace {

constexpr std::size_t MiB = std::size_t{1} << 20;
constexpr std::size_t GiB = std::size_t{1} << 30;

/// 64 MiB handles, growth of 256 MiB, `ahead` bytes made ahead.
vm_resource_options ahead_of(std::size_t ahead) {
  vm_resource_options o;
  o.handle_bytes = 64 * MiB;
  o.growth_bytes = 256 * MiB;
  o.create_ahead_bytes = ahead;
  return o;
}

/// A vm_resource over a simulated device of `capacity` bytes, and a view of its layer.
struct sim_vm {
  explicit sim_vm(std::size_t capacity, vm_resource_options options,
                  detail::simulated_vm_final_state* final_state = nullptr)
      : vm(std::make_unique<simulated_vm_mapping>(
               simulated_vm_options{.capacity = capacity, .final_state = final_state}),
           std::move(options)),
        layer(dynamic_cast<simulated_vm_mapping&>(vm.mapping_layer())) {}
  vm_resource vm;
  simulated_vm_mapping& layer;
};

}  // namespace

TEST_CASE("create_ahead: a growth leaves handles made ahead, and the next growth takes them") {
  sim_vm s{4 * GiB, ahead_of(256 * MiB)};
  void* a = s.vm.allocate(64 * MiB);
  s.vm.settle_create_ahead();
  vm_resource_stats st = s.vm.vm_stats();
  CHECK(st.mapped_bytes == 256 * MiB);         // the growth: 4 handles
  CHECK(st.created_ahead_bytes == 256 * MiB);  // and 4 more, ready for the next one
  CHECK(st.handles_created == 4);
  CHECK(s.layer.calls.create == 8);
  CHECK(s.layer.physical_in_use() == 512 * MiB);
  CHECK(s.vm.stats().reserved_bytes == 512 * MiB);  // memory held ahead is shown as held

  // From now on the device refuses: the next growth can only succeed with the ready handles.
  s.layer.fail_next_creates(1000);
  void* b = s.vm.allocate(448 * MiB);  // 192 MiB free at the frontier: 4 more handles needed
  REQUIRE(b != nullptr);
  s.vm.settle_create_ahead();
  st = s.vm.vm_stats();
  CHECK(st.mapped_bytes == 512 * MiB);
  CHECK(st.created_ahead_bytes == 0);  // its one try failed: it stopped
  CHECK(s.layer.physical_in_use() == 512 * MiB);
  s.vm.deallocate(b, 448 * MiB);
  s.vm.deallocate(a, 64 * MiB);
}

TEST_CASE("create_ahead: a full device gets used exactly as without it, and nothing leaks") {
  for (const std::size_t ahead : {std::size_t{0}, 256 * MiB, 1 * GiB}) {
    detail::simulated_vm_final_state final_state;
    {
      sim_vm s{1 * GiB + 32 * MiB, ahead_of(ahead), &final_state};  // 16 handles and a part
      std::vector<void*> blocks;
      for (;;) {
        try {
          blocks.push_back(s.vm.allocate(64 * MiB));
        } catch (const out_of_memory&) {
          break;
        }
      }
      CHECK(blocks.size() == 16);
      s.vm.settle_create_ahead();
      CHECK(s.vm.vm_stats().created_ahead_bytes == 0);
      CHECK(s.layer.physical_in_use() == 1 * GiB);
      for (void* p : blocks) {
        s.vm.deallocate(p, 64 * MiB);
      }
    }
    CHECK(final_state.destroyed);
    CHECK(final_state.physical_in_use == 0);
    CHECK(final_state.mappings == 0);
    CHECK(final_state.violations == 0);
  }
}

TEST_CASE("create_ahead: physical_limit bounds what is made ahead") {
  vm_resource_options o = ahead_of(1 * GiB);
  o.physical_limit = 512 * MiB;
  sim_vm s{4 * GiB, o};
  void* a = s.vm.allocate(64 * MiB);
  s.vm.settle_create_ahead();
  CHECK(s.vm.vm_stats().mapped_bytes == 256 * MiB);
  CHECK(s.vm.vm_stats().created_ahead_bytes == 256 * MiB);  // up to the limit, not 1 GiB
  CHECK(s.layer.physical_in_use() == 512 * MiB);
  void* b = s.vm.allocate(448 * MiB);  // takes the ready handles: at the limit now
  s.vm.settle_create_ahead();
  CHECK(s.layer.physical_in_use() == 512 * MiB);
  CHECK(s.vm.vm_stats().created_ahead_bytes == 0);
  CHECK_THROWS_AS(s.vm.allocate(64 * MiB), out_of_memory);
  s.vm.deallocate(b, 448 * MiB);
  s.vm.deallocate(a, 64 * MiB);
}

TEST_CASE("create_ahead: release() gives the ready handles back until the resource grows again") {
  sim_vm s{4 * GiB, ahead_of(512 * MiB)};
  void* a = s.vm.allocate(64 * MiB);
  s.vm.settle_create_ahead();
  REQUIRE(s.vm.vm_stats().created_ahead_bytes == 512 * MiB);
  // The growth's 3 free handles and the 8 made ahead; the block's handle stays.
  CHECK(s.vm.release() == 192 * MiB + 512 * MiB);
  s.vm.settle_create_ahead();
  CHECK(s.vm.vm_stats().created_ahead_bytes == 0);  // and none made again
  CHECK(s.layer.physical_in_use() == 64 * MiB);
  void* b = s.vm.allocate(128 * MiB);  // a growth: the thread works again
  s.vm.settle_create_ahead();
  CHECK(s.vm.vm_stats().created_ahead_bytes == 512 * MiB);
  CHECK(s.layer.physical_in_use() == 64 * MiB + 256 * MiB + 512 * MiB);
  s.vm.deallocate(b, 128 * MiB);
  s.vm.deallocate(a, 64 * MiB);
}

TEST_CASE("create_ahead: less than a handle is off") {
  sim_vm s{4 * GiB, ahead_of(32 * MiB)};
  void* a = s.vm.allocate(64 * MiB);
  s.vm.settle_create_ahead();
  CHECK(s.layer.calls.create == 4);
  CHECK(s.vm.vm_stats().created_ahead_bytes == 0);
  s.vm.deallocate(a, 64 * MiB);
}

TEST_CASE("create_ahead: destroyed while the thread works, or after a growth failed half-way, "
          "nothing leaks") {
  for (int round = 0; round < 50; ++round) {
    detail::simulated_vm_final_state final_state;
    {
      sim_vm s{8 * GiB, ahead_of(1 * GiB), &final_state};
      void* a = s.vm.allocate(64 * MiB);
      s.vm.deallocate(a, 64 * MiB);
      if (round % 2 == 1) {
        // The next growth maps 2 of its handles, then the third map fails: the batch is undone
        // (handles taken from the ready ones among them go back to the device).
        s.vm.settle_create_ahead();
        s.layer.fail_map_after(2);
        CHECK_THROWS_AS(s.vm.allocate(1 * GiB), std::runtime_error);
        CHECK(s.vm.vm_stats().used_bytes == 0);
      }
    }  // destroyed, the thread perhaps inside a create
    CHECK(final_state.physical_in_use == 0);
    CHECK(final_state.mappings == 0);
    CHECK(final_state.reservations == 0);
    CHECK(final_state.violations == 0);
  }
}

TEST_CASE("create_ahead: every block goes where it goes without it (vm_pool, random trace)") {
  const auto run = [](std::size_t ahead) {
    vm_pool_options o;
    o.create_ahead_bytes = ahead;
    vm_pool_resource pool{std::make_unique<simulated_vm_mapping>(
                              simulated_vm_options{.capacity = 16 * GiB}),
                          o};
    std::mt19937_64 rng(7);
    std::vector<std::pair<void*, std::size_t>> live;
    std::vector<std::uintptr_t> addresses;
    for (int step = 0; step < 4000; ++step) {
      if (!live.empty() && rng() % 3 == 0) {
        const std::size_t i = rng() % live.size();
        pool.deallocate(live[i].first, live[i].second);
        live[i] = live.back();
        live.pop_back();
        continue;
      }
      const std::size_t bytes = (rng() % 2 == 0) ? (1 + rng() % (4 * MiB)) : (1 + rng() % GiB);
      try {
        void* p = pool.allocate(bytes);
        live.emplace_back(p, bytes);
        addresses.push_back(reinterpret_cast<std::uintptr_t>(p));
      } catch (const out_of_memory&) {
        addresses.push_back(0);
      }
    }
    for (const auto& [p, bytes] : live) {
      pool.deallocate(p, bytes);
    }
    return addresses;
  };
  const std::vector<std::uintptr_t> without = run(0);
  const std::vector<std::uintptr_t> with = run(512 * MiB);
  CHECK(std::count(without.begin(), without.end(), std::uintptr_t{0}) > 0);  // it ran full
  CHECK(with == without);
}
