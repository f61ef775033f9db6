// Importers of memory shared between processes (ipc_pool.hpp, vm_ipc.hpp), without a GPU:
// - which devices get access (detail::import_access, over a made-up device table): the
//   importing thread's current device when it is not the memory's, then access_from, each
//   once; a device with no peer path refused with an ipc_error naming both devices; an id that
//   does not exist std::out_of_range, before any peer path is asked about;
// - imported_pool and imported_vm_block on a machine with no device: the input checks that come
//   before CUDA (a closed fd, a descriptor of another version or that does not fit its fds),
//   then the memory's device, which this process cannot see.
// The GPU side (an importer on the other GPU running a kernel on the memory, killed mid-use) is
// tests/gpu/test_two_gpus.cu.
#include "hidden_devices.hpp"  // first: CUDA must see no device, GPU or not

#include <cudamem/ipc_pool.hpp>
#include <cudamem/vm_ipc.hpp>

#include <catch2/catch.hpp>

#include <unistd.h>

#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

using namespace cudamem;
using Catch::Matchers::Contains;

namespace {

/// Every device reaches every other.
bool all_reach(int, int) { return true; }
/// No device reaches another's memory.
bool none_reach(int a, int b) { return a == b; }

/// The message of the ipc_error `call` throws (a failed check if it throws none).
template <class Call>
std::string ipc_error_text(Call&& call) {
  try {
    call();
  } catch (const ipc_error& e) {
    return e.what();
  }
  FAIL("no ipc_error");
  return {};
}

/// An open descriptor (a pipe's read end) and its other end, closed with the pair.
struct open_fd {
  unique_fd read;
  unique_fd write;
  open_fd() {
    int ends[2] = {-1, -1};
    REQUIRE(::pipe(ends) == 0);
    read.reset(ends[0]);
    write.reset(ends[1]);
  }
  [[nodiscard]] unique_fd dup() const { return unique_fd{::dup(read.get())}; }
};

/// A descriptor that is not open in this process.
unique_fd closed_fd() {
  open_fd pipe;
  const int number = pipe.read.get();
  pipe.read.reset();
  return unique_fd{number};
}

}  // namespace

TEST_CASE("import_access: the importing thread's device gets access when it is not the memory's") {
  using detail::import_access;
  CHECK(import_access("imported_pool", 0, 0, {}, 2, all_reach).empty());  // the memory's own
  CHECK(import_access("imported_pool", 0, 1, {}, 2, all_reach) == std::vector<int>{1});
  CHECK(import_access("imported_pool", 3, 1, {}, 4, all_reach) == std::vector<int>{1});
}

TEST_CASE("import_access: access_from adds more devices, each once, never the memory's own") {
  using detail::import_access;
  const std::vector<int> from{2, 0, 3, 2, 1};
  CHECK(import_access("imported_vm_block", 0, 1, from, 4, all_reach) ==
        std::vector<int>{1, 2, 3});
  CHECK(import_access("imported_vm_block", 0, 0, from, 4, all_reach) ==
        std::vector<int>{2, 3, 1});
}

TEST_CASE("import_access: a device with no peer path to the memory is refused, naming both") {
  using detail::import_access;
  const std::string current = ipc_error_text([] {
    static_cast<void>(import_access("imported_pool", 0, 1, {}, 2, none_reach));
  });
  CHECK_THAT(current, Contains("imported_pool") && Contains("current device 1") &&
                          Contains("no peer path to device 0"));
  const std::vector<int> from{1};
  const std::string listed = ipc_error_text([&] {
    static_cast<void>(import_access("imported_vm_block", 0, 0, from, 2, none_reach));
  });
  CHECK_THAT(listed, Contains("imported_vm_block") && Contains("device 1") &&
                         Contains("no peer path to device 0"));
  // Peer paths have a direction: 0 reaches 1, 1 does not reach 0.
  const auto one_way = [](int a, int b) { return a == b || (a == 0 && b == 1); };
  CHECK(import_access("imported_pool", 1, 0, {}, 2, one_way) == std::vector<int>{0});
  CHECK_THROWS_AS(import_access("imported_pool", 0, 1, {}, 2, one_way), ipc_error);
  // An ipc_error is a std::invalid_argument: the input does not fit this machine.
  CHECK_THROWS_AS(import_access("imported_pool", 0, 1, {}, 2, none_reach), std::invalid_argument);
}

TEST_CASE("import_access: an id that does not exist is std::out_of_range, before any peer path") {
  using detail::import_access;
  int asked = 0;
  const auto counting = [&](int, int) {
    ++asked;
    return true;
  };
  for (const int bad : {-1, 2, 1000}) {
    const std::vector<int> from{1, bad};
    CHECK_THROWS_AS(import_access("imported_pool", 0, 1, from, 2, counting), std::out_of_range);
  }
  CHECK(asked == 0);
  try {
    const std::vector<int> from{5};
    static_cast<void>(import_access("imported_vm_block", 0, 0, from, 2, counting));
    FAIL("no exception");
  } catch (const std::out_of_range& e) {
    CHECK_THAT(e.what(), Contains("imported_vm_block") && Contains("device 5") &&
                             Contains("0..1"));
  }
}

TEST_CASE("imported_pool with no device: input checks first, then the device it cannot see") {
  const open_fd pipe;
  const ipc_pool_descriptor descriptor;  // version 1, a device of all zeros
  CHECK_THROWS_AS(imported_pool(unique_fd{}, descriptor), std::invalid_argument);
  CHECK_THROWS_AS(imported_pool(closed_fd(), descriptor), std::invalid_argument);
  ipc_pool_descriptor future = descriptor;
  future.version = 2;
  CHECK_THROWS_AS(imported_pool(pipe.dup(), future), ipc_error);
  const std::string text = ipc_error_text([&] { imported_pool pool{pipe.dup(), descriptor}; });
  CHECK_THAT(text, Contains("cannot see"));
}

TEST_CASE("imported_vm_block with no device: input checks first, then the device it cannot see") {
  const open_fd pipe;
  vm_block_descriptor d;
  d.handle_count = 1;
  d.granularity = std::size_t{2} << 20;
  d.handle_bytes[0] = std::size_t{2} << 20;
  d.bytes = std::size_t{1} << 20;
  const auto one = [&] {
    std::vector<unique_fd> fds;
    fds.push_back(pipe.dup());
    return fds;
  };
  std::vector<unique_fd> closed;
  closed.push_back(closed_fd());
  CHECK_THROWS_AS(imported_vm_block(std::move(closed), d), std::invalid_argument);
  vm_block_descriptor bad = d;
  bad.version = 2;
  CHECK_THROWS_AS(imported_vm_block(one(), bad), ipc_error);
  bad = d;
  bad.handle_count = 2;  // more handles than descriptors
  CHECK_THROWS_AS(imported_vm_block(one(), bad), ipc_error);
  bad = d;
  bad.bytes = d.handle_bytes[0] + 1;  // larger than its handles
  CHECK_THROWS_AS(imported_vm_block(one(), bad), ipc_error);
  const std::string text = ipc_error_text([&] { imported_vm_block block{one(), d}; });
  CHECK_THAT(text, Contains("cannot see"));
}
