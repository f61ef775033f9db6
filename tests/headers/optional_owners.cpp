// A user's translation unit that holds cudamem's owners in std::optional, as a program does when
// it makes one only on some paths (a peer guard only with two GPUs, a pool only when asked for).
// tests/headers/CMakeLists.txt compiles it at test time with the user's flags: the optimisation
// of each CMake build type (-O3 Release, -O2 RelWithDebInfo, -Os MinSizeRel) and -Wall -Wextra
// -Werror, through the C++ compiler and through nvcc. It is never run.
//
// Why. g++ 12 inlines an owner's destructor into std::optional's and, on paths where the
// optional is empty, cannot always tie the owner's members to the optional's engaged flag: it
// then warns that they "may be used uninitialized" (-Wmaybe-uninitialized). A Release build of
// code holding std::optional<peer_access> failed that way, and std::optional<stream>
// under the GPU machine's newer g++ at -O2. The owners keep their release paths out of line
// where that happens (peer_access::end, event::destroy, stream::destroy, device_scope's end,
// detail::spare_nodes' destructor); this file is the check that they still compile clean.
#include <cudamem/async_resource.hpp>
#include <cudamem/context.hpp>
#include <cudamem/device.hpp>
#include <cudamem/device_resource.hpp>
#include <cudamem/device_scope.hpp>
#include <cudamem/event.hpp>
#include <cudamem/limit_guard.hpp>
#include <cudamem/managed_resource.hpp>
#include <cudamem/peer_access.hpp>
#include <cudamem/pinned_resource.hpp>
#include <cudamem/primary_context.hpp>
#include <cudamem/stream.hpp>
#include <cudamem/sync_guard.hpp>
#include <cudamem/vm_pool_resource.hpp>
#include <cudamem/vm_resource.hpp>

#include <cstddef>
#include <cstdio>
#include <optional>
#include <vector>

void say(const char* what) {
  std::printf("%s\n", what);
  std::fflush(stdout);
}

/// Two owners made together, on one of two paths (the shape of tests/gpu/sanitizer's
/// probe_peer, where the warning was first seen), then ended early by hand.
template <class Owner, class... Args>
void made_on_some_paths(bool early, Args... args) {
  std::optional<Owner> first;
  std::optional<Owner> second;
  const auto make_both = [&] {
    first.emplace(args...);
    second.emplace(args...);
    say("made");
  };
  if (early) {
    make_both();
  }
  say("between");
  if (!early) {
    make_both();
  }
  first.reset();
  second.reset();
}

/// One owner, made only when asked for, ended by its scope.
template <class Owner, class... Args>
void made_if_asked(bool asked, Args... args) {
  std::optional<Owner> owner;
  if (asked) {
    owner.emplace(args...);
  }
  say(owner ? "made" : "not made");
}

/// Guards in a vector, as peer_access.hpp's own example keeps them.
void peer_guards_in_a_vector(int devices) {
  std::vector<cudamem::peer_access> all;
  for (int a = 0; a < devices; ++a) {
    for (int b = 0; b < devices; ++b) {
      if (a != b && cudamem::can_access_peer(a, b)) {
        all.emplace_back(a, b);
      }
    }
  }
  say("all peers on");
}

// The warnings come and go with the inliner's choices, which depend on the shapes above and on
// how they are called: this is the arrangement that made g++ 12 warn for peer_access (-O3),
// event (-O2) and vm_pool_resource (-O3) before their fixes. External linkage, so that the
// optimiser keeps every path.
void user_code(bool early) {
  made_on_some_paths<cudamem::peer_access>(early, 0, 1);
  made_if_asked<cudamem::peer_access>(early, 0, 1);
  peer_guards_in_a_vector(early ? 2 : 1);
  made_on_some_paths<cudamem::event>(early);
  made_if_asked<cudamem::event>(early);
  made_on_some_paths<cudamem::stream>(early);
  made_on_some_paths<cudamem::device_guard>(early, 1);
  made_on_some_paths<cudamem::limit_guard>(early, cudaLimitStackSize, std::size_t{4096});
  made_on_some_paths<cudamem::heap_limit_guard>(early, std::size_t{1} << 20);
  made_on_some_paths<cudamem::synchronize_device_on_exit>(early, 0);
  made_on_some_paths<cudamem::device_scope>(early);
  made_on_some_paths<cudamem::context>(early);
  made_on_some_paths<cudamem::primary_context>(early, 0);
  made_on_some_paths<cudamem::device_resource>(early);
  made_on_some_paths<cudamem::async_resource>(early);
  made_on_some_paths<cudamem::pinned_resource>(early);
  made_on_some_paths<cudamem::managed_resource>(early);
  made_on_some_paths<cudamem::vm_resource>(early);
  made_on_some_paths<cudamem::vm_pool_resource>(early);
  made_if_asked<cudamem::vm_pool_resource>(early);
}
