// pool_resource over real device memory: the randomised model test, and the stream-order tests
// that would catch a block handed to another stream before the work of its last user finished.
#include <cudamem/device_resource.hpp>
#include <cudamem/out_of_memory.hpp>
#include <cudamem/pool_resource.hpp>
#include <cudamem/stream.hpp>

#include "gpu_test.hpp"

#include <cstdint>
#include <future>
#include <map>
#include <random>
#include <thread>
#include <vector>

using namespace cudamem;

namespace {

constexpr std::size_t MiB = std::size_t{1} << 20;

/// Writes `value` to every element, slowly: each thread waits `spin` cycles before each store,
/// so the writes are spread over tens of milliseconds.
__global__ void slow_fill(unsigned* p, std::size_t n, unsigned value, long long spin) {
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < n;
       i += stride) {
    const long long start = clock64();
    while (clock64() - start < spin) {
    }
    p[i] = value;
  }
}

__global__ void fast_fill(unsigned* p, std::size_t n, unsigned value) {
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < n;
       i += stride) {
    p[i] = value;
  }
}

/// How many elements of the device array differ from `value`.
std::size_t count_not(const unsigned* device_array, std::size_t n, unsigned value) {
  std::vector<unsigned> host(n);
  check(cudaMemcpy(host.data(), device_array, n * sizeof(unsigned), cudaMemcpyDeviceToHost));
  std::size_t wrong = 0;
  for (unsigned v : host) {
    wrong += v != value ? 1 : 0;
  }
  return wrong;
}

constexpr std::size_t race_elements = MiB;  // 4 MiB of unsigned
constexpr long long race_spin = 20000;      // ~40 ms for the whole slow fill on one block

}  // namespace

TEST_CASE("pool over device memory: random model test, data intact, everything returned") {
  device_resource device;
  stream s;
  {
    pool_resource pool{device, {.growth_step = 32 * MiB}};
    std::map<std::uintptr_t, std::pair<std::size_t, unsigned char>> live;
    std::mt19937_64 rng(5);
    for (int i = 0; i < 3000; ++i) {
      if (live.empty() || rng() % 100 < 55) {
        const std::size_t n = 1 + rng() % (4 * MiB);
        const std::size_t align = std::size_t{256} << (rng() % 4);
        void* p = pool.allocate(n, align, s);
        const auto a = reinterpret_cast<std::uintptr_t>(p);
        REQUIRE(a % align == 0);
        auto next = live.lower_bound(a);
        if (next != live.end()) {
          REQUIRE(a + n <= next->first);
        }
        if (next != live.begin()) {
          REQUIRE(std::prev(next)->first + std::prev(next)->second.first <= a);
        }
        const auto tag = static_cast<unsigned char>(rng());
        check(cudaMemsetAsync(p, tag, n, s.get()));
        live[a] = {n, tag};
      } else {
        auto it = live.begin();
        std::advance(it, static_cast<std::ptrdiff_t>(rng() % live.size()));
        const auto [n, tag] = it->second;
        unsigned char first = 0;
        unsigned char last = 0;
        check(cudaMemcpyAsync(&first, reinterpret_cast<void*>(it->first), 1, cudaMemcpyDeviceToHost, s.get()));
        check(cudaMemcpyAsync(&last, reinterpret_cast<void*>(it->first + n - 1), 1,
                              cudaMemcpyDeviceToHost, s.get()));
        s.synchronize();
        REQUIRE(first == tag);  // no other block wrote over this one
        REQUIRE(last == tag);
        pool.deallocate(reinterpret_cast<void*>(it->first), n, 256, s);
        live.erase(it);
      }
    }
    for (auto& [a, entry] : live) {
      pool.deallocate(reinterpret_cast<void*>(a), entry.first, 256, s);
    }
    CHECK(pool.stats().used_bytes == 0);
    CHECK(pool.kind() == memory_kind::device);
    CHECK(pool.device() == device.device());
  }
  CHECK(device.stats().used_bytes == 0);
}

TEST_CASE("stream order: a block freed on A is not given to B before A's work has finished") {
  device_resource device;
  pool_resource pool{device, {.shards = 1}};
  stream a{{.non_blocking = true}};
  stream b{{.non_blocking = true}};
  const std::size_t bytes = race_elements * sizeof(unsigned);
  auto* p = static_cast<unsigned*>(pool.allocate(bytes, 256, a));
  slow_fill<<<1, 256, 0, a.get()>>>(p, race_elements, 0xAAAAAAAAU, race_spin);
  check(cudaGetLastError());
  pool.deallocate(p, bytes, 256, a);
  // B asks at once: the same block (the pool's only free memory of that size), which must not
  // be written by B before A's slow kernel is done.
  auto* q = static_cast<unsigned*>(pool.allocate(bytes, 256, b));
  REQUIRE(q == p);  // the test is only meaningful when B gets the very block
  CHECK_FALSE(a.is_idle());  // A is still writing: a real race window
  fast_fill<<<256, 256, 0, b.get()>>>(q, race_elements, 0xBBBBBBBBU);
  check(cudaGetLastError());
  check(cudaDeviceSynchronize());
  CHECK(count_not(q, race_elements, 0xBBBBBBBBU) == 0);  // an interleaving leaves 0xAA words
  pool.deallocate(q, bytes, 256, b);
}

// cudaStreamPerThread names the calling thread's own stream (detail/stream_tag.hpp). A thread
// frees a block on its per-thread stream while its slow kernel still writes it; a second
// thread, on its own per-thread stream, takes the block and must be ordered after that free.
// The first thread is either still alive or has ended: the next thread then usually gets the
// ended one's std::thread::id, by which the pool used to tell per-thread streams apart (and
// handed the block over with no wait).
TEST_CASE("stream order: another thread's per-thread stream is another stream, also once that "
          "thread has ended") {
  device_resource device;
  pool_resource pool{device, {.shards = 1}};
  const bool first_ended = GENERATE(false, true);
  CAPTURE(first_ended);
  const std::size_t bytes = race_elements * sizeof(unsigned);
  const stream_view per_thread = stream_view::per_thread();
  unsigned* p = nullptr;
  cudaEvent_t written = nullptr;
  check(cudaEventCreateWithFlags(&written, cudaEventDisableTiming));
  std::promise<void> freed;
  std::promise<void> taken;
  std::thread first{[&] {
    check(cudaSetDevice(device.device()));
    p = static_cast<unsigned*>(pool.allocate(bytes, 256, per_thread));
    slow_fill<<<1, 256, 0, per_thread.get()>>>(p, race_elements, 0xAAAAAAAAU, race_spin);
    check(cudaGetLastError());
    check(cudaEventRecord(written, per_thread.get()));
    pool.deallocate(p, bytes, 256, per_thread);
    freed.set_value();
    if (!first_ended) {
      taken.get_future().wait();
    }
  }};
  freed.get_future().wait();
  if (first_ended) {
    first.join();
  }
  // Whether the first thread's kernel was still writing when the second thread asked (the
  // race window; a thread's end need not wait for its stream).
  const bool window = cudaEventQuery(written) == cudaErrorNotReady;
  static_cast<void>(cudaGetLastError());
  CAPTURE(window);
  unsigned* q = nullptr;
  std::thread second{[&] {
    check(cudaSetDevice(device.device()));
    q = static_cast<unsigned*>(pool.allocate(bytes, 256, per_thread));
    fast_fill<<<256, 256, 0, per_thread.get()>>>(q, race_elements, 0xBBBBBBBBU);
    check(cudaGetLastError());
    per_thread.synchronize();
  }};
  second.join();
  if (!first_ended) {
    taken.set_value();
    first.join();
  }
  check(cudaDeviceSynchronize());
  REQUIRE(q == p);  // the test is only meaningful when the second thread gets the very block
  CHECK(count_not(q, race_elements, 0xBBBBBBBBU) == 0);  // an interleaving leaves 0xAA words
  pool.deallocate(q, bytes, 256);  // synchronous: the device is idle
  check(cudaEventDestroy(written));
}

namespace {

/// While it lives, this thread may make calls a global-mode capture elsewhere forbids (what
/// PyTorch's allocator does around cudaMalloc during a capture).
struct relaxed_capture {
  cudaStreamCaptureMode previous = cudaStreamCaptureModeRelaxed;
  relaxed_capture() { check(cudaThreadExchangeStreamCaptureMode(&previous)); }
  ~relaxed_capture() { cudaThreadExchangeStreamCaptureMode(&previous); }
  relaxed_capture(const relaxed_capture&) = delete;
  relaxed_capture& operator=(const relaxed_capture&) = delete;
};

}  // namespace

TEST_CASE("stream order: a block freed on a stream now being captured goes to another stream "
          "once prepare_for_graph_capture has marked the free; without it, a typed error") {
  device_resource device;
  pool_resource pool{device, {.shards = 1}};
  stream a{{.non_blocking = true}};
  stream b{{.non_blocking = true}};
  const std::size_t bytes = race_elements * sizeof(unsigned);
  auto* p = static_cast<unsigned*>(pool.allocate(bytes, 256, a));
  slow_fill<<<1, 256, 0, a.get()>>>(p, race_elements, 0xAAAAAAAAU, race_spin);
  check(cudaGetLastError());
  pool.deallocate(p, bytes, 256, a);
  const bool prepared = GENERATE(false, true);
  INFO("prepare_for_graph_capture called: " << prepared);
  if (prepared) {
    prepare_for_graph_capture();
  }
  check(cudaStreamBeginCapture(a.get(), cudaStreamCaptureModeGlobal));
  unsigned* q = nullptr;
  {
    const relaxed_capture relaxed;
    if (prepared) {
      q = static_cast<unsigned*>(pool.allocate(bytes, 256, b));
    } else {
      try {
        static_cast<void>(pool.allocate(bytes, 256, b));
        FAIL("allocate returned");
      } catch (const cuda_error& e) {
        CHECK(e.code() == cudaErrorStreamCaptureUnsupported);
      }
    }
  }
  cudaGraph_t graph = nullptr;
  CHECK(cudaStreamEndCapture(a.get(), &graph) == cudaSuccess);  // the capture was not broken
  if (graph != nullptr) {
    check(cudaGraphDestroy(graph));
  }
  if (!prepared) {  // the capture over, the same block, with a wait
    q = static_cast<unsigned*>(pool.allocate(bytes, 256, b));
  }
  REQUIRE(q == p);
  fast_fill<<<256, 256, 0, b.get()>>>(q, race_elements, 0xBBBBBBBBU);
  check(cudaGetLastError());
  check(cudaDeviceSynchronize());
  CHECK(count_not(q, race_elements, 0xBBBBBBBBU) == 0);  // after A's slow fill, not during
  pool.deallocate(q, bytes, 256, b);
}

TEST_CASE("stream order: the same stream reuses a block at once; the sync form waits") {
  device_resource device;
  pool_resource pool{device, {.shards = 1}};
  stream a{{.non_blocking = true}};
  const std::size_t bytes = race_elements * sizeof(unsigned);
  auto* p = static_cast<unsigned*>(pool.allocate(bytes, 256, a));
  slow_fill<<<1, 256, 0, a.get()>>>(p, race_elements, 0xAAAAAAAAU, race_spin);
  pool.deallocate(p, bytes, 256, a);
  auto* same = static_cast<unsigned*>(pool.allocate(bytes, 256, a));  // stream order suffices
  CHECK(same == p);
  fast_fill<<<256, 256, 0, a.get()>>>(same, race_elements, 0xCCCCCCCCU);
  pool.deallocate(same, bytes, 256, a);
  p = static_cast<unsigned*>(pool.allocate(bytes, 256, a));
  slow_fill<<<1, 256, 0, a.get()>>>(p, race_elements, 0xAAAAAAAAU, race_spin);
  pool.deallocate(p, bytes, 256, a);
  auto* host_ready = static_cast<unsigned*>(pool.allocate(bytes));  // synchronous: waits on host
  CHECK(host_ready == p);
  CHECK(a.is_idle());
  check(cudaMemset(host_ready, 0xDD, bytes));
  check(cudaDeviceSynchronize());
  CHECK(count_not(host_ready, race_elements, 0xDDDDDDDDU) == 0);
  pool.deallocate(host_ready, bytes);
}

namespace {

/// Stream a frees a block while a slow kernel still writes it, then a is destroyed; stream b
/// must get the same block only after that kernel (its pattern must be the only one left).
/// `retire_first` calls retire_stream before a's destruction; otherwise the stream itself
/// tells the pool (stream_listener).
void reuse_after_freeing_stream_dies(bool retire_first) {
  cudamem_test::captured_errors errors;
  device_resource device;
  pool_resource pool{device, {.shards = 1}};
  stream b{{.non_blocking = true}};
  const std::size_t bytes = race_elements * sizeof(unsigned);
  unsigned* p = nullptr;
  {
    stream a{{.non_blocking = true}};
    p = static_cast<unsigned*>(pool.allocate(bytes, 256, a));
    slow_fill<<<1, 256, 0, a.get()>>>(p, race_elements, 0xAAAAAAAAU, race_spin);
    pool.deallocate(p, bytes, 256, a);
    if (retire_first) {
      pool.retire_stream(a);
    }
  }  // a destroyed while its kernel still runs
  auto* q = static_cast<unsigned*>(pool.allocate(bytes, 256, b));
  REQUIRE(q == p);
  fast_fill<<<256, 256, 0, b.get()>>>(q, race_elements, 0xBBBBBBBBU);
  check(cudaDeviceSynchronize());
  CHECK(count_not(q, race_elements, 0xBBBBBBBBU) == 0);
  pool.deallocate(q, bytes, 256, b);
  CHECK(errors.messages().empty());
}

}  // namespace

TEST_CASE("stream order: retire_stream lets the freeing stream be destroyed first") {
  reuse_after_freeing_stream_dies(true);
}

TEST_CASE("stream order: a cudamem::stream destroyed before the pool settles up by itself") {
  reuse_after_freeing_stream_dies(false);
}

// The upstream cudaMalloc fails on purpose (an expected API error for compute-sanitizer).
TEST_CASE("pool over device memory: out_of_memory after release-and-retry, with a report",
          "[expected-api-error]") {
  device_resource device;
  pool_resource pool{device};
  const std::size_t total = device_memory(0).total;
  try {
    static_cast<void>(pool.allocate(total + total / 2));
    FAIL("expected out_of_memory");
  } catch (const out_of_memory& e) {
    CHECK(e.verdict() == oom_verdict::larger_than_device);
    CHECK(e.report().chain.front().name == "pool_resource");
  }
  CHECK(pool.stats().used_bytes == 0);
}
