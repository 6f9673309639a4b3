/*
 * fa_quant.h -- decode kernels that read K and V stored in one byte per value or less
 * (q8_0, q4_0, fp8) where they are stored (float compute).  Each storage kind is an
 * instantiation of one template, given by three things:
 *
 *   fa_quant_bytes   the stored bytes of VL values of a row from dim d0 (int8 for q8_0
 *                    and q4_0, whose nibbles are unpacked here; the bit patterns for fp8);
 *   fa_quant_widen   those bytes as floats: the value's *level*, exact in float32;
 *   the scales       float32, per key and block of 32 dims (q8_0, q4_0: the float16
 *                    scales) or one per kv head (fp8: the scale times FA_E4M3_UNIT).
 *
 * A value is level * scale, one float32 multiplication, wherever it is read: in these
 * kernels, as they load, or by fa_dequant_row (the prefill's gather) into a workspace that
 * the float kernels read.  The chains after it are the float kernels', so a decode step
 * gives the bits of the prefill over the same cache.  For q8_0 and q4_0 the product is
 * exact (a small integer times a float16); for fp8 it is the stored value times the
 * scale rounded once to float32.
 *
 * Rows are addressed one pointer per key (kr[j]), so that rows in pages cost what
 * contiguous rows do.  Included by fa_kernels.h after the float kernels (it uses their
 * transpose and vector helpers).
 */

/* The kinds instantiated below: X(name, kind). */
#define FA_QUANT_KINDS(X) \
    X(q8_0, FA_STORE_Q8_0) X(q4_0, FA_STORE_Q4_0) X(e4m3, FA_STORE_E4M3) X(e5m2, FA_STORE_E5M2)

/* An e4m3 value's level is the value / 2^8: its bits then read as a float16's (exponent
 * bias 15 against 7), subnormals included.  Its per-head scale is multiplied by 2^8 once. */
#define FA_E4M3_UNIT 256.0f

FA_INLINE ptrdiff_t fa_quant_row_bytes(const int kind, ptrdiff_t n)
{
    return fa_kind_row_items(kind, n);
}

/* Where the byte of value d of a q4_0 row is: blocks of 32 values in 16 bytes, value
 * j < 16 of a block in the low nibble of byte j, value j + 16 in its high nibble. */
FA_INLINE ptrdiff_t fa_q4_0_byte(ptrdiff_t d) { return (d / 32) * 16 + d % 16; }

/* The float16 bits of 16-bit lanes each holding an fp8 byte (see FA_E4M3_UNIT); e4m3fn's
 * only NaNs, S.1111.111, become float16 NaNs. */
FA_INLINE uint16_t fa_fp8_half(const int kind, uint16_t x)
{
    if (kind == FA_STORE_E5M2) return (uint16_t)(x << 8);
    return (uint16_t)(((x & 0x80) << 8) | ((x & 0x7F) << 7) | ((x & 0x7F) == 0x7F ? 0x7E00 : 0));
}

/* The level of value d of a row, one at a time (the portable build, and row tails). */
FA_INLINE float fa_quant_level(const int kind, const uint8_t* row, ptrdiff_t d)
{
    if (kind == FA_STORE_Q8_0) return (float)(int8_t)row[d];
    if (kind == FA_STORE_Q4_0) {
        const uint8_t b = row[fa_q4_0_byte(d)];
        return (float)(((d & 16) ? b >> 4 : b & 15) - 8);
    }
    return fa_f16_to_f32(fa_fp8_half(kind, row[d]));
}

#if defined(__AVX2__) && defined(__F16C__)
/* The stored bytes that hold values d0 .. d0 + VL of a row (d0 a multiple of VL), in the
 * low VL bytes: q4_0's still packed (see fa_q4_0_unpack). */
FA_INLINE __m128i fa_quant_raw(const int kind, const uint8_t* row, ptrdiff_t d0)
{
    const uint8_t* p = row + (kind == FA_STORE_Q4_0 ? fa_q4_0_byte(d0) : d0);
#if FA_VBYTES == 64
    return _mm_loadu_si128((const __m128i*)p);
#else
    return _mm_loadl_epi64((const __m128i*)p);
#endif
}

/* q4_0 bytes as int8 values: their low nibbles (values j of their blocks), or with hi
 * their high ones (values j + 16), less 8. */
FA_INLINE __m128i fa_q4_0_unpack(__m128i x, const int hi)
{
    if (hi) x = _mm_srli_epi16(x, 4);
    return _mm_sub_epi8(_mm_and_si128(x, _mm_set1_epi8(15)), _mm_set1_epi8(8));
}
#if FA_VBYTES == 64
FA_INLINE __m512i fa_q4_0_unpack64(__m512i x, const int hi)
{
    if (hi) x = _mm512_srli_epi16(x, 4);
    return _mm512_sub_epi8(_mm512_and_si512(x, _mm512_set1_epi8(15)), _mm512_set1_epi8(8));
}
#endif

/* The bytes of values d0 .. d0 + VL of a row, q4_0's unpacked. */
FA_INLINE __m128i fa_quant_bytes(const int kind, const uint8_t* row, ptrdiff_t d0)
{
    const __m128i x = fa_quant_raw(kind, row, d0);
    return kind == FA_STORE_Q4_0 ? fa_q4_0_unpack(x, d0 & 16) : x;
}

/* VL 16-bit lanes (fp8 bytes widened, then float16 bits). */
typedef uint16_t fa_vh16 __attribute__((vector_size(2 * FA_VL_F)));

/* fa_fp8_half lane by lane: h, 16-bit lanes, from w, the same lanes each holding an fp8
 * byte sign-extended (an e4m3 byte shifted so that its sign lands in bit 15 and its other
 * bits in 13..7, bit 14 cleared); nan: the byte may be an e4m3fn NaN. */
#define FA_FP8_HALF_LANES(h, kind, w, nan) \
    do { \
        if ((kind) == FA_STORE_E5M2) { \
            (h) = (w) << 8; \
        } else { \
            (h) = ((w) << 7) & 0xBF80; \
            if (nan) (h) |= (__typeof__(h))(((h) & 0x7FFF) == 0x3F80) & 0x7E00; \
        } \
    } while (0)

/* VL float16 values (their bits in 16-bit lanes) as floats. */
FA_INLINE fa_vf fa_half_lanes_f(fa_vh16 h)
{
#if FA_VBYTES == 64
    return (fa_vf)_mm512_cvtph_ps((__m256i)h);
#else
    return (fa_vf)_mm256_cvtph_ps((__m128i)h);
#endif
}

/* The bytes of b (a vector of chars) that are e4m3fn NaNs (S.1111.111): all ones, the
 * others zero. */
#define FA_E4M3_NAN_BYTES(b) (((b) | (char)0x80) == (char)0xFF)
FA_INLINE __m128i fa_e4m3_nan_bytes(__m128i b)
{
    typedef char fa_b16 __attribute__((vector_size(16)));
    return (__m128i)FA_E4M3_NAN_BYTES((fa_b16)b);
}

/* Whether any of the low VL bytes of b is an e4m3fn NaN. */
FA_INLINE int fa_e4m3_nan(__m128i b)
{
    return (_mm_movemask_epi8(fa_e4m3_nan_bytes(b)) & ((1 << FA_VL_F) - 1)) != 0;
}

/* VL bytes (the low VL of b) as the levels of their values; e4m3 bytes as finite values
 * only (NaN bytes read as 1.875 unless `nan` is set: the caller checks, a block at a
 * time, whether there are any). */
FA_INLINE fa_vf fa_quant_widen(const int kind, __m128i b, const int nan)
{
#if FA_VBYTES == 64
    if (kind == FA_STORE_Q8_0 || kind == FA_STORE_Q4_0)
        return (fa_vf)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b));
    const fa_vh16 w = (fa_vh16)_mm256_cvtepi8_epi16(b);
#else
    if (kind == FA_STORE_Q8_0 || kind == FA_STORE_Q4_0)
        return (fa_vf)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
    const fa_vh16 w = (fa_vh16)_mm_cvtepi8_epi16(b);
#endif
    fa_vh16 h;
    FA_FP8_HALF_LANES(h, kind, w, nan);
    return fa_half_lanes_f(h);
}

/* Two vectors of fp8 levels from 2 VL bytes (the low VL, then the high VL): all of them
 * widened to float16 bits at once, then each half converted; per value the bits of
 * fa_quant_widen, at fewer instructions. */
#if FA_VBYTES == 64
typedef __m256i fa_fp8x2;
typedef __m512i fa_fp8x2_lanes;
#define FA_FP8X2_WIDEN _mm512_cvtepi8_epi16
#define FA_FP8X2_LO(h) _mm512_castsi512_si256(h)
#define FA_FP8X2_HI(h) _mm512_extracti64x4_epi64(h, 1)
#else
typedef __m128i fa_fp8x2;
typedef __m256i fa_fp8x2_lanes;
#define FA_FP8X2_WIDEN _mm256_cvtepi8_epi16
#define FA_FP8X2_LO(h) _mm256_castsi256_si128(h)
#define FA_FP8X2_HI(h) _mm256_extracti128_si256(h, 1)
#endif
typedef uint16_t fa_vh2 __attribute__((vector_size(sizeof(fa_fp8x2_lanes))));
FA_INLINE void fa_fp8_widen2(const int kind, fa_fp8x2 b, const int nan, fa_vf* x)
{
    fa_vh2 h;
    FA_FP8_HALF_LANES(h, kind, (fa_vh2)FA_FP8X2_WIDEN(b), nan);
    x[0] = fa_half_lanes_f((fa_vh16)FA_FP8X2_LO((fa_fp8x2_lanes)h));
    x[1] = fa_half_lanes_f((fa_vh16)FA_FP8X2_HI((fa_fp8x2_lanes)h));
}

/* The levels of values d0 .. d0 + VL of a row. */
FA_INLINE fa_vf fa_quant_vload(const int kind, const uint8_t* row, ptrdiff_t d0)
{
    const __m128i b = fa_quant_bytes(kind, row, d0);
    if (kind == FA_STORE_E4M3 && fa_e4m3_nan(b)) return fa_quant_widen(kind, b, 1);
    return fa_quant_widen(kind, b, 0);
}
#else
FA_INLINE fa_vf fa_quant_vload(const int kind, const uint8_t* row, ptrdiff_t d0)
{
    float w[FA_VL_F];
    for (int i = 0; i < FA_VL_F; i++) w[i] = fa_quant_level(kind, row, d0 + i);
    return fa_load_f(w);
}
#endif

#if defined(__AVX2__) && defined(__F16C__)
/* The levels of nv (even, at most 8) vectors of an fp8 row's values from d0: two
 * vectors' bytes read at once, one check for e4m3fn NaNs over them all,
 * then fa_fp8_widen2. */
FA_INLINE void fa_fp8_vloads(const int kind, const uint8_t* row, ptrdiff_t d0, const int nv,
                             fa_vf* x)
{
    typedef char fa_b2 __attribute__((vector_size(sizeof(fa_fp8x2))));
    fa_fp8x2 b[4];
    fa_b2 any = {0};
    for (int i = 0; i < nv / 2; i++) {
        memcpy(&b[i], row + d0 + 2 * FA_VL_F * i, sizeof(fa_fp8x2));
        if (kind == FA_STORE_E4M3) any |= FA_E4M3_NAN_BYTES((fa_b2)b[i]);
    }
#if FA_VBYTES == 64
    const int nan = kind == FA_STORE_E4M3 && !_mm256_testz_si256((__m256i)any, (__m256i)any);
#else
    const int nan = kind == FA_STORE_E4M3 && !_mm_testz_si128((__m128i)any, (__m128i)any);
#endif
    if (nan) {
        for (int i = 0; i < nv / 2; i++) fa_fp8_widen2(kind, b[i], 1, x + 2 * i);
    } else {
        for (int i = 0; i < nv / 2; i++) fa_fp8_widen2(kind, b[i], 0, x + 2 * i);
    }
}
#endif

/* The levels of nv vectors of values of a row from d0 (one check for e4m3 NaNs). */
FA_INLINE void fa_quant_vloads(const int kind, const uint8_t* row, ptrdiff_t d0, const int nv,
                               fa_vf* x)
{
#if defined(__AVX2__) && defined(__F16C__)
    if ((kind == FA_STORE_E4M3 || kind == FA_STORE_E5M2) && nv % 2 == 0) {
        fa_fp8_vloads(kind, row, d0, nv, x);
        return;
    }
    /* With 8 lanes a q4_0 block's 16 bytes are read at once, their nibbles unpacked
     * together, for two vectors. */
    const int pairs = FA_VBYTES == 32 && kind == FA_STORE_Q4_0 && nv % 2 == 0 && d0 % 16 == 0;
    const int nload = pairs ? nv / 2 : nv;
    __m128i b[8], any = _mm_setzero_si128();
    for (int i = 0; i < nload; i++) {
        const ptrdiff_t d = d0 + 16 * i;
        if (!pairs)
            b[i] = fa_quant_bytes(kind, row, d0 + i * FA_VL_F);
        else
            b[i] = fa_q4_0_unpack(_mm_loadu_si128((const __m128i*)(row + fa_q4_0_byte(d))),
                                  d & 16);
        if (kind == FA_STORE_E4M3) any = _mm_or_si128(any, fa_e4m3_nan_bytes(b[i]));
    }
    /* (the bytes past VL of a vector's load are zeros, never NaNs) */
    const int nan = kind == FA_STORE_E4M3 && _mm_movemask_epi8(any) != 0;
    for (int i = 0; i < nload; i++) {
        if (pairs) {
            x[2 * i] = fa_quant_widen(kind, b[i], 0);
            x[2 * i + 1] = fa_quant_widen(kind, _mm_unpackhi_epi64(b[i], b[i]), 0);
            continue;
        }
        x[i] = nan ? fa_quant_widen(kind, b[i], 1) : fa_quant_widen(kind, b[i], 0);
    }
#else
    for (int i = 0; i < nv; i++) x[i] = fa_quant_vload(kind, row, d0 + i * FA_VL_F);
#endif
}

/* A row of n values in the compute type (the gather of the prefill tiles): value c is
 * level(c) * d, d the float32 scale of c's block (bscale, float16 per 32 values) or of
 * the whole row (fscale: an fp8 row's kv head, times FA_E4M3_UNIT for e4m3). */
FA_INLINE float fa_quant_scale(const int kind, const uint16_t* bscale, float fscale,
                               ptrdiff_t c)
{
    return FA_BLOCK_SCALED(kind) ? fa_f16_to_f32(bscale[c / 32]) : fscale;
}

FA_INLINE void fa_dequant_row_body(const int kind, const uint8_t* __restrict x,
                                   const uint16_t* __restrict bscale, float fscale,
                                   ptrdiff_t n, float* __restrict y)
{
    ptrdiff_t c = 0;
    for (; c + FA_VL_F <= n; c += FA_VL_F)
        fa_store_f(y + c, fa_quant_vload(kind, x, c)
                              * fa_bcast_f(fa_quant_scale(kind, bscale, fscale, c)));
    for (; c < n; c++) y[c] = fa_quant_level(kind, x, c) * fa_quant_scale(kind, bscale, fscale, c);
}

static void fa_dequant_row_f(int kind, const uint8_t* __restrict x,
                             const uint16_t* __restrict bscale, float fscale, ptrdiff_t n,
                             float* __restrict y)
{
#define FA_CASE(NAME, KIND) case KIND: fa_dequant_row_body(KIND, x, bscale, fscale, n, y); return;
    switch (kind) { FA_QUANT_KINDS(FA_CASE) }
#undef FA_CASE
}

/* In double compute the product is exact (at most 4 + 24 significant bits). */
static void fa_dequant_row_d(int kind, const uint8_t* __restrict x,
                             const uint16_t* __restrict bscale, float fscale, ptrdiff_t n,
                             double* __restrict y)
{
    for (ptrdiff_t c = 0; c < n; c++)
        y[c] = (double)fa_quant_level(kind, x, c) * (double)fa_quant_scale(kind, bscale, fscale, c);
}

/* A VL x VL block of keys (rows kr[0..VL), dims d0 .. d0 + VL) transposed in two steps:
 * fa_quant_load reads it, fa_quant_half(h) then gives t[i] = the VL keys at dim
 * d0 + h VL/2 + i (i < VL/2) as levels, not yet scaled.  In halves, the FMAs of two
 * blocks can be interleaved without spilling. */
#if FA_VBYTES == 64
/* The 16 x 16 byte block is transposed as bytes, 24 shuffles against the 80 of a float
 * transpose (then a lane extraction and a widening per dim): rows t, t + 4, t + 8,
 * t + 12 in the 128-bit lanes of z[t]; byte unpacks (kept: x[0..1] dims 0-7, x[2..3]
 * dims 8-15) and word unpacks leave in lane g the dims of keys 4g .. 4g + 3, a dword per
 * dim; one dword permutation then gathers a dim's 16 keys into one 128-bit lane, which
 * is widened. */
typedef struct { __m512i x[4]; int nan; } fa_quant_blk;

/* The stored bytes of the 16 rows at d0: rows t, t + 4, t + 8, t + 12 in the 128-bit
 * lanes of z[t]. */
FA_INLINE void fa_quant_raw16(const int kind, const uint8_t* const* kr, ptrdiff_t d0,
                              __m512i* z)
{
    for (int r = 0; r < 4; r++) {
        __m512i x = _mm512_castsi128_si512(fa_quant_raw(kind, kr[r], d0));
        x = _mm512_inserti32x4(x, fa_quant_raw(kind, kr[4 + r], d0), 1);
        x = _mm512_inserti32x4(x, fa_quant_raw(kind, kr[8 + r], d0), 2);
        z[r] = _mm512_inserti32x4(x, fa_quant_raw(kind, kr[12 + r], d0), 3);
    }
}
/* The byte unpacks of the transpose, z (as fa_quant_raw16 lays them out) into u. */
FA_INLINE void fa_quant_unpack16(const __m512i* z, fa_quant_blk* u)
{
    u->x[0] = _mm512_unpacklo_epi8(z[0], z[1]);
    u->x[1] = _mm512_unpacklo_epi8(z[2], z[3]);
    u->x[2] = _mm512_unpackhi_epi8(z[0], z[1]);
    u->x[3] = _mm512_unpackhi_epi8(z[2], z[3]);
}

FA_INLINE void fa_quant_load(const int kind, const uint8_t* const* kr, ptrdiff_t d0,
                             fa_quant_blk* u)
{
    __m512i z[4];
    fa_quant_raw16(kind, kr, d0, z);
    if (kind == FA_STORE_Q4_0)   /* (q4_0's nibbles unpacked 64 at a time) */
        for (int r = 0; r < 4; r++) z[r] = fa_q4_0_unpack64(z[r], d0 & 16);
    u->nan = 0;
    if (kind == FA_STORE_E4M3) {   /* any e4m3fn NaN in the block (see fa_quant_widen) */
        typedef char fa_b64 __attribute__((vector_size(64)));
        fa_b64 any = {0};
        for (int r = 0; r < 4; r++) any |= FA_E4M3_NAN_BYTES((fa_b64)z[r]);
        u->nan = _mm512_test_epi8_mask((__m512i)any, (__m512i)any) != 0;
    }
    fa_quant_unpack16(z, u);
}

/* A q4_0 block of 32 dims of the 16 keys at once: the rows' 16 bytes loaded once, u[s]
 * what fa_quant_load gives for dims d0 + 16 s (low nibbles, then high ones). */
#define FA_HAVE_Q4_0_LOAD32 1
FA_INLINE void fa_q4_0_load32(const uint8_t* const* kr, ptrdiff_t d0, fa_quant_blk u[2])
{
    __m512i z[4], n[4];
    fa_quant_raw16(FA_STORE_Q4_0, kr, d0, z);
    for (int s = 0; s < 2; s++) {
        for (int r = 0; r < 4; r++) n[r] = fa_q4_0_unpack64(z[r], s);
        fa_quant_unpack16(n, &u[s]);
        u[s].nan = 0;
    }
}

FA_INLINE fa_vf fa_quant_lane(const int kind, __m512i b, const int lane, const int nan)
{
    /* The lane of the extract is an immediate: each one spelled out, as Clang requires a
     * literal constant where GCC accepts one that inlining makes constant. */
    __m128i x;
    switch (lane) {
    case 1: x = _mm512_extracti32x4_epi32(b, 1); break;
    case 2: x = _mm512_extracti32x4_epi32(b, 2); break;
    case 3: x = _mm512_extracti32x4_epi32(b, 3); break;
    default: x = _mm512_castsi512_si128(b); break;
    }
    return fa_quant_widen(kind, x, nan);
}

FA_INLINE void fa_quant_half(const int kind, const fa_quant_blk* u, const int h, fa_vf* t)
{
    const __m512i idx = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    const __m512i lo = u->x[2 * h], hi = u->x[2 * h + 1];
    const __m512i b0 = _mm512_permutexvar_epi32(idx, _mm512_unpacklo_epi16(lo, hi));
    const __m512i b1 = _mm512_permutexvar_epi32(idx, _mm512_unpackhi_epi16(lo, hi));
#define FA_LANES(NAN) \
    if (kind == FA_STORE_E4M3 || kind == FA_STORE_E5M2) { \
        fa_fp8_widen2(kind, _mm512_castsi512_si256(b0), NAN, t); \
        fa_fp8_widen2(kind, _mm512_extracti64x4_epi64(b0, 1), NAN, t + 2); \
        fa_fp8_widen2(kind, _mm512_castsi512_si256(b1), NAN, t + 4); \
        fa_fp8_widen2(kind, _mm512_extracti64x4_epi64(b1, 1), NAN, t + 6); \
    } else { \
        for (int i = 0; i < 4; i++) { \
            t[i] = fa_quant_lane(kind, b0, i, NAN); \
            t[4 + i] = fa_quant_lane(kind, b1, i, NAN); \
        } \
    }
    if (kind == FA_STORE_E4M3 && u->nan) {
        FA_LANES(1)
    } else {
        FA_LANES(0)
    }
#undef FA_LANES
}
#elif defined(__AVX2__) && defined(__F16C__)
/* The 8 x 8 byte block is transposed as bytes, 12 unpacks against the 24 shuffles of a
 * float transpose and its round trip through memory: byte, word and dword unpacks leave
 * in c[i] dims 2i and 2i + 1, each a qword of the 8 keys' bytes, which is then widened. */
typedef struct { __m128i c[4]; int nan; } fa_quant_blk;

/* The byte and word unpacks of the 8 x 8 transpose: a[i] interleaves the 8 bytes of rows
 * 2i and 2i + 1; c[i] gets dims 2i and 2i + 1 of the 8 keys. */
FA_INLINE void fa_bytes8x8_transpose(const __m128i* a, __m128i* c)
{
    const __m128i b0 = _mm_unpacklo_epi16(a[0], a[1]);     /* dims 0-3, keys 0-3 */
    const __m128i b1 = _mm_unpackhi_epi16(a[0], a[1]);     /* dims 4-7, keys 0-3 */
    const __m128i b2 = _mm_unpacklo_epi16(a[2], a[3]);     /* dims 0-3, keys 4-7 */
    const __m128i b3 = _mm_unpackhi_epi16(a[2], a[3]);     /* dims 4-7, keys 4-7 */
    c[0] = _mm_unpacklo_epi32(b0, b2);
    c[1] = _mm_unpackhi_epi32(b0, b2);
    c[2] = _mm_unpacklo_epi32(b1, b3);
    c[3] = _mm_unpackhi_epi32(b1, b3);
}

FA_INLINE void fa_quant_load(const int kind, const uint8_t* const* kr, ptrdiff_t d0,
                             fa_quant_blk* u)
{
    __m128i x[8], a[4];
    for (int r = 0; r < 8; r++) x[r] = fa_quant_bytes(kind, kr[r], d0);
    for (int i = 0; i < 4; i++) a[i] = _mm_unpacklo_epi8(x[2 * i], x[2 * i + 1]);
    fa_bytes8x8_transpose(a, u->c);
    u->nan = 0;
    if (kind == FA_STORE_E4M3) {   /* any e4m3fn NaN in the block (see fa_quant_widen) */
        __m128i any = _mm_setzero_si128();
        for (int i = 0; i < 4; i++) any = _mm_or_si128(any, fa_e4m3_nan_bytes(u->c[i]));
        u->nan = _mm_movemask_epi8(any) != 0;
    }
}

FA_INLINE void fa_quant_half(const int kind, const fa_quant_blk* u, const int h, fa_vf* t)
{
#define FA_DIMS(NAN) \
    for (int i = 0; i < 2; i++) { \
        const __m128i c = u->c[2 * h + i]; \
        if (kind == FA_STORE_E4M3 || kind == FA_STORE_E5M2) { \
            fa_fp8_widen2(kind, c, NAN, t + 2 * i); \
            continue; \
        } \
        t[2 * i] = fa_quant_widen(kind, c, NAN); \
        t[2 * i + 1] = fa_quant_widen(kind, _mm_unpackhi_epi64(c, c), NAN); \
    }
    if (kind == FA_STORE_E4M3 && u->nan) {
        FA_DIMS(1)
    } else {
        FA_DIMS(0)
    }
#undef FA_DIMS
}

/* A q4_0 block of 32 dims of the 8 keys at once: each row's 16 bytes transposed once
 * (bytes 0-7, then 8-15), their nibbles unpacked after the transpose; u[s] is what
 * fa_quant_load gives for dims d0 + 8 s (s < 4; low nibbles are dims 0-15, high ones
 * 16-31), at half its loads and transposes over the four. */
#define FA_HAVE_Q4_0_LOAD32 1
FA_INLINE void fa_q4_0_load32(const uint8_t* const* kr, ptrdiff_t d0, fa_quant_blk u[4])
{
    __m128i x[8], lo[4], hi[4], c[2][4];
    for (int r = 0; r < 8; r++)
        x[r] = _mm_loadu_si128((const __m128i*)(kr[r] + fa_q4_0_byte(d0)));
    for (int i = 0; i < 4; i++) {
        lo[i] = _mm_unpacklo_epi8(x[2 * i], x[2 * i + 1]);
        hi[i] = _mm_unpackhi_epi8(x[2 * i], x[2 * i + 1]);
    }
    fa_bytes8x8_transpose(lo, c[0]);
    fa_bytes8x8_transpose(hi, c[1]);
    for (int s = 0; s < 4; s++) {
        for (int i = 0; i < 4; i++) u[s].c[i] = fa_q4_0_unpack(c[s % 2][i], s >= 2);
        u[s].nan = 0;
    }
}
#else
/* Each row widened into a small buffer, then the float transpose, all at load. */
typedef struct { fa_vf t[FA_VL_F]; } fa_quant_blk;

FA_INLINE void fa_quant_load(const int kind, const uint8_t* const* kr, ptrdiff_t d0,
                             fa_quant_blk* u)
{
    float w[FA_VL_F][FA_VL_F];
    const float* rows[FA_VL_F];
    for (int i = 0; i < FA_VL_F; i++) {
        fa_store_f(w[i], fa_quant_vload(kind, kr[i], d0));
        rows[i] = w[i];
    }
    fa_load_transpose_vf(rows, 0, u->t);
}

FA_INLINE void fa_quant_half(const int kind, const fa_quant_blk* u, const int h, fa_vf* t)
{
    (void)kind;
    for (int i = 0; i < FA_VL_F / 2; i++) t[i] = u->t[h * FA_VL_F / 2 + i];
}
#endif

#if FA_VBYTES == 64
/* The float32 scales of 16 keys x 4 blocks (D = 128), stored key by key (ks, 64 float16
 * values), transposed block by block into ksc[b * ldksc + u]. */
FA_INLINE void fa_q8_0_ksc16x4(const uint16_t* ks, float* ksc, ptrdiff_t ldksc)
{
    __m512 a[4];
    for (int i = 0; i < 4; i++)
        a[i] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(ks + 16 * i)));
    /* lane m: block (m >> 3) (+ 2 for hi) of key m & 7 of the pair a[0], a[1] (a[2], a[3]) */
    const __m512i lo = _mm512_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28,
                                         1, 5, 9, 13, 17, 21, 25, 29);
    const __m512i hi = _mm512_add_epi32(lo, _mm512_set1_epi32(2));
    const __m512 t_lo = _mm512_permutex2var_ps(a[0], lo, a[1]);
    const __m512 t_hi = _mm512_permutex2var_ps(a[0], hi, a[1]);
    const __m512 s_lo = _mm512_permutex2var_ps(a[2], lo, a[3]);
    const __m512 s_hi = _mm512_permutex2var_ps(a[2], hi, a[3]);
    _mm512_storeu_ps(ksc, _mm512_shuffle_f32x4(t_lo, s_lo, 0x44));
    _mm512_storeu_ps(ksc + ldksc, _mm512_shuffle_f32x4(t_lo, s_lo, 0xEE));
    _mm512_storeu_ps(ksc + 2 * ldksc, _mm512_shuffle_f32x4(t_hi, s_hi, 0x44));
    _mm512_storeu_ps(ksc + 3 * ldksc, _mm512_shuffle_f32x4(t_hi, s_hi, 0xEE));
}
#elif defined(__AVX2__) && defined(__F16C__)
/* The same for 8 keys: a[i] holds keys 2i and 2i + 1 (a 128-bit lane each); unpacks and
 * shuffles leave block b's keys in the order 0 2 4 6 1 3 5 7, which one permutation sorts. */
FA_INLINE void fa_q8_0_ksc8x4(const uint16_t* ks, float* ksc, ptrdiff_t ldksc)
{
    __m256 a[4];
    for (int i = 0; i < 4; i++)
        a[i] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(ks + 8 * i)));
    const __m256 u0 = _mm256_unpacklo_ps(a[0], a[1]), u1 = _mm256_unpacklo_ps(a[2], a[3]);
    const __m256 w0 = _mm256_unpackhi_ps(a[0], a[1]), w1 = _mm256_unpackhi_ps(a[2], a[3]);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    _mm256_storeu_ps(ksc, _mm256_permutevar8x32_ps(_mm256_shuffle_ps(u0, u1, 0x44), order));
    _mm256_storeu_ps(ksc + ldksc,
                     _mm256_permutevar8x32_ps(_mm256_shuffle_ps(u0, u1, 0xEE), order));
    _mm256_storeu_ps(ksc + 2 * ldksc,
                     _mm256_permutevar8x32_ps(_mm256_shuffle_ps(w0, w1, 0x44), order));
    _mm256_storeu_ps(ksc + 3 * ldksc,
                     _mm256_permutevar8x32_ps(_mm256_shuffle_ps(w0, w1, 0xEE), order));
}
#endif

/* n consecutive rows of K and V stored as `kind` (a page, or a contiguous run of a cache)
 * for the kernels below: row pointers kptr[u] = k + u k_row (likewise vptr), and the
 * scales in float32: K's transposed, ksc[b * ldksc + u] (a vector then holds consecutive
 * keys' scales of one block of 32 dims), V's by row, vsc[u * nbv + b].  Block scales come
 * from ks (vs), rows ks_row (vs_row) elements apart; an fp8 kind's are its kv head's kfs
 * (vfs) in every block. */
static void fa_quant_rows(int kind, const char* k, ptrdiff_t k_row, const uint16_t* ks,
                          ptrdiff_t ks_row, ptrdiff_t nbk, float kfs, const char* v,
                          ptrdiff_t v_row, const uint16_t* vs, ptrdiff_t vs_row,
                          ptrdiff_t nbv, float vfs, ptrdiff_t n, const char** kptr,
                          const char** vptr, float* ksc, ptrdiff_t ldksc, float* vsc)
{
    for (ptrdiff_t u = 0; u < n; u++) {
        kptr[u] = k + u * k_row;
        vptr[u] = v + u * v_row;
    }
    if (!FA_BLOCK_SCALED(kind)) {
        for (ptrdiff_t b = 0; b < nbk; b++)
            for (ptrdiff_t u = 0; u < n; u++) ksc[b * ldksc + u] = kfs;
        for (ptrdiff_t i = 0; i < n * nbv; i++) vsc[i] = vfs;
        return;
    }
    ptrdiff_t u0 = 0;
#if FA_VBYTES == 64
    if (nbk == 4 && ks_row == 4)
        for (; u0 + 16 <= n; u0 += 16) fa_q8_0_ksc16x4(ks + 4 * u0, ksc + u0, ldksc);
#elif defined(__AVX2__) && defined(__F16C__)
    if (nbk == 4 && ks_row == 4)
        for (; u0 + 8 <= n; u0 += 8) fa_q8_0_ksc8x4(ks + 4 * u0, ksc + u0, ldksc);
#endif
    for (ptrdiff_t b = 0; b < nbk; b++)
        for (ptrdiff_t u = u0; u < n; u++) ksc[b * ldksc + u] = fa_f16_to_f32(ks[u * ks_row + b]);
    if (vs_row == nbv) {
        fa_widen_f(FA_STORE_F16, vs, n * nbv, vsc);
        return;
    }
    for (ptrdiff_t u = 0; u < n; u++) fa_widen_f(FA_STORE_F16, vs + u * vs_row, nbv, vsc + u * nbv);
}

/* The same rows' addresses for the next block, whose rows the kernels request as they go
 * (kpf, vpf), and the lines of their block scales (if any) requested into L2 now. */
static void fa_quant_next_rows(int kind, const char* k, ptrdiff_t k_row, const uint16_t* ks,
                               ptrdiff_t ks_row, ptrdiff_t nbk, const char* v, ptrdiff_t v_row,
                               const uint16_t* vs, ptrdiff_t vs_row, ptrdiff_t nbv, ptrdiff_t n,
                               const char** kpf, const char** vpf)
{
    for (ptrdiff_t u = 0; u < n; u++) {
        kpf[u] = k + u * k_row;
        vpf[u] = v + u * v_row;
    }
    if (!FA_BLOCK_SCALED(kind)) return;
    /* the lines from the first row's scales to the last's */
    fa_prefetch_lines((const char*)ks, ((n - 1) * ks_row + nbk) * 2, 2);
    fa_prefetch_lines((const char*)vs, ((n - 1) * vs_row + nbv) * 2, 2);
}

FA_INLINE ptrdiff_t fa_min_pd(ptrdiff_t a, ptrdiff_t b) { return a < b ? a : b; }

/* Rows [i0, i1) of pf[0 .. n). */
FA_INLINE void fa_quant_prefetch_rows(const char* const* pf, ptrdiff_t i0, ptrdiff_t i1,
                                      ptrdiff_t n, ptrdiff_t bytes, const int loc)
{
    for (ptrdiff_t i = i0; i < i1; i++) fa_prefetch_run_row(pf, i, n, bytes, loc);
}

/*
 * Scores of ng x VL keys (the lanes of ng vectors) against nr query rows of Q^T, as
 * fa_score_keyrows_f:
 *   s[t*lds + r] = scale * sum_d k_t[d] * qt[d*ldqt + r]    t < nk, r < min(nr, nstore)
 * Each VL x VL block of keys is transposed, then scaled per lane by its key's scale
 * (ksc[(d / 32) * ldksc + t]; see fa_quant_rows); per score the chain acc += k[d] * q[d]
 * in order of d, chunk sums every FA_DCHUNK dims, then * scale.  Two groups of keys
 * (ng 2) give one or two rows (four with AVX-512's 32 registers) independent chains to
 * interleave: with fewer than eight, FMAs wait on their latency, not their ports.  Rows
 * past nk must be zero rows: they are read, not stored.  Requested as the dims go:
 * pf[0 .. npf), the next block's K rows at these keys, into L2; l1[0 .. nl1), the next
 * call's, into L1.
 */
FA_INLINE void fa_score_quant_body(const int kind, const uint8_t* const* kr, const float* ksc,
                                   ptrdiff_t ldksc, int nk, const float* qt, ptrdiff_t ldqt,
                                   ptrdiff_t D, float scale, float* s, ptrdiff_t lds,
                                   const int nr, const int ng, int nstore,
                                   const char* const* pf, int npf, const char* const* l1,
                                   int nl1)
{
    fa_vf a[2][8];
    float part[2][8][FA_VL_F];   /* the sums of the chunks before the current one */
#ifdef FA_HAVE_Q4_0_LOAD32
    fa_quant_blk q4[2][4];       /* q4_0: the current block's 32 dims (fa_q4_0_load32) */
#endif
    for (int g = 0; g < ng; g++)
        for (int r = 0; r < nr; r++) a[g][r] = fa_bcast_f(0);
    /* rows to request per step of VL dims */
    const ptrdiff_t steps = D / FA_VL_F, row_bytes = fa_quant_row_bytes(kind, D);
    const ptrdiff_t l2_rows = (npf + steps - 1) / steps, l1_rows = (nl1 + steps - 1) / steps;
    for (ptrdiff_t d0 = 0; d0 < D; d0 += FA_VL_F) {
        if (d0 && d0 % FA_DCHUNK == 0)
            for (int g = 0; g < ng; g++)
                for (int r = 0; r < nr; r++) {
                    fa_store_f(part[g][r], d0 == FA_DCHUNK ? a[g][r]
                                                           : fa_load_f(part[g][r]) + a[g][r]);
                    a[g][r] = fa_bcast_f(0);
                }
        const ptrdiff_t step = d0 / FA_VL_F;
        fa_quant_prefetch_rows(pf, step * l2_rows, fa_min_pd(npf, (step + 1) * l2_rows), npf,
                               row_bytes, 2);
        fa_quant_prefetch_rows(l1, step * l1_rows, fa_min_pd(nl1, (step + 1) * l1_rows), nl1,
                               row_bytes, 3);
        fa_quant_blk u[2];
        fa_vf d[2];
        for (int g = 0; g < ng; g++) {
#ifdef FA_HAVE_Q4_0_LOAD32
            if (kind == FA_STORE_Q4_0) {   /* a block's 32 dims at its first step */
                if (d0 % 32 == 0) fa_q4_0_load32(kr + g * FA_VL_F, d0, q4[g]);
                u[g] = q4[g][d0 % 32 / FA_VL_F];
            } else
#endif
            fa_quant_load(kind, kr + g * FA_VL_F, d0, &u[g]);
            d[g] = fa_load_f(ksc + (d0 / 32) * ldksc + g * FA_VL_F);
        }
        for (int h = 0; h < 2; h++) {
            fa_vf t[2][FA_VL_F / 2];
            for (int g = 0; g < ng; g++) fa_quant_half(kind, &u[g], h, t[g]);
            for (int i = 0; i < FA_VL_F / 2; i++) {
                const float* qd = qt + (d0 + h * FA_VL_F / 2 + i) * ldqt;
                for (int g = 0; g < ng; g++) {
                    const fa_vf ki = t[g][i] * d[g];
                    for (int r = 0; r < nr; r++) a[g][r] += fa_bcast_f(qd[r]) * ki;
                }
            }
        }
    }
    const fa_vf sc = fa_bcast_f(scale);
    for (int g = 0; g < ng; g++)
        for (int r = 0; r < nr && r < nstore; r++) {
            float out[FA_VL_F];
            fa_store_f(out, (D > FA_DCHUNK ? fa_load_f(part[g][r]) + a[g][r] : a[g][r]) * sc);
            for (int t = 0; t < FA_VL_F && g * FA_VL_F + t < nk; t++)
                s[(g * FA_VL_F + t) * lds + r] = out[t];
        }
}

/* groups of VL keys per call with nr rows: eight chains or more where registers allow */
#if FA_VBYTES == 64
#define FA_SCORE_QUANT_NG(nr) ((nr) <= 4 ? 2 : 1)
#else
#define FA_SCORE_QUANT_NG(nr) ((nr) <= 2 ? 2 : 1)
#endif
#define FA_SCORE_QUANT_ARGS const uint8_t* const* kr, const float* ksc, ptrdiff_t ldksc, \
    int nk, const float* qt, ptrdiff_t ldqt, ptrdiff_t D, float scale, float* s, ptrdiff_t lds, \
    int nstore, const char* const* pf, int npf, const char* const* l1, int nl1
#define FA_SCORE_QUANT_PASS kr, ksc, ldksc, nk, qt, ldqt, D, scale, s, lds
#define FA_SCORE_QUANT_NR(NAME, KIND, NR, NG) \
FA_NOINLINE void fa_score_##NAME##_r##NR(FA_SCORE_QUANT_ARGS) \
{ fa_score_quant_body(KIND, FA_SCORE_QUANT_PASS, NR, NG, nstore, pf, npf, l1, nl1); }
#define FA_SCORE_QUANT_KIND(NAME, KIND) \
    FA_SCORE_QUANT_NR(NAME, KIND, 1, FA_SCORE_QUANT_NG(1)) \
    FA_SCORE_QUANT_NR(NAME, KIND, 2, FA_SCORE_QUANT_NG(2)) \
    FA_SCORE_QUANT_NR(NAME, KIND, 4, FA_SCORE_QUANT_NG(4)) \
    FA_SCORE_QUANT_NR(NAME, KIND, 8, FA_SCORE_QUANT_NG(8))
FA_QUANT_KINDS(FA_SCORE_QUANT_KIND)

/* keys per call of fa_score_quant with nr rows */
FA_INLINE int fa_score_quant_keys(int nr) { return (int)(FA_SCORE_QUANT_NG(nr) * FA_VL_F); }

/* One decode score pass of nr (8, 4, 2 or 1) query rows over fa_score_quant_keys(nr) keys
 * of K stored as `kind`: the kind's instantiation of fa_score_quant_body. */
static void fa_score_quant(int kind, int nr, FA_SCORE_QUANT_ARGS)
{
#define FA_CASE(NAME, KIND) \
    case KIND: \
        if (nr == 8) fa_score_##NAME##_r8(FA_SCORE_QUANT_PASS, nstore, pf, npf, l1, nl1); \
        else if (nr == 4) fa_score_##NAME##_r4(FA_SCORE_QUANT_PASS, nstore, pf, npf, l1, nl1); \
        else if (nr == 2) fa_score_##NAME##_r2(FA_SCORE_QUANT_PASS, nstore, pf, npf, l1, nl1); \
        else fa_score_##NAME##_r1(FA_SCORE_QUANT_PASS, nstore, pf, npf, l1, nl1); \
        return;
    switch (kind) { FA_QUANT_KINDS(FA_CASE) }
#undef FA_CASE
}
#undef FA_SCORE_QUANT_KIND
#undef FA_SCORE_QUANT_NR
#undef FA_SCORE_QUANT_PASS
#undef FA_SCORE_QUANT_ARGS

/* The values (level times the block's scale d[b]) of nv vectors of a row's columns from
 * c0.  q4_0 with AVX-512: a block's 16 possible values, (i - 8) d, are one vector of
 * products, and each value is looked up by its nibble (the permutation reads the low 4
 * bits of a lane): the same products as widening every level, at half the
 * instructions. */
FA_INLINE void fa_quant_values(const int kind, const uint8_t* row, ptrdiff_t c0, const int nv,
                               const float* d, fa_vf* x)
{
#if FA_VBYTES == 64
    if (kind == FA_STORE_Q4_0 && nv % 2 == 0 && c0 % 32 == 0) {
        const __m512 levels = _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1,
                                             0, 1, 2, 3, 4, 5, 6, 7);
        for (int b = 0; b < nv / 2; b++) {
            const __m512i idx = _mm512_cvtepu8_epi32(fa_quant_raw(kind, row, c0 + 32 * b));
            const __m512 table = _mm512_mul_ps(levels, _mm512_set1_ps(d[b]));
            x[2 * b] = (fa_vf)_mm512_permutexvar_ps(idx, table);
            x[2 * b + 1] = (fa_vf)_mm512_permutexvar_ps(_mm512_srli_epi32(idx, 4), table);
        }
        return;
    }
#endif
    fa_quant_vloads(kind, row, c0, nv, x);
    for (int i = 0; i < nv; i++) x[i] *= fa_bcast_f(d[i * FA_VL_F / 32]);
}

/*
 * The output of nr query rows (1 or 4) over nv vectors of value columns from column c0,
 * V stored as `kind` in rows vr[j] with float32 scales vsc[j * nbv + c / 32]: per
 * element the sequence of fa_pv_tile_f,
 *   acc[r, c] = acc[r, c] * alpha[r] + sum_j p[j*ldp + r] * v_j[c]
 * the block's sum from zero in order of j, then one FMA.  Each V vector is dequantised
 * once for all nr rows.  The first pass (c0 0) requests row j + FA_PV_QUANT_AHEAD whole
 * into L1 as row j is read, and pf[j] (the next block's rows, j < npf, pf_bytes each, the
 * bytes of a whole row) into L2.
 */
#define FA_PV_QUANT_AHEAD 4
FA_INLINE void fa_pv_quant_cols(const int kind, const float* p, ptrdiff_t ldp, ptrdiff_t nj,
                                const uint8_t* const* vr, const float* vsc, ptrdiff_t nbv,
                                ptrdiff_t c0, float* acc, ptrdiff_t ldacc, const float* alpha,
                                const int nr, const int nv, const char* const* pf,
                                ptrdiff_t npf, ptrdiff_t pf_bytes)
{
    fa_vf c[4][8];
    for (int r = 0; r < nr; r++)
        for (int i = 0; i < nv; i++) c[r][i] = fa_bcast_f(0);
    /* the first pass requests whole rows into L1; the later ones find them there */
    const ptrdiff_t l1_bytes = c0 ? 0 : pf_bytes;
    for (ptrdiff_t j = 0; j < nj; j++) {
        const float* d = vsc + j * nbv + c0 / 32;
        if (l1_bytes && j + FA_PV_QUANT_AHEAD < nj)
            fa_prefetch_lines((const char*)vr[j + FA_PV_QUANT_AHEAD], l1_bytes, 3);
        if (j < npf) fa_prefetch_run_row(pf, j, npf, pf_bytes, 2);
        fa_vf xv[8];
        fa_quant_values(kind, vr[j], c0, nv, d, xv);
        fa_pv_add_key_f(c, p + j * ldp, xv, nr, nv);
    }
    fa_pv_finish_f(c, acc + c0, ldacc, alpha, nr, nv);
}

/* acc = acc * alpha + P V over all Dv columns (a multiple of 32) for nr rows (1 or 4), V
 * stored as the kind of NAME, in passes of vectors of value columns: 1 row x 8 (all of
 * Dv = 128 with AVX-512 in one pass over the keys), 4 rows x FA_PV4_NV (accumulators and
 * V vectors fit the register file, see fa_pv_rows4_f).  The first pass over the keys
 * requests pf[0 .. npf) into L2. */
#define FA_PV_QUANT_ARGS const float* p, ptrdiff_t ldp, ptrdiff_t nj, const uint8_t* const* vr, \
    const float* vsc, ptrdiff_t nbv, ptrdiff_t c0, float* acc, ptrdiff_t ldacc, \
    const float* alpha, const char* const* pf, ptrdiff_t npf, ptrdiff_t pf_bytes
#define FA_PV_QUANT_ROWS(NAME, KIND, NR, NV) \
FA_NOINLINE void fa_pv_##NAME##_r##NR##_v##NV(FA_PV_QUANT_ARGS) \
{ fa_pv_quant_cols(KIND, p, ldp, nj, vr, vsc, nbv, c0, acc, ldacc, alpha, NR, NV, pf, npf, \
                   pf_bytes); }
#if FA_PV4_NV >= 4
#define FA_PV_QUANT_R4_V4(NAME, KIND) FA_PV_QUANT_ROWS(NAME, KIND, 4, 4)
#define FA_PASS_R4_V4(NAME, KIND) FA_PASS(NAME, KIND, 4, 4)
#else
#define FA_PV_QUANT_R4_V4(NAME, KIND)
#define FA_PASS_R4_V4(NAME, KIND)
#endif
#define FA_PASS(NAME, KIND, NR, NV) \
    for (; c0 + NV * FA_VL_F <= Dv; c0 += NV * FA_VL_F, npf = 0) \
        fa_pv_##NAME##_r##NR##_v##NV(p, ldp, nj, vr, vsc, Dv / 32, c0, acc, ldacc, alpha, pf, \
                                     npf, fa_quant_row_bytes(KIND, Dv));
#define FA_PV_QUANT_KIND(NAME, KIND) \
    FA_PV_QUANT_ROWS(NAME, KIND, 1, 8) FA_PV_QUANT_ROWS(NAME, KIND, 1, 4) \
    FA_PV_QUANT_ROWS(NAME, KIND, 1, 2) FA_PV_QUANT_ROWS(NAME, KIND, 1, 1) \
    FA_PV_QUANT_ROWS(NAME, KIND, 4, 2) FA_PV_QUANT_ROWS(NAME, KIND, 4, 1) \
    FA_PV_QUANT_R4_V4(NAME, KIND) \
FA_NOINLINE void fa_pv_##NAME(const float* p, ptrdiff_t ldp, ptrdiff_t nj, \
                              const uint8_t* const* vr, const float* vsc, ptrdiff_t Dv, \
                              float* acc, ptrdiff_t ldacc, const float* alpha, int nr, \
                              const char* const* pf, ptrdiff_t npf) \
{ \
    ptrdiff_t c0 = 0; \
    if (nr == 1) { \
        FA_PASS(NAME, KIND, 1, 8) FA_PASS(NAME, KIND, 1, 4) \
        FA_PASS(NAME, KIND, 1, 2) FA_PASS(NAME, KIND, 1, 1) \
        return; \
    } \
    FA_PASS_R4_V4(NAME, KIND) FA_PASS(NAME, KIND, 4, 2) FA_PASS(NAME, KIND, 4, 1) \
}
FA_QUANT_KINDS(FA_PV_QUANT_KIND)
#undef FA_PV_QUANT_KIND
#undef FA_PASS
#undef FA_PASS_R4_V4
#undef FA_PV_QUANT_R4_V4
#undef FA_PV_QUANT_ROWS
#undef FA_PV_QUANT_ARGS

/* The output kernel of V stored as `kind` (fa_pv_<kind>). */
static void fa_pv_quant(int kind, const float* p, ptrdiff_t ldp, ptrdiff_t nj,
                        const uint8_t* const* vr, const float* vsc, ptrdiff_t Dv, float* acc,
                        ptrdiff_t ldacc, const float* alpha, int nr, const char* const* pf,
                        ptrdiff_t npf)
{
#define FA_CASE(NAME, KIND) \
    case KIND: fa_pv_##NAME(p, ldp, nj, vr, vsc, Dv, acc, ldacc, alpha, nr, pf, npf); return;
    switch (kind) { FA_QUANT_KINDS(FA_CASE) }
#undef FA_CASE
}
