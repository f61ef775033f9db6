// vm_pool_resource and vm_resource on a real device: stream order across compaction (a kernel
// still reading a freed block whose physical memory is recycled, through the pool and through
// the upstream alone), everything given back at destruction, real swiss cheese, the mixed
// trace's variants run twice on one pool (the second run keeps as much live as the first),
// peers, bad input; memory made ahead by the growth thread; per-thread streams of two threads.
#include <cudamem/memory_report.hpp>
#include <cudamem/stream.hpp>
#include <cudamem/vm_pool_resource.hpp>
#include <cudamem/vm_resource.hpp>

#include "../../bench/support/fragmentation.hpp"
#include "gpu_test.hpp"

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstdio>
#include <future>
#include <thread>
#include <vector>

using namespace cudamem;

namespace {

constexpr std::size_t MiB = std::size_t{1} << 20;

/// Spins for `cycles`, then counts the bytes of `data` that equal `expected`.
__global__ void slow_count(const unsigned char* data, std::size_t n, unsigned char expected,
                           long long cycles, unsigned long long* count) {
  if (threadIdx.x == 0) {
    const long long start = clock64();
    while (clock64() - start < cycles) {
    }
  }
  __syncthreads();
  unsigned long long mine = 0;
  for (std::size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    mine += data[i] == expected ? 1 : 0;
  }
  atomicAdd(count, mine);
}

vm_pool_options limited(std::size_t chunk, std::size_t limit) {
  vm_pool_options o;
  o.handle_bytes = chunk;
  o.physical_limit = limit;
  return o;
}

/// Four 64 MiB blocks on `reader`; two kernels wait ~0.5 s, then read blocks 0 and 2, which
/// are freed at once; with the budget spent, 128 MiB on `writer` needs both holes remapped
/// together. The kernels must still see their data, not the writer's 0xFF. Frees everything.
/// `no_host_wait`: the allocation returns while the kernels still run (writer == reader:
/// stream order alone puts the writer after them).
template <class Resource>
void recycle_while_a_kernel_reads(Resource& memory, stream_view reader, stream_view writer,
                                  bool no_host_wait = false) {
  std::vector<void*> blocks;
  for (int i = 0; i < 4; ++i) {
    blocks.push_back(memory.allocate(64 * MiB, 256, reader));
    check(cudaMemsetAsync(blocks.back(), 1, 64 * MiB, reader.get()));
  }
  unsigned long long* count = nullptr;
  check(cudaMallocAsync(&count, 2 * sizeof(unsigned long long), reader.get()));
  check(cudaMemsetAsync(count, 0, 2 * sizeof(unsigned long long), reader.get()));
  const long long cycles = 1'000'000'000;
  slow_count<<<256, 256, 0, reader.get()>>>(static_cast<unsigned char*>(blocks[0]), 64 * MiB, 1,
                                            cycles, count);
  slow_count<<<256, 256, 0, reader.get()>>>(static_cast<unsigned char*>(blocks[2]), 64 * MiB, 1,
                                            cycles, count + 1);
  check(cudaGetLastError());
  memory.deallocate(blocks[0], 64 * MiB, 256, reader);
  memory.deallocate(blocks[2], 64 * MiB, 256, reader);
  void* big = memory.allocate(128 * MiB, 256, writer);  // both holes, remapped together
  bool plain = false;  // under compute-sanitizer a vm_pool's blocks are cudaMalloc'd
  if constexpr (requires { memory.uses_plain_memory(); }) {
    plain = memory.uses_plain_memory();
  }
  CHECK(memory.vm_stats().compactions == (plain ? 0U : 1U));
  if (no_host_wait) {
    CHECK(cudaStreamQuery(reader.get()) == cudaErrorNotReady);  // the kernels still run
    static_cast<void>(cudaGetLastError());
  }
  check(cudaMemsetAsync(big, 0xFF, 128 * MiB, writer.get()));
  writer.synchronize();
  reader.synchronize();
  unsigned long long host[2] = {0, 0};
  check(cudaMemcpy(host, count, sizeof host, cudaMemcpyDeviceToHost));
  CHECK(host[0] == 64 * MiB);
  CHECK(host[1] == 64 * MiB);
  check(cudaFree(count));
  memory.deallocate(big, 128 * MiB, 256, writer);
  memory.deallocate(blocks[1], 64 * MiB, 256, reader);
  memory.deallocate(blocks[3], 64 * MiB, 256, reader);
}

}  // namespace

TEST_CASE("vm_pool (GPU): recycled memory is not overwritten while a kernel still reads it") {
  vm_pool_resource pool{0, limited(32 * MiB, 256 * MiB)};
  stream reader;
  stream writer;
  recycle_while_a_kernel_reads(pool, reader, writer);
}

// physical_limit bounds what the vm_pool holds from the device in both of its modes: virtual
// memory, and the cudaMalloc'd memory it takes under compute-sanitizer (tests/gpu/sanitize.sh
// runs this binary under the tool). A request past it fails with the verdict `budget` and the
// vm_pool's own advice, and loses nothing: the same requests succeed once blocks are freed.
TEST_CASE("vm_pool (GPU): physical_limit holds, under compute-sanitizer too") {
  vm_pool_resource pool{0, limited(32 * MiB, 128 * MiB)};
  CAPTURE(pool.uses_plain_memory());
  void* a = pool.allocate(96 * MiB);
  try {
    static_cast<void>(pool.allocate(64 * MiB));
    FAIL("64 MiB more than a 128 MiB limit with 96 MiB in use was allowed");
  } catch (const out_of_memory& e) {
    CHECK(e.verdict() == oom_verdict::budget);
    CHECK(e.report().hint().find("physical_limit") != std::string::npos);
  }
  void* b = pool.allocate(32 * MiB);  // exactly up to the limit
  check(cudaMemset(a, 1, 96 * MiB));
  check(cudaMemset(b, 2, 32 * MiB));
  check(cudaDeviceSynchronize());
  pool.deallocate(b, 32 * MiB);
  pool.deallocate(a, 96 * MiB);
  void* whole = pool.allocate(128 * MiB);  // all of it, once the blocks are back
  check(cudaMemset(whole, 3, 128 * MiB));
  check(cudaDeviceSynchronize());
  pool.deallocate(whole, 128 * MiB);
  CHECK(pool.stats().used_bytes == 0);
}

// Bulk blocks (bulk_handle_bytes) on the device: a whole multiple of 32 MiB is the bulk
// vm_resource's, the rest as before; kernels write and read both; release() gives back both.
// Under compute-sanitizer there is no bulk resource (plain memory): the same blocks still work.
TEST_CASE("vm_pool (GPU): bulk blocks are whole large handles, usable like any block") {
  vm_pool_options options;
  options.handle_bytes = 4 * MiB;
  options.bulk_handle_bytes = 32 * MiB;
  vm_pool_resource pool{0, options};
  CAPTURE(pool.uses_plain_memory());
  stream s;
  void* bulk = pool.allocate(96 * MiB, 256, s);
  void* other = pool.allocate(36 * MiB, 256, s);
  check(cudaMemsetAsync(bulk, 0x5A, 96 * MiB, s.get()));
  check(cudaMemsetAsync(other, 0x3C, 36 * MiB, s.get()));
  unsigned char last[2] = {0, 0};
  check(cudaMemcpyAsync(&last[0], static_cast<unsigned char*>(bulk) + 96 * MiB - 1, 1,
                        cudaMemcpyDeviceToHost, s.get()));
  check(cudaMemcpyAsync(&last[1], static_cast<unsigned char*>(other) + 36 * MiB - 1, 1,
                        cudaMemcpyDeviceToHost, s.get()));
  s.synchronize();
  CHECK(last[0] == 0x5A);
  CHECK(last[1] == 0x3C);
  const vm_pool_stats st = pool.vm_stats();
  CHECK(st.large_used_bytes == 132 * MiB);
  if (pool.uses_plain_memory()) {
    CHECK(pool.bulk_vm() == nullptr);
  } else {
    REQUIRE(st.bulk.has_value());
    CHECK(st.bulk->used_bytes == 96 * MiB);
    CHECK(st.bulk->handle_bytes == 32 * MiB);
    CHECK(&pool.upstream_vm_of(bulk) == pool.bulk_vm());
    CHECK(&pool.upstream_vm_of(other) == &pool.upstream_vm());
  }
  pool.deallocate(bulk, 96 * MiB, 256, s);
  pool.deallocate(other, 36 * MiB, 256, s);
  s.synchronize();
  pool.release();
  const vm_pool_stats after = pool.vm_stats();
  CHECK(after.mapped_bytes == 0);
  CHECK((!after.bulk || after.bulk->mapped_bytes == 0));
}

// The upstream alone, freeing on a stream: recycling a handle whose last use is a running kernel
// must wait for that kernel (on the host) before the handle is mapped anywhere else.
TEST_CASE("vm_resource (GPU): a handle freed on a stream is recycled only after its work") {
  vm_resource_options options;
  options.handle_bytes = 32 * MiB;
  options.growth_bytes = 0;
  options.physical_limit = 256 * MiB;
  vm_resource vm{0, options};
  stream reader;
  stream writer;
  recycle_while_a_kernel_reads(vm, reader, writer);
  CHECK(vm.release() == 256 * MiB);  // waits for every free, then unmaps
}

// The driver reserves address space aligned to a power-of-two handle, so every handle sits at
// a multiple of its size and placement needs no lookup (detail/vm/handle_set.hpp); with a
// handle size that is not a power of two it looks up. Either way a block of whole handles
// starts on a handle of its own, and kernels can write all of it.
TEST_CASE("vm_resource (GPU): blocks of whole handles start at a multiple of a power-of-two "
          "handle") {
  for (const std::size_t handle : {4 * MiB, 6 * MiB}) {
    CAPTURE(handle);
    vm_resource_options options;
    options.handle_bytes = handle;
    options.growth_bytes = 0;
    vm_resource vm{0, options};
    std::vector<std::pair<void*, std::size_t>> blocks;
    for (const std::size_t bytes : {4 * MiB, 3 * MiB, 10 * MiB, 1 * MiB, 26 * MiB, 6 * MiB}) {
      void* p = vm.allocate(bytes);
      check(cudaMemset(p, 7, bytes));
      if (bytes >= handle && handle == 4 * MiB) {
        CHECK(reinterpret_cast<std::uintptr_t>(p) % handle == 0);
      }
      blocks.emplace_back(p, bytes);
    }
    check(cudaDeviceSynchronize());
    for (std::size_t i = 0; i < blocks.size(); i += 2) {  // holes, then taken again
      vm.deallocate(blocks[i].first, blocks[i].second);
    }
    for (std::size_t i = 0; i < blocks.size(); i += 2) {
      blocks[i].first = vm.allocate(blocks[i].second);
      check(cudaMemset(blocks[i].first, 9, blocks[i].second));
      if (blocks[i].second >= handle && handle == 4 * MiB) {
        CHECK(reinterpret_cast<std::uintptr_t>(blocks[i].first) % handle == 0);
      }
    }
    check(cudaDeviceSynchronize());
    for (const auto& [p, bytes] : blocks) {
      vm.deallocate(p, bytes);
    }
    CHECK(vm.stats().used_bytes == 0);
  }
}

// Frees on the legacy default stream record their event only when it is needed
// (driver_mapping.hpp): when a non-blocking stream (which the legacy stream does not order)
// takes the range, and when the host waits before recycling. Either way the kernel still
// reading on the legacy stream must see its data.
TEST_CASE("vm_resource (GPU): frees on the legacy stream order later users, recorded lazily") {
  vm_resource_options options;
  options.handle_bytes = 32 * MiB;
  options.growth_bytes = 0;
  options.physical_limit = 256 * MiB;
  const stream writer{stream_options{.non_blocking = true}};
  SECTION("recycled (a host wait)") {
    vm_resource vm{0, options};
    recycle_while_a_kernel_reads(vm, stream_view{}, writer);
    CHECK(vm.release() == 256 * MiB);
  }
  SECTION("recycled for the legacy stream itself (stream order, no host wait)") {
    vm_resource vm{0, options};
    recycle_while_a_kernel_reads(vm, stream_view{}, stream_view{}, /*no_host_wait=*/true);
    CHECK(vm.release() == 256 * MiB);
  }
  SECTION("taken as it is by another stream (a device wait)") {
    vm_resource vm{0, options};
    void* block = vm.allocate(64 * MiB, 256, stream_view{});
    check(cudaMemsetAsync(block, 1, 64 * MiB, nullptr));
    unsigned long long* count = nullptr;
    check(cudaMalloc(&count, sizeof(unsigned long long)));
    check(cudaMemset(count, 0, sizeof(unsigned long long)));
    slow_count<<<256, 256, 0, nullptr>>>(static_cast<unsigned char*>(block), 64 * MiB, 1,
                                         1'000'000'000, count);
    check(cudaGetLastError());
    vm.deallocate(block, 64 * MiB, 256, stream_view{});
    void* again = vm.allocate(64 * MiB, 256, writer);
    CHECK(again == block);  // the same range, no compaction: only the event orders the two
    CHECK(vm.vm_stats().compactions == 0);
    check(cudaMemsetAsync(again, 0xFF, 64 * MiB, writer.get()));
    writer.synchronize();
    check(cudaDeviceSynchronize());
    unsigned long long host = 0;
    check(cudaMemcpy(&host, count, sizeof host, cudaMemcpyDeviceToHost));
    CHECK(host == 64 * MiB);
    check(cudaFree(count));
    vm.deallocate(again, 64 * MiB, 256, writer);
  }
}

// cudaStreamPerThread is the same handle in every thread and a different stream in each
// (detail/stream_tag.hpp). A worker's kernels still read blocks it freed on its own
// per-thread stream; the main thread, on its per-thread stream, must not overwrite them:
// recycled, the host waits for the worker's free; taken as it is, the device does. The worker
// stays alive until the main thread is done, so its stream cannot be finished by its exit.
TEST_CASE("vm_resource (GPU): another thread's per-thread stream is another stream") {
  vm_resource_options options;
  options.handle_bytes = 32 * MiB;
  options.growth_bytes = 0;
  options.physical_limit = 256 * MiB;
  options.grow_ahead_bytes = 0;  // what release() gives back is what the test mapped
  vm_resource vm{0, options};
  const stream_view per_thread = stream_view::per_thread();
  const bool recycled = GENERATE(true, false);
  CAPTURE(recycled);
  const std::size_t block = recycled ? 64 * MiB : 128 * MiB;
  std::vector<void*> blocks;
  unsigned long long* count = nullptr;
  std::promise<void> worker_done;
  std::promise<void> main_done;
  std::thread worker{[&] {
    check(cudaSetDevice(0));
    for (std::size_t i = 0; i < (recycled ? 4 : 1); ++i) {
      blocks.push_back(vm.allocate(block, 256, per_thread));
      check(cudaMemsetAsync(blocks.back(), 1, block, per_thread.get()));
    }
    check(cudaMallocAsync(&count, 2 * sizeof(unsigned long long), per_thread.get()));
    check(cudaMemsetAsync(count, 0, 2 * sizeof(unsigned long long), per_thread.get()));
    for (std::size_t i = 0; i < blocks.size(); i += 2) {
      slow_count<<<256, 256, 0, per_thread.get()>>>(static_cast<unsigned char*>(blocks[i]),
                                                    block, 1, 1'000'000'000, count + i / 2);
      check(cudaGetLastError());
      vm.deallocate(blocks[i], block, 256, per_thread);
    }
    worker_done.set_value();
    main_done.get_future().wait();
    per_thread.synchronize();
  }};
  worker_done.get_future().wait();
  void* mine = vm.allocate(128 * MiB, 256, per_thread);  // both holes, or the one block
  CHECK(vm.vm_stats().compactions == (recycled ? 1U : 0U));
  check(cudaMemsetAsync(mine, 0xFF, 128 * MiB, per_thread.get()));
  per_thread.synchronize();
  main_done.set_value();
  worker.join();
  unsigned long long host[2] = {0, 0};
  check(cudaMemcpy(host, count, sizeof host, cudaMemcpyDeviceToHost));
  CHECK(host[0] == block);
  CHECK(host[1] == (recycled ? block : 0));
  check(cudaFree(count));
  vm.deallocate(mine, 128 * MiB, 256, per_thread);
  for (std::size_t i = 1; i < blocks.size(); i += 2) {
    vm.deallocate(blocks[i], block, 256, per_thread);
  }
  CHECK(vm.release() == (recycled ? 256 : 128) * MiB);
}

TEST_CASE("vm_pool (GPU): destruction gives every byte back to the device", "[free-memory]") {
  const std::size_t baseline = cudamem_test::free_device_memory();
  {
    vm_pool_resource pool{0};
    std::vector<void*> blocks;
    for (int i = 0; i < 32; ++i) {
      blocks.push_back(pool.allocate(64 * MiB, 256, stream_view{}));
    }
    for (int i = 0; i < 32; i += 2) {
      pool.deallocate(blocks[i], 64 * MiB, 256, stream_view{});
    }
    void* big = pool.allocate(512 * MiB, 256, stream_view{});
    check(cudaMemset(big, 7, 512 * MiB));
    // Virtual memory holds the 32 blocks' handles (2 GiB), recycled for `big`; under
    // compute-sanitizer the blocks are cudaMalloc'd and the freed ones gone: 1.5 GiB live.
    const std::size_t held = pool.uses_plain_memory() ? 1024 * MiB : 2048 * MiB;
    CHECK(cudamem_test::free_device_memory() < baseline - held);
    pool.deallocate(big, 512 * MiB, 256, stream_view{});
    for (int i = 1; i < 32; i += 2) {
      pool.deallocate(blocks[i], 64 * MiB, 256, stream_view{});
    }
  }
  const std::size_t after = cudamem_test::free_device_memory();
  CAPTURE(baseline, after);
  CHECK(after + 4 * MiB >= baseline);  // events and page tables may cost a little, not memory
}

// Fills the device until cuMemCreate answers CUDA_ERROR_OUT_OF_MEMORY, on purpose.
TEST_CASE("vm_pool (GPU): swiss cheese over the whole device reuses >= 0.99 of the freed memory",
          "[expected-api-error]") {
  vm_pool_resource pool{0};
  std::vector<void*> small;
  try {
    for (;;) {
      small.push_back(pool.allocate(64 * MiB, 256, stream_view{}));
    }
  } catch (const out_of_memory&) {
  }
  REQUIRE(small.size() >= 4);
  std::size_t freed = 0;
  for (std::size_t i = 0; i < small.size(); i += 2) {
    pool.deallocate(small[i], 64 * MiB, 256, stream_view{});
    small[i] = nullptr;
    freed += 64 * MiB;
  }
  std::vector<void*> large;
  try {
    for (;;) {
      large.push_back(pool.allocate(128 * MiB, 256, stream_view{}));
    }
  } catch (const out_of_memory&) {
  }
  const double fraction =
      static_cast<double>(large.size() * 128 * MiB) / static_cast<double>(freed);
  std::printf("vm_pool swiss cheese: %zu x 64 MiB, %zu x 128 MiB, fraction %.4f, %zu compaction(s)\n",
              small.size(), large.size(), fraction, pool.vm_stats().compactions);
  if (pool.uses_plain_memory()) {
    // Under compute-sanitizer the blocks are cudaMalloc'd, so the fraction is cudaMalloc's under
    // the tool, not the vm_pool's: initcheck's own device memory takes part of the freed holes
    // (0.89 on an H200, CUDA 13.0), where memcheck leaves them whole.
    WARN("under compute-sanitizer vm_pool takes cudaMalloc memory: fraction not checked, "
         << fraction);
  } else {
    CHECK(fraction >= 0.99);
  }
  for (void* p : large) {
    check(cudaMemset(p, 1, 128 * MiB));  // really usable
    pool.deallocate(p, 128 * MiB, 256, stream_view{});
  }
  for (void* p : small) {
    if (p != nullptr) {
      pool.deallocate(p, 64 * MiB, 256, stream_view{});
    }
  }
  if (!pool.uses_plain_memory()) {  // under compute-sanitizer every block went back at its free
    CHECK(pool.release() > 0);
  }
}

// Fills the device to the first failure (cuMemCreate answers CUDA_ERROR_OUT_OF_MEMORY) on
// purpose, twice per variant. Prints each run's figures (the bench measures the time; this
// checks the fractions): a line per variant, "cold F ns/op, warm F ns/op".
TEST_CASE("vm_pool (GPU): a second run of the mixed trace keeps as much of the device live",
          "[expected-api-error][free-memory]") {
  std::array<stream, 4> streams;
  const auto on = [&](std::size_t s) { return stream_view{streams[s % streams.size()]}; };
  for (const char* name : {"bench", "wide", "streams4"}) {
    const auto& variants = cudamem_bench::mixed_variants();
    const auto v = std::find_if(variants.begin(), variants.end(),
                                [&](const auto& x) { return x.name == name; });
    REQUIRE(v != variants.end());
    const std::size_t free = cudamem_test::free_device_memory();
    cudamem_bench::mixed_spec spec = v->make(free);
    vm_pool_resource pool{0};
    const auto alloc = [&](std::size_t n, std::size_t s) -> void* {
      try {
        return pool.allocate(n, 256, on(s));
      } catch (const out_of_memory&) {
        return nullptr;
      }
    };
    const auto release = [&](void* p, std::size_t n, std::size_t s) {
      pool.deallocate(p, n, 256, on(s));
    };
    const auto cold = cudamem_bench::mixed(spec, alloc, release);
    const auto warm = cudamem_bench::mixed(spec, alloc, release);
    std::printf("vm_pool mixed %-9s cold %.4f %6.0f ns/op, warm %.4f %6.0f ns/op\n", name,
                cold.ratio, cold.ns_per_op, warm.ratio, warm.ns_per_op);
    CAPTURE(name, cold.ratio, warm.ratio);
    CHECK(cold.ratio >= 0.97);
    CHECK(warm.ratio >= 0.97);
    CHECK(warm.ratio >= cold.ratio);
    CHECK(pool.stats().used_bytes == 0);
  }
}

TEST_CASE("vm_pool (GPU): peers get access; bad devices and peers are refused") {
  vm_pool_options own;
  own.peers = {0};
  CHECK_THROWS_AS(vm_pool_resource(0, own), std::invalid_argument);
  vm_pool_options missing;
  missing.peers = {device_count()};
  CHECK_THROWS_AS(vm_pool_resource(0, missing), std::out_of_range);
  CHECK_THROWS_AS(vm_pool_resource(device_count()), std::out_of_range);
  if (device_count() < 2) {
    return;
  }
  int can = 0;
  check(cudaDeviceCanAccessPeer(&can, 0, 1));
  if (can == 0) {
    return;
  }
  vm_pool_options shared;
  shared.peers = {0};
  vm_pool_resource pool{1, shared};
  CHECK(pool.device() == 1);
  void* p = pool.allocate(4 * MiB, 256, stream_view{});
  unsigned long long* count = nullptr;
  check(cudaMalloc(&count, sizeof *count));  // on device 0, the current one
  check(cudaMemset(count, 0, sizeof *count));
  check(cudaMemset(p, 3, 4 * MiB));
  slow_count<<<64, 256>>>(static_cast<unsigned char*>(p), 4 * MiB, 3, 0, count);  // device 0 reads
  check(cudaDeviceSynchronize());
  unsigned long long host = 0;
  check(cudaMemcpy(&host, count, sizeof host, cudaMemcpyDeviceToHost));
  CHECK(host == 4 * MiB);
  check(cudaFree(count));
  pool.deallocate(p, 4 * MiB, 256, stream_view{});
}

TEST_CASE("vm_pool (GPU): memory its growth thread made ahead is memory kernels can use") {
  // The default over a real device: a quarter of what it holds is made ahead, up to 4 GiB.
  vm_pool_resource pool{0};
  if (pool.uses_plain_memory()) {
    WARN("under compute-sanitizer vm_pool takes cudaMalloc memory: nothing is made ahead");
    return;
  }
  stream s;
  constexpr int count_blocks = 64;  // 4 GiB in blocks of a handle: straight to the upstream
  std::vector<void*> blocks;
  for (int i = 0; i < count_blocks; ++i) {
    blocks.push_back(pool.allocate(64 * MiB, 256, s));
  }
  pool.upstream_vm().wait_for_growth();
  const vm_pool_stats st = pool.vm_stats();
  CAPTURE(st.mapped_bytes, st.used_bytes, st.handles_created, st.handles_created_ahead);
  CHECK(st.handles_created_ahead > 0);
  CHECK(st.free_bytes >= st.used_bytes / 4);  // the headroom, a quarter of what it holds
  CHECK(st.free_bytes <= default_grow_ahead_bytes + 1024 * MiB);
  // One more block comes from the memory made ahead: no growth of the caller's own (the
  // thread may make more meanwhile).
  blocks.push_back(pool.allocate(64 * MiB, 256, s));
  const vm_pool_stats after = pool.vm_stats();
  CHECK(after.handles_created - after.handles_created_ahead ==
        st.handles_created - st.handles_created_ahead);
  unsigned long long* count = nullptr;
  check(cudaMallocAsync(&count, sizeof *count, s.get()));
  check(cudaMemsetAsync(count, 0, sizeof *count, s.get()));
  for (void* p : blocks) {
    check(cudaMemsetAsync(p, 7, 64 * MiB, s.get()));
    slow_count<<<256, 256, 0, s.get()>>>(static_cast<unsigned char*>(p), 64 * MiB, 7, 0, count);
  }
  check(cudaGetLastError());
  unsigned long long host = 0;
  check(cudaMemcpyAsync(&host, count, sizeof host, cudaMemcpyDeviceToHost, s.get()));
  check(cudaFreeAsync(count, s.get()));
  s.synchronize();
  CHECK(host == blocks.size() * 64 * MiB);
  for (void* p : blocks) {
    pool.deallocate(p, 64 * MiB, 256, s);
  }
  s.synchronize();
  CHECK(pool.release() >= st.mapped_bytes);  // what it made ahead goes back too
  CHECK(pool.vm_stats().mapped_bytes == 0);
}

TEST_CASE("vm_pool (GPU): grow_ahead_bytes 0 makes nothing ahead") {
  vm_pool_options o;
  o.grow_ahead_bytes = 0;
  vm_pool_resource pool{0, o};
  if (pool.uses_plain_memory()) {
    WARN("under compute-sanitizer vm_pool takes cudaMalloc memory: nothing is mapped");
    return;
  }
  void* p = pool.allocate(64 * MiB, 256, stream_view{});
  pool.upstream_vm().wait_for_growth();
  CHECK(pool.vm_stats().handles_created_ahead == 0);
  CHECK(pool.vm_stats().mapped_bytes == 256 * MiB);  // one growth of growth_bytes
  pool.deallocate(p, 64 * MiB, 256, stream_view{});
}
