"""Records train.py's allocations under PyTorch's own allocator and writes them as a cudamem log
(logging_adaptor's format, log_format.hpp), so that `bench_replay` can replay them through
any cudamem stack on a simulated device: which configuration fits this training loop in how
much memory, without a GPU.

    python3 bench/python/trace.py --batch 28 --steps 50 --out train_b28.log.gz

Every tensor allocation and free PyTorch's caching allocator sees (torch.cuda.memory's
recorded history: `alloc` and `free_completed`), in order, from before the model is built to
the end of the last step: what a pluggable allocator is asked for, in the sizes the caching
allocator rounds requests to (multiples of 512 bytes). One stream (the loop uses one).
"""
import argparse
import gzip
import random
import sys

import common
import train


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, required=True)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    import torch
    torch.cuda.init()
    torch.cuda.memory._record_memory_history(enabled="all", max_entries=2_000_000)
    model, optimizer = train.build(torch)
    rng = random.Random(args.seed)
    for _ in range(args.steps):
        train.step(torch, model, optimizer, args.batch, train.draw_length(rng))
    torch.cuda.synchronize()
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    events = snapshot["device_traces"][torch.cuda.current_device()]
    opener = gzip.open if args.out.endswith(".gz") else open
    counts = {"A": 0, "F": 0}
    live = {}
    peak = in_use = 0
    with opener(args.out, "wt") as out:
        out.write("# cudamem log v1\n# train.py batch %d, %d steps, seed %d, PyTorch %s\n"
                  % (args.batch, args.steps, args.seed, torch.__version__))
        out.write("kind,t_ns,thread,stream,ptr,bytes,align,reserved\n")
        t0 = events[0]["time_us"] if events else 0
        last_ns = 0
        for e in events:
            kind = {"alloc": "A", "free_completed": "F"}.get(e["action"])
            if kind is None:
                continue
            address, size = e["addr"], e["size"]
            if kind == "F":
                if address not in live:
                    continue  # allocated before the recording started
                size = live.pop(address)
                in_use -= size
            else:
                live[address] = size
                in_use += size
                peak = max(peak, in_use)
            t_ns = last_ns = max(last_ns, int((e["time_us"] - t0) * 1000))  # never decreasing
            out.write("%s,%d,1,0x0,0x%x,%d,256,\n" % (kind, t_ns, address, size))
            counts[kind] += 1
    print("RESULT trace batch %d: %d allocations, %d frees, peak in use %.3f GiB -> %s"
          % (args.batch, counts["A"], counts["F"], peak / common.GiB, args.out))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
