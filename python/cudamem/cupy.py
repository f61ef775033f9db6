"""CuPy on cudamem's memory resources.

    import cudamem.cupy
    cudamem.cupy.install()                 # cupy.cuda.set_allocator over cudamem
    a = cupy.zeros(1 << 28)                 # from cudamem's vm_pool
    cudamem.cupy.stats()                    # in use, peak, reserved, largest free block

install(resource="vm_pool", **options) takes the options of cudamem.torch.install() and
configures the same process-wide allocator: in a program that uses both, PyTorch and CuPy
share cudamem's pools (and install() with other options than the first raises StateError).

Contract
- Each CuPy allocation is made on CuPy's current device and stream, and freed, when CuPy lets
  go of the memory, on that stream (CuPy's own pool is stream-ordered the same way: work on
  another stream must be ordered by the program).
- A failed allocation raises cudamem.cupy.OutOfMemoryError, which is both CuPy's
  cupy.cuda.memory.OutOfMemoryError and cudamem.OutOfMemoryError, with cudamem's report as its
  message.
- It can be called at any time: arrays allocated before keep their memory from CuPy's pool.
- Cost: CuPy's allocator hook is a Python callable, so each allocation makes one call into
  libcudamem_c through ctypes (bench/python/README.md measures it).
"""
import threading

import cupy

from . import _native, _process
from ._errors import OutOfMemoryError as _CudamemOutOfMemory

# CuPy's CUDA runtime first, so that libcudamem_c uses the same one (one runtime per process:
# a second would not know CuPy's streams).
cupy.cuda.runtime.runtimeGetVersion()

__all__ = ["install", "is_installed", "stats", "report", "release", "OutOfMemoryError"]


class OutOfMemoryError(cupy.cuda.memory.OutOfMemoryError, _CudamemOutOfMemory):
    """CuPy's out-of-memory error, carrying cudamem's report."""

    def __init__(self, report, size):
        MemoryError.__init__(self, report)
        self.size = size
        self._report = report

    def __str__(self):
        return self._report


class _Block:
    """Owns one allocation for CuPy's UnownedMemory: freed when CuPy drops the memory."""

    __slots__ = ("ptr", "size", "device", "stream")

    def __init__(self, ptr, size, device, stream):
        self.ptr, self.size, self.device, self.stream = ptr, size, device, stream

    def __del__(self):
        try:
            _native.deallocate(0, self.ptr, self.size, self.device, self.stream)
        except Exception:  # noqa: BLE001 - interpreter teardown: the process is ending
            pass


def _malloc(size):
    if size == 0:
        return cupy.cuda.MemoryPointer(cupy.cuda.memory.Memory(0), 0)
    device = cupy.cuda.runtime.getDevice()
    stream = cupy.cuda.get_current_stream().ptr
    try:
        ptr = _native.allocate(0, size, device, stream)
    except _CudamemOutOfMemory as e:
        raise OutOfMemoryError(str(e), size) from None
    memory = cupy.cuda.UnownedMemory(ptr, size, _Block(ptr, size, device, stream), device)
    return cupy.cuda.MemoryPointer(memory, 0)


_lock = threading.Lock()
_installed = False


def install(resource="vm_pool", **options):
    """Makes cudamem CuPy's allocator (see the module's contract)."""
    global _installed
    with _lock:
        _process.claim("cudamem.cupy.install()", resource, options)
        cupy.cuda.set_allocator(_malloc)
        _installed = True


def is_installed():
    return _installed


def _device(device):
    if device is None:
        return cupy.cuda.runtime.getDevice()
    if isinstance(device, cupy.cuda.Device):
        return device.id
    if isinstance(device, bool) or not isinstance(device, int):
        raise TypeError("device must be an int or a cupy.cuda.Device, not %s"
                        % type(device).__name__)
    return device


def stats(device=None):
    """What cudamem holds for one device (see cudamem.torch.stats)."""
    return _native.stats(0, _device(device))


def report(device=None, nbytes=0):
    """cudamem's memory report for one device, as text."""
    return _native.report(0, _device(device), nbytes)


def release(device=None):
    """Gives wholly free memory back to the device; returns the bytes given back."""
    return _native.release(0, -1 if device is None else _device(device))


