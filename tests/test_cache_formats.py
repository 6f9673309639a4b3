"""The q4_0 and fp8 cache formats: their bytes, their appends, and their refusals.

What the tests pin, each against an independent oracle:

- q4_0 is llama.cpp's format bit for bit: ``gguf``'s ``quants.quantize(x, Q4_0)`` (a NumPy
  port of ``quantize_row_q4_0_ref``) gives the same bytes -- ties, zero blocks, negative
  maxima, equal magnitudes of both signs, values at the edge of a finite float16 scale --
  and ``gguf``'s dequantisation the same float32 numbers;
- fp8 stores ``x / scale`` as ``ml_dtypes`` rounds it (to nearest even) after clipping to
  the largest finite value (which ``ml_dtypes`` does not do: vLLM's kernels saturate), for
  every fp8 value, every midpoint between two and their float32 neighbours;
- appending writes those bytes in place (the block scales beside them; fp8 scales are
  only read), in the plan's compiled run and in its checked path alike;
- every bad input is refused before anything is written;
- ``KVCache``, ``MultiHeadAttention`` and the torch call store and read the formats.

The bits of attention over these caches (paged = contiguous, batch and threads,
decode = prefill, FlashAttention's float32 rule) are tests/test_kvcache.py's, which run
every quantised format; tests/test_plan.py compares the compiled run with the checked path
and checks that a decode step's call never leaves the compiled run.
"""
import pickle

import numpy as np
import pytest

from conftest import import_optional
import test_kvcache as kvcache_tests
from test_kvcache import assert_same_bits, ml_fp8, ml_fp8_values, paged_from, snapshot

import fastattn

try:
    import ml_dtypes
except ImportError:
    ml_dtypes = None

needs_ml_dtypes = pytest.mark.skipif(ml_dtypes is None, reason="fp8 needs ml_dtypes")
FP8 = [pytest.param(n, marks=needs_ml_dtypes) for n in ("float8_e4m3fn", "float8_e5m2")]
FORMATS = ["q4_0"] + FP8


# --------------------------------------------------------------------------- oracles

def gguf_q4_0(x):
    """``(values, scales)`` of ``x`` quantised by gguf (skips without it)."""
    gguf = import_optional("gguf")
    raw = gguf.quants.quantize(np.asarray(x), gguf.GGMLQuantizationType.Q4_0)
    blocks = raw.reshape(x.shape[:-1] + (x.shape[-1] // 32, 18))
    scales = np.ascontiguousarray(blocks[..., :2]).view(np.float16)[..., 0]
    values = np.ascontiguousarray(blocks[..., 2:]).reshape(x.shape[:-1] + (x.shape[-1] // 2,))
    return values, scales


def make_cache(rng, fmt, B, Hkv, Lmax, D, Dv=None):
    """test_kvcache's cache of format ``fmt`` (fp8 scales per kv head)."""
    return kvcache_tests.make_cache(rng, B, Hkv, Lmax, D, Dv, dtype=fmt)


def _q4_0_values(values, scales):
    """q4_0 bytes read back by gguf (skips without it)."""
    gguf = import_optional("gguf")
    blocks = np.concatenate([np.ascontiguousarray(scales[..., None]).view(np.uint8),
                             values.reshape(values.shape[:-1] + (-1, 16))], axis=-1)
    out = gguf.quants.dequantize(blocks.reshape(-1, 18).reshape(-1),
                                 gguf.GGMLQuantizationType.Q4_0)
    return out.reshape(values.shape[:-1] + (2 * values.shape[-1],)).astype(np.float32)




# --------------------------------------------------------------------------- q4_0 bytes

def _awkward_q4_0_blocks(rng):
    """Rows of 64 whose blocks hit llama.cpp's corner cases."""
    x = rng.standard_normal((12, 64)).astype(np.float32)
    x[0, :32] = 0                                            # a zero block: d = 0
    x[1, :32] = np.linspace(-8, 7, 32).round()               # exact levels, d = 1
    x[2, 3], x[2, 9] = -5.0, 5.0                             # equal |x|: the first one's sign
    x[3, 3], x[3, 9] = 5.0, -5.0
    x[4] = np.abs(x[4]) + 0.5                                # positive maximum: d < 0
    x[5] = -np.abs(x[5]) - 0.5                               # negative maximum: d > 0
    x[6, :32] = (np.arange(32) - 16) / 2.0                   # x / d + 8.5 at halves
    x[6, 32:] = (np.arange(32) - 15.5) / 8.0
    x[7, :32] = 8 * 65504.0 * rng.uniform(-1, 1, 32)         # up to the largest finite d
    x[7, 0] = -8 * 65504.0
    x[8] *= 1e-6                                             # float16-subnormal scales
    x[9] *= 1e-9                                             # scales that round to 0
    x[10, :32] = 3.0                                         # a constant block
    x[11] = np.float32(1e-45) * rng.integers(-3, 4, 64)      # float32 subnormals
    return x


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.float64])
def test_q4_0_bytes_are_gguf_bytes(rng, dtype):
    x = _awkward_q4_0_blocks(rng)
    if dtype == np.float16:
        x = x[:7]                                            # the rest overflow float16
    x = x.astype(dtype)
    values, scales = fastattn.quantize_q4_0(x)
    want_v, want_s = gguf_q4_0(x.astype(np.float32))
    assert values.dtype == np.uint8 and values.shape == (x.shape[0], 32)
    assert scales.dtype == np.float16 and scales.shape == (x.shape[0], 2)
    np.testing.assert_array_equal(values, want_v)
    np.testing.assert_array_equal(scales.view(np.uint16), want_s.view(np.uint16))


def test_q4_0_random_rows_and_batch_shapes_are_gguf_bytes(rng):
    x = (rng.standard_normal((3, 2, 5, 96)) * rng.uniform(0.01, 100, (3, 2, 5, 1)))
    values, scales = fastattn.quantize_q4_0(x)
    want_v, want_s = gguf_q4_0(x.astype(np.float32))
    np.testing.assert_array_equal(values, want_v)
    np.testing.assert_array_equal(scales, want_s)


def test_q4_0_dequantize_is_gguf_and_requantising_is_the_identity(rng):
    x = _awkward_q4_0_blocks(rng)
    values, scales = fastattn.quantize_q4_0(x)
    deq = fastattn.dequantize_q4_0(values, scales)
    assert deq.dtype == np.float32 and deq.shape == x.shape
    np.testing.assert_array_equal(deq, _q4_0_values(values, scales))
    again = fastattn.quantize_q4_0(deq)
    np.testing.assert_array_equal(fastattn.dequantize_q4_0(*again), deq)
    # the same bytes, but where a float32 scale rounded to a float16 0 (its values then too)
    kept = np.repeat(scales != 0, 16, axis=-1)
    np.testing.assert_array_equal(again[0][kept], values[kept])
    np.testing.assert_array_equal(again[1], scales)


@pytest.mark.parametrize("x, exc, word", [
    (np.full(32, np.inf), ValueError, "finite"),
    (np.r_[np.nan, np.zeros(31)], ValueError, "finite"),
    (np.r_[8 * 65504.0 * 1.001, np.zeros(31)], ValueError, "524032"),
    (np.zeros(48), ValueError, "multiple of 32"),
    (np.float32(1.0), ValueError, "scalar"),
    (np.zeros(32, complex), TypeError, "x"),
])
def test_q4_0_quantize_refuses(x, exc, word):
    with pytest.raises(exc, match=word):
        fastattn.quantize_q4_0(x)


@pytest.mark.parametrize("values, scales, exc, word", [
    (np.zeros(16, np.int8), np.zeros(1, np.float16), TypeError, "uint8"),
    (np.zeros(16, np.uint8), np.zeros(1, np.float32), TypeError, "float16"),
    (np.zeros(16, np.uint8), np.zeros(2, np.float16), ValueError, "shape"),
    (np.zeros(8, np.uint8), np.zeros(1, np.float16), ValueError, "multiple of 32"),
])
def test_q4_0_dequantize_refuses(values, scales, exc, word):
    with pytest.raises(exc, match=word):
        fastattn.dequantize_q4_0(values, scales)


# --------------------------------------------------------------------------- fp8 bytes

def _fp8_sweep(rng, name):
    """Every finite fp8 value, the midpoints between neighbours and their float32
    neighbours, random magnitudes over 20 decades, zeros and values past the largest."""
    dt = np.dtype(getattr(ml_dtypes, name))
    every = np.arange(256, dtype=np.uint8).view(dt).astype(np.float32)
    every = np.unique(every[np.isfinite(every)])
    mid = ((every[1:].astype(np.float64) + every[:-1]) / 2).astype(np.float32)
    wide = (rng.standard_normal(4000) * 10.0 ** rng.uniform(-12, 8, 4000)).astype(np.float32)
    return np.concatenate([every, mid, np.nextafter(mid, np.float32(np.inf)),
                           np.nextafter(mid, -np.float32(np.inf)), wide,
                           np.array([0.0, -0.0, 3e38, -3e38, 1e-45], np.float32)])


@pytest.mark.parametrize("name", FP8)
@pytest.mark.parametrize("scale", [1.0, 0.37, 3e-3, 250.0])
def test_fp8_bytes_are_ml_dtypes_bytes_saturated(rng, name, scale):
    x = _fp8_sweep(rng, name)
    got = fastattn.quantize_fp8(x, scale, name)
    assert got.dtype == np.dtype(getattr(ml_dtypes, name)) and got.shape == x.shape
    np.testing.assert_array_equal(got.view(np.uint8), ml_fp8(x, scale, name).view(np.uint8))


@pytest.mark.parametrize("name", FP8)
def test_fp8_per_head_scales_and_16bit_input(rng, name):
    x = rng.standard_normal((2, 3, 5, 8)).astype(np.float16) * np.float16(30)
    scale = np.array([0.5, 0.01, 7.0], np.float32)
    got = fastattn.quantize_fp8(x, scale, getattr(ml_dtypes, name))
    np.testing.assert_array_equal(got.view(np.uint8), ml_fp8(x, scale, name).view(np.uint8))
    np.testing.assert_array_equal(fastattn.dequantize_fp8(got, scale), ml_fp8_values(got, scale))
    # float64 is rounded to float32 before the division
    x64 = rng.standard_normal((3, 4, 8)) * 100
    np.testing.assert_array_equal(fastattn.quantize_fp8(x64, scale, name).view(np.uint8),
                                  ml_fp8(x64.astype(np.float32), scale, name).view(np.uint8))


@needs_ml_dtypes
@pytest.mark.parametrize("call, exc, words", [
    (dict(x=[1.0, np.inf]), ValueError, ["x", "finite"]),
    (dict(x=[np.nan]), ValueError, ["x", "finite"]),
    (dict(x=[1.0], scale=0.0), ValueError, ["scale", "> 0"]),
    (dict(x=[1.0], scale=-2.0), ValueError, ["scale", "> 0"]),
    (dict(x=[1.0], scale=np.float32(np.nan)), ValueError, ["scale", "finite"]),
    (dict(x=[1.0], scale=1e34, dtype="float8_e5m2"), ValueError, ["scale", "57344"]),
    (dict(x=[1.0], scale=np.array(1.0)), TypeError, ["scale", "float32"]),
    (dict(x=np.ones((2, 3, 4)), scale=np.ones(3, np.float32)), ValueError, ["scale", "(2,)"]),
    (dict(x=np.ones(4), scale=np.ones(4, np.float32)), ValueError, ["scale", "shape"]),
    (dict(x=[1.0], dtype="float8_e4m3"), TypeError, ["dtype"]),
    (dict(x=[1.0], dtype=np.float16), TypeError, ["dtype"]),
])
def test_fp8_quantize_refuses(call, exc, words):
    with pytest.raises(exc) as info:
        fastattn.quantize_fp8(**call)
    for word in words:
        assert word in str(info.value), (word, str(info.value))


# --------------------------------------------------------------------------- serving caches
# Attention over these caches runs the kernel's quantised reads (src/kinds/fa_quant.h).

@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "checked"])
def test_append_writes_the_oracles_bytes_in_place(rng, fmt, compiled):
    B, Hkv, D, Dv, Lmax, Lnew = 3, 2, 64, 32, 20, 3
    cache = make_cache(rng, fmt, B, Hkv, Lmax, D, Dv)
    before = {n: a.copy() for n, a in cache.items()}
    seqlens = np.array([0, 5, 17])
    k = (rng.standard_normal((B, Hkv, Lnew, D)) * 3).astype(np.float32)
    v = rng.standard_normal((B, Hkv, Lnew, Dv)).astype(np.float16)
    q = rng.standard_normal((B, 4, 1, D)).astype(np.float32)
    plan = fastattn.plan_kvcache(cache_seqlens=seqlens)
    plan.compiled = compiled
    plan.run(q, cache["k_cache"], cache["v_cache"], k, v, k_scale=cache["k_scale"],
             v_scale=cache["v_scale"])
    if fmt == "q4_0":
        want = dict(zip(("k_cache", "k_scale"), gguf_q4_0(k)))
        want.update(zip(("v_cache", "v_scale"), gguf_q4_0(v.astype(np.float32))))
    else:
        want = dict(k_cache=ml_fp8(k, cache["k_scale"], fmt),
                    v_cache=ml_fp8(v, cache["v_scale"], fmt))
        for name in ("k_scale", "v_scale"):                  # read, never written
            np.testing.assert_array_equal(cache[name], before[name])
    for name, rows in want.items():
        for b in range(B):
            new = slice(seqlens[b], seqlens[b] + Lnew)
            np.testing.assert_array_equal(cache[name][b, :, new].view(np.uint8),
                                          rows[b].view(np.uint8))
            old = np.ones(Lmax, bool)
            old[new] = False
            np.testing.assert_array_equal(cache[name][b, :, old], before[name][b, :, old])


# --------------------------------------------------------------------------- bad input

def _bad_calls(rng):
    """(name, call keywords, exception, words) of calls over q4_0 and fp8 caches that must be
    refused; each differs from a legal call (test_good_calls_are_accepted) in one thing."""
    B, Hq, Hkv, D = 2, 4, 2, 32
    q = rng.standard_normal((B, Hq, 1, D)).astype(np.float32)
    k, v = (rng.standard_normal((B, Hkv, 1, D)).astype(np.float32) for _ in range(2))
    base = dict(q=q, k=k, v=v, cache_seqlens=np.array([3, 5]))
    q4 = make_cache(rng, "q4_0", B, Hkv, 16, D)
    cases = [
        ("q4_0 without scales", dict(k_cache=q4["k_cache"], v_cache=q4["v_cache"]),
         ValueError, ["k_scale", "q4_0"]),
        ("q4_0 scales misshaped", {**q4, "v_scale": q4["v_scale"][..., :1, :]}, ValueError,
         ["v_scale", "shape"]),
        ("q4_0 scales dtype", {**q4, "k_scale": q4["k_scale"].astype(np.float32)}, TypeError,
         ["k_scale", "float16"]),
        ("q4_0 scales read-only", {**q4, "v_scale": _read_only(q4["v_scale"])}, ValueError,
         ["v_scale", "read-only"]),
        ("q4_0 scales a list", {**q4, "k_scale": q4["k_scale"].tolist()}, TypeError,
         ["k_scale", "ndarray"]),
        ("q4_0 head dim", {**q4, "q": q[..., :16], "k": k[..., :16], "v": v[..., :16]},
         ValueError, ["head dim", "D // 2"]),
        ("q4_0 D not a multiple of 32", dict(
            q=q[..., :16], k=k[..., :16], v=v[..., :16],
            k_cache=np.zeros((B, Hkv, 16, 8), np.uint8), v_cache=np.zeros((B, Hkv, 16, 8),
                                                                          np.uint8),
            k_scale=np.zeros((B, Hkv, 16, 0), np.float16),
            v_scale=np.zeros((B, Hkv, 16, 0), np.float16)), ValueError, ["multiple of 32"]),
        ("q4_0 of inf", {**q4, "v": np.where(v > 0, np.inf, v)}, ValueError, ["v", "finite"]),
        ("q4_0 too large", {**q4, "k": k * 1e6}, ValueError, ["k", "524032"]),
        ("mixed with q8_0", {**q4, "v_cache": q4["v_cache"].view(np.int8)}, TypeError,
         ["one dtype"]),
        ("bool cache", {**q4, "k_cache": np.zeros((B, Hkv, 16, D), bool),
                        "v_cache": np.zeros((B, Hkv, 16, D), bool)}, TypeError, ["uint8"]),
    ]
    if ml_dtypes is None:
        return base, cases
    f8 = make_cache(rng, "float8_e4m3fn", B, Hkv, 16, D)
    cases += [
        ("fp8 without k_scale", {**f8, "k_scale": None}, ValueError, ["k_scale", "fp8"]),
        ("fp8 scale misshaped", {**f8, "v_scale": np.ones(3, np.float32)}, ValueError,
         ["v_scale", "(2,)"]),
        ("fp8 scale dtype", {**f8, "k_scale": np.ones(2, np.float64)}, TypeError,
         ["k_scale", "float32"]),
        ("fp8 scale zero", {**f8, "k_scale": np.array([1, 0], np.float32)}, ValueError,
         ["k_scale", "> 0"]),
        ("fp8 scale negative", {**f8, "v_scale": -1.0}, ValueError, ["v_scale", "> 0"]),
        ("fp8 scale inf", {**f8, "v_scale": np.float32(np.inf)}, ValueError,
         ["v_scale", "finite"]),
        ("fp8 scale nan", {**f8, "k_scale": np.array([np.nan, 1], np.float32)}, ValueError,
         ["k_scale", "finite"]),
        ("fp8 scale too large", {**f8, "v_scale": np.float32(1e36)}, ValueError,
         ["v_scale", "largest / 448"]),
        ("fp8 new k inf", {**f8, "k": np.where(k > 1, np.inf, k)}, ValueError,
         ["k", "finite"]),
        ("fp8 new v nan", {**f8, "v": np.where(v > 1, np.nan, v)}, ValueError,
         ["v", "finite"]),
        ("fp8 mixed types", {**f8, "v_cache": f8["v_cache"].view(ml_dtypes.float8_e5m2)},
         TypeError, ["one dtype"]),
        ("fp8 read-only", {**f8, "k_cache": _read_only(f8["k_cache"])}, ValueError,
         ["k_cache", "read-only"]),
        ("scales on a float cache", dict(k_cache=np.zeros((B, Hkv, 16, D), np.float32),
                                         v_cache=np.zeros((B, Hkv, 16, D), np.float32),
                                         k_scale=f8["k_scale"]), ValueError,
         ["k_scale", "quantised"]),
    ]
    return base, cases


def _read_only(a):
    a = a.copy()
    a.flags.writeable = False
    return a


_BASE, _CASES = _bad_calls(np.random.default_rng(5))


@pytest.mark.parametrize("case", _CASES, ids=[c[0] for c in _CASES])
@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "checked"])
def test_bad_input_is_refused_before_anything_is_written(case, compiled):
    _, kwargs, exc, words = case
    call = {**_BASE, **kwargs}
    caches = {n: a for n, a in call.items()
              if n in ("k_cache", "v_cache", "k_scale", "v_scale") and isinstance(a, np.ndarray)}
    before = snapshot(caches)
    plan = fastattn.plan_kvcache(cache_seqlens=call.pop("cache_seqlens"))
    plan.compiled = compiled
    with pytest.raises(exc) as info:
        plan.run(call.pop("q"), call.pop("k_cache"), call.pop("v_cache"), **call)
    for word in words:
        assert word in str(info.value), (word, str(info.value))
    assert snapshot(caches) == before


@pytest.mark.parametrize("fmt", FORMATS)
def test_good_calls_are_accepted(fmt):
    # the bad calls above differ from this legal call only in what each case changes
    rng = np.random.default_rng(5)
    cache = make_cache(rng, fmt, 2, 2, 16, 32)
    out = fastattn.attention_with_kvcache(**_BASE, **cache)
    want = kvcache_tests._per_sequence(_BASE["q"], cache, _BASE["cache_seqlens"] + 1, {})
    assert_same_bits(out, want)


# --------------------------------------------------------------------------- KVCache, layers

def test_kvcache_q4_0_stores_gguf_blocks_and_pickles(rng):
    cache = fastattn.KVCache(capacity=2, dtype="q4_0")
    assert cache.dtype == "q4_0" and cache.quantized and cache.format == "q4_0"
    k1, v1 = rng.standard_normal((2, 3, 4, 32)), rng.standard_normal((2, 3, 4, 64))
    k2, v2 = rng.standard_normal((2, 3, 2, 32)), rng.standard_normal((2, 3, 2, 64))
    cache.append(k1, v1)
    cache.append(k2, v2, lengths=[2, 1])                      # ragged: grows, scatters
    keys, values = cache.keys_values()
    k_scale, v_scale = cache.scales()
    assert keys.dtype == np.uint8 and keys.shape == (2, 3, 6, 16)
    assert k_scale.shape == (2, 3, 6, 1) and v_scale.shape == (2, 3, 6, 2)
    for got, got_s, rows in ((keys, k_scale, np.concatenate([k1, k2], 2)),
                             (values, v_scale, np.concatenate([v1, v2], 2))):
        want, want_s = gguf_q4_0(rows.astype(np.float32))
        for b, n in enumerate([6, 5]):
            np.testing.assert_array_equal(got[b, :, :n], want[b, :, :n])
            np.testing.assert_array_equal(got_s[b, :, :n], want_s[b, :, :n])
    again = pickle.loads(pickle.dumps(cache))
    assert again.dtype == "q4_0" and again.capacity == cache.capacity
    for a, b in zip(again.keys_values() + again.scales(), cache.keys_values() + cache.scales()):
        np.testing.assert_array_equal(a, b)
    assert "dtype=q4_0" in repr(cache)


@pytest.mark.parametrize("name", FP8)
def test_kvcache_fp8_stores_saturated_bytes_and_pickles(rng, name):
    k_scale = np.array([0.5, 0.02, 3.0], np.float32)
    cache = fastattn.KVCache(capacity=2, dtype=name, k_scale=k_scale, v_scale=0.25)
    assert cache.format == "fp8" and cache.quantized
    k, v = rng.standard_normal((2, 3, 5, 16)) * 50, rng.standard_normal((2, 3, 5, 8))
    cache.append(k, v)
    keys, values = cache.keys_values()
    assert cache.dtype == np.dtype(getattr(ml_dtypes, name)) == keys.dtype
    np.testing.assert_array_equal(keys.view(np.uint8), ml_fp8(k, k_scale, name).view(np.uint8))
    np.testing.assert_array_equal(values.view(np.uint8), ml_fp8(v, 0.25, name).view(np.uint8))
    ks, vs = cache.scales()
    np.testing.assert_array_equal(ks, k_scale)
    assert vs.dtype == np.float32 and vs == np.float32(0.25)
    again = pickle.loads(pickle.dumps(cache))
    for a, b in zip(again.keys_values() + again.scales(), cache.keys_values() + cache.scales()):
        assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


@needs_ml_dtypes
def test_kvcache_new_formats_refuse_before_writing():
    with pytest.raises(ValueError, match="k_scale"):
        fastattn.KVCache(dtype="float8_e4m3fn", k_scale=0.0)
    with pytest.raises(TypeError, match="float32"):
        fastattn.KVCache(dtype="float8_e5m2", v_scale=np.ones(2))
    with pytest.raises(ValueError, match="fp8"):
        fastattn.KVCache(dtype="q4_0", k_scale=1.0)
    cache = fastattn.KVCache(dtype="float8_e4m3fn", k_scale=np.ones(2, np.float32))
    with pytest.raises(ValueError, match=r"k_scale.*\(3,\)"):
        cache.append(np.ones((1, 3, 2, 8)), np.ones((1, 3, 2, 8)))
    assert cache.k is None
    cache.append(np.ones((1, 2, 2, 8)), np.ones((1, 2, 2, 8)))
    before = [a.tobytes() for a in cache.keys_values(cache.capacity)]
    with pytest.raises(ValueError, match="finite"):
        cache.append(np.ones((1, 2, 1, 8)), np.full((1, 2, 1, 8), np.nan))
    assert [a.tobytes() for a in cache.keys_values(cache.capacity)] == before
    np.testing.assert_array_equal(cache.lengths, [2])
    q4 = fastattn.KVCache(dtype="q4_0")
    with pytest.raises(ValueError, match="multiple of 32"):
        q4.append(np.zeros((1, 1, 2, 16)), np.zeros((1, 1, 2, 32)))
    assert q4.k is None


@pytest.mark.parametrize("kv_dtype", FORMATS)
@pytest.mark.parametrize("rope", [False, True])
def test_mha_decoding_reproduces_its_full_pass(rng, kv_dtype, rope):
    mha = fastattn.MultiHeadAttention(128, 4, n_kv_heads=2, seed=0, kv_dtype=kv_dtype,
                                      rope=rope, window=(6, 0))
    assert f"kv_dtype={kv_dtype}" in repr(mha)
    x = rng.standard_normal((2, 12, 128)).astype(np.float32)
    full = mha(x, causal=True)
    cache = fastattn.KVCache(capacity=4)
    out, cache = mha(x[:, :5], cache=cache, causal=True)
    rows = [out] + [mha(x[:, t:t + 1], cache=cache, causal=True)[0] for t in range(5, 12)]
    assert cache.quantized and cache.k.itemsize == 1
    # attention bits agree; the output projections of 1 and 12 rows may round apart in BLAS
    np.testing.assert_allclose(np.concatenate(rows, 1), full, rtol=1e-5, atol=1e-6)


def test_mha_q4_0_settings_are_checked():
    with pytest.raises(ValueError, match="q4_0.*multiple of 32"):
        fastattn.MultiHeadAttention(64, 4, kv_dtype="q4_0")          # d_head 16
    mha = fastattn.MultiHeadAttention(64, 2, kv_dtype="q4_0")
    with pytest.raises(ValueError, match="mask"):
        mha(np.ones((1, 3, 64), np.float32), cache=fastattn.KVCache(),
            mask=np.ones((3, 3), bool))


# --------------------------------------------------------------------------- torch

@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("page", [False, True], ids=["contiguous", "paged"])
def test_torch_call_appends_into_the_tensors(rng, fmt, page):
    torch = import_optional("torch")
    from fastattn.integrations.torch import attention_with_kvcache
    B, Hq, Hkv, D = 2, 4, 2, 32
    cache = make_cache(rng, fmt, B, Hkv, 16, D)
    table = None
    if page:
        cache, table = paged_from(cache, 4, rng)
    arrays = {n: a.copy() for n, a in cache.items()}                # the NumPy twin
    torch_fp8 = {"float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2}

    def as_tensor(a):                                               # sharing a's memory
        a = np.ascontiguousarray(a)
        if a.dtype.name in torch_fp8:
            return torch.from_numpy(a.view(np.uint8)).view(torch_fp8[a.dtype.name])
        return torch.from_numpy(a)

    tensors = {n: as_tensor(a) for n, a in cache.items()}
    q, k, v = (rng.standard_normal((B, h, 2, D)).astype(np.float32) for h in (Hq, Hkv, Hkv))
    kwargs = dict(cache_seqlens=np.array([3, 9]), block_table=table, causal=True)
    want = fastattn.attention_with_kvcache(q, **arrays, k=k, v=v, **kwargs)
    with torch.inference_mode():
        got = attention_with_kvcache(torch.from_numpy(q), tensors.pop("k_cache"),
                                     tensors.pop("v_cache"), torch.from_numpy(k),
                                     torch.from_numpy(v), **tensors,
                                     cache_seqlens=torch.tensor([3, 9]),
                                     block_table=None if table is None else torch.from_numpy(table),
                                     causal=True)
    np.testing.assert_array_equal(got.numpy(), want)
    for name in arrays:                                              # appended in place
        np.testing.assert_array_equal(cache[name].view(np.uint8), arrays[name].view(np.uint8))
