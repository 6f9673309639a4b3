"""Gradients of attention: the front end of the compiled backward pass.

The arguments of the forward call are checked by the forward's own rules
(:class:`fastattn._calls.args.Problem`), and ``dout``, ``out``, ``lse`` and ``dlse`` by
:func:`fastattn._calls.args.check_forward_result`.  The kernel (src/pipeline/_backward.pxi) writes
dq, dk, dv over the full broadcast batch in the compute dtype, and Delta; here batch
dimensions that an input broadcast are summed (one fixed order, NumPy's reduction over
C-contiguous axes), 16-bit gradients rounded once, and the sinks' gradient computed from
Delta: with ``lse`` including the sink, ``dsink = -sum_i exp(sink - lse_i) Delta_i``.
That Delta is summed here in float64 from ``dout`` and ``out``: the kernel's, in the
compute dtype, rounds each row, and a sink's gradient adds up every row of its head.
"""
import numpy as np

from . import args as _args
from . import precision as _precision
from .._machine import threads as _threads
from .glue import kernel as _kernel
from .glue import kernel_mask, kernel_ready

__all__ = ["attention_backward", "attention_varlen_backward"]


def _reduce_to(g, shape, dtype):
    """The gradient g of an input of ``shape`` that broadcast to g's shape: summed over the
    broadcast axes, then rounded once to ``dtype``."""
    lead = g.ndim - len(shape)
    axes = tuple(range(lead)) + tuple(
        lead + d for d, n in enumerate(shape) if n == 1 and g.shape[lead + d] != 1)
    if axes:
        g = np.add.reduce(g, axis=axes, keepdims=True)
    g = g.reshape(shape)
    return g if g.dtype == dtype else _args.round_to(g, dtype)


def _delta64(dout, out, dlse):
    """Delta = rowsum(dout * out) - dlse of every row (the shape of dlse, out's without
    its last axis), in float64 (the products are exact), a chunk of rows at a time so
    that no float64 copy of dout is made; each row's sum is NumPy's pairwise one over
    that row alone, whatever the batch."""
    rows, Dv = out.shape[:-1], out.shape[-1]
    n = int(np.prod(rows))
    dout, out = dout.reshape(n, Dv), out.reshape(n, Dv)
    delta = np.empty(n, np.float64)
    step = max(1, 2**15 // max(Dv, 1))
    for s in range(0, n, step):
        # C order: a row's sum runs in the same order whatever the caller's layout.
        delta[s:s + step] = np.multiply(dout[s:s + step], out[s:s + step],
                                        dtype=np.float64, order="C").sum(axis=-1)
    delta = delta.reshape(rows)
    return delta if dlse is None else delta - dlse


def _dsinks(sinks, lse, delta, shape, sinks_dtype):
    """-sum over rows of exp(sink - lse) Delta (delta: _delta64's), per (batch element,
    head), as ``shape`` (the sinks argument's) in the gradient dtype of ``sinks_dtype``;
    rows that saw nothing and no sink (lse = -inf) count 0."""
    sink = np.asarray(sinks, dtype=np.float64)[..., None]
    lse = lse.astype(np.float64, order="C")      # the sum below in one order for any view
    none = np.isneginf(lse)
    delta = np.where(none, 0.0, delta.reshape(lse.shape))
    with np.errstate(over="ignore", invalid="ignore"):
        w = np.where(none, 0.0, np.exp(sink - np.where(none, 0, lse)))
    g = -np.add.reduce(w * delta, axis=-1)
    return _reduce_to(g, shape, _args.grad_dtype(sinks_dtype, np.float64))


def attention_backward(dout, q, k, v, out, lse, *, scale=None, causal=False, window=None,
                       mask=None, kv_lengths=None, q_lengths=None, softcap=None,
                       alibi_slopes=None, sinks=None, dlse=None):
    """Gradients of :func:`attention` with respect to q, k, v (and sinks).

    ``out, lse`` are what ``attention(q, k, v, return_lse=True, ...)`` returned for the
    same arguments and keywords; ``dout`` (out's shape and dtype) and ``dlse`` (optional,
    lse's) are the gradients of a loss with respect to them.  The probabilities are
    recomputed block by block from ``lse``: no ``Lq x Lk`` matrix is stored.

    Returns
    -------
    (dq, dk, dv), or (dq, dk, dv, dsinks) when ``sinks`` is given
        Each the shape and dtype of its input (integer inputs: the compute dtype); batch
        dimensions an input broadcast are summed over, and under GQA ``dk``/``dv`` of a
        kv head sum over the query heads that read it.  Rows and keys that are hidden or
        padding get zeros.  Bitwise identical whatever the thread count or batch size.
    """
    p = _args.Problem(q, k, v, scale=scale, causal=causal, window=window, mask=mask,
                      kv_lengths=kv_lengths, q_lengths=q_lengths, softcap=softcap,
                      alibi_slopes=alibi_slopes, sinks=sinks)
    cdt = p.compute_dtype
    dout, out, lse, dlse = _args.check_forward_result(
        p.result_shape(p.Dv), p.result_dtype, cdt, dout, out, lse, dlse)
    batch, Hq, Lq = p.batch, p.Hq, p.Lq
    delta64 = None if p.sinks is None else _delta64(dout, out, dlse)
    dout, out = (kernel_ready(a.reshape(batch + (Hq, Lq, p.Dv)), cdt) for a in (dout, out))
    lse, dlse = (None if a is None else np.ascontiguousarray(a.reshape(batch + (Hq, Lq)), cdt)
                 for a in (lse, dlse))
    q, k, v = (kernel_ready(a, cdt) for a in (p.q, p.k, p.v))
    q, k, v = _precision.backward_inputs(q, k, v, cdt, p.D, p.Dv)
    dq = np.empty(batch + (Hq, Lq, p.D), cdt)
    dk = np.empty(batch + (p.Hkv, p.Lk, p.D), cdt)
    dv = np.empty(batch + (p.Hkv, p.Lk, p.Dv), cdt)
    delta = np.empty(batch + (Hq, Lq), cdt)
    _kernel.backward(p, q=q, k=k, v=v, out=out, dout=dout, lse=lse, dlse=dlse, delta=delta,
                     dq=dq, dk=dk, dv=dv, mask=kernel_mask(p),
                     n_threads=_threads.get_num_threads())
    grads = []
    for g, a in ((dq, p.q), (dk, p.k), (dv, p.v)):
        g = _reduce_to(g, a.shape, _args.grad_dtype(a.dtype, cdt))
        grads.append(g[0] if p.squeeze_heads else g)
    if p.sinks is not None:
        grads.append(_dsinks(p.sinks.reshape(batch + (Hq,)), lse, delta64, np.shape(sinks),
                             _args.as_array(sinks, "sinks").dtype))
    return tuple(grads)


def attention_varlen_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, *,
                              scale=None, causal=False, window=None, softcap=None,
                              alibi_slopes=None, sinks=None, dlse=None):
    """Gradients of :func:`attention_varlen` with respect to q, k, v (and sinks).

    Arguments as for :func:`attention_varlen`, plus its ``out`` and ``lse`` and the
    gradients ``dout`` (``(Hq, total_q, Dv)``) and ``dlse`` (optional, ``(Hq, total_q)``).
    Returns ``(dq, dk, dv)`` or ``(dq, dk, dv, dsinks)``, each row with the bits of the
    same row from :func:`attention_backward` on its sequence alone.
    """
    p = _args.varlen_problem(q, k, v, cu_seqlens_q, cu_seqlens_k, scale=scale, causal=causal,
                             window=window, softcap=softcap, alibi_slopes=alibi_slopes,
                             sinks=sinks)
    cdt = p.compute_dtype
    dout, out, lse, dlse = _args.check_forward_result(
        (p.Hq, p.total_q, p.Dv), p.result_dtype, cdt, dout, out, lse, dlse)
    delta64 = None if p.sinks is None else _delta64(dout, out, dlse)
    dout, out = (kernel_ready(a, cdt) for a in (dout, out))
    lse, dlse = (None if a is None else np.ascontiguousarray(a, cdt) for a in (lse, dlse))
    q, k, v = (kernel_ready(a, cdt) for a in (p.q, p.k, p.v))
    q, k, v = _precision.backward_inputs(q, k, v, cdt, p.D, p.Dv)
    dq = np.zeros((p.Hq, p.total_q, p.D), cdt)
    dk = np.zeros((p.Hkv, p.total_k, p.D), cdt)
    dv = np.zeros((p.Hkv, p.total_k, p.Dv), cdt)
    delta = np.zeros((p.Hq, p.total_q), cdt)
    _kernel.backward(p, q=q, k=k, v=v, out=out, dout=dout, lse=lse, dlse=dlse, delta=delta,
                     dq=dq, dk=dk, dv=dv, mask=None, n_threads=_threads.get_num_threads())
    grads = [_reduce_to(g, a.shape, _args.grad_dtype(a.dtype, cdt))
             for g, a in zip((dq, dk, dv), (p.q, p.k, p.v))]
    if p.sinks is not None:
        grads.append(_dsinks(_args.check_sinks(sinks, (), p.Hq)[0], lse, delta64,
                             np.shape(sinks), _args.as_array(sinks, "sinks").dtype))
    return tuple(grads)
