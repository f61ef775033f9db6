"""The build backend pip runs for `pip install ./python` and `pip wheel ./python`:
scikit-build-core, after a check of what building libcudamem_c needs from the machine.

Why. Without the check, a missing CUDA Toolkit or Microsoft GSL stops the build deep inside
CMake, whose message ("Could not find a package configuration file provided by
"Microsoft.GSL"...", its search paths, the CMake call that failed) says nothing a Python user
can act on. Here each missing prerequisite is one sentence saying what to install, and nothing
else is printed:

  - a Python older than the package supports (pip itself refuses it first, from
    requires-python, for `pip install`; this covers builds that skip that check);
  - the CUDA Toolkit (12.5 or newer) and Microsoft GSL: found by configuring
    ../cmake/check (no language, no compiler: a fraction of a second) with the settings the
    real build gets (CMAKE_PREFIX_PATH and CUDAToolkit_ROOT from the environment,
    `-C cmake.define.X=...`, SKBUILD_CMAKE_DEFINE, SKBUILD_CMAKE_ARGS, CMAKE_ARGS). Its
    output is kept; the sentence it wrote (cmake/prerequisites.cmake) is printed alone.

Every hook is scikit-build-core's; build_wheel and build_editable check first. The wheel holds
the package and libcudamem_c only: installing it needs no compiler, toolkit or GSL.
"""
import os
import shlex
import shutil
import subprocess
import sys
import tempfile

from scikit_build_core import build as _scikit_build

MINIMUM_PYTHON = (3, 9)  # keep in step with requires-python in ../pyproject.toml

_HERE = os.path.dirname(os.path.abspath(__file__))
_CHECK_PROJECT = os.path.join(os.path.dirname(_HERE), "cmake", "check")

# The hooks that need no check are scikit-build-core's own.
get_requires_for_build_sdist = _scikit_build.get_requires_for_build_sdist
get_requires_for_build_wheel = _scikit_build.get_requires_for_build_wheel
get_requires_for_build_editable = _scikit_build.get_requires_for_build_editable
prepare_metadata_for_build_wheel = _scikit_build.prepare_metadata_for_build_wheel
prepare_metadata_for_build_editable = _scikit_build.prepare_metadata_for_build_editable
build_sdist = _scikit_build.build_sdist


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    _stop_if_missing(config_settings)
    return _scikit_build.build_wheel(wheel_directory, config_settings, metadata_directory)


def build_editable(wheel_directory, config_settings=None, metadata_directory=None):
    _stop_if_missing(config_settings)
    return _scikit_build.build_editable(wheel_directory, config_settings, metadata_directory)


def python_problem(version=None):
    """The sentence for a Python this package does not support, or None."""
    version = tuple(version or sys.version_info[:3])
    if version[:2] >= MINIMUM_PYTHON:
        return None
    return ("cudamem: Python %s is not supported: cudamem needs Python %s or newer; run pip "
            "with a newer Python (python3.12 -m pip install ./python)."
            % (".".join(str(v) for v in version), ".".join(str(v) for v in MINIMUM_PYTHON)))


def prerequisite_problem(config_settings=None, cmake=None):
    """The sentence for the first prerequisite missing (Python, CUDA Toolkit, GSL), or None."""
    problem = python_problem()
    if problem:
        return problem
    cmake = cmake or _cmake_program()
    if cmake is None:
        return None  # scikit-build-core finds or installs CMake itself, and says so if it cannot
    with tempfile.TemporaryDirectory(prefix="cudamem-check-") as build:
        done = subprocess.run([cmake, "-S", _CHECK_PROJECT, "-B", build]
                              + cmake_definitions(config_settings),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if done.returncode == 0:
            return None
        missing = os.path.join(build, "cudamem-missing.txt")
        if os.path.exists(missing):
            with open(missing) as f:
                return f.read().strip()
        # Not a prerequisite we know: the real build will fail the same way and say why.
        return None


def cmake_definitions(config_settings=None, environ=None):
    """The -D settings the real build gets, for the check: from pip's config settings
    (cmake.define.NAME=VALUE, cmake.args) and the environment (SKBUILD_CMAKE_DEFINE,
    SKBUILD_CMAKE_ARGS, CMAKE_ARGS), in the order scikit-build-core applies them."""
    environ = os.environ if environ is None else environ
    out = []
    for item in shlex.split(environ.get("CMAKE_ARGS", "")):
        if item.startswith("-D"):
            out.append(item)
    for item in environ.get("SKBUILD_CMAKE_ARGS", "").split(";"):
        if item.startswith("-D"):
            out.append(item)
    for item in environ.get("SKBUILD_CMAKE_DEFINE", "").split(";"):
        if "=" in item:
            out.append("-D" + item.strip())
    for key, value in (config_settings or {}).items():
        if key.startswith("cmake.define."):
            out.append("-D%s=%s" % (key[len("cmake.define."):], value))
        elif key in ("cmake.args", "cmake-args"):
            values = value if isinstance(value, list) else value.split(";")
            out.extend(v for v in values if v.startswith("-D"))
    return out


def _cmake_program():
    """The CMake the build will use: the `cmake` package scikit-build-core asked pip for when
    the machine's is missing or too old, else the machine's."""
    try:
        import cmake  # noqa: PLC0415  (PyPI's cmake, in pip's build environment)
        candidate = os.path.join(cmake.CMAKE_BIN_DIR, "cmake")
        if os.path.exists(candidate):
            return candidate
    except ImportError:
        pass
    return shutil.which("cmake")


def _stop_if_missing(config_settings):
    problem = prerequisite_problem(config_settings)
    if problem:
        print(problem, file=sys.stderr, flush=True)
        raise SystemExit(1)
