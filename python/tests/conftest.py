"""Shared helpers: where the package and its library are, and how a scenario runs in a fresh
process (PyTorch's allocator can be chosen once per process, so each scenario gets its own)."""
import os
import subprocess
import sys
import textwrap

import pytest

PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _has_module(name):
    try:
        __import__(name)
        return True
    except Exception:  # noqa: BLE001
        return False


def _cuda_devices():
    """CUDA devices as PyTorch sees them, asked in a child (importing torch here would make
    this test process's CUDA state part of every test)."""
    if not _has_module("torch"):
        return 0
    done = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.device_count())"],
                          capture_output=True, text=True)
    return int(done.stdout.strip() or 0) if done.returncode == 0 else 0


def _numba_cuda():
    """(whether numba-cuda is importable, CUDA devices as Numba sees them), asked in a child
    (Numba binds its memory manager when it makes a context: none is made in this process)."""
    probe = ("import numba.cuda as c\n"
             "print(c.implementation, len(c.gpus) if c.is_available() else 0)")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    words = done.stdout.split()
    if done.returncode != 0 or len(words) != 2 or words[0] != "NVIDIA":
        return False, 0
    return True, int(words[1])


HAS_TORCH = _has_module("torch")
HAS_CUPY = _has_module("cupy")
CUDA_DEVICES = _cuda_devices() if HAS_TORCH else 0

needs_torch_gpu = pytest.mark.skipif(
    not HAS_TORCH or CUDA_DEVICES == 0,
    reason="needs PyTorch and a CUDA device (%s)" % ("no torch" if not HAS_TORCH else
                                                     "no CUDA device"))
needs_cupy_gpu = pytest.mark.skipif(not HAS_CUPY or CUDA_DEVICES == 0,
                                    reason="needs CuPy and a CUDA device")
HAS_NUMBA_CUDA, NUMBA_DEVICES = _numba_cuda()
needs_numba = pytest.mark.skipif(not HAS_NUMBA_CUDA,
                                 reason="needs numba-cuda (pip install numba-cuda)")
needs_numba_gpu = pytest.mark.skipif(
    not HAS_NUMBA_CUDA or NUMBA_DEVICES == 0,
    reason="needs numba-cuda and a CUDA device (%s)" % ("no numba-cuda" if not HAS_NUMBA_CUDA
                                                        else "no CUDA device"))


def _numpy_compat():
    """The directory of numpy_compat/sitecustomize.py when numba-cuda needs it with this NumPy
    (see that file), else None. Said once, on stderr, when it is used."""
    if not HAS_NUMBA_CUDA:
        return None
    probe = "import numpy; print(hasattr(numpy, 'row_stack'))"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    if done.stdout.strip() != "False":
        return None
    print("conftest: numba-cuda reads numpy.row_stack, which this NumPy removed: the tests' "
          "child processes run with python/tests/numpy_compat on PYTHONPATH, which restores it",
          file=sys.stderr)
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "numpy_compat")


NUMPY_COMPAT = _numpy_compat()


def start_python(code, env=None):
    """Starts `code` in a fresh interpreter with this package importable; finish_python waits."""
    child_env = dict(os.environ)
    child_env["PYTHONPATH"] = PACKAGE_ROOT + os.pathsep + child_env.get("PYTHONPATH", "")
    if NUMPY_COMPAT:
        child_env["PYTHONPATH"] = NUMPY_COMPAT + os.pathsep + child_env["PYTHONPATH"]
    child_env["PYTHONUNBUFFERED"] = "1"
    child_env.update(env or {})
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=child_env)


def finish_python(child, expect_rc=0, timeout=300):
    """Waits for a child of start_python; its stdout (with stderr when a failure is expected).
    A child past `timeout` is killed and the test fails with what it printed."""
    try:
        out, err = child.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        child.kill()
        out, err = child.communicate()
        raise AssertionError("child ran past %d s\n--- stdout\n%s\n--- stderr\n%s"
                             % (timeout, out, err))
    if child.returncode != expect_rc:
        raise AssertionError("child exited %d (expected %d)\n--- stdout\n%s\n--- stderr\n%s"
                             % (child.returncode, expect_rc, out, err))
    return out + err if expect_rc != 0 else out


def run_python(code, env=None, expect_rc=0, timeout=300):
    """Runs `code` in a fresh interpreter with this package importable; returns its stdout."""
    return finish_python(start_python(code, env), expect_rc, timeout)
