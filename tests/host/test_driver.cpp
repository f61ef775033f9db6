// detail/cuda/driver.hpp on any machine: the driver API is reached without linking libcuda (this
// executable links only cudart), a machine with no driver gets no_device_error, and driver
// results become cudamem's exceptions with the driver's name in them.
#include <cudamem/detail/cuda/driver.hpp>
#include <cudamem/device.hpp>

#include "captured_errors.hpp"

#include <catch2/catch.hpp>

#include <string>

using namespace cudamem;

TEST_CASE("driver(): no_device_error on a machine without a driver, a full table with one") {
  if (device_count() == 0) {
    CHECK_THROWS_AS(detail::driver(), no_device_error);
    CHECK_THROWS_WITH(detail::driver(), Catch::Contains("no usable CUDA device"));
    // A failed load is retried, and fails the same way again: no crash, no half table.
    CHECK_THROWS_AS(detail::driver(), no_device_error);
  } else {
    const detail::driver_api& cu = detail::driver();
    CHECK(cu.ctx_create != nullptr);
    CHECK(cu.mem_get_allocation_granularity != nullptr);
    CHECK(cu.mem_export_to_shareable_handle != nullptr);
    CHECK(cu.mem_import_from_shareable_handle != nullptr);
    CHECK(cu.mem_get_allocation_properties_from_handle != nullptr);
    CHECK(&detail::driver() == &cu);  // loaded once
    int version = 0;
    REQUIRE(cu.driver_get_version(&version) == CUDA_SUCCESS);
    CHECK(version >= 12050);
  }
}

TEST_CASE("driver results map to the runtime code with the same meaning") {
  STATIC_REQUIRE(to_runtime_error(CUDA_ERROR_OUT_OF_MEMORY) == cudaErrorMemoryAllocation);
  STATIC_REQUIRE(to_runtime_error(CUDA_ERROR_DEINITIALIZED) == cudaErrorCudartUnloading);
  STATIC_REQUIRE(to_runtime_error(CUDA_ERROR_CONTEXT_ALREADY_CURRENT) == cudaErrorUnknown);
  STATIC_REQUIRE(to_runtime_error(CUDA_ERROR_ALREADY_MAPPED) == cudaErrorAlreadyMapped);
  STATIC_REQUIRE(is_no_device(CUDA_ERROR_NO_DEVICE));
  STATIC_REQUIRE(is_no_device(CUDA_ERROR_STUB_LIBRARY));
  STATIC_REQUIRE_FALSE(is_no_device(CUDA_ERROR_OUT_OF_MEMORY));
  STATIC_REQUIRE(is_teardown(CUDA_ERROR_DEINITIALIZED));
  STATIC_REQUIRE_FALSE(is_teardown(CUDA_ERROR_INVALID_VALUE));
}

TEST_CASE("check_driver throws the right type and names the call") {
  CHECK_NOTHROW(detail::check_driver(CUDA_SUCCESS, "nothing"));
  CHECK_THROWS_AS(detail::check_driver(CUDA_ERROR_NO_DEVICE, "cuDeviceGet"), no_device_error);
  CHECK_THROWS_AS(detail::check_driver(CUDA_ERROR_STUB_LIBRARY, "cuInit"), no_device_error);
  try {
    detail::check_driver(CUDA_ERROR_OUT_OF_MEMORY, "cuCtxCreate");
    FAIL("check_driver did not throw");
  } catch (const driver_error& e) {
    CHECK(e.result() == CUDA_ERROR_OUT_OF_MEMORY);
    CHECK(e.code() == cudaErrorMemoryAllocation);
    const std::string what = e.what();
    CHECK_THAT(what, Catch::Contains("cuCtxCreate"));
    CHECK_THAT(what, Catch::Contains("test_driver.cpp"));  // the caller's line, not ours
    if (has_device()) {
      CHECK(e.result_name() == "CUDA_ERROR_OUT_OF_MEMORY");
      CHECK_THAT(what, Catch::Contains("CUDA_ERROR_OUT_OF_MEMORY"));
    } else {
      CHECK_THAT(what, Catch::Contains("CUresult 2"));  // no driver to name it: the number
    }
  }
  // A driver_error is a cuda_error: one catch clause serves both APIs.
  CHECK_THROWS_AS(detail::check_driver(CUDA_ERROR_INVALID_VALUE, "cuMemMap"), cuda_error);
  CHECK_THROWS_AS(detail::check_driver(CUDA_ERROR_INVALID_VALUE, "cuMemMap"), driver_error);
}

TEST_CASE("report_driver_error: to the handler, quiet at teardown and on success") {
  const cudamem_test::captured_errors captured;
  detail::report_driver_error(CUDA_SUCCESS, "fine");
  detail::report_driver_error(CUDA_ERROR_DEINITIALIZED, "at exit");
  CHECK(captured.messages().empty());
  detail::report_driver_error(CUDA_ERROR_INVALID_CONTEXT, "cuCtxDestroy");
  REQUIRE(captured.messages().size() == 1);
  CHECK_THAT(captured.messages()[0], Catch::Contains("cuCtxDestroy"));
}

TEST_CASE("the no-driver error names the caller's line") {
  if (device_count() != 0) {
    SUCCEED("a driver is present");
    return;
  }
  try {
    static_cast<void>(detail::driver());
    FAIL("driver() did not throw");
  } catch (const no_device_error& e) {
    CHECK_THAT(std::string(e.where().file_name()), Catch::EndsWith("test_driver.cpp"));
    CHECK_THAT(std::string(e.what()), Catch::Contains("driver"));
  }
}
