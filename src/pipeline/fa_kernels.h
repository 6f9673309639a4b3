/*
 * fa_kernels.h -- C building blocks shared by every instruction-set variant of fastattn's
 * Cython kernel (src/_kernel_impl.pxi):
 *
 *   - fa_key_interval: THE visibility rule (causal in both alignments, sliding window,
 *     kv_lengths).  Every kernel and attention_weights ask it; nothing else restates it.
 *   - the micro-kernels (fa_tile_impl.h) for float and double, K/V in the compute type;
 *   - build facts and the CPU feature probe used for import-time dispatch.
 *
 * Why the query rows are the SIMD lanes: the score tile is computed transposed,
 * S^T[j, r] = k_j . q_r, by broadcasting one key element against a packed vector of query
 * rows.  K is then read in place (no per-block packing, any row stride), the online-softmax
 * statistics (running max m, running sum l) of many rows are updated with single vector
 * instructions, and each score is one sequential FMA chain over d -- the same chain whether
 * the row is computed alone (decode) or in a tile of 96 (prefill).
 */
#ifndef FA_KERNELS_H
#define FA_KERNELS_H

#include "fa_simd.h"
#include "fa_transpose.h"
/* The chunk sums of a score (part[] in the decode kernels) are read only when D spans more
 * than one chunk, after the first chunk has written them; GCC cannot see that. */
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#ifdef _OPENMP
#include <omp.h>
#endif

/* Tile geometry (rows = query rows, keys = key/value rows).
 * FA_BK: keys per online-softmax block.  Fixed for every call so that the order in which
 *   a row's keys are merged never depends on Lq, the batch or the thread count.  64 keys
 *   x 96 rows of scores (24 KiB in float32) stay in L1/L2 between the three passes.
 * FA_BQ: query rows per work item: a multiple of FA_MR_PV and of 2 vectors of lanes for
 *   every ISA (16, 32 floats); 96 rows amortise each K/V block read over many rows.
 * FA_MR_K / FA_MR_PV: register-tile heights of the two micro-kernels (6 x 2 vectors = 12
 *   accumulators, the AVX2 sweet spot). */
#define FA_BK 64
/* FA_DCHUNK: dimensions per chunk of a score's FMA chain (see fa_score_tile).  A multiple
 * of every vector width, so that the decode kernels' steps never straddle a chunk.  16
 * keeps a score's rounding error near that of a dot product summed in vector lanes (what
 * BLAS does for a single query row): with one chain of 64 at D = 64, a decode row's float32
 * error reaches 2-3x torch's. */
#define FA_DCHUNK 16
/* FA_KCHUNK: keys per chunk of the softmax reduction (a multiple of FA_BK).  A row's keys
 * are reduced chunk by chunk from an empty state and the chunks merged in key order, the
 * same way whether one thread walks them all or a decode step with few (batch x kv head)
 * work items spreads them over threads (flash-decoding), so both give the same bits. */
#define FA_KCHUNK 1024
#define FA_BQ 96
#define FA_MR_K 6
#define FA_MR_PV 6
/* Decode tiles (few query rows, keys as lanes): rows per pass of fa_score_keyrows -- as
 * many accumulators as fit beside VL transposed keys in the register file. */
#if FA_VBYTES == 64
#define FA_DEC_NR_MAX 8
#else
#define FA_DEC_NR_MAX 4
#endif
/* The largest head dim of the 16-bit decode score kernel (fa_score_keys32_kt8): its
 * per-call buffer of 32 transposed keys is 16 KiB at this size. */
#define FA_KT8_MAX_D 256

/* causal modes */
#define FA_CAUSAL_NONE 0
#define FA_CAUSAL_BOTTOM_RIGHT 1
#define FA_CAUSAL_TOP_LEFT 2

/*
 * Keys visible to query row i (0 <= i < Lq) form one interval [lo, hi) of [0, kv_len):
 *   causal bottom-right:  j <= i + (kv_len - Lq)
 *   causal top-left:      j <= i
 *   window (wl, wr):      i + (kv_len - Lq) - wl <= j <= i + (kv_len - Lq) + wr, -1 = unbounded
 * An empty interval has lo == hi.  (A user mask may hide further keys inside it.)
 */
static inline void fa_key_interval(ptrdiff_t i, ptrdiff_t Lq, ptrdiff_t kv_len, int causal,
                                   ptrdiff_t wl, ptrdiff_t wr, ptrdiff_t* lo, ptrdiff_t* hi)
{
    const ptrdiff_t diag = i + kv_len - Lq;
    ptrdiff_t l = 0, h = kv_len;
    if (causal == FA_CAUSAL_BOTTOM_RIGHT && diag + 1 < h) h = diag + 1;
    if (causal == FA_CAUSAL_TOP_LEFT && i + 1 < h) h = i + 1;
    /* Written so that no window size, however large, overflows: diag >= -Lq always. */
    if (wl >= 0 && diag > wl && diag - wl > l) l = diag - wl;
    if (wr >= 0 && wr < h - 1 - diag) h = diag + wr + 1;
    if (h < l) h = l;   /* l >= 0 always, so an empty interval is [l, l) */
    *lo = l;
    *hi = h;
}

/* Prefetch [p, p + bytes) into L2 (or L1), a line at a time from p: the lines of rows
 * that follow each other in memory (the decode kernels' streams).  A row that starts
 * inside a line ends inside one, which the next row's first prefetch covers; a row that
 * no other follows needs its last line too (fa_prefetch_row). */
static inline void fa_prefetch_l2(const char* p, ptrdiff_t bytes)
{
    for (ptrdiff_t off = 0; off < bytes; off += 64) __builtin_prefetch(p + off, 0, 2);
}
static inline void fa_prefetch_l1(const char* p, ptrdiff_t bytes)
{
    for (ptrdiff_t off = 0; off < bytes; off += 64) __builtin_prefetch(p + off, 0, 3);
}
/* Every line of [p, p + bytes), whatever p's alignment (rows of NumPy arrays start 16
 * bytes into a line as often as not: a 128-byte row then touches three lines). */
static inline void fa_prefetch_lines(const char* p, ptrdiff_t bytes, const int loc)
{
    const char* end = p + bytes;
    for (const char* a = (const char*)((uintptr_t)p & ~(uintptr_t)63); a < end; a += 64) {
        if (loc == 3)
            __builtin_prefetch(a, 0, 3);
        else
            __builtin_prefetch(a, 0, 2);
    }
}
/* Where a run of rows ends, its last row's last line, which no following row's first line
 * covers (rows need not start on a line). */
static inline void fa_prefetch_run_tail(const char* p, ptrdiff_t bytes, int run_ends,
                                        const int loc)
{
    if (run_ends) fa_prefetch_lines(p + bytes - 1, 1, loc);
}
/* One row of a run of rows that follow each other in memory (a page, a contiguous
 * block), into L2 (or L1 for loc 3): its lines from its start, and where the run ends
 * (run_ends: no row follows it) its last line as well. */
static inline void fa_prefetch_row(const char* p, ptrdiff_t bytes, int run_ends, const int loc)
{
    if (loc == 3)
        fa_prefetch_l1(p, bytes);
    else
        fa_prefetch_l2(p, bytes);
    fa_prefetch_run_tail(p, bytes, run_ends, loc);
}
/* The requests as the tile pipeline's Cython functions make them (their declarations
 * name these).  GCC takes a function whose only effect is a prefetch for one without
 * effects (a prefetch changes nothing a program can read) and deletes the calls to it:
 * a tile function that did nothing but request rows never ran.  An empty volatile asm
 * statement is an effect it keeps, at no instruction; the kernels, whose prefetches sit
 * beside their stores, need none. */
#define FA_KEPT(call) do { call; __asm__ __volatile__(""); } while (0)
static inline void fa_prefetch_l2_kept(const char* p, ptrdiff_t bytes)
{ FA_KEPT(fa_prefetch_l2(p, bytes)); }
static inline void fa_prefetch_l1_kept(const char* p, ptrdiff_t bytes)
{ FA_KEPT(fa_prefetch_l1(p, bytes)); }
static inline void fa_prefetch_row_kept(const char* p, ptrdiff_t bytes, int run_ends,
                                        const int loc)
{ FA_KEPT(fa_prefetch_row(p, bytes, run_ends, loc)); }
#undef FA_KEPT
/* Whether row i of rows[0 .. n) (bytes long) ends its run of rows: row i + 1 does not
 * follow it in memory. */
FA_INLINE int fa_run_ends(const char* const* rows, ptrdiff_t i, ptrdiff_t n, ptrdiff_t bytes)
{
    return i + 1 == n || rows[i + 1] != rows[i] + bytes;
}
/* Row i of rows[0 .. n) (bytes long) requested into the cache level of locality loc. */
FA_INLINE void fa_prefetch_run_row(const char* const* rows, ptrdiff_t i, ptrdiff_t n,
                                   ptrdiff_t bytes, const int loc)
{
    fa_prefetch_row(rows[i], bytes, fa_run_ends(rows, i, n, bytes), loc);
}

#include "fa_half.h"
FA_WIDEN_ROWS(f, float)
FA_WIDEN_ROWS(d, double)
#undef FA_WIDEN_ROWS

/* VL x VL 16-bit elements of VL rows, transposed and widened: each row widened into a small
 * buffer, then the float transpose (the generic decode kernel's loads; the 32-byte builds
 * use fa_keys32.h instead). */
#define FA_LOAD_TRANSPOSE_16(SUF, LOADW)                                                      \
FA_INLINE void fa_load_transpose_vf##SUF(const uint16_t* const* rows, ptrdiff_t d0, fa_vf* t) \
{                                                                                             \
    float tmp[FA_VL_F][FA_VL_F];                                                              \
    const float* p[FA_VL_F];                                                                  \
    for (int i = 0; i < FA_VL_F; i++) {                                                       \
        const fa_vf x = LOADW(rows[i] + d0);                                                  \
        memcpy(tmp[i], &x, sizeof x);                                                         \
        p[i] = tmp[i];                                                                        \
    }                                                                                         \
    fa_load_transpose_vf(p, 0, t);                                                            \
}
FA_LOAD_TRANSPOSE_16(h, fa_load_fh)
FA_LOAD_TRANSPOSE_16(b, fa_load_fb)
#undef FA_LOAD_TRANSPOSE_16

/* ---- decode score kernels on groups of 8 keys (every build) ----
 * Transposing whole blocks of VL keys (fa_score_keyrows) leaves one query row a single
 * FMA chain per VL keys, bound by the FMA latency, and costs a full VL x VL transpose
 * per VL dims (with 16 lanes, twice the shuffles per element of the 8-lane transposes
 * below).  Here a call takes 32 keys (4 groups of 8, in 8-float vectors: ymm registers in
 * AVX-512 builds) and
 * transposes 8 keys x 4 dims at a time -- two 128-bit loads and a blend (or insert) per
 * vector, then two in-lane shuffles -- so that nr rows x ng groups = 4 independent chains
 * are in flight.
 * Per score it is still the chain acc += k[d] * q[d], d = 0, 1, ... then * scale: bit for
 * bit the prefill score.  kr: 32 key rows (zero rows past nk); pf: the 32 V rows to
 * prefetch (or NULL), as in fa_score_keyrows. */
#define FA_DEC_KEYS_F 32
/* Decode tiles of at most this many rows prefetch the next K rows in the score kernel
 * (fa_score_keys32_f's first pass); larger ones in the output kernel (fa_pv_row8/rows4). */
#if FA_VBYTES == 32 && defined(__AVX__)
#define FA_DEC_SCORES_PREFETCH_K_ROWS_F 8
#else
#define FA_DEC_SCORES_PREFETCH_K_ROWS_F 2
#endif
typedef float fa_v4f __attribute__((vector_size(16)));

/* Whether the decode kernels request the rows they read next into L1 (1) or into L2 (0),
 * set once at import from the CPU (fa_prefetch_init).  Into L1 on Intel cores, where the
 * loads then find their lines closest.  Into L2 on the others (AMD's): there a request
 * into L1 that goes to memory holds one of the core's L1 miss buffers for the whole
 * latency, the kernels' loads wait behind those requests, and a thread reads half as
 * fast as with its requests into L2, from where the L1 prefetcher brings the lines on. */
static int fa_pf_l1 = 1;
static int fa_prefetch_init(void)
{
    fa_pf_l1 = fa_cpu_is_intel();
    return fa_pf_l1;
}

/* The two prefetch streams of a decode score call (its first row pass, pf_bytes > 0):
 * 32 rows pf of pf_bytes each into L2 (the V rows of its keys, for the output kernel that
 * follows, or the next block's K rows; none when pf is NULL) and the next 32 rows of K
 * (into L1 where fa_pf_l1 says, else L2, for the next call; only for evenly spaced rows,
 * ldk != 0), each
 * spread evenly over the call's nsteps steps and issued line by line in address order,
 * a row's lines from its start as fa_prefetch_row's.
 * Row-ordered streams are what the memory system serves fastest; the same lines
 * prefetched column by column (as the loads use them) gain nothing, and without software
 * prefetch the rate halves: the hardware prefetchers do not follow the kernels'
 * 8-rows-at-a-time reads.
 * When the rows of each stream are one contiguous block that divides evenly over the
 * steps (K and V rows of a contiguous cache), a step is a fixed run of lines from a
 * moving pointer; otherwise a Bresenham walk over (row, line) pairs, which costs more
 * scalar work than the prefetches themselves. */
typedef struct {
    const char* const* v_rows;
    const char* v_lin;
    const char* k_lin;
    ptrdiff_t nsteps, v_bytes, v_row_lines, v_lines, k_row_lines, k_lines, k_stride;
    ptrdiff_t v_err, v_row, v_col, k_err, k_row, k_col;
    ptrdiff_t v_step, k_step;   /* linear: lines per step of each stream */
    int on, lin;
} fa_dec_pf;

FA_INLINE void fa_dec_pf_init(fa_dec_pf* p, const char* const* pf, ptrdiff_t pf_bytes,
                              const char* k0, ptrdiff_t ldk, ptrdiff_t esz, ptrdiff_t D,
                              ptrdiff_t nsteps)
{
    p->on = pf_bytes > 0 && nsteps > 0;
    p->v_rows = pf;
    p->nsteps = nsteps;
    p->v_bytes = pf_bytes;
    p->v_row_lines = (pf_bytes + 63) / 64;
    p->v_lines = pf ? 32 * p->v_row_lines : 0;          /* pf NULL: the K stream only */
    p->k_row_lines = (D * esz + 63) / 64;
    p->k_lines = ldk ? 32 * p->k_row_lines : 0;          /* rows k0 + (32 + i) ldk */
    p->k_stride = ldk * esz;
    p->k_lin = k0 + 32 * ldk * esz;
    p->v_lin = p->on && pf ? pf[0] : NULL;
    p->v_err = p->v_row = p->v_col = p->k_err = p->k_row = p->k_col = 0;
    const ptrdiff_t v_bytes = 64 * p->v_row_lines, k_bytes = 64 * p->k_row_lines;
    p->lin = p->on && p->v_lines % nsteps == 0 && p->k_lines % nsteps == 0
             && (!ldk || p->k_stride == k_bytes)
             && (!pf || (pf_bytes == v_bytes
                         && (uintptr_t)pf[1] - (uintptr_t)pf[0] == (uintptr_t)v_bytes
                         && (uintptr_t)pf[31] - (uintptr_t)pf[0] == (uintptr_t)(31 * v_bytes)));
    p->v_step = p->lin ? p->v_lines / nsteps : 0;   /* divided once here, not per step */
    p->k_step = p->lin ? p->k_lines / nsteps : 0;
}

/* This step's share of each stream. */
FA_INLINE void fa_dec_pf_step(fa_dec_pf* p)
{
    if (!p->on) return;
    if (p->lin) {
        for (ptrdiff_t i = 0; i < p->v_step; i++) __builtin_prefetch(p->v_lin + 64 * i, 0, 2);
        if (fa_pf_l1)
            for (ptrdiff_t i = 0; i < p->k_step; i++) __builtin_prefetch(p->k_lin + 64 * i, 0, 3);
        else
            for (ptrdiff_t i = 0; i < p->k_step; i++) __builtin_prefetch(p->k_lin + 64 * i, 0, 2);
        p->v_lin += 64 * p->v_step;
        p->k_lin += 64 * p->k_step;
        return;
    }
    for (p->v_err += p->v_lines; p->v_err >= p->nsteps; p->v_err -= p->nsteps) {
        __builtin_prefetch(p->v_rows[p->v_row] + 64 * p->v_col, 0, 2);
        if (++p->v_col == p->v_row_lines) {
            fa_prefetch_run_tail(p->v_rows[p->v_row], p->v_bytes,
                                 fa_run_ends(p->v_rows, p->v_row, 32, p->v_bytes), 2);
            p->v_col = 0;
            p->v_row++;
        }
    }
    for (p->k_err += p->k_lines; p->k_err >= p->nsteps; p->k_err -= p->nsteps) {
        fa_prefetch_lines(p->k_lin + p->k_row * p->k_stride + 64 * p->k_col, 1,
                          fa_pf_l1 ? 3 : 2);
        if (++p->k_col == p->k_row_lines) { p->k_col = 0; p->k_row++; }
    }
}

/* 4 elements of two rows as one vector [lo | hi] (keys 0-3 in the low 128-bit lane, 4-7
 * in the high one) for the decode transposes; 16-bit rows widen the pair in one conversion. */
#if defined(__AVX__)
/* two broadcast loads and a blend (vinsertf128 would take a shuffle-port uop) */
#define fa_yrows_f(lo, hi) (fa_vf8)_mm256_blend_ps(_mm256_broadcast_ps((const __m128*)(lo)), \
                                                  _mm256_broadcast_ps((const __m128*)(hi)), 0xF0)
#else
FA_INLINE fa_vf8 fa_yrows_f(const float* lo, const float* hi)
{
    fa_v4f a, b;
    memcpy(&a, lo, sizeof a);
    memcpy(&b, hi, sizeof b);
    return __builtin_shufflevector(a, b, 0, 1, 2, 3, 4, 5, 6, 7);
}
#endif
FA_INLINE fa_vf8 fa_yrows_fh(const uint16_t* lo, const uint16_t* hi)
{ return fa_widen_f16x8(fa_h8_rows(lo, hi)); }
#if defined(__AVX2__)
/* bfloat16: each row's 8 bytes broadcast to its 128-bit lane, then interleaved with zeros
 * (the bits of a bfloat16 are the top half of its float32): one shuffle in all. */
FA_INLINE fa_vf8 fa_yrows_fb(const uint16_t* lo, const uint16_t* hi)
{
    long long a, b;
    memcpy(&a, lo, sizeof a);
    memcpy(&b, hi, sizeof b);
    const __m256i y = _mm256_blend_epi32(_mm256_set1_epi64x(a), _mm256_set1_epi64x(b), 0xF0);
    return (fa_vf8)_mm256_unpacklo_epi16(_mm256_setzero_si256(), y);
}
#else
FA_INLINE fa_vf8 fa_yrows_fb(const uint16_t* lo, const uint16_t* hi)
{ return fa_widen_bf16x8(fa_h8_rows(lo, hi)); }
#endif

#if defined(__AVX2__) && defined(__F16C__)
/* The 8 x 8 transpose of 16-bit elements within each 128-bit lane: x_i = row i (8 elements
 * per lane) in, y_j = element j of rows 0..7 out.  Three rounds of interleaves (16-, 32-,
 * then 64-bit), 24 in-lane shuffles for 128 elements; P names the intrinsics of the
 * vector type VT (_mm256 for __m256i, _mm512 for __m512i). */
#define FA_TRANSPOSE_H8X8(VT, P, x, y) do { \
    /* pairs of rows 2p, 2p+1: 32-bit lane u of lo[p] is their element u, of hi[p] 4 + u */ \
    VT lo_[4], hi_[4], c_[2][4]; \
    for (int p_ = 0; p_ < 4; p_++) { \
        lo_[p_] = P##_unpacklo_epi16((x)[2 * p_], (x)[2 * p_ + 1]); \
        hi_[p_] = P##_unpackhi_epi16((x)[2 * p_], (x)[2 * p_ + 1]); \
    } \
    /* quads of rows 4Q..4Q+3: 64-bit lane v of c[Q][w] is their element 2w + v */ \
    for (int Q_ = 0; Q_ < 2; Q_++) { \
        c_[Q_][0] = P##_unpacklo_epi32(lo_[2 * Q_], lo_[2 * Q_ + 1]); \
        c_[Q_][1] = P##_unpackhi_epi32(lo_[2 * Q_], lo_[2 * Q_ + 1]); \
        c_[Q_][2] = P##_unpacklo_epi32(hi_[2 * Q_], hi_[2 * Q_ + 1]); \
        c_[Q_][3] = P##_unpackhi_epi32(hi_[2 * Q_], hi_[2 * Q_ + 1]); \
    } \
    for (int w_ = 0; w_ < 4; w_++) { \
        (y)[2 * w_] = P##_unpacklo_epi64(c_[0][w_], c_[1][w_]); \
        (y)[2 * w_ + 1] = P##_unpackhi_epi64(c_[0][w_], c_[1][w_]); \
    } \
} while (0)
FA_INLINE void fa_transpose_h8x8(const __m256i* x, __m256i* y)
{
    FA_TRANSPOSE_H8X8(__m256i, _mm256, x, y);
}

/* The 8 keys r[0..7] (D 16-bit elements each, D % 8 == 0) transposed, as bits, into o:
 * 8 elements per dimension; in each block of 16 dims from d0, dim d0 + e at
 * o + 8 (d0 + 2 (e % 8) + e / 8), the two 128-bit lanes of the transpose side by side; a
 * last block of 8 dims (D % 16 == 8) in order. */
FA_INLINE void fa_kt8_group(const uint16_t* const* r, ptrdiff_t D, uint16_t* o)
{
    __m256i x[8], y[8];
    ptrdiff_t d0 = 0;
    for (; d0 + 16 <= D; d0 += 16) {
        for (int i = 0; i < 8; i++) x[i] = _mm256_loadu_si256((const __m256i*)(r[i] + d0));
        fa_transpose_h8x8(x, y);
        for (int j = 0; j < 8; j++) _mm256_store_si256((__m256i*)(o + 8 * d0 + 16 * j), y[j]);
    }
    if (d0 < D) {
        for (int i = 0; i < 8; i++)
            x[i] = _mm256_zextsi128_si256(_mm_loadu_si128((const __m128i*)(r[i] + d0)));
        fa_transpose_h8x8(x, y);
        for (int j = 0; j < 8; j++)
            _mm_store_si128((__m128i*)(o + 8 * d0 + 8 * j), _mm256_castsi256_si128(y[j]));
    }
}
/* Keys first .. first + n - 1 of a decode score call: kr[0] + i ldk, or the rows kr[i]
 * when ldk is 0. */
FA_INLINE void fa_call_rows(const uint16_t* const* kr, ptrdiff_t ldk, int first, int n,
                            const uint16_t** r)
{
    for (int i = 0; i < n; i++) r[i] = ldk ? kr[0] + (first + i) * ldk : kr[first + i];
}
/* The call's 32 keys transposed for the 16-bit decode score kernel
 * (fa_score_keys32_kt8): the 8 keys of group g (keys 8g .. 8g+7) at kh + 8 g D, as
 * fa_kt8_group lays them out.  Not inlined: inside the score kernel GCC keeps the 8 row
 * offsets on the stack and reloads them. */
FA_NOINLINE void fa_kt8_transpose(const uint16_t* const* kr, ptrdiff_t ldk, ptrdiff_t D,
                                  uint16_t* kh)
{
    for (int g = 0; g < 4; g++) {
        const uint16_t* r[8];
        fa_call_rows(kr, ldk, 8 * g, 8, r);
        fa_kt8_group(r, D, kh + 8 * g * D);
    }
}
#endif

#define KE float
#define K32(name) name##_f
#define KE_SCALAR(x) (x)
#define FA_YROWS fa_yrows_f
#include "fa_keys32.h"
#define KE uint16_t
#define K32(name) name##_fh
#define KE_SCALAR(x) fa_f16_to_f32(x)
#define FA_YROWS fa_yrows_fh
#if defined(__AVX2__) && defined(__F16C__)
#define KE_LOAD8W(p) ((fa_vf8)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(p))))
#endif
#include "fa_keys32.h"
#define KE uint16_t
#define K32(name) name##_fb
#define KE_SCALAR(x) fa_bf16_to_f32(x)
#define FA_YROWS fa_yrows_fb
#if defined(__AVX2__) && defined(__F16C__)
#define KE_LOAD8W(p) \
    ((fa_vf8)_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)(p))), 16))
#endif
#include "fa_keys32.h"
#if FA_VBYTES == 64 && FA_DCHUNK % 16 == 0
/* ---- the 16-bit decode score kernel of AVX-512 builds ----
 * fa_score_keys32_kt8 in 16-key vectors: the call's 32 keys are transposed, still 16-bit,
 * 16 keys x 16 dims at a time (8 row loads, 8 inserts, 24 in-lane unpacks and 8 lane
 * permutations of zmm registers), then each dimension takes one widening load per 16
 * keys for 4 broadcasts of q and 4 FMAs: two 16-key halves x 4 rows = 8 chains in
 * flight, their chunk sums beside them in registers.  Against the 8-key kernel, half the
 * conversions and FMAs per key and dimension, on two ports where ymm has three.  Per
 * score the same chain:
 * acc += k[d] * q[d] in order of d, chunk sums in order, then * scale. */

/* 16 keys r[0..15] (D 16-bit elements each, D % 16 == 0) transposed, as bits, into o: in
 * each block of 16 dims from d0, the 16 keys of dim d0 + e at o + 16 (d0 + 2 (e % 8) + e / 8).
 * x[i] holds rows i and i + 8; the 8 x 8 transposes of FA_TRANSPOSE_H8X8 run in each of
 * its four 128-bit lanes, leaving [dim e: keys 0-7 | dim e + 8: keys 0-7 | dim e: keys
 * 8-15 | dim e + 8: keys 8-15], and one permutation of 64-bit lanes pairs the keys of a
 * dim. */
FA_INLINE void fa_kt16_group(const uint16_t* const* r, ptrdiff_t D, uint16_t* o)
{
    const __m512i pair_keys = _mm512_setr_epi64(0, 1, 4, 5, 2, 3, 6, 7);
    for (ptrdiff_t d0 = 0; d0 < D; d0 += 16) {
        __m512i x[8], y[8];
        for (int i = 0; i < 8; i++)
            x[i] = _mm512_inserti64x4(
                _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i*)(r[i] + d0))),
                _mm256_loadu_si256((const __m256i*)(r[i + 8] + d0)), 1);
        FA_TRANSPOSE_H8X8(__m512i, _mm512, x, y);
        for (int j = 0; j < 8; j++)
            _mm512_store_si512((__m512i*)(o + 16 * (d0 + 2 * j)),
                               _mm512_permutexvar_epi64(pair_keys, y[j]));
    }
}

/* The call's 32 keys transposed: keys 16h .. 16h + 15 at kh + 16 h D, as fa_kt16_group
 * lays them out.  Not inlined, as fa_kt8_transpose. */
FA_NOINLINE void fa_kt16_transpose(const uint16_t* const* kr, ptrdiff_t ldk, ptrdiff_t D,
                                   uint16_t* kh)
{
    for (int h = 0; h < 2; h++) {
        const uint16_t* r[16];
        fa_call_rows(kr, ldk, 16 * h, 16, r);
        fa_kt16_group(r, D, kh + 16 * h * D);
    }
}

/* 16 keys of one dim widened: float16 converted, bfloat16 shifted into the high half. */
FA_INLINE __m512 fa_kt16_widen(const uint16_t* p, const int bf)
{
    const __m256i x = _mm256_load_si256((const __m256i*)p);
    return bf ? _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(x), 16))
              : _mm512_cvtph_ps(x);
}

/* One pass: 4 rows of Q^T (qt[d * ldqt + r]) over the call's 32 transposed keys kh;
 * s[t * lds + r] for rows r < min(4, nstore).  pfs: the call's prefetch streams, on the
 * first pass only (else NULL), a step per 8 dims. */
FA_INLINE void fa_kt16_pass(const uint16_t* kh, const float* qt, const ptrdiff_t ldqt,
                            ptrdiff_t D, float scale, float* s, ptrdiff_t lds, int nstore,
                            const int bf, fa_dec_pf* pfs)
{
    __m512 a[4][2], part[4][2];
    for (int r = 0; r < 4; r++)
        for (int g = 0; g < 2; g++) a[r][g] = part[r][g] = _mm512_setzero_ps();
    for (ptrdiff_t d0 = 0; d0 < D; d0 += 16) {
        if (d0 && d0 % FA_DCHUNK == 0)
            for (int r = 0; r < 4; r++)
                for (int g = 0; g < 2; g++) {
                    part[r][g] = d0 == FA_DCHUNK ? a[r][g] : _mm512_add_ps(part[r][g], a[r][g]);
                    a[r][g] = _mm512_setzero_ps();
                }
        for (int h = 0; h < 2; h++) {   /* dims d0 + 8h + e, e < 8 */
            if (pfs) fa_dec_pf_step(pfs);
#pragma GCC unroll 8
            for (int e = 0; e < 8; e++) {
                const uint16_t* kd = kh + 16 * (d0 + 2 * e + h);
                const float* qd = qt + (d0 + 8 * h + e) * ldqt;
                const __m512 k0 = fa_kt16_widen(kd, bf), k1 = fa_kt16_widen(kd + 16 * D, bf);
                for (int r = 0; r < 4; r++) {
                    const __m512 qb = _mm512_set1_ps(qd[r]);
                    a[r][0] = _mm512_fmadd_ps(qb, k0, a[r][0]);
                    a[r][1] = _mm512_fmadd_ps(qb, k1, a[r][1]);
                }
            }
        }
    }
    const __m512 sc = _mm512_set1_ps(scale);
    float o[4][32] __attribute__((aligned(64)));
    for (int r = 0; r < 4; r++)
        for (int g = 0; g < 2; g++)
            _mm512_store_ps(o[r] + 16 * g, _mm512_mul_ps(
                D > FA_DCHUNK ? _mm512_add_ps(part[r][g], a[r][g]) : a[r][g], sc));
    if (nstore >= 4) {
        for (int t = 0; t < 32; t++) {   /* a key's 4 rows side by side, as the softmax reads them */
            const float w[4] = {o[0][t], o[1][t], o[2][t], o[3][t]};
            memcpy(s + t * lds, w, sizeof w);
        }
    } else {
        for (int r = 0; r < nstore; r++)
            for (int t = 0; t < 32; t++) s[t * lds + r] = o[r][t];
    }
}

/* npass passes of 4 rows over a call of 32 16-bit keys (bf: bfloat16, else float16), D a
 * multiple of 16 up to FA_KT8_MAX_D. */
FA_INLINE void fa_score_keys32_kt16(const uint16_t* const* kr, ptrdiff_t ldk, const float* qt,
                                    ptrdiff_t ldqt, ptrdiff_t D, float scale, float* s,
                                    ptrdiff_t lds, int nstore, const char* const* pf,
                                    ptrdiff_t pf_bytes, int npass, const int bf)
{
    uint16_t kh[32 * FA_KT8_MAX_D] __attribute__((aligned(64)));
    fa_kt16_transpose(kr, ldk, D, kh);
    fa_dec_pf pfs;   /* prefetch streams, see fa_dec_pf: issued by the first pass */
    fa_dec_pf_init(&pfs, pf, pf_bytes, (const char*)kr[0], ldk, 2, D, D / 8);
    for (int p = 0; p < npass; p++, qt += 4, s += 4, nstore -= 4) {
        /* ldqt as a constant where it is one (decode tiles): see fa_score_keys32_kt8 */
        if (ldqt == 8)
            fa_kt16_pass(kh, qt, 8, D, scale, s, lds, nstore, bf, p == 0 ? &pfs : NULL);
        else
            fa_kt16_pass(kh, qt, ldqt, D, scale, s, lds, nstore, bf, p == 0 ? &pfs : NULL);
    }
}
/* Whether fa_score_keys32_kt16 takes calls of D dims (else the 8-key kernel does). */
#define FA_KT16(D) ((D) % 16 == 0)
#else
#define FA_KT16(D) 0
#define fa_score_keys32_kt16(...) ((void)0)
#endif

#if defined(__AVX2__) && defined(__F16C__)
/* The decode score kernel of 16-bit K for npass passes of 4 rows over a whole call of
 * keys: kr[0] + i ldk, or the rows kr[i] when ldk is 0 -- 16 keys per vector where the
 * build has them (fa_score_keys32_kt16), else 8 (fa_score_keys32_kt8). */
#define FA_HAVE_GQA4_16 1
#define FA_SCORE_GQA4(SUF, BF) \
FA_NOINLINE void fa_score_gqa4##SUF(const uint16_t* const* kr, ptrdiff_t ldk, const float* qt, \
                                    ptrdiff_t ldqt, ptrdiff_t D, float scale, float* s, \
                                    ptrdiff_t lds, int nstore, const char* const* pf, \
                                    ptrdiff_t pf_bytes, int npass) \
{ \
    if (FA_KT16(D)) \
        fa_score_keys32_kt16(kr, ldk, qt, ldqt, D, scale, s, lds, nstore, pf, pf_bytes, npass, BF); \
    else \
        fa_score_keys32_kt8##SUF(kr, ldk, qt, ldqt, D, scale, s, lds, nstore, pf, pf_bytes, npass, 4); \
}
FA_SCORE_GQA4(_fh, 0)
FA_SCORE_GQA4(_fb, 1)
#undef FA_SCORE_GQA4
#endif
/* The 4- and 8-row passes: fa_score_keys32_wide with AVX2.  SSE2's 16 xmm registers do
 * not hold 4 rows x 8-lane accumulators beside the 8x4 transposes (they spill), and with
 * AVX-512 the whole 16x16 transposes of fa_score_keyrows feed 4 or 8 rows of FMAs per
 * shuffle, more than the 8-key transposes: both take a call's keys as whole vectors
 * (fa_score_keyrows_split); the output kernel then prefetches the next K rows
 * (FA_DEC_SCORES_PREFETCH_K_ROWS_F). */
#if FA_VBYTES == 32 && defined(__AVX__)
#define FA_KEYS32_WIDE(suf) fa_score_keys32_wide##suf
#else
#define FA_KEYS32_WIDE(suf) fa_score_keyrows_split##suf
#endif
#define KEYROWS_IMPL_WIDE FA_KEYS32_WIDE(_f)
#define KEYROWS_IMPL fa_score_keys32_f
#ifndef FA_HAVE_GQA4_16
/* Builds without that kernel never call it (the tile pipeline checks FA_HAVE_GQA4_16);
 * the names exist so that the pipeline compiles the same in every build. */
#define FA_HAVE_GQA4_16 0
#define fa_score_gqa4_fh(...) ((void)0)
#define fa_score_gqa4_fb(...) ((void)0)
#endif

/* ---- micro-kernels, float compute ----
 * K and V are read through the storage-type macros (KV, LOAD_KV, KV_SCALAR,
 * LOAD_TRANSPOSE_KV).  First with the compute type as the storage type; then, for
 * float16 and bfloat16, only the kernels that read K or V (FA_KV_KERNELS_ONLY), which the
 * decode tiles use to read 16-bit K and V in place, widening every load in registers.
 * Prefill tiles widen a key block into the workspace once instead (the tile pipeline's
 * _load_block) and run the float-storage kernels. */
#define T float
#define V fa_vf
#define VL FA_VL_F
#define LOAD fa_load_f
#define STORE fa_store_f
#define BCAST fa_bcast_f
#define MAX fa_max_f
#define SELECT fa_select_f
#define EXP2 fa_exp2_f
#define LOAD_TRANSPOSE fa_load_transpose_vf
#define FA_FN(name) name##_f
#define KV T
#define LOAD_KV LOAD
#define KV_SCALAR(x) (x)
#define LOAD_TRANSPOSE_KV LOAD_TRANSPOSE
#include "fa_tile_impl.h"
#define FA_KV_KERNELS_ONLY
#define KV uint16_t
#define FA_FN(name) name##_fh
#define LOAD_KV fa_load_fh
#define KV_SCALAR(x) fa_f16_to_f32(x)
#define LOAD_TRANSPOSE_KV fa_load_transpose_vfh
#define KEYROWS_IMPL fa_score_keys32_fh
#define KEYROWS_IMPL_WIDE FA_KEYS32_WIDE(_fh)
#include "fa_tile_impl.h"
#define KV uint16_t
#define FA_FN(name) name##_fb
#define LOAD_KV fa_load_fb
#define KV_SCALAR(x) fa_bf16_to_f32(x)
#define LOAD_TRANSPOSE_KV fa_load_transpose_vfb
#define KEYROWS_IMPL fa_score_keys32_fb
#define KEYROWS_IMPL_WIDE FA_KEYS32_WIDE(_fb)
#include "fa_tile_impl.h"
#undef FA_KV_KERNELS_ONLY
/*
 * The online-softmax step of fa_softmax_step_f for a decode tile of at most 4 query rows
 * (lanes 0-3 of its vector; the other lanes are padding, left as they are): two keys per
 * vector, [key j: rows 0-3 | key j + 1: rows 0-3], so that no exp is computed for the
 * padding lanes, half the exps of the plain step.  The same bits in lanes 0-3: each lane
 * runs the same operations on the same values (exp2, the selects, and l * alpha + sum as
 * one FMA, in 8 lanes whose halves are equal), the sum adds the keys one at a time in key
 * order (the low half, then the high one), and the block max is the same value whatever
 * the order of the comparisons.
 */
FA_INLINE fa_v4f fa_load4_f(const float* p) { fa_v4f x; memcpy(&x, p, sizeof x); return x; }
FA_INLINE void fa_store4_f(float* p, fa_v4f x) { memcpy(p, &x, sizeof x); }
FA_INLINE fa_vf8 fa_join4_f(fa_v4f lo, fa_v4f hi)
{ return __builtin_shufflevector(lo, hi, 0, 1, 2, 3, 4, 5, 6, 7); }
FA_INLINE fa_v4f fa_lo4_f(fa_vf8 x) { return __builtin_shufflevector(x, x, 0, 1, 2, 3); }
FA_INLINE fa_v4f fa_hi4_f(fa_vf8 x) { return __builtin_shufflevector(x, x, 4, 5, 6, 7); }
/* keys j and j1 of the 4 rows (the same key twice for a single one) */
FA_INLINE fa_vf8 fa_key_pair_f(const float* s, ptrdiff_t lds, ptrdiff_t j, ptrdiff_t j1)
{ return fa_join4_f(fa_load4_f(s + j * lds), fa_load4_f(s + j1 * lds)); }

#define FA_HAVE_SOFTMAX_PAIRS 1
FA_NOINLINE void fa_softmax_pairs_f(float* s, ptrdiff_t lds, ptrdiff_t nj, ptrdiff_t jlo,
                                    ptrdiff_t jhi, float* m, float* l, float* alpha)
{
    const fa_vf8 ninf = fa_bcast_f8(-INFINITY), zero = fa_bcast_f8(0), one = fa_bcast_f8(1);
    fa_vf8 mb = ninf;
    ptrdiff_t j = jlo;
    for (; j + 1 < jhi; j += 2) mb = fa_max_f8(mb, fa_key_pair_f(s, lds, j, j + 1));
    if (j < jhi) mb = fa_max_f8(mb, fa_key_pair_f(s, lds, j, j));
    const fa_v4f mb4 = fa_lo4_f(fa_max_f8(mb, __builtin_shufflevector(mb, mb, 4, 5, 6, 7, 0, 1,
                                                                     2, 3)));
    const fa_vf8 m_old = fa_join4_f(fa_load4_f(m), fa_load4_f(m));
    const fa_vf8 m_new = fa_max_f8(m_old, fa_join4_f(mb4, mb4));
    const fa_vf8 a = fa_select_f8(m_new == m_old, one, fa_exp2_f8(m_old - m_new));
    const fa_vf8 m_sub = fa_select_f8(m_new == ninf, zero, m_new);
    fa_store4_f(m, fa_lo4_f(m_new));
    fa_store4_f(alpha, fa_lo4_f(a));
    for (j = 0; j < jlo; j++) fa_store_f8(s + j * lds, zero);
    fa_v4f sum = fa_lo4_f(zero);
    for (j = jlo; j + 1 < jhi; j += 2) {
        const fa_vf8 p = fa_exp2_f8(fa_key_pair_f(s, lds, j, j + 1) - m_sub);
        fa_store4_f(s + j * lds, fa_lo4_f(p));
        fa_store4_f(s + (j + 1) * lds, fa_hi4_f(p));
        sum += fa_lo4_f(p);
        sum += fa_hi4_f(p);
    }
    if (j < jhi) {
        const fa_vf8 p = fa_exp2_f8(fa_key_pair_f(s, lds, j, j) - m_sub);
        fa_store4_f(s + j * lds, fa_lo4_f(p));
        sum += fa_lo4_f(p);
    }
    for (j = jhi; j < nj; j++) fa_store_f8(s + j * lds, zero);
    const fa_vf8 l_old = fa_join4_f(fa_load4_f(l), fa_load4_f(l));
    fa_store4_f(l, fa_lo4_f(l_old * a + fa_join4_f(sum, sum)));
}
#ifndef FA_HAVE_SOFTMAX_PAIRS
#define FA_HAVE_SOFTMAX_PAIRS 0
#define fa_softmax_pairs_f(...) ((void)0)
#endif
#include "fa_compute_end.h"

/* ---- micro-kernels, double compute, double storage ---- */
#define T double
#define V fa_vd
#define VL FA_VL_D
#define LOAD fa_load_d
#define STORE fa_store_d
#define BCAST fa_bcast_d
#define MAX fa_max_d
#define SELECT fa_select_d
#define EXP2 fa_exp2_d
#define LOAD_TRANSPOSE fa_load_transpose_vd
#define FA_FN(name) name##_d
#define KV T
#define LOAD_KV LOAD
#define KV_SCALAR(x) (x)
#define LOAD_TRANSPOSE_KV LOAD_TRANSPOSE
#include "fa_tile_impl.h"
#include "fa_compute_end.h"

/* ---- score modifiers (the finish-scores stage; scores are in base 2) ----
 * Each works on nk keys of nvec whole vectors of rows, per lane only, so a row gets the
 * same bits in a decode tile as in a prefill tile. */

/* The odd series of tanh(ax) for 0 <= ax < 0.4. */
FA_INLINE fa_vf fa_tanh_series_f(fa_vf ax)
{
    const fa_vf z = ax * ax;
    fa_vf p = fa_bcast_f(21844.0f / 6081075.0f);
    p = p * z + fa_bcast_f(-1382.0f / 155925.0f);
    p = p * z + fa_bcast_f(62.0f / 2835.0f);
    p = p * z + fa_bcast_f(-17.0f / 315.0f);
    p = p * z + fa_bcast_f(2.0f / 15.0f);
    p = p * z + fa_bcast_f(-1.0f / 3.0f);
    return ax + ax * (z * p);
}

/* e^(-2x) for the tanh below, its exponent rounded before the exp: left to the compiler,
 * the product is fused into the exp's first operations in one build and not in another,
 * and the AVX2 and AVX-512 kernels would differ in the last bit. */
FA_INLINE fa_vf fa_exp_m2x_f(fa_vf x)
{
    fa_vf x2 = x * fa_bcast_f(-2.0f * 1.44269504088896341f);
#if defined(__AVX__)
    __asm__("" : "+v"(x2));
#else
    __asm__("" : "+m"(x2));
#endif
    return fa_exp2_f(x2);
}

/* tanh for float vectors: for |x| < 0.4 the odd Taylor series to x^13 (truncation below
 * 4e-9 relative), else (1 - e) / (1 + e) with e = 2^(-2|x| log2 e) <= 0.45, which has no
 * cancellation.  Accuracy is measured by tests/test_exp.py. */
FA_INLINE fa_vf fa_tanh_f(fa_vf x)
{
    const fa_vf ax = fa_select_f(x < 0, -x, x);
    const fa_vf small = fa_tanh_series_f(ax);
    const fa_vfi is_small = ax < fa_bcast_f(0.4f);
    fa_vf r = small;
    /* Capped scores are mostly well inside the cap (|s / softcap| < 0.4): the exp and the
     * division run only for vectors with a lane outside.  Each lane's result is the same
     * either way. */
    if (!fa_all_f(is_small)) {
        const fa_vf e = fa_exp_m2x_f(ax);
        const fa_vf one = fa_bcast_f(1.0f);
        r = fa_select_f(is_small, small, (one - e) / (one + e));
    }
    return fa_select_f(x < 0, -r, r);
}

/* tanh(x) - 1 for float vectors, with a small relative error also where tanh(x) is near
 * 1: for |x| < 0.4 the series of fa_tanh_f, then minus 1 (no cancellation: tanh(x) - 1 <=
 * -0.6); else -2e / (1 + e) for x > 0 and -2 / (1 + e) for x < 0, with e = 2^(-2|x| log2 e)
 * <= 0.45 (tanh(x) = (1 - e) / (1 + e) for x > 0).  Capped scores are kept as
 * c (tanh(x / c) - 1), see fa_softcap_f. */
FA_INLINE fa_vf fa_tanh_minus1_f(fa_vf x)
{
    const fa_vf one = fa_bcast_f(1.0f), two = fa_bcast_f(2.0f);
    const fa_vf ax = fa_select_f(x < 0, -x, x);
    const fa_vfi is_small = ax < fa_bcast_f(0.4f);
    const fa_vf small = fa_tanh_series_f(ax);
    fa_vf r = fa_select_f(x < 0, -small, small) - one;
    if (!fa_all_f(is_small)) {
        const fa_vf e = fa_exp_m2x_f(ax);
        const fa_vf num = fa_select_f(x < 0, two, two * e);
        r = fa_select_f(is_small, r, -(num / (one + e)));
    }
    return r;
}

/* Softcapping, s <- c tanh(s / c), with c = softcap * log2 e for base-2 scores, stored
 * shifted by -c: s <- c (tanh(s / c) - 1).  The scores that weigh in a capped softmax are
 * the ones near the cap, where c tanh(s / c) is a large number close to c and rounds to a
 * unit of ~8e-6 (in [64, 128) for softcap 50); shifted, they are small numbers that keep
 * their low bits, and the softmax does not change under a shift of all scores.  What
 * reads the finished scores as values (lse, sinks, the backward's P) adds c back (see
 * _cap_shift).  s / c is a product with 1 / c, computed once per call, as a vector
 * division costs several times a multiply. */
static void fa_softcap_f(float* s, ptrdiff_t lds, ptrdiff_t nk, int nvec, float c)
{
    const fa_vf vc = fa_bcast_f(c), inv = fa_bcast_f(1.0f / c);
    for (ptrdiff_t j = 0; j < nk; j++)
        for (int t = 0; t < nvec; t++) {
            float* p = s + j * lds + t * FA_VL_F;
            fa_store_f(p, vc * fa_tanh_minus1_f(fa_load_f(p) * inv));
        }
}
/* float64 scores take libm's exp, lane by lane: tanh(y) - 1 = -2 / (1 + e^(2y)). */
static void fa_softcap_d(double* s, ptrdiff_t lds, ptrdiff_t nk, int nvec, double c)
{
    for (ptrdiff_t j = 0; j < nk; j++)
        for (ptrdiff_t r = 0; r < nvec * FA_VL_D; r++)
            s[j * lds + r] = c * (-2.0 / (1.0 + exp(2.0 * (s[j * lds + r] / c))));
}

/* ALiBi: s[j] += nslope * |diag - j| for keys j = j0 .. j0 + nk - 1, per lane: nslope is
 * -slope * log2 e of the lane's head, diag its row's diagonal i + kv_len - q_len. */
#define FA_ALIBI(SUF, T, V, VL, LOAD, STORE, BCAST, SELECT) \
static void fa_alibi_##SUF(T* s, ptrdiff_t lds, ptrdiff_t j0, ptrdiff_t nk, \
                           const T* nslope, const T* diag, int nvec) \
{ \
    for (int t = 0; t < nvec; t++) { \
        const V sl = LOAD(nslope + t * VL), dg = LOAD(diag + t * VL); \
        for (ptrdiff_t j = 0; j < nk; j++) { \
            T* p = s + j * lds + t * VL; \
            V dj = dg - BCAST((T)(j0 + j)); \
            dj = SELECT(dj < 0, -dj, dj); \
            STORE(p, LOAD(p) + sl * dj); \
        } \
    } \
}
FA_ALIBI(f, float, fa_vf, FA_VL_F, fa_load_f, fa_store_f, fa_bcast_f, fa_select_f)
FA_ALIBI(d, double, fa_vd, FA_VL_D, fa_load_d, fa_store_d, fa_bcast_d, fa_select_d)
#undef FA_ALIBI

/* Whole-array versions of the vector functions, for measuring their accuracy from the
 * tests: the array in vectors, the last one zero-padded. */
#define FA_ARRAY_FN(NAME, T, VL, LOAD, STORE, FN) \
static inline void NAME(const T* x, T* y, ptrdiff_t n) \
{ \
    T buf[64]; \
    for (ptrdiff_t i = 0; i < n; i += VL) { \
        ptrdiff_t m = n - i < VL ? n - i : VL; \
        for (ptrdiff_t t = 0; t < VL; t++) buf[t] = t < m ? x[i + t] : (T)0; \
        STORE(buf, FN(LOAD(buf))); \
        for (ptrdiff_t t = 0; t < m; t++) y[i + t] = buf[t]; \
    } \
}
FA_ARRAY_FN(fa_tanh_array_f, float, FA_VL_F, fa_load_f, fa_store_f, fa_tanh_f)
FA_ARRAY_FN(fa_exp2_array_f, float, FA_VL_F, fa_load_f, fa_store_f, fa_exp2_f)
FA_ARRAY_FN(fa_exp2_array_d, double, FA_VL_D, fa_load_d, fa_store_d, fa_exp2_d)
FA_ARRAY_FN(fa_exp2_array_f8, float, 8, fa_load_f8, fa_store_f8, fa_exp2_f8)
#undef FA_ARRAY_FN

/* ---- OpenMP and build facts ---- */
static inline int fa_have_openmp(void)
{
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}

static inline int fa_omp_max_threads(void)
{
#ifdef _OPENMP
    return omp_get_max_threads();
#else
    return 1;
#endif
}

#if defined(__clang__)
#define FA_COMPILER "clang " __clang_version__
#elif defined(__GNUC__)
#define FA_COMPILER "gcc " __VERSION__
#else
#define FA_COMPILER "unknown"
#endif

/* Whether a*b+c compiles to one fused multiply-add in this build (setup.py pins
 * -ffp-contract=fast; the ISA decides whether an FMA instruction exists).  Tests check
 * the kernel's rounding against it, so a build that loses contraction fails them. */
#if defined(__FMA__) || defined(__ARM_FEATURE_FMA) || defined(__aarch64__)
#define FA_HAS_FMA 1
#else
#define FA_HAS_FMA 0
#endif

#if defined(__AVX512F__)
#define FA_ISA "avx512"
#elif defined(__AVX2__) && defined(__FMA__)
#define FA_ISA "avx2"
#elif defined(__x86_64__) || defined(_M_X64)
#define FA_ISA "sse2"
#else
#define FA_ISA "generic"
#endif

/* Whole-array 16-bit conversions (tests compare them with NumPy's and ml_dtypes' casts). */
static void fa_widen_array_f(int kind, const uint16_t* x, float* y, ptrdiff_t n)
{ fa_widen_f(kind, x, n, y); }
static void fa_narrow_array_f(int kind, const float* x, uint16_t* y, ptrdiff_t n)
{ fa_narrow_f(kind, x, n, y); }

#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
/* F16C from CPUID leaf 1 (ECX bit 29): clang before 16 does not know "f16c" as a feature
 * name of __builtin_cpu_supports.  The AVX state it needs is the one the avx2 probe checks. */
static inline int fa_cpu_has_f16c(void) { return fa_cpuid_bit(1, 0, 2, 29); }
#endif

/* CPU probe for import-time dispatch (answers for the machine running, not the build host). */
static inline int fa_cpu_supports(const char* isa)
{
#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
    __builtin_cpu_init();
    /* every CPU with AVX2 and FMA has F16C; checked anyway, the builds use it */
    if (strcmp(isa, "avx2") == 0)
        return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")
               && fa_cpu_has_f16c();
    if (strcmp(isa, "avx512") == 0)
        return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")
               && __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl")
               && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")
               && fa_cpu_has_f16c();
    if (strcmp(isa, "sse2") == 0) return 1;
    return 0;
#else
    (void)isa;
    return 0;
#endif
}

/* Q^T of the 4 query rows of a decode tile of at most 4 rows (float compute):
 * qt[d * ldqt + t] = rows[t][d] for t < 4, the only lanes its kernels read (the others are
 * left as they are).  A 4-wide transpose per 4 dims, where fa_pack_qt_f would transpose
 * a whole vector of rows, most of them padding. */
static void fa_pack_qt4_f(const float* const* rows, ptrdiff_t D, float* qt, ptrdiff_t ldqt)
{
    ptrdiff_t d = 0;
#if FA_VBYTES == 64
#define FA_QT4_LANE(u, l, d0) \
    _mm_storeu_ps(qt + (d0 + 4 * l) * ldqt, _mm512_extractf32x4_ps(u[0], l)); \
    _mm_storeu_ps(qt + (d0 + 4 * l + 1) * ldqt, _mm512_extractf32x4_ps(u[1], l)); \
    _mm_storeu_ps(qt + (d0 + 4 * l + 2) * ldqt, _mm512_extractf32x4_ps(u[2], l)); \
    _mm_storeu_ps(qt + (d0 + 4 * l + 3) * ldqt, _mm512_extractf32x4_ps(u[3], l));
    for (; d + 16 <= D; d += 16) {
        const __m512 a = _mm512_loadu_ps(rows[0] + d), b = _mm512_loadu_ps(rows[1] + d);
        const __m512 c = _mm512_loadu_ps(rows[2] + d), e = _mm512_loadu_ps(rows[3] + d);
        const __m512 t0 = _mm512_unpacklo_ps(a, b), t1 = _mm512_unpackhi_ps(a, b);
        const __m512 t2 = _mm512_unpacklo_ps(c, e), t3 = _mm512_unpackhi_ps(c, e);
        /* u[i], 128-bit lane l: dim 4l + i of the 4 rows */
        const __m512 u[4] = {_mm512_shuffle_ps(t0, t2, 0x44), _mm512_shuffle_ps(t0, t2, 0xEE),
                             _mm512_shuffle_ps(t1, t3, 0x44), _mm512_shuffle_ps(t1, t3, 0xEE)};
        FA_QT4_LANE(u, 0, d) FA_QT4_LANE(u, 1, d) FA_QT4_LANE(u, 2, d) FA_QT4_LANE(u, 3, d)
    }
#undef FA_QT4_LANE
#elif defined(__AVX__)
    for (; d + 8 <= D; d += 8) {
        const __m256 a = _mm256_loadu_ps(rows[0] + d), b = _mm256_loadu_ps(rows[1] + d);
        const __m256 c = _mm256_loadu_ps(rows[2] + d), e = _mm256_loadu_ps(rows[3] + d);
        const __m256 t0 = _mm256_unpacklo_ps(a, b), t1 = _mm256_unpackhi_ps(a, b);
        const __m256 t2 = _mm256_unpacklo_ps(c, e), t3 = _mm256_unpackhi_ps(c, e);
        /* u[i], 128-bit lane l: dim 4l + i of the 4 rows */
        const __m256 u[4] = {_mm256_shuffle_ps(t0, t2, 0x44), _mm256_shuffle_ps(t0, t2, 0xEE),
                             _mm256_shuffle_ps(t1, t3, 0x44), _mm256_shuffle_ps(t1, t3, 0xEE)};
        for (int i = 0; i < 4; i++) {
            _mm_storeu_ps(qt + (d + i) * ldqt, _mm256_castps256_ps128(u[i]));
            _mm_storeu_ps(qt + (d + 4 + i) * ldqt, _mm256_extractf128_ps(u[i], 1));
        }
    }
#endif
#if defined(__SSE__)
    for (; d + 4 <= D; d += 4) {
        __m128 a = _mm_loadu_ps(rows[0] + d), b = _mm_loadu_ps(rows[1] + d);
        __m128 c = _mm_loadu_ps(rows[2] + d), e = _mm_loadu_ps(rows[3] + d);
        _MM_TRANSPOSE4_PS(a, b, c, e);
        _mm_storeu_ps(qt + d * ldqt, a);
        _mm_storeu_ps(qt + (d + 1) * ldqt, b);
        _mm_storeu_ps(qt + (d + 2) * ldqt, c);
        _mm_storeu_ps(qt + (d + 3) * ldqt, e);
    }
#endif
    for (; d < D; d++)
        for (int t = 0; t < 4; t++) qt[d * ldqt + t] = rows[t][d];
}

#include "fa_quant.h"
#include "fa_by_kind.h"
#include "fa_bf16dot.h"
#include "fa_int8dot.h"
#include "fa_amx.h"

#endif /* FA_KERNELS_H */
