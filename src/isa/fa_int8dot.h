/*
 * fa_int8dot.h -- integer dot products for the scores over q8_0 and q4_0 keys, the opt-in
 * of fastattn.set_int8_dot_products: q is quantised per block of 32 dims as llama.cpp
 * quantises it against its quantised K, and each block's q.k is taken exactly in int32:
 * by `vpdpbusd` (AVX512-VNNI in the avx512 build, AVX-VNNI in the avx2 build) or, in the
 * avx2 build on a CPU without AVX-VNNI, by AVX2's `vpmaddubsw` and `vpmaddwd`.  Both sums
 * are exact, so both give the same bits.  The VNNI kernels have their own target
 * attribute, so the modules still load on CPUs without VNNI; the tile pipeline calls the
 * kernels only where fa_int8dot_init() found a way to run them.
 *
 * q, a row x of D float32 values (fa_int8_quant_row), block b of 32 dims:
 *     qd_b = max |x| / 127,   qi[d] = x[d] * (127 / max |x|) rounded to nearest (even),
 *     qs_b = the sum of the block's qi
 * llama.cpp's rule, with the scale kept in float32 (llama.cpp rounds it to float16).
 *
 * The chain of a score, the same in every row pass, tile and thread (so a decode step
 * keeps the bits of the prefill over the same cache, and threads, batch and pages change
 * nothing), in both builds and with either instruction:
 *     isum_b = sum over the block of qi[d] * k[d]                  (exact, int32)
 *     acc    = fma(isum_b, dk_b * qd_b, acc)   for b = 0, 1, ...    (from acc = 0)
 *     s      = acc * scale
 * with dk_b the key's block scale (float32, from its float16).  isum_b is at most
 * 32 * 127 * 128 in magnitude, exact in float32.
 *
 * vpdpbusd multiplies unsigned bytes by signed ones, four to a 32-bit lane: the key's
 * byte is the unsigned side, q8_0's k read as k + 128 (k ^ 0x80) and q4_0's nibble as
 * it is stored (k + 8); the excess, 128 qs_b or 8 qs_b, is subtracted from the sum.
 * vpmaddubsw multiplies the same way, two to a 16-bit lane that saturates, so q8_0's k
 * goes in as |k| against q with k's sign (at most 2 * 128 * 127 < 2^15 a lane), and
 * q4_0's nibbles (at most 15) as they are stored, whose 16-bit sums stay below 2^15 for a
 * whole block (16 * 15 * 127) before vpmaddwd widens them.
 *
 * Keys are the lanes: a block of 32 dims of VL keys is transposed into 8 vectors, vector
 * j holding dims 4j .. 4j+3 of every key (lane u: key u, as the float kernels' lanes).
 * q rows: qi[r * D + d] bytes, qd[r * nb + b], qs[r * nb + b] with nb = D / 32.
 */
#ifndef FA_INT8DOT_H
#define FA_INT8DOT_H

#if defined(__AVX2__) && defined(__GNUC__) && (defined(__clang__) || __GNUC__ >= 11)
#define FA_HAVE_INT8DOT 1
#else
#define FA_HAVE_INT8DOT 0
#endif

/* Whether the running CPU executes this build's vpdpbusd: AVX512-VNNI (CPUID leaf 7,
 * ECX bit 11) for the avx512 build, AVX-VNNI (leaf 7, subleaf 1, EAX bit 4) for the avx2
 * build.  The modules' own dispatch has checked that the OS saves the vector state. */
static inline int fa_cpu_has_vnni(void)
{
#if FA_HAVE_INT8DOT && FA_VBYTES == 64
    return fa_cpuid_bit(7, 0, 2, 11);
#elif FA_HAVE_INT8DOT
    return fa_cpuid_bit(7, 1, 0, 4);
#else
    return 0;
#endif
}

/* How this process takes the int8 products (CPUID traps to the hypervisor in a VM, so it
 * is asked once, at import, by fa_int8dot_init). */
enum { FA_I8_NONE = 0, FA_I8_MADD = 1, FA_I8_VNNI = 2 };
static int fa_i8_way = FA_I8_NONE;

/* Sets and returns fa_i8_way: VNNI where the CPU has it; else, in the avx2 build (whose
 * module runs only on AVX2 CPUs), vpmaddubsw; else none. */
static int fa_int8dot_init(void)
{
#if FA_HAVE_INT8DOT
    fa_i8_way = fa_cpu_has_vnni() ? FA_I8_VNNI : FA_VBYTES == 32 ? FA_I8_MADD : FA_I8_NONE;
#endif
    return fa_i8_way;
}

/* Row x quantised per block (see the top of this file); x NULL: a zero row.  A block
 * holding NaN or an infinity gets qd_b = NaN, so that the row's scores are NaN, as the
 * float products would make them. */
static void fa_int8_quant_row(const float* x, ptrdiff_t D, int8_t* qi, float* qd, int32_t* qs)
{
    for (ptrdiff_t b = 0; b < D / 32; b++) {
        float amax = 0;
        int bad = 0;
        if (x != NULL)
            for (int i = 0; i < 32; i++) {
                const float a = fabsf(x[32 * b + i]);
                bad |= !(a <= 3.4028234663852886e38f);
                amax = a > amax ? a : amax;
            }
        const float id = amax > 0 && !bad ? 127.0f / amax : 0.0f;
        int32_t sum = 0;
        for (int i = 0; i < 32; i++) {
            float v = id != 0 ? nearbyintf(x[32 * b + i] * id) : 0.0f;
            v = v > 127 ? 127 : v < -127 ? -127 : v;
            qi[32 * b + i] = (int8_t)v;
            sum += (int32_t)v;
        }
        qd[b] = bad ? NAN : amax / 127.0f;
        qs[b] = sum;
    }
}

#if FA_HAVE_INT8DOT && FA_VBYTES == 64

#define FA_I8_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni")))
#define FA_I8_INLINE static inline __attribute__((always_inline))   /* the module's flags */
#define FA_I8_VNNI_INLINE static inline __attribute__((always_inline)) FA_I8_TARGET
#define FA_I8_KEYS 16
typedef __m512i fa_i8v;
typedef __m512 fa_i8f;

/* Dims 32b .. 32b+31 of 16 q8_0 key rows, transposed (t[j]: dims 4j .. 4j+3 of each key). */
FA_I8_INLINE void fa_i8_keys_q8_0(const uint8_t* const* kr, ptrdiff_t b, fa_i8v t[8])
{
    __m512i z[8], a[8], A[4], B[4];
    for (int i = 0; i < 8; i++)   /* key i in the low half, key i + 8 in the high one */
        z[i] = _mm512_inserti64x4(
            _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i*)(kr[i] + 32 * b))),
            _mm256_loadu_si256((const __m256i*)(kr[i + 8] + 32 * b)), 1);
    for (int p = 0; p < 4; p++) {
        a[2 * p] = _mm512_unpacklo_epi32(z[2 * p], z[2 * p + 1]);
        a[2 * p + 1] = _mm512_unpackhi_epi32(z[2 * p], z[2 * p + 1]);
    }
    /* A[j] (keys 0-3, 8-11), B[j] (keys 4-7, 12-15): dims 4j.. in 128-bit lanes 0 and 2,
     * dims 16+4j.. in lanes 1 and 3 */
    for (int h = 0; h < 2; h++) {
        __m512i* o = h ? B : A;
        const __m512i* s = a + 4 * h;
        o[0] = _mm512_unpacklo_epi64(s[0], s[2]);
        o[1] = _mm512_unpackhi_epi64(s[0], s[2]);
        o[2] = _mm512_unpacklo_epi64(s[1], s[3]);
        o[3] = _mm512_unpackhi_epi64(s[1], s[3]);
    }
    const __m512i lo = _mm512_set_epi64(13, 12, 5, 4, 9, 8, 1, 0);
    const __m512i hi = _mm512_set_epi64(15, 14, 7, 6, 11, 10, 3, 2);
    for (int j = 0; j < 4; j++) {
        t[j] = _mm512_permutex2var_epi64(A[j], lo, B[j]);
        t[j + 4] = _mm512_permutex2var_epi64(A[j], hi, B[j]);
    }
}

/* The same for 16 q4_0 key rows (16 bytes a block): the nibbles as they are stored. */
FA_I8_INLINE void fa_i8_keys_q4_0(const uint8_t* const* kr, ptrdiff_t b, fa_i8v t[8])
{
    __m512i z[4];
#define FA_I8_ROW(u) _mm_loadu_si128((const __m128i*)(kr[u] + 16 * b))
    for (int i = 0; i < 4; i++) {  /* keys i, i + 4, i + 8, i + 12 in the 128-bit lanes */
        const __m512i x = _mm512_castsi128_si512(FA_I8_ROW(i));
        z[i] = _mm512_inserti32x4(_mm512_inserti32x4(_mm512_inserti32x4(
            x, FA_I8_ROW(i + 4), 1), FA_I8_ROW(i + 8), 2), FA_I8_ROW(i + 12), 3);
    }
#undef FA_I8_ROW
    const __m512i l01 = _mm512_unpacklo_epi32(z[0], z[1]), h01 = _mm512_unpackhi_epi32(z[0], z[1]);
    const __m512i l23 = _mm512_unpacklo_epi32(z[2], z[3]), h23 = _mm512_unpackhi_epi32(z[2], z[3]);
    const __m512i p[4] = {_mm512_unpacklo_epi64(l01, l23), _mm512_unpackhi_epi64(l01, l23),
                          _mm512_unpacklo_epi64(h01, h23), _mm512_unpackhi_epi64(h01, h23)};
    const __m512i m = _mm512_set1_epi8(15);
    for (int j = 0; j < 4; j++) {
        t[j] = _mm512_and_si512(p[j], m);                          /* dims 4j .. 4j+3 */
        t[j + 4] = _mm512_and_si512(_mm512_srli_epi16(p[j], 4), m);  /* dims 16+4j .. */
    }
}

/* acc += the products of k's bytes (unsigned) with the 4 bytes of q at p (signed) */
FA_I8_VNNI_INLINE fa_i8v fa_i8_dot(fa_i8v acc, fa_i8v k, const int8_t* p)
{ return _mm512_dpbusd_epi32(acc, k, _mm512_broadcastd_epi32(_mm_loadu_si32(p))); }
/* signed bytes + 128, as unsigned ones */
FA_I8_INLINE fa_i8v fa_i8_bias(fa_i8v k) { return _mm512_xor_si512(k, _mm512_set1_epi8((char)0x80)); }
FA_I8_INLINE fa_i8v fa_i8_zero(void) { return _mm512_setzero_si512(); }
FA_I8_INLINE fa_i8v fa_i8_sub(fa_i8v a, int32_t x)
{ return _mm512_sub_epi32(a, _mm512_set1_epi32(x)); }
FA_I8_INLINE fa_i8v fa_i8_add(fa_i8v a, fa_i8v b) { return _mm512_add_epi32(a, b); }
FA_I8_INLINE fa_i8f fa_i8_fzero(void) { return _mm512_setzero_ps(); }
FA_I8_INLINE fa_i8f fa_i8_fload(const float* p) { return _mm512_loadu_ps(p); }
FA_I8_INLINE fa_i8f fa_i8_fma(fa_i8v isum, fa_i8f m, fa_i8f acc)
{ return _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), m, acc); }
FA_I8_INLINE fa_i8f fa_i8_scaled(fa_i8f v, float x) { return _mm512_mul_ps(v, _mm512_set1_ps(x)); }
FA_I8_INLINE void fa_i8_fstore(float* p, fa_i8f v) { _mm512_storeu_ps(p, v); }
#define FA_I8_MAX_ROWS 8

#elif FA_HAVE_INT8DOT

#define FA_I8_TARGET __attribute__((target("avx2,fma,avxvnni")))
#define FA_I8_INLINE static inline __attribute__((always_inline))   /* the module's flags */
#define FA_I8_VNNI_INLINE static inline __attribute__((always_inline)) FA_I8_TARGET
#define FA_I8_KEYS 8
typedef __m256i fa_i8v;
typedef __m256 fa_i8f;

/* Dims 32b .. 32b+31 of 8 q8_0 key rows, transposed (t[j]: dims 4j .. 4j+3 of each key). */
FA_I8_INLINE void fa_i8_keys_q8_0(const uint8_t* const* kr, ptrdiff_t b, fa_i8v t[8])
{
    __m256i z[8], a[8], A[4], B[4];
    for (int i = 0; i < 8; i++) z[i] = _mm256_loadu_si256((const __m256i*)(kr[i] + 32 * b));
    for (int p = 0; p < 4; p++) {
        a[2 * p] = _mm256_unpacklo_epi32(z[2 * p], z[2 * p + 1]);
        a[2 * p + 1] = _mm256_unpackhi_epi32(z[2 * p], z[2 * p + 1]);
    }
    for (int h = 0; h < 2; h++) {   /* A: keys 0-3, B: keys 4-7; dims 4j.. low, 16+4j.. high */
        __m256i* o = h ? B : A;
        const __m256i* s = a + 4 * h;
        o[0] = _mm256_unpacklo_epi64(s[0], s[2]);
        o[1] = _mm256_unpackhi_epi64(s[0], s[2]);
        o[2] = _mm256_unpacklo_epi64(s[1], s[3]);
        o[3] = _mm256_unpackhi_epi64(s[1], s[3]);
    }
    for (int j = 0; j < 4; j++) {
        t[j] = _mm256_permute2x128_si256(A[j], B[j], 0x20);
        t[j + 4] = _mm256_permute2x128_si256(A[j], B[j], 0x31);
    }
}

/* The same for 8 q4_0 key rows (16 bytes a block): the nibbles as they are stored. */
FA_I8_INLINE void fa_i8_keys_q4_0(const uint8_t* const* kr, ptrdiff_t b, fa_i8v t[8])
{
    __m256i z[4];
    for (int i = 0; i < 4; i++)   /* keys i and i + 4 in the 128-bit lanes */
        z[i] = _mm256_inserti128_si256(
            _mm256_castsi128_si256(_mm_loadu_si128((const __m128i*)(kr[i] + 16 * b))),
            _mm_loadu_si128((const __m128i*)(kr[i + 4] + 16 * b)), 1);
    const __m256i l01 = _mm256_unpacklo_epi32(z[0], z[1]), h01 = _mm256_unpackhi_epi32(z[0], z[1]);
    const __m256i l23 = _mm256_unpacklo_epi32(z[2], z[3]), h23 = _mm256_unpackhi_epi32(z[2], z[3]);
    const __m256i p[4] = {_mm256_unpacklo_epi64(l01, l23), _mm256_unpackhi_epi64(l01, l23),
                          _mm256_unpacklo_epi64(h01, h23), _mm256_unpackhi_epi64(h01, h23)};
    const __m256i m = _mm256_set1_epi8(15);
    for (int j = 0; j < 4; j++) {
        t[j] = _mm256_and_si256(p[j], m);
        t[j + 4] = _mm256_and_si256(_mm256_srli_epi16(p[j], 4), m);
    }
}

/* q's 4 bytes at p in every 32-bit lane */
FA_I8_INLINE fa_i8v fa_i8_q4(const int8_t* p) { return _mm256_broadcastd_epi32(_mm_loadu_si32(p)); }
FA_I8_VNNI_INLINE fa_i8v fa_i8_dot(fa_i8v acc, fa_i8v k, const int8_t* p)
{ return _mm256_dpbusd_avx_epi32(acc, k, fa_i8_q4(p)); }
FA_I8_INLINE fa_i8v fa_i8_bias(fa_i8v k) { return _mm256_xor_si256(k, _mm256_set1_epi8((char)0x80)); }
/* The vpmaddubsw way (no VNNI): q's 4 bytes against k's unsigned bytes, two products to
 * a 16-bit lane; with k's sign (q8_0) or without (q4_0's nibbles). */
FA_I8_INLINE fa_i8v fa_i8_abs(fa_i8v k) { return _mm256_abs_epi8(k); }
FA_I8_INLINE fa_i8v fa_i8_pairs(fa_i8v k_unsigned, fa_i8v q) { return _mm256_maddubs_epi16(k_unsigned, q); }
FA_I8_INLINE fa_i8v fa_i8_pairs_signed(fa_i8v k_abs, fa_i8v k, fa_i8v q)
{ return _mm256_maddubs_epi16(k_abs, _mm256_sign_epi8(q, k)); }
FA_I8_INLINE fa_i8v fa_i8_add16(fa_i8v a, fa_i8v b) { return _mm256_add_epi16(a, b); }
/* 16-bit lanes summed in pairs into 32-bit ones */
FA_I8_INLINE fa_i8v fa_i8_widen16(fa_i8v x) { return _mm256_madd_epi16(x, _mm256_set1_epi16(1)); }
FA_I8_INLINE fa_i8v fa_i8_zero(void) { return _mm256_setzero_si256(); }
FA_I8_INLINE fa_i8v fa_i8_sub(fa_i8v a, int32_t x)
{ return _mm256_sub_epi32(a, _mm256_set1_epi32(x)); }
FA_I8_INLINE fa_i8v fa_i8_add(fa_i8v a, fa_i8v b) { return _mm256_add_epi32(a, b); }
FA_I8_INLINE fa_i8f fa_i8_fzero(void) { return _mm256_setzero_ps(); }
FA_I8_INLINE fa_i8f fa_i8_fload(const float* p) { return _mm256_loadu_ps(p); }
FA_I8_INLINE fa_i8f fa_i8_fma(fa_i8v isum, fa_i8f m, fa_i8f acc)
{ return _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), m, acc); }
FA_I8_INLINE fa_i8f fa_i8_scaled(fa_i8f v, float x) { return _mm256_mul_ps(v, _mm256_set1_ps(x)); }
FA_I8_INLINE void fa_i8_fstore(float* p, fa_i8f v) { _mm256_storeu_ps(p, v); }
#define FA_I8_MAX_ROWS 4

#endif

#if FA_HAVE_INT8DOT

#define FA_SCORE_INT8_ARGS const uint8_t* const* kr, const float* ksc, ptrdiff_t ldksc, int nk, \
    const int8_t* qi, const float* qd, const int32_t* qs, ptrdiff_t D, float scale, float* s, \
    ptrdiff_t lds, int nstore, const char* const* pf, int npf, const char* const* l1, int nl1
#define FA_SCORE_INT8_PASS kr, ksc, ldksc, nk, qi, qd, qs, D, scale, s, lds, nstore, pf, npf, l1, nl1

#define FA_I8B_VNNI 1
#define FA_I8B(name) name##_vnni
#define FA_I8B_ATTR FA_I8_TARGET
#include "fa_int8dot_body.h"
#if FA_VBYTES == 32
#define FA_I8B_VNNI 0
#define FA_I8B(name) name##_madd
#define FA_I8B_ATTR
#include "fa_int8dot_body.h"
#endif

/* One score pass of nr rows (1, 2, 4 or FA_I8_MAX_ROWS) over FA_I8_KEYS keys stored as
 * `kind` (q8_0 or q4_0), the way fa_int8dot_init chose. */
static void fa_score_int8(int kind, int nr, FA_SCORE_INT8_ARGS)
{
#if FA_VBYTES == 32
    if (fa_i8_way == FA_I8_MADD) {
        fa_score_int8_madd(kind, nr, FA_SCORE_INT8_PASS);
        return;
    }
#endif
    fa_score_int8_vnni(kind, nr, FA_SCORE_INT8_PASS);
}

#else   /* no integer products in this build: never called (fa_int8dot_init() is 0) */
#define FA_I8_KEYS FA_VL_F
#define FA_I8_MAX_ROWS 4
static void fa_score_int8(int kind, int nr, const uint8_t* const* kr, const float* ksc,
                          ptrdiff_t ldksc, int nk, const int8_t* qi, const float* qd,
                          const int32_t* qs, ptrdiff_t D, float scale, float* s, ptrdiff_t lds,
                          int nstore, const char* const* pf, int npf, const char* const* l1,
                          int nl1)
{
    (void)kind; (void)nr; (void)kr; (void)ksc; (void)ldksc; (void)nk; (void)qi; (void)qd;
    (void)qs; (void)D; (void)scale; (void)s; (void)lds; (void)nstore; (void)pf; (void)npf;
    (void)l1; (void)nl1;
}
#endif

#endif /* FA_INT8DOT_H */
