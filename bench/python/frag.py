"""Fragmentation through torch.empty: how much of the device an allocator lets a program keep
live before its first out-of-memory error.

    python3 frag.py [--trace mixed|swiss] [--free-gib N] [--seed S]     (one allocator: the
                                                    one run_all.py names in the environment)

mixed (the seeds' situation): large short-lived tensors, 8 MiB to 1 GiB (log-uniform), come
and go while small long-lived ones, 64 KiB to 2 MiB, pile up between them. The large ones are
kept under half of the free memory by freeing random ones; the small ones grow until
something fails. Printed: live bytes at the first failed allocation / free bytes at the start.
A failed allocation is any exception from torch.empty: an allocator that handed back a
tensor without memory would be caught by the check that every tensor's data_ptr is non-zero.

swiss: fill the device with 64 MiB tensors, free every other one, then ask for 128 MiB ones
until one fails. Printed: bytes of the new tensors / bytes freed.
"""
import argparse
import math
import random
import sys

import common


def mixed(torch, free0, rng):
    small, large, large_bytes, live = [], [], 0, 0
    large_cap = free0 // 2
    while True:
        size = int(math.exp(rng.uniform(math.log(8 * common.MiB), math.log(common.GiB))))
        size -= size % 512
        try:
            t = torch.empty(size, dtype=torch.uint8, device="cuda")
        except Exception as e:  # noqa: BLE001 - classified below
            if common.is_oom(e):
                return live, "large %d MiB" % (size >> 20)
            raise
        assert t.data_ptr() != 0, "an allocation without memory"
        large.append(t)
        large_bytes += size
        live += size
        for _ in range(rng.randint(0, 3)):
            s = int(math.exp(rng.uniform(math.log(64 << 10), math.log(2 * common.MiB))))
            s -= s % 512
            try:
                u = torch.empty(s, dtype=torch.uint8, device="cuda")
            except Exception as e:  # noqa: BLE001
                if common.is_oom(e):
                    return live, "small %d KiB" % (s >> 10)
                raise
            assert u.data_ptr() != 0, "an allocation without memory"
            small.append(u)
            live += s
        while large_bytes > large_cap:
            victim = large.pop(rng.randrange(len(large)))
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
    parser.add_argument("--trace", choices=["mixed", "swiss"], default="mixed")
    parser.add_argument("--free-gib", type=float, default=0,
                        help="cap the device's free memory with a ballast (0: the whole device)")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    allocator = common.set_up()
    import torch
    torch.cuda.init()
    common.cap_free_memory(int(args.free_gib * common.GiB))
    free0, _ = torch.cuda.mem_get_info()
    if args.trace == "mixed":
        live, failed = mixed(torch, free0, random.Random(args.seed))
        print("RESULT mixed %s %.4f (live %.2f GiB of %.2f GiB free at start; failed: %s)"
              % (allocator, live / free0, live / common.GiB, free0 / common.GiB, failed))
    else:
        got, freed = swiss(torch, free0)
        print("RESULT swiss %s %.4f (%.2f GiB of 128 MiB tensors in %.2f GiB freed)"
              % (allocator, got / freed, got / common.GiB, freed / common.GiB))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
