// copy_stager's pipeline with no GPU: a fake transfer engine (tests/support) stands in for
// CUDA, running "DMAs" on a thread of its own after a delay. Data at many sizes both ways, the
// call's timing promises (source reusable, destination filled, stream order), failures
// injected at every chunk, several threads through one stager, release, and bad options.
#include <cudamem/copy_stager.hpp>

#include "fake_transfer_engine.hpp"

#include <catch2/catch.hpp>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <new>
#include <numeric>
#include <random>
#include <stdexcept>
#include <thread>
#include <vector>

using namespace cudamem;
using cudamem_test::fake_transfer_engine;
using cudamem_test::transfer_counts;

namespace {

constexpr std::size_t kib = 1024;

/// Small chunks, so that a few hundred KiB already make many stages.
const copy_stager_options small{.chunk_bytes = 64 * kib, .chunk_count = 3, .threads = 3};

std::vector<unsigned char> pattern(std::size_t bytes, unsigned seed) {
  std::vector<unsigned char> v(bytes);
  std::mt19937 rng{seed};
  for (auto& b : v) {
    b = static_cast<unsigned char>(rng());
  }
  return v;
}

struct fixture {
  std::shared_ptr<transfer_counts> counts = std::make_shared<transfer_counts>();
  fake_transfer_engine* fake = nullptr;
  std::unique_ptr<copy_stager> stager;

  explicit fixture(const copy_stager_options& options = small) {
    auto engine = std::make_unique<fake_transfer_engine>(counts);
    fake = engine.get();
    stager = std::make_unique<copy_stager>(std::move(engine), options);
  }

  /// Nothing held by a copy, no memcpy piece in flight, the engine's books match the stager's.
  void check_at_rest() const {
    const copy_stager_stats s = stager->stats();
    CHECK(s.chunks_in_use == 0);
    CHECK(s.copies_in_progress == 0);
    CHECK(s.memcpy_pieces_in_flight == 0);
    CHECK(counts->chunks_live == static_cast<long>(s.chunks_allocated));
    CHECK(counts->fences_live == static_cast<long>(s.chunks_allocated));
    CHECK(counts->races == 0);
  }
};

const stream_view any_stream{};

}  // namespace

TEST_CASE("copy_stager: data arrives intact both ways at many sizes", "[copy_stager]") {
  const copy_stager_options choices[] = {
      small,
      {.chunk_bytes = 1 << 20, .chunk_count = 4, .threads = 4},  // the workers share stages
      {.chunk_bytes = 64 * kib, .chunk_count = 1, .threads = 1},  // no overlap at all
  };
  const copy_stager_options options = choices[GENERATE(0, 1, 2)];
  fixture f{options};
  const std::size_t c = options.chunk_bytes;
  for (const std::size_t bytes :
       {std::size_t{1}, std::size_t{4095}, 64 * kib - 1, 64 * kib, 64 * kib + 1, 256 * kib,
        3 * c - 1, 3 * c, 3 * c + 1, 7 * c + 12345, std::size_t{5} << 20}) {
    CAPTURE(bytes, options.chunk_bytes, options.chunk_count, options.threads);
    const std::vector<unsigned char> original = pattern(bytes, static_cast<unsigned>(bytes));
    std::vector<unsigned char> host = original;
    std::vector<unsigned char> device(bytes, 0);

    f.stager->copy_to_device(device.data(), host.data(), bytes, any_stream);
    std::fill(host.begin(), host.end(), 0xEE);  // the source may be reused at once
    f.fake->drain();                            // cudaStreamSynchronize
    CHECK(device == original);

    f.stager->copy_to_host(host.data(), device.data(), bytes, any_stream);
    CHECK(host == original);  // filled when the call returns, no wait
    f.check_at_rest();
  }
  CHECK(f.stager->stats().chunks_allocated <= options.chunk_count);
  CHECK(f.stager->stats().worker_threads <= options.threads - 1);
}

TEST_CASE("copy_stager: stream order is kept both ways", "[copy_stager]") {
  fixture f;
  const std::size_t bytes = 1 << 20;
  std::vector<unsigned char> device(bytes, 1);
  std::vector<unsigned char> host(bytes, 0);

  // A "kernel" queued before a download writes the device buffer; the download must see it.
  f.fake->enqueue([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    std::fill(device.begin(), device.end(), 7);
  });
  f.stager->copy_to_host(host.data(), device.data(), bytes, any_stream);
  CHECK(std::all_of(host.begin(), host.end(), [](unsigned char b) { return b == 7; }));

  // A "kernel" queued after an upload reads what the upload wrote.
  std::fill(host.begin(), host.end(), 9);
  f.stager->copy_to_device(device.data(), host.data(), bytes, any_stream);
  std::size_t nines = 0;
  f.fake->enqueue([&] {
    nines = static_cast<std::size_t>(std::count(device.begin(), device.end(), 9));
  });
  f.fake->drain();
  CHECK(nines == bytes);
  f.check_at_rest();
}

TEST_CASE("copy_stager: chunks and threads are bounded and kept between copies",
          "[copy_stager]") {
  fixture f;
  std::vector<unsigned char> host = pattern(2 << 20, 1);
  std::vector<unsigned char> device(host.size());
  f.stager->copy_to_device(device.data(), host.data(), host.size(), any_stream);
  const copy_stager_stats first = f.stager->stats();
  CHECK(first.chunks_allocated == small.chunk_count);
  CHECK(first.pinned_bytes == small.chunk_count * small.chunk_bytes);
  CHECK(first.staged_copies == 1);
  f.stager->copy_to_host(host.data(), device.data(), host.size(), any_stream);
  CHECK(f.counts->chunks_live == static_cast<long>(small.chunk_count));  // no new chunk
  CHECK(f.stager->stats().staged_copies == 2);
}

TEST_CASE("copy_stager: a failure part-way throws and leaves nothing held", "[copy_stager]") {
  const std::size_t bytes = 10 * small.chunk_bytes + 100;  // 11 stages
  const auto way = GENERATE(0, 1);                          // 0: to device, 1: to host
  const auto fail = [&](fixture& f) {
    std::vector<unsigned char> host(bytes, 3);
    std::vector<unsigned char> device(bytes, 4);
    if (way == 0) {
      f.stager->copy_to_device(device.data(), host.data(), bytes, any_stream);
    } else {
      f.stager->copy_to_host(host.data(), device.data(), bytes, any_stream);
    }
    f.fake->drain();  // a "DMA" still queued must not outlive host and device (test only)
  };
  const auto recovers = [&](fixture& f) {
    f.fake->fail_allocation_at = -1;
    f.fake->fail_copy_at = -1;
    f.fake->fail_wait_at = -1;
    f.fake->fail_synchronize = false;
    const std::vector<unsigned char> original = pattern(bytes, 5);
    std::vector<unsigned char> device(bytes);
    std::vector<unsigned char> back(bytes);
    f.stager->copy_to_device(device.data(), original.data(), bytes, any_stream);
    f.stager->copy_to_host(back.data(), device.data(), bytes, any_stream);
    CHECK(back == original);
    f.check_at_rest();
  };

  SECTION("no pinned memory for chunk k") {
    for (long k = 0; k < static_cast<long>(small.chunk_count); ++k) {
      CAPTURE(way, k);
      fixture f;
      f.fake->fail_allocation_at = k;
      CHECK_THROWS_AS(fail(f), std::bad_alloc);
      f.check_at_rest();
      CHECK(f.stager->stats().chunks_allocated == static_cast<std::size_t>(k));
      recovers(f);
    }
  }
  SECTION("a copy fails to start at chunk k") {
    for (long k = 0; k < 11; ++k) {
      CAPTURE(way, k);
      fixture f;
      f.fake->fail_copy_at = k;
      CHECK_THROWS_AS(fail(f), cuda_error);
      f.check_at_rest();
      recovers(f);
    }
  }
  SECTION("a copy fails while running (seen at the wait for chunk k)") {
    for (long k = 0; k < 8; ++k) {
      CAPTURE(way, k);
      fixture f;
      f.fake->fail_wait_at = k;
      CHECK_THROWS_AS(fail(f), cuda_error);
      f.check_at_rest();
      recovers(f);
    }
  }
  SECTION("the stream cannot be waited for either: the chunks are freed, not kept") {
    fixture f;
    f.fake->fail_copy_at = 5;
    f.fake->fail_synchronize = true;
    CHECK_THROWS_AS(fail(f), cuda_error);
    f.check_at_rest();
    CHECK(f.stager->stats().chunks_allocated == 0);
    recovers(f);
  }
}

TEST_CASE("copy_stager: several threads copy through one stager at once", "[copy_stager]") {
  // Stages of up to 512 KiB: each is split between the caller and a worker, so the workers
  // serve several copies at once too.
  fixture f{copy_stager_options{.chunk_bytes = 512 * kib, .chunk_count = 4, .threads = 3}};
  f.fake->dma_delay = std::chrono::microseconds(5);
  constexpr int threads = 4;
  constexpr int copies_each = 12;
  std::vector<int> wrong(threads, 0);
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t) {
    pool.emplace_back([&, t] {
      std::mt19937 rng{static_cast<unsigned>(t)};
      for (int i = 0; i < copies_each; ++i) {
        const std::size_t bytes = 1 + rng() % (4096 * kib);
        const std::vector<unsigned char> original = pattern(bytes, rng());
        std::vector<unsigned char> device(bytes);
        std::vector<unsigned char> back(bytes);
        f.stager->copy_to_device(device.data(), original.data(), bytes, any_stream);
        f.stager->copy_to_host(back.data(), device.data(), bytes, any_stream);
        wrong[static_cast<std::size_t>(t)] += back == original ? 0 : 1;
      }
    });
  }
  for (std::thread& t : pool) {
    t.join();
  }
  CHECK(wrong == std::vector<int>(threads, 0));
  CHECK(f.stager->stats().staged_copies == 2 * threads * copies_each);
  CHECK(f.stager->stats().chunks_allocated <= 4);
  CHECK(f.stager->stats().worker_threads >= 1);
  f.check_at_rest();
}

TEST_CASE("copy_stager: release while idle gives everything back; the next copy starts over",
          "[copy_stager]") {
  const copy_stager_options two_halves{.chunk_bytes = 512 * kib, .chunk_count = 2, .threads = 3};
  fixture f{two_halves};
  std::vector<unsigned char> host = pattern(1 << 20, 2);
  std::vector<unsigned char> device(host.size());
  f.stager->copy_to_device(device.data(), host.data(), host.size(), any_stream);
  CHECK(f.stager->stats().worker_threads > 0);
  f.stager->release();
  CHECK(f.stager->stats().chunks_allocated == 0);
  CHECK(f.stager->stats().worker_threads == 0);
  CHECK(f.counts->chunks_live == 0);
  CHECK(f.counts->fences_live == 0);
  f.fake->drain();
  CHECK(device == host);  // release waited for the upload's last chunk before freeing it

  std::vector<unsigned char> back(host.size());
  f.stager->copy_to_host(back.data(), device.data(), host.size(), any_stream);
  CHECK(back == host);
  CHECK(f.stager->stats().chunks_allocated == two_halves.chunk_count);

  f.stager.reset();  // the destructor frees the rest
  CHECK(f.counts->chunks_live == 0);
  CHECK(f.counts->fences_live == 0);
}

TEST_CASE("copy_stager: set_options takes effect for the next copy", "[copy_stager]") {
  fixture f;
  std::vector<unsigned char> host = pattern(1 << 20, 3);
  std::vector<unsigned char> device(host.size());
  f.stager->copy_to_device(device.data(), host.data(), host.size(), any_stream);
  const copy_stager_options bigger{.chunk_bytes = 128 * kib, .chunk_count = 2, .threads = 2};
  f.stager->set_options(bigger);
  CHECK(f.counts->chunks_live == 0);
  CHECK(f.stager->options().chunk_bytes == 128 * kib);
  std::vector<unsigned char> back(host.size());
  f.stager->copy_to_host(back.data(), device.data(), host.size(), any_stream);
  CHECK(back == host);
  CHECK(f.stager->stats().pinned_bytes == 2 * 128 * kib);
}

TEST_CASE("copy_stager: bad options and arguments are refused clearly", "[copy_stager]") {
  const auto refused = [](copy_stager_options o) {
    return copy_stager(std::make_unique<fake_transfer_engine>(), o);
  };
  CHECK_THROWS_AS(refused({.chunk_bytes = 0}), std::invalid_argument);
  CHECK_THROWS_WITH(refused({.chunk_bytes = 64 * kib + 1}), Catch::Contains("chunk_bytes"));
  CHECK_THROWS_WITH(refused({.chunk_bytes = 2ull << 30}), Catch::Contains("chunk_bytes"));
  CHECK_THROWS_WITH(refused({.chunk_count = 0}), Catch::Contains("chunk_count"));
  CHECK_THROWS_WITH(refused({.chunk_count = 65}), Catch::Contains("chunk_count"));
  CHECK_THROWS_WITH(refused({.threads = 0}), Catch::Contains("threads"));
  CHECK_THROWS_WITH(refused({.threads = 65}), Catch::Contains("threads"));
  CHECK_THROWS_WITH(refused({.chunk_bytes = 1ull << 30, .chunk_count = 8}),
                    Catch::Contains("4 GiB"));
  CHECK_THROWS_WITH(copy_stager(std::unique_ptr<detail::transfer_engine>{}),
                    Catch::Contains("null"));

  fixture f;
  CHECK_THROWS_AS(f.stager->set_options({.threads = 0}), std::invalid_argument);
  CHECK(f.stager->options().threads == small.threads);  // unchanged
  std::vector<unsigned char> host(10);
  CHECK_THROWS_WITH(f.stager->copy_to_device(nullptr, host.data(), 10, any_stream),
                    Catch::Contains("destination is null"));
  CHECK_THROWS_WITH(f.stager->copy_to_host(host.data(), nullptr, 10, any_stream),
                    Catch::Contains("source is null"));
  CHECK_NOTHROW(f.stager->copy_to_device(nullptr, nullptr, 0, any_stream));  // 0 bytes: nothing
  CHECK(f.counts->copies == 0);
  f.check_at_rest();
}

TEST_CASE("copy_stager: cudamem::copy's threshold is settable", "[copy_stager]") {
  CHECK(direct_copy_max_bytes() == default_direct_copy_max_bytes);
  set_direct_copy_max_bytes(SIZE_MAX);
  CHECK(direct_copy_max_bytes() == SIZE_MAX);
  set_direct_copy_max_bytes(default_direct_copy_max_bytes);
  CHECK(direct_copy_max_bytes() == std::size_t{1} << 20);
}

TEST_CASE("copy_stager: the default options are the measured ones", "[copy_stager]") {
  const copy_stager_options defaults;
  CHECK(defaults.chunk_bytes == 8u << 20);
  CHECK(defaults.chunk_count == 4);
  // Half the hardware threads, at least 1 and at most 8 (copy_stager.hpp says why).
  const unsigned hardware = std::thread::hardware_concurrency();
  CHECK(defaults.threads == default_copy_threads());
  CHECK(default_copy_threads() >= 1);
  CHECK(default_copy_threads() <= 8);
  if (hardware >= 2 && hardware <= 16) {
    CHECK(default_copy_threads() == hardware / 2);
  }
  // The defaults pass the stager's own checks (a fake engine: no GPU needed).
  fixture f{defaults};
  CHECK(f.stager->options().threads == defaults.threads);
}
