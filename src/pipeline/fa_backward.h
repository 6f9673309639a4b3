/*
 * fa_backward.h -- the elementwise micro-kernels of the backward pass (src/pipeline/_backward.pxi).
 * Its products (S, dP = dO V^T, dV += P^T dO, dK += dS^T Q, dQ += dS K) run on the
 * forward's score and output micro-tiles; what is new is here:
 *
 *   fa_bwd_ds        P = 2^(S - lse), dS = P (dP - Delta) [times the softcap's slope],
 *                    and the rows' running sums of P
 *   fa_softcap_slope 1 - tanh^2 of capped scores: d(capped) / d(raw)
 *   fa_bwd_dot       a row's Delta: dout . out in a fixed order
 *   fa_bwd_transpose a block of S^T (query rows as lanes) to rows of keys, for the
 *                    products that reduce over query rows (dV, dK)
 *
 * Layout as in fa_tile_impl.h: s[j * lds + r], key j, query row r (the lanes).
 */
#ifndef FA_BACKWARD_H
#define FA_BACKWARD_H

#include "fa_kernels.h"

/* Keys of one dK/dV work item at most (a multiple of FA_BK): the rows of Q and dO it
 * packs serve that many keys. */
#define FA_BKV_MAX 256

/* acc + x y as one FMA where the ISA has one, in every compiler.  Written `acc += x * y`, a
 * scalar loop's sum rounds by the loop's length in GCC: from a few iterations on, it
 * multiplies in vectors and adds the products in order, unfused (Clang fuses each). */
#if FA_HAS_FMA
#define FA_MUL_ADD(x, y, acc) \
    _Generic((acc), float: __builtin_fmaf, double: __builtin_fma)(x, y, acc)
#else
#define FA_MUL_ADD(x, y, acc) ((acc) + (x) * (y))
#endif

#define FA_BWD_KERNELS(SUF, T, V, VL, LOAD, STORE, BCAST, EXP2, LOAD_TRANSPOSE)                              \
/* Keys [ja, jz) of nvec vectors of rows: s <- P = 2^(s - lse2), dp <- dS =                   \
 * P (dp - delta) (times slope[j] when slope is not NULL); both 0 for the other keys of      \
 * [0, nj), which no row of the vectors sees (their dp was never computed).  psum[r] += P    \
 * of row r's keys, in key order: a row's sum over all its keys is 1 up to lse's rounding. */ \
static void fa_bwd_ds_##SUF(T* s, T* dp, const T* slope, ptrdiff_t lds, ptrdiff_t nj,        \
                            ptrdiff_t ja, ptrdiff_t jz, int nvec, const T* lse2,              \
                            const T* delta, T* psum)                                          \
{                                                                                             \
    const V zero = BCAST(0);                                                                  \
    for (int t = 0; t < nvec; t++) {                                                          \
        const V l2 = LOAD(lse2 + t * VL), dl = LOAD(delta + t * VL);                          \
        V sum = LOAD(psum + t * VL);                                                          \
        for (ptrdiff_t j = 0; j < nj; j++) {                                                  \
            T* ps = s + j * lds + t * VL;                                                     \
            T* pd = dp + j * lds + t * VL;                                                    \
            if (j < ja || j >= jz) {                                                          \
                STORE(ps, zero);                                                              \
                STORE(pd, zero);                                                              \
                continue;                                                                     \
            }                                                                                 \
            const V p = EXP2(LOAD(ps) - l2);                                                  \
            V ds = p * (LOAD(pd) - dl);                                                       \
            if (slope) ds = ds * LOAD(slope + j * lds + t * VL);                              \
            sum += p;                                                                         \
            STORE(ps, p);                                                                     \
            STORE(pd, ds);                                                                    \
        }                                                                                     \
        STORE(psum + t * VL, sum);                                                            \
    }                                                                                         \
}                                                                                             \
                                                                                              \
/* sum_c a[c] b[c], c < n, in one fixed order: VL partial sums (c mod VL), added in lane  \
 * order, then the last n mod VL products. */                                               \
static T fa_bwd_dot_##SUF(const T* a, const T* b, ptrdiff_t n)                              \
{                                                                                             \
    V acc = BCAST(0);                                                                         \
    T lanes[VL], sum = 0;                                                                     \
    ptrdiff_t c = 0;                                                                          \
    for (; c + VL <= n; c += VL) acc += LOAD(a + c) * LOAD(b + c);                            \
    STORE(lanes, acc);                                                                        \
    for (int u = 0; u < VL; u++) sum += lanes[u];                                             \
    for (; c < n; c++) sum = FA_MUL_ADD(a[c], b[c], sum);                                      \
    return sum;                                                                               \
}                                                                                             \
                                                                                              \
/* g <- 1 - tanh^2 = -u (2 + u) for nk keys of nvec vectors of capped scores stored as    \
 * s = c u, u = tanh(x / c) - 1 (see fa_softcap_f): near the cap, where the scores that     \
 * weigh are, u is small and kept to a few units in its last place, where 1 - tanh^2 from    \
 * tanh itself would cancel. */                                                               \
static void fa_softcap_slope_##SUF(const T* s, T* g, ptrdiff_t lds, ptrdiff_t nk, int nvec,  \
                                   T c)                                                       \
{                                                                                             \
    const V inv = BCAST((T)1 / c), two = BCAST(2);                                            \
    for (ptrdiff_t j = 0; j < nk; j++)                                                        \
        for (int t = 0; t < nvec; t++) {                                                      \
            const V u = LOAD(s + j * lds + t * VL) * inv;                                     \
            STORE(g + j * lds + t * VL, -u * (two + u));                                      \
        }                                                                                     \
}                                                                                             \
                                                                                              \
/* dst[r * ldd + j] = src[j * lds + r] for rows r < nrows, keys j < nj, and 0 for keys       \
 * [nj, nj_pad): whole micro-tiles of keys read the padding.  VL x VL blocks are          \
 * transposed in registers. */                                                                \
static void fa_bwd_transpose_##SUF(const T* src, ptrdiff_t lds, ptrdiff_t nj,                \
                                   ptrdiff_t nj_pad, ptrdiff_t nrows, T* dst, ptrdiff_t ldd) \
{                                                                                             \
    const T* rows[VL];                                                                        \
    V x[VL];                                                                                  \
    ptrdiff_t j0 = 0, r0;                                                                     \
    for (; j0 + VL <= nj; j0 += VL) {                                                         \
        for (int u = 0; u < VL; u++) rows[u] = src + (j0 + u) * lds;                          \
        for (r0 = 0; r0 + VL <= nrows; r0 += VL) {                                            \
            LOAD_TRANSPOSE(rows, r0, x);                                                      \
            for (int i = 0; i < VL; i++) STORE(dst + (r0 + i) * ldd + j0, x[i]);              \
        }                                                                                     \
        for (; r0 < nrows; r0++)                                                              \
            for (int u = 0; u < VL; u++) dst[r0 * ldd + j0 + u] = rows[u][r0];                \
    }                                                                                         \
    for (ptrdiff_t r = 0; r < nrows; r++) {                                                   \
        for (ptrdiff_t j = j0; j < nj; j++) dst[r * ldd + j] = src[j * lds + r];              \
        for (ptrdiff_t j = nj; j < nj_pad; j++) dst[r * ldd + j] = 0;                         \
    }                                                                                         \
}

FA_BWD_KERNELS(f, float, fa_vf, FA_VL_F, fa_load_f, fa_store_f, fa_bcast_f, fa_exp2_f,
               fa_load_transpose_vf)
FA_BWD_KERNELS(d, double, fa_vd, FA_VL_D, fa_load_d, fa_store_d, fa_bcast_d, fa_exp2_d,
               fa_load_transpose_vd)
#undef FA_BWD_KERNELS

#endif /* FA_BACKWARD_H */
