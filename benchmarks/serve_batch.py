"""Sequences of different lengths decoding together: one paged q8_0 pool against padded
contiguous float32 caches.

    python benchmarks/serve_batch.py [--seqs 8] [--min-len 256] [--max-len 1024] [--steps 16]
        [--heads 32] [--kv-heads 8] [--d 128] [--page 16] [--threads 2] [--plot FILE.png]
        [--layers N] [--int8]

A server's batch holds sequences of different lengths.  Contiguous caches give every
sequence the longest one's rows, ``B x max(lengths)``, in float32 here; a pool of pages
holds ``sum(lengths)`` rows rounded up to whole pages, and q8_0 stores 1.0625 bytes a
value.  Both runs prefill the same prompts, then decode ``--steps`` tokens for every
sequence with ``fastattn.attention_with_kvcache`` (one call per step for the whole batch),
the two caches taking turns step by step; the new keys, values and queries are random and
the same for both.  The report gives decode tokens per second (the median of the steps),
the cache memory each holds, and the largest difference between the two runs' outputs
(the q8_0 quantisation; a paged float32 pool gives the contiguous bits exactly, which
tests/test_kvcache.py checks).  ``--plot`` draws both as bars (needs matplotlib).

With ``--layers N`` it decodes a model's step instead: N layers, each with its own paged
q8_0 pool, one :func:`fastattn.plan_kvcache` per step and ``plan.run`` per layer, against
``attention_with_kvcache`` per layer (a plan and a run each), alternating step by step.
It reports tokens per second and the share of each step spent outside the kernel (the plan,
the checks, the appends and the Python loop): the step's time less the kernels' own, which
the compiled module clocks while a benchmark asks it to (``kernel_clock``).

Both modes also give the bytes of K and V (and their scales) a step reads, as GB/s and as a
share of the read roof, measured first in the same run: a float32 matrix-vector product
streaming 512 MiB with all BLAS threads (as ``python -m fastattn bench`` does).

``--int8`` turns on :func:`fastattn.set_int8_dot_products` for the q8_0 pools.

The defaults are small, so that a run takes seconds; the figures of a real comparison
come from longer sequences on a quiet machine (name the CPU with them).
"""
import argparse
import statistics
import sys
import time

import numpy as np

import fastattn
from fastattn.cli.bench.harness import OtherLoad
from fastattn.cli.bench.machine import cpu_name, measure_read_bandwidth


class PagePool:
    """A pool of ``num_pages`` cache pages and the free list that hands them out: a
    sequence gets a page when its next row would not fit, and returns its pages when it
    finishes.  The block table row of a sequence lists its pages in order."""

    def __init__(self, num_pages, n_kv_heads, page, d, *, dtype="q8_0"):
        self.page = page
        shape = (num_pages, n_kv_heads, page, d)
        if dtype == "q8_0":
            self.k, self.v = np.zeros(shape, np.int8), np.zeros(shape, np.int8)
            scale_shape = shape[:-1] + (d // 32,)
            self.k_scale = np.zeros(scale_shape, np.float16)
            self.v_scale = np.zeros(scale_shape, np.float16)
        else:
            self.k, self.v = np.zeros(shape, dtype), np.zeros(shape, dtype)
            self.k_scale = self.v_scale = None
        self.free = list(range(num_pages - 1, -1, -1))
        self.pages = {}                                  # sequence -> its pages

    def reserve(self, seq, rows):
        """Give sequence ``seq`` pages for ``rows`` rows in all (MemoryError when full)."""
        have = self.pages.setdefault(seq, [])
        need = -(-rows // self.page) - len(have)
        if need > len(self.free):
            raise MemoryError(f"the pool has {len(self.free)} free pages, {need} needed")
        have.extend(self.free.pop() for _ in range(need))

    def release(self, seq):
        self.free.extend(reversed(self.pages.pop(seq, [])))

    def block_table(self, seqs):
        """``(len(seqs), max_pages)`` int32; unused entries are 0 (never read)."""
        width = max((len(self.pages[s]) for s in seqs), default=0)
        table = np.zeros((len(seqs), width), np.int32)
        for i, s in enumerate(seqs):
            table[i, :len(self.pages[s])] = self.pages[s]
        return table

    def caches(self):
        kw = dict(k_cache=self.k, v_cache=self.v)
        if self.k_scale is not None:
            kw.update(k_scale=self.k_scale, v_scale=self.v_scale)
        return kw

    def bytes_per_key(self):
        """Bytes of one key's rows in every kv head, K and V with their scales."""
        return sum(a[0].nbytes // self.page for a in self.caches().values())

    def bytes_in_use(self):
        """Bytes of the pages the sequences hold (values and scales)."""
        used = sum(len(p) for p in self.pages.values())
        per_page = sum(a[0].nbytes for a in self.caches().values())
        return used * per_page


def read_roof():
    """The read roof (GB/s) and a line that says it, with the other processes' load."""
    load = OtherLoad()
    roof = measure_read_bandwidth()
    busy = load.fraction()
    return roof, (f"{cpu_name()}; read roof (sgemv over 512 MiB): {roof:.1f} GB/s"
                  + (f" (bg load {100 * busy[0]:.0f}%)" if busy else ""))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seqs", type=int, default=8)
    ap.add_argument("--min-len", type=int, default=256)
    ap.add_argument("--max-len", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--page", type=int, default=16)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--plot", metavar="FILE.png")
    ap.add_argument("--layers", type=int, default=0,
                    help="decode a step of this many layers through one plan per step")
    ap.add_argument("--int8", action="store_true",
                    help="with set_int8_dot_products(True): q.k over the q8_0 pool in int8")
    args = ap.parse_args(argv)
    if args.int8:
        fastattn.set_int8_dot_products(True)
        from fastattn._calls.precision import quantised_products
        print(f"q8_0 products: {quantised_products()}")
    if args.layers:
        if args.threads:
            fastattn.set_num_threads(args.threads)
        return decode_layers(args)
    plt = None
    if args.plot:
        try:
            import matplotlib
            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            print("serve_batch: --plot needs matplotlib (pip install matplotlib); nothing was "
                  "run", file=sys.stderr)
            return 3
    if args.threads:
        fastattn.set_num_threads(args.threads)

    roof, roof_line = read_roof()
    rng = np.random.default_rng(args.seed)
    B, Hq, Hkv, D, steps = args.seqs, args.heads, args.kv_heads, args.d, args.steps
    lengths = np.sort(rng.integers(args.min_len, args.max_len + 1, B))[::-1].copy()
    capacity = int(lengths.max()) + steps
    num_pages = sum(-(-(int(n) + steps) // args.page) for n in lengths)

    pool = PagePool(num_pages, Hkv, args.page, D)
    flat = dict(k_cache=np.zeros((B, Hkv, capacity, D), np.float32),
                v_cache=np.zeros((B, Hkv, capacity, D), np.float32))
    seqs = list(range(B))

    # Prefill: each prompt's keys and values written into both caches (one sequence per
    # call, as a server admits them).
    for b, n in enumerate(lengths):
        k, v = (rng.standard_normal((1, Hkv, int(n), D)).astype(np.float32) for _ in range(2))
        q = rng.standard_normal((1, Hq, 1, D)).astype(np.float32)
        pool.reserve(b, int(n))
        fastattn.attention_with_kvcache(q, **pool.caches(), k=k, v=v, cache_seqlens=[0],
                                        block_table=pool.block_table([b]))
        fastattn.attention_with_kvcache(q, flat["k_cache"][b:b + 1], flat["v_cache"][b:b + 1],
                                        k, v, cache_seqlens=[0])

    times = {"paged q8_0": [], "contiguous float32": []}
    diff = 0.0
    seqlens = lengths.copy()
    for step in range(steps):
        q = rng.standard_normal((B, Hq, 1, D)).astype(np.float32)
        k, v = (rng.standard_normal((B, Hkv, 1, D)).astype(np.float32) for _ in range(2))
        for b in seqs:
            pool.reserve(b, int(seqlens[b]) + 1)
        table = pool.block_table(seqs)
        calls = {
            "paged q8_0": lambda: fastattn.attention_with_kvcache(
                q, **pool.caches(), k=k, v=v, cache_seqlens=seqlens, block_table=table),
            "contiguous float32": lambda: fastattn.attention_with_kvcache(
                q, **flat, k=k, v=v, cache_seqlens=seqlens),
        }
        order = list(calls) if step % 2 == 0 else list(calls)[::-1]
        outs = {}
        for name in order:
            t0 = time.perf_counter()
            outs[name] = calls[name]()
            times[name].append(time.perf_counter() - t0)
        diff = max(diff, float(np.abs(outs["paged q8_0"] - outs["contiguous float32"]).max()))
        seqlens += 1

    memory = {"paged q8_0": pool.bytes_in_use(),
              "contiguous float32": sum(a.nbytes for a in flat.values())}
    print(f"{B} sequences of {lengths.min()}-{lengths.max()} keys (+{steps} decoded), "
          f"Hq={Hq}, Hkv={Hkv}, D={D}, page {args.page}, {fastattn.get_num_threads()} threads")
    print(roof_line)
    # the rows a median step reads: each sequence's keys (the middle step's), every kv head
    keys = int(lengths.sum()) + B * (steps // 2 + 1)
    per_key = {"paged q8_0": pool.bytes_per_key(),
               "contiguous float32": sum(a[0, :, 0].nbytes for a in flat.values())}
    print(f"{'cache':<20} {'tokens/s':>10} {'ms/step':>9} {'cache MB':>9} {'GB/s':>7} {'roof':>6}")
    rates = {}
    for name in times:
        med = statistics.median(times[name])
        rates[name] = B / med
        gbs = keys * per_key[name] / med / 1e9
        print(f"{name:<20} {rates[name]:>10.0f} {1e3 * med:>9.2f} {memory[name] / 1e6:>9.1f}"
              f" {gbs:>7.1f} {gbs / roof:>6.2f}")
    print(f"largest difference between the two outputs: {diff:.2e} (q8_0 quantisation)")

    if plt is not None:
        fig, axes = plt.subplots(1, 2, figsize=(8, 3.2))
        names = list(times)
        axes[0].bar(names, [rates[n] for n in names], color=["tab:blue", "tab:gray"])
        axes[0].set_ylabel("decode tokens / s")
        axes[1].bar(names, [memory[n] / 1e6 for n in names], color=["tab:blue", "tab:gray"])
        axes[1].set_ylabel("cache MB")
        fig.suptitle(f"{B} sequences, {lengths.min()}-{lengths.max()} keys, page {args.page}")
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)
        print(f"plot written to {args.plot}")
    return 0


def decode_layers(args):
    """``--layers``: a step of ``args.layers`` layers over paged q8_0 pools (see the top)."""
    roof, roof_line = read_roof()
    rng = np.random.default_rng(args.seed)
    B, Hq, Hkv, D, steps = args.seqs, args.heads, args.kv_heads, args.d, args.steps
    lengths = np.sort(rng.integers(args.min_len, args.max_len + 1, B))[::-1].copy()
    num_pages = sum(-(-(int(n) + steps) // args.page) for n in lengths)
    pools = [PagePool(num_pages, Hkv, args.page, D) for _ in range(args.layers)]
    for pool in pools:           # every pool hands out the same pages: one block table
        for b, n in enumerate(lengths):
            pool.reserve(b, int(n) + steps)
            rows = pool.k[pool.pages[b]]
            rows[...] = rng.integers(-127, 128, rows.shape, dtype=np.int8)
            pool.k[pool.pages[b]] = pool.v[pool.pages[b][::-1]] = rows
        pool.k_scale[...] = pool.v_scale[...] = np.float16(0.01)
    table = pools[0].block_table(range(B))
    q = rng.standard_normal((B, Hq, 1, D)).astype(np.float32)
    k, v = (rng.standard_normal((B, Hkv, 1, D)).astype(np.float32) for _ in range(2))

    def planned(seqlens):
        plan = fastattn.plan_kvcache(cache_seqlens=seqlens, block_table=table, causal=True)
        for pool in pools:
            plan.run(q, pool.k, pool.v, k, v, k_scale=pool.k_scale, v_scale=pool.v_scale)

    def per_call(seqlens):
        for pool in pools:
            fastattn.attention_with_kvcache(q, **pool.caches(), k=k, v=v, cache_seqlens=seqlens,
                                            block_table=table, causal=True)

    runs = {"plan.run per layer": planned, "attention_with_kvcache per layer": per_call}
    times = {name: [] for name in runs}
    outside = {name: [] for name in runs}
    kernel = fastattn._calls.glue.kernel
    seqlens = lengths.copy()
    for step in range(steps):
        names = list(runs) if step % 2 == 0 else list(runs)[::-1]
        for name in names:
            kernel.kernel_clock(True)
            t0 = time.perf_counter()
            runs[name](seqlens)
            t = time.perf_counter() - t0
            times[name].append(t)
            outside[name].append((t - kernel.kernel_clock(False)) / t)
        seqlens += 1       # each step's new row stays: the next step appends after it
    print(f"{args.layers} layers, {B} sequences of {lengths.min()}-{lengths.max()} keys "
          f"(+{steps} decoded), paged q8_0 (page {args.page}), Hq={Hq}, Hkv={Hkv}, D={D}, "
          f"{fastattn.get_num_threads()} threads")
    print(roof_line)
    # the rows a median step reads: every layer, each sequence's keys (the middle step's)
    nbytes = args.layers * pools[0].bytes_per_key() * (int(lengths.sum()) + B * (steps // 2 + 1))
    print(f"{'step':<34} {'tokens/s':>9} {'ms/step':>9} {'outside kernel':>15} {'GB/s':>7}"
          f" {'roof':>6}")
    for name, t in times.items():
        med = statistics.median(t)
        print(f"{name:<34} {B / med:>9.1f} {1e3 * med:>9.2f} "
              f"{100 * statistics.median(outside[name]):>14.1f}% {nbytes / med / 1e9:>7.1f}"
              f" {nbytes / med / 1e9 / roof:>6.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
