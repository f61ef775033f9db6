// The host-compiler consumer: plain C++ (g++) that uses the CUDA runtime through cudamem.
// On a machine with a GPU it creates a stream and prints "consumer_cpp: OK ..."; on one without,
// it prints the no-device message and exits 69 (EX_UNAVAILABLE). Anything else is a failure.
#include <cudamem/cudamem.hpp>

#include <cstdio>
#include <exception>

namespace {
constexpr int exit_no_device = 69;
}

int main() try {
  std::printf("consumer_cpp: cudamem %s\n", CUDAMEM_VERSION_STRING);
  const int devices = cudamem::device_count();
  cudamem::stream s;  // throws cudamem::no_device_error where there is no usable device
  s.synchronize();
  std::printf("consumer_cpp: OK, %d device(s), a stream on device %d\n", devices, s.device());
  return 0;
} catch (const cudamem::no_device_error& e) {
  std::printf("consumer_cpp: %s\n", e.what());
  return exit_no_device;
} catch (const std::exception& e) {
  std::fprintf(stderr, "consumer_cpp failed: %s\n", e.what());
  return 1;
}
