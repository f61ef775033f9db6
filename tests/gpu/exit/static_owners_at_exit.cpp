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
// The default copy stager (copy_stager.hpp) is made by a staged copy in main: at exit its
// chunks are freed and its threads joined by the std::atexit handler it registers, and a
// staged-size copy made later in exit (the destructor of `copy_at_exit`, registered before
// that handler, so it runs after it) must go direct, with no thread started again.
// Any error report during exit ends the process with code 3 (so ctest sees it even if the
// text were lost); a crash is a signal. Success is exit code 0 and no output but one line.
#include <cudamem/async_resource.hpp>
#include <cudamem/context.hpp>
#include <cudamem/copy.hpp>
#include <cudamem/copy_stager.hpp>
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
#include <vector>

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

/// Copies the late buffer to the host in its destructor, during exit.
struct copy_at_exit {
  late_owners& from;
  ~copy_at_exit() {
    std::vector<float> host(from.buffer.size());
    cudamem::copy(host, from.buffer, from.stream);  // 4 MiB: staged size, but stagers retired
    if (host[0] != 2.0f || cudamem::default_copy_stager().stats().worker_threads != 0) {
      std::fprintf(stderr, "copy_at_exit: wrong data or a worker thread started at exit\n");
      std::_Exit(4);
    }
  }
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
  static copy_at_exit copier{late};

  // A staged copy each way (4 MiB > direct_copy_max_bytes): the default stager now holds
  // pinned chunks and worker threads, left for exit to clean up.
  std::vector<float> host(late.buffer.size(), 2.0f);
  cudamem::copy(late.buffer, host, late.stream);
  cudamem::copy(host, late.buffer, late.stream);
  if (cudamem::default_copy_stager().stats().staged_copies != 2) {
    std::printf("the copies were not staged\n");
    return 5;
  }

  // Work still in flight at exit, as in a real program that returns without synchronising.
  std::printf("static owners created; exiting without cleanup\n");
  return 0;
}
