"""Bitwise reproducibility: a query row's result does not depend on how the work is cut.

The contract: for one build and machine, the result for one query row is bitwise identical
whatever the number of threads, the batch size, the other query rows in the call (Lq), and
whether it comes from one prefill call or from a decode step against the same keys. That is
what makes KV-cache decoding agree exactly with a causal prefill, so it is tested with
byte equality, never with a tolerance.

The home of these tests: the forward by threads, batch, rows, decode steps, Python threads
and workspaces; the score modifiers; packed sequences (each row the bits of its sequence
alone); the backward pass (gradients whatever the threads, batch, rows and layout); random
valid calls (the property tests' strategy); 16-bit storage.  Features with a test file of
their own keep the checks that need their set-up: bfloat16 products
(tests/test_bf16_products.py, on CPUs that have them), the serving caches
(tests/test_kvcache.py), the thread pool's own paths (tests/test_threads.py).
"""

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from hypothesis import given, strategies as st

import fastattn
from fastattn import reference

from conftest import HALVES, assert_close, make_qkv, qkv_shapes, run_python
# The random valid calls of the property tests.
from test_properties import budget, calls


def assert_bitwise(a, b, what=""):
    """Same dtype, same shape, same bytes (so -0.0 != 0.0 and NaN payloads count too)."""
    a, b = np.asarray(a), np.asarray(b)
    assert a.dtype == b.dtype and a.shape == b.shape, (what, a.dtype, b.dtype, a.shape, b.shape)
    if a.tobytes() != b.tobytes():
        diff = np.abs(a.astype(np.float64) - b.astype(np.float64))
        raise AssertionError(f"{what}: not bitwise equal; {np.count_nonzero(diff)} entries "
                             f"differ, max |diff| {np.nanmax(diff, initial=0):.3g}")


# (batch, Hq, Hkv, Lq, Lk, D, Dv): past a block, odd, GQA, MQA, and Lk > 1000.
SHAPES = [
    ((2,), 2, 2, 33, 33, 16, 16),
    ((1,), 4, 2, 77, 300, 64, 32),
    ((2,), 8, 1, 5, 1100, 64, 64),
    ((1,), 2, 2, 300, 1030, 128, 128),
    ((3,), 3, 1, 129, 129, 5, 7),
]
DTYPES = [np.float32, np.float64]


# --------------------------------------------------------------------------- threads

@pytest.mark.parametrize("dtype", DTYPES + [np.float16])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("causal", [False, True])
def test_thread_count(rng, shape, dtype, causal):
    q, k, v = make_qkv(rng, *qkv_shapes(*shape), dtype)
    results = []
    for n in (1, 2, 3):
        with fastattn.num_threads(n):
            results.append(fastattn.attention(q, k, v, causal=causal, return_lse=True))
    for n, (out, lse) in zip((2, 3), results[1:]):
        assert_bitwise(out, results[0][0], f"out, {n} threads vs 1")
        assert_bitwise(lse, results[0][1], f"lse, {n} threads vs 1")


# --------------------------------------------------------------------------- batch, rows

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True])
def test_batch_of_one_vs_three(rng, dtype, causal):
    q, k, v = make_qkv(rng, *qkv_shapes((3,), 4, 2, 65, 300, 32, 32), dtype)
    full = fastattn.attention(q, k, v, causal=causal)
    for b in range(3):
        alone = fastattn.attention(q[b:b + 1], k[b:b + 1], v[b:b + 1], causal=causal)
        assert_bitwise(alone, full[b:b + 1], f"batch element {b}")
        # ... and without the batch dim at all.
        assert_bitwise(fastattn.attention(q[b], k[b], v[b], causal=causal), full[b])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("window", [None, (40, 0)])
def test_single_row_vs_full_call(rng, shape, dtype, window):
    # With bottom-right causal alignment, row i of an (Lq, Lk) call sees keys
    # [0, Lk - Lq + i]: the same as a one-row call against those keys only.
    q, k, v = make_qkv(rng, *qkv_shapes(*shape), dtype)
    Lq, Lk = q.shape[-2], k.shape[-2]
    full, lse = fastattn.attention(q, k, v, causal=True, window=window, return_lse=True)
    for i in sorted({0, 1, Lq // 2, Lq - 2, Lq - 1} & set(range(Lq))):
        n = Lk - Lq + i + 1
        if n <= 0:
            continue
        row, row_lse = fastattn.attention(q[..., i:i + 1, :], k[..., :n, :], v[..., :n, :],
                                          causal=True, window=window, return_lse=True)
        assert_bitwise(row, full[..., i:i + 1, :], f"row {i}")
        assert_bitwise(row_lse, lse[..., i:i + 1], f"lse row {i}")
    # Without causal, a row against all keys equals that row of a non-causal call.
    nc = fastattn.attention(q, k, v, window=window)
    assert_bitwise(fastattn.attention(q[..., -1:, :], k, v, window=window), nc[..., -1:, :],
                   "non-causal row")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True])
def test_chunked_prefill(rng, dtype, causal):
    # The first rows computed as their own (shorter) call: other rows in the call (Lq)
    # do not change them.
    q, k, v = make_qkv(rng, *qkv_shapes((2,), 4, 2, 300, 300, 64, 64), dtype)
    full = fastattn.attention(q, k, v, causal=causal)
    for start, stop in [(0, 5), (0, 129), (5, 6), (100, 300), (257, 300)]:
        n = stop if causal else k.shape[-2]  # keys the chunk may see (bottom-right alignment)
        part = fastattn.attention(q[..., start:stop, :], k[..., :n, :], v[..., :n, :],
                                  causal=causal)
        assert_bitwise(part, full[..., start:stop, :], f"rows {start}:{stop}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_gqa_heads_alone(rng, dtype):
    # GQA may put the rows of several query heads in one tile; a head on its own agrees.
    q, k, v = make_qkv(rng, *qkv_shapes((2,), 8, 2, 1, 1100, 64, 64), dtype)
    full = fastattn.attention(q, k, v, causal=True)
    for h in range(8):
        g = h // 4
        alone = fastattn.attention(q[:, h:h + 1], k[:, g:g + 1], v[:, g:g + 1], causal=True)
        assert_bitwise(alone, full[:, h:h + 1], f"head {h}")


# --------------------------------------------------------------------------- decode

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("Hq, Hkv, L, D", [(2, 2, 70, 16), (8, 2, 300, 64), (4, 1, 1100, 32)])
def test_decode_steps_match_prefill(rng, dtype, Hq, Hkv, L, D):
    q, k, v = make_qkv(rng, (1, Hq, L, D), (1, Hkv, L, D), (1, Hkv, L, D), dtype)
    prefill, prefill_lse = fastattn.attention(q, k, v, causal=True, return_lse=True)
    steps = list(range(min(L, 40))) + list(range(max(L - 40, 40), L))
    for t in steps:
        # Decode step t: one new query against the cache of keys 0..t (Lq = 1).
        out, lse = fastattn.attention(q[..., t:t + 1, :], k[..., :t + 1, :], v[..., :t + 1, :],
                                      causal=True, return_lse=True)
        assert_bitwise(out, prefill[..., t:t + 1, :], f"decode step {t}")
        assert_bitwise(lse, prefill_lse[..., t:t + 1], f"decode lse {t}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group", [1, 2, 3, 5, 8, 12])
@pytest.mark.parametrize("D, Dv", [(128, 128), (100, 72), (24, 40)])
def test_decode_group_sizes_and_odd_dims(rng, dtype, group, D, Dv):
    # Decode tiles run their own kernels (keys as lanes in passes of 8/4/2/1 rows, 4-row
    # and whole-row output tiles, D and Dv not multiples of the vector width); every group
    # size and head dimension must still reproduce the prefill row bit for bit.
    L = 200
    q, k, v = make_qkv(rng, (1, 2 * group, L, D), (1, 2, L, D), (1, 2, L, Dv), dtype)
    prefill, prefill_lse = fastattn.attention(q, k, v, causal=True, return_lse=True)
    for t in (0, 1, 63, 64, 130, L - 1):
        out, lse = fastattn.attention(q[..., t:t + 1, :], k[..., :t + 1, :], v[..., :t + 1, :],
                                      causal=True, return_lse=True)
        assert_bitwise(out, prefill[..., t:t + 1, :], f"decode step {t}")
        assert_bitwise(lse, prefill_lse[..., t:t + 1], f"decode lse {t}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group", [1, 2, 3, 4, 6])
@pytest.mark.parametrize("layout", ["contiguous", "every_other_row", "reversed", "broadcast",
                                    "column_major"])
@pytest.mark.parametrize("D", [40, 64])
def test_decode_key_layouts(rng, dtype, group, layout, D):
    # The decode score kernel addresses a whole call of keys (32 in float32 on AVX2/SSE2)
    # by its first row and a stride when the rows are evenly spaced -- of either sign --
    # and by row pointers otherwise (partial calls, stride 0); groups of 3 to 6 query heads
    # take the 4-row kernel (with rows past the group not stored), and D = 64 rows of whole
    # cache lines its linear prefetch streams.  Every layout of K read in place gives the
    # bits of a prefill on a contiguous copy.
    L = 300
    q, _, v = make_qkv(rng, (1, 2 * group, L, D), (1, 2, L, D), (1, 2, L, D), dtype)
    base = rng.standard_normal((1, 2, 2 * L, D)).astype(dtype)
    if layout == "contiguous":
        k = base[:, :, :L, :]
    elif layout == "every_other_row":
        k = base[:, :, ::2, :]
    elif layout == "reversed":
        k = base[:, :, L - 1::-1, :]
    elif layout == "broadcast":
        k = np.broadcast_to(base[:, :, :1, :], (1, 2, L, D))
    else:
        k = np.ascontiguousarray(base[:, :, :L, :].transpose(0, 1, 3, 2)).transpose(0, 1, 3, 2)
    prefill = fastattn.attention(q, np.ascontiguousarray(k), v, causal=True)
    for t in (0, 31, 32, 95, 100, L - 1):
        out = fastattn.attention(q[..., t:t + 1, :], k[..., :t + 1, :], v[..., :t + 1, :],
                                 causal=True)
        assert_bitwise(out, prefill[..., t:t + 1, :], f"{layout} decode step {t}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_with_padded_cache(rng, dtype):
    # A preallocated cache of capacity 1100 with kv_lengths = t + 1 agrees with the sliced
    # cache and with the prefill: padding beyond kv_lengths is never read into the result.
    q, k, v = make_qkv(rng, (2, 4, 600, 32), (2, 2, 1100, 32), (2, 2, 1100, 32), dtype)
    k[..., 600:, :] = np.nan  # garbage in the unused part of the cache
    v[..., 600:, :] = np.nan
    prefill = fastattn.attention(q, k[..., :600, :], v[..., :600, :], causal=True)
    for t in (0, 1, 63, 64, 65, 299, 599):
        out = fastattn.attention(q[..., t:t + 1, :], k, v, causal=True,
                                 kv_lengths=np.array([t + 1, t + 1]))
        assert_bitwise(out, prefill[..., t:t + 1, :], f"padded decode step {t}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_masked_rows_alone(rng, dtype):
    q, k, v = make_qkv(rng, *qkv_shapes((2,), 2, 2, 40, 300, 16, 16), dtype)
    mask = rng.random((40, 300)) < 0.7
    full = fastattn.attention(q, k, v, mask=mask)
    for i in (0, 17, 39):
        row = fastattn.attention(q[..., i:i + 1, :], k, v, mask=mask[i:i + 1])
        assert_bitwise(row, full[..., i:i + 1, :], f"masked row {i}")


# --------------------------------------------------------------------------- Python threads

def test_concurrent_python_threads(rng):
    calls = []
    for shape, dtype, causal in [(SHAPES[1], np.float32, True), (SHAPES[2], np.float64, True),
                                 (SHAPES[3], np.float32, False), (SHAPES[4], np.float64, True),
                                 (SHAPES[0], np.float16, False), (SHAPES[2], np.float32, False)]:
        calls.append((*make_qkv(rng, *qkv_shapes(*shape), dtype), causal))

    def run(call):
        q, k, v, causal = call
        return fastattn.attention(q, k, v, causal=causal, return_lse=True)

    serial = [run(c) for c in calls]
    work = calls * 4  # every call several times, interleaved across the threads
    with ThreadPoolExecutor(max_workers=4) as pool:
        concurrent = list(pool.map(run, work))
    for i, (out, lse) in enumerate(concurrent):
        assert_bitwise(out, serial[i % len(calls)][0], f"concurrent call {i}")
        assert_bitwise(lse, serial[i % len(calls)][1], f"concurrent lse {i}")


def test_concurrent_threads_with_own_thread_counts(rng):
    # num_threads() is a thread-local override: threads using different counts at the
    # same time neither disturb each other's setting nor the results.
    q, k, v = make_qkv(rng, *qkv_shapes(*SHAPES[1]), np.float32)
    expected = fastattn.attention(q, k, v, causal=True)

    def run(n):
        with fastattn.num_threads(n):
            results = [fastattn.attention(q, k, v, causal=True) for _ in range(3)]
            return fastattn.get_num_threads(), results

    with ThreadPoolExecutor(max_workers=4) as pool:
        outcomes = list(pool.map(run, [1, 2, 1, 2, 3, 1]))
    for n, (seen, results) in zip([1, 2, 1, 2, 3, 1], outcomes):
        assert seen == n
        for r in results:
            assert_bitwise(r, expected, f"thread with num_threads({n})")


def test_omp_num_threads_environment(tmp_path):
    # The default thread count honours OMP_NUM_THREADS, and a process running on one
    # thread reproduces this process's result byte for byte.
    rng = np.random.default_rng(11)
    q, k, v = make_qkv(rng, *qkv_shapes(*SHAPES[3]), np.float32)
    np.save(tmp_path / "q.npy", q), np.save(tmp_path / "k.npy", k), np.save(tmp_path / "v.npy", v)
    expected = fastattn.attention(q, k, v, causal=True)
    script = (
        "import numpy as np, fastattn\n"
        "q, k, v = (np.load(n + '.npy') for n in 'qkv')\n"
        "print(fastattn.get_num_threads())\n"
        "np.save('out.npy', fastattn.attention(q, k, v, causal=True))\n"
    )
    proc = run_python("-c", script, env={"OMP_NUM_THREADS": "1"}, cwd=tmp_path)  # exit 0
    assert proc.stdout.split() == ["1"]
    assert_bitwise(np.load(tmp_path / "out.npy"), expected, "OMP_NUM_THREADS=1 process")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kwargs", [{}, {"causal": True}, {"window": (3000, 0)},
                                    {"kv_lengths": np.array([2500])}])
def test_flash_decoding_split_matches_one_thread_and_prefill(rng, dtype, kwargs):
    # One (batch, kv head) work item and 4100 keys (5 chunks of FA_KCHUNK = 1024): with
    # two threads the kernel splits the keys over threads and merges the chunk states
    # afterwards; with one thread it walks the chunks itself.  Both merge the same chunk
    # states in the same order, so the bits agree -- with each other and with the prefill.
    q, k, v = make_qkv(rng, (1, 4, 40, 64), (1, 1, 4100, 64), (1, 1, 4100, 48), dtype)
    with fastattn.num_threads(1):
        one, one_lse = fastattn.attention(q[..., -1:, :], k, v, return_lse=True, **kwargs)
        prefill, prefill_lse = fastattn.attention(q, k, v, return_lse=True, **kwargs)
    with fastattn.num_threads(2):
        split, split_lse = fastattn.attention(q[..., -1:, :], k, v, return_lse=True, **kwargs)
    assert_bitwise(split, one, "split vs one thread")
    assert_bitwise(split_lse, one_lse, "split lse vs one thread")
    assert_bitwise(one, prefill[..., -1:, :], "decode vs prefill")
    assert_bitwise(one_lse, prefill_lse[..., -1:], "decode lse vs prefill")
    ref = fastattn.reference.attention(q[..., -1:, :], k, v, **kwargs)
    np.testing.assert_allclose(split, ref, rtol=1e-4 if dtype == np.float32 else 1e-10,
                               atol=1e-5 if dtype == np.float32 else 1e-12)


# --------------------------------------------------------------------------- workspace

@pytest.mark.parametrize("dtype", DTYPES)
def test_results_do_not_depend_on_a_previous_call(rng, dtype):
    # A call's workspace block is reused by the next call, with whatever the last one left
    # in it: a call that leaves NaN and inf everywhere must not change the bits of the
    # calls after it (padding lanes, odd D and Dv, decode and prefill tiles, sinks).
    small = [((1,), 3, 1, 1, 40, 5, 7), ((1,), 6, 2, 2, 70, 16, 9), ((1,), 2, 2, 33, 65, 3, 3),
             ((1,), 1, 1, 6, 6, 3, 3)]
    calls = [(*make_qkv(rng, *qkv_shapes(*s), dtype), causal)
             for s in small for causal in (False, True)]
    sinks = {len(c[0][0]): rng.standard_normal(len(c[0][0])) for c in calls}

    def run(q, k, v, causal):
        return (fastattn.attention(q, k, v, causal=causal, return_lse=True),
                fastattn.attention(q, k, v, causal=causal, sinks=sinks[len(q[0])]))

    expected = [run(*c) for c in calls]
    q, k, v = make_qkv(rng, *qkv_shapes((1,), 8, 8, 96, 200, 128, 128), dtype)
    q[..., ::3, :] = np.nan
    k[..., 1::4, :] = np.inf
    v[..., ::5, :] = -np.inf
    for c, (exp_lse, exp_sink) in zip(calls, expected):
        with fastattn.num_threads(2):
            fastattn.attention(q, k, v)                 # poisons the workspace
        (out, lse), out_sink = run(*c)
        assert_bitwise(out, exp_lse[0], "after a NaN call: out")
        assert_bitwise(lse, exp_lse[1], "after a NaN call: lse")
        assert_bitwise(out_sink, exp_sink, "after a NaN call: sinks")


@pytest.mark.parametrize("batch", [(9,), (3, 4), (2, 2, 5)])
def test_batches_of_more_than_eight_match_single_calls(rng, batch):
    # Batch offsets of up to 8 elements live on the stack, larger batches on the heap:
    # both, through the lean path, the validated path (kv_lengths) and packed sequences.
    q, k, v = make_qkv(rng, (*batch, 2, 7, 16), (*batch, 1, 40, 16), (*batch, 1, 40, 8))
    lens = rng.integers(1, 41, size=batch)
    lean = fastattn.attention(q, k, v, causal=True)
    masked = fastattn.attention(q, k, v, kv_lengths=lens)
    for idx in np.ndindex(*batch):
        assert_bitwise(lean[idx], fastattn.attention(q[idx], k[idx], v[idx], causal=True),
                       f"lean path, element {idx}")
        n = lens[idx]
        assert_bitwise(masked[idx], fastattn.attention(q[idx], k[idx][:, :n], v[idx][:, :n]),
                       f"kv_lengths, element {idx}")
    seq_q = [int(x) for x in rng.integers(1, 9, size=int(np.prod(batch)))]
    seq_k = [int(x) for x in rng.integers(1, 30, size=len(seq_q))]
    cu_q, cu_k = np.cumsum([0] + seq_q), np.cumsum([0] + seq_k)
    qp, kp, vp = make_qkv(rng, (2, cu_q[-1], 16), (1, cu_k[-1], 16), (1, cu_k[-1], 8))
    packed = fastattn.attention_varlen(qp, kp, vp, cu_q, cu_k)
    for s in range(len(seq_q)):
        alone = fastattn.attention(qp[:, cu_q[s]:cu_q[s + 1]], kp[:, cu_k[s]:cu_k[s + 1]],
                                   vp[:, cu_k[s]:cu_k[s + 1]])
        assert_bitwise(packed[:, cu_q[s]:cu_q[s + 1]], alone, f"packed sequence {s}")


# ---------------------------------------------------------------------- score modifiers


@pytest.mark.parametrize("dtype", DTYPES)
def test_score_modifiers_bits_independent_of_threads_lq_and_decode(rng, dtype):
    # Every variant at once; each row of a prefill call equals the same row computed alone
    # as a decode step, and the result does not depend on the thread count.
    Hq, Hkv, L, D = 8, 2, 150, 48
    q, k, v = make_qkv(rng, *qkv_shapes((1,), Hq, Hkv, L, L, D), dtype)
    kw = dict(softcap=3.0, alibi_slopes=2.0 ** -np.arange(1, Hq + 1),
              sinks=rng.standard_normal(Hq), causal=True)
    with fastattn.num_threads(1):
        full, lse = fastattn.attention(q, k, v, return_lse=True, **kw)
    with fastattn.num_threads(2):
        full2, lse2 = fastattn.attention(q, k, v, return_lse=True, **kw)
    np.testing.assert_array_equal(full, full2)
    np.testing.assert_array_equal(lse, lse2)
    for i in (0, 63, 64, 149):
        step, step_lse = fastattn.attention(q[:, :, i:i + 1], k[:, :, :i + 1], v[:, :, :i + 1],
                                            return_lse=True, **kw)
        np.testing.assert_array_equal(step[:, :, 0], full[:, :, i])
        np.testing.assert_array_equal(step_lse[:, :, 0], lse[:, :, i])


@pytest.mark.parametrize("dtype", DTYPES)
def test_q_lengths_padding_does_not_change_bits(rng, dtype):
    # A right-padded batch gives each real row the bits of the unpadded call.
    q, k, v = make_qkv(rng, *qkv_shapes((3,), 4, 4, 20, 33, 16), dtype)
    q_len, kv_len = np.array([20, 5, 13]), np.array([33, 9, 20])
    kw = dict(causal=True, alibi_slopes=[0.5, 0.25, 0.125, 0.0625], softcap=5.0)
    out = fastattn.attention(q, k, v, q_lengths=q_len, kv_lengths=kv_len, **kw)
    for b in range(3):
        alone = fastattn.attention(q[b, :, :q_len[b]], k[b, :, :kv_len[b]],
                                   v[b, :, :kv_len[b]], **kw)
        np.testing.assert_array_equal(out[b, :, :q_len[b]], alone)


# --------------------------------------------------------------------- packed sequences


def _packed(rng, lens_q, lens_k, Hq, Hkv, D, dtype):
    q = rng.standard_normal((Hq, sum(lens_q), D)).astype(dtype)
    k = rng.standard_normal((Hkv, sum(lens_k), D)).astype(dtype)
    v = rng.standard_normal((Hkv, sum(lens_k), D + 3)).astype(dtype)
    return q, k, v, np.cumsum([0] + lens_q), np.cumsum([0] + lens_k)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kw", [dict(), dict(causal=True), dict(window=(5, 0)),
                                dict(causal=True, softcap=2.0, alibi_slopes="slopes",
                                     sinks="sinks")], ids=["plain", "causal", "window", "all"])
@pytest.mark.parametrize("threads", [1, 2])
def test_varlen_rows_equal_separate_calls(rng, dtype, kw, threads):
    # Lengths that put sequence ends inside tiles and key blocks, an empty sequence, a
    # single-row one (a decode tile) and more keys than queries.
    lens_q, lens_k = [70, 0, 1, 130, 9], [70, 4, 300, 130, 20]
    Hq, Hkv = 4, 2
    q, k, v, cu_q, cu_k = _packed(rng, lens_q, lens_k, Hq, Hkv, 24, dtype)
    kw = dict(kw)
    if kw.get("alibi_slopes") == "slopes":
        kw["alibi_slopes"] = 2.0 ** -np.arange(1, Hq + 1)
    if kw.get("sinks") == "sinks":
        kw["sinks"] = rng.standard_normal(Hq)
    with fastattn.num_threads(threads):
        out, lse = fastattn.attention_varlen(q, k, v, cu_q, cu_k, return_lse=True, **kw)
    for s in range(len(lens_q)):
        rq, rk = slice(cu_q[s], cu_q[s + 1]), slice(cu_k[s], cu_k[s + 1])
        alone, alone_lse = fastattn.attention(q[:, rq], k[:, rk], v[:, rk], return_lse=True, **kw)
        np.testing.assert_array_equal(out[:, rq], alone)
        np.testing.assert_array_equal(lse[:, rq], alone_lse)
    ref = reference.attention_varlen(q, k, v, cu_q, cu_k, **kw)
    assert_close(out, ref)


# -------------------------------------------------------------------- the backward pass


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
def test_backward_bitwise_across_threads_and_repeats(dtype, kw):
    args, kw = _problem(np.random.default_rng(0), dtype=dtype, **kw)
    with fastattn.num_threads(1):
        one = fastattn.attention_backward(*args, **kw)
    for n in (2, 3, 4):
        with fastattn.num_threads(n):
            assert _same(fastattn.attention_backward(*args, **kw), one)
    assert _same(fastattn.attention_backward(*args, **kw), one)


@pytest.mark.parametrize("kw", KEYWORDS[:2], ids=["causal", "window+modifiers"])
def test_backward_bitwise_with_few_kv_heads(kw):
    # One kv head shared by 4 query heads: one thread takes the whole head in one work
    # item, more threads split its keys and rows into separate passes; the same bits.
    args, kw = _problem(np.random.default_rng(5), B=1, Hkv=1, Lq=300, Lk=333, **kw)
    with fastattn.num_threads(1):
        one = fastattn.attention_backward(*args, **kw)
    for n in (2, 3):
        with fastattn.num_threads(n):
            assert _same(fastattn.attention_backward(*args, **kw), one)


@pytest.mark.parametrize("kw", KEYWORDS[:2], ids=["causal", "window+modifiers"])
def test_backward_bitwise_across_batch_sizes(kw):
    # each batch element alone gets the bits it gets in the batch
    args, kw = _problem(np.random.default_rng(1), **kw)
    whole = fastattn.attention_backward(*args, **kw)
    for b in range(3):
        part = fastattn.attention_backward(*(a[b:b + 1] for a in args),
                                           **dict(kw, dlse=kw["dlse"][b:b + 1]))
        assert _same(part, [g[b:b + 1] for g in whole])


def test_backward_bitwise_across_query_rows_and_gqa_layout():
    # a decode row's dq has the bits of the same row in a prefill call
    args, kw = _problem(np.random.default_rng(2), B=1, Lq=120, Lk=120, causal=True)
    dout, q, k, v, out, lse = args
    dq = fastattn.attention_backward(*args, **kw)[0]
    last = [a[..., -1:, :] for a in (dout, q)] + [k, v, out[..., -1:, :], lse[..., -1:]]
    dq1 = fastattn.attention_backward(*last, causal=True, dlse=kw["dlse"][..., -1:])[0]
    assert np.array_equal(dq1, dq[..., -1:, :])


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_backward_varlen_rows_equal_separate_calls(dtype, threads):
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


def test_backward_strided_inputs_give_the_bits_of_contiguous_ones():
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


# ------------------------------------------------------------------------- random calls



def _broadcast_batch(a, batch):
    return np.broadcast_to(a, batch + a.shape[-3:])


@budget(1)
@given(calls(dtypes=(np.float32, np.float64, np.float16)), st.data())
def test_bits_independent_of_threads_batch_and_rows(case, data):
    q, k, v, kw, info = case
    with fastattn.num_threads(1):
        out1, lse1 = fastattn.attention(q, k, v, return_lse=True, **kw)
    n = data.draw(st.integers(2, 4))
    with fastattn.num_threads(n):
        outn, lsen = fastattn.attention(q, k, v, return_lse=True, **kw)
    assert out1.tobytes() == outn.tobytes() and lse1.tobytes() == lsen.tobytes(), \
        f"1 vs {n} threads"
    if q.ndim == 2 or out1.size == 0:
        return
    # One batch element alone (everything batch-shaped sliced along with it).
    batch = out1.shape[:-3]
    if batch:
        b = tuple(data.draw(st.integers(0, n - 1)) for n in batch)
        sub = lambda a: _broadcast_batch(a, batch)[b][None]   # noqa: E731
        kw1 = dict(kw)
        if "kv_lengths" in kw:
            kw1["kv_lengths"] = np.broadcast_to(kw["kv_lengths"], batch)[b][None]
        if kw.get("mask") is not None:
            full = (*batch, *out1.shape[-3:-1], k.shape[-2])
            kw1["mask"] = np.broadcast_to(kw["mask"], full)[b][None]
        o, l = fastattn.attention(sub(q), sub(k), sub(v), return_lse=True, **kw1)
        assert o[0].tobytes() == out1[b].tobytes() and l[0].tobytes() == lse1[b].tobytes(), \
            f"batch element {b} alone"
    # One query row alone, against the keys it may see (bottom-right alignment moves
    # with Lq, so the key set is cut to keep the same visible keys).
    if "window" in kw or "kv_lengths" in kw:
        return
    Lq, Lk = q.shape[-2], k.shape[-2]
    i = data.draw(st.integers(0, Lq - 1))
    causal = kw.get("causal", False)
    if causal in (True, "bottom-right"):
        n_keys = max(0, min(Lk, i + Lk - Lq + 1))
    elif causal == "top-left":
        n_keys = min(Lk, i + 1)
    else:
        n_keys = Lk
    kw1 = dict(kw)
    kw1.pop("causal", None)   # the cut key set is exactly what the row sees
    if kw.get("mask") is not None:
        full = (*batch, *out1.shape[-3:-1], Lk)
        kw1["mask"] = np.broadcast_to(kw["mask"], full)[..., i:i + 1, :n_keys]
    o, l = fastattn.attention(q[..., i:i + 1, :], k[..., :n_keys, :], v[..., :n_keys, :],
                              return_lse=True, **kw1)
    assert o.tobytes() == out1[..., i:i + 1, :].tobytes(), f"row {i} alone"
    assert l.tobytes() == lse1[..., i:i + 1].tobytes(), f"lse of row {i} alone"


# ----------------------------------------------------------------------- 16-bit storage


@pytest.mark.parametrize("kvdt", HALVES)
def test_reproducible_for_16_bit_storage(rng, kvdt):
    # Threads, batch, Lq, and decode against prefill, as for float32.
    q, k, v = make_qkv(rng, *qkv_shapes((3,), 8, 2, 150, 150, 64, 32), kvdt, kvdt)
    with fastattn.num_threads(1):
        one = fastattn.attention(q, k, v, causal=True)
    with fastattn.num_threads(2):
        two = fastattn.attention(q, k, v, causal=True)
    assert one.tobytes() == two.tobytes()
    assert fastattn.attention(q[1], k[1], v[1], causal=True).tobytes() == one[1].tobytes()
    rows = fastattn.attention(q[..., 100:140, :], k[..., :140, :], v[..., :140, :], causal=True)
    assert rows.tobytes() == one[..., 100:140, :].tobytes()
    for i in (0, 63, 64, 96, 149):
        step = fastattn.attention(q[..., i:i + 1, :], k[..., :i + 1, :], v[..., :i + 1, :])
        assert step.tobytes() == one[..., i:i + 1, :].tobytes(), i
