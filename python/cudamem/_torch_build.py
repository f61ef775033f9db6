"""Builds cudamem's PyTorch allocator (cudamem/_torch/torch_allocator.cpp) against the
installed PyTorch's headers: at `pip install` when PyTorch is importable there (the package's
CMake runs this file as a script), otherwise at the first cudamem.torch.install(), once per
PyTorch version, cached in $CUDAMEM_CACHE_DIR or ~/.cache/cudamem.

    python3 cudamem/_torch_build.py build DIR     # what pip install runs: the library into DIR

Why compile against PyTorch: the allocator is a C++ subclass of PyTorch's CUDAAllocator; its
layout (virtual functions, the structs of snapshots and statistics) belongs to one PyTorch
version. The key of a build names that version, where it is installed, its C++ ABI and the
sources, so a library is never loaded into a PyTorch it was not built for.

Supported: PyTorch 2.7 to 2.15 (SUPPORTED), each compiled with the C++ standard its headers
need (C++17, C++20 from 2.14). An older PyTorch is refused (UnsupportedTorch) before anything
is compiled; a newer one is tried, and its failure says it is newer than the supported ones.

Needs a C++ compiler (choose_compiler: $CUDAMEM_CXX, else the system's c++) and the headers of
the CUDA runtime PyTorch was built for (cuda_include_dir: the same CUDA major version, from
$CUDA_HOME, nvcc's toolkit, /usr/local/cuda, or the nvidia-cuda-runtime wheel PyTorch installs).
"""
import glob
import hashlib
import os
import re
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
           "snapshot_layout.hpp", "stats.hpp", "trace_ring.hpp", "call_timer.hpp"]
SUPPORTED = ((2, 7), (2, 15))  # the oldest and newest PyTorch release checked (major, minor)
SECONDS = 10  # what a build takes, about (4-6 s measured on 2 cores), said before it starts
LIBRARIES = ["c10", "c10_cuda", "torch_cuda"]  # PyTorch's libraries the allocator links


class BuildError(RuntimeError):
    """The allocator could not be built; the message says what is missing."""


class UnsupportedTorch(BuildError):
    """The installed PyTorch is older than the oldest release cudamem's allocator supports."""


def supported_text():
    (a, b), (c, d) = SUPPORTED
    return "%d.%d to %d.%d" % (a, b, c, d)


class TorchInstall:
    """What a build needs to know of a PyTorch: where it is (the directory holding include/ and
    lib/), its version ("2.11.0+cu130"), its C++ ABI and the CUDA version it was built for.
    from_module(torch) describes the imported one; tests/torch_releases.py describes a wheel's
    unpacked files the same way."""

    def __init__(self, directory, version, cxx11_abi, cuda=None):
        self.directory = os.path.abspath(directory)
        self.version = version
        self.cxx11_abi = bool(cxx11_abi)
        self.cuda = cuda

    @classmethod
    def from_module(cls, torch):
        return cls(os.path.dirname(os.path.abspath(torch.__file__)), torch.__version__,
                   torch._C._GLIBCXX_USE_CXX11_ABI, getattr(torch.version, "cuda", None))

    @property
    def release(self):
        """(major, minor) of the version; (0, 0) if it cannot be read."""
        match = re.match(r"(\d+)\.(\d+)", self.version)
        return (int(match.group(1)), int(match.group(2))) if match else (0, 0)


def _describe(torch):
    return torch if isinstance(torch, TorchInstall) else TorchInstall.from_module(torch)


def check_supported(torch):
    """Raises UnsupportedTorch for a PyTorch older than SUPPORTED's first release."""
    install = _describe(torch)
    if install.release < SUPPORTED[0]:
        raise UnsupportedTorch(
            "cudamem.torch supports PyTorch %s; this is PyTorch %s" % (supported_text(),
                                                                       install.version))


def cxx_standard(torch):
    """The C++ standard the release's headers need: C++20 from PyTorch 2.14 (c10 uses
    std::bit_width and std::strong_ordering), C++17 before, so older compilers still serve
    older releases."""
    return "c++20" if _describe(torch).release >= (2, 14) else "c++17"


def c_header_dir():
    """Where cudamem_c.h is: inside an installed package, or in the checkout's capi/."""
    for d in (os.path.join(HERE, "include"),
              os.path.join(os.path.dirname(os.path.dirname(HERE)), "capi", "include")):
        if os.path.isfile(os.path.join(d, "cudamem_c.h")):
            return d
    raise BuildError("cudamem_c.h is neither in %s/include nor in a cudamem checkout" % HERE)


def _cuda_header_major(directory):
    """The CUDA major version of the runtime headers in `directory` (None if unreadable)."""
    try:
        with open(os.path.join(directory, "cuda_runtime_api.h"), errors="replace") as f:
            match = re.search(r"#define\s+CUDART_VERSION\s+(\d+)", f.read())
    except OSError:
        return None
    return int(match.group(1)) // 1000 if match else None


def cuda_include_dir(cuda=None):
    """A directory with cuda_runtime_api.h for PyTorch's CUDA headers, of the CUDA major version
    `cuda` ("12.8": 12) when given: the allocator's calls must match the runtime PyTorch loads
    (cudaStreamGetCaptureInfo's signature differs between CUDA 12 and 13)."""
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
    found = [d for d in candidates if os.path.isfile(os.path.join(d, "cuda_runtime_api.h"))]
    if not found:
        raise BuildError("the CUDA runtime's headers (cuda_runtime_api.h) were not found: set "
                         "CUDA_HOME to the CUDA Toolkit, or install it in /usr/local/cuda")
    if not cuda:
        return found[0]
    wanted = int(str(cuda).split(".")[0])
    for d in found:
        if _cuda_header_major(d) == wanted:
            return d
    raise BuildError(
        "PyTorch was built for CUDA %s, and the CUDA runtime headers found are CUDA %s's (%s): "
        "install the CUDA %d runtime's headers (pip install nvidia-cuda-runtime-cu%d, or a CUDA "
        "%d Toolkit named by CUDA_HOME)" % (cuda, _cuda_header_major(found[0]), found[0],
                                            wanted, wanted, wanted))


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
    install = _describe(torch)
    h = hashlib.sha256()
    for name in SOURCES:
        with open(os.path.join(SOURCE_DIR, name), "rb") as f:
            h.update(f.read())
    with open(os.path.join(c_header_dir(), "cudamem_c.h"), "rb") as f:
        h.update(f.read())
    h.update(install.version.encode())
    h.update(install.directory.encode())
    h.update(bytes([int(install.cxx11_abi)]))
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


def compile_command(torch, compiler, source, target, libraries, cuda_include=None):
    """The command that compiles `source` (C++ over PyTorch's and cudamem's C headers) into
    the shared library `target`, linked to PyTorch's `libraries` (names without lib/.so): the
    flags that must match the installed PyTorch (its C++ standard, its C++ ABI, its headers, the
    CUDA runtime's headers of its CUDA version, where its libraries are found at run time) are
    chosen here, once, for the allocator and the benchmarks. `torch`: the module, or a
    TorchInstall."""
    install = _describe(torch)
    lib = os.path.join(install.directory, "lib")
    return ([compiler, "-O2", "-shared", "-fPIC", "-std=" + cxx_standard(install),
             "-fvisibility=hidden", "-D_GLIBCXX_USE_CXX11_ABI=%d" % int(install.cxx11_abi),
             "-isystem", os.path.join(install.directory, "include"),
             "-isystem", cuda_include or cuda_include_dir(install.cuda), "-I", c_header_dir(),
             source, "-o", target, "-L" + lib]
            + ["-l" + name for name in libraries] + ["-Wl,-rpath," + lib])


def _failure(install, compiler, stderr):
    """What a failed compilation says: the compiler's last lines, and for a PyTorch newer than
    the supported ones, that this is why."""
    lines = stderr.strip().splitlines()
    first = next((line for line in lines if "error" in line), "")  # the cause, said first
    detail = "%s failed: %s" % (os.path.basename(compiler), first[-500:])
    rest = "\n".join(lines)[-1000:]
    if rest and first not in rest:
        detail += "\n...\n" + rest
    if install.release > SUPPORTED[1]:
        return BuildError("PyTorch %s is newer than the releases cudamem supports (%s), and %s"
                          % (install.version, supported_text(), detail))
    return BuildError(detail)


def build(torch, directory, quiet=False, cuda_include=None):
    """Compiles the allocator into `directory`; returns its path. `torch`: the module, or a
    TorchInstall (tests/torch_releases.py: a wheel's files)."""
    install = _describe(torch)
    check_supported(install)
    name = library_name(install)
    target = os.path.join(directory, name)
    if os.path.isfile(target):
        return target
    compiler = choose_compiler()
    cuda_include = cuda_include or cuda_include_dir(install.cuda)
    os.makedirs(directory, exist_ok=True)
    if not quiet:
        print("cudamem: building its PyTorch allocator for PyTorch %s (once per PyTorch "
              "version, about %d s) into %s" % (install.version, SECONDS, directory),
              file=sys.stderr, flush=True)
    fd, temporary = tempfile.mkstemp(suffix=".so", dir=directory)
    os.close(fd)
    command = compile_command(install, compiler, os.path.join(SOURCE_DIR, "torch_allocator.cpp"),
                              temporary, LIBRARIES, cuda_include)
    started = time.monotonic()
    try:
        try:
            done = subprocess.run(command, capture_output=True, text=True)
        except OSError as e:  # $CUDAMEM_CXX names no program, say
            raise BuildError("the C++ compiler %s could not be run (%s)" % (compiler, e)) from None
        if done.returncode != 0:
            raise _failure(install, compiler, done.stderr)
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
        print("cudamem: PyTorch is not importable here (%s: %s): its allocator will be built at "
              "the first cudamem.torch.install()" % (type(e).__name__, e))
        return 0
    try:
        path = build(torch, argv[2], quiet=True)
    except BuildError as e:
        print("cudamem: the PyTorch allocator was not built now (%s); install() will say why "
              "if it cannot build it either" % e)
        return 0
    for stale in glob.glob(os.path.join(argv[2], "_torch_allocator_*.so")):
        if stale != path:
            os.unlink(stale)
    print("cudamem: built %s for PyTorch %s" % (os.path.basename(path), torch.__version__))
    return 0


if __name__ == "__main__":
    # Run as a script, this file's directory comes first on sys.path, where cudamem/torch.py
    # would be imported as `torch` (and fail): PyTorch itself must be found.
    if sys.path and os.path.abspath(sys.path[0] or os.curdir) == HERE:
        del sys.path[0]
    sys.exit(main(sys.argv))
