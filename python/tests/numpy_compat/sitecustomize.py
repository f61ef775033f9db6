"""Put on PYTHONPATH by the tests (conftest.py: NUMPY_COMPAT) only where numba-cuda cannot
compile a kernel with the installed NumPy: numba-cuda 0.30 reads numpy.row_stack when it first
lowers an array operation, and NumPy 2.5 removed that alias of numpy.vstack. Then every kernel
fails under any memory manager, Numba's own included; this restores the alias so that the tests
exercise the memory manager and not that incompatibility. Nothing else changes: the module the
interpreter would have run as sitecustomize, if any, runs after this."""
import os
import sys

try:
    import numpy

    if not hasattr(numpy, "row_stack"):
        numpy.row_stack = numpy.vstack
except ImportError:
    pass

_here = os.path.dirname(os.path.abspath(__file__))
for _directory in sys.path:
    _other = os.path.join(_directory or ".", "sitecustomize.py")
    if os.path.abspath(_directory or ".") != _here and os.path.isfile(_other):
        with open(_other) as _source:
            exec(compile(_source.read(), _other, "exec"), {"__name__": "sitecustomize",
                                                        "__file__": _other})
        break
