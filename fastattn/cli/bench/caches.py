"""The quantised cache types the bench times against fastattn's own float16 cache: how
each stores float32 keys and values, and what it holds once stored (the float64 values the
kernel attends over, for the check).

q8_0 and q4_0 are llama.cpp's blocks (``fastattn.quantize_q8_0``/``quantize_q4_0``); fp8
is vLLM's ``kv_cache_dtype="fp8"``: float8_e4m3fn values with one float32 scale per kv
head, here ``max|x| / 448`` over the head's rows (needs ml_dtypes).
"""
import numpy as np


def _fp8(fa, x):
    scale = (np.abs(x).max(axis=(0, 2, 3)) / 448).astype(np.float32)
    scale[scale == 0] = 1
    return fa.quantize_fp8(x, scale, "float8_e4m3fn"), scale


def store(fa, dtype, k, v):
    """k and v ``(1, Hkv, L, D)`` float32 stored as ``dtype``: the keywords of
    ``attention_with_kvcache`` (caches and scales)."""
    if dtype == "fp8":
        (kq, ks), (vq, vs) = _fp8(fa, k), _fp8(fa, v)
    else:
        quantize = getattr(fa, f"quantize_{dtype}")      # q8_0, q4_0
        (kq, ks), (vq, vs) = quantize(k), quantize(v)
    return dict(k_cache=kq, v_cache=vq, k_scale=ks, v_scale=vs)


def stored_values(fa, dtype, cache):
    """The float64 values a stored cache holds: (k, v)."""
    pairs = ((cache["k_cache"], cache["k_scale"]), (cache["v_cache"], cache["v_scale"]))
    if dtype == "fp8":
        return tuple(x.astype(np.float64) * s.astype(np.float64)[:, None, None]
                     for x, s in pairs)
    dequantize = getattr(fa, f"dequantize_{dtype}")
    return tuple(np.asarray(dequantize(x, s), np.float64) for x, s in pairs)
