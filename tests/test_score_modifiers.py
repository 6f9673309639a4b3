"""The score modifiers (softcap, ALiBi, sinks, q_lengths) of the kernel against the reference,
alone and composed with the other options, and softcap's vector tanh.  Their bitwise
reproducibility: tests/test_reproducibility.py; the reference's own modifiers against
independent oracles: tests/test_reference_modifiers.py."""
import numpy as np
import pytest

import fastattn
from fastattn import reference
from fastattn._machine.isa import _load, available_variants

from conftest import assert_close, make_qkv, qkv_shapes

DTYPES = [np.float32, np.float64]


VARIANTS = {
    "softcap": dict(softcap=1.5),
    "alibi": dict(alibi_slopes="slopes"),
    "sinks": dict(sinks="sinks"),
    "q_lengths": dict(q_lengths="q_len"),
    "all": dict(softcap=4.0, alibi_slopes="slopes", sinks="sinks", q_lengths="q_len"),
}
OPTIONS = {
    "plain": dict(),
    "causal": dict(causal=True),
    "window": dict(window=(9, 2)),
    "kv_lengths": dict(kv_lengths=np.array([37, 11]), causal=True),
    "bool mask": dict(mask="bool"),
    "float mask": dict(mask="float"),
}


def _resolve(rng, kw, B, Hq, Lq, Lk, dtype):
    out = {}
    for name, val in kw.items():
        if not isinstance(val, str):
            pass
        elif val == "slopes":
            val = 2.0 ** -np.linspace(1, 8, Hq)             # the ALiBi paper's geometric slopes
        elif val == "sinks":
            val = rng.standard_normal((B, Hq)) * 2
            val[0, 0] = -np.inf                              # one head without a sink
        elif val == "q_len":
            val = np.array([Lq, max(0, Lq - 7)])[:B]
        elif val == "bool":
            val = rng.random((B, Hq, Lq, Lk)) < 0.85
        elif val == "float":
            val = (rng.standard_normal((1, Hq, Lq, Lk)) * 0.5).astype(dtype)
        out[name] = val
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("option", list(OPTIONS))
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("Hq, Hkv, Lq, Lk, D", [(4, 2, 19, 43, 16), (6, 3, 1, 70, 40),
                                               (2, 1, 130, 130, 64)])
def test_matches_reference(rng, dtype, option, variant, Hq, Hkv, Lq, Lk, D):
    q, k, v = make_qkv(rng, *qkv_shapes((2,), Hq, Hkv, Lq, Lk, D), dtype)
    kw = dict(OPTIONS[option])
    if "kv_lengths" in kw:
        kw["kv_lengths"] = np.minimum(kw["kv_lengths"], Lk)
    kw.update(VARIANTS[variant])
    kw = _resolve(rng, kw, 2, Hq, Lq, Lk, dtype)
    out, lse = fastattn.attention(q, k, v, return_lse=True, **kw)
    ref, ref_lse = reference.attention(q, k, v, return_lse=True, **kw)
    assert_close(out, ref, err_msg=f"{variant} + {option}")
    assert_close(lse, ref_lse, err_msg=f"{variant} + {option} (lse)")
    w = fastattn.attention_weights(q, k, **{n: a for n, a in kw.items()})
    assert_close(w, reference.attention_weights(q, k, **kw), err_msg=f"{variant} + {option} (weights)")


def test_softcap_caps_scores(rng):
    # Scores of 50 with softcap 2: both keys capped to ~2, so the weights are nearly equal;
    # uncapped they would be exp(50 - 10) apart.
    q = np.array([[1.0, 0.0]])
    k = np.array([[50.0, 0.0], [10.0, 0.0]])
    w = fastattn.attention_weights(q, k, scale=1.0, softcap=2.0)
    want = np.exp(2 * np.tanh([25.0, 5.0]))
    np.testing.assert_allclose(w[0], want / want.sum(), rtol=1e-12)


def test_sink_row_with_no_visible_key(rng):
    q, k, v = make_qkv(rng, *qkv_shapes((1,), 2, 2, 3, 5, 8), np.float32)
    out, lse = fastattn.attention(q, k, v, kv_lengths=[0], sinks=[1.5, -np.inf], return_lse=True)
    assert not out.any()
    np.testing.assert_array_equal(lse[0, 0], np.float32(1.5))
    assert np.isneginf(lse[0, 1]).all()


def test_q_lengths_padding_rows(rng):
    q, k, v = make_qkv(rng, *qkv_shapes((2,), 2, 2, 6, 9, 8), np.float64)
    out, lse = fastattn.attention(q, k, v, q_lengths=[6, 2], sinks=[[0.5, 0.5]] * 2,
                                  causal=True, return_lse=True)
    assert not out[1, :, 2:].any()
    assert np.isneginf(lse[1, :, 2:]).all()
    # The real rows of element 1 are the last 2 of a 2-row prompt against 9 keys.
    alone = fastattn.attention(q[1:, :, :2], k[1:], v[1:], causal=True, sinks=[0.5, 0.5])
    np.testing.assert_array_equal(out[1:, :, :2], alone)


@pytest.fixture(params=available_variants())
def kernel(request):
    return _load(request.param)


def test_vector_tanh_accuracy(kernel):
    # The float32 tanh of softcap: within 4 ulp of tanh (float64) over the range scores take
    # (|s / softcap| < 50), in particular near 0 and around the switch at |x| = 0.4.  Just
    # above the switch the 2-ulp error of 2^x passes through (1 - e) / (1 + e), e ~ 0.4:
    # 3.1 ulp at most on a grid of 4 million points (avx2 and base builds).
    x = np.concatenate([np.linspace(-50, 50, 200001), np.linspace(-1, 1, 200001),
                        np.geomspace(1e-30, 1e-1, 2000), -np.geomspace(1e-30, 1e-1, 2000),
                        np.nextafter(np.float32(0.4), 0) + np.zeros(1), [0.0, np.inf, -np.inf]])
    x = x.astype(np.float32)
    y = kernel.vector_tanh(x)
    exact = np.tanh(x.astype(np.float64))
    ulp = np.spacing(np.abs(exact).astype(np.float32)).astype(np.float64)
    err = np.abs(y.astype(np.float64) - exact) / ulp
    assert err.max() <= 4, f"max error {err.max():.2f} ulp at x = {x[np.argmax(err)]!r}"


# --------------------------------------------------------------------------- packed sequences


