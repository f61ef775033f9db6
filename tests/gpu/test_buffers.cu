// device_buffer, pinned_buffer, copy/fill and device_span on a real device: contents, stream
// order, cross-stream reuse, exception paths that must leave device memory where it started,
// and fault injection (every allocation of every owner made to fail in turn).
#include <cudamem/async_resource.hpp>
#include <cudamem/copy.hpp>
#include <cudamem/current_resource.hpp>
#include <cudamem/device_buffer.hpp>
#include <cudamem/device_resource.hpp>
#include <cudamem/failing_adaptor.hpp>
#include <cudamem/managed_resource.hpp>
#include <cudamem/pinned_buffer.hpp>
#include <cudamem/pinned_resource.hpp>
#include <cudamem/stream.hpp>

#include "gpu_test.hpp"

#include <algorithm>
#include <cstdint>
#include <functional>
#include <limits>
#include <numeric>
#include <stdexcept>
#include <utility>
#include <vector>

using namespace cudamem;

namespace {

__global__ void add_one(device_span<int> v) {
  const std::size_t i = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x;
  if (i < v.size()) {
    v[i] += 1;
  }
}

/// Spins for `cycles`, then writes `value` over all of `v`: a long-running last use.
__global__ void late_write(device_span<unsigned> v, long long cycles, unsigned value) {
  const long long start = clock64();
  while (clock64() - start < cycles) {
  }
  for (std::size_t i = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x; i < v.size();
       i += std::size_t{blockDim.x} * gridDim.x) {
    v[i] = value;
  }
}

template <class T>
std::vector<T> to_host(const device_buffer<T>& b) {
  std::vector<T> out(b.size());
  copy(out, b, b.stream());  // pageable destination: written before copy returns
  return out;
}

struct rgb {
  std::uint8_t r, g, b;
};

}  // namespace

TEST_CASE("device_buffer: every constructor gives the right contents") {
  stream s;
  const std::vector<int> source{5, 6, 7, 8, 9};
  device_buffer<int> from_host(source, s);
  CHECK(to_host(from_host) == source);
  device_buffer<int> zeros(1000, zero_fill, s);
  CHECK(to_host(zeros) == std::vector<int>(1000, 0));
  device_buffer<int> sevens(1001, 7, s);
  CHECK(to_host(sevens) == std::vector<int>(1001, 7));
  device_buffer<double> halves(77777, 0.5, s);   // not a single-byte pattern: doubling copies
  CHECK(to_host(halves) == std::vector<double>(77777, 0.5));
  device_buffer<rgb> odd_size(333, rgb{1, 2, 3}, s);
  const auto pixels = to_host(odd_size);
  CHECK(pixels[332].r == 1);
  CHECK(pixels[332].b == 3);
  CHECK(&from_host.resource() == &get_current_resource());
  CHECK(from_host.device() == current_device());
}

TEST_CASE("device_buffer: kernels take it as a device_span; resize keeps, clone copies") {
  stream s;
  std::vector<int> values(10000);
  std::iota(values.begin(), values.end(), 0);
  device_buffer<int> b(values, s);
  add_one<<<(10000 + 255) / 256, 256, 0, s.get()>>>(b);
  check(cudaGetLastError());
  b.resize(20000, s);
  CHECK(b.size() == 20000);
  // Only the kept 10000 are read back: the new elements are uninitialised, and copying them
  // is a read of uninitialised memory (compute-sanitizer's initcheck says so).
  std::vector<int> back(10000);
  check(cudaMemcpyAsync(back.data(), b.data(), back.size() * sizeof(int), cudaMemcpyDeviceToHost,
                        s.get()));
  s.synchronize();
  for (int i = 0; i < 10000; ++i) {
    REQUIRE(back[i] == i + 1);
  }
  b.resize(3, s);
  CHECK(b.capacity() == 20000);
  device_buffer<int> c = b.clone(s);
  add_one<<<1, 32, 0, s.get()>>>(c);
  CHECK(to_host(c) == std::vector<int>{2, 3, 4});
  CHECK(to_host(b) == std::vector<int>{1, 2, 3});  // the original is untouched
  b.reserve(50000, s);
  CHECK(b.capacity() == 50000);
  CHECK(to_host(b) == std::vector<int>{1, 2, 3});
}

TEST_CASE("device_buffer: switching streams is ordered (the new stream waits for the old)") {
  stream a{{.non_blocking = true}};
  stream b{{.non_blocking = true}};
  device_buffer<unsigned> buf(1 << 20, zero_fill, a);
  late_write<<<64, 256, 0, a.get()>>>(buf, 200'000'000, 42u);  // ~0.1 s, then writes 42
  check(cudaGetLastError());
  device_buffer<unsigned> copy_on_b = buf.clone(b);  // must see the 42s, not the zeros
  std::vector<unsigned> host(1 << 20);
  copy(host, copy_on_b, b);
  CHECK(host.front() == 42u);
  CHECK(host.back() == 42u);
  buf.resize(2 << 20, b);  // growth on b: copies after a's work
  host.resize(1 << 20);
  copy(host, buf.span().first(1 << 20), b);
  CHECK(host[12345] == 42u);
}

TEST_CASE("pinned_buffer <-> device_buffer round trip; fill and fill_zero") {
  stream s;
  pinned_buffer<float> h(1 << 20, 1.5f);
  device_buffer<float> d(h.size(), s);
  copy(d, h, s);
  fill(h, 0.0f, s);  // waits for s (the copy out of h) before the host writes
  copy(h, d, s);
  s.synchronize();
  CHECK(h[0] == 1.5f);
  CHECK(h[(1 << 20) - 1] == 1.5f);
  fill(d, 2.25f, s);
  copy(h, d, s);
  s.synchronize();
  CHECK(h[777] == 2.25f);
  fill_zero(d, s);
  copy(h.span(), d.span(), s);
  s.synchronize();
  CHECK(h[777] == 0.0f);
  CHECK_THROWS_AS(copy(d.span().first(3), h, s), std::invalid_argument);
  pinned_buffer<float> grown = h.clone(s);
  grown.resize(3 << 20, s);
  CHECK(grown[777] == 0.0f);
  CHECK(&h.resource() == &default_pinned_resource());
}

TEST_CASE("device_buffer over managed and pinned memory; host memory refused") {
  stream s;
  managed_resource managed;
  device_buffer<int> m(100, 9, s, managed);
  s.synchronize();
  CHECK(m.data()[99] == 9);  // managed: the host can read it
  pinned_resource pinned;
  device_buffer<int> p(100, zero_fill, s, pinned);
  s.synchronize();
  CHECK(p.data()[50] == 0);
}

// A deliberately wrong resource: it hands a freed block to the next request at once, on any
// stream, without waiting for the free to complete. The cross-stream test must catch it.
class unordered_cache final : public memory_resource {
 public:
  explicit unordered_cache(memory_resource& upstream)
      : memory_resource(memory_kind::device, upstream.device()), upstream_(upstream) {}
  ~unordered_cache() override {
    if (cached_ != nullptr) {
      upstream_.deallocate(cached_, cached_bytes_);
    }
  }

 private:
  void* do_allocate(std::size_t bytes, std::size_t alignment, stream_view) override {
    if (cached_ != nullptr && cached_bytes_ == bytes) {
      return std::exchange(cached_, nullptr);
    }
    return upstream_.allocate(bytes, alignment);
  }
  void do_deallocate(void* p, std::size_t bytes, std::size_t, stream_view) noexcept override {
    if (cached_ != nullptr) {
      upstream_.deallocate(cached_, cached_bytes_);
    }
    cached_ = p;
    cached_bytes_ = bytes;
  }
  memory_resource& upstream_;
  void* cached_ = nullptr;
  std::size_t cached_bytes_ = 0;
};

/// Stream A: a long kernel writes 0xAAAAAAAA over a block, which is freed on A at once.
/// Stream B: allocates the same size, writes 0x55555555, and reads it back after everything
/// finished. If the resource handed A's block to B before A's kernel finished, A's late write
/// overwrote B's data.
bool cross_stream_reuse_is_safe(memory_resource& mr) {
  stream a{{.non_blocking = true}};
  stream b{{.non_blocking = true}};
  constexpr std::size_t n = 4 << 20;
  void* first = nullptr;
  {
    device_buffer<unsigned> on_a(n, a, mr);
    first = on_a.data();
    late_write<<<128, 256, 0, a.get()>>>(on_a, 300'000'000, 0xAAAAAAAAu);
    check(cudaGetLastError());
  }  // freed on a, while the kernel still runs
  device_buffer<unsigned> on_b(n, 0x55555555u, b, mr);
  const bool reused = on_b.data() == static_cast<unsigned*>(first);
  check(cudaDeviceSynchronize());  // a's kernel has finished now, whatever happened
  std::vector<unsigned> host(n);
  copy(host, on_b, b);
  const bool intact = std::all_of(host.begin(), host.end(), [](unsigned x) { return x == 0x55555555u; });
  UNSCOPED_INFO(mr.name() << ": block reused " << (reused ? "yes" : "no"));
  return intact;
}

TEST_CASE("cross-stream reuse: a freed block is not reused by another stream too early") {
  async_resource pool{{.release_threshold = std::numeric_limits<std::uint64_t>::max()}};
  CHECK(cross_stream_reuse_is_safe(pool));
  device_resource plain;
  CHECK(cross_stream_reuse_is_safe(plain));
  // The test has teeth: a resource that reuses without ordering is caught.
  unordered_cache wrong{plain};
  CHECK_FALSE(cross_stream_reuse_is_safe(wrong));
}

TEST_CASE("an exception between allocation and free leaves device memory where it was",
          "[free-memory]") {
  { device_buffer<float> warm_up(1 << 20); }  // context and first-allocation overheads
  const std::size_t before = cudamem_test::free_device_memory();
  const std::size_t size = std::size_t{1} << 30;  // 1 GiB, as in the seed
  bool caught = false;
  try {
    device_buffer<float> dev(size / sizeof(float));
    CHECK(cudamem_test::free_device_memory() <= before - size);  // it really was allocated
    throw std::runtime_error("computation failed");  // ...some computation using dev...
  } catch (const std::runtime_error&) {
    caught = true;  // no cudaFree anywhere: the buffer's destructor did it
  }
  CHECK(caught);
  CHECK(cudamem_test::free_device_memory() == before);
}

// --- fault injection ----------------------------------------------------------------------

namespace {
/// Runs `operation` with the k-th allocation through `faults` failing, for k = 1, 2, ... until
/// it completes without reaching a k-th call. After every failure: out_of_memory was thrown,
/// `base` holds `baseline` bytes again (nothing leaked), and `still_valid()` holds.
/// Returns how many allocations the operation made.
std::size_t fail_each_allocation(failing_adaptor& faults, const memory_resource& base,
                                 std::size_t baseline, const std::function<void()>& operation,
                                 const std::function<void()>& still_valid = [] {}) {
  for (std::size_t k = 1; k < 100; ++k) {
    faults.fail_call(k);
    try {
      operation();
    } catch (const out_of_memory& e) {
      CHECK(e.report().cause.find("injected") != std::string::npos);
      check(cudaDeviceSynchronize());
      CHECK(base.stats().used_bytes == baseline);
      still_valid();
      continue;
    }
    faults.never_fail();
    return k - 1;  // completed: it made k - 1 calls
  }
  FAIL("operation never completed");
  return 0;
}
}  // namespace

TEST_CASE("fault injection: every device_buffer constructor leaks nothing when allocation fails") {
  async_resource base;
  failing_adaptor faults{base};
  stream s;
  const std::vector<int> host(1000, 3);
  CHECK(fail_each_allocation(faults, base, 0, [&] { device_buffer<int> b(1000, s, faults); }) == 1);
  CHECK(fail_each_allocation(faults, base, 0, [&] { device_buffer<int> b(1000, zero_fill, s, faults); }) == 1);
  CHECK(fail_each_allocation(faults, base, 0, [&] { device_buffer<int> b(1000, 7, s, faults); }) == 1);
  CHECK(fail_each_allocation(faults, base, 0, [&] { device_buffer<int> b(host, s, faults); }) == 1);
  // Several owners in one scope: whichever allocation fails, the earlier ones are freed.
  CHECK(fail_each_allocation(faults, base, 0, [&] {
          device_buffer<int> a(host, s, faults);
          device_buffer<int> b(2000, 1, s, faults);
          device_buffer<int> c = a.clone(s);
          b.resize(5000, s);
          a.reserve(4000, s);
        }) == 5);
  s.synchronize();
  CHECK(base.stats().used_bytes == 0);
}

TEST_CASE("fault injection: resize, reserve and clone keep the buffer intact when they fail") {
  async_resource base;
  failing_adaptor faults{base};
  stream s;
  std::vector<int> values(1000);
  std::iota(values.begin(), values.end(), 0);
  device_buffer<int> b(values, s, faults);
  const std::size_t baseline = base.stats().used_bytes;
  int* const data = b.data();
  auto unchanged = [&] {
    CHECK(b.size() == 1000);
    CHECK(b.data() == data);
    CHECK(to_host(b) == values);
  };
  CHECK(fail_each_allocation(faults, base, baseline, [&] { b.reserve(4000, s); b.reserve(1000, s); }, unchanged) == 1);
  // reserve succeeded on the last round: new memory now; re-take the baseline.
  const std::size_t grown = base.stats().used_bytes;
  int* const moved = b.data();
  CHECK(to_host(b) == values);
  CHECK(fail_each_allocation(faults, base, grown, [&] { device_buffer<int> c = b.clone(s); }, [&] {
    CHECK(b.data() == moved);
    CHECK(to_host(b) == values);
  }) == 1);
  CHECK(fail_each_allocation(faults, base, grown, [&] { b.resize(9000, s); b.resize(1000, s); }, [&] {
    CHECK(b.size() == 1000);
    CHECK(to_host(b) == values);
  }) == 1);
}

TEST_CASE("fault injection: pinned_buffer constructors, resize and clone") {
  pinned_resource base;
  failing_adaptor faults{base};
  stream s;
  const std::vector<int> host(500, 4);
  CHECK(fail_each_allocation(faults, base, 0, [&] { pinned_buffer<int> b(500, s, faults); }) == 1);
  CHECK(fail_each_allocation(faults, base, 0, [&] { pinned_buffer<int> b(500, zero_fill, s, faults); }) == 1);
  CHECK(fail_each_allocation(faults, base, 0, [&] { pinned_buffer<int> b(500, 1, s, faults); }) == 1);
  CHECK(fail_each_allocation(faults, base, 0, [&] {
          pinned_buffer<int> b(host, s, faults);
          pinned_buffer<int> c = b.clone(s);
          b.resize(2000, s);
        }) == 3);
  pinned_buffer<int> b(host, s, faults);
  const std::size_t baseline = base.stats().used_bytes;
  CHECK(fail_each_allocation(faults, base, baseline, [&] { pinned_buffer<int> c = b.clone(s); }, [&] {
    CHECK(b.size() == 500);
    CHECK(b[499] == 4);
  }) == 1);
}
