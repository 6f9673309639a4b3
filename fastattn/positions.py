"""Positional encodings: the sinusoidal table and rotary embeddings.

Attention is permutation invariant; these functions inject token order.

* ``sinusoidal_positions`` builds the additive table of "Attention is all you
  need": add it to the token embeddings before the projections.
* ``rope`` rotates queries and keys by position-dependent angles (RoFormer), so
  that ``q_i . k_j`` depends on ``i - j`` only.  It uses the *half-split*
  convention of GPT-NeoX and of the Hugging Face Llama/Mistral/Qwen code
  (``rotate_half``): feature ``m`` is paired with feature ``m + D/2``, not with
  its neighbour ``m + 1`` as in the original interleaved RoFormer/GPT-J layout.
  Weights trained with one convention need their q/k columns permuted to be
  used with the other.

Both compute angles in float64: ``position * frequency`` loses digits quickly in
float32 for long sequences, and the tables are cheap next to attention.
"""

from __future__ import annotations

import numpy as np

from ._calls import args as _args

__all__ = ["sinusoidal_positions", "rope"]


def _check_base(base):
    base = float(base)
    if not np.isfinite(base) or base <= 0.0:
        raise ValueError(f"base must be a positive finite number, got {base}")
    return base


def sinusoidal_positions(length, d_model, base=10000.0, *, dtype=np.float64):
    """Sinusoidal position table, shape ``(length, d_model)``.

    ``pe[p, 2i] = sin(p / base**(2i/d_model))`` and
    ``pe[p, 2i+1] = cos(p / base**(2i/d_model))``: even columns are sines, odd
    columns cosines, pairs sharing one frequency.  For odd ``d_model`` the last
    column (even index ``d_model - 1``) is the sine of a last, unpaired
    frequency ``base**((d_model-1)/d_model)``.  (Some tutorials leave that
    column at zero; their other columns agree with this table.)

    Parameters
    ----------
    length : int
        Number of positions ``0 .. length-1``.
    d_model : int
        Embedding width, >= 1.
    base : float
        Wavelength base, 10000 in the Transformer paper.
    dtype : floating dtype, default float64

    Examples
    --------
    >>> pe = sinusoidal_positions(4, 3)
    >>> words = np.array([[0, 1, 0], [0, 1, 1], [1, 1, 1], [0, 0, 0]])  # "I love you today"
    >>> x = words + pe
    >>> np.round(pe[1, :2], 8)
    array([0.84147098, 0.54030231])
    """
    length = _args.check_index(length, "length", 0)
    d_model = _args.check_index(d_model, "d_model", 1)
    base = _check_base(base)
    dtype = np.dtype(dtype)
    if dtype.kind != "f":
        raise TypeError(f"dtype must be a floating dtype, got {dtype}")
    pos = np.arange(length, dtype=np.float64)[:, None]
    two_i = np.arange(0, d_model, 2, dtype=np.float64)  # 2i for every sine column
    angle = pos / base ** (two_i / d_model)              # (length, ceil(d/2))
    pe = np.empty((length, d_model), dtype=np.float64)
    pe[:, 0::2] = np.sin(angle)
    pe[:, 1::2] = np.cos(angle[:, : d_model // 2])       # odd d: no cosine partner for the last sine
    return pe.astype(dtype, copy=False)


def rope(x, positions=None, base=10000.0):
    """Rotary position embedding of queries or keys, on the last axis.

    ``x`` has shape ``(..., L, D)`` with ``D`` even (usually ``(..., H, L, d_head)``).
    With ``x1 = x[..., :D/2]``, ``x2 = x[..., D/2:]``, ``theta_m = base**(-2m/D)``
    and angle ``a = position * theta_m``::

        out[..., :D/2] = x1 * cos(a) - x2 * sin(a)
        out[..., D/2:] = x2 * cos(a) + x1 * sin(a)

    i.e. ``x * cos + rotate_half(x) * sin`` of GPT-NeoX / Hugging Face Llama
    (half-split pairs, see the module docstring).

    Parameters
    ----------
    x : array_like, (..., L, D)
        Floating input keeps its dtype (float16 is computed in float32); integer
        and bool input give float64.
    positions : array_like of numbers, optional
        Position of each row, broadcastable to ``x.shape[:-1]``; default
        ``arange(L)`` along axis -2.  For a decode step pass the absolute
        position, e.g. ``positions=[t]``; for a batch ``(B, H, L, D)`` with
        per-sequence offsets pass shape ``(B, 1, L)``.
    base : float
        10000 for most models (Llama 3 uses 500000).

    Returns
    -------
    ndarray, same shape as ``x``.

    Examples
    --------
    >>> q = np.random.default_rng(0).standard_normal((2, 5, 8))    # (heads, L, d_head)
    >>> q_rot = rope(q)                                             # positions 0..4
    >>> np.allclose(rope(q[:, 4:], positions=[4]), q_rot[:, 4:])    # one decode step
    True
    """
    x = np.asarray(x)
    if x.dtype.kind == "c" or x.dtype == object:
        raise TypeError(f"x must be a real array, got dtype {x.dtype}")
    if x.ndim < 2:
        raise ValueError(f"x must have shape (..., L, D), got shape {x.shape}")
    D = x.shape[-1]
    if D % 2:
        raise ValueError(f"x must have an even last dimension D for rope, got shape {x.shape}")
    base = _check_base(base)
    if x.dtype.kind == "f":
        out_dtype = x.dtype
        compute = np.float32 if x.dtype == np.float16 else x.dtype
    else:
        out_dtype = compute = np.dtype(np.float64)

    if positions is None:
        pos = np.arange(x.shape[-2], dtype=np.float64)
    else:
        pos = np.asarray(positions)
        if pos.dtype.kind not in "biuf":
            raise TypeError(f"positions must be numeric, got dtype {pos.dtype}")
        pos = pos.astype(np.float64)
        try:
            ok = np.broadcast_shapes(pos.shape, x.shape[:-1]) == x.shape[:-1]
        except ValueError:
            ok = False
        if not ok:
            raise ValueError(
                f"positions of shape {pos.shape} does not broadcast to x.shape[:-1] = "
                f"{x.shape[:-1]} (x has shape {x.shape})"
            )

    half = D // 2
    inv_freq = base ** (-np.arange(0, D, 2, dtype=np.float64) / D)   # (D/2,)
    angle = pos[..., None] * inv_freq                                  # (..., L, D/2)
    cos = np.cos(angle).astype(compute, copy=False)
    sin = np.sin(angle).astype(compute, copy=False)
    xc = x.astype(compute, copy=False)
    x1, x2 = xc[..., :half], xc[..., half:]
    out = np.empty(x.shape, dtype=compute)
    out[..., :half] = x1 * cos - x2 * sin
    out[..., half:] = x2 * cos + x1 * sin
    return out.astype(out_dtype, copy=False)
