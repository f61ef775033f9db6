// cudamem_c.h over simulated devices (no GPU): the whole path of a C caller and of PyTorch's
// entry points — configuration, allocation, statistics, reports, out of memory, bad input.
#include <cudamem_c.h>

#include <catch2/catch.hpp>

#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <new>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace {
constexpr std::size_t MiB = std::size_t{1} << 20;
constexpr std::size_t GiB = std::size_t{1} << 30;

std::string last() { return cudamem_last_error(); }

/// A new allocator; fails the test if it cannot be made.
int make(const char* config) {
  int id = -1;
  const cudamem_status s = cudamem_allocator_create(config, &id);
  INFO(last());
  REQUIRE(s == CUDAMEM_OK);
  REQUIRE(id > 0);
  return id;
}

cudamem_stats stats_of(int id, int device = 0) {
  cudamem_stats s{};
  s.struct_size = sizeof(s);
  REQUIRE(cudamem_get_stats(id, device, &s) == CUDAMEM_OK);
  return s;
}

std::string text_of(cudamem_status (*get)(int, char*, std::size_t, std::size_t*), int id) {
  std::size_t needed = 0;
  REQUIRE(get(id, nullptr, 0, &needed) == CUDAMEM_OK);
  std::string s(needed, '\0');
  REQUIRE(get(id, s.data(), s.size(), &needed) == CUDAMEM_OK);
  s.resize(needed - 1);
  return s;
}

/// Destroys `id` at scope exit (after the test freed everything).
struct destroyer {
  int id;
  ~destroyer() { cudamem_allocator_destroy(id); }
};

struct framework_oom : std::runtime_error {
  using std::runtime_error::runtime_error;
};
void throw_framework_oom(const char* report) { throw framework_oom(report); }

}  // namespace

// First in this file on purpose: allocator 0 reads the environment once, when first touched.
TEST_CASE("c api: allocator 0 is configured by CUDAMEM_ variables; a bad one is never ignored") {
  ::setenv("CUDAMEM_LIMIT_BYTES", "2GB", 1);
  CHECK(cudamem_allocator_configure(0, "") == CUDAMEM_ERROR_INVALID_ARGUMENT);
  CHECK(last() ==
        "cudamem: limit_bytes=2GB (from environment variable CUDAMEM_LIMIT_BYTES): not a size "
        "(bytes, optionally with a unit: 512, 64KiB, 2MiB, 8GiB, 1TiB)");
  void* p = reinterpret_cast<void*>(1);
  CHECK(cudamem_allocate(0, 64, 0, nullptr, &p) == CUDAMEM_ERROR_INVALID_ARGUMENT);  // still
  CHECK(p == nullptr);

  ::setenv("CUDAMEM_LIMIT_BYTES", "2GiB", 1);
  ::setenv("CUDAMEM_RESOURCE", "pool", 1);
  ::setenv("CUDAMEM_SIMULATE_BYTES", "4GiB", 1);
  REQUIRE(cudamem_allocator_configure(0, "raise_on_oom=1") == CUDAMEM_OK);
  std::size_t needed = 0;
  REQUIRE(cudamem_allocator_describe(0, nullptr, 0, &needed) == CUDAMEM_OK);
  std::string d(needed, '\0');
  REQUIRE(cudamem_allocator_describe(0, d.data(), d.size(), nullptr) == CUDAMEM_OK);
  CHECK(std::string(d.c_str()) ==
        "resource=pool, limit_bytes=2147483648, simulate_bytes=4294967296, raise_on_oom=1");
  ::unsetenv("CUDAMEM_LIMIT_BYTES");
  ::unsetenv("CUDAMEM_RESOURCE");
  ::unsetenv("CUDAMEM_SIMULATE_BYTES");
}

TEST_CASE("c api: PyTorch's entry points over allocator 0 raise at a failed allocation") {
  void* p = cudamem_torch_malloc(64 * MiB, 0, nullptr);
  CHECK(p != nullptr);
  cudamem_torch_record_stream(p, reinterpret_cast<cudamem_stream_t>(0x10));
  cudamem_torch_free(p, 64 * MiB, 0, nullptr);
  CHECK(cudamem_torch_malloc(0, 0, nullptr) == nullptr);  // 0 bytes: no memory, no error

  // Over the 2 GiB budget: no thrower registered -> a std::bad_alloc carrying the report.
  cudamem_set_torch_oom_thrower(nullptr);
  try {
    static_cast<void>(cudamem_torch_malloc(3 * GiB, 0, nullptr));
    FAIL("no exception");
  } catch (const std::bad_alloc& e) {
    CHECK_THAT(e.what(), Catch::Contains("could not allocate 3.00 GiB"));
    CHECK_THAT(e.what(), Catch::Contains("Verdict: budget"));
  }
  // With a thrower: the framework's own exception, with the same report.
  cudamem_set_torch_oom_thrower(&throw_framework_oom);
  try {
    static_cast<void>(cudamem_torch_malloc(3 * GiB, 0, nullptr));
    FAIL("no exception");
  } catch (const framework_oom& e) {
    CHECK_THAT(e.what(), Catch::Contains("Verdict: budget"));
  }
  cudamem_set_torch_oom_thrower(nullptr);
  // A device that does not exist: a runtime_error naming it, not a null pointer.
  CHECK_THROWS_WITH(cudamem_torch_malloc(MiB, 99, nullptr),
                    Catch::Contains("device 99 does not exist"));
  // The allocator goes on working, and the configuration is fixed now.
  void* q = cudamem_torch_malloc(MiB, 0, nullptr);
  CHECK(q != nullptr);
  cudamem_torch_free(q, MiB, 0, nullptr);
  CHECK(cudamem_allocator_configure(0, "resource=vm_pool") == CUDAMEM_ERROR_STATE);
  CHECK_THAT(last(), Catch::Contains("configured at its first allocation"));
  cudamem_torch_empty_cache();
  CHECK(stats_of(0).reserved_bytes == 0);  // the pool gave its chunk back
}

TEST_CASE("c api: allocate, free, statistics over a simulated vm_pool") {
  const int id = make("simulate_bytes=8GiB");
  destroyer d{id};
  const cudamem_stats before = stats_of(id);
  CHECK(before.stack_exists == 0);
  CHECK(before.in_use_bytes == 0);

  std::vector<void*> blocks;
  for (int i = 0; i < 8; ++i) {
    void* p = nullptr;
    REQUIRE(cudamem_allocate(id, 3 * MiB, 0, nullptr, &p) == CUDAMEM_OK);
    CHECK(p != nullptr);
    CHECK(reinterpret_cast<std::uintptr_t>(p) % 256 == 0);
    blocks.push_back(p);
  }
  void* big = nullptr;
  REQUIRE(cudamem_allocate(id, 512 * MiB, 0, nullptr, &big) == CUDAMEM_OK);
  cudamem_stats s = stats_of(id);
  CHECK(s.stack_exists == 1);
  CHECK(s.device == 0);
  CHECK(s.in_use_bytes == 8 * 3 * MiB + 512 * MiB);
  CHECK(s.allocations == 9);
  CHECK(s.reserved_bytes >= s.in_use_bytes);
  CHECK(s.largest_free_block != UINT64_MAX);
  CHECK(s.limit_bytes == 0);

  REQUIRE(cudamem_deallocate(id, big, 512 * MiB, 0, nullptr) == CUDAMEM_OK);
  for (void* p : blocks) {
    REQUIRE(cudamem_deallocate(id, p, 3 * MiB, 0, nullptr) == CUDAMEM_OK);
  }
  s = stats_of(id);
  CHECK(s.in_use_bytes == 0);
  CHECK(s.peak_in_use_bytes == 8 * 3 * MiB + 512 * MiB);
  CHECK(s.deallocations == 9);
  uint64_t released = 0;
  CHECK(cudamem_release(id, -1, &released) == CUDAMEM_OK);
  CHECK(released > 0);
  CHECK(stats_of(id).reserved_bytes == 0);

  void* none = reinterpret_cast<void*>(1);
  CHECK(cudamem_allocate(id, 0, 0, nullptr, &none) == CUDAMEM_OK);
  CHECK(none == nullptr);
  CHECK(cudamem_deallocate(id, nullptr, 0, 0, nullptr) == CUDAMEM_OK);
}

TEST_CASE("c api: the vm_pool's handles are 4 MiB unless handle_bytes says otherwise") {
  // 5 MiB blocks on a 64 MiB device, until it is full. A block of a handle or more gets whole
  // handles of the vm_resource: 2 x 4 MiB each by default (8 blocks fit), 3 x 2 MiB with 2 MiB
  // handles (10). With 64 MiB handles they are cut from one 64 MiB chunk of the pool (12).
  for (const auto& [text, fit] :
       {std::pair<const char*, int>{"simulate_bytes=64MiB", 8},
        {"simulate_bytes=64MiB, handle_bytes=2MiB", 10},
        {"simulate_bytes=64MiB, handle_bytes=64MiB", 12}}) {
    INFO(text);
    const int id = make(text);
    destroyer d{id};
    std::vector<void*> blocks;
    void* p = nullptr;
    while (blocks.size() < 20 && cudamem_allocate(id, 5 * MiB, 0, nullptr, &p) == CUDAMEM_OK) {
      blocks.push_back(p);
    }
    CHECK(static_cast<int>(blocks.size()) == fit);
    for (void* b : blocks) {
      REQUIRE(cudamem_deallocate(id, b, 5 * MiB, 0, nullptr) == CUDAMEM_OK);
    }
  }
}

TEST_CASE("c api: the vm_pool keeps 1 GiB of the device free while recycling can serve") {
  // 2 GiB device, no growth ahead. 1 GiB of 64 MiB blocks, every other one freed, then a
  // 128 MiB block, which no hole holds. With the default keep_free_bytes (1 GiB) the device
  // is at the reserve: two holes are recycled, nothing is made (nothing held ahead), and the
  // statistics count one compaction, chosen to keep the reserve. With 0 it grows by a growth
  // step (256 MiB), and the 128 MiB it did not need is held ahead; no compaction.
  struct variant {
    const char* text;
    std::uint64_t held_ahead;
    std::uint64_t compactions;
  };
  for (const variant& v :
       {variant{"simulate_bytes=2GiB, grow_ahead_bytes=0", 0, 1},
        variant{"simulate_bytes=2GiB, grow_ahead_bytes=0, keep_free_bytes=0", 128 * MiB, 0}}) {
    const char* const text = v.text;
    INFO(text);
    const int id = make(text);
    destroyer d{id};
    std::vector<void*> blocks(16);
    for (void*& p : blocks) {
      REQUIRE(cudamem_allocate(id, 64 * MiB, 0, nullptr, &p) == CUDAMEM_OK);
    }
    for (std::size_t i = 0; i < blocks.size(); i += 2) {
      REQUIRE(cudamem_deallocate(id, blocks[i], 64 * MiB, 0, nullptr) == CUDAMEM_OK);
    }
    CHECK(stats_of(id).compactions == 0);
    void* big = nullptr;
    REQUIRE(cudamem_allocate(id, 128 * MiB, 0, nullptr, &big) == CUDAMEM_OK);
    const cudamem_stats s = stats_of(id);
    CHECK(s.held_ahead_bytes == v.held_ahead);
    CHECK(s.compactions == v.compactions);
    CHECK(s.kept_free_compactions == v.compactions);
    // Simulated memory is not stream-ordered: the pool never waits for a stream.
    CHECK(s.stream_waits == 0);
    CHECK(s.host_waits == 0);
    CHECK(s.device_syncs == 0);
    REQUIRE(cudamem_deallocate(id, big, 128 * MiB, 0, nullptr) == CUDAMEM_OK);
    for (std::size_t i = 1; i < blocks.size(); i += 2) {
      REQUIRE(cudamem_deallocate(id, blocks[i], 64 * MiB, 0, nullptr) == CUDAMEM_OK);
    }
  }
}

TEST_CASE("c api: memory a vm_pool made ahead of need is counted, and release gives it back") {
  // The growth thread runs on its own: the test waits (at most 10 s) for its first batch.
  const int id = make("simulate_bytes=8GiB, grow_ahead_bytes=1GiB");
  destroyer d{id};
  void* big = nullptr;
  REQUIRE(cudamem_allocate(id, 1024 * MiB, 0, nullptr, &big) == CUDAMEM_OK);
  cudamem_stats s = stats_of(id);
  for (int i = 0; i < 1000 && s.held_ahead_bytes == 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
    s = stats_of(id);
  }
  CHECK(s.held_ahead_bytes > 0);
  CHECK(s.held_ahead_bytes <= s.reserved_bytes - s.in_use_bytes);
  REQUIRE(cudamem_deallocate(id, big, 1024 * MiB, 0, nullptr) == CUDAMEM_OK);
  uint64_t released = 0;
  CHECK(cudamem_release(id, -1, &released) == CUDAMEM_OK);
  CHECK(released >= s.held_ahead_bytes);
  CHECK(stats_of(id).held_ahead_bytes == 0);
}

TEST_CASE("c api: out of memory returns cudamem's report, and the allocator goes on") {
  const int id = make("resource=pool, simulate_bytes=1GiB");
  destroyer d{id};
  void* p = nullptr;
  CHECK(cudamem_allocate(id, 2 * GiB, 0, nullptr, &p) == CUDAMEM_ERROR_OUT_OF_MEMORY);
  CHECK(p == nullptr);
  const std::string report = last();
  CHECK_THAT(report, Catch::Contains("could not allocate 2.00 GiB"));
  CHECK_THAT(report, Catch::Contains("statistics_adaptor"));
  CHECK_THAT(report, Catch::Contains("pool_resource"));
  CHECK_THAT(report, Catch::Contains("Verdict: larger_than_device"));
  CHECK(text_of(&cudamem_last_oom_report, id) == report);

  REQUIRE(cudamem_allocate(id, 256 * MiB, 0, nullptr, &p) == CUDAMEM_OK);
  std::size_t needed = 0;
  REQUIRE(cudamem_report(id, 0, 0, nullptr, 0, &needed) == CUDAMEM_OK);
  std::string text(needed, '\0');
  REQUIRE(cudamem_report(id, 0, 0, text.data(), text.size(), nullptr) == CUDAMEM_OK);
  CHECK_THAT(text, Catch::Contains("pool_resource: "));
  std::string small(8, 'x');  // a buffer too small: cut, terminated
  REQUIRE(cudamem_report(id, 0, 0, small.data(), small.size(), &needed) == CUDAMEM_OK);
  CHECK(std::string(small.c_str()).size() == 7);
  CHECK(cudamem_deallocate(id, p, 256 * MiB, 0, nullptr) == CUDAMEM_OK);
}

TEST_CASE("c api: a byte budget") {
  const int id = make("limit_bytes=256MiB, simulate_bytes=4GiB");
  destroyer d{id};
  void* p = nullptr;
  REQUIRE(cudamem_allocate(id, 200 * MiB, 0, nullptr, &p) == CUDAMEM_OK);
  void* q = nullptr;
  CHECK(cudamem_allocate(id, 100 * MiB, 0, nullptr, &q) == CUDAMEM_ERROR_OUT_OF_MEMORY);
  CHECK_THAT(last(), Catch::Contains("Verdict: budget"));
  CHECK(stats_of(id).limit_bytes == 256 * MiB);
  CHECK(cudamem_deallocate(id, p, 200 * MiB, 0, nullptr) == CUDAMEM_OK);
  REQUIRE(cudamem_allocate(id, 100 * MiB, 0, nullptr, &q) == CUDAMEM_OK);
  CHECK(cudamem_deallocate(id, q, 100 * MiB, 0, nullptr) == CUDAMEM_OK);
}

TEST_CASE("c api: bad input is refused with a message, and nothing is lost") {
  int id = -1;
  CHECK(cudamem_allocator_create("resource=nope", &id) == CUDAMEM_ERROR_INVALID_ARGUMENT);
  CHECK_THAT(last(), Catch::Contains("unknown resource"));
  CHECK(id == -1);
  CHECK(cudamem_allocator_create("", nullptr) == CUDAMEM_ERROR_INVALID_ARGUMENT);
  CHECK(cudamem_allocator_configure(CUDAMEM_MAX_ALLOCATORS, "") ==
        CUDAMEM_ERROR_INVALID_ARGUMENT);
  CHECK_THAT(last(), Catch::Contains("no allocator 16"));
  CHECK(cudamem_allocator_destroy(0) == CUDAMEM_ERROR_INVALID_ARGUMENT);

  id = make("simulate_bytes=1GiB");
  destroyer d{id};
  CHECK(cudamem_allocator_configure(id, "limit_bytes=-3") == CUDAMEM_ERROR_INVALID_ARGUMENT);
  void* p = nullptr;
  CHECK(cudamem_allocate(id, MiB, 8, nullptr, &p) == CUDAMEM_ERROR_INVALID_ARGUMENT);
  CHECK(last() == "cudamem: device 8 does not exist (8 simulated devices)");
  CHECK(cudamem_allocate(id, MiB, -1, nullptr, &p) == CUDAMEM_ERROR_INVALID_ARGUMENT);
  CHECK(cudamem_allocate(id, MiB, 0, nullptr, nullptr) == CUDAMEM_ERROR_INVALID_ARGUMENT);
  CHECK(cudamem_record_stream(id, &p, nullptr) == CUDAMEM_ERROR_INVALID_ARGUMENT);  // nothing yet

  REQUIRE(cudamem_allocate(id, MiB, 0, nullptr, &p) == CUDAMEM_OK);
  int local = 0;
  CHECK(cudamem_deallocate(id, &local, MiB, 0, nullptr) == CUDAMEM_ERROR_INVALID_ARGUMENT);
  CHECK_THAT(last(), Catch::Contains("deallocate"));
  CHECK(cudamem_deallocate(id, p, MiB, 1, nullptr) == CUDAMEM_ERROR_INVALID_ARGUMENT);
  CHECK_THAT(last(), Catch::Contains("device 1, where this allocator never allocated"));
  CHECK(cudamem_allocator_destroy(id) == CUDAMEM_ERROR_STATE);  // p is still live
  CHECK_THAT(last(), Catch::Contains("still has"));
  CHECK(cudamem_deallocate(id, p, MiB, 0, nullptr) == CUDAMEM_OK);  // the real free still works

  cudamem_stats s{};
  CHECK(cudamem_get_stats(id, 0, nullptr) == CUDAMEM_ERROR_INVALID_ARGUMENT);
  CHECK(cudamem_get_stats(id, 0, &s) == CUDAMEM_ERROR_INVALID_ARGUMENT);  // struct_size 0
  CHECK_THAT(last(), Catch::Contains("struct_size"));
  // A caller that knows fewer fields gets those only.
  s.struct_size = offsetof(cudamem_stats, peak_in_use_bytes);
  s.peak_in_use_bytes = 12345;
  CHECK(cudamem_get_stats(id, 0, &s) == CUDAMEM_OK);
  CHECK(s.stack_exists == 1);
  CHECK(s.peak_in_use_bytes == 12345);
}

TEST_CASE("c api: record_stream holds a free back until the other stream is done") {
  // Simulated devices run no work, so the free goes through at the next call; the waiting
  // itself is tested in test_deferred_frees and on the GPU.
  const int id = make("simulate_bytes=1GiB");
  destroyer d{id};
  void* p = nullptr;
  REQUIRE(cudamem_allocate(id, MiB, 0, nullptr, &p) == CUDAMEM_OK);
  CHECK(cudamem_record_stream(id, p, reinterpret_cast<cudamem_stream_t>(0x20)) == CUDAMEM_OK);
  CHECK(cudamem_deallocate(id, p, MiB, 0, nullptr) == CUDAMEM_OK);
  CHECK(stats_of(id).in_use_bytes == 0);
  CHECK(stats_of(id).pending_frees == 0);
}

TEST_CASE("c api: a large block freed on a stream serves the next request of its size there") {
  const cudamem_stream_t a = reinterpret_cast<cudamem_stream_t>(0x10);
  const int id = make("simulate_bytes=4GiB, grow_ahead_bytes=0");
  destroyer d{id};
  void* big = nullptr;  // what the blocks kept aside are counted against (not bulk-sized)
  REQUIRE(cudamem_allocate(id, 1500 * MiB, 0, a, &big) == CUDAMEM_OK);
  void* p = nullptr;
  REQUIRE(cudamem_allocate(id, 24 * MiB, 0, a, &p) == CUDAMEM_OK);
  REQUIRE(cudamem_deallocate(id, p, 24 * MiB, 0, a) == CUDAMEM_OK);
  void* q = nullptr;
  REQUIRE(cudamem_allocate(id, 24 * MiB, 0, a, &q) == CUDAMEM_OK);
  CHECK(q == p);
  CHECK(stats_of(id).recent_reuses == 1);
  // Freed after record_stream: given to the resource once the other stream is done (at once
  // on a simulated device, at the next call), then kept aside for its own stream as any free.
  REQUIRE(cudamem_record_stream(id, q, reinterpret_cast<cudamem_stream_t>(0x20)) == CUDAMEM_OK);
  REQUIRE(cudamem_deallocate(id, q, 24 * MiB, 0, a) == CUDAMEM_OK);
  void* r = nullptr;
  REQUIRE(cudamem_allocate(id, 24 * MiB, 0, a, &r) == CUDAMEM_OK);
  CHECK(r == p);
  const cudamem_stats st = stats_of(id);
  CHECK(st.recent_reuses == 2);
  CHECK(st.pending_frees == 0);
  CHECK(st.in_use_bytes == 1524 * MiB);
  REQUIRE(cudamem_deallocate(id, r, 24 * MiB, 0, a) == CUDAMEM_OK);
  REQUIRE(cudamem_deallocate(id, big, 1500 * MiB, 0, a) == CUDAMEM_OK);
  CHECK(stats_of(id).in_use_bytes == 0);

  // recent_frees=0: the same calls, none kept, none reused.
  const int off = make("simulate_bytes=4GiB, grow_ahead_bytes=0, recent_frees=0");
  destroyer d_off{off};
  REQUIRE(cudamem_allocate(off, 1500 * MiB, 0, a, &big) == CUDAMEM_OK);
  REQUIRE(cudamem_allocate(off, 24 * MiB, 0, a, &p) == CUDAMEM_OK);
  REQUIRE(cudamem_deallocate(off, p, 24 * MiB, 0, a) == CUDAMEM_OK);
  REQUIRE(cudamem_allocate(off, 24 * MiB, 0, a, &q) == CUDAMEM_OK);
  CHECK(q == p);  // best fit finds it all the same
  CHECK(stats_of(off).recent_reuses == 0);
  REQUIRE(cudamem_deallocate(off, q, 24 * MiB, 0, a) == CUDAMEM_OK);
  REQUIRE(cudamem_deallocate(off, big, 1500 * MiB, 0, a) == CUDAMEM_OK);
  // A bad value is refused with the key named.
  int bad = -1;
  CHECK(cudamem_allocator_create("simulate_bytes=1GiB, recent_frees=1000", &bad) ==
        CUDAMEM_ERROR_INVALID_ARGUMENT);
  CHECK_THAT(last(), Catch::Contains("recent_frees=1000"));
}

TEST_CASE("c api: prepare_for_graph_capture takes no input, succeeds, and changes no stack") {
  // What it records is tested where streams are tracked: test_pool_streams (a model device)
  // and test_pool_device (a capture on the GPU). Here: a simulated stack, which owes nothing.
  const int id = make("simulate_bytes=1GiB");
  destroyer d{id};
  void* p = nullptr;
  REQUIRE(cudamem_allocate(id, MiB, 0, nullptr, &p) == CUDAMEM_OK);
  CHECK(cudamem_prepare_for_graph_capture() == CUDAMEM_OK);
  CHECK(stats_of(id).in_use_bytes == MiB);
  CHECK(cudamem_deallocate(id, p, MiB, 0, nullptr) == CUDAMEM_OK);
  CHECK(cudamem_prepare_for_graph_capture() == CUDAMEM_OK);
  CHECK(stats_of(id).in_use_bytes == 0);
}

TEST_CASE("c api: a MemPool's allocator returns null at a failed allocation (raise_on_oom=0)") {
  const int id = make("resource=pool, simulate_bytes=1GiB, raise_on_oom=0");
  destroyer d{id};
  REQUIRE(id < 16);
  // The entry points of allocator `id` are cudamem_torch_malloc_<id>; call through allocate
  // for the same allocator to check the refusal mode the entry point follows.
  void* p = reinterpret_cast<void*>(1);
  CHECK(cudamem_allocate(id, 2 * GiB, 0, nullptr, &p) == CUDAMEM_ERROR_OUT_OF_MEMORY);
  CHECK(p == nullptr);
}

TEST_CASE("c api: at most 15 allocators beside allocator 0; destroyed ids are reused") {
  std::vector<int> ids;
  int id = 0;
  while (cudamem_allocator_create("simulate_bytes=1GiB", &id) == CUDAMEM_OK) {
    ids.push_back(id);
  }
  CHECK(cudamem_allocator_create("", &id) == CUDAMEM_ERROR_STATE);
  CHECK_THAT(last(), Catch::Contains("allocators besides allocator 0 are in use"));
  CHECK(ids.size() == CUDAMEM_MAX_ALLOCATORS - 1);
  REQUIRE(cudamem_allocator_destroy(ids.back()) == CUDAMEM_OK);
  CHECK(cudamem_allocator_destroy(ids.back()) == CUDAMEM_ERROR_INVALID_ARGUMENT);  // twice
  CHECK(cudamem_allocator_create("", &id) == CUDAMEM_OK);
  CHECK(id == ids.back());
  ids.back() = id;
  for (int i : ids) {
    CHECK(cudamem_allocator_destroy(i) == CUDAMEM_OK);
  }
}

TEST_CASE("c api: version") {
  CHECK(std::string(cudamem_version()) == "0.1.0");
  CHECK(std::string(cudamem_last_error()).empty());  // the last call succeeded
}

TEST_CASE("c api: current_device is the thread's device, or says there is none") {
  CHECK(cudamem_current_device(nullptr) == CUDAMEM_ERROR_INVALID_ARGUMENT);
  CHECK(last() == "cudamem_current_device: out is NULL");
  int device = -1;
  const cudamem_status s = cudamem_current_device(&device);
  INFO(last());
  if (s == CUDAMEM_OK) {  // a machine with a GPU: nothing was chosen on this thread
    CHECK(device == 0);
  } else {  // none: the status says so, and *out is untouched
    CHECK(s == CUDAMEM_ERROR_NO_DEVICE);
    CHECK(device == -1);
    CHECK_THAT(last(), Catch::Contains("cudamem_current_device"));
  }
}

namespace {
std::vector<cudamem_segment> segments_of(int id, int device = 0) {
  std::size_t count = 0;
  REQUIRE(cudamem_segments(id, device, nullptr, 0, &count) == CUDAMEM_OK);
  std::vector<cudamem_segment> out(count);
  std::size_t again = 0;
  REQUIRE(cudamem_segments(id, device, out.data(), out.size(), &again) == CUDAMEM_OK);
  REQUIRE(again == count);
  return out;
}

bool inside(const std::vector<cudamem_segment>& segments, const void* p, std::size_t bytes) {
  const auto a = reinterpret_cast<std::uintptr_t>(p);
  for (const cudamem_segment& s : segments) {
    if (a >= s.address && a + bytes <= s.address + s.bytes) {
      return true;
    }
  }
  return false;
}
}  // namespace

TEST_CASE("c api: segments are what the stack holds, by address, and add up to reserved") {
  for (const char* config : {"simulate_bytes=8GiB, grow_ahead_bytes=0",
                             "resource=pool, simulate_bytes=8GiB"}) {
    INFO(config);
    const int id = make(config);
    destroyer d{id};
    CHECK(segments_of(id).empty());  // nothing before the first allocation
    void* small = nullptr;
    void* big = nullptr;
    REQUIRE(cudamem_allocate(id, MiB, 0, nullptr, &small) == CUDAMEM_OK);
    REQUIRE(cudamem_allocate(id, 300 * MiB, 0, nullptr, &big) == CUDAMEM_OK);
    const std::vector<cudamem_segment> held = segments_of(id);
    const cudamem_stats s = stats_of(id);
    std::uint64_t total = 0;
    for (std::size_t i = 0; i < held.size(); ++i) {
      total += held[i].bytes;
      if (i > 0) {
        CHECK(held[i - 1].address + held[i - 1].bytes <= held[i].address);  // sorted, disjoint
      }
    }
    CHECK(total == s.reserved_bytes);
    CHECK(s.segments == held.size());
    CHECK(inside(held, small, MiB));
    CHECK(inside(held, big, 300 * MiB));
    // A short array gets what fits, and the count of all.
    std::size_t count = 0;
    cudamem_segment one{};
    REQUIRE(cudamem_segments(id, 0, &one, 1, &count) == CUDAMEM_OK);
    CHECK(count == held.size());
    CHECK(one.address == held[0].address);
    CHECK(cudamem_segments(id, 0, nullptr, 0, nullptr) == CUDAMEM_ERROR_INVALID_ARGUMENT);
    CHECK(cudamem_segments(id, 99, nullptr, 0, &count) == CUDAMEM_ERROR_INVALID_ARGUMENT);
    REQUIRE(cudamem_deallocate(id, small, MiB, 0, nullptr) == CUDAMEM_OK);
    REQUIRE(cudamem_deallocate(id, big, 300 * MiB, 0, nullptr) == CUDAMEM_OK);
  }
}

TEST_CASE("c api: bulk blocks are counted with the rest, given back and reset with it") {
  // The default stack: 4 MiB handles, and 32 MiB ones for whole multiples of 32 MiB.
  const int id = make("simulate_bytes=8GiB, grow_ahead_bytes=0");
  destroyer d{id};
  void* bulk = nullptr;
  void* other = nullptr;
  REQUIRE(cudamem_allocate(id, 256 * MiB, 0, nullptr, &bulk) == CUDAMEM_OK);   // 8 x 32 MiB
  REQUIRE(cudamem_allocate(id, 260 * MiB, 0, nullptr, &other) == CUDAMEM_OK);  // 65 x 4 MiB
  const cudamem_stats at_peak = stats_of(id);
  CHECK(at_peak.reserved_bytes >= 516 * MiB);
  CHECK(at_peak.peak_reserved_bytes == at_peak.reserved_bytes);
  CHECK(at_peak.device_allocated_bytes == at_peak.reserved_bytes);  // nothing freed yet
  CHECK(at_peak.device_allocations < at_peak.reserved_bytes / (4 * MiB));  // some are 32 MiB
  std::size_t segment_bytes = 0;
  std::size_t count = 0;
  REQUIRE(cudamem_segments(id, 0, nullptr, 0, &count) == CUDAMEM_OK);
  std::vector<cudamem_segment> segments(count);
  REQUIRE(cudamem_segments(id, 0, segments.data(), count, &count) == CUDAMEM_OK);
  for (const cudamem_segment& s : segments) {
    segment_bytes += s.bytes;
  }
  CHECK(segment_bytes == at_peak.reserved_bytes);  // both resources' mapped ranges
  REQUIRE(cudamem_deallocate(id, bulk, 256 * MiB, 0, nullptr) == CUDAMEM_OK);
  REQUIRE(cudamem_deallocate(id, other, 260 * MiB, 0, nullptr) == CUDAMEM_OK);
  REQUIRE(cudamem_release(id, 0, nullptr) == CUDAMEM_OK);
  const cudamem_stats after = stats_of(id);
  CHECK(after.reserved_bytes == 0);
  CHECK(after.device_freed_bytes == after.device_allocated_bytes);
  CHECK(after.device_frees == after.device_allocations);
  REQUIRE(cudamem_reset_peak_reserved(id, 0) == CUDAMEM_OK);
  CHECK(stats_of(id).peak_reserved_bytes == 0);  // both resources' peaks
}

TEST_CASE("c api: a bulk-sized block at the reserve comes from the 4 MiB handles, counted") {
  // 2 GiB simulated, 1 GiB kept free (the default). The 4 MiB handles take the device to the
  // reserve and the blocks are freed; then a 64 MiB block, which the 32 MiB handles could
  // only have by growing into the reserve, is cut from the 4 MiB handles' free memory.
  const int id = make("simulate_bytes=2GiB, grow_ahead_bytes=0");
  destroyer d{id};
  std::vector<void*> blocks(28);
  for (void*& p : blocks) {
    REQUIRE(cudamem_allocate(id, 36 * MiB, 0, nullptr, &p) == CUDAMEM_OK);  // 1008 MiB
  }
  for (void* p : blocks) {
    REQUIRE(cudamem_deallocate(id, p, 36 * MiB, 0, nullptr) == CUDAMEM_OK);
  }
  const cudamem_stats before = stats_of(id);
  CHECK(before.bulk_declined == 0);
  void* bulk = nullptr;
  REQUIRE(cudamem_allocate(id, 64 * MiB, 0, nullptr, &bulk) == CUDAMEM_OK);
  const cudamem_stats after = stats_of(id);
  CHECK(after.bulk_declined == 1);
  CHECK(after.reserved_bytes == before.reserved_bytes);  // nothing made, nothing given back
  CHECK(after.device_allocations == before.device_allocations);
  REQUIRE(cudamem_deallocate(id, bulk, 64 * MiB, 0, nullptr) == CUDAMEM_OK);
  CHECK(stats_of(id).in_use_bytes == 0);
}

TEST_CASE("c api: the peak of reserved memory, and its reset") {
  const int id = make("simulate_bytes=8GiB, grow_ahead_bytes=0, bulk_handle_bytes=0");
  destroyer d{id};
  void* big = nullptr;
  REQUIRE(cudamem_allocate(id, GiB, 0, nullptr, &big) == CUDAMEM_OK);
  const cudamem_stats at_peak = stats_of(id);
  CHECK(at_peak.peak_reserved_bytes == at_peak.reserved_bytes);
  CHECK(at_peak.reserved_bytes >= GiB);
  CHECK(at_peak.device_allocations == GiB / (4 * MiB));  // 4 MiB handles
  CHECK(at_peak.device_frees == 0);
  REQUIRE(cudamem_deallocate(id, big, GiB, 0, nullptr) == CUDAMEM_OK);
  REQUIRE(cudamem_release(id, 0, nullptr) == CUDAMEM_OK);
  const cudamem_stats after = stats_of(id);
  CHECK(after.reserved_bytes == 0);
  CHECK(after.peak_reserved_bytes == at_peak.peak_reserved_bytes);  // a peak outlives the memory
  CHECK(after.device_frees == at_peak.device_allocations);
  CHECK(after.device_allocated_bytes == at_peak.device_allocations * 4 * MiB);
  CHECK(after.device_freed_bytes == after.device_allocated_bytes);
  REQUIRE(cudamem_reset_peak_reserved(id, 0) == CUDAMEM_OK);
  CHECK(stats_of(id).peak_reserved_bytes == 0);
  CHECK(cudamem_reset_peak_reserved(id, 99) == CUDAMEM_ERROR_INVALID_ARGUMENT);
  CHECK(cudamem_reset_peak_reserved(id, 1) == CUDAMEM_OK);  // a device not used yet: nothing
}

TEST_CASE("c api: add_peer refuses a device or a peer that does not exist, and an allocator") {
  const int id = make("simulate_bytes=1GiB");
  destroyer d{id};
  CHECK(cudamem_add_peer(id, 0, 77) == CUDAMEM_ERROR_INVALID_ARGUMENT);
  CHECK_THAT(last(), Catch::Contains("device 77 does not exist"));
  CHECK(cudamem_add_peer(id, 99, 1) == CUDAMEM_ERROR_INVALID_ARGUMENT);
  CHECK(cudamem_add_peer(77, 0, 1) == CUDAMEM_ERROR_INVALID_ARGUMENT);
  CHECK(cudamem_add_peer(id, 0, 0) == CUDAMEM_OK);  // its own device: nothing to do
}

TEST_CASE("c api: the IPC entry points refuse bad input before touching a device") {
  const int id = make("simulate_bytes=1GiB");
  destroyer d{id};
  cudamem_ipc_export e{};
  e.struct_size = sizeof(e);
  int fds[4] = {-1, -1, -1, -1};
  std::size_t count = 0;
  int x = 0;
  CHECK(cudamem_ipc_export_range(id, 0, &x, 4, nullptr, fds, 4, &count) ==
        CUDAMEM_ERROR_INVALID_ARGUMENT);
  CHECK(cudamem_ipc_export_range(id, 0, &x, 4, &e, fds, 4, nullptr) ==
        CUDAMEM_ERROR_INVALID_ARGUMENT);
  cudamem_ipc_export old_size{};
  old_size.struct_size = 8;
  CHECK(cudamem_ipc_export_range(id, 0, &x, 4, &old_size, fds, 4, &count) ==
        CUDAMEM_ERROR_INVALID_ARGUMENT);
  CHECK(cudamem_ipc_export_range(id, 0, &x, 4, &e, fds, 4, &count) ==
        CUDAMEM_ERROR_INVALID_ARGUMENT);  // nothing allocated on device 0 yet
  CHECK_THAT(last(), Catch::Contains("no memory of this allocator to share"));
  CHECK(cudamem_ipc_export_range(77, 0, &x, 4, &e, fds, 4, &count) ==
        CUDAMEM_ERROR_INVALID_ARGUMENT);
  void* base = reinterpret_cast<void*>(1);
  CHECK(cudamem_ipc_import(0, 1, fds, 1, 4 * MiB, nullptr) == CUDAMEM_ERROR_INVALID_ARGUMENT);
  CHECK(cudamem_ipc_import(0, 1, nullptr, 1, 4 * MiB, &base) == CUDAMEM_ERROR_INVALID_ARGUMENT);
  CHECK(cudamem_ipc_unmap(&x) == CUDAMEM_ERROR_INVALID_ARGUMENT);
  CHECK_THAT(last(), Catch::Contains("no memory of another process is mapped there"));
  CHECK(cudamem_ipc_add_peer(&x, 1) == CUDAMEM_ERROR_INVALID_ARGUMENT);
}

TEST_CASE("c api: a call made after the thread's thread_local objects are gone keeps no text "
          "and writes into none of them") {
  // A framework may free memory through the C API from destructors that run after the
  // calling thread's thread_local objects are destroyed: the main thread runs those at exit
  // before the static destructors. Here a worker's own thread_local, constructed before the
  // library's error text and so destroyed after it, calls in from its destructor: a failing
  // call and a succeeding one. Before the fix both wrote into the destroyed string (a
  // heap-use-after-free under AddressSanitizer; in a PyTorch process, malloc aborting at exit).
  const int id = make("simulate_bytes=256MiB");
  const destroyer cleanup{id};
  struct seen_at_exit {
    cudamem_status failed = CUDAMEM_OK;
    cudamem_status succeeded = CUDAMEM_ERROR_INTERNAL;
    std::string text;
  } seen;
  struct calls_at_thread_exit {
    int id;
    seen_at_exit* out;
    ~calls_at_thread_exit() {
      int unused = -1;
      out->failed = cudamem_allocator_create("no_such_key=1", &unused);
      cudamem_stats s{};
      s.struct_size = sizeof(s);
      out->succeeded = cudamem_get_stats(id, 0, &s);
      out->text = cudamem_last_error();
    }
  };
  cudamem_status failed_while_alive = CUDAMEM_OK;
  std::string text_while_alive;
  std::thread worker{[&] {  // no assertions here: Catch records them on the test's thread
    thread_local calls_at_thread_exit probe{id, &seen};  // before the library's text
    static_cast<void>(probe);
    int unused = -1;
    failed_while_alive = cudamem_allocator_create("no_such_key=1", &unused);
    text_while_alive = cudamem_last_error();  // long enough to live on the heap
  }};
  worker.join();
  CHECK(failed_while_alive == CUDAMEM_ERROR_INVALID_ARGUMENT);
  CHECK(text_while_alive.find("no_such_key") != std::string::npos);
  CHECK(seen.failed == CUDAMEM_ERROR_INVALID_ARGUMENT);  // the status still says why
  CHECK(seen.succeeded == CUDAMEM_OK);
  CHECK(seen.text == "cudamem: no message (the calling thread is ending)");
}
