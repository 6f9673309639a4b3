"""Plan once, run every layer: ``plan_kvcache`` and ``KVCachePlan.run``.

What the tests pin:

- the compiled run (checks, appends, rotation, q8_0 quantisation in C) and the checked
  path in NumPy give the same bits, outputs and cache bytes, over every storage dtype,
  paging, rotary, modifier and new-row count (the checked path's own oracles are in
  tests/test_kvcache.py: gguf's q8_0 bytes, FlashAttention's rotary written out in
  float64, attention over each sequence's own keys);
- a plan runs many layers, each giving ``attention_with_kvcache``'s bits, and keeps its own
  copy of what it was given;
- a run refuses a layer's bad arrays before anything is written, naming the argument;
- several Python threads may run one plan at once;
- under the float32 precision opt-in, a float32 cache's rows get the products of
  ``attention`` over the same keys, whatever the layout.
"""
import itertools
import threading

import numpy as np
import pytest

import fastattn
from test_kvcache import FP8, QUANT_CACHES, assert_same_bits, ml_fp8

try:
    import ml_dtypes
    BF16 = np.dtype(ml_dtypes.bfloat16)
except ImportError:
    ml_dtypes = BF16 = None

DTYPES = [np.float32, np.float16] + ([BF16] if BF16 is not None else [])


def _caches(rng, dtype, B, Hkv, Lmax, D, Dv, page=None):
    """Cache keywords (k_cache, v_cache and q8_0 scales) filled with normal values, and the
    block table of a shuffled pool when ``page`` is given."""
    if page is None:
        shape, table = (B, Hkv, Lmax), None
    else:
        per_seq = -(-Lmax // page)
        order = rng.permutation(B * per_seq + 2)
        table = order[:B * per_seq].reshape(B, per_seq).astype(np.int32)
        shape = (B * per_seq + 2, Hkv, page)
    k, v = (rng.standard_normal(shape + (d,)).astype(np.float32) for d in (D, Dv))
    if dtype in ("q8_0", "q4_0"):
        quantize = fastattn.quantize_q8_0 if dtype == "q8_0" else fastattn.quantize_q4_0
        (kq, ks), (vq, vs) = quantize(k), quantize(v)
        return dict(k_cache=kq, v_cache=vq, k_scale=ks, v_scale=vs), table
    if dtype in FP8:
        ks, vs = np.float32(0.05), rng.uniform(0.01, 0.5, Hkv).astype(np.float32)
        return dict(k_cache=ml_fp8(k, ks, dtype), v_cache=ml_fp8(v, vs, dtype), k_scale=ks,
                    v_scale=vs), table
    return dict(k_cache=k.astype(dtype), v_cache=v.astype(dtype)), table


def _copy(caches):
    return {name: a.copy() for name, a in caches.items()}


def _both_paths(plan, *args, **kwargs):
    """The run of the compiled path and of the checked path, each on its own copy of the
    caches: ``(compiled result, compiled caches), (checked result, checked caches)``."""
    q, caches, k, v = args
    results = []
    for compiled in (True, False):
        mine = _copy(caches)
        plan.compiled = compiled
        try:
            res = plan.run(q, mine["k_cache"], mine["v_cache"], k, v,
                           k_scale=mine.get("k_scale"), v_scale=mine.get("v_scale"), **kwargs)
        finally:
            plan.compiled = True
        results.append((res, mine))
    return results


def _rotary(max_pos, rotary_dim, dtype=np.float64):
    inv = 1.0 / 10000.0 ** (np.arange(0, rotary_dim, 2) / rotary_dim)
    angles = np.outer(np.arange(max_pos), inv)
    return np.cos(angles).astype(dtype), np.sin(angles).astype(dtype)


CASES = list(itertools.product(
    DTYPES + ["q8_0", "q4_0"] + (list(FP8) if ml_dtypes is not None else []),   # cache
    [None, 4],                                # page
    [0, 1, 3],                                # Lnew
    ["plain", "rotary", "interleaved", "modifiers"]))


@pytest.mark.parametrize("cache_dtype, page, Lnew, keywords", CASES)
def test_compiled_run_gives_the_checked_path_bits(rng, cache_dtype, page, Lnew, keywords):
    B, Hq, Hkv, D, Dv, Lmax = 3, 4, 2, 64, 32, 24
    caches, table = _caches(rng, cache_dtype, B, Hkv, Lmax, D, Dv, page)
    seqlens = np.array([0, 5, 17])
    plan_kw = dict(cache_seqlens=seqlens, block_table=table)
    run_kw = {}
    if keywords in ("rotary", "interleaved"):
        cos, sin = _rotary(Lmax + 4, 48)
        plan_kw.update(rotary_cos=cos, rotary_sin=sin, causal=True,
                       rotary_interleaved=keywords == "interleaved")
    elif keywords == "modifiers":
        plan_kw.update(causal=True, window=(6, 0), softcap=8.0, alibi_slopes=[0.5, 0.25, 0.1, 0])
        run_kw.update(sinks=np.array([0.5, -np.inf, 1.0, 2.0]), return_lse=True)
    if keywords in ("rotary", "interleaved") and Lnew == 0:
        pytest.skip("rotary tables rotate new keys")
    plan = fastattn.plan_kvcache(scale=0.3 if keywords == "plain" else None, **plan_kw)
    for q_dtype, new_dtype in [(np.float32, np.float32)] + [(d, d) for d in DTYPES[1:]] + [
            (np.float16, np.float32)]:
        Lq = max(Lnew, 1)
        q = rng.standard_normal((B, Hq, Lq, D)).astype(q_dtype)
        k = rng.standard_normal((B, Hkv, Lnew, D)).astype(new_dtype) if Lnew else None
        v = rng.standard_normal((B, Hkv, Lnew, Dv)).astype(new_dtype) if Lnew else None
        (res_c, caches_c), (res_p, caches_p) = _both_paths(plan, q, caches, k, v, **run_kw)
        assert_same_bits(res_c, res_p)
        for name in caches:
            assert caches_c[name].tobytes() == caches_p[name].tobytes(), name


def test_compiled_run_takes_strided_new_rows_and_q(rng):
    # New rows and q as views with any strides (a (B, L, H, D) projection's swapaxes).
    B, Hq, Hkv, D = 2, 4, 2, 32
    caches, _ = _caches(rng, "q8_0", B, Hkv, 16, D, D)
    plan = fastattn.plan_kvcache(cache_seqlens=[3, 9], causal=True)
    q = np.swapaxes(rng.standard_normal((B, 2, Hq, D)).astype(np.float32), 1, 2)
    k = np.swapaxes(rng.standard_normal((B, 2, Hkv, 2 * D)).astype(np.float32), 1, 2)[..., ::2]
    v = np.swapaxes(rng.standard_normal((B, 2, Hkv, D)).astype(np.float32), 1, 2)
    (res_c, caches_c), (res_p, caches_p) = _both_paths(plan, q, caches, k, v)
    assert_same_bits(res_c, res_p)
    assert all(caches_c[n].tobytes() == caches_p[n].tobytes() for n in caches)


def test_layers_of_a_step_give_attention_with_kvcache_bits(rng):
    B, Hq, Hkv, D, layers = 4, 8, 2, 64, 3
    seqlens = np.array([7, 0, 30, 12])
    table = rng.permutation(40)[:32].reshape(B, 8).astype(np.int32)
    kw = dict(cache_seqlens=seqlens, block_table=table, causal=True)
    plan = fastattn.plan_kvcache(**kw)
    for layer in range(layers):
        caches, _ = _caches(rng, "q8_0", 40, Hkv, 4, D, D)
        theirs = _copy(caches)
        q = rng.standard_normal((B, Hq, 1, D)).astype(np.float32)
        k, v = (rng.standard_normal((B, Hkv, 1, D)).astype(np.float32) for _ in range(2))
        got = plan.run(q, caches["k_cache"], caches["v_cache"], k, v,
                       k_scale=caches["k_scale"], v_scale=caches["v_scale"])
        want = fastattn.attention_with_kvcache(q, theirs["k_cache"], theirs["v_cache"], k, v,
                                               k_scale=theirs["k_scale"],
                                               v_scale=theirs["v_scale"], **kw)
        assert_same_bits(got, want)
        assert all(caches[n].tobytes() == theirs[n].tobytes() for n in caches)


def test_plan_keeps_its_own_copy(rng):
    B, H, D = 2, 2, 32
    seqlens, table = np.array([3, 9]), np.array([[0, 1], [2, 3]])
    cos, sin = _rotary(32, D)
    plan = fastattn.plan_kvcache(cache_seqlens=seqlens, block_table=table, rotary_cos=cos,
                                 rotary_sin=sin, causal=True)
    caches, _ = _caches(rng, np.float32, 4, H, 8, D, D)
    q = rng.standard_normal((B, H, 1, D)).astype(np.float32)
    k, v = (rng.standard_normal((B, H, 1, D)).astype(np.float32) for _ in range(2))
    want = plan.run(q, **_copy(caches), k=k, v=v)
    seqlens[:], table[:], cos[:], sin[:] = 0, 3, 0, 0
    got = plan.run(q, **_copy(caches), k=k, v=v)
    assert_same_bits(got, want)


@pytest.mark.parametrize("case", ["nan", "float16 overflow", "small pool", "read-only",
                                  "no room", "scales missing", "other batch"])
def test_run_refuses_before_writing(rng, case):
    B, H, D = 2, 2, 32
    dtype = np.float16 if case == "float16 overflow" else "q8_0"
    caches, table = _caches(rng, dtype, B, H, 16, D, D, page=4)
    plan = fastattn.plan_kvcache(cache_seqlens=[3, 9], block_table=table)
    q = rng.standard_normal((B, H, 1, D)).astype(np.float32)
    k, v = (rng.standard_normal((B, H, 1, D)).astype(np.float32) for _ in range(2))
    word = {"nan": "k", "float16 overflow": "v", "small pool": "block_table",
            "read-only": "k_cache", "no room": "capacity", "scales missing": "v_scale",
            "other batch": "batch"}[case]
    if case == "nan":
        k[1, 0, 0, 5] = np.nan
    elif case == "float16 overflow":
        v[0, 1, 0, 3] = 1e6
    elif case == "small pool":
        caches = {n: a[:4] for n, a in caches.items()}
    elif case == "read-only":
        caches["k_cache"].flags.writeable = False
    elif case == "no room":
        k, v = (rng.standard_normal((B, H, 8, D)).astype(np.float32) for _ in range(2))
    elif case == "scales missing":
        caches.pop("v_scale")
    elif case == "other batch":
        q = q[:1]
    before = _copy(caches)
    with pytest.raises((ValueError, TypeError)) as info:
        plan.run(q, caches["k_cache"], caches["v_cache"], k, v,
                 k_scale=caches.get("k_scale"), v_scale=caches.get("v_scale"))
    assert word in str(info.value), str(info.value)
    assert all(caches[n].tobytes() == before[n].tobytes() for n in caches)


def test_q8_0_refusal_names_the_argument_passed(rng):
    caches, _ = _caches(rng, "q8_0", 1, 1, 8, 32, 32)
    k, v = (np.ones((1, 1, 1, 32), np.float32) for _ in range(2))
    v[..., 7] = np.inf
    with pytest.raises(ValueError, match=r"^v must be finite"):
        fastattn.attention_with_kvcache(np.ones((1, 1, 1, 32), np.float32), **caches, k=k,
                                        v=v, cache_seqlens=0)


def test_plan_refuses_bad_shared_arguments():
    with pytest.raises(ValueError, match="top-left"):
        fastattn.plan_kvcache(cache_seqlens=1, causal="top-left")
    with pytest.raises(ValueError, match="cache_seqlens must be >= 0"):
        fastattn.plan_kvcache(cache_seqlens=[1, -1])
    with pytest.raises(TypeError, match="block_table must be an integer"):
        fastattn.plan_kvcache(cache_seqlens=1, block_table=[[0.5]])
    with pytest.raises(ValueError, match="alibi_slopes must be finite"):
        fastattn.plan_kvcache(cache_seqlens=1, alibi_slopes=[np.nan])
    with pytest.raises(ValueError, match="rotary_cos and rotary_sin must be given together"):
        fastattn.plan_kvcache(cache_seqlens=1, rotary_cos=np.ones((4, 2)))


def test_one_length_plan_takes_any_batch(rng):
    plan = fastattn.plan_kvcache(cache_seqlens=2, causal=True)
    for B in (1, 3):
        caches, _ = _caches(rng, np.float32, B, 1, 8, 32, 32)
        q = rng.standard_normal((B, 2, 1, 32)).astype(np.float32)
        got = plan.run(q, **_copy(caches))
        want = fastattn.attention(q, caches["k_cache"][:, :, :2], caches["v_cache"][:, :, :2],
                                  causal=True)
        assert_same_bits(got, want)


def test_threads_may_run_one_plan_at_once(rng):
    B, Hq, Hkv, D, n = 4, 8, 2, 64, 8
    plan = fastattn.plan_kvcache(cache_seqlens=[100, 7, 300, 64], causal=True)
    layers = [_caches(rng, np.float16, B, Hkv, 320, D, D)[0] for _ in range(n)]
    qs = [rng.standard_normal((B, Hq, 1, D)).astype(np.float32) for _ in range(n)]
    want = [plan.run(q, **c) for q, c in zip(qs, layers)]
    got = [None] * n

    def work(i):
        for _ in range(5):
            got[i] = plan.run(qs[i], **layers[i])

    threads = [threading.Thread(target=work, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for g, w in zip(got, want):
        assert_same_bits(g, w)


@pytest.mark.skipif(not fastattn._calls.glue.kernel.bf16_dot_takes(64, 64),
                    reason="the float32 opt-in changes nothing without bfloat16 products")
@pytest.mark.parametrize("page", [None, 4])
def test_float32_opt_in_gives_attention_products_in_every_layout(rng, page):
    # The opt-in rounds q, k and v to bfloat16 in attention(); a float32 cache read in place
    # must get the same products, and the bits may not depend on the cache's layout.
    B, Hq, Hkv, D = 2, 4, 2, 64
    seqlens = np.array([20, 33])
    caches, table = _caches(rng, np.float32, B, Hkv, 40, D, D, page)
    strided = {n: np.swapaxes(np.swapaxes(a, 1, 2).copy(), 1, 2) for n, a in caches.items()}
    q = rng.standard_normal((B, Hq, 1, D)).astype(np.float32)
    kw = dict(cache_seqlens=seqlens, block_table=table, causal=True)
    with fastattn.float32_precision("bfloat16"):
        got = fastattn.attention_with_kvcache(q, **caches, **kw)
        got_strided = fastattn.attention_with_kvcache(q, **strided, **kw)
        keys, values = (_gather(caches[n], table, page, 33) for n in ("k_cache", "v_cache"))
        want = fastattn.attention(q, keys, values, kv_lengths=seqlens, causal=True)
    exact = fastattn.attention_with_kvcache(q, **caches, **kw)
    assert_same_bits(got, want)
    assert_same_bits(got_strided, want)
    assert not np.array_equal(got, exact)     # the opt-in did change the products


def _gather(cache, table, page, n):
    """The first n rows of every sequence, (B, H, n, D): the cache's own, or its pages'."""
    if table is None:
        return cache[:, :, :n]
    pages = [np.concatenate([cache[p] for p in row[:-(-n // page)]], axis=-2)[:, :n]
             for row in table]
    return np.stack(pages)


@pytest.mark.parametrize("cache_dtype", DTYPES + QUANT_CACHES)
@pytest.mark.parametrize("page", [None, 4])
def test_serving_calls_run_compiled(rng, monkeypatch, cache_dtype, page):
    # The calls a server makes -- decode with an append, rotary, sinks, out, lse -- never
    # reach the checked path (its Python checks): a paged plan's first layer resolves the
    # pages in use for its page size and new rows, then runs compiled, and every later
    # layer reuses what it resolved.
    calls = []
    checked = type(fastattn.plan_kvcache(cache_seqlens=0))._run_checked

    def counted(*args):
        calls.append(1)
        return checked(*args)

    B, H, D = 2, 4, 64
    cos, sin = _rotary(32, D)
    first, table = _caches(rng, cache_dtype, B, 2, 24, D, D, page)
    monkeypatch.setattr(fastattn.KVCachePlan, "_run_checked", counted)
    plan = fastattn.plan_kvcache(cache_seqlens=[4, 11], block_table=table, rotary_cos=cos,
                                 rotary_sin=sin, causal=True, window=(8, 0), softcap=20.0)
    for layer in range(3):
        caches = _copy(first)          # each layer's own arrays, of the first one's shapes
        q = rng.standard_normal((B, H, 1, D)).astype(np.float32)
        k, v = (rng.standard_normal((B, 2, 1, D)).astype(np.float32) for _ in range(2))
        out = np.empty((B, H, 1, D), np.float32)
        res, lse = plan.run(q, caches["k_cache"], caches["v_cache"], k, v, out=out,
                            return_lse=True, k_scale=caches.get("k_scale"),
                            v_scale=caches.get("v_scale"), sinks=np.zeros(H))
        assert res is out and lse.shape == (B, H, 1) and np.isfinite(lse).all()
    assert not calls
    # attention_with_kvcache is a plan and one run: never the checked path either.
    calls.clear()
    fastattn.attention_with_kvcache(q, caches["k_cache"], caches["v_cache"], k, v,
                                    cache_seqlens=[4, 11], block_table=table,
                                    k_scale=caches.get("k_scale"), v_scale=caches.get("v_scale"))
    assert not calls


@pytest.mark.parametrize("cache_dtype", DTYPES + ["q8_0", "q4_0"])
@pytest.mark.parametrize("layout", ["step", "fortran", "swapaxes", "reversed"])
def test_serving_call_reads_q_as_any_view(rng, cache_dtype, layout):
    # A view of q gives the bits of its C-contiguous copy, compiled or checked, decode and
    # prefill: the compiled run once read such a q's rows as if they were contiguous.
    B, Hq, Hkv, D = 2, 4, 2, 64
    caches, _ = _caches(rng, cache_dtype, B, Hkv, 16, D, D)
    for Lq in (1, 3):
        base = rng.standard_normal((B, Hq, Lq, 2 * D)).astype(np.float32)
        q = {"step": base[..., ::2],
             "fortran": np.asfortranarray(base[..., :D]),
             "swapaxes": np.swapaxes(np.ascontiguousarray(np.swapaxes(base[..., :D], 2, 3)), 2, 3),
             "reversed": base[..., :D][..., ::-1]}[layout]
        want = fastattn.attention_with_kvcache(np.ascontiguousarray(q), **_copy(caches),
                                               cache_seqlens=[5, 9])
        got = fastattn.attention_with_kvcache(q, **_copy(caches), cache_seqlens=[5, 9])
        assert_same_bits(got, want)


def test_bfloat16_cache_refusal_names_its_own_range(rng):
    if BF16 is None:
        pytest.skip("needs ml_dtypes")
    caches, _ = _caches(rng, BF16, 1, 1, 8, 32, 32)
    k = np.full((1, 1, 1, 32), np.finfo(np.float32).max, np.float32)
    v = np.zeros_like(k)
    before = _copy(caches)
    with pytest.raises(ValueError) as e:
        fastattn.attention_with_kvcache(k[:, :1], caches["k_cache"], caches["v_cache"], k, v,
                                        cache_seqlens=[2])
    msg = str(e.value)
    assert "bfloat16's range" in msg and "3.38953e+38" in msg and "3.40282e+38" in msg
    assert "store it as float32" in msg and "as bfloat16" not in msg
    assert all(before[n].tobytes() == caches[n].tobytes() for n in caches)


def test_float32_cache_refusal_names_float32s_range(rng):
    # A float64 value beyond float32 names float32's largest value and advises float64.
    caches, _ = _caches(rng, np.float32, 1, 1, 8, 32, 32)
    k = np.full((1, 1, 1, 32), 1e300)
    before = _copy(caches)
    with pytest.raises(ValueError) as e:
        fastattn.attention_with_kvcache(np.zeros((1, 1, 1, 32), np.float32), caches["k_cache"],
                                        caches["v_cache"], k, np.zeros_like(k), cache_seqlens=[2])
    msg = str(e.value)
    assert "float32's range" in msg and "3.40282e+38" in msg and "store it as float64" in msg
    assert all(before[n].tobytes() == caches[n].tobytes() for n in caches)
