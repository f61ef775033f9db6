// Code built with `nvcc --default-stream per-thread`: CUDA_API_PER_THREAD_DEFAULT_STREAM is
// defined before any CUDA header, and stream 0 then names the *calling thread's* default
// stream, as cudaStreamPerThread does everywhere. So two threads' work on stream 0 is on two
// streams: memory one thread freed on 0 must not go to another thread's request on 0 without a
// wait, or the second thread's kernels write what the first one's still read. The rule lives
// in detail/stream_tag.hpp; pool_resource's ledger and vm_resource both keep their records by
// its tags. The pool used to compare stream 0 by handle and took another thread's frees on it
// as the requester's own.
//
// This file is its own executable (tests/CMakeLists.txt builds each host test alone), so the
// macro holds for everything in it, as it does for a whole program built that way.
#define CUDA_API_PER_THREAD_DEFAULT_STREAM 1

#include <cudamem/detail/pool/host_stream_events.hpp>
#include <cudamem/detail/stream_tag.hpp>
#include <cudamem/detail/vm/mapping.hpp>
#include <cudamem/detail/vm/simulated_mapping.hpp>
#include <cudamem/pool_resource.hpp>
#include <cudamem/simulated_resource.hpp>
#include <cudamem/vm_resource.hpp>

#include <catch2/catch.hpp>

#include <cstdint>
#include <memory>
#include <thread>

using namespace cudamem;

namespace {

constexpr std::size_t KiB = std::size_t{1} << 10;
constexpr std::size_t MiB = std::size_t{1} << 20;

/// Runs `work` on a thread of its own, to its end.
template <class Work>
void on_a_worker(Work&& work) {
  std::thread{std::forward<Work>(work)}.join();
}

}  // namespace

TEST_CASE("per-thread default stream build: stream 0 is the calling thread's own stream") {
  const cudaStream_t mine = detail::stream_tag(nullptr);
  CHECK(detail::is_thread_tag(mine));
  CHECK(detail::stream_tag(cudaStreamPerThread) == mine);  // the same stream, named twice
  CHECK(detail::cuda_stream(mine) == cudaStreamPerThread);
  cudaStream_t theirs = nullptr;
  on_a_worker([&] { theirs = detail::stream_tag(nullptr); });
  CHECK(theirs != mine);
  CHECK(detail::stream_tag(cudaStreamLegacy) == cudaStreamLegacy);  // still one for all threads
  CHECK(detail::is_default_stream(nullptr));
}

TEST_CASE("per-thread default stream build: pool_resource orders a request on stream 0 after "
          "another thread's free on stream 0") {
  detail::host_stream_events events;  // an event completes only when the test says so
  const detail::scoped_pool_stream_events use{events};
  simulated_resource device;
  pool_options one_shard;
  one_shard.shards = 1;
  pool_resource pool{device, one_shard};

  void* freed = nullptr;
  on_a_worker([&] {
    freed = pool.allocate(64 * KiB, 256, stream_view{});
    pool.deallocate(freed, 64 * KiB, 256, stream_view{});  // its kernels may still read it
    void* again = pool.allocate(64 * KiB, 256, stream_view{});  // the worker's own: no wait
    CHECK(again == freed);
    pool.deallocate(again, 64 * KiB, 256, stream_view{});
  });
  CHECK(events.calls().record == 2);  // a thread's own stream: recorded at each free
  CHECK(events.calls().wait == 0);

  void* taken = pool.allocate(64 * KiB, 256, stream_view{});
  CHECK(taken == freed);              // the only free block
  CHECK(events.calls().wait == 1);    // after the worker's free, on this thread's stream 0
  CHECK(pool.stream_stats().cross_stream_blocks == 1);
  pool.deallocate(taken, 64 * KiB, 256, stream_view{});
  void* again = pool.allocate(64 * KiB, 256, stream_view{});  // this thread's own free now
  CHECK(again == taken);
  CHECK(events.calls().wait == 1);
  pool.deallocate(again, 64 * KiB, 256, stream_view{});
}

TEST_CASE("per-thread default stream build: vm_resource orders a request on stream 0 after "
          "another thread's free on stream 0") {
  vm_resource_options options;
  options.handle_bytes = 32 * MiB;
  options.growth_bytes = 0;  // grow by what a request needs
  vm_resource vm{std::make_unique<detail::simulated_vm_mapping>(detail::simulated_vm_options{
                     .capacity = 256 * MiB, .granularity = 2 * MiB}),
                 options};
  auto& layer = dynamic_cast<detail::simulated_vm_mapping&>(vm.mapping_layer());

  void* p = nullptr;
  on_a_worker([&] {
    p = vm.allocate(32 * MiB, 256, stream_view{});
    vm.deallocate(p, 32 * MiB, 256, stream_view{});
  });
  CHECK(layer.calls.order_after_free == 0);
  void* q = vm.allocate(32 * MiB, 256, stream_view{});
  CHECK(q == p);
  CHECK(layer.calls.order_after_free == 1);  // after the worker's free, on the device
  vm.deallocate(q, 32 * MiB, 256, stream_view{});
  void* r = vm.allocate(32 * MiB, 256, stream_view{});  // this thread's own free: nothing
  CHECK(layer.calls.order_after_free == 1);
  vm.deallocate(r, 32 * MiB, 256, stream_view{});
  CHECK(vm.release() == 32 * MiB);
  CHECK(layer.violations == 0);
}
