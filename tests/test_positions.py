"""Tests of fastattn.positions: the sinusoidal table and rotary embeddings (rope)."""

import numpy as np
import pytest

from fastattn.positions import rope, sinusoidal_positions

# An independent loop implementation printed get_position_encoding(3)[:10]; its third
# column is 0 only because its loop stops at int(3/2) pairs, so only the first two columns
# are compared.
LOOP_TABLE = np.array([
    [0.0, 1.0],
    [0.84147098, 0.54030231],
    [0.90929743, -0.41614684],
    [0.14112001, -0.9899925],
    [-0.7568025, -0.65364362],
    [-0.95892427, 0.28366219],
    [-0.2794155, 0.96017029],
    [0.6569866, 0.75390225],
    [0.98935825, -0.14550003],
    [0.41211849, -0.91113026],
])


def loop_position_encoding(d_embedding, max_seq_len=100, n=10000):
    """That independent loop, verbatim (exact for even d_embedding)."""
    position_encoding = np.zeros((max_seq_len, d_embedding))
    for k in range(max_seq_len):
        for i in np.arange(int(d_embedding / 2)):
            denominator = np.power(n, 2 * i / d_embedding)
            position_encoding[k, 2 * i] = np.sin(k / denominator)
            position_encoding[k, 2 * i + 1] = np.cos(k / denominator)
    return position_encoding


# --------------------------------------------------------------------------- sinusoidal

def test_printed_table():
    pe = sinusoidal_positions(100, 3)
    assert pe.shape == (100, 3) and pe.dtype == np.float64
    np.testing.assert_allclose(pe[1, :2], [0.84147098, 0.54030231], atol=5e-9)
    np.testing.assert_allclose(pe[:10, :2], LOOP_TABLE, atol=5e-9)


@pytest.mark.parametrize("d_model", [2, 4, 8, 64])
def test_even_d_model_equals_seed_loop(d_model):
    np.testing.assert_allclose(sinusoidal_positions(50, d_model),
                               loop_position_encoding(d_model, 50), rtol=0, atol=1e-14)


@pytest.mark.parametrize("d_model", [1, 3, 7])
def test_odd_d_model_last_column_is_a_sine(d_model):
    pe = sinusoidal_positions(20, d_model, base=100.0)
    k = np.arange(20)
    # The columns before the last agree with the even formula one size down ...
    if d_model > 1:
        expected = loop_position_encoding(d_model, 20, n=100.0)[:, : d_model - 1]
        np.testing.assert_allclose(pe[:, : d_model - 1], expected, atol=1e-14)
    # ... and the last column (even index d_model-1) is sin(k / base**((d_model-1)/d_model)).
    np.testing.assert_allclose(pe[:, -1], np.sin(k / 100.0 ** ((d_model - 1) / d_model)), atol=1e-14)


def test_table_rows_are_positions_and_dtype():
    pe = sinusoidal_positions(0, 4)
    assert pe.shape == (0, 4)
    pe32 = sinusoidal_positions(6, 8, dtype=np.float32)
    assert pe32.dtype == np.float32
    np.testing.assert_allclose(pe32, sinusoidal_positions(6, 8), atol=1e-7)
    # Position 0 is (0, 1, 0, 1, ...).
    np.testing.assert_array_equal(sinusoidal_positions(1, 6)[0], [0, 1, 0, 1, 0, 1])


@pytest.mark.parametrize("kwargs, exc, word", [
    (dict(length=-1, d_model=4), ValueError, "length"),
    (dict(length=3, d_model=0), ValueError, "d_model"),
    (dict(length=2.5, d_model=4), TypeError, "length"),
    (dict(length=3, d_model=4, base=0.0), ValueError, "base"),
    (dict(length=3, d_model=4, base=float("nan")), ValueError, "base"),
    (dict(length=3, d_model=4, dtype=np.int32), TypeError, "dtype"),
])
def test_sinusoidal_bad_arguments(kwargs, exc, word):
    with pytest.raises(exc, match=word):
        sinusoidal_positions(**kwargs)


# --------------------------------------------------------------------------- rope

def hf_rope(x, positions, base=10000.0):
    """Hugging Face Llama's apply_rotary_pos_emb, written out independently (float64)."""
    dim = x.shape[-1]
    inv_freq = 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    freqs = np.asarray(positions, dtype=np.float64)[..., None] * inv_freq
    emb = np.concatenate([freqs, freqs], axis=-1)
    cos, sin = np.cos(emb), np.sin(emb)

    def rotate_half(t):
        t1, t2 = t[..., : dim // 2], t[..., dim // 2:]
        return np.concatenate([-t2, t1], axis=-1)

    return x * cos + rotate_half(x) * sin


def test_rope_matches_hf_rotate_half(rng):
    x = rng.standard_normal((2, 3, 7, 16))
    np.testing.assert_allclose(rope(x), hf_rope(x, np.arange(7)), rtol=1e-13, atol=1e-13)
    pos = rng.integers(0, 5000, size=7)
    np.testing.assert_allclose(rope(x, pos, base=500000.0), hf_rope(x, pos, 500000.0),
                               rtol=1e-12, atol=1e-12)


def test_rope_matches_torch_formula(rng):
    torch = pytest.importorskip("torch")
    x = rng.standard_normal((2, 4, 9, 32)).astype(np.float32)
    # The same formula in torch, as transformers' LlamaRotaryEmbedding computes it.
    dim = 32
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    t = torch.arange(9).float()
    emb = torch.cat([torch.outer(t, inv_freq)] * 2, dim=-1)
    xt = torch.from_numpy(x)
    rot = torch.cat([-xt[..., dim // 2:], xt[..., : dim // 2]], dim=-1)
    expected = (xt * emb.cos() + rot * emb.sin()).numpy()
    out = rope(x)
    assert out.dtype == np.float32
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=2e-6)


def test_rope_position_zero_is_identity_and_norms_are_kept(rng):
    x = rng.standard_normal((5, 8))
    out = rope(x)
    np.testing.assert_array_equal(out[0], x[0])
    # Each (m, m + D/2) pair is rotated: norms of the pairs are preserved.
    pair = lambda a: np.hypot(a[..., :4], a[..., 4:])  # noqa: E731
    np.testing.assert_allclose(pair(out), pair(x), rtol=1e-14)


def test_rope_scores_depend_on_relative_position_only(rng):
    q = rng.standard_normal((1, 64))
    k = rng.standard_normal((1, 64))
    s = [float((rope(q, [m]) @ rope(k, [n]).T)[0, 0]) for m, n in [(3, 1), (10, 8), (1002, 1000)]]
    np.testing.assert_allclose(s, s[0], rtol=1e-10)


def test_rope_decode_step_and_batched_offsets(rng):
    x = rng.standard_normal((2, 3, 6, 8)).astype(np.float32)
    full = rope(x)
    np.testing.assert_array_equal(rope(x[..., 4:5, :], positions=[4]), full[..., 4:5, :])
    # Per-sequence offsets, broadcast over heads: positions (B, 1, L).
    offsets = np.array([0, 7])
    pos = offsets[:, None, None] + np.arange(6)
    out = rope(x, pos)
    for b in range(2):
        np.testing.assert_allclose(out[b], hf_rope(x[b].astype(np.float64), offsets[b] + np.arange(6)),
                                   rtol=1e-5, atol=1e-6)


def test_rope_dtypes():
    x = np.arange(24).reshape(3, 8)
    assert rope(x).dtype == np.float64
    np.testing.assert_allclose(rope(x), hf_rope(x.astype(float), np.arange(3)), atol=1e-12)
    assert rope(x.astype(np.float16)).dtype == np.float16
    assert rope(x.astype(np.float32)).dtype == np.float32


@pytest.mark.parametrize("x_shape, kwargs, exc, word", [
    ((4, 7), {}, ValueError, "even"),
    ((8,), {}, ValueError, "x"),
    ((2, 4, 8), dict(positions=np.arange(5)), ValueError, "positions"),
    ((2, 4, 8), dict(positions=np.zeros((3, 4))), ValueError, "positions"),
    ((4, 8), dict(positions=["a"] * 4), TypeError, "positions"),
    ((4, 8), dict(base=-1.0), ValueError, "base"),
])
def test_rope_bad_arguments(x_shape, kwargs, exc, word):
    with pytest.raises(exc, match=word):
        rope(np.ones(x_shape), **kwargs)


def test_rope_rejects_complex():
    with pytest.raises(TypeError, match="x"):
        rope(np.ones((2, 4), dtype=complex))
