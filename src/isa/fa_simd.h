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
 * for a row independent of the other rows in the call (bitwise reproducibility).
 */
#ifndef FA_SIMD_H
#define FA_SIMD_H

#include <stddef.h>
#include <string.h>
#include <stdint.h>
#include <math.h>
#if defined(__AVX__)
#include <immintrin.h>
#elif defined(__SSE2__)
#include <emmintrin.h>
#endif

#if !defined(__GNUC__) && !defined(__clang__)
#error "fastattn's kernels need GCC or Clang vector extensions"
#endif

#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
/* r = EAX, EBX, ECX, EDX of CPUID leaf `leaf`, subleaf `sub`: what the running CPU says,
 * not the build host. */
static inline void fa_cpuid(unsigned leaf, unsigned sub, unsigned r[4])
{
    __asm__ volatile("cpuid" : "=a"(r[0]), "=b"(r[1]), "=c"(r[2]), "=d"(r[3])
                     : "a"(leaf), "c"(sub));
}
/* Bit `bit` of register `reg` (0 EAX, 1 EBX, 2 ECX, 3 EDX) of CPUID leaf `leaf`, subleaf
 * `sub`; 0 where the CPU has no such leaf. */
static inline int fa_cpuid_bit(unsigned leaf, unsigned sub, int reg, int bit)
{
    unsigned r[4];
    fa_cpuid(0, 0, r);
    if (r[0] < leaf) return 0;
    fa_cpuid(leaf, sub, r);
    return (r[reg] >> bit) & 1;
}
/* Whether the running CPU says it is an Intel one (leaf 0's vendor: "GenuineIntel"). */
static inline int fa_cpu_is_intel(void)
{
    unsigned r[4];
    fa_cpuid(0, 0, r);
    return r[1] == 0x756e6547u && r[3] == 0x49656e69u && r[2] == 0x6c65746eu;
}
#else
static inline int fa_cpu_is_intel(void) { return 0; }
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
/* unused: not every instantiation of a kernel is called by every build */
#define FA_NOINLINE static __attribute__((noinline, unused))

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
/* 8 floats: the native vector of the 32-byte builds; in AVX-512 builds a ymm register,
 * for the decode kernels that work on groups of 8 keys (fa_keys32.h) or of 4 rows. */
typedef float fa_vf8 __attribute__((vector_size(32)));
typedef int32_t fa_vi8 __attribute__((vector_size(32)));
FA_INLINE fa_vf8 fa_load_f8(const float* p) { fa_vf8 v; memcpy(&v, p, sizeof v); return v; }
FA_INLINE void fa_store_f8(float* p, fa_vf8 v) { memcpy(p, &v, sizeof v); }
FA_INLINE fa_vf8 fa_bcast_f8(float x) { return (fa_vf8){x, x, x, x, x, x, x, x}; }
FA_INLINE fa_vf8 fa_select_f8(fa_vi8 m, fa_vf8 a, fa_vf8 b)
{ return (fa_vf8)(((fa_vi8)a & m) | ((fa_vi8)b & ~m)); }
#if defined(__AVX__)
FA_INLINE fa_vf8 fa_max_f8(fa_vf8 a, fa_vf8 b) { return (fa_vf8)_mm256_max_ps((__m256)a, (__m256)b); }
#else
/* No single max instruction for a 32-byte vector on SSE2: compare and select. */
FA_INLINE fa_vf8 fa_max_f8(fa_vf8 a, fa_vf8 b) { return fa_select_f8(a > b, a, b); }
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
FA_INLINE fa_vf fa_max_f(fa_vf a, fa_vf b) { return fa_max_f8(a, b); }
FA_INLINE fa_vd fa_max_d(fa_vd a, fa_vd b) { return (fa_vd)_mm256_max_pd((__m256d)a, (__m256d)b); }
#else
FA_INLINE fa_vf fa_max_f(fa_vf a, fa_vf b) { return fa_max_f8(a, b); }
FA_INLINE fa_vd fa_max_d(fa_vd a, fa_vd b) { return fa_select_d(a > b, a, b); }
#endif

/* Whether every lane of a comparison result is true: one movemask where the ISA has it
 * (a lane-by-lane loop extracts each lane, a dozen instructions). */
FA_INLINE int fa_all_f(fa_vfi m)
{
#if FA_VBYTES == 64
    return _mm512_cmpneq_epi32_mask((__m512i)m, _mm512_setzero_si512()) == 0xFFFF;
#elif defined(__AVX__)
    return _mm256_movemask_ps((__m256)m) == 0xFF;
#elif defined(__SSE2__)
    const __m128i lo = (__m128i)__builtin_shufflevector(m, m, 0, 1, 2, 3);
    const __m128i hi = (__m128i)__builtin_shufflevector(m, m, 4, 5, 6, 7);
    return _mm_movemask_ps((__m128)_mm_and_si128(lo, hi)) == 0xF;
#else
    int all = 1;
    for (int i = 0; i < (int)FA_VL_F; i++) all &= m[i] != 0;
    return all;
#endif
}

/*
 * 2^x, float lanes.  The kernel works in base 2: scores are scaled by scale*log2(e) inside
 * the score micro-kernel, so the softmax needs exp2 and no extra multiply.
 *   x = n + r, n = round(x), |r| <= 1/2;  2^r by a degree-6 polynomial with p(0) = 1
 *   exactly (near-minimax for relative error on [-1/2, 1/2]: 1.97e-9, below float's
 *   half-ulp; fitted by Lawson iterations in 40-digit arithmetic);  then times 2^n.
 * round(x) is the "magic number" trick (adding 1.5*2^23 rounds to an integer), which needs
 * no float->int instruction and so compiles to the same code on every ISA.
 * Results with n <= -127 are exactly 0 -- the online softmax relies on 2^-inf == 0 for
 * hidden keys (and 2^0 == 1 exactly).  NaN propagates.  Domain: x <= 127 (the kernel only
 * takes 2^(score - running max) <= 1).  Accuracy vs. float64: tests/test_exp.py.
 *   AVX-512: 2^n by vscalefps, zero-masked where n < -126.5 (an unordered compare, so NaN
 *            is kept); -inf gives n = -inf, a NaN r, and a masked-off 0.
 *   otherwise: x is clamped to -127 first and 2^n is built in the exponent bits, whose
 *            field is then 0 for n = -127: the product is exactly 0.
 */
#define FA_EXP2_POLY_F(p, r) FA_EXP2_POLY_F_AS(fa_vf, fa_bcast_f, p, r)
#define FA_EXP2_POLY_F_AS(VT, BCAST, p, r)                  \
    VT p = BCAST(1.5353360629289048927e-04f);               \
    p = p * r + 1.3398874866602215750e-03f;                 \
    p = p * r + 9.6184373664188744101e-03f;                 \
    p = p * r + 5.5503324696938733559e-02f;                 \
    p = p * r + 2.4022647913498998394e-01f;                 \
    p = p * r + 6.9314720285597040077e-01f;                 \
    p = p * r + 1.0f;
/* 2^x, double lanes: the same scheme with a degree-11 polynomial (3.4e-18 relative) and
 * the flush at n <= -1023. */
#define FA_EXP2_POLY_D(p, r)                                \
    fa_vd p = fa_bcast_d(4.434770725838830419e-10);         \
    p = p * r + 7.0737832933895722769e-09;                  \
    p = p * r + 1.0178199575928271726e-07;                  \
    p = p * r + 1.3215435282016427242e-06;                  \
    p = p * r + 1.5252733493116752112e-05;                  \
    p = p * r + 1.5403530457112759331e-04;                  \
    p = p * r + 1.3333558146774633100e-03;                  \
    p = p * r + 9.6181291075941194663e-03;                  \
    p = p * r + 5.5504108664820083165e-02;                  \
    p = p * r + 2.4022650695910131262e-01;                  \
    p = p * r + 6.9314718055994532581e-01;                  \
    p = p * r + 1.0;

/* 2^x on 8 float lanes with 2^n built in the exponent bits: x is clamped to -127 first,
 * whose exponent field is then 0, so the product is exactly 0.  The 32-byte builds' exp2;
 * AVX-512 builds use it for their 8-float decode kernels, and per lane it gives the bits
 * of their vscalefps version. */
FA_INLINE fa_vf8 fa_exp2_f8(fa_vf8 x)
{
    const fa_vf8 magic = fa_bcast_f8(12582912.0f);           /* 1.5 * 2^23 */
    x = fa_max_f8(fa_bcast_f8(-127.0f), x);
    const fa_vf8 t = x + magic;
    const fa_vf8 r = x - (t - magic);
    FA_EXP2_POLY_F_AS(fa_vf8, fa_bcast_f8, p, r)
    const fa_vf8 pow2n = (fa_vf8)(((fa_vi8)t - (fa_vi8)magic + 127) << 23);
    return p * pow2n;
}

#if FA_VBYTES == 64
FA_INLINE fa_vf fa_exp2_f(fa_vf x)
{
    const fa_vf magic = fa_bcast_f(12582912.0f);            /* 1.5 * 2^23 */
    const fa_vf n = (x + magic) - magic;
    const fa_vf r = x - n;
    FA_EXP2_POLY_F(p, r)
    const __mmask16 keep = _mm512_cmp_ps_mask((__m512)n, _mm512_set1_ps(-126.5f), _CMP_NLT_UQ);
    return (fa_vf)_mm512_maskz_scalef_ps(keep, (__m512)p, (__m512)n);
}
FA_INLINE fa_vd fa_exp2_d(fa_vd x)
{
    const fa_vd magic = fa_bcast_d(6755399441055744.0);      /* 1.5 * 2^52 */
    const fa_vd n = (x + magic) - magic;
    const fa_vd r = x - n;
    FA_EXP2_POLY_D(p, r)
    const __mmask8 keep = _mm512_cmp_pd_mask((__m512d)n, _mm512_set1_pd(-1022.5), _CMP_NLT_UQ);
    return (fa_vd)_mm512_maskz_scalef_pd(keep, (__m512d)p, (__m512d)n);
}
#else
FA_INLINE fa_vf fa_exp2_f(fa_vf x) { return fa_exp2_f8(x); }
FA_INLINE fa_vd fa_exp2_d(fa_vd x)
{
    const fa_vd magic = fa_bcast_d(6755399441055744.0);      /* 1.5 * 2^52 */
    x = fa_max_d(fa_bcast_d(-1023.0), x);
    const fa_vd t = x + magic;
    const fa_vd r = x - (t - magic);
    FA_EXP2_POLY_D(p, r)
    const fa_vd pow2n = (fa_vd)(((fa_vdi)t - (fa_vdi)magic + 1023) << 52);
    return p * pow2n;
}
#endif

#endif /* FA_SIMD_H */
