"""PyTorch, CuPy and Numba in one program on one set of cudamem pools: the model's tensors in
PyTorch, a custom kernel's buffers in CuPy and Numba, all of it counted by cudamem.stats(), and
memory one library frees serving the next library's request.

    pip install ./python                  # once (the README: "From PyTorch, CuPy and Numba")
    python3 examples/python/three_libraries.py

It uses the installed package, as any program would: PyTorch, CuPy, numba-cuda and a CUDA
device are needed.

Without cudamem each library keeps a cache of its own: memory PyTorch frees stays in PyTorch's
cache, where CuPy and Numba cannot use it, and no one can say what the device holds in all.
With the three installs below (one line each, before each library's first allocation) every
allocation comes from cudamem's pools, whichever library asks.
"""
import numpy as np

MiB, GiB = 1 << 20, 1 << 30


def main():
    import cupy
    import torch
    from numba import cuda

    import cudamem
    import cudamem.cupy
    import cudamem.numba
    import cudamem.torch
    cudamem.torch.install()
    cudamem.cupy.install()                 # the same options: the same pools
    cudamem.numba.install()

    @cuda.jit
    def scale(x, factor):                  # a custom kernel, run on PyTorch's memory too
        i = cuda.grid(1)
        if i < x.size:
            x[i] *= factor

    weights = torch.ones(64 * MiB // 4, device="cuda")                  # 64 MiB
    table = cupy.arange(32 * MiB // 4, dtype=cupy.float32)               # 32 MiB
    scratch = cuda.to_device(np.full(16 * MiB // 4, 3, dtype=np.float32))  # 16 MiB
    scale[(weights.numel() + 255) // 256, 256](cuda.as_cuda_array(weights), 2.0)
    scale[(scratch.size + 255) // 256, 256](scratch, 2.0)
    cuda.synchronize()
    print("PyTorch holds %5.1f MiB (torch.cuda.memory_allocated), its weights are %.1f"
          % (torch.cuda.memory_allocated() / MiB, float(weights[0])))
    print("CuPy    holds %5.1f MiB (its arrays)" % (table.nbytes / MiB))
    print("Numba   holds %5.1f MiB (its arrays), its scratch is %.1f"
          % (scratch.nbytes / MiB, float(scratch[:1].copy_to_host()[0])))
    show(cudamem.stats())

    # PyTorch lets go of 4 GiB; Numba asks for 4 GiB: the same memory, not more of the device.
    activations = torch.empty(4 * GiB, dtype=torch.uint8, device="cuda")
    freed_at = activations.data_ptr()
    del activations
    buffer = cuda.device_array(4 * GiB, dtype=np.uint8)
    print("Numba's 4 GiB buffer took the memory PyTorch freed: %s"
          % ("yes" if buffer.device_ctypes_pointer.value == freed_at else "no"))
    show(cudamem.stats())


def show(s):
    print("cudamem.stats(): %.1f MiB in use by all three, %.1f MiB reserved from the device, "
          "%d allocations" % (s["in_use_bytes"] / MiB, s["reserved_bytes"] / MiB,
                              s["allocations"]))


if __name__ == "__main__":
    main()
