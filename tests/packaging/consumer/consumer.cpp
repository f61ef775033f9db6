// The host-compiler consumer: plain C++ (g++) that uses the CUDA runtime through cudamem.
// On a machine with a GPU it creates a stream, takes a block from a pool and from a vm_pool, and
// prints "consumer_cpp: OK ..."; on one without, it prints the no-device message and exits 69
// (EX_UNAVAILABLE). Anything else is a failure. Built a second time as consumer_compiled, over
// cudamem::compiled (compiled mode), where cudamem is part of the consumer's build.
#include <cudamem/cudamem.hpp>

#ifndef CONSUMER_NAME
#define CONSUMER_NAME "consumer_cpp"
#endif

#include <cstdio>
#include <exception>

namespace {
constexpr int exit_no_device = 69;
}

int main() try {
  std::printf(CONSUMER_NAME ": cudamem %s\n", CUDAMEM_VERSION_STRING);
  const int devices = cudamem::device_count();
  cudamem::stream s;  // throws cudamem::no_device_error where there is no usable device
  cudamem::device_resource device;
  cudamem::pool_resource pool{device};
  void* small = pool.allocate(std::size_t{1} << 20, 256, s);
  pool.deallocate(small, std::size_t{1} << 20, 256, s);
  cudamem::vm_pool_resource vm_pool;
  void* large = vm_pool.allocate(std::size_t{256} << 20, 256, s);
  vm_pool.deallocate(large, std::size_t{256} << 20, 256, s);
  s.synchronize();
  std::printf(CONSUMER_NAME ": OK, %d device(s), a stream on device %d\n", devices, s.device());
  return 0;
} catch (const cudamem::no_device_error& e) {
  std::printf(CONSUMER_NAME ": %s\n", e.what());
  return exit_no_device;
} catch (const std::exception& e) {
  std::fprintf(stderr, CONSUMER_NAME " failed: %s\n", e.what());
  return 1;
}
