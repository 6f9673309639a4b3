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
 * exp(x), float lanes.  Cephes' expf: x = n*ln2 + r with |r| <= ln2/2, a degree-6
 * polynomial for e^r, and 2^n built in the exponent bits.  n = round(x*log2 e) comes from
 * the "magic number" trick (adding 1.5*2^23 leaves n in the low mantissa bits), which
 * needs no float->int conversion instruction and so works on every ISA.
 * Measured max error vs. float64 exp on [-87, 0]: see tests/test_exp.py (~1-2 ulp).
 * Below -87.33 (where exp would be subnormal) and for -inf the result is exactly 0: the
 * online softmax relies on exp(-inf) == 0 for hidden keys, and exp(0) is exactly 1.
 * NaN propagates.  Domain: x <= 88 (the kernel only takes exp of score - running max <= 0);
 * larger x overflow the exponent bits instead of giving inf.
 */
FA_INLINE fa_vf fa_exp_f(fa_vf x)
{
    const fa_vf magic = fa_bcast_f(12582912.0f);            /* 1.5 * 2^23 */
    const fa_vf lo = fa_bcast_f(-87.33654f);
    const fa_vfi under = x < lo;   /* -inf included; garbage lanes are replaced below */
    fa_vf t = x * 1.44269504088896341f + magic;
    fa_vfi n = (fa_vfi)t - (fa_vfi)magic;
    fa_vf fn = t - magic;
    fa_vf r = x - fn * 0.693359375f;
    r = r - fn * -2.12194440e-4f;
    fa_vf p = fa_bcast_f(1.9875691500E-4f);
    p = p * r + 1.3981999507E-3f;
    p = p * r + 8.3334519073E-3f;
    p = p * r + 4.1665795894E-2f;
    p = p * r + 1.6666665459E-1f;
    p = p * r + 5.0000001201E-1f;
    fa_vf y = p * (r * r) + r + 1.0f;
    fa_vf pow2n = (fa_vf)((n + 127) << 23);
    return fa_select_f(under, fa_bcast_f(0.0f), y * pow2n);
}

/*
 * exp(x), double lanes: same reduction with a two-part ln2 and a degree-13 Taylor
 * polynomial on |r| <= ln2/2 (truncation error < 1e-17, below half an ulp).
 */
FA_INLINE fa_vd fa_exp_d(fa_vd x)
{
    const fa_vd magic = fa_bcast_d(6755399441055744.0);      /* 1.5 * 2^52 */
    const fa_vd lo = fa_bcast_d(-708.3964185322641);
    const fa_vdi under = x < lo;
    fa_vd t = x * 1.4426950408889634074 + magic;
    fa_vdi n = (fa_vdi)t - (fa_vdi)magic;
    fa_vd fn = t - magic;
    fa_vd r = x - fn * 6.93145751953125E-1;
    r = r - fn * 1.42860682030941723212E-6;
    fa_vd p = fa_bcast_d(1.0 / 6227020800.0);                /* 1/13! */
    p = p * r + 1.0 / 479001600.0;
    p = p * r + 1.0 / 39916800.0;
    p = p * r + 1.0 / 3628800.0;
    p = p * r + 1.0 / 362880.0;
    p = p * r + 1.0 / 40320.0;
    p = p * r + 1.0 / 5040.0;
    p = p * r + 1.0 / 720.0;
    p = p * r + 1.0 / 120.0;
    p = p * r + 1.0 / 24.0;
    p = p * r + 1.0 / 6.0;
    p = p * r + 0.5;
    fa_vd y = p * (r * r) + r + 1.0;
    fa_vd pow2n = (fa_vd)((n + 1023) << 52);
    return fa_select_d(under, fa_bcast_d(0.0), y * pow2n);
}

#endif /* FA_SIMD_H */
