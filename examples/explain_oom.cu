// explain_oom — every seed ends in the same two words, "out of memory", and the question
// they leave: why? cudamem's out_of_memory carries a memory_report: the request, the device's
// free and total memory, what each resource in the chain holds, who else holds the device,
// a verdict and advice that fits the resource that failed.
//
//   ./run example explain_oom
//
// Two failures, each shown as raw CUDA reports it and as cudamem explains it:
// 1. a request larger than the whole device (raw: cudaMalloc returns "out of memory");
// 2. a request that fails from fragmentation: 64 MiB blocks in a pool capped at 1 GiB, every
//    other one freed, then 128 MiB. Half the pool is free, the device has tens of GiB free,
//    and still no free block is large enough — all raw CUDA can show is the free memory.
#include <cudamem/cudamem.hpp>

#include <cstddef>
#include <cstdio>
#include <string>
#include <vector>

namespace {

constexpr std::size_t MiB = std::size_t{1} << 20;
constexpr std::size_t GiB = MiB << 10;

void print_raw_view(const char* what, cudaError_t code) {
  const cudamem::memory_usage usage = cudamem::device_memory(0);
  std::printf("  raw CUDA:  %s -> %s (\"%s\"); cudaMemGetInfo: %s free of %s\n", what,
              cudaGetErrorName(code), cudaGetErrorString(code),
              cudamem::format_bytes(usage.free).c_str(),
              cudamem::format_bytes(usage.total).c_str());
}

// Prints the report of `e` and returns its verdict.
std::string explain(const cudamem::out_of_memory& e) {
  std::printf("  cudamem:   %s\n", e.what());
  return std::string(to_string(e.verdict()));
}

}  // namespace

int main() try {
  const cudamem::device_properties props = cudamem::get_device_properties(0);
  std::printf("device 0: %s, %s\n", props.name.c_str(),
              cudamem::format_bytes(props.total_memory).c_str());

  // --- 1. larger than the device -------------------------------------------------------------
  const std::size_t too_large = props.total_memory + GiB;
  std::printf("1. %s, more than the device has\n", cudamem::format_bytes(too_large).c_str());
  void* p = nullptr;
  const cudaError_t code = cudaMalloc(&p, too_large);
  static_cast<void>(cudaGetLastError());  // raw code must clear the error it just got
  print_raw_view("cudaMalloc", code);
  std::string first;
  try {
    cudamem::device_buffer<std::byte> buffer(too_large);
  } catch (const cudamem::out_of_memory& e) {
    first = explain(e);
    std::printf("  as JSON:   %.160s...\n", e.report().to_json().c_str());
  }

  // --- 2. fragmentation ---------------------------------------------------------------------
  std::printf("2. 128 MiB from a 1 GiB pool holding 8 live and 8 free blocks of 64 MiB\n");
  cudamem::device_resource device;
  cudamem::pool_resource pool{device, {.maximum_size = GiB, .growth_step = 256 * MiB}};
  std::vector<cudamem::device_buffer<std::byte>> blocks;
  for (int i = 0; i < 16; ++i) {
    blocks.emplace_back(64 * MiB, cudamem::stream_view{}, pool);
  }
  for (std::size_t i = 0; i < blocks.size(); i += 2) {
    blocks[i] = cudamem::device_buffer<std::byte>(0, cudamem::stream_view{}, pool);  // freed
  }
  std::string second;
  try {
    cudamem::device_buffer<std::byte> wanted(128 * MiB, cudamem::stream_view{}, pool);
  } catch (const cudamem::out_of_memory& e) {
    print_raw_view("a caching allocator's failure", cudaErrorMemoryAllocation);
    second = explain(e);
  }
  blocks.clear();  // every block back to the pool before the pool goes

  std::printf("explained: too large -> %s, swiss cheese -> %s\n", first.c_str(), second.c_str());
  return first == "larger_than_device" && second == "fragmentation" ? 0 : 1;
} catch (const cudamem::no_device_error& e) {
  std::printf("explain_oom: no usable CUDA device here (%s), nothing to run\n", e.name());
  return 69;
} catch (const std::exception& e) {
  std::fprintf(stderr, "explain_oom failed: %s\n", e.what());
  return 1;
}
