"""The attention variants against the same call without them, and against torch.

    python -m fastattn bench --variants [--threads N] [--repeat N]

Rows (float32, batch 1):
  softcap        prefill-1k (12 heads, 1024 x 1024, D 64) with softcap=30
  alibi          prefill-1k causal with ALiBi slopes 2^-(1..12)
  sinks          decode-gqa-8k (32 query heads, 8 kv heads, 8192 keys, D 128) with sinks
  varlen         16 prompts, lengths drawn from 64-1024 (seed 0), 12 heads, D 64, causal:
                 attention_varlen on the packed batch against attention on the batch
                 right-padded to the longest prompt with kv_lengths and causal="top-left"
                 (each prompt's rows j <= i, keys j < len), padding rows computed too
For each row: the variant's time, the plain call's time and their ratio; torch's
scaled_dot_product_attention given the equivalent float mask where it can express the
variant (ALiBi; the padded batch of the varlen row), and fastattn's speed-up over it.
Batches of each callable alternate; the figure is the median of --repeat batches.
"""
import time

import numpy as np

import fastattn
from . import bench


def _time(calls, repeat):
    # Median seconds per call of each callable, batches alternating between them.
    n = {}
    for name, f in calls.items():
        f()
        n[name] = bench._iterations(bench._warm_call_seconds(f, 0.05), 0.2)
    samples = {name: [] for name in calls}
    order = list(calls.items())
    for round_ in range(repeat):
        # the order rotates each round, so that no callable always follows the same one
        for name, f in order[round_ % len(order):] + order[:round_ % len(order)]:
            t0 = time.perf_counter()
            for _ in range(n[name]):
                f()
            samples[name].append((time.perf_counter() - t0) / n[name])
    return {name: float(np.median(s)) for name, s in samples.items()}


def _alibi_mask(slopes, L):
    i = np.arange(L)[:, None]
    j = np.arange(L)[None]
    bias = -slopes[:, None, None] * np.abs(i - j)
    return np.where(j <= i, bias, -np.inf).astype(np.float32)[None]


def rows(torch, repeat):
    rng = np.random.default_rng(0)
    out = []

    q, k, v = (rng.standard_normal((1, 12, 1024, 64)).astype(np.float32) for _ in range(3))
    out.append(("softcap", _time({
        "variant": lambda: fastattn.attention(q, k, v, softcap=30.0),
        "plain": lambda: fastattn.attention(q, k, v)}, repeat), None))

    slopes = 2.0 ** -np.arange(1, 13)
    calls = {"variant": lambda: fastattn.attention(q, k, v, causal=True, alibi_slopes=slopes),
             "plain": lambda: fastattn.attention(q, k, v, causal=True)}
    if torch is not None:
        tq, tk, tv = (torch.from_numpy(a) for a in (q, k, v))
        tm = torch.from_numpy(_alibi_mask(slopes, 1024))
        sdpa = torch.nn.functional.scaled_dot_product_attention
        calls["torch"] = lambda: sdpa(tq, tk, tv, attn_mask=tm)
    out.append(("alibi", _time(calls, repeat), "float mask"))

    qd = rng.standard_normal((1, 32, 1, 128)).astype(np.float32)
    kd, vd = (rng.standard_normal((1, 8, 8192, 128)).astype(np.float32) for _ in range(2))
    sinks = rng.standard_normal(32)
    out.append(("sinks", _time({
        "variant": lambda: fastattn.attention(qd, kd, vd, sinks=sinks),
        "plain": lambda: fastattn.attention(qd, kd, vd)}, repeat), None))

    lens = rng.integers(64, 1025, size=16)
    cu = np.concatenate([[0], np.cumsum(lens)])
    packed = [rng.standard_normal((12, cu[-1], 64)).astype(np.float32) for _ in range(3)]
    L = int(lens.max())
    padded = [np.zeros((16, 12, L, 64), np.float32) for _ in range(3)]
    for s in range(16):
        for p, a in zip(padded, packed):
            p[s, :, :lens[s]] = a[:, cu[s]:cu[s + 1]]
    calls = {"variant": lambda: fastattn.attention_varlen(*packed, cu, cu, causal=True),
             "plain": lambda: fastattn.attention(*padded, causal="top-left", kv_lengths=lens)}
    if torch is not None:
        tp = [torch.from_numpy(a) for a in padded]
        j = np.arange(L)
        # Key j visible to query i of prompt s iff j <= i and j < len[s] (padded queries
        # keep key 0 so that torch has no fully masked row to special-case).
        vis = (j[None, None] <= j[None, :, None]) & (j[None, None] < lens[:, None, None])
        vis[:, :, 0] = True
        tm = torch.from_numpy(np.where(vis, 0.0, -np.inf).astype(np.float32)[:, None])
        sdpa = torch.nn.functional.scaled_dot_product_attention
        calls["torch"] = lambda: sdpa(*tp, attn_mask=tm)
    out.append(("varlen", _time(calls, repeat), "padded batch, float mask"))
    return out


def run(args, stdout):
    """Print the variants table for parsed ``bench`` arguments; return the exit status."""
    torch = bench._import_torch()
    threads = args.threads or fastattn.get_num_threads()
    repeat = args.repeat or (3 if args.quick else 7)
    with fastattn.num_threads(threads):
        if torch is not None:
            torch.set_num_threads(threads)
        load = bench.OtherLoad()
        print(f"fastattn variants, {threads} threads, median of {repeat} alternating batches",
              file=stdout)
        print(f"{'row':<8}{'variant':>11}{'plain':>11}{'variant/plain':>15}{'torch':>11}"
              f"{'x torch':>9}  torch gets", file=stdout)
        for name, t, torch_how in rows(torch, repeat):
            tt = t.get("torch")
            print(f"{name:<8}{t['variant'] * 1e3:>9.3f}ms{t['plain'] * 1e3:>9.3f}ms"
                  f"{t['variant'] / t['plain']:>15.3f}"
                  + (f"{tt * 1e3:>9.3f}ms{tt / t['variant']:>9.2f}  {torch_how}" if tt else
                     f"{'-':>11}{'-':>9}  " + (torch_how or "(no equivalent)")),
                  file=stdout, flush=True)
        frac = load.fraction()
        if frac is not None:
            print(f"bg load {100 * frac[0]:.0f}% (other processes' CPU share; trust the "
                  "figures only when it is low)", file=stdout)
    return 0
