"""Property-based tests: fastattn against the float64 reference over random valid calls.

Hypothesis draws whole calls: shapes (0 and 1 lengths, lengths at the kernel's block edges
64/96, odd and large head dims, GQA groups, broadcast batch dims, the 2-D one-head form),
dtypes, memory layouts (transposed, negative steps, zero-stride broadcasts, padded slices
whose gaps hold NaN so that a read out of bounds shows, Fortran order, read-only), causal
alignments, windows, kv_lengths, bool and additive masks, scale, and value ranges.

What "correct" means here
-------------------------
* Finite inputs: the kernel must agree with ``fastattn.reference`` run on the inputs cast
  to float64 (exact: float16/32 and small ints are float64 values), within an error bound
  derived from the arithmetic, not tuned: with u the unit roundoff of the compute dtype,
  a score is off by at most dS = u * ((D + 2) * S + M) (S bounds |scale| * sum_d |q_d k_d|,
  M the largest finite additive mask), which moves the softmax weights by a factor
  exp(+-2 dS); the sums over Lk keys add (2 Lk + 64) u (the 64 covers the vector exp's few
  ulps and the rescaling per key block). Outputs are compared to that bound times max|v|,
  lse to dS + (Lk + 64) u + u |lse|; float16 results add one float16 rounding. Any real
  bug (a wrong key, a missed rescale, a stride mix-up) is off by O(max|v|) instead.
* Non-finite inputs (NaN, +-inf in q, k, v or a float mask), see test_nonfinite_*: a row
  whose visible scores include NaN or +inf has no meaningful softmax; like the reference
  (and PyTorch) its output and lse must be NaN -- never a silent number. A score of -inf
  hides its key, exactly like False in a bool mask. A non-finite value row v_j poisons the
  output columns it has in every row that sees key j. Rows not touched by any of this
  must match the reference. Keys beyond kv_lengths do not exist: garbage there never leaks.
  Keys hidden by causal/window/mask may hold non-finite v: the kernel is allowed (not
  required) to turn 0 * NaN into NaN in the columns concerned, as the reference does.
* Invariants: attention_weights rows sum to 1 when a key is visible and are all 0 otherwise;
  attention == weights @ v; merging the results over two disjoint key sets with their lse
  gives the full call.  (That bits do not depend on the thread count, the batch or Lq,
  over these calls: tests/test_reproducibility.py.)

Example counts scale with the hypothesis profile (tests/conftest.py): ``default`` (CI)
runs about 700 cases in this file, ``--hypothesis-profile=long`` ten times as many.
"""

import math

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import fastattn
from fastattn import reference as ref

# The profile's max_examples (100 default, 1000 long) is the unit of every test's budget.
_UNIT = settings.default.max_examples


def budget(factor):
    return settings(max_examples=max(1, int(_UNIT * factor)))


# Shapes near the kernel's edges: key blocks of 64, query tiles of 96 rows, 6-row/6-key
# micro-tiles, vectors of 4/8/16 lanes.
LENGTHS = st.one_of(st.sampled_from([0, 1, 2, 5, 6, 7, 63, 64, 65, 95, 96, 97, 130]),
                    st.integers(0, 140))
HEAD_DIMS = st.sampled_from([1, 2, 3, 4, 7, 8, 9, 15, 16, 17, 31, 32, 33, 63, 64, 65, 100,
                             128, 129, 256])
BATCHES = st.sampled_from([
    ((), (), ()), ((1,), (1,), (1,)), ((2,), (2,), (2,)), ((2,), (1,), (1,)),
    ((1,), (3,), (3,)), ((1,), (2,), (1,)), ((2,), (1,), (2,)), ((2, 1), (1, 3), (1, 3)),
    ((3, 1), (1, 2), (3, 2)), ((1, 1, 2), (2, 1, 1), (1, 1, 1)),
])
LAYOUTS = ["contiguous", "rows_heads_swapped", "transposed", "negative_rows",
           "negative_cols", "padded", "fortran", "broadcast_rows", "broadcast_heads",
           "readonly"]

UNIT_ROUNDOFF = {np.dtype(np.float32): 2.0 ** -24, np.dtype(np.float64): 2.0 ** -53}
F16_ROUNDOFF = 2.0 ** -11


# --------------------------------------------------------------------------- helpers

def compute_dtype(*dtypes):
    res = np.result_type(*dtypes)
    if res.kind in "biu":
        return np.dtype(np.float64)
    return np.dtype(np.float32) if res == np.float16 else res


def result_dtype(*dtypes):
    res = np.result_type(*dtypes)
    return np.dtype(np.float64) if res.kind in "biu" else res


def lay_out(x, layout, rng):
    """A view with the logical values of ``x`` (or a broadcast of part of them) in memory
    arranged as ``layout`` says. Returns the view; its values are what both sides see."""
    if x.ndim < 2 or x.size == 0:
        return x
    if layout == "rows_heads_swapped" and x.ndim >= 3:   # (B, L, H, D) storage
        return np.swapaxes(np.ascontiguousarray(np.swapaxes(x, -2, -3)), -2, -3)
    if layout == "transposed":                            # (.., D, L) storage
        return np.swapaxes(np.ascontiguousarray(np.swapaxes(x, -1, -2)), -1, -2)
    if layout == "negative_rows":
        return np.ascontiguousarray(x[..., ::-1, :])[..., ::-1, :]
    if layout == "negative_cols":
        return np.ascontiguousarray(x[..., ::-1])[..., ::-1]
    if layout == "padded":
        # Every other row and column of a bigger array; the gaps hold NaN (or a huge int)
        # so that reading a wrong element cannot go unnoticed.
        big = np.empty(x.shape[:-2] + (2 * x.shape[-2], 2 * x.shape[-1] + 1), x.dtype)
        big[...] = np.nan if x.dtype.kind == "f" else (1 if x.dtype == bool else 99)
        view = big[..., 1::2, 1::2]
        view[...] = x
        return view
    if layout == "fortran":
        return np.asfortranarray(x)
    if layout == "broadcast_rows":                        # zero stride along the rows
        return np.broadcast_to(x[..., :1, :], x.shape)
    if layout == "broadcast_heads" and x.ndim >= 3:
        return np.broadcast_to(x[..., :1, :, :], x.shape)
    if layout == "readonly":
        x = x.copy()
        x.setflags(write=False)
        return x
    return x


def values(rng, shape, dtype, magnitude):
    """Standard normal (clipped to +-6) times ``magnitude``, in ``dtype``."""
    dtype = np.dtype(dtype)
    if dtype == bool:
        return rng.random(shape) < 0.5
    if dtype.kind in "iu":
        return rng.integers(-3, 4, size=shape).astype(dtype)
    return (np.clip(rng.standard_normal(shape), -6, 6) * magnitude).astype(dtype)


# Value ranges, per compute dtype: (q/k magnitude, v magnitude, scale factor). "huge" and
# "tiny" inputs get a compensating scale so that scores stay O(1-10): what is tested is
# that nothing overflows or flushes on the way (products of 1e15 * 1e15 in float32 are
# fine, 1e30 * D of them too); "sharp" makes scores of O(100-1000): near one-hot softmax.
RANGES = {
    "normal": {np.float16: (1, 1, 1), np.float32: (1, 1, 1), np.float64: (1, 1, 1)},
    "tiny": {np.float16: (1e-2, 1e-5, 1e4), np.float32: (1e-18, 1e-30, 1e36),
             np.float64: (1e-150, 1e-300, 1e300)},
    "huge": {np.float16: (1e2, 1e4, 1e-4), np.float32: (1e15, 1e30, 1e-30),
             np.float64: (1e150, 1e300, 1e-300)},
    "sharp": {np.float16: (6, 1, 1), np.float32: (12, 1, 1), np.float64: (12, 1, 1)},
}


@st.composite
def calls(draw, dtypes=(np.float32, np.float64, np.float16, "mixed", np.int8, np.int64),
          ranges=tuple(RANGES), layouts=True, masks=True):
    """A random valid call: (q, k, v, kwargs, info)."""
    seed = draw(st.integers(0, 2 ** 32 - 1))
    rng = np.random.default_rng(seed)
    two_dim = draw(st.integers(0, 9)) == 0
    qb, kb, vb = ((), (), ()) if two_dim else draw(BATCHES)
    Hkv = 1 if two_dim else draw(st.integers(1, 3))
    Hq = Hkv * (1 if two_dim else draw(st.sampled_from([1, 1, 2, 3])))
    Lq, Lk = draw(LENGTHS), draw(LENGTHS)
    D, Dv = draw(HEAD_DIMS), draw(HEAD_DIMS)
    if math.prod(np.broadcast_shapes(qb, kb, vb)) * Hq * Lq * Lk * (D + Dv) > 4e6:
        Lq, Lk = min(Lq, 40), min(Lk, 70)  # keep the float64 reference cheap
    dt = draw(st.sampled_from(dtypes))
    if dt == "mixed":
        dq, dk, dv = (draw(st.sampled_from([np.float16, np.float32, np.float64, np.int16]))
                      for _ in range(3))
    else:
        dq = dk = dv = dt
    cdt = compute_dtype(dq, dk, dv)
    floats = dt in (np.float16, np.float32, np.float64)
    rng_name = draw(st.sampled_from(ranges)) if floats else "normal"
    qk_mag, v_mag, scale_mag = RANGES[rng_name][dt] if floats else (1, 1, 1)

    def core(batch, H, L, d):
        return ((L, d) if two_dim else (*batch, H, L, d))

    q = values(rng, core(qb, Hq, Lq, D), dq, qk_mag)
    k = values(rng, core(kb, Hkv, Lk, D), dk, qk_mag)
    v = values(rng, core(vb, Hkv, Lk, Dv), dv, v_mag)
    if layouts:
        q, k, v = (lay_out(a, draw(st.sampled_from(LAYOUTS)), rng) for a in (q, k, v))

    kw = {}
    s = draw(st.sampled_from([None, None, 1.0, 0.0, -0.5, 0.125, 3.7, 0.01]))
    if D == 0 or s is not None or scale_mag != 1:
        kw["scale"] = (1.0 if s is None else s) * scale_mag / (1 if D == 0 else math.sqrt(D))
    causal = draw(st.sampled_from([False, False, True, "top-left", "bottom-right"]))
    if causal is not False:
        kw["causal"] = causal
    if draw(st.booleans()):
        kw["window"] = (draw(st.sampled_from([-1, 0, 1, 3, 20, 70, 200])),
                        draw(st.sampled_from([-1, 0, 1, 3, 20, 70, 200])))
    batch = np.broadcast_shapes(qb, kb, vb)
    if draw(st.booleans()):
        kv_shape = draw(st.sampled_from([(), batch, batch[-1:]]))
        kw["kv_lengths"] = rng.integers(0, Lk + 1, size=kv_shape).astype(
            draw(st.sampled_from([np.int64, np.int32, np.uint16, np.intp])))
    mask_kind = draw(st.sampled_from(["none", "bool", "float"])) if masks else "none"
    if mask_kind != "none":
        full = (*batch, Hq, Lq, Lk)
        shape = tuple(n if draw(st.booleans()) else 1 for n in full)
        shape = shape[draw(st.integers(0, len(batch))):]   # fewer leading dims broadcast too
        if two_dim:
            shape = shape[-2:] if draw(st.booleans()) else shape
        if mask_kind == "bool":
            kw["mask"] = rng.random(shape) < draw(st.sampled_from([0.0, 0.3, 0.9, 1.0]))
        else:
            m = rng.standard_normal(shape) * draw(st.sampled_from([0.5, 3.0, 30.0]))
            m[rng.random(shape) < 0.2] = -np.inf
            kw["mask"] = m.astype(draw(st.sampled_from([np.float16, np.float32, np.float64])))
        if layouts and draw(st.booleans()):
            kw["mask"] = lay_out(kw["mask"], draw(st.sampled_from(LAYOUTS)), rng)
    return q, k, v, kw, dict(range=rng_name, seed=seed)


def truth(q, k, v, **kw):
    """The float64 reference on the same values (all dtypes here are exact in float64)."""
    kw = dict(kw)
    if kw.get("mask") is not None and kw["mask"].dtype.kind == "f":
        # The kernel adds the mask in the compute dtype; the bound covers that rounding.
        kw["mask"] = kw["mask"].astype(np.float64)
    with np.errstate(invalid="ignore", over="ignore"):   # NaN/inf inputs: expected here
        return ref.attention(*(np.asarray(a, np.float64) for a in (q, k, v)),
                             return_lse=True, **kw)


def error_bounds(q, k, v, kw, cdt):
    """(output bound, lse bound) of the module docstring, as floats (global maxima)."""
    u = UNIT_ROUNDOFF[cdt]
    q64, k64, v64 = (np.abs(np.asarray(a, np.float64)) for a in (q, k, v))
    D, Lk = q64.shape[-1], k64.shape[-2]
    scale = kw.get("scale")
    scale = 1 / math.sqrt(D) if scale is None else abs(scale)
    if q64.size and k64.size:
        if q64.ndim == 2:
            S = float((q64 @ k64.T).max(initial=0.0)) * scale
        else:
            G = q64.shape[-3] // k64.shape[-3]
            kk = np.repeat(k64, G, axis=-3)
            S = float(np.matmul(q64, np.swapaxes(kk, -1, -2)).max(initial=0.0)) * scale
    else:
        S = 0.0
    M = 0.0
    mask = kw.get("mask")
    if mask is not None and mask.dtype.kind == "f" and mask.size:
        fin = np.abs(mask[np.isfinite(mask)].astype(np.float64))
        M = float(fin.max(initial=0.0))
    tiny = np.finfo(cdt).smallest_subnormal
    dS = u * ((D + 2) * S + 2 * M) + (D + 2) * tiny * scale
    vmax = float(v64.max(initial=0.0))
    out_tol = 2 * (vmax * (math.expm1(2 * dS) + u * (2 * Lk + 64)) + (Lk + 2) * tiny)
    lse_tol = 2 * (dS + u * (Lk + 64))
    return out_tol, lse_tol, u


def check_against_truth(q, k, v, kw, out, lse):
    cdt = compute_dtype(q.dtype, k.dtype, v.dtype)
    rdt = result_dtype(q.dtype, k.dtype, v.dtype)
    assert out.dtype == rdt, (out.dtype, rdt)
    assert lse.dtype == cdt, (lse.dtype, cdt)
    t_out, t_lse = truth(q, k, v, **kw)
    assert out.shape == t_out.shape and lse.shape == t_lse.shape
    out_tol, lse_tol, u = error_bounds(q, k, v, kw, cdt)
    o = out.astype(np.float64)
    assert np.isfinite(o).all(), "non-finite output for finite inputs"
    err = np.abs(o - t_out)
    bound = out_tol
    if rdt == np.float16:
        bound = out_tol + F16_ROUNDOFF * np.abs(t_out) + np.finfo(np.float16).smallest_subnormal
    bad = err > bound
    assert not bad.any(), (
        f"output off by {err.max():.3g} (bound {np.max(bound):.3g}) at "
        f"{np.argwhere(bad)[:5].tolist()}")
    lf = lse.astype(np.float64)
    np.testing.assert_array_equal(np.isneginf(lf), np.isneginf(t_lse), "rows with no key")
    assert not np.isnan(lf).any()
    fin = np.isfinite(t_lse)
    if fin.any():
        lerr = np.abs(lf[fin] - t_lse[fin])
        lbound = lse_tol + 2 * u * np.abs(t_lse[fin])
        assert (lerr <= lbound).all(), f"lse off by {lerr.max():.3g} (bound {lbound.max():.3g})"
    # Rows that see nothing: exact zeros.
    assert (o[np.isneginf(t_lse)] == 0).all()


def snapshot(*arrays):
    return [None if a is None else (np.asarray(a).copy(), np.asarray(a).strides) for a in arrays]


def assert_unchanged(arrays, snaps):
    for a, s in zip(arrays, snaps):
        if a is not None:
            np.testing.assert_array_equal(np.asarray(a), s[0], "an input was written to")


# --------------------------------------------------------------------------- vs reference

@budget(2)
@given(calls())
def test_matches_reference(case):
    q, k, v, kw, info = case
    before = snapshot(q, k, v, kw.get("mask"))
    out, lse = fastattn.attention(q, k, v, return_lse=True, **kw)
    assert_unchanged((q, k, v, kw.get("mask")), before)
    check_against_truth(q, k, v, kw, out, lse)


@budget(0.5)
@given(calls(dtypes=(np.float32, np.float64, np.float16)), st.data())
def test_out_argument(case, data):
    # `out` of any layout (contiguous, padded, negative, aliased with nothing) is written
    # with exactly the result of the call without it, and is what's returned.
    q, k, v, kw, info = case
    expected, lse = fastattn.attention(q, k, v, return_lse=True, **kw)
    layout = data.draw(st.sampled_from(["contiguous", "padded", "negative_rows",
                                        "negative_cols", "transposed", "fortran"]))
    out = lay_out(np.full(expected.shape, 7, expected.dtype), layout, None)
    res = fastattn.attention(q, k, v, out=out, **kw)
    assert res is out
    np.testing.assert_array_equal(out, expected)


# --------------------------------------------------------------------------- non-finite

def poison(rng, a, frac, kinds):
    """A copy of float array ``a`` with a fraction of entries set to NaN/+inf/-inf."""
    a = np.array(a, copy=True)
    if a.size == 0 or a.dtype.kind != "f":
        return a
    hit = rng.random(a.shape) < frac
    choice = rng.choice(np.array(kinds, dtype=np.float64), size=a.shape)
    a[hit] = choice[hit].astype(a.dtype)
    return a


@st.composite
def nonfinite_calls(draw):
    q, k, v, kw, info = draw(calls(dtypes=(np.float32, np.float64, np.float16),
                                   ranges=("normal",), layouts=False))
    rng = np.random.default_rng(info["seed"] + 1)
    kinds = draw(st.sampled_from([[np.nan], [np.inf], [-np.inf], [np.nan, np.inf, -np.inf]]))
    frac = draw(st.sampled_from([0.002, 0.02, 0.2]))
    targets = draw(st.sets(st.sampled_from(["q", "k", "v", "mask"]), min_size=1))
    if "q" in targets:
        q = poison(rng, q, frac, kinds)
    if "k" in targets:
        k = poison(rng, k, frac, kinds)
    if "v" in targets:
        v = poison(rng, v, frac, kinds)
    if "mask" in targets and kw.get("mask") is not None and kw["mask"].dtype.kind == "f":
        kw["mask"] = poison(rng, kw["mask"], frac, kinds)
    return q, k, v, kw, info


def nonfinite_expectations(q, k, v, kw):
    """From the float64 reference: which rows must be NaN, which may be, the rest's values.

    Returns (t_out, t_lse, nan_rows, open_cols): ``nan_rows`` (..., Hq, Lq) rows with a
    visible NaN/+inf score; ``open_cols`` (..., Hq, Lq, Dv) entries that must be non-finite
    (a visible key's v is non-finite there) or may be (only a hidden key's v is).
    """
    q64, k64, v64 = (np.asarray(a, np.float64) for a in (q, k, v))
    kv_len = kw.get("kv_lengths")
    bad_v = ~np.isfinite(v64)
    # Reference with finite v (non-finite v entries -> 0): its lse tells the score story.
    t_out, t_lse = truth(q64, k64, np.where(bad_v, 0.0, v64), **kw)
    nan_rows = np.isnan(t_lse)
    with np.errstate(invalid="ignore", over="ignore"):
        w = ref.attention_weights(q64, k64, **kw)
    # Keys each row sees (weights of NaN rows are NaN: those rows are decided already).
    sees = np.nan_to_num(w, nan=1.0) > 0
    squeeze = q64.ndim == 2
    if squeeze:
        sees, v64b, bad_vb = sees[None], v64[None], bad_v[None]
    else:
        v64b, bad_vb = v64, bad_v
    Hq, Hkv = sees.shape[-3], v64b.shape[-3]
    G = Hq // Hkv
    badv_q = np.repeat(bad_vb, G, axis=-3).astype(np.float64)  # (.., Hq, Lk, Dv)
    must = np.matmul(sees.astype(np.float64), badv_q) > 0
    # Existing keys (j < kv_len) hidden from the row: their v may leak as 0 * NaN.
    Lk = v64b.shape[-2]
    batch = sees.shape[:-3]
    lengths = (np.full(batch, Lk) if kv_len is None
               else np.broadcast_to(kv_len, batch))[..., None, None, None]
    exists = np.arange(Lk) < lengths                                  # (..., 1, 1, Lk)
    hidden = (~sees) & exists
    may = np.matmul(hidden.astype(np.float64), badv_q) > 0
    if squeeze:
        must, may = must[0], may[0]
    return t_out, t_lse, nan_rows, must, may


def check_nonfinite(q, k, v, kw):
    out, lse = fastattn.attention(q, k, v, return_lse=True, **kw)
    t_out, t_lse, nan_rows, must, may = nonfinite_expectations(q, k, v, kw)
    o = out.astype(np.float64)
    lf = lse.astype(np.float64)
    # 1. Rows with a visible NaN or +inf score: NaN output and lse, never a number.
    assert np.isnan(lf[nan_rows]).all(), "a row with a NaN/+inf score got a finite lse"
    assert np.isnan(o[nan_rows]).all(), "a row with a NaN/+inf score got finite outputs"
    rows_ok = ~nan_rows
    # 2. Every other row: lse as the reference (-inf for rows that see nothing) ...
    np.testing.assert_array_equal(np.isneginf(lf[rows_ok]), np.isneginf(t_lse[rows_ok]))
    assert not np.isnan(lf[rows_ok]).any()
    # ... outputs non-finite where a visible v is, finite and right elsewhere (except the
    # columns where only a hidden key's v is non-finite, where either is allowed).
    sel = rows_ok[..., None] & must
    assert (~np.isfinite(o[sel])).all(), "a visible non-finite v vanished"
    check = rows_ok[..., None] & ~must & ~may
    finite_part = np.where(check, o, 0.0)
    assert np.isfinite(finite_part).all(), "non-finite output in a clean row"
    finite = [np.where(np.isfinite(a), a, 0) for a in (q, k, v)]
    out_tol, lse_tol, u = error_bounds(*finite, kw, compute_dtype(q.dtype, k.dtype, v.dtype))
    err = np.abs(finite_part[check] - t_out[check])
    bound = out_tol + (F16_ROUNDOFF * np.abs(t_out[check]) + 1e-7
                       if out.dtype == np.float16 else 0)
    assert (err <= bound).all(), f"clean entries off by {err.max(initial=0):.3g}"


@budget(1)
@given(nonfinite_calls())
def test_nonfinite_inputs(case):
    q, k, v, kw, info = case
    check_nonfinite(q, k, v, kw)


@budget(0.5)
@given(nonfinite_calls())
def test_nonfinite_values_in_v_and_hidden_keys(case):
    # The part of the non-finite contract the kernel meets today: -inf scores hide keys,
    # non-finite v of visible keys shows, garbage beyond kv_lengths never leaks, clean rows
    # are right. (Rows with a NaN/+inf score are test_nonfinite_inputs' business.)
    q, k, v, kw, info = case
    q, k = (np.nan_to_num(a, nan=0.0, posinf=1.0, neginf=-1.0) for a in (q, k))
    if kw.get("mask") is not None and kw["mask"].dtype.kind == "f":
        kw["mask"] = np.where(np.isnan(kw["mask"]) | (kw["mask"] == np.inf), -np.inf,
                              kw["mask"]).astype(kw["mask"].dtype)
    check_nonfinite(q, k, v, kw)


@budget(0.3)
@given(calls(dtypes=(np.float32, np.float64), ranges=("normal",), masks=False))
def test_garbage_beyond_kv_lengths_never_leaks(case):
    q, k, v, kw, info = case
    if q.ndim == 2 or k.shape[-2] == 0:
        return
    lengths = kw.get("kv_lengths", np.array(k.shape[-2] // 2))
    kw["kv_lengths"] = lengths
    clean = fastattn.attention(q, k, v, return_lse=True, **kw)
    batch = np.broadcast_shapes(q.shape[:-3], k.shape[:-3], v.shape[:-3])
    kb = np.broadcast_to(k, batch + k.shape[-3:]).copy()
    vb = np.broadcast_to(v, batch + v.shape[-3:]).copy()
    gone = np.arange(k.shape[-2]) >= np.broadcast_to(lengths, batch)[..., None, None]
    rng = np.random.default_rng(info["seed"])
    for a in (kb, vb):
        junk = rng.choice(np.array([np.nan, np.inf, -np.inf, 1e30]), size=a.shape)
        a[...] = np.where(gone[..., None], junk.astype(a.dtype), a)
    dirty = fastattn.attention(q, kb, vb, return_lse=True, **kw)
    for c, d in zip(clean, dirty):
        assert c.tobytes() == d.tobytes()


# --------------------------------------------------------------------------- invariants

@budget(1)
@given(calls(dtypes=(np.float32, np.float64, np.float16, np.int8)))
def test_weights_are_probabilities(case):
    q, k, v, kw, info = case
    w = fastattn.attention_weights(q, k, **kw)
    t_out, t_lse = truth(q, k, v, **kw)
    assert w.shape == t_lse.shape + (k.shape[-2],)
    assert w.dtype == result_dtype(q.dtype, k.dtype)
    w64 = w.astype(np.float64)
    assert np.isfinite(w64).all() and (w64 >= 0).all() and (w64 <= 1).all()
    cdt = compute_dtype(q.dtype, k.dtype)
    # Each weight is e_j / sum_j e_j: relative error <= (Lk + 4) u; float16 rounds once more.
    tol = (k.shape[-2] + 4) * UNIT_ROUNDOFF[cdt] + (F16_ROUNDOFF if w.dtype == np.float16 else 0)
    visible = np.isfinite(t_lse)
    sums = w64.sum(axis=-1)
    assert np.all(np.abs(sums[visible] - 1) <= tol), "rows with a visible key must sum to 1"
    assert (w64[~visible] == 0).all(), "rows that see nothing must be all 0"
    # Hidden keys weigh 0 and the weighted sum of v is the attention output.
    w3, v3 = (w64, np.asarray(v, np.float64)) if q.ndim > 2 else (w64[None], np.asarray(v, np.float64)[None])
    wv = np.matmul(w3, np.repeat(v3, w3.shape[-3] // v3.shape[-3], axis=-3))
    wv = wv if q.ndim > 2 else wv[0]
    out_tol, _, _ = error_bounds(q, k, v, kw, compute_dtype(q.dtype, k.dtype, v.dtype))
    vmax = float(np.abs(v3).max(initial=0.0))
    assert np.all(np.abs(wv - t_out) <= out_tol + 2 * tol * vmax)


@budget(1)
@given(calls(dtypes=(np.float32, np.float64), ranges=("normal", "sharp")), st.data())
def test_lse_merge_of_disjoint_key_sets(case, data):
    # Split the keys in two disjoint sets with complementary bool masks (on top of the
    # call's own visibility rules); merging the halves with their lse gives the full call.
    q, k, v, kw, info = case
    rng = np.random.default_rng(info["seed"] + 7)
    batch = np.broadcast_shapes(*(a.shape[:-3] for a in (q, k, v))) if q.ndim > 2 else ()
    Hq, Lq, Lk = (q.shape[-3] if q.ndim > 2 else 1), q.shape[-2], k.shape[-2]
    how = data.draw(st.sampled_from(["random", "halves", "per_row"]))
    if how == "random":
        part = rng.random((Lq, Lk)) < 0.5
    elif how == "halves":
        part = np.broadcast_to(np.arange(Lk) < data.draw(st.integers(0, Lk)), (Lq, Lk))
    else:
        part = rng.random((*batch, Hq, Lq, Lk)) < 0.5
        if q.ndim == 2:
            part = part[0]
    base = kw.pop("mask", None)
    if base is not None and base.dtype.kind == "f":
        # A float mask stays as it is (added); the split goes into -inf.
        m1 = np.where(part, base.astype(np.float64), -np.inf)
        m2 = np.where(~part, base.astype(np.float64), -np.inf)
    elif base is not None:
        m1, m2 = part & base, ~part & base
    else:
        m1, m2 = part, ~part
    full = fastattn.attention(q, k, v, return_lse=True, mask=base, **kw)
    o1, l1 = fastattn.attention(q, k, v, return_lse=True, mask=m1, **kw)
    o2, l2 = fastattn.attention(q, k, v, return_lse=True, mask=m2, **kw)
    l1, l2 = l1.astype(np.float64), l2.astype(np.float64)
    lse = np.logaddexp(l1, l2)
    fin = np.isfinite(lse)
    safe = np.where(fin, lse, 0.0)
    w1 = np.where(fin, np.exp(l1 - safe), 0.0)[..., None]
    w2 = np.where(fin, np.exp(l2 - safe), 0.0)[..., None]
    merged = w1 * o1 + w2 * o2
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(full[1]))
    cdt = full[1].dtype
    out_tol, lse_tol, u = error_bounds(q, k, v, dict(kw, mask=base), cdt)
    vmax = float(np.abs(np.asarray(v, np.float64)).max(initial=0.0))
    assert np.all(np.abs(merged - full[0]) <= 3 * out_tol + 2 * vmax * lse_tol)
    assert np.all(np.abs(lse[fin] - full[1][fin]) <= 3 * (lse_tol + u * np.abs(lse[fin])))


# ------------------------------------------------- fixed bugs (regression tests)

def test_nan_in_a_visible_key_makes_the_row_nan():
    q = np.ones((2, 4), np.float32)
    k = np.ones((3, 4), np.float32)
    k[1, 0] = np.nan
    out, lse = fastattn.attention(q, k, np.ones((3, 2), np.float32), return_lse=True)
    assert np.isnan(out).all() and np.isnan(lse).all()


def test_plus_inf_score_makes_the_row_nan():
    q = np.ones((2, 4))
    mask = np.zeros((2, 3))
    mask[0, 2] = np.inf
    out, lse = fastattn.attention(q, q[:1].repeat(3, 0), np.ones((3, 2)), mask=mask,
                                  return_lse=True)
    assert np.isnan(out[0]).all() and np.isnan(lse[0])
    np.testing.assert_allclose(out[1], 1.0)


def test_huge_window_is_unbounded():
    # A window wider than the sequence is no window. Signed overflow in the interval
    # arithmetic made (0, 2**63 - 1) hide every key instead.
    big = 2 ** 63 - 1
    q, k, v = np.ones((3, 2)), np.ones((5, 2)), np.arange(10.0).reshape(5, 2)
    np.testing.assert_array_equal(fastattn.attention(q, k, v, window=(big, big)),
                                  fastattn.attention(q, k, v))
    np.testing.assert_array_equal(fastattn.attention(q, k, v, window=(0, big)),
                                  fastattn.attention(q, k, v, window=(0, -1)))
    # Lq > Lk: the left edge i + Lk - Lq - left is below -2**63 for the first rows.
    q = np.ones((7, 2))
    np.testing.assert_array_equal(fastattn.attention(q, k, v, window=(big, -1)),
                                  fastattn.attention(q, k, v))
