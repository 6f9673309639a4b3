"""The products of float32 calls: exact float32 (the default) or bfloat16, opt-in.

Calls whose q, k and v are all bfloat16 multiply in bfloat16 pairs where the CPU has
bfloat16 dot products (AVX512-BF16) and the head dims suit the kernel (the kernel's
``bf16_dot_takes``).  Float32 calls do so only when asked, like torch's
``set_float32_matmul_precision("medium")``: q, k and v are then rounded to bfloat16 (to
nearest even) and run through the same kernel, with a float32 result.  The backward of
such a call computes with the rounded q, k and v, so its gradients are those of the
function the forward computed.  Where the CPU lacks the bfloat16 products, float32 calls
stay exact whatever the setting: rounding would cost accuracy and buy no speed; asking
for bfloat16 there warns, once per process (:func:`fastattn.show_config` shows what runs).

The setting is process-wide (:func:`set_float32_precision`); :class:`float32_precision`
overrides it for the calling thread within a ``with`` block.  The torch integrations
follow this setting too, never torch's ``set_float32_matmul_precision``.
"""
import threading
import warnings

import numpy as np

from . import args as _args
from .._machine.isa import kernel

__all__ = ["set_float32_precision", "get_float32_precision", "float32_precision"]

PRECISIONS = ("float32", "bfloat16")
_global = "float32"
_local = threading.local()
# Whether any call may run in bfloat16 now (the process-wide setting, or a thread inside
# a bfloat16 block): a plain flag, so that the lean path's check costs a lookup.
active = False
_bf16_blocks = 0
_lock = threading.Lock()
# Whether the opt-in has warned that it changes nothing here: once per process.
_warned = False


def _update_active():
    global active
    active = _global == "bfloat16" or _bf16_blocks > 0


def _check(precision):
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    if precision == "bfloat16":
        _warn_once_if_no_products()
    return precision


def bf16_products():
    """Whether this process multiplies in bfloat16 pairs where a call may: ``(True, how)``,
    or ``(False, why not)``."""
    if kernel.bf16_dot():
        return True, "AVX512-BF16 vdpbf16ps"
    if not kernel.BF16_DOT_BUILT:
        return False, "this kernel variant has no bfloat16 products"
    if not kernel.BF16_DOT_CPU:
        return False, "this CPU has no AVX512-BF16"
    return False, "turned off by FASTATTN_BF16_DOT=0 or the kernel's set_bf16_dot"


def float32_products():
    """What this thread's float32 calls multiply in now, in words."""
    if get_float32_precision() == "float32":
        return "float32 (exact, the default)"
    runs, why = bf16_products()
    if runs:
        return ("bfloat16 (set_float32_precision: q, k, v rounded to bfloat16 where the "
                "head dims suit the kernel)")
    return f"float32: 'bfloat16' is set, but {why}"


def _warn_once_if_no_products():
    global _warned
    runs, why = bf16_products()
    if runs or _warned:
        return
    _warned = True
    # stacklevel: the user's call of set_float32_precision or float32_precision.
    warnings.warn(f"float32 precision 'bfloat16' changes nothing here: {why}, so float32 "
                  "calls keep exact float32 products (fastattn.show_config() shows what "
                  "runs)", RuntimeWarning, stacklevel=4)


def set_float32_precision(precision):
    """Set how float32 calls multiply: ``"float32"`` (exact, the default) or
    ``"bfloat16"`` (q, k, v rounded to bfloat16 and multiplied in bfloat16 pairs, softmax
    and sums in float32; only where the CPU has bfloat16 dot products: elsewhere, or with
    ``FASTATTN_BF16_DOT=0``, it changes nothing and warns once per process).  Returns the
    previous setting.

    Examples
    --------
    >>> old = fastattn.set_float32_precision("bfloat16")
    >>> fastattn.get_float32_precision()
    'bfloat16'
    >>> fastattn.set_float32_precision(old)
    'bfloat16'
    """
    global _global
    with _lock:
        old, _global = _global, _check(precision)
        _update_active()
    return old


def get_float32_precision():
    """The precision of float32 calls made by this thread now (see
    :func:`set_float32_precision`): the setting.  Where the CPU has no bfloat16 products
    float32 calls stay exact whatever it says; :func:`fastattn.show_config` shows what runs."""
    return getattr(_local, "override", None) or _global


class float32_precision:
    """Within the block, this thread's float32 calls use ``precision`` (see
    :func:`set_float32_precision`), whatever the process-wide setting.

    >>> with fastattn.float32_precision("bfloat16"):
    ...     fastattn.get_float32_precision()
    'bfloat16'
    """

    __slots__ = ("precision", "previous")

    def __init__(self, precision):
        self.precision = _check(precision)

    def __enter__(self):
        global _bf16_blocks
        self.previous = getattr(_local, "override", None)
        _local.override = self.precision
        if self.precision == "bfloat16":
            with _lock:
                _bf16_blocks += 1
                _update_active()
        return self

    def __exit__(self, *exc):
        global _bf16_blocks
        _local.override = self.previous
        if self.precision == "bfloat16":
            with _lock:
                _bf16_blocks -= 1
                _update_active()


def rounds_float32(D, Dv):
    """Whether a float32 call with head dims D and Dv is run in bfloat16 now."""
    return get_float32_precision() == "bfloat16" and kernel.bf16_dot_takes(D, Dv)


def bfloat16_bits(a):
    """The bfloat16 bits (uint16) of ``a`` rounded to nearest even, as the kernel reads a
    bfloat16 array; NaN stays NaN.  ``a``: an array the kernel can read (float32, or 16-bit)."""
    a = np.asarray(a, dtype=np.float32)
    u = a.view(np.uint32)
    bits = ((u + np.uint32(0x7FFF) + ((u >> 16) & np.uint32(1))) >> 16).astype(np.uint16)
    nan = np.isnan(a)
    if nan.any():
        bits[nan] = (u[nan] >> 16).astype(np.uint16) | np.uint16(0x40)
    return bits


def bfloat16_values(a):
    """``a`` (float32) with each value rounded to bfloat16, as float32."""
    return (bfloat16_bits(a).astype(np.uint32) << 16).view(np.float32)


def forward_inputs(q, k, v, cdt, D, Dv):
    """The forward kernel's q, k, v: as they are, or float32 calls' rounded to bfloat16
    bits when they run in bfloat16 now."""
    if cdt != np.float32 or not rounds_float32(D, Dv):
        return q, k, v
    return tuple(a if _args.is_bfloat16(a.dtype) else bfloat16_bits(a) for a in (q, k, v))


def backward_inputs(q, k, v, cdt, D, Dv):
    """The backward kernel's q, k, v: those the forward multiplied (float32 calls' rounded
    to bfloat16 values when they run in bfloat16 now)."""
    if cdt != np.float32 or not rounds_float32(D, Dv):
        return q, k, v
    return tuple(a if _args.is_16bit(a.dtype) else bfloat16_values(a) for a in (q, k, v))
