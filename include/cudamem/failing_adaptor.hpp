// cudamem/failing_adaptor.hpp — fault injection: a resource that passes everything to its
// upstream except the allocations you tell it to fail. For proving that code leaks nothing
// and stays valid when any allocation in it fails.
//
//   cudamem::host_resource host;
//   cudamem::failing_adaptor faults{host};
//   for (std::size_t k = 1;; ++k) {            // fail the 1st call, then the 2nd, ...
//     faults.fail_call(k);
//     try { run_the_code_under_test(faults); break; }   // reached the end: no k-th call
//     catch (const cudamem::out_of_memory&) {}
//     REQUIRE(host.stats().used_bytes == 0);   // nothing leaked on this failure path
//   }
//   faults.fail_from(3);                       // the 3rd call and every one after it
//   faults.fail_randomly(0.1, 42);             // each call with probability 0.1, seed 42
//   faults.never_fail();
//
// Contract
// - Same kind and device as the upstream; `upstream()` is it; `stats()` are its stats.
// - Each plan (`fail_call`, `fail_from`, `fail_randomly`, `never_fail`) restarts the call
//   count: "the k-th call" is counted from the moment the plan is set, 1-based. k = 0 is
//   refused (`std::invalid_argument`), as is a probability outside [0, 1].
// - An injected failure throws `out_of_memory` whose cause says it was injected and which
//   call it was, and whose hint says nothing ran out; the upstream is not asked. Zero-byte requests never reach the adaptor (the
//   interface answers them), so they are not counted.
// - Deallocations always pass through, in the form they came in (stream-ordered or not).
// - The random plan is deterministic: the same seed gives the same failures on every
//   platform (its generator is splitmix64, written out below, not a std:: distribution whose
//   results differ between standard libraries).
// - Thread-safe: counters are atomic; the random generator is behind a mutex.
#pragma once

#include <cudamem/detail/sync/atomic.hpp>
#include <cudamem/detail/sync/mutex.hpp>
#include <cudamem/memory_resource.hpp>
#include <cudamem/out_of_memory.hpp>

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <string_view>

namespace cudamem {

/// Forwards to its upstream, except the allocations its plan fails with `out_of_memory`.
class failing_adaptor final : public memory_resource {
 public:
  /// Passes everything to `upstream` until a plan says otherwise.
  explicit failing_adaptor(memory_resource& upstream) noexcept
      : memory_resource(upstream.kind(), upstream.device()), upstream_(&upstream) {}

  /// Fails only the `k`-th allocate call from now (1-based).
  void fail_call(std::size_t k) { set_plan(plan::only_kth, require_positive(k), 0.0, 0); }
  /// Fails the `k`-th allocate call from now and every one after it (1-based).
  void fail_from(std::size_t k) { set_plan(plan::from_kth, require_positive(k), 0.0, 0); }
  /// Fails each allocate call with probability `p`, drawn from a generator seeded with `seed`.
  void fail_randomly(double p, std::uint64_t seed) {
    if (!(p >= 0.0 && p <= 1.0)) {
      throw std::invalid_argument("cudamem: failing_adaptor: probability " + std::to_string(p) +
                                  " is not in [0, 1]");
    }
    set_plan(plan::random, 0, p, seed);
  }
  /// Passes every call through.
  void never_fail() { set_plan(plan::never, 0, 0.0, 0); }

  /// Allocate calls since the plan was set (failed ones included).
  [[nodiscard]] std::size_t allocate_calls() const noexcept { return calls_.load(); }
  /// Allocate calls failed on purpose since the plan was set.
  [[nodiscard]] std::size_t injected_failures() const noexcept { return failures_.load(); }
  /// Deallocate calls passed through since construction.
  [[nodiscard]] std::size_t deallocate_calls() const noexcept { return frees_.load(); }

 private:
  enum class plan { never, only_kth, from_kth, random };
  static constexpr const char* injected_cause = "failure injected by failing_adaptor";

  static std::size_t require_positive(std::size_t k) {
    if (k == 0) {
      throw std::invalid_argument("cudamem: failing_adaptor: calls are counted from 1; k = 0 "
                                  "names no call");
    }
    return k;
  }

  void set_plan(plan p, std::size_t k, double probability, std::uint64_t seed) {
    const detail::lock_guard lock(mutex_);
    plan_ = p;
    k_ = k;
    probability_ = probability;
    rng_state_ = seed;
    calls_ = 0;
    failures_ = 0;
  }

  /// splitmix64: a tiny, well-mixed generator whose output is the same everywhere.
  static std::uint64_t next_random(std::uint64_t& state) noexcept {
    std::uint64_t z = (state += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
  }

  /// Counts the call and decides whether it fails; returns its number.
  bool should_fail(std::size_t& call) {
    const detail::lock_guard lock(mutex_);
    call = ++calls_;
    switch (plan_) {
      case plan::never: return false;
      case plan::only_kth: return call == k_;
      case plan::from_kth: return call >= k_;
      case plan::random: {
        const double draw = static_cast<double>(next_random(rng_state_) >> 11) * 0x1.0p-53;
        return draw < probability_;
      }
    }
    return false;
  }

  void maybe_fail(std::size_t bytes, std::size_t alignment) {
    std::size_t call = 0;
    if (should_fail(call)) {
      ++failures_;
      throw_out_of_memory(*this, bytes, alignment,
                          std::string(injected_cause) + " on allocate call " +
                              std::to_string(call));
    }
  }

  void* do_allocate(std::size_t bytes, std::size_t alignment, stream_view stream) override {
    maybe_fail(bytes, alignment);
    return upstream_->allocate(bytes, alignment, stream);
  }
  void do_deallocate(void* p, std::size_t bytes, std::size_t alignment,
                     stream_view stream) noexcept override {
    ++frees_;
    upstream_->deallocate(p, bytes, alignment, stream);
  }
  void* do_allocate_sync(std::size_t bytes, std::size_t alignment) override {
    maybe_fail(bytes, alignment);
    return upstream_->allocate(bytes, alignment);
  }
  void do_deallocate_sync(void* p, std::size_t bytes, std::size_t alignment) noexcept override {
    ++frees_;
    upstream_->deallocate(p, bytes, alignment);
  }

  std::string_view do_name() const noexcept override { return "failing_adaptor"; }
  std::string do_oom_hint(const memory_report& report, std::size_t /*position*/) const override {
    if (report.cause.rfind(injected_cause, 0) != 0) {
      return {};  // a real failure from below: the rest of the chain knows why
    }
    return "Nothing ran out: failing_adaptor failed this request on purpose (" + report.cause +
           "), to test that the code around it leaks nothing when an allocation fails.";
  }
  resource_stats do_stats() const override { return upstream_->stats(); }
  memory_resource* do_upstream() const noexcept override { return upstream_; }

  memory_resource* upstream_;
  detail::mutex mutex_;
  plan plan_ = plan::never;
  std::size_t k_ = 0;
  double probability_ = 0.0;
  std::uint64_t rng_state_ = 0;
  detail::atomic<std::size_t> calls_{0};
  detail::atomic<std::size_t> failures_{0};
  detail::atomic<std::size_t> frees_{0};
};

}  // namespace cudamem
