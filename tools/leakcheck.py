#!/usr/bin/env python
"""Leak check: many fastattn calls of every kind must leave memory flat.

    python tools/leakcheck.py [--calls 100000] [--report 10] [--tracemalloc]

Cycles through calls that exercise every path that allocates: the compiled fast path and
the Python front end, return_lse, out= (direct and through a temporary), bool and float
masks, windows, kv_lengths, float16 (casts), broadcast batches, attention_weights,
softmax, thread-count changes and calls that raise ValueError/TypeError. After a warm-up
it reports the process RSS and (with --tracemalloc, ~2x slower) the Python heap traced by
tracemalloc -- NumPy reports its data buffers there too -- at regular checkpoints, and
exits 1 if either grew by more than the thresholds over the run (a leak of one small
object per call shows up as several MB over 100,000 calls; allocator noise does not).

tests/test_hardening.py imports make_step() for a 5,000-call version.
"""
import argparse
import gc
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import fastattn  # noqa: E402


def make_step(rng):
    """A function step(i) doing call number i of a fixed cycle of call kinds."""
    f32 = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    q, k, v = f32(2, 4, 33, 16), f32(2, 2, 70, 16), f32(2, 2, 70, 8)
    q1, k1, v1 = f32(1, 64), f32(300, 64), f32(300, 64)
    q16, k16, v16 = (a.astype(np.float16) for a in (q, k, v))
    qd, kd, vd = (a.astype(np.float64) for a in (q, k, v))
    out = np.empty((2, 4, 33, 8), np.float32)
    out16 = np.empty((2, 4, 33, 8), np.float16)
    bmask = rng.random((33, 70)) < 0.7
    fmask = np.where(bmask, 0.0, -np.inf).astype(np.float32)
    lengths = np.array([70, 17])
    bad_out = np.empty((2, 4, 33, 9), np.float32)
    x = f32(5, 7)
    # more than 8 batch elements: batch offsets on the heap instead of the stack
    qb, kb, vb = f32(12, 2, 3, 16), f32(12, 1, 20, 16), f32(12, 1, 20, 8)
    lengths12 = np.arange(1, 13)
    cu = np.arange(0, 13 * 3, 3)

    def fail(fn, *a, **kw):
        try:
            fn(*a, **kw)
        except (ValueError, TypeError):
            return
        raise AssertionError("expected an error")

    kinds = [
        lambda: fastattn.attention(q, k, v),
        lambda: fastattn.attention(q, k, v, causal=True, return_lse=True),
        lambda: fastattn.attention(q, k, v, out=out),
        lambda: fastattn.attention(q16, k16, v16, out=out16, causal=True),
        lambda: fastattn.attention(q, k, v, mask=bmask, return_lse=True),
        lambda: fastattn.attention(q, k, v, mask=fmask, window=(20, 5)),
        lambda: fastattn.attention(qd, kd, vd, kv_lengths=lengths, causal=True),
        lambda: fastattn.attention(q[:1], k, v),                       # broadcast batch
        lambda: fastattn.attention(q1, k1, v1, causal=True, return_lse=True),
        lambda: fastattn.attention(q.tolist(), k, v),                  # list input
        lambda: fastattn.attention_weights(q, k, causal=True),
        lambda: fastattn.softmax(x, axis=0),
        lambda: fastattn.attention(qb, kb, vb),
        lambda: fastattn.attention(qb, kb, vb, kv_lengths=lengths12),
        lambda: fastattn.attention_varlen(q[0, :, :30], k[0, :, :30], v[0, :, :30],
                                          cu[:11], cu[:11]),
        lambda: fail(fastattn.attention, q, k, v, out=bad_out),
        lambda: fail(fastattn.attention, q, k, v, kv_lengths=np.array([99, 1])),
        lambda: fail(fastattn.attention, q, k[..., :5], v),
        lambda: fail(fastattn.attention, q.astype(complex), k, v),
        lambda: fail(fastattn.attention, q, k, v, window=(-3, 0)),
        lambda: fail(fastattn.attention, q, k, v, scale="x"),
        lambda: fail(fastattn.attention, [[1, 2], [3]], k, v),
    ]

    def step(i):
        kind = kinds[i % len(kinds)]
        if i % 97 == 0:
            with fastattn.num_threads(1 + (i // 97) % 2):
                kind()
        else:
            kind()

    return step


def rss_mib():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2 ** 20


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    ap.add_argument("--calls", type=int, default=100_000)
    ap.add_argument("--report", type=int, default=10, help="number of checkpoints")
    ap.add_argument("--tracemalloc", action="store_true", help="also trace the Python heap")
    ap.add_argument("--max-rss-growth", type=float, default=4.0, help="MiB")
    ap.add_argument("--max-traced-growth", type=float, default=0.25, help="MiB")
    args = ap.parse_args(argv)

    import tracemalloc
    step = make_step(np.random.default_rng(0))
    warm = min(2000, args.calls // 10)
    for i in range(warm):
        step(i)
    gc.collect()
    if args.tracemalloc:
        tracemalloc.start()
    rss0 = rss_mib()
    traced0 = tracemalloc.get_traced_memory()[0] / 2 ** 20 if args.tracemalloc else 0.0
    t0 = time.perf_counter()
    every = max(1, args.calls // args.report)
    print(f"{'calls':>9} {'seconds':>8} {'RSS MiB':>9} {'dRSS':>7} "
          + (f"{'traced MiB':>11} {'dtraced':>8}" if args.tracemalloc else ""))
    for i in range(warm, warm + args.calls):
        step(i)
        n = i - warm + 1
        if n % every == 0 or n == args.calls:
            gc.collect()
            rss = rss_mib()
            line = f"{n:>9} {time.perf_counter() - t0:>8.1f} {rss:>9.2f} {rss - rss0:>+7.2f} "
            if args.tracemalloc:
                traced = tracemalloc.get_traced_memory()[0] / 2 ** 20
                line += f"{traced:>11.3f} {traced - traced0:>+8.3f}"
            print(line, flush=True)
    rss_growth = rss_mib() - rss0
    traced_growth = (tracemalloc.get_traced_memory()[0] / 2 ** 20 - traced0
                     if args.tracemalloc else 0.0)
    ok = rss_growth <= args.max_rss_growth and traced_growth <= args.max_traced_growth
    print(f"{'OK' if ok else 'LEAK?'}: {args.calls} calls, RSS {rss_growth:+.2f} MiB "
          f"(limit {args.max_rss_growth}), traced {traced_growth:+.3f} MiB "
          f"(limit {args.max_traced_growth})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
