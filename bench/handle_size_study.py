#!/usr/bin/env python3
"""bench/handle_size_study.py — vm_pool's handle size, on the host: stranded memory against the
driver's per-handle cost of recycling (bench/README.md, "Handle size: stranded memory against
recycling cost"). No GPU: everything runs on the simulated device.

    cmake --build build --target bench_fragmentation bench_replay
    python3 bench/handle_size_study.py [--build build] [--out /tmp/handle_size_study]

For each handle size (2 to 64 MiB) it runs
1. bench_fragmentation --simulated --only vm_pool --variant all --seeds 42,1..7 --handle-mib H:
   the live fraction at the first failure, per variant and seed, cold and warm;
2. bench_fragmentation --simulated --only vm_pool --variant none --detail
   --simulated-driver-us 20,34 --handle-mib H, three times: swiss cheese's 128 MiB phase over its
   320 blocks is the time of one 128 MiB request made of recycled handles;
3. bench_replay --resource vm_pool --handle-bytes H over PyTorch-like logs (written here: sizes
   log-uniform 1 MiB..1 GiB rounded to 512 B, allocate with probability 0.55 under 40 GiB live,
   else free a random live block; seeds 1..5) and the standard trace random_1KiB-64MiB: the least
   device each completes on (bisected in MiB), over its peak in use.
Why 3: the bench's two traces hardly strand memory at any of these sizes (swiss cheese's blocks
are whole handles, the mixed trace's large blocks are short-lived), so they cannot show what
larger handles cost where tensors of every size stay alive. Raw outputs go to --out.
"""
import argparse
import math
import os
import random
import re
import statistics
import subprocess

HANDLES = [2, 4, 8, 16, 32, 64]
VARIANTS = ["bench", "wide", "many-small", "tiny", "window16", "streams4"]
SEEDS = "42,1,2,3,4,5,6,7"


def spread(values, fmt):
    return f"{fmt % statistics.median(values)} ({fmt % min(values)}-{fmt % max(values)})"


def table(header, rows):
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in rows:
        print("| " + " | ".join(row) + " |")
    print()


def write_torch_like_log(path, seed, cap_gib=40, ops=20000):
    """The PyTorch-like log (bench_replay's format, cudamem/log_format.hpp)."""
    rng = random.Random(seed)
    live, total, address, t = [], 0, 0x4000000000000000, 1000
    cap = cap_gib << 30
    with open(path, "w") as f:
        f.write("# cudamem log v1\nkind,t_ns,thread,stream,ptr,bytes,align,reserved\n")
        for _ in range(ops):
            t += 1000
            if live and (total >= cap or rng.random() >= 0.55):
                j = rng.randrange(len(live))
                p, n = live[j]
                live[j] = live[-1]
                live.pop()
                total -= n
                f.write(f"F,{t},1,sync,{p:#x},{n},256,\n")
            else:
                n = int(math.exp(rng.uniform(math.log(1 << 20), math.log(1 << 30))))
                n = (n + 511) // 512 * 512
                p = address
                address += (n >> 21 << 21) + (4 << 20)  # never overlapping, never reused
                live.append((p, n))
                total += n
                f.write(f"A,{t},1,sync,{p:#x},{n},256,\n")
        for p, n in live:
            t += 1000
            f.write(f"F,{t},1,sync,{p:#x},{n},256,\n")


def least_device(replay, log, handle_mib):
    """The least capacity (MiB) on which the log completes, and its peak in use (MiB)."""
    def run(cap_mib):
        r = subprocess.run([replay, log, "--resource", "vm_pool", "--handle-bytes",
                            f"{handle_mib}MiB", "--capacity", f"{cap_mib}MiB"],
                           capture_output=True, text=True)
        return r.returncode, r.stdout
    _, out = run(1 << 20)
    peak = float(re.search(r"peak in use:\s+([\d.]+) GiB", out).group(1)) * 1024
    lo, hi = int(peak) - 1, int(peak * 2)
    assert run(hi)[0] == 0, (log, handle_mib, hi)
    while hi - lo > 2:  # completion is assumed monotonic in the capacity
        mid = (lo + hi) // 2
        if run(mid)[0] == 0:
            hi = mid
        else:
            lo = mid
    return hi, peak


def rounding_model(logs):
    """Handles as pure rounding, no allocator: each block of a handle or more (4 MiB for the
    schemes of several sizes) held in whole handles of its scheme, smaller ones packed exactly
    (the pool's, as in vm_pool). Prints the peak of the held live bytes over the peak of the
    requested ones, and handles made per GiB of blocks of 4 MiB or more (a handle costs ~34 us
    each time it is recycled; the pool's chunks are not counted). The uniform rows check the model
    against the replays; the others are schemes no allocator implements yet."""
    mib = 1 << 20

    def pow2_floor(x):
        return 1 << (x.bit_length() - 1)

    def uniform(h):
        return lambda s: [h * mib] * -(-s // (h * mib)) if s >= h * mib else []

    def by_size(k, top):  # a power of two near 1/k of the block, 4 MiB to `top` MiB
        def f(s):
            h = min(max(pow2_floor(s // k), 4 * mib), top * mib)
            return [h] * -(-s // h)
        return f

    def body_and_tail(s):  # 32 MiB handles, then 4 MiB ones for what is left
        body = s // (32 * mib)
        return [32 * mib] * body + [4 * mib] * -(-(s - body * 32 * mib) // (4 * mib))

    schemes = [(f"uniform {h} MiB", uniform(h)) for h in (4, 8, 16, 32, 64)]
    schemes += [("1/4 of the block, 4-16 MiB", by_size(4, 16)),
                ("1/4 of the block, 4-32 MiB", by_size(4, 32)),
                ("1/2 of the block, 4-32 MiB", by_size(2, 32)),
                ("32 MiB body + 4 MiB tail", body_and_tail)]
    events = []
    for _, path in logs:
        with open(path) as f:
            events.append([(l.split(",")[0], l.split(",")[4], int(l.split(",")[5]))
                           for l in f if l[0] in "AF"])
    rows = []
    for name, handles_of in schemes:
        ratios, per_gib = [], []
        for log in events:
            live, used, held, peak_used, peak_held, made, big = {}, 0, 0, 0, 0, 0, 0
            for kind, p, n in log:
                hs = handles_of(n) if n >= 4 * mib else []
                size = sum(hs) if hs else n
                if kind == "A":
                    live[p] = n
                    used += n
                    held += size
                    made += len(hs)
                    big += n
                else:
                    live.pop(p)
                    used -= n
                    held -= size
                peak_used, peak_held = max(peak_used, used), max(peak_held, held)
            ratios.append(peak_held / peak_used)
            per_gib.append(made / (big / (1 << 30)))
        first = handles_of(64 * mib)
        rows.append([name, spread(ratios, "%.3f") + "x", spread(per_gib, "%.1f"),
                     str(len(first)), "%.2f" % (2 * len(first) * 0.034)])
    print("Rounding model over the PyTorch-like logs (no allocator; 5 seeds, median (min-max))\n")
    table(["scheme", "peak held / peak in use", "handles per GiB of blocks >= 4 MiB",
           "handles per 64 MiB tensor", "ms per 128 MiB request here (2 tensors' handles x 34 us)"],
          rows)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--build", default="build")
    parser.add_argument("--out", default="/tmp/handle_size_study")
    args = parser.parse_args()
    frag = os.path.join(args.build, "bench", "bench_fragmentation")
    replay = os.path.join(args.build, "bench", "bench_replay")
    os.makedirs(args.out, exist_ok=True)

    fractions = {}  # (handle, variant) -> cold fractions
    main_table = {}
    for h in HANDLES:
        out = subprocess.run([frag, "--simulated", "--only", "vm_pool", "--variant", "all",
                              "--seeds", SEEDS, "--handle-mib", str(h)],
                             capture_output=True, text=True, check=True).stdout
        open(os.path.join(args.out, f"fractions_{h}.txt"), "w").write(out)
        for line in out.splitlines():
            f = line.split()
            if len(f) >= 10 and f[0] in VARIANTS and f[2] == "cudamem":
                if f[4] != f[6]:
                    print(f"note: {h} MiB {f[0]} seed {f[1]}: warm {f[6]} != cold {f[4]}")
                fractions.setdefault((h, f[0]), []).append(float(f[4]))
        main_table[h] = re.findall(r"cudamem vm_pool\s+(cold|warm)\s+([\d.]+)\s+\d+\s+([\d.]+)", out)

    print("Live fraction at the first failure, cold, median over seeds " + SEEDS +
          " (min-max); warm equal unless noted above\n")
    rows = [[v] + [spread(fractions[(h, v)], "%.4f") for h in HANDLES] for v in VARIANTS]
    rows.append(["all 48"] + [spread(sum((fractions[(h, v)] for v in VARIANTS), []), "%.4f")
                              for h in HANDLES])
    rows.append(["main table: swiss / mixed"] +
                ["%s / %s" % main_table[h][0][1:] for h in HANDLES])
    table(["variant"] + [f"{h} MiB" for h in HANDLES], rows)

    rows = []
    for h in HANDLES:
        cold, warm, mix_cold, mix_warm, counts = [], [], [], [], ""
        for rep in range(3):
            out = subprocess.run([frag, "--simulated", "--only", "vm_pool", "--variant", "none",
                                  "--detail", "--simulated-driver-us", "20,34",
                                  "--handle-mib", str(h)],
                                 capture_output=True, text=True, check=True).stdout
            open(os.path.join(args.out, f"driver_{h}_{rep}.txt"), "w").write(out)
            phases = re.findall(r"phases \(fill, holes, large, free\) ms: [\d.]+ [\d.]+ ([\d.]+)", out)
            needed = [int(n) for n in re.findall(r"moved \((\d+) needed\)", out)]
            moved = [int(n) for n in re.findall(r"created \(\d+ needed\), (\d+) moved", out)]
            blocks = needed[0] // (128 // h)
            cold.append(float(phases[0]) / blocks)
            warm.append(float(phases[1]) / blocks)
            mix = re.findall(r"cudamem vm_pool\s+(?:cold|warm)\s+[\d.]+\s+\d+\s+[\d.]+\s+(\d+)", out)
            mix_cold.append(int(mix[0]))
            mix_warm.append(int(mix[1]))
            counts = f"{moved[0]} / {moved[1]} ({needed[0]})"
        rows.append([f"{h} MiB", str(128 // h), "%.3f" % (128 / h * 0.034), counts,
                     spread(cold, "%.3f"), spread(warm, "%.3f"),
                     spread(mix_cold, "%d"), spread(mix_warm, "%d")])
    print("Recycling cost per 128 MiB request (swiss cheese's 128 MiB phase / its 320 blocks, "
          "simulated driver 20 us per create, 34 us per handle given access; 3 runs)\n")
    table(["handle", "handles per 128 MiB", "model ms (x 34 us)",
           "swiss moves cold / warm (needed)", "simulated ms cold", "simulated ms warm",
           "mixed ns/op cold", "mixed ns/op warm"], rows)

    logs = []
    for seed in range(1, 6):
        path = os.path.join(args.out, f"torch_like_{seed}.log")
        write_torch_like_log(path, seed)
        logs.append((f"PyTorch-like, seed {seed}", path))
    path = os.path.join(args.out, "random_1KiB-64MiB.log")
    subprocess.run([replay, "--make-log", "random_1KiB-64MiB", path], check=True,
                   capture_output=True)
    logs.append(("random_1KiB-64MiB", path))
    rows = []
    for name, path in logs:
        ratios, peak = [], 0
        for h in HANDLES:
            least, peak = least_device(replay, path, h)
            ratios.append("%.3fx" % (least / peak))
        rows.append([name, "%.0f" % peak] + ratios)
    print("Least device a replay completes on / its peak in use (bench_replay, vm_pool)\n")
    table(["log", "peak in use MiB"] + [f"{h} MiB" for h in HANDLES], rows)
    rounding_model(logs[:5])


if __name__ == "__main__":
    main()
