"""Per-operation cost of torch.empty + free under one allocator (run_all.py names it):
    python3 overhead.py [--iterations N]
prints ns per allocate+free pair, median of 7 rounds, for a fixed 1 MiB tensor and for sizes
cycling through 4 KiB .. 16 MiB. Everything PyTorch does around the allocator is included
(the dispatcher, the tensor object; under a pluggable allocator PyTorch's own map of
allocations): the difference between allocators is what the allocator path costs."""
import argparse
import sys
import time

import common


def pairs(torch, sizes, iterations):
    t = time.perf_counter_ns()
    n = len(sizes)
    for i in range(iterations):
        x = torch.empty(sizes[i % n], dtype=torch.uint8, device="cuda")
        del x
    return (time.perf_counter_ns() - t) / iterations


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--iterations", type=int, default=100_000)
    args = parser.parse_args()
    allocator = common.set_up()
    import torch
    torch.cuda.init()
    fixed = [common.MiB]
    mixed = [4096 << (i % 13) for i in range(13)]  # 4 KiB .. 16 MiB
    for name, sizes in (("1MiB", fixed), ("4KiB-16MiB", mixed)):
        pairs(torch, sizes, args.iterations // 10)  # warm: the pools hold what the loop needs
        rounds = [pairs(torch, sizes, args.iterations) for _ in range(7)]
        print("RESULT overhead %s %s %.0f ns per pair" % (allocator, name, common.median(rounds)))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
