"""Tests of fastattn.layers: self_attention, MultiHeadAttention, KVCache.

Oracles: numbers printed by an independent torch implementation of the same examples,
compositions of ``fastattn.reference`` with
plain NumPy (heads taken apart by hand), and torch.nn.MultiheadAttention when installed.
"""

import pickle

import numpy as np
import pytest

import fastattn
from fastattn import reference
from fastattn._calls import api as _api
from fastattn.layers import KVCache, MultiHeadAttention, self_attention

TOL32 = dict(rtol=2e-5, atol=2e-6)
TOL64 = dict(rtol=1e-11, atol=1e-12)


@pytest.fixture
def rng():
    return np.random.default_rng(4)


@pytest.fixture
def kernel_calls(monkeypatch):
    """Record every call of the compiled front-end's ``attention`` (and still run it)."""
    calls = []
    original = _api.attention

    def spy(q, k, v, **kwargs):
        calls.append((q, k, v, kwargs))
        return original(q, k, v, **kwargs)

    monkeypatch.setattr(_api, "attention", spy)
    return calls


# --------------------------------------------------------------------------- oracles

def mha_oracle(layer, x, *, causal=False, mask=None, kv_lengths=None):
    """The layer's math with each head taken apart explicitly, attention by the reference."""
    H, Hkv, dh, dv = layer.n_heads, layer.n_kv_heads, layer.d_head, layer.d_value
    bias = lambda b: 0 if b is None else b  # noqa: E731
    q = x @ layer.w_q + bias(layer.b_q)
    k = x @ layer.w_k + bias(layer.b_k)
    v = x @ layer.w_v + bias(layer.b_v)
    group = H // Hkv
    heads = []
    for h in range(H):
        g = h // group
        qh = q[..., h * dh:(h + 1) * dh][..., None, :, :]   # one head: (..., 1, L, dh)
        kh = k[..., g * dh:(g + 1) * dh][..., None, :, :]
        vh = v[..., g * dv:(g + 1) * dv][..., None, :, :]
        mh = None if mask is None else np.broadcast_to(
            mask, x.shape[:-2] + (H, x.shape[-2], x.shape[-2]))[..., h:h + 1, :, :]
        heads.append(reference.attention(qh, kh, vh, causal=causal, mask=mh,
                                         kv_lengths=kv_lengths)[..., 0, :, :])
    return np.concatenate(heads, axis=-1) @ layer.w_o + bias(layer.b_o)


# --------------------------------------------------------------------------- self_attention

def test_self_attention_examples():
    x = np.array([[1, 0, 1, 0], [0, 1, 0, 1], [1, 1, 1, 1]])
    out = self_attention(x, scale=1.0)
    assert out.dtype == np.float64           # integer inputs compute in float64
    np.testing.assert_allclose(out, [[0.93662106, 0.53168947, 0.93662106, 0.53168947],
                                     [0.53168947, 0.93662106, 0.53168947, 0.93662106],
                                     [0.89349302, 0.89349302, 0.89349302, 0.89349302]], atol=5e-9)
    # "Jiraiya": scores up to 43074, the softmax must not overflow.
    x = np.array([[9, 31, 8], [106, 7, 0], [207, 15, 0]])
    np.testing.assert_array_equal(self_attention(x, scale=1.0), [[207, 15, 0]] * 3)


def test_self_attention_context_vectors():
    x = np.array([[0.43, 0.15, 0.89], [0.55, 0.87, 0.66], [0.57, 0.85, 0.64],
                  [0.22, 0.58, 0.33], [0.77, 0.25, 0.10], [0.05, 0.80, 0.55]])
    printed = [[0.4421, 0.5931, 0.5790], [0.4419, 0.6515, 0.5683], [0.4431, 0.6496, 0.5671],
               [0.4304, 0.6298, 0.5510], [0.4671, 0.5910, 0.5266], [0.4177, 0.6503, 0.5645]]
    np.testing.assert_allclose(self_attention(x, scale=1.0), printed, atol=5e-5)
    np.testing.assert_allclose(self_attention(x.astype(np.float32), scale=1.0), printed, atol=5e-5)


def test_self_attention_masked_contextualised_vectors():
    y = self_attention(np.array([[1, 2], [1, 0], [1, 1], [2, 2]]), scale=1.0, causal=True)
    np.testing.assert_allclose(y, [[1.0, 2.0], [1.0, 1.0], [1.0, 1.5752103826044344],
                                   [1.8649548767993709, 1.9798697812543224]], rtol=1e-13)
    emb = {"each": [4, 3, 3], "session": [7, 2, 1], "person": [1, 2, 7],
           "has": [3.5, 3, 3.5], "a": [3, 3, 4], "chair": [3, 4, 3]}
    s1 = np.array([emb[w] for w in ["each", "session", "has", "a", "chair"]])
    s2 = np.array([emb[w] for w in ["each", "person", "has", "a", "chair"]])
    np.testing.assert_allclose(self_attention(s1, scale=1.0, causal=True)[-1],
                               [3.488241706560337, 3.3861879899594367, 3.1255703034802282],
                               rtol=1e-13)
    np.testing.assert_allclose(self_attention(s2, scale=1.0, causal=True)[-1],
                               [3.1255703034802282, 3.3861879899594367, 3.4882417065603373],
                               rtol=1e-13)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_self_attention_equals_reference_composition(rng, causal, dtype):
    x = rng.standard_normal((2, 3, 7, 5)).astype(dtype)
    w_q, w_k = rng.standard_normal((2, 5, 4)).astype(dtype)
    w_v = rng.standard_normal((5, 6)).astype(dtype)
    w_o = rng.standard_normal((6, 3)).astype(dtype)
    out = self_attention(x, w_q, w_k, w_v, w_o, scale=0.3, causal=causal)
    expected = reference.attention(x @ w_q, x @ w_k, x @ w_v, scale=0.3, causal=causal) @ w_o
    assert out.shape == (2, 3, 7, 3) and out.dtype == dtype
    np.testing.assert_allclose(out, expected, **(TOL32 if dtype == np.float32 else TOL64))
    # Missing weights are the identity; scale None is 1/sqrt(d_k).
    np.testing.assert_allclose(self_attention(x, w_v=w_v, causal=causal),
                               reference.attention(x, x, x @ w_v, causal=causal),
                               **(TOL32 if dtype == np.float32 else TOL64))


def test_self_attention_per_head_weights_broadcast(rng, kernel_calls):
    x = rng.standard_normal((4, 3))                       # 4 words, 3 dims
    w_q, w_k = rng.random((2, 5, 3, 6))                   # 5 heads, d_query 6
    w_v = rng.random((3, 8))                              # values shared by the heads
    out = self_attention(x, w_q, w_k, w_v)
    assert out.shape == (5, 4, 8)
    for h in range(5):
        np.testing.assert_allclose(out[h], reference.attention(x @ w_q[h], x @ w_k[h], x @ w_v),
                                   **TOL64)
    (_, _, v, _), = kernel_calls
    assert v.strides[0] == 0                              # broadcast view, not 5 copies


def test_self_attention_calls_the_kernel(kernel_calls):
    self_attention(np.eye(3), scale=1.0, causal=True)
    assert len(kernel_calls) == 1
    assert kernel_calls[0][3]["causal"] is True and kernel_calls[0][3]["scale"] == 1.0


@pytest.mark.parametrize("args, exc, word", [
    ((np.ones(3),), ValueError, "x"),
    ((np.ones((2, 3)), np.ones((4, 2))), ValueError, "w_q"),
    ((np.ones((2, 3)), None, np.ones((2, 2))), ValueError, "w_k"),
    ((np.ones((2, 3)), np.ones((3, 2)), np.ones((3, 4))), ValueError, "w_q and w_k"),
    ((np.ones((2, 3)), None, None, np.ones((4, 5))), ValueError, "w_v"),
    ((np.ones((2, 3)), None, None, None, np.ones((4, 2))), ValueError, "w_o"),
    ((np.ones((2, 3)), np.ones((2, 3, 2)), np.ones((3, 3, 2))), ValueError, "broadcast"),
    ((np.ones((2, 3), dtype=complex),), TypeError, "x"),
    ((np.ones((2, 3)), np.array([["a"] * 3] * 3)), TypeError, "w_q"),
])
def test_self_attention_bad_arguments(args, exc, word):
    with pytest.raises(exc, match=word):
        self_attention(*args)


# --------------------------------------------------------------------------- MultiHeadAttention

def test_mha_weights_shapes_init_and_seed():
    m = MultiHeadAttention(12, 6, n_kv_heads=2, d_head=4, d_value=5, bias=True, seed=7)
    assert m.w_q.shape == (12, 24) and m.w_k.shape == (12, 8) and m.w_v.shape == (12, 10)
    assert m.w_o.shape == (30, 12)
    assert (m.b_q.shape, m.b_k.shape, m.b_v.shape, m.b_o.shape) == ((24,), (8,), (10,), (12,))
    assert all(w.dtype == np.float32 for w in (m.w_q, m.w_k, m.w_v, m.w_o, m.b_q, m.b_o))
    # torch.nn.Linear-style init: U(-1/sqrt(fan_in), 1/sqrt(fan_in)), zero biases.
    assert np.abs(m.w_q).max() <= 1 / np.sqrt(12) and np.abs(m.w_q).max() > 0.8 / np.sqrt(12)
    assert np.abs(m.w_o).max() <= 1 / np.sqrt(30) and np.abs(m.w_o).max() > 0.8 / np.sqrt(30)
    assert not m.b_q.any() and not m.b_o.any()
    again = MultiHeadAttention(12, 6, n_kv_heads=2, d_head=4, d_value=5, bias=True, seed=7)
    np.testing.assert_array_equal(again.w_v, m.w_v)
    assert not np.array_equal(MultiHeadAttention(12, 6, seed=8).w_q, MultiHeadAttention(12, 6, seed=9).w_q)
    d = MultiHeadAttention(16, 4, dtype=np.float64)
    assert d.d_head == 4 and d.d_value == 4 and d.n_kv_heads == 4 and d.w_q.dtype == np.float64
    assert d.b_q is None


def test_mha_learned_step():
    """A worked example's "Schritt 7": the 4th word attends to the first three, projected by W_O.
    Its printed scores [-91, -163, -81.5] are unscaled (the sqrt(d_k) cell was not run)."""
    m = MultiHeadAttention(3, 1, d_head=3, d_value=4, dtype=np.float64, scale=1.0)
    m.w_q = np.array([[1, 2, 1], [-1, 1, 0], [-2, 1, 1]])
    m.w_k = np.array([[-1, -2, -1], [-1, -1, 2], [0, -1, 1]])
    m.w_v = np.array([[-1, 1, -2, 2], [1, 0, 1, 1], [1, 0, 0, -1]])
    m.w_o = np.array([[1, 1, 2], [3, 1, 2], [6, 2, 1], [0, 0, 1]])
    x = np.array([[4, 3, 3], [7, 2, 1], [3.5, 3, 3.5], [3, 3, 4], [3, 4, 3]])
    mask = np.ones((5, 5), dtype=bool)
    mask[3, 3:] = False                  # row 3 sees its first three keys only
    out = m(x, mask=mask)
    np.testing.assert_allclose(out[3], [-10.500411654251309, -1.5001871155687763, 15.499962576886247],
                               rtol=1e-12)
    np.testing.assert_allclose(m.attention_weights(x, mask=mask)[0, 3, :3],
                               [7.484622751062311e-05, 4.026866373829326e-36, 0.9999251537724895],
                               rtol=1e-10)


@pytest.mark.parametrize("n_kv_heads", [4, 2, 1])
@pytest.mark.parametrize("causal", [False, True])
def test_mha_equals_per_head_reference(rng, n_kv_heads, causal):
    m = MultiHeadAttention(16, 4, n_kv_heads=n_kv_heads, d_head=6, d_value=3, bias=True,
                           dtype=np.float64, seed=1)
    for name in ("b_q", "b_k", "b_v", "b_o"):
        setattr(m, name, rng.standard_normal(getattr(m, name).shape))
    x = rng.standard_normal((2, 3, 9, 16))
    out = m(x, causal=causal)
    assert out.shape == x.shape and out.dtype == np.float64
    np.testing.assert_allclose(out, mha_oracle(m, x, causal=causal), **TOL64)


def test_mha_float32_mask_and_kv_lengths(rng):
    m = MultiHeadAttention(8, 2, seed=2)
    x = rng.standard_normal((3, 5, 8)).astype(np.float32)
    mask = rng.random((3, 2, 5, 5)) < 0.7
    out = m(x, mask=mask)
    assert out.dtype == np.float32
    np.testing.assert_allclose(out, mha_oracle(m, x.astype(np.float64), mask=mask), **TOL32)
    lengths = np.array([5, 2, 0])
    out = m(x, kv_lengths=lengths, causal="top-left")
    np.testing.assert_allclose(out, mha_oracle(m, x.astype(np.float64), kv_lengths=lengths,
                                               causal="top-left"), **TOL32)
    # A sequence with no keys gives attention zeros, so only the output bias (none) remains.
    np.testing.assert_array_equal(out[2], 0)


def test_mha_batch_dims_equal_loop(rng):
    m = MultiHeadAttention(8, 4, n_kv_heads=2, seed=3)
    x = rng.standard_normal((2, 3, 6, 8)).astype(np.float32)
    out = m(x, causal=True)
    for i in range(2):
        for j in range(3):
            np.testing.assert_allclose(out[i, j], m(x[i, j], causal=True), **TOL32)


def test_mha_uses_kernel_with_head_views_and_no_kv_repeat(rng, kernel_calls):
    m = MultiHeadAttention(32, 8, n_kv_heads=2, seed=0)
    m(rng.standard_normal((3, 10, 32)).astype(np.float32), causal=True)
    (q, k, v, kwargs), = kernel_calls
    assert q.shape == (3, 8, 10, 4) and k.shape == (3, 2, 10, 4) and v.shape == (3, 2, 10, 4)
    for a in (q, k, v):
        assert a.base is not None                         # views of the projections
        assert not a.flags.c_contiguous                   # (..., H, L, d) is a transpose
    assert kwargs["causal"] is True


def test_mha_attention_weights(rng):
    m = MultiHeadAttention(6, 3, n_kv_heads=1, dtype=np.float64, seed=5)
    x = rng.standard_normal((2, 4, 6))
    w = m.attention_weights(x, causal=True)
    assert w.shape == (2, 3, 4, 4)
    q = (x @ m.w_q).reshape(2, 4, 3, 2).swapaxes(1, 2)
    k = (x @ m.w_k).reshape(2, 4, 1, 2).swapaxes(1, 2)
    np.testing.assert_allclose(w, reference.attention_weights(q, k, causal=True), **TOL64)


@pytest.mark.parametrize("kwargs, exc, word", [
    (dict(d_model=0, n_heads=1), ValueError, "d_model"),
    (dict(d_model=10, n_heads=4), ValueError, "n_heads"),
    (dict(d_model=8, n_heads=4, n_kv_heads=3), ValueError, "n_kv_heads"),
    (dict(d_model=8, n_heads=2.0), TypeError, "n_heads"),
    (dict(d_model=8, n_heads=2, d_value=0), ValueError, "d_value"),
    (dict(d_model=8, n_heads=2, dtype=np.int32), TypeError, "dtype"),
    (dict(d_model=6, n_heads=2, rope=True), ValueError, "rope"),
    # The rules of fastattn.attention's scale and window and of rope's base, at construction.
    (dict(d_model=8, n_heads=2, scale="2"), TypeError, "scale"),
    (dict(d_model=8, n_heads=2, scale=True), TypeError, "scale"),
    (dict(d_model=8, n_heads=2, scale=np.inf), ValueError, "scale"),
    (dict(d_model=8, n_heads=2, window=(-2, 0)), ValueError, "window"),
    (dict(d_model=8, n_heads=2, rope=True, rope_base=0.0), ValueError, "base"),
])
def test_mha_constructor_errors(kwargs, exc, word):
    with pytest.raises(exc, match=word):
        MultiHeadAttention(**kwargs)


def test_mha_call_errors():
    m = MultiHeadAttention(8, 2, seed=0)
    with pytest.raises(ValueError, match="x"):
        m(np.ones((3, 7)))
    with pytest.raises(ValueError, match="x"):
        m(np.ones(8))
    m.w_k = np.ones((8, 3))
    with pytest.raises(ValueError, match=r"w_k has shape \(8, 3\), expected \(8, 8\)"):
        m(np.ones((3, 8)))
    m = MultiHeadAttention(8, 2, seed=0)
    m.b_o = np.ones(3)
    with pytest.raises(ValueError, match="b_o"):
        m(np.ones((3, 8)))
    m.b_o = None
    with pytest.raises(TypeError, match="cache"):
        m(np.ones((3, 8)), cache={})
    with pytest.raises(ValueError, match="causal"):
        m(np.ones((3, 8)), cache=KVCache(), causal="top-left")
    with pytest.raises(ValueError, match="kv_lengths"):
        m(np.ones((2, 3, 8)), cache=KVCache(), kv_lengths=[1, 4])
    cache = KVCache()
    m(np.ones((2, 3, 8)), cache=cache)
    with pytest.raises(ValueError, match="batch shape"):
        m(np.ones((3, 3, 8)), cache=cache)


# --------------------------------------------------------------------------- KV cache decoding

def exact_layer(dtype, n_kv_heads=2, rng=None):
    """A layer whose projections are exact in ``dtype`` (small dyadic weights) and w_o = I,
    so decode and prefill outputs can be compared bit for bit (BLAS rounding of a 1-row
    product may differ from that of an L-row product only when rounding happens at all)."""
    rng = np.random.default_rng(0) if rng is None else rng
    m = MultiHeadAttention(16, 4, n_kv_heads=n_kv_heads, dtype=dtype)
    for name in ("w_q", "w_k", "w_v"):
        setattr(m, name, (rng.integers(-4, 5, getattr(m, name).shape) / 8).astype(dtype))
    m.w_o = np.eye(16, dtype=dtype)
    return m


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("n_kv_heads", [4, 2, 1])
def test_decode_token_by_token_is_bitwise_prefill(rng, dtype, n_kv_heads):
    m = exact_layer(dtype, n_kv_heads, rng)
    x = rng.integers(-3, 4, (2, 11, 16)).astype(dtype)
    full = m(x, causal=True)
    cache = KVCache(capacity=2)                     # forces several geometric growths
    rows = []
    for t in range(11):
        out, cache_back = m(x[:, t:t + 1], cache=cache)
        assert cache_back is cache
        rows.append(out)
    np.testing.assert_array_equal(np.concatenate(rows, axis=1), full)
    assert cache.lengths.tolist() == [11, 11] and cache.capacity == 16


def test_decode_random_weights_allclose_and_chunks(rng):
    m = MultiHeadAttention(32, 4, n_kv_heads=2, bias=True, seed=11)
    m.b_k[:] = rng.standard_normal(m.b_k.shape)
    x = rng.standard_normal((3, 20, 32)).astype(np.float32)
    full = m(x, causal=True)
    cache = KVCache()
    pieces = []
    for a, b in [(0, 7), (7, 8), (8, 9), (9, 15), (15, 20)]:   # prefill, steps, chunks
        pieces.append(m(x[:, a:b], cache=cache, causal=True)[0])
    np.testing.assert_allclose(np.concatenate(pieces, axis=1), full, **TOL32)
    # Single tokens need no causal flag: one query sees the whole cache either way.
    cache = KVCache()
    m(x[:, :10], cache=cache, causal=True)
    step = m(x[:, 10:11], cache=cache)[0]
    np.testing.assert_allclose(step, full[:, 10:11], **TOL32)


def test_decode_attention_step_reads_the_cache_without_copies(rng, kernel_calls):
    m = MultiHeadAttention(16, 4, n_kv_heads=1, seed=0)
    cache = KVCache(capacity=8)
    m(rng.standard_normal((5, 16)).astype(np.float32), cache=cache, causal=True)
    m(rng.standard_normal((1, 16)).astype(np.float32), cache=cache)
    q, k, v, kwargs = kernel_calls[-1]
    assert q.shape == (4, 1, 4) and k.shape == (1, 6, 4) and v.shape == (1, 6, 4)
    assert np.shares_memory(k, cache.k) and np.shares_memory(v, cache.v)
    assert kwargs["kv_lengths"] is None                 # uniform lengths: just a slice


def test_batched_cache_with_different_lengths(rng):
    """Right-padded prompts of lengths 3 and 6, then 4 decode steps: each sequence's rows
    equal an unpadded causal run of that sequence alone."""
    m = MultiHeadAttention(16, 4, n_kv_heads=2, rope=True, seed=3)
    lens = [3, 6]
    seqs = [rng.standard_normal((n + 4, 16)).astype(np.float32) for n in lens]
    prompt = np.zeros((2, 6, 16), np.float32)
    for b, n in enumerate(lens):
        prompt[b, :n] = seqs[b][:n]
    cache = KVCache(capacity=4)
    out, _ = m(prompt, cache=cache, causal=True, kv_lengths=lens)
    assert cache.lengths.tolist() == lens
    steps = [m(np.stack([s[n + t] for s, n in zip(seqs, lens)])[:, None], cache=cache)[0]
             for t in range(4)]
    assert cache.lengths.tolist() == [7, 10]
    for b, n in enumerate(lens):
        alone = m(seqs[b], causal=True)
        np.testing.assert_allclose(out[b, :n], alone[:n], **TOL32)
        np.testing.assert_allclose(np.concatenate([s[b] for s in steps]), alone[n:], **TOL32)
    # The cache holds each sequence's keys contiguously from position 0.
    k_alone = (seqs[1] @ m.w_k).reshape(10, 2, 4).swapaxes(0, 1)
    from fastattn.positions import rope
    np.testing.assert_allclose(cache.k[1], rope(k_alone), **TOL32)


def test_padded_non_causal_prefill_ignores_padding(rng):
    m = MultiHeadAttention(8, 2, dtype=np.float64, seed=1)
    x = rng.standard_normal((2, 5, 8))
    out, cache = m(x, cache=KVCache(), kv_lengths=[2, 5])
    np.testing.assert_allclose(out[0, :2], m(x[0, :2]), **TOL64)
    np.testing.assert_allclose(out[1], m(x[1]), **TOL64)
    assert cache.lengths.tolist() == [2, 5]


def test_rope_layer_decode_equals_prefill(rng):
    m = MultiHeadAttention(24, 6, n_kv_heads=3, rope=True, rope_base=500.0, dtype=np.float64, seed=2)
    x = rng.standard_normal((9, 24))
    full = m(x, causal=True)
    cache = KVCache()
    rows = [m(x[t:t + 1], cache=cache)[0] for t in range(9)]
    np.testing.assert_allclose(np.concatenate(rows), full, **TOL64)
    # Rotary positions change the result (relative to the same layer without rope).
    m.rope = False
    assert not np.allclose(m(x, causal=True), full)


# --------------------------------------------------------------------------- KVCache itself

def test_kvcache_append_grow_views_and_reset(rng):
    cache = KVCache(capacity=3)
    assert len(cache) == 0 and cache.k is None and cache.capacity == 0
    k = rng.standard_normal((2, 4, 5))              # (Hkv, L, d), unbatched
    v = rng.standard_normal((2, 4, 7))
    before = cache.append(k, v)
    assert before.tolist() == 0 and cache.capacity == 4 and len(cache) == 4
    cache.append(k[:, :3], v[:, :3])
    assert cache.capacity == 8 and len(cache) == 7
    np.testing.assert_array_equal(cache.k, np.concatenate([k, k[:, :3]], axis=1))
    np.testing.assert_array_equal(cache.v[:, 4:], v[:, :3])
    assert cache.k.base is not None                 # a view of the storage
    with pytest.raises(ValueError):
        cache.lengths[...] = 0                      # read-only
    assert "lengths=7" in repr(cache)
    cache.reset()
    assert len(cache) == 0 and cache.capacity == 0


@pytest.mark.parametrize("dtype", [np.float16, np.float32, "q8_0"])
def test_kvcache_storage_starts_on_a_cache_line(rng, dtype):
    # NumPy starts a large array 16 bytes into a 64-byte line; the cache's storage, first
    # allocated, grown and unpickled, starts on one (rows of 128 float16 values then
    # span four lines, not five).
    cache = KVCache(capacity=1000, dtype=dtype)
    k = rng.standard_normal((2, 8, 5, 128)).astype(np.float32)
    cache.append(k, k)
    grown = KVCache(capacity=1, dtype=dtype)
    grown.append(k, k)
    grown.append(k, k)
    for c in (cache, grown, pickle.loads(pickle.dumps(grown))):
        for a in (c._k, c._v, c._k_scale, c._v_scale):
            assert a is None or a.ctypes.data % 64 == 0
    np.testing.assert_array_equal(grown.keys_values()[0][..., :5, :],
                                  cache.keys_values()[0])


def test_kvcache_ragged_append(rng):
    cache = KVCache()
    k = rng.standard_normal((3, 1, 4, 2))
    cache.append(k, k, lengths=[4, 1, 0])
    cache.append(k[:, :, :1] + 10, k[:, :, :1] + 10)
    assert cache.lengths.tolist() == [5, 2, 1]
    np.testing.assert_array_equal(cache.k[0, :, 4], k[0, :, 0] + 10)
    np.testing.assert_array_equal(cache.k[1, :, :2], np.stack([k[1, :, 0], k[1, :, 0] + 10], 1))
    np.testing.assert_array_equal(cache.k[2, :, 0], k[2, :, 0] + 10)


@pytest.mark.parametrize("k_shape, v_shape, kwargs, exc, word", [
    ((4, 5), (4, 5), {}, ValueError, "k"),
    ((2, 4, 5), (2, 3, 5), {}, ValueError, "v"),
    ((2, 4, 5), (2, 4, 5), dict(lengths=[1, 2]), ValueError, "lengths"),
    ((2, 4, 5), (2, 4, 5), dict(lengths=5), ValueError, "lengths"),
    ((2, 4, 5), (2, 4, 5), dict(lengths=1.5), TypeError, "lengths"),
])
def test_kvcache_bad_arguments(k_shape, v_shape, kwargs, exc, word):
    with pytest.raises(exc, match=word):
        KVCache().append(np.ones(k_shape), np.ones(v_shape), **kwargs)


def test_kvcache_shape_mismatch_after_first_append():
    cache = KVCache()
    cache.append(np.ones((2, 4, 5)), np.ones((2, 4, 5)))
    with pytest.raises(ValueError, match="cache"):
        cache.append(np.ones((3, 1, 5)), np.ones((3, 1, 5)))
    with pytest.raises(ValueError, match="capacity"):
        KVCache(capacity=0)
    with pytest.raises(ValueError, match="growth"):
        KVCache(growth=1.0)


# --------------------------------------------------------------------------- torch interop

def torch_mha(torch, E, H, bias, seed=0):
    torch.manual_seed(seed)
    mod = torch.nn.MultiheadAttention(E, H, bias=bias, batch_first=True).double()
    if bias:   # torch starts biases at 0; make them matter
        with torch.no_grad():
            mod.in_proj_bias.normal_()
            mod.out_proj.bias.normal_()
    return mod.eval()


@pytest.mark.parametrize("bias", [True, False])
def test_matches_torch_multihead_attention(rng, bias):
    torch = pytest.importorskip("torch")
    E, H, L = 16, 4, 7
    mod = torch_mha(torch, E, H, bias)
    x = rng.standard_normal((3, L, E))
    xt = torch.from_numpy(x)
    causal_mask = torch.triu(torch.ones(L, L, dtype=torch.bool), 1)   # torch: True = hidden
    lengths = np.array([7, 4, 1])
    padding = torch.from_numpy(np.arange(L)[None, :] >= lengths[:, None])
    with torch.no_grad():
        y_plain = mod(xt, xt, xt, need_weights=False)[0].numpy()
        y_causal = mod(xt, xt, xt, attn_mask=causal_mask, need_weights=False)[0].numpy()
        y_pad = mod(xt, xt, xt, key_padding_mask=padding, need_weights=False)[0].numpy()

    # Tensors straight from state_dict() (converted without importing torch) ...
    m = MultiHeadAttention.from_torch_state_dict(mod.state_dict(), n_heads=H)
    assert m.w_q.dtype == np.float64 and (m.b_q is not None) == bias
    np.testing.assert_allclose(m(x), y_plain, **TOL64)
    np.testing.assert_allclose(m(x, causal=True), y_causal, **TOL64)
    np.testing.assert_allclose(m(x, kv_lengths=lengths), y_pad, **TOL64)
    # ... and plain NumPy arrays under a prefix, cast to float32.
    sd = {"attn." + k: t.numpy() for k, t in mod.state_dict().items()}
    m32 = MultiHeadAttention.from_torch_state_dict(sd, H, prefix="attn.", dtype=np.float32)
    assert m32.w_o.dtype == np.float32
    np.testing.assert_allclose(m32(x.astype(np.float32)), y_plain, rtol=1e-4, atol=1e-5)


def test_torch_default_layout_and_decode(rng):
    torch = pytest.importorskip("torch")
    mod = torch_mha(torch, 12, 3, True, seed=1)
    mod.batch_first = False                                  # (L, N, E), torch's default
    x = rng.standard_normal((6, 2, 12))
    with torch.no_grad():
        ref = mod(*(torch.from_numpy(x),) * 3, is_causal=True,
                  attn_mask=torch.triu(torch.ones(6, 6, dtype=torch.bool), 1),
                  need_weights=False)[0].numpy()
    m = MultiHeadAttention.from_torch_state_dict(mod.state_dict(), 3)
    xb = x.swapaxes(0, 1)                                    # to (N, L, E)
    cache = KVCache()
    rows = np.concatenate([m(xb[:, t:t + 1], cache=cache)[0] for t in range(6)], axis=1)
    np.testing.assert_allclose(rows.swapaxes(0, 1), ref, **TOL64)


def test_from_torch_state_dict_errors(rng):
    E = 4
    good = {"in_proj_weight": rng.standard_normal((3 * E, E)),
            "out_proj.weight": rng.standard_normal((E, E))}
    m = MultiHeadAttention.from_torch_state_dict(good, 2)
    np.testing.assert_array_equal(m.w_k, good["in_proj_weight"][E:2 * E].T.astype(np.float64))
    with pytest.raises(ValueError, match="out_proj.weight"):
        MultiHeadAttention.from_torch_state_dict({"in_proj_weight": good["in_proj_weight"]}, 2)
    with pytest.raises(ValueError, match="in_proj_weight"):
        MultiHeadAttention.from_torch_state_dict({**good, "in_proj_weight": np.ones((5, 4))}, 2)
    with pytest.raises(ValueError, match="add_bias_kv"):
        MultiHeadAttention.from_torch_state_dict({**good, "bias_k": np.ones((1, 1, E))}, 2)
    separate = {"q_proj_weight": np.ones((E, E)), "k_proj_weight": np.ones((E, 3)),
                "v_proj_weight": np.ones((E, 3)), "out_proj.weight": np.ones((E, E))}
    with pytest.raises(ValueError, match="kdim"):
        MultiHeadAttention.from_torch_state_dict(separate, 2)
    with pytest.raises(ValueError, match="n_heads"):
        MultiHeadAttention.from_torch_state_dict(good, 3)


def test_mha_integer_weights_float_bias_and_float16(rng):
    m = MultiHeadAttention(4, 2, bias=True, dtype=np.float64)
    m.w_q = np.eye(4, dtype=int)                    # user-assigned integer weights
    m.b_q = np.full(4, 0.5)
    x = rng.integers(-2, 3, (3, 4))
    np.testing.assert_allclose(m(x), mha_oracle(m, x), **TOL64)
    h = MultiHeadAttention(8, 2, dtype=np.float16, seed=0)
    x16 = rng.standard_normal((5, 8)).astype(np.float16)
    out = h(x16, causal=True)
    assert out.dtype == np.float16
    np.testing.assert_allclose(out, mha_oracle(h, x16.astype(np.float64), causal=True),
                               rtol=2e-2, atol=2e-3)


# --------------------------------------------------------------------------- variants in the layer

@pytest.mark.parametrize("kw", [dict(window=(5, 0)), dict(softcap=3.0), dict(sinks=True),
                                dict(window=(3, 0), softcap=2.0, sinks=True)],
                         ids=["window", "softcap", "sinks", "all"])
def test_mha_variants_match_reference_and_cache_decode(kw):
    mha = fastattn.MultiHeadAttention(32, 4, n_kv_heads=2, seed=3, rope=True, **kw)
    if mha.sinks is not None:
        mha.sinks = np.random.default_rng(4).standard_normal(4).astype(np.float32)
    x = np.random.default_rng(5).standard_normal((2, 13, 32)).astype(np.float32)
    y = mha(x, causal=True)
    # The layer's math written out: projections, rope, reference attention, output.
    W = mha._weights()
    q, k, v = mha._qkv(x, W)
    o = fastattn.reference.attention(q, k, v, causal=True, window=mha.window,
                                     softcap=mha.softcap, sinks=mha.sinks)
    np.testing.assert_allclose(y, mha._out(o, W), rtol=1e-5, atol=1e-5)
    # Token by token through the cache: the same rows.
    cache = fastattn.KVCache()
    rows = [mha(x[:, t:t + 1], cache=cache)[0] for t in range(13)]
    np.testing.assert_allclose(np.concatenate(rows, axis=1), y, rtol=1e-5, atol=1e-6)


def test_mha_sinks_are_assignable_weights():
    mha = fastattn.MultiHeadAttention(16, 2, sinks=True, seed=0)
    mha.sinks = np.zeros(3)
    with pytest.raises(ValueError, match="sinks has shape"):
        mha(np.zeros((4, 16), np.float32))


def test_mha_explicit_positions_for_left_padding():
    # A left-padded row with positions shifted by its padding gives the unpadded result.
    mha = fastattn.MultiHeadAttention(16, 2, seed=1, rope=True)
    x = np.random.default_rng(2).standard_normal((6, 16)).astype(np.float32)
    pad = np.concatenate([np.zeros((2, 16), np.float32), x])         # 2 padding rows first
    mask = np.ones((8, 8), bool)
    mask[:, :2] = False
    mask[:2, 0] = True                                              # padding rows see something
    y = mha(pad, causal=True, mask=mask, positions=np.arange(8) - 2)
    np.testing.assert_allclose(y[2:], mha(x, causal=True), rtol=1e-5, atol=1e-6)
    with pytest.raises(TypeError, match="positions"):
        mha(x, positions=np.zeros(6))


def test_from_torch_state_dict_gqa():
    rng = np.random.default_rng(0)
    E, H, Hkv = 16, 4, 2
    sd = {"q_proj_weight": rng.standard_normal((E, E)), "k_proj_weight": rng.standard_normal((8, E)),
          "v_proj_weight": rng.standard_normal((8, E)), "out_proj.weight": rng.standard_normal((E, E)),
          "in_proj_bias": rng.standard_normal(E + 16), "out_proj.bias": rng.standard_normal(E)}
    mha = fastattn.MultiHeadAttention.from_torch_state_dict(sd, H, n_kv_heads=Hkv)
    assert mha.w_k.shape == (E, 8) and mha.n_kv_heads == Hkv
    x = rng.standard_normal((5, E))
    q = (x @ sd["q_proj_weight"].T + sd["in_proj_bias"][:E]).reshape(5, H, 4).transpose(1, 0, 2)
    k = (x @ sd["k_proj_weight"].T + sd["in_proj_bias"][E:E + 8]).reshape(5, Hkv, 4).transpose(1, 0, 2)
    v = (x @ sd["v_proj_weight"].T + sd["in_proj_bias"][E + 8:]).reshape(5, Hkv, 4).transpose(1, 0, 2)
    o = fastattn.reference.attention(q, k, v).transpose(1, 0, 2).reshape(5, E)
    np.testing.assert_allclose(mha(x), o @ sd["out_proj.weight"].T + sd["out_proj.bias"],
                               rtol=1e-10, atol=1e-10)
    with pytest.raises(ValueError, match="n_kv_heads"):
        fastattn.MultiHeadAttention.from_torch_state_dict(sd, H)


# --------------------------------------------------------------------------- pickling
# A model is scattered to dask workers by pickling it: layers and caches must arrive with
# their weights, contents, dtype and positions, and compute the same bits there.

def _pickled(obj, protocol):
    if protocol == "out-of-band":        # pickle 5 with the arrays outside the stream (dask)
        buffers = []
        data = pickle.dumps(obj, protocol=5, buffer_callback=buffers.append)
        return pickle.loads(data, buffers=buffers)
    return pickle.loads(pickle.dumps(obj, protocol=protocol))


def _full_layer(seed=5, **kwargs):
    m = MultiHeadAttention(24, 6, n_kv_heads=2, bias=True, rope=True, window=(5, 0),
                           softcap=20.0, sinks=True, seed=seed, **kwargs)
    rng = np.random.default_rng(seed)
    for name in ("b_q", "b_k", "b_v", "b_o", "sinks"):
        setattr(m, name, rng.standard_normal(getattr(m, name).shape).astype(m.dtype))
    return m


PROTOCOLS = [2, pickle.HIGHEST_PROTOCOL, "out-of-band"]


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_mha_pickles_with_its_weights(rng, protocol):
    m = _full_layer(kv_dtype=np.float16)
    back = _pickled(m, protocol)
    assert type(back) is MultiHeadAttention and repr(back) == repr(m)
    for name, value in vars(m).items():
        got = getattr(back, name)
        if isinstance(value, np.ndarray):
            assert got.dtype == value.dtype and got.tobytes() == value.tobytes(), name
        else:
            assert got == value, name
    x = rng.standard_normal((2, 9, 24)).astype(np.float32)
    assert back(x, causal=True).tobytes() == m(x, causal=True).tobytes()


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_kvcache_pickles_with_contents_and_positions(rng, protocol):
    # Mid-decode, with sequences of different lengths: the restored cache holds the same
    # keys, values, lengths, dtype and capacity, and decoding on from it gives the same bits.
    m = _full_layer()
    x = rng.standard_normal((2, 8, 24)).astype(np.float32)
    cache = KVCache(capacity=6, growth=1.5, dtype=np.float16)
    m(x[:, :5], cache=cache, causal=True, kv_lengths=[3, 5])
    m(x[:, 5:6], cache=cache)
    back = _pickled(cache, protocol)
    assert type(back) is KVCache and repr(back) == repr(cache)
    assert back.dtype == np.float16 and back.capacity == cache.capacity == 6
    assert back.lengths.tolist() == [4, 6] and back.batch_shape == (2,)
    for got, want in zip(back.keys_values(), cache.keys_values()):   # stale rows included
        assert got.dtype == want.dtype and got.tobytes() == want.tobytes()
    for t in range(6, 8):                           # the second step grows both caches
        want = m(x[:, t:t + 1], cache=cache)[0]
        got = m(x[:, t:t + 1], cache=back)[0]
        assert got.tobytes() == want.tobytes()
    assert back.capacity == cache.capacity == 9
    for b, n in enumerate(cache.lengths.tolist()):  # rows beyond a sequence's length are stale
        assert back.k[b, :, :n].tobytes() == cache.k[b, :, :n].tobytes()
        assert back.v[b, :, :n].tobytes() == cache.v[b, :, :n].tobytes()


def test_kvcache_pickle_holds_only_the_rows_in_use(rng):
    cache = KVCache(capacity=4096)
    cache.append(rng.standard_normal((2, 3, 64)), rng.standard_normal((2, 3, 64)))
    data = pickle.dumps(cache)
    assert len(data) < 2 * 3 * 64 * 8 * 2 + 2000      # the 3 rows, not 4096 of them
    assert pickle.loads(data).capacity == 4096


def test_empty_kvcache_pickles_its_settings():
    cache = KVCache(capacity=7, growth=3.0, dtype=np.float16)
    back = pickle.loads(pickle.dumps(cache))
    assert repr(back) == repr(cache) == "KVCache(empty, capacity=7, dtype=float16)"
    back.append(np.ones((1, 8, 2)), np.ones((1, 8, 2)))
    assert back.capacity == 8 and back.dtype == np.float16
    back.append(np.ones((1, 1, 2)), np.ones((1, 1, 2)))
    assert back.capacity == 24                      # growth 3.0 survived


def test_bfloat16_layer_and_cache_pickle(rng):
    ml_dtypes = pytest.importorskip("ml_dtypes")
    bf16 = np.dtype(ml_dtypes.bfloat16)
    m = _full_layer(kv_dtype="bfloat16")
    x = rng.standard_normal((1, 4, 24)).astype(np.float32)
    cache = KVCache()
    m(x[:, :3], cache=cache, causal=True)
    m2, cache2 = pickle.loads(pickle.dumps((m, cache)))
    assert m2.kv_dtype == bf16 and cache2.dtype == bf16
    assert cache2.k.tobytes() == cache.k.tobytes()
    assert m2(x[:, 3:], cache=cache2)[0].tobytes() == m(x[:, 3:], cache=cache)[0].tobytes()


def test_layer_and_cache_through_dask_serialization(rng):
    protocol = pytest.importorskip("distributed.protocol")
    m = _full_layer()
    x = rng.standard_normal((1, 4, 24)).astype(np.float32)
    cache = KVCache()
    m(x[:, :3], cache=cache, causal=True)
    m2 = protocol.deserialize(*protocol.serialize(m))
    cache2 = protocol.deserialize(*protocol.serialize(cache))
    assert m2(x[:, 3:], cache=cache2)[0].tobytes() == m(x[:, 3:], cache=cache)[0].tobytes()


# --------------------------------------------------------------------------- KVCache accessors

def test_kvcache_keys_values_views(rng):
    cache = KVCache(capacity=8)
    assert cache.keys_values() == (None, None)
    k, v = rng.standard_normal((2, 3, 4)), rng.standard_normal((2, 3, 5))
    cache.append(k, v)
    keys, values = cache.keys_values()
    np.testing.assert_array_equal(keys, k)
    np.testing.assert_array_equal(values, v)
    assert np.shares_memory(keys, cache.k) and np.shares_memory(values, cache.v)
    assert cache.keys_values(8)[0].shape == (2, 8, 4)       # up to the capacity
    assert cache.keys_values(0)[1].shape == (2, 0, 5)
    with pytest.raises(ValueError, match="length"):
        cache.keys_values(9)
    with pytest.raises(TypeError, match="length"):
        cache.keys_values(2.0)


@pytest.mark.parametrize("lengths", [np.array([True, False]), [0.0, 1.0]])
def test_kvcache_lengths_follow_the_kv_lengths_rule(lengths):
    # Lengths are integers, as for fastattn.attention's kv_lengths (bool is refused there).
    with pytest.raises(TypeError, match="lengths"):
        KVCache().append(np.ones((2, 1, 3, 4)), np.ones((2, 1, 3, 4)), lengths=lengths)
    with pytest.raises(TypeError, match="kv_lengths"):
        fastattn.attention(np.ones((2, 1, 3, 4)), np.ones((2, 1, 3, 4)), np.ones((2, 1, 3, 4)),
                           kv_lengths=lengths)
