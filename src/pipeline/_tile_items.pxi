# A work item end to end (_attend_tile), and the merge of flash-decoding partials.
# One stage file of the tile pipeline: _tile_pipeline.pxi includes them in order.

# ---------------------------------------------------------------------------- work items

@cython.cdivision(True)   # next_bg >= 0
cdef void _attend_tile(const Problem* P, Py_ssize_t b, Py_ssize_t g, Py_ssize_t r0,
                       Py_ssize_t chunk, floating* partial,
                       floating* ws, Py_ssize_t* lo, Py_ssize_t* hi,
                       Py_ssize_t next_bg) noexcept nogil:
    # One tile: rows [r0, r0 + nrows) of kv head g of batch element b.
    #   chunk < 0:  all key chunks the rows see, merged in key order, rows written out;
    #   chunk >= 0: only that chunk; its state goes to `partial` (flash-decoding).
    # next_bg: b * Hkv + g of the tile its thread runs next (its first rows are requested
    # during this tile's last block), or -1.
    cdef Workspace w, direct
    cdef Tile t
    cdef Py_ssize_t kc, kc0 = 0, kc1 = 0
    _carve(&w, P, vec_lanes(ws))
    _setup(P, &t, b, g, r0, lo, hi, ws)
    if next_bg >= 0:
        t.next_b, t.next_g = next_bg // P.Hkv, next_bg % P.Hkv
    _setup_rows(P, &t, &w, ws)
    if t.decode and t.next_b >= 0:
        _prefetch_next_q(P, &t)
    if t.tile_lo < t.tile_hi:
        kc0 = t.tile_lo // FA_KCHUNK
        kc1 = (t.tile_hi + FA_KCHUNK - 1) // FA_KCHUNK
    if chunk >= 0:
        kc0, kc1 = chunk, chunk + 1
    fa_amx_begin(t.amx)
    if chunk < 0 and kc1 - kc0 == 1:
        # One key chunk (a short sequence): reduced straight into the running state, which
        # merging it into the empty state would copy exactly (_merge_chunk's factors are
        # then 0 and 1).
        direct = w
        direct.m, direct.l, direct.acc = w.M, w.L, w.ACC
        _reduce_chunk(P, &t, &direct, ws, kc0)
    else:
        _reset_state(ws + w.M, ws + w.L, ws + w.ACC, t.nlanes, t.dv_pad, _acc_rows(&t))
        for kc in range(kc0, kc1):
            _reduce_chunk(P, &t, &w, ws, kc)
            if chunk >= 0:
                _store_partial(P, &t, &w, ws, partial)
            else:
                _merge_chunk(&t, &w, ws, ws + w.m, ws + w.l, ws + w.acc)
    fa_amx_end(t.amx)
    if chunk < 0:
        _write_rows(P, &t, &w, ws)


cdef void _merge_partials(const Problem* P, Py_ssize_t b, Py_ssize_t g, Py_ssize_t r0,
                          const floating* partial, Py_ssize_t nchunk,
                          floating* ws) noexcept nogil:
    # Flash-decoding, second phase: merge a work item's chunk states in key order, exactly
    # as _attend_tile merges them when it walks all chunks itself, and write the rows.
    cdef Workspace w
    cdef Tile t
    cdef Py_ssize_t kc, VL = vec_lanes(ws)
    cdef Py_ssize_t cap = _partial_rows(P, VL), pst = _partial_elems(P, VL)
    cdef const floating* pc
    _carve(&w, P, VL)
    _setup(P, &t, b, g, r0, NULL, NULL, ws)
    _set_mask_shifts(P, &t, <const floating*> P.mask)
    _reset_state(ws + w.M, ws + w.L, ws + w.ACC, t.nlanes, t.dv_pad, _acc_rows(&t))
    for kc in range(nchunk):
        pc = partial + kc * pst
        _merge_chunk(&t, &w, ws, pc, pc + cap, pc + 2 * cap)
    _write_rows(P, &t, &w, ws)
