"""Everyday PyTorch under cudamem.torch.install(): each program runs in a fresh interpreter
twice in the same run, under PyTorch's own allocator and under cudamem, and must behave the
same: what works under PyTorch's allocator must work under cudamem. Skipped, never passed,
without PyTorch and a GPU; two-GPU cases skip on one.

Each case is a program that prints `name value` lines; the assertions read them. The prologue
installs cudamem when ALLOCATOR=cudamem, before anything touches CUDA.
"""
import os
import sys
import textwrap

import pytest

from conftest import CUDA_DEVICES, finish_python, needs_torch_gpu, start_python

pytestmark = [pytest.mark.gpu, needs_torch_gpu]

ALLOCATORS = ["default", "cudamem"]
two_gpus = pytest.mark.skipif(CUDA_DEVICES < 2, reason="needs 2 CUDA devices")

PROLOGUE = """
import os, sys, time, torch
CUDAMEM = os.environ["ALLOCATOR"] == "cudamem"
if CUDAMEM and __name__ == "__main__":   # (processes spawned from it choose for themselves)
    import cudamem.torch
    cudamem.torch.install()

def settle():
    # cudamem's vm_pool maps memory ahead of need on a thread of its own: let it finish
    # before comparing figures read at different moments.
    torch.cuda.synchronize()
    time.sleep(0.3)
"""


# The cudamem run of a case starts beside its default run (two interpreters on one GPU, as two
# users' programs would be), which halves the suite's time: most of a case is importing PyTorch
# and compiling. Cases that read the device's free memory or fill it run alone (exclusive=True).
_started = {}  # (source, env) -> the cudamem child started beside the default run


def _source(code, allocator, tmp_path):
    source = PROLOGUE + textwrap.dedent(code)
    if tmp_path is None:
        return source
    path = tmp_path / ("case_%s.py" % allocator)
    path.write_text(source)
    return "import runpy, sys; sys.argv = [%r]; runpy.run_path(%r, run_name='__main__')" % (
        str(path), str(path))


def _start(code, allocator, tmp_path, env):
    child_env = {"ALLOCATOR": allocator, "PYTHONWARNINGS": "ignore"}
    child_env.update(env or {})
    return start_python(_source(code, allocator, tmp_path), env=child_env)


def run(code, allocator, tmp_path=None, env=None, timeout=300, exclusive=False):
    """Runs PROLOGUE + code under `allocator`; returns {name: value} of its printed lines.
    With tmp_path the program is a file (torch.multiprocessing's spawn needs one)."""
    key = (code, repr(sorted((env or {}).items())))
    child = _started.pop(key, None) if allocator == "cudamem" else None
    if child is None:
        if allocator == "default" and not exclusive:
            _started[key] = _start(code, "cudamem", tmp_path, env)
        child = _start(code, allocator, tmp_path, env)
    out = finish_python(child, timeout=timeout)
    values = {}
    for line in out.splitlines():
        name, _, value = line.partition(" ")
        values[name] = value
    return values


@pytest.fixture(autouse=True, scope="module")
def _no_child_left():
    """A cudamem run started beside a default run whose own test was deselected is stopped."""
    yield
    while _started:
        _, child = _started.popitem()
        child.kill()
        child.communicate()


@pytest.mark.parametrize("allocator", ALLOCATORS)
def test_memory_statistics(allocator):
    v = run("""
        x = torch.empty(256, device="cuda")
        s = torch.cuda.memory_stats()
        keys = ["allocated_bytes.all.current", "reserved_bytes.all.peak",
                "active_bytes.small_pool.freed", "requested_bytes.large_pool.allocated",
                "segment.all.current", "inactive_split_bytes.all.current", "allocation.all.peak",
                "num_alloc_retries", "num_ooms", "num_device_alloc", "num_device_free",
                "oversize_allocations.current", "max_split_size"]
        print("keys", all(k in s for k in keys) and len(s) >= 100)
        base = torch.cuda.memory_allocated()
        active = s["active_bytes.all.current"]
        z = torch.randn(256, device="cuda")          # 1 KiB, PyTorch's rounding
        print("exact", torch.cuda.memory_stats()["active_bytes.all.current"] - active == 1024)
        y = torch.empty(1 << 20, device="cuda")       # 4 MiB
        print("allocated", torch.cuda.memory_allocated() - base == (4 << 20) + 1024)
        print("peak", torch.cuda.max_memory_allocated() >= base + (4 << 20))
        del y
        print("freed", torch.cuda.memory_allocated() == base + 1024)
        torch.cuda.reset_peak_memory_stats()
        print("reset", torch.cuda.max_memory_allocated() == torch.cuda.memory_allocated(),
              torch.cuda.max_memory_reserved() == torch.cuda.memory_reserved())
        print("reserved", torch.cuda.memory_reserved() >= torch.cuda.memory_allocated() > 0)
        print("summary", "Allocated memory" in torch.cuda.memory_summary())
        a = torch.accelerator.memory_stats()
        print("accelerator", a.get("allocated_bytes.all.current") == torch.cuda.memory_allocated())
        torch.cuda.reset_accumulated_memory_stats()
        print("accumulated", torch.cuda.memory_stats()["allocation.all.allocated"] == 0)
        if CUDAMEM:
            settle()
            mine = cudamem.torch.stats()
            print("agree", mine["reserved_bytes"] == torch.cuda.memory_reserved(),
                  mine["in_use_bytes"] == torch.cuda.memory_allocated())
    """, allocator)
    assert v["keys"] == "True"
    assert v["exact"] == "True"
    assert v["allocated"] == "True"
    assert v["peak"] == "True"
    assert v["freed"] == "True"
    assert v["reset"] == "True True"
    assert v["reserved"] == "True"
    assert v["summary"] == "True"
    assert v["accelerator"] == "True"
    assert v["accumulated"] == "True"
    if allocator == "cudamem":
        assert v["agree"] == "True True"


@pytest.mark.parametrize("allocator", ALLOCATORS)
def test_snapshot_history_and_memory_viz(allocator, tmp_path):
    v = run("""
        import json, pickle
        from torch.cuda import _memory_viz
        torch.cuda.memory._record_memory_history(max_entries=100000)
        model = torch.nn.Sequential(torch.nn.Linear(512, 2048), torch.nn.ReLU(),
                                    torch.nn.Linear(2048, 10)).cuda()
        opt = torch.optim.Adam(model.parameters())
        def train_step():
            loss = model(torch.randn(256, 512, device="cuda")).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
        for _ in range(3):
            train_step()
        marker = torch.empty(311 * 411, device="cuda")
        settle()
        snap = torch.cuda.memory._snapshot()
        segs = snap["segments"]
        print("segments", len(segs) > 0)
        print("tiled", all(sum(b["size"] for b in s["blocks"]) == s["total_size"] for s in segs))
        found = [b for s in segs for b in s["blocks"]
                 if b["requested_size"] == 311 * 411 * 4 and b["state"] == "active_allocated"]
        print("marker", len(found) == 1 and found[0]["address"] == marker.data_ptr())
        print("frames", bool(found) and any("case_" in f["filename"] for f in found[0]["frames"]))
        actions = {e["action"] for e in snap["device_traces"][0]}
        print("trace", {"alloc", "free_requested", "free_completed"} <= actions)
        allocated = sum(s["allocated_size"] for s in segs)
        print("consistent", allocated == torch.cuda.memory_allocated(),
              sum(s["total_size"] for s in segs) == torch.cuda.memory_reserved())
        json.dumps(snap)
        path = os.path.join(os.path.dirname(sys.argv[0]), "snap_%s.pickle" % CUDAMEM)
        torch.cuda.memory._dump_snapshot(path)
        with open(path, "rb") as f:
            print("dumped", len(pickle.load(f)["segments"]) == len(segs))
        print("plots", len(_memory_viz.trace_plot(snap)) > 1000,
              len(_memory_viz.segment_plot(snap)) > 1000, len(_memory_viz.segsum(snap)) > 0)
        torch.cuda.memory._record_memory_history(None)
        # (one trace per device: a two-GPU machine has two, both empty)
        print("off", all(t == [] for t in torch.cuda.memory._snapshot()["device_traces"]))
    """, allocator, tmp_path=tmp_path)
    for key in ("segments", "tiled", "marker", "frames", "trace", "dumped"):
        assert v[key] == "True", key
    assert v["consistent"] == "True True"
    assert v["plots"] == "True True True"
    assert v["off"] == "True"


@pytest.mark.parametrize("allocator", ALLOCATORS)
def test_out_of_memory_observer_and_message(allocator):
    v = run("""
        seen = []
        def observer(device, alloc, total, free):
            report = cudamem.torch.last_oom_report() if CUDAMEM else "n/a"
            seen.append((device, alloc, "Verdict" in report if CUDAMEM else True))
        torch._C._cuda_attach_out_of_memory_observer(observer)
        try:
            torch.empty(1 << 50, dtype=torch.uint8, device="cuda")
            print("raised False")
        except torch.OutOfMemoryError as e:
            print("raised True")
            print("message", "Tried to allocate" in str(e) and "GPU 0 has a total capacity" in str(e))
            if CUDAMEM:
                print("report", "Verdict: larger_than_device" in str(e))
        print("observer", len(seen) == 1 and seen[0][0] == 0 and seen[0][1] >= 1 << 50, seen[0][2])
        print("ooms", torch.cuda.memory_stats()["num_ooms"])
        print("goes_on", torch.ones(10, device="cuda").sum().item())
    """, allocator)
    assert v["raised"] == "True"
    assert v["message"] == "True"
    assert v["observer"] == "True True"
    assert v["ooms"] == "1"
    assert v["goes_on"] == "10.0"
    if allocator == "cudamem":
        assert v["report"] == "True"


@pytest.mark.parametrize("allocator", ALLOCATORS)
def test_cudnn_benchmark_training(allocator):
    v = run("""
        torch.backends.cudnn.benchmark = True
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Conv2d(3, 32, 3, padding=1), torch.nn.ReLU(),
            torch.nn.Conv2d(32, 64, 3, padding=1), torch.nn.ReLU(),
            torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(64, 10)).cuda()
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        losses = []
        for shape in [(16, 3, 32, 32), (32, 3, 64, 64), (16, 3, 32, 32)]:
            x = torch.randn(*shape, device="cuda")
            loss = torch.nn.functional.cross_entropy(model(x), torch.zeros(shape[0], dtype=torch.long, device="cuda"))
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        print("trained", all(l == l and l < 100 for l in losses))
    """, allocator)
    assert v["trained"] == "True"


@pytest.mark.parametrize("allocator", ALLOCATORS)
def test_cuda_graphs_pools_and_their_memory(allocator):
    v = run("""
        import gc
        def pool_segments():
            return [s for s in torch.cuda.memory_snapshot() if s["segment_pool_id"] != (0, 0)]
        torch.cuda.synchronize()
        baseline = len(pool_segments())
        x = torch.randn(1 << 20, device="cuda")
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(2):
                y = x * 2 + 1           # warm up
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            tmp = x * 3
            y = tmp * 2 + 1             # tmp's block may be reused inside the graph
            del tmp
        ok = True
        for value in (1.0, 2.0, 3.0):
            x.fill_(value)
            g.replay()
            ok = ok and bool((y == value * 6 + 1).all().item())
        print("replay", ok)
        print("pool", g.pool() != (0, 0) and len(pool_segments()) > baseline)
        # Two graphs sharing a pool, replayed in capture order.
        shared = torch.cuda.graph_pool_handle()
        g1, g2 = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        with torch.cuda.graph(g1, pool=shared):
            a = x + 1
        with torch.cuda.graph(g2, pool=shared):
            b = a * 10
        x.fill_(4.0)
        g1.replay()
        g2.replay()
        print("shared", bool((b == 50).all().item()))
        # A graph's memory is kept while it lives; gone once the graphs and their outputs are.
        del g, g1, g2, y, a, b
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        print("released", len(pool_segments()) == baseline)
        # make_graphed_callables, training a small module.
        module = torch.nn.Linear(64, 64).cuda()
        sample = torch.randn(8, 64, device="cuda", requires_grad=True)
        graphed = torch.cuda.make_graphed_callables(module, (sample,))
        opt = torch.optim.SGD(module.parameters(), lr=0.1)
        for _ in range(3):
            out = graphed(torch.randn(8, 64, device="cuda", requires_grad=True))
            out.sum().backward()
            opt.step()
            opt.zero_grad()
        print("graphed", bool(torch.isfinite(module.weight).all().item()))
    """, allocator)
    assert v["replay"] == "True"
    assert v["pool"] == "True"
    assert v["shared"] == "True"
    assert v["graphed"] == "True"
    assert v["released"] == "True"


@pytest.mark.parametrize("reuse", [True, False])
@pytest.mark.parametrize("allocator", ALLOCATORS)
def test_graph_capture_record_stream_reuse(allocator, reuse):
    # PyTorch's graph_capture_record_stream_reuse: a block freed during a capture after
    # record_stream is reused in the same capture once the graph orders its uses first (the
    # side stream joined), never before; without the setting, only after the capture.
    v = run("""
        x = torch.ones(1024, device="cuda")
        capture_stream, side = torch.cuda.Stream(), torch.cuda.Stream()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=capture_stream):
            a = x * 2
            side.wait_stream(capture_stream)
            with torch.cuda.stream(side):
                b = a * 3                       # a read on the side stream
            a.record_stream(side)
            address = a.data_ptr()
            del a
            before_join = x * 5                 # the side stream may still read a
            capture_stream.wait_stream(side)
            after_join = x * 7                  # every use of a is ordered before this
            out = after_join + before_join + b
        ok = True
        for value in (2.0, 3.0):
            x.fill_(value)
            g.replay()
            torch.cuda.synchronize()
            ok = ok and bool((b == 6 * value).all()) and bool((out == 18 * value).all())
        print("before_join_reused", before_join.data_ptr() == address)
        print("after_join_reused", after_join.data_ptr() == address)
        print("values", ok)
    """, allocator, env={"PYTORCH_CUDA_ALLOC_CONF": "graph_capture_record_stream_reuse:%s" % reuse})
    assert v["values"] == "True"
    assert v["before_join_reused"] == "False"
    assert v["after_join_reused"] == str(reuse)


@pytest.mark.parametrize("allocator", ALLOCATORS)
def test_torch_compile_reduce_overhead(allocator):
    v = run("""
        torch.manual_seed(0)
        @torch.compile(mode="reduce-overhead")
        def f(x):
            return (x.sin() + x.cos()) * 2
        x = torch.randn(4096, device="cuda")
        for _ in range(5):
            y = f(x)
        print("function", torch.allclose(y, (x.sin() + x.cos()) * 2))
        model = torch.nn.Sequential(torch.nn.Linear(128, 256), torch.nn.GELU(),
                                    torch.nn.Linear(256, 1)).cuda()
        compiled = torch.compile(model, mode="reduce-overhead")
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        losses = []
        for step in range(6):
            torch.compiler.cudagraph_mark_step_begin()
            loss = compiled(torch.randn(64, 128, device="cuda")).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        print("training", all(l == l for l in losses))
    """, allocator, timeout=600)
    assert v["function"] == "True"
    assert v["training"] == "True"


@pytest.mark.parametrize("allocator", ALLOCATORS)
def test_memory_fraction(allocator):
    v = run("""
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(0.25)
        print("get", abs(torch.cuda.get_per_process_memory_fraction() - 0.25) < 1e-6)
        try:
            torch.empty(int(total * 0.4), dtype=torch.uint8, device="cuda")
            print("limited False")
        except torch.OutOfMemoryError as e:
            print("limited True")
            if CUDAMEM:
                print("why", "set_per_process_memory_fraction(0.25" in str(e))
        x = torch.empty(int(total * 0.2), dtype=torch.uint8, device="cuda")
        print("within", x.numel() > 0)
        try:
            torch.cuda.set_per_process_memory_fraction(1.5)
        except ValueError as e:
            print("bad", "Invalid fraction value" in str(e))
        torch.cuda.set_per_process_memory_fraction(1.0)
        print("unlimited", torch.cuda.get_per_process_memory_fraction() == 1.0)
    """, allocator, exclusive=True)
    assert v["get"] == "True"
    assert v["limited"] == "True"
    assert v["within"] == "True"
    assert v["bad"] == "True"
    assert v["unlimited"] == "True"
    if allocator == "cudamem":
        assert v["why"] == "True"


@pytest.mark.parametrize("allocator", ALLOCATORS)
def test_memory_fraction_counts_mempools(allocator):
    # PyTorch's own scenario (TestMemPool.test_mempool_limited_memory_with_allocator): what
    # MemPools hold counts against the fraction, and a pool marked use_on_oom lends its free
    # blocks when the fraction refuses a request.
    v = run("""
        mib = 1 << 20
        torch.cuda.empty_cache()
        total = torch.cuda.mem_get_info()[1]
        allowed = 80 * mib + torch.cuda.memory_reserved()
        torch.cuda.set_per_process_memory_fraction(allowed / total)
        kept = torch.cuda.MemPool()
        lends = torch.cuda.MemPool(use_on_oom=True)
        with torch.cuda.use_mem_pool(kept):
            a = torch.empty(40 * mib, dtype=torch.uint8, device="cuda")
        with torch.cuda.use_mem_pool(lends):
            b = torch.empty(40 * mib, dtype=torch.uint8, device="cuda")
        b_at = b.data_ptr()
        def refused(n):
            try:
                torch.empty(n, dtype=torch.uint8, device="cuda")
                return False
            except torch.OutOfMemoryError as e:
                if CUDAMEM:
                    print("why", "set_per_process_memory_fraction(" in str(e))
                return True
        print("pools_count", refused(40 * mib))
        del a, b
        c = torch.empty(30 * mib, dtype=torch.uint8, device="cuda")
        print("lent", c.data_ptr() == b_at)
        print("kept_not_lent", refused(30 * mib))
        del c
        with torch.cuda.use_mem_pool(lends):
            e = torch.empty(20 * mib, dtype=torch.uint8, device="cuda")
        print("pool_reused", e.data_ptr() == b_at)
        with torch.cuda.use_mem_pool(kept):
            try:
                torch.empty(60 * mib, dtype=torch.uint8, device="cuda")
                print("pool_chunk_refused False")
            except torch.OutOfMemoryError:
                print("pool_chunk_refused True")
        del e, kept, lends
        torch.cuda.empty_cache()
        torch.cuda.set_per_process_memory_fraction(1.0)
        x = torch.empty(100 * mib, dtype=torch.uint8, device="cuda")
        print("unlimited", x.numel() == 100 * mib)
    """, allocator, exclusive=True)
    for name in ("pools_count", "lent", "kept_not_lent", "pool_reused", "pool_chunk_refused",
                 "unlimited"):
        assert v[name] == "True", (name, v)
    if allocator == "cudamem":
        assert v["why"] == "True"


@pytest.mark.parametrize("allocator", ALLOCATORS)
def test_caching_allocator_alloc_profiler_and_empty_cache(allocator):
    v = run("""
        base = torch.cuda.memory_allocated()
        p = torch.cuda.caching_allocator_alloc(1 << 20)
        print("raw", torch.cuda.memory_allocated() - base == 1 << 20)
        torch.cuda.caching_allocator_delete(p)
        print("raw_freed", torch.cuda.memory_allocated() == base)
        side = torch.cuda.Stream()
        q = torch.cuda.caching_allocator_alloc(4096, stream=side)
        torch.cuda.caching_allocator_delete(q)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA],
                                    profile_memory=True) as prof:
            t = torch.ones(1 << 22, device="cuda")
            u = t * 2
        used = [e.self_device_memory_usage for e in prof.key_averages()]
        print("profiler", any(m > 0 for m in used))
        del t, u
        big = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
        free_with = torch.cuda.mem_get_info()[0]
        del big
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        print("returned", torch.cuda.mem_get_info()[0] - free_with >= (1 << 30) - (64 << 20))
    """, allocator, exclusive=True)
    assert v["raw"] == "True"
    assert v["raw_freed"] == "True"
    assert v["profiler"] == "True"
    assert v["returned"] == "True"


@pytest.mark.parametrize("allocator", ALLOCATORS)
def test_threads_amp_checkpoint_and_a_dataloader(allocator, tmp_path):
    v = run("""
        import threading
        from torch.utils.checkpoint import checkpoint
        from torch.utils.data import DataLoader, TensorDataset
        errors = []
        def worker(i):
            try:
                s = torch.cuda.Stream()
                with torch.cuda.stream(s):
                    for k in range(50):
                        a = torch.full((1 << (10 + k % 8),), float(i), device="cuda")
                        if (a * 2).sum().item() != 2.0 * i * a.numel():
                            errors.append((i, k))
            except Exception as e:  # noqa
                errors.append(repr(e))
        threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
        for t in threads: t.start()
        for t in threads: t.join()
        print("threads", errors == [])
        model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(),
                                    torch.nn.Linear(256, 1)).cuda()
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        scaler = torch.amp.GradScaler("cuda")
        for _ in range(3):
            with torch.autocast("cuda", dtype=torch.float16):
                x = torch.randn(128, 256, device="cuda", requires_grad=True)
                loss = checkpoint(model, x, use_reentrant=False).float().square().mean()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        print("amp", loss.item() == loss.item())
        if __name__ == "__main__":
            data = TensorDataset(torch.arange(4096, dtype=torch.float32).view(-1, 4))
            loader = DataLoader(data, batch_size=64, num_workers=2, pin_memory=True)
            total = 0.0
            for (batch,) in loader:
                total += batch.to("cuda", non_blocking=True).sum().item()
            print("loader", total == float(sum(range(4096))))
    """, allocator, tmp_path=tmp_path)
    assert v["threads"] == "True"
    assert v["amp"] == "True"
    assert v["loader"] == "True"


@pytest.mark.parametrize("allocator", ALLOCATORS)
def test_mem_pools(allocator):
    v = run("""
        pool = torch.cuda.MemPool()
        with torch.cuda.use_mem_pool(pool):
            a = torch.full((1 << 20,), 3.0, device="cuda")
        print("use_count", pool.use_count())
        print("in_pool", any(s["segment_pool_id"] == pool.id for s in torch.cuda.memory_snapshot()))
        print("value", a.sum().item() == 3.0 * (1 << 20))
        del a
        del pool
        if CUDAMEM:
            kv = cudamem.torch.pool(grow_ahead_bytes=0)
            with torch.cuda.use_mem_pool(kv):
                b = torch.full((1 << 20,), 2.0, device="cuda")
            print("cudamem_pool", b.sum().item() == 2.0 * (1 << 20),
                  cudamem.torch.stats(pool=kv)["in_use_bytes"] > 0)
    """, allocator)
    assert v["use_count"] == "1"
    assert v["in_pool"] == "True"
    assert v["value"] == "True"
    if allocator == "cudamem":
        assert v["cudamem_pool"] == "True True"


@pytest.mark.parametrize("allocator", ALLOCATORS)
def test_tensors_sent_to_other_processes(allocator, tmp_path):
    # Receivers with cudamem installed and without; a large tensor (many handles) and a small
    # one (a part of a handle). The sender frees its tensor and allocates again at once: the
    # block must not be reused before the receiver has let go (PyTorch counts receivers).
    v = run("""
        import torch.multiprocessing as mp
        def receiver(inbox, outbox, install):
            if install:
                import cudamem.torch
                cudamem.torch.install()
            for _ in range(2):
                t = inbox.get()
                outbox.put(float(t.double().sum().item()))
                del t
        if __name__ == "__main__":
            ctx = mp.get_context("spawn")
            for install in (True, False):
                inbox, outbox = ctx.Queue(), ctx.Queue()
                p = ctx.Process(target=receiver, args=(inbox, outbox, install))
                p.start()
                results = []
                for n in (25 << 20, 1000):
                    t = torch.arange(n, dtype=torch.float32, device="cuda") % 7
                    expected = float(t.double().sum().item())
                    inbox.put(t)
                    del t
                    scribble = torch.full((n,), 99.0, device="cuda")   # must not take t's memory
                    results.append(outbox.get(timeout=120) == expected)
                    del scribble
                p.join(120)
                print("received_%s" % ("cudamem" if install else "default"), all(results),
                      p.exitcode)
    """, allocator, tmp_path=tmp_path, timeout=400)
    assert v["received_cudamem"] == "True 0"
    assert v["received_default"] == "True 0"


@two_gpus
@pytest.mark.parametrize("allocator", ALLOCATORS)
def test_copies_between_two_gpus(allocator):
    v = run("""
        a = torch.arange(1 << 22, dtype=torch.float32, device="cuda:0")
        b = a.to("cuda:1")
        c = torch.empty(1 << 22, device="cuda:1")
        c.copy_(a)
        d = b.to("cuda:0")
        big = torch.full((64 << 20,), 5.0, device="cuda:0").to("cuda:1")
        print("copies", bool((b.cpu() == a.cpu()).all()), bool((c == b).all().item()),
              bool((d == a).all().item()), big.sum().item() == 5.0 * (64 << 20))
        print("per_device", torch.cuda.memory_allocated(0) > 0, torch.cuda.memory_allocated(1) > 0)
    """, allocator)
    assert v["copies"] == "True True True True"
    assert v["per_device"] == "True True"


@two_gpus
@pytest.mark.parametrize("allocator", ALLOCATORS)
def test_ddp_on_two_gpus_with_nccl(allocator, tmp_path):
    v = run("""
        import torch.distributed as dist
        import torch.multiprocessing as mp
        from torch.nn.parallel import DistributedDataParallel as DDP
        def rank_main(rank, world, install):
            if install:
                import cudamem.torch
                cudamem.torch.install()
            os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", "29533"
            torch.cuda.set_device(rank)
            dist.init_process_group("nccl", rank=rank, world_size=world)
            torch.manual_seed(0)
            model = DDP(torch.nn.Linear(1024, 1024).cuda(), device_ids=[rank])
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            for step in range(5):
                torch.manual_seed(rank * 100 + step)
                model(torch.randn(64, 1024, device="cuda")).square().mean().backward()
                opt.step()
                opt.zero_grad()
            w = model.module.weight.detach().clone()
            gathered = [torch.empty_like(w) for _ in range(world)]
            dist.all_gather(gathered, w)
            if rank == 0:
                print("ddp", bool(torch.equal(gathered[0], gathered[1])), flush=True)
            dist.destroy_process_group()
        if __name__ == "__main__":
            mp.spawn(rank_main, args=(2, CUDAMEM), nprocs=2)
    """, allocator, tmp_path=tmp_path, timeout=400, exclusive=True)
    assert v["ddp"] == "True"
