// memory_report.hpp: every verdict, on resources whose figures the test sets.
#include <cudamem/memory_report.hpp>
#include <cudamem/out_of_memory.hpp>

#include <catch2/catch.hpp>

#include <string>

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
  CHECK(r.to_text().find("release()") != std::string::npos);
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
