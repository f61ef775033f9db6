// vm_resource::block_handles over the simulated mapping layer (no GPU): which physical handles
// lie under a block — the list vm_ipc.hpp's export_block turns into file descriptors. A block
// of whole handles, a small block inside a shared handle (with its offset), a block over
// handles created in two growths, and the bad input: a resource not made exportable, a
// pointer it never gave, one inside a block, one already freed.
#include <cudamem/detail/vm/simulated_mapping.hpp>
#include <cudamem/vm_resource.hpp>

#include <catch2/catch.hpp>

#include <cstdint>
#include <memory>
#include <numeric>
#include <stdexcept>

using namespace cudamem;
using detail::simulated_vm_mapping;
using detail::simulated_vm_options;

namespace {

constexpr std::size_t MiB = std::size_t{1} << 20;
constexpr std::size_t GiB = std::size_t{1} << 30;

struct sim_vm {
  explicit sim_vm(bool exportable, std::size_t handle = 32 * MiB, std::size_t growth = 64 * MiB)
      : vm(std::make_unique<simulated_vm_mapping>(
               simulated_vm_options{.capacity = 8 * GiB, .granularity = 2 * MiB}),
           options(exportable, handle, growth)),
        layer(dynamic_cast<simulated_vm_mapping&>(vm.mapping_layer())) {}
  static vm_resource_options options(bool exportable, std::size_t handle, std::size_t growth) {
    vm_resource_options o;
    o.handle_bytes = handle;
    o.growth_bytes = growth;
    o.exportable = exportable;
    return o;
  }
  vm_resource vm;
  simulated_vm_mapping& layer;
};

std::uintptr_t addr(const void* p) { return reinterpret_cast<std::uintptr_t>(p); }

std::size_t total(const vm_block_handles& h) {
  return std::accumulate(h.handles.begin(), h.handles.end(), std::size_t{0},
                         [](std::size_t sum, const auto& e) { return sum + e.second; });
}

}  // namespace

TEST_CASE("block_handles: a block of whole handles lists exactly them, in address order") {
  sim_vm s{true};
  void* p = s.vm.allocate(96 * MiB);  // three 32 MiB handles
  const vm_block_handles h = s.vm.block_handles(p);
  CHECK(h.address == addr(p));
  CHECK(h.offset == 0);
  CHECK(h.bytes == 96 * MiB);
  CHECK(h.requested == 96 * MiB);
  REQUIRE(h.handles.size() == 3);
  CHECK(total(h) == 96 * MiB);
  for (std::size_t i = 0; i < h.handles.size(); ++i) {
    // The layer agrees: handle i is the one mapped at p + 32 MiB * i.
    CHECK(s.layer.handle_at(addr(p) + i * 32 * MiB) == h.handles[i].first);
    CHECK(h.handles[i].second == 32 * MiB);
  }
  s.vm.deallocate(p, 96 * MiB);
}

TEST_CASE("block_handles: a small block sits inside one shared handle, at its offset") {
  sim_vm s{true};
  void* first = s.vm.allocate(4 * MiB);
  void* second = s.vm.allocate(6 * MiB - 100);  // rounded to 6 MiB; asked for less
  const vm_block_handles a = s.vm.block_handles(first);
  const vm_block_handles b = s.vm.block_handles(second);
  REQUIRE(a.handles.size() == 1);
  REQUIRE(b.handles.size() == 1);
  CHECK(a.handles[0].first == b.handles[0].first);  // the same 32 MiB handle
  CHECK(a.offset + (addr(second) - addr(first)) == b.offset);
  CHECK(b.bytes == 6 * MiB);
  CHECK(b.requested == 6 * MiB - 100);
  CHECK(b.offset + b.bytes <= total(b));
  CHECK(s.layer.handle_at(addr(second)) == b.handles[0].first);
  s.vm.deallocate(second, 6 * MiB - 100);
  s.vm.deallocate(first, 4 * MiB);
}

TEST_CASE("block_handles: a block over handles of two growths is still one adjacent run") {
  sim_vm s{true, 32 * MiB, 32 * MiB};
  void* small = s.vm.allocate(2 * MiB);       // the first growth: one handle
  void* large = s.vm.allocate(128 * MiB);     // needs more: a second growth, at the frontier
  const vm_block_handles h = s.vm.block_handles(large);
  CHECK(h.offset == 0);
  CHECK(h.handles.size() == 4);
  CHECK(total(h) == 128 * MiB);
  for (std::size_t i = 0; i < h.handles.size(); ++i) {
    CHECK(s.layer.handle_at(addr(large) + i * 32 * MiB) == h.handles[i].first);
  }
  s.vm.deallocate(large, 128 * MiB);
  s.vm.deallocate(small, 2 * MiB);
}

TEST_CASE("block_handles: bad input throws std::invalid_argument and changes nothing") {
  sim_vm plain{false};
  void* p = plain.vm.allocate(32 * MiB);
  CHECK_THROWS_AS(plain.vm.block_handles(p), std::invalid_argument);  // not exportable
  plain.vm.deallocate(p, 32 * MiB);

  sim_vm s{true};
  void* q = s.vm.allocate(64 * MiB);
  int on_the_stack = 0;
  CHECK_THROWS_AS(s.vm.block_handles(&on_the_stack), std::invalid_argument);  // never given
  CHECK_THROWS_AS(s.vm.block_handles(nullptr), std::invalid_argument);
  CHECK_THROWS_AS(s.vm.block_handles(static_cast<char*>(q) + 2 * MiB), std::invalid_argument);
  const std::size_t used = s.vm.vm_stats().used_bytes;
  CHECK(s.vm.block_handles(q).handles.size() == 2);
  CHECK(s.vm.vm_stats().used_bytes == used);
  s.vm.deallocate(q, 64 * MiB);
  CHECK_THROWS_AS(s.vm.block_handles(q), std::invalid_argument);  // freed
}

TEST_CASE("handles_covering: any mapped range, a part of a block or beyond it, and nothing else") {
  sim_vm s{true};
  void* a = s.vm.allocate(40 * MiB);  // two 32 MiB handles of one 64 MiB growth
  const vm_block_handles part = s.vm.handles_covering(static_cast<char*>(a) + 8 * MiB, 4 * MiB);
  REQUIRE(part.handles.size() == 1);
  CHECK(part.offset == 8 * MiB);
  const vm_block_handles across = s.vm.handles_covering(static_cast<char*>(a) + 30 * MiB, 4 * MiB);
  CHECK(across.handles.size() == 2);  // over the edge between the two handles
  CHECK(across.offset == 30 * MiB);
  // Free memory that is mapped is coverable (a pool's chunk keeps blocks inside it).
  const vm_block_handles free_part = s.vm.handles_covering(static_cast<char*>(a) + 50 * MiB, MiB);
  CHECK(free_part.handles.size() == 1);
  // Outside what is mapped, zero bytes, and a resource not made exportable: refused.
  int outside = 0;
  CHECK_THROWS_AS(s.vm.handles_covering(&outside, 4), std::invalid_argument);
  CHECK_THROWS_AS(s.vm.handles_covering(a, 0), std::invalid_argument);
  CHECK_THROWS_AS(s.vm.handles_covering(a, 65 * MiB), std::invalid_argument);  // past the end
  sim_vm plain{false};
  void* b = plain.vm.allocate(MiB);
  CHECK_THROWS_WITH(plain.vm.handles_covering(b, MiB), Catch::Contains("not made exportable"));
  plain.vm.deallocate(b, MiB);
  s.vm.deallocate(a, 40 * MiB);
}

TEST_CASE("add_peer: what is mapped gets the peer's access, and later mappings do too") {
  sim_vm s{false};
  void* a = s.vm.allocate(100 * MiB);
  const auto ranges = s.vm.mapped_ranges();
  REQUIRE(ranges.size() == 1);
  CHECK(ranges[0].second == 128 * MiB);  // four handles, one range
  s.vm.add_peer(3);
  CHECK(s.layer.peers == std::vector<int>{3});
  CHECK(s.layer.peer_access_mappings == 4);  // every mapping of the range
  void* b = s.vm.allocate(200 * MiB);         // a growth after the peer was added
  CHECK(s.layer.peers == std::vector<int>{3});
  s.vm.add_peer(3);                           // again: no new peer, access set again
  CHECK(s.layer.peers.size() == 1);
  s.vm.deallocate(a, 100 * MiB);
  s.vm.deallocate(b, 200 * MiB);
}

TEST_CASE("the peak of mapped memory outlives the memory, until reset_peak_mapped()") {
  sim_vm s{false};
  void* a = s.vm.allocate(GiB);
  const std::size_t mapped = s.vm.vm_stats().mapped_bytes;
  CHECK(s.vm.vm_stats().peak_mapped_bytes == mapped);
  s.vm.deallocate(a, GiB);
  s.vm.release();
  CHECK(s.vm.vm_stats().mapped_bytes == 0);
  CHECK(s.vm.vm_stats().peak_mapped_bytes == mapped);
  s.vm.reset_peak_mapped();
  CHECK(s.vm.vm_stats().peak_mapped_bytes == 0);
  CHECK(s.vm.mapped_ranges().empty());
}
