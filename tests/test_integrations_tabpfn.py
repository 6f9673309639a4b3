"""fastattn as a TabPFN attention backend, at the level of TabPFN's SDPA wrapper.

``tabpfn.architectures.shared.scaled_dot_product_attention`` is the one function every
TabPFN architecture calls for attention.  Each test makes the same call twice on random
tensors: with ``backend="auto"`` (the registry picks fastattn) and with ``backend=None``
(TabPFN's own torch SDPA path), and compares.  No model weights are needed.  Tolerances are
those of tests/conftest.py for the result dtype (float32: 1e-5 relative, 2e-6 absolute).
"""
import numpy as np
import pytest

from conftest import assert_close, import_optional

torch = import_optional("torch")
import_optional("tabpfn")

from tabpfn.architectures.shared import attention_backends as ab  # noqa: E402
from tabpfn.architectures.shared.scaled_dot_product_attention import (  # noqa: E402
    scaled_dot_product_attention as sdpa,
)

import fastattn  # noqa: E402
from fastattn.integrations import tabpfn as fa_tabpfn  # noqa: E402


@pytest.fixture(autouse=True)
def registered():
    backend = fa_tabpfn.register()
    yield backend
    fa_tabpfn.unregister()


def bshd(shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype)


def both(q, k, v):
    """(fastattn's result, TabPFN's standard result, backends the auto call ran on)."""
    with torch.no_grad(), ab.recorded_attention_backends() as ran:
        got = sdpa(q, k, v)
    with torch.no_grad():
        expected = sdpa(q.double(), k.double(), v.double(), backend=None)
    return got, expected, ran


@pytest.mark.parametrize("B, Sq, Sk, Hq, Hkv, D, Dv", [
    (2, 50, 70, 4, 4, 16, 16),    # cross-attention (test rows to train rows)
    (3, 33, 33, 6, 2, 8, 8),      # GQA
    (1, 1, 129, 3, 1, 64, 32),    # one row, MQA, Dv != D
])
def test_same_call_with_and_without_backend(registered, B, Sq, Sk, Hq, Hkv, D, Dv):
    q = bshd((B, Sq, Hq, D))
    k = bshd((B, Sk, Hkv, D), seed=1)
    v = bshd((B, Sk, Hkv, Dv), seed=2)
    got, expected, ran = both(q, k, v)
    assert ran == [registered]
    assert got.shape == (B, Sq, Hq, Dv) and got.dtype == torch.float32
    assert_close(got.numpy(), expected.numpy())


def test_batch_broadcasts():
    # TabPFN's cache path passes keys with batch 1 for a batch of queries.
    q = bshd((4, 9, 2, 8))
    k = bshd((1, 12, 1, 8), seed=1)
    v = bshd((1, 12, 1, 8), seed=2)
    got, expected, ran = both(q, k, v)
    assert [b.name for b in ran] == ["fastattn"]
    assert got.shape == (4, 9, 2, 8)
    assert_close(got.numpy(), expected.numpy())


def test_float32_is_read_and_written_in_place(monkeypatch):
    seen = {}
    real = fastattn.attention

    def spy(q, k, v, **kw):
        seen.update(q=q, k=k, v=v, out=kw["out"])
        return real(q, k, v, **kw)

    monkeypatch.setattr(fastattn, "attention", spy)
    q, k, v = bshd((2, 5, 4, 8)), bshd((2, 7, 2, 8), seed=1), bshd((2, 7, 2, 8), seed=2)
    with torch.no_grad():
        out = sdpa(q, k, v)
    for name, t in (("q", q), ("k", k), ("v", v)):
        assert np.shares_memory(seen[name], t.numpy()), name
    assert np.shares_memory(seen["out"], out.numpy())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_reduced_precision(dtype):
    q = bshd((2, 20, 4, 16), dtype)
    k = bshd((2, 30, 4, 16), dtype, seed=1)
    v = bshd((2, 30, 4, 16), dtype, seed=2)
    got, expected, ran = both(q, k, v)
    assert [b.name for b in ran] == ["fastattn"] and got.dtype == dtype
    if dtype == torch.float16:
        assert_close(got.numpy(), expected.numpy().astype(np.float16).astype(np.float64),
                     np.float16)
    else:  # computed in float32, rounded once to bfloat16 (8 significant bits)
        np.testing.assert_allclose(got.double().numpy(), expected.numpy(), rtol=8e-3, atol=8e-3)


def test_takes_autograd_calls_with_torch_gradients_and_unregisters():
    q = bshd((2, 5, 4, 8)).double().requires_grad_(True)
    k = bshd((1, 7, 2, 8), seed=1).double().requires_grad_(True)   # broadcast batch, GQA
    v = bshd((1, 7, 2, 6), seed=2).double().requires_grad_(True)
    dout = bshd((2, 5, 4, 6), seed=3).double()
    with ab.recorded_attention_backends() as ran:
        out = sdpa(q, k, v)
    assert [b.name for b in ran] == ["fastattn"]  # grad mode on: fastattn, with its backward
    got = torch.autograd.grad(out, (q, k, v), dout)
    expected_out = sdpa(q, k, v, backend=None)
    expected = torch.autograd.grad(expected_out, (q, k, v), dout)
    for g, e in zip(got, expected):
        assert g.shape == e.shape
        assert_close(g.numpy(), e.numpy())
    fa_tabpfn.unregister()
    with torch.no_grad(), ab.recorded_attention_backends() as ran:
        sdpa(q.detach(), k, v)
    assert ran == [None]


def test_register_is_idempotent_and_first(registered):
    assert fa_tabpfn.register() is registered
    order = ab.registered_attention_backends()
    assert order[0] is registered
    assert sum(b.name == "fastattn" for b in order) == 1


def test_is_preferred():
    spec = dict(seq_len_q=3, seq_len_kv=5, num_heads=4, num_kv_heads=2, head_dim=8,
                dtype=torch.float32, device=torch.device("cpu"), batch_size=1)
    backend = fa_tabpfn.FastattnBackend()
    assert backend.is_preferred(ab.AttentionSpec(**spec))
    assert backend.is_preferred(ab.AttentionSpec(**dict(spec, is_grad_enabled=True)))
    for change in ({"device": torch.device("meta")},
                   {"seq_len_kv": None}, {"num_kv_heads": 3}, {"dtype": torch.int32}):
        assert not backend.is_preferred(ab.AttentionSpec(**dict(spec, **change))), change
