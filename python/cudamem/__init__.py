"""cudamem: fragmentation-proof CUDA memory pools for PyTorch and CuPy.

    import cudamem.torch
    cudamem.torch.install()                  # before PyTorch's first CUDA allocation

    import cudamem.cupy
    cudamem.cupy.install()                   # CuPy allocates through the same pools

PyTorch and CuPy are imported only by their submodules, and needed only to use them.
"""
from ._errors import (ConfigError, CudamemError, NoDeviceError, OutOfMemoryError,
                      StateError, TorchAllocatorError)

__version__ = "0.1.0"

__all__ = ["ConfigError", "CudamemError", "NoDeviceError", "OutOfMemoryError", "StateError",
           "TorchAllocatorError", "__version__"]
