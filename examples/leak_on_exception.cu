// leak_on_exception — an exception skips cudaFree, and the memory stays
// taken until the process exits. A device_buffer frees it on every path.
//
//   ./run example leak_on_exception
//
// The program "processes a batch" four times. Each batch takes 256 MiB of device memory and
// then fails with an exception (think: a corrupt input file). The raw version frees at the end
// of the function, a line the exception jumps over; the cudamem version keeps the memory in a
// device_buffer, whose destructor runs however the function is left. The device's free memory
// is measured before and after each version: the difference is what leaked.
#include <cudamem/cudamem.hpp>

#include <cstdio>
#include <stdexcept>
#include <vector>

namespace {

constexpr std::size_t MiB = std::size_t{1} << 20;
constexpr std::size_t batch_bytes = 256 * MiB;
constexpr int batches = 4;
// Free memory moves in 2 MiB pages, and the driver keeps a little for itself; device_scope.hpp
// explains why a shortfall of up to 4 MiB is not a leak of ours.
constexpr std::size_t tolerance = 4 * MiB;

struct bad_input : std::runtime_error {
  bad_input() : std::runtime_error("bad input") {}
};

// The raw code loses its pointers. This list exists only so that this example can give the
// memory back at the end; the program in the seed has no such list.
std::vector<void*> lost_pointers;

// The usual pattern: allocate, work, fail, and the cudaFree at the end never runs.
void raw_batch(bool input_is_bad) {
  float* data = nullptr;
  cudamem::check(cudaMalloc(&data, batch_bytes), "cudaMalloc");
  lost_pointers.push_back(data);
  cudamem::check(cudaMemset(data, 0, batch_bytes), "cudaMemset");  // ...some work...
  if (input_is_bad) {
    throw bad_input{};  // leaves the function here...
  }
  cudamem::check(cudaFree(data), "cudaFree");  // ...so this line never runs
}

// The same with an owner: the buffer's destructor frees the memory when the exception passes.
void cudamem_batch(bool input_is_bad, cudamem::stream_view s) {
  cudamem::device_buffer<float> data(batch_bytes / sizeof(float), cudamem::zero_fill, s);
  if (input_is_bad) {
    throw bad_input{};
  }
}

std::size_t free_device_memory() {
  cudamem::check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  return cudamem::device_memory().free;
}

// Runs `batch` on four bad inputs, catching each failure as a caller would, and returns how
// much less device memory is free afterwards (0 within the tolerance).
template <class Batch>
std::size_t leaked_by(const char* what, Batch batch) {
  const std::size_t before = free_device_memory();
  for (int i = 0; i < batches; ++i) {
    try {
      batch();
    } catch (const bad_input&) {
      // the caller logs the bad input and goes on with the next batch
    }
  }
  const std::size_t after = free_device_memory();
  const std::size_t shortfall = before > after ? before - after : 0;
  std::printf("%-28s free %s before, %s after %d failed batches: %s still held\n", what,
              cudamem::format_bytes(before).c_str(), cudamem::format_bytes(after).c_str(),
              batches, cudamem::format_bytes(shortfall).c_str());
  return shortfall > tolerance ? shortfall : 0;
}

}  // namespace

int main() try {
  std::printf("device 0: %s\n", cudamem::get_device_properties(0).name.c_str());
  cudamem::stream s;
  { cudamem::device_buffer<float> warm_up(batch_bytes / sizeof(float), s); }  // driver set-up

  const std::size_t raw = leaked_by("raw cudaMalloc + throw:", [] { raw_batch(true); });
  const std::size_t owned = leaked_by("device_buffer + throw:", [&] { cudamem_batch(true, s); });

  // Give back what the raw version lost, so the example leaves the GPU as it found it.
  for (void* p : lost_pointers) {
    cudamem::check(cudaFree(p), "cudaFree of a lost pointer");
  }
  std::printf("cleanup: freed the %zu pointers the raw version lost; %s free now\n",
              lost_pointers.size(), cudamem::format_bytes(free_device_memory()).c_str());

  std::printf("leaked bytes: raw %zu, cudamem %zu\n", raw, owned);
  return raw >= batches * batch_bytes && owned == 0 ? 0 : 1;
} catch (const cudamem::no_device_error& e) {
  std::printf("leak_on_exception: no usable CUDA device here (%s), nothing to run\n", e.name());
  return 69;
} catch (const std::exception& e) {
  std::fprintf(stderr, "leak_on_exception failed: %s\n", e.what());
  return 1;
}
