// cudamem/detail/report/holders.hpp — who holds the device's memory, asked when a report is
// made on a real device: the processes using it and how much each holds, from NVML (the
// driver's management library, loaded at run time: detail/nvml/nvml.hpp; when it cannot say,
// why, in one plain sentence), and what this process's CUDA context reserves for kernels, from
// the runtime's limits. They fill in figures.hpp's device_holders and context_reservations.
//
// Part of memory_report.hpp: only making a report needs it (make_memory_report,
// throw_out_of_memory), not carrying or reading one, so out_of_memory.hpp does not include it.
#pragma once

#include <cudamem/detail/nvml/nvml.hpp>
#include <cudamem/detail/report/figures.hpp>

#include <cuda_runtime_api.h>

#include <cstddef>
#include <optional>
#include <utility>

namespace cudamem::detail {

/// Who holds the memory of CUDA device `device` (current already), from NVML.
inline device_holders find_holders(int device) {
  device_holders h;
  h.this_pid = nvml::this_process_id();
  char bus_id[64] = {};
  if (cudaDeviceGetPCIBusId(bus_id, static_cast<int>(sizeof bus_id), device) != cudaSuccess) {
    static_cast<void>(cudaGetLastError());
    h.reason = "the device's PCI bus id is not known (cudaDeviceGetPCIBusId failed)";
    return h;
  }
  nvml::device_processes found = nvml::list_processes(nvml::process_library(), bus_id, h.this_pid);
  h.listed = found.status == nvml::listing::listed;
  h.reason = std::move(found.reason);
  for (nvml::process_usage& p : found.processes) {
    if (h.listed && p.pid == h.this_pid) {
      h.this_process = p.bytes;
    } else {
      h.others.push_back({p.pid, std::move(p.name), p.bytes});
    }
  }
  return h;
}

/// What the context on the current device reserves for kernels (memory_report.hpp's contract).
inline std::optional<context_reservations> find_context_reservations(int device) {
  context_reservations c;
  std::size_t stack = 0;
  std::size_t heap = 0;
  std::size_t fifo = 0;
  int sms = 0;
  int per_sm = 0;
  if (cudaDeviceGetLimit(&stack, cudaLimitStackSize) != cudaSuccess ||
      cudaDeviceGetLimit(&heap, cudaLimitMallocHeapSize) != cudaSuccess ||
      cudaDeviceGetLimit(&fifo, cudaLimitPrintfFifoSize) != cudaSuccess ||
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&per_sm, cudaDevAttrMaxThreadsPerMultiProcessor, device) !=
          cudaSuccess) {
    static_cast<void>(cudaGetLastError());
    return std::nullopt;
  }
  c.stack_per_thread = stack;
  c.threads = static_cast<std::size_t>(sms) * static_cast<std::size_t>(per_sm);
  c.heap_bytes = heap;
  c.printf_bytes = fifo;
  return c;
}

}  // namespace cudamem::detail
