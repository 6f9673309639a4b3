"""The public kernels: argument validation and dispatch to the compiled code.

Everything a caller can get wrong is checked here, before any work starts and before
``out`` is touched; the compiled kernel (src/_kernel_impl.pxi) never re-validates.  The
front end also decides the compute dtype, makes the last axis of q/k/v contiguous when it
is not (the only copies it makes besides dtype casts), and turns NumPy broadcasting of the
batch dimensions into one element offset per flattened batch element, so broadcast inputs
are read in place.  float16 and bfloat16 inputs are never cast: the kernel reads them in
place and widens them itself, and writes a 16-bit result directly.
"""
import math
import numbers
import operator

import numpy as np

from . import _threads, _variants
from ._dispatch import kernel as _kernel

__all__ = ["attention", "attention_varlen", "attention_weights", "softmax"]

_CAUSAL_MODES = {
    False: _kernel.CAUSAL_NONE,
    True: _kernel.CAUSAL_BOTTOM_RIGHT,
    "bottom-right": _kernel.CAUSAL_BOTTOM_RIGHT,
    "top-left": _kernel.CAUSAL_TOP_LEFT,
}


# --------------------------------------------------------------------------- validation

def _as_array(x, name):
    if isinstance(x, np.ndarray):
        a = x
    else:
        try:
            a = np.asarray(x)
        except (ValueError, TypeError) as e:  # ragged nested lists, odd objects
            raise ValueError(f"{name} could not be converted to an array: {e}") from None
    if a.dtype.kind not in "biuf" and not _variants.is_bfloat16(a.dtype):
        raise TypeError(
            f"{name} must hold real numbers (bool, integer, float16, bfloat16, float32 or "
            f"float64), got dtype {a.dtype}")
    return a


def _scale(scale, D):
    if scale is None:
        if D == 0:
            raise ValueError("scale=None needs a head dimension D >= 1 (q.shape[-1] is 0)")
        return 1.0 / math.sqrt(D)
    if isinstance(scale, (bool, np.bool_)) or not isinstance(scale, numbers.Real):
        raise TypeError(f"scale must be a real number or None, got {type(scale).__name__}")
    try:
        scale = float(scale)
    except OverflowError:  # an int beyond float's range
        raise ValueError(f"scale must be finite, got {scale}") from None
    if not math.isfinite(scale):
        raise ValueError(f"scale must be finite, got {scale}")
    return scale


def _causal(causal):
    if isinstance(causal, np.bool_):
        causal = bool(causal)
    if isinstance(causal, (bool, str)) and causal in _CAUSAL_MODES:
        return _CAUSAL_MODES[causal]
    if isinstance(causal, str):
        raise ValueError(f"causal must be True, False, 'bottom-right' or 'top-left', got {causal!r}")
    raise TypeError(
        f"causal must be a bool or 'top-left'/'bottom-right', got {type(causal).__name__}")


def _window(window):
    if window is None:
        return -1, -1
    if isinstance(window, np.ndarray):
        window = window.tolist()
    if not isinstance(window, (tuple, list)):  # not any iterable: a dict would unpack its keys
        raise TypeError(f"window must be None or a pair (left, right), got {type(window).__name__}")
    if len(window) != 2:
        raise ValueError(f"window must be None or a pair (left, right), got {window!r}")
    left, right = window
    sides = []
    for side, w in (("left", left), ("right", right)):
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


def _kernel_layout(a):
    """Whether the kernel can address ``a`` in place (the kernel's own rule)."""
    return _kernel.kernel_layout(a)


def _kernel_ready(a, dtype):
    """``a`` as the kernel reads it: 16-bit floats as they are, anything else cast to the
    compute dtype; copied only if the kernel cannot read it in place."""
    if not _variants.is_16bit(a.dtype):
        a = a.astype(dtype, copy=False)
    return a if _kernel_layout(a) else np.ascontiguousarray(a)


def _check_out(out, shape, dtype):
    """``out`` (or None) checked as the preallocated result of that shape and dtype."""
    if out is None:
        return None
    if not isinstance(out, np.ndarray):
        raise TypeError(f"out must be a numpy.ndarray, got {type(out).__name__}")
    if out.shape != shape:
        raise ValueError(f"out must have shape {shape}, got {out.shape}")
    if out.dtype != dtype:
        raise TypeError(f"out must have dtype {dtype}, got {out.dtype}")
    if not out.flags.writeable:
        raise ValueError("out must be writeable")
    return out


def _writes_in_place(target, cdt, inputs):
    """Whether the kernel can write straight into ``target``: the compute dtype (or a 16-bit
    result of float32 compute), rows it can address, and no overlap with an input (tiles
    read the inputs while others are written)."""
    return (target is not None and _kernel_writes(target.dtype, cdt) and _kernel_layout(target)
            and not any(np.may_share_memory(target, a) for a in inputs if a is not None))


def _kernel_writes(dtype, cdt):
    """Whether the kernel writes results of compute dtype ``cdt`` as ``dtype`` itself."""
    return dtype == cdt or (cdt == np.float32 and _variants.is_16bit(dtype))


class _Call:
    """Validated arguments of one attention / attention_weights call."""

    def __init__(self, q, k, v, scale, causal, window, mask, kv_lengths, out, return_lse,
                 softcap=None, alibi_slopes=None, sinks=None, q_lengths=None):
        q = _as_array(q, "q")
        k = _as_array(k, "k")
        arrays = [q, k]
        if v is not None:
            v = _as_array(v, "v")
            arrays.append(v)
        if q.ndim < 2:
            raise ValueError(f"q must have shape (..., Hq, Lq, D), (Hq, Lq, D) or (Lq, D); got {q.shape}")
        for name, a in (("k", k), ("v", v)):
            if a is not None and a.ndim != q.ndim:
                raise ValueError(
                    f"{name} must have as many dimensions as q: q.shape={q.shape}, {name}.shape={a.shape}")
        self.squeeze_heads = q.ndim == 2
        if self.squeeze_heads:  # (L, D): one head
            q, k = q[None], k[None]
            v = None if v is None else v[None]
        Hq, Lq, D = q.shape[-3:]
        Hkv, Lk, Dk = k.shape[-3:]
        if Dk != D:
            raise ValueError(f"q and k must have the same head dim D: q.shape={q.shape}, k.shape={k.shape}")
        if v is not None:
            if v.shape[-3] != Hkv or v.shape[-2] != Lk:
                raise ValueError(
                    f"k and v must have the same heads and length (..., Hkv, Lk, :): "
                    f"k.shape={k.shape}, v.shape={v.shape}")
        if Hkv == 0 or Hq % Hkv:
            raise ValueError(
                f"the number of query heads must be a multiple of the key/value heads: "
                f"q.shape={q.shape} (Hq={Hq}), k.shape={k.shape} (Hkv={Hkv})")
        shapes = [a.shape[:-3] for a in (q, k, v) if a is not None]
        try:
            batch = np.broadcast_shapes(*shapes)
        except ValueError:
            raise ValueError(
                "the batch dimensions of q, k, v do not broadcast: "
                + ", ".join(f"{n}.shape={a.shape}" for n, a in zip("qkv", (q, k, v)) if a is not None)
            ) from None

        self.compute_dtype, self.result_dtype = _variants.dtypes(**dict(zip("qkv", arrays)))
        self.scale = _scale(scale, D)
        self.causal = _causal(causal)
        self.wl, self.wr = _window(window)
        self.batch, self.Hq, self.Hkv, self.Lq, self.Lk, self.D = batch, Hq, Hkv, Lq, Lk, D
        self.Dv = None if v is None else v.shape[-1]
        self.nbatch = math.prod(batch)
        self.mask, self.mask_kind = self._mask(mask)
        self.kv_len = self._kv_lengths(kv_lengths)
        self.softcap = _variants.check_softcap(softcap)
        self.alibi = _variants.check_alibi_slopes(alibi_slopes, batch, Hq)
        self.sinks = _variants.check_sinks(sinks, batch, Hq)
        self.q_len = _variants.check_q_lengths(q_lengths, batch, Lq)
        if not isinstance(return_lse, (bool, np.bool_)):
            raise TypeError(f"return_lse must be a bool, got {type(return_lse).__name__}")
        self.return_lse = bool(return_lse)
        self.out = self._out(out)
        self.q, self.k, self.v = q, k, v

    def _mask(self, mask):
        if mask is None:
            return None, _kernel.MASK_NONE
        mask = _as_array(mask, "mask")
        if mask.dtype.kind == "b":
            kind = _kernel.MASK_BOOL
        elif mask.dtype.kind == "f" or _variants.is_bfloat16(mask.dtype):
            kind = _kernel.MASK_ADD
        else:
            raise TypeError(f"mask must be bool (True = may attend) or floating (added to the "
                            f"scores), got dtype {mask.dtype}")
        target = self.batch + (self.Hq, self.Lq, self.Lk)
        try:
            ok = mask.ndim <= len(target) and np.broadcast_shapes(mask.shape, target) == target
        except ValueError:
            ok = False
        if not ok:
            raise ValueError(f"mask of shape {mask.shape} does not broadcast to (..., Hq, Lq, Lk) = {target}")
        return mask, kind

    def _kv_lengths(self, kv_lengths):
        if kv_lengths is None:
            return None
        kvl = _as_array(kv_lengths, "kv_lengths")
        if kvl.dtype.kind not in "iu":
            raise TypeError(f"kv_lengths must be an integer array, got dtype {kvl.dtype}")
        try:
            kvl = np.broadcast_to(kvl, self.batch)
        except ValueError:
            raise ValueError(
                f"kv_lengths of shape {kvl.shape} does not broadcast to the batch shape {self.batch}") from None
        if kvl.size and (kvl.min() < 0 or kvl.max() > self.Lk):
            raise ValueError(
                f"kv_lengths must lie in [0, Lk] = [0, {self.Lk}], got values in "
                f"[{kvl.min()}, {kvl.max()}]")
        return kvl

    def _out(self, out):
        return _check_out(out, self.result_shape(self.Dv), self.result_dtype)

    def result_shape(self, last):
        shape = self.batch + (self.Hq, self.Lq, last)
        return shape[1:] if self.squeeze_heads else shape

    def kernel_mask(self):
        """The mask as the kernel reads it: a bool mask's bytes, a float mask in the compute
        dtype, broadcast to (..., Hq, Lq, Lk); or None."""
        mask = self.mask
        if mask is None:
            return None
        if self.mask_kind == _kernel.MASK_BOOL:
            mask = mask.view(np.uint8)
        else:
            mask = mask.astype(self.compute_dtype, copy=False)
            if any(st % mask.itemsize for st in mask.strides):
                mask = np.ascontiguousarray(mask)
        return np.broadcast_to(mask, self.batch + (self.Hq, self.Lq, self.Lk))

    def kv_len_flat(self):
        if self.kv_len is None:
            return np.full(self.nbatch, self.Lk, dtype=np.intp)
        return np.ascontiguousarray(self.kv_len.reshape(-1), dtype=np.intp)


# --------------------------------------------------------------------------- public API

def attention(q, k, v, *, scale=None, causal=False, window=None, mask=None,
              kv_lengths=None, return_lse=False, out=None, softcap=None, alibi_slopes=None,
              sinks=None, q_lengths=None):
    """Scaled-dot-product attention, ``softmax(scale * q @ k^T + mask) @ v``, in one fused pass.

    Parameters
    ----------
    q : array_like, shape (..., Hq, Lq, D), (Hq, Lq, D) or (Lq, D)
    k : array_like, shape (..., Hkv, Lk, D), as many dimensions as q
    v : array_like, shape (..., Hkv, Lk, Dv)
        Batch dimensions ``...`` broadcast.  ``Hq`` must be a multiple of ``Hkv``; query
        head ``h`` reads key/value head ``h // (Hq // Hkv)`` (GQA / MQA), never copied.
    scale : float, optional
        Scores are ``scale * q . k``; default ``1 / sqrt(D)``.
    causal : bool or {"bottom-right", "top-left"}, optional
        ``True`` (= "bottom-right"): key ``j`` is visible to query ``i`` iff
        ``j <= i + Lk - Lq`` (FlashAttention >= 2.1; equals PyTorch's ``is_causal`` when
        ``Lq == Lk``).  "top-left": ``j <= i`` (PyTorch's alignment for ``Lq != Lk``).
    window : (int, int), optional
        Sliding window ``(left, right)``, -1 = unbounded: key ``j`` is visible iff
        ``i + Lk - Lq - left <= j <= i + Lk - Lq + right``.  Combines with causal.
    mask : array_like, optional
        Broadcastable to ``(..., Hq, Lq, Lk)``.  bool: True = may attend.  floating: added
        to the scaled scores (``-inf`` hides a key).
    kv_lengths : array_like of int, optional
        Broadcastable to the batch shape; batch element ``b`` only has keys
        ``j < kv_lengths[b]``, and causal/window alignment uses it in place of ``Lk``.
    return_lse : bool, optional
        Also return ``lse = log(sum_j exp(score_ij))`` over visible keys, shape (..., Hq, Lq).
    out : ndarray, optional
        Preallocated result (right shape and dtype), written and returned.
    softcap : float, optional
        Caps the scores smoothly, ``s <- softcap * tanh(s / softcap)`` (Gemma 2, Grok).
    alibi_slopes : array_like, optional
        Broadcastable to ``(..., Hq)``: adds ``-slope[h] * |i + kv_len - q_len - j|`` to the
        score of query ``i`` and key ``j`` (ALiBi, bottom-right aligned).
    sinks : array_like, optional
        Broadcastable to ``(..., Hq)``: one extra logit per head in every row's softmax
        denominator, without a value (gpt-oss); ``-inf`` means no sink.  ``lse`` includes it,
        and a row that sees no key gives zeros and ``lse = sink``.
    q_lengths : array_like of int, optional
        Broadcastable to the batch shape; rows ``i >= q_lengths[b]`` are padding (zeros,
        ``lse = -inf``), and causal/window/ALiBi alignment uses it in place of ``Lq``.

    The score of query ``i`` and key ``j`` is built in this order: ``scale * q_i . k_j``,
    softcap, + ALiBi bias, + float mask, then visibility (causal, window, lengths, bool
    mask).

    Returns
    -------
    out : ndarray, shape (..., Hq, Lq, Dv)
        float16 or bfloat16 when q, k and v all have that dtype (computed in float32,
        rounded once at the end); otherwise ``result_type(q, k, v)`` promoted to float32
        or float64 (bfloat16 counts as float32; integers and bools give float64).  Rows
        that see no key are zeros.
    lse : ndarray, shape (..., Hq, Lq)
        Only with ``return_lse=True``; compute dtype; ``-inf`` for rows that see no key.

    Notes
    -----
    The result of a query row is bitwise identical whatever the thread count, batch size,
    ``Lq`` or the other rows in the call: a decode step reproduces the prefill row exactly.

    float16 and bfloat16 (``ml_dtypes.bfloat16``) inputs are read in place, never copied:
    the kernel widens K and V one key block at a time (exactly: every 16-bit value is a
    float32) and computes in float32, so a float16 cache reads half the bytes of a float32
    one.

    Examples
    --------
    >>> x = np.array([[1., 0.], [0., 1.], [1., 1.]])
    >>> fastattn.attention(x, x, x, scale=1.0, causal=True).round(3)
    array([[1.   , 0.   ],
           [0.269, 0.731],
           [0.788, 0.788]])
    """
    if v is None:
        raise TypeError("v must be an array of shape (..., Hkv, Lk, Dv), got None")
    if (window is None and mask is None and kv_lengths is None and type(return_lse) is bool
            and softcap is None and alibi_slopes is None and q_lengths is None):
        # The common case is validated and run entirely in C (see src/_kernel_impl.pxi,
        # "The lean call path"); it returns None for anything it does not handle.
        res = _kernel.attention_fast(q, k, v, scale, causal, return_lse, out,
                                     _threads.get_num_threads, sinks)
        if res is not None:
            return res
    call = _Call(q, k, v, scale, causal, window, mask, kv_lengths, out, return_lse,
                 softcap, alibi_slopes, sinks, q_lengths)
    cdt = call.compute_dtype
    q, k, v = (_kernel_ready(a, cdt) for a in (call.q, call.k, call.v))
    batch = call.batch
    full_shape = batch + (call.Hq, call.Lq, call.Dv)

    # Write straight into the caller's `out` when the kernel can.
    target = call.out
    if target is not None and target.ndim == len(full_shape) - 1:
        target = target[None]
    direct = _writes_in_place(target, cdt, (q, k, v, call.mask))
    rdt = call.result_dtype if _kernel_writes(call.result_dtype, cdt) else cdt
    res = target if direct else np.empty(full_shape, dtype=rdt)
    lse = np.empty(batch + (call.Hq, call.Lq), dtype=cdt) if call.return_lse else None

    _kernel.forward(
        q, k, v, res, lse, call.kernel_mask(), call.mask_kind, batch, call.kv_len_flat(),
        call.causal, call.wl, call.wr, call.scale, _threads.get_num_threads(),
        call.softcap or 0.0, call.alibi, call.sinks, call.q_len,
    )

    if call.squeeze_heads:
        res = res[0]
        if lse is not None:
            lse = lse[0]
    if call.out is not None:
        if not direct:
            np.copyto(call.out, res, casting="unsafe")
        res = call.out
    elif res.dtype != call.result_dtype:
        res = res.astype(call.result_dtype)
    return (res, lse) if call.return_lse else res


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, *, scale=None, causal=False,
                     window=None, softcap=None, alibi_slopes=None, sinks=None,
                     return_lse=False, out=None):
    """Attention over packed sequences of different lengths, with no padding computed.

    Parameters
    ----------
    q : array_like, shape (Hq, total_q, D)
    k : array_like, shape (Hkv, total_k, D)
    v : array_like, shape (Hkv, total_k, Dv)
        Heads first; a ``(total, H, D)`` array's ``.transpose(1, 0, 2)`` view is read in
        place.
    cu_seqlens_q, cu_seqlens_k : array_like of int, shape (n_seq + 1,)
        Sequence ``s`` is query rows ``cu_seqlens_q[s]:cu_seqlens_q[s+1]`` against keys
        ``cu_seqlens_k[s]:cu_seqlens_k[s+1]``; both start at 0, never decrease and end at
        ``total_q`` / ``total_k``.
    scale, causal, window, softcap : as in :func:`attention`, per sequence (causal and
        window aligned on each sequence's own lengths).
    alibi_slopes, sinks : array_like, optional
        One value per query head, shape ``(Hq,)`` (or broadcastable to it).
    return_lse, out : as in :func:`attention`; lse has shape ``(Hq, total_q)``.

    Returns
    -------
    out : ndarray, shape (Hq, total_q, Dv)
        Each row has the bits of the same row computed by :func:`attention` on its sequence
        alone.  Work is split over threads across sequence boundaries.

    Examples
    --------
    >>> q = np.random.default_rng(0).standard_normal((2, 5, 8))      # lengths 3 and 2
    >>> out = fastattn.attention_varlen(q, q, q, [0, 3, 5], [0, 3, 5], causal=True)
    >>> np.array_equal(out[:, 3:], fastattn.attention(q[:, 3:], q[:, 3:], q[:, 3:], causal=True))
    True
    """
    arrays = {"q": _as_array(q, "q"), "k": _as_array(k, "k"), "v": _as_array(v, "v")}
    Hq, Hkv, total_q, total_k, D, Dv = _variants.check_varlen_shapes(*arrays.values())
    cu_q, cu_k = _variants.check_cu_seqlens(cu_seqlens_q, cu_seqlens_k, total_q, total_k)
    n_seq = cu_q.shape[0] - 1
    cdt, rdt = _variants.dtypes(**arrays)
    sc = _scale(scale, D)
    causal_mode = _causal(causal)
    wl, wr = _window(window)
    cap = _variants.check_softcap(softcap)
    slopes = _variants.check_alibi_slopes(alibi_slopes, (), Hq)
    sink = _variants.check_sinks(sinks, (), Hq)
    per_seq = lambda a: None if a is None else np.ascontiguousarray(np.broadcast_to(a, (n_seq, Hq)))
    if not isinstance(return_lse, (bool, np.bool_)):
        raise TypeError(f"return_lse must be a bool, got {type(return_lse).__name__}")
    out = _check_out(out, (Hq, total_q, Dv), rdt)
    q, k, v = (_kernel_ready(a, cdt) for a in arrays.values())
    direct = _writes_in_place(out, cdt, (q, k, v))
    res = out if direct else np.empty((Hq, total_q, Dv),
                                      dtype=rdt if _kernel_writes(rdt, cdt) else cdt)
    lse = np.empty((Hq, total_q), dtype=cdt) if return_lse else None
    _kernel.forward_packed(q, k, v, res, lse, cu_q, cu_k, causal_mode, wl, wr, sc,
                           _threads.get_num_threads(), cap or 0.0, per_seq(slopes),
                           per_seq(sink))
    if out is not None:
        if not direct:
            np.copyto(out, res, casting="unsafe")
        res = out
    elif res.dtype != rdt:
        res = res.astype(rdt)
    return (res, lse) if return_lse else res


def attention_weights(q, k, *, scale=None, causal=False, window=None, mask=None, kv_lengths=None,
                      softcap=None, alibi_slopes=None, sinks=None, q_lengths=None):
    """The attention probabilities ``softmax(scale * q @ k^T + mask)``, for inspection.

    Same arguments, variants and masking rules as :func:`attention` (without ``v``).
    Materialises the ``(..., Hq, Lq, Lk)`` matrix, so it is meant for plots and small
    inputs; hidden keys get weight 0 and rows that see no key are all zeros.  With
    ``sinks``, each row sums to ``1 - p_sink`` (the sink's share of the denominator).

    Returns
    -------
    ndarray, shape (..., Hq, Lq, Lk), in the result dtype of ``q`` and ``k``.
    """
    call = _Call(q, k, None, scale, causal, window, mask, kv_lengths, None, False,
                 softcap, alibi_slopes, sinks, q_lengths)
    cdt = call.compute_dtype
    q = call.q.astype(cdt, copy=False)
    k = call.k.astype(cdt, copy=False)
    G = call.Hq // call.Hkv
    # Group query heads by the kv head they read: (..., Hkv, G, Lq, D) @ (..., Hkv, 1, D, Lk).
    qg = q.reshape(q.shape[:-3] + (call.Hkv, G, call.Lq, call.D))
    kt = np.swapaxes(k, -1, -2)[..., :, None, :, :]
    # errstate: some BLAS kernels (OpenBLAS's SME matmul) raise spurious FP warnings, and
    # this function never warns.
    with np.errstate(all="ignore"):
        scores = np.matmul(qg, kt).reshape(call.batch + (call.Hq, call.Lq, call.Lk))
    scores = scores * cdt.type(call.scale)
    if call.softcap is not None:
        c = cdt.type(call.softcap)
        scores = c * np.tanh(scores / c)
    per_head = call.batch + (call.Hq, 1, 1)
    q_len = call.q_len if call.q_len is not None else np.full(call.nbatch, call.Lq, np.intp)
    if call.alibi is not None:
        diag = (np.arange(call.Lq)[:, None] + (call.kv_len_flat() - q_len)[:, None, None])
        dist = np.abs(diag[:, None, :, :] - np.arange(call.Lk))     # (nbatch, 1, Lq, Lk)
        bias = -call.alibi[:, :, None, None] * dist
        scores = scores + bias.reshape(call.batch + bias.shape[1:]).astype(cdt)

    # Visibility from the kernel's own rule (one definition for every code path).
    lo, hi = _kernel.key_intervals(call.Lq, call.kv_len_flat(), call.causal, call.wl, call.wr,
                                   call.q_len)
    lo = lo.reshape(call.batch + (1, call.Lq, 1))
    hi = hi.reshape(call.batch + (1, call.Lq, 1))
    j = np.arange(call.Lk)
    visible = (j >= lo) & (j < hi)
    if call.mask is not None:
        if call.mask_kind == _kernel.MASK_BOOL:
            visible = visible & call.mask
        else:
            with np.errstate(invalid="ignore"):
                scores = scores + call.mask.astype(cdt, copy=False)
    scores = np.where(visible, scores, cdt.type(-np.inf))
    if call.sinks is None:
        w = softmax(scores, axis=-1)
    else:
        w = _softmax_with_sink(scores, call.sinks.reshape(per_head).astype(cdt))
    if call.squeeze_heads:
        w = w[0]
    return w.astype(call.result_dtype, copy=False)


def _softmax_with_sink(scores, sink):
    """Rows of exp(s_j) / (exp(sink) + sum_j exp(s_j)), shifted by max(row max, sink)."""
    m = np.maximum(np.max(scores, axis=-1, keepdims=True) if scores.shape[-1] else sink, sink)
    m = np.where(np.isneginf(m), 0, m)
    e = np.exp(scores - m)
    den = np.exp(sink - m) + np.sum(e, axis=-1, keepdims=True)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(den == 0, 0, e / np.where(den == 0, 1, den))


def softmax(x, axis=-1):
    """Numerically stable softmax along ``axis``; a row that is all ``-inf`` gives zeros.

    Integer and bool input is computed in float64, float16 in float32 (returned as float16).
    """
    x = _as_array(x, "x")
    cdt, rdt = _variants.dtypes(x=x)
    x = x.astype(cdt, copy=False)
    m = np.max(x, axis=axis, keepdims=True) if x.size else np.zeros_like(x)
    # Subtract the row max (stability); a row with no finite max subtracts 0 instead.
    m = np.where(np.isneginf(m), cdt.type(0), m)
    e = np.exp(x - m)
    s = np.sum(e, axis=axis, keepdims=True)
    with np.errstate(invalid="ignore", divide="ignore"):
        # s == 0 only when every entry was -inf; NaN inputs still propagate.
        y = np.where(s == 0, cdt.type(0), e / np.where(s == 0, 1, s))
    return y.astype(rdt, copy=False)
