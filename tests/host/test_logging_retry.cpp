// logging_adaptor + log_format (lines, round trip, failures, threads) and retry_adaptor.
#include <cudamem/host_resource.hpp>
#include <cudamem/limiting_adaptor.hpp>
#include <cudamem/log_format.hpp>
#include <cudamem/logging_adaptor.hpp>
#include <cudamem/out_of_memory.hpp>
#include <cudamem/retry_adaptor.hpp>

#include "captured_errors.hpp"

#include <catch2/catch.hpp>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <map>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

using namespace cudamem;
using cudamem_test::captured_errors;

TEST_CASE("log lines round-trip exactly") {
  log_event e;
  e.kind = log_event_kind::free;
  e.t_ns = 18446744073709551615ull;
  e.thread = 4294967295u;
  e.stream = 0xdeadbeefcafeull;
  e.pointer = 0xffffffffffffffffull;
  e.bytes = 123456789;
  e.alignment = 4096;
  e.reserved = 99;
  const std::string line = to_log_line(e);
  CHECK(line.back() == '\n');
  CHECK(line.size() <= max_log_line);
  CHECK(parse_log_line(line) == e);
  e.synchronous = true;
  e.stream = 0;
  e.reserved.reset();
  e.kind = log_event_kind::out_of_memory;
  CHECK(to_log_line(e) ==
        "O,18446744073709551615,4294967295,sync,0xffffffffffffffff,123456789,4096,\n");
  CHECK(parse_log_line(to_log_line(e)) == e);
}

TEST_CASE("the reader skips comments and the header, and names a bad line") {
  std::istringstream good{std::string(log_header) +
                          "\nA,1,1,0x0,0x10,8,8,\n# note\nF,2,1,0x0,0x10,8,8,\r\n"};
  const std::vector<log_event> events = read_log(good);
  REQUIRE(events.size() == 2);
  CHECK(events[1].kind == log_event_kind::free);
  CHECK(events[1].t_ns == 2);

  for (const char* bad : {"X,1,1,0x0,0x10,8,8,", "A,1,1,0x0,0x10,8,8", "A,1,1,0x0,0x10,8,8,,",
                          "A,-1,1,0x0,0x10,8,8,", "A,1,1,zz,0x10,8,8,", "A,1,1,0x0,16,8,8,",
                          "A,1,1,0x0,0x10,8 ,8,", "A,1,1,0x0,0x10,,8,"}) {
    std::istringstream in{std::string("A,1,1,0x0,0x10,8,8,\n") + bad + "\n"};
    try {
      static_cast<void>(read_log(in));
      FAIL("accepted " << bad);
    } catch (const std::runtime_error& error) {
      CHECK(std::string(error.what()).find("line 2") != std::string::npos);
    }
  }
}

TEST_CASE("logging: allocations, frees and a failure as lines") {
  host_resource host;
  limiting_adaptor capped{host, 1 << 20};
  std::ostringstream out;
  {
    logging_adaptor logged{capped, out, logging_options{.sample_reserved = true}};
    void* a = logged.allocate(1000, 64);
    void* b = logged.allocate(24, 8, stream_view{reinterpret_cast<cudaStream_t>(0xabc)});
    CHECK_THROWS_AS(logged.allocate(2 << 20), out_of_memory);
    logged.deallocate(b, 24, 8, stream_view{reinterpret_cast<cudaStream_t>(0xabc)});
    logged.deallocate(a, 1000, 64);
    CHECK(logged.events() == 5);
    CHECK(logged.stats().peak_used_bytes == 1024);
    CHECK(logged.stats().used_bytes == 0);
  }
  CHECK(out.str().starts_with(log_header));
  std::istringstream in{out.str()};
  const std::vector<log_event> e = read_log(in);
  REQUIRE(e.size() == 5);
  CHECK(e[0].kind == log_event_kind::allocate);
  CHECK(e[0].synchronous);
  CHECK(e[0].bytes == 1000);
  CHECK(e[0].alignment == 64);
  CHECK(e[0].thread == 1);
  CHECK(e[0].reserved == 1000u);  // host_resource, the leaf, holds exactly what it gave
  CHECK(e[1].stream == 0xabc);
  CHECK_FALSE(e[1].synchronous);
  CHECK(e[2].kind == log_event_kind::out_of_memory);
  CHECK(e[2].pointer == 0);
  CHECK(e[2].bytes == 2 << 20);
  CHECK(e[3].kind == log_event_kind::free);
  CHECK(e[3].pointer == e[1].pointer);
  CHECK(e[4].pointer == e[0].pointer);
  for (std::size_t i = 1; i < e.size(); ++i) {
    CHECK(e[i].t_ns >= e[i - 1].t_ns);
  }
}

TEST_CASE("logging: many threads write whole lines in a replayable order") {
  host_resource host;
  std::ostringstream out;
  {
    logging_adaptor logged{host, out};
    std::vector<std::thread> workers;
    for (int t = 0; t < 6; ++t) {
      workers.emplace_back([&logged] {
        for (int i = 0; i < 2000; ++i) {
          void* p = logged.allocate(32 + static_cast<std::size_t>(i % 7) * 16, 16);
          logged.deallocate(p, 32 + static_cast<std::size_t>(i % 7) * 16, 16);
        }
      });
    }
    for (auto& w : workers) {
      w.join();
    }
  }
  std::istringstream in{out.str()};
  const std::vector<log_event> events = read_log(in);
  REQUIRE(events.size() == 6 * 2000 * 2);
  // Replaying in file order: every free matches a live allocation, no address is live twice.
  std::map<std::uint64_t, std::size_t> live;
  std::uint32_t highest_thread = 0;
  for (const log_event& e : events) {
    highest_thread = std::max(highest_thread, e.thread);
    if (e.kind == log_event_kind::allocate) {
      CHECK(live.emplace(e.pointer, e.bytes).second);
    } else {
      const auto it = live.find(e.pointer);
      REQUIRE(it != live.end());
      CHECK(it->second == e.bytes);
      live.erase(it);
    }
  }
  CHECK(live.empty());
  CHECK(highest_thread == 6);
}

TEST_CASE("logging: a failing stream is reported once and never breaks allocation") {
  host_resource host;
  captured_errors errors;
  std::ostringstream out;
  logging_adaptor logged{host, out};
  out.setstate(std::ios::badbit);
  for (int i = 0; i < 3; ++i) {
    void* p = logged.allocate(64);
    logged.deallocate(p, 64);
  }
  CHECK(errors.messages().size() == 1);
  CHECK(host.stats().used_bytes == 0);
}

TEST_CASE("logging: a file that cannot be opened throws from the constructor") {
  host_resource host;
  CHECK_THROWS_AS(logging_adaptor(host, std::string("/nonexistent-dir/x/run.log")),
                  std::runtime_error);
}

// --- retry_adaptor -------------------------------------------------------------------------------

TEST_CASE("retry: the callback frees a cache and the request succeeds") {
  host_resource host;
  limiting_adaptor capped{host, 1000};
  void* cache = capped.allocate(800);
  int calls = 0;
  retry_adaptor mr{capped, [&](const out_of_memory& e) {
                     ++calls;
                     CHECK(e.requested_bytes() == 500);
                     if (cache == nullptr) {
                       return false;
                     }
                     capped.deallocate(cache, 800);
                     cache = nullptr;
                     return true;
                   }};
  void* p = mr.allocate(500);
  CHECK(calls == 1);
  CHECK(mr.retries() == 1);
  CHECK(mr.recoveries() == 1);
  CHECK(mr.stats().used_bytes == 500);
  mr.deallocate(p, 500);
  CHECK(capped.used_bytes() == 0);
}

TEST_CASE("retry: bounded, and stops when the callback frees nothing") {
  host_resource host;
  limiting_adaptor capped{host, 100};
  int calls = 0;
  SECTION("the callback keeps saying yes: max_retries + 1 calls, then the error") {
    retry_adaptor mr{capped, [&](const out_of_memory&) { return ++calls, true; }, 2};
    CHECK_THROWS_AS(mr.allocate(200), out_of_memory);
    CHECK(calls == 3);
    CHECK(mr.retries() == 2);
    CHECK(mr.recoveries() == 0);
  }
  SECTION("the callback says no: one call, the budget verdict comes through") {
    retry_adaptor mr{capped, [&](const out_of_memory&) { return ++calls, false; }};
    try {
      static_cast<void>(mr.allocate(200));
      FAIL("no throw");
    } catch (const out_of_memory& e) {
      CHECK(e.verdict() == oom_verdict::budget);
      CHECK(e.report().chain[0].name == "retry_adaptor");
    }
    CHECK(calls == 1);
  }
  SECTION("zero retries still calls the callback once") {
    retry_adaptor mr{capped, [&](const out_of_memory&) { return ++calls, true; }, 0};
    CHECK_THROWS_AS(mr.allocate(200), out_of_memory);
    CHECK(calls == 1);
  }
  SECTION("a throwing callback's exception passes through") {
    retry_adaptor mr{capped, [&](const out_of_memory&) -> bool { throw std::logic_error("cb"); }};
    CHECK_THROWS_AS(mr.allocate(200), std::logic_error);
  }
  CHECK(capped.used_bytes() == 0);
}

TEST_CASE("retry: bad arguments") {
  host_resource host;
  CHECK_THROWS_AS(retry_adaptor(host, retry_adaptor::callback{}), std::invalid_argument);
  retry_adaptor mr{host, [](const out_of_memory&) { return false; }, -5};
  CHECK(mr.max_retries() == 0);
  CHECK(mr.allocate(0) == nullptr);
  CHECK_THROWS_AS(mr.allocate(8, 6), std::invalid_argument);
}

TEST_CASE("retry: many threads share one callback") {
  host_resource host;
  limiting_adaptor capped{host, 64 * 4};
  std::atomic<int> calls{0};
  retry_adaptor mr{capped, [&](const out_of_memory&) {
                     calls.fetch_add(1);
                     std::this_thread::sleep_for(std::chrono::microseconds(20));  // others free
                     return true;
                   },
                   100000};
  std::vector<std::thread> workers;
  for (int t = 0; t < 8; ++t) {
    workers.emplace_back([&mr] {
      for (int i = 0; i < 500; ++i) {
        void* p = mr.allocate(64);
        mr.deallocate(p, 64);
      }
    });
  }
  for (auto& w : workers) {
    w.join();
  }
  CHECK(capped.used_bytes() == 0);
  CHECK(mr.stats().used_bytes == 0);
  CHECK(static_cast<std::size_t>(calls.load()) == mr.retries());
}
