"""Fingerprint the kernel's output bits over many configurations, to compare two builds.

A kernel change that must keep the bits (a refactor, a scheduling change) is checked by
recording the fingerprints with the old build and comparing them with the new one::

    FASTATTN_ISA=avx2 PYTHONPATH=. python tools/bitcheck.py save /tmp/old-avx2.json    # old build
    FASTATTN_ISA=avx2 PYTHONPATH=. python tools/bitcheck.py check /tmp/old-avx2.json   # new build

Each configuration hashes the bytes of ``out`` and ``lse`` for 1 and 2 threads (which must
agree with each other too).  The configurations cover prefill and decode tiles, GQA groups,
both causal alignments, windows, bool and float masks, kv_lengths, Dv != D, head dims that
are not a multiple of the vector width, flash-decoding key chunks and both dtypes.
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


def fingerprints():
    fp = {}
    for shape, var, dtype in _configs():
        key = f"{shape} {sorted(var.items())} {dtype.__name__}"
        one, two = _run(shape, var, dtype, 1), _run(shape, var, dtype, 2)
        if one != two:
            raise SystemExit(f"threads change the bits: {key}")
        fp[key] = one
    return fp


def main(argv):
    if len(argv) != 3 or argv[1] not in ("save", "check"):
        raise SystemExit(__doc__)
    fp = fingerprints()
    print(f"{len(fp)} configurations, kernel variant {fastattn._dispatch.ISA}")
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
