/*
 * fa_append.h -- new rows of a serving cache in the cache's format: read from q, k or v in
 * float32, float16 or bfloat16 (any element stride), rotated (rotary embedding), and
 * stored as float32, float16, bfloat16, llama.cpp's q8_0 or q4_0, or fp8 (float8_e4m3fn,
 * float8_e5m2) with a float32 scale.
 *
 * Every value here must equal the NumPy front end's, bit for bit, since either may append
 * the rows of one cache:
 *  - rotation is FlashAttention's apply_rotary_emb in float32, each product and each sum
 *    rounded on its own (x1 cos - x2 sin, x1 sin + x2 cos), as NumPy's elementwise
 *    operations round them; fa_rounded keeps the compiler from fusing them into an FMA;
 *  - rounding to float16 and bfloat16 is to nearest even; NaN becomes NumPy's float16 NaN
 *    (the top bits of the payload) and ml_dtypes' bfloat16 NaN (the sign and 0x7fc0);
 *  - q8_0 is quantize_row_q8_0_ref: d = max|x| / 127 in float32, values round(x * (1 / d))
 *    with ties away from zero, d stored rounded to float16;
 *  - q4_0 is quantize_row_q4_0_ref: d = m / -8, m the value of largest |x| with its sign,
 *    values min(15, trunc(x * (1 / d) + 8.5)), d stored rounded to float16;
 *  - fp8 is vLLM's: x / scale rounded once to float32, then to the nearest fp8 value (ties
 *    to even), saturated to the largest finite one (448, or 57344 for e5m2).
 * A function that would store a value the front end refuses (a finite value that
 * overflows float16, a non-finite value, a value too large for a finite float16 block
 * scale) returns -1 and stores nothing of that row; the caller then leaves the whole call
 * to the front end, which names the value.
 */
#ifndef FA_APPEND_H
#define FA_APPEND_H

#include <math.h>
#include "fa_half.h"

/* llama.cpp's QK8_0 (and QK4_0), and the largest |x| whose block scale is a finite
 * float16: 127 (q8_0) or 8 (q4_0) times float16's largest value. */
#define FA_Q8_0_BLOCK 32
#define FA_Q8_0_MAX_ABS (127.0f * 65504.0f)
#define FA_Q4_0_MAX_ABS (8.0f * 65504.0f)

/* x as rounded to float32: the compiler may not fuse the operation that made it into a
 * later addition. */
FA_INLINE float fa_rounded(float x)
{
    __asm__ volatile("" : "+m"(x));
    return x;
}

/* The bits of +inf in the 16-bit kind (float16 or bfloat16).  A stored value overflowed
 * where its magnitude's bits are these and the float32 it came from is finite. */
FA_INLINE uint16_t fa_inf_bits(int kind)
{
    return kind == FA_STORE_F16 ? 0x7c00u : 0x7f80u;
}

#if defined(__AVX2__)
/* The quantisers below take a vector of the build at a time (8 or 16 lanes), each lane's
 * operations those of the scalar code, so that every build stores the same bytes. */
#define FA_APPEND_VECTORS 1

/* fa_rounded lane by lane, in a register. */
FA_INLINE fa_vf fa_rounded_v(fa_vf x)
{
    __asm__("" : "+x"(x));
    return x;
}

FA_INLINE fa_vf fa_abs_v(fa_vf x) { return (fa_vf)((fa_vfi)x & 0x7fffffff); }

/* Whether any lane of the mask m is set. */
FA_INLINE int fa_any_v(fa_vfi m)
{
#if FA_VBYTES == 64
    return _mm512_test_epi32_mask((__m512i)m, (__m512i)m) != 0;
#else
    return !_mm256_testz_si256((__m256i)m, (__m256i)m);
#endif
}

/* The low byte of each lane of r, stored at dst (FA_VL_F bytes). */
FA_INLINE void fa_store_low_bytes(void* dst, fa_vfi r)
{
#if FA_VBYTES == 64
    _mm_storeu_si128((__m128i*)dst, _mm512_cvtepi32_epi8((__m512i)r));
#else
    const __m256i low = _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                         0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1);
    const __m256i t = _mm256_permutevar8x32_epi32(_mm256_shuffle_epi8((__m256i)r, low),
                                                  _mm256_setr_epi32(0, 4, 1, 1, 1, 1, 1, 1));
    _mm_storel_epi64((__m128i*)dst, _mm256_castsi256_si128(t));
#endif
}

/* FA_VL_F float16 (kind FA_STORE_F16) or bfloat16 values in 16-bit lanes. */
typedef uint16_t fa_vh __attribute__((vector_size(FA_VBYTES / 2)));
typedef uint32_t fa_vu __attribute__((vector_size(FA_VBYTES)));

/* The lanes of x as the 16-bit kind's bits, at h, as fa_f32_to_f16 (F16C's rounding) and
 * fa_f32_to_bf16_np round them; *overflow set where a finite value became inf.  0, and
 * nothing stored, where a lane is NaN: NaN payloads are the scalar code's. */
FA_INLINE int fa_narrow_v(int kind, fa_vf x, uint16_t* h, int* overflow)
{
    const fa_vfi a = (fa_vfi)x & 0x7fffffff;
    if (fa_any_v(a > 0x7f800000))
        return 0;
    fa_vh r;
    if (kind == FA_STORE_F16) {
#if FA_VBYTES == 64
        r = (fa_vh)_mm512_cvtps_ph((__m512)x, _MM_FROUND_TO_NEAREST_INT);
#else
        r = (fa_vh)_mm256_cvtps_ph((__m256)x, _MM_FROUND_TO_NEAREST_INT);
#endif
    } else {
        const fa_vu w = (fa_vu)x;
        r = __builtin_convertvector((w + 0x7fffu + ((w >> 16) & 1u)) >> 16, fa_vh);
    }
    *overflow |= fa_any_v(((__builtin_convertvector(r, fa_vfi) & 0x7fff) == fa_inf_bits(kind))
                          & (a < 0x7f800000));
    memcpy(h, &r, sizeof r);
    return 1;
}

/* The largest |x| of x[0 .. n), n a multiple of FA_VL_F; *bad set where some |x| is not
 * <= max_abs (NaN included).  Exact: max of magnitudes in any order is the same float. */
FA_INLINE float fa_amax_v(const float* x, int n, float max_abs, int* bad)
{
    fa_vf m = fa_bcast_f(0.0f);
    fa_vfi over = (fa_vfi)fa_bcast_f(0.0f);
    for (int j = 0; j < n; j += FA_VL_F) {
        const fa_vf a = fa_abs_v(fa_load_f(x + j));
        const fa_vfi gt = a > m;
        over |= ~(a <= max_abs);
        m = (fa_vf)((gt & (fa_vfi)a) | (~gt & (fa_vfi)m));
    }
    *bad |= fa_any_v(over);
    /* the lanes folded in halves (no lane is NaN where the result is used, none -0) */
#if FA_VBYTES == 64
    return _mm512_reduce_max_ps((__m512)m);
#else
    __m128 h = _mm_max_ps(_mm256_castps256_ps128((__m256)m), _mm256_extractf128_ps((__m256)m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_max_ss(h, _mm_shuffle_ps(h, h, 1)));
#endif
}
#else
#define FA_APPEND_VECTORS 0
#endif

FA_INLINE uint16_t fa_f32_to_f16(float f)
{
    const uint32_t w = fa_f32_bits(f);
    if ((w & 0x7fffffffu) > 0x7f800000u) {                 /* NaN: NumPy keeps the payload */
        uint16_t h = (uint16_t)(0x7c00u | ((w & 0x007fffffu) >> 13));
        if (h == 0x7c00u) h++;
        return (uint16_t)(((w >> 16) & 0x8000u) | h);
    }
#if defined(__F16C__)
    return (uint16_t)_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT);
#else
    return fa_f32_to_f16_soft(f);
#endif
}

FA_INLINE uint16_t fa_f32_to_bf16_np(float f)
{
    const uint32_t w = fa_f32_bits(f);
    if ((w & 0x7fffffffu) > 0x7f800000u)                   /* NaN: ml_dtypes' quiet NaN */
        return (uint16_t)(((w >> 16) & 0x8000u) | 0x7fc0u);
    return (uint16_t)((w + 0x7fffu + ((w >> 16) & 1u)) >> 16);
}

/* One element of storage kind `kind` (FA_STORE_NATIVE: float32) as float32. */
FA_INLINE float fa_load_one(int kind, const char* p)
{
    uint16_t h;
    float f;
    if (kind == FA_STORE_NATIVE) {
        memcpy(&f, p, 4);
        return f;
    }
    memcpy(&h, p, 2);
    return kind == FA_STORE_F16 ? fa_f16_to_f32(h) : fa_bf16_to_f32(h);
}

/* n elements src[i * stride] (bytes) of kind `kind` widened into dst. */
static inline void fa_load_row(int kind, const char* src, ptrdiff_t stride, ptrdiff_t n,
                               float* dst)
{
    if (kind == FA_STORE_NATIVE && stride == 4)
        memcpy(dst, src, n * sizeof(float));
    else if (kind != FA_STORE_NATIVE && stride == 2)
        fa_widen_f(kind, (const uint16_t*)src, n, dst);
    else
        for (ptrdiff_t i = 0; i < n; i++)
            dst[i] = fa_load_one(kind, src + i * stride);
}

/* x[0 .. 2 half) rotated in place by the angles of one position: pairs (i, i + half), or
 * (2i, 2i + 1) when interleaved; the dims past 2 half are left as they are. */
static inline void fa_rotate_row(float* x, const float* cos, const float* sin, ptrdiff_t half,
                                 int interleaved)
{
    ptrdiff_t i0 = 0;
#if FA_APPEND_VECTORS
    /* a vector of pairs at a time: the same products, each rounded before its sum */
    for (; i0 + FA_VL_F <= half; i0 += FA_VL_F) {
        fa_vf x1, x2;
        float a[FA_VL_F], b[FA_VL_F];
        if (interleaved) {
            for (int j = 0; j < FA_VL_F; j++) {
                a[j] = x[2 * (i0 + j)];
                b[j] = x[2 * (i0 + j) + 1];
            }
            x1 = fa_load_f(a);
            x2 = fa_load_f(b);
        } else {
            x1 = fa_load_f(x + i0);
            x2 = fa_load_f(x + i0 + half);
        }
        const fa_vf c = fa_load_f(cos + i0), s = fa_load_f(sin + i0);
        const fa_vf y1 = fa_rounded_v(x1 * c) - fa_rounded_v(x2 * s);
        const fa_vf y2 = fa_rounded_v(x1 * s) + fa_rounded_v(x2 * c);
        if (interleaved) {
            fa_store_f(a, y1);
            fa_store_f(b, y2);
            for (int j = 0; j < FA_VL_F; j++) {
                x[2 * (i0 + j)] = a[j];
                x[2 * (i0 + j) + 1] = b[j];
            }
        } else {
            fa_store_f(x + i0, y1);
            fa_store_f(x + i0 + half, y2);
        }
    }
#endif
    for (ptrdiff_t i = i0; i < half; i++) {
        float* p1 = interleaved ? x + 2 * i : x + i;
        float* p2 = interleaved ? x + 2 * i + 1 : x + i + half;
        const float x1 = *p1, x2 = *p2;
        *p1 = fa_rounded(x1 * cos[i]) - fa_rounded(x2 * sin[i]);
        *p2 = fa_rounded(x1 * sin[i]) + fa_rounded(x2 * cos[i]);
    }
}

/* x[0 .. n) rounded to the 16-bit kind `kind` and back (a rotated row given back in its own
 * 16-bit dtype: overflow gives inf, as NumPy's cast does). */
static inline void fa_round_row(int kind, float* x, ptrdiff_t n)
{
    ptrdiff_t i0 = 0;
#if FA_APPEND_VECTORS
    if (kind == FA_STORE_F16 || kind == FA_STORE_BF16) {
        uint16_t h[FA_VL_F];
        int overflow = 0;                   /* (inf is kept here, as NumPy's cast keeps it) */
        for (; i0 + FA_VL_F <= n; i0 += FA_VL_F) {
            if (!fa_narrow_v(kind, fa_load_f(x + i0), h, &overflow))
                break;
            fa_store_f(x + i0, kind == FA_STORE_F16 ? fa_load_fh(h) : fa_load_fb(h));
        }
    }
#endif
    if (kind == FA_STORE_F16)
        for (ptrdiff_t i = i0; i < n; i++) x[i] = fa_f16_to_f32(fa_f32_to_f16(x[i]));
    else if (kind == FA_STORE_BF16)
        for (ptrdiff_t i = i0; i < n; i++) x[i] = fa_bf16_to_f32(fa_f32_to_bf16_np(x[i]));
}

/* Every line of [p, p + bytes) requested for writing: a new row's place in a cache that
 * has gone cold, asked for before the row is made so that its store finds the line. */
static inline void fa_prefetch_for_store(char* p, ptrdiff_t bytes)
{
    char* end = p + bytes;
    for (char* a = (char*)((uintptr_t)p & ~(uintptr_t)63); a < end; a += 64)
        __builtin_prefetch(a, 1, 3);
}

/* x[0 .. n) stored as float32, float16 or bfloat16 at dst (contiguous).  -1 where a finite
 * value overflowed the 16-bit type (stored as inf, which a cache refuses). */
static inline int fa_store_row(int kind, const float* x, ptrdiff_t n, char* dst)
{
    if (kind == FA_STORE_NATIVE) {
        memcpy(dst, x, n * sizeof(float));
        return 0;
    }
    uint16_t* h = (uint16_t*)dst;
    const uint16_t inf = fa_inf_bits(kind);
    int overflow = 0;
    ptrdiff_t i0 = 0;
#if FA_APPEND_VECTORS
    for (; i0 + FA_VL_F <= n; i0 += FA_VL_F)
        if (!fa_narrow_v(kind, fa_load_f(x + i0), h + i0, &overflow))
            break;
#endif
    for (ptrdiff_t i = i0; i < n; i++) {
        h[i] = kind == FA_STORE_F16 ? fa_f32_to_f16(x[i]) : fa_f32_to_bf16_np(x[i]);
        overflow |= (h[i] & 0x7fffu) == inf && isfinite(x[i]);
    }
    return overflow ? -1 : 0;
}

/* x[0 .. n), n a multiple of 32, as q8_0: values qs[0 .. n), float16 scales ds[0 .. n / 32).
 * -1 for a value that is not finite or beyond 127 * 65504 (its scale would not be). */
static inline int fa_quantize_q8_0_row(const float* x, ptrdiff_t n, int8_t* qs, uint16_t* ds)
{
    for (ptrdiff_t b = 0; b < n; b += FA_Q8_0_BLOCK) {
        int bad = 0;
#if FA_APPEND_VECTORS
        const float amax = fa_amax_v(x + b, FA_Q8_0_BLOCK, FA_Q8_0_MAX_ABS, &bad);
#else
        float amax = 0.0f;
        for (int j = 0; j < FA_Q8_0_BLOCK; j++) {
            const float a = fabsf(x[b + j]);
            bad |= !(a <= FA_Q8_0_MAX_ABS);
            amax = a > amax ? a : amax;
        }
#endif
        if (bad)
            return -1;
        const float d = amax / 127.0f;
        const float id = d != 0.0f ? 1.0f / d : 0.0f;
#if FA_APPEND_VECTORS
        /* roundf, halves away from zero, for |y| <= 127: the truncation t, plus one away
         * from zero where y lies half a step or more past it.  y is only compared, never
         * added to, so nothing can fuse the product into a later operation. */
        for (int j = 0; j < FA_Q8_0_BLOCK; j += FA_VL_F) {
            const fa_vf y = fa_load_f(x + b + j) * id;
            const fa_vfi t = __builtin_convertvector(y, fa_vfi);
            const fa_vf tf = __builtin_convertvector(t, fa_vf);
            const fa_vfi r = t - (fa_vfi)(y >= tf + 0.5f) + (fa_vfi)(y <= tf - 0.5f);
            fa_store_low_bytes(qs + b + j, r);
        }
#else
        /* x * id is rounded once, then to the nearest integer: nothing to fuse it into */
        for (int j = 0; j < FA_Q8_0_BLOCK; j++)
            qs[b + j] = (int8_t)roundf(x[b + j] * id);
#endif
        ds[b / FA_Q8_0_BLOCK] = fa_f32_to_f16(d);
    }
    return 0;
}

/* x[0 .. n), n a multiple of 32, as q4_0: bytes qs[0 .. n / 2) (value j of a block in the
 * low nibble of its byte j, value j + 16 in the high one), float16 scales ds[0 .. n / 32).
 * -1 for a value that is not finite or beyond 8 * 65504. */
static inline int fa_quantize_q4_0_row(const float* x, ptrdiff_t n, uint8_t* qs, uint16_t* ds)
{
    for (ptrdiff_t b = 0; b < n; b += FA_Q8_0_BLOCK) {
        float max = 0.0f;
        int bad = 0;
#if FA_APPEND_VECTORS
        /* the first value of the largest magnitude (+0 where every value is a zero) */
        const float amax = fa_amax_v(x + b, FA_Q8_0_BLOCK, FA_Q4_0_MAX_ABS, &bad);
        for (int j = 0; j < FA_Q8_0_BLOCK && amax > 0.0f; j++)
            if (fabsf(x[b + j]) == amax) {
                max = x[b + j];
                break;
            }
#else
        float amax = 0.0f;
        for (int j = 0; j < FA_Q8_0_BLOCK; j++) {
            const float a = fabsf(x[b + j]);
            bad |= !(a <= FA_Q4_0_MAX_ABS);
            if (amax < a) {                     /* the first of equal magnitudes */
                amax = a;
                max = x[b + j];
            }
        }
#endif
        if (bad)
            return -1;
        const float d = max / -8.0f;
        const float id = d != 0.0f ? 1.0f / d : 0.0f;
        /* x * id is rounded before 8.5 is added (no FMA), then truncated */
#if FA_APPEND_VECTORS
        for (int j = 0; j < FA_Q8_0_BLOCK / 2; j += FA_VL_F) {
            fa_vfi v[2];
            for (int h = 0; h < 2; h++) {
                const fa_vf y = fa_rounded_v(fa_load_f(x + b + j + h * FA_Q8_0_BLOCK / 2) * id);
                const fa_vfi t = __builtin_convertvector(y + 8.5f, fa_vfi), lt = t < 15;
                v[h] = (lt & t) | (~lt & 15);
            }
            fa_store_low_bytes(qs + b / 2 + j, v[0] | v[1] << 4);
        }
#else
        uint8_t q[FA_Q8_0_BLOCK];
        for (int j = 0; j < FA_Q8_0_BLOCK; j++) {
            const int v = (int8_t)(fa_rounded(x[b + j] * id) + 8.5f);
            q[j] = (uint8_t)(v < 15 ? v : 15);
        }
        for (int j = 0; j < FA_Q8_0_BLOCK / 2; j++)
            qs[b / 2 + j] = (uint8_t)(q[j] | q[j + FA_Q8_0_BLOCK / 2] << 4);
#endif
        ds[b / FA_Q8_0_BLOCK] = fa_f32_to_f16(d);
    }
    return 0;
}

/* f as fp8 of kind FA_STORE_E4M3 (float8_e4m3fn) or FA_STORE_E5M2: rounded to nearest,
 * ties to even, saturated to the largest finite value (inf too); f is not NaN. */
FA_INLINE uint8_t fa_f32_to_fp8(int kind, float f)
{
    const int m = kind == FA_STORE_E4M3 ? 3 : 2;            /* mantissa bits */
    const int bias = kind == FA_STORE_E4M3 ? 7 : 15;
    const float top = kind == FA_STORE_E4M3 ? 448.0f : 57344.0f;
    const float a = fminf(fabsf(f), top);
    int e;
    frexpf(a, &e);                                            /* a in [2^(e-1), 2^e) */
    /* the binade's exponent; subnormals share the smallest normal's step 2^(1 - bias - m) */
    const int ex = e - 1 < 1 - bias ? 1 - bias : e - 1;
    int mant = (int)nearbyintf(ldexpf(a, m - ex));            /* a in steps, exact; RNE */
    int expo = ex + bias;
    if (mant == 2 << m) {                                     /* rounded up a binade */
        mant = 1 << m;
        expo++;
    }
    if (mant < 1 << m)                                        /* subnormal (or zero) */
        expo = 0;
    else
        mant -= 1 << m;
    return (uint8_t)((signbit(f) ? 0x80 : 0) | expo << m | mant);
}

#if FA_APPEND_VECTORS
/* fa_f32_to_fp8 lane by lane, on the bits: from the smallest normal 2^(1 - bias) up, the
 * float32 mantissa rounded to m bits, ties to even (a carry moves into the exponent), and
 * the exponent rebiased; below it, the steps of 2^(1 - bias - m) rounded to nearest even
 * by adding and taking away 2^23 (the product by a power of two is exact, so a fused
 * multiply-add gives the same sum).  Steps of 2^m are the smallest normal's bits. */
FA_INLINE fa_vfi fa_f32_to_fp8_v(const int kind, fa_vf f)
{
    const int m = kind == FA_STORE_E4M3 ? 3 : 2, bias = kind == FA_STORE_E4M3 ? 7 : 15;
    const float top = kind == FA_STORE_E4M3 ? 448.0f : 57344.0f;
    fa_vf a = fa_abs_v(f);
    const fa_vfi over = a > top;
    a = (fa_vf)((over & (fa_vfi)fa_bcast_f(top)) | (~over & (fa_vfi)a));
    const fa_vfi w = (fa_vfi)a;
    const int sh = 23 - m;
    const fa_vfi normal = ((w + ((1 << (sh - 1)) - 1) + ((w >> sh) & 1)) >> sh)
                          - ((127 - bias) << m);
    const fa_vf steps = (a * (float)(1 << (bias - 1 + m)) + 8388608.0f) - 8388608.0f;
    const fa_vfi small = w < ((127 + 1 - bias) << 23);
    const fa_vfi mag = (small & __builtin_convertvector(steps, fa_vfi)) | (~small & normal);
    return mag | (((fa_vfi)f >> 24) & 0x80);
}
#endif

/* x[0 .. n) / scale as fp8 of kind `kind` at qs.  -1 for a value that is not finite. */
static inline int fa_quantize_fp8_row(int kind, const float* x, ptrdiff_t n, float scale,
                                      uint8_t* qs)
{
    for (ptrdiff_t i = 0; i < n; i++)
        if (!isfinite(x[i]))
            return -1;
    ptrdiff_t i0 = 0;
#if FA_APPEND_VECTORS
    for (; i0 + FA_VL_F <= n; i0 += FA_VL_F) {
        fa_store_low_bytes(qs + i0, fa_f32_to_fp8_v(kind, fa_load_f(x + i0) / scale));
    }
#endif
    for (ptrdiff_t i = i0; i < n; i++)
        qs[i] = fa_f32_to_fp8(kind, x[i] / scale);
    return 0;
}

/* x[0 .. n) stored as the quantised kind `kind` (FA_QUANTISED): values at qs, and float16
 * block scales at ds (q8_0, q4_0), or divided by the float32 scale fscale first (fp8). */
static inline int fa_quantize_row(int kind, const float* x, ptrdiff_t n, char* qs, uint16_t* ds,
                                  float fscale)
{
    if (kind == FA_STORE_Q8_0)
        return fa_quantize_q8_0_row(x, n, (int8_t*)qs, ds);
    if (kind == FA_STORE_Q4_0)
        return fa_quantize_q4_0_row(x, n, (uint8_t*)qs, ds);
    return fa_quantize_fp8_row(kind, x, n, fscale, (uint8_t*)qs);
}

#endif
