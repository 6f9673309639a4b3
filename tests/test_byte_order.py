"""Arrays in any byte order compute the same numbers on every entry point: a big-endian
array gives the bits of its native twin everywhere.  The argument rules, and the one
description of a call that fastattn._calls.args builds: tests/test_arguments.py."""
import numpy as np
import pytest

import fastattn
from fastattn import reference as ref

from conftest import make_qkv


def _swapped(a):
    """``a`` with the same values in the opposite byte order."""
    a = np.asarray(a)
    return a.astype(a.dtype.newbyteorder("S"))


@pytest.fixture
def qkv():
    return make_qkv(7, batch=(2,), Hq=4, Hkv=2, Lq=5, Lk=7, D=8, Dv=6, dtype=np.float64)


# --------------------------------------------------------------------------- byte order

@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
@pytest.mark.parametrize("keywords", [{}, {"causal": True}, {"window": (2, 1)},
                                      {"softcap": 3.0}, {"sinks": np.zeros(4)}])
def test_big_endian_inputs_give_the_native_bits(qkv, dtype, keywords):
    q, k, v = (a.astype(dtype) for a in qkv)
    want = fastattn.attention(q, k, v, return_lse=True, **keywords)
    got = fastattn.attention(_swapped(q), _swapped(k), _swapped(v), return_lse=True, **keywords)
    for w, g in zip(want, got):
        assert g.dtype.isnative and g.dtype == w.dtype
        np.testing.assert_array_equal(g, w)


def test_the_readme_example_of_a_big_endian_file():
    # The new user's report: a big-endian .npy file gave [[3.45e-41, 2.30e-41], ...].
    x = np.array([[1.0, 2.0], [3.0, 4.0]], dtype=">f4")
    want = fastattn.attention(x.astype("<f4"), x.astype("<f4"), x.astype("<f4"), scale=1.0)
    np.testing.assert_array_equal(fastattn.attention(x, x, x, scale=1.0), want)
    assert np.allclose(want, ref.attention(x, x, x, scale=1.0), rtol=1e-6)
    np.testing.assert_array_equal(fastattn.self_attention(x, scale=1.0), want)


@pytest.mark.parametrize("dtype", [">f8", ">f4", ">f2"])
def test_big_endian_out_receives_the_right_numbers(qkv, dtype):
    q, k, v = (a.astype(np.dtype(dtype).newbyteorder("=")) for a in qkv)
    want = fastattn.attention(q, k, v)
    out = np.full(want.shape, 7, dtype=dtype)
    assert fastattn.attention(q, k, v, out=out) is out
    np.testing.assert_array_equal(out, want)


def test_big_endian_masks_lengths_and_per_head_arrays(qkv):
    q, k, v = qkv
    rng = np.random.default_rng(3)
    keywords = dict(mask=rng.standard_normal((5, 7)), kv_lengths=np.array([7, 4]),
                    q_lengths=np.array([5, 3]), alibi_slopes=np.linspace(0.1, 0.4, 4),
                    sinks=np.linspace(-1, 1, 4))
    swapped = {name: _swapped(a) for name, a in keywords.items()}
    np.testing.assert_array_equal(fastattn.attention(q, k, v, **swapped),
                                  fastattn.attention(q, k, v, **keywords))
    np.testing.assert_array_equal(ref.attention(q, k, v, **swapped),
                                  ref.attention(q, k, v, **keywords))


def test_big_endian_on_every_other_entry_point(qkv):
    q, k, v = qkv
    sq, sk, sv = (_swapped(a) for a in qkv)
    np.testing.assert_array_equal(fastattn.attention_weights(sq, sk, causal=True),
                                  fastattn.attention_weights(q, k, causal=True))
    np.testing.assert_array_equal(fastattn.softmax(sq), fastattn.softmax(q))
    np.testing.assert_array_equal(ref.attention_weights(sq, sk), ref.attention_weights(q, k))
    np.testing.assert_array_equal(ref.softmax(sq), ref.softmax(q))
    packed = (a[0] for a in (q, k, v))
    q1, k1, v1 = packed
    cu_q, cu_k = np.array([0, 2, 5]), _swapped(np.array([0, 3, 7]))
    np.testing.assert_array_equal(
        fastattn.attention_varlen(_swapped(q1), _swapped(k1), _swapped(v1), cu_q, cu_k),
        fastattn.attention_varlen(q1, k1, v1, cu_q, cu_k.astype("=i8")))


def test_merge_attention_takes_big_endian_partials(qkv):
    q, k, v = qkv
    parts = [fastattn.attention(q, k[..., a:b, :], v[..., a:b, :], return_lse=True)
             for a, b in ((0, 3), (3, 7))]
    want = fastattn.merge_attention([o for o, _ in parts], [l for _, l in parts])
    got = fastattn.merge_attention([_swapped(o) for o, _ in parts], [_swapped(l) for _, l in parts])
    for g, w in zip(got, want):
        assert g.dtype.isnative
        np.testing.assert_array_equal(g, w)


def test_attention_backward_takes_big_endian_arrays(qkv):
    q, k, v = qkv
    out, lse = fastattn.attention(q, k, v, causal=True, return_lse=True)
    dout = np.random.default_rng(1).standard_normal(out.shape)
    want = fastattn.attention_backward(dout, q, k, v, out, lse, causal=True)
    got = fastattn.attention_backward(*(_swapped(a) for a in (dout, q, k, v, out, lse)),
                                      causal=True)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)
