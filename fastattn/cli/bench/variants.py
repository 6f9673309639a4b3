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
variant (ALiBi; the padded batch of the varlen row), torch's eager ops for the softcap
(as transformers' eager attention computes Gemma 2's), and fastattn's speed-up over it.
The calls of a row are timed as the shapes table's are (the bench's harness: warm-up,
alternating batches of about 0.2 s, each after a pause and a wake-up call); the figure
is the median of --repeat batches.
"""

from __future__ import annotations

import numpy as np

from ..common import OK, format_table, symbols
from . import harness

BATCH_S = 0.2


def _time(calls, repeat):
    """Median seconds per call of each callable, through the harness."""
    medians, _, errors = harness.measure(
        {name: harness.Timed(f, repeat) for name, f in calls.items()}, BATCH_S)
    if errors:
        name, exc = next(iter(errors.items()))
        raise RuntimeError(f"{name}: {type(exc).__name__}: {exc}") from exc
    return medians


def _alibi_mask(slopes, L):
    i = np.arange(L)[:, None]
    j = np.arange(L)[None]
    bias = -slopes[:, None, None] * np.abs(i - j)
    return np.where(j <= i, bias, -np.inf).astype(np.float32)[None]


def _softcap_torch_call(torch, q, k, v, cap):
    """Softcapped attention as a torch user writes it (SDPA has no softcap; transformers'
    eager attention for Gemma 2 does this)."""
    tq, tk, tv = (torch.from_numpy(a) for a in (q, k, v))
    scale = q.shape[-1] ** -0.5

    def call():
        s = torch.matmul(tq, tk.transpose(-1, -2)) * scale
        s = torch.tanh(s / cap) * cap
        return torch.matmul(torch.softmax(s, dim=-1), tv)
    return call


def _softcap_alibi_rows(fa, torch, rng, repeat):
    q, k, v = (rng.standard_normal((1, 12, 1024, 64)).astype(np.float32) for _ in range(3))
    calls = {"variant": lambda: fa.attention(q, k, v, softcap=30.0),
             "plain": lambda: fa.attention(q, k, v)}
    if torch is not None:
        calls["torch"] = _softcap_torch_call(torch, q, k, v, 30.0)
    rows = [("softcap", _time(calls, repeat), "eager: matmul, tanh, softmax, matmul")]
    slopes = 2.0 ** -np.arange(1, 13)
    calls = {"variant": lambda: fa.attention(q, k, v, causal=True, alibi_slopes=slopes),
             "plain": lambda: fa.attention(q, k, v, causal=True)}
    if torch is not None:
        tq, tk, tv = (torch.from_numpy(a) for a in (q, k, v))
        tm = torch.from_numpy(_alibi_mask(slopes, 1024))
        sdpa = torch.nn.functional.scaled_dot_product_attention
        calls["torch"] = lambda: sdpa(tq, tk, tv, attn_mask=tm)
    rows.append(("alibi", _time(calls, repeat), "float mask"))
    return rows


def _sinks_row(fa, rng, repeat):
    qd = rng.standard_normal((1, 32, 1, 128)).astype(np.float32)
    kd, vd = (rng.standard_normal((1, 8, 8192, 128)).astype(np.float32) for _ in range(2))
    sinks = rng.standard_normal(32)
    return ("sinks", _time({
        "variant": lambda: fa.attention(qd, kd, vd, sinks=sinks),
        "plain": lambda: fa.attention(qd, kd, vd)}, repeat), None)


def _padded_torch_call(torch, padded, lens):
    L = padded[0].shape[2]
    tp = [torch.from_numpy(a) for a in padded]
    j = np.arange(L)
    # Key j visible to query i of prompt s iff j <= i and j < len[s] (padded queries
    # keep key 0 so that torch has no fully masked row to special-case).
    vis = (j[None, None] <= j[None, :, None]) & (j[None, None] < lens[:, None, None])
    vis[:, :, 0] = True
    tm = torch.from_numpy(np.where(vis, 0.0, -np.inf).astype(np.float32)[:, None])
    sdpa = torch.nn.functional.scaled_dot_product_attention
    return lambda: sdpa(*tp, attn_mask=tm)


def _varlen_row(fa, torch, rng, repeat):
    lens = rng.integers(64, 1025, size=16)
    cu = np.concatenate([[0], np.cumsum(lens)])
    packed = [rng.standard_normal((12, cu[-1], 64)).astype(np.float32) for _ in range(3)]
    padded = [np.zeros((16, 12, int(lens.max()), 64), np.float32) for _ in range(3)]
    for s in range(16):
        for p, a in zip(padded, packed):
            p[s, :, :lens[s]] = a[:, cu[s]:cu[s + 1]]
    calls = {"variant": lambda: fa.attention_varlen(*packed, cu, cu, causal=True),
             "plain": lambda: fa.attention(*padded, causal="top-left", kv_lengths=lens)}
    if torch is not None:
        calls["torch"] = _padded_torch_call(torch, padded, lens)
    return ("varlen", _time(calls, repeat), "padded batch, float mask")


def rows(fa, torch, repeat):
    """``[(row name, {call: median s}, what torch gets or None)]``, in the table's order."""
    rng = np.random.default_rng(0)
    return (_softcap_alibi_rows(fa, torch, rng, repeat) + [_sinks_row(fa, rng, repeat)]
            + [_varlen_row(fa, torch, rng, repeat)])


def format_variants_table(measured):
    sym = symbols()

    def ms(s):
        return f"{s * 1e3:.3f} ms"
    table = []
    for name, t, torch_how in measured:
        tt = t.get("torch")
        table.append([name, ms(t["variant"]), ms(t["plain"]), f"{t['variant'] / t['plain']:.3f}",
                      ms(tt) if tt else sym["dash"],
                      f"{tt / t['variant']:.2f}{sym['x']}" if tt else sym["dash"],
                      torch_how if tt else (torch_how or "(no equivalent)")])
    header = ["row", "variant", "plain", "variant/plain", "torch", f"{sym['x']} torch",
              "torch gets"]
    return format_table(header, table, align="lrrrrrl")


def run(fa, threads, repeat, stdout):
    """Print the variants table on ``threads`` threads; return the exit status."""
    torch = harness.import_torch()
    with harness.hold_threads(threads, fa, torch):
        load = harness.OtherLoad()
        print(f"fastattn variants, {threads} threads, median of {repeat} alternating batches",
              file=stdout, flush=True)
        print(format_variants_table(rows(fa, torch, repeat)), file=stdout, flush=True)
        frac = load.fraction()
        if frac is not None:
            print(f"bg load {100 * frac[0]:.0f}% (other processes' CPU share; trust the "
                  "figures only when it is low)", file=stdout)
    return OK
