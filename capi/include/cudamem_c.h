/* cudamem_c.h — cudamem's memory resources behind a C ABI, for languages and frameworks that
 * load a shared library: PyTorch (torch.cuda.memory.CUDAPluggableAllocator), CuPy, ctypes, C.
 *
 *   #include <cudamem_c.h>
 *
 *   int id = 0;
 *   if (cudamem_allocator_create("resource=vm_pool, limit_bytes=8GiB", &id) != CUDAMEM_OK) {
 *     fprintf(stderr, "%s\n", cudamem_last_error());      // why, in one sentence
 *   }
 *   void* p = NULL;
 *   if (cudamem_allocate(id, 1 << 20, 0, stream, &p) == CUDAMEM_ERROR_OUT_OF_MEMORY) {
 *     fprintf(stderr, "%s\n", cudamem_last_error());      // cudamem's full report
 *   }
 *   cudamem_deallocate(id, p, 1 << 20, 0, stream);
 *
 *   // PyTorch, before its first CUDA allocation (the Python package does this for you):
 *   //   torch.cuda.memory.change_current_allocator(torch.cuda.memory.CUDAPluggableAllocator(
 *   //       "libcudamem_c.so", "cudamem_torch_malloc", "cudamem_torch_free"))
 *
 * Allocators. An allocator is a configuration and, per device, a stack of resources made on
 * that device's first allocation: the resource chosen (`vm_pool`, `pool` over cudaMalloc, or
 * `async`, a cudaMallocAsync pool), a byte budget over it if asked (`limit_bytes`), and a
 * statistics adaptor on top. Allocator 0 is the process-wide one, configured by environment
 * variables and by cudamem_allocator_configure(0, ...); cudamem_allocator_create makes others
 * (at most CUDAMEM_MAX_ALLOCATORS in all, PyTorch's entry points exist for each).
 *
 * Configuration is text: "key=value" pairs separated by commas. Keys:
 *   resource            vm_pool (default) | pool | async
 *   limit_bytes         a byte budget for each device's stack (a size, see below)
 *   grow_ahead_bytes    vm_pool: most memory to make ahead of need (0: never); default 4 GiB
 *   handle_bytes        vm_pool: size of a physical handle (a multiple of 2 MiB; default
 *                       4 MiB: tensors waste less than with vm_resource's 64 MiB)
 *   keep_free_bytes     vm_pool: device memory its growth leaves free for the rest of the
 *                       process while recycling its own free memory can serve a request
 *                       (0: grow while the device has room); default 1 GiB
 *   bulk_handle_bytes   vm_pool: blocks of a whole multiple of this size get handles this big
 *                       (0: none; else a multiple of handle_bytes larger than it); default
 *                       32 MiB where handle_bytes divides it: a 128 MiB tensor made from
 *                       freed memory moves 4 handles, not 32 (the driver's cuMemSetAccess
 *                       costs ~34 us per handle)
 *   recent_frees        vm_pool: how many of the last blocks of a handle or more freed are kept
 *                       aside for the next request of their size on their stream (0: none;
 *                       at most 256; default 16): such a request skips the search of free
 *                       memory (vm_resource.hpp: recent frees)
 *   simulate_bytes      tests: a pretend device of this size, no GPU touched (vm_pool, pool)
 *   raise_on_oom        torch entry points: 1 (default) throw at a failed allocation; 0 return
 *                       null (what torch.cuda.MemPool's caching allocator expects)
 * Sizes are integers of bytes with an optional unit: 512, 64KiB, 2MiB, 8GiB, 1TiB (also K, M,
 * G, T, as powers of 1024). Environment variables CUDAMEM_<KEY> (CUDAMEM_RESOURCE,
 * CUDAMEM_LIMIT_BYTES, ...) configure allocator 0 and are read when it is first touched; an
 * explicit configure call overrides them key by key. A bad value, an unknown key, or a key that
 * does not apply to the resource is refused with CUDAMEM_ERROR_INVALID_ARGUMENT and a message
 * naming it (an environment variable's name too), never ignored.
 *
 * Contract
 * - No function declared here throws, except the PyTorch entry points (cudamem_torch_*), which
 *   are called by PyTorch's C++ code, not by C: cudamem_torch_malloc throws at a failed
 *   allocation (raise_on_oom=1) so that the tensor's allocation raises. It throws what the
 *   registered thrower throws (cudamem_set_torch_oom_thrower: the Python package registers one
 *   that throws c10::OutOfMemoryError, which PyTorch raises as torch.OutOfMemoryError), else a
 *   std::bad_alloc whose what() is the report (PyTorch raises it as RuntimeError). Other errors
 *   (a bad configuration, a CUDA error) throw std::runtime_error with the message.
 * - Every other function returns a cudamem_status; on failure cudamem_last_error() holds the
 *   message (per thread, valid until this thread's next call into the library).
 * - Configuration is fixed at an allocator's first allocation: configure afterwards fails with
 *   CUDAMEM_ERROR_STATE. Stacks are made per device on first use and live until
 *   cudamem_allocator_destroy (allocator 0: for the life of the process, so that memory freed
 *   by other libraries' destructors at exit still has a home).
 * - Stream order: memory from cudamem_allocate(..., stream, ...) is usable by work on `stream`;
 *   cudamem_deallocate(..., stream) says the last use was submitted to `stream` (the resource
 *   keeps other streams away until that work is done). cudamem_record_stream(p, s) adds a
 *   stream that also uses p: its free then waits, without blocking any stream, until the work
 *   submitted to s before the free has finished (PyTorch's Tensor.record_stream).
 * - Thread-safe: allocate, deallocate, record_stream, stats and report may be called from any
 *   thread at once. create/configure/destroy are serialised; destroy must not race a use.
 * - Out of memory: before failing, an allocation waits for frees held back by record_stream
 *   and tries again; then the message is cudamem's report (who holds the device, the verdict,
 *   advice), for the chain of that device.
 */
#ifndef CUDAMEM_C_H
#define CUDAMEM_C_H

#include <stddef.h>
#include <stdint.h>

#if defined(_WIN32)
#define CUDAMEM_C_API __declspec(dllexport)
#else
#define CUDAMEM_C_API __attribute__((visibility("default")))
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* A CUDA stream (cudaStream_t), passed through untouched; NULL is the legacy default stream. */
typedef void* cudamem_stream_t;

#define CUDAMEM_MAX_ALLOCATORS 16

typedef enum cudamem_status {
  CUDAMEM_OK = 0,
  CUDAMEM_ERROR_INVALID_ARGUMENT = 1, /* a bad configuration, id, device, alignment, pointer */
  CUDAMEM_ERROR_OUT_OF_MEMORY = 2,    /* the message is cudamem's report */
  CUDAMEM_ERROR_STATE = 3,            /* e.g. configured after the first allocation */
  CUDAMEM_ERROR_NO_DEVICE = 4,        /* no usable CUDA device (none, driver too old) */
  CUDAMEM_ERROR_CUDA = 5,             /* another CUDA error */
  CUDAMEM_ERROR_INTERNAL = 6          /* anything else (host memory exhausted, ...) */
} cudamem_status;

/* What one device's stack of an allocator holds. Set struct_size to sizeof(cudamem_stats)
 * before the call: fields added later are filled only for callers that know them. */
typedef struct cudamem_stats {
  size_t struct_size;
  int32_t device;
  int32_t stack_exists;        /* 0: nothing allocated on this device yet (all below are 0) */
  uint64_t in_use_bytes;       /* handed out and not yet freed (bytes asked for) */
  uint64_t peak_in_use_bytes;  /* the most in_use_bytes has been */
  uint64_t reserved_bytes;     /* held from the device by the resource */
  uint64_t largest_free_block; /* the largest block free in what it holds; UINT64_MAX: unknown */
  uint64_t held_ahead_bytes;   /* vm_pool: made ahead of need and not used yet */
  uint64_t allocations;        /* successful allocations */
  uint64_t deallocations;
  uint64_t allocated_bytes;    /* total of all allocations */
  uint64_t pending_frees;      /* frees waiting for streams given to record_stream */
  uint64_t limit_bytes;        /* the budget; 0: none */
  /* Added in 0.2 (callers with an older struct_size do not get these): */
  uint64_t peak_reserved_bytes; /* the most reserved_bytes has been since the stack was made or
                                   cudamem_reset_peak_reserved */
  uint64_t segments;            /* address ranges held from the device (cudamem_segments):
                                   vm_pool mapped ranges, pool chunks; 0 for async */
  uint64_t device_allocations;  /* vm_pool: physical handles created (cuMemCreate) */
  uint64_t device_frees;        /* vm_pool: physical handles given back (cuMemRelease) */
  uint64_t device_allocated_bytes; /* vm_pool: the bytes of device_allocations */
  uint64_t device_freed_bytes;     /* vm_pool: the bytes of device_frees */
  /* Where a loop's host time can go, counted since the stack was made (pool and vm_pool; 0
   * for async): */
  uint64_t compactions;           /* vm_pool: free handles mapped again together to serve a
                                     request; each waits on the host for the streams whose
                                     frees cover them (not the request's own stream) and pays
                                     the driver per handle */
  uint64_t kept_free_compactions; /* vm_pool: of compactions, those chosen over growth so that
                                     the device keeps keep_free_bytes free */
  uint64_t stream_waits;          /* cudaStreamWaitEvent the pool inserted (a block freed on
                                     another stream, not yet known complete) */
  uint64_t host_waits;            /* cudaEventSynchronize the pool made (a request with no
                                     stream, for such a block) */
  uint64_t device_syncs;          /* cudaDeviceSynchronize the pool made (before giving back
                                     memory with frees still pending) */
  /* Added with bulk blocks (callers with an older struct_size do not get it): */
  uint64_t bulk_declined;         /* vm_pool with bulk_handle_bytes: blocks of a whole multiple
                                     of it that the bulk handles could not serve without growing
                                     into keep_free_bytes, asked of the other handles instead */
  /* Added with recent frees (callers with an older struct_size do not get it): */
  uint64_t recent_reuses;         /* vm_pool: allocations served by a block of their size freed
                                     on their stream and kept aside (recent_frees), without a
                                     search of free memory */
} cudamem_stats;

/* An address range held from the device: a vm_pool's mapped range, a pool's chunk. */
typedef struct cudamem_segment {
  uint64_t address;
  uint64_t bytes;
} cudamem_segment;

/* The library's version, "MAJOR.MINOR.PATCH". */
CUDAMEM_C_API const char* cudamem_version(void);

/* Why this thread's last failed call failed ("" if none). */
CUDAMEM_C_API const char* cudamem_last_error(void);

/* The calling thread's current CUDA device into *out (cudaGetDevice: the device of the context
 * current on the thread, which PyTorch, CuPy and Numba each make current, else the one chosen
 * by cudaSetDevice, else 0). No usable device: CUDAMEM_ERROR_NO_DEVICE. Creates no context. */
CUDAMEM_C_API cudamem_status cudamem_current_device(int* out);

/* A new allocator with `config` (may be NULL or ""); its id (1..CUDAMEM_MAX_ALLOCATORS-1) in
 * *out_id. Environment variables do not apply to it. */
CUDAMEM_C_API cudamem_status cudamem_allocator_create(const char* config, int* out_id);

/* Sets keys of allocator `id` before its first allocation (0: the process-wide one). */
CUDAMEM_C_API cudamem_status cudamem_allocator_configure(int id, const char* config);

/* The configuration in force (every key, defaults included) as "key=value, ..." into buf;
 * *needed gets the length with the terminating zero (call with buf NULL to ask). */
CUDAMEM_C_API cudamem_status cudamem_allocator_describe(int id, char* buf, size_t size,
                                                        size_t* needed);

/* Destroys allocator `id` (not 0) and its stacks; refused while anything is allocated. */
CUDAMEM_C_API cudamem_status cudamem_allocator_destroy(int id);

/* `bytes` on `device`, usable in stream order on `stream`, aligned to 256 bytes. 0 bytes gives
 * NULL and succeeds. */
CUDAMEM_C_API cudamem_status cudamem_allocate(int id, size_t bytes, int device,
                                              cudamem_stream_t stream, void** out);

/* Frees what cudamem_allocate gave, with the same bytes and device; NULL is a no-op. A pointer
 * the allocator never gave out (or a size other than the one allocated) is refused: nothing is
 * freed, CUDAMEM_ERROR_INVALID_ARGUMENT says why. The statistics count a free before the
 * resource checks it, so in_use_bytes is then low by that size; what the resource holds, and
 * destroy's check, are not affected. */
CUDAMEM_C_API cudamem_status cudamem_deallocate(int id, void* p, size_t bytes, int device,
                                                cudamem_stream_t stream);

/* `stream` also uses the block at p (see the contract). */
CUDAMEM_C_API cudamem_status cudamem_record_stream(int id, void* p, cudamem_stream_t stream);

/* Before a stream is captured into a CUDA graph (PyTorch's beginAllocateToPool calls it): every
 * cudamem pool of the process records an event on each stream it owes one on (streams being
 * captured excepted), so that blocks freed there before the capture can go to other streams
 * during it, where no event may be recorded on the captured stream. A CUDA error gives
 * CUDAMEM_ERROR_INTERNAL with its message; nothing is left half done that a retry cannot do. */
CUDAMEM_C_API cudamem_status cudamem_prepare_for_graph_capture(void);

/* Gives wholly free memory of `device` (-1: every device) back to the driver, after frees held
 * back by record_stream have finished; *released_bytes (may be NULL) gets the bytes. */
CUDAMEM_C_API cudamem_status cudamem_release(int id, int device, uint64_t* released_bytes);

/* What `device`'s stack holds (see cudamem_stats). */
CUDAMEM_C_API cudamem_status cudamem_get_stats(int id, int device, cudamem_stats* out);

/* Starts `device`'s peak_reserved_bytes again from what is reserved now. */
CUDAMEM_C_API cudamem_status cudamem_reset_peak_reserved(int id, int device);

/* What `device`'s stack holds from the device, by address: up to `capacity` ranges into
 * `out`; *count gets how many there are (call with out NULL to ask). None before the stack's
 * first allocation. resource=async cannot tell: CUDAMEM_ERROR_STATE. */
CUDAMEM_C_API cudamem_status cudamem_segments(int id, int device, cudamem_segment* out,
                                              size_t capacity, size_t* count);

/* Gives device `peer` read-write access to `device`'s memory in allocator `id`, what it
 * holds now and what it maps later: what peer access means for virtual memory (PyTorch's copies
 * between GPUs need it; cudaDeviceEnablePeerAccess covers cudaMalloc'd memory only, and the
 * caller enables that itself). Before the device's first allocation it is remembered. A device
 * with no peer path to `device`: CUDAMEM_ERROR_INVALID_ARGUMENT. */
CUDAMEM_C_API cudamem_status cudamem_add_peer(int id, int device, int peer);

/* --- Memory shared with other processes (Linux), in PyTorch's CUDA IPC form --------------
 * The exporter keeps the fds open while the memory must stay mappable (PyTorch: while the
 * tensor lives, which it keeps until every receiver has let go); a receiver takes them with
 * pidfd_getfd (it needs the exporter alive, and permission to trace it). */
#define CUDAMEM_IPC_VMM 1         /* physical handles as POSIX file descriptors */
#define CUDAMEM_IPC_CUDA_MALLOC 2 /* a cudaIpcMemHandle_t of the chunk the memory lies in */

typedef struct cudamem_ipc_export {
  size_t struct_size;
  int32_t kind;                      /* CUDAMEM_IPC_VMM or CUDAMEM_IPC_CUDA_MALLOC */
  uint64_t offset;                   /* from the start of what is shared to p */
  uint64_t handle_bytes;             /* VMM: each handle's size */
  unsigned char ipc_mem_handle[64];  /* CUDA_MALLOC: the cudaIpcMemHandle_t */
} cudamem_ipc_export;

/* The memory under [p, p + bytes) of `device`'s stack in a shareable form. VMM: the handles'
 * fds into fds[0 .. *fd_count) (the caller closes them; fd_capacity too small:
 * CUDAMEM_ERROR_INVALID_ARGUMENT and *fd_count says how many are needed). resource=async, or
 * a device that cannot export: CUDAMEM_ERROR_STATE with the reason. */
CUDAMEM_C_API cudamem_status cudamem_ipc_export_range(int id, int device, const void* p,
                                                      size_t bytes, cudamem_ipc_export* out,
                                                      int* fds, size_t fd_capacity,
                                                      size_t* fd_count);

/* Maps, on `device`, handles another process exported: `fds` are fd numbers in process `pid`,
 * each of `handle_bytes`; they are mapped side by side from *base. */
CUDAMEM_C_API cudamem_status cudamem_ipc_import(int device, int32_t pid, const int* fds,
                                                size_t count, uint64_t handle_bytes,
                                                void** base);
/* Gives `peer` access to an imported range too. */
CUDAMEM_C_API cudamem_status cudamem_ipc_add_peer(void* base, int peer);
/* Unmaps an imported range, after waiting for the devices that could use it. */
CUDAMEM_C_API cudamem_status cudamem_ipc_unmap(void* base);

/* cudamem's memory report for `device`'s stack as text (a request of `bytes`, 0 for none):
 * who holds the device, what each resource holds, a verdict. As cudamem_allocator_describe. */
CUDAMEM_C_API cudamem_status cudamem_report(int id, int device, uint64_t bytes, char* buf,
                                            size_t size, size_t* needed);

/* The last out-of-memory report of allocator `id` (any device), as cudamem_report; "" if none. */
CUDAMEM_C_API cudamem_status cudamem_last_oom_report(int id, char* buf, size_t size,
                                                     size_t* needed);

/* --- PyTorch (CUDAPluggableAllocator) -------------------------------------------------------
 * cudamem_torch_malloc / _free / _record_stream / _empty_cache serve allocator 0; the same
 * functions suffixed _1 ... _15 serve allocators 1..15 (for torch.cuda.MemPool). Their
 * signatures are PyTorch's: malloc(size, device, stream), free(ptr, size, device, stream),
 * record_stream(ptr, stream), empty_cache(). See the contract for what malloc throws. */
#define CUDAMEM_C_TORCH_ENTRY_POINTS(suffix)                                                   \
  CUDAMEM_C_API void* cudamem_torch_malloc##suffix(size_t size, int device,                    \
                                                   cudamem_stream_t stream);                   \
  CUDAMEM_C_API void cudamem_torch_free##suffix(void* p, size_t size, int device,             \
                                                cudamem_stream_t stream);                      \
  CUDAMEM_C_API void cudamem_torch_record_stream##suffix(void* p, cudamem_stream_t stream);   \
  CUDAMEM_C_API void cudamem_torch_empty_cache##suffix(void);
CUDAMEM_C_TORCH_ENTRY_POINTS()
CUDAMEM_C_TORCH_ENTRY_POINTS(_1)
CUDAMEM_C_TORCH_ENTRY_POINTS(_2)
CUDAMEM_C_TORCH_ENTRY_POINTS(_3)
CUDAMEM_C_TORCH_ENTRY_POINTS(_4)
CUDAMEM_C_TORCH_ENTRY_POINTS(_5)
CUDAMEM_C_TORCH_ENTRY_POINTS(_6)
CUDAMEM_C_TORCH_ENTRY_POINTS(_7)
CUDAMEM_C_TORCH_ENTRY_POINTS(_8)
CUDAMEM_C_TORCH_ENTRY_POINTS(_9)
CUDAMEM_C_TORCH_ENTRY_POINTS(_10)
CUDAMEM_C_TORCH_ENTRY_POINTS(_11)
CUDAMEM_C_TORCH_ENTRY_POINTS(_12)
CUDAMEM_C_TORCH_ENTRY_POINTS(_13)
CUDAMEM_C_TORCH_ENTRY_POINTS(_14)
CUDAMEM_C_TORCH_ENTRY_POINTS(_15)
#undef CUDAMEM_C_TORCH_ENTRY_POINTS

/* Registers the function the torch entry points call to throw at a failed allocation; it is
 * given the report and must throw (a C++ exception of the framework's kind). NULL: none. */
typedef void (*cudamem_oom_thrower)(const char* report);
CUDAMEM_C_API void cudamem_set_torch_oom_thrower(cudamem_oom_thrower thrower);

#ifdef __cplusplus
}
#endif

#endif /* CUDAMEM_C_H */
