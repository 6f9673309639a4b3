"""Between the validated front end and the compiled kernel: the arrays as the kernel reads them.

:mod:`fastattn._calls.api`, :mod:`fastattn._calls.backward` and
:mod:`fastattn.integrations.dask` hand the kernel a :class:`fastattn._calls.args.Problem`
(the call's description, which the kernel reads by name: ``_fill_problem`` in
src/calls/_problem.pxi) and the operands prepared here:

- ``kernel_ready``: q, k, v (dout, out) in the compute dtype, or 16-bit read in place;
- ``kernel_mask``: the mask as the kernel reads it;
- ``writes_in_place``, ``kernel_writes``, ``result``: whether the kernel writes the caller's
  ``out`` itself, and the result handed back when it does not.

The kernel codes of the normalised arguments ride on the Problem (``causal_code``,
``mask_code``, from ``fastattn._calls.args.CAUSAL_CODES`` / ``MASK_CODES``); fastattn._machine.isa
checks that a kernel module agrees when it loads one.
"""
import numpy as np

from . import args as _args
from .._machine.isa import kernel

__all__ = ["kernel", "kernel_layout", "kernel_ready", "kernel_mask", "writes_in_place",
           "kernel_writes", "result"]


def kernel_layout(a):
    """Whether the kernel can address ``a`` in place (the kernel's own rule)."""
    return kernel.kernel_layout(a)


def kernel_ready(a, dtype):
    """``a`` as the kernel reads it: 16-bit floats as they are, anything else cast to the
    compute dtype; copied only if the kernel cannot read it in place."""
    if not _args.is_16bit(a.dtype):
        a = a.astype(dtype, copy=False)
    return a if kernel_layout(a) else np.ascontiguousarray(a)


def kernel_mask(p):
    """The mask of Problem ``p`` as the kernel reads it (a uint8 view of a bool mask, or the
    compute dtype with element strides), broadcast to ``(..., Hq, Lq, Lk)``; None without
    one."""
    mask = p.mask
    if mask is None:
        return None
    if p.mask_kind == "bool":
        mask = mask.view(np.uint8)
    else:
        mask = mask.astype(p.compute_dtype, copy=False)
        if any(st % mask.itemsize for st in mask.strides):
            mask = np.ascontiguousarray(mask)
    return np.broadcast_to(mask, p.batch + (p.Hq, p.Lq, p.Lk))


def writes_in_place(target, cdt, inputs):
    """Whether the kernel can write straight into ``target``: the compute dtype (or a 16-bit
    result of float32 compute) in native byte order, rows it can address, and no overlap
    with an input (tiles read the inputs while others are written)."""
    return (target is not None and kernel_writes(target.dtype, cdt) and kernel_layout(target)
            and not any(np.may_share_memory(target, a) for a in inputs if a is not None))


def kernel_writes(dtype, cdt):
    """Whether the kernel writes results of compute dtype ``cdt`` as ``dtype`` itself."""
    return dtype == cdt or (cdt == np.float32 and _args.is_16bit(dtype))


def result_arrays(p, target, cdt, shape, inputs):
    """The arrays the kernel writes for the call ``p`` describes: ``(res, lse, direct)``.
    ``res`` is ``target`` (the caller's ``out``, viewed with the kernel's shape) when the
    kernel can write it in place (``direct``), else a new array of ``shape`` in the result
    dtype the kernel writes; ``lse`` is a new array of ``shape[:-1]`` in the compute dtype,
    or None without ``p.return_lse``."""
    direct = writes_in_place(target, cdt, inputs)
    rdt = p.result_dtype if kernel_writes(p.result_dtype, cdt) else cdt
    res = target if direct else np.empty(shape, dtype=rdt)
    lse = np.empty(shape[:-1], dtype=cdt) if p.return_lse else None
    return res, lse, direct


def result(out, res, result_dtype, direct):
    """The caller's ``out`` holding ``res`` (copied unless the kernel wrote it there), or
    ``res`` in the result dtype."""
    if out is not None:
        if not direct:
            np.copyto(out, res, casting="unsafe")
        return out
    return res if res.dtype == result_dtype else res.astype(result_dtype)
