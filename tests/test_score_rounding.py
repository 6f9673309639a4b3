"""How a score rounds: the same way in every micro-kernel, and not much at a large head dim.

Each score is one chain ``acc += k[d] * q[d]`` that must round the same way in every
micro-kernel: fused into one FMA where the build's instruction set has one, two roundings
where it has none.  setup.py pins this (-ffp-contract=fast); a build that loses it rounds
differently, which these tests detect from a single score through ``lse``.

With one visible key, ``lse`` is the score itself (m = s, l = 1), so its bits show how the
chain rounded.  The inputs make the two roundings differ: the product (1 + e)^2 = 1 + 2e + e^2
is not representable, and fused with the -1 of the previous step its e^2 survives exactly.

At a large head dim, the chain runs in chunks of 16 dimensions whose sums are added in
order (see fa_score_tile).  For D = 256 terms of one sign, a single sequential chain lets the
rounding errors of 256 growing partial sums pile up: about 3 units in the last place
(u = 2**-24) on average, relative to the score (measured: 3.0 u).  Chunked, each chain is 16
long and the 16 chunk sums add 16 more roundings: measured 0.86-0.90 u (1.0 u with chunks of
64).  The lse of a row with one visible key is its score (plus ~0.5 u from the base-2
conversions), so the mean relative error of lse over many rows tells the two apart; the
bound 2 u sits between them with a margin each way.
"""
import platform

import numpy as np
import pytest

import fastattn
from fastattn._machine.isa import _load, available_variants

LOG2E = 1.4426950408889634074
LN2 = 0.69314718055994530942
U = 2.0**-24


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


@pytest.mark.parametrize("Lq", [1, 40])   # decode tiles (keys as lanes), prefill tiles
def test_float32_score_error_at_d256(Lq):
    rng = np.random.default_rng(7)
    nb, D = 400 // Lq, 256
    q = rng.random((nb, 1, Lq, D)).astype(np.float32)
    k = rng.random((nb, 1, 1, D)).astype(np.float32)
    v = np.ones((nb, 1, 1, 8), np.float32)
    _, lse = fastattn.attention(q, k, v, scale=1.0, return_lse=True)
    exact = np.einsum("bhid,bhjd->bhi", q.astype(np.float64), k.astype(np.float64))
    rel = np.abs(lse.astype(np.float64) - exact) / exact
    assert rel.mean() < 2 * U, f"mean relative score error {rel.mean() / U:.2f} u"
