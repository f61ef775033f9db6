// error.hpp: typed CUDA errors, the no-device type, the error handler.
#include <cudamem/error.hpp>

#include <catch2/catch.hpp>

#include "captured_errors.hpp"

#include <cstring>
#include <string>

using namespace cudamem;

TEST_CASE("check() is silent on success") { REQUIRE_NOTHROW(check(cudaSuccess)); }

TEST_CASE("check() throws cuda_error with the code, its name, context and the caller's line") {
  const unsigned line = __LINE__ + 2;
  try {
    check(cudaErrorMemoryAllocation, "cudaMalloc of 1 GiB");
    FAIL("check did not throw");
  } catch (const no_device_error&) {
    FAIL("out of memory is not 'no device'");
  } catch (const cuda_error& e) {
    CHECK(e.code() == cudaErrorMemoryAllocation);
    CHECK(std::string(e.name()) == "cudaErrorMemoryAllocation");
    CHECK(std::string(e.description()).size() > 0);
    CHECK(e.where().line() == line);
    CHECK(std::string(e.where().file_name()).find("test_error.cpp") != std::string::npos);
    const std::string what = e.what();
    CHECK(what.find("cudaMalloc of 1 GiB") != std::string::npos);
    CHECK(what.find("cudaErrorMemoryAllocation") != std::string::npos);
    CHECK(what.find("test_error.cpp:" + std::to_string(line)) != std::string::npos);
  }
}

TEST_CASE("cuda_error is a std::runtime_error") {
  REQUIRE_THROWS_AS(check(cudaErrorInvalidValue), std::runtime_error);
}

TEST_CASE("no usable device is its own type, with advice") {
  for (cudaError_t code : {cudaErrorNoDevice, cudaErrorInsufficientDriver, cudaErrorStubLibrary}) {
    CAPTURE(code);
    CHECK(is_no_device(code));
    try {
      check(code);
      FAIL("no throw");
    } catch (const no_device_error& e) {
      const std::string what = e.what();
      CHECK(what.find("no usable CUDA device") != std::string::npos);
      CHECK((what.find("nvidia-smi") != std::string::npos ||
             what.find("update the driver") != std::string::npos));
      CHECK(e.code() == code);
    }
  }
  CHECK_FALSE(is_no_device(cudaErrorMemoryAllocation));
  CHECK_FALSE(is_no_device(cudaSuccess));
}

TEST_CASE("report_error goes to the installed handler, teardown errors go nowhere") {
  cudamem_test::captured_errors errors;
  report_error(cudaErrorInvalidValue, "freeing in a destructor");
  REQUIRE(errors.messages().size() == 1);
  CHECK(errors.messages()[0] == "freeing in a destructor");

  report_error(cudaErrorCudartUnloading, "at exit");
  report_error(cudaSuccess, "nothing wrong");
  CHECK(errors.messages().size() == 1);

  report_problem("a leak");
  REQUIRE(errors.messages().size() == 2);
  CHECK(errors.messages()[1] == "a leak");
}

TEST_CASE("set_error_handler returns the previous handler; null restores the default") {
  const error_handler original = get_error_handler();
  CHECK(original == &print_error);
  {
    cudamem_test::captured_errors errors;
    CHECK(get_error_handler() != &print_error);
  }
  CHECK(get_error_handler() == original);
  const error_handler before = set_error_handler(nullptr);
  CHECK(before == original);
  CHECK(get_error_handler() == &print_error);
}
