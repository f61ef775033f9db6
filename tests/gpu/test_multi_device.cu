// Several devices' machinery on ANY number of GPUs (one is enough): per_device_resources on
// every visible device and its bad input, owners handed between threads, peer_access's
// defined no-ops and errors, copies ordered after another stream, default streams. What needs
// two GPUs is in test_two_gpus.cu.
#include <cudamem/copy.hpp>
#include <cudamem/current_resource.hpp>
#include <cudamem/device_buffer.hpp>
#include <cudamem/event.hpp>
#include <cudamem/host_resource.hpp>
#include <cudamem/peer_access.hpp>
#include <cudamem/per_device_resources.hpp>
#include <cudamem/pinned_buffer.hpp>
#include <cudamem/statistics_adaptor.hpp>
#include <cudamem/stream.hpp>

#include "gpu_test.hpp"
#include "late_fill.cuh"

#include <stdexcept>
#include <thread>
#include <vector>

using namespace cudamem;
using cudamem_test::captured_errors;
using cudamem_test::late_fill;

namespace {

__global__ void fill_with(device_span<int> x, int value) {
  const std::size_t i = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x;
  if (i < x.size()) {
    x[i] = value;
  }
}

std::size_t count_equal(const pinned_buffer<int>& h, int value) {
  std::size_t n = 0;
  for (const int v : h) {
    n += v == value ? 1 : 0;
  }
  return n;
}

/// Counts constructions and destructions: to see that a stack destroys what it made.
struct probe {
  static inline int alive = 0;
  probe() { ++alive; }
  ~probe() { --alive; }
  probe(const probe&) = delete;
  probe& operator=(const probe&) = delete;
};

}  // namespace

TEST_CASE("per_device_resources::pools: one pool per visible device, current while it lives") {
  const int n = device_count();
  std::vector<memory_resource*> before;
  for (int d = 0; d < n; ++d) {
    before.push_back(&get_current_resource(d));
  }
  {
    auto pools = per_device_resources::pools();
    REQUIRE(pools.size() == static_cast<std::size_t>(n));
    for (int d = 0; d < n; ++d) {
      CHECK(pools.devices()[static_cast<std::size_t>(d)] == d);
      CHECK(pools.get(d).device() == d);
      CHECK(pools.get(d).name() == "pool_resource");
      CHECK(&get_current_resource(d) == &pools.get(d));
      CHECK(&pools[d] == &pools.get(d));
      CHECK(&pools.find<pool_resource>(d) == &pools.get(d));
      CHECK(pools.find<device_resource>(d).device() == d);
    }
    CHECK(&pools.current() == &pools.get(current_device()));
    // A buffer made with no resource named comes from the current device's pool.
    stream s;
    {
      device_buffer<int> x(1000, zero_fill, s);
      CHECK(&x.resource() == &pools.get(current_device()));
      CHECK(pools.get(current_device()).stats().used_bytes >= 1000 * sizeof(int));
    }
    CHECK(pools.get(current_device()).stats().used_bytes == 0);
    s.synchronize();
  }
  for (int d = 0; d < n; ++d) {
    CHECK(&get_current_resource(d) == before[static_cast<std::size_t>(d)]);
  }
}

TEST_CASE("per_device_resources: async and vm_pool stacks serve buffers on every device") {
  auto check_stack = [](per_device_resources& mrs, std::string_view name) {
    for (const int d : mrs.devices()) {
      const device_guard on{d};
      stream s;
      device_buffer<int> x(1 << 20, 7, s);
      CHECK(&x.resource() == &mrs.get(d));
      CHECK(x.device() == d);
      CHECK(mrs.get(d).name() == name);
      pinned_buffer<int> h(x.size());
      copy(h, x, s);
      s.synchronize();
      CHECK(count_equal(h, 7) == x.size());
    }
  };
  {
    auto mrs = per_device_resources::async(std::uint64_t{64} << 20);
    check_stack(mrs, "async_resource");
  }
  {
    auto mrs = per_device_resources::vm_pools();
    check_stack(mrs, "vm_pool_resource");
  }
}

TEST_CASE("per_device_resources: a custom stack, built with its device current") {
  const int caller = current_device();
  std::vector<int> current_while_building;
  {
    per_device_resources stats{[&](resource_stack& stack, int device) -> memory_resource& {
      current_while_building.push_back(current_device());
      auto& cuda = stack.make<device_resource>();  // -1: the current device, which is `device`
      CHECK(cuda.device() == device);
      auto& pool = stack.make<pool_resource>(cuda);
      return stack.make<statistics_adaptor>(pool);
    }};
    CHECK(current_device() == caller);
    for (const int d : stats.devices()) {
      CHECK(current_while_building[static_cast<std::size_t>(d)] == d);
      CHECK(stats.get(d).name() == "statistics_adaptor");
      CHECK(stats.get(d).device() == d);
    }
    stream s;
    device_buffer<float> x(4096, s);
    CHECK(stats.get(current_device()).stats().used_bytes >= 4096 * sizeof(float));
  }
  CHECK(current_device() == caller);
}

TEST_CASE("per_device_resources: bad input throws typed errors and changes nothing") {
  const int n = device_count();
  memory_resource& before = get_current_resource(0);
  const auto pool_stack = [](resource_stack& stack, int device) -> memory_resource& {
    return stack.make<pool_resource>(stack.make<device_resource>(device));
  };
  CHECK_THROWS_AS(per_device_resources(pool_stack, {.devices = {n}}), std::out_of_range);
  CHECK_THROWS_AS(per_device_resources(pool_stack, {.devices = {-1}}), std::out_of_range);
  CHECK_THROWS_AS(per_device_resources(pool_stack, {.devices = {0, 0}}), std::invalid_argument);
  CHECK_THROWS_AS(per_device_resources(per_device_resources::builder{}), std::invalid_argument);
  // A stack whose resource is not of its device (host memory: device -1).
  CHECK_THROWS_AS(per_device_resources([](resource_stack& stack, int) -> memory_resource& {
                    return stack.make<host_resource>();
                  }),
                  std::invalid_argument);
  CHECK(&get_current_resource(0) == &before);

  auto pools = per_device_resources::pools({}, {.devices = {0}});
  CHECK_THROWS_AS(pools.get(n), std::out_of_range);
  CHECK_THROWS_AS(pools.get(-1), std::out_of_range);
  CHECK_THROWS_AS(pools.find<async_resource>(0), std::invalid_argument);
}

TEST_CASE("per_device_resources: a builder that throws leaks nothing and sets nothing current") {
  const int n = device_count();
  memory_resource& before = get_current_resource(0);
  probe::alive = 0;
  int built = 0;
  const auto failing_last = [&](resource_stack& stack, int device) -> memory_resource& {
    stack.make<probe>();
    auto& pool = stack.make<pool_resource>(stack.make<device_resource>(device),
                                           pool_options{.initial_size = std::size_t{64} << 20});
    if (++built == n) {
      throw std::runtime_error("the last device's stack fails");
    }
    return pool;
  };
  const std::size_t free_before = cudamem_test::free_device_memory();
  CHECK_THROWS_AS(per_device_resources(failing_last), std::runtime_error);
  CHECK(built == n);
  CHECK(probe::alive == 0);                             // every stack's objects destroyed
  CHECK(&get_current_resource(0) == &before);           // and nothing made current
  CHECK(cudamem_test::free_device_memory() + (std::size_t{4} << 20) >= free_before);  // pools gone
  CHECK(current_device() == 0);
}

TEST_CASE("per_device_resources: a current resource changed and not restored stays, reported") {
  captured_errors errors;
  memory_resource& before = get_current_resource(0);
  device_resource other{0};
  {
    auto pools = per_device_resources::pools({}, {.devices = {0}});
    CHECK(&get_current_resource(0) == &pools.get(0));
    static_cast<void>(set_current_resource(&other, 0));  // a "guard" that never restores
  }
  CHECK(&get_current_resource(0) == &other);  // not replaced by a dangling pointer
  REQUIRE(errors.messages().size() == 1);
  CHECK(errors.messages()[0].find("changed and not restored") != std::string::npos);
  static_cast<void>(set_current_resource(&before, 0));
}

TEST_CASE("per_device_resources: make_current = false leaves the current resources alone") {
  memory_resource& before = get_current_resource(0);
  auto pools = per_device_resources::pools({}, {.make_current = false});
  CHECK(&get_current_resource(0) == &before);
  CHECK(&pools.get(0) != &before);
}

TEST_CASE("owners made on one thread are destroyed on another, default streams included") {
  auto pools = per_device_resources::pools();
  captured_errors errors;
  stream s{{.non_blocking = true}};
  std::vector<device_buffer<int>> made;
  std::thread maker([&] {
    const device_guard on{0};
    made.emplace_back(1 << 20, 3, s);                 // an ordinary stream
    made.emplace_back(1 << 20, 4, stream_view{});     // the legacy default stream
  });
  maker.join();
  pinned_buffer<int> h(1 << 20);
  copy(h, made[0], s);
  s.synchronize();
  CHECK(count_equal(h, 3) == h.size());
  std::thread destroyer([&] {
    const device_guard on{0};
    made.clear();
  });
  destroyer.join();
  check(cudaDeviceSynchronize());
  CHECK(pools.get(0).stats().used_bytes == 0);
  CHECK(errors.messages().empty());
}

TEST_CASE("peer_access: a device and itself is a no-op; bad ids throw") {
  const int n = device_count();
  CHECK(can_access_peer(0, 0));
  {
    peer_access self{0, 0};
    CHECK_FALSE(self.holds());
    CHECK(peer_access::holders(0, 0) == 0);
  }
  CHECK_THROWS_AS(peer_access(0, n), std::out_of_range);
  CHECK_THROWS_AS(peer_access(n, 0), std::out_of_range);
  CHECK_THROWS_AS(peer_access(-1, 0), std::out_of_range);
  CHECK_THROWS_AS(can_access_peer(0, n), std::out_of_range);
  peer_access moved_from{0, 0};
  peer_access taken{std::move(moved_from)};
  CHECK_FALSE(moved_from.holds());  // NOLINT(bugprone-use-after-move): defined: holds nothing
}

TEST_CASE("copy(dst, src, stream, after) waits for the producer on another stream") {
  constexpr std::size_t n = 1 << 16;
  stream producer{{.non_blocking = true}};
  stream consumer{{.non_blocking = true}};
  device_buffer<int> src(n, 1, producer);
  device_buffer<int> dst(n, 0, consumer);
  producer.synchronize();
  consumer.synchronize();
  // The producer writes 2 after 100 ms; a copy on the consumer that did not wait would read 1.
  late_fill<<<1, 1, 0, producer.get()>>>(src, 2, 100'000'000ULL);
  check(cudaGetLastError());
  copy(dst, src, consumer, producer);
  pinned_buffer<int> h(n);
  copy(h, dst, consumer);
  consumer.synchronize();
  CHECK(count_equal(h, 2) == n);
  // Sizes are still checked first, and zero elements enqueue nothing.
  device_buffer<int> smaller(n - 1, consumer);
  CHECK_THROWS_AS(copy(smaller, src, consumer, producer), std::invalid_argument);
  device_buffer<int> none(0, consumer);
  device_buffer<int> none_too(0, consumer);
  copy(none, none_too, consumer, producer);
  producer.synchronize();
}

TEST_CASE("copy(..., after) with a default stream on either side") {
  constexpr std::size_t n = 1 << 12;
  stream producer{{.non_blocking = true}};
  device_buffer<int> src(n, 6, producer);
  device_buffer<int> dst(n, 0, stream_view{});
  copy(dst, src, stream_view{}, producer);  // the legacy stream waits for the producer
  pinned_buffer<int> h(n);
  copy(h, dst, stream_view{});
  check(cudaStreamSynchronize(nullptr));
  CHECK(count_equal(h, 6) == n);
}

TEST_CASE("event::record on a default stream and destruction on another thread") {
  event e{{.timing = false}};
  fill_with<<<1, 32>>>(device_span<int>{}, 0);
  check(cudaGetLastError());
  e.record(stream_view{});
  e.record(stream_view::per_thread());
  e.synchronize();
  CHECK(e.is_complete());
  captured_errors errors;
  std::thread([moved = std::move(e)]() mutable { static_cast<void>(moved); }).join();
  CHECK(errors.messages().empty());
}
