// cudamem/detail/interop/device_accessible.hpp — the check every interop entry point makes
// before it hands a resource's memory to kernels (thrust, CUB, CCCL): one message, one place.
#pragma once

#include <cudamem/memory_resource.hpp>

#include <stdexcept>
#include <string>

namespace cudamem::detail {

/// `mr`, or std::invalid_argument (naming `who`, the resource and its kind) when kernels cannot
/// use its memory.
inline memory_resource& require_device_accessible(memory_resource& mr, const char* who) {
  if (!is_device_accessible(mr.kind())) {
    throw std::invalid_argument(std::string("cudamem: ") + who +
                                " needs device-accessible memory, but " + std::string(mr.name()) +
                                " gives " + std::string(to_string(mr.kind())) + " memory");
  }
  return mr;
}

}  // namespace cudamem::detail
