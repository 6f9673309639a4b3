"""The backward pass's reproducibility (bitwise equal gradients whatever the thread count, the
batch, repeated calls; varlen rows as separate calls) and its checks of bad input."""
import tracemalloc

import numpy as np
import pytest

import fastattn


def _problem(rng, B=3, Hq=4, Hkv=2, Lq=150, Lk=260, D=40, Dv=24, dtype=np.float32, **kw):
    q = rng.standard_normal((B, Hq, Lq, D)).astype(dtype)
    k = rng.standard_normal((B, Hkv, Lk, D)).astype(dtype)
    v = rng.standard_normal((B, Hkv, Lk, Dv)).astype(dtype)
    out, lse = fastattn.attention(q, k, v, return_lse=True, **kw)
    dout = rng.standard_normal(out.shape).astype(out.dtype)
    dlse = rng.standard_normal(lse.shape).astype(lse.dtype)
    return (dout, q, k, v, out, lse), dict(kw, dlse=dlse)


def _same(a, b):
    return len(a) == len(b) and all(np.array_equal(x, y) and x.dtype == y.dtype
                                    for x, y in zip(a, b))


KEYWORDS = [
    dict(causal=True),
    dict(window=(50, 10), softcap=3.0, alibi_slopes=[0.5, 0.2, 0.1, 0.05]),
    dict(causal=True, kv_lengths=[260, 100, 7], q_lengths=[150, 80, 0],
         sinks=[0.5, -1.0, -np.inf, 2.0]),
]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("kw", KEYWORDS, ids=["causal", "window+modifiers", "lengths+sinks"])
def test_bitwise_across_threads_and_repeats(dtype, kw):
    args, kw = _problem(np.random.default_rng(0), dtype=dtype, **kw)
    with fastattn.num_threads(1):
        one = fastattn.attention_backward(*args, **kw)
    for n in (2, 3, 4):
        with fastattn.num_threads(n):
            assert _same(fastattn.attention_backward(*args, **kw), one)
    assert _same(fastattn.attention_backward(*args, **kw), one)


@pytest.mark.parametrize("kw", KEYWORDS[:2], ids=["causal", "window+modifiers"])
def test_bitwise_with_few_kv_heads(kw):
    # One kv head shared by 4 query heads: one thread takes the whole head in one work
    # item, more threads split its keys and rows into separate passes; the same bits.
    args, kw = _problem(np.random.default_rng(5), B=1, Hkv=1, Lq=300, Lk=333, **kw)
    with fastattn.num_threads(1):
        one = fastattn.attention_backward(*args, **kw)
    for n in (2, 3):
        with fastattn.num_threads(n):
            assert _same(fastattn.attention_backward(*args, **kw), one)


@pytest.mark.parametrize("kw", KEYWORDS[:2], ids=["causal", "window+modifiers"])
def test_bitwise_across_batch_sizes(kw):
    # each batch element alone gets the bits it gets in the batch
    args, kw = _problem(np.random.default_rng(1), **kw)
    whole = fastattn.attention_backward(*args, **kw)
    for b in range(3):
        part = fastattn.attention_backward(*(a[b:b + 1] for a in args),
                                           **dict(kw, dlse=kw["dlse"][b:b + 1]))
        assert _same(part, [g[b:b + 1] for g in whole])


def test_bitwise_across_query_rows_and_gqa_layout():
    # a decode row's dq has the bits of the same row in a prefill call
    args, kw = _problem(np.random.default_rng(2), B=1, Lq=120, Lk=120, causal=True)
    dout, q, k, v, out, lse = args
    dq = fastattn.attention_backward(*args, **kw)[0]
    last = [a[..., -1:, :] for a in (dout, q)] + [k, v, out[..., -1:, :], lse[..., -1:]]
    dq1 = fastattn.attention_backward(*last, causal=True, dlse=kw["dlse"][..., -1:])[0]
    assert np.array_equal(dq1, dq[..., -1:, :])


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_varlen_rows_equal_separate_calls(dtype, threads):
    # (one thread: a work item per sequence and kv head; three: separate passes)
    rng = np.random.default_rng(3)
    cu_q, cu_k = np.array([0, 100, 101, 101, 300]), np.array([0, 130, 200, 260, 600])
    q = rng.standard_normal((4, 300, 32)).astype(dtype)
    k = rng.standard_normal((1, 600, 32)).astype(dtype)
    v = rng.standard_normal((1, 600, 16)).astype(dtype)
    kw = dict(causal=True, window=(70, -1), softcap=4.0, sinks=[0.1, 0.2, -np.inf, 1.0])
    out, lse = fastattn.attention_varlen(q, k, v, cu_q, cu_k, return_lse=True, **kw)
    dout = rng.standard_normal(out.shape).astype(dtype)
    dlse = rng.standard_normal(lse.shape).astype(dtype)
    with fastattn.num_threads(threads):
        dq, dk, dv, _ = fastattn.attention_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k,
                                                           dlse=dlse, **kw)
    for s in range(4):
        r, c = slice(cu_q[s], cu_q[s + 1]), slice(cu_k[s], cu_k[s + 1])
        o, l = fastattn.attention(q[:, r], k[:, c], v[:, c], return_lse=True, **kw)
        g = fastattn.attention_backward(dout[:, r], q[:, r], k[:, c], v[:, c], o, l,
                                        dlse=dlse[:, r], **kw)
        assert _same(g[:3], (dq[:, r], dk[:, c], dv[:, c]))


# --------------------------------------------------------------------------- bad input

def _args():
    args, _ = _problem(np.random.default_rng(4), B=2, Lq=10, Lk=12, D=8, Dv=8)
    return list(args)


@pytest.mark.parametrize("index, bad, error, words", [
    (0, lambda a: a[..., :-1, :], ValueError, "dout must have the shape"),
    (0, lambda a: a.astype(np.float64), TypeError, "dout must have the dtype"),
    (4, lambda a: a[None], ValueError, "out must have the shape"),
    (4, lambda a: a.astype(np.float16), TypeError, "out must have the dtype"),
    (5, lambda a: a[..., :-1], ValueError, "lse must have the shape"),   # another Lq
    (5, lambda a: a.astype(np.float64), TypeError, "lse must have the dtype"),
    (1, lambda a: a[..., :5], ValueError, "same head dim"),             # the forward's check
    (3, lambda a: a[:, :1], ValueError, "same heads and length"),
])
def test_bad_arrays_raise(index, bad, error, words):
    args = _args()
    args[index] = bad(args[index])
    with pytest.raises(error, match=words):
        fastattn.attention_backward(*args)


@pytest.mark.parametrize("kw, error, words", [
    (dict(dlse=np.zeros((2, 4, 11), np.float32)), ValueError, "dlse must have the shape"),
    (dict(dlse=np.zeros((2, 4, 10), np.float64)), TypeError, "dlse must have the dtype"),
    (dict(window=(1, 2, 3)), ValueError, "window"),
    (dict(causal="left"), ValueError, "causal"),
    (dict(softcap=0), ValueError, "softcap"),
    (dict(sinks=np.zeros(3)), ValueError, "sinks"),
    (dict(kv_lengths=[13, 1]), ValueError, "kv_lengths"),
    (dict(mask=np.ones((10, 11), bool)), ValueError, "mask"),
])
def test_bad_keywords_raise(kw, error, words):
    with pytest.raises(error, match=words):
        fastattn.attention_backward(*_args(), **kw)


def test_varlen_bad_input_raises():
    rng = np.random.default_rng(5)
    q, k, v = (rng.standard_normal(s) for s in ((2, 9, 4), (1, 12, 4), (1, 12, 4)))
    out, lse = fastattn.attention_varlen(q, k, v, [0, 4, 9], [0, 5, 12], return_lse=True)
    with pytest.raises(ValueError, match="lse must have the shape"):
        fastattn.attention_varlen_backward(out, q, k, v, out, lse[:, :-1], [0, 4, 9], [0, 5, 12])
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        fastattn.attention_varlen_backward(out, q, k, v, out, lse, [0, 4, 8], [0, 5, 12])
    with pytest.raises(TypeError, match="dout must have the dtype"):
        fastattn.attention_varlen_backward(out.astype(np.float32), q, k, v, out, lse,
                                           [0, 4, 9], [0, 5, 12])


def test_memory_is_not_quadratic():
    # A 4096 x 4096 backward: its probabilities alone would take 64 MiB in float32; the
    # backward allocates its gradients, Delta and per-thread workspaces only.
    rng = np.random.default_rng(6)
    q, k, v = (rng.standard_normal((1, 1, 4096, 16)).astype(np.float32) for _ in range(3))
    out, lse = fastattn.attention(q, k, v, causal=True, return_lse=True)
    tracemalloc.start()
    try:
        fastattn.attention_backward(out, q, k, v, out, lse, causal=True)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 8 * 2**20, peak


def test_strided_inputs_give_the_bits_of_contiguous_ones():
    # (B, L, H, D) transposed, reversed keys, every other value column: read in place or
    # copied, the same gradients
    rng = np.random.default_rng(7)
    q = rng.standard_normal((2, 50, 4, 16)).transpose(0, 2, 1, 3)
    k = rng.standard_normal((2, 55, 4, 16))[:, ::-1].transpose(0, 2, 1, 3)
    v = rng.standard_normal((2, 4, 55, 32))[..., ::2]
    out, lse = fastattn.attention(q, k, v, causal=True, return_lse=True)
    dout = rng.standard_normal((2, 50, 4, 16)).transpose(0, 2, 1, 3)
    got = fastattn.attention_backward(dout, q, k, v, out, lse, causal=True)
    want = fastattn.attention_backward(*(np.ascontiguousarray(a) for a in (dout, q, k, v, out, lse)),
                                       causal=True)
    assert _same(got, want)
