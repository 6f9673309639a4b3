"""Each score is one chain ``acc += k[d] * q[d]`` that must round the same way in every
micro-kernel: fused into one FMA where the build's instruction set has one, two roundings
where it has none.  setup.py pins this (-ffp-contract=fast); a build that loses it rounds
differently, which these tests detect from a single score through ``lse``.

With one visible key, ``lse`` is the score itself (m = s, l = 1), so its bits show how the
chain rounded.  The inputs make the two roundings differ: the product (1 + e)^2 = 1 + 2e + e^2
is not representable, and fused with the -1 of the previous step its e^2 survives exactly.
"""
import platform

import numpy as np
import pytest

from fastattn._dispatch import _load, available_variants

LOG2E = 1.4426950408889634074
LN2 = 0.69314718055994530942


@pytest.fixture(params=available_variants())
def kernel(request):
    return _load(request.param)


def _expected_lse(dtype, e, fused):
    # acc after the chain, then the kernel's base-2 score and lse = s ln 2 + log 1.
    t = dtype.type
    if fused:
        acc = t(2 * e + e * e)            # exact in dtype: one rounding of -1 + (1 + e)^2
    else:
        acc = t((t(1 + e) * t(1 + e)) - t(1))
    s = t(acc * t(LOG2E))
    return t(np.float64(s) * LN2 + 0.0)


@pytest.mark.parametrize("dtype, e", [(np.dtype(np.float32), 2.0**-12),
                                      (np.dtype(np.float64), 2.0**-27)])
@pytest.mark.parametrize("Lq", [1, 3, 40])   # decode tile, small GQA-sized tile, prefill tile
def test_score_chain_rounding_matches_the_build(kernel, dtype, e, Lq):
    fused = kernel.build_info()["fma"]
    assert _expected_lse(dtype, e, True) != _expected_lse(dtype, e, False)
    # Hand-made, not random: the score is -1 + (1 + e)^2, the chain the docstring describes.
    q = np.tile(np.array([1.0, 1 + e, 0.0, 0.0], dtype), (Lq, 1))[None]   # (1, Lq, 4)
    k = np.array([-1.0, 1 + e, 0.0, 0.0], dtype)[None, None]               # one key
    v = np.ones((1, 1, 4), dtype)
    out, lse = kernel.attention_fast(q, k, v, 1.0, False, True, None, 1)
    np.testing.assert_array_equal(out, v.repeat(Lq, axis=1))
    want = _expected_lse(dtype, e, fused)
    assert np.all(lse == want), (f"lse {lse.ravel()[:3]} != {want!r}: the build "
                                 f"{'lost' if fused else 'gained'} FMA contraction")


# Whether each build's instruction set has a fused multiply-add: the x86-64 vector builds
# have one and must use it; the x86-64 baseline (SSE2) has none, and a build claiming one was
# compiled for a newer CPU than the baseline promises.  A portable ("generic") build has one
# exactly on targets whose base instruction set includes it (aarch64).
FMA_BY_ISA = {"avx512": True, "avx2": True, "sse2": False}


def test_build_contracts_exactly_when_its_isa_has_fma(kernel):
    info = kernel.build_info()
    if info["isa"] in FMA_BY_ISA:
        expected = FMA_BY_ISA[info["isa"]]
    elif platform.machine().lower() in ("aarch64", "arm64"):
        expected = True
    else:
        pytest.skip(f"a generic build on {platform.machine()}: whether its instruction set "
                    "has a fused multiply-add is not known here")
    assert info["fma"] == expected, info
