/*
 * fa_kernels.h -- C building blocks shared by every instruction-set variant of fastattn's
 * Cython kernel (src/_kernel_impl.pxi):
 *
 *   - fa_key_interval: THE visibility rule (causal in both alignments, sliding window,
 *     kv_lengths).  Every kernel and attention_weights ask it; nothing else restates it.
 *   - the micro-kernels (fa_tile_impl.h) for float and double;
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

/* ---- micro-kernels, float ---- */
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
#include "fa_tile_impl.h"
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

/* ---- micro-kernels, double ---- */
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
#include "fa_tile_impl.h"
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

/* Whole-array 2^x, for measuring the vector exp2's accuracy from the tests. */
static inline void fa_exp2_array_f(const float* x, float* y, ptrdiff_t n)
{
    float buf[64];
    for (ptrdiff_t i = 0; i < n; i += FA_VL_F) {
        ptrdiff_t m = n - i < FA_VL_F ? n - i : FA_VL_F;
        for (ptrdiff_t t = 0; t < FA_VL_F; t++) buf[t] = t < m ? x[i + t] : 0.0f;
        fa_store_f(buf, fa_exp2_f(fa_load_f(buf)));
        for (ptrdiff_t t = 0; t < m; t++) y[i + t] = buf[t];
    }
}
static inline void fa_exp2_array_d(const double* x, double* y, ptrdiff_t n)
{
    double buf[32];
    for (ptrdiff_t i = 0; i < n; i += FA_VL_D) {
        ptrdiff_t m = n - i < FA_VL_D ? n - i : FA_VL_D;
        for (ptrdiff_t t = 0; t < FA_VL_D; t++) buf[t] = t < m ? x[i + t] : 0.0;
        fa_store_d(buf, fa_exp2_d(fa_load_d(buf)));
        for (ptrdiff_t t = 0; t < m; t++) y[i + t] = buf[t];
    }
}

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
