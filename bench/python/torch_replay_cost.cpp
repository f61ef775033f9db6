// What a recorded PyTorch program's allocations cost on the host, under PyTorch's own caching
// allocator and under cudamem's, in one process on a GPU: the two allocators side by side, on
// the same calls, with the same work between them. torch_replay.py builds this file against the
// installed PyTorch and drives it; see there for the command line.
//
// Why in one process: steps/s of two training processes differ by more than the allocators do
// (the host's noise moved whole passes by 10%). Here both allocators replay the same log, pass
// after pass in turn, so what differs is only what each does per call.
//
// How: PyTorch's native allocator (c10's CUDAAllocator) is taken before cudamem.torch.install()
// replaces it, then initialised here, since PyTorch no longer does; then the installed one. Each replays the log's
// allocations and frees through raw_alloc_with_stream / raw_delete, the same entry points
// tensors reach (allocate() and its deleter add only a DataPtr). Between two calls the replay
// can touch a host buffer, evicting the allocators' structures from the caches as the
// framework's own work between two calls does. Only the calls are timed.
#include <c10/cuda/CUDACachingAllocator.h>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <fstream>
#include <sstream>
#include <string>
#include <unordered_map>
#include <vector>

namespace {

namespace cca = c10::cuda::CUDACachingAllocator;
using clock_type = std::chrono::steady_clock;

/// One call of the log: an allocation of `bytes` into `slot`, or the free of `slot`.
struct op {
  bool allocate;
  std::size_t bytes;  ///< as allocated (a free's is its allocation's)
  std::size_t slot;
};

std::vector<op> ops;
std::size_t slots = 0;
std::vector<std::size_t> slot_bytes;  ///< each slot's allocation size
cca::CUDAAllocator* allocators[2] = {nullptr, nullptr};  // 0: PyTorch's own, 1: the installed
// 2: libcudamem_c's allocator 0 called directly, as the installed one calls it: what the
// compiled allocator adds over the C side is then the difference between 1 and 2.
using c_allocate_fn = int (*)(int, std::size_t, int, void*, void**);
using c_deallocate_fn = int (*)(int, void*, std::size_t, int, void*);
c_allocate_fn c_allocate = nullptr;
c_deallocate_fn c_deallocate = nullptr;
std::vector<unsigned char> touched;
volatile unsigned char sink = 0;
std::string last_error;

/// Reads a cudamem log (logging_adaptor's format: kind,t_ns,thread,stream,ptr,bytes,...).
/// Frees of pointers allocated before the log began are skipped.
bool read_log(const char* path) {
  std::ifstream in(path);
  if (!in) {
    last_error = std::string("cannot open ") + path;
    return false;
  }
  std::unordered_map<std::string, std::pair<std::size_t, std::size_t>> live;  // ptr -> slot, bytes
  std::string line;
  while (std::getline(in, line)) {
    if (line.size() < 2 || line[1] != ',' || (line[0] != 'A' && line[0] != 'F')) {
      continue;  // comments, the header
    }
    std::vector<std::string> f;
    std::stringstream fields(line);
    for (std::string x; std::getline(fields, x, ',');) {
      f.push_back(x);
    }
    if (f.size() < 6) {
      continue;
    }
    const std::size_t bytes = std::stoull(f[5]);
    if (line[0] == 'A') {
      live[f[4]] = {slots, bytes};
      slot_bytes.push_back(bytes);
      ops.push_back({true, bytes, slots++});
    } else if (const auto it = live.find(f[4]); it != live.end()) {
      ops.push_back({false, it->second.second, it->second.first});
      live.erase(it);
    }
  }
  return true;
}

void touch() {
  unsigned char sum = 0;
  for (std::size_t i = 0; i < touched.size(); i += 64) {
    touched[i] = static_cast<unsigned char>(touched[i] + 1);
    sum = static_cast<unsigned char>(sum + touched[i]);
  }
  sink = sum;
}

}  // namespace

extern "C" {

/// Remembers the allocator PyTorch uses now as `which` (0: its own, 1: the installed one).
__attribute__((visibility("default"))) int replay_take_allocator(int which) {
  if (which < 0 || which > 1) {
    return 1;
  }
  allocators[which] = cca::get();
  return allocators[which] != nullptr ? 0 : 1;
}

/// The C API's cudamem_allocate and cudamem_deallocate (their addresses), for `which` = 2.
__attribute__((visibility("default"))) void replay_take_c_api(void* allocate, void* deallocate) {
  c_allocate = reinterpret_cast<c_allocate_fn>(allocate);
  c_deallocate = reinterpret_cast<c_deallocate_fn>(deallocate);
}

/// Initialises allocator `which` for `devices` devices if it is not yet: PyTorch's own, taken
/// before install() and never used by PyTorch after it.
__attribute__((visibility("default"))) int replay_init(int which, int devices) {
  try {
    if (!allocators[which]->initialized()) {
      allocators[which]->init(devices);
    }
    return 0;
  } catch (const std::exception& e) {
    last_error = e.what();
    return 1;
  }
}

__attribute__((visibility("default"))) int replay_load(const char* path, std::size_t touch_kib) {
  try {
    ops.clear();
    slot_bytes.clear();
    slots = 0;
    touched.assign(touch_kib * 1024, 0);
    return read_log(path) && !ops.empty() ? 0 : 1;
  } catch (const std::exception& e) {
    last_error = e.what();
    return 1;
  }
}

__attribute__((visibility("default"))) std::size_t replay_ops() { return ops.size(); }

/// One pass of the log through allocator `which` (0, 1, or 2: the C API); ns[4] and calls[4] get the time and count of
/// large allocations (>= large_bytes), small ones, large frees, small frees. Whatever the log
/// left live is freed at the end, untimed. 0 on success.
__attribute__((visibility("default"))) int replay_pass(int which, std::size_t large_bytes,
                                                       double* ns, long* calls) {
  cca::CUDAAllocator* a = which < 2 ? allocators[which] : nullptr;
  if (which < 2 ? a == nullptr : c_allocate == nullptr || c_deallocate == nullptr) {
    last_error = "no allocator taken";
    return 1;
  }
  last_error.clear();
  int device = 0;
  cudaGetDevice(&device);
  // The C API's block for `p` (its bytes are the log's) and a free of it.
  const auto c_free = [&](void* p, std::size_t bytes) {
    if (c_deallocate(0, p, bytes, device, nullptr) != 0) {
      last_error = "cudamem_deallocate failed";
    }
  };
  std::vector<void*> at(slots, nullptr);
  const cudaStream_t stream = nullptr;  // the log's one stream: PyTorch's default
  for (int k = 0; k < 4; ++k) {
    ns[k] = 0;
    calls[k] = 0;
  }
  try {
    for (const op& o : ops) {
      if (!touched.empty()) {
        touch();
      }
      const int kind = (o.allocate ? 0 : 2) + (o.bytes >= large_bytes ? 0 : 1);
      const auto start = clock_type::now();
      if (a == nullptr) {  // the C API; a failure ends the pass (the time is not used)
        if (o.allocate && c_allocate(0, o.bytes, device, stream, &at[o.slot]) != 0) {
          last_error = "cudamem_allocate failed";
          break;
        }
        if (!o.allocate) {
          c_free(at[o.slot], o.bytes);
        }
      } else if (o.allocate) {
        at[o.slot] = a->raw_alloc_with_stream(o.bytes, stream);
      } else {
        a->raw_delete(at[o.slot]);
      }
      const auto end = clock_type::now();
      if (!o.allocate) {
        at[o.slot] = nullptr;
      }
      ns[kind] += std::chrono::duration<double, std::nano>(end - start).count();
      ++calls[kind];
    }
  } catch (const std::exception& e) {
    last_error = e.what();
  }
  for (std::size_t slot = 0; slot < at.size(); ++slot) {
    if (at[slot] == nullptr) {
      continue;
    }
    if (a != nullptr) {
      a->raw_delete(at[slot]);
    } else {
      c_free(at[slot], slot_bytes[slot]);
    }
  }
  return last_error.empty() ? 0 : 1;
}

__attribute__((visibility("default"))) const char* replay_error() { return last_error.c_str(); }

}  // extern "C"
