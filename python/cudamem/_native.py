"""The C library (libcudamem_c, ../capi) through ctypes: loading it, turning its status codes
into Python exceptions, and options into its configuration text.

Nothing here runs per allocation for PyTorch: PyTorch calls the library's entry points
directly. CuPy's hook (cudamem.cupy) calls allocate/deallocate below once per allocation.
"""
import ctypes
import glob
import os
import re
import sys
import threading

from ._errors import (ConfigError, CudamemError, NoDeviceError, OptionError,
                      OutOfMemoryError, StateError)

MAX_ALLOCATORS = 16

# cudamem_status (capi/include/cudamem_c.h)
_OK, _INVALID_ARGUMENT, _OUT_OF_MEMORY, _STATE, _NO_DEVICE, _CUDA, _INTERNAL = range(7)
_EXCEPTIONS = {
    _INVALID_ARGUMENT: ConfigError,
    _OUT_OF_MEMORY: OutOfMemoryError,
    _STATE: StateError,
    _NO_DEVICE: NoDeviceError,
    _CUDA: CudamemError,
    _INTERNAL: CudamemError,
}

# The options install()/pool() take, beside `resource`: keys of the C configuration. Sizes
# are ints (bytes) or strings such as "4GiB"; counts are ints.
SIZE_OPTIONS = ("limit_bytes", "grow_ahead_bytes", "handle_bytes", "keep_free_bytes",
                "bulk_handle_bytes", "simulate_bytes")
COUNT_OPTIONS = ("recent_frees",)
OPTIONS = SIZE_OPTIONS + COUNT_OPTIONS


class Stats(ctypes.Structure):
    """cudamem_stats."""

    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("device", ctypes.c_int32),
        ("stack_exists", ctypes.c_int32),
        ("in_use_bytes", ctypes.c_uint64),
        ("peak_in_use_bytes", ctypes.c_uint64),
        ("reserved_bytes", ctypes.c_uint64),
        ("largest_free_block", ctypes.c_uint64),
        ("held_ahead_bytes", ctypes.c_uint64),
        ("allocations", ctypes.c_uint64),
        ("deallocations", ctypes.c_uint64),
        ("allocated_bytes", ctypes.c_uint64),
        ("pending_frees", ctypes.c_uint64),
        ("limit_bytes", ctypes.c_uint64),
        ("peak_reserved_bytes", ctypes.c_uint64),
        ("segments", ctypes.c_uint64),
        ("device_allocations", ctypes.c_uint64),
        ("device_frees", ctypes.c_uint64),
        ("device_allocated_bytes", ctypes.c_uint64),
        ("device_freed_bytes", ctypes.c_uint64),
        ("compactions", ctypes.c_uint64),
        ("kept_free_compactions", ctypes.c_uint64),
        ("stream_waits", ctypes.c_uint64),
        ("host_waits", ctypes.c_uint64),
        ("device_syncs", ctypes.c_uint64),
        ("bulk_declined", ctypes.c_uint64),
        ("recent_reuses", ctypes.c_uint64),
    ]


# cudamem_ipc_export.kind
IPC_VMM, IPC_CUDA_MALLOC = 1, 2


class IpcExport(ctypes.Structure):
    """cudamem_ipc_export."""

    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("kind", ctypes.c_int32),
        ("offset", ctypes.c_uint64),
        ("handle_bytes", ctypes.c_uint64),
        ("ipc_mem_handle", ctypes.c_ubyte * 64),
    ]


def library_path():
    """Where libcudamem_c is: $CUDAMEM_C_LIBRARY, else inside this package."""
    explicit = os.environ.get("CUDAMEM_C_LIBRARY")
    if explicit:
        return explicit
    here = os.path.dirname(os.path.abspath(__file__))
    found = sorted(glob.glob(os.path.join(here, "libcudamem_c.so*")))
    if not found:
        raise CudamemError(
            "cudamem: libcudamem_c.so is not in %s: install the package with "
            "`pip install ./python` from a cudamem checkout, or set CUDAMEM_C_LIBRARY" % here)
    return found[0]


_lock = threading.Lock()
_lib = None


def lib():
    """The loaded library, with argument and result types declared."""
    global _lib
    with _lock:
        if _lib is None:
            _lib = _declare(_load(library_path()))
        return _lib


def _load(path):
    """Loads libcudamem_c. It needs the CUDA runtime as a shared library: the one a framework
    loaded already (PyTorch loads it at import), else one found in the usual places — the
    nvidia-cuda-runtime wheel that PyTorch and CuPy install, CUDA_HOME, /usr/local/cuda."""
    # RTLD_GLOBAL: cudamem's PyTorch allocator (cudamem/_torch) calls the library's functions
    # by name. It exports the cudamem_* functions alone, so nothing else is put in sight.
    try:
        return ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
    except OSError as first:
        needed = re.search(r"libcudart\.so\.\d+", str(first))
        if needed is None:
            raise CudamemError("cudamem: cannot load %s: %s" % (path, first)) from None
        for candidate in _runtime_candidates(needed.group(0)):
            try:
                ctypes.CDLL(candidate, mode=ctypes.RTLD_GLOBAL)
                return ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
            except OSError:
                continue
        raise CudamemError(
            "cudamem: %s needs the CUDA runtime %s, which was not found: install PyTorch or "
            "CuPy built for this CUDA version, or the CUDA Toolkit, or put the directory that "
            "holds it on LD_LIBRARY_PATH" % (path, needed.group(0))) from None


def _runtime_candidates(name):
    roots = [p for p in sys.path if p and os.path.isdir(p)]
    for root in roots:
        for sub in ("nvidia/cu13/lib", "nvidia/cu12/lib", "nvidia/cuda_runtime/lib"):
            yield os.path.join(root, sub, name)
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home:
            yield os.path.join(home, "lib64", name)
            yield os.path.join(home, "targets", "x86_64-linux", "lib", name)


def _declare(l):
    c_int, c_size, c_u64, c_void, c_char = (ctypes.c_int, ctypes.c_size_t, ctypes.c_uint64,
                                             ctypes.c_void_p, ctypes.c_char_p)
    signatures = {
        "cudamem_version": (c_char, []),
        "cudamem_last_error": (c_char, []),
        "cudamem_allocator_create": (c_int, [c_char, ctypes.POINTER(c_int)]),
        "cudamem_allocator_configure": (c_int, [c_int, c_char]),
        "cudamem_allocator_describe": (c_int, [c_int, c_void, c_size, ctypes.POINTER(c_size)]),
        "cudamem_allocator_destroy": (c_int, [c_int]),
        "cudamem_allocate": (c_int, [c_int, c_size, c_int, c_void, ctypes.POINTER(c_void)]),
        "cudamem_deallocate": (c_int, [c_int, c_void, c_size, c_int, c_void]),
        "cudamem_record_stream": (c_int, [c_int, c_void, c_void]),
        "cudamem_release": (c_int, [c_int, c_int, ctypes.POINTER(c_u64)]),
        "cudamem_get_stats": (c_int, [c_int, c_int, ctypes.POINTER(Stats)]),
        "cudamem_report": (c_int, [c_int, c_int, c_u64, c_void, c_size, ctypes.POINTER(c_size)]),
        "cudamem_last_oom_report": (c_int, [c_int, c_void, c_size, ctypes.POINTER(c_size)]),
        "cudamem_current_device": (c_int, [ctypes.POINTER(c_int)]),
        "cudamem_ipc_export_range": (c_int, [c_int, c_int, c_void, c_size,
                                             ctypes.POINTER(IpcExport), ctypes.POINTER(c_int),
                                             c_size, ctypes.POINTER(c_size)]),
        "cudamem_ipc_import": (c_int, [c_int, ctypes.c_int32, ctypes.POINTER(c_int), c_size,
                                       c_u64, ctypes.POINTER(c_void)]),
        "cudamem_ipc_add_peer": (c_int, [c_void, c_int]),
        "cudamem_ipc_unmap": (c_int, [c_void]),
    }
    for name, (restype, argtypes) in signatures.items():
        f = getattr(l, name)
        f.restype = restype
        f.argtypes = argtypes
    return l


def _check(status):
    if status != _OK:
        message = lib().cudamem_last_error().decode("utf-8", "replace")
        raise _EXCEPTIONS.get(status, CudamemError)(message)


def _text(call):
    """Calls a C function that fills a text buffer (buf, size, needed) and returns the text."""
    needed = ctypes.c_size_t(0)
    _check(call(None, 0, ctypes.byref(needed)))
    buf = ctypes.create_string_buffer(needed.value)
    _check(call(buf, needed.value, ctypes.byref(needed)))
    return buf.value.decode("utf-8", "replace")


def function_address(name):
    """The address of one of the library's functions (for PyTorch)."""
    return ctypes.cast(getattr(lib(), name), ctypes.c_void_p).value


def config_text(caller, resource, options, extra=None):
    """The C configuration text for install()/pool(); wrong names and types raise OptionError
    (a ConfigError and a TypeError) here, bad values ConfigError (a ValueError), here or from
    the library."""
    if not isinstance(resource, str):
        raise OptionError("%s: resource must be a str (vm_pool, pool or async), not %s"
                          % (caller, type(resource).__name__))
    items = ["resource=" + resource]
    for key, value in options.items():
        if key not in OPTIONS:
            raise OptionError("%s got an unexpected keyword argument %r (options: %s)"
                              % (caller, key, ", ".join(OPTIONS)))
        if value is None:
            continue
        if key in COUNT_OPTIONS and (isinstance(value, bool) or not isinstance(value, int)):
            raise OptionError("%s: %s must be an int (a count), not %s"
                              % (caller, key, type(value).__name__))
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            raise OptionError("%s: %s must be an int (bytes) or a size string such as "
                              "'4GiB', not %s" % (caller, key, type(value).__name__))
        if isinstance(value, int) and value < 0:
            raise ConfigError("%s: %s must not be negative (%d)" % (caller, key, value))
        text = str(value)
        if "," in text or "=" in text:
            raise ConfigError("%s: %s=%r is not a size" % (caller, key, value))
        items.append("%s=%s" % (key, text))
    for key, value in (extra or {}).items():
        items.append("%s=%s" % (key, value))
    return ", ".join(items)


def configure(allocator_id, text):
    _check(lib().cudamem_allocator_configure(allocator_id, text.encode()))


def create(text):
    out = ctypes.c_int(-1)
    _check(lib().cudamem_allocator_create(text.encode(), ctypes.byref(out)))
    return out.value


def destroy(allocator_id):
    _check(lib().cudamem_allocator_destroy(allocator_id))


def describe(allocator_id):
    return _text(lambda b, n, need: lib().cudamem_allocator_describe(allocator_id, b, n, need))


def allocate(allocator_id, nbytes, device, stream):
    out = ctypes.c_void_p(0)
    _check(lib().cudamem_allocate(allocator_id, nbytes, device, stream, ctypes.byref(out)))
    return out.value or 0


def deallocate(allocator_id, ptr, nbytes, device, stream):
    _check(lib().cudamem_deallocate(allocator_id, ptr, nbytes, device, stream))


def record_stream(allocator_id, ptr, stream):
    _check(lib().cudamem_record_stream(allocator_id, ptr, stream))


def release(allocator_id, device=-1):
    out = ctypes.c_uint64(0)
    _check(lib().cudamem_release(allocator_id, device, ctypes.byref(out)))
    return out.value


def stats(allocator_id, device):
    s = Stats()
    s.struct_size = ctypes.sizeof(Stats)
    _check(lib().cudamem_get_stats(allocator_id, device, ctypes.byref(s)))
    unknown = 2 ** 64 - 1
    return {
        "device": s.device,
        "in_use_bytes": s.in_use_bytes,
        "peak_in_use_bytes": s.peak_in_use_bytes,
        "reserved_bytes": s.reserved_bytes,
        "largest_free_block": None if s.largest_free_block == unknown else s.largest_free_block,
        "held_ahead_bytes": s.held_ahead_bytes,
        "allocations": s.allocations,
        "deallocations": s.deallocations,
        "allocated_bytes": s.allocated_bytes,
        "pending_frees": s.pending_frees,
        "limit_bytes": s.limit_bytes or None,
        "compactions": s.compactions,
        "kept_free_compactions": s.kept_free_compactions,
        "stream_waits": s.stream_waits,
        "host_waits": s.host_waits,
        "device_syncs": s.device_syncs,
        "bulk_declined": s.bulk_declined,
        "recent_reuses": s.recent_reuses,
    }


def report(allocator_id, device, nbytes=0):
    return _text(lambda b, n, need: lib().cudamem_report(allocator_id, device, nbytes, b, n, need))


def last_oom_report(allocator_id):
    return _text(lambda b, n, need: lib().cudamem_last_oom_report(allocator_id, b, n, need))


def current_device():
    """The calling thread's CUDA device, as the CUDA runtime says (NoDeviceError: none)."""
    out = ctypes.c_int(-1)
    _check(lib().cudamem_current_device(ctypes.byref(out)))
    return out.value


def ipc_export(allocator_id, device, ptr, nbytes):
    """The memory under [ptr, ptr + nbytes) in a form another process maps: a dict with kind
    (IPC_VMM or IPC_CUDA_MALLOC), offset, handle_bytes, ipc_mem_handle (64 bytes) and fds (VMM:
    descriptors the caller owns and closes)."""
    out = IpcExport()
    out.struct_size = ctypes.sizeof(IpcExport)
    needed = ctypes.c_size_t(0)
    capacity = 64
    while True:
        fds = (ctypes.c_int * capacity)()
        status = lib().cudamem_ipc_export_range(allocator_id, device, ptr, nbytes,
                                                ctypes.byref(out), fds, capacity,
                                                ctypes.byref(needed))
        if status == _INVALID_ARGUMENT and needed.value > capacity:
            capacity = needed.value  # more handles than room: nothing was left open
            continue
        _check(status)
        return {"kind": out.kind, "offset": out.offset, "handle_bytes": out.handle_bytes,
                "ipc_mem_handle": bytes(out.ipc_mem_handle),
                "fds": [fds[i] for i in range(needed.value)]}


def ipc_import(device, pid, fds, handle_bytes):
    """Maps on `device` the handles process `pid` exported as `fds`; the base address."""
    numbers = (ctypes.c_int * len(fds))(*fds)
    base = ctypes.c_void_p(0)
    _check(lib().cudamem_ipc_import(device, pid, numbers, len(fds), handle_bytes,
                                    ctypes.byref(base)))
    return base.value


def ipc_add_peer(base, peer):
    _check(lib().cudamem_ipc_add_peer(base, peer))


def ipc_unmap(base):
    _check(lib().cudamem_ipc_unmap(base))


def version():
    return lib().cudamem_version().decode()
