"""PyTorch on cudamem's memory resources.

    import cudamem.torch
    cudamem.torch.install()                       # before PyTorch's first CUDA allocation
    x = torch.empty(1 << 30, device="cuda")       # from cudamem's vm_pool
    torch.cuda.memory_allocated()                 # PyTorch's own statistics and tools work
    cudamem.torch.stats()                         # in use, peak, reserved, largest free block
    print(cudamem.torch.report())                 # who holds the device, and why
    cudamem.torch.time_calls(True)                # then call_times(): the allocator's host time

    kv_cache = cudamem.torch.pool()               # one region of a program on cudamem
    with torch.cuda.use_mem_pool(kv_cache):
        blocks = torch.empty(...)

install(resource="vm_pool", **options) makes cudamem PyTorch's CUDA allocator for the whole
process: a complete implementation of PyTorch's allocator interface (CUDAAllocator), in C++
compiled against the installed PyTorch (cudamem/_torch/torch_allocator.cpp: at pip install
when PyTorch is importable there, else at the first install(), once per PyTorch version, a few
seconds, cached in $CUDAMEM_CACHE_DIR or ~/.cache/cudamem). Memory statistics, snapshots and
memory history, cuDNN's benchmark mode, CUDA graphs and torch.compile(mode="reduce-overhead"),
the memory fraction, copies between GPUs and tensors sent to other processes work as under
PyTorch's own allocator, as each release 2.7 to 2.15 has them (what a release lacks, such as
MemPool's use_on_oom before 2.8, cudamem lacks there too). Options (sizes are ints of bytes or
strings such as "4GiB"):
    limit_bytes       a byte budget per device
    grow_ahead_bytes  vm_pool: most memory made ahead of need (0: none; default 4 GiB)
    handle_bytes      vm_pool: size of a physical handle (a multiple of 2 MiB; default 4 MiB)
    keep_free_bytes   vm_pool: device memory left free for cuDNN, cuBLAS and the driver
                      while its own free memory can serve a request (default 1 GiB)
    bulk_handle_bytes vm_pool: tensors of a whole multiple of this size get handles this big
                      (0: none; default 32 MiB), so that one made from freed memory is fast
    recent_frees      vm_pool: how many freed tensors of 4 MiB or more are kept aside, each
                      for the next request of its size on its stream (an int, 0 to 256; 0:
                      none; default 16), served without a search of free memory
    interface         "full" (the default) or "pluggable": PyTorch's pluggable allocator
                      interface instead, a subset (see the contract); CUDAMEM_TORCH_GLUE=0
                      asks for it too
Environment variables CUDAMEM_RESOURCE, CUDAMEM_LIMIT_BYTES, ... set the same, for programs
you do not edit; install()'s arguments override them.

Contract
- install() must run before PyTorch initialises its CUDA allocator (its first CUDA tensor, or
  torch.cuda.init()); afterwards it raises StateError saying so. A second install() with the
  same options does nothing; with other options it raises StateError. Unknown options and
  wrong types raise TypeError; bad values ValueError (cudamem.ConfigError).
- A failed allocation raises torch.OutOfMemoryError at the call that allocates: PyTorch's first
  line ("CUDA out of memory. Tried to allocate ..."), then cudamem's report; the program goes
  on. torch.cuda.set_per_process_memory_fraction(f) is a limit on what tensors, MemPools and
  CUDA graph pools hold on that device (a request it refuses may still be served by a
  use_on_oom pool's free blocks), and its out-of-memory error says the fraction was the cause.
- When the full interface cannot be had, install() raises cudamem.TorchAllocatorError before
  anything is allocated, in one sentence: a PyTorch older than 2.7 ("cudamem.torch supports
  PyTorch 2.7 to 2.15, and this is PyTorch 2.6.0: install a supported release ..."), no C++
  compiler, no CUDA runtime headers of PyTorch's CUDA version, or a failed build. Nothing falls
  back silently: install(interface="pluggable") (or CUDAMEM_TORCH_GLUE=0) asks for PyTorch's
  pluggable interface, and its warning names what is then missing: a failed allocation raises
  RuntimeError with cudamem's report, and memory statistics, snapshots, CUDA graphs and
  reduce-overhead, cuDNN's benchmark mode, the memory fraction and IPC are not available
  (PyTorch raises "does not yet support"). A PyTorch newer than 2.15 is tried; if it does not
  build, the error says it is newer than the supported releases.
- PYTORCH_CUDA_ALLOC_CONF (and PYTORCH_ALLOC_CONF from 2.9): roundup_power2_divisions,
  graph_capture_record_stream_reuse, per_process_memory_fraction and throw_on_cudamalloc_oom
  are applied; pinned_* stay PyTorch's (its pinned host memory allocator is not replaced); each
  other setting (expandable_segments, max_split_size_mb, garbage_collection_threshold,
  backend, ...) gets a warning at install() naming it and what cudamem does instead.
- Streams: PyTorch frees on the stream a tensor was allocated on; Tensor.record_stream(s)
  makes the free wait, without blocking any stream, until s's work queued before the free has
  finished. During a CUDA graph capture such a free waits for the capture's end, or, with
  PyTorch's graph_capture_record_stream_reuse setting, until the capture's graph orders the
  uses first (as PyTorch's own allocator does). torch.cuda.empty_cache() gives wholly free
  memory back to the device.
- pool(resource, **options) is a torch.cuda.MemPool on an allocator of its own (up to 15);
  its memory comes from that cudamem allocator, and an out-of-memory in it is PyTorch's own
  torch.OutOfMemoryError; last_oom_report(pool) has cudamem's side.
"""
import ctypes
import os
import threading
import warnings

import torch

from . import _native, _process, _torch_build, _torch_settings
from ._errors import StateError, TorchAllocatorError

__all__ = ["install", "is_installed", "pool", "stats", "report", "last_oom_report",
           "time_calls", "call_times", "release"]

_lock = threading.Lock()
_installed = False
_pools = {}  # id(MemPool) -> (allocator id, the MemPool's allocator object)


def install(resource="vm_pool", interface=None, **options):
    """Makes cudamem PyTorch's CUDA allocator (see the module's contract). interface: "full"
    (default: PyTorch's whole allocator interface, compiled; TorchAllocatorError if it cannot
    be had) or "pluggable" (PyTorch's pluggable subset, with a warning naming what it lacks)."""
    global _installed, _full
    chosen = _torch_settings.chosen_interface(interface)  # TypeError/ValueError first
    with _lock:
        _process.claim("cudamem.torch.install()", resource, options)
        if _installed:
            return
        release = _torch_build.TorchInstall.from_module(torch).release
        for sentence in _torch_settings.unapplied_settings(os.environ, release):
            warnings.warn(sentence, RuntimeWarning, stacklevel=2)
        if chosen == "full":
            allocator = _full_allocator()
            _install_full(allocator)
            _full = allocator
        else:
            reason = ("CUDAMEM_TORCH_GLUE=0" if interface is None else
                      'install(interface="pluggable")')
            warnings.warn(_torch_settings.pluggable_warning(reason), RuntimeWarning,
                          stacklevel=2)
            _install_pluggable()
        _installed = True


def _full_allocator():
    """The compiled allocator (built now if need be); TorchAllocatorError saying why not."""
    try:
        _torch_build.check_supported(torch)
    except _torch_build.UnsupportedTorch:
        raise TorchAllocatorError(_torch_settings.cannot_build_sentence(
            torch.__version__, None, unsupported=True)) from None
    try:
        path = _torch_build.find(torch) or _torch_build.build(torch, _torch_build.cache_dir())
    except _torch_build.BuildError as e:
        raise TorchAllocatorError(_torch_settings.cannot_build_sentence(
            torch.__version__, str(e))) from None
    try:
        _native.lib()  # libcudamem_c first, with its symbols global: the allocator uses them
        glue = ctypes.CDLL(path)
    except OSError as e:
        raise TorchAllocatorError(_torch_settings.cannot_build_sentence(
            torch.__version__, "its library %s does not load (%s)" % (path, e))) from None
    glue.cudamem_torch_allocator_install.restype = ctypes.c_int
    glue.cudamem_torch_allocator_install.argtypes = [
        ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t]
    glue.cudamem_torch_allocator_last_oom.restype = ctypes.c_size_t
    glue.cudamem_torch_allocator_last_oom.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
    glue.cudamem_torch_allocator_time_calls.restype = ctypes.c_int
    glue.cudamem_torch_allocator_time_calls.argtypes = [ctypes.c_int]
    glue.cudamem_torch_allocator_call_times.restype = ctypes.c_int
    glue.cudamem_torch_allocator_call_times.argtypes = [ctypes.POINTER(ctypes.c_uint64)]
    _keep.append(glue)
    return glue


def _install_full(glue):
    config = dict(item.split("=", 1) for item in _native.describe(0).split(", "))
    error = ctypes.create_string_buffer(4096)
    if glue.cudamem_torch_allocator_install(config["resource"].encode(), error,
                                            len(error)) != 0:
        raise _refusal(error.value.decode("utf-8", "replace"))


def _install_pluggable():
    allocator = torch.cuda.memory.CUDAPluggableAllocator(
        _native.library_path(), "cudamem_torch_malloc", "cudamem_torch_free")
    hooks = allocator.allocator()
    hooks.set_record_stream_fn(_native.function_address("cudamem_torch_record_stream"))
    hooks.set_reset_fn(_native.function_address("cudamem_torch_empty_cache"))
    try:
        torch.cuda.memory.change_current_allocator(allocator)
    except RuntimeError as e:
        raise _refusal(str(e)) from None
    _keep.append(allocator)


def _refusal(why):
    return StateError(
        "cudamem.torch.install() must run before PyTorch initialises its CUDA "
        "allocator, i.e. before the program's first CUDA tensor (or torch.cuda.init()): "
        "PyTorch's own allocator is in use in this process already (%s). Call it at "
        "the start of the program, right after `import torch`." % why)


_keep = []  # what install() loaded or made, alive for the life of the process
_full = None  # the compiled allocator's library, once installed


def is_installed():
    """Whether install() made cudamem PyTorch's allocator in this process."""
    return _installed


def pool(resource="vm_pool", **options):
    """A torch.cuda.MemPool whose memory comes from a cudamem allocator of its own."""
    text = _native.config_text("cudamem.torch.pool()", resource, options,
                               extra={"raise_on_oom": 0})
    allocator_id = _native.create(text)
    try:
        allocator = torch.cuda.memory.CUDAPluggableAllocator(
            _native.library_path(), "cudamem_torch_malloc_%d" % allocator_id,
            "cudamem_torch_free_%d" % allocator_id)
        mem_pool = torch.cuda.MemPool(allocator.allocator())
    except BaseException:
        _native.destroy(allocator_id)
        raise
    with _lock:
        _pools[id(mem_pool)] = (allocator_id, allocator)
    return mem_pool


def _allocator_id(pool):
    if pool is None:
        return 0
    with _lock:
        entry = _pools.get(id(pool))
    if entry is None:
        raise ValueError("not a pool made by cudamem.torch.pool()")
    return entry[0]


def _device(device):
    if device is None:
        return torch.cuda.current_device()
    if isinstance(device, torch.device):
        if device.type != "cuda":
            raise ValueError("cudamem: %s is not a CUDA device" % device)
        return device.index if device.index is not None else torch.cuda.current_device()
    if isinstance(device, str):
        return _device(torch.device(device))
    if isinstance(device, bool) or not isinstance(device, int):
        raise TypeError("device must be an int, a torch.device or a str, not %s"
                        % type(device).__name__)
    return device


def stats(device=None, pool=None):
    """What cudamem holds for one device (the current one by default): a dict with
    in_use_bytes, peak_in_use_bytes, reserved_bytes, largest_free_block (None: unknown),
    held_ahead_bytes, allocations, deallocations, allocated_bytes, pending_frees (frees of the
    C library waiting for record_stream's streams: under install()'s allocator such frees wait
    before they reach it, and torch.cuda.memory_stats() counts them as active), limit_bytes
    (None: no budget), and where a loop's host time can go, counted since the stack was made:
    compactions (vm_pool: free memory mapped again together to serve a request; each waits on
    the host for the streams that freed it), kept_free_compactions (of those, the ones chosen
    to keep keep_free_bytes free), stream_waits, host_waits and device_syncs (what the pool
    did to keep stream order), bulk_declined (vm_pool: tensors of a whole multiple of
    bulk_handle_bytes asked of the 4 MiB handles, as the bulk ones would have grown into
    keep_free_bytes), recent_reuses (vm_pool: tensors of 4 MiB or more served by a block of
    their size freed on their stream and kept aside, with no search of free memory; the C
    library's recent_frees). `pool`: a pool made by pool(), else the process-wide
    allocator."""
    return _native.stats(_allocator_id(pool), _device(device))


def report(device=None, nbytes=0, pool=None):
    """cudamem's memory report for one device, as text: who holds the device (processes, this
    process's context), what each resource holds, and for a request of `nbytes` a verdict."""
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
        raise TypeError("nbytes must be a non-negative int")
    return _native.report(_allocator_id(pool), _device(device), nbytes)


def last_oom_report(pool=None):
    """The report of the last allocation cudamem could not meet ("" if none): for the
    installed allocator, the whole message of the torch.OutOfMemoryError it raised."""
    if pool is None and _full is not None:
        buf = ctypes.create_string_buffer(_full.cudamem_torch_allocator_last_oom(None, 0) or 1)
        _full.cudamem_torch_allocator_last_oom(buf, len(buf))
        return buf.value.decode("utf-8", "replace")
    return _native.last_oom_report(_allocator_id(pool))


def release(device=None, pool=None):
    """Gives wholly free memory back to the device (torch.cuda.empty_cache() does this too);
    returns the bytes given back. device None: every device."""
    return _native.release(_allocator_id(pool), -1 if device is None else _device(device))


def time_calls(enabled=True):
    """Starts (or stops) counting the host time of each allocation and free of the installed
    allocator; call_times() reads the counts. Off by default; on, each call reads a clock
    twice more (tens of ns, counted in the figures). Needs install()'s full interface:
    StateError without it."""
    if not isinstance(enabled, bool):
        raise TypeError("enabled must be a bool, not %s" % type(enabled).__name__)
    _timed_allocator("time_calls").cudamem_torch_allocator_time_calls(int(enabled))


def call_times():
    """What time_calls() counted since install(): a dict with allocations, allocation_ns, frees
    and free_ns (host nanoseconds from entry to return, in the calling thread, out-of-memory
    errors included). Read it around a stretch of work: the differences are that stretch's."""
    out = (ctypes.c_uint64 * 4)()
    _timed_allocator("call_times").cudamem_torch_allocator_call_times(out)
    return dict(zip(("allocations", "allocation_ns", "frees", "free_ns"), out))


def _timed_allocator(what):
    if _full is None:
        raise StateError("cudamem.torch.%s() times the allocator install() puts in PyTorch, and "
                         "%s" % (what, "install() chose PyTorch's pluggable interface"
                                 if _installed else "install() has not been called"))
    return _full

