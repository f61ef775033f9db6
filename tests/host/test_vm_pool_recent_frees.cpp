// Recent frees (vm_resource_options::recent_frees) beside the rest, over simulated mapping
// layers (no GPU): a vm_pool's large blocks (marked) and bulk blocks kept aside and taken
// again, the ledger and the statistics, a bad free of a kept block, release(); the growth
// thread's view of the frontier; memory held ahead given to another resource short of the
// device (a kept block at the frontier is part of it); several threads beside the growth
// thread, and destruction.
#include <cudamem/detail/vm/simulated_mapping.hpp>
#include <cudamem/memory_report.hpp>
#include <cudamem/simulated_resource.hpp>
#include <cudamem/vm_pool_resource.hpp>
#include <cudamem/vm_resource.hpp>

#include "captured_errors.hpp"
#include "racing_threads.hpp"

#include <catch2/catch.hpp>

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

cudaStream_t fake_stream(std::uintptr_t n) { return reinterpret_cast<cudaStream_t>(n * 0x1000); }

/// The C API's shape (4 MiB handles, bulk blocks in 32 MiB ones), growths of 1 GiB (so that
/// each resource may keep 64 MiB aside from its first allocation on), no growth ahead.
vm_pool_options options(std::size_t bulk = 32 * MiB) {
  vm_pool_options o;
  o.handle_bytes = 4 * MiB;
  o.bulk_handle_bytes = bulk;
  o.growth_bytes = GiB;
  o.grow_ahead_bytes = 0;
  return o;
}

/// A vm_pool whose vm_resources draw on one pretend device of `capacity` bytes.
struct shared_device_pool {
  explicit shared_device_pool(std::size_t capacity, vm_pool_options o = options(),
                              detail::simulated_vm_final_state* final_state = nullptr)
      : device({.capacity = capacity, .layout = simulated_layout::paged}),
        pool(layer(final_state), layer(nullptr), std::move(o)) {}
  std::unique_ptr<simulated_vm_mapping> layer(detail::simulated_vm_final_state* final_state) {
    return std::make_unique<simulated_vm_mapping>(
        simulated_vm_options{.granularity = 2 * MiB, .final_state = final_state,
                             .physical = &device, .first_address = ++layers << 40});
  }
  simulated_resource device;
  std::uintptr_t layers = 0;
  vm_pool_resource pool;
};

}  // namespace

TEST_CASE("vm_pool recent frees: a large block freed on a stream is its next one there") {
  shared_device_pool s{4 * GiB};
  const cudaStream_t a = fake_stream(1);
  void* p = s.pool.allocate(24 * MiB, 256, a);  // six 4 MiB handles, marked as the pool's
  void* other = s.pool.allocate(24 * MiB, 256, a);
  s.pool.deallocate(p, 24 * MiB, 256, a);
  void* again = s.pool.allocate(22 * MiB, 256, a);  // the same six handles
  CHECK(again == p);
  const vm_pool_stats st = s.pool.vm_stats();
  CHECK(st.recent_reuses == 1);
  CHECK(st.large_used_bytes == 46 * MiB);  // the ledger counts what is asked for
  CHECK(st.used_bytes == 48 * MiB);
  CHECK(s.pool.stats().used_bytes == 46 * MiB);
  s.pool.deallocate(again, 22 * MiB, 256, a);
  CHECK(s.pool.stats().used_bytes == 24 * MiB);  // kept aside: free to the statistics
  CHECK(s.pool.vm_stats().large_used_bytes == 24 * MiB);
  s.pool.deallocate(other, 24 * MiB, 256, a);
  CHECK(s.pool.stats().used_bytes == 0);
}

TEST_CASE("vm_pool recent frees: bulk blocks are kept by the bulk resource") {
  shared_device_pool s{4 * GiB};
  const cudaStream_t a = fake_stream(1);
  void* p = s.pool.allocate(64 * MiB, 256, a);  // two 32 MiB handles
  s.pool.deallocate(p, 64 * MiB, 256, a);
  void* again = s.pool.allocate(64 * MiB, 256, a);
  CHECK(again == p);
  const vm_pool_stats st = s.pool.vm_stats();
  REQUIRE(st.bulk);
  CHECK(st.bulk->recent_reuses == 1);
  CHECK(st.recent_reuses == 0);
  CHECK(st.large_used_bytes == 64 * MiB);
  s.pool.deallocate(again, 64 * MiB, 256, a);
}

TEST_CASE("vm_pool recent frees: a kept large block freed again is a bad free, reported once") {
  cudamem_test::captured_errors errors;
  shared_device_pool s{4 * GiB};
  const cudaStream_t a = fake_stream(1);
  void* p = s.pool.allocate(24 * MiB, 256, a);
  void* q = s.pool.allocate(64 * MiB, 256, a);
  s.pool.deallocate(p, 24 * MiB, 256, a);
  s.pool.deallocate(q, 64 * MiB, 256, a);
  s.pool.deallocate(p, 24 * MiB, 256, a);  // neither vm_resource has it live
  s.pool.deallocate(q, 64 * MiB, 256, a);
  REQUIRE(errors.messages().size() == 2);
  CHECK_THAT(errors.messages()[0], Catch::Contains("did not allocate, or already freed"));
  CHECK(s.pool.stats().used_bytes == 0);  // the ledger's count, freed once
  void* again = s.pool.allocate(24 * MiB, 256, a);  // still one block, served once
  CHECK(again == p);
  void* next = s.pool.allocate(24 * MiB, 256, a);
  CHECK(next != p);
  CHECK(s.pool.vm_stats().recent_reuses == 1);
  s.pool.deallocate(again, 24 * MiB, 256, a);
  s.pool.deallocate(next, 24 * MiB, 256, a);
  CHECK(errors.messages().size() == 2);
}

TEST_CASE("vm_pool recent frees: release() gives kept blocks' handles back to the device") {
  shared_device_pool s{4 * GiB};
  const cudaStream_t a = fake_stream(1);
  void* large = s.pool.allocate(24 * MiB, 256, a);
  void* bulk = s.pool.allocate(64 * MiB, 256, a);
  s.pool.deallocate(large, 24 * MiB, 256, a);
  s.pool.deallocate(bulk, 64 * MiB, 256, a);
  CHECK(s.device.used_bytes() == 2 * GiB);  // each resource's growth
  CHECK(s.pool.release() == 2 * GiB);
  CHECK(s.device.used_bytes() == 0);
}

TEST_CASE("vm_pool recent frees: a kept block at the frontier is held ahead, and given to a "
          "resource short of the device") {
  shared_device_pool s{4 * GiB, options(0)};
  const cudaStream_t a = fake_stream(1);
  void* body = s.pool.allocate(GiB - 64 * MiB, 256, a);  // one growth of 1 GiB: all of it
  void* last = s.pool.allocate(64 * MiB, 256, a);        // ends where the mapping ends
  s.pool.deallocate(last, 64 * MiB, 256, a);               // kept aside (at most 64 MiB)
  SECTION("a report on the device counts it as held ahead") {
    CHECK(make_memory_report(s.device, 1).held_ahead == 64 * MiB);
  }
  SECTION("given back for a request the device cannot serve otherwise") {
    // 3 GiB free; 3 GiB and 64 MiB fit once the vm_pool gives its free tail back.
    void* other = s.device.allocate(3 * GiB + 64 * MiB);
    const vm_pool_stats st = s.pool.vm_stats();
    CHECK(st.given_back_ahead_bytes == 64 * MiB);
    CHECK(st.mapped_bytes == GiB - 64 * MiB);
    CHECK(st.recent_reuses == 0);
    s.device.deallocate(other, 3 * GiB + 64 * MiB);
  }
  s.pool.deallocate(body, GiB - 64 * MiB, 256, a);
}

TEST_CASE("recent frees: the growth thread sees a kept block at the frontier as free there") {
  // 4 MiB handles, growths of 64 MiB, growth ahead with no floor; address space reserved as
  // the first growth needs it (reserve_bytes tiny), so that growth ahead soon has no room to
  // map at the frontier: then every allocation from the free ranges wakes the thread (too
  // little lies free at the frontier) and its step makes nothing.
  vm_resource_options o;
  o.handle_bytes = 4 * MiB;
  o.growth_bytes = 64 * MiB;
  o.grow_ahead_bytes = GiB;
  o.grow_ahead_floor_bytes = 0;
  o.reserve_bytes = 2 * MiB;
  vm_resource vm{std::make_unique<simulated_vm_mapping>(
                     simulated_vm_options{.capacity = 4 * GiB, .granularity = 2 * MiB}),
                 o};
  const cudaStream_t a = fake_stream(1);
  void* hole = vm.allocate(2 * MiB, 256, a);  // not whole handles: never kept aside
  void* beside = vm.allocate(2 * MiB, 256, a);
  std::vector<void*> blocks;
  for (int i = 0; i < 64 && (blocks.empty() || vm.vm_stats().free_bytes != 0); ++i) {
    blocks.push_back(vm.allocate(4 * MiB, 256, a));
    vm.wait_for_growth();
  }
  REQUIRE(vm.vm_stats().free_bytes == 0);  // all mapped is in use; nothing more made ahead
  const std::size_t made_ahead = vm.vm_stats().handles_created_ahead;
  vm.deallocate(blocks.back(), 4 * MiB, 256, a);  // the last handle mapped: kept aside
  vm.deallocate(hole, 2 * MiB, 256, a);
  hole = vm.allocate(2 * MiB, 256, a);  // from the free ranges: wakes the thread
  vm.wait_for_growth();                 // its step put the kept block back first
  void* last = vm.allocate(4 * MiB, 256, a);
  CHECK(last == blocks.back());
  const vm_resource_stats st = vm.vm_stats();
  CHECK(st.recent_reuses == 0);  // it came from the free ranges
  CHECK(st.handles_created_ahead == made_ahead);
  blocks.back() = last;
  for (void* p : blocks) {
    vm.deallocate(p, 4 * MiB, 256, a);
  }
  vm.deallocate(hole, 2 * MiB, 256, a);
  vm.deallocate(beside, 2 * MiB, 256, a);
}

TEST_CASE("vm_pool recent frees: threads on their own streams beside the growth thread") {
  detail::simulated_vm_final_state final_state;
  cudamem_test::captured_errors errors;
  {
    vm_pool_options o = options();
    o.growth_bytes = 64 * MiB;
    o.grow_ahead_bytes = 512 * MiB;
    o.grow_ahead_floor_bytes = 0;
    shared_device_pool s{8 * GiB, o, &final_state};
    // A few sizes, as a training step's tensors: most frees find their next request.
    const cudamem_test::race_result r = cudamem_test::race(
        {.threads = 4, .operations = 600, .allocate_percent = 55},
        [](std::mt19937_64& rng) { return std::size_t{4 + 4 * (rng() % 6)} * MiB + rng() % 4096; },
        [&](std::size_t bytes, cudaStream_t stream) { return s.pool.allocate(bytes, 256, stream); },
        [&](void* p, std::size_t bytes, cudaStream_t stream) {
          s.pool.deallocate(p, bytes, 256, stream);
        });
    s.pool.upstream_vm().wait_for_growth();
    CHECK_FALSE(r.overlap);
    const vm_pool_stats st = s.pool.vm_stats();
    CHECK(st.recent_reuses > 0);
    CHECK(st.handles_created_ahead > 0);
    CHECK(st.large_used_bytes == 0);
    CHECK(st.used_bytes == 0);
    CHECK(st.free_bytes == st.mapped_bytes);
  }  // destroyed with blocks kept aside, freed on four streams
  REQUIRE(final_state.destroyed);
  CHECK(final_state.physical_in_use == 0);
  CHECK(final_state.mappings == 0);
  CHECK(final_state.violations == 0);
  CHECK(errors.messages().empty());
}
