"""fastattn as differentiable torch operations on CPU tensors.

- :func:`scaled_dot_product_attention` is a drop-in for
  ``torch.nn.functional.scaled_dot_product_attention``: the same arguments and meaning
  (``is_causal`` aligned top-left, ``enable_gqa``, a boolean or additive ``attn_mask``,
  ``scale``).
- :func:`attention` is :func:`fastattn.attention` on tensors, with its keywords
  (bottom-right ``causal``, ``window``, lengths, ``softcap``, ``alibi_slopes``, ``sinks``)
  and ``lse`` returned with ``return_lse=True``.
- :func:`attention_with_kvcache` is :func:`fastattn.attention_with_kvcache` on tensors, for
  inference: the cache tensors are appended in place.

Both are ``torch.autograd.Function``\\ s: the forward keeps the ``lse`` that
:func:`fastattn.attention` returns, and the backward is :func:`fastattn.attention_backward`,
which recomputes the probabilities from it tile by tile.  Gradients flow to q, k, v,
``sinks`` (when given as a tensor) and through ``lse``; masks, ALiBi slopes and lengths are
constants.  Tensors are handed to fastattn as NumPy views of the same memory wherever the
dtype allows (float32, float64, float16, and bfloat16 with ``ml_dtypes`` installed).

Mixed dtypes follow :func:`fastattn.attention`: the call is computed in the promoted
dtype (``torch.promote_types``; a float64 ``q`` with float32 ``k``, ``v`` is computed in
float64) and ``out`` comes in it; each gradient comes in its input's dtype.  (torch's own
SDPA refuses mixed dtypes.)

What these functions do not take, they refuse with an error rather than guess: tensors
not on the CPU, ``dropout_p > 0``, a mask (or any other keyword tensor) that requires
gradients, and a second derivative: a backward with ``create_graph=True`` through them
raises ``NotImplementedError``, since fastattn's backward is not itself differentiable.

torch is imported when a function is first called, never by importing this module.
"""
import functools

import numpy as np

import fastattn

from . import _torch

__all__ = ["attention", "attention_with_kvcache", "scaled_dot_product_attention"]


def attention(q, k, v, *, return_lse=False, sinks=None, **keywords):
    """:func:`fastattn.attention` on torch tensors, differentiable.

    Parameters
    ----------
    q, k, v : torch.Tensor
        CPU tensors in fastattn's layout, ``(..., Hq, Lq, D)``, ``(..., Hkv, Lk, D)``,
        ``(..., Hkv, Lk, Dv)``, of float32, float64, float16 or bfloat16.
    return_lse : bool, optional
        Also return ``lse`` ``(..., Hq, Lq)`` (float32, or float64 for float64 inputs);
        it is differentiable too.
    sinks : torch.Tensor or array_like, optional
        One logit per head, broadcastable to ``(..., Hq)``; a tensor that requires grad
        gets its gradient.
    **keywords
        ``scale``, ``causal``, ``window``, ``mask``, ``kv_lengths``, ``q_lengths``,
        ``softcap``, ``alibi_slopes`` as in :func:`fastattn.attention` (tensors or
        arrays; masks, slopes and lengths are constants).

    Returns
    -------
    torch.Tensor, or (torch.Tensor, torch.Tensor) with ``return_lse=True``

    Examples
    --------
    >>> import torch                                                # doctest: +SKIP
    >>> q = torch.randn(2, 4, 16, 8, requires_grad=True)           # doctest: +SKIP
    >>> out = fastattn.integrations.torch.attention(q, q, q, causal=True)  # doctest: +SKIP
    >>> out.sum().backward()                                       # doctest: +SKIP
    """
    import torch

    if "out" in keywords:
        raise TypeError("out is not taken by the torch operation (autograd owns its results)")
    _check_tensors(torch, q=q, k=k, v=v)
    for name, value in keywords.items():
        _refuse_grad(torch, name, value)
    keywords = {name: _constant(torch, name, value) for name, value in keywords.items()}
    if sinks is not None and not torch.is_tensor(sinks):
        sinks = torch.as_tensor(np.asarray(sinks, dtype=np.float64))
    if _torch.needs_grad(torch, q, k, v, sinks):
        out, lse = _function().apply(q, k, v, sinks, keywords)
    else:
        # Nothing to differentiate: no autograd node, whose bookkeeping costs about as
        # much as a decode step's attention.
        out, lse = _forward(torch, q, k, v, sinks, keywords, return_lse)
    return (out, lse) if return_lse else out


def attention_with_kvcache(q, k_cache, v_cache, k=None, v=None, **keywords):
    """:func:`fastattn.attention_with_kvcache` on torch tensors (inference: no gradient).

    ``q``, ``k``, ``v`` are float32, float64, float16 or bfloat16 CPU tensors; the caches
    (and ``k_scale``/``v_scale``) are CPU tensors that are written in place through NumPy
    views of their memory -- int8 with float16 scales for q8_0.  bfloat16 needs
    ``ml_dtypes``.  The other keywords (``cache_seqlens``, ``block_table``, rotary tables,
    ``causal``, ...) take tensors or arrays.  Refuses a call that would need a gradient
    (an input that requires grad while grad mode is on).

    Returns a tensor of ``(B, Hq, Lq, Dv)``, and ``lse`` with ``return_lse=True``.

    Examples
    --------
    >>> import torch                                                       # doctest: +SKIP
    >>> k_cache = torch.zeros(2, 2, 64, 32); v_cache = torch.zeros_like(k_cache)  # doctest: +SKIP
    >>> q, k, v = torch.randn(2, 4, 1, 32), torch.randn(2, 2, 1, 32), torch.randn(2, 2, 1, 32)  # doctest: +SKIP
    >>> out = fastattn.integrations.torch.attention_with_kvcache(
    ...     q, k_cache, v_cache, k, v, cache_seqlens=torch.tensor([0, 5]))     # doctest: +SKIP
    """
    import torch

    if "out" in keywords:
        raise TypeError("out is not taken by the torch operation (it returns a new tensor)")
    _check_tensors(torch, **{n: t for n, t in (("q", q), ("k", k), ("v", v)) if t is not None})
    if _torch.needs_grad(torch, q, k, v):
        raise RuntimeError("attention_with_kvcache computes no gradient: call it under "
                           "torch.no_grad() or torch.inference_mode()")
    caches = {}
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache),
                    ("k_scale", keywords.pop("k_scale", None)),
                    ("v_scale", keywords.pop("v_scale", None))):
        if t is None:
            continue
        if not torch.is_tensor(t):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if not t.is_cpu:
            raise ValueError(f"{name} is on {t.device}: fastattn runs on CPU tensors")
        if t.dtype == torch.bfloat16 and _torch.bfloat16_dtype() is None:
            raise TypeError(f"{name} is bfloat16, which needs the ml_dtypes package to be "
                            "written in place (pip install ml_dtypes)")
        caches[name] = _torch.view(torch, t.detach())
    keywords = {name: _constant(torch, name, value) for name, value in keywords.items()}
    qa, ka, va = (_constant(torch, n, t) for n, t in (("q", q), ("k", k), ("v", v)))
    with _torch.from_torch(torch):
        res = fastattn.attention_with_kvcache(qa, caches["k_cache"], caches["v_cache"], ka, va,
                                              **{n: a for n, a in caches.items()
                                                 if n.endswith("_scale")}, **keywords)
    out, lse = res if keywords.get("return_lse") else (res, None)
    out_t = _tensor(torch, out, q.dtype)
    return (out_t, torch.from_numpy(lse)) if lse is not None else out_t


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0,
                                 is_causal=False, scale=None, enable_gqa=False):
    """``torch.nn.functional.scaled_dot_product_attention`` computed by fastattn.

    The same signature and semantics on CPU tensors: ``query (..., Hq, L, E)``,
    ``key (..., Hkv, S, E)``, ``value (..., Hkv, S, Ev)``; ``attn_mask`` boolean (True =
    may attend) or additive, broadcastable to ``(..., Hq, L, S)``; ``is_causal`` hides key
    ``j > i`` (top-left, as torch aligns it); ``scale`` defaults to ``1 / sqrt(E)``;
    ``enable_gqa`` lets ``Hq`` be a multiple of ``Hkv``.  Differentiable in query, key and
    value.  A row that sees no key gives zeros (as torch's CPU path does).

    Raises ``NotImplementedError`` for ``dropout_p > 0``, for a float ``attn_mask`` that
    requires gradients and for a backward with ``create_graph=True``; ``ValueError`` for
    ``attn_mask`` with ``is_causal=True`` and for ``Hq != Hkv`` without ``enable_gqa``, as
    torch does.  Unlike torch's, mixed dtypes are computed in the promoted dtype.

    Examples
    --------
    >>> import torch                                                # doctest: +SKIP
    >>> from fastattn.integrations.torch import scaled_dot_product_attention
    >>> q = torch.randn(1, 8, 128, 64, requires_grad=True)         # doctest: +SKIP
    >>> scaled_dot_product_attention(q, q, q, is_causal=True).sum().backward()  # doctest: +SKIP
    """
    import torch

    if dropout_p:
        raise NotImplementedError(f"fastattn computes no dropout: dropout_p must be 0, got {dropout_p}")
    if attn_mask is not None and is_causal:
        raise ValueError("attn_mask and is_causal=True cannot be given together (as in torch)")
    if query.dim() >= 3 and query.shape[-3] != key.shape[-3] and not enable_gqa:
        raise ValueError(
            f"query has {query.shape[-3]} heads and key {key.shape[-3]}: pass enable_gqa=True "
            f"for grouped-query attention (query.shape={tuple(query.shape)}, "
            f"key.shape={tuple(key.shape)})")
    _refuse_grad(torch, "attn_mask", attn_mask)
    return attention(query, key, value, scale=scale, mask=attn_mask,
                     causal="top-left" if is_causal else False)


# --------------------------------------------------------------------------- helpers

def _check_tensors(torch, **tensors):
    known = _torch.float_dtypes(torch)
    for name, t in tensors.items():
        if not torch.is_tensor(t):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if not t.is_cpu:
            raise ValueError(f"{name} is on {t.device}: fastattn runs on CPU tensors")
        if t.dtype not in known:
            raise TypeError(f"{name} must be float32, float64, float16 or bfloat16, got {t.dtype}")


def _refuse_grad(torch, name, value):
    """Refuse a keyword tensor that would need a gradient: masks, slopes and lengths are
    constants to fastattn, and a silently missing gradient is a wrong one."""
    if torch.is_tensor(value) and value.requires_grad and torch.is_grad_enabled():
        raise NotImplementedError(
            f"fastattn treats {name} as a constant: it computes no gradient for a {name} "
            f"that requires one (detach it, or compute it with torch)")


def _constant(torch, name, value):
    """A keyword's value as fastattn takes it: tensors as NumPy arrays (detached)."""
    if not torch.is_tensor(value):
        return value
    if not value.is_cpu:
        raise ValueError(f"{name} is on {value.device}: fastattn runs on CPU tensors")
    value = value.detach()
    if value.dtype == torch.bfloat16 and _torch.bfloat16_dtype() is None:
        value = value.float()
    return _torch.view(torch, value)


def _arrays(torch, *tensors):
    """NumPy views of detached CPU tensors, each in its own dtype, so that fastattn
    promotes a mix of dtypes as :func:`fastattn.attention` does (bfloat16 is upcast to a
    float32 copy when ``ml_dtypes`` is missing: the same compute dtype)."""
    arrays = []
    for t in tensors:
        t = t.detach() if t.requires_grad else t
        if t.dtype == torch.bfloat16 and _torch.bfloat16_dtype() is None:
            t = t.float()
        arrays.append(_torch.view(torch, t))
    return tuple(arrays)


def _result_dtype(torch, *tensors):
    """The dtype of ``out``: the inputs' own when they agree, else their promotion (with
    16-bit dtypes mixed, float32), as :func:`fastattn.attention`'s result."""
    return functools.reduce(torch.promote_types, (t.dtype for t in tensors))


def _tensor(torch, a, dtype):
    """The NumPy result ``a`` as a tensor of ``dtype`` (shared memory when it already is)."""
    t = _torch.tensor(torch, a)
    return t if t.dtype == dtype else t.to(dtype)


def _forward(torch, q, k, v, sinks, keywords, return_lse):
    """:func:`fastattn.attention` on the tensors: ``(out, lse)`` as tensors (lse None
    unless ``return_lse``)."""
    qa, ka, va = _arrays(torch, q, k, v)
    sinks_a = None if sinks is None else sinks.detach().double().numpy()
    with _torch.from_torch(torch):
        res = fastattn.attention(qa, ka, va, sinks=sinks_a, return_lse=return_lse, **keywords)
    out, lse = res if return_lse else (res, None)
    out = _tensor(torch, out, _result_dtype(torch, q, k, v))
    return out, None if lse is None else torch.from_numpy(lse)


@functools.lru_cache(maxsize=None)
def _function():
    """The autograd Function, built on first use (torch imported only then)."""
    import torch

    class Attention(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v, sinks, keywords):
            ctx.set_materialize_grads(False)
            out_t, lse_t = _forward(torch, q, k, v, sinks, keywords, True)
            ctx.save_for_backward(q, k, v, out_t, lse_t, sinks)
            ctx.keywords = keywords
            return out_t, lse_t

        @staticmethod
        def backward(ctx, dout, dlse):
            # Grad mode is on inside a backward exactly when it runs with create_graph=True:
            # the gradients would then have to be differentiable, and fastattn's are not.
            if torch.is_grad_enabled():
                raise NotImplementedError(
                    "fastattn's attention has no double backward: its gradients are not "
                    "differentiable, so a backward through it with create_graph=True (a "
                    "gradient penalty, a Hessian-vector product) is refused")
            q, k, v, out, lse, sinks = ctx.saved_tensors
            if dout is None:
                dout = torch.zeros_like(out)
            arrays = _arrays(torch, dout, q, k, v, out)
            with _torch.from_torch(torch):
                grads = fastattn.attention_backward(
                    *arrays, lse.numpy(),
                    dlse=None if dlse is None else dlse.detach().numpy(),
                    sinks=None if sinks is None else sinks.detach().double().numpy(),
                    **ctx.keywords)
            dq, dk, dv = (_tensor(torch, g, t.dtype) for g, t in zip(grads, (q, k, v)))
            dsinks = None if sinks is None else _tensor(torch, grads[3], sinks.dtype)
            return dq, dk, dv, dsinks, None

    return Attention
