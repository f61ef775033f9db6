"""A loop whose tensors change size from one iteration to the next runs
out of memory while much of the device is free, and reducing the batch or calling
torch.cuda.empty_cache() does not help. The same loop, run twice in fresh processes — with
PyTorch's own allocator, then with one line added, cudamem.torch.install() — prints how far
each got.

    pip install ./python                  # once (the README: "From PyTorch, CuPy and Numba")
    python3 examples/python/fragmenting_loop.py

It uses the installed package, as any program would: PyTorch and a CUDA device are needed.

What the loop does: every iteration makes one large activation-like tensor of a size that
varies (8 MiB .. 1 GiB) and keeps it for a few iterations, and keeps a few small tensors for
good (statistics, caches, logged values, 64 KiB .. 2 MiB), the way a training loop with
variable sequence lengths does. PyTorch's caching allocator carves tensors out of segments;
small long-lived tensors end up between the large ones, and a segment with one small live
tensor in it cannot serve a large request. cudamem's vm_pool maps physical memory into a
virtual range and moves free pages together when nothing fits, so free memory stays usable.
"""
import math
import os
import random
import subprocess
import sys

MiB, GiB = 1 << 20, 1 << 30


def loop(use_cudamem):
    import torch
    if use_cudamem:
        import cudamem.torch
        cudamem.torch.install()          # the one line: before the first CUDA tensor
    free_at_start, _ = torch.cuda.mem_get_info()
    rng = random.Random(4)
    window, keep, live, iterations = [], [], 0, 0
    try:
        while True:
            size = int(math.exp(rng.uniform(math.log(8 * MiB), math.log(GiB)))) // 512 * 512
            window.append(torch.empty(size, dtype=torch.uint8, device="cuda"))
            live += size
            for _ in range(rng.randint(0, 3)):
                s = int(math.exp(rng.uniform(math.log(64 << 10), math.log(2 * MiB)))) // 512 * 512
                keep.append(torch.empty(s, dtype=torch.uint8, device="cuda"))
                live += s
            while sum(t.numel() for t in window) > free_at_start // 2:
                live -= window.pop(rng.randrange(len(window))).numel()
            iterations += 1
    except torch.OutOfMemoryError as e:
        message = str(e).splitlines()[0][:160]
    print("%-28s ran %6d iterations; out of memory with %5.1f of %5.1f GiB in use (%.0f%%)"
          % ("cudamem.torch.install():" if use_cudamem else "PyTorch's allocator:", iterations,
             live / GiB, free_at_start / GiB, 100.0 * live / free_at_start))
    print("    the error began: %s" % message)
    if use_cudamem:
        import cudamem.torch
        s = cudamem.torch.stats()
        print("    cudamem holds %.1f GiB, %.1f GiB in use; largest free block %.2f GiB"
              % (s["reserved_bytes"] / GiB, s["in_use_bytes"] / GiB,
                 (s["largest_free_block"] or 0) / GiB))


def main():
    if len(sys.argv) > 1:
        loop(sys.argv[1] == "cudamem")
        return
    for which in ("pytorch", "cudamem"):  # fresh processes: an allocator is chosen once
        subprocess.run([sys.executable, os.path.abspath(__file__), which], check=True)


if __name__ == "__main__":
    main()
