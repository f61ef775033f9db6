// cudamem/detail/thread_flag_scope.hpp — a thread-local flag set for the length of a scope,
// and put back as it was when the scope ends.
//
//   inline thread_local bool inside_registry = false;
//   {
//     const thread_flag_scope inside(inside_registry);   // true from here ...
//     call_that_may_reenter();                            // ... which reads the flag
//   }                                                     // as it was again, also on a throw
//
// Why: several internals change what a call does on the same thread while an outer call is
// under way (a registry that must not re-enter itself, a vm_resource that must not grow into
// its reserve for a vm_pool's bulk blocks). A flag in thread-local storage costs nothing to
// other threads and needs no lock; the scope restores the previous value rather than false,
// so that nested scopes compose.
#pragma once

namespace cudamem::detail {

class thread_flag_scope {
 public:
  /// `flag` must be thread-local (or otherwise touched by this thread only) and outlive the scope.
  explicit thread_flag_scope(bool& flag) noexcept : flag_(flag), previous_(flag) { flag = true; }
  ~thread_flag_scope() { flag_ = previous_; }
  thread_flag_scope(const thread_flag_scope&) = delete;
  thread_flag_scope& operator=(const thread_flag_scope&) = delete;

 private:
  bool& flag_;
  bool previous_;
};

}  // namespace cudamem::detail
