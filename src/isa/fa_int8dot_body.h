/*
 * fa_int8dot_body.h -- the int8 score kernels of fa_int8dot.h, one set per way of taking
 * a block's products, included once per way with
 *     FA_I8B_VNNI   1: vpdpbusd; 0: vpmaddubsw and vpmaddwd
 *     FA_I8B(name)  the set's names (name_vnni, name_madd)
 *     FA_I8B_ATTR   the set's target attribute (VNNI's own, or none: the module's flags)
 * Both ways sum each block exactly in int32 and share everything after, so their scores
 * have the same bits.
 */

#define FA_I8B_INLINE static inline __attribute__((always_inline)) FA_I8B_ATTR
#define FA_I8B_NOINLINE static __attribute__((noinline, unused)) FA_I8B_ATTR

/* isum[r] (r < nr) = block b's exact int32 sums of q row r against the 8 transposed key
 * vectors t, the excess of the unsigned key bytes taken off.  One or two rows keep two
 * sums per row, the even and the odd vectors' (an exact split), so that the products'
 * latency overlaps. */
FA_I8B_INLINE void FA_I8B(fa_i8_block_sums)(const int kind, const fa_i8v t[8],
                                             const int8_t* qi, const int32_t* qs, ptrdiff_t D,
                                             ptrdiff_t b, const int nr, fa_i8v* isum)
{
    const ptrdiff_t nb = D / 32;
    const int nsum = nr >= 4 ? 1 : 2;
    fa_i8v part[FA_I8_MAX_ROWS][2];
    for (int r = 0; r < nr; r++) part[r][0] = part[r][1] = fa_i8_zero();
#if FA_I8B_VNNI
    /* q8_0's k read as k + 128, q4_0's nibble as stored (k + 8) */
    const int excess = kind == FA_STORE_Q8_0 ? 128 : 8;
    for (int j = 0; j < 8; j++) {
        const fa_i8v k = kind == FA_STORE_Q8_0 ? fa_i8_bias(t[j]) : t[j];
        for (int r = 0; r < nr; r++)
            part[r][j % nsum] = fa_i8_dot(part[r][j % nsum], k, qi + r * D + 32 * b + 4 * j);
    }
#else
    const int excess = 0;   /* q8_0 as |k| and sign; q4_0 takes its excess off itself */
    if (kind == FA_STORE_Q8_0) {
        /* |k| against q with k's sign: each 16-bit pair sum within 2 * 128 * 127, widened
         * to 32 bits before the next is added */
        for (int j = 0; j < 8; j++) {
            const fa_i8v ka = fa_i8_abs(t[j]);
            for (int r = 0; r < nr; r++) {
                const fa_i8v q = fa_i8_q4(qi + r * D + 32 * b + 4 * j);
                part[r][j % nsum] = fa_i8_add(part[r][j % nsum],
                                              fa_i8_widen16(fa_i8_pairs_signed(ka, t[j], q)));
            }
        }
    } else {
        /* nibbles of at most 15: a whole block's pairs summed in 16 bits (at most
         * 16 * 15 * 127 a lane), widened once */
        for (int j = 0; j < 8; j++)
            for (int r = 0; r < nr; r++) {
                const fa_i8v q = fa_i8_q4(qi + r * D + 32 * b + 4 * j);
                part[r][j % nsum] = fa_i8_add16(part[r][j % nsum], fa_i8_pairs(t[j], q));
            }
        for (int r = 0; r < nr; r++)
            isum[r] = fa_i8_sub(fa_i8_widen16(nsum == 2 ? fa_i8_add16(part[r][0], part[r][1])
                                                         : part[r][0]), qs[r * nb + b] * 8);
        return;
    }
#endif
    for (int r = 0; r < nr; r++) {
        const fa_i8v sum = nsum == 2 ? fa_i8_add(part[r][0], part[r][1]) : part[r][0];
        isum[r] = excess ? fa_i8_sub(sum, qs[r * nb + b] * excess) : sum;
    }
}

/*
 * Scores of FA_I8_KEYS keys (the lanes) against nr quantised q rows (the chain at the top
 * of fa_int8dot.h):
 *   s[t*lds + r] = score of key kr[t] and row r,   t < nk, r < min(nr, nstore)
 * ksc[b * ldksc + t]: the keys' block scales in float32 (fa_quant_rows).  Keys past nk
 * must be readable rows (the workspace's zero row); they are not stored.  Requested as
 * the blocks go: pf[0 .. npf), the next block's K rows at these keys, into L2; l1[0 ..
 * nl1), the next call's, into L1.
 */
FA_I8B_INLINE void FA_I8B(fa_score_int8_body)(const int kind, const uint8_t* const* kr,
                                               const float* ksc, ptrdiff_t ldksc, int nk,
                                               const int8_t* qi, const float* qd,
                                               const int32_t* qs, ptrdiff_t D, float scale,
                                               float* s, ptrdiff_t lds, const int nr,
                                               int nstore, const char* const* pf, int npf,
                                               const char* const* l1, int nl1)
{
    const ptrdiff_t nb = D / 32, row_bytes = fa_quant_row_bytes(kind, D);
    const ptrdiff_t l2_rows = (npf + nb - 1) / nb, l1_rows = (nl1 + nb - 1) / nb;
    fa_i8f acc[FA_I8_MAX_ROWS];
    for (int r = 0; r < nr; r++) acc[r] = fa_i8_fzero();
    for (ptrdiff_t b = 0; b < nb; b++) {
        fa_quant_prefetch_rows(pf, b * l2_rows, fa_min_pd(npf, (b + 1) * l2_rows), npf,
                               row_bytes, 2);
        fa_quant_prefetch_rows(l1, b * l1_rows, fa_min_pd(nl1, (b + 1) * l1_rows), nl1,
                               row_bytes, 3);
        fa_i8v t[8], isum[FA_I8_MAX_ROWS];
        if (kind == FA_STORE_Q8_0) fa_i8_keys_q8_0(kr, b, t);
        else fa_i8_keys_q4_0(kr, b, t);
        FA_I8B(fa_i8_block_sums)(kind, t, qi, qs, D, b, nr, isum);
        const fa_i8f dk = fa_i8_fload(ksc + b * ldksc);
        for (int r = 0; r < nr; r++)
            acc[r] = fa_i8_fma(isum[r], fa_i8_scaled(dk, qd[r * nb + b]), acc[r]);
    }
    for (int r = 0; r < nr && r < nstore; r++) {
        float out[FA_I8_KEYS];
        fa_i8_fstore(out, fa_i8_scaled(acc[r], scale));
        for (int t = 0; t < FA_I8_KEYS && t < nk; t++) s[t * lds + r] = out[t];
    }
}

#define FA_I8B_NR(NAME, KIND, NR) \
FA_I8B_NOINLINE void FA_I8B(fa_score_int8_##NAME##_r##NR)(FA_SCORE_INT8_ARGS) \
{ \
    FA_I8B(fa_score_int8_body)(KIND, kr, ksc, ldksc, nk, qi, qd, qs, D, scale, s, lds, NR, \
                               nstore, pf, npf, l1, nl1); \
}
#if FA_I8_MAX_ROWS == 8
#define FA_I8B_KIND(NAME, KIND) FA_I8B_NR(NAME, KIND, 1) FA_I8B_NR(NAME, KIND, 2) \
    FA_I8B_NR(NAME, KIND, 4) FA_I8B_NR(NAME, KIND, 8)
#define FA_I8B_CALL8(NAME) if (nr == 8) FA_I8B_CALL(NAME, 8); else
#else
#define FA_I8B_KIND(NAME, KIND) FA_I8B_NR(NAME, KIND, 1) FA_I8B_NR(NAME, KIND, 2) \
    FA_I8B_NR(NAME, KIND, 4)
#define FA_I8B_CALL8(NAME)
#endif
FA_I8B_KIND(q8_0, FA_STORE_Q8_0)
FA_I8B_KIND(q4_0, FA_STORE_Q4_0)

/* The set's score pass: nr rows (1, 2, 4 or FA_I8_MAX_ROWS) of `kind` (q8_0 or q4_0). */
static void FA_I8B(fa_score_int8)(int kind, int nr, FA_SCORE_INT8_ARGS)
{
#define FA_I8B_CALL(NAME, NR) FA_I8B(fa_score_int8_##NAME##_r##NR)(FA_SCORE_INT8_PASS)
#define FA_I8B_CASE(NAME, KIND) \
    case KIND: \
        FA_I8B_CALL8(NAME) \
        if (nr == 4) FA_I8B_CALL(NAME, 4); \
        else if (nr == 2) FA_I8B_CALL(NAME, 2); \
        else FA_I8B_CALL(NAME, 1); \
        return;
    switch (kind) { FA_I8B_CASE(q8_0, FA_STORE_Q8_0) FA_I8B_CASE(q4_0, FA_STORE_Q4_0) }
#undef FA_I8B_CASE
#undef FA_I8B_CALL
}

#undef FA_I8B_KIND
#undef FA_I8B_CALL8
#undef FA_I8B_NR
#undef FA_I8B_NOINLINE
#undef FA_I8B_INLINE
#undef FA_I8B_ATTR
#undef FA_I8B
#undef FA_I8B_VNNI
