# The tile pipeline: one work item (a block of query rows of one kv head) through the
# fused attention loop, one named stage per concern.  Included by _kernel_impl.pxi.
#
#   _setup            geometry, each row's visible key interval, Q^T packed, empty state
#   for each key chunk (FA_KCHUNK keys) the rows can see, in key order:
#     for each key block (FA_BK keys) of the chunk, in key order:
#       _load_block       the block's K and V rows: in place, or widened from 16 bits
#       _scores_prefill   S^T = scale K Q^T, query rows as lanes (score micro-tiles)
#       _scores_decode    the same with keys as lanes (decode-sized tiles)
#       _finish_scores    score modifiers, then the visibility rule: the only code that
#                         reads the mask or writes -inf
#       _softmax          online-softmax step: m, l, alpha; S^T -> P^T in place
#       _pv_prefill / _pv_decode   acc = acc * alpha + P V
#     _merge_chunk (or _store_partial for flash-decoding) into the running state
#   _write_rows       out = ACC / L, lse
#
# A stage is a function of the Problem, the Tile (the work item and the key block being
# processed) and the thread's workspace, whose layout _carve alone knows.

cdef Py_ssize_t FA_DECODE_ROWS = 8
cdef double LOG2E = 1.4426950408889634074
cdef double LN2 = 0.69314718055994530942


cdef struct Problem:
    # Base pointers of element [0, ..., 0] of each array: q, k, v, out in their storage
    # type (*_isz bytes per element; *_kind FA_STORE_NATIVE for the compute type, or
    # float16 / bfloat16), lse in the compute type, mask in its own.
    char* q
    char* k
    char* v
    char* out
    char* lse
    char* mask
    # Per flattened batch element: element offsets into each array, and kv length.
    const Py_ssize_t* q_boff
    const Py_ssize_t* k_boff
    const Py_ssize_t* v_boff
    const Py_ssize_t* o_boff
    const Py_ssize_t* lse_boff
    const Py_ssize_t* m_boff
    const Py_ssize_t* kv_len
    Py_ssize_t nbatch, Hq, Hkv, group, Lq, Lk, D, Dv
    Py_ssize_t q_isz, k_isz, v_isz, o_isz
    int q_kind, k_kind, v_kind, o_kind
    # Element strides (the last axis of q, k, v, out is contiguous).
    Py_ssize_t q_sh, q_si, k_sh, k_sj, v_sh, v_sj, o_sh, o_si, lse_sh, lse_si
    Py_ssize_t m_sh, m_si, m_sj
    int mask_kind
    int causal
    Py_ssize_t wl, wr
    double scale
    # Variants: softcap (0: none); per (batch element, query head) ALiBi slopes and
    # attention-sink logits, nbatch x Hq (NULL: none); per batch element the number of
    # real query rows (NULL: Lq everywhere).
    double softcap
    const double* alibi
    const double* sinks
    const Py_ssize_t* q_len
    # Packed sequences: batch element b is a sequence of q_len[b] rows and kv_len[b] keys
    # (past them, the next sequence's); its work items' rows R are head * q_len[b] + position.
    bint packed
    # A backward pass (_backward.pxi): its workspace regions are carved too, and the
    # finish-scores stage also leaves the softcap's slope.
    bint backward
    # q, k and v bfloat16, multiplied in bfloat16 pairs (fa_bf16dot.h): every tile then
    # runs the prefill's chains (decode tiles with the keys as lanes), K read in place and
    # V packed in pairs of keys.
    bint bf16_dot
    # ... on AMX tiles (fa_amx.h): 0, or the backend FA_AMX_HW / FA_AMX_MODEL.  Key blocks
    # then start at multiples of 32 keys, the chunks of the output tiles.
    int amx
    # Serving caches.  Pages: key j of batch element b is row j % page of page
    # block_table[b * bt_stride + j // page], pages k_pst (v_pst) elements apart (k_boff,
    # v_boff unused); NULL: rows of batch element b from k_boff[b] as usual.  K or V in
    # a byte per value or less (FA_QUANTISED kinds, fa_quant.h): q8_0 and q4_0 rows have
    # one float16 scale per 32 values, at k_scale addressed like K with the strides
    # ks_pst (a page, or a batch element), ks_sh, ks_sj (likewise v_scale); fp8 rows one
    # float32 scale per kv head, k_fscale[g * kfs_sh] (likewise v_fscale).
    const int32_t* block_table
    Py_ssize_t bt_stride, page, k_pst, v_pst
    const uint16_t* k_scale
    const uint16_t* v_scale
    Py_ssize_t ks_pst, ks_sh, ks_sj, vs_pst, vs_sh, vs_sj
    const float* k_fscale
    const float* v_fscale
    Py_ssize_t kfs_sh, vfs_sh


cdef struct Workspace:
    # Element offsets of a thread's workspace arrays (see _carve); elems: its size.
    Py_ssize_t qt, qw, s, acc, m, l, alpha, ACC, M, L, fa, fb, vtail, nslope, diag, zrow
    Py_ssize_t kblk, vblk, orow, pp, pr, kst, elems
    # The backward pass's (see _carve_backward); slope is -1 without a softcap.
    Py_ssize_t slope, dp, dot, dorows, qrows, pt, dkacc, dvacc, dqacc, kpad, lse2, delta, psum
    Py_ssize_t ones
    Py_ssize_t dkblk, dvblk, dqblk, bpairs, kpairs


cdef struct Tile:
    # The work item: rows [r0, r0 + nrows) of kv head g of batch element b (row R is
    # query head g * group + R // Lq at position R % Lq).
    Py_ssize_t b, g, r0, nrows
    Py_ssize_t nlanes             # rows padded to whole vectors of VL lanes
    Py_ssize_t VL, NL             # lanes of a vector; of a score micro-tile's 2 vectors
    Py_ssize_t n6                 # rows in 6-row output tiles
    Py_ssize_t dv_pad, dv_main, dv_tail, ldqt
    bint decode                   # few rows: keys are the lanes of the score kernels
    bint bf16_dot                 # products in bfloat16 pairs (Problem.bf16_dot)
    int amx                       # on AMX tiles (Problem.amx)
    bint gather                   # K and V rows addressed one by one (_gathers)
    bint defer_v                  # gathered V widened after the softmax (_gather_v)
    bint quant_in_place           # decode over quantised K and V read where stored (fa_quant.h)
    bint copy_rows                # decode over paged float rows: K copied as stored
    bint k_in_place               # (16-bit K: read through row pointers instead)
    bint v_in_place               # and V read through row pointers (fa_pv_ptr)
    bint spread_next              # the kernels request the next block's rows (kpf, vpf)
    bint pv_next_v, first_blk     # decode prefetch split (see _pv_decode)
    # The work item's next tile (kv head next_g of batch element next_b; next_b < 0: none),
    # whose first key block the last block requests as it goes (_gather, _gather_quant).
    Py_ssize_t next_b, next_g
    double scale_log2             # scale * log2 e: scores are kept in base 2
    Py_ssize_t kv_len, q_len              # keys and real query rows of batch element b
    Py_ssize_t row_len                    # positions per query head in the rows R (_row_len)
    Py_ssize_t tile_lo, tile_hi           # keys [tile_lo, tile_hi) are seen by some row
    bint same_keys                # every row sees exactly [tile_lo, tile_hi), not empty
    bint gqa4                     # 4-row score passes over 16-bit K: fa_score_gqa4
    bint softmax_pairs            # the softmax step of <= 4 rows: fa_softmax_pairs_f
    # fp8 K and V: kv head g's scales, times FA_E4M3_UNIT for e4m3 (fa_quant.h); else 0.
    float kfs, vfs
    # K and V rows of kv head g in their storage type: key j at kb + j * k_row bytes.
    const char* kb
    const char* vb
    Py_ssize_t k_row, v_row
    bint widen_k, widen_v         # 16-bit K, V widened block by block (_load_block)
    # The key block being processed: keys [j0, j1), and its K and V rows in the compute
    # type as the kernels read them: key j0 + u at kblk + u * kblk_row bytes (kblk_sj
    # elements apart), likewise V.
    Py_ssize_t j0, j1, nj
    const char* kblk
    const char* vblk
    Py_ssize_t kblk_sj, vblk_sj, kblk_row, vblk_row, vblk_esz
    int kblk_kind, vblk_kind      # how the kernels read them: FA_STORE_NATIVE, or 16-bit
    # Per row: visible keys [lo, hi); per vector of rows: the union of its rows' intervals.
    Py_ssize_t* lo
    Py_ssize_t* hi
    Py_ssize_t vec_lo[FA_BQ]
    Py_ssize_t vec_hi[FA_BQ]
    # Per row: the constant its float mask is shifted by (_set_mask_shifts).
    double mshift[FA_BQ]
    # Per lane group ig of the score and finish stages (NL rows; a decode tile is one
    # group): the union [grp_lo, grp_hi) of its rows' intervals, and the keys every one of
    # its rows sees, [grp_all_lo, grp_all_hi) (empty when some row sees nothing).  Per
    # 6-row output tile: the union [pv_lo, pv_hi).  Computed once, in _setup_rows.
    Py_ssize_t grp_lo[FA_BQ]
    Py_ssize_t grp_hi[FA_BQ]
    Py_ssize_t grp_all_lo[FA_BQ]
    Py_ssize_t grp_all_hi[FA_BQ]
    Py_ssize_t pv_lo[FA_BQ]
    Py_ssize_t pv_hi[FA_BQ]
    const char* krows[32]         # key rows of one score call (FA_MR_K or FA_DEC_KEYS_F)
    # The block's K and V rows where they are stored (gathered blocks, bfloat16 products,
    # quantised rows read in place).
    const char* kptr[FA_BK]
    const char* vptr[FA_BK]
    # Quantised rows read in place, and spread_next: the next block's K and V rows (npf of them),
    # which the kernels request into L2 as they go.
    const char* kpf[FA_BK]
    const char* vpf[FA_BK]
    Py_ssize_t npf
    const char* vrows[32]         # decode: the V rows of krows, to prefetch


cdef inline Py_ssize_t _round_up(Py_ssize_t x, Py_ssize_t m) noexcept nogil:
    return ((x + m - 1) // m) * m


# ---------------------------------------------------------------------------- workspace

cdef void _carve(Workspace* w, const Problem* P, Py_ssize_t VL) noexcept nogil:
    # The layout of one thread's workspace, in elements of the compute type.  Blocks of
    # widened K and V only for 16-bit K and V, a vector's widened query rows only for a
    # 16-bit q, and output rows only for a 16-bit out.
    cdef Py_ssize_t D = P.D, Dv = P.Dv, dv_pad = _round_up(Dv, 2 * VL), o = 0
    w.qt = o; o += D * FA_BQ                    # Q^T
    w.qw = o                                    # VL query rows widened, to pack into Q^T
    if P.q_kind != FA_STORE_NATIVE:
        o += VL * D
    w.s = o; o += (FA_BK + FA_MR_K) * FA_BQ     # S^T (a score micro-tile may run past nj)
    w.acc = o; o += FA_BQ * dv_pad              # the chunk's output rows
    w.m = o; o += FA_BQ
    w.l = o; o += FA_BQ
    w.alpha = o; o += FA_BQ
    w.ACC = o; o += FA_BQ * dv_pad              # the running state over merged chunks
    w.M = o; o += FA_BQ
    w.L = o; o += FA_BQ
    w.fa = o; o += FA_BQ                        # merge factors
    w.fb = o; o += FA_BQ
    w.vtail = o; o += FA_BK * 2 * VL            # V's last columns, zero-padded
    w.nslope = o; o += FA_BQ                    # ALiBi per row: -slope log2 e
    w.diag = o; o += FA_BQ                      # and the row's diagonal
    w.zrow = o; o += max(D, Dv) + 1             # a zero key (or value) row for padding keys
    w.kblk = o                                  # a block of K, widened, and of V
    o += FA_BK * D if _gathers(P) or P.k_kind != FA_STORE_NATIVE else 0
    w.vblk = o
    o += FA_BK * Dv if _gathers(P) or P.v_kind != FA_STORE_NATIVE else 0
    w.orow = o; o += dv_pad if P.o_kind != FA_STORE_NATIVE else 0      # a row before rounding
    w.pp = o; o += (FA_BK // 2) * FA_BQ if P.bf16_dot else 0           # P in bfloat16 pairs
    w.pr = o; o += (FA_BK // 2) * FA_BQ if P.amx else 0                # P rows in bfloat16
    w.kst = o; o += 16 * max(D, Dv) if P.amx else 0                   # 32 K (V) rows staged
    if P.backward:
        o = _carve_backward(w, P, VL, o)
    w.elems = _round_up(o, 16)                  # threads' workspaces never share a line


cdef inline bint _gathers(const Problem* P) noexcept nogil:
    # Whether K and V blocks are gathered row by row into the workspace: rows in pages, or
    # quantised values dequantised.
    return P.block_table != NULL or FA_QUANTISED(P.k_kind) or FA_QUANTISED(P.v_kind)


cdef Py_ssize_t _carve_backward(Workspace* w, const Problem* P, Py_ssize_t VL,
                                Py_ssize_t o) noexcept nogil:
    # The backward pass's workspace arrays from element o on; returns the end.  Rows of
    # keys are padded to whole 6-key micro-tiles past a span of FA_BKV_MAX keys (a dK/dV
    # work item), rows of columns to whole 2-vector strips.
    cdef Py_ssize_t nk_pad = FA_BKV_MAX + FA_MR_PV, sblk = (FA_BK + FA_MR_K) * FA_BQ
    cdef Py_ssize_t d_pad = _round_up(P.D, 2 * VL), dv_pad = _round_up(P.Dv, 2 * VL)
    w.slope = -1
    if P.softcap > 0:
        w.slope = o; o += sblk                  # the softcap's slope, laid out like S^T
    w.dp = o; o += sblk                         # dP^T, then dS^T
    w.dot = o; o += P.Dv * FA_BQ                # dO^T, packed like Q^T
    w.dorows = o; o += FA_BQ * dv_pad           # dO rows, zero-padded
    w.qrows = o; o += FA_BQ * d_pad             # Q rows, zero-padded
    w.pt = o; o += FA_BQ * (FA_BK + FA_MR_PV)   # P or dS with rows of keys
    w.dkacc = o; o += nk_pad * d_pad            # dK and dV of a work item's keys
    w.dvacc = o; o += nk_pad * dv_pad
    w.dqacc = o; o += FA_BQ * d_pad             # dQ of a work item's rows
    w.dkblk = o; o += (FA_BK + FA_MR_PV) * d_pad    # one tile's sums, added to those
    w.dvblk = o; o += (FA_BK + FA_MR_PV) * dv_pad
    w.dqblk = o; o += FA_BQ * d_pad
    w.kpad = o; o += FA_BK * d_pad              # a block of K, zero-padded
    w.lse2 = o; o += FA_BQ                      # per row: lse log2 e, Delta, sum of P
    w.delta = o; o += FA_BQ
    w.psum = o; o += FA_BQ
    w.ones = o; o += FA_MR_PV
    if P.amx:
        w.bpairs = o; o += (FA_BQ // 2) * max(P.D, P.Dv)    # dO or Q in pairs of rows
        w.kpairs = o; o += (FA_BK // 2) * P.D               # K in pairs of keys
    return o


cdef inline Py_ssize_t _partial_rows(const Problem* P, Py_ssize_t VL) noexcept nogil:
    # Rows of a flash-decoding chunk state: a work item's lanes, padded to whole vectors.
    return min(FA_BQ, _round_up(P.group * P.Lq, VL))


cdef inline Py_ssize_t _partial_elems(const Problem* P, Py_ssize_t VL) noexcept nogil:
    # One chunk state, laid out [m | l | acc] with _partial_rows rows.
    return _partial_rows(P, VL) * (_round_up(P.Dv, 2 * VL) + 2)


# ---------------------------------------------------------------------------- setup

cdef inline void _row_position(const Problem* P, const Tile* t, Py_ssize_t r, Py_ssize_t* h,
                               Py_ssize_t* i) noexcept nogil:
    # Query head and position of row r of the tile.
    cdef Py_ssize_t R = t.r0 + r
    h[0] = t.g * P.group + R // t.row_len
    i[0] = R % t.row_len


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
    # its prefill row.
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
    # copy paged float rows as they are stored, for the decode kernels to widen in
    # registers as they do in place.
    t.gather = _gathers(P)
    cdef bint quant = FA_QUANTISED(P.k_kind)
    t.quant_in_place = (floating is float and t.decode and quant and P.v_kind == P.k_kind
                        and P.D % 32 == 0 and P.Dv % 32 == 0)
    t.copy_rows = floating is float and t.decode and t.gather and not quant
    # ... 16-bit K rows then read where they are by the score kernels, which transpose or
    # widen them anyway; V read through row pointers, whole vectors of columns (else
    # copied too)
    t.k_in_place = t.copy_rows and (P.k_kind == FA_STORE_F16 or P.k_kind == FA_STORE_BF16)
    t.v_in_place = t.copy_rows and P.Dv % (2 * t.VL) == 0
    # With both read in place, the kernels request the next block's rows as they go (K:
    # the score kernel, V: the output kernel), spread over their steps; when K is copied,
    # _gather requests them as it copies, the faster order for that path.
    t.spread_next = t.k_in_place and t.v_in_place
    t.widen_k = (P.k_kind != FA_STORE_NATIVE or t.gather) and not (
        t.decode and floating is float and not quant or t.quant_in_place or t.bf16_dot)
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
    cdef Py_ssize_t r, h, i, ic, j, nj, u, c, ldqt = t.ldqt, D = P.D
    cdef bint real
    memset(ws + w.zrow, 0, max(D, P.Dv) * sizeof(floating))
    _set_mask_shifts(P, t, <const floating*> P.mask)
    t.tile_lo = t.kv_len
    t.tile_hi = 0
    for r in range(t.nlanes):
        qrows[r % t.VL] = zrow
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
            qrows[r % t.VL] = P.q + (P.q_boff[t.b] + h * P.q_sh + i * P.q_si) * P.q_isz
        if r % t.VL == t.VL - 1:
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
    # Rows a 4-row output tile may cover past the last vector see nothing too.
    for r in range(t.nrows, min(FA_BQ, max(t.nlanes, _round_up(t.nrows, 4)))):
        t.lo[r] = 0
        t.hi[r] = 0
    for ic in range(t.nlanes // t.VL):
        _keys_seen(t, ic * t.VL, min(ic * t.VL + t.VL, t.nrows), &t.vec_lo[ic], &t.vec_hi[ic])
    _group_intervals(t)
    if t.decode:
        # Decode score kernels store real rows only: the padding lanes of S^T hold finite
        # values from here on (0, then the softmax's p), so no stale NaN or denormal reaches
        # the exp.  Only the keys a block can hold for this tile.
        # The two-keys-per-vector softmax step and the 4-row output tile read lanes 0-3 only.
        nj = min(FA_BK, t.tile_hi - t.tile_lo) if t.tile_lo < t.tile_hi else 0
        for r in range(t.nrows, 4 if t.softmax_pairs else t.nlanes):
            for j in range(nj):
                s[j * FA_BQ + r] = 0


# ---------------------------------------------------------------------------- key block

cdef void _load_block(const Problem* P, Tile* t, const Workspace* w,
                      floating* ws) noexcept nogil:
    # The block's K and V rows as the kernels read them.  Stored in the compute type, or
    # in 16 bits where a float kernel widens them in registers (see widen_k), they are
    # read in place.  Otherwise 16-bit rows are widened into the workspace while the
    # next block's rows are prefetched: one pass over the block serves every row of the
    # tile.  Rows in pages or quantised are gathered into the workspace row by row
    # (_gather).  Widening is exact, and dequantising is one multiplication wherever it
    # happens (fa_quant.h), so the kernels compute the same bits whichever way a value
    # arrives.
    cdef Py_ssize_t nxt = max(0, min(FA_BK, t.tile_hi - t.j1))
    t.kblk_kind = t.vblk_kind = FA_STORE_NATIVE
    t.vblk_esz = sizeof(floating)
    if floating is float and t.quant_in_place:
        _gather_quant(P, t, w, ws)
        return
    if t.gather:
        _gather(P, t, w, ws)
    elif not t.widen_k:
        t.kblk, t.kblk_row, t.kblk_sj = t.kb + t.j0 * t.k_row, t.k_row, P.k_sj
        t.kblk_kind = P.k_kind
    else:
        widen_rows(P.k_kind, t.kb + t.j0 * t.k_row, P.k_sj, t.nj, P.D, ws + w.kblk, P.D,
                   t.kb + t.j1 * t.k_row, nxt)
    if t.widen_k:
        t.kblk, t.kblk_row, t.kblk_sj = <const char*> (ws + w.kblk), P.D * sizeof(floating), P.D
    elif t.copy_rows:
        t.kblk, t.kblk_row, t.kblk_sj = <const char*> (ws + w.kblk), P.D * P.k_isz, P.D
        t.kblk_kind = P.k_kind
    if t.bf16_dot:
        # K read through row pointers; V in pairs of keys, the layout of the bfloat16
        # output tiles (fa_pack_v_pairs)
        if not t.gather:
            _row_pointers(t.kptr, t.kb + t.j0 * t.k_row, t.k_row, t.nj)
            _row_pointers(t.vptr, t.vb + t.j0 * t.v_row, t.v_row, t.nj)
        if floating is float and not P.backward:
            fa_pack_v_pairs(<const uint16_t* const*> t.vptr, t.nj, P.Dv, <uint32_t*> (ws + w.vblk))
            if t.amx:
                _zero_pairs_to(<uint32_t*> (ws + w.vblk), t.nj, _round_up(t.nj, 32), P.Dv)
        t.vblk, t.vblk_row, t.vblk_sj = <const char*> (ws + w.vblk), 0, 0
    elif t.copy_rows:
        t.vblk, t.vblk_row, t.vblk_sj = <const char*> (ws + w.vblk), P.Dv * P.v_isz, P.Dv
        t.vblk_kind, t.vblk_esz = P.v_kind, P.v_isz
    elif not t.widen_v:
        t.vblk, t.vblk_row, t.vblk_sj = t.vb + t.j0 * t.v_row, t.v_row, P.v_sj
        t.vblk_kind, t.vblk_esz = P.v_kind, P.v_isz
    else:
        if not t.gather:
            widen_rows(P.v_kind, t.vb + t.j0 * t.v_row, P.v_sj, t.nj, P.Dv, ws + w.vblk, P.Dv,
                       t.vb + t.j1 * t.v_row, nxt)
        t.vblk, t.vblk_row, t.vblk_sj = <const char*> (ws + w.vblk), P.Dv * sizeof(floating), P.Dv


cdef inline void _row_pointers(const char** ptr, const char* first, Py_ssize_t row,
                               Py_ssize_t n) noexcept nogil:
    cdef Py_ssize_t u
    for u in range(n):
        ptr[u] = first + u * row


cdef struct CacheRows:
    # Walks the rows of kv head g of batch element b in a cache, key after key: the element
    # offsets of K, V and their scales for key j (one division per page, not per row).
    Py_ssize_t j, page_left, k, v, ks, vs


cdef inline void _cache_seek(const Problem* P, const Tile* t, CacheRows* c,
                             Py_ssize_t j) noexcept nogil:
    # Point c at key j.
    _cache_seek_at(P, t.b, t.g, c, j)


cdef inline void _cache_seek_at(const Problem* P, Py_ssize_t b, Py_ssize_t g, CacheRows* c,
                                Py_ssize_t j) noexcept nogil:
    # Point c at key j of kv head g of batch element b.
    cdef Py_ssize_t page, i
    c.j = j
    if P.block_table == NULL:
        c.page_left = -1                         # no pages: rows are evenly spaced
        c.k = P.k_boff[b] + g * P.k_sh + j * P.k_sj
        c.v = P.v_boff[b] + g * P.v_sh + j * P.v_sj
        c.ks = b * P.ks_pst + g * P.ks_sh + j * P.ks_sj
        c.vs = b * P.vs_pst + g * P.vs_sh + j * P.vs_sj
        return
    page = P.block_table[b * P.bt_stride + j // P.page]
    i = j % P.page
    c.page_left = P.page - i
    c.k = page * P.k_pst + g * P.k_sh + i * P.k_sj
    c.v = page * P.v_pst + g * P.v_sh + i * P.v_sj
    c.ks = page * P.ks_pst + g * P.ks_sh + i * P.ks_sj
    c.vs = page * P.vs_pst + g * P.vs_sh + i * P.vs_sj


cdef inline Py_ssize_t _next_tile_keys(const Problem* P, const Tile* t,
                                       Py_ssize_t n) noexcept nogil:
    # Keys of the next tile's first block to request now: when this is the tile's last
    # block, up to n of them (its keys from 0: a hint, which a window may make useless but
    # never wrong); else 0.
    if t.next_b < 0 or t.j1 < t.tile_hi:
        return 0
    return min(n, FA_BK, P.kv_len[t.next_b])


cdef void _row_runs(const Problem* P, Py_ssize_t b, Py_ssize_t g, Py_ssize_t j, Py_ssize_t n,
                    const char** kp, const char** vp) noexcept nogil:
    # The K and V row pointers of keys j .. j + n - 1 of kv head g of batch element b, a
    # run of evenly spaced rows (a page's, or all of them) at a time.
    cdef CacheRows c
    cdef Py_ssize_t u = 0, m, i, kr = P.k_sj * P.k_isz, vr = P.v_sj * P.v_isz
    cdef const char* k
    cdef const char* v
    while u < n:
        _cache_seek_at(P, b, g, &c, j + u)
        m = n - u if c.page_left < 0 else min(n - u, c.page_left)
        k = P.k + c.k * P.k_isz
        v = P.v + c.v * P.v_isz
        for i in range(m):
            kp[u + i] = k + i * kr
            vp[u + i] = v + i * vr
        u += m


cdef inline void _cache_next(const Problem* P, const Tile* t, CacheRows* c) noexcept nogil:
    # Point c at the next key (which must exist: past a page it is looked up).
    c.page_left -= 1
    if c.page_left == 0:
        _cache_seek(P, t, c, c.j + 1)
        return
    c.j += 1
    c.k += P.k_sj
    c.v += P.v_sj
    c.ks += P.ks_sj
    c.vs += P.vs_sj


cdef void _gather(const Problem* P, Tile* t, const Workspace* w, floating* ws) noexcept nogil:
    # The block's K and V rows looked up one by one (pages), into kptr and vptr, and,
    # unless the bfloat16 products read them there, widened (or dequantised) into the
    # workspace; meanwhile the next block's rows are requested into L2, since
    # no hardware prefetcher follows rows across pages (or, spread_next, looked up into
    # kpf and vpf for the kernels to request).
    cdef Py_ssize_t u, nxt = max(0, min(FA_BK, t.tile_hi - t.j1))
    cdef floating* kdst = ws + w.kblk
    cdef floating* vdst = ws + w.vblk
    cdef CacheRows c, n
    if t.spread_next:
        # Row pointers only, a run at a time; the last block of a tile requests the next
        # tile's first rows instead.
        _row_runs(P, t.b, t.g, t.j0, t.nj, t.kptr, t.vptr)
        t.npf = min(nxt, t.nj)
        if t.npf:
            _row_runs(P, t.b, t.g, t.j1, t.npf, t.kpf, t.vpf)
        else:
            t.npf = _next_tile_keys(P, t, t.nj)
            _row_runs(P, t.next_b, t.next_g, 0, t.npf, t.kpf, t.vpf)
        return
    _cache_seek(P, t, &c, t.j0)
    if nxt:
        _cache_seek(P, t, &n, t.j1)
    t.npf = min(nxt, t.nj) if t.spread_next else 0
    for u in range(t.nj):
        t.kptr[u] = P.k + c.k * P.k_isz
        t.vptr[u] = P.v + c.v * P.v_isz
        if u < nxt:
            if t.spread_next:
                # requested as the kernels go: K by the score kernel, V by the output one
                t.kpf[u] = P.k + n.k * P.k_isz
                t.vpf[u] = P.v + n.v * P.v_isz
            else:
                # (a page's last row ends its run: page_left 1)
                fa_prefetch_row(P.k + n.k * P.k_isz, _row_bytes(P.k_kind, P.D, P.k_isz),
                                n.page_left == 1, 2)
                fa_prefetch_row(P.v + n.v * P.v_isz, _row_bytes(P.v_kind, P.Dv, P.v_isz),
                                n.page_left == 1, 2)
            if u + 1 < nxt:   # (never past the last key: its page may be the table's last)
                _cache_next(P, t, &n)
        if t.copy_rows:
            if not t.k_in_place:
                memcpy(<char*> kdst + u * P.D * P.k_isz, t.kptr[u], P.D * P.k_isz)
            if not t.defer_v and not t.v_in_place:
                memcpy(<char*> vdst + u * P.Dv * P.v_isz, t.vptr[u], P.Dv * P.v_isz)
        elif not t.bf16_dot:
            _gather_row(t.kptr[u], P.k_kind, P.k_scale + c.ks, t.kfs, P.D, kdst + u * P.D)
            if not t.defer_v:
                _gather_row(t.vptr[u], P.v_kind, P.v_scale + c.vs, t.vfs, P.Dv,
                            vdst + u * P.Dv)
        if u + 1 < t.nj:
            _cache_next(P, t, &c)
    if not nxt:
        _prefetch_next_tile(P, t)


cdef void _prefetch_next_tile(const Problem* P, const Tile* t) noexcept nogil:
    # The next tile's first rows requested into L2 (see _next_tile_keys).
    cdef Py_ssize_t u, n = _next_tile_keys(P, t, FA_BK)
    cdef CacheRows c
    if n:
        _cache_seek_at(P, t.next_b, t.next_g, &c, 0)
    for u in range(n):
        fa_prefetch_row(P.k + c.k * P.k_isz, _row_bytes(P.k_kind, P.D, P.k_isz),
                        c.page_left == 1, 2)
        fa_prefetch_row(P.v + c.v * P.v_isz, _row_bytes(P.v_kind, P.Dv, P.v_isz),
                        c.page_left == 1, 2)
        if u + 1 < n:
            c.page_left -= 1
            if c.page_left == 0:
                _cache_seek_at(P, t.next_b, t.next_g, &c, u + 1)
            else:
                c.k += P.k_sj
                c.v += P.v_sj


cdef void _gather_quant(const Problem* P, Tile* t, const Workspace* w,
                        float* ws) noexcept nogil:
    # The block's quantised rows for the decode kernels that read them in place, run by
    # run of evenly spaced rows (a page, or the whole block): their pointers into kptr
    # and vptr, their scales in float32 into the workspace (kblk, vblk; see
    # fa_quant_rows), and the next block's row pointers into kpf and vpf.
    cdef Py_ssize_t u = 0, n, nbk = P.D // 32, nbv = P.Dv // 32, b
    cdef float* ksc = ws + w.kblk
    cdef float* vsc = ws + w.vblk
    cdef CacheRows c
    while u < t.nj:
        _cache_seek(P, t, &c, t.j0 + u)
        n = t.nj - u if c.page_left < 0 else min(t.nj - u, c.page_left)
        fa_quant_rows(P.k_kind, P.k + c.k, P.k_sj, P.k_scale + c.ks, P.ks_sj, nbk, t.kfs,
                      P.v + c.v, P.v_sj, P.v_scale + c.vs, P.vs_sj, nbv, t.vfs, n,
                      t.kptr + u, t.vptr + u, ksc + u, FA_BK, vsc + u * nbv)
        u += n
    for u in range(t.nj, _round_up(t.nj, 2 * t.VL)):   # padding keys' lanes: defined zeros
        for b in range(nbk):
            ksc[b * FA_BK + u] = 0
    t.npf = max(0, min(FA_BK, t.tile_hi - t.j1))
    cdef Py_ssize_t nb = t.b, ng = t.g, j1 = t.j1
    if not t.npf:
        # the tile's last block: the next tile's first rows instead
        t.npf = _next_tile_keys(P, t, FA_BK)
        nb, ng, j1 = t.next_b, t.next_g, 0
    u = 0
    while u < t.npf:
        _cache_seek_at(P, nb, ng, &c, j1 + u)
        n = t.npf - u if c.page_left < 0 else min(t.npf - u, c.page_left)
        fa_quant_next_rows(P.k_kind, P.k + c.k, P.k_sj, P.k_scale + c.ks, P.ks_sj, nbk,
                           P.v + c.v, P.v_sj, P.v_scale + c.vs, P.vs_sj, nbv, n,
                           t.kpf + u, t.vpf + u)
        u += n


cdef void _gather_v(const Problem* P, Tile* t, const Workspace* w,
                    floating* ws) noexcept nogil:
    # The block's V rows widened (or dequantised, or copied: copy_rows) into the
    # workspace, when _gather left them for after the softmax (defer_v).
    cdef Py_ssize_t u
    cdef CacheRows c
    _cache_seek(P, t, &c, t.j0)
    for u in range(t.nj):
        if t.copy_rows:
            memcpy(<char*> (ws + w.vblk) + u * P.Dv * P.v_isz, t.vptr[u], P.Dv * P.v_isz)
        else:
            _gather_row(t.vptr[u], P.v_kind, P.v_scale + c.vs, t.vfs, P.Dv,
                        ws + w.vblk + u * P.Dv)
        if u + 1 < t.nj:
            _cache_next(P, t, &c)


cdef inline Py_ssize_t _row_bytes(int kind, Py_ssize_t n, Py_ssize_t isz) noexcept nogil:
    # The bytes of a row of n values stored as `kind`, isz bytes per stored element.
    return fa_quant_row_bytes(kind, n) if FA_QUANTISED(kind) else n * isz


cdef inline void _gather_row(const char* src, int kind, const uint16_t* bscale, float fscale,
                             Py_ssize_t n, floating* dst) noexcept nogil:
    # One row of n values stored as `kind` in the compute type (bscale: its block scales;
    # fscale: its fp8 scale, see _fp8_scale).
    if kind == FA_STORE_NATIVE:
        memcpy(dst, src, n * sizeof(floating))
    elif FA_QUANTISED(kind):
        dequant_row(kind, src, bscale, fscale, n, dst)
    else:
        widen_rows(kind, src, 0, 1, n, dst, n, NULL, 0)


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
    if floating is float and t.quant_in_place:
        _scores_quant(P, t, w, ws)
        return
    for ig in range((nj + KC - 1) // KC):
        jb = ig * KC
        nk = <int> min(KC, nj - jb)
        for u in range(KC):
            if jb + u >= nj:
                t.krows[u] = zrow
            elif t.k_in_place:
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
        ldk = t.kblk_sj if nk == KC and t.kblk_sj != 0 and not t.k_in_place else 0
        # > 0 also turns on the next K rows stream
        if t.spread_next:
            pf_bytes = P.D * P.k_isz + 63      # every line of a row, however it is aligned
        else:
            pf_bytes = P.Dv * (P.v_isz if t.defer_v or t.v_in_place else t.vblk_esz)
        r = 0
        while r < nrows:
            nr = _keyrows_pass(t, nrows - r)
            if floating is float:
                if nr == 4 and (ldk != 0 or t.k_in_place) and t.gqa4:
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
    # rows, each over the pairs of keys any of its rows sees (the others add exact zeros).
    cdef uint32_t* pp = <uint32_t*> (ws + w.pp)
    cdef const uint32_t* vp = <const uint32_t*> t.vblk
    cdef Py_ssize_t rg = 0, nr, ja, z, a, npairs, c, Dv = t.dv_main
    fa_pack_p_pairs(ws + w.s, FA_BQ, t.nj, t.nlanes, pp, FA_BQ)
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


# ---------------------------------------------------------------------------- work items

cdef void _attend_tile(const Problem* P, Py_ssize_t b, Py_ssize_t g, Py_ssize_t r0,
                       Py_ssize_t chunk, floating* partial,
                       floating* ws, Py_ssize_t* lo, Py_ssize_t* hi,
                       Py_ssize_t next_bg) noexcept nogil:
    # One tile: rows [r0, r0 + nrows) of kv head g of batch element b.
    #   chunk < 0:  all key chunks the rows see, merged in key order, rows written out;
    #   chunk >= 0: only that chunk; its state goes to `partial` (flash-decoding).
    # next_bg: b * Hkv + g of the tile its thread runs next (its first rows are requested
    # during this tile's last block), or -1.
    cdef Workspace w
    cdef Tile t
    cdef Py_ssize_t kc, kc0 = 0, kc1 = 0
    _carve(&w, P, vec_lanes(ws))
    _setup(P, &t, b, g, r0, lo, hi, ws)
    if next_bg >= 0:
        t.next_b, t.next_g = next_bg // P.Hkv, next_bg % P.Hkv
    _setup_rows(P, &t, &w, ws)
    _reset_state(ws + w.M, ws + w.L, ws + w.ACC, t.nlanes, t.dv_pad, _acc_rows(&t))
    if t.tile_lo < t.tile_hi:
        kc0 = t.tile_lo // FA_KCHUNK
        kc1 = (t.tile_hi + FA_KCHUNK - 1) // FA_KCHUNK
    if chunk >= 0:
        kc0, kc1 = chunk, chunk + 1
    fa_amx_begin(t.amx)
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
