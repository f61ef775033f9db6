// cudamem/fd_passing.hpp — file descriptors handed from one process to another over a Unix
// socket (SCM_RIGHTS), with a small message beside them: how the shareable handles of CUDA
// memory (POSIX file descriptors) reach the process that imports them. Linux only.
//
//   #include <cudamem/fd_passing.hpp>
//
//   auto [here, there] = cudamem::socket_pair();   // before starting the other process,
//                                                  // which inherits `there` (dup2 it)
//   cudamem::unique_fd handle = ...;               // e.g. an exported pool or vm handle
//   cudamem::send_fds(here.get(), {handle.get()}, cudamem::as_bytes_of(descriptor));
//
//   // in the other process:
//   cudamem::received_fds r = cudamem::receive_fds(socket, 5000);   // wait up to 5 s
//   r.fds[0].get();                                // a new descriptor for the same object
//   auto descriptor = r.payload_as<my_descriptor>();
//
// Why. A POSIX file descriptor is a number in one process's table; the number means nothing
// in another. The kernel copies the open file into the receiver's table when it travels as
// SCM_RIGHTS ancillary data on a Unix socket, and only then. Getting it right is fiddly
// (control-message buffers, truncation, SIGPIPE, partial reads, descriptors leaked on every
// error path); here it is once, with owners on both sides.
//
// Contract
// - `unique_fd` owns one descriptor and closes it on destruction; move-only; -1 is "none".
// - `socket_pair()` makes a connected pair of Unix stream sockets, both close-on-exec (a child
//   gets its end through dup2, which clears the flag on the copy). Failure: `fd_passing_error`.
// - `send_fds(socket, fds, payload)` sends one message: the descriptors (at most
//   `max_fds_per_message`) and the payload bytes (at most `max_payload_bytes`). The sender
//   keeps its own descriptors (close them when you no longer need them; the receiver has its
//   own copies). It returns once the message is in the socket; it never raises SIGPIPE.
// - `receive_fds(socket, timeout_ms)` receives one message sent by `send_fds`: the descriptors
//   as `unique_fd`s (close-on-exec) and the payload. `timeout_ms` < 0 waits for ever.
// - Errors are typed, and nothing leaks on any of them (descriptors received with a message
//   that is then found bad are closed):
//   * a descriptor to send that is not open, more than `max_fds_per_message` of them, or a
//     payload over `max_payload_bytes`: `std::invalid_argument`, before anything is sent;
//   * the other end hung up (EPIPE or ECONNRESET on send, end of stream on receive, also in
//     the middle of a message): `peer_closed_error`;
//   * the time-out elapsed: `fd_passing_error` with std::errc::timed_out;
//   * a message that is not one of ours, or lost descriptors (control data truncated):
//     `fd_passing_error` with std::errc::protocol_error;
//   * anything else the system calls return (a socket that is not one, ...): `fd_passing_error`
//     carrying the errno.
//   `peer_closed_error` derives from `fd_passing_error`, which derives from std::system_error.
// - Thread-safety: one sender and one receiver per socket at a time (a message is several
//   system calls); different sockets are independent.
#pragma once

#if defined(__linux__)

#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <unistd.h>

#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <span>
#include <stdexcept>
#include <string>
#include <system_error>
#include <type_traits>
#include <utility>
#include <vector>

namespace cudamem {

/// A failed system call while passing descriptors; `code()` is the errno (or std::errc).
class fd_passing_error : public std::system_error {
 public:
  /// The failure `code`, with `what` saying which call failed.
  fd_passing_error(std::error_code code, const std::string& what) : std::system_error(code, what) {}
};

/// The other end of the socket is gone (the other process exited, was killed, or closed it).
class peer_closed_error : public fd_passing_error {
 public:
  /// The peer is gone; `what` says which call found out.
  explicit peer_closed_error(const std::string& what)
      : fd_passing_error(std::make_error_code(std::errc::connection_reset), what) {}
};

/// Owns one file descriptor; closes it on destruction.
class unique_fd {
 public:
  unique_fd() noexcept = default;
  /// Takes ownership of `fd` (-1: none).
  explicit unique_fd(int fd) noexcept : fd_(fd) {}
  ~unique_fd() { reset(); }

  unique_fd(const unique_fd&) = delete;
  unique_fd& operator=(const unique_fd&) = delete;
  /// Takes `other`'s descriptor; `other` holds none after.
  unique_fd(unique_fd&& other) noexcept : fd_(std::exchange(other.fd_, -1)) {}
  /// Closes the descriptor held, then takes `other`'s.
  unique_fd& operator=(unique_fd&& other) noexcept {
    if (this != &other) {
      reset(std::exchange(other.fd_, -1));
    }
    return *this;
  }

  /// The descriptor; -1 for none.
  [[nodiscard]] int get() const noexcept { return fd_; }
  /// Whether it holds a descriptor.
  [[nodiscard]] explicit operator bool() const noexcept { return fd_ >= 0; }
  /// Gives up ownership: the caller closes it.
  [[nodiscard]] int release() noexcept { return std::exchange(fd_, -1); }
  /// Closes what it holds (if anything) and takes `fd`.
  void reset(int fd = -1) noexcept {
    if (fd_ >= 0) {
      ::close(fd_);  // Linux releases the descriptor even when close reports EINTR: no retry
    }
    fd_ = fd;
  }

 private:
  int fd_ = -1;
};

/// Most descriptors one message carries (the kernel's SCM_MAX_FD).
inline constexpr std::size_t max_fds_per_message = 253;
/// Most payload bytes one message carries.
inline constexpr std::size_t max_payload_bytes = std::size_t{64} << 10;

/// What one `receive_fds` got.
struct received_fds {
  std::vector<unique_fd> fds;      ///< the descriptors, in the order sent, owned
  std::vector<std::byte> payload;  ///< the bytes sent with them

  /// The payload as a trivially copyable T; `fd_passing_error` (protocol_error) when its size
  /// is not sizeof(T).
  template <class T>
  [[nodiscard]] T payload_as() const {
    static_assert(std::is_trivially_copyable_v<T>, "payload_as<T> needs a trivially copyable T");
    if (payload.size() != sizeof(T)) {
      throw fd_passing_error(std::make_error_code(std::errc::protocol_error),
                             "cudamem: received " + std::to_string(payload.size()) +
                                 " payload bytes where " + std::to_string(sizeof(T)) +
                                 " were expected");
    }
    T out;
    std::memcpy(&out, payload.data(), sizeof(T));
    return out;
  }
};

/// The bytes of a trivially copyable object, for a payload.
template <class T>
[[nodiscard]] std::span<const std::byte> as_bytes_of(const T& object) noexcept {
  static_assert(std::is_trivially_copyable_v<T>, "as_bytes_of needs a trivially copyable T");
  return {reinterpret_cast<const std::byte*>(&object), sizeof(T)};
}

namespace detail {

/// What precedes every payload: recognises our messages and says what follows.
struct fd_message_header {
  static constexpr std::uint32_t expected_magic = 0x63646d66;  // "fmdc"
  std::uint32_t magic = expected_magic;
  std::uint32_t payload_bytes = 0;
  std::uint32_t fd_count = 0;
};

[[noreturn]] inline void throw_errno(int error, const std::string& what) {
  if (error == EPIPE || error == ECONNRESET) {
    throw peer_closed_error("cudamem: " + what + ": the other end hung up (" +
                            std::generic_category().message(error) + ")");
  }
  throw fd_passing_error(std::error_code(error, std::generic_category()), "cudamem: " + what);
}

/// Waits until `socket` is readable or `timeout_ms` passes (< 0: for ever).
inline void wait_readable(int socket, int timeout_ms) {
  if (timeout_ms < 0) {
    return;  // the blocking read waits
  }
  pollfd p{socket, POLLIN, 0};
  for (;;) {
    const int ready = ::poll(&p, 1, timeout_ms);
    if (ready > 0) {
      return;
    }
    if (ready == 0) {
      throw fd_passing_error(std::make_error_code(std::errc::timed_out),
                             "cudamem: receive_fds: nothing arrived in " +
                                 std::to_string(timeout_ms) + " ms");
    }
    if (errno != EINTR) {
      throw_errno(errno, "receive_fds: poll");
    }
  }
}

/// Reads exactly `bytes` (no descriptors expected); end of stream is peer_closed_error.
inline void read_fully(int socket, std::byte* out, std::size_t bytes, int timeout_ms) {
  std::size_t done = 0;
  while (done < bytes) {
    wait_readable(socket, timeout_ms);
    const ssize_t n = ::recv(socket, out + done, bytes - done, 0);
    if (n > 0) {
      done += static_cast<std::size_t>(n);
    } else if (n == 0) {
      throw peer_closed_error("cudamem: receive_fds: the other end hung up in the middle of a "
                              "message");
    } else if (errno != EINTR) {
      throw_errno(errno, "receive_fds: recv");
    }
  }
}

}  // namespace detail

/// A connected pair of Unix stream sockets, both close-on-exec.
[[nodiscard]] inline std::pair<unique_fd, unique_fd> socket_pair() {
  int ends[2] = {-1, -1};
  if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, ends) != 0) {
    detail::throw_errno(errno, "socketpair");
  }
  return {unique_fd{ends[0]}, unique_fd{ends[1]}};
}

/// Sends `fds` and `payload` as one message on `socket`; see the contract above.
inline void send_fds(int socket, std::span<const int> fds, std::span<const std::byte> payload = {}) {
  if (fds.size() > max_fds_per_message) {
    throw std::invalid_argument("cudamem: send_fds: " + std::to_string(fds.size()) +
                                " descriptors; one message carries at most " +
                                std::to_string(max_fds_per_message));
  }
  if (payload.size() > max_payload_bytes) {
    throw std::invalid_argument("cudamem: send_fds: a payload of " + std::to_string(payload.size()) +
                                " bytes; one message carries at most " +
                                std::to_string(max_payload_bytes));
  }
  for (const int fd : fds) {
    if (fd < 0 || ::fcntl(fd, F_GETFD) == -1) {
      throw std::invalid_argument("cudamem: send_fds: descriptor " + std::to_string(fd) +
                                  " is not open (closed already, or never opened)");
    }
  }
  detail::fd_message_header header;
  header.payload_bytes = static_cast<std::uint32_t>(payload.size());
  header.fd_count = static_cast<std::uint32_t>(fds.size());
  // The header and the payload in one buffer: one sendmsg carries them with the descriptors.
  std::vector<std::byte> bytes(sizeof header + payload.size());
  std::memcpy(bytes.data(), &header, sizeof header);
  if (!payload.empty()) {
    std::memcpy(bytes.data() + sizeof header, payload.data(), payload.size());
  }
  std::vector<char> control(fds.empty() ? 0 : CMSG_SPACE(fds.size() * sizeof(int)));
  iovec io{bytes.data(), bytes.size()};
  msghdr message{};
  message.msg_iov = &io;
  message.msg_iovlen = 1;
  if (!fds.empty()) {
    message.msg_control = control.data();
    message.msg_controllen = control.size();
    cmsghdr* c = CMSG_FIRSTHDR(&message);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(fds.size() * sizeof(int));
    std::memcpy(CMSG_DATA(c), fds.data(), fds.size() * sizeof(int));
  }
  std::size_t sent = 0;
  for (;;) {
    const ssize_t n = ::sendmsg(socket, &message, MSG_NOSIGNAL);
    if (n >= 0) {
      sent = static_cast<std::size_t>(n);
      break;
    }
    if (errno != EINTR) {
      detail::throw_errno(errno, "send_fds: sendmsg");
    }
  }
  // A stream socket may take part of the bytes; the descriptors went with the first of them.
  while (sent < bytes.size()) {
    const ssize_t n = ::send(socket, bytes.data() + sent, bytes.size() - sent, MSG_NOSIGNAL);
    if (n >= 0) {
      sent += static_cast<std::size_t>(n);
    } else if (errno != EINTR) {
      detail::throw_errno(errno, "send_fds: send");
    }
  }
}

/// send_fds for a braced list: `send_fds(socket, {fd1, fd2}, payload)`.
inline void send_fds(int socket, std::initializer_list<int> fds,
                     std::span<const std::byte> payload = {}) {
  send_fds(socket, std::span<const int>(fds.begin(), fds.size()), payload);
}

/// Receives one message sent by send_fds; see the contract above.
[[nodiscard]] inline received_fds receive_fds(int socket, int timeout_ms = -1) {
  received_fds out;
  detail::fd_message_header header;
  std::vector<char> control(CMSG_SPACE(max_fds_per_message * sizeof(int)));
  iovec io{&header, sizeof header};
  msghdr message{};
  message.msg_iov = &io;
  message.msg_iovlen = 1;
  message.msg_control = control.data();
  message.msg_controllen = control.size();
  ssize_t n = -1;
  for (;;) {
    detail::wait_readable(socket, timeout_ms);
    n = ::recvmsg(socket, &message, MSG_CMSG_CLOEXEC);
    if (n >= 0 || errno != EINTR) {
      break;
    }
  }
  if (n < 0) {
    detail::throw_errno(errno, "receive_fds: recvmsg");
  }
  // Whatever descriptors arrived are owned from here on, so every error below closes them.
  out.fds.reserve(max_fds_per_message);  // so that taking them cannot throw and leak one
  for (cmsghdr* c = CMSG_FIRSTHDR(&message); c != nullptr; c = CMSG_NXTHDR(&message, c)) {
    if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS) {
      const std::size_t count = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
      for (std::size_t i = 0; i < count; ++i) {
        int fd = -1;
        std::memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof(int));
        out.fds.emplace_back(fd);
      }
    }
  }
  if (n == 0) {
    throw peer_closed_error("cudamem: receive_fds: the other end hung up");
  }
  if ((message.msg_flags & MSG_CTRUNC) != 0) {
    throw fd_passing_error(std::make_error_code(std::errc::protocol_error),
                           "cudamem: receive_fds: descriptors were lost (control data truncated)");
  }
  if (static_cast<std::size_t>(n) < sizeof header) {  // a stream socket may split the header
    detail::read_fully(socket, reinterpret_cast<std::byte*>(&header) + n,
                       sizeof header - static_cast<std::size_t>(n), timeout_ms);
  }
  if (header.magic != detail::fd_message_header::expected_magic ||
      header.payload_bytes > max_payload_bytes || header.fd_count != out.fds.size()) {
    throw fd_passing_error(std::make_error_code(std::errc::protocol_error),
                           "cudamem: receive_fds: not a message sent by send_fds (or "
                           "descriptors missing: " + std::to_string(out.fds.size()) +
                               " arrived)");
  }
  out.payload.resize(header.payload_bytes);
  detail::read_fully(socket, out.payload.data(), out.payload.size(), timeout_ms);
  return out;
}

}  // namespace cudamem

#endif  // __linux__
