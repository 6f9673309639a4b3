"""float16 and bfloat16 storage: q, k, v read in place, computed in float32.

The kernel widens 16-bit values exactly (every float16 and bfloat16 value is a float32), so
its result on 16-bit inputs must equal, bit for bit, its result on the same values cast to
float32 -- the strongest check there is that the in-place reads address and widen every
element right, on every tile path (decode rows, GQA groups, prefill tiles, edge blocks).
A 16-bit result is that float32 result rounded once.  Accuracy against the float64
reference, the error that rounding K/V to 16 bits adds (a bound derived below), the
"no float32 copy" promise, caches and bad input are checked too.  bfloat16 tests need
ml_dtypes and skip without it; one test checks fastattn without ml_dtypes at all.
"""
import math
import tracemalloc

import numpy as np
import pytest

import fastattn
from fastattn import reference as ref

from conftest import HALVES, assert_close, make_qkv, qkv_shapes, run_python, tolerance

try:
    import ml_dtypes
    BF16 = np.dtype(ml_dtypes.bfloat16)
except ImportError:  # bfloat16 cases skip
    ml_dtypes = None
    BF16 = None

needs_bf16 = pytest.mark.skipif(ml_dtypes is None, reason="bfloat16 needs ml_dtypes")
F16 = np.dtype(np.float16)
F32 = np.dtype(np.float32)


def _f32(*arrays):
    return tuple(a.astype(np.float32) for a in arrays)


# Shapes for every tile path: single decode rows (1 query head per kv head), GQA groups of
# 2, 3 (a 4-row pass that stores 3), 4, 7 and 8 rows (two 4-row passes sharing one
# transpose of the keys), prefill tiles with and without causal masking, head dims that
# leave leftovers in the decode transposes (D % 4, D % 8, and D % 16 == 8 in the 16-bit
# transpose) or span two score chunks (D > 64), value widths with a tail strip, and more
# than 1024 keys (merged key chunks).
SHAPES = [
    # batch, Hq, Hkv, Lq, Lk, D, Dv, causal
    ((2,), 4, 4, 1, 300, 64, 64, False),
    ((1,), 8, 2, 1, 2100, 128, 128, False),
    ((1,), 3, 1, 1, 150, 64, 64, False),
    ((1,), 16, 2, 1, 300, 64, 64, False),
    ((1,), 14, 2, 1, 100, 128, 128, False),
    ((2,), 8, 2, 3, 500, 72, 40, True),
    ((1,), 16, 2, 1, 200, 33, 20, False),
    ((1,), 6, 3, 1, 77, 130, 8, False),
    ((2,), 4, 2, 200, 333, 40, 40, True),
    ((1,), 2, 2, 97, 1100, 16, 24, False),
    ((1,), 4, 2, 1, 300, 72, 72, False),
    ((2,), 3, 3, 1, 100, 40, 40, False),
    ((1,), 8, 2, 1, 96, 24, 24, False),
]


@pytest.mark.parametrize("kvdt", HALVES)
@pytest.mark.parametrize("qkind", ["float32", "same"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s[1:7])))
def test_equals_float32_on_the_same_values(rng, kvdt, qkind, shape):
    batch, Hq, Hkv, Lq, Lk, D, Dv, causal = shape
    qdt = F32 if qkind == "float32" else kvdt
    q, k, v = make_qkv(rng, *qkv_shapes(batch, Hq, Hkv, Lq, Lk, D, Dv), qdt, kvdt)
    out, lse = fastattn.attention(q, k, v, causal=causal, return_lse=True)
    # All-bfloat16 calls multiply in bfloat16 where the kernel has those products, as
    # float32 calls do under the opt-in (elsewhere both stay float32).
    products = "bfloat16" if qdt == kvdt and qdt != np.float16 else "float32"
    with fastattn.float32_precision(products):
        want, want_lse = fastattn.attention(*_f32(q, k, v), causal=causal, return_lse=True)
    # float16/bfloat16 out only when all three share the dtype, rounded once
    assert out.dtype == (kvdt if qdt == kvdt else F32)
    assert out.tobytes() == want.astype(out.dtype).tobytes()
    assert lse.dtype == F32 and lse.tobytes() == want_lse.tobytes()


@pytest.mark.parametrize("kvdt", HALVES)
def test_variants_and_masks_on_16_bit_kv(rng, kvdt):
    # The same identity through the masked, windowed, ragged and variant paths, and the
    # Python front end (the lean path takes only the plain calls).
    q, k, v = make_qkv(rng, *qkv_shapes((3,), 4, 2, 40, 150, 32, 24), F32, kvdt)
    keep = rng.random((4, 40, 150)) < 0.8
    cases = [
        dict(mask=keep),
        dict(mask=np.where(keep, 0.0, -np.inf).astype(np.float32)),
        dict(causal=True, window=(30, 2)),
        dict(kv_lengths=np.array([150, 70, 0]), causal=True),
        dict(softcap=5.0, alibi_slopes=np.array([0.5, 0.25, 0.125, 0.0625]),
             sinks=np.array([0.0, 1.0, -np.inf, 2.0])),
        dict(q_lengths=np.array([40, 13, 1]), causal=True),
    ]
    for kw in cases:
        got = fastattn.attention(q, k, v, **kw)
        want = fastattn.attention(*_f32(q, k, v), **kw)
        assert got.tobytes() == want.tobytes(), kw


@pytest.mark.parametrize("kvdt", HALVES)
def test_strided_and_broadcast_kv_read_in_place(rng, kvdt):
    # A cache view (capacity > length: rows strided), heads-second layouts and a K/V
    # broadcast over the batch are read in place too.
    cap = rng.standard_normal((2, 4, 300, 64)).astype(kvdt)
    k, v = cap[:, :, :180], cap[:, :, 100:280]
    q = rng.standard_normal((2, 8, 1, 64)).astype(np.float32)
    assert fastattn.attention(q, k, v).tobytes() == fastattn.attention(*_f32(q, k, v)).tobytes()
    kt = np.ascontiguousarray(rng.standard_normal((120, 4, 64)).astype(kvdt)).transpose(1, 0, 2)
    q1 = rng.standard_normal((5, 8, 3, 64)).astype(np.float32)
    got = fastattn.attention(q1, kt[None], kt[None], causal=True)
    want = fastattn.attention(q1, *_f32(kt[None], kt[None]), causal=True)
    assert got.tobytes() == want.tobytes()


@pytest.mark.parametrize("kvdt", HALVES)
def test_varlen_and_attention_weights(rng, kvdt):
    q, k, v = make_qkv(rng, *qkv_shapes((), 4, 2, 30, 30, 16, 16), kvdt, kvdt)
    cu = np.array([0, 11, 11, 30])
    got = fastattn.attention_varlen(q, k, v, cu, cu, causal=True)
    assert got.dtype == kvdt
    want = fastattn.attention_varlen(*_f32(q, k, v), cu, cu, causal=True)
    assert got.tobytes() == want.astype(kvdt).tobytes()
    w = fastattn.attention_weights(q, k, causal=True)
    assert w.dtype == kvdt
    assert_close(w, ref.attention_weights(q, k, causal=True))


@pytest.mark.parametrize("kvdt", HALVES)
def test_out_argument(rng, kvdt):
    q, k, v = make_qkv(rng, *qkv_shapes((1,), 2, 2, 5, 50, 16, 16), kvdt, kvdt)
    out = np.full((1, 2, 5, 16), 7, dtype=kvdt)
    res = fastattn.attention(q, k, v, out=out)
    assert res is out
    assert out.tobytes() == fastattn.attention(*_f32(q, k, v)).astype(kvdt).tobytes()
    with pytest.raises(TypeError, match="out must have dtype"):
        fastattn.attention(q, k, v, out=np.empty((1, 2, 5, 16), np.float32))
    # overlapping an input: computed aside, then copied
    buf = np.concatenate([q, np.zeros((1, 2, 5, 0), kvdt)], axis=-1)
    assert fastattn.attention(buf, k, v, out=buf).tobytes() == res.tobytes()


# --------------------------------------------------------------------------- accuracy

@pytest.mark.parametrize("kvdt", HALVES)
def test_matches_reference_on_rounded_inputs(rng, kvdt):
    # Against the float64 reference on the same (rounded) values: the float32 tolerance.
    for qdt in (F32, kvdt):
        q, k, v = make_qkv(rng, *qkv_shapes((2,), 8, 2, 1, 1500, 64, 64), qdt, kvdt)
        got = fastattn.attention(q, k, v)
        want = ref.attention(q, k, v)
        if got.dtype == F32:
            assert_close(got, want)
        else:
            assert_close(got, want, kvdt)   # both sides round once to the 16-bit result


def _rounding_bound(q, k, v, scale, u):
    """Largest error that rounding k and v to a format of unit roundoff u can add.

    With k~ = k (1 + d), |d| <= u elementwise (normal numbers), the score of key j moves
    by at most e_j = u * scale * sum_d |q_d k_jd| <= u A_i, A_i the largest such sum over
    the row's keys.  Softmax weights then change by a factor within exp(+-2 u A_i), so
    sum_j |p~_j - p_j| <= exp(2 u A_i) - 1; rounding v adds at most u |v_jc| per term.  So
    |out~_ic - out_ic| <= (exp(2 u A_i) - 1 + u) * max_j |v_jc|.
    """
    A = scale * np.einsum("...id,...jd->...ij", np.abs(q), np.abs(k)).max(axis=-1)
    vmax = np.abs(v).max(axis=-2)[..., None, :]
    return (np.expm1(2 * u * A)[..., None] + u) * vmax


@pytest.mark.parametrize("kvdt,u", [pytest.param(F16, 2.0**-11, id="float16"),
                                     pytest.param(BF16, 2.0**-8, id="bfloat16",
                                                  marks=needs_bf16)])
def test_error_added_by_rounding_kv_is_bounded(rng, kvdt, u):
    # Unrounded float64 K/V against K/V rounded to 16 bits: the measured error stays within
    # the bound above plus the float32 tolerance.  On random data it is far below the
    # bound (the roundings cancel); values that all round the same way nearly reach it,
    # so the bound is tight, not vacuous.
    q = rng.standard_normal((4, 1, 64))
    k = rng.standard_normal((4, 800, 64))
    v = rng.standard_normal((4, 800, 64))
    scale = 1 / 8
    rtol, atol = tolerance(np.float32)

    def check(q, k, v):
        exact = ref.attention(q, k, v, scale=scale)
        got = fastattn.attention(q.astype(np.float32), k.astype(kvdt), v.astype(kvdt),
                                 scale=scale)
        err = np.abs(got - exact)
        bound = _rounding_bound(q, k, v, scale, u) + atol + rtol * np.abs(exact)
        assert (err <= bound).all(), float((err / bound).max())
        return float((err / bound).max())

    check(q, k, v)
    # every value of v just below 1 + u (half an ulp of 1): all round down, by 0.99 u
    v_adv = np.full_like(v, 1 + 0.99 * u)
    assert check(q * 1e-6, k, v_adv) > 0.9


# --------------------------------------------------------------------------- reproducibility


# --------------------------------------------------------------------------- memory

@pytest.mark.parametrize("kvdt", HALVES)
def test_no_float32_copy_of_kv(rng, kvdt):
    # 16 MB of 16-bit K/V: the call allocates the output and per-thread workspaces only
    # (a float32 copy would be 32 MB).  Two threads, so that the workspaces' share of the
    # bound does not grow with the machine's cores.
    k = rng.standard_normal((8, 8192, 64), dtype=np.float32).astype(kvdt)
    v = k[:, ::-1]
    q = rng.standard_normal((32, 1, 64), dtype=np.float32)
    for call in (lambda: fastattn.attention(q, k, v),
                 lambda: fastattn.attention(q, k, v, window=(4000, 0), causal=True)):
        with fastattn.num_threads(2):
            call()
            tracemalloc.start()
            try:
                call()
                peak = tracemalloc.get_traced_memory()[1]
            finally:
                tracemalloc.stop()
        assert peak < (k.nbytes + v.nbytes) / 8, peak


# --------------------------------------------------------------------------- caches

@pytest.mark.parametrize("kvdt", HALVES)
def test_kv_cache_stores_16_bit(rng, kvdt):
    cache = fastattn.KVCache(capacity=2, dtype=kvdt)
    k = rng.standard_normal((2, 5, 8))
    cache.append(k, 2 * k)
    cache.append(k[:, :1], k[:, :1])
    assert cache.k.dtype == kvdt and cache.dtype == kvdt
    assert cache.k.tobytes() == np.concatenate([k, k[:, :1]], axis=1).astype(np.float32).astype(
        kvdt).tobytes()
    with pytest.raises(ValueError, match="range"):
        cache.append(np.full((2, 1, 8), 1e39), k[:, :1])
    assert cache.lengths == 6    # nothing written by the failed append


def test_kv_cache_float16_range_raises_rather_than_inf():
    cache = fastattn.KVCache(dtype=np.float16)
    with pytest.raises(ValueError, match="float16's range"):
        cache.append(np.full((1, 1, 4), 70000.0), np.zeros((1, 1, 4)))
    assert cache.capacity == 0
    cache.append(np.array([[[np.inf, -np.inf, np.nan, 65504.0]]]), np.zeros((1, 1, 4)))
    assert np.isposinf(cache.k[0, 0, 0]) and np.isnan(cache.k[0, 0, 2])


@pytest.mark.parametrize("kvdt", HALVES)
def test_multi_head_attention_kv_dtype(rng, kvdt):
    mha = fastattn.MultiHeadAttention(64, 8, n_kv_heads=2, rope=True, kv_dtype=kvdt, seed=0)
    x = rng.standard_normal((2, 12, 64), dtype=np.float32)
    cache = fastattn.KVCache()
    y, _ = mha(x[:, :7], cache=cache, causal=True)
    assert cache.dtype == kvdt and y.dtype == np.float32
    steps = [mha(x[:, t:t + 1], cache=cache)[0] for t in range(7, 12)]
    full = mha(x, causal=True)
    np.testing.assert_allclose(np.concatenate([y] + steps, axis=1), full, rtol=1e-5, atol=1e-5)
    mha32 = fastattn.MultiHeadAttention(64, 8, n_kv_heads=2, rope=True, seed=0)
    assert np.abs(mha32(x, causal=True) - full).max() > 0     # the keys were rounded
    with pytest.raises(ValueError, match="kv_dtype"):
        mha(x, cache=fastattn.KVCache(dtype=np.float32))


# --------------------------------------------------------------------------- bad input

def test_unsupported_dtypes_name_the_argument(rng):
    q = rng.standard_normal((2, 4, 8)).astype(np.float32)
    with pytest.raises(TypeError, match="^v "):
        fastattn.attention(q, q, q.astype(np.complex64))
    with pytest.raises(TypeError, match="k has unsupported dtype"):
        fastattn.attention(q, q.astype(np.longdouble), q)
    if ml_dtypes is not None:
        with pytest.raises(TypeError, match="^k "):
            fastattn.attention(q, q.astype(ml_dtypes.float8_e4m3fn), q)
        with pytest.raises(TypeError, match="^q "):
            fastattn.attention_varlen(q.astype(ml_dtypes.int4), q, q, [0, 4], [0, 4])
    with pytest.raises(TypeError, match="dtype must be float16, bfloat16"):
        fastattn.KVCache(dtype=np.int8)
    with pytest.raises(TypeError, match="kv_dtype"):
        fastattn.MultiHeadAttention(16, 2, kv_dtype="float8")


def test_works_without_ml_dtypes():
    # ml_dtypes blocked: fastattn imports, float16 works, and asking for bfloat16 by name
    # says to install the package.
    code = """
import sys
sys.modules["ml_dtypes"] = None
import numpy as np, fastattn
q = np.ones((2, 3, 8), np.float16)
assert fastattn.attention(q, q, q).dtype == np.float16
fastattn.KVCache(dtype=np.float16)
try:
    fastattn.KVCache(dtype="bfloat16")
except TypeError as e:
    assert "pip install ml_dtypes" in str(e), e
else:
    raise AssertionError("no error")
try:
    fastattn.MultiHeadAttention(16, 2, kv_dtype="bfloat16")
except TypeError as e:
    assert "ml_dtypes" in str(e), e
else:
    raise AssertionError("no error")
print("ok")
"""
    res = run_python("-c", code)      # fails the test on a non-zero exit status
    assert res.stdout.strip() == "ok", res.stderr


@pytest.mark.parametrize("kvdt", HALVES)
def test_result_dtype_rule(kvdt):
    # float16/bfloat16 out only when q, k and v all have it; any mix computes in float32.
    x = np.ones((2, 3, 8), kvdt)
    x32 = x.astype(np.float32)
    assert fastattn.attention(x, x, x).dtype == kvdt
    for q, k, v in ((x32, x, x), (x, x32, x), (x, x, x32)):
        assert fastattn.attention(q, k, v).dtype == np.float32
    assert fastattn.attention(x, x, x.astype(np.float64)).dtype == np.float64
    other = F16 if kvdt != F16 else BF16
    if other is not None:
        assert fastattn.attention(x, x.astype(other), x).dtype == np.float32
    # float64 compute reads 16-bit K/V in place too (widened to float64)
    q64 = np.random.default_rng(0).standard_normal((2, 3, 8))
    got = fastattn.attention(q64, x, x)
    assert got.dtype == np.float64
    assert got.tobytes() == fastattn.attention(q64, x.astype(np.float64), x.astype(np.float64)).tobytes()
    assert math.isfinite(float(got.sum()))
