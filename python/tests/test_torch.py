"""cudamem.torch on a GPU: each scenario in a fresh process, since PyTorch's allocator is
chosen once per process. Skipped (never passed) without PyTorch or a CUDA device."""
import pytest

from conftest import CUDA_DEVICES, needs_torch_gpu, run_python

pytestmark = [pytest.mark.gpu, needs_torch_gpu]


def test_tensors_live_in_cudamem_and_are_correct():
    out = run_python("""
        import torch, cudamem.torch as ct
        ct.install()
        before = ct.stats()
        x = torch.arange(1 << 20, device="cuda", dtype=torch.float32)
        y = (x * 2).sum().item()
        s = ct.stats()
        print("sum", y == float(sum(range(1 << 20))) * 2)
        print("counted", s["in_use_bytes"] >= 4 << 20, s["allocations"] > before["allocations"])
        big = torch.empty(3 << 30, dtype=torch.uint8, device="cuda")
        big.fill_(7)
        print("big", int(big[-1].item()) == 7, ct.stats()["in_use_bytes"] >= 3 << 30)
        del big, x
        torch.cuda.synchronize()
        reserved = ct.stats()["reserved_bytes"]
        torch.cuda.empty_cache()                     # cudamem's release()
        print("released", ct.stats()["reserved_bytes"] < reserved)
        print("installed", ct.is_installed(), ct.stats()["peak_in_use_bytes"] >= 3 << 30)
    """)
    assert "sum True" in out
    assert "counted True True" in out
    assert "big True True" in out
    assert "released True" in out
    assert "installed True True" in out


def test_out_of_memory_raises_torch_OutOfMemoryError_with_the_report_and_goes_on():
    out = run_python("""
        import torch, cudamem.torch as ct
        ct.install(limit_bytes="1GiB")
        keep = torch.ones(512 << 20, dtype=torch.uint8, device="cuda")
        try:
            torch.empty(700 << 20, dtype=torch.uint8, device="cuda")
            print("no exception")
        except torch.OutOfMemoryError as e:
            text = str(e)
            print("caught OutOfMemoryError")
            print("report", "could not allocate 700.00 MiB" in text, "Verdict: budget" in text,
                  "limiting_adaptor" in text, "set_budget" in text)
            print("last", ct.last_oom_report() in text)
        z = torch.full((100 << 20,), 3, dtype=torch.uint8, device="cuda")   # goes on working
        print("after", int(z[-1].item()) == 3, int(keep[-1].item()) == 1)
    """)
    assert "caught OutOfMemoryError" in out
    assert "report True True True True" in out
    assert "last True" in out
    assert "after True True" in out


def test_device_full_names_the_holders():
    out = run_python("""
        import torch, cudamem.torch as ct
        ct.install()
        free, total = torch.cuda.mem_get_info()
        try:
            torch.empty(total + (1 << 30), dtype=torch.uint8, device="cuda")
        except torch.OutOfMemoryError as e:
            text = str(e)
            print("verdict", "Verdict: larger_than_device" in text)
            print("device", "Device:" in text, "vm_pool_resource" in text)
    """)
    assert "verdict True" in out
    assert "device True True" in out


def test_without_the_compiled_allocator_a_failed_allocation_is_a_RuntimeError_at_the_call():
    # CUDAMEM_TORCH_GLUE=0 (or no compiler): PyTorch's pluggable interface, with a warning.
    out = run_python("""
        import torch, warnings, cudamem.torch as ct
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ct.install(limit_bytes="64MiB")
        print("warned", any("served in part only" in str(w.message) for w in caught))
        try:
            torch.empty(100 << 20, dtype=torch.uint8, device="cuda")
            print("no exception")
        except torch.OutOfMemoryError:
            print("OutOfMemoryError (unexpected)")
        except RuntimeError as e:
            print("RuntimeError", "Verdict: budget" in str(e))
    """, env={"CUDAMEM_TORCH_GLUE": "0"})
    assert "warned True" in out
    assert "RuntimeError True" in out


def test_the_pluggable_interface_is_asked_for_by_an_argument_and_says_what_it_lacks():
    out = run_python("""
        import torch, warnings, cudamem, cudamem.torch as ct
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ct.install(interface="pluggable")
        said = [str(w.message) for w in caught if "served in part only" in str(w.message)]
        print("warned", len(said), 'install(interface="pluggable")' in said[0],
              "snapshots" in said[0], "the memory fraction" in said[0])
        print("works", torch.ones(4, device="cuda").sum().item())
        try:
            torch.cuda.memory_stats()
            print("stats served")
        except RuntimeError as e:
            print("stats refused", "does not yet support" in str(e))
        try:
            ct.call_times()
        except cudamem.StateError as e:
            print("no timing", "pluggable interface" in str(e))
    """)
    assert "warned 1 True True True" in out
    assert "works 4.0" in out
    assert "stats refused True" in out
    assert "no timing True" in out


def test_time_calls_counts_the_allocators_own_calls_while_on():
    out = run_python("""
        import torch, cudamem.torch as ct
        ct.install()
        x = torch.empty(1 << 20, device="cuda")
        del x
        print("off", ct.call_times())
        ct.time_calls(True)
        kept = [torch.empty(n << 20, dtype=torch.uint8, device="cuda") for n in (1, 8, 64)]
        del kept
        on = ct.call_times()
        print("on", on["allocations"], on["frees"], on["allocation_ns"] > 0, on["free_ns"] > 0)
        ct.time_calls(False)
        y = torch.empty(1 << 20, device="cuda")
        del y
        print("stopped", ct.call_times() == on)
    """)
    assert "off {'allocations': 0, 'allocation_ns': 0, 'frees': 0, 'free_ns': 0}" in out
    assert "on 3 3 True True" in out
    assert "stopped True" in out


def test_a_request_past_the_fraction_is_an_oom_rejection_from_pytorch_2_12():
    # cudamem refuses a request past the memory fraction before it allocates: from PyTorch 2.12
    # that is counted as PyTorch counts its preemptive rejections (num_oom_rejections); 2.11
    # has no such statistic.
    out = run_python("""
        import torch, cudamem.torch as ct
        ct.install()
        print("release", "%d.%d" % tuple(int(x) for x in torch.__version__.split(".")[:2]))
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(0.25)
        try:
            torch.empty(int(total * 0.4), dtype=torch.uint8, device="cuda")
        except torch.OutOfMemoryError:
            print("refused")
        stats = torch.cuda.memory_stats()
        print("ooms", stats["num_ooms"], "rejections", stats.get("num_oom_rejections"))
    """)
    release = tuple(int(x) for x in out.split("release ")[1].split()[0].split("."))
    assert "refused" in out
    if release >= (2, 12):
        assert "ooms 1 rejections 1" in out
    else:
        assert "ooms 1 rejections None" in out


def test_install_after_pytorch_allocated_raises_with_a_sentence():
    out = run_python("""
        import torch, cudamem, cudamem.torch as ct
        torch.zeros(1, device="cuda")
        try:
            ct.install()
        except cudamem.StateError as e:
            print("refused:", e)
    """)
    assert "refused: cudamem.torch.install() must run before PyTorch initialises" in out


def test_bad_options_and_a_second_install():
    out = run_python("""
        import torch, cudamem, cudamem.torch as ct
        for kwargs in ({"resource": "heap"}, {"limit_bytes": "lots"},
                       {"resource": "pool", "grow_ahead_bytes": 0}):
            try:
                ct.install(**kwargs)
            except ValueError as e:
                print("ValueError", str(e)[:60])
        for kwargs in ({"limit": 1}, {"limit_bytes": 1.5}):
            try:
                ct.install(**kwargs)
            except TypeError as e:
                print("TypeError", str(e)[:60])
        ct.install(resource="vm_pool", grow_ahead_bytes=0)
        ct.install(resource="vm_pool", grow_ahead_bytes=0)     # the same: nothing
        try:
            ct.install(resource="pool")
        except cudamem.StateError as e:
            print("second:", "cannot change it" in str(e))
        print("works", torch.ones(4, device="cuda").sum().item())
    """)
    assert out.count("ValueError") == 3
    assert out.count("TypeError") == 2
    assert "second: True" in out
    assert "works 4.0" in out


def test_environment_variables_configure_and_bad_ones_are_refused():
    out = run_python("""
        import torch, cudamem.torch as ct
        ct.install()
        print("limit", ct.stats()["limit_bytes"])
    """, env={"CUDAMEM_LIMIT_BYTES": "2GiB", "CUDAMEM_RESOURCE": "pool"})
    assert "limit %d" % (2 << 30) in out
    out = run_python("""
        import cudamem, cudamem.torch as ct
        try:
            ct.install()
        except ValueError as e:
            print("refused:", e)
    """, env={"CUDAMEM_GROW_AHEAD_BYTES": "four"})
    assert "refused: cudamem: grow_ahead_bytes=four (from environment variable " \
           "CUDAMEM_GROW_AHEAD_BYTES): not a size" in out


def test_record_stream_keeps_a_block_from_being_reused_early():
    # x is made on the main stream and read, after a long sleep, on a side stream. It is freed
    # at once. A new tensor of the same size on the main stream would take x's block and
    # overwrite it while the side stream's kernel has yet to read it, unless record_stream
    # held the free back.
    script = """
        import torch, cudamem.torch as ct
        ct.install(grow_ahead_bytes=0)
        n = 1 << 22
        main, side = torch.cuda.current_stream(), torch.cuda.Stream()
        # Warm up every kernel used below on both streams: the first launch of a kernel loads
        # its module (CUDA's lazy loading), which waits for the device and would end the sleep.
        for stream in (main, side):
            with torch.cuda.stream(stream):
                torch.cuda._sleep(1000)
                warm = torch.full((n,), 1.0, device="cuda") * 2
                (warm == 2).all().item()
        del warm
        torch.cuda.synchronize()
        x = torch.full((n,), 1.0, device="cuda")
        address = x.data_ptr()
        side.wait_stream(main)
        with torch.cuda.stream(side):
            torch.cuda._sleep(200_000_000)       # ~0.1 s of GPU time before the read
            y = x * 2
        RECORD
        del x
        s = torch.cuda.memory_stats()            # blocks freed but waiting for a stream
        pending = s["active.all.current"] - s["allocation.all.current"]
        z = torch.full((n,), 7.0, device="cuda")
        torch.cuda.synchronize()
        print("pending", pending)
        print("reused", z.data_ptr() == address)
        print("y intact", bool((y == 2).all().item()))
        w = torch.empty(8, device="cuda")         # the next allocation retires the free
        s = torch.cuda.memory_stats()
        print("after", s["active.all.current"] - s["allocation.all.current"])
    """
    recorded = run_python(script.replace("RECORD", "x.record_stream(side)"))
    assert "pending 1" in recorded
    assert "reused False" in recorded
    assert "y intact True" in recorded
    assert "after 0" in recorded
    # The control, without record_stream: the block is reused at once (what made the test
    # above meaningful), and the side stream reads the new tensor's 7s.
    control = run_python(script.replace("RECORD", "pass"))
    assert "pending 0" in control
    assert "reused True" in control
    assert "y intact False" in control


def test_mem_pool_serves_one_region_of_the_program():
    out = run_python("""
        import torch, cudamem.torch as ct
        outside = torch.ones(1 << 20, device="cuda")        # PyTorch's own allocator
        kv = ct.pool(resource="vm_pool", grow_ahead_bytes=0)
        with torch.cuda.use_mem_pool(kv):
            blocks = [torch.full((1 << 20,), float(i), device="cuda") for i in range(8)]
        s = ct.stats(pool=kv)
        print("pool", s["in_use_bytes"] >= 8 * (4 << 20), s["allocations"] >= 1)
        print("values", all(int(b[0].item()) == i for i, b in enumerate(blocks)))
        print("outside", ct.stats()["allocations"] == 0, torch.cuda.memory_allocated() > 0)
        limited = ct.pool(resource="pool", limit_bytes="256MiB")
        try:
            with torch.cuda.use_mem_pool(limited):
                torch.empty(300 << 20, dtype=torch.uint8, device="cuda")
            print("no exception")
        except torch.OutOfMemoryError:
            print("pool oom", "Verdict: budget" in ct.last_oom_report(pool=limited))
    """)
    assert "pool True True" in out
    assert "values True" in out
    assert "outside True True" in out
    assert "pool oom True" in out


def test_report_and_stats_reject_bad_arguments():
    out = run_python("""
        import torch, cudamem, cudamem.torch as ct
        ct.install()
        torch.ones(1, device="cuda")
        print("report", "vm_pool_resource" in ct.report(nbytes=1 << 20))
        for bad in (lambda: ct.stats(device="cpu"), lambda: ct.stats(device=1.0),
                    lambda: ct.report(nbytes=-1), lambda: ct.stats(pool=object())):
            try:
                bad()
            except (TypeError, ValueError) as e:
                print("bad", type(e).__name__)
        try:
            ct.stats(device=torch.cuda.device_count())
        except ValueError as e:
            print("no device", "does not exist" in str(e))
    """)
    assert "report True" in out
    assert out.count("bad ") == 4
    assert "no device True" in out


@pytest.mark.skipif(CUDA_DEVICES < 2, reason="needs 2 CUDA devices")
def test_each_device_has_its_own_stack():
    out = run_python("""
        import torch, cudamem.torch as ct
        ct.install()
        a = torch.ones(1 << 20, device="cuda:0")
        b = torch.ones(2 << 20, device="cuda:1")
        print("devices", ct.stats(0)["in_use_bytes"] == 4 << 20,
              ct.stats(1)["in_use_bytes"] == 8 << 20)
        print("copy", (b[: 1 << 20].to("cuda:0") == a).all().item())
    """)
    assert "devices True True" in out
    assert "copy True" in out
