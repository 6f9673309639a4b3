/*
 * fa_simd.h -- the few SIMD primitives fastattn's micro-kernels need, written once with
 * GCC/Clang vector extensions so the same source compiles to SSE2, AVX2+FMA or AVX-512
 * depending only on the flags of the extension module that includes it (see setup.py:
 * one module per instruction set, chosen at import time).
 *
 * Vectors are FA_VBYTES wide: 64 bytes when the module is built for AVX-512, else 32
 * (on plain SSE2 the compiler splits a 32-byte vector into two xmm halves, which is fine).
 *
 * Every floating-point operation on a lane depends only on that lane: results are
 * identical whichever lane a query row lands in, which is what makes fastattn's output
 * for a row independent of the other rows in the call (SPEC: reproducibility).
 */
#ifndef FA_SIMD_H
#define FA_SIMD_H

#include <stddef.h>
#include <string.h>
#include <stdint.h>
#include <math.h>
#if defined(__AVX__)
#include <immintrin.h>
#endif

#if !defined(__GNUC__) && !defined(__clang__)
#error "fastattn's kernels need GCC or Clang vector extensions (MSVC: use clang-cl)"
#endif

#if defined(__AVX512F__)
#define FA_VBYTES 64
#else
#define FA_VBYTES 32
#endif

typedef float   fa_vf  __attribute__((vector_size(FA_VBYTES)));
typedef int32_t fa_vfi __attribute__((vector_size(FA_VBYTES)));
typedef double  fa_vd  __attribute__((vector_size(FA_VBYTES)));
typedef int64_t fa_vdi __attribute__((vector_size(FA_VBYTES)));

#define FA_VL_F ((ptrdiff_t)(FA_VBYTES / sizeof(float)))
#define FA_VL_D ((ptrdiff_t)(FA_VBYTES / sizeof(double)))

#define FA_INLINE static inline __attribute__((always_inline))
#define FA_NOINLINE static __attribute__((noinline))

/* Unaligned loads/stores: memcpy of a whole vector compiles to one vmovups. */
FA_INLINE fa_vf fa_load_f(const float* p) { fa_vf v; memcpy(&v, p, sizeof v); return v; }
FA_INLINE void fa_store_f(float* p, fa_vf v) { memcpy(p, &v, sizeof v); }
/* Broadcast: a constructor with every lane equal compiles to one vbroadcastss/sd (from
 * memory when x is a load); `(fa_vf){0} + x` would cost an extra add and a lane-filling
 * loop is not recognised by GCC 12. */
#if FA_VBYTES == 64
#define FA_X8(x) x, x, x, x, x, x, x, x
FA_INLINE fa_vf fa_bcast_f(float x) { return (fa_vf){FA_X8(x), FA_X8(x)}; }
FA_INLINE fa_vd fa_bcast_d(double x) { return (fa_vd){FA_X8(x)}; }
#else
FA_INLINE fa_vf fa_bcast_f(float x) { return (fa_vf){x, x, x, x, x, x, x, x}; }
FA_INLINE fa_vd fa_bcast_d(double x) { return (fa_vd){x, x, x, x}; }
#endif
FA_INLINE fa_vf fa_select_f(fa_vfi m, fa_vf a, fa_vf b)
{ return (fa_vf)(((fa_vfi)a & m) | ((fa_vfi)b & ~m)); }


FA_INLINE fa_vd fa_load_d(const double* p) { fa_vd v; memcpy(&v, p, sizeof v); return v; }
FA_INLINE void fa_store_d(double* p, fa_vd v) { memcpy(p, &v, sizeof v); }
FA_INLINE fa_vd fa_select_d(fa_vdi m, fa_vd a, fa_vd b)
{ return (fa_vd)(((fa_vdi)a & m) | ((fa_vdi)b & ~m)); }
#if FA_VBYTES == 64
FA_INLINE fa_vf fa_max_f(fa_vf a, fa_vf b) { return (fa_vf)_mm512_max_ps((__m512)a, (__m512)b); }
FA_INLINE fa_vd fa_max_d(fa_vd a, fa_vd b) { return (fa_vd)_mm512_max_pd((__m512d)a, (__m512d)b); }
#elif defined(__AVX__)
FA_INLINE fa_vf fa_max_f(fa_vf a, fa_vf b) { return (fa_vf)_mm256_max_ps((__m256)a, (__m256)b); }
FA_INLINE fa_vd fa_max_d(fa_vd a, fa_vd b) { return (fa_vd)_mm256_max_pd((__m256d)a, (__m256d)b); }
#else
/* No single max instruction for a 32-byte vector on SSE2: compare and select. */
FA_INLINE fa_vf fa_max_f(fa_vf a, fa_vf b) { return fa_select_f(a > b, a, b); }
FA_INLINE fa_vd fa_max_d(fa_vd a, fa_vd b) { return fa_select_d(a > b, a, b); }
#endif

/*
 * 2^x, float lanes.  The kernel works in base 2: scores are scaled by scale*log2(e) inside
 * the score micro-kernel, so the softmax needs exp2 and no extra multiply.
 *   x = n + r, n = round(x), |r| <= 1/2;  2^r by its degree-7 Taylor polynomial in r
 *   (truncation < 7.1e-9 relative, below float's half-ulp);  2^n built in the exponent bits.
 * round(x) is the "magic number" trick (adding 1.5*2^23 leaves n in the low mantissa bits),
 * which needs no float->int instruction and so compiles to the same code on every ISA.
 * x is first clamped to -127: there n + 127 == 0, the exponent field is 0 and the result
 * is exactly 0 -- the online softmax relies on 2^-inf == 0 for hidden keys (and 2^0 == 1
 * exactly).  Results below 2^-126 are flushed to 0.  The clamp keeps NaN (max(c, NaN) is
 * NaN with vmaxps' operand order), and NaN propagates.  Domain: x <= 127 (the kernel only
 * takes 2^(score - running max) <= 1).  Accuracy vs. float64: tests/test_exp.py.
 */
FA_INLINE fa_vf fa_exp2_f(fa_vf x)
{
    const fa_vf magic = fa_bcast_f(12582912.0f);            /* 1.5 * 2^23 */
    x = fa_max_f(fa_bcast_f(-127.0f), x);
    const fa_vf t = x + magic;
    const fa_vf r = x - (t - magic);
    fa_vf p = fa_bcast_f(1.5252733804059838e-05f);
    p = p * r + 1.5403530393381606e-04f;
    p = p * r + 1.3333558146428441e-03f;
    p = p * r + 9.6181291076284770e-03f;
    p = p * r + 5.5504108664821576e-02f;
    p = p * r + 2.4022650695910071e-01f;
    p = p * r + 6.9314718055994531e-01f;
    p = p * r + 1.0f;
    const fa_vf pow2n = (fa_vf)(((fa_vfi)t - (fa_vfi)magic + 127) << 23);
    return p * pow2n;
}

/*
 * 2^x, double lanes: the same scheme with a degree-13 Taylor polynomial (truncation
 * < 4e-18 relative) and the clamp at -1023.
 */
FA_INLINE fa_vd fa_exp2_d(fa_vd x)
{
    const fa_vd magic = fa_bcast_d(6755399441055744.0);      /* 1.5 * 2^52 */
    x = fa_max_d(fa_bcast_d(-1023.0), x);
    const fa_vd t = x + magic;
    const fa_vd r = x - (t - magic);
    fa_vd p = fa_bcast_d(1.3691488853904124e-12);
    p = p * r + 2.5678435993488196e-11;
    p = p * r + 4.4455382718708100e-10;
    p = p * r + 7.0549116208011210e-09;
    p = p * r + 1.0178086009239696e-07;
    p = p * r + 1.3215486790144305e-06;
    p = p * r + 1.5252733804059838e-05;
    p = p * r + 1.5403530393381606e-04;
    p = p * r + 1.3333558146428441e-03;
    p = p * r + 9.6181291076284770e-03;
    p = p * r + 5.5504108664821576e-02;
    p = p * r + 2.4022650695910071e-01;
    p = p * r + 6.9314718055994531e-01;
    p = p * r + 1.0;
    const fa_vd pow2n = (fa_vd)(((fa_vdi)t - (fa_vdi)magic + 1023) << 52);
    return p * pow2n;
}

#endif /* FA_SIMD_H */
