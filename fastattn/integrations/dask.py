"""fastattn on Dask arrays: attention over a cluster, with keys split across chunks merged exactly.

``attention(q, k, v, ...)`` takes dask arrays (NumPy arrays are wrapped) in fastattn's
layout ``(..., H, L, D)`` and returns a dask array: one task per block of batch elements and
heads, each a plain :func:`fastattn.attention` call on NumPy blocks.

- **Batch and head chunks** are independent calls.  A head chunk of q holds whole GQA
  groups (query heads ``g*G .. g*G + G - 1`` read key/value head ``g``), so q is rechunked
  along its heads when needed, and k and v get the matching key/value heads.  The query
  rows and the head dims are one chunk each: causal alignment needs all of a call's rows.
  Without key chunks, each block's bits are those of the single-process call.
- **Key chunks** give partial results over disjoint keys, each with its lse, which a tree
  reduction (``dask.array.reduction``) merges with :func:`fastattn.merge_attention`: exact
  within float rounding.  A partial travels as one array, the output rows with the lse
  appended as one more column, in the compute dtype (16-bit inputs are merged in float32
  and rounded once).  A key chunk sees the visibility of the whole call: causal and window
  shifted by the keys after it, or a boolean mask from the kernel's own visibility rule
  where no window can say it (lengths per batch element, narrow windows, top-left
  causal); the sink goes to the first key chunk only.
- **Threads.** Each task calls fastattn with its default thread count, which honours
  ``OMP_NUM_THREADS``: the variable dask's nanny sets in every worker process (to 1 by
  default, with the worker's threads running that many tasks at once), so tasks never
  oversubscribe the cores their worker was given.  ``threads=`` sets it where no nanny
  does (dask's local threaded scheduler).

dask is imported when :func:`attention` is called, never by importing this module.
"""
import numpy as np

from .._calls import args as _args
from .._machine import threads as _threads
from .._calls.glue import kernel as _kernel
from .._calls.merge import merge_attention

__all__ = ["attention"]


def attention(q, k, v, *, scale=None, causal=False, window=None, mask=None, kv_lengths=None,
              return_lse=False, softcap=None, alibi_slopes=None, sinks=None, q_lengths=None,
              split_every=None, threads=None):
    """:func:`fastattn.attention` on dask arrays, block by block, keys split and merged.

    Parameters
    ----------
    q, k, v : dask.array.Array or array_like
        fastattn's shapes ``(..., Hq, Lq, D)``, ``(..., Hkv, Lk, D)``, ``(..., Hkv, Lk, Dv)``;
        NumPy arrays are wrapped (one chunk).  Chunks along the batch axes and the heads
        become separate tasks (q's head chunks rounded to whole GQA groups); chunks of k
        along its key axis (Lk) become partial results merged exactly.
    scale, causal, window, softcap, sinks, return_lse : as in :func:`fastattn.attention`.
    mask : array_like or dask.array.Array, optional
        As in :func:`fastattn.attention`; chunked like the blocks it applies to.
    kv_lengths, q_lengths, alibi_slopes : array_like, optional
        As in :func:`fastattn.attention`: small NumPy arrays, sent with each block's slice.
        ``alibi_slopes`` needs the keys in one chunk.
    split_every : int, optional
        Fan-in of the tree that merges key chunks (dask's default when None).
    threads : int, optional
        fastattn threads per task.  None: fastattn's default, which honours
        ``OMP_NUM_THREADS`` -- in a worker started by Dask's nanny, 1 (the worker's threads
        run that many tasks at once).  Give it where no nanny sets the variable: under
        dask's local threaded scheduler, or in workers without a nanny, where every task
        would otherwise take all the cores.

    Returns
    -------
    out : dask.array.Array, shape (..., Hq, Lq, Dv)
        Chunked as q along the batch and heads; dtype as :func:`fastattn.attention`'s.
    lse : dask.array.Array, shape (..., Hq, Lq)
        Only with ``return_lse=True``, in the compute dtype.

    Raises
    ------
    ValueError, TypeError
        What :func:`fastattn.attention` raises for the same shapes, dtypes and keywords,
        when the graph is built (before any task runs).
    NotImplementedError
        ``alibi_slopes`` with k split along its key axis.

    Examples
    --------
    >>> import dask.array as da
    >>> from fastattn.integrations import dask as fa_dask
    >>> q = da.random.default_rng(0).standard_normal((8, 4, 128, 64), chunks=(2, 4, 128, 64))
    >>> out = fa_dask.attention(q, q, q, causal=True)      # 4 tasks, one per 2 sequences
    >>> out.chunks[0]
    (2, 2, 2, 2)
    """
    import dask.array as da

    arrays = [x if isinstance(x, da.Array) else da.asarray(x) for x in (q, k, v)]
    squeeze = arrays[0].ndim == 2        # (Lq, D): one head, as fastattn.attention allows
    if squeeze and all(a.ndim == 2 for a in arrays):
        arrays = [a[None] for a in arrays]
    if threads is not None:
        try:
            threads = _threads._check(threads)
        except (TypeError, ValueError) as e:
            raise type(e)(f"threads: {e}") from None
    plan = _Plan(arrays, mask, dict(scale=scale, causal=causal, window=window,
                                    kv_lengths=kv_lengths, softcap=softcap,
                                    alibi_slopes=alibi_slopes, sinks=sinks,
                                    q_lengths=q_lengths, return_lse=return_lse,
                                    threads=threads))
    out, lse = plan.build(split_every)
    if squeeze:
        out, lse = out[0], (None if lse is None else lse[0])
    return (out, lse) if return_lse else out


class _Plan:
    """One validated call: its chunks, the per-block keyword arrays, and the graph."""

    def __init__(self, arrays, mask, keywords):
        import dask.array as da

        self.keywords = keywords
        self.call = self._validate(arrays, mask, keywords)
        c = self.call
        self.nb = len(c.batch)
        self.batch_idx = tuple(f"b{t}" for t in range(self.nb))
        self.q, self.k, self.v = self._rechunk(arrays)
        self.q_heads = self.q.chunks[self.nb]
        self.key_chunks = self.k.chunks[self.nb + 1]
        if len(self.key_chunks) > 1 and c.alibi is not None:
            raise NotImplementedError(
                "alibi_slopes with the keys split across chunks is not supported (the bias "
                f"aligns to the whole key axis): rechunk k and v to one chunk along Lk = {c.Lk}")
        self.mask = None if mask is None else self._mask_array(da, mask)
        self.extras = self._keyword_arrays(da)

    # -- validation -------------------------------------------------------------------
    @staticmethod
    def _validate(arrays, mask, keywords):
        """fastattn's own argument checks, run on stand-ins with the shapes and dtypes of
        the dask arrays (zero strides: no memory), before any graph is built."""
        stand_in = lambda a: np.broadcast_to(np.zeros((), a.dtype), a.shape)  # noqa: E731
        q, k, v = (stand_in(a) for a in arrays)
        if mask is not None and not isinstance(mask, np.ndarray) and hasattr(mask, "dask"):
            mask = stand_in(mask)
        kw = {n: keywords[n] for n in ("kv_lengths", "q_lengths", "sinks", "alibi_slopes")}
        for name, value in kw.items():
            if value is not None and hasattr(value, "dask"):
                raise TypeError(f"{name} must be a NumPy array (it is small and sent with every "
                                f"block), got a {type(value).__name__}")
        return _args.Problem(q, k, v, scale=keywords["scale"], causal=keywords["causal"],
                             window=keywords["window"], mask=mask, softcap=keywords["softcap"],
                             return_lse=keywords["return_lse"], **kw)

    # -- chunks -----------------------------------------------------------------------
    def _batch_chunks(self, arrays):
        """Chunks of each batch axis: those of the first array with the full size there."""
        chunks = []
        for t, size in enumerate(self.call.batch):
            full = [a for a in arrays if a.shape[t] == size]
            chunks.append(full[0].chunks[t] if size > 1 else (size,))
        return chunks

    def _head_chunks(self, q):
        """q's head chunks, rounded to whole GQA groups when they split one."""
        G = self.call.Hq // self.call.Hkv
        heads = q.chunks[self.nb]
        if all(c % G == 0 for c in heads):
            return heads
        size = max(1, round(max(heads) / G)) * G
        n, rest = divmod(self.call.Hq, size)
        return (size,) * n + ((rest,) if rest else ())

    def _rechunk(self, arrays):
        nb, c = self.nb, self.call
        self.batch_chunks = self._batch_chunks(arrays)
        heads = self._head_chunks(arrays[0])
        G = c.Hq // c.Hkv
        key_chunks = arrays[1].chunks[nb + 1]
        out = []
        for n, a in enumerate(arrays):
            target = {t: ch for t, ch in enumerate(self.batch_chunks) if a.shape[t] > 1}
            target[nb] = heads if n == 0 else tuple(h // G for h in heads)
            target[nb + 1] = -1 if n == 0 else key_chunks
            target[nb + 2] = -1
            out.append(a.rechunk(target))
        return out

    def _mask_array(self, da, mask):
        """The mask as a dask array of full rank, chunked like the blocks it applies to
        (its broadcast axes stay one chunk of length 1)."""
        if not hasattr(mask, "dask"):
            mask = np.asarray(mask)
        r = self.nb + 3
        mask = mask.reshape((1,) * (r - mask.ndim) + mask.shape)
        chunks = list(self.batch_chunks) + [self.q_heads, (self.call.Lq,), self.key_chunks]
        chunks = [ch if size > 1 else (size,) for ch, size in zip(chunks, mask.shape)]
        if isinstance(mask, np.ndarray):
            return da.from_array(mask, chunks=tuple(chunks))
        return mask.rechunk(tuple(chunks))

    def _keyword_arrays(self, da):
        """Per-batch and per-head keyword arrays as dask arrays chunked like the blocks."""
        c = self.call
        batch_chunks = tuple(self.batch_chunks)
        per_head = batch_chunks + (self.q_heads,)
        wrap = lambda a, ch: None if a is None else da.from_array(  # noqa: E731
            np.array(a), chunks=ch)          # np.array: a copy that stays 0-d for batch ()
        lengths = lambda a: None if a is None else np.broadcast_to(  # noqa: E731
            np.asarray(a, dtype=np.intp).reshape(c.batch), c.batch)
        heads = lambda a: None if a is None else a.reshape(c.batch + (c.Hq,))  # noqa: E731
        return {
            "kv_len": wrap(lengths(c.kv_len), batch_chunks),
            "q_len": wrap(lengths(c.q_len), batch_chunks),
            "sinks": wrap(heads(c.sinks), per_head),
            "alibi": wrap(heads(c.alibi), per_head),
        }

    # -- graph ------------------------------------------------------------------------
    def _arguments(self, key_axis):
        """blockwise's (array, index) pairs: q, k, v, the keyword arrays, the mask."""
        b = self.batch_idx
        args = [self.q, b + ("h", "i", "d"), self.k, b + ("h", "j", "d"),
                self.v, b + ("h", "j", "e")]
        for name in ("kv_len", "q_len"):
            a = self.extras[name]
            args += [a, None if a is None else b]
        for name in ("sinks", "alibi"):
            a = self.extras[name]
            args += [a, None if a is None else b + ("h",)]
        args += [self.mask, None if self.mask is None else b + ("h", "i", "j")]
        if key_axis:
            import dask.array as da

            starts = np.cumsum((0,) + self.key_chunks[:-1])
            args += [da.from_array(starts, chunks=1), ("j",)]
        return args

    def _static(self):
        kw = self.keywords
        return dict(scale=self.call.scale, causal=kw["causal"], window=kw["window"],
                    softcap=kw["softcap"], threads=kw["threads"])

    def build(self, split_every):
        import dask.array as da

        c = self.call
        b = self.batch_idx
        cdt, rdt = c.compute_dtype, c.result_dtype
        r = self.nb + 3
        if len(self.key_chunks) == 1:
            packed = c.return_lse
            res = da.blockwise(
                _attend_block, b + ("h", "i", "e"), *self._arguments(False),
                concatenate=True, align_arrays=False,
                adjust_chunks={"e": (lambda n: n + 1)} if packed else None,
                meta=np.empty((0,) * r, dtype=cdt if packed else rdt),
                static=self._static(), packed=packed)
            if not packed:
                return res, None
        else:
            partials = da.blockwise(
                _partial_block, b + ("h", "i", "j", "e"), *self._arguments(True),
                concatenate=True, align_arrays=False,
                adjust_chunks={"j": 1, "e": (lambda n: n + 1)},
                meta=np.empty((0,) * (r + 1), dtype=cdt),
                static=self._static(), Lk=c.Lk, compute=cdt)
            res = da.reduction(partials, _keep, _merge_packed, combine=_merge_packed,
                               axis=r - 1, keepdims=False, dtype=cdt, split_every=split_every,
                               concatenate=True, meta=np.empty((0,) * r, dtype=cdt),
                               name="fastattn-merge")
        out, lse = res[..., :-1], res[..., -1]
        return (out if out.dtype == rdt else out.astype(rdt)), lse


# --------------------------------------------------------------------------- tasks

def _attention(q, k, v, threads, **keywords):
    """fastattn.attention in a task, on ``threads`` threads (None: fastattn's default)."""
    from .. import attention, num_threads

    if threads is None:
        return attention(q, k, v, **keywords)
    with num_threads(threads):
        return attention(q, k, v, **keywords)


def _attend_block(q, k, v, kv_len, q_len, sinks, alibi, mask, *, static, packed):
    """One block: fastattn.attention on NumPy arrays (lse appended as a column if packed)."""
    keywords = dict(static, kv_lengths=kv_len, q_lengths=q_len, sinks=sinks,
                    alibi_slopes=alibi, mask=mask)
    if not packed:
        return _attention(q, k, v, **keywords)
    out, lse = _attention(q, k, v, return_lse=True, **keywords)
    return np.concatenate([out.astype(lse.dtype, copy=False), lse[..., None]], axis=-1)


def _partial_block(q, k, v, kv_len, q_len, sinks, alibi, mask, start, *, static, Lk, compute):
    """Attention over the keys start:start + k.shape[-2] of a call over Lk keys, with the
    whole call's visibility; the rows with the lse appended, shape (..., Hq, Lq, 1, Dv + 1)."""
    a = int(start[0])
    b = a + k.shape[-2]
    keywords = _shard_keywords(q, k, v, a, b, Lk, kv_len, q_len, mask, static)
    # q in the compute dtype: the partial rows then come back unrounded (16-bit inputs).
    out, lse = _attention(q.astype(compute, copy=False), k, v, return_lse=True,
                          sinks=sinks if a == 0 else None, alibi_slopes=alibi, **keywords)
    return np.concatenate([out, lse[..., None]], axis=-1)[..., None, :]


def _shard_keywords(q, k, v, a, b, Lk, kv_len, q_len, mask, static):
    """Keywords that give keys a:b of a call over Lk keys the visibility they have there."""
    keywords = dict(static)
    causal = _args.check_causal(static["causal"])
    wl, wr = _args.check_window(static["window"])
    if causal == "none" and static["window"] is None:
        # No alignment to keep: only which keys exist matters.
        if kv_len is not None:
            keywords["kv_lengths"] = np.clip(kv_len - a, 0, b - a)
        return dict(keywords, q_lengths=q_len, mask=mask)
    after = Lk - b
    if (kv_len is None and q_len is None and causal != "top-left"
            and (wl == -1 or wl >= after)):
        # Bottom-right alignment to the shard's own last key, shifted back by the keys
        # after it: the same band of keys as in the whole call.
        if causal == "bottom-right":
            wr = 0 if wr == -1 else min(wr, 0)
        keywords.update(causal=False, window=(wl if wl == -1 else wl - after,
                                              wr if wr == -1 else wr + after))
        return dict(keywords, mask=mask)
    # Padding rows (q_lengths) stay padding: zeros and lse = -inf, the sink left out too.
    keywords.update(causal=False, window=None, q_lengths=q_len)
    return dict(keywords, mask=_shard_mask(q, k, v, a, b, Lk, kv_len, q_len, mask, static))


def _shard_mask(q, k, v, a, b, Lk, kv_len, q_len, mask, static):
    """Boolean visibility of keys a:b from the kernel's rule (key_intervals) for the whole
    call, combined with the user's mask."""
    # The whole call's Problem, its k and v stand-ins of Lk keys (zero strides: no memory).
    def whole(x):
        return np.broadcast_to(np.zeros((), x.dtype), x.shape[:-2] + (Lk, x.shape[-1]))

    p = _args.Problem(q, whole(k), whole(v), scale=1.0, causal=static["causal"],
                      window=static["window"], kv_lengths=kv_len, q_lengths=q_len)
    lo, hi = _kernel.key_intervals(p)
    j = np.arange(a, b)
    visible = (j >= lo[..., None]) & (j < hi[..., None])
    visible = visible.reshape(p.batch + (1, p.Lq, b - a))
    if mask is None:
        return visible
    if mask.dtype == bool:
        return mask & visible
    return mask + np.where(visible, 0, -np.inf).astype(mask.dtype)


def _keep(x, axis=None, keepdims=True):
    return x


def _merge_packed(x, axis=None, keepdims=False):
    """Merge packed partials (rows with the lse as the last column) along ``axis``."""
    axis = axis[0] if isinstance(axis, tuple) else axis
    parts = np.moveaxis(x, axis, 0)
    out, lse = merge_attention(parts[..., :-1], parts[..., -1])
    packed = np.concatenate([out, lse[..., None]], axis=-1)
    return np.expand_dims(packed, axis) if keepdims else packed
