"""Fingerprint the kernel's output bits over many configurations, to compare two builds.

A kernel change that must keep the bits (a refactor, a scheduling change) is checked by
recording the fingerprints with the old build and comparing them with the new one::

    FASTATTN_ISA=avx2 PYTHONPATH=. python tools/bitcheck.py save /tmp/old-avx2.json    # old build
    FASTATTN_ISA=avx2 PYTHONPATH=. python tools/bitcheck.py check /tmp/old-avx2.json   # new build

Each configuration hashes the bytes of ``out`` and ``lse`` for 1 and 2 threads (which must
agree with each other too).  The configurations cover prefill and decode tiles, GQA groups,
both causal alignments, windows, bool and float masks, kv_lengths, Dv != D, head dims that
are not a multiple of the vector width, flash-decoding key chunks and both dtypes.
Then every storage type of K and V: float16 and bfloat16 inputs (prefill and decode
tiles), and KV caches of float32, float16, bfloat16, q8_0, q4_0 and fp8 (e4m3fn and e5m2, a
scale per kv head), contiguous and paged, in decode steps (1, 4 and 8 rows per kv head) and
short prefills.  Last, softcap, ALiBi and
sinks, alone and together, in the forward, on packed sequences and in the backward (dq, dk,
dv and dsinks).

Two compilers' builds of the same commit are compared the same way (setup.py with
``CC=clang`` in another clone, say): they must give the same bits.
"""
import hashlib
import itertools
import json
import sys
import zlib

import numpy as np

import fastattn


def _configs():
    shapes = [  # (Hq, Hkv, Lq, Lk, D, Dv)
        (2, 2, 37, 53, 16, 16),
        (4, 2, 96, 130, 64, 64),
        (3, 1, 5, 300, 24, 40),
        (8, 2, 1, 2100, 128, 128),      # GQA decode over flash-decoding chunks
        (4, 4, 1, 1500, 64, 64),        # decode, one row per item
        (2, 1, 200, 200, 7, 9),         # D, Dv not multiples of the vector width
        (6, 6, 2, 77, 32, 48),
        (16, 4, 3, 257, 128, 64),
    ]
    variants = [
        dict(),
        dict(causal=True),
        dict(causal="top-left"),
        dict(window=(17, 3)),
        dict(causal=True, window=(40, -1)),
        dict(mask="bool"),
        dict(mask="float"),
        dict(kv_lengths=True, causal=True),
    ]
    for (shape, var), dtype in itertools.product(itertools.product(shapes, variants),
                                                 (np.float32, np.float64)):
        yield shape, var, dtype


def _run(shape, var, dtype, threads):
    Hq, Hkv, Lq, Lk, D, Dv = shape
    rng = np.random.default_rng(zlib.crc32(repr((shape, dtype.__name__)).encode()))
    q = rng.standard_normal((2, Hq, Lq, D)).astype(dtype)
    k = rng.standard_normal((2, Hkv, Lk, D)).astype(dtype)
    v = rng.standard_normal((2, Hkv, Lk, Dv)).astype(dtype)
    kw = dict(var)
    if kw.get("mask") == "bool":
        kw["mask"] = rng.random((Hq, Lq, Lk)) < 0.8
    elif kw.get("mask") == "float":
        kw["mask"] = rng.standard_normal((1, Lq, Lk)).astype(dtype)
    if kw.get("kv_lengths"):
        kw["kv_lengths"] = np.array([Lk, max(1, Lk // 3)])
    with fastattn.num_threads(threads):
        out, lse = fastattn.attention(q, k, v, return_lse=True, **kw)
    h = hashlib.sha256(np.ascontiguousarray(out).tobytes())
    h.update(np.ascontiguousarray(lse).tobytes())
    return h.hexdigest()[:20]


def _storage_configs():
    import ml_dtypes
    shapes = [  # (Hq, Hkv, Lq, Lk, D, Dv)
        (4, 4, 1, 700, 64, 64),
        (8, 2, 1, 1300, 128, 128),
        (16, 2, 1, 300, 128, 128),
        (6, 2, 7, 200, 32, 64),
        (4, 2, 100, 150, 64, 64),
    ]
    variants = [dict(), dict(causal=True, window=(90, -1)), dict(softcap=5.0)]
    for dtype in (np.float16, ml_dtypes.bfloat16):
        for shape, var in itertools.product(shapes, variants):
            yield "input", shape, var, dtype
    for dtype in (np.float32, np.float16, ml_dtypes.bfloat16, "q8_0", "q4_0", "float8_e4m3fn",
                  "float8_e5m2"):
        for shape, var in itertools.product(shapes, variants[:2]):
            for paged in (False, True):
                yield ("paged" if paged else "cache"), shape, var, dtype


def _run_storage(kind, shape, var, dtype, threads):
    Hq, Hkv, Lq, Lk, D, Dv = shape
    name = dtype if isinstance(dtype, str) else np.dtype(dtype).name
    rng = np.random.default_rng(zlib.crc32(repr((kind == "input", shape, name)).encode()))
    f = lambda *s: rng.standard_normal(s).astype(np.float32)
    q, k, v = f(2, Hq, Lq, D), f(2, Hkv, Lk, D), f(2, Hkv, Lk, Dv)
    with fastattn.num_threads(threads):
        if kind == "input":
            out, lse = fastattn.attention(q.astype(dtype), k.astype(dtype), v.astype(dtype),
                                          return_lse=True, **var)
        else:
            out, lse = _run_cache(kind == "paged", q, k, v, dtype, var, rng)
    h = hashlib.sha256(np.ascontiguousarray(out).tobytes())
    h.update(np.ascontiguousarray(lse).tobytes())
    return h.hexdigest()[:20]


def _run_cache(paged, q, k, v, dtype, var, rng):
    """attention_with_kvcache over a cache holding k, v (2 sequences of Lk and Lk // 3 keys)."""
    B, Hkv, Lk, _ = k.shape
    scales = {}
    if dtype in ("q8_0", "q4_0"):
        quantize = getattr(fastattn, f"quantize_{dtype}")
        k, ks = quantize(k)
        v, vs = quantize(v)
        scales = dict(k_scale=ks, v_scale=vs)
    elif dtype in ("float8_e4m3fn", "float8_e5m2"):      # a scale per kv head, vLLM's
        top = 448.0 if dtype == "float8_e4m3fn" else 57344.0
        ks, vs = ((np.abs(a).max(axis=(0, 2, 3)) / top).astype(np.float32) for a in (k, v))
        k, v = fastattn.quantize_fp8(k, ks, dtype), fastattn.quantize_fp8(v, vs, dtype)
        scales = dict(k_scale=ks, v_scale=vs)
    else:
        k, v = k.astype(dtype), v.astype(dtype)
    kw = dict(cache_seqlens=[Lk, Lk // 3], return_lse=True, **var)
    if not paged:
        return fastattn.attention_with_kvcache(q, k, v, **kw, **scales)
    page = 16
    npg = (Lk + page - 1) // page
    order = rng.permutation(B * npg)
    table = order.reshape(B, npg)

    def pool(a):
        pad = np.zeros(a.shape[:2] + (npg * page,) + a.shape[3:], a.dtype)
        pad[:, :, :Lk] = a
        pages = pad.reshape(B, a.shape[1], npg, page, *a.shape[3:]).swapaxes(1, 2)
        out = np.empty((B * npg,) + pages.shape[2:], a.dtype)
        out[table.reshape(-1)] = pages.reshape((B * npg,) + pages.shape[2:])
        return out
    scales = {name: pool(s) if s.ndim == 4 else s for name, s in scales.items()}
    return fastattn.attention_with_kvcache(q, pool(k), pool(v), block_table=table, **kw,
                                           **scales)


def _modifier_configs():
    shapes = [(4, 2, 1, 147, 32, 32), (4, 2, 113, 211, 64, 64), (2, 1, 37, 300, 24, 40)]
    variants = [dict(softcap=20.0), dict(alibi=True, causal=True, window=(60, 0)),
                dict(sinks=True), dict(softcap=5.0, alibi=True, sinks=True, causal=True)]
    for shape, var in itertools.product(shapes, variants):
        for kind in ("forward", "varlen", "backward"):
            yield kind, shape, var


def _run_modifier(kind, shape, var, threads):
    Hq, Hkv, Lq, Lk, D, Dv = shape
    rng = np.random.default_rng(zlib.crc32(repr(shape).encode()))
    f = lambda *s: rng.standard_normal(s).astype(np.float32)
    q, k, v = f(Hq, 2 * Lq, D), f(Hkv, 2 * Lk, D), f(Hkv, 2 * Lk, Dv)
    kw = dict(var)
    if kw.pop("alibi", False):
        kw["alibi_slopes"] = 2.0 ** -np.arange(1, Hq + 1)
    if kw.pop("sinks", False):
        kw["sinks"] = rng.standard_normal(Hq)
    with fastattn.num_threads(threads):
        if kind == "varlen":      # two sequences of different lengths, packed
            nq, nk = Lq + max(1, Lq // 2), Lk + Lk // 3
            outs = fastattn.attention_varlen(q[:, :nq], k[:, :nk], v[:, :nk], [0, Lq, nq],
                                             [0, Lk, nk], return_lse=True, **kw)
        else:
            q, k, v = q[:, :Lq], k[:, :Lk], v[:, :Lk]
            out, lse = fastattn.attention(q, k, v, return_lse=True, **kw)
            outs = (out, lse)
            if kind == "backward":
                dout = np.random.default_rng(1).standard_normal(out.shape).astype(np.float32)
                outs = fastattn.attention_backward(dout, q, k, v, out, lse, **kw)
    h = hashlib.sha256()
    for a in outs:
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()[:20]


def fingerprints():
    fp = {}
    runs = [(f"{shape} {sorted(var.items())} {dtype.__name__}", _run, (shape, var, dtype))
            for shape, var, dtype in _configs()]
    runs += [(f"{kind} {shape} {sorted(var.items())} "
              f"{dtype if isinstance(dtype, str) else np.dtype(dtype).name}", _run_storage,
              (kind, shape, var, dtype)) for kind, shape, var, dtype in _storage_configs()]
    runs += [(f"{kind} {shape} {sorted(var.items())}", _run_modifier, (kind, shape, var))
             for kind, shape, var in _modifier_configs()]
    for key, run, args in runs:
        one, two = run(*args, 1), run(*args, 2)
        if one != two:
            raise SystemExit(f"threads change the bits: {key}")
        fp[key] = one
    return fp


def main(argv):
    if len(argv) != 3 or argv[1] not in ("save", "check"):
        raise SystemExit(__doc__)
    fp = fingerprints()
    print(f"{len(fp)} configurations, kernel variant {fastattn._machine.isa.ISA}")
    if argv[1] == "save":
        with open(argv[2], "w") as f:
            json.dump(fp, f, indent=0)
        return 0
    with open(argv[2]) as f:
        old = json.load(f)
    bad = [key for key in old if fp.get(key) != old[key]]
    for key in bad:
        print("different bits:", key)
    print(f"{len(old) - len(bad)} of {len(old)} configurations bit-identical")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
