"""Every cache type in pages against the same cache contiguous: one decode step of a batch.

    python benchmarks/paged_caches.py [--seqs 8] [--min-len 1024] [--max-len 4096]
        [--heads 32] [--kv-heads 8] [--d 128] [--page 16] [--rounds 15]
        [--types float32,float16,q8_0,q4_0,fp8_e4m3,fp8_e5m2] [--threads N]

A server keeps its caches in a pool of pages, handed out as sequences grow, so that a
sequence's pages lie anywhere in the pool.  For each cache type this stores the same keys
and values twice: contiguous, ``(seqs, Hkv, max_len, D)``, and in a pool whose pages are
shuffled (a block table that follows no order, as a busy server's does).  Then it times one
decode step of the whole batch (``attention_with_kvcache``, one query row per sequence of
random length in ``[min-len, max-len]``) over each, the two alternating round by round,
and prints the medians, the bytes of K and V (and their scales) the step reads as GB/s and
as a share of the read roof, the ratio contiguous / paged (1.0: pages cost nothing) and
whether both gave the same bits (they must).  The read roof is measured first, in the same
run: a float32 matrix-vector product streaming 512 MiB with all BLAS threads (as
``python -m fastattn bench`` does).  The "bg load" column is the share of the CPUs other
processes used meanwhile: a figure taken beside other work is not the machine's.

q8_0 and q4_0 are llama.cpp's blocks (``fastattn.quantize_q8_0``/``quantize_q4_0``); fp8 is
vLLM's, a float32 scale per kv head (max|x| / the type's largest finite value); bfloat16
and fp8 need ml_dtypes.
"""
import argparse
import os
import statistics
import sys
import time

import numpy as np

import fastattn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from fastattn.cli.bench import caches  # noqa: E402
from fastattn.cli.bench.harness import OtherLoad  # noqa: E402
from fastattn.cli.bench.machine import cpu_name, measure_read_bandwidth  # noqa: E402

TYPES = ("float32", "float16", "bfloat16", "q8_0", "q4_0", "fp8_e4m3", "fp8_e5m2")


def store(name, k, v):
    """k and v (B, Hkv, L, D) float32 stored as cache type ``name``: the keywords of
    ``attention_with_kvcache`` (caches and scales)."""
    if name in ("float32", "float16"):
        return dict(k_cache=k.astype(name), v_cache=v.astype(name))
    if name == "bfloat16":
        import ml_dtypes
        return dict(k_cache=k.astype(ml_dtypes.bfloat16), v_cache=v.astype(ml_dtypes.bfloat16))
    return caches.store(fastattn, {"fp8_e4m3": "fp8"}.get(name, name), k, v)


def paged(cache, table, page):
    """The contiguous cache's arrays in a pool of pages ``(num_pages, Hkv, page, ...)``:
    page ``table[b, i]`` holds rows ``i * page ...`` of sequence ``b``.  fp8's per-head
    scales stay as they are."""
    B, n = table.shape
    out = {}
    for key, a in cache.items():
        if a.ndim != 4:
            out[key] = a
            continue
        pool = np.zeros((B * n, a.shape[1], page) + a.shape[3:], a.dtype)
        pool[table.ravel()] = a.reshape((B, a.shape[1], n, page) + a.shape[3:]).swapaxes(
            1, 2).reshape((B * n, a.shape[1], page) + a.shape[3:])
        out[key] = pool
    return out


def time_pair(calls, rounds):
    """Median seconds of each call, the calls taking turns (the first call of each
    round alternates)."""
    samples = [[] for _ in calls]
    for r in range(rounds):
        order = range(len(calls)) if r % 2 == 0 else reversed(range(len(calls)))
        for i in order:
            t = time.perf_counter()
            calls[i]()
            calls[i]()
            samples[i].append((time.perf_counter() - t) / 2)
    return [statistics.median(s) for s in samples]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seqs", type=int, default=8)
    ap.add_argument("--min-len", type=int, default=1024)
    ap.add_argument("--max-len", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--page", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--types", default=",".join(TYPES))
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    names = [t for t in args.types.split(",") if t]
    unknown = sorted(set(names) - set(TYPES))
    if unknown:
        ap.error(f"unknown cache type(s) {', '.join(unknown)}; choose from {', '.join(TYPES)}")
    if args.threads:
        fastattn.set_num_threads(args.threads)
    rng = np.random.default_rng(args.seed)
    B, Hkv, D, page = args.seqs, args.kv_heads, args.d, args.page
    L = -(-args.max_len // page) * page
    seqlens = rng.integers(args.min_len, args.max_len + 1, B).astype(np.int32)
    q = rng.standard_normal((B, args.heads, 1, D)).astype(np.float32)
    k = rng.standard_normal((B, Hkv, L, D)).astype(np.float32)
    v = rng.standard_normal((B, Hkv, L, D)).astype(np.float32)
    table = rng.permutation(B * (L // page)).astype(np.int32).reshape(B, L // page)
    load = OtherLoad()
    roof = measure_read_bandwidth()
    busy = load.fraction()
    print(f"{cpu_name()}, {B} sequences of {seqlens.min()}-{seqlens.max()} keys, {args.heads} "
          f"heads / {Hkv} kv heads, D {D}, page {page} (pages shuffled), "
          f"{fastattn.get_num_threads()} threads")
    print(f"read roof (sgemv over 512 MiB): {roof:.1f} GB/s"
          + (f" (bg load {100 * busy[0]:.0f}%)" if busy else ""))
    print(f"{'cache':10} {'contiguous':>11} {'paged':>9} {'GB/s c':>7} {'GB/s p':>7} {'roof p':>7}"
          f" {'contig/paged':>13} {'same bits':>10} {'bg load':>8}")
    for name in names:
        try:
            contiguous = store(name, k, v)
        except ImportError as exc:
            print(f"{name:10} skipped: {exc}")
            continue
        pool = paged(contiguous, table, page)
        outs = [np.empty((B, args.heads, 1, D), np.float32) for _ in range(2)]
        calls = [lambda: fastattn.attention_with_kvcache(q, **contiguous, cache_seqlens=seqlens,
                                                         out=outs[0]),
                 lambda: fastattn.attention_with_kvcache(q, **pool, cache_seqlens=seqlens,
                                                         block_table=table, out=outs[1])]
        for call in calls:
            call()
        load = OtherLoad()
        t_contig, t_paged = time_pair(calls, args.rounds)
        busy = load.fraction()
        same = np.array_equal(outs[0], outs[1])
        bg = f"{100 * busy[0]:.0f}%" if busy else "?"
        # the bytes of the rows the step reads: each sequence's keys, every kv head
        nbytes = sum(a.nbytes // (B * L) for a in contiguous.values() if a.ndim == 4) * int(
            seqlens.sum())
        gc, gp = nbytes / t_contig / 1e9, nbytes / t_paged / 1e9
        print(f"{name:10} {t_contig * 1e3:9.2f}ms {t_paged * 1e3:7.2f}ms {gc:7.1f} {gp:7.1f} "
              f"{gp / roof:7.2f} {t_contig / t_paged:13.2f} {str(same):>10} {bg:>8}")


if __name__ == "__main__":
    main()
