"""transformers' continuous batching on fastattn: its paged cache read in place.

transformers' continuous batching (``generate_batch``, ``ContinuousBatchingManager``) packs
the new tokens of every request of a step into one row of queries and hands each attention
layer its ``PagedAttentionCache`` with the step's layout: ``cu_seq_lens_q`` (where each
request's queries start), ``cu_seq_lens_k`` (its keys, cached and new, per layer type) and,
per cache allocator, ``write_index`` (the physical token rows of the new keys) and
``read_index`` (the rows of all of a request's keys, in order).

transformers' own path writes the new rows and then gathers every request's keys into a
contiguous copy (``index_select``).  Here the new rows are written the same way
(``index_copy_``) and the keys are read where they are: the allocator's cache is a pool of
pages ``(pages, page, Hkv, D)``, so every ``page``-th read index over the page size is a
request's block table, and ``fastattn.attention_with_kvcache`` reads the pool through it.
Requests that decode one token are batched into one call, through one plan per step that
every layer reuses (:func:`fastattn.plan_kvcache`); a request's prefill chunk is one call of
its own rows, causal and aligned to its last key, over its cached and new keys.

Only full-attention layers are read this way.  A sliding-window layer's ring buffer holds a
request's last keys out of order, so there the cache's own update gathers them (in order,
the window's last ``w - 1`` cached keys and the new ones) and the packed requests go to
``fastattn.attention_varlen``, causal with the window.
"""
import numpy as np

import fastattn

from . import _ops

FULL_ATTENTION = "full_attention"


def attention(module, query, key, value, *, cache, scaling=None, softcap=None, s_aux=None,
              sinks=None, **kwargs):
    """One attention layer of a continuous-batching step: ``(out, None)`` with ``out``
    ``(1, total_q, Hq, Dv)``."""
    import torch

    layer = module.layer_idx
    allocator = cache.layer_to_allocator[layer]
    if allocator.layer_type != FULL_ATTENTION:
        return _sliding(module, query, key, value, cache, scaling, softcap,
                        s_aux if sinks is None else sinks, kwargs)
    write = kwargs["write_index"][allocator.index]
    read = kwargs["read_index"][allocator.index]
    k_rows, v_rows = allocator._kv_token_views[layer]
    k_rows.index_copy_(0, write, key[0].transpose(0, 1))
    v_rows.index_copy_(0, write, value[0].transpose(0, 1))
    k_pages, v_pages = (np.swapaxes(_ops.view(p), 1, 2)
                        for p in allocator._kv_page_views[layer])
    step = _Step.of(kwargs["cu_seq_lens_q"], kwargs["cu_seq_lens_k"][allocator.layer_type],
                    read if read.numel() else write, allocator.tokens_per_page,
                    dict(scale=scaling, softcap=None if softcap is None else float(softcap)))
    q = _ops.view(query)[0]                                     # (Hq, total_q, D)
    out = torch.empty((1, q.shape[1], q.shape[0], v_pages.shape[-1]), dtype=query.dtype)
    out_rows = _ops.view(out)[0]                                # (total_q, Hq, Dv)
    sinks = s_aux if sinks is None else sinks
    sink_array = None if sinks is None else _ops.view(sinks.detach().float().contiguous())
    step.attend(q, k_pages, v_pages, out_rows, sink_array)
    return out, None


def _sliding(module, query, key, value, cache, scaling, softcap, sinks, kwargs):
    """A sliding-window layer: the keys gathered by the cache's update, then varlen."""
    import torch

    allocator = cache.layer_to_allocator[module.layer_idx]
    key, value = cache.update(key, value, module.layer_idx, kwargs)   # kwargs: this layer's
    w = kwargs.get("sliding_window") or allocator.sliding_window
    q = _ops.view(query)[0]
    out = torch.empty((1, q.shape[1], q.shape[0], value.shape[-1]), dtype=query.dtype)
    res = fastattn.attention_varlen(
        q, _ops.view(key)[0], _ops.view(value)[0],
        np.asarray(kwargs["cu_seq_lens_q"].cpu(), np.int64),
        np.asarray(kwargs["cu_seq_lens_k"].cpu(), np.int64), scale=scaling, causal=True,
        window=(int(w) - 1, 0), softcap=None if softcap is None else float(softcap),
        sinks=None if sinks is None else _ops.view(sinks.detach().float().contiguous()))
    _ops.view(out)[0] = res.swapaxes(0, 1)
    return out, None


class _Step:
    """The layout of one step, shared by its layers: the requests' lengths and block
    tables, and the plan of its decoding requests.  A step is recognised by its contents
    (query starts, key starts, read rows), so a layer of the next step never reuses it."""

    _last = None

    def __init__(self, cu_q, cu_k, rows, page, modifiers):
        self.key = (cu_q, cu_k, rows, page, tuple(sorted(modifiers.items())))
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
    def of(cls, cu_q, cu_k, rows, page, modifiers):
        cu_q, cu_k = (np.asarray(t.cpu(), np.int64) for t in (cu_q, cu_k))
        rows = np.asarray(rows.cpu(), np.int64)
        last = cls._last
        if (last is not None and last.key[3] == page
                and last.key[4] == tuple(sorted(modifiers.items()))
                and all(np.array_equal(a, b) for a, b in zip(last.key[:3], (cu_q, cu_k, rows)))):
            return last
        cls._last = cls(cu_q, cu_k, rows, page, modifiers)
        return cls._last

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
