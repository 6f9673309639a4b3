/* fa_transpose.h -- in-register transposes of VL x VL blocks, for the decode score kernel
 * (keys as lanes).  Hand-maintained: each stage swaps the off-diagonal b x b blocks of
 * every 2b x 2b block, b = VL/2 .. 1, one __builtin_shufflevector pair per swap (the
 * index lists follow that rule; edit them together).  Only fa_load_transpose_vf/vd are
 * used by the kernels. */
#ifndef FA_TRANSPOSE_H
#define FA_TRANSPOSE_H
#include "fa_simd.h"
#if FA_VBYTES == 64
/* The last two stages (b = 2, 1) of the 16x16 float transpose; the first two are done by
 * the loads in fa_load_transpose_vf below. */
FA_INLINE void fa_transpose_vf_last2(fa_vf* r)
{
    /* b = 2 */
    { fa_vf lo = r[0], hi = r[2];
      r[0] = __builtin_shufflevector(lo, hi, 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29);
      r[2] = __builtin_shufflevector(lo, hi, 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31); }
    { fa_vf lo = r[1], hi = r[3];
      r[1] = __builtin_shufflevector(lo, hi, 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29);
      r[3] = __builtin_shufflevector(lo, hi, 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31); }
    { fa_vf lo = r[4], hi = r[6];
      r[4] = __builtin_shufflevector(lo, hi, 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29);
      r[6] = __builtin_shufflevector(lo, hi, 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31); }
    { fa_vf lo = r[5], hi = r[7];
      r[5] = __builtin_shufflevector(lo, hi, 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29);
      r[7] = __builtin_shufflevector(lo, hi, 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31); }
    { fa_vf lo = r[8], hi = r[10];
      r[8] = __builtin_shufflevector(lo, hi, 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29);
      r[10] = __builtin_shufflevector(lo, hi, 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31); }
    { fa_vf lo = r[9], hi = r[11];
      r[9] = __builtin_shufflevector(lo, hi, 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29);
      r[11] = __builtin_shufflevector(lo, hi, 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31); }
    { fa_vf lo = r[12], hi = r[14];
      r[12] = __builtin_shufflevector(lo, hi, 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29);
      r[14] = __builtin_shufflevector(lo, hi, 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31); }
    { fa_vf lo = r[13], hi = r[15];
      r[13] = __builtin_shufflevector(lo, hi, 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29);
      r[15] = __builtin_shufflevector(lo, hi, 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31); }
    /* b = 1 */
    { fa_vf lo = r[0], hi = r[1];
      r[0] = __builtin_shufflevector(lo, hi, 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30);
      r[1] = __builtin_shufflevector(lo, hi, 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31); }
    { fa_vf lo = r[2], hi = r[3];
      r[2] = __builtin_shufflevector(lo, hi, 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30);
      r[3] = __builtin_shufflevector(lo, hi, 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31); }
    { fa_vf lo = r[4], hi = r[5];
      r[4] = __builtin_shufflevector(lo, hi, 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30);
      r[5] = __builtin_shufflevector(lo, hi, 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31); }
    { fa_vf lo = r[6], hi = r[7];
      r[6] = __builtin_shufflevector(lo, hi, 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30);
      r[7] = __builtin_shufflevector(lo, hi, 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31); }
    { fa_vf lo = r[8], hi = r[9];
      r[8] = __builtin_shufflevector(lo, hi, 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30);
      r[9] = __builtin_shufflevector(lo, hi, 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31); }
    { fa_vf lo = r[10], hi = r[11];
      r[10] = __builtin_shufflevector(lo, hi, 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30);
      r[11] = __builtin_shufflevector(lo, hi, 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31); }
    { fa_vf lo = r[12], hi = r[13];
      r[12] = __builtin_shufflevector(lo, hi, 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30);
      r[13] = __builtin_shufflevector(lo, hi, 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31); }
    { fa_vf lo = r[14], hi = r[15];
      r[14] = __builtin_shufflevector(lo, hi, 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30);
      r[15] = __builtin_shufflevector(lo, hi, 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31); }
}
/* In-register 8x8 transpose of double vectors (generated: swap off-diagonal b x b blocks for b = 4..1). */
FA_INLINE void fa_transpose_vd(fa_vd* r)
{
    /* b = 4 */
    { fa_vd lo = r[0], hi = r[4];
      r[0] = __builtin_shufflevector(lo, hi, 0, 1, 2, 3, 8, 9, 10, 11);
      r[4] = __builtin_shufflevector(lo, hi, 4, 5, 6, 7, 12, 13, 14, 15); }
    { fa_vd lo = r[1], hi = r[5];
      r[1] = __builtin_shufflevector(lo, hi, 0, 1, 2, 3, 8, 9, 10, 11);
      r[5] = __builtin_shufflevector(lo, hi, 4, 5, 6, 7, 12, 13, 14, 15); }
    { fa_vd lo = r[2], hi = r[6];
      r[2] = __builtin_shufflevector(lo, hi, 0, 1, 2, 3, 8, 9, 10, 11);
      r[6] = __builtin_shufflevector(lo, hi, 4, 5, 6, 7, 12, 13, 14, 15); }
    { fa_vd lo = r[3], hi = r[7];
      r[3] = __builtin_shufflevector(lo, hi, 0, 1, 2, 3, 8, 9, 10, 11);
      r[7] = __builtin_shufflevector(lo, hi, 4, 5, 6, 7, 12, 13, 14, 15); }
    /* b = 2 */
    { fa_vd lo = r[0], hi = r[2];
      r[0] = __builtin_shufflevector(lo, hi, 0, 1, 8, 9, 4, 5, 12, 13);
      r[2] = __builtin_shufflevector(lo, hi, 2, 3, 10, 11, 6, 7, 14, 15); }
    { fa_vd lo = r[1], hi = r[3];
      r[1] = __builtin_shufflevector(lo, hi, 0, 1, 8, 9, 4, 5, 12, 13);
      r[3] = __builtin_shufflevector(lo, hi, 2, 3, 10, 11, 6, 7, 14, 15); }
    { fa_vd lo = r[4], hi = r[6];
      r[4] = __builtin_shufflevector(lo, hi, 0, 1, 8, 9, 4, 5, 12, 13);
      r[6] = __builtin_shufflevector(lo, hi, 2, 3, 10, 11, 6, 7, 14, 15); }
    { fa_vd lo = r[5], hi = r[7];
      r[5] = __builtin_shufflevector(lo, hi, 0, 1, 8, 9, 4, 5, 12, 13);
      r[7] = __builtin_shufflevector(lo, hi, 2, 3, 10, 11, 6, 7, 14, 15); }
    /* b = 1 */
    { fa_vd lo = r[0], hi = r[1];
      r[0] = __builtin_shufflevector(lo, hi, 0, 8, 2, 10, 4, 12, 6, 14);
      r[1] = __builtin_shufflevector(lo, hi, 1, 9, 3, 11, 5, 13, 7, 15); }
    { fa_vd lo = r[2], hi = r[3];
      r[2] = __builtin_shufflevector(lo, hi, 0, 8, 2, 10, 4, 12, 6, 14);
      r[3] = __builtin_shufflevector(lo, hi, 1, 9, 3, 11, 5, 13, 7, 15); }
    { fa_vd lo = r[4], hi = r[5];
      r[4] = __builtin_shufflevector(lo, hi, 0, 8, 2, 10, 4, 12, 6, 14);
      r[5] = __builtin_shufflevector(lo, hi, 1, 9, 3, 11, 5, 13, 7, 15); }
    { fa_vd lo = r[6], hi = r[7];
      r[6] = __builtin_shufflevector(lo, hi, 0, 8, 2, 10, 4, 12, 6, 14);
      r[7] = __builtin_shufflevector(lo, hi, 1, 9, 3, 11, 5, 13, 7, 15); }
}
#else
/* In-register 8x8 transpose of float vectors (generated: swap off-diagonal b x b blocks for b = 4..1). */
FA_INLINE void fa_transpose_vf(fa_vf* r)
{
    /* b = 4 */
    { fa_vf lo = r[0], hi = r[4];
      r[0] = __builtin_shufflevector(lo, hi, 0, 1, 2, 3, 8, 9, 10, 11);
      r[4] = __builtin_shufflevector(lo, hi, 4, 5, 6, 7, 12, 13, 14, 15); }
    { fa_vf lo = r[1], hi = r[5];
      r[1] = __builtin_shufflevector(lo, hi, 0, 1, 2, 3, 8, 9, 10, 11);
      r[5] = __builtin_shufflevector(lo, hi, 4, 5, 6, 7, 12, 13, 14, 15); }
    { fa_vf lo = r[2], hi = r[6];
      r[2] = __builtin_shufflevector(lo, hi, 0, 1, 2, 3, 8, 9, 10, 11);
      r[6] = __builtin_shufflevector(lo, hi, 4, 5, 6, 7, 12, 13, 14, 15); }
    { fa_vf lo = r[3], hi = r[7];
      r[3] = __builtin_shufflevector(lo, hi, 0, 1, 2, 3, 8, 9, 10, 11);
      r[7] = __builtin_shufflevector(lo, hi, 4, 5, 6, 7, 12, 13, 14, 15); }
    /* b = 2 */
    { fa_vf lo = r[0], hi = r[2];
      r[0] = __builtin_shufflevector(lo, hi, 0, 1, 8, 9, 4, 5, 12, 13);
      r[2] = __builtin_shufflevector(lo, hi, 2, 3, 10, 11, 6, 7, 14, 15); }
    { fa_vf lo = r[1], hi = r[3];
      r[1] = __builtin_shufflevector(lo, hi, 0, 1, 8, 9, 4, 5, 12, 13);
      r[3] = __builtin_shufflevector(lo, hi, 2, 3, 10, 11, 6, 7, 14, 15); }
    { fa_vf lo = r[4], hi = r[6];
      r[4] = __builtin_shufflevector(lo, hi, 0, 1, 8, 9, 4, 5, 12, 13);
      r[6] = __builtin_shufflevector(lo, hi, 2, 3, 10, 11, 6, 7, 14, 15); }
    { fa_vf lo = r[5], hi = r[7];
      r[5] = __builtin_shufflevector(lo, hi, 0, 1, 8, 9, 4, 5, 12, 13);
      r[7] = __builtin_shufflevector(lo, hi, 2, 3, 10, 11, 6, 7, 14, 15); }
    /* b = 1 */
    { fa_vf lo = r[0], hi = r[1];
      r[0] = __builtin_shufflevector(lo, hi, 0, 8, 2, 10, 4, 12, 6, 14);
      r[1] = __builtin_shufflevector(lo, hi, 1, 9, 3, 11, 5, 13, 7, 15); }
    { fa_vf lo = r[2], hi = r[3];
      r[2] = __builtin_shufflevector(lo, hi, 0, 8, 2, 10, 4, 12, 6, 14);
      r[3] = __builtin_shufflevector(lo, hi, 1, 9, 3, 11, 5, 13, 7, 15); }
    { fa_vf lo = r[4], hi = r[5];
      r[4] = __builtin_shufflevector(lo, hi, 0, 8, 2, 10, 4, 12, 6, 14);
      r[5] = __builtin_shufflevector(lo, hi, 1, 9, 3, 11, 5, 13, 7, 15); }
    { fa_vf lo = r[6], hi = r[7];
      r[6] = __builtin_shufflevector(lo, hi, 0, 8, 2, 10, 4, 12, 6, 14);
      r[7] = __builtin_shufflevector(lo, hi, 1, 9, 3, 11, 5, 13, 7, 15); }
}
/* In-register 4x4 transpose of double vectors (generated: swap off-diagonal b x b blocks for b = 2..1). */
FA_INLINE void fa_transpose_vd(fa_vd* r)
{
    /* b = 2 */
    { fa_vd lo = r[0], hi = r[2];
      r[0] = __builtin_shufflevector(lo, hi, 0, 1, 4, 5);
      r[2] = __builtin_shufflevector(lo, hi, 2, 3, 6, 7); }
    { fa_vd lo = r[1], hi = r[3];
      r[1] = __builtin_shufflevector(lo, hi, 0, 1, 4, 5);
      r[3] = __builtin_shufflevector(lo, hi, 2, 3, 6, 7); }
    /* b = 1 */
    { fa_vd lo = r[0], hi = r[1];
      r[0] = __builtin_shufflevector(lo, hi, 0, 4, 2, 6);
      r[1] = __builtin_shufflevector(lo, hi, 1, 5, 3, 7); }
    { fa_vd lo = r[2], hi = r[3];
      r[2] = __builtin_shufflevector(lo, hi, 0, 4, 2, 6);
      r[3] = __builtin_shufflevector(lo, hi, 1, 5, 3, 7); }
}
#endif
/* Load and transpose VL rows: r[i] = {rows[0][d0+i], ..., rows[VL-1][d0+i]}. */
#if FA_VBYTES == 64
/* AVX-512 floats: the first two stages (swapping 8- and 4-wide blocks) are done by the
 * loads: each vector is gathered as four 128-bit pieces (one xmm load, three vinsertf32x4
 * from memory), which use the load ports and port 0 or 5, where the shuffles they replace
 * all need port 5.  Then 128-bit chunk g of r[v] holds row 4g + (v & 3), columns
 * 4(v >> 2) .. +4 -- the state after the b = 8 and b = 4 stages -- and
 * fa_transpose_vf_last2 finishes. */
FA_INLINE void fa_load_transpose_vf(const float* const* rows, ptrdiff_t d0, fa_vf* r)
{
#pragma GCC unroll 16
    for (int v = 0; v < 16; v++) {
        const int t = v & 3;
        const ptrdiff_t c = d0 + 4 * (v >> 2);
        __m512 x = _mm512_castps128_ps512(_mm_loadu_ps(rows[t] + c));
        x = _mm512_insertf32x4(x, _mm_loadu_ps(rows[4 + t] + c), 1);
        x = _mm512_insertf32x4(x, _mm_loadu_ps(rows[8 + t] + c), 2);
        x = _mm512_insertf32x4(x, _mm_loadu_ps(rows[12 + t] + c), 3);
        r[v] = (fa_vf)x;
    }
    fa_transpose_vf_last2(r);
}
#else
FA_INLINE void fa_load_transpose_vf(const float* const* rows, ptrdiff_t d0, fa_vf* r)
{
    for (int t = 0; t < FA_VL_F; t++) r[t] = fa_load_f(rows[t] + d0);
    fa_transpose_vf(r);
}
#endif
FA_INLINE void fa_load_transpose_vd(const double* const* rows, ptrdiff_t d0, fa_vd* r)
{
    for (int t = 0; t < FA_VL_D; t++) r[t] = fa_load_d(rows[t] + d0);
    fa_transpose_vd(r);
}
#endif /* FA_TRANSPOSE_H */
