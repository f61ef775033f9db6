// The other process of test_ipc.cu: started by the test (posix_spawn, a fresh image: CUDA
// starts clean here), its end of a Unix socket on fd 3. One role per run:
//
//   ipc_child pool-read VALUE   import a pool allocation, count the elements equal to VALUE,
//                               add one to each, report, exit (its owners unmap)
//   ipc_child pool-hold         import, start a kernel that keeps writing the memory, report
//                               "busy", then wait to be killed
//   ipc_child pool-bad          feed the importer bad input, report which checks behaved
//
// (and the same three for vm memory: vm-read, vm-hold, vm-bad; vm-export VALUE, which exports
// memory of its own to the parent and waits to be killed; and vm-wrong-device, for
// test_two_gpus: a descriptor naming another device than its handles'). Exit 0 when the role ran to
// its end; anything else prints one line to stderr and exits non-zero.
//
// The read and hold roles take two more arguments, for importers on any GPU (test_two_gpus):
//   ipc_child pool-read VALUE CURRENT [KERNEL]   (pool-hold, vm-read, vm-hold the same)
// CURRENT is made the current device before the import, as a process that runs on that GPU
// has it; the kernel runs on KERNEL (default CURRENT), which the import lists in access_from
// when it is another. Nothing else is asked: the import must give CURRENT access by itself.
// An import refused for want of a peer path reports step_refused (with check_no_peer_path when
// the error names both devices) and exits 0.
#include <cudamem/device.hpp>
#include <cudamem/device_span.hpp>
#include <cudamem/error.hpp>
#include <cudamem/fd_passing.hpp>
#include <cudamem/ipc_pool.hpp>
#include <cudamem/vm_ipc.hpp>
#include <cudamem/vm_resource.hpp>

#include "ipc_protocol.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

using namespace cudamem;
using namespace cudamem_test;

namespace {

constexpr int socket_fd = 3;
constexpr int timeout_ms = 60'000;

__global__ void add_one(device_span<int> x) {
  const std::size_t i = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x;
  if (i < x.size()) {
    x[i] += 1;
  }
}

/// Keeps writing `x` for up to `ns` (the parent kills the process long before).
__global__ void keep_writing(device_span<int> x, unsigned long long ns) {
  unsigned long long start = 0;
  unsigned long long now = 0;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
  do {
    for (std::size_t i = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x; i < x.size();
         i += std::size_t{gridDim.x} * blockDim.x) {
      x[i] = x[i] + 1;
    }
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  } while (now - start < ns);
}

std::uint64_t count_equal(device_span<int> x, int value) {
  std::vector<int> host(x.size());
  check(cudaMemcpy(host.data(), x.data(), x.size() * sizeof(int), cudaMemcpyDefault),
        "cudaMemcpy from the imported memory");
  std::uint64_t n = 0;
  for (const int v : host) {
    n += v == value ? 1 : 0;
  }
  return n;
}

void report(const child_report& r) { send_fds(socket_fd, std::span<const int>{}, as_bytes_of(r)); }

/// Where the read and hold roles run (see the header): the device made current before the
/// import (-1: leave it) and the one the kernel runs on (-1: the current one).
struct placement {
  int current = -1;
  int kernel = -1;
};

/// Makes `where.current` current and fills in the kernel's device; the access_from the import
/// needs for it (the kernel's device when it is not the current one).
std::vector<int> take_place(placement& where) {
  if (where.current >= 0) {
    check(cudaSetDevice(where.current), "cudaSetDevice (the importer's GPU)");
  }
  where.current = current_device();
  if (where.kernel < 0) {
    where.kernel = where.current;
  }
  return where.kernel != where.current ? std::vector<int>{where.kernel} : std::vector<int>{};
}

/// One bit per device in `devices`.
std::uint32_t bits_of(const std::vector<int>& devices) {
  std::uint32_t bits = 0;
  for (const int d : devices) {
    bits |= 1u << d;
  }
  return bits;
}

/// The report of an import refused with `e`: whether its message names both devices.
child_report refused(const ipc_error& e, int memory_device, const placement& where) {
  const std::string text = e.what();
  const bool both = text.find("device " + std::to_string(where.current)) != std::string::npos &&
                    text.find("device " + std::to_string(memory_device)) != std::string::npos &&
                    text.find("no peer path") != std::string::npos;
  return {step_refused, 0, both ? check_no_peer_path : 0u,
          static_cast<std::uint32_t>(memory_device), 0, 0};
}

/// A descriptor number that is not open in this process.
int closed_fd() {
  for (int fd = 900;; ++fd) {
    if (::fcntl(fd, F_GETFD) == -1) {
      return fd;
    }
  }
}

/// Starts keep_writing on the memory (a kernel on `kernel_device`), waits until it runs,
/// reports busy, waits for SIGKILL.
[[noreturn]] void hold(device_span<int> x, int device, int kernel_device, std::uint32_t access) {
  const device_guard on{kernel_device};
  cudaStream_t s = nullptr;
  check(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreate");
  keep_writing<<<64, 256, 0, s>>>(x, 120'000'000'000ULL);  // 120 s
  check(cudaGetLastError(), "launching keep_writing");
  if (cudaStreamQuery(s) != cudaErrorNotReady) {
    std::fprintf(stderr, "ipc_child: the holding kernel is not running\n");
    std::exit(12);
  }
  static_cast<void>(cudaGetLastError());
  report({step_busy, 0, 0, static_cast<std::uint32_t>(device),
          static_cast<std::uint32_t>(kernel_device), access});
  for (;;) {
    ::pause();  // until the parent kills us, mid-use
  }
}

// --- memory pools ------------------------------------------------------------------------------

/// Adds one to every element with a kernel on `kernel_device`, and waits for it.
void add_one_on(device_span<int> x, int kernel_device) {
  const device_guard on{kernel_device};
  add_one<<<static_cast<unsigned>((x.size() + 255) / 256), 256>>>(x);
  check(cudaGetLastError(), "launching add_one");
  check(cudaDeviceSynchronize(), "add_one");
}

int pool_role(const std::string& role, int value, placement where) {
  received_fds shared = receive_fds(socket_fd, timeout_ms);
  if (shared.fds.size() != 1) {
    std::fprintf(stderr, "ipc_child: expected one pool descriptor, got %zu\n", shared.fds.size());
    return 11;
  }
  const auto descriptor = shared.payload_as<ipc_pool_descriptor>();
  const auto token = receive_fds(socket_fd, timeout_ms).payload_as<ipc_pointer>();

  if (role == "pool-bad") {
    std::uint32_t passed = 0;
    try {
      imported_pool bad{unique_fd{closed_fd()}, descriptor};
    } catch (const ipc_error&) {
      // the wrong error: a closed fd is not an ipc mismatch
    } catch (const std::invalid_argument&) {
      passed |= check_closed_fd;
    }
    try {
      ipc_pool_descriptor elsewhere = descriptor;
      elsewhere.device[0] ^= 0xff;  // a device this process does not have
      imported_pool bad{unique_fd{::fcntl(shared.fds[0].get(), F_DUPFD_CLOEXEC, 0)}, elsewhere};
    } catch (const ipc_error&) {
      passed |= check_other_device;
    }
    imported_pool pool{std::move(shared.fds[0]), descriptor};
    try {
      ipc_pointer other = token;
      other.pool_id ^= 1;
      static_cast<void>(pool.import(other));
    } catch (const ipc_error&) {
      passed |= check_other_pool;
    }
    try {
      ipc_pointer unknown = token;
      std::memset(&unknown.data, 0x5a, sizeof unknown.data);
      static_cast<void>(pool.import(unknown));
    } catch (const cuda_error&) {
      passed |= check_unknown_pointer;
    }
    const imported_pointer good = pool.import(token);  // the real one still works
    report({step_checked, good ? 1u : 0u, passed, static_cast<std::uint32_t>(pool.device())});
    return 0;
  }

  imported_pool_options options;
  options.access_from = take_place(where);
  std::optional<imported_pool> imported;
  try {
    imported.emplace(std::move(shared.fds[0]), descriptor, options);
  } catch (const ipc_error& e) {
    const std::optional<int> memory_device = detail::device_with_uuid(descriptor.device);
    report(refused(e, memory_device.value_or(-1), where));
    return 0;
  }
  imported_pool& pool = *imported;
  imported_pointer p = pool.import(token);
  const device_span<int> x = p.span<int>();
  const std::uint32_t access = bits_of(pool.access_devices());
  if (role == "pool-hold") {
    hold(x, p.device(), where.kernel, access);
  }
  const std::uint64_t good = count_equal(x, value);  // read with the importer's device current
  add_one_on(x, where.kernel);
  report({step_imported, good, 0, static_cast<std::uint32_t>(p.device()),
          static_cast<std::uint32_t>(where.kernel), access});
  return 0;  // p, then pool: unmapped, import closed
}

// --- virtual memory -----------------------------------------------------------------------------

/// A descriptor number that is open, for the checks that must get past "is it open".
unique_fd dup_of(const unique_fd& fd) { return unique_fd{::fcntl(fd.get(), F_DUPFD_CLOEXEC, 0)}; }

int vm_role(const std::string& role, int value, placement where) {
  if (role == "vm-export") {
    // The exporter this time: a block of our own, filled with VALUE, sent to the parent; then
    // we wait to be killed (the exporter dying first).
    vm_resource_options options;
    options.exportable = true;
    vm_resource vm{-1, options};
    constexpr std::size_t bytes = std::size_t{256} << 20;
    void* p = vm.allocate(bytes);
    const device_span<int> x{static_cast<int*>(p), bytes / sizeof(int)};
    std::vector<int> host(x.size(), value);
    check(cudaMemcpy(p, host.data(), bytes, cudaMemcpyDefault), "filling the exported block");
    const vm_block_export shared = export_block(vm, p);
    send_fds(socket_fd, shared.fd_numbers(), as_bytes_of(shared.descriptor));
    report({step_exported, x.size(), 0, static_cast<std::uint32_t>(vm.device())});
    for (;;) {
      ::pause();  // the parent kills us while it still maps the block
    }
  }
  received_fds shared = receive_fds(socket_fd, timeout_ms);
  const auto descriptor = shared.payload_as<vm_block_descriptor>();
  if (role == "vm-wrong-device") {
    // The descriptor names another device than the one the handles live on (test_two_gpus).
    std::uint32_t passed = 0;
    try {
      imported_vm_block bad{std::move(shared.fds), descriptor};
    } catch (const ipc_error& e) {
      passed |= std::string(e.what()).find("another device") != std::string::npos ? check_other_device : 0u;
    }
    report({step_checked, 0, passed, 0});
    return 0;
  }
  if (role == "vm-bad") {
    std::uint32_t passed = 0;
    try {
      vm_block_descriptor one = descriptor;
      one.handle_count = 1;
      std::vector<unique_fd> closed;
      closed.emplace_back(closed_fd());
      imported_vm_block bad{std::move(closed), one};
    } catch (const ipc_error&) {
      // the wrong error
    } catch (const std::invalid_argument&) {
      passed |= check_closed_fd;
    }
    try {
      vm_block_descriptor elsewhere = descriptor;
      elsewhere.device[0] ^= 0xff;
      std::vector<unique_fd> copies;
      for (const unique_fd& fd : shared.fds) {
        copies.push_back(dup_of(fd));
      }
      imported_vm_block bad{std::move(copies), elsewhere};
    } catch (const ipc_error&) {
      passed |= check_other_device;
    }
    try {
      vm_block_descriptor more = descriptor;
      more.handle_count += 1;  // one handle more than came with it
      more.handle_bytes[more.handle_count - 1] = more.handle_bytes[0];
      std::vector<unique_fd> copies;
      for (const unique_fd& fd : shared.fds) {
        copies.push_back(dup_of(fd));
      }
      imported_vm_block bad{std::move(copies), more};
    } catch (const ipc_error&) {
      passed |= check_mismatch;
    }
    const imported_vm_block good{std::move(shared.fds), descriptor};  // the real one maps
    report({step_checked, count_equal(good.span<int>(), value) == good.span<int>().size() ? 1u : 0u,
            passed, static_cast<std::uint32_t>(good.device())});
    return 0;
  }
  imported_vm_options options;
  options.access_from = take_place(where);
  std::optional<imported_vm_block> imported;
  try {
    imported.emplace(std::move(shared.fds), descriptor, options);
  } catch (const ipc_error& e) {
    const std::optional<int> memory_device = detail::device_with_uuid(descriptor.device);
    report(refused(e, memory_device.value_or(-1), where));
    return 0;
  }
  const imported_vm_block& block = *imported;
  const device_span<int> x = block.span<int>();
  const std::uint32_t access = bits_of(block.access_devices());
  if (role == "vm-hold") {
    hold(x, block.device(), where.kernel, access);
  }
  const std::uint64_t good = count_equal(x, value);  // read with the importer's device current
  add_one_on(x, where.kernel);
  report({step_imported, good, 0, static_cast<std::uint32_t>(block.device()),
          static_cast<std::uint32_t>(where.kernel), access});
  return 0;  // block: unmapped, handles released
}

}  // namespace

int main(int argc, char** argv) {
  const std::string role = argc > 1 ? argv[1] : "";
  const int value = argc > 2 ? std::atoi(argv[2]) : 0;
  placement where;
  where.current = argc > 3 ? std::atoi(argv[3]) : -1;
  where.kernel = argc > 4 ? std::atoi(argv[4]) : -1;
  try {
    if (::fcntl(socket_fd, F_GETFD) == -1) {
      std::fprintf(stderr, "ipc_child: no socket on fd %d (start it from test_ipc)\n", socket_fd);
      return 2;
    }
    if (role.rfind("pool-", 0) == 0) {
      return pool_role(role, value, where);
    }
    if (role.rfind("vm-", 0) == 0) {
      return vm_role(role, value, where);
    }
    std::fprintf(stderr, "ipc_child: unknown role '%s'\n", role.c_str());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ipc_child %s: %s\n", role.c_str(), e.what());
    return 20;
  }
}
