// context.hpp, primary_context.hpp, limit_guard.hpp, sync_guard.hpp, device_scope.hpp on any
// machine: bad input is refused before anything is created, and a machine with no driver gets
// no_device_error from every owner and guard, never a crash. Their shapes are checked too.
#include <cudamem/context.hpp>
#include <cudamem/device_scope.hpp>
#include <cudamem/limit_guard.hpp>
#include <cudamem/primary_context.hpp>
#include <cudamem/sync_guard.hpp>

#include "captured_errors.hpp"

#include <catch2/catch.hpp>

#include <cstdint>
#include <memory>
#include <type_traits>

using namespace cudamem;

TEST_CASE("owners are move-only with noexcept moves and destructors; guards are pinned") {
  STATIC_REQUIRE_FALSE(std::is_copy_constructible_v<context>);
  STATIC_REQUIRE_FALSE(std::is_copy_assignable_v<context>);
  STATIC_REQUIRE(std::is_nothrow_move_constructible_v<context>);
  STATIC_REQUIRE(std::is_nothrow_move_assignable_v<context>);
  STATIC_REQUIRE(std::is_nothrow_destructible_v<context>);
  STATIC_REQUIRE_FALSE(std::is_copy_constructible_v<primary_context>);
  STATIC_REQUIRE(std::is_nothrow_move_constructible_v<primary_context>);
  STATIC_REQUIRE(std::is_nothrow_move_assignable_v<primary_context>);
  STATIC_REQUIRE(std::is_nothrow_destructible_v<primary_context>);
  STATIC_REQUIRE_FALSE(std::is_move_constructible_v<context_guard>);
  STATIC_REQUIRE_FALSE(std::is_move_constructible_v<limit_guard>);
  STATIC_REQUIRE_FALSE(std::is_move_constructible_v<heap_limit_guard>);
  STATIC_REQUIRE_FALSE(std::is_move_constructible_v<synchronize_on_exit>);
  STATIC_REQUIRE_FALSE(std::is_move_constructible_v<synchronize_device_on_exit>);
  STATIC_REQUIRE_FALSE(std::is_move_constructible_v<device_scope>);
  STATIC_REQUIRE(std::is_nothrow_destructible_v<device_scope>);
  // Implicit conversions that would hide a mistake are absent.
  STATIC_REQUIRE_FALSE(std::is_convertible_v<int, primary_context>);
  STATIC_REQUIRE_FALSE(std::is_convertible_v<const context&, context_guard>);
}

TEST_CASE("context flags are validated before any device or driver is touched") {
  CHECK_NOTHROW(validate_context_flags(CU_CTX_SCHED_AUTO));
  CHECK_NOTHROW(validate_context_flags(CU_CTX_SCHED_BLOCKING_SYNC | CU_CTX_LMEM_RESIZE_TO_MAX));
  CHECK_THROWS_AS(validate_context_flags(0x100), std::invalid_argument);
  CHECK_THROWS_AS(validate_context_flags(CU_CTX_SCHED_SPIN | CU_CTX_SCHED_YIELD),
                  std::invalid_argument);
  CHECK_THROWS_WITH(validate_context_flags(CU_CTX_SCHED_SPIN | CU_CTX_SCHED_YIELD),
                    Catch::Contains("more than one scheduling mode"));
  // The owner validates first, so this is the same answer with or without a GPU.
  CHECK_THROWS_AS(context({.device = 0, .flags = 0xFFFF'FFFFu}), std::invalid_argument);
}

TEST_CASE("context_guard refuses a null context") {
  CHECK_THROWS_AS(context_guard{static_cast<CUcontext>(nullptr)}, std::invalid_argument);
}

TEST_CASE("no driver: every owner and guard throws no_device_error and changes nothing") {
  if (has_device()) {
    SUCCEED("a device is present: the GPU tests cover these types");
    return;
  }
  const cudamem_test::captured_errors captured;
  CHECK_THROWS_AS(primary_context{0}, no_device_error);
  CHECK_THROWS_AS(primary_context_state(0), no_device_error);
  CHECK_THROWS_AS(context{}, no_device_error);
  CHECK_THROWS_AS(context({.device = 0}), no_device_error);
  CHECK_THROWS_AS(current_context(), no_device_error);
  // A guard given a (bogus, non-null) handle must not call into a driver that is not there.
  CHECK_THROWS_AS(context_guard{reinterpret_cast<CUcontext>(std::uintptr_t{0x1000})},
                  no_device_error);
  CHECK_THROWS_AS(limit_guard(cudaLimitStackSize, 4096), no_device_error);
  CHECK_THROWS_AS(heap_limit_guard{std::size_t{64} << 20}, no_device_error);
  CHECK_THROWS_AS(get_limit(cudaLimitMallocHeapSize), no_device_error);
  CHECK_THROWS_AS(synchronize_device_on_exit{}, no_device_error);
  CHECK_THROWS_AS(synchronize_device_on_exit{0}, no_device_error);
  CHECK_THROWS_AS(device_scope{}, no_device_error);
  CHECK_THROWS_AS(device_scope({.device = 0, .verify_memory = true}), no_device_error);
  CHECK_THROWS_WITH(primary_context{0}, Catch::Contains("no usable CUDA device"));
  CHECK_THROWS_WITH(context({.device = 0}), Catch::Contains("no usable CUDA device"));
  // Nothing was created, so nothing was destroyed or reported.
  CHECK(captured.messages().empty());
}

TEST_CASE("no driver: a stream sync guard constructs (it touches nothing) and reports on exit") {
  if (has_device()) {
    SUCCEED("a device is present");
    return;
  }
  const cudamem_test::captured_errors captured;
  {
    synchronize_on_exit wait_for{stream_view{}};
    CHECK_THROWS_AS(wait_for.finish(), no_device_error);  // the normal path throws
  }
  CHECK(captured.messages().empty());  // finish() disarmed it
  {
    synchronize_on_exit wait_for{stream_view{}};
  }  // the destructor cannot throw: the failure goes to the handler, once
  REQUIRE(captured.messages().size() == 1);
  CHECK_THAT(captured.messages()[0], Catch::Contains("synchronize_on_exit"));
  {
    synchronize_on_exit wait_for{stream_view{}};
    wait_for.dismiss();
  }
  CHECK(captured.messages().size() == 1);  // dismissed: no wait, no report
}

TEST_CASE("memory_check: ok within the tolerance, a shortfall described") {
  memory_check check{.device = 0, .free_before = 100 << 20, .free_after = 98 << 20,
                     .tolerance = 4 << 20, .verified = true};
  CHECK(check.ok());
  CHECK(check.missing_bytes() == std::size_t{2} << 20);
  check.free_after = 4 << 20;
  CHECK_FALSE(check.ok());
  CHECK(check.missing_bytes() == std::size_t{96} << 20);
  CHECK_THAT(check.describe(), Catch::Contains("96.0 MiB") && Catch::Contains("did not come back"));
  check.free_after = 200 << 20;  // more free than before is never a failure
  CHECK(check.ok());
  CHECK(check.missing_bytes() == 0);
  const memory_check unverified{};
  CHECK(unverified.ok());
  CHECK_THAT(unverified.describe(), Catch::Contains("not verified"));
}
