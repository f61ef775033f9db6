"""The build backend's checks (python/_build/cudamem_backend.py), without building anything: the
sentence for an unsupported Python, the settings the prerequisite check passes to CMake, and
the sentence for a missing GSL or CUDA Toolkit. (The whole `pip wheel ./python` with them is
run_suite.py's wheel suite.)"""
import os
import re
import shutil
import sys

import pytest

pytest.importorskip("scikit_build_core", reason="the build backend runs over scikit-build-core")

PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(PACKAGE_ROOT, "_build"))
import cudamem_backend  # noqa: E402


def test_an_unsupported_python_is_one_sentence():
    text = cudamem_backend.python_problem((3, 8, 18))
    assert text.startswith("cudamem: Python 3.8.18 is not supported")
    assert "3.9 or newer" in text
    assert text.count(".\n") == 0 and "\n" not in text
    assert cudamem_backend.python_problem((3, 9, 0)) is None
    assert cudamem_backend.python_problem((3, 13, 1)) is None


def test_the_minimum_python_is_requires_python():
    with open(os.path.join(PACKAGE_ROOT, "pyproject.toml")) as f:
        declared = re.search(r'requires-python = ">=(\d+)\.(\d+)"', f.read())
    assert declared is not None
    assert tuple(int(v) for v in declared.groups()) == cudamem_backend.MINIMUM_PYTHON


def test_the_check_gets_the_settings_the_build_gets():
    environ = {"CMAKE_ARGS": "-DA=1 -G Ninja", "SKBUILD_CMAKE_ARGS": "-DB=2;--trace",
               "SKBUILD_CMAKE_DEFINE": "C=3;D=x y"}
    settings = {"cmake.define.CMAKE_PREFIX_PATH": "/opt/gsl", "cmake.args": ["-DE=5", "-Wdev"],
                "wheel.py-api": "py3"}
    assert cudamem_backend.cmake_definitions(settings, environ) == [
        "-DA=1", "-DB=2", "-DC=3", "-DD=x y", "-DCMAKE_PREFIX_PATH=/opt/gsl", "-DE=5"]
    assert cudamem_backend.cmake_definitions(None, {}) == []


@pytest.mark.skipif(shutil.which("cmake") is None, reason="needs cmake")
@pytest.mark.parametrize("package, expected", [
    ("CUDAToolkit", "cudamem: the CUDA Toolkit (12.5 or newer, with nvcc) was not found"),
    ("Microsoft.GSL", "cudamem: Microsoft GSL was not found"),
])
def test_a_missing_prerequisite_is_one_sentence(package, expected, monkeypatch):
    monkeypatch.delenv("CMAKE_ARGS", raising=False)
    monkeypatch.delenv("SKBUILD_CMAKE_ARGS", raising=False)
    monkeypatch.setenv("SKBUILD_CMAKE_DEFINE", "CMAKE_DISABLE_FIND_PACKAGE_%s=TRUE" % package)
    text = cudamem_backend.prerequisite_problem(cmake=shutil.which("cmake"))
    if package == "Microsoft.GSL" and text is not None and "CUDA Toolkit" in text:
        pytest.skip("no CUDA Toolkit here: GSL is checked after it")
    assert text is not None and text.startswith(expected)
    assert "\n" not in text and "CMake Error" not in text
