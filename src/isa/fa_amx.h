/*
 * fa_amx.h -- bfloat16 products on AMX tiles, and a scalar model of the tile instructions.
 *
 * The kernels (fa_amx_kernels.h) are written once over the tile operations and compiled
 * twice: on the hardware (`_hw`: tileloadd, tilestored, tilezero, tdpbf16ps) and on the
 * model below (`_model`), which runs wherever the bfloat16 pairs do (fa_bf16dot.h: their
 * packers serve both).  The model follows the pseudocode
 * of TDPBF16PS in Intel's Software Developer's Manual:
 *
 *   for each row m of C, and each column n:
 *       even = odd = 0
 *       for each pair k of A's row (k = 0 .. A.colsb/4 - 1), in order:
 *           even = fma(A[m][2k],   B[k][2n],   even)
 *           odd  = fma(A[m][2k+1], B[k][2n+1], odd)
 *       C[m][n] = C[m][n] + (even + odd)
 *
 * every operation rounding to nearest even, with bfloat16 and float32 inputs below
 * FLT_MIN read as zero (DAZ) and results below it written as zero (FTZ), MXCSR ignored.
 * A product of two bfloat16 values is exact in float32, so only the order of the sums and
 * the flushing can differ from other float32 arithmetic.  The tests compare the model
 * with that pseudocode written out in NumPy on every machine, and with the hardware,
 * bit for bit, where the CPU has AMX.
 *
 * The canonical chains of the tile kernels (the same in every tile of every call, so
 * that a row's result depends neither on its tile, nor on the thread count, batch or Lq):
 *   score:  C = 0, then one step per chunk of 32 dimensions, in order; times scale
 *   output: per key block, C = 0, then one step per chunk of 32 keys, the chunks at
 *           multiples of 32 from key 0 (keys outside the block, or beyond the row's
 *           keys, add p = 0 exactly); P rounded to bfloat16 (to nearest even) first;
 *           then acc = fma(acc, alpha, C).
 *   backward: dV and dK of a key per tile of rows, C = 0, then one step per 32 rows from
 *           the tile's first, the tiles' sums added in order; dQ of a row per key block,
 *           one step per 32 keys from the block's first, the blocks' sums added in
 *           order; P and dS rounded to bfloat16 first.
 *
 * On Linux a process may use the tile registers only after asking the kernel for them
 * (arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)); fa_amx_status() asks once and
 * says why not where the CPU, the OS or that request says no.
 */
#ifndef FA_AMX_H
#define FA_AMX_H

#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fa_bf16dot.h"

/* The hardware kernels need an assembler that knows the tile instructions, Linux's
 * permission call and the bfloat16 packers of fa_bf16dot.h. */
#if FA_HAVE_BF16DOT && defined(__linux__) && defined(__x86_64__) \
    && (defined(__clang__) ? __clang_major__ >= 12 : __GNUC__ >= 11)
#define FA_HAVE_AMX 1
#include <errno.h>
#include <sys/syscall.h>
#include <unistd.h>
#else
#define FA_HAVE_AMX 0
#endif

/* The tile geometry every kernel configures: 16 rows of 64 bytes (32 bfloat16 values,
 * or 16 float32), palette 1, all eight tiles. */
#define FA_AMX_ROWS 16
#define FA_AMX_COLSB 64

/* ------------------------------------------------------------------ the tile model */

typedef struct {
    uint8_t b[FA_AMX_ROWS][FA_AMX_COLSB];
} fa_amx_tile;

static inline float fa_amx_f32_of_bits(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static inline uint32_t fa_amx_bits_of_f32(float f)
{ uint32_t u; memcpy(&u, &f, 4); return u; }

/* A float32 below FLT_MIN in magnitude as zero of its sign (DAZ on input, FTZ on
 * output). */
static inline float fa_amx_flush(float x)
{
    uint32_t u = fa_amx_bits_of_f32(x);
    return (u & 0x7f800000u) == 0 ? fa_amx_f32_of_bits(u & 0x80000000u) : x;
}

/* A bfloat16 element as float32: its bits in the upper half, subnormals read as zero. */
static inline float fa_amx_bf16(const uint8_t* p)
{
    uint16_t h;
    memcpy(&h, p, 2);
    return fa_amx_flush(fa_amx_f32_of_bits((uint32_t) h << 16));
}

static inline float fa_amx_f32(const fa_amx_tile* t, int m, int n)
{ float f; memcpy(&f, &t->b[m][4 * n], 4); return f; }

static inline void fa_amx_model_load(fa_amx_tile* t, const void* base, ptrdiff_t stride)
{
    for (int m = 0; m < FA_AMX_ROWS; m++)
        memcpy(t->b[m], (const char*) base + m * stride, FA_AMX_COLSB);
}

static inline void fa_amx_model_store(const fa_amx_tile* t, void* base, ptrdiff_t stride)
{
    for (int m = 0; m < FA_AMX_ROWS; m++)
        memcpy((char*) base + m * stride, t->b[m], FA_AMX_COLSB);
}

static inline void fa_amx_model_zero(fa_amx_tile* t) { memset(t, 0, sizeof *t); }

/*
 * TDPBF16PS on the model: c += a . b, a 16 x 32 bfloat16, b 16 pairs x 16 columns.
 * sequential != 0 gives the other reading (the Intrinsics Guide's), in which each pair's
 * two products go straight into C one after the other; the tests report which of the
 * two the hardware follows.  The kernels use the manual's (sequential = 0).
 */
static inline void fa_amx_model_dp(fa_amx_tile* c, const fa_amx_tile* a,
                                   const fa_amx_tile* b, int sequential)
{
    for (int m = 0; m < FA_AMX_ROWS; m++)
        for (int n = 0; n < FA_AMX_COLSB / 4; n++) {
            float acc = fa_amx_flush(fa_amx_f32(c, m, n));
            float even = 0, odd = 0;
            for (int k = 0; k < FA_AMX_COLSB / 4; k++) {
                const float a0 = fa_amx_bf16(&a->b[m][4 * k]);
                const float a1 = fa_amx_bf16(&a->b[m][4 * k + 2]);
                const float b0 = fa_amx_bf16(&b->b[k][4 * n]);
                const float b1 = fa_amx_bf16(&b->b[k][4 * n + 2]);
                if (sequential) {
                    acc = fa_amx_flush(fmaf(a0, b0, acc));
                    acc = fa_amx_flush(fmaf(a1, b1, acc));
                } else {
                    even = fa_amx_flush(fmaf(a0, b0, even));
                    odd = fa_amx_flush(fmaf(a1, b1, odd));
                }
            }
            if (!sequential)
                acc = fa_amx_flush(acc + fa_amx_flush(even + odd));
            memcpy(&c->b[m][4 * n], &acc, 4);
        }
}

/*
 * The tile registers are configured once per work item (fa_amx_begin .. fa_amx_end, on
 * the thread that runs it), not per kernel call, which keeps ldtilecfg out of the
 * kernels' loops over blocks.  The model checks that protocol, so that the tests on any
 * machine catch a kernel called outside it, which on the hardware would fault.
 */
static __thread int fa_amx_model_open;

static inline void fa_amx_model_check(void)
{
    if (!fa_amx_model_open) {
        fputs("fastattn: an AMX tile kernel ran outside fa_amx_begin/fa_amx_end\n", stderr);
        abort();
    }
}

/* One model instruction for the tests: c (16 x 16 float32) += a (16 x 32 bfloat16) .
 * b (16 x 32 bfloat16, pairs of rows interleaved), all row-major and contiguous. */
static inline void fa_amx_model_dp_test(float* c, const uint16_t* a, const uint16_t* b,
                                        int sequential)
{
    fa_amx_tile tc, ta, tb;
    fa_amx_model_load(&tc, c, FA_AMX_COLSB);
    fa_amx_model_load(&ta, a, FA_AMX_COLSB);
    fa_amx_model_load(&tb, b, FA_AMX_COLSB);
    fa_amx_model_dp(&tc, &ta, &tb, sequential);
    fa_amx_model_store(&tc, c, FA_AMX_COLSB);
}

/* ------------------------------------------------------------ the CPU and the OS */

/* The kernels' backends: the hardware's tiles, or the model's */
#define FA_AMX_HW 1
#define FA_AMX_MODEL 2

/* fa_amx_status()'s answers other than an errno */
#define FA_AMX_OK 0
#define FA_AMX_NO_CPU (-1)
#define FA_AMX_NO_OS (-2)
#define FA_AMX_NOT_BUILT (-3)

#if FA_HAVE_AMX
#define FA_AMX_TARGET FA_BDP_TARGET

#ifndef ARCH_REQ_XCOMP_PERM
#define ARCH_REQ_XCOMP_PERM 0x1023
#endif
#define FA_XFEATURE_XTILEDATA 18

/* Whether this process may run AMX-BF16 tiles: CPUID leaf 7 (EDX bit 22 AMX-BF16, bit 24
 * AMX-TILE), the OS's tile state in XCR0 (bits 17, 18), and the kernel's permission,
 * requested once (the answer is kept: the request is idempotent but a system call).
 * Returns FA_AMX_OK, or why not: FA_AMX_NO_CPU, FA_AMX_NO_OS, or the permission request's
 * errno (positive; ENOSPC, for one, when a thread's signal stack is too small for the
 * tile state). */
static int fa_amx_status(void)
{
    static int answer, known;
    if (known) return answer;
    known = 1;
    unsigned int eax, ebx, ecx, edx;
    answer = FA_AMX_NO_CPU;
    __asm__ volatile("cpuid" : "=a"(eax), "=b"(ebx), "=c"(ecx), "=d"(edx) : "a"(0), "c"(0));
    if (eax < 7) return answer;
    __asm__ volatile("cpuid" : "=a"(eax), "=b"(ebx), "=c"(ecx), "=d"(edx) : "a"(7), "c"(0));
    if (!((edx >> 22) & 1) || !((edx >> 24) & 1)) return answer;
    answer = FA_AMX_NO_OS;
    __asm__ volatile("cpuid" : "=a"(eax), "=b"(ebx), "=c"(ecx), "=d"(edx) : "a"(1), "c"(0));
    if (!((ecx >> 27) & 1)) return answer;                   /* OSXSAVE: xgetbv runs */
    unsigned int xlo, xhi;
    __asm__ volatile("xgetbv" : "=a"(xlo), "=d"(xhi) : "c"(0));
    if ((xlo & (3u << 17)) != (3u << 17)) return answer;
    answer = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, FA_XFEATURE_XTILEDATA) == 0
             ? FA_AMX_OK : errno;
    return answer;
}

/* The one tile configuration: palette 1, eight tiles of 16 rows x 64 bytes. */
typedef struct {
    uint8_t palette_id, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} fa_amx_config;

/*
 * The tile instructions, written out rather than through <immintrin.h>'s macros: those
 * tell the compiler neither that tileloadd reads memory nor that ldtilecfg reads all 64
 * bytes of its operand, so stores just before them (a staged key row, the
 * configuration) could be moved past them or dropped.  AT&T operand order.
 */
#define FA_AMX_ASM_LOAD(t, p, stride)                                                     \
    __asm__ volatile("tileloadd (%0,%1,1), %%tmm" #t                                     \
                     :: "r"((const void*) (p)), "r"((long) (stride)) : "memory")
#define FA_AMX_ASM_STORE(t, p, stride)                                                    \
    __asm__ volatile("tilestored %%tmm" #t ", (%0,%1,1)"                                 \
                     :: "r"((void*) (p)), "r"((long) (stride)) : "memory")
#define FA_AMX_ASM_ZERO(t) __asm__ volatile("tilezero %%tmm" #t ::)
#define FA_AMX_ASM_DP(c, a, b)                                                            \
    __asm__ volatile("tdpbf16ps %%tmm" #b ", %%tmm" #a ", %%tmm" #c ::)
#define FA_AMX_ASM_RELEASE() __asm__ volatile("tilerelease" ::)

FA_AMX_TARGET static inline void fa_amx_hw_configure(void)
{
    fa_amx_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette_id = 1;
    for (int i = 0; i < 8; i++) {
        cfg.colsb[i] = FA_AMX_COLSB;
        cfg.rows[i] = FA_AMX_ROWS;
    }
    __asm__ volatile("ldtilecfg %0" :: "m"(cfg));
}

FA_AMX_TARGET static inline void fa_amx_hw_release(void) { FA_AMX_ASM_RELEASE(); }

/* One hardware instruction for the tests, as fa_amx_model_dp_test. */
FA_AMX_TARGET static void fa_amx_hw_dp_test(float* c, const uint16_t* a, const uint16_t* b)
{
    fa_amx_hw_configure();
    FA_AMX_ASM_LOAD(0, c, FA_AMX_COLSB);
    FA_AMX_ASM_LOAD(1, a, FA_AMX_COLSB);
    FA_AMX_ASM_LOAD(2, b, FA_AMX_COLSB);
    FA_AMX_ASM_DP(0, 1, 2);
    FA_AMX_ASM_STORE(0, c, FA_AMX_COLSB);
    FA_AMX_ASM_RELEASE();
}

/* A plain tile loop, for the peak the benchmarks compare with: n steps of four
 * independent tdpbf16ps (2048 multiply-adds each) on tiles already loaded.  Returns the
 * multiply-adds done. */
FA_AMX_TARGET static double fa_amx_hw_peak_loop(long n)
{
    static uint16_t zeros[FA_AMX_ROWS * 32];
    float out[FA_AMX_ROWS * 16];
    fa_amx_hw_configure();
    FA_AMX_ASM_ZERO(0);
    FA_AMX_ASM_ZERO(1);
    FA_AMX_ASM_ZERO(2);
    FA_AMX_ASM_ZERO(3);
    FA_AMX_ASM_LOAD(4, zeros, FA_AMX_COLSB);
    FA_AMX_ASM_LOAD(5, zeros, FA_AMX_COLSB);
    FA_AMX_ASM_LOAD(6, zeros, FA_AMX_COLSB);
    FA_AMX_ASM_LOAD(7, zeros, FA_AMX_COLSB);
    for (long i = 0; i < n; i++) {
        FA_AMX_ASM_DP(0, 4, 6);
        FA_AMX_ASM_DP(1, 4, 7);
        FA_AMX_ASM_DP(2, 5, 6);
        FA_AMX_ASM_DP(3, 5, 7);
    }
    FA_AMX_ASM_STORE(0, out, FA_AMX_COLSB);
    FA_AMX_ASM_RELEASE();
    return (double) n * 4 * 16 * 16 * 32 + out[0];
}

#else
static inline int fa_amx_status(void) { return FA_AMX_NOT_BUILT; }
static inline void fa_amx_hw_dp_test(float* c, const uint16_t* a, const uint16_t* b)
{ (void)c; (void)a; (void)b; }
static inline double fa_amx_hw_peak_loop(long n) { (void)n; return 0; }
#endif

/* ------------------------------------------------------------------ the kernels */

#if FA_HAVE_BF16DOT

/*
 * P rows in bfloat16 for the output tiles: pr[r*ldpr + j] = bf16(s[j*lds + r]) for the
 * block's keys j < nj (a block of at most 64), zero for nj <= j < round_up(nj, 32), rows
 * r < nlanes (a multiple of 16).  Rounds as fa_pack_p_pairs does (vcvtneps2bf16).
 */
FA_BDP_NOINLINE void fa_pack_p_rows(const float* s, ptrdiff_t lds, ptrdiff_t nj,
                                    ptrdiff_t nlanes, uint16_t* pr, ptrdiff_t ldpr)
{
    static const float zeros[16];
    const ptrdiff_t nk = (nj + 31) / 32 * 32;
    for (ptrdiff_t r0 = 0; r0 < nlanes; r0 += 16)
        for (ptrdiff_t j0 = 0; j0 < nk; j0 += 16) {
            const float* rows[16];
            for (int u = 0; u < 16; u++)
                rows[u] = j0 + u < nj ? s + (j0 + u) * lds + r0 : zeros;
            fa_vf t[16];
            fa_load_transpose_vf(rows, 0, t);
            for (int u = 0; u < 16; u++)
                _mm256_storeu_si256((__m256i*) (pr + (r0 + u) * ldpr + j0),
                                    (__m256i) _mm512_cvtneps_pbh((__m512) t[u]));
        }
}

/*
 * Rows of float32 in bfloat16 (to nearest even), zero-padded: dst[i*ldd + c] =
 * bf16(s[i*lds + c]) for rows i < nrows and columns c < ncols; zero for ncols <= c <
 * ncols_pad (a multiple of 16) and for whole rows nrows <= i < nrows_pad.  The backward's
 * P^T and dS^T (keys x rows) as the A operand of its dV and dK tiles.
 */
FA_BDP_NOINLINE void fa_pack_bf16_cols(const float* s, ptrdiff_t lds, ptrdiff_t nrows,
                                       ptrdiff_t nrows_pad, ptrdiff_t ncols,
                                       ptrdiff_t ncols_pad, uint16_t* dst, ptrdiff_t ldd)
{
    for (ptrdiff_t i = 0; i < nrows_pad; i++)
        for (ptrdiff_t c = 0; c < ncols_pad; c += 16) {
            const ptrdiff_t n = i >= nrows || c >= ncols ? 0
                                : ncols - c < 16 ? ncols - c : 16;
            const __mmask16 keep = (__mmask16) ((1u << n) - 1);
            const __m512 x = _mm512_maskz_loadu_ps(keep, s + i * lds + c);
            _mm256_storeu_si256((__m256i*) (dst + i * ldd + c),
                                (__m256i) _mm512_cvtneps_pbh(x));
        }
}

/* acc[r*ldacc + c] = fma(acc, alpha[r], C[r][c]) for r < nr, c < 32, the block sum C of
 * 32 columns in two stored 16 x 16 tiles (lo: columns 0-15, hi: 16-31).  Both backends. */
FA_BDP_INLINE void fa_amx_acc_update(float* acc, ptrdiff_t ldacc, const float* alpha,
                                     const float* lo, const float* hi, ptrdiff_t nr)
{
    for (ptrdiff_t r = 0; r < nr; r++) {
        const __m512 a = _mm512_set1_ps(alpha[r]);
        float* o = acc + r * ldacc;
        _mm512_storeu_ps(o, _mm512_fmadd_ps(_mm512_loadu_ps(o), a,
                                            _mm512_loadu_ps(lo + 16 * r)));
        _mm512_storeu_ps(o + 16, _mm512_fmadd_ps(_mm512_loadu_ps(o + 16), a,
                                                 _mm512_loadu_ps(hi + 16 * r)));
    }
}

/* Whether 16 key rows are evenly spaced (then a tile loads them in place). */
static inline int fa_amx_even_rows(const uint16_t* const* kr, ptrdiff_t* stride)
{
    const ptrdiff_t st = (const char*) kr[1] - (const char*) kr[0];
    for (int u = 2; u < 16; u++)
        if ((const char*) kr[u] - (const char*) kr[u - 1] != st) return 0;
    *stride = st;
    return 1;
}

/* The model's kernels */
#define FA_AMX_NAME(f) f##_model
#define FA_AMX_FN FA_BDP_NOINLINE
#define FA_AMX_STEP FA_BDP_NOINLINE
#define FA_TILE_STATE fa_amx_tile tmm_[8]
#define FA_TILE_CONFIG() fa_amx_model_check()
#define FA_TILE_LOAD(t, p, stride) fa_amx_model_load(&tmm_[t], (p), (stride))
#define FA_TILE_STORE(t, p, stride) fa_amx_model_store(&tmm_[t], (p), (stride))
#define FA_TILE_ZERO(t) fa_amx_model_zero(&tmm_[t])
#define FA_TILE_DP(c, a, b) fa_amx_model_dp(&tmm_[c], &tmm_[a], &tmm_[b], 0)
#include "fa_amx_kernels.h"

#if FA_HAVE_AMX
/* The hardware's: the same text on the tile registers */
#define FA_AMX_NAME(f) f##_hw
#define FA_AMX_FN static __attribute__((noinline, unused)) FA_AMX_TARGET
#define FA_AMX_STEP static inline __attribute__((always_inline)) FA_AMX_TARGET
#define FA_TILE_STATE int tmm_unused_ __attribute__((unused))
#define FA_TILE_CONFIG() ((void) 0)
#define FA_TILE_LOAD(t, p, stride) FA_AMX_ASM_LOAD(t, p, stride)
#define FA_TILE_STORE(t, p, stride) FA_AMX_ASM_STORE(t, p, stride)
#define FA_TILE_ZERO(t) FA_AMX_ASM_ZERO(t)
#define FA_TILE_DP(c, a, b) FA_AMX_ASM_DP(c, a, b)
#include "fa_amx_kernels.h"
#endif

/* The kernels by backend, and the configuration around a work item's calls (backend 0:
 * none) */
static inline void fa_amx_begin(int backend)
{
#if FA_HAVE_AMX
    if (backend == FA_AMX_HW) fa_amx_hw_configure();
#endif
    if (backend == FA_AMX_MODEL) fa_amx_model_open = 1;
}

static inline void fa_amx_end(int backend)
{
#if FA_HAVE_AMX
    if (backend == FA_AMX_HW) fa_amx_hw_release();
#endif
    if (backend == FA_AMX_MODEL) fa_amx_model_open = 0;
}


static inline void fa_amx_scores(int backend, const uint16_t* const* kr, ptrdiff_t nj,
                                 const uint32_t* qt, ptrdiff_t ldqt, ptrdiff_t nlanes,
                                 ptrdiff_t D, float scale, float* s, ptrdiff_t lds,
                                 uint16_t* kst, const uint16_t* zrow)
{
#if FA_HAVE_AMX
    if (backend == FA_AMX_HW) {
        fa_amx_scores_hw(kr, nj, qt, ldqt, nlanes, D, scale, s, lds, kst, zrow);
        return;
    }
#endif
    (void) backend;
    fa_amx_scores_model(kr, nj, qt, ldqt, nlanes, D, scale, s, lds, kst, zrow);
}

static inline void fa_amx_gemm(int backend, const uint16_t* a, ptrdiff_t lda, ptrdiff_t M,
                               ptrdiff_t nchunks, const uint32_t* b, ptrdiff_t ldb,
                               ptrdiff_t N, float* c, ptrdiff_t ldc)
{
#if FA_HAVE_AMX
    if (backend == FA_AMX_HW) {
        fa_amx_gemm_hw(a, lda, M, nchunks, b, ldb, N, c, ldc);
        return;
    }
#endif
    (void) backend;
    fa_amx_gemm_model(a, lda, M, nchunks, b, ldb, N, c, ldc);
}

static inline void fa_amx_pv(int backend, const uint16_t* pr, ptrdiff_t ldpr,
                             ptrdiff_t nchunks, ptrdiff_t nlanes, ptrdiff_t nrows,
                             const uint32_t* vp, ptrdiff_t Dv, float* acc, ptrdiff_t ldacc,
                             const float* alpha)
{
#if FA_HAVE_AMX
    if (backend == FA_AMX_HW) {
        fa_amx_pv_hw(pr, ldpr, nchunks, nlanes, nrows, vp, Dv, acc, ldacc, alpha);
        return;
    }
#endif
    (void) backend;
    fa_amx_pv_model(pr, ldpr, nchunks, nlanes, nrows, vp, Dv, acc, ldacc, alpha);
}

#else  /* no bfloat16 code in this build: the pipeline never calls these */

/* Stubs with the kernels' signatures, which only the avx512 build compiles. */
#define FA_AMX_STUB static inline __attribute__((unused)) void
FA_AMX_STUB fa_pack_p_rows(const float* s, ptrdiff_t lds, ptrdiff_t nj, ptrdiff_t nlanes,
                           uint16_t* pr, ptrdiff_t ldpr)
{ (void)s; (void)lds; (void)nj; (void)nlanes; (void)pr; (void)ldpr; }
FA_AMX_STUB fa_amx_scores(int backend, const uint16_t* const* kr, ptrdiff_t nj,
                          const uint32_t* qt, ptrdiff_t ldqt, ptrdiff_t nlanes, ptrdiff_t D,
                          float scale, float* s, ptrdiff_t lds, uint16_t* kst,
                          const uint16_t* zrow)
{ (void)backend; (void)kr; (void)nj; (void)qt; (void)ldqt; (void)nlanes; (void)D;
  (void)scale; (void)s; (void)lds; (void)kst; (void)zrow; }
FA_AMX_STUB fa_pack_bf16_cols(const float* s, ptrdiff_t lds, ptrdiff_t nrows,
                              ptrdiff_t nrows_pad, ptrdiff_t ncols, ptrdiff_t ncols_pad,
                              uint16_t* dst, ptrdiff_t ldd)
{ (void)s; (void)lds; (void)nrows; (void)nrows_pad; (void)ncols; (void)ncols_pad;
  (void)dst; (void)ldd; }
FA_AMX_STUB fa_amx_gemm(int backend, const uint16_t* a, ptrdiff_t lda, ptrdiff_t M,
                        ptrdiff_t nchunks, const uint32_t* b, ptrdiff_t ldb, ptrdiff_t N,
                        float* c, ptrdiff_t ldc)
{ (void)backend; (void)a; (void)lda; (void)M; (void)nchunks; (void)b; (void)ldb; (void)N;
  (void)c; (void)ldc; }
FA_AMX_STUB fa_amx_pv(int backend, const uint16_t* pr, ptrdiff_t ldpr, ptrdiff_t nchunks,
                      ptrdiff_t nlanes, ptrdiff_t nrows, const uint32_t* vp, ptrdiff_t Dv,
                      float* acc, ptrdiff_t ldacc, const float* alpha)
{ (void)backend; (void)pr; (void)ldpr; (void)nchunks; (void)nlanes; (void)nrows; (void)vp;
  (void)Dv; (void)acc; (void)ldacc; (void)alpha; }
FA_AMX_STUB fa_amx_begin(int backend) { (void)backend; }
FA_AMX_STUB fa_amx_end(int backend) { (void)backend; }
#undef FA_AMX_STUB

#endif /* FA_HAVE_BF16DOT */
#endif /* FA_AMX_H */
