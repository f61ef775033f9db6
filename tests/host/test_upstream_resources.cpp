// The CUDA upstream resources and the current-resource table, on a machine that may have no
// GPU: construction with no device is a clear no_device_error, and the table's logic
// (defaults made once, get/set/exchange, bad ids) works with fake resources.
#include <cudamem/async_resource.hpp>
#include <cudamem/current_resource.hpp>
#include <cudamem/device.hpp>
#include <cudamem/device_resource.hpp>
#include <cudamem/host_resource.hpp>
#include <cudamem/managed_resource.hpp>
#include <cudamem/pinned_buffer.hpp>
#include <cudamem/pinned_resource.hpp>
#include <cudamem/pmr_resource.hpp>

#include "fake_device_memory.hpp"

#include <catch2/catch.hpp>

#include <atomic>
#include <cstdint>
#include <memory_resource>
#include <thread>
#include <vector>

using namespace cudamem;
using cudamem_test::fake_device_memory;

TEST_CASE("upstream resources: no device is a no_device_error from the constructor") {
  if (has_device()) {
    SUCCEED("this machine has a GPU: the GPU tests cover the resources");
    return;
  }
  CHECK_THROWS_AS(device_resource{}, no_device_error);
  CHECK_THROWS_AS(device_resource{0}, no_device_error);
  CHECK_THROWS_AS(async_resource{}, no_device_error);
  CHECK_THROWS_AS(async_resource{{.use_default_pool = true}}, no_device_error);
  CHECK_THROWS_AS(pinned_resource{}, no_device_error);
  CHECK_THROWS_AS(managed_resource{}, no_device_error);
  CHECK_THROWS_AS(get_current_resource(), no_device_error);
  CHECK_THROWS_AS(get_current_resource(0), no_device_error);
  host_resource host;
  CHECK_THROWS_AS(set_current_resource(&host, 0), no_device_error);
  CHECK_THROWS_AS(resource_guard{host}, no_device_error);
  CHECK_THROWS_WITH(device_resource{}, Catch::Contains("no usable CUDA device"));
}

namespace {
std::atomic<int> defaults_made{0};
memory_resource* make_fake_default(int device) {
  ++defaults_made;
  return new fake_device_memory(memory_kind::device, device);
}
}  // namespace

TEST_CASE("current_resource_table: a default per device, made once, until something is set") {
  defaults_made = 0;
  detail::current_resource_table table{2, &make_fake_default};
  memory_resource& d0 = table.get(0);
  CHECK(d0.device() == 0);
  CHECK(&table.get(0) == &d0);
  CHECK(defaults_made == 1);
  CHECK(table.get(1).device() == 1);
  CHECK(defaults_made == 2);

  host_resource mine;
  memory_resource& default_1 = table.get(1);
  CHECK(&table.exchange(&mine, 1) == &default_1);  // returns what was current: the default
  CHECK(&table.get(1) == &mine);
  CHECK(&table.get(0) == &d0);  // other devices unaffected
  memory_resource& before = table.exchange(nullptr, 1);  // back to the default
  CHECK(&before == &mine);
  CHECK(table.get(1).device() == 1);
  CHECK(defaults_made == 2);

  CHECK_THROWS_AS(table.get(2), std::out_of_range);
  CHECK_THROWS_AS(table.get(-1), std::out_of_range);
  CHECK_THROWS_WITH(table.exchange(&mine, 5), Catch::Contains("device 5 does not exist"));
  // The table owns its defaults for ever (they must survive static destruction): free them
  // here only because this table is a test's local.
  delete &table.get(0);
  delete &table.get(1);
}

TEST_CASE("current_resource_table: concurrent first use makes exactly one default") {
  defaults_made = 0;
  detail::current_resource_table table{1, &make_fake_default};
  std::vector<std::thread> threads;
  std::vector<memory_resource*> seen(8);
  for (std::size_t i = 0; i < seen.size(); ++i) {
    threads.emplace_back([&, i] { seen[i] = &table.get(0); });
  }
  for (auto& t : threads) {
    t.join();
  }
  for (memory_resource* mr : seen) {
    CHECK(mr == seen[0]);
  }
  // Losers of the race delete theirs, so more than one may have been made but one is kept.
  CHECK(defaults_made >= 1);
  delete seen[0];
}

TEST_CASE("pmr_resource: a std::pmr::vector in memory from a cudamem resource") {
  host_resource host;
  pmr_resource as_pmr{host};
  CHECK(&as_pmr.resource() == &host);
  {
    std::pmr::vector<int> v{&as_pmr};
    for (int i = 0; i < 1000; ++i) {
      v.push_back(i);
    }
    CHECK(v[999] == 999);
    CHECK(host.stats().used_bytes >= 1000 * sizeof(int));
  }
  CHECK(host.stats().used_bytes == 0);
  // Zero bytes still gets a usable pointer, as std::pmr promises.
  void* p = as_pmr.allocate(0, 8);
  CHECK(p != nullptr);
  as_pmr.deallocate(p, 0, 8);
  CHECK(host.stats().used_bytes == 0);
  // Over-aligned requests are honoured.
  void* q = as_pmr.allocate(100, 1024);
  CHECK(reinterpret_cast<std::uintptr_t>(q) % 1024 == 0);
  as_pmr.deallocate(q, 100, 1024);
}

TEST_CASE("pmr_resource: equality follows the resources; device memory is refused") {
  host_resource a;
  host_resource b;
  pmr_resource pa{a};
  pmr_resource pb{b};
  CHECK(pa.is_equal(pb));
  fake_device_memory pinned{memory_kind::pinned};
  pmr_resource pp{pinned};
  CHECK_FALSE(pa.is_equal(pp));
  CHECK_FALSE(pa.is_equal(*std::pmr::new_delete_resource()));
  fake_device_memory device_only{memory_kind::device};
  CHECK_THROWS_AS(pmr_resource{device_only}, std::invalid_argument);
  CHECK_THROWS_WITH(pmr_resource{device_only}, Catch::Contains("device memory"));
  fake_device_memory managed{memory_kind::managed};
  CHECK_NOTHROW(pmr_resource{managed});
}

TEST_CASE("pmr_resource: out of memory reaches std code as std::bad_alloc") {
  host_resource host;
  pmr_resource as_pmr{host};
  std::pmr::vector<char> v{&as_pmr};
  CHECK_THROWS_AS(v.reserve(v.max_size()), std::bad_alloc);
  CHECK(host.stats().used_bytes == 0);
}
