/*
 * fa_int8dot.h -- integer dot products for the scores over q8_0 and q4_0 keys, the opt-in
 * of fastattn.set_int8_dot_products: q is quantised per block of 32 dims as llama.cpp
 * quantises it against its quantised K, and each block's q.k is taken exactly in int32 by
 * `vpdpbusd` (AVX512-VNNI in the avx512 build, AVX-VNNI in the avx2 build).  Each kernel
 * has its own target attribute, so the modules still load on CPUs without VNNI; the tile
 * pipeline calls them only where fa_cpu_has_int8dot() says the CPU runs them.
 *
 * q, a row x of D float32 values (fa_int8_quant_row), block b of 32 dims:
 *     qd_b = max |x| / 127,   qi[d] = x[d] * (127 / max |x|) rounded to nearest (even),
 *     qs_b = the sum of the block's qi
 * llama.cpp's rule, with the scale kept in float32 (llama.cpp rounds it to float16).
 *
 * The chain of a score, the same in every row pass, tile and thread (so a decode step
 * keeps the bits of the prefill over the same cache, and threads, batch and pages change
 * nothing), and in both builds:
 *     isum_b = sum over the block of qi[d] * k[d]                  (exact, int32)
 *     acc    = fma(isum_b, dk_b * qd_b, acc)   for b = 0, 1, ...    (from acc = 0)
 *     s      = acc * scale
 * with dk_b the key's block scale (float32, from its float16).  isum_b is at most
 * 32 * 127 * 128 in magnitude, exact in float32.
 *
 * vpdpbusd multiplies unsigned bytes by signed ones, four to a 32-bit lane: the key's
 * byte is the unsigned side, q8_0's k read as k + 128 (k ^ 0x80) and q4_0's nibble as
 * it is stored (k + 8); the excess, 128 qs_b or 8 qs_b, is subtracted from the sum.
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
static inline int fa_cpu_has_int8dot(void)
{
#if FA_HAVE_INT8DOT && FA_VBYTES == 64
    return fa_cpuid_bit(7, 0, 2, 11);
#elif FA_HAVE_INT8DOT
    return fa_cpuid_bit(7, 1, 0, 4);
#else
    return 0;
#endif
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
#define FA_I8_NOINLINE static __attribute__((noinline, unused)) FA_I8_TARGET
#define FA_I8_INLINE static inline __attribute__((always_inline)) FA_I8_TARGET
#define FA_I8_KEYS 16
typedef __m512i fa_i8v;
typedef __m512 fa_i8f;

/* Dims 32b .. 32b+31 of 16 q8_0 key rows, transposed (t[j]: dims 4j .. 4j+3 of each key),
 * each byte + 128. */
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
    const __m512i bias = _mm512_set1_epi8((char)0x80);
    for (int j = 0; j < 4; j++) {
        t[j] = _mm512_xor_si512(_mm512_permutex2var_epi64(A[j], lo, B[j]), bias);
        t[j + 4] = _mm512_xor_si512(_mm512_permutex2var_epi64(A[j], hi, B[j]), bias);
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
FA_I8_INLINE fa_i8v fa_i8_dot(fa_i8v acc, fa_i8v k, const int8_t* p)
{ return _mm512_dpbusd_epi32(acc, k, _mm512_broadcastd_epi32(_mm_loadu_si32(p))); }
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
#define FA_I8_NOINLINE static __attribute__((noinline, unused)) FA_I8_TARGET
#define FA_I8_INLINE static inline __attribute__((always_inline)) FA_I8_TARGET
#define FA_I8_KEYS 8
typedef __m256i fa_i8v;
typedef __m256 fa_i8f;

/* Dims 32b .. 32b+31 of 8 q8_0 key rows, transposed (t[j]: dims 4j .. 4j+3 of each key),
 * each byte + 128. */
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
    const __m256i bias = _mm256_set1_epi8((char)0x80);
    for (int j = 0; j < 4; j++) {
        t[j] = _mm256_xor_si256(_mm256_permute2x128_si256(A[j], B[j], 0x20), bias);
        t[j + 4] = _mm256_xor_si256(_mm256_permute2x128_si256(A[j], B[j], 0x31), bias);
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

FA_I8_INLINE fa_i8v fa_i8_dot(fa_i8v acc, fa_i8v k, const int8_t* p)
{ return _mm256_dpbusd_avx_epi32(acc, k, _mm256_broadcastd_epi32(_mm_loadu_si32(p))); }
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

/*
 * Scores of FA_I8_KEYS keys (the lanes) against nr quantised q rows (the chain at the top):
 *   s[t*lds + r] = score of key kr[t] and row r,   t < nk, r < min(nr, nstore)
 * ksc[b * ldksc + t]: the keys' block scales in float32 (fa_quant_rows).  Keys past nk
 * must be readable rows (the workspace's zero row); they are not stored.  Requested as
 * the blocks go: pf[0 .. npf), the next block's K rows at these keys, into L2; l1[0 ..
 * nl1), the next call's, into L1.
 */
FA_I8_INLINE void fa_score_int8_body(const int kind, const uint8_t* const* kr, const float* ksc,
                                     ptrdiff_t ldksc, int nk, const int8_t* qi, const float* qd,
                                     const int32_t* qs, ptrdiff_t D, float scale, float* s,
                                     ptrdiff_t lds, const int nr, int nstore,
                                     const char* const* pf, int npf, const char* const* l1,
                                     int nl1)
{
    const ptrdiff_t nb = D / 32, row_bytes = fa_quant_row_bytes(kind, D);
    const ptrdiff_t l2_rows = (npf + nb - 1) / nb, l1_rows = (nl1 + nb - 1) / nb;
    const int excess = kind == FA_STORE_Q8_0 ? 7 : 3;   /* log2 of 128, 8 */
    /* one or two rows: two sums per row, the even and the odd dims' (an exact split), so
     * that the products' latency overlaps */
    const int nsum = nr >= 4 ? 1 : 2;
    fa_i8f acc[FA_I8_MAX_ROWS];
    for (int r = 0; r < nr; r++) acc[r] = fa_i8_fzero();
    for (ptrdiff_t b = 0; b < nb; b++) {
        fa_quant_prefetch_rows(pf, b * l2_rows, fa_min_pd(npf, (b + 1) * l2_rows), npf,
                               row_bytes, 2);
        fa_quant_prefetch_rows(l1, b * l1_rows, fa_min_pd(nl1, (b + 1) * l1_rows), nl1,
                               row_bytes, 3);
        fa_i8v t[8];
        if (kind == FA_STORE_Q8_0) fa_i8_keys_q8_0(kr, b, t);
        else fa_i8_keys_q4_0(kr, b, t);
        fa_i8v isum[FA_I8_MAX_ROWS][2];
        for (int r = 0; r < nr; r++) isum[r][0] = isum[r][1] = fa_i8_zero();
        for (int j = 0; j < 8; j++)
            for (int r = 0; r < nr; r++)
                isum[r][j % nsum] = fa_i8_dot(isum[r][j % nsum], t[j], qi + r * D + 32 * b + 4 * j);
        const fa_i8f dk = fa_i8_fload(ksc + b * ldksc);
        for (int r = 0; r < nr; r++) {
            fa_i8v sum = nsum == 2 ? fa_i8_add(isum[r][0], isum[r][1]) : isum[r][0];
            sum = fa_i8_sub(sum, qs[r * nb + b] * (1 << excess));
            acc[r] = fa_i8_fma(sum, fa_i8_scaled(dk, qd[r * nb + b]), acc[r]);
        }
    }
    for (int r = 0; r < nr && r < nstore; r++) {
        float out[FA_I8_KEYS];
        fa_i8_fstore(out, fa_i8_scaled(acc[r], scale));
        for (int t = 0; t < FA_I8_KEYS && t < nk; t++) s[t * lds + r] = out[t];
    }
}

#define FA_SCORE_INT8_ARGS const uint8_t* const* kr, const float* ksc, ptrdiff_t ldksc, int nk, \
    const int8_t* qi, const float* qd, const int32_t* qs, ptrdiff_t D, float scale, float* s, \
    ptrdiff_t lds, int nstore, const char* const* pf, int npf, const char* const* l1, int nl1
#define FA_SCORE_INT8_PASS kr, ksc, ldksc, nk, qi, qd, qs, D, scale, s, lds
#define FA_SCORE_INT8_NR(NAME, KIND, NR) \
FA_I8_NOINLINE void fa_score_int8_##NAME##_r##NR(FA_SCORE_INT8_ARGS) \
{ fa_score_int8_body(KIND, FA_SCORE_INT8_PASS, NR, nstore, pf, npf, l1, nl1); }
#if FA_I8_MAX_ROWS == 8
#define FA_SCORE_INT8_KIND(NAME, KIND) FA_SCORE_INT8_NR(NAME, KIND, 1) \
    FA_SCORE_INT8_NR(NAME, KIND, 2) FA_SCORE_INT8_NR(NAME, KIND, 4) FA_SCORE_INT8_NR(NAME, KIND, 8)
#define FA_I8_CALL8(NAME) \
    if (nr == 8) { \
        fa_score_int8_##NAME##_r8(FA_SCORE_INT8_PASS, nstore, pf, npf, l1, nl1); \
        return; \
    }
#else
#define FA_SCORE_INT8_KIND(NAME, KIND) FA_SCORE_INT8_NR(NAME, KIND, 1) \
    FA_SCORE_INT8_NR(NAME, KIND, 2) FA_SCORE_INT8_NR(NAME, KIND, 4)
#define FA_I8_CALL8(NAME)
#endif
FA_SCORE_INT8_KIND(q8_0, FA_STORE_Q8_0)
FA_SCORE_INT8_KIND(q4_0, FA_STORE_Q4_0)

/* One score pass of nr rows (1, 2, 4 or FA_I8_MAX_ROWS) over FA_I8_KEYS keys stored as
 * `kind` (q8_0 or q4_0). */
static void fa_score_int8(int kind, int nr, FA_SCORE_INT8_ARGS)
{
#define FA_CASE(NAME, KIND) \
    case KIND: \
        FA_I8_CALL8(NAME) \
        if (nr == 4) fa_score_int8_##NAME##_r4(FA_SCORE_INT8_PASS, nstore, pf, npf, l1, nl1); \
        else if (nr == 2) fa_score_int8_##NAME##_r2(FA_SCORE_INT8_PASS, nstore, pf, npf, l1, nl1); \
        else fa_score_int8_##NAME##_r1(FA_SCORE_INT8_PASS, nstore, pf, npf, l1, nl1); \
        return;
    switch (kind) { FA_CASE(q8_0, FA_STORE_Q8_0) FA_CASE(q4_0, FA_STORE_Q4_0) }
#undef FA_CASE
}

#else   /* no integer products in this build: never called (fa_cpu_has_int8dot() is 0) */
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
