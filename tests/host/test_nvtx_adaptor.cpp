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

namespace {
/// A device-kind leaf that, like device_resource, lets sub-allocators register NVTX heaps.
class heap_friendly final : public memory_resource {
 public:
  heap_friendly() : memory_resource(memory_kind::device, 0) {}

 private:
  void* do_allocate(std::size_t bytes, std::size_t, stream_view) override {
    return host_.allocate(bytes);
  }
  void do_deallocate(void* p, std::size_t bytes, std::size_t, stream_view) noexcept override {
    host_.deallocate(p, bytes);
  }
  bool do_allows_nvtx_heaps() const noexcept override { return true; }
  host_resource host_;
};
}  // namespace

TEST_CASE("who may register NVTX heaps: leaves that say so, adaptors over them, never a pool") {
  host_resource host;
  CHECK_FALSE(host.allows_nvtx_heaps());  // the default
  heap_friendly leaf;
  CHECK(leaf.allows_nvtx_heaps());
  nvtx_adaptor over_leaf{leaf, "a"};
  limiting_adaptor over_adaptor{over_leaf, 1 << 20};
  CHECK(over_leaf.allows_nvtx_heaps());     // adaptors ask their upstream
  CHECK(over_adaptor.allows_nvtx_heaps());
  nvtx_adaptor over_host{host, "b"};
  CHECK_FALSE(over_host.allows_nvtx_heaps());
}
