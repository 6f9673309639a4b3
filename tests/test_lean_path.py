"""The lean call path is only a gate: for every call it either declines (returns None) or
gives exactly the bits of the validated path, and it never takes a call that the front end
rejects.  Hypothesis draws calls around the gate's edges: dtypes and byte orders, layouts,
scale and causal spellings, out arrays, sinks, and invalid arguments.  The gate normalises
nothing itself: it takes the causal codes of fastattn._calls.args."""
import os
import subprocess
import sys

import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import event, given, settings, strategies as st  # noqa: E402

import fastattn  # noqa: E402
from fastattn._calls import api as _api  # noqa: E402
from fastattn._machine.isa import kernel  # noqa: E402

from conftest import make_qkv  # noqa: E402

try:
    import ml_dtypes
    _DTYPES = [np.float32, np.float64, np.float16, ml_dtypes.bfloat16]
except ImportError:
    _DTYPES = [np.float32, np.float64, np.float16]


def _validated(q, k, v, **keywords):
    """fastattn.attention with the lean path switched off."""
    saved, _api._LEAN_PATH = _api._LEAN_PATH, False
    try:
        return fastattn.attention(q, k, v, **keywords)
    finally:
        _api._LEAN_PATH = saved


@st.composite
def _array(draw, shape, dtype, rng):
    a = rng.standard_normal(shape).astype(dtype)
    layout = draw(st.sampled_from(["c"] * 6 + ["transposed", "reversed", "swapped", "sliced"]))
    if layout == "transposed" and a.ndim >= 2:      # last axis not contiguous: declined
        a = np.ascontiguousarray(np.swapaxes(a, -1, -2)).swapaxes(-1, -2)
    elif layout == "reversed" and a.ndim >= 3:      # negative head stride: taken
        a = np.ascontiguousarray(a[..., ::-1, :, :])[..., ::-1, :, :]
    elif layout == "swapped" and a.dtype.kind == "f":
        a = a.astype(a.dtype.newbyteorder("S"))     # non-native: declined, then converted
    elif layout == "sliced":
        a = np.concatenate([a, a], axis=-1)[..., : a.shape[-1]]
    return a


@st.composite
def calls(draw):
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    nd = draw(st.integers(2, 4))
    group, Hkv = draw(st.integers(1, 3)), draw(st.integers(1, 2))
    Lq, Lk, D, Dv = (draw(st.integers(lo, 20)) for lo in (0, 0, 0, 1))
    batch = tuple(draw(st.integers(1, 2)) for _ in range(nd - 3))
    heads_q = (group * Hkv,) if nd >= 3 else ()
    heads_kv = (Hkv,) if nd >= 3 else ()
    dts = [draw(st.sampled_from(_DTYPES)) for _ in range(3)]
    q = draw(_array(batch + heads_q + (Lq, D), dts[0], rng))
    k = draw(_array(batch + heads_kv + (Lk, D), dts[1], rng))
    v = draw(_array(batch + heads_kv + (Lk, Dv), dts[2], rng))
    if batch and draw(st.integers(0, 5)) == 0:  # broadcast batch dims: declined
        k = k[:1]
    keywords = dict(
        scale=draw(st.sampled_from([None] * 8 + [0.5, 2, np.float32(0.25), float("inf"),
                                                 2**60, "x"])),
        causal=draw(st.sampled_from([False, True] * 6 + ["top-left", np.True_, 1])),
        return_lse=draw(st.sampled_from([False, True] * 3 + [np.False_])),
    )
    Hq = heads_q[0] if heads_q else 1
    sinks = draw(st.sampled_from(["none"] * 12 + ["f64"] * 2 + ["f32", "neg_inf", "nan", "list",
                                                                "wrong"]))
    keywords["sinks"] = {
        "none": None, "f64": rng.standard_normal(Hq), "list": [0.5] * Hq,
        "f32": rng.standard_normal(Hq).astype(np.float32),
        "neg_inf": np.full(Hq, -np.inf), "nan": np.full(Hq, np.nan),
        "wrong": np.zeros(Hq + 1)}[sinks]
    keywords["out"] = draw(st.sampled_from(["none"] * 6 + ["right"] * 3 + ["swapped", "float64",
                                                                          "input"]))
    return q, k, v, keywords


def _make_out(kind, q, k, v):
    """A fresh ``out`` of the given kind for the call (None when the kind needs none)."""
    if kind == "none":
        return None
    try:
        shape, dtype = np.broadcast_shapes(q.shape[:-1], k.shape[:-2] + q.shape[-2:-1]) + (
            v.shape[-1],), fastattn.attention(q[..., :0, :], k, v).dtype
    except (TypeError, ValueError):
        return np.empty(1)
    if kind == "input":                        # overlaps q: declined, then a copy
        return q if q.shape == shape else np.empty(shape, dtype)
    if kind == "swapped" and dtype.kind == "f":
        return np.full(shape, 3, dtype.newbyteorder("S"))
    return np.full(shape, 3, np.float64 if kind == "float64" else dtype)


@settings(max_examples=max(500, settings().max_examples))
@given(calls())
def test_the_lean_path_declines_or_gives_the_validated_bits(call):
    q, k, v, keywords = call
    out_kind = keywords.pop("out")
    lean_out, valid_out = _make_out(out_kind, q, k, v), _make_out(out_kind, q, k, v)
    args = (keywords["scale"], keywords["causal"], keywords["return_lse"])
    if type(args[2]) is not bool:              # the front end checks it before the gate
        lean = None
    else:
        lean = kernel.attention_fast(q, k, v, *args, lean_out, 1, keywords["sinks"])
    try:
        want = _validated(q, k, v, out=valid_out, **keywords)
    except (TypeError, ValueError):
        assert lean is None, "the lean path took a call the front end rejects"
        event("rejected by the front end")
        return
    event("declined" if lean is None else "taken by the lean path")
    if lean is None:
        return
    got = lean if isinstance(lean, tuple) else (lean,)
    want = want if isinstance(want, tuple) else (want,)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape
        np.testing.assert_array_equal(g, w)
    if lean_out is not None:
        assert got[0] is lean_out


def test_common_calls_take_the_lean_path():
    # The gate must not decline everything: the calls it exists for are taken.
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 4, 6, 8)).astype(np.float32) for _ in range(3))
    assert kernel.attention_fast(q, k, v, None, True, True, None, 1) is not None
    assert kernel.attention_fast(q, k, v, 0.5, False, False, None, 1, np.zeros(4)) is not None
    assert kernel.attention_fast(q.astype(">f4"), k, v, None, True, True, None, 1) is None


def test_an_environment_switch_forces_the_validated_path():
    code = ("import fastattn._calls.api as a, numpy as np, fastattn; x = np.ones((2, 3, 4));"
            "print(a._LEAN_PATH, fastattn.attention(x, x, x).shape)")
    env = dict(os.environ, FASTATTN_VALIDATED_ONLY="1")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    run = subprocess.run([sys.executable, "-c", code], env=env, cwd=root, capture_output=True,
                         text=True, check=True)
    assert run.stdout.split() == ["False", "(2,", "3,", "4)"]


def test_sinks_on_the_lean_path_give_the_validated_path_bits(rng):
    # A plain call with sinks of one batch element runs in the lean path; the same call
    # through the validated path (kv_lengths = Lk changes nothing) gives the same bits,
    # and invalid sinks still get the validated path's errors.
    from fastattn._machine.isa import kernel
    q = rng.standard_normal((1, 8, 3, 32)).astype(np.float32)
    k = rng.standard_normal((1, 2, 300, 32)).astype(np.float32)
    v = rng.standard_normal((1, 2, 300, 32)).astype(np.float32)
    sinks = rng.standard_normal(8)
    sinks[3] = -np.inf
    assert kernel.attention_fast(q, k, v, None, True, False, None, 1, sinks) is not None
    for s in (sinks, sinks.astype(np.float32), list(sinks)):
        fast, fast_lse = fastattn.attention(q, k, v, causal=True, sinks=s, return_lse=True)
        slow, slow_lse = fastattn.attention(q, k, v, causal=True, sinks=s, return_lse=True,
                                            kv_lengths=np.array([300]))
        assert fast.tobytes() == slow.tobytes() and fast_lse.tobytes() == slow_lse.tobytes()
    bad = sinks.copy()
    bad[0] = np.nan
    with pytest.raises(ValueError, match="sinks"):
        fastattn.attention(q, k, v, sinks=bad)
    with pytest.raises(ValueError, match="sinks"):
        fastattn.attention(q, k, v, sinks=np.zeros(5))


def test_the_lean_gate_takes_causal_codes_from_the_one_normaliser():
    # The gate normalises nothing: without the codes fastattn._calls.args gives causal=False and
    # causal=True (handed over when fastattn._machine.isa loads the module), it takes no call.
    from fastattn._calls import args as _args
    q, k, v = make_qkv(7, batch=(2,), Hq=4, Hkv=2, Lq=5, Lk=7, D=8, Dv=6, dtype=np.float64)
    assert kernel.attention_fast(q, k, v, None, True, False, None, 1) is not None
    try:
        kernel.lean_causal_codes(-1, -1)
        assert kernel.attention_fast(q, k, v, None, True, False, None, 1) is None
        assert kernel.attention_fast(q, k, v, None, False, False, None, 1) is None
    finally:
        kernel.lean_causal_codes(_args.CAUSAL_CODES["none"], _args.CAUSAL_CODES["bottom-right"])
    np.testing.assert_array_equal(kernel.attention_fast(q, k, v, None, True, False, None, 1),
                                  _validated(q, k, v, causal=True))
