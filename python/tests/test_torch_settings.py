"""cudamem.torch.install()'s choices and refusals without a GPU and without PyTorch: the interface
asked for, the sentence an unsupported or unbuildable PyTorch gets (install() run against a
stand-in `torch` module that has only a version), the PYTORCH_CUDA_ALLOC_CONF settings cudamem
does not apply, and the build's list of sources. Runs in the host suite (run_suite.py host)."""
import os
import subprocess
import sys
import textwrap
import warnings

import pytest

from conftest import PACKAGE_ROOT

sys.path.insert(0, PACKAGE_ROOT)
from cudamem import _torch_build, _torch_settings  # noqa: E402

UNSUPPORTED = ('cudamem.torch supports PyTorch 2.7 to 2.15, and this is PyTorch 2.6.0: install a '
               'supported release (pip install "torch>=2.7,<2.16"), or call '
               'cudamem.torch.install(interface="pluggable") for PyTorch\'s pluggable '
               'interface, which lacks memory statistics, snapshots, CUDA graphs and '
               'torch.compile\'s reduce-overhead mode, cuDNN\'s benchmark mode, the memory '
               'fraction and sending tensors to other processes.')


# --- the interface ------------------------------------------------------------------------------

def test_the_full_interface_unless_the_pluggable_one_is_asked_for():
    assert _torch_settings.chosen_interface(None, {}) == "full"
    assert _torch_settings.chosen_interface(None, {"CUDAMEM_TORCH_GLUE": "1"}) == "full"
    assert _torch_settings.chosen_interface(None, {"CUDAMEM_TORCH_GLUE": "0"}) == "pluggable"
    assert _torch_settings.chosen_interface("pluggable", {}) == "pluggable"
    assert _torch_settings.chosen_interface("full", {"CUDAMEM_TORCH_GLUE": "0"}) == "full"


def test_a_bad_interface_is_refused():
    with pytest.raises(TypeError, match="interface must be a str"):
        _torch_settings.chosen_interface(1, {})
    with pytest.raises(ValueError, match="interface='cuda' is not one of full, pluggable"):
        _torch_settings.chosen_interface("cuda", {})


# --- PYTORCH_CUDA_ALLOC_CONF -----------------------------------------------------------------------

def test_each_unapplied_setting_is_named_with_what_cudamem_does_instead():
    conf = ("expandable_segments:True,max_split_size_mb:128,"
            "roundup_power2_divisions:[256:1,512:2,>:8],garbage_collection_threshold:0.6,"
            "pinned_use_background_threads:True,backend:cudaMallocAsync")
    said = _torch_settings.unapplied_settings({"PYTORCH_CUDA_ALLOC_CONF": conf}, (2, 11))
    assert said == [
        "cudamem.torch: PYTORCH_CUDA_ALLOC_CONF's expandable_segments:True is not applied under "
        "cudamem: cudamem's resource decides how memory is mapped (vm_pool grows and shrinks "
        "virtual memory as expandable segments do).",
        "cudamem.torch: PYTORCH_CUDA_ALLOC_CONF's max_split_size_mb:128 is not applied under "
        "cudamem: cudamem's pools place each request in free memory, so no cached block is "
        "split or served oversized.",
        "cudamem.torch: PYTORCH_CUDA_ALLOC_CONF's garbage_collection_threshold:0.6 is not "
        "applied under cudamem: cudamem gives free memory back at torch.cuda.empty_cache() and "
        "when a request needs it (install(limit_bytes=...) sets a budget).",
        "cudamem.torch: PYTORCH_CUDA_ALLOC_CONF's backend:cudaMallocAsync is not applied under "
        "cudamem: cudamem is the allocator, whichever backend is named.",
    ]


def test_applied_and_host_allocator_settings_get_no_warning():
    conf = ("roundup_power2_divisions:4,graph_capture_record_stream_reuse:True,"
            "per_process_memory_fraction:0.5,throw_on_cudamalloc_oom:True,"
            "release_lock_on_cudamalloc:True,pinned_use_cuda_host_register:True,"
            "pinned_num_register_threads:8")
    assert _torch_settings.unapplied_settings({"PYTORCH_CUDA_ALLOC_CONF": conf}, (2, 15)) == []
    assert _torch_settings.unapplied_settings({}, (2, 15)) == []


def test_pytorch_alloc_conf_counts_from_2_9_and_a_key_is_named_once():
    env = {"PYTORCH_ALLOC_CONF": "expandable_segments:True",
           "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False,max_split_size_mb:64"}
    new = _torch_settings.unapplied_settings(env, (2, 9))
    assert [s.split(" is not")[0] for s in new] == [
        "cudamem.torch: PYTORCH_ALLOC_CONF's expandable_segments:True",
        "cudamem.torch: PYTORCH_CUDA_ALLOC_CONF's max_split_size_mb:64"]
    old = _torch_settings.unapplied_settings(env, (2, 8))  # 2.8 reads PYTORCH_CUDA_ALLOC_CONF only
    assert [s.split(" is not")[0] for s in old] == [
        "cudamem.torch: PYTORCH_CUDA_ALLOC_CONF's expandable_segments:False",
        "cudamem.torch: PYTORCH_CUDA_ALLOC_CONF's max_split_size_mb:64"]


def test_every_setting_of_pytorch_is_classified():
    """The keys PyTorch 2.7-2.15 parse (their headers' CUDAAllocatorConfig and
    AcceleratorAllocatorConfig) are each applied, PyTorch's own (pinned_*), or warned about."""
    keys = ["max_split_size_mb", "max_non_split_rounding_mb", "garbage_collection_threshold",
            "roundup_power2_divisions", "expandable_segments", "release_lock_on_cudamalloc",
            "backend", "graph_capture_record_stream_reuse", "per_process_memory_fraction",
            "throw_on_cudamalloc_oom", "large_segment_size_mb", "expandable_segments_reserve",
            "expandable_segments_reserve_by_class"]
    for key in keys:
        assert (key in _torch_settings.APPLIED) != (key in _torch_settings.UNAPPLIED), key


# --- the build ---------------------------------------------------------------------------------------

def test_the_build_key_covers_every_source_file():
    on_disk = sorted(f for f in os.listdir(_torch_build.SOURCE_DIR)
                     if f.endswith((".cpp", ".hpp")))
    assert sorted(_torch_build.SOURCES) == on_disk


def test_the_wheel_check_expects_the_same_sources():
    import run_suite
    expected = {"cudamem/_torch/" + name for name in _torch_build.SOURCES}
    expected.add("cudamem/include/cudamem_c.h")
    assert run_suite.TORCH_ALLOCATOR_SOURCES == expected


def test_each_release_gets_the_standard_its_headers_need():
    def install(version):
        return _torch_build.TorchInstall("/nowhere", version, True, "13.0")
    assert _torch_build.cxx_standard(install("2.7.1+cu126")) == "c++17"
    assert _torch_build.cxx_standard(install("2.13.0")) == "c++17"
    assert _torch_build.cxx_standard(install("2.14.1+cu130")) == "c++20"
    assert _torch_build.cxx_standard(install("2.15.0")) == "c++20"
    assert _torch_build.cxx_standard(install("3.0.0")) == "c++20"
    with pytest.raises(_torch_build.UnsupportedTorch, match="this is PyTorch 2.6.0"):
        _torch_build.check_supported(install("2.6.0"))
    _torch_build.check_supported(install("2.16.0.dev20270101"))  # newer: tried


def test_cuda_headers_of_another_major_version_are_refused(tmp_path, monkeypatch):
    headers = tmp_path / "include"
    headers.mkdir()
    (headers / "cuda_runtime_api.h").write_text("#define CUDART_VERSION 13000\n")
    monkeypatch.setenv("CUDA_HOME", str(tmp_path))
    assert _torch_build.cuda_include_dir("13.0") == str(headers)
    monkeypatch.setattr(sys, "path", [])
    monkeypatch.setenv("PATH", "")
    if os.path.isfile("/usr/local/cuda/include/cuda_runtime_api.h"):
        with open("/usr/local/cuda/include/cuda_runtime_api.h") as f:
            if "#define CUDART_VERSION 11" in f.read():
                pytest.skip("a CUDA 11 toolkit in /usr/local/cuda")
    with pytest.raises(_torch_build.BuildError, match="PyTorch was built for CUDA 11.8, and the "
                       "CUDA runtime headers found are CUDA 13's"):
        _torch_build.cuda_include_dir("11.8")


# --- install() refuses, in one sentence, before anything is allocated -----------------------------

def run_install(tmp_path, version, cuda="13.0", env=None, call="ct.install()"):
    """install() in a fresh interpreter whose `torch` is a stand-in of that version (enough for
    what install() reads before it builds); what it printed."""
    fake = tmp_path / "fake"
    (fake / "torch").mkdir(parents=True, exist_ok=True)
    (fake / "torch" / "__init__.py").write_text(textwrap.dedent("""
        import types
        __version__ = %r
        version = types.SimpleNamespace(cuda=%r)
        _C = types.SimpleNamespace(_GLIBCXX_USE_CXX11_ABI=True)
    """ % (version, cuda)))
    code = textwrap.dedent("""
        import warnings, cudamem, cudamem.torch as ct
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                %s
                print("installed")
            except (cudamem.TorchAllocatorError, cudamem.StateError, TypeError,
                    ValueError) as e:
                print("refused:", e)
                print("type:", type(e).__name__)
        for w in caught:
            print("warned:", w.message)
        print("is_installed", ct.is_installed())
    """ % call)
    child = dict(os.environ)
    child["PYTHONPATH"] = os.pathsep.join([str(fake), PACKAGE_ROOT])
    child["CUDAMEM_CACHE_DIR"] = str(tmp_path / "cache")
    child.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    child.pop("PYTORCH_ALLOC_CONF", None)
    child.update(env or {})
    done = subprocess.run([sys.executable, "-c", code], env=child, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


needs_library = pytest.mark.skipif(not os.environ.get("CUDAMEM_C_LIBRARY"),
                                   reason="needs libcudamem_c (CUDAMEM_C_LIBRARY)")


@needs_library
def test_timing_the_calls_refuses_a_non_bool_and_wants_install_first(tmp_path):
    out = run_install(tmp_path, "2.11.0+cu130", call="ct.time_calls('yes')")
    assert "refused: enabled must be a bool, not str\ntype: TypeError\n" in out
    for call in ("ct.time_calls(True)", "ct.call_times()"):
        out = run_install(tmp_path, "2.11.0+cu130", call=call)
        assert "type: StateError" in out
        assert "install() has not been called" in out


@needs_library
def test_an_unsupported_release_gets_one_sentence_at_install(tmp_path):
    out = run_install(tmp_path, "2.6.0+cu124",
                      env={"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"})
    assert "refused: " + UNSUPPORTED.replace("2.6.0", "2.6.0+cu124") + "\n" in out
    assert "warned: cudamem.torch: PYTORCH_CUDA_ALLOC_CONF's expandable_segments:True is not " \
           "applied under cudamem" in out
    assert "is_installed False" in out


@needs_library
def test_no_compiler_is_one_sentence_naming_it(tmp_path):
    env = {"PATH": str(tmp_path / "empty"), "CUDAMEM_CXX": "", "CXX": ""}
    out = run_install(tmp_path, "2.11.0+cu130", env=env)
    assert "refused: cudamem.torch cannot build its PyTorch allocator for PyTorch 2.11.0+cu130 " \
           "(it supports 2.7 to 2.15): no C++ compiler that links libstdc++ as a shared " \
           "library (install g++, or name one in CUDAMEM_CXX), or call " \
           "cudamem.torch.install(interface=\"pluggable\")" in out
    assert "is_installed False" in out
    out = run_install(tmp_path, "2.11.0+cu130", env={"CUDAMEM_CXX": "/nonexistent/g++"})
    assert "refused: cudamem.torch cannot build its PyTorch allocator for PyTorch 2.11.0+cu130 " \
           "(it supports 2.7 to 2.15): the C++ compiler /nonexistent/g++ could not be run" in out


@needs_library
def test_cuda_headers_of_another_version_are_one_sentence(tmp_path):
    out = run_install(tmp_path, "2.11.0+cu118", cuda="11.8",
                      env={"CUDA_HOME": str(tmp_path / "no-toolkit")})
    if "refused: " not in out and "/usr/local/cuda" in out:
        pytest.skip("CUDA 11 headers on this machine")
    assert "refused: cudamem.torch cannot build its PyTorch allocator for PyTorch " \
           "2.11.0+cu118 (it supports 2.7 to 2.15): PyTorch was built for CUDA 11.8, and the " \
           "CUDA runtime headers found are CUDA" in out


@needs_library
def test_a_bad_interface_is_refused_at_install(tmp_path):
    out = run_install(tmp_path, "2.11.0", call='ct.install(interface="native")')
    assert "refused: cudamem.torch.install(): interface='native' is not one of full, " \
           "pluggable\ntype: ValueError" in out
    assert "is_installed False" in out


def test_the_pluggable_warning_names_what_is_missing():
    text = _torch_settings.pluggable_warning('install(interface="pluggable")')
    assert text.startswith("cudamem.torch: PyTorch's allocator interface is served in part "
                           'only (install(interface="pluggable")): a failed allocation raises '
                           "RuntimeError")
    for missing in ("memory statistics", "snapshots", "CUDA graphs", "reduce-overhead",
                    "benchmark mode", "the memory fraction", "sending tensors to other "
                    "processes"):
        assert missing in text
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # building the text warns nothing
        _torch_settings.pluggable_warning("CUDAMEM_TORCH_GLUE=0")
