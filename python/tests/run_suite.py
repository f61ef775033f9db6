"""What ctest runs for the Python package (registered in capi/tests/CMakeLists.txt):

    run_suite.py host  --library LIB   the ctypes layer over simulated devices (no GPU)
    run_suite.py gpu   --library LIB   PyTorch and CuPy on the GPU
    run_suite.py wheel --work DIR      `pip wheel ./python`, installed into DIR, then tested

Prints "SKIPPED: <why>" and exits 0 when what a suite needs is missing (pytest; PyTorch or
CuPy and a GPU; pip), which ctest reports as skipped, never as passed.
"""
import argparse
import os
import shutil
import subprocess
import sys

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
              "import cupy; print(cupy.cuda.runtime.getDeviceCount())"]
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
        return pytest(["test_native.py"], env)
    if args.suite == "gpu":
        if not importable("torch") and not importable("cupy"):
            skip("neither PyTorch nor CuPy is installed for %s" % sys.executable)
        if gpu_count() == 0:
            skip("no CUDA device")
        return pytest(["test_torch.py", "test_torch_compat.py", "test_cupy.py"], env)
    # wheel: what `pip install ./python` does, into a directory of its own.
    if not importable("pip"):
        skip("pip is not installed for %s" % sys.executable)
    shutil.rmtree(args.work, ignore_errors=True)
    wheels, target = os.path.join(args.work, "wheels"), os.path.join(args.work, "site")
    build = [sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", wheels, PACKAGE_ROOT]
    if importable("scikit_build_core"):
        build.insert(4, "--no-build-isolation")  # offline machines: use what is installed
    print("+", " ".join(build), flush=True)
    if subprocess.run(build).returncode != 0:
        return 1
    wheel = [os.path.join(wheels, f) for f in os.listdir(wheels) if f.endswith(".whl")]
    install = [sys.executable, "-m", "pip", "install", "--no-deps", "--target", target] + wheel
    print("+", " ".join(install), flush=True)
    if subprocess.run(install).returncode != 0:
        return 1
    env.pop("CUDAMEM_C_LIBRARY", None)
    env["PYTHONPATH"] = target
    return pytest([os.path.join(TESTS, "test_native.py")], env)


if __name__ == "__main__":
    sys.exit(main())
