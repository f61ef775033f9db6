// Host-compiler use of the packaged cudamem: a stream, or the no-device message and exit 69.
#include <cudamem/cudamem.hpp>

#include <cstdio>

int main() try {
  cudamem::stream s;
  s.synchronize();
  std::printf("test_package_cpp: OK, cudamem %s, stream on device %d\n", CUDAMEM_VERSION_STRING,
              s.device());
  return 0;
} catch (const cudamem::no_device_error& e) {
  std::printf("test_package_cpp: %s\n", e.what());
  return 69;
}
