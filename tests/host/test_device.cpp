// device.hpp on any machine: with no device, clear errors; with one, bad ids still rejected.
#include <cudamem/device.hpp>
#include <cudamem/event.hpp>
#include <cudamem/stream.hpp>

#include <catch2/catch.hpp>

#include <type_traits>

using namespace cudamem;

TEST_CASE("device_count is a plain number, never an exception") {
  int count = -1;
  REQUIRE_NOTHROW(count = device_count());
  CHECK(count >= 0);
  CHECK(has_device() == (count > 0));
}

TEST_CASE("bad device ids are rejected clearly") {
  if (device_count() == 0) {
    CHECK_THROWS_AS(validate_device(0), no_device_error);
    CHECK_THROWS_AS(device_guard{0}, no_device_error);
    CHECK_THROWS_AS(get_device_properties(0), no_device_error);
    CHECK_THROWS_AS(device_memory(0), no_device_error);
    CHECK_THROWS_AS(stream{}, no_device_error);
    CHECK_THROWS_AS(event{}, no_device_error);
    CHECK_THROWS_WITH(validate_device(3), Catch::Contains("no usable CUDA device"));
  } else {
    CHECK_THROWS_AS(validate_device(-1), std::out_of_range);
    CHECK_THROWS_AS(validate_device(device_count()), std::out_of_range);
    CHECK_THROWS_WITH(validate_device(-1), Catch::Contains("device -1 does not exist"));
  }
  CHECK_THROWS_AS(get_device_properties(-1), std::exception);
}

TEST_CASE("the owners and views have the shape the contract promises") {
  STATIC_REQUIRE(std::is_trivially_copyable_v<stream_view>);
  STATIC_REQUIRE_FALSE(std::is_copy_constructible_v<stream>);
  STATIC_REQUIRE(std::is_nothrow_move_constructible_v<stream>);
  STATIC_REQUIRE(std::is_nothrow_move_assignable_v<stream>);
  STATIC_REQUIRE(std::is_nothrow_destructible_v<stream>);
  STATIC_REQUIRE_FALSE(std::is_copy_constructible_v<event>);
  STATIC_REQUIRE(std::is_nothrow_move_constructible_v<event>);
  STATIC_REQUIRE(std::is_nothrow_move_assignable_v<event>);
  STATIC_REQUIRE_FALSE(std::is_move_constructible_v<device_guard>);
  STATIC_REQUIRE(std::is_convertible_v<const stream&, stream_view>);
  STATIC_REQUIRE(std::is_convertible_v<cudaStream_t, stream_view>);
}

TEST_CASE("stream_view: default is the legacy null stream; named constants differ") {
  constexpr stream_view v{};
  STATIC_REQUIRE(v.get() == nullptr);
  CHECK(v.is_default());
  CHECK(stream_view::legacy().get() == cudaStreamLegacy);
  CHECK(stream_view::per_thread().get() == cudaStreamPerThread);
  CHECK(stream_view::per_thread().is_default());
  CHECK_FALSE(stream_view::legacy() == stream_view::per_thread());
  struct fake_ref {
    cudaStream_t get() const noexcept { return cudaStreamPerThread; }
  };
  const stream_view from_ref = fake_ref{};
  CHECK(from_ref == stream_view::per_thread());
}
