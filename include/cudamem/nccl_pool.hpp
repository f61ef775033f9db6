// cudamem/nccl_pool.hpp — buffers for NCCL collectives from one resource that puts each size
// where NCCL moves it fastest: blocks of registered chunks for the sizes at which NCCL's
// registered path wins, blocks of plain device memory for the others. Optional, like nccl.hpp.
//
//   #include <cudamem/nccl_pool.hpp>
//
//   auto comms = cudamem::nccl_communicator::init_all();       // one per visible GPU
//   cudamem::nccl_pool pool{comms[0].get()};                   // on comms[0]'s device
//   cudamem::device_buffer<float> x(n, s, pool.resource());    // 8-256 MiB: registered
//   cudamem::check_nccl(ncclAllReduce(x.data(), x.data(), n, ncclFloat, ncclSum,
//                                     comms[0].get(), s.get()), "ncclAllReduce");
//
//   cudamem::nccl_pool every_size_registered{comm, {.registered_min_bytes = 0,
//                                                   .registered_max_bytes = SIZE_MAX}};
//
// Why. A buffer NCCL has registered lets it read and write the user's memory directly; an
// unregistered one is copied through NCCL's own buffers. Which is faster depends on the size:
// measured with bench/nccl.cu on two H100s joined by NVLink (NCCL 2.28.3, NVLS off, float
// all-reduce, bus bandwidth), registered buffers (ncclMemAlloc, or a pool's registered chunks)
// were 2-8% faster than cudaMalloc'd ones from 8 MiB to 256 MiB and 3-5% slower at 2-4 MiB
// and at 512 MiB-1 GiB. NCCL picks its path from the buffer, so a pool of registered chunks
// takes the registered path at every size, and loses where it is the slower one. This
// resource splits by size (size_routing_resource.hpp): requests of [registered_min_bytes,
// registered_max_bytes] come from a pool over an nccl_registering_adaptor (chunks registered
// once, as they are made: a handful of registrations for thousands of buffers), the others
// from a pool over plain device memory that NCCL never sees registered. The defaults are that
// measurement; another machine (more ranks, other links, several nodes, another NCCL) may move
// the edges: measure with `./run bench nccl` and set the two options.
//
// Contract (nccl.hpp's, plus)
// - Construction: `comm` non-null (else std::invalid_argument); the device is the
//   communicator's (ncclCommCuDevice). The owning constructor takes its registered memory from
//   ncclMemAlloc (nccl_mem_resource) and its plain memory from cudaMalloc (device_resource);
//   the other takes both upstreams from the caller (they must be device memory of the
//   communicator's device, and outlive the pool). registered_min_bytes > registered_max_bytes
//   throws std::invalid_argument. A constructor that throws leaves nothing registered.
// - resource(): the memory_resource to allocate from. Each block is the registered pool's
//   when its size is in the range, the plain pool's otherwise, and goes back to the same one
//   (chosen again by the size given to deallocate).
// - Registration: every chunk of the registered pool is registered with `comm` as it is made
//   and deregistered before it goes back (release(), destruction); blocks of the plain pool
//   are never registered. registrations_made() counts them (what bench/nccl.cu reports).
// - Lifetimes: the communicator must outlive the pool; destroy every buffer from it first.
//   Thread safety: the pools' (thread-safe), with nccl.hpp's caveat that growing the
//   registered pool, release() and destruction call NCCL on the communicator.
// - Out of memory: the pool that served the size throws its `out_of_memory`, whose report
//   names that branch (registered or plain) and its chain.
// - release(): both pools give back their wholly free chunks (the registered ones
//   deregistered first); returns the bytes.
#pragma once

#include <cudamem/device_resource.hpp>
#include <cudamem/memory_resource.hpp>
#include <cudamem/nccl.hpp>
#include <cudamem/pool_resource.hpp>
#include <cudamem/size_routing_resource.hpp>

#include <cstddef>
#include <optional>
#include <source_location>
#include <stdexcept>
#include <string>
#include <utility>

namespace cudamem {

/// Which sizes an nccl_pool serves from registered memory, and its two pools' options.
struct nccl_pool_options {
  /// Requests of [registered_min_bytes, registered_max_bytes] come from registered chunks;
  /// the defaults are where NCCL's registered path won on two H100s (see the header).
  std::size_t registered_min_bytes = std::size_t{8} << 20;
  std::size_t registered_max_bytes = std::size_t{256} << 20;  ///< (the range's upper end)
  pool_options registered_pool = {};  ///< the pool over registered memory
  pool_options plain_pool = {};       ///< the pool over memory NCCL does not see registered
};

/// Collective buffers from registered or plain pools by size; see the contract above.
class nccl_pool {
 public:
  /// Registered chunks from ncclMemAlloc, plain ones from cudaMalloc, on `comm`'s device.
  explicit nccl_pool(ncclComm_t comm, nccl_pool_options options = {})
      : nccl_pool(comm, nullptr, nullptr, options, detail::nccl_library_calls()) {}

  /// The same over upstreams of the caller's (device memory of the communicator's device):
  /// `registered_upstream` under the registering adaptor, `plain_upstream` under the plain
  /// pool. `calls`: the NCCL calls to make (tests give a fake table).
  nccl_pool(ncclComm_t comm, memory_resource& registered_upstream,
            memory_resource& plain_upstream, nccl_pool_options options = {},
            const detail::nccl_calls& calls = detail::nccl_library_calls())
      : nccl_pool(comm, &registered_upstream, &plain_upstream, options, calls) {}

  nccl_pool(const nccl_pool&) = delete;
  nccl_pool& operator=(const nccl_pool&) = delete;
  ~nccl_pool() = default;  // router, then the pools (chunks deregistered), then the upstreams

  /// What to allocate from.
  [[nodiscard]] memory_resource& resource() noexcept { return router_; }
  /// The pool of registered chunks, and the plain one.
  [[nodiscard]] pool_resource& registered_pool() noexcept { return registered_; }
  /// The pool of plain chunks, for the other sizes.
  [[nodiscard]] pool_resource& plain_pool() noexcept { return plain_; }
  /// The adaptor that registers the registered pool's chunks (its counts).
  [[nodiscard]] const nccl_registering_adaptor& registering() const noexcept {
    return registering_;
  }
  /// Registrations made since construction (one per registered chunk).
  [[nodiscard]] std::size_t registrations_made() const { return registering_.registrations_made(); }
  /// The options it was made with.
  [[nodiscard]] const nccl_pool_options& options() const noexcept { return options_; }
  /// Whether a request of `bytes` is served from registered memory.
  [[nodiscard]] bool serves_registered(std::size_t bytes) const noexcept {
    return router_.routes_in_range(bytes);
  }

  /// Both pools give back their wholly free chunks; returns the bytes.
  std::size_t release() { return registered_.release() + plain_.release(); }

 private:
  /// The upstreams the first constructor makes on the communicator's device.
  struct owned_upstreams {
    explicit owned_upstreams(int device) : nccl_memory(device), device_memory(device) {}
    nccl_mem_resource nccl_memory;
    device_resource device_memory;
  };

  /// Null upstreams: make and own them.
  nccl_pool(ncclComm_t comm, memory_resource* registered_upstream,
            memory_resource* plain_upstream, const nccl_pool_options& options,
            const detail::nccl_calls& calls)
      : options_(checked(comm, options)),
        owned_(owned_if(registered_upstream == nullptr, comm, calls)),
        registering_(registered_upstream != nullptr ? *registered_upstream
                                                    : owned_->nccl_memory,
                     comm, calls),
        registered_(registering_, options_.registered_pool),
        plain_(plain_upstream != nullptr ? *plain_upstream : owned_->device_memory,
               options_.plain_pool),
        router_(registered_, plain_,
                {.min_bytes = options_.registered_min_bytes,
                 .max_bytes = options_.registered_max_bytes}) {}

  static nccl_pool_options checked(ncclComm_t comm, const nccl_pool_options& options) {
    if (comm == nullptr) {
      throw std::invalid_argument("cudamem: nccl_pool: null communicator");
    }
    if (options.registered_min_bytes > options.registered_max_bytes) {
      throw std::invalid_argument(
          "cudamem: nccl_pool: registered_min_bytes (" +
          std::to_string(options.registered_min_bytes) + ") is above registered_max_bytes (" +
          std::to_string(options.registered_max_bytes) + ")");
    }
    return options;
  }

  static std::optional<owned_upstreams> owned_if(bool own, ncclComm_t comm,
                                                 const detail::nccl_calls& calls) {
    if (!own) {
      return std::nullopt;
    }
    int device = -1;
    detail::check_nccl_with(calls, calls.comm_device(comm, &device), "ncclCommCuDevice",
                            std::source_location::current());
    return std::optional<owned_upstreams>(std::in_place, device);
  }

  // Declared in the order they must be made; destroyed in the reverse order.
  nccl_pool_options options_;
  std::optional<owned_upstreams> owned_;
  nccl_registering_adaptor registering_;
  pool_resource registered_;
  pool_resource plain_;
  size_routing_resource router_;
};

}  // namespace cudamem
