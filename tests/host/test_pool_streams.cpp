// pool_resource's stream order, on the host: which free block a request on one
// stream gets when blocks freed on other streams are about, and which CUDA calls that costs.
// The pools here track streams over simulated memory with a model of the device's event calls
// (detail::host_stream_events: an event completes only when the test says so), so each test
// can say exactly which waits a request must produce; pool_options::stream_reuse =
// when_complete (grow rather than wait) and its bad values too. The last test replays random
// work on four streams (waiting, the cache following use, when_complete) and checks, at every
// allocation, the contract itself: memory last freed on another stream is handed out only once
// that free is known complete or the requesting stream waits for it.
#include <cudamem/detail/pool/host_stream_events.hpp>
#include <cudamem/detail/pool/stream_ledger.hpp>
#include <cudamem/detail/vm/simulated_mapping.hpp>
#include <cudamem/pool_resource.hpp>
#include <cudamem/simulated_resource.hpp>
#include <cudamem/vm_pool_resource.hpp>
#include <cudamem/vm_resource.hpp>

#include "captured_errors.hpp"

#include <catch2/catch.hpp>

#include <algorithm>
#include <cstdint>
#include <map>
#include <random>
#include <thread>
#include <unordered_map>
#include <vector>

using namespace cudamem;
using detail::host_stream_events;

namespace {

constexpr std::size_t KiB = std::size_t{1} << 10;
constexpr std::size_t MiB = std::size_t{1} << 20;

/// Stream handles the model knows by value (never passed to CUDA).
cudaStream_t fake_stream(std::uintptr_t n) { return reinterpret_cast<cudaStream_t>(n * 0x1000); }

const cudaStream_t A = fake_stream(1);
const cudaStream_t B = fake_stream(2);
const cudaStream_t C = fake_stream(3);

/// One shard, so every block is in reach of every request.
pool_options one_shard(pool_options o = {}) {
  o.shards = 1;
  return o;
}

}  // namespace

TEST_CASE("pool streams: over simulated memory with no model installed, nothing is tracked") {
  simulated_resource device;
  pool_resource pool{device, one_shard()};
  void* p = pool.allocate(64 * KiB, 256, A);
  pool.deallocate(p, 64 * KiB, 256, A);
  CHECK(pool.allocate(64 * KiB, 256, B) == p);  // no wait: the memory is not stream-ordered
  pool.deallocate(p, 64 * KiB, 256, B);
  const pool_stream_stats s = pool.stream_stats();
  CHECK(s.cross_stream_blocks == 0);
  CHECK(s.event_records == 0);
  CHECK(s.upstream_allocations == 1);
}

TEST_CASE("pool streams: the cache serves a request from a block its own stream freed") {
  host_stream_events events;
  const detail::scoped_pool_stream_events use{events};
  simulated_resource device;
  pool_resource pool{device, one_shard()};

  void* on_a = pool.allocate(64 * KiB, 256, A);
  void* on_b = pool.allocate(64 * KiB, 256, B);
  pool.deallocate(on_a, 64 * KiB, 256, A);
  pool.deallocate(on_b, 64 * KiB, 256, B);  // B's block is on top of the stack now

  // A's request: B's block would need a wait for B's work; A's own needs none.
  CHECK(pool.allocate(64 * KiB, 256, A) == on_a);
  CHECK(events.calls().record == 0);
  CHECK(events.calls().wait == 0);
  CHECK(events.calls().query == 0);
  pool_stream_stats s = pool.stream_stats();
  CHECK(s.preferred_blocks == 1);
  CHECK(s.cross_stream_blocks == 0);

  // None of A's fits any more: B's block goes, and A waits for B's free on the device.
  CHECK(pool.allocate(64 * KiB, 256, A) == on_b);
  CHECK(events.calls().record == 1);
  CHECK(events.calls().query == 1);
  CHECK(events.calls().wait == 1);
  CHECK(events.last_wait().stream == A);
  s = pool.stream_stats();
  CHECK(s.cross_stream_blocks == 1);
  CHECK(s.event_records == 1);
  CHECK(s.stream_waits == 1);
  pool.deallocate(on_a, 64 * KiB, 256, A);
  pool.deallocate(on_b, 64 * KiB, 256, A);
}

TEST_CASE("pool streams: the heap serves a request from its own stream's block, even when "
          "another stream's fits better") {
  host_stream_events events;
  const detail::scoped_pool_stream_events use{events};
  simulated_resource device;
  // No cache: every block goes through the TLSF heap.
  pool_resource pool{device, one_shard({.cache_bytes = 0})};

  // [A's 1 MiB + 64 KiB][kept][B's 1 MiB][kept][rest of the chunk]: the kept blocks stop the
  // freed ones from merging with each other or with the rest.
  void* on_a = pool.allocate(MiB + 64 * KiB, 256, A);
  void* keep1 = pool.allocate(4 * KiB, 256, C);
  void* on_b = pool.allocate(MiB, 256, B);
  void* keep2 = pool.allocate(4 * KiB, 256, C);
  pool.deallocate(on_a, MiB + 64 * KiB, 256, A);
  pool.deallocate(on_b, MiB, 256, B);

  // B's block is the exact fit (TLSF's usual pick); A's is larger but needs no wait.
  void* first = pool.allocate(MiB, 256, A);
  CHECK(first == on_a);
  CHECK(events.calls().wait == 0);
  CHECK(events.calls().record == 0);
  CHECK(pool.stream_stats().preferred_blocks == 1);

  // A's remaining 64 KiB cannot hold another 1 MiB: now B's block, with a wait.
  void* second = pool.allocate(MiB, 256, A);
  CHECK(second == on_b);
  CHECK(events.calls().wait == 1);
  CHECK(events.last_wait().stream == A);

  pool.deallocate(first, MiB, 256, A);
  pool.deallocate(second, MiB, 256, A);
  pool.deallocate(keep1, 4 * KiB, 256, C);
  pool.deallocate(keep2, 4 * KiB, 256, C);
}

TEST_CASE("pool streams: a block known complete is taken without a call") {
  host_stream_events events;
  const detail::scoped_pool_stream_events use{events};
  simulated_resource device;
  pool_resource pool{device, one_shard()};

  std::vector<void*> blocks;
  for (int i = 0; i < 4; ++i) {
    blocks.push_back(pool.allocate(64 * KiB, 256, B));
  }
  for (void* p : blocks) {
    pool.deallocate(p, 64 * KiB, 256, B);
  }
  events.complete_at_record(true);  // an idle device: B's work is done by the time it is asked
  CHECK(pool.allocate(64 * KiB, 256, A) != nullptr);  // records B's event, finds it complete
  CHECK(events.calls().record == 1);
  CHECK(events.calls().query == 1);
  CHECK(events.calls().wait == 0);
  for (int i = 0; i < 3; ++i) {  // the rest: known complete, no call at all
    CHECK(pool.allocate(64 * KiB, 256, A) != nullptr);
  }
  CHECK(events.calls().record == 1);
  CHECK(events.calls().query == 1);
  CHECK(events.calls().wait == 0);
  CHECK(pool.stream_stats().cross_stream_blocks == 1);
  CHECK(pool.stats().used_bytes == 4 * 64 * KiB);
  for (void* p : blocks) {
    pool.deallocate(p, 64 * KiB, 256, A);
  }
}

TEST_CASE("pool streams: a stream waits once for another stream's frees, not once per block") {
  host_stream_events events;
  const detail::scoped_pool_stream_events use{events};
  simulated_resource device;
  pool_resource pool{device, one_shard()};

  // A stream-step on B: 12 blocks of assorted sizes, freed.
  const std::vector<std::size_t> sizes = {4 * KiB,  16 * KiB, 64 * KiB,  256 * KiB,
                                          1 * MiB,  3 * MiB,  8 * KiB,   32 * KiB,
                                          128 * KiB, 512 * KiB, 2 * MiB, 12 * KiB};
  std::vector<void*> blocks;
  for (std::size_t n : sizes) {
    blocks.push_back(pool.allocate(n, 256, B));
  }
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    pool.deallocate(blocks[i], sizes[i], 256, B);
  }
  // The same stream-step on A: every block B freed, with B's work still running.
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    blocks[i] = pool.allocate(sizes[i], 256, A);
  }
  CHECK(events.calls().record == 1);  // one recording covers all of B's frees
  CHECK(events.calls().wait == 1);    // and A waits for it once
  CHECK(events.calls().query == 1);
  pool_stream_stats s = pool.stream_stats();
  CHECK(s.stream_waits == 1);
  CHECK(s.cross_stream_blocks >= 1);
  CHECK(s.waits_skipped == s.cross_stream_blocks - 1);

  // B frees again (new frees, not covered by A's wait): A must wait again, once.
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    pool.deallocate(blocks[i], sizes[i], 256, A);
  }
  std::vector<void*> on_b;
  for (std::size_t n : sizes) {
    on_b.push_back(pool.allocate(n, 256, B));  // takes A's frees: B waits for A, once
  }
  CHECK(events.calls().wait == 2);
  CHECK(events.last_wait().stream == B);
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    pool.deallocate(on_b[i], sizes[i], 256, B);
  }
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    blocks[i] = pool.allocate(sizes[i], 256, A);
  }
  CHECK(events.calls().record == 3);  // B's event again, covering the new frees
  CHECK(events.calls().wait == 3);
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    pool.deallocate(blocks[i], sizes[i], 256, A);
  }
}

TEST_CASE("pool streams: a block freed on more streams than a tag holds waits for those "
          "streams, never for the whole device") {
  host_stream_events events;
  const detail::scoped_pool_stream_events use{events};
  simulated_resource device;
  // No cache: the freed blocks merge in the heap, and their tags with them.
  pool_resource pool{device, one_shard({.cache_bytes = 0})};
  const std::vector<cudaStream_t> five = {A, B, C, fake_stream(4), fake_stream(5)};
  const cudaStream_t requester = fake_stream(6);

  // Five neighbours, each freed on its own stream: one free range, five streams in its tag.
  std::vector<void*> blocks;
  for (std::size_t i = 0; i < five.size(); ++i) {
    blocks.push_back(pool.allocate(64 * KiB, 256, five[i]));
  }
  void* keep = pool.allocate(4 * KiB, 256, requester);  // the rest of the chunk stays apart
  for (std::size_t i = 0; i < five.size(); ++i) {
    pool.deallocate(blocks[i], 64 * KiB, 256, five[i]);
  }

  SECTION("a request on a stream: that stream waits for each of the five, on the device") {
    void* p = pool.allocate(5 * 64 * KiB, 256, requester);
    CHECK(p == blocks[0]);
    CHECK(events.calls().synchronize_device == 0);
    CHECK(events.calls().record == 5);
    CHECK(events.calls().wait == 5);
    CHECK(events.last_wait().stream == requester);
    const pool_stream_stats s = pool.stream_stats();
    CHECK(s.wide_tags == 1);
    CHECK(s.device_syncs == 0);
    CHECK(s.cross_stream_blocks == 1);
    pool.deallocate(p, 5 * 64 * KiB, 256, requester);
  }
  SECTION("once the device has caught up: no wait at all") {
    events.complete_at_record(true);
    void* p = pool.allocate(5 * 64 * KiB, 256, requester);
    CHECK(p == blocks[0]);
    CHECK(events.calls().wait == 0);
    CHECK(events.calls().synchronize_device == 0);
    CHECK(events.calls().query == 5);
    pool.deallocate(p, 5 * 64 * KiB, 256, requester);
  }
  SECTION("the synchronous form waits for each of the five on the host") {
    void* p = pool.allocate(5 * 64 * KiB);
    CHECK(p == blocks[0]);
    CHECK(events.calls().synchronize == 5);
    CHECK(events.calls().synchronize_device == 0);
    CHECK(pool.stream_stats().host_waits == 5);
    pool.deallocate(p, 5 * 64 * KiB);
  }
  pool.deallocate(keep, 4 * KiB, 256, requester);
}

TEST_CASE("pool streams: a remembered wait is not trusted for a new stream with the same "
          "handle, nor after the stream is retired") {
  host_stream_events events;
  const detail::scoped_pool_stream_events use{events};
  simulated_resource device;
  pool_resource pool{device, one_shard()};

  std::vector<void*> blocks;
  for (int i = 0; i < 6; ++i) {
    blocks.push_back(pool.allocate(64 * KiB, 256, B));
  }
  for (void* p : blocks) {
    pool.deallocate(p, 64 * KiB, 256, B);
  }
  void* first = pool.allocate(64 * KiB, 256, A);
  CHECK(events.calls().wait == 1);
  void* second = pool.allocate(64 * KiB, 256, A);
  CHECK(events.calls().wait == 1);  // remembered

  events.recreate(A);  // A destroyed behind the pool's back; a new stream got its handle
  void* third = pool.allocate(64 * KiB, 256, A);
  CHECK(events.calls().wait == 2);  // the new A waited for nothing: it must wait itself
  void* fourth = pool.allocate(64 * KiB, 256, A);
  CHECK(events.calls().wait == 2);  // and now it has

  pool.retire_stream(A);  // the documented way to say A goes: its waits are forgotten
  void* fifth = pool.allocate(64 * KiB, 256, A);
  CHECK(events.calls().wait == 3);
  CHECK(pool.stream_stats().stream_waits == 3);
  for (void* p : {first, second, third, fourth, fifth}) {
    pool.deallocate(p, 64 * KiB, 256, A);
  }
}

TEST_CASE("pool streams: waits of default streams are never remembered") {
  host_stream_events events;
  const detail::scoped_pool_stream_events use{events};
  simulated_resource device;
  pool_resource pool{device, one_shard()};

  std::vector<void*> blocks;
  for (int i = 0; i < 3; ++i) {
    blocks.push_back(pool.allocate(64 * KiB, 256, B));
  }
  for (void* p : blocks) {
    pool.deallocate(p, 64 * KiB, 256, B);
  }
  // cudaStreamPerThread names another stream on every thread: each block is waited for.
  for (int i = 0; i < 3; ++i) {
    blocks[static_cast<std::size_t>(i)] = pool.allocate(64 * KiB, 256, stream_view::per_thread());
  }
  CHECK(events.calls().wait == 3);
  CHECK(events.calls().stream_id == 0);
  CHECK(pool.stream_stats().waits_skipped == 0);
  for (void* p : blocks) {
    pool.deallocate(p, 64 * KiB, 256, stream_view::per_thread());
  }
}

TEST_CASE("pool streams: a thread that starts after another has ended does not take its frees "
          "as its own") {
  // A thread frees a block on its per-thread stream and ends; its kernels may still read the
  // block. The next thread usually gets the ended one's std::thread::id (glibc reuses the
  // thread's descriptor), but its per-thread stream is another stream: taking the block needs
  // a wait for the first thread's free (detail/stream_tag.hpp). The pool used to tell
  // per-thread streams apart by thread id, and handed the block over with no wait.
  host_stream_events events;
  const detail::scoped_pool_stream_events use{events};
  simulated_resource device;
  pool_resource pool{device, one_shard()};

  void* freed = nullptr;
  std::thread::id first_thread;
  std::thread{[&] {
    first_thread = std::this_thread::get_id();
    freed = pool.allocate(64 * KiB, 256, stream_view::per_thread());
    pool.deallocate(freed, 64 * KiB, 256, stream_view::per_thread());  // recorded at once
  }}.join();
  CHECK(events.calls().record == 1);
  void* taken = nullptr;
  std::thread::id second_thread;
  std::thread{[&] {
    second_thread = std::this_thread::get_id();
    taken = pool.allocate(64 * KiB, 256, stream_view::per_thread());
    pool.deallocate(taken, 64 * KiB, 256, stream_view::per_thread());
  }}.join();
  INFO("the second thread had the first one's id: " << (first_thread == second_thread));
  CHECK(taken == freed);                 // the only free block, merged with the chunk's rest
  CHECK(events.calls().wait == 1);       // ordered after the first thread's free
  CHECK(pool.stream_stats().cross_stream_blocks == 1);
  CHECK(events.calls().stream_id == 0);  // a default stream's wait is never remembered
}

TEST_CASE("pool streams: the synchronous allocate waits on the host, and prefers blocks that "
          "need no wait") {
  host_stream_events events;
  const detail::scoped_pool_stream_events use{events};
  simulated_resource device;
  pool_resource pool{device, one_shard()};

  void* p = pool.allocate(64 * KiB, 256, B);
  pool.deallocate(p, 64 * KiB, 256, B);
  void* q = pool.allocate(64 * KiB);  // synchronous: ready for everyone on return
  CHECK(q == p);
  CHECK(events.calls().synchronize == 1);
  CHECK(events.calls().wait == 0);
  CHECK(pool.stream_stats().host_waits == 1);
  pool.deallocate(q, 64 * KiB);  // the synchronous free: idle memory, no tag
  CHECK(pool.allocate(64 * KiB, 256, A) == q);
  CHECK(events.calls().record == 1);
  pool.deallocate(q, 64 * KiB, 256, A);
}

TEST_CASE("pool streams: benchmarks can build the pool as it was before (first pick, a wait "
          "per block)") {
  host_stream_events events;
  const detail::scoped_pool_stream_events use{events};
  simulated_resource device;
  const detail::scoped_pool_stream_choices before{{.prefer_ready = false, .remember_waits = false}};
  pool_resource pool{device, one_shard()};

  void* on_a = pool.allocate(64 * KiB, 256, A);
  std::vector<void*> on_b;
  for (int i = 0; i < 3; ++i) {
    on_b.push_back(pool.allocate(64 * KiB, 256, B));
  }
  pool.deallocate(on_a, 64 * KiB, 256, A);
  for (void* p : on_b) {
    pool.deallocate(p, 64 * KiB, 256, B);
  }
  std::vector<void*> again;
  for (int i = 0; i < 3; ++i) {
    again.push_back(pool.allocate(64 * KiB, 256, A));  // B's, last freed first
  }
  CHECK(again[0] == on_b[2]);
  CHECK(events.calls().wait == 3);  // one per block
  CHECK(events.calls().query == 3);
  CHECK(pool.stream_stats().preferred_blocks == 0);
  CHECK(pool.stream_stats().waits_skipped == 0);
  for (void* p : again) {
    pool.deallocate(p, 64 * KiB, 256, A);
  }
}

TEST_CASE("pool streams: vm_pool's pool prefers its own stream's blocks too") {
  host_stream_events events;
  const detail::scoped_pool_stream_events use{events};
  vm_pool_resource vm{std::make_unique<detail::simulated_vm_mapping>()};
  void* on_a = vm.allocate(256 * KiB, 256, A);
  void* on_b = vm.allocate(256 * KiB, 256, B);
  void* keep = vm.allocate(4 * KiB, 256, C);  // in use: the cache follows use, keep it full
  vm.deallocate(on_a, 256 * KiB, 256, A);
  vm.deallocate(on_b, 256 * KiB, 256, B);
  CHECK(vm.allocate(256 * KiB, 256, A) == on_a);
  CHECK(events.calls().wait == 0);
  CHECK(vm.pool().stream_stats().preferred_blocks == 1);
  vm.deallocate(on_a, 256 * KiB, 256, A);
  vm.deallocate(keep, 4 * KiB, 256, C);
}

TEST_CASE("pool streams: bad stream_reuse values are refused") {
  simulated_resource device;
  CHECK_THROWS_AS(pool_resource(device, {.stream_reuse = static_cast<stream_reuse_policy>(7)}),
                  std::invalid_argument);
  vm_pool_options o;
  o.pool.stream_reuse = static_cast<stream_reuse_policy>(-1);
  CHECK_THROWS_AS(vm_pool_resource(std::make_unique<detail::simulated_vm_mapping>(), o),
                  std::invalid_argument);
  CHECK_NOTHROW(pool_resource(device, {.stream_reuse = stream_reuse_policy::when_complete}));
}

TEST_CASE("pool streams: when_complete grows rather than wait, and reuses once the free is "
          "known complete") {
  host_stream_events events;
  const detail::scoped_pool_stream_events use{events};
  simulated_resource device;
  pool_resource pool{device, one_shard({.small_chunk_size = 4 * MiB,
                                        .stream_reuse = stream_reuse_policy::when_complete})};

  // B fills the one small chunk and frees it all: every byte has B's work pending.
  std::vector<void*> on_b;
  for (int i = 0; i < 4; ++i) {
    on_b.push_back(pool.allocate(MiB, 256, B));
  }
  for (void* p : on_b) {
    pool.deallocate(p, MiB, 256, B);
  }
  CHECK(pool.stream_stats().upstream_allocations == 1);

  // A's request: nothing it may have without a wait, so a new chunk.
  void* a1 = pool.allocate(MiB, 256, A);
  CHECK(std::find(on_b.begin(), on_b.end(), a1) == on_b.end());
  CHECK(pool.stream_stats().upstream_allocations == 2);
  CHECK(events.calls().wait == 0);
  // B's own request needs no wait either (its own memory, or the new chunk's), nor growth.
  void* b1 = pool.allocate(MiB, 256, B);
  CHECK(pool.stream_stats().upstream_allocations == 2);
  CHECK(events.calls().wait == 0);

  // The device catches up: B's frees are complete, and A may have B's memory with no wait.
  events.complete_all();
  void* a2 = pool.allocate(MiB, 256, A);
  void* a3 = pool.allocate(MiB, 256, A);
  void* a4 = pool.allocate(MiB, 256, A);
  void* a5 = pool.allocate(MiB, 256, A);
  CHECK(pool.stream_stats().upstream_allocations == 2);
  CHECK(events.calls().wait == 0);
  CHECK(pool.stream_stats().stream_waits == 0);
  for (void* p : {a1, a2, a3, a4, a5}) {
    pool.deallocate(p, MiB, 256, A);
  }
  pool.deallocate(b1, MiB, 256, B);
}

TEST_CASE("pool streams: when_complete waits after all when the upstream cannot supply") {
  host_stream_events events;
  const detail::scoped_pool_stream_events use{events};
  simulated_resource device;
  pool_resource pool{device, one_shard({.maximum_size = 4 * MiB, .small_chunk_size = 4 * MiB,
                                        .stream_reuse = stream_reuse_policy::when_complete})};
  void* kept = pool.allocate(MiB, 256, C);  // the chunk is never wholly free: not given back
  std::vector<void*> on_b;
  for (int i = 0; i < 3; ++i) {
    on_b.push_back(pool.allocate(MiB, 256, B));
  }
  for (void* p : on_b) {
    pool.deallocate(p, MiB, 256, B);
  }
  void* a = pool.allocate(MiB, 256, A);  // no room to grow: B's memory, with a wait
  CHECK(reinterpret_cast<std::uintptr_t>(a) >= reinterpret_cast<std::uintptr_t>(on_b[0]));
  CHECK(events.calls().wait == 1);
  CHECK(events.last_wait().stream == A);
  CHECK(pool.stream_stats().upstream_allocations == 1);
  pool.deallocate(a, MiB, 256, A);
  pool.deallocate(kept, MiB, 256, C);
}

namespace {

/// A model device for the random test: it knows, for each event, which frees (by stream and
/// count of frees issued on it) its last record covers, and for each stream, what it waited
/// for; so the test can check every hand-out against the contract.
class checking_events final : public detail::stream_event_driver {
 public:
  /// Called by the test before each free on `s`.
  void issued_free(cudaStream_t s) { ++issued_[s]; }
  [[nodiscard]] std::uint64_t issued(cudaStream_t s) { return issued_[s]; }

  /// The device catches up with everything recorded so far.
  void complete_all() {
    for (auto& [event, e] : events_) {
      completed_[e.stream] = std::max(completed_[e.stream], e.covers);
    }
  }
  /// Whether the free number `n` on `s` is safe for work on `t` now: complete, or covered by
  /// a wait `t` made.
  [[nodiscard]] bool safe_for(cudaStream_t t, cudaStream_t s, std::uint64_t n) {
    if (t == s || completed_[s] >= n) {
      return true;
    }
    const auto it = waited_.find(t);
    return it != waited_.end() && it->second[s] >= n;
  }

  void record(cudaEvent_t& event, cudaStream_t stream, int /*device*/) override {
    if (event == nullptr) {
      event = reinterpret_cast<cudaEvent_t>(++next_);
    }
    events_[event] = {stream, issued_[stream]};
  }
  bool query(cudaEvent_t event) override {
    const entry& e = events_.at(event);
    return completed_[e.stream] >= e.covers;
  }
  void wait(cudaStream_t stream, cudaEvent_t event) override {
    const entry& e = events_.at(event);
    std::uint64_t& w = waited_[stream][e.stream];
    w = std::max(w, e.covers);
  }
  void synchronize(cudaEvent_t event) override {
    const entry& e = events_.at(event);
    completed_[e.stream] = std::max(completed_[e.stream], e.covers);
  }
  void synchronize_device(int /*device*/) override {
    for (auto& [s, n] : issued_) {
      completed_[s] = n;
    }
  }
  cudaError_t synchronize_stream(cudaStream_t stream) noexcept override {
    completed_[stream] = issued_[stream];
    return cudaSuccess;
  }
  std::uint64_t stream_id(cudaStream_t stream) noexcept override {
    return reinterpret_cast<std::uint64_t>(stream);
  }
  void destroy(cudaEvent_t event) noexcept override { events_.erase(event); }

 private:
  struct entry {
    cudaStream_t stream;
    std::uint64_t covers;  ///< frees issued on `stream` when it was recorded
  };
  std::uintptr_t next_ = 0;
  std::unordered_map<cudaEvent_t, entry> events_;
  std::unordered_map<cudaStream_t, std::uint64_t> issued_;
  std::unordered_map<cudaStream_t, std::uint64_t> completed_;
  std::unordered_map<cudaStream_t, std::unordered_map<cudaStream_t, std::uint64_t>> waited_;
};

/// Which stream last freed each byte range, and as its how-manyth free.
class last_frees {
 public:
  struct span {
    std::uintptr_t end;
    cudaStream_t stream;
    std::uint64_t number;
  };
  void freed(std::uintptr_t begin, std::uintptr_t end, cudaStream_t s, std::uint64_t n) {
    erase(begin, end);
    spans_[begin] = {end, s, n};
  }
  /// Calls f(span) for every recorded span overlapping [begin, end).
  template <class F>
  void overlapping(std::uintptr_t begin, std::uintptr_t end, F&& f) const {
    auto it = spans_.upper_bound(begin);
    if (it != spans_.begin()) {
      --it;
    }
    for (; it != spans_.end() && it->first < end; ++it) {
      if (it->second.end > begin) {
        f(it->second);
      }
    }
  }

 private:
  void erase(std::uintptr_t begin, std::uintptr_t end) {
    auto it = spans_.upper_bound(begin);
    if (it != spans_.begin()) {
      --it;
    }
    while (it != spans_.end() && it->first < end) {
      const std::uintptr_t b = it->first;
      const span s = it->second;
      if (s.end <= begin) {
        ++it;
        continue;
      }
      it = spans_.erase(it);
      if (b < begin) {
        spans_[b] = {begin, s.stream, s.number};
      }
      if (s.end > end) {
        spans_[end] = {s.end, s.stream, s.number};
        break;
      }
    }
  }
  std::map<std::uintptr_t, span> spans_;
};

}  // namespace

TEST_CASE("pool streams: random work on four and on six streams never reuses memory before "
          "its free is complete or waited for") {
  checking_events events;
  const detail::scoped_pool_stream_events use{events};
  simulated_resource device;
  // Six streams: free blocks merge frees from more streams than a tag holds (wide tags).
  const std::size_t stream_count = GENERATE(std::size_t{4}, std::size_t{6});
  std::vector<cudaStream_t> streams;
  for (std::size_t i = 1; i <= stream_count; ++i) {
    streams.push_back(fake_stream(i));
  }
  for (const int variant : {0, 1, 2}) {
    const bool cache_follows_use = variant == 1;
    const stream_reuse_policy reuse =
        variant == 2 ? stream_reuse_policy::when_complete : stream_reuse_policy::wait;
    pool_resource pool{device, {.small_chunk_size = 4 * MiB, .shards = 2,
                                .cache_follows_use = cache_follows_use, .stream_reuse = reuse}};
    struct live {
      void* p;
      std::size_t bytes;  ///< asked for
      std::size_t real;   ///< the block's own size
      cudaStream_t stream;
    };
    std::vector<live> blocks;
    last_frees history;
    std::mt19937_64 rng(39);
    std::size_t violations = 0;
    std::size_t cross_checks = 0;
    for (int op = 0; op < 20000; ++op) {
      const std::uint64_t r = rng();
      if (r % 97 == 0) {
        events.complete_all();  // now and then the device catches up
      }
      if (blocks.empty() || (r >> 8) % 100 < 52) {
        const cudaStream_t s = streams[(r >> 16) % streams.size()];
        // Log-uniform-ish sizes, 256 B to 8 MiB: both tiers, the cache and the heap.
        const std::size_t bytes = (std::size_t{256} << ((r >> 20) % 16)) + (r >> 40) % 4096;
        const bool synchronous = (r >> 32) % 50 == 0;
        const std::size_t used_before = pool.stats().used_bytes;
        void* p = synchronous ? pool.allocate(bytes) : pool.allocate(bytes, 256, s);
        // The whole block the request got (a cached one may be up to 1/8 larger than asked):
        // its every byte's last free must be safe for the requesting stream.
        const std::size_t real = pool.stats().used_bytes - used_before;
        const auto begin = reinterpret_cast<std::uintptr_t>(p);
        history.overlapping(begin, begin + real, [&](const last_frees::span& f) {
          ++cross_checks;
          // The synchronous form: complete (nobody's waits count).
          const bool safe = events.safe_for(synchronous ? nullptr : s, f.stream, f.number);
          violations += safe ? 0 : 1;
        });
        blocks.push_back({p, bytes, real, synchronous ? cudaStream_t{nullptr} : s});
      } else {
        const std::size_t k = (r >> 24) % blocks.size();
        const live b = blocks[k];
        blocks[k] = blocks.back();
        blocks.pop_back();
        // Most frees on the allocating stream, some on another (a hand-off).
        const cudaStream_t s =
            b.stream != nullptr && (r >> 48) % 4 != 0 ? b.stream : streams[(r >> 52) % streams.size()];
        events.issued_free(s);
        const auto begin = reinterpret_cast<std::uintptr_t>(b.p);
        history.freed(begin, begin + b.real, s, events.issued(s));
        pool.deallocate(b.p, b.bytes, 256, s);
      }
    }
    for (const live& b : blocks) {
      pool.deallocate(b.p, b.bytes, 256, b.stream != nullptr ? b.stream : A);
    }
    CHECK(violations == 0);
    CHECK(cross_checks > 1000);
    const pool_stream_stats s = pool.stream_stats();
    CHECK(s.preferred_blocks > 0);
    if (reuse == stream_reuse_policy::wait) {
      CHECK(s.cross_stream_blocks > 0);
      CHECK(s.waits_skipped > 0);
      CHECK(s.stream_waits > 0);
      if (stream_count > detail::pending_frees::capacity && !cache_follows_use) {
        CHECK(s.wide_tags > 0);
      }
    }
  }
}

TEST_CASE("pool streams: no event is recorded on a stream being captured into a graph; "
          "prepare_for_graph_capture records it before") {
  host_stream_events events;
  const detail::scoped_pool_stream_events use{events};
  simulated_resource device;
  pool_resource pool{device, one_shard()};

  SECTION("without it, a block freed on the captured stream cannot cross: a typed error, and "
          "the block stays in the pool") {
    void* on_b = pool.allocate(64 * KiB, 256, B);
    pool.deallocate(on_b, 64 * KiB, 256, B);
    events.set_capturing(B, true);
    try {
      static_cast<void>(pool.allocate(64 * KiB, 256, A));
      FAIL("allocate returned");
    } catch (const cuda_error& e) {
      CHECK(e.code() == cudaErrorStreamCaptureUnsupported);
      CHECK_THAT(e.what(), Catch::Contains("prepare_for_graph_capture"));
    }
    CHECK(events.calls().record == 0);
    CHECK(pool.stats().used_bytes == 0);
    events.set_capturing(B, false);  // the capture ended: the same block, with a wait
    CHECK(pool.allocate(64 * KiB, 256, A) == on_b);
    CHECK(events.calls().wait == 1);
    pool.deallocate(on_b, 64 * KiB, 256, A);
  }

  SECTION("with it, the block goes to another stream during the capture, ordered by the "
          "event recorded before; nothing is recorded on the captured stream") {
    void* on_b = pool.allocate(64 * KiB, 256, B);
    pool.deallocate(on_b, 64 * KiB, 256, B);
    prepare_for_graph_capture();
    CHECK(events.calls().record == 1);
    CHECK(pool.cover_frees() == 0);  // nothing more is owed
    events.set_capturing(B, true);
    void* first = pool.allocate(64 * KiB, 256, A);
    CHECK(first == on_b);
    CHECK(events.calls().record == 1);
    CHECK(events.calls().wait == 1);
    CHECK(events.last_wait().stream == A);
    pool.deallocate(first, 64 * KiB, 256, A);
    events.set_capturing(B, false);
  }

  SECTION("a stream already being captured is left alone, and covered once its capture ends") {
    void* on_c = pool.allocate(64 * KiB, 256, C);
    pool.deallocate(on_c, 64 * KiB, 256, C);
    events.set_capturing(C, true);
    prepare_for_graph_capture();  // no error, no record
    CHECK(events.calls().record == 0);
    CHECK(pool.cover_frees() == 0);
    CHECK(events.calls().capturing >= 2);
    events.set_capturing(C, false);
    CHECK(pool.cover_frees() == 1);
    CHECK(events.calls().record == 1);
  }
}
