"""Train a tiny character-level GPT on the CPU twice: with torch's SDPA and with fastattn.

    python benchmarks/train_tiny_gpt.py [--steps 200] [--plot losses.png]
                                        [--float32-precision float32|bfloat16]

The two runs start from the same weights and see the same batches; their steps alternate
(one step of each in turn), so both meet the same phases of the machine.  The script
prints both loss curves' agreement, the median step time of each and their ratio, and
the share of a step that attention takes (its forward and backward, timed alone at the
model's shape).  ``--plot`` draws the two loss curves (needs matplotlib; without it the
script exits with status 3 before training).  ``--float32-precision bfloat16`` opts
fastattn's float32 calls into bfloat16 products (``fastattn.set_float32_precision``, on
CPUs with AVX512-BF16), forward and backward; torch's SDPA run is unchanged by it.

The text is the Zen of Python, which every Python carries: nothing is downloaded.
"""
import argparse
import codecs
import contextlib
import io
import statistics
import sys
import time

import torch
from torch import nn
from torch.nn import functional as F

import fastattn
from fastattn.integrations import torch as fa_torch


def corpus():
    """The Zen of Python, which ``import this`` prints (ROT13-encoded in the module)."""
    with contextlib.redirect_stdout(io.StringIO()):
        import this
    return codecs.decode(this.s, "rot13")


class Block(nn.Module):
    def __init__(self, d_model, n_heads, sdpa):
        super().__init__()
        self.n_heads, self.sdpa = n_heads, sdpa
        self.ln1, self.ln2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(),
                                 nn.Linear(4 * d_model, d_model))

    def forward(self, x):
        B, L, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=-1)
        q, k, v = (t.view(B, L, self.n_heads, C // self.n_heads).transpose(1, 2)
                   for t in (q, k, v))
        y = self.sdpa(q, k, v, is_causal=True).transpose(1, 2).reshape(B, L, C)
        x = x + self.proj(y)
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    def __init__(self, vocab, block, d_model, n_heads, n_layers, sdpa):
        super().__init__()
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(block, d_model)
        self.blocks = nn.Sequential(*[Block(d_model, n_heads, sdpa) for _ in range(n_layers)])
        self.ln, self.head = nn.LayerNorm(d_model), nn.Linear(d_model, vocab)

    def forward(self, idx, targets):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        logits = self.head(self.ln(self.blocks(x)))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


SDPAS = {"torch SDPA": F.scaled_dot_product_attention,
         "fastattn": fa_torch.scaled_dot_product_attention}


def batches(data, n, batch, block, seed):
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        start = torch.randint(0, len(data) - block - 1, (batch,), generator=g)
        x = torch.stack([data[s:s + block] for s in start])
        y = torch.stack([data[s + 1:s + block + 1] for s in start])
        yield x, y


def step(model, opt, x, y):
    t0 = time.perf_counter()
    loss = model(x, y)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    return loss.item(), time.perf_counter() - t0


def attention_time(sdpa, shape, repeats=20):
    """Median time of one attention forward and backward at ``shape`` (B, H, L, D)."""
    q, k, v = (torch.randn(shape, requires_grad=True) for _ in range(3))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        sdpa(q, k, v, is_causal=True).sum().backward()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[2:])


def train(a):
    """Both models trained on the same batches, steps alternating; the losses and step
    times of each, by name."""
    text = corpus()
    chars = sorted(set(text))
    data = torch.tensor([chars.index(c) for c in text])
    models, opts = {}, {}
    for name, sdpa in SDPAS.items():
        torch.manual_seed(0)
        models[name] = TinyGPT(len(chars), a.block, a.d_model, a.heads, a.layers, sdpa)
        opts[name] = torch.optim.AdamW(models[name].parameters(), lr=3e-3)
    losses = {name: [] for name in SDPAS}
    times = {name: [] for name in SDPAS}
    for i, (x, y) in enumerate(batches(data, a.steps, a.batch, a.block, seed=1)):
        for name in list(SDPAS) if i % 2 == 0 else list(reversed(SDPAS)):
            loss, dt = step(models[name], opts[name], x, y)
            losses[name].append(loss)
            times[name].append(dt)
    return losses, times


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--block", type=int, default=128)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--plot", metavar="FILE.png")
    p.add_argument("--float32-precision", choices=("float32", "bfloat16"), default="float32",
                   help="fastattn's float32 precision (fastattn.set_float32_precision): "
                        "float32, exact (default), or bfloat16 products")
    a = p.parse_args(argv)
    plt = None
    if a.plot:   # checked before training, so that a missing matplotlib costs nothing
        try:
            import matplotlib
            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            print("train_tiny_gpt.py: --plot needs matplotlib, which is not installed; "
                  "nothing was run.\nInstall it with:  pip install matplotlib   (or run "
                  "without --plot)", file=sys.stderr)
            return 3

    old = fastattn.set_float32_precision(a.float32_precision)
    try:
        return report(a, plt)
    finally:
        fastattn.set_float32_precision(old)


def report(a, plt):
    """Train, time attention alone, print, and plot with ``plt`` (None: no plot)."""
    losses, times = train(a)
    t_torch = statistics.median(times["torch SDPA"][5:])
    t_fa = statistics.median(times["fastattn"][5:])
    diff = max(abs(u - w) for u, w in zip(losses["torch SDPA"], losses["fastattn"]))
    shape = (a.batch, a.heads, a.block, a.d_model // a.heads)
    att = {name: a.layers * attention_time(sdpa, shape) for name, sdpa in SDPAS.items()}
    print(f"{a.steps} steps, batch {a.batch} x {a.block} characters, {a.layers} layers, "
          f"d_model {a.d_model}, {a.heads} heads; torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; fastattn's float32 precision "
          f"{a.float32_precision}")
    print(f"loss: first {losses['fastattn'][0]:.4f}, last {losses['fastattn'][-1]:.4f} "
          f"(torch SDPA: {losses['torch SDPA'][-1]:.4f}); largest difference at any step "
          f"{diff:.2e}")
    print(f"median step: torch SDPA {t_torch * 1e3:.1f} ms, fastattn {t_fa * 1e3:.1f} ms, "
          f"speed-up {t_torch / t_fa:.3f}x")
    for name in SDPAS:
        step_time = t_torch if name == "torch SDPA" else t_fa
        print(f"attention forward+backward ({name}): {att[name] * 1e3:.1f} ms per step, "
              f"{100 * att[name] / step_time:.0f}% of the step")
    if plt is not None:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        for name in SDPAS:
            ax.plot(losses[name], label=name, lw=1.2, ls="-" if name == "fastattn" else "--")
        ax.set_xlabel("step")
        ax.set_ylabel("training loss")
        ax.set_title(f"tiny GPT on the CPU: steps {t_torch / t_fa:.2f}x as fast with fastattn")
        ax.legend()
        fig.tight_layout()
        fig.savefig(a.plot, dpi=120)
        print(f"plot: {a.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
