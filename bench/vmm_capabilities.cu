// bench/vmm_capabilities.cu — what this machine's GPUs can share, and how: the facts that decide
// how cudamem memory reaches other processes and other nodes (docs/multi_node.md). Not a
// timing: one line per fact, for the record.
//
//   ./run bench vmm_capabilities         (or build-*/bench/bench_vmm_capabilities)
//
// Per device: virtual memory management; the shareable handle types the driver advertises for
// cuMemCreate (POSIX file descriptor, fabric) and for memory pools; and whether a 2 MiB
// allocation with each handle type can really be created and exported here (a fabric handle
// also needs an IMEX channel, /dev/nvidia-caps-imex-channels, which the attribute does not
// say). Per pair of devices: cudaDeviceCanAccessPeer both ways, and the P2P attributes
// (performance rank, native atomics). Nothing here touches NVLink multicast. With no GPU it
// prints one line and exits 69.
#include <cudamem/detail/cuda/driver.hpp>
#include <cudamem/device.hpp>
#include <cudamem/error.hpp>
#include <cudamem/peer_access.hpp>

#include <cuda.h>
#include <cuda_runtime_api.h>

#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <string>

namespace {

const char* yes_no(bool b) { return b ? "yes" : "no"; }

int attribute(CUdevice device, CUdevice_attribute which) {
  int value = 0;
  cudamem::detail::check_driver(cudamem::detail::driver().device_get_attribute(&value, which, device),
                                "cuDeviceGetAttribute");
  return value;
}

/// Creates a 2 MiB allocation that asks for `type`, exports it, closes and releases it.
/// Returns "ok" or what the driver said at the step that failed.
std::string try_export(int ordinal, CUmemAllocationHandleType type) {
  const auto& cu = cudamem::detail::driver();
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = ordinal;
  prop.requestedHandleTypes = type;
  std::size_t granularity = 0;
  CUresult r = cu.mem_get_allocation_granularity(&granularity, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM);
  if (r != CUDA_SUCCESS) {
    return "cuMemGetAllocationGranularity: " + cudamem::detail::driver_result_name(r);
  }
  CUmemGenericAllocationHandle handle = 0;
  r = cu.mem_create(&handle, granularity, &prop, 0);
  if (r != CUDA_SUCCESS) {
    return "cuMemCreate: " + cudamem::detail::driver_result_name(r);
  }
  std::string verdict = "ok (created and exported)";
  if (type == CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) {
    int fd = -1;
    r = cu.mem_export_to_shareable_handle(&fd, handle, type, 0);
    if (r == CUDA_SUCCESS) {
      ::close(fd);
    }
  } else {
    CUmemFabricHandle fabric{};
    r = cu.mem_export_to_shareable_handle(&fabric, handle, type, 0);
  }
  if (r != CUDA_SUCCESS) {
    verdict = "created; cuMemExportToShareableHandle: " + cudamem::detail::driver_result_name(r);
  }
  cudamem::detail::report_driver_error(cu.mem_release(handle), "cuMemRelease");
  return verdict;
}

}  // namespace

int main() try {
  const int devices = cudamem::device_count();
  if (devices == 0) {
    std::printf("SKIPPED: no CUDA device: bench_vmm_capabilities needs a GPU\n");
    return 69;
  }
  const auto& cu = cudamem::detail::driver();
  int driver_version = 0;
  cudamem::detail::check_driver(cu.driver_get_version(&driver_version), "cuDriverGetVersion");
  struct stat imex {};
  const bool imex_channels = ::stat("/dev/nvidia-caps-imex-channels", &imex) == 0;
  std::printf("vmm_capabilities: %d device(s), driver API %d.%d, runtime %d; IMEX channel "
              "directory /dev/nvidia-caps-imex-channels: %s\n",
              devices, driver_version / 1000, (driver_version % 1000) / 10, CUDART_VERSION,
              imex_channels ? "present" : "absent");
  for (int d = 0; d < devices; ++d) {
    const auto props = cudamem::get_device_properties(d);
    CUdevice device = 0;
    cudamem::detail::check_driver(cu.device_get(&device, d), "cuDeviceGet");
    cudamem::check(cudaSetDevice(d));
    cudamem::check(cudaFree(nullptr));  // the primary context, for cuMemCreate
    int pool_types = 0;
    cudamem::check(cudaDeviceGetAttribute(&pool_types, cudaDevAttrMemoryPoolSupportedHandleTypes, d));
    std::printf("\ndevice %d: %s (sm_%d%d)\n", d, props.name.c_str(), props.major, props.minor);
    std::printf("  virtual memory management:            %s\n",
                yes_no(attribute(device, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED) != 0));
    std::printf("  POSIX fd handles (attribute):         %s\n",
                yes_no(attribute(device, CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED) != 0));
    std::printf("  POSIX fd handles (tried):             %s\n",
                try_export(d, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR).c_str());
    std::printf("  fabric handles (attribute):           %s\n",
                yes_no(attribute(device, CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED) != 0));
    std::printf("  fabric handles (tried):               %s\n",
                try_export(d, CU_MEM_HANDLE_TYPE_FABRIC).c_str());
    std::printf("  memory pools export POSIX fd:         %s\n",
                yes_no((pool_types & cudaMemHandleTypePosixFileDescriptor) != 0));
    std::printf("  memory pools export fabric handles:   %s\n",
                yes_no((pool_types & cudaMemHandleTypeFabric) != 0));
    std::printf("  GPUDirect RDMA with VMM allocations:  %s\n",
                yes_no(attribute(device, CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED) != 0));
  }
  std::printf("\npeer access (row can access column; rank: lower is faster; atomics: native)\n");
  for (int a = 0; a < devices; ++a) {
    for (int b = 0; b < devices; ++b) {
      if (a == b) {
        continue;
      }
      int rank = 0;
      int atomics = 0;
      cudamem::check(cudaDeviceGetP2PAttribute(&rank, cudaDevP2PAttrPerformanceRank, a, b));
      cudamem::check(cudaDeviceGetP2PAttribute(&atomics, cudaDevP2PAttrNativeAtomicSupported, a, b));
      std::printf("  %d -> %d: %s (rank %d, atomics %s)\n", a, b,
                  yes_no(cudamem::can_access_peer(a, b)), rank, yes_no(atomics != 0));
    }
  }
  if (devices == 1) {
    std::printf("  (one device: no pairs)\n");
  }
  return 0;
} catch (const cudamem::no_device_error& e) {
  std::printf("SKIPPED: %s\n", e.what());
  return 69;
}
