"""The backward pass against torch's: fastattn.attention_backward vs torch.autograd.grad
through torch.nn.functional.scaled_dot_product_attention on CPU (its flash backward).

Both run in this process, alternating call by call, on the same threads; each row prints
the median times, the ratio (torch / fastattn: > 1 means fastattn is faster) and each
side's GFLOP/s counted as a backward's 2.5x the forward's 4 Lq Lk D flops (halved under
causal masking).

    python benchmarks/backward.py [--threads 2] [--repeats 15] [--dtype float32]
    python benchmarks/backward.py --accuracy

--accuracy prints instead, per gradient, the largest error against the float64 oracle
(fastattn.reference.attention_backward) of fastattn's float32 backward and of torch's
(SDPA's flash backward in float32), relative to the largest gradient.
"""
import argparse
import statistics
import time

import numpy as np

import fastattn

SHAPES = [  # name, B, Hq, Hkv, Lq, Lk, D, causal
    ("small", 8, 8, 8, 128, 128, 64, False),
    ("prefill-1k", 1, 12, 12, 1024, 1024, 64, False),
    ("prefill-1k causal", 1, 12, 12, 1024, 1024, 64, True),
    ("prefill-4k causal", 1, 4, 4, 4096, 4096, 64, True),
    ("GQA 16/4 D128 causal", 1, 16, 4, 1024, 1024, 128, True),
]


def _flops(B, Hq, Lq, Lk, D, causal):
    return 2.5 * 4 * B * Hq * Lq * Lk * D * (0.5 if causal else 1.0)


def _time(fn):
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def bench(torch, name, B, Hq, Hkv, Lq, Lk, D, causal, dtype, repeats):
    rng = np.random.default_rng(0)
    q = rng.standard_normal((B, Hq, Lq, D)).astype(np.float32)
    k = rng.standard_normal((B, Hkv, Lk, D)).astype(np.float32)
    v = rng.standard_normal((B, Hkv, Lk, D)).astype(np.float32)
    dout = rng.standard_normal((B, Hq, Lq, D)).astype(np.float32)
    tdt = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    tq, tk, tv = (torch.tensor(a, dtype=tdt, requires_grad=True) for a in (q, k, v))
    tout = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=causal,
                                                            enable_gqa=Hq != Hkv)
    tdout = torch.tensor(dout, dtype=tdt)
    if dtype == "bfloat16":
        import ml_dtypes
        q, k, v, dout = (a.astype(ml_dtypes.bfloat16) for a in (q, k, v, dout))
    out, lse = fastattn.attention(q, k, v, causal=causal, return_lse=True)

    def run_torch():
        torch.autograd.grad(tout, (tq, tk, tv), tdout, retain_graph=True)

    def run_fastattn():
        fastattn.attention_backward(dout, q, k, v, out, lse, causal=causal)

    run_torch(), run_fastattn()     # warm-up
    tt, tf = [], []
    for _ in range(repeats):
        tt.append(_time(run_torch))
        tf.append(_time(run_fastattn))
    mt, mf = statistics.median(tt), statistics.median(tf)
    fl = _flops(B, Hq, Lq, Lk, D, causal)
    print(f"{name:24s} torch {mt * 1e3:8.2f} ms {fl / mt / 1e9:6.1f} GF/s   fastattn "
          f"{mf * 1e3:8.2f} ms {fl / mf / 1e9:6.1f} GF/s   ratio {mt / mf:5.2f}x", flush=True)
    return mt / mf


def accuracy(torch):
    rng = np.random.default_rng(1)
    print("max |g - g64| / max |g64|, float32 (12 heads, 1024 x 1024, D 64)")
    for causal in (False, True):
        q, k, v, dout = (rng.standard_normal((1, 12, 1024, 64)).astype(np.float32)
                         for _ in range(4))
        exact = fastattn.reference.attention_backward(dout, q, k, v, causal=causal)
        out, lse = fastattn.attention(q, k, v, causal=causal, return_lse=True)
        ours = fastattn.attention_backward(dout, q, k, v, out, lse, causal=causal)
        tq, tk, tv = (torch.tensor(a, requires_grad=True) for a in (q, k, v))
        tout = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=causal)
        theirs = [g.numpy() for g in torch.autograd.grad(tout, (tq, tk, tv), torch.tensor(dout))]
        for name, e, a, b in zip(("dq", "dk", "dv"), exact, ours, theirs):
            top = np.abs(e).max()
            print(f"  causal={causal!s:5s} {name}: fastattn {np.abs(a - e).max() / top:.2e}   "
                  f"torch {np.abs(b - e).max() / top:.2e}")


def main():
    import torch
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--only", default=None, help="run the shapes whose name contains this")
    ap.add_argument("--accuracy", action="store_true", help="print the accuracy table instead")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    fastattn.set_num_threads(a.threads)
    if a.accuracy:
        return accuracy(torch)
    print(f"backward, {a.dtype}, {a.threads} threads, median of {a.repeats} alternating runs "
          f"(torch {torch.__version__}, fastattn {fastattn.__version__})")
    for row in SHAPES:
        if a.only is None or a.only in row[0]:
            bench(torch, *row, a.dtype, a.repeats)


if __name__ == "__main__":
    main()
