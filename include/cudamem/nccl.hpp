// cudamem/nccl.hpp — NCCL on cudamem memory: communicators and buffer registrations as owners,
// pools whose chunks are registered with a communicator as they are made, and NCCL's own
// allocator as an upstream. Optional: it needs NCCL (2.19 or newer), which cudamem itself
// does not; it is not part of cudamem.hpp.
//
//   #include <cudamem/nccl.hpp>          // nccl.h on the include path; link the NCCL you use
//
//   setenv("NCCL_NVLS_ENABLE", "0", 0);  // NCCL's settings are the program's (see below)
//   auto comms = cudamem::nccl_communicator::init_all();          // one per visible GPU
//
//   // Device 0: a pool on NCCL's allocator, every chunk registered with comms[0] once.
//   cudamem::nccl_mem_resource nccl_memory{0};                      // ncclMemAlloc/ncclMemFree
//   cudamem::nccl_registering_adaptor registered{nccl_memory, comms[0].get()};
//   cudamem::pool_resource pool{registered};
//   cudamem::device_buffer<float> x(n, s, pool);                    // in a registered chunk
//   cudamem::check_nccl(ncclAllReduce(x.data(), x.data(), n, ncclFloat, ncclSum,
//                                     comms[0].get(), s.get()), "ncclAllReduce");
//
//   // The same with a vm_pool: its chunks and its large blocks are registered.
//   cudamem::vm_pool_resource vm_pool{0, cudamem::nccl_vm_pool_options(comms[0].get())};
//
//   // One buffer by hand: ncclCommRegister now, ncclCommDeregister at the end of the scope.
//   cudamem::nccl_registration r{comms[0].get(), p, bytes};
//
// Why. NCCL moves data fastest between buffers it has registered: it can then read and write
// the user's memory directly instead of staging it through its own buffers. A registration
// must be undone (ncclCommDeregister) before the memory is freed, and each costs NCCL work on
// first use (mapping the memory for the peers). A pool turns "one registration per buffer" into
// "one per chunk": the chunks live long, the blocks in them come and go, and NCCL finds which
// registered range a block lies in by its address.
//
// How NCCL is loaded: linked, not opened at run time. NVML (detail/nvml/nvml.hpp) is dlopen'd
// because every cudamem program may write an out-of-memory report and must not need the
// library to start. Here the program already calls NCCL (it made the communicator), and the
// communicator is a pointer into *that* NCCL's state: our calls must reach the same copy. A
// dlopen("libnccl.so.2") could load a second copy beside one linked statically into the
// program (some frameworks' builds are) and hand it a communicator it never made; a direct
// call resolves to the NCCL the program links, and a program that links none fails at link
// time, not at run time.
//
// Contract
// - Lifetimes: a communicator must outlive every registration made with it, and so every
//   nccl_registering_adaptor over it and every pool over such an adaptor: destroy pools and
//   buffers first, then the communicators (declare the communicators first).
// - NCCL's communicators are not thread-safe, and a registration is a call on the
//   communicator: allocating from a registering pool (when it grows), release() and
//   destruction may register or deregister. Do them on the thread that issues the
//   communicator's collectives, or serialise them with it. cudamem serialises its own
//   registration calls process-wide (one mutex), so two pools never race each other.
// - Registration needs memory NCCL can map for its peers: NCCL's documentation (User Buffer
//   Registration) asks for CUDA virtual memory created shareable as POSIX file descriptors
//   (and as fabric handles where the fabric exists), its address and size multiples of the
//   recommended granularity — what ncclMemAlloc gives (nccl_mem_resource), and what
//   nccl_vm_pool_options asks of a vm_pool. cudaMalloc'd memory is accepted by
//   ncclCommRegister, but NCCL 2.24+ uses it for its local zero-copy paths only with
//   NCCL_LEGACY_CUDA_REGISTER=1. NCCL also asks that, in one collective, either every rank's
//   buffers are registered or none are.
// - cudamem never sets NCCL's environment. Its programs and tests set NCCL_NVLS_ENABLE=0 (if
//   unset) before the first communicator: NVLink multicast can take a shared host's GPUs out
//   of service, and cudamem never calls the multicast API itself.
// - Errors: a failing NCCL call throws `nccl_error` (the code, NCCL's text and its last
//   warning — process-wide, so possibly older than the call —, what was being done, where);
//   in destructors and frees it goes to the error handler (error.hpp). Every owner's
//   constructor either owns what it made or throws having left nothing behind. Bad arguments (a null communicator or pointer, zero bytes, memory of
//   another device or kind than the communicator's) throw `std::invalid_argument` before NCCL
//   is called.
// - NCCL changes the calling thread's current device in some calls (ncclCommDeregister
//   leaves it on the communicator's device); every call here restores it.
//
// Parts (detail/nccl/; each opens with what it owns)
//   calls.hpp          how cudamem calls NCCL: the table of calls (tests: a fake), one
//                      registration call at a time, the device around each call; nccl_error,
//                      check_nccl
//   communicator.hpp   nccl_communicator (owner; init_all)
//   registration.hpp   nccl_registration (owner of one registered range)
// Here: nccl_registering_adaptor (and nccl_vm_pool_options), nccl_mem_resource.
#pragma once

// Needs nccl.h (2.19 or newer): detail/nccl/calls.hpp stops with a #error that says where to get
// it, before anything else is compiled.
#include <cudamem/detail/nccl/calls.hpp>
#include <cudamem/detail/nccl/communicator.hpp>
#include <cudamem/detail/nccl/registration.hpp>
#include <cudamem/detail/adaptors/adaptor_base.hpp>
#include <cudamem/detail/cuda/cuda_upstream.hpp>
#include <cudamem/detail/sync/mutex.hpp>
#include <cudamem/device.hpp>
#include <cudamem/error.hpp>
#include <cudamem/memory_resource.hpp>
#include <cudamem/out_of_memory.hpp>
#include <cudamem/vm_pool_resource.hpp>
#include <cudamem/vm_resource.hpp>

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <source_location>
#include <stdexcept>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

namespace cudamem {

// --- registering what passes through --------------------------------------------------------

/// An adaptor between a pool and its upstream: every allocation it passes up is registered
/// with the communicator, and deregistered before it goes back down. Under a pool_resource
/// (or a vm_pool_resource: nccl_vm_pool_options) that makes every chunk registered once, as it
/// is made, so every block the pool hands out lies in registered memory.
///
/// Contract (memory_resource.hpp's, plus)
/// - Same kind and device as the upstream, which must be device memory of the communicator's
///   device (else std::invalid_argument; a null communicator too).
/// - allocate: the upstream's memory, registered; if the registration fails the memory goes
///   back and `nccl_error` is thrown; an upstream failure passes through (nothing registered).
/// - deallocate: deregisters, then frees. A stream-ordered free first waits for the stream on
///   the host: NCCL unmaps the memory from its peers when it deregisters, which must not
///   happen while a collective may still use it. (A pool returns chunks with the synchronous
///   free after settling its streams, so this costs a pool nothing.) A pointer it did not hand
///   out is passed down unregistered: the upstream judges it.
/// - Several communicators: stack one adaptor per communicator.
/// - `registrations()` / `registered_bytes()`: live now; `registrations_made()`: since
///   construction (what bench/nccl.cu reports per 1,000 allocations).
/// - Destroyed with registrations still live (memory allocated through it and not freed): they
///   are deregistered and reported; the memory stays with the upstream.
/// - Thread-safe, with the communicator caveat of the header's contract.
class nccl_registering_adaptor final : public detail::adaptor_base<nccl_registering_adaptor> {
 public:
  /// Registers with `comm` what it takes from `upstream` (device memory on comm's device, else
  /// std::invalid_argument). `calls` is NCCL itself; tests pass a fake.
  nccl_registering_adaptor(memory_resource& upstream, ncclComm_t comm,
                           const detail::nccl_calls& calls = detail::nccl_library_calls())
      : adaptor_base(upstream), comm_(comm), calls_(&calls) {
    if (comm == nullptr) {
      throw std::invalid_argument("cudamem: nccl_registering_adaptor: null communicator");
    }
    if (upstream.kind() != memory_kind::device) {
      throw std::invalid_argument("cudamem: nccl_registering_adaptor: NCCL registers device "
                                  "memory; the upstream gives " +
                                  std::string(to_string(upstream.kind())) + " memory");
    }
    int comm_device = -1;
    detail::check_nccl_with(calls, calls.comm_device(comm, &comm_device), "ncclCommCuDevice",
                            std::source_location::current());
    if (comm_device != upstream.device()) {
      throw std::invalid_argument(
          "cudamem: nccl_registering_adaptor: the communicator is on device " +
          std::to_string(comm_device) + ", the upstream's memory on device " +
          std::to_string(upstream.device()));
    }
  }

  ~nccl_registering_adaptor() override {
    const detail::lock_guard lock(mutex_);
    if (!live_.empty()) {
      try {
        report_problem("nccl_registering_adaptor destroyed with " +
                       std::to_string(live_.size()) + " registration(s) (" +
                       format_bytes(registered_bytes_) +
                       ") still live: memory allocated through it was not freed; deregistered "
                       "now, the memory stays with the upstream");
      } catch (...) {  // no memory for the text: say less
        report_problem("nccl_registering_adaptor destroyed with registrations still live");
      }
    }
    live_.clear();  // each registration deregisters
  }

  nccl_registering_adaptor(const nccl_registering_adaptor&) = delete;
  nccl_registering_adaptor& operator=(const nccl_registering_adaptor&) = delete;

  /// The communicator it registers with.
  [[nodiscard]] ncclComm_t communicator() const noexcept { return comm_; }
  /// Registrations live now, and their bytes.
  [[nodiscard]] std::size_t registrations() const {
    const detail::lock_guard lock(mutex_);
    return live_.size();
  }
  /// Bytes of the registrations live now.
  [[nodiscard]] std::size_t registered_bytes() const {
    const detail::lock_guard lock(mutex_);
    return registered_bytes_;
  }
  /// Registrations made since construction.
  [[nodiscard]] std::size_t registrations_made() const {
    const detail::lock_guard lock(mutex_);
    return made_;
  }
  /// Whether `p` is the start of an allocation it registered and has not yet freed.
  [[nodiscard]] bool is_registered(const void* p) const {
    const detail::lock_guard lock(mutex_);
    return live_.find(reinterpret_cast<std::uintptr_t>(p)) != live_.end();
  }

 private:
  friend class detail::adaptor_base<nccl_registering_adaptor>;

  void* adapt_allocate(std::size_t bytes, std::size_t alignment, detail::request_stream stream) {
    void* p = forward_allocate(bytes, alignment, stream);
    try {
      nccl_registration registration{comm_, p, bytes, *calls_};
      const detail::lock_guard lock(mutex_);
      // If the map cannot take it, `registration` (or the node it moved into) deregisters.
      live_.emplace(reinterpret_cast<std::uintptr_t>(p), std::move(registration));
      registered_bytes_ += bytes;
      ++made_;
    } catch (...) {
      forward_deallocate(p, bytes, alignment, stream);
      throw;
    }
    return p;
  }

  void adapt_deallocate(void* p, std::size_t bytes, std::size_t alignment,
                        detail::request_stream stream) noexcept {
    nccl_registration registration;
    {
      const detail::lock_guard lock(mutex_);
      const auto it = live_.find(reinterpret_cast<std::uintptr_t>(p));
      if (it != live_.end()) {
        registration = std::move(it->second);
        registered_bytes_ -= registration.bytes();
        live_.erase(it);
      }
    }
    if (registration && stream && device() >= 0) {
      detail::wait_for_stream_before_free(
          *stream, "nccl_registering_adaptor: waiting for the stream before deregistering");
    }
    registration.reset();  // before the memory goes back
    forward_deallocate(p, bytes, alignment, stream);
  }

  std::string_view do_name() const noexcept override { return "nccl_registering_adaptor"; }
  resource_stats do_stats() const override { return upstream_resource().stats(); }

  ncclComm_t comm_;
  const detail::nccl_calls* calls_;
  mutable detail::mutex mutex_;  ///< guards the three below
  std::unordered_map<std::uintptr_t, nccl_registration> live_;
  std::size_t registered_bytes_ = 0;
  std::size_t made_ = 0;
};

/// vm_pool_options for a vm_pool_resource whose memory NCCL can register and use: handles
/// created shareable as POSIX file descriptors (`exportable`, what NCCL asks of cuMem memory),
/// and every pool chunk and every large block registered with `comm` as it leaves the
/// vm_resource, deregistered before it goes back (an nccl_registering_adaptor as the vm_pool's
/// upstream_adaptor). `options` may not have an upstream_adaptor of its own
/// (std::invalid_argument). The vm_pool's device must be the communicator's.
[[nodiscard]] inline vm_pool_options nccl_vm_pool_options(
    ncclComm_t comm, vm_pool_options options = {},
    const detail::nccl_calls& calls = detail::nccl_library_calls()) {
  if (comm == nullptr) {
    throw std::invalid_argument("cudamem: nccl_vm_pool_options: null communicator");
  }
  if (options.upstream_adaptor) {
    throw std::invalid_argument("cudamem: nccl_vm_pool_options: the options already have an "
                                "upstream_adaptor");
  }
  options.exportable = true;
  options.upstream_adaptor = [comm, &calls](vm_resource& vm) -> std::unique_ptr<memory_resource> {
    return std::make_unique<nccl_registering_adaptor>(vm, comm, calls);
  };
  return options;
}

// --- NCCL's allocator as an upstream --------------------------------------------------------

/// Device memory from ncclMemAlloc / ncclMemFree: CUDA virtual memory created the way NCCL
/// wants to register it (shareable handles, the recommended granularity, access for every
/// peer GPU). Each allocation is at least one granule (2 MiB on current GPUs): put a pool
/// over it (through an nccl_registering_adaptor) rather than allocating small buffers here.
///
/// Contract (memory_resource.hpp's, plus)
/// - Kind `device`; the constructor resolves and validates the device (no GPU:
///   `no_device_error`; an id that does not exist: std::out_of_range). Every call runs on it,
///   whatever device is current.
/// - Alignment up to 256 bytes (what every path of ncclMemAlloc guarantees; it falls back to
///   cudaMalloc where CUDA's virtual memory is off); more throws std::invalid_argument.
/// - Out of device memory throws `out_of_memory`, once the process's vm_resources gave back what
///   they held ahead of need on the device and it was tried again (detail/held_ahead.hpp); any
///   other NCCL failure `nccl_error`.
/// - Synchronous like cudaMalloc: the stream-ordered allocate ignores the stream, the
///   stream-ordered deallocate waits for its stream first. A failing ncclMemFree goes to the
///   error handler.
/// - stats(): bytes asked for (ncclMemAlloc rounds each up to a granule).
class nccl_mem_resource final : public memory_resource {
 public:
  /// Memory from ncclMemAlloc on `device` (-1: the current device).
  explicit nccl_mem_resource(int device = -1)
      : memory_resource(memory_kind::device, detail::resolve_device(device)) {}

 private:
  void* do_allocate(std::size_t bytes, std::size_t alignment, stream_view /*stream*/) override {
    return do_allocate_sync(bytes, alignment);
  }

  void* do_allocate_sync(std::size_t bytes, std::size_t alignment) override {
    detail::check_cuda_alignment("nccl_mem_resource", alignment);
    const device_guard on{device()};
    void* p = nullptr;
    ncclResult_t code = ncclMemAlloc(&p, bytes);
    std::size_t given_back = 0;  // by the process's vm_resources (detail/held_ahead.hpp)
    for (bool tried_again = false; code != ncclSuccess; tried_again = true) {
      static_cast<void>(cudaGetLastError());  // the cudaMalloc fallback's error is not sticky
      std::string text =
          detail::describe_nccl(detail::nccl_library_calls(), code, "ncclMemAlloc");
      if (code != ncclUnhandledCudaError || !out_of_device_memory(text, bytes)) {
        throw nccl_error(code, text);
      }
      if (!tried_again) {  // memory held ahead of need gives way, then once more
        given_back = detail::give_back_held_ahead(detail::memory_domain{device(), nullptr});
        if (given_back != 0) {
          code = ncclMemAlloc(&p, bytes);
          continue;
        }
      }
      if (given_back != 0) {
        text += ", tried again after vm_resources gave back " + format_bytes(given_back) +
                " held ahead of need";
      }
      throw_out_of_memory(*this, bytes, alignment, text);
    }
    usage_.add(bytes);
    return p;
  }

  void do_deallocate(void* p, std::size_t bytes, std::size_t alignment,
                     stream_view stream) noexcept override {
    const detail::quiet_device_scope on{device(), "nccl_mem_resource: switching device to free"};
    detail::wait_for_stream_before_free(
        stream, "nccl_mem_resource: waiting for the stream before ncclMemFree");
    do_deallocate_sync(p, bytes, alignment);
  }

  void do_deallocate_sync(void* p, std::size_t bytes, std::size_t /*alignment*/) noexcept override {
    const ncclResult_t code = ncclMemFree(p);  // on the pointer's device, restored by NCCL
    if (code != ncclSuccess) {
      try {
        report_problem(detail::describe_nccl(detail::nccl_library_calls(), code,
                                             "nccl_mem_resource: ncclMemFree"));
      } catch (...) {
        report_problem("nccl_mem_resource: ncclMemFree failed");
      }
    }
    usage_.subtract(bytes);
  }

  /// NCCL reports a failed cuMemCreate or cudaMalloc as ncclUnhandledCudaError; its last
  /// warning names CUDA's error. Out of memory when it says so, or when the device has less
  /// free than was asked.
  [[nodiscard]] bool out_of_device_memory(const std::string& text, std::size_t bytes) const {
    if (text.find("out of memory") != std::string::npos) {
      return true;
    }
    std::size_t free = 0;
    std::size_t total = 0;
    if (cudaMemGetInfo(&free, &total) != cudaSuccess) {
      static_cast<void>(cudaGetLastError());
      return false;
    }
    return bytes > free;
  }

  bool do_is_equal(const memory_resource& other) const noexcept override {
    const auto* same = dynamic_cast<const nccl_mem_resource*>(&other);
    return same != nullptr && same->device() == device();
  }
  std::string_view do_name() const noexcept override { return "nccl_mem_resource"; }
  resource_stats do_stats() const override { return usage_.leaf_stats(); }

  detail::usage_counter usage_;
};

}  // namespace cudamem
