"""q8_0, llama.cpp's 8-bit block format, for K/V caches.

A row of ``D`` values is cut into blocks of 32 along ``D``.  Each block stores one float16
scale ``d = max|x| / 127`` and 32 int8 values ``round(x / d)`` (ties away from zero): 34
bytes per 32 values, 1.0625 bytes a value.  The bits are llama.cpp's
(``quantize_row_q8_0_ref``): ``d`` is computed in float32 from the float32 values, the values
are rounded from ``x * (1 / d)`` with that float32 ``d``, and ``d`` is then stored rounded to
float16.  Dequantised, a value is ``int8 * float16``, which float32 holds exactly (8 + 11
significant bits), so every reader of a q8_0 cache sees the same float32 numbers.

fastattn keeps the values and the scales as two arrays, ``values`` int8 ``(..., D)`` and
``scales`` float16 ``(..., D // 32)``, so that a cache of values is addressed like any other
cache (rows, heads, pages) and its scales beside it with the same leading axes.
"""
import math

import numpy as np

from . import _args
from ._dispatch import kernel

__all__ = ["Q8_0", "BLOCK", "quantize_q8_0", "dequantize_q8_0", "cache_dtype", "check_block_dim"]

Q8_0 = "q8_0"      # the name of the format, as a cache dtype
BLOCK = 32         # values per block (one scale each), llama.cpp's QK8_0

# The largest finite float16 scale is 65504, so |x| up to 127 * 65504 quantises; beyond,
# the scale would be stored as inf (every value of the block then dequantises to inf or NaN).
_MAX_ABS = 127.0 * float(np.finfo(np.float16).max)


def cache_dtype(dtype, name="dtype"):
    """``"q8_0"``, or the float dtype ``dtype`` names (:func:`fastattn._args.storage_dtype`):
    the dtypes a K/V cache may store."""
    if isinstance(dtype, str) and dtype == Q8_0:
        return Q8_0
    try:
        return _args.storage_dtype(dtype, name)
    except TypeError as e:
        raise TypeError(f"{e}, or 'q8_0'") from None


def check_block_dim(D, name, shape):
    """A ``ValueError`` naming ``name`` unless its last axis ``D`` is a multiple of 32."""
    if D % BLOCK:
        raise ValueError(f"q8_0 stores blocks of {BLOCK} values along the last axis: {name} "
                         f"must have D a multiple of {BLOCK}, got shape {shape}")


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
    return quantize(x, "x")


def quantize(x, name):
    """:func:`quantize_q8_0` of the argument the caller calls ``name`` (``k``, ``v``): its
    errors name that argument."""
    x = _args.as_array(x, name)
    _args.check_dtype(x, name)
    if x.ndim == 0:
        raise ValueError(f"{name} must have shape (..., D) with D a multiple of 32, got a "
                         "scalar")
    check_block_dim(x.shape[-1], name, x.shape)
    # float64 rounds to float32 first, as llama.cpp's converters do; 16-bit is exact
    x32 = x if _args.is_16bit(x.dtype) else x.astype(np.float32)
    rows = np.ascontiguousarray(x32.reshape(math.prod(x.shape[:-1]), x.shape[-1]))
    values = np.empty(rows.shape, np.int8)
    scales = np.empty((rows.shape[0], rows.shape[1] // BLOCK), np.float16)
    if not kernel.quantize_q8_0_rows(rows, values, scales):
        amax = np.abs(rows.astype(np.float32).reshape(-1, BLOCK)).max(axis=-1)
        bad = amax[~(np.isfinite(amax) & (amax <= _MAX_ABS))]
        raise ValueError(f"{name} must be finite with |x| <= 127 * 65504 = {_MAX_ABS:g} to be "
                         f"stored as q8_0 (a float16 scale per 32 values), got a block with "
                         f"max |x| = {float(bad.flat[0]):g} (shape {x.shape})")
    return values.reshape(x.shape), scales.reshape(x.shape[:-1] + scales.shape[-1:])


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
    values, scales = _args.as_array(values, "values"), _args.as_array(scales, "scales")
    check_q8_0_pair(values, scales, "values", "scales")
    blocks = values.reshape(values.shape[:-1] + (-1, BLOCK)).astype(np.float32)
    return (blocks * scales.astype(np.float32)[..., None]).reshape(values.shape)


def check_q8_0_pair(values, scales, values_name, scales_name):
    """q8_0 ``values`` int8 ``(..., D)`` with ``scales`` float16 ``(..., D // 32)``:
    ``TypeError`` for the wrong dtypes, ``ValueError`` for shapes that do not pair up."""
    if values.dtype != np.int8:
        raise TypeError(f"{values_name} must be int8 (q8_0 values), got dtype {values.dtype} "
                        f"(shape {values.shape})")
    if scales.dtype != np.float16:
        raise TypeError(f"{scales_name} must be float16 (q8_0 scales), got dtype "
                        f"{scales.dtype} (shape {scales.shape})")
    if values.ndim == 0:
        raise ValueError(f"{values_name} must have shape (..., D), got a scalar")
    check_block_dim(values.shape[-1], values_name, values.shape)
    want = values.shape[:-1] + (values.shape[-1] // BLOCK,)
    if scales.shape != want:
        raise ValueError(f"{scales_name} must have shape {values_name}.shape[:-1] + (D // 32,) "
                         f"= {want} for {values_name} of shape {values.shape}, got "
                         f"{scales.shape}")
