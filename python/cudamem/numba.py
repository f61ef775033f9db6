"""Numba on cudamem's memory resources: an External Memory Management (EMM) plugin.

    import cudamem.numba
    cudamem.numba.install()                   # before Numba makes its first CUDA context
    d = numba.cuda.to_device(host_array)      # from cudamem's vm_pool, beside PyTorch and CuPy
    cudamem.numba.stats()                     # in use, peak, reserved, largest free block

    # A program you do not edit: Numba loads the plugin by name.
    NUMBA_CUDA_MEMORY_MANAGER=cudamem.numba python3 program.py

install(resource="vm_pool", **options) takes the options of cudamem.torch.install() and
configures the same process-wide allocator: PyTorch, CuPy and Numba in one program share one
set of pools per device, and cudamem.stats() counts all of it. Loaded by name instead, the
plugin takes the allocator as the CUDAMEM_* environment variables configure it (what a first
install() with no arguments would leave, and CUDAMEM_RESOURCE is honoured).

Contract
- install() must run before Numba makes its CUDA context (its first device array, kernel
  launch or numba.cuda.current_context()): Numba binds a memory manager to a context when it
  makes it, so afterwards install() raises StateError saying so. It also raises StateError
  when another plugin was chosen (numba.cuda.set_memory_manager, or NUMBA_CUDA_MEMORY_MANAGER
  naming another module). A second install() with the same options does nothing; with other
  options (or after cudamem.torch/cudamem.cupy installed other ones) StateError. Unknown
  options, wrong types and bad values raise cudamem.ConfigError (the first two also a
  TypeError, as Python's own for a bad keyword argument; bad values also a ValueError).
- Device memory (memalloc) comes from the process-wide allocator of the context's device.
  Numba's EMM interface (version 1, numba-cuda 0.30.4) passes no stream to memalloc and none
  to a free, so both are made on the legacy default stream, the one stream every blocking
  stream is ordered with (numba.cuda.stream(), the default streams, per-thread ones too).
  Memory Numba frees goes back to the pool at once; the next allocation records an event on
  the legacy default stream before Numba queues work on its memory: the GPU reaches it only
  after all work queued before on blocking streams, and later work on them waits for it, so
  reused memory is never written while a kernel of a blocking stream still uses it. Work on
  a non-blocking stream (numba.cuda.external_stream of a PyTorch or CuPy stream) is not
  ordered so: finish it (stream.synchronize()) before its arrays are dropped, or run it inside
  numba.cuda.defer_cleanup().
- defer_cleanup(): while one is active (they nest), memory Numba frees is held, not given back;
  when the outermost exits, the context is synchronised (all streams) and the held memory goes
  back to the pool. reset() (numba.cuda.close()) empties Numba's table of allocations, which
  frees their memory as Numba's own manager does (arrays left are invalid; memory a live view
  still holds is freed when the view goes), then gives wholly free memory back to the device,
  except inside defer_cleanup(). Numba's deferral of host-memory frees is kept.
- get_memory_info(): free is what cudamem can still hand out on the device: the device's free
  memory plus what the pools hold unused (reserved - in use), capped by limit_bytes; total is
  the device's.
- A failed allocation raises cudamem.numba.OutOfMemoryError: Numba's own out-of-memory error
  (numba.cuda.cudadrv.driver.CudaAPIError with code CUDA_ERROR_OUT_OF_MEMORY, what Numba's
  memory manager raises) and cudamem.OutOfMemoryError, its message cudamem's report. The
  program goes on.
- IPC (DeviceNDArray.get_ipc_handle()): with resource="pool" (cudaMalloc'd chunks) the handle
  is Numba's own IpcHandle over the chunk's cudaIpcMemHandle and an offset: any receiver opens
  it, with or without cudamem. vm_pool memory is virtual memory, which the legacy CUDA IPC
  cannot share: its handle is a VmmIpcHandle (a subclass of Numba's IpcHandle) that names the
  physical handles as file descriptors of the sender, kept open while the array's memory is
  allocated; the receiver's open() takes them with pidfd_getfd (Linux 5.6; the receiver must be
  allowed to trace the sender: same user and Yama ptrace_scope 0, or CAP_SYS_PTRACE) and maps
  them. Unpickling it imports cudamem.numba, so the receiver needs the cudamem package, though
  not cudamem as its memory manager. resource="async" memory cannot be shared (StateError).
  With cuda-bindings 13.4 or later Numba's own IpcHandle cannot be pickled, under any memory
  manager (CUipcMemHandle lost its `reserved` field): the pool's handle is then a CudaIpcHandle,
  which pickles the same 64 bytes, and its receiver needs the cudamem package too. The sender
  keeps the array alive while receivers use it, as with Numba's own manager.
- Host memory (memhostalloc, mempin) and managed memory stay Numba's own (this plugin derives
  from HostOnlyCUDAMemoryManager): cudamem pools device memory only, and its C library has no
  pinned resource; mempin must pin the caller's memory where it lies (cuMemHostRegister),
  which no pool can provide; cuda.pinned, cuda.mapped_array and managed arrays work unchanged.
- numba.cuda.close() resets each device's primary context, which PyTorch, CuPy and cudamem
  share with Numba: in a program that uses them, do not call it.
- Under Numba's CUDA simulator (NUMBA_ENABLE_CUDASIM=1) there is no memory manager to replace:
  `import cudamem.numba` raises ImportError saying so.
- Cost: each allocation and free makes one call into libcudamem_c through ctypes.
"""
import contextlib
import ctypes
import operator
import os
import threading
import weakref

try:
    from numba import cuda as _cuda
except ImportError as _missing:
    raise ImportError("cudamem.numba needs numba-cuda, Numba's CUDA target (pip install "
                      "numba-cuda), which cannot be imported here: %s" % _missing) from None
if getattr(_cuda, "implementation", None) != "NVIDIA":
    raise ImportError("cudamem.numba needs numba-cuda, Numba's CUDA target (pip install "
                      "numba-cuda); this Numba has only its built-in CUDA target")
from numba.cuda.core import config as _config  # noqa: E402 (numba-cuda checked first)

if _config.ENABLE_CUDASIM:
    raise ImportError("cudamem.numba cannot serve Numba's CUDA simulator "
                      "(NUMBA_ENABLE_CUDASIM=1), which has no memory manager to replace: unset "
                      "NUMBA_ENABLE_CUDASIM to use cudamem with Numba")
from numba.cuda import utils as _utils  # noqa: E402
from numba.cuda.cudadrv import driver as _driver  # noqa: E402

from . import _native, _process  # noqa: E402
from ._errors import CudamemError, StateError  # noqa: E402
from ._errors import OutOfMemoryError as _CudamemOutOfMemory  # noqa: E402

__all__ = ["install", "is_installed", "stats", "report", "release", "CudamemNumbaManager",
           "OutOfMemoryError", "CudaIpcHandle", "VmmIpcHandle"]

_binding = _driver.binding
_LEGACY_STREAM = _binding.CUstream(_binding.CU_STREAM_LEGACY)
_shutting_down = _utils.shutting_down  # bound now: module globals may be gone at exit
_ENVIRONMENT = "NUMBA_CUDA_MEMORY_MANAGER=cudamem.numba"


class OutOfMemoryError(_driver.CudaAPIError, _CudamemOutOfMemory):
    """Numba's out-of-memory error (CudaAPIError, code CUDA_ERROR_OUT_OF_MEMORY), carrying
    cudamem's report."""

    def __init__(self, report, size):
        super().__init__(_binding.CUresult.CUDA_ERROR_OUT_OF_MEMORY,
                         "Call to cudamem_allocate results in CUDA_ERROR_OUT_OF_MEMORY: "
                         + report)
        self.report = report
        self.size = size

    def __reduce__(self):
        return (type(self), (self.report, self.size))


class _DeviceMemory:
    """What the plugin of one context keeps between Numba's calls: frees held by
    defer_cleanup, whether memory was freed since the last event on the legacy default stream,
    and the descriptors exported for IPC, by allocation. Finalizers reach it from any thread
    (and from the garbage collector inside a call of this class): one re-entrant lock."""

    def __init__(self, device):
        self.device = device
        self.lock = threading.RLock()
        self.deferring = 0
        self.held = []              # (ptr, size) freed inside defer_cleanup
        self.freed_since_event = False
        self.event = None           # recorded on the legacy default stream after frees
        self.exported = {}          # allocation -> _native.ipc_export's dict
        self.allocated = False      # reset() gives memory back only if there is any

    def allocate(self, size):
        """`size` bytes, ordered after every free before it (see the contract). The event goes
        on the legacy default stream after the allocation and before Numba queues any work on
        the memory, which is all the order needs. One lock around both a free (with its flag)
        and an allocation (with its event): memory freed by another thread can only reach this
        allocation if its flag is seen here; a free the garbage collector runs in this thread
        meanwhile takes the (re-entrant) lock and sets the flag for the next allocation."""
        with self.lock:
            try:
                ptr = _native.allocate(0, size, self.device, None)
            except _CudamemOutOfMemory as e:
                raise OutOfMemoryError(str(e), size) from None
            self.allocated = True
            if self.freed_since_event:
                self.freed_since_event = False
                if self.event is None:
                    self.event = _driver.driver.cuEventCreate(
                        int(_binding.CUevent_flags.CU_EVENT_DISABLE_TIMING))
                _driver.driver.cuEventRecord(self.event, _LEGACY_STREAM)
            return ptr

    def free(self, ptr, size):
        """Numba let go of the allocation at ptr: back to the pool, or held."""
        with self.lock:
            if self.deferring:
                self.held.append((ptr, size))
                return
            self._give_back(ptr, size)

    def _give_back(self, ptr, size):
        """(Under the lock.) The memory back to the pool, flagged for the next allocation."""
        for fd in self.exported.pop(ptr, {}).get("fds", ()):
            try:
                os.close(fd)
            except OSError:  # ours, opened by ipc_export: nothing else can be done
                pass
        self.freed_since_event = True
        try:
            _native.deallocate(0, ptr, size, self.device, None)
        except CudamemError:
            if not _shutting_down():  # at exit the CUDA runtime may be gone before us
                raise

    @contextlib.contextmanager
    def deferred(self):
        with self.lock:
            self.deferring += 1
        try:
            yield
        finally:
            with self.lock:
                self.deferring -= 1
                held, self.held = (self.held, []) if self.deferring == 0 else ([], self.held)
                if held:
                    _driver.driver.cuCtxSynchronize()  # every stream: what used them is done
                for ptr, size in held:
                    self._give_back(ptr, size)

    def export(self, ptr, size):
        """The allocation at ptr in shareable form, made once and kept while it lives."""
        with self.lock:
            found = self.exported.get(ptr)
            if found is None:
                found = self.exported[ptr] = _native.ipc_export(0, self.device, ptr, size)
            return found

    def reset(self):
        with self.lock:
            if self.event is not None:
                _driver.driver.cuEventDestroy(self.event)
                self.event = None
            if self.allocated and not self.deferring:
                _native.release(0, self.device)


def _finalizer(memory, allocations, ptr, size):
    """Numba's allocation table entry goes, then the memory (as Numba's own finalizers do; at
    reset() the table is already empty)."""
    def free():
        if allocations:
            allocations.pop(ptr, None)
        memory.free(ptr, size)
    return free


class CudamemNumbaManager(_driver.HostOnlyCUDAMemoryManager):
    """Numba's memory manager for one context over cudamem's process-wide allocator (see the
    module's contract). Numba makes one per context; install() or NUMBA_CUDA_MEMORY_MANAGER
    chooses it."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)  # context=None: set_memory_manager's version probe
        device = None if self.context is None else self.context.device.id
        self._memory = _DeviceMemory(device)

    @property
    def interface_version(self):
        return 1

    def initialize(self):
        _process.adopt_environment(_ENVIRONMENT)  # nothing when an install() came first

    def memalloc(self, size):
        context = weakref.proxy(self.context)
        if size == 0:  # as Numba makes empty arrays: no memory, nothing to free
            return _driver.MemoryPointer(context, _binding.CUdeviceptr(0), 0)
        ptr = self._memory.allocate(size)
        # As Numba's own manager: the table holds the pointer, views count references to it,
        # and the last one gone frees the memory (AutoFreePointer).
        memory = _driver.AutoFreePointer(
            context, _binding.CUdeviceptr(ptr), size,
            finalizer=_finalizer(self._memory, self.allocations, ptr, size))
        self.allocations[ptr] = memory
        return memory.own()

    def get_memory_info(self):
        free, total = _driver.driver.cuMemGetInfo()
        s = _native.stats(0, self._memory.device)
        available = free + max(s["reserved_bytes"] - s["in_use_bytes"], 0)
        if s["limit_bytes"] is not None:
            available = min(available, max(s["limit_bytes"] - s["in_use_bytes"], 0))
        return _driver.MemoryInfo(free=available, total=total)

    def get_ipc_handle(self, memory):
        owner = getattr(memory, "owner", None)  # the allocation under an array or a view
        base = getattr(owner, "device_pointer_value", None)
        if base is None or self.allocations.get(base) is not owner:
            return self._foreign_ipc_handle(memory)
        shared = self._memory.export(base, owner.size)
        offset = shared["offset"] + (memory.device_pointer_value - base)
        source_info = self.context.device.get_device_identity()
        if shared["kind"] == _native.IPC_CUDA_MALLOC:
            return _cuda_ipc_handle(memory, shared["ipc_mem_handle"], memory.size, source_info,
                                    offset)
        return VmmIpcHandle(memory, os.getpid(), shared["fds"], shared["handle_bytes"],
                            memory.size, source_info, offset)

    def _foreign_ipc_handle(self, memory):
        """Memory Numba did not allocate here (an array over another library's memory): what
        Numba's own manager does, and a clear error where the driver refuses."""
        try:
            return _driver.GetIpcHandleMixin.get_ipc_handle(self, memory)
        except _driver.CudaAPIError as e:
            raise CudamemError(
                "cudamem.numba: this array's memory was not allocated by Numba, and the CUDA "
                "driver cannot share it as a cudaIpcMemHandle (%s): share it through the "
                "library that allocated it" % e) from None

    def reset(self):
        super().reset()  # Numba's table emptied: the finalizers free what it still held
        self._memory.reset()

    @contextlib.contextmanager
    def defer_cleanup(self):
        with super().defer_cleanup():  # Numba's host-memory frees wait too
            with self._memory.deferred():
                yield


# cuda-bindings 13.4 made CUipcMemHandle opaque: no `reserved`, which Numba's IpcHandle reads
# to pickle itself and writes to rebuild. Its 64 bytes are reached through getPtr() instead.
_IPC_HANDLE_HAS_RESERVED = hasattr(_binding.CUipcMemHandle(), "reserved")


def _cuda_ipc_handle(memory, raw, size, source_info, offset):
    """An IpcHandle over a cudaIpcMemHandle's 64 bytes: Numba's own where it can be pickled
    (any receiver opens it), else a CudaIpcHandle."""
    handle = _binding.CUipcMemHandle()
    ctypes.memmove(handle.getPtr(), raw, len(raw))
    cls = _driver.IpcHandle if _IPC_HANDLE_HAS_RESERVED else CudaIpcHandle
    return cls(memory, handle, size, source_info, offset=offset)


class CudaIpcHandle(_driver.IpcHandle):
    """Numba's IpcHandle, pickled by the handle's bytes read through getPtr(): with cuda-bindings
    13.4 and later, Numba's own cannot be pickled (nor rebuilt) at all."""

    def __reduce__(self):
        raw = ctypes.string_at(self.handle.getPtr(), 64)
        return (_rebuild_cuda_ipc_handle, (raw, self.size, self.source_info, self.offset))


def _rebuild_cuda_ipc_handle(raw, size, source_info, offset):
    return _cuda_ipc_handle(None, raw, size, source_info, offset)


class VmmIpcHandle(_driver.IpcHandle):
    """Numba's IpcHandle for cudamem's virtual memory: the sender's pid, the fds of the
    physical handles under the array, their size, and the array's offset in them. open() in
    the receiver maps them (cudamem_ipc_import: pidfd_getfd, cuMemImportFromShareableHandle,
    cuMemMap); close() unmaps them."""

    def __init__(self, base, pid, fds, handle_bytes, size, source_info, offset):
        super().__init__(base, None, size, source_info=source_info, offset=offset)
        self.pid = pid
        self.fds = tuple(fds)
        self.handle_bytes = handle_bytes
        self._mapped = None

    def __reduce__(self):
        return (_rebuild_vmm_ipc_handle, (self.pid, self.fds, self.handle_bytes, self.size,
                                          self.source_info, self.offset))

    def open(self, context):
        if self.base is not None:
            raise ValueError("opening IpcHandle from original process")
        if self._mapped is not None:
            raise ValueError("IpcHandle is already opened")
        source = _driver.Device.from_identity(self.source_info).id
        mapped = _native.ipc_import(source, self.pid, self.fds, self.handle_bytes)
        try:
            if context.device.id != source:
                _native.ipc_add_peer(mapped, context.device.id)
        except BaseException:
            _native.ipc_unmap(mapped)
            raise
        self._mapped = mapped
        return _driver.MemoryPointer(weakref.proxy(context),
                                     _binding.CUdeviceptr(mapped + self.offset), self.size)

    open_direct = open
    open_staged = open  # the mapping is given to the receiver's device instead of a copy

    def close(self):
        if self._mapped is None:
            raise ValueError("IpcHandle not opened")
        mapped, self._mapped = self._mapped, None
        _native.ipc_unmap(mapped)


def _rebuild_vmm_ipc_handle(pid, fds, handle_bytes, size, source_info, offset):
    return VmmIpcHandle(None, pid, fds, handle_bytes, size, source_info, offset)


# NUMBA_CUDA_MEMORY_MANAGER=cudamem.numba: what Numba takes from the module it names.
_numba_memory_manager = CudamemNumbaManager

_lock = threading.Lock()
_installed = False


def install(resource="vm_pool", **options):
    """Makes cudamem Numba's memory manager (see the module's contract)."""
    global _installed
    with _lock:
        _native.config_text("cudamem.numba.install()", resource, options)  # names, types
        _refuse_if_too_late()
        _process.claim("cudamem.numba.install()", resource, options)
        if _driver._memory_manager is not CudamemNumbaManager:
            _driver.set_memory_manager(CudamemNumbaManager)
        _installed = True


def _refuse_if_too_late():
    """StateError when Numba has a context bound to another manager, or another plugin was
    chosen; nothing when the contexts are ours (loaded by name) or there are none."""
    for device in list(_driver.driver.devices.values()):
        context = device.primary_context
        if context is not None and not isinstance(context.memory_manager, CudamemNumbaManager):
            raise StateError(
                "cudamem.numba.install() must run before Numba makes its CUDA context (its "
                "first device array, kernel launch or numba.cuda.current_context()): the "
                "context of device %d uses %s already, and Numba binds a context to its memory "
                "manager for life. Call it at the start of the program, or set "
                "NUMBA_CUDA_MEMORY_MANAGER=cudamem.numba."
                % (device.id, type(context.memory_manager).__name__))
    chosen = _driver._memory_manager
    if chosen not in (None, CudamemNumbaManager, _driver.NumbaCUDAMemoryManager):
        raise StateError("cudamem.numba.install(): Numba's memory manager was set to %s.%s "
                         "(numba.cuda.set_memory_manager); one plugin serves a process"
                         % (chosen.__module__, chosen.__qualname__))
    named = _config.CUDA_MEMORY_MANAGER
    if named not in ("default", __name__):
        raise StateError("cudamem.numba.install(): NUMBA_CUDA_MEMORY_MANAGER=%s names another "
                         "memory manager; unset it, or set it to cudamem.numba" % named)


def is_installed():
    """Whether Numba's contexts are made with cudamem's manager: after install(), or once
    Numba has loaded it by name (NUMBA_CUDA_MEMORY_MANAGER, at its first context)."""
    return _installed or _driver._memory_manager is CudamemNumbaManager


def _device(device):
    if device is None:
        return _native.current_device()
    if isinstance(device, bool):
        raise TypeError("device must be an int or a Numba device, not bool")
    if hasattr(device, "id"):  # numba.cuda.gpus[i], a context's device
        return device.id
    try:
        return operator.index(device)
    except TypeError:
        raise TypeError("device must be an int or a Numba device, not %s"
                        % type(device).__name__) from None


def stats(device=None):
    """What cudamem holds for one device (see cudamem.torch.stats); None: the current one."""
    return _native.stats(0, _device(device))


def report(device=None, nbytes=0):
    """cudamem's memory report for one device, as text."""
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
        raise TypeError("nbytes must be a non-negative int")
    return _native.report(0, _device(device), nbytes)


def release(device=None):
    """Gives wholly free memory back to the device; returns the bytes given back."""
    return _native.release(0, -1 if device is None else _device(device))
