"""Argument rules, by argument: a bad argument raises ValueError or TypeError naming it
(and, for shapes, showing them) before any work starts, ``out`` and the inputs are never
written to, and every entry point applies the rule fastattn._calls.args owns.

By argument: q, k, v (shapes, then dtypes); mask; kv_lengths; window; causal; scale;
softcap, alibi_slopes, sinks and q_lengths; out; return_lse; attention_varlen's cu_seqlens;
then the same bad keywords through every entry point, random malformed calls, softmax's
x and axis, attention_backward's arrays and keywords, the one description of a call that
the kernel reads (the Problem's fields, by name, with _args' codes), and the rules of
softcap, the per-head arrays, the lengths, cu_seqlens and storage dtypes as fastattn._calls.args
gives them (what they normalise to) and as the reference applies them.

The random ones: hypothesis builds a valid call (random small shapes, dtypes, keywords),
breaks it with one or two corruptions from the catalogue below (wrong ndim, mismatched dims,
bad dtypes, object/complex/str/datetime arrays, ragged lists, non-arrays, bad or
out-of-range kv_lengths, bad out, bad window/causal/scale, bad masks) and checks that

* the call raises ValueError or TypeError -- nothing else (no OverflowError, IndexError,
  SystemError, segfault) -- whose message names one of the arguments concerned;
* ``out`` is untouched (no partial write) and no input array was written to.

The same calls go through every public entry point that takes those arguments
(attention, attention_weights), so both the Python front end and the compiled fast path
of fastattn.attention (taken when window/mask/kv_lengths are absent) are exercised.
"""
import re

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import fastattn
from fastattn import reference as ref
from fastattn._calls import args as _args

from conftest import make_qkv, names, names_any

_UNIT = settings.default.max_examples
ERRORS = (ValueError, TypeError)

# float32 q (2, 5, 4), k (2, 6, 4), v (2, 6, 3): two heads, Lq != Lk, Dv != D ...
HEADS = dict(Hq=2, Lq=5, Lk=6, D=4, Dv=3)
# ... and q (2, 1, 5, 4), k (2, 1, 6, 4), v (2, 1, 6, 3): a batch of two for kv_lengths.
BATCH = dict(batch=(2,), Lq=5, Lk=6, D=4, Dv=3)


@pytest.fixture
def qkv():
    """float64 GQA inputs: q (2, 4, 5, 8), k (2, 2, 7, 8), v (2, 2, 7, 6)."""
    return make_qkv(7, batch=(2,), Hq=4, Hkv=2, Lq=5, Lk=7, D=8, Dv=6, dtype=np.float64)


# ----------------------------------------------------------- q, k, v: shapes

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


# ----------------------------------------------------------- q, k, v: dtypes

@pytest.mark.parametrize("arg", ["q", "k", "v"])
@pytest.mark.parametrize("bad", [np.complex64, np.complex128, object, "U3", np.longdouble])
def test_bad_input_dtypes(rng, arg, bad):
    arrays = dict(zip("qkv", make_qkv(rng, **HEADS)))
    arrays[arg] = arrays[arg].astype(bad)
    with pytest.raises(TypeError, match=names(arg)):
        fastattn.attention(arrays["q"], arrays["k"], arrays["v"])


def test_attention_weights_dtype_error(rng):
    q, k, _ = make_qkv(rng, **HEADS)
    with pytest.raises(TypeError, match=names("k")):
        fastattn.attention_weights(q, k.astype(complex))


@pytest.mark.parametrize("kw", [{}, {"window": (1, 1)}, {"out": np.ones((2, 3), np.float32)}])
def test_v_none_is_a_type_error(kw):
    x = np.ones((2, 3), np.float32)
    with pytest.raises(TypeError, match=names("v")):
        fastattn.attention(x, x, None, **kw)


# ---------------------------------------------------------------------- mask

@pytest.mark.parametrize("mask_shape", [(5, 7), (5,), (4, 5, 6), (2, 2, 5, 6), (5, 1, 1, 6)])
def test_mask_not_broadcastable(rng, mask_shape):
    # Result is (2, 5, 3) with scores (2, 5, 6): the mask must broadcast *to* (2, 5, 6),
    # not enlarge it.
    q, k, v = make_qkv(rng, **HEADS)
    with pytest.raises(ValueError, match=names("mask")) as info:
        fastattn.attention(q, k, v, mask=np.ones(mask_shape, bool))
    assert str(mask_shape) in str(info.value)


@pytest.mark.parametrize("dtype", [np.int64, np.int32, np.int8, np.complex64, np.complex128,
                                   object])
def test_mask_dtype_error_lists_only_legal_dtypes(rng, dtype):
    q, k, v = make_qkv(rng, **HEADS)
    with pytest.raises(TypeError, match=names("mask")) as info:
        fastattn.attention(q, k, v, mask=np.ones((5, 6), dtype))
    message = str(info.value)
    assert "bool" in message and "floating" in message and "integer" not in message


# ---------------------------------------------------------------- kv_lengths

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


# -------------------------------------------------------------------- window

# A set would otherwise unpack as its keys and be taken as a window.
@pytest.mark.parametrize("window", [(1,), (0, -5), (1.5, 0), (0, "a"), 3, "ab", {0, 1}])
def test_bad_window(rng, window):
    q, k, v = make_qkv(rng, **HEADS)
    with pytest.raises(ERRORS, match=names("window")):
        fastattn.attention(q, k, v, window=window)


# -------------------------------------------------------------------- causal

@pytest.mark.parametrize("causal", ["bottom", "diagonal", "", "TOPLEFT"])
def test_bad_causal(rng, causal):
    q, k, v = make_qkv(rng, **HEADS)
    with pytest.raises(ValueError, match=names("causal")):
        fastattn.attention(q, k, v, causal=causal)


# --------------------------------------------------------------------- scale

@pytest.mark.parametrize("scale", [1j, [1.0], object()])
def test_bad_scale_type(rng, scale):
    q, k, v = make_qkv(rng, **HEADS)
    with pytest.raises(TypeError, match=names("scale")):
        fastattn.attention(q, k, v, scale=scale)


@pytest.mark.parametrize("scale", [np.inf, -np.inf])
def test_non_finite_scale(rng, scale):
    q, k, v = make_qkv(rng, **HEADS)
    with pytest.raises(ValueError, match=names("scale")):
        fastattn.attention(q, k, v, scale=scale)


def test_huge_integer_scale_is_a_value_error():
    x = np.ones((2, 3))
    with pytest.raises(ValueError, match="scale"):
        fastattn.attention(x, x, x, scale=10 ** 400)


# ----------------------------------- softcap, alibi_slopes, sinks, q_lengths

@pytest.mark.parametrize("bad, exc, words", [
    (dict(softcap=0.0), ValueError, "softcap"),
    (dict(softcap=float("nan")), ValueError, "softcap"),
    (dict(softcap=True), TypeError, "softcap"),
    (dict(alibi_slopes=np.ones(3)), ValueError, "alibi_slopes"),
    (dict(alibi_slopes=np.array(["a", "b"])), TypeError, "alibi_slopes"),
    (dict(sinks=np.ones((2, 2, 2))), ValueError, "sinks"),
    (dict(sinks=[np.nan, 0.0]), ValueError, "sinks"),
    (dict(q_lengths=[5]), ValueError, "q_lengths"),
    (dict(q_lengths=[1.5]), TypeError, "q_lengths"),
])
def test_bad_variant_arguments(rng, bad, exc, words):
    q, k, v = make_qkv(rng, batch=(1,), Hq=2, Lq=4, Lk=6, D=8)
    out = np.full((1, 2, 4, 8), 7.0, np.float32)
    with pytest.raises(exc, match=words):
        fastattn.attention(q, k, v, out=out, **bad)
    assert (out == 7.0).all()


# ----------------------------------------------------------------------- out

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


@pytest.mark.parametrize("alias", ["q", "k", "v", "q_reversed", "v_rows_reversed"])
@pytest.mark.parametrize("window", [None, (2, 0)])
def test_out_aliasing_an_input(alias, window):
    # Not an error: `out` may be one of the inputs (in-place attention). The result must be
    # the one of a fresh call -- nothing read after it was overwritten.
    q, k, v = make_qkv(3, batch=(2,), Hq=2, Lq=37, D=8)
    expected = fastattn.attention(q, k, v, causal=True, window=window)
    q2, k2, v2 = q.copy(), k.copy(), v.copy()
    out = {"q": q2, "k": k2, "v": v2, "q_reversed": q2[..., ::-1, :],
           "v_rows_reversed": v2[..., ::-1, :]}[alias]
    res = fastattn.attention(q2, k2, v2, causal=True, window=window, out=out)
    assert res is out
    np.testing.assert_array_equal(res, expected)


# ---------------------------------------------------------------- return_lse

@pytest.mark.parametrize("flag", [np.array([1, 2]), "yes", None, 1])
def test_return_lse_must_be_a_bool(flag):
    q = np.ones((2, 3, 4))
    with pytest.raises(TypeError, match="return_lse"):
        fastattn.attention(q, q, q, return_lse=flag)


# ----------------------------- cu_seqlens_q, cu_seqlens_k (attention_varlen)

@pytest.mark.parametrize("cu_q, cu_k, exc, words", [
    ([0, 3, 5], [0, 4], ValueError, "same length"),
    ([1, 3, 5], [0, 2, 4], ValueError, "start at 0"),
    ([0, 4, 3, 5], [0, 1, 2, 4], ValueError, "non-decreasing"),
    ([0, 3, 4], [0, 2, 4], ValueError, "end at"),
    ([0.0, 3, 5], [0, 2, 4], TypeError, "integer"),
    ([[0, 3, 5]], [[0, 2, 4]], ValueError, "1-D"),
])
def test_varlen_bad_cu_seqlens(rng, cu_q, cu_k, exc, words):
    q, k, _ = make_qkv(rng, Hq=2, Lq=5, Lk=4, D=8)
    with pytest.raises(exc, match=words):
        fastattn.attention_varlen(q, k, k, cu_q, cu_k)


# ----------------------------------------------- every entry point, one rule

def _entry_points():
    """Callables taking (q, k, v, **keywords) for every entry point with those keywords."""
    return {
        "attention": fastattn.attention,
        "reference.attention": ref.attention,
        "attention_weights": lambda q, k, v, **kw: fastattn.attention_weights(q, k, **kw),
        "reference.attention_weights": lambda q, k, v, **kw: ref.attention_weights(q, k, **kw),
    }


BAD_ARGUMENTS = [  # (keywords, exception, what the message names)
    (dict(causal=1.5), TypeError, "causal"),
    (dict(causal=1), TypeError, "causal"),
    (dict(causal="left"), ValueError, "causal"),
    (dict(scale="2"), TypeError, "scale"),
    (dict(scale=float("nan")), ValueError, "scale"),
    (dict(window=(1.5, 2)), TypeError, "window"),
    (dict(window={1: 2, 3: 4}), TypeError, "window"),
    (dict(window=(1, 2, 3)), ValueError, "window"),
    (dict(window=(-2, 0)), ValueError, "window"),
    (dict(mask=np.ones((5, 7), np.int32)), TypeError, "mask"),
    (dict(mask=np.ones((5, 6), bool)), ValueError, "mask"),
    (dict(kv_lengths=[1.5, 2.0]), TypeError, "kv_lengths"),
    (dict(kv_lengths=[8, 2]), ValueError, "kv_lengths"),
    (dict(q_lengths=[6, 2]), ValueError, "q_lengths"),
    (dict(softcap=0.0), ValueError, "softcap"),
    (dict(alibi_slopes=np.ones(3)), ValueError, "alibi_slopes"),
    (dict(sinks=[np.inf] * 4), ValueError, "sinks"),
]


@pytest.mark.parametrize("entry", list(_entry_points()))
@pytest.mark.parametrize("keywords, error, name", BAD_ARGUMENTS,
                         ids=[str(kw) for kw, _, _ in BAD_ARGUMENTS])
def test_every_entry_point_raises_the_same_error(qkv, entry, keywords, error, name):
    with pytest.raises(error, match=re.escape(name)):
        _entry_points()[entry](*qkv, **keywords)


@pytest.mark.parametrize("attention", [fastattn.attention, ref.attention])
def test_out_rules_are_the_same_on_both_sides(qkv, attention):
    q, k, v = qkv
    with pytest.raises(TypeError, match="out must have dtype float64"):
        attention(q, k, v, out=np.empty((2, 4, 5, 6), np.float32))
    with pytest.raises(ValueError, match=re.escape("out must have shape (2, 4, 5, 6)")):
        attention(q, k, v, out=np.empty((2, 4, 5, 7)))
    read_only = np.empty((2, 4, 5, 6))
    read_only.flags.writeable = False
    with pytest.raises(ValueError, match="out must be writeable"):
        attention(q, k, v, out=read_only)


@pytest.mark.parametrize("attention_varlen", [fastattn.attention_varlen, ref.attention_varlen])
@pytest.mark.parametrize("keywords, error", [(dict(causal=1.5), TypeError),
                                             (dict(window=(1, 2, 3)), ValueError),
                                             (dict(return_lse=1), TypeError)])
def test_varlen_entry_points_share_the_rules(attention_varlen, keywords, error):
    x = np.ones((2, 5, 4))
    with pytest.raises(error):
        attention_varlen(x, x, x, [0, 2, 5], [0, 3, 5], **keywords)


# ---------------------------------------------------- random malformed calls

class Ragged:
    """Stand-in for arbitrary non-array Python objects."""


# Each corruption: (category, function(call, draw) -> names the message may mention).
# Categories: at most one "shape" corruption per call (two could cancel out, e.g. adding
# a leading axis to q, k and v alike); the others touch distinct arguments.

def _shape_of(call, name):
    return call[name].shape


def c_ndim(call, draw):
    name = draw(st.sampled_from("qkv"))
    a = call[name]
    how = draw(st.sampled_from(["1d", "0d", "extra", "drop"]))
    if how == "1d":
        call[name] = np.ones(a.shape[-1:], a.dtype)
    elif how == "0d":
        call[name] = a.dtype.type(1)
    elif how == "extra":
        call[name] = a[None]
    else:
        if a.ndim <= 2:
            call[name] = a[0, 0]
        else:
            call[name] = a[0]
    return {name, "q", "k", "v"} if name != "q" else {"q", "k", "v"}


def c_head_dim(call, draw):
    name = draw(st.sampled_from("qk"))
    a = call[name]
    call[name] = np.ones(a.shape[:-1] + (a.shape[-1] + draw(st.integers(1, 3)),), a.dtype)
    return {"q", "k"}


def c_lengths(call, draw):
    # v's length differs from k's (changing k's alone would leave attention_weights valid).
    name = "v"
    a = call[name]
    shape = list(a.shape)
    shape[-2] += draw(st.integers(1, 3))
    call[name] = np.ones(shape, a.dtype)
    return {"k", "v"}


def c_heads(call, draw):
    q, k = call["q"], call["k"]
    if q.ndim < 3:
        call["q"] = q[None]
        return {"q", "k", "v"}
    how = draw(st.sampled_from(["not_multiple", "zero", "v_differs"]))
    if how == "not_multiple":
        Hkv = q.shape[-3] + 1
    elif how == "zero":
        Hkv = 0
    else:
        v = call["v"]
        call["v"] = np.ones(v.shape[:-3] + (v.shape[-3] + 1,) + v.shape[-2:], v.dtype)
        return {"k", "v"}
    call["k"] = np.ones(k.shape[:-3] + (Hkv,) + k.shape[-2:], k.dtype)
    call["v"] = np.ones(call["v"].shape[:-3] + (Hkv,) + call["v"].shape[-2:], call["v"].dtype)
    return {"q", "k"}


def c_batch(call, draw):
    # Batch sizes 2 and 3 never broadcast; q gets one, k (and v, to stay with k) the other.
    nq, nk = draw(st.sampled_from([(2, 3), (3, 2)]))
    for name, n in (("q", nq), ("k", nk), ("v", nk)):
        a = call[name]
        call[name] = np.ones((n,) + (a.shape[1:] if a.ndim >= 4 else a.shape), a.dtype)
    return {"q", "k", "v"}


BAD_DTYPES = [np.complex64, np.complex128, object, "U3", "S2", "datetime64[s]",
              "timedelta64[ms]", [("a", "f4")]]


def c_dtype(call, draw):
    name = draw(st.sampled_from("qkv"))
    a = call[name]
    dt = np.dtype(draw(st.sampled_from(BAD_DTYPES)))
    call[name] = np.zeros(a.shape, dt)
    return {name}


def c_not_array(call, draw):
    name = draw(st.sampled_from("qkv"))
    call[name] = draw(st.sampled_from([
        None, "abc", b"xy", {}, {"a": 1}, Ragged(), [[1.0, 2.0], [3.0]], [[[1.0], []]],
        [None, None], 1j, [[1j]],
    ]))
    return {name}


def c_mask(call, draw):
    Lq, Lk = call["_Lq"], call["_Lk"]
    how = draw(st.sampled_from(["shape", "ndim", "int", "complex", "object", "str", "ragged",
                                "string", "datetime"]))
    call["mask"] = {
        "shape": lambda: np.ones((Lq, Lk + 1), bool),
        "ndim": lambda: np.ones((1,) * 5 + (Lq, Lk), bool),
        "int": lambda: np.ones((Lq, Lk), np.int32),
        "complex": lambda: np.ones((Lq, Lk), complex),
        "object": lambda: np.ones((Lq, Lk), object),
        "str": lambda: np.full((Lq, Lk), "a"),
        "ragged": lambda: [[True] * Lk, [True]] if Lk != 1 else [[True], [True, False]],
        "string": lambda: "mask",
        "datetime": lambda: np.zeros((Lq, Lk), "datetime64[s]"),
    }[how]()
    return {"mask"}


def c_kv_lengths(call, draw):
    Lk = call["_Lk"]
    call["kv_lengths"] = draw(st.sampled_from([
        -1, Lk + 1, 10 ** 6, np.int8(-3), np.array([Lk + 1], np.uint64), 2.0, 1.5, True,
        np.array([True]), np.array([1, 2, 3, 4, 5, 6, 7]), np.ones((3, 3), int), 1j, "3",
        [[1], [2, 3]], 2 ** 70, -2 ** 70, np.array([1, 2], object), None.__class__,
    ]))
    return {"kv_lengths"}


def c_window(call, draw):
    call["window"] = draw(st.sampled_from([
        (-2, 0), (0, -2), (-10 ** 30, 0), (0,), (1, 2, 3), (), "ab", 3, 3.5, (1.5, 2),
        (1, 2.0), (True, 0), (0, False), (None, 1), Ragged(), {"l": 1}, (1j, 1),
        np.array([[1, 1]]), (np.float64(1), 1), ("1", 2),
    ]))
    return {"window"}


def c_causal(call, draw):
    call["causal"] = draw(st.sampled_from([
        "bottom", "TOP-LEFT", "", "causal", 1, 0, 2, None, 1.0, [True], (True,),
        np.array(True), np.array([True]), b"top-left", Ragged(),
    ]))
    return {"causal"}


def c_scale(call, draw):
    call["scale"] = draw(st.sampled_from([
        "x", "1.0", 1j, np.nan, np.inf, -np.inf, np.float32(np.inf), [1.0], (1.0,),
        np.array([1.0]), np.array(1.0), True, np.bool_(False), Ragged(), {},
    ]))
    return {"scale"}


def c_out(call, draw):
    shape, dtype = call["_result_shape"], call["_result_dtype"]
    how = draw(st.sampled_from(["shape", "ndim", "dtype", "list", "tuple", "readonly",
                                "broadcast", "scalar", "str", "int"]))
    if how == "shape":
        bad = np.zeros(shape[:-1] + (shape[-1] + 1,), dtype)
    elif how == "ndim":
        bad = np.zeros((1,) + shape, dtype)
    elif how == "dtype":
        other = [d for d in (np.float16, np.float32, np.float64, np.int32) if np.dtype(d) != dtype]
        bad = np.zeros(shape, draw(st.sampled_from(other)))
    elif how == "list":
        bad = np.zeros(shape, dtype).tolist()
    elif how == "tuple":
        bad = tuple(np.zeros(shape, dtype))
    elif how == "readonly":
        bad = np.full(shape, 7, dtype)
        bad.setflags(write=False)
    elif how == "broadcast":
        bad = np.broadcast_to(np.full(shape[-1:], 7, dtype), shape)
    elif how == "scalar":
        bad = np.zeros((), dtype)
    elif how == "str":
        bad = "out"
    else:
        bad = 3
    call["out"] = bad
    return {"out"}


SHAPE_CORRUPTIONS = [c_ndim, c_head_dim, c_lengths, c_heads, c_batch]
ARG_CORRUPTIONS = {"q/k/v dtype": c_dtype, "q/k/v object": c_not_array, "mask": c_mask,
                   "kv_lengths": c_kv_lengths, "window": c_window, "causal": c_causal,
                   "scale": c_scale, "out": c_out}


@st.composite
def valid_calls(draw):
    rng = np.random.default_rng(draw(st.integers(0, 2 ** 16)))
    two_dim = draw(st.booleans()) and draw(st.booleans())
    batch = () if two_dim else draw(st.sampled_from([(), (2,), (1,), (2, 1)]))
    Hkv = 1 if two_dim else draw(st.integers(1, 2))
    Hq = Hkv * (1 if two_dim else draw(st.integers(1, 2)))
    Lq, Lk, D, Dv = (draw(st.integers(1, 6)) for _ in range(4))
    dtype = np.dtype(draw(st.sampled_from([np.float32, np.float64, np.float16, np.int32])))
    core = (lambda H, L, d: (L, d)) if two_dim else (lambda H, L, d: (*batch, H, L, d))
    call = {"q": rng.standard_normal(core(Hq, Lq, D)).astype(dtype),
            "k": rng.standard_normal(core(Hkv, Lk, D)).astype(dtype),
            "v": rng.standard_normal(core(Hkv, Lk, Dv)).astype(dtype)}
    rdt = np.dtype(np.float64) if dtype.kind == "i" else dtype
    # Facts about the valid call, for corruptions applied after a shape corruption.
    call.update(_result_shape=core(Hq, Lq, Dv), _result_dtype=rdt, _Lq=Lq, _Lk=Lk)
    # Some valid keywords, so that the corruption also meets them.
    if draw(st.booleans()):
        call["causal"] = draw(st.sampled_from([True, "top-left"]))
    if draw(st.booleans()):
        call["kv_lengths"] = np.array(Lk)
    if draw(st.booleans()):
        call["out"] = np.full(call["_result_shape"], 7, rdt)
    return call


@st.composite
def broken_calls(draw):
    call = draw(valid_calls())
    names, targets = set(), set()
    fns = []
    if draw(st.booleans()):
        fns.append(draw(st.sampled_from(SHAPE_CORRUPTIONS)))
    keys = draw(st.sets(st.sampled_from(sorted(ARG_CORRUPTIONS)), min_size=0 if fns else 1,
                        max_size=2))
    if "q/k/v dtype" in keys and "q/k/v object" in keys:
        keys.discard("q/k/v object")
    fns += [ARG_CORRUPTIONS[k] for k in sorted(keys)]
    for fn in fns:
        old = dict(call)
        names |= fn(call, draw)
        targets |= {n for n in call if n not in old or call[n] is not old[n]}
    return call, names, targets, [f.__name__ for f in fns]


def snapshot(x):
    return x.copy() if isinstance(x, np.ndarray) else None


@settings(max_examples=max(1, 3 * _UNIT))
@given(broken_calls(), st.sampled_from(["attention", "attention_weights", "return_lse"]))
def test_malformed_calls_raise_named_errors(case, entry):
    call, names, targets, what = case
    args = {n: a for n, a in call.items() if not n.startswith("_")}
    if entry == "attention_weights":
        if targets <= {"v", "out"}:
            entry = "attention"       # attention_weights has neither: nothing left wrong
        else:
            args.pop("v"), args.pop("out", None)
    before = {n: snapshot(a) for n, a in args.items()}
    with pytest.raises(ERRORS) as info:
        if entry == "attention_weights":
            fastattn.attention_weights(**args)
        else:
            fastattn.attention(**args, return_lse=entry == "return_lse")
    message = str(info.value)
    assert names_any(message, names), f"{what}: message {message!r} names none of {names}"
    for n, snap in before.items():
        if snap is not None:   # out included: never half-written
            np.testing.assert_array_equal(args[n], snap, f"{n} was written to ({what})")


# ------------------------------------------------------- softmax: x and axis

@settings(max_examples=max(1, _UNIT))
@given(st.one_of(
    st.sampled_from([None, "abc", [[1, 2], [3]], Ragged(), 1j, {"x": 1}]),
    st.sampled_from(BAD_DTYPES).map(lambda dt: np.zeros((2, 3), dt)),
), st.sampled_from([-1, 0, None]))
def test_softmax_bad_inputs(x, axis):
    with pytest.raises(ERRORS, match=names("x")):
        fastattn.softmax(x, axis=axis)


def test_softmax_complex_x():
    with pytest.raises(TypeError, match=names("x")):
        fastattn.softmax(np.ones(3, complex))


def test_softmax_bad_axis():
    # NumPy's own errors (AxisError is a ValueError; a non-integer axis a TypeError).
    for axis in (2, -3, "a", 1.5):
        with pytest.raises(ERRORS):
            fastattn.softmax(np.ones((2, 3)), axis=axis)


# ------------------------------------------------------------------- attention_backward


def _backward_call():
    """The arrays of a valid attention_backward call: dout, q, k, v, out, lse."""
    rng = np.random.default_rng(4)
    q, k, v = (rng.standard_normal(s).astype(np.float32)
               for s in ((2, 4, 10, 8), (2, 2, 12, 8), (2, 2, 12, 8)))
    out, lse = fastattn.attention(q, k, v, return_lse=True)
    return [rng.standard_normal(out.shape).astype(np.float32), q, k, v, out, lse]


@pytest.mark.parametrize("index, bad, error, words", [
    (0, lambda a: a[..., :-1, :], ValueError, "dout must have the shape"),
    (0, lambda a: a.astype(np.float64), TypeError, "dout must have the dtype"),
    (4, lambda a: a[None], ValueError, "out must have the shape"),
    (4, lambda a: a.astype(np.float16), TypeError, "out must have the dtype"),
    (5, lambda a: a[..., :-1], ValueError, "lse must have the shape"),   # another Lq
    (5, lambda a: a.astype(np.float64), TypeError, "lse must have the dtype"),
    (1, lambda a: a[..., :5], ValueError, "same head dim"),             # the forward's check
    (3, lambda a: a[:, :1], ValueError, "same heads and length"),
])
def test_bad_arrays_raise(index, bad, error, words):
    args = _backward_call()
    args[index] = bad(args[index])
    with pytest.raises(error, match=words):
        fastattn.attention_backward(*args)


@pytest.mark.parametrize("kw, error, words", [
    (dict(dlse=np.zeros((2, 4, 11), np.float32)), ValueError, "dlse must have the shape"),
    (dict(dlse=np.zeros((2, 4, 10), np.float64)), TypeError, "dlse must have the dtype"),
    (dict(window=(1, 2, 3)), ValueError, "window"),
    (dict(causal="left"), ValueError, "causal"),
    (dict(softcap=0), ValueError, "softcap"),
    (dict(sinks=np.zeros(3)), ValueError, "sinks"),
    (dict(kv_lengths=[13, 1]), ValueError, "kv_lengths"),
    (dict(mask=np.ones((10, 11), bool)), ValueError, "mask"),
])
def test_bad_keywords_raise(kw, error, words):
    with pytest.raises(error, match=words):
        fastattn.attention_backward(*_backward_call(), **kw)


def test_varlen_bad_input_raises():
    rng = np.random.default_rng(5)
    q, k, v = (rng.standard_normal(s) for s in ((2, 9, 4), (1, 12, 4), (1, 12, 4)))
    out, lse = fastattn.attention_varlen(q, k, v, [0, 4, 9], [0, 5, 12], return_lse=True)
    with pytest.raises(ValueError, match="lse must have the shape"):
        fastattn.attention_varlen_backward(out, q, k, v, out, lse[:, :-1], [0, 4, 9], [0, 5, 12])
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        fastattn.attention_varlen_backward(out, q, k, v, out, lse, [0, 4, 8], [0, 5, 12])
    with pytest.raises(TypeError, match="dout must have the dtype"):
        fastattn.attention_varlen_backward(out.astype(np.float32), q, k, v, out, lse,
                                           [0, 4, 9], [0, 5, 12])


# -------------------------------------------------------- the one description of a call


def test_the_kernel_reads_the_problem_by_name(qkv):
    # The compiled entry points read the call's description from the Problem's fields,
    # not from positional copies: a field changed after validation is what the kernel runs.
    from fastattn._calls import args as _args
    from fastattn._calls import glue as _glue
    q, k, v = qkv
    p = _args.Problem(q, k, v, causal=True)
    p.scale, p.causal_code, p.softcap = 0.25, _args.CAUSAL_CODES["top-left"], 2.0
    out = np.empty(p.result_shape(p.Dv))
    _glue.kernel.forward(p, q=q, k=k, v=v, out=out, lse=None, mask=None, n_threads=1)
    np.testing.assert_array_equal(
        out, fastattn.attention(q, k, v, scale=0.25, causal="top-left", softcap=2.0))


def test_a_kernel_with_other_codes_does_not_load(monkeypatch):
    # The codes the Problem carries must be the kernel's: a module that disagrees is refused.
    from fastattn._calls import args as _args
    from fastattn._machine import isa as _dispatch
    monkeypatch.setattr(_args, "CAUSAL_CODES", {"none": 0, "bottom-right": 2, "top-left": 1})
    with pytest.raises(ImportError, match="codes"):
        _dispatch._load(_dispatch.ISA)


# ------------------------------------- softcap, per-head arrays, lengths, cu_seqlens (_args)

X = np.ones((2, 3, 4, 5))  # batch 2, Hq 3, L 4, D 5


@pytest.mark.parametrize("softcap, error", [
    (0, ValueError), (0.0, ValueError), (-1.0, ValueError), (np.inf, ValueError),
    (np.nan, ValueError), (10**400, ValueError), (True, TypeError), ("30", TypeError),
    (np.array([1.0, 2.0]), TypeError), (1j, TypeError),
])
def test_bad_softcap(softcap, error):
    with pytest.raises(error, match="softcap"):
        _args.check_softcap(softcap)
    with pytest.raises(error, match="softcap"):
        ref.attention(X, X, X, softcap=softcap)
    with pytest.raises(error, match="softcap"):
        ref.attention_varlen(X[0], X[0], X[0], [0, 4], [0, 4], softcap=softcap)


def test_good_softcap():
    assert _args.check_softcap(None) is None
    for value in (30, 50.0, np.float32(2.5), np.int64(1), 1e-300):
        out = _args.check_softcap(value)
        assert type(out) is float and out == float(value)


@pytest.mark.parametrize("name", ["alibi_slopes", "sinks"])
@pytest.mark.parametrize("value, error, words", [
    (np.ones(4), ValueError, r"shape \(4,\) does not broadcast to \(\.\.\., Hq\) = \(2, 3\)"),
    (np.ones((3, 3)), ValueError, r"shape \(3, 3\)"),
    (np.ones((1, 2, 3)), ValueError, r"shape \(1, 2, 3\)"),  # would add a batch axis
    (np.ones(3, bool), TypeError, "dtype bool"),
    (np.ones(3, complex), TypeError, "dtype complex128"),
    (np.array(["a", "b", "c"]), TypeError, "dtype <U1"),
    ([1.0, np.nan, 1.0], ValueError, "nan"),
    ([1.0, np.inf, 1.0], ValueError, "inf"),
    ([[1.0], [1.0, 2.0]], ValueError, "could not be converted"),
])
def test_bad_per_head(name, value, error, words):
    check = {"alibi_slopes": _args.check_alibi_slopes, "sinks": _args.check_sinks}[name]
    with pytest.raises(error, match=f"^{name}.*{words}"):
        check(value, (2,), 3)
    with pytest.raises(error, match=f"^{name}"):
        ref.attention(X, X, X, **{name: value})
    with pytest.raises(error, match=f"^{name}"):
        ref.attention_weights(X, X, **{name: value})


def test_minus_inf_is_a_sink_not_a_slope():
    s = _args.check_sinks([0.0, -np.inf, 1.0], (2,), 3)
    assert s.shape == (2, 3) and s.dtype == np.float64 and s[1, 1] == -np.inf
    with pytest.raises(ValueError, match="^alibi_slopes must be finite"):
        _args.check_alibi_slopes([0.0, -np.inf, 1.0], (2,), 3)
    with pytest.raises(ValueError, match=r"^sinks must be finite or -inf"):
        _args.check_sinks([0.0, np.inf, 1.0], (2,), 3)


def test_per_head_normalised(rng):
    slopes = rng.random((3, 1, 4))
    got = _args.check_alibi_slopes(slopes, (3, 2), 4)
    assert got.shape == (6, 4) and got.dtype == np.float64 and got.flags.c_contiguous
    np.testing.assert_array_equal(got.reshape(3, 2, 4), np.broadcast_to(slopes, (3, 2, 4)))
    assert _args.check_sinks(2, (), 3).tolist() == [[2.0, 2.0, 2.0]]
    assert _args.check_alibi_slopes(None, (3,), 4) is None
    assert _args.check_sinks(np.ones(3, np.float16), (), 3).dtype == np.float64


def test_per_head_bfloat16():
    # gpt-oss ships its sinks in bfloat16.
    sinks = np.array([0.5, -1.25, 3.0]).astype(pytest.importorskip("ml_dtypes").bfloat16)
    assert _args.check_sinks(sinks, (), 3).tolist() == [[0.5, -1.25, 3.0]]


@pytest.mark.parametrize("value, error, words", [
    (np.array([1.0, 2.0]), TypeError, "integer array, got dtype float64"),
    (np.array([True, False]), TypeError, "integer array, got dtype bool"),
    (np.array([1, 2, 3]), ValueError, r"shape \(3,\) does not broadcast to the batch shape \(2,\)"),
    (np.array([-1, 2]), ValueError, r"\[0, Lq\] = \[0, 4\], got values in \[-1, 2\]"),
    (np.array([5, 2]), ValueError, r"\[0, Lq\] = \[0, 4\]"),
    (np.array([[1, 2]]), ValueError, "does not broadcast"),
])
def test_bad_q_lengths(value, error, words):
    with pytest.raises(error, match=f"^q_lengths.*{words}"):
        _args.check_q_lengths(value, (2,), 4)
    with pytest.raises(error, match="^q_lengths"):
        ref.attention(X, X, X, q_lengths=value)
    with pytest.raises(error, match="^q_lengths"):
        ref.attention_weights(X, X, q_lengths=value)


def test_lengths_normalised():
    got = _args.check_q_lengths(np.array([[1], [3]], np.uint8), (2, 3), 4)
    assert got.dtype == np.intp and got.tolist() == [1, 1, 1, 3, 3, 3]
    assert _args.check_kv_lengths(np.int64(0), (), 0).tolist() == [0]
    assert _args.check_q_lengths(None, (2,), 4) is None
    with pytest.raises(ValueError, match=r"^kv_lengths must lie in \[0, Lk\] = \[0, 7\]"):
        _args.check_kv_lengths([8], (1,), 7)


@pytest.mark.parametrize("cu_q, cu_k, error, words", [
    ([0.0, 4.0], [0, 4], TypeError, r"^cu_seqlens_q must be a 1-D integer array, got dtype float64"),
    ([0, 4], [False, True], TypeError, r"^cu_seqlens_k must be a 1-D integer array, got dtype bool"),
    ([[0, 4]], [0, 4], ValueError, r"^cu_seqlens_q must be a 1-D.*shape \(1, 2\)"),
    ([], [0, 4], TypeError, r"^cu_seqlens_q"),  # np.asarray([]) is float64
    (np.array([], int), [0, 4], ValueError, r"^cu_seqlens_q must be a 1-D.*shape \(0,\)"),
    ([1, 4], [0, 4], ValueError, r"^cu_seqlens_q must start at 0, got cu_seqlens_q\[0\] = 1"),
    ([0, 3, 2, 4], [0, 1, 2, 4], ValueError,
     r"^cu_seqlens_q must be non-decreasing, got cu_seqlens_q\[1\] = 3 > cu_seqlens_q\[2\] = 2"),
    ([0, 3], [0, 4], ValueError, r"^cu_seqlens_q must end at total_q \(q.shape\[1\]\) = 4"),
    ([0, 4], [0, 5], ValueError, r"^cu_seqlens_k must end at total_k \(k.shape\[1\]\) = 4"),
    ([0, 2, 4], [0, 4], ValueError,
     r"^cu_seqlens_q and cu_seqlens_k must have the same length.*\(3,\).*\(2,\)"),
    (np.array([0, 2**63 + 1, 4], np.uint64), [0, 1, 4], ValueError, "non-decreasing"),
])
def test_bad_cu_seqlens(cu_q, cu_k, error, words):
    with pytest.raises(error, match=words):
        _args.check_cu_seqlens(cu_q, cu_k, 4, 4)
    out = np.full((3, 4, 5), 7.0)
    with pytest.raises(error, match=words):
        ref.attention_varlen(X[0], X[0], X[0], cu_q, cu_k, out=out)
    assert np.all(out == 7.0)  # nothing written before the error


def test_cu_seqlens_normalised():
    cu_q, cu_k = _args.check_cu_seqlens(np.array([0, 2, 2, 5], np.int32), [0, 0, 3, 3], 5, 3)
    assert cu_q.dtype == cu_k.dtype == np.intp
    assert cu_q.tolist() == [0, 2, 2, 5] and cu_k.tolist() == [0, 0, 3, 3]


@pytest.mark.parametrize("q_shape, k_shape, v_shape, words", [
    ((1, 3, 4, 5), (3, 4, 5), (3, 4, 5), r"^q must have shape \(Hq, total_q, D\)"),
    ((4, 5), (3, 4, 5), (3, 4, 5), r"^q must have shape"),
    ((3, 4, 5), (3, 4, 6), (3, 4, 5), r"same head dim D: q.shape=\(3, 4, 5\), k.shape=\(3, 4, 6\)"),
    ((3, 4, 5), (3, 4, 5), (3, 3, 5), r"same heads and length.*v.shape=\(3, 3, 5\)"),
    ((3, 4, 5), (2, 4, 5), (2, 4, 5), r"multiple of the key/value heads.*Hq=3.*Hkv=2"),
])
def test_bad_varlen_shapes(q_shape, k_shape, v_shape, words):
    q, k, v = np.ones(q_shape), np.ones(k_shape), np.ones(v_shape)
    with pytest.raises(ValueError, match=words):
        _args.check_varlen_shapes(q, k, v)
    with pytest.raises(ValueError, match=words):
        ref.attention_varlen(q, k, v, [0, 4], [0, 4])


def test_bad_varlen_keywords():
    x = np.ones((2, 4, 3))
    with pytest.raises(ValueError, match=r"^alibi_slopes of shape \(3,\).*= \(2,\)"):
        ref.attention_varlen(x, x, x, [0, 4], [0, 4], alibi_slopes=[1, 2, 3])
    with pytest.raises(ValueError, match=r"^sinks of shape \(1, 2\).*= \(2,\)"):
        ref.attention_varlen(x, x, x, [0, 4], [0, 4], sinks=[[1, 2]])
    with pytest.raises(ValueError, match=r"^out must have shape \(2, 4, 3\)"):
        ref.attention_varlen(x, x, x, [0, 4], [0, 4], out=np.empty((2, 4, 4)))
    with pytest.raises(ValueError, match="window"):
        ref.attention_varlen(x, x, x, [0, 4], [0, 4], window=(-2, 0))


def test_storage_dtype():
    assert _args.storage_dtype(np.float16) == np.float16
    assert _args.storage_dtype("float32") == np.float32
    for bad in (np.int8, np.complex64, "float8"):
        with pytest.raises(TypeError, match="^kv_dtype"):
            _args.storage_dtype(bad, "kv_dtype")


def test_storage_dtype_bfloat16():
    bf16 = np.dtype(pytest.importorskip("ml_dtypes").bfloat16)
    assert _args.storage_dtype("bfloat16") == bf16
    assert _args.storage_dtype(bf16) == bf16
