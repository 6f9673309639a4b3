/*
 * fa_bf16dot.h -- bfloat16 dot products (AVX512-BF16 `vdpbf16ps`) for the tiles of a call
 * whose q, k and v are bfloat16.  Only the avx512 build compiles them, each function
 * with its own target attribute, so the module still loads on an AVX-512 CPU without
 * BF16; the tile pipeline calls them only when fa_cpu_has_bf16dot() says the CPU runs them.
 *
 * One `vdpbf16ps` step adds the products of a pair of bfloat16 values to a float32 lane:
 *     acc += a[2i] b[2i] + a[2i+1] b[2i+1]
 * Products of two bfloat16 values are exact in float32, so only the order of the sums
 * differs from the float32 kernels.  Pairs run along the dimension of the sum: two
 * dimensions of q and k for a score, two keys of P and V for an output.
 *
 * The canonical orders, shared by every tile of every call, so that a row's result does
 * not depend on the tile, the thread count, the batch or Lq:
 *   score:  per chunk of FA_DCHUNK (16) dimensions, a chain of 8 pair steps from zero;
 *           the chunks' sums added in order, then one multiply by scale (as fa_score_tile)
 *   output: per key block, a chain of pair steps over keys (j0, j0+1), (j0+2, j0+3), ...
 *           from zero, P rounded to bfloat16 (to nearest even) first; then
 *           acc = acc * alpha + block sum (as fa_pv_tile).  Blocks start at even keys.
 *
 * Layouts (u32 = a pair of bfloat16 values, the lower index in the low half):
 *   qt[p*ldqt + r]    dims (2p, 2p+1) of query row r
 *   pp[jp*ldp + r]    P of keys (2jp, 2jp+1) of the block for row r
 *   vp[jp*ldv + c]    V of keys (2jp, 2jp+1) of the block in column c
 */
#ifndef FA_BF16DOT_H
#define FA_BF16DOT_H

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__GNUC__) \
    && (defined(__clang__) || __GNUC__ >= 10)
#define FA_HAVE_BF16DOT 1
#else
#define FA_HAVE_BF16DOT 0
#endif

/* Whether the running CPU executes vdpbf16ps (CPUID leaf 7, subleaf 1, EAX bit 5), and
 * the OS saves the AVX-512 state (checked by the avx512 module's own dispatch). */
static inline int fa_cpu_has_bf16dot(void)
{
#if FA_HAVE_BF16DOT
    return fa_cpuid_bit(7, 1, 0, 5);
#else
    return 0;
#endif
}

#if FA_HAVE_BF16DOT

#define FA_BDP_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
#define FA_BDP_NOINLINE static __attribute__((noinline, unused)) FA_BDP_TARGET
#define FA_BDP_INLINE static inline __attribute__((always_inline)) FA_BDP_TARGET

FA_BDP_INLINE __m512 fa_bdp(__m512 acc, __m512i a, __m512i b)
{ return _mm512_dpbf16_ps(acc, (__m512bh) a, (__m512bh) b); }

/* A pair of bfloat16 values at p, broadcast to every lane (p needs no alignment). */
FA_BDP_INLINE __m512i fa_bcast_pair(const uint16_t* p)
{ uint32_t x; memcpy(&x, p, 4); return _mm512_set1_epi32((int) x); }

FA_BDP_INLINE __m512i fa_load_u32x16(const uint32_t* p)
{ return _mm512_loadu_si512((const void*) p); }

/*
 * Score micro-tiles: FA_MR_K (6) keys x 2 vectors of query rows, and the 1-vector and
 * 4-key forms with per lane the identical chains.  kr: bfloat16 key rows (any stride).
 * The chunks' running sums stay in registers (AVX-512 has 32): the same additions, in
 * the same order, as fa_chunk_out's through memory.
 */
#define FA_BDP_SCORE_TILE(NAME, NK, NV)                                                    \
FA_BDP_NOINLINE void NAME(const uint16_t* const* kr, const uint32_t* qt, ptrdiff_t ldqt,   \
                          ptrdiff_t D, float scale, float* s, ptrdiff_t lds)               \
{                                                                                          \
    __m512 sum[NK][NV];                                                                    \
    for (int u = 0; u < NK; u++)                                                           \
        for (int v = 0; v < NV; v++) sum[u][v] = _mm512_setzero_ps();                      \
    ptrdiff_t d0 = 0;                                                                      \
    do {                                                                                   \
        const ptrdiff_t d1 = D - d0 > FA_DCHUNK ? d0 + FA_DCHUNK : D;                      \
        __m512 a[NK][NV];                                                                  \
        for (int u = 0; u < NK; u++)                                                       \
            for (int v = 0; v < NV; v++) a[u][v] = _mm512_setzero_ps();                    \
        for (ptrdiff_t p = d0 / 2; p < d1 / 2; p++) {                                      \
            __m512i q[NV];                                                                 \
            for (int v = 0; v < NV; v++) q[v] = fa_load_u32x16(qt + p * ldqt + 16 * v);    \
            for (int u = 0; u < NK; u++) {                                                 \
                const __m512i b = fa_bcast_pair(kr[u] + 2 * p);                            \
                for (int v = 0; v < NV; v++) a[u][v] = fa_bdp(a[u][v], b, q[v]);           \
            }                                                                              \
        }                                                                                  \
        for (int u = 0; u < NK; u++)                                                       \
            for (int v = 0; v < NV; v++)                                                   \
                sum[u][v] = d0 == 0 ? a[u][v] : _mm512_add_ps(sum[u][v], a[u][v]);         \
        d0 = d1;                                                                           \
    } while (d0 < D);                                                                      \
    const __m512 sc = _mm512_set1_ps(scale);                                               \
    for (int u = 0; u < NK; u++)                                                           \
        for (int v = 0; v < NV; v++)                                                       \
            _mm512_storeu_ps(s + u * lds + 16 * v, _mm512_mul_ps(sum[u][v], sc));          \
}
FA_BDP_SCORE_TILE(fa_score_tile_bdp, 6, 2)
FA_BDP_SCORE_TILE(fa_score_tile4_bdp, 4, 2)
FA_BDP_SCORE_TILE(fa_score_tile1_bdp, 6, 1)
#undef FA_BDP_SCORE_TILE

/*
 * Decode-sized tiles (at most FA_DECODE_ROWS rows): the keys are the lanes instead, 16
 * key rows transposed in registers 16 pairs of dims at a time, so that no lane idles.  Per
 * (row, key) these are the chains of fa_score_tile_bdp -- vdpbf16ps multiplies the same
 * two pairs whichever operand is broadcast -- so a decode row has its prefill row's bits.
 *   s[u*lds + r] = scale * sum_p qt[p*ldqt + r] . kr[u][p]     u < nk, r < NR
 * kr: 16 bfloat16 key rows (zero rows past nk); qt: query rows in pairs of dims.
 */
#define FA_BDP_KEYS16(NAME, NR)                                                            \
FA_BDP_NOINLINE void NAME(const uint16_t* const* kr, int nk, const uint32_t* qt,          \
                          ptrdiff_t ldqt, ptrdiff_t D, float scale, float* s, ptrdiff_t lds) \
{                                                                                          \
    const ptrdiff_t np = D / 2;                                                            \
    const float* rows[16];                                                                 \
    uint32_t tail[16][16];                                                                 \
    __m512 sum[NR], acc[NR];                                                               \
    for (int r = 0; r < NR; r++) sum[r] = acc[r] = _mm512_setzero_ps();                    \
    for (ptrdiff_t p0 = 0; p0 < np; p0 += 16) {                                            \
        const ptrdiff_t n = np - p0 < 16 ? np - p0 : 16;                                   \
        for (int u = 0; u < 16; u++) {                                                     \
            rows[u] = (const float*) kr[u] + p0;                                           \
            if (n < 16) {   /* the last pairs of a row, zero-padded: no read past it */    \
                memset(tail[u], 0, sizeof tail[u]);                                        \
                memcpy(tail[u], rows[u], 4 * n);                                           \
                rows[u] = (const float*) tail[u];                                          \
            }                                                                              \
        }                                                                                  \
        fa_vf t[16];                                                                       \
        fa_load_transpose_vf(rows, 0, t);                                                  \
        for (ptrdiff_t i = 0; i < n; i++) {                                                \
            const ptrdiff_t p = p0 + i;                                                    \
            for (int r = 0; r < NR; r++)                                                   \
                acc[r] = fa_bdp(acc[r], _mm512_set1_epi32((int) qt[p * ldqt + r]),        \
                                (__m512i) t[i]);                                           \
            if (2 * (p + 1) % FA_DCHUNK == 0 || p + 1 == np)   /* a chunk ends */          \
                for (int r = 0; r < NR; r++) {                                             \
                    sum[r] = 2 * p < FA_DCHUNK ? acc[r] : _mm512_add_ps(sum[r], acc[r]);   \
                    acc[r] = _mm512_setzero_ps();                                          \
                }                                                                          \
        }                                                                                  \
    }                                                                                      \
    const __m512 sc = _mm512_set1_ps(scale);                                               \
    for (int r = 0; r < NR; r++) {                                                         \
        float out[16];                                                                     \
        _mm512_storeu_ps(out, _mm512_mul_ps(sum[r], sc));                                  \
        for (int u = 0; u < nk; u++) s[u * lds + r] = out[u];                              \
    }                                                                                      \
}
FA_BDP_KEYS16(fa_score_keys16x1_bdp, 1)
FA_BDP_KEYS16(fa_score_keys16x2_bdp, 2)
FA_BDP_KEYS16(fa_score_keys16x4_bdp, 4)
#undef FA_BDP_KEYS16

/*
 * Q^T in pairs of dimensions for 16 query rows (bfloat16, D even):
 *   qt[p*ldqt + r] = rows[r][2p] | rows[r][2p+1] << 16
 * Word by word: a tile packs its rows once, so this is not on the hot path.
 */
FA_BDP_NOINLINE void fa_pack_qt_pairs(const uint16_t* const* rows, ptrdiff_t D, uint32_t* qt,
                                      ptrdiff_t ldqt)
{
    for (ptrdiff_t p = 0; p < D / 2; p++) {
        uint32_t col[16];
        for (int r = 0; r < 16; r++) memcpy(&col[r], rows[r] + 2 * p, 4);
        memcpy(qt + p * ldqt, col, sizeof col);
    }
}

/*
 * P^T in pairs of keys, rounded to bfloat16 (to nearest even): for the nlanes rows (a
 * multiple of 16) and keys [0, nj) of the block's P^T (s[j*lds + r]), a key nj (odd nj)
 * counting as p = 0.  Any float32 rows pair up so (the AMX backward's dO and Q rows).
 */
FA_BDP_NOINLINE void fa_pack_p_pairs(const float* s, ptrdiff_t lds, ptrdiff_t nj,
                                     ptrdiff_t nlanes, uint32_t* pp, ptrdiff_t ldp)
{
    const __m512i lo_hi = _mm512_set_epi16(
        31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
        23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    for (ptrdiff_t jp = 0; jp < (nj + 1) / 2; jp++) {
        const float* s0 = s + 2 * jp * lds;
        const int odd = 2 * jp + 1 < nj;
        for (ptrdiff_t r = 0; r < nlanes; r += 16) {
            const __m512 p0 = _mm512_loadu_ps(s0 + r);
            const __m512 p1 = odd ? _mm512_loadu_ps(s0 + lds + r) : _mm512_setzero_ps();
            /* words 0-15: p0 of rows r..r+15, words 16-31: p1; interleaved by row */
            const __m512i both = (__m512i) _mm512_cvtne2ps_pbh(p1, p0);
            const __m512i w = _mm512_permutexvar_epi16(lo_hi, both);
            _mm512_storeu_si512((void*) (pp + jp * ldp + r), w);
        }
    }
}

/* 32 columns of two bfloat16 rows x and y as pairs (x[c], y[c]): columns 0-15 in *lo,
 * 16-31 in *hi. */
FA_BDP_INLINE void fa_v_pairs(__m512i x, __m512i y, __m512i* lo, __m512i* hi)
{
    const __m512i ilo = _mm512_set_epi16(
        47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8,
        39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
    *lo = _mm512_permutex2var_epi16(x, ilo, y);
    *hi = _mm512_permutex2var_epi16(x, _mm512_add_epi16(ilo, _mm512_set1_epi16(16)), y);
}

/*
 * V in pairs of keys for the block's nj keys (bfloat16 rows, Dv a multiple of 32):
 * vp[jp*Dv + c] = rows[2jp][c] | rows[2jp+1][c] << 16, a key nj (odd nj) as 0.
 */
FA_BDP_NOINLINE void fa_pack_v_pairs(const uint16_t* const* rows, ptrdiff_t nj, ptrdiff_t Dv,
                                     uint32_t* vp)
{
    for (ptrdiff_t jp = 0; jp < (nj + 1) / 2; jp++) {
        const uint16_t* v0 = rows[2 * jp];
        const int odd = 2 * jp + 1 < nj;
        uint32_t* dst = vp + jp * Dv;
        for (ptrdiff_t c = 0; c < Dv; c += 32) {
            const __m512i a = _mm512_loadu_si512((const void*) (v0 + c));
            const __m512i b = odd ? _mm512_loadu_si512((const void*) (rows[2 * jp + 1] + c))
                                  : _mm512_setzero_si512();
            __m512i lo, hi;
            fa_v_pairs(a, b, &lo, &hi);
            _mm512_storeu_si512((void*) (dst + c), lo);
            _mm512_storeu_si512((void*) (dst + c + 16), hi);
        }
    }
}

/*
 * Output micro-tiles: FA_MR_PV (6) rows x 2 vectors (32 columns), and one row.
 *   acc[r*ldacc + c] = acc * alpha[r] + sum over pairs jp of pp[jp*ldp + r] . vp[jp*ldv + c]
 */
#define FA_BDP_PV_TILE(NAME, NR)                                                           \
FA_BDP_NOINLINE void NAME(const uint32_t* pp, ptrdiff_t ldp, ptrdiff_t npairs,             \
                          const uint32_t* vp, ptrdiff_t ldv, float* acc, ptrdiff_t ldacc,  \
                          const float* alpha)                                              \
{                                                                                          \
    __m512 c[NR][2];                                                                       \
    for (int r = 0; r < NR; r++) c[r][0] = c[r][1] = _mm512_setzero_ps();                  \
    for (ptrdiff_t jp = 0; jp < npairs; jp++) {                                            \
        const __m512i v0 = fa_load_u32x16(vp + jp * ldv);                                  \
        const __m512i v1 = fa_load_u32x16(vp + jp * ldv + 16);                             \
        for (int r = 0; r < NR; r++) {                                                     \
            const __m512i b = _mm512_set1_epi32((int) pp[jp * ldp + r]);                   \
            c[r][0] = fa_bdp(c[r][0], b, v0);                                              \
            c[r][1] = fa_bdp(c[r][1], b, v1);                                              \
        }                                                                                  \
    }                                                                                      \
    for (int r = 0; r < NR; r++)                                                           \
        for (int h = 0; h < 2; h++) {                                                      \
            float* o = acc + r * ldacc + 16 * h;                                           \
            _mm512_storeu_ps(o, _mm512_fmadd_ps(_mm512_loadu_ps(o),                        \
                                                _mm512_set1_ps(alpha[r]), c[r][h]));       \
        }                                                                                  \
}
FA_BDP_PV_TILE(fa_pv_tile_bdp, 6)
FA_BDP_PV_TILE(fa_pv_tile1_bdp, 1)
#undef FA_BDP_PV_TILE

/*
 * The output of nr (1 to 4) rows that see the same keys, over npairs pairs of keys whose
 * V rows are read where they lie (rows[2jp] and rows[2jp + 1], a key at or past nj as 0):
 * fa_pack_v_pairs and fa_pv_tile1_bdp for each row in one pass, the same pairs and
 * products in the same order, each pair of rows paired once for all the rows.
 *   acc[r*ldacc + c] = acc * alpha[r] + sum over pairs jp of pp[jp*ldp + r] . V pair jp
 * for c < Dv (a multiple of 32), QP chunks of 32 columns a pass (the rows' sums of a pass
 * fill half the register file).
 */
#define FA_BDP_PV_ROWS(NAME, NR, QP)                                                       \
FA_BDP_NOINLINE void NAME(const uint32_t* pp, ptrdiff_t ldp, ptrdiff_t npairs,             \
                          const uint16_t* const* rows, ptrdiff_t nj, ptrdiff_t Dv,         \
                          float* acc, ptrdiff_t ldacc, const float* alpha)                 \
{                                                                                          \
    for (ptrdiff_t c0 = 0; c0 < Dv; c0 += 32 * QP) {                                       \
        const int nq = (Dv - c0) / 32 < QP ? (int) ((Dv - c0) / 32) : QP;                  \
        __m512 c[NR][2 * QP];                                                              \
        for (int r = 0; r < NR; r++)                                                       \
            for (int i = 0; i < 2 * nq; i++) c[r][i] = _mm512_setzero_ps();                \
        for (ptrdiff_t jp = 0; jp < npairs; jp++) {                                        \
            __m512i b[NR];                                                                 \
            for (int r = 0; r < NR; r++) b[r] = _mm512_set1_epi32((int) pp[jp * ldp + r]); \
            const uint16_t* v0 = rows[2 * jp] + c0;                                        \
            const uint16_t* v1 = 2 * jp + 1 < nj ? rows[2 * jp + 1] + c0 : NULL;           \
            for (int i = 0; i < nq; i++) {                                                 \
                const __m512i x = _mm512_loadu_si512((const void*) (v0 + 32 * i));         \
                const __m512i y = v1 ? _mm512_loadu_si512((const void*) (v1 + 32 * i))     \
                                     : _mm512_setzero_si512();                             \
                __m512i pl, ph;                                                            \
                fa_v_pairs(x, y, &pl, &ph);                                                \
                for (int r = 0; r < NR; r++) {                                             \
                    c[r][2 * i] = fa_bdp(c[r][2 * i], b[r], pl);                           \
                    c[r][2 * i + 1] = fa_bdp(c[r][2 * i + 1], b[r], ph);                   \
                }                                                                          \
            }                                                                              \
        }                                                                                  \
        for (int r = 0; r < NR; r++)                                                       \
            for (int i = 0; i < 2 * nq; i++) {                                             \
                float* o = acc + r * ldacc + c0 + 16 * i;                                  \
                _mm512_storeu_ps(o, _mm512_fmadd_ps(_mm512_loadu_ps(o),                    \
                                                    _mm512_set1_ps(alpha[r]), c[r][i]));   \
            }                                                                              \
    }                                                                                      \
}
FA_BDP_PV_ROWS(fa_pv_rows1_bdp, 1, 4)
FA_BDP_PV_ROWS(fa_pv_rows2_bdp, 2, 2)
FA_BDP_PV_ROWS(fa_pv_rows3_bdp, 3, 2)
FA_BDP_PV_ROWS(fa_pv_rows4_bdp, 4, 2)
#undef FA_BDP_PV_ROWS

/* fa_pv_rows<nr>_bdp for nr of 1 to 4 rows. */
static inline void fa_pv_rows_bdp(int nr, const uint32_t* pp, ptrdiff_t ldp, ptrdiff_t npairs,
                                  const uint16_t* const* rows, ptrdiff_t nj, ptrdiff_t Dv,
                                  float* acc, ptrdiff_t ldacc, const float* alpha)
{
    if (nr == 1) fa_pv_rows1_bdp(pp, ldp, npairs, rows, nj, Dv, acc, ldacc, alpha);
    else if (nr == 2) fa_pv_rows2_bdp(pp, ldp, npairs, rows, nj, Dv, acc, ldacc, alpha);
    else if (nr == 3) fa_pv_rows3_bdp(pp, ldp, npairs, rows, nj, Dv, acc, ldacc, alpha);
    else fa_pv_rows4_bdp(pp, ldp, npairs, rows, nj, Dv, acc, ldacc, alpha);
}

#else  /* no AVX512-BF16 code in this build: the pipeline never calls these */

#define FA_BDP_STUB static inline __attribute__((unused)) void
FA_BDP_STUB fa_score_tile_bdp(const uint16_t* const* kr, const uint32_t* qt, ptrdiff_t ldqt,
                              ptrdiff_t D, float scale, float* s, ptrdiff_t lds)
{ (void)kr; (void)qt; (void)ldqt; (void)D; (void)scale; (void)s; (void)lds; }
#define fa_score_tile4_bdp fa_score_tile_bdp
#define fa_score_tile1_bdp fa_score_tile_bdp
FA_BDP_STUB fa_score_keys16x1_bdp(const uint16_t* const* kr, int nk, const uint32_t* qt,
                                  ptrdiff_t ldqt, ptrdiff_t D, float scale, float* s,
                                  ptrdiff_t lds)
{ (void)kr; (void)nk; (void)qt; (void)ldqt; (void)D; (void)scale; (void)s; (void)lds; }
#define fa_score_keys16x2_bdp fa_score_keys16x1_bdp
#define fa_score_keys16x4_bdp fa_score_keys16x1_bdp
FA_BDP_STUB fa_pack_qt_pairs(const uint16_t* const* rows, ptrdiff_t D, uint32_t* qt,
                             ptrdiff_t ldqt)
{ (void)rows; (void)D; (void)qt; (void)ldqt; }
FA_BDP_STUB fa_pack_p_pairs(const float* s, ptrdiff_t lds, ptrdiff_t nj, ptrdiff_t nlanes,
                            uint32_t* pp, ptrdiff_t ldp)
{ (void)s; (void)lds; (void)nj; (void)nlanes; (void)pp; (void)ldp; }
FA_BDP_STUB fa_pack_v_pairs(const uint16_t* const* rows, ptrdiff_t nj, ptrdiff_t Dv,
                            uint32_t* vp)
{ (void)rows; (void)nj; (void)Dv; (void)vp; }
FA_BDP_STUB fa_pv_tile_bdp(const uint32_t* pp, ptrdiff_t ldp, ptrdiff_t npairs,
                           const uint32_t* vp, ptrdiff_t ldv, float* acc, ptrdiff_t ldacc,
                           const float* alpha)
{ (void)pp; (void)ldp; (void)npairs; (void)vp; (void)ldv; (void)acc; (void)ldacc; (void)alpha; }
#define fa_pv_tile1_bdp fa_pv_tile_bdp
static inline __attribute__((unused)) void fa_pv_rows_bdp(
    int nr, const uint32_t* pp, ptrdiff_t ldp, ptrdiff_t npairs, const uint16_t* const* rows,
    ptrdiff_t nj, ptrdiff_t Dv, float* acc, ptrdiff_t ldacc, const float* alpha)
{ (void)nr; (void)pp; (void)ldp; (void)npairs; (void)rows; (void)nj; (void)Dv; (void)acc;
  (void)ldacc; (void)alpha; }
#undef FA_BDP_STUB

#endif /* FA_HAVE_BF16DOT */
#endif /* FA_BF16DOT_H */
