#!/usr/bin/env python3
"""What including cudamem costs a translation unit: compile time, beside a file that includes
only cuda_runtime.h, measured in the same run. Needs no GPU.

    python3 bench/compile_time.py                  # the key units, nvcc and g++, 5 runs each
    python3 bench/compile_time.py --headers        # and every public header alone
    python3 bench/compile_time.py --rmm DIR        # and RMM's comparable set (DIR: RMM's include/)
    python3 bench/compile_time.py --runs 9 --json out.json
    python3 bench/compile_time.py --phases         # and where nvcc spends each unit's time

Each unit is a small program: a kernel and a main() that use what the unit includes (a
device_buffer over the current resource, a pool, ...), compiled alone with `nvcc -std=c++20
-arch=sm_90 -c` as a .cu file, and without its kernel with `g++ -std=c++20 -O2 -c` as a .cpp file.
The units run in turns (every unit once, then every unit again, ...), so that a machine whose
speed drifts slows all of them alike. A unit's time is the median over the runs of the CPU time
(user + system) of the compiler and every process it starts: on a machine with other work on
it that is steadier than the wall clock, and on an idle one the two agree (a compile is one
process at a time). The table gives each median with the runs' spread (min-max), its ratio to
the cuda_runtime.h-only unit of the same compiler, and the preprocessed lines (g++ -E -P, lines
that are not blank).

The units:
  cuda_runtime.h      the baseline: cuda_runtime.h, a kernel, cudaMalloc/cudaFree
  <stdexcept> floor   the baseline + <stdexcept>: what any header costs whose errors are
                      std::runtime_errors (cudamem's are); no cudamem unit can cost less
  owners              stream.hpp + device_buffer.hpp: a stream and a buffer over the current
                      device's resource (which compiles device_resource, cudaMalloc and its
                      out-of-memory report, into this file), a kernel on it
  owners (resource given)  the same headers; a function that runs a kernel on a buffer over a
                      memory_resource& made elsewhere (a library's file)
  pool                stream, device_resource, pool_resource, device_buffer
  vm_pool             stream, vm_pool_resource, device_buffer
  pool (compiled), vm_pool (compiled), umbrella (compiled)
                      the same files in compiled mode (-DCUDAMEM_COMPILED, as linking
                      cudamem::compiled sets it; detail/compiled.hpp): the pool's and the
                      vm_pool's code is compiled once, in the library, not in the file
  umbrella            cudamem/cudamem.hpp, used as the quick start does
  thrust + cub        thrust's device_vector and sort, cub.cuh (nvcc only): for scale
  rmm                 with --rmm: RMM's device_buffer, device_uvector, pool_memory_resource,
                      cuda_memory_resource and cuda_stream, the comparable set
  <header>            with --headers: each public header alone (include + the baseline body)

--phases adds a table of where nvcc's time goes, from `nvcc -time` (wall milliseconds per
phase, medians over the runs): preprocessing (twice: the host's and the device's view of the
file), cudafe++ (the front end that parses the whole file and splits host from device code),
cicc (the device compiler, which parses the whole file again, host code included), the host
compiler (g++ on cudafe++'s output: where inline code that is used gets compiled), and the
rest (ptxas, fatbinary, the driver). A header's host-only code costs all three of cudafe++,
cicc and the host compiler; only what a unit uses costs the host compiler's code generation.

RMM's headers: RMM 24.12's are in its PyPI wheel, with the fmt, spdlog and CCCL they need:
`pip download --no-deps librmm-cu12==24.12.1 && unzip -q librmm_cu12-*.whl -d rmm`, then
`--rmm rmm/librmm/include`. Without --rmm the column is skipped, and the table says so.
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
INCLUDE = os.path.join(REPO, "include")

KERNEL = """
__global__ void scale(float* x, unsigned long long n) {
  const unsigned long long i = blockIdx.x * 256ull + threadIdx.x;
  if (i < n) x[i] *= 2.0f;
}
"""

# name -> (includes, main() body for both compilers, kernel launch for nvcc only)
UNITS = {
    "cuda_runtime.h": (
        ["cuda_runtime.h"],
        "float* p = nullptr;\n  cudaMalloc(&p, 4096);",
        "scale<<<4, 256>>>(p, 1024);\n  cudaFree(p);"),
    "<stdexcept> floor": (
        ["cuda_runtime.h", "stdexcept"],
        "float* p = nullptr;\n  if (cudaMalloc(&p, 4096) != cudaSuccess) throw std::runtime_error(\"no\");",
        "scale<<<4, 256>>>(p, 1024);\n  cudaFree(p);"),
    "owners": (
        ["cudamem/stream.hpp", "cudamem/device_buffer.hpp"],
        "cudamem::stream s;\n  cudamem::device_buffer<float> b(1024, s);",
        "scale<<<4, 256, 0, s.get()>>>(b.data(), b.size());\n  s.synchronize();"),
    "owners (resource given)": (
        ["cudamem/stream.hpp", "cudamem/device_buffer.hpp"],
        None,  # a library's file: a function over a resource made elsewhere
        None),
    "pool": (
        ["cudamem/stream.hpp", "cudamem/device_resource.hpp", "cudamem/pool_resource.hpp",
         "cudamem/device_buffer.hpp"],
        "cudamem::stream s;\n  cudamem::device_resource device;\n"
        "  cudamem::pool_resource pool{device};\n"
        "  cudamem::device_buffer<float> b(1024, s, pool);",
        "scale<<<4, 256, 0, s.get()>>>(b.data(), b.size());\n  s.synchronize();"),
    "vm_pool": (
        ["cudamem/stream.hpp", "cudamem/vm_pool_resource.hpp", "cudamem/device_buffer.hpp"],
        "cudamem::stream s;\n  cudamem::vm_pool_resource pool;\n"
        "  cudamem::device_buffer<float> b(1024, s, pool);",
        "scale<<<4, 256, 0, s.get()>>>(b.data(), b.size());\n  s.synchronize();"),
    "umbrella": (
        ["cudamem/cudamem.hpp"],
        "cudamem::stream s;\n  cudamem::device_resource device;\n"
        "  cudamem::pool_resource pool{device};\n"
        "  cudamem::device_buffer<float> b(1024, s, pool);",
        "scale<<<4, 256, 0, s.get()>>>(b.data(), b.size());\n  s.synchronize();"),
    "thrust + cub": (
        ["thrust/device_vector.h", "thrust/sort.h", "cub/cub.cuh"],
        None,  # nvcc only
        "thrust::device_vector<float> v(1024);\n  thrust::sort(v.begin(), v.end());\n"
        "  scale<<<4, 256>>>(thrust::raw_pointer_cast(v.data()), v.size());"),
}

# Units measured again in compiled mode: name -> the header-only unit they repeat.
COMPILED_UNITS = {"owners (compiled)": "owners (resource given)",
                  "pool (compiled)": "pool", "vm_pool (compiled)": "vm_pool",
                  "umbrella (compiled)": "umbrella"}
COMPILED_FLAGS = ["-DCUDAMEM_COMPILED"]

RMM_UNIT = (
    ["rmm/cuda_stream.hpp", "rmm/device_buffer.hpp", "rmm/device_uvector.hpp",
     "rmm/mr/device/cuda_memory_resource.hpp", "rmm/mr/device/pool_memory_resource.hpp"],
    "rmm::cuda_stream s;\n  rmm::mr::cuda_memory_resource up;\n"
    "  rmm::mr::pool_memory_resource<rmm::mr::cuda_memory_resource> pool{&up, 1u << 20};\n"
    "  rmm::device_uvector<float> b(1024, s.view(), &pool);",
    "scale<<<4, 256, 0, s.value()>>>(b.data(), b.size());\n  s.synchronize();")

# Public headers that need something cudamem does not (NCCL): measured only where it is found.
NEEDS_NCCL = {"cudamem/nccl.hpp", "cudamem/nccl_pool.hpp"}


# A library's file: a function that runs a kernel on a buffer over a resource it is given.
LIBRARY_FUNCTION = """
void run(cudamem::memory_resource& mr, cudamem::stream_view s) {
  cudamem::device_buffer<float> b(1024, s, mr);
  %s
}
"""


def source(unit, language):
    """The text of a unit's translation unit for `language` ("cu" or "cpp"); None if the unit
    has no form for it."""
    includes, body, launch = unit
    if body is None and launch is None:  # a library's file (LIBRARY_FUNCTION)
        lines = ["#include <%s>" % h for h in includes]
        if language == "cu":
            lines.append(KERNEL)
        kernel = "scale<<<4, 256, 0, s.get()>>>(b.data(), b.size());" if language == "cu" else ""
        lines.append(LIBRARY_FUNCTION % kernel)
        return "\n".join(lines)
    if language == "cpp" and body is None:
        return None
    lines = ["#include <%s>" % h for h in includes]
    if language == "cu":
        lines.append(KERNEL)
    lines.append("int main() {")
    if body:
        lines.append("  " + body)
    if language == "cu" and launch:
        lines.append("  " + launch)
    lines.append("  return 0;\n}\n")
    return "\n".join(lines)


# nvcc -time's phases, grouped: (group, test on the phase's name).
PHASE_GROUPS = (
    ("preprocessing", lambda name: "preprocessing" in name),
    ("cudafe++", lambda name: name == "cudafe++"),
    ("cicc", lambda name: name == "cicc"),
    ("host compiler", lambda name: "(compiling)" in name),
)
OTHER_PHASES = "rest"


def nvcc_phases(csv_text):
    """Milliseconds per phase group (PHASE_GROUPS, then OTHER_PHASES) from the CSV that
    `nvcc -time FILE` writes: a header line, then one line per phase whose 2nd field is the
    phase's name and 7th its time, in the unit of the 8th (ms). Raises ValueError for a line
    it cannot read, or a file with no phase."""
    groups = {g: 0.0 for g, _ in PHASE_GROUPS}
    groups[OTHER_PHASES] = 0.0
    rows = [line for line in csv_text.splitlines() if line.strip()]
    if len(rows) < 2:
        raise ValueError("nvcc -time wrote no phase")
    for line in rows[1:]:
        fields = [f.strip() for f in line.split(",")]
        if len(fields) < 8 or fields[7] != "ms":
            raise ValueError("not a line of nvcc -time's CSV: %r" % line)
        name, ms = fields[1], float(fields[6])
        group = next((g for g, test in PHASE_GROUPS if test(name)), OTHER_PHASES)
        groups[group] += ms
    return groups


def cuda_home():
    nvcc = shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
    return os.path.dirname(os.path.dirname(os.path.realpath(nvcc)))


def commands(args, language, src, obj, extra_flags):
    includes = ["-I", INCLUDE] + list(extra_flags)
    if language == "cu":
        return [args.nvcc, "-std=c++20", "-arch=sm_90", "-c", src, "-o", obj] + includes
    home = cuda_home()
    return ([args.cxx, "-std=c++20", "-O2", "-c", "-x", "c++", src, "-o", obj] + includes
            + ["-isystem", os.path.join(home, "include"),
               "-isystem", os.path.join(home, "include", "cccl")])


def cpu_seconds(command):
    """Runs `command`; returns (CPU seconds of it and its children, wall seconds), or raises
    with its output when it fails."""
    started = time.monotonic()
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    output = process.stdout.read()
    _, status, usage = os.wait4(process.pid, 0)
    wall = time.monotonic() - started
    process.returncode = os.waitstatus_to_exitcode(status)
    if process.returncode != 0:
        raise RuntimeError("%s failed:\n%s" % (" ".join(command), output.decode(errors="replace")[-3000:]))
    return usage.ru_utime + usage.ru_stime, wall


def preprocessed_lines(args, src, extra_flags):
    command = commands(args, "cpp", src, os.devnull, extra_flags)
    command = [c for c in command if c not in ("-c", "-O2")]
    at = command.index("-o")
    del command[at:at + 2]
    command += ["-E", "-P"]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        return None
    return sum(1 for line in done.stdout.splitlines() if line.strip())


def rmm_flags(root):
    """What RMM's CMake package gives a consumer: its include directory, the CCCL it was built
    with (as its wheel lays them out), and its definitions (fmt and spdlog header-only, CCCL's
    experimental memory resources)."""
    dirs = [root]
    rapids = os.path.join(root, "rapids")
    for d in (rapids, os.path.join(rapids, "libcudacxx")):
        if os.path.isdir(d):
            dirs.insert(0, d)
    return (sum((["-I", d] for d in dirs), [])
            + ["-DSPDLOG_FMT_EXTERNAL", "-DFMT_HEADER_ONLY",
               "-DLIBCUDACXX_ENABLE_EXPERIMENTAL_MEMORY_RESOURCE"])


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5, help="runs of every unit (median)")
    parser.add_argument("--headers", action="store_true", help="also each public header alone")
    parser.add_argument("--header-runs", type=int, default=3, help="runs of each header alone")
    parser.add_argument("--rmm", metavar="DIR", help="RMM's include directory (see above)")
    parser.add_argument("--only", help="comma-separated unit names to measure (and the baseline)")
    parser.add_argument("--compilers", default="nvcc,g++", help="nvcc, g++ or both")
    parser.add_argument("--nvcc", default=shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc")
    parser.add_argument("--cxx", default=shutil.which("g++") or "g++")
    parser.add_argument("--json", metavar="FILE", help="write every measurement to FILE")
    parser.add_argument("--phases", action="store_true",
                        help="also where nvcc's time goes in each unit (nvcc -time)")
    args = parser.parse_args()
    if args.runs < 1 or args.header_runs < 1:
        parser.error("--runs and --header-runs must be at least 1")
    languages = []
    for name in args.compilers.split(","):
        if name not in ("nvcc", "g++"):
            parser.error("--compilers takes nvcc and g++, not %r" % name)
        languages.append("cu" if name == "nvcc" else "cpp")
    if args.phases and "cu" not in languages:
        parser.error("--phases needs nvcc among --compilers")
    if "cu" in languages and not os.path.exists(args.nvcc):
        sys.exit("compile_time.py: nvcc not found (install the CUDA Toolkit, or pass --nvcc)")
    if "cpp" in languages and not shutil.which(args.cxx):
        sys.exit("compile_time.py: %s not found (pass --cxx)" % args.cxx)

    units = dict(UNITS)
    for name, base in COMPILED_UNITS.items():  # beside the unit they repeat
        units[name] = UNITS[base]
    notes = []
    extra = {name: (COMPILED_FLAGS if name in COMPILED_UNITS else []) for name in units}
    if args.rmm:
        if not os.path.isfile(os.path.join(args.rmm, "rmm", "device_buffer.hpp")):
            sys.exit("compile_time.py: %s has no rmm/device_buffer.hpp" % args.rmm)
        units["rmm"] = RMM_UNIT
        extra["rmm"] = rmm_flags(args.rmm)
    else:
        notes.append("rmm: skipped (no --rmm DIR; see the docstring for where to get RMM's "
                     "headers)")
    if args.only:
        wanted = set(args.only.split(",")) | {"cuda_runtime.h"}
        unknown = wanted - set(units)
        if unknown:
            parser.error("unknown units: %s (known: %s)" % (sorted(unknown), sorted(units)))
        units = {k: v for k, v in units.items() if k in wanted}
    header_units = {}
    if args.headers:
        base_includes, base_body, base_launch = UNITS["cuda_runtime.h"]
        for root, _, files in os.walk(os.path.join(INCLUDE, "cudamem")):
            if os.path.basename(root) != "cudamem":
                continue
            for f in sorted(files):
                header = "cudamem/" + f
                if f.endswith(".hpp") and header not in NEEDS_NCCL:
                    header_units[header] = ([header] + base_includes, base_body, base_launch)
        notes.append("headers needing NCCL (%s) are not measured alone" % ", ".join(sorted(NEEDS_NCCL)))
        for name in header_units:
            extra[name] = []

    work = tempfile.mkdtemp(prefix="cudamem-compile-time-")
    samples = {}  # (unit, language) -> [(cpu, wall)]
    phases = {}  # unit -> [nvcc_phases of each run]
    lines = {}
    try:
        def measure(table, runs):
            for run in range(runs):
                for name, unit in table.items():
                    for language in languages:
                        text = source(unit, language)
                        if text is None:
                            continue
                        src = os.path.join(work, "unit.%s" % language)
                        with open(src, "w") as f:
                            f.write(text)
                        obj = os.path.join(work, "unit.o")
                        command = commands(args, language, src, obj, extra[name])
                        timing = os.path.join(work, "phases.csv")
                        timed = args.phases and language == "cu"
                        if timed:
                            if os.path.exists(timing):
                                os.remove(timing)  # nvcc appends to it
                            command += ["-time", timing]
                        cpu, wall = cpu_seconds(command)
                        samples.setdefault((name, language), []).append((cpu, wall))
                        if timed:
                            with open(timing) as f:
                                phases.setdefault(name, []).append(nvcc_phases(f.read()))
                        if run == 0 and language == "cpp" and name not in lines:
                            lines[name] = preprocessed_lines(args, src, extra[name])
                print("run %d of %d done" % (run + 1, runs), file=sys.stderr, flush=True)

        measure(units, args.runs)
        if header_units:
            measure({"cuda_runtime.h": UNITS["cuda_runtime.h"], **header_units}, args.header_runs)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    def cell(name, language):
        got = samples.get((name, language))
        if not got:
            return "—", None
        cpu = [c for c, _ in got]
        median = statistics.median(cpu)
        base = statistics.median(c for c, _ in samples[("cuda_runtime.h", language)])
        return "%.2f (%.2f-%.2f)" % (median, min(cpu), max(cpu)), median / base

    header = "| unit | nvcc -c, CPU s | × cuda_runtime.h | g++ -O2 -c, CPU s | × cuda_runtime.h | preprocessed lines |"
    print(header)
    print("|---|---|---|---|---|---|")
    for name in list(units) + list(header_units):
        row = ["`%s`" % name if name in header_units else name]
        for language in ("cu", "cpp"):
            text, ratio = cell(name, language)
            row += [text, "%.2f" % ratio if ratio is not None else "—"]
        row.append("{:,}".format(lines[name]) if lines.get(name) else "—")
        print("| " + " | ".join(row) + " |")
    if ("rmm", "cu") in samples:
        rmm = statistics.median(c for c, _ in samples[("rmm", "cu")])
        for name in ("umbrella", "umbrella (compiled)"):
            if (name, "cu") in samples:
                umbrella = statistics.median(c for c, _ in samples[(name, "cu")])
                print("\n%s / rmm under nvcc: %.2f" % (name, umbrella / rmm))
    if phases:
        groups = [g for g, _ in PHASE_GROUPS] + [OTHER_PHASES]
        print("\n| unit, nvcc -time (wall s, medians) | " + " | ".join(groups) + " |")
        print("|---" * (len(groups) + 1) + "|")
        for name in list(units) + list(header_units):
            if name in phases:
                print("| %s | " % name + " | ".join(
                    "%.2f" % (statistics.median(run[g] for run in phases[name]) / 1000.0)
                    for g in groups) + " |")
    for note in notes:
        print("note: " + note)
    print("medians of %d runs (%d for headers alone); %s; nvcc %s; %s" % (
        args.runs, args.header_runs, os.uname().nodename, args.nvcc, args.cxx))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"%s|%s" % k: v for k, v in samples.items()} | {"lines": lines}
                      | ({"phases": phases} if phases else {}), f, indent=1)


if __name__ == "__main__":
    main()
