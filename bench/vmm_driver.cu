// bench/vmm_driver.cu — what CUDA's virtual-memory calls cost on this device, by handle size:
// the figures vm_resource's design rests on (which calls are cheap, which are paid per byte).
//
//   ./run bench vmm_driver          # on a GPU, a few seconds; with no GPU it exits 69
//
// For each handle size (2 MiB to 1 GiB) it creates 8 GiB of physical memory in handles of that
// size, then maps all of it three times, at three fresh address ranges:
//   A: fresh memory, cuMemSetAccess once over the whole range;
//   B: the same handles again (a second alias), cuMemSetAccess once per handle;
//   C: a third alias, cuMemSetAccess once over the whole range.
// and prints the mean time of each kind of call, and cuMemSetAccess per GiB. A then C says
// whether giving access costs less for memory that is already mapped elsewhere; B then C
// whether it is paid per call or per byte.
// Then: pieces of ONE large handle (cuMemMap with a non-zero offset), 64 MiB each, mapped in
// shuffled order at a fresh range, access given once: whether the cost follows the handles in
// the range or the mappings.
// Then: the same per-handle calls from 1, 2 and 4 threads at once (does the driver overlap them?).
// Then: cudaEventRecord and a map + access on one thread while another creates handles (does a
// create on another thread hold them up?).
// Then: the device filled with 64 MiB handles, released, and filled again at once, and after
// pauses: what a fill right after a release costs (the driver clears given-back memory).
// Last: the stream-order calls vm_resource makes around a block it hands out itself (what
// vm_pool_resource pays per block of a handle or more): cudaEventRecord at each free on a
// stream, cudaStreamWaitEvent when another stream takes the memory, cudaEventSynchronize when
// the host must wait (an idle device here: the least it costs).
#include <cudamem/detail/vm/driver_mapping.hpp>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <numeric>
#include <optional>
#include <thread>
#include <vector>

namespace {

using clock_type = std::chrono::steady_clock;
constexpr std::size_t MiB = std::size_t{1} << 20;
constexpr std::size_t GiB = std::size_t{1} << 30;

double us_since(clock_type::time_point start) {
  return std::chrono::duration<double, std::micro>(clock_type::now() - start).count();
}

/// Mean cost of the stream-order calls, on two non-blocking streams of an idle device.
void stream_order_costs() {
  constexpr int n = 2000;
  cudaStream_t freed_on = nullptr;
  cudaStream_t user = nullptr;
  cudaEvent_t ev = nullptr;
  if (cudaStreamCreateWithFlags(&freed_on, cudaStreamNonBlocking) != cudaSuccess ||
      cudaStreamCreateWithFlags(&user, cudaStreamNonBlocking) != cudaSuccess ||
      cudaEventCreateWithFlags(&ev, cudaEventDisableTiming) != cudaSuccess) {
    std::printf("stream order: could not create streams and an event\n");
    return;
  }
  auto start = clock_type::now();
  for (int i = 0; i < n; ++i) {
    cudaEventRecord(ev, freed_on);
  }
  const double record_us = us_since(start) / n;
  start = clock_type::now();
  for (int i = 0; i < n; ++i) {
    cudaStreamWaitEvent(user, ev, 0);
  }
  const double wait_us = us_since(start) / n;
  start = clock_type::now();
  for (int i = 0; i < n; ++i) {
    cudaEventRecord(ev, freed_on);
    cudaEventSynchronize(ev);
  }
  const double sync_us = us_since(start) / n - record_us;
  cudaStreamSynchronize(user);
  std::printf("\nstream order, mean us per call (idle device): cudaEventRecord %.2f, "
              "cudaStreamWaitEvent %.2f, cudaEventSynchronize %.2f\n",
              record_us, wait_us, sync_us);
  cudaEventDestroy(ev);
  cudaStreamDestroy(user);
  cudaStreamDestroy(freed_on);
}

/// Whether the driver runs the per-handle calls of several threads at once: 64 handles of
/// 64 MiB created, then given access one call per handle, by 1, 2 and 4 threads (each its
/// share). Wall time per handle: if it falls with more threads, a vm_resource could spread a
/// growth over threads; if not, the driver serialises them and only host work could overlap.
void parallel_driver_calls(cudamem::detail::driver_vm_mapping& layer) {
  constexpr std::size_t n = 64;
  constexpr std::size_t handle = 64 * MiB;
  std::printf("\nthe same calls from several threads, %zu handles of %zu MiB, wall us per handle:\n",
              n, handle / MiB);
  const auto spread = [](unsigned threads, auto&& work) {  // work(first, last) on each thread
    const auto start = clock_type::now();
    std::vector<std::thread> pool;
    for (unsigned t = 0; t < threads; ++t) {
      pool.emplace_back([&, t] {
        cudaSetDevice(0);  // the primary context current on this thread too
        work(n * t / threads, n * (t + 1) / threads);
      });
    }
    for (std::thread& t : pool) {
      t.join();
    }
    return us_since(start) / static_cast<double>(n);
  };
  for (const unsigned threads : {1U, 2U, 4U, 1U}) {
    std::vector<std::optional<cudamem::detail::vm_handle>> handles(n);
    const double create_us = spread(threads, [&](std::size_t first, std::size_t last) {
      for (std::size_t i = first; i < last; ++i) {
        handles[i] = layer.create(handle);
      }
    });
    if (std::any_of(handles.begin(), handles.end(), [](const auto& h) { return !h; })) {
      std::printf("  cuMemCreate failed\n");
      for (const auto& h : handles) {
        if (h) {
          layer.release(*h);
        }
      }
      return;
    }
    const std::uintptr_t va = layer.reserve(n * handle, layer.granularity());
    for (std::size_t i = 0; i < n; ++i) {
      layer.map(va + i * handle, handle, *handles[i]);
    }
    const double access_us = spread(threads, [&](std::size_t first, std::size_t last) {
      for (std::size_t i = first; i < last; ++i) {
        layer.set_access(va + i * handle, handle);
      }
    });
    for (std::size_t i = 0; i < n; ++i) {
      layer.unmap(va + i * handle, handle);
      layer.release(*handles[i]);
    }
    layer.free_reservation(va, n * handle);
    std::printf("  %u thread(s): cuMemCreate %.1f, cuMemSetAccess %.1f\n", threads, create_us,
                access_us);
  }
}

/// Runs `measure(done)` on this thread while `other()` runs on a second thread (the device
/// current there too); `done` turns true when `other` returns. Returns what `measure` returns.
template <class Measure, class Other>
auto while_running(Measure&& measure, Other&& other) {
  std::atomic<bool> done{false};
  std::thread second([&] {
    cudaSetDevice(0);
    other();
    done = true;
  });
  const auto result = measure(done);
  second.join();
  return result;
}

/// Whether a cuMemCreate on another thread slows this thread's driver calls: cudaEventRecord
/// (what vm_resource calls at every free on a stream) and a cuMemMap + cuMemSetAccess +
/// cuMemUnmap of one handle, each timed for as long as 96 creates take, once beside a thread
/// that sleeps and once beside one that creates 64 MiB handles back to back. If they wait for
/// the creates, making handles ahead on a thread of their own cannot hide the creates' cost.
void calls_beside_a_create(cudamem::detail::driver_vm_mapping& layer) {
  constexpr std::size_t handle = 64 * MiB;
  constexpr std::size_t n = 96;
  cudaStream_t s = nullptr;
  cudaEvent_t ev = nullptr;
  const std::uintptr_t va = layer.reserve(handle, layer.granularity());
  const auto mapped = layer.create(handle);
  if (!mapped || cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) != cudaSuccess ||
      cudaEventCreateWithFlags(&ev, cudaEventDisableTiming) != cudaSuccess) {
    std::printf("beside a create: could not create a handle, a stream and an event\n");
    if (mapped) {
      layer.release(*mapped);
    }
    if (ev != nullptr) {
      cudaEventDestroy(ev);
    }
    if (s != nullptr) {
      cudaStreamDestroy(s);
    }
    layer.free_reservation(va, handle);
    return;
  }
  std::vector<cudamem::detail::vm_handle> made;
  made.reserve(n);
  const auto create_all = [&] {  // mean us per create; release_made() gives them back
    const auto start = clock_type::now();
    for (std::size_t i = 0; i < n; ++i) {
      if (const auto h = layer.create(handle)) {
        made.push_back(*h);
      }
    }
    return us_since(start) / static_cast<double>(n);
  };
  const auto release_made = [&] {
    for (const auto h : made) {
      layer.release(h);
    }
    made.clear();
  };
  const auto mean_us_until = [](const std::atomic<bool>& done, auto&& call) {
    std::size_t count = 0;
    const auto start = clock_type::now();
    while (!done.load(std::memory_order_relaxed)) {
      call();
      ++count;
    }
    return us_since(start) / static_cast<double>(std::max<std::size_t>(count, 1));
  };
  const auto record = [&] { cudaEventRecord(ev, s); };
  const auto map_access_unmap = [&] {
    layer.map(va, handle, *mapped);
    layer.set_access(va, handle);
    layer.unmap(va, handle);
  };
  const double create_alone = create_all();
  release_made();
  const auto sleep_as_long = [&] {
    std::this_thread::sleep_for(std::chrono::duration<double, std::micro>(create_alone * n));
  };
  double create_beside = 0;
  const auto create_beside_records = [&] { create_beside = create_all(); };
  // Mean us of `call` on this thread while `other` runs on a second one.
  const auto beside = [&](auto&& call, auto&& other) {
    return while_running(
        [&](const std::atomic<bool>& done) { return mean_us_until(done, call); }, other);
  };
  // (The creates' handles are released after each timing: a cuMemRelease on the second thread
  // held a map + access + unmap here up for milliseconds.)
  const double record_alone = beside(record, sleep_as_long);
  const double record_beside = beside(record, create_beside_records);
  release_made();
  const double cycle_alone = beside(map_access_unmap, sleep_as_long);
  const double cycle_beside = beside(map_access_unmap, create_all);
  release_made();
  std::printf("\nbeside a thread creating %zu MiB handles (us per call): cudaEventRecord %.2f "
              "alone, %.2f beside; cuMemCreate %.1f alone, %.1f beside the records; "
              "map+access+unmap of one handle %.1f alone, %.1f beside\n",
              handle / MiB, record_alone, record_beside, create_alone, create_beside, cycle_alone,
              cycle_beside);
  cudaStreamSynchronize(s);
  cudaEventDestroy(ev);
  cudaStreamDestroy(s);
  layer.release(*mapped);
  layer.free_reservation(va, handle);
}

/// What one fill of the device costs, per handle: every handle created, mapped side by side and
/// given access in batches of 9 (as a growing vm_resource does), the memory touched, then all of
/// it unmapped and released. nullopt when the device cannot hold `n` handles, or the memset
/// through them fails.
struct fill_costs {
  double create_us = 0;
  double create_median_us = 0;
  double access_us = 0;  ///< per handle
  double release_us = 0;  ///< unmap and release, per handle
};
std::optional<fill_costs> fill_device(cudamem::detail::driver_vm_mapping& layer, std::size_t n,
                                      std::size_t handle) {
  fill_costs c;
  std::vector<cudamem::detail::vm_handle> handles;
  std::vector<double> each;
  for (std::size_t i = 0; i < n; ++i) {
    const auto start = clock_type::now();
    const auto h = layer.create(handle);
    each.push_back(us_since(start));
    if (!h) {
      for (const auto made : handles) {
        layer.release(made);
      }
      return std::nullopt;
    }
    handles.push_back(*h);
  }
  c.create_us = std::accumulate(each.begin(), each.end(), 0.0) / static_cast<double>(n);
  std::nth_element(each.begin(), each.begin() + static_cast<std::ptrdiff_t>(n / 2), each.end());
  c.create_median_us = each[n / 2];
  const std::uintptr_t va = layer.reserve(n * handle, layer.granularity());
  constexpr std::size_t batch = 9;
  auto start = clock_type::now();
  double access = 0;
  for (std::size_t first = 0; first < n; first += batch) {
    const std::size_t last = std::min(n, first + batch);
    for (std::size_t i = first; i < last; ++i) {
      layer.map(va + i * handle, handle, handles[i]);
    }
    const auto access_start = clock_type::now();
    layer.set_access(va + first * handle, (last - first) * handle);
    access += us_since(access_start);
  }
  c.access_us = access / static_cast<double>(n);
  const bool touched = cudaMemsetAsync(reinterpret_cast<void*>(va), 1, n * handle) == cudaSuccess &&
                       cudaDeviceSynchronize() == cudaSuccess;
  start = clock_type::now();
  for (std::size_t i = 0; i < n; ++i) {
    layer.unmap(va + i * handle, handle);
    layer.release(handles[i]);
  }
  c.release_us = us_since(start) / static_cast<double>(n);
  layer.free_reservation(va, n * handle);
  if (!touched) {
    std::printf("  memset of the filled device failed\n");
    return std::nullopt;
  }
  return c;
}

/// Whether a fill costs more right after the device's memory was released than at rest: the
/// driver seems to clear memory a process gave back before it hands it out again. A benchmark
/// that fills the device right after releasing it (a cold run after the previous experiment's
/// release) pays that; a program that starts on a device at rest does not.
void fill_after_release(cudamem::detail::driver_vm_mapping& layer) {
  constexpr std::size_t handle = 64 * MiB;
  std::size_t free_bytes = 0;
  std::size_t total_bytes = 0;
  cudaMemGetInfo(&free_bytes, &total_bytes);
  const std::size_t n = free_bytes * 9 / 10 / handle;
  std::printf("\nfilling the device (%zu handles of %zu MiB, access in batches of 9, touched), "
              "us per handle:\n",
              n, handle / MiB);
  const auto line = [](const char* when, const std::optional<fill_costs>& c) {
    if (!c) {
      std::printf("  %-34s the fill failed\n", when);
      return;
    }
    std::printf("  %-34s cuMemCreate %.1f (median %.1f), cuMemSetAccess %.1f, unmap+release %.1f\n",
                when, c->create_us, c->create_median_us, c->access_us, c->release_us);
  };
  line("first fill (at rest)", fill_device(layer, n, handle));
  line("right after releasing it", fill_device(layer, n, handle));
  line("right after releasing it, again", fill_device(layer, n, handle));
  for (const int pause_ms : {250, 1000, 3000}) {
    std::this_thread::sleep_for(std::chrono::milliseconds(pause_ms));
    char when[64];
    std::snprintf(when, sizeof when, "after a %d ms pause", pause_ms);
    line(when, fill_device(layer, n, handle));
  }
}

}  // namespace

int main() {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("SKIPPED: no CUDA device\n");
    return 69;
  }
  cudaDeviceProp prop{};
  cudaGetDeviceProperties(&prop, 0);
  cudamem::detail::driver_vm_mapping layer{0, {}};
  constexpr std::size_t total = 8 * GiB;
  std::printf("vmm_driver: %s, granularity %zu MiB; %zu GiB per handle size, mean us per call\n",
              prop.name, layer.granularity() / MiB, total / GiB);
  std::printf("%8s %8s %9s %9s %14s %14s %14s %11s %9s\n", "handle", "handles", "create",
              "map", "access A once", "access B each", "access C once", "A/C us/GiB", "unmap");
  for (const std::size_t handle : {2 * MiB, 32 * MiB, 64 * MiB, 256 * MiB, 1024 * MiB}) {
    const std::size_t n = total / handle;
    std::vector<cudamem::detail::vm_handle> handles;
    auto start = clock_type::now();
    for (std::size_t i = 0; i < n; ++i) {
      const auto h = layer.create(handle);
      if (!h) {
        std::printf("cuMemCreate failed at handle %zu\n", i);
        return 1;
      }
      handles.push_back(*h);
    }
    const double create_us = us_since(start) / static_cast<double>(n);
    const std::size_t g = layer.granularity();
    std::uintptr_t va[3] = {layer.reserve(total, g), layer.reserve(total, g),
                            layer.reserve(total, g)};
    double map_us = 0;
    double access_us[3] = {0, 0, 0};
    for (int alias = 0; alias < 3; ++alias) {
      start = clock_type::now();
      for (std::size_t i = 0; i < n; ++i) {
        layer.map(va[alias] + i * handle, handle, handles[i]);
      }
      map_us += us_since(start);
      start = clock_type::now();
      if (alias == 1) {
        for (std::size_t i = 0; i < n; ++i) {
          layer.set_access(va[alias] + i * handle, handle);
        }
      } else {
        layer.set_access(va[alias], total);
      }
      access_us[alias] = us_since(start);
    }
    // Touch the memory through the last alias, so nothing is lazily skipped.
    if (cudaMemsetAsync(reinterpret_cast<void*>(va[2]), 0, total) != cudaSuccess ||
        cudaDeviceSynchronize() != cudaSuccess) {
      std::printf("memset through the alias failed\n");
      return 1;
    }
    start = clock_type::now();
    for (int alias = 0; alias < 3; ++alias) {
      for (std::size_t i = 0; i < n; ++i) {
        layer.unmap(va[alias] + i * handle, handle);
      }
    }
    const double unmap_us = us_since(start) / static_cast<double>(3 * n);
    for (const auto h : handles) {
      layer.release(h);
    }
    for (const std::uintptr_t v : va) {
      layer.free_reservation(v, total);
    }
    const double gib = static_cast<double>(total) / GiB;
    std::printf("%5zu MiB %8zu %9.1f %9.2f %14.1f %14.1f %14.1f %5.0f/%-5.0f %9.1f\n",
                handle / MiB, n, create_us, map_us / static_cast<double>(3 * n), access_us[0],
                access_us[1] / static_cast<double>(n), access_us[2], access_us[0] / gib,
                access_us[2] / gib, unmap_us);
    std::fflush(stdout);
  }
  // Pieces of one handle: 16 x 64 MiB of a 1 GiB handle, and 128 x 64 MiB of an 8 GiB one.
  std::printf("\npieces of one handle, 64 MiB each, shuffled, one cuMemSetAccess over them:\n");
  for (const std::size_t big : {1 * GiB, 8 * GiB}) {
    const auto h = layer.create(big);
    if (!h) {
      std::printf("cuMemCreate(%zu GiB) failed\n", big / GiB);
      return 1;
    }
    constexpr std::size_t piece = 64 * MiB;
    const std::size_t n = big / piece;
    const std::uintptr_t va = layer.reserve(big, layer.granularity());
    const auto start = clock_type::now();
    for (std::size_t i = 0; i < n; ++i) {
      const std::size_t source = (i * 7 + 3) % n;  // 7 is prime to n: a permutation
      const CUresult r = cudamem::detail::driver().mem_map(
          static_cast<CUdeviceptr>(va + i * piece), piece, source * piece,
          static_cast<CUmemGenericAllocationHandle>(*h), 0);
      if (r != CUDA_SUCCESS) {
        std::printf("  cuMemMap with offset %zu MiB: error %d: partial mapping not supported\n",
                    source * piece / MiB, static_cast<int>(r));
        layer.release(*h);
        layer.free_reservation(va, big);
        parallel_driver_calls(layer);
        calls_beside_a_create(layer);
        fill_after_release(layer);
        stream_order_costs();
        return 0;
      }
    }
    const double map_us = us_since(start);
    const auto access_start = clock_type::now();
    layer.set_access(va, big);
    const double access_us = us_since(access_start);
    const bool ok = cudaMemsetAsync(reinterpret_cast<void*>(va), 0, big) == cudaSuccess &&
                    cudaDeviceSynchronize() == cudaSuccess;
    std::printf("  %zu GiB handle, %zu pieces: map %.2f us each, cuMemSetAccess %.1f us (%.1f us "
                "per piece), memset %s\n",
                big / GiB, n, map_us / static_cast<double>(n), access_us,
                access_us / static_cast<double>(n), ok ? "ok" : "FAILED");
    for (std::size_t i = 0; i < n; ++i) {
      layer.unmap(va + i * piece, piece);
    }
    layer.release(*h);
    layer.free_reservation(va, big);
  }
  parallel_driver_calls(layer);
  calls_beside_a_create(layer);
  fill_after_release(layer);
  stream_order_costs();
  return 0;
}
