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

Calls over q8_0 and q4_0 caches may take q.k in integers, opt-in
(:func:`set_int8_dot_products`): q is quantised per block of 32 dims as llama.cpp does
against its quantised K, and the CPU's int8 dot products (AVX512-VNNI, AVX-VNNI, or AVX2's
``vpmaddubsw`` on CPUs without VNNI) multiply it with the stored keys.
"""
import threading
import warnings

import numpy as np

from . import args as _args
from .._machine.isa import ISA, kernel

__all__ = ["set_float32_precision", "get_float32_precision", "float32_precision",
           "set_int8_dot_products", "get_int8_dot_products"]

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


# ---------------------------------------------------------------------------- int8 products

_int8_setting = False
_int8_warned = False
# The VNNI extension of each kernel variant (the base variant has no int8 products).
_VNNI = {"avx512": "AVX512-VNNI", "avx2": "AVX-VNNI", "base": "VNNI"}


def int8_products():
    """Whether calls over q8_0 and q4_0 caches can take q.k in integers in this process:
    ``(True, how)``, or ``(False, why not)``."""
    if not kernel.INT8_DOT_BUILT:
        return False, "this kernel variant has no int8 dot products"
    if not kernel.INT8_DOT_CPU:
        return False, f"this CPU has no {_VNNI[ISA]}"
    if kernel.INT8_DOT_VNNI:
        return True, f"{_VNNI[ISA]} vpdpbusd"
    return True, f"AVX2 vpmaddubsw (this CPU has no {_VNNI[ISA]}; the same bits)"


def quantised_products():
    """What calls over q8_0 and q4_0 caches multiply q.k in now, in words."""
    runs, how = int8_products()
    if not _int8_setting:
        offer = f"; set_int8_dot_products(True) takes them in int8 here: {how}" if runs else ""
        return f"float32 (exact over the stored values, the default{offer})"
    if runs:
        return f"int8 (set_int8_dot_products: q quantised per block of 32 dims; {how})"
    return f"float32: int8 products are asked for, but {how}"


def set_int8_dot_products(enabled):
    """Take q.k in int8 for calls over q8_0 and q4_0 caches (``True``), or exactly over
    the stored values in float32 (``False``, the default).  Returns the previous setting.

    With it on, each query row is quantised per block of 32 dims as llama.cpp quantises q
    against its quantised K (``round(x * 127 / max|x|)``, the block's scale
    ``max|x| / 127`` kept in float32), and each block's products with the stored keys are
    summed exactly in int32 by the CPU's int8 dot products; the blocks' sums are then
    scaled and added in float32.  Softmax and the weighted sum of V stay in float32.

    Results differ from the default: q carries the rounding of an 8-bit quantisation (a
    relative error of about 1/254 per value), which llama.cpp's q8_0 dot products carry
    too.  They stay reproducible: threads, batch size, pages and a decode step against
    the prefill over the same cache give the same bits.  Other caches, other head dims
    (D and Dv must be multiples of 32), double-precision q and the backward pass are not
    affected.

    The products run where the CPU has them: AVX512-VNNI for the AVX-512 kernels;
    AVX-VNNI for the AVX2 ones, or on CPUs without it AVX2's ``vpmaddubsw`` and
    ``vpmaddwd``, which sum each block exactly too and so give the same bits.  Elsewhere
    (the portable kernels, or AVX-512 kernels on a CPU without AVX512-VNNI) the setting
    changes nothing (calls stay exact) and warns once per process;
    :func:`fastattn.show_config` shows what runs.  The setting is process-wide.

    Examples
    --------
    >>> old = fastattn.set_int8_dot_products(True)
    >>> fastattn.get_int8_dot_products()
    True
    >>> fastattn.set_int8_dot_products(old)
    True
    """
    global _int8_setting, _int8_warned
    if not isinstance(enabled, (bool, np.bool_)):
        raise TypeError(f"enabled must be True or False, got {enabled!r}")
    enabled = bool(enabled)
    with _lock:
        old, _int8_setting = _int8_setting, enabled
        kernel.set_int8_dot(enabled)
    runs, why = int8_products()
    if enabled and not runs and not _int8_warned:
        _int8_warned = True
        warnings.warn(f"set_int8_dot_products(True) changes nothing here: {why}, so calls "
                      "over q8_0 and q4_0 caches stay exact (fastattn.show_config() shows "
                      "what runs)", RuntimeWarning, stacklevel=2)
    return old


def get_int8_dot_products():
    """Whether :func:`set_int8_dot_products` is on (where the CPU has no int8 dot products
    calls stay exact whatever it says; :func:`fastattn.show_config` shows what runs)."""
    return _int8_setting
