// fragmentation — seeds 001, 002, 004: "a 4 GiB request fails with 79 GiB free". Memory freed
// in the wrong places is free, but not in one piece.
//
//   ./run example fragmentation
//
// Part 1, the big picture, on a simulated 80 GiB device (addresses only, no memory behind
// them, so it takes milliseconds). A training step keeps a small 256 KiB result for every
// 1 GiB activation it allocates, then frees the activations. Straight from a first-fit
// device — how memory without virtual addressing behaves — the small blocks end up between
// the large holes, and a 4 GiB request fails with nearly the whole device free. A
// pool_resource puts small blocks in chunks of their own, so the large holes merge again.
//
// Part 2, on the real GPU, small: 64 MiB blocks in a pool capped at 1 GiB, every other one
// freed, then a 128 MiB request. A pool_resource holds its chunks at fixed addresses and must
// refuse: its out_of_memory report says why (fragmentation, with the pool's numbers). A
// vm_pool_resource remaps the free physical memory side by side and succeeds.
#include <cudamem/cudamem.hpp>

#include <cstdio>
#include <string>
#include <vector>

namespace {

constexpr std::size_t KiB = std::size_t{1} << 10;
constexpr std::size_t MiB = KiB << 10;
constexpr std::size_t GiB = MiB << 10;

// Tries a request; prints and returns the outcome ("ok" or "failed (<verdict>)").
std::string try_request(cudamem::memory_resource& mr, std::size_t bytes, const char* who) {
  try {
    void* p = mr.allocate(bytes);
    mr.deallocate(p, bytes);
    std::printf("  %-26s %s request: ok\n", who, cudamem::format_bytes(bytes).c_str());
    return "ok";
  } catch (const cudamem::out_of_memory& e) {
    const cudamem::memory_report& r = e.report();
    std::printf("  %-26s %s request: FAILED with %s free on the device; verdict %s\n", who,
                cudamem::format_bytes(bytes).c_str(),
                cudamem::format_bytes(r.device_free.value_or(0)).c_str(),
                std::string(to_string(r.verdict)).c_str());
    for (const cudamem::resource_snapshot& s : r.chain) {
      if (s.stats.largest_free_block) {  // a pool: how its free memory is shaped
        std::printf("  %-26s %s free in the pool, largest free block %s, fragmentation %.0f%%\n",
                    "", cudamem::format_bytes(s.stats.free_bytes()).c_str(),
                    cudamem::format_bytes(*s.stats.largest_free_block).c_str(),
                    100.0 * s.stats.fragmentation());
      }
    }
    return "failed (" + std::string(to_string(r.verdict)) + ")";
  }
}

// Part 1's training step, repeated until the device is full; then the activations are freed.
std::string mixed_sizes(cudamem::memory_resource& mr, const char* who) {
  std::vector<void*> activations;
  std::vector<void*> results;
  try {
    for (;;) {
      activations.push_back(mr.allocate(GiB));
      results.push_back(mr.allocate(256 * KiB));
    }
  } catch (const cudamem::out_of_memory&) {  // full: the step we wanted
  }
  for (void* p : activations) {
    mr.deallocate(p, GiB);
  }
  const std::string outcome = try_request(mr, 4 * GiB, who);
  for (void* p : results) {
    mr.deallocate(p, 256 * KiB);
  }
  return outcome;
}

// Part 2's swiss cheese: 16 blocks of 64 MiB (1 GiB), every other one freed, then 128 MiB.
std::string swiss_cheese(cudamem::memory_resource& mr, const char* who) {
  std::vector<void*> blocks;
  for (int i = 0; i < 16; ++i) {
    blocks.push_back(mr.allocate(64 * MiB));
  }
  for (std::size_t i = 0; i < blocks.size(); i += 2) {
    mr.deallocate(blocks[i], 64 * MiB);
  }
  const std::string outcome = try_request(mr, 128 * MiB, who);
  for (std::size_t i = 1; i < blocks.size(); i += 2) {
    mr.deallocate(blocks[i], 64 * MiB);
  }
  return outcome;
}

}  // namespace

int main() try {
  std::printf("device 0: %s\n", cudamem::get_device_properties(0).name.c_str());

  std::printf("part 1: simulated 80 GiB device, 1 GiB activations + 256 KiB results until full\n");
  cudamem::simulated_resource raw_device;  // first fit, like memory without virtual addresses
  const std::string raw = mixed_sizes(raw_device, "raw first-fit device:");
  cudamem::simulated_resource pooled_device;
  std::string pooled;
  {
    cudamem::pool_resource pool{pooled_device};
    pooled = mixed_sizes(pool, "pool_resource over it:");
  }

  std::printf("part 2: real device, 64 MiB blocks in 1 GiB, every other one freed\n");
  cudamem::device_resource device;
  std::string capped;
  {
    cudamem::pool_resource pool{device, {.maximum_size = GiB, .growth_step = 256 * MiB}};
    capped = swiss_cheese(pool, "pool_resource (1 GiB):");
  }
  std::string vm;
  {
    cudamem::vm_pool_options options;
    options.physical_limit = GiB;
    cudamem::vm_pool_resource pool{0, options};
    vm = swiss_cheese(pool, "vm_pool_resource (1 GiB):");
    std::printf("  %-26s compactions: %zu\n", "", pool.vm_stats().compactions);
  }

  std::printf("big request after churn: raw first-fit %s, cudamem pool %s, capped pool %s, "
              "vm_pool %s\n",
              raw.c_str(), pooled.c_str(), capped.c_str(), vm.c_str());
  return raw == "failed (fragmentation)" && pooled == "ok" && capped == "failed (fragmentation)" &&
                 vm == "ok"
             ? 0
             : 1;
} catch (const cudamem::no_device_error& e) {
  std::printf("fragmentation: no usable CUDA device here (%s), nothing to run\n", e.name());
  return 69;
} catch (const std::exception& e) {
  std::fprintf(stderr, "fragmentation failed: %s\n", e.what());
  return 1;
}
