// detail::owner_bias: the first thread skips the lock; a second thread revokes that once, and
// from then on the two exclude each other. Checked the hard way: a plain counter that both
// increment under a biased_lock_guard must lose no increment, with the second thread arriving
// while the owner is mid-loop, many times over.
#include <cudamem/detail/adaptors/owner_bias.hpp>
#include <cudamem/detail/spin_lock.hpp>

#include <catch2/catch.hpp>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <thread>

using cudamem::detail::asymmetric_fence_available;
using cudamem::detail::biased_lock_guard;
using cudamem::detail::owner_bias;
using cudamem::detail::spin_lock;

TEST_CASE("owner_bias: the first thread owns, until another thread comes") {
  owner_bias bias;
  spin_lock lock;
  CHECK_FALSE(bias.owned());  // nobody has come yet
  {
    const biased_lock_guard guard(bias, lock);
    // The owner takes no lock (where the system can fence other threads: Linux).
    CHECK(bias.owned() == asymmetric_fence_available());
    CHECK(lock.try_lock() == asymmetric_fence_available());
    if (asymmetric_fence_available()) {
      lock.unlock();
    }
  }
  std::thread([&] {
    const biased_lock_guard guard(bias, lock);
    CHECK_FALSE(bias.owned());  // revoked before this guard went on
    CHECK_FALSE(lock.try_lock());  // and this guard holds the lock
  }).join();
  const biased_lock_guard guard(bias, lock);  // the old owner now locks too
  CHECK_FALSE(lock.try_lock());
}

namespace {

/// counter += 1 the slow way: read, dawdle, write. A second thread inside the same section at
/// the same time makes an increment disappear, so a broken exclusion shows in the total. With
/// `long_wait`, the dawdle lasts longer than revoking takes (a system call), so a revoker that
/// did not wait for the owner would meet it inside.
void slow_increment(std::size_t& counter, bool long_wait) {
  const std::size_t seen = counter;
  const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(long_wait ? 50 : 0);
  while (std::chrono::steady_clock::now() < until) {
  }
  std::atomic_signal_fence(std::memory_order_seq_cst);  // the compiler keeps read and write apart
  counter = seen + 1;
}

}  // namespace

TEST_CASE("owner_bias: no increment is lost when a second thread arrives mid-loop") {
  constexpr int rounds = 20;
  constexpr std::size_t owner_increments = 20'000;
  constexpr std::size_t newcomer_increments = 5'000;
  for (int round = 0; round < rounds; ++round) {
    owner_bias bias;
    spin_lock lock;
    std::size_t counter = 0;  // plain: only the guard protects it
    std::atomic<std::size_t> owner_progress{0};
    std::thread owner([&] {
      for (std::size_t i = 0; i < owner_increments; ++i) {
        {
          const biased_lock_guard guard(bias, lock);
          slow_increment(counter, i % 16 == 0);
        }
        owner_progress.store(i, std::memory_order_relaxed);
      }
    });
    // Join in at a different point of the owner's loop each round.
    const std::size_t join_at = owner_increments / rounds * static_cast<std::size_t>(round) / 2;
    while (owner_progress.load(std::memory_order_relaxed) < join_at) {
      std::this_thread::yield();
    }
    std::thread newcomer([&] {
      for (std::size_t i = 0; i < newcomer_increments; ++i) {
        const biased_lock_guard guard(bias, lock);
        slow_increment(counter, false);
      }
    });
    owner.join();
    newcomer.join();
    REQUIRE(counter == owner_increments + newcomer_increments);
    CHECK_FALSE(bias.owned());
  }
}
