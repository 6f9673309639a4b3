"""Exact merge of attention computed over disjoint sets of keys.

A call over keys ``K = K_1 + ... + K_n`` (disjoint) is the weighted mean of the calls over
each ``K_i``: with ``lse_i = log(sum_{j in K_i} exp(s_j))``,

    lse = log(sum_i exp(lse_i)),    out = sum_i exp(lse_i - lse) * out_i.

The sums are shifted by ``max_i lse_i`` (the log-sum-exp trick), so every weight lies in
[0, 1] and nothing overflows whatever the scores.  Each row is merged on its own (its
weights elementwise, its weighted sum one small product of its own), so a row's result does
not depend on the other rows passed with it: dask's chunking of the batch and heads leaves
its bits alone.
"""
import math
import operator

import numpy as np

from . import args as _args

__all__ = ["merge_attention"]


_dtype = operator.attrgetter("dtype")
_LOWEST = {np.dtype(t): np.finfo(t).min for t in (np.float32, np.float64)}


def _stack(items, name):
    """The partials stacked along a new axis 0 (a stacked array is taken as it is)."""
    try:
        n = len(items)
    except TypeError:
        raise TypeError(f"{name} must be a sequence of arrays, got {type(items).__name__}") from None
    if n == 0:
        raise ValueError(f"{name} must hold at least one partial result, got an empty sequence")
    if not isinstance(items, np.ndarray):
        # Checked before stacking, which would promote mixed dtypes silently.
        try:
            dtypes = list(map(_dtype, items))
        except AttributeError:                 # nested lists, scalars: their arrays' dtypes
            dtypes = [np.asarray(a).dtype for a in items]
        if dtypes.count(dtypes[0]) != n:
            i = next(i for i, dt in enumerate(dtypes) if dt != dtypes[0])
            raise TypeError(f"{name} must all have one dtype: {name}[0].dtype={dtypes[0]}, "
                            f"{name}[{i}].dtype={dtypes[i]}")
    try:
        stacked = np.asarray(items)
    except ValueError:
        stacked = np.empty(0, dtype=object)
    if stacked.dtype == object:                # partials of different shapes
        shapes = [np.shape(a) for a in items]
        i = next(i for i, s in enumerate(shapes) if s != shapes[0])
        raise ValueError(f"{name} must all have one shape: {name}[0].shape={shapes[0]}, "
                         f"{name}[{i}].shape={shapes[i]}")
    return stacked


def _check(outs, lses):
    """The partials stacked, their dtype and compute dtype; raises before any arithmetic."""
    # Native byte order, as everywhere: a big-endian partial is converted, one copy.
    outs = _args.as_array(_stack(outs, "outs"), "outs")
    lses = _args.as_array(_stack(lses, "lses"), "lses")
    if len(outs) != len(lses):
        raise ValueError(f"outs and lses must have the same length, got {len(outs)} outs "
                         f"and {len(lses)} lses")
    if outs.ndim < 2:
        raise ValueError("outs must be arrays of shape (..., Lq, Dv), got 0-d arrays")
    dtype = _args.storage_dtype(outs.dtype, "outs[0].dtype")
    compute = np.dtype(np.float32) if dtype.itemsize == 2 else dtype   # 16-bit: float32
    if lses.shape != outs.shape[:-1]:
        raise ValueError(f"lses must have shape out.shape[:-1] = {outs.shape[1:-1]}, got "
                         f"lses of shape {lses.shape[1:]} (outs of shape {outs.shape[1:]})")
    if lses.dtype != compute:
        raise TypeError(f"lses must have dtype {compute} (the compute dtype of outs of dtype "
                        f"{dtype}), got {lses.dtype}")
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
    n, rows, Dv = outs.shape[0], outs.shape[1:-1], outs.shape[-1]
    R = math.prod(rows)
    lse_all = lses.reshape(n, R)
    top = np.maximum.reduce(lse_all, axis=0)
    # Rows nobody sees (top = -inf) are shifted by the most negative finite number instead,
    # so that their weights come out as exp(-inf) = 0 rather than exp(-inf + inf) = NaN.
    w = np.subtract(lse_all, np.maximum(top, _LOWEST[compute]))
    np.exp(w, out=w)
    # The largest weight of a row someone sees is exp(0) = 1 exactly, so its total is >= 1
    # and max(total, 1) changes only the rows nobody sees (total 0: weights 0, lse -inf).
    total = np.maximum(np.add.reduce(w, axis=0), 1)
    w /= total
    lse = np.log(total)
    lse += top
    # One batched product, (R, 1, n) @ (R, n, Dv): each row's weighted sum of the partials
    # in a single call, reading the stacked partials and the weights through transposed
    # views (BLAS takes their strides).
    stacked = outs.reshape(n, R, Dv).astype(compute, copy=False).transpose(1, 0, 2)
    out = np.matmul(w.T[:, None, :], stacked).reshape(rows + (Dv,))
    return out.astype(dtype, copy=False), lse.reshape(rows)
