"""What a recorded PyTorch program's allocations cost on the host under PyTorch's own caching
allocator and under cudamem's, in one process on a GPU (torch_replay_cost.cpp says how and why).

    python3 bench/python/torch_replay.py LOG [--touch-kib 0,4096] [--passes 7] [--steps 60]
    python3 bench/python/torch_replay.py LOG --fake-gpu     # no GPU: the host's bookkeeping only

LOG is a cudamem log (bench/python/trace.py writes one; bench/traces/train_b26.log.gz, 60
steps of train.py at batch 26, is one: gzip is read as is). The C++ part is compiled against
the installed PyTorch, as cudamem's allocator is (cudamem/_torch_build.py), into a temporary
directory. For each --touch-kib (KiB of host memory touched between two calls), each allocator
replays the log once untimed, then --passes times each, in turn (the order turns round every
pass). Three columns: PyTorch's allocator, cudamem's (what install() puts in PyTorch), and the
C API that one calls (libcudamem_c, called directly: the difference is the compiled
allocator's own work). Prints ns per call by kind (allocations and frees of 4 MiB or more,
and below) as the median over passes, each over PyTorch's, and the host ms per step the calls
cost (--steps: the steps in the log). Exit status 0; 1 when something could not run (the
reason is printed).

--fake-gpu runs it where there is no GPU (PyTorch with CUDA installed, a C compiler and the
CUDA Toolkit's headers): fake_gpu/runtime.c and driver.c, compiled into cudamem's cache, stand
in for the CUDA runtime and driver (one pretend device; memory calls hand out addresses,
events and waits are free), and cudamem's C library runs on a simulated device
(CUDAMEM_SIMULATE_BYTES, 16GiB unless set). What each allocator's own bookkeeping costs per
call then shows, under a profiler too (valgrind --tool=callgrind); what the driver costs does
not: compare the allocators within a run, not with a GPU's figures.
"""
import argparse
import ctypes
import gzip
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "python"))

KINDS = ("alloc >= 4 MiB", "alloc < 4 MiB", "free >= 4 MiB", "free < 4 MiB")
LARGE = 4 << 20  # cudamem.torch's handle: blocks from here on are mapped, not pooled
# PyTorch's own allocator; cudamem's compiled one (what install() puts in PyTorch); and the C
# API it calls (libcudamem_c's allocator 0, the same stack), called directly: cudamem minus
# c_api is what the compiled allocator adds.
NAMES = ("pytorch", "cudamem", "c_api")


def build(torch, directory):
    from cudamem import _torch_build
    target = os.path.join(directory, "torch_replay_cost.so")
    command = _torch_build.compile_command(torch, _torch_build.choose_compiler(),
                                           os.path.join(HERE, "torch_replay_cost.cpp"), target,
                                           ["c10", "c10_cuda"])
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError("compiling torch_replay_cost.cpp failed:\n" + done.stderr[-3000:])
    return ctypes.CDLL(target)


FAKE_GPU_ACTIVE = "CUDAMEM_FAKE_GPU_ACTIVE"  # set in the process that runs on the fake GPU


def run_on_fake_gpu():
    """Builds fake_gpu/'s runtime and driver and runs this script again over them (the
    runtime must be preloaded before the process starts: os.execve). Returns 1 if it cannot."""
    try:
        import torch
        from cudamem import _torch_build
        compiler = shutil.which("cc") or shutil.which("gcc")
        if compiler is None:
            raise RuntimeError("--fake-gpu needs a C compiler (cc or gcc)")
        cuda_include = _torch_build.cuda_include_dir(torch.version.cuda)
        directory = os.path.join(_torch_build.cache_dir(), "fake_gpu")
        os.makedirs(directory, exist_ok=True)
        sources = os.path.join(HERE, "fake_gpu")
        for source, target, extra in (
                ("runtime.c", "libcudart_fake.so", []),
                ("driver.c", "libcuda.so.1", ["-Wl,-soname,libcuda.so.1"])):
            done = subprocess.run([compiler, "-shared", "-fPIC", "-O2", "-isystem", cuda_include]
                                  + extra + ["-o", os.path.join(directory, target),
                                             os.path.join(sources, source)],
                                  capture_output=True, text=True)
            if done.returncode != 0:
                raise RuntimeError("compiling fake_gpu/%s failed:\n%s" % (source, done.stderr))
    except Exception as e:  # noqa: BLE001 - one line saying why
        print("torch_replay: %s" % e, flush=True)
        return 1
    env = dict(os.environ)
    env[FAKE_GPU_ACTIVE] = "1"
    env["LD_PRELOAD"] = os.path.join(directory, "libcudart_fake.so")
    env["LD_LIBRARY_PATH"] = os.pathsep.join(
        p for p in (directory, os.environ.get("LD_LIBRARY_PATH", "")) if p)
    env.setdefault("CUDAMEM_SIMULATE_BYTES", "16GiB")
    print("torch_replay: on a fake GPU (fake_gpu/runtime.c): the allocators' host bookkeeping "
          "only, the driver's calls free; cudamem on a simulated %s device"
          % env["CUDAMEM_SIMULATE_BYTES"], flush=True)
    os.execve(sys.executable, [sys.executable, os.path.abspath(__file__)] + sys.argv[1:], env)
    return 1  # not reached


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("log")
    parser.add_argument("--touch-kib", default="0,4096")
    parser.add_argument("--passes", type=int, default=7)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--fake-gpu", action="store_true",
                        help="no GPU: a pretend CUDA runtime (fake_gpu/), see above")
    args = parser.parse_args()
    if args.fake_gpu and os.environ.get(FAKE_GPU_ACTIVE) != "1":
        return run_on_fake_gpu()
    work = tempfile.mkdtemp(prefix="torch_replay_")
    try:
        log = args.log
        if log.endswith(".gz"):
            log = os.path.join(work, "log")
            with gzip.open(args.log, "rb") as f, open(log, "wb") as out:
                shutil.copyfileobj(f, out)
        import torch
        lib = build(torch, work)
        lib.replay_error.restype = ctypes.c_char_p
        lib.replay_ops.restype = ctypes.c_size_t

        def check(status, what):
            if status != 0:
                raise RuntimeError("%s: %s" % (what, lib.replay_error().decode()))
        check(lib.replay_take_allocator(0), "taking PyTorch's allocator")
        import cudamem.torch
        cudamem.torch.install()
        torch.cuda.init()
        check(lib.replay_take_allocator(1), "taking cudamem's allocator")
        check(lib.replay_init(0, torch.cuda.device_count()), "initialising PyTorch's allocator")
        from cudamem import _native
        lib.replay_take_c_api(ctypes.c_void_p(_native.function_address("cudamem_allocate")),
                              ctypes.c_void_p(_native.function_address("cudamem_deallocate")))
        ns = (ctypes.c_double * 4)()
        calls = (ctypes.c_long * 4)()
        print("torch %s, %s; log %s" % (torch.__version__, torch.cuda.get_device_name(0),
                                        os.path.basename(args.log)), flush=True)
        for touch in (int(t) for t in args.touch_kib.split(",")):
            check(lib.replay_load(log.encode(), touch), "reading the log")
            per_call = {n: [[] for _ in KINDS] for n in NAMES}
            per_step = {n: [] for n in NAMES}
            order = list(range(len(NAMES)))
            for which in order:  # warm: each grows to the log's peak once
                check(lib.replay_pass(which, LARGE, ns, calls), "warm pass")
            for p in range(args.passes):
                for which in order[p % len(order):] + order[:p % len(order)]:
                    check(lib.replay_pass(which, LARGE, ns, calls), "pass")
                    name = NAMES[which]
                    for k in range(4):
                        per_call[name][k].append(ns[k] / calls[k] if calls[k] else 0.0)
                    per_step[name].append(sum(ns) / 1e6 / args.steps)
            print("\ntouched between calls: %d KiB; %d calls a pass; medians of %d passes"
                  % (touch, lib.replay_ops(), args.passes))
            print("| ns per call | %s |" % " | ".join(KINDS + ("host ms per step",)))
            print("|---|---|---|---|---|---|")
            for name in NAMES:
                cells = ["%.0f" % statistics.median(v) for v in per_call[name]]
                cells.append("%.3f" % statistics.median(per_step[name]))
                print("| %s | %s |" % (name, " | ".join(cells)))
            base = [statistics.median(v) for v in per_call["pytorch"]]
            base.append(statistics.median(per_step["pytorch"]))
            for name in NAMES[1:]:
                mine = [statistics.median(v) for v in per_call[name]]
                mine.append(statistics.median(per_step[name]))
                print("| %s / pytorch | %s |" % (name, " | ".join(
                    "%.2f" % (m / b) if b else "-" for m, b in zip(mine, base))))
            print("per step, pass by pass: " + "; ".join(
                "%s %s" % (name, " ".join("%.3f" % x for x in per_step[name]))
                for name in NAMES), flush=True)
        return 0
    except Exception as e:  # noqa: BLE001 - one line saying why, for a GPU run's log
        print("torch_replay: %s" % e, flush=True)
        return 1
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
