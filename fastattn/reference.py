"""Plain NumPy attention: the oracle the fast kernels are checked against.

This module is the textbook math, written once for arrays of any batch shape, with the
score modifiers of today's models applied in FlashAttention's order:

1. **scores** -- every query is compared with every key by a scaled dot product::

       S[i, j] = scale * q_i . k_j          (scale = 1/sqrt(D) unless given)

2. **softcap** (Gemma 2, Grok), when given -- the scores are squashed into
   ``(-softcap, softcap)``::

       S[i, j] <- softcap * tanh(S[i, j] / softcap)

3. **ALiBi** (BLOOM, MPT), when ``alibi_slopes`` are given -- a penalty that grows with the
   distance between the query's position and the key's, both aligned bottom-right::

       S[i, j] <- S[i, j] - slope[h] * |i + (kv_len - q_len) - j|

4. **float mask**, when ``mask`` is floating -- added to the scores (``-inf`` hides a key).

5. **visibility** -- some keys may not be seen by query ``i`` (causal masking, a sliding
   window, right padding given by ``kv_lengths`` and ``q_lengths``, a boolean ``mask``).
   Hidden keys get the score ``-inf``.

6. **softmax** over the keys of each row, shifted by the row maximum so ``exp`` never
   overflows (scores in the tens of thousands are fine). With ``sinks`` (gpt-oss),
   one extra logit per head joins the denominator and has no value::

       P[i, j] = exp(S[i, j]) / (exp(sink[h]) + sum_j' exp(S[i, j']))

   Without sinks ``exp(sink)`` is 0: the plain softmax. With them a row of ``P`` sums to
   ``1 - p_sink``, the weight the sink takes.

7. **weighted sum** of the values -- the context vectors::

       out_i = sum_j P[i, j] v_j

   and, on request, the log of the denominator actually used,
   ``lse_i = log(exp(sink[h]) + sum_j exp(S[i, j]))``, which lets partial results over
   disjoint key sets be merged exactly.

A row that sees no key at all has no distribution to normalise: its output is zeros and its
``lse`` is the sink (``-inf`` without sinks) -- never NaN, never a warning. Padding query
rows (``i >= q_lengths[b]``) are not rows at all: zeros and ``lse = -inf``, sinks or not.

Visibility, in the notation of the contract (``Lq`` queries, ``Lk`` keys; for batch element
``b``, ``kv_len = kv_lengths[b]`` (default ``Lk``) and ``q_len = q_lengths[b]`` (default
``Lq``), and ``offset = kv_len - q_len``)::

    query i exists        iff  i < q_len
    key j exists          iff  j < kv_len
    causal=True           iff  j <= i + offset                 (bottom-right aligned;
                                                                also causal="bottom-right")
    causal="top-left"     iff  j <= i                          (PyTorch's is_causal)
    window=(left, right)  iff  i + offset - left <= j <= i + offset + right   (-1: unbounded)
    boolean mask          iff  mask[..., h, i, j] is True

ALiBi uses the same ``offset`` whatever ``causal`` says.

:func:`attention_varlen` runs packed sequences (FlashAttention's ``cu_seqlens``) by calling
:func:`attention` on each sequence alone, which is the definition of its result.

:func:`attention_backward` gives the gradients of :func:`attention` with respect to q, k, v
and sinks, from the same materialised scores and the textbook formulas.

Unlike the kernels, everything here materialises the full ``(..., Hq, Lq, Lk)`` score matrix
and computes in float64 whatever the input dtype (from the values as given: float16 and
bfloat16 inputs are already rounded), so that it is a better oracle than the code it checks.
Only the returned dtype follows the public contract: float16 or bfloat16 out only when q, k
and v all have that dtype, float32 for any other mix involving them, integers and bool ->
float64; the float64 result is rounded once to it. ``lse`` is in the compute dtype (float32
for float16/bfloat16/float32, float64 otherwise). bfloat16 is ``ml_dtypes.bfloat16``;
without the ``ml_dtypes`` package no array has that dtype, and nothing here imports it.

Arguments are validated by :mod:`fastattn._variants` (the variants, dtypes and lengths) and
by the few checks below, each failing with a clear ``ValueError``/``TypeError`` that names
the argument before any work starts.
"""
import math
import numbers
from types import SimpleNamespace

import numpy as np

from . import _variants

__all__ = ["attention", "attention_varlen", "attention_weights", "softmax", "visible_keys",
           "attention_backward"]


# --------------------------------------------------------------------------- dtypes

# --------------------------------------------------------------------------- shapes

def _split_shapes(q, k, v=None):
    """Check q/k/v shapes; return (batch_shape, Hq, Hkv, Lq, Lk, D, Dv, squeeze_head).

    ``(Lq, D)`` inputs are handled as one head; ``squeeze_head`` says to drop it again.
    """
    named = [("q", q), ("k", k)] + ([("v", v)] if v is not None else [])
    for name, a in named:
        if a.ndim < 2:
            raise ValueError(f"{name} must have at least 2 dims (Lq/Lk, D), got shape {a.shape}")
    for name, a in named[1:]:
        if a.ndim != q.ndim:
            raise ValueError(
                f"{name} must have as many dims as q: q.shape={q.shape}, {name}.shape={a.shape}"
            )
    squeeze_head = q.ndim == 2
    if squeeze_head:
        q, k = q[None], k[None]
        v = v[None] if v is not None else None

    Hq, Lq, D = q.shape[-3:]
    Hkv, Lk, Dk = k.shape[-3:]
    if Dk != D:
        raise ValueError(f"k's last dim must equal q's (D): q.shape={q.shape}, k.shape={k.shape}")
    Dv = D
    if v is not None:
        if v.shape[-3:-1] != (Hkv, Lk):
            raise ValueError(
                f"v must have the heads and length of k (Hkv, Lk): "
                f"k.shape={k.shape}, v.shape={v.shape}"
            )
        Dv = v.shape[-1]
    if Hkv == 0 or Hq % Hkv != 0:
        raise ValueError(
            f"the number of query heads must be a multiple of the key/value heads: "
            f"Hq={Hq} (q.shape={q.shape}), Hkv={Hkv} (k.shape={k.shape})"
        )
    try:
        batch_shape = np.broadcast_shapes(*[a.shape[:-3] for _, a in named])
    except ValueError:
        shapes = ", ".join(f"{name}.shape={a.shape}" for name, a in named)
        raise ValueError(f"batch dims of q, k, v do not broadcast: {shapes}") from None
    return batch_shape, Hq, Hkv, Lq, Lk, D, Dv, squeeze_head


def _expand_kv_heads(x, Hq):
    """Give every query head h its key/value head h // (Hq // Hkv) (GQA/MQA) by indexing."""
    Hkv = x.shape[-3]
    return np.take(x, np.arange(Hq) // (Hq // Hkv), axis=-3)


# --------------------------------------------------------------------------- arguments

def _check_scale(scale, D):
    if scale is None:
        if D == 0:
            raise ValueError("scale=None needs a head dimension D >= 1 (q.shape[-1] is 0)")
        return 1.0 / math.sqrt(D)
    if isinstance(scale, (bool, np.bool_)) or not isinstance(scale, numbers.Real):
        raise TypeError(f"scale must be a real number or None, got {scale!r}")
    try:
        scale = float(scale)
    except OverflowError:  # an int beyond float's range
        raise ValueError(f"scale must be finite, got {scale!r}") from None
    if not np.isfinite(scale):
        raise ValueError(f"scale must be finite, got {scale!r}")
    return scale


def _check_causal(causal):
    if isinstance(causal, str):
        if causal == "bottom-right":  # the explicit spelling of causal=True
            return True
        if causal != "top-left":
            raise ValueError(
                f"causal must be True, False, 'top-left' or 'bottom-right', got {causal!r}")
        return causal
    if isinstance(causal, (bool, np.bool_)):
        return bool(causal)
    raise ValueError(f"causal must be True, False or 'top-left', got {causal!r}")


def _check_window(window):
    if window is None:
        return None
    try:
        left, right = window
    except (TypeError, ValueError):
        raise ValueError(f"window must be None or a pair (left, right), got {window!r}") from None
    for side in (left, right):
        if isinstance(side, (bool, np.bool_)) or not isinstance(side, (int, np.integer)):
            raise TypeError(f"window entries must be ints, got {window!r}")
        if side < -1:
            raise ValueError(f"window entries must be >= -1 (-1 = unbounded), got {window!r}")
    return int(left), int(right)


def _check_mask(mask, full_shape):
    if mask is None:
        return None
    mask = np.asarray(mask)
    if not (mask.dtype.kind in "bf" or _variants.is_bfloat16(mask.dtype)):
        raise TypeError(f"mask must be bool or floating, got dtype {mask.dtype}")
    try:
        return np.broadcast_to(mask, full_shape)
    except ValueError:
        raise ValueError(
            f"mask of shape {mask.shape} does not broadcast to (..., Hq, Lq, Lk) = {full_shape}"
        ) from None


def _check_out(out, shape, dtype):
    if out is None:
        return None
    if not isinstance(out, np.ndarray):
        raise TypeError(f"out must be a numpy.ndarray, got {type(out).__name__}")
    if out.shape != shape or out.dtype != dtype:
        raise ValueError(f"out must have shape {shape} and dtype {dtype}, "
                         f"got shape {out.shape} and dtype {out.dtype}")
    return out


def _validate(q, k, v, *, scale, causal, window, mask, kv_lengths, q_lengths, softcap,
              alibi_slopes, sinks, out=None):
    """Every argument checked and normalised before any work starts.

    Per-batch arrays come back shaped ``batch_shape`` (lengths) or ``batch_shape + (Hq,)``
    (slopes, sinks); ``q``, ``k``, ``v`` always have a head axis.
    """
    q, k = np.asarray(q), np.asarray(k)
    named = {"q": q, "k": k}
    if v is not None:
        v = np.asarray(v)
        named["v"] = v
    compute_dtype, result_dtype = _variants.dtypes(**named)
    batch_shape, Hq, Hkv, Lq, Lk, D, Dv, squeeze_head = _split_shapes(q, k, v)
    if squeeze_head:
        q, k = q[None], k[None]
        v = v[None] if v is not None else None
    result_shape = (*batch_shape, Hq, Lq, Dv)

    def per_batch(flat, tail=()):
        return None if flat is None else flat.reshape(batch_shape + tail)

    kv_len = _variants.check_kv_lengths(kv_lengths, batch_shape, Lk)
    q_len = _variants.check_q_lengths(q_lengths, batch_shape, Lq)
    return SimpleNamespace(
        q=q, k=k, v=v, compute_dtype=compute_dtype, result_dtype=result_dtype,
        batch_shape=batch_shape, Hq=Hq, Lq=Lq, Lk=Lk, Dv=Dv, squeeze_head=squeeze_head,
        scale=_check_scale(scale, D),
        causal=_check_causal(causal),
        window=_check_window(window),
        mask=_check_mask(mask, (*batch_shape, Hq, Lq, Lk)),
        kv_len=np.full(batch_shape, Lk, np.intp) if kv_len is None else per_batch(kv_len),
        q_len=np.full(batch_shape, Lq, np.intp) if q_len is None else per_batch(q_len),
        softcap=_variants.check_softcap(softcap),
        slopes=per_batch(_variants.check_alibi_slopes(alibi_slopes, batch_shape, Hq), (Hq,)),
        sinks=per_batch(_variants.check_sinks(sinks, batch_shape, Hq), (Hq,)),
        out=_check_out(out, result_shape[1:] if squeeze_head else result_shape, result_dtype),
    )


# --------------------------------------------------------------------------- visibility

def visible_keys(batch_shape, Lq, Lk, *, causal=False, window=None, kv_lengths=None,
                 q_lengths=None):
    """Boolean array ``(*batch_shape, 1, Lq, Lk)``: may query i see key j?

    Built directly from the contract's formulas (see the module docstring); the head axis
    is 1 because none of these rules depends on the head. ``mask`` is applied separately.
    Padding query rows (``i >= q_lengths[b]``) see no key.
    """
    causal = _check_causal(causal)
    window = _check_window(window)
    i = np.arange(Lq)[:, None]  # (Lq, 1)
    j = np.arange(Lk)[None, :]  # (1, Lk)
    kv_len = _variants.check_kv_lengths(kv_lengths, batch_shape, Lk)
    q_len = _variants.check_q_lengths(q_lengths, batch_shape, Lq)
    kv_len = np.full(batch_shape, Lk) if kv_len is None else kv_len.reshape(batch_shape)
    q_len = np.full(batch_shape, Lq) if q_len is None else q_len.reshape(batch_shape)
    # (..., 1 head, 1 query, 1 key): the per-batch numbers of queries and keys
    kv_len = kv_len[..., None, None, None]
    q_len = q_len[..., None, None, None]
    offset = kv_len - q_len  # bottom-right alignment: the last query sits on the last key

    visible = (j < kv_len) & (i < q_len)
    if causal is True:
        visible = visible & (j <= i + offset)
    elif causal == "top-left":
        visible = visible & (j <= i)
    if window is not None:
        left, right = window
        if left != -1:
            visible = visible & (j >= i + offset - left)
        if right != -1:
            visible = visible & (j <= i + offset + right)
    return np.broadcast_to(visible, (*batch_shape, 1, Lq, Lk))


# --------------------------------------------------------------------------- scores

def _alibi_bias(slopes, q_len, kv_len, Lq, Lk):
    """``-slope[..., h] * |i + (kv_len - q_len) - j|`` as ``(..., Hq, Lq, Lk)``."""
    i = np.arange(Lq)[:, None]
    j = np.arange(Lk)[None, :]
    offset = (kv_len - q_len)[..., None, None, None]
    distance = np.abs(i + offset - j)  # (..., 1, Lq, Lk)
    return -slopes[..., None, None] * distance


def _finished_scores(a):
    """float64 scores (..., Hq, Lq, Lk), every modifier applied and hidden keys at -inf,
    and their visibility, for the validated arguments ``a`` (see :func:`_validate`)."""
    full_shape = (*a.batch_shape, a.Hq, a.Lq, a.Lk)
    q64 = a.q.astype(np.float64)
    k64 = _expand_kv_heads(a.k.astype(np.float64), a.Hq)
    scores = a.scale * (q64 @ np.swapaxes(k64, -1, -2))
    scores = np.broadcast_to(scores, full_shape)
    if a.softcap is not None:
        with np.errstate(over="ignore"):  # s / softcap may overflow: tanh(+-inf) = +-1
            scores = a.softcap * np.tanh(scores / a.softcap)
    if a.slopes is not None:
        scores = scores + _alibi_bias(a.slopes, a.q_len, a.kv_len, a.Lq, a.Lk)

    visible = visible_keys(a.batch_shape, a.Lq, a.Lk, causal=a.causal, window=a.window,
                           kv_lengths=a.kv_len, q_lengths=a.q_len)
    if a.mask is not None:
        if a.mask.dtype == bool:
            visible = visible & a.mask
        else:
            scores = scores + a.mask.astype(np.float64)
    visible = np.broadcast_to(visible, full_shape)
    # A float mask's -inf hides a key just as a False would.
    # (NaN scores stay visible so that they propagate instead of vanishing.)
    visible = visible & (scores != -np.inf)
    scores = np.where(visible, scores, -np.inf)
    return scores, visible


def _row_sinks(a):
    """The sink logit of every row, (..., Hq, Lq, 1): -inf without sinks and for padding
    query rows (which are not rows, so their lse stays -inf)."""
    if a.sinks is None:
        return None
    exists = np.arange(a.Lq) < a.q_len[..., None]  # (..., Lq)
    return np.where(exists[..., None, :, None], a.sinks[..., :, None, None], -np.inf)


def _softmax_rows(scores, visible, sinks=None):
    """Row-wise softmax of float64 scores with an optional extra logit per row that joins
    the denominator (``sinks``, broadcastable to ``(..., 1)``; ``-inf`` = none).

    Returns ``(weights, lse)``. A row with nothing visible gives zeros and ``lse = sink``.
    """
    if sinks is None:
        sinks = np.array(-np.inf)
    m = np.maximum(scores.max(axis=-1, keepdims=True, initial=-np.inf), sinks)
    empty = m == -np.inf
    m = np.where(empty, 0.0, m)
    with np.errstate(invalid="ignore", over="ignore"):
        p = np.where(visible, np.exp(scores - m), 0.0)
    total = p.sum(axis=-1, keepdims=True) + np.exp(sinks - m)
    safe_total = np.where(empty, 1.0, total)
    weights = p / safe_total
    with np.errstate(divide="ignore"):
        lse = np.where(empty, -np.inf, m + np.log(safe_total))[..., 0]
    return weights, lse


# --------------------------------------------------------------------------- public API

def attention(q, k, v, *, scale=None, causal=False, window=None, mask=None,
              kv_lengths=None, softcap=None, alibi_slopes=None, sinks=None, q_lengths=None,
              return_lse=False, out=None):
    """Scaled dot-product attention ``softmax(scale * q k^T + mask) v``, by the book.

    Same signature and semantics as :func:`fastattn.attention`; see the module docstring
    for the order of the score modifiers (``softcap``, ``alibi_slopes``, ``mask``), the
    visibility rules (``causal``, ``window``, ``kv_lengths``, ``q_lengths``) and ``sinks``.
    Computes in float64, materialising the ``(..., Hq, Lq, Lk)`` scores.
    """
    a = _validate(q, k, v, scale=scale, causal=causal, window=window, mask=mask,
                  kv_lengths=kv_lengths, q_lengths=q_lengths, softcap=softcap,
                  alibi_slopes=alibi_slopes, sinks=sinks, out=out)
    scores, visible = _finished_scores(a)
    weights, lse = _softmax_rows(scores, visible, _row_sinks(a))
    v64 = _expand_kv_heads(a.v.astype(np.float64), a.Hq)
    # Keys at j >= kv_lengths[b] do not exist (e.g. the unused tail of a preallocated KV
    # cache, which may hold garbage): zero their values so that a weight of 0 times a NaN
    # there cannot leak into the weighted sum.
    v64 = np.where(np.arange(a.Lk)[:, None] < a.kv_len[..., None, None, None], v64, 0.0)
    context = weights @ v64  # (..., Hq, Lq, Dv): the weighted sum of the values
    context = np.broadcast_to(context, (*a.batch_shape, a.Hq, a.Lq, a.Dv))

    if a.squeeze_head:
        context, lse = context[0], lse[0]
    if a.out is None:
        result = _variants.round_to(context, a.result_dtype)
    else:
        a.out[...] = _variants.round_to(context, a.result_dtype)
        result = a.out
    if return_lse:
        return result, lse.astype(a.compute_dtype)
    return result


def attention_weights(q, k, *, scale=None, causal=False, window=None, mask=None,
                      kv_lengths=None, softcap=None, alibi_slopes=None, sinks=None,
                      q_lengths=None):
    """The attention probabilities ``(..., Hq, Lq, Lk)``; hidden keys and empty rows get 0.

    With ``sinks`` a row sums to ``1 - p_sink``, the weight the sink takes.
    """
    a = _validate(q, k, None, scale=scale, causal=causal, window=window, mask=mask,
                  kv_lengths=kv_lengths, q_lengths=q_lengths, softcap=softcap,
                  alibi_slopes=alibi_slopes, sinks=sinks)
    scores, visible = _finished_scores(a)
    weights, _ = _softmax_rows(scores, visible, _row_sinks(a))
    if a.squeeze_head:
        weights = weights[0]
    return _variants.round_to(weights, a.result_dtype)


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, *, scale=None, causal=False,
                     window=None, softcap=None, alibi_slopes=None, sinks=None,
                     return_lse=False, out=None):
    """Attention over packed sequences (FlashAttention's ``flash_attn_varlen_func``).

    ``q (Hq, total_q, D)``, ``k (Hkv, total_k, D)``, ``v (Hkv, total_k, Dv)``: sequence
    ``s`` is query rows ``cu_seqlens_q[s]:cu_seqlens_q[s+1]`` against keys
    ``cu_seqlens_k[s]:cu_seqlens_k[s+1]``, each computed by :func:`attention` on that
    sequence alone (so causal, window and ALiBi align to each sequence's own lengths).
    ``alibi_slopes`` and ``sinks`` are per head, broadcastable to ``(Hq,)``.
    Returns ``(Hq, total_q, Dv)``, and ``lse (Hq, total_q)`` with ``return_lse=True``.
    """
    q, k, v = np.asarray(q), np.asarray(k), np.asarray(v)
    compute_dtype, result_dtype = _variants.dtypes(q=q, k=k, v=v)
    Hq, _, total_q, total_k, D, Dv = _variants.check_varlen_shapes(q, k, v)
    cu_q, cu_k = _variants.check_cu_seqlens(cu_seqlens_q, cu_seqlens_k, total_q, total_k)
    keywords = dict(
        scale=_check_scale(scale, D), causal=_check_causal(causal), window=_check_window(window),
        softcap=_variants.check_softcap(softcap),
        alibi_slopes=_variants.check_alibi_slopes(alibi_slopes, (), Hq),
        sinks=_variants.check_sinks(sinks, (), Hq),
    )
    for name in ("alibi_slopes", "sinks"):
        if keywords[name] is not None:
            keywords[name] = keywords[name][0]  # (1, Hq) -> (Hq,)
    out = _check_out(out, (Hq, total_q, Dv), result_dtype)

    result = np.zeros((Hq, total_q, Dv), result_dtype) if out is None else out
    lse = np.full((Hq, total_q), -np.inf, compute_dtype)
    for s in range(len(cu_q) - 1):
        rows = slice(cu_q[s], cu_q[s + 1])
        keys = slice(cu_k[s], cu_k[s + 1])
        result[:, rows], lse[:, rows] = attention(q[:, rows], k[:, keys], v[:, keys],
                                                  return_lse=True, **keywords)
    return (result, lse) if return_lse else result


def _sum_to(g, shape):
    """The gradient g of an input of ``shape`` that broadcast to g's shape: summed over
    the broadcast axes."""
    lead = g.ndim - len(shape)
    g = g.sum(axis=tuple(range(lead))) if lead else g
    axes = tuple(d for d, n in enumerate(shape) if n == 1 and g.shape[d] != 1)
    return g.sum(axis=axes, keepdims=True) if axes else g


def attention_backward(dout, q, k, v, *, scale=None, causal=False, window=None, mask=None,
                       kv_lengths=None, softcap=None, alibi_slopes=None, sinks=None,
                       q_lengths=None, dlse=None):
    """Gradients of :func:`attention` with respect to q, k, v (and sinks), by the book.

    ``dout`` and ``dlse`` (optional) are the gradients of a loss with respect to ``out``
    and ``lse``; the forward is recomputed here, in float64, materialising the scores::

        dV = P^T dO                  dP = dO V^T
        Delta_i = rowsum(dO_i * out_i) - dlse_i
        dS = P * (dP - Delta)        (times 1 - tanh^2 through a softcap)
        dQ = scale dS K              dK = scale dS^T Q
        dsink_h = -sum_i exp(sink_h - lse_i) Delta_i

    Padding query rows' ``dout``/``dlse`` have no effect.  Returns ``(dq, dk, dv)`` (and
    ``dsinks`` with sinks) in the shapes and dtypes of the inputs (float64 for integers),
    summed over batch dimensions and heads that an input shares.
    """
    a = _validate(q, k, v, scale=scale, causal=causal, window=window, mask=mask,
                  kv_lengths=kv_lengths, q_lengths=q_lengths, softcap=softcap,
                  alibi_slopes=alibi_slopes, sinks=sinks)
    scores, visible = _finished_scores(a)
    P, lse = _softmax_rows(scores, visible, _row_sinks(a))
    exists = (np.arange(a.Lq) < a.q_len[..., None])[..., None, :]    # (..., 1, Lq)
    dO = np.asarray(dout, dtype=np.float64).reshape(P.shape[:-1] + (a.Dv,))
    dO = np.where(exists[..., None], dO, 0.0)
    kv_exists = np.arange(a.Lk)[:, None] < a.kv_len[..., None, None, None]
    q64 = a.q.astype(np.float64)
    k64 = np.where(kv_exists, _expand_kv_heads(a.k.astype(np.float64), a.Hq), 0.0)
    v64 = np.where(kv_exists, _expand_kv_heads(a.v.astype(np.float64), a.Hq), 0.0)

    out = P @ v64
    delta = np.sum(dO * out, axis=-1)
    if dlse is not None:
        delta = delta - np.where(exists, np.asarray(dlse, np.float64).reshape(lse.shape), 0.0)
    dV = np.swapaxes(P, -1, -2) @ dO
    dP = dO @ np.swapaxes(v64, -1, -2)
    dS = P * (dP - delta[..., None])
    if a.softcap is not None:
        raw = a.scale * (q64 @ np.swapaxes(k64, -1, -2))
        dS = dS * (1 - np.tanh(raw / a.softcap) ** 2)
    dQ = a.scale * dS @ k64
    dK = a.scale * np.swapaxes(dS, -1, -2) @ q64

    def grad(g, x, per_kv_head):
        if per_kv_head:  # the query heads of a group read the same kv head
            Hkv = x.shape[-3]
            g = g.reshape(g.shape[:-3] + (Hkv, a.Hq // Hkv) + g.shape[-2:]).sum(axis=-3)
        g = _sum_to(g, x.shape)
        g = g[0] if a.squeeze_head else g
        dtype = x.dtype if x.dtype.kind == "f" or _variants.is_16bit(x.dtype) else np.float64
        return _variants.round_to(g, dtype)

    grads = (grad(dQ, a.q, False), grad(dK, a.k, True), grad(dV, a.v, True))
    if a.sinks is None:
        return grads
    with np.errstate(invalid="ignore", over="ignore"):
        p_sink = np.where(np.isneginf(lse), 0.0, np.exp(a.sinks[..., None] - lse))
    dsinks = _sum_to(-np.sum(p_sink * delta, axis=-1), np.shape(sinks))
    sinks_dtype = np.asarray(sinks).dtype
    return grads + (dsinks.astype(sinks_dtype if sinks_dtype.kind == "f" else np.float64),)


def softmax(x, axis=-1):
    """Numerically stable softmax along ``axis``; a row that is all ``-inf`` gives zeros.

    float16/bfloat16/float32/float64 keep their dtype; integers and bool give float64.
    """
    x = np.asarray(x)
    _, result_dtype = _variants.dtypes(x=x)
    x64 = x.astype(np.float64)
    visible = x64 != -np.inf
    weights, _ = _softmax_rows(np.moveaxis(x64, axis, -1), np.moveaxis(visible, axis, -1))
    return _variants.round_to(np.moveaxis(weights, -1, axis), result_dtype)
