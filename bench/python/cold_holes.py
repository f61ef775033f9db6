"""The cost of a large tensor made in memory that frees left in pieces (the target: at most
1.2x the time of PyTorch's default allocator):
    python3 bench/python/cold_holes.py default|cudamem
    CUDAMEM_HANDLE_BYTES=32MiB python3 bench/python/cold_holes.py cudamem
fills the device, all but 6 GiB, with 64 MiB tensors (each timed), frees every other one, then
asks for 128 MiB tensors (each timed) until the holes are used or one fails. Prints medians in
ms. PyTorch's default can use no hole for a 128 MiB tensor: it gives its cached blocks back and
calls cudaMalloc; cudamem's vm_pool maps freed handles side by side again, one driver call per
handle. One allocator per process: run it once per allocator (and handle size), one after
another on the same machine, and compare within that run."""
import statistics
import sys
import time

MiB = 1 << 20


def timed(make):
    start = time.perf_counter()
    value = make()
    return value, time.perf_counter() - start


def main():
    if len(sys.argv) != 2 or sys.argv[1] not in ("default", "cudamem"):
        sys.exit("usage: cold_holes.py default|cudamem")
    import torch
    if sys.argv[1] == "cudamem":
        import cudamem.torch
        cudamem.torch.install()
    torch.ones(1, device="cuda")
    torch.cuda.synchronize()
    free, _ = torch.cuda.mem_get_info()
    count = int((free - (6 << 30)) // (64 * MiB))
    held, fill = [], []
    for _ in range(count):
        tensor, seconds = timed(lambda: torch.empty(64 * MiB, dtype=torch.uint8, device="cuda"))
        held.append(tensor)
        fill.append(seconds)
    del held[::2]
    kept, large = [], []
    for _ in range(count // 4):
        try:
            tensor, seconds = timed(
                lambda: torch.empty(128 * MiB, dtype=torch.uint8, device="cuda"))
        except torch.OutOfMemoryError:
            break
        kept.append(tensor)
        large.append(seconds)

    def ms(values):
        return round(1000 * statistics.median(values), 3) if values else float("nan")

    print(sys.argv[1], "64 MiB fill: median ms", ms(fill), "(first 16:", ms(fill[:16]),
          ") | 128 MiB in the holes: median ms", ms(large), "for", len(large), "of",
          count // 4)


if __name__ == "__main__":
    main()
