"""The per-ISA builds of the kernel (its variants, chosen by fastattn._machine.isa): every one
that this CPU can run gives the right results.

setup.py compiles the kernel once per instruction set (base, avx2, avx512 on x86; base
elsewhere) and fastattn/_machine/isa.py imports the best one the CPU runs, so the rest of the
suite exercises only that one.  Here each variant the CPU supports is forced with
FASTATTN_ISA in a fresh interpreter, which runs this file as a script: a compact set of
checks against fastattn.reference (prefill, causal, window, masks, GQA, decode, float64,
float16, lse, attention_weights) and the bitwise reproducibility rule.  Each check is
reported as its own test, one interpreter per variant.

A variant the CPU cannot run is skipped, and the skip says why (so a run on a machine
without AVX-512 shows that the avx512 build went untested).  A variant the CPU can run that
is missing from a build meant to include it is a failure.  Which variants a build is meant
to include follows setup.py: all three on x86, base elsewhere, or the FASTATTN_ISAS list
when that is set (set it for pytest too when you built a subset on purpose).
"""
import importlib
import importlib.util
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import traceback

import numpy as np
import pytest

import fastattn
from fastattn import _kernel_base
from fastattn._machine import isa as _dispatch
from fastattn import reference as ref

from conftest import assert_close, make_qkv, qkv_shapes, run_python

ISAS = ("base", "avx2", "avx512")
X86 = platform.machine().lower() in {"x86_64", "amd64", "i386", "i686"}


def _meant_to_build():
    isas = list(ISAS) if X86 else ["base"]
    only = os.environ.get("FASTATTN_ISAS")
    if only:
        isas = [i for i in isas if i in only.split(",")]
    return isas


# --------------------------------------------------------------------------- the checks
# Run in the child interpreter.  Shapes cross the kernel's block edges (96 query rows,
# 64 keys, 1024-key decode chunks) and use odd head dims, so every tile path runs.

def _same(q, k, v, dtype=None, **kw):
    """fastattn and the reference agree on the output and the lse."""
    out, lse = fastattn.attention(q, k, v, return_lse=True, **kw)
    want, want_lse = ref.attention(q, k, v, return_lse=True, **kw)
    assert_close(out, want, dtype)
    assert_close(lse, want_lse, lse.dtype)


def check_selected(rng, isa):
    info = _dispatch.kernel.build_info()
    assert _dispatch.ISA == isa, _dispatch.ISA
    if isa != "base":
        assert info["isa"] == isa, info
    assert info["vector_bytes"] == (64 if isa == "avx512" else 32), info


def check_prefill(rng, isa):
    _same(*make_qkv(rng, *qkv_shapes((2,), 4, 4, 130, 200, 64, 48)))
    _same(*make_qkv(rng, *qkv_shapes((), 3, 3, 97, 65, 5, 7)))


def check_causal(rng, isa):
    q, k, v = make_qkv(rng, *qkv_shapes((2,), 2, 2, 200, 200, 32, 32))
    _same(q, k, v, causal=True)
    q, k, v = make_qkv(rng, *qkv_shapes((1,), 2, 2, 70, 300, 32, 16))
    _same(q, k, v, causal=True)
    _same(q, k, v, causal="top-left")


def check_window(rng, isa):
    q, k, v = make_qkv(rng, *qkv_shapes((1,), 2, 2, 257, 257, 24, 24))
    _same(q, k, v, window=(40, 5))
    _same(q, k, v, causal=True, window=(100, -1))


def check_mask(rng, isa):
    q, k, v = make_qkv(rng, *qkv_shapes((2,), 4, 2, 100, 150, 16, 16))
    keep = rng.random((4, 1, 150)) < 0.7
    keep[1] = False                                     # a head that sees no key at all
    _same(q, k, v, mask=keep)
    add = np.where(rng.random((100, 150)) < 0.8, rng.standard_normal((100, 150)), -np.inf)
    _same(q, k, v, mask=add.astype(np.float32))


def check_gqa(rng, isa):
    _same(*make_qkv(rng, *qkv_shapes((2,), 8, 2, 99, 140, 64, 64)), causal=True)
    _same(*make_qkv(rng, *qkv_shapes((1,), 6, 1, 33, 80, 16, 8)))


def check_decode(rng, isa):
    # One query row, and GQA groups of 4 and 8 rows: the decode tiles.  Past 1024 keys the
    # keys are reduced in chunks and merged.
    for Hq, Lq in ((4, 1), (4, 4), (8, 1)):
        q, k, v = make_qkv(rng, *qkv_shapes((2,), Hq, 1, Lq, 2100, 64, 64))
        _same(q, k, v, causal=True, kv_lengths=np.array([2100, 1500]))
    with fastattn.num_threads(2):
        _same(*make_qkv(rng, *qkv_shapes((1,), 8, 1, 1, 3000, 128, 128)))


def check_float64(rng, isa):
    q, k, v = make_qkv(rng, *qkv_shapes((2,), 4, 2, 130, 300, 40, 24), np.float64)
    _same(q, k, v, causal=True)
    _same(q[..., -1:, :], k, v, window=(200, 0))


def check_float16(rng, isa):
    _same(*make_qkv(rng, *qkv_shapes((1,), 4, 2, 100, 130, 64, 64), np.float16), causal=True)


def _halves():
    try:
        import ml_dtypes
    except ImportError:   # bfloat16 is checked where ml_dtypes is installed
        return [np.dtype(np.float16)]
    return [np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16)]


def check_half_conversions(rng, isa):
    # The kernel's widening and rounding of float16 / bfloat16 (F16C, or the portable bit
    # arithmetic of the baseline) against NumPy's and ml_dtypes' casts: every 16-bit
    # pattern, random floats, and the ties halfway between neighbouring 16-bit values.
    bits = np.arange(1 << 16, dtype=np.uint16)
    kern = _dispatch.kernel
    for dt in _halves():
        wide = bits.view(dt).astype(np.float32)
        got = kern.vector_widen(bits, dt.name)
        nan = np.isnan(wide)
        assert np.array_equal(np.isnan(got), nan)
        assert got[~nan].tobytes() == wide[~nan].tobytes(), dt
        finite = np.sort(wide[np.isfinite(wide)].astype(np.float64))
        ties = ((finite[1:] + finite[:-1]) / 2).astype(np.float32)
        x = np.concatenate([rng.integers(0, 1 << 32, 200_000, dtype=np.uint64)
                            .astype(np.uint32).view(np.float32), wide, ties])
        with np.errstate(all="ignore"):
            want = x.astype(dt).view(np.uint16)
        got = kern.vector_narrow(x, dt.name)
        nan = np.isnan(x)
        assert np.array_equal(got[~nan], want[~nan]), dt
        assert np.isnan(got[nan].view(dt).astype(np.float32)).all()


def check_half_storage(rng, isa):
    # 16-bit q/k/v read in place give the bits of the same values cast to float32, on the
    # decode paths (1 row, GQA groups of 2, 4 and 8 rows), prefill tiles and odd head dims;
    # a 16-bit result is that float32 result rounded once.
    for dt in _halves():
        for Hq, Hkv, Lq, Lk, D, Dv in ((4, 4, 1, 300, 64, 64), (8, 2, 1, 2100, 128, 128),
                                       (16, 2, 1, 200, 33, 20), (8, 1, 1, 100, 72, 40),
                                       (4, 2, 3, 90, 16, 16), (4, 2, 130, 200, 40, 24)):
            q, k, v = make_qkv(rng, *qkv_shapes((2,), Hq, Hkv, Lq, Lk, D, Dv))
            k16, v16, q16 = k.astype(dt), v.astype(dt), q.astype(dt)
            want = fastattn.attention(q, k16.astype(np.float32), v16.astype(np.float32),
                                      causal=True)
            got = fastattn.attention(q, k16, v16, causal=True)
            assert got.tobytes() == want.tobytes(), (dt, Hq, Hkv, Lq, D)
            got16 = fastattn.attention(q16, k16, v16, causal=True)
            # all-bfloat16 calls multiply in bfloat16 where the kernel has those products,
            # as float32 calls do under the opt-in (elsewhere both stay float32)
            products = "float32" if dt == np.float16 else "bfloat16"
            with fastattn.float32_precision(products):
                want16 = fastattn.attention(q16.astype(np.float32), k16.astype(np.float32),
                                            v16.astype(np.float32), causal=True)
            assert got16.dtype == dt and got16.tobytes() == want16.astype(dt).tobytes()


def check_fp8_caches(rng, isa):
    # fp8 caches (a scale per kv head) read in place give the bits of attention over their
    # values (ml_dtypes' cast times the scale), on decode tiles of 1 and 4 rows and a
    # short prefill; NaN bytes (e4m3fn's S.1111.111, e5m2's) give NaN where those values
    # do, and e5m2's infinities what the float32 infinities give.
    try:
        import ml_dtypes
    except ImportError:
        return
    for name, nans in (("float8_e4m3fn", (0x7F, 0xFF)), ("float8_e5m2", (0x7E, 0xFD, 0x7C))):
        for Hq, Lq, with_nan in ((4, 1, False), (16, 1, False), (8, 5, False), (16, 1, True)):
            Hkv, L, D = 4, 300, 64
            k, v = (rng.standard_normal((1, Hkv, L, D)).astype(np.float32) for _ in range(2))
            q = rng.standard_normal((1, Hq, Lq, D)).astype(np.float32)
            top = float(ml_dtypes.finfo(getattr(ml_dtypes, name)).max)
            ks, vs = ((np.abs(a).max(axis=(0, 2, 3)) / top).astype(np.float32) for a in (k, v))
            kc, vc = fastattn.quantize_fp8(k, ks, name), fastattn.quantize_fp8(v, vs, name)
            if with_nan:   # one special byte in a K row and a few in V rows, apart
                kc.view(np.uint8)[0, 1, 40, 7] = nans[0]
                for j, byte in enumerate(nans):
                    vc.view(np.uint8)[0, 2, 100 + 30 * j, 3 + 20 * j] = byte
            values = [c.astype(np.float32) * s[:, None, None] for c, s in ((kc, ks), (vc, vs))]
            got = fastattn.attention_with_kvcache(q, kc, vc, k_scale=ks, v_scale=vs,
                                                  cache_seqlens=[L], causal=True)
            want = fastattn.attention(q, *values, causal=True)
            assert (np.isnan(got) == np.isnan(want)).all(), (name, Hq, Lq)
            assert (got[~np.isnan(got)] == want[~np.isnan(want)]).all(), (name, Hq, Lq)
            assert np.isnan(got).any() == with_nan


def _awkward_q8_0_rows(rng):
    """Rows of 128 whose blocks hit q8_0's corner cases."""
    x = (rng.standard_normal((8, 128)) * 10.0 ** rng.uniform(-6, 6, (8, 1))).astype(np.float32)
    x[0, :32] = 0.0
    x[0, 1:32:3] = -0.0                                      # signed zeros: d = 0
    x[1, :32] = np.arange(32) - 15.5                         # x / d at halves (d = 1)
    x[1, 0] = 127.0
    x[2, 32:64] = -(np.arange(32) - 15.5) * 0.25             # halves again, d = 1 / 4
    x[2, 32] = -127.0 / 4
    x[3, :32] = 127 * 65504.0 * rng.uniform(-1, 1, 32)       # up to the largest finite d
    x[3, 5] = -127 * 65504.0
    x[4] = np.float32(1e-45) * rng.integers(-3, 4, 128)      # float32 subnormals
    return x


def check_appended_rows(rng, isa):
    # The variant's quantisers and 16-bit stores (vectors of its width, the scalar code
    # past NaN lanes) against the formats' own oracles: gguf for q8_0 and q4_0,
    # ml_dtypes for fp8 and bfloat16, NumPy for float16; corner cases of every format,
    # and rows appended to caches by a decode step.
    import test_cache_formats as formats
    import test_kvcache as kv
    if importlib.util.find_spec("gguf") is not None:
        x = _awkward_q8_0_rows(rng)
        for got, want in zip(fastattn.quantize_q8_0(x), kv.gguf_q8_0(x)):
            assert got.tobytes() == want.tobytes()
        x = formats._awkward_q4_0_blocks(rng)
        for got, want in zip(fastattn.quantize_q4_0(x), formats.gguf_q4_0(x)):
            assert got.tobytes() == want.tobytes()
    for dt in _halves():
        if dt != np.float16:
            for name in ("float8_e4m3fn", "float8_e5m2"):
                x = formats._fp8_sweep(rng, name)
                for scale in (1.0, 0.37):
                    got = fastattn.quantize_fp8(x, scale, name).view(np.uint8)
                    assert got.tobytes() == kv.ml_fp8(x, scale, name).view(np.uint8).tobytes()
        # a decode step appends rows of 70 values (vectors, then a tail); NaN in some
        # lanes (NumPy's float16 NaN keeps the payload's top bits, quiet or not)
        B, Hkv, D = 2, 3, 70
        k_cache, v_cache = (np.zeros((B, Hkv, 8, D), dt) for _ in range(2))
        k, v = (rng.standard_normal((B, Hkv, 1, D)).astype(np.float32) * 1e3 for _ in range(2))
        k.view(np.uint32)[0, 1, 0, 5] = 0x7F800001           # signalling: F16C would quieten it
        k.view(np.uint32)[1, 2, 0, 20] = 0xFFC12345
        q = rng.standard_normal((B, 4 * Hkv, 1, D)).astype(np.float32)
        fastattn.attention_with_kvcache(q, k_cache, v_cache, k=k, v=v, cache_seqlens=[3, 5])
        for cache, new in ((k_cache, k), (v_cache, v)):
            assert cache[0, :, 3].tobytes() == new[0, :, 0].astype(dt).tobytes(), dt
            assert cache[1, :, 5].tobytes() == new[1, :, 0].astype(dt).tobytes(), dt
        # a finite value past the largest of the type is refused, the cache unchanged
        big = k.copy()
        big[1, 0, 0, 60] = np.finfo(np.float32).max if dt != np.float16 else 7e4
        big[np.isnan(big)] = 0
        before = k_cache.copy()
        try:
            fastattn.attention_with_kvcache(q, k_cache, v_cache, k=big, v=v, cache_seqlens=[4, 6])
        except ValueError:
            pass
        else:
            raise AssertionError(f"{dt}: an overflowing row was stored")
        assert k_cache.tobytes() == before.tobytes()
    _check_rotated_rows(rng)


def _check_rotated_rows(rng):
    # Rows rotated as they are appended: FlashAttention's rotation in float32, each
    # product and each sum rounded (NumPy's float32 operations), both layouts, rotary
    # dims that leave a tail past the vectors; float16 rows rounded back to float16 (into a
    # float32 cache, which keeps what the rounding gave).
    B, Hkv, D = 2, 2, 72
    for rotary_dim, dt in ((36, np.float32), (64, np.float32), (64, np.float16)):
        for interleaved in (False, True):
            half = rotary_dim // 2
            angles = rng.uniform(0, 6.3, (32, half))
            cos, sin = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
            k_cache, v_cache = (np.zeros((B, Hkv, 8, D), np.float32) for _ in range(2))
            k, v = (rng.standard_normal((B, Hkv, 1, D)).astype(dt) for _ in range(2))
            q = rng.standard_normal((B, Hkv, 1, D)).astype(np.float32)
            seqlens = np.array([2, 5])
            fastattn.attention_with_kvcache(q, k_cache, v_cache, k=k, v=v, cache_seqlens=seqlens,
                                            rotary_cos=cos, rotary_sin=sin,
                                            rotary_interleaved=interleaved)
            for b in range(B):
                c, s = cos[seqlens[b]], sin[seqlens[b]]
                want = k[b, :, 0].astype(np.float32)
                sl1 = slice(0, rotary_dim, 2) if interleaved else slice(0, half)
                sl2 = slice(1, rotary_dim, 2) if interleaved else slice(half, rotary_dim)
                x1, x2 = want[:, sl1].copy(), want[:, sl2].copy()
                want[:, sl1], want[:, sl2] = x1 * c - x2 * s, x1 * s + x2 * c
                got = k_cache[b, :, seqlens[b]]
                want = want.astype(dt).astype(np.float32)
                assert got.tobytes() == want.tobytes(), (rotary_dim, interleaved, dt)


def check_lse_and_empty_rows(rng, isa):
    # kv_lengths 0, and 7 keys under a causal mask for 50 rows, leave rows empty: their
    # output is zeros and their lse -inf.
    q, k, v = make_qkv(rng, *qkv_shapes((3,), 2, 2, 50, 120, 16, 16))
    _same(q, k, v, kv_lengths=np.array([120, 7, 0]), causal=True)
    out, lse = fastattn.attention(q, k, v, kv_lengths=np.array([120, 7, 0]), return_lse=True)
    assert (out[2] == 0).all() and np.isneginf(lse[2]).all()


def check_attention_weights(rng, isa):
    q, k, _ = make_qkv(rng, *qkv_shapes((1,), 2, 2, 70, 130, 16, 16))
    got = fastattn.attention_weights(q, k, causal=True, window=(50, -1))
    assert_close(got, ref.attention_weights(q, k, causal=True, window=(50, -1)))


def check_reproducible(rng, isa):
    # A query row's bits do not depend on the thread count, the batch, the other rows of
    # the call, or prefill against decode (the same rule tests/test_reproducibility.py
    # checks for the variant in use).
    for dtype in (np.float32, np.float64):
        q, k, v = make_qkv(rng, *qkv_shapes((3,), 4, 2, 150, 150, 64, 32), dtype)
        with fastattn.num_threads(1):
            full, lse = fastattn.attention(q, k, v, causal=True, return_lse=True)
        with fastattn.num_threads(2):
            two, two_lse = fastattn.attention(q, k, v, causal=True, return_lse=True)
        assert full.tobytes() == two.tobytes() and lse.tobytes() == two_lse.tobytes()
        alone = fastattn.attention(q[1], k[1], v[1], causal=True)
        assert alone.tobytes() == full[1].tobytes()
        rows = fastattn.attention(q[..., 100:140, :], k[..., :140, :], v[..., :140, :],
                                  causal=True)
        assert rows.tobytes() == full[..., 100:140, :].tobytes()
        for i in (0, 63, 64, 96, 149):
            step = fastattn.attention(q[..., i:i + 1, :], k[..., :i + 1, :], v[..., :i + 1, :])
            assert step.tobytes() == full[..., i:i + 1, :].tobytes(), (dtype, i)


def check_backward(rng, isa):
    # The gradients against the reference; bitwise equal whatever the thread count.
    q, k, v = make_qkv(rng, *qkv_shapes((2,), 4, 2, 100, 130, 32, 24), np.float64)
    kw = dict(causal=True, softcap=4.0, sinks=[0.5, -1.0, 0.0, 1.0])
    out, lse = fastattn.attention(q, k, v, return_lse=True, **kw)
    dout = rng.standard_normal(out.shape)
    got = fastattn.attention_backward(dout, q, k, v, out, lse, **kw)
    for g, w in zip(got, ref.attention_backward(dout, q, k, v, out, lse, **kw)):
        assert np.abs(g - w).max() <= 1e-12 * np.abs(w).max()
    q, k, v, out, dout = (a.astype(np.float32) for a in (q, k, v, out, dout))
    lse = lse.astype(np.float32)
    with fastattn.num_threads(1):
        one = fastattn.attention_backward(dout, q, k, v, out, lse, **kw)
    with fastattn.num_threads(3):
        three = fastattn.attention_backward(dout, q, k, v, out, lse, **kw)
    assert all(a.tobytes() == b.tobytes() for a, b in zip(one, three))


CHECKS = {name[len("check_"):]: f for name, f in globals().items() if name.startswith("check_")}


def _run_checks(isa):
    """Every check in this interpreter: {name: None if it passed, else the traceback}."""
    results = {}
    for name, check in CHECKS.items():
        try:
            check(np.random.default_rng(20240611), isa)
            results[name] = None
        except Exception:
            results[name] = traceback.format_exc()
    return results


# --------------------------------------------------------------------------- the tests

def _skip_reason(isa):
    if isa != "base" and not X86:
        return f"the {isa} variant is built for x86 CPUs only"
    if isa != "base" and not _kernel_base.cpu_supports(isa):
        return f"this CPU cannot run the {isa} variant: it is tested only on CPUs that can"
    if importlib.util.find_spec(f"fastattn._kernel_{isa}") is None and isa not in _meant_to_build():
        return f"the {isa} variant is not in this build (FASTATTN_ISAS)"
    return None


@pytest.mark.parametrize("isa", ISAS)
def test_variant_is_built(isa):
    reason = _skip_reason(isa)
    if reason:
        pytest.skip(reason)
    assert importlib.util.find_spec(f"fastattn._kernel_{isa}") is not None, (
        f"this CPU runs the {isa} variant and the build should include it "
        f"({', '.join(_meant_to_build())}), but fastattn/_kernel_{isa} is missing")
    assert isa in _dispatch.available_variants(), f"fastattn._kernel_{isa} does not import"


def _cpuinfo_vendor():
    """The first vendor_id of /proc/cpuinfo, or None where there is none to read."""
    if not os.path.exists("/proc/cpuinfo"):
        return None
    with open("/proc/cpuinfo") as f:
        vendors = re.findall(r"^vendor_id\s*:\s*(\S+)", f.read(), re.M)
    return vendors[0] if vendors else None


@pytest.mark.parametrize("isa", ISAS)
def test_decode_prefetch_level_follows_the_vendor(isa):
    # The decode kernels request rows into L1 on Intel cores and into L2 on all others
    # (fa_prefetch_init, from CPUID); the kernel's word checked against the OS's.
    vendor = _cpuinfo_vendor()
    if vendor is None or not X86:
        pytest.skip("no x86 /proc/cpuinfo to read the vendor from")
    if _skip_reason(isa) or isa not in _dispatch.available_variants():
        pytest.skip(f"the {isa} variant does not run here")
    kernel = importlib.import_module(f"fastattn._kernel_{isa}")
    assert kernel.DECODE_PREFETCH_L1 == (vendor == "GenuineIntel"), vendor


def _disassembly(path):
    """{function name: its instructions} from objdump, or None where there is none."""
    objdump = shutil.which("objdump")
    if objdump is None:
        return None
    text = subprocess.run([objdump, "-d", "--no-show-raw-insn", path], capture_output=True,
                          text=True, check=True).stdout
    functions, name = {}, None
    for line in text.splitlines():
        m = re.match(r"^[0-9a-f]+ <(.+)>:$", line)
        if m:
            name = m.group(1)
            functions[name] = []
        elif name and "\t" in line:
            functions[name].append(line.split("\t", 1)[1])
    return functions


@pytest.mark.parametrize("isa", ISAS)
def test_tile_functions_that_only_request_rows_are_compiled(isa):
    # A tile function whose only effect is a prefetch (the next tile's query rows, its
    # first K and V rows) looks to GCC like one without effects, and it deletes the calls
    # to it: the requests then never go out.  Each must be called where the pipeline
    # calls it and hold its prefetch instructions, or be inlined there with them.  Read
    # from the shared object, not run, so every variant built here is checked.
    if not sys.platform.startswith("linux"):
        pytest.skip("reads GNU objdump's listing of an ELF object")
    spec = importlib.util.find_spec(f"fastattn._kernel_{isa}")
    if spec is None or spec.origin is None:
        pytest.skip(f"the {isa} variant is not built here")
    functions = _disassembly(spec.origin)
    if functions is None:
        pytest.skip("needs objdump")
    if not any(name.startswith("fa_pv_rows4") for name in functions):
        pytest.skip("the shared object has no symbol table")

    def named(base):
        return {name: body for name, body in functions.items()
                if re.search(rf"kernel_{isa}_{base}(\.|$)", name)}

    def requests(body):
        return any(i.startswith("prefetch") for i in body)

    for base, caller in (("_prefetch_next_q", "_attend_tile"),
                         ("_prefetch_next_tile", "_load_block")):
        callers = named(caller)
        assert callers, caller
        own = named(base)
        if own:
            assert all(requests(body) for body in own.values()), base
            called = [name for name, body in callers.items()
                      if any(i.startswith("call") and base in i for i in body)]
            assert called, f"no {caller} calls {base} in the {isa} variant: deleted"
        else:   # inlined into its callers, requests and all
            assert all(requests(body) for body in callers.values()), (
                f"{base} is gone from the {isa} variant and {caller} makes no requests")


_results = {}


def _child_results(isa, tmp_path_factory):
    if isa not in _results:
        # The child imports the same fastattn as this process, from a neutral directory.
        proc = run_python(os.path.abspath(__file__), isa, env={"FASTATTN_ISA": isa},
                          cwd=tmp_path_factory.mktemp(f"variant-{isa}"), timeout=None,
                          check=False)
        lines = proc.stdout.strip().splitlines()
        if proc.returncode == 0 and lines:
            _results[isa] = json.loads(lines[-1])
        else:
            crash = f"exit status {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
            _results[isa] = {name: crash for name in CHECKS}
    return _results[isa]


@pytest.mark.parametrize("check", list(CHECKS))
@pytest.mark.parametrize("isa", ISAS)
def test_variant(isa, check, tmp_path_factory):
    reason = _skip_reason(isa)
    if reason:
        pytest.skip(reason)
    if importlib.util.find_spec(f"fastattn._kernel_{isa}") is None:
        pytest.fail(f"fastattn._kernel_{isa} is missing (see test_variant_is_built)")
    error = _child_results(isa, tmp_path_factory)[check]
    assert error is None, f"{isa} variant, check {check}:\n{error}"


def _fingerprint():
    """A hash of the outputs of calls that cross every decode and prefill tile path (one
    row, GQA groups of 4 and 8, prefill tiles; float32, float16 K/V, float64)."""
    import hashlib
    rng = np.random.default_rng(7)
    h = hashlib.sha256()
    for hq, hkv, lq, lk, d in [(4, 4, 1, 700, 128), (8, 2, 1, 1500, 64), (16, 2, 1, 300, 80),
                               (6, 6, 3, 200, 32), (4, 4, 150, 260, 64), (2, 1, 97, 97, 24)]:
        for dtype in (np.float32, np.float16, np.float64):
            q, k, v = make_qkv(rng, *qkv_shapes((2,), hq, hkv, lq, lk, d, d), dtype)
            for kw in ({}, {"causal": True, "window": (100, 0)}, {"softcap": 3.0}):
                out, lse = fastattn.attention(q, k, v, return_lse=True, **kw)
                h.update(out.tobytes() + lse.tobytes())
    return h.hexdigest()


@pytest.mark.skipif(not X86, reason="the avx2 and avx512 variants are built for x86 only")
def test_avx2_and_avx512_give_the_same_bits(tmp_path):
    # Both FMA kernels run the same chain of operations per score and per sum (the decode
    # kernels of the AVX-512 build even run the AVX2 build's 8-key kernels in ymm
    # registers), so on one machine they must agree bit for bit.
    for isa in ("avx2", "avx512"):
        reason = _skip_reason(isa)
        if reason:
            pytest.skip(reason)
    bits = [run_python(os.path.abspath(__file__), isa, "bits", env={"FASTATTN_ISA": isa},
                       cwd=tmp_path).stdout.split()[-1] for isa in ("avx2", "avx512")]
    assert bits[0] == bits[1]


if __name__ == "__main__":
    if sys.argv[2:] == ["bits"]:
        print(_fingerprint())
    else:
        print(json.dumps(_run_checks(sys.argv[1])))
