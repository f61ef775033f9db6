"""PyTorch on cudamem's memory resources.

    import cudamem.torch
    cudamem.torch.install()                       # before PyTorch's first CUDA allocation
    x = torch.empty(1 << 30, device="cuda")       # from cudamem's vm_pool
    cudamem.torch.stats()                         # in use, peak, reserved, largest free block
    print(cudamem.torch.report())                 # who holds the device, and why

    kv_cache = cudamem.torch.pool()               # one region of a program on cudamem
    with torch.cuda.use_mem_pool(kv_cache):
        blocks = torch.empty(...)

install(resource="vm_pool", **options) makes cudamem PyTorch's CUDA allocator for the whole
process (torch.cuda.memory.CUDAPluggableAllocator over libcudamem_c). Options (sizes are ints
of bytes or strings such as "4GiB"):
    limit_bytes       a byte budget per device
    grow_ahead_bytes  vm_pool: most memory made ahead of need (0: none; default 4 GiB)
    handle_bytes      vm_pool: size of a physical handle (a multiple of 2 MiB; default 4 MiB)
    keep_free_bytes   vm_pool: device memory left free for cuDNN, cuBLAS and the driver
                      while its own free memory can serve a request (default 1 GiB)
Environment variables CUDAMEM_RESOURCE, CUDAMEM_LIMIT_BYTES, ... set the same, for programs
you do not edit; install()'s arguments override them.

Contract
- install() must run before PyTorch initialises its CUDA allocator (its first CUDA tensor, or
  torch.cuda.init()); afterwards it raises StateError saying so. A second install() with the
  same options does nothing; with other options it raises StateError. Unknown options and
  wrong types raise TypeError; bad values ValueError (cudamem.ConfigError).
- A failed allocation raises torch.OutOfMemoryError at the call that allocates, with cudamem's
  report as its message, and the program goes on. (This needs a C++ compiler once per PyTorch
  version, to build a 10-line shim against PyTorch's headers, cached in
  $CUDAMEM_CACHE_DIR or ~/.cache/cudamem. Without one it raises RuntimeError with the same
  report, and install() warns.)
- Streams: PyTorch frees on the stream a tensor was allocated on; Tensor.record_stream(s)
  makes the free wait, without blocking any stream, until s's work queued before the free has
  finished. torch.cuda.empty_cache() gives wholly free memory back to the device.
- torch.cuda.memory_allocated() and the other torch.cuda memory statistics are not available
  under a pluggable allocator (PyTorch raises); use stats() and report().
- pool(resource, **options) is a torch.cuda.MemPool on an allocator of its own (up to 15):
  PyTorch's caching allocator manages the pool's blocks and gets its segments from cudamem,
  so there an out-of-memory is PyTorch's own torch.OutOfMemoryError (after it freed its cache
  and retried); last_oom_report(pool) has cudamem's side.
"""
import ctypes
import hashlib
import os
import subprocess
import sys
import tempfile
import threading
import warnings

import torch

from . import _native, _process
from ._errors import CudamemError, StateError

__all__ = ["install", "is_installed", "pool", "stats", "report", "last_oom_report",
           "release"]

_lock = threading.Lock()
_installed = False
_pools = {}  # id(MemPool) -> (allocator id, the MemPool's allocator object)


def install(resource="vm_pool", **options):
    """Makes cudamem PyTorch's CUDA allocator (see the module's contract)."""
    global _installed
    with _lock:
        _process.claim("cudamem.torch.install()", resource, options)
        if _installed:
            return
        allocator = torch.cuda.memory.CUDAPluggableAllocator(
            _native.library_path(), "cudamem_torch_malloc", "cudamem_torch_free")
        hooks = allocator.allocator()
        hooks.set_record_stream_fn(_native.function_address("cudamem_torch_record_stream"))
        hooks.set_reset_fn(_native.function_address("cudamem_torch_empty_cache"))
        try:
            torch.cuda.memory.change_current_allocator(allocator)
        except RuntimeError as e:
            raise StateError(
                "cudamem.torch.install() must run before PyTorch initialises its CUDA "
                "allocator, i.e. before the program's first CUDA tensor (or torch.cuda.init()): "
                "PyTorch's own allocator is in use in this process already (%s). Call it at "
                "the start of the program, right after `import torch`." % e) from None
        _register_oom_thrower()
        _installed = True
        _keep.append(allocator)


_keep = []  # the installed allocator object, alive for the life of the process


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
    held_ahead_bytes, allocations, deallocations, allocated_bytes, pending_frees (frees
    waiting for record_stream's streams) and limit_bytes (None: no budget). `pool`: a pool
    made by pool(), else the process-wide allocator."""
    return _native.stats(_allocator_id(pool), _device(device))


def report(device=None, nbytes=0, pool=None):
    """cudamem's memory report for one device, as text: who holds the device (processes, this
    process's context), what each resource holds, and for a request of `nbytes` a verdict."""
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
        raise TypeError("nbytes must be a non-negative int")
    return _native.report(_allocator_id(pool), _device(device), nbytes)


def last_oom_report(pool=None):
    """The report of the last allocation cudamem could not meet ("" if none)."""
    return _native.last_oom_report(_allocator_id(pool))


def release(device=None, pool=None):
    """Gives wholly free memory back to the device (torch.cuda.empty_cache() does this too);
    returns the bytes given back. device None: every device."""
    return _native.release(_allocator_id(pool), -1 if device is None else _device(device))


# --- torch.OutOfMemoryError ------------------------------------------------------------------

def _register_oom_thrower():
    """Builds (once per PyTorch version) and registers the shim that throws PyTorch's
    out-of-memory exception; without it a failed allocation raises RuntimeError."""
    if os.environ.get("CUDAMEM_TORCH_GLUE", "1") == "0":
        return
    try:
        path = _oom_thrower_library()
        glue = ctypes.CDLL(path)
        _keep.append(glue)
        address = ctypes.cast(glue.cudamem_torch_throw_oom, ctypes.c_void_p).value
        _native.lib().cudamem_set_torch_oom_thrower(address)
    except Exception as e:  # noqa: BLE001 - any failure leaves the RuntimeError fallback
        warnings.warn(
            "cudamem.torch: a failed allocation will raise RuntimeError (with cudamem's report) "
            "rather than torch.OutOfMemoryError: the shim that throws PyTorch's exception could "
            "not be built (%s). It needs a C++ compiler (set CXX) and PyTorch's headers."
            % e, RuntimeWarning, stacklevel=3)


def _oom_thrower_library():
    source = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_torch_glue.cpp")
    with open(source, "rb") as f:
        code = f.read()
    torch_dir = os.path.dirname(os.path.abspath(torch.__file__))
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    key = hashlib.sha256(code + torch.__version__.encode() + torch_dir.encode()
                         + bytes([abi])).hexdigest()[:16]
    cache = os.environ.get("CUDAMEM_CACHE_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "cudamem")
    target = os.path.join(cache, "torch_oom_%s.so" % key)
    if os.path.exists(target):
        return target
    os.makedirs(cache, exist_ok=True)
    compiler = os.environ.get("CXX") or "c++"
    fd, temporary = tempfile.mkstemp(suffix=".so", dir=cache)
    os.close(fd)
    command = [compiler, "-O2", "-shared", "-fPIC", "-std=c++17",
               "-D_GLIBCXX_USE_CXX11_ABI=%d" % abi,
               "-I" + os.path.join(torch_dir, "include"), source, "-o", temporary,
               "-L" + os.path.join(torch_dir, "lib"), "-lc10",
               "-Wl,-rpath," + os.path.join(torch_dir, "lib")]
    try:
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            raise CudamemError("%s failed: %s" % (" ".join(command[:1]),
                                                  done.stderr.strip()[-600:]))
        os.replace(temporary, target)  # atomic: a concurrent process sees all of it or none
    finally:
        if os.path.exists(temporary):
            os.unlink(temporary)
    return target
