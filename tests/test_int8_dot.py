"""Int8 products over q8_0 and q4_0 caches (``set_int8_dot_products``): q quantised per
block of 32 dims as llama.cpp does, q.k taken in int8 with the CPU's VNNI dot products.

What holds: accuracy against the float64 attention over the dequantised cache, within
twice the error of a NumPy model of llama.cpp's own dot products (q8_0 q against q8_0 or
q4_0 K, ``ggml_vec_dot_q8_0_q8_0`` / ``ggml_vec_dot_q4_0_q8_0``); the reproducibility
rules (threads, batch, pages, a decode step against the prefill over the same cache); the
default (off: the exact products, bit for bit); and calls the setting does not cover.
The model's quantisation of q is checked against llama.cpp's through the gguf package.

Skipped, with the reason, where the CPU or build has no int8 dot products; there the
setting must change nothing and warn once.
"""
import importlib.util
import warnings

import numpy as np
import pytest

import fastattn
from fastattn._calls import precision as _precision

RUNS, WHY = _precision.int8_products()
needs_int8 = pytest.mark.skipif(not RUNS, reason=f"no int8 products here: {WHY}")


@pytest.fixture
def int8_on():
    old = fastattn.set_int8_dot_products(True)
    yield
    fastattn.set_int8_dot_products(old)


def int8(fn, *args, **kw):
    """fn(*args, **kw) with the int8 products on, the setting restored after."""
    old = fastattn.set_int8_dot_products(True)
    try:
        return fn(*args, **kw)
    finally:
        fastattn.set_int8_dot_products(old)


def cache(kind, B, Hkv, L, D, rng):
    """k, v (float32) and their cache of ``kind`` as attention_with_kvcache takes it."""
    k = rng.standard_normal((B, Hkv, L, D)).astype(np.float32)
    v = rng.standard_normal((B, Hkv, L, D)).astype(np.float32)
    quantize = getattr(fastattn, f"quantize_{kind}")
    (kq, ks), (vq, vs) = quantize(k), quantize(v)
    return dict(k_cache=kq, v_cache=vq, k_scale=ks, v_scale=vs)


def dequantised(kind, c):
    deq = getattr(fastattn, f"dequantize_{kind}")
    return (deq(c["k_cache"], c["k_scale"]).astype(np.float64),
            deq(c["v_cache"], c["v_scale"]).astype(np.float64))


# ----------------------------------------------------------------------------- the oracles

def llama_q8_0(x):
    """llama.cpp's q8_0 of rows x (quantize_row_q8_0_ref): per block of 32, d = max|x| /
    127 stored as float16, values round(x / d).  Returns (values int, d float64)."""
    xb = x.astype(np.float32).reshape(*x.shape[:-1], -1, 32)
    amax = np.abs(xb).max(-1, keepdims=True)
    d = amax / np.float32(127)
    with np.errstate(divide="ignore"):
        inv = np.where(d > 0, np.float32(1) / d, np.float32(0))
    vals = np.round(xb * inv)        # llama.cpp's roundf: only exact ties differ
    return vals.astype(np.int64), d[..., 0].astype(np.float16).astype(np.float64)


def blocks(a):
    return a.reshape(*a.shape[:-1], -1, 32)


def llama_scores(q, kind, c):
    """Scores (B, Hq, Lq, L) as llama.cpp's dot products take them: q as q8_0, each
    block's integer sum times both block scales, summed over blocks (float64)."""
    qv, qd = llama_q8_0(q)
    if kind == "q8_0":
        kv = blocks(c["k_cache"].astype(np.int64))
    else:   # value j of a block in the low nibble of byte j, value j + 16 in the high one
        packed = c["k_cache"].astype(np.int64).reshape(*c["k_cache"].shape[:-1], -1, 16)
        kv = np.concatenate([(packed & 15) - 8, (packed >> 4) - 8], axis=-1)
    kd = c["k_scale"].astype(np.float64)
    g = q.shape[1] // kv.shape[1]
    kv, kd = np.repeat(kv, g, axis=1), np.repeat(kd, g, axis=1)
    isum = np.einsum("bhinc,bhjnc->bhijn", qv, kv)
    return np.einsum("bhijn,bhin,bhjn->bhij", isum.astype(np.float64), qd, kd)


def attend(scores, v, scale, seqlens):
    """Softmax over each sequence's keys, then P V, in float64 (v: B, Hkv, L, Dv)."""
    B, Hq = scores.shape[:2]
    g = Hq // v.shape[1]
    out = np.empty(scores.shape[:3] + (v.shape[-1],))
    for b in range(B):
        s = scores[b, :, :, :seqlens[b]] * scale
        p = np.exp(s - s.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        out[b] = np.einsum("hij,hjd->hid", p, np.repeat(v[b, :, :seqlens[b]], g, axis=0))
    return out


# ----------------------------------------------------------------------------- accuracy

@needs_int8
@pytest.mark.parametrize("kind", ["q8_0", "q4_0"])
@pytest.mark.parametrize("B,Hq,Hkv,Lq,L,D", [(2, 8, 2, 1, 300, 128), (1, 4, 4, 1, 1000, 64),
                                             (2, 4, 1, 33, 200, 96), (1, 2, 2, 5, 77, 32)])
def test_error_within_twice_llama_cpp(kind, B, Hq, Hkv, Lq, L, D):
    rng = np.random.default_rng(B * 1000 + L + D)
    c = cache(kind, B, Hkv, L, D, rng)
    kd, vd = dequantised(kind, c)
    seqlens = np.array([L - 7 * b for b in range(B)])
    scale = D ** -0.5
    for trial in range(3):
        q = (rng.standard_normal((B, Hq, Lq, D)) * (1 + trial)).astype(np.float32)
        got = int8(fastattn.attention_with_kvcache, q, **c, cache_seqlens=seqlens)
        exact_scores = np.einsum("bhid,bhjd->bhij", q.astype(np.float64),
                                 np.repeat(kd, Hq // Hkv, axis=1))
        exact = attend(exact_scores, vd, scale, seqlens)
        model = attend(llama_scores(q, kind, c), vd, scale, seqlens)
        ours_err = np.abs(got - exact).max()
        model_err = np.abs(model - exact).max()
        assert model_err > 0
        assert ours_err <= 2 * model_err, (ours_err, model_err)
        # and the products ran: the default's error is float32 rounding only
        default = fastattn.attention_with_kvcache(q, **c, cache_seqlens=seqlens)
        assert np.abs(default - exact).max() < ours_err


@needs_int8
@pytest.mark.parametrize("kind", ["q8_0", "q4_0"])
def test_extreme_bytes_are_summed_exactly(kind):
    # Every byte a cache may hold, -128 included, against q rows of +-1 (quantised to
    # +-127 exactly), signed to match the keys' so that the block sums reach their
    # largest: a product pair summed in 16 bits without care saturates here.
    rng = np.random.default_rng(17)
    B, Hkv, L, D = 1, 2, 96, 64
    if kind == "q8_0":
        kc = rng.integers(-128, 128, (B, Hkv, L, D)).astype(np.int8)
        kc[0, 0, :8] = -128
        kc[0, 1, :8] = 127
    else:
        kc = rng.integers(0, 256, (B, Hkv, L, D // 2)).astype(np.uint8)
        kc[0, 0, :8] = 0x00
        kc[0, 1, :8] = 0xFF
    ks = np.full((B, Hkv, L, D // 32), 2e-3, np.float16)
    c = dict(k_cache=kc, v_cache=kc.copy(), k_scale=ks, v_scale=ks.copy())
    kd, vd = dequantised(kind, c)
    q = np.where(kd[:, :, :2] >= 0, 1.0, -1.0).astype(np.float32)   # rows like keys 0, 1
    got = int8(fastattn.attention_with_kvcache, q, **c, cache_seqlens=[L])
    exact = attend(np.einsum("bhid,bhjd->bhij", q.astype(np.float64), kd), vd, D ** -0.5, [L])
    np.testing.assert_allclose(got, exact, rtol=1e-4, atol=1e-5)


def test_model_quantises_q_as_llama_cpp():
    gguf = pytest.importorskip("gguf")
    from gguf import GGMLQuantizationType, quants
    x = np.random.default_rng(3).standard_normal((7, 128)).astype(np.float32)
    raw = quants.quantize(x, GGMLQuantizationType.Q8_0).reshape(7, 4, 34)
    d = raw[..., :2].copy().view(np.float16)[..., 0].astype(np.float64)
    vals = raw[..., 2:].copy().view(np.int8).astype(np.int64)
    ours_vals, ours_d = llama_q8_0(x)
    np.testing.assert_array_equal(ours_d, d)
    # ties (x / d exactly half-way) round away from zero in llama.cpp, to even here
    assert np.mean(ours_vals != vals) < 1e-3
    assert np.abs(ours_vals - vals).max() <= 1
    del gguf


# ----------------------------------------------------------------------------- reproducibility

def paged(c, B, Hkv, L, page, rng):
    """c's rows in a shuffled pool of pages, and its block table."""
    n = -(-L // page)
    order = rng.permutation(B * n)
    table = order.reshape(B, n).astype(np.int32)
    out = {}
    for name, a in c.items():
        pad = np.zeros(a.shape[:2] + (n * page,) + a.shape[3:], a.dtype)
        pad[:, :, :L] = a
        pool = np.zeros((B * n, Hkv, page) + a.shape[3:], a.dtype)
        for b in range(B):
            for i in range(n):
                pool[table[b, i]] = pad[b, :, i * page:(i + 1) * page]
        out[name] = pool
    return out, table


@needs_int8
@pytest.mark.parametrize("kind", ["q8_0", "q4_0"])
def test_threads_batch_and_pages_keep_the_bits(kind, int8_on):
    rng = np.random.default_rng(7)
    B, Hq, Hkv, L, D = 3, 8, 2, 400, 128
    c = cache(kind, B, Hkv, L, D, rng)
    q = rng.standard_normal((B, Hq, 1, D)).astype(np.float32)
    seqlens = np.array([400, 123, 258])
    with fastattn.num_threads(2):
        two = fastattn.attention_with_kvcache(q, **c, cache_seqlens=seqlens)
    with fastattn.num_threads(1):
        one = fastattn.attention_with_kvcache(q, **c, cache_seqlens=seqlens)
    np.testing.assert_array_equal(one, two)
    for b in range(B):
        alone = fastattn.attention_with_kvcache(
            q[b:b + 1], **{n: a[b:b + 1] for n, a in c.items()}, cache_seqlens=seqlens[b:b + 1])
        np.testing.assert_array_equal(alone[0], two[b])
    pool, table = paged(c, B, Hkv, L, 16, rng)
    with fastattn.num_threads(2):
        pg = fastattn.attention_with_kvcache(q, **pool, cache_seqlens=seqlens, block_table=table)
    np.testing.assert_array_equal(pg, two)


@needs_int8
@pytest.mark.parametrize("kind", ["q8_0", "q4_0"])
@pytest.mark.parametrize("Hq,Hkv", [(8, 2), (4, 4)])
def test_decode_steps_give_the_prefill_bits(kind, Hq, Hkv, int8_on):
    rng = np.random.default_rng(11)
    B, L, D, Lq = 2, 300, 64, 40
    c = cache(kind, B, Hkv, L, D, rng)
    q = rng.standard_normal((B, Hq, Lq, D)).astype(np.float32)
    seqlens = np.array([300, 171])
    prefill = fastattn.attention_with_kvcache(q, **c, cache_seqlens=seqlens, causal=True)
    for i in range(0, Lq, 7):
        step = fastattn.attention_with_kvcache(q[:, :, i:i + 1], **c, causal=True,
                                               cache_seqlens=seqlens - Lq + i + 1)
        np.testing.assert_array_equal(step[:, :, 0], prefill[:, :, i])


@needs_int8
def test_plan_run_follows_the_setting():
    rng = np.random.default_rng(5)
    c = cache("q8_0", 2, 2, 128, 64, rng)
    q = rng.standard_normal((2, 4, 1, 64)).astype(np.float32)
    plan = fastattn.plan_kvcache(cache_seqlens=[128, 100])
    off = plan.run(q, c["k_cache"], c["v_cache"], k_scale=c["k_scale"], v_scale=c["v_scale"])
    on = int8(plan.run, q, c["k_cache"], c["v_cache"], k_scale=c["k_scale"],
              v_scale=c["v_scale"])
    direct = int8(fastattn.attention_with_kvcache, q, **c, cache_seqlens=[128, 100])
    np.testing.assert_array_equal(on, direct)
    assert not np.array_equal(on, off)
    np.testing.assert_array_equal(
        off, plan.run(q, c["k_cache"], c["v_cache"], k_scale=c["k_scale"], v_scale=c["v_scale"]))


# ----------------------------------------------------------------------------- what it covers

@needs_int8
def test_other_caches_keep_the_exact_products():
    rng = np.random.default_rng(2)
    q = rng.standard_normal((1, 4, 1, 64)).astype(np.float32)
    k = rng.standard_normal((1, 2, 50, 64)).astype(np.float32)
    caches = [dict(k_cache=k.astype(np.float16), v_cache=k.astype(np.float16)),
              dict(k_cache=k, v_cache=k)]
    if importlib.util.find_spec("ml_dtypes") is not None:    # fp8's dtypes
        s = np.float32(np.abs(k).max() / 448)
        fp8 = fastattn.quantize_fp8(k, s, "float8_e4m3fn")
        caches.append(dict(k_cache=fp8, v_cache=fp8, k_scale=s, v_scale=s))
    for kw in caches:
        off = fastattn.attention_with_kvcache(q, **kw, cache_seqlens=[50])
        on = int8(fastattn.attention_with_kvcache, q, **kw, cache_seqlens=[50])
        np.testing.assert_array_equal(on, off)


def test_setting_is_off_by_default_and_checked():
    assert fastattn.get_int8_dot_products() is False
    # off, show_config says whether the products would run here, and how
    assert ("takes them in int8 here" in _precision.quantised_products()) == RUNS
    assert "int8 (" not in _precision.quantised_products()
    with pytest.raises(TypeError, match="enabled"):
        fastattn.set_int8_dot_products("yes")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert fastattn.set_int8_dot_products(True) is False
    try:
        assert fastattn.get_int8_dot_products() is True
        assert ("int8 (" in _precision.quantised_products()) == RUNS
    finally:
        assert fastattn.set_int8_dot_products(False) is True


@pytest.mark.skipif(RUNS, reason="this CPU has int8 products")
def test_without_vnni_the_setting_changes_nothing():
    rng = np.random.default_rng(1)
    c = cache("q8_0", 1, 2, 64, 64, rng)
    q = rng.standard_normal((1, 4, 1, 64)).astype(np.float32)
    off = fastattn.attention_with_kvcache(q, **c, cache_seqlens=[64])
    _precision._int8_warned = False
    with pytest.warns(RuntimeWarning, match="changes nothing"):
        old = fastattn.set_int8_dot_products(True)
    try:
        on = fastattn.attention_with_kvcache(q, **c, cache_seqlens=[64])
    finally:
        fastattn.set_int8_dot_products(old)
    np.testing.assert_array_equal(on, off)
