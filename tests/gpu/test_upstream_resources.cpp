// device_resource, async_resource, pinned_resource, managed_resource, the current resource
// and pmr_resource on a real device.
#include <cudamem/async_resource.hpp>
#include <cudamem/current_resource.hpp>
#include <cudamem/device_resource.hpp>
#include <cudamem/managed_resource.hpp>
#include <cudamem/out_of_memory.hpp>
#include <cudamem/pinned_resource.hpp>
#include <cudamem/pmr_resource.hpp>
#include <cudamem/stream.hpp>

#include "gpu_test.hpp"

#include <cstdint>
#include <cstring>
#include <limits>
#include <memory_resource>
#include <stdexcept>
#include <vector>

using namespace cudamem;

namespace {
/// Where CUDA says `p` lives.
cudaMemoryType memory_type(const void* p) {
  cudaPointerAttributes a{};
  check(cudaPointerGetAttributes(&a, p));
  return a.type;
}

/// The resource contract every upstream keeps: stats, alignment, zero, the stream form.
void check_basic_contract(memory_resource& mr, cudaMemoryType expected) {
  stream s;
  CHECK(mr.stats().used_bytes == 0);
  void* a = mr.allocate(1000);
  void* b = mr.allocate(3 << 20, 256, s);
  REQUIRE(a != nullptr);
  REQUIRE(b != nullptr);
  CHECK(reinterpret_cast<std::uintptr_t>(a) % 256 == 0);
  CHECK(reinterpret_cast<std::uintptr_t>(b) % 256 == 0);
  CHECK(memory_type(a) == expected);
  CHECK(mr.stats().used_bytes == 1000 + (3 << 20));
  CHECK(mr.stats().peak_used_bytes == 1000 + (3 << 20));
  if (expected != cudaMemoryTypeHost) {  // pending work on s when b is freed
    check(cudaMemsetAsync(b, 1, 3 << 20, s.get()));
  }
  mr.deallocate(b, 3 << 20, 256, s);
  mr.deallocate(a, 1000);
  CHECK(mr.stats().used_bytes == 0);
  CHECK(mr.stats().peak_used_bytes == 1000 + (3 << 20));
  CHECK(mr.allocate(0) == nullptr);
  CHECK_THROWS_AS(mr.allocate(64, 512), std::invalid_argument);   // beyond CUDA's 256
  CHECK_THROWS_AS(mr.allocate(64, 48), std::invalid_argument);    // not a power of two
  s.synchronize();
}
}  // namespace

TEST_CASE("device_resource: cudaMalloc memory on its own device") {
  device_resource mr;
  CHECK(mr.kind() == memory_kind::device);
  CHECK(mr.device() == current_device());
  CHECK(mr.name() == "device_resource");
  check_basic_contract(mr, cudaMemoryTypeDevice);
  CHECK(mr == device_resource{0});
  CHECK_THROWS_AS(device_resource{device_count()}, std::out_of_range);
}

// cudaMalloc fails on purpose (an expected API error for compute-sanitizer).
TEST_CASE("device_resource: a request larger than the device is out_of_memory, nothing leaked",
          "[expected-api-error]") {
  device_resource mr;
  const std::size_t too_big = device_memory(0).total * 2;
  try {
    static_cast<void>(mr.allocate(too_big));
    FAIL("should not fit");
  } catch (const out_of_memory& e) {
    CHECK(e.requested_bytes() == too_big);
    CHECK(e.report().cause.find("cudaMalloc") != std::string::npos);
    CHECK(e.verdict() == oom_verdict::larger_than_device);
    CHECK(e.report().device_total.has_value());
  }
  CHECK(mr.stats().used_bytes == 0);
  CHECK(cudaGetLastError() == cudaSuccess);  // the failure does not resurface later
}

TEST_CASE("device_resource: allocates and frees on its device whatever device is current") {
  if (device_count() < 2) {
    SUCCEED("one device: nothing to switch between");
    return;
  }
  device_resource on_1{1};
  const device_guard on_0{0};
  void* p = on_1.allocate(1 << 20);
  cudaPointerAttributes a{};
  check(cudaPointerGetAttributes(&a, p));
  CHECK(a.device == 1);
  CHECK(current_device() == 0);
  on_1.deallocate(p, 1 << 20);
  CHECK(current_device() == 0);
}

TEST_CASE("async_resource: own pool, release threshold, trim, driver figures") {
  async_resource mr{{.release_threshold = 0}};
  CHECK(mr.owns_pool());
  CHECK(mr.name() == "async_resource");
  CHECK(mr.release_threshold() == 0);
  check_basic_contract(mr, cudaMemoryTypeDevice);

  stream s;
  mr.set_release_threshold(std::numeric_limits<std::uint64_t>::max());
  CHECK(mr.release_threshold() == std::numeric_limits<std::uint64_t>::max());
  void* p = mr.allocate(64 << 20, 256, s);
  memory_pool_usage u = mr.pool_usage();
  CHECK(u.used >= (64u << 20));
  CHECK(u.reserved >= u.used);
  CHECK(mr.stats().used_bytes == (64u << 20));
  CHECK(mr.stats().reserved_bytes == u.reserved);
  mr.deallocate(p, 64 << 20, 256, s);
  s.synchronize();
  u = mr.pool_usage();
  CHECK(u.used == 0);
  CHECK(u.reserved >= (64u << 20));   // kept: the threshold is "keep everything"
  mr.trim(0);
  CHECK(mr.pool_usage().reserved == 0);  // given back
  CHECK(mr.pool_usage().reserved_high >= (64u << 20));

  // With threshold 0 the pool gives memory back at the next synchronisation.
  mr.set_release_threshold(0);
  p = mr.allocate(64 << 20, 256, s);
  mr.deallocate(p, 64 << 20, 256, s);
  s.synchronize();
  CHECK(mr.pool_usage().reserved == 0);
}

TEST_CASE("async_resource: the default pool is wrapped, not owned") {
  cudaMemPool_t default_pool = nullptr;
  check(cudaDeviceGetDefaultMemPool(&default_pool, 0));
  {
    async_resource mr{{.device = 0, .use_default_pool = true}};
    CHECK_FALSE(mr.owns_pool());
    CHECK(mr.pool_handle() == default_pool);
    check_basic_contract(mr, cudaMemoryTypeDevice);
    async_resource again{{.device = 0, .use_default_pool = true}};
    CHECK(mr == again);  // same pool: interchangeable
    async_resource own;
    CHECK_FALSE(mr == own);
  }
  std::uint64_t threshold = 0;  // the default pool is still alive and usable
  check(cudaMemPoolGetAttribute(default_pool, cudaMemPoolAttrReleaseThreshold, &threshold));
  void* p = nullptr;
  check(cudaMallocAsync(&p, 1024, nullptr));
  check(cudaFreeAsync(p, nullptr));
  check(cudaDeviceSynchronize());
}

// cudaMallocFromPoolAsync fails on purpose (an expected API error for compute-sanitizer).
TEST_CASE("async_resource: out of memory names the call and leaves nothing allocated",
          "[expected-api-error]") {
  async_resource mr;
  stream s;
  try {
    static_cast<void>(mr.allocate(device_memory(0).total * 2, 256, s));
    FAIL("should not fit");
  } catch (const out_of_memory& e) {
    CHECK(e.report().cause.find("cudaMallocFromPoolAsync") != std::string::npos);
  }
  CHECK(mr.stats().used_bytes == 0);
  void* p = mr.allocate(4096, 256, s);  // still usable after the failure
  mr.deallocate(p, 4096, 256, s);
  s.synchronize();
  CHECK(mr.stats().used_bytes == 0);
}

TEST_CASE("async_resource: a leak is reported at destruction") {
  auto mr = std::make_unique<async_resource>();
  stream s;
  void* p = mr->allocate(4096, 256, s);
  {
    cudamem_test::captured_errors errors;
    mr.reset();
    REQUIRE(errors.messages().size() == 1);
    CHECK(errors.messages()[0].find("4096 bytes still allocated") != std::string::npos);
  }
  check(cudaFreeAsync(p, s.get()));  // CUDA releases the pool with its last block
  s.synchronize();
}

TEST_CASE("pinned_resource: page-locked host memory the host can use at once") {
  pinned_resource mr;
  CHECK(mr.kind() == memory_kind::pinned);
  CHECK(mr.flags() == cudaHostAllocDefault);
  CHECK(mr.name() == "pinned_resource");
  check_basic_contract(mr, cudaMemoryTypeHost);
  auto* p = static_cast<unsigned char*>(mr.allocate(1 << 20));
  std::memset(p, 7, 1 << 20);  // host-writable
  mr.deallocate(p, 1 << 20);
  pinned_resource portable{cudaHostAllocPortable | cudaHostAllocMapped};
  CHECK_FALSE(mr == portable);
  CHECK(mr == pinned_resource{});
  CHECK_THROWS_AS(pinned_resource{0x100u}, std::invalid_argument);
}

TEST_CASE("managed_resource: one pointer for host and device") {
  managed_resource mr;
  CHECK(mr.kind() == memory_kind::managed);
  check_basic_contract(mr, cudaMemoryTypeManaged);
  auto* p = static_cast<int*>(mr.allocate(sizeof(int) * 4));
  p[0] = 41;
  check(cudaMemset(p + 1, 0, sizeof(int)));
  check(cudaDeviceSynchronize());
  CHECK(p[0] == 41);
  CHECK(p[1] == 0);
  mr.deallocate(p, sizeof(int) * 4);
  CHECK_THROWS_AS(managed_resource{7u}, std::invalid_argument);
  CHECK(managed_resource{cudaMemAttachHost}.attach() == cudaMemAttachHost);
}

TEST_CASE("current resource: a device_resource by default; guards restore on every exit path") {
  memory_resource& original = get_current_resource();
  CHECK(original.name() == "device_resource");
  CHECK(original.device() == current_device());
  CHECK(&get_current_resource(0) == &get_current_resource(0));
  async_resource fast;
  {
    resource_guard use{fast};
    CHECK(&get_current_resource() == &fast);
    CHECK(&use.previous() == &original);
    try {
      resource_guard inner{original};
      CHECK(&get_current_resource() == &original);
      throw std::runtime_error("leave by exception");
    } catch (const std::runtime_error&) {
    }
    CHECK(&get_current_resource() == &fast);
  }
  CHECK(&get_current_resource() == &original);
  memory_resource& before = set_current_resource(&fast);
  CHECK(&before == &original);
  CHECK(&set_current_resource(nullptr) == &fast);
  CHECK(&get_current_resource() == &original);
  CHECK_THROWS_AS(get_current_resource(device_count()), std::out_of_range);
}

TEST_CASE("pmr_resource: a std::pmr::vector<int> in pinned memory") {
  pinned_resource pinned;
  pmr_resource as_pmr{pinned};
  {
    std::pmr::vector<int> v{&as_pmr};
    v.assign(1 << 16, 3);
    CHECK(memory_type(v.data()) == cudaMemoryTypeHost);
    int* dev = nullptr;
    check(cudaMalloc(reinterpret_cast<void**>(&dev), v.size() * sizeof(int)));
    check(cudaMemcpy(dev, v.data(), v.size() * sizeof(int), cudaMemcpyHostToDevice));
    std::vector<int> back(v.size());
    check(cudaMemcpy(back.data(), dev, v.size() * sizeof(int), cudaMemcpyDeviceToHost));
    check(cudaFree(dev));
    CHECK(back[12345] == 3);
    CHECK(pinned.stats().used_bytes >= v.size() * sizeof(int));
  }
  CHECK(pinned.stats().used_bytes == 0);
  device_resource device_only;
  CHECK_THROWS_AS(pmr_resource{device_only}, std::invalid_argument);
}
