// cudamem/nccl.hpp against the real NCCL: one communicator per visible GPU from ncclCommInitAll
// (one rank on a one-GPU machine), made once for the whole run. Registrations go through a
// table that counts and forwards to NCCL, so each test can say that every ncclCommRegister was
// matched by an ncclCommDeregister, and a checking resource under each registering adaptor
// looks at every free: no memory goes back to NCCL's allocator or to a vm_resource while it is
// registered. All-reduces run on blocks of pools whose chunks are registered, and their
// results are checked element by element. NCCL_NVLS_ENABLE=0 is set (if unset) before the
// communicators are made: NVLink multicast stays off.
// Catch2's listener base (destroy_communicators, below) is declared only with this.
#define CATCH_CONFIG_EXTERNAL_INTERFACES

#include <cudamem/device_buffer.hpp>
#include <cudamem/device_resource.hpp>
#include <cudamem/failing_adaptor.hpp>
#include <cudamem/nccl.hpp>
#include <cudamem/nccl_pool.hpp>
#include <cudamem/pool_resource.hpp>
#include <cudamem/stream.hpp>
#include <cudamem/vm_pool_resource.hpp>

#include "gpu_test.hpp"

#include <catch2/catch.hpp>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

using namespace cudamem;

namespace {

constexpr std::size_t MiB = std::size_t{1} << 20;

// --- the communicators, made once ---------------------------------------------------------------

std::optional<std::vector<nccl_communicator>>& shared_slot() {
  static std::optional<std::vector<nccl_communicator>> comms;
  return comms;
}

/// One communicator per visible GPU, rank d on device d.
std::vector<nccl_communicator>& communicators() {
  auto& slot = shared_slot();
  if (!slot) {
    ::setenv("NCCL_NVLS_ENABLE", "0", 0);  // before NCCL reads its settings: no multicast
    slot.emplace(nccl_communicator::init_all());
  }
  return *slot;
}

/// Destroys the communicators when the run ends, while CUDA and NCCL are still whole.
struct destroy_communicators : Catch::TestEventListenerBase {
  using TestEventListenerBase::TestEventListenerBase;
  void testRunEnded(const Catch::TestRunStats&) override { shared_slot().reset(); }
};

}  // namespace

CATCH_REGISTER_LISTENER(destroy_communicators)

namespace {

// --- NCCL's registration calls, counted -------------------------------------------------------

struct registration_counts {
  struct range {
    std::uintptr_t address;
    std::size_t bytes;
  };
  std::multimap<void*, range> live;  ///< handle -> range (NCCL may share a handle)
  int registers = 0;
  int deregisters = 0;
  int register_calls = 0;
  int fail_register_call = 0;  ///< this register call (1-based) fails without calling NCCL

  [[nodiscard]] bool overlaps_live(const void* p, std::size_t bytes) const {
    const auto begin = reinterpret_cast<std::uintptr_t>(p);
    return std::any_of(live.begin(), live.end(), [&](const auto& entry) {
      const range& r = entry.second;
      return r.address < begin + bytes && begin < r.address + r.bytes;
    });
  }
};

registration_counts counts;

ncclResult_t counting_register(ncclComm_t comm, void* p, std::size_t bytes, void** handle) {
  ++counts.register_calls;
  if (counts.register_calls == counts.fail_register_call) {
    return ncclInvalidArgument;  // injected: NCCL is not called
  }
  const ncclResult_t code = ncclCommRegister(comm, p, bytes, handle);
  if (code == ncclSuccess) {
    ++counts.registers;
    counts.live.emplace(*handle,
                        registration_counts::range{reinterpret_cast<std::uintptr_t>(p), bytes});
  }
  return code;
}
ncclResult_t counting_deregister(ncclComm_t comm, void* handle) {
  const ncclResult_t code = ncclCommDeregister(comm, handle);
  if (code == ncclSuccess) {
    ++counts.deregisters;
    const auto it = counts.live.find(handle);
    if (it != counts.live.end()) {
      counts.live.erase(it);
    }
  }
  return code;
}

const detail::nccl_calls counting_calls{&counting_register, &counting_deregister,
                                        &ncclCommCuDevice, &ncclGetErrorString,
                                        &ncclGetLastError};

struct counts_scope {
  counts_scope() { counts = registration_counts{}; }
  ~counts_scope() { counts = registration_counts{}; }
};

/// Passes everything to its upstream; counts the frees of memory still registered.
class registration_checker final : public memory_resource {
 public:
  explicit registration_checker(memory_resource& upstream)
      : memory_resource(upstream.kind(), upstream.device()), upstream_(&upstream) {}
  int frees = 0;
  int frees_still_registered = 0;

 private:
  void* do_allocate(std::size_t bytes, std::size_t alignment, stream_view s) override {
    return upstream_->allocate(bytes, alignment, s);
  }
  void* do_allocate_sync(std::size_t bytes, std::size_t alignment) override {
    return upstream_->allocate(bytes, alignment);
  }
  void do_deallocate(void* p, std::size_t bytes, std::size_t alignment,
                     stream_view s) noexcept override {
    look(p, bytes);
    upstream_->deallocate(p, bytes, alignment, s);
  }
  void do_deallocate_sync(void* p, std::size_t bytes, std::size_t alignment) noexcept override {
    look(p, bytes);
    upstream_->deallocate(p, bytes, alignment);
  }
  void look(const void* p, std::size_t bytes) noexcept {
    ++frees;
    frees_still_registered += counts.overlaps_live(p, bytes) ? 1 : 0;
  }
  memory_resource* do_upstream() const noexcept override { return upstream_; }
  resource_stats do_stats() const override { return upstream_->stats(); }

  memory_resource* upstream_;
};

/// One device's stack: NCCL's allocator, the checker, the registering adaptor, a pool.
struct registered_pool {
  registered_pool(int device, ncclComm_t comm)
      : memory(device), faults(memory), checker(faults), registered(checker, comm, counting_calls),
        pool(registered) {}
  nccl_mem_resource memory;
  failing_adaptor faults;
  registration_checker checker;
  nccl_registering_adaptor registered;
  pool_resource pool;
};

/// Fills rank r's buffers with r + 1, all-reduces (sum) every rank's buffer k from `send` into
/// `recv` (in place when they are the same), and returns the elements that are not
/// n (n + 1) / 2 afterwards.
std::size_t all_reduce_and_count_wrong(std::vector<float*>& send, std::vector<float*>& recv,
                                       std::size_t count, std::vector<stream>& streams) {
  auto& comms = communicators();
  const std::size_t n = comms.size();
  for (std::size_t r = 0; r < n; ++r) {
    const device_guard on{static_cast<int>(r)};
    const float value = static_cast<float>(r + 1);
    detail::fill_bytes(send[r], count, &value, sizeof value, streams[r]);
  }
  check_nccl(ncclGroupStart(), "ncclGroupStart");
  for (std::size_t r = 0; r < n; ++r) {
    check_nccl(ncclAllReduce(send[r], recv[r], count, ncclFloat, ncclSum, comms[r].get(),
                             streams[r].get()),
               "ncclAllReduce");
  }
  check_nccl(ncclGroupEnd(), "ncclGroupEnd");
  const auto expected = static_cast<float>(n * (n + 1) / 2);
  std::size_t wrong = 0;
  std::vector<float> host(count);
  for (std::size_t r = 0; r < n; ++r) {
    const device_guard on{static_cast<int>(r)};
    check(cudaMemcpyAsync(host.data(), recv[r], count * sizeof(float), cudaMemcpyDeviceToHost,
                          streams[r].get()));
    streams[r].synchronize();
    wrong += static_cast<std::size_t>(
        std::count_if(host.begin(), host.end(), [&](float x) { return x != expected; }));
  }
  return wrong;
}

std::vector<stream> one_stream_per_device() {
  std::vector<stream> streams;
  for (std::size_t d = 0; d < communicators().size(); ++d) {
    streams.emplace_back(stream_options{.device = static_cast<int>(d), .non_blocking = true});
  }
  return streams;
}

}  // namespace

TEST_CASE("nccl_communicator: one per GPU, ranks in order; bad input before NCCL") {
  auto& comms = communicators();
  int version = 0;
  check_nccl(ncclGetVersion(&version), "ncclGetVersion");
  CHECK(version == NCCL_VERSION_CODE);  // the library loaded is the one nccl.h describes
  const int n = device_count();
  REQUIRE(comms.size() == static_cast<std::size_t>(n));
  for (int d = 0; d < n; ++d) {
    CHECK(comms[d].device() == d);
    CHECK(comms[d].rank() == d);
    CHECK(comms[d].size() == n);
  }
  CHECK(current_device() == 0);  // init_all left the caller's device as it was
  const int missing[] = {0, n};
  CHECK_THROWS_AS(nccl_communicator::init_all(missing), std::out_of_range);
  const int twice[] = {0, 0};
  CHECK_THROWS_WITH(nccl_communicator::init_all(twice), Catch::Contains("listed twice"));
  const nccl_communicator empty;
  CHECK_FALSE(static_cast<bool>(empty));
  CHECK_THROWS_AS(empty.device(), std::invalid_argument);
}

TEST_CASE("nccl_registration: ncclMemAlloc'd and cudaMalloc'd memory, paired, device kept") {
  const counts_scope scope;
  ncclComm_t comm = communicators()[0].get();
  nccl_mem_resource nccl_memory{0};
  void* from_nccl = nccl_memory.allocate(4 * MiB);
  void* from_cuda = nullptr;
  check(cudaMalloc(&from_cuda, 4 * MiB));
  const int last = device_count() - 1;
  const device_guard elsewhere{last};  // the registrations restore whatever device was current
  {
    nccl_registration a{comm, from_nccl, 4 * MiB, counting_calls};
    nccl_registration b{comm, from_cuda, 4 * MiB, counting_calls};
    CHECK(a.handle() != nullptr);
    CHECK(counts.live.size() == 2);
    CHECK(current_device() == last);
    nccl_registration moved{std::move(a)};
    b = std::move(moved);  // b's own registration is undone first
    CHECK(counts.deregisters == 1);
    CHECK(current_device() == last);
  }
  CHECK(current_device() == last);
  CHECK(counts.registers == 2);
  CHECK(counts.deregisters == 2);
  CHECK(counts.live.empty());
  {
    // The library's own table, not the counting one.
    const nccl_registration direct{comm, from_nccl, MiB};
    CHECK(static_cast<bool>(direct));
  }
  check(cudaFree(from_cuda));
  nccl_memory.deallocate(from_nccl, 4 * MiB);
}

// NCCL 2.28 itself accepts pageable memory at ncclCommRegister (measured on the H100: it defers
// the work to the first collective), so nccl_registration asks CUDA first.
TEST_CASE("nccl_registration: memory CUDA does not know is refused with invalid_argument") {
  ncclComm_t comm = communicators()[0].get();
  std::vector<char> host(MiB);
  CHECK_THROWS_AS((nccl_registration{comm, host.data(), host.size()}), std::invalid_argument);
  CHECK_THROWS_WITH((nccl_registration{comm, host.data(), host.size()}),
                    Catch::Contains("1.00 MiB") && Catch::Contains("pageable host memory"));
  CHECK_THROWS_AS((nccl_registration{nullptr, host.data(), host.size()}), std::invalid_argument);
  CHECK(cudaGetLastError() == cudaSuccess);  // nothing sticky left for the next call
}

TEST_CASE("registered pools: all-reduce on pooled blocks is right; each chunk registered once") {
  const counts_scope scope;
  auto& comms = communicators();
  const std::size_t n = comms.size();
  auto streams = one_stream_per_device();
  std::vector<std::unique_ptr<registered_pool>> pools;
  for (std::size_t d = 0; d < n; ++d) {
    pools.push_back(std::make_unique<registered_pool>(static_cast<int>(d), comms[d].get()));
  }
  const std::size_t sizes[] = {1, 1000, 256 * 1024, 3 * MiB, 20 * MiB};  // floats
  for (const std::size_t count : sizes) {
    INFO(count << " floats on " << n << " rank(s)");
    std::vector<device_buffer<float>> send_buffers;
    std::vector<device_buffer<float>> recv_buffers;
    std::vector<float*> send;
    std::vector<float*> recv;
    for (std::size_t r = 0; r < n; ++r) {
      send_buffers.emplace_back(count, streams[r], pools[r]->pool);
      recv_buffers.emplace_back(count, streams[r], pools[r]->pool);
      send.push_back(send_buffers.back().data());
      recv.push_back(recv_buffers.back().data());
      CHECK(counts.overlaps_live(send.back(), count * sizeof(float)));
      CHECK(counts.overlaps_live(recv.back(), count * sizeof(float)));
    }
    CHECK(all_reduce_and_count_wrong(send, recv, count, streams) == 0);
    CHECK(all_reduce_and_count_wrong(send, send, count, streams) == 0);  // in place
  }
  // A block that does not start at its chunk's start: the 18th float of a buffer.
  std::vector<device_buffer<float>> offset_buffers;
  std::vector<float*> inner;
  for (std::size_t r = 0; r < n; ++r) {
    offset_buffers.emplace_back(5000, streams[r], pools[r]->pool);
    inner.push_back(offset_buffers.back().data() + 17);
  }
  CHECK(all_reduce_and_count_wrong(inner, inner, 4000, streams) == 0);
  offset_buffers.clear();

  // A dozen buffers of every size, a few chunks: one registration per chunk, none per block.
  std::size_t made = 0;
  std::size_t chunks = 0;
  for (std::size_t r = 0; r < n; ++r) {
    made += pools[r]->registered.registrations_made();
    chunks += pools[r]->faults.allocate_calls();
    CHECK(pools[r]->registered.registrations() == pools[r]->pool.chunk_count());
  }
  CHECK(made == chunks);
  CHECK(made < 10 * n);
  for (std::size_t r = 0; r < n; ++r) {
    pools[r]->pool.release();
    CHECK(pools[r]->pool.chunk_count() == 0);
    CHECK(pools[r]->registered.registrations() == 0);
    CHECK(pools[r]->checker.frees > 0);
    CHECK(pools[r]->checker.frees_still_registered == 0);
    CHECK(pools[r]->memory.stats().used_bytes == 0);
  }
  CHECK(counts.live.empty());
  CHECK(counts.registers == counts.deregisters);
}

TEST_CASE("nccl_pool: sizes in the range from registered chunks, others plain; all-reduce right") {
  const counts_scope scope;
  auto& comms = communicators();
  const std::size_t n = comms.size();
  auto streams = one_stream_per_device();
  struct stack {
    stack(int device, ncclComm_t comm)
        : nccl_memory(device), plain_memory(device),
          pool(comm, nccl_memory, plain_memory, {}, counting_calls) {}
    nccl_mem_resource nccl_memory;
    device_resource plain_memory;
    nccl_pool pool;
  };
  std::vector<std::unique_ptr<stack>> stacks;
  for (std::size_t d = 0; d < n; ++d) {
    stacks.push_back(std::make_unique<stack>(static_cast<int>(d), comms[d].get()));
  }
  // 2 MiB and 512 MiB: plain memory, never registered; 8 and 16 MiB: registered chunks.
  for (const std::size_t bytes : {2 * MiB, 8 * MiB, 16 * MiB, 512 * MiB}) {
    const bool registered = bytes >= 8 * MiB && bytes <= 256 * MiB;
    INFO(bytes << " bytes on " << n << " rank(s)");
    const std::size_t count = bytes / sizeof(float);
    std::vector<device_buffer<float>> buffers;
    std::vector<float*> send;
    std::vector<float*> recv;
    for (std::size_t r = 0; r < n; ++r) {
      CHECK(stacks[r]->pool.serves_registered(bytes) == registered);
      buffers.emplace_back(count, streams[r], stacks[r]->pool.resource());
      send.push_back(buffers.back().data());
      buffers.emplace_back(count, streams[r], stacks[r]->pool.resource());
      recv.push_back(buffers.back().data());
      CHECK(counts.overlaps_live(send.back(), bytes) == registered);
      CHECK(counts.overlaps_live(recv.back(), bytes) == registered);
    }
    CHECK(all_reduce_and_count_wrong(send, recv, count, streams) == 0);
    CHECK(all_reduce_and_count_wrong(send, send, count, streams) == 0);  // in place
  }
  std::size_t made = 0;
  for (std::size_t r = 0; r < n; ++r) {
    nccl_pool& pool = stacks[r]->pool;
    made += pool.registrations_made();
    CHECK(pool.registering().registrations() == pool.registered_pool().chunk_count());
    CHECK(pool.registered_pool().chunk_count() > 0);
    CHECK(pool.plain_pool().chunk_count() > 0);
    CHECK(pool.release() > 0);
    CHECK(pool.registering().registrations() == 0);
    CHECK(stacks[r]->nccl_memory.stats().used_bytes == 0);
    CHECK(stacks[r]->plain_memory.stats().used_bytes == 0);
  }
  CHECK(made == static_cast<std::size_t>(counts.registers));  // chunks only, no plain block
  CHECK(counts.live.empty());
  CHECK(counts.registers == counts.deregisters);
}

TEST_CASE("nccl_pool: the owning constructor, on the communicator's device; bad input") {
  auto& comms = communicators();
  const int last = static_cast<int>(comms.size()) - 1;
  stream s{stream_options{.device = last}};
  {
    nccl_pool pool{comms.back().get()};
    CHECK(pool.resource().device() == last);
    const device_buffer<float> registered(4 * MiB, s, pool.resource());  // 16 MiB
    const device_buffer<float> plain(256 * 1024, s, pool.resource());    // 1 MiB
    CHECK(pool.registrations_made() == 1);  // the registered pool's one chunk
    CHECK(pool.registered_pool().chunk_count() == 1);
    CHECK(pool.plain_pool().chunk_count() == 1);
    s.synchronize();
  }
  CHECK_THROWS_AS(nccl_pool(nullptr), std::invalid_argument);
  CHECK_THROWS_AS(nccl_pool(comms[0].get(), {.registered_min_bytes = 2 * MiB,
                                             .registered_max_bytes = MiB}),
                  std::invalid_argument);
}

TEST_CASE("registered pools: a registration or an allocation failing leaves nothing behind") {
  const counts_scope scope;
  auto& comms = communicators();
  registered_pool stack{0, comms[0].get()};
  void* first = stack.pool.allocate(MiB);      // a small chunk, registered
  counts.fail_register_call = counts.register_calls + 1;  // the next chunk's registration
  CHECK_THROWS_AS(stack.pool.allocate(100 * MiB), nccl_error);
  CHECK(stack.pool.chunk_count() == 1);
  CHECK(stack.registered.registrations() == 1);
  CHECK(stack.memory.stats().used_bytes == stack.pool.stats().reserved_bytes);
  stack.faults.fail_from(1);  // NCCL's allocator "fails": the pool has nothing more to try
  CHECK_THROWS_AS(stack.pool.allocate(100 * MiB), out_of_memory);
  stack.faults.never_fail();
  CHECK(counts.live.size() == 1);
  void* second = stack.pool.allocate(100 * MiB);
  CHECK(counts.live.size() == 2);
  stack.pool.deallocate(second, 100 * MiB);
  stack.pool.deallocate(first, MiB);
  stack.pool.release();
  CHECK(counts.live.empty());
  CHECK(stack.checker.frees_still_registered == 0);
  CHECK(stack.memory.stats().used_bytes == 0);
}

TEST_CASE("vm_pool with nccl_vm_pool_options: all-reduce on its small and large blocks") {
  const counts_scope scope;
  auto& comms = communicators();
  const std::size_t n = comms.size();
  auto streams = one_stream_per_device();
  std::vector<std::unique_ptr<vm_pool_resource>> pools;
  for (std::size_t d = 0; d < n; ++d) {
    pools.push_back(std::make_unique<vm_pool_resource>(
        static_cast<int>(d), nccl_vm_pool_options(comms[d].get(), {}, counting_calls)));
  }
  for (const std::size_t count : {std::size_t{300000}, 40 * MiB}) {  // 1.1 MiB; 160 MiB: large
    INFO(count << " floats on " << n << " rank(s)");
    std::vector<device_buffer<float>> send_buffers;
    std::vector<device_buffer<float>> recv_buffers;
    std::vector<float*> send;
    std::vector<float*> recv;
    for (std::size_t r = 0; r < n; ++r) {
      send_buffers.emplace_back(count, streams[r], *pools[r]);
      recv_buffers.emplace_back(count, streams[r], *pools[r]);
      send.push_back(send_buffers.back().data());
      recv.push_back(recv_buffers.back().data());
      CHECK(counts.overlaps_live(send.back(), count * sizeof(float)));
    }
    CHECK(all_reduce_and_count_wrong(send, recv, count, streams) == 0);
  }  // the large blocks are freed on their streams: waited for, deregistered, then freed
  std::size_t chunks = 0;
  for (auto& pool : pools) {
    chunks += pool->pool().chunk_count();
  }
  CHECK(counts.live.size() == chunks);
  for (auto& pool : pools) {
    pool->release();
  }
  CHECK(counts.live.empty());
  pools.clear();
  CHECK(counts.registers == counts.deregisters);
  CHECK(counts.registers >= static_cast<int>(3 * n));  // a chunk and two large blocks each
}

TEST_CASE("nccl_mem_resource: device, alignment, bad input; out of memory is out_of_memory",
          "[expected-api-error]") {
  const int last = device_count() - 1;
  nccl_mem_resource on_last{last};
  CHECK(on_last.device() == last);
  CHECK(on_last.kind() == memory_kind::device);
  CHECK(on_last.name() == "nccl_mem_resource");
  {
    const device_guard on_0{0};
    void* p = on_last.allocate(3 * MiB);
    cudaPointerAttributes attributes{};
    check(cudaPointerGetAttributes(&attributes, p));
    CHECK(attributes.device == last);
    CHECK(on_last.stats().used_bytes == 3 * MiB);
    CHECK(current_device() == 0);
    on_last.deallocate(p, 3 * MiB, 256, stream_view{});
    CHECK(current_device() == 0);
  }
  CHECK(on_last.stats().used_bytes == 0);
  CHECK(on_last.allocate(0) == nullptr);
  CHECK_THROWS_AS(on_last.allocate(MiB, 512), std::invalid_argument);
  CHECK_THROWS_AS(nccl_mem_resource{device_count()}, std::out_of_range);
  CHECK(nccl_mem_resource{last} == on_last);
  const std::size_t too_much = device_memory(last).total * 2;
  try {
    static_cast<void>(on_last.allocate(too_much));
    FAIL("expected out_of_memory");
  } catch (const out_of_memory& e) {
    CHECK(e.requested_bytes() == too_much);
    CHECK_THAT(std::string(e.what()), Catch::Contains("ncclMemAlloc"));
  }
  CHECK(on_last.stats().used_bytes == 0);
  void* after = on_last.allocate(MiB);  // nothing sticky left behind
  on_last.deallocate(after, MiB);
}
