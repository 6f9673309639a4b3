"""The reference's score modifiers (softcap, ALiBi, sinks, q_lengths), packed sequences and
float16/bfloat16 inputs against oracles that share none of its code (the rules of their
arguments: tests/test_arguments.py).

- ``fa_attention_ref``: FlashAttention's test oracle (``attention_ref`` in its
  tests/test_flash_attn.py, with ``construct_local_mask`` and
  ``attn_bias_from_alibi_slopes``) transcribed to NumPy float64, in its own
  ``(batch, seqlen, heads, D)`` layout with boolean key/query padding masks.
- ``gpt_oss_sdpa``: gpt-oss's ``sdpa`` (the sink logit concatenated as an extra column of
  the scores, softmax, the column dropped), transcribed to NumPy.
- ``loop_attention``: scalar Python loops written from the formulas of the contract.
- torch's ``scaled_dot_product_attention`` given an explicit float mask (and, for sinks, an
  extra key whose score is the sink and whose value is 0), when torch is installed.
- small examples computed by hand.

If the oracle is wrong, every kernel comparison built on it is meaningless; so each variant
is checked against at least two of these.
"""
import math

import numpy as np
import pytest

from fastattn._calls import args as _args
from fastattn import reference as ref

from conftest import assert_close, run_python


# --------------------------------------------------------------------------- oracles

def _masked_softmax(scores):
    """softmax over the last axis; a row that is all -inf gives zeros (FlashAttention's
    attention_ref fills such rows with 0 after torch.softmax has made them NaN)."""
    m = scores.max(axis=-1, keepdims=True, initial=-np.inf)
    dead = m == -np.inf
    e = np.exp(scores - np.where(dead, 0.0, m))
    return np.where(dead, 0.0, e / np.where(dead, 1.0, e.sum(axis=-1, keepdims=True)))


def fa_construct_local_mask(seqlen_q, seqlen_k, window_size, query_padding_mask=None,
                            key_padding_mask=None):
    """FlashAttention's construct_local_mask: True where the window hides key ``col`` from
    query ``row``, with the lengths taken from the padding masks (bottom-right aligned).
    FlashAttention's kernels read a negative window side as unbounded; so does this."""
    row_idx = np.arange(seqlen_q)[:, None]
    col_idx = np.arange(seqlen_k)
    sk = seqlen_k if key_padding_mask is None else key_padding_mask.sum(-1)[:, None, None, None]
    sq = seqlen_q if query_padding_mask is None else query_padding_mask.sum(-1)[:, None, None, None]
    left, right = window_size
    hidden = np.zeros((1, 1, seqlen_q, seqlen_k), bool)
    if right >= 0:
        hidden = hidden | (col_idx > np.minimum(row_idx + sk - sq + right, sk))
    if left >= 0:
        hidden = hidden | (col_idx < row_idx + sk - sq - left)
    return hidden


def fa_attn_bias_from_alibi_slopes(slopes, seqlen_q, seqlen_k, query_padding_mask=None,
                                   key_padding_mask=None, causal=False):
    """FlashAttention's attn_bias_from_alibi_slopes: slopes (batch, nheads) -> the bias
    (batch, nheads, seqlen_q, seqlen_k). Its causal shortcut differs from the general bias
    by a constant per row, which softmax cancels (lse does not)."""
    slopes = slopes[:, :, None, None]
    if causal:
        return np.arange(-seqlen_k + 1, 1, dtype=np.float64) * slopes
    row_idx = np.arange(seqlen_q)[:, None]
    col_idx = np.arange(seqlen_k)
    sk = seqlen_k if key_padding_mask is None else key_padding_mask.sum(-1)[:, None, None, None]
    sq = seqlen_q if query_padding_mask is None else query_padding_mask.sum(-1)[:, None, None, None]
    relative_pos = np.abs(row_idx + sk - sq - col_idx)
    return -slopes * relative_pos


def fa_attention_ref(q, k, v, query_padding_mask=None, key_padding_mask=None, attn_bias=None,
                     causal=False, window_size=(-1, -1), softcap=0.0, softmax_scale=None,
                     attn_mask=None, sinks=None):
    """FlashAttention's attention_ref in NumPy float64: q (b, sq, hq, d), k and v
    (b, sk, hkv, d). Returns (output (b, sq, hq, dv), attention (b, hq, sq, sk), lse
    (b, hq, sq)).

    Two additions, each a line: ``attn_mask`` (bool, True = may attend, broadcast to the
    scores) hides keys like the padding masks do, and ``sinks`` (b, hq) joins the softmax
    as gpt-oss does (an extra column, dropped after the softmax). lse is the log of the
    softmax denominator, -inf for rows that see nothing and for padding query rows.
    """
    if causal:
        window_size = (window_size[0], 0)
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    seqlen_q, seqlen_k = q.shape[1], k.shape[1]
    g = q.shape[2] // k.shape[2]
    k = np.repeat(k, g, axis=2)  # "b s h d -> b s (h g) d"
    v = np.repeat(v, g, axis=2)
    d = q.shape[-1]
    scale = 1 / math.sqrt(d) if softmax_scale is None else softmax_scale
    scores = np.einsum("bthd,bshd->bhts", q * scale, k)
    if softcap > 0:
        scores = np.tanh(scores / softcap) * softcap
    if key_padding_mask is not None:
        scores = np.where(~key_padding_mask[:, None, None, :], -np.inf, scores)
    if window_size[0] >= 0 or window_size[1] >= 0:
        local_mask = fa_construct_local_mask(seqlen_q, seqlen_k, window_size,
                                             query_padding_mask, key_padding_mask)
        scores = np.where(local_mask, -np.inf, scores)
    if attn_mask is not None:
        scores = np.where(attn_mask, scores, -np.inf)
    if attn_bias is not None:
        scores = scores + attn_bias
    if sinks is not None:
        sink_col = np.broadcast_to(np.asarray(sinks, np.float64)[:, :, None, None],
                                   scores.shape[:-1] + (1,))
        scores = np.concatenate([scores, sink_col], axis=-1)
    attention = _masked_softmax(scores)
    lse = np.logaddexp.reduce(scores, axis=-1, initial=-np.inf)
    if sinks is not None:
        attention = attention[..., :-1]
    if query_padding_mask is not None:
        attention = np.where(~query_padding_mask[:, None, :, None], 0.0, attention)
        lse = np.where(~query_padding_mask[:, None, :], -np.inf, lse)
    output = np.einsum("bhts,bshd->bthd", attention, v)
    if query_padding_mask is not None:
        output = np.where(~query_padding_mask[:, :, None, None], 0.0, output)
    return output, attention, lse


def gpt_oss_sdpa(Q, K, V, S, sm_scale, sliding_window=0):
    """gpt-oss's sdpa (gpt_oss/torch/model.py) in NumPy: Q (n_tokens, n_heads, q_mult,
    d_head), K and V (n_tokens, n_heads, d_head), S (n_heads * q_mult,) sink logits; causal,
    with an optional window of ``sliding_window`` tokens. Returns (attn (n_tokens,
    n_heads * q_mult * d_head), W (n_heads, q_mult, n_tokens, n_tokens), lse)."""
    n_tokens, n_heads, q_mult, d_head = Q.shape
    K = np.broadcast_to(K[:, :, None, :], (n_tokens, n_heads, q_mult, d_head))
    V = np.broadcast_to(V[:, :, None, :], (n_tokens, n_heads, q_mult, d_head))
    S = np.broadcast_to(S.reshape(n_heads, q_mult, 1, 1), (n_heads, q_mult, n_tokens, 1))
    mask = np.triu(np.full((n_tokens, n_tokens), -np.inf), k=1)
    if sliding_window > 0:
        mask = mask + np.tril(np.full((n_tokens, n_tokens), -np.inf), k=-sliding_window)
    QK = np.einsum("qhmd,khmd->hmqk", Q, K)
    QK = QK * sm_scale
    QK = QK + mask[None, None, :, :]
    QK = np.concatenate([QK, S], axis=-1)
    W = np.exp(QK - QK.max(axis=-1, keepdims=True))
    W = W / W.sum(axis=-1, keepdims=True)
    lse = np.logaddexp.reduce(QK, axis=-1)
    W = W[..., :-1]
    attn = np.einsum("hmqk,khmd->qhmd", W, V)
    return attn.reshape(n_tokens, -1), W, lse


def loop_attention(q, k, v, *, scale, causal=False, window=None, softcap=None, slope=None,
                   sink=None, q_len=None, kv_len=None):
    """One head by scalar loops, straight from the contract: q (Lq, D), k (Lk, D), v (Lk, Dv).
    Returns (out, lse, weights) as float64 arrays."""
    Lq, Lk = len(q), len(k)
    q_len = Lq if q_len is None else q_len
    kv_len = Lk if kv_len is None else kv_len
    sink = -math.inf if sink is None else sink
    out = np.zeros((Lq, v.shape[1]))
    lse = np.full(Lq, -math.inf)
    weights = np.zeros((Lq, Lk))
    for i in range(q_len):
        s = {}
        for j in range(kv_len):
            pos = i + kv_len - q_len  # the key position query i sits on
            if causal is True and j > pos or causal == "top-left" and j > i:
                continue
            if window is not None and (window[0] != -1 and j < pos - window[0]
                                       or window[1] != -1 and j > pos + window[1]):
                continue
            x = scale * sum(float(a) * float(b) for a, b in zip(q[i], k[j]))
            if softcap is not None:
                x = softcap * math.tanh(x / softcap)
            if slope is not None:
                x -= slope * abs(pos - j)
            s[j] = x
        logits = list(s.values()) + [sink]
        m = max(logits)
        if m == -math.inf:
            continue
        total = sum(math.exp(x - m) for x in logits)
        lse[i] = m + math.log(total)
        for j, x in s.items():
            weights[i, j] = math.exp(x - m) / total
            out[i] += weights[i, j] * v[j].astype(np.float64)
    return out, lse, weights


def _padding_masks(B, Lq, Lk, q_len, kv_len):
    """FlashAttention's boolean padding masks (True = real) for right padding."""
    qpm = None if q_len is None else np.arange(Lq)[None, :] < np.asarray(q_len)[:, None]
    kpm = None if kv_len is None else np.arange(Lk)[None, :] < np.asarray(kv_len)[:, None]
    return qpm, kpm


def _fa_call(q, k, v, *, scale=None, causal=False, window=None, softcap=None, slopes=None,
             sinks=None, q_len=None, kv_len=None, float_mask=None, bool_mask=None):
    """fa_attention_ref on fastattn's (B, H, L, D) layout; results back in that layout."""
    B, Hq, Lq, _ = q.shape
    Lk = k.shape[2]
    qpm, kpm = _padding_masks(B, Lq, Lk, q_len, kv_len)
    bias = None
    if slopes is not None:
        bias = fa_attn_bias_from_alibi_slopes(np.broadcast_to(slopes, (B, Hq)), Lq, Lk, qpm, kpm)
    if float_mask is not None:
        bias = float_mask if bias is None else bias + float_mask
    sinks = None if sinks is None else np.broadcast_to(sinks, (B, Hq))
    out, attn, lse = fa_attention_ref(
        q.transpose(0, 2, 1, 3), k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), qpm, kpm,
        bias, causal, window if window is not None else (-1, -1), softcap or 0.0, scale,
        attn_mask=bool_mask, sinks=sinks)
    return out.transpose(0, 2, 1, 3), attn, lse


# --------------------------------------------------------------------------- FlashAttention

SHAPES = [(5, 7), (7, 5), (6, 6)]  # (Lq, Lk)
PADDINGS = ["none", "kv", "q", "both"]


def _lengths(rng, B, Lq, Lk, padding):
    q_len = rng.integers(0, Lq + 1, B) if padding in ("q", "both") else None
    kv_len = rng.integers(0, Lk + 1, B) if padding in ("kv", "both") else None
    if q_len is not None:
        q_len[0] = Lq  # one unpadded element, one with some rows at least
        q_len[-1] = max(q_len[-1], 1)
    if kv_len is not None:
        kv_len[-1] = max(kv_len[-1], 1)
    return q_len, kv_len


@pytest.mark.parametrize("Lq, Lk", SHAPES)
@pytest.mark.parametrize("padding", PADDINGS)
@pytest.mark.parametrize("window", [None, (2, 1), (3, -1), (-1, 2)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("softcap, alibi", [(None, False), (2.5, False), (None, True),
                                             (2.5, True)])
def test_against_flash_attention_ref(rng, Lq, Lk, padding, window, causal, softcap, alibi):
    B, Hq, Hkv, D, Dv = 3, 4, 2, 8, 6
    q = rng.standard_normal((B, Hq, Lq, D)) * 1.5  # scores of a few units: softcap bites
    k = rng.standard_normal((B, Hkv, Lk, D)) * 1.5
    v = rng.standard_normal((B, Hkv, Lk, Dv))
    slopes = rng.random((B, Hq)) * 0.3 if alibi else None  # as FlashAttention's tests draw
    q_len, kv_len = _lengths(rng, B, Lq, Lk, padding)
    kw = dict(causal=causal, window=window, softcap=softcap)

    out, lse = ref.attention(q, k, v, alibi_slopes=slopes, q_lengths=q_len,
                             kv_lengths=kv_len, return_lse=True, **kw)
    weights = ref.attention_weights(q, k, alibi_slopes=slopes, q_lengths=q_len,
                                    kv_lengths=kv_len, **kw)
    exp_out, exp_weights, exp_lse = _fa_call(q, k, v, slopes=slopes, q_len=q_len,
                                             kv_len=kv_len, **kw)
    assert_close(out, exp_out)
    assert_close(lse, exp_lse)
    assert_close(weights, exp_weights)


def test_flash_attention_causal_alibi_shortcut(rng):
    # FlashAttention's causal ALiBi bias is (j - Lk + 1) * slope, the general bias plus
    # -(Lk - 1 - i - offset) * slope on row i: the outputs agree, lse by that constant.
    B, H, Lq, Lk, D = 3, 2, 4, 9, 5
    q, k, v = (rng.standard_normal((B, H, L, D)) for L in (Lq, Lk, Lk))
    slopes = rng.random((B, H))
    kv_len = np.array([9, 6, 4])
    out, lse = ref.attention(q, k, v, causal=True, alibi_slopes=slopes, kv_lengths=kv_len,
                             return_lse=True)
    _, kpm = _padding_masks(B, Lq, Lk, None, kv_len)
    bias = fa_attn_bias_from_alibi_slopes(slopes, Lq, Lk, None, kpm, causal=True)
    exp_out, _, exp_lse = fa_attention_ref(*(x.transpose(0, 2, 1, 3) for x in (q, k, v)),
                                           key_padding_mask=kpm, attn_bias=bias, causal=True)
    assert_close(out, exp_out.transpose(0, 2, 1, 3))
    offset = (kv_len - Lq)[:, None, None]
    assert_close(lse - (Lk - 1 - np.arange(Lq) - offset) * slopes[:, :, None], exp_lse)


def test_masks_and_broadcast_batch(rng):
    # Float and bool masks, per-batch-element slopes and sinks, and kv/q lengths, on batch
    # dims that broadcast ((2, 1) x (1, 3)), against the oracle on the broadcast arrays.
    Hq, Hkv, Lq, Lk, D = 4, 1, 5, 6, 3
    q = rng.standard_normal((2, 1, Hq, Lq, D))
    k = rng.standard_normal((1, 3, Hkv, Lk, D))
    v = rng.standard_normal((1, 3, Hkv, Lk, 2))
    float_mask = rng.standard_normal((Hq, Lq, Lk))
    float_mask[rng.random(float_mask.shape) < 0.2] = -np.inf
    bool_mask = rng.random((3, 1, Lq, Lk)) < 0.8
    slopes = rng.random((3, Hq))
    sinks = rng.standard_normal((2, 1, Hq))
    sinks[0, 0, 1] = -np.inf  # head 1 of batch row 0: no sink
    kv_len = np.array([[6], [3]])
    q_len = np.array([5, 4, 2])
    kw = dict(causal=True, window=(3, -1), softcap=4.0, mask=float_mask, alibi_slopes=slopes,
              sinks=sinks, kv_lengths=kv_len, q_lengths=q_len)
    out, lse = ref.attention(q, k, v, return_lse=True, **kw)
    kw.pop("mask")
    weights = ref.attention_weights(q, k, mask=bool_mask, **kw)

    flat = lambda x, tail: np.broadcast_to(x, (2, 3) + tail).reshape((6,) + tail)  # noqa: E731
    fq, fk, fv = flat(q, q.shape[2:]), flat(k, k.shape[2:]), flat(v, v.shape[2:])
    common = dict(causal=True, window=(3, -1), softcap=4.0, slopes=flat(slopes, (Hq,)),
                  sinks=flat(sinks, (Hq,)), q_len=flat(q_len, ()), kv_len=flat(kv_len, ()))
    exp_out, _, exp_lse = _fa_call(fq, fk, fv, float_mask=float_mask, **common)
    _, exp_weights, _ = _fa_call(fq, fk, fv, bool_mask=flat(bool_mask, (1, Lq, Lk)), **common)
    assert_close(out.reshape(6, Hq, Lq, 2), exp_out)
    assert_close(lse.reshape(6, Hq, Lq), exp_lse)
    assert_close(weights.reshape(6, Hq, Lq, Lk), exp_weights)


# --------------------------------------------------------------------------- sinks

@pytest.mark.parametrize("sliding_window", [0, 1, 3])
def test_sinks_against_gpt_oss(rng, sliding_window):
    n_tokens, n_heads, q_mult, d_head = 7, 2, 3, 8
    Q = rng.standard_normal((n_tokens, n_heads, q_mult, d_head))
    K = rng.standard_normal((n_tokens, n_heads, d_head))
    V = rng.standard_normal((n_tokens, n_heads, d_head))
    S = rng.standard_normal(n_heads * q_mult)
    sm_scale = 1 / math.sqrt(d_head)
    exp_attn, exp_W, exp_lse = gpt_oss_sdpa(Q, K, V, S, sm_scale, sliding_window)

    # fastattn's layout: heads first, query head h = kv head h // q_mult.
    q = Q.reshape(n_tokens, n_heads * q_mult, d_head).transpose(1, 0, 2)
    k, v = K.transpose(1, 0, 2), V.transpose(1, 0, 2)
    window = (sliding_window - 1, 0) if sliding_window else None  # the last sliding_window keys
    kw = dict(causal=True, window=window, sinks=S)
    out, lse = ref.attention(q, k, v, return_lse=True, **kw)
    assert_close(out.transpose(1, 0, 2).reshape(n_tokens, -1), exp_attn)
    assert_close(lse, exp_lse.reshape(n_heads * q_mult, n_tokens))
    W = ref.attention_weights(q, k, **kw)
    assert_close(W, exp_W.reshape(n_heads * q_mult, n_tokens, n_tokens))


def test_sinks_hand_computed():
    # One head, D = 1, scale 1: the scores of row 0 are log(1, 2, 3), of row 1 log(1, 4, 9),
    # and the sink is log 4. Row 0: p = (1, 2, 3) / (1 + 2 + 3 + 4); row 1: (1, 4, 9) / 18.
    q = np.array([[1.0], [2.0]])
    k = np.log([[1.0], [2.0], [3.0]])
    v = np.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    sink = math.log(4)
    out, lse = ref.attention(q, k, v, scale=1.0, sinks=sink, return_lse=True)
    np.testing.assert_allclose(out, [[0.4, 0.5], [10 / 18, 13 / 18]], rtol=1e-14)
    np.testing.assert_allclose(lse, np.log([10, 18]), rtol=1e-14)
    w = ref.attention_weights(q, k, scale=1.0, sinks=sink)
    np.testing.assert_allclose(w, [[0.1, 0.2, 0.3], [1 / 18, 4 / 18, 9 / 18]], rtol=1e-14)
    np.testing.assert_allclose(w.sum(axis=-1), [1 - 4 / 10, 1 - 4 / 18], rtol=1e-14)

    # Causal, Lq = 2 against Lk = 3: row 0 sees keys 0 and 1 only: (1, 2) / (1 + 2 + 4).
    out, lse = ref.attention(q, k, v, scale=1.0, sinks=sink, causal=True, return_lse=True)
    np.testing.assert_allclose(out, [[1 / 7, 2 / 7], [10 / 18, 13 / 18]], rtol=1e-14)
    np.testing.assert_allclose(lse, np.log([7, 18]), rtol=1e-14)

    # No visible key: zeros, and lse is the sink. A padding query row: zeros and -inf.
    out, lse = ref.attention(q, k, v, scale=1.0, sinks=sink, kv_lengths=0, return_lse=True)
    assert not out.any() and np.array_equal(lse, [sink, sink])
    out, lse = ref.attention(q, k, v, scale=1.0, sinks=sink, q_lengths=1, return_lse=True)
    np.testing.assert_allclose(out, [[0.4, 0.5], [0.0, 0.0]], rtol=1e-14)
    assert lse[1] == -np.inf
    # A sink of -inf is no sink.
    np.testing.assert_array_equal(ref.attention(q, k, v, scale=1.0, sinks=-np.inf),
                                  ref.attention(q, k, v, scale=1.0))


def test_sinks_huge_and_tiny(strict_warnings):
    # The sink can dominate every score (p -> 0, lse -> sink) or vanish, without overflow.
    q, k, v = np.ones((2, 3)), np.ones((4, 3)), np.arange(8.0).reshape(4, 2)
    out, lse = ref.attention(q, k, v, sinks=1000.0, return_lse=True)
    assert np.all(out == 0) and np.all(lse == 1000.0)
    out, lse = ref.attention(q, k, v, sinks=-1000.0, return_lse=True)
    np.testing.assert_allclose(out, np.broadcast_to(v.mean(axis=0), (2, 2)), rtol=1e-14)
    np.testing.assert_allclose(lse, math.sqrt(3) + math.log(4), rtol=1e-14)


# --------------------------------------------------------------------------- scalar loops

@pytest.mark.parametrize("causal", [False, True, "top-left"])
@pytest.mark.parametrize("window", [None, (1, 0), (0, 2)])
def test_against_scalar_loops(rng, causal, window):
    # Every keyword at once on one batch of two elements, and heads in a GQA group of 2.
    B, Hq, Hkv, Lq, Lk, D = 2, 4, 2, 5, 7, 3
    q, k, v = (rng.standard_normal(s) for s in ((B, Hq, Lq, D), (B, Hkv, Lk, D), (B, Hkv, Lk, 2)))
    slopes, sinks = rng.random(Hq), rng.standard_normal((B, Hq))
    q_len, kv_len = np.array([5, 3]), np.array([6, 4])
    kw = dict(causal=causal, window=window, softcap=1.5)
    out, lse = ref.attention(q, k, v, alibi_slopes=slopes, sinks=sinks, q_lengths=q_len,
                             kv_lengths=kv_len, return_lse=True, **kw)
    weights = ref.attention_weights(q, k, alibi_slopes=slopes, sinks=sinks, q_lengths=q_len,
                                    kv_lengths=kv_len, **kw)
    for b in range(B):
        for h in range(Hq):
            e_out, e_lse, e_w = loop_attention(
                q[b, h], k[b, h // 2], v[b, h // 2], scale=1 / math.sqrt(D), slope=slopes[h],
                sink=sinks[b, h], q_len=q_len[b], kv_len=kv_len[b], **kw)
            assert_close(out[b, h], e_out)
            assert_close(lse[b, h], e_lse)
            assert_close(weights[b, h], e_w)


def test_softcap_and_alibi_hand_computed():
    # softcap 1, scale 1, q . k = (2, 0, -2): scores tanh(2), 0, -tanh(2).
    q, k = np.array([[1.0]]), np.array([[2.0], [0.0], [-2.0]])
    e = np.exp([math.tanh(2), 0, -math.tanh(2)])
    np.testing.assert_allclose(ref.attention_weights(q, k, scale=1.0, softcap=1.0)[0],
                               e / e.sum(), rtol=1e-14)
    # ALiBi, one query on the last of three keys, zero scores: biases -2 s, -s, 0.
    q, k = np.zeros((1, 4)), np.ones((3, 4))
    e = np.exp([-2 * 0.5, -0.5, 0])
    np.testing.assert_allclose(ref.attention_weights(q, k, alibi_slopes=0.5)[0],
                               e / e.sum(), rtol=1e-14)
    # softcap comes before ALiBi: the bias is not capped. Scores 2 -> tanh(2), then -2 s.
    q, k = np.array([[1.0]]), np.array([[2.0], [2.0]])
    e = np.exp([math.tanh(2) - 1.0, math.tanh(2)])
    np.testing.assert_allclose(
        ref.attention_weights(q, k, scale=1.0, softcap=1.0, alibi_slopes=1.0)[0],
        e / e.sum(), rtol=1e-14)


def test_q_lengths_hand_computed(strict_warnings):
    # Lq = 3 rows of which 1 is real, Lk = 2, causal: the real row 0 sits on the last key
    # (j <= 0 + 2 - 1) and sees both. Garbage in the padding rows is never read.
    q = np.array([[0.0], [np.nan], [np.inf]])
    k, v = np.array([[1.0], [2.0]]), np.array([[1.0], [3.0]])
    out, lse = ref.attention(q, k, v, causal=True, q_lengths=1, return_lse=True)
    np.testing.assert_allclose(out, [[2.0], [0.0], [0.0]], rtol=1e-15)
    np.testing.assert_allclose(lse, [math.log(2), -np.inf, -np.inf], rtol=1e-15)
    # As if the padding rows were cut off; left in without q_lengths, they would move
    # row 0 onto key 2 - 3 + 0 < 0, where it sees nothing.
    np.testing.assert_array_equal(ref.attention(q[:1], k, v, causal=True), [[2.0]])
    out, lse = ref.attention(np.zeros((3, 1)), k, v, causal=True, return_lse=True)
    assert not out[0].any() and lse[0] == -np.inf


def test_q_lengths_equal_truncated_queries(rng):
    # The real rows of a padded call equal a call with the padding rows cut off.
    q, k, v = rng.standard_normal((3, 2, 6, 4)), rng.standard_normal((3, 2, 8, 4)), \
        rng.standard_normal((3, 2, 8, 4))
    q_len, kv_len = np.array([6, 2, 0]), np.array([8, 5, 3])
    slopes = rng.random(2)
    kw = dict(causal=True, window=(2, 0), alibi_slopes=slopes, softcap=3.0, sinks=[0.5, -1.0])
    out, lse = ref.attention(q, k, v, q_lengths=q_len, kv_lengths=kv_len, return_lse=True, **kw)
    for b in range(3):
        n, m = q_len[b], kv_len[b]
        o, l = ref.attention(q[b, :, :n], k[b, :, :m], v[b, :, :m], return_lse=True, **kw)
        assert_close(out[b, :, :n], o)
        assert_close(lse[b, :, :n], l)
        assert not out[b, :, n:].any() and np.all(lse[b, :, n:] == -np.inf)


# --------------------------------------------------------------------------- torch

def _explicit_bias(B, Hq, Lq, Lk, slopes, q_len, kv_len, causal):
    """The float mask (B, Hq, Lq, Lk) that expresses ALiBi, lengths and bottom-right causal."""
    i = np.arange(Lq)[:, None]
    j = np.arange(Lk)[None, :]
    bias = np.zeros((B, Hq, Lq, Lk))
    for b in range(B):
        off = kv_len[b] - q_len[b]
        bias[b] = -slopes[:, None, None] * np.abs(i + off - j)
        hidden = (j >= kv_len[b]) | (i >= q_len[b])
        if causal:
            hidden = hidden | (j > i + off)
        bias[b][:, hidden] = -np.inf
    return bias


@pytest.mark.parametrize("causal", [False, True])
def test_alibi_padding_against_torch(rng, causal):
    torch = pytest.importorskip("torch")
    F = torch.nn.functional
    B, Hq, Hkv, Lq, Lk, D = 3, 4, 2, 6, 9, 8
    q, k, v = (rng.standard_normal(s) for s in ((B, Hq, Lq, D), (B, Hkv, Lk, D), (B, Hkv, Lk, 5)))
    slopes = 2.0 ** -np.arange(1, Hq + 1)  # the ALiBi paper's geometric slopes
    q_len, kv_len = np.array([6, 4, 2]), np.array([9, 5, 1])
    out, lse = ref.attention(q, k, v, causal=causal, alibi_slopes=slopes, q_lengths=q_len,
                             kv_lengths=kv_len, return_lse=True)
    bias = _explicit_bias(B, Hq, Lq, Lk, slopes, q_len, kv_len, causal)
    tq, tk, tv = (torch.from_numpy(x) for x in (q, k, v))
    tk, tv = tk.repeat_interleave(2, dim=1), tv.repeat_interleave(2, dim=1)
    expected = F.scaled_dot_product_attention(tq, tk, tv, attn_mask=torch.from_numpy(bias)).numpy()
    live = np.isfinite(bias).any(axis=-1)  # torch makes rows with no visible key NaN
    assert live.sum() > B * Hq  # most rows are compared
    assert_close(out[live], expected[live])
    assert not out[~live].any()
    exp_lse = torch.logsumexp(torch.from_numpy(bias) + tq @ tk.transpose(-1, -2) / math.sqrt(D),
                              dim=-1).numpy()
    assert_close(lse, exp_lse)


def test_sinks_against_torch_extra_key(rng):
    # A sink is a key whose score is the sink and whose value is 0: append a coordinate 1 to
    # every query and a key (0, ..., 0, sink / scale) per head, so torch's softmax sees it.
    torch = pytest.importorskip("torch")
    F = torch.nn.functional
    B, H, Lq, Lk, D = 2, 3, 5, 5, 4
    q, k, v = (rng.standard_normal((B, H, L, D)) for L in (Lq, Lk, Lk))
    sinks = rng.standard_normal(H) * 2
    kv_len = np.array([5, 0])  # batch element 1 sees no key: only the sink
    out = ref.attention(q, k, v, causal=True, sinks=sinks, kv_lengths=kv_len)
    scale = 1 / math.sqrt(D)
    q_aug = np.concatenate([q, np.ones((B, H, Lq, 1))], axis=-1)
    k_sink = np.zeros((B, H, 1, D + 1))
    k_sink[..., 0, D] = sinks / scale
    k_aug = np.concatenate([np.concatenate([k, np.zeros((B, H, Lk, 1))], axis=-1), k_sink], axis=2)
    v_aug = np.concatenate([v, np.zeros((B, H, 1, D))], axis=2)
    mask = np.tril(np.ones((Lq, Lk), bool))[None, None] & (np.arange(Lk) < kv_len[:, None, None, None])
    mask = np.concatenate([mask, np.ones((B, 1, Lq, 1), bool)], axis=-1)  # the sink: always
    expected = F.scaled_dot_product_attention(
        *(torch.from_numpy(x) for x in (q_aug, k_aug, v_aug)), attn_mask=torch.from_numpy(mask),
        scale=scale).numpy()
    assert_close(out, expected)


# --------------------------------------------------------------------------- packed sequences

def _packed(rng, q_lens, k_lens, Hq, Hkv, D, Dv):
    cu_q = np.concatenate([[0], np.cumsum(q_lens)])
    cu_k = np.concatenate([[0], np.cumsum(k_lens)])
    # Packed the way FlashAttention stores them, (total, H, D), read heads first.
    q = rng.standard_normal((cu_q[-1], Hq, D)).transpose(1, 0, 2)
    k = rng.standard_normal((cu_k[-1], Hkv, D)).transpose(1, 0, 2)
    v = rng.standard_normal((cu_k[-1], Hkv, Dv)).transpose(1, 0, 2)
    return q, k, v, cu_q, cu_k


@pytest.mark.parametrize("causal, window", [(False, None), (True, None), (True, (2, 0)),
                                            (False, (1, 3))])
def test_varlen_rows_equal_separate_calls(rng, causal, window):
    q_lens, k_lens = [3, 0, 5, 1, 4], [6, 2, 5, 0, 4]
    q, k, v, cu_q, cu_k = _packed(rng, q_lens, k_lens, 4, 2, 6, 3)
    kw = dict(causal=causal, window=window, softcap=2.0, alibi_slopes=rng.random(4),
              sinks=rng.standard_normal(4))
    out, lse = ref.attention_varlen(q, k, v, cu_q, cu_k, return_lse=True, **kw)
    assert out.shape == (4, cu_q[-1], 3) and lse.shape == (4, cu_q[-1])
    for s in range(len(q_lens)):
        rows, keys = slice(cu_q[s], cu_q[s + 1]), slice(cu_k[s], cu_k[s + 1])
        o, l = ref.attention(q[:, rows], k[:, keys], v[:, keys], return_lse=True, **kw)
        np.testing.assert_array_equal(out[:, rows], o)
        np.testing.assert_array_equal(lse[:, rows], l)

    # The same batch right-padded, through FlashAttention's oracle with padding masks.
    B, Lq, Lk = len(q_lens), max(q_lens), max(k_lens)
    pad = lambda x, cu, L: np.stack([  # noqa: E731
        np.pad(x[:, cu[s]:cu[s + 1]], ((0, 0), (0, L - (cu[s + 1] - cu[s])), (0, 0)))
        for s in range(B)])
    exp_out, _, exp_lse = _fa_call(pad(q, cu_q, Lq), pad(k, cu_k, Lk), pad(v, cu_k, Lk),
                                   causal=causal, window=window, softcap=2.0,
                                   slopes=kw["alibi_slopes"], sinks=kw["sinks"],
                                   q_len=np.array(q_lens), kv_len=np.array(k_lens))
    for s in range(B):
        rows = slice(cu_q[s], cu_q[s + 1])
        assert_close(out[:, rows], exp_out[s, :, :q_lens[s]])
        assert_close(lse[:, rows], exp_lse[s, :, :q_lens[s]])


def test_varlen_out_dtypes_and_empty(rng):
    q, k, v, cu_q, cu_k = _packed(rng, [2, 3], [4, 1], 2, 1, 4, 4)
    q16, k16, v16 = (x.astype(np.float16) for x in (q, k, v))
    out = np.full((2, 5, 4), np.nan, np.float16)
    res, lse = ref.attention_varlen(q16, k16, v16, cu_q, cu_k, out=out, return_lse=True)
    assert res is out and lse.dtype == np.float32
    assert_close(out, ref.attention_varlen(q16.astype(np.float64), k16.astype(np.float64),
                                           v16.astype(np.float64), cu_q, cu_k), np.float16)
    # No sequences at all, and sequences without keys.
    e = np.zeros((2, 0, 4))
    assert ref.attention_varlen(e, e[:1], e[:1], [0], [0]).shape == (2, 0, 4)
    res, lse = ref.attention_varlen(q, k[:, :0], v[:, :0], cu_q, [0, 0, 0], sinks=[1.0, 2.0],
                                    return_lse=True)
    assert not res.any() and np.array_equal(lse, np.repeat([[1.0], [2.0]], 5, axis=1))


# --------------------------------------------------------------------------- dtypes

def _bf16():
    return np.dtype(pytest.importorskip("ml_dtypes").bfloat16)


@pytest.mark.parametrize("names, result, lse", [
    (("float16",) * 3, "float16", "float32"),
    (("float16", "float32", "float16"), "float32", "float32"),
    (("float16", "int8", "float16"), "float32", "float32"),
    (("float16", "float64", "float16"), "float64", "float64"),
    (("bfloat16",) * 3, "bfloat16", "float32"),
    (("bfloat16", "float32", "bfloat16"), "float32", "float32"),
    (("float32", "bfloat16", "bfloat16"), "float32", "float32"),
    (("bfloat16", "float16", "float16"), "float32", "float32"),
    (("bfloat16", "float64", "bfloat16"), "float64", "float64"),
    (("bfloat16", "int8", "bfloat16"), "float32", "float32"),
])
def test_reduced_precision_result_dtypes(rng, names, result, lse):
    dt = lambda n: _bf16() if n == "bfloat16" else np.dtype(n)  # noqa: E731
    q, k, v = (rng.integers(-2, 3, (2, 3, 4)).astype(np.float32).astype(dt(n)) for n in names)
    out, l = ref.attention(q, k, v, return_lse=True, causal=True, sinks=0.5)
    assert out.dtype == dt(result) and l.dtype == np.dtype(lse)
    # The values are those of float64 inputs holding the same (already rounded) numbers.
    q64, k64, v64 = (x.astype(np.float64) for x in (q, k, v))
    exp_out, _, exp_lse = _fa_call(q64[None], k64[None], v64[None], causal=True, sinks=0.5)
    assert_close(out, exp_out[0], out.dtype)
    assert_close(l, exp_lse[0], l.dtype)
    assert ref.attention_weights(q, k).dtype == _args.dtypes(q=q, k=k)[1]


@pytest.mark.parametrize("name", ["float16", "bfloat16"])
def test_reduced_precision_random(rng, name):
    dtype = _bf16() if name == "bfloat16" else np.dtype(np.float16)
    q, k, v = (rng.standard_normal(s).astype(dtype) for s in ((2, 4, 9, 16), (2, 2, 11, 16),
                                                              (2, 2, 11, 8)))
    kw = dict(causal=True, softcap=3.0, alibi_slopes=[0.1, 0.2, 0.3, 0.4], sinks=[0, 1, -1, 0])
    out = ref.attention(q, k, v, **kw)
    exp_out, _, _ = _fa_call(*(x.astype(np.float64) for x in (q, k, v)), causal=True,
                             softcap=3.0, slopes=np.array(kw["alibi_slopes"]),
                             sinks=np.array(kw["sinks"], float))
    assert out.dtype == dtype
    assert_close(out, exp_out, dtype)


def test_bfloat16_rounds_once_to_nearest(rng):
    # Against a table of every finite bfloat16 value: the nearest one, ties to even
    # (an even last bit of the 16-bit pattern).
    bf16 = _bf16()
    with np.errstate(invalid="ignore"):  # the NaN patterns
        bits = np.arange(2**16, dtype=np.uint16).view(bf16).astype(np.float64)
    table = np.unique(bits[np.isfinite(bits)])  # sorted; -0 and +0 merge
    x = np.concatenate([
        rng.standard_normal(2000) * 10.0 ** rng.integers(-40, 39, 2000),
        [1 + 2**-8 + 2**-30, 1 + 2**-8, 1 + 3 * 2**-8, 1.5 * 2**-133, 2**-134, 3.3e38],
        (table[1:] + table[:-1])[::97] / 2,  # exact midpoints
    ])
    x = x[np.abs(x) <= table[-1]]
    hi = np.searchsorted(table, x)
    lo = np.maximum(hi - 1, 0)
    hi = np.minimum(hi, len(table) - 1)
    d_lo, d_hi = np.abs(x - table[lo]), np.abs(table[hi] - x)
    even_hi = (table[hi].astype(np.float32).view(np.uint32) >> 16) % 2 == 0
    nearest = np.where((d_hi < d_lo) | ((d_hi == d_lo) & even_hi), table[hi], table[lo])
    got = _args.round_to(x, bf16).astype(np.float64)
    np.testing.assert_array_equal(got, nearest)
    assert _args.round_to(np.array([1 + 2**-8 + 2**-30]), bf16).astype(float)[0] == 1 + 2**-7


@pytest.mark.parametrize("make, name", [
    (lambda: np.ones((2, 3), np.complex64), "complex64"),
    (lambda: np.ones((2, 3), object), "object"),
    (lambda: np.ones((2, 3), np.longdouble), "float128"),
    (lambda: np.ones((2, 3)).astype(pytest.importorskip("ml_dtypes").float8_e4m3fn),
     "float8_e4m3fn"),
])
@pytest.mark.parametrize("arg", ["q", "k", "v"])
def test_unsupported_dtypes(make, name, arg):
    if name == "float128" and np.dtype(np.longdouble).itemsize <= 8:
        pytest.skip("long double is double here")
    args = {"q": np.ones((2, 3)), "k": np.ones((2, 3)), "v": np.ones((2, 3))}
    args[arg] = make()
    with pytest.raises(TypeError, match=f"^{arg} has unsupported dtype"):
        ref.attention(args["q"], args["k"], args["v"])
    with pytest.raises(TypeError, match=f"^{arg} has unsupported dtype"):
        ref.attention_varlen(args["q"][None], args["k"][None], args["v"][None], [0, 2], [0, 2])


_NO_ML_DTYPES = """
import sys
sys.modules["ml_dtypes"] = None  # import ml_dtypes now raises ImportError
import numpy as np
import fastattn
from fastattn import reference as ref
from fastattn._calls import args as _args
x = np.ones((2, 3, 4), np.float16)
out, lse = ref.attention(x, x, x, sinks=[0.0, 1.0], return_lse=True)
assert out.dtype == np.float16 and lse.dtype == np.float32
assert not _args.is_bfloat16(np.float16) and not _args.is_bfloat16("bfloat16")
try:
    _args.storage_dtype("bfloat16")
except TypeError as e:
    assert "pip install ml_dtypes" in str(e), e
else:
    raise AssertionError("bfloat16 without ml_dtypes did not raise")
print("ok")
"""

_NOT_IMPORTED = """
import sys
import numpy as np
import fastattn
from fastattn import reference as ref
x = np.ones((2, 3, 4), np.float16)
ref.attention(x, x, x, softcap=1.0, alibi_slopes=[1, 2], sinks=[0, 0], q_lengths=2)
ref.attention_varlen(x, x, x, [0, 3], [0, 3])
assert "ml_dtypes" not in sys.modules
print("ok")
"""


@pytest.mark.parametrize("script", [_NO_ML_DTYPES, _NOT_IMPORTED], ids=["blocked", "unused"])
def test_works_without_ml_dtypes(script):
    proc = run_python("-c", script, timeout=120)          # asserts exit status 0
    assert proc.stdout.strip() == "ok", proc.stderr[-2000:]


# --------------------------------------------------------------------------- randomised

def test_random_combinations_against_flash_attention_ref():
    hypothesis = pytest.importorskip("hypothesis")
    st = hypothesis.strategies

    @hypothesis.settings(max_examples=60, deadline=None)
    @hypothesis.given(st.data())
    def check(data):
        seed = data.draw(st.integers(0, 2**32 - 1))
        rng = np.random.default_rng(seed)
        B = data.draw(st.integers(1, 3))
        Hkv, g = data.draw(st.integers(1, 2)), data.draw(st.integers(1, 3))
        Hq = Hkv * g
        Lq, Lk, D = data.draw(st.integers(0, 6)), data.draw(st.integers(0, 7)), data.draw(st.integers(1, 5))
        side = st.sampled_from([-1, 0, 1, 3])
        window = data.draw(st.none() | st.tuples(side, side))
        causal = data.draw(st.booleans())
        softcap = data.draw(st.none() | st.sampled_from([0.5, 2.0, 20.0]))
        slopes = rng.random((B, Hq)) if data.draw(st.booleans()) else None
        sinks = rng.standard_normal(Hq) * 3 if data.draw(st.booleans()) else None
        q_len = rng.integers(0, Lq + 1, B) if data.draw(st.booleans()) else None
        kv_len = rng.integers(0, Lk + 1, B) if data.draw(st.booleans()) else None
        q = rng.standard_normal((B, Hq, Lq, D)) * 2
        k = rng.standard_normal((B, Hkv, Lk, D)) * 2
        v = rng.standard_normal((B, Hkv, Lk, 3))
        kw = dict(causal=causal, window=window, softcap=softcap)
        out, lse = ref.attention(q, k, v, alibi_slopes=slopes, sinks=sinks, q_lengths=q_len,
                                 kv_lengths=kv_len, return_lse=True, **kw)
        exp_out, _, exp_lse = _fa_call(q, k, v, slopes=slopes, sinks=sinks, q_len=q_len,
                                       kv_len=kv_len, **kw)
        assert_close(out, exp_out)
        assert_close(lse, exp_lse)

    check()
