// detail::spare_nodes, and what it buys: the records vm_resource and vm_pool_resource keep for
// blocks and free ranges reuse their nodes, so a block of a handle or more taken and freed
// again allocates no host memory once the resource is warm (it was a malloc and a free per
// record before). This binary replaces the global operator new to count allocations, and to
// fail one on purpose: an insert that cannot allocate changes nothing.
#include <cudamem/detail/spare_nodes.hpp>
#include <cudamem/detail/vm/simulated_mapping.hpp>
#include <cudamem/vm_pool_resource.hpp>
#include <cudamem/vm_resource.hpp>

#include <catch2/catch.hpp>

#include <cstdint>
#include <cstdlib>
#include <map>
#include <memory>
#include <new>
#include <set>
#include <unordered_map>
#include <utility>
#include <vector>

namespace {

// Counts every allocation of this thread's tests; `fail_in` > 0 makes that allocation (1 =
// the next) throw std::bad_alloc.
thread_local std::size_t allocations = 0;
thread_local std::size_t fail_in = 0;

void* counted_allocation(std::size_t bytes) {
  ++allocations;
  if (fail_in != 0 && --fail_in == 0) {
    throw std::bad_alloc();
  }
  if (void* p = std::malloc(bytes == 0 ? 1 : bytes)) {
    return p;
  }
  throw std::bad_alloc();
}

}  // namespace

// Every form that pairs with the plain operator delete is replaced, so that new and delete
// always meet in malloc and free (AddressSanitizer checks that they match). The aligned forms
// stay the library's, new and delete alike.
void* operator new(std::size_t bytes) { return counted_allocation(bytes); }
void* operator new[](std::size_t bytes) { return counted_allocation(bytes); }
void* operator new(std::size_t bytes, const std::nothrow_t&) noexcept {
  try {
    return counted_allocation(bytes);
  } catch (const std::bad_alloc&) {
    return nullptr;
  }
}
void* operator new[](std::size_t bytes, const std::nothrow_t& tag) noexcept {
  return operator new(bytes, tag);
}
void operator delete(void* p) noexcept { std::free(p); }
void operator delete[](void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t) noexcept { std::free(p); }
void operator delete(void* p, const std::nothrow_t&) noexcept { std::free(p); }
void operator delete[](void* p, const std::nothrow_t&) noexcept { std::free(p); }

using namespace cudamem;
using detail::spare_nodes;

namespace {

constexpr std::size_t MiB = std::size_t{1} << 20;
constexpr std::size_t GiB = std::size_t{1} << 30;

cudaStream_t fake_stream(std::uintptr_t n) { return reinterpret_cast<cudaStream_t>(n * 0x1000); }

/// Allocations made by `f`.
template <class F>
std::size_t allocations_in(F&& f) {
  const std::size_t before = allocations;
  f();
  return allocations - before;
}

/// Allocations made by 100 calls of `cycle`, after two calls to warm it up.
template <class F>
std::size_t allocations_when_warm(F&& cycle) {
  cycle();  // growth, first records and events: allocates
  cycle();
  return allocations_in([&] {
    for (int k = 0; k < 100; ++k) {
      cycle();
    }
  });
}

}  // namespace

TEST_CASE("spare_nodes: an erased element's node serves the next insert, in every container") {
  SECTION("std::map") {
    std::map<std::uintptr_t, int> m;
    spare_nodes<std::map<std::uintptr_t, int>> spares;
    auto it = spares.insert(m, 10, 1);
    CHECK(it->first == 10);
    CHECK(it->second == 1);
    spares.erase(m, it);
    CHECK(m.empty());
    CHECK(spares.size() == 1);
    CHECK(allocations_in([&] { it = spares.insert(m, 20, 2); }) == 0);
    CHECK(spares.size() == 0);
    CHECK(m.size() == 1);
    CHECK(m.at(20) == 2);
  }
  SECTION("std::set") {
    std::set<std::pair<std::size_t, std::uintptr_t>> s;
    spare_nodes<std::set<std::pair<std::size_t, std::uintptr_t>>> spares;
    spares.erase(s, spares.insert(s, std::pair{std::size_t{5}, std::uintptr_t{50}}));
    CHECK(allocations_in([&] { spares.insert(s, std::pair{std::size_t{6}, std::uintptr_t{60}}); }) ==
          0);
    REQUIRE(s.size() == 1);
    CHECK(*s.begin() == std::pair{std::size_t{6}, std::uintptr_t{60}});
  }
  SECTION("std::unordered_map") {
    std::unordered_map<std::uintptr_t, std::size_t> u;
    u.reserve(16);
    spare_nodes<std::unordered_map<std::uintptr_t, std::size_t>> spares;
    spares.erase(u, spares.insert(u, 1, 100));
    CHECK(allocations_in([&] { spares.insert(u, 2, 200); }) == 0);
    CHECK(u.size() == 1);
    CHECK(u.at(2) == 200);
  }
}

TEST_CASE("spare_nodes: keeps at most its capacity, and keeping never allocates") {
  std::map<int, int> m;
  spare_nodes<std::map<int, int>, 4> spares;
  for (int k = 0; k < 10; ++k) {
    spares.insert(m, k, k);
  }
  CHECK(allocations_in([&] {
          while (!m.empty()) {
            spares.erase(m, m.begin());
          }
        }) == 0);
  CHECK(spares.size() == 4);  // the other six nodes were freed
  spares.keep({});            // an empty handle is not kept
  CHECK(spares.size() == 4);
  std::size_t made = 0;
  for (int k = 0; k < 6; ++k) {
    made += allocations_in([&] { spares.insert(m, 100 + k, k); });
  }
  CHECK(made == 2);  // four from the spares, then new nodes
  CHECK(m.size() == 6);
}

TEST_CASE("spare_nodes: a key already there is not replaced, and the node is not lost") {
  std::map<int, int> m;
  spare_nodes<std::map<int, int>> spares;
  spares.insert(m, 1, 10);
  spares.erase(m, spares.insert(m, 2, 20));
  REQUIRE(spares.size() == 1);
  const auto it = spares.insert(m, 1, 99);
  CHECK(it->second == 10);  // as emplace: the element already there stays
  CHECK(m.size() == 1);
}

TEST_CASE("spare_nodes: an insert that cannot allocate throws and inserts nothing") {
  std::map<int, int> m;
  spare_nodes<std::map<int, int>> spares;
  spares.insert(m, 1, 10);
  fail_in = 1;
  CHECK_THROWS_AS(spares.insert(m, 2, 20), std::bad_alloc);
  fail_in = 0;
  CHECK(m.size() == 1);
  CHECK(m.count(2) == 0);

  // An unordered map that must rehash to take a kept node: the rehash fails, nothing changes
  // and the node is freed, not leaked (ASan's leak check in CI).
  std::unordered_map<int, int> u;
  spare_nodes<std::unordered_map<int, int>> uspares;
  uspares.erase(u, uspares.insert(u, 0, 0));
  REQUIRE(uspares.size() == 1);
  for (int k = 1; k < 8; ++k) {
    u.emplace(k, k);
  }
  while (u.size() + 1 <= u.max_load_factor() * static_cast<float>(u.bucket_count())) {
    u.emplace(static_cast<int>(u.size()) + 100, 0);
  }
  const std::size_t before = u.size();
  fail_in = 1;  // the rehash's bucket array
  CHECK_THROWS_AS(uspares.insert(u, -1, -1), std::bad_alloc);
  fail_in = 0;
  CHECK(u.size() == before);
  CHECK(u.count(-1) == 0);
  CHECK(uspares.size() == 0);
}

TEST_CASE("vm_resource: a warm resource takes and frees blocks without allocating host memory") {
  vm_resource_options o;
  o.handle_bytes = 64 * MiB;
  vm_resource vm{std::make_unique<detail::simulated_vm_mapping>(detail::simulated_vm_options{
                     .capacity = 8 * GiB, .granularity = 2 * MiB}),
                 o};
  const cudaStream_t s = fake_stream(1);
  const auto cycle = [&] {
    void* a = vm.allocate(192 * MiB, 256, stream_view{s});  // whole handles
    void* b = vm.allocate(3 * MiB, 256, stream_view{s});    // granule precision
    void* c = vm.allocate(64 * MiB);                        // synchronous
    vm.deallocate(b, 3 * MiB, 256, stream_view{s});
    vm.deallocate(a, 192 * MiB, 256, stream_view{s});
    vm.deallocate(c, 64 * MiB);
  };
  CHECK(allocations_when_warm(cycle) == 0);
  CHECK(vm.vm_stats().used_bytes == 0);
}

TEST_CASE("vm_pool_resource: warm large blocks are taken and freed without allocating") {
  vm_pool_resource vm{std::make_unique<detail::simulated_vm_mapping>(detail::simulated_vm_options{
      .capacity = 8 * GiB, .granularity = 2 * MiB})};
  const cudaStream_t s = fake_stream(1);
  const auto cycle = [&] {
    void* a = vm.allocate(300 * MiB, 256, stream_view{s});
    void* b = vm.allocate(128 * MiB, 256, stream_view{s});
    vm.deallocate(a, 300 * MiB, 256, stream_view{s});
    vm.deallocate(b, 128 * MiB, 256, stream_view{s});
  };
  CHECK(allocations_when_warm(cycle) == 0);
  CHECK(vm.vm_stats().large_used_bytes == 0);
}
