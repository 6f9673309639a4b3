"""Each storage kind of a KV cache against fastattn's own float16 cache and a read roof.

    python benchmarks/cache_kinds.py                       # this checkout, every ISA it can run
    python benchmarks/cache_kinds.py --isa avx2            # one instruction set
    python benchmarks/cache_kinds.py --old /path/to/older  # an older build beside this one

For every shape and kind the table gives the GB/s of K and V read (stored bytes, scales
included), the share of a read roof and float16's time over the kind's.  The read roof is
``torch.sum`` over 512 MiB of float32 on the same threads, measured in the same process
as the kinds it divides.  Each build runs in its own process (two builds cannot share
one); the builds alternate round by round, and inside a process the kinds alternate call
batch by call batch, so that the ratios of one run share the machine's state.  Every
figure is the median over rounds; ``bg load`` is the share of the CPUs that other
processes used while a round ran (from /proc/stat), and /proc/loadavg is printed at the
start and the end.

Shapes (heads first; q and the output float32, as a serving layer holds them):

* ``gqa``: decode, B 8, Hq 32, Hkv 8, D 128, 2048 keys per sequence;
* ``4k``: decode, B 1, Hq = Hkv = 32, D 128, 4096 keys;
* ``prefill``: chunked prefill, 256 new query rows (causal) over a 4096-key cache, B 1,
  Hq 32, Hkv 8, D 128 (bound by its FLOPs: time ratios only).

Kinds: float16, bfloat16, q8_0, q4_0, fp8 (float8_e4m3fn, a float32 scale per kv head),
fp8-1 (float8_e4m3fn, one scalar scale) and e5m2 (float8_e5m2, per kv head); q8_0-i8 and
q4_0-i8 are the same caches with ``set_int8_dot_products(True)`` (rows "n/a" where the build
or the CPU has no int8 products).  Each call
reads a different copy of the cache of the kind (enough copies for 160 MiB), so that K and
V come from memory, not from the last-level cache.

``--isa`` runs both sides on one instruction set: ``FASTATTN_ISA`` for fastattn, and for
torch (the roof) ``ATEN_CPU_CAPABILITY``, ``MKL_ENABLE_INSTRUCTIONS`` and
``ONEDNN_MAX_CPU_ISA``, as the table's header says.
"""
import argparse
import json
import os
import subprocess
import sys
import time

SHAPES = {  # name: (B, Hq, Hkv, Lq, Lk, D, causal)
    "gqa": (8, 32, 8, 1, 2048, 128, False),
    "4k": (1, 32, 32, 1, 4096, 128, False),
    "prefill": (1, 32, 8, 256, 4096, 128, True),
}
KINDS = ["float16", "bfloat16", "q8_0", "q4_0", "fp8", "fp8-1", "e5m2", "q8_0-i8", "q4_0-i8"]
COPIES_BYTES = 160 << 20


# ----------------------------------------------------------------------------- worker

def _cpu_seconds():
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq = fields[:7]
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


def _store(fa, kind, k, v):
    """The keywords of attention_with_kvcache for k, v (float32) stored as ``kind``."""
    import ml_dtypes
    import numpy as np
    if kind in ("float16", "bfloat16"):
        dt = np.float16 if kind == "float16" else ml_dtypes.bfloat16
        return dict(k_cache=k.astype(dt), v_cache=v.astype(dt))
    if kind in ("q8_0", "q4_0"):
        quantize = getattr(fa, f"quantize_{kind}")
        (kq, ks), (vq, vs) = quantize(k), quantize(v)
        return dict(k_cache=kq, v_cache=vq, k_scale=ks, v_scale=vs)
    name, top = ("float8_e5m2", 57344.0) if kind == "e5m2" else ("float8_e4m3fn", 448.0)
    out = {}
    for which, x in (("k", k), ("v", v)):
        if kind == "fp8-1":
            s = np.float32(np.abs(x).max() / top)
        else:
            s = (np.abs(x).max(axis=(0, 2, 3)) / top).astype(np.float32)
        out[f"{which}_cache"], out[f"{which}_scale"] = fa.quantize_fp8(x, s, name), s
    return out


def _nbytes(cache, B, Hkv, L):
    """Bytes of the rows a call reads (every sequence's L keys, K and V, with scales)."""
    total = 0
    for name, a in cache.items():
        if name.endswith("_cache"):
            total += a.nbytes
        elif getattr(a, "ndim", 0) == 4:     # q8_0 / q4_0 block scales, one row per key
            total += a.nbytes
    return total * L // cache["k_cache"].shape[2]


def _time(call, n):
    t = time.perf_counter()
    for _ in range(n):
        call()
    return (time.perf_counter() - t) / n


def worker(args):
    import numpy as np
    import torch
    import fastattn as fa

    threads = args.threads
    fa.set_num_threads(threads)
    torch.set_num_threads(threads)
    rng = np.random.default_rng(0)
    try:
        from fastattn._machine.isa import ISA
    except ImportError:                     # an older build (--old) keeps it elsewhere
        from fastattn._dispatch import ISA
    res = {"isa": ISA, "shapes": {}}
    try:
        from fastattn._calls.precision import int8_products
        has_int8 = int8_products()[0]
    except ImportError:                     # a build before the int8 products
        has_int8 = False
    kinds = [kind for kind in args.kinds if has_int8 or not kind.endswith("-i8")]
    big = torch.ones(512 << 18, dtype=torch.float32)
    roof_call = lambda: torch.sum(big)       # noqa: E731
    for shape_name in args.shapes:
        B, Hq, Hkv, Lq, Lk, D, causal = SHAPES[shape_name]
        k = rng.standard_normal((B, Hkv, Lk, D), dtype=np.float32)
        v = rng.standard_normal((B, Hkv, Lk, D), dtype=np.float32)
        q = rng.standard_normal((B, Hq, Lq, D), dtype=np.float32)
        out = np.empty((B, Hq, Lq, D), np.float32)
        seqlens = np.full(B, Lk)
        calls, nbytes = {}, {}
        for kind in kinds:
            int8 = kind.endswith("-i8")
            cache = _store(fa, kind[:-3] if int8 else kind, k, v)
            nbytes[kind] = _nbytes(cache, B, Hkv, Lk)
            copies = [cache] + [{n: a.copy() for n, a in cache.items()}
                                for _ in range(max(0, -(-COPIES_BYTES // nbytes[kind]) - 1))]
            state = {"i": 0}

            def call(copies=copies, state=state, int8=int8):
                c = copies[state["i"] % len(copies)]
                state["i"] += 1
                old = fa.set_int8_dot_products(True) if int8 else None
                try:
                    fa.attention_with_kvcache(q, **c, cache_seqlens=seqlens, causal=causal,
                                              out=out)
                finally:
                    if int8:
                        fa.set_int8_dot_products(old)
            call()
            calls[kind] = call
        calls["roof"] = roof_call
        roof_call()
        # batches of about 0.1 s, alternating
        n = {name: max(1, int(0.1 / max(1e-5, _time(c, 2)))) for name, c in calls.items()}
        samples = {name: [] for name in calls}
        cpu0, own0, wall0 = _cpu_seconds(), time.process_time(), time.perf_counter()
        for _ in range(args.rounds):
            for name, c in calls.items():
                samples[name].append(_time(c, n[name]))
        wall = time.perf_counter() - wall0
        other = max(0.0, (_cpu_seconds() - cpu0) - (time.process_time() - own0))
        med = {name: float(np.median(s)) for name, s in samples.items()}
        # per-round ratios to float16, then their median
        ratio = {kind: float(np.median(np.array(samples["float16"]) / np.array(samples[kind])))
                 for kind in kinds if "float16" in samples}
        roof = big.numel() * 4 / min(samples["roof"]) / 1e9
        res["shapes"][shape_name] = {
            "roof_gbs": roof, "bg_load": min(1.0, other / (wall * os.cpu_count())),
            "kinds": {kind: {"s": med[kind], "gbs": nbytes[kind] / med[kind] / 1e9,
                             "share": nbytes[kind] / med[kind] / 1e9 / roof,
                             "f16_ratio": ratio.get(kind)} for kind in kinds}}
    json.dump(res, sys.stdout)


# ----------------------------------------------------------------------------- driver

def _loadavg():
    try:
        with open("/proc/loadavg") as f:
            return " ".join(f.read().split()[:3])
    except OSError:
        return "?"


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--isa", action="append", help="avx512, avx2 or base (repeatable)")
    p.add_argument("--old", help="PYTHONPATH of an older build to alternate with")
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--kinds", nargs="+", default=KINDS, choices=KINDS)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=5, help="call batches per kind per process")
    p.add_argument("--runs", type=int, default=2, help="processes per build and ISA")
    p.add_argument("--json", help="write the raw results here")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if "float16" not in args.kinds:
        args.kinds = ["float16"] + args.kinds
    if args.worker:
        return worker(args)

    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    builds = [("new", os.environ.get("PYTHONPATH", here))]
    if args.old:
        builds.insert(0, ("old", args.old))
    isas = args.isa or ["avx512", "avx2"]
    sys.path.insert(0, here)
    # the driver's; each worker imports its build
    from fastattn.cli.bench.machine import TORCH_ISA, cpu_name
    print(f"CPU: {cpu_name()}, {args.threads} threads; loadavg at start {_loadavg()}")
    for isa in isas:
        if isa in TORCH_ISA:
            print(f"  --isa {isa}: FASTATTN_ISA={isa}, torch restricted by "
                  + " ".join(f"{k}={v}" for k, v in TORCH_ISA[isa].items()))
    results = {}
    for run in range(args.runs):
        for isa in isas:
            for build, path in builds:
                env = dict(os.environ, PYTHONPATH=path, FASTATTN_ISA=isa, **TORCH_ISA.get(isa, {}))
                cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--threads",
                       str(args.threads), "--rounds", str(args.rounds), "--shapes", *args.shapes,
                       "--kinds", *args.kinds]
                r = subprocess.run(cmd, env=env, capture_output=True, text=True)
                if r.returncode:
                    sys.exit(f"{build} {isa}: worker failed\n{r.stderr}")
                results.setdefault((isa, build), []).append(json.loads(r.stdout))
    print(f"loadavg at end {_loadavg()}")
    import numpy as np
    raw = {}
    for (isa, build), runs in results.items():
        for shape in args.shapes:
            per = [r["shapes"][shape] for r in runs]
            roof = np.median([x["roof_gbs"] for x in per])
            bg = max(x["bg_load"] for x in per)
            print(f"\n{shape} {SHAPES[shape]} -- {isa} build, {build} ({path_of(builds, build)});"
                  f" read roof {roof:.1f} GB/s (torch.sum, 512 MiB); bg load up to {100 * bg:.0f}%")
            print(f"  {'kind':<9} {'ms':>8} {'GB/s':>7} {'roof':>6} {'f16/this':>9}")
            for kind in args.kinds:
                if any(kind not in x["kinds"] for x in per):
                    print(f"  {kind:<9} {'n/a':>8}")
                    continue
                xs = [x["kinds"][kind] for x in per]
                ms = 1e3 * np.median([x["s"] for x in xs])
                gbs = np.median([x["gbs"] for x in xs])
                share = np.median([x["share"] for x in xs])
                f16 = np.median([x["f16_ratio"] for x in xs])
                if SHAPES[shape][3] > 1:      # a prefill is bound by its FLOPs, not its reads
                    print(f"  {kind:<9} {ms:8.2f} {'-':>7} {'-':>6} {f16:9.2f}")
                else:
                    print(f"  {kind:<9} {ms:8.2f} {gbs:7.1f} {share:6.2f} {f16:9.2f}")
                raw[f"{isa}/{build}/{shape}/{kind}"] = dict(ms=ms, gbs=gbs, share=share, f16=f16)
    if args.old:
        print("\nnew build's time / old build's time... as old/new speed-up (same run):")
        for isa in isas:
            for shape in args.shapes:
                cells = []
                for kind in args.kinds:
                    o = raw.get(f"{isa}/old/{shape}/{kind}")
                    n = raw.get(f"{isa}/new/{shape}/{kind}")
                    if o is None or n is None:      # a kind one of the builds lacks
                        continue
                    cells.append(f"{kind} {o['ms'] / n['ms']:.2f}x")
                print(f"  {isa} {shape}: " + ", ".join(cells))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(raw, f, indent=1)


def path_of(builds, name):
    return dict(builds)[name]


if __name__ == "__main__":
    main()
