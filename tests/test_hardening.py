"""Hardening: index arithmetic past 2**31, concurrency and the GIL, leaks, memory use.

* 2**31: keys and values of more than 2**31 rows cost nothing as zero-stride broadcasts
  (np.broadcast_to) or as sparse memory maps (only the pages written exist); the results
  have closed forms (all keys equal -> output = that value row, lse = log(n) + score) or
  come from the reference on the few rows that are visible.
* Threads: Python threads calling at once, with different shapes and thread settings,
  reproduce serial results bit for bit; the GIL is released during the kernel;
  set_num_threads from another thread does not disturb a running call.
* Leaks and memory: thousands of calls (lse, out=, masks, errors) leave tracemalloc and RSS
  flat (tools/leakcheck.py does 100,000); an 8192 x 8192 single-head attention needs only
  a few MiB beyond its inputs and output; a 32k-key decode is right.
"""

import gc
import math
import os
import sys
import tempfile
import threading
import time
import tracemalloc
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

import fastattn
from fastattn import reference as ref

from conftest import ROOT, run_python

BIG = 2 ** 31 + 7          # more rows than a signed 32-bit index can count


# --------------------------------------------------------------------------- past 2**31

def _equal_keys(Lk, D=2, Dv=3, dtype=np.float64):
    """k, v of Lk identical rows as zero-stride views (a few bytes of memory)."""
    krow = np.array([0.5, -0.25, 1.0, 2.0][:D], dtype)
    vrow = np.array([1.5, -3.0, 0.25, 8.0][:Dv], dtype)
    return np.broadcast_to(krow, (1, Lk, D)), np.broadcast_to(vrow, (1, Lk, Dv)), vrow


@pytest.mark.parametrize("Lq", [1, 3])
@pytest.mark.parametrize("kw, n_visible", [
    # (keyword arguments, number of keys row i sees as a function of i and Lq)
    (dict(window=(5, -1)), lambda i, Lq: Lq - i + 5),
    (dict(window=(40, 0), causal=True), lambda i, Lq: 41),
    (dict(kv_lengths=np.array(BIG - 3), window=(9, 0)), lambda i, Lq: 10),
    (dict(kv_lengths=np.array([BIG, 70, BIG - 1]), window=(64, 64)), None),
    (dict(causal="top-left", window=(-1, 2)), lambda i, Lq: i + 1),
])
def test_keys_past_2_31_closed_form(Lq, kw, n_visible):
    # Every key is the same row, so every visible key has the same score s and the output
    # is exactly that value row (sums of equal terms in float64 are exact), and
    # lse = s + log(number of visible keys): the count proves the key interval is right
    # at offsets past 2**31, and the time (milliseconds) that nothing scans all keys.
    k, v, vrow = _equal_keys(BIG)
    q = np.full((1, Lq, 2), 2.0)
    s = float(q[0, 0] @ k[0, 0])
    if "kv_lengths" in kw and kw["kv_lengths"].ndim == 1:   # a batch of 3 lengths
        q = np.broadcast_to(q, (3, *q.shape))
        k, v = k[None], v[None]
    out, lse = fastattn.attention(q, k, v, scale=1.0, return_lse=True, **kw)
    assert np.array_equal(out, np.broadcast_to(vrow, out.shape))
    if n_visible is None:     # per batch element: row i of Lq sees keys [L-Lq+i-64, L)
        lengths = kw["kv_lengths"]
        expect = np.array([[s + math.log(min(L, 64 + Lq - i)) for i in range(Lq)]
                           for L in lengths])[:, None, :]
    else:
        expect = np.array([[s + math.log(n_visible(i, Lq)) for i in range(Lq)]])
    np.testing.assert_allclose(lse, expect, rtol=1e-15, atol=0)


def test_distinct_rows_past_2_31_via_sparse_memmap():
    # Real element offsets past 2**31 (not zero strides): k, v, a bool mask and a float
    # mask are memory maps of sparse files of ~17 GB apparent size, of which only the last
    # rows are written (and exist on disk). A window makes the kernel read only those.
    n_tail = 130                       # more than two key blocks of 64
    with tempfile.TemporaryDirectory() as d:
        def mm(name, dtype, shape):
            return np.memmap(os.path.join(d, name), dtype=dtype, mode="w+", shape=shape)

        rng = np.random.default_rng(1)
        k = mm("k", np.float32, (2, BIG, 4))
        v = mm("v", np.float32, (2, BIG, 3))
        bmask = mm("b", np.bool_, (1, BIG))
        fmask = mm("f", np.float32, (1, BIG))
        k[:, -n_tail:] = rng.standard_normal((2, n_tail, 4))
        v[:, -n_tail:] = rng.standard_normal((2, n_tail, 3))
        bmask[:, -n_tail:] = rng.random((1, n_tail)) < 0.7
        fmask[:, -n_tail:] = rng.standard_normal((1, n_tail))
        q = rng.standard_normal((2, 5, 4)).astype(np.float32)
        tail = lambda a: np.array(a[..., -n_tail:, :] if a.ndim == 3 else a[:, -n_tail:])  # noqa: E731
        for kw in [dict(window=(100, -1)), dict(window=(120, 0), causal=True)]:
            for mask, tmask in [(None, None), (bmask, tail(bmask)), (fmask, tail(fmask))]:
                out, lse = fastattn.attention(q, k, v, mask=mask, return_lse=True, **kw)
                r_out, r_lse = ref.attention(q, tail(k), tail(v), mask=tmask,
                                             return_lse=True, **kw)
                np.testing.assert_allclose(out, r_out, rtol=1e-5, atol=2e-6)
                np.testing.assert_allclose(lse, r_lse, rtol=1e-5, atol=2e-6)
        del k, v, bmask, fmask


@pytest.mark.slow
def test_full_scan_of_2_31_keys():
    # Every one of 2**31 + 7 zero-stride keys visible: one work item scans them all
    # (about a minute on one core). float64 keeps the count exact: out = v row,
    # lse = s + log(Lk).
    k, v, vrow = _equal_keys(BIG)
    q = np.full((1, 2), 2.0)
    out, lse = fastattn.attention(q, k[0], v[0], scale=1.0, return_lse=True)
    assert np.array_equal(out, vrow[None])
    np.testing.assert_allclose(lse, [float(q[0] @ k[0, 0]) + math.log(BIG)], rtol=1e-15)


# --------------------------------------------------------------------------- threads

def _workload(seed):
    """A mix of calls: shapes, dtypes, GQA, masks, windows, kv_lengths, thread counts."""
    rng = np.random.default_rng(seed)
    calls = []
    for j, (b, Hq, Hkv, Lq, Lk, D, Dv, dtype) in enumerate([
        ((2,), 4, 2, 77, 300, 64, 32, np.float32),
        ((1,), 8, 1, 1, 1100, 64, 64, np.float64),
        ((3,), 3, 3, 129, 129, 5, 7, np.float32),
        ((2,), 2, 2, 200, 200, 128, 128, np.float16),
        ((), 1, 1, 96, 97, 33, 16, np.float64),
        ((2, 1), 6, 3, 40, 65, 16, 8, np.float32),
    ]):
        q = rng.standard_normal((*b, Hq, Lq, D)).astype(dtype)
        k = rng.standard_normal((*b, Hkv, Lk, D)).astype(dtype)
        v = rng.standard_normal((*b, Hkv, Lk, Dv)).astype(dtype)
        kw = [dict(causal=True), dict(window=(50, 3)), dict(mask=rng.random((Lq, Lk)) < 0.8),
              dict(kv_lengths=np.array(Lk // 2)), dict(causal="top-left"), {}][j]
        calls.append((q, k, v, kw, 1 + j % 3))
    return calls


def _run(call):
    q, k, v, kw, n = call
    with fastattn.num_threads(n):
        return fastattn.attention(q, k, v, return_lse=True, **kw)


def test_many_python_threads_match_serial():
    calls = _workload(0)
    serial = [_run(c) for c in calls]
    work = list(range(len(calls))) * 5
    np.random.default_rng(1).shuffle(work)
    with ThreadPoolExecutor(max_workers=8) as pool:
        results = list(pool.map(lambda i: (i, _run(calls[i])), work))
    for i, (out, lse) in results:
        assert out.tobytes() == serial[i][0].tobytes(), f"call {i}, concurrent vs serial"
        assert lse.tobytes() == serial[i][1].tobytes(), f"lse {i}, concurrent vs serial"


def test_set_num_threads_during_calls_in_other_threads():
    # The thread count is read once when a call starts: changing the process default
    # while other threads are inside the kernel changes neither their results nor
    # breaks anything.
    calls = _workload(2)
    serial = [fastattn.attention(q, k, v, return_lse=True, **kw) for q, k, v, kw, _ in calls]
    default = fastattn.get_num_threads()
    stop = threading.Event()

    def toggler():
        n = 0
        while not stop.is_set():
            fastattn.set_num_threads(1 + n % 4)
            n += 1
            time.sleep(0.0005)

    def worker(offset):
        bad = []
        for r in range(4):
            for i, (q, k, v, kw, _) in enumerate(calls):
                j = (i + offset + r) % len(calls)
                q, k, v, kw, _ = calls[j]
                out, lse = fastattn.attention(q, k, v, return_lse=True, **kw)
                if out.tobytes() != serial[j][0].tobytes() or lse.tobytes() != serial[j][1].tobytes():
                    bad.append(j)
        return bad

    t = threading.Thread(target=toggler)
    t.start()
    try:
        with ThreadPoolExecutor(max_workers=3) as pool:
            bad = sum(pool.map(worker, range(3)), [])
    finally:
        stop.set()
        t.join()
        fastattn.set_num_threads(default)
    assert not bad, f"calls {sorted(set(bad))} changed while set_num_threads was toggled"


def _gil_probe_call():
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((4, 1024, 64)).astype(np.float32) for _ in range(3))
    return lambda: fastattn.attention(q, k, v)


def test_gil_is_released():
    # While one thread is inside the kernel, another Python thread keeps running: the
    # longest pause it sees is far below the call's duration. (If the GIL were held, it
    # would see one pause as long as the call.) No timing ratio is asserted here.
    call = _gil_probe_call()
    with fastattn.num_threads(1):
        call()
        t0 = time.perf_counter()
        call()
        duration = time.perf_counter() - t0
        done = threading.Event()
        stamps = []

        def spin():
            while not done.is_set():
                stamps.append(time.perf_counter())

        spinner = threading.Thread(target=spin)
        spinner.start()
        time.sleep(0.01)
        start = time.perf_counter()
        call()
        end = time.perf_counter()
        done.set()
        spinner.join()
    inside = np.array([s for s in stamps if start <= s <= end])
    gaps = np.diff(np.concatenate([[start], inside, [end]]))
    assert gaps.max() < 0.5 * max(duration, end - start), (
        f"a Python thread was blocked for {gaps.max() * 1e3:.1f} ms of a "
        f"{(end - start) * 1e3:.1f} ms call: the GIL seems held")


# --------------------------------------------------------------------------- leaks

def _rss_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs /proc")
def test_no_leak_over_thousands_of_calls():
    # 5,000 calls of every kind (tools/leakcheck.py does 100,000 and reports): after a
    # warm-up, neither the Python heap (tracemalloc, NumPy's buffers included) nor the
    # RSS grows. Bounds are loose against allocator noise, tight against a leak: leaking
    # even one 16-byte object per call would show as 80 kB.
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    try:
        import leakcheck
    finally:
        sys.path.pop(0)
    step = leakcheck.make_step(np.random.default_rng(0))
    for i in range(500):
        step(i)
    gc.collect()
    tracemalloc.start()
    rss0 = _rss_bytes()
    snap0 = tracemalloc.take_snapshot()
    for i in range(5000):
        step(i)
    gc.collect()
    grown = sum(s.size_diff for s in tracemalloc.take_snapshot().compare_to(snap0, "filename"))
    tracemalloc.stop()
    rss_grown = _rss_bytes() - rss0
    assert grown < 64 * 1024, f"tracemalloc grew by {grown} bytes over 5000 calls"
    assert rss_grown < 8 * 2 ** 20, f"RSS grew by {rss_grown / 2**20:.1f} MiB over 5000 calls"


# --------------------------------------------------------------------------- memory

_PEAK_SCRIPT = r"""
import resource, sys, tracemalloc
import numpy as np
import fastattn
rng = np.random.default_rng(0)
q, k, v = (rng.standard_normal((8192, 64)).astype(np.float32) for _ in range(3))
out = np.empty((8192, 64), np.float32)
fastattn.attention(q[:96], k[:128], v[:128])          # load everything once
def status(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
for kw in ({}, {"out": out}, {"causal": True, "return_lse": True}):
    # Extra memory = this process's RSS high-water mark (VmHWM) after the call - RSS just
    # before it, with the mark reset to the current RSS first ("5" > clear_refs).  Not
    # ru_maxrss: after fork+exec it also holds the forking parent's peak (pytest's).
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = status("VmRSS")
    tracemalloc.start()
    res = fastattn.attention(q, k, v, **kw)
    cur, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    print(peak, max(0, status("VmHWM") - before))
    del res
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux /proc")
def test_peak_memory_8k_by_8k():
    # In a fresh interpreter (ru_maxrss is a lifetime peak): the 8192 x 8192 single-head
    # float32 call (D = 64) allocates its 2 MiB result and per-thread workspaces of tens
    # of KiB -- never an Lq x Lk matrix (256 MiB). Both tracemalloc's peak (NumPy and
    # PyMem allocations) and the growth of the RSS high-water mark over the RSS before the
    # call (which also sees C allocations and thread stacks) must stay under 48 MiB.
    proc = run_python("-c", _PEAK_SCRIPT, timeout=600)    # asserts exit status 0
    for line, what in zip(proc.stdout.split("\n"), ["plain", "out=", "causal+lse"]):
        traced, rss = map(int, line.split())
        print(f"{what}: tracemalloc peak {traced / 2**20:.2f} MiB, "
              f"peak RSS - RSS before {rss / 2**20:.2f} MiB")
        assert traced < 48 * 2 ** 20 and rss < 48 * 2 ** 20, (what, traced, rss)


def test_decode_against_32k_keys():
    rng = np.random.default_rng(4)
    Hq, Hkv, Lk, D = 8, 2, 32768, 128
    q = rng.standard_normal((Hq, 1, D)).astype(np.float32)
    k = rng.standard_normal((Hkv, Lk, D)).astype(np.float32)
    v = rng.standard_normal((Hkv, Lk, D)).astype(np.float32)
    out, lse = fastattn.attention(q, k, v, causal=True, return_lse=True)
    # float64 reference, one head at a time (the full reference would expand K per head).
    for h in range(Hq):
        kh = k[h // (Hq // Hkv)].astype(np.float64)
        s = kh @ q[h, 0].astype(np.float64) / math.sqrt(D)
        m = s.max()
        p = np.exp(s - m)
        expect = p @ v[h // (Hq // Hkv)].astype(np.float64) / p.sum()
        np.testing.assert_allclose(out[h, 0], expect, rtol=1e-4, atol=2e-6)
        np.testing.assert_allclose(lse[h, 0], m + math.log(p.sum()), rtol=1e-6)
    # The decode row is the last row of the causal prefill, bit for bit, on a slice.
    q_all = rng.standard_normal((Hq, 64, D)).astype(np.float32)
    q_all[:, -1] = q[:, 0]
    prefill = fastattn.attention(q_all, k, v, causal=True)
    assert prefill[:, -1:].tobytes() == out.tobytes()
