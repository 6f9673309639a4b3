"""AMX tiles: the scalar model of the tile instructions, and the tile kernels on it.

The model (src/isa/fa_amx.h) is checked against TDPBF16PS's pseudocode from Intel's manual,
written out here in NumPy: per row and column, even and odd products summed separately
over the pairs (each step a fused multiply-add rounded to nearest even), then their sum
added to C, with subnormal inputs read as zero and subnormal results flushed.  The tile
kernels then run on the model on any CPU with bfloat16 products, and must keep the
reproducibility rules of the bfloat16 products and their accuracy.  Where the CPU has
AMX the same tests run on the hardware too, and the hardware must give the model's bits.

Skipped, with the reason, where this build or CPU has no bfloat16 products.
"""
import numpy as np
import pytest

from conftest import make_qkv, qkv_shapes, run_python
import test_bf16_products as pairs_tests      # the pairs' checks, rerun on the tiles
from test_bf16_products import bf16

import fastattn
from fastattn import reference
from fastattn._machine.isa import kernel
from fastattn._calls.precision import bfloat16_bits, bfloat16_values

FLT_MIN = np.float32(2.0**-126)
HAS_TILE_KERNELS = kernel.BF16_DOT_BUILT and kernel.BF16_DOT_CPU
needs_amx = pytest.mark.skipif(not kernel.amx_cpu(), reason="this CPU or OS runs no AMX-BF16")
BACKENDS = ["model"] + (["hw"] if kernel.amx_cpu() else [])


# ------------------------------------------------------------------ the instruction

def flush(x):
    """float32 values below FLT_MIN in magnitude as zeros of their sign."""
    x = np.asarray(x, np.float32)
    return np.where(np.abs(x) < FLT_MIN, np.copysign(np.float32(0), x), x).astype(np.float32)


def widen(bits):
    """bfloat16 bits as float32, subnormals read as zero."""
    return flush((np.asarray(bits, np.uint32) << 16).view(np.float32))


def fma32(a, b, c):
    """float32(a * b + c) rounded once: exact in float64 for the operands used here
    (products of two bfloat16 values, exponents within a few dozen of each other)."""
    return (a.astype(np.float64) * b.astype(np.float64) + c.astype(np.float64)).astype(np.float32)


def manual_dp(c, a, b, sequential=False):
    """TDPBF16PS as the manual's pseudocode reads (or, sequential, the Intrinsics
    Guide's): c (16 x 16 float32) + a (16 x 32 bfloat16 bits) . b (16 x 32 bits)."""
    A, B = widen(a), widen(b)
    acc = flush(c)
    even = np.zeros((16, 16), np.float32)
    odd = np.zeros((16, 16), np.float32)
    for k in range(16):
        a0, a1 = A[:, 2 * k, None], A[:, 2 * k + 1, None]
        b0, b1 = B[k, 0::2][None, :], B[k, 1::2][None, :]
        if sequential:
            acc = flush(fma32(a0, b0, acc))
            acc = flush(fma32(a1, b1, acc))
        else:
            even = flush(fma32(a0, b0, even))
            odd = flush(fma32(a1, b1, odd))
    if sequential:
        return acc
    return flush(acc + flush(even + odd))


def model_dp(c, a, b, sequential=False):
    out = np.array(c, np.float32, copy=True)
    kernel.amx_model_dp(out, np.ascontiguousarray(a, np.uint16),
                        np.ascontiguousarray(b, np.uint16), sequential)
    return out


def random_operands(rng, lo=-6, hi=6):
    """bfloat16 operands with exponents in [lo, hi], and a float32 C."""
    def values(shape):
        m = rng.uniform(1, 2, shape) * rng.choice([-1, 1], shape)
        return bfloat16_bits((m * 2.0 ** rng.integers(lo, hi + 1, shape)).astype(np.float32))
    c = (rng.standard_normal((16, 16)) * 4).astype(np.float32)
    return c, values((16, 32)), values((16, 32))


@pytest.mark.parametrize("sequential", [False, True], ids=["manual", "intrinsics-guide"])
def test_model_instruction_is_the_pseudocode(sequential):
    rng = np.random.default_rng(1)
    for _ in range(20):
        c, a, b = random_operands(rng)
        want = manual_dp(c, a, b, sequential)
        np.testing.assert_array_equal(model_dp(c, a, b, sequential).view(np.uint32),
                                      want.view(np.uint32))


def one_row(pairs, c0=0.0):
    """Operands whose row 0, column 0 multiplies the given (a_even, b_even, a_odd, b_odd)
    pairs in order; everything else zero."""
    c = np.zeros((16, 16), np.float32)
    c[0, 0] = c0
    a = np.zeros((16, 32), np.float32)
    b = np.zeros((16, 32), np.float32)
    for k, (ae, be, ao, bo) in enumerate(pairs):
        a[0, 2 * k], a[0, 2 * k + 1] = ae, ao
        b[k, 0], b[k, 1] = be, bo
    return c, bfloat16_bits(a), bfloat16_bits(b)


def test_the_two_orders_differ_as_the_manual_says():
    # even: 2^24 - 2^24 = 0, odd: 1 + 1 = 2, so C = 2 in the manual's order; one chain
    # through C loses the first 1 (2^24 + 1 rounds to 2^24): C = 1.
    c, a, b = one_row([(2.0**12, 2.0**12, 1, 1), (-2.0**12, 2.0**12, 1, 1)])
    assert model_dp(c, a, b)[0, 0] == 2
    assert model_dp(c, a, b, sequential=True)[0, 0] == 1
    assert manual_dp(c, a, b)[0, 0] == 2 and manual_dp(c, a, b, True)[0, 0] == 1


def test_sums_round_to_nearest_even():
    # 1 + 2^-24 is a tie between 1 and 1 + 2^-23: even is 1, at every step.
    c, a, b = one_row([(1, 1, 0, 0), (2.0**-12, 2.0**-12, 0, 0), (2.0**-12, 2.0**-12, 0, 0)])
    assert model_dp(c, a, b)[0, 0] == 1
    # 1 + 3 2^-24 lies past the tie: up to 1 + 2^-22 (fused: one rounding)
    c, a, b = one_row([(1, 1, 0, 0), (3 * 2.0**-13, 2.0**-11, 0, 0)])
    assert model_dp(c, a, b)[0, 0] == np.float32(1 + 2.0**-22)


def test_subnormals_are_read_and_written_as_zero():
    tiny = np.uint16(0x0001)                                   # a bfloat16 subnormal
    c = np.zeros((16, 16), np.float32)
    a = np.zeros((16, 32), np.uint16)
    b = np.zeros((16, 32), np.uint16)
    a[0, 0], b[0, 0] = tiny, bfloat16_bits(np.float32([2.0**100]))[0]
    assert model_dp(c, a, b)[0, 0] == 0                        # DAZ on the inputs
    c2, a2, b2 = one_row([(2.0**-70, 2.0**-70, 0, 0)])
    out = model_dp(c2, a2, b2)
    assert out[0, 0] == 0 and not np.signbit(out[0, 0])        # FTZ: 2^-140
    # -2^-140 flushes to -0; -0 + 0 (the odd products) is +0 when rounding to nearest
    c3, a3, b3 = one_row([(-(2.0**-70), 2.0**-70, 0, 0)], c0=-0.0)
    out = model_dp(c3, a3, b3)
    assert out[0, 0] == 0 and not np.signbit(out[0, 0])
    assert manual_dp(c3, a3, b3).view(np.uint32)[0, 0] == out.view(np.uint32)[0, 0]
    c4 = np.zeros((16, 16), np.float32)
    c4[0, 0] = 1e-40                                           # a subnormal C reads as 0
    assert model_dp(c4, np.zeros((16, 32), np.uint16), np.zeros((16, 32), np.uint16))[0, 0] == 0


def test_tile_operands_are_checked():
    c, a, b = random_operands(np.random.default_rng(0))
    with pytest.raises(ValueError, match="c must be"):
        kernel.amx_model_dp(c.astype(np.float64), a, b)
    with pytest.raises(ValueError, match="b must be"):
        kernel.amx_model_dp(c, a, b[:, :16].copy())
    with pytest.raises(TypeError, match="a must be a NumPy array"):
        kernel.amx_model_dp(c, a.tolist(), b)


@needs_amx
def test_hardware_instruction_gives_the_models_bits():
    rng = np.random.default_rng(2)
    for lo, hi in ((-6, 6), (-126, 127), (-70, -60)):         # overflow, underflow too
        for _ in range(20):
            c, a, b = random_operands(rng, lo, hi)
            a[rng.random(a.shape) < 0.05] = 0x0003             # some subnormals
            hw = c.copy()
            kernel.amx_hw_dp(hw, a, b)
            if not same_bits(hw, model_dp(c, a, b)):
                pytest.fail(f"the hardware differs from the model (exponents {lo}..{hi}); "
                            f"it follows the Intrinsics Guide's order: "
                            f"{same_bits(hw, model_dp(c, a, b, sequential=True))}")


def same_bits(x, y):
    """Equal bits, any NaN equal to any other (the hardware's NaN payloads are its own)."""
    return bool(np.all((x.view(np.uint32) == y.view(np.uint32)) | (np.isnan(x) & np.isnan(y))))


@needs_amx
def test_the_peak_loop_runs_at_tile_speed():
    # 1024 multiply-adds a cycle on Sapphire Rapids; a loop that traps or is emulated
    # runs orders of magnitude below 10^11 a second
    assert kernel.amx_peak(1_000_000) > 1e11


# ------------------------------------------------------------------ the kernels

@pytest.fixture(params=BACKENDS)
def tiles(request):
    """Run the test's bfloat16 products on AMX tiles (the model, and the hardware where
    there is one)."""
    if not HAS_TILE_KERNELS:
        pytest.skip(f"the tile kernels need bfloat16 products (kernel {kernel.__name__}: "
                    f"built {kernel.BF16_DOT_BUILT}, CPU has AVX512-BF16 "
                    f"{kernel.BF16_DOT_CPU})")
    old = kernel.set_amx(request.param)
    yield request.param
    kernel.set_amx(old)


def on_pairs(f, *args, **kw):
    """f on the bfloat16 pairs (no tiles)."""
    old = kernel.set_amx("off")
    try:
        return f(*args, **kw)
    finally:
        kernel.set_amx(old)


@pytest.mark.parametrize("causal, window", [(False, None), (True, None), (True, (37, 0)),
                                            (False, (20, 9))])
@pytest.mark.parametrize("D", [64, 128])
def test_accuracy_against_float64_on_rounded_inputs(tiles, causal, window, D):
    # The bounds of the bfloat16 pairs: q.k exact products summed in float32, P rounded
    # to bfloat16 (a relative error of at most 2^-9 per weight).
    q, k, v = make_qkv(np.random.default_rng(D), *qkv_shapes((2,), 4, 2, 150, 230, D))
    f = bf16(causal=causal, window=window, return_lse=True)
    out, lse = f(q, k, v)
    qr, kr, vr = (bfloat16_values(a).astype(np.float64) for a in (q, k, v))
    ref, ref_lse = reference.attention(qr, kr, vr, causal=causal, window=window,
                                       return_lse=True)
    err = np.abs(out - ref)
    assert err.max() < 2**-9 * np.abs(vr).max()
    assert err.mean() < 2**-11
    assert np.abs(lse - ref_lse).max() < 1e-5
    # the tiles' sums go in another order than the pairs': other bits
    pair_out, pair_lse = on_pairs(f, q, k, v)
    assert not np.array_equal(lse, pair_lse)


VARIANTS = {
    "mask-sinks": dict(mask="bool", sinks=True),
    "softcap-alibi": dict(softcap=20.0, alibi_slopes=[0.5, 0.25, 0.125, 0.0625]),
    "lengths": dict(kv_lengths=[200, 37], q_lengths=[60, 5]),
}


@pytest.mark.parametrize("D, Dv", [(128, 64), (64, 96)])
@pytest.mark.parametrize("variant", VARIANTS, ids=list(VARIANTS))
def test_variants_and_head_dims(tiles, D, Dv, variant):
    # The modifiers live in the pairs' finish stage; the tiles only multiply.  D != Dv
    # sizes the staging (K and V rows) and the pairs' buffers apart.
    rng = np.random.default_rng(17)
    q, k, v = make_qkv(rng, *qkv_shapes((2,), 4, 2, 60, 200, D, Dv))
    kw = dict(VARIANTS[variant], causal=True)
    if kw.get("mask") == "bool":
        kw["mask"] = rng.random((60, 200)) < 0.8
    if kw.get("sinks"):
        kw["sinks"] = rng.standard_normal(4)
    out, lse = bf16(**kw, return_lse=True)(q, k, v)
    qr, kr, vr = (bfloat16_values(a).astype(np.float64) for a in (q, k, v))
    ref, ref_lse = reference.attention(qr, kr, vr, **kw, return_lse=True)
    seen = np.isfinite(ref_lse)
    assert np.abs(out - ref).max() < 2**-9 * np.abs(vr).max()
    assert np.abs(lse[seen] - ref_lse[seen]).max() < 1e-5
    np.testing.assert_array_equal(np.isfinite(lse), seen)
    _, pair_lse = on_pairs(bf16(**kw, return_lse=True), q, k, v)
    assert not np.array_equal(lse, pair_lse)


def test_bits_do_not_depend_on_threads_batch_or_rows(tiles):
    pairs_tests.test_bits_do_not_depend_on_threads_batch_or_rows()


@pytest.mark.parametrize("window", [None, (33, 0), (70, 0)])
def test_decode_steps_give_the_prefill_rows(tiles, window):
    # Windows put a row's first key anywhere: its tile's first block starts at the
    # multiple of 32 below, which other tiles reach from an earlier key.
    pairs_tests.test_decode_steps_give_the_prefill_rows(window)


def test_varlen_rows_equal_their_own_calls(tiles):
    pairs_tests.test_varlen_rows_equal_their_own_calls()


def test_bfloat16_caches_paged_and_decoded_keep_the_prefill_bits(tiles):
    ml_dtypes = pytest.importorskip("ml_dtypes")
    from test_kvcache import make_cache, paged_from

    bf = ml_dtypes.bfloat16
    rng = np.random.default_rng(9)
    B, Hq, Hkv, D, L, Lmax = 2, 8, 2, 64, 6, 90
    cache = make_cache(rng, B, Hkv, Lmax, D, dtype=bf)
    pools, table = paged_from(cache, 16, rng)
    seqlens = np.array([37, 70])
    q = rng.standard_normal((B, Hq, L, D)).astype(bf)
    k, v = (rng.standard_normal((B, Hkv, L, D)).astype(bf) for _ in range(2))
    kw = dict(causal=True, return_lse=True)
    pre = {n: a.copy() for n, a in cache.items()}
    prefill, lse = fastattn.attention_with_kvcache(q, **pre, k=k, v=v, cache_seqlens=seqlens,
                                                   **kw)
    for i in range(L):
        step, step_lse = fastattn.attention_with_kvcache(
            q[:, :, i:i + 1], **pools, k=k[:, :, i:i + 1], v=v[:, :, i:i + 1],
            cache_seqlens=seqlens + i, block_table=table, **kw)
        np.testing.assert_array_equal(step.view(np.uint16), prefill[:, :, i:i + 1].view(np.uint16))
        np.testing.assert_array_equal(step_lse, lse[:, :, i:i + 1])
    # the pairs give other bits (lse: float32, before the output's rounding)
    _, pair_lse = on_pairs(fastattn.attention_with_kvcache, q, **cache, k=k, v=v,
                           cache_seqlens=seqlens, **kw)
    assert not np.array_equal(pair_lse, lse)


def test_head_dims_the_tiles_do_not_take_stay_on_the_pairs(tiles):
    # D = 48: bfloat16 pairs, not whole tiles of 32 dims
    q, k, v = make_qkv(np.random.default_rng(11), *qkv_shapes((1,), 2, 2, 30, 90, 48, 64))
    f = bf16(causal=True, return_lse=True)
    for got, want in zip(f(q, k, v), on_pairs(f, q, k, v)):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("batch, Hq, Hkv, Dv", [(2, 4, 2, 64), (1, 2, 1, 64), (1, 4, 2, 96)])
def test_backward_on_tiles(tiles, batch, Hq, Hkv, Dv):
    # All five products of the backward on the tiles (P and dS rounded to bfloat16):
    # gradients within bfloat16 accuracy of float64's on the rounded inputs, the same
    # bits on any thread count (one kv head: the passes split over threads, else whole
    # heads), and other bits than the pairs'.
    q, k, v = make_qkv(np.random.default_rng(13),
                       *qkv_shapes((batch,), Hq, Hkv, 90, 150, 64, Dv))
    dout = bfloat16_values(
        np.random.default_rng(14).standard_normal((*q.shape[:-1], Dv), np.float32))
    ml_dtypes = pytest.importorskip("ml_dtypes")
    bf = ml_dtypes.bfloat16
    qb, kb, vb, db = (a.astype(bf) for a in (q, k, v, dout))

    def grads():
        out, lse = fastattn.attention(qb, kb, vb, causal=True, return_lse=True)
        return fastattn.attention_backward(db, qb, kb, vb, out, lse, causal=True)

    with fastattn.num_threads(1):
        one = grads()
    with fastattn.num_threads(2):
        two = grads()
    qr, kr, vr = (bfloat16_values(a).astype(np.float64) for a in (q, k, v))
    want = reference.attention_backward(dout.astype(np.float64), qr, kr, vr, causal=True)
    pairs = on_pairs(grads)
    for g1, g2, w, p in zip(one, two, want, pairs):
        g1, g2, p = (np.asarray(x, np.float32) for x in (g1, g2, p))
        np.testing.assert_array_equal(g1, g2)
        assert np.abs(g1 - w).max() < 2**-6 * np.abs(w).max()
        assert not np.array_equal(g1, p)


@needs_amx
def test_hardware_kernels_give_the_models_bits():
    q, k, v = make_qkv(np.random.default_rng(15), *qkv_shapes((2,), 8, 2, 130, 333, 128))
    f = bf16(causal=True, window=(100, 0), return_lse=True)
    got = {}
    for mode in ("model", "hw"):
        old = kernel.set_amx(mode)
        try:
            got[mode] = f(q, k, v)
        finally:
            kernel.set_amx(old)
    for a, b in zip(got["hw"], got["model"]):
        np.testing.assert_array_equal(a, b)


# ------------------------------------------------------------------ the switches

def test_modes_are_checked():
    with pytest.raises(ValueError, match="AMX mode must be one of"):
        kernel.set_amx("on")
    if not kernel.amx_cpu():
        with pytest.raises(ValueError, match="cannot run AMX-BF16 tiles"):
            kernel.set_amx("hw")
        with pytest.raises(ValueError, match="cannot run AMX-BF16 tiles"):
            kernel.amx_hw_dp(*random_operands(np.random.default_rng(0)))
    assert kernel.amx() in ("off", "hw", "model")


@pytest.mark.parametrize("value, want", [("0", "off"), ("model", "model"), ("1", "hw"),
                                         (None, "hw")])
def test_environment_switch(value, want):
    code = "from fastattn._machine.isa import kernel; print(kernel.amx())"
    res = run_python("-c", code, env={"FASTATTN_AMX": value})
    if want == "model" and not HAS_TILE_KERNELS:
        want = "off"
    if want == "hw" and not (kernel.amx_cpu() and (value == "1" or kernel.AMX_VERIFIED)):
        want = "off"
    assert res.stdout.split() == [want]
    info = run_python("-m", "fastattn", "info", env={"FASTATTN_AMX": value}).stdout
    line = next(s for s in info.splitlines() if s.startswith("AMX tiles:"))
    assert ("yes: runs on the hardware" in line) == (want == "hw")
    assert ("the scalar model" in line) == (want == "model")
