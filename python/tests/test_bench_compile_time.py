"""bench/compile_time.py's reading of `nvcc -time` (no GPU, no nvcc needed): which phase's time
goes to which column of its --phases table. A misread phase does not fail the benchmark, it
puts a header's cost in the wrong place, so it is tested here."""
import importlib.util
import os
import subprocess
import sys

import pytest

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench",
                      "compile_time.py")

# What nvcc 13.0 wrote for a .cu file (`nvcc -time t.csv -c unit.cu`), paths shortened.
NVCC_TIME_CSV = """\
source file name , phase name , phase input files , phase output file , arch , tool, metric , unit
unit.cu , gcc (preprocessing 4) , unit.cu  , /tmp/x-5_unit.cpp4.ii ,  , nvcc , 202.7110 , ms
unit.cu , cudafe++ , /tmp/x-5_unit.cpp4.ii  , /tmp/x-6_unit.cudafe1.cpp , compute_90 , nvcc , 2398.1401 , ms
unit.cu , gcc (preprocessing 1) , unit.cu  , /tmp/x-7_unit.cpp1.ii , compute_90 , nvcc , 192.2240 , ms
unit.cu , cicc ,  /tmp/x-7_unit.cpp1.ii  , /tmp/x-6_unit.ptx , compute_90 , nvcc , 2240.4500 , ms
unit.cu , ptxas , /tmp/x-6_unit.ptx  , /tmp/x-8_unit.sm_90.cubin , sm_90 , nvcc , 16.0520 , ms
unit.cu , fatbinary , /tmp/x-8_unit.sm_90.cubin /tmp/x-6_unit.ptx  , /tmp/x-3_unit.fatbin ,  , nvcc , 4.0030 , ms
unit.cu , gcc (compiling) ,   , unit.o , compute_90 , nvcc , 2075.1121 , ms
 , nvcc (driver) ,  , unit.o ,  , nvcc , 0.6455 , ms
"""


@pytest.fixture(scope="module")
def compile_time():
    spec = importlib.util.spec_from_file_location("compile_time", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_each_phase_lands_in_its_group(compile_time):
    got = compile_time.nvcc_phases(NVCC_TIME_CSV)
    assert got == pytest.approx({
        "preprocessing": 202.7110 + 192.2240,
        "cudafe++": 2398.1401,
        "cicc": 2240.4500,
        "host compiler": 2075.1121,
        "rest": 16.0520 + 4.0030 + 0.6455,
    })


def test_another_host_compiler_is_still_the_host_compiler(compile_time):
    clang = NVCC_TIME_CSV.replace("gcc (compiling)", "clang (compiling)")
    assert compile_time.nvcc_phases(clang)["host compiler"] == pytest.approx(2075.1121)


@pytest.mark.parametrize("text", [
    "",                                                          # nvcc wrote nothing
    NVCC_TIME_CSV.splitlines()[0],                               # a header, no phase
    NVCC_TIME_CSV + "unit.cu , cicc , a , b , c , nvcc , 1.0\n",  # a line cut short
    NVCC_TIME_CSV.replace("2240.4500 , ms", "2.2404500 , s"),    # a unit it does not know
    NVCC_TIME_CSV.replace("2240.4500", "fast"),                  # not a number
])
def test_what_it_cannot_read_is_an_error(compile_time, text):
    with pytest.raises(ValueError):
        compile_time.nvcc_phases(text)


def test_phases_without_nvcc_is_refused_before_anything_compiles():
    done = subprocess.run([sys.executable, SCRIPT, "--compilers", "g++", "--phases"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "--phases needs nvcc" in done.stderr
