// Owners kept in static objects and destroyed at process exit, some of them after the CUDA
// runtime has begun to unload. None may crash, and none may print: at exit CUDA answers
// cudaErrorCudartUnloading (or the driver CUDA_ERROR_DEINITIALIZED), and cudamem's owners
// drop those quietly — the process is giving all its memory back anyway.
//
// Two kinds of statics, because they die at different times:
// - namespace-scope `std::optional`s are constructed (empty) before main, so before the CUDA
//   runtime initialises; they are filled in main. Their destructors were registered first,
//   so they run last: after a runtime that registers its own teardown at initialisation.
// - function-local statics are constructed in main, after the runtime initialised; they die
//   before its teardown.
// Any error report during exit ends the process with code 3 (so ctest sees it even if the
// text were lost); a crash is a signal. Success is exit code 0 and no output but one line.
#include <cudamem/async_resource.hpp>
#include <cudamem/context.hpp>
#include <cudamem/device.hpp>
#include <cudamem/device_buffer.hpp>
#include <cudamem/device_resource.hpp>
#include <cudamem/error.hpp>
#include <cudamem/event.hpp>
#include <cudamem/pool_resource.hpp>
#include <cudamem/primary_context.hpp>
#include <cudamem/stream.hpp>

#include <cuda_runtime_api.h>

#include <cstdio>
#include <cstdlib>
#include <optional>

namespace {

// Declaration order is construction order; destruction runs the other way, so each resource
// outlives the buffers and pools that draw on it.
std::optional<cudamem::primary_context> early_primary;
std::optional<cudamem::context> early_context;
std::optional<cudamem::device_resource> early_device;
std::optional<cudamem::pool_resource> early_pool;
std::optional<cudamem::async_resource> early_async;
std::optional<cudamem::stream> early_stream;
std::optional<cudamem::event> early_event;
std::optional<cudamem::device_buffer<float>> early_pool_buffer;
std::optional<cudamem::device_buffer<float>> early_async_buffer;

void fail_on_any_report(const cudamem::error_report& report) noexcept {
  cudamem::print_error(report);
  std::fflush(stderr);
  std::_Exit(3);
}

struct late_owners {
  cudamem::device_resource device;
  cudamem::pool_resource pool{device};
  cudamem::stream stream;
  cudamem::event event;
  cudamem::device_buffer<float> buffer{std::size_t{1} << 20, stream.view(), pool};
};

}  // namespace

int main() {
  if (cudamem::device_count() == 0) {
    std::printf("SKIPPED: no CUDA device\n");
    return 77;
  }
  cudamem::set_error_handler(&fail_on_any_report);

  early_primary.emplace(0);
  early_context.emplace(cudamem::context_options{.device = 0});
  early_device.emplace(0);
  early_pool.emplace(*early_device);
  early_async.emplace();
  early_stream.emplace();
  early_event.emplace();
  early_pool_buffer.emplace(std::size_t{1} << 20, early_stream->view(), *early_pool);
  early_async_buffer.emplace(std::size_t{1} << 20, early_stream->view(), *early_async);
  cudamem::check(cudaMemsetAsync(early_pool_buffer->data(), 0, early_pool_buffer->size_bytes(),
                                 early_stream->get()));
  early_event->record(*early_stream);

  static late_owners late;
  cudamem::check(cudaMemsetAsync(late.buffer.data(), 0, late.buffer.size_bytes(),
                                 late.stream.get()));
  late.event.record(late.stream);

  // Work still in flight at exit, as in a real program that returns without synchronising.
  std::printf("static owners created; exiting without cleanup\n");
  return 0;
}
