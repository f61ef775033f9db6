// statistics_adaptor (counters, nested scopes, threads) and limiting_adaptor (budget, verdict,
// exactness under threads), over host memory.
#include <cudamem/host_resource.hpp>
#include <cudamem/limiting_adaptor.hpp>
#include <cudamem/memory_report.hpp>  // the whole report: what() is its text
#include <cudamem/out_of_memory.hpp>
#include <cudamem/statistics_adaptor.hpp>

#include "phased_threads.hpp"

#include <catch2/catch.hpp>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

using namespace cudamem;

TEST_CASE("statistics: current, peak, totals and counts") {
  host_resource host;
  statistics_adaptor counted{host};
  void* a = counted.allocate(100);
  void* b = counted.allocate(300, 64, stream_view{});
  counted.deallocate(a, 100);
  void* c = counted.allocate(50);
  allocation_counters now = counted.counters();
  CHECK(now.current_bytes == 350);
  CHECK(now.peak_bytes == 400);
  CHECK(now.allocated_bytes == 450);
  CHECK(now.freed_bytes == 100);
  CHECK(now.allocations == 3);
  CHECK(now.deallocations == 1);
  CHECK(now.live_allocations() == 2);
  CHECK(counted.stats().used_bytes == 350);
  CHECK(counted.stats().peak_used_bytes == 400);
  counted.deallocate(b, 300, 64, stream_view{});
  counted.deallocate(c, 50);
  now = counted.counters();
  CHECK(now.current_bytes == 0);
  CHECK(now.live_allocations() == 0);
  CHECK(host.stats().used_bytes == 0);
}

TEST_CASE("statistics: bad input and failures count nothing") {
  host_resource host;
  statistics_adaptor counted{host};
  CHECK(counted.allocate(0) == nullptr);
  counted.deallocate(nullptr, 10);
  CHECK_THROWS_AS(counted.allocate(10, 48), std::invalid_argument);
  CHECK_THROWS_AS(counted.allocate(SIZE_MAX / 2), out_of_memory);
  CHECK(counted.counters().allocations == 0);
  CHECK(counted.counters().deallocations == 0);
}

TEST_CASE("statistics: nested scopes see their own phase") {
  host_resource host;
  statistics_adaptor counted{host};
  void* before = counted.allocate(1000);
  statistics_adaptor::scope outer{counted};
  void* x = counted.allocate(200);
  allocation_counters inner_result;
  {
    statistics_adaptor::scope inner{counted};
    void* y = counted.allocate(500);
    counted.deallocate(y, 500);
    void* z = counted.allocate(100);
    counted.deallocate(z, 100);
    inner_result = inner.counters();
  }
  counted.deallocate(x, 200);
  const allocation_counters o = outer.counters();
  CHECK(inner_result.allocated_bytes == 600);
  CHECK(inner_result.allocations == 2);
  CHECK(inner_result.deallocations == 2);
  CHECK(inner_result.peak_bytes == 500);  // above the 1200 in use when it opened
  CHECK(inner_result.current_bytes == 0);
  CHECK(o.allocated_bytes == 800);
  CHECK(o.allocations == 3);
  CHECK(o.peak_bytes == 700);  // x and y together, above the 1000 before
  CHECK(o.current_bytes == 0);
  CHECK(o.live_allocations() == 0);
  counted.deallocate(before, 1000);
  CHECK(counted.counters().peak_bytes == 1700);
}

TEST_CASE("statistics: a scope opened below an earlier peak sees its own") {
  host_resource host;
  statistics_adaptor counted{host};
  void* big = counted.allocate(5000);
  counted.deallocate(big, 5000);
  void* kept = counted.allocate(100);
  statistics_adaptor::scope phase{counted};  // opens at 100 in use, far below the peak
  void* a = counted.allocate(300);
  void* b = counted.allocate(200);
  counted.deallocate(a, 300);
  CHECK(phase.counters().peak_bytes == 500);  // a and b together
  CHECK(phase.counters().current_bytes == 200);
  counted.deallocate(b, 200);
  counted.deallocate(kept, 100);
  CHECK(counted.counters().peak_bytes == 5000);
}

namespace {

/// A thread that runs what it is given, one job at a time, and waits for each: two of them
/// take turns, so their requests never overlap, and each keeps its own counter slot.
class turn_taker {
 public:
  turn_taker() : thread_([this] { serve(); }) {}
  ~turn_taker() {
    run(nullptr);
    thread_.join();
  }
  turn_taker(const turn_taker&) = delete;
  turn_taker& operator=(const turn_taker&) = delete;

  /// Runs `job` on this thread and returns when it is done (nullptr: stop).
  void run(std::function<void()> job) {
    std::unique_lock lock(mutex_);
    job_ = std::move(job);
    pending_ = true;
    changed_.notify_all();
    changed_.wait(lock, [this] { return !pending_; });
  }

 private:
  void serve() {
    for (;;) {
      std::unique_lock lock(mutex_);
      changed_.wait(lock, [this] { return pending_; });
      if (!job_) {
        pending_ = false;
        changed_.notify_all();
        return;
      }
      job_();
      pending_ = false;
      changed_.notify_all();
    }
  }

  std::mutex mutex_;
  std::condition_variable changed_;
  std::function<void()> job_;
  bool pending_ = false;
  std::thread thread_;  // last: starts once the members above exist
};

}  // namespace

namespace {

/// Two threads taking turns (their requests never overlap), frees across threads too; runs
/// the script on `counted` and returns the counters at the end. The true peak is 1700.
allocation_counters take_turns(statistics_adaptor& counted) {
  turn_taker a;
  turn_taker b;
  void* a1 = nullptr;
  void* b1 = nullptr;
  void* a2 = nullptr;
  void* b2 = nullptr;
  a.run([&] { a1 = counted.allocate(1000); });
  CHECK(counted.peak_error_bound() == 0);  // one thread so far: exact
  a.run([&] { counted.deallocate(a1, 1000); });  // a is now below the most it held
  b.run([&] { b1 = counted.allocate(500); });
  CHECK(counted.counters().peak_bytes >= 1000);
  // The total passes the peak through a thread that is below its own most: must be seen.
  a.run([&] { a2 = counted.allocate(800); });
  CHECK(counted.counters().peak_bytes >= 1300);
  // b frees what a allocated: b's balance goes negative, and a new peak comes from b.
  b.run([&] {
    counted.deallocate(a2, 800);
    b2 = counted.allocate(1200);
  });
  CHECK(counted.counters().current_bytes == 1700);
  CHECK(counted.counters().peak_bytes >= 1700);
  a.run([&] { counted.deallocate(b1, 500); });
  b.run([&] { counted.deallocate(b2, 1200); });
  return counted.counters();
}

}  // namespace

TEST_CASE("statistics: threads taking turns, frees across threads: exact with peak_slack 0") {
  host_resource host;
  statistics_adaptor counted{host, {.peak_slack = 0}};
  const allocation_counters c = take_turns(counted);
  CHECK(c.current_bytes == 0);
  CHECK(c.peak_bytes == 1700);
  CHECK(counted.peak_error_bound() == 0);
  CHECK(c.allocations == 4);
  CHECK(c.deallocations == 4);
}

TEST_CASE("statistics: threads taking turns with the default slack: the peak within its bound") {
  host_resource host;
  statistics_adaptor counted{host};
  const allocation_counters c = take_turns(counted);
  CHECK(c.current_bytes == 0);
  CHECK(c.peak_bytes >= 1700);
  CHECK(counted.peak_error_bound() == 3 * statistics_options{}.peak_slack);  // two threads
  CHECK(c.peak_bytes <= 1700 + counted.peak_error_bound());
  // and never above the sum of each thread's own most (a: 1000, b: 900)
  CHECK(c.peak_bytes <= 1900);
}

TEST_CASE("statistics: the peak never passes a budget, even with frees racing allocations") {
  host_resource host;
  constexpr std::size_t budget = 64 * 4;
  limiting_adaptor capped{host, budget};
  statistics_adaptor counted{capped, {.peak_slack = 0}};  // the exact peak (see the contract)
  // Producers allocate, consumers free what they were handed: every thread's own balance
  // runs far from zero, and frees race allocations all the time.
  std::mutex handed_mutex;
  std::vector<void*> handed;
  std::atomic<bool> producing{true};
  std::vector<std::thread> workers;
  for (int t = 0; t < 2; ++t) {
    workers.emplace_back([&] {
      for (int i = 0; i < 5000; ++i) {
        try {
          void* p = counted.allocate(64);
          const std::lock_guard lock(handed_mutex);
          handed.push_back(p);
        } catch (const out_of_memory&) {  // the budget is full: the consumers will free some
          std::this_thread::yield();
        }
      }
    });
  }
  std::vector<std::thread> consumers;
  for (int t = 0; t < 2; ++t) {
    consumers.emplace_back([&] {
      for (;;) {
        void* p = nullptr;
        {
          const std::lock_guard lock(handed_mutex);
          if (!handed.empty()) {
            p = handed.back();
            handed.pop_back();
          }
        }
        if (p != nullptr) {
          counted.deallocate(p, 64);
        } else if (!producing.load()) {
          return;
        } else {
          std::this_thread::yield();
        }
      }
    });
  }
  for (auto& w : workers) {
    w.join();
  }
  producing.store(false);
  for (auto& c : consumers) {
    c.join();
  }
  const allocation_counters c = counted.counters();
  CHECK(c.peak_bytes <= budget);
  CHECK(c.peak_bytes >= 64);
  CHECK(c.current_bytes == 0);
  CHECK(c.allocations == c.deallocations);
  CHECK(capped.used_bytes() == 0);
}

TEST_CASE("statistics: a second thread arriving mid-work loses no byte") {
  for (int round = 0; round < 10; ++round) {
    host_resource host;
    statistics_adaptor counted{host};
    // This thread keeps a window of allocations moving; a second thread joins at a different
    // moment each round and counts beside it. Each writes only its own slot: a count that
    // both wrote with plain stores would lose bytes.
    void* first = counted.allocate(64);
    std::atomic<int> progress{0};
    std::thread newcomer([&] {
      while (progress.load() < round * 300) {
        std::this_thread::yield();
      }
      for (int i = 0; i < 3000; ++i) {
        void* p = counted.allocate(48);
        counted.deallocate(p, 48);
      }
    });
    std::vector<void*> window;
    std::size_t window_bytes = 0;
    std::size_t most = 0;
    for (int i = 0; i < 6000; ++i) {
      const std::size_t bytes = 32 + static_cast<std::size_t>(i % 5) * 16;
      window.push_back(counted.allocate(bytes));
      window_bytes += bytes;
      most = std::max(most, window_bytes);
      if (window.size() > 30) {
        const std::size_t oldest = 32 + static_cast<std::size_t>((i - 30) % 5) * 16;
        counted.deallocate(window.front(), oldest);
        window_bytes -= oldest;
        window.erase(window.begin());
      }
      progress.store(i);
    }
    newcomer.join();
    const allocation_counters c = counted.counters();
    CHECK(c.current_bytes == window_bytes + 64);
    CHECK(c.peak_bytes >= most + 64);               // this thread's own window at its widest
    CHECK(c.peak_bytes <= most + 64 + 48);          // plus at most the newcomer's one block
                                                    // (the sum of each thread's own most)
    CHECK(c.allocations == 6000 + 1 + 3000);
    CHECK(c.deallocations == (6000 - window.size()) + 3000);
    std::size_t k = 6000 - window.size();
    for (void* p : window) {
      counted.deallocate(p, 32 + (k++ % 5) * 16);
    }
    counted.deallocate(first, 64);
    CHECK(counted.counters().current_bytes == 0);
    CHECK(host.stats().used_bytes == 0);
  }
}

TEST_CASE("statistics: racing threads: the peak within its bound, scopes exact") {
  // Slack 0: exact. 1 KiB: the sum of the threads' most is far above the truth, so the shared
  // mark must hold the peak down. 1 MiB: no thread's bytes move by the slack, so nothing is
  // published and the peak rests on the mark the threads' activations raised.
  for (const std::size_t slack : {std::size_t{0}, std::size_t{1} << 10, std::size_t{64} << 10,
                                  std::size_t{1} << 20, statistics_options{}.peak_slack}) {
    CAPTURE(slack);
    host_resource host;
    statistics_adaptor counted{host, {.peak_slack = slack}};
    std::size_t truth = 0;
    allocation_counters in_scope;
    {
      statistics_adaptor::scope phases{counted};
      truth = cudamem_test::run_phases(counted);
      in_scope = phases.counters();
    }
    const allocation_counters c = counted.counters();
    CHECK(c.current_bytes == 0);
    CHECK(c.peak_bytes >= truth);
    CHECK(c.peak_bytes <= truth + counted.peak_error_bound());
    CHECK(counted.peak_error_bound() == (slack == 0 ? 0 : 7 * slack));  // 4 threads
    CHECK(in_scope.peak_bytes == truth);  // a scope's peak is exact under any race
    CHECK(in_scope.current_bytes == 0);
    CHECK(host.stats().used_bytes == 0);
  }
}

TEST_CASE("statistics: many threads, exact totals") {
  host_resource host;
  statistics_adaptor counted{host};
  statistics_adaptor::scope whole{counted};
  constexpr int threads = 8;
  constexpr int rounds = 5000;
  std::vector<std::thread> workers;
  for (int t = 0; t < threads; ++t) {
    workers.emplace_back([&counted] {
      for (int i = 0; i < rounds; ++i) {
        void* p = counted.allocate(64);
        counted.deallocate(p, 64);
      }
    });
  }
  for (auto& w : workers) {
    w.join();
  }
  const allocation_counters c = counted.counters();
  CHECK(c.allocations == threads * rounds);
  CHECK(c.deallocations == threads * rounds);
  CHECK(c.allocated_bytes == std::size_t{64} * threads * rounds);
  CHECK(c.current_bytes == 0);
  CHECK(c.peak_bytes >= 64);
  CHECK(c.peak_bytes <= 64 * threads);
  CHECK(whole.counters().allocations == threads * rounds);
  CHECK(whole.counters().peak_bytes <= 64 * threads);
}

TEST_CASE("statistics: more threads than slots, threads that come and go, exact totals") {
  host_resource host;
  statistics_adaptor counted{host};
  // Waves of threads: more than thread_slots in all, some alive together; the late ones share
  // the spare slot or inherit a finished thread's id. Every count must still be exact.
  constexpr std::size_t waves = 5;
  constexpr std::size_t per_wave = statistics_adaptor::thread_slots / 2 + 3;
  constexpr int rounds = 200;
  for (std::size_t w = 0; w < waves; ++w) {
    std::vector<std::thread> workers;
    for (std::size_t t = 0; t < per_wave; ++t) {
      workers.emplace_back([&counted, t] {
        for (int i = 0; i < rounds; ++i) {
          void* p = counted.allocate(8 + t);
          counted.deallocate(p, 8 + t);
        }
      });
    }
    for (auto& worker : workers) {
      worker.join();
    }
  }
  std::size_t bytes_per_wave = 0;
  for (std::size_t t = 0; t < per_wave; ++t) {
    bytes_per_wave += (8 + t) * rounds;
  }
  const allocation_counters c = counted.counters();
  CHECK(c.allocations == waves * per_wave * rounds);
  CHECK(c.deallocations == waves * per_wave * rounds);
  CHECK(c.allocated_bytes == waves * bytes_per_wave);
  CHECK(c.freed_bytes == waves * bytes_per_wave);
  CHECK(c.current_bytes == 0);
}

TEST_CASE("statistics: one thread alternating between many adaptors counts each apart") {
  host_resource host;
  // More adaptors than a thread remembers slots for, used in turn, then a new adaptor made
  // where an old one was: each sees only its own traffic.
  std::vector<std::unique_ptr<statistics_adaptor>> adaptors;
  for (int i = 0; i < 6; ++i) {
    adaptors.push_back(std::make_unique<statistics_adaptor>(host));
  }
  for (int round = 0; round < 10; ++round) {
    for (std::size_t i = 0; i < adaptors.size(); ++i) {
      void* p = adaptors[i]->allocate(16 * (i + 1));
      adaptors[i]->deallocate(p, 16 * (i + 1));
    }
  }
  for (std::size_t i = 0; i < adaptors.size(); ++i) {
    const allocation_counters c = adaptors[i]->counters();
    CHECK(c.allocations == 10);
    CHECK(c.allocated_bytes == 160 * (i + 1));
    CHECK(c.peak_bytes == 16 * (i + 1));
  }
  adaptors[0] = std::make_unique<statistics_adaptor>(host);  // may reuse the old address
  void* p = adaptors[0]->allocate(1);
  CHECK(adaptors[0]->counters().allocations == 1);
  adaptors[0]->deallocate(p, 1);
}

TEST_CASE("limiting: within the budget, then over it with the budget verdict") {
  host_resource host;
  limiting_adaptor capped{host, 1000};
  void* a = capped.allocate(600);
  CHECK(capped.used_bytes() == 600);
  try {
    static_cast<void>(capped.allocate(500, 128));
    FAIL("no throw");
  } catch (const out_of_memory& e) {
    CHECK(e.verdict() == oom_verdict::budget);
    CHECK(e.report().requested_bytes == 500);
    REQUIRE(!e.report().chain.empty());
    CHECK(e.report().chain[0].name == "limiting_adaptor");
    CHECK(e.report().chain[0].stats.budget == 1000u);
    CHECK(e.report().chain[0].stats.used_bytes == 600);
    const std::string text = e.what();
    CHECK(text.find("budget") != std::string::npos);
    CHECK(text.find("raise its budget with set_budget()") != std::string::npos);
  }
  CHECK(capped.used_bytes() == 600);  // the failure took nothing
  void* b = capped.allocate(400);     // exactly up to the budget is allowed
  capped.deallocate(a, 600);
  capped.deallocate(b, 400);
  CHECK(capped.used_bytes() == 0);
  CHECK(capped.stats().peak_used_bytes == 1000);
  CHECK(host.stats().used_bytes == 0);
}

TEST_CASE("limiting: huge requests and lowered budgets cannot overflow the check") {
  host_resource host;
  limiting_adaptor capped{host, 1 << 20};
  void* a = capped.allocate(1 << 19);
  CHECK_THROWS_AS(capped.allocate(SIZE_MAX), out_of_memory);
  CHECK_THROWS_AS(capped.allocate(SIZE_MAX - (1 << 18)), out_of_memory);
  capped.set_budget(100);  // below what is in use: nothing is taken back
  CHECK_THROWS_AS(capped.allocate(1), out_of_memory);
  capped.deallocate(a, 1 << 19);
  void* b = capped.allocate(100);
  capped.deallocate(b, 100);
  CHECK(capped.allocate(0) == nullptr);
  CHECK_THROWS_AS(capped.allocate(8, 0), std::invalid_argument);
}

TEST_CASE("limiting: an upstream failure gives the budget back and keeps its verdict") {
  host_resource host;
  limiting_adaptor inner{host, 100};
  limiting_adaptor outer{inner, 1000};
  try {
    static_cast<void>(outer.allocate(200));
    FAIL("no throw");
  } catch (const out_of_memory& e) {
    CHECK(e.verdict() == oom_verdict::budget);
    REQUIRE(e.report().chain.size() == 3);  // outer, inner, host
    CHECK(e.report().chain[1].stats.budget == 100u);
  }
  CHECK(outer.used_bytes() == 0);
}

TEST_CASE("limiting: many threads never pass the budget together") {
  host_resource host;
  constexpr std::size_t budget = 64 * 10;
  limiting_adaptor capped{host, budget};
  statistics_adaptor counted{capped};  // sees only what the budget let through
  std::atomic<int> refused{0};
  std::vector<std::thread> workers;
  for (int t = 0; t < 8; ++t) {
    workers.emplace_back([&] {
      for (int i = 0; i < 3000; ++i) {
        try {
          void* p = counted.allocate(64);
          counted.deallocate(p, 64);
        } catch (const out_of_memory&) {
          refused.fetch_add(1);
        }
      }
    });
  }
  for (auto& w : workers) {
    w.join();
  }
  CHECK(counted.counters().peak_bytes <= budget);
  CHECK(capped.stats().peak_used_bytes <= budget);
  CHECK(capped.used_bytes() == 0);
  CHECK(refused.load() == 0);  // 8 threads x 64 bytes never exceed 10 x 64
}
