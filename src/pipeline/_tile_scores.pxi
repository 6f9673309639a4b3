# Stages 3 and 4: S^T = scale K Q^T (prefill tiles, decode lanes, quantised and bfloat16
# keys), then _finish_scores: the score modifiers and the visibility rule.
# One stage file of the tile pipeline: _tile_pipeline.pxi includes them in order.

# ---------------------------------------------------------------------------- scores

cdef void _scores_prefill(const Problem* P, Tile* t, const Workspace* w,
                          floating* ws) noexcept nogil:
    # S^T of the block (see _score_lanes).
    _score_lanes(t, w, ws, t.kblk, t.kblk_row, t.kptr, ws + w.qt, P.D, <floating> t.scale_log2,
                 ws + w.s)


cdef void _score_lanes(Tile* t, const Workspace* w, floating* ws, const char* kb,
                       Py_ssize_t k_row, const char** kptr, const floating* qt, Py_ssize_t D,
                       floating scale, floating* s) noexcept nogil:
    # s = scale kb qt for the block's keys (rows of kb, k_row bytes apart, in the compute
    # type; with bfloat16 products the rows kptr as stored, and qt in pairs of dims)
    # against the tile's rows packed in qt (D x FA_BQ), one lane group (2 vectors of
    # rows, or 1 for the last) at a time, in micro-tiles of FA_MR_K (6) keys; the last 4 or
    # fewer keys of a block in a 4-key tile (64 = 10 x 6 + 4: no scores computed for
    # padding keys).  Micro-tiles no row of the group can see are not computed
    # (_finish_scores hides them).
    cdef const char* zrow = <const char*> (ws + w.zrow)
    cdef Py_ssize_t VL = t.VL, NL = t.NL, nlanes = t.nlanes, j0 = t.j0, j1 = t.j1
    cdef Py_ssize_t nj = t.nj, c, ic, jj, ja, mk, g_lo, g_hi, u
    cdef int nvec
    for ic in range((nlanes + NL - 1) // NL):
        c = ic * NL
        nvec = <int> min(2, (nlanes - c) // VL)
        g_lo, g_hi = t.grp_lo[ic], t.grp_hi[ic]
        jj = 0
        while jj < nj:
            mk = FA_MR_K if nj - jj > 4 or nvec == 1 else 4
            ja = j0 + jj
            if ja + mk > g_lo and ja < g_hi:
                for u in range(mk):
                    t.krows[u] = kb + (jj + u) * k_row if ja + u < j1 else zrow
                if floating is float and t.bf16_dot:
                    for u in range(mk):
                        t.krows[u] = kptr[jj + u] if ja + u < j1 else zrow
                    score_tile_bdp(t.krows, <const uint32_t*> (qt + c), D, scale,
                                   s + jj * FA_BQ + c, nvec, mk)
                else:
                    score_tile(t.krows, qt + c, D, scale, s + jj * FA_BQ + c, nvec, mk)
            jj += mk


cdef void _scores_amx(const Problem* P, Tile* t, const Workspace* w, float* ws) noexcept nogil:
    # S^T of the block on AMX tiles, every lane of the tile (fa_amx_scores): the same
    # chain for a decode row as for a prefill row.  K through its row pointers.
    _lanes_amx(t, w, ws, t.kptr, ws + w.qt, P.D, <float> t.scale_log2, ws + w.s)


cdef inline void _lanes_amx(const Tile* t, const Workspace* w, float* ws,
                            const char** rows, const float* qt, Py_ssize_t D, float scale,
                            float* s) noexcept nogil:
    # s = scale rows qt on AMX tiles for the block's keys (the rows as stored, bfloat16)
    # against every lane of qt (pairs of dims): S^T, and the backward's dP^T.
    fa_amx_scores(t.amx, <const uint16_t* const*> rows, t.nj, <const uint32_t*> qt, FA_BQ,
                  t.nlanes, D, scale, s, FA_BQ, <uint16_t*> (ws + w.kst),
                  <const uint16_t*> (ws + w.zrow))


cdef void _scores_bf16_keys(const Problem* P, Tile* t, const Workspace* w,
                            float* ws) noexcept nogil:
    # S^T of a decode-sized tile with bfloat16 products: 16 keys at a time as the lanes
    # (zero keys pad the last call), against the rows in passes of 4, 2 or 1 (rows past
    # nrows read qt's zero padding and are not stored).  The chains of the prefill's
    # micro-tiles (fa_score_keys16x*_bdp).  These read a few lines of 16 rows at a time,
    # which no hardware prefetcher follows: each call requests the next call's K rows into
    # L1, and the same keys of the next block (K and V) into L2, spread over the block.
    cdef const uint32_t* qt = <const uint32_t*> (ws + w.qt)
    cdef const char* zrow = <const char*> (ws + w.zrow)
    cdef float scale = <float> t.scale_log2
    cdef Py_ssize_t jb, u, r, left, nxt = min(FA_BK, t.tile_hi - t.j1)
    cdef int nk
    jb = 0
    while jb < t.nj:
        nk = <int> min(16, t.nj - jb)
        for u in range(jb + 16, min(jb + 32, t.nj)):
            fa_prefetch_l1(t.kptr[u], P.D * P.k_isz)
        if not t.gather:
            for u in range(jb, min(jb + 16, nxt)):
                fa_prefetch_l2(t.kb + (t.j1 + u) * t.k_row, P.D * P.k_isz)
                fa_prefetch_l2(t.vb + (t.j1 + u) * t.v_row, P.Dv * P.v_isz)
        for u in range(16):
            t.krows[u] = t.kptr[jb + u] if u < nk else zrow
        r = 0
        while r < t.nrows:
            left = t.nrows - r
            if left > 2:
                fa_score_keys16x4_bdp(<const uint16_t**> t.krows, nk, qt + r, FA_BQ, P.D,
                                      scale, ws + w.s + jb * FA_BQ + r, FA_BQ)
                r += 4
            elif left == 2:
                fa_score_keys16x2_bdp(<const uint16_t**> t.krows, nk, qt + r, FA_BQ, P.D,
                                      scale, ws + w.s + jb * FA_BQ + r, FA_BQ)
                r += 2
            else:
                fa_score_keys16x1_bdp(<const uint16_t**> t.krows, nk, qt + r, FA_BQ, P.D,
                                      scale, ws + w.s + jb * FA_BQ + r, FA_BQ)
                r += 1
        jb += 16


cdef inline Py_ssize_t _keyrows_pass(const Tile* t, Py_ssize_t left) noexcept nogil:
    # Rows per decode score pass for `left` remaining rows: 8 (AVX-512) or 4 cover 3..8
    # rows at once (the extra rows read qt's zero padding), 2 and 1 exactly.  16-bit K
    # with the 4-row kernel (gqa4) goes 4 rows at a time: it widens the keys once for
    # two such passes.
    if left > 4 and FA_DEC_NR_MAX >= 8 and not t.gqa4:
        return 8
    if left > 2:
        return 4
    return left


cdef void _scores_decode(const Problem* P, Tile* t, const Workspace* w,
                         floating* ws) noexcept nogil:
    # S^T of a decode-sized tile, keys as the lanes: KC keys per call (zero keys pad the
    # last call), each against the rows in passes of 8/4/2/1 (4-row passes over a whole
    # call of 16-bit keys: fa_score_gqa4); only rows < nrows are stored.  The first pass
    # prefetches the V rows of its keys, unless the output kernel streams the next
    # block's V instead (pv_next_v; then only for the first block) or the block was
    # widened (_load_block prefetched it); gathered V, widened after the softmax
    # (defer_v), is requested where it is stored.  With spread_next it requests the next
    # block's K rows instead.
    # KC: one vector of lanes, or 32 (4 groups of 8) with 32-byte float vectors.
    cdef floating* s = ws + w.s
    cdef const floating* qt = ws + w.qt
    cdef const char* zrow = <const char*> (ws + w.zrow)
    cdef floating scale = <floating> t.scale_log2
    cdef Py_ssize_t KC = FA_DEC_KEYS_F if floating is float else FA_VL_D
    cdef Py_ssize_t nj = t.nj, nrows = t.nrows, u, r, ig, jb, nr, pf_bytes, ldk
    cdef int npass
    cdef bint pf_v = ((not t.pv_next_v or t.first_blk) and not t.widen_v or t.defer_v
                      or t.spread_next)
    cdef int nk
    if floating is float and t.int8_dot:
        _scores_int8(P, t, w, ws)
        return
    if floating is float and t.quant_in_place:
        _scores_quant(P, t, w, ws)
        return
    for ig in range((nj + KC - 1) // KC):
        jb = ig * KC
        nk = <int> min(KC, nj - jb)
        for u in range(KC):
            if jb + u >= nj:
                t.krows[u] = zrow
            elif t.copy_rows:
                t.krows[u] = t.kptr[jb + u]
            else:
                t.krows[u] = t.kblk + (jb + u) * t.kblk_row
            if t.spread_next:
                t.vrows[u] = t.kpf[jb + u] if jb + u < t.npf else zrow
            elif jb + u >= nj:
                t.vrows[u] = zrow
            elif t.defer_v or t.v_in_place:
                t.vrows[u] = t.vptr[jb + u]
            else:
                t.vrows[u] = t.vblk + (jb + u) * t.vblk_row
        # A whole call of keys is evenly spaced rows of K: say so (kernels may use it).
        ldk = t.kblk_sj if nk == KC else 0
        # > 0 also turns on the next K rows stream
        if t.spread_next:
            pf_bytes = P.D * P.k_isz
        else:
            pf_bytes = P.Dv * (P.v_isz if t.defer_v or t.v_in_place else t.vblk_esz)
        r = 0
        while r < nrows:
            nr = _keyrows_pass(t, nrows - r)
            if floating is float:
                if nr == 4 and (ldk != 0 or t.copy_rows) and t.gqa4:
                    # a second 4-row pass follows (more than 2 rows after these 4): one
                    # call takes both, widening the keys once
                    npass = 2 if nrows - r > 6 else 1
                    score_gqa4(t.krows, ldk, qt + r, t.ldqt, P.D, scale,
                               s + jb * FA_BQ + r, <int> (nrows - r),
                               t.vrows if pf_v else NULL, pf_bytes, t.kblk_kind, npass)
                    r += 4 * npass
                    pf_bytes = 0
                    continue
            score_keyrows(nr, t.krows, ldk, nk, qt + r, t.ldqt, P.D, scale,
                          s + jb * FA_BQ + r, <int> (nrows - r),
                          t.vrows if pf_v else NULL, pf_bytes, t.kblk_kind)
            r += nr
            pf_bytes = 0
    t.first_blk = False


cdef void _scores_quant(const Problem* P, Tile* t, const Workspace* w,
                        float* ws) noexcept nogil:
    # S^T of a decode tile over quantised K read in place (fa_score_quant): KC keys at a
    # time as the lanes (zero rows pad the last call), against the rows in passes of
    # 8/4/2/1.  The first pass of each call requests the next call's K rows into L1 and
    # the next block's into L2.
    cdef const char* zrow = <const char*> (ws + w.zrow)
    cdef Py_ssize_t jb = 0, u, r, nr, KC
    cdef int nk, npf, nl1
    KC = fa_score_quant_keys(<int> _keyrows_pass(t, t.nrows))
    for u in range(KC, 32):
        t.krows[u] = zrow
    while jb < t.nj:
        nk = <int> min(KC, t.nj - jb)
        for u in range(KC):
            t.krows[u] = t.kptr[jb + u] if u < nk else zrow
        npf = <int> max(0, min(nk, t.npf - jb))
        nl1 = <int> max(0, min(KC, t.nj - jb - KC))
        r = 0
        while r < t.nrows:
            nr = _keyrows_pass(t, t.nrows - r)
            fa_score_quant(P.k_kind, <int> nr, <const uint8_t**> t.krows, ws + w.kblk + jb,
                           FA_BK, nk, ws + w.qt + r, t.ldqt, P.D, <float> t.scale_log2,
                           ws + w.s + jb * FA_BQ + r, FA_BQ, <int> (t.nrows - r),
                           t.kpf + jb, npf, t.kptr + jb + KC, nl1)
            r += nr
            npf = nl1 = 0
        jb += KC
    t.first_blk = False


cdef void _scores_int8(const Problem* P, Tile* t, const Workspace* w,
                       float* ws) noexcept nogil:
    # S^T of a tile over q8_0 or q4_0 K read in place with integer products
    # (fa_score_int8, on the rows _quantise_q wrote): FA_I8_KEYS keys at a time as the
    # lanes (zero rows pad the last call), against the rows in passes of up to
    # FA_I8_MAX_ROWS (rows past nrows read quantised zeros and are not stored).  Requests
    # as _scores_quant's.
    cdef const char* zrow = <const char*> (ws + w.zrow)
    cdef Py_ssize_t jb = 0, u, r, nr, D = P.D, nb = P.D // 32
    cdef const int8_t* qi = <const int8_t*> (ws + w.qi)
    cdef const float* qd = ws + w.qi + FA_BQ * D // 4
    cdef const int32_t* qs = <const int32_t*> (qd + FA_BQ * nb)
    cdef int nk, npf, nl1
    while jb < t.nj:
        nk = <int> min(FA_I8_KEYS, t.nj - jb)
        for u in range(FA_I8_KEYS):
            t.krows[u] = t.kptr[jb + u] if u < nk else zrow
        npf = <int> max(0, min(nk, t.npf - jb))
        nl1 = <int> max(0, min(FA_I8_KEYS, t.nj - jb - FA_I8_KEYS))
        r = 0
        while r < t.nrows:
            nr = _int8_pass(t.nrows - r)
            fa_score_int8(P.k_kind, <int> nr, <const uint8_t**> t.krows, ws + w.kblk + jb,
                          FA_BK, nk, qi + r * D, qd + r * nb, qs + r * nb, D,
                          <float> t.scale_log2, ws + w.s + jb * FA_BQ + r, FA_BQ,
                          <int> (t.nrows - r), t.kpf + jb, npf, t.kptr + jb + FA_I8_KEYS, nl1)
            r += nr
            npf = nl1 = 0
        jb += FA_I8_KEYS
    t.first_blk = False


cdef inline Py_ssize_t _int8_pass(Py_ssize_t left) noexcept nogil:
    # Rows per integer score pass: FA_I8_MAX_ROWS or 4 cover several rows at once (the
    # extra rows read quantised zeros), 2 and 1 exactly.
    if left > 4 and FA_I8_MAX_ROWS >= 8:
        return 8
    if left > 2:
        return 4
    return left


# ---------------------------------------------------------------------------- finish scores

cdef void _finish_scores(const Problem* P, const Tile* t, const Workspace* w,
                         floating* ws) noexcept nogil:
    # Every score modifier, then the visibility rule, for the block's keys [j0, j1): the
    # only code that reads the mask or writes -inf.  Per lane group (as the score stage
    # computed it): keys no row of the group sees become -inf as whole vectors (the score
    # stage skipped them), then each row's own modifiers and hidden keys.
    cdef floating* s = ws + w.s
    cdef Py_ssize_t width = t.nlanes if t.decode else t.NL
    cdef Py_ssize_t j0 = t.j0, j1 = t.j1, c, ig, r, rend, g_lo, g_hi
    cdef int nvec
    if t.same_keys and P.mask_kind == 0 and P.softcap <= 0 and P.alibi == NULL:
        return   # every row sees every key of the block, unmodified (most decode steps)
    for ig in range((t.nlanes + width - 1) // width):
        c = ig * width
        nvec = <int> (min(width, t.nlanes - c) // t.VL)
        rend = min(c + nvec * t.VL, t.nrows)
        g_lo = min(max(t.grp_lo[ig], j0), j1)
        g_hi = min(max(t.grp_hi[ig], g_lo), j1)
        if g_lo < g_hi:
            _modify_scores(P, t, w, ws, c, nvec, g_lo, g_hi)
        hide_keys(s + c, g_lo - j0, nvec)
        hide_keys(s + (g_hi - j0) * FA_BQ + c, j1 - g_hi, nvec)
        if P.mask_kind == 0:
            # no per-row modifier: only the keys some row of the group does not see
            _hide_per_row(t, s, c, rend, g_lo, min(max(t.grp_all_lo[ig], g_lo), g_hi))
            _hide_per_row(t, s, c, rend, min(max(t.grp_all_hi[ig], g_lo), g_hi), g_hi)
            continue
        for r in range(c, rend):
            _finish_row(P, t, s + r, r, g_lo, g_hi)


cdef inline void _hide_per_row(const Tile* t, floating* s, Py_ssize_t c, Py_ssize_t rend,
                               Py_ssize_t ja, Py_ssize_t jz) noexcept nogil:
    # -inf for the keys [ja, jz) of the block that rows [c, rend) do not see, key by key
    # (a row of S^T is contiguous; row by row would write a cache line per key).
    cdef Py_ssize_t j, r
    cdef floating ninf = -INFINITY
    cdef floating* sj
    for j in range(ja, jz):
        sj = s + (j - t.j0) * FA_BQ
        for r in range(c, rend):
            if j < t.lo[r] or j >= t.hi[r]:
                sj[r] = ninf


cdef inline void _alibi_row(const Problem* P, const Tile* t, const Workspace* w,
                            floating* ws, Py_ssize_t r, Py_ssize_t h, Py_ssize_t i,
                            bint real) noexcept nogil:
    # ALiBi's terms of lane r, set once per tile (by _setup_rows) for _modify_scores to add
    # to every key block: -slope * log2(e) of its query head h, and its diagonal
    # i + kv_len - q_len (the key at distance 0); zeros without ALiBi and for a padding
    # lane (not real), whose scores are never read.
    ws[w.nslope + r] = 0
    ws[w.diag + r] = 0
    if real and P.alibi != NULL:
        ws[w.nslope + r] = <floating> (-P.alibi[t.b * P.Hq + h] * LOG2E)
        ws[w.diag + r] = <floating> (i + t.kv_len - t.q_len)


cdef inline void _modify_scores(const Problem* P, const Tile* t, const Workspace* w,
                               floating* ws, Py_ssize_t c, int nvec, Py_ssize_t g_lo,
                               Py_ssize_t g_hi) noexcept nogil:
    # The score modifiers that apply to whole vectors of rows, in order: softcap, then the
    # ALiBi bias (its per-row terms from _alibi_row), on keys [g_lo, g_hi) of the lane
    # group starting at row c.
    cdef floating* s = ws + w.s + (g_lo - t.j0) * FA_BQ + c
    if P.softcap > 0:
        softcap(s, g_hi - g_lo, nvec, P.softcap * LOG2E)
        if P.backward:
            # the chain rule through the cap, before the bias is added
            softcap_slope(s, ws + w.slope + (g_lo - t.j0) * FA_BQ + c, g_hi - g_lo, nvec,
                          P.softcap * LOG2E)
    if P.alibi != NULL:
        alibi(s, g_lo, g_hi - g_lo, ws + w.nslope + c, ws + w.diag + c, nvec)


cdef inline double _sink2(const Problem* P, double sink, double shift) noexcept nogil:
    # A sink logit as the row's finished scores hold it: base 2, less the cap and the row's
    # mask shift (_mask_shift).
    if shift == 0:
        return sink * LOG2E - _cap_shift(P)
    return (sink - shift) * LOG2E - _cap_shift(P)


cdef inline double _cap_shift(const Problem* P) noexcept nogil:
    # What the finished scores (base 2) lack: softcap keeps capped scores less the cap c,
    # so that those near the cap keep their low bits (see fa_softcap_f); the softmax is
    # the same, and lse, the sinks and the backward's P add c back.
    return P.softcap * LOG2E if P.softcap > 0 else 0


cdef inline void _finish_row(const Problem* P, const Tile* t, floating* sr, Py_ssize_t r,
                             Py_ssize_t g_lo, Py_ssize_t g_hi) noexcept nogil:
    # Row r's scores sr[(j - j0) * FA_BQ], keys [g_lo, g_hi) of the block: the modifiers on
    # the keys it may see, [a, z), and -inf on the others.
    cdef Py_ssize_t j0 = t.j0, j
    cdef Py_ssize_t a = max(j0, t.lo[r]), z = min(t.j1, t.hi[r])
    cdef floating ninf = -INFINITY
    if a < z and P.mask_kind != 0:
        _apply_mask(P, t, sr, r, a, z)
    for j in range(g_lo, min(a, g_hi)):
        sr[(j - j0) * FA_BQ] = ninf
    for j in range(max(z, g_lo), g_hi):
        sr[(j - j0) * FA_BQ] = ninf


cdef inline void _apply_mask(const Problem* P, const Tile* t, floating* sr, Py_ssize_t r,
                             Py_ssize_t a, Py_ssize_t z) noexcept nogil:
    # The user's mask on keys [a, z) of row r: a bool mask hides keys, a float mask is added
    # (in base 2, like the scores), less the row's shift (_set_mask_shifts).
    cdef Py_ssize_t h, i, j, j0 = t.j0
    cdef floating log2e = <floating> LOG2E
    cdef floating ninf = -INFINITY
    cdef const char* mrow
    cdef const floating* mask
    cdef floating shift
    _row_position(P, t, r, &h, &i)
    if P.mask_kind == 1:
        mrow = P.mask + P.m_boff[t.b] + h * P.m_sh + i * P.m_si
        for j in range(a, z):
            if not (<const unsigned char*> mrow)[j * P.m_sj]:
                sr[(j - j0) * FA_BQ] = ninf
    else:
        mask = (<const floating*> P.mask) + _mask_row(P, t, h, i)
        shift = <floating> t.mshift[r]
        for j in range(a, z):
            sr[(j - j0) * FA_BQ] += (mask[j * P.m_sj] - shift) * log2e


cdef inline Py_ssize_t _mask_row(const Problem* P, const Tile* t, Py_ssize_t h,
                                 Py_ssize_t i) noexcept nogil:
    # The element offset of the float mask's row of query head h, position i.
    return P.m_boff[t.b] + h * P.m_sh + i * P.m_si


cdef inline double _mask_shift(const Problem* P, const Tile* t, Py_ssize_t r) noexcept nogil:
    # Row r's float mask shift (_set_mask_shifts), 0 without a float mask.
    return t.mshift[r] if P.mask_kind == 2 else 0


cdef void _set_mask_shifts(const Problem* P, Tile* t, const floating* mask) noexcept nogil:
    # The constant each row's float mask (`mask`: P.mask in the compute type) is shifted by:
    # its largest finite value over the row's visible keys (0 without a float mask, for a
    # row that sees nothing, or one whose mask holds no finite value there).  The softmax
    # is the same for any constant, and lse, the sinks and the backward add it back; but a
    # mask of large magnitude (ALiBi as a mask, up to slope x length) would otherwise round
    # the finished scores at its magnitude, in base 2 half a binade above the natural
    # scores', while the mask less its row's largest value is exact near that value, where
    # the keys that carry the softmax are.  A row's shift is its own, whatever the tile or
    # key chunk: decode steps keep the prefill's bits.
    cdef Py_ssize_t r, h, i, lo, hi, j, m0
    cdef floating m, best
    if P.mask_kind != 2:
        return
    for r in range(t.nrows):
        t.mshift[r] = 0
        _row_position(P, t, r, &h, &i)
        if i >= t.q_len:
            continue
        fa_key_interval(i, t.q_len, t.kv_len, P.causal, P.wl, P.wr, &lo, &hi)
        m0 = _mask_row(P, t, h, i)
        best = -INFINITY
        for j in range(lo, hi):
            m = mask[m0 + j * P.m_sj]
            if m > best and m != INFINITY:
                best = m
        if best != -INFINITY:
            t.mshift[r] = best
