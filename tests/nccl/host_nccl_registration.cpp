// cudamem/nccl.hpp with no GPU and no communicator: the registration owner and the registering
// adaptor over a fake NCCL table (detail::nccl_calls) that keeps the live registrations. Every
// registration is undone exactly once, on every path (moves, failures of NCCL, of the upstream,
// of the pool), and no memory goes back to the upstream while registered: a checking resource
// under the adaptor looks at every free. Pools and vm_pools run over simulated devices.
#include <cudamem/detail/vm/simulated_mapping.hpp>
#include <cudamem/failing_adaptor.hpp>
#include <cudamem/host_resource.hpp>
#include <cudamem/nccl.hpp>
#include <cudamem/nccl_pool.hpp>
#include <cudamem/pool_resource.hpp>
#include <cudamem/simulated_resource.hpp>
#include <cudamem/vm_pool_resource.hpp>

#include "captured_errors.hpp"

#include <catch2/catch.hpp>

#include <algorithm>
#include <cstdint>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

using namespace cudamem;
using cudamem_test::captured_errors;

namespace {

constexpr std::size_t MiB = std::size_t{1} << 20;
constexpr std::size_t GiB = std::size_t{1} << 30;

/// The fake NCCL: what is registered now, what was called, and the failures to inject.
struct fake_nccl_state {
  struct range {
    std::uintptr_t address;
    std::size_t bytes;
  };
  std::map<void*, range> live;  ///< handle -> what it registered
  int registers = 0;            ///< successful ncclCommRegister calls
  int deregisters = 0;          ///< successful ncclCommDeregister calls
  int register_calls = 0;       ///< all ncclCommRegister calls
  int fail_register_call = 0;   ///< the k-th register call (1-based) fails; 0: none
  bool fail_all_registers = false;
  bool fail_deregister = false;
  bool null_handles = false;    ///< as NCCL with NCCL_LOCAL_REGISTER=0
  bool fail_comm_device = false;
  int device = -1;              ///< the communicator's device (simulated memory: -1)
  std::uintptr_t next_handle = 0x1000;

  [[nodiscard]] bool overlaps_live(const void* p, std::size_t bytes) const {
    const auto begin = reinterpret_cast<std::uintptr_t>(p);
    return std::any_of(live.begin(), live.end(), [&](const auto& entry) {
      const range& r = entry.second;
      return r.address < begin + bytes && begin < r.address + r.bytes;
    });
  }
  [[nodiscard]] std::size_t live_bytes() const {
    std::size_t total = 0;
    for (const auto& entry : live) {
      total += entry.second.bytes;
    }
    return total;
  }
};

fake_nccl_state fake;  // reset by each test through fake_nccl_scope

ncclResult_t fake_register(ncclComm_t, void* p, std::size_t bytes, void** handle) {
  ++fake.register_calls;
  if (fake.fail_all_registers || fake.register_calls == fake.fail_register_call) {
    return ncclInvalidArgument;
  }
  ++fake.registers;
  if (fake.null_handles) {
    *handle = nullptr;
    return ncclSuccess;
  }
  void* h = reinterpret_cast<void*>(fake.next_handle++);
  fake.live.emplace(h, fake_nccl_state::range{reinterpret_cast<std::uintptr_t>(p), bytes});
  *handle = h;
  return ncclSuccess;
}
ncclResult_t fake_deregister(ncclComm_t, void* handle) {
  if (fake.fail_deregister) {
    return ncclInternalError;
  }
  if (handle == nullptr) {  // what NCCL does with a null handle: nothing, successfully
    ++fake.deregisters;
    return ncclSuccess;
  }
  if (fake.live.erase(handle) == 0) {
    return ncclInvalidUsage;  // NCCL: "Deregister: Could not find handle"
  }
  ++fake.deregisters;
  return ncclSuccess;
}
ncclResult_t fake_comm_device(ncclComm_t, int* device) {
  if (fake.fail_comm_device) {
    return ncclInvalidUsage;
  }
  *device = fake.device;
  return ncclSuccess;
}
const char* fake_error_string(ncclResult_t) { return "fake NCCL error"; }
const char* fake_last_error(ncclComm_t) { return "fake last warning"; }

const detail::nccl_calls fake_calls{&fake_register, &fake_deregister, &fake_comm_device,
                                    &fake_error_string, &fake_last_error};

int comm_object = 0;
const ncclComm_t fake_comm = reinterpret_cast<ncclComm_t>(&comm_object);

struct fake_nccl_scope {
  fake_nccl_scope() { fake = fake_nccl_state{}; }
  ~fake_nccl_scope() { fake = fake_nccl_state{}; }
};

/// What a registration_checker saw (kept apart, so that it can be read after the checker died).
struct free_counts {
  int frees = 0;
  int frees_still_registered = 0;
};

/// Passes everything to its upstream and counts the frees of memory still registered.
class registration_checker final : public memory_resource {
 public:
  explicit registration_checker(memory_resource& upstream, free_counts* counts = nullptr)
      : memory_resource(upstream.kind(), upstream.device()),
        upstream_(&upstream),
        counts_(counts != nullptr ? counts : &own_) {}

  [[nodiscard]] int frees() const noexcept { return counts_->frees; }
  [[nodiscard]] int frees_still_registered() const noexcept {
    return counts_->frees_still_registered;
  }

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
  void look(void* p, std::size_t bytes) noexcept {
    ++counts_->frees;
    counts_->frees_still_registered += fake.overlaps_live(p, bytes) ? 1 : 0;
  }
  resource_stats do_stats() const override { return upstream_->stats(); }
  memory_resource* do_upstream() const noexcept override { return upstream_; }
  std::string_view do_name() const noexcept override { return "registration_checker"; }

  memory_resource* upstream_;
  free_counts own_;
  free_counts* counts_;
};

/// simulated device -> checker -> registering adaptor: the chain the tests put pools on.
struct registered_chain {
  simulated_resource device{{.capacity = 64 * GiB}};
  failing_adaptor faults{device};
  registration_checker checker{faults};
  nccl_registering_adaptor registered{checker, fake_comm, fake_calls};
};

/// A random trace of `allocations` blocks of 256 B .. 4 MiB and 8 .. 256 MiB, about half
/// freed as it goes; returns what is still allocated.
std::vector<std::pair<void*, std::size_t>> run_trace(memory_resource& mr, int allocations,
                                                     std::uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<double> small(8.0, 22.0);   // 256 B .. 4 MiB
  std::uniform_real_distribution<double> large(23.0, 28.0);  // 8 .. 256 MiB
  std::vector<std::pair<void*, std::size_t>> live;
  for (int i = 0; i < allocations; ++i) {
    const bool is_large = rng() % 16 == 0;
    const auto bytes = static_cast<std::size_t>(std::exp2(is_large ? large(rng) : small(rng)));
    live.emplace_back(mr.allocate(bytes), bytes);
    if (rng() % 2 == 0 && !live.empty()) {
      const std::size_t k = rng() % live.size();
      mr.deallocate(live[k].first, live[k].second);
      live.erase(live.begin() + static_cast<std::ptrdiff_t>(k));
    }
  }
  return live;
}

void free_all(memory_resource& mr, std::vector<std::pair<void*, std::size_t>>& live) {
  for (auto& [p, bytes] : live) {
    mr.deallocate(p, bytes);
  }
  live.clear();
}

}  // namespace

// --- nccl_registration ----------------------------------------------------------------------

TEST_CASE("nccl_registration: registered once, deregistered once, moves carry it") {
  const fake_nccl_scope scope;
  std::vector<char> memory(4096);
  {
    nccl_registration r{fake_comm, memory.data(), memory.size(), fake_calls};
    CHECK(static_cast<bool>(r));
    CHECK(r.communicator() == fake_comm);
    CHECK(r.address() == memory.data());
    CHECK(r.bytes() == memory.size());
    CHECK(r.handle() != nullptr);
    CHECK(fake.registers == 1);
    REQUIRE(fake.live.size() == 1);
    CHECK(fake.live.begin()->second.bytes == 4096);

    nccl_registration moved{std::move(r)};
    CHECK_FALSE(static_cast<bool>(r));  // NOLINT(bugprone-use-after-move): moved-from is empty
    CHECK(moved.handle() != nullptr);
    CHECK(fake.live.size() == 1);

    nccl_registration other{fake_comm, memory.data() + 1024, 1024, fake_calls};
    CHECK(fake.live.size() == 2);
    other = std::move(moved);  // other's own registration is undone first
    CHECK(fake.live.size() == 1);
    CHECK(fake.deregisters == 1);
    CHECK(other.address() == memory.data());

    other.reset();
    CHECK(fake.live.empty());
    CHECK(fake.deregisters == 2);
    other.reset();  // twice: nothing more
    CHECK(fake.deregisters == 2);

    nccl_registration last{fake_comm, memory.data(), 256, fake_calls};
    CHECK(fake.live.size() == 1);
  }  // `last` deregisters here
  CHECK(fake.live.empty());
  CHECK(fake.registers == 3);
  CHECK(fake.deregisters == 3);

  const nccl_registration empty;
  CHECK_FALSE(static_cast<bool>(empty));
  CHECK(empty.handle() == nullptr);
}

TEST_CASE("nccl_registration: a null handle (registration off in NCCL) is still deregistered") {
  const fake_nccl_scope scope;
  fake.null_handles = true;
  std::vector<char> memory(256);
  {
    const nccl_registration r{fake_comm, memory.data(), memory.size(), fake_calls};
    CHECK(static_cast<bool>(r));
    CHECK(r.handle() == nullptr);
  }
  CHECK(fake.registers == 1);
  CHECK(fake.deregisters == 1);
}

TEST_CASE("nccl_registration: bad input throws before NCCL is called") {
  const fake_nccl_scope scope;
  std::vector<char> memory(256);
  CHECK_THROWS_AS((nccl_registration{nullptr, memory.data(), 256, fake_calls}),
                  std::invalid_argument);
  CHECK_THROWS_AS((nccl_registration{fake_comm, nullptr, 256, fake_calls}),
                  std::invalid_argument);
  CHECK_THROWS_AS((nccl_registration{fake_comm, memory.data(), 0, fake_calls}),
                  std::invalid_argument);
  CHECK_THROWS_WITH((nccl_registration{fake_comm, memory.data(), 0, fake_calls}),
                    Catch::Contains("zero bytes"));
  CHECK(fake.register_calls == 0);
}

TEST_CASE("nccl_registration: NCCL refusing throws nccl_error and leaves nothing registered") {
  const fake_nccl_scope scope;
  std::vector<char> memory(256);
  fake.fail_all_registers = true;
  try {
    const nccl_registration r{fake_comm, memory.data(), memory.size(), fake_calls};
    FAIL("no exception");
  } catch (const nccl_error& e) {
    CHECK(e.code() == ncclInvalidArgument);
    const std::string what = e.what();
    CHECK_THAT(what, Catch::Contains("ncclCommRegister of 256 B") &&
                         Catch::Contains("ncclInvalidArgument") &&
                         Catch::Contains("fake NCCL error") &&
                         Catch::Contains("fake last warning") &&
                         Catch::Contains("host_nccl_registration.cpp"));
  }
  CHECK(fake.live.empty());

  fake.fail_all_registers = false;
  fake.fail_comm_device = true;
  CHECK_THROWS_AS((nccl_registration{fake_comm, memory.data(), 256, fake_calls}), nccl_error);
  CHECK(fake.registers == 0);
}

TEST_CASE("nccl_registration: a failing deregistration is reported, never thrown") {
  const fake_nccl_scope scope;
  const captured_errors errors;
  std::vector<char> memory(256);
  {
    const nccl_registration r{fake_comm, memory.data(), memory.size(), fake_calls};
    fake.fail_deregister = true;
  }
  REQUIRE(captured_errors::messages().size() == 1);
  CHECK_THAT(captured_errors::messages()[0],
             Catch::Contains("ncclCommDeregister of 256 B") &&
                 Catch::Contains("ncclInternalError"));
}

TEST_CASE("nccl_error and check_nccl: the code and what was being done") {
  CHECK_NOTHROW(check_nccl(ncclSuccess, "nothing"));
  try {
    check_nccl(ncclInvalidUsage, "ncclAllReduce");
    FAIL("no exception");
  } catch (const nccl_error& e) {
    CHECK(e.code() == ncclInvalidUsage);
    CHECK_THAT(std::string(e.what()),
               Catch::StartsWith("ncclAllReduce: ncclInvalidUsage (") &&
                   Catch::Contains("host_nccl_registration.cpp"));
    CHECK(e.where().line() > 0);
  }
}

// --- nccl_registering_adaptor -----------------------------------------------------------------

TEST_CASE("nccl_registering_adaptor: bad input") {
  const fake_nccl_scope scope;
  simulated_resource device;
  CHECK_THROWS_AS((nccl_registering_adaptor{device, nullptr, fake_calls}), std::invalid_argument);
  host_resource host;
  CHECK_THROWS_WITH((nccl_registering_adaptor{host, fake_comm, fake_calls}),
                    Catch::Contains("NCCL registers device memory"));
  fake.device = 3;  // the communicator is on device 3, the memory on -1
  CHECK_THROWS_WITH((nccl_registering_adaptor{device, fake_comm, fake_calls}),
                    Catch::Contains("communicator is on device 3"));
  fake.device = -1;
  fake.fail_comm_device = true;
  CHECK_THROWS_AS((nccl_registering_adaptor{device, fake_comm, fake_calls}), nccl_error);
  CHECK(fake.register_calls == 0);
}

TEST_CASE("nccl_registering_adaptor: each allocation registered, deregistered before it goes") {
  const fake_nccl_scope scope;
  registered_chain c;
  nccl_registering_adaptor& mr = c.registered;
  CHECK(mr.upstream() == &c.checker);
  CHECK(mr.kind() == memory_kind::device);
  CHECK(mr.device() == -1);
  CHECK(mr.name() == "nccl_registering_adaptor");
  CHECK(mr.communicator() == fake_comm);

  void* a = mr.allocate(3 * MiB);
  void* b = mr.allocate(1000, 256, stream_view{});
  CHECK(mr.is_registered(a));
  CHECK(mr.is_registered(b));
  CHECK(mr.registrations() == 2);
  CHECK(mr.registered_bytes() == 3 * MiB + 1000);
  CHECK(fake.live.size() == 2);
  CHECK(fake.overlaps_live(a, 3 * MiB));
  CHECK(mr.stats().used_bytes == c.device.stats().used_bytes);

  mr.deallocate(b, 1000, 256, stream_view{});  // the stream-ordered form
  mr.deallocate(a, 3 * MiB);
  CHECK(mr.registrations() == 0);
  CHECK(mr.registered_bytes() == 0);
  CHECK(mr.registrations_made() == 2);
  CHECK(fake.live.empty());
  CHECK(c.checker.frees() == 2);
  CHECK(c.checker.frees_still_registered() == 0);
  CHECK(c.device.stats().used_bytes == 0);
  CHECK(mr.allocate(0) == nullptr);  // zero bytes: nothing asked, nothing registered
  CHECK(fake.register_calls == 2);
}

TEST_CASE("nccl_registering_adaptor: a refused registration gives the memory back") {
  const fake_nccl_scope scope;
  registered_chain c;
  fake.fail_all_registers = true;
  CHECK_THROWS_AS(c.registered.allocate(MiB), nccl_error);
  CHECK(c.device.stats().used_bytes == 0);
  CHECK(c.checker.frees() == 1);
  CHECK(c.registered.registrations() == 0);
  CHECK(c.registered.registrations_made() == 0);
}

TEST_CASE("nccl_registering_adaptor: an upstream failure passes through, nothing registered") {
  const fake_nccl_scope scope;
  registered_chain c;
  c.faults.fail_call(1);
  try {
    static_cast<void>(c.registered.allocate(MiB));
    FAIL("no exception");
  } catch (const out_of_memory& e) {
    CHECK(e.report().cause.find("failure injected") != std::string::npos);
  }
  CHECK(fake.register_calls == 0);
  CHECK(c.device.stats().used_bytes == 0);
}

TEST_CASE("nccl_registering_adaptor: a pointer it did not register is passed down as it is") {
  const fake_nccl_scope scope;
  registered_chain c;
  void* direct = c.checker.allocate(MiB);  // not through the adaptor
  c.registered.deallocate(direct, MiB);
  CHECK(c.device.stats().used_bytes == 0);
  CHECK(fake.deregisters == 0);
}

TEST_CASE("nccl_registering_adaptor: destroyed with live registrations, reports and undoes them") {
  const fake_nccl_scope scope;
  const captured_errors errors;
  simulated_resource device;
  void* p = nullptr;
  {
    nccl_registering_adaptor mr{device, fake_comm, fake_calls};
    p = mr.allocate(2 * MiB);
    CHECK(fake.live.size() == 1);
  }
  CHECK(fake.live.empty());
  REQUIRE(captured_errors::messages().size() == 1);
  CHECK_THAT(captured_errors::messages()[0],
             Catch::Contains("1 registration(s) (2.00 MiB) still live"));
  device.deallocate(p, 2 * MiB);
}

// --- pools over it ----------------------------------------------------------------------------

TEST_CASE("pool over the adaptor: each chunk registered once, however many blocks") {
  const fake_nccl_scope scope;
  registered_chain c;
  {
    pool_resource pool{c.registered};
    auto live = run_trace(pool, 1000, 7);
    // Every chunk the pool holds is registered, and nothing else is.
    CHECK(fake.live.size() == pool.chunk_count());
    CHECK(fake.live_bytes() == pool.stats().reserved_bytes);
    // 1,000 allocations, a handful of registrations: the point of registering chunks.
    // Each chunk taken from the upstream was registered once: 1,000 allocations (1 in 16 of
    // 8 to 256 MiB, chunks of their own size) took 53 registrations when this was written.
    INFO("registrations for 1,000 allocations: " << c.registered.registrations_made());
    CHECK(c.registered.registrations_made() == c.faults.allocate_calls());
    CHECK(c.registered.registrations_made() < 100);
    // Every block lies in a registered range.
    for (const auto& [p, bytes] : live) {
      CHECK(fake.overlaps_live(p, bytes));
    }
    free_all(pool, live);
    CHECK(pool.release() > 0);
    CHECK(pool.chunk_count() == 0);
    CHECK(fake.live.empty());

    live = run_trace(pool, 200, 8);  // grows again; the destructor returns the rest
    CHECK(fake.live.size() == pool.chunk_count());
    free_all(pool, live);
  }
  CHECK(fake.live.empty());
  CHECK(c.device.stats().used_bytes == 0);
  CHECK(c.checker.frees() > 0);
  CHECK(c.checker.frees_still_registered() == 0);
  CHECK(fake.registers == fake.deregisters);
}

TEST_CASE("pool over the adaptor: a failure at any registration leaks nothing") {
  const fake_nccl_scope scope;
  registered_chain c;
  bool finished = false;
  for (int k = 1; !finished; ++k) {
    fake.register_calls = 0;
    fake.fail_register_call = k;
    {
      // The trace's blocks still allocated when it throws are lost to this test, not to the
      // pool: its destructor returns their chunks, and reports them (quietly here).
      const captured_errors quiet;
      pool_resource pool{c.registered};
      std::vector<std::pair<void*, std::size_t>> live;
      try {
        live = run_trace(pool, 300, 11);
        finished = true;  // no k-th registration in the whole trace
      } catch (const nccl_error& e) {
        CHECK(e.code() == ncclInvalidArgument);
      }
      // Whatever happened, the pool's chunks are exactly what is registered and allocated.
      CHECK(fake.live.size() == pool.chunk_count());
      CHECK(c.device.stats().used_bytes == pool.stats().reserved_bytes);
      free_all(pool, live);
    }
    CHECK(fake.live.empty());
    CHECK(c.device.stats().used_bytes == 0);
    REQUIRE(k < 100);
  }
  CHECK(c.checker.frees_still_registered() == 0);
}

TEST_CASE("pool over the adaptor: an upstream failure at any point leaks nothing") {
  const fake_nccl_scope scope;
  registered_chain c;
  bool finished = false;
  for (std::size_t k = 1; !finished; ++k) {
    c.faults.fail_call(k);
    {
      // The trace's blocks still allocated when it throws are lost to this test, not to the
      // pool: its destructor returns their chunks, and reports them (quietly here).
      const captured_errors quiet;
      pool_resource pool{c.registered};
      std::vector<std::pair<void*, std::size_t>> live;
      try {
        live = run_trace(pool, 300, 12);
        finished = c.faults.injected_failures() == 0;
      } catch (const out_of_memory&) {
      }
      CHECK(fake.live.size() == pool.chunk_count());
      CHECK(c.device.stats().used_bytes == pool.stats().reserved_bytes);
      free_all(pool, live);
    }
    CHECK(fake.live.empty());
    CHECK(c.device.stats().used_bytes == 0);
    REQUIRE(k < 100);
  }
  c.faults.never_fail();
  CHECK(c.checker.frees_still_registered() == 0);
}

// --- vm_pool ----------------------------------------------------------------------------------

namespace {

/// A vm_pool over a simulated device with the given options.
std::unique_ptr<vm_pool_resource> simulated_vm_pool(vm_pool_options options) {
  return std::make_unique<vm_pool_resource>(
      std::make_unique<detail::simulated_vm_mapping>(
          detail::simulated_vm_options{.capacity = 16 * GiB, .granularity = 2 * MiB}),
      std::move(options));
}

/// What upstream_adaptor makes in the checked test: vm -> checker -> registering adaptor,
/// owned together; requests go to the adaptor.
class checked_registration final : public memory_resource {
 public:
  checked_registration(vm_resource& vm, free_counts& counts)
      : memory_resource(vm.kind(), vm.device()),
        checker(vm, &counts),
        adaptor(checker, fake_comm, fake_calls) {}
  registration_checker checker;
  nccl_registering_adaptor adaptor;

 private:
  void* do_allocate(std::size_t bytes, std::size_t alignment, stream_view s) override {
    return adaptor.allocate(bytes, alignment, s);
  }
  void* do_allocate_sync(std::size_t bytes, std::size_t alignment) override {
    return adaptor.allocate(bytes, alignment);
  }
  void do_deallocate(void* p, std::size_t bytes, std::size_t alignment,
                     stream_view s) noexcept override {
    adaptor.deallocate(p, bytes, alignment, s);
  }
  void do_deallocate_sync(void* p, std::size_t bytes, std::size_t alignment) noexcept override {
    adaptor.deallocate(p, bytes, alignment);
  }
  memory_resource* do_upstream() const noexcept override {
    return const_cast<nccl_registering_adaptor*>(&adaptor);
  }
};

}  // namespace

TEST_CASE("vm_pool with nccl_vm_pool_options: chunks and large blocks registered") {
  const fake_nccl_scope scope;
  const vm_pool_options options = nccl_vm_pool_options(fake_comm, {}, fake_calls);
  CHECK(options.exportable);  // NCCL maps cuMem memory for its peers through shareable handles
  auto pool = simulated_vm_pool(options);
  auto* adaptor = dynamic_cast<nccl_registering_adaptor*>(pool->upstream_adaptor());
  REQUIRE(adaptor != nullptr);
  CHECK(pool->upstream() == adaptor);
  CHECK(adaptor->upstream() == &pool->upstream_vm());

  void* small = pool->allocate(MiB);
  void* large = pool->allocate(200 * MiB);  // >= a handle: the upstream's, through the adaptor
  CHECK(adaptor->is_registered(large));
  CHECK(fake.overlaps_live(small, MiB));
  CHECK(fake.live.size() == pool->pool().chunk_count() + 1);
  pool->deallocate(large, 200 * MiB, 256, stream_view{});
  CHECK(fake.live.size() == pool->pool().chunk_count());
  pool->deallocate(small, MiB);
  pool->release();
  CHECK(fake.live.empty());
  void* again = pool->allocate(2 * MiB);
  CHECK(fake.live.size() == 1);
  pool->deallocate(again, 2 * MiB);
  pool.reset();
  CHECK(fake.live.empty());
  CHECK(fake.registers == fake.deregisters);
  CHECK(fake.registers >= 3);
}

TEST_CASE("vm_pool with nccl_vm_pool_options: bad input") {
  const fake_nccl_scope scope;
  CHECK_THROWS_AS(nccl_vm_pool_options(nullptr, {}, fake_calls), std::invalid_argument);
  vm_pool_options taken;
  taken.upstream_adaptor = [](vm_resource& vm) -> std::unique_ptr<memory_resource> {
    return std::make_unique<failing_adaptor>(vm);
  };
  CHECK_THROWS_WITH(nccl_vm_pool_options(fake_comm, taken, fake_calls),
                    Catch::Contains("already have an upstream_adaptor"));
  fake.device = 0;  // the communicator on device 0, the simulated vm_pool on -1
  CHECK_THROWS_AS(simulated_vm_pool(nccl_vm_pool_options(fake_comm, {}, fake_calls)),
                  std::invalid_argument);
}

TEST_CASE("vm_pool with registration: nothing goes back to the vm_resource registered") {
  const fake_nccl_scope scope;
  free_counts counts;
  nccl_registering_adaptor* adaptor = nullptr;
  vm_pool_options options;
  options.upstream_adaptor = [&](vm_resource& vm) -> std::unique_ptr<memory_resource> {
    auto made = std::make_unique<checked_registration>(vm, counts);
    adaptor = &made->adaptor;
    return made;
  };
  auto pool = simulated_vm_pool(options);
  REQUIRE(adaptor != nullptr);
  auto live = run_trace(*pool, 1000, 21);
  CHECK(fake.live.size() == adaptor->registrations());
  for (const auto& [p, bytes] : live) {
    CHECK(fake.overlaps_live(p, bytes));
  }
  INFO("registrations for 1,000 allocations: " << adaptor->registrations_made());
  CHECK(adaptor->registrations_made() < 200);  // the large blocks (1 in 16) and the chunks
  free_all(*pool, live);
  pool->release();
  CHECK(fake.live.empty());
  const int frees_at_release = counts.frees;
  CHECK(frees_at_release > 0);
  live = run_trace(*pool, 100, 22);
  free_all(*pool, live);
  pool.reset();  // the pool's chunks go back through the adaptor at destruction
  CHECK(counts.frees > frees_at_release);
  CHECK(counts.frees_still_registered == 0);
  CHECK(fake.live.empty());
  CHECK(fake.registers == fake.deregisters);
}

// --- nccl_pool: registered chunks for some sizes, plain memory for the rest -------------------

namespace {

/// Two simulated devices' worth of upstreams for an nccl_pool: the registered side checked
/// for frees of registered memory, the plain side counted.
struct nccl_pool_upstreams {
  simulated_resource registered_device{{.capacity = 64 * GiB}};
  failing_adaptor registered_faults{registered_device};
  registration_checker checker{registered_faults};
  simulated_resource plain_device{{.capacity = 64 * GiB}};
  failing_adaptor plain_faults{plain_device};
};

}  // namespace

TEST_CASE("nccl_pool: sizes in the range come from registered chunks, the others never do") {
  const fake_nccl_scope scope;
  nccl_pool_upstreams u;
  {
    nccl_pool pool{fake_comm, u.checker, u.plain_faults, {}, fake_calls};
    CHECK(pool.options().registered_min_bytes == 8 * MiB);
    CHECK(pool.options().registered_max_bytes == 256 * MiB);
    memory_resource& mr = pool.resource();
    // The edges: 8 MiB - 1 and 256 MiB + 1 are plain, 8 MiB and 256 MiB registered.
    const std::size_t sizes[] = {4096, 2 * MiB, 8 * MiB - 1, 8 * MiB, 64 * MiB, 256 * MiB,
                                 256 * MiB + 1, GiB};
    std::vector<std::pair<void*, std::size_t>> live;
    for (const std::size_t bytes : sizes) {
      const bool registered = bytes >= 8 * MiB && bytes <= 256 * MiB;
      INFO(bytes << " bytes");
      CHECK(pool.serves_registered(bytes) == registered);
      void* p = mr.allocate(bytes);
      live.emplace_back(p, bytes);
      CHECK(fake.overlaps_live(p, bytes) == registered);
    }
    // Registered: one registration per chunk of the registered pool, none for plain blocks.
    CHECK(pool.registrations_made() == u.registered_faults.allocate_calls());
    CHECK(fake.live.size() == pool.registered_pool().chunk_count());
    CHECK(u.plain_faults.allocate_calls() == pool.plain_pool().chunk_count());
    CHECK(pool.plain_pool().stats().used_bytes >= 4096 + 2 * MiB + 8 * MiB - 1 + 256 * MiB + 1 + GiB);
    free_all(mr, live);
    CHECK(pool.registered_pool().stats().used_bytes == 0);
    CHECK(pool.plain_pool().stats().used_bytes == 0);
    CHECK(pool.release() > 0);
    CHECK(fake.live.empty());
    live = run_trace(mr, 500, 31);  // the destructor gives back what this leaves
    free_all(mr, live);
  }
  CHECK(fake.live.empty());
  CHECK(fake.registers == fake.deregisters);
  CHECK(u.checker.frees_still_registered() == 0);
  CHECK(u.registered_device.stats().used_bytes == 0);
  CHECK(u.plain_device.stats().used_bytes == 0);
}

TEST_CASE("nccl_pool: a failing registration or upstream loses nothing, the other side works") {
  const fake_nccl_scope scope;
  nccl_pool_upstreams u;
  {
    nccl_pool pool{fake_comm, u.checker, u.plain_faults, {}, fake_calls};
    fake.fail_all_registers = true;
    CHECK_THROWS_AS(pool.resource().allocate(16 * MiB), nccl_error);
    CHECK(u.registered_device.stats().used_bytes == 0);  // the chunk went back
    void* plain = pool.resource().allocate(2 * MiB);      // plain memory needs no NCCL
    fake.fail_all_registers = false;
    void* registered = pool.resource().allocate(16 * MiB);
    CHECK(fake.overlaps_live(registered, 16 * MiB));
    u.plain_faults.fail_from(1);
    CHECK_THROWS_AS(pool.resource().allocate(GiB), out_of_memory);  // the plain side's failure
    CHECK(u.plain_faults.injected_failures() > 0);
    u.plain_faults.never_fail();
    CHECK(fake.live.size() == pool.registered_pool().chunk_count());  // registered side as was
    pool.resource().deallocate(registered, 16 * MiB);
    pool.resource().deallocate(plain, 2 * MiB);
  }
  CHECK(fake.live.empty());
  CHECK(fake.registers == fake.deregisters);
  CHECK(u.registered_device.stats().used_bytes == 0);
  CHECK(u.plain_device.stats().used_bytes == 0);
}

TEST_CASE("nccl_pool: bad input throws std::invalid_argument and registers nothing") {
  const fake_nccl_scope scope;
  nccl_pool_upstreams u;
  CHECK_THROWS_AS(nccl_pool(nullptr, u.checker, u.plain_faults, {}, fake_calls),
                  std::invalid_argument);
  CHECK_THROWS_WITH(nccl_pool(fake_comm, u.checker, u.plain_faults,
                              {.registered_min_bytes = 2 * MiB, .registered_max_bytes = MiB},
                              fake_calls),
                    Catch::Contains("registered_min_bytes"));
  host_resource host;  // not device memory: the registering adaptor refuses it
  CHECK_THROWS_AS(nccl_pool(fake_comm, host, u.plain_faults, {}, fake_calls),
                  std::invalid_argument);
  fake.device = 0;  // the communicator on device 0, the simulated memory on -1
  CHECK_THROWS_AS(nccl_pool(fake_comm, u.checker, u.plain_faults, {}, fake_calls),
                  std::invalid_argument);
  CHECK(fake.register_calls == 0);
}
