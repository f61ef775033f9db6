// Fragmentation at 80 GiB scale on a simulated device: the swiss-cheese and mixed experiments
// of bench/support/fragmentation.hpp for pool_resource and for the naive first-fit reference
// (the simulated device used directly). The pool must at least match first fit.
#include <cudamem/out_of_memory.hpp>
#include <cudamem/pool_resource.hpp>
#include <cudamem/simulated_resource.hpp>

#include "../../bench/support/fragmentation.hpp"

#include <catch2/catch.hpp>

#include <cstdio>

using namespace cudamem;
using namespace cudamem_bench;

namespace {

constexpr std::size_t capacity = 80 * GiB;

template <class Resource>
auto allocator_of(Resource& r) {
  return [&r](std::size_t n) -> void* {
    try {
      return r.allocate(n);
    } catch (const out_of_memory&) {
      return nullptr;
    }
  };
}
template <class Resource>
auto releaser_of(Resource& r) {
  return [&r](void* p, std::size_t n) { r.deallocate(p, n); };
}

void print(const char* experiment, const char* who, const fragmentation_result& r) {
  std::printf("%-13s %-10s ratio %.3f (%zu / %zu bytes), %zu ops, %.0f ns/op\n", experiment, who,
              r.ratio, r.numerator, r.denominator, r.ops, r.ns_per_op);
}

}  // namespace

TEST_CASE("swiss cheese on 80 GiB: the pool at least matches first fit") {
  simulated_resource first_fit_device;
  const auto first_fit = swiss_cheese(allocator_of(first_fit_device), releaser_of(first_fit_device),
                                      64 * MiB, 128 * MiB);
  print("swiss_cheese", "first_fit", first_fit);
  CHECK(first_fit_device.used_bytes() == 0);
  CHECK(first_fit.denominator == capacity / 2);

  simulated_resource device;
  {
    pool_resource pool{device};
    const auto pooled = swiss_cheese(allocator_of(pool), releaser_of(pool), 64 * MiB, 128 * MiB);
    print("swiss_cheese", "pool", pooled);
    CHECK(pooled.denominator >= capacity / 2 - 64 * MiB);
    CHECK(pooled.ratio >= first_fit.ratio);
    CHECK(pool.stats().used_bytes == 0);
  }
  CHECK(device.used_bytes() == 0);

  // Over a device that never fragments (what cudaMalloc does with virtual memory), a pool that
  // returns whole free chunks on failure gets every freed byte back.
  simulated_resource paged{{.capacity = capacity, .layout = simulated_layout::paged}};
  pool_resource pool{paged};
  const auto over_paged = swiss_cheese(allocator_of(pool), releaser_of(pool), 64 * MiB, 128 * MiB);
  print("swiss_cheese", "pool/paged", over_paged);
  CHECK(over_paged.ratio >= 0.99);
}

TEST_CASE("mixed trace on 80 GiB: the pool over a paged device beats first fit") {
  const mixed_spec spec = mixed_spec_for(capacity);
  simulated_resource first_fit_device;
  const auto first_fit = mixed(spec, allocator_of(first_fit_device), releaser_of(first_fit_device));
  print("mixed", "first_fit", first_fit);
  CHECK(first_fit_device.used_bytes() == 0);

  // The pool over a paged device: what it sits on on a real GPU (cudaMalloc maps pages behind
  // fresh addresses). Keeping small and large blocks apart makes it beat first fit there.
  simulated_resource paged{{.capacity = capacity, .layout = simulated_layout::paged}};
  {
    pool_resource pool{paged};
    const auto pooled = mixed(spec, allocator_of(pool), releaser_of(pool));
    print("mixed", "pool/paged", pooled);
    CHECK(pooled.ratio >= first_fit.ratio);
  }
  CHECK(paged.used_bytes() == 0);

  // The pool over a first-fit device: its chunks themselves are placed first fit, so it
  // cannot beat ideal first fit at 256 B grain over the whole device; it stays within 6%
  // (0.919 vs 0.968 with 16 MiB small chunks). Real devices are paged (above), not first fit.
  simulated_resource device;
  {
    pool_resource pool{device};
    const auto pooled = mixed(spec, allocator_of(pool), releaser_of(pool));
    print("mixed", "pool", pooled);
    CHECK(pooled.ratio >= 0.94 * first_fit.ratio);
  }
  CHECK(device.used_bytes() == 0);
}

TEST_CASE("mixed trace with long-lived 1..4 MiB blocks: the pool keeps them out of large chunks") {
  // The GPU bench's variant: long-lived blocks up to 4 MiB. In large-tier chunks they would pin
  // the chunks large blocks come and go in (0.67 of the device with a 1 MiB small-tier limit).
  simulated_resource paged{{.capacity = capacity, .layout = simulated_layout::paged}};
  {
    pool_resource pool{paged};
    const auto pooled = mixed(mixed_spec_gpu_for(capacity), allocator_of(pool), releaser_of(pool));
    print("mixed_gpu", "pool/paged", pooled);
    CHECK(pooled.ratio >= 0.97);
  }
  CHECK(paged.used_bytes() == 0);
}
