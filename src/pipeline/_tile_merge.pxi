# Stage 7: a key chunk merged into the running state (or stored as a flash-decoding
# partial), and the rows written: out = ACC / L, lse.
# One stage file of the tile pipeline: _tile_pipeline.pxi includes them in order.

# ---------------------------------------------------------------------------- chunks, merge

cdef void _reduce_chunk(const Problem* P, Tile* t, const Workspace* w, floating* ws,
                        Py_ssize_t kc) noexcept nogil:
    # The chunk's key blocks (multiples of FA_BK from key 0) that some row sees, in key
    # order, from the empty state: scores, finish, softmax step, P V.
    cdef Py_ssize_t c_lo = max(t.tile_lo, kc * FA_KCHUNK)
    cdef Py_ssize_t c_hi = min(t.tile_hi, kc * FA_KCHUNK + FA_KCHUNK), ib
    _reset_state(ws + w.m, ws + w.l, ws + w.acc, t.nlanes, t.dv_pad, _acc_rows(t))
    for ib in range(c_lo // FA_BK, (c_hi + FA_BK - 1) // FA_BK if c_lo < c_hi else 0):
        t.j0 = max(ib * FA_BK, t.tile_lo - t.tile_lo % _block_align(t))
        t.j1 = min(ib * FA_BK + FA_BK, t.tile_hi)
        t.nj = t.j1 - t.j0
        _load_block(P, t, w, ws)
        if t.decode:
            _scores_decode(P, t, w, ws)
        elif floating is float and t.amx:
            _scores_amx(P, t, w, ws)
        elif floating is float and t.bf16_dot and t.nrows <= FA_DECODE_ROWS:
            _scores_bf16_keys(P, t, w, ws)
        elif floating is float and t.int8_dot:
            _scores_int8(P, t, w, ws)
        else:
            _scores_prefill(P, t, w, ws)
        _finish_scores(P, t, w, ws)
        _softmax(t, w, ws)
        if t.defer_v:
            _gather_v(P, t, w, ws)
        if t.dv_tail:
            _load_vtail(t, w, ws)
        if t.decode:
            _pv_decode(P, t, w, ws)
        elif floating is float and t.amx:
            _pv_amx(t, w, ws)
        elif floating is float and t.bf16_dot:
            _pv_bf16(t, w, ws)
        else:
            _pv_prefill(t, w, ws)


cdef inline Py_ssize_t _block_align(const Tile* t) noexcept nogil:
    # Where a tile's first key block may start: any key, an even key for bfloat16 pairs,
    # a multiple of 32 on AMX tiles (a chunk of the output tiles).  The finish stage hides
    # the keys before the tile's first.
    if t.amx:
        return 32
    return 2 if t.bf16_dot else 1


cdef inline void _reset_state(floating* m, floating* l, floating* acc, Py_ssize_t nlanes,
                              Py_ssize_t dv_pad, Py_ssize_t acc_rows) noexcept nogil:
    # The empty softmax state: m = -inf, l = 0 for every lane, acc = 0 for its first
    # acc_rows rows (_acc_rows).
    cdef Py_ssize_t r
    for r in range(nlanes):
        m[r] = -INFINITY
        l[r] = 0
    memset(acc, 0, acc_rows * dv_pad * sizeof(floating))


cdef inline Py_ssize_t _acc_rows(const Tile* t) noexcept nogil:
    # The output rows a tile's kernels read: a decode tile's 4-row output tiles cover its
    # rows rounded up to 4, and nothing reads the rest of its padding lanes' rows (a GQA
    # group of 4 in 16 lanes of AVX-512 would otherwise clear four times its own bytes);
    # prefill tiles all their lanes.
    if t.decode:
        return min(t.nlanes, _round_up(t.nrows, 4))
    return t.nlanes


cdef void _merge_chunk(const Tile* t, const Workspace* w, floating* ws, const floating* m,
                       const floating* l, const floating* acc) noexcept nogil:
    # Merge one key chunk's state (m, l, acc) into the running state (M, L, ACC) of the
    # rows: fa_merge_stats / fa_merge_acc, the one merge every path uses.
    cdef Py_ssize_t c, iv, r, dv_pad = t.dv_pad
    cdef floating* fa = ws + w.fa
    cdef floating* fb = ws + w.fb
    for iv in range(t.nlanes // t.VL):
        c = iv * t.VL
        merge_stats(ws + w.M + c, ws + w.L + c, m + c, l + c, fa + c, fb + c)
    for r in range(t.nrows):
        merge_acc(ws + w.ACC + r * dv_pad, acc + r * dv_pad, dv_pad, fa[r], fb[r])


cdef void _store_partial(const Problem* P, const Tile* t, const Workspace* w, floating* ws,
                         floating* partial) noexcept nogil:
    # Flash-decoding: the chunk's state to its slot, laid out as _partial_elems says.
    cdef Py_ssize_t cap = _partial_rows(P, t.VL), r
    for r in range(t.nlanes):
        partial[r] = ws[w.m + r]
        partial[cap + r] = ws[w.l + r]
    memcpy(partial + 2 * cap, ws + w.acc, t.nrows * t.dv_pad * sizeof(floating))


cdef void _write_rows(const Problem* P, const Tile* t, const Workspace* w,
                      floating* ws) noexcept nogil:
    # out = ACC / L and lse = M ln 2 + log L for the rows of a work item; rows that saw
    # nothing (L == 0) get zeros and -inf.
    cdef const floating* M = ws + w.M
    cdef const floating* L = ws + w.L
    cdef const floating* ACC
    cdef Py_ssize_t r, h, i
    cdef double shift
    cdef char* orow
    # A 16-bit output row is computed into the workspace and rounded once.
    cdef bint narrow = P.o_kind != FA_STORE_NATIVE
    cdef floating* dst = ws + w.orow
    for r in range(t.nrows):
        _row_position(P, t, r, &h, &i)
        orow = P.out + (P.o_boff[t.b] + h * P.o_sh + i * P.o_si) * P.o_isz
        if not narrow:
            dst = <floating*> orow
        ACC = ws + w.ACC + r * t.dv_pad
        shift = _mask_shift(P, t, r)
        if P.sinks != NULL and i < t.q_len:
            _write_row_sink(P, t, dst, ACC, M[r], L[r], P.sinks[t.b * P.Hq + h], shift, h, i)
        else:
            _write_row(P, t, dst, ACC, M[r], L[r], shift, h, i)
        if narrow:
            narrow_row(P.o_kind, dst, P.Dv, orow)


cdef inline void _write_row(const Problem* P, const Tile* t, floating* orow,
                            const floating* ACC, floating M, floating L, double shift,
                            Py_ssize_t h, Py_ssize_t i) noexcept nogil:
    # out = ACC / L, lse = M ln 2 + log L (+ the row's mask shift).  L == 0 exactly iff no
    # key was visible (the max key alone contributes p = 1); a NaN or +inf score makes L
    # NaN, and the row NaN, as in the reference.  A division rounds once; a product with
    # 1 / L rounds twice, which at float32 costs up to one more unit in the last place of
    # every output.
    cdef Py_ssize_t c
    if L != 0:
        for c in range(P.Dv):
            orow[c] = ACC[c] / L
    else:
        for c in range(P.Dv):
            orow[c] = 0
    if P.lse != NULL:
        (<floating*> P.lse)[P.lse_boff[t.b] + h * P.lse_sh + i * P.lse_si] = (
            _lse(P, M, L, shift) if L != 0 else -INFINITY)


cdef inline double _lse(const Problem* P, double M, double L, double shift) noexcept nogil:
    # lse = M ln 2 + log L, M the row's base-2 maximum (less the cap shift, and the row's
    # mask shift where it has one, which are added back).  Without a mask shift, one
    # expression as ever: its product and sum may be one FMA, and its bits are then kept.
    if shift == 0:
        return (M + _cap_shift(P)) * LN2 + log(L)
    return (M + _cap_shift(P)) * LN2 + (shift + log(L))


cdef inline void _write_row_sink(const Problem* P, const Tile* t, floating* orow,
                                 const floating* ACC, floating M, floating L, double sink,
                                 double shift, Py_ssize_t h, Py_ssize_t i) noexcept nogil:
    # A row whose softmax denominator has one more logit, the head's sink, without a value:
    # out = ACC 2^M / (L 2^M + 2^sink2), lse = log of that denominator (natural log);
    # a row that saw no key gets zeros and lse = sink.  sink2 is in the scores' base 2,
    # shifted as they are (the cap, the row's mask shift).
    cdef double sink2 = _sink2(P, sink, shift), mx, a, den, f
    cdef Py_ssize_t c
    cdef double lse = sink
    if L == 0:
        for c in range(P.Dv):
            orow[c] = 0
    else:
        mx = max(<double> M, sink2)
        a = exp2(M - mx)
        den = L * a + exp2(sink2 - mx)
        # in double and rounded once, as ACC / L is
        f = a / den
        for c in range(P.Dv):
            orow[c] = <floating> (ACC[c] * f)
        lse = _lse(P, mx, den, shift)
    if P.lse != NULL:
        (<floating*> P.lse)[P.lse_boff[t.b] + h * P.lse_sh + i * P.lse_si] = <floating> lse
