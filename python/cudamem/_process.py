"""Allocator 0, the process-wide one, shared by cudamem.torch.install(),
cudamem.cupy.install() and cudamem.numba.install(): the first install configures it, later
ones must agree with it. Numba can also load cudamem.numba by name (NUMBA_CUDA_MEMORY_MANAGER)
with no install() at all: then allocator 0 keeps what the CUDAMEM_* environment variables
say, and is adopted as set up by that first use (adopt_environment)."""
import threading

from . import _native
from ._errors import StateError

_lock = threading.Lock()
_settings = None  # (resource, options) of the first install
_first_caller = None


def claim(caller, resource, options):
    """Configures allocator 0 for `caller`, or checks that it already has these settings."""
    global _settings, _first_caller
    text = _native.config_text(caller, resource, options)  # TypeError/ValueError first
    wanted = (resource, {k: str(v) for k, v in options.items() if v is not None})
    with _lock:
        if _settings is not None:
            if _settings != wanted:
                raise StateError(
                    "%s: cudamem's process-wide allocator was already set up by %s with "
                    "resource=%r and %s; a second install with other options (resource=%r, %s) "
                    "cannot change it. Pass the same options, or none of them differently."
                    % (caller, _first_caller, _settings[0], _settings[1] or "no options",
                       wanted[0], wanted[1] or "no options"))
            return
        _native.configure(0, text)
        _settings = wanted
        _first_caller = caller


def settings():
    """(resource, options) of the first install, or None."""
    with _lock:
        return _settings


def adopt_environment(caller):
    """Marks allocator 0 as set up by `caller` with the configuration in force (defaults and
    CUDAMEM_* environment variables), unless an install() set it up already. Later installs
    must then ask for its resource and no other options, as after a first install() that
    passed none."""
    global _settings, _first_caller
    with _lock:
        if _settings is not None:
            return
        config = dict(item.split("=", 1) for item in _native.describe(0).split(", "))
        _settings = (config["resource"], {})
        _first_caller = caller
