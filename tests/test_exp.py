"""Accuracy of the kernel's vector 2**x (src/isa/fa_simd.h), the only transcendental in the
fused loop.  The bounds asserted here are the ones stated in the source and the README."""
import numpy as np
import pytest

from fastattn._machine.isa import available_variants, _load


@pytest.fixture(params=available_variants())
def kernel(request):
    return _load(request.param)


def _ulp_error(y, exact, dtype):
    # Error in units of the last place of the exact value, in that dtype.
    return np.abs(y.astype(np.float64) - exact) / np.spacing(exact.astype(dtype)).astype(np.float64)


def test_exp2_float32_within_2_ulp(kernel):
    # Normal results only: below 2**-126 the kernel flushes to zero (checked below).
    x = np.linspace(-126.0, 0.0, 400_003, dtype=np.float32)
    y = kernel.vector_exp2(x)
    exact = np.exp2(x.astype(np.float64))
    assert _ulp_error(y, exact, np.float32).max() <= 2.0


def test_exp2_float64_within_2_ulp(kernel):
    x = np.linspace(-1022.0, 0.0, 400_003)
    y = kernel.vector_exp2(x)
    exact = np.exp2(x.astype(np.longdouble)).astype(np.float64)
    assert _ulp_error(y, exact, np.float64).max() <= 2.0


@pytest.mark.parametrize("dtype, floor", [(np.float32, -127.0), (np.float64, -1023.0)])
def test_exp2_special_values(kernel, dtype, floor):
    # 2**0 == 1 and 2**-inf == 0 exactly (the online softmax relies on both), results
    # below the smallest normal are flushed to 0, NaN propagates.
    x = np.array([0.0, -np.inf, floor, floor - 5, -1e30, np.nan, -0.0], dtype=dtype)
    y = kernel.vector_exp2(x)
    assert y[0] == 1.0 and y[6] == 1.0
    assert (y[1:5] == 0.0).all()
    assert np.isnan(y[5])


def test_exp2_float32_8_lanes_has_the_full_vectors_bits(kernel):
    # The decode kernels' 8-lane 2**x (a ymm register in AVX-512 builds, where the full
    # vector uses vscalefps instead) must give the same bits, or a decode step would
    # differ from the prefill of the same row.  Dense over the range the softmax uses,
    # with the flush-to-zero edge and the special values.
    x = np.concatenate([np.linspace(-130.0, 0.0, 1_000_003, dtype=np.float32),
                        np.array([-np.inf, -0.0, -126.5, -126.49999, -1e30], np.float32)])
    np.testing.assert_array_equal(kernel.vector_exp2(x, lanes8=True).view(np.uint32),
                                  kernel.vector_exp2(x).view(np.uint32))
