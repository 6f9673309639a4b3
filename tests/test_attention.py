"""The fast kernel against the NumPy reference, over the whole contract.

Every test computes the same call with ``fastattn.attention`` (or ``attention_weights`` /
``softmax``) and with ``fastattn.reference`` and compares them with the per-dtype
tolerances of ``conftest.assert_close``. Shapes are chosen to hit the kernel's edges:
empty and single rows, odd sizes, sizes just past a block (257, 300), D = 1 and odd D.
"""

import warnings

import numpy as np
import pytest

import fastattn
from fastattn import reference as ref

from conftest import assert_close, make_qkv, max_error, merge_partials

# No call in this file may warn (overflow, invalid value in exp/log/divide, ...): the
# contract promises neither NaN nor warnings, hidden rows included.
pytestmark = pytest.mark.filterwarnings("error")


def check(q, k, v, dtype=None, **kw):
    """Run kernel and reference with return_lse; compare output, lse, dtypes and shapes."""
    out, lse = fastattn.attention(q, k, v, return_lse=True, **kw)
    out_ref, lse_ref = ref.attention(q, k, v, return_lse=True, **kw)
    assert out.dtype == out_ref.dtype, (out.dtype, out_ref.dtype)
    assert lse.dtype == lse_ref.dtype, (lse.dtype, lse_ref.dtype)
    assert_close(out, out_ref, dtype, err_msg=f"out, max error {max_error(out, out_ref):.3g}")
    assert_close(lse, lse_ref, lse_ref.dtype,
                 err_msg=f"lse, max error {max_error(lse, lse_ref):.3g}")
    return out, lse


# --------------------------------------------------------------------------- lengths, D

LENGTHS = [(0, 5), (5, 0), (0, 0), (1, 1), (7, 7), (33, 33), (7, 33), (33, 7), (1, 300),
           (257, 257), (300, 257)]


@pytest.mark.parametrize("causal", [False, True, "top-left"])
@pytest.mark.parametrize("D", [1, 5, 64, 128])
@pytest.mark.parametrize("Lq, Lk", LENGTHS)
def test_lengths_and_head_dims(rng, Lq, Lk, D, causal):
    q, k, v = make_qkv(rng, (2, Lq, D), (2, Lk, D), (2, Lk, D))
    check(q, k, v, causal=causal)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("D, Dv", [(64, 5), (5, 64), (1, 128), (128, 1), (3, 17)])
@pytest.mark.parametrize("Lq, Lk", [(7, 7), (33, 300), (257, 33)])
def test_value_dim_differs(rng, dtype, D, Dv, Lq, Lk):
    q, k, v = make_qkv(rng, (2, Lq, D), (2, Lk, D), (2, Lk, Dv), dtype)
    out, _ = check(q, k, v, causal=True)
    assert out.shape == (2, Lq, Dv)


def test_two_dim_inputs(rng):
    q, k, v = make_qkv(rng, (9, 4), (11, 4), (11, 6))
    out, lse = check(q, k, v, causal=True)
    assert out.shape == (9, 6) and lse.shape == (9,)


# --------------------------------------------------------------------------- heads, batch

@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("Hq, Hkv", [(4, 2), (8, 1), (4, 4), (6, 3)])
@pytest.mark.parametrize("Lq, Lk", [(1, 33), (7, 7), (33, 257), (257, 40)])
def test_gqa(rng, Hq, Hkv, Lq, Lk, causal):
    q, k, v = make_qkv(rng, (2, Hq, Lq, 16), (2, Hkv, Lk, 16), (2, Hkv, Lk, 8))
    out, lse = check(q, k, v, causal=causal)
    assert out.shape == (2, Hq, Lq, 8) and lse.shape == (2, Hq, Lq)


@pytest.mark.parametrize("q_batch, k_batch, v_batch", [
    ((2, 1), (1, 3), (1, 3)),
    ((2, 1), (1, 3), (2, 3)),
    ((1,), (4,), (4,)),
    ((3,), (1,), (1,)),
    ((2, 3), (3,), (1,)),   # padded on the left to (2, 3), (1, 3), (1, 1)
])
def test_batch_broadcast(rng, q_batch, k_batch, v_batch):
    H, Lq, Lk, D = 2, 5, 9, 8
    # k/v with fewer batch dims are padded with size-1 dims: q, k, v need the same ndim.
    nd = max(len(q_batch), len(k_batch), len(v_batch))
    pad = lambda b: (1,) * (nd - len(b)) + b
    q, k, v = make_qkv(rng, (*pad(q_batch), H, Lq, D), (*pad(k_batch), H, Lk, D),
                       (*pad(v_batch), H, Lk, D))
    out, _ = check(q, k, v, causal=True)
    batch = np.broadcast_shapes(pad(q_batch), pad(k_batch), pad(v_batch))
    assert out.shape == (*batch, H, Lq, D)


# --------------------------------------------------------------------------- dtypes

@pytest.mark.parametrize("dtypes, result", [
    ((np.float32,) * 3, np.float32),
    ((np.float64,) * 3, np.float64),
    ((np.float16,) * 3, np.float16),
    ((np.int64,) * 3, np.float64),
    ((np.int8,) * 3, np.float64),
    ((bool,) * 3, np.float64),
    ((np.float16, np.float32, np.float16), np.float32),
    ((np.float32, np.float64, np.float32), np.float64),
    ((np.int64, np.float32, np.float32), np.float64),
])
@pytest.mark.parametrize("causal", [False, True])
def test_dtypes(rng, dtypes, result, causal):
    shapes = [(2, 33, 16), (2, 40, 16), (2, 40, 16)]
    q, k, v = (make_qkv(rng, s, s, s, dt)[0] for s, dt in zip(shapes, dtypes))
    out, lse = check(q, k, v, dtype=result, causal=causal)
    assert out.dtype == result
    # lse is in the compute dtype: float16 is computed in float32.
    assert lse.dtype == (np.float32 if result in (np.float16, np.float32) else np.float64)


def test_integer_seed_examples():
    # Integer examples with printed results, unscaled: int64 in, float64 out, "Jiraiya" exactly.
    x = np.array([[1, 0, 1, 0], [0, 1, 0, 1], [1, 1, 1, 1]])
    check(x, x, x, scale=1.0)
    # Python lists are arrays like any other.
    np.testing.assert_array_equal(fastattn.attention(x.tolist(), x.tolist(), x.tolist(), scale=1.0),
                                  fastattn.attention(x, x, x, scale=1.0))
    x = np.array([[9, 31, 8], [106, 7, 0], [207, 15, 0]])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = fastattn.attention(x, x, x, scale=1.0)
    assert out.dtype == np.float64
    np.testing.assert_array_equal(out, [[207, 15, 0]] * 3)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_large_scores_are_stable(rng, dtype):
    # Scores up to ~1e4: the online max-shift must keep every intermediate finite.
    q, k, v = make_qkv(rng, (2, 40, 8), (2, 300, 8), (2, 300, 8), dtype)
    q, k = q * 30, k * 30
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out, lse = fastattn.attention(q, k, v, scale=1.0, causal=True, return_lse=True)
    out_ref, lse_ref = ref.attention(q, k, v, scale=1.0, causal=True, return_lse=True)
    assert np.isfinite(out).all() and np.isfinite(lse).all()
    # A score s is computed with an absolute error ~ |s| * eps * sqrt(D) in the input
    # precision, which exp() turns into that relative error of the weights: the usual
    # O(1)-score tolerance does not apply. Bound: 4 * max|s| * eps * sqrt(D) * max|v|.
    s_max = np.abs(q.astype(np.float64) @ k.astype(np.float64).swapaxes(-1, -2)).max()
    err = 4 * s_max * np.finfo(dtype).eps * np.sqrt(8)
    np.testing.assert_allclose(out, out_ref, rtol=0, atol=err * np.abs(v).max())
    np.testing.assert_allclose(lse, lse_ref, rtol=0, atol=err)


# --------------------------------------------------------------------------- causal / window

@pytest.mark.parametrize("window", [(0, 0), (2, 0), (3, 3), (-1, 4), (5, -1), (0, -1),
                                    (-1, -1), (40, 2)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("Lq, Lk", [(7, 7), (5, 40), (40, 5), (257, 300)])
def test_window(rng, window, causal, Lq, Lk):
    q, k, v = make_qkv(rng, (2, Lq, 8), (2, Lk, 8), (2, Lk, 8))
    check(q, k, v, causal=causal, window=window)


def test_causal_is_window_minus_one_zero(rng):
    q, k, v = make_qkv(rng, (2, 40, 8), (2, 300, 8), (2, 300, 8))
    np.testing.assert_array_equal(fastattn.attention(q, k, v, causal=True),
                                  fastattn.attention(q, k, v, window=(-1, 0)))
    np.testing.assert_array_equal(fastattn.attention(q, k, v, causal=True),
                                  fastattn.attention(q, k, v, causal="bottom-right"))


# --------------------------------------------------------------------------- kv_lengths

@pytest.mark.parametrize("causal", [False, True, "top-left"])
@pytest.mark.parametrize("window", [None, (3, 0)])
@pytest.mark.parametrize("Lq, Lk", [(1, 300), (7, 7), (33, 257), (40, 9)])
def test_kv_lengths(rng, causal, window, Lq, Lk):
    q, k, v = make_qkv(rng, (5, 2, Lq, 8), (5, 2, Lk, 8), (5, 2, Lk, 8))
    lengths = np.array([0, 1, Lk // 2, Lk - 1, Lk])
    out, lse = check(q, k, v, causal=causal, window=window, kv_lengths=lengths)
    assert not out[0].any() and np.all(lse[0] == -np.inf)


def test_kv_lengths_broadcast(rng):
    q, k, v = make_qkv(rng, (2, 3, 2, 5, 8), (2, 3, 2, 20, 8), (2, 3, 2, 20, 8))
    check(q, k, v, causal=True, kv_lengths=np.array([[4], [20]]))       # (2, 1)
    check(q, k, v, causal=True, kv_lengths=np.array([3, 0, 17]))        # (3,)
    check(q, k, v, kv_lengths=np.int32(7))                              # scalar
    check(q, k, v, kv_lengths=np.array([[1, 2, 3], [4, 5, 6]], dtype=np.uint8))


def test_kv_lengths_equals_sliced_keys(rng):
    # Right padding: the padded call agrees with each element sliced to its length.
    q, k, v = make_qkv(rng, (3, 2, 6, 8), (3, 2, 50, 8), (3, 2, 50, 8), np.float64)
    lengths = [50, 17, 6]
    out = fastattn.attention(q, k, v, causal=True, kv_lengths=np.array(lengths))
    for b, n in enumerate(lengths):
        sliced = fastattn.attention(q[b], k[b, :, :n], v[b, :, :n], causal=True)
        assert_close(out[b], sliced)


def test_kv_lengths_ignores_garbage_padding(rng, strict_warnings):
    # A preallocated cache: whatever lies beyond kv_lengths (here NaN/inf) never matters.
    q, k, v = make_qkv(rng, (3, 2, 6, 8), (3, 2, 300, 8), (3, 2, 300, 8))
    lengths = np.array([0, 100, 257])
    for b, n in enumerate(lengths):
        k[b, :, n:] = np.nan
        v[b, :, n:] = np.inf
    check(q, k, v, causal=True, kv_lengths=lengths)
    check(q, k, v, kv_lengths=lengths, window=(4, 4))


# --------------------------------------------------------------------------- masks

@pytest.mark.parametrize("kind", ["bool", "float", "float32"])
@pytest.mark.parametrize("mask_shape", [(7, 33), (1, 33), (2, 1, 33), (2, 7, 1), (3, 2, 7, 33),
                                        (33,)])
@pytest.mark.parametrize("causal", [False, True])
def test_masks(rng, kind, mask_shape, causal):
    q, k, v = make_qkv(rng, (3, 2, 7, 8), (3, 2, 33, 8), (3, 2, 33, 8), np.float64)
    if kind == "bool":
        mask = rng.random(mask_shape) < 0.7
    else:
        mask = rng.standard_normal(mask_shape)
        mask[rng.random(mask_shape) < 0.3] = -np.inf
        mask = mask.astype(np.float32 if kind == "float32" else np.float64)
    check(q, k, v, causal=causal, mask=mask)


@pytest.mark.parametrize("Lq, Lk", [(7, 33), (300, 257)])
def test_masks_large(rng, Lq, Lk):
    q, k, v = make_qkv(rng, (2, Lq, 16), (2, Lk, 16), (2, Lk, 16))
    mask = rng.random((Lq, Lk)) < 0.5
    check(q, k, v, mask=mask, causal=True, window=(100, -1))
    check(q, k, v, mask=np.where(mask, 0.0, -np.inf).astype(np.float32), kv_lengths=200 % Lk)


# --------------------------------------------------------------------------- hidden rows

def test_fully_hidden_rows(rng, strict_warnings):
    q, k, v = make_qkv(rng, (2, 2, 9, 8), (2, 2, 5, 8), (2, 2, 5, 8))
    cases = [
        dict(causal=True),                               # Lq > Lk: first 4 rows see nothing
        dict(mask=np.zeros((9, 5), bool)),
        dict(mask=np.full((9, 5), -np.inf)),
        dict(kv_lengths=np.array([0, 3])),
        dict(window=(0, 0), kv_lengths=np.array([5, 0])),
        dict(mask=np.arange(9)[:, None] % 2 == np.zeros((1, 5), int)),  # odd rows hidden
    ]
    for kw in cases:
        out, lse = check(q, k, v, **kw)
        out_ref, lse_ref = ref.attention(q, k, v, return_lse=True, **kw)
        hidden = lse_ref == -np.inf
        assert hidden.any(), kw
        np.testing.assert_array_equal(out[hidden], 0.0)
        assert np.all(lse[hidden] == -np.inf), kw
        w = fastattn.attention_weights(q, k, **kw)
        np.testing.assert_array_equal(w[hidden], 0.0)


def test_empty_shapes(strict_warnings):
    # (D = 0 is left out: the contract does not say what 1/sqrt(0) should mean.)
    for q_shape, k_shape, Dv in [((2, 0, 4), (2, 6, 4), 5), ((2, 3, 4), (2, 0, 4), 5),
                                 ((0, 2, 3, 4), (1, 2, 6, 4), 5), ((2, 3, 4), (2, 6, 4), 0)]:
        q, k = np.ones(q_shape, np.float32), np.ones(k_shape, np.float32)
        v = np.ones(k_shape[:-1] + (Dv,), np.float32)
        out, lse = check(q, k, v, causal=True)
        assert out.shape == np.broadcast_shapes(q_shape[:-1], k_shape[:-2] + (1,)) + (Dv,)


# --------------------------------------------------------------------------- strides

def _views(rng, dtype):
    """(name, q, k, v) with non-contiguous layouts of the same logical shapes."""
    H, Lq, Lk, D = 2, 33, 40, 16
    base_q = rng.standard_normal((Lq, H, D)).astype(dtype)
    base_k = rng.standard_normal((Lk, H, 2 * D)).astype(dtype)
    base_v = rng.standard_normal((H, 2 * Lk, D)).astype(dtype)
    yield ("transposed/sliced", base_q.transpose(1, 0, 2), base_k.transpose(1, 0, 2)[..., ::2],
           base_v[:, ::2])
    yield ("negative", base_q.transpose(1, 0, 2)[:, ::-1], base_k.transpose(1, 0, 2)[::-1, ::-1, :D],
           base_v[::-1, ::-2, ::-1])
    yield ("fortran", np.asfortranarray(base_q.transpose(1, 0, 2)),
           np.asfortranarray(base_k.transpose(1, 0, 2)[..., :D]), np.asfortranarray(base_v[:, :Lk]))
    # Stride-0 broadcast views: one key/value sequence shared by every batch element/head.
    yield ("broadcast", base_q.transpose(1, 0, 2), np.broadcast_to(base_k[:, 0, :D], (H, Lk, D)),
           np.broadcast_to(base_v[0, :Lk], (H, Lk, D)))


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
@pytest.mark.parametrize("causal", [False, True])
def test_strided_views(rng, dtype, causal):
    for name, q, k, v in _views(rng, dtype):
        out = fastattn.attention(q, k, v, causal=causal)
        # The same call on contiguous copies must agree bitwise: layout is not semantics.
        contiguous = fastattn.attention(*(np.ascontiguousarray(a) for a in (q, k, v)),
                                        causal=causal)
        np.testing.assert_array_equal(out, contiguous, err_msg=name)
        assert_close(out, ref.attention(q, k, v, causal=causal), dtype, err_msg=name)


def test_read_only_inputs_untouched(rng):
    q, k, v = make_qkv(rng, (2, 1, 9, 8), (2, 1, 12, 8), (2, 1, 12, 8))
    mask = rng.random((9, 12)) < 0.8
    lengths = np.array([12, 5])
    copies = [a.copy() for a in (q, k, v, mask, lengths)]
    for a in (q, k, v, mask, lengths):
        a.setflags(write=False)
    check(q, k, v, causal=True, mask=mask, kv_lengths=lengths)
    for a, c in zip((q, k, v, mask, lengths), copies):
        np.testing.assert_array_equal(a, c)


# --------------------------------------------------------------------------- out=

@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
def test_out(rng, dtype):
    q, k, v = make_qkv(rng, (2, 2, 33, 8), (2, 2, 40, 8), (2, 2, 40, 5), dtype)
    out = np.full((2, 2, 33, 5), np.nan, dtype=dtype)
    res = fastattn.attention(q, k, v, causal=True, out=out)
    assert res is out
    assert_close(out, ref.attention(q, k, v, causal=True), dtype)
    out2 = np.full_like(out, np.nan)
    res, lse = fastattn.attention(q, k, v, causal=True, out=out2, return_lse=True)
    assert res is out2
    np.testing.assert_array_equal(out2, out)
    # Hidden rows must be written as zeros, not left as they were.
    out3 = np.full((2, 2, 33, 5), np.nan, dtype=dtype)
    fastattn.attention(q, k, v, kv_lengths=np.array([0, 40]), out=out3)
    np.testing.assert_array_equal(out3[0], 0.0)


# --------------------------------------------------------------------------- lse / merging

@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("causal", [False, True])
def test_lse_merge_disjoint_masks(rng, dtype, causal):
    q, k, v = make_qkv(rng, (2, 2, 33, 16), (2, 2, 300, 16), (2, 2, 300, 16), dtype)
    full, lse = fastattn.attention(q, k, v, causal=causal, return_lse=True)
    part = rng.random(300) < 0.5
    o1, l1 = fastattn.attention(q, k, v, causal=causal, mask=part, return_lse=True)
    o2, l2 = fastattn.attention(q, k, v, causal=causal, mask=~part, return_lse=True)
    merged, merged_lse = merge_partials(o1, l1, o2, l2)
    assert_close(merged.astype(dtype), ref.attention(q, k, v, causal=causal), dtype)
    assert_close(merged.astype(dtype), full, dtype)
    assert_close(merged_lse.astype(dtype), lse, dtype)


def test_lse_merge_key_chunks(rng):
    # Split-K as a user would do it: attend to two slices of the keys, then merge.
    q, k, v = make_qkv(rng, (4, 7, 32), (4, 513, 32), (4, 513, 32), np.float64)
    o1, l1 = fastattn.attention(q, k[:, :200], v[:, :200], return_lse=True)
    o2, l2 = fastattn.attention(q, k[:, 200:], v[:, 200:], return_lse=True)
    merged, merged_lse = merge_partials(o1, l1, o2, l2)
    out_ref, lse_ref = ref.attention(q, k, v, return_lse=True)
    assert_close(merged, out_ref)
    assert_close(merged_lse, lse_ref)


# --------------------------------------------------------------------------- scale

@pytest.mark.parametrize("scale", [None, 1.0, 0.125, 2.0, 0.0, -0.5, 1, np.float32(0.3)])
def test_scale(rng, scale):
    q, k, v = make_qkv(rng, (2, 7, 8), (2, 33, 8), (2, 33, 4), np.float64)
    check(q, k, v, scale=scale, causal=True)


def test_scale_zero_is_uniform_average(rng):
    q, k, v = make_qkv(rng, (2, 5, 8), (2, 9, 8), (2, 9, 4), np.float64)
    assert_close(fastattn.attention(q, k, v, scale=0.0), np.broadcast_to(v.mean(1, keepdims=True), (2, 5, 4)))


# --------------------------------------------------------------------------- weights, softmax

@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16, np.int64])
@pytest.mark.parametrize("kw", [dict(), dict(causal=True), dict(causal="top-left"),
                                dict(window=(3, 1)), dict(kv_lengths=np.array([0, 20])),
                                dict(mask=np.tri(9, 20, 5, dtype=bool)), dict(scale=1.0)])
def test_attention_weights(rng, dtype, kw):
    q, k, _ = make_qkv(rng, (2, 2, 9, 8), (2, 1, 20, 8), (1, 1, 1, 1), dtype)
    w = fastattn.attention_weights(q, k, **kw)
    w_ref = ref.attention_weights(q, k, **kw)
    assert w.shape == (2, 2, 9, 20)
    assert_close(w, w_ref, w_ref.dtype)


def test_attention_weights_do_not_compute_with_the_oracle(rng, monkeypatch):
    # The library never computes through its oracle: with every function of the reference
    # broken, attention_weights still gives the textbook softmax, written out here.
    q, k, _ = make_qkv(rng, (2, 4, 5, 8), (2, 2, 7, 8), (1, 1, 1, 1), np.float64)
    slopes, sinks = np.array([0.5, 0.25, 0.0, 1.0]), np.array([0.3, -np.inf, 1.0, 2.0])
    for name in dir(ref):
        if callable(getattr(ref, name)) and not name.startswith("__"):
            monkeypatch.setattr(ref, name, None)
    w = fastattn.attention_weights(q, k, scale=0.5, causal=True, softcap=3.0,
                                   alibi_slopes=slopes, sinks=sinks)
    i, j = np.arange(5)[:, None], np.arange(7)
    s = 0.5 * q @ np.repeat(k, 2, axis=1).swapaxes(-1, -2)
    s = 3.0 * np.tanh(s / 3.0) - slopes[:, None, None] * np.abs(i + 2 - j)
    s = np.where(j <= i + 2, s, -np.inf)
    e = np.exp(s)
    want = e / (e.sum(-1, keepdims=True) + np.exp(sinks)[:, None, None])
    np.testing.assert_allclose(w, want, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("kw", [dict(causal=True, sinks=np.array([0.5, -1.0])),
                                dict(window=(2, 0), alibi_slopes=np.array([0.3, 0.1])),
                                dict(softcap=2.0, q_lengths=np.array([4, 9])),
                                dict(mask=np.tri(9, 20, 5) - 1e9 * (1 - np.tri(9, 20, 5)))])
def test_attention_weights_times_v_is_attention(rng, kw):
    # The weights and the kernel's output are the same softmax: w @ v is the output.
    q, k, v = make_qkv(rng, (2, 2, 9, 8), (2, 1, 20, 8), (2, 1, 20, 4), np.float64)
    w = fastattn.attention_weights(q, k, **kw)
    assert_close(w @ v, fastattn.attention(q, k, v, **kw))


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16, np.int32])
@pytest.mark.parametrize("shape, axis", [((5,), -1), ((3, 7), -1), ((3, 7), 0), ((2, 3, 300), -1),
                                         ((2, 3, 4), 1), ((4, 0), -1), ((0, 4), -1)])
def test_softmax(rng, dtype, shape, axis):
    x = (rng.standard_normal(shape) * 5).astype(dtype)
    assert_close(fastattn.softmax(x, axis=axis), ref.softmax(x, axis=axis),
                 ref.softmax(x, axis=axis).dtype)


def test_softmax_special_rows(strict_warnings):
    x = np.array([[-np.inf, -np.inf, -np.inf], [0.0, -np.inf, 0.0], [1106, 1171, 2328],
                  [-1e30, -1e30, -1e30]])
    for dtype in (np.float64, np.float32):
        np.testing.assert_array_equal(fastattn.softmax(x.astype(dtype)),
                                      ref.softmax(x.astype(dtype)))
    np.testing.assert_array_equal(fastattn.softmax(x)[0], 0.0)
    np.testing.assert_allclose(fastattn.softmax([1, 2, 3]),
                               [0.09003057317038284, 0.24472847105480003, 0.6652409557748171],
                               rtol=1e-11)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("Hq, Hkv", [(2, 2), (4, 1)])
def test_float16_long(rng, causal, Hq, Hkv):
    # float16 over many keys: the float32 accumulation must keep one float16 rounding.
    q, k, v = make_qkv(rng, (Hq, 257, 128), (Hkv, 1030, 128), (Hkv, 1030, 64), np.float16)
    check(q, k, v, causal=causal)


# --------------------------------------------------------------------------- random combos

from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402


@st.composite
def attention_case(draw):
    """A random, valid call: shapes, GQA, batch broadcast, causal, window, lengths, mask."""
    group = draw(st.sampled_from([1, 2, 3]))
    Hkv = draw(st.integers(1, 2))
    Lq, Lk = draw(st.integers(0, 70)), draw(st.integers(0, 140))
    D, Dv = draw(st.sampled_from([1, 3, 8, 16, 33])), draw(st.sampled_from([1, 4, 16, 19]))
    qb, kb = draw(st.sampled_from([((1,), (2,)), ((2,), (1,)), ((2,), (2,)), ((3, 1), (1, 2))]))
    kw = dict(causal=draw(st.sampled_from([False, True, "top-left"])))
    if draw(st.booleans()):
        kw["window"] = (draw(st.integers(-1, 20)), draw(st.integers(-1, 20)))
    batch = np.broadcast_shapes(qb, kb)
    if draw(st.booleans()):
        kw["kv_lengths"] = np.array(draw(st.lists(st.integers(0, Lk), min_size=batch[-1],
                                                  max_size=batch[-1])))
    mask_kind = draw(st.sampled_from([None, "bool", "float"]))
    seed = draw(st.integers(0, 2**32 - 1))
    dtype = draw(st.sampled_from([np.float32, np.float64]))
    return (qb, kb, group * Hkv, Hkv, Lq, Lk, D, Dv, kw, mask_kind, seed, dtype)


# 100 examples by default (~3 s); `pytest --hypothesis-profile=thorough` runs 3000.
@settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(attention_case())
def test_random_combinations(case):
    qb, kb, Hq, Hkv, Lq, Lk, D, Dv, kw, mask_kind, seed, dtype = case
    rng = np.random.default_rng(seed)
    q, k, v = make_qkv(rng, (*qb, Hq, Lq, D), (*kb, Hkv, Lk, D), (*kb, Hkv, Lk, Dv), dtype)
    if mask_kind == "bool":
        kw["mask"] = rng.random((Hq, 1, Lk)) < 0.8
    elif mask_kind == "float":
        kw["mask"] = np.where(rng.random((Lq, Lk)) < 0.8, rng.standard_normal((Lq, Lk)), -np.inf)
    check(q, k, v, **kw)


# --------------------------------------------------------------------- packed sequences


def test_varlen_reads_total_h_d_views(rng):
    # A (total, H, D) array's transpose(1, 0, 2) view is read in place.
    qt = rng.standard_normal((50, 3, 16)).astype(np.float32)
    view = qt.transpose(1, 0, 2)
    cu = np.array([0, 20, 50])
    out = fastattn.attention_varlen(view, view, view, cu, cu, causal=True)
    want = fastattn.attention_varlen(np.ascontiguousarray(view), np.ascontiguousarray(view),
                                     np.ascontiguousarray(view), cu, cu, causal=True)
    np.testing.assert_array_equal(out, want)
