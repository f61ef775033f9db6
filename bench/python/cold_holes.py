"""A cold trace that mixes filling and reuse: with only `--free-gib` of the device free (a
cudaMalloc'd ballast outside every allocator stands for another process), fill it with 64 MiB
tensors, free every other one, then fill the holes with 128 MiB tensors until one fails. Each
allocator runs in a fresh process of its own, the allocators in turns, `--rounds` times:

    python3 bench/python/cold_holes.py                     # default, expandable, cudamem: 3 rounds
    python3 bench/python/cold_holes.py --allocators default,cudamem --rounds 5 --free-gib 24

Prints, per round and allocator, the whole trace's time per operation (both phases together,
every torch.empty and every free), the 64 MiB fill's and the 128 MiB phase's, and the fraction
of the free memory live at the end; then each allocator's medians (min-max over the rounds) and
their ratio to the default's. Every tensor is synchronised before its time is taken, so the
driver's work is counted. PyTorch's default can use no hole for a 128 MiB tensor: it gives its
cached blocks back and calls cudaMalloc; cudamem's vm_pool maps freed handles side by side again,
one driver call per handle (and grows ahead of need on a thread of its own during the fill).
Allocators: see common.py (default, expandable, cudamem, cudamem:key=value,...)."""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

MiB = 1 << 20


def child(free_gib):
    """One allocator (named by the environment), one trace; prints one JSON line."""
    allocator = common.set_up()
    import torch
    torch.ones(1, device="cuda")
    common.cap_free_memory(int(free_gib * (1 << 30)))
    torch.cuda.synchronize()
    free, _ = torch.cuda.mem_get_info()
    count = int(free // (64 * MiB))

    def timed(action):
        start = time.perf_counter()
        value = action()
        torch.cuda.synchronize()
        return value, time.perf_counter() - start

    fill_seconds, held = 0.0, []
    fill_ops = 0
    for _ in range(count):
        try:
            tensor, seconds = timed(lambda: torch.empty(64 * MiB, dtype=torch.uint8, device="cuda"))
        except torch.OutOfMemoryError:
            break
        held.append(tensor)
        fill_seconds += seconds
        fill_ops += 1
    start = time.perf_counter()
    del held[::2]
    torch.cuda.synchronize()
    free_seconds = time.perf_counter() - start
    free_ops = fill_ops - len(held)
    large_seconds, large_ops = 0.0, 0
    kept = []
    while True:
        try:
            tensor, seconds = timed(
                lambda: torch.empty(128 * MiB, dtype=torch.uint8, device="cuda"))
        except torch.OutOfMemoryError:
            break
        kept.append(tensor)
        large_seconds += seconds
        large_ops += 1
    live = (len(held) * 64 + len(kept) * 128) * MiB
    ops = fill_ops + free_ops + large_ops
    print(json.dumps({
        "allocator": allocator,
        "trace_us_per_op": 1e6 * (fill_seconds + free_seconds + large_seconds) / ops,
        "fill_us_per_op": 1e6 * fill_seconds / max(fill_ops, 1),
        "large_us_per_op": 1e6 * large_seconds / max(large_ops, 1),
        "fill_ops": fill_ops, "large_ops": large_ops,
        "live_fraction": live / free,
    }), flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--allocators", default="default,expandable,cudamem")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--free-gib", type=float, default=24.0,
                        help="device memory left free for the trace (0: all of it)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args.free_gib)
    if args.rounds < 1 or args.free_gib < 0:
        parser.error("--rounds must be at least 1 and --free-gib not negative")
    allocators = args.allocators.split(",")
    results = {a: [] for a in allocators}
    for round_ in range(args.rounds):
        for allocator in allocators:
            done = subprocess.run([sys.executable, os.path.abspath(__file__), "--child",
                                   "--free-gib", str(args.free_gib)],
                                  env=common.environment_for(allocator), capture_output=True,
                                  text=True)
            lines = [l for l in done.stdout.splitlines() if l.startswith("{")]
            if done.returncode != 0 or not lines:
                sys.exit("%s failed (exit %d):\n%s" % (allocator, done.returncode,
                                                         done.stderr[-3000:]))
            r = json.loads(lines[-1])
            results[allocator].append(r)
            print("round %d %-12s trace %8.1f us/op | 64 MiB fill %8.1f us/op (%d) | 128 MiB "
                  "in holes %8.1f us/op (%d) | live %.4f" % (
                      round_ + 1, allocator, r["trace_us_per_op"], r["fill_us_per_op"],
                      r["fill_ops"], r["large_us_per_op"], r["large_ops"], r["live_fraction"]),
                  flush=True)
    base = allocators[0]
    print("medians over %d rounds (min-max), ratio to %s's median:" % (args.rounds, base))
    for key, title in (("trace_us_per_op", "whole trace, us per op"),
                       ("fill_us_per_op", "64 MiB fill, us per op"),
                       ("large_us_per_op", "128 MiB in the holes, us per op"),
                       ("live_fraction", "live at the end / free at the start")):
        reference = statistics.median(r[key] for r in results[base])
        cells = []
        for allocator in allocators:
            values = [r[key] for r in results[allocator]]
            median = statistics.median(values)
            cells.append("%s %.4g (%.4g-%.4g) %.2fx" % (allocator, median, min(values),
                                                       max(values), median / reference))
        print("  %-38s %s" % (title, " | ".join(cells)))


if __name__ == "__main__":
    main()
