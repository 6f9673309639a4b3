"""fastattn.integrations.torch: differentiable drop-ins checked against torch itself.

Gradients are compared with torch autograd through ``F.scaled_dot_product_attention`` (and
through a materialised softmax for what torch's SDPA lacks) in float64, and with
``torch.autograd.gradcheck``'s finite differences.
"""
import numpy as np
import pytest

from conftest import import_optional

torch = import_optional("torch")
F = torch.nn.functional

from fastattn.integrations import torch as fa_torch  # noqa: E402


def _leaves(*shapes, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=g, dtype=dtype).requires_grad_(True) for s in shapes]


def _grads(fn, tensors, seed=1):
    """(output, gradients of <output, dout> with respect to ``tensors``)."""
    out = fn(*tensors)
    g = torch.Generator().manual_seed(seed)
    dout = torch.randn(out.shape, generator=g, dtype=torch.float64).to(out.dtype)
    return out, torch.autograd.grad(out, tensors, dout)


def _close(got, want, tol=1e-10):
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype
        scale = max(float(w.abs().max()), 1e-300)
        np.testing.assert_allclose(g.detach().numpy(), w.detach().numpy(), rtol=0,
                                   atol=tol * scale)


@pytest.mark.parametrize("keywords", [
    {}, {"is_causal": True}, {"scale": 0.3}, {"enable_gqa": True},
    {"attn_mask": "bool"}, {"attn_mask": "float"},
])
def test_sdpa_gradients_are_torchs(keywords):
    Hkv = 2 if keywords.get("enable_gqa") else 4
    q, k, v = _leaves((2, 4, 9, 8), (2, Hkv, 9, 8), (2, Hkv, 9, 5))
    if keywords.get("attn_mask") == "bool":
        keywords = dict(attn_mask=torch.rand(9, 9, generator=torch.Generator().manual_seed(2)) < 0.7)
        keywords["attn_mask"][:, 0] = True  # every row sees a key: torch's rows agree
    elif keywords.get("attn_mask") == "float":
        keywords = dict(attn_mask=torch.randn(1, 4, 9, 9, dtype=torch.float64))
    got = _grads(lambda *t: fa_torch.scaled_dot_product_attention(*t, **keywords), [q, k, v])
    want = _grads(lambda *t: F.scaled_dot_product_attention(*t, **keywords), [q, k, v])
    _close([got[0]], [want[0]])
    _close(got[1], want[1])


def test_sdpa_float32_matches_torch_to_float32_rounding():
    q, k, v = _leaves((1, 3, 33, 16), (1, 3, 33, 16), (1, 3, 33, 16), dtype=torch.float32)
    got = _grads(lambda *t: fa_torch.scaled_dot_product_attention(*t, is_causal=True), [q, k, v])
    want = _grads(lambda *t: F.scaled_dot_product_attention(*t, is_causal=True), [q, k, v])
    _close(got[1], want[1], tol=1e-5)


def _materialised(q, k, v, sinks=None, causal=False, softcap=None):
    """fastattn's attention with sinks and softcap, by the book in torch (float64)."""
    s = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    if causal:
        Lq, Lk = s.shape[-2:]
        hidden = torch.arange(Lk)[None, :] > torch.arange(Lq)[:, None] + (Lk - Lq)
        s = s.masked_fill(hidden, -torch.inf)
    if sinks is not None:
        sink = sinks[:, None, None].expand(*s.shape[:-1], 1)
        lse = torch.logsumexp(torch.cat([s, sink], dim=-1), dim=-1)
    else:
        lse = torch.logsumexp(s, dim=-1)
    return torch.exp(s - lse[..., None]) @ v, lse


@pytest.mark.parametrize("keywords", [{}, {"causal": True}, {"softcap": 2.0},
                                      {"causal": True, "softcap": 1.5}])
def test_attention_with_sinks_and_lse_gradients(keywords):
    q, k, v = _leaves((3, 6, 8), (3, 10, 8), (3, 10, 4))
    sinks = torch.tensor([0.5, -1.0, 2.0], dtype=torch.float64, requires_grad=True)
    g = torch.Generator().manual_seed(5)
    dout, dlse = torch.randn(3, 6, 4, generator=g, dtype=torch.float64), torch.randn(3, 6, generator=g, dtype=torch.float64)

    def loss(fn):
        out, lse = fn()
        return (out * dout).sum() + (lse * dlse).sum()

    got = torch.autograd.grad(loss(lambda: fa_torch.attention(
        q, k, v, sinks=sinks, return_lse=True, **keywords)), (q, k, v, sinks))
    want = torch.autograd.grad(loss(lambda: _materialised(q, k, v, sinks, **keywords)),
                               (q, k, v, sinks))
    _close(got, want)


def test_gradcheck():
    q, k, v = _leaves((2, 5, 4), (1, 6, 4), (1, 6, 3))
    sinks = torch.tensor([0.3, -0.2], dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda q, k, v, s: fa_torch.attention(q, k, v, sinks=s, causal=True, softcap=3.0,
                                              return_lse=True),
        (q, k, v, sinks))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_gradients_come_in_the_inputs_dtype(dtype):
    q, k, v = _leaves((2, 7, 8), (2, 7, 8), (2, 7, 8), dtype=dtype)
    out, grads = _grads(lambda *t: fa_torch.attention(*t, causal=True), [q, k, v])
    assert out.dtype == dtype and all(g.dtype == dtype for g in grads)
    want = _grads(lambda *t: fa_torch.attention(*t, causal=True),
                  [t.detach().double().requires_grad_(True) for t in (q, k, v)])[1]
    tol = {torch.float32: 1e-5, torch.float16: 2e-2, torch.bfloat16: 1e-1}[dtype]
    _close([g.double() for g in grads], want, tol=tol)


def test_what_it_refuses():
    q, k, v = _leaves((1, 2, 3, 4), (1, 1, 3, 4), (1, 1, 3, 4))
    with pytest.raises(NotImplementedError, match="dropout"):
        fa_torch.scaled_dot_product_attention(q, k, v, dropout_p=0.1, enable_gqa=True)
    with pytest.raises(ValueError, match="enable_gqa"):
        fa_torch.scaled_dot_product_attention(q, k, v)
    with pytest.raises(ValueError, match="is_causal"):
        fa_torch.scaled_dot_product_attention(q, k, v, attn_mask=torch.ones(3, 3, dtype=bool),
                                              is_causal=True, enable_gqa=True)
    with pytest.raises(NotImplementedError, match="mask"):
        fa_torch.scaled_dot_product_attention(
            q, k, v, attn_mask=torch.zeros(3, 3, dtype=torch.float64, requires_grad=True),
            enable_gqa=True)
    with pytest.raises(TypeError, match="q must be a torch.Tensor"):
        fa_torch.attention(q.detach().numpy(), k, v)
    with pytest.raises(TypeError, match="out"):
        fa_torch.attention(q, k, v, out=torch.empty(1, 2, 3, 4))
    out = fa_torch.attention(q, k, v)
    with pytest.raises(NotImplementedError, match="double backward"):
        torch.autograd.grad(out.sum(), q, create_graph=True)


def _softmax_attention(q, k, v):
    """Plain softmax attention in torch: differentiable twice."""
    s = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    return torch.softmax(s, dim=-1) @ v


@pytest.mark.parametrize("op", ["sdpa", "attention"])
def test_a_gradient_penalty_is_refused_not_wrong(op):
    # loss = sum(out) + |d sum(out) / dq|^2 needs the second derivative; fastattn's
    # backward is not differentiable, so the create_graph=True backward raises instead of
    # handing back a constant gradient (which gave a q.grad off by most of its size).
    fn = {"sdpa": fa_torch.scaled_dot_product_attention, "attention": fa_torch.attention}[op]
    (q,) = _leaves((1, 2, 6, 4))
    want_g = torch.autograd.grad(_softmax_attention(q, q, q).sum(), q, create_graph=True)[0]
    assert want_g.requires_grad  # the reference is differentiable: the case is real
    with pytest.raises(NotImplementedError, match="double backward"):
        torch.autograd.grad(fn(q, q, q).sum(), q, create_graph=True)
    # The first derivative alone is still torch's.
    (g,) = torch.autograd.grad(fn(q, q, q).sum(), q)
    _close([g], [want_g.detach()])


def test_attention_refuses_a_mask_that_requires_grad():
    # A float mask is a constant to fastattn: a mask that requires a gradient is refused,
    # as scaled_dot_product_attention does, rather than left with no gradient.
    (q,) = _leaves((1, 2, 5, 4))
    m = torch.randn(5, 5, dtype=torch.float64, requires_grad=True)
    with pytest.raises(NotImplementedError, match="mask"):
        fa_torch.attention(q, q, q, mask=m)
    slopes = torch.rand(2, dtype=torch.float64, requires_grad=True)
    with pytest.raises(NotImplementedError, match="alibi_slopes"):
        fa_torch.attention(q, q, q, alibi_slopes=slopes)
    # Detached, or without grad mode, the mask is taken (as torch's SDPA computes it).
    out = fa_torch.attention(q, q, q, mask=m.detach())
    _close([out], [F.scaled_dot_product_attention(q, q, q, attn_mask=m.detach())])
    with torch.no_grad():
        fa_torch.attention(q.detach(), q.detach(), q.detach(), mask=m)


@pytest.mark.parametrize("op", ["sdpa", "attention"])
def test_mixed_dtypes_are_computed_in_the_promoted_dtype(op):
    # float64 q with float32 k, v: computed in float64, as fastattn.attention does, so the
    # result is the float64 one (of the float32 values) to float64 rounding, and each
    # gradient comes in its input's dtype.
    fn = {"sdpa": fa_torch.scaled_dot_product_attention, "attention": fa_torch.attention}[op]
    q, k, v = _leaves((2, 3, 7, 8), (2, 3, 9, 8), (2, 3, 9, 5))
    k32, v32 = (t.detach().float().requires_grad_(True) for t in (k, v))
    k64, v64 = (t.detach().double().requires_grad_(True) for t in (k32, v32))
    out, grads = _grads(fn, [q, k32, v32])
    want_out, want = _grads(fn, [q, k64, v64])
    assert out.dtype == torch.float64 and [g.dtype for g in grads] == [
        torch.float64, torch.float32, torch.float32]
    _close([out], [want_out], tol=1e-13)
    _close([grads[0]], [want[0]], tol=1e-13)
    _close(grads[1:], [g.float() for g in want[1:]], tol=1e-7)  # one float32 rounding
    np.testing.assert_allclose(out.detach().numpy(), F.scaled_dot_product_attention(
        q, k64, v64).detach().numpy(), rtol=0, atol=1e-13)


def _tiny_gpt():
    """benchmarks/train_tiny_gpt.py as a module."""
    import importlib.util
    import os

    path = os.path.join(os.path.dirname(__file__), os.pardir, "benchmarks", "train_tiny_gpt.py")
    spec = importlib.util.spec_from_file_location("train_tiny_gpt", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    return example


def test_the_tiny_gpt_example_without_matplotlib_stops_before_training(monkeypatch, capsys):
    example = _tiny_gpt()
    monkeypatch.setitem(__import__("sys").modules, "matplotlib", None)   # not installed

    def train(a):
        raise AssertionError("trained before finding matplotlib missing")
    monkeypatch.setattr(example, "train", train)
    assert example.main(["--plot", "losses.png", "--steps", "2"]) == 3
    err = capsys.readouterr().err
    assert "--plot needs matplotlib" in err and "pip install matplotlib" in err


def test_the_tiny_gpt_example_trains_as_with_torchs_sdpa():
    # benchmarks/train_tiny_gpt.py, a few steps of a small model: the two runs' losses
    # agree step for step (float32 rounding only) and fall.
    import argparse

    example = _tiny_gpt()
    a = argparse.Namespace(steps=12, batch=4, block=32, d_model=32, heads=2, layers=2)
    losses, _ = example.train(a)
    ref, got = np.array(losses["torch SDPA"]), np.array(losses["fastattn"])
    np.testing.assert_allclose(got, ref, rtol=1e-4)
    assert got[-1] < got[0]


def test_the_tiny_gpt_example_opts_in_to_bfloat16_products_with_its_flag(monkeypatch):
    # --float32-precision sets fastattn's own setting for the run, and restores it after.
    import fastattn

    example = _tiny_gpt()
    seen = []

    class Stop(Exception):
        pass

    def train(a):
        seen.append(fastattn.get_float32_precision())
        raise Stop
    monkeypatch.setattr(example, "train", train)
    for flag in (["--float32-precision", "bfloat16"], []):
        with pytest.raises(Stop):
            example.main(["--steps", "2", *flag])
        assert fastattn.get_float32_precision() == "float32"
    assert seen == ["bfloat16", "float32"]
