// vm_pool_resource's bulk blocks (vm_pool_options::bulk_handle_bytes) over two simulated
// mapping layers that share one pretend device (no GPU): which resource serves which block,
// the GPU trace's 128 MiB requests in freed 64 MiB holes, free memory moving between the two
// resources when the device is full, the bulk resource held above keep_free, failures that
// leak nothing, bad input, and when there is no bulk resource at all.
#include <cudamem/detail/vm/simulated_mapping.hpp>
#include <cudamem/memory_report.hpp>
#include <cudamem/simulated_resource.hpp>
#include <cudamem/statistics_adaptor.hpp>
#include <cudamem/vm_pool_resource.hpp>
#include <cudamem/vm_resource.hpp>

#include "captured_errors.hpp"

#include <catch2/catch.hpp>

#include <cstdint>
#include <memory>
#include <stdexcept>
#include <vector>

using namespace cudamem;
using detail::simulated_vm_mapping;
using detail::simulated_vm_options;

namespace {

constexpr std::size_t MiB = std::size_t{1} << 20;
constexpr std::size_t GiB = std::size_t{1} << 30;

std::uintptr_t addr(void* p) { return reinterpret_cast<std::uintptr_t>(p); }

/// The C API's shape: 4 MiB handles, bulk blocks in 32 MiB ones; no growth ahead (its thread's
/// timing is not what these tests are about).
vm_pool_options bulk_options(std::size_t bulk = 32 * MiB) {
  vm_pool_options o;
  o.handle_bytes = 4 * MiB;
  o.bulk_handle_bytes = bulk;
  o.grow_ahead_bytes = 0;
  return o;
}

/// The same, keeping 256 MiB of the pretend device free (the C API keeps 1 GiB).
vm_pool_options reserve_options() {
  vm_pool_options o = bulk_options();
  o.keep_free_bytes = 256 * MiB;
  return o;
}

/// A mapping layer whose handles are `device`'s memory; each of one test gets its own address
/// space (`nth` TiB up), as a process's layers have.
std::unique_ptr<simulated_vm_mapping> layer_over(simulated_resource& device, std::uintptr_t nth) {
  return std::make_unique<simulated_vm_mapping>(simulated_vm_options{
      .granularity = 2 * MiB, .physical = &device, .first_address = nth << 40});
}

/// A vm_pool whose two vm_resources draw on one pretend device of `capacity` bytes.
struct shared_device_pool {
  explicit shared_device_pool(std::size_t capacity, vm_pool_options options = bulk_options())
      : device({.capacity = capacity, .layout = simulated_layout::paged}),
        pool(layer(), layer(), std::move(options)),
        layer_of_upstream(dynamic_cast<simulated_vm_mapping&>(pool.mapping_layer())) {}
  std::unique_ptr<simulated_vm_mapping> layer() { return layer_over(device, ++layers); }
  simulated_vm_mapping& layer_of_bulk() {
    REQUIRE(pool.bulk_vm() != nullptr);
    return dynamic_cast<simulated_vm_mapping&>(pool.bulk_vm()->mapping_layer());
  }
  /// Allocates `bytes` until the device says no; returns the blocks.
  std::vector<void*> fill(std::size_t bytes) {
    std::vector<void*> blocks;
    for (;;) {
      try {
        blocks.push_back(pool.allocate(bytes));
      } catch (const out_of_memory&) {
        return blocks;
      }
    }
  }
  /// Frees blocks 0, 2, 4, ... (nulled): the holes of the cold-hole trace.
  void free_every_other(std::vector<void*>& blocks, std::size_t bytes) {
    for (std::size_t i = 0; i < blocks.size(); i += 2) {
      pool.deallocate(blocks[i], bytes);
      blocks[i] = nullptr;
    }
  }
  /// Frees what free_every_other left.
  void free_survivors(std::vector<void*>& blocks, std::size_t bytes) {
    for (void* p : blocks) {
      if (p != nullptr) {
        pool.deallocate(p, bytes);
      }
    }
    blocks.clear();
  }
  void free_all(std::vector<void*>& blocks, std::size_t bytes) {
    for (void* p : blocks) {
      pool.deallocate(p, bytes);
    }
    blocks.clear();
  }
  simulated_resource device;
  std::uintptr_t layers = 0;
  vm_pool_resource pool;
  simulated_vm_mapping& layer_of_upstream;
};

}  // namespace

TEST_CASE("vm_pool bulk: whole multiples of the bulk handle are the bulk resource's") {
  shared_device_pool s{GiB};
  void* bulk = s.pool.allocate(64 * MiB);   // two 32 MiB handles
  void* other = s.pool.allocate(36 * MiB);  // nine 4 MiB handles
  void* small = s.pool.allocate(MiB);       // the pool's
  vm_pool_stats st = s.pool.vm_stats();
  REQUIRE(st.bulk.has_value());
  CHECK(st.bulk->used_bytes == 64 * MiB);
  CHECK(st.bulk->mapped_bytes == st.bulk->handles * 32 * MiB);  // (grown in growth_bytes)
  CHECK(st.bulk->handle_bytes == 32 * MiB);
  CHECK(st.handle_bytes == 4 * MiB);
  CHECK(st.used_bytes == 36 * MiB + 64 * MiB);  // the large block and the pool's one chunk
  CHECK(st.large_used_bytes == 100 * MiB);
  CHECK(s.pool.stats().used_bytes == 100 * MiB + MiB);
  CHECK(s.layer_of_bulk().is_accessible(addr(bulk), 64 * MiB));
  CHECK(&s.pool.upstream_vm_of(bulk) == s.pool.bulk_vm());
  CHECK(&s.pool.upstream_vm_of(static_cast<char*>(bulk) + 40 * MiB) == s.pool.bulk_vm());
  CHECK(&s.pool.upstream_vm_of(other) == &s.pool.upstream_vm());
  CHECK(&s.pool.upstream_vm_of(small) == &s.pool.upstream_vm());
  // held_ranges() holds both resources' mappings.
  std::size_t held = 0;
  for (const auto& [start, bytes] : s.pool.held_ranges()) {
    held += bytes;
  }
  CHECK(held == st.mapped_bytes + st.bulk->mapped_bytes);
  s.pool.deallocate(bulk, 64 * MiB);
  s.pool.deallocate(other, 36 * MiB);
  s.pool.deallocate(small, MiB);
  st = s.pool.vm_stats();
  CHECK(st.bulk->used_bytes == 0);
  CHECK(st.large_used_bytes == 0);
  CHECK(s.pool.stats().used_bytes == 0);
  CHECK(s.pool.release() == st.mapped_bytes + st.bulk->mapped_bytes);  // both give back
  CHECK(s.device.stats().used_bytes == 0);
  CHECK(s.layer_of_upstream.violations == 0);
  CHECK(s.layer_of_bulk().violations == 0);
}

TEST_CASE("vm_pool bulk: 128 MiB in freed 64 MiB holes moves four bulk handles") {
  // bench/python/cold_holes.py's trace: fill the device with 64 MiB blocks, free every other
  // one, then ask for 128 MiB blocks. Every byte freed serves them, four handle moves each.
  shared_device_pool s{GiB};
  std::vector<void*> blocks = s.fill(64 * MiB);
  REQUIRE(blocks.size() == 16);
  s.free_every_other(blocks, 64 * MiB);
  const std::size_t maps_before = s.layer_of_bulk().calls.map;
  std::vector<void*> large = s.fill(128 * MiB);
  CHECK(large.size() == 4);  // all 512 MiB the frees left
  CHECK(s.layer_of_bulk().calls.map - maps_before == 16);
  CHECK(s.pool.vm_stats().bulk->handles_created == 32);  // nothing made after the fill
  for (void* p : large) {
    CHECK(s.layer_of_bulk().is_accessible(addr(p), 128 * MiB));
  }
  s.free_all(large, 128 * MiB);
  s.free_survivors(blocks, 64 * MiB);
  CHECK(s.pool.stats().used_bytes == 0);
  CHECK(s.layer_of_bulk().violations == 0);
}

TEST_CASE("vm_pool bulk: free memory serves the other resource once the device is full") {
  shared_device_pool s{GiB};
  SECTION("bulk blocks, then other large blocks") {
    std::vector<void*> bulk = s.fill(64 * MiB);
    REQUIRE(bulk.size() == 16);
    s.free_all(bulk, 64 * MiB);
    std::vector<void*> other = s.fill(36 * MiB);
    CHECK(other.size() == 28);  // 1008 of 1024 MiB: all the bulk resource held came back
    CHECK(s.pool.vm_stats().bulk->mapped_bytes == 0);
    s.free_all(other, 36 * MiB);
  }
  SECTION("other large blocks, then bulk blocks") {
    std::vector<void*> other = s.fill(36 * MiB);
    REQUIRE(other.size() == 28);
    s.free_all(other, 36 * MiB);
    std::vector<void*> bulk = s.fill(64 * MiB);
    CHECK(bulk.size() == 16);
    s.free_all(bulk, 64 * MiB);
  }
  SECTION("bulk blocks, then the pool's small blocks") {
    std::vector<void*> bulk = s.fill(64 * MiB);
    REQUIRE(bulk.size() == 16);
    s.free_all(bulk, 64 * MiB);
    std::vector<void*> small = s.fill(MiB);
    CHECK(small.size() >= 960);  // the pool's 64 MiB chunks over the whole device
    s.free_all(small, MiB);
  }
  CHECK(s.pool.stats().used_bytes == 0);
  CHECK(s.layer_of_upstream.violations == 0);
  CHECK(s.layer_of_bulk().violations == 0);
}

TEST_CASE("vm_pool bulk: the bulk resource does not grow into keep_free; the upstream serves") {
  // The training loop's case (bench/python/README.md): the upstream holds the device's memory,
  // free, and a bulk-sized block comes. Before, the bulk resource grew into the reserve, the
  // device said no, and the upstream gave all its free memory back to the driver for it; the
  // next other block took it back the same way. Now the upstream serves the block from what
  // it holds, and nothing moves.
  shared_device_pool s{GiB, reserve_options()};
  std::vector<void*> other = s.fill(36 * MiB);
  REQUIRE(other.size() == 28);  // a reserve, not a limit: requests still fill the device
  s.free_all(other, 36 * MiB);
  const vm_pool_stats before = s.pool.vm_stats();
  const std::size_t creates_before = s.layer_of_upstream.calls.create;
  void* p = s.pool.allocate(64 * MiB);
  vm_pool_stats st = s.pool.vm_stats();
  CHECK(&s.pool.upstream_vm_of(p) == &s.pool.upstream_vm());
  CHECK(st.bulk_declined == 1);
  CHECK(st.bulk->mapped_bytes == 0);
  CHECK(st.mapped_bytes == before.mapped_bytes);  // nothing given back, nothing made
  CHECK(s.layer_of_upstream.calls.create == creates_before);
  CHECK(s.layer_of_bulk().calls.create == 0);
  CHECK(st.large_used_bytes == 64 * MiB);
  s.pool.deallocate(p, 64 * MiB);  // to the upstream, where it came from (its record says)
  st = s.pool.vm_stats();
  CHECK(st.large_used_bytes == 0);
  CHECK(st.used_bytes == 0);
  // With room above the reserve, a bulk-sized block is the bulk resource's again.
  CHECK(s.pool.release() == st.mapped_bytes);
  void* q = s.pool.allocate(64 * MiB);
  CHECK(&s.pool.upstream_vm_of(q) == s.pool.bulk_vm());
  CHECK(s.pool.vm_stats().bulk_declined == 1);
  s.pool.deallocate(q, 64 * MiB);
  CHECK(s.layer_of_upstream.violations == 0);
  CHECK(s.layer_of_bulk().violations == 0);
}

TEST_CASE("vm_pool bulk: the upstream held back by keep_free takes the bulk resource's free "
          "memory, once") {
  shared_device_pool s{GiB, reserve_options()};
  std::vector<void*> bulk;
  for (int i = 0; i < 12; ++i) {  // 768 MiB: the bulk resource grows up to the reserve
    bulk.push_back(s.pool.allocate(64 * MiB));
  }
  REQUIRE(s.pool.vm_stats().bulk->mapped_bytes == 768 * MiB);
  s.free_all(bulk, 64 * MiB);
  // The upstream's first block finds its growth held back (the device is at the reserve):
  // it grows into the reserve for this one, and the bulk resource then gives back its free
  // handles, so the next blocks grow above the reserve instead of recycling.
  void* first = s.pool.allocate(36 * MiB);
  vm_pool_stats st = s.pool.vm_stats();
  CHECK(st.bulk->mapped_bytes == 0);
  const std::size_t held_back = st.kept_free_compactions;
  std::vector<void*> other = s.fill(36 * MiB);
  other.push_back(first);
  CHECK(other.size() == 28);  // the whole device, as with one resource
  CHECK(s.pool.vm_stats().kept_free_compactions == held_back);
  s.free_all(other, 36 * MiB);
  // Shapes that change from step to step: bulk-sized blocks, then others, again and again.
  // Once the upstream holds the memory, nothing moves between the two resources any more.
  const auto run_step = [&s] {
    std::vector<void*> a;
    for (int i = 0; i < 8; ++i) {
      a.push_back(s.pool.allocate(64 * MiB));
    }
    s.free_all(a, 64 * MiB);
    std::vector<void*> b;
    for (int i = 0; i < 20; ++i) {
      b.push_back(s.pool.allocate(36 * MiB));
    }
    s.free_all(b, 36 * MiB);
  };
  run_step();
  const std::size_t creates = s.layer_of_upstream.calls.create + s.layer_of_bulk().calls.create;
  const std::size_t releases =
      s.layer_of_upstream.calls.release + s.layer_of_bulk().calls.release;
  for (int step = 0; step < 4; ++step) {
    run_step();
  }
  CHECK(s.layer_of_upstream.calls.create + s.layer_of_bulk().calls.create == creates);
  CHECK(s.layer_of_upstream.calls.release + s.layer_of_bulk().calls.release == releases);
  CHECK(s.pool.stats().used_bytes == 0);
  CHECK(s.layer_of_upstream.violations == 0);
  CHECK(s.layer_of_bulk().violations == 0);
}

TEST_CASE("vm_pool bulk: with keep_free, 128 MiB in freed 64 MiB holes still uses every byte") {
  shared_device_pool s{GiB, reserve_options()};
  std::vector<void*> blocks = s.fill(64 * MiB);
  REQUIRE(blocks.size() == 16);
  vm_pool_stats st = s.pool.vm_stats();
  CHECK(st.bulk->mapped_bytes <= GiB - 256 * MiB);  // bulk growth stopped at the reserve
  CHECK(st.bulk_declined >= 1);                     // the rest came from the upstream
  s.free_every_other(blocks, 64 * MiB);
  std::vector<void*> large = s.fill(128 * MiB);
  CHECK(large.size() == 4);  // the holes of both resources, each recycled where it lies
  for (void* p : large) {
    const bool in_bulk = &s.pool.upstream_vm_of(p) == s.pool.bulk_vm();
    CHECK((in_bulk ? s.layer_of_bulk() : s.layer_of_upstream).is_accessible(addr(p), 128 * MiB));
  }
  s.free_all(large, 128 * MiB);
  s.free_survivors(blocks, 64 * MiB);
  CHECK(s.pool.stats().used_bytes == 0);
  CHECK(s.pool.vm_stats().large_used_bytes == 0);
  s.pool.release();
  CHECK(s.device.stats().used_bytes == 0);
  CHECK(s.layer_of_upstream.violations == 0);
  CHECK(s.layer_of_bulk().violations == 0);
}

TEST_CASE("vm_pool bulk: an out-of-memory report counts the bulk blocks as the chain's") {
  // The bulk vm_resource is not under upstream(): without held_beside, a report would call
  // its memory "held by others" and the device free.
  shared_device_pool s{GiB};
  std::vector<void*> bulk = s.fill(64 * MiB);  // the whole device, live
  REQUIRE(bulk.size() == 16);
  try {
    static_cast<void>(s.pool.allocate(36 * MiB));
    FAIL("36 MiB on a full device");
  } catch (const out_of_memory& e) {
    CHECK(e.report().held_by_chain() == GiB);
    CHECK(e.report().device_free == std::optional<std::size_t>{0});
    CHECK(e.verdict() == oom_verdict::exhausted);
    CHECK(e.report().to_json().find("\"held_beside\":1073741824") != std::string::npos);
  }
  CHECK(s.pool.stats().held_beside == GiB);
  s.free_all(bulk, 64 * MiB);
}

TEST_CASE("vm_pool bulk: a driver failure under a bulk block leaks nothing") {
  shared_device_pool s{GiB};
  s.layer_of_bulk().fail_map_after(1);
  CHECK_THROWS_AS(s.pool.allocate(96 * MiB), std::runtime_error);
  CHECK(s.pool.stats().used_bytes == 0);
  CHECK(s.pool.vm_stats().large_used_bytes == 0);
  CHECK(s.pool.vm_stats().bulk->used_bytes == 0);
  void* p = s.pool.allocate(96 * MiB);  // the next try works
  CHECK(s.layer_of_bulk().is_accessible(addr(p), 96 * MiB));
  s.pool.deallocate(p, 96 * MiB);
  CHECK(s.pool.release() > 0);
  CHECK(s.device.stats().used_bytes == 0);
  CHECK(s.layer_of_bulk().violations == 0);
}

TEST_CASE("vm_pool bulk: a driver failure in the upstream, after the bulk resource declined, "
          "leaks nothing") {
  shared_device_pool s{GiB, reserve_options()};
  std::vector<void*> blocks = s.fill(36 * MiB);
  REQUIRE(blocks.size() == 28);
  s.free_every_other(blocks, 36 * MiB);  // 36 MiB holes: a 64 MiB block needs recycling
  const vm_pool_stats before = s.pool.vm_stats();
  s.layer_of_upstream.fail_map_after(1);  // the recycled handles' second map fails
  CHECK_THROWS_AS(s.pool.allocate(64 * MiB), std::runtime_error);
  vm_pool_stats st = s.pool.vm_stats();
  CHECK(st.bulk_declined == 1);
  CHECK(st.large_used_bytes == before.large_used_bytes);
  CHECK(st.used_bytes == before.used_bytes);
  CHECK(st.mapped_bytes == before.mapped_bytes);  // the handles went back where they were
  CHECK(st.bulk->mapped_bytes == 0);
  void* p = s.pool.allocate(64 * MiB);  // the next try works, from the upstream
  CHECK(&s.pool.upstream_vm_of(p) == &s.pool.upstream_vm());
  CHECK(s.layer_of_upstream.is_accessible(addr(p), 64 * MiB));
  s.pool.deallocate(p, 64 * MiB);
  s.free_survivors(blocks, 36 * MiB);
  CHECK(s.pool.stats().used_bytes == 0);
  s.pool.release();
  CHECK(s.device.stats().used_bytes == 0);
  CHECK(s.layer_of_upstream.violations == 0);
  CHECK(s.layer_of_bulk().violations == 0);
}

TEST_CASE("vm_pool bulk: a bulk block freed with another size goes back where it came from") {
  shared_device_pool s{GiB};
  void* p = s.pool.allocate(64 * MiB);
  cudamem_test::captured_errors errors;
  s.pool.deallocate(p, 40 * MiB);  // a size mismatch: reported, and the block is still freed
  CHECK(errors.messages().size() == 1);
  CHECK(s.pool.vm_stats().bulk->used_bytes == 0);
  CHECK(s.pool.vm_stats().large_used_bytes == 0);
  CHECK(s.layer_of_bulk().violations == 0);
}

TEST_CASE("vm_pool bulk: bad input") {
  simulated_resource device{{.capacity = GiB, .layout = simulated_layout::paged}};
  std::uintptr_t layers = 0;
  const auto layer = [&device, &layers] { return layer_over(device, ++layers); };
  // Not a multiple of the handle, or not larger than it.
  for (const std::size_t bad : {6 * MiB, 4 * MiB, 2 * MiB, 34 * MiB}) {
    CAPTURE(bad);
    CHECK_THROWS_AS(vm_pool_resource(layer(), layer(), bulk_options(bad)), std::invalid_argument);
  }
  // Bulk blocks asked for, with no layer for them.
  CHECK_THROWS_AS(vm_pool_resource(layer(), bulk_options()), std::invalid_argument);
  CHECK_THROWS_AS(vm_pool_resource(layer(), nullptr, bulk_options()), std::invalid_argument);
  // And a bad size is refused even where there would be no bulk resource.
  vm_pool_options limited = bulk_options(6 * MiB);
  limited.physical_limit = 512 * MiB;
  CHECK_THROWS_AS(vm_pool_resource(layer(), layer(), limited), std::invalid_argument);
  CHECK(device.stats().used_bytes == 0);  // nothing was made
}

TEST_CASE("vm_pool bulk: none under a physical limit or an adaptor; none by default") {
  simulated_resource device{{.capacity = GiB, .layout = simulated_layout::paged}};
  std::uintptr_t layers = 0;
  const auto layer = [&device, &layers] { return layer_over(device, ++layers); };
  vm_pool_options limited = bulk_options();
  limited.physical_limit = 512 * MiB;
  vm_pool_options adapted = bulk_options();
  adapted.upstream_adaptor = [](vm_resource& vm) {
    return std::make_unique<statistics_adaptor>(vm);
  };
  vm_pool_options plain;
  plain.handle_bytes = 4 * MiB;
  for (const vm_pool_options& options : {limited, adapted, plain}) {
    vm_pool_resource pool{layer(), layer(), options};
    CHECK(pool.bulk_vm() == nullptr);
    CHECK_FALSE(pool.vm_stats().bulk.has_value());
    void* p = pool.allocate(64 * MiB);  // the upstream's, as without the option
    CHECK(&pool.upstream_vm_of(p) == &pool.upstream_vm());
    CHECK(pool.vm_stats().large_used_bytes == 64 * MiB);
    pool.deallocate(p, 64 * MiB);
  }
}
