// fd_passing.hpp with no GPU: descriptors and payloads between threads and between processes
// over a socketpair, and every error: a closed descriptor, too many, a payload too large, a
// peer that hung up (before, and in the middle of a message), a time-out, a message that is
// not ours, a "socket" that is a pipe. Received descriptors are new, work, and are
// close-on-exec; nothing leaks on any error (the test counts open descriptors).
#include <cudamem/fd_passing.hpp>

#include <catch2/catch.hpp>

#include <dirent.h>
#include <fcntl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

using namespace cudamem;

namespace {

/// Open descriptors of this process (to see that nothing leaks).
int open_fds() {
  int count = 0;
  DIR* dir = ::opendir("/proc/self/fd");
  REQUIRE(dir != nullptr);
  while (const dirent* entry = ::readdir(dir)) {
    count += entry->d_name[0] != '.' ? 1 : 0;
  }
  ::closedir(dir);
  return count - 1;  // the directory's own descriptor
}

bool is_open(int fd) { return ::fcntl(fd, F_GETFD) != -1; }

std::pair<unique_fd, unique_fd> make_pipe() {
  int ends[2] = {-1, -1};
  REQUIRE(::pipe2(ends, O_CLOEXEC) == 0);
  return {unique_fd{ends[0]}, unique_fd{ends[1]}};
}

void write_text(int fd, const std::string& text) {
  REQUIRE(::write(fd, text.data(), text.size()) == static_cast<ssize_t>(text.size()));
}

std::string read_text(int fd, std::size_t bytes) {
  std::string text(bytes, '\0');
  std::size_t done = 0;
  while (done < bytes) {
    const ssize_t n = ::read(fd, text.data() + done, bytes - done);
    REQUIRE(n > 0);
    done += static_cast<std::size_t>(n);
  }
  return text;
}

struct descriptor {
  std::uint64_t bytes;
  std::uint32_t handles;
  char name[20];
};

}  // namespace

TEST_CASE("unique_fd owns and closes one descriptor") {
  auto [r, w] = make_pipe();
  const int fd = r.get();
  REQUIRE(is_open(fd));
  unique_fd moved{std::move(r)};
  CHECK(moved.get() == fd);
  CHECK_FALSE(r);  // NOLINT(bugprone-use-after-move): defined: -1
  moved.reset();
  CHECK_FALSE(is_open(fd));
  const int wfd = w.release();
  CHECK(is_open(wfd));
  CHECK_FALSE(w);
  ::close(wfd);
  unique_fd a{make_pipe().first.release()};
  unique_fd b;
  b = std::move(a);
  CHECK(b);
  CHECK_FALSE(a);  // NOLINT(bugprone-use-after-move)
}

TEST_CASE("send_fds / receive_fds between two threads: the descriptors work on the other side") {
  const int before = open_fds();
  {
    auto [here, there] = socket_pair();
    auto [read_end, write_end] = make_pipe();
    descriptor sent{std::uint64_t{64} << 20, 2, "pool"};
    received_fds got;
    std::thread receiver([&, socket = there.get()] { got = receive_fds(socket, 5000); });
    send_fds(here.get(), {read_end.get(), write_end.get()}, as_bytes_of(sent));
    receiver.join();
    REQUIRE(got.fds.size() == 2);
    CHECK(got.fds[0].get() != read_end.get());  // new numbers for the same open files
    CHECK(got.fds[1].get() != write_end.get());
    CHECK((::fcntl(got.fds[0].get(), F_GETFD) & FD_CLOEXEC) != 0);
    const auto d = got.payload_as<descriptor>();
    CHECK(d.bytes == sent.bytes);
    CHECK(d.handles == 2);
    CHECK(std::string(d.name) == "pool");
    // Written through the received write end, read through the sender's read end.
    write_text(got.fds[1].get(), "hello");
    CHECK(read_text(read_end.get(), 5) == "hello");
    // The sender may close its own copies: the receiver's stay valid.
    read_end.reset();
    write_text(write_end.get(), "again");
    CHECK(read_text(got.fds[0].get(), 5) == "again");
    // A message with no descriptors, and one with no payload.
    send_fds(here.get(), std::span<const int>{}, as_bytes_of(sent));
    const received_fds only_bytes = receive_fds(there.get(), 5000);
    CHECK(only_bytes.fds.empty());
    CHECK(only_bytes.payload.size() == sizeof(descriptor));
    send_fds(here.get(), {write_end.get()});
    const received_fds only_fd = receive_fds(there.get(), 5000);
    CHECK(only_fd.fds.size() == 1);
    CHECK(only_fd.payload.empty());
    CHECK_THROWS_AS(only_fd.payload_as<descriptor>(), fd_passing_error);
  }
  CHECK(open_fds() == before);
}

TEST_CASE("send_fds / receive_fds between two processes") {
  auto [here, there] = socket_pair();
  auto [read_end, write_end] = make_pipe();
  const pid_t child = ::fork();
  REQUIRE(child >= 0);
  if (child == 0) {
    // The child: no Catch2 here, only an exit code. Receive the pipe's write end, write
    // through it, and answer on the socket with the number of descriptors it got.
    int code = 0;
    try {
      here.reset();
      received_fds got = receive_fds(there.get(), 10000);
      const std::string text = "from the child";
      if (got.fds.size() != 1 ||
          ::write(got.fds[0].get(), text.data(), text.size()) != static_cast<ssize_t>(text.size())) {
        code = 2;
      }
      const std::uint32_t count = static_cast<std::uint32_t>(got.fds.size());
      send_fds(there.get(), std::span<const int>{}, as_bytes_of(count));
    } catch (...) {
      code = 3;
    }
    ::_exit(code);
  }
  there.reset();
  send_fds(here.get(), {write_end.get()});
  write_end.reset();  // only the child's copy is left
  const received_fds answer = receive_fds(here.get(), 10000);
  CHECK(answer.payload_as<std::uint32_t>() == 1);
  CHECK(read_text(read_end.get(), 14) == "from the child");
  int status = 0;
  REQUIRE(::waitpid(child, &status, 0) == child);
  CHECK(WIFEXITED(status));
  CHECK(WEXITSTATUS(status) == 0);
}

TEST_CASE("bad input to send_fds throws before anything is sent") {
  const int before = open_fds();
  {
    auto [here, there] = socket_pair();
    auto [read_end, write_end] = make_pipe();
    const int closed = ::dup(read_end.get());
    ::close(closed);
    CHECK_THROWS_AS(send_fds(here.get(), {read_end.get(), closed}), std::invalid_argument);
    CHECK_THROWS_AS(send_fds(here.get(), {-1}), std::invalid_argument);
    std::vector<int> too_many(max_fds_per_message + 1, read_end.get());
    CHECK_THROWS_AS(send_fds(here.get(), too_many), std::invalid_argument);
    std::vector<std::byte> too_large(max_payload_bytes + 1);
    CHECK_THROWS_AS(send_fds(here.get(), std::span<const int>{}, too_large),
                    std::invalid_argument);
    // Nothing went out: the first message the other end sees is the next good one.
    const std::uint32_t marker = 77;
    send_fds(here.get(), {read_end.get()}, as_bytes_of(marker));
    const received_fds got = receive_fds(there.get(), 5000);
    CHECK(got.payload_as<std::uint32_t>() == 77);
    CHECK(got.fds.size() == 1);
    // The maximum itself is fine.
    std::vector<int> most(max_fds_per_message, read_end.get());
    send_fds(here.get(), most);
    CHECK(receive_fds(there.get(), 5000).fds.size() == max_fds_per_message);
  }
  CHECK(open_fds() == before);
}

TEST_CASE("a peer that hung up: peer_closed_error on both sides, and in mid-message") {
  const int before = open_fds();
  {
    auto [here, there] = socket_pair();
    there.reset();
    auto [read_end, write_end] = make_pipe();
    CHECK_THROWS_AS(send_fds(here.get(), {read_end.get()}), peer_closed_error);
  }
  {
    auto [here, there] = socket_pair();
    here.reset();
    CHECK_THROWS_AS(receive_fds(there.get(), 5000), peer_closed_error);
  }
  {
    // A header that announces 100 payload bytes and a descriptor, then the sender dies.
    auto [here, there] = socket_pair();
    auto [read_end, write_end] = make_pipe();
    struct {
      std::uint32_t magic = 0x63646d66, payload = 100, fds = 1;
    } header;
    std::array<char, CMSG_SPACE(sizeof(int))> control{};
    iovec io{&header, sizeof header};
    msghdr m{};
    m.msg_iov = &io;
    m.msg_iovlen = 1;
    m.msg_control = control.data();
    m.msg_controllen = control.size();
    cmsghdr* c = CMSG_FIRSTHDR(&m);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int));
    const int fd = read_end.get();
    std::memcpy(CMSG_DATA(c), &fd, sizeof fd);
    REQUIRE(::sendmsg(here.get(), &m, MSG_NOSIGNAL) == static_cast<ssize_t>(sizeof header));
    here.reset();
    CHECK_THROWS_AS(receive_fds(there.get(), 5000), peer_closed_error);  // and closes the fd
  }
  CHECK(open_fds() == before);
}

TEST_CASE("time-out, a foreign message, and a pipe for a socket are typed errors") {
  const int before = open_fds();
  {
    auto [here, there] = socket_pair();
    try {
      static_cast<void>(receive_fds(there.get(), 50));
      FAIL("no time-out");
    } catch (const fd_passing_error& e) {
      CHECK(e.code() == std::errc::timed_out);
    }
    const char junk[16] = "not our message";
    REQUIRE(::send(here.get(), junk, sizeof junk, MSG_NOSIGNAL) == sizeof junk);
    try {
      static_cast<void>(receive_fds(there.get(), 5000));
      FAIL("foreign message accepted");
    } catch (const fd_passing_error& e) {
      CHECK(e.code() == std::errc::protocol_error);
    }
    auto [read_end, write_end] = make_pipe();
    try {
      send_fds(read_end.get(), {write_end.get()});
      FAIL("a pipe accepted as a socket");
    } catch (const fd_passing_error& e) {
      CHECK(e.code() == std::errc::not_a_socket);
    }
  }
  CHECK(open_fds() == before);
}
