// pool_resource over simulated and host memory: a randomised model test, threads, growth,
// release, maximum size, out-of-memory retry and report, bad inputs; and its internals
// (the TLSF free-block index and the address map) on their own.
#include <cudamem/detail/pool/address_map.hpp>
#include <cudamem/detail/pool/tlsf_heap.hpp>
#include <cudamem/host_resource.hpp>
#include <cudamem/out_of_memory.hpp>
#include <cudamem/pool_resource.hpp>
#include <cudamem/retry_adaptor.hpp>
#include <cudamem/simulated_resource.hpp>

#include "captured_errors.hpp"

#include <catch2/catch.hpp>

#include <chrono>
#include <cstdint>
#include <cstring>
#include <limits>
#include <map>
#include <mutex>
#include <random>
#include <thread>
#include <unordered_map>
#include <vector>

using namespace cudamem;

namespace {

constexpr std::size_t MiB = std::size_t{1} << 20;
constexpr std::size_t GiB = std::size_t{1} << 30;

std::size_t rounded(std::size_t n) { return (n + 255) & ~std::size_t{255}; }

/// The reference model: what is live, by address. Checks every invariant after each step.
/// A block from the pool's cache may be up to 1/8 larger than asked: `used()` is the least the
/// pool may count, `slack()` how much more it may (0 when the pool has no cache).
class model {
 public:
  model(bool writable, bool exact) : writable_(writable), exact_(exact) {}

  void allocated(void* p, std::size_t bytes, std::size_t alignment) {
    const auto a = reinterpret_cast<std::uintptr_t>(p);
    REQUIRE(p != nullptr);
    REQUIRE(a % alignment == 0);
    REQUIRE(a % 256 == 0);
    auto next = live_.lower_bound(a);
    if (next != live_.end()) {
      REQUIRE(a + rounded(bytes) <= next->first);  // no overlap with the block above
    }
    if (next != live_.begin()) {
      auto prev = std::prev(next);
      REQUIRE(prev->first + rounded(prev->second.bytes) <= a);  // nor with the block below
    }
    const auto tag = static_cast<unsigned char>(a >> 8);
    live_[a] = {bytes, alignment, tag};
    used_ += rounded(bytes);
    slack_ += exact_ ? 0 : rounded(bytes) / 8;
    if (writable_) {  // real memory: write the whole block, check it before the free
      std::memset(p, tag, bytes);
    }
  }
  /// Forgets and returns a live block (its pattern checked).
  std::pair<void*, std::size_t> take(std::size_t k) {
    auto it = live_.begin();
    std::advance(it, static_cast<std::ptrdiff_t>(k % live_.size()));
    void* p = reinterpret_cast<void*>(it->first);
    const std::size_t bytes = it->second.bytes;
    if (writable_) {
      const auto* c = static_cast<const unsigned char*>(p);
      REQUIRE(c[0] == it->second.tag);
      REQUIRE(c[bytes - 1] == it->second.tag);
      REQUIRE(c[bytes / 2] == it->second.tag);
    }
    used_ -= rounded(bytes);
    slack_ -= exact_ ? 0 : rounded(bytes) / 8;
    live_.erase(it);
    return {p, bytes};
  }
  [[nodiscard]] std::size_t size() const { return live_.size(); }
  [[nodiscard]] std::size_t used() const { return used_; }
  [[nodiscard]] std::size_t slack() const { return slack_; }

 private:
  struct entry {
    std::size_t bytes;
    std::size_t alignment;
    unsigned char tag;
  };
  bool writable_;
  bool exact_;
  std::map<std::uintptr_t, entry> live_;
  std::size_t used_ = 0;
  std::size_t slack_ = 0;
};

void check_stats(const pool_resource& pool, const model& m) {
  const resource_stats s = pool.stats();
  REQUIRE(s.used_bytes >= m.used());
  REQUIRE(s.used_bytes <= m.used() + m.slack());
  REQUIRE(s.reserved_bytes >= s.used_bytes);
  REQUIRE(s.peak_used_bytes >= s.used_bytes);
  REQUIRE(s.free_blocks.has_value());
  REQUIRE(s.largest_free_block.has_value());
  REQUIRE(*s.largest_free_block <= s.free_bytes());
  if (s.free_bytes() > 0) {
    REQUIRE(*s.free_blocks > 0);
    const double expected =
        1.0 - static_cast<double>(*s.largest_free_block) / static_cast<double>(s.free_bytes());
    REQUIRE(s.fragmentation() == Approx(expected));
  }
  REQUIRE(pool.upstream()->stats().used_bytes >= s.reserved_bytes);
}

/// Random allocations and frees of sizes 1 B .. max_bytes against the model.
void random_model_run(pool_resource& pool, bool writable, std::size_t max_bytes, unsigned seed,
                      int steps) {
  model m(writable, pool.options().cache_bytes == 0 || pool.options().cache_block_limit == 0);
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> unit(0.0, 1.0);
  const double log_max = std::log(static_cast<double>(max_bytes));
  for (int i = 0; i < steps; ++i) {
    if (m.size() == 0 || unit(rng) < 0.55) {
      const auto bytes = static_cast<std::size_t>(std::exp(unit(rng) * log_max));
      const std::size_t alignment = std::size_t{1} << (rng() % 13);  // 1 B .. 4 KiB
      const bool on_stream = rng() % 2 == 0;
      void* p = on_stream ? pool.allocate(bytes, alignment, stream_view{})
                          : pool.allocate(bytes, alignment);
      m.allocated(p, bytes, alignment);
    } else {
      auto [p, bytes] = m.take(rng());
      pool.deallocate(p, bytes);
    }
    if (i % 97 == 0) {
      check_stats(pool, m);
    }
  }
  while (m.size() > 0) {
    auto [p, bytes] = m.take(0);
    pool.deallocate(p, bytes);
  }
  check_stats(pool, m);
  CHECK(pool.stats().used_bytes == 0);
}

/// An upstream that fails (out_of_memory) on chosen calls; host memory behind the others.
class flaky_upstream final : public memory_resource {
 public:
  flaky_upstream() : memory_resource(memory_kind::host, -1) {}
  int calls = 0;
  int fail_from = std::numeric_limits<int>::max();  ///< calls at or after this fail
  mutable int stats_calls = 0;  ///< one per report that shows it (and per stats())
  std::size_t used() const { return host_.stats().used_bytes; }

 private:
  void* do_allocate(std::size_t bytes, std::size_t alignment, stream_view) override {
    return do_allocate_sync(bytes, alignment);
  }
  void do_deallocate(void* p, std::size_t bytes, std::size_t alignment,
                     stream_view) noexcept override {
    do_deallocate_sync(p, bytes, alignment);
  }
  void* do_allocate_sync(std::size_t bytes, std::size_t alignment) override {
    if (++calls >= fail_from) {
      throw_out_of_memory(*this, bytes, alignment, "flaky_upstream: told to fail");
    }
    return host_.allocate(bytes, alignment);
  }
  void do_deallocate_sync(void* p, std::size_t bytes, std::size_t alignment) noexcept override {
    host_.deallocate(p, bytes, alignment);
  }
  resource_stats do_stats() const override {
    ++stats_calls;
    return host_.stats();
  }
  host_resource host_;
};

}  // namespace

// --- the free-block index on its own -----------------------------------------------------------

TEST_CASE("tlsf_heap: split, coalesce, alignment, and whole regions") {
  detail::tlsf_heap<> heap{256};
  auto* region = heap.add_region(1 << 20, 1 << 20);
  CHECK(heap.free_bytes() == (1 << 20));
  auto* a = heap.allocate(1000, 256);
  auto* b = heap.allocate(256, 4096);
  auto* c = heap.allocate(300, 256);
  REQUIRE((a && b && c));
  CHECK(a->size == 1024);
  CHECK(b->address % 4096 == 0);
  CHECK(c->size == 512);
  CHECK(heap.free_bytes() == (1 << 20) - 1024 - 256 - 512);
  CHECK_FALSE(heap.is_wholly_free(region));
  heap.free(b);
  heap.free(a);
  heap.free(c);
  CHECK(heap.is_wholly_free(region));
  CHECK(heap.free_block_count() == 1);
  CHECK(heap.largest_free_block() == (1 << 20));
  CHECK(heap.allocate(2 << 20, 256) == nullptr);
  CHECK(heap.allocate(std::numeric_limits<std::size_t>::max(), 256) == nullptr);
  heap.extend_region(region, 1 << 20);  // a growable range: the new bytes join the free block
  CHECK(heap.largest_free_block() == (2 << 20));
  auto* whole = heap.allocate(2 << 20, 256);
  REQUIRE(whole != nullptr);
  heap.free(whole);
  heap.remove_region(region);
  CHECK(heap.total_bytes() == 0);
}

TEST_CASE("tlsf_heap: a search costs the same with 64k holes (no linear scan)") {
  detail::tlsf_heap<> heap{256};
  constexpr std::size_t holes = 1 << 16;
  heap.add_region(1 << 20, holes * 512);
  std::vector<detail::tlsf_heap<>::block*> blocks;
  for (std::size_t i = 0; i < holes * 2; ++i) {
    blocks.push_back(heap.allocate(256, 256));
  }
  for (std::size_t i = 0; i < blocks.size(); i += 2) {
    heap.free(blocks[i]);  // 64k free 256 B holes, none adjacent
  }
  REQUIRE(heap.free_block_count() == holes);
  const auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < 100000; ++i) {
    REQUIRE(heap.allocate(512, 256) == nullptr);  // fits no hole: a linear scan would see all
  }
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  CHECK(seconds < 0.5);  // 100k scans of 64k holes would take many seconds
}

TEST_CASE("tlsf_heap: random use against a model keeps blocks disjoint and merges fully") {
  detail::tlsf_heap<> heap{256};
  auto* region = heap.add_region(256, 64 << 20);
  std::mt19937 rng(7);
  std::map<std::uintptr_t, detail::tlsf_heap<>::block*> live;
  for (int i = 0; i < 20000; ++i) {
    if (live.empty() || rng() % 100 < 55) {
      const std::size_t n = 1 + rng() % (256 << 10);
      const std::size_t align = std::size_t{256} << (rng() % 5);
      auto* b = heap.allocate(n, align);
      if (b == nullptr) {
        continue;
      }
      REQUIRE(b->address % align == 0);
      auto next = live.lower_bound(b->address);
      if (next != live.end()) {
        REQUIRE(b->address + b->size <= next->first);
      }
      if (next != live.begin()) {
        REQUIRE(std::prev(next)->second->address + std::prev(next)->second->size <= b->address);
      }
      live[b->address] = b;
    } else {
      auto it = live.begin();
      std::advance(it, static_cast<std::ptrdiff_t>(rng() % live.size()));
      heap.free(it->second);
      live.erase(it);
    }
  }
  for (auto& [a, b] : live) {
    heap.free(b);
  }
  CHECK(heap.is_wholly_free(region));
  CHECK(heap.free_bytes() == (64 << 20));
}

TEST_CASE("address_map agrees with std::unordered_map under random inserts and erases") {
  detail::address_map<int> map;
  std::unordered_map<std::uintptr_t, int*> reference;
  std::vector<int> values(4096);
  std::mt19937_64 rng(3);
  for (int i = 0; i < 200000; ++i) {
    const std::uintptr_t key = ((rng() % 4096) + 1) * 256;
    if (rng() % 2 == 0) {
      if (reference.count(key) == 0) {
        map.reserve_one();
        int* v = &values[key / 256 - 1];
        map.insert(key, v);
        reference[key] = v;
      }
    } else {
      auto it = reference.find(key);
      int* expected = it == reference.end() ? nullptr : it->second;
      REQUIRE(map.erase(key) == expected);
      if (it != reference.end()) {
        reference.erase(it);
      }
    }
    REQUIRE(map.size() == reference.size());
  }
  for (auto& [k, v] : reference) {
    REQUIRE(map.find(k) == v);
  }
}

// --- the pool ------------------------------------------------------------------------------

TEST_CASE("pool over an 80 GiB simulated device: random model test") {
  simulated_resource device;
  {
    pool_resource pool{device};
    random_model_run(pool, false, 256 * MiB, 11, 20000);
    CHECK(pool.kind() == memory_kind::device);
    CHECK(pool.device() == -1);
    CHECK(pool.upstream() == &device);
  }
  CHECK(device.used_bytes() == 0);  // everything went back
}

TEST_CASE("pool over host memory: random model test writing every block") {
  host_resource host;
  {
    pool_resource pool{host, {.growth_step = 8 * MiB, .small_block_limit = 1 * MiB, .small_chunk_size = 2 * MiB}};
    random_model_run(pool, true, 4 * MiB, 12, 20000);
    CHECK(pool.release() > 0);
    CHECK(pool.stats().reserved_bytes == 0);
  }
  CHECK(host.stats().used_bytes == 0);
}

TEST_CASE("pool: several shards, one thread, small and large tiers") {
  simulated_resource device;
  pool_resource pool{device, {.shards = 4}};
  CHECK(pool.shard_count() == 4);
  random_model_run(pool, false, 64 * MiB, 13, 5000);
}

TEST_CASE("pool: many threads allocating and freeing at once, some frees on other threads") {
  host_resource host;
  {
    pool_resource pool{host, {.growth_step = 16 * MiB, .shards = 8}};
    std::mutex handoff_mutex;
    std::vector<std::pair<void*, std::size_t>> handoff;  // freed by whichever thread comes next
    std::vector<std::thread> threads;
    for (unsigned t = 0; t < 8; ++t) {
      threads.emplace_back([&, t] {
        std::mt19937 rng(100 + t);
        std::vector<std::pair<unsigned char*, std::size_t>> mine;
        for (int i = 0; i < 20000; ++i) {
          if (mine.empty() || rng() % 100 < 55) {
            const std::size_t n = 1 + rng() % (64 << 10);
            auto* p = static_cast<unsigned char*>(pool.allocate(n));
            p[0] = p[n - 1] = static_cast<unsigned char>(t);
            mine.emplace_back(p, n);
          } else {
            const std::size_t k = rng() % mine.size();
            auto [p, n] = mine[k];
            REQUIRE(p[0] == t);
            REQUIRE(p[n - 1] == t);
            mine[k] = mine.back();
            mine.pop_back();
            if (rng() % 8 == 0) {
              const std::lock_guard lock(handoff_mutex);
              p[0] = p[n - 1] = 0xEE;
              handoff.emplace_back(p, n);
            } else {
              pool.deallocate(p, n);
            }
          }
          if (i % 64 == 0) {
            const std::lock_guard lock(handoff_mutex);
            for (auto [p, n] : handoff) {
              REQUIRE(static_cast<unsigned char*>(p)[0] == 0xEE);
              pool.deallocate(p, n);  // allocated by another thread, most likely
            }
            handoff.clear();
          }
        }
        for (auto [p, n] : mine) {
          pool.deallocate(p, n);
        }
      });
    }
    for (auto& th : threads) {
      th.join();
    }
    for (auto [p, n] : handoff) {
      pool.deallocate(p, n);
    }
    CHECK(pool.stats().used_bytes == 0);
  }
  CHECK(host.stats().used_bytes == 0);
}

TEST_CASE("pool: growth in steps, chunks of their own for large requests, small tier apart") {
  simulated_resource device;
  pool_resource pool{device, {.growth_step = 64 * MiB, .small_block_limit = 1 * MiB,
                              .small_chunk_size = 4 * MiB, .shards = 1}};
  CHECK(pool.stats().reserved_bytes == 0);
  void* a = pool.allocate(2 * MiB);
  CHECK(pool.stats().reserved_bytes == 64 * MiB);
  void* b = pool.allocate(1000);
  CHECK(pool.stats().reserved_bytes == 68 * MiB);  // small tier: its own 4 MiB chunk
  void* c = pool.allocate(100 * MiB);
  CHECK(pool.stats().reserved_bytes == 168 * MiB);  // a chunk of the request's own size
  CHECK(pool.chunk_count() == 3);
  void* d = pool.allocate(60 * MiB);                // fits the first chunk's rest
  CHECK(pool.stats().reserved_bytes == 168 * MiB);
  pool.deallocate(c, 100 * MiB);
  CHECK(pool.release() == 100 * MiB);               // exactly the wholly free chunk
  CHECK(pool.stats().reserved_bytes == 68 * MiB);
  pool.deallocate(a, 2 * MiB);
  pool.deallocate(b, 1000);
  pool.deallocate(d, 60 * MiB);
  CHECK(pool.release() == 68 * MiB);
  CHECK(device.used_bytes() == 0);
}

TEST_CASE("pool: initial size is reserved up front and used") {
  simulated_resource device;
  pool_resource pool{device, {.initial_size = 1 * GiB, .shards = 1}};
  CHECK(pool.stats().reserved_bytes == 1 * GiB);
  void* p = pool.allocate(512 * MiB);
  CHECK(pool.stats().reserved_bytes == 1 * GiB);
  pool.deallocate(p, 512 * MiB);
  simulated_resource tiny{{.capacity = 64 * MiB}};
  CHECK_THROWS_AS((pool_resource{tiny, {.initial_size = 1 * GiB}}), out_of_memory);
  CHECK(tiny.used_bytes() == 0);
}

TEST_CASE("pool: maximum size is never exceeded; the report says why") {
  simulated_resource device;
  pool_resource pool{device, {.maximum_size = 256 * MiB, .growth_step = 64 * MiB, .shards = 1}};
  void* a = pool.allocate(200 * MiB);
  try {
    static_cast<void>(pool.allocate(100 * MiB));
    FAIL("expected out_of_memory");
  } catch (const out_of_memory& e) {
    CHECK_THAT(e.what(), Catch::Contains("maximum size"));
    REQUIRE(e.report().chain.size() == 2);
    CHECK(e.report().chain[0].name == "pool_resource");
    CHECK(e.report().chain[0].stats.reserved_bytes == 200 * MiB);
    CHECK(e.report().chain[0].stats.largest_free_block.has_value());
  }
  CHECK(pool.stats().reserved_bytes <= 256 * MiB);
  void* b = pool.allocate(50 * MiB);  // within the maximum: fine
  pool.deallocate(a, 200 * MiB);
  pool.deallocate(b, 50 * MiB);
  CHECK_THROWS_AS(pool.allocate(257 * MiB), out_of_memory);
}

TEST_CASE("pool: when the upstream is full it releases its free chunks and retries") {
  simulated_resource device{{.capacity = 1 * GiB}};
  pool_resource pool{device, {.growth_step = 64 * MiB, .shards = 1}};
  std::vector<void*> blocks;
  for (int i = 0; i < 16; ++i) {
    blocks.push_back(pool.allocate(64 * MiB));
  }
  CHECK_THROWS_AS(pool.allocate(64 * MiB), out_of_memory);
  for (void* p : blocks) {
    pool.deallocate(p, 64 * MiB);
  }
  CHECK(pool.stats().reserved_bytes == 1 * GiB);  // 16 free chunks, none large enough alone
  void* big = pool.allocate(512 * MiB);            // fails upstream, releases, retries
  CHECK(pool.stats().reserved_bytes == 512 * MiB);
  pool.deallocate(big, 512 * MiB);
}

TEST_CASE("pool: a request the upstream cannot supply builds one report, the pool's") {
  // The pool asks for a chunk, then for an exact one; each refusal used to build a report of
  // its own (stats of the chain, NVML on a device) that the pool threw away.
  flaky_upstream up;
  up.fail_from = 1;
  pool_resource pool{up, {.growth_step = 64 * MiB, .shards = 1}};
  try {
    static_cast<void>(pool.allocate(1 * MiB));
    FAIL("expected out_of_memory");
  } catch (const out_of_memory& e) {
    CHECK(up.calls >= 2);         // it did try more than once
    CHECK(up.stats_calls == 1);   // but only its own report looked at the upstream
    REQUIRE(e.report().chain.size() == 2);
    CHECK(e.report().chain[0].name == "pool_resource");
    CHECK_THAT(e.report().cause, Catch::Contains("could not supply"));
  }
  CHECK(up.used() == 0);
}

TEST_CASE("pool: a retry_adaptor below the pool still hands its callback a whole report") {
  flaky_upstream up;
  up.fail_from = 1;
  std::vector<std::size_t> chain_sizes;
  retry_adaptor retry{up, [&](const out_of_memory& e) {
                        chain_sizes.push_back(e.report().chain.size());
                        return false;
                      }};
  pool_resource pool{retry, {.growth_step = 64 * MiB, .shards = 1}};
  CHECK_THROWS_AS(pool.allocate(1 * MiB), out_of_memory);
  REQUIRE_FALSE(chain_sizes.empty());
  for (const std::size_t n : chain_sizes) {
    CHECK(n == 2);  // retry_adaptor, then the upstream: the failure passed on is reported whole
  }
}

TEST_CASE("pool: out_of_memory carries the pool's figures and a verdict") {
  simulated_resource device{{.capacity = 1 * GiB}};
  pool_resource pool{device, {.shards = 1}};
  try {
    static_cast<void>(pool.allocate(2 * GiB));
    FAIL("expected out_of_memory");
  } catch (const out_of_memory& e) {
    CHECK(e.verdict() == oom_verdict::larger_than_device);
    CHECK(e.requested_bytes() == 2 * GiB);
    CHECK(e.report().device_total == 1 * GiB);
  }
  // Fragmentation: free memory in the pool, in pieces, and a full device.
  std::vector<void*> blocks;
  for (int i = 0; i < 16; ++i) {
    blocks.push_back(pool.allocate(64 * MiB - 256));
  }
  for (int i = 0; i < 16; i += 2) {
    pool.deallocate(blocks[i], 64 * MiB - 256);
  }
  try {
    static_cast<void>(pool.allocate(128 * MiB));
    FAIL("expected out_of_memory");
  } catch (const out_of_memory& e) {
    const resource_stats& s = e.report().chain[0].stats;
    CHECK(s.free_blocks.value() >= 1);
    CHECK(s.largest_free_block.value() < 128 * MiB);
    CHECK(e.verdict() != oom_verdict::unknown);
  }
  for (int i = 1; i < 16; i += 2) {
    pool.deallocate(blocks[i], 64 * MiB - 256);
  }
}

TEST_CASE("pool: bad input") {
  simulated_resource device;
  pool_resource pool{device, {.shards = 1}};
  CHECK(pool.allocate(0) == nullptr);
  pool.deallocate(nullptr, 10);
  CHECK_THROWS_AS(pool.allocate(64, 3), std::invalid_argument);
  CHECK_THROWS_AS(pool.allocate(std::numeric_limits<std::size_t>::max()), out_of_memory);
  CHECK_THROWS_AS(pool.allocate(std::numeric_limits<std::size_t>::max() - 100, 256, stream_view{}),
                  out_of_memory);
  CHECK_THROWS_AS(pool.allocate(1024, std::size_t{1} << 62), out_of_memory);
  void* big_align = pool.allocate(1000, std::size_t{1} << 24);
  CHECK(reinterpret_cast<std::uintptr_t>(big_align) % (std::size_t{1} << 24) == 0);
  pool.deallocate(big_align, 1000, std::size_t{1} << 24);

  cudamem_test::captured_errors errors;
  void* p = pool.allocate(4096);
  pool.deallocate(p, 4096);
  const resource_stats before = pool.stats();
  pool.deallocate(p, 4096);  // double free
  REQUIRE(errors.messages().size() == 1);
  CHECK_THAT(errors.messages()[0], Catch::Contains("double free"));
  int local = 0;
  pool.deallocate(&local, 4);  // never came from the pool
  REQUIRE(errors.messages().size() == 2);
  CHECK_THAT(errors.messages()[1], Catch::Contains("did not give out"));
  CHECK(pool.stats().used_bytes == before.used_bytes);
  CHECK(pool.stats().free_blocks == before.free_blocks);
  void* q = pool.allocate(4096);
  pool.deallocate(q, 8192);  // wrong size: reported, freed with its own size
  REQUIRE(errors.messages().size() == 3);
  CHECK_THAT(errors.messages()[2], Catch::Contains("size"));
  CHECK(pool.stats().used_bytes == 0);
  void* r = pool.allocate(8192);  // the pool still works
  pool.deallocate(r, 8192);
}

TEST_CASE("pool: bad options are refused") {
  host_resource host;
  CHECK_THROWS_AS((pool_resource{host, {.shards = 3}}), std::invalid_argument);
  CHECK_THROWS_AS((pool_resource{host, {.growth_step = 0}}), std::invalid_argument);
  CHECK_THROWS_AS((pool_resource{host, {.small_block_limit = 8 * MiB, .small_chunk_size = 4 * MiB}}),
                  std::invalid_argument);
  CHECK_THROWS_AS((pool_resource{host, {.initial_size = 2 * MiB, .maximum_size = MiB}}),
                  std::invalid_argument);
}

TEST_CASE("pool: an upstream failing at any point leaks nothing") {
  for (int fail_at = 1; fail_at <= 6; ++fail_at) {
    CAPTURE(fail_at);
    flaky_upstream upstream;
    upstream.fail_from = fail_at;
    {
      pool_resource pool{upstream, {.growth_step = 4 * MiB, .small_block_limit = 1 * MiB, .small_chunk_size = 2 * MiB, .shards = 1}};
      std::vector<std::pair<void*, std::size_t>> blocks;
      try {
        for (std::size_t n : {100 * std::size_t{1024}, 3 * MiB, 5 * MiB, 512 * std::size_t{1}, 9 * MiB}) {
          blocks.emplace_back(pool.allocate(n), n);
        }
      } catch (const out_of_memory&) {
      }
      for (auto [p, n] : blocks) {
        pool.deallocate(p, n);
      }
      CHECK(pool.stats().used_bytes == 0);
    }
    CHECK(upstream.used() == 0);
  }
}

TEST_CASE("pool: destroying it with blocks allocated reports them and returns the memory") {
  simulated_resource device;
  cudamem_test::captured_errors errors;
  {
    pool_resource pool{device};
    static_cast<void>(pool.allocate(10 * MiB));
  }
  REQUIRE(errors.messages().size() == 1);
  CHECK_THAT(errors.messages()[0], Catch::Contains("still allocated"));
  CHECK(device.used_bytes() == 0);
}

// --- the front-end cache -------------------------------------------------------------------

TEST_CASE("pool without its cache: random model test with exact sizes") {
  simulated_resource device;
  pool_resource pool{device, {.cache_block_limit = 0}};
  random_model_run(pool, false, 16 * MiB, 14, 5000);
  pool_resource no_bytes{device, {.cache_bytes = 0}};
  random_model_run(no_bytes, false, 16 * MiB, 15, 2000);
}

TEST_CASE("pool cache: a freed block is reused whole by a request of about its size") {
  simulated_resource device;
  cudamem_test::captured_errors errors;
  pool_resource pool{device, {.small_block_limit = 1 * MiB, .small_chunk_size = 4 * MiB, .shards = 1}};
  void* p = pool.allocate(100000);  // 100096 bytes
  pool.deallocate(p, 100000);
  resource_stats s = pool.stats();
  CHECK(s.used_bytes == 0);
  CHECK(s.free_blocks == 2);  // the cached block and the rest of the chunk
  CHECK(s.largest_free_block == 4 * MiB - 100096);
  CHECK(pool.allocate(100000) == p);
  pool.deallocate(p, 100000);
  void* q = pool.allocate(95000);  // 95232 bytes: the cached block is at most 1/8 larger
  CHECK(q == p);
  CHECK(pool.stats().used_bytes == 100096);
  pool.deallocate(q, 95000);  // the size asked for, not the block's: no complaint
  void* r = pool.allocate(80000);  // 80128 bytes: 100096 would waste more than 1/8
  CHECK(r != p);
  CHECK(pool.stats().used_bytes == 80128);
  pool.deallocate(r, 80000);
  void* aligned = pool.allocate(100000, std::size_t{1} << 20);  // the cached one may not do
  CHECK(reinterpret_cast<std::uintptr_t>(aligned) % (std::size_t{1} << 20) == 0);
  pool.deallocate(aligned, 100000, std::size_t{1} << 20);
  CHECK(errors.messages().empty());
  void* t = pool.allocate(100000);
  pool.deallocate(t, 200000);  // far off: reported, freed with its own size
  REQUIRE(errors.messages().size() == 1);
  CHECK_THAT(errors.messages()[0], Catch::Contains("size"));
  CHECK(pool.stats().used_bytes == 0);
}

// The cache's own mechanics, with cache_follows_use off (it merges whatever outgrows use, which
// would hide them; its own test follows).
TEST_CASE("pool cache: cached blocks merge when the heap has no room, and before release") {
  simulated_resource device;
  pool_resource pool{device, {.maximum_size = 4 * MiB, .small_block_limit = 1 * MiB,
                              .small_chunk_size = 4 * MiB, .shards = 1,
                              .cache_follows_use = false}};
  std::vector<void*> blocks;
  for (int i = 0; i < 8; ++i) {
    blocks.push_back(pool.allocate(512 * 1024));  // fills the one 4 MiB small chunk
  }
  for (void* p : blocks) {
    pool.deallocate(p, 512 * 1024);  // all cached, not merged
  }
  resource_stats s = pool.stats();
  CHECK(s.free_blocks == 8);
  CHECK(s.largest_free_block == 512 * 1024);
  CHECK(s.reserved_bytes == 4 * MiB);
  CHECK(s.used_bytes == 0);
  void* big = pool.allocate(MiB);  // no cached block fits: the cache is flushed and merges
  CHECK(pool.chunk_count() == 1);
  CHECK(pool.stats().reserved_bytes == 4 * MiB);
  pool.deallocate(big, MiB);
  CHECK(pool.release() == 4 * MiB);  // the cached block does not keep the chunk
  CHECK(pool.chunk_count() == 0);
  CHECK(device.used_bytes() == 0);

  // A large-tier request at the maximum size: the small chunk, free but cached, goes back.
  for (int i = 0; i < 4; ++i) {
    pool.deallocate(pool.allocate(MiB), MiB);
  }
  void* large = pool.allocate(4 * MiB);
  CHECK(pool.stats().reserved_bytes == 4 * MiB);
  pool.deallocate(large, 4 * MiB);
}

TEST_CASE("pool cache: a request the heap cannot serve flushes only what it needs") {
  simulated_resource device;
  pool_resource pool{device, {.maximum_size = 4 * MiB, .small_block_limit = 1 * MiB,
                              .small_chunk_size = 4 * MiB, .shards = 1,
                              .cache_follows_use = false}};
  std::vector<void*> blocks;
  for (int i = 0; i < 8; ++i) {
    blocks.push_back(pool.allocate(512 * 1024));  // fills the one 4 MiB small chunk, in order
  }
  for (void* p : blocks) {
    pool.deallocate(p, 512 * 1024);  // all cached: the last one freed is on top
  }
  // The top two (blocks 7, then 6) go back to the heap and merge into 1 MiB: enough.
  void* big = pool.allocate(MiB);
  CHECK(big == blocks[6]);
  resource_stats s = pool.stats();
  CHECK(s.free_blocks == 6);  // the other six are still cached, each reusable whole
  CHECK(s.used_bytes == MiB);
  CHECK(pool.allocate(512 * 1024) == blocks[5]);
  pool.deallocate(blocks[5], 512 * 1024);
  // Nothing cached can merge into 4 MiB while `big` lives: the whole cache goes, then the
  // pool is full and says so (it never grows while a flush might still make room).
  CHECK_THROWS_AS(pool.allocate(3 * MiB + 512 * 1024), out_of_memory);
  CHECK(pool.stats().free_blocks == 1);  // everything merged: blocks 0-5, one free block
  CHECK(pool.stats().largest_free_block == 3 * MiB);
  pool.deallocate(big, MiB);  // cached again
  CHECK(pool.release() == 4 * MiB);
  CHECK(device.used_bytes() == 0);
}

TEST_CASE("pool cache: its byte bound holds") {
  simulated_resource device;
  pool_resource pool{device, {.small_block_limit = 1 * MiB, .small_chunk_size = 4 * MiB,
                              .shards = 1, .cache_bytes = MiB, .cache_follows_use = false}};
  std::vector<void*> blocks;
  for (int i = 0; i < 4; ++i) {
    blocks.push_back(pool.allocate(512 * 1024));
  }
  for (void* p : blocks) {
    pool.deallocate(p, 512 * 1024);
  }
  // Two are cached; the other two went back to the heap and merged with the chunk's rest.
  const resource_stats s = pool.stats();
  CHECK(s.free_blocks == 3);
  CHECK(s.largest_free_block == 3 * MiB);
}

TEST_CASE("pool cache: cache_follows_use (default) flushes a cache that outgrew its use") {
  simulated_resource device;
  pool_resource pool{device, {.small_block_limit = 1 * MiB, .small_chunk_size = 4 * MiB,
                              .shards = 1}};
  REQUIRE(pool.options().cache_follows_use);
  // Eight blocks fill the chunk; freed in turn, the cache holds at most what is still in use.
  std::vector<void*> blocks;
  for (int i = 0; i < 8; ++i) {
    blocks.push_back(pool.allocate(512 * 1024));
  }
  REQUIRE(pool.chunk_count() == 1);
  // Freed in order. The fifth free finds 4 blocks cached and 3 in use: the four merge into
  // one free block and the fifth is cached; the seventh finds 2 cached, 1 in use: they merge
  // into it; the last finds 1 cached, 0 in use. Free blocks: cached + the heap's merged one.
  const std::size_t free_blocks_after[8] = {1, 2, 3, 4, 2, 3, 2, 2};
  for (std::size_t i = 0; i < 8; ++i) {
    pool.deallocate(blocks[i], 512 * 1024);
    CAPTURE(i);
    CHECK(pool.stats().free_blocks == free_blocks_after[i]);
  }
  // All freed: the cache holds only the last block; the rest merged into one free block.
  const resource_stats s = pool.stats();
  CHECK(s.used_bytes == 0);
  CHECK(s.free_blocks == 2);
  CHECK(s.largest_free_block == 4 * MiB - 512 * 1024);
  // A block freed and taken again at once (a loop) still comes from the cache, whole.
  for (int i = 0; i < 3; ++i) {
    void* again = pool.allocate(512 * 1024);
    CHECK(again == blocks[7]);
    pool.deallocate(again, 512 * 1024);
    CHECK(pool.stats().free_blocks == 2);
  }
  // Without the option, the same frees leave all eight cached (the byte bound allows them).
  pool_resource keeps{device, {.small_block_limit = 1 * MiB, .small_chunk_size = 4 * MiB,
                               .shards = 1, .cache_follows_use = false}};
  blocks.clear();
  for (int i = 0; i < 8; ++i) {
    blocks.push_back(keeps.allocate(512 * 1024));
  }
  for (void* p : blocks) {
    keeps.deallocate(p, 512 * 1024);
  }
  CHECK(keeps.stats().free_blocks == 8);
}

// Why cache_follows_use is the default: a run of work that frees everything it held, then a
// next run that takes other sizes. Kept, the cache hands the next run's small blocks back at
// their old places, scattered over the chunk, and a larger block no longer fits between them:
// the pool grows. Following use, the finished run's blocks merged as they were freed, and the
// next run is cut from merged memory (bench_workload: 192 against 160 MiB, bench/README.md).
TEST_CASE("pool cache: a finished run's blocks do not scatter the next run") {
  for (const bool follows : {true, false}) {
    CAPTURE(follows);
    simulated_resource device;
    pool_resource pool{device, {.small_block_limit = 4 * MiB, .small_chunk_size = 4 * MiB,
                                .shards = 1, .cache_follows_use = follows}};
    const std::size_t small = 64 * 1024;
    // The first run: small and 1 MiB blocks, interleaved; then all of it freed.
    std::vector<std::pair<void*, std::size_t>> run;
    for (const std::size_t bytes : {small, MiB, small, MiB, small}) {
      run.emplace_back(pool.allocate(bytes), bytes);
    }
    REQUIRE(pool.chunk_count() == 1);
    for (const auto& [p, bytes] : run) {
      pool.deallocate(p, bytes);
    }
    // The next run: three small blocks, then one of 2 MiB.
    run.clear();
    for (int i = 0; i < 3; ++i) {
      run.emplace_back(pool.allocate(small), small);
    }
    run.emplace_back(pool.allocate(2 * MiB), 2 * MiB);
    CHECK(pool.chunk_count() == (follows ? 1U : 2U));
    for (const auto& [p, bytes] : run) {
      pool.deallocate(p, bytes);
    }
    CHECK(pool.stats().used_bytes == 0);
  }
}

TEST_CASE("pool cache: with cache_follows_use off, the random model test's invariants hold") {
  simulated_resource device;
  pool_resource pool{device, {.cache_follows_use = false}};
  random_model_run(pool, false, 16 * MiB, 16, 5000);
}
