// A file that declares buffers and passes resources along: it must not compile the
// out-of-memory report's formatting (memory_report.hpp, NVML; check_paid_where_used.cmake checks
// its includes and its object's symbols).
#include <cudamem/device_buffer.hpp>
#include <cudamem/stream.hpp>

float* scratch(cudamem::memory_resource& mr, cudamem::stream& s) {
  static cudamem::device_buffer<float> given(1024, s, mr);
  static cudamem::device_buffer<float> on_default(1024, s);
  return on_default.size() != 0 ? on_default.data() : given.data();
}
