// cudamem/detail/adaptors/adaptor_base.hpp — what every adaptor (tracking, statistics, limiting,
// logging, retry) has in common: it wraps an upstream resource, is a resource itself, and
// forwards each request in the form it arrived in (on a stream, or synchronously).
//
// An adaptor derives from `adaptor_base<itself>` and writes two functions,
//
//   void* adapt_allocate(std::size_t bytes, std::size_t alignment, request_stream stream);
//   void adapt_deallocate(void* p, std::size_t bytes, std::size_t alignment,
//                         request_stream stream) noexcept;
//
// and forwards with `forward_allocate` / `forward_deallocate`. CRTP rather than a second
// virtual layer: the adaptors sit on the hot path of every allocation, and one virtual call
// per level (the resource's own do_allocate) is all they should cost in dispatch. A request is
// checked once, where it enters the chain (memory_resource::allocate); the adaptor passes it
// to the upstream's implementation directly (`allocate_checked`), so a chain of four adaptors
// does not validate the alignment, or record the call site, four times.
//
// Why both forms go through one function: a stream-ordered request must stay stream-ordered
// all the way down, and a synchronous one must reach the upstream's synchronous form (which,
// for host-only upstreams, touches no CUDA API at all). `request_stream` carries which it was.
#pragma once

#include <cudamem/memory_resource.hpp>
#include <cudamem/out_of_memory.hpp>

#include <cstddef>
#include <optional>
#include <string>

namespace cudamem::detail {

/// The stream a request arrived on; empty for the synchronous form.
using request_stream = std::optional<stream_view>;

template <class Adaptor>
class adaptor_base : public memory_resource {
 public:
  /// The resource this adaptor forwards to.
  [[nodiscard]] memory_resource& upstream_resource() const noexcept { return *upstream_; }

 protected:
  /// The adaptor gives the same kind of memory, on the same device, as its upstream.
  explicit adaptor_base(memory_resource& upstream) noexcept
      : memory_resource(upstream.kind(), upstream.device()), upstream_(&upstream) {}

  /// Asks the upstream in the form the request arrived in. An `out_of_memory` from below is
  /// rethrown with a report that starts at this adaptor, so the outermost adaptor's report
  /// shows the whole chain (budgets included); the upstream's verdict and cause are kept,
  /// since the resource that failed knew best why, and so is which one failed first.
  void* forward_allocate(std::size_t bytes, std::size_t alignment, request_stream stream) {
    try {
      // The request was checked (and its call site recorded) when it entered this adaptor.
      return stream ? allocate_checked(*upstream_, bytes, alignment, *stream)
                    : allocate_checked(*upstream_, bytes, alignment);
    } catch (const out_of_memory& below) {
      rethrow_out_of_memory(*this, bytes, alignment, below.report());
    }
  }

  void forward_deallocate(void* p, std::size_t bytes, std::size_t alignment,
                          request_stream stream) noexcept {
    if (stream) {
      upstream_->deallocate(p, bytes, alignment, *stream);
    } else {
      upstream_->deallocate(p, bytes, alignment);
    }
  }

 private:
  Adaptor& self() noexcept { return static_cast<Adaptor&>(*this); }

  void* do_allocate(std::size_t bytes, std::size_t alignment, stream_view stream) final {
    return self().adapt_allocate(bytes, alignment, request_stream{stream});
  }
  void do_deallocate(void* p, std::size_t bytes, std::size_t alignment,
                     stream_view stream) noexcept final {
    self().adapt_deallocate(p, bytes, alignment, request_stream{stream});
  }
  void* do_allocate_sync(std::size_t bytes, std::size_t alignment) final {
    return self().adapt_allocate(bytes, alignment, std::nullopt);
  }
  void do_deallocate_sync(void* p, std::size_t bytes, std::size_t alignment) noexcept final {
    self().adapt_deallocate(p, bytes, alignment, std::nullopt);
  }
  memory_resource* do_upstream() const noexcept final { return upstream_; }
  bool do_allows_nvtx_heaps() const noexcept final { return upstream_->allows_nvtx_heaps(); }

  memory_resource* upstream_;
};

}  // namespace cudamem::detail
