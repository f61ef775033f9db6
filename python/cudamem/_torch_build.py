"""Builds cudamem's PyTorch allocator (cudamem/_torch/torch_allocator.cpp) against the
installed PyTorch's headers: at `pip install` when PyTorch is importable there (the package's
CMake runs this file as a script), otherwise at the first cudamem.torch.install(), once per
PyTorch version, cached in $CUDAMEM_CACHE_DIR or ~/.cache/cudamem.

    python3 cudamem/_torch_build.py build DIR     # what pip install runs: the library into DIR

Why compile against PyTorch: the allocator is a C++ subclass of PyTorch's CUDAAllocator; its
layout (virtual functions, the structs of snapshots and statistics) belongs to one PyTorch
version. The key of a build names that version, where it is installed, its C++ ABI and the
sources, so a library is never loaded into a PyTorch it was not built for.

Needs a C++17 compiler (choose_compiler: $CUDAMEM_CXX, else the system's c++) and the CUDA
runtime's headers ($CUDA_HOME, the
toolkit in /usr/local/cuda, or the nvidia-cuda-runtime wheel PyTorch installs).
"""
import glob
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCE_DIR = os.path.join(HERE, "_torch")
# Every file the allocator is compiled from (the build's key hashes them; the wheel holds them):
# the translation unit, its parts over PyTorch, and the PyTorch-free parts.
SOURCES = ["torch_allocator.cpp", "torch_interface.hpp", "chunk_sources.hpp",
           "allocator_class.hpp", "allocator_malloc.hpp", "allocator_frees.hpp",
           "allocator_stats.hpp", "allocator_pools.hpp", "allocator_history.hpp",
           "allocator_snapshot.hpp", "allocator_ipc.hpp", "capture_order.hpp", "graph_pool.hpp",
           "snapshot_layout.hpp", "stats.hpp", "trace_ring.hpp"]
SECONDS = 10  # what a build takes, about (4-6 s measured on 2 cores), said before it starts


class BuildError(RuntimeError):
    """The allocator could not be built; the message says what is missing."""


def c_header_dir():
    """Where cudamem_c.h is: inside an installed package, or in the checkout's capi/."""
    for d in (os.path.join(HERE, "include"),
              os.path.join(os.path.dirname(os.path.dirname(HERE)), "capi", "include")):
        if os.path.isfile(os.path.join(d, "cudamem_c.h")):
            return d
    raise BuildError("cudamem_c.h is neither in %s/include nor in a cudamem checkout" % HERE)


def cuda_include_dir():
    """A directory with cuda_runtime_api.h, for PyTorch's CUDA headers."""
    candidates = []
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            candidates.append(os.path.join(os.environ[var], "include"))
    nvcc = shutil.which("nvcc")
    if nvcc:
        candidates.append(os.path.join(os.path.dirname(os.path.dirname(nvcc)), "include"))
    candidates.append("/usr/local/cuda/include")
    for root in sys.path:
        for sub in ("nvidia/cu13/include", "nvidia/cu12/include", "nvidia/cuda_runtime/include"):
            candidates.append(os.path.join(root, sub))
    for d in candidates:
        if os.path.isfile(os.path.join(d, "cuda_runtime_api.h")):
            return d
    raise BuildError("the CUDA runtime's headers (cuda_runtime_api.h) were not found: set "
                     "CUDA_HOME to the CUDA Toolkit, or install it in /usr/local/cuda")


def _links_libstdcxx_dynamically(compiler):
    """Whether `compiler` links libstdc++ as a shared library. One that links it statically
    (a GCC built with --disable-shared, seen as $CXX on a GPU machine) puts a second copy of
    libstdc++'s locale code beside the one PyTorch's process loaded: formatting a number in
    the allocator then crashed."""
    try:
        done = subprocess.run([compiler, "-print-file-name=libstdc++.so"], capture_output=True,
                              text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return False
    path = done.stdout.strip()
    return done.returncode == 0 and os.path.isabs(path) and os.path.exists(path)


def choose_compiler():
    """$CUDAMEM_CXX if set; else the system's c++ or g++, else $CXX or clang++: the first that
    links libstdc++ as a shared library, as PyTorch itself does."""
    if os.environ.get("CUDAMEM_CXX"):
        return os.environ["CUDAMEM_CXX"]
    candidates = [shutil.which("c++"), shutil.which("g++"), os.environ.get("CXX"),
                  shutil.which("clang++")]
    for compiler in candidates:
        if compiler and _links_libstdcxx_dynamically(compiler):
            return compiler
    raise BuildError("no C++ compiler that links libstdc++ as a shared library (install g++, "
                     "or name one in CUDAMEM_CXX)")


def key(torch):
    """What a build is valid for: the sources, the PyTorch version, where it is, its ABI."""
    h = hashlib.sha256()
    for name in SOURCES:
        with open(os.path.join(SOURCE_DIR, name), "rb") as f:
            h.update(f.read())
    with open(os.path.join(c_header_dir(), "cudamem_c.h"), "rb") as f:
        h.update(f.read())
    torch_dir = os.path.dirname(os.path.abspath(torch.__file__))
    h.update(torch.__version__.encode())
    h.update(torch_dir.encode())
    h.update(bytes([int(torch._C._GLIBCXX_USE_CXX11_ABI)]))
    return h.hexdigest()[:16]


def library_name(torch):
    return "_torch_allocator_%s.so" % key(torch)


def cache_dir():
    return os.environ.get("CUDAMEM_CACHE_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "cudamem")


def find(torch):
    """A build for this PyTorch: the package's own (pip install) or the cache's; else None."""
    name = library_name(torch)
    for d in (HERE, cache_dir()):
        path = os.path.join(d, name)
        if os.path.isfile(path):
            return path
    return None


def compile_command(torch, compiler, source, target, libraries):
    """The command that compiles `source` (C++ over PyTorch's and cudamem's C headers) into
    the shared library `target`, linked to PyTorch's `libraries` (names without lib/.so): the
    flags that must match the installed PyTorch (its C++ ABI, its headers, where its libraries
    are found at run time) are chosen here, once, for the allocator and the benchmarks."""
    torch_dir = os.path.dirname(os.path.abspath(torch.__file__))
    lib = os.path.join(torch_dir, "lib")
    return ([compiler, "-O2", "-shared", "-fPIC", "-std=c++17", "-fvisibility=hidden",
             "-D_GLIBCXX_USE_CXX11_ABI=%d" % int(torch._C._GLIBCXX_USE_CXX11_ABI),
             "-isystem", os.path.join(torch_dir, "include"),
             "-isystem", cuda_include_dir(), "-I", c_header_dir(), source, "-o", target,
             "-L" + lib]
            + ["-l" + name for name in libraries] + ["-Wl,-rpath," + lib])


def build(torch, directory, quiet=False):
    """Compiles the allocator into `directory`; returns its path."""
    name = library_name(torch)
    target = os.path.join(directory, name)
    if os.path.isfile(target):
        return target
    compiler = choose_compiler()
    os.makedirs(directory, exist_ok=True)
    if not quiet:
        print("cudamem: building its PyTorch allocator for PyTorch %s (once per PyTorch "
              "version, about %d s) into %s" % (torch.__version__, SECONDS, directory),
              file=sys.stderr, flush=True)
    fd, temporary = tempfile.mkstemp(suffix=".so", dir=directory)
    os.close(fd)
    command = compile_command(torch, compiler, os.path.join(SOURCE_DIR, "torch_allocator.cpp"),
                              temporary, ["c10", "c10_cuda", "torch_cuda"])
    started = time.monotonic()
    try:
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            raise BuildError("%s failed: %s" % (os.path.basename(compiler),
                                                done.stderr.strip()[-1500:]))
        os.replace(temporary, target)  # atomic: a concurrent process sees all of it or none
    finally:
        if os.path.exists(temporary):
            os.unlink(temporary)
    if not quiet:
        print("cudamem: built in %.1f s" % (time.monotonic() - started), file=sys.stderr,
              flush=True)
    return target


def main(argv):
    """`build DIR`: what pip install runs; prints what it did, never fails the install."""
    if len(argv) != 3 or argv[1] != "build":
        print("usage: _torch_build.py build DIR", file=sys.stderr)
        return 2
    try:
        import torch
    except Exception as e:  # noqa: BLE001 - no PyTorch here: built at the first install()
        print("cudamem: PyTorch is not importable here (%s): its allocator will be built at "
              "the first cudamem.torch.install()" % type(e).__name__)
        return 0
    try:
        path = build(torch, argv[2], quiet=True)
    except BuildError as e:
        print("cudamem: the PyTorch allocator was not built now (%s); it will be at the first "
              "cudamem.torch.install()" % e)
        return 0
    for stale in glob.glob(os.path.join(argv[2], "_torch_allocator_*.so")):
        if stale != path:
            os.unlink(stale)
    print("cudamem: built %s for PyTorch %s" % (os.path.basename(path), torch.__version__))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
