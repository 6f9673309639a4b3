"""Every argument rule of fastattn, each written once: what is legal, and what it means.

Every entry point -- :func:`fastattn.attention`, ``attention_varlen``, ``attention_weights``,
the backward passes, the NumPy oracle :mod:`fastattn.reference` and the layers -- checks its
arguments by calling the functions here, so no two of them can disagree about which calls
are legal.  The compiled kernel never re-validates; its lean call path
(``attention_fast``) only recognises the common case and hands everything else back here.

Every function is pure: it reads its arguments, raises ``TypeError`` (the wrong kind of
thing: a string for a number, a complex array) or ``ValueError`` (the right kind, a wrong
shape or value) with a message that names the argument and the shapes involved, and
otherwise returns the argument normalised to the form a kernel wants.

=============================  =========================================================
rule                           owner (returns)
=============================  =========================================================
array-like in, byte order      ``as_array`` (an ndarray in native byte order)
a layer's input or weight      ``check_array`` (``as_array`` of a legal dtype)
a size or count                ``check_index`` (an int ``>= minimum``)
one array's dtype              ``check_dtype`` (real numbers: bool, integers, floats)
dtypes of q, k, v (or any x)   ``dtypes`` (``(compute_dtype, result_dtype)``)
bfloat16                       ``is_bfloat16`` / ``is_16bit``
q, k, v shapes and batch       ``check_shapes`` (a :class:`Shapes`)
scale                          ``check_scale`` (a finite float)
causal                         ``check_causal`` (``"none"``, ``"bottom-right"``, ``"top-left"``);
                               ``CAUSAL_CODES`` gives the kernel's code of each
window                         ``check_window`` (``(left, right)``, -1 = unbounded)
mask                           ``check_mask`` (``(mask, "bool" | "add")`` or ``(None, None)``)
kv_lengths / q_lengths         ``check_kv_lengths`` / ``check_q_lengths`` (intp ``(nbatch,)``),
                               both ``check_lengths``, which a KV cache's lengths share
softcap                        ``check_softcap`` (``None`` or a finite float > 0)
alibi_slopes / sinks           ``check_alibi_slopes`` / ``check_sinks`` (float64 ``(nbatch, Hq)``)
return_lse                     ``check_flag`` (a bool)
out                            ``check_out`` (the array, or ``None``)
cu_seqlens_q / cu_seqlens_k    ``check_cu_seqlens`` (intp ``(n_seq + 1,)`` each)
packed q, k, v shapes          ``check_varlen_shapes``
a KV cache's storage dtype     ``storage_dtype``; ``round_to`` and ``store_as`` round to it
one whole call                 :class:`Problem` / :func:`varlen_problem`, built from the above
a backward's dout, out, lse    ``check_forward_result`` (the forward result's shapes, dtypes)
a gradient's dtype             ``grad_dtype``
=============================  =========================================================

``nbatch`` is ``prod(batch_shape)``: batch element ``b`` of the flattened, broadcast batch
is row ``b``; ``arr.reshape(batch_shape + arr.shape[1:])`` restores the batch axes.

Decisions where NumPy, PyTorch and the models leave room:

- Arrays in non-native byte order (e.g. ``>f4`` from a big-endian ``.npy`` file) are
  converted to native order, one copy, and computed like any other; an ``out`` in
  non-native order receives the result through a byte-swapping copy.
- A wrong *type* of argument is a ``TypeError`` everywhere: ``causal=1.5``, ``scale="2"``,
  ``window=(1.5, 2)``, ``out`` of the wrong dtype.  A wrong *value* or *shape* of the right
  type is a ``ValueError``: ``causal="left"``, ``window=(1, 2, 3)``, ``out`` of the wrong
  shape or read-only.
- ``window`` is ``None``, a tuple, list or ndarray of two ints; other iterables (a dict
  would unpack its keys) are rejected.
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
- q, k and v of integer or bool dtype stay legal (computed in float64); which dtypes a KV
  cache may store is :func:`storage_dtype`'s separate question.
"""
import math
import numbers
import operator
from types import SimpleNamespace

import numpy as np

__all__ = [
    "as_array", "check_array", "check_index", "is_bfloat16", "is_16bit", "check_dtype",
    "dtypes", "check_lengths",
    "check_shapes", "Shapes",
    "check_scale", "check_causal", "check_window", "check_flag", "check_mask",
    "check_softcap", "check_alibi_slopes", "check_sinks", "check_q_lengths",
    "check_kv_lengths", "check_out", "check_varlen_shapes", "check_cu_seqlens",
    "storage_dtype", "round_to", "store_as", "Problem", "varlen_problem",
    "check_forward_result", "grad_dtype", "CAUSAL_CODES", "MASK_CODES",
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


def _native(dtype):
    return dtype if dtype.isnative else dtype.newbyteorder("=")


def check_dtype(a, name):
    dt = a.dtype
    if dt.kind in "biu" or _native(dt) in _NATIVE_FLOATS or is_bfloat16(dt):
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
        check_dtype(a, name)
    dts = [_native(a.dtype) for a in arrays.values()]
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
        # bfloat16's finfo is ml_dtypes' (installed wherever a bfloat16 dtype exists).
        finfo = np.finfo
        if is_bfloat16(dtype):
            import ml_dtypes
            finfo = ml_dtypes.finfo
        limit = float(finfo(dtype).max)
        wider = {"float16": "bfloat16 or float32", "bfloat16": "float32"}.get(dtype.name,
                                                                             "float64")
        raise ValueError(
            f"{name} has values beyond {dtype.name}'s range (|x| <= {limit:.6g}), up to "
            f"{float(np.abs(a.astype(np.float64)[big]).max()):.6g}: store it as {wider} "
            "instead")
    return out


# --------------------------------------------------------------------------- scalars

def _finite_real(x, name, expected):
    """``x`` as a finite float: bools and non-reals are a ``TypeError`` saying what was
    ``expected``, infinities and NaN a ``ValueError``."""
    if isinstance(x, (bool, np.bool_)) or not isinstance(x, numbers.Real):
        raise TypeError(f"{name} must be {expected}, got {type(x).__name__}")
    try:
        value = float(x)
    except OverflowError:  # an int beyond float's range
        raise ValueError(f"{name} must be finite, got {x}") from None
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {x}")
    return value


def check_softcap(softcap):
    """``None`` or ``softcap`` as a finite float ``> 0``; bools and non-reals are rejected."""
    if softcap is None:
        return None
    value = _finite_real(softcap, "softcap", "None or a real number > 0")
    if value <= 0:
        raise ValueError(f"softcap must be a finite number > 0 (None turns it off), got {softcap}")
    return value


def check_scale(scale, D):
    """``scale`` as a finite float; ``None`` gives ``1 / sqrt(D)``."""
    if scale is None:
        if D == 0:
            raise ValueError("scale=None needs a head dimension D >= 1 (q.shape[-1] is 0)")
        return 1.0 / math.sqrt(D)
    return _finite_real(scale, "scale", "a real number or None")


_CAUSAL = {False: "none", True: "bottom-right", "bottom-right": "bottom-right",
           "top-left": "top-left"}

# The compiled kernel's code of each normalised ``causal`` and mask kind (FA_CAUSAL_* of
# src/pipeline/fa_kernels.h; the Problem's mask kinds, src/pipeline/_tile_state.pxi), which
# the kernel checks against its own when it loads.  A :class:`Problem` carries its codes.
CAUSAL_CODES = {"none": 0, "bottom-right": 1, "top-left": 2}
MASK_CODES = {None: 0, "bool": 1, "add": 2}


def check_causal(causal):
    """``causal`` as ``"none"``, ``"bottom-right"`` (``True``) or ``"top-left"``."""
    if isinstance(causal, np.bool_):
        causal = bool(causal)
    if isinstance(causal, (bool, str)) and causal in _CAUSAL:
        return _CAUSAL[causal]
    if isinstance(causal, str):
        raise ValueError(
            f"causal must be True, False, 'bottom-right' or 'top-left', got {causal!r}")
    raise TypeError(
        f"causal must be a bool or 'top-left'/'bottom-right', got {type(causal).__name__}")


def check_window(window):
    """``window`` as ``(left, right)`` ints, -1 = unbounded on that side; ``None`` gives
    ``(-1, -1)``."""
    if window is None:
        return -1, -1
    if isinstance(window, np.ndarray):
        window = window.tolist()
    if not isinstance(window, (tuple, list)):  # not any iterable: a dict would unpack its keys
        raise TypeError(f"window must be None or a pair (left, right), got {type(window).__name__}")
    if len(window) != 2:
        raise ValueError(f"window must be None or a pair (left, right), got {window!r}")
    sides = []
    for side, w in zip(("left", "right"), window):
        if isinstance(w, (bool, np.bool_)):
            raise TypeError(f"window {side} must be an int, got bool")
        try:
            w = operator.index(w)
        except TypeError:
            raise TypeError(f"window {side} must be an int, got {type(w).__name__}") from None
        if w < -1:
            raise ValueError(f"window {side} must be >= 0 or -1 (unbounded), got {w}")
        # Any width beyond 2**62 is wider than every sequence: keep it in C's range.
        sides.append(min(w, 2**62))
    return sides[0], sides[1]


def check_flag(value, name):
    """A bool keyword (``return_lse``) as a Python bool; NumPy bools count."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    return bool(value)


def check_index(value, name, minimum):
    """``value`` as a Python int ``>= minimum`` (sizes and counts of the layers, positions
    and KV cache: ``d_model``, ``n_heads``, ``capacity``, ...); NumPy integers count, floats
    do not."""
    try:
        value = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an integer, got {type(value).__name__}") from None
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


# --------------------------------------------------------------------------- arrays

def as_array(x, name):
    """``x`` as an ndarray in native byte order: the one way every entry point reads an
    array argument.  Ragged lists and other unconvertible objects raise ``ValueError``; a
    non-native array (``>f4`` on a little-endian machine) is converted, one copy, since the
    kernels read native numbers.  Which dtypes are legal is each argument's own rule."""
    if not isinstance(x, np.ndarray):
        try:
            x = np.asarray(x)
        except (ValueError, TypeError) as e:  # ragged nested lists, odd objects
            raise ValueError(f"{name} could not be converted to an array: {e}") from None
    if not x.dtype.isnative:
        x = x.astype(x.dtype.newbyteorder("="))
    return x


def check_array(a, name):
    """``a`` as an array (:func:`as_array`) of a dtype the kernels take
    (:func:`check_dtype`): the inputs and weights of the layers."""
    a = as_array(a, name)
    check_dtype(a, name)
    return a


def _per_head(values, name, batch_shape, Hq, allow_minus_inf):
    if values is None:
        return None
    a = as_array(values, name)
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


def check_lengths(lengths, name, batch_shape, limit, limit_name):
    if lengths is None:
        return None
    a = as_array(lengths, name)
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
    return check_lengths(q_lengths, "q_lengths", batch_shape, Lq, "Lq")


def check_kv_lengths(kv_lengths, batch_shape, Lk):
    """``None``, or the number of existing keys of each batch element as intp
    ``(nbatch,)``: integers broadcastable to ``batch_shape``, each in ``[0, Lk]``."""
    return check_lengths(kv_lengths, "kv_lengths", batch_shape, Lk, "Lk")


# --------------------------------------------------------------------------- packed sequences

def check_varlen_shapes(q, k, v):
    """``(Hq, Hkv, total_q, total_k, D, Dv)`` of packed ``q (Hq, total_q, D)``,
    ``k (Hkv, total_k, D)``, ``v (Hkv, total_k, Dv)`` (heads first, no batch axes)."""
    for name, a, want in (("q", q, "(Hq, total_q, D)"), ("k", k, "(Hkv, total_k, D)"),
                          ("v", v, "(Hkv, total_k, Dv)")):
        if a.ndim != 3:
            raise ValueError(f"{name} must have shape {want} (packed sequences), got {a.shape}")
    _check_shapes(q, k, v, "(Hkv, total_k, :)")
    (Hq, total_q, D), (Hkv, total_k, _) = q.shape, k.shape
    return Hq, Hkv, total_q, total_k, D, v.shape[2]


def _check_shapes(q, k, v, kv_axes):
    """q, k and v (or None) agree on their last three axes ``(heads, length, dim)``: one
    head dim D, k's heads and length for v, ``Hq`` a multiple of ``Hkv``.  ``kv_axes``
    spells k's and v's axes for the message."""
    D = q.shape[-1]
    Hkv, Lk, Dk = k.shape[-3:]
    if Dk != D:
        raise ValueError(f"q and k must have the same head dim D: q.shape={q.shape}, k.shape={k.shape}")
    if v is not None and v.shape[-3:-1] != (Hkv, Lk):
        raise ValueError(f"k and v must have the same heads and length {kv_axes}: "
                         f"k.shape={k.shape}, v.shape={v.shape}")
    check_gqa(q, k, "k")


def check_gqa(q, k, k_name):
    """A ``ValueError`` unless q's heads (axis -3) are a multiple of ``k``'s, which are
    not 0: query head ``h`` reads key/value head ``h // (Hq // Hkv)`` (GQA, MQA)."""
    Hq, Hkv = q.shape[-3], k.shape[-3]
    if Hkv == 0 or Hq % Hkv:
        raise ValueError(f"the number of query heads must be a multiple of the key/value heads: "
                         f"q.shape={q.shape} (Hq={Hq}), {k_name}.shape={k.shape} (Hkv={Hkv})")


def _cu(cu, name, total, total_name):
    a = as_array(cu, name)
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


# --------------------------------------------------------------------------- one call

def check_mask(mask, full_shape):
    """``(mask, kind)``: the mask as an array that broadcasts to ``full_shape`` =
    ``(..., Hq, Lq, Lk)``, kind ``"bool"`` (True = may attend) or ``"add"`` (floating,
    added to the scaled scores); ``(None, None)`` without a mask."""
    if mask is None:
        return None, None
    mask = as_array(mask, "mask")
    if mask.dtype.kind == "b":
        kind = "bool"
    elif mask.dtype.kind == "f" or is_bfloat16(mask.dtype):
        kind = "add"
    else:
        raise TypeError(f"mask must be bool (True = may attend) or floating (added to the "
                        f"scores), got dtype {mask.dtype} (shape {mask.shape})")
    try:
        ok = mask.ndim <= len(full_shape) and np.broadcast_shapes(mask.shape, full_shape) == full_shape
    except ValueError:
        ok = False
    if not ok:
        raise ValueError(f"mask of shape {mask.shape} does not broadcast to (..., Hq, Lq, Lk) = {full_shape}")
    return mask, kind


def check_out(out, shape, dtype, name="out"):
    """``out`` (or None) checked as a preallocated result of that shape and dtype: an
    ndarray, writeable, in any byte order."""
    if out is None:
        return None
    if not isinstance(out, np.ndarray):
        raise TypeError(f"{name} must be a numpy.ndarray, got {type(out).__name__}")
    if out.shape != shape:
        raise ValueError(f"{name} must have shape {shape}, got {out.shape}")
    if _native(out.dtype) != dtype:
        raise TypeError(f"{name} must have dtype {dtype}, got {out.dtype}")
    if not out.flags.writeable:
        raise ValueError(f"{name} must be writeable")
    return out


class Shapes:
    """The sizes of q ``(..., Hq, Lq, D)``, k ``(..., Hkv, Lk, D)`` and v
    ``(..., Hkv, Lk, Dv)`` (v may be None), checked; ``(L, D)`` inputs count as one head
    (``squeeze_heads``), and ``q, k, v`` here always have a head axis."""

    def __init__(self, q, k, v):
        if q.ndim < 2:
            raise ValueError(f"q must have shape (..., Hq, Lq, D), (Hq, Lq, D) or (Lq, D); got {q.shape}")
        for name, a in (("k", k), ("v", v)):
            if a is not None and a.ndim != q.ndim:
                raise ValueError(
                    f"{name} must have as many dimensions as q: q.shape={q.shape}, {name}.shape={a.shape}")
        self.squeeze_heads = q.ndim == 2
        if self.squeeze_heads:
            q, k = q[None], k[None]
            v = None if v is None else v[None]
        _check_shapes(q, k, v, "(..., Hkv, Lk, :)")
        self.Hq, self.Lq, self.D = q.shape[-3:]
        self.Hkv, self.Lk = k.shape[-3:-1]
        named = [(n, a) for n, a in zip("qkv", (q, k, v)) if a is not None]
        try:
            self.batch = np.broadcast_shapes(*[a.shape[:-3] for _, a in named])
        except ValueError:
            raise ValueError("the batch dimensions of q, k, v do not broadcast: " + ", ".join(
                f"{n}.shape={a.shape}" for n, a in named)) from None
        self.Dv = None if v is None else v.shape[-1]
        self.nbatch = math.prod(self.batch)
        self.q, self.k, self.v = q, k, v

    def result_shape(self, *last):
        """``batch + (Hq, Lq) + last``, without the head axis for ``(L, D)`` inputs."""
        shape = self.batch + (self.Hq, self.Lq) + last
        return shape[1:] if self.squeeze_heads else shape


def check_shapes(q, k, v):
    """:class:`Shapes` of ndarrays q, k and v (or None)."""
    return Shapes(q, k, v)


class Problem(Shapes):
    """Every argument of one ``attention``-style call, checked in one place and normalised:

    - ``q, k, v``: ndarrays in native byte order, with a head axis (see :class:`Shapes`);
    - ``compute_dtype``, ``result_dtype`` (:func:`dtypes`);
    - ``scale`` (float), ``causal`` (a string of :func:`check_causal`), ``wl, wr``
      (:func:`check_window`), ``mask, mask_kind`` (:func:`check_mask`), and the kernel's
      codes of the two, ``causal_code`` and ``mask_code``;
    - ``kv_len``, ``q_len``: ``None`` or intp ``(nbatch,)``; ``softcap``: ``None`` or float;
      ``alibi``, ``sinks``: ``None`` or float64 ``(nbatch, Hq)``;
    - ``return_lse`` (bool) and ``out`` (checked against the result's shape and dtype).

    ``v=None`` describes ``attention_weights``, which has no values (nor ``out``).

    The compiled kernel reads its description of the call from these attributes, by name
    (``_fill_problem`` in src/calls/_problem.pxi): a new keyword is a new attribute here and one
    line there.  ``packed`` is False (:func:`varlen_problem` describes packed sequences).
    """
    packed = False

    def __init__(self, q, k, v, *, scale=None, causal=False, window=None, mask=None,
                 kv_lengths=None, q_lengths=None, softcap=None, alibi_slopes=None, sinks=None,
                 return_lse=False, out=None):
        arrays = {"q": as_array(q, "q"), "k": as_array(k, "k")}
        if v is not None:
            arrays["v"] = as_array(v, "v")
        self.compute_dtype, self.result_dtype = dtypes(**arrays)
        super().__init__(arrays["q"], arrays["k"], arrays.get("v"))
        self.scale = check_scale(scale, self.D)
        self.causal = check_causal(causal)
        self.causal_code = CAUSAL_CODES[self.causal]
        self.wl, self.wr = check_window(window)
        self.mask, self.mask_kind = check_mask(mask, self.batch + (self.Hq, self.Lq, self.Lk))
        self.mask_code = MASK_CODES[self.mask_kind]
        self.kv_len = check_kv_lengths(kv_lengths, self.batch, self.Lk)
        self.softcap = check_softcap(softcap)
        self.alibi = check_alibi_slopes(alibi_slopes, self.batch, self.Hq)
        self.sinks = check_sinks(sinks, self.batch, self.Hq)
        self.q_len = check_q_lengths(q_lengths, self.batch, self.Lq)
        self.return_lse = check_flag(return_lse, "return_lse")
        self.out = None if v is None else check_out(out, self.result_shape(self.Dv),
                                                    self.result_dtype)

    def kv_len_flat(self):
        """The number of keys of every batch element, intp ``(nbatch,)``."""
        return np.full(self.nbatch, self.Lk, np.intp) if self.kv_len is None else self.kv_len

    def q_len_flat(self):
        """The number of real query rows of every batch element, intp ``(nbatch,)``."""
        return np.full(self.nbatch, self.Lq, np.intp) if self.q_len is None else self.q_len


def varlen_problem(q, k, v, cu_seqlens_q, cu_seqlens_k, *, scale=None, causal=False,
                   window=None, softcap=None, alibi_slopes=None, sinks=None,
                   return_lse=False, out=None):
    """Every argument of one ``attention_varlen``-style call, checked and normalised, as
    a namespace: ``q, k, v``, the sizes of :func:`check_varlen_shapes`, ``cu_q, cu_k``,
    ``n_seq``, the dtypes, and the keywords as :class:`Problem` has them (``alibi`` and
    ``sinks`` float64 ``(n_seq, Hq)``, one row per sequence), with ``packed`` True."""
    p = SimpleNamespace(q=as_array(q, "q"), k=as_array(k, "k"), v=as_array(v, "v"), packed=True)
    p.compute_dtype, p.result_dtype = dtypes(q=p.q, k=p.k, v=p.v)
    p.Hq, p.Hkv, p.total_q, p.total_k, p.D, p.Dv = check_varlen_shapes(p.q, p.k, p.v)
    p.cu_q, p.cu_k = check_cu_seqlens(cu_seqlens_q, cu_seqlens_k, p.total_q, p.total_k)
    p.n_seq = p.cu_q.shape[0] - 1
    p.scale = check_scale(scale, p.D)
    p.causal = check_causal(causal)
    p.causal_code = CAUSAL_CODES[p.causal]
    p.mask, p.mask_kind = None, None
    p.mask_code = MASK_CODES[None]
    p.wl, p.wr = check_window(window)
    p.softcap = check_softcap(softcap)
    per_seq = lambda a: None if a is None else np.ascontiguousarray(
        np.broadcast_to(a, (p.n_seq, p.Hq)))
    p.alibi = per_seq(check_alibi_slopes(alibi_slopes, (), p.Hq))
    p.sinks = per_seq(check_sinks(sinks, (), p.Hq))
    p.return_lse = check_flag(return_lse, "return_lse")
    p.out = check_out(out, (p.Hq, p.total_q, p.Dv), p.result_dtype)
    return p


def grad_dtype(dtype, fallback):
    """The dtype of the gradient of an input of ``dtype``: that dtype when it is floating
    (16-bit included), else ``fallback`` (integers and bools have no gradient dtype)."""
    dtype = np.dtype(dtype)
    return dtype if dtype.kind == "f" or is_16bit(dtype) else np.dtype(fallback)


def check_forward_result(out_shape, out_dtype, lse_dtype, dout, out, lse, dlse):
    """``dout, out, lse, dlse`` of a backward call as arrays, each with the shape and dtype
    the forward call gives ``out`` (dout, out) or ``lse`` (lse, dlse; dlse may be None):
    an ``lse`` that could not have come from this forward (another ``Lq``) is refused."""
    lse_shape = out_shape[:-1]
    checked = []
    for name, a, shape, dtype, of in (("dout", dout, out_shape, out_dtype, "out"),
                                      ("out", out, out_shape, out_dtype, "out"),
                                      ("lse", lse, lse_shape, lse_dtype, "lse"),
                                      ("dlse", dlse, lse_shape, lse_dtype, "lse")):
        if a is None and name == "dlse":
            checked.append(None)
            continue
        a = as_array(a, name)
        if a.shape != shape:
            raise ValueError(f"{name} must have the shape of the forward's {of}, {shape} for "
                             f"these q, k, v; got {a.shape}")
        if a.dtype != dtype:
            raise TypeError(f"{name} must have the dtype of the forward's {of}, {dtype}; "
                            f"got {a.dtype}")
        checked.append(a)
    return checked
