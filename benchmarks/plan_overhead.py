"""What a serving call costs beyond its kernel: ``plan.run``, ``attention_with_kvcache`` and
``attention`` over the same keys, on one small decode step, alternating in one process.

    python benchmarks/plan_overhead.py [--rounds 15] [--threads 2]

The step: B 1, Hq 8, Hkv 2, 128 cached keys, D 64, float32 q.  Rows: no append over a
float32 cache, a one-token append to a float32 cache, a one-token append to a q8_0 cache.
``attention`` runs over the same keys (a view of the contiguous cache) without appending,
the floor a serving call can reach.  Each figure is the median over rounds of the mean of a
batch of calls; the rounds alternate the calls, so a drift of the machine hits all alike.
Name the CPU with the figures, and keep the machine quiet.
"""
import argparse
import statistics
import time

import numpy as np

import fastattn


def timed(fn, n):
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n


def calls(dtype, append, rng):
    B, Hq, Hkv, L, D = 1, 8, 2, 128, 64
    q = rng.standard_normal((B, Hq, 1, D)).astype(np.float32)
    k, v = (rng.standard_normal((B, Hkv, 1, D)).astype(np.float32) for _ in range(2))
    x = rng.standard_normal((B, Hkv, L + 1, D)).astype(np.float32)
    if dtype == "q8_0":
        (kc, ks), (vc, vs) = fastattn.quantize_q8_0(x), fastattn.quantize_q8_0(x[::-1].copy())
        caches = dict(k_cache=kc, v_cache=vc, k_scale=ks, v_scale=vs)
    else:
        caches = dict(k_cache=x.copy(), v_cache=x[::-1].copy())
    new = dict(k=k, v=v) if append else {}
    seqlens = L - 1 if append else L       # the append fills row L - 1 each time
    keys, values = x[:, :, :L], x[:, :, :L][::-1].copy()
    fns = {}
    if hasattr(fastattn, "plan_kvcache"):        # (a build before plans times the rest)
        plan = fastattn.plan_kvcache(cache_seqlens=seqlens)
        fns["plan.run"] = lambda: plan.run(q, caches["k_cache"], caches["v_cache"], **new,
                                           k_scale=caches.get("k_scale"),
                                           v_scale=caches.get("v_scale"))
    return fns | {
        "attention_with_kvcache": lambda: fastattn.attention_with_kvcache(
            q, **caches, **new, cache_seqlens=seqlens),
        "attention": lambda: fastattn.attention(q, keys, values),
    }


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    fastattn.set_num_threads(args.threads)
    print(f"fastattn from {fastattn.__file__}, {args.threads} threads")
    rng = np.random.default_rng(0)
    rows = [("float32, no append", np.float32, False), ("float32, 1-token append", np.float32, True),
            ("q8_0, 1-token append", "q8_0", True)]
    print(f"{'row':26s} {'plan.run':>10s} {'with_kvcache':>13s} {'attention':>10s} "
          f"{'run/attn':>9s}")
    for name, dtype, append in rows:
        fns = calls(dtype, append, rng)
        times = {n: [] for n in fns}
        for n, fn in fns.items():          # warm up
            timed(fn, 100)
        for _ in range(args.rounds):
            for n, fn in fns.items():
                times[n].append(timed(fn, args.calls))
        med = {n: statistics.median(t) * 1e6 for n, t in times.items()}
        run = med.get("plan.run", float("nan"))
        print(f"{name:26s} {run:8.2f}us {med['attention_with_kvcache']:11.2f}us "
              f"{med['attention']:8.2f}us {run / med['attention']:8.2f}x")


if __name__ == "__main__":
    main()
