"""cudamem.numba's bad input, and the plugin called as Numba calls it over a simulated device:
no GPU needed (numba-cuda for most; the first test not even that). Each in a fresh process:
Numba binds its memory manager when it makes a context, and install() configures cudamem's
process-wide allocator once. The GPU scenarios are in test_numba.py."""
import os
import site
import subprocess
import sys
import textwrap

from conftest import PACKAGE_ROOT, needs_numba, run_python


def _blocked(names):
    """Code that makes the top-level packages `names` unimportable in the program it starts."""
    return textwrap.dedent("""
        import importlib.abc, sys
        class _Blocked(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path, target=None):
                if name.split(".")[0] in %r:
                    raise ModuleNotFoundError("No module named %%r" %% name, name=name)
        sys.meta_path.insert(0, _Blocked())
    """ % (names,))


IMPORT_AND_SAY = """
try:
    import cudamem.numba
except ImportError as e:
    print("ImportError", str(e))
"""


def _one_sentence(text):
    return "\n" not in text and text.count(". ") == 0 and not text.endswith(".")


def test_without_numba_the_import_says_what_to_install():
    out = run_python(_blocked(("numba", "numba_cuda")) + IMPORT_AND_SAY)
    message = out.split("ImportError ", 1)[1].strip()
    assert "pip install numba-cuda" in message, out
    assert "No module named 'numba'" in message, out
    assert _one_sentence(message), message


@needs_numba
def test_with_numba_but_without_numba_cuda_the_import_says_what_to_install():
    # numba-cuda takes over numba.cuda through a .pth file: without site's .pth processing
    # (python -S, site-packages put on the path by hand) Numba has only its built-in target.
    code = "import sys\nsys.path += %r\n" % site.getsitepackages() + IMPORT_AND_SAY
    env = dict(os.environ, PYTHONPATH=PACKAGE_ROOT)
    done = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True,
                          env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    message = done.stdout.split("ImportError ", 1)[1].strip()
    assert "pip install numba-cuda" in message and "built-in CUDA target" in message, message
    assert _one_sentence(message), message


@needs_numba
def test_under_numbas_simulator_the_import_says_so():
    out = run_python(IMPORT_AND_SAY, env={"NUMBA_ENABLE_CUDASIM": "1"})
    message = out.split("ImportError ", 1)[1].strip()
    assert "NUMBA_ENABLE_CUDASIM=1" in message and "unset" in message, out
    assert _one_sentence(message), message


@needs_numba
def test_install_after_numba_made_a_context_is_refused_and_nothing_is_taken():
    # A context Numba made with its own manager, as driver.devices holds it after the first
    # device array (no GPU here: the context is a stand-in with Numba's manager in it).
    out = run_python("""
        import cudamem, cudamem.numba as cn
        from cudamem import _process
        from numba.cuda.cudadrv import driver
        class Context:
            memory_manager = driver.NumbaCUDAMemoryManager(context=None)
        class Device:
            id = 0
            primary_context = Context()
        driver.driver.devices[0] = Device()
        try:
            cn.install()
        except cudamem.StateError as e:
            print("refused", "before Numba makes its CUDA context" in str(e),
                  "NumbaCUDAMemoryManager" in str(e), "NUMBA_CUDA_MEMORY_MANAGER" in str(e))
        print("untouched", cn.is_installed(), driver._memory_manager, _process.settings())
        del driver.driver.devices[0]                   # Numba closed it (numba.cuda.close())
        cn.install()
        print("installed", cn.is_installed(), driver._memory_manager.__name__)
    """)
    assert "refused True True True" in out
    assert "untouched False None None" in out
    assert "installed True CudamemNumbaManager" in out


@needs_numba
def test_install_refuses_another_memory_manager():
    out = run_python("""
        import cudamem, cudamem.numba as cn
        from numba import cuda
        class Other(cuda.HostOnlyCUDAMemoryManager):
            interface_version = 1
            def memalloc(self, size): raise NotImplementedError
            def initialize(self): pass
            def get_ipc_handle(self, memory): raise NotImplementedError
            def get_memory_info(self): raise NotImplementedError
        cuda.set_memory_manager(Other)
        try:
            cn.install()
        except cudamem.StateError as e:
            print("refused", "Other" in str(e), "set_memory_manager" in str(e))
        print("installed", cn.is_installed())
    """)
    assert "refused True True" in out
    assert "installed False" in out
    out = run_python("""
        import cudamem, cudamem.numba as cn
        try:
            cn.install()
        except cudamem.StateError as e:
            print("refused", "NUMBA_CUDA_MEMORY_MANAGER=rmm.allocators.numba" in str(e))
    """, env={"NUMBA_CUDA_MEMORY_MANAGER": "rmm.allocators.numba"})
    assert "refused True" in out


@needs_numba
def test_bad_options_are_config_errors_and_install_nothing():
    out = run_python("""
        import cudamem, cudamem.numba as cn
        from cudamem import _process
        from numba.cuda.cudadrv import driver
        bad = [{"limit": 1}, {"limit_bytes": 1.5}, {"limit_bytes": True}, {"resource": 3},
               {"resource": "heap"}, {"limit_bytes": "lots"}, {"limit_bytes": -1},
               {"handle_bytes": "3MiB"}, {"resource": "pool", "grow_ahead_bytes": 0}]
        for options in bad:
            try:
                cn.install(**options)
                print("accepted", options)
            except cudamem.ConfigError as e:
                print("ConfigError", isinstance(e, (TypeError, ValueError)), str(e)[:70])
        print("untouched", cn.is_installed(), driver._memory_manager, _process.settings())
        cn.install(limit_bytes="1GiB")
        cn.install(limit_bytes="1GiB")                      # the same: nothing
        try:
            cn.install()
        except cudamem.StateError as e:
            print("second", "cannot change it" in str(e))
        print("installed", cn.is_installed(), driver._memory_manager.__name__)
        try:
            cn.stats("0")
        except TypeError as e:
            print("stats", str(e))
        try:
            cn.report(0, nbytes=-1)
        except TypeError as e:
            print("report", str(e))
    """)
    assert out.count("ConfigError True") == 9, out
    assert "accepted" not in out
    assert "untouched False None None" in out
    assert "second True" in out
    assert "installed True CudamemNumbaManager" in out
    assert "stats device must be an int or a Numba device, not str" in out
    assert "report nbytes must be a non-negative int" in out


@needs_numba
def test_the_plugin_as_numba_calls_it_over_a_simulated_device():
    # Numba's calls into the plugin, made as Numba makes them, over a simulated device (no
    # GPU): the context is a stand-in, and the driver calls the plugin makes are recorded.
    out = run_python("""
        import cudamem, cudamem.numba as cn
        from numba.cuda.cudadrv import driver
        cn.install(simulate_bytes="4GiB", limit_bytes="1GiB", grow_ahead_bytes=0)
        calls = []
        class Driver:
            def cuEventCreate(self, flags): calls.append("event"); return "an event"
            def cuEventRecord(self, event, stream): calls.append(("record", int(stream)))
            def cuEventDestroy(self, event): calls.append("destroy")
            def cuCtxSynchronize(self): calls.append("synchronize")
            def cuMemGetInfo(self): return (3 << 30, 4 << 30)
        driver.driver = Driver()
        class Device:
            id = 0
        class Context:
            device = Device()
        context = Context()
        mm = cn.CudamemNumbaManager(context=context)
        mm.initialize()
        MiB = 1 << 20
        in_use = lambda: cudamem.stats(0)["in_use_bytes"]
        a = mm.memalloc(64 * MiB)
        view = a.view(MiB)                          # as a slice of a device array makes
        del a
        print("view_holds", in_use() == 64 * MiB, calls == [])
        del view
        print("freed", in_use() == 0)
        b = mm.memalloc(MiB)
        c = mm.memalloc(MiB)
        legacy = int(driver.binding.CUstream(driver.binding.CU_STREAM_LEGACY))
        print("ordered_after_the_free", calls == ["event", ("record", legacy)])
        print("empty", mm.memalloc(0).size, in_use() == 2 * MiB)
        print("info", mm.get_memory_info() == (1024 * MiB - 2 * MiB, 4 << 30))
        with mm.defer_cleanup():
            with mm.defer_cleanup():
                d = mm.memalloc(MiB)
                del d
            print("held", in_use() == 3 * MiB, "synchronize" not in calls)
        print("given_back", in_use() == 2 * MiB, calls[-1] == "synchronize")
        try:
            mm.memalloc(1 << 30)
        except driver.CudaAPIError as e:
            oom = driver.binding.CUresult.CUDA_ERROR_OUT_OF_MEMORY
            print("oom", type(e).__name__, e.code == oom,
                  isinstance(e, cudamem.OutOfMemoryError), "Verdict: budget" in str(e))
        e = mm.memalloc(MiB)
        print("goes_on", in_use() == 3 * MiB)
        for shared in (e, e.view(4096)):            # the allocation is found under a view too
            try:
                mm.get_ipc_handle(shared)
            except cudamem.StateError as err:       # a simulated device exports nothing
                print("ipc", "cannot export memory as POSIX file descriptors" in str(err))
        del shared                                  # a view holds its allocation for good
        mm.reset()                                  # numba.cuda.close(): b, c and e with it
        print("reset", in_use() == 0, cudamem.stats(0)["reserved_bytes"] == 0, "destroy" in calls)
    """)
    assert "view_holds True True" in out
    assert "freed True" in out
    assert "ordered_after_the_free True" in out
    assert "empty 0 True" in out
    assert "info True" in out
    assert "held True True" in out
    assert "given_back True True" in out
    assert "oom OutOfMemoryError True True True" in out
    assert "goes_on True" in out
    assert out.count("ipc True") == 2, out
    assert "reset True True True" in out
