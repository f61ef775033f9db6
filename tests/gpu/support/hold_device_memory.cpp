// A process that holds a known amount of device memory until told to let go: the "other
// process" of tests/gpu/test_process_report.cpp, which starts it (posix_spawn, not fork: the
// test process has CUDA initialised).
//
//   cudamem_hold_device_memory BYTES [DEVICE]
//
// Allocates BYTES on DEVICE (default 0; CUDA_VISIBLE_DEVICES is inherited, so it is the same
// GPU as the parent's device 0), writes them, prints "ready PID BYTES" on stdout, then waits
// until its stdin reaches end of file (the parent closes its end, or dies), frees and exits 0.
// Exit 1 with a message on stderr if it cannot allocate.
#include <cuda_runtime_api.h>

#include <cstdio>
#include <cstdlib>
#include <string>

#include <unistd.h>

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: cudamem_hold_device_memory BYTES [DEVICE]\n");
    return 2;
  }
  const std::size_t bytes = std::strtoull(argv[1], nullptr, 10);
  const int device = argc > 2 ? std::atoi(argv[2]) : 0;
  void* p = nullptr;
  cudaError_t code = cudaSetDevice(device);
  if (code == cudaSuccess) {
    code = cudaMalloc(&p, bytes);
  }
  if (code == cudaSuccess) {
    code = cudaMemset(p, 0x5A, bytes);  // touched: resident, whatever the driver defers
  }
  if (code == cudaSuccess) {
    code = cudaDeviceSynchronize();
  }
  if (code != cudaSuccess) {
    std::fprintf(stderr, "cudamem_hold_device_memory: %s\n", cudaGetErrorString(code));
    return 1;
  }
  std::printf("ready %ld %zu\n", static_cast<long>(getpid()), bytes);
  std::fflush(stdout);
  char buffer[64];
  while (read(STDIN_FILENO, buffer, sizeof buffer) > 0) {  // until end of file
  }
  return cudaFree(p) == cudaSuccess ? 0 : 1;
}
