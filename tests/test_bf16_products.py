"""bfloat16 products: calls whose q, k and v are bfloat16, and float32 calls under
``set_float32_precision("bfloat16")``, multiply in bfloat16 pairs (AVX512-BF16).

What holds: the reproducibility rules (bits independent of threads, batch, Lq and the
other rows; a decode step gives the prefill row's bits), the switch (FASTATTN_BF16_DOT=0
and the kernel's setter give float32 products, bit for bit the old path), the opt-in's
default (float32 calls keep their exact bits), and accuracy against the float64 reference
on bfloat16-rounded inputs.  Most cases run float32 inputs through the opt-in, which needs
no ml_dtypes, so that the sanitizer stage runs these kernels too.  FlashAttention's
accuracy rule against torch's bfloat16 attention is in tests/test_flash_rule_bf16.py.

Skipped, with the reason, on a CPU or build without the bfloat16 products.
"""
import os
import subprocess
import sys
import warnings

import numpy as np
import pytest

from conftest import make_qkv, qkv_shapes, run_python

import fastattn
from fastattn import reference
from fastattn._calls import precision as _precision
from fastattn._machine.isa import kernel
from fastattn._calls.precision import bfloat16_bits, bfloat16_values

needs_bf16_dot = pytest.mark.skipif(
    not kernel.bf16_dot(),
    reason=f"no bfloat16 products here (kernel {kernel.__name__}: built "
           f"{kernel.BF16_DOT_BUILT}, CPU has AVX512-BF16 {kernel.BF16_DOT_CPU}, "
           f"FASTATTN_BF16_DOT={os.environ.get('FASTATTN_BF16_DOT', 'unset')})")


def bf16(**kw):
    """fastattn.attention with bfloat16 products for float32 inputs."""
    def call(*args, **more):
        with fastattn.float32_precision("bfloat16"):
            return fastattn.attention(*args, **kw, **more)
    return call


def test_bfloat16_bits_round_to_nearest_even():
    x = np.array([1.0, 1 + 2**-8, 1 + 3 * 2**-8, 1 + 2**-8 + 2**-20, -2.5, np.inf, -np.inf,
                  3.4e38, 1e-40, 0.0, -0.0], dtype=np.float32)
    # 1 + 2^-8 is a tie: even (1.0); 1 + 3 2^-8 a tie: up to 1 + 2^-6; just past a tie: up;
    # 3.4e38 rounds to inf (bfloat16's largest finite value is 3.39e38).
    want = np.array([1.0, 1.0, 1 + 2**-6, 1 + 2**-7, -2.5, np.inf, -np.inf, np.inf,
                     9.99e-41, 0.0, -0.0], dtype=np.float32)
    got = bfloat16_values(x)
    np.testing.assert_array_equal(got[:8], want[:8])
    assert got[8] != 0 and abs(got[8] - 1e-40) < 2**-133   # denormals round too
    assert np.signbit(got[10]) and not np.signbit(got[9])
    assert np.isnan(bfloat16_values(np.array([np.nan, np.float32(np.nan) * -1]))).all()
    assert np.isnan(bfloat16_values(np.array([0x7F800001], np.uint32).view(np.float32)))[0]


def test_default_float32_precision_keeps_float32_bits():
    q, k, v = make_qkv(np.random.default_rng(0), *qkv_shapes((2,), 3, 3, 50, 70, 64))
    before = fastattn.attention(q, k, v, causal=True)
    old = kernel.set_bf16_dot(False)
    try:
        off = fastattn.attention(q, k, v, causal=True)
    finally:
        kernel.set_bf16_dot(old)
    assert fastattn.get_float32_precision() == "float32"
    np.testing.assert_array_equal(before, off)
    ref = reference.attention(q.astype(np.float64), k, v, causal=True)
    assert np.abs(before - ref).max() < 1e-5


def test_precision_setting_is_checked_and_scoped():
    with pytest.raises(ValueError, match="precision must be one of"):
        fastattn.set_float32_precision("float16")
    with pytest.raises(ValueError, match="precision must be one of"):
        fastattn.float32_precision("medium")
    old = fastattn.set_float32_precision("bfloat16")
    try:
        assert fastattn.get_float32_precision() == "bfloat16"
        with fastattn.float32_precision("float32"):
            assert fastattn.get_float32_precision() == "float32"
        assert fastattn.get_float32_precision() == "bfloat16"
    finally:
        fastattn.set_float32_precision(old)
    assert fastattn.get_float32_precision() == "float32"


def test_the_opt_in_warns_once_where_it_changes_nothing(monkeypatch):
    monkeypatch.setattr(_precision, "_warned", False)
    had_products = kernel.set_bf16_dot(False)
    previous = fastattn.get_float32_precision()
    try:
        with pytest.warns(RuntimeWarning, match="'bfloat16' changes nothing here: ") as caught:
            fastattn.set_float32_precision("bfloat16")
            with fastattn.float32_precision("bfloat16"):
                pass
            fastattn.set_float32_precision("bfloat16")
        assert len(caught) == 1 and caught[0].filename == __file__   # names the user's line
    finally:
        fastattn.set_float32_precision(previous)
        kernel.set_bf16_dot(had_products)


@needs_bf16_dot
def test_the_opt_in_is_silent_where_it_runs(monkeypatch):
    monkeypatch.setattr(_precision, "_warned", False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with fastattn.float32_precision("bfloat16"):
            assert fastattn.get_float32_precision() == "bfloat16"
        fastattn.set_float32_precision(fastattn.set_float32_precision("bfloat16"))
    assert not _precision._warned


def test_the_environment_switch_makes_the_opt_in_warn_once():
    code = ("import fastattn\n"
            "for _ in range(3):\n"
            "    fastattn.set_float32_precision('bfloat16')\n"
            "fastattn.show_config()")
    res = run_python("-c", code, env={"FASTATTN_BF16_DOT": "0"})
    assert res.stderr.count("RuntimeWarning") == 1, res.stderr
    assert "float32: 'bfloat16' is set, but " in res.stdout


@needs_bf16_dot
@pytest.mark.parametrize("causal, window", [(False, None), (True, None), (True, (37, 0)),
                                            (False, (20, 9))])
@pytest.mark.parametrize("D", [64, 128])
def test_accuracy_against_float64_on_rounded_inputs(causal, window, D):
    # q.k is exact products summed in float32; P.V rounds P to bfloat16: a relative error
    # of at most 2^-9 per weight, so at most 2^-9 max|v| on an output, and with errors of
    # random sign, a few times 2^-12 on average (rows of one key have p = 1, exact).
    q, k, v = make_qkv(np.random.default_rng(D), *qkv_shapes((2,), 4, 2, 150, 230, D))
    out = bf16(causal=causal, window=window)(q, k, v)
    qr, kr, vr = (bfloat16_values(a).astype(np.float64) for a in (q, k, v))
    ref = reference.attention(qr, kr, vr, causal=causal, window=window)
    err = np.abs(out - ref)
    assert err.max() < 2**-9 * np.abs(vr).max()
    assert err.mean() < 2**-11
    # and the float32 products on the same rounded inputs are more exact, not equal
    exact = fastattn.attention(*(bfloat16_values(a) for a in (q, k, v)), causal=causal,
                               window=window)
    assert not np.array_equal(out, exact)


@needs_bf16_dot
def test_bits_do_not_depend_on_threads_batch_or_rows():
    q, k, v = make_qkv(np.random.default_rng(3), *qkv_shapes((3,), 8, 2, 200, 300, 64))
    f = bf16(causal=True)
    with fastattn.num_threads(1):
        one = f(q, k, v)
    with fastattn.num_threads(2):
        two = f(q, k, v)
    np.testing.assert_array_equal(one, two)
    for b in range(3):
        np.testing.assert_array_equal(f(q[b:b + 1], k[b:b + 1], v[b:b + 1])[0], two[b])
    # a slice of the rows, bottom-right aligned: the same rows of the full call
    np.testing.assert_array_equal(f(q[:, :, 150:], k, v), two[:, :, 150:])
    # rows of one head alone (other GQA rows absent from the tiles)
    np.testing.assert_array_equal(f(q[:, 5:6], k[:, 1:2], v[:, 1:2]), two[:, 5:6])


@needs_bf16_dot
@pytest.mark.parametrize("window", [None, (33, 0)])
def test_decode_steps_give_the_prefill_rows(window):
    # Odd cache lengths put the first visible key of a window at odd positions, where a
    # block of key pairs starts one key early.
    q, k, v = make_qkv(np.random.default_rng(5), *qkv_shapes((1,), 4, 4, 40, 1500, 128))
    f = bf16(causal=True, window=window)
    prefill = f(q, k, v)
    for i in (0, 1, 17, 38, 39):
        n = 1500 - 40 + 1 + i
        step = f(q[:, :, i:i + 1], k[:, :, :n], v[:, :, :n])
        np.testing.assert_array_equal(step[:, :, 0], prefill[:, :, i])
    with fastattn.num_threads(2):   # one head: keys split over threads (flash-decoding)
        split = f(q[:, :1, -1:], k[:, :1], v[:, :1])
    with fastattn.num_threads(1):
        whole = f(q[:, :1, -1:], k[:, :1], v[:, :1])
    np.testing.assert_array_equal(split, whole)
    np.testing.assert_array_equal(split[0, 0, 0], prefill[0, 0, -1])


@needs_bf16_dot
def test_varlen_rows_equal_their_own_calls():
    q, k, v = make_qkv(np.random.default_rng(7), *qkv_shapes((), 4, 2, 170, 260, 64))
    cu_q, cu_k = [0, 1, 70, 170], [0, 33, 150, 260]
    with fastattn.float32_precision("bfloat16"):
        packed = fastattn.attention_varlen(q, k, v, cu_q, cu_k, causal=True)
        for s in range(3):
            one = fastattn.attention(q[:, cu_q[s]:cu_q[s + 1]], k[:, cu_k[s]:cu_k[s + 1]],
                                     v[:, cu_k[s]:cu_k[s + 1]], causal=True)
            np.testing.assert_array_equal(packed[:, cu_q[s]:cu_q[s + 1]], one)


@needs_bf16_dot
def test_head_dims_the_tiles_do_not_take_multiply_in_float32():
    # Dv not a multiple of two vectors: the call is not rounded and keeps float32 bits.
    q, k, v = make_qkv(np.random.default_rng(9), *qkv_shapes((1,), 2, 2, 30, 40, 48))
    assert not kernel.bf16_dot_takes(48, 48)
    np.testing.assert_array_equal(bf16()(q, k, v), fastattn.attention(q, k, v))
    assert kernel.bf16_dot_takes(64, 64) and kernel.bf16_dot_takes(30, 32)


@needs_bf16_dot
def test_backward_uses_the_rounded_inputs():
    q, k, v = make_qkv(np.random.default_rng(11), *qkv_shapes((1,), 2, 2, 60, 80, 64))
    dout = np.random.default_rng(12).standard_normal(q.shape, dtype=np.float32)
    with fastattn.float32_precision("bfloat16"):
        out, lse = fastattn.attention(q, k, v, causal=True, return_lse=True)
        grads = fastattn.attention_backward(dout, q, k, v, out, lse, causal=True)
    rounded = [bfloat16_values(a) for a in (q, k, v)]
    want = fastattn.attention_backward(dout, *rounded, out, lse, causal=True)
    for g, w in zip(grads, want):
        np.testing.assert_array_equal(g, w)


@needs_bf16_dot
def test_bfloat16_inputs_use_the_products_and_the_switch_turns_them_off():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    bf = ml_dtypes.bfloat16
    q, k, v = make_qkv(np.random.default_rng(13), *qkv_shapes((2,), 4, 4, 90, 130, 64), bf)
    on = fastattn.attention(q, k, v, causal=True)
    # the float32 opt-in runs the same products on the same values
    wide = [a.astype(np.float32) for a in (q, k, v)]
    np.testing.assert_array_equal(bf16(causal=True)(*wide).astype(bf).view(np.uint16),
                                  on.view(np.uint16))
    old = kernel.set_bf16_dot(False)
    try:
        off = fastattn.attention(q, k, v, causal=True)
    finally:
        kernel.set_bf16_dot(old)
    # off: float32 products of the widened values, rounded once
    f32 = fastattn.attention(*wide, causal=True)
    np.testing.assert_array_equal(off.view(np.uint16), f32.astype(bf).view(np.uint16))
    assert not np.array_equal(on.view(np.uint16), off.view(np.uint16))
    # a decode step over the bfloat16 cache: the prefill row's bits
    step = fastattn.attention(q[:, :, -1:], k, v, causal=True)
    np.testing.assert_array_equal(step.view(np.uint16), on[:, :, -1:].view(np.uint16))


def test_environment_switch_turns_the_products_off():
    code = ("import fastattn; from fastattn._machine.isa import kernel; "
            "print(kernel.bf16_dot(), kernel.set_bf16_dot(True), kernel.bf16_dot())")
    env = dict(os.environ, FASTATTN_BF16_DOT="0")
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, check=True, cwd=os.path.dirname(os.path.dirname(
                             os.path.abspath(fastattn.__file__))))
    supported = kernel.BF16_DOT_BUILT and kernel.BF16_DOT_CPU
    assert res.stdout.split() == ["False", "False", str(supported)]
    assert bfloat16_bits(np.float32([1.0]))[0] == 0x3F80


@needs_bf16_dot
def test_backward_of_bfloat16_calls():
    # S and dP multiply in bfloat16 pairs when q, k, v and dout are bfloat16: the
    # gradients keep their bits across threads and batch, and stay within bfloat16
    # accuracy of the float64 gradients of the same values.
    ml_dtypes = pytest.importorskip("ml_dtypes")
    bf = ml_dtypes.bfloat16
    q, k, v = make_qkv(np.random.default_rng(17), *qkv_shapes((2,), 4, 2, 150, 200, 64), bf)
    dout = np.random.default_rng(18).standard_normal(q.shape).astype(bf)
    out, lse = fastattn.attention(q, k, v, causal=True, return_lse=True)
    with fastattn.num_threads(1):
        one = fastattn.attention_backward(dout, q, k, v, out, lse, causal=True)
    with fastattn.num_threads(2):
        two = fastattn.attention_backward(dout, q, k, v, out, lse, causal=True)
    single = fastattn.attention_backward(dout[1:], q[1:], k[1:], v[1:], out[1:], lse[1:],
                                         causal=True)
    for a, b, c in zip(one, two, single):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(a[1:], c)
    wide = [a.astype(np.float64) for a in (dout, q, k, v)]
    want = reference.attention_backward(*wide, causal=True)
    old = kernel.set_bf16_dot(False)
    try:
        exact = fastattn.attention_backward(dout, q, k, v, out, lse, causal=True)
    finally:
        kernel.set_bf16_dot(old)
    for g, e, w in zip(two, exact, want):
        scale = np.abs(w).max()
        assert np.abs(g - w).max() < 2**-7 * scale
        assert np.abs(g - w).max() < 4 * np.abs(e - w).max() + 2**-12 * scale
