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


HAS_TORCH = _has_module("torch")
HAS_CUPY = _has_module("cupy")
CUDA_DEVICES = _cuda_devices() if HAS_TORCH else 0

needs_torch_gpu = pytest.mark.skipif(
    not HAS_TORCH or CUDA_DEVICES == 0,
    reason="needs PyTorch and a CUDA device (%s)" % ("no torch" if not HAS_TORCH else
                                                     "no CUDA device"))
needs_cupy_gpu = pytest.mark.skipif(not HAS_CUPY or CUDA_DEVICES == 0,
                                    reason="needs CuPy and a CUDA device")


def run_python(code, env=None, expect_rc=0, timeout=300):
    """Runs `code` in a fresh interpreter with this package importable; returns its stdout."""
    child_env = dict(os.environ)
    child_env["PYTHONPATH"] = PACKAGE_ROOT + os.pathsep + child_env.get("PYTHONPATH", "")
    child_env["PYTHONUNBUFFERED"] = "1"
    child_env.update(env or {})
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, env=child_env, timeout=timeout)
    if done.returncode != expect_rc:
        raise AssertionError("child exited %d (expected %d)\n--- stdout\n%s\n--- stderr\n%s"
                             % (done.returncode, expect_rc, done.stdout, done.stderr))
    return done.stdout + done.stderr if expect_rc != 0 else done.stdout
