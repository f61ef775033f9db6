"""Every PyTorch benchmark, every allocator, each run in a fresh process; one table at the end.

    python3 bench/python/run_all.py [--only overhead,frag,train,speed] [--frag-free-gib N]
                                    [--train-free-gib N] [--seeds 1,2,3]
                                    [--variants OPTIONS ...] [--allocators A,B,...]
                                    [--train-start B --train-step S] [--train-batch B]
                                    [--speed-passes N] [--speed-window STEPS] [--notes]
                                    [--profile-steps N] [--pin-cpus LIST|auto]
                                    [--speed-side-by-side] [--speed-time-calls]

--variants adds cudamem with other options as more columns ("resource=pool",
"handle_bytes=16MiB,grow_ahead_bytes=0": cudamem.torch.install()'s keywords); --allocators
keeps only the named columns (default, expandable, cudamem) and the variants;
--train-start/--train-step skip the coarse search; --only speed measures steps/s alone, at
--train-batch; --notes prints what each cudamem child said about its state (stats, the failed
allocation's report); --speed-side-by-side runs each pass's allocators at the same time, each on
a GPU and physical cores of its own, and swaps the GPUs from pass to pass.

Allocators: PyTorch's default caching allocator, the same with expandable_segments:True, and
cudamem.torch.install() (vm_pool). The package is imported from ../../python; its library is
found there (pip install) or through CUDAMEM_C_LIBRARY (a build tree).
"""
import argparse
import os
import re
import subprocess
import sys
import tempfile

import common

HERE = os.path.dirname(os.path.abspath(__file__))


show_notes = False  # --notes: print what the children said about cudamem's state
pin_cpus = ""  # --pin-cpus: a taskset list every child runs on


def start(script, allocator, *arguments, cpus="", gpu=None):
    """A child running `script` under `allocator`, on `cpus` (a taskset list; default: every
    child's --pin-cpus) and, when `gpu` is given, on that GPU alone (CUDA_VISIBLE_DEVICES)."""
    command = [sys.executable, os.path.join(HERE, script)] + [str(a) for a in arguments]
    cpus = cpus or pin_cpus
    if cpus:
        command = ["taskset", "-c", cpus] + command
    env = common.environment_for(allocator)
    if gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = str(gpu)
    # Files, not pipes: children that run at the same time are waited for one after the
    # other, and one whose pipe filled up meanwhile would stop in the middle of its timing.
    out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
    child = subprocess.Popen(command, env=env, stdout=out, stderr=err, text=True)
    child.what = "%s %s %s" % (script, allocator, arguments)
    child.files = (out, err)
    return child


def finish(child, timeout=900):
    """The RESULT lines of a child from start() (printed), or [] when it failed (its output
    printed to stderr). A child past `timeout` seconds is killed and counts as failed."""
    killed = ""
    try:
        child.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait()
        killed = "\n(killed after %d s)" % timeout
    texts = []
    for f in child.files:
        with f:
            f.seek(0)
            texts.append(f.read())
    out, err = texts[0], texts[1] + killed
    results = [line[len("RESULT "):] for line in out.splitlines() if line.startswith("RESULT ")]
    if child.returncode != 0 or not results:
        sys.stderr.write("%s failed (%d):\n%s\n%s\n"
                         % (child.what, child.returncode, out[-2000:], err[-3000:]))
        return []
    for r in results:
        print("  " + r, flush=True)
    for line in out.splitlines():
        if line.startswith("NOTE ") and show_notes:
            print("    " + line[len("NOTE "):], flush=True)
    return results


def run(script, allocator, *arguments, timeout=900):
    return finish(start(script, allocator, *arguments), timeout)


def gpu_cpu_affinity(topology, gpu=0):
    """The "CPU Affinity" of GPU `gpu` in `nvidia-smi topo -m`'s matrix (a taskset list such as
    "48-63,176-191"), or None, also when the matrix says N/A. Found by the header's column:
    the fields before it (GPUs, NICs: X, NV12, SYS, PIX, ...) are one word each, and the row
    starts with its own name."""
    column = None
    for line in topology.splitlines():
        fields = line.split()
        if column is None and "CPU Affinity" in line:
            column = fields.index("CPU") + 1  # the row's name comes first
        elif column is not None and fields and fields[0] == "GPU%d" % gpu:
            cores = fields[column] if column < len(fields) else ""
            return cores if re.fullmatch(r"\d+(-\d+)?(,\d+(-\d+)?)*", cores) else None
    return None


def expand_cpu_list(text):
    """The CPUs of a taskset/sysfs list such as "0-3,8,10-11", in order."""
    cpus = []
    for part in text.split(","):
        first, _, last = part.partition("-")
        cpus.extend(range(int(first), int(last or first) + 1))
    return cpus


def one_per_core(cpu_list, siblings_of=None):
    """`cpu_list` (a taskset list) with one logical CPU per physical core: the first of each
    group of hyperthread siblings (sysfs's thread_siblings_list, read by `siblings_of(cpu)`;
    a CPU whose siblings cannot be read is kept). Why: the training loop is bound by two host
    threads (Python's and autograd's); placed on two siblings of one core, both run slower, and
    that differs from process to process, whatever the allocator."""
    def from_sysfs(cpu):
        path = "/sys/devices/system/cpu/cpu%d/topology/thread_siblings_list" % cpu
        with open(path) as f:
            return f.read().strip()
    siblings_of = siblings_of or from_sysfs
    kept, seen = [], set()
    for cpu in expand_cpu_list(cpu_list):
        try:
            group = tuple(expand_cpu_list(siblings_of(cpu)))
        except (OSError, ValueError):
            group = (cpu,)
        if group not in seen:
            seen.add(group)
            kept.append(cpu)
    return ",".join(str(c) for c in kept)


def number(result, index=2):
    return float(result.split()[index])


def side_by_side_plan(allocators, gpus, cpus_of, passes):
    """Where each allocator runs in each pass when the passes run side by side: pass n puts
    allocator i on GPU gpus[(i + n) % k] (k allocators), so each allocator visits every GPU in
    turn and no GPU or core set favours one. `cpus_of[g]` is GPU g's taskset list. Returns, per
    pass, a list of (allocator, gpu, cpus)."""
    k = len(allocators)
    return [[(a, gpus[(i + n) % k], cpus_of[gpus[(i + n) % k]]) for i, a in enumerate(allocators)]
            for n in range(passes)]


def split_cpus(cpu_list, parts):
    """`cpu_list` (a taskset list) cut into `parts` contiguous taskset lists of (nearly) equal
    length: disjoint cores for children that run at the same time on GPUs whose affinity is
    the same set (as on the cloud machines, where every GPU's is every core)."""
    cpus = expand_cpu_list(cpu_list)
    size, extra = divmod(len(cpus), parts)
    groups, first = [], 0
    for p in range(parts):
        last = first + size + (1 if p < extra else 0)
        groups.append(",".join(str(c) for c in cpus[first:last]))
        first = last
    return groups


def speed_row(allocators, batch, free, args, placement=None):
    """Steps/s at `batch` for each allocator: three table rows. Steps/s from one process varied by
    up to 1.5x between runs on different hosts: each allocator runs in `--speed-passes`
    processes, the passes interleaved (all allocators once, then again), and the median
    counts. With `placement` (side_by_side_plan's), the allocators of a pass run at the same
    time, each on its own GPU and cores: a host that slows down then slows down all of one
    pass alike, which the pass-by-pass ratio cancels."""
    by_pass = {a: {} for a in allocators}  # pass number -> steps/s, in pass order
    windows = {a: [] for a in allocators}  # per pass: each window's steps/s
    kernels = {a: [] for a in allocators}  # per pass (--profile-steps): GPU kernel ms per step
    walls = {a: [] for a in allocators}  # and wall ms per step, of the same profiled steps
    arguments = ("speed", "--batch", batch, "--free-gib", free, "--window", args.speed_window,
                 "--profile-steps", args.profile_steps) + (
                     ("--time-calls",) if args.speed_time_calls else ())

    def record(a, n, r):
        if r:
            by_pass[a][n] = number(r[0])
            windows[a].append([float(x) for x in r[0].split("windows ")[1].split()])
            for line in r[1:]:  # "profile A kernels K ms/step, wall W ms/step over N steps"
                if line.startswith("profile "):
                    kernels[a].append(number(line, 3))
                    walls[a].append(number(line, 6))

    for n in range(args.speed_passes):
        if placement:
            print("  pass %d side by side: %s" % (n + 1, ", ".join(
                "%s on GPU %s (cores %s)" % p for p in placement[n])), flush=True)
            children = [(a, start("train.py", a, *arguments, cpus=cpus, gpu=gpu))
                        for a, gpu, cpus in placement[n]]
            for a, child in children:
                record(a, n, finish(child))
            continue
        # The order turns round every pass: a host that slows down (or speeds up) during the
        # run does not favour whoever always comes first.
        for a in (allocators if n % 2 == 0 else allocators[::-1]):
            record(a, n, run("train.py", a, *arguments))
    for a, v in by_pass.items():  # the spread behind each median
        if v:
            print("  passes %s: %s" % (a, " ".join("%.2f" % x for x in v.values())), flush=True)
    median_row = {a: common.median(list(v.values())) for a, v in by_pass.items() if v}
    # Window i is the same steps in every process; the host only ever slows one down. So the
    # fastest pass of each window, over all windows: steps / the sum of their times.
    best_row = {}
    for a, passes in windows.items():
        if passes:
            best = [max(p[i] for p in passes) for i in range(min(len(p) for p in passes))]
            best_row[a] = len(best) / sum(1.0 / r for r in best)
    # A host that drifts moves every allocator of one pass alike (they run minutes apart, in
    # turn): each pass's rate over the default's in the same pass, then the median of those.
    paired_row = {}
    for a, passes in by_pass.items():
        ratios = [r / by_pass["default"][n] for n, r in passes.items()
                  if n in by_pass.get("default", {})]
        if ratios:
            paired_row[a] = common.median(ratios)
    profile_rows = []
    if any(kernels.values()):
        profile_rows = [
            ("GPU kernel ms per step, profiled (median of passes)",
             {a: common.median(v) for a, v in kernels.items() if v}, "%.3f"),
            ("wall ms per step, the same steps (median of passes)",
             {a: common.median(v) for a, v in walls.items() if v}, "%.3f")]
    return profile_rows + [
            ("steps/s at batch %d (median of %d passes)" % (batch, args.speed_passes),
             median_row, "%.3f"),
            ("steps/s at batch %d over the default's in the same pass (median of %d)"
             % (batch, args.speed_passes), paired_row, "%.3f"),
            ("steps/s at batch %d (each window's best of %d passes)"
             % (batch, args.speed_passes), best_row, "%.3f")]


def nvidia_topology():
    """`nvidia-smi topo -m`'s matrix, or "" where there is no nvidia-smi."""
    try:
        return subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True,
                              text=True).stdout
    except OSError:
        return ""


def visible_gpus():
    """The GPUs the children may use: CUDA_VISIBLE_DEVICES's entries, else nvidia-smi -L's."""
    if os.environ.get("CUDA_VISIBLE_DEVICES"):
        return os.environ["CUDA_VISIBLE_DEVICES"].split(",")
    try:
        listing = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True).stdout
    except OSError:
        return []
    gpus = [line for line in listing.splitlines() if line.startswith("GPU ")]
    return [str(i) for i in range(len(gpus))]


def side_by_side_placement(allocators, topology, passes, gpus=None, siblings_of=None,
                           all_cpus=None):
    """side_by_side_plan over the first len(allocators) visible GPUs, each child on physical
    cores of its own: the GPU's own affinity when the GPUs' differ, else their common affinity
    (or every CPU) split between them. None, with a line saying why, when there are too few
    GPUs: the passes then run in turn."""
    gpus = (visible_gpus() if gpus is None else gpus)[:len(allocators)]
    if len(gpus) < len(allocators):
        print("side by side needs %d GPUs, %d visible: the passes run in turn"
              % (len(allocators), len(gpus)), flush=True)
        return None
    if all_cpus is None:
        all_cpus = ",".join(str(c) for c in sorted(os.sched_getaffinity(0)))
    affinity = {g: gpu_cpu_affinity(topology, int(g)) if g.isdigit() else None for g in gpus}
    if None in affinity.values() or len(set(affinity.values())) == 1:
        common_cpus = one_per_core(next(iter(affinity.values())) or all_cpus, siblings_of)
        cpus_of = dict(zip(gpus, split_cpus(common_cpus, len(gpus))))
    else:
        cpus_of = {g: one_per_core(a, siblings_of) for g, a in affinity.items()}
    return side_by_side_plan(allocators, gpus, cpus_of, passes)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--only", default="overhead,frag,train")
    parser.add_argument("--frag-free-gib", type=float, default=0)
    parser.add_argument("--train-free-gib", type=float, default=16)
    parser.add_argument("--seeds", default="1,2,3")
    parser.add_argument("--variants", nargs="*", default=[])
    parser.add_argument("--allocators", default="")
    parser.add_argument("--train-start", type=int, default=0)
    parser.add_argument("--train-step", type=int, default=2)
    parser.add_argument("--train-batch", type=int, default=0)
    parser.add_argument("--notes", action="store_true")
    parser.add_argument("--speed-passes", type=int, default=3)
    parser.add_argument("--speed-window", type=int, default=50)
    parser.add_argument("--profile-steps", type=int, default=0,
                        help="speed: each pass then times this many steps' kernels under "
                        "torch.profiler (a row of GPU kernel ms per step against wall ms)")
    parser.add_argument("--speed-time-calls", action="store_true",
                        help="speed: cudamem's passes time its allocator's calls and print "
                        "its host ms per step by window (train.py --time-calls; with --notes)")
    parser.add_argument("--pin-cpus", default="", help="run every child on these cores "
                        "(taskset -c list; auto: the GPU's CPU affinity, from nvidia-smi topo "
                        "-m, one logical CPU per physical core)")
    parser.add_argument("--speed-side-by-side", action="store_true",
                        help="speed: run a pass's allocators at the same time, each on its own "
                        "GPU and its own physical cores (as many GPUs as allocators)")
    args = parser.parse_args()
    global show_notes, pin_cpus
    show_notes = args.notes
    pin_cpus = args.pin_cpus
    topology = nvidia_topology() if pin_cpus == "auto" or args.speed_side_by_side else ""
    if pin_cpus == "auto":  # the cores nearest the GPU the children use (the first visible)
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]
        pin_cpus = gpu_cpu_affinity(topology, int(visible) if visible.isdigit() else 0) or ""
        print("children pinned to cores %s (nvidia-smi topo -m)" % (pin_cpus or "- (unknown)"),
              flush=True)
        if pin_cpus:  # one logical CPU per physical core (one_per_core says why)
            pin_cpus = one_per_core(pin_cpus)
            print("  one per physical core: %s" % pin_cpus, flush=True)
    allocators = list(common.ALLOCATORS) + ["cudamem:" + v for v in args.variants]
    if args.allocators:  # the named ones, and every --variants column
        wanted = args.allocators.split(",")
        allocators = [a for a in allocators if a in wanted or a.startswith("cudamem:")]
    parts = args.only.split(",")
    table = []

    if "overhead" in parts:
        print("torch.empty + free, ns per pair (median of 7 rounds of 100,000)", flush=True)
        costs = {a: run("overhead.py", a) for a in allocators}
        for kind_index, kind in enumerate(("1MiB", "4KiB-16MiB")):
            row = {a: number(costs[a][kind_index], 3) for a in allocators if costs[a]}
            table.append(("empty+free %s (ns)" % kind, row, "%.0f"))

    if "frag" in parts:
        print("fragmentation: live at the first OOM / free at start", flush=True)
        for trace in ("mixed", "heavy"):
            for seed in args.seeds.split(","):
                row = {}
                for a in allocators:
                    r = run("frag.py", a, "--trace", trace, "--seed", seed,
                            "--free-gib", args.frag_free_gib)
                    if r:
                        row[a] = number(r[0])
                table.append(("%s trace, seed %s (fraction)" % (trace, seed), row, "%.4f"))
        row = {}
        for a in allocators:
            r = run("frag.py", a, "--trace", "swiss", "--free-gib", args.frag_free_gib)
            if r:
                row[a] = number(r[0])
        table.append(("swiss: 128 MiB in freed 64 MiB holes (fraction)", row, "%.4f"))

    if "train" in parts:
        free = args.train_free_gib
        # 10 steps a batch see long sequences too; a batch that passed them may still fail in
        # 50, so the fine search starts well below (at half): it must start on a batch that runs.
        if args.train_start:
            coarse, start, fine = None, args.train_start, args.train_step
        else:
            print("training: coarse search (default allocator, 10 steps a batch)", flush=True)
            coarse = run("train.py", "default", "search", "--start", 16, "--step", 16,
                         "--steps", 10, "--free-gib", free)
            if coarse:
                estimate = int(number(coarse[0]))
                fine = max(2, estimate // 24)
                start = max(fine, (estimate // 2) // fine * fine)
        if args.train_start or coarse:
            print("training: the largest batch running 50 steps, from %d by %d" % (start, fine),
                  flush=True)
            row = {}
            for a in allocators:
                r = run("train.py", a, "search", "--start", start, "--step", fine,
                        "--steps", 50, "--free-gib", free, timeout=1800)
                if r:
                    row[a] = number(r[0])
            table.append(("largest batch, 50 steps (%g GiB free)" % free, row, "%.0f"))
            if (row or args.train_batch) and "speed" not in parts:
                # One step below the largest batch every allocator ran: there a step is bound
                # by the GPU. At half of it a step was bound by the host's kernel launches,
                # and on the H100 host one 50-step window differed from the next by up to 20%
                # whatever the allocator, which drowns a 3% target.
                batch = args.train_batch or max(2, int(min(row.values())) - fine)
                table.extend(speed_row(allocators, batch, free, args))

    if "speed" in parts:  # steps/s alone, at --train-batch (default: 2)
        placement = None
        if args.speed_side_by_side:
            placement = side_by_side_placement(allocators, topology, args.speed_passes)
        table.extend(speed_row(allocators, args.train_batch or 2, args.train_free_gib, args,
                               placement))

    print()
    names = {"expandable": "expandable_segments"}
    print("| measurement | %s | cudamem / default |"
          % " | ".join(names.get(a, a) for a in allocators))
    print("|---|%s---|" % ("---|" * len(allocators)))
    for name, row, fmt in table:
        cells = [fmt % row[a] if a in row else "failed" for a in allocators]
        ratio = ("%.3f" % (row["cudamem"] / row["default"])
                 if "cudamem" in row and row.get("default") else "")
        print("| %s | %s | %s |" % (name, " | ".join(cells), ratio))


if __name__ == "__main__":
    main()
