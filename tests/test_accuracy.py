"""Rounding error of a float32 score at a large head dim.

A score's FMA chain runs in chunks of 16 dimensions whose sums are added in order (see
fa_score_tile).  For D = 256 terms of one sign, a single sequential chain lets the rounding
errors of 256 growing partial sums pile up: about 3 units in the last place (u = 2**-24)
on average, relative to the score (measured: 3.0 u).  Chunked, each chain is 16 long and
the 16 chunk sums add 16 more roundings: measured 0.86-0.90 u (1.0 u with chunks of 64).
The lse of a row with one visible key is its score
(plus ~0.5 u from the base-2 conversions), so the mean relative error of lse over many
rows tells the two apart; the bound 2 u sits between them with a margin each way.
"""
import numpy as np
import pytest

import fastattn

U = 2.0**-24


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
