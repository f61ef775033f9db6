// The app of the README's install section ("A complete consumer"): main.cpp through the C++
// compiler, kernels.cu through nvcc, one program. packaging.readme builds it from the README's
// own CMakeLists.txt against the prefix the README's commands installed, and runs it: on a
// machine with a GPU it prints "app: OK ..."; on one without, the no-device message and exits
// 69 (EX_UNAVAILABLE). Anything else is a failure.
#include <cudamem/cudamem.hpp>

#include <cstdio>
#include <exception>

// kernels.cu: a kernel writes 0..n-1 into `values` on `s`; returns the last value it wrote.
int iota_on(cudamem::stream& s, int n);

int main() try {
  std::printf("app: cudamem %s\n", CUDAMEM_VERSION_STRING);
  cudamem::stream s;  // throws cudamem::no_device_error where there is no usable device
  constexpr int n = 1000;
  const int last = iota_on(s, n);
  if (last != n - 1) {
    std::fprintf(stderr, "app failed: the kernel wrote %d, expected %d\n", last, n - 1);
    return 1;
  }
  std::printf("app: OK, a kernel ran on device %d\n", s.device());
  return 0;
} catch (const cudamem::no_device_error& e) {
  std::printf("app: %s\n", e.what());
  return 69;
} catch (const std::exception& e) {
  std::fprintf(stderr, "app failed: %s\n", e.what());
  return 1;
}
