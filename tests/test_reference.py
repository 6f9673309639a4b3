"""Tests of the NumPy oracle itself: hand-computed numbers, outputs printed by an
independent torch implementation of the same examples, and the contract's masking formulas
checked one by one.

If the oracle is wrong every kernel comparison is meaningless, so these tests compare it
with things that do not share its code: those printed values, np.tril/np.triu, and a
scalar loop (``naive_attention``) written straight from the definition.
"""

import math
import warnings

import numpy as np
import pytest

from fastattn import reference as ref

from conftest import assert_close, merge_partials


def naive_attention(q, k, v, scale, visible=None, add=None):
    """Scalar-loop attention for one head: q (Lq, D), k (Lk, D), v (Lk, Dv).

    ``visible[i][j]`` says whether query i may see key j, ``add[i][j]`` is added to the
    score. Returns (out, lse, weights) as nested lists.
    """
    Lq, Lk, Dv = len(q), len(k), v.shape[1]
    out, lse, weights = [], [], []
    for i in range(Lq):
        s = {}
        for j in range(Lk):
            if visible is not None and not visible[i][j]:
                continue
            sij = scale * sum(float(a) * float(b) for a, b in zip(q[i], k[j]))
            if add is not None:
                sij += add[i][j]
            if sij != -math.inf:
                s[j] = sij
        if not s:
            out.append([0.0] * Dv)
            lse.append(-math.inf)
            weights.append([0.0] * Lk)
            continue
        m = max(s.values())
        total = sum(math.exp(x - m) for x in s.values())
        w = [math.exp(s[j] - m) / total if j in s else 0.0 for j in range(Lk)]
        out.append([sum(w[j] * float(v[j][c]) for j in range(Lk)) for c in range(Dv)])
        lse.append(m + math.log(total))
        weights.append(w)
    return np.array(out).reshape(Lq, Dv), np.array(lse), np.array(weights).reshape(Lq, Lk)


# --------------------------------------------------------------------------- softmax

# The printed examples compute softmax with e = 2.718281828459 (truncated at 12 digits,
# relative error 1.7e-14), so their values carry a relative error of about |x| * 1.7e-14:
# rtol 1e-11.
@pytest.mark.parametrize("x, expected", [
    ([1, 2, 3], [0.09003057317038284, 0.24472847105480003, 0.6652409557748171]),
    ([1, 0, 1], [0.4223187982515171, 0.1553624034969658, 0.4223187982515171]),
    # The example prints the label [1, -10, -10] but computes softmax([1, 0, 0]): test what it
    # computed.
    ([1, 0, 0], [0.576116884765825, 0.21194155761708747, 0.21194155761708747]),
    ([4], [1.0]),
])
def test_softmax(x, expected):
    np.testing.assert_allclose(ref.softmax(x), expected, rtol=1e-11)


def test_softmax_rounded():
    # A printed example: softmax([4.4, 2.2, 4.01]) ~ [0.56, 0.06, 0.38] (two decimals).
    np.testing.assert_allclose(ref.softmax([4.4, 2.2, 4.01]), [0.56, 0.06, 0.38], atol=0.005)


def test_softmax_large_scores(strict_warnings):
    # "Jiraiya": exp(-1222) and exp(-1157) underflow to exactly 0 after the max shift.
    assert np.array_equal(ref.softmax(np.array([1106, 1171, 2328])), [0.0, 0.0, 1.0])


def test_softmax_weights():
    # The printed similarity scores and attention weights come from the same cell
    # (its context vectors do not: they were printed from another random draw, so they are
    # not tested). Inputs are printed with 8 decimals: atol 1e-7.
    scores = np.array([[5.06798984, 3.09132164, 3.47594607],
                       [3.09132164, 2.35205625, 2.25159346],
                       [3.47594607, 2.25159346, 2.57544933]])
    expected = [[0.50805787, 0.22669918, 0.26524295],
                [0.40828812, 0.30192217, 0.28978971],
                [0.43497103, 0.26386552, 0.30116346]]
    np.testing.assert_allclose(ref.softmax(scores / np.sqrt(6)), expected, atol=1e-7)


def test_softmax_all_minus_inf_row_is_zero(strict_warnings):
    x = np.array([[-np.inf, -np.inf, -np.inf], [0.0, -np.inf, 0.0]])
    assert np.array_equal(ref.softmax(x), [[0, 0, 0], [0.5, 0, 0.5]])
    assert np.array_equal(ref.softmax(np.full((2, 0), 1.0)), np.full((2, 0), 1.0))


def test_softmax_axis_and_dtypes(rng):
    x = rng.standard_normal((3, 4, 5))
    for axis in (0, 1, -1):
        expected = np.exp(x) / np.exp(x).sum(axis=axis, keepdims=True)
        np.testing.assert_allclose(ref.softmax(x, axis=axis), expected, rtol=1e-14)
    assert ref.softmax(x.astype(np.float32)).dtype == np.float32
    assert ref.softmax(x.astype(np.float16)).dtype == np.float16
    assert ref.softmax(np.array([1, 2, 3])).dtype == np.float64
    assert ref.softmax(np.array([True, False])).dtype == np.float64


# --------------------------------------------------------------------------- printed examples

def test_alpha_and_alpha_masked():
    x = np.array([[2, 4], [1, 2], [0, 2]])
    alpha = [[0.9999484585145457, 4.539758978267296e-05, 6.143895671497805e-06],
             [0.9908674725821718, 0.006676412513377005, 0.002456114904451198],
             [0.9646631559719018, 0.017668422014049192, 0.017668422014049192]]
    # alpha_masked prints ragged rows; as a matrix the hidden (future) keys have weight 0.
    alpha_masked = [[1.0, 0.0, 0.0],
                    [0.9933071490757145, 0.006692850924285412, 0.0],
                    [0.9646631559719018, 0.017668422014049192, 0.017668422014049192]]
    w = ref.attention_weights(x, x, scale=1.0)
    assert w.dtype == np.float64
    np.testing.assert_allclose(w, alpha, rtol=1e-11)
    np.testing.assert_allclose(ref.attention_weights(x, x, scale=1.0, causal=True),
                               alpha_masked, rtol=1e-11, atol=0)


@pytest.mark.parametrize("x, expected", [
    ([[1, 2], [1, 0], [1, 1], [2, 2]],
     [[1.0, 2.0], [1.0, 1.0], [1.0, 1.5752103826044344],
      [1.8649548767993709, 1.9798697812543224]]),
    ([[2, 4], [1, 2], [2, 0.1]],
     [[2.0, 4.0], [1.9933071490757144, 3.9866142981514288],
      [1.938024701975659, 2.399131881320575]]),
])
def test_contextualized(x, expected):
    # contextualized() is causal ("masked") self-attention with q = k = v = x, unscaled.
    x = np.array(x)
    np.testing.assert_allclose(ref.attention(x, x, x, scale=1.0, causal=True), expected,
                               rtol=1e-11)


def test_each_session_has_a_chair():
    emb = {"each": [4, 3, 3], "session": [7, 2, 1], "person": [1, 2, 7],
           "has": [3.5, 3, 3.5], "a": [3, 3, 4], "chair": [3, 4, 3]}
    s1 = np.array([emb[w] for w in ["each", "session", "has", "a", "chair"]])
    s2 = np.array([emb[w] for w in ["each", "person", "has", "a", "chair"]])
    np.testing.assert_allclose(ref.attention(s1, s1, s1, scale=1.0, causal=True)[-1],
                               [3.488241706560337, 3.3861879899594367, 3.1255703034802282],
                               rtol=1e-11)
    np.testing.assert_allclose(ref.attention(s2, s2, s2, scale=1.0, causal=True)[-1],
                               [3.1255703034802282, 3.3861879899594367, 3.4882417065603373],
                               rtol=1e-11)


def test_learned_projections():
    # "Schritt 3..6": query of word 3 ("a") against the keys/values of words 0..2.
    # The printed softmax input [-91, -163, -81.5] is the *unscaled* dot product (the
    # displayed scoreL divides by sqrt(3), but that cell shows "In [None]": it was edited
    # after the run), so scale=1.0 reproduces the printed numbers.
    WQ = np.array([[1, 2, 1], [-1, 1, 0], [-2, 1, 1]])
    WK = np.array([[-1, -2, -1], [-1, -1, 2], [0, -1, 1]])
    WV = np.array([[-1, 1, -2, 2], [1, 0, 1, 1], [1, 0, 0, -1]])
    WO = np.array([[1, 1, 2], [3, 1, 2], [6, 2, 1], [0, 0, 1]])
    x = np.array([[4, 3, 3], [7, 2, 1], [3.5, 3, 3.5], [3, 3, 4], [3, 4, 3]])
    q, k, v = x @ WQ, x @ WK, x @ WV
    w = ref.attention_weights(q[3:4], k[:3], scale=1.0)
    np.testing.assert_allclose(
        w, [[7.484622751062311e-05, 4.026866373829326e-36, 0.9999251537724895]], rtol=1e-9)
    out = ref.attention(q[3:4], k[:3], v[:3], scale=1.0)
    np.testing.assert_allclose(
        out, [[2.9999251537724896, 3.500037423113756, -4.000074846227511, 6.500112269341266]],
        rtol=1e-11)
    np.testing.assert_allclose(
        out @ WO, [[-10.500411654251309, -1.5001871155687763, 15.499962576886247]],
        rtol=1e-11)


# --------------------------------------------------------------------------- printed examples

CAT_INPUTS = np.array([[0.43, 0.15, 0.89],
                       [0.55, 0.87, 0.66],
                       [0.57, 0.85, 0.64],
                       [0.22, 0.58, 0.33],
                       [0.77, 0.25, 0.10],
                       [0.05, 0.80, 0.55]])


def test_a_cat_sat_on_the_mat_weights():
    # torch printed float32 results; 6 decimals (atol 5e-7 for rounding, plus 5e-7 for the
    # float32 arithmetic that printed them) in the loop and 4 in the tensor repr.
    w = ref.attention_weights(CAT_INPUTS, CAT_INPUTS, scale=1.0)
    six = {0: [0.209835, 0.200581, 0.198149, 0.124228, 0.122049, 0.145158],
           1: [0.138548, 0.237891, 0.233274, 0.123992, 0.108182, 0.158114],
           2: [0.139008, 0.236921, 0.232602, 0.124204, 0.110800, 0.156464]}
    for i, row in six.items():
        np.testing.assert_allclose(w[i], row, atol=1e-6)
    np.testing.assert_allclose(w[3, :2], [0.143527, 0.207394], atol=1e-6)
    four = [[0.2098, 0.2006, 0.1981, 0.1242, 0.1220, 0.1452],
            [0.1385, 0.2379, 0.2333, 0.1240, 0.1082, 0.1581],
            [0.1390, 0.2369, 0.2326, 0.1242, 0.1108, 0.1565],
            [0.1435, 0.2074, 0.2046, 0.1462, 0.1263, 0.1720],
            [0.1526, 0.1958, 0.1975, 0.1367, 0.1879, 0.1295],
            [0.1385, 0.2184, 0.2128, 0.1420, 0.0988, 0.1896]]
    np.testing.assert_allclose(w, four, atol=5.1e-5)


def test_context_vectors_and_lse():
    out, lse = ref.attention(CAT_INPUTS, CAT_INPUTS, CAT_INPUTS, scale=1.0, return_lse=True)
    context = [[0.4421, 0.5931, 0.5790],
               [0.4419, 0.6515, 0.5683],
               [0.4431, 0.6496, 0.5671],
               [0.4304, 0.6298, 0.5510],
               [0.4671, 0.5910, 0.5266],
               [0.4177, 0.6503, 0.5645]]
    np.testing.assert_allclose(out, context, atol=5.1e-5)
    # torch.exp(attention_scores_1).sum() = 18.7453 for "cat": that sum is exp(lse).
    np.testing.assert_allclose(np.exp(lse[1]), 18.7453, atol=5.1e-5)
    # log(weights) + lse recovers the printed raw scores (4 decimals).
    scores = [[0.9995, 0.9544, 0.9422, 0.4753, 0.4576, 0.6310],
              [0.9544, 1.4950, 1.4754, 0.8434, 0.7070, 1.0865],
              [0.9422, 1.4754, 1.4570, 0.8296, 0.7154, 1.0605],
              [0.4753, 0.8434, 0.8296, 0.4937, 0.3474, 0.6565],
              [0.4576, 0.7070, 0.7154, 0.3474, 0.6654, 0.2935],
              [0.6310, 1.0865, 1.0605, 0.6565, 0.2935, 0.9450]]
    w = ref.attention_weights(CAT_INPUTS, CAT_INPUTS, scale=1.0)
    np.testing.assert_allclose(np.log(w) + lse[:, None], scores, atol=5.1e-5)


# --------------------------------------------------------------------------- printed examples

def test_integer_example():
    x = np.array([[1, 0, 1, 0], [0, 1, 0, 1], [1, 1, 1, 1]])
    w = ref.attention_weights(x, x, scale=1.0)
    np.testing.assert_allclose(w, [[0.46831053, 0.06337894, 0.46831053],
                                   [0.06337894, 0.46831053, 0.46831053],
                                   [0.10650698, 0.10650698, 0.78698604]], atol=5e-9)
    out = ref.attention(x, x, x, scale=1.0)
    assert out.dtype == np.float64  # integer inputs are computed and returned in float64
    np.testing.assert_allclose(out, [[0.93662106, 0.53168947, 0.93662106, 0.53168947],
                                     [0.53168947, 0.93662106, 0.53168947, 0.93662106],
                                     [0.89349302, 0.89349302, 0.89349302, 0.89349302]],
                               atol=5e-9)


def test_jiraiya_large_scores(strict_warnings):
    # Scores up to 43074: only a max-shifted softmax survives; the other weights underflow
    # to exactly 0, so the output is exactly the last token.
    x = np.array([[9, 31, 8], [106, 7, 0], [207, 15, 0]])
    assert np.array_equal(ref.attention_weights(x, x, scale=1.0), [[0, 0, 1]] * 3)
    assert np.array_equal(ref.attention(x, x, x, scale=1.0), [[207, 15, 0]] * 3)


# --------------------------------------------------------------------------- visibility

def _visible(Lq, Lk, **kw):
    return ref.visible_keys((), Lq, Lk, **kw)[0]  # drop the head axis


@pytest.mark.parametrize("L", [1, 2, 5, 8])
def test_causal_square_is_tril(L):
    assert np.array_equal(_visible(L, L, causal=True), np.tril(np.ones((L, L), bool)))
    assert np.array_equal(_visible(L, L, causal="top-left"), np.tril(np.ones((L, L), bool)))


@pytest.mark.parametrize("Lq, Lk", [(1, 5), (3, 7), (7, 3), (5, 1)])
def test_causal_alignment(Lq, Lk):
    ones = np.ones((Lq, Lk), bool)
    # bottom-right: the last query sees every key; for Lq > Lk the first rows see none.
    assert np.array_equal(_visible(Lq, Lk, causal=True), np.tril(ones, k=Lk - Lq))
    assert np.array_equal(_visible(Lq, Lk, causal="top-left"), np.tril(ones, k=0))
    assert np.array_equal(_visible(Lq, Lk, causal=False), ones)


@pytest.mark.parametrize("Lq, Lk", [(4, 4), (2, 6), (6, 2), (5, 9)])
@pytest.mark.parametrize("left, right", [(-1, 0), (0, 0), (2, 0), (1, 1), (-1, 2), (0, -1),
                                         (3, -1), (-1, -1)])
def test_window_band(Lq, Lk, left, right):
    off = Lk - Lq
    ones = np.ones((Lq, Lk), bool)
    expected = ones.copy()
    if right != -1:
        expected &= np.tril(ones, k=off + right)
    if left != -1:
        expected &= np.triu(ones, k=off - left)
    assert np.array_equal(_visible(Lq, Lk, window=(left, right)), expected)
    # causal=True is window=(-1, 0); given together they intersect.
    assert np.array_equal(_visible(Lq, Lk, causal=True, window=(left, right)),
                          expected & np.tril(ones, k=off))


def test_window_minus_one_zero_is_causal(rng):
    q, k, v = (rng.standard_normal((2, L, 3)) for L in (5, 8, 8))
    np.testing.assert_array_equal(ref.attention(q, k, v, window=(-1, 0)),
                                  ref.attention(q, k, v, causal=True))


def test_kv_lengths_visibility():
    Lq, Lk = 3, 6
    vis = ref.visible_keys((3,), Lq, Lk, causal=True, kv_lengths=np.array([0, 2, 6]))
    ones = np.ones((Lq, Lk), bool)
    # Alignment uses kv_lengths[b] in place of Lk, and keys j >= kv_lengths[b] do not exist.
    assert not vis[0, 0].any()
    assert np.array_equal(vis[1, 0], np.tril(ones, k=2 - Lq) & (np.arange(Lk) < 2))
    assert np.array_equal(vis[2, 0], np.tril(ones, k=Lk - Lq))


@pytest.mark.parametrize("causal", [False, True, "top-left"])
def test_kv_lengths_equals_truncated_keys(rng, causal):
    B, H, Lq, Lk, D = 4, 2, 3, 7, 5
    q = rng.standard_normal((B, H, Lq, D))
    k = rng.standard_normal((B, H, Lk, D))
    v = rng.standard_normal((B, H, Lk, 4))
    lengths = np.array([0, 1, 4, 7])
    out, lse = ref.attention(q, k, v, causal=causal, window=(2, -1), kv_lengths=lengths,
                             return_lse=True)
    for b, n in enumerate(lengths):
        o_b, l_b = ref.attention(q[b], k[b, :, :n], v[b, :, :n], causal=causal, window=(2, -1),
                                 return_lse=True)
        np.testing.assert_allclose(out[b], o_b, rtol=1e-14, atol=1e-15)
        np.testing.assert_allclose(lse[b], l_b, rtol=1e-14, atol=1e-14)
    assert np.array_equal(out[0], np.zeros((H, Lq, 4)))
    assert np.all(lse[0] == -np.inf)


# --------------------------------------------------------------------------- vs scalar loops

@pytest.mark.parametrize("causal", [False, True, "top-left"])
@pytest.mark.parametrize("Lq, Lk", [(4, 4), (2, 5), (5, 2), (1, 1), (3, 0)])
def test_against_scalar_loops(rng, causal, Lq, Lk):
    D, Dv = 3, 2
    q, k, v = rng.standard_normal((Lq, D)), rng.standard_normal((Lk, D)), rng.standard_normal((Lk, Dv))
    scale = 0.7
    vis = _visible(Lq, Lk, causal=causal)
    # Cross-check the visibility used by the loop against the formula, independently.
    off = Lk - Lq if causal is True else 0
    vis_loop = [[(not causal) or j <= i + off for j in range(Lk)] for i in range(Lq)]
    assert np.array_equal(vis, np.array(vis_loop, bool).reshape(Lq, Lk))
    out_n, lse_n, w_n = naive_attention(q, k, v, scale, vis_loop)
    out, lse = ref.attention(q, k, v, scale=scale, causal=causal, return_lse=True)
    np.testing.assert_allclose(out, out_n, rtol=1e-13, atol=1e-15)
    np.testing.assert_allclose(lse, lse_n, rtol=1e-13, atol=1e-14)
    np.testing.assert_allclose(ref.attention_weights(q, k, scale=scale, causal=causal), w_n,
                               rtol=1e-13, atol=1e-15)


def test_masks_against_scalar_loops(rng):
    Lq, Lk, D = 4, 6, 3
    q, k, v = rng.standard_normal((Lq, D)), rng.standard_normal((Lk, D)), rng.standard_normal((Lk, 2))
    bool_mask = rng.random((Lq, Lk)) < 0.6
    bool_mask[2] = False  # a row with nothing visible
    add = rng.standard_normal((Lq, Lk))
    add[1, ::2] = -np.inf
    add[3] = -np.inf  # hidden by the additive mask
    out_n, lse_n, _ = naive_attention(q, k, v, 0.5, bool_mask.tolist())
    out, lse = ref.attention(q, k, v, scale=0.5, mask=bool_mask, return_lse=True)
    np.testing.assert_allclose(out, out_n, rtol=1e-13, atol=1e-15)
    np.testing.assert_allclose(lse, lse_n, rtol=1e-13, atol=1e-14)
    assert lse[2] == -np.inf and not out[2].any()
    out_n, lse_n, _ = naive_attention(q, k, v, 0.5, None, add.tolist())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out, lse = ref.attention(q, k, v, scale=0.5, mask=add, return_lse=True)
    np.testing.assert_allclose(out, out_n, rtol=1e-13, atol=1e-15)
    np.testing.assert_allclose(lse, lse_n, rtol=1e-13, atol=1e-14)
    assert lse[3] == -np.inf and not out[3].any()
    # A float mask of 0/-inf is the same as the boolean mask.
    as_float = np.where(bool_mask, 0.0, -np.inf)
    np.testing.assert_array_equal(ref.attention(q, k, v, mask=as_float),
                                  ref.attention(q, k, v, mask=bool_mask))


def test_mask_broadcast_shapes(rng):
    q = rng.standard_normal((2, 3, 4, 5))
    k = rng.standard_normal((2, 3, 6, 5))
    v = rng.standard_normal((2, 3, 6, 5))
    m = rng.random((1, 6)) < 0.5
    full = np.broadcast_to(m, (2, 3, 4, 6))
    np.testing.assert_array_equal(ref.attention(q, k, v, mask=m), ref.attention(q, k, v, mask=full))


# --------------------------------------------------------------------------- lse

def test_lse_definition(rng):
    q, k, v = rng.standard_normal((3, 4)), rng.standard_normal((5, 4)), rng.standard_normal((5, 2))
    _, lse = ref.attention(q, k, v, scale=0.3, return_lse=True)
    np.testing.assert_allclose(lse, np.log(np.exp(0.3 * q @ k.T).sum(axis=1)), rtol=1e-14)
    # ... and with large scores, where the naive formula would overflow.
    _, lse = ref.attention(q * 100, k * 100, v, scale=1.0, return_lse=True)
    s = 1e4 * q @ k.T
    np.testing.assert_allclose(lse, s.max(1) + np.log(np.exp(s - s.max(1, keepdims=True)).sum(1)),
                               rtol=1e-14)


@pytest.mark.parametrize("causal", [False, True])
def test_partial_lse_merge(rng, causal):
    H, Lq, Lk, D = 2, 5, 9, 4
    q = rng.standard_normal((H, Lq, D))
    k = rng.standard_normal((H, Lk, D))
    v = rng.standard_normal((H, Lk, 3))
    full, lse = ref.attention(q, k, v, causal=causal, return_lse=True)
    # Split the keys into two disjoint sets with complementary boolean masks (interleaved,
    # so each part is non-contiguous), then merge with the lse of each part.
    part = (np.arange(Lk) % 3 == 0)[None, :]
    o1, l1 = ref.attention(q, k, v, causal=causal, mask=part, return_lse=True)
    o2, l2 = ref.attention(q, k, v, causal=causal, mask=~part, return_lse=True)
    merged, merged_lse = merge_partials(o1, l1, o2, l2)
    np.testing.assert_allclose(merged, full, rtol=1e-13, atol=1e-15)
    np.testing.assert_allclose(merged_lse, lse, rtol=1e-14, atol=1e-14)
    # Contiguous split too: keys [0, 4) and [4, Lk) as separate calls (no causal: the
    # alignment would change with Lk).
    if not causal:
        o1, l1 = ref.attention(q, k[:, :4], v[:, :4], return_lse=True)
        o2, l2 = ref.attention(q, k[:, 4:], v[:, 4:], return_lse=True)
        merged, merged_lse = merge_partials(o1, l1, o2, l2)
        np.testing.assert_allclose(merged, full, rtol=1e-13, atol=1e-15)


# --------------------------------------------------------------------------- shapes, dtypes

def test_gqa_matches_repeated_heads(rng):
    q = rng.standard_normal((2, 8, 3, 4))
    k = rng.standard_normal((2, 2, 5, 4))
    v = rng.standard_normal((2, 2, 5, 6))
    out = ref.attention(q, k, v, causal=True)
    assert out.shape == (2, 8, 3, 6)
    for h in range(8):
        g = h // 4  # query head h uses kv head h // (Hq // Hkv)
        np.testing.assert_array_equal(out[:, h], ref.attention(q[:, h], k[:, g], v[:, g], causal=True))


def test_batch_broadcast(rng):
    q = rng.standard_normal((2, 1, 2, 3, 4))
    k = rng.standard_normal((1, 3, 2, 5, 4))
    v = rng.standard_normal((1, 3, 2, 5, 2))
    out = ref.attention(q, k, v)
    assert out.shape == (2, 3, 2, 3, 2)
    for a in range(2):
        for b in range(3):
            np.testing.assert_allclose(out[a, b], ref.attention(q[a, 0], k[0, b], v[0, b]),
                                       rtol=1e-14, atol=1e-15)


@pytest.mark.parametrize("dtypes, result, lse_dtype", [
    ((np.float64,) * 3, np.float64, np.float64),
    ((np.float32,) * 3, np.float32, np.float32),
    ((np.float16,) * 3, np.float16, np.float32),
    ((np.float16, np.float32, np.float16), np.float32, np.float32),
    ((np.int64,) * 3, np.float64, np.float64),
    ((np.int32, np.float32, np.float32), np.float64, np.float64),
    ((bool,) * 3, np.float64, np.float64),
])
def test_result_dtypes(rng, dtypes, result, lse_dtype):
    q, k, v = (rng.integers(0, 2, (2, 3, 4)).astype(dt) for dt in dtypes)
    out, lse = ref.attention(q, k, v, return_lse=True)
    assert out.dtype == result and lse.dtype == lse_dtype
    # attention_weights depends on q and k only.
    wdt = np.result_type(q, k)
    assert ref.attention_weights(q, k).dtype == (wdt if wdt.kind == "f" else np.float64)


def test_empty_lengths(strict_warnings, rng):
    q = rng.standard_normal((2, 3, 4))
    out, lse = ref.attention(q, np.zeros((2, 0, 4)), np.zeros((2, 0, 5)), return_lse=True)
    assert out.shape == (2, 3, 5) and not out.any() and np.all(lse == -np.inf)
    out, lse = ref.attention(np.zeros((2, 0, 4)), q, q, return_lse=True)
    assert out.shape == (2, 0, 4) and lse.shape == (2, 0)
    assert ref.attention_weights(q, np.zeros((2, 0, 4))).shape == (2, 3, 0)


def test_out_argument(rng):
    q, k, v = (rng.standard_normal((2, 3, 4)) for _ in range(3))
    out = np.empty((2, 3, 4))
    res = ref.attention(q, k, v, out=out)
    assert res is out
    np.testing.assert_array_equal(out, ref.attention(q, k, v))


def test_default_scale(rng):
    q, k, v = (rng.standard_normal((3, 9)) for _ in range(3))
    np.testing.assert_array_equal(ref.attention(q, k, v), ref.attention(q, k, v, scale=1 / 3))


@pytest.mark.parametrize("q_shape, k_shape, v_shape", [
    ((3, 4), (5, 3), (5, 4)),        # D mismatch
    ((3, 4), (5, 4), (6, 4)),        # Lk mismatch
    ((3, 3, 4), (2, 5, 4), (2, 5, 4)),  # Hq % Hkv
    ((2, 1, 3, 4), (3, 1, 5, 4), (3, 1, 5, 4)),  # batch dims
    ((2, 3, 4), (5, 4), (5, 4)),     # ndim
    ((4,), (4,), (4,)),              # too few dims
])
def test_shape_errors(q_shape, k_shape, v_shape):
    with pytest.raises(ValueError):
        ref.attention(np.ones(q_shape), np.ones(k_shape), np.ones(v_shape))


def test_other_errors():
    x = np.ones((3, 4))
    with pytest.raises(TypeError):
        ref.attention(x.astype(complex), x, x)
    with pytest.raises(ValueError):
        ref.attention(x, x, x, causal="bottom")
    with pytest.raises(ValueError):
        ref.attention(x, x, x, kv_lengths=4)
    with pytest.raises(ValueError):
        ref.attention(x, x, x, mask=np.ones((2, 3, 3), bool))
    with pytest.raises(ValueError):
        ref.attention(x, x, x, out=np.empty((3, 5)))


def test_kv_lengths_padding_is_never_read(rng, strict_warnings):
    # Keys beyond kv_lengths do not exist: NaN/inf there (an unused cache tail) is ignored.
    q = rng.standard_normal((2, 1, 3, 4))
    k, v = rng.standard_normal((2, 1, 8, 4)), rng.standard_normal((2, 1, 8, 2))
    lengths = np.array([5, 0])
    clean = ref.attention(q, k, v, kv_lengths=lengths)
    k[0, :, 5:], v[0, :, 5:], k[1], v[1] = np.nan, np.inf, np.nan, np.nan
    np.testing.assert_array_equal(ref.attention(q, k, v, kv_lengths=lengths), clean)


def test_causal_bottom_right_spelling(rng):
    q, k, v = rng.standard_normal((3, 4)), rng.standard_normal((6, 4)), rng.standard_normal((6, 2))
    np.testing.assert_array_equal(ref.attention(q, k, v, causal="bottom-right"),
                                  ref.attention(q, k, v, causal=True))
    with pytest.raises(ValueError):
        ref.attention(q[:, :0], k[:, :0], v)  # scale=None with D = 0 has no meaning
