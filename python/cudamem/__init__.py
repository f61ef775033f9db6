"""cudamem: fragmentation-proof CUDA memory pools for PyTorch, CuPy and Numba.

    import cudamem.torch
    cudamem.torch.install()                  # before PyTorch's first CUDA allocation

    import cudamem.cupy
    cudamem.cupy.install()                   # CuPy allocates through the same pools

    import cudamem.numba
    cudamem.numba.install()                  # Numba too (before its first CUDA context)

    cudamem.stats()                          # what the pools hold, all three libraries counted

PyTorch, CuPy and Numba are imported only by their submodules, and needed only to use them.
"""
import operator

from ._errors import (ConfigError, CudamemError, NoDeviceError, OutOfMemoryError,
                      StateError, TorchAllocatorError)

__version__ = "0.1.0"

__all__ = ["ConfigError", "CudamemError", "NoDeviceError", "OutOfMemoryError", "StateError",
           "TorchAllocatorError", "stats", "__version__"]


def stats(device=None):
    """What cudamem's process-wide allocator (the one cudamem.torch, cudamem.cupy and
    cudamem.numba install) holds on one device, whichever library asked for the memory: the
    dict cudamem.torch.stats() describes. `device`: an int; None: the calling thread's current
    CUDA device (the device of the context PyTorch, CuPy or Numba made current, else the one
    cudaSetDevice chose, else 0). Imports none of the three libraries."""
    from . import _native  # the library is loaded at the first call, not at `import cudamem`
    if device is None:
        device = _native.current_device()
    elif isinstance(device, bool):
        raise TypeError("cudamem.stats: device must be an int, not bool")
    else:
        try:
            device = operator.index(device)
        except TypeError:
            raise TypeError("cudamem.stats: device must be an int, not %s"
                            % type(device).__name__) from None
    return _native.stats(0, device)
