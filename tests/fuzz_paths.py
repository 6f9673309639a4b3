"""A differential fuzzer of fastattn's two doors: the compiled gates against the checked path.

Every public call has a checked path in Python (every argument checked, then the kernel)
and, for the common cases, a compiled one (the lean gate of ``attention``, the compiled
``plan.run`` behind ``attention_with_kvcache`` and the torch operators).  The two must give
the same bits, or refuse with the same error class and leave every cache as it was.  Each
case here draws one random call -- ``attention``, ``attention_varlen``,
``attention_weights``, ``attention_backward``, ``attention_with_kvcache``, a plan and its
runs, or a torch operator -- over every storage kind, paging, appends, rotary and the score
modifiers (in a third of the cases with the int8 products over q8_0 and q4_0 caches
turned on, where the CPU has them), with every array argument drawn as a view (negative, zero and non-unit strides,
Fortran order, transposed layouts, sliced batches, broadcast inputs, read-only arrays), and
now and then a bad value.  It runs the call three times:

1. through the compiled gates, on the views;
2. through the checked path alone (what ``FASTATTN_VALIDATED_ONLY=1`` selects), on the views;
3. through the checked path on C-contiguous copies of the views: the oracle of how a view
   reads, which no gate can share a mistake with.

Run as a script, one case at a time in this process (``tests/test_paths_fuzz.py`` runs it
in a child process so that a crash is reported with its case)::

    python tests/fuzz_paths.py --seed 0 --cases 2000      # a budget of random cases
    python tests/fuzz_paths.py --seed 0 --case 137        # one case again, with its call

Before each case it prints ``case N`` (flushed), so the last such line of a crashed run
names the case that crashed.  It exits 1 after listing every mismatch.
"""
import argparse
import os
import sys
import traceback

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import fastattn                                   # noqa: E402
from fastattn._calls import api as _api  # noqa: E402
from fastattn._serving import kvcache as _kvcache_attn  # noqa: E402
from fastattn._calls.precision import int8_products  # noqa: E402

INT8 = int8_products()[0]          # whether the int8 products run here

try:
    import ml_dtypes
    BF16 = np.dtype(ml_dtypes.bfloat16)
    FP8 = [np.dtype(ml_dtypes.float8_e4m3fn), np.dtype(ml_dtypes.float8_e5m2)]
except ImportError:
    ml_dtypes, BF16, FP8 = None, None, []

FLOATS = [np.dtype(np.float32), np.dtype(np.float16)] + ([BF16] if BF16 is not None else [])
CACHE_KINDS = FLOATS + [np.dtype(np.float64), "q8_0", "q4_0"] + FP8
LAYOUTS = ("c", "f", "step", "reverse", "swap", "broadcast", "readonly", "offset")


class Mismatch(AssertionError):
    pass


# --------------------------------------------------------------------------- views

def view_of(a, layout, rng):
    """An array with ``a``'s values (and dtype) laid out as ``layout`` says: a view into a
    larger or reordered buffer.  "broadcast" gives zero strides on an axis whose values it
    makes equal first (so the call sees other values than ``a``'s; the caller compares
    with a copy of what it passes, not with ``a``)."""
    if a.ndim == 0 or a.size == 0:
        return a
    ax = int(rng.integers(a.ndim))
    if layout == "f":
        return np.asfortranarray(a)
    if layout == "step":
        step = int(rng.integers(2, 4))
        big = np.zeros(a.shape[:ax] + (a.shape[ax] * step,) + a.shape[ax + 1:], a.dtype)
        sl = (slice(None),) * ax + (slice(None, None, step),)
        big[sl] = a
        return big[sl]
    if layout == "reverse":
        sl = (slice(None),) * ax + (slice(None, None, -1),)
        return np.ascontiguousarray(a[sl])[sl]
    if layout == "swap" and a.ndim >= 2:
        other = int(rng.integers(a.ndim))
        return np.swapaxes(np.ascontiguousarray(np.swapaxes(a, ax, other)), ax, other)
    if layout == "broadcast":
        sl = (slice(None),) * ax + (slice(0, 1),)
        return np.broadcast_to(a[sl], a.shape)
    if layout == "readonly":
        r = a.copy()
        r.flags.writeable = False
        return r
    if layout == "offset":          # a sliced batch: the data starts inside a buffer
        big = np.zeros((a.shape[0] + 2,) + a.shape[1:], a.dtype)
        big[1:-1] = a
        return big[1:-1]
    return a.copy()


def any_view(a, rng, writable=False):
    layouts = [l for l in LAYOUTS if not (writable and l in ("broadcast", "readonly"))]
    return view_of(a, layouts[int(rng.integers(len(layouts)))], rng)


def contiguous(x):
    if isinstance(x, np.ndarray):
        return np.ascontiguousarray(x)
    return x


# --------------------------------------------------------------------------- comparisons

def same_bits(a, b, what):
    if isinstance(a, tuple) or isinstance(b, tuple):
        if not (isinstance(a, tuple) and isinstance(b, tuple) and len(a) == len(b)):
            raise Mismatch(f"{what}: {type(a).__name__} against {type(b).__name__}")
        for i, (x, y) in enumerate(zip(a, b)):
            same_bits(x, y, f"{what}[{i}]")
        return
    if a is None or b is None:
        if a is not b:
            raise Mismatch(f"{what}: {a!r} against {b!r}")
        return
    a, b = np.asarray(a), np.asarray(b)
    if a.dtype != b.dtype or a.shape != b.shape:
        raise Mismatch(f"{what}: {a.dtype}{a.shape} against {b.dtype}{b.shape}")
    if np.ascontiguousarray(a).tobytes() != np.ascontiguousarray(b).tobytes():
        bad = np.argwhere(np.ascontiguousarray(a).view(np.uint8).reshape(a.shape + (-1,))
                          != np.ascontiguousarray(b).view(np.uint8).reshape(b.shape + (-1,)))
        raise Mismatch(f"{what}: bits differ at {len(bad)} bytes, first at "
                       f"{tuple(int(i) for i in bad[0])}")


def outcome(fn):
    """``("ok", result)`` or ``("error", the exception)``."""
    try:
        return "ok", fn()
    except (ValueError, TypeError) as e:
        return "error", e


def same_outcome(a, b, what):
    if a[0] != b[0]:
        raise Mismatch(f"{what}: {a[0]} ({a[1]!r:.300}) against {b[0]} ({b[1]!r:.300})")
    if a[0] == "error":
        if type(a[1]) is not type(b[1]):
            raise Mismatch(f"{what}: {type(a[1]).__name__} ({a[1]}) against "
                           f"{type(b[1]).__name__} ({b[1]})")
    else:
        same_bits(a[1], b[1], what)


class Paths:
    """Switches between the compiled gates and the checked path alone."""

    def __init__(self, compiled):
        self.compiled = compiled

    def __enter__(self):
        self.saved = _api._LEAN_PATH, _kvcache_attn._COMPILED_RUN
        _api._LEAN_PATH = _kvcache_attn._COMPILED_RUN = self.compiled

    def __exit__(self, *exc):
        _api._LEAN_PATH, _kvcache_attn._COMPILED_RUN = self.saved


# --------------------------------------------------------------------------- draws

def normal(rng, shape, dtype, scale=1.0):
    x = rng.standard_normal(shape) * scale
    return x.astype(dtype)


def draw_float(rng, allow64=True):
    kinds = FLOATS + ([np.dtype(np.float64)] if allow64 else [])
    return kinds[int(rng.integers(len(kinds)))]


def draw_modifiers(rng, Hq, B, Lq, Lk, lean=False):
    kw = {}
    if rng.random() < 0.5:
        kw["causal"] = bool(rng.integers(2))
    if rng.random() < 0.3:
        kw["scale"] = float(rng.uniform(0.05, 0.5))
    if lean:
        return kw
    if rng.random() < 0.25:
        kw["window"] = (int(rng.integers(-1, 6)), int(rng.integers(-1, 3)))
    if rng.random() < 0.2:
        kw["softcap"] = float(rng.uniform(1, 20))
    if rng.random() < 0.2:
        kw["alibi_slopes"] = rng.uniform(0, 1, Hq)
    if rng.random() < 0.2:
        kw["sinks"] = rng.standard_normal(Hq)
    return kw


def bad_value(rng, kw, names):
    """One argument of ``kw`` replaced by a bad value (a wrong shape, dtype or value)."""
    name = names[int(rng.integers(len(names)))]
    a = kw[name]
    if isinstance(a, np.ndarray) and a.ndim:
        how = int(rng.integers(4))
        if how == 0:
            kw[name] = a[..., :-1] if a.shape[-1] > 1 else np.concatenate([a, a], axis=-1)
        elif how == 1 and a.dtype.kind == "f" and a.size:
            bad = np.array(a)
            bad.flat[int(rng.integers(bad.size))] = [np.nan, np.inf, -np.inf][int(rng.integers(3))]
            kw[name] = bad
        elif how == 2:
            kw[name] = a.astype(np.int16)
        else:
            kw[name] = a[:, None] if a.ndim < 5 else a[0]
    else:
        kw[name] = [np.nan, -1, "x", 2 ** 70][int(rng.integers(4))]
    return name


# --------------------------------------------------------------------------- calls

def case_attention(rng, bad):
    B, Hkv, g = int(rng.integers(1, 3)), int(rng.integers(1, 3)), int(rng.integers(1, 3))
    Hq, Lq, Lk = Hkv * g, int(rng.integers(1, 7)), int(rng.integers(1, 40))
    D, Dv = [8, 16, 32, 64][int(rng.integers(4))], [8, 16, 32][int(rng.integers(3))]
    f64 = rng.random() < 0.2
    dts = [np.dtype(np.float64)] * 3 if f64 else [draw_float(rng, False) for _ in range(3)]
    lean = rng.random() < 0.6
    kw = dict(q=normal(rng, (B, Hq, Lq, D), dts[0]), k=normal(rng, (B, Hkv, Lk, D), dts[1]),
              v=normal(rng, (B, Hkv, Lk, Dv), dts[2]))
    if lean and rng.random() < 0.3:
        kw["sinks"] = rng.standard_normal(Hq)
    kw.update(draw_modifiers(rng, Hq, B, Lq, Lk, lean))
    if not lean and rng.random() < 0.3:
        kw["kv_lengths"] = rng.integers(0, Lk + 1, B)
    if not lean and rng.random() < 0.2:
        kw["mask"] = rng.random((Lq, Lk)) < 0.8
    kw["return_lse"] = bool(rng.integers(2))
    for n in ("q", "k", "v"):
        kw[n] = any_view(kw[n], rng)
    if rng.random() < 0.2:
        res_dt = np.result_type(*dts)
        kw["out"] = any_view(np.zeros((B, Hq, Lq, Dv), res_dt), rng, writable=True)
    elif rng.random() < 0.1 and D == Dv:
        kw["out"] = kw["q"]                      # in place: out overlaps an input
    if bad:
        bad_value(rng, kw, [n for n in kw if n not in ("return_lse", "out")])
    return "attention", lambda a: fastattn.attention(**a), kw, ()


def case_weights(rng, bad):
    name, _, kw, _ = case_attention(rng, bad)
    for n in ("v", "out", "return_lse", "sinks"):
        kw.pop(n, None)
    return "attention_weights", lambda a: fastattn.attention_weights(**a), kw, ()


def case_varlen(rng, bad):
    n = int(rng.integers(1, 4))
    lq, lk = rng.integers(0, 6, n), rng.integers(1, 12, n)
    Hkv, g, D = int(rng.integers(1, 3)), int(rng.integers(1, 3)), [8, 16, 32][int(rng.integers(3))]
    dt = draw_float(rng)
    kw = dict(q=normal(rng, (Hkv * g, int(lq.sum()), D), dt),
              k=normal(rng, (Hkv, int(lk.sum()), D), dt), v=normal(rng, (Hkv, int(lk.sum()), D), dt),
              cu_seqlens_q=np.concatenate([[0], np.cumsum(lq)]).astype(np.int32),
              cu_seqlens_k=np.concatenate([[0], np.cumsum(lk)]).astype(np.int32))
    kw.update(draw_modifiers(rng, Hkv * g, n, 1, 1))
    kw["return_lse"] = bool(rng.integers(2))
    for a in ("q", "k", "v"):
        kw[a] = any_view(kw[a], rng)
    if bad:
        bad_value(rng, kw, list(kw))
    return "attention_varlen", lambda a: fastattn.attention_varlen(**a), kw, ()


def case_backward(rng, bad):
    B, Hkv, g = int(rng.integers(1, 3)), int(rng.integers(1, 3)), int(rng.integers(1, 3))
    Hq, Lq, Lk, D = Hkv * g, int(rng.integers(1, 6)), int(rng.integers(1, 20)), 16
    dt = draw_float(rng)
    q, k, v = (normal(rng, (B, h, L, D), dt) for h, L in ((Hq, Lq), (Hkv, Lk), (Hkv, Lk)))
    mods = draw_modifiers(rng, Hq, B, Lq, Lk)
    out, lse = fastattn.attention(q, k, v, return_lse=True, **mods)
    kw = dict(dout=normal(rng, out.shape, out.dtype), q=q, k=k, v=v, out=out, lse=lse, **mods)
    for a in ("dout", "q", "k", "v", "out", "lse"):
        kw[a] = any_view(kw[a], rng)
    if bad:
        bad_value(rng, kw, list(kw))
    return "attention_backward", lambda a: fastattn.attention_backward(**a), kw, ()


def make_caches(rng, kind, B, Hkv, Lmax, D, Dv, page):
    """k_cache, v_cache (and their scales) holding normal values, as a batch or a shuffled
    pool of pages with its block table."""
    if page is None:
        lead, table = (B, Hkv, Lmax), None
    else:
        per_seq = -(-Lmax // page)
        order = rng.permutation(B * per_seq + 1).astype(np.int32)
        table = order[:B * per_seq].reshape(B, per_seq)
        lead = (B * per_seq + 1, Hkv, page)
    k, v = normal(rng, lead + (D,), np.float32), normal(rng, lead + (Dv,), np.float32)
    if kind in ("q8_0", "q4_0"):
        quantize = fastattn.quantize_q8_0 if kind == "q8_0" else fastattn.quantize_q4_0
        (kq, ks), (vq, vs) = quantize(k), quantize(v)
        return dict(k_cache=kq, v_cache=vq, k_scale=ks, v_scale=vs), table
    if kind in FP8:
        ks = np.float32(0.05) if rng.random() < 0.5 else rng.uniform(0.01, 0.2, Hkv).astype(np.float32)
        vs = rng.uniform(0.01, 0.2, Hkv).astype(np.float32)
        return dict(k_cache=fastattn.quantize_fp8(k, ks, kind), k_scale=ks,
                    v_cache=fastattn.quantize_fp8(v, vs, kind), v_scale=vs), table
    return dict(k_cache=k.astype(kind), v_cache=v.astype(kind)), table


def cache_view(c, rng):
    """A cache as a writable view: as it is, or the (pages, page, Hkv, D) layout swapped
    back, or every other row of a larger buffer along the pages or heads axis."""
    how = int(rng.integers(4))
    if how == 1:
        return np.swapaxes(np.ascontiguousarray(np.swapaxes(c, 1, 2)), 1, 2)
    if how == 2:
        big = np.zeros((c.shape[0] * 2,) + c.shape[1:], c.dtype)
        big[::2] = c
        return big[::2]
    return c


def draw_serving(rng, bad):
    kind = CACHE_KINDS[int(rng.integers(len(CACHE_KINDS)))]
    B, Hkv, g = int(rng.integers(1, 4)), int(rng.integers(1, 3)), int(rng.integers(1, 3))
    Hq = Hkv * g
    quant = kind in ("q8_0", "q4_0") or kind in FP8
    D = [32, 64][int(rng.integers(2))] if quant else [8, 16, 32][int(rng.integers(3))]
    Dv = [32, 64][int(rng.integers(2))] if quant else [8, 16, 32][int(rng.integers(3))]
    page = [None, 4, 8, 16][int(rng.integers(4))]
    Lmax = int(rng.integers(8, 40))
    Lnew = [0, 0, 1, 1, 2, 4][int(rng.integers(6))]
    seqlens = rng.integers(0, Lmax - Lnew + 1, B)
    caches, table = make_caches(rng, kind, B, Hkv, Lmax, D if kind != "q4_0" else D,
                                Dv, page)
    if kind == "q4_0":
        assert caches["k_cache"].shape[-1] * 2 == D
    for n in ("k_cache", "v_cache"):
        caches[n] = cache_view(caches[n], rng)
    Lq = Lnew if Lnew and rng.random() < 0.7 else int(rng.integers(1, 4))
    new_dt = FLOATS[int(rng.integers(len(FLOATS)))] if rng.random() < 0.8 else np.dtype(np.float64)
    q_dt = new_dt if rng.random() < 0.6 else draw_float(rng)
    shared = dict(cache_seqlens=seqlens if rng.random() < 0.8 else int(seqlens[0]),
                  block_table=table)
    if int(np.size(shared["cache_seqlens"])) == 1:
        seqlens = np.full(B, int(seqlens[0]))
        shared["cache_seqlens"] = int(seqlens[0])
    if Lnew and rng.random() < 0.3:
        half = int(rng.integers(1, D // 2 + 1))
        ang = np.outer(np.arange(Lmax + 8), 1.0 / 10000 ** (np.arange(half) / half))
        shared.update(rotary_cos=np.cos(ang), rotary_sin=np.sin(ang),
                      rotary_interleaved=bool(rng.integers(2)))
    mods = draw_modifiers(rng, Hq, B, Lq, Lmax)
    mods.pop("sinks", None)
    shared.update(mods)
    if shared.get("causal") is False:
        shared.pop("causal")
    layer = dict(q=any_view(normal(rng, (B, Hq, Lq, D), q_dt), rng))
    if Lnew:
        layer["k"] = any_view(normal(rng, (B, Hkv, Lnew, D), new_dt), rng)
        layer["v"] = any_view(normal(rng, (B, Hkv, Lnew, Dv), new_dt), rng)
    layer.update(caches)
    if rng.random() < 0.2:
        layer["sinks"] = rng.standard_normal(Hq)
    layer["return_lse"] = bool(rng.integers(2))
    if rng.random() < 0.1 and D == Dv:
        layer["out"] = layer["q"]                # in place: out overlaps q
    if bad:
        if rng.random() < 0.5:
            bad_value(rng, layer, [n for n in layer if n not in ("return_lse",)])
        else:
            bad_shared(rng, shared, layer, Lmax)
    return shared, layer


def bad_shared(rng, shared, layer, Lmax):
    how = int(rng.integers(5))
    if how == 4 and shared.get("block_table") is not None and len(shared["block_table"]) > 1:
        # two sequences of one length on one row of pages: their new rows share cache rows
        t = shared["block_table"].copy()
        t[1] = t[0]
        shared["block_table"] = t
        n = np.asarray(shared["cache_seqlens"])
        shared["cache_seqlens"] = int(n.flat[0]) if n.ndim else int(n)
    elif how == 0:
        shared["cache_seqlens"] = np.asarray(shared["cache_seqlens"]) + Lmax
    elif how == 1 and shared.get("block_table") is not None:
        t = shared["block_table"].copy()
        t.flat[int(rng.integers(t.size))] = [-1, 10 ** 6][int(rng.integers(2))]
        shared["block_table"] = t
    elif how == 2 and "k" in layer:
        big = np.array(layer["k"], dtype=np.float32)
        big.flat[int(rng.integers(big.size))] = [np.float32(3.4e38), np.inf, np.nan][int(rng.integers(3))]
        layer["k"] = big
    else:
        layer["q"] = layer["q"][:, :, :, :-1]


def case_kvcache(rng, bad):
    shared, layer = draw_serving(rng, bad)
    kw = dict(shared, **layer)
    return "attention_with_kvcache", lambda a: fastattn.attention_with_kvcache(**a), kw, \
        ("k_cache", "v_cache", "k_scale", "v_scale")


def case_plan(rng, bad):
    shared, layer = draw_serving(rng, bad)

    def run(a):
        a = dict(a)
        plan = fastattn.plan_kvcache(**{n: a.pop(n) for n in list(a) if n in shared})
        first = plan.run(**a)
        # A second layer through the same plan: what the first run memoised is reused.
        second = plan.run(**a)
        return first, second
    return "plan_kvcache/run", run, dict(shared, **layer), ("k_cache", "v_cache", "k_scale", "v_scale")


def case_torch(rng, bad):
    import torch
    from fastattn.integrations import torch as fa_torch
    use_cache = rng.random() < 0.5
    if not use_cache:
        name, _, kw, _ = case_attention(rng, bad)
        kw.pop("out", None)
        kw.pop("return_lse", None)
        for n in list(kw):
            if isinstance(kw[n], np.ndarray) and kw[n].dtype != BF16:
                kw[n] = torch_view(kw[n], rng)
        if any(isinstance(x, np.ndarray) for x in kw.values()):
            return case_attention(rng, bad)
        return "torch attention", lambda a: as_numpy(fa_torch.attention(**a)), kw, ()
    shared, layer = draw_serving(rng, bad)
    kw = dict(shared, **layer)
    if any(isinstance(x, np.ndarray) and (x.dtype == BF16 or x.dtype in FP8) for x in kw.values()):
        return case_kvcache(rng, bad)
    for n in list(kw):
        if isinstance(kw[n], np.ndarray):
            kw[n] = torch_view(kw[n], rng) if n not in ("k_cache", "v_cache", "k_scale",
                                                           "v_scale") else torch.from_numpy(kw[n])
    return "torch attention_with_kvcache", \
        lambda a: as_numpy(fa_torch.attention_with_kvcache(**a)), kw, \
        ("k_cache", "v_cache", "k_scale", "v_scale")


def torch_view(a, rng):
    """``a`` as a torch tensor view: transposed, strided, expanded or as it is (torch has
    no negative strides)."""
    import torch
    t = torch.from_numpy(np.ascontiguousarray(a))
    how = int(rng.integers(4))
    if how == 1 and t.dim() >= 2:
        return t.transpose(-1, -2).contiguous().transpose(-1, -2)
    if how == 2 and t.dim() >= 1:
        big = torch.zeros(t.shape[:-1] + (t.shape[-1] * 2,), dtype=t.dtype)
        big[..., ::2] = t
        return big[..., ::2]
    if how == 3 and t.dim() >= 1 and t.shape[0] > 1:
        return t[:1].expand(t.shape)
    return t


def as_numpy(res):
    if isinstance(res, tuple):
        return tuple(as_numpy(r) for r in res)
    return res.numpy() if hasattr(res, "numpy") else res


CASES = [case_attention, case_attention, case_weights, case_varlen, case_backward,
         case_kvcache, case_kvcache, case_plan, case_plan]


def draw(seed, i, with_torch):
    rng = np.random.default_rng([seed, i])
    makers = CASES + ([case_torch, case_torch] if with_torch else [])
    maker = makers[int(rng.integers(len(makers)))]
    return maker(rng, bad=rng.random() < 0.25)


# --------------------------------------------------------------------------- one case

def fresh(kw, contig=False):
    """A copy of a call's arguments (caches and out included, so that each run writes its
    own), keeping each array's layout unless ``contig``."""
    memo = {}                                   # an array passed twice stays one array

    def copy(x):
        if id(x) in memo:
            return memo[id(x)]
        memo[id(x)] = y = _copy(x)
        return y

    def _copy(x):
        if isinstance(x, dict):
            return {n: copy(y) for n, y in x.items()}
        if isinstance(x, np.ndarray):
            if contig:
                return np.array(x, order="C", copy=True)
            if 0 in x.strides or not x.flags.writeable:
                return x                        # never written: shared as it is
            return _same_layout(x)
        if hasattr(x, "clone"):                 # a torch tensor
            return x.contiguous().clone() if contig else _torch_same_layout(x)
        return x
    return {n: copy(x) for n, x in kw.items()}


def _same_layout(x):
    """A new array equal to ``x`` with ``x``'s strides (a copy of the buffer behind it)."""
    lo, hi = np.lib.array_utils.byte_bounds(x) if hasattr(np.lib, "array_utils") else np.byte_bounds(x)
    buf = np.empty(hi - lo, np.uint8)
    ptr = x.__array_interface__["data"][0]
    y = np.ndarray(x.shape, x.dtype, buffer=buf, offset=ptr - lo, strides=x.strides)
    y[...] = x
    return y


def _torch_same_layout(t):
    import torch
    y = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype)
    if t.stride() and 0 in t.stride():
        return t
    y.copy_(t)
    return y


def caches_of(kw, names):
    out = {}
    for n in names:
        x = kw.get(n) if n in kw else kw.get("rest", {}).get(n)
        if x is not None and not isinstance(x, (float, int)):
            out[n] = np.ascontiguousarray(x.numpy() if hasattr(x, "numpy") else x).copy()
    return out


def run_case(seed, i, with_torch, verbose=False):
    name, call, kw, written = draw(seed, i, with_torch)
    # drawn apart from the call, so that a case's call is the same whether or not the
    # CPU has int8 products
    int8 = np.random.default_rng([seed, i, 1]).random() < 1 / 3
    old = fastattn.set_int8_dot_products(int8) if INT8 else False
    try:
        return _run_case(name, call, kw, written, verbose)
    finally:
        if INT8:
            fastattn.set_int8_dot_products(old)


def _run_case(name, call, kw, written, verbose):
    if verbose:
        print(f"  int8 products: {fastattn.get_int8_dot_products()}")
        for n, x in kw.items():
            desc = f"{x.dtype}{tuple(x.shape)} strides {getattr(x, 'strides', None) or x.stride()}" \
                if hasattr(x, "shape") and hasattr(x, "dtype") else repr(x)[:120]
            print(f"  {n} = {desc}")
    results = {}
    for label, compiled, contig in (("compiled", True, False), ("checked", False, False),
                                    ("contiguous", False, True)):
        args = fresh(kw, contig)
        before = caches_of(args, written)
        with Paths(compiled):
            res = outcome(lambda: call(args))
        after = caches_of(args, written)
        if res[0] == "error":
            for n in before:
                if before[n].tobytes() != after[n].tobytes():
                    raise Mismatch(f"{name}, {label} path: {n} changed by a refused call "
                                   f"({type(res[1]).__name__}: {res[1]})")
        results[label] = res, after
    (c, c_caches), (p, p_caches), (o, o_caches) = (results[l] for l in ("compiled", "checked",
                                                                        "contiguous"))
    same_outcome(c, p, f"{name}: compiled against checked")
    if p[0] == "ok":
        # A broadcast input or read-only array may refuse an `out`, not a result: views
        # read as their copies do.
        same_outcome(p, o, f"{name}: a view against its contiguous copy")
    for n in c_caches:
        if c_caches[n].tobytes() != p_caches[n].tobytes():
            raise Mismatch(f"{name}: {n} written differently by the compiled and checked paths")
    return name, c[0]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cases", type=int, default=2000)
    ap.add_argument("--case", type=int, default=None, help="run this one case, verbosely")
    ap.add_argument("--no-torch", action="store_true", help="leave the torch operators out")
    a = ap.parse_args(argv)
    with_torch = False
    if not a.no_torch:
        try:
            import torch  # noqa: F401
            import fastattn.integrations.torch  # noqa: F401
            with_torch = True
        except ImportError:
            pass
    cases = [a.case] if a.case is not None else range(a.cases)
    failures, counts = [], {}
    np.seterr(all="ignore")
    for i in cases:
        print(f"case {i}", flush=True)
        try:
            name, how = run_case(a.seed, i, with_torch, verbose=a.case is not None)
            counts[name, how] = counts.get((name, how), 0) + 1
        except Mismatch as e:
            failures.append(f"seed {a.seed} case {i}: {e}")
        except Exception:
            failures.append(f"seed {a.seed} case {i}: {traceback.format_exc(limit=4)}")
    for (name, how), n in sorted(counts.items()):
        print(f"{name:32s} {how:6s} {n}")
    print(f"{len(cases)} cases, {len(failures)} mismatches (torch operators "
          f"{'included' if with_torch else 'left out'})")
    for f in failures:
        print("MISMATCH", f)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
