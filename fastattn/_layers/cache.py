"""``KVCache``: the keys and values of the tokens seen so far, for incremental decoding.

The storage is preallocated and grown geometrically, so that a decode step costs one
projection of the new token and one kernel call over the cache, never a re-encoding of
the prefix.  ``MultiHeadAttention`` reads the cache only through its public accessors
(``lengths``, ``batch_shape``, ``dtype``, ``append`` and ``keys_values``).
"""

import math

import numpy as np

from .._calls import args as _args
from .._storage.quant import cache_dtype, check_fp8_scale, dequantize, quantize

__all__ = ["KVCache"]

# The cache line.  NumPy starts a large array 16 bytes into one, where a row of 128
# float16 values spans five lines instead of four and half its vector loads are split
# across two: the decode kernels read rows that start on a line faster.
_LINE = 64


def _aligned_empty(shape, dtype):
    """An uninitialised array of ``shape`` and ``dtype`` that starts on a cache line."""
    dtype = np.dtype(dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    raw = np.empty(nbytes + _LINE, np.uint8)
    start = -raw.ctypes.data % _LINE
    return raw[start:start + nbytes].view(dtype).reshape(shape)


class KVCache:
    """Keys and values of the tokens seen so far, for incremental decoding.

    Storage is ``(*batch, n_kv_heads, capacity, d)`` for keys and
    ``(*batch, n_kv_heads, capacity, d_value)`` for values.  The shapes are
    taken from the first ``append``; ``capacity`` rows are reserved then, and
    when an append does not fit the storage grows to
    ``max(needed, growth * capacity)`` (one copy, amortised O(1) per token).

    ``dtype`` (float16, bfloat16 -- ``ml_dtypes.bfloat16`` or the string
    ``"bfloat16"`` --, float32, float64, ``"q8_0"``, ``"q4_0"``, or fp8:
    ``"float8_e4m3fn"``, ``"float8_e5m2"`` or those ``ml_dtypes`` types) is the storage dtype; by
    default it is the dtype of the first keys and values appended.  Keys and values of
    another dtype are rounded to it (to nearest, once) as they are appended; a
    finite value beyond its range (float16 stops at 65504) raises
    ``ValueError`` instead of being stored as inf.  A float16 or bfloat16
    cache holds half the bytes of a float32 one, and attention reads it in
    place, so a decode step streams half the memory.

    ``dtype="q8_0"`` stores llama.cpp's q8_0 (see :func:`fastattn.quantize_q8_0`):
    int8 values and one float16 scale per 32 of them, 1.0625 bytes a value; ``d``
    and ``d_value`` must be multiples of 32.  ``dtype="q4_0"`` stores llama.cpp's q4_0
    (:func:`fastattn.quantize_q4_0`): two 4-bit values a byte (rows of ``d // 2``
    uint8) and one float16 scale per 32 values, 0.5625 bytes a value.  ``keys_values``
    then gives the stored values and ``scales`` their scales.

    An fp8 ``dtype`` stores ``x / scale`` rounded to nearest even and saturated
    (:func:`fastattn.quantize_fp8`), one byte a value, with the float32 scales
    ``k_scale`` and ``v_scale``: a float or an array of shape ``()`` (per tensor) or
    ``(n_kv_heads,)`` (per kv head), finite and > 0.  They default to 1.0, what vLLM
    uses when no scales were calibrated; calibrated ones (e.g. ``max|k| / 448`` per
    head for e4m3fn) keep more precision.  ``scales`` gives them back.

    ``MultiHeadAttention`` attends over a quantised cache with
    :func:`fastattn.attention_with_kvcache`, which reads it in place.

    Each batch element has its own length (``lengths``, shape ``batch``), so
    sequences of different lengths share one cache: rows at or beyond a
    sequence's length are unused and may hold stale data.

    A cache pickles with its contents, dtype, lengths and capacity (the rows
    beyond the longest sequence are not written), so it can be sent to another
    process and decoding continues there with the same bits.

    Normally you do not call ``append`` yourself: create an empty cache and
    pass it to ``MultiHeadAttention``:

    >>> mha = fastattn.MultiHeadAttention(16, 4, seed=0)
    >>> prompt = np.random.default_rng(0).standard_normal((1, 5, 16), dtype=np.float32)
    >>> cache = KVCache(capacity=256)
    >>> out, cache = mha(prompt, cache=cache, causal=True)    # prefill
    >>> out, cache = mha(prompt[:, -1:], cache=cache)         # one decode step
    >>> cache
    KVCache(batch=(1,), n_kv_heads=4, d=4, d_value=4, lengths=[6], capacity=256, dtype=float32)
    """

    def __init__(self, capacity=64, *, growth=2.0, dtype=None, k_scale=None, v_scale=None):
        self._initial_capacity = _args.check_index(capacity, "capacity", 1)
        growth = float(growth)
        if not growth > 1.0:
            raise ValueError(f"growth must be > 1, got {growth}")
        self._growth = growth
        self._dtype = None if dtype is None else cache_dtype(dtype, "dtype")
        self._fp8_scales = None
        if self.format == "fp8":
            self._fp8_scales = tuple(
                check_fp8_scale(1.0 if s is None else s, name, self._dtype, None, "cache")
                for name, s in (("k_scale", k_scale), ("v_scale", v_scale)))
        elif k_scale is not None or v_scale is not None:
            raise ValueError(f"k_scale and v_scale are the scales of an fp8 cache "
                             f"(dtype='float8_e4m3fn' or 'float8_e5m2'), got dtype={dtype!r}")
        self.reset()

    @property
    def dtype(self):
        """The storage dtype, or the string ``"q8_0"`` or ``"q4_0"`` (None until the
        first append when none was given)."""
        if self._k is None or isinstance(self._dtype, str):
            return self._dtype
        return self._k.dtype

    @property
    def format(self):
        """The quantised format stored: ``"q8_0"``, ``"q4_0"``, ``"fp8"``, or None."""
        if isinstance(self._dtype, str):
            return self._dtype
        return "fp8" if self._dtype is not None and self._dtype.itemsize == 1 else None

    @property
    def quantized(self):
        """Whether the cache stores a quantised format (q8_0, q4_0, fp8)."""
        return self.format is not None

    def reset(self):
        """Forget all tokens and release the storage."""
        self._k = None
        self._v = None
        self._k_scale = None
        self._v_scale = None
        self._lengths = None

    def _take_dtype(self, dtype):
        # A layer's kv_dtype for an empty cache without one (a quantised format cannot be
        # read off the float rows the layer appends); fp8 with the default scales.
        if self._k is None and self._dtype is None:
            self._dtype = dtype
            if self.format == "fp8":
                self._fp8_scales = (np.float32(1.0), np.float32(1.0))

    _STORAGE = ("_k", "_v", "_k_scale", "_v_scale")

    def _storage(self):
        """The names of the storage arrays in use (the block scales only for q8_0 and
        q4_0)."""
        return [n for n in self._STORAGE if getattr(self, n, None) is not None]

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

    def keys_values(self, length=None):
        """Views of the first ``length`` rows of every sequence's keys and values.

        ``length`` defaults to ``max_length`` and may be up to ``capacity``: rows at or
        beyond a sequence's own length are padding written by the last append, or stale.
        Returns ``(k, v)``, shaped ``(*batch, n_kv_heads, length, d)`` and
        ``(*batch, n_kv_heads, length, d_value)``, or ``(None, None)`` when empty.
        """
        if self._k is None:
            return None, None
        length = self.max_length if length is None else _args.check_index(length, "length", 0)
        if length > self.capacity:
            raise ValueError(f"length must be <= capacity = {self.capacity}, got {length}")
        return self._k[..., :length, :], self._v[..., :length, :]

    def scales(self, length=None):
        """Views of the q8_0 or q4_0 scales of the first ``length`` rows, ``(k_scale,
        v_scale)`` shaped ``(*batch, n_kv_heads, length, d // 32)`` and ``(...,
        d_value // 32)`` (float16), beside :meth:`keys_values`' values; an fp8 cache's
        float32 scales (shape ``()`` or ``(n_kv_heads,)``); ``(None, None)`` for a float or
        empty cache."""
        if self._fp8_scales is not None:
            return self._fp8_scales
        if self._k_scale is None:
            return None, None
        length = self.max_length if length is None else _args.check_index(length, "length", 0)
        if length > self.capacity:
            raise ValueError(f"length must be <= capacity = {self.capacity}, got {length}")
        return self._k_scale[..., :length, :], self._v_scale[..., :length, :]

    @property
    def k(self):
        """Stored keys, a view ``(*batch, n_kv_heads, max_length, d)`` (None when empty)."""
        return self.keys_values()[0]

    @property
    def v(self):
        """Stored values, a view ``(*batch, n_kv_heads, max_length, d_value)``."""
        return self.keys_values()[1]

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
                f"d_value={self._v.shape[-1]}, lengths={ln}, capacity={cap}, dtype={self.dtype})")

    # -- pickling -------------------------------------------------------------
    def __getstate__(self):
        # Only the rows in use: the rest of the storage is uninitialised memory, which
        # would make the pickle larger and its bytes differ from one run to the next.
        state = dict(self.__dict__)
        if self._k is not None:
            used = self.max_length
            for name in self._storage():
                state[name] = np.ascontiguousarray(getattr(self, name)[..., :used, :])
            state["capacity"] = self.capacity
        return state

    def __setstate__(self, state):
        state = dict(state)
        state.setdefault("_k_scale", None)     # pickles of float caches made before q8_0
        state.setdefault("_v_scale", None)
        state.setdefault("_fp8_scales", None)
        capacity = state.pop("capacity", None)
        self.__dict__.update(state)
        if capacity is not None:
            used = self._k.shape[-2]
            for name in self._storage():
                setattr(self, name, self._allocate(getattr(self, name), capacity, used))

    @staticmethod
    def _allocate(rows, capacity, used):
        # Storage of ``capacity`` rows per sequence holding ``rows``' first ``used`` rows.
        buf = _aligned_empty(rows.shape[:-2] + (capacity, rows.shape[-1]), rows.dtype)
        buf[..., :used, :] = rows[..., :used, :]
        return buf

    # -- writing --------------------------------------------------------------
    @staticmethod
    def _new_counts(lengths, L, batch, name="lengths"):
        """How many of the ``L`` new rows are real tokens, int64 of shape ``batch``."""
        if lengths is None:
            return np.full(batch, L, dtype=np.int64)
        n = _args.check_lengths(lengths, name, batch, L, "the number of new rows L")
        return n.reshape(batch).astype(np.int64)

    def _check_shapes(self, k, v):
        if k.ndim < 3:
            raise ValueError(f"k must have shape (..., n_kv_heads, L, d), got shape {k.shape}")
        if v.ndim != k.ndim or v.shape[:-1] != k.shape[:-1]:
            raise ValueError(
                f"v must have shape {k.shape[:-1] + ('d_value',)} to match k {k.shape}, "
                f"got v with shape {v.shape}"
            )
        per_byte = 2 if self.format == "q4_0" else 1        # q4_0: two values a byte
        d, dv = self._k.shape[-1] * per_byte if self._k is not None else None, None
        if d is not None:
            dv = self._v.shape[-1] * per_byte
        if d is not None and (k.shape[:-2] != self._k.shape[:-2] or k.shape[-1] != d
                              or v.shape[-1] != dv):
            raise ValueError(
                f"k {k.shape} / v {v.shape} do not match the cache's keys "
                f"{self._k.shape[:-2] + ('L', d)} / values {self._v.shape[:-2] + ('L', dv)}"
            )

    def append(self, k, v, lengths=None):
        """Append new keys ``(*batch, n_kv_heads, L, d)`` and values ``(..., L, d_value)``.

        Sequence ``b`` receives the rows at its current end; ``lengths[b]``
        (default ``L``) says how many of the ``L`` new rows are real tokens
        (right padding), and the sequence's length grows by that much.
        Returns the lengths before the append (the positions of the new rows).
        """
        k, v = _args.check_array(k, "k"), _args.check_array(v, "v")
        self._check_shapes(k, v)
        dtype = self._dtype if self._dtype is not None else _args.dtypes(k=k, v=v)[1]
        batch, L = k.shape[:-3], k.shape[-2]
        new = self._new_counts(lengths, L, batch)
        # Rounded or quantised (and checked) before anything is allocated or written.
        rows = self._stored(k, v, dtype, self._fp8_scales)
        if self._k is None:
            cap = max(self._initial_capacity, L)
            for name, a in zip(self._STORAGE, rows):
                if a is not None:
                    setattr(self, name, _aligned_empty(a.shape[:-2] + (cap, a.shape[-1]), a.dtype))
            self._lengths = np.zeros(batch, dtype=np.int64)
        old = self._lengths.copy()
        needed = int(old.max(initial=0)) + L   # every row is written, padding included
        if needed > self.capacity:
            self._grow(needed)
        for name, a in zip(self._STORAGE, rows):
            if a is not None:
                self._write(getattr(self, name), old, a)
        self._lengths = np.asarray(old + new, dtype=np.int64)   # stays an array when batch == ()
        return old

    @staticmethod
    def _stored(k, v, dtype, fp8_scales=None):
        """``(k, v, k_scale, v_scale)`` as stored: rounded to a float dtype (scales None),
        or quantised (block scales for q8_0 and q4_0, None for fp8, whose scales
        ``fp8_scales`` are the cache's own)."""
        if isinstance(dtype, str) or dtype.itemsize == 1:
            ks, vs = (None, None) if fp8_scales is None else (
                check_fp8_scale(s, name, dtype, a, name[0]) for name, s, a in
                (("k_scale", fp8_scales[0], k), ("v_scale", fp8_scales[1], v)))
            (kq, kb), (vq, vb) = quantize(k, "k", dtype, ks), quantize(v, "v", dtype, vs)
            return kq, vq, kb, vb
        return _args.store_as(k, dtype, "k"), _args.store_as(v, dtype, "v"), None, None

    def dequantized(self, length=None):
        """The float32 numbers a quantised cache stores, ``(k, v)`` like
        :meth:`keys_values` (copies); :meth:`keys_values` itself for a float cache."""
        k, v = self.keys_values(length)
        if k is None or not self.quantized:
            return k, v
        ks, vs = self.scales(length)
        return dequantize(k, ks, self.format), dequantize(v, vs, self.format)

    @staticmethod
    def _write(target, old, rows):
        # The L new rows of sequence b go to rows old[b] .. old[b] + L - 1 of ``target``.
        L = rows.shape[-2]
        if old.size == 0 or L == 0:
            return
        if np.all(old == old.flat[0]):
            start = int(old.flat[0])
            target[..., start:start + L, :] = rows
            return
        # Different lengths per sequence: scatter each sequence's rows at its own end.
        tb = target.reshape((-1,) + target.shape[-3:])
        at = (old.reshape(-1)[:, None] + np.arange(L))[:, None, :]      # (nb, 1, L)
        bi = np.arange(tb.shape[0])[:, None, None]
        hi = np.arange(target.shape[-3])[None, :, None]
        tb[bi, hi, at] = rows.reshape(tb.shape[:2] + (L, rows.shape[-1]))

    def _grow(self, needed):
        cap = max(needed, math.ceil(self.capacity * self._growth))
        used = self.max_length
        for name in self._storage():
            setattr(self, name, self._allocate(getattr(self, name), cap, used))
