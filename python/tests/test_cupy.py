"""cudamem.cupy on a GPU, each scenario in a fresh process. Skipped without CuPy or a GPU."""
import pytest

from conftest import HAS_TORCH, needs_cupy_gpu, run_python

pytestmark = [pytest.mark.gpu, needs_cupy_gpu]


def test_arrays_live_in_cudamem_and_are_correct():
    out = run_python("""
        import cupy, cudamem.cupy as cc
        cc.install()
        a = cupy.arange(1 << 20, dtype=cupy.float32)
        print("sum", float((a * 2).sum()) == float(sum(range(1 << 20))) * 2)
        s = cc.stats()
        print("counted", s["in_use_bytes"] >= 4 << 20, s["allocations"] >= 2)
        s1 = cupy.cuda.Stream(non_blocking=True)
        with s1:
            b = cupy.ones(1 << 20, dtype=cupy.float32)
            b += 1
        s1.synchronize()
        print("stream", float(b.sum()) == 2.0 * (1 << 20))
        empty = cupy.empty(0)
        del a, b
        print("freed", cc.stats()["in_use_bytes"] == 0)
    """)
    assert "sum True" in out
    assert "counted True True" in out
    assert "stream True" in out
    assert "freed True" in out


def test_out_of_memory_is_cupys_error_with_the_report():
    out = run_python("""
        import cupy, cudamem, cudamem.cupy as cc
        cc.install(limit_bytes="256MiB")
        keep = cupy.ones(200 << 20, dtype=cupy.uint8)
        try:
            cupy.empty(100 << 20, dtype=cupy.uint8)
        except cupy.cuda.memory.OutOfMemoryError as e:
            print("caught", isinstance(e, cudamem.OutOfMemoryError), isinstance(e, MemoryError))
            print("report", "Verdict: budget" in str(e), "could not allocate" in str(e))
        print("after", int(cupy.ones(10, dtype=cupy.uint8).sum()) == 10)
    """)
    assert "caught True True" in out
    assert "report True True" in out
    assert "after True" in out


@pytest.mark.skipif(not HAS_TORCH, reason="needs PyTorch too")
def test_torch_and_cupy_share_one_allocator():
    out = run_python("""
        import torch, cupy, cudamem, cudamem.torch as ct, cudamem.cupy as cc
        ct.install(grow_ahead_bytes=0)
        cc.install(grow_ahead_bytes=0)                      # the same options: shared
        t = torch.ones(1 << 20, device="cuda")
        c = cupy.ones(1 << 20, dtype=cupy.float32)
        print("shared", ct.stats()["in_use_bytes"] >= 8 << 20, cc.stats() == ct.stats())
        try:
            cc.install(resource="pool")
        except cudamem.StateError as e:
            print("refused", "cudamem.torch.install()" in str(e))
    """)
    assert "shared True True" in out
    assert "refused True" in out
