"""The public kernels: argument validation and dispatch to the compiled code.

Everything a caller can get wrong is checked here, before any work starts and before
``out`` is touched; the compiled kernel (src/calls/_entry_points.pxi) never re-validates.  The
front end also decides the compute dtype and makes the last axis of q/k/v contiguous when
it is not (the only copies it makes besides dtype casts; fastattn/_calls/glue.py), and the kernel
turns NumPy broadcasting of the batch dimensions into one element offset per flattened
batch element, so broadcast inputs are read in place.  float16 and bfloat16 inputs are
never cast: the kernel reads them in place and widens them itself, and writes a 16-bit
result directly.
"""
import os

import numpy as np

from . import args as _args
from . import glue as _glue
from . import precision as _precision
from .._machine import threads as _threads
from .glue import kernel as _kernel

__all__ = ["attention", "attention_varlen", "attention_weights", "softmax"]

# Set to False to send every call through the validated path (tests compare the two).
_LEAN_PATH = os.environ.get("FASTATTN_VALIDATED_ONLY", "") in ("", "0")


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
    The score of query ``i`` and key ``j`` is built in this order: ``scale * q_i . k_j``,
    softcap, + ALiBi bias, + float mask, then visibility (causal, window, lengths, bool
    mask).

    Arrays in non-native byte order (a big-endian ``.npy`` file) are converted to native
    order, one copy, and an ``out`` in non-native order receives the result through a
    byte-swapping copy.

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
    if _LEAN_PATH and (window is None and mask is None and kv_lengths is None
                       and type(return_lse) is bool and softcap is None
                       and alibi_slopes is None and q_lengths is None
                       and not _precision.active):
        # The common case is recognised and run entirely in C (see src/calls/_lean_gate.pxi,
        # "The lean call path"); it returns None for anything it does not take.
        res = _kernel.attention_fast(q, k, v, scale, causal, return_lse, out,
                                     _threads.get_num_threads, sinks)
        if res is not None:
            return res
    p = _args.Problem(q, k, v, scale=scale, causal=causal, window=window, mask=mask,
                      kv_lengths=kv_lengths, q_lengths=q_lengths, softcap=softcap,
                      alibi_slopes=alibi_slopes, sinks=sinks, return_lse=return_lse, out=out)
    return _forward(p)


def _forward(p):
    """Run the kernel on a validated :class:`fastattn._calls.args.Problem`."""
    cdt = p.compute_dtype
    q, k, v = (_glue.kernel_ready(a, cdt) for a in (p.q, p.k, p.v))
    q, k, v = _precision.forward_inputs(q, k, v, cdt, p.D, p.Dv)
    full_shape = p.batch + (p.Hq, p.Lq, p.Dv)
    # Write straight into the caller's `out` when the kernel can.
    target = p.out
    if target is not None and p.squeeze_heads:
        target = target[None]
    mask = _glue.kernel_mask(p)
    res, lse, direct = _glue.result_arrays(p, target, cdt, full_shape, (q, k, v, mask))
    _kernel.forward(p, q=q, k=k, v=v, out=res, lse=lse, mask=mask,
                    n_threads=_threads.get_num_threads())
    if p.squeeze_heads:
        res = res[0]
        lse = None if lse is None else lse[0]
    res = _glue.result(p.out, res, p.result_dtype, direct)
    return (res, lse) if p.return_lse else res


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
    scale, causal, window, softcap : optional
        As in :func:`attention`, per sequence (causal and window aligned on each
        sequence's own lengths).
    alibi_slopes, sinks : array_like, optional
        One value per query head, shape ``(Hq,)`` (or broadcastable to it).
    return_lse, out : optional
        As in :func:`attention`; lse has shape ``(Hq, total_q)``.

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
    p = _args.varlen_problem(q, k, v, cu_seqlens_q, cu_seqlens_k, scale=scale, causal=causal,
                             window=window, softcap=softcap, alibi_slopes=alibi_slopes,
                             sinks=sinks, return_lse=return_lse, out=out)
    cdt = p.compute_dtype
    q, k, v = (_glue.kernel_ready(a, cdt) for a in (p.q, p.k, p.v))
    q, k, v = _precision.forward_inputs(q, k, v, cdt, p.D, p.Dv)
    res, lse, direct = _glue.result_arrays(p, p.out, cdt, (p.Hq, p.total_q, p.Dv), (q, k, v))
    _kernel.forward(p, q=q, k=k, v=v, out=res, lse=lse, mask=None,
                    n_threads=_threads.get_num_threads())
    res = _glue.result(p.out, res, p.result_dtype, direct)
    return (res, lse) if p.return_lse else res


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
    p = _args.Problem(q, k, None, scale=scale, causal=causal, window=window, mask=mask,
                      kv_lengths=kv_lengths, q_lengths=q_lengths, softcap=softcap,
                      alibi_slopes=alibi_slopes, sinks=sinks)
    # exp(S - lse): the finished scores against the kernel's own lse, whose denominator
    # holds the sink too; hidden keys and rows that see nothing get 0.  The kernel's lse
    # rounds differently from S here (it sums in base 2), so each row is divided by its
    # own sum, sink included: a common factor, which makes the rows sum to 1 (less the
    # sink's share) to rounding.
    lse = _kernel_lse(p)[..., None]
    lse = np.where(np.isneginf(lse), 0, lse)
    scores, visible = _finished_scores(p)
    with np.errstate(invalid="ignore", over="ignore"):
        e = np.where(visible, np.exp(scores - lse), 0)
        total = e.sum(axis=-1, keepdims=True)
        if p.sinks is not None:
            sink = p.sinks.reshape(p.batch + (p.Hq, 1, 1)).astype(p.compute_dtype)
            total = total + np.exp(sink - lse)
        w = e / np.where(total == 0, 1, total)
    if p.squeeze_heads:
        w = w[0]
    return w.astype(p.result_dtype, copy=False)


def _kernel_lse(p):
    """The kernel's ``lse`` ``(..., Hq, Lq)`` of the call that Problem ``p`` (without
    values) describes: a forward call with one zero value column, which the lse does not
    read."""
    cdt = p.compute_dtype
    q, k = (_glue.kernel_ready(a, cdt) for a in (p.q, p.k))
    v = np.broadcast_to(np.zeros((), cdt), k.shape[:-1] + (1,))
    out = np.empty(p.batch + (p.Hq, p.Lq, 1), cdt)
    lse = np.empty(p.batch + (p.Hq, p.Lq), cdt)
    _kernel.forward(p, q=q, k=k, v=v, out=out, lse=lse, mask=_glue.kernel_mask(p),
                    n_threads=_threads.get_num_threads())
    return lse


def _finished_scores(p):
    """The scores ``(..., Hq, Lq, Lk)`` of Problem ``p`` in its compute dtype, finished in
    the kernel's order (``scale * q . k``, softcap, ALiBi, float mask), and which of them
    are visible: the kernel's rule (key_intervals), the bool mask, and a float mask's
    -inf."""
    cdt = p.compute_dtype
    group = p.Hq // p.Hkv
    # C order whatever the caller's layout: a BLAS product's bits depend on the layout of
    # its operands, and a view must give its copy's weights.
    q = p.q.astype(cdt, order="C").reshape(p.q.shape[:-3] + (p.Hkv, group, p.Lq, p.D))
    k = p.k.astype(cdt, order="C")[..., :, None, :, :]
    with np.errstate(all="ignore"):  # some BLAS kernels raise spurious FP warnings
        s = cdt.type(p.scale) * (q @ np.swapaxes(k, -1, -2))
    full = p.batch + (p.Hq, p.Lq, p.Lk)
    s = np.broadcast_to(s.reshape(s.shape[:-4] + (p.Hq, p.Lq, p.Lk)), full)
    if p.softcap is not None:
        cap = cdt.type(p.softcap)
        with np.errstate(over="ignore"):
            s = cap * np.tanh(s / cap)
    if p.alibi is not None:
        offset = (p.kv_len_flat() - p.q_len_flat()).reshape(p.batch + (1, 1, 1))
        distance = np.abs(np.arange(p.Lq)[:, None] + offset - np.arange(p.Lk))
        s = s - (p.alibi.reshape(p.batch + (p.Hq, 1, 1)) * distance).astype(cdt)
    lo, hi = _kernel.key_intervals(p)
    j = np.arange(p.Lk)
    visible = ((j >= lo[..., None]) & (j < hi[..., None])).reshape(p.batch + (1, p.Lq, p.Lk))
    if p.mask_kind == "bool":
        visible = visible & p.mask
    elif p.mask_kind == "add":
        with np.errstate(invalid="ignore"):
            s = s + p.mask.astype(cdt)
    visible = np.broadcast_to(visible, full) & (s != -np.inf)
    return s, visible


def softmax(x, axis=-1):
    """Numerically stable softmax along ``axis``; a row that is all ``-inf`` gives zeros.

    Integer and bool input is computed in float64, float16 in float32 (returned as float16).
    """
    x = _args.as_array(x, "x")
    cdt, rdt = _args.dtypes(x=x)
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
