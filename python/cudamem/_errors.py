"""cudamem's exceptions in Python (one per status of the C library)."""


class CudamemError(RuntimeError):
    """A cudamem call failed (a CUDA error, or a call at the wrong time)."""


class ConfigError(CudamemError, ValueError):
    """A configuration, a device or a pointer that cudamem refuses; the message says which."""


class OptionError(ConfigError, TypeError):
    """An option install() or pool() does not take, or a value of the wrong type: a
    ConfigError, and the TypeError Python raises for a bad keyword argument."""


class StateError(CudamemError):
    """A call the allocator's state forbids (configuring it after its first allocation, ...)."""


class NoDeviceError(CudamemError):
    """No usable CUDA device."""


class OutOfMemoryError(CudamemError, MemoryError):
    """An allocation cudamem could not meet; the message is cudamem's report: who holds the
    device, what each resource holds, a verdict and advice."""


class TorchAllocatorError(CudamemError):
    """cudamem.torch.install() cannot make cudamem PyTorch's whole allocator: an unsupported
    PyTorch release, no C++ compiler, no CUDA runtime headers of PyTorch's CUDA version, or a
    build that failed. The message says which, and what to do."""
