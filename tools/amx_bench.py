"""Thread scaling of attention against torch, with fastattn's bfloat16 products on AMX
tiles and on bfloat16 pairs: bfloat16 and float32 prefill and decode, and the bfloat16
backward, at 1, 2, 4, 8 and 16 threads (those the machine has), and a plain tile loop's
multiply-adds a second for the share of the AMX peak each row reaches.

    python tools/amx_bench.py [--threads 1,2,4] [--repeat 7] [--json FILE]

Each row's variants alternate within a round, the median of the rounds is kept, and
every output is checked against torch's before it is timed.  Without AMX (the CPU, the
OS, or FASTATTN_AMX=0) the tile variant is left out.  tools/amx_device_check.sh runs this
on an AMX Xeon.
"""
import argparse
import json
import os
import platform
import statistics
import sys
import time

import numpy as np

import fastattn
from fastattn._machine.isa import ISA, kernel

#        name                      Hq  Lq    Lk    D    causal dtype       backward
ROWS = [("prefill-1k-causal-bf16", 12, 1024, 1024, 64, True, "bfloat16", False),
        ("prefill-4k-causal-bf16", 4, 4096, 4096, 64, True, "bfloat16", False),
        ("decode-4k-bf16", 32, 1, 4096, 128, False, "bfloat16", False),
        ("backward-1k-causal-bf16", 12, 1024, 1024, 64, True, "bfloat16", True),
        ("prefill-1k-causal", 12, 1024, 1024, 64, True, "float32", False),
        ("prefill-4k-causal", 4, 4096, 4096, 64, True, "float32", False),
        ("decode-4k", 32, 1, 4096, 128, False, "float32", False)]


def multiply_adds(Hq, Lq, Lk, D, causal, backward):
    """Multiply-adds of the products: two per visible (row, key) and dim (q.k, p.v);
    the backward's five (S, dP, dV, dK, dQ)."""
    pairs = sum(min(Lk, Lk - Lq + i + 1) for i in range(Lq)) if causal else Lq * Lk
    return Hq * pairs * D * (5 if backward else 2)


def tensors(torch, Hq, Lq, Lk, D, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    tdt = getattr(torch, dtype)
    q, k, v = (torch.randn(1, Hq, n, D, generator=gen).to(tdt) for n in (Lq, Lk, Lk))
    dout = torch.randn(1, Hq, Lq, D, generator=gen).to(tdt)
    return q, k, v, dout


def as_numpy(torch, x):
    """A torch tensor as a NumPy array of the same bits (bfloat16 as ml_dtypes')."""
    if x.dtype == torch.bfloat16:
        import ml_dtypes
        return x.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return x.numpy()


def variants(torch, row):
    """(name, AMX mode or None, call) for each implementation of the row.  The backward
    rows time the backward alone: torch's autograd.grad through SDPA's graph, kept, and
    fastattn.attention_backward on its forward's out and lse."""
    name, Hq, Lq, Lk, D, causal, dtype, backward = row
    q, k, v, dout = tensors(torch, Hq, Lq, Lk, D, dtype)
    nq, nk, nv, ndo = (as_numpy(torch, x) for x in (q, k, v, dout))
    sdpa = torch.nn.functional.scaled_dot_product_attention
    xs = [x.detach().requires_grad_() for x in (q, k, v)]
    graph = sdpa(*xs, is_causal=causal) if backward else None

    def torch_call():
        if not backward:
            with torch.no_grad():
                return sdpa(q, k, v, is_causal=causal)
        return torch.autograd.grad(graph, xs, dout, retain_graph=True)[0]

    fa_out, fa_lse = fastattn.attention(nq, nk, nv, causal=causal, return_lse=True)

    def fa_call():
        if not backward:
            return fastattn.attention(nq, nk, nv, causal=causal)
        return fastattn.attention_backward(ndo, nq, nk, nv, fa_out, fa_lse, causal=causal)[0]

    found = [("torch", None, torch_call)]
    if dtype == "bfloat16" and kernel.bf16_dot():
        if kernel.amx() == "hw":
            found.append(("fastattn-amx", "hw", fa_call))
        found.append(("fastattn-pairs", "off", fa_call))
    else:
        found.append(("fastattn", None, fa_call))
    return found


def timed(call, mode, n):
    old = kernel.set_amx(mode) if mode is not None else None
    try:
        call()
        t0 = time.perf_counter()
        for _ in range(n):
            call()
        return (time.perf_counter() - t0) / n
    finally:
        if old is not None:
            kernel.set_amx(old)


def to_f64(x):
    if hasattr(x, "detach"):
        return x.detach().double().numpy()
    return np.asarray(x, dtype=np.float64)


def run_row(torch, row, threads, repeat):
    found = variants(torch, row)
    checks = {}
    for name, mode, call in found:
        old = kernel.set_amx(mode) if mode is not None else None
        try:
            checks[name] = to_f64(call())
        finally:
            if old is not None:
                kernel.set_amx(old)
    ref = checks["torch"]
    for name, got in checks.items():
        err = float(np.abs(got - ref).max())
        if not err < 0.1 * max(1.0, float(np.abs(ref).max())):
            raise SystemExit(f"{row[0]}: {name} differs from torch by {err:.3g}")
    # calls per round: about 20 ms a round for each variant
    first = timed(found[0][2], found[0][1], 1)
    n = max(1, min(50, int(0.02 / max(first, 1e-6))))
    times = {name: [] for name, _, _ in found}
    for _ in range(repeat):
        for name, mode, call in found:
            times[name].append(timed(call, mode, n))
    return {name: statistics.median(ts) for name, ts in times.items()}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", default=None, help="comma-separated thread counts")
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--rows", default=None, help="comma-separated subset of the rows")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    import torch

    cores = os.cpu_count() or 1
    counts = ([int(x) for x in args.threads.split(",")] if args.threads else
              [n for n in (1, 2, 4, 8, 16) if n <= cores])
    rows = [r for r in ROWS if args.rows is None or r[0] in args.rows.split(",")]
    peak = kernel.amx_peak(20_000_000) if kernel.amx_cpu() else None
    info = {"machine": platform.processor() or platform.machine(), "isa": ISA,
            "amx": kernel.amx(), "torch": torch.__version__, "numpy": np.__version__,
            "fastattn": fastattn.__version__, "amx_peak_macs_per_s_one_thread": peak}
    print(f"fastattn {fastattn.__version__} ({ISA}; AMX {kernel.amx()}), torch "
          f"{torch.__version__}; plain tile loop, one thread: "
          + (f"{peak / 1e12:.2f} T multiply-adds/s" if peak else "no AMX"))
    results = []
    for n in counts:
        torch.set_num_threads(n)
        with fastattn.num_threads(n):
            print(f"\n{n} thread(s)\n\n| row | variant | ms | torch / it | share of AMX peak |")
            print("|---|---|---|---|---|")
            for row in rows:
                t = run_row(torch, row, n, args.repeat)
                macs = multiply_adds(*row[1:6], row[7])
                for name, sec in t.items():
                    share = f"{macs / sec / (peak * n):.0%}" if peak else ""
                    print(f"| {row[0]} | {name} | {sec * 1e3:.2f} | {t['torch'] / sec:.2f} | "
                          f"{share} |", flush=True)
                    results.append({"threads": n, "row": row[0], "variant": name,
                                    "seconds": sec, "multiply_adds": macs})
    by = {(r["row"], r["variant"], r["threads"]): r["seconds"] for r in results}
    if len(counts) > 1:
        top = counts[-1]
        print(f"\nparallel efficiency at {top} threads (time at 1 / ({top} x time at {top}))")
        for row in rows:
            for variant in sorted({r["variant"] for r in results if r["row"] == row[0]}):
                one, many = by.get((row[0], variant, counts[0])), by.get((row[0], variant, top))
                if one and many:
                    eff = one * counts[0] / (top * many)
                    print(f"  {row[0]:<26} {variant:<15} {eff:.0%}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"info": info, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
