// cudamem/retry_adaptor.hpp — when the upstream runs out of memory, call the user's callback
// (free a cache, trim a pool, drop a batch) and try again, a bounded number of times.
//
//   cudamem::pool_resource pool{device};
//   cudamem::retry_adaptor mr{pool, [&](const cudamem::out_of_memory& e) {
//     const bool freed = cache.evict_bytes(e.requested_bytes()) > 0;
//     pool.release();                       // give wholly free blocks back to the device
//     return freed;                         // true: worth trying again
//   }};
//   void* p = mr.allocate(bytes, 256, stream);   // may run the callback, then retries
//
// Contract
// - On `out_of_memory` from the upstream, calls `on_out_of_memory(error)` and retries if it
//   returns true, at most `max_retries` times for one request. The last `out_of_memory` is
//   rethrown (its report starting at this adaptor) when the callback returns false or the
//   retries are spent. Other exceptions pass through at once, and so does one thrown by the
//   callback itself.
// - The callback runs on the allocating thread with no lock held: it may allocate and free
//   through this adaptor or any other resource. If several threads allocate through the
//   adaptor, it may run on several of them at once, so it must be thread-safe then.
// - `retries()` counts retries over the adaptor's life, `recoveries()` the requests that
//   succeeded after at least one retry.
// - `max_retries` of 0 means never retry (the callback is still called, to let the user
//   log or clean up).
#pragma once

#include <cudamem/detail/adaptors/adaptor_base.hpp>
#include <cudamem/detail/sync/atomic.hpp>
#include <cudamem/memory_resource.hpp>
#include <cudamem/out_of_memory.hpp>

#include <algorithm>
#include <cstddef>
#include <functional>
#include <stdexcept>
#include <string_view>
#include <utility>

namespace cudamem {

/// Forwards to its upstream; on `out_of_memory`, calls the callback and retries.
class retry_adaptor final : public detail::adaptor_base<retry_adaptor> {
 public:
  /// Whether the callback freed something worth another try.
  using callback = std::function<bool(const out_of_memory&)>;

  /// Throws std::invalid_argument for an empty callback.
  retry_adaptor(memory_resource& upstream, callback on_out_of_memory, int max_retries = 3)
      : adaptor_base(upstream),
        on_out_of_memory_(std::move(on_out_of_memory)),
        max_retries_(std::max(max_retries, 0)) {
    if (!on_out_of_memory_) {
      throw std::invalid_argument("retry_adaptor: the callback is empty");
    }
  }

  /// The most retries for one request (a negative value given is 0).
  [[nodiscard]] int max_retries() const noexcept { return max_retries_; }
  /// Retries made so far, over all requests.
  [[nodiscard]] std::size_t retries() const noexcept {
    return retries_.load(detail::memory_order_relaxed);
  }
  /// Requests that succeeded after at least one retry.
  [[nodiscard]] std::size_t recoveries() const noexcept {
    return recoveries_.load(detail::memory_order_relaxed);
  }

 private:
  friend class detail::adaptor_base<retry_adaptor>;

  void* adapt_allocate(std::size_t bytes, std::size_t alignment, detail::request_stream stream) {
    for (int attempt = 0;; ++attempt) {
      try {
        void* p = forward_allocate(bytes, alignment, stream);
        if (attempt > 0) {
          recoveries_.fetch_add(1, detail::memory_order_relaxed);
        }
        used_.fetch_add(bytes, detail::memory_order_relaxed);
        return p;
      } catch (const out_of_memory& error) {
        // The callback runs inside the handler so it can read the report; it holds no lock.
        if (!on_out_of_memory_(error) || attempt >= max_retries_) {
          throw;
        }
      }
      retries_.fetch_add(1, detail::memory_order_relaxed);
    }
  }

  void adapt_deallocate(void* p, std::size_t bytes, std::size_t alignment,
                        detail::request_stream stream) noexcept {
    forward_deallocate(p, bytes, alignment, stream);
    used_.fetch_sub(bytes, detail::memory_order_relaxed);
  }

  std::string_view do_name() const noexcept override { return "retry_adaptor"; }
  resource_stats do_stats() const override {
    resource_stats s;
    s.reserved_bytes = s.used_bytes = used_.load(detail::memory_order_relaxed);
    return s;
  }

  callback on_out_of_memory_;
  int max_retries_;
  detail::atomic<std::size_t> retries_{0};
  detail::atomic<std::size_t> recoveries_{0};
  detail::atomic<std::size_t> used_{0};
};

}  // namespace cudamem
