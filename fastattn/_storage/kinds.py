"""The storage kinds of q, k, v and the serving caches: one table.

The table lives in C (src/kinds/fa_kinds.h), where the kernels and the compiled gates read it;
Python reads the same rows from the extension (``storage_kinds()``), so no rule about a
kind -- which dtype holds it, how many values a stored element packs (q4_0: two a byte),
how many values share a scale and which scale, the largest value it stores -- is written
twice.  Each row is a dict:

``kind``         the kernels' number for it
``name``         ``"q8_0"``, ``"q4_0"``, or the NumPy dtype's name
``dtype``        the stored array's dtype name (``ml_dtypes``' for bfloat16 and fp8)
``per_item``     values per stored element (q4_0: 2)
``block``        values that share one scale, or 0
``scale``        None, ``"float16 per block"`` or ``"float32 per tensor or kv head"``
``largest``      the largest finite stored value (fp8's saturation point, a block
                 format's largest level)
``quantisable``  a block format's largest ``|x|`` with a finite float16 scale
"""
import numpy as np

from .._machine.isa import kernel as _kernel

KINDS = _kernel.storage_kinds()
BY_NAME = {k["name"]: k for k in KINDS}
# Dtypes that exist only in ml_dtypes, recognised without importing it.
_ML_DTYPES = {k["dtype"] for k in KINDS if k["dtype"].startswith(("bfloat16", "float8"))}


def of_dtype(dtype):
    """The kind an array of ``dtype`` stores as a cache (q8_0 for int8, q4_0 for uint8), or
    None for a dtype no cache holds (float64 included: it is a compute type)."""
    try:
        dtype = np.dtype(dtype)
    except TypeError:
        return None
    name = dtype.name
    if name in _ML_DTYPES and dtype.type.__module__.split(".")[0] != "ml_dtypes":
        return None
    for k in KINDS:
        if k["dtype"] == name:
            return k
    return None


def row_values(dtype, items):
    """The values in a row of ``items`` stored elements of ``dtype`` (q4_0: twice)."""
    kind = of_dtype(dtype)
    return items * (kind["per_item"] if kind is not None else 1)
