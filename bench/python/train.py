"""A training loop whose shapes change from step to step: a transformer built from torch.nn,
random tokens, a sequence length drawn anew each step (nothing downloaded). Two measurements,
one allocator per process (run_all.py names it in the environment):

    python3 train.py search --start B --step S [--free-gib N]
        batches B, B+S, B+2S, ... in one process, 50 steps each, until one fails: prints the
        largest batch that ran all its steps (a common situation: a program that grows its
        batch, on an allocator that has served every shape before)
    python3 train.py speed --batch B [--free-gib N]
        steps per second at batch B (median of 5 timed windows of --window steps, 50 by
        default, after a warm-up step at every length), and each window's rate;
        --profile-steps N then times N more steps' kernels under torch.profiler;
        --time-calls (cudamem only) prints its allocator's host ms per step in each window
"""
import argparse
import random
import sys
import time

import common

VOCAB, D_MODEL, HEADS, LAYERS, FF = 8192, 512, 8, 6, 2048
MIN_LEN, MAX_LEN = 64, 1024
# Lengths are multiples of 8, padded as real data loaders pad them: every shape still differs
# from step to step (121 lengths), but not so many that the first launch of each new GEMM
# kernel (CUDA loads modules lazily, and a load waits for the device) dominates a step.
PAD = 8


def draw_length(rng):
    return rng.randint(MIN_LEN // PAD, MAX_LEN // PAD) * PAD


def build(torch):
    torch.manual_seed(0)
    nn = torch.nn

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(VOCAB, D_MODEL)
            layer = nn.TransformerEncoderLayer(D_MODEL, HEADS, FF, batch_first=True,
                                               norm_first=True)
            self.encoder = nn.TransformerEncoder(layer, LAYERS, enable_nested_tensor=False)
            self.head = nn.Linear(D_MODEL, VOCAB)

        def forward(self, tokens):
            return self.head(self.encoder(self.embed(tokens)))

    model = Model().cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    return model, optimizer


def step(torch, model, optimizer, batch, length):
    tokens = torch.randint(0, VOCAB, (batch, length), device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        logits = model(tokens)
        loss = torch.nn.functional.cross_entropy(logits.view(-1, VOCAB).float(),
                                                 tokens.view(-1))
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def search(torch, model, optimizer, start, increment, steps):
    rng = random.Random(1)
    largest, batch = 0, start
    while True:
        lengths = [draw_length(rng) for _ in range(steps)]
        try:
            for length in lengths:
                step(torch, model, optimizer, batch, length)
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001
            # An out-of-memory error, or a library failing for want of memory (cuDNN's
            # attention reports "mha_graph.execute(...)" when the device is full): the batch
            # failed, whichever allocator (the NOTE line says which it was).
            if not common.is_oom(e) and not isinstance(e, RuntimeError):
                raise
            print("NOTE %s failed at batch %d: %s" % (common.allocator_name(), batch,
                                                      str(e).strip().splitlines()[0][:300]))
            free, total = torch.cuda.mem_get_info()  # what the driver had left for libraries
            print("NOTE device free after the failure: %.0f MiB of %.0f MiB"
                  % (free / common.MiB, total / common.MiB))
            common.print_cudamem_notes()
            return largest, batch
        largest = batch
        print("ok batch %d" % batch, flush=True)
        batch += increment


def counters(time_calls=False):
    """cudamem's counts of the work that costs driver calls or waits (None under PyTorch's
    own allocator): read around each timed window, they say which windows paid for it. With
    time_calls, also the calls to the allocator and the host time they took (time_calls())."""
    if not common.allocator_name().startswith("cudamem"):
        return None
    import cudamem.torch
    stats = cudamem.torch.stats()
    counts = {k: stats[k] for k in ("compactions", "host_waits", "stream_waits", "device_syncs")}
    if time_calls:
        times = cudamem.torch.call_times()
        counts["calls"] = times["allocations"] + times["frees"]
        counts["call_ns"] = times["allocation_ns"] + times["free_ns"]
    return counts


def profiled(torch, model, optimizer, batch, steps):
    """`steps` more steps under torch.profiler (CUDA activity): the GPU's kernel time per step
    against the wall time per step. Same kernel time, longer wall: the GPU waited for the host
    (the allocator's host work, or a wait it added). Longer kernel time: the kernels ran
    slower on this memory (placement), or different ones ran (a library chose by memory)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    def device_us(e):  # renamed from cuda to device in PyTorch 2.4
        return getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0)

    rng = random.Random(3)
    lengths = [draw_length(rng) for _ in range(steps)]
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t = time.perf_counter()
        for length in lengths:
            step(torch, model, optimizer, batch, length)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t
    on_device = [e for e in prof.key_averages() if e.device_type == DeviceType.CUDA]
    kernel_ms = sum(device_us(e) for e in on_device) / 1000.0
    print("RESULT profile %s kernels %.3f ms/step, wall %.3f ms/step over %d steps"
          % (common.allocator_name(), kernel_ms / steps, 1000.0 * wall / steps, steps))
    for e in sorted(on_device, key=device_us, reverse=True)[:8]:
        print("NOTE kernel %.3f ms/step x%d %s" % (device_us(e) / 1000.0 / steps,
                                                   e.count // steps, e.key[:90]))


def speed(torch, model, optimizer, batch, window, time_calls=False):
    # Warm-up: one step at every length. cuDNN builds an attention graph for each new shape
    # and CUDA loads kernels on their first launch (each load waits for the device): costs a
    # long run has paid once, which left in the timed windows made one process's steps/s
    # differ from the next one's by up to 13% whatever the allocator.
    for length in range(MIN_LEN, MAX_LEN + 1, PAD):
        step(torch, model, optimizer, batch, length)
    torch.cuda.synchronize()
    rng = random.Random(2)
    rates = []
    if time_calls and common.allocator_name().startswith("cudamem"):
        import cudamem.torch
        cudamem.torch.time_calls(True)
    counts = [counters(time_calls)]
    cpu = []  # per window: ms of CPU per step, the main thread's and the whole process's
    for _ in range(5):
        lengths = [draw_length(rng) for _ in range(window)]
        t = time.perf_counter()
        main_cpu, process_cpu = time.thread_time(), time.process_time()
        for length in lengths:
            step(torch, model, optimizer, batch, length)
        torch.cuda.synchronize()
        rates.append(window / (time.perf_counter() - t))
        cpu.append((1000.0 * (time.thread_time() - main_cpu) / window,
                    1000.0 * (time.process_time() - process_cpu) / window))
        counts.append(counters(time_calls))
    # Against the wall ms per step (1000 / the window's rate): a main thread that is busy for
    # less than the wall waited (for the GPU, or for a lock); one busy all the time may still
    # be spinning in the driver (a full launch queue, the window's last synchronize), so the
    # profile's kernel time says which. The process's CPU above the main thread's is its other
    # threads' (PyTorch's, the driver's, cudamem's growth thread).
    print("NOTE cpu ms/step by window, main thread / process: " + " ".join(
        "%.2f/%.2f" % c for c in cpu) + " (wall: %s)" % " ".join("%.2f" % (1000.0 / r)
                                                                 for r in rates))
    if counts[0] is not None:  # what each timed window paid for (the warm-up's are before)
        print("NOTE counts in the windows: " + "; ".join(
            "%s %s" % (k, " ".join(str(b[k] - a[k]) for a, b in zip(counts, counts[1:])))
            for k in counts[0] if k != "call_ns"))
    if counts[0] is not None and "call_ns" in counts[0]:  # the allocator's share of a step
        print("NOTE allocator host ms/step by window: " + " ".join(
            "%.3f" % ((b["call_ns"] - a["call_ns"]) / 1e6 / window)
            for a, b in zip(counts, counts[1:])) + " (calls/step: %s)" % " ".join(
            "%.0f" % ((b["calls"] - a["calls"]) / window) for a, b in zip(counts, counts[1:])))
    return rates


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["search", "speed"])
    parser.add_argument("--start", type=int, default=8)
    parser.add_argument("--step", type=int, default=4)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--free-gib", type=float, default=0)
    parser.add_argument("--window", type=int, default=50, help="speed: steps per timed window")
    parser.add_argument("--profile-steps", type=int, default=0,
                        help="speed: then this many steps under torch.profiler (0: none)")
    parser.add_argument("--time-calls", action="store_true",
                        help="speed, under cudamem: time its allocator's calls in each window "
                             "(cudamem.torch.time_calls)")
    args = parser.parse_args()
    allocator = common.set_up()
    import torch
    torch.cuda.init()
    common.cap_free_memory(int(args.free_gib * common.GiB))
    model, optimizer = build(torch)
    if args.mode == "search":
        largest, failed = search(torch, model, optimizer, args.start, args.step, args.steps)
        print("RESULT search %s %d (batch %d failed)" % (allocator, largest, failed))
    else:
        rates = speed(torch, model, optimizer, args.batch, args.window, args.time_calls)
        # Every process draws the same lengths: window i is the same work in each, so
        # run_all.py can compare window by window (the windows' rates close the line).
        print("RESULT speed %s %.3f steps/s at batch %d, windows %s"
              % (allocator, common.median(rates), args.batch,
                 " ".join("%.3f" % r for r in rates)))
        if args.profile_steps > 0:
            profiled(torch, model, optimizer, args.batch, args.profile_steps)
        common.print_cudamem_notes()
    sys.stdout.flush()


if __name__ == "__main__":
    main()
