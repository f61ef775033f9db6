"""What ctest runs for the Python package (registered in capi/tests/CMakeLists.txt):

    run_suite.py host  --library LIB   the ctypes layer over simulated devices (no GPU), the
                                       build backend's checks, cudamem.torch.install()'s
                                       choices and refusals over a stand-in torch, the
                                       per-release check's parts, cudamem.numba's GPU-free
                                       tests (bad input; the plugin over a simulated device)
    run_suite.py gpu   --library LIB   PyTorch, CuPy and Numba on the GPU; the examples and the
                                       README's snippet against the installed wheel
    run_suite.py wheel --work DIR      `pip wheel ./python` (and its one-sentence errors for a
                                       missing GSL or CUDA Toolkit), installed into a fresh
                                       virtual environment in DIR with no compiler and no GSL
                                       on its paths, imported from there, its host tests run

Prints "SKIPPED: <why>" and exits 0 when what a suite needs is missing (pytest; PyTorch,
CuPy or numba-cuda, and a GPU; pip, venv, scikit-build-core), which ctest reports as skipped,
never as passed.
"""
import argparse
import os
import shutil
import site
import subprocess
import sys
import zipfile

PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.join(PACKAGE_ROOT, "tests")


def skip(why):
    print("SKIPPED: " + why)
    sys.exit(0)


def importable(name):
    return subprocess.run([sys.executable, "-c", "import " + name],
                          capture_output=True).returncode == 0


def gpu_count():
    probes = ["import torch; print(torch.cuda.device_count())",
              "import cupy; print(cupy.cuda.runtime.getDeviceCount())",
              "import numba.cuda as c; print(len(c.gpus) if c.is_available() else 0)"]
    for probe in probes:
        done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
        if done.returncode == 0 and done.stdout.strip().isdigit():
            return int(done.stdout.strip())
    return 0


def pytest(files, env):
    command = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider"] + files
    print("+", " ".join(command), flush=True)
    return subprocess.run(command, env=env, cwd=TESTS).returncode


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("suite", choices=["host", "gpu", "wheel"])
    parser.add_argument("--library")
    parser.add_argument("--work")
    args = parser.parse_args()
    if not importable("pytest"):
        skip("pytest is not installed for %s (python3 -m pip install pytest)" % sys.executable)
    env = dict(os.environ)
    if args.suite in ("host", "gpu"):
        env["CUDAMEM_C_LIBRARY"] = args.library
        env["PYTHONPATH"] = PACKAGE_ROOT + os.pathsep + env.get("PYTHONPATH", "")
        env["CUDAMEM_CACHE_DIR"] = env.get("CUDAMEM_CACHE_DIR") or os.path.join(
            os.path.dirname(args.library), "python-cache")
    if args.suite == "host":
        # (test_examples.py's programs need a GPU: the gpu suite runs them; here, only the check
        # that every example is covered.)
        return pytest(["test_native.py", "test_build_backend.py", "test_bench_placement.py",
                       "test_bench_compile_time.py",
                       "test_torch_settings.py", "test_torch_releases.py",
                       "test_examples.py::test_every_example_is_covered", "test_numba_host.py"],
                      env)
    if args.suite == "gpu":
        if not any(importable(m) for m in ("torch", "cupy", "numba.cuda")):
            skip("none of PyTorch, CuPy and numba-cuda is installed for %s" % sys.executable)
        if gpu_count() == 0:
            skip("no CUDA device")
        return pytest(["test_torch.py", "test_torch_compat.py", "test_cupy.py", "test_numba.py",
                       "test_examples.py"], env)
    return wheel_suite(args.work, env)


# --- the wheel -------------------------------------------------------------------------------

# Said by the build when a prerequisite is missing (python/cmake/prerequisites.cmake), one
# sentence each, and what must never be shown instead.
MISSING = {
    "Microsoft.GSL": ["cudamem: Microsoft GSL was not found", "libmsgsl-dev", "Conan or vcpkg",
                      "CMAKE_PREFIX_PATH"],
    "CUDAToolkit": ["cudamem: the CUDA Toolkit (12.5 or newer, with nvcc) was not found",
                    "CUDAToolkit_ROOT"],
}
NEVER_SHOWN = ["CMake Error", "Call Stack", "Could not find a package configuration file",
               "Traceback", "find_package"]


def run(command, **kwargs):
    print("+", " ".join(command), flush=True)
    return subprocess.run(command, **kwargs)


def pip_wheel(out_dir, env):
    """`pip wheel ./python` into out_dir; the finished process (output captured)."""
    command = [sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", out_dir, PACKAGE_ROOT]
    if importable("scikit_build_core"):
        command.insert(4, "--no-build-isolation")  # offline machines: use what is installed
    return run(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def check_missing_prerequisites(work, env):
    """Bad input: the build on a machine without GSL, then without a CUDA Toolkit (CMake told
    not to find it), stops with one sentence saying what to install, and no CMake output."""
    failures = []
    for package, expected in MISSING.items():
        bare = dict(env)
        bare["SKBUILD_CMAKE_DEFINE"] = "CMAKE_DISABLE_FIND_PACKAGE_%s=TRUE" % package
        done = pip_wheel(os.path.join(work, "missing-" + package), bare)
        shown = [line.strip() for line in done.stdout.splitlines()
                 if line.strip().startswith("cudamem:")]
        problems = []
        if done.returncode == 0:
            problems.append("the build succeeded")
        if len(shown) != 1:
            problems.append("%d lines say cudamem: ..., not one" % len(shown))
        problems += ["it does not say %r" % e for e in expected if e not in done.stdout]
        problems += ["it shows %r" % n for n in NEVER_SHOWN if n in done.stdout]
        if problems:
            failures.append("without %s: %s\n%s" % (package, "; ".join(problems), done.stdout))
        else:
            print("without %s the build says, alone:\n  %s" % (package, shown[0]), flush=True)
    return failures


# What the PyTorch allocator is compiled from at the first install() (cudamem/_torch_build.py):
# the only sources a wheel holds. No header of cudamem's C++ library or of GSL.
TORCH_ALLOCATOR_SOURCES = {
    "cudamem/_torch/torch_allocator.cpp", "cudamem/_torch/torch_interface.hpp",
    "cudamem/_torch/chunk_sources.hpp", "cudamem/_torch/allocator_class.hpp",
    "cudamem/_torch/allocator_malloc.hpp", "cudamem/_torch/allocator_frees.hpp",
    "cudamem/_torch/allocator_stats.hpp", "cudamem/_torch/allocator_pools.hpp",
    "cudamem/_torch/allocator_history.hpp", "cudamem/_torch/allocator_snapshot.hpp",
    "cudamem/_torch/allocator_ipc.hpp", "cudamem/_torch/capture_order.hpp",
    "cudamem/_torch/graph_pool.hpp", "cudamem/_torch/snapshot_layout.hpp",
    "cudamem/_torch/stats.hpp", "cudamem/_torch/trace_ring.hpp",
    "cudamem/_torch/call_timer.hpp", "cudamem/include/cudamem_c.h"}


def check_wheel_contents(wheel):
    """The wheel holds the package, libcudamem_c and the PyTorch allocator's sources, and no
    other header (cudamem's or GSL's)."""
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
    failures = []
    for required in ["cudamem/__init__.py", "cudamem/_native.py", "cudamem/libcudamem_c.so",
                     "cudamem/_torch_build.py"] + sorted(TORCH_ALLOCATOR_SOURCES):
        if required not in names:
            failures.append("the wheel lacks %s (it has %s)" % (required, names))
    headers = [n for n in names
               if n.endswith((".h", ".hpp")) and n not in TORCH_ALLOCATOR_SOURCES]
    if headers:
        failures.append("the wheel holds headers: %s" % headers)
    return failures


def make_venv(venv):
    """A fresh virtual environment (no pip) that sees this interpreter's packages (pytest,
    PyTorch, CuPy, Numba) but nothing of this checkout. `--system-site-packages` gives the
    *base* interpreter's packages only: when this interpreter is itself a virtual environment
    (PyTorch often lives in one), its site-packages are added after the new environment's own by
    a .pth file, so that what is installed into the new environment comes first. They are added
    as site directories, their own .pth files read: numba-cuda takes over numba.cuda by one."""
    done = run([sys.executable, "-m", "venv", "--without-pip", "--system-site-packages", venv])
    if done.returncode != 0 or sys.prefix == sys.base_prefix:
        return done
    python = os.path.join(venv, "bin", "python")
    purelib = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                             stdout=subprocess.PIPE, text=True, check=True).stdout.strip()
    parents = [p for p in site.getsitepackages() if os.path.isdir(p)]
    with open(os.path.join(purelib, "_cudamem_test_parent_env.pth"), "w") as pth:
        pth.write("".join("import site; site.addsitedir(%r)\n" % p for p in parents))
    return done


def install_wheel(python, wheel, env):
    """Installs `wheel` into the virtual environment of `python`, from the file, offline. Even
    when the interpreter it sees (--system-site-packages) has cudamem installed, of the same
    version: --ignore-installed puts the wheel under test in the environment, whose
    site-packages come first on sys.path, instead of pip's "already installed"."""
    return run([python, "-m", "pip", "install", "--no-deps", "--no-index", "--ignore-installed",
                wheel], env=env)


def bare_environment(venv, home):
    """What the installed package runs with: the venv's bin/ and nothing else on PATH (no
    compiler, no nvcc, no CMake), no include or CMake search paths (no GSL), no library of a
    checkout. The CUDA runtime libcudamem_c needs is found where _native looks for it."""
    env = {"PATH": os.path.join(venv, "bin"), "HOME": home, "LANG": "C.UTF-8",
           "PYTHONNOUSERSITE": "1"}
    for keep in ("CUDA_HOME", "CUDA_PATH", "TMPDIR"):
        if keep in os.environ:
            env[keep] = os.environ[keep]
    return env


def wheel_suite(work, env):
    """`pip wheel ./python` once, installed into a fresh virtual environment that has no
    compiler, toolkit or GSL on its paths; the package imported from there and its host tests
    run. First, the build's one-sentence errors for a missing GSL and CUDA Toolkit."""
    if not importable("pip") or not importable("venv"):
        skip("pip or venv is not available for %s" % sys.executable)
    if not importable("scikit_build_core"):
        probe = run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d",
                     os.path.join(work, "probe"), "scikit-build-core"],
                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if probe.returncode != 0:
            skip("scikit-build-core is neither installed nor downloadable here "
                 "(python3 -m pip install scikit-build-core)")
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    env = dict(env)
    env.pop("CUDAMEM_C_LIBRARY", None)
    failures = check_missing_prerequisites(work, env)

    wheels = os.path.join(work, "wheels")
    done = pip_wheel(wheels, env)
    print(done.stdout[-4000:], flush=True)
    if done.returncode != 0:
        return 1
    built = [os.path.join(wheels, f) for f in os.listdir(wheels) if f.endswith(".whl")]
    if len(built) != 1:
        print("FAILED: expected one wheel, found %s" % built)
        return 1
    failures += check_wheel_contents(built[0])

    # A fresh environment: the interpreter's own packages are seen (pytest, to run the tests),
    # nothing of this checkout is; the wheel is installed from the file, offline.
    venv = os.path.join(work, "venv")
    if make_venv(venv).returncode != 0:
        return 1
    python = os.path.join(venv, "bin", "python")
    home = os.path.join(work, "home")
    os.makedirs(home)
    bare = bare_environment(venv, home)
    if install_wheel(python, built[0], bare).returncode != 0:
        return 1
    tools = [t for t in ("cc", "gcc", "g++", "c++", "nvcc", "cmake")
             if shutil.which(t, path=bare["PATH"])]
    if tools:
        failures.append("the bare environment finds %s" % tools)
    where = run([python, "-c", "import cudamem, cudamem._native as n; "
                 "print(cudamem.__file__); print(n.library_path()); print(n.version())"],
                env=bare, cwd=home, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    print(where.stdout, flush=True)
    lines = where.stdout.split()
    if where.returncode != 0 or len(lines) != 3:
        failures.append("the installed package does not import and load its library")
    elif not all(os.path.realpath(p).startswith(os.path.realpath(venv)) for p in lines[:2]):
        failures.append("the package or its library does not come from the environment: %s"
                        % lines[:2])
    tests = run([python, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
                 os.path.join(TESTS, "test_native.py")], env=bare, cwd=home).returncode
    if tests != 0:
        failures.append("the host tests failed in the installed environment")
    for failure in failures:
        print("FAILED: " + failure)
    if not failures:
        print("the wheel %s installs and runs where nothing can build it"
              % os.path.basename(built[0]))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
