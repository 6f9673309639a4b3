/*
 * fa_half.h -- 16-bit storage types of q, K, V and the output: float16 (IEEE binary16) and
 * bfloat16 (the top half of a float32).
 *
 * Widening to float32 is exact for both, so a value widened here, in a register by F16C's
 * vcvtph2ps, or by NumPy's astype is the same float: which path widened an element never
 * changes a result's bits.  Narrowing (the output, rounded once at the end) rounds to
 * nearest, ties to even, as NumPy's and ml_dtypes' casts do; NaN stays NaN and overflow
 * gives inf.
 *
 * The F16C instructions are used where the build has them (the AVX2 and AVX-512 variants);
 * the portable baseline converts with integer operations on the bits, vectorised by the
 * compiler's vector extensions, and never multiplies a subnormal (which would take a
 * microcode assist, or flush to zero where DAZ is set).
 */
#ifndef FA_HALF_H
#define FA_HALF_H

#include "fa_simd.h"

/* The storage kinds (FA_STORE_*, FA_QUANTISED, FA_BLOCK_SCALED): one table. */
#include "fa_kinds.h"

/* Whether float16 widens in one instruction (F16C), or in the portable integer sequence. */
#if defined(__F16C__)
#define FA_HAVE_F16C 1
#else
#define FA_HAVE_F16C 0
#endif

typedef uint16_t fa_vh8 __attribute__((vector_size(16)));
typedef uint32_t fa_vu8 __attribute__((vector_size(32)));

FA_INLINE uint32_t fa_f32_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
FA_INLINE float fa_f32_from_bits(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

/* 8 float16 values to float32, portably: the exponent is rebiased in the bits; a subnormal
 * (exponent 0) is built as 2^-14 + m 2^-24 and then 2^-14 subtracted, which is exact. */
FA_INLINE fa_vf8 fa_f16x8_soft(fa_vh8 h)
{
    const fa_vu8 x = __builtin_convertvector(h, fa_vu8);
    const fa_vu8 emask = (fa_vu8){0} + (0x7c00u << 13);
    fa_vu8 u = (x & 0x7fffu) << 13;
    const fa_vu8 e = u & emask;
    u += 112u << 23;
    u += (fa_vu8)((fa_vi8)(e == emask)) & (112u << 23);   /* inf, NaN: exponent 255 */
    fa_vu8 sub = (fa_vu8)((fa_vf8)(u + (1u << 23)) - 0x1p-14f);
    const fa_vu8 is_sub = (fa_vu8)(fa_vi8)(e == 0);
    u = (sub & is_sub) | (u & ~is_sub);
    return (fa_vf8)(u | ((x & 0x8000u) << 16));
}

FA_INLINE fa_vf8 fa_load_f16x8(const uint16_t* p)
{
#if defined(__F16C__)
    return (fa_vf8)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p));
#else
    fa_vh8 h;
    memcpy(&h, p, sizeof h);
    return fa_f16x8_soft(h);
#endif
}

FA_INLINE fa_vf8 fa_widen_bf16x8(fa_vh8 h)
{
#if defined(__AVX2__)
    /* GCC splits the generic form into two 128-bit halves */
    return (fa_vf8)_mm256_slli_epi32(_mm256_cvtepu16_epi32((__m128i)h), 16);
#else
    return (fa_vf8)(__builtin_convertvector(h, fa_vu8) << 16);
#endif
}

FA_INLINE fa_vf8 fa_load_bf16x8(const uint16_t* p)
{
    fa_vh8 h;
    memcpy(&h, p, sizeof h);
    return fa_widen_bf16x8(h);
}

FA_INLINE fa_vf8 fa_widen_f16x8(fa_vh8 h)
{
#if defined(__F16C__)
    return (fa_vf8)_mm256_cvtph_ps((__m128i)h);
#else
    return fa_f16x8_soft(h);
#endif
}


/* 4 elements of each of two rows as one vector of 8 [lo | hi]. */
typedef uint64_t fa_vq2 __attribute__((vector_size(16)));
FA_INLINE fa_vh8 fa_h8_rows(const uint16_t* lo, const uint16_t* hi)
{
#if defined(__AVX__)
    /* two loads (vmovq, vmovddup: no shuffle-port uop) and a blend; GCC builds the
     * generic form below through the stack */
    double h;
    memcpy(&h, hi, sizeof h);   /* (_mm_loaddup_pd would dereference a misaligned double*) */
    const __m128i a = _mm_loadl_epi64((const __m128i*)lo);
    const __m128i b = _mm_castpd_si128(_mm_set1_pd(h));
    return (fa_vh8)_mm_blend_epi32(a, b, 0xC);
#else
    uint64_t a, b;
    memcpy(&a, lo, sizeof a);
    memcpy(&b, hi, sizeof b);
    return (fa_vh8)(fa_vq2){a, b};
#endif
}

FA_INLINE float fa_f16_to_f32(uint16_t h)
{
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    fa_vh8 v = {h};
    return fa_f16x8_soft(v)[0];
#endif
}

FA_INLINE float fa_bf16_to_f32(uint16_t h) { return fa_f32_from_bits((uint32_t)h << 16); }

/* float32 to float16, round to nearest even (the scheme of the FP16 library: the rounding
 * is done by a float addition that leaves the half's bits in the low mantissa). */
FA_INLINE uint16_t fa_f32_to_f16_soft(float f)
{
    const uint32_t w = fa_f32_bits(f);
    const uint32_t shl1 = w + w;
    const uint32_t sign = w & 0x80000000u;
    /* |f| scaled so that the addition below rounds it at half's precision; values that
     * overflow half reach inf here */
    float base = (fa_f32_from_bits(shl1 >> 1) * 0x1p+112f) * 0x1p-110f;
    uint32_t bias = shl1 & 0xff000000u;
    if (bias < 0x71000000u) bias = 0x71000000u;
    base = fa_f32_from_bits((bias >> 1) + 0x07800000u) + base;
    const uint32_t bits = fa_f32_bits(base);
    const uint32_t nonsign = ((bits >> 13) & 0x7c00u) + (bits & 0x0fffu);
    return (uint16_t)((sign >> 16) | (shl1 > 0xff000000u ? 0x7e00u : nonsign));
}

FA_INLINE uint16_t fa_f32_to_bf16(float f)
{
    const uint32_t w = fa_f32_bits(f);
    if ((w & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((w >> 16) | 0x40u);   /* quiet NaN */
    return (uint16_t)((w + 0x7fffu + ((w >> 16) & 1u)) >> 16);
}

/* One vector of the compute type's lanes (FA_VL_F) widened from 16-bit storage. */
#if FA_VBYTES == 64
FA_INLINE fa_vf fa_load_fh(const uint16_t* p)
{ return (fa_vf)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p)); }
/* (GCC builds __builtin_convertvector of 16 lanes from two 8-lane halves and an insert) */
FA_INLINE fa_vf fa_load_fb(const uint16_t* p)
{ return (fa_vf)_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16); }
#else
FA_INLINE fa_vf fa_load_fh(const uint16_t* p) { return fa_load_f16x8(p); }
FA_INLINE fa_vf fa_load_fb(const uint16_t* p) { return fa_load_bf16x8(p); }
#endif

/* n elements of a row in storage kind `kind` (16-bit) widened to float / double. */
static inline void fa_widen_f(int kind, const uint16_t* src, ptrdiff_t n, float* dst)
{
    ptrdiff_t i = 0;
    if (kind == FA_STORE_F16) {
        for (; i + 8 <= n; i += 8) {
            const fa_vf8 x = fa_load_f16x8(src + i);
            memcpy(dst + i, &x, sizeof x);
        }
        for (; i < n; i++) dst[i] = fa_f16_to_f32(src[i]);
    } else {
        for (; i + 8 <= n; i += 8) {
            const fa_vf8 x = fa_load_bf16x8(src + i);
            memcpy(dst + i, &x, sizeof x);
        }
        for (; i < n; i++) dst[i] = fa_bf16_to_f32(src[i]);
    }
}

static inline void fa_widen_d(int kind, const uint16_t* src, ptrdiff_t n, double* dst)
{
    for (ptrdiff_t i = 0; i < n; i++)
        dst[i] = kind == FA_STORE_F16 ? fa_f16_to_f32(src[i]) : fa_bf16_to_f32(src[i]);
}

/* n float32 values rounded to storage kind `kind` (16-bit). */
static inline void fa_narrow_f(int kind, const float* src, ptrdiff_t n, uint16_t* dst)
{
    ptrdiff_t i = 0;
    if (kind == FA_STORE_F16) {
#if defined(__F16C__)
        for (; i + 8 <= n; i += 8)
            _mm_storeu_si128((__m128i*)(dst + i),
                             _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
        for (; i < n; i++) dst[i] = _cvtss_sh(src[i], _MM_FROUND_TO_NEAREST_INT);
#else
        for (; i < n; i++) dst[i] = fa_f32_to_f16_soft(src[i]);
#endif
    } else {
        for (; i < n; i++) dst[i] = fa_f32_to_bf16(src[i]);
    }
}

/*
 * The K or V rows of one key block widened into a buffer of the compute type: rows
 * src + j * ld (j < nrows, 16-bit elements) to dst + j * ldd.  While it converts row j it
 * prefetches row j of the next block (pf + j * ld, or nothing when pf is NULL), so that the
 * next block streams in while this one is computed on.
 */
#define FA_WIDEN_ROWS(SUF, T)                                                                  \
static void fa_widen_rows_##SUF(int kind, const uint16_t* src, ptrdiff_t ld, ptrdiff_t nrows, \
                                ptrdiff_t n, T* dst, ptrdiff_t ldd, const uint16_t* pf,       \
                                ptrdiff_t pf_rows)                                            \
{                                                                                             \
    for (ptrdiff_t j = 0; j < nrows; j++) {                                                   \
        if (j < pf_rows) fa_prefetch_l2((const char*)(pf + j * ld), n * 2);                    \
        fa_widen_##SUF(kind, src + j * ld, n, dst + j * ldd);                                 \
    }                                                                                         \
}

#endif /* FA_HALF_H */
