// The registry of memory held ahead (detail/held_ahead.hpp) outlives every holder, holders that
// are never destroyed included. libcudamem_c's per-device stacks live to the end of the process,
// and a program's last frees and allocations (a PyTorch program's CUDA graphs and tensors torn
// down at exit, after a failed capture say) reach them while static destruction runs. Here a
// vm_resource that is never destroyed is asked, from an exit handler that runs after the
// registry would have been destroyed were it an ordinary static, what it holds ahead, and then
// gives it back. Each answer must be right. (With the registry an ordinary static, the handler
// read its freed list: AddressSanitizer's heap-use-after-free.)
//
// One test case in an executable of its own: the registry must first be used after the handler
// is registered, so that, as an ordinary static, it would be destroyed before the handler runs.
#include <cudamem/detail/held_ahead.hpp>
#include <cudamem/detail/vm/simulated_mapping.hpp>
#include <cudamem/vm_resource.hpp>

#include <catch2/catch.hpp>

#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <memory>

using namespace cudamem;

namespace {

constexpr std::size_t MiB = std::size_t{1} << 20;

vm_resource* immortal = nullptr;  // never destroyed, as libcudamem_c's stacks are not
std::size_t held_at_exit = 0;

void ask_at_exit() {
  const detail::memory_domain domain = immortal->mapping_layer().domain();
  const std::size_t held = detail::held_ahead_bytes(domain);
  const std::size_t given = detail::give_back_held_ahead(domain);
  const std::size_t left = immortal->vm_stats().held_ahead_bytes;
  if (held != held_at_exit || given != held_at_exit || left != 0) {
    std::fprintf(stderr,
                 "held_ahead at exit: registry says %zu held (expected %zu), gave back %zu, "
                 "%zu left\n", held, held_at_exit, given, left);
    std::_Exit(1);
  }
}

}  // namespace

TEST_CASE("held_ahead: the registry answers for holders that outlive static destruction") {
  REQUIRE(std::atexit(ask_at_exit) == 0);  // before the registry's first use (below)
  vm_resource_options options;
  options.handle_bytes = 32 * MiB;
  options.growth_bytes = 128 * MiB;  // a growth for 32 MiB leaves three handles ahead
  options.grow_ahead_bytes = 0;
  immortal = new vm_resource(std::make_unique<detail::simulated_vm_mapping>(
                                 detail::simulated_vm_options{.capacity = 1024 * MiB,
                                                              .granularity = 2 * MiB}),
                             options);
  void* block = immortal->allocate(32 * MiB);
  held_at_exit = immortal->vm_stats().held_ahead_bytes;
  CHECK(held_at_exit == 96 * MiB);
  CHECK(detail::held_ahead_bytes(immortal->mapping_layer().domain()) == held_at_exit);
  static_cast<void>(block);  // kept: the resource, like the C API's, holds it to the end
}
