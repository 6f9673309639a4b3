"""Plain NumPy attention: the oracle the fast kernels are checked against.

This module is the textbook math, written once for arrays of any batch shape:

1. **scores** -- every query is compared with every key by a scaled dot product::

       S[i, j] = scale * q_i . k_j          (scale = 1/sqrt(D) unless given)

2. **visibility** -- some keys may not be seen by query ``i`` (causal masking, a sliding
   window, right padding given by ``kv_lengths``, a boolean ``mask``); a floating ``mask``
   is added to the scores instead. Hidden keys get the score ``-inf``.

3. **softmax** over the keys of each row, shifted by the row maximum so ``exp`` never
   overflows (scores in the tens of thousands are fine)::

       P[i, j] = exp(S[i, j] - m_i) / sum_j' exp(S[i, j'] - m_i),   m_i = max_j S[i, j]

4. **weighted sum** of the values -- the context vectors::

       out_i = sum_j P[i, j] v_j

   and, on request, the log-sum-exp of each row ``lse_i = m_i + log sum_j exp(S[i, j] - m_i)``,
   which lets partial results over disjoint key sets be merged exactly.

A row that sees no key at all has no distribution to normalise: its output is zeros and its
``lse`` is ``-inf`` (never NaN, never a warning).

Unlike the kernels, everything here materialises the full ``(..., Hq, Lq, Lk)`` score matrix
and computes in float64 whatever the input dtype, so that it is a better oracle than the code
it checks. Only the returned dtype follows the public contract (float16 in -> float16 out,
integers and bool -> float64, ``lse`` in the compute dtype: float32 for float16/float32,
float64 otherwise). Arguments are checked only as far as needed to fail with a clear
``ValueError``/``TypeError``; the public front-end in :mod:`fastattn._api` is the strict one.

Visibility, in the notation of the contract (``Lq`` queries, ``Lk`` keys, ``Lk`` replaced by
``kv_lengths[b]`` for batch element ``b`` when given)::

    key j exists          iff  j < Lk
    causal=True           iff  j <= i + (Lk - Lq)            (bottom-right aligned;
                                                              also causal="bottom-right")
    causal="top-left"     iff  j <= i                        (PyTorch's is_causal)
    window=(left, right)  iff  i + (Lk-Lq) - left <= j <= i + (Lk-Lq) + right   (-1: unbounded)
    boolean mask          iff  mask[..., h, i, j] is True
"""

import numpy as np

__all__ = ["attention", "attention_weights", "softmax", "visible_keys"]


# --------------------------------------------------------------------------- dtypes

def _dtypes(*arrays):
    """Return ``(result_dtype, compute_dtype)`` of the contract for these inputs.

    The kernels compute float16 in float32 and integers/bool in float64; the reference
    computes everything in float64 but reports the kernels' compute dtype for ``lse``.
    """
    for name, a in arrays:
        if a.dtype.kind not in "biuf":
            raise TypeError(
                f"{name} must be a real numeric array, got dtype {a.dtype} "
                "(complex and object arrays are not supported)"
            )
    dt = np.result_type(*[a for _, a in arrays])
    if dt.kind in "biu":
        return np.dtype(np.float64), np.dtype(np.float64)
    if dt == np.float16:
        return np.dtype(np.float16), np.dtype(np.float32)
    if dt in (np.float32, np.float64):
        return dt, dt
    raise TypeError(f"unsupported floating dtype {dt} (use float16, float32 or float64)")


# --------------------------------------------------------------------------- shapes

def _split_shapes(q, k, v=None):
    """Check q/k/v shapes; return (batch_shape, Hq, Hkv, Lq, Lk, D, Dv, squeeze_head).

    ``(Lq, D)`` inputs are handled as one head; ``squeeze_head`` says to drop it again.
    """
    named = [("q", q), ("k", k)] + ([("v", v)] if v is not None else [])
    for name, a in named:
        if a.ndim < 2:
            raise ValueError(f"{name} must have at least 2 dims (Lq/Lk, D), got shape {a.shape}")
    for name, a in named[1:]:
        if a.ndim != q.ndim:
            raise ValueError(
                f"{name} must have as many dims as q: q.shape={q.shape}, {name}.shape={a.shape}"
            )
    squeeze_head = q.ndim == 2
    if squeeze_head:
        q, k = q[None], k[None]
        v = v[None] if v is not None else None

    Hq, Lq, D = q.shape[-3:]
    Hkv, Lk, Dk = k.shape[-3:]
    if Dk != D:
        raise ValueError(f"k's last dim must equal q's (D): q.shape={q.shape}, k.shape={k.shape}")
    Dv = D
    if v is not None:
        if v.shape[-3:-1] != (Hkv, Lk):
            raise ValueError(
                f"v must have the heads and length of k (Hkv, Lk): "
                f"k.shape={k.shape}, v.shape={v.shape}"
            )
        Dv = v.shape[-1]
    if Hkv == 0 or Hq % Hkv != 0:
        raise ValueError(
            f"the number of query heads must be a multiple of the key/value heads: "
            f"Hq={Hq} (q.shape={q.shape}), Hkv={Hkv} (k.shape={k.shape})"
        )
    try:
        batch_shape = np.broadcast_shapes(*[a.shape[:-3] for _, a in named])
    except ValueError:
        shapes = ", ".join(f"{name}.shape={a.shape}" for name, a in named)
        raise ValueError(f"batch dims of q, k, v do not broadcast: {shapes}") from None
    return batch_shape, Hq, Hkv, Lq, Lk, D, Dv, squeeze_head


def _expand_kv_heads(x, Hq):
    """Give every query head h its key/value head h // (Hq // Hkv) (GQA/MQA) by indexing."""
    Hkv = x.shape[-3]
    return np.take(x, np.arange(Hq) // (Hq // Hkv), axis=-3)


# --------------------------------------------------------------------------- visibility

def _check_causal(causal):
    if isinstance(causal, str):
        if causal == "bottom-right":  # the explicit spelling of causal=True
            return True
        if causal != "top-left":
            raise ValueError(
                f"causal must be True, False, 'top-left' or 'bottom-right', got {causal!r}")
        return causal
    if isinstance(causal, (bool, np.bool_)):
        return bool(causal)
    raise ValueError(f"causal must be True, False or 'top-left', got {causal!r}")


def _check_window(window):
    if window is None:
        return None
    try:
        left, right = window
    except (TypeError, ValueError):
        raise ValueError(f"window must be None or a pair (left, right), got {window!r}") from None
    for side in (left, right):
        if isinstance(side, (bool, np.bool_)) or not isinstance(side, (int, np.integer)):
            raise TypeError(f"window entries must be ints, got {window!r}")
        if side < -1:
            raise ValueError(f"window entries must be >= -1 (-1 = unbounded), got {window!r}")
    return int(left), int(right)


def _check_kv_lengths(kv_lengths, batch_shape, Lk):
    kv = np.asarray(kv_lengths)
    if kv.dtype.kind not in "iu":
        raise TypeError(f"kv_lengths must be an integer array, got dtype {kv.dtype}")
    try:
        kv = np.broadcast_to(kv, batch_shape)
    except ValueError:
        raise ValueError(
            f"kv_lengths of shape {kv.shape} does not broadcast to the batch shape {batch_shape}"
        ) from None
    if kv.size and (kv.min() < 0 or kv.max() > Lk):
        raise ValueError(f"kv_lengths must lie in [0, Lk={Lk}], got values in "
                         f"[{kv.min()}, {kv.max()}]")
    return kv.astype(np.int64)


def visible_keys(batch_shape, Lq, Lk, *, causal=False, window=None, kv_lengths=None):
    """Boolean array ``(*batch_shape, 1, Lq, Lk)``: may query i see key j?

    Built directly from the contract's formulas (see the module docstring); the head axis
    is 1 because none of these rules depends on the head. ``mask`` is applied separately.
    """
    causal = _check_causal(causal)
    window = _check_window(window)
    i = np.arange(Lq)[:, None]  # (Lq, 1)
    j = np.arange(Lk)[None, :]  # (1, Lk)
    if kv_lengths is None:
        length = np.full(batch_shape, Lk, dtype=np.int64)
    else:
        length = _check_kv_lengths(kv_lengths, batch_shape, Lk)
    # (..., 1 head, 1 query, 1 key): the per-batch number of existing keys
    length = length[..., None, None, None]
    offset = length - Lq  # bottom-right alignment: the last query sits on the last key

    visible = j < length
    if causal is True:
        visible = visible & (j <= i + offset)
    elif causal == "top-left":
        visible = visible & (j <= i)
    if window is not None:
        left, right = window
        if left != -1:
            visible = visible & (j >= i + offset - left)
        if right != -1:
            visible = visible & (j <= i + offset + right)
    return np.broadcast_to(visible, (*batch_shape, 1, Lq, Lk))


def _scores_and_visibility(q, k, scale, causal, window, mask, kv_lengths, batch_shape,
                           Hq, Lq, Lk, D):
    """Scaled float64 scores (..., Hq, Lq, Lk) with hidden keys at -inf, plus visibility."""
    if scale is None:
        if D == 0:
            raise ValueError("scale=None needs a head dimension D >= 1 (q.shape[-1] is 0)")
        scale = 1.0 / np.sqrt(D)
    if isinstance(scale, (bool, np.bool_)) or not isinstance(scale, (int, float, np.integer,
                                                                      np.floating)):
        raise TypeError(f"scale must be a real number or None, got {scale!r}")
    scale = float(scale)
    if not np.isfinite(scale):
        raise ValueError(f"scale must be finite, got {scale!r}")

    full_shape = (*batch_shape, Hq, Lq, Lk)
    q64 = q.astype(np.float64)
    k64 = _expand_kv_heads(k.astype(np.float64), Hq)
    scores = scale * (q64 @ np.swapaxes(k64, -1, -2))
    scores = np.broadcast_to(scores, full_shape)

    visible = visible_keys(batch_shape, Lq, Lk, causal=causal, window=window,
                           kv_lengths=kv_lengths)
    if mask is not None:
        mask = np.asarray(mask)
        if mask.dtype.kind not in "bf":
            raise TypeError(f"mask must be bool or floating, got dtype {mask.dtype}")
        try:
            mask = np.broadcast_to(mask, full_shape)
        except ValueError:
            raise ValueError(
                f"mask of shape {mask.shape} does not broadcast to (..., Hq, Lq, Lk) = {full_shape}"
            ) from None
        if mask.dtype == bool:
            visible = visible & mask
        else:
            scores = scores + mask.astype(np.float64)
    visible = np.broadcast_to(visible, full_shape)
    # A float mask's -inf hides a key just as a False would.
    # (NaN scores stay visible so that they propagate instead of vanishing.)
    visible = visible & (scores != -np.inf)
    scores = np.where(visible, scores, -np.inf)
    return scores, visible


def _softmax_rows(scores, visible):
    """Row-wise softmax of float64 scores; rows with nothing visible give zeros, lse=-inf."""
    any_visible = visible.any(axis=-1, keepdims=True)
    m = np.where(any_visible, scores.max(axis=-1, keepdims=True, initial=-np.inf), 0.0)
    with np.errstate(invalid="ignore", over="ignore"):
        p = np.where(visible, np.exp(scores - m), 0.0)
    total = p.sum(axis=-1, keepdims=True)
    safe_total = np.where(any_visible, total, 1.0)
    weights = p / safe_total
    with np.errstate(divide="ignore"):
        lse = np.where(any_visible, m + np.log(safe_total), -np.inf)[..., 0]
    return weights, lse


# --------------------------------------------------------------------------- public API

def attention(q, k, v, *, scale=None, causal=False, window=None, mask=None,
              kv_lengths=None, return_lse=False, out=None):
    """Scaled dot-product attention ``softmax(scale * q k^T + mask) v``, by the book.

    Same signature and semantics as :func:`fastattn.attention`; see the module docstring.
    Computes in float64, materialising the ``(..., Hq, Lq, Lk)`` scores.
    """
    q, k, v = np.asarray(q), np.asarray(k), np.asarray(v)
    result_dtype, compute_dtype = _dtypes(("q", q), ("k", k), ("v", v))
    batch_shape, Hq, Hkv, Lq, Lk, D, Dv, squeeze_head = _split_shapes(q, k, v)
    if squeeze_head:
        q, k, v = q[None], k[None], v[None]
    result_shape = (*batch_shape, Hq, Lq, Dv)
    if out is not None:
        if not isinstance(out, np.ndarray):
            raise TypeError(f"out must be a numpy.ndarray, got {type(out).__name__}")
        want = result_shape[1:] if squeeze_head else result_shape
        if out.shape != want or out.dtype != result_dtype:
            raise ValueError(f"out must have shape {want} and dtype {result_dtype}, "
                             f"got shape {out.shape} and dtype {out.dtype}")

    scores, visible = _scores_and_visibility(q, k, scale, causal, window, mask, kv_lengths,
                                             batch_shape, Hq, Lq, Lk, D)
    weights, lse = _softmax_rows(scores, visible)
    v64 = _expand_kv_heads(v.astype(np.float64), Hq)
    if kv_lengths is not None:
        # Keys at j >= kv_lengths[b] do not exist (e.g. the unused tail of a preallocated
        # KV cache, which may hold garbage): zero their values so that a weight of 0 times
        # a NaN there cannot leak into the weighted sum.
        length = _check_kv_lengths(kv_lengths, batch_shape, Lk)[..., None, None, None]
        v64 = np.where(np.arange(Lk)[:, None] < length, v64, 0.0)
    context = weights @ v64  # (..., Hq, Lq, Dv): the weighted sum of the values
    context = np.broadcast_to(context, result_shape)

    if squeeze_head:
        context, lse = context[0], lse[0]
    if out is None:
        result = context.astype(result_dtype)
    else:
        out[...] = context
        result = out
    if return_lse:
        return result, lse.astype(compute_dtype)
    return result


def attention_weights(q, k, *, scale=None, causal=False, window=None, mask=None,
                      kv_lengths=None):
    """The attention probabilities ``(..., Hq, Lq, Lk)``; hidden keys and empty rows get 0."""
    q, k = np.asarray(q), np.asarray(k)
    result_dtype, _ = _dtypes(("q", q), ("k", k))
    batch_shape, Hq, Hkv, Lq, Lk, D, _, squeeze_head = _split_shapes(q, k)
    if squeeze_head:
        q, k = q[None], k[None]
    scores, visible = _scores_and_visibility(q, k, scale, causal, window, mask, kv_lengths,
                                             batch_shape, Hq, Lq, Lk, D)
    weights, _ = _softmax_rows(scores, visible)
    if squeeze_head:
        weights = weights[0]
    return weights.astype(result_dtype)


def softmax(x, axis=-1):
    """Numerically stable softmax along ``axis``; a row that is all ``-inf`` gives zeros.

    float16/float32/float64 keep their dtype; integers and bool give float64.
    """
    x = np.asarray(x)
    result_dtype, _ = _dtypes(("x", x))
    x64 = x.astype(np.float64)
    visible = x64 != -np.inf
    weights, _ = _softmax_rows(np.moveaxis(x64, axis, -1), np.moveaxis(visible, axis, -1))
    return np.moveaxis(weights, -1, axis).astype(result_dtype)
