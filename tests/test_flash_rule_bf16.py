"""bfloat16 accuracy under FlashAttention's test rule, through the torch operation.

The rule of tests/test_flash_rule.py, for bfloat16 inputs: fastattn's largest error
against the float64 reference is at most twice that of torch's plain bfloat16 attention
forward, and three times backward (FlashAttention's factor for gradients), plus twice the
rounding noise of the reference in bfloat16 (about one bfloat16 ulp at the outputs' size):

    max|out - ref| <= 2 max|out_torch - ref| + 2 max|fl(fl(ref + 0.3) - 0.3) - ref|

``ref`` and its gradients are float64 autograd of the textbook attention on the same
bfloat16 values.  ``out_torch`` is that textbook attention run in bfloat16 by torch --
matmul, scale, softcap, bias, softmax, matmul, each rounded to bfloat16 -- as
FlashAttention's ``attention_ref(upcast=False)`` is; its gradients come from torch's
autograd of it.  fastattn runs through ``fastattn.integrations.torch.attention`` with
bfloat16 tensors: on CPUs with AVX512-BF16 the forward multiplies in bfloat16 pairs (P
rounded to bfloat16), and again on AMX tiles (their scalar model, and the hardware where
there is one); elsewhere in float32.  Its backward computes in float32 from the
bfloat16 inputs.

Cases: MHA and GQA, D 64 and 128, causal or not, a sliding window, softcap and ALiBi, on
FlashAttention's decode row and odd lengths.
"""
import math

import numpy as np
import pytest

from conftest import import_optional

from fastattn import reference
from fastattn._machine.isa import ISA, kernel

CASES = [
    # (Lq, Lk, D, Hkv, causal, window, softcap, alibi)
    (1, 147, 128, 2, False, None, None, False),
    (113, 203, 64, 6, False, None, None, False),
    (113, 203, 128, 2, True, None, None, False),
    (128, 217, 64, 2, True, (40, 0), None, False),
    (108, 256, 128, 6, False, (30, 20), None, False),
    (113, 211, 64, 6, True, None, 30.0, False),
    (256, 256, 128, 2, False, None, 50.0, False),
    (113, 211, 64, 2, True, None, None, True),
    (200, 256, 128, 6, False, (64, 64), None, True),
]
HEADS = 6


def textbook(torch, q, k, v, causal, window, softcap, slopes):
    """Attention in the dtype of q, k, v, one rounding per operation; GQA by repeating K
    and V over the query heads."""
    group = q.shape[1] // k.shape[1]
    k, v = (x.repeat_interleave(group, dim=1) for x in (k, v))
    Lq, Lk = q.shape[2], k.shape[2]
    s = (q @ k.transpose(-1, -2)) * (1 / math.sqrt(q.shape[-1]))
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    if slopes is not None:
        i = torch.arange(Lq, dtype=torch.float64)[:, None] + (Lk - Lq)
        j = torch.arange(Lk, dtype=torch.float64)[None, :]
        bias = -torch.as_tensor(slopes)[:, None, None] * (i - j).abs()
        s = s + bias.to(s.dtype)
    visible = torch.from_numpy(np.array(reference.visible_keys((), Lq, Lk, causal=causal,
                                                               window=window)))
    s = s.masked_fill(~visible, float("-inf"))
    return torch.softmax(s, dim=-1) @ v


def errors(torch, case, seed=0):
    """(fastattn's max error, torch's, noise) for out, dq, dk, dv."""
    from fastattn.integrations import torch as fa_torch
    Lq, Lk, D, Hkv, causal, window, softcap, alibi = case
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(2, HEADS, Lq, D, generator=gen).bfloat16()
    k, v = (torch.randn(2, Hkv, Lk, D, generator=gen).bfloat16() for _ in range(2))
    dout = torch.randn(2, HEADS, Lq, D, generator=gen).bfloat16()
    slopes = (np.exp2(-np.arange(1, HEADS + 1) / 2) if alibi else None)
    kw = dict(causal=causal, window=window, softcap=softcap, alibi_slopes=slopes)

    def run(fn, dtype):
        xs = [x.detach().to(dtype).requires_grad_() for x in (q, k, v)]
        out = fn(*xs)
        out.backward(dout.to(dtype))
        return [out.detach().double()] + [x.grad.double() for x in xs]

    ref = run(lambda *x: textbook(torch, *x, causal, window, softcap, slopes), torch.float64)
    pt = run(lambda *x: textbook(torch, *x, causal, window, softcap, slopes), torch.bfloat16)
    fa = run(lambda *x: fa_torch.attention(*x, **kw), torch.bfloat16)
    res = []
    for r, p, f in zip(ref, pt, fa):
        r16 = r.bfloat16()
        noise = ((r16 + 0.3).bfloat16() - 0.3).bfloat16().double() - r16.double()
        res.append((float((f - r).abs().max()), float((p - r).abs().max()),
                    2 * float(noise.abs().max())))
    return res


def case_id(case):
    Lq, Lk, D, Hkv, causal, window, softcap, alibi = case
    parts = [f"{Lq}x{Lk}", f"D{D}", "mha" if Hkv == HEADS else "gqa",
             "causal" if causal else "full"]
    parts += ["window"] * (window is not None) + ["softcap"] * bool(softcap)
    return "-".join(parts + ["alibi"] * alibi)


# The forward's products on bfloat16 pairs, and on AMX tiles: the scalar model of the
# tile instructions wherever the pairs run, the hardware where the CPU has AMX.
TILES = ["off"] + ["model"] * kernel.bf16_dot() + ["hw"] * kernel.amx_cpu()


@pytest.mark.parametrize("tiles", TILES, ids=lambda m: f"amx-{m}")
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_bfloat16_within_flash_rule(case, tiles):
    torch = import_optional("torch")
    import_optional("ml_dtypes")
    products = "bfloat16 products" if kernel.bf16_dot() else "float32 products"
    old = kernel.set_amx(tiles)
    try:
        errs = errors(torch, case)
    finally:
        kernel.set_amx(old)
    for name, factor, (err, err_torch, atol) in zip(("out", "dq", "dk", "dv"), (2, 3, 3, 3),
                                                    errs):
        assert err <= factor * err_torch + atol, (
            f"{name}: fastattn ({ISA} kernel, {products}, AMX {tiles}) error {err:.3e} > "
            f"{factor} x torch bfloat16's {err_torch:.3e} + {atol:.2e} "
            f"(ratio {err / err_torch:.2f})")
