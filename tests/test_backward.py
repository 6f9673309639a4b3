"""The backward pass (attention_backward, attention_varlen_backward): gradients against the
NumPy oracle (fastattn.reference.attention_backward, float64) for every variant and their
combinations, the oracle itself against torch autograd, float32 accuracy by FlashAttention's
rule, 16-bit inputs, and the zero gradients of hidden rows and keys.  Reproducibility and
bad input: tests/test_reproducibility.py and tests/test_arguments.py."""
import tracemalloc

import numpy as np
import pytest

import fastattn
from fastattn import reference

from conftest import import_optional, make_qkv, qkv_shapes


def _keywords(rng, names, B, Hq, Lq, Lk):
    """The keywords of a forward call with the named variants, for batch B."""
    table = {
        "causal": dict(causal=True),
        "top-left": dict(causal="top-left"),
        "window": dict(window=(13, 3)),
        "bool mask": dict(mask=rng.random((B, Hq, Lq, Lk)) < 0.8),
        "float mask": dict(mask=rng.standard_normal((1, Hq, Lq, Lk)) * 0.5),
        "kv_lengths": dict(kv_lengths=np.array([Lk, max(1, Lk - 23)])[:B]),
        "q_lengths": dict(q_lengths=np.array([max(0, Lq - 9), Lq])[:B]),
        "softcap": dict(softcap=2.5),
        "alibi": dict(alibi_slopes=2.0 ** -np.linspace(1, 8, Hq)),
        "sinks": dict(sinks=np.where(np.arange(Hq) == 0, -np.inf, rng.standard_normal((B, Hq)))),
    }
    kw = {}
    for name in names:
        kw.update(table[name])
    return kw


def _grads(q, k, v, kw, rng, with_dlse=True):
    """fastattn's and the oracle's gradients for random dout (and dlse)."""
    out, lse = fastattn.attention(q, k, v, return_lse=True, **kw)
    dout = rng.standard_normal(out.shape).astype(out.dtype)
    dlse = rng.standard_normal(lse.shape).astype(lse.dtype) if with_dlse else None
    got = fastattn.attention_backward(dout, q, k, v, out, lse, dlse=dlse, **kw)
    want = reference.attention_backward(dout, q, k, v, out, lse, dlse=dlse, **kw)
    return got, want


def _max_rel(got, want):
    scale = max(float(np.max(np.abs(want.astype(np.float64)))), 1e-300) if want.size else 1.0
    return float(np.max(np.abs(got.astype(np.float64) - want.astype(np.float64)))) / scale \
        if want.size else 0.0


COMBOS = [
    (), ("causal",), ("top-left",), ("window",), ("bool mask",), ("float mask",),
    ("kv_lengths",), ("q_lengths",), ("softcap",), ("alibi",), ("sinks",),
    ("causal", "kv_lengths", "q_lengths"), ("window", "softcap", "alibi"),
    ("causal", "bool mask", "sinks"), ("top-left", "float mask", "softcap", "sinks"),
    ("causal", "window", "kv_lengths", "q_lengths", "softcap", "alibi", "sinks", "float mask"),
]
SHAPES = [  # B, Hq, Hkv, Lq, Lk, D, Dv: edges of blocks, GQA, Lq != Lk, a decode row
    (2, 4, 2, 45, 70, 16, 24),
    (1, 3, 1, 130, 200, 72, 40),
    (2, 2, 2, 1, 150, 8, 8),
]


@pytest.mark.parametrize("combo", COMBOS, ids=lambda c: "+".join(c) or "plain")
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_float64_against_the_oracle(combo, shape):
    rng = np.random.default_rng(hash(combo) % 2**32)
    B, Hq, Hkv, Lq, Lk, D, Dv = shape
    q, k, v = make_qkv(rng, *qkv_shapes((B,), Hq, Hkv, Lq, Lk, D, Dv), np.float64)
    kw = _keywords(rng, combo, B, Hq, Lq, Lk)
    got, want = _grads(q, k, v, kw, rng)
    assert len(got) == len(want) == (4 if "sinks" in combo else 3)
    for name, g, w in zip(("dq", "dk", "dv", "dsinks"), got, want):
        assert g.shape == w.shape and g.dtype == w.dtype, name
        assert np.all(np.isfinite(g)), name
        assert _max_rel(g, w) < 1e-12, (name, _max_rel(g, w))


def test_broadcast_batch_dims_are_summed():
    # k, v shared by the batch (and q by the heads' batch axis): their gradients sum.
    rng = np.random.default_rng(1)
    q = rng.standard_normal((3, 2, 4, 33, 16))
    k = rng.standard_normal((1, 2, 2, 40, 16))
    v = rng.standard_normal((3, 1, 2, 40, 8))
    kw = dict(causal=True, sinks=rng.standard_normal(4))
    got, want = _grads(q, k, v, kw, rng)
    for g, w, x in zip(got, want, (q, k, v, kw["sinks"])):
        assert g.shape == np.shape(x)
        assert _max_rel(g, w) < 1e-12


def test_single_head_inputs():
    rng = np.random.default_rng(2)
    q, k, v = (rng.standard_normal((n, 8)) for n in (20, 31, 31))
    got, want = _grads(q, k, v, dict(causal=True), rng)
    for g, w, x in zip(got, want, (q, k, v)):
        assert g.shape == x.shape and _max_rel(g, w) < 1e-12


def test_varlen_against_the_oracle_per_sequence():
    rng = np.random.default_rng(3)
    cu_q, cu_k = np.array([0, 37, 37, 140, 141]), np.array([0, 50, 61, 200, 330])
    q = rng.standard_normal((4, 141, 24))
    k = rng.standard_normal((2, 330, 24))
    v = rng.standard_normal((2, 330, 16))
    kw = dict(causal=True, window=(40, -1), softcap=3.0, alibi_slopes=[0.5, 0.25, 0.1, 0.05],
              sinks=[0.3, -np.inf, 1.0, -0.5])
    out, lse = fastattn.attention_varlen(q, k, v, cu_q, cu_k, return_lse=True, **kw)
    dout, dlse = rng.standard_normal(out.shape), rng.standard_normal(lse.shape)
    dq, dk, dv, ds = fastattn.attention_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k,
                                                        dlse=dlse, **kw)
    want_ds = np.zeros(4)
    for s in range(4):
        r, c = slice(cu_q[s], cu_q[s + 1]), slice(cu_k[s], cu_k[s + 1])
        w = reference.attention_backward(dout[:, r], q[:, r], k[:, c], v[:, c], dlse=dlse[:, r],
                                         **kw)
        for g, x in zip((dq[:, r], dk[:, c], dv[:, c]), w):
            np.testing.assert_allclose(g, x, rtol=0, atol=1e-12 * max(1, np.abs(x).max(initial=0)))
        want_ds += w[3]
    np.testing.assert_allclose(ds, want_ds, rtol=1e-12, atol=1e-12)


# --------------------------------------------------------------------------- torch

torch_cases = pytest.mark.parametrize("combo", [
    (), ("causal",), ("top-left", "kv_lengths"), ("window", "q_lengths"), ("bool mask",),
    ("float mask", "softcap"), ("alibi", "causal"), ("sinks", "causal", "q_lengths"),
    ("causal", "window", "kv_lengths", "q_lengths", "softcap", "alibi", "sinks", "float mask"),
], ids=lambda c: "+".join(c) or "plain")


def _torch_attention(torch, q, k, v, kw, sinks, dtype):
    """out and lse of a materialised attention in torch, differentiable in q, k, v, sinks;
    visibility and ALiBi come from the reference (constants)."""
    B, Hq, Lq, _ = q.shape
    Hkv, Lk = k.shape[1], k.shape[2]
    G = Hq // Hkv
    kk, vv = k.repeat_interleave(G, dim=1), v.repeat_interleave(G, dim=1)
    s = kw.get("scale", q.shape[-1] ** -0.5) * q @ kk.transpose(-1, -2)
    if "softcap" in kw:
        s = kw["softcap"] * torch.tanh(s / kw["softcap"])
    q_len = np.broadcast_to(kw.get("q_lengths", Lq), (B,))
    kv_len = np.broadcast_to(kw.get("kv_lengths", Lk), (B,))
    if "alibi_slopes" in kw:
        bias = reference._alibi_bias(np.broadcast_to(kw["alibi_slopes"], (B, Hq)), q_len, kv_len,
                                     Lq, Lk)
        s = s + torch.tensor(bias, dtype=dtype)
    visible = reference.visible_keys((B,), Lq, Lk, causal=kw.get("causal", False),
                                     window=kw.get("window"), kv_lengths=kv_len, q_lengths=q_len)
    mask = kw.get("mask")
    if mask is not None and mask.dtype == bool:
        visible = visible & mask
    elif mask is not None:
        s = s + torch.tensor(mask, dtype=dtype)
    vis = torch.tensor(np.broadcast_to(visible, s.shape).copy())
    s = s.masked_fill(~vis, -torch.inf)
    logits = s
    if sinks is not None:
        rows = torch.tensor(np.arange(Lq)[None, :] < q_len[:, None])[:, None, :, None]
        sink_col = sinks[:, :, None, None].expand(B, Hq, Lq, 1)
        logits = torch.cat([s, sink_col.masked_fill(~rows, -torch.inf)], dim=-1)
    m = logits.amax(-1, keepdim=True).detach()
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    e = torch.exp(logits - m)
    den = e.sum(-1, keepdim=True)
    safe = torch.where(den == 0, torch.ones_like(den), den)
    p = (e / safe)[..., :Lk]
    lse = torch.where(den[..., 0] == 0, -torch.inf, (m + torch.log(safe))[..., 0])
    return p @ vv, lse


def _torch_grads(torch, q, k, v, kw, dout, dlse, dtype):
    t = [torch.tensor(a, dtype=dtype, requires_grad=True) for a in (q, k, v)]
    ts = None
    if "sinks" in kw:
        ts = torch.tensor(kw["sinks"], dtype=dtype, requires_grad=True)
        t.append(ts)
    out, lse = _torch_attention(torch, t[0], t[1], t[2], kw, ts, dtype)
    live = torch.isfinite(lse)
    loss = (out * torch.tensor(dout, dtype=dtype)).sum() + torch.where(
        live, lse * torch.tensor(dlse, dtype=dtype), torch.zeros_like(lse)).sum()
    return [g.numpy() for g in torch.autograd.grad(loss, t)]


@torch_cases
def test_oracle_and_kernel_against_torch_autograd(combo):
    torch = import_optional("torch")
    rng = np.random.default_rng(4)
    B, Hq, Hkv, Lq, Lk, D, Dv = 2, 4, 2, 40, 75, 16, 12
    q, k, v = make_qkv(rng, *qkv_shapes((B,), Hq, Hkv, Lq, Lk, D, Dv), np.float64)
    kw = _keywords(rng, combo, B, Hq, Lq, Lk)
    out, lse = fastattn.attention(q, k, v, return_lse=True, **kw)
    dout, dlse = rng.standard_normal(out.shape), rng.standard_normal(lse.shape)
    want = _torch_grads(torch, q, k, v, kw, dout, dlse, torch.float64)
    got = fastattn.attention_backward(dout, q, k, v, out, lse, dlse=dlse, **kw)
    oracle = reference.attention_backward(dout, q, k, v, dlse=dlse, **kw)
    for g, o, w in zip(got, oracle, want):
        assert _max_rel(g, w) < 1e-12
        assert _max_rel(o, w) < 1e-12


@torch_cases
def test_float32_within_flash_attention_rule(combo):
    # max |fastattn float32 - float64| <= 3 x max |the materialised formula in float32 -
    # float64|, per gradient.
    torch = import_optional("torch")
    rng = np.random.default_rng(5)
    B, Hq, Hkv, Lq, Lk, D, Dv = 2, 4, 2, 96, 160, 64, 64
    q, k, v = make_qkv(rng, *qkv_shapes((B,), Hq, Hkv, Lq, Lk, D, Dv), np.float32)
    kw = _keywords(rng, combo, B, Hq, Lq, Lk)
    if "float mask" in combo:
        kw["mask"] = kw["mask"].astype(np.float32)
    out, lse = fastattn.attention(q, k, v, return_lse=True, **kw)
    dout = rng.standard_normal(out.shape).astype(np.float32)
    dlse = rng.standard_normal(lse.shape).astype(np.float32)
    got = fastattn.attention_backward(dout, q, k, v, out, lse, dlse=dlse, **kw)
    exact = reference.attention_backward(dout, q, k, v, dlse=dlse,
                                         **{n: (x.astype(np.float64) if n == "mask" else x)
                                            for n, x in kw.items()})
    f32 = _torch_grads(torch, q, k, v, kw, dout, dlse, torch.float32)
    for name, g, e, t in zip(("dq", "dk", "dv", "dsinks"), got, exact, f32):
        assert g.dtype == (np.float64 if name == "dsinks" else np.float32)   # float64 sinks
        err = np.abs(g.astype(np.float64) - e).max()
        base = np.abs(t.astype(np.float64) - e).max()
        assert err <= 3 * base, (name, err, base)



@pytest.mark.parametrize("sinks", [False, True], ids=["plain", "sinks"])
def test_dq_does_not_carry_the_rounding_of_lse(sinks):
    # lse in float32 is off by up to an ulp, which scales all of a row's P alike; where
    # ALiBi puts P on a few keys, that scale was dq's largest error (3.5x torch float32's
    # on FlashAttention's causal MQA D 32 case).  dq divides it out: with lse moved by 16
    # of its ulps, dq stays as close to float64 as with the forward's own lse (before,
    # 11x further off).  dk and dv sum over many rows, whose lse errors do not add up alike.
    rng = np.random.default_rng(7)
    q, k, v = (rng.standard_normal((1, 4, 64, 32), dtype=np.float32) for _ in range(3))
    kw = dict(causal=True, alibi_slopes=np.array([0.05, 0.2, 0.5, 1.0], np.float32))
    if sinks:
        kw["sinks"] = rng.standard_normal(4).astype(np.float32)
    out, lse = fastattn.attention(q, k, v, return_lse=True, **kw)
    dout = rng.standard_normal(out.shape, dtype=np.float32)
    want = reference.attention_backward(*(x.astype(np.float64) for x in (dout, q, k, v)),
                                        **{n: x.astype(np.float64) for n, x in kw.items()
                                           if n != "causal"}, causal=True)[0]
    moved = (lse.astype(np.float64) + 16 * np.spacing(np.abs(lse))).astype(np.float32)
    errors = [np.abs(fastattn.attention_backward(dout, q, k, v, out, x, **kw)[0] - want).max()
              for x in (lse, moved)]
    assert errors[1] <= 2 * errors[0], errors


@pytest.mark.parametrize("seed", range(4))
def test_dsinks_adds_no_rounding_to_that_of_out_and_lse(seed):
    # dsink = -sum_i exp(sink - lse_i) Delta_i adds up every row of its head.  With each
    # row's Delta rounded to float32, dsink was up to 12x further from float64 than the
    # float32 out and lse alone leave (seeds 1-3 here; and over 3x torch float32's error on
    # an Intel Xeon); Delta summed in float64 leaves that floor alone.
    rng = np.random.default_rng(seed)
    q, k, v = make_qkv(rng, *qkv_shapes((1,), 2, 1, 512, 512, 64, 256), np.float32)
    sinks = rng.standard_normal(2).astype(np.float32)
    out, lse = fastattn.attention(q, k, v, return_lse=True, sinks=sinks)
    dout, dlse = (rng.standard_normal(a.shape, dtype=np.float32) for a in (out, lse))
    dsinks = fastattn.attention_backward(dout, q, k, v, out, lse, dlse=dlse, sinks=sinks)[3]
    exact = reference.attention_backward(dout, q, k, v, dlse=dlse, sinks=sinks)[3]
    # the formula in float64 over the float32 out and lse: what any float32 forward leaves
    delta = (dout.astype(np.float64) * out).sum(-1) - dlse
    floor = np.abs(-(np.exp(sinks[:, None] - lse.astype(np.float64)) * delta).sum((0, 2))
                   - exact).max()
    assert np.abs(dsinks - exact).max() <= 1.25 * floor, (np.abs(dsinks - exact).max(), floor)


def test_dsinks_with_empty_value_rows():
    # Dv = 0: out is empty, so Delta is -dlse alone; the sinks still get their gradient.
    rng = np.random.default_rng(9)
    q, k, v = make_qkv(rng, *qkv_shapes((2,), 4, 2, 6, 9, 8, 0), np.float32)
    sinks = rng.standard_normal(4).astype(np.float32)
    out, lse = fastattn.attention(q, k, v, return_lse=True, causal=True, sinks=sinks)
    dlse = rng.standard_normal(lse.shape).astype(np.float32)
    got = fastattn.attention_backward(np.zeros_like(out), q, k, v, out, lse, dlse=dlse,
                                      causal=True, sinks=sinks)
    want = reference.attention_backward(np.zeros_like(out), q, k, v, dlse=dlse, causal=True,
                                        sinks=sinks)
    assert got[2].shape == v.shape
    np.testing.assert_allclose(got[3], want[3], rtol=1e-6, atol=1e-7)


# --------------------------------------------------------------------------- 16-bit

@pytest.mark.parametrize("kind", ["float16", "bfloat16"])
def test_16bit_inputs(kind):
    if kind == "bfloat16":
        dtype = import_optional("ml_dtypes").bfloat16
        tol = 2.0 ** -7
    else:
        dtype, tol = np.float16, 2.0 ** -10
    rng = np.random.default_rng(6)
    q, k, v = make_qkv(rng, batch=(2,), Hq=4, Hkv=2, Lq=70, Lk=90, D=32, Dv=16, dtype=dtype)
    kw = dict(causal=True, softcap=5.0, q_lengths=[70, 50])
    out, lse = fastattn.attention(q, k, v, return_lse=True, **kw)
    assert out.dtype == dtype and lse.dtype == np.float32
    dout = rng.standard_normal(out.shape).astype(dtype)
    got = fastattn.attention_backward(dout, q, k, v, out, lse, **kw)
    # the oracle from the same (16-bit) values, out included
    want = reference.attention_backward(dout, q, k, v, **kw)
    for g, w in zip(got, want):
        assert g.dtype == dtype
        # computed in float32, rounded once: within a few 16-bit ulps of the largest value
        err = np.abs(g.astype(np.float64) - w.astype(np.float64)).max()
        assert err <= 4 * tol * np.abs(w.astype(np.float64)).max()
    # mixed 16-bit and float32 inputs compute in float32 and give each input's dtype
    q32 = q.astype(np.float32)
    out, lse = fastattn.attention(q32, k, v, return_lse=True)
    dq, dk, dv = fastattn.attention_backward(out, q32, k, v, out, lse)
    assert (dq.dtype, dk.dtype, dv.dtype) == (np.float32, dtype, dtype)


# --------------------------------------------------------------------------- hidden rows

def test_hidden_rows_and_keys_get_finite_zeros():
    rng = np.random.default_rng(7)
    q, k, v = make_qkv(rng, batch=(2,), Hq=2, Hkv=1, Lq=30, Lk=40, D=8, dtype=np.float64)
    k[1, :, 25:] = np.nan      # past kv_lengths: garbage that must not be read
    v[1, :, 25:] = np.inf
    mask = np.ones((2, 2, 30, 40), bool)
    mask[0, 1, 3] = False      # a row that sees nothing
    kw = dict(kv_lengths=[40, 25], q_lengths=[30, 20], mask=mask)
    out, lse = fastattn.attention(q, k, v, return_lse=True, **kw)
    dout = rng.standard_normal(out.shape)
    dout[1, :, 20:] = np.nan   # padding rows: dout there has no effect
    dlse = rng.standard_normal(lse.shape)
    dlse[1, :, 20:] = np.inf
    dq, dk, dv = fastattn.attention_backward(dout, q, k, v, out, lse, dlse=dlse, **kw)
    for g in (dq, dk, dv):
        assert np.all(np.isfinite(g))
    assert not dq[1, :, 20:].any() and not dq[0, 1, 3].any()
    assert not dk[1, :, 25:].any() and not dv[1, :, 25:].any()
    clean = dout.copy()
    clean[1, :, 20:] = 0
    dlse[1, :, 20:] = 0
    again = fastattn.attention_backward(clean, q, k, v, out, lse, dlse=dlse, **kw)
    for g, h in zip((dq, dk, dv), again):
        assert np.array_equal(g, h)


# --------------------------------------------------------------------------- the oracle's call

def test_the_oracle_takes_the_same_call():
    # reference.attention_backward has fastattn.attention_backward's signature: out and
    # lse are taken (optional), checked by the same rules, and not read.
    import inspect
    fast = inspect.signature(fastattn.attention_backward).parameters
    oracle = inspect.signature(reference.attention_backward).parameters
    assert [(n, p.kind) for n, p in fast.items()] == [(n, p.kind) for n, p in oracle.items()]
    rng = np.random.default_rng(10)
    q, k, v = make_qkv(rng, batch=(2,), Hq=2, Hkv=1, Lq=7, Lk=9, D=8, Dv=4, dtype=np.float64)
    out, lse = fastattn.attention(q, k, v, return_lse=True, causal=True)
    dout = rng.standard_normal(out.shape)
    with_results = reference.attention_backward(dout, q, k, v, out, lse, causal=True)
    for g, w in zip(with_results, reference.attention_backward(dout, q, k, v, causal=True)):
        assert np.array_equal(g, w)
    for f in (fastattn.attention_backward, reference.attention_backward):
        with pytest.raises(ValueError, match="lse must have the shape"):
            f(dout, q, k, v, out, lse[..., 1:], causal=True)
        with pytest.raises(TypeError, match="out must have the dtype"):
            f(dout, q, k, v, out.astype(np.float32), lse, causal=True)
    with pytest.raises(TypeError, match="together"):
        reference.attention_backward(dout, q, k, v, out, causal=True)


# --------------------------------------------------------------------------- NaN

@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("where", ["k", "q", "v"])
def test_a_nan_reaches_the_gradients_as_in_the_oracle(where, dtype):
    # A NaN in one element of q, k or v of a causal call: the rows whose out holds a NaN
    # get NaN dq in every column (Delta is NaN), and dq, dk, dv are NaN exactly where the oracle's are (one
    # tile of rows and keys: the kernel's products, like the oracle's dense ones, carry
    # 0 * NaN from a hidden key of the tile into a column).  Elsewhere the two agree.
    rng = np.random.default_rng(8)
    q, k, v = make_qkv(rng, batch=(1,), Hq=2, Hkv=1, Lq=6, D=8, dtype=dtype)
    {"q": q, "k": k, "v": v}[where][0, 0, 1, 3] = np.nan
    kw = dict(causal=True)
    out, lse = fastattn.attention(q, k, v, return_lse=True, **kw)
    dout = rng.standard_normal(out.shape).astype(dtype)
    got = fastattn.attention_backward(dout, q, k, v, out, lse, **kw)
    want = reference.attention_backward(dout, q, k, v, **kw)

    nan_rows = np.isnan(out).any(-1)
    assert nan_rows.any()
    assert np.isnan(got[0][nan_rows]).all()
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.isnan(g), np.isnan(w))
        finite = ~np.isnan(w)   # gradients of size 1 or so: float32 rounding
        np.testing.assert_allclose(g[finite], w[finite], rtol=0, atol=1e-5)


def test_a_nan_key_gives_nan_gradients_as_torch_does():
    # torch autograd through its SDPA agrees on every row whose out is NaN, and on dk, dv.
    torch = import_optional("torch")
    rng = np.random.default_rng(9)
    q, k, v = make_qkv(rng, batch=(1,), Lq=4, D=8, dtype=np.float64)
    k[0, 0, 1, 3] = np.nan
    out, lse = fastattn.attention(q, k, v, return_lse=True, causal=True)
    dout = rng.standard_normal(out.shape)
    dq, dk, dv = fastattn.attention_backward(dout, q, k, v, out, lse, causal=True)
    t = [torch.tensor(a, requires_grad=True) for a in (q, k, v)]
    o = torch.nn.functional.scaled_dot_product_attention(*t, is_causal=True)
    tq, tk, tv = (g.numpy() for g in torch.autograd.grad(o, t, torch.tensor(dout)))
    rows = np.isnan(o.detach().numpy()).any(-1)
    np.testing.assert_array_equal(rows, np.isnan(out).any(-1))
    assert np.isnan(dq[rows]).all() and np.isnan(tq[rows]).all()
    np.testing.assert_array_equal(np.isnan(dk), np.isnan(tk))
    np.testing.assert_array_equal(np.isnan(dv), np.isnan(tv))


def test_memory_is_not_quadratic():
    # A 4096 x 4096 backward: its probabilities alone would take 64 MiB in float32; the
    # backward allocates its gradients, Delta and per-thread workspaces only.
    rng = np.random.default_rng(6)
    q, k, v = (rng.standard_normal((1, 1, 4096, 16)).astype(np.float32) for _ in range(3))
    out, lse = fastattn.attention(q, k, v, causal=True, return_lse=True)
    tracemalloc.start()
    try:
        fastattn.attention_backward(out, q, k, v, out, lse, causal=True)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 8 * 2**20, peak
