// Memory a vm_pool holds ahead of need gives way to the rest of the process, on a real device
// (detail/held_ahead.hpp): growth ahead stops at its floor of free memory; a cudaMallocAsync
// pool (async_resource) and cudaMalloc (device_resource) filling the device beside a vm_pool
// that grew ahead get that memory, and fail only when the device is truly full; a vm_pool
// with keep_free_bytes recycles rather than grow into its reserve, which cudaMalloc then gets.
#include <cudamem/async_resource.hpp>
#include <cudamem/device_resource.hpp>
#include <cudamem/stream.hpp>
#include <cudamem/vm_pool_resource.hpp>

#include "gpu_test.hpp"

#include <cstdio>
#include <vector>

using namespace cudamem;

namespace {

constexpr std::size_t MiB = std::size_t{1} << 20;
constexpr std::size_t GiB = std::size_t{1} << 30;

/// What a fill of the device through `mr` got: blocks of `bytes` until out_of_memory.
struct fill_result {
  std::vector<void*> blocks;
  std::size_t bytes = 0;
  std::size_t held_ahead_at_failure = 0;  ///< the failure's report: memory_report::held_ahead
};

fill_result fill(memory_resource& mr, std::size_t bytes, stream_view s) {
  fill_result r;
  r.bytes = bytes;
  while (true) {
    try {
      r.blocks.push_back(mr.allocate(bytes, 256, s));
    } catch (const out_of_memory& e) {
      r.held_ahead_at_failure = e.report().held_ahead.value_or(0);
      return r;
    }
  }
}

void free_all(memory_resource& mr, fill_result& r, stream_view s) {
  for (void* p : r.blocks) {
    mr.deallocate(p, r.bytes, 256, s);
  }
  r.blocks.clear();
}

}  // namespace

TEST_CASE("vm_pool (GPU): growth ahead never takes the device below its floor; a request may",
          "[free-memory]") {
  const std::size_t free_before = cudamem_test::free_device_memory();
  REQUIRE(free_before > 8 * GiB);
  // 4 GiB of blocks want a quarter of that (1 GiB) made ahead; the floor leaves room for
  // 512 MiB of it.
  vm_pool_options o;
  o.grow_ahead_floor_bytes = free_before - 4 * GiB - 512 * MiB;
  vm_pool_resource pool{0, o};
  if (pool.uses_plain_memory()) {
    WARN("under compute-sanitizer vm_pool takes cudaMalloc memory: nothing is made ahead");
    return;
  }
  std::vector<void*> blocks;
  for (int i = 0; i < 64; ++i) {
    blocks.push_back(pool.allocate(64 * MiB, 256, stream_view{}));
  }
  pool.upstream_vm().wait_for_growth();
  const vm_pool_stats st = pool.vm_stats();
  const std::size_t free_now = cudamem_test::free_device_memory();
  CAPTURE(free_before, free_now, *o.grow_ahead_floor_bytes, st.mapped_bytes,
          st.handles_created_ahead, st.held_ahead_bytes);
  std::printf("floor: %zu MiB free before, floor %zu MiB, %zu MiB free after; %zu MiB held "
              "ahead, %zu handles made ahead\n",
              free_before / MiB, *o.grow_ahead_floor_bytes / MiB, free_now / MiB,
              st.held_ahead_bytes / MiB, st.handles_created_ahead);
  CHECK(free_now + 64 * MiB >= *o.grow_ahead_floor_bytes);  // page tables: a little, not a handle
  CHECK(st.held_ahead_bytes <= 512 * MiB);
  CHECK(st.growth_ahead_held_back);
  // The resource's own growth for a request is not bounded by the floor.
  void* big = pool.allocate(2 * GiB, 256, stream_view{});
  CHECK(cudamem_test::free_device_memory() < *o.grow_ahead_floor_bytes);
  pool.deallocate(big, 2 * GiB, 256, stream_view{});
  for (void* p : blocks) {
    pool.deallocate(p, 64 * MiB, 256, stream_view{});
  }
}

TEST_CASE("vm_pool (GPU): keep_free_bytes leaves its reserve to cudaMalloc while recycling "
          "serves", "[free-memory]") {
  const std::size_t free_before = cudamem_test::free_device_memory();
  REQUIRE(free_before > 8 * GiB);
  vm_pool_options o;
  o.keep_free_bytes = free_before - 4 * GiB;  // room for 4 GiB above the reserve
  o.grow_ahead_bytes = 0;
  vm_pool_resource pool{0, o};
  if (pool.uses_plain_memory()) {
    WARN("under compute-sanitizer vm_pool takes cudaMalloc memory: no virtual memory to keep");
    return;
  }
  stream s;
  std::vector<void*> blocks;
  for (int i = 0; i < 16; ++i) {  // 4 GiB of blocks of the upstream's (a handle or more)
    blocks.push_back(pool.allocate(256 * MiB, 256, s));
  }
  for (std::size_t i = 0; i < blocks.size(); i += 2) {
    pool.deallocate(blocks[i], 256 * MiB, 256, s);  // eight 256 MiB holes
  }
  const std::size_t mapped = pool.vm_stats().mapped_bytes;
  std::vector<void*> large;
  for (int i = 0; i < 4; ++i) {  // no hole holds one: each recycles two, nothing grows
    large.push_back(pool.allocate(512 * MiB, 256, s));
    CHECK(cudaMemsetAsync(large.back(), 0x5a, 512 * MiB, s.get()) == cudaSuccess);
  }
  unsigned char last = 0;
  REQUIRE(cudaMemcpyAsync(&last, static_cast<unsigned char*>(large.back()) + 512 * MiB - 1, 1,
                          cudaMemcpyDeviceToHost, s.get()) == cudaSuccess);
  s.synchronize();
  const vm_pool_stats st = pool.vm_stats();
  const std::size_t free_now = cudamem_test::free_device_memory();
  CAPTURE(free_before, o.keep_free_bytes, free_now, mapped, st.mapped_bytes, st.compactions);
  std::printf("keep_free: %zu MiB free before, %zu MiB kept, %zu MiB free after; %zu MiB "
              "mapped; %zu compactions, %zu for the reserve\n",
              free_before / MiB, o.keep_free_bytes / MiB, free_now / MiB, st.mapped_bytes / MiB,
              st.compactions, st.kept_free_compactions);
  CHECK(last == 0x5a);
  CHECK(st.mapped_bytes == mapped);
  CHECK(st.kept_free_compactions == 4);
  CHECK(free_now + 128 * MiB >= o.keep_free_bytes);  // page tables: a little, not a handle
  // The reserve is there for an allocation outside the pool.
  void* foreign = nullptr;
  CHECK(cudaMalloc(&foreign, o.keep_free_bytes - 512 * MiB) == cudaSuccess);
  CHECK(cudaFree(foreign) == cudaSuccess);
  for (void* p : large) {
    pool.deallocate(p, 512 * MiB, 256, s);
  }
  for (std::size_t i = 1; i < blocks.size(); i += 2) {
    pool.deallocate(blocks[i], 256 * MiB, 256, s);
  }
}

// Fills the device until cudaMallocFromPoolAsync and cudaMalloc fail, on purpose.
TEST_CASE("vm_pool (GPU): memory grown ahead gives way to cudaMallocAsync and cudaMalloc filling "
          "the device", "[expected-api-error]") {
  vm_pool_resource pool{0};  // the defaults: grows ahead, up to 4 GiB
  if (pool.uses_plain_memory()) {
    WARN("under compute-sanitizer vm_pool takes cudaMalloc memory: nothing is made ahead");
    return;
  }
  stream s;
  std::vector<void*> blocks;
  for (int i = 0; i < 128; ++i) {  // 8 GiB in blocks of a handle: the upstream's
    blocks.push_back(pool.allocate(64 * MiB, 256, s));
  }
  const auto grown_ahead = [&] {
    pool.upstream_vm().wait_for_growth();
    return pool.vm_stats().held_ahead_bytes;
  };

  SECTION("cudaMallocAsync (async_resource, a pool of its own)") {
    const std::size_t held = grown_ahead();
    REQUIRE(held >= 1 * GiB);  // a quarter of 8 GiB is the aim
    const std::size_t free_at_start = cudamem_test::free_device_memory();
    async_resource async;
    fill_result r = fill(async, 256 * MiB, s);
    s.synchronize();
    const std::size_t free_at_end = device_memory(0).free;
    const std::size_t got = r.blocks.size() * 256 * MiB;
    const vm_pool_stats st = pool.vm_stats();
    CAPTURE(held, free_at_start, got, free_at_end, st.given_back_ahead_bytes);
    std::printf("cudaMallocAsync: %zu MiB held ahead, %zu MiB free at the start; the fill got "
                "%zu MiB, left %zu MiB free; %zu MiB given back\n",
                held / MiB, free_at_start / MiB, got / MiB, free_at_end / MiB,
                st.given_back_ahead_bytes / MiB);
    CHECK(got + 512 * MiB >= free_at_start + held);  // what was free, and what was held ahead
    CHECK(free_at_end < 512 * MiB);                   // the true limit
    CHECK(st.held_ahead_bytes == 0);
    CHECK(st.given_back_ahead_bytes >= held);
    CHECK(r.held_ahead_at_failure == 0);
    free_all(async, r, s);
    s.synchronize();
    async.trim(0);
  }
  SECTION("cudaMalloc (device_resource)") {
    const std::size_t held = grown_ahead();
    REQUIRE(held >= 1 * GiB);
    const std::size_t free_at_start = cudamem_test::free_device_memory();
    device_resource device;
    fill_result r = fill(device, 256 * MiB, stream_view{});
    const std::size_t free_at_end = device_memory(0).free;
    const std::size_t got = r.blocks.size() * 256 * MiB;
    const vm_pool_stats st = pool.vm_stats();
    CAPTURE(held, free_at_start, got, free_at_end, st.given_back_ahead_bytes);
    std::printf("cudaMalloc: %zu MiB held ahead, %zu MiB free at the start; the fill got %zu "
                "MiB, left %zu MiB free; %zu MiB given back\n",
                held / MiB, free_at_start / MiB, got / MiB, free_at_end / MiB,
                st.given_back_ahead_bytes / MiB);
    CHECK(got + 512 * MiB >= free_at_start + held);
    CHECK(free_at_end < 512 * MiB);
    CHECK(st.held_ahead_bytes == 0);
    CHECK(st.given_back_ahead_bytes >= held);
    free_all(device, r, stream_view{});
  }
  // The vm_pool's blocks are whole and usable, and it grows ahead again once it grows.
  blocks.push_back(pool.allocate(64 * MiB, 256, s));
  CHECK(grown_ahead() > 0);
  for (void* p : blocks) {
    check(cudaMemsetAsync(p, 3, 64 * MiB, s.get()));
    pool.deallocate(p, 64 * MiB, 256, s);
  }
  s.synchronize();
}
