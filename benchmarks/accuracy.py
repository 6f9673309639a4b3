"""float32 accuracy of fastattn against a float64 reference, beside PyTorch's float32 math.

    python benchmarks/accuracy.py [--heads 4]

For each head dim D in 32, 64, 128, 256 and each (Lq, Lk) of FlashAttention's test shapes,
with and without (bottom-right) causal masking, q, k, v are standard normal float32.  Both
fastattn and torch's math path (scaled_dot_product_attention with the MATH backend, or
NumPy's float32 matmul/softmax/matmul when torch is absent) are compared with
fastattn.reference on the same float32 inputs, computed in float64.  FlashAttention's own
test rule asks a kernel's max error to stay within 2x that of the framework's float32 math;
the table gives both errors and, per D, the worst ratio over the shapes.
"""
import argparse

import numpy as np

import fastattn

# FlashAttention's tests/test_flash_attn.py seqlen pairs.
SHAPES = [(113, 203), (128, 217), (113, 211), (108, 256), (256, 512), (512, 256),
          (1024, 1024), (1023, 1024), (1024, 1023), (2048, 2048)]


def _math_torch(torch, q, k, v, mask):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    t = [torch.from_numpy(x) for x in (q, k, v)]
    m = None if mask is None else torch.from_numpy(mask)
    with sdpa_kernel(SDPBackend.MATH):
        return torch.nn.functional.scaled_dot_product_attention(*t, attn_mask=m).numpy()


def _math_numpy(q, k, v, mask):
    s = (q @ np.swapaxes(k, -1, -2)) * np.float32(1 / np.sqrt(q.shape[-1]))
    if mask is not None:
        s = np.where(mask, s, np.float32(-np.inf))
    p = np.exp(s - s.max(-1, keepdims=True))
    return (p / p.sum(-1, keepdims=True)) @ v


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--heads", type=int, default=4)
    args = ap.parse_args()
    try:
        import torch
        math, name = (lambda *a: _math_torch(torch, *a)), "torch f32 math"
    except ImportError:
        math, name = _math_numpy, "numpy f32 math"
    rng = np.random.default_rng(0)
    print(f"{'D':>4} {'fastattn max err':>17} {name + ' max err':>22} {'ratio':>6} "
          f"{'worst shape ratio':>18}")
    for D in (32, 64, 128, 256):
        fa_err, m_err = [], []
        for Lq, Lk in SHAPES:
            q, k, v = (rng.standard_normal((1, args.heads, L, D)).astype(np.float32)
                       for L in (Lq, Lk, Lk))
            for causal in (False, True):
                mask = None
                if causal:
                    mask = np.arange(Lk)[None] <= np.arange(Lq)[:, None] + (Lk - Lq)
                ref = fastattn.reference.attention(*(x.astype(np.float64) for x in (q, k, v)),
                                                   causal=causal)
                out = fastattn.attention(q, k, v, causal=causal)
                fa_err.append(float(np.abs(out - ref).max()))
                m_err.append(float(np.abs(math(q, k, v, mask) - ref).max()))
        worst = max(a / b for a, b in zip(fa_err, m_err))
        print(f"{D:>4} {max(fa_err):>17.3e} {max(m_err):>22.3e} "
              f"{max(fa_err) / max(m_err):>6.2f} {worst:>18.2f}")


if __name__ == "__main__":
    main()
