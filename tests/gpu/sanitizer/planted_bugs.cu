// One memory bug (or none) per run, over a cudamem resource or over cudaMalloc for reference:
// the child program that tests/gpu/sanitizer/check_report.cmake runs under compute-sanitizer,
// to prove that a bug inside a pool is as visible to the tool as one in a cudaMalloc'd buffer.
//
//   planted_bugs MODE        prints "planted_bugs MODE: done" and exits 0 when it ran
//
// Modes (RESOURCE is cudamalloc, pool, arena (over device_resource), vm_pool (its small blocks)
// or vm_pool_large (a block of a handle and more); a vm_pool under compute-sanitizer takes
// plain device memory, since the tool refuses every annotation of virtual memory, so its bugs
// are reported as cudaMalloc's, and its modes print which memory it had; pool1 and arena1 are
// a pool and an arena over device 1's memory, allocated from, freed to and destroyed by this thread with
// device 0 current — only the kernels run with device 1 current — and need two GPUs: with one
// they print "SKIPPED: needs 2 GPUs" and exit 0):
//   oob-RESOURCE      writes one element past block a, whose neighbour b in the same chunk is
//                     live (memcheck: "Invalid __global__ write")
//   uaf-RESOURCE      reads block a after it was freed (memcheck: "Invalid __global__ read");
//                     not for arena (its deallocate frees nothing; rewind is its free)
//   uninit-RESOURCE   reads a fresh block nobody wrote (initcheck: "Uninitialized __global__
//                     memory read")
//   rewind-arena      reads arena memory after the scope that held it rewound (memcheck)
//   reuse-pool        a 4096-byte block freed on s and taken at once on s by a 4000-byte
//                     request (the same block) is a new region: a write at byte 4000 is out
//                     of bounds (memcheck)
//   correct           every resource used correctly, and an arena over a pool (whose chunks
//                     are pool blocks, so it must not annotate): nothing to report or leak
//   correct-other-device   pool1 and arena1 used correctly: nothing to report or leak (the
//                     tool refuses an annotation made with another device current)
//   probe-nvtx, probe-vm   what the tool answers (diagnostics, not tests)
//   probe-peer-{late,late-copy,early-copy}[-raw]   pool blocks and peer access (diagnostics,
//                     two GPUs; see probe_peer)
// With no usable device it prints one line and exits 69.
#include <cudamem/arena_resource.hpp>
#include <cudamem/detail/nvtx.hpp>
#include <cudamem/device.hpp>
#include <cudamem/device_resource.hpp>
#include <cudamem/error.hpp>
#include <cudamem/peer_access.hpp>
#include <cudamem/pool_resource.hpp>
#include <cudamem/stream.hpp>
#include <cudamem/vm_pool_resource.hpp>
#include <cudamem/vm_resource.hpp>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <initializer_list>
#include <memory>
#include <optional>
#include <string>

namespace {

constexpr int exit_no_device = 69;
// Floats per block: 4000 bytes, so a block takes 4096 of the pool (and of cudaMalloc), and the
// element just past it is in that padding: for cudaMalloc, outside any allocation; for a pool,
// outside the block's region. (One past a 4096-byte block would be inside its live neighbour,
// which no tool can tell from a valid access: memcheck has no notion of which allocation a
// pointer came from.)
constexpr std::size_t n = 1000;
constexpr std::size_t bytes = n * sizeof(float);

__global__ void write_at(float* p, std::size_t i, float v) { p[i] = v; }
__global__ void fill(float* p, std::size_t count, float v) {
  const std::size_t i = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x;
  if (i < count) {
    p[i] = v;
  }
}
__global__ void sum_into(const float* p, std::size_t count, float* out) {
  float s = 0;
  for (std::size_t i = 0; i < count; ++i) {
    s += p[i];
  }
  *out = s;
}

void launched(const char* what) { cudamem::check(cudaGetLastError(), what); }

/// The device a resource kind's memory is on: 1 for pool1 and arena1, else 0.
int device_of_kind(const std::string& kind) { return kind.ends_with('1') ? 1 : 0; }

/// Allocates and frees through one resource kind, so every mode runs the same code over each.
/// Allocation and free run with device 0 current, whatever the memory's device.
struct source {
  std::string kind;
  int memory_device;
  cudamem::stream s;  // on memory_device
  std::unique_ptr<cudamem::device_resource> device;
  std::unique_ptr<cudamem::pool_resource> pool;
  std::unique_ptr<cudamem::arena_resource> arena;
  std::unique_ptr<cudamem::vm_pool_resource> vm_pool;
  /// Floats per block: n, or for vm_pool_large a block of a whole handle and 4000 bytes more,
  /// which the vm_pool hands out from its upstream (blocks of a handle or more), not its pool.
  std::size_t count;

  explicit source(std::string k)
      : kind(std::move(k)),
        memory_device(device_of_kind(kind)),
        s(cudamem::stream_options{.device = memory_device}),
        count(kind == "vm_pool_large" ? (std::size_t{64} << 20) / sizeof(float) + n : n) {
    if (kind == "pool" || kind == "arena" || kind == "arena_over_pool") {
      device = std::make_unique<cudamem::device_resource>();
    }
    if (kind == "pool1" || kind == "arena1") {
      device = std::make_unique<cudamem::device_resource>(1);
    }
    if (kind == "pool" || kind == "arena_over_pool" || kind == "pool1") {
      pool = std::make_unique<cudamem::pool_resource>(*device);
    }
    if (kind == "arena" || kind == "arena1") {
      arena = std::make_unique<cudamem::arena_resource>(*device);
    }
    if (kind == "arena_over_pool") {
      arena = std::make_unique<cudamem::arena_resource>(*pool);
    }
    if (kind == "vm_pool" || kind == "vm_pool_large") {
      vm_pool = std::make_unique<cudamem::vm_pool_resource>(0);
      std::printf("vm_pool memory: %s\n",
                  vm_pool->uses_plain_memory() ? "plain (cudaMalloc)" : "virtual");
    }
  }
  [[nodiscard]] std::size_t block_bytes() const noexcept { return count * sizeof(float); }
  cudamem::memory_resource* resource() {
    if (arena) return arena.get();
    if (pool) return pool.get();
    return vm_pool.get();
  }
  float* allocate(std::size_t b) {
    if (kind == "cudamalloc") {
      void* p = nullptr;
      cudamem::check(cudaMalloc(&p, b), "cudaMalloc");
      return static_cast<float*>(p);
    }
    return static_cast<float*>(resource()->allocate(b, 256, s));
  }
  void deallocate(float* p, std::size_t b) {
    if (kind == "cudamalloc") {
      cudamem::check(cudaFree(p), "cudaFree");
      return;
    }
    resource()->deallocate(p, b, 256, s);
  }
  /// The memory's device, current while it lives: for kernel launches on `s`.
  [[nodiscard]] cudamem::device_guard for_kernels() const {
    return cudamem::device_guard{memory_device};
  }
};

/// a and b side by side (for a pool, in the same chunk), both live: a[n] is one past a.
void out_of_bounds(source& src) {
  const std::size_t bytes = src.block_bytes();
  const std::size_t n = src.count;
  float* a = src.allocate(bytes);
  float* b = src.allocate(bytes);
  std::printf("a=%p b=%p (b - a = %td floats)\n", static_cast<void*>(a), static_cast<void*>(b),
              b - a);
  {
    const auto on = src.for_kernels();
    fill<<<(std::min<std::size_t>(n, 1 << 20) + 255) / 256, 256, 0, src.s.get()>>>(
        b, std::min<std::size_t>(n, 1 << 20), 1.0f);
    write_at<<<1, 1, 0, src.s.get()>>>(a, n, 2.0f);  // the bug: one past the end of a
    launched("write_at");
  }
  src.s.synchronize();
  src.deallocate(b, bytes);
  src.deallocate(a, bytes);
  src.s.synchronize();
}

void use_after_free(source& src) {
  const std::size_t bytes = src.block_bytes();
  const std::size_t n = std::min<std::size_t>(src.count, 1000);  // what the kernels touch
  float* a = src.allocate(bytes);
  float* keep = src.allocate(bytes);  // keeps the chunk alive: the pool cannot return it
  {
    const auto on = src.for_kernels();
    fill<<<(n + 255) / 256, 256, 0, src.s.get()>>>(a, n, 1.0f);
  }
  src.deallocate(a, bytes);
  float* out = src.allocate(sizeof(float));
  {
    const auto on = src.for_kernels();
    sum_into<<<1, 1, 0, src.s.get()>>>(a, n, out);  // the bug: a was freed
    launched("sum_into");
  }
  src.s.synchronize();
  src.deallocate(out, sizeof(float));
  src.deallocate(keep, bytes);
  src.s.synchronize();
}

void uninitialised(source& src) {
  const std::size_t bytes = src.block_bytes();
  const std::size_t n = std::min<std::size_t>(src.count, 1000);  // what the kernel reads
  float* a = src.allocate(bytes);
  float* out = src.allocate(sizeof(float));
  {
    const auto on = src.for_kernels();
    sum_into<<<1, 1, 0, src.s.get()>>>(a, n, out);  // the bug: nobody wrote a
    launched("sum_into");
  }
  src.s.synchronize();
  src.deallocate(out, sizeof(float));
  src.deallocate(a, bytes);
  src.s.synchronize();
}

void rewound_arena() {
  source src{"arena"};
  float* out = src.allocate(sizeof(float));
  float* a = nullptr;
  {
    cudamem::arena_scope scope{*src.arena};
    a = src.allocate(bytes);
    fill<<<(n + 255) / 256, 256, 0, src.s.get()>>>(a, n, 1.0f);
  }
  sum_into<<<1, 1, 0, src.s.get()>>>(a, n, out);  // the bug: the scope rewound a away
  launched("sum_into");
  src.s.synchronize();
}

void reused_block() {
  source src{"pool"};
  float* a = src.allocate(4096);
  fill<<<4, 256, 0, src.s.get()>>>(a, 1024, 1.0f);
  src.deallocate(a, 4096);
  float* b = src.allocate(4000);  // the same block, from the cache, on the same stream
  std::printf("reused: %s\n", a == b ? "same block" : "another block");
  write_at<<<1, 1, 0, src.s.get()>>>(b, 1000, 2.0f);  // the bug: byte 4000 of a 4000-byte block
  launched("write_at");
  src.s.synchronize();
  src.deallocate(b, 4000);
  src.s.synchronize();
}

void correct(std::initializer_list<const char*> kinds) {
  for (const char* kind : kinds) {
    source src{kind};
    float* a = src.allocate(bytes);
    float* b = src.allocate(bytes);
    float* out = src.allocate(sizeof(float));
    float sum = 0;
    {
      const auto on = src.for_kernels();
      fill<<<(n + 255) / 256, 256, 0, src.s.get()>>>(a, n, 1.0f);
      fill<<<(n + 255) / 256, 256, 0, src.s.get()>>>(b, n, 2.0f);
      sum_into<<<1, 1, 0, src.s.get()>>>(a, n, out);
      launched("sum_into");
      cudamem::check(cudaMemcpyAsync(&sum, out, sizeof sum, cudaMemcpyDeviceToHost, src.s.get()),
                     "cudaMemcpyAsync");
    }
    src.s.synchronize();
    if (sum != static_cast<float>(n)) {
      std::fprintf(stderr, "correct: %s summed %f, expected %zu\n", kind, sum, n);
      std::exit(1);
    }
    src.deallocate(out, sizeof(float));
    src.deallocate(b, bytes);
    src.deallocate(a, bytes);
    src.s.synchronize();
  }
}


/// probe-peer-MODE (diagnostics, not a test): blocks of device 1's and device 0's pools, small
/// and large tier, with peer access enabled before allocating (early) or after (late), and a
/// copy from device 1 to device 0 (copy); markers on stdout place the tool's warnings. With
/// `raw`, plain device_resources (cudaMalloc, nothing annotated) instead of the pools.
/// Seen on two H200s: a block annotated before access was enabled cannot be unregistered
/// after ("nvtxMemRegionsUnregister failed"); initcheck fails inside itself on the copy.
void probe_peer(bool early, bool copy_it, bool raw) {
  cudamem::device_resource d0{0}, d1{1};
  cudamem::pool_resource pool0{d0}, pool1{d1};
  cudamem::memory_resource& p0 = raw ? static_cast<cudamem::memory_resource&>(d0) : pool0;
  cudamem::memory_resource& p1 = raw ? static_cast<cudamem::memory_resource&>(d1) : pool1;
  cudamem::stream s0{cudamem::stream_options{.device = 0}};
  cudamem::stream s1{cudamem::stream_options{.device = 1}};
  const auto mark = [](const char* what) {
    std::printf("marker: %s\n", what);
    std::fflush(stdout);
  };
  std::optional<cudamem::peer_access> reach_01, reach_10;
  const auto enable_peers = [&](const char* when) {
    reach_01.emplace(0, 1);
    reach_10.emplace(1, 0);
    mark(when);
  };
  const auto fill_block = [](void* p, std::size_t block_bytes, float v, cudaStream_t s) {
    const std::size_t count = block_bytes / sizeof(float);
    fill<<<static_cast<unsigned>((count + 255) / 256), 256, 0, s>>>(static_cast<float*>(p), count,
                                                                     v);
    launched("fill");
  };
  if (early) {
    enable_peers("peer on (early)");
  }
  constexpr std::size_t small = std::size_t{1} << 20;
  constexpr std::size_t large = std::size_t{32} << 20;
  void* a_small = p1.allocate(small, 256, s1);
  void* a_large = p1.allocate(large, 256, s1);
  void* b_large = p0.allocate(large, 256, s0);
  {
    const cudamem::device_guard on{1};
    fill_block(a_small, small, 1.0f, s1.get());
    fill_block(a_large, large, 1.0f, s1.get());
  }
  fill_block(b_large, large, 2.0f, s0.get());
  s1.synchronize();
  s0.synchronize();
  mark("allocated and filled");
  if (!early) {
    enable_peers("peer on (late)");
  }
  if (copy_it) {
    cudamem::check(cudaMemcpyAsync(b_large, a_large, large, cudaMemcpyDefault, s0.get()),
                   "copy 1->0");
    s0.synchronize();
    mark("copied 1 -> 0");
  }
  p1.deallocate(a_small, small, 256, s1);
  mark("freed device 1 small");
  p1.deallocate(a_large, large, 256, s1);
  mark("freed device 1 large");
  p0.deallocate(b_large, large, 256, s0);
  mark("freed device 0 large");
  reach_01.reset();
  reach_10.reset();
  mark("peer off");
}

}  // namespace

int main(int argc, char** argv) try {
  if (argc != 2) {
    std::fprintf(stderr, "usage: planted_bugs MODE\n");
    return 2;
  }
  const std::string mode = argv[1];
  int count = 0;
  if (const cudaError_t code = cudaGetDeviceCount(&count); code != cudaSuccess || count == 0) {
    std::printf("planted_bugs: no usable CUDA device (%s)\n",
                code != cudaSuccess ? cudaGetErrorName(code) : "0 devices");
    return exit_no_device;
  }
  const auto dash = mode.find('-');
  const std::string what = mode.substr(0, dash);
  const std::string kind = dash == std::string::npos ? "" : mode.substr(dash + 1);
  if ((device_of_kind(kind) == 1 || mode == "correct-other-device") && count < 2) {
    std::printf("SKIPPED: needs 2 GPUs (%d visible)\n", count);
    return 0;
  }
  if (what == "oob") {
    source src{kind};
    out_of_bounds(src);
  } else if (what == "uaf") {
    source src{kind};
    use_after_free(src);
  } else if (what == "uninit") {
    source src{kind};
    uninitialised(src);
  } else if (mode == "rewind-arena") {
    rewound_arena();
  } else if (mode == "reuse-pool") {
    reused_block();
  } else if (mode == "correct") {
    correct({"cudamalloc", "pool", "arena", "arena_over_pool", "vm_pool"});
  } else if (mode == "correct-other-device") {
    correct({"pool1", "arena1"});
  } else if (mode.starts_with("probe-peer")) {  // diagnostics: see probe_peer
    if (count < 2) {
      std::printf("SKIPPED: needs 2 GPUs (%d visible)\n", count);
      return 0;
    }
    probe_peer(mode.find("early") != std::string::npos, mode.find("copy") != std::string::npos,
               mode.ends_with("-raw"));
  } else if (mode == "probe-nvtx") {  // what the NVTX tool answers (diagnostics, not a test)
    float* p = nullptr;
    cudamem::check(cudaMalloc(&p, 1 << 20), "cudaMalloc");
    void* heap = cudamem::detail::memory_annotations::add_heap(0, p, 1 << 20, "probe");
    std::printf("tool attached %d, domain %p, heap %p (base %p)\n",
                cudamem::detail::nvtx_tool_attached() ? 1 : 0,
                static_cast<void*>(cudamem::detail::nvtx_domain()), heap, static_cast<void*>(p));
    cudamem::detail::memory_annotations::remove_heap(0, heap);
    cudamem::check(cudaFree(p), "cudaFree");
  } else if (mode == "probe-vm") {  // does the tool take a heap over VMM memory? (diagnostics)
    cudamem::vm_resource vm{0};
    void* p = vm.allocate(std::size_t{64} << 20);
    std::printf("vm block %p (one 64 MiB handle)\n", p);
    void* heap =
        cudamem::detail::memory_annotations::add_heap(0, p, std::size_t{64} << 20, "probe-vm");
    cudamem::detail::memory_annotations::add_region(0, heap, p, 4096);
    cudamem::detail::memory_annotations::remove_region(0, p);
    cudamem::detail::memory_annotations::remove_heap(0, heap);
    vm.deallocate(p, std::size_t{64} << 20);
  } else {
    std::fprintf(stderr, "planted_bugs: unknown mode %s\n", mode.c_str());
    return 2;
  }
  std::printf("planted_bugs %s: done\n", mode.c_str());
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "planted_bugs: %s\n", e.what());
  return 1;
}
