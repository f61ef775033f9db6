"""cudamem.numba on a GPU, each scenario in a fresh process (Numba binds its memory manager when
it makes a context). They run under cudamem's plugin and under Numba's own memory manager (and,
where it differs, with the plugin loaded by name), so that each is known to hold for Numba
itself; skipped without numba-cuda or a GPU. Bad input and the plugin over a simulated device,
no GPU needed: test_numba_host.py."""
import textwrap

import pytest

from conftest import HAS_CUPY, HAS_TORCH, needs_numba_gpu, run_python

# How each program chooses its memory manager: cudamem.numba.install(), Numba loading the
# plugin by name, or Numba's own.
SETUP = {
    "cudamem": "import cudamem.numba as cn\ncn.install()\n",
    "by_name": "",
    "numba": "",
}
ENV = {"by_name": {"NUMBA_CUDA_MEMORY_MANAGER": "cudamem.numba"}}
KERNELS = """
import gc
import numpy as np
from numba import cuda
import cudamem

@cuda.jit
def fill(out, value):
    i = cuda.grid(1)
    if i < out.size:
        out[i] = value

@cuda.jit
def slow_fill(out, value, sleeps):   # writes late: ~sleeps us after it starts
    i = cuda.grid(1)
    for _ in range(sleeps):
        cuda.nanosleep(1000)
    if i < out.size:
        out[i] = value

@cuda.jit
def axpy(a, x, y, out):
    i = cuda.grid(1)
    if i < out.size:
        out[i] = a * x[i] + y[i]

def blocks(n):
    return (n + 255) // 256
"""


def numba_program(setup, code):
    return setup + KERNELS + textwrap.dedent(code)


def run_numba(manager, code, timeout=300):
    """Runs KERNELS + code in a fresh process under `manager`; its stdout."""
    return run_python(numba_program(SETUP[manager], code), env=ENV.get(manager),
                      timeout=timeout)


# --- on a GPU ------------------------------------------------------------------------------------

@pytest.mark.gpu
@needs_numba_gpu
@pytest.mark.parametrize("manager", ["cudamem", "by_name", "numba"])
def test_arrays_and_kernels_on_several_streams(manager):
    # Several streams at once, then memory dropped while a slow kernel of one stream still
    # writes it and taken at once for another stream: the reused memory must hold what the
    # second stream wrote (under cudamem, the event before the allocation orders it).
    out = run_numba(manager, """
        mm = type(cuda.current_context().memory_manager).__name__
        print("manager", mm)
        n = 1 << 20
        streams = [cuda.stream() for _ in range(4)]
        results = []
        for k, s in enumerate(streams):
            x = cuda.to_device(np.arange(n, dtype=np.float32), stream=s)
            y = cuda.device_array(n, dtype=np.float32, stream=s)
            fill[blocks(n), 256, s](y, float(k))
            out = cuda.device_array_like(x, stream=s)
            axpy[blocks(n), 256, s](np.float32(2), x, y, out)
            results.append((k, s, out))
        ok = True
        for k, s, out in results:
            host = out.copy_to_host(stream=s)
            s.synchronize()
            ok &= bool((host == 2 * np.arange(n, dtype=np.float32) + k).all())
        print("streams", ok)
        s1, s2 = streams[0], streams[1]
        reused = 0
        clean = True
        for size in [n // 4] * 10 + [4 * n] * 10:    # 1 MiB (the pool's), 16 MiB (handles)
            a = cuda.device_array(size, dtype=np.float32, stream=s1)
            a_ptr = a.device_ctypes_pointer.value
            slow_fill[blocks(size), 256, s1](a, 1.0, 200)
            del a                                     # freed while slow_fill still runs
            b = cuda.device_array(size, dtype=np.float32, stream=s2)
            reused += b.device_ctypes_pointer.value == a_ptr
            fill[blocks(size), 256, s2](b, 2.0)
            s1.synchronize()
            s2.synchronize()
            clean &= bool((b.copy_to_host() == 2.0).all())
            del b
        print("reuse", clean, reused > 0)
        if mm == "CudamemNumbaManager":
            s = cudamem.stats(0)
            print("counted", s["allocations"] >= 20, s["in_use_bytes"] >= 12 * n)
            del x, y, out, results
            gc.collect()                              # numba's arrays may sit in cycles
            cuda.synchronize()
            held = cudamem.stats(0)["in_use_bytes"]
            print("freed", held == 0, held)
    """)
    expected = "NumbaCUDAMemoryManager" if manager == "numba" else "CudamemNumbaManager"
    assert "manager %s" % expected in out
    assert "streams True" in out
    if manager == "numba":
        assert "reuse True" in out  # Numba defers its frees: no reuse to check here
    else:
        assert "reuse True True" in out  # reused at once, and written in order
        assert "counted True True" in out
        assert "freed True" in out


@pytest.mark.gpu
@needs_numba_gpu
@pytest.mark.parametrize("manager", ["cudamem", "numba"])
def test_copies_views_host_memory_and_memory_info(manager):
    out = run_numba(manager, """
        ctx = cuda.current_context()
        ok = True
        for dtype in (np.float64, np.int32, np.uint8):
            for n in (1, 1000, 3 << 20):
                host = (np.arange(n) % 251).astype(dtype)
                d = cuda.to_device(host)
                ok &= bool((d.copy_to_host() == host).all())
                s = cuda.stream()
                back = np.empty_like(host)
                d.copy_to_host(back, stream=s)
                s.synchronize()
                ok &= bool((back == host).all())
        print("round_trips", ok)
        empty = cuda.device_array(0, dtype=np.float32)
        print("empty", empty.copy_to_host().size == 0)
        base = cuda.to_device(np.arange(1 << 20, dtype=np.float32))
        view = base[1000:2000]
        del base                                   # the view keeps the memory
        fill[blocks(1000), 256](view, 5.0)
        print("view", bool((view.copy_to_host() == 5.0).all()))
        pinned = cuda.pinned_array(1 << 20, dtype=np.float32)
        pinned[:] = 3
        mapped = cuda.mapped_array(1 << 10, dtype=np.float32)
        fill[blocks(1 << 10), 256](mapped, 4.0)
        cuda.synchronize()
        managed = cuda.managed_array(1 << 10, dtype=np.float32)
        fill[blocks(1 << 10), 256](managed, 6.0)
        cuda.synchronize()
        print("host_memory", float(cuda.to_device(pinned).copy_to_host().sum()) == 3 << 20,
              bool((mapped == 4.0).all()), bool((managed == 6.0).all()))
        free, total = ctx.get_memory_info()
        print("info", 0 < free <= total)
        if type(ctx.memory_manager).__name__ == "CudamemNumbaManager":
            big = cuda.device_array(1 << 28, dtype=np.float32)      # 1 GiB
            with_big = ctx.get_memory_info().free
            del big                                  # back to the pool: still free to use
            print("info_counts_the_pool",
                  ctx.get_memory_info().free >= with_big + (1 << 30) - (64 << 20))
            in_use = cudamem.stats()["in_use_bytes"]
            with cuda.defer_cleanup():
                held = cuda.device_array(1 << 20, dtype=np.float32)
                del held
                print("deferred", cudamem.stats()["in_use_bytes"] == in_use + (4 << 20))
            print("after_defer", cudamem.stats()["in_use_bytes"] == in_use)
            del view                                 # (a view holds its base for good)
            cuda.close()                             # reset(): Numba's memory freed, given back
            print("reset", cudamem.stats(0)["in_use_bytes"] == 0,
                  cudamem.stats(0)["reserved_bytes"] < (1 << 30))
    """)
    assert "round_trips True" in out
    assert "empty True" in out
    assert "view True" in out
    assert "host_memory True True True" in out
    assert "info True" in out
    if manager == "cudamem":
        assert "info_counts_the_pool True" in out
        assert "deferred True" in out
        assert "after_defer True" in out
        assert "reset True True" in out


IPC_RECEIVER = r"""
import base64, pickle, sys
import numpy as np
from numba import cuda

@cuda.jit
def triple(a):
    i = cuda.grid(1)
    if i < a.size:
        a[i] *= 3

handles = pickle.loads(base64.b64decode(sys.stdin.readline()))
print("receiver_manager", type(cuda.current_context().memory_manager).__name__)
for h in handles:
    with h as a:
        print("seen", float(a.copy_to_host().astype(np.float64).sum()))
        triple[(a.size + 255) // 256, 256](a)
        cuda.synchronize()
print("receiver_done", flush=True)
"""


# A receiver that has never heard of cudamem: importing it fails as if it were not installed.
NO_CUDAMEM = r"""
import importlib.abc, sys
class _NoCudamem(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] == "cudamem":
            raise ModuleNotFoundError("No module named 'cudamem'", name=name)
sys.meta_path.insert(0, _NoCudamem())
"""


@pytest.mark.gpu
@needs_numba_gpu
@pytest.mark.parametrize("sender", ["cudamem", "cudamem_pool", "numba"])
def test_arrays_sent_to_another_process(sender):
    # A large array (many handles), a small one (part of a handle) and a view at an offset,
    # opened by a receiver on Numba's own manager, then by one without cudamem on its path.
    setup = {"cudamem_pool": 'import cudamem.numba as cn\ncn.install(resource="pool")\n'}
    out = run_python(numba_program(setup.get(sender, SETUP.get(sender, "")), """
        import base64, os, pickle, subprocess, sys
        RECEIVER = %r
        NO_CUDAMEM = %r
        big_host = (np.arange(25 << 20) %% 7).astype(np.float32)
        big = cuda.to_device(big_host)
        small = cuda.to_device(np.arange(1000, dtype=np.float32))
        part = big[1000:3000]
        arrays = (big, small, part)
        try:
            handles = [x.get_ipc_handle() for x in arrays]
            payload = base64.b64encode(pickle.dumps(handles)).decode()
        except AttributeError as e:   # Numba's own IpcHandle, cuda-bindings 13.4 or later
            print("unpicklable", e)
            sys.exit(0)
        print("kinds", sorted({type(h._ipc_handle).__name__ for h in handles}))
        # What the receiver sees: it opens the handles in turn and triples each, and `part`
        # lies inside `big`, which it tripled just before.
        def sums(xs):
            s = [float(x.copy_to_host().astype(np.float64).sum()) for x in xs]
            return s[:2] + [3 * s[2]]
        expected = sums(arrays)
        for receiver in ("numba", "no_cudamem"):
            env = dict(os.environ)
            env.pop("NUMBA_CUDA_MEMORY_MANAGER", None)
            code = (NO_CUDAMEM if receiver == "no_cudamem" else "") + RECEIVER
            done = subprocess.run([sys.executable, "-c", code], input=payload + "\\n",
                                  capture_output=True, text=True, env=env, timeout=240,
                                  cwd="/")
            lines = done.stdout.splitlines()
            seen = [float(l.split()[1]) for l in lines if l.startswith("seen ")]
            print(receiver, done.returncode, seen == expected, "receiver_done" in lines,
                  [l for l in lines if l.startswith("receiver_manager")])
            if done.returncode != 0:
                print(receiver + "_error", done.stderr.strip().splitlines()[-1])
            if done.returncode == 0:   # the receiver tripled the memory the sender holds
                big_host *= 3
                big_host[1000:3000] *= 3
                print(receiver + "_wrote", bool((big.copy_to_host() == big_host).all()),
                      bool((small.copy_to_host() == 3 * np.arange(1000)).all()))
                small = cuda.to_device(np.arange(1000, dtype=np.float32))  # for the next
                handles[1] = small.get_ipc_handle()
                payload = base64.b64encode(pickle.dumps(handles)).decode()
                expected = sums((big, small, big[1000:3000]))
    """ % (IPC_RECEIVER, NO_CUDAMEM)), env=ENV.get(sender), timeout=600)
    if "unpicklable" in out:
        assert sender == "numba" and "reserved" in out, out
        pytest.skip("numba-cuda's own IpcHandle cannot be pickled with this cuda-bindings "
                    "(CUipcMemHandle has no 'reserved'): %s" % out.strip())
    assert "numba 0 True True ['receiver_manager NumbaCUDAMemoryManager']" in out, out
    assert "numba_wrote True True" in out, out
    if sender == "cudamem":
        assert "kinds ['VmmIpcHandle']" in out, out
        # Unpickling a VmmIpcHandle imports cudamem.numba: documented, and said plainly.
        assert "no_cudamem_error ModuleNotFoundError: No module named 'cudamem'" in out, out
    else:
        if sender == "cudamem_pool":
            assert "kinds ['CudaIpcHandle']" in out or "kinds ['IpcHandle']" in out, out
        if "kinds ['CudaIpcHandle']" in out:
            assert "no_cudamem_error ModuleNotFoundError" in out, out
        else:  # Numba's own handle: a receiver that never heard of cudamem opens it
            assert "no_cudamem 0 True True" in out, out
            assert "no_cudamem_wrote True True" in out, out


@pytest.mark.gpu
@needs_numba_gpu
@pytest.mark.parametrize("manager", ["cudamem", "numba"])
def test_a_fill_to_out_of_memory_then_recovery(manager):
    out = run_numba(manager, """
        from numba.cuda.cudadrv.driver import CudaAPIError, binding
        held = []
        try:
            while True:
                held.append(cuda.device_array(1 << 28, dtype=np.float32))     # 1 GiB each
        except CudaAPIError as e:
            print("oom", e.code == binding.CUresult.CUDA_ERROR_OUT_OF_MEMORY, len(held) > 8)
            print("cudamem_error", isinstance(e, cudamem.OutOfMemoryError),
                  "Verdict:" in str(e))
        del held[::2]
        again = [cuda.device_array(1 << 28, dtype=np.float32) for _ in range(4)]
        fill[blocks(1 << 28), 256](again[-1], 7.0)
        print("recovered", float(again[-1][-1:].copy_to_host()[0]) == 7.0)
    """, timeout=600)
    assert "oom True True" in out
    assert "recovered True" in out
    if manager == "cudamem":
        assert "cudamem_error True True" in out


@pytest.mark.gpu
@needs_numba_gpu
def test_a_budget_out_of_memory_is_numbas_error_with_cudamems_report():
    out = run_numba("numba", """
        import cudamem.numba as cn
        from numba.cuda.cudadrv.driver import CudaAPIError, binding
        cn.install(limit_bytes="256MiB")
        keep = cuda.device_array(200 << 20, dtype=np.uint8)
        try:
            cuda.device_array(100 << 20, dtype=np.uint8)
        except CudaAPIError as e:
            print("caught", type(e).__name__, e.code == binding.CUresult.CUDA_ERROR_OUT_OF_MEMORY,
                  isinstance(e, cudamem.OutOfMemoryError), isinstance(e, MemoryError))
            print("report", "Verdict: budget" in str(e), "could not allocate 100.00 MiB" in str(e))
        print("info", cuda.current_context().get_memory_info().free <= 56 << 20)
        print("after", cuda.to_device(np.ones(10)).copy_to_host().sum() == 10)
    """)
    assert "caught OutOfMemoryError True True True" in out
    assert "report True True" in out
    assert "info True" in out
    assert "after True" in out


@pytest.mark.gpu
@needs_numba_gpu
def test_install_after_numbas_first_context_is_refused_and_numba_goes_on():
    out = run_numba("numba", """
        import cudamem.numba as cn
        a = cuda.to_device(np.arange(10))
        try:
            cn.install()
        except cudamem.StateError as e:
            print("refused", "before Numba makes its CUDA context" in str(e),
                  "NumbaCUDAMemoryManager" in str(e))
        print("installed", cn.is_installed())
        print("works", int(cuda.to_device(np.arange(10)).copy_to_host().sum()) == 45,
              int(a.copy_to_host().sum()) == 45)
    """)
    assert "refused True True" in out
    assert "installed False" in out
    assert "works True True" in out


@pytest.mark.gpu
@needs_numba_gpu
@pytest.mark.skipif(not (HAS_TORCH and HAS_CUPY), reason="needs PyTorch and CuPy too")
def test_three_libraries_share_the_pools():
    # PyTorch, CuPy and Numba on cudamem: one set of pools, counted by cudamem.stats(). Each
    # library holds 4 GiB; one of them fills the device to its own out-of-memory error, another
    # frees its 4 GiB, and the first allocates 2 GiB again: the freed memory serves it.
    out = run_python("""
        import numpy as np, torch, cupy, cudamem
        import cudamem.torch as ct, cudamem.cupy as cc, cudamem.numba as cn
        from numba import cuda
        from numba.cuda.cudadrv.driver import CudaAPIError
        ct.install()
        cc.install()
        cn.install()
        GiB = 1 << 30
        make = {
            "torch": lambda n: torch.empty(n, dtype=torch.uint8, device="cuda"),
            "cupy": lambda n: cupy.empty(n, dtype=cupy.uint8),
            "numba": lambda n: cuda.device_array(n, dtype=np.uint8),
        }
        errors = {"torch": torch.OutOfMemoryError, "cupy": cupy.cuda.memory.OutOfMemoryError,
                  "numba": CudaAPIError}
        t = torch.ones(1 << 26, device="cuda")
        c = cupy.ones(1 << 26, dtype=cupy.float32)
        n = cuda.to_device(np.ones(1 << 26, dtype=np.float32))
        s = cudamem.stats(0)
        print("counted", s["in_use_bytes"] >= 3 << 28, s == ct.stats() == cc.stats() == cn.stats())
        total = float(t.sum()) + float(c.sum()) + float(n.copy_to_host().sum())
        print("values", abs(total - 3.0 * (1 << 26)) < 1)
        del t, c, n
        ballast = {name: make[name](4 * GiB) for name in make}
        order = ["torch", "cupy", "numba"]
        for i, filler in enumerate(order):
            freer = order[(i + 1) % 3]
            fill = []
            try:
                while True:
                    fill.append(make[filler](GiB))
            except errors[filler] as e:     # each library's own error, cudamem's report
                print("oom_" + filler, "Verdict:" in str(e), len(fill) > 4)
            del ballast[freer]                             # freed through another library
            extra = make[filler](2 * GiB)
            print("recovered_" + filler, True)
            del fill, extra
            ballast[freer] = make[freer](4 * GiB)
        print("in_use", 12 * GiB <= cudamem.stats()["in_use_bytes"] < 12 * GiB + (64 << 20))
    """, timeout=600)
    assert "counted True True" in out
    assert "values True" in out
    for name in ("torch", "cupy", "numba"):
        assert "oom_%s True True" % name in out, out
        assert "recovered_%s True" % name in out, out
    assert "in_use True" in out
