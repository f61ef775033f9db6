"""The Python examples (examples/python/*.py) and the README's Python snippet, run as their
documentation says: `pip install ./python` (here: the wheel `pip wheel ./python` builds,
installed into a fresh virtual environment that sees this interpreter's PyTorch, CuPy and
Numba), then `python3 examples/python/<name>.py` from the checkout's root, with nothing of the
checkout on the path. Those are skipped (never passed) without what they use (PyTorch; CuPy and
numba-cuda for three_libraries.py) or a CUDA device; the check that every example is covered
and uses the installed package runs anywhere."""
import glob
import os
import re
import subprocess

import pytest

from conftest import (CUDA_DEVICES, HAS_CUPY, HAS_NUMBA_CUDA, HAS_TORCH, NUMBA_DEVICES,
                      NUMPY_COMPAT, needs_torch_gpu)

import run_suite

REPO_ROOT = os.path.dirname(run_suite.PACKAGE_ROOT)
EXAMPLES = sorted(glob.glob(os.path.join(REPO_ROOT, "examples", "python", "*.py")))
TIMEOUT = 900  # seconds per program: fragmenting_loop fills the device twice


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """The Python of a fresh virtual environment with the package installed from its wheel,
    and the environment to run it in (no PYTHONPATH, no CUDAMEM_C_LIBRARY)."""
    work = str(tmp_path_factory.mktemp("installed"))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "CUDAMEM_C_LIBRARY")}
    done = run_suite.pip_wheel(os.path.join(work, "wheels"), env)
    assert done.returncode == 0, "pip wheel ./python failed:\n" + done.stdout
    wheels = glob.glob(os.path.join(work, "wheels", "*.whl"))
    assert len(wheels) == 1, wheels
    venv = os.path.join(work, "venv")
    assert run_suite.make_venv(venv).returncode == 0
    python = os.path.join(venv, "bin", "python")
    assert run_suite.install_wheel(python, wheels[0], env).returncode == 0
    where = subprocess.run([python, "-c", "import cudamem._native as n; print(n.__file__)"],
                           env=env, cwd=REPO_ROOT, capture_output=True, text=True, check=True)
    assert os.path.realpath(where.stdout.strip()).startswith(os.path.realpath(venv))
    if NUMPY_COMPAT:  # numba-cuda's incompatibility with this NumPy (conftest.py says so)
        env = dict(env, PYTHONPATH=NUMPY_COMPAT)
    return python, env


def run_program(installed, path):
    """Runs `python3 <path>` from the checkout's root as the docstrings say; its output."""
    python, env = installed
    done = subprocess.run([python, os.path.relpath(path, REPO_ROOT)], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=TIMEOUT)
    output = done.stdout + done.stderr
    assert done.returncode == 0, "%s exited %d:\n%s" % (path, done.returncode, output)
    return output


def test_every_example_is_covered():
    """Runs anywhere: each example is checked below, documented as it is run there, and uses
    the installed package (the examples used to put the checkout's python/ first)."""
    names = sorted(os.path.basename(p) for p in EXAMPLES)
    assert names == ["explain_oom.py", "fragmenting_loop.py", "three_libraries.py"], (
        "a new example needs its checks in test_examples.py: %s" % names)
    for path in EXAMPLES:
        with open(path) as f:
            text = f.read()
        assert "python3 examples/python/%s" % os.path.basename(path) in text  # as documented
        assert "sys.path" not in text and "PYTHONPATH" not in text  # the installed package


@pytest.mark.gpu
@needs_torch_gpu
def test_explain_oom(installed):
    out = run_program(installed, os.path.join(REPO_ROOT, "examples", "python", "explain_oom.py"))
    holder = re.search(r"another process \(pid (\d+)\) holds 4 GiB", out)
    assert holder, out
    assert re.search(r"torch\.OutOfMemoryError after \d+ tensors of 2 GiB", out), out
    report = out.split("OutOfMemoryError after", 1)[1]
    assert "could not allocate 2.00 GiB" in report, out
    assert "Verdict:" in report, out
    if "Other processes: " in report:  # NVML listed them: the holder is named
        assert "pid %s" % holder.group(1) in report, out
    else:  # NVML could not (a container, no permission): the report says why, plainly
        assert "hold the device's memory is not known" in report or "cannot name" in report, out


@pytest.mark.gpu
@needs_torch_gpu
def test_fragmenting_loop(installed):
    out = run_program(installed,
                      os.path.join(REPO_ROOT, "examples", "python", "fragmenting_loop.py"))
    ran = dict(re.findall(r"(PyTorch's allocator|cudamem\.torch\.install\(\)):\s+ran\s+(\d+)",
                          out))
    assert set(ran) == {"PyTorch's allocator", "cudamem.torch.install()"}, out
    assert all(int(n) > 0 for n in ran.values()), out
    assert re.search(r"cudamem holds [\d.]+ GiB, [\d.]+ GiB in use", out), out


@pytest.mark.gpu
@pytest.mark.skipif(not (HAS_TORCH and HAS_CUPY and HAS_NUMBA_CUDA)
                    or min(CUDA_DEVICES, NUMBA_DEVICES) == 0,
                    reason="needs PyTorch, CuPy, numba-cuda and a CUDA device")
def test_three_libraries(installed):
    out = run_program(installed,
                      os.path.join(REPO_ROOT, "examples", "python", "three_libraries.py"))
    held = dict(re.findall(r"(PyTorch|CuPy|Numba) +holds +([\d.]+) MiB", out))
    assert held == {"PyTorch": "64.0", "CuPy": "32.0", "Numba": "16.0"}, out
    assert "its weights are 2.0" in out and "its scratch is 6.0" in out, out  # the kernel ran
    in_use = [float(m) for m in re.findall(r"([\d.]+) MiB in use by all three", out)]
    assert len(in_use) == 2 and in_use[0] >= 112 and in_use[1] >= 112 + 4096, out
    assert "took the memory PyTorch freed: yes" in out, out


def readme_python_snippet():
    """The first ```python block of the README's "From PyTorch, CuPy and Numba" section."""
    with open(os.path.join(REPO_ROOT, "README.md")) as f:
        readme = f.read()
    section = readme[readme.index("## From PyTorch, CuPy and Numba"):]
    return re.search(r"\n```python\n(.*?)\n```\n", section, re.S).group(1)


@pytest.mark.gpu
@needs_torch_gpu
def test_the_readme_python_snippet(installed, tmp_path):
    snippet = readme_python_snippet()
    placeholder = "# ... the program, unchanged ..."
    assert placeholder in snippet, snippet
    assert "cudamem.torch.install()" in snippet and "cudamem.torch.report()" in snippet
    program = snippet.replace(placeholder, "x = torch.ones(1 << 22, device='cuda')  # 16 MiB\n"
                                           "torch.cuda.synchronize()")
    path = tmp_path / "readme_snippet.py"
    path.write_text(program + "\nprint('in use', cudamem.torch.stats()['in_use_bytes'])\n")
    out = run_program(installed, str(path))
    in_use = re.search(r"in use (\d+)", out)
    assert in_use and int(in_use.group(1)) >= 16 << 20, out
    assert "'in_use_bytes':" in out and "'reserved_bytes':" in out, out  # print(stats())
    assert "vm_pool_resource" in out, out  # print(report()): the chain that holds the tensor
