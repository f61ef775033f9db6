// vm_resource's recent frees (vm_resource_options::recent_frees) over the simulated mapping
// layer (no GPU): the list itself (order, the stream rule, its bytes), a block kept aside going
// to the next request of its size on its stream, and every path that must see kept blocks as
// free memory — statistics, release, trim, a request that fits only once they are merged, a
// request on another stream or a synchronous one, failure and its report, bad frees of a kept
// block, destruction — and the bounds (count, bytes, bad values).
#include <cudamem/detail/vm/recent_frees.hpp>
#include <cudamem/detail/vm/simulated_mapping.hpp>
#include <cudamem/vm_resource.hpp>

#include "captured_errors.hpp"

#include <catch2/catch.hpp>

#include <cstdint>
#include <memory>
#include <optional>
#include <stdexcept>
#include <vector>

using namespace cudamem;
using detail::recent_free;
using detail::recent_frees;
using detail::simulated_vm_mapping;
using detail::simulated_vm_options;

namespace {

constexpr std::size_t MiB = std::size_t{1} << 20;
constexpr std::size_t GiB = std::size_t{1} << 30;

cudaStream_t fake_stream(std::uintptr_t n) { return reinterpret_cast<cudaStream_t>(n * 0x1000); }
std::uintptr_t addr(void* p) { return reinterpret_cast<std::uintptr_t>(p); }

/// A 1 GiB simulated device of 16 MiB handles, mapped whole at the first allocation (one
/// growth of 1 GiB), so that the blocks kept aside may hold 1/16 of it: 64 MiB, four handles.
/// Blocks are kept while the resource may still grow: until a create has failed.
struct sim_vm {
  explicit sim_vm(std::size_t recent = default_recent_frees,
                  detail::simulated_vm_final_state* final_state = nullptr,
                  bool exportable = false)
      : sim_vm(options(recent, exportable), GiB, final_state) {}

  sim_vm(vm_resource_options o, std::size_t capacity,
         detail::simulated_vm_final_state* final_state = nullptr)
      : vm(std::make_unique<simulated_vm_mapping>(simulated_vm_options{
               .capacity = capacity, .granularity = 2 * MiB, .final_state = final_state}),
           std::move(o)),
        layer(dynamic_cast<simulated_vm_mapping&>(vm.mapping_layer())) {}

  static vm_resource_options options(std::size_t recent = default_recent_frees,
                                     bool exportable = false) {
    vm_resource_options o;
    o.handle_bytes = 16 * MiB;
    o.growth_bytes = GiB;
    o.recent_frees = recent;
    o.exportable = exportable;
    return o;
  }

  /// The whole device in 16 MiB blocks on `stream` (the device has not said "full" yet).
  std::vector<void*> fill(cudaStream_t stream) {
    std::vector<void*> blocks;
    for (int i = 0; i < 64; ++i) {
      blocks.push_back(vm.allocate(16 * MiB, 256, stream));
    }
    CHECK(vm.vm_stats().free_bytes == 0);
    CHECK(layer.physical_in_use() == GiB);
    return blocks;
  }

  /// Frees every block of `blocks` that is not null, on `stream`.
  void free_all(const std::vector<void*>& blocks, cudaStream_t stream) {
    for (void* p : blocks) {
      if (p != nullptr) {
        vm.deallocate(p, 16 * MiB, 256, stream);
      }
    }
  }

  vm_resource vm;
  simulated_vm_mapping& layer;
};

recent_free block_at(std::uintptr_t address, std::size_t bytes, cudaStream_t stream,
                     bool complete = false) {
  return {address, bytes, stream, complete, nullptr};
}

}  // namespace

TEST_CASE("recent_frees: newest first, by size and stream; no gap once one is taken") {
  recent_frees r{4};
  CHECK(r.empty());
  CHECK_FALSE(r.full());
  const cudaStream_t a = fake_stream(1);
  const cudaStream_t b = fake_stream(2);
  r.put(block_at(0x1000, 32, a));
  r.put(block_at(0x2000, 16, a));
  r.put(block_at(0x3000, 32, a));
  r.put(block_at(0x4000, 32, b));
  CHECK(r.full());
  CHECK(r.count() == 4);
  CHECK(r.bytes() == 112);
  CHECK(r.oldest().address == 0x1000);
  CHECK_FALSE(r.take(64, a, false));  // no block of that size
  CHECK_FALSE(r.take(16, b, false));  // its size, another stream
  auto hit = r.take(32, a, false);    // the newest of a's two
  REQUIRE(hit);
  CHECK(hit->address == 0x3000);
  CHECK(r.count() == 3);
  CHECK(r.bytes() == 80);
  CHECK_FALSE(r.full());
  r.put(block_at(0x5000, 32, a));  // room again: the list keeps its order
  CHECK(r.take(32, a, false)->address == 0x5000);
  CHECK(r.take(32, a, false)->address == 0x1000);
  CHECK_FALSE(r.take(32, a, false));
  CHECK(r.oldest().address == 0x2000);
  std::vector<std::uintptr_t> drained;
  r.drain([&](const recent_free& f) { drained.push_back(f.address); });
  CHECK(drained == std::vector<std::uintptr_t>{0x2000, 0x4000});
  CHECK(r.empty());
  CHECK(r.bytes() == 0);
}

TEST_CASE("recent_frees: a pending block only to its stream; a complete one to anyone") {
  recent_frees r{8};
  const cudaStream_t a = fake_stream(1);
  r.put(block_at(0x1000, 32, a));                   // freed on a, pending
  r.put(block_at(0x2000, 64, nullptr));             // freed on the legacy stream, pending
  r.put(block_at(0x3000, 16, nullptr, true));       // freed synchronously: complete
  CHECK_FALSE(r.take(32, fake_stream(2), false));   // another stream would have to wait
  CHECK_FALSE(r.take(32, nullptr, true));           // so would a synchronous request
  CHECK_FALSE(r.take(64, nullptr, true));           // the legacy stream's too
  CHECK(r.take(64, nullptr, false)->address == 0x2000);  // the legacy stream itself
  CHECK(r.take(16, fake_stream(3), false)->address == 0x3000);
  CHECK(r.take(32, a, false)->address == 0x1000);
  // Taking from the middle of a wrapped list, either side moving over.
  for (int shift = 0; shift < 5; ++shift) {
    recent_frees w{5};
    for (int i = 0; i < shift; ++i) {  // move the head round the slots
      w.put(block_at(0x100, 8, a));
      w.drop_oldest();
    }
    for (std::uintptr_t i = 1; i <= 5; ++i) {
      w.put(block_at(i * 0x1000, i == 2 || i == 4 ? 16 : 8, a));
    }
    CHECK(w.take(16, a, false)->address == 0x4000);
    CHECK(w.take(16, a, false)->address == 0x2000);
    std::vector<std::uintptr_t> left;
    w.drain([&](const recent_free& f) { left.push_back(f.address); });
    CHECK(left == std::vector<std::uintptr_t>{0x1000, 0x3000, 0x5000});
  }
}

TEST_CASE("recent frees: the next request of a block's size on its stream takes it, no wait") {
  sim_vm s;
  const cudaStream_t a = fake_stream(1);
  void* p = s.vm.allocate(20 * MiB, 256, a);  // two handles
  void* q = s.vm.allocate(20 * MiB, 256, a);
  s.vm.deallocate(p, 20 * MiB, 256, a);
  const auto before = s.layer.calls;
  void* again = s.vm.allocate(30 * MiB, 256, a);  // another size, the same two handles
  CHECK(again == p);
  CHECK(s.layer.calls.order_after_free == before.order_after_free);
  CHECK(s.layer.calls.wait_for_free == before.wait_for_free);
  CHECK(s.layer.calls.map == before.map);
  const vm_resource_stats st = s.vm.vm_stats();
  CHECK(st.recent_reuses == 1);
  CHECK(st.requested_bytes == 50 * MiB);  // what the callers asked for now
  CHECK(st.used_bytes == 64 * MiB);
  s.vm.deallocate(again, 30 * MiB, 256, a);
  s.vm.deallocate(q, 20 * MiB, 256, a);
  CHECK(s.vm.stats().used_bytes == 0);
  CHECK(s.layer.violations == 0);
}

TEST_CASE("recent frees: the statistics count kept blocks as free, merged with their neighbours") {
  sim_vm s;
  const cudaStream_t a = fake_stream(1);
  std::vector<void*> blocks = s.fill(a);
  s.vm.deallocate(blocks[10], 16 * MiB, 256, a);  // neighbours: both kept aside
  s.vm.deallocate(blocks[11], 16 * MiB, 256, a);
  blocks[10] = blocks[11] = nullptr;
  SECTION("stats()") {
    const resource_stats r = s.vm.stats();
    CHECK(r.used_bytes == 62 * 16 * MiB);
    CHECK(r.free_blocks == 1);
    CHECK(r.largest_free_block == 32 * MiB);  // one range, as if never kept
  }
  SECTION("vm_stats()") {
    const vm_resource_stats v = s.vm.vm_stats();
    CHECK(v.used_bytes == 62 * 16 * MiB);
    CHECK(v.free_bytes == 32 * MiB);
    CHECK(v.largest_free_range == 32 * MiB);
    CHECK(v.recyclable_bytes == 32 * MiB);
    CHECK(v.recent_reuses == 0);
  }
  s.free_all(blocks, a);
  CHECK(s.layer.violations == 0);
}

TEST_CASE("recent frees: a request that fits only once kept blocks merge takes them, no growth") {
  sim_vm s;
  const cudaStream_t a = fake_stream(1);
  std::vector<void*> blocks = s.fill(a);
  void* first = blocks[20];
  s.vm.deallocate(blocks[20], 16 * MiB, 256, a);
  s.vm.deallocate(blocks[21], 16 * MiB, 256, a);
  blocks[20] = blocks[21] = nullptr;
  const auto before = s.layer.calls;
  void* both = s.vm.allocate(32 * MiB, 256, a);  // no free range holds it until they merge
  CHECK(both == first);
  const vm_resource_stats st = s.vm.vm_stats();
  CHECK(st.compactions == 0);  // nothing recycled, nothing created
  CHECK(s.layer.calls.create == before.create);
  CHECK(s.layer.calls.wait_for_free == before.wait_for_free);  // its own stream: no wait
  CHECK(st.recent_reuses == 0);
  s.vm.deallocate(both, 32 * MiB, 256, a);
  s.free_all(blocks, a);
  CHECK(s.layer.violations == 0);
}

TEST_CASE("recent frees: another stream waits for the free on the device, as without them") {
  sim_vm s;
  const cudaStream_t a = fake_stream(1);
  const cudaStream_t b = fake_stream(2);
  std::vector<void*> blocks = s.fill(a);
  void* freed = blocks[5];
  s.vm.deallocate(blocks[5], 16 * MiB, 256, a);
  blocks[5] = nullptr;
  const auto before = s.layer.calls;
  void* on_b = s.vm.allocate(16 * MiB, 256, b);  // not from the list: b must wait for a
  CHECK(on_b == freed);
  CHECK(s.layer.calls.order_after_free == before.order_after_free + 1);
  CHECK(s.layer.calls.wait_for_free == before.wait_for_free);
  CHECK(s.vm.vm_stats().recent_reuses == 0);
  s.vm.deallocate(on_b, 16 * MiB, 256, b);
  s.free_all(blocks, a);
  CHECK(s.layer.violations == 0);
}

TEST_CASE("recent frees: a synchronous request waits on the host for a kept block's stream") {
  sim_vm s;
  const cudaStream_t a = fake_stream(1);
  std::vector<void*> blocks = s.fill(a);
  void* freed = blocks[7];
  s.vm.deallocate(blocks[7], 16 * MiB, 256, a);
  blocks[7] = nullptr;
  const auto before = s.layer.calls;
  void* sync = s.vm.allocate(16 * MiB);
  CHECK(sync == freed);
  CHECK(s.layer.calls.wait_for_free == before.wait_for_free + 1);
  CHECK_FALSE(s.layer.in_flight(addr(sync)));
  CHECK(s.vm.vm_stats().recent_reuses == 0);
  // Freed synchronously, it is idle: the next request of its size on any stream takes it.
  s.vm.deallocate(sync, 16 * MiB);
  const auto after = s.layer.calls;
  void* on_b = s.vm.allocate(16 * MiB, 256, fake_stream(2));
  CHECK(on_b == freed);
  CHECK(s.layer.calls.order_after_free == after.order_after_free);
  CHECK(s.layer.calls.wait_for_free == after.wait_for_free);
  CHECK(s.vm.vm_stats().recent_reuses == 1);
  s.vm.deallocate(on_b, 16 * MiB, 256, fake_stream(2));
  s.free_all(blocks, a);
  CHECK(s.layer.violations == 0);
}

TEST_CASE("recent frees: release and trim give back kept blocks' handles") {
  SECTION("release") {
    sim_vm s;
    const cudaStream_t a = fake_stream(1);
    void* p = s.vm.allocate(16 * MiB, 256, a);
    s.vm.deallocate(p, 16 * MiB, 256, a);  // kept aside; every handle is now free
    CHECK(s.vm.release() == GiB);
    CHECK(s.layer.physical_in_use() == 0);
    CHECK(s.layer.unmaps_in_flight == 0);  // the host waited for a first
  }
  SECTION("trim: a kept block at the end of what is mapped is held ahead") {
    sim_vm s;
    const cudaStream_t a = fake_stream(1);
    std::vector<void*> blocks = s.fill(a);
    s.vm.deallocate(blocks[63], 16 * MiB, 256, a);  // the last handle, kept aside
    blocks[63] = nullptr;
    CHECK(s.vm.trim() == 16 * MiB);
    CHECK(s.layer.physical_in_use() == GiB - 16 * MiB);
    CHECK(s.layer.unmaps_in_flight == 0);
    s.free_all(blocks, a);
  }
}

TEST_CASE("recent frees: recycling and failure come only once kept blocks are back") {
  const cudaStream_t a = fake_stream(1);
  SECTION("two lone kept blocks are recycled into one range for a request of both") {
    sim_vm s;
    std::vector<void*> blocks = s.fill(a);
    s.vm.deallocate(blocks[2], 16 * MiB, 256, a);
    s.vm.deallocate(blocks[4], 16 * MiB, 256, a);
    blocks[2] = blocks[4] = nullptr;
    void* joined = s.vm.allocate(32 * MiB, 256, a);
    CHECK(s.vm.vm_stats().compactions == 1);
    CHECK(s.layer.physical_in_use() == GiB);  // nothing created: the device is full
    s.vm.deallocate(joined, 32 * MiB, 256, a);
    s.free_all(blocks, a);
    CHECK(s.layer.violations == 0);
  }
  SECTION("a request a kept block cannot serve fails, and says the block is free") {
    sim_vm s;
    std::vector<void*> blocks = s.fill(a);
    s.vm.deallocate(blocks[9], 16 * MiB, 256, a);
    blocks[9] = nullptr;
    try {
      static_cast<void>(s.vm.allocate(48 * MiB, 256, a));
      FAIL("48 MiB fitted into 16 MiB");
    } catch (const out_of_memory& e) {
      CHECK_THAT(e.report().cause, Catch::Contains("16.00 MiB free in all"));
      const resource_stats& st = e.report().chain.front().stats;
      CHECK(st.used_bytes == GiB - 16 * MiB);
      CHECK(st.largest_free_block == 16 * MiB);
      CHECK(st.free_blocks == 1);
    }
    CHECK(s.vm.vm_stats().free_bytes == 16 * MiB);
    blocks[9] = s.vm.allocate(16 * MiB, 256, a);  // still there for its size
    s.free_all(blocks, a);
    CHECK(s.layer.violations == 0);
  }
}

TEST_CASE("recent frees: a kept block is free: freeing it again or exporting it is refused") {
  cudamem_test::captured_errors errors;
  sim_vm s{default_recent_frees, nullptr, /*exportable=*/true};
  const cudaStream_t a = fake_stream(1);
  void* p = s.vm.allocate(16 * MiB, 256, a);
  void* q = s.vm.allocate(16 * MiB, 256, a);
  s.vm.deallocate(p, 16 * MiB, 256, a);
  CHECK_THROWS_AS(s.vm.block_handles(p), std::invalid_argument);
  s.vm.deallocate(p, 16 * MiB, 256, a);  // a double free
  REQUIRE(errors.messages().size() == 1);
  CHECK_THAT(errors.messages()[0], Catch::Contains("or already freed"));
  CHECK_FALSE(s.vm.deallocate_marked(p, 16 * MiB, nullptr, 0));  // not a live block
  CHECK(errors.messages().size() == 1);
  CHECK(s.vm.vm_stats().free_bytes == GiB - 16 * MiB);  // freed once
  void* again = s.vm.allocate(16 * MiB, 256, a);
  CHECK(again == p);
  CHECK(s.vm.block_handles(again).bytes == 16 * MiB);  // live again
  s.vm.deallocate(again, 16 * MiB, 256, a);
  s.vm.deallocate(q, 16 * MiB, 256, a);
}

TEST_CASE("recent frees: destruction with blocks kept leaks nothing and reports nothing") {
  detail::simulated_vm_final_state final_state;
  cudamem_test::captured_errors errors;
  {
    sim_vm s{default_recent_frees, &final_state};
    std::vector<void*> blocks;
    for (int i = 0; i < 4; ++i) {
      blocks.push_back(s.vm.allocate(16 * MiB, 256, fake_stream(1)));
    }
    s.free_all(blocks, fake_stream(1));  // all four kept aside, in flight on the stream
  }
  REQUIRE(final_state.destroyed);
  CHECK(final_state.physical_in_use == 0);
  CHECK(final_state.mappings == 0);
  CHECK(final_state.reservations == 0);
  CHECK(final_state.violations == 0);
  CHECK(errors.messages().empty());  // nothing "still allocated"
}

TEST_CASE("recent frees: at most the count, and at most 1/16 of what is mapped") {
  const cudaStream_t a = fake_stream(1);
  SECTION("bytes: 64 MiB of the 1 GiB mapped, the oldest go back first") {
    sim_vm s;
    std::vector<void*> blocks = s.fill(a);
    for (int i = 0; i < 5; ++i) {
      s.vm.deallocate(blocks[2 * i], 16 * MiB, 256, a);  // five lone blocks
    }
    for (int i = 0; i < 5; ++i) {
      blocks[2 * i] = s.vm.allocate(16 * MiB, 256, a);
    }
    CHECK(s.vm.vm_stats().recent_reuses == 4);  // the first went back to the free ranges
    CHECK(blocks[0] != nullptr);
    // A block larger than 64 MiB is never kept.
    s.vm.deallocate(blocks[20], 16 * MiB, 256, a);
    s.vm.deallocate(blocks[21], 16 * MiB, 256, a);
    s.vm.deallocate(blocks[22], 16 * MiB, 256, a);
    s.vm.deallocate(blocks[23], 16 * MiB, 256, a);
    s.vm.deallocate(blocks[24], 16 * MiB, 256, a);
    blocks[20] = s.vm.allocate(80 * MiB, 256, a);  // from the free ranges (after a flush)
    blocks[21] = blocks[22] = blocks[23] = blocks[24] = nullptr;
    s.vm.deallocate(blocks[20], 80 * MiB, 256, a);
    blocks[20] = s.vm.allocate(80 * MiB, 256, a);
    CHECK(s.vm.vm_stats().recent_reuses == 4);
    s.vm.deallocate(blocks[20], 80 * MiB, 256, a);
    blocks[20] = nullptr;
    s.free_all(blocks, a);
  }
  SECTION("count: recent_frees=2 keeps two") {
    sim_vm s{2};
    std::vector<void*> blocks = s.fill(a);
    for (int i = 0; i < 3; ++i) {
      s.vm.deallocate(blocks[2 * i], 16 * MiB, 256, a);
    }
    for (int i = 0; i < 3; ++i) {
      blocks[2 * i] = s.vm.allocate(16 * MiB, 256, a);
    }
    CHECK(s.vm.vm_stats().recent_reuses == 2);
    s.free_all(blocks, a);
  }
  SECTION("recent_frees=0 keeps none") {
    sim_vm s{0};
    void* p = s.vm.allocate(16 * MiB, 256, a);
    s.vm.deallocate(p, 16 * MiB, 256, a);
    void* q = s.vm.allocate(16 * MiB, 256, a);
    CHECK(q == p);  // best fit finds it all the same
    CHECK(s.vm.vm_stats().recent_reuses == 0);
    s.vm.deallocate(q, 16 * MiB, 256, a);
  }
}

TEST_CASE("recent frees: none kept once the resource cannot grow: a full device, the limit") {
  // There memory is scarce: a block kept aside could cost a compaction (host waits, driver
  // calls) where the free ranges would have held the request.
  const cudaStream_t a = fake_stream(1);
  SECTION("the device has said full; release() makes room again") {
    sim_vm s;
    std::vector<void*> blocks = s.fill(a);
    CHECK_THROWS_AS(s.vm.allocate(16 * MiB, 256, a), out_of_memory);  // a create failed
    s.vm.deallocate(blocks[3], 16 * MiB, 256, a);
    blocks[3] = s.vm.allocate(16 * MiB, 256, a);  // from the free ranges
    CHECK(s.vm.vm_stats().recent_reuses == 0);
    s.free_all(blocks, a);
    CHECK(s.vm.release() == GiB);
    void* p = s.vm.allocate(16 * MiB, 256, a);  // grows again
    s.vm.deallocate(p, 16 * MiB, 256, a);
    void* q = s.vm.allocate(16 * MiB, 256, a);
    CHECK(s.vm.vm_stats().recent_reuses == 1);
    s.vm.deallocate(q, 16 * MiB, 256, a);
  }
  SECTION("physical_limit reached") {
    vm_resource_options o = sim_vm::options();
    o.physical_limit = GiB;
    sim_vm s{o, 2 * GiB};
    void* p = s.vm.allocate(16 * MiB, 256, a);  // one growth: the whole limit
    s.vm.deallocate(p, 16 * MiB, 256, a);
    void* q = s.vm.allocate(16 * MiB, 256, a);
    CHECK(q == p);
    CHECK(s.vm.vm_stats().recent_reuses == 0);
    s.vm.deallocate(q, 16 * MiB, 256, a);
  }
}

TEST_CASE("recent frees: more than max_recent_frees is refused") {
  CHECK_NOTHROW(sim_vm{max_recent_frees});
  try {
    sim_vm s{max_recent_frees + 1};
    FAIL("recent_frees above the most was accepted");
  } catch (const std::invalid_argument& e) {
    CHECK_THAT(std::string(e.what()), Catch::Contains("recent_frees must be at most 256, not 257"));
  }
}
