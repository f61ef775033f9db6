// vm_resource over the simulated mapping layer (no GPU): growth in batches, whole-handle
// placement, reuse without driver calls, compaction by recycling handles, stream ordering (and
// never an unmap of memory still in flight), release, destruction, bad input, a failure
// inside the layer, and a randomised run checked against a model.
#include <cudamem/detail/stream_tag.hpp>
#include <cudamem/detail/vm/config.hpp>
#include <cudamem/detail/vm/free_ranges.hpp>
#include <cudamem/detail/vm/handle_set.hpp>
#include <cudamem/detail/vm/placement.hpp>
#include <cudamem/detail/vm/simulated_mapping.hpp>
#include <cudamem/vm_resource.hpp>

#include "captured_errors.hpp"

#include <catch2/catch.hpp>

#include <cstdint>
#include <iterator>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <thread>
#include <vector>

using namespace cudamem;
using detail::simulated_vm_mapping;
using detail::simulated_vm_options;

namespace {

constexpr std::size_t MiB = std::size_t{1} << 20;
constexpr std::size_t GiB = std::size_t{1} << 30;

vm_resource_options handles_of(std::size_t handle, std::size_t growth = 0) {
  vm_resource_options o;
  o.handle_bytes = handle;
  o.growth_bytes = growth;
  return o;
}

/// 32 MiB handles, growths of `growth`, and `keep` bytes of the device kept free.
vm_resource_options keeping_free(std::size_t keep, std::size_t growth) {
  vm_resource_options o = handles_of(32 * MiB, growth);
  o.keep_free_bytes = keep;
  return o;
}

/// A vm_resource over a simulated device of `capacity` bytes, and a view of its layer.
struct sim_vm {
  explicit sim_vm(std::size_t capacity, vm_resource_options options = handles_of(32 * MiB),
                  detail::simulated_vm_final_state* final_state = nullptr)
      : vm(std::make_unique<simulated_vm_mapping>(simulated_vm_options{
               .capacity = capacity, .granularity = 2 * MiB, .final_state = final_state}),
           std::move(options)),
        layer(dynamic_cast<simulated_vm_mapping&>(vm.mapping_layer())) {}
  vm_resource vm;
  simulated_vm_mapping& layer;
};

cudaStream_t fake_stream(std::uintptr_t n) { return reinterpret_cast<cudaStream_t>(n * 0x1000); }
std::uintptr_t addr(void* p) { return reinterpret_cast<std::uintptr_t>(p); }

/// Eight 32 MiB blocks with every other one freed again: four lone holes that no larger
/// request fits in. free_survivors frees the other four.
std::vector<void*> eight_with_holes(vm_resource& vm) {
  std::vector<void*> blocks;
  for (int i = 0; i < 8; ++i) {
    blocks.push_back(vm.allocate(32 * MiB));
  }
  for (std::size_t i = 0; i < blocks.size(); i += 2) {
    vm.deallocate(blocks[i], 32 * MiB);
  }
  return blocks;
}

void free_survivors(vm_resource& vm, const std::vector<void*>& blocks) {
  for (std::size_t i = 1; i < blocks.size(); i += 2) {
    vm.deallocate(blocks[i], 32 * MiB);
  }
}

void free_each(vm_resource& vm, const std::vector<void*>& blocks, std::size_t bytes) {
  for (void* p : blocks) {
    vm.deallocate(p, bytes);
  }
}

/// Eight 32 MiB blocks allocated on stream `s`: a 256 MiB sim_vm, full.
std::vector<void*> eight_on(vm_resource& vm, cudaStream_t s) {
  std::vector<void*> blocks;
  for (int i = 0; i < 8; ++i) {
    blocks.push_back(vm.allocate(32 * MiB, 256, s));
  }
  return blocks;
}

/// The same with every other one freed on `s` again: four lone 32 MiB holes, pending on `s`.
std::vector<void*> holes_on(vm_resource& vm, cudaStream_t s) {
  std::vector<void*> blocks = eight_on(vm, s);
  for (std::size_t i = 0; i < blocks.size(); i += 2) {
    vm.deallocate(blocks[i], 32 * MiB, 256, s);
  }
  return blocks;
}

/// The end of a stream-order test on a 256 MiB sim_vm: the odd blocks freed on `s`, then
/// release() gives every byte back, and no alias was unmapped while work could still use it.
void free_odd_and_release(sim_vm& v, const std::vector<void*>& blocks, cudaStream_t s) {
  for (std::size_t i = 1; i < blocks.size(); i += 2) {
    v.vm.deallocate(blocks[i], 32 * MiB, 256, s);
  }
  CHECK(v.vm.release() == 256 * MiB);
  CHECK(v.layer.unmaps_in_flight == 0);
  CHECK(v.layer.violations == 0);
}

}  // namespace

TEST_CASE("vm_resource: first allocation reserves once, grows in a batch, sets access once") {
  sim_vm s{8 * GiB, handles_of(32 * MiB, 256 * MiB)};
  void* p = s.vm.allocate(1000);
  REQUIRE(p != nullptr);
  CHECK(addr(p) % (2 * MiB) == 0);
  CHECK(s.layer.calls.reserve == 1);
  CHECK(s.layer.reserved_bytes() == 32 * GiB);  // 4x the device by default
  CHECK(s.layer.calls.create == 8);             // growth_bytes of 32 MiB handles
  CHECK(s.layer.calls.map == 8);
  CHECK(s.layer.calls.set_access == 1);
  CHECK(s.layer.is_accessible(addr(p), 1000));
  vm_resource_stats st = s.vm.vm_stats();
  CHECK(st.mapped_bytes == 256 * MiB);
  CHECK(st.used_bytes == 2 * MiB);
  CHECK(st.requested_bytes == 1000);
  CHECK(st.partial_granule_bytes == 2 * MiB - 1000);
  CHECK(st.handles == 8);
  CHECK(st.granularity == 2 * MiB);
  CHECK(st.free_bytes == 254 * MiB);
  CHECK(st.stranded_bytes == 30 * MiB);  // the rest of the handle the 2 MiB block lives in
  // Reuse, and more requests that fit, cost the driver nothing.
  s.vm.deallocate(p, 1000);
  void* q = s.vm.allocate(100 * MiB);
  void* r = s.vm.allocate(4 * MiB);
  CHECK(s.layer.calls.create == 8);
  CHECK(s.layer.calls.map == 8);
  st = s.vm.vm_stats();
  CHECK(st.used_bytes == 128 * MiB + 4 * MiB);  // 100 MiB takes 4 whole handles
  s.vm.deallocate(q, 100 * MiB);
  s.vm.deallocate(r, 4 * MiB);
  CHECK(s.vm.stats().used_bytes == 0);
  CHECK(s.vm.vm_stats().stranded_bytes == 0);
  CHECK(s.vm.vm_stats().largest_free_range == 256 * MiB);  // neighbours merged again
}

TEST_CASE("vm_resource: a block of a handle or more starts and ends on handle boundaries") {
  sim_vm s{GiB, handles_of(32 * MiB)};
  void* small = s.vm.allocate(6 * MiB);
  void* large = s.vm.allocate(40 * MiB);  // not after the 6 MiB: at the next handle
  CHECK((addr(large) - addr(small)) % (32 * MiB) == 0);
  CHECK(s.layer.handle_at(addr(large)) != s.layer.handle_at(addr(small)));
  CHECK(s.vm.vm_stats().used_bytes == 6 * MiB + 64 * MiB);
  s.vm.deallocate(large, 40 * MiB);
  // Freed, its handles are wholly free: recyclable, while the small block strands the rest of
  // its own handle only.
  const vm_resource_stats st = s.vm.vm_stats();
  CHECK(st.recyclable_bytes == st.mapped_bytes - 32 * MiB);
  CHECK(st.stranded_bytes == 26 * MiB);
  s.vm.deallocate(small, 6 * MiB);
}

TEST_CASE("vm_resource: when nothing fits, free handles are recycled side by side") {
  sim_vm s{512 * MiB, handles_of(32 * MiB)};
  std::vector<void*> blocks;
  for (int i = 0; i < 16; ++i) {
    blocks.push_back(s.vm.allocate(32 * MiB));
  }
  CHECK_THROWS_AS(s.vm.allocate(32 * MiB), out_of_memory);
  std::vector<detail::vm_handle> freed;
  for (int i = 0; i < 16; i += 2) {
    freed.push_back(*s.layer.handle_at(addr(blocks[i])));
    s.vm.deallocate(blocks[i], 32 * MiB);
  }
  const auto creates = s.layer.calls.create;
  const auto unmaps = s.layer.calls.unmap;
  void* big = s.vm.allocate(256 * MiB);  // all eight holes, remapped together
  CHECK(s.layer.calls.create == creates);
  CHECK(s.layer.calls.unmap == unmaps);  // the old addresses stay mapped as aliases
  CHECK(s.layer.is_accessible(addr(big), 256 * MiB));
  for (std::size_t k = 0; k < 8; ++k) {
    CHECK(s.layer.handle_at(addr(big) + k * 32 * MiB) == freed[k]);  // moved, not copied
  }
  const vm_resource_stats st = s.vm.vm_stats();
  CHECK(st.compactions == 1);
  CHECK(st.stale_aliases == 8);
  CHECK(st.mapped_bytes == 512 * MiB);
  CHECK(s.layer.physical_in_use() == 512 * MiB);  // aliases are not memory
  s.vm.deallocate(big, 256 * MiB);
  for (int i = 1; i < 16; i += 2) {
    s.vm.deallocate(blocks[i], 32 * MiB);
  }
  CHECK(s.vm.release() == 512 * MiB);
  CHECK(s.layer.physical_in_use() == 0);
  CHECK(s.layer.mapping_count() == 0);
  CHECK(s.layer.violations == 0);
}

TEST_CASE("vm_resource: a compaction moves only the handles the request lacks, smallest runs first") {
  // Moving a handle costs the driver ~25-40 us (bench_vmm_driver); a free run that stays where
  // it is costs nothing. So: four lone free handles and one free run of three; a 128 MiB
  // request fits in neither, and must take exactly the four lone handles, leaving the run of
  // three in place for the next request.
  sim_vm s{GiB, handles_of(32 * MiB)};
  std::vector<void*> blocks;
  for (int i = 0; i < 32; ++i) {
    blocks.push_back(s.vm.allocate(32 * MiB));
  }
  CHECK_THROWS_AS(s.vm.allocate(32 * MiB), out_of_memory);  // the device is full
  std::vector<detail::vm_handle> lone;
  for (const int i : {5, 8, 11, 14}) {
    lone.push_back(*s.layer.handle_at(addr(blocks[i])));
    s.vm.deallocate(blocks[i], 32 * MiB);
  }
  for (const int i : {20, 21, 22}) {
    s.vm.deallocate(blocks[i], 32 * MiB);
  }
  const auto calls = s.layer.calls;
  void* big = s.vm.allocate(128 * MiB);
  CHECK(s.layer.calls.map - calls.map == 4);  // four moves, not seven
  CHECK(s.layer.calls.set_access - calls.set_access == 1);
  CHECK(s.layer.calls.create == calls.create);
  for (std::size_t k = 0; k < 4; ++k) {
    CHECK(s.layer.handle_at(addr(big) + k * 32 * MiB) == lone[k]);
  }
  CHECK(s.layer.is_accessible(addr(big), 128 * MiB));
  // The run of three is still where it was, and serves a 96 MiB request with no driver call.
  const auto after = s.layer.calls;
  void* run = s.vm.allocate(96 * MiB);
  CHECK(run == blocks[20]);
  CHECK(s.layer.calls.map == after.map);
  CHECK(s.layer.calls.set_access == after.set_access);
  const vm_resource_stats st = s.vm.vm_stats();
  CHECK(st.compactions == 1);
  CHECK(st.stale_aliases == 4);
  CHECK(st.free_bytes == 0);
  s.vm.deallocate(run, 96 * MiB);
  s.vm.deallocate(big, 128 * MiB);
  for (int i = 0; i < 32; ++i) {
    if (i != 5 && i != 8 && i != 11 && i != 14 && (i < 20 || i > 22)) {
      s.vm.deallocate(blocks[i], 32 * MiB);
    }
  }
  CHECK(s.vm.release() == GiB);
  CHECK(s.layer.physical_in_use() == 0);
  CHECK(s.layer.violations == 0);
}

TEST_CASE("vm_resource: stream order across reuse and recycling; no unmap while in flight") {
  sim_vm s{256 * MiB, handles_of(32 * MiB)};
  const cudaStream_t a = fake_stream(1);
  const cudaStream_t b = fake_stream(2);
  void* p = s.vm.allocate(32 * MiB, 256, a);
  s.vm.deallocate(p, 32 * MiB, 256, a);
  CHECK(s.layer.calls.record_free == 1);
  CHECK(s.layer.in_flight(addr(p)));
  void* q = s.vm.allocate(32 * MiB, 256, a);  // same stream: stream order is enough
  CHECK(s.layer.calls.order_after_free == 0);
  s.vm.deallocate(q, 32 * MiB, 256, a);
  void* r = s.vm.allocate(32 * MiB, 256, b);  // another stream: waits on a's event, no host wait
  CHECK(s.layer.calls.order_after_free == 1);
  CHECK(s.layer.calls.wait_for_free == 0);
  s.vm.deallocate(r, 32 * MiB, 256, b);
  void* t = s.vm.allocate(32 * MiB);  // synchronous: the host waits
  CHECK(s.layer.calls.wait_for_free == 1);
  s.vm.deallocate(t, 32 * MiB);  // a synchronous free records nothing
  CHECK(s.layer.calls.record_free == 3);

  // Fill the device on a, free every other block on a, then ask on b for more than any hole:
  // the recycled handles are still in flight on a, so the host waits before remapping them.
  std::vector<void*> blocks;
  for (;;) {
    try {
      blocks.push_back(s.vm.allocate(32 * MiB, 256, a));
    } catch (const out_of_memory&) {
      break;
    }
  }
  REQUIRE(blocks.size() == 8);
  for (std::size_t i = 0; i < blocks.size(); i += 2) {
    s.vm.deallocate(blocks[i], 32 * MiB, 256, a);
  }
  CHECK(s.layer.in_flight(addr(blocks[0])));
  const auto waits = s.layer.calls.wait_for_free;
  void* big = s.vm.allocate(128 * MiB, 256, b);
  CHECK(s.layer.calls.wait_for_free == waits + 1);
  CHECK_FALSE(s.layer.in_flight(addr(big)));
  CHECK(s.vm.vm_stats().compactions == 1);
  // release() waits for everything before it unmaps the stale aliases.
  s.vm.deallocate(big, 128 * MiB, 256, b);
  for (std::size_t i = 1; i < blocks.size(); i += 2) {
    s.vm.deallocate(blocks[i], 32 * MiB, 256, a);
  }
  CHECK(s.vm.release() == 256 * MiB);
  CHECK(s.layer.calls.wait_for_all_frees >= 1);
  CHECK(s.layer.unmaps_in_flight == 0);
  CHECK(s.layer.violations == 0);
}

TEST_CASE("vm_resource: recycling memory freed on the request's own stream needs no host "
          "wait; the range keeps that stream's tag") {
  // One stream, as a training loop has it: fill the device on a, free every other block on a,
  // then ask on a for more than any hole. The request is ordered after those frees on a, so
  // the handles are mapped again with no host wait (the old mapping stays as an alias until
  // release()); the new range stays pending on a. The legacy default stream (0, where a
  // PyTorch training loop runs) is such a stream too: a host wait there would drain the
  // device's queue at every compaction.
  for (const cudaStream_t a : {fake_stream(1), cudaStream_t{nullptr}}) {
    CAPTURE(a == nullptr);
    sim_vm s{256 * MiB, handles_of(32 * MiB)};
    const cudaStream_t b = fake_stream(2);
    std::vector<void*> blocks = eight_on(s.vm, a);
    CHECK_THROWS_AS(s.vm.allocate(32 * MiB, 256, a), out_of_memory);  // the device is full
    for (std::size_t i = 0; i < blocks.size(); i += 2) {
      s.vm.deallocate(blocks[i], 32 * MiB, 256, a);
    }
    const auto before = s.layer.calls;
    void* big = s.vm.allocate(128 * MiB, 256, a);
    CHECK(s.vm.vm_stats().compactions == 1);
    CHECK(s.layer.calls.wait_for_free == before.wait_for_free);  // no host wait
    CHECK(s.layer.calls.order_after_free == before.order_after_free);  // nor a device one
    CHECK(s.layer.in_flight(addr(big)));  // a's earlier work may still use these handles

    // Freed on a and asked for on b: b is ordered after a's frees on the device, as for any
    // range freed on another stream; the host never waited.
    s.vm.deallocate(big, 128 * MiB, 256, a);
    void* on_b = s.vm.allocate(128 * MiB, 256, b);
    CHECK(on_b == big);
    CHECK(s.layer.calls.order_after_free == before.order_after_free + 1);
    CHECK(s.layer.calls.wait_for_free == before.wait_for_free);
    s.vm.deallocate(on_b, 128 * MiB, 256, b);

    free_odd_and_release(s, blocks, a);  // no alias was unmapped while a could still use it
  }
}

TEST_CASE("vm_resource: a synchronous request recycling the legacy stream's frees waits for "
          "them") {
  // The synchronous form names no stream, and must not pass for the legacy stream (handle 0
  // too): it waits on the host for the frees it recycles.
  sim_vm s{256 * MiB, handles_of(32 * MiB)};
  std::vector<void*> blocks = holes_on(s.vm, nullptr);
  const auto before = s.layer.calls;
  void* big = s.vm.allocate(128 * MiB);
  CHECK(s.vm.vm_stats().compactions == 1);
  CHECK(s.layer.calls.wait_for_free == before.wait_for_free + 1);
  CHECK_FALSE(s.layer.in_flight(addr(big)));
  s.vm.deallocate(big, 128 * MiB);
  free_odd_and_release(s, blocks, nullptr);
}

TEST_CASE("vm_resource: a compaction that fails after recycling the request's own frees waits "
          "for them before it unmaps the new aliases, and puts the handles back idle") {
  for (const cudaStream_t a : {fake_stream(1), cudaStream_t{nullptr}}) {
    CAPTURE(a == nullptr);
    sim_vm s{256 * MiB, handles_of(32 * MiB)};
    const cudaStream_t b = fake_stream(2);
    std::vector<void*> blocks = holes_on(s.vm, a);
    const auto before = s.layer.calls;
    s.layer.fail_map_after(2);
    CHECK_THROWS_AS(s.vm.allocate(128 * MiB, 256, a), std::runtime_error);
    CHECK(s.layer.calls.wait_for_free == before.wait_for_free + 1);  // the rare path waits
    CHECK(s.layer.unmaps_in_flight == 0);
    // The holes are back where they were, idle now: a request on b takes one with no wait.
    void* hole = s.vm.allocate(32 * MiB, 256, b);
    CHECK(s.layer.calls.order_after_free == before.order_after_free);
    CHECK_FALSE(s.layer.in_flight(addr(hole)));
    s.vm.deallocate(hole, 32 * MiB, 256, b);
    free_odd_and_release(s, blocks, a);
  }
}

TEST_CASE("vm_resource: a request on a stream recycles memory another stream freed with a host "
          "wait for that stream only") {
  // Holes freed on a and on b; a request on a needs them all: the host waits for b, not a.
  sim_vm s{256 * MiB, handles_of(32 * MiB)};
  const cudaStream_t a = fake_stream(1);
  const cudaStream_t b = fake_stream(2);
  std::vector<void*> blocks = eight_on(s.vm, a);
  for (std::size_t i = 0; i < blocks.size(); i += 2) {
    s.vm.deallocate(blocks[i], 32 * MiB, 256, i < 4 ? a : b);
  }
  const auto before = s.layer.calls;
  void* big = s.vm.allocate(128 * MiB, 256, a);
  CHECK(s.vm.vm_stats().compactions == 1);
  CHECK(s.layer.calls.wait_for_free == before.wait_for_free + 1);  // for b
  s.vm.deallocate(big, 128 * MiB, 256, a);
  free_odd_and_release(s, blocks, a);
}

TEST_CASE("vm_resource: cudaStreamPerThread is one stream per thread: another thread's frees on "
          "it are ordered like any other stream's, the thread's own need nothing") {
  // The handle is the same in every thread, the stream is not (detail/stream_tag.hpp). Taken
  // by handle, the main thread would reuse or recycle what a worker freed on its own stream
  // with no wait at all while the worker's kernels may still read it.
  const cudaStream_t per_thread = cudaStreamPerThread;
  const auto on_a_worker = [](auto&& work) { std::thread{work}.join(); };

  SECTION("a free range") {
    sim_vm s{256 * MiB, handles_of(32 * MiB)};
    void* p = nullptr;
    on_a_worker([&] {
      p = s.vm.allocate(32 * MiB, 256, per_thread);
      s.vm.deallocate(p, 32 * MiB, 256, per_thread);
      void* again = s.vm.allocate(32 * MiB, 256, per_thread);  // the worker's own: no wait
      CHECK(again == p);
      s.vm.deallocate(again, 32 * MiB, 256, per_thread);
    });
    CHECK(s.layer.calls.order_after_free == 0);
    void* q = s.vm.allocate(32 * MiB, 256, per_thread);
    CHECK(q == p);
    CHECK(s.layer.calls.order_after_free == 1);  // after the worker's free, on the device
    CHECK(s.layer.calls.wait_for_free == 0);
    s.vm.deallocate(q, 32 * MiB, 256, per_thread);
    void* r = s.vm.allocate(32 * MiB, 256, per_thread);  // the main thread's own now
    CHECK(s.layer.calls.order_after_free == 1);
    s.vm.deallocate(r, 32 * MiB, 256, per_thread);
    CHECK(s.vm.release() == 32 * MiB);
    CHECK(s.layer.violations == 0);
  }
  SECTION("recycled handles") {
    sim_vm s{256 * MiB, handles_of(32 * MiB)};
    std::vector<void*> blocks;
    on_a_worker([&] { blocks = holes_on(s.vm, per_thread); });
    const auto before = s.layer.calls;
    void* big = s.vm.allocate(128 * MiB, 256, per_thread);
    CHECK(s.vm.vm_stats().compactions == 1);
    CHECK(s.layer.calls.wait_for_free == before.wait_for_free + 1);  // the worker's stream
    CHECK_FALSE(s.layer.in_flight(addr(big)));
    s.vm.deallocate(big, 128 * MiB, 256, per_thread);
    on_a_worker([&] { free_odd_and_release(s, blocks, per_thread); });
  }
  SECTION("the thread's own recycled handles") {
    sim_vm s{256 * MiB, handles_of(32 * MiB)};
    std::vector<void*> blocks = holes_on(s.vm, per_thread);
    const auto before = s.layer.calls;
    void* big = s.vm.allocate(128 * MiB, 256, per_thread);
    CHECK(s.vm.vm_stats().compactions == 1);
    CHECK(s.layer.calls.wait_for_free == before.wait_for_free);  // stream order covers it
    CHECK(s.layer.in_flight(addr(big)));
    s.vm.deallocate(big, 128 * MiB, 256, per_thread);
    free_odd_and_release(s, blocks, per_thread);
  }
}

TEST_CASE("stream_tag: a thread's own tag for the per-thread stream, every other handle itself") {
  using detail::cuda_stream;
  using detail::stream_tag;
  const cudaStream_t created = fake_stream(7);
  CHECK(stream_tag(created) == created);
  CHECK(stream_tag(cudaStreamLegacy) == cudaStreamLegacy);
  const cudaStream_t mine = stream_tag(cudaStreamPerThread);
  CHECK(mine != cudaStreamPerThread);
  CHECK(stream_tag(cudaStreamPerThread) == mine);  // stable within the thread
  CHECK(cuda_stream(mine) == cudaStreamPerThread);
  CHECK(cuda_stream(created) == created);
  cudaStream_t theirs = nullptr;
  cudaStream_t theirs_as_they_see_it = nullptr;
  std::thread{[&] {
    theirs = stream_tag(cudaStreamPerThread);
    theirs_as_they_see_it = cuda_stream(theirs);
  }}.join();
  CHECK(theirs != mine);
  CHECK(theirs_as_they_see_it == cudaStreamPerThread);
  CHECK(cuda_stream(theirs) == theirs);  // not this thread's: never given to CUDA from here
  std::thread{[&] { CHECK(stream_tag(cudaStreamPerThread) != theirs); }}.join();  // not reused
#if defined(CUDA_API_PER_THREAD_DEFAULT_STREAM)
  CHECK(stream_tag(nullptr) == mine);  // handle 0 is the thread's own stream in such a build
#else
  CHECK(stream_tag(nullptr) == nullptr);  // the legacy default stream: one for all threads
#endif
}

TEST_CASE("vm_resource: once the host has waited for a stream, its free ranges merge") {
  // Ranges freed on two streams, both pending, stay apart. A synchronous request that takes
  // one waits for its stream on the host: everything freed on that stream is idle then, and
  // merges with its neighbours, so a 96 MiB request on the other stream fits without a move.
  sim_vm s{256 * MiB, handles_of(32 * MiB)};
  const cudaStream_t a = fake_stream(1);
  const cudaStream_t b = fake_stream(2);
  std::vector<void*> blocks = eight_on(s.vm, a);
  s.vm.deallocate(blocks[0], 32 * MiB, 256, a);
  s.vm.deallocate(blocks[1], 32 * MiB, 256, a);
  s.vm.deallocate(blocks[2], 32 * MiB, 256, b);
  s.vm.deallocate(blocks[3], 32 * MiB, 256, b);
  CHECK(s.vm.vm_stats().largest_free_range == 64 * MiB);  // a's and b's apart
  void* first = s.vm.allocate(32 * MiB);  // synchronous: waits for a
  CHECK(first == blocks[0]);
  CHECK(s.layer.calls.wait_for_free == 1);
  CHECK(s.vm.vm_stats().largest_free_range == 96 * MiB);  // a's rest merged with b's
  const auto calls = s.layer.calls;
  void* big = s.vm.allocate(96 * MiB, 256, b);
  CHECK(big == blocks[1]);
  CHECK(s.layer.calls.map == calls.map);  // no move
  CHECK(s.vm.vm_stats().compactions == 0);
  s.vm.deallocate(big, 96 * MiB, 256, b);
  s.vm.deallocate(first, 32 * MiB);
  for (std::size_t i = 4; i < blocks.size(); ++i) {
    s.vm.deallocate(blocks[i], 32 * MiB, 256, a);
  }
  CHECK(s.vm.release() == 256 * MiB);
  CHECK(s.layer.unmaps_in_flight == 0);
  CHECK(s.layer.violations == 0);
}

TEST_CASE("vm_resource: neighbours freed on two streams serve a request that needs both") {
  // No single free range holds 128 MiB, but two neighbours freed on a and on b do: the host
  // waits for a (not b: the request is on b, and stream order covers it), they merge, and
  // nothing moves. A compaction would have waited for a and b, and moved four handles.
  sim_vm s{256 * MiB, handles_of(32 * MiB)};
  const cudaStream_t a = fake_stream(1);
  const cudaStream_t b = fake_stream(2);
  std::vector<void*> blocks = eight_on(s.vm, a);
  s.vm.deallocate(blocks[2], 32 * MiB, 256, a);
  s.vm.deallocate(blocks[3], 32 * MiB, 256, a);
  s.vm.deallocate(blocks[4], 32 * MiB, 256, b);
  s.vm.deallocate(blocks[5], 32 * MiB, 256, b);
  const auto calls = s.layer.calls;
  void* big = s.vm.allocate(128 * MiB, 256, b);
  CHECK(big == blocks[2]);
  CHECK(s.layer.calls.map == calls.map);
  CHECK(s.layer.calls.wait_for_free - calls.wait_for_free == 1);  // for a only
  CHECK(s.layer.calls.order_after_free == calls.order_after_free);  // b's own frees
  CHECK(s.vm.vm_stats().compactions == 0);
  CHECK(s.layer.is_accessible(addr(big), 128 * MiB));
  s.vm.deallocate(big, 128 * MiB, 256, b);
  for (const int i : {0, 1, 6, 7}) {
    s.vm.deallocate(blocks[static_cast<std::size_t>(i)], 32 * MiB, 256, a);
  }
  CHECK(s.vm.release() == 256 * MiB);
  CHECK(s.layer.unmaps_in_flight == 0);
  CHECK(s.layer.violations == 0);
}

TEST_CASE("vm_resource: a synchronous request takes an idle range before a pending one") {
  // A synchronous request (a pool's chunk) that takes a range freed on a stream must wait on
  // the host for that stream; an idle range that holds it costs no wait.
  sim_vm s{GiB, handles_of(32 * MiB)};
  const cudaStream_t a = fake_stream(1);
  void* pending = s.vm.allocate(32 * MiB, 256, a);
  void* fence1 = s.vm.allocate(32 * MiB);
  void* idle = s.vm.allocate(64 * MiB);
  void* fence2 = s.vm.allocate(32 * MiB);
  s.vm.deallocate(pending, 32 * MiB, 256, a);  // the best fit for 32 MiB, but pending on a
  s.vm.deallocate(idle, 64 * MiB);             // larger, idle
  const auto waits = s.layer.calls.wait_for_free;
  void* p = s.vm.allocate(32 * MiB);
  CHECK(p == idle);
  CHECK(s.layer.calls.wait_for_free == waits);
  void* q = s.vm.allocate(32 * MiB, 256, a);  // on a itself: the pending range, no wait
  CHECK(q == pending);
  CHECK(s.layer.calls.wait_for_free == waits);
  s.vm.deallocate(q, 32 * MiB, 256, a);
  s.vm.deallocate(p, 32 * MiB);
  s.vm.deallocate(fence1, 32 * MiB);
  s.vm.deallocate(fence2, 32 * MiB);
  CHECK(s.layer.violations == 0);
}

TEST_CASE("vm_resource: release keeps what is in use and the handles it shares") {
  sim_vm s{GiB, handles_of(32 * MiB)};
  void* keep = s.vm.allocate(MiB);
  void* drop = s.vm.allocate(100 * MiB);
  s.vm.deallocate(drop, 100 * MiB);
  const std::size_t before = s.layer.physical_in_use();
  const std::size_t released = s.vm.release();
  CHECK(released == before - 32 * MiB);  // all but the handle under `keep`
  CHECK(s.layer.physical_in_use() == 32 * MiB);
  CHECK(s.vm.vm_stats().mapped_bytes == s.layer.physical_in_use());
  CHECK(s.layer.is_accessible(addr(keep), MiB));
  s.vm.deallocate(keep, MiB);
  CHECK(s.vm.release() == 32 * MiB);
  CHECK(s.layer.physical_in_use() == 0);
  CHECK(s.layer.violations == 0);
  void* again = s.vm.allocate(MiB);  // and it still works
  CHECK(s.layer.is_accessible(addr(again), MiB));
  s.vm.deallocate(again, MiB);
}

TEST_CASE("vm_resource: destruction unmaps, releases and frees everything, even leaked ranges") {
  detail::simulated_vm_final_state final_state;
  cudamem_test::captured_errors errors;
  {
    sim_vm s{GiB, handles_of(32 * MiB), &final_state};
    void* leaked = s.vm.allocate(3 * MiB, 256, fake_stream(1));
    static_cast<void>(leaked);
    std::vector<void*> blocks;
    try {
      for (;;) {
        blocks.push_back(s.vm.allocate(96 * MiB));
      }
    } catch (const out_of_memory&) {
    }
    REQUIRE(blocks.size() >= 6);
    for (std::size_t i = 0; i < blocks.size(); i += 2) {
      s.vm.deallocate(blocks[i], 96 * MiB, 256, fake_stream(2));
    }
    void* big = s.vm.allocate(300 * MiB);  // compaction: stale aliases
    CHECK(s.vm.vm_stats().stale_aliases > 0);
    s.vm.deallocate(big, 300 * MiB, 256, fake_stream(3));  // in flight at destruction
    for (std::size_t i = 1; i < blocks.size(); i += 2) {
      s.vm.deallocate(blocks[i], 96 * MiB);
    }
    CHECK_FALSE(final_state.destroyed);
  }
  REQUIRE(final_state.destroyed);
  CHECK(final_state.physical_in_use == 0);
  CHECK(final_state.mappings == 0);
  CHECK(final_state.reservations == 0);
  CHECK(final_state.violations == 0);  // no unmap of in-flight memory: it waited first
  REQUIRE(errors.messages().size() == 1);
  CHECK_THAT(errors.messages()[0], Catch::Contains("still allocated"));
}

TEST_CASE("vm_resource: every handle is handle_bytes, at the end of the device and of the limit") {
  // A free run of k handles then holds the same blocks wherever it lies and however often it
  // was reused; a smaller handle in the middle of a run would change how many handles a block
  // spans (what made a second run of a trace strand more than the first). The price: the
  // device's last part-handle stays with the driver.
  sim_vm s{100 * MiB, handles_of(64 * MiB)};
  void* a = s.vm.allocate(64 * MiB);
  CHECK_THROWS_AS(s.vm.allocate(36 * MiB), out_of_memory);  // 36 MiB left: not a handle
  CHECK_THROWS_AS(s.vm.allocate(2 * MiB), out_of_memory);
  CHECK(s.layer.physical_in_use() == 64 * MiB);
  s.vm.deallocate(a, 64 * MiB);
  // A physical limit that is not a multiple of the handle is used in whole handles.
  vm_resource_options limited = handles_of(32 * MiB);
  limited.physical_limit = 100 * MiB;
  sim_vm l{GiB, limited};
  std::vector<void*> blocks;
  for (;;) {
    try {
      blocks.push_back(l.vm.allocate(6 * MiB));
    } catch (const out_of_memory&) {
      break;
    }
  }
  CHECK(blocks.size() == 16);  // 96 MiB: 16 blocks of 6 MiB
  const vm_resource_stats st = l.vm.vm_stats();
  CHECK(st.mapped_bytes == 96 * MiB);
  CHECK(st.mapped_bytes == st.handles * st.handle_bytes);
  for (void* p : blocks) {
    l.vm.deallocate(p, 6 * MiB);
  }
  CHECK(s.layer.violations == 0);
  CHECK(l.layer.violations == 0);
}

TEST_CASE("vm_resource: growth comes before recycling while the device has room") {
  // A created handle is paid for once; a recycled one is moved (~34 us of driver time) at
  // every shortfall. So while the device has room, what is missing is created; only once it
  // is full are free handles moved.
  sim_vm s{GiB, handles_of(32 * MiB)};
  const std::vector<void*> blocks = eight_with_holes(s.vm);
  const auto calls = s.layer.calls;
  void* grown = s.vm.allocate(128 * MiB);  // four lone holes: none holds it
  CHECK(s.layer.calls.create - calls.create == 4);
  CHECK(s.layer.calls.map - calls.map == 4);
  CHECK(s.vm.vm_stats().compactions == 0);
  CHECK(s.vm.vm_stats().stale_aliases == 0);
  // The holes are still where they were, and serve 32 MiB requests for nothing.
  void* hole = s.vm.allocate(32 * MiB);
  CHECK(hole == blocks[0]);
  s.vm.deallocate(hole, 32 * MiB);
  // Fill the rest of the device: now the next shortfall recycles, and only what it lacks.
  std::vector<void*> fill;
  for (int i = 0; i < 10; ++i) {
    fill.push_back(s.vm.allocate(64 * MiB));
  }
  CHECK(s.layer.physical_in_use() == GiB);
  CHECK(s.vm.vm_stats().compactions == 0);
  const auto full = s.layer.calls;
  void* moved = s.vm.allocate(64 * MiB);  // two of the four lone holes, side by side
  CHECK(s.vm.vm_stats().compactions == 1);
  CHECK(s.layer.calls.map - full.map == 2);
  CHECK(s.layer.calls.create - full.create == 1);  // one create, refused: the device is full
  CHECK(s.layer.is_accessible(addr(moved), 64 * MiB));
  s.vm.deallocate(moved, 64 * MiB);
  free_each(s.vm, fill, 64 * MiB);
  s.vm.deallocate(grown, 128 * MiB);
  free_survivors(s.vm, blocks);
  CHECK(s.vm.release() == GiB);
  CHECK(s.layer.violations == 0);
}

TEST_CASE("vm_resource: keep_free_bytes recycles before growing into the reserve") {
  // 1 GiB device, 256 MiB kept free. Growth goes up to the reserve; there a request that
  // finds no fit recycles free handles although the device has room, and grows into the
  // reserve only for what recycling cannot give: the reserve is for the rest of the process
  // (a library's cudaMalloc), not a limit.
  sim_vm s{GiB, keeping_free(256 * MiB, 128 * MiB)};
  const std::vector<void*> small = eight_with_holes(s.vm);
  std::vector<void*> fill;
  for (int i = 0; i < 8; ++i) {
    fill.push_back(s.vm.allocate(64 * MiB));
  }
  // Growths of 128 MiB stop where they would cut into the reserve: exactly 768 MiB mapped.
  CHECK(s.layer.physical_in_use() == 768 * MiB);
  CHECK(s.vm.vm_stats().compactions == 0);
  const auto calls = s.layer.calls;
  void* moved = s.vm.allocate(64 * MiB);  // no fit, and growth would cut into the reserve
  vm_resource_stats st = s.vm.vm_stats();
  CHECK(st.compactions == 1);
  CHECK(st.kept_free_compactions == 1);
  CHECK(s.layer.calls.create == calls.create);  // not even a probe: recycling gave it all
  CHECK(s.layer.physical_in_use() == 768 * MiB);
  CHECK(s.layer.is_accessible(addr(moved), 64 * MiB));
  // 128 MiB: two holes are left (64 MiB), so 64 MiB more is created, into the reserve, and
  // no more (a growth does not round up into it).
  void* both = s.vm.allocate(128 * MiB);
  st = s.vm.vm_stats();
  CHECK(st.compactions == 2);
  CHECK(s.layer.physical_in_use() == 832 * MiB);
  CHECK(s.layer.is_accessible(addr(both), 128 * MiB));
  // Past the reserve it is the device's last bytes as without the option: a fill takes them.
  std::vector<void*> rest;
  while (s.layer.physical_in_use() < GiB) {
    rest.push_back(s.vm.allocate(64 * MiB));
  }
  CHECK(rest.size() == 3);
  CHECK_THROWS_AS(s.vm.allocate(64 * MiB), out_of_memory);
  free_each(s.vm, rest, 64 * MiB);
  s.vm.deallocate(both, 128 * MiB);
  s.vm.deallocate(moved, 64 * MiB);
  free_each(s.vm, fill, 64 * MiB);
  free_survivors(s.vm, small);
  CHECK(s.vm.release() == GiB);
  CHECK(s.layer.violations == 0);
}

TEST_CASE("vm_resource: no_growth_into_reserve_scope: recycling only, below keep_free") {
  // What a vm_pool's bulk blocks ask under (vm_pool_resource.hpp): a request that recycling
  // cannot serve fails, changing nothing, instead of growing into the reserve.
  sim_vm s{GiB, keeping_free(256 * MiB, 128 * MiB)};
  std::vector<void*> fill;
  for (int i = 0; i < 12; ++i) {  // 768 MiB: growth up to the reserve
    fill.push_back(s.vm.allocate(64 * MiB));
  }
  s.vm.deallocate(fill.back(), 64 * MiB);  // 64 MiB to recycle
  fill.pop_back();
  const auto calls = s.layer.calls;
  {
    const detail::no_growth_into_reserve_scope above_reserve;
    try {
      static_cast<void>(s.vm.allocate(128 * MiB));
      FAIL("expected out_of_memory");
    } catch (const out_of_memory& e) {
      CHECK_THAT(e.report().cause, Catch::Contains("growth above keep_free tried"));
    }
    CHECK(s.layer.calls.create == calls.create);
    CHECK(s.layer.physical_in_use() == 768 * MiB);
    void* recycled = s.vm.allocate(64 * MiB);  // what recycling alone serves still works
    fill.push_back(recycled);
  }
  void* grown = s.vm.allocate(64 * MiB);  // outside the scope: into the reserve, as before
  CHECK(s.layer.physical_in_use() == 832 * MiB);
  s.vm.deallocate(grown, 64 * MiB);
  free_each(s.vm, fill, 64 * MiB);
  // Without keep_free_bytes the scope changes nothing: growth while the device has room.
  sim_vm plain{GiB, keeping_free(0, 128 * MiB)};
  {
    const detail::no_growth_into_reserve_scope above_reserve;
    void* p = plain.vm.allocate(512 * MiB);
    CHECK(plain.layer.physical_in_use() >= 512 * MiB);
    plain.vm.deallocate(p, 512 * MiB);
  }
  CHECK(s.layer.violations == 0);
  CHECK(plain.layer.violations == 0);
}

TEST_CASE("vm_resource: keep_free_bytes larger than the device: always recycle first") {
  // Not an error: the smallest footprint, every growth only what recycling cannot give.
  sim_vm s{GiB, keeping_free(2 * GiB, 256 * MiB)};
  void* a = s.vm.allocate(32 * MiB);
  CHECK(s.layer.physical_in_use() == 32 * MiB);  // no 256 MiB growth
  void* b = s.vm.allocate(64 * MiB);
  CHECK(s.layer.physical_in_use() == 96 * MiB);
  s.vm.deallocate(a, 32 * MiB);
  void* c = s.vm.allocate(64 * MiB);  // the freed 32 MiB recycled, 32 MiB created
  CHECK(s.layer.physical_in_use() == 128 * MiB);
  CHECK(s.vm.vm_stats().kept_free_compactions == 1);
  s.vm.deallocate(b, 64 * MiB);
  s.vm.deallocate(c, 64 * MiB);
  CHECK(s.vm.release() == 128 * MiB);
  CHECK(s.layer.violations == 0);
}

TEST_CASE("vm_resource: out_of_memory carries a report; nothing changes on failure") {
  sim_vm s{256 * MiB, handles_of(32 * MiB)};
  void* a = s.vm.allocate(200 * MiB);
  const auto maps = s.layer.calls.map;
  try {
    static_cast<void>(s.vm.allocate(100 * MiB));
    FAIL("expected out_of_memory");
  } catch (const out_of_memory& e) {
    CHECK(e.requested_bytes() == 100 * MiB);
    CHECK(e.report().chain.front().name == "vm_resource");
    CHECK(e.verdict() == oom_verdict::exhausted);
    CHECK_THAT(std::string(e.what()), Catch::Contains("recycling and growth both tried"));
  }
  CHECK(s.layer.calls.map == maps);
  CHECK(s.vm.stats().used_bytes == 224 * MiB);
  CHECK(s.layer.physical_in_use() <= 256 * MiB);
  CHECK(s.layer.violations == 0);
  // Larger than the device: refused before anything is tried.
  const auto creates = s.layer.calls.create;
  CHECK_THROWS_AS(s.vm.allocate(std::numeric_limits<std::size_t>::max()), out_of_memory);
  CHECK_THROWS_AS(s.vm.allocate(GiB), out_of_memory);
  CHECK(s.layer.calls.create == creates);
  s.vm.deallocate(a, 200 * MiB);
}

TEST_CASE("vm_resource: physical_limit is a budget") {
  vm_resource_options o = handles_of(32 * MiB);
  o.physical_limit = 64 * MiB;
  sim_vm s{GiB, o};
  void* a = s.vm.allocate(60 * MiB);
  try {
    static_cast<void>(s.vm.allocate(10 * MiB));
    FAIL("expected out_of_memory");
  } catch (const out_of_memory& e) {
    CHECK(e.verdict() == oom_verdict::budget);
    CHECK_THAT(std::string(e.what()), Catch::Contains("physical limit"));
  }
  CHECK(s.layer.physical_in_use() <= 64 * MiB);
  CHECK(s.vm.stats().budget == 64 * MiB);
  s.vm.deallocate(a, 60 * MiB);
}

TEST_CASE("vm_resource: bad input") {
  sim_vm s{GiB};
  CHECK(s.vm.allocate(0) == nullptr);
  s.vm.deallocate(nullptr, 10);
  CHECK_THROWS_AS(s.vm.allocate(10, 3), std::invalid_argument);
  CHECK_THROWS_AS(vm_resource(std::unique_ptr<detail::vm_mapping_layer>{}), std::invalid_argument);
  CHECK_THROWS_AS(vm_resource(std::make_unique<simulated_vm_mapping>(), handles_of(0)),
                  std::invalid_argument);
  vm_resource_options below_a_handle = handles_of(32 * MiB);
  below_a_handle.physical_limit = 31 * MiB;  // could never map anything
  CHECK_THROWS_AS(vm_resource(std::make_unique<simulated_vm_mapping>(), below_a_handle),
                  std::invalid_argument);
  CHECK(s.vm.handle_bytes() == 32 * MiB);
  // Large alignment is honoured, for small and whole-handle blocks.
  void* aligned = s.vm.allocate(100, 64 * MiB);
  CHECK(addr(aligned) % (64 * MiB) == 0);
  CHECK(s.layer.is_accessible(addr(aligned), 100));
  void* big_aligned = s.vm.allocate(40 * MiB, 128 * MiB);
  CHECK(addr(big_aligned) % (128 * MiB) == 0);
  CHECK(s.layer.is_accessible(addr(big_aligned), 40 * MiB));
  cudamem_test::captured_errors errors;
  int not_ours = 0;
  s.vm.deallocate(&not_ours, sizeof not_ours);
  void* p = s.vm.allocate(1000);
  s.vm.deallocate(p, 1000);
  s.vm.deallocate(p, 1000);  // double free
  void* q = s.vm.allocate(1000);
  s.vm.deallocate(q, 5 * MiB);  // size mismatch: reported, still freed
  REQUIRE(errors.messages().size() == 3);
  CHECK_THAT(errors.messages()[0], Catch::Contains("did not allocate"));
  CHECK_THAT(errors.messages()[1], Catch::Contains("already freed"));
  CHECK_THAT(errors.messages()[2], Catch::Contains(std::to_string(5 * MiB) + " bytes"));
  s.vm.deallocate(aligned, 100, 64 * MiB);
  s.vm.deallocate(big_aligned, 40 * MiB, 128 * MiB);
  CHECK(s.vm.stats().used_bytes == 0);
  CHECK(s.layer.violations == 0);
}

TEST_CASE("vm_resource: a marked block is freed only by its mark; everything else is left alone") {
  sim_vm s{GiB};
  const stream_view on{fake_stream(1)};
  void* chunk = s.vm.allocate(64 * MiB, 256, on);  // unmarked, as a pool's chunk is
  void* marked = s.vm.allocate_marked(100 * MiB, 256, &on, 1);
  void* marked_sync = s.vm.allocate_marked(40 * MiB, 256, nullptr, 1);
  REQUIRE(marked != nullptr);
  CHECK(s.layer.is_accessible(addr(marked), 100 * MiB));
  const std::size_t used = s.vm.stats().used_bytes;
  {
    cudamem_test::captured_errors errors;
    int not_ours = 0;
    // Nothing freed and nothing reported: the owner decides what a miss means.
    CHECK_FALSE(s.vm.deallocate_marked(chunk, 64 * MiB, &on, 1).has_value());  // mark 0
    CHECK_FALSE(s.vm.deallocate_marked(marked, 100 * MiB, &on, 2).has_value());  // another mark
    CHECK_FALSE(s.vm.deallocate_marked(static_cast<char*>(marked) + MiB, MiB, &on, 1));
    CHECK_FALSE(s.vm.deallocate_marked(&not_ours, 100 * MiB, &on, 1).has_value());
    CHECK_FALSE(s.vm.deallocate_marked(nullptr, 100 * MiB, &on, 1).has_value());
    CHECK(errors.messages().empty());
    CHECK(s.vm.stats().used_bytes == used);
  }
  const std::size_t frees_before = s.layer.calls.record_free;
  CHECK(s.vm.deallocate_marked(marked, 100 * MiB, &on, 1) == 100 * MiB);
  CHECK(s.layer.calls.record_free == frees_before + 1);  // in stream order, as deallocate
  CHECK_FALSE(s.vm.deallocate_marked(marked, 100 * MiB, &on, 1).has_value());  // already freed
  {
    cudamem_test::captured_errors errors;  // a size mismatch: reported, freed as allocated
    CHECK(s.vm.deallocate_marked(marked_sync, 30 * MiB, nullptr, 1) == 40 * MiB);
    CHECK(errors.messages().size() == 1);
  }
  CHECK(s.layer.calls.record_free == frees_before + 1);  // the synchronous form records none
  s.vm.deallocate(chunk, 64 * MiB, 256, on);
  CHECK(s.vm.stats().used_bytes == 0);
  // Bad input, as allocate's: nothing for 0 bytes, std::invalid_argument for an alignment.
  CHECK(s.vm.allocate_marked(0, 256, &on, 1) == nullptr);
  CHECK_THROWS_AS(s.vm.allocate_marked(MiB, 3, &on, 1), std::invalid_argument);
  CHECK(s.vm.stats().used_bytes == 0);
  CHECK(s.layer.violations == 0);
}

TEST_CASE("vm_resource: a device that says full leaks nothing, and memory coming back is found") {
  sim_vm s{GiB, handles_of(32 * MiB)};
  s.layer.fail_next_creates(100);
  CHECK_THROWS_AS(s.vm.allocate(MiB), out_of_memory);
  CHECK(s.layer.physical_in_use() == 0);
  s.layer.fail_next_creates(0);
  void* q = s.vm.allocate(MiB);
  CHECK(s.layer.is_accessible(addr(q), MiB));
  s.vm.deallocate(q, MiB);
  // One refusal on a fresh resource: no smaller handles (see "every handle is handle_bytes");
  // the next request probes the device once, for just what it needs.
  sim_vm fresh{GiB, handles_of(32 * MiB, 256 * MiB)};
  fresh.layer.fail_next_creates(1);
  CHECK_THROWS_AS(fresh.vm.allocate(MiB), out_of_memory);
  CHECK(fresh.layer.calls.create == 1);
  void* p = fresh.vm.allocate(MiB);
  CHECK(fresh.layer.calls.create == 2);
  CHECK(fresh.layer.physical_in_use() == 32 * MiB);  // one handle, not a growth of 256 MiB
  CHECK(fresh.vm.vm_stats().handles == 1);
  fresh.vm.deallocate(p, MiB);
  CHECK(s.layer.violations == 0);
  CHECK(fresh.layer.violations == 0);
}

/// Six rounds of: 8 x 32 MiB, free every other one, 128 MiB (a compaction each round).
static void compact_six_times(sim_vm& s) {
  for (int round = 0; round < 6; ++round) {
    std::vector<void*> blocks;
    for (int i = 0; i < 8; ++i) {
      blocks.push_back(s.vm.allocate(32 * MiB));
    }
    for (int i = 0; i < 8; i += 2) {
      s.vm.deallocate(blocks[static_cast<std::size_t>(i)], 32 * MiB);
    }
    void* big = s.vm.allocate(128 * MiB);
    REQUIRE(s.layer.is_accessible(addr(big), 128 * MiB));
    s.vm.deallocate(big, 128 * MiB);
    for (int i = 1; i < 8; i += 2) {
      s.vm.deallocate(blocks[static_cast<std::size_t>(i)], 32 * MiB);
    }
  }
}

TEST_CASE("vm_resource: running out of address space reserves more, never unmaps, up to a limit") {
  vm_resource_options o = handles_of(32 * MiB);
  o.reserve_bytes = 512 * MiB;  // small, so compactions use it up
  sim_vm s{256 * MiB, o};
  compact_six_times(s);
  const vm_resource_stats st = s.vm.vm_stats();
  CHECK(st.compactions == 6);
  CHECK(st.unmaps == 0);                  // no cuMemUnmap on the allocation path
  CHECK(s.layer.calls.unmap == 0);
  CHECK(st.stale_aliases > 0);
  CHECK(st.reserved_virtual_bytes > 512 * MiB);  // more address space instead
  CHECK(st.reserved_virtual_bytes <= 8 * 512 * MiB);
  s.vm.release();  // the aliases go now
  CHECK(s.vm.vm_stats().stale_aliases == 0);
  CHECK(s.layer.violations == 0);
}

TEST_CASE("vm_resource: reservations_before_sweep 0 is refused") {
  vm_resource_options o;
  o.reservations_before_sweep = 0;
  CHECK_THROWS_AS(vm_resource(std::make_unique<simulated_vm_mapping>(), o), std::invalid_argument);
}

TEST_CASE("vm_resource: running out of address space sweeps stale aliases past the limit") {
  vm_resource_options o = handles_of(32 * MiB);
  o.reserve_bytes = 512 * MiB;  // small, so compactions use it up
  o.reservations_before_sweep = 1;
  sim_vm s{256 * MiB, o};
  compact_six_times(s);
  const vm_resource_stats st = s.vm.vm_stats();
  CHECK(st.unmaps > 0);                               // aliases were swept
  CHECK(st.reserved_virtual_bytes <= 3 * 512 * MiB);  // and address space did not pile up
  CHECK(s.layer.physical_in_use() <= 256 * MiB);
  CHECK(s.layer.violations == 0);
}

TEST_CASE("vm_resource: randomised against a model") {
  for (std::uint32_t seed : {1u, 2u, 3u, 4u, 5u}) {
    CAPTURE(seed);
    const std::size_t capacity = 512 * MiB;
    // Seeds 1-4: handles of a power of two (placement is arithmetic); 5: 6 MiB handles, not
    // aligned to their size (placement looks the handles up).
    const std::size_t handle = seed == 5 ? 6 * MiB : std::size_t{4} << (20 + seed % 3);
    sim_vm s{capacity, handles_of(handle, 64 * MiB)};
    std::mt19937_64 rng{seed};
    std::map<std::uintptr_t, std::size_t> live;  // the model: address -> bytes
    std::size_t live_bytes = 0;
    for (int op = 0; op < 3000; ++op) {
      const bool alloc = live.empty() || rng() % 100 < 55;
      if (alloc) {
        const int exponent = static_cast<int>(rng() % 27);  // 1 B .. 64 MiB, log-uniform-ish
        const std::size_t bytes = (std::size_t{1} << exponent) + rng() % 1000;
        const std::size_t alignment = std::size_t{256} << (rng() % 4);
        const cudaStream_t stream = fake_stream(rng() % 4);  // 0: the legacy stream
        void* p = nullptr;
        try {
          p = s.vm.allocate(bytes, alignment, stream);
        } catch (const out_of_memory&) {
          // Failing is allowed only when the memory is really not there: everything a model
          // of 2 MiB granules plus at most one handle per live range would need.
          CHECK(live_bytes + bytes + (live.size() + 2) * s.vm.vm_stats().handle_bytes >
                capacity);
          continue;
        }
        const std::uintptr_t a = addr(p);
        CHECK(a % alignment == 0);
        const auto next = live.lower_bound(a);
        if (next != live.end()) {
          REQUIRE(a + bytes <= next->first);
        }
        if (next != live.begin()) {
          REQUIRE(std::prev(next)->first + std::prev(next)->second <= a);
        }
        REQUIRE(s.layer.is_accessible(a, bytes));
        live.emplace(a, bytes);
        live_bytes += bytes;
      } else {
        auto it = live.begin();
        std::advance(it, static_cast<long>(rng() % live.size()));
        if (rng() % 4 == 0) {
          s.vm.deallocate(reinterpret_cast<void*>(it->first), it->second);
        } else {
          s.vm.deallocate(reinterpret_cast<void*>(it->first), it->second, 256,
                          fake_stream(rng() % 4));
        }
        live_bytes -= it->second;
        live.erase(it);
      }
      REQUIRE(s.layer.physical_in_use() <= capacity);
      if (op % 300 == 0) {
        const vm_resource_stats st = s.vm.vm_stats();
        CHECK(st.mapped_bytes == s.layer.physical_in_use());
        CHECK(st.free_bytes == st.recyclable_bytes + st.stranded_bytes);
        CHECK(st.requested_bytes == live_bytes);
        for (const auto& [a, b] : live) {
          REQUIRE(s.layer.is_accessible(a, b));
        }
      }
      if (op == 1500) {
        s.vm.release();  // mid-run: live ranges must stay mapped
      }
    }
    for (const auto& [a, b] : live) {
      REQUIRE(s.layer.is_accessible(a, b));
      s.vm.deallocate(reinterpret_cast<void*>(a), b, 256, fake_stream(1));
    }
    CHECK(s.vm.stats().used_bytes == 0);
    CHECK(s.layer.violations == 0);
    CHECK(s.layer.unmaps_in_flight == 0);
  }
}

TEST_CASE("handle_set: placement by arithmetic agrees with looking the handles up") {
  // While every handle has the resource's size and sits at a multiple of it, place_whole
  // rounds instead of walking the map. Both answers, for random tilings and free ranges.
  const std::size_t handle = 4 * MiB;
  std::mt19937_64 rng(23);
  for (int round = 0; round < 50; ++round) {
    detail::handle_set arithmetic{handle};
    detail::handle_set lookup;  // no handle size known: always looks up
    std::vector<std::pair<std::uintptr_t, std::uintptr_t>> runs;  // mapped [begin, end)
    std::uintptr_t at = (std::uintptr_t{1} << 40) + handle * (rng() % 8);
    for (int r = 0; r < 6; ++r) {
      const std::uintptr_t begin = at;
      for (std::size_t h = 0, n = 1 + rng() % 5; h < n; ++h, at += handle) {
        arithmetic.add(at, {detail::vm_handle{at}, handle});
        lookup.add(at, {detail::vm_handle{at}, handle});
      }
      runs.emplace_back(begin, at);
      at += handle * (1 + rng() % 3);  // a gap: unmapped
    }
    REQUIRE(arithmetic.all_aligned());
    REQUIRE_FALSE(lookup.all_aligned());
    for (int q = 0; q < 200; ++q) {
      const auto [b0, b1] = runs[rng() % runs.size()];
      const std::uintptr_t granule = 2 * MiB;
      const std::uintptr_t begin = b0 + granule * (rng() % ((b1 - b0) / granule));
      const std::uintptr_t end = begin + granule * (1 + rng() % ((b1 - begin) / granule));
      const std::size_t size = granule * (2 + rng() % 10);
      CAPTURE(round, q, begin - b0, end - begin, size);
      const auto a = arithmetic.place_whole(begin, end, size);
      const auto l = lookup.place_whole(begin, end, size);
      REQUIRE(a.has_value() == l.has_value());
      if (a) {
        CHECK(a->start == l->start);
        CHECK(a->end == l->end);
        CHECK(a->start % handle == 0);
      }
    }
  }
  // One handle of another size, or off a multiple of its size, and placement looks up again
  // until it is gone; handles adopted from a batch count too.
  detail::handle_set set{handle};
  const std::uintptr_t base = std::uintptr_t{1} << 40;
  set.add(base, {detail::vm_handle{1}, handle});
  CHECK(set.all_aligned());
  set.add(base + handle + 2 * MiB, {detail::vm_handle{2}, handle});
  CHECK_FALSE(set.all_aligned());
  set.erase(base + handle + 2 * MiB);
  CHECK(set.all_aligned());
  detail::handle_set::map_type made;
  made.emplace(base + 4 * handle, detail::mapped_handle{detail::vm_handle{3}, 2 * MiB});
  set.adopt(made);
  CHECK_FALSE(set.all_aligned());
  set.erase(base + 4 * handle);
  CHECK(set.all_aligned());
  set.erase(base + 9 * handle);  // not mapped: nothing changes
  CHECK(set.all_aligned());
  CHECK(set.count() == 1);
}

TEST_CASE("free_range_index: adjacent pairs stay exact; best_run without them is best fit's") {
  // vm_resource asks best_run before every compaction. It used to walk the whole index; with
  // no free ranges touching (the usual case) it now finds the answer by size. This checks the
  // count against a walk after every kind of change, and best_run against the walk it replaced.
  using detail::free_range_index;
  const std::uintptr_t unit = 2 * MiB;
  const std::uintptr_t base = std::uintptr_t{1} << 40;
  const auto stream_of = [](int k) { return reinterpret_cast<cudaStream_t>(std::uintptr_t(k) * 16); };
  std::mt19937_64 rng(19);
  const auto pick = [&](std::uint64_t n) { return static_cast<std::uintptr_t>(rng() % n); };
  free_range_index free;
  detail::handle_set handles;  // empty: requests here are not whole-handle ones
  const auto walk_pairs = [&] {
    std::size_t n = 0;
    for (auto it = free.begin(); it != free.end(); ++it) {
      const auto next = std::next(it);
      n += next != free.end() && it->first + it->second.bytes == next->first ? 1 : 0;
    }
    return n;
  };
  const auto walk_best_run = [&](const detail::vm_request& r) {
    std::optional<detail::vm_placement> best;
    free.for_each_run([&](std::uintptr_t b, std::uintptr_t e) {
      if (e - b >= r.needed && (!best || e - b < best->end - best->start) &&
          detail::place(handles, b, e, r)) {
        best = detail::vm_placement{b, e};
      }
    });
    return best;
  };
  const auto overlaps_free = [&](std::uintptr_t b, std::uintptr_t e) {
    for (auto it = free.begin(); it != free.end(); ++it) {
      if (it->first < e && b < it->first + it->second.bytes) {
        return true;
      }
    }
    return false;
  };
  std::size_t with_pairs = 0;
  std::size_t without_pairs = 0;
  for (int step = 0; step < 20000; ++step) {
    const int op = static_cast<int>(pick(10));
    if (op < 5) {  // a free: merges with mergeable neighbours
      const std::uintptr_t b = base + pick(256) * unit;
      const std::uintptr_t e = b + (1 + pick(8)) * unit;
      if (!overlaps_free(b, e)) {
        free.insert(b, {e - b, stream_of(1 + static_cast<int>(pick(3))), pick(4) == 0});
      }
    } else if (op < 7 && free.count() != 0) {  // an allocation carves a part of one range
      auto it = free.begin();
      std::advance(it, static_cast<long>(pick(free.count())));
      const std::uintptr_t units = it->second.bytes / unit;
      const std::uintptr_t from = pick(units);
      const std::uintptr_t to = from + 1 + pick(units - from);
      free.carve(it, it->first + from * unit, it->first + to * unit);
    } else if (op < 9) {  // a handle moves away: cut out of whatever it overlaps
      std::vector<cudaStream_t> pending;
      free.cut(base + pick(256) * unit, (1 + pick(4)) * unit, pending);
    } else if (pick(8) == 0) {
      free.mark_all_complete();
    } else {
      free.mark_complete(stream_of(1 + static_cast<int>(pick(3))));
    }
    REQUIRE(free.adjacent_pairs() == walk_pairs());
    (free.adjacent_pairs() == 0 ? without_pairs : with_pairs) += 1;
    const std::size_t size = (1 + pick(12)) * unit;
    const std::size_t alignment = pick(3) == 0 ? 4 * unit : unit;
    const detail::vm_request r{size, alignment <= unit ? size : size + alignment - unit,
                               alignment, false, unit};
    const auto expected = walk_best_run(r);
    const auto got = detail::best_run(free, handles, r);
    REQUIRE(got.has_value() == expected.has_value());
    if (got) {
      CHECK(got->start == expected->start);
      CHECK(got->end == expected->end);
    }
  }
  CHECK(with_pairs > 500);  // both cases were met often
  CHECK(without_pairs > 500);
}

TEST_CASE("vm_resource: with no device, the real one throws no_device_error") {
  if (has_device()) {
    SUCCEED("a device is present: the GPU tests cover the real resource");
    return;
  }
  CHECK_THROWS_AS(vm_resource{0}, no_device_error);
  CHECK_THROWS_AS(vm_resource{}, no_device_error);
}

TEST_CASE("vm_resource: a map that fails half-way through a batch leaks nothing") {
  detail::simulated_vm_final_state final_state;
  {
    sim_vm s{512 * MiB, handles_of(32 * MiB), &final_state};
    // During growth: the fresh handles go back.
    s.layer.fail_map_after(3);
    CHECK_THROWS_AS(s.vm.allocate(200 * MiB), std::runtime_error);
    CHECK(s.layer.physical_in_use() == 0);
    CHECK(s.layer.mapping_count() == 0);
    CHECK(s.vm.vm_stats().mapped_bytes == 0);
    // During a compaction: the recycled handles stay where they were, free and usable.
    std::vector<void*> blocks;
    for (int i = 0; i < 16; ++i) {
      blocks.push_back(s.vm.allocate(32 * MiB));
    }
    for (int i = 0; i < 16; i += 2) {
      s.vm.deallocate(blocks[static_cast<std::size_t>(i)], 32 * MiB);
    }
    const vm_resource_stats before = s.vm.vm_stats();
    s.layer.fail_map_after(5);
    CHECK_THROWS_AS(s.vm.allocate(256 * MiB), std::runtime_error);
    const vm_resource_stats after = s.vm.vm_stats();
    CHECK(after.mapped_bytes == before.mapped_bytes);
    CHECK(after.recyclable_bytes == before.recyclable_bytes);
    CHECK(after.stale_aliases == before.stale_aliases);
    CHECK(after.handles == before.handles);
    for (std::size_t i = 1; i < blocks.size(); i += 2) {
      REQUIRE(s.layer.is_accessible(addr(blocks[i]), 32 * MiB));
    }
    void* big = s.vm.allocate(256 * MiB);  // and the same request works next time
    CHECK(s.layer.is_accessible(addr(big), 256 * MiB));
    s.vm.deallocate(big, 256 * MiB);
    for (std::size_t i = 1; i < blocks.size(); i += 2) {
      s.vm.deallocate(blocks[i], 32 * MiB);
    }
    CHECK(s.layer.violations == 0);
  }
  CHECK(final_state.physical_in_use == 0);
  CHECK(final_state.mappings == 0);
  CHECK(final_state.reservations == 0);
  CHECK(final_state.violations == 0);
}
