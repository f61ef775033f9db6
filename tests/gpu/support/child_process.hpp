// Test helper: a child process started from a separate executable (posix_spawn: a fresh
// process image, so CUDA starts clean in the child; a fork of a process that has initialised
// CUDA is not usable), connected to the parent by a Unix socket that the child sees as fd 3.
// The destructor kills and reaps a child still running: no stray processes, no zombies.
#pragma once

#include <cudamem/fd_passing.hpp>

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <stdexcept>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

extern char** environ;

namespace cudamem_test {

/// The fd number under which the child finds its end of the socket.
inline constexpr int child_socket_fd = 3;

class child_process {
 public:
  /// Starts `exe` with `args` (argv[1...]); the child's end of a socketpair becomes its fd 3.
  child_process(const std::string& exe, const std::vector<std::string>& args) {
    auto [mine, theirs] = cudamem::socket_pair();
    // dup2 onto the same number would keep close-on-exec: make sure the source is not 3.
    cudamem::unique_fd source{::fcntl(theirs.get(), F_DUPFD_CLOEXEC, 10)};
    if (!source) {
      throw std::system_error(errno, std::generic_category(), "fcntl(F_DUPFD_CLOEXEC)");
    }
    theirs.reset();
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_adddup2(&actions, source.get(), child_socket_fd);
    std::vector<std::string> all{exe};
    all.insert(all.end(), args.begin(), args.end());
    std::vector<char*> argv;
    for (std::string& a : all) {
      argv.push_back(a.data());
    }
    argv.push_back(nullptr);
    const int error = ::posix_spawn(&pid_, exe.c_str(), &actions, nullptr, argv.data(), environ);
    posix_spawn_file_actions_destroy(&actions);
    if (error != 0) {
      throw std::system_error(error, std::generic_category(), "posix_spawn " + exe);
    }
    socket_ = std::move(mine);
  }

  ~child_process() {
    if (pid_ > 0) {
      ::kill(pid_, SIGKILL);
      static_cast<void>(wait());
    }
  }

  child_process(const child_process&) = delete;
  child_process& operator=(const child_process&) = delete;

  [[nodiscard]] int socket() const noexcept { return socket_.get(); }
  [[nodiscard]] pid_t pid() const noexcept { return pid_; }

  /// Kills the child at once (SIGKILL: no destructor of its runs) and reaps it.
  int kill() {
    ::kill(pid_, SIGKILL);
    return wait();
  }

  /// Reaps the child: its exit code, or -signal when a signal ended it. Waits at most
  /// `timeout` (then kills it and returns -SIGKILL).
  int wait(std::chrono::seconds timeout = std::chrono::seconds{120}) {
    if (pid_ <= 0) {
      return status_;
    }
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    int status = 0;
    for (;;) {
      const pid_t done = ::waitpid(pid_, &status, WNOHANG);
      if (done == pid_) {
        break;
      }
      if (done < 0 && errno != EINTR) {
        pid_ = -1;
        return status_ = -1;
      }
      if (std::chrono::steady_clock::now() > deadline) {
        ::kill(pid_, SIGKILL);
        ::waitpid(pid_, &status, 0);
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds{10});
    }
    pid_ = -1;
    status_ = WIFEXITED(status) ? WEXITSTATUS(status) : -WTERMSIG(status);
    return status_;
  }

 private:
  pid_t pid_ = -1;
  int status_ = -1;
  cudamem::unique_fd socket_;
};

}  // namespace cudamem_test
