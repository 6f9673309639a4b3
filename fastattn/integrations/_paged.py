"""transformers' continuous batching on fastattn: its paged cache read in place.

transformers' continuous batching (``generate_batch``, ``ContinuousBatchingManager``) packs
the new tokens of every request of a step into one row of queries.  Each attention layer's
keyword arguments describe the step: ``cu_seq_lens_q`` (where each request's queries
start), ``cu_seq_lens_k`` (its keys, cached and new) and, per cache allocator,
``write_index`` (the physical token rows of the new keys) and ``read_index`` (the rows of
all of a request's keys, in order).  The layer's keys reach the cache through
``PagedAttentionCache.update(key_states, value_states, layer_idx, kwargs)``, which writes
the new rows, picks this layer's ``cu_seq_lens_k`` out of ``kwargs`` and gathers every
request's keys into a contiguous copy (``index_select``).  transformers 5.23 calls it from
the attention function (which then receives the cache as ``cache=``); 5.24 calls it from the
model's attention layer, before the attention function.

Here the gather is skipped either way: fastattn's wrapper of ``update`` hands it this
layer's read index emptied, so it only writes (its own write-only path), and passes the
allocator's pages (``get_cache_for_block_table``, a pool ``(pages, page, Hkv, D)``) to the
attention function in ``kwargs``.  Every ``page``-th read row over the page size is a
request's block table, and ``fastattn.attention_with_kvcache`` reads the pool through it.
Requests that decode one token are batched into one call, through one plan per step that
every layer reuses (:func:`fastattn.plan_kvcache`); a request's prefill chunk is one call of
its own rows, causal and aligned to its last key, over its cached and new keys.

Only full-attention layers are read this way.  A sliding-window layer's ring buffer holds a
request's last keys out of order, so there the cache's own update gathers them (in order,
the window's last ``w - 1`` cached keys and the new ones) and the packed requests go to
``fastattn.attention_varlen``, causal with the window.

The internals this rests on are named in :data:`INTERNALS`, each with the check that guards
it.  Where a check fails, the step runs on transformers' own cache path -- its update
gathers each request's keys, and ``fastattn.attention_varlen`` attends over them -- with one
``RuntimeWarning`` naming the transformers release.  The tokens are the same either way.
"""
import functools
import inspect
import warnings

import numpy as np

import fastattn

from . import _ops

FULL_ATTENTION = "full_attention"

# transformers' internals that the in-place read rests on (and nothing else of its private
# surface), with where each is checked.
INTERNALS = {
    "PagedAttentionCache.update(key_states, value_states, layer_idx, kwargs)":
        "its signature at register(); at every call, that an emptied read index makes it "
        "return the new rows it was given (no gather)",
    "FullAttentionCacheAllocator.get_cache_for_block_table(layer_idx)":
        "at every call, that the page pool it returns holds the rows the update just wrote",
    "ContinuousBatchingManager.switch_to_cb_friendly_attn, and its manager's "
    "_original_attn_impl (the name restored when the manager stops)":
        "the method at register(); the attribute when a manager switches a model",
    "config._attn_implementation (written, as set_attn_implementation does, without its "
    "search for a flash package behind a 'flash' name)":
        "when a manager switches a model",
}

# The keyword under which the update hands the attention function this layer's pages.
PAGES = "fastattn_pages"

# One warning per reason and process: a step calls the layers many times.
_warned = set()


# What continuous batching does where an internal differs (the usual case).
GATHERED = ("continuous batching runs on transformers' own cache path (its update gathers "
            "each request's keys), with the same tokens")


def warn_once(reason, then=GATHERED):
    """One ``RuntimeWarning`` per ``reason``, naming the transformers release."""
    if reason in _warned:
        return
    _warned.add(reason)
    import transformers
    warnings.warn(f"fastattn relies on an internal of transformers {transformers.__version__} "
                  f"that differs here ({reason}): {then}", RuntimeWarning, stacklevel=3)


# --------------------------------------------------------------------------- the cache's update

def install(runs_on_fastattn):
    """Wrap ``PagedAttentionCache.update`` (once) so that, for a cache whose model
    ``runs_on_fastattn(name)``, it writes without gathering and hands over its pages.
    Returns why it cannot, or None."""
    from transformers.generation.continuous_batching import PagedAttentionCache

    update = PagedAttentionCache.update
    if getattr(update, "_fastattn", False):
        return None
    expected = ["self", "key_states", "value_states", "layer_idx", "kwargs"]
    if list(inspect.signature(update).parameters) != expected:
        return f"PagedAttentionCache.update's arguments are not {expected[1:]}"

    @functools.wraps(update)
    def wrapper(self, key_states, value_states, layer_idx, kwargs):
        if not runs_on_fastattn(getattr(self.config, "_attn_implementation", None)):
            return update(self, key_states, value_states, layer_idx, kwargs)
        return write_in_place(update, self, key_states, value_states, layer_idx, kwargs)

    wrapper._fastattn = True
    PagedAttentionCache.update = wrapper
    return None


def write_in_place(update, cache, key, value, layer, kwargs):
    """transformers' ``update`` writing this layer's new rows without gathering, and the
    allocator's pages put in ``kwargs[PAGES]`` for the attention function.  Where a check
    fails, the update as transformers runs it (a gather), and no pages."""
    allocator = cache.layer_to_allocator[layer]
    if allocator.layer_type != FULL_ATTENTION or kwargs.get("block_table") is not None:
        return update(cache, key, value, layer, kwargs)
    i = allocator.index
    reads = kwargs["read_index"]
    read, write = reads[i], kwargs["write_index"][i]
    as_given = dict(kwargs)
    # An emptied read index is the update's own write-only path: no gather.
    kwargs["read_index"] = [r[:0] if j == i else r for j, r in enumerate(reads)]
    k, v = update(cache, key, value, layer, kwargs)
    kwargs["read_index"] = reads
    reason = _unwritten(k, v, key, value)
    if reason is None:
        try:
            k_pages, v_pages = allocator.get_cache_for_block_table(layer)
        except Exception as e:   # noqa: BLE001  (any failure means: read as transformers does)
            reason = f"get_cache_for_block_table failed: {e!r}"
        else:
            reason = _unseen(k_pages, v_pages, key, value, write, allocator.tokens_per_page)
    if reason is not None:
        warn_once(reason)
        kwargs.clear()
        kwargs.update(as_given)
        k, v = update(cache, key, value, layer, kwargs)   # rewrites the same rows, gathers
        kwargs[PAGES] = None                              # (and the reason is told)
        return k, v
    kwargs[PAGES] = (k_pages, v_pages, read if read.numel() else write,
                     allocator.tokens_per_page)
    return k, v


def _unwritten(k, v, key, value):
    """Why the update with an emptied read index did not return the new rows, or None."""
    if not (k.shape == key.shape and v.shape == value.shape
            and k.data_ptr() == key.data_ptr() and v.data_ptr() == value.data_ptr()):
        return "an update with no rows to read still returned other keys than the new ones"
    return None


def _unseen(k_pages, v_pages, key, value, write, page):
    """Why the pages do not hold the rows the update wrote (first and last), or None."""
    import torch

    if k_pages.dim() != 4 or k_pages.shape[1] != page or k_pages.shape[2] != key.shape[1]:
        return f"the page pool's shape {tuple(k_pages.shape)} is not (pages, {page}, Hkv, D)"
    if not (k_pages.is_contiguous() and v_pages.is_contiguous()):
        return "the page pool is not one contiguous run of token rows"
    for pages, new in ((k_pages, key), (v_pages, value)):
        flat = pages.view(-1, *pages.shape[2:])
        for n in ({0, write.numel() - 1} if write.numel() else ()):   # first and last
            r = int(write[n])
            if r >= flat.shape[0] or not torch.equal(flat[r], new[0, :, n]):
                return "the page pool does not hold the rows the update wrote"
    return None


# --------------------------------------------------------------------------- attention

def attention(module, query, key, value, *, scaling=None, softcap=None, s_aux=None,
              sinks=None, cache=None, **kwargs):
    """One attention layer of a continuous-batching step: ``(out, None)`` with ``out``
    ``(1, total_q, Hq, Dv)``.  ``cache`` is given where transformers leaves the update to
    the attention function."""
    if cache is not None and isinstance(kwargs.get("cu_seq_lens_k"), dict):
        # not yet updated: the update picks this layer's key lengths out of the dict
        key, value = cache.update(key, value, module.layer_idx, kwargs)
    sinks = s_aux if sinks is None else sinks
    softcap = None if softcap is None else float(softcap)
    sink_array = None if sinks is None else _ops.view(sinks.detach().float().contiguous())
    pages = kwargs.get(PAGES)
    if pages is None:
        if PAGES not in kwargs and not kwargs.get("sliding_window"):
            warn_once("the cache's update handed over no pages for a full-attention layer")
        return _gathered(query, key, value, scaling, softcap, sink_array, kwargs)
    return _in_place(query, pages, scaling, softcap, sink_array, kwargs)


def _in_place(query, pages, scaling, softcap, sinks, kwargs):
    """A full-attention layer read from its pages."""
    import torch

    k_pages, v_pages, rows, page = pages
    k_pages, v_pages = (np.swapaxes(_ops.view(p), 1, 2) for p in (k_pages, v_pages))
    step = _Step.of(kwargs["cu_seq_lens_q"], kwargs["cu_seq_lens_k"], rows, page,
                    dict(scale=scaling, softcap=softcap))
    q = _ops.view(query)[0]                                     # (Hq, total_q, D)
    out = torch.empty((1, q.shape[1], q.shape[0], v_pages.shape[-1]), dtype=query.dtype)
    step.attend(q, k_pages, v_pages, _ops.view(out)[0], sinks)  # out rows (total_q, Hq, Dv)
    return out, None


def _gathered(query, key, value, scaling, softcap, sinks, kwargs):
    """The keys the cache's update gathered (each request's, in order; a sliding-window
    layer's last ``w - 1`` cached ones and the new ones), attended per request."""
    import torch

    w = kwargs.get("sliding_window")
    q = _ops.view(query)[0]
    out = torch.empty((1, q.shape[1], q.shape[0], value.shape[-1]), dtype=query.dtype)
    res = fastattn.attention_varlen(
        q, _ops.view(key)[0], _ops.view(value)[0],
        np.asarray(kwargs["cu_seq_lens_q"].cpu(), np.int64),
        np.asarray(kwargs["cu_seq_lens_k"].cpu(), np.int64), scale=scaling, causal=True,
        window=(int(w) - 1, 0) if w else None, softcap=softcap, sinks=sinks)
    _ops.view(out)[0] = res.swapaxes(0, 1)
    return out, None


class _Step:
    """The layout of one step, shared by its layers: the requests' lengths and block
    tables, and the plan of its decoding requests.  A step is kept on its ``cu_seq_lens_q``
    tensor, which every layer of the step is handed, and recognised by its contents (query
    starts, key starts, read rows), so a layer of another step never reuses it."""

    def __init__(self, key, cu_q, cu_k, rows, page, modifiers):
        self.key = key
        self.q_len = np.diff(cu_q)
        self.k_len = np.diff(cu_k)
        self.tables = [rows[cu_k[s]:cu_k[s + 1]:page] // page for s in range(len(self.q_len))]
        self.modifiers = modifiers
        self.decode = np.flatnonzero(self.q_len == 1)
        self.prefill = np.flatnonzero(self.q_len > 1)
        self.q_start = cu_q[:-1]
        self.plan = None
        if len(self.decode):
            table = _table([self.tables[s] for s in self.decode])
            self.plan = fastattn.plan_kvcache(
                cache_seqlens=self.k_len[self.decode].astype(np.int32), block_table=table,
                causal=True, **modifiers)

    @classmethod
    def of(cls, cu_q_tensor, cu_k, rows, page, modifiers):
        cu_q, cu_k, rows = (np.asarray(t.cpu(), np.int64) for t in (cu_q_tensor, cu_k, rows))
        shape = (page, tuple(sorted(modifiers.items())))
        kept = getattr(cu_q_tensor, "_fastattn_steps", None)
        if kept is None:
            kept = []
            try:
                cu_q_tensor._fastattn_steps = kept
            except (AttributeError, RuntimeError):   # a tensor that takes no attributes
                pass
        kept[:] = [s for s in kept if np.array_equal(s.key[1], cu_q)]   # other steps' go
        for step in kept:
            if step.key[0] == shape and all(np.array_equal(a, b)
                                            for a, b in zip(step.key[1:], (cu_q, cu_k, rows))):
                return step
        step = cls((shape, cu_q, cu_k, rows), cu_q, cu_k, rows, page, modifiers)
        kept.append(step)
        return step

    def attend(self, q, k_pages, v_pages, out_rows, sinks):
        """Every request's rows of ``out_rows`` ``(total_q, Hq, Dv)`` from its queries
        ``q[:, rows]`` over its keys in the pages."""
        if self.plan is not None:
            pos = self.q_start[self.decode]
            qd = np.ascontiguousarray(q[:, pos].swapaxes(0, 1)[:, :, None])  # (n, Hq, 1, D)
            res = self.plan.run(qd, k_pages, v_pages, sinks=sinks)
            out_rows[pos] = res[:, :, 0]
        for s in self.prefill:
            a, n = self.q_start[s], self.q_len[s]
            qs = np.ascontiguousarray(q[None, :, a:a + n])                    # (1, Hq, n, D)
            res = fastattn.attention_with_kvcache(
                qs, k_pages, v_pages, cache_seqlens=np.array([self.k_len[s]], np.int32),
                block_table=_table([self.tables[s]]), causal=True, sinks=sinks,
                **self.modifiers)
            out_rows[a:a + n] = res[0].swapaxes(0, 1)


def _table(rows):
    """A block table ``(len(rows), longest)`` of int32, rows padded with page 0 (never read:
    a request reads only its own keys)."""
    table = np.zeros((len(rows), max(len(r) for r in rows)), np.int32)
    for i, r in enumerate(rows):
        table[i, :len(r)] = r
    return table
