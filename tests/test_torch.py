"""fastattn against PyTorch's scaled_dot_product_attention, when torch is installed.

This pins the meaning shared with PyTorch: the boolean mask (True = may attend), the
additive float mask, ``is_causal`` (= fastattn's causal for Lq == Lk, and "top-left"
otherwise), ``scale``, and GQA's head grouping. Comparisons are in float64 (torch computes
float64 on CPU) so the tolerance is the float64 one; one float32 check allows for both
sides' float32 rounding. Rows that see no key are avoided: torch returns NaN there, where
the contract says zeros.
"""

import numpy as np
import pytest

from conftest import assert_close, import_optional, make_qkv

torch = import_optional("torch")
F = torch.nn.functional

import fastattn  # noqa: E402



def _has_gqa():
    # The function is a builtin without an inspectable signature: just try the keyword.
    try:
        F.scaled_dot_product_attention(torch.ones(1, 2, 1, 1), torch.ones(1, 1, 1, 1),
                                       torch.ones(1, 1, 1, 1), enable_gqa=True)
    except TypeError:
        return False
    return True


HAS_GQA = _has_gqa()


def sdpa(q, k, v, mask=None, **kw):
    t = lambda a: None if a is None else torch.from_numpy(np.ascontiguousarray(a))
    with torch.no_grad():
        return F.scaled_dot_product_attention(t(q), t(k), t(v), attn_mask=t(mask), **kw).numpy()


@pytest.mark.parametrize("L", [1, 7, 64, 257])
@pytest.mark.parametrize("D", [5, 64])
def test_is_causal_square(rng, L, D):
    q, k, v = make_qkv(rng, (2, 3, L, D), (2, 3, L, D), (2, 3, L, D), np.float64)
    expected = sdpa(q, k, v, is_causal=True)
    assert_close(fastattn.attention(q, k, v, causal=True), expected)
    assert_close(fastattn.attention(q, k, v, causal="top-left"), expected)
    assert_close(fastattn.attention(q, k, v), sdpa(q, k, v))


@pytest.mark.parametrize("Lq, Lk", [(5, 33), (33, 5), (1, 300), (257, 300)])
def test_is_causal_top_left(rng, Lq, Lk):
    # torch's is_causal is top-left aligned (j <= i) for Lq != Lk; every row sees key 0.
    q, k, v = make_qkv(rng, (2, Lq, 16), (2, Lk, 16), (2, Lk, 8), np.float64)
    assert_close(fastattn.attention(q, k, v, causal="top-left"), sdpa(q, k, v, is_causal=True))


@pytest.mark.parametrize("Lq, Lk", [(5, 33), (1, 300), (257, 300)])
def test_bottom_right_is_shifted_tril(rng, Lq, Lk):
    # fastattn's causal=True for Lq <= Lk is torch with the mask tril(k=Lk-Lq).
    q, k, v = make_qkv(rng, (2, Lq, 16), (2, Lk, 16), (2, Lk, 8), np.float64)
    mask = np.tril(np.ones((Lq, Lk), bool), k=Lk - Lq)
    assert_close(fastattn.attention(q, k, v, causal=True), sdpa(q, k, v, mask))


@pytest.mark.parametrize("mask_shape", [(9, 40), (1, 40), (2, 1, 40), (3, 2, 9, 40)])
def test_bool_and_float_masks(rng, mask_shape):
    q, k, v = make_qkv(rng, (3, 2, 9, 16), (3, 2, 40, 16), (3, 2, 40, 8), np.float64)
    bool_mask = rng.random(mask_shape) < 0.7
    bool_mask[..., 0] = True  # no empty rows: torch gives NaN there
    assert_close(fastattn.attention(q, k, v, mask=bool_mask), sdpa(q, k, v, bool_mask))
    float_mask = np.where(bool_mask, rng.standard_normal(mask_shape), -np.inf)
    assert_close(fastattn.attention(q, k, v, mask=float_mask), sdpa(q, k, v, float_mask))


@pytest.mark.parametrize("window", [(3, 0), (2, 2), (-1, 5)])
def test_window_as_mask(rng, window):
    Lq, Lk = 20, 50
    q, k, v = make_qkv(rng, (2, Lq, 8), (2, Lk, 8), (2, Lk, 8), np.float64)
    i, j = np.arange(Lq)[:, None], np.arange(Lk)[None, :]
    left, right = window
    off = Lk - Lq
    mask = np.ones((Lq, Lk), bool)
    if left != -1:
        mask &= j >= i + off - left
    if right != -1:
        mask &= j <= i + off + right
    assert_close(fastattn.attention(q, k, v, window=window), sdpa(q, k, v, mask))


@pytest.mark.parametrize("scale", [1.0, 0.05, 2.0])
def test_scale(rng, scale):
    q, k, v = make_qkv(rng, (2, 2, 7, 16), (2, 2, 33, 16), (2, 2, 33, 4), np.float64)
    assert_close(fastattn.attention(q, k, v, scale=scale, causal=True),
                 sdpa(q, k, v, scale=scale, is_causal=False,
                      mask=np.tril(np.ones((7, 33), bool), k=26)))


@pytest.mark.skipif(not HAS_GQA, reason="this torch has no enable_gqa")
@pytest.mark.parametrize("Hq, Hkv", [(4, 2), (8, 1), (6, 3)])
def test_gqa(rng, Hq, Hkv):
    q, k, v = make_qkv(rng, (2, Hq, 33, 16), (2, Hkv, 33, 16), (2, Hkv, 33, 8), np.float64)
    assert_close(fastattn.attention(q, k, v, causal=True),
                 sdpa(q, k, v, is_causal=True, enable_gqa=True))


def test_float32(rng):
    q, k, v = make_qkv(rng, (2, 4, 300, 64), (2, 4, 300, 64), (2, 4, 300, 64), np.float32)
    out = fastattn.attention(q, k, v, causal=True)
    assert out.dtype == np.float32
    # Both sides are within the float32 tolerance of the exact result: allow twice that.
    np.testing.assert_allclose(out, sdpa(q, k, v, is_causal=True), rtol=2e-5, atol=4e-6)


def test_context_vectors():
    # An independent implementation ran torch in float32 on these inputs, unscaled
    # (scores = inputs @ inputs.T).
    x = np.array([[0.43, 0.15, 0.89], [0.55, 0.87, 0.66], [0.57, 0.85, 0.64],
                  [0.22, 0.58, 0.33], [0.77, 0.25, 0.10], [0.05, 0.80, 0.55]], np.float32)
    np.testing.assert_allclose(fastattn.attention(x, x, x, scale=1.0),
                               sdpa(x, x, x, scale=1.0), rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("name", ["float16", "bfloat16"])
def test_16_bit_inputs_match_torch_in_the_same_dtype(rng, name):
    # torch's SDPA on float16 / bfloat16 tensors and fastattn on the same bits (bfloat16
    # through ml_dtypes) agree within two ulps of the 16-bit result: each rounds its
    # result once (torch's CPU kernel accumulates in float32 too).
    if name == "bfloat16":
        ml_dtypes = import_optional("ml_dtypes")
        dt, tdt = np.dtype(ml_dtypes.bfloat16), torch.bfloat16
    else:
        dt, tdt = np.dtype(np.float16), torch.float16
    q, k, v = make_qkv(rng, (2, 8, 1, 64), (2, 2, 300, 64), (2, 2, 300, 64), np.float32)
    q, k, v = (a.astype(dt) for a in (q, k, v))
    tq, tk, tv = (torch.from_numpy(a.view(np.int16)).view(tdt) for a in (q, k, v))
    with torch.no_grad():
        want = F.scaled_dot_product_attention(tq, tk, tv, enable_gqa=True).float().numpy()
    got = fastattn.attention(q, k, v)
    assert got.dtype == dt
    ulp = 2.0 ** (-10 if name == "float16" else -7)
    np.testing.assert_allclose(got.astype(np.float32), want, rtol=2 * ulp, atol=2 * ulp)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "float64"])
def test_without_grad_the_same_bits_as_through_autograd(dtype):
    # With nothing to differentiate the operation skips autograd's node; it must give
    # the bits, dtypes and lse of the recorded call.
    from fastattn.integrations import torch as fa_torch

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 37, 16, generator=g).to(getattr(torch, dtype))
               for _ in range(3))
    with torch.no_grad():
        plain, plain_lse = fa_torch.attention(q, k, v, causal=True, return_lse=True)
    recorded, lse = fa_torch.attention(q.clone().requires_grad_(), k, v, causal=True,
                                       return_lse=True)
    assert plain.grad_fn is None and recorded.grad_fn is not None
    assert plain.dtype == recorded.dtype == q.dtype and plain_lse.dtype == lse.dtype
    assert torch.equal(plain, recorded.detach()) and torch.equal(plain_lse, lse.detach())
    assert torch.equal(fa_torch.attention(q, k, v, causal=True), plain)


# --------------------------------------------------------------------------- precision

@pytest.fixture
def matmul_precision():
    old = torch.get_float32_matmul_precision()
    yield torch.set_float32_matmul_precision
    torch.set_float32_matmul_precision(old)


def _float32_case():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 33, 64, generator=g).requires_grad_() for _ in range(3))
    dout = torch.randn(2, 4, 33, 64, generator=g)
    return q, k, v, dout


def _through_torch(q, k, v, dout):
    """fastattn.integrations.torch.attention and its gradients."""
    from fastattn.integrations import torch as fa_torch

    out = fa_torch.attention(q, k, v, causal=True)
    return (out, *torch.autograd.grad(out, (q, k, v), dout))


def _through_numpy(q, k, v, dout):
    """fastattn.attention and fastattn.attention_backward on the same arrays."""
    q, k, v = (t.detach().numpy() for t in (q, k, v))
    out, lse = fastattn.attention(q, k, v, causal=True, return_lse=True)
    return (out, *fastattn.attention_backward(dout.numpy(), q, k, v, out, lse, causal=True))


def _assert_same_bits(got, want):
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g.detach().numpy(), w)


def test_torchs_matmul_precision_leaves_fastattn_exact(matmul_precision):
    # torch.set_float32_matmul_precision("medium") is a line many GPU training scripts
    # carry; torch's own CPU SDPA stays exact under it, and so do fastattn's integrations:
    # only fastattn's own setting changes its float32 arithmetic.
    q, k, v, dout = _float32_case()
    want = _through_numpy(q, k, v, dout)
    for precision in ("medium", "high", "highest"):
        matmul_precision(precision)
        assert fastattn.get_float32_precision() == "float32"
        _assert_same_bits(_through_torch(q, k, v, dout), want)


def test_fastattns_own_setting_applies_inside_the_integrations(matmul_precision):
    # fastattn's opt-in reaches calls through torch, whatever torch's setting says: the
    # integrations compute what fastattn.attention computes under the same setting.
    from fastattn._machine.isa import kernel

    q, k, v, dout = _float32_case()
    exact = _through_numpy(q, k, v, dout)
    matmul_precision("highest")
    with fastattn.float32_precision("bfloat16"):
        want = _through_numpy(q, k, v, dout)
        _assert_same_bits(_through_torch(q, k, v, dout), want)
    if kernel.bf16_dot():   # the opt-in changes the arithmetic only where the CPU has it
        assert not np.array_equal(want[0], exact[0])
