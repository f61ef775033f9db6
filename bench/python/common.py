"""What every PyTorch benchmark here shares: the allocators compared, each set up in a fresh
process before PyTorch's first CUDA allocation, and a ballast that caps the free memory so
that every allocator meets the same, smaller device (a plain cudaMalloc outside all of them).

    allocators: default     PyTorch's caching allocator
                expandable  the same with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
                cudamem     cudamem.torch.install() (vm_pool)
                cudamem:k=v,k=v  cudamem.torch.install(k=v, ...): another stack or options,
                            e.g. cudamem:resource=pool or cudamem:handle_bytes=16MiB
"""
import ctypes
import os
import sys

ALLOCATORS = ("default", "expandable", "cudamem")
MiB = 1 << 20
GiB = 1 << 30


def environment_for(allocator):
    """Environment a child needs for `allocator` (PyTorch reads its variable at import)."""
    env = dict(os.environ)
    env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    if allocator == "expandable":
        env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    env["CUDAMEM_BENCH_ALLOCATOR"] = allocator
    env["PYTHONUNBUFFERED"] = "1"
    here = os.path.dirname(os.path.abspath(__file__))
    package = os.path.join(here, "..", "..", "python")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package, env.get("PYTHONPATH")) if p)
    return env


def set_up():
    """In the child: the allocator named by the environment, ready before any allocation."""
    allocator = os.environ.get("CUDAMEM_BENCH_ALLOCATOR", "default")
    import torch  # noqa: F401  (imported here, after the environment is set)
    if allocator == "cudamem" or allocator.startswith("cudamem:"):
        import cudamem.torch
        cudamem.torch.install(**cudamem_options(allocator))
    return allocator


def cudamem_options(allocator):
    """install()'s keyword arguments for "cudamem" or "cudamem:key=value,key=value"."""
    _, _, text = allocator.partition(":")
    options = {}
    for item in filter(None, text.split(",")):
        key, _, value = item.partition("=")
        options[key.strip()] = int(value) if value.strip().isdigit() else value.strip()
    return options


_ballast = []


def cap_free_memory(free_bytes):
    """Takes device memory outside every allocator (cudaMalloc, through the CUDA runtime that
    PyTorch loaded) until about `free_bytes` stay free; 0 or None: nothing."""
    import torch
    if not free_bytes:
        return
    free, _ = torch.cuda.mem_get_info()
    take = free - free_bytes
    if take <= 0:
        return
    runtime = _cudart()
    p = ctypes.c_void_p()
    status = runtime.cudaMalloc(ctypes.byref(p), ctypes.c_size_t(take))
    if status != 0:
        sys.exit("cudaMalloc of the ballast (%d bytes) failed: %d" % (take, status))
    _ballast.append(p)


def _cudart():
    import glob
    import torch
    roots = [os.path.dirname(torch.__file__), os.path.join(os.path.dirname(torch.__file__), "..")]
    for root in roots:
        for pattern in ("lib/libcudart.so*", "nvidia/cu*/lib/libcudart.so*",
                        "nvidia/cuda_runtime/lib/libcudart.so*"):
            found = sorted(glob.glob(os.path.join(root, pattern)))
            if found:
                return ctypes.CDLL(found[0])
    return ctypes.CDLL("libcudart.so")


def is_oom(error):
    """A failed allocation, whatever the allocator raised."""
    import torch
    return isinstance(error, torch.OutOfMemoryError) or (
        isinstance(error, RuntimeError) and "out of memory" in str(error).lower())


def median(values):
    ordered = sorted(values)
    n = len(ordered)
    return ordered[n // 2] if n % 2 else 0.5 * (ordered[n // 2 - 1] + ordered[n // 2])


def allocator_name():
    return os.environ.get("CUDAMEM_BENCH_ALLOCATOR", "default")


def print_cudamem_notes():
    """Under cudamem: what it holds (stats()) and, after a failure, the report's first lines,
    as NOTE lines (run_all.py prints them): why an allocation failed, or what a speed run
    left held. Under PyTorch's own: its retries and calls to the driver, to compare."""
    if not allocator_name().startswith("cudamem"):
        import torch  # PyTorch's own: how often it went back to the driver, or retried
        stats = torch.cuda.memory_stats()
        keys = ("num_alloc_retries", "num_device_alloc", "num_device_free", "num_ooms")
        print("NOTE stats: " + ", ".join("%s=%s" % (k, stats.get(k)) for k in keys))
        sys.stdout.flush()
        return
    import cudamem.torch
    stats = cudamem.torch.stats()
    print("NOTE stats: " + ", ".join("%s=%s" % (k, stats[k]) for k in sorted(stats)))
    report = cudamem.torch.last_oom_report()
    for line in report.splitlines()[:40]:
        print("NOTE report: " + line)
    sys.stdout.flush()
