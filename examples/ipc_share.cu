// ipc_share — a producer process and a consumer process sharing one device buffer (Linux).
//
//   ./run example ipc_share
//
// The producer allocates from an ipc_pool_resource (a CUDA pool whose memory other processes
// may map), fills the buffer, and hands the pool and the pointer to a consumer process over a
// Unix socket (the pool travels as a file descriptor: fd_passing.hpp). The consumer imports
// it, checks it, adds one to every element, and exits; the producer reads the consumer's
// result from its own buffer. Then a second consumer is killed in the middle of using the
// buffer (a crashed worker), and the producer frees and gets its memory back anyway.
//
// The failure it avoids: memory shared between processes has two owners, and raw CUDA leaves
// the release order to you. An importer that forgets its cudaFree / cudaIpcCloseMemHandle
// keeps the exporter's memory mapped after the exporter is done with it — device memory held
// by "no process" in nvidia-smi until the importer exits; an exporter that frees first pulls
// memory from under a running kernel. Here both sides are owners: imported_pointer unmaps and
// imported_pool closes the import in their destructors (on every path, exceptions included),
// the producer frees only after the consumer has said "done" or is gone, and the device's free
// memory is measured to come back.
//
// The consumer is this same program started again (posix_spawn of /proc/self/exe, with the
// socket as fd 3): a fresh process image in which CUDA starts clean — never a fork of a
// process that has already initialised CUDA.
#include <cudamem/cudamem.hpp>

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

extern char** environ;

namespace {

constexpr int consumer_socket = 3;
constexpr std::size_t n = std::size_t{1} << 24;  // 64 MiB of ints

struct consumer_report {
  std::uint64_t matching = 0;  ///< elements that held the producer's value
};

__global__ void add_one(cudamem::device_span<int> x) {
  const std::size_t i = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x;
  if (i < x.size()) {
    x[i] += 1;
  }
}

__global__ void keep_reading(cudamem::device_span<int> x, unsigned long long* sink) {
  unsigned long long sum = 0;
  for (;;) {  // until the process is killed
    for (std::size_t i = threadIdx.x; i < x.size(); i += blockDim.x) {
      sum += static_cast<unsigned long long>(x[i]);
    }
    if (sum == 42) {
      *sink = sum;  // never true in practice; keeps the loop from being optimised away
    }
  }
}

std::size_t free_memory() {
  cudamem::check(cudaDeviceSynchronize());
  return cudamem::device_memory().free;
}

std::string mib(std::size_t bytes) { return std::to_string(bytes >> 20) + " MiB"; }

/// The consumer process: import, check, add one (or, `hold`, read until killed).
int consume(bool hold) {
  cudamem::received_fds pool_message = cudamem::receive_fds(consumer_socket, 60'000);
  const auto token = cudamem::receive_fds(consumer_socket, 60'000).payload_as<cudamem::ipc_pointer>();
  cudamem::imported_pool pool{std::move(pool_message.fds.at(0)),
                              pool_message.payload_as<cudamem::ipc_pool_descriptor>()};
  cudamem::imported_pointer shared = pool.import(token);  // the producer's memory, mapped here
  const cudamem::device_guard on{shared.device()};
  const auto x = shared.span<int>();
  if (hold) {
    cudamem::device_buffer<unsigned long long> sink(1);
    keep_reading<<<1, 256>>>(x, sink.data());
    cudamem::check(cudaGetLastError(), "launching keep_reading");
    cudamem::send_fds(consumer_socket, std::span<const int>{},
                      cudamem::as_bytes_of(consumer_report{}));
    for (;;) {
      ::pause();  // killed here, mid-use, by the producer
    }
  }
  std::vector<int> host(x.size());
  cudamem::check(cudaMemcpy(host.data(), x.data(), x.size_bytes(), cudaMemcpyDefault));
  consumer_report report;
  for (const int v : host) {
    report.matching += v == 7 ? 1 : 0;
  }
  add_one<<<static_cast<unsigned>((x.size() + 255) / 256), 256>>>(x);
  cudamem::check(cudaGetLastError(), "launching add_one");
  cudamem::check(cudaDeviceSynchronize());
  cudamem::send_fds(consumer_socket, std::span<const int>{}, cudamem::as_bytes_of(report));
  return 0;  // `shared` unmaps, `pool` closes the import: nothing stays mapped
}

/// Starts this program again as a consumer; returns its pid and our end of the socket.
std::pair<pid_t, cudamem::unique_fd> start_consumer(const char* role) {
  auto [ours, theirs] = cudamem::socket_pair();
  cudamem::unique_fd source{::fcntl(theirs.get(), F_DUPFD_CLOEXEC, 10)};  // never fd 3 itself
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, source.get(), consumer_socket);
  std::string self = "/proc/self/exe";
  std::string mode = role;
  char* argv[] = {self.data(), mode.data(), nullptr};
  pid_t pid = -1;
  const int error = ::posix_spawn(&pid, self.c_str(), &actions, nullptr, argv, environ);
  posix_spawn_file_actions_destroy(&actions);
  if (error != 0) {
    throw std::runtime_error("posix_spawn: " + std::string(std::strerror(error)));
  }
  return {pid, std::move(ours)};
}

/// Hands the pool and one pointer of it to the consumer on `socket`.
void share(int socket, const cudamem::ipc_pool_resource& pool, const void* p) {
  const cudamem::ipc_pool_export exported = pool.export_pool();
  cudamem::send_fds(socket, {exported.fd.get()}, cudamem::as_bytes_of(exported.descriptor));
  cudamem::send_fds(socket, std::span<const int>{}, cudamem::as_bytes_of(pool.export_pointer(p)));
}

/// Waits until free memory is within 32 MiB of `baseline` (the driver tears a dead process's
/// context down in the background), at most 30 s.
bool memory_back(std::size_t baseline, std::size_t& now) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds{30};
  for (;;) {
    now = free_memory();
    if (now + (std::size_t{32} << 20) >= baseline) {
      return true;
    }
    if (std::chrono::steady_clock::now() > deadline) {
      return false;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds{100});
  }
}

int produce() {
  std::printf("producer: device 0: %s\n", cudamem::get_device_properties(0).name.c_str());
  const std::size_t baseline = free_memory();
  std::uint64_t consumer_saw = 0;
  std::size_t producer_saw = 0;
  {
    cudamem::stream s;
    cudamem::ipc_pool_resource pool;
    cudamem::device_buffer<int> x(n, 7, s, pool);
    s.synchronize();  // the consumer must not run ahead of the allocation and the fill
    auto [pid, socket] = start_consumer("--consumer");
    share(socket.get(), pool, x.data());
    consumer_saw = cudamem::receive_fds(socket.get(), 60'000).payload_as<consumer_report>().matching;
    int status = 0;
    ::waitpid(pid, &status, 0);  // gone, and its import with it: now x may be freed
    std::vector<int> host(n);
    cudamem::copy(host, x, s);
    for (const int v : host) {
      producer_saw += v == 8 ? 1 : 0;
    }
    std::printf("consumer: read %llu of %zu sevens; producer: read back %zu of %zu eights\n",
                static_cast<unsigned long long>(consumer_saw), n, producer_saw, n);
  }  // x freed, the pool destroyed
  std::size_t now = 0;
  const bool back_after_clean_exit = memory_back(baseline, now);
  std::printf("after a consumer that exited: free %s before, %s after\n", mib(baseline).c_str(),
              mib(now).c_str());

  bool killed = false;
  {
    cudamem::stream s;
    cudamem::ipc_pool_resource pool;
    cudamem::device_buffer<int> x(n, 7, s, pool);
    s.synchronize();
    auto [pid, socket] = start_consumer("--consumer-killed");
    share(socket.get(), pool, x.data());
    static_cast<void>(cudamem::receive_fds(socket.get(), 60'000));  // its kernel is running
    ::kill(pid, SIGKILL);
    int status = 0;
    ::waitpid(pid, &status, 0);
    killed = WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL;
  }  // freed anyway
  const bool back_after_kill = memory_back(baseline, now);
  std::printf("after a consumer killed mid-use (%s): free %s before, %s after\n",
              killed ? "SIGKILL" : "not killed?", mib(baseline).c_str(), mib(now).c_str());

  const bool ok = consumer_saw == n && producer_saw == n;
  std::printf("ipc_share: consumer read %llu of %zu, producer read back %zu of %zu, memory back "
              "after exit: %s, after a kill: %s\n",
              static_cast<unsigned long long>(consumer_saw), n, producer_saw, n,
              back_after_clean_exit ? "yes" : "no", back_after_kill ? "yes" : "no");
  return ok && back_after_clean_exit && back_after_kill && killed ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) try {
  const std::string role = argc > 1 ? argv[1] : "";
  if (role == "--consumer" || role == "--consumer-killed") {
    return consume(role == "--consumer-killed");
  }
  if (cudamem::device_count() == 0) {
    throw cudamem::no_device_error(cudaErrorNoDevice, "ipc_share");
  }
  return produce();
} catch (const cudamem::no_device_error& e) {
  std::printf("ipc_share: no usable CUDA device here (%s), nothing to run\n", e.name());
  return 69;
} catch (const std::exception& e) {
  std::fprintf(stderr, "ipc_share failed: %s\n", e.what());
  return 1;
}
