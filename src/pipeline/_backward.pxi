# The backward pass of attention (FlashAttention-2's, made deterministic): the passes over
# the thread pool, on the forward's Problem (_problem.pxi) and the Grads beside it; the
# entry point, `backward`, is in _entry_points.pxi.
#
# Given the forward's out and lse, and dout (and dlse, the gradient of lse), with
# P = exp(S - lse) recomputed tile by tile and never stored whole:
#   Delta_i = rowsum(dout_i * out_i) - dlse_i
#   dV_j += sum_i P_ij dout_i          dP_ij = dout_i . v_j
#   dS_ij = P_ij (dP_ij - Delta_i) * (1 - tanh^2 of the capped score, with a softcap)
#   dQ_i = scale sum_j dS_ij k_j       dK_j = scale sum_i dS_ij q_i
# and dQ_i divided by the row's sum of P (and its sink's), 1 but for lse's rounding (_write_q).
# Passes over fastattn's thread pool, each work item owning what it writes, so that no
# sum depends on the schedule (no atomics, no reduction across threads):
#   0. Delta of the rows of one (batch element, query head);
#   1. dK, dV of a span of keys of one kv head (up to FA_BKV_MAX keys), looping over all
#      the query rows of its GQA group -- the forward's row blocks, in order;
#   2. dQ of one forward row block, looping over its key blocks in order.
# With enough (batch element, kv head) pairs to keep the threads busy, one work item per
# pair does the three passes instead (_head_item): S and dP once per tile, 5 products
# instead of 7, and one run of the pool.
# Every sum has one order whatever the thread count, the batch, the schedule or how rows
# and keys are split into work items: dK_j and dV_j over the rows R = (head, position) of
# the group in order, dQ_i over the keys in order, each a sequential FMA chain in the
# output micro-tile (a chain may stop and resume through memory, and rows or keys whose
# terms are exactly 0 may be skipped: the same bits).
# A key block's S^T comes from the forward's own stages (_load_block,
# _score_lanes, _finish_scores: the one home of the visibility rule and the modifiers),
# always on the prefill tiles; dP^T from the same score micro-tiles with dO in place of Q.
# On AMX tiles all five products run there, P and dS rounded to bfloat16 (the tiles
# multiply bfloat16 only), with the chains of fa_amx.h.
# Rows that see nothing, padding rows (past q_len) and keys past kv_len get exactly zero
# gradients: their dO, Q and Delta are taken as 0 and their P as 0 (lse2 = +inf).
# Extra memory: one workspace per thread (O(FA_BQ * (D + Dv + FA_BK) + FA_BKV_MAX * (D + Dv)))
# and Delta, O(Hq * Lq) per batch element.


cdef struct Grads:
    # The backward's own arrays, beside the Problem (q, k, v, out, lse, mask, variants).
    # dout in its storage type (do_isz bytes per element); delta and dlse in the compute
    # type with lse's layout; dq, dk, dv in the compute type.
    char* dout
    int do_kind
    Py_ssize_t do_isz, do_sh, do_si
    const Py_ssize_t* do_boff
    char* delta
    const char* dlse
    char* dq
    char* dk
    char* dv
    const Py_ssize_t* dq_boff
    const Py_ssize_t* dk_boff
    const Py_ssize_t* dv_boff
    Py_ssize_t dq_sh, dq_si, dk_sh, dk_sj, dv_sh, dv_sj
    Py_ssize_t nkb                # key blocks per dK/dV work item
    Py_ssize_t n_kitems           # dK/dV work items per (batch element, kv head)


cdef struct BJob:
    # One pass of a backward call, as handed to the thread pool.
    const Problem* P
    const Grads* G
    void* workspace
    Py_ssize_t ws_elems
    Py_ssize_t* row_idx           # 2 * FA_BQ per thread
    Py_ssize_t n_rblk
    int stage


# ---------------------------------------------------------------------------- rows

cdef inline void _load_row(const char* src, int kind, Py_ssize_t n, floating* dst,
                           Py_ssize_t n_pad) noexcept nogil:
    # A row of n elements stored as `kind`, in the compute type, zero-padded to n_pad.
    if kind == FA_STORE_NATIVE:
        memcpy(dst, src, n * sizeof(floating))
    else:
        widen_rows(kind, src, n, 1, n, dst, n, NULL, 0)
    memset(dst + n, 0, (n_pad - n) * sizeof(floating))


cdef inline bint _row_lse(const Problem* P, Py_ssize_t b, Py_ssize_t h, Py_ssize_t i,
                          Py_ssize_t q_len, Py_ssize_t* li, floating* lse) noexcept nogil:
    # Whether row (h, i) of batch element b has a gradient: a real row (i < q_len) that
    # saw something (lse != -inf); li: its element of lse, delta and dlse.  A NaN lse (a
    # NaN among the row's scores) counts as a row, so that the NaN reaches its gradients.
    if i >= q_len:
        return False
    li[0] = P.lse_boff[b] + h * P.lse_sh + i * P.lse_si
    lse[0] = (<const floating*> P.lse)[li[0]]
    return lse[0] != -INFINITY


cdef void _delta_rows(const Problem* P, const Grads* G, Py_ssize_t b, Py_ssize_t h,
                      floating* ws) noexcept nogil:
    # Pass 0: Delta = rowsum(dout * out) - dlse for the rows of query head h of batch
    # element b; 0 for rows without a gradient (rows of the next sequence, past q_len of
    # a packed one, are not ours).  16-bit rows are widened into the workspace first.
    cdef Workspace w
    cdef Py_ssize_t q_len = P.q_len[b] if P.q_len != NULL else P.Lq, i, li = 0
    cdef const floating* orow
    cdef const floating* drow
    cdef floating d, lse
    _carve(&w, P, vec_lanes(ws))
    for i in range(_row_len(P, b)):
        d = 0
        if _row_lse(P, b, h, i, q_len, &li, &lse):
            orow = _row_as_compute(P.out + (P.o_boff[b] + h * P.o_sh + i * P.o_si) * P.o_isz,
                                   P.o_kind, P.Dv, ws + w.dorows)
            drow = _row_as_compute(
                G.dout + (G.do_boff[b] + h * G.do_sh + i * G.do_si) * G.do_isz, G.do_kind,
                P.Dv, ws + w.dorows + P.Dv)
            d = bwd_dot(drow, orow, P.Dv)
            if G.dlse != NULL:
                d -= (<const floating*> G.dlse)[li]
        else:
            li = P.lse_boff[b] + h * P.lse_sh + i * P.lse_si
        (<floating*> G.delta)[li] = d


cdef inline const floating* _row_as_compute(const char* row, int kind, Py_ssize_t n,
                                            floating* buf) noexcept nogil:
    # A row in the compute type: in place, or widened into buf.
    if kind == FA_STORE_NATIVE:
        return <const floating*> row
    _load_row(row, kind, n, buf, n)
    return buf


cdef void _bwd_setup(const Problem* P, Tile* t, const Workspace* w, Py_ssize_t b,
                     Py_ssize_t g, Py_ssize_t r0, Py_ssize_t* lo, Py_ssize_t* hi,
                     floating* ws) noexcept nogil:
    # The forward's row block r0 of kv head g, always on the prefill tiles, with K and V
    # in the compute type (16-bit ones widened a block at a time): S^T, dP^T and the
    # products all read them as score and output micro-tiles.
    _setup(P, t, b, g, r0, lo, hi, ws)
    t.decode = False
    t.ldqt = FA_BQ
    t.widen_k = P.k_kind != FA_STORE_NATIVE
    # (bfloat16 products read V's rows in place for dP)
    t.widen_v = P.v_kind != FA_STORE_NATIVE and not t.bf16_dot
    t.pv_next_v = False
    _setup_rows(P, t, w, ws)


cdef void _bwd_rows(const Problem* P, const Grads* G, Tile* t, const Workspace* w,
                    floating* ws, bint q_rows) noexcept nogil:
    # Per row of the block: lse2 = lse log2 e (less the cap shift, as the scores carry it)
    # and Delta, the sum of P from 0, dO as zero-padded rows and packed as dO^T, and
    # (q_rows) Q as zero-padded rows.  Rows without a gradient get dO = Q = 0, Delta = 0
    # and lse2 = +inf (so P = 0): whatever dout holds there has no effect.
    cdef Py_ssize_t dv_pad = _round_up(P.Dv, t.NL), d_pad = _round_up(P.D, t.NL)
    cdef Py_ssize_t r, h, i, li = 0, u
    cdef floating lse = 0
    cdef floating* dst
    cdef const char** rows = t.krows
    for r in range(t.nlanes):
        ws[w.lse2 + r] = INFINITY
        ws[w.delta + r] = 0
        ws[w.psum + r] = 0
        dst = ws + w.dorows + r * dv_pad
        if r < t.nrows:
            _row_position(P, t, r, &h, &i)
        if r < t.nrows and t.lo[r] < t.hi[r] and _row_lse(P, t.b, h, i, t.q_len, &li, &lse):
            ws[w.lse2 + r] = <floating> _sink2(P, lse, _mask_shift(P, t, r))
            ws[w.delta + r] = (<const floating*> G.delta)[li]
            _load_row(G.dout + (G.do_boff[t.b] + h * G.do_sh + i * G.do_si) * G.do_isz,
                      G.do_kind, P.Dv, dst, dv_pad)
            if q_rows:
                _load_row(P.q + (P.q_boff[t.b] + h * P.q_sh + i * P.q_si) * P.q_isz,
                          P.q_kind, P.D, ws + w.qrows + r * d_pad, d_pad)
        else:
            memset(dst, 0, dv_pad * sizeof(floating))
            if q_rows:
                memset(ws + w.qrows + r * d_pad, 0, d_pad * sizeof(floating))
        rows[r % t.VL] = <const char*> dst
        if t.bf16_dot:
            # dO^T in pairs of bfloat16 dims, from dout as stored (zeros without a gradient)
            rows[r % t.VL] = <const char*> (ws + w.zrow)
            if ws[w.lse2 + r] != INFINITY:
                rows[r % t.VL] = G.dout + (G.do_boff[t.b] + h * G.do_sh + i * G.do_si) * G.do_isz
        if r % t.VL == t.VL - 1:
            if floating is float and t.bf16_dot:
                fa_pack_qt_pairs(<const uint16_t* const*> rows, P.Dv,
                                 <uint32_t*> (ws + w.dot + r + 1 - t.VL), FA_BQ)
            else:
                pack_qt(rows, P.Dv, ws + w.dot + r + 1 - t.VL, FA_BQ)


# ---------------------------------------------------------------------------- key block

cdef void _bwd_block(const Problem* P, Tile* t, const Workspace* w,
                     floating* ws) noexcept nogil:
    # Keys [j0, j1) against the rows of the tile: S^T by the forward's stages, dP^T = V dO^T
    # on the same micro-tiles, then P^T (in S^T's place) and dS^T (in dP^T's), per lane
    # group over the keys some row of it sees (0 elsewhere), P added to the rows' sums.
    cdef Py_ssize_t ig, c, g_lo, g_hi
    cdef int nvec
    cdef const floating* slope
    _load_block(P, t, w, ws)
    if floating is float and t.amx:
        _scores_amx(P, t, w, ws)
    else:
        _scores_prefill(P, t, w, ws)
    _finish_scores(P, t, w, ws)
    if floating is float and t.amx:
        _lanes_amx(t, w, ws, t.vptr, ws + w.dot, P.Dv, 1, ws + w.dp)
    else:
        _score_lanes(t, w, ws, t.vblk, t.vblk_row, t.vptr, ws + w.dot, P.Dv, 1, ws + w.dp)
    for ig in range((t.nlanes + t.NL - 1) // t.NL):
        c = ig * t.NL
        nvec = <int> (min(t.NL, t.nlanes - c) // t.VL)
        g_lo = min(max(t.grp_lo[ig], t.j0), t.j1)
        g_hi = min(max(t.grp_hi[ig], g_lo), t.j1)
        slope = ws + w.slope + c if w.slope >= 0 else NULL
        bwd_ds(ws + w.s + c, ws + w.dp + c, slope, t.nj, g_lo - t.j0, g_hi - t.j0, nvec,
               ws + w.lse2 + c, ws + w.delta + c, ws + w.psum + c)


cdef void _reduce_rows(const Tile* t, const floating* pt, const floating* x, Py_ssize_t x_pad,
                       floating* acc, const floating* ones) noexcept nogil:
    # acc[jj] += sum_r pt[r, jj] x[r] for the block's keys jj (6 at a time, pt padded with
    # zero keys), over the rows in order: dV (pt = P, x = dO) and dK (pt = dS, x = Q).
    # Only over the rows [ra, rz) that see some of the 6 keys: the others have pt = 0, and
    # adding 0 leaves a sum's bits as they are.
    cdef Py_ssize_t jj = 0, c, ldp = FA_BK + FA_MR_PV, ra, rz, ka, kz
    while jj < t.nj:
        ka = t.j0 + jj
        kz = min(ka + FA_MR_PV, t.j1)
        ra = 0
        while ra < t.nrows and (t.hi[ra] <= ka or t.lo[ra] >= kz):
            ra += 1
        rz = t.nrows
        while rz > ra and (t.hi[rz - 1] <= ka or t.lo[rz - 1] >= kz):
            rz -= 1
        c = 0
        while c < x_pad and ra < rz:
            pv_tile_ld(pt + ra * ldp + jj, ldp, rz - ra, x + ra * x_pad + c, x_pad,
                       acc + jj * x_pad + c, x_pad, ones, FA_MR_PV)
            c += t.NL
        jj += FA_MR_PV


cdef inline void _add_rows(const floating* src, Py_ssize_t lds, floating* dst, Py_ssize_t ldd,
                           Py_ssize_t nrows, Py_ssize_t ncols) noexcept nogil:
    # dst rows += src rows: a tile's sums into the running ones.
    cdef Py_ssize_t r, c
    for r in range(nrows):
        for c in range(ncols):
            dst[r * ldd + c] += src[r * lds + c]


cdef void _kv_block(const Problem* P, const Tile* t, const Workspace* w,
                    floating* ws) noexcept nogil:
    # The tile's sums for dV and dK of the block's keys, from zero (dvblk, dkblk): a key's
    # gradient sums one tile of rows at a time, then the tiles' sums in order, whose
    # rounding error grows with the number of tiles instead of the number of rows.
    cdef Py_ssize_t dv_pad = _round_up(P.Dv, t.NL), d_pad = _round_up(P.D, t.NL)
    cdef Py_ssize_t nj6 = _round_up(t.nj, FA_MR_PV), ldp = FA_BK + FA_MR_PV
    cdef floating* pt = ws + w.pt
    if floating is float and t.amx:
        _kv_block_amx(P, t, w, ws)
        return
    memset(ws + w.dvblk, 0, nj6 * dv_pad * sizeof(floating))
    memset(ws + w.dkblk, 0, nj6 * d_pad * sizeof(floating))
    bwd_transpose(ws + w.s, t.nj, nj6, t.nrows, pt, ldp)
    _reduce_rows(t, pt, ws + w.dorows, dv_pad, ws + w.dvblk, ws + w.ones)
    bwd_transpose(ws + w.dp, t.nj, nj6, t.nrows, pt, ldp)
    _reduce_rows(t, pt, ws + w.qrows, d_pad, ws + w.dkblk, ws + w.ones)


cdef void _kv_block_amx(const Problem* P, const Tile* t, const Workspace* w,
                        float* ws) noexcept nogil:
    # _kv_block on AMX tiles: P^T, then dS^T, rounded to bfloat16 rows of keys against dO,
    # then Q, in pairs of rows; each key's sums over the tile's rows in chunks of 32 from
    # its first (fa_amx_gemm), padding rows zero.
    cdef Py_ssize_t dv_pad = _round_up(P.Dv, t.NL), d_pad = _round_up(P.D, t.NL)
    cdef Py_ssize_t nr = _round_up(t.nlanes, 32), nk = _round_up(t.nj, 16)
    cdef uint16_t* pr = <uint16_t*> (ws + w.pr)
    cdef uint32_t* rp = <uint32_t*> (ws + w.bpairs)
    fa_pack_bf16_cols(ws + w.s, FA_BQ, t.nj, nk, t.nlanes, nr, pr, FA_BQ)
    fa_pack_p_pairs(ws + w.dorows, dv_pad, t.nlanes, P.Dv, rp, P.Dv)
    _zero_pairs_to(rp, t.nlanes, nr, P.Dv)
    fa_amx_gemm(t.amx, pr, FA_BQ, t.nj, nr // 32, rp, P.Dv, P.Dv, ws + w.dvblk, dv_pad)
    fa_pack_bf16_cols(ws + w.dp, FA_BQ, t.nj, nk, t.nlanes, nr, pr, FA_BQ)
    fa_pack_p_pairs(ws + w.qrows, d_pad, t.nlanes, P.D, rp, P.D)
    _zero_pairs_to(rp, t.nlanes, nr, P.D)
    fa_amx_gemm(t.amx, pr, FA_BQ, t.nj, nr // 32, rp, P.D, P.D, ws + w.dkblk, d_pad)


cdef void _accumulate_q_amx(const Problem* P, const Tile* t, const Workspace* w,
                            float* ws) noexcept nogil:
    # _accumulate_q on AMX tiles: dS rounded to bfloat16 rows (zero past the block's keys)
    # against K in pairs of keys, over the block's chunks of 32 keys from its first
    # (fa_amx_gemm); then added to the running sums.
    cdef Py_ssize_t d_pad = _round_up(P.D, t.NL)
    cdef uint16_t* pr = <uint16_t*> (ws + w.pr)
    cdef uint32_t* kp = <uint32_t*> (ws + w.kpairs)
    fa_pack_p_rows(ws + w.dp, FA_BQ, t.nj, t.nlanes, pr, FA_BK)
    fa_pack_v_pairs(<const uint16_t* const*> t.kptr, t.nj, P.D, kp)
    _zero_pairs_to(kp, t.nj, _round_up(t.nj, 32), P.D)
    fa_amx_gemm(t.amx, pr, FA_BK, t.nrows, (t.nj + 31) // 32, kp, P.D, P.D, ws + w.dqblk,
                d_pad)
    _add_rows(ws + w.dqblk, d_pad, ws + w.dqacc, d_pad, t.nrows, d_pad)


cdef void _accumulate_q(const Problem* P, const Tile* t, const Workspace* w,
                        floating* ws) noexcept nogil:
    # dQ += dS K for the rows of the tile: the block's sums from zero (6-row tiles then
    # single rows, each over the keys of the block its rows see; dS is 0 for the others),
    # then added to the running sums.
    cdef Py_ssize_t d_pad = _round_up(P.D, t.NL), j, rg = 0, nr, ja, z, na, c
    cdef const floating* kb = <const floating*> t.kblk
    cdef Py_ssize_t ldk = t.kblk_sj
    if floating is float and t.amx:
        _accumulate_q_amx(P, t, w, ws)
        return
    if d_pad != P.D:
        # K's rows zero-padded to whole strips of columns (else read in place)
        for j in range(t.nj):
            _load_row(t.kblk + j * t.kblk_row, FA_STORE_NATIVE, P.D, ws + w.kpad + j * d_pad,
                      d_pad)
        kb, ldk = ws + w.kpad, d_pad
    memset(ws + w.dqblk, 0, t.nrows * d_pad * sizeof(floating))
    while rg < t.nrows:
        nr = FA_MR_PV if rg < t.n6 else 1
        if nr == FA_MR_PV:
            ja, z = t.pv_lo[rg // FA_MR_PV], t.pv_hi[rg // FA_MR_PV]
        else:
            _keys_seen(t, rg, rg + 1, &ja, &z)
        ja = min(max(t.j0, ja), t.j1)
        na = max(0, min(t.j1, z) - ja)
        c = 0
        while c < d_pad and na > 0:
            pv_tile_widened(ws + w.dp + (ja - t.j0) * FA_BQ + rg, na,
                            kb + (ja - t.j0) * ldk + c, ldk, ws + w.dqblk + rg * d_pad + c,
                            d_pad, ws + w.ones, nr)
            c += t.NL
        rg += nr
    _add_rows(ws + w.dqblk, d_pad, ws + w.dqacc, d_pad, t.nrows, d_pad)


# ---------------------------------------------------------------------------- work items

cdef void _kv_item(const Problem* P, const Grads* G, Py_ssize_t b, Py_ssize_t g,
                   Py_ssize_t k0, floating* ws, Py_ssize_t* lo, Py_ssize_t* hi) noexcept nogil:
    # Pass 1: dK, dV of keys [k0, k1) of kv head g of batch element b, over the group's
    # row blocks in order (keys past kv_len get zeros).
    cdef Workspace w
    cdef Tile t
    cdef Py_ssize_t k1 = min(k0 + G.nkb * FA_BK, P.Lk), r0, a, z, ib, VL = vec_lanes(ws)
    cdef Py_ssize_t nk_pad = FA_BKV_MAX + FA_MR_PV, n_rows = P.group * _row_len(P, b)
    cdef Py_ssize_t d_pad = _round_up(P.D, 2 * VL), dv_pad = _round_up(P.Dv, 2 * VL)
    _carve(&w, P, VL)
    memset(ws + w.dkacc, 0, nk_pad * d_pad * sizeof(floating))
    memset(ws + w.dvacc, 0, nk_pad * dv_pad * sizeof(floating))
    for a in range(FA_MR_PV):
        ws[w.ones + a] = 1
    r0 = 0
    while r0 < n_rows and k0 < P.kv_len[b]:
        _bwd_setup(P, &t, &w, b, g, r0, lo, hi, ws)
        a = max(k0, t.tile_lo)
        z = min(k1, t.tile_hi)
        if a < z:
            _bwd_rows(P, G, &t, &w, ws, True)
            for ib in range(a // FA_BK, (z + FA_BK - 1) // FA_BK):
                t.j0 = max(ib * FA_BK, a)
                t.j1 = min(ib * FA_BK + FA_BK, z)
                t.nj = t.j1 - t.j0
                _bwd_block(P, &t, &w, ws)
                _kv_block(P, &t, &w, ws)
                _add_rows(ws + w.dkblk, d_pad, ws + w.dkacc + (t.j0 - k0) * d_pad, d_pad, t.nj,
                          d_pad)
                _add_rows(ws + w.dvblk, dv_pad, ws + w.dvacc + (t.j0 - k0) * dv_pad, dv_pad,
                          t.nj, dv_pad)
        r0 += FA_BQ
    _write_kv(P, G, &w, ws, b, g, k0, k1)


cdef void _write_kv(const Problem* P, const Grads* G, const Workspace* w, floating* ws,
                    Py_ssize_t b, Py_ssize_t g, Py_ssize_t k0, Py_ssize_t k1) noexcept nogil:
    # dK = scale * the accumulated sums, dV as accumulated; keys of the next sequence
    # (past kv_len of a packed one) are not ours.
    cdef Py_ssize_t VL = vec_lanes(ws), d_pad = _round_up(P.D, 2 * VL)
    cdef Py_ssize_t dv_pad = _round_up(P.Dv, 2 * VL), j, c
    cdef floating sc = <floating> P.scale
    cdef floating* dk
    cdef floating* dv
    for j in range(k0, k1):
        if P.packed and j >= P.kv_len[b]:
            break
        dk = <floating*> G.dk + G.dk_boff[b] + g * G.dk_sh + j * G.dk_sj
        dv = <floating*> G.dv + G.dv_boff[b] + g * G.dv_sh + j * G.dv_sj
        for c in range(P.D):
            dk[c] = ws[w.dkacc + (j - k0) * d_pad + c] * sc
        for c in range(P.Dv):
            dv[c] = ws[w.dvacc + (j - k0) * dv_pad + c]


cdef void _q_item(const Problem* P, const Grads* G, Py_ssize_t b, Py_ssize_t g,
                  Py_ssize_t r0, floating* ws, Py_ssize_t* lo, Py_ssize_t* hi) noexcept nogil:
    # Pass 2: dQ of the forward's row block r0 of kv head g, over its key blocks in order.
    cdef Workspace w
    cdef Tile t
    cdef Py_ssize_t ib, a
    _carve(&w, P, vec_lanes(ws))
    _bwd_setup(P, &t, &w, b, g, r0, lo, hi, ws)
    memset(ws + w.dqacc, 0, t.nlanes * _round_up(P.D, t.NL) * sizeof(floating))
    for a in range(FA_MR_PV):
        ws[w.ones + a] = 1
    if t.tile_lo < t.tile_hi:
        _bwd_rows(P, G, &t, &w, ws, False)
        for ib in range(t.tile_lo // FA_BK, (t.tile_hi + FA_BK - 1) // FA_BK):
            t.j0 = max(ib * FA_BK, t.tile_lo)
            t.j1 = min(ib * FA_BK + FA_BK, t.tile_hi)
            t.nj = t.j1 - t.j0
            _bwd_block(P, &t, &w, ws)
            _accumulate_q(P, &t, &w, ws)
    _write_q(P, G, &t, &w, ws)


cdef void _write_q(const Problem* P, const Grads* G, const Tile* t, const Workspace* w,
                   floating* ws) noexcept nogil:
    # dQ = scale * the accumulated sums / the row's sum of P over its keys (and its sink);
    # zeros for rows without a gradient.  lse in the compute type is off by up to an ulp,
    # which scales all of a row's P alike: where P sits on a few keys (ALiBi, peaked
    # scores), that is dQ's largest error, and dividing by the sum (1 but for it) removes
    # it.  dK and dV sum over many rows, whose lse errors do not add up alike.
    cdef Py_ssize_t d_pad = _round_up(P.D, t.NL), r, h, i, c, li
    cdef floating lse, sc
    cdef double psum
    cdef floating* dq
    cdef const floating* acc
    for r in range(t.nrows):
        _row_position(P, t, r, &h, &i)
        dq = <floating*> G.dq + G.dq_boff[t.b] + h * G.dq_sh + i * G.dq_si
        if t.lo[r] < t.hi[r] and _row_lse(P, t.b, h, i, t.q_len, &li, &lse):
            acc = ws + w.dqacc + r * d_pad
            psum = ws[w.psum + r]
            if P.sinks != NULL:
                psum += exp2(_sink2(P, P.sinks[t.b * P.Hq + h], _mask_shift(P, t, r))
                             - ws[w.lse2 + r])
            sc = <floating> (P.scale / psum)
            for c in range(P.D):
                dq[c] = acc[c] * sc
        else:
            memset(dq, 0, P.D * sizeof(floating))


cdef void _kv_add_out(const Problem* P, const Grads* G, const Tile* t, const Workspace* w,
                     floating* ws) noexcept nogil:
    # The tile's sums for dK, dV (_kv_block) added to the running sums in the output.
    cdef Py_ssize_t off = t.j0 * G.dk_sj, offv = t.j0 * G.dv_sj
    _add_rows(ws + w.dkblk, _round_up(P.D, t.NL),
              <floating*> G.dk + G.dk_boff[t.b] + t.g * G.dk_sh + off, G.dk_sj, t.nj, P.D)
    _add_rows(ws + w.dvblk, _round_up(P.Dv, t.NL),
              <floating*> G.dv + G.dv_boff[t.b] + t.g * G.dv_sh + offv, G.dv_sj, t.nj, P.Dv)


cdef void _kv_head_scale(const Problem* P, const Grads* G, Py_ssize_t b, Py_ssize_t g,
                         floating* like, double scale) noexcept nogil:
    # dK *= scale (0: clear dK and dV) for the keys of kv head g of batch element b (keys
    # past kv_len of a packed sequence are the next one's).
    cdef floating scale_dk = <floating> scale
    cdef Py_ssize_t j, c, nk = P.kv_len[b] if P.packed else P.Lk
    cdef floating* dk
    cdef floating* dv
    for j in range(nk):
        dk = <floating*> G.dk + G.dk_boff[b] + g * G.dk_sh + j * G.dk_sj
        if scale_dk == 0:
            memset(dk, 0, P.D * sizeof(floating))
            dv = <floating*> G.dv + G.dv_boff[b] + g * G.dv_sh + j * G.dv_sj
            memset(dv, 0, P.Dv * sizeof(floating))
        else:
            for c in range(P.D):
                dk[c] = dk[c] * scale_dk


cdef void _head_item(const Problem* P, const Grads* G, Py_ssize_t b, Py_ssize_t g,
                     floating* ws, Py_ssize_t* lo, Py_ssize_t* hi) noexcept nogil:
    # Passes 0, 1 and 2 at once for kv head g of batch element b, when there are enough
    # such items for the threads: Delta of its rows, then its row blocks in order, each
    # over its key blocks in order, dQ accumulated per row block and dK, dV in the output
    # itself.  Every sum runs in the order of the separate passes, through the same
    # micro-kernels: the same bits.
    cdef Workspace w
    cdef Tile t
    cdef Py_ssize_t r0 = 0, ib, a
    _carve(&w, P, vec_lanes(ws))
    for a in range(FA_MR_PV):
        ws[w.ones + a] = 1
    _kv_head_scale(P, G, b, g, ws, 0)
    for a in range(P.group):     # pass 0 for the item's own rows (one pool run less)
        _delta_rows(P, G, b, g * P.group + a, ws)
    while r0 < P.group * _row_len(P, b):
        _bwd_setup(P, &t, &w, b, g, r0, lo, hi, ws)
        memset(ws + w.dqacc, 0, t.nlanes * _round_up(P.D, t.NL) * sizeof(floating))
        if t.tile_lo < t.tile_hi:
            _bwd_rows(P, G, &t, &w, ws, True)
            for ib in range(t.tile_lo // FA_BK, (t.tile_hi + FA_BK - 1) // FA_BK):
                t.j0 = max(ib * FA_BK, t.tile_lo)
                t.j1 = min(ib * FA_BK + FA_BK, t.tile_hi)
                t.nj = t.j1 - t.j0
                _bwd_block(P, &t, &w, ws)
                _accumulate_q(P, &t, &w, ws)
                _kv_block(P, &t, &w, ws)
                _kv_add_out(P, G, &t, &w, ws)
        _write_q(P, G, &t, &w, ws)
        r0 += FA_BQ
    _kv_head_scale(P, G, b, g, ws, P.scale)


cdef inline void _bjob_item(const BJob* J, floating* workspace, Py_ssize_t w,
                            int tid) noexcept nogil:
    cdef const Problem* P = J.P
    cdef const Grads* G = J.G
    cdef floating* ws = workspace + tid * J.ws_elems
    cdef Py_ssize_t* idx = J.row_idx + tid * 2 * FA_BQ
    cdef Py_ssize_t bg, rb
    cdef int amx = P.amx if floating is float else 0
    if J.stage == 0:
        _delta_rows(P, G, w // P.Hq, w % P.Hq, ws)
        return
    fa_amx_begin(amx)
    if J.stage == 3:
        _head_item(P, G, w // P.Hkv, w % P.Hkv, ws, idx, idx + FA_BQ)
    elif J.stage == 1:
        bg = w // G.n_kitems
        _kv_item(P, G, bg // P.Hkv, bg % P.Hkv, (w % G.n_kitems) * G.nkb * FA_BK, ws, idx,
                 idx + FA_BQ)
    else:
        # Last row blocks first: under causal masking they see the most keys.
        rb = J.n_rblk - 1 - w % J.n_rblk
        bg = w // J.n_rblk
        _q_item(P, G, bg // P.Hkv, bg % P.Hkv, rb * FA_BQ, ws, idx, idx + FA_BQ)
    fa_amx_end(amx)


cdef void _bjob_item_f(void* ctx, Py_ssize_t w, int tid) noexcept nogil:
    _bjob_item(<const BJob*> ctx, <float*> (<const BJob*> ctx).workspace, w, tid)


cdef void _bjob_item_d(void* ctx, Py_ssize_t w, int tid) noexcept nogil:
    _bjob_item(<const BJob*> ctx, <double*> (<const BJob*> ctx).workspace, w, tid)


cdef void _run_stage(BJob* J, int stage, Py_ssize_t n_items, int n_threads,
                     bint is_float) noexcept nogil:
    # One pass's work items on the pool, no more threads than items.
    J.stage = stage
    if n_items > 0:
        fa_pool_run(_threads_for(n_threads, n_items), n_items,
                    _bjob_item_f if is_float else _bjob_item_d, J)


cdef int _run_backward(Problem* P, Grads* G, bint is_float, int n_threads) except -1:
    """Allocate per-thread workspaces, release the GIL and run the passes."""
    cdef Py_ssize_t n_rblk = (P.group * P.Lq + FA_BQ - 1) // FA_BQ
    cdef Py_ssize_t nkblk = (P.Lk + FA_BK - 1) // FA_BK
    cdef Py_ssize_t n_items[4]
    cdef Py_ssize_t vl = FA_VL_F if is_float else FA_VL_D
    cdef Py_ssize_t itemsize = sizeof(float) if is_float else sizeof(double)
    # Key spans as long as FA_BKV_MAX while there are several work items per thread (Q
    # and dO rows are packed once per span and row block).
    G.nkb = FA_BKV_MAX // FA_BK
    while G.nkb > 1 and P.nbatch * P.Hkv * ((nkblk + G.nkb - 1) // G.nkb) < 4 * n_threads:
        G.nkb -= 1
    G.n_kitems = (nkblk + G.nkb - 1) // G.nkb
    n_items[0] = P.nbatch * P.Hq
    n_items[1] = P.nbatch * P.Hkv * G.n_kitems
    n_items[2] = P.nbatch * P.Hkv * n_rblk
    # One item per (batch element, kv head) does the work of passes 1 and 2 with 5
    # products instead of 7 (S and dP once): taken unless it leaves threads idle for longer.
    n_items[3] = P.nbatch * P.Hkv
    cdef Py_ssize_t rounds = (n_items[3] + n_threads - 1) // n_threads
    cdef bint per_head = 5 * rounds * n_threads <= 7 * n_items[3]
    n_threads = _threads_for(n_threads, max(max(n_items[0], n_items[1]), n_items[2]))
    cdef Workspace w
    _carve(&w, P, vl)
    cdef size_t ws_bytes = n_threads * w.elems * itemsize
    cdef size_t nbytes = ws_bytes + n_threads * 2 * FA_BQ * sizeof(Py_ssize_t) + 64
    cdef char* mem = _take_block(&nbytes)
    if mem == NULL:
        raise MemoryError(f"fastattn: cannot allocate {nbytes} bytes of workspace")
    cdef char* aligned = <char*> ((<size_t> mem + 63) & ~(<size_t> 63))
    cdef BJob J
    J.P, J.G = P, G
    J.workspace = aligned
    J.ws_elems = w.elems
    J.row_idx = <Py_ssize_t*> (aligned + ws_bytes)
    J.n_rblk = n_rblk
    try:
        with nogil:
            if per_head:
                _run_stage(&J, 3, n_items[3], n_threads, is_float)
            else:
                _run_stage(&J, 0, n_items[0], n_threads, is_float)
                _run_stage(&J, 1, n_items[1], n_threads, is_float)
                _run_stage(&J, 2, n_items[2], n_threads, is_float)
    finally:
        _return_block(mem, nbytes)
    return 0
