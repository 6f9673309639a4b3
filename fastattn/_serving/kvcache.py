"""``attention_with_kvcache`` and ``plan_kvcache``: attention over a serving cache,
appended in place.

A server keeps the keys and values of many sequences in one cache: a ``(B, Hkv, Lmax, D)``
array, or a pool of pages ``(num_pages, Hkv, page, D)`` that a ``block_table`` hands out
to the sequences, in float32, float64, float16, bfloat16, or a quantised format
(:mod:`fastattn._storage.quant`): llama.cpp's q8_0 (int8) and q4_0 (uint8, two values a
byte) with a float16 scale per 32 values, or fp8 (``ml_dtypes``' float8_e4m3fn,
float8_e5m2) with a float32 scale per tensor or kv head.  One call does what a decode or
prefill step needs: it checks everything, rotates the new keys (rotary embedding), writes
them at the end of each sequence, and attends over each sequence's keys with the rules of
:func:`fastattn.attention` (causal and window aligned bottom-right to the sequence's own
length).

A decode step makes that call once per layer, and the layers share everything but their
arrays: the lengths, the block table, the rotary tables and the score modifiers.  So the
call is a plan and a run.  :class:`KVCachePlan` checks what the layers share once and
keeps its own copy; its ``run`` (src/calls/_plan.pxi) checks each layer's arrays, appends and
attends in C.  ``attention_with_kvcache`` is a plan and one run.

What the compiled run does not take -- an unusual dtype or layout, the float32 precision
opt-in, and every call it would refuse -- goes to the plan's checked path, in three steps,
in this order, so that a refused call writes nothing:

1. :func:`_check_call` and :func:`_check_attention` -- every argument checked, then the
   new rows rotated and rounded (or quantised) to the cache's format (:func:`_stored_rows`);
2. :func:`_append` -- the new rows written in place;
3. :func:`_attend` -- one kernel call over the caches in place; or :func:`_gather_keys` and
   :func:`fastattn.attention`, whose rows have the bits of a call over each sequence's own
   keys alone.

Both paths give the same bits (tests/test_plan.py compares them).
"""
import math
import os
from types import SimpleNamespace

import numpy as np

from .._calls import api as _api
from .._calls import args as _args
from .._calls import glue as _glue
from .._calls import precision as _precision
from .._calls.glue import kernel as _kernel
from .._machine import threads as _threads
from .._storage import kinds as _kinds
from .._storage.quant import (BLOCK, cache_format, check_block_pair, check_fp8_scale,
                              dequantize, quantize)

__all__ = ["attention_with_kvcache", "plan_kvcache", "KVCachePlan"]

# Set to False to send every run through the checked path (tests compare the two).
_COMPILED_RUN = os.environ.get("FASTATTN_VALIDATED_ONLY", "") in ("", "0")


def plan_kvcache(*, cache_seqlens, block_table=None, rotary_cos=None, rotary_sin=None,
                 rotary_interleaved=False, scale=None, causal=False, window=None,
                 softcap=None, alibi_slopes=None):
    """Plan the attention of one decode (or prefill) step, for every layer to run.

    The arguments are :func:`attention_with_kvcache`'s that the layers of a step share;
    they are checked here, once, and the plan keeps its own copy (the caller may change its
    arrays afterwards).  ``plan.run(q, k_cache, v_cache, k=None, v=None, *, k_scale=None,
    v_scale=None, sinks=None, return_lse=False, out=None)`` then gives exactly (bit for
    bit) ``attention_with_kvcache`` with both calls' arguments, checking only each layer's
    arrays, in compiled code.  Layers that differ in a keyword of the plan (a sliding
    window beside global attention) take a plan each.

    Returns
    -------
    KVCachePlan

    Examples
    --------
    Two layers of one decode step over caches of 16 rows, sequences of 3 and 5 keys:

    >>> rng = np.random.default_rng(0)
    >>> caches = [(np.zeros((2, 1, 16, 8), np.float32), np.zeros((2, 1, 16, 8), np.float32))
    ...           for layer in range(2)]
    >>> plan = fastattn.plan_kvcache(cache_seqlens=[3, 5], causal=True)
    >>> for k_cache, v_cache in caches:
    ...     q, k, v = (rng.standard_normal((2, 1, 1, 8), dtype=np.float32) for _ in range(3))
    ...     out = plan.run(q, k_cache, v_cache, k, v)
    >>> out.shape
    (2, 1, 1, 8)
    """
    return KVCachePlan(cache_seqlens=cache_seqlens, block_table=block_table,
                       rotary_cos=rotary_cos, rotary_sin=rotary_sin,
                       rotary_interleaved=rotary_interleaved, scale=scale, causal=causal,
                       window=window, softcap=softcap, alibi_slopes=alibi_slopes)


class KVCachePlan(_kernel.KVCachePlanBase):
    """A decode step's shared arguments, checked once (:func:`plan_kvcache` makes it).

    ``run(q, k_cache, v_cache, k=None, v=None, *, k_scale=None, v_scale=None, sinks=None,
    return_lse=False, out=None)`` attends (and appends) over one layer's caches: the bits
    of :func:`attention_with_kvcache` with the plan's keywords.  A plan may be run from
    several threads at once.
    """

    def __init__(self, *, cache_seqlens, block_table=None, rotary_cos=None, rotary_sin=None,
                 rotary_interleaved=False, scale=None, causal=False, window=None,
                 softcap=None, alibi_slopes=None):
        table = None if block_table is None else _check_block_table(block_table)
        self._seqlens = _check_seqlens(cache_seqlens)
        self._table = table
        self._cos, self._sin, interleaved = _check_rotary(rotary_cos, rotary_sin,
                                                          rotary_interleaved)
        self._scale = None if scale is None else _args.check_scale(scale, 1)
        if isinstance(causal, str) and causal == "top-left":
            raise ValueError("causal='top-left' cannot be used with a KV cache (the cached "
                             "keys precede the queries); use causal=True")
        self._causal = _args.check_causal(causal)
        wl, wr = _args.check_window(window)
        self._window = None if window is None else (wl, wr)
        self._softcap = _args.check_softcap(softcap)
        self._alibi_slopes = _check_alibi(alibi_slopes)
        as32 = lambda t: None if t is None else np.ascontiguousarray(t, dtype=np.float32)
        self._configure(np.zeros(0, np.intp), None, _args.CAUSAL_CODES[self._causal], wl, wr,
                        self._scale, self._softcap, as32(self._cos), as32(self._sin),
                        interleaved, self._causal != "none" or window is not None,
                        self._alibi_slopes is not None, _threads.get_num_threads,
                        _precision, _COMPILED_RUN)
        self._interleaved = interleaved
        B = table.shape[0] if table is not None else self._seqlens.shape[0] if self._seqlens.ndim else -1
        if B >= 0:
            try:
                self._batch_of(B)
            except ValueError:      # lengths and table disagree: each run's q says which
                pass

    def __repr__(self):
        return (f"<fastattn.KVCachePlan: {self.batch if self.batch >= 0 else 'any'} "
                f"sequences, {'paged' if self._table is not None else 'contiguous'}, "
                f"causal={self._causal!r}>")

    def _batch_of(self, B):
        """The lengths ``(B,)`` of a batch of ``B`` sequences (``cache_seqlens`` broadcast,
        checked against the block table), set for the compiled run."""
        if B != self.batch:
            if self._table is not None:
                _check_table_batch(self._table, B)
            seqlens = _broadcast_seqlens(self._seqlens, B)
            table32 = None if self._table is None else _table32(self._table)
            self._set_batch(seqlens, table32)
        return self._seqlens_b

    def _set_batch(self, seqlens, table32):
        self._seqlens_b = seqlens
        super()._set_batch(seqlens, table32)

    def _remember_pages_of(self, used, page, lnew):
        """Remember the span of the pages in use (``used``, checked) for the compiled
        run, which compares it with each run's pool."""
        lo, hi = (int(used.min()), int(used.max())) if used.size else (0, -1)
        self._remember_pages(page, lnew, lo, hi)

    def _resolve(self, q, k_cache, k):
        """Decide what the compiled run reuses and never decides itself, when a run finds
        it undecided: the lengths of q's batch and the pages its new rows and keys use.
        Arrays that do not fit are left to the checked run, which refuses them with its
        own message."""
        try:
            self._batch_of(q.shape[0])
            if self._table is not None:   # in C, or left to the checked run's messages
                self._resolve_pages(k_cache.shape[2], 0 if k is None else k.shape[2])
        except (AttributeError, IndexError, TypeError, ValueError):
            pass

    def _run_checked(self, q, k_cache, v_cache, k, v, k_scale, v_scale, sinks, return_lse,
                     out):
        """The run of every call the compiled run does not take (see the module's notes)."""
        c = _check_call(self, q, k_cache, v_cache, k, v, k_scale, v_scale)
        p = _check_attention(c, self, sinks, return_lse, out)
        if p.alibi is not None and p.alibi.shape == (c.B, c.Hq):
            self._set_alibi(p.alibi)
        q_rot, new_rows = _rotated(c)
        stored = _stored_rows(c, new_rows)
        _append(c, stored)
        if _kernel_reads(c, p):
            return _attend(c, q_rot, p)
        keys, values = _gather_keys(c)
        return _api.attention(q_rot, keys, values, kv_lengths=c.seen, scale=self._scale,
                              causal=self._causal != "none", window=self._window,
                              softcap=self._softcap, alibi_slopes=self._alibi_slopes,
                              sinks=sinks, return_lse=return_lse, out=out)


def attention_with_kvcache(q, k_cache, v_cache, k=None, v=None, *, cache_seqlens,
                           block_table=None, k_scale=None, v_scale=None, rotary_cos=None,
                           rotary_sin=None, rotary_interleaved=False, scale=None,
                           causal=False, window=None, softcap=None, alibi_slopes=None,
                           sinks=None, return_lse=False, out=None):
    """Attention over a KV cache -- contiguous or paged, float, q8_0, q4_0 or fp8 --
    appending the new keys and values in place first (FlashAttention's ``flash_attn_with_kvcache``, heads
    first).

    Parameters
    ----------
    q : array_like, shape (B, Hq, Lq, D)
    k_cache : ndarray, shape (B, Hkv, Lmax, D), or (num_pages, Hkv, page, D) with block_table
    v_cache : ndarray, shape (B, Hkv, Lmax, Dv), or (num_pages, Hkv, page, Dv)
        float32, float64, float16, bfloat16 (``ml_dtypes``); int8, which means q8_0, or
        uint8, which means q4_0 (the last axis holds ``D // 2`` bytes), both with
        ``k_scale``/``v_scale``; or ``ml_dtypes.float8_e4m3fn`` / ``float8_e5m2`` (fp8)
        with ``k_scale``/``v_scale``.  Both caches of one dtype.  Any strides: a
        ``(num_pages, page, Hkv, D)`` pool is passed as ``np.swapaxes(pool, 1, 2)``, a view.
        Rows beyond a sequence's keys are never read.
    k, v : array_like, shape (B, Hkv, Lnew, D) and (B, Hkv, Lnew, Dv), optional
        New keys and values, written at positions ``cache_seqlens[b] + i`` of sequence ``b``
        before attending (rounded once to a float cache's dtype, quantised for the
        others: fp8 stores ``x / scale`` rounded to nearest even and saturated).
    cache_seqlens : int or array_like of int, shape (B,)
        The number of keys each sequence has in the cache before this call; it is not
        changed (the caller adds ``Lnew`` for the next step).
    block_table : array_like of int, shape (B, max_pages), optional
        Page ``p`` of sequence ``b`` (its keys ``p * page .. (p + 1) * page - 1``) is
        ``k_cache[block_table[b, p]]``.  Only the pages a sequence uses are read (or
        checked); the rest of its row may hold anything.
    k_scale, v_scale : ndarray
        q8_0 and q4_0: float16 of shape ``cache.shape[:-1] + (D // 32,)``, written in
        place with the new rows.  fp8: float32 of shape ``()`` (per tensor) or ``(Hkv,)``
        (per kv head), or a float, every scale finite and > 0 (vLLM's ``k_scale`` /
        ``v_scale``): a stored value ``x`` reads as ``float32(x) * scale``.
    rotary_cos, rotary_sin : array_like, shape (max_pos, rotary_dim / 2), optional
        Rotary embedding of the new keys (needs ``k``) at positions ``cache_seqlens[b] + i``,
        stored rotated, and of ``q`` at the same positions when ``causal`` or ``window`` is
        set, else at ``cache_seqlens[b]``.  The first ``rotary_dim`` dims rotate: pairs
        ``(i, i + rotary_dim / 2)`` (GPT-NeoX), or ``(2i, 2i + 1)`` with
        ``rotary_interleaved=True`` (GPT-J).
    scale, causal, window, softcap, alibi_slopes, sinks, return_lse, out : optional
        As in :func:`attention`, per sequence over its ``cache_seqlens[b] + Lnew`` keys
        (``causal`` and ``window`` aligned bottom-right to that length; ``"top-left"`` is
        refused, since the cached keys precede the queries).

    Returns
    -------
    out : ndarray, shape (B, Hq, Lq, Dv)
        In :func:`attention`'s result dtype of ``q`` and the cache, a quantised cache
        counting as float32.  Each sequence's rows have the bits of :func:`attention` over that
        sequence's keys alone, whatever the paging, page size, layout, batch or threads.
    lse : ndarray, shape (B, Hq, Lq)
        Only with ``return_lse=True``.

    Every bad argument raises ``ValueError`` or ``TypeError`` before anything is written:
    a call that raises leaves the caches as they were.

    Examples
    --------
    >>> rng = np.random.default_rng(0)
    >>> k_cache = np.zeros((2, 1, 16, 8), np.float32); v_cache = np.zeros_like(k_cache)
    >>> q, k, v = (rng.standard_normal((2, 1, 1, 8), dtype=np.float32) for _ in range(3))
    >>> out = fastattn.attention_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=[0, 3])
    >>> bool(np.array_equal(k_cache[1, :, 3], k[1, :, 0]))
    True
    """
    plan = KVCachePlan(cache_seqlens=cache_seqlens, block_table=block_table,
                       rotary_cos=rotary_cos, rotary_sin=rotary_sin,
                       rotary_interleaved=rotary_interleaved, scale=scale, causal=causal,
                       window=window, softcap=softcap, alibi_slopes=alibi_slopes)
    return plan.run(q, k_cache, v_cache, k, v, k_scale=k_scale, v_scale=v_scale, sinks=sinks,
                    return_lse=return_lse, out=out)


# --------------------------------------------------------------------------- argument rules

def _cache(a, name):
    """A cache argument: an ndarray (it is written in place, so never a converted copy),
    native byte order, 4-d, of a cache dtype."""
    if not isinstance(a, np.ndarray):
        raise TypeError(f"{name} must be a numpy.ndarray (it is written in place), "
                        f"got {type(a).__name__}")
    if a.ndim != 4:
        raise ValueError(f"{name} must have shape (B, Hkv, Lmax, D), or (num_pages, Hkv, page, "
                         f"D) with block_table; got {a.shape}")
    if not a.dtype.isnative:
        raise TypeError(f"{name} must be in native byte order (it is written in place), got "
                        f"dtype {a.dtype}")
    if not (cache_format(a.dtype) or a.dtype in (np.float16, np.float32, np.float64)
            or _args.is_bfloat16(a.dtype)):
        raise TypeError(f"{name} must be float16, bfloat16 (ml_dtypes), float32, float64, "
                        f"int8 (q8_0, with scales), uint8 (q4_0, with scales) or "
                        f"float8_e4m3fn / float8_e5m2 (ml_dtypes; fp8, with scales), got "
                        f"dtype {a.dtype} (shape {a.shape})")
    return a


def _row_values(cache):
    """The values in a row of ``cache``: its last axis, twice that for q4_0."""
    return _kinds.row_values(cache.dtype, cache.shape[-1])


def _check_scales(cache, s, name, cache_name):
    """``s``, the scales of a quantised cache: float16 blocks for q8_0 and q4_0 (an ndarray,
    written in place), a float32 array of shape () or (Hkv,) for fp8; ``None`` for a float
    cache."""
    fmt = cache_format(cache.dtype)
    if fmt is None:
        if s is not None:
            raise ValueError(f"{name} is only for a quantised {cache_name} (q8_0, q4_0, fp8), "
                             f"which is {cache.dtype}")
        return None
    if fmt == "fp8":
        return check_fp8_scale(s, name, cache.dtype, cache, cache_name)
    if s is None:
        raise ValueError(f"a {cache.dtype} {cache_name} is {fmt} and needs its scales: {name} "
                         f"float16 of shape "
                         f"{cache.shape[:-1] + (_row_values(cache) // BLOCK,)}")
    if not isinstance(s, np.ndarray):
        raise TypeError(f"{name} must be a numpy.ndarray (it is written in place), got "
                        f"{type(s).__name__}")
    check_block_pair(cache, s, cache_name, name, fmt)
    return s


def _check_writable(a, name, why):
    if not a.flags.writeable:
        raise ValueError(f"{name} is read-only but {why} (shape {a.shape})")


def _check_caches(q, k_cache, v_cache, k_scale, v_scale):
    """The two caches (and scales) agree with each other and with q."""
    k_cache, v_cache = _cache(k_cache, "k_cache"), _cache(v_cache, "v_cache")
    if k_cache.dtype != v_cache.dtype:
        raise TypeError(f"k_cache and v_cache must have one dtype, got {k_cache.dtype} and "
                        f"{v_cache.dtype}")
    if k_cache.shape[:-1] != v_cache.shape[:-1]:
        raise ValueError(f"k_cache and v_cache must agree on all but the last axis: "
                         f"k_cache.shape={k_cache.shape}, v_cache.shape={v_cache.shape}")
    if _row_values(k_cache) != q.shape[-1]:
        half = " (q4_0: D // 2 bytes a row)" if _row_values(k_cache) != k_cache.shape[-1] else ""
        raise ValueError(f"q and k_cache must have the same head dim D{half}: "
                         f"q.shape={q.shape}, k_cache.shape={k_cache.shape}")
    _args.check_gqa(q, k_cache, "k_cache")
    k_scale = _check_scales(k_cache, k_scale, "k_scale", "k_cache")
    v_scale = _check_scales(v_cache, v_scale, "v_scale", "v_cache")
    return k_cache, v_cache, k_scale, v_scale


# The plan's arguments, checked once (KVCachePlan.__init__).

def _check_block_table(block_table):
    """The block table ``(B, max_pages)``, the plan's own copy: integers (the pages in use
    are checked against each run's pool), kept as int32 where every value fits (what the
    kernel reads), else as intp."""
    bt = _args.as_array(block_table, "block_table")
    if bt.dtype.kind not in "iu":
        raise TypeError(f"block_table must be an integer array, got dtype {bt.dtype} "
                        f"(shape {bt.shape})")
    if bt.ndim != 2:
        raise ValueError(f"block_table must have shape (B, max_pages), got {bt.shape}")
    fits = np.can_cast(bt.dtype, np.int32)
    return np.array(bt, dtype=np.int32 if fits else np.intp)


def _check_table_batch(table, B):
    if table.shape[0] != B:
        raise ValueError(f"block_table must have shape (B, max_pages) = ({B}, max_pages) for "
                         f"q of batch {B}, got {table.shape}")


def _table32(table):
    """The block table as the kernel reads it, int32 C-contiguous: the pages in use are
    checked below 2**31 (a pool's size); others are never read."""
    if table.dtype == np.int32:
        return np.ascontiguousarray(table)
    return np.ascontiguousarray(table.clip(-1, np.iinfo(np.int32).max), dtype=np.int32)


def _check_seqlens(cache_seqlens):
    """``cache_seqlens`` as intp: one length for every sequence (0-d), or ``(B,)``;
    integers ``>= 0`` (the room for each run's new rows is checked by the run)."""
    if cache_seqlens is None:
        raise TypeError("cache_seqlens must be an int or integer array of shape (B,), got None")
    a = _args.as_array(cache_seqlens, "cache_seqlens")
    if a.dtype.kind not in "iu":
        raise TypeError(f"cache_seqlens must be an integer array, got dtype {a.dtype} "
                        f"(shape {a.shape})")
    if a.ndim > 1:
        raise ValueError(f"cache_seqlens must be an int or have shape (B,), got {a.shape}")
    if a.size and int(a.min()) < 0:
        raise ValueError(f"cache_seqlens must be >= 0, got {int(a.min())} "
                         f"(sequence {int(np.argmin(a))})")
    return np.array(a, dtype=np.intp)                      # the plan's own copy


def _broadcast_seqlens(seqlens, B):
    """The plan's lengths for a batch of ``B`` sequences, intp ``(B,)`` C-contiguous."""
    if seqlens.shape == (B,):
        return seqlens                                     # the plan's own, contiguous
    if seqlens.shape not in ((), (1,)):
        raise ValueError(f"cache_seqlens of shape {seqlens.shape} does not broadcast to the "
                         f"batch (B,) = ({B},) of q")
    return np.full(B, seqlens.reshape(()), np.intp)


def _check_rotary(cos, sin, interleaved):
    """``(cos, sin, interleaved)``: float tables ``(max_pos, rotary_dim / 2)`` (the plan's
    own copies), or ``(None, None, interleaved)``."""
    interleaved = _args.check_flag(interleaved, "rotary_interleaved")
    if cos is None and sin is None:
        return None, None, interleaved
    if cos is None or sin is None:
        raise ValueError("rotary_cos and rotary_sin must be given together")
    cos, sin = _args.as_array(cos, "rotary_cos"), _args.as_array(sin, "rotary_sin")
    for name, a in (("rotary_cos", cos), ("rotary_sin", sin)):
        if a.dtype.kind != "f" and not _args.is_bfloat16(a.dtype):
            raise TypeError(f"{name} must be a floating array, got dtype {a.dtype}")
    if cos.ndim != 2 or cos.shape != sin.shape or cos.shape[1] == 0:
        raise ValueError(f"rotary_cos and rotary_sin must both have shape (max_pos, "
                         f"rotary_dim / 2) with rotary_dim >= 2, got {cos.shape} and "
                         f"{sin.shape}")
    return np.array(cos), np.array(sin), interleaved


def _check_alibi(alibi_slopes):
    """The ALiBi slopes as float64 (the plan's own copy), real and finite; whether they
    broadcast to ``(B, Hq)`` is checked when ``Hq`` is known (the run's q)."""
    if alibi_slopes is None:
        return None
    a = _args.as_array(alibi_slopes, "alibi_slopes")
    if not (a.dtype.kind in "iuf" or _args.is_bfloat16(a.dtype)):
        raise TypeError(f"alibi_slopes must be a real (integer or floating) array "
                        f"broadcastable to (B, Hq), got dtype {a.dtype}")
    a = np.array(a, dtype=np.float64)
    if not np.isfinite(a).all():
        raise ValueError(f"alibi_slopes must be finite, got {a[~np.isfinite(a)].flat[0]} "
                         f"(shape {a.shape})")
    return a


# Each run's arrays, checked (the checked path, KVCachePlan._run_checked).

def _check_room(seqlens, Lnew, capacity, capacity_text):
    """Room in the cache for every sequence's keys and ``Lnew`` new rows."""
    if seqlens.size and int(seqlens.max()) + Lnew > capacity:
        b = int(np.argmax(seqlens))
        raise ValueError(f"cache_seqlens[{b}] + Lnew = {int(seqlens[b])} + {Lnew} exceeds the "
                         f"cache's capacity {capacity} ({capacity_text})")


def _check_new(k, v, B, Hkv, D, Dv):
    """New keys and values ``(B, Hkv, Lnew, D)`` / ``(B, Hkv, Lnew, Dv)``, or both None."""
    if (k is None) != (v is None):
        raise ValueError("k and v must be given together (new keys and their values), got "
                         f"{'k' if v is None else 'v'} alone")
    if k is None:
        return None, None
    k, v = _args.as_array(k, "k"), _args.as_array(v, "v")
    _args.check_dtype(k, "k")
    _args.check_dtype(v, "v")
    for name, a, last in (("k", k, D), ("v", v, Dv)):
        want = (B, Hkv, "Lnew", last)
        if a.ndim != 4 or a.shape[:2] != (B, Hkv) or a.shape[3] != last:
            raise ValueError(f"{name} must have shape {want} to match q and the caches, got "
                             f"{a.shape}")
    if k.shape[2] != v.shape[2]:
        raise ValueError(f"k and v must have the same number of new rows: k.shape={k.shape}, "
                         f"v.shape={v.shape}")
    return k, v


def _check_rotary_fits(c, cos, has_new):
    """The plan's rotary tables against this run: new keys to rotate, the rotary dims
    within D, and a position for every row rotated."""
    if cos is None:
        return
    if not has_new:
        raise ValueError("rotary_cos/rotary_sin rotate the new keys: pass k and v with them")
    if 2 * cos.shape[1] > c.D:
        raise ValueError(f"rotary_dim = 2 * rotary_cos.shape[1] = {2 * cos.shape[1]} must lie "
                         f"in [2, D] = [2, {c.D}]")
    top = int(c.seqlens.max(initial=0)) + max(c.Lnew, c.Lq) - 1
    if top >= cos.shape[0]:
        raise ValueError(f"rotary_cos has {cos.shape[0]} positions but position "
                         f"{top} is rotated (cache_seqlens + Lnew or Lq)")


def _pages_in_use(seqlens, table, page, Lnew):
    """``(pages, in_use)``: the block table's pages that hold each sequence's keys and
    ``Lnew`` new rows (0 past them), and which entries those are; refuses two sequences
    given one cache row for their new rows."""
    seen = seqlens + Lnew
    used = -(-seen // page)                                      # ceil: pages in use
    n_used = int(used.max(initial=0))                            # <= max_pages (room)
    in_use = np.arange(n_used) < used[:, None]
    pages = np.where(in_use, table[:, :n_used], 0).astype(np.intp)
    if Lnew:
        first, row = _new_rows_at(seqlens, pages, page, Lnew)
        slots = first * page + row
        if np.unique(slots).size != slots.size:
            raise ValueError("block_table gives two sequences the same page for their new "
                             "rows: each new row needs a cache row of its own")
    return pages, in_use


def _check_pages(c, table, num_pages):
    """``c.pages`` and ``c.in_use``: the pages each sequence uses, checked in range of the
    pool."""
    pages, in_use = _pages_in_use(c.seqlens, table, c.page, c.Lnew)
    bad = in_use & ((pages < 0) | (pages >= num_pages))
    if bad.any():
        b, p = (int(i[0]) for i in np.nonzero(bad))
        raise ValueError(f"block_table[{b}, {p}] = {pages[b, p]} is not a page of the cache "
                         f"(num_pages = {num_pages}, block_table.shape={table.shape})")
    c.pages, c.in_use = pages, in_use


def _check_call(plan, q, k_cache, v_cache, k, v, k_scale, v_scale):
    """Every cache argument of one run of ``plan``, checked: a namespace of the normalised
    arrays and sizes (``B, Hq, Hkv, Lq, Lnew, D, Dv, seqlens, seen, pages, page``, and
    ``fmt``, the caches' quantised format or None)."""
    q = _args.as_array(q, "q")
    _args.check_dtype(q, "q")
    if q.ndim != 4:
        raise ValueError(f"q must have shape (B, Hq, Lq, D), got {q.shape}")
    B, Hq, Lq, D = q.shape
    k_cache, v_cache, k_scale, v_scale = _check_caches(q, k_cache, v_cache, k_scale, v_scale)
    Hkv, Dv = k_cache.shape[1], _row_values(v_cache)
    fmt = cache_format(k_cache.dtype)
    table = plan._table
    if table is not None:
        _check_table_batch(table, B)
        page = k_cache.shape[2]
        if page == 0:
            raise ValueError(f"k_cache's pages must hold at least one row, got shape "
                             f"{k_cache.shape}")
        capacity = table.shape[1] * page
        capacity_text = f"block_table.shape[1] * page = {table.shape[1]} * {page}"
    else:
        if k_cache.shape[0] != B:
            raise ValueError(f"k_cache must have the batch of q, (B, Hkv, Lmax, D) with B = "
                             f"{B}, got {k_cache.shape} (pass block_table for a paged cache)")
        page, capacity = None, k_cache.shape[2]
        capacity_text = f"Lmax = k_cache.shape[2] = {capacity}"
    k, v = _check_new(k, v, B, Hkv, D, Dv)
    Lnew = 0 if k is None else k.shape[2]
    seqlens = plan._batch_of(B)
    _check_room(seqlens, Lnew, capacity, capacity_text)
    if k is not None:
        scales = (("k_scale", k_scale), ("v_scale", v_scale)) if fmt in ("q8_0", "q4_0") else ()
        for name, a in (("k_cache", k_cache), ("v_cache", v_cache)) + scales:
            _check_writable(a, name, "k and v are to be written into it")
    c = SimpleNamespace(q=q, k_cache=k_cache, v_cache=v_cache, k_scale=k_scale,
                        v_scale=v_scale, k=k, v=v, B=B, Hq=Hq, Hkv=Hkv, Lq=Lq, Lnew=Lnew, D=D,
                        Dv=Dv, seqlens=seqlens, seen=seqlens + Lnew, page=page, pages=None,
                        in_use=None,
                        cos=plan._cos, sin=plan._sin, interleaved=plan._interleaved,
                        rotate_q_per_row=plan._causal != "none" or plan._window is not None,
                        fmt=fmt)
    _check_rotary_fits(c, plan._cos, k is not None)
    if table is not None:
        _check_pages(c, table, k_cache.shape[0])
        plan._remember_pages_of(c.pages[c.in_use], page, Lnew)
    return c


def _value_dtype(c):
    """The dtype the keys are attended in: a float cache's own, float32 for a quantised
    one."""
    return np.dtype(np.float32) if c.fmt else c.k_cache.dtype


def _stand_in(dtype, shape):
    """A read-only array of zeros of any shape in one element's memory."""
    a = np.ndarray(shape, dtype, np.zeros(1, dtype), 0, (0,) * len(shape))
    a.flags.writeable = False
    return a


def _check_attention(c, plan, sinks, return_lse, out):
    """The keywords of the attention step, checked by :func:`fastattn.attention`'s own rules
    before anything is written (on stand-in keys of the right shape and dtype, which cost
    no memory)."""
    lk = int(c.seen.max(initial=0))
    dt = _value_dtype(c)
    keys, values = (_stand_in(dt, (c.B, c.Hkv, lk, last)) for last in (c.D, c.Dv))
    return _args.Problem(c.q, keys, values, scale=plan._scale, causal=plan._causal != "none",
                         window=plan._window, kv_lengths=c.seen, softcap=plan._softcap,
                         alibi_slopes=plan._alibi_slopes, sinks=sinks, return_lse=return_lse,
                         out=out)


# --------------------------------------------------------------------------- rotary

def _rotate(x, cos, sin, interleaved):
    """``x (..., L, D)`` rotated by the tables ``cos``/``sin`` ``(..., L, rotary_dim / 2)``:
    FlashAttention's ``apply_rotary_emb``, computed in ``x``'s compute dtype and rounded
    back to ``x``'s own float dtype (so a float16 q stays float16)."""
    half = cos.shape[-1]
    cdt = _args.dtypes(x=x)[0]
    xr = x.astype(cdt)
    cos, sin = cos.astype(cdt), sin.astype(cdt)
    if interleaved:
        x1, x2 = xr[..., 0:2 * half:2], xr[..., 1:2 * half:2]
    else:
        x1, x2 = xr[..., :half], xr[..., half:2 * half]
    r1, r2 = x1 * cos - x2 * sin, x1 * sin + x2 * cos
    if interleaved:
        xr[..., 0:2 * half:2], xr[..., 1:2 * half:2] = r1, r2
    else:
        xr[..., :half], xr[..., half:2 * half] = r1, r2
    return _args.round_to(xr, x.dtype) if x.dtype.kind == "f" or _args.is_16bit(x.dtype) else xr


def _rotated(c):
    """``(q, (k, v))`` with the rotary embedding applied (q as given without tables):
    new key ``i`` of sequence ``b`` at position ``cache_seqlens[b] + i``, q row ``i`` at the
    same position when causal or windowed, else every row at ``cache_seqlens[b]``."""
    if c.cos is None:
        return c.q, (c.k, c.v)
    k_pos = c.seqlens[:, None] + np.arange(c.Lnew)                        # (B, Lnew)
    q_pos = c.seqlens[:, None] + (np.arange(c.Lq) if c.rotate_q_per_row else
                                  np.zeros(c.Lq, np.intp))                 # (B, Lq)
    table = lambda t, pos: t[pos][:, None]                                 # (B, 1, L, half)
    k = _rotate(c.k, table(c.cos, k_pos), table(c.sin, k_pos), c.interleaved)
    q = _rotate(c.q, table(c.cos, q_pos), table(c.sin, q_pos), c.interleaved)
    return q, (k, c.v)


# --------------------------------------------------------------------------- appending

def _stored_rows(c, new_rows):
    """The new rows in the cache's format: ``((k, k_scale), (v, v_scale))``, rounded once
    to a float cache's dtype (a finite value beyond float16's range is refused), or
    quantised (the scales None for fp8, whose scales are not written); None without new
    rows.  Raises before anything is written."""
    k, v = new_rows
    if k is None:
        return None
    if c.fmt:
        fmt = c.k_cache.dtype if c.fmt == "fp8" else c.fmt
        return quantize(k, "k", fmt, c.k_scale), quantize(v, "v", fmt, c.v_scale)
    dt = c.k_cache.dtype
    return (_args.store_as(k, dt, "k"), None), (_args.store_as(v, dt, "v"), None)


def _row_index(c):
    """Where new row ``i`` of sequence ``b`` goes: ``(first, row)`` index arrays
    ``(B, Lnew)`` into a cache's axes 0 and 2 (sequence or page, and row)."""
    if c.page is None:
        pos = c.seqlens[:, None] + np.arange(c.Lnew)
        return np.broadcast_to(np.arange(c.B)[:, None], pos.shape), pos
    return _new_rows_at(c.seqlens, c.pages, c.page, c.Lnew)


def _new_rows_at(seqlens, pages, page, Lnew):
    """The paging rule for the new rows: row ``i`` of sequence ``b`` is key
    ``seqlens[b] + i``, which lies in row ``key % page`` of page ``pages[b, key // page]``.
    ``(first, row)``, index arrays ``(B, Lnew)``."""
    pos = seqlens[:, None] + np.arange(Lnew)
    return np.take_along_axis(pages, pos // page, axis=1), pos % page


def _append(c, stored):
    """Write the new rows (and block scales) into the caches, in place."""
    if stored is None or c.Lnew == 0 or c.B == 0:
        return
    first, row = _row_index(c)
    (k, ks), (v, vs) = stored
    for target, rows in ((c.k_cache, k), (c.v_cache, v), (c.k_scale, ks), (c.v_scale, vs)):
        if rows is not None:
            # advanced indices on axes 0 and 2 put their (B, Lnew) axes first
            target[first, :, row] = np.swapaxes(rows, 1, 2)


# --------------------------------------------------------------------------- attending

def _kernel_reads(c, p):
    """Whether the kernel reads the caches where they are: always, except for float64
    arithmetic over a cache of another dtype (the kernel computes in the caches' own
    float64 only), caches whose rows are not contiguous, and float caches under the
    float32 precision opt-in, whose q and rows :func:`fastattn.attention` rounds to
    bfloat16 first (so every layout gives its products)."""
    if p.compute_dtype == np.float64 and c.k_cache.dtype != np.float64:
        return False
    if _rounds_to_bfloat16(c, p):
        return False
    return all(_kernel.kernel_layout(a) for a in (c.k_cache, c.v_cache))


def _rounds_to_bfloat16(c, p):
    """Whether :func:`fastattn.attention` over this call's float keys would round q, k and
    v to bfloat16 (the float32 opt-in), which the kernel reading a cache does not do."""
    if c.fmt or p.compute_dtype != np.float32:
        return False
    all_bf16 = _args.is_bfloat16(c.q.dtype) and _args.is_bfloat16(c.k_cache.dtype)
    return not all_bf16 and _precision.rounds_float32(c.D, c.Dv)


def _attend(c, q, p):
    """One kernel call over the caches in place: pages looked up in the block table and
    quantised rows dequantised as each key block is loaded, with the bits of
    :func:`fastattn.attention` over each sequence's own (dequantised) keys."""
    cdt = p.compute_dtype
    q = _glue.kernel_ready(q, cdt)
    scales = [_kernel_scales(c, s) for s in (c.k_scale, c.v_scale)]
    # the checked table: the pages each sequence uses, 0 past them (never read)
    block_table = None if c.page is None else _table32(c.pages)
    res, lse, direct = _glue.result_arrays(p, p.out, cdt, (c.B, c.Hq, c.Lq, c.Dv),
                                           (q, c.k_cache, c.v_cache))
    _kernel.forward_kvcache(p, q=q, k_cache=c.k_cache, v_cache=c.v_cache, out=res, lse=lse,
                            block_table=block_table, k_scale=scales[0], v_scale=scales[1],
                            n_threads=_threads.get_num_threads())
    res = _glue.result(p.out, res, p.result_dtype, direct)
    return (res, lse) if p.return_lse else res


def _kernel_scales(c, s):
    """Scales as the kernel reads them: uint16 views of the float16 blocks, or fp8's
    float32 scale per kv head (Hkv,)."""
    if s is None:
        return None
    if c.fmt == "fp8":
        return np.broadcast_to(s, (c.Hkv,))
    return np.ascontiguousarray(s).view(np.uint16)


def _gather_keys(c):
    """Each sequence's first ``cache_seqlens[b] + Lnew`` keys and values as arrays
    ``(B, Hkv, Lk, D)`` that :func:`fastattn.attention` reads with ``kv_lengths``, for the
    calls the kernel does not read in place (:func:`_kernel_reads`).

    A contiguous float cache is passed as it is (a view).  Pages are copied into one
    contiguous array per sequence, and quantised rows dequantised to float32; the
    rows beyond a sequence's keys are zeros.
    """
    lk = int(c.seen.max(initial=0))
    if c.page is None and not c.fmt:
        return c.k_cache[:, :, :lk], c.v_cache[:, :, :lk]
    return (_gathered(c, c.k_cache, c.k_scale, lk),
            _gathered(c, c.v_cache, c.v_scale, lk))


def _gathered(c, cache, scales, lk):
    """One cache's keys (or values) of every sequence, contiguous ``(B, Hkv, lk, last)``."""
    rows = _sequence_rows(c, cache, lk)
    if c.fmt == "fp8":
        rows = dequantize(rows, scales, "fp8")
    elif c.fmt:
        rows = dequantize(rows, _sequence_rows(c, scales, lk), c.fmt)
    # zeros, not stale rows, beyond each sequence's keys: nothing there can be NaN
    beyond = np.arange(lk) >= c.seen[:, None]                       # (B, lk)
    rows[np.broadcast_to(beyond[:, None, :, None], rows.shape)] = 0
    return rows


def _sequence_rows(c, a, lk):
    """``a``'s first ``lk`` rows of every sequence, ``(B, Hkv, lk, last)`` (a copy)."""
    if c.page is None:
        return np.array(a[:, :, :lk])
    n_pages = math.ceil(lk / c.page)
    pages = a[c.pages[:, :n_pages]]                   # (B, n_pages, Hkv, page, last)
    pages = np.swapaxes(pages, 1, 2)                  # (B, Hkv, n_pages, page, last)
    return pages.reshape(pages.shape[:2] + (n_pages * c.page, a.shape[-1]))[:, :, :lk].copy()
