"""Serving caches: ``attention_with_kvcache`` (contiguous and paged, float and quantised --
q8_0, q4_0, fp8 --, appended in place, rotated on append) and the q8_0 format (the q4_0 and
fp8 formats' bytes: tests/test_cache_formats.py).

What the tests pin, each against an independent oracle:

- q8_0 is llama.cpp's format bit for bit: ``gguf``'s ``quants.quantize(x, Q8_0)`` (a NumPy
  port of ``quantize_row_q8_0_ref``) gives the same bytes, ties and zero blocks included;
- appending writes the new rows where FlashAttention writes them (``cache_seqlens[b] + i``,
  through the block table), rounded once to a float cache's dtype or quantised;
- the bits of each sequence's rows are those of :func:`fastattn.attention` over that
  sequence's keys alone (dequantised for q8_0), whatever the paging, page size, pool
  layout, batch or thread count; a decode step gives the bits of the prefill row;
- rotary embedding follows FlashAttention's rule, written out here in float64;
- every bad input is refused before anything is written (the cache bytes are compared);
- quantised caches lose only what quantisation loses: FlashAttention's float32 rule
  against float64 attention over the dequantised cache (with torch; skipped without it).
"""
import itertools
import pickle
import zlib

import numpy as np
import pytest

from conftest import import_optional

import fastattn
from fastattn import reference

try:
    import ml_dtypes
    BF16 = np.dtype(ml_dtypes.bfloat16)
except ImportError:
    ml_dtypes = BF16 = None

needs_bf16 = pytest.mark.skipif(ml_dtypes is None, reason="bfloat16 needs ml_dtypes")
FLOAT_CACHES = [np.float32, np.float64, np.float16,
                pytest.param(BF16, id="bfloat16", marks=needs_bf16)]
FP8 = ("float8_e4m3fn", "float8_e5m2")
# The quantised formats: llama.cpp's blocks, and fp8 (test_cache_formats.py pins their bytes)
QUANT_CACHES = ["q8_0", "q4_0"] + [
    pytest.param(n, marks=pytest.mark.skipif(ml_dtypes is None, reason="fp8 needs ml_dtypes"))
    for n in FP8]


# --------------------------------------------------------------------------- helpers

def gguf_q8_0(x):
    """``(values, scales)`` of ``x`` quantised by gguf (skips without it)."""
    gguf = import_optional("gguf")
    raw = gguf.quants.quantize(np.asarray(x), gguf.GGMLQuantizationType.Q8_0)
    blocks = raw.reshape(x.shape[:-1] + (x.shape[-1] // 32, 34))
    scales = np.ascontiguousarray(blocks[..., :2]).view(np.float16)[..., 0]
    values = np.ascontiguousarray(blocks[..., 2:]).view(np.int8).reshape(x.shape)
    return values, scales


def make_cache(rng, B, Hkv, Lmax, D, Dv=None, dtype=np.float32):
    """A contiguous cache pair filled with standard normal values (rows beyond each
    sequence's length are stale data, as in a server): q8_0 and q4_0 with their block
    scales, fp8 with float32 scales per kv head (ml_dtypes' rounding, clipped)."""
    Dv = D if Dv is None else Dv
    if isinstance(dtype, str):
        k, v = (rng.standard_normal((B, Hkv, Lmax, d)).astype(np.float32) for d in (D, Dv))
    if dtype in ("q8_0", "q4_0"):
        quantize = fastattn.quantize_q8_0 if dtype == "q8_0" else fastattn.quantize_q4_0
        (kq, ks), (vq, vs) = quantize(k), quantize(v)
        return dict(k_cache=kq, v_cache=vq, k_scale=ks, v_scale=vs)
    if dtype in FP8:
        ks, vs = (rng.uniform(0.01, 0.5, Hkv).astype(np.float32) for _ in range(2))
        return dict(k_cache=ml_fp8(k, ks, dtype), v_cache=ml_fp8(v, vs, dtype), k_scale=ks,
                    v_scale=vs)
    return dict(k_cache=rng.standard_normal((B, Hkv, Lmax, D)).astype(dtype),
                v_cache=rng.standard_normal((B, Hkv, Lmax, Dv)).astype(dtype))


def ml_fp8(x, scale, name):
    """``x / scale`` (float32) as ml_dtypes' fp8 ``name``, clipped first to its largest
    finite value (vLLM saturates; ml_dtypes' cast alone would not); ``scale`` () or per
    head (axis -3)."""
    dt = np.dtype(getattr(ml_dtypes, name))
    top = float(ml_dtypes.finfo(dt).max)
    s = np.asarray(scale, np.float32)
    s = s if s.ndim == 0 else s[:, None, None]
    with np.errstate(over="ignore"):                         # x / scale may overflow: inf
        return np.clip(np.asarray(x, np.float32) / s, -top, top).astype(dt)


def ml_fp8_values(values, scale):
    """The float32 numbers fp8 ``values`` with ``scale`` hold, by ml_dtypes' cast."""
    s = np.asarray(scale, np.float32)
    return values.astype(np.float32) * (s if s.ndim == 0 else s[:, None, None])


def paged_from(cache, page, rng, *, spare=3, pool_layout=False):
    """The same cache as a shuffled pool of pages and a block table: returns
    ``(pool_kwargs, block_table)``; ``pool_layout`` stores the pool as
    ``(num_pages, page, Hkv, D)`` and passes its swapaxes view.  fp8 scales (one per kv
    head) stay as they are."""
    B, Hkv, Lmax = cache["k_cache"].shape[:3]
    n = -(-Lmax // page)
    num_pages = B * n + spare
    table = rng.permutation(num_pages)[:B * n].reshape(B, n).astype(np.int32)
    pools = {name: a for name, a in cache.items() if a.ndim != 4}
    for name, a in cache.items():
        if a.ndim != 4:
            continue
        last = a.shape[-1]
        pool = np.full((num_pages, page, Hkv, last) if pool_layout else
                       (num_pages, Hkv, page, last), 7, a.dtype)
        view = np.swapaxes(pool, 1, 2) if pool_layout else pool
        for b in range(B):
            for p in range(n):
                rows = a[b, :, p * page:(p + 1) * page]
                view[table[b, p], :, :rows.shape[1]] = rows
        pools[name] = view
    return pools, table


def contiguous_from(pools, table, B, Lmax):
    """The pool read back sequence by sequence, ``(B, Hkv, Lmax, last)`` (the oracle of the
    paged writes)."""
    out = {name: a for name, a in pools.items() if a.ndim != 4}
    for name, pool in pools.items():
        if pool.ndim != 4:
            continue
        page = pool.shape[2]
        seqs = [np.concatenate([pool[p] for p in table[b]], axis=1)[:, :Lmax] for b in range(B)]
        out[name] = np.stack(seqs)
    return out


def own_keys(cache, b, n):
    """Sequence ``b``'s first ``n`` keys and values as float arrays (dequantised for the
    quantised formats: ml_dtypes' cast times the scale for fp8)."""
    k, v = cache["k_cache"][b, :, :n], cache["v_cache"][b, :, :n]
    if k.dtype.name in FP8:
        return ml_fp8_values(k, cache["k_scale"]), ml_fp8_values(v, cache["v_scale"])
    if "k_scale" in cache:
        dequantize = fastattn.dequantize_q8_0 if k.dtype == np.int8 else fastattn.dequantize_q4_0
        k = dequantize(k, cache["k_scale"][b, :, :n])
        v = dequantize(v, cache["v_scale"][b, :, :n])
    return k, v


def snapshot(arrays):
    return {name: a.tobytes() for name, a in arrays.items()}


# --------------------------------------------------------------------------- q8_0 format

def _blocks_with_ties(rng):
    """float32 blocks whose max is 127 (so d = 1 and id = 1 exactly): every other value is
    an exact tie k + 0.5 or -(k + 0.5), which ties-away and ties-even round apart."""
    x = (rng.integers(-126, 126, (4, 32)) + 0.5).astype(np.float32)
    x[:, 0] = 127
    x[1, 0] = -127
    return x


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.float64])
def test_q8_0_bytes_are_gguf_bytes(rng, dtype):
    scales = np.array([1e-6, 1e-3, 0.1, 1.0, 30.0, 1e4, 1e6])[:, None, None]
    x = rng.standard_normal((7, 5, 128)) * scales
    if dtype == np.float16:
        x = np.clip(x, -6e4, 6e4)
    x = x.astype(dtype)
    x[0, 0, :32] = 0                      # an all-zero block
    x[1, 1, 5:40] = 0                     # zeros inside blocks
    x[2, 2, 64:96] = -3.0                 # a constant block
    x[3, 3, 96:128] = np.float32(1e-30) if dtype != np.float16 else 0   # a tiny scale
    values, scales_ = fastattn.quantize_q8_0(x)
    want_v, want_s = gguf_q8_0(x)
    assert values.dtype == np.int8 and scales_.dtype == np.float16
    assert values.shape == x.shape and scales_.shape == x.shape[:-1] + (4,)
    np.testing.assert_array_equal(values, want_v)
    np.testing.assert_array_equal(scales_.view(np.uint16), want_s.view(np.uint16))


def test_q8_0_ties_round_away_from_zero(rng):
    x = _blocks_with_ties(rng)
    values, scales = fastattn.quantize_q8_0(x)
    assert np.all(scales == 1)
    np.testing.assert_array_equal(values, np.trunc(x + np.copysign(0.5, x)))   # away
    want_v, want_s = gguf_q8_0(x)
    np.testing.assert_array_equal(values, want_v)


def test_q8_0_dequantize_is_gguf_and_exact(rng):
    gguf = import_optional("gguf")
    x = rng.standard_normal((3, 4, 96)).astype(np.float32) * 5
    values, scales = fastattn.quantize_q8_0(x)
    deq = fastattn.dequantize_q8_0(values, scales)
    raw = gguf.quants.quantize(x, gguf.GGMLQuantizationType.Q8_0)
    np.testing.assert_array_equal(deq, gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q8_0))
    # exact: the float64 product of the two rounds to itself in float32
    exact = values.astype(np.float64) * np.repeat(scales.astype(np.float64), 32, -1)
    np.testing.assert_array_equal(deq.astype(np.float64), exact)
    # the quantisation error is at most half a step (+ the float16 rounding of d)
    step = np.repeat(scales.astype(np.float64), 32, -1)
    assert np.all(np.abs(deq - x) <= 0.5 * step + np.abs(x) * 2**-10)


def test_q8_0_requantising_is_the_identity(rng):
    x = rng.standard_normal((6, 64)).astype(np.float32) * rng.uniform(1e-3, 1e3, (6, 1))
    values, scales = fastattn.quantize_q8_0(x)
    again = fastattn.quantize_q8_0(fastattn.dequantize_q8_0(values, scales))
    np.testing.assert_array_equal(again[0], values)
    np.testing.assert_array_equal(again[1], scales)


@pytest.mark.parametrize("x, exc, word", [
    (np.zeros((2, 48), np.float32), ValueError, "multiple of 32"),
    (np.float32(1.0), ValueError, "scalar"),
    (np.full((1, 32), np.inf, np.float32), ValueError, "finite"),
    (np.full((1, 32), np.nan, np.float32), ValueError, "finite"),
    (np.full((1, 32), 9e6, np.float32), ValueError, "65504"),
    (np.zeros((1, 32), np.complex64), TypeError, "dtype"),
])
def test_q8_0_quantize_refuses(x, exc, word):
    with pytest.raises(exc, match=word):
        fastattn.quantize_q8_0(x)


@pytest.mark.parametrize("values, scales, exc, word", [
    (np.zeros((2, 32), np.int16), np.zeros((2, 1), np.float16), TypeError, "int8"),
    (np.zeros((2, 32), np.int8), np.zeros((2, 1), np.float32), TypeError, "float16"),
    (np.zeros((2, 32), np.int8), np.zeros((2, 2), np.float16), ValueError, r"\(2, 1\)"),
    (np.zeros((2, 40), np.int8), np.zeros((2, 1), np.float16), ValueError, "multiple of 32"),
])
def test_q8_0_dequantize_refuses(values, scales, exc, word):
    with pytest.raises(exc, match=word):
        fastattn.dequantize_q8_0(values, scales)


# --------------------------------------------------------------------------- the bits

CALLS = {
    "plain": {},
    "causal": dict(causal=True),
    "window": dict(causal=True, window=(5, 0)),
    "window-both": dict(window=(7, 3)),
    "softcap-alibi": dict(softcap=4.0, alibi_slopes=[0.5, 0.25, 0.125, 0.0625]),
    "sinks-lse": dict(causal=True, sinks=[0.5, -1.0, 2.0, -np.inf], return_lse=True),
}


def _per_sequence(q, cache, seen, kwargs):
    """The oracle of the bits: fastattn.attention over each sequence's own keys."""
    outs, lses = [], []
    for b in range(q.shape[0]):
        k, v = own_keys(cache, b, seen[b])
        res = fastattn.attention(q[b], k, v, **kwargs)
        out, lse = res if kwargs.get("return_lse") else (res, None)
        outs.append(out)
        lses.append(lse)
    out = np.stack(outs)
    return (out, np.stack(lses)) if kwargs.get("return_lse") else out


def assert_same_bits(got, want):
    if isinstance(want, tuple):
        for g, w in zip(got, want):
            assert_same_bits(g, w)
        return
    assert got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))


@pytest.mark.parametrize("call", CALLS)
@pytest.mark.parametrize("dtype", FLOAT_CACHES + QUANT_CACHES)
@pytest.mark.parametrize("Lq, Lnew", [(1, 1), (3, 3), (1, 0), (4, 2)])
def test_rows_have_the_bits_of_attention_over_own_keys(rng, call, dtype, Lq, Lnew):
    B, Hq, Hkv, D, Lmax = 3, 4, 2, 64, 48
    cache = make_cache(rng, B, Hkv, Lmax, D, dtype=dtype)
    seqlens = np.array([0, 13, 40]) if Lnew else np.array([1, 13, 40])
    q = rng.standard_normal((B, Hq, Lq, D)).astype(np.float32)
    kw = {} if not Lnew else dict(
        k=rng.standard_normal((B, Hkv, Lnew, D)).astype(np.float32),
        v=rng.standard_normal((B, Hkv, Lnew, D)).astype(np.float32))
    got = fastattn.attention_with_kvcache(q, **cache, **kw, cache_seqlens=seqlens,
                                          **CALLS[call])
    assert_same_bits(got, _per_sequence(q, cache, seqlens + Lnew, CALLS[call]))


@pytest.mark.parametrize("dtype", FLOAT_CACHES)
def test_append_writes_rounded_rows_in_place(rng, dtype):
    B, Hkv, D, Dv, Lmax, Lnew = 3, 2, 16, 8, 20, 3
    cache = make_cache(rng, B, Hkv, Lmax, D, Dv, dtype=dtype)
    before = {n: a.copy() for n, a in cache.items()}
    seqlens = np.array([0, 5, 17])
    k = rng.standard_normal((B, Hkv, Lnew, D))
    v = rng.standard_normal((B, Hkv, Lnew, Dv))
    q = rng.standard_normal((B, 4, 1, D)).astype(np.float32)
    fastattn.attention_with_kvcache(q, **cache, k=k, v=v, cache_seqlens=seqlens)
    for name, new in (("k_cache", k), ("v_cache", v)):
        want = before[name].copy()
        for b in range(B):
            want[b, :, seqlens[b]:seqlens[b] + Lnew] = new[b].astype(np.float32).astype(dtype) \
                if dtype is BF16 else new[b].astype(dtype)
        assert_same_bits(cache[name], want)
    np.testing.assert_array_equal(seqlens, [0, 5, 17])     # cache_seqlens is not changed


def test_q8_0_append_writes_gguf_blocks(rng):
    B, Hkv, D, Lmax, Lnew = 2, 2, 64, 24, 5
    cache = make_cache(rng, B, Hkv, Lmax, D, dtype="q8_0")
    before = {n: a.copy() for n, a in cache.items()}
    seqlens = np.array([19, 2])
    k, v = (rng.standard_normal((B, Hkv, Lnew, D)) * 3 for _ in range(2))
    q = rng.standard_normal((B, 2, 1, D)).astype(np.float32)
    fastattn.attention_with_kvcache(q, **cache, k=k, v=v, cache_seqlens=seqlens)
    for values, scales, new in (("k_cache", "k_scale", k), ("v_cache", "v_scale", v)):
        gv, gs = gguf_q8_0(new)
        wv, ws = before[values].copy(), before[scales].copy()
        for b in range(B):
            wv[b, :, seqlens[b]:seqlens[b] + Lnew] = gv[b]
            ws[b, :, seqlens[b]:seqlens[b] + Lnew] = gs[b]
        np.testing.assert_array_equal(cache[values], wv)
        np.testing.assert_array_equal(cache[scales].view(np.uint16), ws.view(np.uint16))


@pytest.mark.parametrize("dtype", [np.float32, np.float16] + QUANT_CACHES)
@pytest.mark.parametrize("page", [1, 3, 16, 64])
@pytest.mark.parametrize("pool_layout", [False, True], ids=["heads-first", "swapaxes"])
def test_paged_equals_contiguous_bit_for_bit(rng, dtype, page, pool_layout):
    B, Hq, Hkv, D, Lmax, Lnew = 3, 6, 2, 32, 50, 2
    cache = make_cache(rng, B, Hkv, Lmax, D, dtype=dtype)
    pools, table = paged_from(cache, page, rng, pool_layout=pool_layout)
    seqlens = np.array([7, 0, 48])
    q = rng.standard_normal((B, Hq, 2, D)).astype(np.float32)
    k, v = (rng.standard_normal((B, Hkv, Lnew, D)).astype(np.float32) for _ in range(2))
    kwargs = dict(k=k, v=v, cache_seqlens=seqlens, causal=True, return_lse=True)
    want = fastattn.attention_with_kvcache(q, **cache, **kwargs)
    got = fastattn.attention_with_kvcache(q, **pools, **kwargs, block_table=table)
    assert_same_bits(got, want)
    # the pages now hold what the contiguous cache holds, new rows included
    back = contiguous_from(pools, table, B, Lmax)
    for b in range(B):
        n = seqlens[b] + Lnew
        for name, a in cache.items():
            if a.ndim == 4:
                np.testing.assert_array_equal(back[name][b, :, :n].view(np.uint8),
                                              a[b, :, :n].view(np.uint8))


def test_unused_block_table_entries_and_stale_rows_are_never_read(rng):
    B, Hkv, D, page = 2, 1, 32, 4
    cache = make_cache(rng, B, Hkv, 16, D)
    pools, table = paged_from(cache, page, rng)
    seqlens = np.array([5, 9])
    q = rng.standard_normal((B, 2, 1, D)).astype(np.float32)
    want = fastattn.attention_with_kvcache(q, **pools, cache_seqlens=seqlens, block_table=table)
    table = table.copy()
    table[0, 2:] = -1                        # pages sequence 0 does not use
    table[1, 3:] = 10**6
    for pool in pools.values():              # stale rows: NaN beyond each sequence's keys
        pool[table[0, 1], :, 1:] = np.nan
        pool[table[1, 2], :, 1:] = np.nan
    got = fastattn.attention_with_kvcache(q, **pools, cache_seqlens=seqlens, block_table=table)
    assert_same_bits(got, want)


@pytest.mark.parametrize("dtype", [np.float32] + QUANT_CACHES)
def test_bits_do_not_depend_on_batch_or_threads(rng, dtype):
    B, Hq, Hkv, D, Lmax = 4, 8, 2, 64, 300
    cache = make_cache(rng, B, Hkv, Lmax, D, dtype=dtype)
    pools, table = paged_from(cache, 16, rng)
    seqlens = np.array([299, 1, 150, 64])
    q = rng.standard_normal((B, Hq, 1, D)).astype(np.float32)
    with fastattn.num_threads(2):
        both = fastattn.attention_with_kvcache(q, **pools, cache_seqlens=seqlens,
                                               block_table=table, causal=True)
    with fastattn.num_threads(1):
        one = fastattn.attention_with_kvcache(q, **pools, cache_seqlens=seqlens,
                                              block_table=table, causal=True)
    assert_same_bits(one, both)
    for b in range(B):
        alone = fastattn.attention_with_kvcache(q[b:b + 1], **pools,
                                                cache_seqlens=seqlens[b:b + 1],
                                                block_table=table[b:b + 1], causal=True)
        assert_same_bits(alone[0], both[b])


@pytest.mark.parametrize("dtype", [np.float32, np.float16] + QUANT_CACHES)
def test_many_short_sequences_have_their_own_bits(rng, dtype):
    # A busy server's step: many short sequences, whose tiles run several to a work item
    # (each requesting the next one's first rows); every row keeps the bits it has alone,
    # paged or contiguous, on one thread or two.
    B, Hq, Hkv, D, Lmax = 40, 4, 2, 64, 96
    cache = make_cache(rng, B, Hkv, Lmax, D, dtype=dtype)
    pools, table = paged_from(cache, 16, rng)
    seqlens = rng.integers(0, Lmax + 1, B)
    seqlens[:6] = [0, 1, 16, 63, 64, 65]
    q = rng.standard_normal((B, Hq, 1, D)).astype(np.float32)
    runs = {}
    for threads in (1, 2):
        with fastattn.num_threads(threads):
            runs["paged", threads] = fastattn.attention_with_kvcache(
                q, **pools, cache_seqlens=seqlens, block_table=table)
            runs["contiguous", threads] = fastattn.attention_with_kvcache(
                q, **cache, cache_seqlens=seqlens)
    want = runs["contiguous", 1]
    for got in runs.values():
        assert_same_bits(got, want)
    for b in range(0, B, 7):
        alone = fastattn.attention_with_kvcache(q[b:b + 1], **pools,
                                                cache_seqlens=seqlens[b:b + 1],
                                                block_table=table[b:b + 1])
        assert_same_bits(alone[0], want[b])


def _q8_0_cache_with_odd_scales(rng, B, Hkv, Lmax, D, Dv):
    """A q8_0 cache whose blocks include all-zero blocks (scale 0), float16-subnormal
    scales and scales near float16's largest, beside ordinary ones."""
    cache = make_cache(rng, B, Hkv, Lmax, D, Dv, dtype="q8_0")
    for name in ("k_scale", "v_scale"):
        s = cache[name]
        pick = rng.random(s.shape)
        s[pick < 0.05] = 0
        s[(pick >= 0.05) & (pick < 0.1)] = np.float16(3e-7)        # subnormal
        s[(pick >= 0.1) & (pick < 0.12)] = np.float16(200.0)
    return cache


# q8_0 needs Dv a multiple of 32; paged float V rows are read by pointer when Dv is a
# multiple of two vectors, else copied (Dv 40).
LONG_CACHE_DTYPES = [("q8_0", 96), ("q4_0", 96)] + [
    pytest.param(n, 96, marks=pytest.mark.skipif(ml_dtypes is None, reason="needs ml_dtypes"))
    for n in FP8] + [
    pytest.param(dt, dv, id=f"{name}-{dv}", marks=marks)
    for name, dt, marks in (("float16", np.float16, ()), ("float32", np.float32, ()),
                            ("bfloat16", BF16, needs_bf16))
    for dv in (96, 40)]


@pytest.mark.parametrize("dtype, Dv", LONG_CACHE_DTYPES)
@pytest.mark.parametrize("group", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("page", [None, 16, 7])
def test_decode_over_long_caches_has_the_bits_of_attention_over_own_keys(rng, dtype, Dv,
                                                                          group, page):
    # Decode tiles (up to 8 query rows of a kv head) read q8_0 rows in place and copy
    # paged float rows as stored, keys past a chunk of 1024 merged in order: each row has
    # the bits of attention over its sequence's own (dequantised) keys, whatever the rows
    # per tile and the paging.
    B, Hkv, D, Lmax = 2, 2, 64, 2600
    if dtype == "q8_0":
        D = 128             # 4 scales per row: their transpose 16 keys at a time
        cache = _q8_0_cache_with_odd_scales(rng, B, Hkv, Lmax, D, Dv)
    else:
        cache = make_cache(rng, B, Hkv, Lmax, D, Dv, dtype=dtype)
    seqlens = np.array([2600, 1100])
    table = None
    if page:
        cache, table = paged_from(cache, page, rng)
    q = rng.standard_normal((B, Hkv * group, 1, D)).astype(np.float32)
    for kw in ({}, dict(causal=True, window=(700, 0))):
        got = fastattn.attention_with_kvcache(q, **cache, cache_seqlens=seqlens,
                                              block_table=table, **kw)
        if page:
            flat = contiguous_from(cache, table, B, Lmax)
        else:
            flat = cache
        assert_same_bits(got, _per_sequence(q, flat, seqlens, kw))


@pytest.mark.parametrize("dtype", [np.float32, np.float16] + QUANT_CACHES)
@pytest.mark.parametrize("page", [None, 5])
def test_decode_steps_give_the_prefill_rows(rng, dtype, page):
    B, Hq, Hkv, D, L = 2, 4, 2, 32, 12
    Lmax = 20
    cache = make_cache(rng, B, Hkv, Lmax, D, dtype=dtype)
    q = rng.standard_normal((B, Hq, L, D)).astype(np.float32)
    k, v = (rng.standard_normal((B, Hkv, L, D)).astype(np.float32) for _ in range(2))
    pre = {n: a.copy() for n, a in cache.items()}
    table = None
    if page:
        cache, table = paged_from(cache, page, rng)
        pre = {n: a.copy() for n, a in cache.items()}
    seqlens = np.array([3, 0])
    prefill = fastattn.attention_with_kvcache(q, **pre, k=k, v=v, cache_seqlens=seqlens,
                                              block_table=table, causal=True)
    for i in range(L):
        step = fastattn.attention_with_kvcache(q[:, :, i:i + 1], **cache, k=k[:, :, i:i + 1],
                                               v=v[:, :, i:i + 1], cache_seqlens=seqlens + i,
                                               block_table=table, causal=True)
        assert_same_bits(step, prefill[:, :, i:i + 1])
    for name in cache:                        # both wrote the same cache bytes
        np.testing.assert_array_equal(cache[name].view(np.uint8), pre[name].view(np.uint8))


def test_empty_batch_and_empty_sequences(rng):
    cache = make_cache(rng, 0, 2, 8, 32)
    out = fastattn.attention_with_kvcache(np.zeros((0, 2, 1, 32), np.float32), **cache,
                                          cache_seqlens=np.zeros(0, np.int32))
    assert out.shape == (0, 2, 1, 32)
    cache = make_cache(rng, 2, 1, 8, 32)
    out, lse = fastattn.attention_with_kvcache(np.ones((2, 1, 1, 32), np.float32), **cache,
                                               cache_seqlens=0, return_lse=True)
    np.testing.assert_array_equal(out, 0)     # a row that sees no key gives zeros
    assert np.all(lse == -np.inf)


def test_out_is_written(rng):
    cache = make_cache(rng, 2, 2, 8, 32)
    q = rng.standard_normal((2, 4, 1, 32)).astype(np.float32)
    out = np.empty((2, 4, 1, 32), np.float32)
    res = fastattn.attention_with_kvcache(q, **cache, cache_seqlens=[3, 8], out=out)
    assert res is out
    assert_same_bits(out, _per_sequence(q, cache, [3, 8], {}))


# --------------------------------------------------------------------------- rotary

def rotary_tables(max_pos, rotary_dim, base=10000.0):
    inv = 1.0 / base ** (np.arange(0, rotary_dim, 2) / rotary_dim)
    angles = np.arange(max_pos)[:, None] * inv
    return np.cos(angles), np.sin(angles)


def apply_rotary_emb(x, cos, sin, interleaved):
    """FlashAttention's reference (flash_attn/layers/rotary.py, ``apply_rotary_emb_torch``)
    in float64: x (..., L, D), cos/sin (..., L, rotary_dim / 2)."""
    x = x.astype(np.float64)
    rd = 2 * cos.shape[-1]
    if interleaved:
        cos, sin = np.repeat(cos, 2, -1), np.repeat(sin, 2, -1)
        x1, x2 = x[..., 0:rd:2], x[..., 1:rd:2]
        rotated = np.stack([-x2, x1], -1).reshape(x.shape[:-1] + (rd,))
    else:
        cos, sin = np.concatenate([cos, cos], -1), np.concatenate([sin, sin], -1)
        x1, x2 = x[..., :rd // 2], x[..., rd // 2:rd]
        rotated = np.concatenate([-x2, x1], -1)
    return np.concatenate([x[..., :rd] * cos + rotated * sin, x[..., rd:]], -1)


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("rotary_dim", [64, 32, 16])
@pytest.mark.parametrize("causal", [False, True])
def test_rotary_follows_flash_attention(rng, interleaved, rotary_dim, causal):
    B, Hq, Hkv, D, Lmax, Lnew, Lq = 3, 4, 2, 64, 40, 3, 3
    cache = make_cache(rng, B, Hkv, Lmax, D, dtype=np.float64)
    before = {n: a.copy() for n, a in cache.items()}
    seqlens = np.array([0, 9, 30])
    q = rng.standard_normal((B, Hq, Lq, D))
    k, v = (rng.standard_normal((B, Hkv, Lnew, D)) for _ in range(2))
    cos, sin = rotary_tables(64, rotary_dim)
    out = fastattn.attention_with_kvcache(q, **cache, k=k, v=v, cache_seqlens=seqlens,
                                          rotary_cos=cos, rotary_sin=sin,
                                          rotary_interleaved=interleaved, causal=causal)
    for b in range(B):
        pos = seqlens[b] + np.arange(Lnew)
        k_rot = apply_rotary_emb(k[b], cos[pos], sin[pos], interleaved)
        np.testing.assert_allclose(cache["k_cache"][b, :, pos], np.swapaxes(k_rot, 0, 1),
                                   rtol=1e-15, atol=1e-15)
        np.testing.assert_array_equal(cache["v_cache"][b, :, pos], np.swapaxes(v[b], 0, 1))
        q_pos = seqlens[b] + (np.arange(Lq) if causal else np.zeros(Lq, int))
        q_rot = apply_rotary_emb(q[b], cos[q_pos], sin[q_pos], interleaved)
        n = seqlens[b] + Lnew
        keys = np.concatenate([before["k_cache"][b, :, :seqlens[b]], k_rot], 1)
        want = reference.attention(q_rot, keys, cache["v_cache"][b, :, :n], causal=causal)
        np.testing.assert_allclose(out[b], want, rtol=1e-12, atol=1e-12)


def test_rotary_bits_are_attention_over_the_rotated_rows(rng):
    # float32: the rotation is FlashAttention's, in float32, and the attention step is the
    # plain call over the rotated q and the cache holding the rotated keys
    B, Hq, Hkv, D = 2, 2, 1, 32
    cache = make_cache(rng, B, Hkv, 16, D)
    q = rng.standard_normal((B, Hq, 2, D)).astype(np.float32)
    k, v = (rng.standard_normal((B, Hkv, 2, D)).astype(np.float32) for _ in range(2))
    cos, sin = (t.astype(np.float32) for t in rotary_tables(16, D))
    seqlens = np.array([4, 11])
    out = fastattn.attention_with_kvcache(q, **cache, k=k, v=v, cache_seqlens=seqlens,
                                          rotary_cos=cos, rotary_sin=sin, window=(3, 0))
    for b in range(B):
        pos = seqlens[b] + np.arange(2)
        q_rot = apply_rotary_emb(q[b], cos[pos].astype(np.float64), sin[pos].astype(np.float64),
                                 False)
        # float32 rotation: one rounding of each product and sum, within 2 ulps of float64
        np.testing.assert_allclose(cache["k_cache"][b, :, pos],
                                   np.swapaxes(apply_rotary_emb(k[b], cos[pos], sin[pos],
                                                                False), 0, 1),
                                   rtol=5e-7, atol=5e-7)
        del q_rot
    # the bits: attention over a q rotated the same way, with the stored keys
    from fastattn._serving.kvcache import _rotate
    q_pos = seqlens[:, None] + np.arange(2)
    q_rot = _rotate(q, cos[q_pos][:, None], sin[q_pos][:, None], False)
    assert_same_bits(out, _per_sequence(q_rot, cache, seqlens + 2, dict(window=(3, 0))))


# --------------------------------------------------------------------------- bad input

def _bad_calls(rng):
    """(name, call keywords, exception, words) of calls that must be refused."""
    B, Hq, Hkv, D, page = 2, 4, 2, 32, 4
    q = rng.standard_normal((B, Hq, 1, D)).astype(np.float32)
    k, v = (rng.standard_normal((B, Hkv, 1, D)).astype(np.float32) for _ in range(2))
    flat = make_cache(rng, B, Hkv, 16, D)
    quant = make_cache(rng, B, Hkv, 16, D, dtype="q8_0")
    pools, table = paged_from(flat, page, rng, spare=0)
    base = dict(q=q, k=k, v=v, cache_seqlens=np.array([3, 5]))
    ro = {n: a.copy() for n, a in flat.items()}
    for a in ro.values():
        a.flags.writeable = False
    cos, sin = rotary_tables(8, D)
    cases = [
        ("page out of range", dict(**pools, block_table=np.where(table == table[1, 1], 99,
                                                                 table)), ValueError,
         ["block_table", "num_pages"]),
        ("negative page", dict(**pools, block_table=np.where(table == table[0, 0], -1, table)),
         ValueError, ["block_table"]),
        ("float block table", dict(**pools, block_table=table.astype(np.float32)), TypeError,
         ["block_table", "integer"]),
        ("block table batch", dict(**pools, block_table=table[:1]), ValueError,
         ["block_table", "(2, max_pages)"]),
        ("shared new page", dict(**pools, block_table=np.repeat(table[:1], 2, 0),
                                 cache_seqlens=np.array([3, 3])), ValueError, ["same page"]),
        ("capacity", dict(**flat, cache_seqlens=np.array([3, 16])), ValueError,
         ["capacity", "16"]),
        ("paged capacity", dict(**pools, block_table=table, cache_seqlens=np.array([16, 0])),
         ValueError, ["capacity"]),
        ("negative length", dict(**flat, cache_seqlens=np.array([-1, 2])), ValueError,
         ["cache_seqlens", ">= 0"]),
        ("float lengths", dict(**flat, cache_seqlens=np.array([1.0, 2.0])), TypeError,
         ["cache_seqlens"]),
        ("lengths batch", dict(**flat, cache_seqlens=np.array([1, 2, 3])), ValueError,
         ["cache_seqlens", "(2,)"]),
        ("k without v", dict(**flat, v=None), ValueError, ["k and v"]),
        ("v without k", dict(**flat, k=None), ValueError, ["k and v"]),
        ("int8 without scales", dict(k_cache=quant["k_cache"], v_cache=quant["v_cache"]),
         ValueError, ["k_scale", "q8_0"]),
        ("scales misshaped", dict(**{**quant, "v_scale": quant["v_scale"][..., :1, :]}),
         ValueError, ["v_scale", "shape"]),
        ("scales dtype", dict(**{**quant, "k_scale": quant["k_scale"].astype(np.float32)}),
         TypeError, ["k_scale", "float16"]),
        ("scales on a float cache", dict(**flat, k_scale=quant["k_scale"]), ValueError,
         ["k_scale", "q8_0"]),
        ("D not a multiple of 32", dict(
            q=q[..., :16], k=k[..., :16], v=v[..., :16],
            k_cache=np.zeros((B, Hkv, 16, 16), np.int8), v_cache=np.zeros((B, Hkv, 16, 16),
                                                                          np.int8),
            k_scale=np.zeros((B, Hkv, 16, 0), np.float16),
            v_scale=np.zeros((B, Hkv, 16, 0), np.float16)), ValueError, ["multiple of 32"]),
        ("read-only cache", dict(**ro), ValueError, ["read-only", "k_cache"]),
        ("batch mismatch", dict(**flat, q=q[:1]), ValueError, ["batch", "k_cache"]),
        ("k batch", dict(**flat, k=k[:1], v=v[:1]), ValueError, ["k must have shape"]),
        ("k heads", dict(**flat, k=k[:, :1], v=v[:, :1]), ValueError, ["k must have shape"]),
        ("head dim", dict(**flat, q=q[..., :16]), ValueError, ["head dim"]),
        ("heads", dict(**flat, q=q[:, :3]), ValueError, ["multiple"]),
        ("mixed cache dtypes", dict(k_cache=flat["k_cache"],
                                    v_cache=flat["v_cache"].astype(np.float16)),
         TypeError, ["one dtype"]),
        ("list cache", dict(k_cache=flat["k_cache"].tolist(), v_cache=flat["v_cache"]),
         TypeError, ["k_cache", "ndarray"]),
        ("3-d cache", dict(k_cache=flat["k_cache"][0], v_cache=flat["v_cache"][0]),
         ValueError, ["k_cache", "shape"]),
        ("cache dtype", dict(k_cache=flat["k_cache"].astype(np.int32),
                             v_cache=flat["v_cache"].astype(np.int32)), TypeError, ["int8"]),
        ("float16 overflow", dict(k_cache=flat["k_cache"].astype(np.float16),
                                  v_cache=flat["v_cache"].astype(np.float16), k=k * 1e6),
         ValueError, ["k", "65504"]),
        ("q8_0 of inf", dict(**quant, v=np.where(v > 0, np.inf, v)), ValueError, ["finite"]),
        ("top-left", dict(**flat, causal="top-left"), ValueError, ["top-left"]),
        ("window", dict(**flat, window=(1, 2, 3)), ValueError, ["window"]),
        ("softcap", dict(**flat, softcap=0), ValueError, ["softcap"]),
        ("sinks", dict(**flat, sinks=[1.0, 2.0]), ValueError, ["sinks"]),
        ("alibi", dict(**flat, alibi_slopes=[np.nan] * 4), ValueError, ["alibi_slopes"]),
        ("scale", dict(**flat, scale="2"), TypeError, ["scale"]),
        ("return_lse", dict(**flat, return_lse="yes"), TypeError, ["return_lse"]),
        ("out shape", dict(**flat, out=np.empty((2, 4, 2, 32), np.float32)), ValueError,
         ["out"]),
        ("rotary without k", dict(**flat, k=None, v=None, rotary_cos=cos, rotary_sin=sin),
         ValueError, ["rotary", "k and v"]),
        ("rotary cos alone", dict(**flat, rotary_cos=cos), ValueError, ["rotary_sin"]),
        ("rotary too short", dict(**flat, rotary_cos=cos[:5], rotary_sin=sin[:5]),
         ValueError, ["rotary_cos", "position"]),
        ("rotary too wide", dict(**flat, rotary_cos=np.ones((8, 17)),
                                 rotary_sin=np.ones((8, 17))), ValueError, ["rotary_dim"]),
        ("rotary shapes", dict(**flat, rotary_cos=cos, rotary_sin=sin[:, :4]), ValueError,
         ["rotary_cos and rotary_sin"]),
        ("interleaved", dict(**flat, rotary_cos=cos, rotary_sin=sin, rotary_interleaved=1),
         TypeError, ["rotary_interleaved"]),
        ("q 3-d", dict(**flat, q=q[0]), ValueError, ["q must have shape"]),
        ("no seqlens", dict(**flat, cache_seqlens=None), TypeError, ["cache_seqlens"]),
    ]
    return base, cases


_BASE, _CASES = _bad_calls(np.random.default_rng(5))


@pytest.mark.parametrize("case", _CASES, ids=[c[0] for c in _CASES])
def test_bad_input_is_refused_before_anything_is_written(case):
    _, kwargs, exc, words = case
    call = {**_BASE, **kwargs}
    caches = {n: a for n, a in call.items()
              if n in ("k_cache", "v_cache", "k_scale", "v_scale") and isinstance(a, np.ndarray)}
    before = snapshot(caches)
    with pytest.raises(exc) as info:
        fastattn.attention_with_kvcache(**call)
    for word in words:
        assert word in str(info.value), (word, str(info.value))
    assert snapshot(caches) == before


def test_good_base_call_is_accepted():
    # the bad calls above differ from a legal call only in what each case changes: that
    # call appends k and v at cache_seqlens and attends over each sequence's keys
    rng = np.random.default_rng(5)
    flat = make_cache(rng, 2, 2, 16, 32)
    out = fastattn.attention_with_kvcache(**_BASE, **flat)
    seqlens = _BASE["cache_seqlens"]
    for b in range(2):
        np.testing.assert_array_equal(flat["k_cache"][b, :, seqlens[b]], _BASE["k"][b, :, 0])
        np.testing.assert_array_equal(flat["v_cache"][b, :, seqlens[b]], _BASE["v"][b, :, 0])
    assert_same_bits(out, _per_sequence(_BASE["q"], flat, seqlens + 1, {}))


# --------------------------------------------------------------------------- accuracy

@pytest.mark.parametrize("dtype", QUANT_CACHES)
@pytest.mark.parametrize("kind", ["mha", "gqa"])
@pytest.mark.parametrize("causal", [False, True])
def test_quantised_within_flash_rule_of_float64_over_dequantised_cache(dtype, kind, causal):
    import_optional("torch")
    rng = np.random.default_rng(3)
    B, Hq, D, Lmax = 3, 8, 128, 300
    Hkv = 8 if kind == "mha" else 2
    cache = make_cache(rng, B, Hkv, Lmax, D, dtype=dtype)
    seqlens = np.array([299, 147, 40])
    q = rng.standard_normal((B, Hq, 1, D)).astype(np.float32)
    out = fastattn.attention_with_kvcache(q, **cache, cache_seqlens=seqlens, causal=causal)
    assert_within_flash_rule(out, q, [own_keys(cache, b, n) for b, n in enumerate(seqlens)],
                             causal)


def assert_within_flash_rule(out, q, keys, causal):
    """Each sequence's rows of ``out`` within FlashAttention's float32 rule: at most twice
    torch's float32 error against float64 attention over that sequence's ``keys[b]``
    (``(k, v)``, the cache's own values), plus the rounding noise of float32 itself."""
    torch = import_optional("torch")
    from test_flash_rule import torch_float32
    for b, (k, v) in enumerate(keys):
        ref = reference.attention(q[b].astype(np.float64), k.astype(np.float64),
                                  v.astype(np.float64), causal=causal)
        pt = torch_float32(torch, q[b:b + 1], k[None], v[None], causal, None)[0]
        r32 = ref.astype(np.float32)
        noise = 2 * float(np.abs((r32 + np.float32(0.3) - np.float32(0.3)) - r32).max())
        err, err_pt = np.abs(out[b] - ref).max(), np.abs(pt - ref).max()
        assert err <= 2 * err_pt + noise, (b, err, err_pt, noise)


# --------------------------------------------------------------------------- FlashAttention's cases

def _flash_kvcache_cases():
    """FlashAttention's ``test_flash_attn_kvcache`` grid (seqlen_q, seqlen_k, d, paged block
    size, rotary fraction and layout, new keys or not, causal / local, MHA / GQA / MQA),
    thinned to the combinations that differ for fastattn and on smaller sizes."""
    grid = itertools.product(
        [(1, 128), (1, 339), (3, 1024), (64, 800), (16, 200)],   # (seqlen_q, seqlen_k)
        [64, 128], [None, 16, 256], [0.0, 0.5, 1.0], [False, True], [False, True],
        ["none", "causal", "local"], ["mha", "gqa", "mqa"])
    cases = list(grid)
    return [c for i, c in enumerate(cases) if i % 31 == 0]


@pytest.mark.parametrize("case", _flash_kvcache_cases(), ids=lambda c: "-".join(map(str, c)))
def test_flash_attn_kvcache_cases(case):
    """FlashAttention's kvcache test in float32: the cache updated where FlashAttention puts
    the new keys (rotated when asked), and the output within twice torch's float32 error of
    a float64 reference over the same cache (plus the rounding noise, as in
    test_flash_rule)."""
    torch = import_optional("torch")
    from test_flash_rule import torch_float32
    ((Lq, Lk), D, page, rotary_fraction, interleaved, new_kv, mask, kind) = case
    rng = np.random.default_rng(zlib.crc32(repr(case).encode()))
    B, Hq = 2, 6
    Hkv = {"mha": 6, "gqa": 3, "mqa": 1}[kind]
    Lnew = rng.integers(1, Lq + 1) if new_kv else 0
    q = rng.standard_normal((B, Hq, Lq, D)).astype(np.float32)
    cache = make_cache(rng, B, Hkv, Lk, D)
    seqlens = rng.integers(0, Lk - Lnew + 1, B)
    kw = {}
    if new_kv:
        kw = dict(k=rng.standard_normal((B, Hkv, Lnew, D)).astype(np.float32),
                  v=rng.standard_normal((B, Hkv, Lnew, D)).astype(np.float32))
    rotary_dim = int(rotary_fraction * D) // 16 * 16
    if rotary_dim and new_kv:
        cos, sin = (t.astype(np.float32) for t in rotary_tables(Lk + Lq, rotary_dim))
        kw.update(rotary_cos=cos, rotary_sin=sin, rotary_interleaved=interleaved)
    causal = mask == "causal"
    window = tuple(int(w) for w in rng.integers(0, Lk, 2)) if mask == "local" else None
    before = {n: a.copy() for n, a in cache.items()}
    target, table = cache, None
    if page:
        target, table = paged_from(cache, page, rng)
    out = fastattn.attention_with_kvcache(q, **target, **kw, cache_seqlens=seqlens,
                                          block_table=table, causal=causal, window=window)
    stored = contiguous_from(target, table, B, Lk) if page else target
    for b in range(B):
        n = seqlens[b] + Lnew
        k_new = kw.get("k", np.zeros((B, Hkv, 0, D)))[b].astype(np.float64)
        q_b = q[b].astype(np.float64)
        if "rotary_cos" in kw:
            pos = seqlens[b] + np.arange(Lnew)
            k_new = apply_rotary_emb(k_new, cos[pos], sin[pos], interleaved)
            q_pos = seqlens[b] + (np.arange(Lq) if causal or window else np.zeros(Lq, int))
            q_b = apply_rotary_emb(q_b, cos[q_pos], sin[q_pos], interleaved)
        keys = np.concatenate([before["k_cache"][b, :, :seqlens[b]], k_new], 1)
        values = np.concatenate([before["v_cache"][b, :, :seqlens[b]],
                                 kw.get("v", np.zeros((B, Hkv, 0, D)))[b]], 1)
        # the cache: FlashAttention's rows (float32 rotation: within a few ulps)
        np.testing.assert_allclose(stored["k_cache"][b, :, :n], keys, rtol=1e-6, atol=1e-6)
        np.testing.assert_array_equal(stored["v_cache"][b, :, :n], values)
        ref = reference.attention(q_b, keys, values.astype(np.float64), causal=causal,
                                  window=window)
        pt = torch_float32(torch, q_b.astype(np.float32)[None], keys.astype(np.float32)[None],
                           values.astype(np.float32)[None], causal, window)[0]
        r32 = ref.astype(np.float32)
        noise = 2 * float(np.abs((r32 + np.float32(0.3) - np.float32(0.3)) - r32).max())
        err, err_pt = np.abs(out[b] - ref).max(), np.abs(pt - ref).max()
        # the rotation of q rounds in float32 before fastattn sees it: allow its share
        assert err <= 2 * err_pt + noise + (1e-6 if "rotary_cos" in kw else 0), (err, err_pt)


# --------------------------------------------------------------------------- KVCache, layers

def test_kvcache_q8_0_stores_gguf_blocks_and_pickles(rng):
    cache = fastattn.KVCache(capacity=2, dtype="q8_0")
    assert cache.dtype == "q8_0" and cache.quantized
    k1, v1 = rng.standard_normal((2, 3, 4, 32)), rng.standard_normal((2, 3, 4, 64))
    k2, v2 = rng.standard_normal((2, 3, 2, 32)), rng.standard_normal((2, 3, 2, 64))
    cache.append(k1, v1)
    cache.append(k2, v2, lengths=[2, 1])                      # ragged: grows, scatters
    np.testing.assert_array_equal(cache.lengths, [6, 5])
    keys, values = cache.keys_values()
    k_scale, v_scale = cache.scales()
    assert keys.dtype == np.int8 and k_scale.dtype == np.float16
    assert k_scale.shape == (2, 3, 6, 1) and v_scale.shape == (2, 3, 6, 2)
    for got, got_s, rows in ((keys, k_scale, np.concatenate([k1, k2], 2)),
                             (values, v_scale, np.concatenate([v1, v2], 2))):
        want, want_s = gguf_q8_0(rows)
        for b, n in enumerate([6, 5]):
            np.testing.assert_array_equal(got[b, :, :n], want[b, :, :n])
            np.testing.assert_array_equal(got_s[b, :, :n], want_s[b, :, :n])
    again = pickle.loads(pickle.dumps(cache))
    assert again.dtype == "q8_0" and again.capacity == cache.capacity
    for a, b in zip(again.keys_values() + again.scales(), cache.keys_values() + cache.scales()):
        np.testing.assert_array_equal(a, b)
    assert "dtype=q8_0" in repr(cache)


def test_kvcache_q8_0_refuses_before_writing(rng):
    cache = fastattn.KVCache(dtype="q8_0")
    with pytest.raises(ValueError, match="multiple of 32"):
        cache.append(np.zeros((1, 1, 2, 16)), np.zeros((1, 1, 2, 32)))
    assert cache.k is None
    cache.append(np.ones((1, 1, 2, 32)), np.ones((1, 1, 2, 32)))
    before = [a.tobytes() for a in cache.keys_values(cache.capacity) + cache.scales(cache.capacity)]
    with pytest.raises(ValueError, match="finite"):
        cache.append(np.full((1, 1, 1, 32), np.inf), np.ones((1, 1, 1, 32)))
    after = cache.keys_values(cache.capacity) + cache.scales(cache.capacity)
    assert [a.tobytes() for a in after] == before     # stale rows too: compared as bytes
    np.testing.assert_array_equal(cache.lengths, [2])
    with pytest.raises(TypeError, match="q8_0"):
        fastattn.KVCache(dtype="q5_0")


@pytest.mark.parametrize("rope", [False, True])
def test_mha_q8_0_decoding_reproduces_its_full_pass(rng, rope):
    mha = fastattn.MultiHeadAttention(128, 4, n_kv_heads=2, seed=0, kv_dtype="q8_0", rope=rope,
                                      window=(6, 0))
    x = rng.standard_normal((2, 12, 128)).astype(np.float32)
    full = mha(x, causal=True)
    cache = fastattn.KVCache(capacity=4)
    out, cache = mha(x[:, :5], cache=cache, causal=True)
    rows = [out] + [mha(x[:, t:t + 1], cache=cache, causal=True)[0] for t in range(5, 12)]
    assert cache.dtype == "q8_0" and cache.k.dtype == np.int8
    # attention bits agree; the output projections of 1 and 12 rows may round apart in BLAS
    np.testing.assert_allclose(np.concatenate(rows, 1), full, rtol=1e-5, atol=1e-6)


def test_mha_q8_0_decoding_stays_close_to_a_float32_cache(rng):
    """The q8_0 cache's only error is its quantisation: each stored value is within half a
    step, max|block| / 254, of the float32 one.  An output is a convex combination of the
    values, so the values' share is at most max|v| / 254; the keys' share moves each score
    by at most scale * sum_i |q_i| * max|k| / 254 and the softmax weights by about twice that
    (in l1), each weight moving the output by at most max|v|.  The bound is computed from
    the layer's own q, k and v, and the error must also stay above zero (the cache
    quantised)."""
    d_model, n_heads, d = 128, 4, 32
    kw = dict(n_kv_heads=2, seed=1, rope=True)
    q8 = fastattn.MultiHeadAttention(d_model, n_heads, kv_dtype="q8_0", **kw)
    f32 = fastattn.MultiHeadAttention(d_model, n_heads, **kw)
    x = rng.standard_normal((1, 24, d_model)).astype(np.float32)
    c8, c32 = fastattn.KVCache(), fastattn.KVCache()
    errs = []
    for t in range(24):
        o8, _ = q8(x[:, t:t + 1], cache=c8)
        o32, _ = f32(x[:, t:t + 1], cache=c32)
        errs.append(np.abs(o8 - o32).max())
    q, k, v = f32._qkv(x, f32._weights(), np.arange(24))
    k_err = np.abs(k).max() / 254
    score = (1 / np.sqrt(d)) * np.abs(q).sum(-1).max() * k_err
    attn_bound = np.abs(v).max() / 254 + 2.5 * score * np.abs(v).max()
    # the output projection multiplies an attention error by at most the w_o row sums
    bound = attn_bound * np.abs(f32.w_o).sum(0).max()
    assert 0 < max(errs) <= bound, (max(errs), bound)


def test_mha_q8_0_settings_are_checked():
    with pytest.raises(ValueError, match="multiple of 32"):
        fastattn.MultiHeadAttention(64, 4, kv_dtype="q8_0")          # d_head 16
    mha = fastattn.MultiHeadAttention(64, 2, kv_dtype="q8_0")
    assert "kv_dtype=q8_0" in repr(mha)
    x = np.ones((1, 3, 64), np.float32)
    with pytest.raises(ValueError, match="mask"):
        mha(x, cache=fastattn.KVCache(), mask=np.ones((3, 3), bool))
    with pytest.raises(ValueError, match="kv_dtype"):
        mha(x, cache=fastattn.KVCache(dtype=np.float32))


# --------------------------------------------------------------------------- torch

@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "q8_0"])
@pytest.mark.parametrize("paged", [False, True])
def test_torch_call_appends_into_the_tensors(rng, dtype, paged):
    torch = import_optional("torch")
    if dtype == "bfloat16" and ml_dtypes is None:
        pytest.skip("bfloat16 needs ml_dtypes")
    from fastattn.integrations.torch import attention_with_kvcache
    B, Hq, Hkv, D = 2, 4, 2, 32
    np_dt = np.float32 if dtype == "q8_0" else (BF16 if dtype == "bfloat16" else np.dtype(dtype))
    cache = make_cache(rng, B, Hkv, 16, D, dtype=dtype if dtype == "q8_0" else np_dt)
    table = None
    if paged:
        cache, table = paged_from(cache, 4, rng)
    arrays = {n: a.copy() for n, a in cache.items()}                 # the NumPy twin
    as_tensor = lambda a: (torch.from_numpy(np.ascontiguousarray(a).view(np.int16)).view(
        torch.bfloat16) if a.dtype == BF16 else torch.from_numpy(np.ascontiguousarray(a)))
    tensors = {n: as_tensor(a) for n, a in cache.items()}          # sharing cache's memory
    q, k, v = (rng.standard_normal((B, h, 2, D)).astype(np_dt) for h in (Hq, Hkv, Hkv))
    kwargs = dict(cache_seqlens=np.array([3, 9]), block_table=table, causal=True)
    want = fastattn.attention_with_kvcache(q, **arrays, k=k, v=v, **kwargs)
    with torch.inference_mode():
        got = attention_with_kvcache(as_tensor(q), tensors.pop("k_cache"), tensors.pop("v_cache"),
                                     as_tensor(k), as_tensor(v), **tensors,
                                     cache_seqlens=torch.tensor([3, 9]),
                                     block_table=None if table is None else torch.from_numpy(table),
                                     causal=True)
    got = (got.float() if got.dtype == torch.bfloat16 else got).numpy()
    np.testing.assert_array_equal(got, want.astype(np.float32) if want.dtype == BF16 else want)
    for name in arrays:                                              # appended in place
        np.testing.assert_array_equal(cache[name].view(np.uint8), arrays[name].view(np.uint8))


def test_torch_call_refuses_gradients(rng):
    torch = import_optional("torch")
    from fastattn.integrations.torch import attention_with_kvcache
    k_cache, v_cache = torch.zeros(1, 1, 8, 32), torch.zeros(1, 1, 8, 32)
    q = torch.randn(1, 1, 1, 32, requires_grad=True)
    with pytest.raises(RuntimeError, match="no_grad"):
        attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=torch.tensor([2]))


def test_paged_q8_0_cache_is_read_in_place():
    # The kernel reads pages and q8_0 rows where they are: a call allocates about its
    # output and the small arrays of its arguments, never a copy of the keys (a float32
    # copy of this cache's keys and values would take 4 MiB), and a workspace per thread:
    # two threads, so that the bound does not grow with the machine's cores.
    import tracemalloc
    rng = np.random.default_rng(3)
    B, Hkv, D, page, pages_per_seq = 2, 4, 64, 16, 64
    pool = rng.standard_normal((B * pages_per_seq, Hkv, page, D), dtype=np.float32)
    k_cache, k_scale = fastattn.quantize_q8_0(pool)
    v_cache, v_scale = fastattn.quantize_q8_0(pool[::-1].copy())
    block_table = np.arange(B * pages_per_seq, dtype=np.int32).reshape(B, pages_per_seq)
    q = rng.standard_normal((B, 8, 1, D), dtype=np.float32)
    call = dict(cache_seqlens=[1000, 700], block_table=block_table, k_scale=k_scale,
                v_scale=v_scale, causal=True)
    with fastattn.num_threads(2):
        fastattn.attention_with_kvcache(q, k_cache, v_cache, **call)      # warm caches
        tracemalloc.start()
        try:
            fastattn.attention_with_kvcache(q, k_cache, v_cache, **call)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    assert peak < 256 * 1024, f"{peak} bytes allocated by a decode step"
