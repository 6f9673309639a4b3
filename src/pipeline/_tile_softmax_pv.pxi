# Stages 5 and 6: the online-softmax step, then acc = acc * alpha + P V.
# One stage file of the tile pipeline: _tile_pipeline.pxi includes them in order.

# ---------------------------------------------------------------------------- softmax

cdef void _softmax(const Tile* t, const Workspace* w, floating* ws) noexcept nogil:
    # The online-softmax step, two vectors of rows per call (one for an odd last vector).
    # Keys of the block that no row of the vector(s) sees get p = 0 without an exp; an
    # empty range leaves the rows' state unchanged.
    cdef floating* s = ws + w.s
    cdef floating* m = ws + w.m
    cdef floating* l = ws + w.l
    cdef floating* alpha = ws + w.alpha
    cdef Py_ssize_t nv = t.nlanes // t.VL, j0 = t.j0, j1 = t.j1, ic = 0, c, vj0, vj1
    cdef int nvec
    while ic < nv:
        c = ic * t.VL
        nvec = <int> min(2, nv - ic)
        vj0 = min(max(min(t.vec_lo[ic], t.vec_lo[ic + nvec - 1]), j0), j1) - j0
        vj1 = max(min(max(t.vec_hi[ic], t.vec_hi[ic + nvec - 1]), j1) - j0, vj0)
        if floating is float and t.softmax_pairs:
            fa_softmax_pairs_f(s, FA_BQ, t.nj, vj0, vj1, m, l, alpha)
        else:
            softmax_step(s + c, t.nj, vj0, vj1, m + c, l + c, alpha + c, nvec)
        ic += nvec


# ---------------------------------------------------------------------------- P V

cdef void _load_vtail(const Tile* t, const Workspace* w, floating* ws) noexcept nogil:
    # V's last partial strip of columns, zero-padded to NL lanes, so that the output kernel
    # has a single variant (and never reads past a row of V).
    cdef floating* vtail = ws + w.vtail
    cdef const char* vrow
    cdef Py_ssize_t j, u, NL = t.NL
    for j in range(t.nj):
        vrow = t.vblk + j * t.vblk_row
        for u in range(NL):
            vtail[j * NL + u] = (load_elem(vrow, t.dv_main + u, t.vblk_kind, ws)
                                 if u < t.dv_tail else 0)


cdef inline void _pv_strips(const Tile* t, const Workspace* w, floating* ws,
                            const floating* p, Py_ssize_t na, const char* v, Py_ssize_t ja,
                            Py_ssize_t r, Py_ssize_t nr, Py_ssize_t c) noexcept nogil:
    # Output micro-tiles of nr (6 or 1) rows from row r over value columns [c, dv_main) in
    # 2-vector strips, then the zero-padded tail strip.
    cdef floating* acc = ws + w.acc + r * t.dv_pad
    cdef const floating* alpha = ws + w.alpha + r
    while c < t.dv_main:
        pv_tile(p, na, v + c * t.vblk_esz, t.vblk_sj, acc + c, t.dv_pad, alpha, nr,
                t.vblk_kind)
        c += t.NL
    if t.dv_tail:
        pv_tile_widened(p, na, ws + w.vtail + (ja - t.j0) * t.NL, t.NL, acc + t.dv_main,
                        t.dv_pad, alpha, nr)


cdef void _pv_rows(const Tile* t, const Workspace* w, floating* ws, Py_ssize_t rg,
                   Py_ssize_t nr, const char* pf, Py_ssize_t pf_stride, Py_ssize_t pf_rows,
                   Py_ssize_t pf_cols) noexcept nogil:
    # acc = acc * alpha + P V for rows [rg, rg + nr) over the keys any of them sees (the
    # others have p == 0 exactly): wide tiles first (4 rows x 4 vectors, 1 row x 8
    # vectors), then 2-vector strips, row by row for a 4-row group.  pf: pf_rows rows of
    # another block (pf_stride bytes apart) to prefetch beside the first pf_cols columns.
    cdef Py_ssize_t isz = t.vblk_esz, dv_pad = t.dv_pad, ja, z, na, c = 0, cw, r
    if nr == FA_MR_PV and rg + nr <= t.n6:
        ja, z = t.pv_lo[rg // FA_MR_PV], t.pv_hi[rg // FA_MR_PV]
    else:
        _keys_seen(t, rg, rg + nr, &ja, &z)
    ja = min(max(t.j0, ja), t.j1)
    na = max(0, min(t.j1, z) - ja)
    cdef const floating* p = ws + w.s + (ja - t.j0) * FA_BQ
    cdef const char* v = t.vblk + (ja - t.j0) * t.vblk_row
    if nr == 4 or nr == 1:
        cw = 2 * t.NL if nr == 4 else 4 * t.NL
        while c + cw <= t.dv_main:
            pv_wide(nr, p + rg, na, v + c * isz, t.vblk_sj, ws + w.acc + rg * dv_pad + c, dv_pad,
                    ws + w.alpha + rg, pf + c * isz if pf != NULL else NULL, pf_stride,
                    pf_rows if c < pf_cols else 0, min(cw, pf_cols - c) * isz, t.vblk_kind)
            c += cw
    if nr == 4:
        for r in range(rg, min(rg + 4, t.nrows)):
            _pv_strips(t, w, ws, p + r, na, v, ja, r, 1, c)
    else:
        _pv_strips(t, w, ws, p + rg, na, v, ja, rg, nr, c)


cdef void _pv_prefill(const Tile* t, const Workspace* w, floating* ws) noexcept nogil:
    # Rows in 6-row output tiles, then single rows.
    cdef Py_ssize_t rg = 0, nr
    while rg < t.nrows:
        nr = FA_MR_PV if rg < t.n6 else 1
        _pv_rows(t, w, ws, rg, nr, NULL, 0, 0, 0)
        rg += nr


cdef void _pv_bf16(const Tile* t, const Workspace* w, float* ws) noexcept nogil:
    # P rounded to bfloat16 in pairs of keys, then rows in 6-row output tiles and single
    # rows, each over the pairs of keys any of its rows sees (the others add exact zeros);
    # a decode tile (up to 4 rows that see the same keys) pairs V's rows as it reads them
    # (v_pairs_rows).
    cdef uint32_t* pp = <uint32_t*> (ws + w.pp)
    cdef const uint32_t* vp = <const uint32_t*> t.vblk
    cdef Py_ssize_t rg = 0, nr, ja, z, a, npairs, c, Dv = t.dv_main
    fa_pack_p_pairs(ws + w.s, FA_BQ, t.nj, t.nlanes, pp, FA_BQ)
    if t.v_pairs_rows:
        _keys_seen(t, 0, t.nrows, &ja, &z)
        ja = min(max(t.j0, ja), t.j1)
        z = min(max(ja, z), t.j1)
        a = (ja - t.j0) // 2
        fa_pv_rows_bdp(<int> t.nrows, pp + a * FA_BQ, FA_BQ, (z - t.j0 + 1) // 2 - a,
                       <const uint16_t* const*> (t.vptr + 2 * a), t.nj - 2 * a, Dv,
                       ws + w.acc, t.dv_pad, ws + w.alpha)
        return
    while rg < t.nrows:
        nr = FA_MR_PV if rg < t.n6 else 1
        if nr == FA_MR_PV:
            ja, z = t.pv_lo[rg // FA_MR_PV], t.pv_hi[rg // FA_MR_PV]
        else:
            _keys_seen(t, rg, rg + 1, &ja, &z)
        ja = min(max(t.j0, ja), t.j1)
        z = min(max(ja, z), t.j1)
        a = (ja - t.j0) // 2
        npairs = (z - t.j0 + 1) // 2 - a
        c = 0
        while c < Dv:
            if nr == FA_MR_PV:
                fa_pv_tile_bdp(pp + a * FA_BQ + rg, FA_BQ, npairs, vp + a * Dv + c, Dv,
                               ws + w.acc + rg * t.dv_pad + c, t.dv_pad, ws + w.alpha + rg)
            else:
                fa_pv_tile1_bdp(pp + a * FA_BQ + rg, FA_BQ, npairs, vp + a * Dv + c, Dv,
                                ws + w.acc + rg * t.dv_pad + c, t.dv_pad, ws + w.alpha + rg)
            c += t.NL
        rg += nr


cdef inline void _zero_pairs_to(uint32_t* pairs, Py_ssize_t n, Py_ssize_t n_pad,
                                Py_ssize_t ncols) noexcept nogil:
    # Zero pairs after the (n + 1) // 2 packed from n rows (ncols values a pair row), up
    # to n_pad // 2: AMX tiles read whole chunks of 16 pairs, and a stale NaN or infinity
    # times a zero weight would not be zero.
    cdef Py_ssize_t done = (n + 1) // 2
    memset(pairs + done * ncols, 0, (n_pad // 2 - done) * ncols * sizeof(uint32_t))


cdef void _pv_amx(const Tile* t, const Workspace* w, float* ws) noexcept nogil:
    # P rounded to bfloat16 rows (zero past the block's keys), then the output tiles over
    # the block's chunks of 32 keys (fa_amx_pv); V is in pairs of keys (_load_block).
    cdef uint16_t* pr = <uint16_t*> (ws + w.pr)
    fa_pack_p_rows(ws + w.s, FA_BQ, t.nj, t.nlanes, pr, FA_BK)
    fa_amx_pv(t.amx, pr, FA_BK, (t.nj + 31) // 32, t.nlanes, t.nrows,
              <const uint32_t*> t.vblk, t.dv_main, ws + w.acc, t.dv_pad, ws + w.alpha)


cdef void _pv_decode(const Problem* P, const Tile* t, const Workspace* w,
                     floating* ws) noexcept nogil:
    # A GQA group 4 rows at a time (each V vector loaded once for all 4; rows past nrows
    # are zero-initialised padding, never written out); a single row whole V rows, 8
    # vectors at a time.  K and V are read a few rows at a time, which the hardware
    # prefetchers do not follow, so the first row group also prefetches: the next block's
    # V rows for a single row of float32 V (pv_next_v: requests then go out during both
    # kernels), else the next block's K rows unless the score kernel streams them itself.
    # GQA groups keep their V prefetch in the score kernel (their output kernel is too
    # short to carry a stream), and so does a single row of 16-bit V (see _setup).
    cdef Py_ssize_t nr = 4 if t.nrows >= 2 else 1, rg, pf_rows = 0, ja, z
    cdef Py_ssize_t pf_stride, pf_cols
    cdef const char* pf
    if floating is float and t.quant_in_place:
        _pv_quant(P, t, w, ws, nr)
        return
    if floating is float and t.v_in_place:
        _pv_rows_ptr(P, t, w, ws, nr)
        return
    _keys_seen(t, 0, nr, &ja, &z)
    ja = min(max(t.j0, ja), t.j1)
    if t.widen_k or t.widen_v or t.gather:
        pf_rows = 0
    elif t.pv_next_v or not (floating is float
                             and (t.nrows <= FA_DEC_SCORES_PREFETCH_K_ROWS_F or t.gqa4)):
        pf_rows = max(0, min(max(0, min(t.j1, z) - ja), t.tile_hi - (ja + FA_BK)))
    if t.pv_next_v:
        pf, pf_stride, pf_cols = t.vb + (ja + FA_BK) * t.v_row, t.v_row, P.Dv
    else:
        pf, pf_stride, pf_cols = t.kb + (ja + FA_BK) * t.k_row, t.k_row, P.D
    _pv_rows(t, w, ws, 0, nr, pf, pf_stride, pf_rows, pf_cols)
    rg = nr
    while rg < t.nrows:
        _pv_rows(t, w, ws, rg, nr, pf, pf_stride, 0, pf_cols)
        rg += nr


cdef void _pv_rows_ptr(const Problem* P, const Tile* t, const Workspace* w, float* ws,
                       Py_ssize_t nr) noexcept nogil:
    # _pv_decode over V rows read through the block's row pointers (v_in_place): rows in
    # groups of nr (4, or 1 for a single row), each over the keys any of its rows sees.
    cdef Py_ssize_t rg = 0, ja, z, na
    while rg < t.nrows:
        _keys_seen(t, rg, rg + nr, &ja, &z)
        ja = min(max(t.j0, ja), t.j1)
        na = max(0, min(t.j1, z) - ja)
        pv_ptr(ws + w.s + (ja - t.j0) * FA_BQ + rg, na, t.vptr + (ja - t.j0), P.Dv,
               ws + w.acc + rg * t.dv_pad, t.dv_pad, ws + w.alpha + rg, <int> nr, P.v_kind,
               t.vpf, t.npf if rg == 0 else 0)
        rg += nr


cdef void _pv_quant(const Problem* P, const Tile* t, const Workspace* w, float* ws,
                    Py_ssize_t nr) noexcept nogil:
    # _pv_decode over quantised V read in place: rows in groups of nr (4, or 1 for a
    # single row), each over the keys any of its rows sees; the first group requests the
    # next block's V rows into L2.
    cdef Py_ssize_t rg = 0, ja, z, na
    while rg < t.nrows:
        _keys_seen(t, rg, rg + nr, &ja, &z)
        ja = min(max(t.j0, ja), t.j1)
        na = max(0, min(t.j1, z) - ja)
        fa_pv_quant(P.v_kind, ws + w.s + (ja - t.j0) * FA_BQ + rg, FA_BQ, na,
                    <const uint8_t**> (t.vptr + (ja - t.j0)),
                    ws + w.vblk + (ja - t.j0) * (P.Dv // 32), P.Dv,
                    ws + w.acc + rg * t.dv_pad, t.dv_pad, ws + w.alpha + rg, <int> nr,
                    t.vpf, t.npf if rg == 0 else 0)
        rg += nr
