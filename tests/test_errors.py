"""Every inconsistent argument raises ValueError/TypeError naming the argument (and, for
shape errors, showing the shapes) before any work starts; ``out`` is never half-written.
"""

import numpy as np
import pytest

import fastattn

from conftest import make_qkv, names

ERRORS = (ValueError, TypeError)


# float32 q (2, 5, 4), k (2, 6, 4), v (2, 6, 3): two heads, Lq != Lk, Dv != D ...
HEADS = dict(Hq=2, Lq=5, Lk=6, D=4, Dv=3)
# ... and q (2, 1, 5, 4), k (2, 1, 6, 4), v (2, 1, 6, 3): a batch of two for kv_lengths.
BATCH = dict(batch=(2,), Lq=5, Lk=6, D=4, Dv=3)


# --------------------------------------------------------------------------- shapes

@pytest.mark.parametrize("q_shape, k_shape, v_shape, arg, shown", [
    ((4,), (6, 4), (6, 3), "q", (4,)),                                 # too few dims
    ((5, 4), (4,), (6, 3), "k", (4,)),
    ((5, 4), (6, 4), (3,), "v", (3,)),
    ((2, 5, 4), (6, 4), (6, 3), "k", (6, 4)),                          # ndim differs from q
    ((2, 5, 4), (2, 6, 4), (6, 3), "v", (6, 3)),
    ((2, 5, 4), (2, 6, 3), (2, 6, 3), "k", (2, 6, 3)),                 # D of q vs k
    ((2, 5, 4), (2, 6, 4), (2, 7, 3), "v", (2, 7, 3)),                 # Lk of k vs v
    ((2, 5, 4), (2, 6, 4), (1, 6, 3), "v", (1, 6, 3)),                 # Hkv of k vs v
    ((3, 5, 4), (2, 6, 4), (2, 6, 3), "k", (2, 6, 4)),                 # Hq % Hkv != 0
    ((2, 2, 5, 4), (3, 2, 6, 4), (3, 2, 6, 3), "k", (3, 2, 6, 4)),     # batch dims
    ((2, 2, 5, 4), (2, 2, 6, 4), (3, 2, 6, 3), "v", (3, 2, 6, 3)),
])
def test_shape_errors(rng, q_shape, k_shape, v_shape, arg, shown):
    q, k, v = make_qkv(rng, q_shape, k_shape, v_shape)
    with pytest.raises(ValueError, match=names(arg)) as info:
        fastattn.attention(q, k, v)
    assert str(shown) in str(info.value), f"message should show the shape {shown}: {info.value}"


def test_attention_weights_shape_errors(rng):
    q, k, _ = make_qkv(rng, **HEADS)
    with pytest.raises(ValueError, match=names("k")):
        fastattn.attention_weights(q, k[..., :3])
    with pytest.raises(ValueError, match=names("k")):
        fastattn.attention_weights(np.ones((3, 5, 4)), k)


# --------------------------------------------------------------------------- dtypes

@pytest.mark.parametrize("arg", ["q", "k", "v"])
@pytest.mark.parametrize("bad", [np.complex64, np.complex128, object, "U3"])
def test_bad_input_dtypes(rng, arg, bad):
    arrays = dict(zip("qkv", make_qkv(rng, **HEADS)))
    arrays[arg] = arrays[arg].astype(bad)
    with pytest.raises(TypeError, match=names(arg)):
        fastattn.attention(arrays["q"], arrays["k"], arrays["v"])


def test_bad_dtypes_weights_softmax(rng):
    q, k, _ = make_qkv(rng, **HEADS)
    with pytest.raises(TypeError, match=names("k")):
        fastattn.attention_weights(q, k.astype(complex))
    with pytest.raises(TypeError, match=names("x")):
        fastattn.softmax(np.ones(3, complex))
    with pytest.raises(ERRORS):
        fastattn.softmax(np.ones((2, 3)), axis=2)


# --------------------------------------------------------------------------- mask

@pytest.mark.parametrize("mask_shape", [(5, 7), (5,), (4, 5, 6), (2, 2, 5, 6), (5, 1, 1, 6)])
def test_mask_not_broadcastable(rng, mask_shape):
    # Result is (2, 5, 3) with scores (2, 5, 6): the mask must broadcast *to* (2, 5, 6),
    # not enlarge it.
    q, k, v = make_qkv(rng, **HEADS)
    with pytest.raises(ValueError, match=names("mask")) as info:
        fastattn.attention(q, k, v, mask=np.ones(mask_shape, bool))
    assert str(mask_shape) in str(info.value)


@pytest.mark.parametrize("dtype", [np.int64, np.int8, np.complex128, object])
def test_mask_bad_dtype(rng, dtype):
    q, k, v = make_qkv(rng, **HEADS)
    with pytest.raises(ERRORS, match=names("mask")):
        fastattn.attention(q, k, v, mask=np.ones((5, 6), dtype))


# --------------------------------------------------------------------------- kv_lengths

@pytest.mark.parametrize("lengths", [np.array([-1, 3]), np.array([7, 3]), -1, 7])
def test_kv_lengths_out_of_range(rng, lengths):
    q, k, v = make_qkv(rng, **BATCH)
    with pytest.raises(ValueError, match=names("kv_lengths")):
        fastattn.attention(q, k, v, kv_lengths=lengths)


@pytest.mark.parametrize("lengths", [np.array([2.0, 3.0]), np.array([2.5, 3]), 2.0,
                                     np.array([True, False]), "3", np.array([1 + 0j, 2])])
def test_kv_lengths_not_integer(rng, lengths):
    q, k, v = make_qkv(rng, **BATCH)
    with pytest.raises(ERRORS, match=names("kv_lengths")):
        fastattn.attention(q, k, v, kv_lengths=lengths)


@pytest.mark.parametrize("lengths", [np.array([1, 2, 3]), np.array([[1], [2], [3]]),
                                     np.ones((2, 1), int)])
def test_kv_lengths_not_broadcastable(rng, lengths):
    # batch shape is (2,); (2, 1) would enlarge it to (2, 2).
    q, k, v = make_qkv(rng, **BATCH)
    with pytest.raises(ValueError, match=names("kv_lengths")):
        fastattn.attention(q, k, v, kv_lengths=lengths)


# --------------------------------------------------------------------------- window, causal

@pytest.mark.parametrize("window", [(1,), (1, 2, 3), (-2, 0), (0, -5), (1.5, 0), (0, "a"), 3,
                                    "ab"])
def test_bad_window(rng, window):
    q, k, v = make_qkv(rng, **HEADS)
    with pytest.raises(ERRORS, match=names("window")):
        fastattn.attention(q, k, v, window=window)


@pytest.mark.parametrize("causal", ["bottom", "diagonal", "", "TOPLEFT"])
def test_bad_causal(rng, causal):
    q, k, v = make_qkv(rng, **HEADS)
    with pytest.raises(ValueError, match=names("causal")):
        fastattn.attention(q, k, v, causal=causal)


# --------------------------------------------------------------------------- scale

@pytest.mark.parametrize("scale", ["1.0", 1j, [1.0], object()])
def test_bad_scale_type(rng, scale):
    q, k, v = make_qkv(rng, **HEADS)
    with pytest.raises(TypeError, match=names("scale")):
        fastattn.attention(q, k, v, scale=scale)


@pytest.mark.parametrize("scale", [np.nan, np.inf, -np.inf])
def test_non_finite_scale(rng, scale):
    q, k, v = make_qkv(rng, **HEADS)
    with pytest.raises(ValueError, match=names("scale")):
        fastattn.attention(q, k, v, scale=scale)


# --------------------------------------------------------------------------- out

@pytest.mark.parametrize("bad_out, exc", [
    (np.empty((2, 5, 4), np.float32), ValueError),       # wrong shape (Dv is 3)
    (np.empty((5, 3), np.float32), ValueError),
    (np.empty((2, 5, 3), np.float64), ERRORS),           # wrong dtype
    (np.empty((2, 5, 3), np.float16), ERRORS),
    ([[0.0] * 3] * 5, TypeError),                        # not an ndarray
])
def test_bad_out(rng, bad_out, exc):
    q, k, v = make_qkv(rng, **HEADS)
    with pytest.raises(exc, match=names("out")):
        fastattn.attention(q, k, v, out=bad_out)


def test_read_only_out(rng):
    q, k, v = make_qkv(rng, **HEADS)
    out = np.zeros((2, 5, 3), np.float32)
    out.setflags(write=False)
    with pytest.raises(ERRORS, match=names("out")):
        fastattn.attention(q, k, v, out=out)


@pytest.mark.parametrize("bad", [
    dict(mask=np.ones((5, 7), bool)),
    dict(mask=np.ones((5, 6), np.int32)),
    dict(kv_lengths=np.array([3, 7])),
    dict(window=(-3, 0)),
    dict(causal="bottom"),
    dict(scale="x"),
])
def test_out_untouched_after_error(rng, bad):
    q, k, v = make_qkv(rng, **BATCH)
    out = np.full((2, 1, 5, 3), 7.0, np.float32)
    with pytest.raises(ERRORS):
        fastattn.attention(q, k, v, out=out, **bad)
    assert np.all(out == 7.0)


def test_inputs_untouched_after_error(rng):
    q, k, v = make_qkv(rng, **HEADS)
    copies = [a.copy() for a in (q, k, v)]
    with pytest.raises(ValueError):
        fastattn.attention(q, k, v, kv_lengths=99)
    for a, c in zip((q, k, v), copies):
        np.testing.assert_array_equal(a, c)


@pytest.mark.parametrize("window", [{1: 2, 3: 4}, {0, 1}, "ab"])
def test_window_must_be_a_pair_not_any_iterable(window):
    # A dict or set would otherwise unpack as its keys and be taken as a window.
    q = np.ones((2, 3, 4))
    with pytest.raises(ERRORS, match=names("window")):
        fastattn.attention(q, q, q, window=window)


@pytest.mark.parametrize("flag", [np.array([1, 2]), "yes", None, 1])
def test_return_lse_must_be_a_bool(flag):
    q = np.ones((2, 3, 4))
    with pytest.raises(TypeError, match="return_lse"):
        fastattn.attention(q, q, q, return_lse=flag)
