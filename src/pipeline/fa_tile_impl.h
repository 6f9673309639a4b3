/*
 * fa_tile_impl.h -- the micro-kernels of the fused attention loop, for one compute type and
 * one storage type of K and V.  Included by fa_kernels.h once per instantiation with these
 * macros defined:
 *   T, V, VL, FA_FN(name), LOAD, STORE, BCAST, MAX, SELECT, EXP2   the compute type
 *   KV, LOAD_KV, KV_SCALAR, LOAD_TRANSPOSE_KV    how K and V are stored and widened to T
 *   FA_KV_KERNELS_ONLY (optional)  only the kernels that read K or V (another storage type
 *                                  for a compute type whose other kernels already exist)
 * FA_FN and the storage-type macros are undefined at the end (each instantiation names its
 * own); the compute-type macros stay for the next storage type.
 *
 * Layout (lanes = query rows; see fa_kernels.h for why):
 *   qt[d*ldqt + r]    the query tile, transposed and packed once per tile
 *   s[j*lds + r]      scores, then probabilities, of key j for query row r (S^T / P^T)
 *   acc[r*ldacc + c]  the unnormalised output tile
 *
 * Each kernel has exactly one variant, used by every call path (prefill, decode, edge
 * tiles, padded rows), and is kept out of line (FA_NOINLINE): the arithmetic a row sees is
 * always the same machine code, which keeps results bitwise reproducible, and each kernel
 * gets the whole register file instead of sharing it with the caller's loop.
 */

/*
 * Score micro-tile: FA_MR_K keys x 2 vectors of query rows.
 *   s[jj*lds + c] = scale * sum_d kr[jj][d] * qt[d*ldqt + c]
 * (the caller passes scale * log2 e: scores leave here in base 2)
 * Broadcast-FMA: one key element broadcast (straight from K's rows, any row stride), times a
 * contiguous vector of packed queries; 12 accumulators + 2 query vectors + 1 broadcast fit
 * the 16 registers of AVX2.
 * The canonical order of a score, whichever kernel computes it: a sequential FMA chain
 * over each chunk of FA_DCHUNK (16) dimensions, the chunks' sums added in order, then one
 * multiply by scale.  Chunking bounds the rounding error of a score by about
 * (FA_DCHUNK + D / FA_DCHUNK) units in the last place instead of D.
 */
/* One chunk's sums a into the scores at p: the first chunk stores, later ones add to what
 * is there; the last one also applies the scale. */
FA_INLINE void FA_FN(fa_chunk_out)(T* p, V a, int first, int last, V sc)
{
    if (!first) a = LOAD(p) + a;
    STORE(p, last ? a * sc : a);
}

FA_NOINLINE void FA_FN(fa_score_tile)(const KV* const* kr, const T* qt, ptrdiff_t ldqt,
                                     ptrdiff_t D, T scale, T* s, ptrdiff_t lds)
{
    const KV *k0 = kr[0], *k1 = kr[1], *k2 = kr[2], *k3 = kr[3], *k4 = kr[4], *k5 = kr[5];
    const V sc = BCAST(scale);
    ptrdiff_t d0 = 0;
    do {
        const ptrdiff_t d1 = D - d0 > FA_DCHUNK ? d0 + FA_DCHUNK : D;
        const int first = d0 == 0, last = d1 == D;
        V a00 = {0}, a01 = {0}, a10 = {0}, a11 = {0}, a20 = {0}, a21 = {0};
        V a30 = {0}, a31 = {0}, a40 = {0}, a41 = {0}, a50 = {0}, a51 = {0};
        for (ptrdiff_t d = d0; d < d1; d++) {
            const V q0 = LOAD(qt + d * ldqt), q1 = LOAD(qt + d * ldqt + VL);
            V b;
            b = BCAST(KV_SCALAR(k0[d])); a00 += b * q0; a01 += b * q1;
            b = BCAST(KV_SCALAR(k1[d])); a10 += b * q0; a11 += b * q1;
            b = BCAST(KV_SCALAR(k2[d])); a20 += b * q0; a21 += b * q1;
            b = BCAST(KV_SCALAR(k3[d])); a30 += b * q0; a31 += b * q1;
            b = BCAST(KV_SCALAR(k4[d])); a40 += b * q0; a41 += b * q1;
            b = BCAST(KV_SCALAR(k5[d])); a50 += b * q0; a51 += b * q1;
        }
#define OUT(j, a0, a1) FA_FN(fa_chunk_out)(s + j * lds, a0, first, last, sc); \
                       FA_FN(fa_chunk_out)(s + j * lds + VL, a1, first, last, sc);
        OUT(0, a00, a01) OUT(1, a10, a11) OUT(2, a20, a21)
        OUT(3, a30, a31) OUT(4, a40, a41) OUT(5, a50, a51)
#undef OUT
        d0 = d1;
    } while (d0 < D);
}

/* The same score micro-tile for a single vector of query rows (the last lane group of a
 * tile): per lane, the identical chains as fa_score_tile. */
FA_NOINLINE void FA_FN(fa_score_tile1)(const KV* const* kr, const T* qt, ptrdiff_t ldqt,
                                      ptrdiff_t D, T scale, T* s, ptrdiff_t lds)
{
    const KV *k0 = kr[0], *k1 = kr[1], *k2 = kr[2], *k3 = kr[3], *k4 = kr[4], *k5 = kr[5];
    const V sc = BCAST(scale);
    ptrdiff_t d0 = 0;
    do {
        const ptrdiff_t d1 = D - d0 > FA_DCHUNK ? d0 + FA_DCHUNK : D;
        const int first = d0 == 0, last = d1 == D;
        V a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0}, a4 = {0}, a5 = {0};
        for (ptrdiff_t d = d0; d < d1; d++) {
            const V q0 = LOAD(qt + d * ldqt);
            a0 += BCAST(KV_SCALAR(k0[d])) * q0;
            a1 += BCAST(KV_SCALAR(k1[d])) * q0;
            a2 += BCAST(KV_SCALAR(k2[d])) * q0;
            a3 += BCAST(KV_SCALAR(k3[d])) * q0;
            a4 += BCAST(KV_SCALAR(k4[d])) * q0;
            a5 += BCAST(KV_SCALAR(k5[d])) * q0;
        }
        FA_FN(fa_chunk_out)(s + 0 * lds, a0, first, last, sc);
        FA_FN(fa_chunk_out)(s + 1 * lds, a1, first, last, sc);
        FA_FN(fa_chunk_out)(s + 2 * lds, a2, first, last, sc);
        FA_FN(fa_chunk_out)(s + 3 * lds, a3, first, last, sc);
        FA_FN(fa_chunk_out)(s + 4 * lds, a4, first, last, sc);
        FA_FN(fa_chunk_out)(s + 5 * lds, a5, first, last, sc);
        d0 = d1;
    } while (d0 < D);
}

/* The score micro-tile for the last 4 keys of a block (64 = 10 x 6 + 4), so that no
 * padding keys are computed: 8 accumulators, per lane the identical chains.  Written
 * out like fa_score_tile rather than sharing a body over an accumulator array: that form
 * compiles to the same AVX2 loop but spills more in the SSE2 build. */
FA_NOINLINE void FA_FN(fa_score_tile4)(const KV* const* kr, const T* qt, ptrdiff_t ldqt,
                                      ptrdiff_t D, T scale, T* s, ptrdiff_t lds)
{
    const KV *k0 = kr[0], *k1 = kr[1], *k2 = kr[2], *k3 = kr[3];
    const V sc = BCAST(scale);
    ptrdiff_t d0 = 0;
    do {
        const ptrdiff_t d1 = D - d0 > FA_DCHUNK ? d0 + FA_DCHUNK : D;
        const int first = d0 == 0, last = d1 == D;
        V a00 = {0}, a01 = {0}, a10 = {0}, a11 = {0}, a20 = {0}, a21 = {0}, a30 = {0}, a31 = {0};
        for (ptrdiff_t d = d0; d < d1; d++) {
            const V q0 = LOAD(qt + d * ldqt), q1 = LOAD(qt + d * ldqt + VL);
            V b;
            b = BCAST(KV_SCALAR(k0[d])); a00 += b * q0; a01 += b * q1;
            b = BCAST(KV_SCALAR(k1[d])); a10 += b * q0; a11 += b * q1;
            b = BCAST(KV_SCALAR(k2[d])); a20 += b * q0; a21 += b * q1;
            b = BCAST(KV_SCALAR(k3[d])); a30 += b * q0; a31 += b * q1;
        }
#define OUT(j, a0, a1) FA_FN(fa_chunk_out)(s + j * lds, a0, first, last, sc); \
                       FA_FN(fa_chunk_out)(s + j * lds + VL, a1, first, last, sc);
        OUT(0, a00, a01) OUT(1, a10, a11) OUT(2, a20, a21) OUT(3, a30, a31)
#undef OUT
        d0 = d1;
    } while (d0 < D);
}

#ifndef FA_KV_KERNELS_ONLY
/* -inf for nk keys of nvec whole vectors of rows: keys hidden from every row of a lane
 * group, whose scores the score stage did not compute (the finish-scores stage's fill). */
FA_INLINE void FA_FN(fa_hide_keys)(T* s, ptrdiff_t lds, ptrdiff_t nk, int nvec)
{
    const V ninf = BCAST(-INFINITY);
    for (ptrdiff_t jj = 0; jj < nk; jj++)
        for (int t = 0; t < nvec; t++) STORE(s + jj * lds + t * VL, ninf);
}

/*
 * Online-softmax step for one vector of query rows over nj keys of a key block.  Scores
 * are in base 2 (already multiplied by log2 e):
 *   m_new = max(m, max_j s_j);  alpha = 2^(m - m_new);  p_j = 2^(s_j - m_new)
 *   l = l * alpha + sum_j p_j  (sequential in j);  s_j <- p_j
 * alpha is exactly 1 when the max did not move and exactly 0 when nothing was visible
 * before; a row that sees nothing keeps m = -inf, l = 0 and gets p = 0: a block hidden
 * from a row leaves its state bit-for-bit unchanged, so skipping it is equivalent.
 * Keys outside [jlo, jhi) are hidden from every row of the vector (s_j = -inf, so p_j = 0
 * and they add exactly nothing to the max and the sum): they get p = 0 without an exp --
 * on causal diagonals and window edges whole runs of keys are hidden from a vector.
 */
FA_INLINE void FA_FN(fa_softmax_body)(T* s, ptrdiff_t lds, ptrdiff_t nj, ptrdiff_t jlo,
                                      ptrdiff_t jhi, T* m, T* l, T* alpha, const int nv)
{
    const V ninf = BCAST(-INFINITY), zero = BCAST(0), one = BCAST(1);
    V mb[2], m_sub[2], alpha_v[2], sum[2];
    for (int v = 0; v < nv; v++) mb[v] = ninf;
    for (ptrdiff_t j = jlo; j < jhi; j++)
        for (int v = 0; v < nv; v++) mb[v] = MAX(mb[v], LOAD(s + j * lds + v * VL));
    for (int v = 0; v < nv; v++) {
        const V m_old = LOAD(m + v * VL);
        const V m_new = MAX(m_old, mb[v]);
        const V a = SELECT(m_new == m_old, one, EXP2(m_old - m_new));
        m_sub[v] = SELECT(m_new == ninf, zero, m_new);
        alpha_v[v] = a;
        sum[v] = zero;
        STORE(m + v * VL, m_new);
        STORE(alpha + v * VL, a);
    }
    for (ptrdiff_t j = 0; j < jlo; j++)
        for (int v = 0; v < nv; v++) STORE(s + j * lds + v * VL, zero);
    for (ptrdiff_t j = jlo; j < jhi; j++)
        for (int v = 0; v < nv; v++) {
            const V p = EXP2(LOAD(s + j * lds + v * VL) - m_sub[v]);
            STORE(s + j * lds + v * VL, p);
            sum[v] += p;
        }
    for (ptrdiff_t j = jhi; j < nj; j++)
        for (int v = 0; v < nv; v++) STORE(s + j * lds + v * VL, zero);
    /* one expression, so that it compiles to one FMA (l * alpha + sum) wherever it is used */
    for (int v = 0; v < nv; v++) STORE(l + v * VL, LOAD(l + v * VL) * alpha_v[v] + sum[v]);
}

/* One vector of rows, and two adjacent ones (s, m, l, alpha + VL) at once: two
 * independent max/sum chains in flight.  Per lane the same operations, so the same bits;
 * a pair takes the union of the two vectors' [jlo, jhi) (see above: a key hidden from a
 * whole vector gets exactly 0 either way). */
FA_NOINLINE void FA_FN(fa_softmax_step)(T* s, ptrdiff_t lds, ptrdiff_t nj, ptrdiff_t jlo,
                                       ptrdiff_t jhi, T* m, T* l, T* alpha)
{ FA_FN(fa_softmax_body)(s, lds, nj, jlo, jhi, m, l, alpha, 1); }
FA_NOINLINE void FA_FN(fa_softmax_step2)(T* s, ptrdiff_t lds, ptrdiff_t nj, ptrdiff_t jlo,
                                        ptrdiff_t jhi, T* m, T* l, T* alpha)
{ FA_FN(fa_softmax_body)(s, lds, nj, jlo, jhi, m, l, alpha, 2); }

/*
 * Q^T of VL query rows (stored in the compute type): qt[d * ldqt + t] = rows[t][d], d < D.
 * VL x VL blocks are transposed in registers, so every store is a whole vector.
 */
FA_NOINLINE void FA_FN(fa_pack_qt)(const T* const* rows, ptrdiff_t D, T* qt, ptrdiff_t ldqt)
{
    V r[VL];
    ptrdiff_t d0 = 0;
    /* Every line of the rows requested first: the transposes below read the rows a
     * vector at a time across all of them, an order the hardware prefetcher does not
     * follow, so a Q tile read from memory would otherwise wait on a few lines at a time. */
    for (int t = 0; t < VL; t++)
        for (ptrdiff_t off = 0; off < D * (ptrdiff_t) sizeof(T); off += 64)
            __builtin_prefetch((const char*) rows[t] + off, 0, 3);
    for (; d0 + VL <= D; d0 += VL) {
        LOAD_TRANSPOSE(rows, d0, r);
        for (int i = 0; i < VL; i++) STORE(qt + (d0 + i) * ldqt, r[i]);
    }
    for (; d0 < D; d0++)
        for (int t = 0; t < VL; t++) qt[d0 * ldqt + t] = rows[t][d0];
}

/*
 * Merging a key chunk's softmax state (m, l, acc: one chunk of FA_KCHUNK keys processed
 * from an empty state) into the running state (M, L, ACC) of the rows, chunks in key order:
 *   M' = max(M, m);  a = 2^(M - M');  b = 2^(m - M');  L' = L a + l b;  ACC' = ACC a + acc b
 * with a (b) exactly 1 when M (m) is the new max, so merging into the empty state
 * (M = -inf, L = 0, ACC = 0) reproduces the chunk's state exactly.  Every path -- one
 * thread walking all of a row's chunks, or threads each taking a chunk (flash-decoding)
 * -- merges with these two functions in the same order, so results stay bitwise equal.
 * fa_merge_stats: one vector of rows; leaves a, b in fa, fb for fa_merge_acc.
 */
FA_NOINLINE void FA_FN(fa_merge_stats)(T* M, T* L, const T* m, const T* l, T* fa, T* fb)
{
    const V one = BCAST(1);
    const V M_old = LOAD(M), m_chunk = LOAD(m);
    const V M_new = MAX(M_old, m_chunk);
    const V a = SELECT(M_new == M_old, one, EXP2(M_old - M_new));
    const V b = SELECT(M_new == m_chunk, one, EXP2(m_chunk - M_new));
    STORE(L, LOAD(L) * a + LOAD(l) * b);
    STORE(M, M_new);
    STORE(fa, a);
    STORE(fb, b);
}

/* ACC[c] = ACC[c] * a + acc[c] * b for c < n (n a multiple of VL): one row. */
FA_NOINLINE void FA_FN(fa_merge_acc)(T* ACC, const T* acc, ptrdiff_t n, T a, T b)
{
    const V va = BCAST(a), vb = BCAST(b);
    for (ptrdiff_t c = 0; c < n; c += VL) STORE(ACC + c, LOAD(ACC + c) * va + LOAD(acc + c) * vb);
}

#endif /* FA_KV_KERNELS_ONLY */

/*
 * Output micro-tile: FA_MR_PV query rows x 2 vectors of value columns.
 *   acc[r, c] = acc[r, c] * alpha[r] + sum_j p[j, r] * v[j, c]
 * The canonical order of every output kernel: the block's sum from zero, sequential in j,
 * then one FMA into the rescaled running sum.  A chain per key block (<= FA_BK keys, as a
 * GEMM adds blocks of its inner dimension) instead of one over all of a row's keys keeps
 * the float32 rounding error of long rows near torch's.
 * Values are read in place (rows of V are contiguous in Dv), p is broadcast.  Keys with
 * p == 0 contribute exactly nothing, so callers may shorten [0, nj) to the keys visible
 * to any of these rows.
 */
FA_NOINLINE void FA_FN(fa_pv_tile)(const T* p, ptrdiff_t ldp, ptrdiff_t nj,
                                const KV* v, ptrdiff_t ldv,
                                T* acc, ptrdiff_t ldacc, const T* alpha)
{
#define FA_PV_LOAD_ROW(r) V c##r##0 = {0}, c##r##1 = {0};
    FA_PV_LOAD_ROW(0) FA_PV_LOAD_ROW(1) FA_PV_LOAD_ROW(2)
    FA_PV_LOAD_ROW(3) FA_PV_LOAD_ROW(4) FA_PV_LOAD_ROW(5)
#undef FA_PV_LOAD_ROW
    for (ptrdiff_t j = 0; j < nj; j++) {
        const V v0 = LOAD_KV(v + j * ldv), v1 = LOAD_KV(v + j * ldv + VL);
        const T* pj = p + j * ldp;
        V b;
        b = BCAST(pj[0]); c00 += b * v0; c01 += b * v1;
        b = BCAST(pj[1]); c10 += b * v0; c11 += b * v1;
        b = BCAST(pj[2]); c20 += b * v0; c21 += b * v1;
        b = BCAST(pj[3]); c30 += b * v0; c31 += b * v1;
        b = BCAST(pj[4]); c40 += b * v0; c41 += b * v1;
        b = BCAST(pj[5]); c50 += b * v0; c51 += b * v1;
    }
#define FA_PV_STORE_ROW(r) \
    STORE(acc + r * ldacc, LOAD(acc + r * ldacc) * BCAST(alpha[r]) + c##r##0); \
    STORE(acc + r * ldacc + VL, LOAD(acc + r * ldacc + VL) * BCAST(alpha[r]) + c##r##1);
    FA_PV_STORE_ROW(0) FA_PV_STORE_ROW(1) FA_PV_STORE_ROW(2)
    FA_PV_STORE_ROW(3) FA_PV_STORE_ROW(4) FA_PV_STORE_ROW(5)
#undef FA_PV_STORE_ROW
}

/* The output micro-tile for one query row (decode steps, rows left over by the 6-row
 * tiles): per element, the identical sequence as fa_pv_tile. */
FA_NOINLINE void FA_FN(fa_pv_tile1)(const T* p, ptrdiff_t ldp, ptrdiff_t nj,
                                   const KV* v, ptrdiff_t ldv,
                                   T* acc, ptrdiff_t ldacc, const T* alpha)
{
    (void)ldacc;
    V c0 = {0}, c1 = {0};
    for (ptrdiff_t j = 0; j < nj; j++) {
        const V b = BCAST(p[j * ldp]);
        c0 += b * LOAD_KV(v + j * ldv);
        c1 += b * LOAD_KV(v + j * ldv + VL);
    }
    STORE(acc, LOAD(acc) * BCAST(alpha[0]) + c0);
    STORE(acc + VL, LOAD(acc + VL) * BCAST(alpha[0]) + c1);
}

/*
 * Decode-sized tiles (a few query rows) compute scores with the keys as the lanes instead:
 * one query element broadcast against a vector of VL keys read from K transposed.  Each
 * score is still the sequential FMA chain over d of fa_score_tile (k*q + acc, rounded
 * once per step), so a decode step reproduces the prefill row bit for bit -- but no
 * lanes idle, which makes these tiles ~10x cheaper and lets them run at memory speed.
 */

/*
 * Scores of VL keys (the lanes) against nr query rows, K transposed on the fly:
 *   s[t*lds + r] = scale * sum_d kr[t][d] * qt[d*ldqt + r]    t < nk, r < nr
 * Each VL x VL block of keys is loaded (row by row, as K lies in memory), transposed in
 * registers and consumed at once by nr accumulators; nothing is written back but the
 * scores.  Per score this is the FMA chain of fa_score_tile (acc += k[d]*q[d], d in
 * order, then * scale), so a decode row equals its prefill row bit for bit.
 * nr is a compile-time constant in each wrapper below so the accumulators stay in
 * registers: VL transposed keys + nr accumulators fit the register file (32 zmm for
 * AVX-512 with nr <= 8; 16 ymm for AVX2 with nr <= 4).  Rows past the caller's last
 * are computed from qt's zero padding and not stored.
 * pf (optional): VL rows to prefetch into L2, the same byte range of each as the key
 * loads (up to pf_bytes): the decode path passes the V rows of these keys, which the
 * output kernel reads next (see fa_pv_row8).
 */
FA_INLINE void FA_FN(fa_score_keyrows)(const KV* const* kr, ptrdiff_t ldk, int nk, const T* qt, ptrdiff_t ldqt,
                                       ptrdiff_t D, T scale, T* s, ptrdiff_t lds,
                                       const int nr, int nstore,
                                       const char* const* pf, ptrdiff_t pf_bytes)
{
    (void)ldk;
    V a[8];
    T part[8][VL];   /* the sums of the chunks before the current one (see fa_score_tile) */
    for (int r = 0; r < nr; r++) a[r] = BCAST(0);
#define FA_FOLD(d) \
    if ((d) && (d) % FA_DCHUNK == 0) \
        for (int r = 0; r < nr; r++) { \
            STORE(part[r], (d) == FA_DCHUNK ? a[r] : LOAD(part[r]) + a[r]); \
            a[r] = BCAST(0); \
        }
    ptrdiff_t d0 = 0;
    for (; d0 + VL <= D; d0 += VL) {
        FA_FOLD(d0)
        V t[VL];
        LOAD_TRANSPOSE_KV(kr, d0, t);
        if (pf && (ptrdiff_t)(d0 * sizeof(T)) < pf_bytes)
            for (int i = 0; i < VL; i++) __builtin_prefetch(pf[i] + d0 * sizeof(T), 0, 2);
        for (int i = 0; i < VL; i++) {
            const T* qd = qt + (d0 + i) * ldqt;
            for (int r = 0; r < nr; r++) a[r] += BCAST(qd[r]) * t[i];
        }
    }
    for (; d0 < D; d0++) {   /* D % VL leftover dimensions, one lane-gathered vector each */
        FA_FOLD(d0)
        T col[VL];
        for (int i = 0; i < VL; i++) col[i] = KV_SCALAR(kr[i][d0]);
        const V kd = LOAD(col);
        const T* qd = qt + d0 * ldqt;
        for (int r = 0; r < nr; r++) a[r] += BCAST(qd[r]) * kd;
    }
#undef FA_FOLD
    const V sc = BCAST(scale);
    for (int r = 0; r < nr && r < nstore; r++) {
        T out[VL];
        STORE(out, (D > FA_DCHUNK ? LOAD(part[r]) + a[r] : a[r]) * sc);
        for (int t = 0; t < nk; t++) s[t * lds + r] = out[t];
    }
}

/* FA_DEC_KEYS_F keys (32) for the float kernels as calls of VL keys each (see
 * FA_KEYS32_WIDE).  pf: the V rows of all the call's keys. */
FA_INLINE void FA_FN(fa_score_keyrows_split)(const KV* const* kr, ptrdiff_t ldk, int nk,
                                             const T* qt, ptrdiff_t ldqt, ptrdiff_t D,
                                             T scale, T* s, ptrdiff_t lds, const int nr,
                                             int nstore, const char* const* pf,
                                             ptrdiff_t pf_bytes)
{
    for (int g = 0; g * VL < nk; g++)
        FA_FN(fa_score_keyrows)(kr + g * VL, ldk, nk - g * VL < VL ? nk - g * VL : VL, qt, ldqt,
                                D, scale, s + g * VL * lds, lds, nr, nstore,
                                pf ? pf + g * VL : NULL, pf_bytes);
}

/* KEYROWS_IMPL (optional): an ISA-specific body for the wrappers below, with the same
 * contract but FA_DEC_KEYS_F keys per call instead of VL (see fa_score_keys32_f). */
#ifndef KEYROWS_IMPL
#define KEYROWS_IMPL FA_FN(fa_score_keyrows)
#endif
#ifndef KEYROWS_IMPL_WIDE   /* optional: another body for the 4- and 8-row passes */
#define KEYROWS_IMPL_WIDE KEYROWS_IMPL
#endif
#define FA_SCORE_KEYROWS_NR(NR, IMPL) \
FA_NOINLINE void FA_FN(fa_score_keyrows##NR)(const KV* const* kr, ptrdiff_t ldk, int nk, const T* qt, \
                                            ptrdiff_t ldqt, ptrdiff_t D, T scale, T* s, \
                                            ptrdiff_t lds, int nstore, \
                                            const char* const* pf, ptrdiff_t pf_bytes) \
{ IMPL(kr, ldk, nk, qt, ldqt, D, scale, s, lds, NR, nstore, pf, pf_bytes); }
FA_SCORE_KEYROWS_NR(1, KEYROWS_IMPL)
FA_SCORE_KEYROWS_NR(2, KEYROWS_IMPL)
FA_SCORE_KEYROWS_NR(4, KEYROWS_IMPL_WIDE)
FA_SCORE_KEYROWS_NR(8, KEYROWS_IMPL_WIDE)   /* called only when FA_DEC_NR_MAX >= 8 */
#undef FA_SCORE_KEYROWS_NR
#undef KEYROWS_IMPL
#undef KEYROWS_IMPL_WIDE

/* The output of one query row over 8 vectors of value columns at once (decode tiles):
 * each V row is read as 8 contiguous vectors instead of in 2-vector strips, one pass per
 * key block.  Per element, the identical sequence as fa_pv_tile.
 * pf: row j < pf_rows of another block (pf + j*pf_stride, pf_bytes long) is prefetched
 * into L2 as V row j is read: the decode path passes the next block's K rows, so that
 * K and V stream from memory continuously, each kernel's loads hitting lines the other
 * kernel requested (one core alone keeps too few misses in flight otherwise). */
#if FA_VBYTES == 64
/* AVX-512: whole 8-vector rows are 256-1024 bytes, and the loads of one key stall on its
 * lines (from L2, or memory when the score kernel's V stream is late) unless they are
 * requested into L1 about 4 KiB of rows ahead. */
#define FA_PV_L1_AHEAD (4096 / (8 * VL * (ptrdiff_t)sizeof(KV)))
#endif
FA_NOINLINE void FA_FN(fa_pv_row8)(const T* p, ptrdiff_t ldp, ptrdiff_t nj,
                                  const KV* v, ptrdiff_t ldv, T* acc, const T* alpha,
                                  const char* pf, ptrdiff_t pf_stride, ptrdiff_t pf_rows,
                                  ptrdiff_t pf_bytes)
{
    const V a = BCAST(alpha[0]);
    V c0 = {0}, c1 = {0}, c2 = {0}, c3 = {0}, c4 = {0}, c5 = {0}, c6 = {0}, c7 = {0};
    for (ptrdiff_t j = 0; j < nj; j++) {
        const V b = BCAST(p[j * ldp]);
        const KV* vj = v + j * ldv;
        if (j < pf_rows) fa_prefetch_l2(pf + j * pf_stride, pf_bytes);
#if FA_VBYTES == 64
        if (j + FA_PV_L1_AHEAD < nj)
            for (int u = 0; u < (int)(8 * VL * sizeof(KV)); u += 64)
                __builtin_prefetch((const char*)(vj + FA_PV_L1_AHEAD * ldv) + u, 0, 3);
#endif
        c0 += b * LOAD_KV(vj);
        c1 += b * LOAD_KV(vj + VL);
        c2 += b * LOAD_KV(vj + 2 * VL);
        c3 += b * LOAD_KV(vj + 3 * VL);
        c4 += b * LOAD_KV(vj + 4 * VL);
        c5 += b * LOAD_KV(vj + 5 * VL);
        c6 += b * LOAD_KV(vj + 6 * VL);
        c7 += b * LOAD_KV(vj + 7 * VL);
    }
    STORE(acc, LOAD(acc) * a + c0); STORE(acc + VL, LOAD(acc + VL) * a + c1);
    STORE(acc + 2 * VL, LOAD(acc + 2 * VL) * a + c2); STORE(acc + 3 * VL, LOAD(acc + 3 * VL) * a + c3);
    STORE(acc + 4 * VL, LOAD(acc + 4 * VL) * a + c4); STORE(acc + 5 * VL, LOAD(acc + 5 * VL) * a + c5);
    STORE(acc + 6 * VL, LOAD(acc + 6 * VL) * a + c6); STORE(acc + 7 * VL, LOAD(acc + 7 * VL) * a + c7);
}
#undef FA_PV_L1_AHEAD

/* The output of 4 query rows over 4 vectors of value columns (decode tiles of a GQA
 * group): each V vector loaded is used by all 4 rows.  Per element, the identical
 * sequence as fa_pv_tile.  pf, pf_stride, pf_rows, pf_bytes: as fa_pv_row8.
 * The 4 vectors go in FA_PV4_NV-vector passes over the keys so that the 4 x FA_PV4_NV
 * accumulators, the V vectors and a broadcast fit the register file: all 4 at once with
 * 32 zmm registers; 2 with 16 ymm (4 x 4 accumulators would spill there, doubling the
 * time per key); 1 with SSE2's 16 xmm (a vector is 2 of them). */
#ifndef FA_PV4_NV
#if FA_VBYTES == 64
#define FA_PV4_NV 4
#elif defined(__AVX__)
#define FA_PV4_NV 2
#else
#define FA_PV4_NV 1
#endif
#endif
FA_NOINLINE void FA_FN(fa_pv_rows4)(const T* p, ptrdiff_t ldp, ptrdiff_t nj,
                                   const KV* v, ptrdiff_t ldv, T* acc, ptrdiff_t ldacc,
                                   const T* alpha, const char* pf, ptrdiff_t pf_stride,
                                   ptrdiff_t pf_rows, ptrdiff_t pf_bytes)
{
    for (int c0 = 0; c0 < 4; c0 += FA_PV4_NV) {
        T* const acc_c = acc + c0 * VL;
        const KV* const v_c = v + c0 * VL;
        V c[4][FA_PV4_NV];
        for (int r = 0; r < 4; r++)
            for (int i = 0; i < FA_PV4_NV; i++) c[r][i] = BCAST(0);
        /* the first pass issues the prefetches (they cover all 4 vectors' columns) */
        const ptrdiff_t pf_n = c0 == 0 ? pf_rows : 0;
        for (ptrdiff_t j = 0; j < nj; j++) {
            const KV* vj = v_c + j * ldv;
            const T* pj = p + j * ldp;
            if (j < pf_n) fa_prefetch_l2(pf + j * pf_stride, pf_bytes);
            V x[FA_PV4_NV];
            for (int i = 0; i < FA_PV4_NV; i++) x[i] = LOAD_KV(vj + i * VL);
            for (int r = 0; r < 4; r++) {
                const V b = BCAST(pj[r]);
                for (int i = 0; i < FA_PV4_NV; i++) c[r][i] += b * x[i];
            }
        }
        for (int r = 0; r < 4; r++) {
            const V a = BCAST(alpha[r]);
            for (int i = 0; i < FA_PV4_NV; i++)
                STORE(acc_c + r * ldacc + i * VL, LOAD(acc_c + r * ldacc + i * VL) * a + c[r][i]);
        }
    }
}

/* One key's term of the output rows that read V through row pointers (here and in
 * fa_quant.h): c[r][i] += p[r] * x[i] for nr rows and nv vectors of columns; then
 * acc = acc * alpha + c, row r at acc + r * ldacc. */
FA_INLINE void FA_FN(fa_pv_add_key)(V c[4][8], const T* p, const V* x, const int nr,
                                    const int nv)
{
    for (int r = 0; r < nr; r++) {
        const V b = BCAST(p[r]);
        for (int i = 0; i < nv; i++) c[r][i] += b * x[i];
    }
}
FA_INLINE void FA_FN(fa_pv_finish)(V c[4][8], T* acc, ptrdiff_t ldacc, const T* alpha,
                                   const int nr, const int nv)
{
    for (int r = 0; r < nr; r++) {
        const V a = BCAST(alpha[r]);
        T* acc_r = acc + r * ldacc;
        for (int i = 0; i < nv; i++)
            STORE(acc_r + i * VL, LOAD(acc_r + i * VL) * a + c[r][i]);
    }
}

#ifndef FA_PV_PF_ONCE
#define FA_PV_PF_ONCE
/* How many rows ahead fa_pv_ptr requests V rows into L1. */
#define FA_PV_PTR_AHEAD 12
/* Keys per chunk of fa_pv_ptr's key loop: the requests due in a chunk go out at its
 * start, so that the loop over its keys does only the loads and FMAs (checking a request
 * schedule every key doubled the instructions of the AVX2 build's 4-row loop). */
#define FA_PV_PF_KEYS 8
/* The next block's V rows that fa_pv_ptr requests into L2, spread evenly over all its
 * passes' key steps: rows[0 .. n), each of `bytes`, row `next` the next one due; a row
 * is due every `steps` / n steps (err accumulates n per step).  Rows are requested a
 * line per 64 bytes from their start (fa_prefetch_run_row): where a row starts inside a
 * line (NumPy's arrays start 16 bytes into one) and the next row follows it, as in a
 * page, the next row's first request covers its last line; the last row of a run
 * requests it itself. */
typedef struct {
    const char* const* rows;
    ptrdiff_t n, next, err, steps, bytes;
} fa_pv_pf;
/* The requests due over the next nsteps key steps. */
FA_INLINE void fa_pv_pf_steps(fa_pv_pf* q, ptrdiff_t nsteps)
{
    for (q->err += nsteps * q->n; q->err >= q->steps && q->next < q->n; q->err -= q->steps)
        fa_prefetch_run_row(q->rows, q->next++, q->n, q->bytes, 2);
}
#endif
/* The output of nr query rows (1 or 4) over all Dv value columns (a multiple of VL), V
 * rows addressed one pointer per key (vr[j]: decode steps over paged caches): per
 * element the sequence of fa_pv_tile, in passes of nv vectors whose accumulators fit the
 * register file (up to 8 for one row, so that as many chains run at once; FA_PV4_NV for
 * four).  Where fa_pf_l1 says, the first pass requests row j + FA_PV_PTR_AHEAD whole
 * into L1 as row j is read (far enough ahead for a row in L2 to arrive; l1_bytes, 0 in
 * the later passes, which find the block's rows there), and the next block's rows go
 * into L2 as pf says. */
FA_INLINE void FA_FN(fa_pv_ptr_cols)(const T* p, ptrdiff_t ldp, ptrdiff_t nj,
                                     const KV* const* vr, ptrdiff_t c0, T* acc,
                                     ptrdiff_t ldacc, const T* alpha, const int nr,
                                     const int nv, fa_pv_pf* pf, ptrdiff_t l1_bytes)
{
    V c[4][8];
    for (int r = 0; r < nr; r++)
        for (int i = 0; i < nv; i++) c[r][i] = BCAST(0);
    for (ptrdiff_t j0 = 0; j0 < nj; j0 += FA_PV_PF_KEYS) {
        const ptrdiff_t j1 = j0 + FA_PV_PF_KEYS < nj ? j0 + FA_PV_PF_KEYS : nj;
        fa_pv_pf_steps(pf, j1 - j0);
        for (ptrdiff_t j = j0; j < j1; j++) {
            if (l1_bytes && j + FA_PV_PTR_AHEAD < nj)
                fa_prefetch_run_row((const char* const*)vr, j + FA_PV_PTR_AHEAD, nj, l1_bytes, 3);
            V x[8];
            for (int i = 0; i < nv; i++) x[i] = LOAD_KV(vr[j] + c0 + i * VL);
            FA_FN(fa_pv_add_key)(c, p + j * ldp, x, nr, nv);
        }
    }
    FA_FN(fa_pv_finish)(c, acc + c0, ldacc, alpha, nr, nv);
}
#define FA_PV_PTR_PASS(SUF, NR, NV) \
FA_NOINLINE void FA_FN(fa_pv_ptr_##SUF)(const T* p, ptrdiff_t ldp, ptrdiff_t nj, \
                                              const KV* const* vr, ptrdiff_t c0, T* acc, \
                                              ptrdiff_t ldacc, const T* alpha, fa_pv_pf* pf, \
                                              ptrdiff_t l1_bytes) \
{ FA_FN(fa_pv_ptr_cols)(p, ldp, nj, vr, c0, acc, ldacc, alpha, NR, NV, pf, l1_bytes); }
FA_PV_PTR_PASS(r1_wide, 1, 8)
FA_PV_PTR_PASS(r1_v4, 1, 4)
FA_PV_PTR_PASS(r1_v2, 1, 2)
FA_PV_PTR_PASS(r1_v1, 1, 1)
FA_PV_PTR_PASS(r4_wide, 4, FA_PV4_NV)
FA_PV_PTR_PASS(r4_v1, 4, 1)
#undef FA_PV_PTR_PASS
/* pf: the next block's V rows (npf of them), requested into L2 spread evenly over the
 * key steps of all the passes: from caches larger than L3, the same requests issued a
 * row per key by the first pass alone left the next block's loads waiting on memory. */
FA_NOINLINE void FA_FN(fa_pv_ptr)(const T* p, ptrdiff_t ldp, ptrdiff_t nj, const KV* const* vr,
                                  ptrdiff_t Dv, T* acc, ptrdiff_t ldacc, const T* alpha, int nr,
                                  const char* const* pf, ptrdiff_t npf)
{
    ptrdiff_t c0 = 0, passes = 0;
    fa_pv_pf q = {pf, npf, 0, 0, 0, Dv * (ptrdiff_t)sizeof(KV)};
#define FA_COUNT(NV) for (; c0 + NV * VL <= Dv; c0 += NV * VL) passes++
    if (nr == 1) { FA_COUNT(8); FA_COUNT(4); FA_COUNT(2); FA_COUNT(1); }
    else { FA_COUNT(FA_PV4_NV); FA_COUNT(1); }
#undef FA_COUNT
    q.steps = passes * nj > npf ? passes * nj : npf;
    c0 = 0;
#define FA_PASS(SUF, NV) for (; c0 + NV * VL <= Dv; c0 += NV * VL) \
        FA_FN(fa_pv_ptr_##SUF)(p, ldp, nj, vr, c0, acc, ldacc, alpha, &q, \
                               c0 || !fa_pf_l1 ? 0 : q.bytes)
    if (nr == 1) {
        FA_PASS(r1_wide, 8);
        FA_PASS(r1_v4, 4);
        FA_PASS(r1_v2, 2);
        FA_PASS(r1_v1, 1);
    } else {
        FA_PASS(r4_wide, FA_PV4_NV);
        FA_PASS(r4_v1, 1);
    }
#undef FA_PASS
    while (q.next < q.n) fa_prefetch_run_row(q.rows, q.next++, q.n, q.bytes, 2);
}

#undef FA_FN
#undef KV
#undef LOAD_KV
#undef KV_SCALAR
#undef LOAD_TRANSPOSE_KV
