// replay: a run logged by logging_adaptor, replayed through other stacks on a simulated
// device — the counts and peaks match the log, a fragmenting stack runs out where expected
// (with the verdict), a pool does not, logged OOMs are retried, and the trace gets samples.
#include <cudamem/arena_resource.hpp>
#include <cudamem/log_format.hpp>
#include <cudamem/logging_adaptor.hpp>
#include <cudamem/out_of_memory.hpp>
#include <cudamem/pool_resource.hpp>
#include <cudamem/replay.hpp>
#include <cudamem/simulated_resource.hpp>
#include <cudamem/trace_export.hpp>

#include "mini_json.hpp"

#include <catch2/catch.hpp>

#include <set>
#include <sstream>
#include <string>
#include <vector>

using namespace cudamem;

namespace {

constexpr std::size_t MiB = std::size_t{1} << 20;
constexpr std::size_t GiB = std::size_t{1} << 30;

/// The seeds' pattern: each step of a "forward pass" allocates a large activation and a small
/// block that lives on (a cache, a log buffer); the activations are freed at the end; then one
/// big request. Logged on a roomy device, so the log is complete. Returns the log and the index
/// of the big request. On a 1 GiB first-fit device the small blocks pin the freed activations'
/// holes apart: 1000 MiB free, no hole of 512 MiB.
std::pair<std::vector<log_event>, std::size_t> logged_training_run() {
  simulated_resource roomy{{.capacity = 8 * GiB}};
  std::ostringstream out;
  {
    logging_adaptor logged{roomy, out};
    std::vector<void*> activations;
    std::vector<void*> kept;
    for (std::size_t step = 0; step < 24; ++step) {
      activations.push_back(logged.allocate(32 * MiB));
      kept.push_back(logged.allocate(MiB));
    }
    for (void* a : activations) {
      logged.deallocate(a, 32 * MiB);
    }
    void* big = logged.allocate(512 * MiB);
    logged.deallocate(big, 512 * MiB);
    for (void* k : kept) {
      logged.deallocate(k, MiB);
    }
  }
  std::istringstream in{out.str()};
  std::vector<log_event> events = read_log(in);
  std::size_t big_index = 0;
  for (std::size_t i = 0; i < events.size(); ++i) {
    if (events[i].bytes == 512 * MiB && events[i].kind == log_event_kind::allocate) {
      big_index = i;
    }
  }
  return {std::move(events), big_index};
}

}  // namespace

TEST_CASE("replay on a paged device: counts and peaks match the log") {
  const auto [events, big_index] = logged_training_run();
  REQUIRE(events.size() == 24 * 4 + 2);
  simulated_resource device{{.capacity = 80 * GiB, .layout = simulated_layout::paged}};
  const replay_result r = replay_log(events, device);
  CHECK_FALSE(r.failure);
  CHECK(r.events == events.size());
  CHECK(r.allocations == 24 * 2 + 1);
  CHECK(r.frees == 24 * 2 + 1);
  CHECK(r.unmatched_frees == 0);
  CHECK(r.peak_in_use == 24 * 33 * MiB);
  CHECK(r.peak_reserved == r.peak_in_use);  // a direct device holds exactly what is in use
  CHECK(device.used_bytes() == 0);          // everything given back
  CHECK(r.to_text().find("completed without running out") != std::string::npos);
  CHECK(r.to_text().find("peak in use:   792.00 MiB") != std::string::npos);
}

TEST_CASE("replay on a first-fit device: fragmentation stops it at the big request") {
  const auto [events, big_index] = logged_training_run();
  simulated_resource device{{.capacity = 1 * GiB}};
  const replay_result r = replay_log(events, device);
  REQUIRE(r.failure);
  CHECK(r.failure->event_index == big_index);
  CHECK(r.failure->bytes == 512 * MiB);
  CHECK(r.events == big_index + 1);
  CHECK(r.peak_in_use == 24 * 33 * MiB);
  CHECK(device.used_bytes() == 0);  // the live blocks were freed after the failure
  const std::string text = r.to_text();
  CHECK(text.find("OUT OF MEMORY at event " + std::to_string(big_index)) != std::string::npos);
  CHECK(text.find("512.00 MiB requested") != std::string::npos);
  INFO(text);
  CHECK(r.failure->verdict == oom_verdict::fragmentation);
}

TEST_CASE("replay through a pool and through an arena on the same device") {
  const auto [events, big_index] = logged_training_run();
  SECTION("pool: reserves more than it uses, gives the device back clean") {
    simulated_resource device{{.capacity = 1 * GiB}};
    {
      pool_resource pool{device};
      const replay_result r = replay_log(events, pool);
      INFO(r.to_text());
      CHECK(r.peak_reserved >= r.peak_in_use);
      CHECK(r.peak_reserved <= 1 * GiB);
      CHECK(r.allocations >= 2 * 24);
      CHECK(pool.stats().used_bytes == 0);
    }
    CHECK(device.used_bytes() == 0);
  }
  SECTION("arena: frees give nothing back and chunks double, so it runs out early") {
    simulated_resource device{{.capacity = 1 * GiB}};
    arena_resource arena{device};
    const replay_result r = replay_log(events, arena);
    REQUIRE(r.failure);
    CHECK(r.failure->event_index < big_index);
    CHECK(r.peak_reserved >= r.peak_in_use);
  }
}

TEST_CASE("logged out-of-memory events are retried; unmatched frees are skipped") {
  std::ostringstream out;
  {
    simulated_resource small{{.capacity = 256 * MiB}};
    logging_adaptor logged{small, out};
    void* a = logged.allocate(200 * MiB);
    CHECK_THROWS_AS(logged.allocate(100 * MiB), out_of_memory);  // an O line
    logged.deallocate(a, 200 * MiB);
  }
  out << "F,999999,1,sync,0x1234,64,256,\n";  // a free the replay never saw allocated
  std::istringstream in{out.str()};
  const std::vector<log_event> events = read_log(in);
  REQUIRE(events.size() == 4);

  simulated_resource larger{{.capacity = 512 * MiB}};
  const replay_result served = replay_log(events, larger);
  CHECK(served.logged_failures == 1);
  CHECK(served.logged_failures_avoided == 1);
  CHECK(served.unmatched_frees == 1);
  CHECK_FALSE(served.failure);
  CHECK(served.peak_reserved == 300 * MiB);
  CHECK(served.to_text().find("1 served by this stack") != std::string::npos);

  simulated_resource same{{.capacity = 256 * MiB}};
  const replay_result again = replay_log(events, same);
  CHECK(again.logged_failures_avoided == 0);
  CHECK_FALSE(again.failure);  // the original program survived it, so the replay goes on
  CHECK(again.events == 4);
}

TEST_CASE("replay writes per-resource counter samples and the failure to a trace") {
  const auto [events, big_index] = logged_training_run();
  simulated_resource device{{.capacity = 1 * GiB, .layout = simulated_layout::paged}};
  pool_resource pool{device};
  chrome_trace trace;
  const replay_result r = replay_log(events, pool, {.trace = &trace, .sample_every = 2});
  REQUIRE_FALSE(r.failure);
  const cudamem_test::json_value doc = cudamem_test::parse_json(trace.to_json());
  std::set<std::string> tracks;
  for (const auto& e : doc["traceEvents"].items) {
    if (e["ph"].text == "C") {
      tracks.insert(e["name"].text);
      CHECK(e["args"].has("reserved"));
    }
  }
  CHECK(tracks == std::set<std::string>{"pool_resource bytes", "simulated_resource bytes"});
  CHECK(trace.size() == 2 * ((events.size() + 1) / 2));

  simulated_resource tight{{.capacity = 1 * GiB}};
  chrome_trace failed;
  static_cast<void>(replay_log(events, tight, {.trace = &failed}));
  CHECK(failed.to_json().find("\"out of memory: simulated_resource\"") != std::string::npos);
}

TEST_CASE("an empty log replays to nothing") {
  simulated_resource device;
  const replay_result r = replay_log({}, device);
  CHECK(r.events == 0);
  CHECK(r.peak_in_use == 0);
  CHECK_FALSE(r.failure);
}
