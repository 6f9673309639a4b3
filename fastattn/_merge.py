"""Exact merge of attention computed over disjoint sets of keys.

A call over keys ``K = K_1 + ... + K_n`` (disjoint) is the weighted mean of the calls over
each ``K_i``: with ``lse_i = log(sum_{j in K_i} exp(s_j))``,

    lse = log(sum_i exp(lse_i)),    out = sum_i exp(lse_i - lse) * out_i.

The sums are shifted by ``max_i lse_i`` (the log-sum-exp trick), so every weight lies in
[0, 1] and nothing overflows whatever the scores.  Everything here is elementwise over the
rows and sums the partials in the order given, so a row's result does not depend on the
other rows passed with it (dask's chunking of the batch and heads leaves its bits alone).
"""
import math
import operator

import numpy as np

from . import _variants

__all__ = ["merge_attention"]


_shape = operator.attrgetter("shape")
_dtype = operator.attrgetter("dtype")


def _arrays(items, name):
    if isinstance(items, np.ndarray):
        items = list(items)   # a stacked array: its partials along axis 0
    else:
        try:
            items = [a if type(a) is np.ndarray else np.asarray(a) for a in items]
        except TypeError:
            raise TypeError(f"{name} must be a sequence of arrays, got "
                            f"{type(items).__name__}") from None
    if not items:
        raise ValueError(f"{name} must hold at least one partial result, got an empty sequence")
    return items


def _first_unlike(items, attr, value):
    return next(i for i, a in enumerate(items) if attr(a) != value)


def _check(outs, lses):
    """The partials as arrays, their dtype and compute dtype; raises before any arithmetic."""
    outs, lses = _arrays(outs, "outs"), _arrays(lses, "lses")
    if len(outs) != len(lses):
        raise ValueError(f"outs and lses must have the same length, got {len(outs)} outs "
                         f"and {len(lses)} lses")
    first = outs[0]
    if first.ndim < 1:
        raise ValueError("outs[0] must have shape (..., Lq, Dv), got a 0-d array")
    dtype = _variants.storage_dtype(first.dtype, "outs[0].dtype")
    compute = np.dtype(np.float32) if dtype.itemsize == 2 else dtype   # 16-bit: float32
    rows = first.shape[:-1]
    # Whole lists compared in C; the loops in _first_unlike only name the culprit.
    n = len(outs)
    if list(map(_shape, outs)) != [first.shape] * n:
        i = _first_unlike(outs, _shape, first.shape)
        raise ValueError(f"outs must all have one shape: outs[0].shape={first.shape}, "
                         f"outs[{i}].shape={outs[i].shape}")
    if list(map(_dtype, outs)) != [dtype] * n:
        i = _first_unlike(outs, _dtype, dtype)
        raise TypeError(f"outs must all have one dtype: outs[0].dtype={dtype}, "
                        f"outs[{i}].dtype={outs[i].dtype}")
    if list(map(_shape, lses)) != [rows] * n:
        i = _first_unlike(lses, _shape, rows)
        raise ValueError(f"lses[{i}] must have shape out.shape[:-1] = {rows}, got "
                         f"lses[{i}].shape={lses[i].shape} (outs[0].shape={first.shape})")
    if list(map(_dtype, lses)) != [compute] * n:
        i = _first_unlike(lses, _dtype, compute)
        raise TypeError(f"lses[{i}] must have dtype {compute} (the compute dtype of outs of "
                        f"dtype {dtype}), got {lses[i].dtype}")
    return outs, lses, dtype, compute


def merge_attention(outs, lses):
    """Merge attention results over disjoint sets of keys into the result over all of them.

    Parameters
    ----------
    outs : sequence of ndarray, each of shape (..., Hq, Lq, Dv)
        Partial results, as :func:`attention` with ``return_lse=True`` returns them: all
        of one shape and one dtype (float16, bfloat16, float32 or float64).
    lses : sequence of ndarray, each of shape (..., Hq, Lq)
        Their log-sum-exps, ``out.shape[:-1]``, in the compute dtype of the outs (float32
        for float16, bfloat16 and float32 outs; float64 for float64 outs).

    Returns
    -------
    out : ndarray, shape (..., Hq, Lq, Dv)
        The dtype of the outs.  Equals one :func:`attention` call over all the keys,
        within float rounding.  A row that no partial sees (``lse = -inf`` in all of them)
        is zeros.
    lse : ndarray, shape (..., Hq, Lq)
        ``log(sum_i exp(lses[i]))`` in the compute dtype; ``-inf`` where no partial sees
        the row.

    Notes
    -----
    The sum is shifted by the largest ``lse`` of each row, so every weight
    ``exp(lse_i - lse)`` lies in [0, 1]: nothing overflows, and a partial whose row has
    ``lse = -inf`` (no visible key) gets weight 0 and contributes nothing.  16-bit outs are
    merged in float32 and rounded once.

    The partial calls must see, between them, exactly the keys of the one call, each key
    once, with the one call's visibility.  Three details matter:

    - **Causal and sliding-window alignment.** These are aligned to the last key
      (``j <= i + Lk - Lq``), and a call over a shard of keys ``a:b`` would align to the
      shard's own last key.  Pass that shard ``window=(left - (Lk - b), right + (Lk - b))``
      instead (``causal=True`` is ``window=(-1, 0)``, so it becomes
      ``window=(-1, Lk - b)``; ``-1`` stays ``-1``).  Where ``left - (Lk - b)`` would be
      negative, give the shard the visibility as a boolean ``mask`` instead.
    - **kv_lengths.** Shard ``a:b`` has ``clip(kv_lengths - a, 0, b - a)`` keys (without
      causal or window, which align to ``kv_lengths``).
    - **sinks.** A sink is one extra logit in the denominator: pass ``sinks=`` to exactly
      one shard's call (fastattn's dask integration gives it to the first) and not to the
      others, or it would count once per shard.

    Examples
    --------
    >>> rng = np.random.default_rng(0)
    >>> q = rng.standard_normal((4, 1, 64))               # (Hq, Lq, D): a decode step
    >>> k, v = rng.standard_normal((2, 4, 1000, 64))
    >>> parts = [fastattn.attention(q, k[:, a:a + 250], v[:, a:a + 250], return_lse=True)
    ...          for a in range(0, 1000, 250)]             # four shards of the keys
    >>> out, lse = fastattn.merge_attention(*zip(*parts))
    >>> full, full_lse = fastattn.attention(q, k, v, return_lse=True)
    >>> bool(np.allclose(out, full, rtol=1e-12, atol=1e-12) and np.allclose(lse, full_lse))
    True
    """
    outs, lses, dtype, compute = _check(outs, lses)
    rows, Dv = outs[0].shape[:-1], outs[0].shape[-1]
    n, R = len(outs), math.prod(rows)
    lse_all = np.array(lses).reshape(n, R)
    top = np.maximum.reduce(lse_all, axis=0)
    # Rows nobody sees (top = -inf) are shifted by the most negative finite number instead,
    # so that their weights come out as exp(-inf) = 0 rather than exp(-inf + inf) = NaN.
    shift = np.maximum(top, np.finfo(compute).min)
    # Weights of row r in w[r], contiguous: the layout the product below reads.
    w = np.subtract(lse_all.T, shift[:, None], order="C")
    np.exp(w, out=w)
    # The largest weight of a row someone sees is exp(0) = 1 exactly, so its total is >= 1
    # and max(total, 1) changes only the rows nobody sees (total 0: weights 0, lse -inf).
    total = np.maximum(np.add.reduce(w, axis=1), 1)
    lse = np.add(top, np.log(total)).reshape(rows)
    w /= total[:, None]
    # One batched product, (R, 1, n) @ (R, n, Dv): each row's weighted sum of the partials
    # in a single call.  np.array copies the partials once; the product reads that copy
    # through a transposed view (BLAS takes its stride).
    stacked = np.array(outs, dtype=compute).reshape(n, R, Dv).transpose(1, 0, 2)
    out = np.matmul(w[:, None, :], stacked).reshape(rows + (Dv,))
    return out.astype(dtype, copy=False), lse
