// The PyTorch allocator's torch-free parts (python/cudamem/_torch), with no GPU and no PyTorch:
// graph pools (chunks kept for one owner, same-stream reuse, blocks placed again at their
// addresses for a checkpoint), a snapshot's layout (segments tiled by blocks and gaps),
// PyTorch's statistics as cudamem keeps them, the history ring, and the timer of the
// allocator's own calls.
#include <call_timer.hpp>
#include <graph_pool.hpp>
#include <snapshot_layout.hpp>
#include <stats.hpp>
#include <trace_ring.hpp>

#include <catch2/catch.hpp>

#include <chrono>
#include <cstdint>
#include <map>
#include <stdexcept>
#include <thread>
#include <vector>

using namespace cudamem::torch_bridge;

namespace {
constexpr std::size_t MiB = std::size_t{1} << 20;

/// Chunks from a pretend device: addresses far apart, a byte budget, every call counted.
class fake_source final : public chunk_source {
 public:
  explicit fake_source(std::size_t capacity = 1024 * MiB) : capacity_(capacity) {}
  void* allocate_chunk(std::size_t bytes, void* stream) override {
    if (held + bytes > capacity_) {
      return nullptr;
    }
    held += bytes;
    ++allocations;
    next_ += std::uintptr_t{1} << 32;  // chunks never adjacent: merging must stay inside one
    chunks[next_] = {bytes, stream};
    return reinterpret_cast<void*>(next_);
  }
  void deallocate_chunk(void* p, std::size_t bytes, void* stream) noexcept override {
    const auto it = chunks.find(reinterpret_cast<std::uintptr_t>(p));
    ok = ok && it != chunks.end() && it->second.first == bytes && it->second.second == stream;
    chunks.erase(it);
    held -= bytes;
  }
  std::size_t held = 0;
  std::size_t allocations = 0;
  bool ok = true;
  std::map<std::uintptr_t, std::pair<std::size_t, void*>> chunks;

 private:
  std::size_t capacity_;
  std::uintptr_t next_ = 0;
};

void* stream(int i) { return reinterpret_cast<void*>(static_cast<std::uintptr_t>(0x1000 * i)); }
std::uintptr_t at(const void* p) { return reinterpret_cast<std::uintptr_t>(p); }
}  // namespace

TEST_CASE("graph pool: chunks sized as PyTorch's, blocks reused on their own stream only") {
  graph_pool pool;
  fake_source source;
  void* a = pool.allocate(512 * 1024, stream(1), source);  // small: a 2 MiB chunk
  REQUIRE(a != nullptr);
  CHECK(pool.last_new_chunk() == at(a));
  CHECK(pool.chunks().at(at(a)).bytes == 2 * MiB);
  CHECK(pool.chunks().at(at(a)).small);
  void* b = pool.allocate(512 * 1024, stream(1), source);  // the same chunk
  CHECK(at(b) == at(a) + 512 * 1024);
  CHECK(pool.last_new_chunk() == 0);
  void* c = pool.allocate(3 * MiB, stream(1), source);     // medium: a 20 MiB chunk
  CHECK(pool.chunks().at(at(c)).bytes == 20 * MiB);
  void* d = pool.allocate(33 * MiB, stream(1), source);    // large: its size, rounded to 2 MiB
  CHECK(pool.chunks().at(at(d)).bytes == 34 * MiB);
  CHECK(source.allocations == 3);
  CHECK(pool.used_bytes() == MiB + 36 * MiB);
  // Freed on stream 1: the next request on stream 1 takes it; stream 2 never does.
  pool.deallocate(a, 512 * 1024);
  CHECK(pool.allocate(512 * 1024, stream(1), source) == a);
  pool.deallocate(a, 512 * 1024);
  void* e = pool.allocate(512 * 1024, stream(2), source);
  CHECK(e != a);
  CHECK(pool.chunks().at(at(e)).stream == stream(2));
  // The source has no more: nullptr, nothing changes.
  fake_source empty{0};
  CHECK(pool.allocate(64 * MiB, stream(3), empty) == nullptr);
  for (auto [p, n] : {std::pair{b, 512 * 1024}, {c, 3 * MiB}, {d, 33 * MiB}, {e, 512 * 1024}}) {
    pool.deallocate(p, static_cast<std::size_t>(n));
  }
  CHECK(pool.used_bytes() == 0);
  const auto released = pool.release(source);
  CHECK(released.size() == 4);
  CHECK_FALSE(pool.has_chunks());
  CHECK(source.held == 0);
  CHECK(source.ok);  // every chunk back with its size and stream
}

TEST_CASE("graph pool: free ranges merge inside a chunk, best fit, whole chunks go back") {
  graph_pool pool;
  fake_source source;
  std::vector<void*> blocks;
  for (int i = 0; i < 4; ++i) {
    blocks.push_back(pool.allocate(512 * 1024, stream(1), source));  // fill one 2 MiB chunk
  }
  CHECK(source.allocations == 1);
  pool.deallocate(blocks[1], 512 * 1024);
  pool.deallocate(blocks[2], 512 * 1024);  // merges with [1]: one free MiB
  const auto pieces = pool.pieces_of(at(blocks[0]));
  REQUIRE(pieces.size() == 3);
  CHECK(pieces[1].free);
  CHECK(pieces[1].bytes == MiB);
  CHECK(pool.largest_free() == MiB);
  CHECK(pool.allocate(MiB, stream(1), source) == blocks[1]);  // fits the merged range exactly
  CHECK(pool.release(source).empty());                       // no chunk is wholly free
  for (void* p : {blocks[0], blocks[1], blocks[3]}) {
    pool.deallocate(p, p == blocks[1] ? MiB : 512 * 1024);
  }
  CHECK(pool.pieces_of(at(blocks[0])).size() == 1);  // all one free range again
  CHECK(pool.release(source).size() == 1);
}

TEST_CASE("graph pool: a checkpoint's blocks are placed again at their addresses") {
  graph_pool pool;
  fake_source source;
  void* a = pool.allocate(MiB, stream(1), source);
  void* b = pool.allocate(512 * 1024, stream(1), source);
  pool.deallocate(a, MiB);
  pool.deallocate(b, 512 * 1024);
  CHECK(pool.allocate_at(b, 512 * 1024));  // b's range is free: taken again, exactly there
  CHECK_FALSE(pool.allocate_at(b, 512 * 1024));  // taken now
  CHECK_FALSE(pool.allocate_at(static_cast<char*>(a) + 768 * 1024, 512 * 1024));  // overlaps b
  CHECK(pool.allocate_at(a, MiB));
  CHECK(pool.used_bytes() == MiB + 512 * 1024);
  int elsewhere = 0;
  CHECK_FALSE(pool.allocate_at(&elsewhere, 512));  // in no chunk
}

TEST_CASE("graph pool: no_split gives every block a chunk of its own") {
  graph_pool pool;
  pool.set_no_split();
  fake_source source;
  void* a = pool.allocate(512 * 1024, stream(1), source);
  void* b = pool.allocate(512 * 1024, stream(1), source);
  CHECK(source.allocations == 2);
  CHECK(pool.block_size_for(512 * 1024) == 2 * MiB);
  pool.deallocate(a, 2 * MiB);
  pool.deallocate(b, 2 * MiB);
  CHECK(pool.release(source).size() == 2);
}

TEST_CASE("snapshot layout: segments tiled by blocks and gaps, holes taken out") {
  const std::vector<span> mapped{{0x1000, 0x9000}, {0x20000, 0x4000}};
  const std::vector<span> holes{{0x3000, 0x2000}};  // a graph pool's chunk inside the first
  const std::vector<span> mine = subtract(mapped, holes);
  REQUIRE(mine.size() == 3);
  CHECK((mine[0].address == 0x1000 && mine[0].bytes == 0x2000));
  CHECK((mine[1].address == 0x5000 && mine[1].bytes == 0x5000));
  CHECK((mine[2].address == 0x20000 && mine[2].bytes == 0x4000));
  const std::vector<span> blocks{{0x1800, 0x800}, {0x5000, 0x1000}, {0x7000, 0x1000},
                                 {0x9800, 0x1000},   // across the second segment's end
                                 {0x30000, 0x100}};  // in no segment
  const layout l = lay_out(mine, blocks);
  REQUIRE(l.segments.size() == 3);
  for (const laid_segment& s : l.segments) {  // every segment covered exactly, in order
    std::uintptr_t next = s.range.address;
    for (const laid_piece& p : s.pieces) {
      CHECK(p.address == next);
      next += p.bytes;
    }
    CHECK(next == s.range.end());
  }
  REQUIRE(l.segments[0].pieces.size() == 3);  // gap, block, gap
  CHECK(l.segments[0].pieces[0].block == npos);
  CHECK(l.segments[0].pieces[1].block == 0);
  CHECK(l.segments[0].pieces[2].block == npos);
  REQUIRE(l.segments[1].pieces.size() == 4);  // block, gap, block, gap
  CHECK(l.segments[1].pieces[2].block == 2);
  CHECK(l.segments[2].pieces.size() == 1);
  CHECK(l.loose == std::vector<std::size_t>{3, 4});
}

TEST_CASE("snapshot layout: a graph pool's used range cut into the blocks side by side in it") {
  // Two 512-byte tensors next to each other are one used range to the pool, two blocks to
  // PyTorch (its CUDA graph trees count live blocks in the snapshot).
  const std::map<std::uintptr_t, std::size_t> live{{0x1000, 0x200}, {0x1200, 0x200},
                                                   {0x1400, 0x600}};
  const auto bytes_at = [&](std::uintptr_t a) -> std::size_t {
    const auto it = live.find(a);
    return it == live.end() ? 0 : it->second;
  };
  const std::vector<span> three = blocks_tiling({0x1000, 0xa00}, bytes_at);
  REQUIRE(three.size() == 3);
  CHECK((three[0].address == 0x1000 && three[0].bytes == 0x200));
  CHECK((three[1].address == 0x1200 && three[1].bytes == 0x200));
  CHECK((three[2].address == 0x1400 && three[2].bytes == 0x600));
  // Where no block starts, the rest stays with the block before it; at the start, whole.
  const std::vector<span> rest = blocks_tiling({0x1000, 0x1000}, bytes_at);
  REQUIRE(rest.size() == 3);
  CHECK((rest[2].address == 0x1400 && rest[2].bytes == 0xc00));
  const std::vector<span> whole = blocks_tiling({0x5000, 0x400}, bytes_at);
  REQUIRE(whole.size() == 1);
  CHECK((whole[0].address == 0x5000 && whole[0].bytes == 0x400));
  // A block larger than what is left of the range is not believed.
  const std::vector<span> short_range = blocks_tiling({0x1400, 0x200}, bytes_at);
  REQUIRE(short_range.size() == 1);
  CHECK(short_range[0].bytes == 0x200);
}

TEST_CASE("statistics: roundup_power2_divisions rounds as PyTorch's allocator does") {
  // PyTorch's own test (test_allocator_settings) computes the expected size this way: from
  // half the next power of two, steps of a `divisions`-th of that half until the size is
  // reached.
  const auto by_steps = [](std::size_t size, std::size_t divisions) {
    std::size_t pow2 = 1;
    while (pow2 < size) {
      pow2 *= 2;
    }
    if (pow2 == size) {
      return pow2;
    }
    const std::size_t step = pow2 / 2 / divisions;
    std::size_t at = pow2 / 2;
    while (at < size) {
      at += step;
    }
    return at;
  };
  CHECK(rounded_block_size(84 * MiB, 4) == 96 * MiB);  // the test's 21 Mi floats
  CHECK(rounded_block_size(84 * MiB, 1) == 84 * MiB);  // 1 or 0: no divisions
  CHECK(rounded_block_size(84 * MiB, 0) == 84 * MiB);
  CHECK(rounded_block_size(64 * MiB, 8) == 64 * MiB);  // a power of two stays
  CHECK(rounded_block_size(1200, 4) == 1536);          // too small for 4 steps of 512: plain
  CHECK(rounded_block_size(3000, 4) == 3072);          // [2048, 4096) in steps of 512
  CHECK(rounded_block_size(1000, 16) == 1024);
  for (const std::size_t divisions : {2U, 4U, 8U, 16U}) {
    for (std::size_t size = 512 * divisions + 1; size < 64 * MiB; size = size * 5 / 3 + 777) {
      CAPTURE(divisions, size);
      const std::size_t rounded = rounded_block_size(size, divisions);
      CHECK(rounded == rounded_block_size(by_steps(size, divisions)));
      CHECK(rounded >= size);
      CHECK(rounded % 512 == 0);
    }
  }
}

TEST_CASE("statistics: PyTorch's rounding, pools, and the two kinds of free") {
  CHECK(rounded_block_size(1) == 512);
  CHECK(rounded_block_size(1024) == 1024);
  CHECK(rounded_block_size(1025) == 1536);
  device_figures f;
  f.on_allocate(rounded_block_size(1000), 1000);
  f.on_allocate(4 * MiB, 4 * MiB - 7);
  CHECK(f.allocated_bytes[all].current == 1024 + 4 * MiB);
  CHECK(f.allocated_bytes[small_pool].current == 1024);
  CHECK(f.allocation[large_pool].current == 1);
  CHECK(f.requested_bytes[all].current == 1000 + 4 * MiB - 7);
  f.on_free_requested(4 * MiB);  // waits for a stream: no longer allocated, still active
  CHECK(f.allocated_bytes[all].current == 1024);
  CHECK(f.active_bytes[all].current == 1024 + 4 * MiB);
  f.on_free_completed(4 * MiB, 4 * MiB - 7);
  CHECK(f.active_bytes[large_pool].current == 0);
  CHECK(f.allocated_bytes[all].peak == 1024 + 4 * MiB);
  f.reset_peaks();
  CHECK(f.allocated_bytes[all].peak == 1024);
  CHECK(f.allocation[all].allocated == 2);
  f.num_ooms = 3;
  f.reset_accumulated();
  CHECK(f.allocation[all].allocated == 0);
  CHECK(f.allocation[all].current == 1);  // current figures stay
  CHECK(f.num_ooms == 0);
  f.segment.increase(small_pool, 2);
  CHECK(f.segment[small_pool].current == 2);
  CHECK(f.segment[all].peak == 2);
}

TEST_CASE("history: a ring of the last N events, oldest first") {
  trace_ring<int> ring;
  ring.set_capacity(3);
  for (int i = 1; i <= 5; ++i) {
    ring.push(i);
  }
  CHECK(ring.entries() == std::vector<int>{3, 4, 5});
  ring.set_capacity(2);  // smaller: the oldest go
  CHECK(ring.entries() == std::vector<int>{4, 5});
  ring.push(6);
  CHECK(ring.entries() == std::vector<int>{5, 6});
  ring.set_capacity(0);  // at least one
  CHECK(ring.capacity() == 1);
  ring.clear();
  CHECK(ring.entries().empty());
}

TEST_CASE("call timer: counts a scope only while timing is on, a throwing one too") {
  std::atomic<bool> on{false};
  timed_calls calls;
  { const call_timer t(on, calls); }
  CHECK(calls.calls == 0);  // off: nothing counted
  CHECK(calls.ns == 0);
  on = true;
  {
    const call_timer t(on, calls);
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  CHECK(calls.calls == 1);
  CHECK(calls.ns >= 2'000'000);  // the scope's time, at least what it slept
  CHECK_THROWS_AS(
      [&] {
        const call_timer t(on, calls);
        throw std::runtime_error("out of memory");
      }(),
      std::runtime_error);
  CHECK(calls.calls == 2);
  {
    const call_timer t(on, calls);
    on = false;  // turned off meanwhile: the call that began on is still counted
  }
  CHECK(calls.calls == 3);
  { const call_timer t(on, calls); }
  CHECK(calls.calls == 3);
}
