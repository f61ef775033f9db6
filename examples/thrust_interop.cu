// thrust_interop — thrust on a cudamem pool. thrust's default policies take every temporary
// buffer (a sort's second key array, CUB's scratch, reduce's partial sums) with cudaMalloc and
// give it back with cudaFree, which waits for the whole device; a thrust::device_vector does
// the same for its own memory. In a loop of small operations that is most of the time spent.
//
//   ./run example thrust_interop
//
// The same loop runs twice on one stream: make a device_vector from host data, sort it, sum
// it, keep the positive values (copy_if), sum those. Before: thrust's defaults. After: the
// vectors' memory from a cudamem pool through cudamem::thrust_allocator, the algorithms'
// temporaries from the same pool through cudamem::exec_policy. Both loops must give the same
// sums; the pool's statistics show where the temporaries went, and how often the pool itself
// called cudaMalloc.
#include <cudamem/cudamem.hpp>
#include <cudamem/exec_policy.hpp>       // not in cudamem.hpp: it brings thrust
#include <cudamem/thrust_allocator.hpp>  // (ditto)

#include <thrust/copy.h>
#include <thrust/device_vector.h>
#include <thrust/reduce.h>
#include <thrust/sort.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <random>
#include <vector>

namespace {

constexpr std::size_t elements = 1 << 16;  // small arrays: where the allocator matters most
constexpr int iterations = 300;

using clock_type = std::chrono::steady_clock;

struct is_positive {
  __host__ __device__ bool operator()(int x) const { return x > 0; }
};

// One iteration's answer: the sum of everything and the sum of the positive values.
struct sums {
  long long all = 0;
  long long positive = 0;
  friend bool operator==(const sums&, const sums&) = default;
};

}  // namespace

int main() try {
  std::printf("device 0: %s\n", cudamem::get_device_properties(0).name.c_str());
  std::vector<std::vector<int>> inputs(iterations, std::vector<int>(elements));
  std::mt19937 rng(42);
  std::uniform_int_distribution<int> value(-1000, 1000);
  for (auto& input : inputs) {
    for (int& x : input) {
      x = value(rng);
    }
  }
  cudamem::stream s;  // first: everything below frees on it, so it must outlive them

  // --- before: thrust's defaults -----------------------------------------------------------
  // `thrust::cuda::par.on(s)` is `thrust::device` on our stream: each temporary is a
  // cudaMalloc + cudaFree (a device-wide wait), and thrust waits for the stream after each
  // algorithm. thrust::device_vector<int> allocates with cudaMalloc and frees with cudaFree.
  const auto run_before = [&](const std::vector<int>& input) {
    const auto policy = thrust::cuda::par.on(s.get());
    thrust::device_vector<int> v(input.begin(), input.end());
    thrust::sort(policy, v.begin(), v.end());
    sums out;
    out.all = thrust::reduce(policy, v.begin(), v.end(), 0LL);
    thrust::device_vector<int> kept(elements);
    const auto end = thrust::copy_if(policy, v.begin(), v.end(), kept.begin(), is_positive{});
    out.positive = thrust::reduce(policy, kept.begin(), end, 0LL);
    return out;
  };

  // --- after: one pool for the vectors and the temporaries ----------------------------------
  // The pool gets memory from the device only when it has no free block that fits (and
  // `from_device` counts how often that was); a statistics_adaptor on top counts what
  // thrust's temporaries take from it.
  cudamem::device_resource device;
  cudamem::statistics_adaptor from_device{device};
  cudamem::pool_resource pool{from_device};
  cudamem::statistics_adaptor temporaries{pool};
  // A device_vector whose memory comes from the pool, in stream order on s; its own work
  // (copying the host data in, zero-filling) runs on s too.
  using pooled_vector = thrust::device_vector<int, cudamem::thrust_allocator<int>>;
  const cudamem::thrust_allocator<int> alloc{pool, s};
  const auto run_after = [&](const std::vector<int>& input) {
    // The policy: thrust's algorithms on s, their temporaries from `temporaries` (the pool),
    // freed in stream order as soon as the kernels are queued. No cudaMalloc, no cudaFree, no
    // wait for the device; thrust waits for s only where the host needs a result (reduce,
    // copy_if's end).
    const cudamem::exec_policy policy{temporaries, s};
    pooled_vector v(input.begin(), input.end(), alloc);
    thrust::sort(policy, v.begin(), v.end());
    sums out;
    out.all = thrust::reduce(policy, v.begin(), v.end(), 0LL);
    pooled_vector kept(elements, alloc);
    const auto end = thrust::copy_if(policy, v.begin(), v.end(), kept.begin(), is_positive{});
    out.positive = thrust::reduce(policy, kept.begin(), end, 0LL);
    return out;
  };  // v and kept go back to the pool in stream order: the next iteration reuses them

  // One untimed iteration of each first: it loads the kernels (CUDA loads them lazily, on
  // first launch) and, for the pool, takes its memory from the device.
  run_before(inputs[0]);
  run_after(inputs[0]);
  s.synchronize();
  const std::size_t device_calls_warming_up = from_device.counters().allocations;
  const std::size_t temporaries_warming_up = temporaries.counters().allocations;

  std::vector<sums> before(iterations);
  const auto before_start = clock_type::now();
  for (int i = 0; i < iterations; ++i) {
    before[i] = run_before(inputs[i]);
  }
  s.synchronize();
  const double before_ms =
      std::chrono::duration<double, std::milli>(clock_type::now() - before_start).count();

  std::vector<sums> after(iterations);
  const auto after_start = clock_type::now();
  for (int i = 0; i < iterations; ++i) {
    after[i] = run_after(inputs[i]);
  }
  s.synchronize();
  const double after_ms =
      std::chrono::duration<double, std::milli>(clock_type::now() - after_start).count();
  const std::size_t device_calls_timed = from_device.counters().allocations - device_calls_warming_up;
  const cudamem::allocation_counters t = temporaries.counters();
  const std::size_t timed_temporaries = t.allocations - temporaries_warming_up;

  std::printf("%d iterations of: device_vector from %zu host ints, sort, reduce, copy_if, reduce\n",
              iterations, elements);
  std::printf("before (thrust defaults):                %8.2f ms  (%.3f ms per iteration)\n",
              before_ms, before_ms / iterations);
  std::printf("after (thrust_allocator + exec_policy):  %8.2f ms  (%.3f ms per iteration)\n",
              after_ms, after_ms / iterations);
  std::printf("after: %zu temporaries (%zu per iteration) from the pool, %zu bytes still held; the "
              "pool called cudaMalloc %zu times while warming up and %zu times in the timed loop\n",
              timed_temporaries, timed_temporaries / iterations, t.current_bytes,
              device_calls_warming_up, device_calls_timed);

  const bool same = before == after;
  const double speedup = before_ms / after_ms;
  std::printf("thrust interop: results %s, cudamem %.1fx %s, temporaries from the pool %zu, "
              "pool cudaMalloc calls in the timed loop %zu\n",
              same ? "identical" : "DIFFERENT", speedup, speedup >= 1.0 ? "faster" : "slower",
              timed_temporaries, device_calls_timed);
  return same && timed_temporaries > 0 && device_calls_timed == 0 ? 0 : 1;
} catch (const cudamem::no_device_error& e) {
  std::printf("thrust_interop: no usable CUDA device here (%s), nothing to run\n", e.name());
  return 69;
} catch (const std::exception& e) {
  std::fprintf(stderr, "thrust_interop failed: %s\n", e.what());
  return 1;
}
