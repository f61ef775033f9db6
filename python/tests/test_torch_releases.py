"""The per-release check's own parts (torch_releases.py), with no PyTorch wheel: the stub that
stands in for a library exports what the library did, a symbol no library exports is reported,
the CUDA runtime a wheel's metadata names is found, and a release that cannot be fetched is
reported as skipped. Runs in the host suite (run_suite.py host)."""
import os
import shutil
import subprocess
import sys

import pytest

import torch_releases

needs_tools = pytest.mark.skipif(any(shutil.which(t) is None for t in ("nm", "cc")),
                                 reason="needs nm and a C compiler")


def shared_library(tmp_path, name, code):
    source = tmp_path / (name + ".c")
    source.write_text(code)
    target = tmp_path / ("lib%s.so" % name)
    subprocess.run(["cc", "-shared", "-fPIC", str(source), "-o", str(target)], check=True)
    return str(target)


@needs_tools
def test_the_stub_exports_what_the_library_exported(tmp_path):
    real = shared_library(tmp_path, "real", "int answer_object = 42;\n"
                                            "int answer_function(void) { return 42; }\n")
    table = tmp_path / "real.symbols"
    exported = torch_releases.dynamic_symbols(real, defined=True)
    table.write_text("".join("%s %s\n" % kv for kv in exported.items()))
    stub = str(tmp_path / "libstub.so")
    torch_releases.make_stub(str(table), "libreal.so", stub, str(tmp_path))
    stubbed = torch_releases.dynamic_symbols(stub, defined=True)
    assert {"answer_object", "answer_function"} <= set(stubbed)
    assert stubbed["answer_function"] == "T" and stubbed["answer_object"] in ("D", "B")


@needs_tools
def test_a_symbol_no_library_exports_is_reported(tmp_path):
    provider = shared_library(tmp_path, "provider", "int provided(void) { return 1; }\n")
    user = shared_library(tmp_path, "user", "int provided(void); int absent(void);\n"
                                            "int use(void) { return provided() + absent(); }\n")
    needed = torch_releases.dynamic_symbols(user, defined=False)
    counts, missing = torch_releases.resolve(
        needed, [("provider", torch_releases.dynamic_symbols(provider, defined=True))])
    assert counts == {"provider": 1}
    assert missing == ["absent"]


def test_the_cuda_runtime_of_each_wheel_form_is_found():
    cu12 = "Requires-Dist: filelock\nRequires-Dist: nvidia-cuda-runtime-cu12==12.8.90; " \
           "platform_system == \"Linux\"\n"
    assert torch_releases.torch_runtime_requirement(cu12) == (
        "nvidia-cuda-runtime-cu12==12.8.90", "nvidia_cuda_runtime_cu*-12.8.90-*.whl")
    cu13 = "Requires-Dist: cuda-toolkit[cublas,cudart,cufft]==13.0.2; platform_system == " \
           "\"Linux\"\n"
    assert torch_releases.torch_runtime_requirement(cu13) == (
        "cuda-toolkit[cudart]==13.0.2", "nvidia_cuda_runtime-*.whl")
    assert torch_releases.torch_runtime_requirement("Requires-Dist: filelock\n") == (None, None)


def test_a_release_that_cannot_be_fetched_is_skipped_not_passed(tmp_path):
    # (Offline, pip gives up after one short try: the answer is the same, skipped.)
    env = dict(os.environ, CUDAMEM_TORCH_WHEELS=str(tmp_path / "cache"), PIP_RETRIES="0",
               PIP_TIMEOUT="5")
    done = subprocess.run([sys.executable, torch_releases.__file__, "check", "0.0.0",
                           "--library", "/nonexistent/libcudamem_c.so", "--work",
                           str(tmp_path / "work")], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.startswith("SKIPPED: torch==0.0.0 could not be fetched from PyPI"), \
        done.stdout
