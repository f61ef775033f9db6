// Test helper: a transfer_engine (detail/copy/transfer_engine.hpp) with no GPU behind it, for
// copy_stager's host tests. "Device memory" is host memory; copies and fences go into one
// queue that a thread of its own works through after a delay, like a stream's copy engine, so
// a stager that reuses a chunk before its DMA ran, or reads one before it landed, gives wrong
// data or trips the race counter. Failures can be injected at the k-th call of each kind.
//
//   auto engine = std::make_unique<cudamem_test::fake_transfer_engine>();
//   auto& fake = *engine;                        // the stager owns it; the counters are shared
//   fake.fail_copy_at = 2;                       // the third copy_async throws cuda_error
//   cudamem::copy_stager stager{std::move(engine), options};
//   fake.enqueue([&] { device[0] = 1; });        // "a kernel" earlier on the stream
//   fake.drain();                                // what cudaStreamSynchronize would be
#pragma once

#include <cudamem/detail/copy/transfer_engine.hpp>
#include <cudamem/error.hpp>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <new>
#include <thread>

namespace cudamem_test {

/// Counts that outlive the engine (the stager destroys its engine).
struct transfer_counts {
  std::atomic<long> chunks_live{0};
  std::atomic<long> fences_live{0};
  std::atomic<long> copies{0};
  std::atomic<long> races{0};  // a chunk's bytes changed between a DMA's enqueue and its run
};

class fake_transfer_engine final : public cudamem::detail::transfer_engine {
 public:
  /// The k-th call (from 0) of each kind fails; -1: never.
  std::atomic<long> fail_allocation_at{-1};  // allocate_chunk throws std::bad_alloc
  std::atomic<long> fail_copy_at{-1};        // copy_async throws cuda_error
  std::atomic<long> fail_wait_at{-1};        // wait throws cuda_error (an async DMA error)
  std::atomic<bool> fail_synchronize{false};
  std::chrono::microseconds dma_delay{50};   // per queued copy

  explicit fake_transfer_engine(std::shared_ptr<transfer_counts> counts =
                                    std::make_shared<transfer_counts>())
      : counts_(std::move(counts)), dma_([this] { run(); }) {}

  ~fake_transfer_engine() override {
    {
      const std::lock_guard lock{mutex_};
      stopping_ = true;
    }
    changed_.notify_all();
    dma_.join();
  }

  [[nodiscard]] std::shared_ptr<transfer_counts> counts() const { return counts_; }

  /// Runs `op` on the "stream" after everything queued before it (a kernel, say).
  void enqueue(std::function<void()> op) {
    {
      const std::lock_guard lock{mutex_};
      queue_.push_back(std::move(op));
    }
    changed_.notify_all();
  }

  /// Waits until everything queued so far has run.
  void drain() {
    std::unique_lock lock{mutex_};
    changed_.wait(lock, [this] { return queue_.empty() && !busy_; });
  }

  void* allocate_chunk(std::size_t bytes) override {
    if (allocations_++ == fail_allocation_at) {
      throw std::bad_alloc();
    }
    void* p = ::operator new(bytes);
    ++counts_->chunks_live;
    const std::lock_guard lock{mutex_};
    chunks_[p] = bytes;
    return p;
  }

  void deallocate_chunk(void* chunk, std::size_t /*bytes*/) noexcept override {
    {
      const std::lock_guard lock{mutex_};
      chunks_.erase(chunk);
    }
    ::operator delete(chunk);
    --counts_->chunks_live;
  }

  fence make_fence() override {
    ++counts_->fences_live;
    return new fake_fence;
  }

  void destroy_fence(fence f) noexcept override {
    delete static_cast<fake_fence*>(f);
    --counts_->fences_live;
  }

  void copy_async(void* dst, const void* src, std::size_t bytes,
                  cudamem::stream_view /*stream*/) override {
    if (copies_++ == fail_copy_at) {
      cudamem::check(cudaErrorInvalidValue, "fake copy_async (injected)");
    }
    ++counts_->copies;
    // Only an upload's source is a chunk, which the stager must leave alone until the copy
    // ran; a download's source may change by earlier work on the stream, as on a GPU.
    const bool from_chunk = is_chunk(src);
    const std::uint64_t sum = from_chunk ? checksum(src, bytes) : 0;
    enqueue([this, dst, src, bytes, sum, from_chunk] {
      std::this_thread::sleep_for(dma_delay);
      if (from_chunk && checksum(src, bytes) != sum) {
        ++counts_->races;
      }
      std::memcpy(dst, src, bytes);
    });
  }

  void record(fence f, cudamem::stream_view /*stream*/) override {
    auto* marker = static_cast<fake_fence*>(f);
    {
      const std::lock_guard lock{mutex_};
      marker->passed = false;
    }
    enqueue([this, marker] {
      const std::lock_guard lock{mutex_};
      marker->passed = true;
    });
  }

  void wait(fence f) override {
    if (waits_++ == fail_wait_at) {
      cudamem::check(cudaErrorLaunchFailure, "fake wait (injected)");
    }
    auto* marker = static_cast<fake_fence*>(f);
    std::unique_lock lock{mutex_};
    changed_.wait(lock, [marker] { return marker->passed; });
  }

  bool synchronize(cudamem::stream_view /*stream*/) noexcept override {
    drain();
    return !fail_synchronize;
  }

 private:
  struct fake_fence {
    bool passed = true;  // guarded by mutex_
  };

  static std::uint64_t checksum(const void* p, std::size_t bytes) noexcept {
    const auto* b = static_cast<const unsigned char*>(p);
    std::uint64_t h = 1469598103934665603ull;
    for (std::size_t i = 0; i < bytes; i += 61) {  // a sample is enough to see a rewrite
      h = (h ^ b[i]) * 1099511628211ull;
    }
    return (h ^ b[bytes - 1]) * 1099511628211ull;
  }

  bool is_chunk(const void* p) {
    const std::lock_guard lock{mutex_};
    const auto* byte = static_cast<const unsigned char*>(p);
    auto next = chunks_.upper_bound(const_cast<void*>(p));
    if (next == chunks_.begin()) {
      return false;
    }
    --next;
    return byte < static_cast<const unsigned char*>(next->first) + next->second;
  }

  void run() {
    std::unique_lock lock{mutex_};
    for (;;) {
      changed_.wait(lock, [this] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) {
        return;
      }
      std::function<void()> op = std::move(queue_.front());
      queue_.pop_front();
      busy_ = true;
      lock.unlock();
      op();
      lock.lock();
      busy_ = false;
      changed_.notify_all();
    }
  }

  std::shared_ptr<transfer_counts> counts_;
  std::atomic<long> allocations_{0};
  std::atomic<long> copies_{0};
  std::atomic<long> waits_{0};
  std::mutex mutex_;
  std::condition_variable changed_;
  std::deque<std::function<void()>> queue_;
  std::map<void*, std::size_t, std::less<>> chunks_;  // allocated chunks: address -> bytes
  bool busy_ = false;
  bool stopping_ = false;
  std::thread dma_;  // last: it starts running in the constructor
};

}  // namespace cudamem_test
