// cudamem/copy_stager.hpp — copies between ordinary (pageable) host memory and device memory
// at several times the driver's pageable speed: the data goes through a few pinned chunks that
// are kept for reuse, a few host threads share each chunk's memcpy, and each chunk's DMA runs
// on the copy's stream while the next chunk is being copied on the host.
//
//   #include <cudamem/copy_stager.hpp>
//
//   std::vector<float> host(n);
//   cudamem::device_buffer<float> dev(n, s);
//   cudamem::copy(dev, host, s);        // copy.hpp: above 1 MiB it is staged, by itself
//   // Explicit use, and the knobs:
//   cudamem::copy_stager& stager = cudamem::default_copy_stager();   // the current device's
//   stager.set_options({.chunk_bytes = 4 << 20, .chunk_count = 2, .threads = 2});  // smaller
//   stager.copy_to_device(dev.data(), host.data(), n * sizeof(float), s);
//   stager.copy_to_host(host.data(), dev.data(), n * sizeof(float), s);
//   stager.release();                   // pinned chunks back to CUDA, worker threads joined
//   cudamem::set_direct_copy_max_bytes(SIZE_MAX);    // cudamem::copy: never stage
//
// Why. The driver copies pageable memory by staging it itself, through a small pinned buffer,
// one piece at a time, on one thread: 10 GB/s to an H100 and 17 GB/s from it, where pinned
// memory moves at 55 GB/s. Pinning the user's memory (cudaHostRegister) costs more than the
// copy unless the memory is copied many times; copying through chunks pinned once does not.
//
// Why a template. `copy_stager` is `basic_copy_stager<>`, and `default_copy_stager` and
// `release_default_copy_stagers` are function templates, all of one instantiation. A
// device_buffer's header includes this one (its constructor from a host range stages large
// copies), so every file that declares a buffer would otherwise compile the stager's ~300
// lines of non-template code; as templates they are compiled only in a file that copies
// between host and device memory (bench/compile_time.py: ~0.3 s of each nvcc translation
// unit). Nothing else changes: the names are used as before.
//
// Contract
// - `copy_to_device(dst, src, bytes, stream)` / `copy_to_host(dst, src, bytes, stream)`: `src` /
//   `dst` on the host may be any host memory (pageable memory is what it is for); the other
//   side is memory the GPU can copy to or from (device memory). Same semantics as a pageable
//   cudaMemcpyAsync: work submitted to `stream` before the call is finished before the data is
//   read (copy_to_host) or written (copy_to_device) on the device; when the call returns the
//   host source may be reused (copy_to_device) and the host destination holds the data
//   (copy_to_host). Work submitted to `stream` after the call sees the data on the device.
//   0 bytes does nothing; a null pointer with bytes > 0 throws std::invalid_argument.
// - `stream` must belong to the stager's device (events are recorded on it), or be a default
//   stream while that device is current. `default_copy_stager()` is chosen that way by copy().
// - Pinned memory is bounded: at most `chunk_count` chunks of `chunk_bytes`, allocated on first
//   use and kept (a cudaHostAlloc of 4 MiB costs ~2 ms: paying it per copy would undo the
//   gain) until `release()`, `set_options()` or the stager's destruction. A copy splits into
//   stages of at most chunk_bytes (smaller ones for short copies, so that even a 2 MiB copy
//   has 4 stages to overlap) and uses up to chunk_count chunks in turn; a chunk is written
//   again only after the event recorded behind its previous DMA has passed.
// - Threads: each stage's memcpy is shared by the calling thread and up to `threads - 1`
//   worker threads (started on first use, joined by release() and the destructor). Several
//   threads may copy through one stager at once: each copy holds its own chunks (a copy that
//   finds none free waits for one), and the workers serve every copy.
// - Failure part-way (no pinned memory, a CUDA error from a copy or an event): the call throws
//   that error (`out_of_memory`, `cuda_error`), and before it does, no worker still touches the
//   user's memory and every chunk the copy held is back with the stager — after waiting for
//   `stream`, so no DMA into a chunk is still in flight; if that wait fails too, the chunks
//   are freed instead of kept. The data of a failed copy is unspecified.
// - Options are checked: chunk_bytes from 64 KiB to 1 GiB and a multiple of 4 KiB,
//   chunk_count 1-64, threads 1-64, at most 4 GiB pinned in all; otherwise
//   std::invalid_argument naming the field. `set_options` and `release` wait for copies in
//   progress through this stager, then free its chunks and join its workers.
// - Stream capture: a copy on a capturing stream is not staged by cudamem::copy (host waits
//   cannot be captured); the stager itself refuses nothing, so don't call it there.
// - `default_copy_stager(device)`: one per device, made on first use, never destroyed (copies
//   from static destructors stay legal); at exit (std::atexit, registered when the first is
//   made) their chunks are freed and their threads joined, and copies after that go direct.
//   `release_default_copy_stagers()` does the same now, without retiring them.
// - `direct_copy_max_bytes()`: cudamem::copy (and device_buffer's constructor from a host
//   range) copy at most this many bytes with one plain cudaMemcpyAsync; larger copies between
//   pageable host memory and device memory are staged through `default_copy_stager` of the
//   stream's device. Default 1 MiB, measured (default_direct_copy_max_bytes says how).
//
// Parts (detail/copy/; each opens with what it owns)
//   stager_options.hpp   copy_stager_options (the defaults, measured), their checks, how a
//                        copy is cut into stages, copy_stager_stats
//   memcpy_workers.hpp   the host threads that share one memcpy
//   transfer_engine.hpp  the CUDA calls of the pipeline behind an interface (tests: a fake)
//   default_stagers.hpp  when cudamem::copy stages (direct_copy_max_bytes), and the stagers it
//                        uses (default_copy_stager, release_default_copy_stagers)
// Here: the stager (chunks, pipeline, failures).
#pragma once

#include <cudamem/detail/copy/default_stagers.hpp>
#include <cudamem/detail/copy/memcpy_workers.hpp>
#include <cudamem/detail/copy/stager_options.hpp>
#include <cudamem/detail/copy/transfer_engine.hpp>
#include <cudamem/detail/cuda/cuda_upstream.hpp>
#include <cudamem/detail/cuda/stream_ops.hpp>
#include <cudamem/detail/sync/atomic.hpp>
#include <cudamem/detail/sync/mutex.hpp>
#include <cudamem/detail/unique_owner.hpp>
#include <cudamem/device.hpp>
#include <cudamem/error.hpp>
#include <cudamem/stream.hpp>

#include <cuda_runtime_api.h>

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <vector>

namespace cudamem {
/// Copies between pageable host memory and device memory through pinned chunks kept for reuse.
/// Use it as `copy_stager` (basic_copy_stager<>); see "Why a template" above.
template <class Deferred = void>
class basic_copy_stager {
 public:
  /// A stager for copies on streams of `device` (-1: the current device).
  explicit basic_copy_stager(int device = -1, const copy_stager_options& options = {})
      : basic_copy_stager(detail::make_unique_owner<detail::cuda_transfer_engine>(
                        detail::resolve_device(device)),
                    options) {}

  /// A stager over any engine (tests: a fake), given by its owning pointer (a unique_ptr).
  template <class EngineOwner>
    requires requires(EngineOwner& owner) {
      { owner.release() } -> std::convertible_to<detail::transfer_engine*>;
    }
  explicit basic_copy_stager(EngineOwner engine, const copy_stager_options& options = {})
      : options_(detail::validated_stager_options(options)),
        engine_(engine.release()),
        slots_(options_.chunk_count) {
    if (engine_ == nullptr) {
      throw std::invalid_argument("cudamem::copy_stager: the transfer engine is null");
    }
  }

  basic_copy_stager(const basic_copy_stager&) = delete;
  basic_copy_stager& operator=(const basic_copy_stager&) = delete;

  /// Waits for copies in progress, frees the chunks, joins the workers.
  ~basic_copy_stager() { release(); }

  /// Copies `bytes` from host memory `src` to device memory `dst` in stream order on `stream`;
  /// `src` may be reused when it returns.
  void copy_to_device(void* dst, const void* src, std::size_t bytes, stream_view stream) {
    if (bytes == 0) {
      return;
    }
    check_pointers(dst, src, "copy_to_device");
    run_copy(static_cast<unsigned char*>(dst), static_cast<const unsigned char*>(src), bytes,
             stream, direction::to_device);
  }

  /// Copies `bytes` from device memory `src` to host memory `dst` after the work already on
  /// `stream`; `dst` holds the data when it returns.
  void copy_to_host(void* dst, const void* src, std::size_t bytes, stream_view stream) {
    if (bytes == 0) {
      return;
    }
    check_pointers(dst, src, "copy_to_host");
    run_copy(static_cast<unsigned char*>(dst), static_cast<const unsigned char*>(src), bytes,
             stream, direction::to_host);
  }
  /// The options in force.
  [[nodiscard]] copy_stager_options options() const {
    const detail::lock_guard lock{mutex_};
    return options_;
  }

  /// New options, once the copies in progress are done; the chunks are freed (the next copy
  /// allocates chunks of the new size) and the workers joined.
  void set_options(const copy_stager_options& options) {
    const copy_stager_options checked = detail::validated_stager_options(options);
    std::vector<chunk_slot> fresh(checked.chunk_count);  // before anything changes: may throw
    detail::unique_lock lock{mutex_};
    idle_.wait(lock, [this] { return copies_in_progress_ == 0; });
    free_chunks(lock);
    workers_.stop();
    options_ = checked;
    slots_.swap(fresh);
  }

  /// Frees every chunk and joins the workers, once the copies in progress are done. The next
  /// copy starts over (allocating chunks and starting threads again).
  void release() noexcept {
    detail::unique_lock lock{mutex_};
    idle_.wait(lock, [this] { return copies_in_progress_ == 0; });
    free_chunks(lock);
    workers_.stop();
  }
  /// What it holds now and has done since it was made.
  [[nodiscard]] copy_stager_stats stats() const {
    copy_stager_stats s;
    {
      const detail::lock_guard lock{mutex_};
      for (const chunk_slot& slot : slots_) {
        if (slot.memory != nullptr) {
          ++s.chunks_allocated;
          s.pinned_bytes += options_.chunk_bytes;
          s.chunks_in_use += slot.taken ? 1 : 0;
        }
      }
      s.copies_in_progress = copies_in_progress_;
      s.staged_copies = staged_copies_;
    }
    s.memcpy_pieces_in_flight = workers_.pieces_in_flight();
    s.worker_threads = workers_.threads();
    return s;
  }

 private:
  enum class direction { to_device, to_host };

  struct chunk_slot {
    unsigned char* memory = nullptr;
    detail::transfer_engine::fence done = nullptr;  // recorded behind the chunk's last DMA
    bool fence_pending = false;  // `done` was recorded and not yet waited for
    bool taken = false;          // held by a copy now
  };

  /// The chunks one copy holds, and what it must undo if it fails (see the contract).
  class held_chunks {
   public:
    held_chunks(basic_copy_stager& owner, std::vector<std::size_t> slots, stream_view stream)
        : owner_(owner), slots_(std::move(slots)), stream_(stream) {}
    held_chunks(const held_chunks&) = delete;
    held_chunks& operator=(const held_chunks&) = delete;
    ~held_chunks() { owner_.give_back(slots_, stream_, succeeded_); }

    [[nodiscard]] std::size_t count() const noexcept { return slots_.size(); }
    [[nodiscard]] chunk_slot& operator[](std::size_t i) noexcept {
      return owner_.slots_[slots_[i % slots_.size()]];  // the slot's fields are this copy's
    }
    void succeeded() noexcept { succeeded_ = true; }

   private:
    basic_copy_stager& owner_;
    std::vector<std::size_t> slots_;
    stream_view stream_;
    bool succeeded_ = false;
  };

  static void check_pointers(const void* dst, const void* src, const char* what) {
    if (dst == nullptr || src == nullptr) {
      throw std::invalid_argument(std::string("cudamem::copy_stager::") + what + ": the " +
                                  (dst == nullptr ? "destination" : "source") + " is null");
    }
  }

  void run_copy(unsigned char* dst, const unsigned char* src, std::size_t bytes,
                stream_view stream, direction way) {
    copy_stager_options o;
    std::vector<std::size_t> taken;
    {
      detail::unique_lock lock{mutex_};
      o = options_;
      const std::size_t stage = detail::stage_bytes(bytes, o);
      const std::size_t stages = (bytes + stage - 1) / stage;
      const std::size_t wanted = stages < o.chunk_count ? stages : std::size_t{o.chunk_count};
      chunk_freed_.wait(lock, [this] { return free_slot_count() > 0; });
      for (std::size_t i = 0; i < slots_.size() && taken.size() < wanted; ++i) {
        if (!slots_[i].taken) {
          taken.push_back(i);  // if this throws, nothing is marked taken yet
        }
      }
      for (const std::size_t i : taken) {
        slots_[i].taken = true;
      }
      ++copies_in_progress_;
      ++staged_copies_;
    }
    held_chunks chunks(*this, std::move(taken), stream);
    allocate_missing(chunks, o.chunk_bytes);
    const std::size_t stage = detail::stage_bytes(bytes, o);
    const std::size_t stages = (bytes + stage - 1) / stage;
    const auto length = [&](std::size_t i) {
      return stage < bytes - i * stage ? stage : bytes - i * stage;
    };
    if (way == direction::to_device) {
      for (std::size_t i = 0; i < stages; ++i) {
        chunk_slot& chunk = chunks[i];
        settle(chunk);  // its previous DMA has read it
        workers_.copy(chunk.memory, src + i * stage, length(i), o.threads);
        enqueue_dma(chunk, dst + i * stage, chunk.memory, length(i), stream);
      }
    } else {
      const std::size_t ahead = chunks.count();
      for (std::size_t i = 0; i < ahead && i < stages; ++i) {
        settle(chunks[i]);
        enqueue_dma(chunks[i], chunks[i].memory, src + i * stage, length(i), stream);
      }
      for (std::size_t i = 0; i < stages; ++i) {
        chunk_slot& chunk = chunks[i];
        settle(chunk);  // its DMA has landed
        workers_.copy(dst + i * stage, chunk.memory, length(i), o.threads);
        if (i + ahead < stages) {
          enqueue_dma(chunk, chunk.memory, src + (i + ahead) * stage, length(i + ahead), stream);
        }
      }
    }
    chunks.succeeded();
  }

  std::size_t free_slot_count() const noexcept {
    std::size_t taken = 0;
    for (const chunk_slot& slot : slots_) {
      taken += slot.taken ? 1 : 0;
    }
    return slots_.size() - taken;
  }

  /// Pinned memory and an event for every held chunk that has none yet (outside the lock:
  /// cudaHostAlloc takes milliseconds). On failure the caller's held_chunks gives them back.
  void allocate_missing(held_chunks& chunks, std::size_t chunk_bytes) {
    for (std::size_t i = 0; i < chunks.count(); ++i) {
      chunk_slot& slot = chunks[i];
      if (slot.memory != nullptr) {
        continue;
      }
      detail::transfer_engine::fence done = engine_->make_fence();
      void* memory = nullptr;
      try {
        memory = engine_->allocate_chunk(chunk_bytes);
      } catch (...) {
        engine_->destroy_fence(done);
        throw;
      }
      const detail::lock_guard lock{mutex_};  // stats() reads `memory`
      slot.memory = static_cast<unsigned char*>(memory);
      slot.done = done;
      slot.fence_pending = false;
    }
  }

  /// Waits until the chunk's last DMA is done.
  void settle(chunk_slot& chunk) {
    if (chunk.fence_pending) {
      engine_->wait(chunk.done);
      chunk.fence_pending = false;
    }
  }

  void enqueue_dma(chunk_slot& chunk, void* dst, const void* src, std::size_t bytes,
                   stream_view stream) {
    engine_->copy_async(dst, src, bytes, stream);
    engine_->record(chunk.done, stream);
    chunk.fence_pending = true;
  }

  /// Returns a copy's chunks. After a failure the stream is waited for first (a DMA may still
  /// be writing or reading a chunk with no fence behind it); if that fails, they are freed.
  void give_back(const std::vector<std::size_t>& held, stream_view stream,
                 bool succeeded) noexcept {
    const bool settled = succeeded || engine_->synchronize(stream);
    {
      const detail::lock_guard lock{mutex_};
      for (const std::size_t i : held) {
        chunk_slot& slot = slots_[i];
        if (!succeeded) {
          slot.fence_pending = false;
          if (!settled && slot.memory != nullptr) {
            engine_->deallocate_chunk(slot.memory, options_.chunk_bytes);
            engine_->destroy_fence(slot.done);
            slot.memory = nullptr;
            slot.done = nullptr;
          }
        }
        slot.taken = false;
      }
      --copies_in_progress_;
    }
    chunk_freed_.notify_all();
    idle_.notify_all();
  }

  /// Frees every chunk; called with the lock held and no copy in progress.
  void free_chunks(detail::unique_lock<detail::mutex>& /*held*/) noexcept {
    for (chunk_slot& slot : slots_) {
      if (slot.memory == nullptr) {
        continue;
      }
      if (slot.fence_pending) {
        try {
          engine_->wait(slot.done);  // an upload may still read it
        } catch (const std::exception&) {  // reported by the free below failing, if it does
        }
      }
      engine_->destroy_fence(slot.done);
      engine_->deallocate_chunk(slot.memory, options_.chunk_bytes);
      slot = chunk_slot{};
    }
  }

  mutable detail::mutex mutex_;
  detail::condition_variable chunk_freed_;  // a copy gave its chunks back
  detail::condition_variable idle_;         // ... and copies_in_progress_ may be 0
  copy_stager_options options_;
  detail::unique_owner<detail::transfer_engine> engine_;
  std::vector<chunk_slot> slots_;  // fields of a taken slot belong to the copy holding it
  std::size_t copies_in_progress_ = 0;
  std::uint64_t staged_copies_ = 0;
  detail::memcpy_workers workers_;
};

/// The stager (see the contract).
using copy_stager = basic_copy_stager<>;

}  // namespace cudamem
