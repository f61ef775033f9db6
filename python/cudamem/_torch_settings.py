"""What cudamem.torch.install() says before it makes cudamem PyTorch's allocator, without
importing PyTorch (so that it is tested where there is none): which interface was asked for, the
sentence an unsupported or unbuildable PyTorch gets, and the PYTORCH_CUDA_ALLOC_CONF settings
cudamem does not apply, each named with what cudamem does instead.

    interface = chosen_interface(None)                     # "full", or "pluggable" if asked
    for text in unapplied_settings(os.environ, (2, 11)):   # one sentence per setting
        warnings.warn(text, RuntimeWarning)

Settings PyTorch reads (c10/cuda/CUDAAllocatorConfig.h and c10/core/AllocatorConfig.h of 2.7 to
2.15) and what becomes of them under cudamem:
- applied by cudamem's allocator: roundup_power2_divisions (requests rounded as PyTorch rounds),
  graph_capture_record_stream_reuse (2.9+), per_process_memory_fraction (2.10+),
  throw_on_cudamalloc_oom (2.12+: cudamem always refuses a request past the fraction before it
  allocates), release_lock_on_cudamalloc (cudamem never holds its lock over a device
  allocation);
- still PyTorch's: pinned_* (its pinned host memory allocator, which cudamem does not replace);
- not applied, with a warning naming what cudamem does instead: the rest (UNAPPLIED).
"""
import os

from . import _torch_build

INTERFACES = ("full", "pluggable")

# What the pluggable interface lacks (PyTorch raises "does not yet support" for each).
PLUGGABLE_LACKS = ("memory statistics, snapshots, CUDA graphs and torch.compile's "
                   "reduce-overhead mode, cuDNN's benchmark mode, the memory fraction and "
                   "sending tensors to other processes")

APPLIED = frozenset({"roundup_power2_divisions", "graph_capture_record_stream_reuse",
                     "per_process_memory_fraction", "throw_on_cudamalloc_oom",
                     "release_lock_on_cudamalloc"})

_SPLITTING = ("cudamem's pools place each request in free memory, so no cached block is split "
              "or served oversized")
UNAPPLIED = {
    "backend": "cudamem is the allocator, whichever backend is named",
    "expandable_segments": "cudamem's resource decides how memory is mapped (vm_pool grows and "
                           "shrinks virtual memory as expandable segments do)",
    "expandable_segments_reserve": "vm_pool reserves its own virtual address range",
    "expandable_segments_reserve_by_class": "vm_pool reserves its own virtual address range",
    "max_split_size_mb": _SPLITTING,
    "max_non_split_rounding_mb": _SPLITTING,
    "garbage_collection_threshold": "cudamem gives free memory back at "
                                    "torch.cuda.empty_cache() and when a request needs it "
                                    "(install(limit_bytes=...) sets a budget)",
    "large_segment_size_mb": "cudamem's handle sizes apply (install(handle_bytes=..., "
                             "bulk_handle_bytes=...))",
}


def chosen_interface(interface, environ=os.environ):
    """"full" (PyTorch's whole allocator interface, compiled) or "pluggable" (PyTorch's
    pluggable subset): the argument, else "pluggable" where CUDAMEM_TORCH_GLUE=0."""
    if interface is None:
        return "pluggable" if environ.get("CUDAMEM_TORCH_GLUE", "1") == "0" else "full"
    if not isinstance(interface, str):
        raise TypeError("cudamem.torch.install(): interface must be a str (%s), not %s"
                        % (" or ".join(INTERFACES), type(interface).__name__))
    if interface not in INTERFACES:
        raise ValueError("cudamem.torch.install(): interface=%r is not one of %s"
                         % (interface, ", ".join(INTERFACES)))
    return interface


def _upper_release():
    major, minor = _torch_build.SUPPORTED[1]
    return "%d.%d" % (major, minor + 1)


def cannot_build_sentence(torch_version, why, unsupported=False):
    """The one sentence install() raises when the full interface cannot be had."""
    low = "%d.%d" % _torch_build.SUPPORTED[0]
    what_to_do = ('install a supported release (pip install "torch>=%s,<%s")'
                  % (low, _upper_release()) if unsupported else why)
    head = ("cudamem.torch supports PyTorch %s, and this is PyTorch %s"
            % (_torch_build.supported_text(), torch_version) if unsupported else
            "cudamem.torch cannot build its PyTorch allocator for PyTorch %s (it supports %s)"
            % (torch_version, _torch_build.supported_text()))
    return ("%s: %s, or call cudamem.torch.install(interface=\"pluggable\") for PyTorch's "
            "pluggable interface, which lacks %s." % (head, what_to_do, PLUGGABLE_LACKS))


def pluggable_warning(reason):
    """The warning of the pluggable interface, asked for: what will not work."""
    return ("cudamem.torch: PyTorch's allocator interface is served in part only (%s): a failed "
            "allocation raises RuntimeError with cudamem's report, and %s are not available "
            "(PyTorch raises \"does not yet support\")." % (reason, PLUGGABLE_LACKS))


def _split(conf):
    """"a:1,b:[2:3,4:5]" -> [("a", "1"), ("b", "[2:3,4:5]")]: commas inside brackets kept."""
    items, depth, start = [], 0, 0
    for i, c in enumerate(conf + ","):
        if c == "[":
            depth += 1
        elif c == "]":
            depth = max(depth - 1, 0)
        elif c == "," and depth == 0:
            item = conf[start:i].strip()
            if item:
                key, _, value = item.partition(":")
                items.append((key.strip(), value.strip()))
            start = i + 1
    return items


def unapplied_settings(environ, release):
    """One sentence for each setting of PyTorch's allocator configuration cudamem does not
    apply, in the variables the release reads (PYTORCH_ALLOC_CONF from 2.9, and
    PYTORCH_CUDA_ALLOC_CONF). Keys PyTorch does not know are left to PyTorch, which refuses
    them itself."""
    names = ["PYTORCH_CUDA_ALLOC_CONF"]
    if tuple(release) >= (2, 9):
        names.insert(0, "PYTORCH_ALLOC_CONF")
    sentences, seen = [], set()
    for name in names:
        for key, value in _split(environ.get(name, "")):
            if key in seen or key not in UNAPPLIED:
                continue
            seen.add(key)
            sentences.append("cudamem.torch: %s's %s:%s is not applied under cudamem: %s."
                             % (name, key, value, UNAPPLIED[key]))
    return sentences
