#!/usr/bin/env python3
"""Runs PyTorch's own allocator tests (test_cuda.py) under one CUDA allocator, writes JSON.

    python3 run_pytorch_tests.py --allocator default --out default.json
    python3 run_pytorch_tests.py --allocator cudamem --out cudamem.json
    python3 compare.py default.json cudamem.json

--allocator cudamem imports cudamem.torch and calls install() before test_cuda.py is
imported (test_cuda.py initialises CUDA at import, through get_device_properties), so every
test of the run uses cudamem's allocator; --allocator default leaves PyTorch's caching
allocator in place. Tests that start a Python subprocess of their own (test_allocator_backend,
test_allocator_memory_fraction_setting, test_graph_error, ...) run PyTorch's allocator in that
subprocess unless --subprocess-install is given.

Selection: the tests of the allocator-related classes (TestCudaMallocAsync: snapshots, memory
history, memory_viz; TestBlockStateAbsorption: checkpointing of graph pools; TestMemPool), and
of every other class the tests whose "Class.test_name" contains one of DEFAULT_PATTERNS
(case-insensitive), less DEFAULT_EXCLUDES. -k PATTERN (repeatable, several per -k) replaces
both with "contains PATTERN" (fnmatch when it has * ? or [); --all runs every test; --exclude
drops more; --list prints the selection and exits.

Isolation: one subprocess per test class, a batch; each test's result is written to a file as
it ends, and after each test the worker checks that CUDA still works (a sticky CUDA error
would poison the tests after it). When a batch dies (crash, --timeout, poisoned CUDA context)
the tests it did not finish are run again in fresh subprocesses: one per test (--rerun
single), the rest of the batch as a new batch after the failing test alone (--rerun resume),
or single when at most 15 are left and resume otherwise (--rerun auto, the default).

Output: FILE.json (see write_report) and FILE.logs/, each subprocess's stdout and stderr.
Outcomes: pass, fail, error, skip, xfail (expected failure), xpass (unexpected success),
crash (the process died in the test), timeout, not_run (--budget spent, or the listing or
the allocator's install failed).

The worker imports nothing of this file but the standard library before it has installed the
allocator; the parent process never imports torch.
"""
import argparse
import datetime
import fnmatch
import hashlib
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_TEST_FILE = os.path.join(HERE, "test_cuda.py")

# Classes run whole: they exist to test the allocator.
DEFAULT_CLASSES = ["TestCudaMallocAsync", "TestCudaAllocator", "TestBlockStateAbsorption",
                   "TestMemPool"]
# Other classes (TestCuda, TestCudaOptimsCUDA, TestCachingHostAllocatorCudaGraph,
# TestFXMemoryProfiler, TestCudaDeviceParametrizedCUDA, TestCudaMultiGPU, ...): the tests
# whose "Class.test_name" contains one of these.
DEFAULT_PATTERNS = [
    "memory", "memory_stats", "caching_allocator", "cachingallocator", "allocat",
    "snapshot", "memory_viz", "plots", "cycles",
    "graph", "pool", "mempool",
    "oom", "out_of_memory", "fraction",
    "record_stream", "empty_cache", "leak", "checkpoint", "blockstateabsorption",
    "cublas_workspace",
]
# Host (pinned) memory has an allocator of its own that cudamem does not replace.
DEFAULT_EXCLUDES = ["pinned_memory", "host_memory", "cudart_register", "shared_memory"]

# Tests of the shipped test_cuda.py (PyTorch main of early March 2026, some weeks after the
# 2.11 branch cut; see README.md) that assert behaviour PyTorch 2.11's binary does not have:
# per-capture CUDA-graph RNG state and lazy generator registration (pytorch#176752/#176753).
# Expect them to fail under the default allocator as well; compare.py marks them.
POST_211_TESTS = {
    "TestCuda.test_memory_stats_of_multiple_generators_and_graphs":
        "expects 2 RNG tensors per (generator, graph) pair: per-capture RNG state, after 2.11",
    "TestCuda.test_graphsafe_set_get_rng_state":
        "no longer registers generator states with the graph: lazy registration, after 2.11",
    "TestCuda.test_graph_rng_concurrent_captures":
        "concurrent captures with RNG: per-capture RNG state, after 2.11",
    "TestCuda.test_graph_rng_after_failed_capture":
        "added with the per-capture RNG state work; absent from earlier snapshots",
    "TestCuda.test_graph_rng_shared_pool_replay_matches_eager":
        "added with the per-capture RNG state work; absent from earlier snapshots",
}

RESULT_LIMIT = 600  # characters of a failure message kept in the JSON
LOG_TAIL = 2000     # characters of a dead subprocess's output kept in the JSON
EXIT_POISONED = 3   # worker: CUDA no longer works after a test; the rest must run elsewhere
EXIT_SETUP = 4      # worker: installing the allocator or importing the test file failed


# ----------------------------------------------------------------------------------------
# Worker: runs in the subprocess. Imports torch (through cudamem or the test file) only here.
# ----------------------------------------------------------------------------------------

def _stub_module(name, attrs):
    import types
    module = types.ModuleType(name)
    module.__dict__.update(attrs)
    module.__pytorch_suite_stub__ = True
    sys.modules[name] = module
    return module


def _ensure_third_party(shims):
    """Stand-ins for packages test_cuda.py imports that the GPU machine may lack."""
    import unittest
    try:
        import expecttest  # noqa: F401  (common_utils: `class TestCase(expecttest.TestCase)`)
    except ImportError:
        class TestCase(unittest.TestCase):
            def assertExpectedInline(self, *args, **kwargs):
                raise unittest.SkipTest("expecttest is not installed (stand-in module)")
        _stub_module("expecttest", {"TestCase": TestCase, "ACCEPT": False})
        shims.append("expecttest: stand-in module (TestCase = unittest.TestCase, ACCEPT = "
                     "False); assertExpectedInline skips")


def _ensure_psutil(shims):
    """test_cuda.py imports psutil at the top; only TestGDS (always skipped) uses it."""
    try:
        import psutil  # noqa: F401
    except ImportError:
        _stub_module("psutil", {"disk_partitions": lambda *a, **k: []})
        shims.append("psutil: stand-in module (disk_partitions() returns []); only "
                     "TestGDS, skipped in every build without cuFile, uses it")


def _identity_decorator_factory(*args, **kwargs):
    def decorate(fn):
        return fn
    return decorate


def _inject_missing_names(shims):
    """Harmless stand-ins for names newer test_cuda.py files import from
    torch.testing._internal that PyTorch 2.11 lacks. The shipped test_cuda.py needs none
    of them; they let a newer copy be dropped in (--test-file). Each is set only when the
    module lacks the name, and each one set is listed in the JSON."""
    import contextlib
    import unittest
    import torch
    import torch.testing._internal.common_utils as cu
    import torch.testing._internal.common_cuda as cc
    import torch.testing._internal.common_device_type  # noqa: F401  (psutil try-import)

    def test_cudamallocasync():
        return bool(torch.cuda.is_available()) and (
            torch.cuda.get_allocator_backend() == "cudaMallocAsync")

    @contextlib.contextmanager
    def blas_library_context(backend):
        previous = torch.backends.cuda.preferred_blas_library()
        try:
            torch.backends.cuda.preferred_blas_library(backend)
            yield
        finally:
            torch.backends.cuda.preferred_blas_library(previous)

    def requires_cuda_python_bindings(fn):
        return unittest.skipIf(not getattr(cu, "TEST_CUDA_PYTHON_BINDINGS", False),
                               "cuda-bindings must be installed")(fn)

    wanted = [
        (cu, "TEST_CUDAMALLOCASYNC", test_cudamallocasync,
         "computed as test_cuda.py itself does: backend == cudaMallocAsync"),
        (cu, "requires_cuda_python_bindings", lambda: requires_cuda_python_bindings,
         "decorator: skip unless cuda-bindings is importable"),
        (cu, "skipIfRocmVersionAtLeast", lambda: _identity_decorator_factory,
         "decorator factory returning the function unchanged (not ROCm)"),
        (cc, "blas_library_context", lambda: blas_library_context,
         "context manager setting torch.backends.cuda.preferred_blas_library"),
        (cc, "PLATFORM_SUPPORTS_WORKQUEUE_CONFIG", lambda: False, "False"),
        (cc, "xfailCUDAIfSM89OrLaterOnWindows", lambda: _identity_decorator_factory,
         "decorator factory returning the function unchanged (not Windows)"),
    ]
    for module, name, make, what in wanted:
        if not hasattr(module, name):
            setattr(module, name, make())
            shims.append("%s.%s: %s" % (module.__name__, name, what))
    # test_allocator_fuzz reads it on ROCm only (`torch.version.hip and ...`).
    if not hasattr(torch._C, "_accelerator_getAllocatorSettings"):
        torch._C._accelerator_getAllocatorSettings = lambda: ""
        shims.append("torch._C._accelerator_getAllocatorSettings: returns '' (read on ROCm "
                     "only, by test_allocator_fuzz)")


def _install_cudamem(options, info):
    import warnings
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        import cudamem.torch
        cudamem.torch.install(**options)
    info["install_warnings"] = [str(w.message)[:RESULT_LIMIT] for w in caught]
    info["cudamem_mode"] = "full" if getattr(cudamem.torch, "_full", None) is not None \
        else "pluggable"


def _environment(info, module):
    info["python"] = sys.version.split()[0]
    torch = sys.modules.get("torch")
    if torch is None:
        return
    info["torch"] = getattr(torch, "__version__", None)
    info["torch_git"] = getattr(getattr(torch, "version", None), "git_version", None)
    try:
        if torch.cuda.is_available():
            info["device"] = torch.cuda.get_device_name(0)
            info["device_count"] = torch.cuda.device_count()
            info["allocator_backend"] = torch.cuda.get_allocator_backend()
    except Exception as e:  # noqa: BLE001
        info["device_error"] = str(e)[:RESULT_LIMIT]


def _load_module(test_file):
    import importlib.util
    directory = os.path.dirname(os.path.abspath(test_file))
    if directory not in sys.path:
        sys.path.insert(0, directory)
    name = os.path.splitext(os.path.basename(test_file))[0]
    spec = importlib.util.spec_from_file_location(name, test_file)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _list_tests(module):
    import unittest
    loader = unittest.TestLoader()
    ids = []
    for name, obj in sorted(vars(module).items()):
        if (isinstance(obj, type) and issubclass(obj, unittest.TestCase)
                and getattr(obj, "__module__", None) == module.__name__):
            for method in loader.getTestCaseNames(obj):
                ids.append("%s.%s" % (name, method))
    return ids


def _short(text):
    return (text or "")[:RESULT_LIMIT]


def _format_error(err):
    exc_type, exc_value, tb = err
    import traceback as tb_module
    message = "".join(tb_module.format_exception_only(exc_type, exc_value)).strip()
    where = ""
    frames = tb_module.extract_tb(tb) if tb is not None else []
    for frame in reversed(frames):
        if not frame.filename.endswith(("unittest/case.py", "common_utils.py")):
            where = "%s:%d in %s" % (os.path.basename(frame.filename), frame.lineno,
                                     frame.name)
            break
    return _short(message), where


class _Recorder:
    """A unittest result that keeps the worst outcome of one test (subtests included)."""
    RANK = {"pass": 0, "skip": 1, "xfail": 1, "xpass": 3, "fail": 4, "error": 5}

    def __init__(self):
        import unittest
        self.outcome = None
        self.message = ""
        self.where = ""
        recorder = self

        class Result(unittest.TestResult):
            # Each also calls TestResult's own method: PyTorch's TestCase.run() looks at
            # result.errors / result.failures.
            def addSuccess(self, test):
                super().addSuccess(test)
                recorder._set("pass", "")

            def addError(self, test, err):
                super().addError(test, err)
                recorder._set("error", *_format_error(err))

            def addFailure(self, test, err):
                super().addFailure(test, err)
                recorder._set("fail", *_format_error(err))

            def addSkip(self, test, reason):
                super().addSkip(test, reason)
                recorder._set("skip", _short(str(reason)))

            def addExpectedFailure(self, test, err):
                super().addExpectedFailure(test, err)
                recorder._set("xfail", *_format_error(err))

            def addUnexpectedSuccess(self, test):
                super().addUnexpectedSuccess(test)
                recorder._set("xpass", "unexpected success")

            def addSubTest(self, test, subtest, err):
                super().addSubTest(test, subtest, err)
                if err is not None:
                    kind = "fail" if issubclass(err[0], test.failureException) else "error"
                    message, where = _format_error(err)
                    describe = getattr(subtest, "_subDescription", None)
                    label = describe() if describe else str(subtest)
                    recorder._set(kind, _short("%s: %s" % (label, message)), where)

        self.result = Result()

    def _set(self, outcome, message, where=""):
        if self.outcome is None or self.RANK[outcome] > self.RANK[self.outcome]:
            self.outcome, self.message, self.where = outcome, message, where


def _cuda_healthy(module):
    hook = getattr(module, "RUNNER_HEALTH_CHECK", None)  # fake test modules
    if hook is not None:
        return hook()
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    try:
        if not torch.cuda.is_initialized():
            return None
        torch.cuda.synchronize()
        probe = torch.ones(1024, device="cuda")
        value = float(probe.sum().item())
        del probe
        if value != 1024.0:
            return "a probe tensor read back %r, not 1024" % value
        return None
    except Exception as e:  # noqa: BLE001
        return "%s: %s" % (type(e).__name__, e)


def worker_main(args):
    out = open(args.results, "a", buffering=1)

    def emit(record):
        out.write(json.dumps(record) + "\n")
        out.flush()

    info = {"shims": []}
    env_fix = os.environ.pop("NUM_PARALLEL_PROCS", None)
    if env_fix is not None:
        info["removed_env"] = ["NUM_PARALLEL_PROCS"]
    try:
        _ensure_third_party(info["shims"])
        if args.allocator == "cudamem":
            options = dict(item.split("=", 1) for item in (args.cudamem_option or []))
            _install_cudamem(options, info)
            if os.environ.get("PYTORCH_SUITE_SUBPROCESS_INSTALL") == "1":
                os.environ["PYTORCH_SUITE_CUDAMEM_CHILD"] = "1"
                os.environ["PYTORCH_SUITE_CUDAMEM_OPTIONS"] = json.dumps(options)
                info["subprocess_install"] = True
        if _torch_importable():
            _inject_missing_names(info["shims"])
        _ensure_psutil(info["shims"])
        sys.argv = [os.path.abspath(args.test_file)]
        module = _load_module(args.test_file)
        if "torch.testing._internal.common_utils" in sys.modules:
            # What run_tests() does first: GRAPH_EXECUTOR, the seed, expecttest.ACCEPT.
            sys.modules["torch.testing._internal.common_utils"].parse_cmd_line_args()
    except BaseException as e:  # noqa: BLE001
        emit({"event": "setup_failed", "message": _short("%s: %s" % (type(e).__name__, e)),
              "traceback": traceback.format_exc()[-LOG_TAIL:], "info": info})
        traceback.print_exc()
        return EXIT_SETUP
    _environment(info, module)
    emit({"event": "setup", "info": info})

    if args.list:
        emit({"event": "list", "tests": _list_tests(module)})
        return 0

    import unittest
    with open(args.tests) as f:
        tests = json.load(f)
    loader = unittest.TestLoader()
    for test_id in tests:
        emit({"event": "start", "id": test_id, "time": time.time()})
        sys.stdout.write("\n=== %s\n" % test_id)
        sys.stdout.flush()
        started = time.monotonic()
        recorder = _Recorder()
        try:
            suite = loader.loadTestsFromName(test_id, module)
            suite.run(recorder.result)
        except BaseException as e:  # noqa: BLE001
            recorder._set("error", _short("runner: %s: %s" % (type(e).__name__, e)))
        if recorder.outcome is None:
            recorder._set("error", "runner: the test reported no outcome")
        record = {"event": "end", "id": test_id, "outcome": recorder.outcome,
                  "message": recorder.message, "where": recorder.where,
                  "duration_s": round(time.monotonic() - started, 3)}
        poisoned = _cuda_healthy(module)
        if poisoned:
            record["poisoned"] = _short(poisoned)
        emit(record)
        if poisoned:
            return EXIT_POISONED
    return 0


def _torch_importable():
    import importlib.util
    return importlib.util.find_spec("torch") is not None


# ----------------------------------------------------------------------------------------
# Parent: selects, runs the subprocesses, collects, writes the JSON. Never imports torch.
# ----------------------------------------------------------------------------------------

def _matches(test_id, pattern):
    if any(c in pattern for c in "*?["):
        return fnmatch.fnmatchcase(test_id.lower(), pattern.lower())
    return pattern.lower() in test_id.lower()


def select(tests, args):
    excludes = list(args.exclude or [])
    if args.all:
        chosen = list(tests)
    elif args.k:
        patterns = [p for group in args.k for p in group]
        chosen = [t for t in tests if any(_matches(t, p) for p in patterns)]
    else:
        excludes += DEFAULT_EXCLUDES
        chosen = [t for t in tests
                  if t.split(".")[0] in DEFAULT_CLASSES
                  or any(_matches(t, p) for p in DEFAULT_PATTERNS)]
    return [t for t in chosen if not any(_matches(t, p) for p in excludes)]


class Runner:
    def __init__(self, args):
        self.args = args
        self.started = time.monotonic()
        self.logs = os.path.abspath(args.out) + ".logs"
        os.makedirs(self.logs, exist_ok=True)
        self.tmp = tempfile.mkdtemp(prefix="pytorch_suite_")
        self.counter = 0
        self.results = {}
        self.batches = []
        self.info = {}
        self.sitecustomize = self._sitecustomize() if args.subprocess_install else None

    def budget_left(self):
        if not self.args.budget:
            return True
        return time.monotonic() - self.started < self.args.budget

    def seconds_left(self):
        """What is left of --budget, or None without one."""
        if not self.args.budget:
            return None
        return max(1.0, self.args.budget - (time.monotonic() - self.started))

    def _sitecustomize(self):
        """A sitecustomize.py that installs cudamem in the Python subprocesses tests start."""
        directory = os.path.join(self.tmp, "site")
        os.makedirs(directory)
        with open(os.path.join(directory, "sitecustomize.py"), "w") as f:
            f.write(
                "import os\n"
                "if os.environ.get('PYTORCH_SUITE_CUDAMEM_CHILD') == '1':\n"
                "    try:\n"
                "        import json\n"
                "        import cudamem.torch\n"
                "        cudamem.torch.install(**json.loads(\n"
                "            os.environ.get('PYTORCH_SUITE_CUDAMEM_OPTIONS', '{}')))\n"
                "    except Exception as e:\n"
                "        import sys\n"
                "        sys.stderr.write('pytorch_suite sitecustomize: %s\\n' % e)\n")
        return directory

    def _env(self):
        env = dict(os.environ)
        # The workers run in the test file's directory: make relative paths absolute.
        if env.get("PYTHONPATH"):
            env["PYTHONPATH"] = os.pathsep.join(
                os.path.abspath(p) if p else p for p in env["PYTHONPATH"].split(os.pathsep))
        for name in ("CUDAMEM_C_LIBRARY", "CUDAMEM_CACHE_DIR"):
            if env.get(name) and not os.path.isabs(env[name]):
                env[name] = os.path.abspath(env[name])
        env.pop("PYTORCH_TEST_SKIP_CUDAGRAPH", None)
        env.pop("NUM_PARALLEL_PROCS", None)
        env["PYTHONUNBUFFERED"] = "1"
        env.setdefault("PYTORCH_PRINT_REPRO_ON_FAILURE", "0")
        if self.args.leak_check:
            env["PYTORCH_TEST_CUDA_MEM_LEAK_CHECK"] = "1"
        env.pop("PYTORCH_SUITE_CUDAMEM_CHILD", None)
        if self.sitecustomize and self.args.allocator == "cudamem":
            # The worker installs cudamem itself, then sets PYTORCH_SUITE_CUDAMEM_CHILD=1
            # so that the Python processes its tests start install it at startup.
            env["PYTHONPATH"] = os.pathsep.join(
                [self.sitecustomize] + [p for p in [env.get("PYTHONPATH")] if p])
            env["PYTORCH_SUITE_SUBPROCESS_INSTALL"] = "1"
        return env

    def spawn(self, label, tests=None, listing=False, timeout=None):
        """Runs one worker; returns (returncode or 'timeout', [records], log path)."""
        self.counter += 1
        stem = "%03d_%s" % (self.counter, "".join(c if c.isalnum() or c in "._-" else "_"
                                                 for c in label)[:80])
        results = os.path.join(self.tmp, stem + ".jsonl")
        log_path = os.path.join(self.logs, stem + ".log")
        command = [self.args.python, os.path.abspath(__file__), "--worker",
                   "--allocator", self.args.allocator, "--test-file", self.args.test_file,
                   "--results", results]
        for option in self.args.cudamem_option or []:
            command += ["--cudamem-option", option]
        if listing:
            command.append("--list")
        else:
            tests_path = os.path.join(self.tmp, stem + ".tests.json")
            with open(tests_path, "w") as f:
                json.dump(tests, f)
            command += ["--tests", tests_path]
        with open(log_path, "w") as log:
            log.write("$ %s\n" % " ".join(command))
            log.flush()
            process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                       env=self._env(), cwd=os.path.dirname(
                                           os.path.abspath(self.args.test_file)),
                                       start_new_session=True)
            try:
                rc = process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self._kill(process)
                rc = "timeout"
        records = []
        if os.path.exists(results):
            with open(results) as f:
                for line in f:
                    line = line.strip()
                    if line:
                        try:
                            records.append(json.loads(line))
                        except ValueError:
                            pass  # a line cut short by a crash
        return rc, records, log_path

    @staticmethod
    def _kill(process):
        try:
            os.killpg(process.pid, signal.SIGTERM)
            process.wait(timeout=10)
        except (ProcessLookupError, subprocess.TimeoutExpired, PermissionError):
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            process.wait()

    @staticmethod
    def _tail(log_path, limit=LOG_TAIL):
        """The end of a subprocess's output, without the command line written first."""
        try:
            with open(log_path, errors="replace") as f:
                text = f.read()
        except OSError:
            return ""
        if text.startswith("$ "):
            text = text.split("\n", 1)[1] if "\n" in text else ""
        return text.strip()[-limit:]

    def _take_setup(self, records):
        for record in records:
            if record.get("event") == "setup" and not self.info:
                self.info = record.get("info", {})

    def list_tests(self):
        rc, records, log_path = self.spawn("list", listing=True, timeout=self.args.timeout)
        self._take_setup(records)
        for record in records:
            if record.get("event") == "list":
                return record["tests"], None
        failure = next((r for r in records if r.get("event") == "setup_failed"), None)
        why = failure["message"] if failure else "listing exited with %s" % rc
        if failure:
            self.info = failure.get("info", {})
        return None, {"reason": why, "returncode": rc, "log": os.path.relpath(
            log_path, os.path.dirname(os.path.abspath(self.args.out))),
            "log_tail": self._tail(log_path)}

    def run_batch(self, label, tests, mode):
        """Runs tests in one subprocess; returns the ids it did not finish."""
        timeout = self.args.timeout if mode == "batch" else self.args.single_timeout
        # The budget is a wall: a subprocess still running when it is spent is stopped, so
        # that the report is written within it (a machine lent for a fixed time keeps nothing
        # the runner had not written).
        left = self.seconds_left()
        cut_by_budget = left is not None and left < timeout
        if cut_by_budget:
            timeout = left
        began = time.monotonic()
        rc, records, log_path = self.spawn(label, tests=tests, timeout=timeout)
        ended = time.time()
        self._take_setup(records)
        finished, started_last, started_at, poisoned = set(), None, None, None
        for record in records:
            event = record.get("event")
            if event == "start":
                started_last, started_at = record["id"], record.get("time")
            elif event == "end":
                entry = {k: record[k] for k in ("outcome", "message", "where", "duration_s")}
                entry["run"] = mode
                if record.get("poisoned"):
                    entry["poisoned_cuda"] = record["poisoned"]
                    poisoned = record["id"]
                previous = self.results.get(record["id"])
                if previous is not None:
                    entry["first_run"] = {k: previous.get(k) for k in ("outcome", "message")}
                self.results[record["id"]] = entry
                finished.add(record["id"])
        setup_failed = next((r for r in records if r.get("event") == "setup_failed"), None)
        batch = {"name": label, "mode": mode, "tests": len(tests), "finished": len(finished),
                 "returncode": rc, "duration_s": round(time.monotonic() - began, 1),
                 "log": os.path.relpath(log_path, os.path.dirname(
                     os.path.abspath(self.args.out)))}
        remaining = [t for t in tests if t not in finished]
        died = rc != 0 or bool(remaining)
        if died:
            batch["died"] = True
            batch["log_tail"] = self._tail(log_path)
            if setup_failed:
                batch["reason"] = "setup failed: " + setup_failed["message"]
            elif rc == "timeout":
                batch["reason"] = "timeout after %ss" % timeout
            elif rc == EXIT_POISONED:
                batch["reason"] = "CUDA no longer worked after %s" % poisoned
            elif isinstance(rc, int) and rc < 0:
                batch["reason"] = "killed by signal %d" % -rc
            else:
                batch["reason"] = "exit status %s" % rc
            if started_last in remaining:
                batch["died_in"] = started_last
                if started_at is not None:
                    batch["died_in_after_s"] = round(ended - started_at, 1)
        if rc == "timeout" and cut_by_budget:
            batch["reason"] = "stopped: --budget spent"
            self.batches.append(batch)
            for t in remaining:
                self.results[t] = {"outcome": "not_run", "run": mode,
                                   "message": "--budget spent (its subprocess was stopped)"}
            return []
        self.batches.append(batch)
        if (mode == "batch" and rc == "timeout" and batch.get("died_in")
                and batch.get("died_in_after_s", 0) >= self.args.single_timeout):
            # It ran longer than a rerun may: that is its outcome, without a rerun.
            t = batch["died_in"]
            self.results[t] = {"outcome": "timeout", "run": mode,
                               "message": _short("ran %ss when its batch's --timeout ended "
                                                 "it; last output: %s" % (
                                                     batch["died_in_after_s"],
                                                     self._tail(log_path, 400))),
                               "duration_s": batch["died_in_after_s"]}
            remaining.remove(t)
            batch.pop("died_in")
        if setup_failed:
            for t in remaining:
                self.results[t] = {"outcome": "not_run", "run": mode,
                                   "message": _short("setup failed: " +
                                                     setup_failed["message"])}
            return []
        if mode == "single" and remaining:
            # The test killed its own process: that is its outcome.
            for t in remaining:
                outcome = "timeout" if rc == "timeout" else "crash"
                self.results[t] = {"outcome": outcome, "run": mode,
                                   "message": _short("%s; last output: %s" % (
                                       batch["reason"], self._tail(log_path, 400))),
                                   "duration_s": batch["duration_s"]}
            return []
        return remaining

    def run_class(self, name, tests):
        pending = list(tests)
        mode = "batch"
        label = name
        while pending:
            if not self.budget_left():
                for t in pending:
                    self.results[t] = {"outcome": "not_run", "message": "--budget spent"}
                return
            remaining = self.run_batch(label, pending, mode)
            if not remaining:
                return
            rerun = self.args.rerun
            if rerun == "auto":
                rerun = "single" if len(remaining) <= 15 else "resume"
            if rerun == "single":
                for t in remaining:
                    if not self.budget_left():
                        self.results[t] = {"outcome": "not_run", "message": "--budget spent"}
                        continue
                    self.run_batch(t, [t], "single")
                return
            # resume: the test that was running when the batch died runs alone, then the
            # rest of the batch as a new batch.
            died_in = self.batches[-1].get("died_in")
            if died_in in remaining:
                self.run_batch(died_in, [died_in], "single")
                remaining = [t for t in remaining if t != died_in]
            pending = remaining
            label = name + "_resumed"

    def run(self):
        listing, failure = self.list_tests()
        report = {"listing_failed": failure} if failure else {}
        if listing is None:
            return self.write_report([], report)
        chosen = select(listing, self.args)
        if self.args.list:
            for t in chosen:
                print(t)
            print("%d of %d tests selected" % (len(chosen), len(listing)), file=sys.stderr)
            return 0
        order, by_class = [], {}
        for t in chosen:
            cls = t.split(".")[0]
            if cls not in by_class:
                order.append(cls)
                by_class[cls] = []
            by_class[cls].append(t)
        # The classes that exist to test the allocator first: under --budget, what a crash or a
        # slow class elsewhere costs is taken from the others, never from them.
        order.sort(key=lambda c: DEFAULT_CLASSES.index(c) if c in DEFAULT_CLASSES
                   else len(DEFAULT_CLASSES))
        for cls in order:
            print("[%s] %s: %d tests" % (self.args.allocator, cls, len(by_class[cls])),
                  flush=True)
            self.run_class(cls, by_class[cls])
        return self.write_report(chosen, report)

    def write_report(self, chosen, extra):
        counts = {}
        for entry in self.results.values():
            counts[entry["outcome"]] = counts.get(entry["outcome"], 0) + 1
        with open(self.args.test_file, "rb") as f:
            digest = hashlib.sha256(f.read()).hexdigest()
        report = {
            "schema": 1,
            "allocator": self.args.allocator,
            "cudamem_options": self.args.cudamem_option or [],
            "leak_check": bool(self.args.leak_check),
            "subprocess_install": bool(self.args.subprocess_install),
            "test_file": os.path.abspath(self.args.test_file),
            "test_file_sha256": digest,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
            "duration_s": round(time.monotonic() - self.started, 1),
            "host": platform.node(),
            "environment": self.info,
            "selection": {
                "all": bool(self.args.all),
                "k": [p for group in (self.args.k or []) for p in group],
                "exclude": self.args.exclude or [],
                "default_classes": DEFAULT_CLASSES,
                "default_patterns": DEFAULT_PATTERNS,
                "default_excludes": DEFAULT_EXCLUDES,
                "selected": len(chosen),
            },
            "post_2_11_tests": {t: why for t, why in POST_211_TESTS.items() if t in chosen},
            "counts": counts,
            "batches": self.batches,
            "tests": {t: self.results.get(t, {"outcome": "not_run",
                                              "message": "never started"})
                      for t in chosen},
        }
        report.update(extra)
        directory = os.path.dirname(os.path.abspath(self.args.out))
        os.makedirs(directory, exist_ok=True)
        with open(self.args.out, "w") as f:
            json.dump(report, f, indent=1, sort_keys=False)
            f.write("\n")
        summary = ", ".join("%s %d" % kv for kv in sorted(counts.items()))
        print("[%s] %d tests in %.0f s: %s -> %s" % (
            self.args.allocator, len(chosen), report["duration_s"], summary or "nothing",
            self.args.out), flush=True)
        if extra.get("listing_failed"):
            print("listing the tests failed: %s (see %s)" % (
                extra["listing_failed"]["reason"], extra["listing_failed"]["log"]),
                file=sys.stderr)
            return 2
        return 0


def parse_args(argv):
    parser = argparse.ArgumentParser(
        description="Run PyTorch's test_cuda.py allocator tests under one allocator and "
                    "write the outcomes as JSON (see the module docstring).")
    parser.add_argument("--allocator", choices=["default", "cudamem"], required=True,
                        help="default: PyTorch's caching allocator; cudamem: "
                             "cudamem.torch.install() before test_cuda.py is imported")
    parser.add_argument("--out", help="the JSON to write (required unless --list)")
    parser.add_argument("-k", action="append", nargs="+", metavar="PATTERN",
                        help="run the tests whose Class.test_name contains PATTERN "
                             "(case-insensitive; fnmatch with * ? [); replaces the "
                             "default selection; repeatable")
    parser.add_argument("--all", action="store_true", help="every test of the file")
    parser.add_argument("--exclude", action="append", metavar="PATTERN",
                        help="drop the tests matching PATTERN (after the selection)")
    parser.add_argument("--list", action="store_true",
                        help="print the selected tests and exit (imports the test file in "
                             "a subprocess, so it needs torch and a GPU)")
    parser.add_argument("--timeout", type=float, default=300,
                        help="seconds a subprocess (a class's batch, or the listing) may "
                             "run (default 300)")
    parser.add_argument("--single-timeout", type=float, default=120,
                        help="seconds a rerun of one test may run (default 120)")
    parser.add_argument("--rerun", choices=["auto", "single", "resume"], default="auto",
                        help="after a batch died: rerun each unfinished test in its own "
                             "subprocess (single), or the test it died in alone and the "
                             "rest as a new batch (resume); auto: single for at most 15 "
                             "left, else resume (default)")
    parser.add_argument("--budget", type=float, default=0,
                        help="seconds for the whole run; no subprocess starts after it, one "
                             "still running then is stopped, and the tests left are not_run "
                             "(default 0: no limit)")
    parser.add_argument("--test-file", default=DEFAULT_TEST_FILE,
                        help="the unittest file (default: test_cuda.py beside this script; "
                             "test_cuda_multigpu.py works too)")
    parser.add_argument("--python", default=sys.executable,
                        help="the interpreter for the subprocesses (default: this one)")
    parser.add_argument("--cudamem-option", action="append", metavar="KEY=VALUE",
                        help="passed to cudamem.torch.install() as a string keyword "
                             "argument (e.g. limit_bytes=60GiB); repeatable")
    parser.add_argument("--leak-check", action="store_true",
                        help="PYTORCH_TEST_CUDA_MEM_LEAK_CHECK=1: wrap the tests of classes "
                             "that ask for it (TestCuda) in PyTorch's CUDA memory leak check")
    parser.add_argument("--subprocess-install", action="store_true",
                        help="with --allocator cudamem: also install cudamem in the Python "
                             "subprocesses tests start (a sitecustomize.py on PYTHONPATH)")
    # Internal: the subprocess side.
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--results", help=argparse.SUPPRESS)
    parser.add_argument("--tests", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if not args.worker and not args.list and not args.out:
        parser.error("--out is required (unless --list)")
    args.test_file = os.path.abspath(args.test_file)
    if not os.path.exists(args.test_file):
        parser.error("no test file at %s" % args.test_file)
    return args


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.worker:
        return worker_main(args)
    scratch = None
    if args.list and not args.out:
        scratch = tempfile.mkdtemp(prefix="pytorch_suite_list_")
        args.out = os.path.join(scratch, "list.json")
    runner = Runner(args)
    try:
        return runner.run()
    finally:
        shutil.rmtree(runner.tmp, ignore_errors=True)
        if scratch:
            shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
