// Memory shared between processes, on one GPU or more (two processes on one device is the
// common case): the test is the exporter, a child process started from its own executable
// (tests/gpu/ipc_child, posix_spawn) is the importer. For CUDA memory pools (ipc_pool.hpp) and
// virtual memory (vm_ipc.hpp):
// - data written by either side is seen by the other, and each side's owners release;
// - the importer killed mid-use (a kernel of its running on the memory): the exporter frees,
//   and the device's free memory returns (cudaMemGetInfo, polled while the driver tears down
//   the dead process's context);
// - bad input on both sides (a pointer never exported, a closed fd, a device not visible,
//   a token of another pool, a descriptor that does not match its handles) gets a typed error.
#include <cudamem/device.hpp>
#include <cudamem/device_buffer.hpp>
#include <cudamem/fd_passing.hpp>
#include <cudamem/ipc_pool.hpp>
#include <cudamem/pinned_buffer.hpp>
#include <cudamem/copy.hpp>
#include <cudamem/stream.hpp>
#include <cudamem/vm_ipc.hpp>
#include <cudamem/vm_resource.hpp>

#include "child_process.hpp"

#include <fcntl.h>
#include "gpu_test.hpp"
#include "ipc_protocol.hpp"

#include <algorithm>
#include <chrono>
#include <string>
#include <vector>
#include <thread>

#ifndef CUDAMEM_IPC_CHILD
#error "CUDAMEM_IPC_CHILD must name the ipc_child executable (tests/CMakeLists.txt sets it)"
#endif

using namespace cudamem;
using namespace cudamem_test;

namespace {

constexpr std::size_t MiB = std::size_t{1} << 20;
constexpr int timeout_ms = 60'000;

std::size_t free_memory(int device) {
  const device_guard on{device};
  check(cudaDeviceSynchronize());
  return device_memory(device).free;
}

/// Polls until `device`'s free memory is back within `tolerance` of `baseline` (the driver
/// tears a dead process's context down asynchronously); returns the last reading.
std::size_t wait_for_free_memory(int device, std::size_t baseline, std::size_t tolerance) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds{30};
  std::size_t now = free_memory(device);
  while (now + tolerance < baseline && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds{100});
    now = free_memory(device);
  }
  return now;
}

std::size_t count_equal(const pinned_buffer<int>& h, int value) {
  std::size_t n = 0;
  for (const int v : h) {
    n += v == value ? 1 : 0;
  }
  return n;
}

child_report read_report(const child_process& child) {
  return receive_fds(child.socket(), timeout_ms).payload_as<child_report>();
}

/// Sends the pool and one pointer of it to the child, as an application would.
void send_pool_and_pointer(const child_process& child, const ipc_pool_resource& pool,
                           const void* p) {
  const ipc_pool_export shared = pool.export_pool();
  send_fds(child.socket(), {shared.fd.get()}, as_bytes_of(shared.descriptor));
  const ipc_pointer token = pool.export_pointer(p);
  send_fds(child.socket(), std::span<const int>{}, as_bytes_of(token));
}  // the exporter's copy of the pool's fd is closed here: the child has its own

constexpr std::size_t tolerance = 32 * MiB;

vm_resource_options exportable() {
  vm_resource_options o;
  o.exportable = true;
  return o;
}

/// A block of `count` ints of `vm`, set to `value`, ready (synchronised) for another process.
void* filled_block(vm_resource& vm, std::size_t count, int value) {
  void* p = vm.allocate(count * sizeof(int));
  std::vector<int> host(count, value);
  check(cudaMemcpy(p, host.data(), count * sizeof(int), cudaMemcpyDefault));
  return p;
}

std::size_t count_equal_at(const void* p, std::size_t count, int value) {
  std::vector<int> host(count);
  check(cudaMemcpy(host.data(), p, count * sizeof(int), cudaMemcpyDefault));
  return static_cast<std::size_t>(std::count(host.begin(), host.end(), value));
}

}  // namespace

TEST_CASE("ipc_pool_resource: allocates like a resource; bad exports are typed errors") {
  stream s;
  ipc_pool_resource pool;
  CHECK(pool.device() == current_device());
  CHECK(pool.name() == "ipc_pool_resource");
  device_buffer<int> x(1 << 20, 3, s, pool);
  CHECK(pool.stats().used_bytes == x.size_bytes());
  s.synchronize();  // the importer must not see the memory before its fill is done
  // A pointer before its pool: CUDA would say only "invalid argument" (the H100 run's one
  // failure was this order); export_pointer says what to do.
  CHECK_THROWS_AS(pool.export_pointer(x.data()), std::logic_error);
  const ipc_pool_export shared = pool.export_pool();
  CHECK(shared.fd);
  CHECK(shared.descriptor.pool_id == pool.descriptor().pool_id);
  const ipc_pointer token = pool.export_pointer(x.data());
  CHECK(token.bytes == x.size_bytes());
  CHECK(token.pool_id == pool.descriptor().pool_id);
  CHECK(pool.descriptor().device == detail::uuid_of(pool.device()));

  // A pointer the exporter never gave: inside an allocation, another resource's, freed.
  CHECK_THROWS_AS(pool.export_pointer(x.data() + 1), std::invalid_argument);
  device_buffer<int> elsewhere(16, s, get_current_resource());
  CHECK_THROWS_AS(pool.export_pointer(elsewhere.data()), std::invalid_argument);
  CHECK_THROWS_AS(pool.export_pointer(nullptr), std::invalid_argument);
  const void* freed = nullptr;
  {
    device_buffer<int> gone(16, s, pool);
    freed = gone.data();
  }
  CHECK_THROWS_AS(pool.export_pointer(freed), std::invalid_argument);
  // A free of a pointer it never gave is reported and ignored.
  captured_errors errors;
  pool.deallocate(elsewhere.data(), 64, default_alignment, s);
  CHECK(errors.messages().size() == 1);
  s.synchronize();
}

TEST_CASE("imported_pool: bad input in the importing process is a typed error") {
  ipc_pool_resource pool;
  const ipc_pool_export shared = pool.export_pool();
  CHECK_THROWS_AS(imported_pool(unique_fd{}, shared.descriptor), std::invalid_argument);
  ipc_pool_descriptor other_device = shared.descriptor;
  other_device.device[5] ^= 0x5a;
  CHECK_THROWS_AS(imported_pool(unique_fd{::dup(shared.fd.get())}, other_device), ipc_error);
  ipc_pool_descriptor future = shared.descriptor;
  future.version = 99;
  CHECK_THROWS_AS(imported_pool(unique_fd{::dup(shared.fd.get())}, future), ipc_error);
  CHECK_THROWS_AS(imported_pool(unique_fd{::dup(shared.fd.get())}, shared.descriptor,
                                {.access_from = {device_count()}}),
                  std::out_of_range);
  CHECK_THROWS_AS(imported_pool(unique_fd{::dup(shared.fd.get())}, shared.descriptor,
                                {.access_from = {-1}}),
                  std::out_of_range);
  CHECK(shared.fd);  // the exporter's copy is untouched by the failures
}

TEST_CASE("a pool allocation shared with another process: both see the other's writes") {
  const int device = current_device();
  stream s;
  const std::size_t baseline = free_memory(device);
  {
    ipc_pool_resource pool;
    device_buffer<int> x(64 * MiB / sizeof(int), 7, s, pool);
    s.synchronize();  // the child must not touch it before the allocation and fill are done
    child_process child{CUDAMEM_IPC_CHILD, {"pool-read", "7"}};
    send_pool_and_pointer(child, pool, x.data());
    const child_report r = read_report(child);
    CHECK(r.step == step_imported);
    CHECK(r.good_elements == x.size());  // the child saw the 7s
    CHECK(r.device == static_cast<std::uint32_t>(device));
    CHECK(r.kernel_device == static_cast<std::uint32_t>(device));
    CHECK(r.access_devices == 1u << device);  // its current device is the memory's: no more
    CHECK(child.wait() == 0);             // and unmapped before exiting
    pinned_buffer<int> h(x.size());
    copy(h, x, s);
    s.synchronize();
    CHECK(count_equal(h, 8) == x.size());  // we see its + 1
    CHECK(free_memory(device) + 64 * MiB <= baseline + tolerance);  // really held
  }  // x freed, then the pool destroyed: its memory goes back to the device
  const std::size_t after = wait_for_free_memory(device, baseline, tolerance);
  INFO("free before " << baseline << ", after " << after);
  CHECK(after + tolerance >= baseline);
}

TEST_CASE("the importer killed mid-use: the exporter frees and the memory returns") {
  const int device = current_device();
  stream s;
  const std::size_t baseline = free_memory(device);
  constexpr std::size_t bytes = 256 * MiB;
  {
    ipc_pool_resource pool;
    device_buffer<int> x(bytes / sizeof(int), 1, s, pool);
    s.synchronize();
    child_process child{CUDAMEM_IPC_CHILD, {"pool-hold"}};
    send_pool_and_pointer(child, pool, x.data());
    const child_report r = read_report(child);
    REQUIRE(r.step == step_busy);  // its kernel is writing our memory right now
    CHECK(free_memory(device) + bytes <= baseline + tolerance);
    CHECK(child.kill() == -SIGKILL);
    // Still ours, still usable: the child's death took only its own mapping.
    fill(x, 5, s);
    pinned_buffer<int> h(x.size());
    copy(h, x, s);
    s.synchronize();
    CHECK(count_equal(h, 5) == x.size());
  }  // freed, pool destroyed
  const std::size_t after = wait_for_free_memory(device, baseline, tolerance);
  INFO("free before " << baseline << ", after " << after << " (the child's context included)");
  CHECK(after + tolerance >= baseline);
}

TEST_CASE("bad input in the importing process, across processes", "[expected-api-error]") {
  stream s;
  ipc_pool_resource pool;
  device_buffer<int> x(MiB / sizeof(int), 2, s, pool);
  s.synchronize();
  child_process child{CUDAMEM_IPC_CHILD, {"pool-bad"}};
  send_pool_and_pointer(child, pool, x.data());
  const child_report r = read_report(child);
  CHECK(r.step == step_checked);
  CHECK((r.passed & check_closed_fd) != 0);
  CHECK((r.passed & check_other_device) != 0);
  CHECK((r.passed & check_other_pool) != 0);
  CHECK((r.passed & check_unknown_pointer) != 0);
  CHECK(r.good_elements == 1);  // the genuine token still imported
  CHECK(child.wait() == 0);
}

// --- virtual memory (vm_ipc.hpp) ------------------------------------------------------------------

TEST_CASE("export_block and imported_vm_block: bad input is a typed error, before any import") {
  vm_resource plain{-1};
  void* q = plain.allocate(64 * MiB);
  CHECK_THROWS_AS(export_block(plain, q), std::invalid_argument);  // not exportable
  plain.deallocate(q, 64 * MiB);

  vm_resource vm{-1, exportable()};
  void* p = filled_block(vm, 96 * MiB / sizeof(int), 1);
  int on_the_stack = 0;
  CHECK_THROWS_AS(export_block(vm, &on_the_stack), std::invalid_argument);  // never given
  CHECK_THROWS_AS(export_block(vm, static_cast<char*>(p) + 2 * MiB), std::invalid_argument);
  const vm_block_export shared = export_block(vm, p);
  const vm_block_handles handles = vm.block_handles(p);
  REQUIRE(shared.fds.size() == handles.handles.size());
  CHECK(shared.descriptor.handle_count == handles.handles.size());
  CHECK(shared.descriptor.bytes == 96 * MiB);
  CHECK(shared.descriptor.offset == handles.offset);
  CHECK(shared.descriptor.granularity == vm.granularity());
  CHECK(shared.descriptor.device == detail::uuid_of(vm.device()));
  for (const unique_fd& fd : shared.fds) {
    CHECK(fd);
  }
  const auto copies = [&] {
    std::vector<unique_fd> out;
    for (const unique_fd& fd : shared.fds) {
      out.emplace_back(::dup(fd.get()));
    }
    return out;
  };
  vm_block_descriptor d = shared.descriptor;
  d.version = 7;
  CHECK_THROWS_AS(imported_vm_block(copies(), d), ipc_error);
  d = shared.descriptor;
  d.handle_count += 1;
  CHECK_THROWS_AS(imported_vm_block(copies(), d), ipc_error);  // more handles than fds
  d = shared.descriptor;
  d.offset = 1ull << 40;
  CHECK_THROWS_AS(imported_vm_block(copies(), d), ipc_error);  // does not fit its handles
  d = shared.descriptor;
  d.handle_bytes[0] += 1;
  CHECK_THROWS_AS(imported_vm_block(copies(), d), ipc_error);  // not a granule multiple
  d = shared.descriptor;
  d.device[3] ^= 0x33;
  CHECK_THROWS_AS(imported_vm_block(copies(), d), ipc_error);  // a device not visible here
  for (const int bad_id : {-1, device_count()}) {
    CHECK_THROWS_AS(imported_vm_block(copies(), shared.descriptor, {.access_from = {bad_id}}),
                    std::out_of_range);
  }
  std::vector<unique_fd> with_closed = copies();
  int closed = 900;
  while (::fcntl(closed, F_GETFD) != -1) {
    ++closed;  // a number that is not open
  }
  with_closed.back().reset(closed);
  CHECK_THROWS_AS(imported_vm_block(std::move(with_closed), shared.descriptor),
                  std::invalid_argument);
  vm.deallocate(p, 96 * MiB);
  CHECK_THROWS_AS(export_block(vm, p), std::invalid_argument);  // freed
}

TEST_CASE("a vm block shared with another process: both see the other's writes") {
  const int device = current_device();
  const std::size_t baseline = free_memory(device);
  constexpr std::size_t count = 64 * MiB / sizeof(int);
  {
    vm_resource vm{-1, exportable()};
    void* p = filled_block(vm, count, 7);
    child_process child{CUDAMEM_IPC_CHILD, {"vm-read", "7"}};
    {
      const vm_block_export shared = export_block(vm, p);
      send_fds(child.socket(), shared.fd_numbers(), as_bytes_of(shared.descriptor));
    }  // our copies of the fds closed: the child has its own
    const child_report r = read_report(child);
    CHECK(r.step == step_imported);
    CHECK(r.good_elements == count);
    CHECK(r.device == static_cast<std::uint32_t>(device));
    CHECK(r.kernel_device == static_cast<std::uint32_t>(device));
    CHECK(r.access_devices == 1u << device);
    CHECK(child.wait() == 0);
    CHECK(count_equal_at(p, count, 8) == count);
    vm.deallocate(p, count * sizeof(int));
  }  // the vm_resource gives every handle back
  const std::size_t after = wait_for_free_memory(device, baseline, tolerance);
  INFO("free before " << baseline << ", after " << after);
  CHECK(after + tolerance >= baseline);
}

TEST_CASE("the vm importer killed mid-use: the exporter frees and the memory returns") {
  const int device = current_device();
  const std::size_t baseline = free_memory(device);
  constexpr std::size_t count = 256 * MiB / sizeof(int);
  {
    vm_resource vm{-1, exportable()};
    void* p = filled_block(vm, count, 1);
    child_process child{CUDAMEM_IPC_CHILD, {"vm-hold"}};
    {
      const vm_block_export shared = export_block(vm, p);
      send_fds(child.socket(), shared.fd_numbers(), as_bytes_of(shared.descriptor));
    }
    REQUIRE(read_report(child).step == step_busy);
    CHECK(free_memory(device) + count * sizeof(int) <= baseline + tolerance);
    CHECK(child.kill() == -SIGKILL);
    check(cudaMemset(p, 0, count * sizeof(int)));  // ours alone again
    CHECK(count_equal_at(p, count, 0) == count);
    vm.deallocate(p, count * sizeof(int));
    CHECK(vm.release() >= count * sizeof(int));
  }
  const std::size_t after = wait_for_free_memory(device, baseline, tolerance);
  INFO("free before " << baseline << ", after " << after << " (the child's context included)");
  CHECK(after + tolerance >= baseline);
}

TEST_CASE("the vm exporter dies first: the importer's mapping keeps the memory, then frees it") {
  const int device = current_device();
  const std::size_t baseline = free_memory(device);
  child_process child{CUDAMEM_IPC_CHILD, {"vm-export", "9"}};
  received_fds shared = receive_fds(child.socket(), timeout_ms);
  const auto descriptor = shared.payload_as<vm_block_descriptor>();
  const child_report r = read_report(child);
  REQUIRE(r.step == step_exported);
  {
    imported_vm_block block{std::move(shared.fds), descriptor};
    const std::size_t count = block.bytes() / sizeof(int);
    CHECK(count == r.good_elements);
    CHECK(count_equal_at(block.get(), count, 9) == count);
    CHECK(child.kill() == -SIGKILL);  // the exporter is gone; its pages are still mapped here
    CHECK(count_equal_at(block.get(), count, 9) == count);
    check(cudaMemset(block.get(), 0, block.bytes()));
    CHECK(count_equal_at(block.get(), count, 0) == count);
    CHECK(free_memory(device) + block.bytes() <= baseline + tolerance);  // held by us alone
  }  // unmapped and released: the last reference
  const std::size_t after = wait_for_free_memory(device, baseline, tolerance);
  INFO("free before " << baseline << ", after " << after);
  CHECK(after + tolerance >= baseline);
}

TEST_CASE("bad vm input in the importing process, across processes") {
  constexpr std::size_t count = 64 * MiB / sizeof(int);
  vm_resource vm{-1, exportable()};
  void* p = filled_block(vm, count, 4);
  child_process child{CUDAMEM_IPC_CHILD, {"vm-bad", "4"}};
  {
    const vm_block_export shared = export_block(vm, p);
    send_fds(child.socket(), shared.fd_numbers(), as_bytes_of(shared.descriptor));
  }
  const child_report r = read_report(child);
  CHECK(r.step == step_checked);
  CHECK((r.passed & check_closed_fd) != 0);
  CHECK((r.passed & check_other_device) != 0);
  CHECK((r.passed & check_mismatch) != 0);
  CHECK(r.good_elements == 1);  // the genuine descriptor still maps, with the right data
  CHECK(child.wait() == 0);
  vm.deallocate(p, count * sizeof(int));
}
