# The state of a work item: the Problem (a call, as the kernels read it), the Tile (one
# work item and the key block in hand), and the thread's workspace, carved by _carve.
# One stage file of the tile pipeline: _tile_pipeline.pxi includes them in order.

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
    # q.k in integers over q8_0 or q4_0 K and V of the same kind (fa_int8dot.h; set by
    # _run from the opt-in): every tile of float compute then runs the decode kernels,
    # q quantised per block as the tile is set up.
    bint int8_dot
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
    Py_ssize_t qt, qw, qi, s, acc, m, l, alpha, ACC, M, L, fa, fb, vtail, nslope, diag, zrow
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
    bint v_pairs_rows             # decode rows' pairs of V read from the rows (fa_pv_rows_bdp)
    bint gather                   # K and V rows addressed one by one (_gathers)
    bint defer_v                  # gathered V widened after the softmax (_gather_v)
    bint quant_in_place           # decode over quantised K and V read where stored (fa_quant.h)
    bint int8_dot                 # ... with q.k in integers (Problem.int8_dot)
    bint copy_rows                # decode over paged float rows as stored: K through kptr,
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
    bint qt4                      # Q^T of 4 lanes only, ldqt 8 (fa_pack_qt4_f)
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
    w.qi = o                                    # q rows quantised (fa_int8_quant_row):
    if P.int8_dot:                              # bytes, then scales and sums per block
        o += FA_BQ * D // 4 + 2 * FA_BQ * (D // 32)
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
