// vm_pool_resource (a pool_resource over a vm_resource) over the simulated mapping layer (no
// GPU): the composition's reports, swiss cheese and the bench's mixed trace on an 80 GiB
// device, the physical limit, destruction, bad input, and a randomised run against a model.
#include <cudamem/detail/vm/simulated_mapping.hpp>
#include <cudamem/failing_adaptor.hpp>
#include <cudamem/statistics_adaptor.hpp>
#include <cudamem/vm_pool_resource.hpp>
#include <cudamem/vm_resource.hpp>

#include "../../bench/support/fragmentation.hpp"
#include "captured_errors.hpp"

#include <catch2/catch.hpp>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <map>
#include <memory>
#include <random>
#include <utility>
#include <vector>

using namespace cudamem;
using detail::simulated_vm_mapping;
using detail::simulated_vm_options;

namespace {

constexpr std::size_t MiB = std::size_t{1} << 20;
constexpr std::size_t GiB = std::size_t{1} << 30;

/// A vm_pool over a simulated device of `capacity` bytes, and a view of its layer.
struct sim_pool {
  explicit sim_pool(std::size_t capacity, vm_pool_options options = {},
                    detail::simulated_vm_final_state* final_state = nullptr)
      : pool(std::make_unique<simulated_vm_mapping>(simulated_vm_options{
                 .capacity = capacity, .granularity = 2 * MiB, .final_state = final_state}),
             std::move(options)),
        layer(dynamic_cast<simulated_vm_mapping&>(pool.mapping_layer())) {}
  vm_pool_resource pool;
  simulated_vm_mapping& layer;
};

std::uintptr_t addr(void* p) { return reinterpret_cast<std::uintptr_t>(p); }

/// alloc/release callables for bench/support/fragmentation.hpp (nullptr on failure).
auto allocator_of(memory_resource& mr) {
  return [&mr](std::size_t n) -> void* {
    try {
      return mr.allocate(n);
    } catch (const out_of_memory&) {
      return nullptr;
    }
  };
}
auto releaser_of(memory_resource& mr) {
  return [&mr](void* p, std::size_t n) { mr.deallocate(p, n); };
}

}  // namespace

TEST_CASE("vm_pool: a pool over a vm_resource; small blocks cost the upstream nothing") {
  sim_pool s{8 * GiB};
  CHECK(s.pool.upstream() == &s.pool.upstream_vm());
  CHECK(s.pool.pool().upstream() == &s.pool.upstream_vm());
  CHECK(s.pool.device() == -1);
  void* p = s.pool.allocate(1000);
  CHECK(s.layer.is_accessible(addr(p), 1000));
  const auto maps = s.layer.calls.map;
  std::vector<void*> more;
  for (int i = 0; i < 100; ++i) {
    more.push_back(s.pool.allocate(64 * 1024));
  }
  CHECK(s.layer.calls.map == maps);  // served from the pool's chunk
  for (void* q : more) {
    s.pool.deallocate(q, 64 * 1024);
  }
  s.pool.deallocate(p, 1000);
  const vm_pool_stats st = s.pool.vm_stats();
  CHECK(st.pool_used_bytes == 0);
  CHECK(st.pool_chunks == 1);
  CHECK(st.used_bytes == 64 * MiB);  // the upstream lent one 64 MiB small chunk
  CHECK(st.mapped_bytes == 256 * MiB);
  CHECK(s.pool.release() == 256 * MiB);
  CHECK(s.layer.physical_in_use() == 0);
}

TEST_CASE("vm_pool: swiss cheese on a simulated 80 GiB device reuses >= 0.99, cold and warm") {
  sim_pool s{80 * GiB};
  auto alloc = allocator_of(s.pool);
  auto release = releaser_of(s.pool);
  const auto cold = cudamem_bench::swiss_cheese(alloc, release, 64 * MiB, 128 * MiB);
  CAPTURE(cold.numerator, cold.denominator);
  CHECK(cold.ratio >= 0.99);
  CHECK(cold.ratio <= 1.0);
  const vm_pool_stats between = s.pool.vm_stats();
  const auto warm = cudamem_bench::swiss_cheese(alloc, release, 64 * MiB, 128 * MiB);
  CHECK(warm.ratio >= 0.99);
  CHECK(warm.ratio <= 1.0);
  const vm_pool_stats st = s.pool.vm_stats();
  CHECK(st.handles_created == between.handles_created);  // no new physical memory when warm
  // Moving a handle is what costs (a map and its share of cuMemSetAccess): the warm run moves
  // each freed handle at most once, and only to be used.
  CAPTURE(st.maps - between.maps, st.compactions - between.compactions);
  CHECK(st.maps - between.maps <= warm.denominator / (64 * MiB));  // 64 MiB handles
  CHECK(st.mapped_bytes <= 80 * GiB);
  CHECK(s.layer.violations == 0);
}

TEST_CASE("vm_pool: a warm swiss cheese after the mixed trace is served by mapped memory") {
  // The bench's order: cold swiss, release, cold mixed (what it caches stays), warm swiss.
  sim_pool s{80 * GiB};
  auto alloc = allocator_of(s.pool);
  auto release = releaser_of(s.pool);
  static_cast<void>(cudamem_bench::swiss_cheese(alloc, release, 64 * MiB, 128 * MiB));
  s.pool.release();
  const auto mix = cudamem_bench::mixed(cudamem_bench::mixed_spec_gpu_for(80 * GiB), alloc, release);
  CHECK(mix.ratio >= 0.97);
  const vm_pool_stats before = s.pool.vm_stats();
  const auto calls_before = s.layer.calls;
  // The swiss cheese by hand, to count each phase.
  std::vector<void*> smalls;
  while (void* p = alloc(64 * MiB)) {
    smalls.push_back(p);
  }
  const vm_pool_stats filled = s.pool.vm_stats();
  std::size_t freed = 0;
  for (std::size_t i = 1; i < smalls.size(); i += 2) {
    release(smalls[i], 64 * MiB);
    smalls[i] = nullptr;
    freed += 64 * MiB;
  }
  std::size_t obtained = 0;
  std::vector<void*> larges;
  while (void* p = alloc(128 * MiB)) {
    larges.push_back(p);
    obtained += 128 * MiB;
  }
  const vm_pool_stats after = s.pool.vm_stats();
  CHECK(static_cast<double>(obtained) >= 0.99 * static_cast<double>(freed));
  // Nothing new, nothing unmapped: the memory the mixed trace left is moved, not made.
  CHECK(after.handles_created == before.handles_created);
  CHECK(s.layer.calls.unmap == calls_before.unmap);
  CHECK(after.unmaps == before.unmaps);
  // The 128 MiB phase: each freed handle moved at most once (a map each), one cuMemSetAccess
  // per compaction; only what the requests use is moved.
  CAPTURE(after.maps - filled.maps, after.compactions - filled.compactions,
          filled.maps - before.maps, filled.compactions - before.compactions);
  CHECK(after.maps - filled.maps <= freed / (64 * MiB));  // one per freed 64 MiB handle
  CHECK(after.access_calls - filled.access_calls == after.compactions - filled.compactions);
  // The fill: 64 MiB blocks are whole handles from the upstream's free ranges where they lie
  // (every chunk and large block is whole handles, so every free range holds whole 64 MiB
  // blocks): the fill moves nothing.
  CHECK(filled.maps - before.maps == 0);
  for (void* p : larges) {
    release(p, 128 * MiB);
  }
  for (void* p : smalls) {
    if (p != nullptr) {
      release(p, 64 * MiB);
    }
  }
  CHECK(s.layer.violations == 0);
}

TEST_CASE("vm_pool: a block of a handle or more gets whole handles of its own") {
  // Not a chunk the pool kept: a pool cuts a large block out of a cached chunk up to 1.25 times
  // its size, and the rest stays pinned while the block lives (the main reason a second run of
  // a trace stranded more than the first).
  sim_pool s{8 * GiB};
  void* a = s.pool.allocate(300 * MiB);
  s.pool.deallocate(a, 300 * MiB);
  void* b = s.pool.allocate(250 * MiB);
  const vm_pool_stats st = s.pool.vm_stats();
  CHECK(st.used_bytes == 256 * MiB);  // four 64 MiB handles, not the 300 MiB block's five
  CHECK(st.pool_chunks == 0);
  CHECK(s.layer.is_accessible(addr(b), 250 * MiB));
  // What the 300 MiB block left is the upstream's again: a 64 MiB block fits there.
  void* c = s.pool.allocate(64 * MiB);
  CHECK(s.pool.vm_stats().mapped_bytes == st.mapped_bytes);
  s.pool.deallocate(c, 64 * MiB);
  s.pool.deallocate(b, 250 * MiB);
  CHECK(s.pool.stats().used_bytes == 0);
  CHECK(s.layer.violations == 0);
}

TEST_CASE("vm_pool: small blocks after everything was freed land as in a fresh pool") {
  // 320 blocks of 1 MiB fill five 64 MiB small chunks; they are freed chunk by chunk in turn,
  // so the last ones freed lie in all five. Ten new blocks must share one chunk, as in a fresh
  // pool: a front-end cache full of the freed blocks would hand out blocks from all five, and
  // long-lived blocks would pin five chunks instead of one.
  sim_pool s{8 * GiB};
  std::vector<void*> blocks;
  for (int i = 0; i < 320; ++i) {
    blocks.push_back(s.pool.allocate(MiB));
  }
  REQUIRE(s.pool.vm_stats().pool_chunks == 5);
  for (std::size_t k = 0; k < 64; ++k) {
    for (std::size_t chunk = 0; chunk < 5; ++chunk) {
      s.pool.deallocate(blocks[chunk * 64 + k], MiB);
    }
  }
  std::vector<void*> again;
  for (int i = 0; i < 10; ++i) {
    again.push_back(s.pool.allocate(MiB));
  }
  s.pool.release();  // every chunk with nothing in it goes back
  CHECK(s.pool.vm_stats().pool_chunks == 1);
  for (void* p : again) {
    s.pool.deallocate(p, MiB);
  }
  CHECK(s.layer.violations == 0);
}

namespace {

/// alloc/release on stream index s (fake streams: the simulated layer only compares them).
auto stream_allocator_of(memory_resource& mr) {
  return [&mr](std::size_t n, std::size_t s) -> void* {
    try {
      return mr.allocate(n, 256, stream_view{reinterpret_cast<cudaStream_t>(0x1000 * (s + 1))});
    } catch (const out_of_memory&) {
      return nullptr;
    }
  };
}
auto stream_releaser_of(memory_resource& mr) {
  return [&mr](void* p, std::size_t n, std::size_t s) {
    mr.deallocate(p, n, 256, stream_view{reinterpret_cast<cudaStream_t>(0x1000 * (s + 1))});
  };
}

}  // namespace

TEST_CASE("vm_pool: a second run of each mixed-trace variant keeps as much live as the first") {
  // Each variant of bench/support/fragmentation.hpp on a simulated device, run to its first
  // failure on a fresh vm_pool (cold), then again on the same one (warm). The seeds and sizes
  // are ones where the second run used to strand more (warm 0.9815 vs cold 0.9887 for "wide"
  // seed 8): 80 GiB, and 81000 MiB, about what an H100 has free (not a multiple of a handle).
  // "bench" seed 4 is the one where the pool's front-end cache, left holding the first run's
  // freed small blocks, made the second run keep 0.9834 against 0.9957 (before
  // pool_options::cache_follows_use flushed it as the run's frees emptied the pool).
  struct run_case {
    const char* variant;
    std::uint64_t seed;
    std::size_t capacity;
  };
  const run_case cases[] = {
      {"bench", 1, 80 * GiB},          {"wide", 8, 81000 * MiB},
      {"many-small", 1, 81000 * MiB},  {"tiny", 4, 81000 * MiB},
      {"window16", 7, 81000 * MiB},    {"streams4", 1, 80 * GiB},
      {"bench", 4, 80 * GiB},
  };
  for (const run_case& c : cases) {
    CAPTURE(c.variant, c.seed, c.capacity);
    const auto& variants = cudamem_bench::mixed_variants();
    const auto v = std::find_if(variants.begin(), variants.end(),
                                [&](const auto& x) { return x.name == c.variant; });
    REQUIRE(v != variants.end());
    cudamem_bench::mixed_spec spec = v->make(c.capacity);
    spec.seed = c.seed;
    sim_pool s{c.capacity};
    const auto cold =
        cudamem_bench::mixed(spec, stream_allocator_of(s.pool), stream_releaser_of(s.pool));
    const auto warm =
        cudamem_bench::mixed(spec, stream_allocator_of(s.pool), stream_releaser_of(s.pool));
    CAPTURE(cold.ratio, warm.ratio);
    CHECK(cold.ratio >= 0.97);
    CHECK(warm.ratio >= 0.97);
    CHECK(warm.ratio >= cold.ratio);
    CHECK(s.pool.stats().used_bytes == 0);
    CHECK(s.layer.violations == 0);
    CHECK(s.layer.unmaps_in_flight == 0);
  }
}

TEST_CASE("vm_pool: the bench's mixed traces keep >= 0.97 of an 80 GiB device live") {
  for (const bool gpu_variant : {false, true}) {
    CAPTURE(gpu_variant);
    sim_pool s{80 * GiB};
    const cudamem_bench::mixed_spec spec = gpu_variant ? cudamem_bench::mixed_spec_gpu_for(80 * GiB)
                                                       : cudamem_bench::mixed_spec_for(80 * GiB);
    const auto result = cudamem_bench::mixed(spec, allocator_of(s.pool), releaser_of(s.pool));
    CAPTURE(result.numerator, result.ops);
    CHECK(result.ratio >= 0.97);
    CHECK(result.ratio <= 1.0);
    CHECK(s.pool.stats().used_bytes == 0);
    CHECK(s.layer.violations == 0);
  }
}

TEST_CASE("vm_pool: a physical limit of 1 GiB still serves 128 MiB after swiss cheese") {
  vm_pool_options options;
  options.physical_limit = GiB;
  sim_pool s{80 * GiB, options};
  std::vector<void*> blocks;
  for (int i = 0; i < 16; ++i) {
    blocks.push_back(s.pool.allocate(64 * MiB));
  }
  CHECK_THROWS_AS(s.pool.allocate(64 * MiB), out_of_memory);
  for (std::size_t i = 0; i < blocks.size(); i += 2) {
    s.pool.deallocate(blocks[i], 64 * MiB);
  }
  void* big = s.pool.allocate(128 * MiB);
  CHECK(s.layer.is_accessible(addr(big), 128 * MiB));
  CHECK(s.pool.vm_stats().compactions == 1);
  CHECK(s.layer.physical_in_use() <= GiB);
  s.pool.deallocate(big, 128 * MiB);
  for (std::size_t i = 1; i < blocks.size(); i += 2) {
    s.pool.deallocate(blocks[i], 64 * MiB);
  }
}

TEST_CASE("vm_pool: out_of_memory names the vm_pool and its upstream") {
  sim_pool s{256 * MiB};
  void* a = s.pool.allocate(200 * MiB);
  try {
    static_cast<void>(s.pool.allocate(100 * MiB));
    FAIL("expected out_of_memory");
  } catch (const out_of_memory& e) {
    CHECK(e.requested_bytes() == 100 * MiB);
    REQUIRE(e.report().chain.size() == 2);
    CHECK(e.report().chain[0].name == "vm_pool_resource");
    CHECK(e.report().chain[1].name == "vm_resource");
    CHECK_THAT(std::string(e.what()), Catch::Contains("upstream vm_resource"));
  }
  CHECK(s.pool.stats().used_bytes == 200 * MiB);
  CHECK_THROWS_AS(s.pool.allocate(std::numeric_limits<std::size_t>::max()), out_of_memory);
  s.pool.deallocate(a, 200 * MiB);
  CHECK(s.layer.violations == 0);
}

TEST_CASE("vm_pool: destruction gives everything back, even with blocks still allocated") {
  detail::simulated_vm_final_state final_state;
  cudamem_test::captured_errors errors;
  {
    sim_pool s{GiB, {}, &final_state};
    void* leaked = s.pool.allocate(3 * MiB);
    static_cast<void>(leaked);
    std::vector<void*> blocks;
    try {
      for (;;) {
        blocks.push_back(s.pool.allocate(96 * MiB));
      }
    } catch (const out_of_memory&) {
    }
    REQUIRE(blocks.size() >= 6);
    for (std::size_t i = 0; i < blocks.size(); i += 2) {
      s.pool.deallocate(blocks[i], 96 * MiB);
    }
    void* big = s.pool.allocate(250 * MiB);  // the pool gives chunks back; they are recycled
    CHECK(s.pool.vm_stats().stale_aliases > 0);
    s.pool.deallocate(big, 250 * MiB);
    for (std::size_t i = 1; i < blocks.size(); i += 2) {
      s.pool.deallocate(blocks[i], 96 * MiB);
    }
  }
  REQUIRE(final_state.destroyed);
  CHECK(final_state.physical_in_use == 0);
  CHECK(final_state.mappings == 0);
  CHECK(final_state.reservations == 0);
  CHECK(final_state.violations == 0);
  REQUIRE_FALSE(errors.messages().empty());
  CHECK_THAT(errors.messages()[0], Catch::Contains("still allocated"));
}

TEST_CASE("vm_pool: bad input") {
  sim_pool s{GiB};
  CHECK(s.pool.allocate(0) == nullptr);
  s.pool.deallocate(nullptr, 10);
  CHECK_THROWS_AS(s.pool.allocate(10, 3), std::invalid_argument);
  CHECK_THROWS_AS(vm_pool_resource(std::unique_ptr<detail::vm_mapping_layer>{}),
                  std::invalid_argument);
  vm_pool_options no_handles;
  no_handles.handle_bytes = 0;
  CHECK_THROWS_AS(vm_pool_resource(std::make_unique<simulated_vm_mapping>(), no_handles),
                  std::invalid_argument);
  vm_pool_options bad_pool;
  bad_pool.pool.shards = 3;
  CHECK_THROWS_AS(vm_pool_resource(std::make_unique<simulated_vm_mapping>(), bad_pool),
                  std::invalid_argument);
  vm_pool_options tiny_limit;
  tiny_limit.physical_limit = 32 * MiB;  // less than one 64 MiB handle
  CHECK_THROWS_AS(vm_pool_resource(std::make_unique<simulated_vm_mapping>(), tiny_limit),
                  std::invalid_argument);
  void* aligned = s.pool.allocate(100, 4 * MiB);
  CHECK(addr(aligned) % (4 * MiB) == 0);
  void* big_aligned = s.pool.allocate(100 * MiB, 256 * MiB);  // a large block, aligned
  CHECK(addr(big_aligned) % (256 * MiB) == 0);
  cudamem_test::captured_errors errors;
  int not_ours = 0;
  s.pool.deallocate(&not_ours, sizeof not_ours);
  CHECK(errors.messages().size() == 1);
  s.pool.deallocate(&not_ours, 100 * MiB);  // large: the upstream's, which reports it
  CHECK(errors.messages().size() == 2);
  // A size on the other side of the line between the pool's blocks and the upstream's is a bad
  // free: reported, nothing freed, nothing miscounted.
  void* large = s.pool.allocate(100 * MiB);
  s.pool.deallocate(large, 10 * MiB);
  CHECK(errors.messages().size() == 3);
  void* small = s.pool.allocate(MiB);
  s.pool.deallocate(small, 100 * MiB);
  CHECK(errors.messages().size() == 4);
  CHECK(s.pool.vm_stats().large_used_bytes == 200 * MiB);
  CHECK(s.pool.stats().used_bytes >= 200 * MiB + MiB);
  s.pool.deallocate(small, MiB);
  s.pool.deallocate(large, 100 * MiB);
  s.pool.deallocate(aligned, 100, 4 * MiB);
  s.pool.deallocate(big_aligned, 100 * MiB, 256 * MiB);
  CHECK(s.pool.stats().used_bytes == 0);
  CHECK(s.pool.vm_stats().large_used_bytes == 0);
  CHECK(s.layer.violations == 0);
}

TEST_CASE("vm_pool: a chunk is never freed as a large block, with or without an adaptor") {
  // Over its own vm_resource the pool's large blocks are marked there and recorded nowhere
  // else (detail/vm/large_blocks.hpp); over an adaptor they are recorded in the pool. Either
  // way, the base of one of the pool's chunks freed with a large size is a bad free.
  vm_pool_options with_adaptor;
  with_adaptor.upstream_adaptor = [](vm_resource& vm) {
    return std::make_unique<statistics_adaptor>(vm);
  };
  for (const bool adaptor : {false, true}) {
    CAPTURE(adaptor);
    sim_pool s{8 * GiB, adaptor ? with_adaptor : vm_pool_options{}};
    void* small = s.pool.allocate(MiB);
    const auto chunks = s.pool.pool().chunk_ranges();
    REQUIRE(chunks.size() == 1);
    REQUIRE(addr(small) == chunks[0].first);  // the chunk's base: what the vm_resource gave
    void* large = s.pool.allocate(100 * MiB);
    const std::size_t mapped_used = s.pool.upstream_vm().stats().used_bytes;
    cudamem_test::captured_errors errors;
    s.pool.deallocate(small, 64 * MiB);  // the chunk's size, even
    s.pool.deallocate(static_cast<char*>(large) + 4 * MiB, 96 * MiB);  // inside a large block
    CHECK(errors.messages().size() == 2);
    CHECK(s.pool.upstream_vm().stats().used_bytes == mapped_used);
    CHECK(s.pool.vm_stats().large_used_bytes == 100 * MiB);
    s.pool.deallocate(large, 100 * MiB);
    s.pool.deallocate(large, 100 * MiB);  // a double free of a large block
    CHECK(errors.messages().size() == 3);
    CHECK(s.pool.vm_stats().large_used_bytes == 0);
    CHECK(s.pool.vm_stats().large_peak_bytes == 100 * MiB);
    s.pool.deallocate(small, MiB);
    CHECK(s.pool.stats().used_bytes == 0);
    CHECK(s.layer.violations == 0);
  }
}

TEST_CASE("vm_pool: a failure at any call of the upstream leaks nothing, marked or recorded") {
  // A small block (a chunk), a large block and a medium one (a chunk of its own), freed in
  // turn; the k-th call to the upstream fails (once, then from there on). What succeeded is
  // freed; then nothing is in use and the large blocks' count is 0.
  const auto run = [](vm_pool_resource& pool) {
    std::vector<std::pair<void*, std::size_t>> made;
    bool failed = false;
    for (const std::size_t bytes : {MiB, 100 * MiB, 20 * MiB, 64 * MiB}) {
      try {
        made.emplace_back(pool.allocate(bytes), bytes);
      } catch (const out_of_memory&) {
        failed = true;
      }
    }
    for (const auto& [p, bytes] : made) {
      pool.deallocate(p, bytes);
    }
    CHECK(pool.stats().used_bytes == 0);
    CHECK(pool.vm_stats().large_used_bytes == 0);
    return failed;
  };
  SECTION("recorded: an adaptor between the pool and its vm_resource fails") {
    failing_adaptor* faults = nullptr;
    vm_pool_options options;
    options.upstream_adaptor = [&faults](vm_resource& vm) {
      auto made = std::make_unique<failing_adaptor>(vm);
      faults = made.get();
      return made;
    };
    for (const bool from_then_on : {false, true}) {
      for (std::size_t k = 1; k <= 6; ++k) {
        CAPTURE(from_then_on, k);
        sim_pool s{8 * GiB, options};
        from_then_on ? faults->fail_from(k) : faults->fail_call(k);
        run(s.pool);
        s.pool.release();
        CHECK(s.pool.upstream_vm().stats().used_bytes == 0);
        CHECK(s.layer.violations == 0);
      }
    }
  }
  SECTION("marked: the device under the vm_resource fails") {
    sim_pool s{8 * GiB};
    s.layer.fail_next_creates(1000);  // nothing can be mapped: every request fails
    CHECK(run(s.pool));
    s.layer.fail_next_creates(0);
    CHECK_FALSE(run(s.pool));  // and then nothing was left behind in the way
    s.pool.release();
    CHECK(s.pool.upstream_vm().stats().used_bytes == 0);
    CHECK(s.layer.violations == 0);
  }
}

TEST_CASE("vm_pool: an upstream_adaptor sees every chunk and large block, both ways") {
  statistics_adaptor* seen = nullptr;
  vm_pool_options options;
  options.upstream_adaptor = [&seen](vm_resource& vm) {
    auto made = std::make_unique<statistics_adaptor>(vm);
    seen = made.get();
    return made;
  };
  sim_pool s{8 * GiB, options};
  REQUIRE(seen != nullptr);
  CHECK(s.pool.upstream_adaptor() == seen);
  CHECK(s.pool.upstream() == seen);  // reports walk this, the adaptor, the vm_resource
  CHECK(s.pool.pool().upstream() == seen);
  CHECK(seen->upstream() == &s.pool.upstream_vm());
  void* small = s.pool.allocate(MiB);
  void* medium = s.pool.allocate(20 * MiB);
  void* large = s.pool.allocate(100 * MiB, 256, stream_view{});
  CHECK(seen->counters().allocations == 3);  // a small chunk, a medium chunk, the large block
  CHECK(seen->counters().current_bytes == 64 * MiB + 64 * MiB + 100 * MiB);
  s.pool.deallocate(large, 100 * MiB, 256, stream_view{});
  CHECK(seen->counters().current_bytes == 128 * MiB);
  s.pool.deallocate(small, MiB);
  s.pool.deallocate(medium, 20 * MiB);
  CHECK(seen->counters().current_bytes == 128 * MiB);  // the pool keeps its chunks ...
  s.pool.release();
  CHECK(seen->counters().current_bytes == 0);          // ... until release()
  CHECK(seen->counters().deallocations == 3);
  void* full = s.pool.allocate(7 * GiB);
  try {
    static_cast<void>(s.pool.allocate(2 * GiB));
    FAIL("expected out_of_memory");
  } catch (const out_of_memory& e) {
    REQUIRE(e.report().chain.size() == 3);
    CHECK(e.report().chain[1].name == "statistics_adaptor");
    CHECK(e.report().chain[2].name == "vm_resource");
  }
  s.pool.deallocate(full, 7 * GiB);
  CHECK(s.layer.violations == 0);
}

TEST_CASE("vm_pool: an upstream_adaptor that does not lead to the vm_resource is refused") {
  vm_pool_options none;
  none.upstream_adaptor = [](vm_resource&) { return std::unique_ptr<memory_resource>{}; };
  CHECK_THROWS_WITH(vm_pool_resource(std::make_unique<simulated_vm_mapping>(), none),
                    Catch::Contains("made no resource"));
  vm_resource elsewhere{std::make_unique<simulated_vm_mapping>()};
  vm_pool_options unrelated;
  unrelated.upstream_adaptor = [&elsewhere](vm_resource&) -> std::unique_ptr<memory_resource> {
    return std::make_unique<statistics_adaptor>(elsewhere);
  };
  CHECK_THROWS_WITH(vm_pool_resource(std::make_unique<simulated_vm_mapping>(), unrelated),
                    Catch::Contains("do not lead to the vm_pool's vm_resource"));
  vm_pool_options throwing;
  throwing.upstream_adaptor = [](vm_resource&) -> std::unique_ptr<memory_resource> {
    throw std::runtime_error("factory failed");
  };
  detail::simulated_vm_final_state final_state;
  CHECK_THROWS_WITH(
      vm_pool_resource(std::make_unique<simulated_vm_mapping>(simulated_vm_options{
                           .final_state = &final_state}),
                       throwing),
      "factory failed");
  CHECK(final_state.destroyed);  // the vm_resource made before it is gone, and left nothing
  CHECK(final_state.mappings == 0);
  CHECK(final_state.reservations == 0);
}

TEST_CASE("vm_pool: a small block freed with a large size never frees the pool's chunk") {
  // The upstream's ranges are the pool's chunks as well as the large blocks: a bad free of the
  // block at a chunk's start must not give that chunk back under the pool.
  sim_pool s{GiB};
  void* small = s.pool.allocate(MiB);
  void* neighbour = s.pool.allocate(MiB);
  const vm_pool_stats before = s.pool.vm_stats();
  REQUIRE(before.pool_chunks == 1);
  cudamem_test::captured_errors errors;
  s.pool.deallocate(small, 64 * MiB);
  CHECK(errors.messages().size() == 1);
  const vm_pool_stats after = s.pool.vm_stats();
  CHECK(after.used_bytes == before.used_bytes);  // the chunk is still lent to the pool
  CHECK(after.pool_chunks == 1);
  CHECK(s.layer.is_accessible(addr(neighbour), MiB));
  s.pool.deallocate(neighbour, MiB);
  s.pool.deallocate(small, MiB);
  CHECK(s.pool.stats().used_bytes == 0);
  CHECK(s.layer.violations == 0);
}

TEST_CASE("vm_pool: stats count the large blocks beside the pool's") {
  sim_pool s{8 * GiB};
  void* small = s.pool.allocate(MiB);
  void* large = s.pool.allocate(300 * MiB);
  const resource_stats st = s.pool.stats();
  const vm_pool_stats vst = s.pool.vm_stats();
  CHECK(vst.large_used_bytes == 300 * MiB);
  CHECK(st.used_bytes == vst.pool_used_bytes + 300 * MiB);
  CHECK(st.reserved_bytes == 64 * MiB + 300 * MiB);  // one small chunk, one large block
  CHECK(st.peak_used_bytes >= st.used_bytes);
  s.pool.deallocate(large, 300 * MiB);
  CHECK(s.pool.stats().used_bytes == vst.pool_used_bytes);
  CHECK(s.pool.stats().peak_used_bytes >= st.used_bytes);
  s.pool.deallocate(small, MiB);
}

TEST_CASE("vm_pool: a driver failure while mapping a large block leaks nothing") {
  detail::simulated_vm_final_state final_state;
  {
    sim_pool s{GiB, {}, &final_state};
    s.layer.fail_map_after(2);
    CHECK_THROWS_AS(s.pool.allocate(300 * MiB), std::runtime_error);
    CHECK(s.layer.physical_in_use() == 0);
    CHECK(s.pool.stats().used_bytes == 0);
    CHECK(s.pool.vm_stats().large_used_bytes == 0);
    void* p = s.pool.allocate(300 * MiB);  // and the next try works
    CHECK(s.layer.is_accessible(addr(p), 300 * MiB));
    s.pool.deallocate(p, 300 * MiB);
    CHECK(s.layer.violations == 0);
  }
  CHECK(final_state.physical_in_use == 0);
  CHECK(final_state.mappings == 0);
  CHECK(final_state.violations == 0);
}

TEST_CASE("vm_pool: randomised against a model") {
  for (std::uint32_t seed : {1u, 2u, 3u}) {
    CAPTURE(seed);
    const std::size_t capacity = GiB;
    sim_pool s{capacity};
    std::mt19937_64 rng{seed};
    std::map<std::uintptr_t, std::size_t> live;  // the model: address -> bytes
    for (int op = 0; op < 4000; ++op) {
      if (live.empty() || rng() % 100 < 55) {
        const int exponent = static_cast<int>(rng() % 27);  // 1 B .. 64 MiB
        const std::size_t bytes = (std::size_t{1} << exponent) + rng() % 1000;
        void* p = nullptr;
        try {
          p = s.pool.allocate(bytes);
        } catch (const out_of_memory&) {
          continue;
        }
        const std::uintptr_t a = addr(p);
        const auto next = live.lower_bound(a);
        if (next != live.end()) {
          REQUIRE(a + bytes <= next->first);
        }
        if (next != live.begin()) {
          REQUIRE(std::prev(next)->first + std::prev(next)->second <= a);
        }
        REQUIRE(s.layer.is_accessible(a, bytes));
        live.emplace(a, bytes);
      } else {
        auto it = live.begin();
        std::advance(it, static_cast<long>(rng() % live.size()));
        s.pool.deallocate(reinterpret_cast<void*>(it->first), it->second);
        live.erase(it);
      }
      REQUIRE(s.layer.physical_in_use() <= capacity);
      if (op % 1000 == 999) {
        s.pool.release();  // live blocks stay mapped
        for (const auto& [a, b] : live) {
          REQUIRE(s.layer.is_accessible(a, b));
        }
      }
    }
    for (const auto& [a, b] : live) {
      s.pool.deallocate(reinterpret_cast<void*>(a), b);
    }
    CHECK(s.pool.stats().used_bytes == 0);
    CHECK(s.pool.release() > 0);
    CHECK(s.layer.physical_in_use() == 0);
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
