"""merge_attention: partial results over disjoint key shards merged into one call's result.

The oracle is one fastattn.attention call over all the keys (and, for the 16-bit cases, the
float64 reference).  Shards follow the recipe in merge_attention's docstring: causal and
window alignment shifted by the keys after the shard, a boolean mask where the shift cannot
be written as a window, ``kv_lengths`` clipped to the shard, the sink in the first shard.
"""
import doctest

import numpy as np
import pytest

import fastattn
from fastattn import reference
from fastattn._calls import merge as _merge

from conftest import assert_close, import_optional, make_qkv, tolerance


def shard_call(q, k, v, a, b, *, causal=False, window=None, kv_lengths=None, first=True,
               sinks=None, **keywords):
    """attention(..., return_lse=True) over keys a:b with the visibility of the whole call."""
    Lq, Lk = q.shape[-2], k.shape[-2]
    extra = dict(keywords)
    if sinks is not None and first:
        extra["sinks"] = sinks
    if kv_lengths is not None:
        assert not causal and window is None, "kv_lengths aligns causal/window: use a mask"
        extra["kv_lengths"] = np.clip(np.asarray(kv_lengths) - a, 0, b - a)
    if causal:
        window = (-1, 0) if window is None else (window[0], 0 if window[1] == -1 else min(window[1], 0))
    if window is not None:
        after = Lk - b
        left, right = window
        if left == -1 or left >= after:
            extra["window"] = (left if left == -1 else left - after,
                               right if right == -1 else right + after)
        else:
            batch = np.broadcast_shapes(q.shape[:-3], k.shape[:-3])
            visible = reference.visible_keys(batch, Lq, Lk, window=window)
            extra["mask"] = visible[..., a:b]
    return fastattn.attention(q, k[..., a:b, :], v[..., a:b, :], return_lse=True, **extra)


def merged(q, k, v, bounds, **keywords):
    parts = [shard_call(q, k, v, a, b, first=(n == 0), **keywords)
             for n, (a, b) in enumerate(zip(bounds[:-1], bounds[1:]))]
    return fastattn.merge_attention([p[0] for p in parts], [p[1] for p in parts])


def check_against_one_call(q, k, v, bounds, **keywords):
    out, lse = merged(q, k, v, bounds, **keywords)
    full, full_lse = fastattn.attention(q, k, v, return_lse=True, **keywords)
    assert out.dtype == full.dtype and lse.dtype == full_lse.dtype
    assert_close(out, full)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(full_lse))
    assert_close(lse, full_lse, scale=10.0)   # |lse| ~ log(Lk) + |s|: absolute floor x10


# --------------------------------------------------------------------------- one call

@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("bounds", [[0, 40, 97], [0, 13, 13, 50, 97], [0, 97, 97], [0, 1, 96, 97]])
def test_shards_equal_one_call(rng, dtype, bounds):
    # GQA (4 query heads on 2 key/value heads), a batch dimension, empty shards.
    q, k, v = make_qkv(rng, (2, 4, 7, 16), (2, 2, 97, 16), (2, 2, 97, 8), dtype)
    check_against_one_call(q, k, v, bounds)


@pytest.mark.parametrize("Lq", [1, 5, 64])
@pytest.mark.parametrize("bounds", [[0, 30, 64], [0, 10, 20, 45, 64], [0, 0, 64]])
def test_causal_shards(rng, Lq, bounds):
    # Lq < Lk: bottom-right alignment, as in a prefill that continues a cache.
    q, k, v = make_qkv(rng, (3, Lq, 16), (3, 64, 16), (3, 64, 16))
    check_against_one_call(q, k, v, bounds, causal=True)


def test_unshifted_causal_shards_are_wrong(rng):
    # Why the recipe shifts the window: causal=True per shard aligns each shard to its own
    # last key, which lets early queries see keys after them.
    q, k, v = make_qkv(rng, (2, 8, 16), (2, 32, 16), (2, 32, 16))
    parts = [fastattn.attention(q, k[:, a:b], v[:, a:b], causal=True, return_lse=True)
             for a, b in ((0, 16), (16, 32))]
    out, _ = fastattn.merge_attention(*zip(*parts))
    assert not np.allclose(out, fastattn.attention(q, k, v, causal=True), atol=1e-3)


@pytest.mark.parametrize("window", [(4, 2), (20, 0), (3, -1), (-1, 3), (0, 0)])
@pytest.mark.parametrize("bounds", [[0, 12, 25, 40], [0, 39, 40]])
def test_window_shards(rng, window, bounds):
    # Narrow left windows put some shards' lower bound out of reach of a shifted window:
    # those shards take the mask, the others the window.
    q, k, v = make_qkv(rng, (2, 9, 8), (2, 40, 8), (2, 40, 8))
    check_against_one_call(q, k, v, bounds, window=window)
    check_against_one_call(q, k, v, bounds, window=window, causal=True)


def test_kv_lengths_shards_and_rows_nobody_sees(rng):
    # Batch element 1 has no keys: every shard gives lse = -inf there, and the merge zeros.
    q, k, v = make_qkv(rng, (3, 2, 4, 8), (3, 2, 30, 8), (3, 2, 30, 8))
    lengths = np.array([30, 0, 17])
    check_against_one_call(q, k, v, [0, 10, 20, 30], kv_lengths=lengths)
    out, lse = merged(q, k, v, [0, 10, 20, 30], kv_lengths=lengths)
    assert np.all(out[1] == 0) and np.all(lse[1] == -np.inf)


def test_partials_with_no_visible_key_contribute_nothing(rng):
    o = rng.standard_normal((2, 3, 4)).astype(np.float32)
    lse = rng.standard_normal((2, 3)).astype(np.float32)
    empty_out = np.zeros_like(o)
    empty_lse = np.full_like(lse, -np.inf)
    out, merged_lse = fastattn.merge_attention([empty_out, o, empty_out], [empty_lse, lse, empty_lse])
    np.testing.assert_array_equal(out, o)
    np.testing.assert_array_equal(merged_lse, lse)


@pytest.mark.parametrize("where", [0, 2])
def test_sink_belongs_to_one_shard(rng, where):
    q, k, v = make_qkv(rng, (2, 4, 5, 16), (2, 2, 60, 16), (2, 2, 60, 16))
    sinks = np.array([0.5, -1.0, 2.0, -np.inf])
    bounds = [0, 20, 40, 60]
    parts = [fastattn.attention(q, k[..., a:b, :], v[..., a:b, :], return_lse=True,
                                sinks=sinks if n == where else None)
             for n, (a, b) in enumerate(zip(bounds[:-1], bounds[1:]))]
    out, lse = fastattn.merge_attention(*zip(*parts))
    full, full_lse = fastattn.attention(q, k, v, sinks=sinks, return_lse=True)
    assert_close(out, full)
    assert_close(lse, full_lse, scale=10.0)
    # The sink in every shard would count three times in the denominator.
    parts = [fastattn.attention(q, k[..., a:b, :], v[..., a:b, :], return_lse=True, sinks=sinks)
             for a, b in zip(bounds[:-1], bounds[1:])]
    wrong, _ = fastattn.merge_attention(*zip(*parts))
    assert not np.allclose(wrong[:, :3], full[:, :3], atol=1e-4)


def test_sink_with_causal_shards(rng):
    q, k, v = make_qkv(rng, (4, 6, 16), (4, 48, 16), (4, 48, 16))
    check_against_one_call(q, k, v, [0, 16, 32, 48], causal=True, sinks=np.array([1.0, 0.0, -2.0, 3.0]))


# --------------------------------------------------------------------------- dtypes

def test_float16_partials(rng):
    q, k, v = make_qkv(rng, (4, 3, 32), (4, 200, 32), (4, 200, 32), np.float16)
    out, lse = merged(q, k, v, [0, 50, 120, 200], causal=True)
    assert out.dtype == np.float16 and lse.dtype == np.float32
    expected = reference.attention(q.astype(np.float64), k.astype(np.float64),
                                   v.astype(np.float64), causal=True)
    # Two roundings to float16, half an ulp each: the partials' (weighted, the weights sum
    # to 1) and the result's; one ulp of a value of size ~1 is ~1e-3.
    rtol, atol = tolerance(np.float16)
    np.testing.assert_allclose(out.astype(np.float64), expected, rtol=2 * rtol, atol=2 * atol)


def test_bfloat16_partials(rng):
    ml_dtypes = import_optional("ml_dtypes")
    q, k, v = make_qkv(rng, (2, 3, 32), (2, 100, 32), (2, 100, 32))
    q, k, v = (a.astype(ml_dtypes.bfloat16) for a in (q, k, v))
    out, lse = merged(q, k, v, [0, 30, 100])
    assert out.dtype == ml_dtypes.bfloat16 and lse.dtype == np.float32
    expected = reference.attention(*(a.astype(np.float64) for a in (q, k, v)))
    rtol, atol = tolerance(out.dtype)
    np.testing.assert_allclose(out.astype(np.float64), expected, rtol=2 * rtol, atol=2 * atol)


# --------------------------------------------------------------------------- properties

def test_no_overflow_with_large_scores(rng):
    # Scores in the thousands: exp(lse) overflows float32 and even float64, the merge does not.
    q, k, v = make_qkv(rng, (2, 3, 8), (2, 50, 8), (2, 50, 8))
    check_against_one_call(q, k, v, [0, 25, 50], scale=300.0)
    out, lse = merged(q, k, v, [0, 25, 50], scale=300.0)
    assert np.all(np.isfinite(lse)) and lse.max() > 1000


def test_rows_merge_independently(rng):
    # A row's bits do not depend on the other rows merged with it (dask chunks the batch and
    # heads freely and must not change results).
    outs = [rng.standard_normal((6, 5, 16)).astype(np.float32) for _ in range(4)]
    lses = [rng.standard_normal((6, 5)).astype(np.float32) * 5 for _ in range(4)]
    lses[2][1] = -np.inf
    out, lse = fastattn.merge_attention(outs, lses)
    for h in range(6):
        o1, l1 = fastattn.merge_attention([o[h:h + 1, 2:] for o in outs], [x[h:h + 1, 2:] for x in lses])
        np.testing.assert_array_equal(o1, out[h:h + 1, 2:])
        np.testing.assert_array_equal(l1, lse[h:h + 1, 2:])


def test_stacked_arrays_and_tree_order(rng):
    q, k, v = make_qkv(rng, (3, 2, 16), (3, 80, 16), (3, 80, 16), np.float64)
    parts = [fastattn.attention(q, k[:, a:a + 20], v[:, a:a + 20], return_lse=True)
             for a in range(0, 80, 20)]
    outs, lses = [p[0] for p in parts], [p[1] for p in parts]
    flat = fastattn.merge_attention(outs, lses)
    stacked = fastattn.merge_attention(np.stack(outs), np.stack(lses))
    np.testing.assert_array_equal(stacked[0], flat[0])
    left = fastattn.merge_attention(outs[:2], lses[:2])
    right = fastattn.merge_attention(outs[2:], lses[2:])
    tree = fastattn.merge_attention([left[0], right[0]], [left[1], right[1]])
    np.testing.assert_allclose(tree[0], flat[0], rtol=1e-13, atol=1e-14)
    np.testing.assert_allclose(tree[1], flat[1], rtol=1e-13)


def test_single_partial_and_empty_shapes(rng):
    o = rng.standard_normal((3, 4)).astype(np.float32)     # (Lq, Dv): one head
    x = rng.standard_normal(3).astype(np.float32)
    out, lse = fastattn.merge_attention([o], [x])
    np.testing.assert_allclose(out, o, rtol=1e-6)
    np.testing.assert_allclose(lse, x, rtol=1e-6)
    out, lse = fastattn.merge_attention([np.zeros((2, 0, 5))] * 2, [np.zeros((2, 0))] * 2)
    assert out.shape == (2, 0, 5) and lse.shape == (2, 0)


def test_docstring_example():
    runner = doctest.DocTestRunner(optionflags=doctest.NORMALIZE_WHITESPACE)
    tests = doctest.DocTestFinder().find(_merge.merge_attention, "merge_attention",
                                         globs={"np": np, "fastattn": fastattn})
    assert tests and tests[0].examples
    for t in tests:
        runner.run(t)
    assert runner.failures == 0


# --------------------------------------------------------------------------- bad input

O32 = np.zeros((2, 3, 4), np.float32)
L32 = np.zeros((2, 3), np.float32)


@pytest.mark.parametrize("outs, lses, error, words", [
    ([], [], ValueError, "outs must hold at least one"),
    ([O32], [], ValueError, "lses must hold at least one"),
    ([O32, O32], [L32], ValueError, "same length"),
    ([O32, O32[:, :2]], [L32, L32], ValueError, "outs[1].shape=(2, 2, 4)"),
    ([O32, O32.astype(np.float64)], [L32, L32], TypeError, "outs[1].dtype=float64"),
    ([O32, O32], [L32, L32[:1]], ValueError, "lses[0].shape=(2, 3), lses[1].shape=(1, 3)"),
    ([O32, O32], [L32[:, :2]] * 2, ValueError, "lses must have shape out.shape[:-1] = (2, 3)"),
    ([O32, O32], [L32, L32.astype(np.float64)], TypeError, "lses[1].dtype=float64"),
    ([O32, O32], [L32.astype(np.float64)] * 2, TypeError, "lses must have dtype float32"),
    ([O32.astype(np.float16)] * 2, [L32.astype(np.float16)] * 2, TypeError, "float32"),
    ([O32.astype(np.int64)], [L32], TypeError, "outs[0].dtype"),
    ([np.float32(1)], [L32], ValueError, "0-d"),
    ([[[1.0]], [[1.0], [2.0]]], [L32, L32], ValueError, "outs[1].shape=(2, 1)"),
    (3, [L32], TypeError, "outs must be a sequence of arrays"),
])
def test_bad_input(outs, lses, error, words):
    with pytest.raises(error) as info:
        fastattn.merge_attention(outs, lses)
    assert words in str(info.value)
