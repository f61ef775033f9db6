// capi/src/c_api.cpp — the exported functions of cudamem_c.h: a table of allocators
// (allocator.hpp), C++ exceptions turned into status codes and a per-thread message, and the
// entry points PyTorch's CUDAPluggableAllocator calls.
//
// Every C function is a `guarded` call: whatever the allocator throws becomes a status and
// cudamem_last_error() text, so nothing crosses the C ABI. The PyTorch entry points are the
// exception on purpose (see cudamem_c.h): PyTorch calls them from C++, and a failed allocation
// must raise where the tensor is made, not hand PyTorch a null pointer (it would build a
// tensor with no memory and fail later, elsewhere).
#include "allocator.hpp"
#include "ipc.hpp"

#include <cudamem/error.hpp>
#include <cudamem/out_of_memory.hpp>
#include <cudamem/version.hpp>

#include <cudamem_c.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <memory>
#include <mutex>
#include <new>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

using cudamem::capi::allocator;

// --- errors --------------------------------------------------------------------------------------

/// cudamem_last_error()'s text, one per thread, reached through error_text() (and cleared by
/// guarded() only once alive, so a thread that never failed never constructs it). A framework
/// may call in after the thread's thread_local objects are destroyed: the main thread runs them
/// at exit before the static destructors that free a framework's last memory (PyTorch's). A
/// destroyed std::string written to, even by clear(), writes into freed heap memory, and malloc
/// aborts later ("unsorted double linked list corrupted"). So the holder marks itself dead in a
/// flag that has no destructor, and after that the thread keeps no text.
enum class text_state : unsigned char { unborn, alive, dead };
thread_local text_state error_text_state = text_state::unborn;  // trivial: valid to the end

struct error_text_holder {
  std::string text;
  ~error_text_holder() { error_text_state = text_state::dead; }
};
thread_local error_text_holder error_text_storage;  // touched only while not dead

/// This thread's text, or nullptr once its thread_local objects are gone.
std::string* error_text() noexcept {
  if (error_text_state == text_state::dead) {
    return nullptr;
  }
  error_text_state = text_state::alive;
  return &error_text_storage.text;  // the first touch constructs it
}

/// What cudamem_last_error() says on a thread whose text is gone.
constexpr const char* no_error_text = "cudamem: no message (the calling thread is ending)";

/// Problems cudamem reports through its error handler during one call on this thread (a bad
/// free: the resources' deallocate is noexcept and reports instead of throwing).
thread_local std::string* captured_problem = nullptr;

/// The library's error handler: a problem during a guarded call becomes that call's error;
/// anything else (a destructor's failure) is printed as cudamem's default handler does. This
/// library has its own copy of cudamem's handler slot, so a program's handler is not touched.
void capture_or_print(const cudamem::error_report& report) noexcept {
  if (captured_problem != nullptr && report.code == cudaSuccess) {
    try {
      captured_problem->assign(report.message);
      return;
    } catch (...) {  // no memory for the text: print it instead
    }
  }
  cudamem::print_error(report);
}

struct problem_capture {
  problem_capture() noexcept { captured_problem = &text; }
  ~problem_capture() { captured_problem = nullptr; }
  problem_capture(const problem_capture&) = delete;
  problem_capture& operator=(const problem_capture&) = delete;
  std::string text;
};

cudamem_status fail(cudamem_status status, const char* message) noexcept {
  if (std::string* text = error_text()) {
    try {
      *text = message;
    } catch (...) {
      text->clear();
    }
  }
  return status;
}

/// Runs `f`, turning every exception into a status and a message. Order matters: the
/// specific types first (out_of_memory is a bad_alloc; no_device_error a cuda_error).
template <class F>
cudamem_status guarded(F&& f) noexcept {
  try {
    f();
    if (error_text_state == text_state::alive) {  // unborn: no text yet; dead: none to keep
      error_text_storage.text.clear();
    }
    return CUDAMEM_OK;
  } catch (const cudamem::out_of_memory& e) {
    return fail(CUDAMEM_ERROR_OUT_OF_MEMORY, e.what());
  } catch (const cudamem::no_device_error& e) {
    return fail(CUDAMEM_ERROR_NO_DEVICE, e.what());
  } catch (const cudamem::cuda_error& e) {
    return fail(CUDAMEM_ERROR_CUDA, e.what());
  } catch (const cudamem::capi::state_error& e) {
    return fail(CUDAMEM_ERROR_STATE, e.what());
  } catch (const std::invalid_argument& e) {  // config_error too
    return fail(CUDAMEM_ERROR_INVALID_ARGUMENT, e.what());
  } catch (const std::out_of_range& e) {
    return fail(CUDAMEM_ERROR_INVALID_ARGUMENT, e.what());
  } catch (const std::bad_alloc&) {
    return fail(CUDAMEM_ERROR_INTERNAL, "cudamem: out of host memory");
  } catch (const std::exception& e) {
    return fail(CUDAMEM_ERROR_INTERNAL, e.what());
  } catch (...) {
    return fail(CUDAMEM_ERROR_INTERNAL, "cudamem: unknown exception");
  }
}

/// Copies `text` into a caller's buffer, C style; *needed gets its length with the zero.
void copy_out(const std::string& text, char* buf, std::size_t size, std::size_t* needed) {
  if (needed != nullptr) {
    *needed = text.size() + 1;
  }
  if (buf != nullptr && size > 0) {
    const std::size_t n = std::min(text.size(), size - 1);
    std::memcpy(buf, text.data(), n);
    buf[n] = '\0';
  }
}

/// Copies ranges into a caller's array, C style; *count gets how many there are.
void copy_ranges(const std::vector<cudamem::capi::address_range>& ranges, cudamem_segment* out,
                 std::size_t capacity, std::size_t* count) {
  if (count == nullptr) {
    throw std::invalid_argument("cudamem: count is NULL");
  }
  *count = ranges.size();
  if (out != nullptr) {
    for (std::size_t i = 0; i < std::min(capacity, ranges.size()); ++i) {
      out[i] = cudamem_segment{ranges[i].address, ranges[i].bytes};
    }
  }
}

// --- the table of allocators -------------------------------------------------------------------

/// Allocators by id. Entries are made once and, but for destroy(), never freed: allocator 0
/// lives as long as the process, so that memory a framework frees from its own static
/// destructors at exit still finds it (the driver takes the device memory back at exit).
struct allocator_table {
  std::mutex mutex;  ///< create, destroy, and allocator 0's first making
  std::array<std::atomic<allocator*>, CUDAMEM_MAX_ALLOCATORS> slots{};
};

allocator_table& table() {
  static auto* t = new allocator_table;  // never destroyed: see above
  return *t;
}

/// Allocator 0, made (and configured from the environment) on first use.
allocator& process_allocator() {
  allocator_table& t = table();
  if (allocator* a = t.slots[0].load(std::memory_order_acquire)) {
    return *a;
  }
  const std::lock_guard lock(t.mutex);
  if (allocator* a = t.slots[0].load(std::memory_order_acquire)) {
    return *a;
  }
  cudamem::set_error_handler(&capture_or_print);
  auto made = std::make_unique<allocator>();
  made->configure_from_environment([](const char* name) { return std::getenv(name); });
  t.slots[0].store(made.get(), std::memory_order_release);
  return *made.release();
}

allocator& allocator_at(int id) {
  if (id == 0) {
    return process_allocator();
  }
  if (id < 0 || id >= CUDAMEM_MAX_ALLOCATORS) {
    throw std::invalid_argument("cudamem: no allocator " + std::to_string(id) + " (ids are 0.." +
                                std::to_string(CUDAMEM_MAX_ALLOCATORS - 1) + ")");
  }
  allocator* a = table().slots[static_cast<std::size_t>(id)].load(std::memory_order_acquire);
  if (a == nullptr) {
    throw std::invalid_argument("cudamem: no allocator " + std::to_string(id) +
                                " (not created, or destroyed)");
  }
  return *a;
}

cudaStream_t as_stream(cudamem_stream_t s) noexcept { return static_cast<cudaStream_t>(s); }

/// What a failed PyTorch allocation throws when no thrower is registered: a std::bad_alloc
/// (PyTorch raises it as RuntimeError) whose what() is cudamem's report.
class torch_out_of_memory : public std::bad_alloc {
 public:
  explicit torch_out_of_memory(std::string report) : report_(std::move(report)) {}
  [[nodiscard]] const char* what() const noexcept override { return report_.c_str(); }

 private:
  std::string report_;
};

// --- PyTorch ------------------------------------------------------------------------------------

std::atomic<cudamem_oom_thrower> torch_oom_thrower{nullptr};

/// Allocator `Id`'s PyTorch malloc. Throws on failure (raise_on_oom=1; see cudamem_c.h).
template <int Id>
void* torch_malloc(std::size_t size, int device, cudamem_stream_t stream) {
  std::string message;
  bool oom = false;
  bool return_null = false;
  try {
    allocator& a = allocator_at(Id);
    try {
      return a.allocate(size, device, as_stream(stream));
    } catch (const cudamem::out_of_memory& e) {
      oom = true;
      message = e.what();
      return_null = !a.raise_on_oom();
    }
  } catch (const cudamem::out_of_memory& e) {
    oom = true;
    message = e.what();
  } catch (const std::bad_alloc&) {
    oom = true;
    message = "cudamem: out of host memory";
  } catch (const std::exception& e) {
    message = e.what();
  }
  if (return_null) {
    return nullptr;  // torch.cuda.MemPool's caching allocator frees its cache and retries
  }
  if (oom) {
    if (const cudamem_oom_thrower thrower = torch_oom_thrower.load()) {
      thrower(message.c_str());  // throws the framework's exception
    }
    throw torch_out_of_memory(std::move(message));
  }
  throw std::runtime_error(message);
}

template <int Id>
void torch_free(void* p, std::size_t size, int device, cudamem_stream_t stream) noexcept {
  problem_capture capture;
  try {
    allocator_at(Id).deallocate(p, size, device, as_stream(stream));
  } catch (const std::exception& e) {
    cudamem::report_problem(std::string("cudamem: PyTorch free: ") + e.what());
  } catch (...) {
  }
  if (!capture.text.empty()) {
    captured_problem = nullptr;
    cudamem::report_problem(capture.text);
  }
}

template <int Id>
void torch_record_stream(void* p, cudamem_stream_t stream) noexcept {
  try {
    allocator_at(Id).record_stream(p, as_stream(stream));
  } catch (const std::exception& e) {
    cudamem::report_problem(std::string("cudamem: PyTorch record_stream: ") + e.what());
  } catch (...) {
  }
}

template <int Id>
void torch_empty_cache() noexcept {
  try {
    static_cast<void>(allocator_at(Id).release(-1));
  } catch (const std::exception& e) {
    cudamem::report_problem(std::string("cudamem: PyTorch empty_cache: ") + e.what());
  } catch (...) {
  }
}

}  // namespace

// --- the C functions ----------------------------------------------------------------------------

extern "C" {

CUDAMEM_C_API const char* cudamem_version(void) { return CUDAMEM_VERSION_STRING; }

CUDAMEM_C_API const char* cudamem_last_error(void) {
  const std::string* text = error_text();
  return text != nullptr ? text->c_str() : no_error_text;
}

CUDAMEM_C_API cudamem_status cudamem_current_device(int* out) {
  return guarded([&] {
    if (out == nullptr) {
      throw std::invalid_argument("cudamem_current_device: out is NULL");
    }
    int device = -1;
    cudamem::check(cudaGetDevice(&device), "cudamem_current_device");
    *out = device;
  });
}

CUDAMEM_C_API cudamem_status cudamem_allocator_create(const char* config, int* out_id) {
  return guarded([&] {
    if (out_id == nullptr) {
      throw std::invalid_argument("cudamem_allocator_create: out_id is NULL");
    }
    cudamem::capi::allocator_config c;
    cudamem::capi::apply_config_text(c, config != nullptr ? config : "",
                                     "cudamem_allocator_create");
    process_allocator();  // the error handler is installed with it
    allocator_table& t = table();
    const std::lock_guard lock(t.mutex);
    for (int id = 1; id < CUDAMEM_MAX_ALLOCATORS; ++id) {
      auto& slot = t.slots[static_cast<std::size_t>(id)];
      if (slot.load(std::memory_order_acquire) == nullptr) {
        slot.store(new allocator(c), std::memory_order_release);
        *out_id = id;
        return;
      }
    }
    throw cudamem::capi::state_error("cudamem: all " +
                                     std::to_string(CUDAMEM_MAX_ALLOCATORS - 1) +
                                     " allocators besides allocator 0 are in use");
  });
}

CUDAMEM_C_API cudamem_status cudamem_allocator_configure(int id, const char* config) {
  return guarded([&] {
    allocator_at(id).configure(config != nullptr ? config : "", "cudamem_allocator_configure");
  });
}

CUDAMEM_C_API cudamem_status cudamem_allocator_describe(int id, char* buf, size_t size,
                                                        size_t* needed) {
  return guarded([&] {
    copy_out(cudamem::capi::describe(allocator_at(id).config()), buf, size, needed);
  });
}

CUDAMEM_C_API cudamem_status cudamem_allocator_destroy(int id) {
  return guarded([&] {
    if (id == 0) {
      throw std::invalid_argument("cudamem: allocator 0 lives as long as the process");
    }
    allocator* a = &allocator_at(id);
    allocator_table& t = table();
    const std::lock_guard lock(t.mutex);
    if (const std::size_t in_use = a->in_use_bytes(); in_use != 0) {
      throw cudamem::capi::state_error("cudamem: allocator " + std::to_string(id) + " still has " +
                                       std::to_string(in_use) + " bytes allocated");
    }
    t.slots[static_cast<std::size_t>(id)].store(nullptr, std::memory_order_release);
    delete a;
  });
}

CUDAMEM_C_API cudamem_status cudamem_allocate(int id, size_t bytes, int device,
                                              cudamem_stream_t stream, void** out) {
  return guarded([&] {
    if (out == nullptr) {
      throw std::invalid_argument("cudamem_allocate: out is NULL");
    }
    *out = nullptr;
    *out = allocator_at(id).allocate(bytes, device, as_stream(stream));
  });
}

CUDAMEM_C_API cudamem_status cudamem_deallocate(int id, void* p, size_t bytes, int device,
                                                cudamem_stream_t stream) {
  return guarded([&] {
    problem_capture capture;
    allocator_at(id).deallocate(p, bytes, device, as_stream(stream));
    if (!capture.text.empty()) {
      throw std::invalid_argument(capture.text);
    }
  });
}

CUDAMEM_C_API cudamem_status cudamem_record_stream(int id, void* p, cudamem_stream_t stream) {
  return guarded([&] { allocator_at(id).record_stream(p, as_stream(stream)); });
}

CUDAMEM_C_API cudamem_status cudamem_prepare_for_graph_capture(void) {
  return guarded([] {
    problem_capture capture;
    cudamem::prepare_for_graph_capture();
    if (!capture.text.empty()) {
      throw std::runtime_error(capture.text);
    }
  });
}

CUDAMEM_C_API cudamem_status cudamem_release(int id, int device, uint64_t* released_bytes) {
  return guarded([&] {
    const std::size_t released = allocator_at(id).release(device);
    if (released_bytes != nullptr) {
      *released_bytes = released;
    }
  });
}

CUDAMEM_C_API cudamem_status cudamem_get_stats(int id, int device, cudamem_stats* out) {
  return guarded([&] {
    if (out == nullptr || out->struct_size < offsetof(cudamem_stats, device)) {
      throw std::invalid_argument(
          "cudamem_get_stats: out is NULL or its struct_size is not set (set it to "
          "sizeof(cudamem_stats))");
    }
    const std::size_t caller_size = out->struct_size;
    cudamem_stats s = allocator_at(id).stats(device);
    s.struct_size = std::min(caller_size, sizeof(cudamem_stats));
    std::memcpy(out, &s, s.struct_size);  // a caller built against an older header gets less
  });
}

CUDAMEM_C_API cudamem_status cudamem_reset_peak_reserved(int id, int device) {
  return guarded([&] { allocator_at(id).reset_peak_reserved(device); });
}

CUDAMEM_C_API cudamem_status cudamem_segments(int id, int device, cudamem_segment* out,
                                              size_t capacity, size_t* count) {
  return guarded([&] { copy_ranges(allocator_at(id).segments(device), out, capacity, count); });
}

CUDAMEM_C_API cudamem_status cudamem_add_peer(int id, int device, int peer) {
  return guarded([&] { allocator_at(id).add_peer(device, peer); });
}

CUDAMEM_C_API cudamem_status cudamem_ipc_export_range(int id, int device, const void* p,
                                                      size_t bytes, cudamem_ipc_export* out,
                                                      int* fds, size_t fd_capacity,
                                                      size_t* fd_count) {
  return guarded([&] {
    if (out == nullptr || out->struct_size < sizeof(cudamem_ipc_export) || fd_count == nullptr) {
      throw std::invalid_argument(
          "cudamem_ipc_export_range: out (with struct_size set) and fd_count are needed");
    }
    allocator& a = allocator_at(id);
    const cudamem::capi::device_stack* stack = a.stack_of(device);
    if (stack == nullptr) {
      throw std::invalid_argument("cudamem: device " + std::to_string(device) +
                                  " has no memory of this allocator to share");
    }
    std::vector<cudamem::unique_fd> made;
    const cudamem::capi::ipc_export e =
        cudamem::capi::export_range<cudamem::capi::state_error>(*stack, p, bytes, made);
    *fd_count = made.size();
    if (made.size() > fd_capacity || (fds == nullptr && !made.empty())) {
      throw std::invalid_argument("cudamem_ipc_export_range: room for " +
                                  std::to_string(fd_capacity) + " descriptors, " +
                                  std::to_string(made.size()) + " needed");
    }
    out->kind = e.vmm ? CUDAMEM_IPC_VMM : CUDAMEM_IPC_CUDA_MALLOC;
    out->offset = e.offset;
    out->handle_bytes = e.handle_bytes;
    static_assert(sizeof(out->ipc_mem_handle) == sizeof(e.memory_handle));
    std::memcpy(out->ipc_mem_handle, &e.memory_handle, sizeof(e.memory_handle));
    for (std::size_t i = 0; i < made.size(); ++i) {
      fds[i] = made[i].release();
    }
  });
}

CUDAMEM_C_API cudamem_status cudamem_ipc_import(int device, int32_t pid, const int* fds,
                                                size_t count, uint64_t handle_bytes,
                                                void** base) {
  return guarded([&] {
    if (base == nullptr || (fds == nullptr && count != 0)) {
      throw std::invalid_argument("cudamem_ipc_import: base and fds are needed");
    }
    *base = nullptr;
    *base = cudamem::capi::imported_ranges::instance().import(
        device, pid, std::vector<int>(fds, fds + count), static_cast<std::size_t>(handle_bytes));
  });
}

CUDAMEM_C_API cudamem_status cudamem_ipc_add_peer(void* base, int peer) {
  return guarded([&] { cudamem::capi::imported_ranges::instance().add_peer(base, peer); });
}

CUDAMEM_C_API cudamem_status cudamem_ipc_unmap(void* base) {
  return guarded([&] { cudamem::capi::imported_ranges::instance().unmap(base); });
}

CUDAMEM_C_API cudamem_status cudamem_report(int id, int device, uint64_t bytes, char* buf,
                                            size_t size, size_t* needed) {
  return guarded([&] {
    copy_out(allocator_at(id).report(device, static_cast<std::size_t>(bytes)), buf, size,
             needed);
  });
}

CUDAMEM_C_API cudamem_status cudamem_last_oom_report(int id, char* buf, size_t size,
                                                     size_t* needed) {
  return guarded([&] { copy_out(allocator_at(id).last_oom_report(), buf, size, needed); });
}

CUDAMEM_C_API void cudamem_set_torch_oom_thrower(cudamem_oom_thrower thrower) {
  torch_oom_thrower.store(thrower);
}

// PyTorch's entry points, one set per allocator id (CUDAPluggableAllocator takes function
// names, and a MemPool needs an allocator of its own).
#define CUDAMEM_TORCH_ENTRY_POINTS(suffix, id)                                                   \
  CUDAMEM_C_API void* cudamem_torch_malloc##suffix(size_t size, int device,                    \
                                                   cudamem_stream_t stream) {                  \
    return torch_malloc<id>(size, device, stream);                                             \
  }                                                                                            \
  CUDAMEM_C_API void cudamem_torch_free##suffix(void* p, size_t size, int device,             \
                                                cudamem_stream_t stream) {                     \
    torch_free<id>(p, size, device, stream);                                                   \
  }                                                                                            \
  CUDAMEM_C_API void cudamem_torch_record_stream##suffix(void* p, cudamem_stream_t stream) {  \
    torch_record_stream<id>(p, stream);                                                        \
  }                                                                                            \
  CUDAMEM_C_API void cudamem_torch_empty_cache##suffix(void) { torch_empty_cache<id>(); }

CUDAMEM_TORCH_ENTRY_POINTS(, 0)
CUDAMEM_TORCH_ENTRY_POINTS(_1, 1)
CUDAMEM_TORCH_ENTRY_POINTS(_2, 2)
CUDAMEM_TORCH_ENTRY_POINTS(_3, 3)
CUDAMEM_TORCH_ENTRY_POINTS(_4, 4)
CUDAMEM_TORCH_ENTRY_POINTS(_5, 5)
CUDAMEM_TORCH_ENTRY_POINTS(_6, 6)
CUDAMEM_TORCH_ENTRY_POINTS(_7, 7)
CUDAMEM_TORCH_ENTRY_POINTS(_8, 8)
CUDAMEM_TORCH_ENTRY_POINTS(_9, 9)
CUDAMEM_TORCH_ENTRY_POINTS(_10, 10)
CUDAMEM_TORCH_ENTRY_POINTS(_11, 11)
CUDAMEM_TORCH_ENTRY_POINTS(_12, 12)
CUDAMEM_TORCH_ENTRY_POINTS(_13, 13)
CUDAMEM_TORCH_ENTRY_POINTS(_14, 14)
CUDAMEM_TORCH_ENTRY_POINTS(_15, 15)
static_assert(CUDAMEM_MAX_ALLOCATORS == 16, "one set of PyTorch entry points per allocator");

}  // extern "C"
