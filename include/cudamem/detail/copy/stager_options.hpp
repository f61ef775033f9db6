// cudamem/detail/copy/stager_options.hpp — what a copy_stager is told and what it reports:
// its options (chunk size, chunk count, threads: the defaults and the measurements behind them),
// the ranges they are checked against, how a copy is cut into stages, and its stats.
//
//   cudamem::copy_stager_options o{.chunk_bytes = 4 << 20, .chunk_count = 2, .threads = 2};
//   detail::validated_stager_options(o);       // std::invalid_argument naming a bad field
//   detail::stage_bytes(64 << 20, o);          // 4 MiB: each stage fills one chunk
//
// Part of copy_stager.hpp, whose contract gives the allowed ranges; the stager itself, its
// chunks and its pipeline are there.
#pragma once

#include <cudamem/detail/sync/thread.hpp>

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>

namespace cudamem {

/// Host threads per staged memcpy by default: half the machine's hardware threads, 1 to 8.
/// Why. One thread's memcpy out of pageable memory is about the driver's own staging speed:
/// measured on the H100's 16-core host at 256 MiB (bench_buffers, section 4), 1 thread 9.9 GB/s
/// to the device, 2 threads 17.6, 4 threads 25.7, 6 threads 30.2, 8 threads 35.6 (8 MiB
/// chunks); from the device 9.5 / 17.0 / 28.2 / 35.2 / 42.6. Half the cores leaves the others
/// to the program; on a small machine the threads would only contend.
[[nodiscard]] inline unsigned default_copy_threads() noexcept {
  const unsigned half = detail::hardware_threads() / 2;
  return half < 1u ? 1u : half > 8u ? 8u : half;
}

/// How a copy_stager stages; see the contract for the allowed ranges. The defaults are the
/// best row of bench_buffers' threads x chunk sweep on the H100 (bench/README.md): 8 MiB chunks
/// beat 4 MiB by 4-50% and 16 MiB by 7-22% at 4-8 threads; 4 chunks (32 MiB pinned per device)
/// keep two or three DMAs queued behind the host's memcpy.
struct copy_stager_options {
  std::size_t chunk_bytes = std::size_t{8} << 20;  ///< one stage's pinned chunk
  unsigned chunk_count = 4;                         ///< chunks held at most (pipeline depth)
  unsigned threads = default_copy_threads();        ///< host threads per memcpy, caller included
};

/// What a stager holds and does now.
struct copy_stager_stats {
  std::size_t chunks_allocated = 0;     ///< pinned chunks held (in use or idle)
  std::size_t pinned_bytes = 0;         ///< their bytes
  std::size_t chunks_in_use = 0;        ///< held by copies running now
  std::size_t copies_in_progress = 0;   ///< staged copies running now
  std::size_t memcpy_pieces_in_flight = 0;  ///< host memcpy pieces queued or being copied
  unsigned worker_threads = 0;          ///< worker threads alive
  std::uint64_t staged_copies = 0;      ///< copies done since construction (any outcome)
};

namespace detail {

/// `o`, or std::invalid_argument naming the first field out of its range (see the contract).
[[nodiscard]] inline copy_stager_options validated_stager_options(const copy_stager_options& o) {
  const auto refuse = [](const std::string& what) {
    throw std::invalid_argument("cudamem::copy_stager: " + what);
  };
  constexpr std::size_t kib = 1024;
  if (o.chunk_bytes < 64 * kib || o.chunk_bytes > (std::size_t{1} << 30) ||
      o.chunk_bytes % (4 * kib) != 0) {
    refuse("chunk_bytes is " + std::to_string(o.chunk_bytes) +
           "; it must be a multiple of 4 KiB from 64 KiB to 1 GiB");
  }
  if (o.chunk_count < 1 || o.chunk_count > 64) {
    refuse("chunk_count is " + std::to_string(o.chunk_count) + "; it must be 1 to 64");
  }
  if (o.threads < 1 || o.threads > 64) {
    refuse("threads is " + std::to_string(o.threads) + "; it must be 1 to 64");
  }
  if (o.chunk_bytes * o.chunk_count > (std::size_t{4} << 30)) {
    refuse("chunk_bytes * chunk_count is " + std::to_string(o.chunk_bytes * o.chunk_count) +
           " bytes; at most 4 GiB may be pinned for staging");
  }
  return o;
}

/// Stage size for a copy of `bytes`: the chunk, or less so that a short copy still has
/// chunk_count stages to overlap (never below 256 KiB, where a stage costs more than it hides).
[[nodiscard]] inline std::size_t stage_bytes(std::size_t bytes, const copy_stager_options& o) {
  constexpr std::size_t smallest = std::size_t{256} << 10;
  const std::size_t even = (bytes / o.chunk_count + 4095) / 4096 * 4096;
  const std::size_t stage = even > smallest ? even : smallest;
  return stage < o.chunk_bytes ? stage : o.chunk_bytes;
}

}  // namespace detail

}  // namespace cudamem
