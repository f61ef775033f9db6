// cudamem/detail/nccl/communicator.hpp — `nccl_communicator`, the owner of an ncclComm_t:
// ncclCommDestroy when it goes (with the communicator's device current), move-only, and
// `init_all` for one process that drives several GPUs (ncclCommInitAll, with the devices
// checked before NCCL is called).
//
//   auto comms = cudamem::nccl_communicator::init_all();   // one per visible GPU
//   int device = comms[0].device(), rank = comms[0].rank(), ranks = comms[0].size();
//   ncclComm_t raw = comms[0].get();                        // for NCCL's collectives
//
// Part of nccl.hpp, whose contract gives the lifetimes (a communicator outlives every
// registration made with it) and the threading rules.
#pragma once

#include <cudamem/detail/nccl/calls.hpp>
#include <cudamem/device.hpp>
#include <cudamem/error.hpp>

#include <nccl.h>

#include <algorithm>
#include <cstddef>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace cudamem {

// --- communicators --------------------------------------------------------------------------

/// Owns an ncclComm_t: ncclCommDestroy when it goes. Move-only.
class nccl_communicator {
 public:
  nccl_communicator() noexcept = default;
  /// Takes ownership of `comm` (may be null: an empty owner).
  explicit nccl_communicator(ncclComm_t comm) noexcept : comm_(comm) {}
  ~nccl_communicator() { reset(); }

  /// Takes `other`'s communicator; `other` is left empty.
  nccl_communicator(nccl_communicator&& other) noexcept
      : comm_(std::exchange(other.comm_, nullptr)) {}
  /// Destroys the communicator held, then takes `other`'s.
  nccl_communicator& operator=(nccl_communicator&& other) noexcept {
    if (this != &other) {
      reset();
      comm_ = std::exchange(other.comm_, nullptr);
    }
    return *this;
  }
  nccl_communicator(const nccl_communicator&) = delete;
  nccl_communicator& operator=(const nccl_communicator&) = delete;

  /// One communicator per device in `devices`, rank i on devices[i], for one process that
  /// drives them all (ncclCommInitAll). Empty `devices`: every visible device. A device that
  /// does not exist throws std::out_of_range, one listed twice std::invalid_argument (before
  /// NCCL is called); NCCL's failures throw nccl_error.
  [[nodiscard]] static std::vector<nccl_communicator> init_all(std::span<const int> devices = {}) {
    std::vector<int> list(devices.begin(), devices.end());
    if (list.empty()) {
      const int count = device_count();
      if (count == 0) {
        throw no_device_error(cudaErrorNoDevice, "nccl_communicator::init_all");
      }
      for (int d = 0; d < count; ++d) {
        list.push_back(d);
      }
    }
    for (std::size_t i = 0; i < list.size(); ++i) {
      validate_device(list[i]);
      if (std::find(list.begin(), list.begin() + static_cast<std::ptrdiff_t>(i), list[i]) !=
          list.begin() + static_cast<std::ptrdiff_t>(i)) {
        throw std::invalid_argument("cudamem: nccl_communicator::init_all: device " +
                                    std::to_string(list[i]) + " is listed twice");
      }
    }
    std::vector<ncclComm_t> raw(list.size(), nullptr);
    std::vector<nccl_communicator> owners;
    owners.reserve(list.size());  // nothing below throws once NCCL has made them
    const detail::nccl_device_scope keep{current_device()};  // restored afterwards
    check_nccl(ncclCommInitAll(raw.data(), static_cast<int>(raw.size()), list.data()),
               "ncclCommInitAll");
    for (ncclComm_t c : raw) {
      owners.emplace_back(c);
    }
    return owners;
  }

  /// The communicator, for NCCL calls; null when empty.
  [[nodiscard]] ncclComm_t get() const noexcept { return comm_; }
  /// Whether it holds a communicator.
  explicit operator bool() const noexcept { return comm_ != nullptr; }

  /// The communicator's CUDA device (ncclCommCuDevice).
  [[nodiscard]] int device() const { return query(&ncclCommCuDevice, "ncclCommCuDevice"); }
  /// Its rank (ncclCommUserRank) and the number of ranks (ncclCommCount).
  [[nodiscard]] int rank() const { return query(&ncclCommUserRank, "ncclCommUserRank"); }
  /// The number of ranks (ncclCommCount).
  [[nodiscard]] int size() const { return query(&ncclCommCount, "ncclCommCount"); }

  /// Destroys the communicator now (ncclCommDestroy); a failure goes to the error handler.
  void reset() noexcept {
    if (comm_ == nullptr) {
      return;
    }
    int device = -1;
    if (ncclCommCuDevice(comm_, &device) != ncclSuccess) {
      device = -1;
    }
    const detail::nccl_device_scope on{device};
    const ncclResult_t code = ncclCommDestroy(comm_);
    comm_ = nullptr;
    if (code != ncclSuccess) {
      try {
        report_problem(detail::describe_nccl(detail::nccl_library_calls(), code,
                                             "nccl_communicator: ncclCommDestroy"));
      } catch (...) {  // no memory for the text: say less
        report_problem("nccl_communicator: ncclCommDestroy failed");
      }
    }
  }
  /// Gives up ownership; the caller destroys the communicator.
  [[nodiscard]] ncclComm_t release() noexcept { return std::exchange(comm_, nullptr); }

 private:
  int query(ncclResult_t (*call)(ncclComm_t, int*), std::string_view what) const {
    if (comm_ == nullptr) {
      throw std::invalid_argument("cudamem: nccl_communicator: empty (no communicator)");
    }
    int value = 0;
    check_nccl(call(comm_, &value), what);
    return value;
  }

  ncclComm_t comm_ = nullptr;
};

}  // namespace cudamem
