"""cudamem's PyTorch allocator against one PyTorch release, with no GPU and no PyTorch installed:
what ctest's torch.<release> tests run (registered in capi/tests/CMakeLists.txt), one per
supported release, so that a release whose interface moved fails by name.

    torch_releases.py check 2.15.0 --library build/capi/libcudamem_c.so --work build/torch-2.15.0

For the release: its wheel from PyPI (`pip download --no-deps torch==X`, ~0.5-0.9 GB, once),
unpacked into the cache as only what a build needs (torch/include, libc10, libc10_cuda, the
table of libtorch_cuda's exported symbols as a stub library in its place, and the CUDA runtime
headers and library of the wheel's CUDA version), then:
  1. compiled and linked as cudamem.torch.install() builds it (cudamem/_torch_build.py: the
     release's C++ standard, its ABI, its headers, linked to its libc10, libc10_cuda and
     libtorch_cuda);
  2. every symbol the built library needs is exported by the release's libraries (c10,
     c10_cuda, torch_cuda), by its CUDA runtime, by libcudamem_c or by the C/C++ runtime;
  3. the library loads, every symbol bound at once (RTLD_NOW), beside the release's libc10 and
     libc10_cuda, its CUDA runtime, the stub of libtorch_cuda and libcudamem_c.
The cache is $CUDAMEM_TORCH_WHEELS, else ${XDG_CACHE_HOME:-~/.cache}/cudamem/torch-wheels; a
release unpacked there is never downloaded again (CUDAMEM_TORCH_KEEP_WHEELS=1 keeps the wheels
too). Releases run in parallel safely: each step that writes the cache holds a lock. A release
whose wheel cannot be fetched prints "SKIPPED: <why>" and exits 0 (ctest: skipped, never
passed).
"""
import argparse
import contextlib
import fcntl
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile

PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, PACKAGE_ROOT)
from cudamem import _torch_build  # noqa: E402

# The latest patch of each supported minor release; `list` prints them for CMake.
RELEASES = ["2.7.1", "2.8.0", "2.9.1", "2.10.0", "2.11.0", "2.12.1", "2.13.0", "2.14.1",
            "2.15.0"]
TORCH_LIBRARIES = ["libc10.so", "libc10_cuda.so", "libtorch_cuda.so"]


def skip(why):
    print("SKIPPED: " + why, flush=True)
    sys.exit(0)


def cache_root():
    if os.environ.get("CUDAMEM_TORCH_WHEELS"):
        return os.environ["CUDAMEM_TORCH_WHEELS"]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "cudamem", "torch-wheels")


@contextlib.contextmanager
def locked(path):
    """An exclusive lock on `path` (a file beside what it guards), held for the block."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def pip_download(requirement, directory, deps=False):
    """`pip download` of one requirement into `directory`; the finished process."""
    command = [sys.executable, "-m", "pip", "download", "-q", "--only-binary=:all:",
               "--retries", os.environ.get("PIP_RETRIES", "2"),
               "--timeout", os.environ.get("PIP_TIMEOUT", "30"), "-d", directory, requirement]
    if not deps:
        command.append("--no-deps")
    return subprocess.run(command, capture_output=True, text=True)


def pip_failure(stderr):
    """pip's reason in one line: its last ERROR line, or the cause it retried on (no network
    says 'name resolution'), not the middle of a retry's repr."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("ERROR:")]
    reason = errors[-1] if errors else (lines[-1] if lines else "pip printed nothing")
    if "name resolution" in stderr or "Failed to establish a new connection" in stderr:
        reason = "no network (%s)" % reason[:160]
    return reason[:300]


def fetch_wheel(requirement, pattern, wheels, deps=False):
    """The wheel files matching `pattern` in the cache, downloaded first if none is there;
    SKIPPED (exit 0) if it cannot be fetched."""
    found = glob.glob(os.path.join(wheels, pattern))
    if found:
        return found
    with tempfile.TemporaryDirectory(dir=wheels) as incoming:
        done = pip_download(requirement, incoming, deps)
        if done.returncode != 0:
            skip("%s could not be fetched from PyPI: %s" % (requirement,
                                                            pip_failure(done.stderr)))
        for f in os.listdir(incoming):
            os.replace(os.path.join(incoming, f), os.path.join(wheels, f))
    found = glob.glob(os.path.join(wheels, pattern))
    if not found:
        skip("pip fetched no file matching %s for %s" % (pattern, requirement))
    return found


def run(command, **kwargs):
    done = subprocess.run(command, capture_output=True, text=True, **kwargs)
    if done.returncode != 0:
        raise RuntimeError("%s failed: %s" % (" ".join(command[:3]), done.stderr[-2000:]))
    return done.stdout


def dynamic_symbols(library, defined):
    """The dynamic symbols `library` defines (or, defined=False, needs), without versions."""
    flag = "--defined-only" if defined else "--undefined-only"
    out = run(["nm", "-D", flag, "--format=posix", library])
    names = {}
    for line in out.splitlines():
        parts = line.split()
        if len(parts) >= 2:
            names[parts[0].split("@")[0]] = parts[1]
    return names


def make_stub(symbols_file, soname, target, work):
    """A shared library named `soname` that exports every symbol listed in `symbols_file`
    (name and nm type) and nothing else: stands in for a library too large to keep (the
    release's libtorch_cuda, 0.5-1 GB) where only what it exports matters."""
    source = os.path.join(work, "stub.s")
    with open(symbols_file) as table, open(source, "w") as out:
        out.write(".text\n")
        for line in table:
            name, kind = line.split()
            if kind in ("T", "W", "i"):
                out.write(".globl %s\n.type %s,@function\n%s:\n ret\n" % (name, name, name))
            elif kind in ("D", "B", "R", "V", "u"):
                out.write(".data\n.globl %s\n.type %s,@object\n.size %s,8\n%s:\n .zero 8\n.text\n"
                          % (name, name, name, name))
    run(["cc", "-shared", "-nostdlib", "-Wl,-soname," + soname, source, "-o", target])


def torch_runtime_requirement(metadata):
    """The pip requirement of the CUDA runtime a torch wheel's METADATA names, and the glob of
    the wheel file that brings it."""
    for line in metadata.splitlines():
        m = re.match(r"Requires-Dist: (nvidia-cuda-runtime-cu\d+)==([\w.]+)", line)
        if m:
            return "%s==%s" % (m.group(1), m.group(2)), "nvidia_cuda_runtime_cu*-%s-*.whl" % (
                m.group(2))
        m = re.match(r"Requires-Dist: cuda-toolkit\[[^\]]*cudart[^\]]*\]==([\w.]+)", line)
        if m:  # 2.11+: the toolkit's cudart extra, one nvidia-cuda-runtime wheel
            return "cuda-toolkit[cudart]==%s" % m.group(1), "nvidia_cuda_runtime-*.whl"
    return None, None


def unpack(version, root):
    """The release's files in the cache (made once): torch/include, torch/lib's libc10,
    libc10_cuda and libtorch_cuda's stub, torch/version.py, cuda-runtime/{include,lib}."""
    where = os.path.join(root, "torch-" + version)
    done_marker = os.path.join(where, "complete")
    with locked(where + ".lock"):
        if os.path.isfile(done_marker):
            return where
        wheels = os.path.join(root, "wheels")
        os.makedirs(wheels, exist_ok=True)
        started = time.monotonic()
        wheel = fetch_wheel("torch==" + version, "torch-%s-*.whl" % version, wheels)[0]
        fetched = time.monotonic() - started
        shutil.rmtree(where, ignore_errors=True)
        os.makedirs(where)
        with zipfile.ZipFile(wheel) as z:
            wanted = [n for n in z.namelist()
                      if n.startswith("torch/include/") or n == "torch/version.py"
                      or n in ("torch/lib/" + lib for lib in TORCH_LIBRARIES)
                      or re.match(r"torch-[^/]*\.dist-info/METADATA$", n)]
            z.extractall(where, wanted)
            metadata = next(z.read(n).decode() for n in wanted if n.endswith("METADATA"))
        lib = os.path.join(where, "torch", "lib")
        real = os.path.join(lib, "libtorch_cuda.so")
        with open(os.path.join(lib, "libtorch_cuda.symbols"), "w") as f:
            for name, kind in sorted(dynamic_symbols(real, defined=True).items()):
                f.write("%s %s\n" % (name, kind))
        os.unlink(real)
        make_stub(os.path.join(lib, "libtorch_cuda.symbols"), "libtorch_cuda.so", real, where)
        requirement, pattern = torch_runtime_requirement(metadata)
        if requirement is None:
            raise RuntimeError("torch %s's METADATA names no CUDA runtime" % version)
        with locked(os.path.join(wheels, "cuda-runtime.lock")):
            runtime = [w for w in fetch_wheel(requirement, pattern, wheels, deps=True)
                       if "nvidia_cuda_runtime" in os.path.basename(w)][0]
        with zipfile.ZipFile(runtime) as z:
            for name in z.namelist():
                m = re.match(r"nvidia/[^/]+/(include/.*|lib/libcudart\.so\.\d+)$", name)
                if m:
                    target = os.path.join(where, "cuda-runtime", m.group(1))
                    os.makedirs(os.path.dirname(target), exist_ok=True)
                    with z.open(name) as src, open(target, "wb") as dst:
                        shutil.copyfileobj(src, dst)
        if os.environ.get("CUDAMEM_TORCH_KEEP_WHEELS") != "1":
            os.unlink(wheel)
        with open(done_marker, "w") as f:
            f.write("%s fetched in %.1f s, unpacked in %.1f s\n"
                    % (os.path.basename(wheel), fetched, time.monotonic() - started - fetched))
        return where


def describe(where, version):
    """The unpacked release as _torch_build.TorchInstall (its version, ABI, CUDA)."""
    text = open(os.path.join(where, "torch", "version.py")).read()
    full = re.search(r"__version__ = '([^']+)'", text).group(1)
    cuda = re.search(r"cuda: .*= '([^']+)'", text) or re.search(r"cuda = '([^']+)'", text)
    c10 = os.path.join(where, "torch", "lib", "libc10.so")
    cxx11 = any("__cxx11" in name for name in dynamic_symbols(c10, defined=True))
    install = _torch_build.TorchInstall(os.path.join(where, "torch"), full, cxx11,
                                        cuda.group(1) if cuda else None)
    assert install.release == tuple(int(x) for x in version.split(".")[:2]), full
    return install


def system_library(name):
    """Where the C/C++ runtime library `name` (libstdc++.so.6, libc.so.6, ...) is."""
    path = run(["cc", "-print-file-name=" + name]).strip()
    if os.path.isabs(path) and os.path.exists(path):
        return path
    for d in ("/lib/x86_64-linux-gnu", "/usr/lib/x86_64-linux-gnu", "/lib64", "/usr/lib64"):
        if os.path.exists(os.path.join(d, name)):
            return os.path.join(d, name)
    raise RuntimeError("%s not found" % name)


def check_symbols(built, where, library):
    """Every symbol the built library needs, and who exports it; the ones nobody does."""
    lib = os.path.join(where, "torch", "lib")
    providers = [("c10", dynamic_symbols(os.path.join(lib, "libc10.so"), True)),
                 ("c10_cuda", dynamic_symbols(os.path.join(lib, "libc10_cuda.so"), True)),
                 ("torch_cuda", dict(line.split() for line in
                                     open(os.path.join(lib, "libtorch_cuda.symbols")))),
                 ("cudart", dynamic_symbols(glob.glob(os.path.join(
                     where, "cuda-runtime", "lib", "libcudart.so.*"))[0], True)),
                 ("cudamem_c", dynamic_symbols(library, True))]
    for name in ("libstdc++.so.6", "libgcc_s.so.1", "libc.so.6", "libm.so.6",
                 "ld-linux-x86-64.so.2"):
        providers.append((name, dynamic_symbols(system_library(name), True)))
    return resolve(dynamic_symbols(built, defined=False), providers)


def resolve(needed, providers):
    """For symbols `needed` ({name: nm type}) and `providers` ([(who, {name: type})], in the
    order the loader would search), how many each provider serves, and the ones none does
    (weak references may stay unresolved)."""
    counts, missing = {}, []
    for symbol, kind in sorted(needed.items()):
        owner = next((who for who, table in providers if symbol in table), None)
        if owner is None and kind not in ("w", "v"):
            missing.append(symbol)
        elif owner is not None:
            counts[owner] = counts.get(owner, 0) + 1
    return counts, missing


LOAD = """
import ctypes, glob, os, sys
where, library, built = sys.argv[1:4]
lib = os.path.join(where, "torch", "lib")
for path in (glob.glob(os.path.join(where, "cuda-runtime", "lib", "libcudart.so.*"))[0],
             os.path.join(lib, "libc10.so"), os.path.join(lib, "libc10_cuda.so"),
             os.path.join(lib, "libtorch_cuda.so"), library):
    ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
glue = ctypes.CDLL(built, mode=os.RTLD_NOW)  # every symbol bound now, or OSError
print("entry points", bool(glue.cudamem_torch_allocator_install),
      bool(glue.cudamem_torch_allocator_last_oom))
"""


def check(version, library, work):
    started = time.monotonic()
    root = cache_root()
    where = unpack(version, root)
    unpacked = time.monotonic()
    print(open(os.path.join(where, "complete")).read().strip() or "cached", flush=True)
    install = describe(where, version)
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    try:
        built = _torch_build.build(install, work, quiet=True,
                                   cuda_include=os.path.join(where, "cuda-runtime", "include"))
    except _torch_build.BuildError as e:
        print("FAILED: torch %s (%s): the allocator does not compile: %s"
              % (version, _torch_build.cxx_standard(install), e))
        return 1
    compiled = time.monotonic()
    print("compiled and linked against torch %s (%s, CUDA %s headers) in %.1f s"
          % (install.version, _torch_build.cxx_standard(install), install.cuda,
             compiled - unpacked), flush=True)
    counts, missing = check_symbols(built, where, library)
    if missing:
        names = run(["c++filt"], input="\n".join(missing)).splitlines()
        print("FAILED: torch %s's libraries do not export %d symbol(s) the allocator needs:\n  %s"
              % (version, len(missing), "\n  ".join(names)))
        return 1
    print("every symbol resolved: %s" % ", ".join("%s %d" % kv for kv in counts.items()))
    load = subprocess.run([sys.executable, "-c", LOAD, where, library, built],
                          capture_output=True, text=True)
    if load.returncode != 0 or "entry points True True" not in load.stdout:
        print("FAILED: the allocator does not load beside torch %s's libraries:\n%s%s"
              % (version, load.stdout, load.stderr[-2000:]))
        return 1
    print("loaded with every symbol bound (RTLD_NOW)")
    print("torch %s: unpack %.1f s, compile and link %.1f s, checks %.1f s"
          % (version, unpacked - started, compiled - unpacked, time.monotonic() - compiled))
    return 0


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("action", choices=["check", "list"])
    parser.add_argument("version", nargs="?")
    parser.add_argument("--library", help="libcudamem_c.so, built")
    parser.add_argument("--work", help="where the allocator is built")
    args = parser.parse_args()
    if args.action == "list":
        print(";".join(RELEASES))
        return 0
    if not args.version or not args.library or not args.work:
        parser.error("check needs VERSION, --library and --work")
    for tool in ("nm", "cc", "c++filt"):
        if shutil.which(tool) is None:
            skip("%s is not installed (binutils, a C compiler)" % tool)
    return check(args.version, args.library, args.work)


if __name__ == "__main__":
    sys.exit(main())
