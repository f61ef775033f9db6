// Advice that fits: every out-of-memory hint is written for the resource that failed and the
// verdict (memory_report.hpp's contract). Real chains over simulated devices, run to each
// verdict; then every host resource kind asked about every verdict directly.
#include <cudamem/arena_resource.hpp>
#include <cudamem/detail/vm/mapping.hpp>
#include <cudamem/detail/vm/simulated_mapping.hpp>
#include <cudamem/failing_adaptor.hpp>
#include <cudamem/host_resource.hpp>
#include <cudamem/limiting_adaptor.hpp>
#include <cudamem/logging_adaptor.hpp>
#include <cudamem/memory_report.hpp>
#include <cudamem/out_of_memory.hpp>
#include <cudamem/pool_resource.hpp>
#include <cudamem/retry_adaptor.hpp>
#include <cudamem/simulated_resource.hpp>
#include <cudamem/statistics_adaptor.hpp>
#include <cudamem/tracking_adaptor.hpp>
#include <cudamem/vm_pool_resource.hpp>
#include <cudamem/vm_resource.hpp>

#include "captured_errors.hpp"

#include <catch2/catch.hpp>

#include <functional>
#include <limits>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

using namespace cudamem;

namespace {

constexpr std::size_t MiB = std::size_t{1} << 20;
constexpr std::size_t GiB = std::size_t{1} << 30;

bool has(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

/// The report of the out_of_memory `request` throws (FAILs if it does not throw).
memory_report failure_of(const std::function<void()>& request) {
  try {
    request();
  } catch (const out_of_memory& e) {
    return e.report();
  }
  FAIL("expected out_of_memory");
  return {};
}

/// Blocks of `bytes` from `mr` until it says no; returns them.
std::vector<void*> fill(memory_resource& mr, std::size_t bytes) {
  std::vector<void*> blocks;
  try {
    for (;;) {
      blocks.push_back(mr.allocate(bytes));
    }
  } catch (const out_of_memory&) {
  }
  return blocks;
}

/// Frees every other block (the 1st, 3rd...) and returns the rest.
std::vector<void*> free_every_other(memory_resource& mr, const std::vector<void*>& blocks,
                                    std::size_t bytes) {
  std::vector<void*> kept;
  for (std::size_t i = 0; i < blocks.size(); ++i) {
    if (i % 2 == 0) {
      mr.deallocate(blocks[i], bytes);
    } else {
      kept.push_back(blocks[i]);
    }
  }
  return kept;
}

void free_all(memory_resource& mr, const std::vector<void*>& blocks, std::size_t bytes) {
  for (void* p : blocks) {
    mr.deallocate(p, bytes);
  }
}

/// A vm_pool over a simulated device of `capacity` bytes.
std::unique_ptr<vm_pool_resource> simulated_vm_pool(std::size_t capacity,
                                                    vm_pool_options options = {}) {
  return std::make_unique<vm_pool_resource>(
      std::make_unique<detail::simulated_vm_mapping>(
          detail::simulated_vm_options{.capacity = capacity, .granularity = 2 * MiB}),
      std::move(options));
}

}  // namespace

// --- real chains, run to each verdict ---------------------------------------------------------

TEST_CASE("pool_resource: fragmentation advice, the pool's general one") {
  simulated_resource device{{.capacity = 256 * MiB, .layout = simulated_layout::paged}};
  pool_resource pool{device};
  const std::vector<void*> kept = free_every_other(pool, fill(pool, 2 * MiB), 2 * MiB);
  const memory_report r = failure_of([&] { static_cast<void>(pool.allocate(8 * MiB)); });
  CHECK(r.verdict == oom_verdict::fragmentation);
  CHECK(r.origin == 0);
  CHECK(r.resource_hint.empty());  // pool_resource has no advice of its own (yet)
  CHECK(has(r.hint(), "vm_pool_resource"));
  CHECK(has(r.hint(), "pool_resource has 128.00 MiB free, in blocks of at most 2.00 MiB"));
  CHECK(has(r.hint(), "Free long-lived blocks"));
  free_all(pool, kept, 2 * MiB);
}

TEST_CASE("a capped pool's fragmentation is the pool's, not the device's below it") {
  // (examples/explain_oom.cu on a simulated first-fit device.) The device has plenty free and
  // its own layout fragments too, but it is the pool that failed: the advice is about it.
  simulated_resource device{{.capacity = 8 * GiB}};  // first fit
  pool_resource pool{device, {.maximum_size = 1 * GiB, .growth_step = 256 * MiB}};
  const std::vector<void*> kept = free_every_other(pool, fill(pool, 64 * MiB), 64 * MiB);
  const memory_report r = failure_of([&] { static_cast<void>(pool.allocate(128 * MiB)); });
  CHECK(r.verdict == oom_verdict::fragmentation);
  CHECK(r.verdict_subject() == 0u);
  CHECK(has(r.hint(), "pool_resource has 512.00 MiB free, in blocks of at most 64.00 MiB"));
  CHECK_FALSE(has(r.hint(), "first fit"));
  free_all(pool, kept, 64 * MiB);
}

TEST_CASE("pool_resource: exhausted, and larger than the device") {
  simulated_resource device{{.capacity = 256 * MiB, .layout = simulated_layout::paged}};
  pool_resource pool{device};
  void* most = pool.allocate(200 * MiB);
  memory_report r = failure_of([&] { static_cast<void>(pool.allocate(100 * MiB)); });
  CHECK(r.verdict == oom_verdict::exhausted);
  CHECK(has(r.hint(), "free buffers you no longer need"));
  r = failure_of([&] { static_cast<void>(pool.allocate(1 * GiB)); });
  CHECK(r.verdict == oom_verdict::larger_than_device);
  CHECK(has(r.hint(), "split the work"));
  pool.deallocate(most, 200 * MiB);
}

TEST_CASE("vm_pool_resource: its fragmentation advice is its own, never 'use a vm_pool'") {
  auto pool = simulated_vm_pool(512 * MiB);
  const std::vector<void*> kept = free_every_other(*pool, fill(*pool, 2 * MiB), 2 * MiB);
  const memory_report r = failure_of([&] { static_cast<void>(pool->allocate(8 * MiB)); });
  CHECK(r.verdict == oom_verdict::fragmentation);
  REQUIRE(r.chain.size() == 2);
  CHECK(r.chain[0].name == "vm_pool_resource");
  const std::string hint = r.hint();
  CHECK_FALSE(r.resource_hint.empty());
  CHECK(has(hint, "This vm_pool_resource has"));
  CHECK(has(hint, "release() returns wholly free handles to the driver"));
  CHECK(has(hint, "cannot move live blocks"));
  CHECK(has(hint, "vm_pool_options::handle_bytes"));
  CHECK(has(hint, "64.00 MiB handles"));
  CHECK_FALSE(has(hint, "use vm_pool_resource"));
  CHECK_FALSE(has(r.to_text(), "use vm_pool_resource"));
  free_all(*pool, kept, 2 * MiB);
}

TEST_CASE("vm_pool_resource: over its physical limit, the advice names the limit") {
  vm_pool_options limited;
  limited.physical_limit = 128 * MiB;
  auto pool = simulated_vm_pool(1 * GiB, limited);
  void* a = pool->allocate(100 * MiB);
  const memory_report r = failure_of([&] { static_cast<void>(pool->allocate(100 * MiB)); });
  CHECK(r.verdict == oom_verdict::budget);
  CHECK(has(r.hint(), "may map at most 128.00 MiB (vm_pool_options::physical_limit)"));
  CHECK_FALSE(has(r.hint(), "set_budget"));
  pool->deallocate(a, 100 * MiB);
}

TEST_CASE("limiting_adaptor: the budget named, under other adaptors too") {
  simulated_resource device{{.capacity = 8 * GiB}};
  limiting_adaptor capped{device, 1 * GiB};
  tracking_adaptor tracked{capped};
  void* a = tracked.allocate(700 * MiB);
  const memory_report r = failure_of([&] { static_cast<void>(tracked.allocate(400 * MiB)); });
  CHECK(r.verdict == oom_verdict::budget);
  CHECK(r.origin == 1);  // the limiting adaptor failed first; the tracking adaptor passed it on
  CHECK(has(r.hint(), "This limiting_adaptor allows 1.00 GiB and has 700.00 MiB in use"));
  CHECK(has(r.hint(), "set_budget()"));
  tracked.deallocate(a, 700 * MiB);
}

TEST_CASE("limiting_adaptor over an exhausted device: not its budget, not its advice") {
  simulated_resource device{{.capacity = 256 * MiB, .layout = simulated_layout::paged}};
  limiting_adaptor capped{device, 1 * GiB};
  void* a = capped.allocate(200 * MiB);
  const memory_report r = failure_of([&] { static_cast<void>(capped.allocate(100 * MiB)); });
  CHECK(r.verdict == oom_verdict::exhausted);
  CHECK(r.resource_hint.empty());
  CHECK(has(r.hint(), "free buffers you no longer need"));
  capped.deallocate(a, 200 * MiB);
}

TEST_CASE("tracking_adaptor: when the chain holds the memory, it counts what is live") {
  simulated_resource device{{.capacity = 256 * MiB, .layout = simulated_layout::paged}};
  pool_resource pool{device};
  tracking_adaptor tracked{pool};
  std::vector<void*> blocks;
  for (int i = 0; i < 3; ++i) {
    blocks.push_back(tracked.allocate(64 * MiB));
  }
  const memory_report r = failure_of([&] { static_cast<void>(tracked.allocate(100 * MiB)); });
  CHECK(r.verdict == oom_verdict::exhausted);
  CHECK(has(r.hint(), "the tracking_adaptor has 3 live allocations (192.00 MiB); leaks() lists "
                      "them"));
  free_all(tracked, blocks, 64 * MiB);
}

TEST_CASE("arena_resource: chunks kept after a rewind are named, and rewind/release advised") {
  simulated_resource device{{.capacity = 256 * MiB, .layout = simulated_layout::paged}};
  pool_resource pool{device};
  arena_resource arena{pool, {.initial_chunk_size = 64 * MiB, .growth_factor = 1.0}};
  {
    arena_scope step{arena};
    static_cast<void>(arena.allocate(60 * MiB));
    static_cast<void>(arena.allocate(60 * MiB));  // a second chunk, 128 MiB
  }
  void* other = pool.allocate(100 * MiB);  // the rest of the device, outside the arena
  const memory_report r = failure_of([&] { static_cast<void>(arena.allocate(100 * MiB)); });
  REQUIRE(r.chain.size() == 3);
  CHECK(r.chain[0].name == "arena_resource");  // the arena passes the pool's failure on
  CHECK(has(r.cause, "arena_resource asked it for a chunk of"));
  CHECK(has(r.hint(), "This arena_resource holds 128.00 MiB in 2 chunks, of which 0 B were "
                      "handed out since the last rewind"));
  CHECK(has(r.hint(), "rewind()"));
  pool.deallocate(other, 100 * MiB);
}

TEST_CASE("failing_adaptor: an injected failure says nothing ran out, whatever is above it") {
  // The device is nearly full and the tracking adaptor on top holds a live allocation: on the
  // figures the verdict is `exhausted`, which the tracking adaptor would advise on. The
  // resource that failed first speaks first.
  simulated_resource device{{.capacity = 256 * MiB, .layout = simulated_layout::paged}};
  pool_resource pool{device};
  failing_adaptor faults{pool};
  tracking_adaptor tracked{faults};
  void* most = tracked.allocate(200 * MiB);
  faults.fail_call(1);
  const memory_report r = failure_of([&] { static_cast<void>(tracked.allocate(100 * MiB)); });
  CHECK(r.verdict == oom_verdict::exhausted);
  CHECK(r.origin == 1);
  CHECK(has(r.hint(), "Nothing ran out: failing_adaptor failed this request on purpose"));
  CHECK(has(r.hint(), "allocate call 1"));
  tracked.deallocate(most, 200 * MiB);
}

TEST_CASE("host_resource: the operating system's refusal") {
  host_resource host;
  const memory_report r = failure_of([&] {
    static_cast<void>(host.allocate(std::numeric_limits<std::size_t>::max() / 2));
  });
  CHECK(r.verdict == oom_verdict::unknown);
  CHECK(has(r.hint(), "The operating system refused"));
}

TEST_CASE("simulated_resource: first fit fragments, and says why") {
  simulated_resource device{{.capacity = 256 * MiB}};  // first fit
  std::vector<void*> blocks = fill(device, 16 * MiB);
  const std::vector<void*> kept = free_every_other(device, blocks, 16 * MiB);
  const memory_report r = failure_of([&] { static_cast<void>(device.allocate(32 * MiB)); });
  CHECK(r.verdict == oom_verdict::fragmentation);
  CHECK(has(r.hint(), "first fit (simulated_layout::first_fit)"));
  free_all(device, kept, 16 * MiB);

  simulated_resource paged{{.capacity = 256 * MiB, .layout = simulated_layout::paged}};
  void* a = paged.allocate(200 * MiB);
  const memory_report full = failure_of([&] { static_cast<void>(paged.allocate(100 * MiB)); });
  CHECK(full.verdict == oom_verdict::exhausted);
  CHECK(full.resource_hint.empty());  // nothing of its own to add
  paged.deallocate(a, 200 * MiB);
}

// --- every host resource kind, asked about every verdict --------------------------------------

namespace {

const std::vector<oom_verdict> all_verdicts = {
    oom_verdict::unknown,       oom_verdict::budget,         oom_verdict::larger_than_device,
    oom_verdict::fragmentation, oom_verdict::held_by_others, oom_verdict::exhausted};

/// A report with `verdict` about a request of 100 MiB, its chain made of `resource` and its
/// upstreams as they are now (so figures are the resource's own).
memory_report report_about(const memory_resource& resource, oom_verdict verdict,
                           std::string cause = "test") {
  memory_report r = make_memory_report(resource, 100 * MiB, default_alignment, std::move(cause));
  r.verdict = verdict;
  return r;
}

}  // namespace

TEST_CASE("each resource kind answers only for the verdicts it can advise on") {
  simulated_resource device{{.capacity = 256 * MiB}};
  simulated_resource paged{{.capacity = 256 * MiB, .layout = simulated_layout::paged}};
  pool_resource pool{paged};
  host_resource host;
  limiting_adaptor capped{paged, 150 * MiB};
  void* in_budget = capped.allocate(100 * MiB);  // 100 in use + 100 asked > 150
  tracking_adaptor tracked{pool};
  void* live = tracked.allocate(1 * MiB);
  statistics_adaptor counted{pool};
  std::ostringstream log;
  logging_adaptor logged{pool, log};
  retry_adaptor retried{pool, [](const out_of_memory&) { return false; }};
  failing_adaptor faults{pool};
  arena_resource arena{pool, {.initial_chunk_size = 4 * MiB}};
  {
    arena_scope scratch{arena};
    static_cast<void>(arena.allocate(1 * MiB));
  }
  vm_pool_options limited;
  limited.physical_limit = 150 * MiB;
  auto vm_pool = simulated_vm_pool(512 * MiB, limited);
  void* mapped = vm_pool->allocate(100 * MiB);

  struct expectation {
    const memory_resource* resource;
    oom_verdict verdict;
    const char* says;  // nullptr: nothing of its own (the general advice stands)
  };
  // Everything not listed here must be empty.
  const std::vector<expectation> expected = {
      {&capped, oom_verdict::budget, "This limiting_adaptor allows 150.00 MiB"},
      {&tracked, oom_verdict::exhausted, "the tracking_adaptor has 1 live allocation"},
      {&faults, oom_verdict::unknown, "on purpose"},
      {&faults, oom_verdict::budget, "on purpose"},
      {&faults, oom_verdict::larger_than_device, "on purpose"},
      {&faults, oom_verdict::fragmentation, "on purpose"},
      {&faults, oom_verdict::held_by_others, "on purpose"},
      {&faults, oom_verdict::exhausted, "on purpose"},
      {&arena, oom_verdict::fragmentation, "This arena_resource holds 4.00 MiB"},
      {&arena, oom_verdict::held_by_others, "This arena_resource holds 4.00 MiB"},
      {&arena, oom_verdict::exhausted, "This arena_resource holds 4.00 MiB"},
      {&host, oom_verdict::unknown, "The operating system refused 100.00 MiB"},
      {&device, oom_verdict::fragmentation, "first fit"},
      {vm_pool.get(), oom_verdict::budget, "may map at most 150.00 MiB"},
      {vm_pool.get(), oom_verdict::fragmentation, "This vm_pool_resource has"},
  };
  const std::vector<const memory_resource*> kinds = {
      &device, &paged, &pool, &host, &capped, &tracked, &counted,
      &logged, &retried, &faults, &arena, vm_pool.get(), &vm_pool->upstream_vm()};
  for (const memory_resource* resource : kinds) {
    for (const oom_verdict verdict : all_verdicts) {
      CAPTURE(resource->name(), to_string(verdict));
      const bool injected = resource == &faults;
      const memory_report r = report_about(
          *resource, verdict, injected ? "failure injected by failing_adaptor on allocate call 7" : "test");
      const std::string advice = resource->oom_hint(r, 0);
      const char* says = nullptr;
      for (const expectation& e : expected) {
        if (e.resource == resource && e.verdict == verdict) {
          says = e.says;
        }
      }
      if (says == nullptr) {
        CHECK(advice.empty());
      } else {
        CHECK(has(advice, says));
      }
      // Whatever the verdict, the full hint never tells a resource to become what it is.
      if (resource == vm_pool.get() || resource == &vm_pool->upstream_vm()) {
        CHECK_FALSE(has(r.hint(), "use vm_pool_resource"));
      }
      CHECK_FALSE(r.hint().empty());
    }
  }
  // A failing_adaptor passing on a real failure from below has nothing to add.
  CHECK(faults.oom_hint(report_about(faults, oom_verdict::exhausted, "pool_resource: full"), 0)
            .empty());
  vm_pool->deallocate(mapped, 100 * MiB);
  tracked.deallocate(live, 1 * MiB);
  capped.deallocate(in_budget, 100 * MiB);
}

TEST_CASE("a resource that throws while advising leaves the report whole") {
  class grumpy final : public memory_resource {
   public:
    grumpy() : memory_resource(memory_kind::host, -1) {}

   private:
    void* do_allocate(std::size_t, std::size_t, stream_view) override { return nullptr; }
    void do_deallocate(void*, std::size_t, std::size_t, stream_view) noexcept override {}
    std::string do_oom_hint(const memory_report&, std::size_t) const override {
      throw std::runtime_error("no advice today");
    }
  };
  grumpy g;
  const memory_report r = make_memory_report(g, 1024);
  CHECK(r.resource_hint.empty());
  CHECK(r.hint() == r.general_hint());
}
