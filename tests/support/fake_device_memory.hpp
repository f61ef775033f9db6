// Test helper: a resource that claims any memory kind (device, pinned, ...) but hands out
// ordinary host memory, and records what reaches it. Lets the typed owners' logic (sizes,
// moves, release, which stream a free happens on, kind checks) run on a machine with no GPU.
#pragma once

#include <cudamem/host_resource.hpp>
#include <cudamem/memory_resource.hpp>

#include <string_view>

namespace cudamem_test {

class fake_device_memory final : public cudamem::memory_resource {
 public:
  explicit fake_device_memory(cudamem::memory_kind kind = cudamem::memory_kind::device, int device = 0)
      : memory_resource(kind, device) {}

  int allocations = 0;
  int deallocations = 0;
  int synchronous_allocations = 0;
  cudamem::stream_view last_free_stream{};
  std::size_t last_alignment = 0;

  [[nodiscard]] std::size_t used_bytes() const { return host_.stats().used_bytes; }

 private:
  void* do_allocate(std::size_t bytes, std::size_t alignment, cudamem::stream_view) override {
    ++allocations;
    last_alignment = alignment;
    return host_.allocate(bytes, alignment);
  }
  void do_deallocate(void* p, std::size_t bytes, std::size_t alignment,
                     cudamem::stream_view s) noexcept override {
    ++deallocations;
    last_free_stream = s;
    host_.deallocate(p, bytes, alignment);
  }
  void* do_allocate_sync(std::size_t bytes, std::size_t alignment) override {
    ++synchronous_allocations;
    return do_allocate(bytes, alignment, {});
  }
  void do_deallocate_sync(void* p, std::size_t bytes, std::size_t alignment) noexcept override {
    do_deallocate(p, bytes, alignment, {});
  }
  std::string_view do_name() const noexcept override { return "fake_device_memory"; }
  cudamem::resource_stats do_stats() const override { return host_.stats(); }

  cudamem::host_resource host_;
};

}  // namespace cudamem_test
