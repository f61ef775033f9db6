// cudamem/stream.hpp — an owning CUDA stream and a non-owning view of any stream.
//
//   #include <cudamem/stream.hpp>
//
//   cudamem::stream s;                                   // on the current device
//   cudamem::stream fast{{.device = 1, .non_blocking = true, .priority = -1}};
//   kernel<<<grid, block, 0, s.get()>>>(...);
//   cudamem::stream_view v = s;                          // cheap, copyable, non-owning
//   v.synchronize();
//   if (v.is_idle()) { ... }
//   cudamem::stream_view::per_thread().synchronize();     // the per-thread default stream
//
// Contract
// - `stream` owns one cudaStream_t, created on `options.device` (the current device by
//   default) and destroyed on it, whatever device is current at destruction (the destructor
//   makes the stream's device current for the call and restores the caller's). It is move-only.
//   A moved-from stream holds no handle: it may be destroyed or assigned to, nothing else.
//   Move-assignment destroys the stream it held before taking the other one; self-move is a
//   no-op. The destructor is noexcept: a failure goes to the error handler.
// - Bad options throw before anything is created: an invalid device (`std::out_of_range`), a
//   priority outside the device's range (`std::invalid_argument`, naming the range; CUDA
//   would clamp it silently).
// - `stream_view` is trivially copyable and never owns. It converts implicitly from a
//   `stream`, a raw `cudaStream_t`, and anything with a `.get()` that returns one (such as
//   `cuda::stream_ref`). A default-constructed view is the legacy default stream (handle 0).
// - `is_idle()` is true when all work submitted so far has finished; it throws on a real
//   error (a failed kernel), never confusing "busy" with "broken".
#pragma once

#include <cudamem/detail/cuda/quiet_device_scope.hpp>
#include <cudamem/detail/sync/mutex.hpp>
#include <cudamem/device.hpp>
#include <cudamem/error.hpp>

#include <cuda_runtime_api.h>

#include <concepts>
#include <string>
#include <utility>
#include <vector>

namespace cudamem {

/// A non-owning, trivially copyable handle to a CUDA stream.
class stream_view {
 public:
  /// The legacy default stream (handle 0): synchronises with other blocking streams.
  constexpr stream_view() noexcept = default;
  /// A view of `handle` (not owned), implicitly: a cudaStream_t passes where a view is taken.
  constexpr stream_view(cudaStream_t handle) noexcept : handle_(handle) {}  // NOLINT: implicit by design

  /// Any stream-reference type with `.get()` returning a cudaStream_t (e.g. cuda::stream_ref).
  template <class StreamRef>
    requires(!std::same_as<std::remove_cvref_t<StreamRef>, stream_view>) &&
            requires(const StreamRef& ref) {
              { ref.get() } -> std::convertible_to<cudaStream_t>;
            }
  constexpr stream_view(const StreamRef& ref) noexcept(noexcept(ref.get()))  // NOLINT: implicit
      : handle_(ref.get()) {}

  /// The legacy default stream, named explicitly (cudaStreamLegacy).
  [[nodiscard]] static stream_view legacy() noexcept { return stream_view{cudaStreamLegacy}; }
  /// The calling thread's per-thread default stream (cudaStreamPerThread).
  [[nodiscard]] static stream_view per_thread() noexcept {
    return stream_view{cudaStreamPerThread};
  }

  /// The CUDA handle, for CUDA calls and kernel launches.
  [[nodiscard]] constexpr cudaStream_t get() const noexcept { return handle_; }

  /// True for the null handle, cudaStreamLegacy and cudaStreamPerThread.
  [[nodiscard]] bool is_default() const noexcept {
    return handle_ == nullptr || handle_ == cudaStreamLegacy || handle_ == cudaStreamPerThread;
  }

  /// Blocks the calling thread until all work submitted to the stream has finished.
  void synchronize() const { check(cudaStreamSynchronize(handle_), "cudaStreamSynchronize"); }

  /// Whether all work submitted to the stream has finished. Throws on a real error.
  [[nodiscard]] bool is_idle() const {
    const cudaError_t code = cudaStreamQuery(handle_);
    if (code == cudaErrorNotReady) {
      static_cast<void>(cudaGetLastError());  // "not ready" is an answer, not an error
      return false;
    }
    check(code, "cudaStreamQuery");
    return true;
  }

  /// Whether both name the same handle.
  friend constexpr bool operator==(stream_view a, stream_view b) noexcept {
    return a.handle_ == b.handle_;
  }

 private:
  cudaStream_t handle_ = nullptr;
};

namespace detail {

/// Something that remembers stream handles and must hear of a stream's end while the stream
/// still exists (a pool that owes an event on a stream it freed memory on). `stream`'s
/// destructor calls every registered listener before cudaStreamDestroy.
class stream_listener {
 public:
  virtual void on_stream_destroy(cudaStream_t handle) noexcept = 0;
  /// A stream of the process is about to be captured into a CUDA graph (which one is not
  /// known): settle now what would otherwise have to be recorded on it during the capture.
  virtual void before_graph_capture() noexcept {}

 protected:
  stream_listener() = default;
  stream_listener(const stream_listener&) = default;
  stream_listener& operator=(const stream_listener&) = default;
  ~stream_listener() = default;
};

/// The registry of listeners. Never destroyed, so that a stream in a static object can still
/// consult it during static destruction.
struct stream_listener_registry {
  detail::mutex mutex;
  std::vector<stream_listener*> listeners;

  static stream_listener_registry& instance() {
    static auto* registry = new stream_listener_registry;  // deliberately never deleted
    return *registry;
  }
  void add(stream_listener* l) {
    const detail::lock_guard lock(mutex);
    listeners.push_back(l);
  }
  void remove(stream_listener* l) noexcept {
    const detail::lock_guard lock(mutex);
    std::erase(listeners, l);
  }
  void notify(cudaStream_t handle) noexcept {
    const detail::lock_guard lock(mutex);
    for (stream_listener* l : listeners) {
      l->on_stream_destroy(handle);
    }
  }
  void notify_before_graph_capture() noexcept {
    const detail::lock_guard lock(mutex);
    for (stream_listener* l : listeners) {
      l->before_graph_capture();
    }
  }
};

}  // namespace detail

/// How to create a `stream`.
struct stream_options {
  int device = -1;            ///< -1: the current device
  bool non_blocking = false;  ///< true: no implicit sync with the legacy default stream
  int priority = 0;           ///< lower numbers are higher priority; 0 is the default
};

/// An owning CUDA stream; see the contract above.
class stream {
 public:
  /// Creates a stream with `options` (the current device, blocking, default priority).
  explicit stream(stream_options options = {}) {
    const int device = options.device < 0 ? current_device() : options.device;
    device_guard on{device};  // validates the id
    int least = 0;
    int greatest = 0;
    check(cudaDeviceGetStreamPriorityRange(&least, &greatest), "cudaDeviceGetStreamPriorityRange");
    if (options.priority > least || options.priority < greatest) {
      throw std::invalid_argument("cudamem::stream: priority " + std::to_string(options.priority) +
                                  " is outside this device's range [" + std::to_string(greatest) +
                                  ", " + std::to_string(least) + "] (lower is higher priority)");
    }
    const unsigned flags = options.non_blocking ? cudaStreamNonBlocking : cudaStreamDefault;
    check(cudaStreamCreateWithPriority(&handle_, flags, options.priority),
          "cudaStreamCreateWithPriority");
    device_ = device;
  }

  ~stream() { destroy(); }

  stream(const stream&) = delete;
  stream& operator=(const stream&) = delete;

  /// Takes `other`'s stream; `other` holds nothing after.
  stream(stream&& other) noexcept
      : handle_(std::exchange(other.handle_, nullptr)), device_(std::exchange(other.device_, -1)) {}

  /// Destroys the stream held, then takes `other`'s.
  stream& operator=(stream&& other) noexcept {
    if (this != &other) {
      destroy();  // release what we hold before taking the other one
      handle_ = std::exchange(other.handle_, nullptr);
      device_ = std::exchange(other.device_, -1);
    }
    return *this;
  }

  /// The CUDA handle; nullptr for a moved-from stream.
  [[nodiscard]] cudaStream_t get() const noexcept { return handle_; }
  /// A non-owning view, for functions that take one.
  [[nodiscard]] stream_view view() const noexcept { return stream_view{handle_}; }
  /// The view, implicitly: a stream passes where a stream_view is taken.
  operator stream_view() const noexcept { return view(); }  // NOLINT: implicit by design
  /// The device the stream was created on; -1 for a moved-from stream.
  [[nodiscard]] int device() const noexcept { return device_; }
  /// False for a moved-from stream.
  [[nodiscard]] explicit operator bool() const noexcept { return handle_ != nullptr; }

  /// Blocks the calling thread until all work submitted to the stream has finished.
  void synchronize() const { view().synchronize(); }
  /// Whether all work submitted to the stream has finished. Throws on a real error.
  [[nodiscard]] bool is_idle() const { return view().is_idle(); }

 private:
  // Out of line on purpose, as event::destroy(): inlined into a std::optional<stream>'s
  // destructor, g++ at -O2 (a newer one than CI's g++ 12, on the GPU machine) warned that
  // device_ "may be used uninitialized" (a false positive that fails a user's -Werror build).
  // Destroying a stream is a driver call anyway.
  [[gnu::noinline]] void destroy() noexcept {
    if (handle_ == nullptr) {
      return;
    }
    // On the stream's own device: the thread that destroys it may have made another device
    // current (a worker driving several GPUs), and the listeners below record events on it.
    const detail::quiet_device_scope on{device_, "cudamem::stream: switching to its device"};
    // Resources that remember this stream (a pool that owes an event on it) settle up first,
    // while the handle is still valid.
    detail::stream_listener_registry::instance().notify(handle_);
    // cudaStreamDestroy returns at once; the stream's pending work still completes.
    report_error(cudaStreamDestroy(handle_), "cudamem::stream: cudaStreamDestroy");
    handle_ = nullptr;
    device_ = -1;
  }

  cudaStream_t handle_ = nullptr;
  int device_ = -1;
};

}  // namespace cudamem
