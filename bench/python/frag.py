"""Fragmentation through torch.empty: how much of the device an allocator lets a program keep
live before its first out-of-memory error.

    python3 frag.py [--trace mixed|swiss] [--free-gib N] [--seed S]     (one allocator: the
                                                    one run_all.py names in the environment)

mixed (seeds 001/004 in miniature; the mixed trace of bench/support/fragmentation.hpp, the
one bench_fragmentation runs in C++, through torch.empty): each step makes one large,
short-lived tensor (8 MiB to 1 GiB, log-uniform; the last 4 stay alive) and 3 small, long-lived
ones (64 KiB to 2 MiB) that pile up, like a training loop whose activations come and go
between parameters, caches and logs that stay. heavy: the same sizes, but large tensors are
kept alive up to half of the free memory and freed in random order, so the small ones land
among many more holes. Printed: live bytes at the first failed allocation / free bytes at the
start. A failed allocation is any exception from torch.empty (an allocator that handed back a
tensor without memory would be caught: every tensor's data_ptr is checked).

swiss: fill the device with 64 MiB tensors, free every other one, then ask for 128 MiB ones
until one fails. Printed: bytes of the new tensors / bytes freed.
"""
import argparse
import math
import random
import sys

import common


def mixed(torch, free0, rng, heavy):
    """Runs the mixed (or heavy) trace to its first failure: (live bytes then, what failed)."""
    small, large, large_bytes, live = [], [], 0, 0
    large_cap = free0 // 2

    def make(size, kind):
        try:
            t = torch.empty(size, dtype=torch.uint8, device="cuda")
        except Exception as e:  # noqa: BLE001 - classified below
            if common.is_oom(e):
                return None, "%s %d KiB" % (kind, size >> 10)
            raise
        assert t.data_ptr() != 0, "an allocation without memory"
        return t, None

    while True:
        size = int(math.exp(rng.uniform(math.log(8 * common.MiB), math.log(common.GiB))))
        t, failed = make(size - size % 512, "large")
        if failed:
            return live, failed
        large.append(t)
        large_bytes += t.numel()
        live += t.numel()
        for _ in range(rng.randint(0, 3) if heavy else 3):
            s = int(math.exp(rng.uniform(math.log(64 << 10), math.log(2 * common.MiB))))
            u, failed = make(s - s % 512, "small")
            if failed:
                return live, failed
            small.append(u)
            live += u.numel()
        while (large_bytes > large_cap) if heavy else (len(large) > 4):
            victim = large.pop(rng.randrange(len(large)) if heavy else 0)
            large_bytes -= victim.numel()
            live -= victim.numel()
            del victim


def swiss(torch, free0):
    blocks = []
    while True:
        try:
            blocks.append(torch.empty(64 * common.MiB, dtype=torch.uint8, device="cuda"))
        except Exception as e:  # noqa: BLE001
            if not common.is_oom(e):
                raise
            break
    freed = 0
    for i in range(0, len(blocks), 2):
        freed += blocks[i].numel()
        blocks[i] = None
    got = []
    while True:
        try:
            got.append(torch.empty(128 * common.MiB, dtype=torch.uint8, device="cuda"))
        except Exception as e:  # noqa: BLE001
            if not common.is_oom(e):
                raise
            return sum(t.numel() for t in got), freed


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--trace", choices=["mixed", "heavy", "swiss"], default="mixed")
    parser.add_argument("--free-gib", type=float, default=0,
                        help="cap the device's free memory with a ballast (0: the whole device)")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    allocator = common.set_up()
    import torch
    torch.cuda.init()
    common.cap_free_memory(int(args.free_gib * common.GiB))
    free0, _ = torch.cuda.mem_get_info()
    if args.trace in ("mixed", "heavy"):
        live, failed = mixed(torch, free0, random.Random(args.seed), args.trace == "heavy")
        print("RESULT %s %s %.4f (live %.2f GiB of %.2f GiB free at start; failed: %s)"
              % (args.trace, allocator, live / free0, live / common.GiB,
                 free0 / common.GiB, failed))
    else:
        got, freed = swiss(torch, free0)
        print("RESULT swiss %s %.4f (%.2f GiB of 128 MiB tensors in %.2f GiB freed)"
              % (allocator, got / freed, got / common.GiB, freed / common.GiB))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
