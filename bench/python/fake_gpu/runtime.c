/* A pretend one-GPU CUDA runtime, for measuring allocators' host-side cost where there is no GPU.

     python3 bench/python/torch_replay.py LOG --fake-gpu      (builds this and uses it)

   torch_replay.py compiles this file (with the CUDA Toolkit's cuda_runtime_api.h, so every
   signature is checked against the real one) and LD_PRELOADs it: the definitions here take the
   place of libcudart's, so PyTorch sees one device ("Fake GPU", 140 GiB) and its caching
   allocator runs as it would. Memory calls hand out addresses from a counter (no memory is
   behind them: the allocators never touch it); streams and events are counters, and every wait
   or query says "done". cudamem, beside it, runs its C library on a simulated device
   (CUDAMEM_SIMULATE_BYTES). Nothing is ever run on a device.

   What this measures well: the instructions and host time each allocator's own bookkeeping
   takes per call. What it does not: the driver's time (a real cudaMalloc, cudaEventRecord or
   cuMemMap), which these stand-ins make free. Compare allocators under it, not with a GPU. */
#include <cuda_runtime_api.h>

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

static uintptr_t next_address = (uintptr_t)0x7f0000000000ull;  /* bumps by whole MiB */
static uintptr_t next_handle = 0x1000;                          /* streams and events */
static int current_device = 0;
static const size_t total_bytes = (size_t)140 << 30;

static void* new_handle(void) { return (void*)(next_handle++); }

cudaError_t cudaGetDeviceCount(int* count) { *count = 1; return cudaSuccess; }
cudaError_t cudaGetDevice(int* device) { *device = current_device; return cudaSuccess; }
cudaError_t cudaSetDevice(int device) {
  if (device != 0) return cudaErrorInvalidDevice;
  current_device = device;
  return cudaSuccess;
}
cudaError_t cudaDriverGetVersion(int* version) { *version = CUDART_VERSION; return cudaSuccess; }
cudaError_t cudaRuntimeGetVersion(int* version) { *version = CUDART_VERSION; return cudaSuccess; }
cudaError_t cudaGetLastError(void) { return cudaSuccess; }
cudaError_t cudaPeekAtLastError(void) { return cudaSuccess; }
const char* cudaGetErrorString(cudaError_t error) { (void)error; return "fake GPU"; }
const char* cudaGetErrorName(cudaError_t error) { (void)error; return "fakeGpuError"; }

cudaError_t cudaGetDeviceProperties(struct cudaDeviceProp* prop, int device) {
  (void)device;
  memset(prop, 0, sizeof *prop);
  strcpy(prop->name, "Fake GPU");
  prop->totalGlobalMem = total_bytes;
  prop->major = 9;
  prop->minor = 0;
  prop->multiProcessorCount = 132;
  prop->warpSize = 32;
  prop->maxThreadsPerBlock = 1024;
  return cudaSuccess;
}
/* The runtime's header names this entry point cudaGetDeviceProperties (a macro); libraries
   built against it call the _v2 symbol. */
#undef cudaGetDeviceProperties
cudaError_t cudaGetDeviceProperties_v2(struct cudaDeviceProp* prop, int device) {
  return cudaGetDeviceProperties(prop, device);
}
cudaError_t cudaDeviceGetAttribute(int* value, enum cudaDeviceAttr attr, int device) {
  (void)device;
  switch (attr) {
    case cudaDevAttrMultiProcessorCount: *value = 132; break;
    case cudaDevAttrComputeCapabilityMajor: *value = 9; break;
    case cudaDevAttrComputeCapabilityMinor: *value = 0; break;
    default: *value = 1; break;
  }
  return cudaSuccess;
}
cudaError_t cudaDeviceGetPCIBusId(char* bus, int length, int device) {
  snprintf(bus, (size_t)length, "0000:%02x:00.0", device);
  return cudaSuccess;
}
cudaError_t cudaDeviceCanAccessPeer(int* can, int device, int peer) {
  (void)device; (void)peer;
  *can = 0;
  return cudaSuccess;
}
cudaError_t cudaMemGetInfo(size_t* free_bytes, size_t* total) {
  *free_bytes = total_bytes - (size_t)(next_address - (uintptr_t)0x7f0000000000ull) % total_bytes;
  *total = total_bytes;
  return cudaSuccess;
}

cudaError_t cudaMalloc(void** p, size_t bytes) {
  *p = (void*)next_address;
  next_address += (bytes + 0xfffff) & ~(size_t)0xfffff;
  return cudaSuccess;
}
cudaError_t cudaFree(void* p) { (void)p; return cudaSuccess; }
cudaError_t cudaMallocAsync(void** p, size_t bytes, cudaStream_t stream) {
  (void)stream;
  return cudaMalloc(p, bytes);
}
cudaError_t cudaFreeAsync(void* p, cudaStream_t stream) {
  (void)p; (void)stream;
  return cudaSuccess;
}
cudaError_t cudaPointerGetAttributes(struct cudaPointerAttributes* attributes, const void* p) {
  (void)p;
  memset(attributes, 0, sizeof *attributes);
  attributes->type = cudaMemoryTypeDevice;
  return cudaSuccess;
}

cudaError_t cudaStreamCreate(cudaStream_t* stream) { *stream = new_handle(); return cudaSuccess; }
cudaError_t cudaStreamCreateWithFlags(cudaStream_t* stream, unsigned int flags) {
  (void)flags;
  *stream = new_handle();
  return cudaSuccess;
}
cudaError_t cudaStreamCreateWithPriority(cudaStream_t* stream, unsigned int flags, int priority) {
  (void)flags; (void)priority;
  *stream = new_handle();
  return cudaSuccess;
}
cudaError_t cudaStreamDestroy(cudaStream_t stream) { (void)stream; return cudaSuccess; }
cudaError_t cudaStreamSynchronize(cudaStream_t stream) { (void)stream; return cudaSuccess; }
cudaError_t cudaStreamQuery(cudaStream_t stream) { (void)stream; return cudaSuccess; }
cudaError_t cudaStreamWaitEvent(cudaStream_t stream, cudaEvent_t event, unsigned int flags) {
  (void)stream; (void)event; (void)flags;
  return cudaSuccess;
}
cudaError_t cudaStreamGetPriority(cudaStream_t stream, int* priority) {
  (void)stream;
  *priority = 0;
  return cudaSuccess;
}
cudaError_t cudaDeviceGetStreamPriorityRange(int* least, int* greatest) {
  if (least) *least = 0;
  if (greatest) *greatest = -5;
  return cudaSuccess;
}
cudaError_t cudaStreamIsCapturing(cudaStream_t stream, enum cudaStreamCaptureStatus* status) {
  (void)stream;
  *status = cudaStreamCaptureStatusNone;
  return cudaSuccess;
}
cudaError_t cudaThreadExchangeStreamCaptureMode(enum cudaStreamCaptureMode* mode) {
  (void)mode;
  return cudaSuccess;
}
cudaError_t cudaDeviceSynchronize(void) { return cudaSuccess; }

cudaError_t cudaEventCreate(cudaEvent_t* event) { *event = new_handle(); return cudaSuccess; }
cudaError_t cudaEventCreateWithFlags(cudaEvent_t* event, unsigned int flags) {
  (void)flags;
  *event = new_handle();
  return cudaSuccess;
}
cudaError_t cudaEventDestroy(cudaEvent_t event) { (void)event; return cudaSuccess; }
cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t stream) {
  (void)event; (void)stream;
  return cudaSuccess;
}
cudaError_t cudaEventRecordWithFlags(cudaEvent_t event, cudaStream_t stream, unsigned int flags) {
  (void)event; (void)stream; (void)flags;
  return cudaSuccess;
}
cudaError_t cudaEventQuery(cudaEvent_t event) { (void)event; return cudaSuccess; }
cudaError_t cudaEventSynchronize(cudaEvent_t event) { (void)event; return cudaSuccess; }
