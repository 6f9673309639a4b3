"""Gradients of attention: the front end of the compiled backward pass.

The arguments of the forward call are checked by the forward's own validation (``_Call``
and the functions of ``_variants``); :func:`_check_forward_result` adds the backward's
checks on ``dout``, ``out``, ``lse`` and ``dlse``.  The kernel (src/_backward.pxi) writes
dq, dk, dv over the full broadcast batch in the compute dtype, and Delta; here batch
dimensions that an input broadcast are summed (one fixed order, NumPy's reduction over
C-contiguous axes), 16-bit gradients rounded once, and the sinks' gradient computed from
Delta: with ``lse`` including the sink, ``dsink = -sum_i exp(sink - lse_i) Delta_i``.
"""
import numpy as np

from . import _threads, _variants
from ._api import _Call, _as_array, _causal, _kernel_ready, _scale, _window
from ._dispatch import kernel as _kernel

__all__ = ["attention_backward", "attention_varlen_backward"]


def _check_forward_result(out_shape, out_dtype, lse_dtype, dout, out, lse, dlse):
    """``dout, out, lse, dlse`` as arrays, each with the shape and dtype the forward call
    gives ``out`` (dout, out) or ``lse`` (lse, dlse; dlse may be None)."""
    lse_shape = out_shape[:-1]
    checked = []
    for name, a, shape, dtype, of in (("dout", dout, out_shape, out_dtype, "out"),
                                      ("out", out, out_shape, out_dtype, "out"),
                                      ("lse", lse, lse_shape, lse_dtype, "lse"),
                                      ("dlse", dlse, lse_shape, lse_dtype, "lse")):
        if a is None and name == "dlse":
            checked.append(None)
            continue
        a = _as_array(a, name)
        if a.shape != shape:
            raise ValueError(f"{name} must have the shape of the forward's {of}, {shape} for "
                             f"these q, k, v; got {a.shape}")
        if a.dtype != dtype:
            raise TypeError(f"{name} must have the dtype of the forward's {of}, {dtype}; "
                            f"got {a.dtype}")
        checked.append(a)
    return checked


def _grad_dtype(a, cdt):
    """A gradient's dtype: its input's, or the compute dtype for integer or bool input."""
    return a.dtype if a.dtype.kind == "f" or _variants.is_16bit(a.dtype) else cdt


def _reduce_to(g, shape, dtype):
    """The gradient g of an input of ``shape`` that broadcast to g's shape: summed over the
    broadcast axes, then rounded once to ``dtype``."""
    lead = g.ndim - len(shape)
    axes = tuple(range(lead)) + tuple(
        lead + d for d, n in enumerate(shape) if n == 1 and g.shape[lead + d] != 1)
    if axes:
        g = np.add.reduce(g, axis=axes, keepdims=True)
    g = g.reshape(shape)
    return g if g.dtype == dtype else _variants.round_to(g, dtype)


def _dsinks(sinks, lse, delta, shape, cdt):
    """-sum over rows of exp(sink - lse) Delta, per (batch element, head), as ``shape``;
    rows that saw nothing and no sink (lse = -inf) count 0."""
    sink = np.asarray(sinks, dtype=np.float64)[..., None]
    lse = lse.astype(np.float64)
    with np.errstate(over="ignore", invalid="ignore"):
        w = np.where(np.isneginf(lse), 0.0, np.exp(sink - np.where(np.isneginf(lse), 0, lse)))
    g = -np.add.reduce(w * delta, axis=-1)
    dtype = _grad_dtype(np.asarray(sinks), np.dtype(np.float64))
    return _reduce_to(g.astype(cdt), shape, dtype)


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
    call = _Call(q, k, v, scale, causal, window, mask, kv_lengths, None, False, softcap,
                 alibi_slopes, sinks, q_lengths)
    cdt = call.compute_dtype
    dout, out, lse, dlse = _check_forward_result(call.result_shape(call.Dv), call.result_dtype,
                                                 cdt, dout, out, lse, dlse)
    batch, Hq, Hkv, Lq, Lk = call.batch, call.Hq, call.Hkv, call.Lq, call.Lk
    o_shape = batch + (Hq, Lq, call.Dv)
    dout, out = (_kernel_ready(a.reshape(o_shape), cdt) for a in (dout, out))
    lse, dlse = (None if a is None else np.ascontiguousarray(a.reshape(batch + (Hq, Lq)), cdt)
                 for a in (lse, dlse))
    qk, kk, vk = (_kernel_ready(a, cdt) for a in (call.q, call.k, call.v))
    dq = np.empty(batch + (Hq, Lq, call.D), cdt)
    dk = np.empty(batch + (Hkv, Lk, call.D), cdt)
    dv = np.empty(batch + (Hkv, Lk, call.Dv), cdt)
    delta = np.empty(batch + (Hq, Lq), cdt)
    _kernel.backward(qk, kk, vk, out, dout, lse, delta, dq, dk, dv, call.kernel_mask(),
                     call.mask_kind, batch, call.kv_len_flat(), call.causal, call.wl, call.wr,
                     call.scale, _threads.get_num_threads(), call.softcap or 0.0, call.alibi,
                     call.sinks, call.q_len, dlse)
    grads = []
    for g, a in ((dq, call.q), (dk, call.k), (dv, call.v)):
        g = _reduce_to(g, a.shape, _grad_dtype(a, cdt))
        grads.append(g[0] if call.squeeze_heads else g)
    if call.sinks is not None:
        sink_arr = np.asarray(sinks)
        grads.append(_dsinks(call.sinks.reshape(batch + (Hq,)), lse, delta, sink_arr.shape,
                             cdt))
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
    arrays = {"q": _as_array(q, "q"), "k": _as_array(k, "k"), "v": _as_array(v, "v")}
    Hq, Hkv, total_q, total_k, D, Dv = _variants.check_varlen_shapes(*arrays.values())
    cu_q, cu_k = _variants.check_cu_seqlens(cu_seqlens_q, cu_seqlens_k, total_q, total_k)
    n_seq = cu_q.shape[0] - 1
    cdt, rdt = _variants.dtypes(**arrays)
    sc = _scale(scale, D)
    causal_mode = _causal(causal)
    wl, wr = _window(window)
    cap = _variants.check_softcap(softcap)
    slopes = _variants.check_alibi_slopes(alibi_slopes, (), Hq)
    sink = _variants.check_sinks(sinks, (), Hq)
    dout, out, lse, dlse = _check_forward_result((Hq, total_q, Dv), rdt, cdt, dout, out, lse,
                                                 dlse)
    per_seq = lambda a: None if a is None else np.ascontiguousarray(np.broadcast_to(a, (n_seq, Hq)))
    dout, out = (_kernel_ready(a, cdt) for a in (dout, out))
    lse, dlse = (None if a is None else np.ascontiguousarray(a, cdt) for a in (lse, dlse))
    qk, kk, vk = (_kernel_ready(a, cdt) for a in arrays.values())
    dq = np.zeros((Hq, total_q, D), cdt)
    dk = np.zeros((Hkv, total_k, D), cdt)
    dv = np.zeros((Hkv, total_k, Dv), cdt)
    delta = np.zeros((Hq, total_q), cdt)
    _kernel.backward_packed(qk, kk, vk, out, dout, lse, delta, dq, dk, dv, cu_q, cu_k,
                            causal_mode, wl, wr, sc, _threads.get_num_threads(), cap or 0.0,
                            per_seq(slopes), per_seq(sink), dlse)
    grads = [_reduce_to(g, a.shape, _grad_dtype(a, cdt)) for g, a in zip((dq, dk, dv),
                                                                         arrays.values())]
    if sink is not None:
        grads.append(_dsinks(sink.reshape(Hq), lse, delta, np.shape(sinks), cdt))
    return tuple(grads)
