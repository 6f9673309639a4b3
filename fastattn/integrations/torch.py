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

Each is a ``torch.library`` custom operator (``torch.ops.fastattn.attention``,
``torch.ops.fastattn.attention_with_kvcache``; see :mod:`fastattn.integrations._ops`), so
``torch.compile(..., fullgraph=True)`` keeps calls to them in its graph, forward and
backward.  The forward keeps the ``lse`` that :func:`fastattn.attention` returns, and the
backward is the operator ``fastattn::attention_backward``, :func:`fastattn.attention_backward`,
which recomputes the probabilities from it tile by tile.  Gradients flow to q, k, v,
``sinks`` (when given as a tensor) and through ``lse``; masks, ALiBi slopes and lengths are
constants.  Tensors are handed to fastattn as NumPy views of the same memory wherever the
dtype allows (float32, float64, float16, and bfloat16 with ``ml_dtypes`` installed), and
the result of :func:`attention` is written in place: a tensor ``(..., Hq, Lq, Dv)`` laid out
``(..., Lq, Hq, Dv)`` in memory, as torch's own CPU attention returns it.

Mixed dtypes follow :func:`fastattn.attention`: the call is computed in the promoted
dtype (``torch.promote_types``; a float64 ``q`` with float32 ``k``, ``v`` is computed in
float64) and ``out`` comes in it; each gradient comes in its input's dtype.  (torch's own
SDPA refuses mixed dtypes.)

float32 calls compute as :func:`fastattn.set_float32_precision` says (exact float32 unless
you opt in), whatever ``torch.set_float32_matmul_precision`` says.

What these functions do not take, they refuse with an error rather than guess: tensors
not on the CPU, ``dropout_p > 0``, a mask (or any other keyword tensor) that requires
gradients, and a second derivative: a backward with ``create_graph=True`` through them
raises ``NotImplementedError``, since fastattn's backward is not itself differentiable.

torch is imported when a function is first called, never by importing this module.
"""
import numbers

import numpy as np

from .._calls import args as _args

__all__ = ["attention", "attention_with_kvcache", "scaled_dot_product_attention"]

# The keywords of fastattn.attention that the operation takes besides sinks and return_lse.
_KEYWORDS = ("scale", "causal", "window", "mask", "kv_lengths", "q_lengths", "softcap",
             "alibi_slopes")


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

    from . import _ops

    if "out" in keywords:
        raise TypeError("out is not taken by the torch operation (autograd owns its results)")
    unknown = sorted(set(keywords) - set(_KEYWORDS))
    if unknown:
        raise TypeError(f"attention() got unexpected keyword arguments {unknown}")
    _check_tensors(torch, q=q, k=k, v=v)
    for name, value in keywords.items():
        _refuse_grad(torch, name, value)
    if sinks is not None and not torch.is_tensor(sinks):
        sinks = torch.as_tensor(np.asarray(sinks, dtype=np.float64))
    out, lse = _ops.call_attention(q, k, v, sinks=sinks, **_arguments(torch, **keywords))
    return (out, lse) if return_lse else out


def attention_with_kvcache(q, k_cache, v_cache, k=None, v=None, **keywords):
    """:func:`fastattn.attention_with_kvcache` on torch tensors (inference: no gradient).

    ``q``, ``k``, ``v`` are float32, float64, float16 or bfloat16 CPU tensors; the caches
    (and ``k_scale``/``v_scale``) are CPU tensors that are written in place through NumPy
    views of their memory -- int8 (q8_0) or uint8 (q4_0, ``D // 2`` bytes a row) with
    float16 scales, or ``torch.float8_e4m3fn`` / ``float8_e5m2`` (fp8) with float32 scales
    of shape ``()`` or ``(Hkv,)``.  bfloat16 and fp8 need ``ml_dtypes``.  The other keywords (``cache_seqlens``, ``block_table``, rotary tables,
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

    from . import _ops

    if "out" in keywords:
        raise TypeError("out is not taken by the torch operation (it returns a new tensor)")
    return_lse = _args.check_flag(keywords.pop("return_lse", False), "return_lse")
    _check_tensors(torch, **{n: t for n, t in (("q", q), ("k", k), ("v", v)) if t is not None})
    if any(t is not None and t.requires_grad for t in (q, k, v)) and torch.is_grad_enabled():
        raise RuntimeError("attention_with_kvcache computes no gradient: call it under "
                           "torch.no_grad() or torch.inference_mode()")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache),
                    ("k_scale", keywords.get("k_scale")), ("v_scale", keywords.get("v_scale"))):
        if t is None and name.endswith("_scale"):
            continue
        if not torch.is_tensor(t):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if not t.is_cpu:
            raise ValueError(f"{name} is on {t.device}: fastattn runs on CPU tensors")
    if "cache_seqlens" not in keywords:
        raise TypeError("attention_with_kvcache() missing the keyword argument 'cache_seqlens'")
    interleaved = _args.check_flag(keywords.pop("rotary_interleaved", False),
                                   "rotary_interleaved")
    arguments = _arguments(torch, **keywords)
    out, lse = _ops.call_attention_with_kvcache(
        q, k_cache, v_cache, arguments.pop("cache_seqlens"), k=k, v=v,
        rotary_interleaved=interleaved, **arguments)
    return (out, lse) if return_lse else out


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
    known = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
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


def _arguments(torch, causal=False, window=None, scale=None, softcap=None, **arrays):
    """The keywords of a call as the operators' schemas take them: ``causal`` as its
    string, ``window`` as a list, scalars as floats, arrays as CPU tensors (detached)."""
    arguments = {"causal": _args.check_causal(causal),
                 "window": None if window is None else list(_args.check_window(window)),
                 "scale": _real(scale, "scale"), "softcap": _real(softcap, "softcap")}
    for name, value in arrays.items():
        if value is None or name.endswith("_scale"):   # caches' scales: checked, in place
            arguments[name] = value
        elif torch.is_tensor(value):
            if not value.is_cpu:
                raise ValueError(f"{name} is on {value.device}: fastattn runs on CPU tensors")
            arguments[name] = value.detach()
        else:
            arguments[name] = torch.as_tensor(np.asarray(value))
    return arguments


def _real(value, name):
    """A real scalar keyword as a float (None stays None)."""
    if value is None:
        return None
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number or None, got {type(value).__name__}")
    return float(value)
