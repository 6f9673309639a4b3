"""Attention layers on the fused kernel: what a textbook builds by hand.

* ``self_attention`` -- one function: project ``x`` to queries, keys and values
  (a missing weight is the identity), attend, optionally project back.  With no
  weights and ``scale=1.0`` it is the classic "attention without learned weights".
* ``MultiHeadAttention`` -- a layer holding plain NumPy weights the user owns
  (and may assign), with grouped-query attention (``n_kv_heads < n_heads``),
  optional biases, optional rotary embeddings, and incremental decoding.
* ``KVCache`` (defined in ``fastattn._layers.cache``) -- the keys and values of the
  tokens seen so far, preallocated and grown geometrically, so that a decode step
  costs one projection of the new token and one kernel call over the cache, never a
  re-encoding of the prefix.

Every attention step is one call of ``fastattn.attention`` (the compiled
kernel).  Heads are NumPy views: a projection ``(..., L, H*d)`` is reshaped to
``(..., L, H, d)`` and transposed to ``(..., H, L, d)`` without copying, and the
kernel reads those strides directly.  Grouped-query attention passes the
``n_kv_heads`` key/value heads as they are; the kernel maps query head ``h`` to
key/value head ``h // (n_heads // n_kv_heads)``, so K and V are never repeated.

Decode API (one way): ``out, cache = mha(x_new, cache=cache)``.  Passing a
cache appends the new tokens' keys and values to it and attends the new queries
to everything cached; the cache is updated in place and returned.  Because the
kernel's result for a query row does not depend on how many other rows are in
the call, feeding a sequence token by token gives the same attention output,
bit for bit, as one causal call over the whole sequence (the projections agree
to float rounding, since BLAS may round a 1-row product differently).
"""

from __future__ import annotations

import math

import numpy as np

from ._calls import api as _api
from ._calls import args as _args
from ._layers.cache import KVCache
from ._serving.kvcache import attention_with_kvcache
from ._storage.quant import cache_dtype, check_block_dim
from ._layers.state_dict import layer_from_state_dict
from .positions import _check_base
from .positions import rope as _rope

__all__ = ["self_attention", "MultiHeadAttention", "KVCache"]


# ----------------------------------------------------------------------------
# self_attention
# ----------------------------------------------------------------------------

def _project(x, w, name):
    if w is None:
        return x  # identity: attention without learned weights
    w = _args.check_array(w, name)
    if w.ndim < 2 or w.shape[-2] != x.shape[-1]:
        raise ValueError(
            f"{name} must have shape (..., d_model, d) with d_model = {x.shape[-1]} "
            f"(x has shape {x.shape}), got {name} with shape {w.shape}"
        )
    return x @ w


def self_attention(x, w_q=None, w_k=None, w_v=None, w_o=None, *, scale=None, causal=False):
    """Self-attention of a sequence: ``attention(x @ w_q, x @ w_k, x @ w_v) @ w_o``.

    Parameters
    ----------
    x : array_like, (..., L, d_model)
        Token vectors; leading dims are batch dims.
    w_q, w_k : array_like, (d_model, d_k), optional
        Query and key projections; ``None`` is the identity (``d_k = d_model``).
    w_v : array_like, (d_model, d_v), optional
        Value projection, ``d_v`` may differ from ``d_k``; ``None`` is the identity.
    w_o : array_like, (d_v, d_out), optional
        Output projection applied after attention; ``None`` returns the context
        vectors ``(..., L, d_v)`` as they are.
    scale : float, optional
        Score scale; ``None`` is ``1/sqrt(d_k)``, ``1.0`` the unscaled dot
        product.
    causal : bool or "top-left"
        ``True``: token ``i`` attends to tokens ``j <= i`` (masked attention).

    Returns
    -------
    ndarray, shape (..., L, d_out or d_v)
        The dtype follows :func:`fastattn.attention` (integer inputs give float64).

    Notes
    -----
    Weights may carry leading batch dims that broadcast with ``x``'s, e.g.
    per-head weights ``w_q (H, d_model, d_k)`` give per-head contexts
    ``(H, L, d_v)``; broadcasting uses views, never copies.

    Examples
    --------
    >>> x = np.array([[1, 0, 1, 0], [0, 1, 0, 1], [1, 1, 1, 1]])
    >>> self_attention(x, scale=1.0)[0].round(8)
    array([0.93662106, 0.53168947, 0.93662106, 0.53168947])
    """
    x = _args.check_array(x, "x")
    if x.ndim < 2:
        raise ValueError(f"x must have shape (..., L, d_model), got shape {x.shape}")
    q = _project(x, w_q, "w_q")
    k = _project(x, w_k, "w_k")
    v = _project(x, w_v, "w_v")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(
            f"w_q and w_k must project to the same width d_k: queries have shape "
            f"{q.shape}, keys {k.shape}"
        )
    try:
        batch = np.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
    except ValueError:
        raise ValueError(
            f"batch dims of x {x.shape} and the weights do not broadcast: queries "
            f"{q.shape}, keys {k.shape}, values {v.shape}"
        ) from None
    # The kernel wants q, k, v with the same number of dims; broadcast_to gives
    # stride-0 views, so per-head weights never cause copies of shared keys.
    q, k, v = (np.broadcast_to(a, batch + a.shape[-2:]) for a in (q, k, v))
    out = _api.attention(q, k, v, scale=scale, causal=causal)
    if w_o is not None:
        w_o = _args.check_array(w_o, "w_o")
        if w_o.ndim < 2 or w_o.shape[-2] != out.shape[-1]:
            raise ValueError(
                f"w_o must have shape (..., d_v, d_out) with d_v = {out.shape[-1]}, "
                f"got w_o with shape {w_o.shape}"
            )
        out = out @ w_o
    return out


# ----------------------------------------------------------------------------
# MultiHeadAttention
# ----------------------------------------------------------------------------

def _split_heads(y, n_heads, d):
    # (..., L, H*d) -> (..., H, L, d): a reshape of a fresh matmul result plus a
    # transpose, both views; the kernel accepts the resulting strides.
    return np.swapaxes(y.reshape(y.shape[:-1] + (n_heads, d)), -2, -3)


def _merge_heads(o):
    # (..., H, L, dv) -> (..., L, H*dv); this one copies (the output projection
    # needs the heads side by side), O(L*H*dv), negligible next to attention.
    o = np.swapaxes(o, -2, -3)
    return o.reshape(o.shape[:-2] + (o.shape[-2] * o.shape[-1],))



def _quantized(kv_dtype):
    """Whether a layer's ``kv_dtype`` is a quantised format (q8_0, q4_0, fp8)."""
    return kv_dtype is not None and (isinstance(kv_dtype, str) or kv_dtype.itemsize == 1)


def _as_cached(k, v, kv_dtype, cache):
    """``k`` and ``v`` as a cache of the quantised ``kv_dtype`` gives them back (float32), so
    that a full pass attends over what decoding reads: fp8 with ``cache``'s scales, or
    1.0 without a cache (or with an empty one of no dtype, which takes those)."""
    scales = {}
    if cache is not None and cache.format == "fp8":
        scales = dict(zip(("k_scale", "v_scale"), cache.scales()))
    held = KVCache(capacity=max(k.shape[-2], 1), dtype=kv_dtype, **scales)
    held.append(k, v)
    return held.dequantized()

class MultiHeadAttention:
    """Multi-head self-attention with NumPy weights, GQA and a KV cache.

    Parameters
    ----------
    d_model : int
        Width of the token vectors (input and output).
    n_heads : int
        Number of query heads.
    n_kv_heads : int, optional
        Number of key/value heads (default ``n_heads``); must divide
        ``n_heads``.  ``1`` is multi-query attention, anything between is
        grouped-query attention.
    d_head : int, optional
        Width of each query/key head; default ``d_model // n_heads`` (then
        ``n_heads`` must divide ``d_model``).
    d_value : int, optional
        Width of each value head; default ``d_head``.
    bias : bool
        Create zero biases ``b_q, b_k, b_v, b_o``.
    dtype : floating dtype
        dtype of the initial weights (default float32).
    seed : int or numpy Generator, optional
        Seed of the weight initialisation.
    scale : float, optional
        Score scale; default ``1/sqrt(d_head)`` (``1.0`` gives unscaled
        scores).
    rope : bool
        Apply rotary embeddings (``fastattn.rope``, half-split convention) to
        queries and keys, at their absolute positions (cache-aware).
    rope_base : float
        Base of the rotary frequencies.
    window : (int, int), optional
        Sliding window ``(left, right)`` of every call (Mistral: ``(W - 1, 0)`` with
        ``causal=True``), as in ``fastattn.attention``.
    softcap : float, optional
        Score softcapping ``softcap * tanh(s / softcap)`` (Gemma 2).
    sinks : bool
        Create per-head attention-sink logits ``sinks`` (zeros; gpt-oss), assignable like
        the weights.
    kv_dtype : dtype, optional
        Store keys and values at this precision (float16, or bfloat16 with
        ``ml_dtypes``): they are rounded to it after the projection and rotary
        embedding, with a cache or without (so a cached decode step reproduces the
        full forward pass), and an empty ``KVCache`` without a dtype of its own takes
        it.  Attention still computes in float32; the cache takes half the memory.
        ``"q8_0"`` and ``"q4_0"`` store llama.cpp's 8- and 4-bit blocks (``d_head``
        and ``d_value`` multiples of 32; 1.0625 and 0.5625 bytes a value), and
        ``"float8_e4m3fn"`` / ``"float8_e5m2"`` fp8 (one byte a value; an empty cache
        takes the scales 1.0, vLLM's default; a ``KVCache`` may bring its own): keys and
        values are quantised and dequantised the same way with a cache or without (the
        full pass with the scales 1.0), and a cached step attends through
        :func:`fastattn.attention_with_kvcache` (no ``mask``).

    Attributes
    ----------
    w_q : ndarray, (d_model, n_heads * d_head)
        Query projection. The weights are plain arrays: assign your own trained ones.
    w_k : ndarray, (d_model, n_kv_heads * d_head)
        Key projection.
    w_v : ndarray, (d_model, n_kv_heads * d_value)
        Value projection.
    w_o : ndarray, (n_heads * d_value, d_model)
        Output projection.
    b_q, b_k, b_v, b_o : ndarray or None
        Matching 1-d biases (``bias=True``), or None.
    sinks : ndarray, (n_heads,), or None
        One sink logit per query head (``sinks=True``), or None.

    Notes
    -----
    Head ``h`` uses columns ``h*d_head:(h+1)*d_head`` of ``w_q`` (and likewise
    for the others), the layout of ``torch.nn.MultiheadAttention``.  The initial weights are drawn like
    ``torch.nn.Linear``'s default: uniform in ``±1/sqrt(fan_in)``, with
    ``fan_in = d_model`` for ``w_q, w_k, w_v`` and ``n_heads * d_value`` for
    ``w_o``; biases start at zero (as in ``torch.nn.MultiheadAttention``).

    A layer holds only its settings and NumPy arrays, so it pickles (to send a model to
    other processes, e.g. dask workers) and computes the same bits after unpickling.

    Examples
    --------
    >>> mha = MultiHeadAttention(64, 8, n_kv_heads=2, seed=0)
    >>> x = np.random.default_rng(1).standard_normal((2, 10, 64), dtype=np.float32)
    >>> y = mha(x, causal=True)                          # (2, 10, 64)
    >>> cache = KVCache()
    >>> rows = [mha(x[:, t:t+1], cache=cache)[0] for t in range(10)]
    >>> np.allclose(np.concatenate(rows, axis=1), y, atol=1e-5)
    True
    """

    def __init__(self, d_model, n_heads, *, n_kv_heads=None, d_head=None, d_value=None,
                 bias=False, dtype=np.float32, seed=None, scale=None, rope=False,
                 rope_base=10000.0, window=None, softcap=None, sinks=False, kv_dtype=None):
        d_model = _args.check_index(d_model, "d_model", 1)
        n_heads = _args.check_index(n_heads, "n_heads", 1)
        n_kv_heads = (n_heads if n_kv_heads is None
                      else _args.check_index(n_kv_heads, "n_kv_heads", 1))
        if n_heads % n_kv_heads:
            raise ValueError(f"n_kv_heads ({n_kv_heads}) must divide n_heads ({n_heads})")
        if d_head is None:
            if d_model % n_heads:
                raise ValueError(
                    f"n_heads ({n_heads}) must divide d_model ({d_model}) unless d_head is given"
                )
            d_head = d_model // n_heads
        d_head = _args.check_index(d_head, "d_head", 1)
        d_value = d_head if d_value is None else _args.check_index(d_value, "d_value", 1)
        dtype = np.dtype(dtype)
        if dtype.kind != "f":
            raise TypeError(f"dtype must be a floating dtype, got {dtype}")
        if rope and d_head % 2:
            raise ValueError(f"rope needs an even d_head, got d_head={d_head}")
        self.d_model, self.n_heads, self.n_kv_heads = d_model, n_heads, n_kv_heads
        self.d_head, self.d_value, self.dtype = d_head, d_value, dtype
        # The front end's and rope's checks: a clear error now, not at a call.
        self.scale = None if scale is None else _args.check_scale(scale, d_head)
        self.rope, self.rope_base = bool(rope), _check_base(rope_base)
        _args.check_window(window)
        self.window = None if window is None else tuple(int(w) for w in window)
        self.softcap = _args.check_softcap(softcap)
        self.sinks = np.zeros(n_heads, dtype) if sinks else None
        self.kv_dtype = None if kv_dtype is None else cache_dtype(kv_dtype, "kv_dtype")
        if isinstance(self.kv_dtype, str):
            check_block_dim(d_head, "d_head", (d_head,), self.kv_dtype)
            check_block_dim(d_value, "d_value", (d_value,), self.kv_dtype)

        rng = np.random.default_rng(seed)

        def uniform(fan_in, shape):
            bound = 1.0 / math.sqrt(fan_in)
            return rng.uniform(-bound, bound, size=shape).astype(dtype)

        self.w_q = uniform(d_model, (d_model, n_heads * d_head))
        self.w_k = uniform(d_model, (d_model, n_kv_heads * d_head))
        self.w_v = uniform(d_model, (d_model, n_kv_heads * d_value))
        self.w_o = uniform(n_heads * d_value, (n_heads * d_value, d_model))
        if bias:
            self.b_q = np.zeros(n_heads * d_head, dtype)
            self.b_k = np.zeros(n_kv_heads * d_head, dtype)
            self.b_v = np.zeros(n_kv_heads * d_value, dtype)
            self.b_o = np.zeros(d_model, dtype)
        else:
            self.b_q = self.b_k = self.b_v = self.b_o = None

    def __repr__(self):
        extra = "" if self.n_kv_heads == self.n_heads else f", n_kv_heads={self.n_kv_heads}"
        for name in ("window", "softcap"):
            if getattr(self, name) is not None:
                extra += f", {name}={getattr(self, name)!r}"
        if self.sinks is not None:
            extra += ", sinks=True"
        if self.kv_dtype is not None:
            extra += f", kv_dtype={getattr(self.kv_dtype, 'name', self.kv_dtype)}"
        return (f"MultiHeadAttention(d_model={self.d_model}, n_heads={self.n_heads}{extra}, "
                f"d_head={self.d_head}, d_value={self.d_value}, bias={self.b_q is not None}, "
                f"rope={self.rope})")

    # -- weights --------------------------------------------------------------
    def _weights(self):
        """The weights as arrays, checked against the layer's shapes (they are assignable)."""
        hq, hk = self.n_heads * self.d_head, self.n_kv_heads * self.d_head
        hv, ho = self.n_kv_heads * self.d_value, self.n_heads * self.d_value
        expected = {
            "w_q": (self.d_model, hq), "w_k": (self.d_model, hk),
            "w_v": (self.d_model, hv), "w_o": (ho, self.d_model),
            "b_q": (hq,), "b_k": (hk,), "b_v": (hv,), "b_o": (self.d_model,),
            "sinks": (self.n_heads,),
        }
        out = {}
        for name, shape in expected.items():
            w = getattr(self, name)
            if w is None and (name.startswith("b_") or name == "sinks"):
                out[name] = None
                continue
            w = _args.check_array(w, name)
            if w.shape != shape:
                raise ValueError(
                    f"{name} has shape {w.shape}, expected {shape} (d_model={self.d_model}, "
                    f"n_heads={self.n_heads}, n_kv_heads={self.n_kv_heads}, "
                    f"d_head={self.d_head}, d_value={self.d_value})"
                )
            out[name] = w
        return out

    @staticmethod
    def _linear(x, w, b):
        y = x @ w
        if b is not None:
            if np.result_type(y, b) == y.dtype:
                y += b       # y is a fresh array: add in place, no second temporary
            else:
                y = y + b    # e.g. integer weights with a float bias
        return y

    def _qkv(self, x, W, positions=None, cache=None):
        x = _args.check_array(x, "x")
        if x.ndim < 2 or x.shape[-1] != self.d_model:
            raise ValueError(
                f"x must have shape (..., L, d_model) with d_model={self.d_model}, got shape {x.shape}"
            )
        q = _split_heads(self._linear(x, W["w_q"], W["b_q"]), self.n_heads, self.d_head)
        k = _split_heads(self._linear(x, W["w_k"], W["b_k"]), self.n_kv_heads, self.d_head)
        v = _split_heads(self._linear(x, W["w_v"], W["b_v"]), self.n_kv_heads, self.d_value)
        if self.rope:
            q = _rope(q, positions, self.rope_base)
            k = _rope(k, positions, self.rope_base)
        if _quantized(self.kv_dtype):
            k, v = _as_cached(k, v, self.kv_dtype, cache)
        elif self.kv_dtype is not None:
            k = _args.store_as(k, self.kv_dtype, "k")
            v = _args.store_as(v, self.kv_dtype, "v")
        return q, k, v

    def _out(self, o, W):
        return self._linear(_merge_heads(o), W["w_o"], W["b_o"])

    def _attention_kwargs(self, W):
        # The keywords of fastattn.attention that come from the layer itself.
        return dict(scale=self.scale, window=self.window, softcap=self.softcap,
                    sinks=W["sinks"])

    @staticmethod
    def _positions(positions, batch, L):
        # Explicit rotary positions of the L rows: (*batch, L) or (L,), as (*batch, 1, L).
        p = _args.as_array(positions, "positions")
        if p.dtype.kind not in "iu":
            raise TypeError(f"positions must be an integer array, got dtype {p.dtype}")
        try:
            p = np.broadcast_to(p, batch + (L,))
        except ValueError:
            raise ValueError(f"positions of shape {p.shape} does not broadcast to (..., L) = "
                             f"{batch + (L,)}") from None
        return p[..., None, :]

    # -- forward --------------------------------------------------------------
    def __call__(self, x, *, causal=False, mask=None, kv_lengths=None, cache=None,
                 positions=None):
        """Apply the layer to ``x (..., L, d_model)``; returns ``(..., L, d_model)``.

        Without a cache, ``causal``, ``mask`` (broadcastable to
        ``(..., n_heads, L, L)``) and ``kv_lengths`` (batch shape) mean exactly
        what they mean for ``fastattn.attention``.  For a right-padded batch of
        causal sequences pass ``kv_lengths=lengths, causal="top-left"``
        (``causal=True`` aligns each sequence's *last* real key with the last
        row, the decoding convention).

        With ``cache=`` (a ``KVCache``), ``x`` holds the *new* tokens of each
        sequence.  Their keys and values are appended to the cache, the queries
        attend to all cached tokens, and ``(out, cache)`` is returned (the same
        cache object, updated in place).  Then:

        * ``causal=True`` lets new token ``i`` see the cache plus new tokens
          ``<= i`` -- use it for a multi-token prompt; for a single token it
          changes nothing.  ``causal="top-left"`` is refused.
        * ``kv_lengths`` (batch shape, optional) is the number of real tokens
          among the ``L`` rows of ``x`` for each sequence (right padding, e.g.
          prompts of different lengths); each sequence grows by that much.
          Output rows of padding tokens are unspecified.
        * ``mask`` must broadcast to ``(..., n_heads, L, Lk)``, ``Lk`` being
          the longest cached sequence after the append.
        * with ``rope=True``, new token ``i`` of sequence ``b`` gets position
          ``cache.lengths[b] + i``.

        ``positions`` (integers, broadcastable to ``(..., L)``) gives the rotary positions
        of the rows explicitly, e.g. ``arange(L) - pad[b]`` for a left-padded batch; by
        default they are ``0 .. L-1``, after the cached tokens with a cache.  The layer's
        ``window``, ``softcap`` and ``sinks`` apply to every call.
        """
        W = self._weights()
        if cache is None:
            return self._forward(x, W, causal, mask, kv_lengths, positions)
        return self._decode_step(x, W, cache, causal, mask, kv_lengths, positions), cache

    def _forward(self, x, W, causal, mask, kv_lengths, positions):
        # The whole sequence at once: one kernel call over its own keys.
        x = _args.check_array(x, "x")
        pos = None
        if positions is not None and self.rope and x.ndim >= 2:
            pos = self._positions(positions, x.shape[:-2], x.shape[-2])
        q, k, v = self._qkv(x, W, pos)
        o = _api.attention(q, k, v, causal=causal, mask=mask, kv_lengths=kv_lengths,
                           **self._attention_kwargs(W))
        return self._out(o, W)

    def _decode_step(self, x, W, cache, causal, mask, kv_lengths, positions):
        # New tokens: their keys and values join the cache, their queries attend to it.
        self._check_cache(cache, causal, mask)
        x = _args.check_array(x, "x")
        L = x.shape[-2] if x.ndim >= 2 else 0
        batch = x.shape[:-2]
        if cache.batch_shape is not None and cache.batch_shape != batch:
            raise ValueError(
                f"x has batch shape {batch} but the cache holds batch shape {cache.batch_shape}"
            )
        if self.rope:
            positions = self._cached_positions(positions, cache.lengths, batch, L)
        else:
            positions = None
        q, k, v = self._qkv(x, W, positions, cache)
        new = KVCache._new_counts(kv_lengths, L, batch, "kv_lengths")
        # An empty cache without a dtype takes k's and v's, which _qkv gave kv_dtype (a
        # quantised format, whose rows _qkv gives as float32, is handed over by name).
        if _quantized(self.kv_dtype):
            cache._take_dtype(self.kv_dtype)
        old = cache.append(k, v, lengths=new)
        # Causal alignment is bottom-right: the L queries must be the last L keys the
        # kernel sees, so padded rows count as keys (the real queries cannot see them,
        # being before them).  Without causality only the real keys may exist.
        seen = old + L if causal or self.window is not None else old + new
        lk = int(seen.max(initial=0))
        keys, values = cache.keys_values(lk)
        if cache.quantized:
            o = self._attend_quantized(q, cache, lk, seen, causal, W)
        else:
            lengths = None if seen.size == 0 or np.all(seen == lk) else seen
            o = _api.attention(q, keys, values, causal=bool(causal), mask=mask,
                               kv_lengths=lengths, **self._attention_kwargs(W))
        return self._out(o, W)

    def _attend_quantized(self, q, cache, lk, seen, causal, W):
        # The serving call over the cache's stored rows and scales, the batch flattened.
        (keys, values), (k_scale, v_scale) = cache.keys_values(lk), cache.scales(lk)
        flat = lambda a: a.reshape((-1,) + a.shape[-3:])
        if cache.format != "fp8":                 # block scales, one row per key
            k_scale, v_scale = flat(k_scale), flat(v_scale)
        o = attention_with_kvcache(flat(q), flat(keys), flat(values), k_scale=k_scale,
                                   v_scale=v_scale, cache_seqlens=seen.reshape(-1),
                                   causal=bool(causal), **self._attention_kwargs(W))
        return o.reshape(q.shape[:-1] + (o.shape[-1],))

    def _check_cache(self, cache, causal, mask=None):
        if not isinstance(cache, KVCache):
            raise TypeError(f"cache must be a fastattn.KVCache, got {type(cache).__name__}")
        if self.kv_dtype is not None and cache.dtype is not None and cache.dtype != self.kv_dtype:
            raise ValueError(f"the cache stores {cache.dtype} but this layer's kv_dtype is "
                             f"{self.kv_dtype}: pass an empty KVCache or one of that dtype")
        if isinstance(causal, str):
            raise ValueError(
                f"causal={causal!r} cannot be used with a cache (the cached tokens precede the "
                "new ones); use causal=True"
            )
        if mask is not None and (cache.quantized or _quantized(self.kv_dtype)):
            raise ValueError("mask is not taken with a quantised cache (attention_with_kvcache "
                             "has none): use causal, window or kv_lengths")

    def _cached_positions(self, positions, old, batch, L):
        # Absolute rotary positions of the new rows, (*batch, 1, L) broadcast over heads:
        # by default right after each sequence's cached tokens.
        if positions is None:
            return np.broadcast_to(old, batch)[..., None, None] + np.arange(L)
        return self._positions(positions, batch, L)

    def attention_weights(self, x, *, causal=False, mask=None, kv_lengths=None):
        """Per-head attention probabilities ``(..., n_heads, L, L)`` for ``x`` (for inspection/plots)."""
        W = self._weights()
        q, k, _ = self._qkv(x, W)
        return _api.attention_weights(q, k, causal=causal, mask=mask, kv_lengths=kv_lengths,
                                      **self._attention_kwargs(W))

    # -- interop --------------------------------------------------------------
    @classmethod
    def from_torch_state_dict(cls, state_dict, n_heads, *, prefix="", dtype=None, **kwargs):
        """Build a layer from a ``torch.nn.MultiheadAttention`` state dict.

        ``state_dict`` maps names to arrays (NumPy arrays, lists, or CPU torch
        tensors -- torch is not imported).  Keys used: ``in_proj_weight``
        ``(3E, E)`` or ``q_proj_weight/k_proj_weight/v_proj_weight`` ``(E, E)``,
        optional ``in_proj_bias``, ``out_proj.weight``, optional
        ``out_proj.bias``; ``prefix`` is prepended to each (e.g. ``"attn."``).
        torch computes ``x @ W.T + b``, so ``w_q = W_q.T``.  The result matches
        torch's module applied to ``(..., L, E)`` with ``batch_first=True``
        (transpose for the default ``(L, N, E)`` layout).  ``dtype`` defaults
        to the arrays' floating dtype; extra keywords (e.g. ``rope``) go to the
        constructor.

        Examples
        --------
        With torch installed:

        >>> import torch
        >>> m = torch.nn.MultiheadAttention(16, 4, batch_first=True)
        >>> mha = MultiHeadAttention.from_torch_state_dict(m.state_dict(), n_heads=4)
        >>> x = torch.randn(2, 5, 16)
        >>> want = m(x, x, x, need_weights=False)[0].detach().numpy()
        >>> np.allclose(mha(x.numpy()), want, rtol=1e-4, atol=1e-5)
        True
        """
        return layer_from_state_dict(cls, state_dict, n_heads, prefix=prefix, dtype=dtype,
                                     **kwargs)
