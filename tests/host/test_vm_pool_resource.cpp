// vm_pool_resource's granule and handle bookkeeping, over the simulated mapping layer (no GPU):
// growth, compaction, stream ordering calls, release, bad input, and a randomised run checked
// against a model.
#include <cudamem/vm_pool_resource.hpp>

#include "captured_errors.hpp"

#include <catch2/catch.hpp>

#include <cstdint>
#include <limits>
#include <map>
#include <memory>
#include <random>
#include <vector>

using namespace cudamem;
using detail::simulated_vm_mapping;
using detail::simulated_vm_options;

namespace {

constexpr std::size_t MiB = std::size_t{1} << 20;
constexpr std::size_t GiB = std::size_t{1} << 30;

/// A pool over a simulated device of `capacity` bytes, and a view of its layer.
struct sim_pool {
  explicit sim_pool(std::size_t capacity, vm_pool_options options = {})
      : pool(std::make_unique<simulated_vm_mapping>(simulated_vm_options{.capacity = capacity, .granularity = 2 * MiB, .final_state = nullptr}),
             std::move(options)),
        layer(dynamic_cast<simulated_vm_mapping&>(pool.mapping_layer())) {}
  vm_pool_resource pool;
  simulated_vm_mapping& layer;
};

/// Options with a chunk size (designated initializers would trip -Wmissing-field-initializers).
vm_pool_options chunked(std::size_t chunk) {
  vm_pool_options o;
  o.chunk_bytes = chunk;
  return o;
}
vm_pool_options with_limit(std::size_t chunk, std::size_t limit) {
  vm_pool_options o = chunked(chunk);
  o.physical_limit = limit;
  return o;
}

cudaStream_t fake_stream(std::uintptr_t n) { return reinterpret_cast<cudaStream_t>(n * 0x1000); }
std::uintptr_t addr(void* p) { return reinterpret_cast<std::uintptr_t>(p); }

/// Swiss cheese: fill with `small` blocks until failure, free every other one, then allocate
/// `large` blocks until failure. Returns large bytes obtained / bytes freed.
double swiss_cheese(vm_pool_resource& pool, std::size_t small, std::size_t large) {
  std::vector<void*> blocks;
  try {
    for (;;) {
      blocks.push_back(pool.allocate(small, 256, stream_view{}));
    }
  } catch (const out_of_memory&) {
  }
  std::size_t freed = 0;
  for (std::size_t i = 0; i < blocks.size(); i += 2) {
    pool.deallocate(blocks[i], small, 256, stream_view{});
    blocks[i] = nullptr;
    freed += small;
  }
  std::vector<void*> larges;
  try {
    for (;;) {
      larges.push_back(pool.allocate(large, 256, stream_view{}));
    }
  } catch (const out_of_memory&) {
  }
  const double fraction = static_cast<double>(larges.size() * large) / static_cast<double>(freed);
  for (void* p : larges) {
    pool.deallocate(p, large, 256, stream_view{});
  }
  for (void* p : blocks) {
    if (p != nullptr) {
      pool.deallocate(p, small, 256, stream_view{});
    }
  }
  return fraction;
}

}  // namespace

TEST_CASE("vm_pool: first allocation reserves, creates one chunk, maps it, sets access once") {
  sim_pool s{8 * GiB, chunked(32 * MiB)};
  void* p = s.pool.allocate(1000, 256, stream_view{});
  REQUIRE(p != nullptr);
  CHECK(addr(p) % 256 == 0);
  CHECK(s.layer.calls.reserve == 1);
  CHECK(s.layer.reserved_bytes() == 32 * GiB);  // 4x the device by default
  CHECK(s.layer.calls.create == 1);
  CHECK(s.layer.calls.map == 1);
  CHECK(s.layer.calls.set_access == 1);
  CHECK(s.layer.is_accessible(addr(p), 1000));
  const vm_pool_stats st = s.pool.vm_stats();
  CHECK(st.mapped_bytes == 32 * MiB);
  CHECK(st.used_bytes == 1024);
  CHECK(st.handles == 1);
  CHECK(st.granularity == 2 * MiB);
  // Reuse costs the driver nothing.
  s.pool.deallocate(p, 1000, 256, stream_view{});
  void* q = s.pool.allocate(4096, 256, stream_view{});
  CHECK(s.layer.calls.create == 1);
  CHECK(s.layer.calls.map == 1);
  s.pool.deallocate(q, 4096, 256, stream_view{});
  CHECK(s.pool.stats().used_bytes == 0);
}

TEST_CASE("vm_pool: a large request is backed by several chunks, contiguous and accessible") {
  sim_pool s{8 * GiB, chunked(32 * MiB)};
  void* p = s.pool.allocate(100 * MiB + 5, 256, stream_view{});
  CHECK(s.layer.calls.create == 4);  // 4 x 32 MiB
  CHECK(s.layer.calls.set_access == 1);
  CHECK(s.layer.is_accessible(addr(p), 100 * MiB + 5));
  s.pool.deallocate(p, 100 * MiB + 5, 256, stream_view{});
}

TEST_CASE("vm_pool: swiss cheese on the simulated device reuses >= 0.99 of the freed memory") {
  sim_pool s{8 * GiB, chunked(32 * MiB)};
  const double fraction = swiss_cheese(s.pool, 64 * MiB, 128 * MiB);
  CAPTURE(fraction);
  CHECK(fraction >= 0.99);
  const vm_pool_stats st = s.pool.vm_stats();
  CHECK(st.compactions >= 1);
  CHECK(st.compactions <= 2);  // free memory was gathered once, not per request
  CHECK(st.mapped_bytes <= 8 * GiB);
  CHECK(st.used_bytes == 0);
  CHECK(s.layer.violations == 0);
  // Twice in a row: the second run needs no new physical memory.
  const std::size_t growths = s.pool.vm_stats().growths;
  const std::size_t creates = s.layer.calls.create;
  CHECK(swiss_cheese(s.pool, 64 * MiB, 128 * MiB) >= 0.99);
  CHECK(s.pool.vm_stats().growths == growths);
  // A full device is probed once per shortfall, not once per handle size.
  CHECK(s.layer.calls.create - creates <= 3);
}

TEST_CASE("vm_pool: memory freed on another stream is ordered before reuse") {
  sim_pool s{1 * GiB};
  const cudaStream_t a = fake_stream(1);
  const cudaStream_t b = fake_stream(2);
  void* p = s.pool.allocate(MiB, 256, a);
  s.pool.deallocate(p, MiB, 256, a);
  CHECK(s.layer.calls.record_free == 1);
  void* q = s.pool.allocate(MiB, 256, a);  // same stream: no wait
  CHECK(s.layer.calls.order_after_free == 0);
  s.pool.deallocate(q, MiB, 256, a);
  void* r = s.pool.allocate(MiB, 256, b);  // another stream: waits on a's free event
  CHECK(s.layer.calls.order_after_free == 1);
  s.pool.deallocate(r, MiB, 256, b);
  void* t = s.pool.allocate(MiB);  // synchronous: the host waits
  CHECK(s.layer.calls.wait_for_free >= 1);
  s.pool.deallocate(t, MiB);  // a synchronous free records nothing: the block is complete
  CHECK(s.layer.calls.record_free == 3);
}

TEST_CASE("vm_pool: compaction orders the requesting stream after every recycled free") {
  sim_pool s{256 * MiB, chunked(32 * MiB)};
  const cudaStream_t a = fake_stream(1);
  const cudaStream_t b = fake_stream(2);
  std::vector<void*> blocks;
  for (int i = 0; i < 8; ++i) {
    blocks.push_back(s.pool.allocate(32 * MiB, 256, a));
  }
  CHECK_THROWS_AS(s.pool.allocate(32 * MiB, 256, a), out_of_memory);
  s.pool.deallocate(blocks[0], 32 * MiB, 256, a);
  s.pool.deallocate(blocks[2], 32 * MiB, 256, b);
  const auto waits = s.layer.calls.order_after_free;
  void* big = s.pool.allocate(64 * MiB, 256, b);  // needs both holes: compaction
  CHECK(s.pool.vm_stats().compactions == 1);
  CHECK(s.layer.calls.order_after_free == waits + 1);  // b waits for a's free (not its own)
  CHECK(s.layer.is_accessible(addr(big), 64 * MiB));
  CHECK(s.pool.vm_stats().stale_aliases == 2);
  CHECK(s.layer.violations == 0);
  s.pool.deallocate(big, 64 * MiB, 256, b);
  for (int i : {1, 3, 4, 5, 6, 7}) {
    s.pool.deallocate(blocks[i], 32 * MiB, 256, a);
  }
}

TEST_CASE("vm_pool: release gives back wholly free handles and stale aliases, not used ones") {
  sim_pool s{1 * GiB, chunked(32 * MiB)};
  void* keep = s.pool.allocate(MiB, 256, stream_view{});
  void* drop = s.pool.allocate(100 * MiB, 256, stream_view{});
  s.pool.deallocate(drop, 100 * MiB, 256, stream_view{});
  const std::size_t before = s.layer.physical_in_use();
  const std::size_t released = s.pool.release();
  CHECK(released > 0);
  CHECK(s.layer.physical_in_use() == before - released);
  CHECK(s.pool.vm_stats().mapped_bytes == s.layer.physical_in_use());
  CHECK(s.layer.is_accessible(addr(keep), MiB));
  CHECK(s.layer.calls.wait_for_all_frees >= 1);
  s.pool.deallocate(keep, MiB, 256, stream_view{});
  CHECK(s.pool.release() == s.layer.physical_in_use() - 0);  // everything left goes
  CHECK(s.layer.physical_in_use() == 0);
  CHECK(s.layer.violations == 0);
  void* again = s.pool.allocate(MiB, 256, stream_view{});  // and it still works
  s.pool.deallocate(again, MiB, 256, stream_view{});
}

TEST_CASE("vm_pool: destruction unmaps, releases and frees everything, even leaked blocks") {
  detail::simulated_vm_final_state final_state;
  cudamem_test::captured_errors errors;
  {
    vm_pool_resource pool{std::make_unique<simulated_vm_mapping>(
        simulated_vm_options{.capacity = GiB, .granularity = 2 * MiB, .final_state = &final_state})};
    void* leaked = pool.allocate(3 * MiB, 256, stream_view{});
    static_cast<void>(leaked);
    std::vector<void*> blocks;
    try {
      for (;;) {
        blocks.push_back(pool.allocate(96 * MiB, 256, stream_view{}));
      }
    } catch (const out_of_memory&) {
    }
    REQUIRE(blocks.size() >= 6);
    for (std::size_t i = 0; i < blocks.size(); i += 2) {
      pool.deallocate(blocks[i], 96 * MiB, 256, stream_view{});
    }
    void* big = pool.allocate(300 * MiB, 256, stream_view{});  // compaction: stale aliases
    CHECK(pool.vm_stats().stale_aliases > 0);
    pool.deallocate(big, 300 * MiB, 256, stream_view{});
    for (std::size_t i = 1; i < blocks.size(); i += 2) {
      pool.deallocate(blocks[i], 96 * MiB, 256, stream_view{});
    }
    CHECK_FALSE(final_state.destroyed);
  }
  REQUIRE(final_state.destroyed);
  CHECK(final_state.physical_in_use == 0);
  CHECK(final_state.mappings == 0);
  CHECK(final_state.reservations == 0);
  CHECK(final_state.violations == 0);
  REQUIRE(errors.messages().size() == 1);
  CHECK_THAT(errors.messages()[0], Catch::Contains("still allocated"));
}

TEST_CASE("vm_pool: near the end of the device, smaller handles are made") {
  sim_pool s{100 * MiB, chunked(64 * MiB)};
  void* a = s.pool.allocate(64 * MiB, 256, stream_view{});
  void* b = s.pool.allocate(36 * MiB, 256, stream_view{});  // 64 MiB will not fit: 32 + 4
  CHECK(s.layer.physical_in_use() == 100 * MiB);
  CHECK(s.layer.is_accessible(addr(b), 36 * MiB));
  CHECK_THROWS_AS(s.pool.allocate(2 * MiB, 256, stream_view{}), out_of_memory);
  s.pool.deallocate(a, 64 * MiB, 256, stream_view{});
  s.pool.deallocate(b, 36 * MiB, 256, stream_view{});
}

TEST_CASE("vm_pool: out_of_memory carries a report; nothing changes on failure") {
  sim_pool s{256 * MiB, chunked(32 * MiB)};
  void* a = s.pool.allocate(200 * MiB, 256, stream_view{});
  try {
    static_cast<void>(s.pool.allocate(100 * MiB, 256, stream_view{}));
    FAIL("expected out_of_memory");
  } catch (const out_of_memory& e) {
    CHECK(e.requested_bytes() == 100 * MiB);
    CHECK(e.report().chain.front().name == "vm_pool_resource");
    CHECK(e.verdict() == oom_verdict::exhausted);
    CHECK_THAT(std::string(e.what()), Catch::Contains("growth and compaction"));
  }
  CHECK(s.pool.stats().used_bytes == 200 * MiB);
  CHECK(s.layer.violations == 0);
  // Bigger than the device: refused before anything is tried.
  const auto creates = s.layer.calls.create;
  CHECK_THROWS_AS(s.pool.allocate(std::numeric_limits<std::size_t>::max(), 256, stream_view{}),
                  out_of_memory);
  CHECK_THROWS_AS(s.pool.allocate(GiB, 256, stream_view{}), out_of_memory);
  CHECK(s.layer.calls.create == creates);
  s.pool.deallocate(a, 200 * MiB, 256, stream_view{});
}

TEST_CASE("vm_pool: physical_limit is a budget") {
  sim_pool s{GiB, with_limit(32 * MiB, 64 * MiB)};
  void* a = s.pool.allocate(60 * MiB, 256, stream_view{});
  try {
    static_cast<void>(s.pool.allocate(10 * MiB, 256, stream_view{}));
    FAIL("expected out_of_memory");
  } catch (const out_of_memory& e) {
    CHECK(e.verdict() == oom_verdict::budget);
  }
  CHECK(s.layer.physical_in_use() <= 64 * MiB);
  s.pool.deallocate(a, 60 * MiB, 256, stream_view{});
}

TEST_CASE("vm_pool: bad input") {
  sim_pool s{GiB};
  CHECK(s.pool.allocate(0, 256, stream_view{}) == nullptr);
  s.pool.deallocate(nullptr, 10, 256, stream_view{});
  CHECK_THROWS_AS(s.pool.allocate(10, 3, stream_view{}), std::invalid_argument);
  CHECK_THROWS_AS(vm_pool_resource(std::unique_ptr<detail::vm_mapping_layer>{}),
                  std::invalid_argument);
  CHECK_THROWS_AS(vm_pool_resource(std::make_unique<simulated_vm_mapping>(), chunked(0)),
                  std::invalid_argument);
  // Large alignment is honoured.
  void* aligned = s.pool.allocate(100, 4 * MiB, stream_view{});
  CHECK(addr(aligned) % (4 * MiB) == 0);
  CHECK(s.layer.is_accessible(addr(aligned), 100));
  cudamem_test::captured_errors errors;
  int not_ours = 0;
  s.pool.deallocate(&not_ours, sizeof not_ours, 256, stream_view{});
  void* p = s.pool.allocate(1000, 256, stream_view{});
  s.pool.deallocate(p, 1000, 256, stream_view{});
  s.pool.deallocate(p, 1000, 256, stream_view{});  // double free
  void* q = s.pool.allocate(1000, 256, stream_view{});
  s.pool.deallocate(q, 5000, 256, stream_view{});  // size mismatch: reported, still freed
  REQUIRE(errors.messages().size() == 3);
  CHECK_THAT(errors.messages()[0], Catch::Contains("did not allocate"));
  CHECK_THAT(errors.messages()[1], Catch::Contains("already freed"));
  CHECK_THAT(errors.messages()[2], Catch::Contains("5000 bytes"));
  s.pool.deallocate(aligned, 100, 4 * MiB, stream_view{});
  CHECK(s.pool.stats().used_bytes == 0);
}

TEST_CASE("vm_pool: a failure inside the mapping layer leaks nothing") {
  sim_pool s{GiB, chunked(32 * MiB)};
  s.layer.fail_next_creates(100);  // the "device" says it is full
  CHECK_THROWS_AS(s.pool.allocate(MiB, 256, stream_view{}), out_of_memory);
  CHECK(s.layer.physical_in_use() == 0);
  CHECK(s.layer.violations == 0);
  // One failure on a fresh pool: it falls back to a smaller handle.
  sim_pool fresh{GiB, chunked(32 * MiB)};
  fresh.layer.fail_next_creates(1);
  void* p = fresh.pool.allocate(MiB, 256, stream_view{});
  CHECK(fresh.layer.physical_in_use() == 16 * MiB);
  fresh.pool.deallocate(p, MiB, 256, stream_view{});
  // And after the device said "full", memory coming back is found again.
  s.layer.fail_next_creates(0);
  void* q = s.pool.allocate(MiB, 256, stream_view{});
  CHECK(s.layer.is_accessible(addr(q), MiB));
  s.pool.deallocate(q, MiB, 256, stream_view{});
  CHECK(s.layer.violations == 0);
}

TEST_CASE("vm_pool: randomised against a model") {
  for (std::uint32_t seed : {1u, 2u, 3u, 4u}) {
    CAPTURE(seed);
    const std::size_t capacity = 512 * MiB;
    sim_pool s{capacity, chunked(std::size_t{4} << (20 + seed % 3))};
    std::mt19937_64 rng{seed};
    std::map<std::uintptr_t, std::size_t> live;  // the model: address -> bytes
    std::size_t ooms = 0;
    for (int op = 0; op < 4000; ++op) {
      const bool alloc = live.empty() || rng() % 100 < 55;
      if (alloc) {
        const int exponent = static_cast<int>(rng() % 25);  // 1 B .. 16 MiB, log-uniform-ish
        const std::size_t bytes = (std::size_t{1} << exponent) + rng() % 1000;
        const std::size_t alignment = std::size_t{256} << (rng() % 4);
        const cudaStream_t stream = fake_stream(1 + rng() % 3);
        void* p = nullptr;
        try {
          p = s.pool.allocate(bytes, alignment, stream);
        } catch (const out_of_memory&) {
          ++ooms;
          // Failing is allowed only when the memory is really not there.
          std::size_t live_bytes = 0;
          for (const auto& [a, b] : live) {
            live_bytes += (b + 255) / 256 * 256;
          }
          CHECK(live_bytes + bytes > capacity / 4);
          continue;
        }
        const std::uintptr_t a = addr(p);
        CHECK(a % alignment == 0);
        // No overlap with any live block.
        const auto next = live.lower_bound(a);
        if (next != live.end()) {
          REQUIRE(a + bytes <= next->first);
        }
        if (next != live.begin()) {
          const auto prev = std::prev(next);
          REQUIRE(prev->first + prev->second <= a);
        }
        REQUIRE(s.layer.is_accessible(a, bytes));
        live.emplace(a, bytes);
      } else {
        auto it = live.begin();
        std::advance(it, static_cast<long>(rng() % live.size()));
        s.pool.deallocate(reinterpret_cast<void*>(it->first), it->second, 256,
                          fake_stream(1 + rng() % 3));
        live.erase(it);
      }
      REQUIRE(s.layer.physical_in_use() <= capacity);
      if (op % 500 == 0) {
        const vm_pool_stats st = s.pool.vm_stats();
        CHECK(st.mapped_bytes == s.layer.physical_in_use());
        CHECK(st.free_bytes == st.recyclable_bytes + st.stranded_bytes);
        for (const auto& [a, b] : live) {
          REQUIRE(s.layer.is_accessible(a, b));
        }
      }
      if (op == 2000) {
        s.pool.release();  // mid-run: live blocks must stay mapped
      }
    }
    for (const auto& [a, b] : live) {
      REQUIRE(s.layer.is_accessible(a, b));
      s.pool.deallocate(reinterpret_cast<void*>(a), b, 256, fake_stream(1));
    }
    CHECK(s.pool.stats().used_bytes == 0);
    CHECK(s.layer.violations == 0);
  }
}

TEST_CASE("vm_pool: with no device, the real pool throws no_device_error") {
  if (has_device()) {
    SUCCEED("a device is present: the GPU tests cover the real pool");
    return;
  }
  CHECK_THROWS_AS(vm_pool_resource{0}, no_device_error);
  CHECK_THROWS_AS(vm_pool_resource{}, no_device_error);
}
