/*
 * fa_keys32.h -- the decode score kernels of 32-byte vector builds (AVX2 and the SSE2
 * baseline) for one storage type of K.  Included by fa_kernels.h once per storage type
 * with these macros defined:
 *   KE                 the element type of K (float, or uint16_t for float16 / bfloat16)
 *   K32(name)          the name of this instantiation's function
 *   KE_SCALAR(x)       one element widened to float
 *   FA_YROWS(lo, hi)   4 elements of two rows as one float vector [lo[0..3] | hi[0..3]]
 *   KE_LOAD8W(p)       optional (16-bit K, AVX2): 8 elements loaded and widened
 * (all undefined at the end: each inclusion names its own)
 * The float arithmetic is the same for every storage type: a 16-bit K is widened in
 * registers as it is loaded, and widening is exact, so a score's bits do not depend on
 * how its key is stored.
 */

/* The 4 x 4 transpose within each 128-bit lane that turns y_i = [row i | row i+4] (4
 * elements of each) into t[i][lane] = element i of row lane: unpack, then 64-bit
 * shuffles. */
FA_INLINE void K32(fa_transpose_y4)(fa_vf8 y0, fa_vf8 y1, fa_vf8 y2, fa_vf8 y3, fa_vf8* t)
{
    const fa_vf8 u0 = __builtin_shufflevector(y0, y1, 0, 8, 1, 9, 4, 12, 5, 13);
    const fa_vf8 u1 = __builtin_shufflevector(y0, y1, 2, 10, 3, 11, 6, 14, 7, 15);
    const fa_vf8 u2 = __builtin_shufflevector(y2, y3, 0, 8, 1, 9, 4, 12, 5, 13);
    const fa_vf8 u3 = __builtin_shufflevector(y2, y3, 2, 10, 3, 11, 6, 14, 7, 15);
    t[0] = __builtin_shufflevector(u0, u2, 0, 1, 8, 9, 4, 5, 12, 13);
    t[1] = __builtin_shufflevector(u0, u2, 2, 3, 10, 11, 6, 7, 14, 15);
    t[2] = __builtin_shufflevector(u1, u3, 0, 1, 8, 9, 4, 5, 12, 13);
    t[3] = __builtin_shufflevector(u1, u3, 2, 3, 10, 11, 6, 7, 14, 15);
}

/* t[i][lane] = k[lane][d0 + i] for 8 key rows k, i < 4. */
FA_INLINE void K32(fa_load_transpose_8x4)(const KE* const* k, ptrdiff_t d0, fa_vf8* t)
{
    /* y_i = [k_i | k_(i+4)]: keys 0-3 in the low 128-bit lane, 4-7 in the high one */
    const fa_vf8 y0 = FA_YROWS(k[0] + d0, k[4] + d0), y1 = FA_YROWS(k[1] + d0, k[5] + d0);
    const fa_vf8 y2 = FA_YROWS(k[2] + d0, k[6] + d0), y3 = FA_YROWS(k[3] + d0, k[7] + d0);
    K32(fa_transpose_y4)(y0, y1, y2, y3, t);
}

/* The same from 8 equally spaced rows k, k + ldk, ..., k + 7 ldk, addressed from two
 * base pointers (k and k + 3 ldk) and the stride: an array of row pointers would be kept
 * on the stack and reloaded before every load. */
FA_INLINE void K32(fa_load_transpose_8x4s)(const KE* k, ptrdiff_t ldk, ptrdiff_t d0, fa_vf8* t)
{
    const KE *b = k + d0, *b3 = k + 3 * ldk + d0;
    const fa_vf8 y0 = FA_YROWS(b, b + 4 * ldk), y1 = FA_YROWS(b + ldk, b3 + 2 * ldk);
    const fa_vf8 y2 = FA_YROWS(b + 2 * ldk, b3 + 3 * ldk), y3 = FA_YROWS(b3, b3 + 4 * ldk);
    K32(fa_transpose_y4)(y0, y1, y2, y3, t);
}

/* One step: 4 dims of the 8 keys of group g into the nr accumulators a[r]. */
FA_INLINE void K32(fa_keys32_step)(const KE* const* kr, ptrdiff_t ldk, int g, ptrdiff_t d0,
                                const float* qt, ptrdiff_t ldqt, const int nr, fa_vf8* a)
{
    fa_vf8 t[4];
    if (ldk)
        K32(fa_load_transpose_8x4s)(kr[0] + 8 * g * ldk, ldk, d0, t);
    else
        K32(fa_load_transpose_8x4)(kr + 8 * g, d0, t);
    for (int i = 0; i < 4; i++) {
        const float* qd = qt + (d0 + i) * ldqt;
        for (int r = 0; r < nr; r++) a[r] += fa_bcast_f8(qd[r]) * t[i];
    }
}

#if defined(KE_LOAD8W)
/* One dimension of fa_kt8_pass: the nr x ng accumulators a[r][g] += q[r] k_g, where
 * kd + g gs holds the dimension's 8 keys of group g as 16-bit values. */
FA_INLINE void K32(fa_kt8_dim)(const KE* kd, ptrdiff_t gs, const float* qd, const int nr,
                              const int ng, fa_vf8 (*a)[4])
{
    fa_vf8 kv[4];
    for (int g = 0; g < ng; g++) kv[g] = KE_LOAD8W(kd + g * gs);
    for (int r = 0; r < nr; r++) {
        const fa_vf8 qb = fa_bcast_f8(qd[r]);
        for (int g = 0; g < ng; g++) a[r][g] += qb * kv[g];
    }
}

/* One pass of fa_score_keys32_kt8: nr = 2 or 4 rows of Q^T (qt[d * ldqt + r]) over the
 * call's 32 transposed keys kh, ng groups of 8 keys per sweep so that nr x ng = 8
 * accumulator chains are in flight.  pfs: the call's prefetch streams, on the first pass
 * only (else NULL). */
FA_INLINE void K32(fa_kt8_pass)(const KE* kh, const float* qt, ptrdiff_t ldqt, ptrdiff_t D,
                               float scale, float* s, ptrdiff_t lds, int nstore, const int nr,
                               fa_dec_pf* pfs)
{
    const int ng = nr >= 4 ? 2 : 4;
    const ptrdiff_t gs = 8 * D;   /* elements per group of 8 keys */
    const fa_vf8 sc = fa_bcast_f8(scale);
    for (int g0 = 0; g0 < 4; g0 += ng) {
        fa_vf8 a[4][4];
        float part[4][4][8];   /* the sums of the chunks before the current one */
        for (int r = 0; r < nr; r++)
            for (int g = 0; g < ng; g++) a[r][g] = fa_bcast_f8(0);
        const KE* kg = kh + g0 * gs;
        for (ptrdiff_t c0 = 0; c0 < D; c0 += FA_DCHUNK) {
            if (c0)
                for (int r = 0; r < nr; r++)
                    for (int g = 0; g < ng; g++) {
                        fa_store_f8(part[r][g], c0 == FA_DCHUNK ? a[r][g]
                                                               : fa_load_f8(part[r][g]) + a[r][g]);
                        a[r][g] = fa_bcast_f8(0);
                    }
            const ptrdiff_t c1 = c0 + FA_DCHUNK < D ? c0 + FA_DCHUNK : D;
            ptrdiff_t d0 = c0;
            for (; d0 + 16 <= c1; d0 += 16)
                for (int h = 0; h < 2; h++) {   /* dims d0 + 8h + e, e < 8 */
                    if (pfs) fa_dec_pf_step(pfs);
#pragma GCC unroll 8
                    for (int e = 0; e < 8; e++)
                        K32(fa_kt8_dim)(kg + 8 * (d0 + 2 * e + h), gs,
                                        qt + (d0 + 8 * h + e) * ldqt, nr, ng, a);
                }
            if (d0 < c1) {   /* the last 8 dims, D % 16 == 8 */
                if (pfs) fa_dec_pf_step(pfs);
#pragma GCC unroll 8
                for (int e = 0; e < 8; e++)
                    K32(fa_kt8_dim)(kg + 8 * (d0 + e), gs, qt + (d0 + e) * ldqt, nr, ng, a);
            }
        }
        /* out by constant indices (a runtime bound on r would keep a[][] in memory) */
        float o[4][4][8];
        for (int r = 0; r < nr; r++)
            for (int g = 0; g < ng; g++)
                fa_store_f8(o[r][g], (D > FA_DCHUNK ? fa_load_f8(part[r][g]) + a[r][g]
                                                   : a[r][g]) * sc);
        for (int g = 0; g < ng; g++) {
            float* sg = s + 8 * (g0 + g) * lds;
            if (nr == 4 && nstore >= 4) {
                /* [key i: rows 0-3 | key i + 4: rows 0-3] */
                fa_vf8 t[4];
                K32(fa_transpose_y4)(fa_load_f8(o[0][g]), fa_load_f8(o[1][g]), fa_load_f8(o[2][g]),
                                     fa_load_f8(o[3][g]), t);
                for (int i = 0; i < 4; i++) {
                    float w[8];
                    fa_store_f8(w, t[i]);
                    memcpy(sg + i * lds, w, 4 * sizeof(float));
                    memcpy(sg + (i + 4) * lds, w + 4, 4 * sizeof(float));
                }
            } else {
                for (int r = 0; r < nr && r < nstore; r++)
                    for (int i = 0; i < 8; i++) sg[i * lds + r] = o[r][g][i];
            }
        }
    }
}

/* AVX2, npass x nr rows (nr = 2 or 4: GQA groups), 32 evenly spaced 16-bit keys, D a
 * multiple of 8 (up to FA_KT8_MAX_D).  The call's K is first transposed, still 16-bit,
 * into an L1 buffer (fa_kt8_transpose: 24 in-lane shuffles, 8 loads and 8 stores of 32
 * bytes per 8 keys x 16 dims), once for all its passes.  The score loop then takes per
 * dimension and group one 8-key load, widened as it is loaded (vcvtph2ps, or a
 * zero-extension and a shift), for nr broadcasts of q and nr FMAs: no shuffle shares the
 * FMAs' port.  Transposing 16-bit elements moves half the bytes of a float transpose and
 * needs no conversion before it.  (A single row keeps the in-loop transposes of
 * fa_score_keys32_body: one FMA per key vector leaves them time to hide the memory
 * reads, which a transpose up front exposes.)
 * Per score the same chain as the other kernels: acc += k[d] * q[d], chunk sums in order,
 * then * scale. */
FA_INLINE void K32(fa_score_keys32_kt8)(const KE* const* kr, ptrdiff_t ldk, const float* qt,
                                       ptrdiff_t ldqt, ptrdiff_t D, float scale, float* s,
                                       ptrdiff_t lds, int nstore, const char* const* pf,
                                       ptrdiff_t pf_bytes, int npass, const int nr)
{
    KE kh[32 * FA_KT8_MAX_D] __attribute__((aligned(32)));
    fa_kt8_transpose(kr, ldk, D, kh);
    fa_dec_pf pfs;   /* prefetch streams, see fa_dec_pf: issued by the first pass */
    fa_dec_pf_init(&pfs, pf, pf_bytes, (const char*)kr[0], ldk, sizeof(KE), D,
                   (nr >= 4 ? 2 : 1) * (D / 8));
    /* ldqt is one vector of lanes in decode tiles: as a constant, the score loop addresses
     * q from one pointer, where a variable ldqt takes a register per dimension of the
     * unrolled loop and those spill */
    for (int p = 0; p < npass; p++, qt += nr, s += nr, nstore -= nr) {
        if (ldqt == 8)
            K32(fa_kt8_pass)(kh, qt, 8, D, scale, s, lds, nstore, nr, p == 0 ? &pfs : NULL);
        else
            K32(fa_kt8_pass)(kh, qt, ldqt, D, scale, s, lds, nstore, nr, p == 0 ? &pfs : NULL);
    }
}
#endif

FA_INLINE void K32(fa_score_keys32_body)(const KE* const* kr, ptrdiff_t ldk, int nk,
                                      const float* qt, ptrdiff_t ldqt, ptrdiff_t D,
                                      float scale, float* s, ptrdiff_t lds, const int nr,
                                      int nstore, const char* const* pf, ptrdiff_t pf_bytes)
{
    /* groups of 8 keys per sweep over d: nr * ng = 4 accumulator chains (nr <= 4) */
    const int ng = nr >= 4 ? 1 : 4 / nr;
    const fa_vf8 sc = fa_bcast_f8(scale);
    fa_dec_pf pfs;   /* prefetch streams, see fa_dec_pf */
    fa_dec_pf_init(&pfs, pf, pf_bytes, (const char*)kr[0], ldk, sizeof(KE), D,
                   (D / 4) * ((((nk + 7) / 8) + ng - 1) / ng));
    for (int g0 = 0; g0 < 4 && 8 * g0 < nk; g0 += ng) {
        fa_vf8 a[4][8];   /* nr <= 4 is called; 8 keeps the unused 8-row wrapper in bounds */
        float part[4][8][8];   /* the sums of the chunks before the current one */
        for (int g = 0; g < ng; g++)
            for (int r = 0; r < nr; r++) a[g][r] = fa_bcast_f8(0);
#define FA_FOLD(d) \
        if ((d) && (d) % FA_DCHUNK == 0) \
            for (int g = 0; g < ng; g++) \
                for (int r = 0; r < nr; r++) { \
                    fa_store_f8(part[g][r], (d) == FA_DCHUNK ? a[g][r] \
                                                            : fa_load_f8(part[g][r]) + a[g][r]); \
                    a[g][r] = fa_bcast_f8(0); \
                }
        ptrdiff_t d0 = 0;
        for (; d0 + 4 <= D; d0 += 4) {
            FA_FOLD(d0)
            fa_dec_pf_step(&pfs);
            /* unrolled, so that a[g] stays in registers (a loop over g kept the accumulator
             * array in memory: a store and reload in every step of every FMA chain) */
#pragma GCC unroll 4
            for (int g = 0; g < ng; g++)
                K32(fa_keys32_step)(kr, ldk, g0 + g, d0, qt, ldqt, nr, a[g]);
        }
        for (; d0 < D; d0++) {   /* D % 4 leftover dimensions, lane-gathered */
            FA_FOLD(d0)
            const float* qd = qt + d0 * ldqt;
            for (int g = 0; g < ng; g++) {
                float col[8];
                for (int i = 0; i < 8; i++) col[i] = KE_SCALAR(kr[8 * (g0 + g) + i][d0]);
                const fa_vf8 kd = fa_load_f8(col);
                for (int r = 0; r < nr; r++) a[g][r] += fa_bcast_f8(qd[r]) * kd;
            }
        }
        /* Out through a buffer indexed by constants only: a runtime bound on r here (nstore)
         * kept the accumulator array in memory, a store on every step of every FMA chain. */
#undef FA_FOLD
        float out[4][8][8];
        for (int g = 0; g < ng; g++)
            for (int r = 0; r < nr; r++)
                fa_store_f8(out[g][r], (D > FA_DCHUNK ? fa_load_f8(part[g][r]) + a[g][r]
                                                     : a[g][r]) * sc);
        for (int g = 0; g < ng; g++) {
            const int kg = nk - 8 * (g0 + g) < 8 ? nk - 8 * (g0 + g) : 8;
            for (int r = 0; r < nr && r < nstore; r++)
                for (int t = 0; t < kg; t++) s[(8 * (g0 + g) + t) * lds + r] = out[g][r][t];
        }
    }
}
/* ldk != 0: kr[t] = kr[0] + t * ldk for all 32 rows (a full call of evenly spaced keys),
 * the common case; the body is instantiated for it and for arbitrary row pointers. */
FA_INLINE void K32(fa_score_keys32)(const KE* const* kr, ptrdiff_t ldk, int nk,
                                 const float* qt, ptrdiff_t ldqt, ptrdiff_t D, float scale,
                                 float* s, ptrdiff_t lds, const int nr, int nstore,
                                 const char* const* pf, ptrdiff_t pf_bytes)
{
#if defined(KE_LOAD8W)
    if (ldk && nk == 32 && nr == 2 && D % 8 == 0 && D <= FA_KT8_MAX_D) {
        K32(fa_score_keys32_kt8)(kr, ldk, qt, ldqt, D, scale, s, lds, nstore, pf, pf_bytes,
                                 1, nr);
        return;
    }
#endif
    if (ldk)
        K32(fa_score_keys32_body)(kr, ldk, nk, qt, ldqt, D, scale, s, lds, nr, nstore, pf, pf_bytes);
    else
        K32(fa_score_keys32_body)(kr, 0, nk, qt, ldqt, D, scale, s, lds, nr, nstore, pf, pf_bytes);
}
#if defined(__AVX__)
/* AVX2, 4 rows (a GQA group of 4 query heads), 32 evenly spaced keys: two sweeps of 16
 * keys, so that 4 rows x 2 groups = 8 accumulator chains are in flight -- as many as
 * the FMA latency x throughput of a Zen 3 or Skylake core needs -- while the 8
 * accumulators, the 4 half-transposed vectors of one group and a broadcast still fit 16
 * ymm registers.  The 8 rows of a group are addressed from two base pointers and the
 * stride (b, b + 3 ldk), so no row pointer lives in memory.  It is bound by loads more
 * than by FMAs (16 broadcasts of q and 8 half-row loads per 16 FMAs).
 * Per score: the same chain acc += k[d] * q[d], d = 0, 1, ... then * scale. */
FA_INLINE void K32(fa_keys8x4s_r4)(const KE* b, const KE* b3, ptrdiff_t ldk,
                                const float* qt, ptrdiff_t ldqt, fa_vf8* a)
{
    /* y_i = [k_i | k_(i+4)] over 4 dims: rows b, b+ldk, b+2ldk, b3 | b+4ldk, b3+2ldk, ... */
#define FA_Y FA_YROWS
    const fa_vf8 y0 = FA_Y(b, b + 4 * ldk), y1 = FA_Y(b + ldk, b3 + 2 * ldk);
    const fa_vf8 u0 = __builtin_shufflevector(y0, y1, 0, 8, 1, 9, 4, 12, 5, 13);
    const fa_vf8 u1 = __builtin_shufflevector(y0, y1, 2, 10, 3, 11, 6, 14, 7, 15);
    const fa_vf8 y2 = FA_Y(b + 2 * ldk, b3 + 3 * ldk), y3 = FA_Y(b3, b3 + 4 * ldk);
#undef FA_Y
    const fa_vf8 u2 = __builtin_shufflevector(y2, y3, 0, 8, 1, 9, 4, 12, 5, 13);
    const fa_vf8 u3 = __builtin_shufflevector(y2, y3, 2, 10, 3, 11, 6, 14, 7, 15);
    fa_vf8 t;
#define FA_FMA4(i) \
    a[0] += fa_bcast_f8(qt[(i) * ldqt + 0]) * t; a[1] += fa_bcast_f8(qt[(i) * ldqt + 1]) * t; \
    a[2] += fa_bcast_f8(qt[(i) * ldqt + 2]) * t; a[3] += fa_bcast_f8(qt[(i) * ldqt + 3]) * t;
    t = __builtin_shufflevector(u0, u2, 0, 1, 8, 9, 4, 5, 12, 13); FA_FMA4(0)
    t = __builtin_shufflevector(u0, u2, 2, 3, 10, 11, 6, 7, 14, 15); FA_FMA4(1)
    t = __builtin_shufflevector(u1, u3, 0, 1, 8, 9, 4, 5, 12, 13); FA_FMA4(2)
    t = __builtin_shufflevector(u1, u3, 2, 3, 10, 11, 6, 7, 14, 15); FA_FMA4(3)
#undef FA_FMA4
}


FA_INLINE void K32(fa_score_keys32_wide)(const KE* const* kr, ptrdiff_t ldk, int nk,
                                      const float* qt, ptrdiff_t ldqt, ptrdiff_t D,
                                      float scale, float* s, ptrdiff_t lds, const int nr,
                                      int nstore, const char* const* pf, ptrdiff_t pf_bytes)
{
    if (nr != 4 || !ldk || nk != 32 || D % 4) {
        K32(fa_score_keys32)(kr, ldk, nk, qt, ldqt, D, scale, s, lds, nr, nstore, pf, pf_bytes);
        return;
    }
    fa_dec_pf pfs;   /* prefetch streams, see fa_dec_pf */
    fa_dec_pf_init(&pfs, pf, pf_bytes, (const char*)kr[0], ldk, sizeof(KE), D, 2 * (D / 4));
    const fa_vf8 sc = fa_bcast_f8(scale);
    for (int h = 0; h < 2; h++) {
        const KE* b = kr[0] + 16 * h * ldk;        /* group 0: keys 16h .. 16h+7 */
        const KE* c = b + 8 * ldk;                 /* group 1: the next 8 */
        fa_vf8 a0[4], a1[4];
        float part[4][16];   /* the sums of the chunks before the current one */
        for (int r = 0; r < 4; r++) a0[r] = a1[r] = fa_bcast_f8(0);
        for (ptrdiff_t d0 = 0; d0 < D; d0 += 4) {
            if (d0 && d0 % FA_DCHUNK == 0)
                for (int r = 0; r < 4; r++) {
                    const int first = d0 == FA_DCHUNK;
                    fa_store_f8(part[r], first ? a0[r] : fa_load_f8(part[r]) + a0[r]);
                    fa_store_f8(part[r] + 8, first ? a1[r] : fa_load_f8(part[r] + 8) + a1[r]);
                    a0[r] = a1[r] = fa_bcast_f8(0);
                }
            fa_dec_pf_step(&pfs);
            const float* q = qt + d0 * ldqt;
            K32(fa_keys8x4s_r4)(b + d0, b + 3 * ldk + d0, ldk, q, ldqt, a0);
            /* an opaque copy of q: the second group broadcasts q again instead of the
             * compiler keeping 16 broadcasts alive across both groups (they spilled) */
            __asm__("" : "+r"(q));
            K32(fa_keys8x4s_r4)(c + d0, c + 3 * ldk + d0, ldk, q, ldqt, a1);
        }
        /* all 4 rows out by constant indices (a runtime bound on r would keep the
         * accumulator arrays in memory, a store and reload on every FMA chain step) */
        float o[4][16];
        for (int r = 0; r < 4; r++) {
            if (D > FA_DCHUNK) {
                a0[r] += fa_load_f8(part[r]);
                a1[r] += fa_load_f8(part[r] + 8);
            }
            fa_store_f8(o[r], a0[r] * sc);
            fa_store_f8(o[r] + 8, a1[r] * sc);
        }
        for (int r = 0; r < nstore && r < 4; r++)
            for (int t = 0; t < 16; t++) s[(16 * h + t) * lds + r] = o[r][t];
    }
}
#endif
#undef KE
#undef K32
#undef KE_SCALAR
#undef FA_YROWS
#undef KE_LOAD8W
