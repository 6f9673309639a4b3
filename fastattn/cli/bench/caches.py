"""The quantised cache types the bench times against fastattn's own float16 cache: how
each stores float32 keys and values, and what it holds once stored (the float64 values the
kernel attends over, for the check).

q8_0 and q4_0 are llama.cpp's blocks (``fastattn.quantize_q8_0``/``quantize_q4_0``); fp8
is vLLM's ``kv_cache_dtype="fp8"``: float8_e4m3fn values (fp8_e5m2: float8_e5m2) with one
float32 scale per kv head, here max|x| over the head's rows / the type's largest finite
value (needs ml_dtypes).
"""
import numpy as np

# the fp8 cache types: (ml_dtypes' name, largest finite value)
FP8 = {"fp8": ("float8_e4m3fn", 448.0), "fp8_e5m2": ("float8_e5m2", 57344.0)}


def _fp8(fa, x, dtype):
    name, top = FP8[dtype]
    scale = (np.abs(x).max(axis=(0, 2, 3)) / top).astype(np.float32)
    scale[scale == 0] = 1
    return fa.quantize_fp8(x, scale, name), scale


def store(fa, dtype, k, v):
    """k and v ``(B, Hkv, L, D)`` float32 stored as ``dtype`` (q8_0, q4_0, fp8, fp8_e5m2):
    the keywords of ``attention_with_kvcache`` (caches and scales)."""
    if dtype in FP8:
        (kq, ks), (vq, vs) = _fp8(fa, k, dtype), _fp8(fa, v, dtype)
    else:
        quantize = getattr(fa, f"quantize_{dtype}")      # q8_0, q4_0
        (kq, ks), (vq, vs) = quantize(k), quantize(v)
    return dict(k_cache=kq, v_cache=vq, k_scale=ks, v_scale=vs)


def stored_values(fa, dtype, cache):
    """The float64 values a stored cache holds: (k, v)."""
    pairs = ((cache["k_cache"], cache["k_scale"]), (cache["v_cache"], cache["v_scale"]))
    if dtype in FP8:
        return tuple(x.astype(np.float64) * s.astype(np.float64)[:, None, None]
                     for x, s in pairs)
    dequantize = getattr(fa, f"dequantize_{dtype}")
    return tuple(np.asarray(dequantize(x, s), np.float64) for x, s in pairs)
