// copy_stager (copy_stager.hpp) on a real device: staged copies give what a raw cudaMemcpy
// gives at sizes around the threshold and the chunk boundaries, cudamem::copy stages exactly
// the copies it should, stream order holds both ways (a slow kernel before a download, a
// kernel after an upload), two threads share one stager, and a failure injected part-way
// leaves nothing held and the stager usable.
#include <cudamem/copy.hpp>
#include <cudamem/copy_stager.hpp>
#include <cudamem/device_buffer.hpp>
#include <cudamem/pinned_buffer.hpp>
#include <cudamem/stream.hpp>

#include "gpu_test.hpp"

#include <atomic>
#include <cstdint>
#include <memory>
#include <new>
#include <numeric>
#include <stdexcept>
#include <thread>
#include <vector>

using namespace cudamem;

namespace {

constexpr std::size_t kib = 1024;
constexpr std::size_t mib = 1024 * kib;

/// Spins for `cycles`, then writes `value` over all of `v`: a long-running earlier writer.
__global__ void late_write(device_span<std::uint32_t> v, long long cycles, std::uint32_t value) {
  const long long start = clock64();
  while (clock64() - start < cycles) {
  }
  for (std::size_t i = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x; i < v.size();
       i += std::size_t{blockDim.x} * gridDim.x) {
    v[i] = value;
  }
}

/// Adds one to every element: a later reader (and writer) of an upload.
__global__ void add_one(device_span<std::uint32_t> v) {
  for (std::size_t i = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x; i < v.size();
       i += std::size_t{blockDim.x} * gridDim.x) {
    v[i] += 1;
  }
}

std::vector<std::uint32_t> counting(std::size_t n, std::uint32_t first) {
  std::vector<std::uint32_t> v(n);
  std::iota(v.begin(), v.end(), first);
  return v;
}

/// What a raw synchronous copy reads from the device: the reference.
std::vector<std::uint32_t> raw_read(const device_buffer<std::uint32_t>& d) {
  std::vector<std::uint32_t> out(d.size());
  check(cudaStreamSynchronize(d.stream().get()));
  check(cudaMemcpy(out.data(), d.data(), d.size_bytes(), cudaMemcpyDeviceToHost));
  return out;
}

/// The CUDA engine with failures on request: the k-th chunk allocation or chunk copy throws.
class failing_engine final : public detail::transfer_engine {
 public:
  long fail_allocation_at = -1;
  long fail_copy_at = -1;

  void* allocate_chunk(std::size_t bytes) override {
    if (allocations_++ == fail_allocation_at) {
      throw std::bad_alloc();
    }
    return real_.allocate_chunk(bytes);
  }
  void deallocate_chunk(void* chunk, std::size_t bytes) noexcept override {
    real_.deallocate_chunk(chunk, bytes);
  }
  fence make_fence() override { return real_.make_fence(); }
  void destroy_fence(fence f) noexcept override { real_.destroy_fence(f); }
  void copy_async(void* dst, const void* src, std::size_t bytes, stream_view s) override {
    if (copies_++ == fail_copy_at) {
      check(cudaErrorInvalidValue, "injected copy failure");
    }
    real_.copy_async(dst, src, bytes, s);
  }
  void record(fence f, stream_view s) override { real_.record(f, s); }
  void wait(fence f) override { real_.wait(f); }
  bool synchronize(stream_view s) noexcept override { return real_.synchronize(s); }

 private:
  detail::cuda_transfer_engine real_{current_device()};
  long allocations_ = 0;
  long copies_ = 0;
};

}  // namespace

TEST_CASE("copy_stager: cudamem::copy around the threshold and chunk boundaries matches raw") {
  stream s;
  copy_stager& stager = default_copy_stager();
  const std::size_t limit = direct_copy_max_bytes();
  const std::size_t chunk = stager.options().chunk_bytes;
  for (const std::size_t bytes :
       {limit - 4, limit, limit + 4, 2 * limit, chunk - 4, chunk, chunk + 4,
        3 * chunk + 256 * kib + 4, 16 * mib + 12, 64 * mib + 4}) {
    CAPTURE(bytes);
    const std::size_t n = bytes / sizeof(std::uint32_t);
    const std::vector<std::uint32_t> original = counting(n, static_cast<std::uint32_t>(bytes));
    std::vector<std::uint32_t> host = original;
    device_buffer<std::uint32_t> d(n, s);

    const std::uint64_t before = stager.stats().staged_copies;
    copy(d, host, s);
    std::fill(host.begin(), host.end(), 0u);  // the source may be reused at once
    CHECK(raw_read(d) == original);

    copy(host, d, s);  // no synchronisation: the destination is filled on return
    CHECK(host == original);
    const bool staged = n * sizeof(std::uint32_t) > limit;
    CHECK(stager.stats().staged_copies - before == (staged ? 2u : 0u));

    device_buffer<std::uint32_t> built(original, s);  // the constructor from a host range
    CHECK(raw_read(built) == original);
  }
  const copy_stager_stats rest = stager.stats();
  CHECK(rest.chunks_in_use == 0);
  CHECK(rest.pinned_bytes <= std::size_t{32} << 20);  // the default options' bound
}

TEST_CASE("copy_stager: pinned memory and device-to-device copies are not staged") {
  stream s;
  copy_stager& stager = default_copy_stager();
  const std::size_t n = 8 * mib / sizeof(std::uint32_t);
  pinned_buffer<std::uint32_t> pinned(n, 5u);
  device_buffer<std::uint32_t> d(n, s);
  const std::uint64_t before = stager.stats().staged_copies;
  copy(d, pinned, s);
  device_buffer<std::uint32_t> other(n, s);
  copy(other, d, s);
  copy(pinned, other, s);
  s.synchronize();
  CHECK(stager.stats().staged_copies == before);
  CHECK(pinned[n - 1] == 5u);
}

TEST_CASE("copy_stager: stream order is kept both ways") {
  stream s{{.non_blocking = true}};
  const std::size_t n = 24 * mib / sizeof(std::uint32_t);
  device_buffer<std::uint32_t> d(n, 1u, s);
  std::vector<std::uint32_t> host(n, 0u);

  // A slow kernel queued before the download writes 7 everywhere; the download must see 7s.
  late_write<<<256, 256, 0, s.get()>>>(d.span(), 20'000'000, 7u);
  check(cudaGetLastError());
  copy(host, d, s);
  CHECK(std::count(host.begin(), host.end(), 7u) == static_cast<std::ptrdiff_t>(n));

  // A kernel queued after an upload reads what it wrote.
  const std::vector<std::uint32_t> original = counting(n, 100);
  copy(d, original, s);
  add_one<<<256, 256, 0, s.get()>>>(d.span());
  check(cudaGetLastError());
  copy(host, d, s);
  CHECK(host == counting(n, 101));
}

TEST_CASE("copy_stager: an explicit stager with small chunks, every boundary") {
  stream s;
  copy_stager stager{-1, {.chunk_bytes = 64 * kib, .chunk_count = 3, .threads = 2}};
  for (const std::size_t bytes : {std::size_t{4}, 64 * kib - 4, 64 * kib, 64 * kib + 4,
                                  192 * kib, 192 * kib + 4, 5 * mib + 68}) {
    CAPTURE(bytes);
    const std::size_t n = bytes / sizeof(std::uint32_t);
    const std::vector<std::uint32_t> original = counting(n, 3);
    device_buffer<std::uint32_t> d(n, s);
    stager.copy_to_device(d.data(), original.data(), bytes, s);
    CHECK(raw_read(d) == original);
    std::vector<std::uint32_t> back(n);
    stager.copy_to_host(back.data(), d.data(), bytes, s);
    CHECK(back == original);
  }
  CHECK(stager.stats().pinned_bytes == 3 * 64 * kib);
  stager.release();
  CHECK(stager.stats().chunks_allocated == 0);
  CHECK(stager.stats().worker_threads == 0);
}

TEST_CASE("copy_stager: two threads copy through one stager at once") {
  copy_stager& stager = default_copy_stager();
  std::atomic<int> wrong{0};
  const auto work = [&](std::uint32_t seed) {
    stream s{{.non_blocking = true}};
    for (int i = 0; i < 6; ++i) {
      const std::size_t n = (3 * mib + seed * 4096 + static_cast<std::size_t>(i) * 777 * kib) /
                            sizeof(std::uint32_t);
      const std::vector<std::uint32_t> original = counting(n, seed * 1000 + i);
      device_buffer<std::uint32_t> d(n, s);
      std::vector<std::uint32_t> back(n);
      copy(d, original, s);
      copy(back, d, s);
      wrong += back == original ? 0 : 1;
    }
  };
  std::thread a{work, 1u};
  std::thread b{work, 2u};
  a.join();
  b.join();
  CHECK(wrong == 0);
  CHECK(stager.stats().chunks_in_use == 0);
}

TEST_CASE("copy_stager: a failure part-way throws, holds nothing, and the stager goes on") {
  stream s;
  auto engine = std::make_unique<failing_engine>();
  failing_engine& fail = *engine;
  copy_stager stager{std::move(engine), {.chunk_bytes = 256 * kib, .chunk_count = 4,
                                         .threads = 2}};
  const std::size_t n = 4 * mib / sizeof(std::uint32_t);  // 16 stages
  const std::vector<std::uint32_t> original = counting(n, 9);
  device_buffer<std::uint32_t> d(n, s);
  std::vector<std::uint32_t> back(n);

  fail.fail_allocation_at = 2;
  CHECK_THROWS_AS(stager.copy_to_device(d.data(), original.data(), n * 4, s), std::bad_alloc);
  CHECK(stager.stats().chunks_in_use == 0);
  CHECK(stager.stats().chunks_allocated == 2);

  fail.fail_copy_at = 9;
  CHECK_THROWS_AS(stager.copy_to_host(back.data(), d.data(), n * 4, s), cuda_error);
  const copy_stager_stats after = stager.stats();
  CHECK(after.chunks_in_use == 0);
  CHECK(after.copies_in_progress == 0);
  CHECK(after.memcpy_pieces_in_flight == 0);

  stager.copy_to_device(d.data(), original.data(), n * 4, s);
  stager.copy_to_host(back.data(), d.data(), n * 4, s);
  CHECK(back == original);
}

TEST_CASE("copy_stager: release_default_copy_stagers gives the pinned chunks back") {
  stream s;
  const std::vector<std::uint32_t> original = counting(4 * mib, 1);
  device_buffer<std::uint32_t> d(original, s);  // staged: chunks allocated
  CHECK(default_copy_stager().stats().chunks_allocated > 0);
  release_default_copy_stagers();
  CHECK(default_copy_stager().stats().chunks_allocated == 0);
  CHECK(default_copy_stager().stats().worker_threads == 0);
  CHECK(raw_read(d) == original);
}
