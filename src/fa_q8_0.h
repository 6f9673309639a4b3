/*
 * fa_q8_0.h -- decode kernels that read q8_0 K and V where they are stored (float
 * compute).  A q8_0 row holds int8 values and one float16 scale per 32 of them; a value
 * is x * d, exact in float32 (an 8-bit integer times a float16), so the kernels below
 * dequantise in registers as they load and then run the float kernels' arithmetic: the
 * same chains, hence the same bits, as the float32 kernels over the dequantised cache.
 * The point is to read 1.0625 bytes per value instead of the 4 of a dequantised copy.
 *
 * Rows are addressed one pointer per key (kr[j]), so that rows in pages cost what
 * contiguous rows do; their scales come converted to float32 (fa_q8_0_rows).  Included
 * by fa_kernels.h after the float kernels (it uses their transpose and vector helpers).
 */

/* VL values of a q8_0 row from x, of the block whose scale is d (broadcast): widened
 * with one sign extension and one conversion (GCC's generic int8 -> float vector
 * conversion goes element by element). */
#if FA_VBYTES == 64
FA_INLINE fa_vf fa_load_q8_0(const int8_t* x, fa_vf d)
{
    const __m128i b = _mm_loadu_si128((const __m128i*)x);
    return (fa_vf)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b)) * d;
}
#elif defined(__AVX2__)
FA_INLINE fa_vf fa_load_q8_0(const int8_t* x, fa_vf d)
{
    const __m128i b = _mm_loadl_epi64((const __m128i*)x);
    return (fa_vf)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)) * d;
}
#else
FA_INLINE fa_vf fa_load_q8_0(const int8_t* x, fa_vf d)
{
    float w[FA_VL_F];
    for (int i = 0; i < FA_VL_F; i++) w[i] = (float)x[i];
    return fa_load_f(w) * d;
}
#endif

/* A VL x VL block of keys (rows kr[0..VL), dims d0 .. d0 + VL) transposed in two steps:
 * fa_q8_0_load reads it, fa_q8_0_half(h) then gives t[i] = the VL keys at dim
 * d0 + h VL/2 + i (i < VL/2) as exact floats, not yet scaled.  In halves, the FMAs of two
 * blocks can be interleaved without spilling. */
#if FA_VBYTES == 64
/* The 16 x 16 int8 block is transposed as bytes, 24 shuffles against the 80 of a float
 * transpose (then a lane extraction and a sign extension per dim): rows t, t + 4, t + 8,
 * t + 12 in the 128-bit lanes of z[t]; byte unpacks (kept: x[0..1] dims 0-7, x[2..3]
 * dims 8-15) and word unpacks leave in lane g the dims of keys 4g .. 4g + 3, a dword per
 * dim; one dword permutation then gathers a dim's 16 keys into one 128-bit lane, which
 * is sign-extended and converted. */
typedef struct { __m512i x[4]; } fa_q8_0_blk;

FA_INLINE void fa_q8_0_load(const int8_t* const* kr, ptrdiff_t d0, fa_q8_0_blk* u)
{
    __m512i z[4];
    for (int r = 0; r < 4; r++) {
        __m512i x = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i*)(kr[r] + d0)));
        x = _mm512_inserti32x4(x, _mm_loadu_si128((const __m128i*)(kr[4 + r] + d0)), 1);
        x = _mm512_inserti32x4(x, _mm_loadu_si128((const __m128i*)(kr[8 + r] + d0)), 2);
        z[r] = _mm512_inserti32x4(x, _mm_loadu_si128((const __m128i*)(kr[12 + r] + d0)), 3);
    }
    u->x[0] = _mm512_unpacklo_epi8(z[0], z[1]);
    u->x[1] = _mm512_unpacklo_epi8(z[2], z[3]);
    u->x[2] = _mm512_unpackhi_epi8(z[0], z[1]);
    u->x[3] = _mm512_unpackhi_epi8(z[2], z[3]);
}

FA_INLINE fa_vf fa_q8_0_lane(__m512i b, const int lane)
{
    const __m128i x = lane ? _mm512_extracti32x4_epi32(b, lane) : _mm512_castsi512_si128(b);
    return (fa_vf)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(x));
}

FA_INLINE void fa_q8_0_half(const fa_q8_0_blk* u, const int h, fa_vf* t)
{
    const __m512i idx = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    const __m512i lo = u->x[2 * h], hi = u->x[2 * h + 1];
    const __m512i b0 = _mm512_permutexvar_epi32(idx, _mm512_unpacklo_epi16(lo, hi));
    const __m512i b1 = _mm512_permutexvar_epi32(idx, _mm512_unpackhi_epi16(lo, hi));
    t[0] = fa_q8_0_lane(b0, 0); t[1] = fa_q8_0_lane(b0, 1);
    t[2] = fa_q8_0_lane(b0, 2); t[3] = fa_q8_0_lane(b0, 3);
    t[4] = fa_q8_0_lane(b1, 0); t[5] = fa_q8_0_lane(b1, 1);
    t[6] = fa_q8_0_lane(b1, 2); t[7] = fa_q8_0_lane(b1, 3);
}
#else
/* Each row widened into a small buffer, then the float transpose, all at load. */
typedef struct { fa_vf t[FA_VL_F]; } fa_q8_0_blk;

FA_INLINE void fa_q8_0_load(const int8_t* const* kr, ptrdiff_t d0, fa_q8_0_blk* u)
{
    float w[FA_VL_F][FA_VL_F];
    const float* rows[FA_VL_F];
    for (int i = 0; i < FA_VL_F; i++) {
        fa_store_f(w[i], fa_load_q8_0(kr[i] + d0, fa_bcast_f(1.0f)));
        rows[i] = w[i];
    }
    fa_load_transpose_vf(rows, 0, u->t);
}

FA_INLINE void fa_q8_0_half(const fa_q8_0_blk* u, const int h, fa_vf* t)
{
    for (int i = 0; i < FA_VL_F / 2; i++) t[i] = u->t[h * FA_VL_F / 2 + i];
}
#endif

#if FA_VBYTES == 64
/* The float32 scales of 16 keys x 4 blocks (D = 128), stored key by key (ks, 64 float16
 * values), transposed block by block into ksc[b * ldksc + u]. */
FA_INLINE void fa_q8_0_ksc16x4(const uint16_t* ks, float* ksc, ptrdiff_t ldksc)
{
    __m512 a[4];
    for (int i = 0; i < 4; i++)
        a[i] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(ks + 16 * i)));
    /* lane m: block (m >> 3) (+ 2 for hi) of key m & 7 of the pair a[0], a[1] (a[2], a[3]) */
    const __m512i lo = _mm512_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28,
                                         1, 5, 9, 13, 17, 21, 25, 29);
    const __m512i hi = _mm512_add_epi32(lo, _mm512_set1_epi32(2));
    const __m512 t_lo = _mm512_permutex2var_ps(a[0], lo, a[1]);
    const __m512 t_hi = _mm512_permutex2var_ps(a[0], hi, a[1]);
    const __m512 s_lo = _mm512_permutex2var_ps(a[2], lo, a[3]);
    const __m512 s_hi = _mm512_permutex2var_ps(a[2], hi, a[3]);
    _mm512_storeu_ps(ksc, _mm512_shuffle_f32x4(t_lo, s_lo, 0x44));
    _mm512_storeu_ps(ksc + ldksc, _mm512_shuffle_f32x4(t_lo, s_lo, 0xEE));
    _mm512_storeu_ps(ksc + 2 * ldksc, _mm512_shuffle_f32x4(t_hi, s_hi, 0x44));
    _mm512_storeu_ps(ksc + 3 * ldksc, _mm512_shuffle_f32x4(t_hi, s_hi, 0xEE));
}
#endif

/* n consecutive rows of a q8_0 K and V (a page, or a contiguous run of a cache) for the
 * kernels below: row pointers kptr[u] = k + u k_row (likewise vptr), and the scales in
 * float32: K's transposed, ksc[b * ldksc + u] (a vector then holds consecutive keys'
 * scales of one block of dims), V's by row, vsc[u * nbv + b].  Scale rows are ks_row
 * (vs_row) elements apart. */
static void fa_q8_0_rows(const char* k, ptrdiff_t k_row, const uint16_t* ks, ptrdiff_t ks_row,
                         ptrdiff_t nbk, const char* v, ptrdiff_t v_row, const uint16_t* vs,
                         ptrdiff_t vs_row, ptrdiff_t nbv, ptrdiff_t n, const char** kptr,
                         const char** vptr, float* ksc, ptrdiff_t ldksc, float* vsc)
{
    for (ptrdiff_t u = 0; u < n; u++) {
        kptr[u] = k + u * k_row;
        vptr[u] = v + u * v_row;
    }
    ptrdiff_t u0 = 0;
#if FA_VBYTES == 64
    if (nbk == 4 && ks_row == 4)
        for (; u0 + 16 <= n; u0 += 16) fa_q8_0_ksc16x4(ks + 4 * u0, ksc + u0, ldksc);
#endif
    for (ptrdiff_t b = 0; b < nbk; b++)
        for (ptrdiff_t u = u0; u < n; u++) ksc[b * ldksc + u] = fa_f16_to_f32(ks[u * ks_row + b]);
    if (vs_row == nbv) {
        fa_widen_f(FA_STORE_F16, vs, n * nbv, vsc);
        return;
    }
    for (ptrdiff_t u = 0; u < n; u++) fa_widen_f(FA_STORE_F16, vs + u * vs_row, nbv, vsc + u * nbv);
}

/* The same rows' addresses for the next block, whose rows the kernels request as they go
 * (kpf, vpf), and the lines of their scales requested into L2 now. */
static void fa_q8_0_next_rows(const char* k, ptrdiff_t k_row, const uint16_t* ks,
                              ptrdiff_t ks_row, ptrdiff_t nbk, const char* v, ptrdiff_t v_row,
                              const uint16_t* vs, ptrdiff_t vs_row, ptrdiff_t nbv, ptrdiff_t n,
                              const char** kpf, const char** vpf)
{
    for (ptrdiff_t u = 0; u < n; u++) {
        kpf[u] = k + u * k_row;
        vpf[u] = v + u * v_row;
    }
    /* the lines from the first row's scales to the last's */
    fa_prefetch_lines((const char*)ks, ((n - 1) * ks_row + nbk) * 2, 2);
    fa_prefetch_lines((const char*)vs, ((n - 1) * vs_row + nbv) * 2, 2);
}

FA_INLINE ptrdiff_t fa_min_pd(ptrdiff_t a, ptrdiff_t b) { return a < b ? a : b; }

/* Row pf[i] (bytes long) requested into the cache level of locality loc; its run of
 * rows ends unless row i + 1 (< n) follows it in memory (see fa_prefetch_row). */
FA_INLINE void fa_q8_0_prefetch_row(const char* const* pf, ptrdiff_t i, ptrdiff_t n,
                                    ptrdiff_t bytes, const int loc)
{
    fa_prefetch_row(pf[i], bytes, i + 1 == n || pf[i + 1] != pf[i] + bytes, loc);
}

/* Rows [i0, i1) of pf[0 .. n). */
FA_INLINE void fa_q8_0_prefetch_rows(const char* const* pf, ptrdiff_t i0, ptrdiff_t i1,
                                     ptrdiff_t n, ptrdiff_t bytes, const int loc)
{
    for (ptrdiff_t i = i0; i < i1; i++) fa_q8_0_prefetch_row(pf, i, n, bytes, loc);
}

/*
 * Scores of ng x VL keys (the lanes of ng vectors) against nr query rows of Q^T, as
 * fa_score_keyrows_f:
 *   s[t*lds + r] = scale * sum_d k_t[d] * qt[d*ldqt + r]    t < nk, r < min(nr, nstore)
 * Each VL x VL block of keys is transposed, then scaled per lane by its key's scale
 * (ksc[(d / 32) * ldksc + t], float32; exact); per score the chain acc += k[d] * q[d] in
 * order of d, chunk sums every FA_DCHUNK dims, then * scale.  Two groups of keys (ng 2)
 * give one or two rows independent chains to interleave.  Rows past nk must be zero
 * rows: they are read, not stored.  Requested as the dims go: pf[0 .. npf), the next
 * block's K rows at these keys, into L2; l1[0 .. nl1), the next call's, into L1.
 */
FA_INLINE void fa_score_q8_0_body(const int8_t* const* kr, const float* ksc, ptrdiff_t ldksc,
                                  int nk, const float* qt, ptrdiff_t ldqt, ptrdiff_t D,
                                  float scale, float* s, ptrdiff_t lds, const int nr,
                                  const int ng, int nstore, const char* const* pf, int npf,
                                  const char* const* l1, int nl1)
{
    fa_vf a[2][8];
    float part[2][8][FA_VL_F];   /* the sums of the chunks before the current one */
    for (int g = 0; g < ng; g++)
        for (int r = 0; r < nr; r++) a[g][r] = fa_bcast_f(0);
    /* rows to request per step of VL dims */
    const ptrdiff_t steps = D / FA_VL_F;
    const ptrdiff_t l2_rows = (npf + steps - 1) / steps, l1_rows = (nl1 + steps - 1) / steps;
    for (ptrdiff_t d0 = 0; d0 < D; d0 += FA_VL_F) {
        if (d0 && d0 % FA_DCHUNK == 0)
            for (int g = 0; g < ng; g++)
                for (int r = 0; r < nr; r++) {
                    fa_store_f(part[g][r], d0 == FA_DCHUNK ? a[g][r]
                                                           : fa_load_f(part[g][r]) + a[g][r]);
                    a[g][r] = fa_bcast_f(0);
                }
        const ptrdiff_t step = d0 / FA_VL_F;
        fa_q8_0_prefetch_rows(pf, step * l2_rows, fa_min_pd(npf, (step + 1) * l2_rows), npf, D, 2);
        fa_q8_0_prefetch_rows(l1, step * l1_rows, fa_min_pd(nl1, (step + 1) * l1_rows), nl1, D, 3);
        fa_q8_0_blk u[2];
        fa_vf d[2];
        for (int g = 0; g < ng; g++) {
            fa_q8_0_load(kr + g * FA_VL_F, d0, &u[g]);
            d[g] = fa_load_f(ksc + (d0 / 32) * ldksc + g * FA_VL_F);
        }
        for (int h = 0; h < 2; h++) {
            fa_vf t[2][FA_VL_F / 2];
            for (int g = 0; g < ng; g++) fa_q8_0_half(&u[g], h, t[g]);
            for (int i = 0; i < FA_VL_F / 2; i++) {
                const float* qd = qt + (d0 + h * FA_VL_F / 2 + i) * ldqt;
                for (int g = 0; g < ng; g++) {
                    const fa_vf ki = t[g][i] * d[g];
                    for (int r = 0; r < nr; r++) a[g][r] += fa_bcast_f(qd[r]) * ki;
                }
            }
        }
    }
    const fa_vf sc = fa_bcast_f(scale);
    for (int g = 0; g < ng; g++)
        for (int r = 0; r < nr && r < nstore; r++) {
            float out[FA_VL_F];
            fa_store_f(out, (D > FA_DCHUNK ? fa_load_f(part[g][r]) + a[g][r] : a[g][r]) * sc);
            for (int t = 0; t < FA_VL_F && g * FA_VL_F + t < nk; t++)
                s[(g * FA_VL_F + t) * lds + r] = out[t];
        }
}

#define FA_SCORE_Q8_0_NR(NR, NG) \
FA_NOINLINE void fa_score_q8_0_r##NR(const int8_t* const* kr, const float* ksc, \
                                     ptrdiff_t ldksc, int nk, const float* qt, ptrdiff_t ldqt, \
                                     ptrdiff_t D, float scale, float* s, ptrdiff_t lds, \
                                     int nstore, const char* const* pf, int npf, \
                                     const char* const* l1, int nl1) \
{ fa_score_q8_0_body(kr, ksc, ldksc, nk, qt, ldqt, D, scale, s, lds, NR, NG, nstore, pf, \
                     npf, l1, nl1); }
FA_SCORE_Q8_0_NR(1, 2)
FA_SCORE_Q8_0_NR(2, 2)
FA_SCORE_Q8_0_NR(4, 1)
FA_SCORE_Q8_0_NR(8, 1)
#undef FA_SCORE_Q8_0_NR
/* keys per call of fa_score_q8_0_r<nr> */
FA_INLINE int fa_score_q8_0_keys(int nr) { return (int)(nr <= 2 ? 2 * FA_VL_F : FA_VL_F); }

/*
 * The output of nr query rows (1 or 4) over nv vectors of value columns from column c0,
 * V in q8_0 rows vr[j] with float32 scales vsc[j * nbv + c / 32]: per element the
 * sequence of fa_pv_tile_f,
 *   acc[r, c] = acc[r, c] * alpha[r] + sum_j p[j*ldp + r] * v_j[c]
 * the block's sum from zero in order of j, then one FMA.  Each V vector is dequantised
 * once for all nr rows.  Row j + FA_PV_Q8_0_AHEAD is requested into L1 as row j is read,
 * and pf[j] (the next block's rows, j < npf) into L2.
 */
#define FA_PV_Q8_0_AHEAD 4
FA_INLINE void fa_pv_q8_0_cols(const float* p, ptrdiff_t ldp, ptrdiff_t nj,
                               const int8_t* const* vr, const float* vsc, ptrdiff_t nbv,
                               ptrdiff_t c0, float* acc, ptrdiff_t ldacc, const float* alpha,
                               const int nr, const int nv, const char* const* pf,
                               ptrdiff_t npf, ptrdiff_t pf_bytes)
{
    fa_vf c[4][8];
    for (int r = 0; r < nr; r++)
        for (int i = 0; i < nv; i++) c[r][i] = fa_bcast_f(0);
    for (ptrdiff_t j = 0; j < nj; j++) {
        const int8_t* x = vr[j] + c0;
        const float* d = vsc + j * nbv + c0 / 32;
        if (j + FA_PV_Q8_0_AHEAD < nj)
            fa_prefetch_lines((const char*)(vr[j + FA_PV_Q8_0_AHEAD] + c0), nv * FA_VL_F, 3);
        if (j < npf) fa_q8_0_prefetch_row(pf, j, npf, pf_bytes, 2);
        fa_vf xv[8];
        for (int i = 0; i < nv; i++)
            xv[i] = fa_load_q8_0(x + i * FA_VL_F, fa_bcast_f(d[i * FA_VL_F / 32]));
        for (int r = 0; r < nr; r++) {
            const fa_vf b = fa_bcast_f(p[j * ldp + r]);
            for (int i = 0; i < nv; i++) c[r][i] += b * xv[i];
        }
    }
    for (int r = 0; r < nr; r++) {
        const fa_vf a = fa_bcast_f(alpha[r]);
        float* acc_r = acc + r * ldacc + c0;
        for (int i = 0; i < nv; i++)
            fa_store_f(acc_r + i * FA_VL_F, fa_load_f(acc_r + i * FA_VL_F) * a + c[r][i]);
    }
}

/* Vectors of value columns per pass: 1 row x 8 (all of Dv = 128 with AVX-512 in one
 * pass over the keys), 4 rows x FA_PV4_NV (accumulators and V vectors fit the register
 * file, see fa_pv_rows4_f). */
#define FA_PV_Q8_0_ROWS(NR, NV) \
FA_NOINLINE void fa_pv_q8_0_r##NR##_v##NV(const float* p, ptrdiff_t ldp, ptrdiff_t nj, \
                                           const int8_t* const* vr, const float* vsc, \
                                           ptrdiff_t nbv, ptrdiff_t c0, float* acc, \
                                           ptrdiff_t ldacc, const float* alpha, \
                                           const char* const* pf, ptrdiff_t npf, \
                                           ptrdiff_t pf_bytes) \
{ fa_pv_q8_0_cols(p, ldp, nj, vr, vsc, nbv, c0, acc, ldacc, alpha, NR, NV, pf, npf, pf_bytes); }
FA_PV_Q8_0_ROWS(1, 8)
FA_PV_Q8_0_ROWS(1, 4)
FA_PV_Q8_0_ROWS(1, 2)
FA_PV_Q8_0_ROWS(1, 1)
FA_PV_Q8_0_ROWS(4, 2)
FA_PV_Q8_0_ROWS(4, 1)
#if FA_PV4_NV >= 4
FA_PV_Q8_0_ROWS(4, 4)
#endif
#undef FA_PV_Q8_0_ROWS

/* acc = acc * alpha + P V over all Dv columns (a multiple of 32) for nr rows (1 or 4);
 * the first pass over the keys requests pf[0 .. npf) (Dv bytes each) into L2. */
FA_NOINLINE void fa_pv_q8_0(const float* p, ptrdiff_t ldp, ptrdiff_t nj,
                            const int8_t* const* vr, const float* vsc, ptrdiff_t Dv,
                            float* acc, ptrdiff_t ldacc, const float* alpha, int nr,
                            const char* const* pf, ptrdiff_t npf)
{
    const ptrdiff_t VL = FA_VL_F, nbv = Dv / 32;
    ptrdiff_t c0 = 0;
#define FA_PASS(NR, NV) \
    for (; c0 + NV * VL <= Dv; c0 += NV * VL, npf = 0) \
        fa_pv_q8_0_r##NR##_v##NV(p, ldp, nj, vr, vsc, nbv, c0, acc, ldacc, alpha, pf, npf, Dv);
    if (nr == 1) {
        FA_PASS(1, 8) FA_PASS(1, 4) FA_PASS(1, 2) FA_PASS(1, 1)
        return;
    }
#if FA_PV4_NV >= 4
    FA_PASS(4, 4)
#endif
    FA_PASS(4, 2) FA_PASS(4, 1)
#undef FA_PASS
}
