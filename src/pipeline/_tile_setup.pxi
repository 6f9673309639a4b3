# Stage 1, _setup: a tile's geometry, each row's visible key interval, Q^T packed.
# One stage file of the tile pipeline: _tile_pipeline.pxi includes them in order.

# ---------------------------------------------------------------------------- setup

cdef inline void _row_position(const Problem* P, const Tile* t, Py_ssize_t r, Py_ssize_t* h,
                               Py_ssize_t* i) noexcept nogil:
    # Query head and position of row r of the tile.
    _head_position(P, t.g, t.r0 + r, t.row_len, h, i)


@cython.cdivision(True)   # rows and lengths are >= 0
cdef inline void _head_position(const Problem* P, Py_ssize_t g, Py_ssize_t R,
                                Py_ssize_t row_len, Py_ssize_t* h, Py_ssize_t* i) noexcept nogil:
    # Query head and position of row R of kv head g's rows (head * row_len + position).
    # One position per head (a decode step) without a division: every tile's rows go
    # through here.
    if row_len == 1:
        h[0] = g * P.group + R
        i[0] = 0
        return
    h[0] = g * P.group + R // row_len
    i[0] = R % row_len


cdef inline Py_ssize_t _row_len(const Problem* P, Py_ssize_t b) noexcept nogil:
    # Positions per query head in the rows R of batch element b: Lq, or a packed
    # sequence's own length, so that its rows fall into the same blocks as in a call on
    # that sequence alone (the backward's per-block sums depend on the blocks).
    return P.q_len[b] if P.packed else P.Lq


cdef inline void _keys_seen(const Tile* t, Py_ssize_t r_begin, Py_ssize_t r_end,
                            Py_ssize_t* a, Py_ssize_t* z) noexcept nogil:
    # Union [a, z) of the visible intervals of rows [r_begin, r_end) (rows that see
    # nothing do not count); a >= z when none sees anything.
    cdef Py_ssize_t r
    a[0] = t.kv_len
    z[0] = 0
    if t.same_keys and r_end <= t.nrows:
        if r_begin < r_end:
            a[0], z[0] = t.tile_lo, t.tile_hi
        return
    for r in range(r_begin, r_end):
        if t.lo[r] < t.hi[r]:
            a[0] = min(a[0], t.lo[r])
            z[0] = max(z[0], t.hi[r])


cdef inline void _keys_all_see(const Tile* t, Py_ssize_t r_begin, Py_ssize_t r_end,
                               Py_ssize_t* a, Py_ssize_t* z) noexcept nogil:
    # The keys [a, z) every row of [r_begin, r_end) sees (all keys for no rows).
    cdef Py_ssize_t r
    a[0] = 0
    z[0] = t.kv_len
    for r in range(r_begin, r_end):
        a[0] = max(a[0], t.lo[r])
        z[0] = min(z[0], t.hi[r])


cdef void _group_intervals(Tile* t) noexcept nogil:
    # The per-group intervals of the Tile (see there), from the rows' intervals.
    cdef Py_ssize_t width = t.nlanes if t.decode else t.NL, ig, c, rend
    if t.nlanes == 0:
        return   # a block past a packed sequence's rows
    for ig in range((t.nlanes + width - 1) // width):
        c = ig * width
        rend = min(c + width, t.nrows)
        _keys_seen(t, c, rend, &t.grp_lo[ig], &t.grp_hi[ig])
        _keys_all_see(t, c, rend, &t.grp_all_lo[ig], &t.grp_all_hi[ig])
    for ig in range(t.n6 // FA_MR_PV):
        _keys_seen(t, ig * FA_MR_PV, ig * FA_MR_PV + FA_MR_PV, &t.pv_lo[ig], &t.pv_hi[ig])


cdef void _setup(const Problem* P, Tile* t, Py_ssize_t b, Py_ssize_t g, Py_ssize_t r0,
                 Py_ssize_t* lo, Py_ssize_t* hi, floating* ws) noexcept nogil:
    # The work item's geometry and the pointers to its K and V rows.
    t.VL = vec_lanes(ws)
    t.NL = 2 * t.VL
    t.b, t.g, t.r0 = b, g, r0
    t.row_len = _row_len(P, b)
    t.nrows = max(0, min(FA_BQ, P.group * t.row_len - r0))
    t.nlanes = _round_up(t.nrows, t.VL)
    t.n6 = (t.nrows // FA_MR_PV) * FA_MR_PV
    t.dv_pad = _round_up(P.Dv, t.NL)
    t.dv_main = (P.Dv // t.NL) * t.NL
    t.dv_tail = P.Dv - t.dv_main
    # bfloat16 products have one kernel per stage, so that a decode row keeps the bits of
    # its prefill row; so do integer products (their score kernel, with keys as lanes, in
    # decode and prefill tiles alike).
    t.int8_dot = floating is float and P.int8_dot
    t.decode = t.nrows <= FA_DECODE_ROWS and not P.bf16_dot
    t.bf16_dot = floating is float and P.bf16_dot
    t.amx = P.amx if floating is float else 0
    # A decode tile of at most 4 rows fills at most half a vector of 8 lanes: its softmax
    # step takes two keys per 8-lane vector (fa_softmax_pairs_f), the same bits.
    t.softmax_pairs = floating is float and FA_HAVE_SOFTMAX_PAIRS and t.decode and t.nrows <= 4
    # Q^T's row stride: FA_BQ for the prefill's score tiles; the padded row count for a
    # decode tile, so that its D x nlanes values take D/2 (8 lanes of floats) cache lines
    # instead of D -- the decode score kernels read a line per dimension, beside 32 K rows
    # and the prefetched V rows in L1.
    t.ldqt = t.nlanes if t.decode else FA_BQ
    # A decode tile of at most 4 rows (a GQA group of 4, a single row) has kernels that
    # read Q^T's lanes 0-3 only: those are packed alone, 8 lanes apart (the constant
    # stride of the 16-bit score kernel, fa_keys32.h).
    t.qt4 = (floating is float and t.decode and t.nrows <= 4 and not P.bf16_dot
             and not P.int8_dot)
    if t.qt4:
        t.ldqt = 8
    # 16-bit K and V are widened in registers by the decode kernels of float compute (as
    # they load them), and so is float16 V by the prefill's P.V tiles on F16C builds,
    # where vcvtph2ps fits beside the FMAs.  Otherwise they are widened a block at a time
    # into the workspace, once for all the rows of a prefill tile: K, whose score tiles
    # broadcast single elements; bfloat16 V, whose shift would compete with the FMAs;
    # float16 V without F16C, whose integer widening would be repeated by every 6-row
    # tile; and both for double compute.
    # Rows in pages or quantised are gathered (and widened or dequantised) a block at a
    # time, except where the kernels read them through the block's row pointers: the
    # bfloat16 products', and quantised K and V in decode tiles of float compute,
    # dequantised in registers (whole blocks of 32 dims).  Decode tiles of float compute
    # take paged float rows as they are stored (copy_rows), for the decode kernels to
    # widen in registers as they do in place.
    t.gather = _gathers(P)
    cdef bint quant = FA_QUANTISED(P.k_kind)
    t.quant_in_place = (floating is float and t.decode and quant and P.v_kind == P.k_kind
                        and P.D % 32 == 0 and P.Dv % 32 == 0)
    t.copy_rows = floating is float and t.decode and t.gather and not quant
    # ... K rows then read where they are (kptr) by the score kernels, which load them
    # row by row to transpose (or widen) them anyway; V read through row pointers, whole
    # vectors of columns (else copied)
    t.v_in_place = t.copy_rows and P.Dv % (2 * t.VL) == 0
    # With both read in place, the kernels request the next block's rows as they go (K:
    # the score kernel, V: the output kernel), spread over their steps; when V is copied,
    # _gather requests them as it copies, the faster order for that path.
    t.spread_next = t.v_in_place
    t.widen_k = (P.k_kind != FA_STORE_NATIVE or t.gather) and not (
        t.decode and floating is float and not quant or t.quant_in_place or t.bf16_dot
        or t.int8_dot)
    t.widen_v = (P.v_kind != FA_STORE_NATIVE or t.gather) and not (floating is float and (
        t.decode and not quant or t.quant_in_place or t.bf16_dot
        or (P.v_kind == FA_STORE_F16 and FA_HAVE_F16C and not t.gather)))
    # A single row of float32 V streams the next block's V from the output kernel (see
    # _pv_decode); 16-bit V rows, half as long, arrive sooner when the score kernel
    # prefetches its own keys' V rows, spread over its steps.
    # Gathered V is widened after the scores are done with the widened K: one block of
    # either in L1 at a time (a block of K of 128 dims takes all 32 KiB of it).
    t.defer_v = t.gather and (t.widen_v or t.copy_rows and not t.v_in_place) and not P.backward
    t.pv_next_v = (t.decode and floating is float and t.nrows == 1
                   and P.v_kind == FA_STORE_NATIVE and not t.gather)
    t.first_blk = True
    t.next_b = t.next_g = -1
    t.scale_log2 = P.scale * LOG2E
    t.kv_len = P.kv_len[b]
    t.q_len = P.q_len[b] if P.q_len != NULL else P.Lq
    t.k_row, t.v_row = P.k_sj * P.k_isz, P.v_sj * P.v_isz
    t.kb = P.k + (P.k_boff[b] + g * P.k_sh) * P.k_isz
    t.kfs = _fp8_scale(P.k_kind, P.k_fscale, g * P.kfs_sh)
    t.vfs = _fp8_scale(P.v_kind, P.v_fscale, g * P.vfs_sh)
    t.vb = P.v + (P.v_boff[b] + g * P.v_sh) * P.v_isz
    t.lo, t.hi = lo, hi


cdef void _prefetch_next_q(const Problem* P, const Tile* t) noexcept nogil:
    # The query rows of the decode tile this thread runs next (its first FA_DECODE_ROWS),
    # requested into L2 now: a step of many short sequences reads a few rows of q per
    # tile, which would otherwise come from memory as the tile starts.
    cdef Py_ssize_t R, h, i, length = _row_len(P, t.next_b)
    for R in range(min(P.group * length, FA_DECODE_ROWS)):
        _head_position(P, t.next_g, R, length, &h, &i)
        fa_prefetch_l2(P.q + (P.q_boff[t.next_b] + h * P.q_sh + i * P.q_si) * P.q_isz,
                       P.D * P.q_isz)


cdef inline void _quantise_q(const Problem* P, const Workspace* w, float* ws, Py_ssize_t r,
                             const float* x, bint padding) noexcept nogil:
    # Query row r of the tile quantised for the integer products (a padding row: zeros),
    # where _scores_int8 reads it.
    cdef Py_ssize_t nb = P.D // 32
    if padding:
        x = NULL
    fa_int8_quant_row(x, P.D, <int8_t*> (ws + w.qi) + r * P.D,
                      ws + w.qi + FA_BQ * P.D // 4 + r * nb,
                      <int32_t*> (ws + w.qi + FA_BQ * P.D // 4 + FA_BQ * nb) + r * nb)


cdef inline float _fp8_scale(int kind, const float* fscale, Py_ssize_t i) noexcept nogil:
    # The scale a kernel multiplies an fp8 level by (see fa_quant.h); 0 for other kinds.
    if kind == FA_STORE_E4M3:
        return fscale[i] * FA_E4M3_UNIT
    if kind == FA_STORE_E5M2:
        return fscale[i]
    return 0


cdef void _setup_rows(const Problem* P, Tile* t, const Workspace* w,
                      floating* ws) noexcept nogil:
    # Each row's visible key interval (fa_key_interval: the visibility rule, aligned on the
    # real query rows q_len), Q^T packed, the per-row ALiBi terms (_alibi_row), and the
    # padding lanes: zero queries that see nothing and are never written out.  Rows at or
    # past q_len are padding too.
    cdef floating* qt = ws + w.qt
    cdef floating* s = ws + w.s
    cdef const char* zrow = <const char*> (ws + w.zrow)
    cdef const char** qrows = t.krows       # one vector's query rows, then packed
    cdef Py_ssize_t r, h, i, ic, j, nj, u, c, lane, ldqt = t.ldqt, D = P.D
    cdef bint real
    memset(ws + w.zrow, 0, max(D, P.Dv) * sizeof(floating))
    _set_mask_shifts(P, t, <const floating*> P.mask)
    t.tile_lo = t.kv_len
    t.tile_hi = 0
    for r in range(t.nlanes):
        lane = r & (t.VL - 1)      # r % VL (VL a power of two), without a division
        qrows[lane] = zrow
        t.lo[r] = 0
        t.hi[r] = 0
        if r < t.nrows:
            _row_position(P, t, r, &h, &i)
        real = r < t.nrows and i < t.q_len
        _alibi_row(P, t, w, ws, r, h, i, real)
        if real:
            fa_key_interval(i, t.q_len, t.kv_len, P.causal, P.wl, P.wr, &t.lo[r], &t.hi[r])
            if t.lo[r] < t.hi[r]:
                t.tile_lo = min(t.tile_lo, t.lo[r])
                t.tile_hi = max(t.tile_hi, t.hi[r])
            qrows[lane] = P.q + (P.q_boff[t.b] + h * P.q_sh + i * P.q_si) * P.q_isz
        if lane == t.VL - 1:
            c = r + 1 - t.VL
            if t.bf16_dot:
                # pairs of bfloat16 dimensions as they are stored (zrow: zeros)
                fa_pack_qt_pairs(<const uint16_t* const*> qrows, D, <uint32_t*> (qt + c), ldqt)
                continue
            if P.q_kind != FA_STORE_NATIVE:
                # 16-bit rows widened first (exactly), then packed like stored ones
                for u in range(t.VL):
                    if qrows[u] != zrow:
                        widen_rows(P.q_kind, qrows[u], D, 1, D, ws + w.qw + u * D, D, NULL, 0)
                        qrows[u] = <const char*> (ws + w.qw + u * D)
            if floating is float and t.int8_dot:
                for u in range(t.VL):
                    _quantise_q(P, w, ws, c + u, <const float*> qrows[u], qrows[u] == zrow)
                continue
            if floating is float and t.qt4:
                fa_pack_qt4_f(<const float* const*> qrows, D, qt, ldqt)
                continue
            pack_qt(qrows, D, qt + c, ldqt)
    # 4-row score passes over 16-bit K (_keyrows_pass: rows c .. c+3 with more than 2 of
    # them left) take a whole call of keys in one kernel (fa_score_gqa4).
    t.gqa4 = (floating is float and FA_HAVE_GQA4_16 and t.decode and not t.widen_k
              and (P.k_kind == FA_STORE_F16 or P.k_kind == FA_STORE_BF16)
              and D % 8 == 0 and D <= FA_KT8_MAX_D)
    # The common case (no causal diagonal, window or per-sequence lengths in the tile) in
    # one flag, so that the per-block stages need not scan the rows.
    # (Blocks of bfloat16 products start at even keys, on AMX tiles at multiples of 32
    # (_block_align), which may put keys before tile_lo into the first block: the finish
    # stage must then hide them.)
    t.same_keys = t.tile_lo < t.tile_hi and not (t.bf16_dot and t.tile_lo % _block_align(t))
    for r in range(t.nrows):
        if t.lo[r] != t.tile_lo or t.hi[r] != t.tile_hi:
            t.same_keys = False
            break
    # A decode tile of bfloat16 products (one row, or up to 4 that see the same keys) takes
    # V's pairs straight from the rows instead of packing the block first, which its rows
    # would read once (same bits).
    t.v_pairs_rows = (t.bf16_dot and not t.amx and not P.backward
                      and (t.nrows == 1 or t.nrows <= 4 and t.same_keys))
    # Rows a 4-row output tile may cover past the last vector see nothing too.
    for r in range(t.nrows, min(FA_BQ, max(t.nlanes, _round_up(t.nrows, 4)))):
        t.lo[r] = 0
        t.hi[r] = 0
    for ic in range(t.nlanes // t.VL):
        _keys_seen(t, ic * t.VL, min(ic * t.VL + t.VL, t.nrows), &t.vec_lo[ic], &t.vec_hi[ic])
    _group_intervals(t)
    if t.decode or t.int8_dot:
        # Decode score kernels (and the integer ones) store real rows only: the padding
        # lanes of S^T hold finite values from here on (0, then the softmax's p), so no
        # stale NaN or denormal reaches the exp.  Only the keys a block can hold for this tile.
        # The two-keys-per-vector softmax step and the 4-row output tile read lanes 0-3 only.
        nj = min(FA_BK, t.tile_hi - t.tile_lo) if t.tile_lo < t.tile_hi else 0
        for r in range(t.nrows, 4 if t.softmax_pairs else t.nlanes):
            for j in range(nj):
                s[j * FA_BQ + r] = 0
