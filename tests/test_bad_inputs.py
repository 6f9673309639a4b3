"""Malformed calls never crash: they raise ValueError/TypeError naming the argument.

Hypothesis builds a valid call (random small shapes, dtypes, keywords), breaks it with one
or two corruptions from the catalogue below (wrong ndim, mismatched dims, bad dtypes,
object/complex/str/datetime arrays, ragged lists, non-arrays, bad or out-of-range
kv_lengths, bad out, bad window/causal/scale, bad masks) and checks that

* the call raises ValueError or TypeError -- nothing else (no OverflowError, IndexError,
  SystemError, segfault) -- whose message names one of the arguments concerned;
* ``out`` is untouched (no partial write) and no input array was written to.

The same calls go through every public entry point that takes those arguments
(attention, attention_weights), so both the Python front end and the compiled fast path
of fastattn.attention (taken when window/mask/kv_lengths are absent) are exercised.
"""

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import fastattn

from conftest import names, names_any

_UNIT = settings.default.max_examples
ERRORS = (ValueError, TypeError)


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


@settings(max_examples=max(1, _UNIT))
@given(st.one_of(
    st.sampled_from([None, "abc", [[1, 2], [3]], Ragged(), 1j, {"x": 1}]),
    st.sampled_from(BAD_DTYPES).map(lambda dt: np.zeros((2, 3), dt)),
), st.sampled_from([-1, 0, None]))
def test_softmax_bad_inputs(x, axis):
    with pytest.raises(ERRORS, match=names("x")):
        fastattn.softmax(x, axis=axis)


def test_softmax_bad_axis():
    # NumPy's own errors (AxisError is a ValueError; a non-integer axis a TypeError).
    for axis in (2, -3, "a", 1.5):
        with pytest.raises(ERRORS):
            fastattn.softmax(np.ones((2, 3)), axis=axis)


# --------------------------------------------------------------------------- out aliasing

@pytest.mark.parametrize("alias", ["q", "k", "v", "q_reversed", "v_rows_reversed"])
@pytest.mark.parametrize("window", [None, (2, 0)])
def test_out_aliasing_an_input(alias, window):
    # Not an error: `out` may be one of the inputs (in-place attention). The result must be
    # the one of a fresh call -- nothing read after it was overwritten.
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal((2, 2, 37, 8)).astype(np.float32) for _ in range(3))
    expected = fastattn.attention(q, k, v, causal=True, window=window)
    q2, k2, v2 = q.copy(), k.copy(), v.copy()
    out = {"q": q2, "k": k2, "v": v2, "q_reversed": q2[..., ::-1, :],
           "v_rows_reversed": v2[..., ::-1, :]}[alias]
    res = fastattn.attention(q2, k2, v2, causal=True, window=window, out=out)
    assert res is out
    np.testing.assert_array_equal(res, expected)


# --------------------------------------------------------------- fixed bugs (regression tests)

def test_huge_integer_scale_is_a_value_error():
    x = np.ones((2, 3))
    with pytest.raises(ValueError, match="scale"):
        fastattn.attention(x, x, x, scale=10 ** 400)


@pytest.mark.parametrize("arg", ["q", "k", "v"])
def test_longdouble_error_names_the_argument(arg):
    arrays = {n: np.ones((3, 2)) for n in "qkv"}
    arrays[arg] = arrays[arg].astype(np.longdouble)
    with pytest.raises(TypeError) as info:
        fastattn.attention(**arrays)
    assert names_any(str(info.value), {arg}), str(info.value)


@pytest.mark.parametrize("kw", [{}, {"window": (1, 1)}, {"out": np.ones((2, 3), np.float32)}])
def test_v_none_is_a_type_error(kw):
    x = np.ones((2, 3), np.float32)
    with pytest.raises(TypeError, match=names("v")):
        fastattn.attention(x, x, None, **kw)
