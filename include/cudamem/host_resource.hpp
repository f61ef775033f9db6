// cudamem/host_resource.hpp — ordinary host memory (aligned operator new) as a cudamem
// resource: for host pipelines, and for running pools, arenas and adaptors with no GPU.
//
//   cudamem::host_resource host;
//   void* p = host.allocate(4096, 64);       // synchronous form; no CUDA call is made
//   host.deallocate(p, 4096, 64);
//   cudamem::pool_resource pool{host};       // a pool over host memory, testable anywhere
//
// Contract
// - Kind `host`, device -1. Touches no CUDA API at all, in either form: the stream is
//   ignored (host memory is not stream-ordered), so it works on a machine with no driver.
// - Any power-of-two alignment. Failure throws `out_of_memory` (verdict `unknown`: the
//   operating system does not say why).
// - All host_resource objects are interchangeable (`is_equal` is true between them).
// - Counts bytes in use and the peak, so tests can see that everything came back.
#pragma once

#include <cudamem/detail/usage_counter.hpp>
#include <cudamem/memory_resource.hpp>
#include <cudamem/out_of_memory.hpp>

#include <new>
#include <string>

namespace cudamem {

/// Ordinary host memory (aligned operator new) as a resource of kind `host`.
class host_resource final : public memory_resource {
 public:
  host_resource() noexcept : memory_resource(memory_kind::host, -1) {}

 private:
  void* do_allocate(std::size_t bytes, std::size_t alignment, stream_view /*stream*/) override {
    return do_allocate_sync(bytes, alignment);
  }
  void do_deallocate(void* p, std::size_t bytes, std::size_t alignment,
                     stream_view /*stream*/) noexcept override {
    do_deallocate_sync(p, bytes, alignment);
  }
  void* do_allocate_sync(std::size_t bytes, std::size_t alignment) override {
    void* p = ::operator new(bytes, std::align_val_t{alignment}, std::nothrow);
    if (p == nullptr) {
      throw_out_of_memory(*this, bytes, alignment, "operator new failed");
    }
    usage_.add(bytes);
    return p;
  }
  void do_deallocate_sync(void* p, std::size_t bytes, std::size_t alignment) noexcept override {
    ::operator delete(p, bytes, std::align_val_t{alignment});
    usage_.subtract(bytes);
  }
  bool do_is_equal(const memory_resource& other) const noexcept override {
    return dynamic_cast<const host_resource*>(&other) != nullptr;
  }
  std::string_view do_name() const noexcept override { return "host_resource"; }
  std::string do_oom_hint(const memory_report& report, std::size_t /*position*/) const override {
    if (report.verdict != oom_verdict::unknown) {
      return {};
    }
    return "The operating system refused " + format_bytes(report.requested_bytes) +
           " of host memory: the machine's memory, or a limit on this process (ulimit -v, a "
           "container's memory limit), is used up.";
  }
  resource_stats do_stats() const override { return usage_.leaf_stats(); }

  detail::usage_counter usage_;
};

}  // namespace cudamem
