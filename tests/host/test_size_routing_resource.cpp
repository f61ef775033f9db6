// size_routing_resource over host and simulated memory: routing at the bounds in both forms,
// frees reaching the resource that gave the memory, failures passing through unchanged, bad
// construction, what it reports, and two threads sharing one router.
#include <cudamem/failing_adaptor.hpp>
#include <cudamem/host_resource.hpp>
#include <cudamem/limiting_adaptor.hpp>
#include <cudamem/memory_report.hpp>
#include <cudamem/out_of_memory.hpp>
#include <cudamem/simulated_resource.hpp>
#include <cudamem/size_routing_resource.hpp>
#include <cudamem/statistics_adaptor.hpp>

#include "captured_errors.hpp"

#include <catch2/catch.hpp>

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

using namespace cudamem;
using Catch::Matchers::Contains;

namespace {

const stream_view stream_a{reinterpret_cast<cudaStream_t>(std::uintptr_t{0x1000})};

/// What a form_recorder throws when told to refuse: not an out_of_memory, so a router that
/// caught and converted failures would be seen.
struct refused : std::runtime_error {
  refused() : std::runtime_error("form_recorder: refused on purpose") {}
};

/// Records the form (on a stream or synchronous), stream, size and pointer of every call that
/// reaches it; the memory comes from a host_resource of its own. Kind, device and whether it
/// allows NVTX heaps are what the test says. One thread only.
class form_recorder final : public memory_resource {
 public:
  explicit form_recorder(memory_kind kind = memory_kind::host, int device = -1,
                         bool allows_nvtx_heaps = false)
      : memory_resource(kind, device), allows_nvtx_heaps_(allows_nvtx_heaps) {}

  std::size_t stream_allocations = 0;
  std::size_t sync_allocations = 0;
  std::size_t stream_frees = 0;
  std::size_t sync_frees = 0;
  cudaStream_t last_stream = nullptr;
  std::size_t last_bytes = 0;
  void* last_pointer = nullptr;
  bool refuse_next = false;  // the next allocation throws `refused`
  host_resource memory;

  [[nodiscard]] std::size_t calls() const noexcept {
    return stream_allocations + sync_allocations + stream_frees + sync_frees;
  }

 private:
  void* give(std::size_t bytes, std::size_t alignment) {
    if (refuse_next) {
      refuse_next = false;
      throw refused{};
    }
    last_bytes = bytes;
    last_pointer = memory.allocate(bytes, alignment);
    return last_pointer;
  }
  void take(void* p, std::size_t bytes, std::size_t alignment) noexcept {
    last_bytes = bytes;
    last_pointer = p;
    memory.deallocate(p, bytes, alignment);
  }
  void* do_allocate(std::size_t bytes, std::size_t alignment, stream_view stream) override {
    void* p = give(bytes, alignment);
    ++stream_allocations;
    last_stream = stream.get();
    return p;
  }
  void do_deallocate(void* p, std::size_t bytes, std::size_t alignment,
                     stream_view stream) noexcept override {
    ++stream_frees;
    last_stream = stream.get();
    take(p, bytes, alignment);
  }
  void* do_allocate_sync(std::size_t bytes, std::size_t alignment) override {
    void* p = give(bytes, alignment);
    ++sync_allocations;
    return p;
  }
  void do_deallocate_sync(void* p, std::size_t bytes, std::size_t alignment) noexcept override {
    ++sync_frees;
    take(p, bytes, alignment);
  }
  std::string_view do_name() const noexcept override { return "form_recorder"; }
  resource_stats do_stats() const override { return memory.stats(); }
  bool do_allows_nvtx_heaps() const noexcept override { return allows_nvtx_heaps_; }

  bool allows_nvtx_heaps_;
};

}  // namespace

TEST_CASE("size_routing: requests at the bounds go where the range says, in both forms") {
  form_recorder inside;
  form_recorder outside;
  size_routing_resource router{inside, outside, {.min_bytes = 100, .max_bytes = 200}};
  CHECK(router.min_bytes() == 100);
  CHECK(router.max_bytes() == 200);
  CHECK(&router.in_range_resource() == &inside);
  CHECK(&router.otherwise_resource() == &outside);

  const std::array<std::pair<std::size_t, bool>, 4> cases{
      {{99, false}, {100, true}, {200, true}, {201, false}}};
  for (const auto& [bytes, in_range] : cases) {
    CAPTURE(bytes);
    CHECK(router.routes_in_range(bytes) == in_range);
    form_recorder& chosen = in_range ? inside : outside;
    form_recorder& other = in_range ? outside : inside;
    CHECK(&router.resource_for(bytes) == &chosen);
    const std::size_t other_calls = other.calls();

    // On a stream: the chosen resource gets the stream-ordered form, on the same stream.
    const std::size_t stream_allocations = chosen.stream_allocations;
    void* p = router.allocate(bytes, 64, stream_a);
    CHECK(chosen.stream_allocations == stream_allocations + 1);
    CHECK(chosen.last_pointer == p);
    CHECK(chosen.last_bytes == bytes);
    CHECK(chosen.last_stream == stream_a.get());
    chosen.last_stream = nullptr;
    router.deallocate(p, bytes, 64, stream_a);
    CHECK(chosen.last_pointer == p);
    CHECK(chosen.last_stream == stream_a.get());

    // Synchronous: the chosen resource gets the synchronous form.
    const std::size_t sync_frees = chosen.sync_frees;
    void* q = router.allocate(bytes, 64);
    CHECK(chosen.last_pointer == q);
    router.deallocate(q, bytes, 64);
    CHECK(chosen.sync_frees == sync_frees + 1);
    CHECK(chosen.last_pointer == q);

    CHECK(other.calls() == other_calls);  // the other resource heard nothing
  }
  // Two sizes each way, each allocated and freed once in each form.
  for (const form_recorder* r : {&inside, &outside}) {
    CHECK(r->stream_allocations == 2);
    CHECK(r->stream_frees == 2);
    CHECK(r->sync_allocations == 2);
    CHECK(r->sync_frees == 2);
    CHECK(r->memory.stats().used_bytes == 0);
  }
}

TEST_CASE("size_routing: one-size, open-ended and extreme ranges") {
  form_recorder a;
  form_recorder b;
  const size_routing_resource one_size{a, b, {.min_bytes = 128, .max_bytes = 128}};
  CHECK(!one_size.routes_in_range(127));
  CHECK(one_size.routes_in_range(128));
  CHECK(!one_size.routes_in_range(129));

  const size_routing_resource from{a, b, {.min_bytes = 1 << 20}};  // 1 MiB and more
  CHECK(!from.routes_in_range(1));
  CHECK(!from.routes_in_range((1 << 20) - 1));
  CHECK(from.routes_in_range(1 << 20));
  CHECK(from.routes_in_range(SIZE_MAX));

  const size_routing_resource up_to{a, b, {.max_bytes = 4096}};  // up to 4 KiB
  CHECK(up_to.routes_in_range(1));
  CHECK(up_to.routes_in_range(4096));
  CHECK(!up_to.routes_in_range(4097));
  CHECK(!up_to.routes_in_range(SIZE_MAX));

  const size_routing_resource only_max{a, b, {.min_bytes = SIZE_MAX, .max_bytes = SIZE_MAX}};
  CHECK(!only_max.routes_in_range(1));
  CHECK(!only_max.routes_in_range(SIZE_MAX - 1));
  CHECK(only_max.routes_in_range(SIZE_MAX));

  const size_routing_resource everything{a, b, {}};
  CHECK(everything.routes_in_range(1));
  CHECK(everything.routes_in_range(SIZE_MAX));
}

TEST_CASE("size_routing: frees reach the resource that gave the memory") {
  host_resource host_in;
  host_resource host_out;
  statistics_adaptor in_counted{host_in};
  statistics_adaptor out_counted{host_out};
  size_routing_resource router{in_counted, out_counted, {.min_bytes = 1024, .max_bytes = 65536}};

  struct block {
    void* p;
    std::size_t bytes;
    bool on_stream;
  };
  std::vector<block> live;
  const std::array<std::size_t, 8> sizes{8, 1023, 1024, 4000, 65536, 65537, 1 << 20, 512};
  std::size_t in_bytes = 0;
  std::size_t out_bytes = 0;
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    const bool on_stream = i % 2 == 0;
    const std::size_t bytes = sizes[i];
    void* p = on_stream ? router.allocate(bytes, 256, stream_a) : router.allocate(bytes);
    live.push_back({p, bytes, on_stream});
    (router.routes_in_range(bytes) ? in_bytes : out_bytes) += bytes;
  }
  CHECK(in_counted.counters().allocations == 3);  // 1024, 4000, 65536
  CHECK(in_counted.counters().current_bytes == in_bytes);
  CHECK(out_counted.counters().allocations == 5);
  CHECK(out_counted.counters().current_bytes == out_bytes);
  CHECK(router.stats().used_bytes == in_bytes + out_bytes);

  // Freed in another order than allocated: each goes back by its size alone.
  for (std::size_t k : {5, 2, 7, 0, 4, 1, 6, 3}) {
    const block& b = live[k];
    if (b.on_stream) {
      router.deallocate(b.p, b.bytes, 256, stream_a);
    } else {
      router.deallocate(b.p, b.bytes);
    }
  }
  const allocation_counters in = in_counted.counters();
  const allocation_counters out = out_counted.counters();
  CHECK(in.deallocations == 3);
  CHECK(in.freed_bytes == in_bytes);
  CHECK(in.current_bytes == 0);
  CHECK(out.deallocations == 5);
  CHECK(out.freed_bytes == out_bytes);
  CHECK(out.current_bytes == 0);
  CHECK(host_in.stats().used_bytes == 0);
  CHECK(host_out.stats().used_bytes == 0);
}

TEST_CASE("size_routing: zero bytes and a bad alignment reach neither resource") {
  form_recorder a;
  form_recorder b;
  size_routing_resource router{a, b, {}};  // 0 is in range: it still never gets there
  CHECK(router.allocate(0) == nullptr);
  CHECK(router.allocate(0, 256, stream_a) == nullptr);
  router.deallocate(nullptr, 0);
  router.deallocate(nullptr, 100, 256, stream_a);
  CHECK_THROWS_AS(router.allocate(100, 48), std::invalid_argument);
  CHECK_THROWS_AS(router.allocate(100, 0, stream_a), std::invalid_argument);
  CHECK(a.calls() == 0);
  CHECK(b.calls() == 0);
}

TEST_CASE("size_routing: an out_of_memory from the chosen resource passes through unchanged") {
  host_resource host_in;
  host_resource host_out;
  limiting_adaptor capped{host_in, 1000};
  statistics_adaptor out_counted{host_out};
  size_routing_resource router{capped, out_counted, {.min_bytes = 100, .max_bytes = 10000}};
  void* kept = router.allocate(800);  // in range, within the budget

  const auto check_budget_failure = [&](const out_of_memory& e) {
    CHECK(e.verdict() == oom_verdict::budget);
    CHECK(e.report().requested_bytes == 500);
    // The report starts at the branch that failed, as it threw it: the router added nothing.
    REQUIRE(e.report().chain.size() == 2);
    CHECK(e.report().chain[0].name == "limiting_adaptor");
    CHECK(e.report().chain[0].stats.budget == 1000u);
    CHECK(e.report().chain[1].name == "host_resource");
    CHECK(e.report().origin == 0);
    CHECK_THAT(e.report().cause, Contains("limiting_adaptor: 800 B in use"));
    CHECK_THAT(e.report().hint(), Contains("raise its budget with set_budget()"));
  };
  try {
    static_cast<void>(router.allocate(500, 128, stream_a));
    FAIL("no throw");
  } catch (const out_of_memory& e) {
    check_budget_failure(e);
  }
  try {
    static_cast<void>(router.allocate(500, 128));
    FAIL("no throw");
  } catch (const out_of_memory& e) {
    check_budget_failure(e);
  }
  // The other resource was never asked, and the failure took nothing.
  CHECK(out_counted.counters().allocations == 0);
  CHECK(host_out.stats().used_bytes == 0);
  CHECK(capped.used_bytes() == 800);
  CHECK(host_in.stats().used_bytes == 800);
  router.deallocate(kept, 800);
  CHECK(host_in.stats().used_bytes == 0);

  // The otherwise branch failing: its failure passes through, the in_range one holds nothing.
  failing_adaptor faults{out_counted};
  faults.fail_from(1);
  size_routing_resource faulty{capped, faults, {.min_bytes = 100, .max_bytes = 10000}};
  for (const bool on_stream : {true, false}) {
    try {
      static_cast<void>(on_stream ? faulty.allocate(50, 256, stream_a) : faulty.allocate(50));
      FAIL("no throw");
    } catch (const out_of_memory& e) {
      REQUIRE(!e.report().chain.empty());
      CHECK(e.report().chain[0].name == "failing_adaptor");
      CHECK_THAT(e.report().cause, Contains("failure injected by failing_adaptor"));
      CHECK_THAT(e.report().hint(), Contains("Nothing ran out"));
    }
  }
  CHECK(faults.injected_failures() == 2);
  CHECK(capped.used_bytes() == 0);
  CHECK(host_in.stats().used_bytes == 0);
  CHECK(out_counted.counters().allocations == 0);
}

TEST_CASE("size_routing: other exceptions pass through as they were thrown") {
  form_recorder inside;
  form_recorder outside;
  size_routing_resource router{inside, outside, {.min_bytes = 100, .max_bytes = 200}};
  inside.refuse_next = true;
  CHECK_THROWS_AS(router.allocate(150, 256, stream_a), refused);
  outside.refuse_next = true;
  CHECK_THROWS_AS(router.allocate(300), refused);
  CHECK(inside.calls() == 0);
  CHECK(outside.calls() == 0);
  CHECK(inside.memory.stats().used_bytes == 0);
  CHECK(outside.memory.stats().used_bytes == 0);
}

TEST_CASE("size_routing: bad construction arguments throw std::invalid_argument") {
  host_resource a;
  host_resource b;
  CHECK_THROWS_AS((size_routing_resource{a, b, {.min_bytes = 201, .max_bytes = 200}}),
                  std::invalid_argument);
  CHECK_THROWS_WITH((size_routing_resource{a, b, {.min_bytes = 201, .max_bytes = 200}}),
                    Contains("min_bytes 201 is larger than max_bytes 200"));
  CHECK_THROWS_AS((size_routing_resource{a, a, {.min_bytes = 1, .max_bytes = 2}}),
                  std::invalid_argument);
  CHECK_THROWS_WITH((size_routing_resource{a, a, {.min_bytes = 1, .max_bytes = 2}}),
                    Contains("the same host_resource was given as both"));
  // Different kinds of memory: host vs a (simulated) device.
  simulated_resource device;
  CHECK_THROWS_AS((size_routing_resource{a, device, {.max_bytes = 64}}), std::invalid_argument);
  CHECK_THROWS_WITH((size_routing_resource{device, a, {.max_bytes = 64}}),
                    Contains("gives device memory on device -1") &&
                        Contains("host memory on device -1"));
  // The same kind on different devices.
  form_recorder on_0{memory_kind::device, 0};
  form_recorder on_1{memory_kind::device, 1};
  CHECK_THROWS_AS((size_routing_resource{on_0, on_1, {.max_bytes = 64}}),
                  std::invalid_argument);
  // Accepted: two host_resources that compare equal but are two objects; a one-size range.
  CHECK(a == b);
  CHECK_NOTHROW((size_routing_resource{a, b, {.min_bytes = 7, .max_bytes = 7}}));
  form_recorder also_on_0{memory_kind::device, 0};
  CHECK_NOTHROW((size_routing_resource{on_0, also_on_0, {.max_bytes = 64}}));
}

TEST_CASE("size_routing: kind, device, equality, stats and the report") {
  simulated_resource sim_a{{.capacity = 1 << 20}};
  simulated_resource sim_b{{.capacity = 1 << 20}};
  size_routing_resource router{sim_a, sim_b, {.min_bytes = 100, .max_bytes = 200}};
  CHECK(router.kind() == memory_kind::device);
  CHECK(router.device() == -1);
  CHECK(router.name() == "size_routing_resource");
  CHECK(router.upstream() == nullptr);  // the report's walk ends here (see the header)
  CHECK(!router.allows_nvtx_heaps());

  // Equal: the same bounds over equal resources. Not: other bounds, another resource for
  // either side, the two swapped.
  simulated_resource sim_c{{.capacity = 1 << 20}};
  const size_routing_resource same{sim_a, sim_b, {.min_bytes = 100, .max_bytes = 200}};
  const size_routing_resource other_in{sim_c, sim_b, {.min_bytes = 100, .max_bytes = 200}};
  const size_routing_resource other_out{sim_a, sim_c, {.min_bytes = 100, .max_bytes = 200}};
  const size_routing_resource wider{sim_a, sim_b, {.min_bytes = 100, .max_bytes = 201}};
  const size_routing_resource swapped{sim_b, sim_a, {.min_bytes = 100, .max_bytes = 200}};
  CHECK(router == same);
  CHECK(router.is_equal(same));
  CHECK(!router.is_equal(wider));
  CHECK(!router.is_equal(other_in));
  CHECK(!router.is_equal(other_out));
  CHECK(!router.is_equal(swapped));
  CHECK(!router.is_equal(sim_a));
  CHECK(!sim_a.is_equal(router));

  // Stats: the two resources' figures summed; the pool-only and budget figures left empty.
  void* in = router.allocate(150);
  void* out_1 = router.allocate(1000);
  void* out_2 = router.allocate(5000, 256, stream_a);
  const resource_stats a = sim_a.stats();
  const resource_stats b = sim_b.stats();
  REQUIRE(a.used_bytes > 0);
  REQUIRE(b.used_bytes > a.used_bytes);
  const resource_stats s = router.stats();
  CHECK(s.used_bytes == a.used_bytes + b.used_bytes);
  CHECK(s.reserved_bytes == a.reserved_bytes + b.reserved_bytes);
  CHECK(s.peak_used_bytes == a.peak_used_bytes + b.peak_used_bytes);
  CHECK(!s.free_blocks);
  CHECK(!s.largest_free_block);
  CHECK(!s.budget);
  CHECK(!s.capacity);

  const memory_report report = make_memory_report(router, 150);
  REQUIRE(report.chain.size() == 1);
  CHECK(report.chain[0].name == "size_routing_resource");
  CHECK(report.chain[0].stats.used_bytes == s.used_bytes);
  CHECK_THAT(report.to_text(), Contains("size_routing_resource"));

  router.deallocate(out_2, 5000, 256, stream_a);
  router.deallocate(out_1, 1000);
  router.deallocate(in, 150);
  CHECK(sim_a.stats().used_bytes == 0);
  CHECK(sim_b.stats().used_bytes == 0);
  CHECK(router.stats().used_bytes == 0);
}

TEST_CASE("size_routing: NVTX heaps only when both resources allow them") {
  form_recorder yes_1{memory_kind::device, 0, true};
  form_recorder yes_2{memory_kind::device, 0, true};
  form_recorder no{memory_kind::device, 0, false};
  CHECK(size_routing_resource{yes_1, yes_2, {.max_bytes = 64}}.allows_nvtx_heaps());
  CHECK(!size_routing_resource{yes_1, no, {.max_bytes = 64}}.allows_nvtx_heaps());
  CHECK(!size_routing_resource{no, yes_2, {.max_bytes = 64}}.allows_nvtx_heaps());
}

TEST_CASE("size_routing: an adaptor above the router names both branches in its advice") {
  host_resource host_in;
  host_resource host_out;
  limiting_adaptor capped{host_in, 1000};
  size_routing_resource router{capped, host_out, {.min_bytes = 100, .max_bytes = 10000}};
  statistics_adaptor counted{router};
  void* kept = counted.allocate(800);
  try {
    static_cast<void>(counted.allocate(500));
    FAIL("no throw");
  } catch (const out_of_memory& e) {
    // The statistics_adaptor passes the failure on with a report from itself: its chain ends
    // at the router, and keeps the branch's verdict and cause.
    REQUIRE(e.report().chain.size() == 2);
    CHECK(e.report().chain[0].name == "statistics_adaptor");
    CHECK(e.report().chain[1].name == "size_routing_resource");
    CHECK(e.verdict() == oom_verdict::budget);
    CHECK_THAT(e.report().cause, Contains("limiting_adaptor:"));
    const std::string hint = e.report().hint();
    CHECK_THAT(hint, Contains("this request of 500 B went to in_range (limiting_adaptor, 800 B "
                              "in use of 800 B reserved, budget 1000 B)"));
    CHECK_THAT(hint, Contains("the otherwise resource (host_resource, 0 B in use"));
    CHECK_THAT(hint, Contains("raise the budget"));  // the general advice for the verdict
  }
  counted.deallocate(kept, 800);
  CHECK(host_in.stats().used_bytes == 0);
}

TEST_CASE("size_routing: a free with a size from the other range reaches the other resource") {
  // The contract requires the allocation's size at deallocate; here is what breaking it does.
  simulated_resource sim_in{{.capacity = 1 << 20}};
  simulated_resource sim_out{{.capacity = 1 << 20}};
  size_routing_resource router{sim_in, sim_out, {.min_bytes = 100, .max_bytes = 200}};
  void* p = router.allocate(150);
  {
    cudamem_test::captured_errors errors;
    router.deallocate(p, 250);  // out of range: to sim_out, which never gave p out
    REQUIRE(errors.messages().size() == 1);
    CHECK_THAT(errors.messages()[0], Contains("simulated_resource: deallocate of a pointer it "
                                              "did not give out"));
    CHECK(sim_in.stats().used_bytes > 0);  // p is still allocated where it came from
    router.deallocate(p, 150);
    CHECK(errors.messages().size() == 1);
  }
  CHECK(sim_in.stats().used_bytes == 0);
  CHECK(sim_out.stats().used_bytes == 0);
}

TEST_CASE("size_routing: two threads allocating and freeing through one router") {
  host_resource host_in;
  host_resource host_out;
  statistics_adaptor in_counted{host_in};
  statistics_adaptor out_counted{host_out};
  size_routing_resource router{in_counted, out_counted, {.min_bytes = 256, .max_bytes = 4096}};

  // Each thread cycles through sizes on both sides of both bounds, keeps a window of live
  // blocks, alternates the two forms, and writes its own mark into each block.
  constexpr std::array<std::size_t, 7> sizes{64, 255, 256, 1000, 4096, 4097, 100000};
  constexpr int rounds = 20000;
  constexpr std::size_t window = 16;
  std::atomic<int> ready{0};
  std::atomic<int> bad_marks{0};
  const auto work = [&](int thread) {
    const stream_view stream{reinterpret_cast<cudaStream_t>(std::uintptr_t{0x1000} * (thread + 1))};
    struct block {
      unsigned char* p;
      std::size_t bytes;
      bool on_stream;
    };
    std::deque<block> live;
    const auto free_oldest = [&] {
      const block b = live.front();
      live.pop_front();
      if (b.p[0] != thread || b.p[b.bytes - 1] != thread) {
        bad_marks.fetch_add(1);
      }
      if (b.on_stream) {
        router.deallocate(b.p, b.bytes, 256, stream);
      } else {
        router.deallocate(b.p, b.bytes);
      }
    };
    ready.fetch_add(1);
    while (ready.load() < 2) {
      std::this_thread::yield();
    }
    for (int i = 0; i < rounds; ++i) {
      const std::size_t bytes = sizes[static_cast<std::size_t>(i) % sizes.size()];
      const bool on_stream = (i / 7) % 2 == 0;
      auto* p = static_cast<unsigned char*>(on_stream ? router.allocate(bytes, 256, stream)
                                                      : router.allocate(bytes));
      p[0] = p[bytes - 1] = static_cast<unsigned char>(thread);
      live.push_back({p, bytes, on_stream});
      if (live.size() > window) {
        free_oldest();
      }
    }
    while (!live.empty()) {
      free_oldest();
    }
  };
  std::thread first(work, 1);
  std::thread second(work, 2);
  first.join();
  second.join();

  std::size_t in_count = 0;
  std::size_t in_bytes = 0;
  std::size_t out_count = 0;
  std::size_t out_bytes = 0;
  for (int i = 0; i < rounds; ++i) {
    const std::size_t bytes = sizes[static_cast<std::size_t>(i) % sizes.size()];
    if (bytes >= 256 && bytes <= 4096) {
      ++in_count;
      in_bytes += bytes;
    } else {
      ++out_count;
      out_bytes += bytes;
    }
  }
  CHECK(bad_marks.load() == 0);
  const allocation_counters in = in_counted.counters();
  const allocation_counters out = out_counted.counters();
  CHECK(in.allocations == 2 * in_count);
  CHECK(in.deallocations == 2 * in_count);
  CHECK(in.allocated_bytes == 2 * in_bytes);
  CHECK(in.freed_bytes == 2 * in_bytes);
  CHECK(in.current_bytes == 0);
  CHECK(out.allocations == 2 * out_count);
  CHECK(out.deallocations == 2 * out_count);
  CHECK(out.allocated_bytes == 2 * out_bytes);
  CHECK(out.freed_bytes == 2 * out_bytes);
  CHECK(out.current_bytes == 0);
  CHECK(host_in.stats().used_bytes == 0);
  CHECK(host_out.stats().used_bytes == 0);
  CHECK(host_in.stats().peak_used_bytes > 0);
  CHECK(host_out.stats().peak_used_bytes > 0);
}
