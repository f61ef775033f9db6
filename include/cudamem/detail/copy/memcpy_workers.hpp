// cudamem/detail/copy/memcpy_workers.hpp — a few host threads that share one large memcpy, for
// copy_stager (copy_stager.hpp). One thread copies host memory at about 8-12 GB/s; the copy
// engine of a GPU moves pinned memory at 50+ GB/s, so a staging pipeline whose host side runs
// on one thread is limited by that thread. Here the caller hands out pieces of a memcpy to the
// workers, copies a piece itself, and returns when every piece is done.
//
//   detail::memcpy_workers workers;            // no thread yet
//   workers.copy(dst, src, 4 << 20, 4);         // starts 3 threads; 4 pieces of 1 MiB
//   workers.stop();                             // joins them (the next copy starts them again)
//
// - `copy` is noexcept and always copies: if a thread cannot be started or a piece cannot be
//   queued, the caller copies that part itself. It returns only when no worker is still
//   touching `dst` or `src` (what makes the stager's exception safety simple).
// - Several threads may call `copy` at once; their pieces share the workers (first come, first
//   served). `stop` must not run beside a `copy` (copy_stager stops them only when idle).
#pragma once

#include <cudamem/detail/sync/mutex.hpp>
#include <cudamem/detail/sync/thread.hpp>

#include <cstddef>
#include <cstring>
#include <vector>

namespace cudamem::detail {

class memcpy_workers {
 public:
  /// Pieces smaller than this are not worth a hand-off to another thread (a wake-up costs a
  /// few microseconds; 256 KiB take ~25 us to copy).
  static constexpr std::size_t min_piece_bytes = std::size_t{256} << 10;

  memcpy_workers() = default;
  memcpy_workers(const memcpy_workers&) = delete;
  memcpy_workers& operator=(const memcpy_workers&) = delete;
  ~memcpy_workers() { stop(); }

  /// Copies `bytes` from `src` to `dst` in up to `parts` pieces, copied at once by the caller
  /// and `parts - 1` workers; returns when all are done.
  void copy(void* dst, const void* src, std::size_t bytes, unsigned parts) noexcept {
    auto* to = static_cast<unsigned char*>(dst);
    const auto* from = static_cast<const unsigned char*>(src);
    const std::size_t most = bytes / min_piece_bytes;
    parts = static_cast<unsigned>(parts < most ? parts : most);
    if (parts <= 1 || !start(parts - 1)) {
      std::memcpy(to, from, bytes);
      return;
    }
    // Pieces are multiples of 4 KiB, so no two threads write the same page.
    const std::size_t piece = (bytes / parts + 4095) / 4096 * 4096;
    batch mine;
    std::size_t handed_out = piece;  // the caller keeps [0, piece)
    {
      const detail::lock_guard lock{mutex_};
      try {
        for (; handed_out < bytes; handed_out += piece) {
          queue_.push_back({to + handed_out, from + handed_out,
                            piece < bytes - handed_out ? piece : bytes - handed_out, &mine});
          ++mine.remaining;
          ++in_flight_;
        }
      } catch (...) {  // out of memory for the queue: the caller copies the rest itself
      }
    }
    work_ready_.notify_all();
    std::memcpy(to, from, piece);
    if (handed_out < bytes) {
      std::memcpy(to + handed_out, from + handed_out, bytes - handed_out);
    }
    detail::unique_lock lock{mutex_};
    piece_done_.wait(lock, [&] { return mine.remaining == 0; });
  }

  /// Joins the worker threads. Call only while no `copy` runs.
  void stop() noexcept {
    {
      const detail::lock_guard lock{mutex_};
      stopping_ = true;
    }
    work_ready_.notify_all();
    for (detail::thread& t : threads_) {
      t.join();
    }
    threads_.clear();
    const detail::lock_guard lock{mutex_};
    stopping_ = false;
  }

  /// Worker threads alive now.
  [[nodiscard]] unsigned threads() const noexcept {
    const detail::lock_guard lock{mutex_};
    return static_cast<unsigned>(threads_.size());
  }

  /// Pieces queued or being copied by a worker now (0 whenever no `copy` is running).
  [[nodiscard]] std::size_t pieces_in_flight() const noexcept {
    const detail::lock_guard lock{mutex_};
    return in_flight_;
  }

 private:
  struct batch {
    std::size_t remaining = 0;  // pieces of one `copy` not yet done; guarded by mutex_
  };
  struct piece_of_work {
    unsigned char* dst;
    const unsigned char* src;
    std::size_t bytes;
    batch* owner;
  };

  /// First in, first out, over one vector: pieces are taken from `head_`, and the vector is
  /// emptied (keeping its capacity) whenever all of them are taken, which happens at the end of
  /// every copy. A std::deque would do the same, but costs every translation unit that
  /// includes the stager its header.
  class work_queue {
   public:
    void push_back(const piece_of_work& piece) { items_.push_back(piece); }
    [[nodiscard]] bool empty() const noexcept { return head_ == items_.size(); }
    [[nodiscard]] const piece_of_work& front() const noexcept { return items_[head_]; }
    void pop_front() noexcept {
      if (++head_ == items_.size()) {
        items_.clear();
        head_ = 0;
      }
    }

   private:
    std::vector<piece_of_work> items_;
    std::size_t head_ = 0;
  };

  /// Makes sure `wanted` workers run (fewer if threads cannot be started); false if none.
  bool start(unsigned wanted) noexcept {
    const detail::lock_guard lock{mutex_};
    try {
      while (threads_.size() < wanted) {
        threads_.emplace_back([this] { work(); });
      }
    } catch (...) {  // std::system_error: no more threads; use what we have
    }
    return !threads_.empty();
  }

  void work() noexcept {
    detail::unique_lock lock{mutex_};
    for (;;) {
      work_ready_.wait(lock, [this] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) {
        return;  // stopping, and nothing left
      }
      const piece_of_work job = queue_.front();
      queue_.pop_front();
      lock.unlock();
      std::memcpy(job.dst, job.src, job.bytes);
      lock.lock();
      --in_flight_;
      if (--job.owner->remaining == 0) {
        piece_done_.notify_all();
      }
    }
  }

  mutable detail::mutex mutex_;
  detail::condition_variable work_ready_;
  detail::condition_variable piece_done_;
  work_queue queue_;
  std::vector<detail::thread> threads_;
  std::size_t in_flight_ = 0;
  bool stopping_ = false;
};

}  // namespace cudamem::detail
