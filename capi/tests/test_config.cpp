// The C API's configuration: sizes, keys, sources, and every way a value is refused.
#include "config.hpp"

#include <cudamem/detail/vm/options.hpp>  // max_recent_frees, which config.hpp copies

#include <catch2/catch.hpp>

#include <map>
#include <string>

using namespace cudamem::capi;

namespace {
constexpr std::size_t MiB = std::size_t{1} << 20;
constexpr std::size_t GiB = std::size_t{1} << 30;

/// What a config_error says when `f` throws it; fails the test if it does not.
template <class F>
std::string refusal(F&& f) {
  try {
    f();
  } catch (const config_error& e) {
    return e.what();
  }
  FAIL("no config_error");
  return {};
}

/// A pretend environment.
struct environment {
  std::map<std::string, std::string> vars;
  const char* operator()(const char* name) const {
    const auto it = vars.find(name);
    return it == vars.end() ? nullptr : it->second.c_str();
  }
};
}  // namespace

TEST_CASE("capi config: sizes with and without units") {
  CHECK(parse_size("0") == 0u);
  CHECK(parse_size("4096") == 4096u);
  CHECK(parse_size(" 64KiB ") == std::size_t{64} << 10);
  CHECK(parse_size("2M") == 2 * MiB);
  CHECK(parse_size("2mib") == 2 * MiB);
  CHECK(parse_size("8 GiB") == 8 * GiB);
  CHECK(parse_size("1TiB") == std::size_t{1} << 40);
  CHECK(parse_size("12b") == 12u);
  CHECK_FALSE(parse_size(""));
  CHECK_FALSE(parse_size("GiB"));
  CHECK_FALSE(parse_size("-1"));
  CHECK_FALSE(parse_size("1.5GiB"));
  CHECK_FALSE(parse_size("8GB"));                     // decimal units are not guessed at
  CHECK_FALSE(parse_size("99999999999999999999"));    // more than 64 bits
  CHECK_FALSE(parse_size("17179869184TiB"));          // 2^34 TiB: overflows when scaled
}

TEST_CASE("capi config: defaults, text, and describe") {
  allocator_config c;
  CHECK(c.resource == resource_choice::vm_pool);
  CHECK_FALSE(c.limit_bytes);
  CHECK(c.raise_on_oom);
  CHECK(describe(c) ==
        "resource=vm_pool, limit_bytes=none, grow_ahead_bytes=default, handle_bytes=default, "
        "keep_free_bytes=default, bulk_handle_bytes=default, recent_frees=default, "
        "raise_on_oom=1");
  apply_config_text(c, " limit_bytes = 8GiB ,grow_ahead_bytes=0,, handle_bytes=32MiB ", "test");
  CHECK(c.limit_bytes == 8 * GiB);
  CHECK(c.grow_ahead_bytes == 0u);
  CHECK(c.handle_bytes == 32 * MiB);
  CHECK(describe(c) ==
        "resource=vm_pool, limit_bytes=8589934592, grow_ahead_bytes=0, handle_bytes=33554432, "
        "keep_free_bytes=default, bulk_handle_bytes=default, recent_frees=default, "
        "raise_on_oom=1");
  CHECK(bulk_handle_bytes(c) == 0u);  // 32 MiB handles: the default bulk size is no larger
  apply_config_text(c, "keep_free_bytes=1GiB", "test");
  CHECK(c.keep_free_bytes == GiB);
  apply_config_text(c, "keep_free_bytes=0", "test");  // 0: grow while the device has room
  CHECK(c.keep_free_bytes == 0u);

  // Bulk blocks: 32 MiB by default where the handle size divides it; 0 turns them off.
  allocator_config b;
  CHECK(bulk_handle_bytes(b) == 32 * MiB);  // the default 4 MiB handles
  apply_config_text(b, "handle_bytes=8MiB", "test");
  CHECK(bulk_handle_bytes(b) == 32 * MiB);
  apply_config_text(b, "handle_bytes=6MiB", "test");
  CHECK(bulk_handle_bytes(b) == 0u);  // 6 MiB does not divide 32 MiB: none
  apply_config_text(b, "handle_bytes=4MiB, bulk_handle_bytes=64MiB", "test");
  CHECK(bulk_handle_bytes(b) == 64 * MiB);
  apply_config_text(b, "bulk_handle_bytes=0", "test");
  CHECK(bulk_handle_bytes(b) == 0u);
  CHECK(describe(b).find("bulk_handle_bytes=0") != std::string::npos);

  // Recent frees: a count, 0 (none) to the most vm_resource accepts.
  allocator_config r;
  CHECK_FALSE(r.recent_frees);
  apply_config_text(r, "recent_frees=64", "test");
  CHECK(r.recent_frees == 64u);
  apply_config_text(r, "recent_frees = 0", "test");
  CHECK(r.recent_frees == 0u);
  apply_config_text(r, "recent_frees=256", "test");
  CHECK(r.recent_frees == 256u);
  CHECK(describe(r).find("recent_frees=256") != std::string::npos);
  CHECK(max_recent_frees == cudamem::max_recent_frees);  // the parser's copy agrees

  allocator_config p;
  apply_config_text(p, "resource=Pool, raise_on_oom=off, simulate_bytes=1GiB", "test");
  CHECK(p.resource == resource_choice::pool);
  CHECK_FALSE(p.raise_on_oom);
  CHECK(describe(p) ==
        "resource=pool, limit_bytes=none, simulate_bytes=1073741824, raise_on_oom=0");
  apply_config_text(p, "", "test");  // nothing: unchanged
  CHECK(p.resource == resource_choice::pool);
}

TEST_CASE("capi config: bad values are refused with the key, the value and the source") {
  allocator_config c;
  const allocator_config before = c;
  CHECK(refusal([&] { apply_config_text(c, "resource=vmpool", "install()"); }) ==
        "cudamem: resource=vmpool (from install()): unknown resource; one of vm_pool, pool, "
        "async");
  CHECK_THAT(refusal([&] { apply_config_text(c, "limit_bytes=lots", "x"); }),
             Catch::Contains("limit_bytes=lots (from x): not a size"));
  CHECK_THAT(refusal([&] { apply_config_text(c, "limit_bytes=0", "x"); }),
             Catch::Contains("must be more than 0"));
  CHECK_THAT(refusal([&] { apply_config_text(c, "handle_bytes=3MiB", "x"); }),
             Catch::Contains("multiple of 2 MiB"));
  CHECK_THAT(refusal([&] { apply_config_text(c, "raise_on_oom=maybe", "x"); }),
             Catch::Contains("not a boolean"));
  CHECK_THAT(refusal([&] { apply_config_text(c, "limit=4GiB", "x"); }),
             Catch::Contains("unknown key 'limit' (from x); known keys: resource, limit_bytes"));
  CHECK_THAT(refusal([&] { apply_config_text(c, "resource", "x"); }),
             Catch::Contains("'resource' (from x) is not key=value"));
  // A key that does not apply to the resource, whatever the order they came in.
  CHECK_THAT(refusal([&] { apply_config_text(c, "grow_ahead_bytes=0, resource=pool", "x"); }),
             Catch::Contains("grow_ahead_bytes (set in x or by CUDAMEM_GROW_AHEAD_BYTES) "
                             "applies to resource=vm_pool only, not resource=pool"));
  CHECK_THAT(refusal([&] { apply_config_text(c, "resource=pool, keep_free_bytes=1GiB", "x"); }),
             Catch::Contains("keep_free_bytes (set in x or by CUDAMEM_KEEP_FREE_BYTES) "
                             "applies to resource=vm_pool only, not resource=pool"));
  CHECK_THAT(refusal([&] { apply_config_text(c, "bulk_handle_bytes=3MiB", "x"); }),
             Catch::Contains("bulk_handle_bytes=3MiB (from x): must be 0 (none) or a multiple "
                             "of 2 MiB"));
  for (const char* text : {"bulk_handle_bytes=4MiB", "bulk_handle_bytes=6MiB",
                           "handle_bytes=64MiB, bulk_handle_bytes=32MiB"}) {
    CAPTURE(text);
    CHECK_THAT(refusal([&] { apply_config_text(c, text, "x"); }),
               Catch::Contains("(set in x or by CUDAMEM_BULK_HANDLE_BYTES) must be 0 or a "
                               "multiple of the handle size"));
  }
  CHECK_THAT(refusal([&] { apply_config_text(c, "resource=pool, bulk_handle_bytes=0", "x"); }),
             Catch::Contains("bulk_handle_bytes (set in x or by CUDAMEM_BULK_HANDLE_BYTES) "
                             "applies to resource=vm_pool only"));
  for (const char* text : {"recent_frees=257", "recent_frees=16KiB", "recent_frees=-1",
                           "recent_frees=many", "recent_frees=", "recent_frees=1e3"}) {
    CAPTURE(text);
    CHECK_THAT(refusal([&] { apply_config_text(c, text, "x"); }),
               Catch::Contains("(from x): not a count from 0 to 256 (blocks kept aside once "
                               "freed; 0: none)"));
  }
  CHECK_THAT(refusal([&] { apply_config_text(c, "resource=async, recent_frees=4", "x"); }),
             Catch::Contains("recent_frees (set in x or by CUDAMEM_RECENT_FREES) applies to "
                             "resource=vm_pool only, not resource=async"));
  CHECK_THAT(refusal([&] { apply_config_text(c, "keep_free_bytes=-1", "x"); }),
             Catch::Contains("keep_free_bytes=-1 (from x): not a size"));
  CHECK_THAT(refusal([&] { apply_config_text(c, "resource=async, simulate_bytes=1GiB", "x"); }),
             Catch::Contains("cannot simulate resource=async"));
  // All or nothing: a good key before a bad one is not applied either.
  CHECK_THROWS_AS(apply_config_text(c, "limit_bytes=1GiB, resource=nope", "x"), config_error);
  CHECK(describe(c) == describe(before));
}

TEST_CASE("capi config: environment variables, checked whole and named in the message") {
  CHECK(environment_name("grow_ahead_bytes") == "CUDAMEM_GROW_AHEAD_BYTES");
  allocator_config c;
  apply_environment(c, environment{{{"CUDAMEM_RESOURCE", "pool"},
                                    {"CUDAMEM_LIMIT_BYTES", "2GiB"},
                                    {"CUDAMEM_NO_NVML", "1"}}});  // others: not ours
  CHECK(c.resource == resource_choice::pool);
  CHECK(c.limit_bytes == 2 * GiB);
  // An explicit text overrides the environment key by key.
  apply_config_text(c, "resource=vm_pool", "install()");
  CHECK(c.resource == resource_choice::vm_pool);
  CHECK(c.limit_bytes == 2 * GiB);

  allocator_config d;
  CHECK(refusal([&] { apply_environment(d, environment{{{"CUDAMEM_LIMIT_BYTES", "2GB"}}}); }) ==
        "cudamem: limit_bytes=2GB (from environment variable CUDAMEM_LIMIT_BYTES): not a size "
        "(bytes, optionally with a unit: 512, 64KiB, 2MiB, 8GiB, 1TiB)");
  CHECK_THAT(refusal([&] {
               apply_environment(d, environment{{{"CUDAMEM_RESOURCE", "async"},
                                                 {"CUDAMEM_GROW_AHEAD_BYTES", "0"}}});
             }),
             Catch::Contains("applies to resource=vm_pool only"));
  CHECK_FALSE(d.limit_bytes);  // nothing applied

  allocator_config e;
  apply_environment(e, environment{{{"CUDAMEM_RECENT_FREES", "0"}}});
  CHECK(e.recent_frees == 0u);
  CHECK_THAT(refusal([&] {
               apply_environment(e, environment{{{"CUDAMEM_RECENT_FREES", "300"}}});
             }),
             Catch::Contains("recent_frees=300 (from environment variable CUDAMEM_RECENT_FREES): "
                             "not a count"));
}
