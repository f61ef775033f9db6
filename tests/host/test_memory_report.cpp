// memory_report.hpp: every verdict, on resources whose figures the test sets.
#include <cudamem/limiting_adaptor.hpp>
#include <cudamem/memory_report.hpp>
#include <cudamem/out_of_memory.hpp>
#include <cudamem/simulated_resource.hpp>
#include <cudamem/tracking_adaptor.hpp>

#include <catch2/catch.hpp>

#include <string>
#include <vector>

using namespace cudamem;

namespace {

/// A resource that allocates nothing and reports the figures it is given.
class figures_resource final : public memory_resource {
 public:
  figures_resource(resource_stats s, memory_resource* up = nullptr)
      : memory_resource(memory_kind::device, -1), stats_(s), upstream_(up) {}

 private:
  void* do_allocate(std::size_t bytes, std::size_t alignment, stream_view) override {
    throw_out_of_memory(*this, bytes, alignment, "figures only");
  }
  void do_deallocate(void*, std::size_t, std::size_t, stream_view) noexcept override {}
  std::string_view do_name() const noexcept override { return "figures"; }
  resource_stats do_stats() const override { return stats_; }
  memory_resource* do_upstream() const noexcept override { return upstream_; }
  resource_stats stats_;
  memory_resource* upstream_;
};

constexpr std::size_t GiB = std::size_t{1} << 30;

resource_stats leaf(std::size_t capacity, std::size_t reserved) {
  resource_stats s;
  s.capacity = capacity;
  s.reserved_bytes = s.used_bytes = reserved;
  return s;
}

}  // namespace

TEST_CASE("verdict: larger than the device") {
  figures_resource device{leaf(80 * GiB, 0)};
  const memory_report r = make_memory_report(device, 100 * GiB);
  CHECK(r.verdict == oom_verdict::larger_than_device);
  CHECK(*r.device_total == 80 * GiB);
  CHECK(r.to_text().find("100.00 GiB") != std::string::npos);
  CHECK(r.to_text().find("split the work") != std::string::npos);
}

TEST_CASE("verdict: exhausted by this chain") {
  figures_resource device{leaf(80 * GiB, 79 * GiB)};
  CHECK(make_memory_report(device, 2 * GiB).verdict == oom_verdict::exhausted);
}

TEST_CASE("verdict: fragmentation inside a pool") {
  figures_resource device{leaf(80 * GiB, 80 * GiB)};
  resource_stats pool;
  pool.reserved_bytes = 80 * GiB;
  pool.used_bytes = 70 * GiB;
  pool.free_blocks = 10;
  pool.largest_free_block = 1 * GiB;
  figures_resource top{pool, &device};
  const memory_report r = make_memory_report(top, 2 * GiB);
  CHECK(r.verdict == oom_verdict::fragmentation);
  REQUIRE(r.chain.size() == 2);
  CHECK(r.chain[0].stats.fragmentation() == Approx(0.9));
  CHECK(r.to_text().find("fragmentation 90%") != std::string::npos);
  CHECK(r.to_text().find("vm_pool_resource") != std::string::npos);  // the general advice
}

TEST_CASE("verdict: budget") {
  figures_resource device{leaf(80 * GiB, 1 * GiB)};
  resource_stats limit;
  limit.reserved_bytes = limit.used_bytes = 1 * GiB;
  limit.budget = 2 * GiB;
  figures_resource top{limit, &device};
  const memory_report r = make_memory_report(top, 2 * GiB);
  CHECK(r.verdict == oom_verdict::budget);
  CHECK(r.to_text().find("budget 2.00 GiB") != std::string::npos);
}

TEST_CASE("verdict: unknown without device figures") {
  figures_resource nothing{resource_stats{}};
  CHECK(make_memory_report(nothing, 1024).verdict == oom_verdict::unknown);
}

TEST_CASE("out_of_memory carries the report and is a bad_alloc") {
  figures_resource device{leaf(8 * GiB, 7 * GiB)};
  try {
    static_cast<void>(device.allocate(2 * GiB, 512));
    FAIL("no throw");
  } catch (const std::bad_alloc& e) {
    const auto* oom = dynamic_cast<const out_of_memory*>(&e);
    REQUIRE(oom != nullptr);
    CHECK(oom->report().requested_bytes == 2 * GiB);
    CHECK(oom->report().alignment == 512);
    CHECK(oom->report().cause == "figures only");
    CHECK(std::string(e.what()) == oom->report().to_text());
  }
}

TEST_CASE("a discarded report: the scope's resource's own failures carry only their cause") {
  figures_resource a{leaf(GiB, 0)};
  figures_resource b{leaf(GiB, 0)};
  const auto chain_of = [](memory_resource& r) {
    try {
      static_cast<void>(r.allocate(3 * GiB));
    } catch (const out_of_memory& e) {
      CHECK(e.requested_bytes() == 3 * GiB);
      CHECK(e.report().cause == "figures only");
      CHECK_THAT(std::string(e.what()), Catch::Contains("figures only"));
      return e.report().chain.size();
    }
    FAIL("expected out_of_memory");
    return std::size_t{99};
  };
  CHECK(chain_of(a) == 1);
  {
    const detail::discarded_report_scope outer{a};
    CHECK(chain_of(a) == 0);  // no chain: nothing was asked of the resources
    CHECK(chain_of(b) == 1);  // another resource reports as always
    {
      const detail::discarded_report_scope inner{b};
      CHECK(chain_of(b) == 0);
      CHECK(chain_of(a) == 1);
    }
    CHECK(chain_of(a) == 0);  // the inner scope restored the outer one
  }
  CHECK(chain_of(a) == 1);
}

TEST_CASE("to_json is one object with the chain and escapes text") {
  figures_resource device{leaf(8 * GiB, 7 * GiB)};
  const memory_report r = make_memory_report(device, 2 * GiB, 256, "a \"quoted\" cause");
  const std::string json = r.to_json();
  CHECK(json.front() == '{');
  CHECK(json.back() == '}');
  CHECK(json.find("\"requested_bytes\":2147483648") != std::string::npos);
  CHECK(json.find("\"verdict\":\"exhausted\"") != std::string::npos);
  CHECK(json.find("a \\\"quoted\\\" cause") != std::string::npos);
  CHECK(json.find("\"chain\":[{\"name\":\"figures\"") != std::string::npos);
}

TEST_CASE("format_bytes uses binary units") {
  CHECK(format_bytes(0) == "0 B");
  CHECK(format_bytes(1023) == "1023 B");
  CHECK(format_bytes(1536) == "1.50 KiB");
  CHECK(format_bytes(GiB) == "1.00 GiB");
}

// --- added with the adaptors: the numbers behind each verdict, others' memory, real chains ---

namespace {
bool has(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}
}  // namespace

TEST_CASE("verdict: held by other processes or contexts") {
  resource_stats device = leaf(80 * GiB, 10 * GiB);
  device.held_elsewhere = 69 * GiB;  // e.g. another process on the same GPU
  figures_resource gpu{device};
  const memory_report r = make_memory_report(gpu, 2 * GiB);
  CHECK(r.verdict == oom_verdict::held_by_others);
  CHECK(*r.device_free == 1 * GiB);
  CHECK(r.held_by_chain() == 10 * GiB);
  CHECK(r.held_by_others() == 69 * GiB);
  const std::string text = r.to_text();
  CHECK(has(text, "this chain holds 10.00 GiB, others (processes, contexts, other resources) "
                  "hold 69.00 GiB"));
  CHECK(has(text, "69.00 GiB of the device is held outside this chain"));
  CHECK(has(text, "nvidia-smi"));
  CHECK(has(r.to_json(), "\"held_by_others\":" + std::to_string(69 * GiB)));
}

TEST_CASE("exhausted when this chain holds more than the others") {
  resource_stats device = leaf(80 * GiB, 70 * GiB);
  device.held_elsewhere = 9 * GiB;
  figures_resource gpu{device};
  const memory_report r = make_memory_report(gpu, 2 * GiB);
  CHECK(r.verdict == oom_verdict::exhausted);
  CHECK(has(r.to_text(), "This chain holds 70.00 GiB of the device's 80.00 GiB."));
  CHECK(has(r.to_text(), "free buffers"));
}

TEST_CASE("verdict: fragmentation of the device itself") {
  resource_stats device = leaf(80 * GiB, 60 * GiB);
  device.largest_free_block = 512ull << 20;  // 20 GiB free, in pieces of at most 512 MiB
  figures_resource gpu{device};
  const memory_report r = make_memory_report(gpu, 1 * GiB);
  CHECK(r.verdict == oom_verdict::fragmentation);
  CHECK(has(r.to_text(), "figures has 20.00 GiB free in total, but its largest free block is "
                         "512.00 MiB."));
}

TEST_CASE("each verdict has its own hint and explanation") {
  std::vector<std::string> hints;
  for (const oom_verdict v : {oom_verdict::unknown, oom_verdict::budget,
                              oom_verdict::larger_than_device, oom_verdict::fragmentation,
                              oom_verdict::held_by_others, oom_verdict::exhausted}) {
    memory_report r;
    r.verdict = v;
    r.requested_bytes = 1;
    CHECK_FALSE(r.hint().empty());
    CHECK_FALSE(r.explanation().empty());
    for (const std::string& other : hints) {
      CHECK(other != r.hint());
    }
    hints.push_back(r.hint());
  }
}

TEST_CASE("a real chain: limiting over simulated, the budget explained in human units") {
  simulated_resource device{{.capacity = 8 * GiB}};
  limiting_adaptor capped{device, 3 * GiB};
  tracking_adaptor tracked{capped};
  void* p = tracked.allocate(2 * GiB);
  try {
    static_cast<void>(tracked.allocate(1536ull << 20));
    FAIL("no throw");
  } catch (const out_of_memory& e) {
    const memory_report& r = e.report();
    CHECK(r.verdict == oom_verdict::budget);
    REQUIRE(r.chain.size() == 3);
    CHECK(r.chain[0].name == "tracking_adaptor");
    CHECK(r.chain[1].name == "limiting_adaptor");
    CHECK(*r.device_total == 8 * GiB);
    CHECK(*r.device_free == 6 * GiB);
    CHECK(has(e.what(), "could not allocate 1.50 GiB"));
    CHECK(has(e.what(), "limiting_adaptor has 2.00 GiB in use; 1.50 GiB more would pass its "
                        "budget of 3.00 GiB."));
    CHECK(has(e.what(), "raise its budget with set_budget()"));  // the limiting adaptor's own
    CHECK(e.report().origin == 1);  // the limiting adaptor failed first, below the tracking
  }
  tracked.deallocate(p, 2 * GiB);
}

TEST_CASE("a real chain: larger than the simulated device") {
  simulated_resource device{{.capacity = 4 * GiB}};
  tracking_adaptor tracked{device};
  try {
    static_cast<void>(tracked.allocate(5 * GiB));
    FAIL("no throw");
  } catch (const out_of_memory& e) {
    CHECK(e.verdict() == oom_verdict::larger_than_device);
    CHECK(has(e.what(), "larger than the device's 4.00 GiB"));
  }
  CHECK(tracked.live_count() == 0);
}
