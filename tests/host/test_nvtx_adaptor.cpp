// nvtx_adaptor: forwards in the form a request arrived in, counts bytes in use exactly, keeps
// an out_of_memory's report with itself at its head, and refuses an empty name. (No NVTX tool
// is attached here, so its calls return at once; what a tool sees is checked on a GPU machine
// with Nsight, not in CI.)
#include <cudamem/host_resource.hpp>
#include <cudamem/limiting_adaptor.hpp>
#include <cudamem/nvtx_adaptor.hpp>
#include <cudamem/out_of_memory.hpp>

#include <catch2/catch.hpp>

#include <stdexcept>
#include <thread>
#include <vector>

using namespace cudamem;

TEST_CASE("nvtx_adaptor forwards and counts the bytes in use") {
  host_resource host;
  nvtx_adaptor traced{host, "scratch"};
  CHECK(traced.label() == "scratch");
  CHECK(traced.upstream() == &host);
  void* a = traced.allocate(1000);
  void* b = traced.allocate(24, 64);
  CHECK(traced.bytes_in_use() == 1024);
  CHECK(host.stats().used_bytes == 1024);
  traced.deallocate(a, 1000);
  CHECK(traced.bytes_in_use() == 24);
  traced.deallocate(b, 24, 64);
  CHECK(traced.bytes_in_use() == 0);
  CHECK(host.stats().used_bytes == 0);
}

TEST_CASE("nvtx_adaptor: a failed allocation changes no count and names the adaptor") {
  host_resource host;
  limiting_adaptor budget{host, 4096};
  nvtx_adaptor traced{budget, "weights"};
  void* a = traced.allocate(4096);
  try {
    static_cast<void>(traced.allocate(1));
    FAIL("the budget should have refused");
  } catch (const out_of_memory& e) {
    REQUIRE(!e.report().chain.empty());
    CHECK(e.report().chain.front().name == "nvtx_adaptor");
  }
  CHECK(traced.bytes_in_use() == 4096);
  traced.deallocate(a, 4096);
  CHECK(traced.bytes_in_use() == 0);
}

TEST_CASE("nvtx_adaptor: bad input") {
  host_resource host;
  CHECK_THROWS_AS(nvtx_adaptor(host, ""), std::invalid_argument);
  nvtx_adaptor traced{host, "x"};
  CHECK_THROWS_AS(traced.allocate(8, 3), std::invalid_argument);  // checked where it enters
  CHECK(traced.bytes_in_use() == 0);
}

TEST_CASE("nvtx_adaptor counts exactly under racing threads") {
  host_resource host;
  nvtx_adaptor traced{host, "threads"};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < 2000; ++i) {
        void* p = traced.allocate(256);
        traced.deallocate(p, 256);
      }
    });
  }
  void* held = traced.allocate(512);
  for (auto& th : threads) {
    th.join();
  }
  CHECK(traced.bytes_in_use() == 512);
  traced.deallocate(held, 512);
  CHECK(traced.bytes_in_use() == 0);
}
