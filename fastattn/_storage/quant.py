"""Quantised K/V cache formats: llama.cpp's q8_0 and q4_0 blocks, and fp8 with a scale.

**q8_0 and q4_0** cut a row of ``D`` values into blocks of 32 along ``D``, each with one
float16 scale ``d``.  The bits are llama.cpp's (``quantize_row_q8_0_ref``,
``quantize_row_q4_0_ref``): ``d`` is computed in float32 from the float32 values, the
values are rounded from ``x * (1 / d)`` with that float32 ``d``, and ``d`` is then stored
rounded to float16.

- q8_0: ``d = max|x| / 127``, values ``round(x / d)`` (ties away from zero), int8; 34 bytes
  per 32 values.
- q4_0: ``d = m / -8`` where ``m`` is the value of largest magnitude with its sign (the
  first of equal ones), values ``min(15, trunc(x / d + 8.5))`` stored ``+ 8`` in 4 bits;
  byte ``j`` of a block holds value ``j`` in its low nibble and value ``j + 16`` in its high
  one: 18 bytes per 32 values.

Dequantised, a value is ``level * float16``, which float32 holds exactly, so every reader
of such a cache sees the same float32 numbers.  fastattn keeps the values and the scales
as two arrays, ``values`` ``(..., D)`` int8 (q8_0) or ``(..., D // 2)`` uint8 (q4_0) and
``scales`` float16 ``(..., D // 32)``, so that a cache of values is addressed like any
other cache (rows, heads, pages) and its scales beside it with the same leading axes.

**fp8** (vLLM's ``kv_cache_dtype="fp8"``) stores ``ml_dtypes.float8_e4m3fn`` or
``float8_e5m2`` values with one float32 scale per tensor (shape ``()``) or per kv head
(``(Hkv,)``): a stored ``x`` reads as ``float32(x) * scale``.  Storing divides by the scale
(float32 by float32, rounded once to float32), rounds to the nearest fp8 value (ties to
even) and saturates to the largest finite one (448 for e4m3fn, 57344 for e5m2), as vLLM's
kernels do; non-finite values are refused.  (``ml_dtypes``' own cast rounds the same way
but gives NaN or inf beyond the largest value.)

The arithmetic is the compiled code's (``src/kinds/fa_append.h``), which the serving cache's
appends share, so both give the same bytes.
"""
import math
import numbers

import numpy as np

from .._calls import args as _args
from . import kinds as _kinds
from .._machine.isa import kernel

__all__ = ["Q8_0", "Q4_0", "BLOCK", "FP8_NAMES", "quantize_q8_0", "dequantize_q8_0",
           "quantize_q4_0", "dequantize_q4_0", "quantize_fp8", "dequantize_fp8", "cache_dtype",
           "cache_format", "check_block_dim", "check_block_pair", "check_fp8_scale",
           "quantize", "dequantize"]

Q8_0 = "q8_0"      # the names of the block formats, as cache dtypes
Q4_0 = "q4_0"
# Values per block (one scale each), llama.cpp's QK8_0 and QK4_0: the table's, one for both.
BLOCK = _kinds.BY_NAME[Q8_0]["block"]
FP8_NAMES = tuple(k["name"] for k in _kinds.KINDS if k["scale"] == "float32 per tensor or kv head")

# Per block format (the storage kinds' table): the values' dtype, values per byte, and the
# largest |x| whose block scale is a finite float16 (beyond, the scale would be inf).
_BLOCKS = {k["name"]: (np.dtype(k["dtype"]), k["per_item"], k["quantisable"])
           for k in _kinds.KINDS if k["scale"] == "float16 per block"}
_LEVELS = {name: f"{_kinds.BY_NAME[name]['largest']:g}" for name in _BLOCKS}


def is_fp8(dtype):
    """Whether ``dtype`` is one of ``ml_dtypes``' fp8 types a cache stores (checked without
    importing ml_dtypes)."""
    kind = _kinds.of_dtype(dtype) if isinstance(dtype, np.dtype) else None
    return kind is not None and kind["name"] in FP8_NAMES


def fp8_dtype(dtype, name="dtype"):
    """The fp8 dtype ``dtype`` names (an ``ml_dtypes`` type or its name), or None."""
    if isinstance(dtype, str):
        if dtype not in FP8_NAMES:
            return None
        try:
            import ml_dtypes
        except ImportError:
            raise TypeError(f"{name}={dtype!r} needs the ml_dtypes package "
                            "(pip install ml_dtypes)") from None
        return np.dtype(getattr(ml_dtypes, dtype))
    try:
        dt = np.dtype(dtype)
    except TypeError:
        return None
    return dt if is_fp8(dt) else None


def cache_dtype(dtype, name="dtype"):
    """``"q8_0"``, ``"q4_0"``, an fp8 dtype, or the float dtype ``dtype`` names
    (:func:`fastattn._calls.args.storage_dtype`): the dtypes a K/V cache may store."""
    if isinstance(dtype, str) and dtype in _BLOCKS:
        return dtype
    fp8 = fp8_dtype(dtype, name)
    if fp8 is not None:
        return fp8
    try:
        return _args.storage_dtype(dtype, name)
    except TypeError as e:
        raise TypeError(f"{e}, 'q8_0', 'q4_0', 'float8_e4m3fn' or 'float8_e5m2'") from None


def cache_format(dtype):
    """The quantised format an array of ``dtype`` holds as a cache: ``"q8_0"`` (int8),
    ``"q4_0"`` (uint8), ``"fp8"`` (ml_dtypes' fp8), or None for a float cache."""
    kind = _kinds.of_dtype(dtype)
    if kind is None or kind["scale"] is None:
        return None
    return "fp8" if kind["name"] in FP8_NAMES else kind["name"]


def check_block_dim(D, name, shape, fmt=Q8_0):
    """A ``ValueError`` naming ``name`` unless its last axis ``D`` is a multiple of 32."""
    if D % BLOCK:
        raise ValueError(f"{fmt} stores blocks of {BLOCK} values along the last axis: {name} "
                         f"must have D a multiple of {BLOCK}, got shape {shape}")


# --------------------------------------------------------------------------- q8_0, q4_0

def quantize_q8_0(x):
    """Quantise ``x`` to llama.cpp's q8_0 format, bit for bit.

    Parameters
    ----------
    x : array_like, shape (..., D)
        Real numbers, ``D`` a multiple of 32, finite and at most ``127 * 65504`` in
        magnitude.  float64 values are rounded to float32 first, as llama.cpp's converters
        do; float16 and bfloat16 values are exact in float32.

    Returns
    -------
    values : ndarray of int8, shape (..., D)
    scales : ndarray of float16, shape (..., D // 32)
        Block ``j`` of a row is ``values[..., 32*j:32*(j+1)] * scales[..., j]``; a block of
        zeros has scale 0.

    Examples
    --------
    >>> values, scales = fastattn.quantize_q8_0(np.linspace(-1, 1, 32))
    >>> values[:4], scales
    (array([-127, -119, -111, -102], dtype=int8), array([0.00787], dtype=float16))
    """
    return quantize(x, "x", Q8_0)


def quantize_q4_0(x):
    """Quantise ``x`` to llama.cpp's q4_0 format, bit for bit.

    Parameters
    ----------
    x : array_like, shape (..., D)
        Real numbers, ``D`` a multiple of 32, finite and at most ``8 * 65504`` in
        magnitude.  float64 values are rounded to float32 first, as llama.cpp's converters
        do; float16 and bfloat16 values are exact in float32.

    Returns
    -------
    values : ndarray of uint8, shape (..., D // 2)
        Two values a byte, each stored ``+ 8`` in 4 bits: byte ``j`` of block ``b`` (bytes
        ``16*b .. 16*b + 15``) holds value ``32*b + j`` in its low nibble and value
        ``32*b + j + 16`` in its high one.
    scales : ndarray of float16, shape (..., D // 32)
        Value ``i`` of block ``b`` is ``(nibble - 8) * scales[..., b]``.

    Examples
    --------
    >>> values, scales = fastattn.quantize_q4_0(np.linspace(-1, 1, 32))
    >>> values[:4], scales
    (array([128, 145, 145, 162], dtype=uint8), array([0.125], dtype=float16))
    """
    return quantize(x, "x", Q4_0)


def _float32_rows(x, name):
    """``x`` ``(..., D)`` as C-contiguous rows ``(n, D)`` of float32 or a 16-bit dtype
    (float64 rounded to float32 first, as llama.cpp's converters do; 16-bit is exact)."""
    x32 = x if _args.is_16bit(x.dtype) else x.astype(np.float32)
    return np.ascontiguousarray(x32.reshape(math.prod(x.shape[:-1]), x.shape[-1]))


def quantize(x, name, fmt, scale=None):
    """``x`` stored in the quantised format ``fmt`` (``"q8_0"``, ``"q4_0"`` or an fp8
    dtype, which takes ``scale``, float32 ``()`` or ``(H,)`` for ``x (..., H, L, D)``):
    ``(values, scales)``, ``scales`` None for fp8.  Errors name ``x`` as ``name``."""
    x = _args.as_array(x, name)
    _args.check_dtype(x, name)
    if x.ndim == 0:
        raise ValueError(f"{name} must have shape (..., D), got a scalar")
    if not isinstance(fmt, str):
        return _quantize_fp8(x, name, scale, fmt), None
    check_block_dim(x.shape[-1], name, x.shape, fmt)
    dtype, per_byte, max_abs = _BLOCKS[fmt]
    rows = _float32_rows(x, name)
    values = np.empty((rows.shape[0], rows.shape[1] // per_byte), dtype)
    scales = np.empty((rows.shape[0], rows.shape[1] // BLOCK), np.float16)
    if not kernel.quantize_rows(rows, values, scales):
        amax = np.abs(rows.astype(np.float32).reshape(-1, BLOCK)).max(axis=-1)
        bad = amax[~(np.isfinite(amax) & (amax <= max_abs))]
        raise ValueError(f"{name} must be finite with |x| <= {_LEVELS[fmt]} * 65504 = "
                         f"{max_abs:g} to be stored as {fmt} (a float16 scale per 32 values), "
                         f"got a block with max |x| = {float(bad.flat[0]):g} (shape {x.shape})")
    return (values.reshape(x.shape[:-1] + values.shape[-1:]),
            scales.reshape(x.shape[:-1] + scales.shape[-1:]))


def dequantize_q8_0(values, scales):
    """The float32 numbers a q8_0 array stores: ``values * scales``, one scale per block of
    32 values along the last axis (exact in float32).

    Parameters
    ----------
    values : array_like of int8, shape (..., D)
    scales : array_like of float16, shape (..., D // 32)

    Returns
    -------
    ndarray of float32, shape (..., D)
    """
    return _dequantize_blocks(values, scales, Q8_0)


def dequantize_q4_0(values, scales):
    """The float32 numbers a q4_0 array stores: ``(nibble - 8) * scale``, one scale per
    block of 32 values (16 bytes) along the last axis (exact in float32).

    Parameters
    ----------
    values : array_like of uint8, shape (..., D // 2)
    scales : array_like of float16, shape (..., D // 32)

    Returns
    -------
    ndarray of float32, shape (..., D)
    """
    return _dequantize_blocks(values, scales, Q4_0)


def _dequantize_blocks(values, scales, fmt):
    values, scales = _args.as_array(values, "values"), _args.as_array(scales, "scales")
    check_block_pair(values, scales, "values", "scales", fmt)
    return _levels_times_scales(values, scales, fmt)


def _levels_times_scales(values, scales, fmt):
    """A checked block array ``(values, scales)`` as float32 ``(..., D)``."""
    per_block = BLOCK // _BLOCKS[fmt][1]
    blocks = values.reshape(values.shape[:-1] + (-1, per_block))
    if fmt == Q4_0:
        blocks = np.concatenate([blocks & 15, blocks >> 4], axis=-1).astype(np.int8) - 8
    levels = blocks.astype(np.float32)
    return (levels * scales.astype(np.float32)[..., None]).reshape(
        values.shape[:-1] + (-1,))


def check_block_pair(values, scales, values_name, scales_name, fmt=Q8_0):
    """Block-format ``values`` (int8 ``(..., D)`` for q8_0, uint8 ``(..., D // 2)`` for
    q4_0) with ``scales`` float16 ``(..., D // 32)``: ``TypeError`` for the wrong dtypes,
    ``ValueError`` for shapes that do not pair up."""
    dtype, per_byte, _ = _BLOCKS[fmt]
    if values.dtype != dtype:
        raise TypeError(f"{values_name} must be {dtype} ({fmt} values), got dtype "
                        f"{values.dtype} (shape {values.shape})")
    if scales.dtype != np.float16:
        raise TypeError(f"{scales_name} must be float16 ({fmt} scales), got dtype "
                        f"{scales.dtype} (shape {scales.shape})")
    if values.ndim == 0:
        raise ValueError(f"{values_name} must have shape (..., D), got a scalar")
    if (values.shape[-1] * per_byte) % BLOCK:
        what = "D" if per_byte == 1 else f"D = {per_byte} * its last axis"
        raise ValueError(f"{fmt} stores blocks of {BLOCK} values along the last axis: "
                         f"{values_name} must have {what} a multiple of {BLOCK}, got shape "
                         f"{values.shape}")
    want = values.shape[:-1] + (values.shape[-1] * per_byte // BLOCK,)
    if scales.shape != want:
        raise ValueError(f"{scales_name} must have shape {values_name}.shape[:-1] + (D // 32,) "
                         f"= {want} for {values_name} of shape {values.shape}, got "
                         f"{scales.shape}")


# --------------------------------------------------------------------------- fp8

def quantize_fp8(x, scale=1.0, dtype="float8_e4m3fn"):
    """Store ``x`` as fp8 with a float32 scale, as vLLM's fp8 KV cache does.

    Parameters
    ----------
    x : array_like, shape (..., H, L, D), or any shape with a scalar ``scale``
        Finite real numbers (float64 is rounded to float32 first).
    scale : float or array_like of float32, shape () or (H,)
        One scale for all of ``x``, or one per head (axis ``-3``), > 0 and at most
        float32's largest value / the largest fp8 value (so that every stored value
        reads back finite): a cache's ``k_scale`` / ``v_scale``.  A Python float is
        rounded to float32.
    dtype : ``"float8_e4m3fn"`` or ``"float8_e5m2"``, or that ``ml_dtypes`` type

    Returns
    -------
    ndarray of ``dtype``, shape of ``x``
        ``x / scale`` (float32, rounded once) rounded to the nearest value of ``dtype``,
        ties to even, and saturated to its largest finite value (448 for e4m3fn, 57344
        for e5m2); ``dequantize_fp8(result, scale)`` reads it back.

    Examples
    --------
    >>> fastattn.quantize_fp8([0.3, -2.0, 1000.0], 0.5).astype(np.float32)  # doctest: +SKIP
    array([  0.625,  -4.   , 448.   ], dtype=float32)
    """
    fp8 = fp8_dtype(dtype, "dtype")
    if fp8 is None:
        raise TypeError(f"dtype must be 'float8_e4m3fn' or 'float8_e5m2', got {dtype!r}")
    x = _args.as_array(x, "x")
    _args.check_dtype(x, "x")
    return _quantize_fp8(x, "x", check_fp8_scale(scale, "scale", fp8, x, "x"), fp8)


def _quantize_fp8(x, name, scale, fp8):
    """``x`` (checked) stored as ``fp8`` with the checked float32 ``scale``."""
    if x.size and not np.isfinite(x).all():
        bad = x[~np.isfinite(x)].flat[0]
        raise ValueError(f"{name} must be finite to be stored as {fp8} (vLLM refuses no "
                         f"value, but saturating {bad} would hide it), got {bad} "
                         f"(shape {x.shape})")
    if x.ndim == 0:
        return _quantize_fp8(x.reshape(1), name, scale, fp8).reshape(())
    rows = _float32_rows(x, name)
    per_row = scale if scale.ndim == 0 else scale[:, None, None]
    row_scales = np.ascontiguousarray(
        np.broadcast_to(per_row, x.shape).reshape(-1, x.shape[-1])[:, 0], dtype=np.float32)
    values = np.empty(rows.shape, fp8)
    kernel.quantize_rows(rows, values, row_scales)
    return values.reshape(x.shape)


def dequantize_fp8(values, scale=1.0):
    """The float32 numbers an fp8 array stores with its scale: ``float32(values) * scale``.

    Parameters
    ----------
    values : ndarray of ``ml_dtypes.float8_e4m3fn`` or ``float8_e5m2``, shape (..., H, L, D)
    scale : float or array_like of float32, shape () or (H,)

    Returns
    -------
    ndarray of float32, shape of ``values``
    """
    values = _args.as_array(values, "values")
    if not is_fp8(values.dtype):
        raise TypeError(f"values must be float8_e4m3fn or float8_e5m2 (ml_dtypes), got dtype "
                        f"{values.dtype} (shape {values.shape})")
    scale = check_fp8_scale(scale, "scale", values.dtype, values, "values")
    per_row = scale if scale.ndim == 0 else scale[:, None, None]
    return values.astype(np.float32) * per_row


def fp8_max(fp8):
    """The largest finite value of the fp8 dtype ``fp8``."""
    return _kinds.BY_NAME[fp8.name]["largest"]


def check_fp8_scale(s, name, fp8, cache, cache_name):
    """``s``, the scales of values of the fp8 dtype ``fp8`` in ``cache`` ``(..., H, L, D)``:
    a Python real number, or float32 of shape ``()`` or ``(H,)`` (any length without a cache
    yet: ``cache=None``); every scale > 0 and small enough that the largest fp8 value times
    it is a finite float32.  Returns a float32 array."""
    if s is None:
        raise ValueError(f"an fp8 {cache_name} needs its scale: {name} float32 of shape () "
                         f"or (Hkv,) (1.0 when the values were stored unscaled)")
    if isinstance(s, numbers.Real) and not isinstance(s, (bool, np.generic)):
        s = np.float32(s)
    s = _args.as_array(s, name)
    if s.dtype != np.float32:
        raise TypeError(f"{name} must be float32 (fp8 scales, as vLLM's k_scale/v_scale), "
                        f"got dtype {s.dtype} (shape {s.shape})")
    H = "Hkv" if cache is None else cache.shape[-3] if cache.ndim >= 3 else None
    if s.shape != () and (H is None or s.ndim != 1 or (cache is not None and s.shape != (H,))):
        shape = "(no cache yet)" if cache is None else f"of shape {cache.shape}"
        raise ValueError(f"{name} must have shape () or (Hkv,) = ({H},) for {cache_name} "
                         f"{shape}, got {s.shape}")
    top = fp8_max(fp8)
    with np.errstate(over="ignore"):
        bad = s[~(np.isfinite(s * np.float32(top)) & (s > 0))]
    if bad.size:
        raise ValueError(f"{name} must be finite and > 0, at most float32's largest / {top:g} "
                         f"= {float(np.finfo(np.float32).max) / top:.4g} (a stored {fp8} "
                         f"times it is finite), got {bad.flat[0]} (shape {s.shape})")
    return s


# --------------------------------------------------------------------------- any format

def dequantize(values, scales, fmt):
    """A checked quantised array as the float32 numbers it stores (fp8: ``scales`` the
    float32 scale of shape ``()`` or ``(H,)``)."""
    if fmt == "fp8":
        per_row = scales if scales.ndim == 0 else scales[:, None, None]
        return values.astype(np.float32) * per_row
    return _levels_times_scales(values, scales, fmt)
