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

Arguments are checked by :mod:`fastattn._calls.args`, the rules every entry point shares, each
failing with a clear ``ValueError``/``TypeError`` that names the argument before any work
starts.
"""
import copy

import numpy as np

from ._calls import args as _args

__all__ = ["attention", "attention_varlen", "attention_weights", "softmax", "visible_keys",
           "attention_backward"]


# --------------------------------------------------------------------------- shapes

def _expand_kv_heads(x, Hq):
    """Give every query head h its key/value head h // (Hq // Hkv) (GQA/MQA) by indexing."""
    Hkv = x.shape[-3]
    return np.take(x, np.arange(Hq) // (Hq // Hkv), axis=-3)


# --------------------------------------------------------------------------- arguments

def _problem(q, k, v, out=None, return_lse=False, **keywords):
    """The checked arguments (:class:`fastattn._calls.args.Problem`, the rules every entry point
    shares), with the per-batch lengths, slopes and sinks given back their batch axes."""
    return with_batch_axes(_args.Problem(q, k, v, out=out, return_lse=return_lse, **keywords))


def with_batch_axes(p):
    """A copy of the :class:`fastattn._calls.args.Problem` ``p`` with its per-batch lengths
    shaped ``batch``, and its slopes and sinks ``batch + (Hq,)``, as this module reads them."""
    p = copy.copy(p)
    p.kv_len = p.kv_len_flat().reshape(p.batch)
    p.q_len = p.q_len_flat().reshape(p.batch)
    for name in ("alibi", "sinks"):
        if getattr(p, name) is not None:
            setattr(p, name, getattr(p, name).reshape(p.batch + (p.Hq,)))
    return p


# --------------------------------------------------------------------------- visibility

def visible_keys(batch_shape, Lq, Lk, *, causal=False, window=None, kv_lengths=None,
                 q_lengths=None):
    """Boolean array ``(*batch_shape, 1, Lq, Lk)``: may query i see key j?

    Built directly from the contract's formulas (see the module docstring); the head axis
    is 1 because none of these rules depends on the head. ``mask`` is applied separately.
    Padding query rows (``i >= q_lengths[b]``) see no key.
    """
    kv_len = _args.check_kv_lengths(kv_lengths, batch_shape, Lk)
    q_len = _args.check_q_lengths(q_lengths, batch_shape, Lq)
    kv_len = np.full(batch_shape, Lk) if kv_len is None else kv_len.reshape(batch_shape)
    q_len = np.full(batch_shape, Lq) if q_len is None else q_len.reshape(batch_shape)
    return _visibility(batch_shape, Lq, Lk, _args.check_causal(causal),
                       *_args.check_window(window), kv_len, q_len)


def _visibility(batch_shape, Lq, Lk, causal, left, right, kv_len, q_len):
    """:func:`visible_keys` for checked arguments: ``causal`` as
    :func:`fastattn._calls.args.check_causal` gives it, lengths shaped ``batch_shape``."""
    i = np.arange(Lq)[:, None]  # (Lq, 1)
    j = np.arange(Lk)[None, :]  # (1, Lk)
    # (..., 1 head, 1 query, 1 key): the per-batch numbers of queries and keys
    kv_len = kv_len[..., None, None, None]
    q_len = q_len[..., None, None, None]
    offset = kv_len - q_len  # bottom-right alignment: the last query sits on the last key

    visible = (j < kv_len) & (i < q_len)
    if causal == "bottom-right":
        visible = visible & (j <= i + offset)
    elif causal == "top-left":
        visible = visible & (j <= i)
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


def _visible(a):
    """The contract's visibility for the checked arguments ``a`` (see :func:`_problem`)."""
    return _visibility(a.batch, a.Lq, a.Lk, a.causal, a.wl, a.wr, a.kv_len, a.q_len)


def _finished_scores(a, dtype, visible):
    """Scores ``(..., Hq, Lq, Lk)`` in ``dtype``, every modifier applied and hidden keys
    at -inf, and their visibility, for the checked arguments ``a`` (see :func:`_problem`)
    and ``visible``, which keys each row may see before the mask (``(..., 1, Lq, Lk)``)."""
    full_shape = (*a.batch, a.Hq, a.Lq, a.Lk)
    q = a.q.astype(dtype)
    k = _expand_kv_heads(a.k.astype(dtype), a.Hq)
    # errstate: some BLAS kernels (OpenBLAS's SME matmul) raise spurious FP warnings, and
    # nothing here warns.
    with np.errstate(all="ignore"):
        scores = dtype.type(a.scale) * (q @ np.swapaxes(k, -1, -2))
    scores = np.broadcast_to(scores, full_shape)
    if a.softcap is not None:
        cap = dtype.type(a.softcap)
        with np.errstate(over="ignore"):  # s / softcap may overflow: tanh(+-inf) = +-1
            scores = cap * np.tanh(scores / cap)
    if a.alibi is not None:
        scores = scores + _alibi_bias(a.alibi, a.q_len, a.kv_len, a.Lq, a.Lk).astype(dtype)
    if a.mask_kind == "bool":
        visible = visible & a.mask
    elif a.mask_kind == "add":
        with np.errstate(invalid="ignore"):  # -inf + inf in a mask gives NaN, as it should
            scores = scores + a.mask.astype(dtype)
    visible = np.broadcast_to(visible, full_shape)
    # A float mask's -inf hides a key just as a False would.
    # (NaN scores stay visible so that they propagate instead of vanishing.)
    visible = visible & (scores != -np.inf)
    scores = np.where(visible, scores, dtype.type(-np.inf))
    return scores, visible


def probabilities(a, dtype, visible):
    """The probabilities ``(..., Hq, Lq, Lk)`` in ``dtype`` and their ``lse``: the score
    stage (:func:`_finished_scores`) and the row softmax with sinks."""
    scores, visible = _finished_scores(a, dtype, visible)
    sinks = _row_sinks(a)
    return _softmax_rows(scores, visible, None if sinks is None else sinks.astype(dtype))


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
        sinks = np.array(-np.inf, scores.dtype)
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
    a = _problem(q, k, v, scale=scale, causal=causal, window=window, mask=mask,
                 kv_lengths=kv_lengths, q_lengths=q_lengths, softcap=softcap,
                 alibi_slopes=alibi_slopes, sinks=sinks, return_lse=return_lse, out=out)
    weights_, lse = probabilities(a, np.dtype(np.float64), _visible(a))
    v64 = _expand_kv_heads(a.v.astype(np.float64), a.Hq)
    # Keys at j >= kv_lengths[b] do not exist (e.g. the unused tail of a preallocated KV
    # cache, which may hold garbage): zero their values so that a weight of 0 times a NaN
    # there cannot leak into the weighted sum.
    v64 = np.where(np.arange(a.Lk)[:, None] < a.kv_len[..., None, None, None], v64, 0.0)
    context = weights_ @ v64  # (..., Hq, Lq, Dv): the weighted sum of the values
    context = np.broadcast_to(context, (*a.batch, a.Hq, a.Lq, a.Dv))

    if a.squeeze_heads:
        context, lse = context[0], lse[0]
    if a.out is None:
        result = _args.round_to(context, a.result_dtype)
    else:
        a.out[...] = _args.round_to(context, a.result_dtype)
        result = a.out
    if a.return_lse:
        return result, lse.astype(a.compute_dtype)
    return result


def attention_weights(q, k, *, scale=None, causal=False, window=None, mask=None,
                      kv_lengths=None, softcap=None, alibi_slopes=None, sinks=None,
                      q_lengths=None):
    """The attention probabilities ``(..., Hq, Lq, Lk)``; hidden keys and empty rows get 0.

    With ``sinks`` a row sums to ``1 - p_sink``, the weight the sink takes.
    """
    a = _problem(q, k, None, scale=scale, causal=causal, window=window, mask=mask,
                 kv_lengths=kv_lengths, q_lengths=q_lengths, softcap=softcap,
                 alibi_slopes=alibi_slopes, sinks=sinks)
    weights_, _ = probabilities(a, np.dtype(np.float64), _visible(a))
    if a.squeeze_heads:
        weights_ = weights_[0]
    return _args.round_to(weights_, a.result_dtype)


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
    p = _args.varlen_problem(q, k, v, cu_seqlens_q, cu_seqlens_k, scale=scale, causal=causal,
                             window=window, softcap=softcap, alibi_slopes=alibi_slopes,
                             sinks=sinks, return_lse=return_lse, out=out)
    keywords = dict(scale=p.scale, causal=causal, window=window, softcap=p.softcap)
    result = np.zeros((p.Hq, p.total_q, p.Dv), p.result_dtype) if p.out is None else p.out
    lse = np.full((p.Hq, p.total_q), -np.inf, p.compute_dtype)
    for s in range(p.n_seq):
        rows = slice(p.cu_q[s], p.cu_q[s + 1])
        keys = slice(p.cu_k[s], p.cu_k[s + 1])
        per_head = {name: None if x is None else x[s]
                    for name, x in (("alibi_slopes", p.alibi), ("sinks", p.sinks))}
        result[:, rows], lse[:, rows] = attention(p.q[:, rows], p.k[:, keys], p.v[:, keys],
                                                  return_lse=True, **keywords, **per_head)
    return (result, lse) if p.return_lse else result


def _sum_to(g, shape):
    """The gradient g of an input of ``shape`` that broadcast to g's shape: summed over
    the broadcast axes."""
    lead = g.ndim - len(shape)
    g = g.sum(axis=tuple(range(lead))) if lead else g
    axes = tuple(d for d, n in enumerate(shape) if n == 1 and g.shape[d] != 1)
    return g.sum(axis=axes, keepdims=True) if axes else g


def attention_backward(dout, q, k, v, out=None, lse=None, *, scale=None, causal=False,
                       window=None, mask=None, kv_lengths=None, q_lengths=None, softcap=None,
                       alibi_slopes=None, sinks=None, dlse=None):
    """Gradients of :func:`attention` with respect to q, k, v (and sinks), by the book.

    The signature of :func:`fastattn.attention_backward`.  ``dout`` and ``dlse``
    (optional) are the gradients of a loss with respect to ``out`` and ``lse``.  ``out``
    and ``lse``, the forward's results, are optional here: when given (both), they are
    checked by the same rules as there (shape and dtype) but not read, since the oracle
    recomputes the forward in float64, materialising the scores, rather than depend on
    the kernel's rounding::

        dV = P^T dO                  dP = dO V^T
        Delta_i = rowsum(dO_i * out_i) - dlse_i
        dS = P * (dP - Delta)        (times 1 - tanh^2 through a softcap)
        dQ = scale dS K              dK = scale dS^T Q
        dsink_h = -sum_i exp(sink_h - lse_i) Delta_i

    Padding query rows' ``dout``/``dlse`` have no effect.  Returns ``(dq, dk, dv)`` (and
    ``dsinks`` with sinks) in the shapes and dtypes of the inputs (float64 for integers),
    summed over batch dimensions and heads that an input shares.
    """
    a = _problem(q, k, v, scale=scale, causal=causal, window=window, mask=mask,
                 kv_lengths=kv_lengths, q_lengths=q_lengths, softcap=softcap,
                 alibi_slopes=alibi_slopes, sinks=sinks)
    if out is not None or lse is not None:
        if out is None or lse is None:
            raise TypeError("out and lse are given together, as attention(..., "
                            "return_lse=True) returns them, or not at all")
        _args.check_forward_result(a.result_shape(a.Dv), a.result_dtype, a.compute_dtype,
                                   dout, out, lse, dlse)
    P, lse = probabilities(a, np.dtype(np.float64), _visible(a))
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
        g = g[0] if a.squeeze_heads else g
        return _args.round_to(g, _args.grad_dtype(x.dtype, np.float64))

    grads = (grad(dQ, a.q, False), grad(dK, a.k, True), grad(dV, a.v, True))
    if a.sinks is None:
        return grads
    with np.errstate(invalid="ignore", over="ignore"):
        p_sink = np.where(np.isneginf(lse), 0.0, np.exp(a.sinks[..., None] - lse))
    dsinks = _sum_to(-np.sum(p_sink * delta, axis=-1), np.shape(sinks))
    return grads + (_args.round_to(dsinks, _args.grad_dtype(np.asarray(sinks).dtype, np.float64)),)


def softmax(x, axis=-1):
    """Numerically stable softmax along ``axis``; a row that is all ``-inf`` gives zeros.

    float16/bfloat16/float32/float64 keep their dtype; integers and bool give float64.
    """
    x = _args.as_array(x, "x")
    _, result_dtype = _args.dtypes(x=x)
    x64 = x.astype(np.float64)
    visible = x64 != -np.inf
    weights, _ = _softmax_rows(np.moveaxis(x64, axis, -1), np.moveaxis(visible, axis, -1))
    return _args.round_to(np.moveaxis(weights, -1, axis), result_dtype)
