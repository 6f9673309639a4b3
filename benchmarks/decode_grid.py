"""A decode step over pages against the same step over contiguous caches, on a grid of
batch sizes and sequence lengths: what a busy server's step costs in each layout.

    python benchmarks/decode_grid.py [--grid 1x4096,8x1024,64x64,64x256,64x1024,256x128]
        [--types float16,q8_0] [--page 16] [--heads 32] [--kv-heads 8] [--d 128]
        [--rounds 11] [--threads N] [--plot FILE.png] [--json FILE.json]
        [--against OLD_DIR]

For each point B x keys and each cache type, the same keys and values are stored twice:
contiguous, ``(B, Hkv, keys, D)``, and in a pool of pages whose order follows no sequence
(a shuffled block table, as a busy server's).  One :func:`fastattn.plan_kvcache` per layout
(made once, as a server makes one per step) and ``plan.run`` over each, the two taking
turns round by round; every sample repeats the call until it lasts a few milliseconds.
The report gives each layout's time, the bytes of K and V (and their scales) read per
step as GB/s, that rate as a share of the read roof, the ratio contiguous / paged (1.0:
pages cost nothing) and whether both gave the same bits (they must).

The read roof is measured in the same run, before the grid: a float32 matrix-vector
product streaming 512 MiB with all BLAS threads (as ``python -m fastattn bench`` does).
Small points fit in the last-level cache, so their share can pass 1.  The "bg load"
column is the share of the CPUs other processes used meanwhile: a figure taken beside
other work is not the machine's.  ``FASTATTN_ISA=avx2`` runs the AVX2 build.

``--against OLD_DIR`` times another build of fastattn (a directory holding an importable
``fastattn`` package) in the same process, as tools/ab_inproc.py does: the four calls
(old and new, contiguous and paged) take turns, and each sample is the fastest of the
rounds, so that a loaded machine's slow phases fall on both builds alike.  The report then
gives each build's ratio contiguous / paged and the new build's time / the old one's.
Two builds in one process are not placed alike (the old one is imported under another
name, and the calls take turns in a fixed cycle), so a difference of several percent can
be the placement alone: confirm one under about 10% in separate processes that
alternate, against a fresh build of the commit before.
"""
import argparse
import json
import os
import statistics
import sys
import time

import numpy as np

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
if "--against" in sys.argv:
    # the old build first, renamed fastattn_old, then this checkout's (or PYTHONPATH's)
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    from ab_inproc import _load_both
    _old_dir = sys.argv[sys.argv.index("--against") + 1]
    old_fa, _ = _load_both(_old_dir, os.environ.get("PYTHONPATH", ROOT).split(os.pathsep)[0])
else:
    old_fa = None

import fastattn  # noqa: E402

sys.path.insert(0, ROOT)
from fastattn._machine.isa import ISA  # noqa: E402
from fastattn.cli.bench.harness import OtherLoad  # noqa: E402
from fastattn.cli.bench.machine import cpu_name, measure_read_bandwidth  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from paged_caches import paged, store  # noqa: E402

GRID = "1x4096,8x1024,64x64,64x256,64x1024,256x128"
TYPES = ("float32", "float16", "bfloat16", "q8_0", "q4_0", "fp8", "fp8_e5m2")


def point_inputs(rng, B, L, Hq, Hkv, D, page):
    """One grid point's decode step: ``L`` rounded up to whole pages, k and v ``(B, Hkv, L,
    D)``, q ``(B, Hq, 1, D)``, every sequence's length, and a shuffled block table."""
    L = -(-L // page) * page
    k = rng.standard_normal((B, Hkv, L, D)).astype(np.float32)
    v = rng.standard_normal((B, Hkv, L, D)).astype(np.float32)
    q = rng.standard_normal((B, Hq, 1, D)).astype(np.float32)
    seqlens = np.full(B, L, np.int32)
    table = rng.permutation(B * (L // page)).astype(np.int32).reshape(B, L // page)
    return L, k, v, q, seqlens, table


def step_bytes(cache, B, L):
    """Bytes of K and V (and block scales) one step reads: every row of the contiguous
    cache (each sequence attends over all its L keys)."""
    return sum(a.nbytes for a in cache.values() if a.ndim == 4)


def repeats_for(call, target_s=0.004):
    t = time.perf_counter()
    call()
    dt = max(time.perf_counter() - t, 1e-6)
    return max(1, int(target_s / dt))


def time_fastest(calls, rounds):
    """Fastest seconds per call of each call over the rounds, the calls taking turns."""
    n = min(repeats_for(c, 0.0015) for c in calls)
    best = [float("inf")] * len(calls)
    for r in range(rounds):
        order = range(len(calls)) if r % 2 == 0 else reversed(range(len(calls)))
        for i in order:
            t = time.perf_counter()
            for _ in range(n):
                calls[i]()
            best[i] = min(best[i], (time.perf_counter() - t) / n)
    return best


def time_alternating(calls, rounds):
    """Median seconds per call of each call, the calls taking turns (the first of a round
    alternates), each sample ``n`` calls in a row."""
    n = min(repeats_for(c) for c in calls)
    samples = [[] for _ in calls]
    for r in range(rounds):
        order = range(len(calls)) if r % 2 == 0 else reversed(range(len(calls)))
        for i in order:
            t = time.perf_counter()
            for _ in range(n):
                calls[i]()
            samples[i].append((time.perf_counter() - t) / n)
    return [statistics.median(s) for s in samples]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--grid", default=GRID, help="points B x keys, comma-separated")
    ap.add_argument("--types", default="float16,q8_0")
    ap.add_argument("--page", type=int, default=16)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=11)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--plot", metavar="FILE.png")
    ap.add_argument("--json", metavar="FILE.json")
    ap.add_argument("--against", metavar="OLD_DIR",
                    help="time the fastattn package in OLD_DIR beside this one, in one process")
    args = ap.parse_args(argv)
    names = [t for t in args.types.split(",") if t]
    unknown = sorted(set(names) - set(TYPES))
    if unknown:
        ap.error(f"unknown cache type(s) {', '.join(unknown)}; choose from {', '.join(TYPES)}")
    points = [tuple(int(x) for x in p.split("x")) for p in args.grid.split(",") if p]
    if args.threads:
        fastattn.set_num_threads(args.threads)
        if old_fa is not None:
            old_fa.set_num_threads(args.threads)
    if old_fa is not None:
        return against(args, names, points)
    rng = np.random.default_rng(args.seed)
    Hq, Hkv, D, page = args.heads, args.kv_heads, args.d, args.page

    load = OtherLoad()
    roof = measure_read_bandwidth()
    busy = load.fraction()
    print(f"{cpu_name()}, fastattn {ISA} build, {fastattn.get_num_threads()} threads; "
          f"Hq {Hq}, Hkv {Hkv}, D {D}, page {page} (pages shuffled)")
    print(f"read roof (sgemv over 512 MiB): {roof:.1f} GB/s"
          f" (bg load {100 * busy[0]:.0f}%)" if busy else "")
    print(f"{'B x keys':>10} {'cache':>9} {'contig':>9} {'paged':>9} {'GB/s c':>7} {'GB/s p':>7}"
          f" {'roof c':>7} {'roof p':>7} {'c/p':>6} {'same':>5} {'bg load':>8}")
    rows = []
    for B, L in points:
        L, k, v, q, seqlens, table = point_inputs(rng, B, L, Hq, Hkv, D, page)
        plans = (fastattn.plan_kvcache(cache_seqlens=seqlens),
                 fastattn.plan_kvcache(cache_seqlens=seqlens, block_table=table))
        for name in names:
            contiguous = store(name, k, v)
            pool = paged(contiguous, table, page)
            nbytes = step_bytes(contiguous, B, L)
            outs = [np.empty((B, Hq, 1, D), np.float32) for _ in range(2)]
            calls = [lambda c=c, p=p, o=o: p.run(q, **c, out=o)
                     for c, p, o in zip((contiguous, pool), plans, outs)]
            for call in calls:
                call()
            load = OtherLoad()
            t_c, t_p = time_alternating(calls, args.rounds)
            busy = load.fraction()
            same = bool(np.array_equal(outs[0], outs[1]))
            gc, gp = nbytes / t_c / 1e9, nbytes / t_p / 1e9
            bg = f"{100 * busy[0]:.0f}%" if busy else "?"
            print(f"{B:>4} x {L:<4} {name:>9} {t_c * 1e3:7.3f}ms {t_p * 1e3:7.3f}ms"
                  f" {gc:7.1f} {gp:7.1f} {gc / roof:7.2f} {gp / roof:7.2f} {t_c / t_p:6.2f}"
                  f" {str(same):>5} {bg:>8}", flush=True)
            rows.append(dict(B=B, keys=L, cache=name, contiguous_s=t_c, paged_s=t_p,
                             bytes=nbytes, gbs_contiguous=gc, gbs_paged=gp, roof_gbs=roof,
                             same_bits=same, bg_load=busy[0] if busy else None))
            del contiguous, pool
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(cpu=cpu_name(), isa=ISA, threads=fastattn.get_num_threads(),
                           page=page, rows=rows), f, indent=1)
    if args.plot:
        plot(rows, roof, args, names)
    return 0


def against(args, names, points):
    """--against: the old build and this one, in turns, per point and cache type."""
    rng = np.random.default_rng(args.seed)
    Hq, Hkv, D, page = args.heads, args.kv_heads, args.d, args.page
    print(f"{cpu_name()}, {ISA} builds, {fastattn.get_num_threads()} threads; Hq {Hq}, "
          f"Hkv {Hkv}, D {D}, page {page} (pages shuffled); old: {args.against}; fastest of "
          f"{args.rounds} rounds")
    print(f"{'B x keys':>10} {'cache':>9} {'old c/p':>8} {'new c/p':>8} {'new/old c':>10}"
          f" {'new/old p':>10} {'GB/s c':>7} {'GB/s p':>7} {'same':>5} {'bg load':>8}")
    for B, L in points:
        L, k, v, q, seqlens, table = point_inputs(rng, B, L, Hq, Hkv, D, page)
        for name in names:
            contiguous = store(name, k, v)
            pool = paged(contiguous, table, page)
            outs = [np.empty((B, Hq, 1, D), np.float32) for _ in range(4)]
            calls = []
            for fa in (old_fa, fastattn):
                plans = (fa.plan_kvcache(cache_seqlens=seqlens),
                         fa.plan_kvcache(cache_seqlens=seqlens, block_table=table))
                for c, p in zip((contiguous, pool), plans):
                    calls.append(lambda c=c, p=p, o=outs[len(calls)]: p.run(q, **c, out=o))
            for call in calls:
                call()
            load = OtherLoad()
            oc, op, nc, np_ = time_fastest(calls, args.rounds)
            busy = load.fraction()
            same = all(np.array_equal(outs[0], o) for o in outs[1:])
            nbytes = step_bytes(contiguous, B, L)
            bg = f"{100 * busy[0]:.0f}%" if busy else "?"
            print(f"{B:>4} x {L:<4} {name:>9} {oc / op:8.2f} {nc / np_:8.2f} {nc / oc:10.2f}"
                  f" {np_ / op:10.2f} {nbytes / nc / 1e9:7.1f} {nbytes / np_ / 1e9:7.1f}"
                  f" {str(same):>5} {bg:>8}", flush=True)
            del contiguous, pool
    return 0


def plot(rows, roof, args, names):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(names), figsize=(5 * len(names), 3.6), squeeze=False)
    for ax, name in zip(axes[0], names):
        sel = [r for r in rows if r["cache"] == name]
        x = np.arange(len(sel))
        ax.bar(x - 0.2, [r["gbs_contiguous"] for r in sel], 0.4, label="contiguous")
        ax.bar(x + 0.2, [r["gbs_paged"] for r in sel], 0.4, label=f"pages of {args.page}")
        ax.axhline(roof, color="gray", ls="--", lw=1, label="read roof (sgemv)")
        ax.set_xticks(x, [f"{r['B']}x{r['keys']}" for r in sel])
        ax.set_ylabel("GB/s of K and V")
        ax.set_title(f"{name}, {ISA} build")
        ax.legend(fontsize=8)
    fig.suptitle(f"decode step, {cpu_name()}, {fastattn.get_num_threads()} threads", fontsize=9)
    fig.tight_layout()
    fig.savefig(args.plot, dpi=120)
    print(f"plot written to {args.plot}")


if __name__ == "__main__":
    sys.exit(main())
