"""Validation of the attention variants' arguments: one rule, shared by every entry point.

The variants of today's models -- a tanh ``softcap`` on the scores, ALiBi ``alibi_slopes``,
attention ``sinks``, right-padded queries (``q_lengths``), packed sequences
(``cu_seqlens_q`` / ``cu_seqlens_k``) and reduced-precision storage (float16, bfloat16) --
are checked here and nowhere else. Both the NumPy oracle (:mod:`fastattn.reference`) and the
compiled kernels' front end call these functions, so the two can never disagree about
which arguments are legal or what they mean.

Every function is pure: it reads its arguments, raises ``TypeError`` (wrong kind of thing)
or ``ValueError`` (right kind, wrong shape or value) with a message that names the argument
and the shapes involved, and otherwise returns the argument normalised to the form a kernel
wants -- a Python float, or a C-contiguous array flattened over the batch:

=========================  ===========================================================
function                   returns
=========================  ===========================================================
``dtypes(**arrays)``       ``(compute_dtype, result_dtype)`` of q/k/v (or any arrays)
``check_softcap``          ``None`` or a finite ``float > 0``
``check_alibi_slopes``     ``None`` or float64 ``(nbatch, Hq)``, finite
``check_sinks``            ``None`` or float64 ``(nbatch, Hq)``, finite or ``-inf``
``check_q_lengths``        ``None`` or intp ``(nbatch,)`` in ``[0, Lq]``
``check_kv_lengths``       ``None`` or intp ``(nbatch,)`` in ``[0, Lk]``
``check_varlen_shapes``    ``(Hq, Hkv, total_q, total_k, D, Dv)``
``check_cu_seqlens``       ``(cu_seqlens_q, cu_seqlens_k)``, intp ``(n_seq + 1,)`` each
``storage_dtype``          a KV storage dtype (float16, bfloat16, float32, float64)
``round_to(x, dtype)``     ``x`` rounded once to ``dtype`` (nearest, ties to even)
``store_as(a, dtype, n)``  ``a`` rounded to a storage dtype; overflow raises
=========================  ===========================================================

``nbatch`` is ``prod(batch_shape)``: batch element ``b`` of the flattened, broadcast batch
is row ``b``; ``arr.reshape(batch_shape + arr.shape[1:])`` restores the batch axes.

Decisions where the models leave room:

- ``softcap`` is ``None`` (off) or a finite real number ``> 0``; ``0`` is rejected rather
  than read as "off" (FlashAttention's spelling), so a zero read from a config that should
  have been 30.0 cannot silently turn capping off.
- ALiBi slopes must be finite. Negative slopes are legal (the bias then grows with
  distance); the models use positive ones.
- A sink of ``-inf`` means "no sink" for that head (``exp(-inf) = 0``: the plain softmax);
  ``+inf`` and NaN are rejected, since they would make every weight 0 or NaN.
- bfloat16 is ``ml_dtypes.bfloat16``. An array's dtype is recognised without importing
  ``ml_dtypes`` (without the package no array can have that dtype); only a request by name,
  ``storage_dtype("bfloat16")``, imports it, and raises a ``TypeError`` saying to install
  ``ml_dtypes`` when it is missing.
- q, k and v of integer or bool dtype stay legal (computed in float64), as in the core
  kernel; which dtypes a KV cache may store is :func:`storage_dtype`'s separate question.
"""
import math
import numbers

import numpy as np

__all__ = [
    "is_bfloat16", "is_16bit", "dtypes", "check_softcap", "check_alibi_slopes", "check_sinks",
    "check_q_lengths", "check_kv_lengths", "check_varlen_shapes", "check_cu_seqlens",
    "storage_dtype", "round_to", "store_as",
]

_NATIVE_FLOATS = (np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64))


# --------------------------------------------------------------------------- dtypes

def is_bfloat16(dtype):
    """Whether ``dtype`` is ``ml_dtypes.bfloat16`` (checked without importing ml_dtypes)."""
    if not isinstance(dtype, np.dtype):
        try:
            dtype = np.dtype(dtype)
        except TypeError:  # e.g. the name "bfloat16" without ml_dtypes
            return False
    # kind first: NumPy computes dtype.name in Python, and this runs for every argument
    return (dtype.kind == "V" and dtype.itemsize == 2 and dtype.name == "bfloat16"
            and dtype.type.__module__.split(".")[0] == "ml_dtypes")


def is_16bit(dtype):
    """float16 or bfloat16: stored in 16 bits, computed in float32 (read in place by the
    kernel, which widens them itself)."""
    return dtype == np.float16 or is_bfloat16(dtype)


def _check_dtype(a, name):
    dt = a.dtype
    if dt.kind in "biu" or dt in _NATIVE_FLOATS or is_bfloat16(dt):
        return
    raise TypeError(
        f"{name} has unsupported dtype {dt} (shape {a.shape}): use float16, bfloat16 "
        "(ml_dtypes), float32, float64, or integers/bool (computed in float64)")


def dtypes(**arrays):
    """``(compute_dtype, result_dtype)`` for the named arrays (e.g. ``q=q, k=k, v=v``).

    - float16 or bfloat16 in all of them: computed in float32, the result in that dtype;
    - any other mix: ``np.result_type`` with bfloat16 counted as float32, integers and
      bool promoted to float64, and a float16 result (float16 mixed with small integers)
      raised to float32 -- a 16-bit result only when all arrays share that dtype;
    - float32 and float64 are computed in their own precision.

    Raises ``TypeError`` naming the first argument of any other dtype (complex, object,
    float8 or int4 from ml_dtypes, longdouble, strings, datetimes).
    """
    for name, a in arrays.items():
        _check_dtype(a, name)
    dts = [a.dtype for a in arrays.values()]
    if is_16bit(dts[0]) and all(dt == dts[0] for dt in dts):
        return np.dtype(np.float32), dts[0]
    # Dtypes, not arrays, so that NumPy 1.x's value-based casting of 0-d arrays stays out.
    res = np.result_type(*[np.dtype(np.float32) if is_bfloat16(dt) else dt for dt in dts])
    if res.kind in "biu":
        res = np.dtype(np.float64)
    if res == np.float16:
        res = np.dtype(np.float32)
    return res, res


def storage_dtype(dtype, name="dtype"):
    """The dtype ``dtype`` names, if K/V may be stored in it (float16, bfloat16, float32,
    float64); the string ``"bfloat16"`` needs ``ml_dtypes`` and says so when it is missing."""
    if isinstance(dtype, str) and dtype == "bfloat16":
        try:
            import ml_dtypes
        except ImportError:
            raise TypeError(
                f"{name}='bfloat16' needs the ml_dtypes package (pip install ml_dtypes)"
            ) from None
        return np.dtype(ml_dtypes.bfloat16)
    try:
        dt = np.dtype(dtype)
    except TypeError:
        raise TypeError(f"{name} must be a NumPy dtype, got {dtype!r}") from None
    if dt in _NATIVE_FLOATS or is_bfloat16(dt):
        return dt
    raise TypeError(f"{name} must be float16, bfloat16 (ml_dtypes), float32 or float64, got {dt}")


def round_to(x, dtype):
    """``x`` (any float array) rounded once, to nearest with ties to even, to ``dtype``."""
    dtype = np.dtype(dtype)
    x = np.asarray(x)
    if not is_bfloat16(dtype) or x.dtype.itemsize <= 4:
        with np.errstate(over="ignore"):   # overflow gives inf, as rounding should
            return x.astype(dtype)
    # ml_dtypes converts float64 through float32, rounding twice (1 + 2**-8 + 2**-30 becomes
    # 1, not 1 + 2**-7). Round the significand to bfloat16's 8 bits here instead; the result
    # is exact in float32 (or overflows to inf, as it should) and in bfloat16.
    # bfloat16 has float32's exponent range: subnormals below 2**-126 are spaced 2**-133.
    with np.errstate(over="ignore", invalid="ignore"):
        _, e = np.frexp(x)
        quantum = np.maximum(e, -125) - 8
        y = np.ldexp(np.rint(np.ldexp(x, -quantum)), quantum)
        return y.astype(np.float32).astype(dtype)


def store_as(a, dtype, name):
    """``a`` as ``dtype`` for storage (a KV cache): rounded once to nearest, and a
    ``ValueError`` naming ``name`` if a finite value is too large for ``dtype`` (float16
    stops at 65504), rather than stored as inf."""
    a, dtype = np.asarray(a), np.dtype(dtype)
    if a.dtype == dtype:
        return a
    out = round_to(a if a.dtype.kind == "f" or is_bfloat16(a.dtype) else a.astype(np.float64),
                   dtype)
    with np.errstate(invalid="ignore"):
        big = np.isinf(out.astype(np.float32)) & np.isfinite(a.astype(np.float64))
    if big.any():
        limit = float(np.finfo(np.float16).max) if dtype == np.float16 else float(
            np.finfo(np.float32).max)
        raise ValueError(
            f"{name} has values beyond {dtype.name}'s range (|x| > {limit:g}), up to "
            f"{float(np.abs(a.astype(np.float64)[big]).max()):g}: store it as bfloat16 or "
            "float32 instead")
    return out


# --------------------------------------------------------------------------- scalars

def check_softcap(softcap):
    """``None`` or ``softcap`` as a finite float ``> 0``; bools and non-reals are rejected."""
    if softcap is None:
        return None
    if isinstance(softcap, (bool, np.bool_)) or not isinstance(softcap, numbers.Real):
        raise TypeError(f"softcap must be None or a real number > 0, got {type(softcap).__name__}")
    try:
        value = float(softcap)
    except OverflowError:  # an int beyond float's range
        raise ValueError(f"softcap must be finite, got {softcap}") from None
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"softcap must be a finite number > 0 (None turns it off), got {softcap}")
    return value


# --------------------------------------------------------------------------- arrays

def _as_array(x, name):
    try:
        return np.asarray(x)
    except (ValueError, TypeError) as e:  # ragged nested lists, odd objects
        raise ValueError(f"{name} could not be converted to an array: {e}") from None


def _per_head(values, name, batch_shape, Hq, allow_minus_inf):
    if values is None:
        return None
    a = _as_array(values, name)
    if not (a.dtype.kind in "iuf" or is_bfloat16(a.dtype)):
        raise TypeError(
            f"{name} must be a real (integer or floating) array broadcastable to (..., Hq), "
            f"got dtype {a.dtype}")
    target = (*batch_shape, Hq)
    try:
        ok = np.broadcast_shapes(a.shape, target) == target
    except ValueError:
        ok = False
    if not ok:
        raise ValueError(f"{name} of shape {a.shape} does not broadcast to (..., Hq) = {target}")
    a = a.astype(np.float64)
    bad = np.isnan(a) | (a == np.inf) | ((a == -np.inf) & (not allow_minus_inf))
    if bad.any():
        allowed = "finite or -inf (no sink)" if allow_minus_inf else "finite"
        raise ValueError(f"{name} must be {allowed}, got {a[bad].flat[0]} "
                         f"(shape {a.shape})")
    return np.ascontiguousarray(np.broadcast_to(a, target).reshape(-1, Hq))


def check_alibi_slopes(alibi_slopes, batch_shape, Hq):
    """``None``, or the ALiBi slopes as float64 ``(nbatch, Hq)``: real, finite, and
    broadcastable to ``(*batch_shape, Hq)`` (one slope per query head, optionally per batch
    element). Query row ``i`` and key ``j`` then get ``-slope * |i + kv_len - q_len - j|``."""
    return _per_head(alibi_slopes, "alibi_slopes", batch_shape, Hq, allow_minus_inf=False)


def check_sinks(sinks, batch_shape, Hq):
    """``None``, or the sink logits as float64 ``(nbatch, Hq)``: real, broadcastable to
    ``(*batch_shape, Hq)``, finite or ``-inf`` (that head has no sink)."""
    return _per_head(sinks, "sinks", batch_shape, Hq, allow_minus_inf=True)


def _lengths(lengths, name, batch_shape, limit, limit_name):
    if lengths is None:
        return None
    a = _as_array(lengths, name)
    if a.dtype.kind not in "iu":
        raise TypeError(f"{name} must be an integer array, got dtype {a.dtype} (shape {a.shape})")
    try:
        a = np.broadcast_to(a, batch_shape)
    except ValueError:
        raise ValueError(
            f"{name} of shape {a.shape} does not broadcast to the batch shape {batch_shape}"
        ) from None
    if a.size and (a.min() < 0 or a.max() > limit):
        raise ValueError(f"{name} must lie in [0, {limit_name}] = [0, {limit}], got values in "
                         f"[{a.min()}, {a.max()}]")
    return np.ascontiguousarray(a.reshape(-1), dtype=np.intp)


def check_q_lengths(q_lengths, batch_shape, Lq):
    """``None``, or the number of real (not padding) query rows of each batch element as
    intp ``(nbatch,)``: integers broadcastable to ``batch_shape``, each in ``[0, Lq]``."""
    return _lengths(q_lengths, "q_lengths", batch_shape, Lq, "Lq")


def check_kv_lengths(kv_lengths, batch_shape, Lk):
    """``None``, or the number of existing keys of each batch element as intp
    ``(nbatch,)``: integers broadcastable to ``batch_shape``, each in ``[0, Lk]``."""
    return _lengths(kv_lengths, "kv_lengths", batch_shape, Lk, "Lk")


# --------------------------------------------------------------------------- packed sequences

def check_varlen_shapes(q, k, v):
    """``(Hq, Hkv, total_q, total_k, D, Dv)`` of packed ``q (Hq, total_q, D)``,
    ``k (Hkv, total_k, D)``, ``v (Hkv, total_k, Dv)`` (heads first, no batch axes)."""
    for name, a, want in (("q", q, "(Hq, total_q, D)"), ("k", k, "(Hkv, total_k, D)"),
                          ("v", v, "(Hkv, total_k, Dv)")):
        if a.ndim != 3:
            raise ValueError(f"{name} must have shape {want} (packed sequences), got {a.shape}")
    Hq, total_q, D = q.shape
    Hkv, total_k, Dk = k.shape
    if Dk != D:
        raise ValueError(
            f"q and k must have the same head dim D: q.shape={q.shape}, k.shape={k.shape}")
    if v.shape[:2] != (Hkv, total_k):
        raise ValueError(f"k and v must have the same heads and length (Hkv, total_k, :): "
                         f"k.shape={k.shape}, v.shape={v.shape}")
    if Hkv == 0 or Hq % Hkv:
        raise ValueError(f"the number of query heads must be a multiple of the key/value heads: "
                         f"q.shape={q.shape} (Hq={Hq}), k.shape={k.shape} (Hkv={Hkv})")
    return Hq, Hkv, total_q, total_k, D, v.shape[2]


def _cu(cu, name, total, total_name):
    a = _as_array(cu, name)
    if a.dtype.kind not in "iu":
        raise TypeError(
            f"{name} must be a 1-D integer array, got dtype {a.dtype} (shape {a.shape})")
    if a.ndim != 1 or a.size == 0:
        raise ValueError(
            f"{name} must be a 1-D array of n_seq + 1 >= 1 offsets, got shape {a.shape}")
    if a[0] != 0:
        raise ValueError(f"{name} must start at 0, got {name}[0] = {a[0]} (shape {a.shape})")
    down = a[1:] < a[:-1]  # compared, not subtracted: no overflow for any integer dtype
    if down.any():
        s = int(np.argmax(down))
        raise ValueError(f"{name} must be non-decreasing, got {name}[{s}] = {a[s]} > "
                         f"{name}[{s + 1}] = {a[s + 1]} (shape {a.shape})")
    if a[-1] != total:
        raise ValueError(f"{name} must end at {total_name} = {total}, got {name}[-1] = {a[-1]} "
                         f"(shape {a.shape})")
    return np.ascontiguousarray(a, dtype=np.intp)


def check_cu_seqlens(cu_seqlens_q, cu_seqlens_k, total_q, total_k):
    """The sequence offsets as intp arrays ``(n_seq + 1,)``: 1-D integers, starting at 0,
    non-decreasing, ending at ``total_q`` / ``total_k``, the same length for q and k.
    Sequence ``s`` is query rows ``cu_q[s]:cu_q[s+1]`` against keys ``cu_k[s]:cu_k[s+1]``."""
    cu_q = _cu(cu_seqlens_q, "cu_seqlens_q", total_q, "total_q (q.shape[1])")
    cu_k = _cu(cu_seqlens_k, "cu_seqlens_k", total_k, "total_k (k.shape[1])")
    if cu_q.shape != cu_k.shape:
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must have the same length n_seq + 1: "
                         f"cu_seqlens_q.shape={cu_q.shape}, cu_seqlens_k.shape={cu_k.shape}")
    return cu_q, cu_k
