// cudamem/size_routing_resource.hpp — one resource in front of two: each request goes to one of
// them by its size, requests of [min_bytes, max_bytes] to the first, all others to the second.
//
//   cudamem::nccl_mem_resource nccl_memory{0};                        // (cudamem/nccl.hpp)
//   cudamem::nccl_registering_adaptor registering{nccl_memory, comm};
//   cudamem::pool_resource registered{registering};    // chunks registered with `comm`
//   cudamem::device_resource device;
//   cudamem::pool_resource plain{device};              // chunks NCCL does not know
//   cudamem::size_routing_resource router{registered, plain,
//                                         {.min_bytes = 8ull << 20, .max_bytes = 256ull << 20}};
//   void* a = router.allocate(64ull << 20, 256, s);    // 64 MiB: from `registered`
//   void* b = router.allocate(2ull << 20, 256, s);     // 2 MiB: from `plain`
//   router.deallocate(b, 2ull << 20, 256, s);          // back to `plain`, chosen by its size
//   router.deallocate(a, 64ull << 20, 256, s);
//
//   cudamem::size_routing_resource small_first{small_pool, big_blocks, {.max_bytes = 64 << 10}};
//
// Why. NCCL runs faster on registered buffers only for some sizes: measured on two H100s with
// NCCL 2.28, registered buffers are 2-8% faster at 8-256 MiB and 3-5% slower at 2-4 MiB and at
// 512 MiB-1 GiB. So a pool whose chunks are registered with the communicator serves the sizes
// where registration wins, and an unregistered pool the rest. More generally, any split by
// size: a small-object pool beside a resource for large blocks.
//
// Contract (memory_resource.hpp's, plus)
// - Routing. A request of `bytes` goes to `in_range` when min_bytes <= bytes <= max_bytes (both
//   ends included), else to `otherwise`. Alignment and stream play no part. Zero-byte requests
//   never get here (memory_resource::allocate answers them with nullptr and calls nothing), so
//   min_bytes = 0 means the same as 1. The defaults (0, SIZE_MAX) make `{.min_bytes = n}` "n
//   bytes and more" and `{.max_bytes = n}` "up to n bytes".
// - Frees are routed by the same rule, from the size given to deallocate, which the contract
//   already requires to be the size allocated: the router keeps no table and no state that
//   changes. A free with another size may reach the other resource; one that checks (pools,
//   tracking_adaptor, simulated_resource) reports a pointer it never gave out and leaves it
//   alone; one that does not (host_resource) frees it as its own, which is undefined. Put a
//   tracking_adaptor above the router to find such a free.
// - Both forms are forwarded as they came: allocate/deallocate on a stream reach the chosen
//   resource on that stream, the synchronous forms reach its synchronous forms (so host-only
//   resources behind it touch no CUDA API).
// - Exceptions pass through unchanged: the chosen resource's out_of_memory (or anything else)
//   reaches the caller as that resource threw it, so its report shows the branch that failed,
//   its chain and its verdict, and says why. The router holds nothing itself: a failed request
//   asked only the one resource, and the other was never called.
// - Thread-safe as far as the two resources are: the router only reads what it was built with.
// - Construction refuses, with std::invalid_argument: min_bytes > max_bytes; the same resource
//   object as both (its figures would count twice, and a split that sends everything to one
//   place is a mistake); resources that give different kinds of memory or memory on
//   different devices (kind() and device() must describe every pointer the router returns,
//   and owners rely on them). Two objects that merely compare equal (two host_resources) are
//   two resources: each counts its own.
// - Both resources are referred to, not owned (like every adaptor): they must outlive the
//   router and every allocation made through it.
// - What it is. kind() and device() are the two resources' (the same, see above). is_equal: a
//   router with the same bounds over resources equal to these, so memory from one may be freed
//   through the other. allows_nvtx_heaps() when both allow it (a sub-allocator above may get
//   memory from either).
// - Reports. A memory_report walks one chain (upstream()), and a router has two, so the walk
//   ends here: upstream() is nullptr. stats() are the two resources' reserved, used and peak
//   bytes summed (the peak is a bound: the two need not have peaked at once); the pool-only and
//   budget figures are left empty, since one pool's free blocks or one budget, summed with the
//   other branch's, would let a report blame a request on memory it can never reach. The
//   router's out-of-memory advice (asked when an adaptor above it passes a failure on, the
//   report then starting above the router) says which resource the request went to, what each
//   holds, and then the general advice for the verdict; the failing branch's own report, with
//   its chain, is the one the branch threw. Such a report keeps the branch's cause and verdict,
//   but its `origin` (which resource failed first) counts positions in one chain and so cannot
//   point inside a branch: it names the router or a resource above it.
#pragma once

#include <cudamem/detail/report/verdict.hpp>
#include <cudamem/out_of_memory.hpp>
#include <cudamem/memory_resource.hpp>

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <string_view>

namespace cudamem {

/// Which requests a size_routing_resource sends to its `in_range` resource: those of
/// min_bytes to max_bytes bytes, both included.
struct size_routing_options {
  std::size_t min_bytes = 0;         ///< the smallest request routed to `in_range`
  std::size_t max_bytes = SIZE_MAX;  ///< the largest request routed to `in_range`
};

/// Sends each request to one of two resources by its size; see the contract above.
class size_routing_resource final : public memory_resource {
 public:
  /// Requests of [range.min_bytes, range.max_bytes] bytes go to `in_range`, all others to
  /// `otherwise`. Both are referred to, not owned.
  size_routing_resource(memory_resource& in_range, memory_resource& otherwise,
                        size_routing_options range)
      : memory_resource(checked_kind(in_range, otherwise, range), in_range.device()),
        in_range_(&in_range),
        otherwise_(&otherwise),
        min_bytes_(range.min_bytes),
        max_bytes_(range.max_bytes) {}

  /// The resource for requests in [min_bytes(), max_bytes()].
  [[nodiscard]] memory_resource& in_range_resource() const noexcept { return *in_range_; }
  /// The resource for all other requests.
  [[nodiscard]] memory_resource& otherwise_resource() const noexcept { return *otherwise_; }
  /// The smallest request sent to the in_range resource.
  [[nodiscard]] std::size_t min_bytes() const noexcept { return min_bytes_; }
  /// The largest request sent to the in_range resource.
  [[nodiscard]] std::size_t max_bytes() const noexcept { return max_bytes_; }

  /// Whether a request of `bytes` goes to the in_range resource.
  [[nodiscard]] bool routes_in_range(std::size_t bytes) const noexcept {
    // One unsigned comparison: below min_bytes, bytes - min_bytes wraps around to a number
    // larger than the range's width, so this is min_bytes <= bytes <= max_bytes.
    return bytes - min_bytes_ <= max_bytes_ - min_bytes_;
  }
  /// The resource a request (or a free) of `bytes` goes to.
  [[nodiscard]] memory_resource& resource_for(std::size_t bytes) const noexcept {
    return routes_in_range(bytes) ? *in_range_ : *otherwise_;
  }

 private:
  /// Checks the arguments (see the contract) before the base is built from them.
  static memory_kind checked_kind(const memory_resource& in_range,
                                  const memory_resource& otherwise,
                                  const size_routing_options& range) {
    if (range.min_bytes > range.max_bytes) {
      throw std::invalid_argument(
          "cudamem::size_routing_resource: min_bytes " + std::to_string(range.min_bytes) +
          " is larger than max_bytes " + std::to_string(range.max_bytes) +
          ", so no size would be in range");
    }
    if (&in_range == &otherwise) {
      throw std::invalid_argument(
          "cudamem::size_routing_resource: the same " + std::string(in_range.name()) +
          " was given as both the in_range and the otherwise resource; use it directly");
    }
    if (in_range.kind() != otherwise.kind() || in_range.device() != otherwise.device()) {
      throw std::invalid_argument(
          "cudamem::size_routing_resource: the in_range resource (" +
          std::string(in_range.name()) + ") gives " + std::string(to_string(in_range.kind())) +
          " memory on device " + std::to_string(in_range.device()) +
          ", the otherwise resource (" + std::string(otherwise.name()) + ") " +
          std::string(to_string(otherwise.kind())) + " memory on device " +
          std::to_string(otherwise.device()) +
          "; the router's kind() and device() must hold for every pointer it returns");
    }
    return in_range.kind();
  }

  // The request was checked (bytes non-zero, alignment valid, call site recorded) where it
  // entered the router, so it goes straight to the chosen resource's implementation; and
  // nothing is caught, so a failure reaches the caller as the chosen resource threw it.
  void* do_allocate(std::size_t bytes, std::size_t alignment, stream_view stream) override {
    return allocate_checked(resource_for(bytes), bytes, alignment, stream);
  }
  void do_deallocate(void* p, std::size_t bytes, std::size_t alignment,
                     stream_view stream) noexcept override {
    resource_for(bytes).deallocate(p, bytes, alignment, stream);
  }
  void* do_allocate_sync(std::size_t bytes, std::size_t alignment) override {
    return allocate_checked(resource_for(bytes), bytes, alignment);
  }
  void do_deallocate_sync(void* p, std::size_t bytes, std::size_t alignment) noexcept override {
    resource_for(bytes).deallocate(p, bytes, alignment);
  }

  bool do_is_equal(const memory_resource& other) const noexcept override {
    const auto* router = dynamic_cast<const size_routing_resource*>(&other);
    return router != nullptr && router->min_bytes_ == min_bytes_ &&
           router->max_bytes_ == max_bytes_ && router->in_range_->is_equal(*in_range_) &&
           router->otherwise_->is_equal(*otherwise_);
  }
  std::string_view do_name() const noexcept override { return "size_routing_resource"; }
  resource_stats do_stats() const override {
    const resource_stats a = in_range_->stats();
    const resource_stats b = otherwise_->stats();
    resource_stats s;
    s.reserved_bytes = a.reserved_bytes + b.reserved_bytes;
    s.used_bytes = a.used_bytes + b.used_bytes;
    s.peak_used_bytes = a.peak_used_bytes + b.peak_used_bytes;
    return s;  // the rest stays empty: see the contract
  }
  // nullptr, although the router has two upstreams: a report's chain is one line, and naming
  // either would show the wrong branch for half the requests (see the contract).
  memory_resource* do_upstream() const noexcept override { return nullptr; }
  bool do_allows_nvtx_heaps() const noexcept override {
    return in_range_->allows_nvtx_heaps() && otherwise_->allows_nvtx_heaps();
  }
  // The report cannot show both branches as a chain, so this names them in its advice.
  std::string do_oom_hint(const memory_report& report, std::size_t /*position*/) const override {
    const bool in_range = routes_in_range(report.requested_bytes);
    const memory_resource& chosen = in_range ? *in_range_ : *otherwise_;
    const memory_resource& other = in_range ? *otherwise_ : *in_range_;
    const resource_stats chosen_stats = chosen.stats();
    const resource_stats other_stats = other.stats();
    return "size_routing_resource sends requests of " + format_bytes(min_bytes_) + " to " +
           format_bytes(max_bytes_) + " to its in_range resource and the rest to its otherwise "
           "resource: this request of " + format_bytes(report.requested_bytes) + " went to " +
           (in_range ? "in_range (" : "otherwise (") + std::string(chosen.name()) + ", " +
           format_bytes(chosen_stats.used_bytes) + " in use of " +
           format_bytes(chosen_stats.reserved_bytes) + " reserved" +
           (chosen_stats.budget ? ", budget " + format_bytes(*chosen_stats.budget) : "") +
           "); the " + (in_range ? "otherwise" : "in_range") + " resource (" +
           std::string(other.name()) + ", " + format_bytes(other_stats.used_bytes) +
           " in use of " + format_bytes(other_stats.reserved_bytes) +
           " reserved) is never asked for this size. " + report.general_hint();
  }

  memory_resource* in_range_;
  memory_resource* otherwise_;
  std::size_t min_bytes_;
  std::size_t max_bytes_;
};

}  // namespace cudamem
