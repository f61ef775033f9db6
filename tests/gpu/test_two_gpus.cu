// Two GPUs at once (skipped with "SKIPPED: needs 2 GPUs" on a machine with one): threads
// driving both devices through per-device resources; buffers, streams and events made on one
// device and thread and destroyed on another with the other device current; peer_access's
// reference counting and its respect for access enabled by someone else; copies between
// devices, ordered after the other device's stream; vm_pool memory mapped for a peer; memory
// shared with another process whose GPU is the other one (ipc_pool.hpp, vm_ipc.hpp: the
// importer's device gets access by itself, its kernel there reads and writes the memory, it is
// killed mid-use, and the data and every byte of both devices come back).
#include <cudamem/copy.hpp>
#include <cudamem/current_resource.hpp>
#include <cudamem/device_buffer.hpp>
#include <cudamem/event.hpp>
#include <cudamem/peer_access.hpp>
#include <cudamem/per_device_resources.hpp>
#include <cudamem/pinned_buffer.hpp>
#include <cudamem/stream.hpp>
#include <cudamem/fd_passing.hpp>
#include <cudamem/ipc_pool.hpp>
#include <cudamem/vm_ipc.hpp>
#include <cudamem/vm_pool_resource.hpp>
#include <cudamem/vm_resource.hpp>

#include "child_process.hpp"
#include "gpu_test.hpp"
#include "late_fill.cuh"
#include "ipc_protocol.hpp"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <mutex>
#include <string>
#include <stdexcept>
#include <thread>
#include <vector>

CUDAMEM_TEST_NEEDS_DEVICES(2)

using namespace cudamem;
using cudamem_test::captured_errors;
using cudamem_test::late_fill;

namespace {

constexpr std::size_t MiB = std::size_t{1} << 20;

__global__ void fill_with(device_span<int> x, int value) {
  const std::size_t i = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x;
  if (i < x.size()) {
    x[i] = value;
  }
}

__global__ void add_one(device_span<int> x) {
  const std::size_t i = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x;
  if (i < x.size()) {
    x[i] += 1;
  }
}

unsigned blocks_for(std::size_t n) { return static_cast<unsigned>((n + 255) / 256); }

std::size_t count_equal(const pinned_buffer<int>& h, int value) {
  std::size_t n = 0;
  for (const int v : h) {
    n += v == value ? 1 : 0;
  }
  return n;
}

/// The device a pointer's memory lives on, as CUDA sees it.
int device_of(const void* p) {
  cudaPointerAttributes attributes{};
  check(cudaPointerGetAttributes(&attributes, p), "cudaPointerGetAttributes");
  return attributes.device;
}

/// Whether device a has peer access to b enabled now. Asks CUDA by trying to enable it: a
/// success means it was off, and it is switched off again. Asked while access is on, the
/// answer is a refused call (an API error to compute-sanitizer): only [expected-api-error]
/// cases do that.
bool peer_enabled(int a, int b) {
  const device_guard on{a};
  const cudaError_t code = cudaDeviceEnablePeerAccess(b, 0);
  if (code == cudaErrorPeerAccessAlreadyEnabled) {
    static_cast<void>(cudaGetLastError());
    return true;
  }
  check(code, "cudaDeviceEnablePeerAccess (probe)");
  check(cudaDeviceDisablePeerAccess(b), "cudaDeviceDisablePeerAccess (probe)");
  return false;
}

/// Two threads, one per device, each allocating from the current resource and handing every
/// buffer to the other thread, which destroys it with its own device current. Checks the data,
/// the devices, that the destroying thread's device is untouched, and that no error was
/// reported and every byte went back.
void drive_both_devices(per_device_resources& mrs) {
  captured_errors errors;
  constexpr int rounds = 20;
  constexpr std::size_t n = 256 * 1024;
  // Streams outlive every buffer freed on them, whichever thread frees it.
  stream streams[2] = {stream{{.device = 0, .non_blocking = true}},
                       stream{{.device = 1, .non_blocking = true}}};
  std::mutex handoff_mutex;
  std::vector<device_buffer<int>> handoff[2];  // buffers made on device d, destroyed by 1 - d
  std::vector<std::string> failures;           // Catch2 asserts on the main thread only
  const auto fail = [&](std::string what) {
    const std::lock_guard lock(handoff_mutex);
    failures.push_back(std::move(what));
  };
  const auto worker = [&](int device) {
    try {
      const device_guard on{device};
      pinned_buffer<int> h(n);
      for (int r = 0; r < rounds; ++r) {
        // Alternate the device's own stream and the legacy default stream.
        const stream_view on_stream = r % 2 == 0 ? stream_view{streams[device]} : stream_view{};
        device_buffer<int> x(n, on_stream);  // the current resource: this device's
        if (x.device() != device || device_of(x.data()) != device ||
            &x.resource() != &mrs.get(device)) {
          fail("device " + std::to_string(device) + ": a buffer from the wrong device or resource");
        }
        fill_with<<<blocks_for(n), 256, 0, on_stream.get()>>>(x, device * 1000 + r);
        add_one<<<blocks_for(n), 256, 0, on_stream.get()>>>(x);
        check(cudaGetLastError());
        copy(h, x, on_stream);
        on_stream.synchronize();
        if (count_equal(h, device * 1000 + r + 1) != n) {
          fail("device " + std::to_string(device) + ": wrong data in round " + std::to_string(r));
        }
        {
          const std::lock_guard lock(handoff_mutex);
          handoff[device].push_back(std::move(x));
          handoff[1 - device].clear();  // what the other thread made, freed with this device current
        }
        if (current_device() != device) {
          fail("device " + std::to_string(device) + ": a free changed the thread's current device");
        }
      }
    } catch (const std::exception& e) {
      fail("device " + std::to_string(device) + ": " + e.what());
    }
  };
  std::thread t0(worker, 0);
  std::thread t1(worker, 1);
  t0.join();
  t1.join();
  // What is left was made on one device; destroy it from a thread with the other current.
  std::thread([&] {
    const device_guard on{1};
    handoff[0].clear();
  }).join();
  std::thread([&] {
    const device_guard on{0};
    handoff[1].clear();
  }).join();
  for (const int d : {0, 1}) {
    const device_guard on{d};
    check(cudaDeviceSynchronize());
  }
  for (const std::string& f : failures) {
    UNSCOPED_INFO(f);
  }
  CHECK(failures.empty());
  for (const std::string& m : errors.messages()) {
    UNSCOPED_INFO("reported: " << m);
  }
  CHECK(errors.messages().empty());
  CHECK(mrs.get(0).stats().used_bytes == 0);
  CHECK(mrs.get(1).stats().used_bytes == 0);
}

}  // namespace

TEST_CASE("two threads drive two GPUs through per-device pools; buffers die on the other device") {
  auto pools = per_device_resources::pools({}, {.devices = {0, 1}});
  drive_both_devices(pools);
}

TEST_CASE("two threads drive two GPUs through per-device async pools") {
  auto pools = per_device_resources::async(std::uint64_t{256} << 20, {.devices = {0, 1}});
  drive_both_devices(pools);
}

TEST_CASE("two threads drive two GPUs through per-device vm pools") {
  auto pools = per_device_resources::vm_pools({}, {.devices = {0, 1}});
  drive_both_devices(pools);
}

TEST_CASE("a device 1 buffer on the default stream, made and freed with device 0 current") {
  captured_errors errors;
  auto pools = per_device_resources::pools({}, {.devices = {0, 1}});
  const device_guard on{0};
  {
    device_buffer<int> x(1 << 20, 9, stream_view{}, pools.get(1));
    CHECK(current_device() == 0);
    CHECK(device_of(x.data()) == 1);
    pinned_buffer<int> h(x.size());
    {
      const device_guard on_1{1};
      copy(h, x, stream_view{});  // device 1's legacy stream: after the fill
      check(cudaStreamSynchronize(nullptr));
    }
    CHECK(count_equal(h, 9) == h.size());
  }
  CHECK(current_device() == 0);
  CHECK(pools.get(1).stats().used_bytes == 0);
  CHECK(errors.messages().empty());
}

TEST_CASE("streams and events of device 1 destroyed with device 0 current") {
  captured_errors errors;
  const device_guard on{0};
  {
    stream s1{{.device = 1, .non_blocking = true}};
    event e1{{.device = 1}};
    CHECK(s1.device() == 1);
    CHECK(e1.device() == 1);
    e1.record(s1);
    // A default stream for a device 1 event: the event's device's legacy stream. (Recording on
    // device 0's legacy stream would fail: an event and a stream of different devices.)
    e1.record(stream_view{});
    e1.synchronize();
    CHECK(current_device() == 0);
    stream moved = std::move(s1);
    CHECK(moved.device() == 1);
  }
  CHECK(current_device() == 0);
  CHECK(errors.messages().empty());
}

// The guards' own work never makes CUDA answer with an error: the first enables access that
// is off, the last disables what the first enabled. So this case runs under compute-sanitizer
// with API errors reported; the probe `peer_enabled` is only asked while access is off (a
// probe of access that is on is itself a refused enable). The kernel is what shows access on.
TEST_CASE("peer_access: counted per pair, enables on the first guard, disables on the last") {
  if (!can_access_peer(0, 1)) {
    CHECK_THROWS_AS(peer_access(0, 1), peer_access_error);
    WARN("devices 0 and 1 have no peer path: only the error is checked");
    return;
  }
  REQUIRE_FALSE(peer_enabled(0, 1));
  {
    peer_access a{0, 1};
    CHECK(a.holds());
    CHECK(peer_access::holders(0, 1) == 1);
    CHECK(peer_access::enabled_by_guards(0, 1));
    {
      peer_access b{0, 1};
      std::vector<peer_access> more;
      more.emplace_back(0, 1);
      CHECK(peer_access::holders(0, 1) == 3);
    }
    CHECK(peer_access::holders(0, 1) == 1);
    CHECK(peer_access::holders(1, 0) == 0);  // one-way: the other direction is its own pair
    // Device 0's kernel writes device 1's cudaMalloc memory directly: it would fault (an
    // illegal address) without access.
    device_resource on_1{1};
    void* p = on_1.allocate(MiB);
    {
      const device_guard d0{0};
      fill_with<<<blocks_for(MiB / sizeof(int)), 256>>>(
          device_span<int>{static_cast<int*>(p), MiB / sizeof(int)}, 42);
      check(cudaGetLastError());
      check(cudaDeviceSynchronize());
    }
    std::vector<int> back(MiB / sizeof(int));
    check(cudaMemcpy(back.data(), p, MiB, cudaMemcpyDefault));
    CHECK(std::count(back.begin(), back.end(), 42) == static_cast<long>(back.size()));
    on_1.deallocate(p, MiB);
  }
  CHECK(peer_access::holders(0, 1) == 0);
  CHECK_FALSE(peer_enabled(0, 1));  // the guards enabled it, the last one disabled it
}

// Access that others switch on or off is answered by CUDA with an error code the guards take
// as a state (cudaErrorPeerAccessAlreadyEnabled, cudaErrorPeerAccessNotEnabled); there is no
// query for it. Those refusals are the point of this case: sanitize.sh runs it with API-error
// reports off, leaks still checked.
TEST_CASE("peer_access: leaves access others enabled on, and says nothing when others disabled it",
          "[expected-api-error]") {
  if (!can_access_peer(0, 1)) {
    WARN("devices 0 and 1 have no peer path");
    return;
  }
  REQUIRE_FALSE(peer_enabled(0, 1));
  {
    const device_guard d0{0};
    check(cudaDeviceEnablePeerAccess(1, 0));  // somebody else's access
  }
  {
    peer_access a{0, 1};
    CHECK(peer_access::holders(0, 1) == 1);
    CHECK_FALSE(peer_access::enabled_by_guards(0, 1));
  }
  CHECK(peer_enabled(0, 1));  // left on
  {
    const device_guard d0{0};
    check(cudaDeviceDisablePeerAccess(1));
  }

  // Access disabled behind the guard's back: its end says nothing and leaves it off.
  captured_errors errors;
  {
    peer_access a{0, 1};
    CHECK(peer_access::enabled_by_guards(0, 1));
    const device_guard d0{0};
    check(cudaDeviceDisablePeerAccess(1));
  }
  CHECK(errors.messages().empty());
  CHECK(peer_access::holders(0, 1) == 0);
  CHECK_FALSE(peer_enabled(0, 1));
  CHECK(cudaGetLastError() == cudaSuccess);  // the refusals left no error behind
}

TEST_CASE("peer_access from many threads at once balances to the state before") {
  if (!can_access_peer(0, 1) || !can_access_peer(1, 0)) {
    WARN("no peer path between devices 0 and 1");
    return;
  }
  REQUIRE_FALSE(peer_enabled(0, 1));
  REQUIRE_FALSE(peer_enabled(1, 0));
  std::vector<std::thread> threads;
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([t] {
      for (int i = 0; i < 50; ++i) {
        peer_access a{t % 2, 1 - t % 2};
        peer_access b{1 - t % 2, t % 2};
      }
    });
  }
  for (auto& t : threads) {
    t.join();
  }
  CHECK(peer_access::holders(0, 1) == 0);
  CHECK_FALSE(peer_enabled(0, 1));
  CHECK_FALSE(peer_enabled(1, 0));
}

// [peer-copy]: initcheck cannot run it (tests/gpu/sanitize.sh says why); the other tools do.
TEST_CASE("copy between device buffers of two GPUs, both ways, with and without peer access",
          "[peer-copy]") {
  auto pools = per_device_resources::pools({}, {.devices = {0, 1}});
  constexpr std::size_t n = 8 * MiB / sizeof(int);
  stream s0{{.device = 0, .non_blocking = true}};
  stream s1{{.device = 1, .non_blocking = true}};
  const auto round_trip = [&](int tag) {
    device_buffer<int> a(n, tag, s0, pools.get(0));
    device_buffer<int> b(n, 0, s1, pools.get(1));
    s1.synchronize();
    copy(b, a, s0);  // device 0 -> device 1, on device 0's stream
    s0.synchronize();
    {
      const device_guard on{1};
      add_one<<<blocks_for(n), 256, 0, s1.get()>>>(b);
      check(cudaGetLastError());
    }
    copy(a, b, s0, s1);  // device 1 -> device 0, after device 1's kernel
    pinned_buffer<int> h(n);
    copy(h, a, s0);
    s0.synchronize();
    CHECK(device_of(a.data()) == 0);
    CHECK(device_of(b.data()) == 1);
    CHECK(count_equal(h, tag + 1) == n);
  };
  round_trip(10);  // whatever the peer state is (staged through the host when off)
  if (can_access_peer(0, 1) && can_access_peer(1, 0)) {
    peer_access ab{0, 1};
    peer_access ba{1, 0};
    round_trip(20);  // direct
  }
  // With a third "current" device: the copy does not depend on which device is current.
  const device_guard on{1};
  round_trip(30);
}

TEST_CASE("copy(dst, src, stream, after): a copy on device 0 waits for device 1's producer") {
  constexpr std::size_t n = 1 << 16;
  stream s0{{.device = 0, .non_blocking = true}};
  stream s1{{.device = 1, .non_blocking = true}};
  device_resource on_0{0};
  device_resource on_1{1};
  device_buffer<int> src(n, 1, s1, on_1);
  device_buffer<int> dst(n, 0, s0, on_0);
  s0.synchronize();
  s1.synchronize();
  {
    const device_guard on{1};
    late_fill<<<1, 1, 0, s1.get()>>>(src, 2, 100'000'000ULL);  // 2 after 100 ms
    check(cudaGetLastError());
  }
  const device_guard on{0};
  copy(dst, src, s0, s1);
  pinned_buffer<int> h(n);
  copy(h, dst, s0);
  s0.synchronize();
  CHECK(count_equal(h, 2) == n);
  s1.synchronize();
}

TEST_CASE("vm_pool memory of device 0 mapped for device 1: kernels on 1 use it, copy() moves it") {
  if (!can_access_peer(1, 0)) {
    vm_pool_options refused;
    refused.peers = {1};
    CHECK_THROWS_AS(vm_pool_resource(0, refused), std::invalid_argument);
    WARN("device 1 cannot access device 0: only the refusal is checked");
    return;
  }
  vm_pool_options options;
  options.peers = {1};
  vm_pool_resource shared{0, options};
  device_resource on_1{1};
  constexpr std::size_t n = 16 * MiB / sizeof(int);
  stream s0{{.device = 0, .non_blocking = true}};
  stream s1{{.device = 1, .non_blocking = true}};
  device_buffer<int> x(n, 5, s0, shared);  // physical memory on device 0
  CHECK(device_of(x.data()) == 0);
  s0.synchronize();
  {
    // No cudaDeviceEnablePeerAccess: cuMemSetAccess (the peers option) is what grants it.
    const device_guard on{1};
    add_one<<<blocks_for(n), 256, 0, s1.get()>>>(x);
    check(cudaGetLastError());
    s1.synchronize();
  }
  device_buffer<int> y(n, 0, s1, on_1);
  copy(y, x, s1);  // device 0's vm memory -> device 1
  pinned_buffer<int> h(n);
  copy(h, y, s1);
  s1.synchronize();
  CHECK(count_equal(h, 6) == n);
  // And with the guard for the cudaMalloc side, a kernel on device 0 reading y directly.
  if (can_access_peer(0, 1)) {
    peer_access reach{0, 1};
    const device_guard on{0};
    add_one<<<blocks_for(n), 256, 0, s0.get()>>>(y);
    check(cudaGetLastError());
    copy(x, y, s0);
    copy(h, x, s0);
    s0.synchronize();
    CHECK(count_equal(h, 7) == n);
  }
  s0.synchronize();
  s1.synchronize();
}

TEST_CASE("per_device_resources::vm_pools with every device as a peer of the others") {
  if (!can_access_peer(0, 1) || !can_access_peer(1, 0)) {
    WARN("no peer path between devices 0 and 1");
    return;
  }
  vm_pool_options options;
  options.peers = {0, 1};  // each device's own id is left out of its own list
  auto pools = per_device_resources::vm_pools(options, {.devices = {0, 1}});
  constexpr std::size_t n = 4 * MiB / sizeof(int);
  stream s1{{.device = 1, .non_blocking = true}};
  stream s0{{.device = 0, .non_blocking = true}};
  device_buffer<int> on_0(n, 1, s0, pools.get(0));
  s0.synchronize();
  {
    const device_guard on{1};
    add_one<<<blocks_for(n), 256, 0, s1.get()>>>(on_0);  // device 1 writes device 0's memory
    check(cudaGetLastError());
  }
  pinned_buffer<int> h(n);
  copy(h, on_0, s1);
  s1.synchronize();
  CHECK(count_equal(h, 2) == n);
}

TEST_CASE("a vm handle from another device than its descriptor says: ipc_error in the importer") {
  // Memory of device 1, described as device 0's: the importer (another process) finds out from
  // the imported handle itself (cuMemGetAllocationPropertiesFromHandle) and refuses it.
  vm_resource_options options;
  options.exportable = true;
  vm_resource on_1{1, options};
  void* p = on_1.allocate(64 * MiB);
  vm_block_export shared = export_block(on_1, p);
  shared.descriptor.device = detail::uuid_of(0);
  cudamem_test::child_process child{CUDAMEM_IPC_CHILD, {"vm-wrong-device"}};
  send_fds(child.socket(), shared.fd_numbers(), as_bytes_of(shared.descriptor));
  const auto r = receive_fds(child.socket(), 60'000).payload_as<cudamem_test::child_report>();
  CHECK(r.step == cudamem_test::step_checked);
  CHECK((r.passed & cudamem_test::check_other_device) != 0);
  CHECK(child.wait() == 0);
  on_1.deallocate(p, 64 * MiB);
}

// --- importers on the other GPU (ipc_pool.hpp, vm_ipc.hpp) ----------------------------------------

namespace {

using cudamem_test::child_process;
using cudamem_test::child_report;

constexpr std::size_t tolerance = 32 * MiB;  // what the driver's own bookkeeping may move

/// `device`'s free memory once everything submitted to it has finished.
std::size_t free_memory(int device) {
  const device_guard on{device};
  check(cudaDeviceSynchronize());
  return device_memory(device).free;
}

/// Polls until `device`'s free memory is back within `tolerance` of `baseline` (the driver tears
/// a finished or killed process's context down asynchronously); returns the last reading.
std::size_t wait_for_free_memory(int device, std::size_t baseline) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds{30};
  std::size_t now = free_memory(device);
  while (now + tolerance < baseline && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds{100});
    now = free_memory(device);
  }
  return now;
}

/// Both devices' free memory came back to `baseline` (see wait_for_free_memory).
void check_nothing_lost(const std::size_t (&baseline)[2]) {
  for (const int d : {0, 1}) {
    const std::size_t after = wait_for_free_memory(d, baseline[d]);
    INFO("device " << d << ": free before " << baseline[d] << ", after " << after);
    CHECK(after + tolerance >= baseline[d]);
  }
}

child_report read_report(const child_process& child) {
  return receive_fds(child.socket(), 60'000).payload_as<child_report>();
}

/// The pool and one pointer of it, sent to the child as an application would.
void send_pool_and_pointer(const child_process& child, const ipc_pool_resource& pool,
                           const void* p) {
  const ipc_pool_export shared = pool.export_pool();
  send_fds(child.socket(), {shared.fd.get()}, as_bytes_of(shared.descriptor));
  const ipc_pointer token = pool.export_pointer(p);
  send_fds(child.socket(), std::span<const int>{}, as_bytes_of(token));
}

/// The block at `p` of `vm`, sent to the child; our copies of its fds close on return.
void send_block(const child_process& child, const vm_resource& vm, const void* p) {
  const vm_block_export shared = export_block(vm, p);
  send_fds(child.socket(), shared.fd_numbers(), as_bytes_of(shared.descriptor));
}

std::size_t count_equal_at(const void* p, std::size_t count, int value) {
  std::vector<int> host(count);
  check(cudaMemcpy(host.data(), p, count * sizeof(int), cudaMemcpyDefault));
  return static_cast<std::size_t>(std::count(host.begin(), host.end(), value));
}

/// Where the memory lives, which device the importing process has current, and where its
/// kernel runs (another than the current one: passed in access_from).
struct import_case {
  int memory;
  int current;
  int kernel;
};

// The natural program first: the importer runs on the other GPU and asks for nothing. Then
// the same the other way round, and access_from adding a device beside the current one.
constexpr import_case import_cases[] = {{0, 1, 1}, {1, 0, 0}, {0, 0, 1}};

std::uint32_t bit(int device) { return 1u << device; }

/// What the child reports when its import is refused for want of a peer path (the devices
/// cannot reach each other): the error named both devices.
void check_refused(const child_report& r) {
  CHECK(r.step == cudamem_test::step_refused);
  CHECK((r.passed & cudamem_test::check_no_peer_path) != 0);
}

}  // namespace

TEST_CASE("ipc_pool: an importer on the other GPU gets access by itself; its kernel there "
          "reads and writes the memory") {
  constexpr std::size_t n = 64 * MiB / sizeof(int);
  for (const import_case& c : import_cases) {
    INFO("memory on device " << c.memory << ", importer's device " << c.current
                             << ", its kernel on device " << c.kernel);
    const std::size_t baseline[2] = {free_memory(0), free_memory(1)};
    const bool reachable = can_access_peer(c.current, c.memory) &&
                           can_access_peer(c.kernel, c.memory);
    {
      stream s{{.device = c.memory, .non_blocking = true}};
      ipc_pool_resource pool{{.device = c.memory}};
      device_buffer<int> x(n, 7, s, pool);
      s.synchronize();  // the importer must not see the memory before its fill is done
      child_process child{CUDAMEM_IPC_CHILD, {"pool-read", "7", std::to_string(c.current),
                                              std::to_string(c.kernel)}};
      send_pool_and_pointer(child, pool, x.data());
      const child_report r = read_report(child);
      CHECK(child.wait() == 0);  // and unmapped before exiting
      if (!reachable) {
        check_refused(r);
      } else {
        REQUIRE(r.step == cudamem_test::step_imported);
        CHECK(r.device == static_cast<std::uint32_t>(c.memory));
        CHECK(r.kernel_device == static_cast<std::uint32_t>(c.kernel));
        CHECK(r.access_devices == (bit(c.memory) | bit(c.current) | bit(c.kernel)));
        CHECK(r.good_elements == n);  // it read the 7s with its own device current
        // On the memory's device: copy() from a stream of device 1 with device 0 current
        // failed with cudaErrorInvalidValue on two H200s: this checks that it no longer does.
        const device_guard on{c.memory};
        pinned_buffer<int> h(n);
        copy(h, x, s);
        s.synchronize();
        CHECK(count_equal(h, 8) == n);  // its kernel on the other GPU added one everywhere
      }
    }  // x freed, the pool destroyed: its memory goes back to the device
    check_nothing_lost(baseline);
  }
}

TEST_CASE("ipc_pool: the importer on the other GPU killed mid-use (its kernel writing the "
          "memory); the data is the exporter's and nothing is lost") {
  if (!can_access_peer(1, 0)) {
    WARN("device 1 cannot reach device 0's memory: the refusal is checked by the case above");
    return;
  }
  constexpr std::size_t bytes = 256 * MiB;
  const std::size_t baseline[2] = {free_memory(0), free_memory(1)};
  {
    stream s{{.device = 0, .non_blocking = true}};
    ipc_pool_resource pool{{.device = 0}};
    device_buffer<int> x(bytes / sizeof(int), 1, s, pool);
    s.synchronize();
    child_process child{CUDAMEM_IPC_CHILD, {"pool-hold", "0", "1"}};
    send_pool_and_pointer(child, pool, x.data());
    const child_report r = read_report(child);
    REQUIRE(r.step == cudamem_test::step_busy);  // its kernel on device 1 writes our memory now
    CHECK(r.kernel_device == 1u);
    CHECK(r.access_devices == (bit(0) | bit(1)));
    CHECK(free_memory(0) + bytes <= baseline[0] + tolerance);  // really held
    CHECK(child.kill() == -SIGKILL);
    // Still ours, still usable, and no longer written: the child's death took its kernel.
    fill(x, 5, s);
    pinned_buffer<int> h(x.size());
    copy(h, x, s);
    s.synchronize();
    CHECK(count_equal(h, 5) == x.size());
  }
  check_nothing_lost(baseline);  // device 0: the pool; device 1: the child's context
}

TEST_CASE("vm_ipc: an importer on the other GPU gets access by itself; its kernel there reads "
          "and writes the block") {
  constexpr std::size_t count = 64 * MiB / sizeof(int);
  for (const import_case& c : import_cases) {
    INFO("memory on device " << c.memory << ", importer's device " << c.current
                             << ", its kernel on device " << c.kernel);
    const std::size_t baseline[2] = {free_memory(0), free_memory(1)};
    const bool reachable = can_access_peer(c.current, c.memory) &&
                           can_access_peer(c.kernel, c.memory);
    {
      vm_resource_options options;
      options.exportable = true;
      vm_resource vm{c.memory, options};
      // The block is reachable from its own device only: fill and read it with that current.
      const device_guard on{c.memory};
      void* p = vm.allocate(count * sizeof(int));
      std::vector<int> host(count, 7);
      check(cudaMemcpy(p, host.data(), count * sizeof(int), cudaMemcpyDefault));
      child_process child{CUDAMEM_IPC_CHILD, {"vm-read", "7", std::to_string(c.current),
                                              std::to_string(c.kernel)}};
      send_block(child, vm, p);
      const child_report r = read_report(child);
      CHECK(child.wait() == 0);
      if (!reachable) {
        check_refused(r);
      } else {
        REQUIRE(r.step == cudamem_test::step_imported);
        CHECK(r.device == static_cast<std::uint32_t>(c.memory));
        CHECK(r.kernel_device == static_cast<std::uint32_t>(c.kernel));
        CHECK(r.access_devices == (bit(c.memory) | bit(c.current) | bit(c.kernel)));
        CHECK(r.good_elements == count);
        CHECK(count_equal_at(p, count, 8) == count);
      }
      vm.deallocate(p, count * sizeof(int));
    }  // the vm_resource gives every handle back
    check_nothing_lost(baseline);
  }
}

TEST_CASE("vm_ipc: the importer on the other GPU killed mid-use (its kernel writing the "
          "block); the data is the exporter's and nothing is lost") {
  if (!can_access_peer(1, 0)) {
    WARN("device 1 cannot reach device 0's memory: the refusal is checked by the case above");
    return;
  }
  constexpr std::size_t count = 256 * MiB / sizeof(int);
  const std::size_t baseline[2] = {free_memory(0), free_memory(1)};
  {
    vm_resource_options options;
    options.exportable = true;
    vm_resource vm{0, options};
    void* p = vm.allocate(count * sizeof(int));
    check(cudaMemset(p, 0, count * sizeof(int)));
    child_process child{CUDAMEM_IPC_CHILD, {"vm-hold", "0", "1"}};
    send_block(child, vm, p);
    const child_report r = read_report(child);
    REQUIRE(r.step == cudamem_test::step_busy);
    CHECK(r.kernel_device == 1u);
    CHECK(r.access_devices == (bit(0) | bit(1)));
    CHECK(free_memory(0) + count * sizeof(int) <= baseline[0] + tolerance);
    CHECK(child.kill() == -SIGKILL);
    {
      const device_guard on{0};
      check(cudaMemset(p, 0, count * sizeof(int)));  // ours alone again, and no longer written
    }
    CHECK(count_equal_at(p, count, 0) == count);
    vm.deallocate(p, count * sizeof(int));
    CHECK(vm.release() >= count * sizeof(int));
  }
  check_nothing_lost(baseline);
}
