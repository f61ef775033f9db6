"""The ctypes layer over libcudamem_c, on simulated devices: runs anywhere, no GPU needed."""
import os
import subprocess
import sys
import textwrap

import pytest

import cudamem
from cudamem import _native

MiB = 1 << 20
GiB = 1 << 30


@pytest.fixture
def simulated():
    """An allocator over simulated 4 GiB devices, destroyed afterwards."""
    allocator_id = _native.create("resource=vm_pool, simulate_bytes=4GiB")
    yield allocator_id
    _native.destroy(allocator_id)


def test_version_and_library():
    assert _native.version() == cudamem.__version__
    assert _native.library_path().endswith((".so",)) or ".so." in _native.library_path()


def test_allocate_free_and_stats(simulated):
    ptrs = [_native.allocate(simulated, 3 * MiB, 0, None) for _ in range(4)]
    assert all(p % 256 == 0 and p != 0 for p in ptrs)
    big = _native.allocate(simulated, 256 * MiB, 0, None)
    s = _native.stats(simulated, 0)
    assert s["in_use_bytes"] == 4 * 3 * MiB + 256 * MiB
    assert s["allocations"] == 5
    assert s["reserved_bytes"] >= s["in_use_bytes"]
    assert s["limit_bytes"] is None
    assert s["largest_free_block"] is not None
    _native.deallocate(simulated, big, 256 * MiB, 0, None)
    for p in ptrs:
        _native.deallocate(simulated, p, 3 * MiB, 0, None)
    s = _native.stats(simulated, 0)
    assert s["in_use_bytes"] == 0
    assert s["peak_in_use_bytes"] == 4 * 3 * MiB + 256 * MiB
    assert _native.release(simulated) > 0
    assert _native.stats(simulated, 0)["reserved_bytes"] == 0
    assert _native.allocate(simulated, 0, 0, None) == 0


def test_stats_count_compactions():
    """A 128 MiB block in 64 MiB holes, on a device at its 1 GiB reserve: one compaction,
    chosen to keep the reserve; simulated memory is not stream-ordered, so no waits."""
    allocator_id = _native.create("resource=vm_pool, simulate_bytes=2GiB, grow_ahead_bytes=0")
    try:
        blocks = [_native.allocate(allocator_id, 64 * MiB, 0, None) for _ in range(16)]
        for p in blocks[::2]:
            _native.deallocate(allocator_id, p, 64 * MiB, 0, None)
        assert _native.stats(allocator_id, 0)["compactions"] == 0
        big = _native.allocate(allocator_id, 128 * MiB, 0, None)
        s = _native.stats(allocator_id, 0)
        assert s["compactions"] == 1
        assert s["kept_free_compactions"] == 1
        assert s["bulk_declined"] == 0  # the bulk handles grew above the reserve for each
        assert (s["stream_waits"], s["host_waits"], s["device_syncs"]) == (0, 0, 0)
        _native.deallocate(allocator_id, big, 128 * MiB, 0, None)
        for p in blocks[1::2]:
            _native.deallocate(allocator_id, p, 64 * MiB, 0, None)
    finally:
        _native.destroy(allocator_id)


def test_stats_count_recent_reuses():
    """A large block freed on a stream is the next one of its size there (recent_frees),
    once the device holds enough for it to be kept aside; recent_frees=0 keeps none, and a
    count past 256 is refused."""
    stream = 0x10
    for config, reuses in (("", 1), (", recent_frees=0", 0)):
        allocator_id = _native.create("resource=vm_pool, simulate_bytes=4GiB, "
                                      "grow_ahead_bytes=0" + config)
        try:
            body = _native.allocate(allocator_id, 1500 * MiB, 0, stream)
            p = _native.allocate(allocator_id, 24 * MiB, 0, stream)
            _native.deallocate(allocator_id, p, 24 * MiB, 0, stream)
            q = _native.allocate(allocator_id, 24 * MiB, 0, stream)
            assert q == p
            assert _native.stats(allocator_id, 0)["recent_reuses"] == reuses
            _native.deallocate(allocator_id, q, 24 * MiB, 0, stream)
            _native.deallocate(allocator_id, body, 1500 * MiB, 0, stream)
        finally:
            _native.destroy(allocator_id)
    with pytest.raises(cudamem.ConfigError, match="recent_frees=1000"):
        _native.create("resource=vm_pool, simulate_bytes=1GiB, recent_frees=1000")
    with pytest.raises(ValueError, match="applies to resource=vm_pool only"):
        _native.create("resource=pool, simulate_bytes=1GiB, recent_frees=4")


def test_out_of_memory_carries_the_report(simulated):
    with pytest.raises(cudamem.OutOfMemoryError) as caught:
        _native.allocate(simulated, 5 * GiB, 0, None)
    text = str(caught.value)
    assert "could not allocate 5.00 GiB" in text
    assert "Verdict: larger_than_device" in text
    assert isinstance(caught.value, MemoryError)
    assert _native.last_oom_report(simulated) == text
    p = _native.allocate(simulated, MiB, 0, None)  # and it goes on
    assert "vm_pool_resource" in _native.report(simulated, 0)
    _native.deallocate(simulated, p, MiB, 0, None)


def test_bad_input_is_a_typed_exception(simulated):
    with pytest.raises(cudamem.ConfigError, match="device 8 does not exist"):
        _native.allocate(simulated, MiB, 8, None)
    with pytest.raises(ValueError, match="never allocated"):
        _native.deallocate(simulated, 4096, MiB, 3, None)
    with pytest.raises(cudamem.ConfigError, match="no allocator 99"):
        _native.stats(99, 0)
    with pytest.raises(cudamem.ConfigError, match="unknown resource"):
        _native.create("resource=heap")
    p = _native.allocate(simulated, MiB, 0, None)
    with pytest.raises(cudamem.StateError, match="configured at its first allocation"):
        _native.configure(simulated, "limit_bytes=1GiB")
    with pytest.raises(cudamem.StateError, match="still has"):
        _native.destroy(simulated)
    _native.deallocate(simulated, p, MiB, 0, None)


def test_config_text_checks_names_and_types_in_python():
    text = _native.config_text("f()", "pool", {"limit_bytes": "8GiB", "grow_ahead_bytes": None})
    assert text == "resource=pool, limit_bytes=8GiB"
    with pytest.raises(TypeError, match="unexpected keyword argument 'limit'"):
        _native.config_text("f()", "pool", {"limit": 1})
    with pytest.raises(TypeError, match="limit_bytes must be an int .* not float"):
        _native.config_text("f()", "pool", {"limit_bytes": 1.5})
    with pytest.raises(TypeError, match="not bool"):
        _native.config_text("f()", "pool", {"limit_bytes": True})
    with pytest.raises(TypeError, match="resource must be a str"):
        _native.config_text("f()", 3, {})
    with pytest.raises(ValueError, match="must not be negative"):
        _native.config_text("f()", "pool", {"limit_bytes": -1})
    with pytest.raises(ValueError, match="is not a size"):
        _native.config_text("f()", "pool", {"limit_bytes": "1GiB,resource=async"})
    # Values are parsed by the library: a bad one is a ValueError naming it.
    with pytest.raises(ValueError, match="limit_bytes=8GB .* not a size"):
        _native.create(_native.config_text("f()", "pool", {"limit_bytes": "8GB"}))
    with pytest.raises(ValueError, match="applies to resource=vm_pool only"):
        _native.create(_native.config_text("f()", "pool", {"grow_ahead_bytes": 0}))
    with pytest.raises(ValueError, match="keep_free_bytes .* applies to resource=vm_pool only"):
        _native.create(_native.config_text("f()", "async", {"keep_free_bytes": "1GiB"}))
    with pytest.raises(TypeError, match="keep_free_bytes must be an int"):
        _native.config_text("f()", "vm_pool", {"keep_free_bytes": 0.5})
    with pytest.raises(ValueError, match="bulk_handle_bytes=6291456 .* must be 0 or a multiple "
                                         "of the handle size"):
        _native.create(_native.config_text("f()", "vm_pool", {"bulk_handle_bytes": "6MiB"}))


def test_recent_frees_is_a_count():
    text = _native.config_text("f()", "vm_pool", {"recent_frees": 4})
    assert text == "resource=vm_pool, recent_frees=4"
    allocator_id = _native.create(text + ", simulate_bytes=1GiB")
    _native.destroy(allocator_id)
    for value in ("4", 4.0, True):
        with pytest.raises(TypeError, match="recent_frees must be an int \\(a count\\), not"):
            _native.config_text("f()", "vm_pool", {"recent_frees": value})
    with pytest.raises(ValueError, match="must not be negative"):
        _native.config_text("f()", "vm_pool", {"recent_frees": -1})
    with pytest.raises(ValueError, match="recent_frees=257"):
        _native.create(_native.config_text("f()", "vm_pool", {"recent_frees": 257,
                                                              "simulate_bytes": "1GiB"}))
    with pytest.raises(TypeError, match="options: .*recent_frees"):
        _native.config_text("f()", "vm_pool", {"recent_free": 4})


def test_every_bad_option_is_a_config_error():
    # One type to catch for a bad configuration; a wrong name or type is also a TypeError, as
    # Python's own for a bad keyword argument, a bad value also a ValueError.
    for options in ({"limit": 1}, {"limit_bytes": 1.5}, {"limit_bytes": -1}):
        with pytest.raises(cudamem.ConfigError):
            _native.config_text("f()", "pool", options)
    with pytest.raises(cudamem.ConfigError):
        _native.config_text("f()", 3, {})
    with pytest.raises(cudamem.ConfigError):
        _native.create(_native.config_text("f()", "heap", {}))
    with pytest.raises(cudamem.ConfigError) as raised:
        _native.config_text("f()", "pool", {"limit": 1})
    assert isinstance(raised.value, TypeError) and isinstance(raised.value, ValueError)


def test_cudamem_stats_is_the_process_wide_allocators():
    # Allocator 0 over a simulated device (the environment configures it: a fresh process, with
    # the package this one imports, installed or not).
    code = textwrap.dedent("""
        import cudamem
        from cudamem import _native
        p = _native.allocate(0, 3 << 20, 0, None)
        print("counted", cudamem.stats(0)["in_use_bytes"] == 3 << 20,
              cudamem.stats(device=0) == _native.stats(0, 0))
        for bad in ("0", 1.5, True, None.__class__):
            try:
                cudamem.stats(bad)
            except TypeError as e:
                print("TypeError", str(e))
        try:
            cudamem.stats(99)
        except cudamem.ConfigError as e:
            print("ConfigError", "device 99 does not exist" in str(e))
        try:
            print("current", cudamem.stats()["device"])   # a GPU: this thread's device, 0
        except cudamem.NoDeviceError as e:
            print("current", "no usable CUDA device" in str(e))
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=dict(os.environ, CUDAMEM_SIMULATE_BYTES="4GiB"), timeout=120)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "counted True True" in out
    assert out.count("TypeError cudamem.stats: device must be an int") == 4, out
    assert "ConfigError True" in out
    assert "current 0" in out or "current True" in out


def test_keep_free_bytes_is_configured_and_described():
    allocator_id = _native.create(_native.config_text(
        "f()", "vm_pool", {"simulate_bytes": "2GiB", "keep_free_bytes": "512MiB"}))
    try:
        assert "keep_free_bytes=536870912" in _native.describe(allocator_id)
    finally:
        _native.destroy(allocator_id)


def test_bulk_handle_bytes_is_configured_and_described():
    allocator_id = _native.create(_native.config_text(
        "f()", "vm_pool", {"simulate_bytes": "2GiB", "bulk_handle_bytes": "64MiB"}))
    try:
        assert "bulk_handle_bytes=67108864" in _native.describe(allocator_id)
    finally:
        _native.destroy(allocator_id)


def test_describe_and_limit():
    allocator_id = _native.create("resource=pool, simulate_bytes=2GiB, limit_bytes=64MiB")
    try:
        assert _native.describe(allocator_id) == (
            "resource=pool, limit_bytes=67108864, simulate_bytes=2147483648, raise_on_oom=1")
        p = _native.allocate(allocator_id, 60 * MiB, 0, None)
        with pytest.raises(cudamem.OutOfMemoryError, match="Verdict: budget"):
            _native.allocate(allocator_id, 8 * MiB, 0, None)
        assert _native.stats(allocator_id, 0)["limit_bytes"] == 64 * MiB
        _native.deallocate(allocator_id, p, 60 * MiB, 0, None)
    finally:
        _native.destroy(allocator_id)
