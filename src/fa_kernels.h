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
 * of every vector width, so that the decode kernels' steps never straddle a chunk; 64 keeps
 * the head dims most models use (<= 64) on a single chain, so chunking costs them nothing. */
#define FA_DCHUNK 64
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

/* Prefetch [p, p + bytes) into L2, a line at a time (the decode kernels' streams). */
static inline void fa_prefetch_l2(const char* p, ptrdiff_t bytes)
{
    for (ptrdiff_t off = 0; off < bytes; off += 64) __builtin_prefetch(p + off, 0, 2);
}

/* ---- decode score kernel for 32-byte float vectors (AVX2 and the SSE2 baseline) ----
 * With 8 float lanes, transposing whole 8x8 blocks of K (fa_score_keyrows) leaves one
 * query row a single FMA chain per 8 keys: bound by the FMA latency, not by loads.
 * Here a call takes 32 keys (4 groups of 8) and
 * transposes 8 keys x 4 dims at a time -- two 128-bit loads and a blend (or insert) per
 * vector, then two in-lane shuffles -- so that nr rows x ng groups = 4 independent chains
 * are in flight.
 * Per score it is still the chain acc += k[d] * q[d], d = 0, 1, ... then * scale: bit for
 * bit the prefill score.  kr: 32 key rows (zero rows past nk); pf: the 32 V rows to
 * prefetch (or NULL), as in fa_score_keyrows. */
#if FA_VBYTES == 32
#define FA_DEC_KEYS_F 32
/* Decode tiles of at most this many rows prefetch the next K rows in the score kernel
 * (fa_score_keys32_f's first pass); larger ones in the output kernel (fa_pv_row8/rows4). */
#if defined(__AVX__)
#define FA_DEC_SCORES_PREFETCH_K_ROWS_F 8
#else
#define FA_DEC_SCORES_PREFETCH_K_ROWS_F 2
#endif
typedef float fa_v4f __attribute__((vector_size(16)));

/* t[i][lane] = k[lane][d0 + i] for 8 key rows k, i < 4. */
FA_INLINE void fa_load_transpose_8x4_f(const float* const* k, ptrdiff_t d0, fa_vf* t)
{
    /* y_i = [k_i | k_(i+4)]: keys 0-3 in the low 128-bit lane, 4-7 in the high one */
#if defined(__AVX__)
    /* two broadcast loads and a blend (vinsertf128 would take a shuffle-port uop) */
#define FA_Y(i) (fa_vf)_mm256_blend_ps(_mm256_broadcast_ps((const __m128*)(k[i] + d0)), \
                                       _mm256_broadcast_ps((const __m128*)(k[i + 4] + d0)), 0xF0)
    const fa_vf y0 = FA_Y(0), y1 = FA_Y(1), y2 = FA_Y(2), y3 = FA_Y(3);
#undef FA_Y
#else
    fa_v4f h[8];
    for (int i = 0; i < 8; i++) memcpy(&h[i], k[i] + d0, sizeof h[i]);
    const fa_vf y0 = __builtin_shufflevector(h[0], h[4], 0, 1, 2, 3, 4, 5, 6, 7);
    const fa_vf y1 = __builtin_shufflevector(h[1], h[5], 0, 1, 2, 3, 4, 5, 6, 7);
    const fa_vf y2 = __builtin_shufflevector(h[2], h[6], 0, 1, 2, 3, 4, 5, 6, 7);
    const fa_vf y3 = __builtin_shufflevector(h[3], h[7], 0, 1, 2, 3, 4, 5, 6, 7);
#endif
    /* then a 4x4 transpose inside each lane: unpack, then 64-bit shuffles */
    const fa_vf u0 = __builtin_shufflevector(y0, y1, 0, 8, 1, 9, 4, 12, 5, 13);
    const fa_vf u1 = __builtin_shufflevector(y0, y1, 2, 10, 3, 11, 6, 14, 7, 15);
    const fa_vf u2 = __builtin_shufflevector(y2, y3, 0, 8, 1, 9, 4, 12, 5, 13);
    const fa_vf u3 = __builtin_shufflevector(y2, y3, 2, 10, 3, 11, 6, 14, 7, 15);
    t[0] = __builtin_shufflevector(u0, u2, 0, 1, 8, 9, 4, 5, 12, 13);
    t[1] = __builtin_shufflevector(u0, u2, 2, 3, 10, 11, 6, 7, 14, 15);
    t[2] = __builtin_shufflevector(u1, u3, 0, 1, 8, 9, 4, 5, 12, 13);
    t[3] = __builtin_shufflevector(u1, u3, 2, 3, 10, 11, 6, 7, 14, 15);
}

/* The same from 8 equally spaced rows k, k + ldk, ..., k + 7 ldk: with one base pointer
 * and a stride the addresses come from addressing modes instead of 32 row pointers
 * reloaded from memory every step (which made the loop load-port bound). */
FA_INLINE void fa_load_transpose_8x4s_f(const float* k, ptrdiff_t ldk, ptrdiff_t d0, fa_vf* t)
{
    const float* rows[8];
    for (int i = 0; i < 8; i++) rows[i] = k + i * ldk;
    fa_load_transpose_8x4_f(rows, d0, t);
}

/* One step: 4 dims of the 8 keys of group g into the nr accumulators a[r]. */
FA_INLINE void fa_keys32_step_f(const float* const* kr, ptrdiff_t ldk, int g, ptrdiff_t d0,
                                const float* qt, ptrdiff_t ldqt, const int nr, fa_vf* a)
{
    fa_vf t[4];
    if (ldk)
        fa_load_transpose_8x4s_f(kr[0] + 8 * g * ldk, ldk, d0, t);
    else
        fa_load_transpose_8x4_f(kr + 8 * g, d0, t);
    for (int i = 0; i < 4; i++) {
        const float* qd = qt + (d0 + i) * ldqt;
        for (int r = 0; r < nr; r++) a[r] += fa_bcast_f(qd[r]) * t[i];
    }
}

/* The two prefetch streams of a decode score call (its first row pass, pf_bytes > 0):
 * the V rows of its 32 keys (into L2, for the output kernel that follows; not when pf is
 * NULL, the output kernel then streams V itself) and the next 32 rows of K (into L1, for
 * the next call; only for evenly spaced rows, ldk != 0), each
 * spread evenly over the call's nsteps steps and issued line by line in address order.
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
    ptrdiff_t nsteps, v_row_lines, v_lines, k_row_lines, k_lines, k_stride;
    ptrdiff_t v_err, v_row, v_col, k_err, k_row, k_col;
    ptrdiff_t v_step, k_step;   /* linear: lines per step of each stream */
    int on, lin;
} fa_dec_pf;

FA_INLINE void fa_dec_pf_init(fa_dec_pf* p, const char* const* pf, ptrdiff_t pf_bytes,
                              const float* k0, ptrdiff_t ldk, ptrdiff_t D, ptrdiff_t nsteps)
{
    p->on = pf_bytes > 0 && nsteps > 0;
    p->v_rows = pf;
    p->nsteps = nsteps;
    p->v_row_lines = (pf_bytes + 63) / 64;
    p->v_lines = pf ? 32 * p->v_row_lines : 0;          /* pf NULL: the K stream only */
    p->k_row_lines = (D * (ptrdiff_t)sizeof(float) + 63) / 64;
    p->k_lines = ldk ? 32 * p->k_row_lines : 0;          /* rows k0 + (32 + i) ldk */
    p->k_stride = ldk * (ptrdiff_t)sizeof(float);
    p->k_lin = (const char*)(k0 + 32 * ldk);
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
        for (ptrdiff_t i = 0; i < p->k_step; i++) __builtin_prefetch(p->k_lin + 64 * i, 0, 3);
        p->v_lin += 64 * p->v_step;
        p->k_lin += 64 * p->k_step;
        return;
    }
    for (p->v_err += p->v_lines; p->v_err >= p->nsteps; p->v_err -= p->nsteps) {
        __builtin_prefetch(p->v_rows[p->v_row] + 64 * p->v_col, 0, 2);
        if (++p->v_col == p->v_row_lines) { p->v_col = 0; p->v_row++; }
    }
    for (p->k_err += p->k_lines; p->k_err >= p->nsteps; p->k_err -= p->nsteps) {
        __builtin_prefetch(p->k_lin + p->k_row * p->k_stride + 64 * p->k_col, 0, 3);
        if (++p->k_col == p->k_row_lines) { p->k_col = 0; p->k_row++; }
    }
}

FA_INLINE void fa_score_keys32_body_f(const float* const* kr, ptrdiff_t ldk, int nk,
                                      const float* qt, ptrdiff_t ldqt, ptrdiff_t D,
                                      float scale, float* s, ptrdiff_t lds, const int nr,
                                      int nstore, const char* const* pf, ptrdiff_t pf_bytes)
{
    /* groups of 8 keys per sweep over d: nr * ng = 4 accumulator chains (nr <= 4) */
    const int ng = nr >= 4 ? 1 : 4 / nr;
    const fa_vf sc = fa_bcast_f(scale);
    fa_dec_pf pfs;   /* prefetch streams, see fa_dec_pf */
    fa_dec_pf_init(&pfs, pf, pf_bytes, kr[0], ldk, D,
                   (D / 4) * ((((nk + 7) / 8) + ng - 1) / ng));
    for (int g0 = 0; g0 < 4 && 8 * g0 < nk; g0 += ng) {
        fa_vf a[4][8];   /* nr <= 4 is called; 8 keeps the unused 8-row wrapper in bounds */
        float part[4][8][8];   /* the sums of the chunks before the current one */
        for (int g = 0; g < ng; g++)
            for (int r = 0; r < nr; r++) a[g][r] = fa_bcast_f(0);
#define FA_FOLD(d) \
        if ((d) && (d) % FA_DCHUNK == 0) \
            for (int g = 0; g < ng; g++) \
                for (int r = 0; r < nr; r++) { \
                    fa_store_f(part[g][r], (d) == FA_DCHUNK ? a[g][r] \
                                                            : fa_load_f(part[g][r]) + a[g][r]); \
                    a[g][r] = fa_bcast_f(0); \
                }
        ptrdiff_t d0 = 0;
        for (; d0 + 4 <= D; d0 += 4) {
            FA_FOLD(d0)
            fa_dec_pf_step(&pfs);
            /* unrolled, so that a[g] stays in registers (a loop over g kept the accumulator
             * array in memory: a store and reload in every step of every FMA chain) */
#pragma GCC unroll 4
            for (int g = 0; g < ng; g++)
                fa_keys32_step_f(kr, ldk, g0 + g, d0, qt, ldqt, nr, a[g]);
        }
        for (; d0 < D; d0++) {   /* D % 4 leftover dimensions, lane-gathered */
            FA_FOLD(d0)
            const float* qd = qt + d0 * ldqt;
            for (int g = 0; g < ng; g++) {
                float col[8];
                for (int i = 0; i < 8; i++) col[i] = kr[8 * (g0 + g) + i][d0];
                const fa_vf kd = fa_load_f(col);
                for (int r = 0; r < nr; r++) a[g][r] += fa_bcast_f(qd[r]) * kd;
            }
        }
        /* Out through a buffer indexed by constants only: a runtime bound on r here (nstore)
         * kept the accumulator array in memory, a store on every step of every FMA chain. */
#undef FA_FOLD
        float out[4][8][8];
        for (int g = 0; g < ng; g++)
            for (int r = 0; r < nr; r++)
                fa_store_f(out[g][r], (D > FA_DCHUNK ? fa_load_f(part[g][r]) + a[g][r]
                                                     : a[g][r]) * sc);
        for (int g = 0; g < ng; g++) {
            const int kg = nk - 8 * (g0 + g) < 8 ? nk - 8 * (g0 + g) : 8;
            for (int r = 0; r < nr && r < nstore; r++)
                for (int t = 0; t < kg; t++) s[(8 * (g0 + g) + t) * lds + r] = out[g][r][t];
        }
    }
}
/* ldk != 0: kr[t] = kr[0] + t * ldk for all 32 rows (a full call of evenly spaced keys),
 * the common case; the body is instantiated for it and for arbitrary row pointers. */
FA_INLINE void fa_score_keys32_f(const float* const* kr, ptrdiff_t ldk, int nk,
                                 const float* qt, ptrdiff_t ldqt, ptrdiff_t D, float scale,
                                 float* s, ptrdiff_t lds, const int nr, int nstore,
                                 const char* const* pf, ptrdiff_t pf_bytes)
{
    if (ldk)
        fa_score_keys32_body_f(kr, ldk, nk, qt, ldqt, D, scale, s, lds, nr, nstore, pf, pf_bytes);
    else
        fa_score_keys32_body_f(kr, 0, nk, qt, ldqt, D, scale, s, lds, nr, nstore, pf, pf_bytes);
}
#if !defined(__AVX__)
/* SSE2, 4 (or 8) rows: 4 rows x 8-lane accumulators and the 8x4 transposes do not fit 16
 * xmm registers (they spill), so these passes take the 32 keys
 * as 4 groups of 8 with whole 8x8 blocks (fa_score_keyrows, fa_tile_impl.h); the output
 * kernel prefetches the next K rows for such tiles (FA_DEC_SCORES_PREFETCH_K_ROWS_F). */
static inline void fa_score_keyrows_f(const float* const* kr, ptrdiff_t ldk, int nk,
                                      const float* qt, ptrdiff_t ldqt, ptrdiff_t D,
                                      float scale, float* s, ptrdiff_t lds, const int nr,
                                      int nstore, const char* const* pf, ptrdiff_t pf_bytes);
FA_INLINE void fa_score_keys32_by8_f(const float* const* kr, ptrdiff_t ldk, int nk,
                                     const float* qt, ptrdiff_t ldqt, ptrdiff_t D,
                                     float scale, float* s, ptrdiff_t lds, const int nr,
                                     int nstore, const char* const* pf, ptrdiff_t pf_bytes)
{
    (void)ldk;
    for (int g = 0; 8 * g < nk; g++)
        fa_score_keyrows_f(kr + 8 * g, 0, nk - 8 * g < 8 ? nk - 8 * g : 8, qt, ldqt, D, scale,
                           s + 8 * g * lds, lds, nr, nstore, pf ? pf + 8 * g : NULL, pf_bytes);
}
#define KEYROWS_IMPL_WIDE fa_score_keys32_by8_f
#endif
#if defined(__AVX__)
/* AVX2, 4 rows (a GQA group of 4 query heads), 32 evenly spaced keys: two sweeps of 16
 * keys, so that 4 rows x 2 groups = 8 accumulator chains are in flight -- as many as
 * the FMA latency x throughput of a Zen 3 or Skylake core needs -- while the 8
 * accumulators, the 4 half-transposed vectors of one group and a broadcast still fit 16
 * ymm registers.  The 8 rows of a group are addressed from two base pointers and the
 * stride (b, b + 3 ldk), so no row pointer lives in memory.  It is bound by loads more
 * than by FMAs (16 broadcasts of q and 8 half-row loads per 16 FMAs), like the 4-chain
 * body it replaces, and slightly faster.
 * Per score: the same chain acc += k[d] * q[d], d = 0, 1, ... then * scale. */
FA_INLINE void fa_keys8x4s_r4_f(const float* b, const float* b3, ptrdiff_t ldk,
                                const float* qt, ptrdiff_t ldqt, fa_vf* a)
{
    /* y_i = [k_i | k_(i+4)] over 4 dims: rows b, b+ldk, b+2ldk, b3 | b+4ldk, b3+2ldk, ... */
#define FA_Y(lo, hi) (fa_vf)_mm256_blend_ps(_mm256_broadcast_ps((const __m128*)(lo)), \
                                            _mm256_broadcast_ps((const __m128*)(hi)), 0xF0)
    const fa_vf y0 = FA_Y(b, b + 4 * ldk), y1 = FA_Y(b + ldk, b3 + 2 * ldk);
    const fa_vf u0 = __builtin_shufflevector(y0, y1, 0, 8, 1, 9, 4, 12, 5, 13);
    const fa_vf u1 = __builtin_shufflevector(y0, y1, 2, 10, 3, 11, 6, 14, 7, 15);
    const fa_vf y2 = FA_Y(b + 2 * ldk, b3 + 3 * ldk), y3 = FA_Y(b3, b3 + 4 * ldk);
#undef FA_Y
    const fa_vf u2 = __builtin_shufflevector(y2, y3, 0, 8, 1, 9, 4, 12, 5, 13);
    const fa_vf u3 = __builtin_shufflevector(y2, y3, 2, 10, 3, 11, 6, 14, 7, 15);
    fa_vf t;
#define FA_FMA4(i) \
    a[0] += fa_bcast_f(qt[(i) * ldqt + 0]) * t; a[1] += fa_bcast_f(qt[(i) * ldqt + 1]) * t; \
    a[2] += fa_bcast_f(qt[(i) * ldqt + 2]) * t; a[3] += fa_bcast_f(qt[(i) * ldqt + 3]) * t;
    t = __builtin_shufflevector(u0, u2, 0, 1, 8, 9, 4, 5, 12, 13); FA_FMA4(0)
    t = __builtin_shufflevector(u0, u2, 2, 3, 10, 11, 6, 7, 14, 15); FA_FMA4(1)
    t = __builtin_shufflevector(u1, u3, 0, 1, 8, 9, 4, 5, 12, 13); FA_FMA4(2)
    t = __builtin_shufflevector(u1, u3, 2, 3, 10, 11, 6, 7, 14, 15); FA_FMA4(3)
#undef FA_FMA4
}

FA_INLINE void fa_score_keys32_wide_f(const float* const* kr, ptrdiff_t ldk, int nk,
                                      const float* qt, ptrdiff_t ldqt, ptrdiff_t D,
                                      float scale, float* s, ptrdiff_t lds, const int nr,
                                      int nstore, const char* const* pf, ptrdiff_t pf_bytes)
{
    if (nr != 4 || !ldk || nk != 32 || D % 4) {
        fa_score_keys32_f(kr, ldk, nk, qt, ldqt, D, scale, s, lds, nr, nstore, pf, pf_bytes);
        return;
    }
    fa_dec_pf pfs;   /* prefetch streams, see fa_dec_pf */
    fa_dec_pf_init(&pfs, pf, pf_bytes, kr[0], ldk, D, 2 * (D / 4));
    const fa_vf sc = fa_bcast_f(scale);
    for (int h = 0; h < 2; h++) {
        const float* b = kr[0] + 16 * h * ldk;        /* group 0: keys 16h .. 16h+7 */
        const float* c = b + 8 * ldk;                 /* group 1: the next 8 */
        fa_vf a0[4], a1[4];
        float part[4][16];   /* the sums of the chunks before the current one */
        for (int r = 0; r < 4; r++) a0[r] = a1[r] = fa_bcast_f(0);
        for (ptrdiff_t d0 = 0; d0 < D; d0 += 4) {
            if (d0 && d0 % FA_DCHUNK == 0)
                for (int r = 0; r < 4; r++) {
                    const int first = d0 == FA_DCHUNK;
                    fa_store_f(part[r], first ? a0[r] : fa_load_f(part[r]) + a0[r]);
                    fa_store_f(part[r] + 8, first ? a1[r] : fa_load_f(part[r] + 8) + a1[r]);
                    a0[r] = a1[r] = fa_bcast_f(0);
                }
            fa_dec_pf_step(&pfs);
            const float* q = qt + d0 * ldqt;
            fa_keys8x4s_r4_f(b + d0, b + 3 * ldk + d0, ldk, q, ldqt, a0);
            /* an opaque copy of q: the second group broadcasts q again instead of the
             * compiler keeping 16 broadcasts alive across both groups (they spilled) */
            __asm__("" : "+r"(q));
            fa_keys8x4s_r4_f(c + d0, c + 3 * ldk + d0, ldk, q, ldqt, a1);
        }
        /* all 4 rows out by constant indices (a runtime bound on r would keep the
         * accumulator arrays in memory, a store and reload on every FMA chain step) */
        float o[4][16];
        for (int r = 0; r < 4; r++) {
            if (D > FA_DCHUNK) {
                a0[r] += fa_load_f(part[r]);
                a1[r] += fa_load_f(part[r] + 8);
            }
            fa_store_f(o[r], a0[r] * sc);
            fa_store_f(o[r] + 8, a1[r] * sc);
        }
        for (int r = 0; r < nstore && r < 4; r++)
            for (int t = 0; t < 16; t++) s[(16 * h + t) * lds + r] = o[r][t];
    }
}
#define KEYROWS_IMPL_WIDE fa_score_keys32_wide_f
#endif
#define KEYROWS_IMPL fa_score_keys32_f
#else
#define FA_DEC_KEYS_F FA_VL_F
#define FA_DEC_SCORES_PREFETCH_K_ROWS_F 0
#endif

/* ---- micro-kernels, float compute, float storage ----
 * K and V are read through the storage-type macros (KV, LOAD_KV, KV_SCALAR,
 * LOAD_TRANSPOSE_KV); here the storage type is the compute type.  Another storage type
 * (say float16 K/V for float compute) is one more inclusion with FA_KV_KERNELS_ONLY
 * defined, another FA_FN suffix and its widening loads. */
#define T float
#define V fa_vf
#define VL FA_VL_F
#define FA_FN(name) name##_f
#define LOAD fa_load_f
#define STORE fa_store_f
#define BCAST fa_bcast_f
#define MAX fa_max_f
#define SELECT fa_select_f
#define EXP2 fa_exp2_f
#define LOAD_TRANSPOSE fa_load_transpose_vf
#define KV T
#define LOAD_KV LOAD
#define KV_SCALAR(x) (x)
#define LOAD_TRANSPOSE_KV LOAD_TRANSPOSE
#include "fa_tile_impl.h"
#undef KV
#undef LOAD_KV
#undef KV_SCALAR
#undef LOAD_TRANSPOSE_KV
#undef T
#undef V
#undef VL
#undef FA_FN
#undef LOAD
#undef STORE
#undef BCAST
#undef MAX
#undef SELECT
#undef EXP2
#undef LOAD_TRANSPOSE

/* ---- micro-kernels, double compute, double storage ---- */
#define T double
#define V fa_vd
#define VL FA_VL_D
#define FA_FN(name) name##_d
#define LOAD fa_load_d
#define STORE fa_store_d
#define BCAST fa_bcast_d
#define MAX fa_max_d
#define SELECT fa_select_d
#define EXP2 fa_exp2_d
#define LOAD_TRANSPOSE fa_load_transpose_vd
#define KV T
#define LOAD_KV LOAD
#define KV_SCALAR(x) (x)
#define LOAD_TRANSPOSE_KV LOAD_TRANSPOSE
#include "fa_tile_impl.h"
#undef KV
#undef LOAD_KV
#undef KV_SCALAR
#undef LOAD_TRANSPOSE_KV
#undef T
#undef V
#undef VL
#undef FA_FN
#undef LOAD
#undef STORE
#undef BCAST
#undef MAX
#undef SELECT
#undef EXP2
#undef LOAD_TRANSPOSE

/* ---- score modifiers (the finish-scores stage; scores are in base 2) ----
 * Each works on nk keys of nvec whole vectors of rows, per lane only, so a row gets the
 * same bits in a decode tile as in a prefill tile. */

/* tanh for float vectors: for |x| < 0.4 the odd Taylor series to x^13 (truncation below
 * 4e-9 relative), else (1 - e) / (1 + e) with e = 2^(-2|x| log2 e) <= 0.45, which has no
 * cancellation.  Accuracy is measured by tests/test_exp.py. */
FA_INLINE fa_vf fa_tanh_f(fa_vf x)
{
    const fa_vf ax = fa_select_f(x < 0, -x, x);
    const fa_vf z = ax * ax;
    fa_vf p = fa_bcast_f(21844.0f / 6081075.0f);
    p = p * z + fa_bcast_f(-1382.0f / 155925.0f);
    p = p * z + fa_bcast_f(62.0f / 2835.0f);
    p = p * z + fa_bcast_f(-17.0f / 315.0f);
    p = p * z + fa_bcast_f(2.0f / 15.0f);
    p = p * z + fa_bcast_f(-1.0f / 3.0f);
    const fa_vf small = ax + ax * (z * p);
    const fa_vfi is_small = ax < fa_bcast_f(0.4f);
    fa_vf r = small;
    /* Capped scores are mostly well inside the cap (|s / softcap| < 0.4): the exp and the
     * division run only for vectors with a lane outside.  Each lane's result is the same
     * either way. */
    int all_small = 1;
    for (int i = 0; i < (int)FA_VL_F; i++) all_small &= is_small[i] != 0;
    if (!all_small) {
        const fa_vf e = fa_exp2_f(ax * fa_bcast_f(-2.0f * 1.44269504088896341f));
        const fa_vf one = fa_bcast_f(1.0f);
        r = fa_select_f(is_small, small, (one - e) / (one + e));
    }
    return fa_select_f(x < 0, -r, r);
}

/* Softcapping, s <- c tanh(s / c), with c = softcap * log2 e for base-2 scores; s / c is a
 * product with 1 / c, computed once per call, as a vector division costs several times a
 * multiply. */
static void fa_softcap_f(float* s, ptrdiff_t lds, ptrdiff_t nk, int nvec, float c)
{
    const fa_vf vc = fa_bcast_f(c), inv = fa_bcast_f(1.0f / c);
    for (ptrdiff_t j = 0; j < nk; j++)
        for (int t = 0; t < nvec; t++) {
            float* p = s + j * lds + t * FA_VL_F;
            fa_store_f(p, vc * fa_tanh_f(fa_load_f(p) * inv));
        }
}
/* float64 scores take libm's tanh, lane by lane. */
static void fa_softcap_d(double* s, ptrdiff_t lds, ptrdiff_t nk, int nvec, double c)
{
    for (ptrdiff_t j = 0; j < nk; j++)
        for (ptrdiff_t r = 0; r < nvec * FA_VL_D; r++) s[j * lds + r] = c * tanh(s[j * lds + r] / c);
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

/* CPU probe for import-time dispatch (answers for the machine running, not the build host). */
static inline int fa_cpu_supports(const char* isa)
{
#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
    __builtin_cpu_init();
    if (strcmp(isa, "avx2") == 0)
        return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    if (strcmp(isa, "avx512") == 0)
        return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx2")
               && __builtin_cpu_supports("fma");
    if (strcmp(isa, "sse2") == 0) return 1;
    return 0;
#else
    (void)isa;
    return 0;
#endif
}

#endif /* FA_KERNELS_H */
