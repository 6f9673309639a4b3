"""Attention layers on the fused kernel: what a textbook builds by hand.

* ``self_attention`` -- one function: project ``x`` to queries, keys and values
  (a missing weight is the identity), attend, optionally project back.  With no
  weights and ``scale=1.0`` it is the classic "attention without learned weights".
* ``MultiHeadAttention`` -- a layer holding plain NumPy weights the user owns
  (and may assign), with grouped-query attention (``n_kv_heads < n_heads``),
  optional biases, optional rotary embeddings, and incremental decoding.
* ``KVCache`` -- the keys and values of the tokens seen so far, preallocated and
  grown geometrically, so that a decode step costs one projection of the new
  token and one kernel call over the cache, never a re-encoding of the prefix.

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
import operator

import numpy as np

from . import _args
from .positions import rope as _rope

__all__ = ["self_attention", "MultiHeadAttention", "KVCache"]


def _kernel():
    # Imported lazily so that ``fastattn/__init__.py`` may import this module
    # before (or while) the compiled front-end loads, without a cycle.
    from . import _api

    return _api


def _positive_int(value, name):
    try:
        value = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an integer, got {type(value).__name__}") from None
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")
    return value


def _real_array(a, name):
    a = np.asarray(a)
    if a.dtype.kind not in "biuf" and not _args.is_bfloat16(a.dtype):
        raise TypeError(f"{name} must be a real numeric array, got dtype {a.dtype}")
    return a


# ----------------------------------------------------------------------------
# self_attention
# ----------------------------------------------------------------------------

def _project(x, w, name):
    if w is None:
        return x  # identity: attention without learned weights
    w = _real_array(w, name)
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

    Weights may carry leading batch dims that broadcast with ``x``'s, e.g.
    per-head weights ``w_q (H, d_model, d_k)`` give per-head contexts
    ``(H, L, d_v)``; broadcasting uses views, never copies.

    Returns
    -------
    ndarray, (..., L, d_out or d_v); the dtype follows ``fastattn.attention``
    (integer inputs give float64).

    Examples
    --------
    >>> x = np.array([[1, 0, 1, 0], [0, 1, 0, 1], [1, 1, 1, 1]])
    >>> self_attention(x, scale=1.0)[0].round(8)
    array([0.93662106, 0.53168947, 0.93662106, 0.53168947])
    """
    x = _real_array(x, "x")
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
    out = _kernel().attention(q, k, v, scale=scale, causal=causal)
    if w_o is not None:
        w_o = _real_array(w_o, "w_o")
        if w_o.ndim < 2 or w_o.shape[-2] != out.shape[-1]:
            raise ValueError(
                f"w_o must have shape (..., d_v, d_out) with d_v = {out.shape[-1]}, "
                f"got w_o with shape {w_o.shape}"
            )
        out = out @ w_o
    return out


# ----------------------------------------------------------------------------
# KVCache
# ----------------------------------------------------------------------------

class KVCache:
    """Keys and values of the tokens seen so far, for incremental decoding.

    Storage is ``(*batch, n_kv_heads, capacity, d)`` for keys and
    ``(*batch, n_kv_heads, capacity, d_value)`` for values.  The shapes are
    taken from the first ``append``; ``capacity`` rows are reserved then, and
    when an append does not fit the storage grows to
    ``max(needed, growth * capacity)`` (one copy, amortised O(1) per token).

    ``dtype`` (float16, bfloat16 -- ``ml_dtypes.bfloat16`` or the string
    ``"bfloat16"`` --, float32 or float64) is the storage dtype; by default it
    is the dtype of the first keys and values appended.  Keys and values of
    another dtype are rounded to it (to nearest, once) as they are appended; a
    finite value beyond its range (float16 stops at 65504) raises
    ``ValueError`` instead of being stored as inf.  A float16 or bfloat16
    cache holds half the bytes of a float32 one, and attention reads it in
    place, so a decode step streams half the memory.

    Each batch element has its own length (``lengths``, shape ``batch``), so
    sequences of different lengths share one cache: rows at or beyond a
    sequence's length are unused and may hold stale data.

    Normally you do not call ``append`` yourself: create an empty cache and
    pass it to ``MultiHeadAttention``::

        cache = KVCache(capacity=256)
        out, cache = mha(prompt, cache=cache, causal=True)   # prefill
        out, cache = mha(next_token, cache=cache)            # one decode step
    """

    def __init__(self, capacity=64, *, growth=2.0, dtype=None):
        self._initial_capacity = _positive_int(capacity, "capacity")
        growth = float(growth)
        if not growth > 1.0:
            raise ValueError(f"growth must be > 1, got {growth}")
        self._growth = growth
        self._dtype = None if dtype is None else _args.storage_dtype(dtype, "dtype")
        self.reset()

    @property
    def dtype(self):
        """The storage dtype (None until the first append when none was given)."""
        return self._dtype if self._k is None else self._k.dtype

    def reset(self):
        """Forget all tokens and release the storage."""
        self._k = None
        self._v = None
        self._lengths = None

    # -- read-only views ------------------------------------------------------
    @property
    def capacity(self):
        """Rows currently allocated per sequence (0 before the first append)."""
        return 0 if self._k is None else self._k.shape[-2]

    @property
    def lengths(self):
        """Number of tokens stored per batch element, int64 array of shape ``batch``."""
        if self._lengths is None:
            return np.zeros((), dtype=np.int64)
        view = self._lengths.view()
        view.flags.writeable = False
        return view

    @property
    def max_length(self):
        return 0 if self._lengths is None else int(self._lengths.max(initial=0))

    def __len__(self):
        return self.max_length

    @property
    def k(self):
        """Stored keys, a view ``(*batch, n_kv_heads, max_length, d)`` (None when empty)."""
        return None if self._k is None else self._k[..., : self.max_length, :]

    @property
    def v(self):
        """Stored values, a view ``(*batch, n_kv_heads, max_length, d_value)``."""
        return None if self._v is None else self._v[..., : self.max_length, :]

    @property
    def batch_shape(self):
        return None if self._k is None else self._k.shape[:-3]

    def __repr__(self):
        if self._k is None:
            dt = "" if self._dtype is None else f", dtype={self._dtype}"
            return f"KVCache(empty, capacity={self._initial_capacity}{dt})"
        *batch, h, cap, d = self._k.shape
        lengths = self._lengths
        ln = int(lengths) if lengths.ndim == 0 else lengths.tolist()
        return (f"KVCache(batch={tuple(batch)}, n_kv_heads={h}, d={d}, "
                f"d_value={self._v.shape[-1]}, lengths={ln}, capacity={cap}, dtype={self._k.dtype})")

    # -- writing --------------------------------------------------------------
    @staticmethod
    def _new_counts(lengths, L, batch, name="lengths"):
        if lengths is None:
            return np.full(batch, L, dtype=np.int64)
        n = np.asarray(lengths)
        if n.dtype.kind not in "biu":
            raise TypeError(f"{name} must be integers, got dtype {n.dtype}")
        try:
            n = np.broadcast_to(n, batch).astype(np.int64)
        except ValueError:
            raise ValueError(
                f"{name} of shape {n.shape} does not broadcast to the batch shape {batch}"
            ) from None
        if n.size and (n.min() < 0 or n.max() > L):
            raise ValueError(
                f"{name} must be in [0, {L}] (the number of new rows of x), got {n.tolist()}"
            )
        return n

    def append(self, k, v, lengths=None):
        """Append new keys ``(*batch, n_kv_heads, L, d)`` and values ``(..., L, d_value)``.

        Sequence ``b`` receives the rows at its current end; ``lengths[b]``
        (default ``L``) says how many of the ``L`` new rows are real tokens
        (right padding), and the sequence's length grows by that much.
        Returns the lengths before the append (the positions of the new rows).
        """
        k = _real_array(k, "k")
        v = _real_array(v, "v")
        if k.ndim < 3:
            raise ValueError(f"k must have shape (..., n_kv_heads, L, d), got shape {k.shape}")
        if v.ndim != k.ndim or v.shape[:-1] != k.shape[:-1]:
            raise ValueError(
                f"v must have shape {k.shape[:-1] + ('d_value',)} to match k {k.shape}, "
                f"got v with shape {v.shape}"
            )
        batch, L = k.shape[:-3], k.shape[-2]
        if self._k is None:
            dtype = self._dtype if self._dtype is not None else _args.dtypes(k=k, v=v)[1]
        elif k.shape[:-2] != self._k.shape[:-2] or k.shape[-1] != self._k.shape[-1] \
                or v.shape[-1] != self._v.shape[-1]:
            raise ValueError(
                f"k {k.shape} / v {v.shape} do not match the cache's keys "
                f"{self._k.shape[:-2] + ('L', self._k.shape[-1])} / values "
                f"{self._v.shape[:-2] + ('L', self._v.shape[-1])}"
            )
        else:
            dtype = self._k.dtype
        new = self._new_counts(lengths, L, batch)
        # Rounded (and checked for overflow) before anything is allocated or written.
        k = _args.store_as(k, dtype, "k")
        v = _args.store_as(v, dtype, "v")
        if self._k is None:
            cap = max(self._initial_capacity, L)
            h = k.shape[-3]
            self._k = np.empty(batch + (h, cap, k.shape[-1]), dtype=dtype)
            self._v = np.empty(batch + (h, cap, v.shape[-1]), dtype=dtype)
            self._lengths = np.zeros(batch, dtype=np.int64)
        old = self._lengths.copy()
        needed = int(old.max(initial=0)) + L   # every row is written, padding included
        if needed > self.capacity:
            self._grow(needed)
        if old.size == 0 or L == 0:
            pass
        elif np.all(old == old.flat[0]):
            start = int(old.flat[0])
            self._k[..., start:start + L, :] = k
            self._v[..., start:start + L, :] = v
        else:
            # Different lengths per sequence: scatter each sequence's rows at its own end.
            h = self._k.shape[-3]
            kb = self._k.reshape((-1,) + self._k.shape[-3:])
            vb = self._v.reshape((-1,) + self._v.shape[-3:])
            rows = (old.reshape(-1)[:, None] + np.arange(L))[:, None, :]      # (nb, 1, L)
            bi = np.arange(kb.shape[0])[:, None, None]
            hi = np.arange(h)[None, :, None]
            kb[bi, hi, rows] = k.reshape(kb.shape[:2] + (L, k.shape[-1]))
            vb[bi, hi, rows] = v.reshape(vb.shape[:2] + (L, v.shape[-1]))
        self._lengths = np.asarray(old + new, dtype=np.int64)   # stays an array when batch == ()
        return old

    def _grow(self, needed):
        cap = max(needed, math.ceil(self.capacity * self._growth))
        used = self.max_length
        for name in ("_k", "_v"):
            buf = getattr(self, name)
            grown = np.empty(buf.shape[:-2] + (cap, buf.shape[-1]), dtype=buf.dtype)
            grown[..., :used, :] = buf[..., :used, :]
            setattr(self, name, grown)


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
        d_model = _positive_int(d_model, "d_model")
        n_heads = _positive_int(n_heads, "n_heads")
        n_kv_heads = n_heads if n_kv_heads is None else _positive_int(n_kv_heads, "n_kv_heads")
        if n_heads % n_kv_heads:
            raise ValueError(f"n_kv_heads ({n_kv_heads}) must divide n_heads ({n_heads})")
        if d_head is None:
            if d_model % n_heads:
                raise ValueError(
                    f"n_heads ({n_heads}) must divide d_model ({d_model}) unless d_head is given"
                )
            d_head = d_model // n_heads
        d_head = _positive_int(d_head, "d_head")
        d_value = d_head if d_value is None else _positive_int(d_value, "d_value")
        dtype = np.dtype(dtype)
        if dtype.kind != "f":
            raise TypeError(f"dtype must be a floating dtype, got {dtype}")
        if rope and d_head % 2:
            raise ValueError(f"rope needs an even d_head, got d_head={d_head}")
        self.d_model, self.n_heads, self.n_kv_heads = d_model, n_heads, n_kv_heads
        self.d_head, self.d_value, self.dtype = d_head, d_value, dtype
        self.scale = None if scale is None else float(scale)
        self.rope, self.rope_base = bool(rope), float(rope_base)
        _args.check_window(window)   # a clear error now, not at a call
        self.window = None if window is None else tuple(int(w) for w in window)
        self.softcap = _args.check_softcap(softcap)
        self.sinks = np.zeros(n_heads, dtype) if sinks else None
        self.kv_dtype = None if kv_dtype is None else _args.storage_dtype(kv_dtype, "kv_dtype")

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
            extra += f", kv_dtype={self.kv_dtype.name}"
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
            w = _real_array(w, name)
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

    def _qkv(self, x, W, positions=None):
        x = _real_array(x, "x")
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
        if self.kv_dtype is not None:
            k = _args.store_as(k, self.kv_dtype, "k")
            v = _args.store_as(v, self.kv_dtype, "v")
        return q, k, v

    def _out(self, o, W):
        return self._linear(_merge_heads(o), W["w_o"], W["b_o"])

    def _args(self, W):
        # The keywords of fastattn.attention that come from the layer itself.
        return dict(scale=self.scale, window=self.window, softcap=self.softcap,
                    sinks=W["sinks"])

    @staticmethod
    def _positions(positions, batch, L):
        # Explicit rotary positions of the L rows: (*batch, L) or (L,), as (*batch, 1, L).
        p = _real_array(positions, "positions")
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
            x = _real_array(x, "x")
            pos = None
            if positions is not None and self.rope and x.ndim >= 2:
                pos = self._positions(positions, x.shape[:-2], x.shape[-2])
            q, k, v = self._qkv(x, W, pos)
            o = _kernel().attention(q, k, v, causal=causal, mask=mask, kv_lengths=kv_lengths,
                                    **self._args(W))
            return self._out(o, W)

        if not isinstance(cache, KVCache):
            raise TypeError(f"cache must be a fastattn.KVCache, got {type(cache).__name__}")
        if self.kv_dtype is not None and cache.dtype not in (None, self.kv_dtype):
            raise ValueError(f"the cache stores {cache.dtype} but this layer's kv_dtype is "
                             f"{self.kv_dtype}: pass an empty KVCache or one of that dtype")
        if isinstance(causal, str):
            raise ValueError(
                f"causal={causal!r} cannot be used with a cache (the cached tokens precede the "
                "new ones); use causal=True"
            )
        x = _real_array(x, "x")
        L = x.shape[-2] if x.ndim >= 2 else 0
        batch = x.shape[:-2]
        old = cache.lengths
        if cache.batch_shape is not None and cache.batch_shape != batch:
            raise ValueError(
                f"x has batch shape {batch} but the cache holds batch shape {cache.batch_shape}"
            )
        positions = None
        if self.rope:
            # Absolute positions of the new rows: (*batch, 1, L), broadcast over heads.
            if positions is None:
                positions = np.broadcast_to(old, batch)[..., None, None] + np.arange(L)
            else:
                positions = self._positions(positions, batch, L)
        q, k, v = self._qkv(x, W, positions)
        new = KVCache._new_counts(kv_lengths, L, batch, "kv_lengths")
        if self.kv_dtype is not None and cache.dtype is None:
            cache._dtype = self.kv_dtype
        old = cache.append(k, v, lengths=new)
        # Causal alignment is bottom-right: the L queries must be the last L keys the
        # kernel sees, so padded rows count as keys (the real queries cannot see them,
        # being before them).  Without causality only the real keys may exist.
        seen = old + L if causal or self.window is not None else old + new
        lk = int(seen.max(initial=0))
        keys, values = cache._k[..., :lk, :], cache._v[..., :lk, :]
        lengths = None if seen.size == 0 or np.all(seen == lk) else seen
        o = _kernel().attention(q, keys, values, causal=bool(causal), mask=mask,
                                kv_lengths=lengths, **self._args(W))
        return self._out(o, W), cache

    def attention_weights(self, x, *, causal=False, mask=None, kv_lengths=None):
        """Per-head attention probabilities ``(..., n_heads, L, L)`` for ``x`` (for inspection/plots)."""
        W = self._weights()
        q, k, _ = self._qkv(x, W)
        return _kernel().attention_weights(q, k, causal=causal, mask=mask, kv_lengths=kv_lengths,
                                           **self._args(W))

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

        Example (with torch installed)::

            m = torch.nn.MultiheadAttention(16, 4, batch_first=True)
            mha = MultiHeadAttention.from_torch_state_dict(m.state_dict(), n_heads=4)
            # mha(x) == m(x, x, x, need_weights=False)[0] for x of shape (N, L, 16)
        """
        def get(name, required=True):
            key = prefix + name
            if key not in state_dict:
                if required:
                    raise ValueError(f"state_dict has no key {key!r} (keys: {sorted(state_dict)})")
                return None
            t = state_dict[key]
            if hasattr(t, "detach"):          # a torch tensor, without importing torch
                t = t.detach().cpu().numpy()
            return _real_array(t, f"state_dict[{key!r}]")

        for unsupported in ("bias_k", "bias_v"):
            if prefix + unsupported in state_dict:
                raise ValueError(
                    f"state_dict has {prefix + unsupported!r}: add_bias_kv=True is not supported"
                )
        if prefix + "in_proj_weight" in state_dict:
            w_in = get("in_proj_weight")
            if w_in.ndim != 2 or w_in.shape[0] != 3 * w_in.shape[1]:
                raise ValueError(
                    f"state_dict['{prefix}in_proj_weight'] must have shape (3E, E), got {w_in.shape}"
                )
            E = w_in.shape[1]
            w_q, w_k, w_v = w_in[:E], w_in[E:2 * E], w_in[2 * E:]
        else:
            w_q, w_k, w_v = get("q_proj_weight"), get("k_proj_weight"), get("v_proj_weight")
            E = w_q.shape[0]
            # Grouped-query projections: k and v have n_kv_heads heads of E // n_heads.
            n_kv = kwargs.get("n_kv_heads") or n_heads
            E_kv = E // n_heads * n_kv if E % n_heads == 0 else E
            for name, w, rows in (("q_proj_weight", w_q, E), ("k_proj_weight", w_k, E_kv),
                                  ("v_proj_weight", w_v, E_kv)):
                if w.shape != (rows, E):
                    raise ValueError(
                        f"state_dict['{prefix}{name}'] has shape {w.shape}, expected "
                        f"({rows}, {E}) for embed_dim {E}, n_heads {n_heads} and n_kv_heads "
                        f"{n_kv} (self-attention: kdim == vdim == embed_dim)"
                    )
        w_out = get("out_proj.weight")
        if w_out.shape != (E, E):
            raise ValueError(f"state_dict['{prefix}out_proj.weight'] must have shape ({E}, {E}), "
                             f"got {w_out.shape}")
        b_in, b_out = get("in_proj_bias", False), get("out_proj.bias", False)
        E_k = w_k.shape[0]
        if b_in is not None and b_in.shape != (E + 2 * E_k,):
            raise ValueError(f"state_dict['{prefix}in_proj_bias'] must have shape "
                             f"({E + 2 * E_k},), got {b_in.shape}")
        if b_out is not None and b_out.shape != (E,):
            raise ValueError(f"state_dict['{prefix}out_proj.bias'] must have shape ({E},), "
                             f"got {b_out.shape}")
        if dtype is None:
            dtype = np.result_type(w_q, w_out)
            dtype = dtype if dtype.kind == "f" else np.dtype(np.float32)
        has_bias = b_in is not None or b_out is not None
        layer = cls(E, n_heads, bias=has_bias, dtype=dtype, **kwargs)
        conv = lambda a: np.ascontiguousarray(a, dtype=layer.dtype)  # noqa: E731
        layer.w_q, layer.w_k, layer.w_v = conv(w_q.T), conv(w_k.T), conv(w_v.T)
        layer.w_o = conv(w_out.T)
        if has_bias:
            if b_in is not None:
                layer.b_q, layer.b_k, layer.b_v = (conv(b_in[:E]), conv(b_in[E:E + E_k]),
                                                   conv(b_in[E + E_k:]))
            if b_out is not None:
                layer.b_o = conv(b_out)
        return layer
