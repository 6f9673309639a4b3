/*
 * fa_amx_kernels.h -- the AMX tile kernels, written once over the tile operations
 * FA_TILE_LOAD/STORE/ZERO/DP (fa_amx.h includes this file twice: on the model, on the
 * hardware), called between fa_amx_begin and fa_amx_end (FA_TILE_CONFIG checks that on
 * the model).  Eight tiles of 16 x 64 bytes: 0-3 sums (2 x 2), 4-5 A, 6-7 B.  A second
 * group of rows or keys with nothing in it is left out of the step, so that no tile
 * reads past the data.  The chains are fa_amx.h's canonical ones.
 */

/*
 * One step of every kernel, on the 2 x 2 sum tiles: cb[2i + j] = A_i . B_j from zero,
 * over nchunks chunks of 32 along the sum.  A_i: 16 rows of bfloat16 at a_i, sa_i bytes
 * apart, the next chunk astep bytes on; B_j: 16 pair rows at b_j, sb bytes apart, the
 * next chunk bstep bytes on.  The loads go between the products, as the tiles free up.
 * Without two_a (two_b) the second group of rows (columns) is left out: cb[2] and cb[3]
 * (cb[1] and cb[3]) are not written, which spares a decode row's tile the products and
 * stores of a group that would repeat the first.
 */
FA_AMX_STEP void FA_AMX_NAME(fa_amx_2x2)(const char* a0, ptrdiff_t sa0, const char* a1,
                                         ptrdiff_t sa1, ptrdiff_t astep, const char* b0,
                                         const char* b1, ptrdiff_t sb, ptrdiff_t bstep,
                                         ptrdiff_t nchunks, const int two_a, const int two_b,
                                         float cb[4][16 * 16])
{
    FA_TILE_STATE;
    FA_TILE_CONFIG();
    FA_TILE_ZERO(0);
    if (two_b) FA_TILE_ZERO(1);
    if (two_a) FA_TILE_ZERO(2);
    if (two_a && two_b) FA_TILE_ZERO(3);
    for (ptrdiff_t kc = 0; kc < nchunks; kc++) {
        FA_TILE_LOAD(4, a0 + kc * astep, sa0);
        FA_TILE_LOAD(6, b0 + kc * bstep, sb);
        FA_TILE_DP(0, 4, 6);
        if (two_b) {
            FA_TILE_LOAD(7, b1 + kc * bstep, sb);
            FA_TILE_DP(1, 4, 7);
        }
        if (two_a) {
            FA_TILE_LOAD(5, a1 + kc * astep, sa1);
            FA_TILE_DP(2, 5, 6);
            if (two_b) FA_TILE_DP(3, 5, 7);
        }
    }
    FA_TILE_STORE(0, cb[0], 64);
    if (two_b) FA_TILE_STORE(1, cb[1], 64);
    if (two_a) FA_TILE_STORE(2, cb[2], 64);
    if (two_a && two_b) FA_TILE_STORE(3, cb[3], 64);
}

/*
 * Scores of a key block against the tile's rows, s[j*lds + r] = scale * K[j] . Q[r] for
 * keys j < nj (at most 64) and rows r < nlanes (a multiple of 16), 32 dims a step (D a
 * multiple of 32).  A = 16 key rows, B = Q^T in pairs of dims (qt[p*ldqt + r]).  Key rows
 * evenly spaced are read where they are; others (a short group, rows from pages) are
 * staged whole in kst (2 x 16 x D values), zero rows past nj.
 */
FA_AMX_FN void FA_AMX_NAME(fa_amx_scores)(const uint16_t* const* kr, ptrdiff_t nj,
                                          const uint32_t* qt, ptrdiff_t ldqt,
                                          ptrdiff_t nlanes, ptrdiff_t D, float scale,
                                          float* s, ptrdiff_t lds, uint16_t* kst,
                                          const uint16_t* zrow)
{
    float cb[4][16 * 16];
    const __m512 sc = _mm512_set1_ps(scale);
    for (ptrdiff_t k0 = 0; k0 < nj; k0 += 32) {
        const uint16_t* base[2];
        ptrdiff_t stride[2], nk[2];
        for (int g = 0; g < 2; g++) {
            const ptrdiff_t j = k0 + 16 * g;
            nk[g] = j >= nj ? 0 : nj - j < 16 ? nj - j : 16;
            if (nk[g] == 16 && fa_amx_even_rows(kr + j, &stride[g])) {
                base[g] = kr[j];
            } else if (nk[g] > 0) {
                uint16_t* dst = kst + g * 16 * D;
                for (int u = 0; u < 16; u++)
                    memcpy(dst + u * D, u < nk[g] ? kr[j + u] : zrow, 2 * D);
                base[g] = dst;
                stride[g] = 2 * D;
            } else {
                base[g] = base[0];
                stride[g] = stride[0];
            }
        }
        for (ptrdiff_t r0 = 0; r0 < nlanes; r0 += 32) {
            const ptrdiff_t r1 = r0 + 16 < nlanes ? r0 + 16 : r0;
            FA_AMX_NAME(fa_amx_2x2)((const char*) base[0], stride[0],
                                    (const char*) base[1], stride[1], 64,
                                    (const char*) (qt + r0), (const char*) (qt + r1),
                                    4 * ldqt, 64 * ldqt, D / 32, nk[1] > 0, r1 != r0, cb);
            for (int g = 0; g < 2; g++)
                for (int h = 0; h < (r1 != r0 ? 2 : 1); h++)
                    for (ptrdiff_t u = 0; u < nk[g]; u++) {
                        const __m512 c = _mm512_loadu_ps(cb[2 * g + h] + 16 * u);
                        _mm512_storeu_ps(s + (k0 + 16 * g + u) * lds + (h ? r1 : r0),
                                         _mm512_mul_ps(c, sc));
                    }
        }
    }
}

/*
 * The 2 x 2 sum tiles of rows [m0, m0 + 32) and columns [n0, n0 + 32) of A . B, A rows of
 * bfloat16 (a[m*lda + k]) and B in pairs of rows (b[kp*ldb + n]), over nchunks chunks of
 * 32 along k; at the end of the M rows the second group of rows is left out (m1 = m0:
 * cb[2] and cb[3] unwritten).  Returns the rows of the second group (m1) in *m1.
 */
FA_AMX_STEP void FA_AMX_NAME(fa_amx_rows_2x2)(const uint16_t* a, ptrdiff_t lda,
                                              ptrdiff_t M, ptrdiff_t m0, ptrdiff_t nchunks,
                                              const uint32_t* b, ptrdiff_t ldb,
                                              ptrdiff_t n0, float cb[4][16 * 16],
                                              ptrdiff_t* m1)
{
    *m1 = m0 + 16 < M ? m0 + 16 : m0;
    FA_AMX_NAME(fa_amx_2x2)((const char*) (a + m0 * lda), 2 * lda,
                            (const char*) (a + *m1 * lda), 2 * lda, 64,
                            (const char*) (b + n0), (const char*) (b + n0 + 16), 4 * ldb,
                            64 * ldb, nchunks, *m1 != m0, 1, cb);
}

/*
 * acc = acc * alpha + P V for rows r < nrows (nlanes, a multiple of 16, rows of pr) over
 * nchunks chunks of 32 keys: A = P rows in bfloat16 (pr[r*ldpr + j], zero past the
 * block's keys), B = V in pairs of keys (vp[jp*Dv + c], zero pairs past them), Dv a
 * multiple of 32.
 */
FA_AMX_FN void FA_AMX_NAME(fa_amx_pv)(const uint16_t* pr, ptrdiff_t ldpr, ptrdiff_t nchunks,
                                      ptrdiff_t nlanes, ptrdiff_t nrows, const uint32_t* vp,
                                      ptrdiff_t Dv, float* acc, ptrdiff_t ldacc,
                                      const float* alpha)
{
    float cb[4][16 * 16];
    ptrdiff_t r1;
    for (ptrdiff_t r0 = 0; r0 < nrows; r0 += 32)
        for (ptrdiff_t c0 = 0; c0 < Dv; c0 += 32) {
            FA_AMX_NAME(fa_amx_rows_2x2)(pr, ldpr, nlanes, r0, nchunks, vp, Dv, c0, cb,
                                         &r1);
            const ptrdiff_t nr0 = nrows - r0 < 16 ? nrows - r0 : 16;
            const ptrdiff_t nr1 = r1 == r0 ? 0 : nrows - r1 < 16 ? nrows - r1 : 16;
            fa_amx_acc_update(acc + r0 * ldacc + c0, ldacc, alpha + r0, cb[0], cb[1], nr0);
            if (nr1 > 0)
                fa_amx_acc_update(acc + r1 * ldacc + c0, ldacc, alpha + r1, cb[2], cb[3],
                                  nr1);
        }
}

/*
 * c[m*ldc + n] = sum over k of A[m][k] B[k][n], overwritten, for rows m < M and columns
 * n < N (a multiple of 32), over nchunks chunks of 32 along k: A = rows of bfloat16
 * (a[m*lda + k], rows up to M rounded up to 16 readable, zero past the real k), B = pairs
 * of its rows (b[kp*ldb + n], zero pairs past the real k).  The backward's dV, dK (A = P^T
 * or dS^T, B = dO or Q) and dQ (A = dS, B = K).
 */
FA_AMX_FN void FA_AMX_NAME(fa_amx_gemm)(const uint16_t* a, ptrdiff_t lda, ptrdiff_t M,
                                        ptrdiff_t nchunks, const uint32_t* b, ptrdiff_t ldb,
                                        ptrdiff_t N, float* c, ptrdiff_t ldc)
{
    float cb[4][16 * 16];
    ptrdiff_t m1;
    for (ptrdiff_t m0 = 0; m0 < M; m0 += 32)
        for (ptrdiff_t n0 = 0; n0 < N; n0 += 32) {
            FA_AMX_NAME(fa_amx_rows_2x2)(a, lda, M, m0, nchunks, b, ldb, n0, cb, &m1);
            for (ptrdiff_t i = 0; i < 16 && m0 + i < M; i++) {
                memcpy(c + (m0 + i) * ldc + n0, cb[0] + 16 * i, 64);
                memcpy(c + (m0 + i) * ldc + n0 + 16, cb[1] + 16 * i, 64);
            }
            for (ptrdiff_t i = 0; m1 != m0 && i < 16 && m1 + i < M; i++) {
                memcpy(c + (m1 + i) * ldc + n0, cb[2] + 16 * i, 64);
                memcpy(c + (m1 + i) * ldc + n0 + 16, cb[3] + 16 * i, 64);
            }
        }
}

#undef FA_AMX_NAME
#undef FA_AMX_FN
#undef FA_AMX_STEP
#undef FA_TILE_STATE
#undef FA_TILE_CONFIG
#undef FA_TILE_LOAD
#undef FA_TILE_STORE
#undef FA_TILE_ZERO
#undef FA_TILE_DP
