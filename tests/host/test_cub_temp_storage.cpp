// with_temp_storage's protocol without a GPU: a CUB-shaped callable stands for CUB (a size
// query with a null pointer, then the run), over a resource that records what reaches it. The
// order of the calls, the bytes, the stream of the free, the zero-byte case CUB would
// misread, and every failure path (query error, run error, throwing callable, failed
// allocation, host memory) leaving nothing allocated.
#include <cudamem/cub_temp_storage.hpp>
#include <cudamem/failing_adaptor.hpp>
#include <cudamem/host_resource.hpp>
#include <cudamem/out_of_memory.hpp>

#include "fake_device_memory.hpp"
#include "hidden_devices.hpp"

#include <catch2/catch.hpp>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

using namespace cudamem;
using cudamem_test::fake_device_memory;

namespace {

const stream_view stream_a{reinterpret_cast<cudaStream_t>(std::uintptr_t{0x1000})};

/// What a CUB call sees: each call's pointer and size, and what it answers.
struct fake_cub_call {
  explicit fake_cub_call(std::size_t needed_bytes) : needed(needed_bytes) {}
  std::size_t needed;
  cudaError_t query_result = cudaSuccess;
  cudaError_t run_result = cudaSuccess;
  bool throw_in_run = false;
  struct seen {
    void* temp;
    std::size_t bytes;
  };
  std::vector<seen> calls;

  cudaError_t operator()(void* temp, std::size_t& bytes) {
    calls.push_back({temp, bytes});
    if (temp == nullptr) {  // CUB's convention: a null pointer asks for the size
      bytes = needed;
      return query_result;
    }
    if (throw_in_run) {
      throw std::runtime_error("a launch helper threw");
    }
    if (bytes > 0) {
      static_cast<unsigned char*>(temp)[bytes - 1] = 1;  // the storage is really there
    }
    return run_result;
  }
};

}  // namespace

static_assert(two_phase_call<fake_cub_call>);
static_assert(!two_phase_call<int (*)(void*, std::size_t&)>);  // must return cudaError_t

TEST_CASE("with_temp_storage: query, allocate the answer, run with it, free it on the stream") {
  REQUIRE(cudamem_test::devices_hidden);  // the stream handle here is made up
  fake_device_memory mr;
  fake_cub_call call{5000};
  CHECK(with_temp_storage(mr, stream_a, call) == 5000);
  REQUIRE(call.calls.size() == 2);
  CHECK(call.calls[0].temp == nullptr);
  CHECK(call.calls[1].temp != nullptr);
  CHECK(call.calls[1].bytes == 5000);
  CHECK(reinterpret_cast<std::uintptr_t>(call.calls[1].temp) % 256 == 0);
  CHECK(mr.allocations == 1);
  CHECK(mr.deallocations == 1);
  CHECK(mr.last_free_stream == stream_a);
  CHECK(mr.used_bytes() == 0);
}

TEST_CASE("with_temp_storage: a zero-byte answer still gets a real pointer (a null one means 'query')") {
  fake_device_memory mr;
  fake_cub_call call{0};
  CHECK(with_temp_storage(mr, stream_a, call) == 0);
  REQUIRE(call.calls.size() == 2);
  CHECK(call.calls[1].temp != nullptr);
  CHECK(mr.allocations == 1);
  CHECK(mr.used_bytes() == 0);
}

TEST_CASE("with_temp_storage: every failure throws its typed error and leaves nothing allocated") {
  fake_device_memory mr;
  SECTION("the size query fails: nothing is allocated, the run never happens") {
    fake_cub_call call{100};
    call.query_result = cudaErrorInvalidValue;
    try {
      with_temp_storage(mr, stream_a, call);
      FAIL("no error");
    } catch (const cuda_error& e) {
      CHECK(e.code() == cudaErrorInvalidValue);
      CHECK(std::string(e.what()).find("size query") != std::string::npos);
    }
    CHECK(call.calls.size() == 1);
    CHECK(mr.allocations == 0);
  }
  SECTION("the run fails: the storage is freed on the stream") {
    fake_cub_call call{100};
    call.run_result = cudaErrorLaunchFailure;
    try {
      with_temp_storage(mr, stream_a, call);
      FAIL("no error");
    } catch (const cuda_error& e) {
      CHECK(e.code() == cudaErrorLaunchFailure);
      CHECK(std::string(e.what()).find("the run") != std::string::npos);
    }
    CHECK(mr.deallocations == 1);
    CHECK(mr.last_free_stream == stream_a);
  }
  SECTION("the callable throws: the exception passes through, the storage is freed") {
    fake_cub_call call{100};
    call.throw_in_run = true;
    CHECK_THROWS_AS(with_temp_storage(mr, stream_a, call), std::runtime_error);
    CHECK(mr.deallocations == 1);
  }
  SECTION("the allocation fails: out_of_memory, and the run never happens") {
    failing_adaptor faults{mr};
    faults.fail_call(1);
    fake_cub_call call{100};
    CHECK_THROWS_AS(with_temp_storage(faults, stream_a, call), out_of_memory);
    CHECK(call.calls.size() == 1);
  }
  SECTION("host memory is refused before the first call") {
    host_resource host;
    fake_cub_call call{100};
    CHECK_THROWS_AS(with_temp_storage(host, stream_a, call), std::invalid_argument);
    CHECK(call.calls.empty());
  }
  CHECK(mr.used_bytes() == 0);
}
