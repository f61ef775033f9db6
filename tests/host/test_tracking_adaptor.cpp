// tracking_adaptor: the record, leak reports naming the user's line, the three bad frees
// (never forwarded), many threads, and a seed-style program that leaks under an exception.
#include <cudamem/host_resource.hpp>
#include <cudamem/out_of_memory.hpp>
#include <cudamem/statistics_adaptor.hpp>
#include <cudamem/tracking_adaptor.hpp>

#include "captured_errors.hpp"
#include "phased_threads.hpp"

#include <catch2/catch.hpp>

#include <algorithm>
#include <atomic>
#include <bit>
#include <cstdint>
#include <chrono>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

using namespace cudamem;
using cudamem_test::captured_errors;

namespace {

/// Counts what reaches it, so a test can see that a bad free was not forwarded.
class counting_resource final : public memory_resource {
 public:
  counting_resource() : memory_resource(memory_kind::host, -1) {}
  std::size_t frees = 0;
  std::size_t allocations = 0;
  std::size_t fail_above = SIZE_MAX;

 private:
  void* do_allocate(std::size_t bytes, std::size_t alignment, stream_view) override {
    return do_allocate_sync(bytes, alignment);
  }
  void do_deallocate(void* p, std::size_t bytes, std::size_t alignment,
                     stream_view) noexcept override {
    do_deallocate_sync(p, bytes, alignment);
  }
  void* do_allocate_sync(std::size_t bytes, std::size_t alignment) override {
    if (bytes > fail_above) {
      throw_out_of_memory(*this, bytes, alignment, "test limit");
    }
    ++allocations;
    return host_.allocate(bytes, alignment);
  }
  void do_deallocate_sync(void* p, std::size_t bytes, std::size_t alignment) noexcept override {
    ++frees;
    host_.deallocate(p, bytes, alignment);
  }
  std::string_view do_name() const noexcept override { return "counting"; }
  host_resource host_;
};

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

}  // namespace

TEST_CASE("tracking records pointer, bytes, alignment, stream, site, thread") {
  host_resource host;
  tracking_adaptor tracked{host};
  const unsigned line = __LINE__ + 1;
  void* p = tracked.allocate(1000, 64);
  void* q = tracked.allocate(24, 8, stream_view{reinterpret_cast<cudaStream_t>(0x10)});
  REQUIRE(tracked.live_count() == 2);
  const auto record = tracked.find(p);
  REQUIRE(record);
  CHECK(record->pointer == p);
  CHECK(record->bytes == 1000);
  CHECK(record->alignment == 64);
  CHECK_FALSE(record->stream.has_value());
  CHECK(record->site.line() == line);
  CHECK(contains(record->site.file_name(), "test_tracking_adaptor.cpp"));
  CHECK(record->thread == std::this_thread::get_id());
  CHECK(tracked.find(q)->stream == reinterpret_cast<cudaStream_t>(0x10));
  CHECK(tracked.find(q)->sequence == record->sequence + 1);
  CHECK(tracked.stats().used_bytes == 1024);
  CHECK(tracked.upstream() == &host);
  CHECK(tracked.kind() == memory_kind::host);

  const leak_report leaks = tracked.leaks();
  REQUIRE(leaks.leaks.size() == 2);
  CHECK(leaks.leaks[0].pointer == p);  // oldest first
  CHECK(leaks.total_bytes == 1024);
  CHECK(contains(leaks.to_text(), "2 live allocations (1.00 KiB)"));
  CHECK(contains(leaks.to_text(), "test_tracking_adaptor.cpp:" + std::to_string(line)));

  tracked.deallocate(p, 1000, 64);
  tracked.deallocate(q, 24, 8, stream_view{reinterpret_cast<cudaStream_t>(0x10)});
  CHECK(tracked.live_count() == 0);
  CHECK(tracked.leaks().empty());
  CHECK(host.stats().used_bytes == 0);
  CHECK(tracked.stats().peak_used_bytes == 1024);
}

TEST_CASE("a leak is reported at destruction with the user's file and line, never thrown") {
  host_resource host;
  captured_errors errors;
  void* leaked = nullptr;
  unsigned line = 0;
  {
    tracking_adaptor tracked{host};
    line = __LINE__ + 1;
    leaked = tracked.allocate(3 << 20);
  }
  REQUIRE(errors.messages().size() == 1);
  const std::string& message = errors.messages()[0];
  CHECK(contains(message, "leak: 3.00 MiB"));
  CHECK(contains(message, "test_tracking_adaptor.cpp:" + std::to_string(line)));
  CHECK(host.stats().used_bytes == 3 << 20);  // left alone: it may still be in use
  host.deallocate(leaked, 3 << 20);
}

TEST_CASE("bad frees are reported and never reach the upstream") {
  counting_resource counting;
  captured_errors errors;
  tracking_adaptor tracked{counting};
  const unsigned line = __LINE__ + 1;
  void* p = tracked.allocate(512, 256);

  SECTION("a pointer it never gave out") {
    int local = 0;
    tracked.deallocate(&local, 4, 4);
    CHECK(counting.frees == 0);
    REQUIRE(errors.messages().size() == 1);
    CHECK(contains(errors.messages()[0], "never gave out"));
    tracked.deallocate(p, 512, 256);
  }
  SECTION("a double free names where it was allocated") {
    tracked.deallocate(p, 512, 256);
    tracked.deallocate(p, 512, 256);
    CHECK(counting.frees == 1);
    REQUIRE(errors.messages().size() == 1);
    CHECK(contains(errors.messages()[0], "double free"));
    CHECK(contains(errors.messages()[0], "test_tracking_adaptor.cpp:" + std::to_string(line)));
  }
  SECTION("a size mismatch keeps the allocation live, a correct free then works") {
    tracked.deallocate(p, 1024, 256);
    tracked.deallocate(p, 512, 128);
    CHECK(counting.frees == 0);
    REQUIRE(errors.messages().size() == 2);
    CHECK(contains(errors.messages()[0], "size mismatch"));
    CHECK(contains(errors.messages()[0], "deallocate(1024 bytes"));
    CHECK(contains(errors.messages()[1], "alignment 128"));
    CHECK(tracked.live_count() == 1);
    tracked.deallocate(p, 512, 256);
    CHECK(counting.frees == 1);
  }
  CHECK(tracked.bad_frees() >= 1);
  CHECK(tracked.live_count() == 0);
}

TEST_CASE("a reused address is live again, not a double free") {
  host_resource host;
  captured_errors errors;
  tracking_adaptor tracked{host};
  // Allocate and free the same size until the allocator hands back an address it freed.
  void* first = tracked.allocate(64);
  tracked.deallocate(first, 64);
  void* again = nullptr;
  std::vector<void*> others;
  for (int i = 0; i < 64 && again != first; ++i) {
    again = tracked.allocate(64);
    if (again != first) {
      others.push_back(again);
    }
  }
  if (again == first) {
    tracked.deallocate(again, 64);
  }
  for (void* p : others) {
    tracked.deallocate(p, 64);
  }
  CHECK(errors.messages().empty());
  CHECK(tracked.live_count() == 0);
}

TEST_CASE("zero bytes, null, bad alignment and upstream failures") {
  counting_resource counting;
  counting.fail_above = 1 << 20;
  captured_errors errors;
  tracking_adaptor tracked{counting};
  CHECK(tracked.allocate(0) == nullptr);
  tracked.deallocate(nullptr, 8);
  CHECK_THROWS_AS(tracked.allocate(8, 3), std::invalid_argument);
  try {
    static_cast<void>(tracked.allocate(2 << 20));
    FAIL("no throw");
  } catch (const out_of_memory& e) {
    // The report starts at the adaptor and keeps the upstream's cause.
    REQUIRE(e.report().chain.size() == 2);
    CHECK(e.report().chain[0].name == "tracking_adaptor");
    CHECK(e.report().cause == "test limit");
  }
  CHECK(tracked.live_count() == 0);
  CHECK(errors.messages().empty());
  CHECK(counting.allocations == 0);
}

TEST_CASE("many threads at once, with a bad free among them") {
  host_resource host;
  captured_errors errors;
  tracking_adaptor tracked{host};
  constexpr int threads = 8;
  constexpr int rounds = 2000;
  std::vector<std::thread> workers;
  for (int t = 0; t < threads; ++t) {
    workers.emplace_back([&tracked, t] {
      std::vector<std::pair<void*, std::size_t>> mine;
      for (int i = 0; i < rounds; ++i) {
        const std::size_t bytes = 16 + static_cast<std::size_t>((i * 37 + t) % 500);
        mine.emplace_back(tracked.allocate(bytes, 16), bytes);
        if (i % 3 == 2) {
          tracked.deallocate(mine.front().first, mine.front().second, 16);
          mine.erase(mine.begin());
        }
      }
      for (auto [p, bytes] : mine) {
        tracked.deallocate(p, bytes, 16);
      }
    });
  }
  for (auto& w : workers) {
    w.join();
  }
  CHECK(tracked.live_count() == 0);
  CHECK(host.stats().used_bytes == 0);
  CHECK(errors.messages().empty());
  CHECK(tracked.bad_frees() == 0);
}

// --- a seed-style program: allocations in a loop, an exception, one buffer leaked --------------

namespace {

/// What seed programs do: a raw allocation that only a happy path frees.
struct raw_buffer_user {
  memory_resource& mr;
  unsigned leak_line = 0;

  void step(int i) {
    leak_line = __LINE__ + 1;
    void* scratch = mr.allocate(1 << 16);
    if (i == 7) {
      throw std::runtime_error("step 7 failed");  // skips the free below: a leak
    }
    mr.deallocate(scratch, 1 << 16);
  }
};

/// An RAII owner that forwards its caller's line, like device_buffer does.
class owned_bytes {
 public:
  owned_bytes(std::size_t bytes, memory_resource& mr,
              std::source_location where = std::source_location::current())
      : mr_(&mr), bytes_(bytes), p_(mr.allocate(bytes, default_alignment, where)) {}
  ~owned_bytes() { mr_->deallocate(p_, bytes_); }
  owned_bytes(const owned_bytes&) = delete;
  owned_bytes& operator=(const owned_bytes&) = delete;

 private:
  memory_resource* mr_;
  std::size_t bytes_;
  void* p_;
};

}  // namespace

TEST_CASE("seed program: the leaked allocation is named by file and line") {
  host_resource host;
  captured_errors errors;
  unsigned leak_line = 0;
  void* leaked = nullptr;
  {
    tracking_adaptor tracked{host};
    raw_buffer_user user{tracked};
    try {
      for (int i = 0; i < 10; ++i) {
        const owned_bytes per_step(4096, tracked);  // freed by RAII even when step throws
        user.step(i);
      }
    } catch (const std::runtime_error&) {
    }
    leak_line = user.leak_line;
    {
      const unsigned owner_line = __LINE__ + 1;
      const owned_bytes kept(100, tracked);
      const leak_report leaks = tracked.leaks();
      REQUIRE(leaks.leaks.size() == 2);
      CHECK(leaks.leaks[0].site.line() == leak_line);
      CHECK(leaks.leaks[1].site.line() == owner_line);  // the user's line, not owned_bytes'
      CHECK(contains(leaks.to_text(), "test_tracking_adaptor.cpp:" + std::to_string(owner_line)));
      leaked = leaks.leaks[0].pointer;
    }
  }
  // Only the raw allocation skipped by the exception is left when the adaptor goes.
  REQUIRE(errors.messages().size() == 1);
  CHECK(contains(errors.messages()[0], "test_tracking_adaptor.cpp:" + std::to_string(leak_line)));
  CHECK(contains(errors.messages()[0], "64.00 KiB"));
  CHECK(host.stats().used_bytes == 1 << 16);
  host.deallocate(leaked, 1 << 16);
}

// --- the record's own structure: growth, removal in any order, recent frees, threads ---------

TEST_CASE("thousands of live allocations, freed in a scattered order, stay exactly tracked") {
  host_resource host;
  captured_errors errors;
  tracking_adaptor tracked{host};
  constexpr std::size_t count = 5000;  // grows every shard's table and record store many times
  std::vector<std::pair<void*, std::size_t>> live;
  for (std::size_t i = 0; i < count; ++i) {
    const std::size_t bytes = 8 + i % 97;
    live.emplace_back(tracked.allocate(bytes, 8), bytes);
  }
  CHECK(tracked.live_count() == count);
  CHECK(tracked.leaks().leaks.size() == count);
  // Free every third one, then check that each remaining one is still found with its size.
  std::vector<std::pair<void*, std::size_t>> kept;
  for (std::size_t i = 0; i < live.size(); ++i) {
    if (i % 3 == 1) {
      tracked.deallocate(live[i].first, live[i].second, 8);
    } else {
      kept.push_back(live[i]);
    }
  }
  REQUIRE(tracked.live_count() == kept.size());
  std::size_t found = 0;
  for (const auto& [p, bytes] : kept) {
    const auto record = tracked.find(p);
    found += record && record->bytes == bytes && record->alignment == 8 ? 1 : 0;
  }
  CHECK(found == kept.size());
  const leak_report leaks = tracked.leaks();
  REQUIRE(leaks.leaks.size() == kept.size());
  CHECK(std::is_sorted(leaks.leaks.begin(), leaks.leaks.end(),
                       [](const allocation_record& a, const allocation_record& b) {
                         return a.sequence < b.sequence;
                       }));
  // Free the rest from the back, and the table is empty again.
  for (auto it = kept.rbegin(); it != kept.rend(); ++it) {
    tracked.deallocate(it->first, it->second, 8);
  }
  CHECK(tracked.live_count() == 0);
  CHECK(tracked.stats().used_bytes == 0);
  CHECK(host.stats().used_bytes == 0);
  CHECK(errors.messages().empty());
}

TEST_CASE("a double free long after the free is still not forwarded") {
  counting_resource counting;
  captured_errors errors;
  tracking_adaptor tracked{counting};
  void* p = tracked.allocate(64);
  tracked.deallocate(p, 64);
  // Many frees later (more than the record remembers), the stale pointer is reported as one
  // never given out; either way the upstream never sees the second free.
  std::vector<void*> others;
  for (std::size_t i = 0; i < 2 * tracking_adaptor::remembered_frees; ++i) {
    others.push_back(tracked.allocate(64));
  }
  const bool reused = std::find(others.begin(), others.end(), p) != others.end();
  for (void* q : others) {
    tracked.deallocate(q, 64);
  }
  const std::size_t frees_before = counting.frees;
  tracked.deallocate(p, 64);
  if (reused) {  // p was live again and freed again: this one is a double free
    REQUIRE(errors.messages().size() == 1);
  } else {
    REQUIRE(errors.messages().size() == 1);
    CHECK((contains(errors.messages()[0], "double free") ||
           contains(errors.messages()[0], "never gave out")));
  }
  CHECK(counting.frees == frees_before);
  CHECK(tracked.bad_frees() == 1);
}

TEST_CASE("a double free names the allocation's line even with other frees in between") {
  host_resource host;
  captured_errors errors;
  tracking_adaptor tracked{host, {.timestamps = true}};
  const unsigned line = __LINE__ + 1;
  void* p = tracked.allocate(128);
  std::vector<void*> others;
  for (int i = 0; i < 20; ++i) {
    others.push_back(tracked.allocate(128));
  }
  tracked.deallocate(p, 128);
  for (void* q : others) {
    tracked.deallocate(q, 128);
  }
  tracked.deallocate(p, 128);
  REQUIRE(errors.messages().size() == 1);
  CHECK(contains(errors.messages()[0], "double free"));
  CHECK(contains(errors.messages()[0], "test_tracking_adaptor.cpp:" + std::to_string(line)));
  CHECK(contains(errors.messages()[0], "ms after the adaptor was made"));  // timestamps on
}

TEST_CASE("timestamps: off by default, on request increasing from the adaptor's start") {
  host_resource host;
  tracking_adaptor plain{host};
  void* a = plain.allocate(16);
  CHECK_FALSE(plain.find(a)->time.has_value());
  CHECK(plain.find(a)->to_text().find("ms after") == std::string::npos);
  plain.deallocate(a, 16);

  tracking_adaptor timed{host, {.timestamps = true}};
  void* first = timed.allocate(16);
  std::this_thread::sleep_for(std::chrono::milliseconds(2));
  void* second = timed.allocate(16);
  const auto t1 = timed.find(first)->time;
  const auto t2 = timed.find(second)->time;
  REQUIRE(t1.has_value());
  REQUIRE(t2.has_value());
  CHECK(*t2 - *t1 >= std::chrono::milliseconds(1));
  CHECK(*t2 < std::chrono::seconds(60));
  timed.deallocate(first, 16);
  timed.deallocate(second, 16);
}

TEST_CASE("freed on another thread than the one that allocated") {
  host_resource host;
  captured_errors errors;
  tracking_adaptor tracked{host};
  constexpr int pairs = 4;
  constexpr int rounds = 3000;
  // Producers allocate, consumers free what the producer beside them made.
  std::vector<std::vector<void*>> handed(pairs);
  std::vector<std::thread> producers;
  for (int t = 0; t < pairs; ++t) {
    producers.emplace_back([&, t] {
      for (int i = 0; i < rounds; ++i) {
        handed[static_cast<std::size_t>(t)].push_back(tracked.allocate(32 + t, 16));
      }
    });
  }
  for (auto& p : producers) {
    p.join();
  }
  CHECK(tracked.live_count() == pairs * rounds);
  std::vector<std::thread> consumers;
  for (int t = 0; t < pairs; ++t) {
    consumers.emplace_back([&, t] {
      for (void* p : handed[static_cast<std::size_t>(t)]) {
        tracked.deallocate(p, 32 + t, 16);
      }
    });
  }
  for (auto& c : consumers) {
    c.join();
  }
  CHECK(tracked.live_count() == 0);
  CHECK(tracked.stats().used_bytes == 0);
  CHECK(tracked.stats().peak_used_bytes == std::size_t{rounds} * (32 + 33 + 34 + 35));
  CHECK(errors.messages().empty());
}

TEST_CASE("one thread owns the record without locks; a second thread arriving loses nothing") {
  for (int round = 0; round < 10; ++round) {
    host_resource host;
    captured_errors errors;
    tracking_adaptor tracked{host};
    CHECK_FALSE(tracked.owned_by_one_thread());  // nobody has used it yet
    void* first = tracked.allocate(64);
    CHECK(tracked.owned_by_one_thread() == detail::asymmetric_fence_available());

    // The owner (this thread) keeps a window of live allocations moving, while a second
    // thread joins in at a different moment each round: its requests and leak reports revoke
    // the owner's bias in the middle of the owner's work.
    std::atomic<int> owner_progress{0};
    std::atomic<std::size_t> newcomer_live_seen{0};
    std::thread newcomer([&] {
      while (owner_progress.load() < round * 300) {
        std::this_thread::yield();
      }
      for (int i = 0; i < 2000; ++i) {
        void* p = tracked.allocate(48, 16);
        if (i % 100 == 0) {
          newcomer_live_seen.store(std::max(newcomer_live_seen.load(), tracked.leaks().leaks.size()));
        }
        tracked.deallocate(p, 48, 16);
      }
    });
    std::vector<void*> window;
    std::size_t window_bytes = 0;
    for (int i = 0; i < 6000; ++i) {
      const std::size_t bytes = 32 + static_cast<std::size_t>(i % 7) * 16;
      window.push_back(tracked.allocate(bytes));
      window_bytes += bytes;
      if (window.size() > 40) {  // free the oldest: entries leave from all over the table
        const std::size_t oldest_bytes = 32 + static_cast<std::size_t>((i - 40) % 7) * 16;
        tracked.deallocate(window.front(), oldest_bytes);
        window_bytes -= oldest_bytes;
        window.erase(window.begin());
      }
      owner_progress.store(i);
    }
    newcomer.join();
    CHECK_FALSE(tracked.owned_by_one_thread());  // revoked for good
    // Exactly the owner's window and `first` are live; every record is found; no bad free.
    CHECK(tracked.live_count() == window.size() + 1);
    CHECK(tracked.stats().used_bytes == window_bytes + 64);
    for (void* p : window) {
      CHECK(tracked.find(p).has_value());
    }
    CHECK(newcomer_live_seen.load() >= 1);
    CHECK(tracked.bad_frees() == 0);
    CHECK(errors.messages().empty());
    for (std::size_t k = 0; k < window.size(); ++k) {
      const int i = 6000 - static_cast<int>(window.size()) + static_cast<int>(k);
      tracked.deallocate(window[k], 32 + static_cast<std::size_t>(i % 7) * 16);
    }
    tracked.deallocate(first, 64);
    CHECK(tracked.live_count() == 0);
    CHECK(host.stats().used_bytes == 0);
  }
}

namespace {

/// Hands out the same address twice without a free in between: an upstream bug the tracking
/// adaptor must report without losing either allocation's bookkeeping.
class repeating_resource final : public memory_resource {
 public:
  repeating_resource() : memory_resource(memory_kind::host, -1) {}
  alignas(256) unsigned char storage[256]{};

 private:
  void* do_allocate(std::size_t, std::size_t, stream_view) override { return storage; }
  void do_deallocate(void*, std::size_t, std::size_t, stream_view) noexcept override {}
  void* do_allocate_sync(std::size_t, std::size_t) override { return storage; }
  void do_deallocate_sync(void*, std::size_t, std::size_t) noexcept override {}
  std::string_view do_name() const noexcept override { return "repeating"; }
};

}  // namespace

TEST_CASE("an upstream that returns a live pointer again is reported, the newer one tracked") {
  repeating_resource repeating;
  captured_errors errors;
  tracking_adaptor tracked{repeating};
  void* a = tracked.allocate(100);
  void* b = tracked.allocate(200);
  REQUIRE(a == b);
  REQUIRE(errors.messages().size() == 1);
  CHECK(contains(errors.messages()[0], "still live"));
  CHECK(tracked.live_count() == 1);
  CHECK(tracked.find(a)->bytes == 200);
  CHECK(tracked.stats().used_bytes == 200);
  tracked.deallocate(b, 200);
  CHECK(tracked.live_count() == 0);
  CHECK(tracked.stats().used_bytes == 0);
}

TEST_CASE("tracking under other adaptors still names the user's line") {
  host_resource host;
  captured_errors errors;
  tracking_adaptor tracked{host};
  statistics_adaptor counted{tracked};  // the user talks to the statistics adaptor on top
  const unsigned line = __LINE__ + 1;
  void* p = counted.allocate(256, 64);
  const auto record = tracked.find(p);
  REQUIRE(record);
  CHECK(record->site.line() == line);
  CHECK(contains(record->site.file_name(), "test_tracking_adaptor.cpp"));
  CHECK_THROWS_AS(counted.allocate(8, 12), std::invalid_argument);  // checked at the top
  counted.deallocate(p, 256, 64);
  CHECK(tracked.live_count() == 0);
  CHECK(counted.counters().allocations == 1);
  CHECK(errors.messages().empty());
}

TEST_CASE("bytes in use and the peak are exact for one thread") {
  // A rolling pair (allocate the next, free the previous) of varied sizes spreads over many
  // shards of the record: a peak made of each shard's own most would overshoot.
  host_resource host;
  tracking_adaptor tracked{host};
  void* previous = nullptr;
  std::size_t previous_bytes = 0;
  std::size_t expected_peak = 0;
  for (std::size_t i = 0; i < 400; ++i) {
    const std::size_t bytes = 1000 + 16 * (i % 37);
    void* p = tracked.allocate(bytes, 16);
    expected_peak = std::max(expected_peak, bytes + previous_bytes);  // no stats() in the
                                                                       // loop: it sums too
    if (previous != nullptr) {
      tracked.deallocate(previous, previous_bytes, 16);
    }
    previous = p;
    previous_bytes = bytes;
  }
  CHECK(tracked.stats().peak_used_bytes == expected_peak);
  tracked.deallocate(previous, previous_bytes, 16);
  CHECK(tracked.stats().used_bytes == 0);

  // A build-up past the old peak, without stats() in between, is seen by the shards alone.
  std::vector<void*> built;
  for (int i = 0; i < 100; ++i) {
    built.push_back(tracked.allocate(4096, 16));
  }
  for (void* p : built) {
    tracked.deallocate(p, 4096, 16);
  }
  CHECK(tracked.stats().used_bytes == 0);
  CHECK(tracked.stats().peak_used_bytes == 100 * 4096);
}

TEST_CASE("racing threads: bytes in use exact, the peak within its bound") {
  // See phased_threads.hpp: the sum of each shard's most is far above the true peak, so the
  // shared mark must hold the peak down (small slacks), or, with a slack no shard moves by,
  // the activations' mark must hold it up (large slacks). Light blocks are freed by another
  // thread than the one that made them: each such free finds its record in another shard.
  for (const std::size_t slack : {std::size_t{0}, std::size_t{1} << 10, std::size_t{64} << 10,
                                  std::size_t{1} << 20, tracking_options{}.peak_slack}) {
    CAPTURE(slack);
    host_resource host;
    captured_errors errors;
    tracking_adaptor tracked{host, {.peak_slack = slack}};
    const std::size_t truth = cudamem_test::run_phases(tracked);
    const resource_stats s = tracked.stats();
    CHECK(s.used_bytes == 0);
    CHECK(tracked.live_count() == 0);
    CHECK(s.peak_used_bytes >= truth);
    CHECK(s.peak_used_bytes <= truth + tracked.peak_error_bound());
    CHECK(tracked.peak_error_bound() <= 7 * slack);  // at most 4 shards (threads may share)
    CHECK(tracked.bad_frees() == 0);
    CHECK(errors.messages().empty());
    CHECK(host.stats().used_bytes == 0);
  }
}

TEST_CASE("frees from another thread: found, and bad ones told apart") {
  host_resource host;
  captured_errors errors;
  tracking_adaptor tracked{host};
  std::vector<void*> made;
  unsigned line = 0;
  std::thread maker([&] {
    for (int i = 0; i < 200; ++i) {
      line = __LINE__ + 1;
      made.push_back(tracked.allocate(96, 32));
    }
  });
  maker.join();
  // This thread frees what the other made: not in its own shard, found in the maker's (the
  // first through every shard, the rest through the hint the first left).
  for (void* p : made) {
    tracked.deallocate(p, 96, 32);
  }
  CHECK(tracked.live_count() == 0);
  CHECK(tracked.stats().used_bytes == 0);
  CHECK(errors.messages().empty());
  CHECK(host.stats().used_bytes == 0);

  // A second free of a recent one, from a third thread: a double free, named by its line
  // (each shard remembers its last 64 frees).
  std::thread again([&] { tracked.deallocate(made[195], 96, 32); });
  again.join();
  REQUIRE(errors.messages().size() == 1);
  CHECK(contains(errors.messages()[0], "double free"));
  CHECK(contains(errors.messages()[0], ":" + std::to_string(line)));
  CHECK(host.stats().used_bytes == 0);  // not forwarded

  // A size mismatch on a record in another thread's shard keeps it live.
  void* kept = nullptr;
  std::thread maker2([&] { kept = tracked.allocate(500, 16); });
  maker2.join();
  tracked.deallocate(kept, 400, 16);
  REQUIRE(errors.messages().size() == 2);
  CHECK(contains(errors.messages()[1], "size mismatch"));
  CHECK(tracked.find(kept).has_value());
  tracked.deallocate(kept, 500, 16);
  CHECK(tracked.live_count() == 0);

  // A pointer no thread was given.
  int local = 0;
  tracked.deallocate(&local, 4, 4);
  REQUIRE(errors.messages().size() == 3);
  CHECK(contains(errors.messages()[2], "never gave out"));
  CHECK(tracked.bad_frees() == 3);
}

TEST_CASE("leaks are oldest first within each thread") {
  host_resource host;
  tracking_adaptor tracked{host};
  constexpr int threads = 3;
  constexpr int per_thread = 50;
  std::vector<std::vector<void*>> made(threads);
  std::vector<std::thread::id> ids(threads);
  std::vector<std::thread> workers;
  for (int t = 0; t < threads; ++t) {
    workers.emplace_back([&, t] {
      ids[static_cast<std::size_t>(t)] = std::this_thread::get_id();
      for (int i = 0; i < per_thread; ++i) {
        made[static_cast<std::size_t>(t)].push_back(tracked.allocate(64 + 8 * t, 8));
      }
    });
  }
  for (auto& w : workers) {
    w.join();
  }
  const leak_report report = tracked.leaks();
  REQUIRE(report.leaks.size() == threads * per_thread);
  for (int t = 0; t < threads; ++t) {
    std::vector<void*> seen;
    for (const allocation_record& r : report.leaks) {
      if (r.thread == ids[static_cast<std::size_t>(t)]) {
        seen.push_back(r.pointer);
      }
    }
    CHECK(seen == made[static_cast<std::size_t>(t)]);  // in the order this thread made them
  }
  for (int t = 0; t < threads; ++t) {
    for (void* p : made[static_cast<std::size_t>(t)]) {
      tracked.deallocate(p, 64 + 8 * static_cast<std::size_t>(t), 8);
    }
  }
  CHECK(tracked.live_count() == 0);
}
