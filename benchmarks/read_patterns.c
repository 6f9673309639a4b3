/*
 * read_patterns.c -- how fast can this machine read K/V blocks the way the decode kernels do?
 *
 * The decode kernels make keys the SIMD lanes, so that a decode step gives the prefill's
 * bits (the reproducibility rule in the README).  They therefore read a block of K rows a
 * strip of rows at a time, 16 bytes of each row per step (the 8x4 in-register transposes),
 * not each row front to back.  This program streams a large buffer of such blocks (32 rows
 * x 512 bytes, the K or V rows of decode-gqa-8k: D = 128, float32) with no arithmetic, in
 * several orders, to separate what the read pattern costs from what the kernels'
 * arithmetic costs:
 *
 *   seq        each block front to back (what the hardware prefetchers follow best)
 *   strips     strips of 16 rows, 16 bytes of each row per step (the kernels' loads)
 *   strips-pf  the same, plus software prefetch of the next block, line by line in address
 *              order, spread evenly over the steps (what fa_dec_pf does)
 *   copy       each block copied front to back into a 16 KiB buffer that stays in L1, then
 *              read from there in strips (a staging copy for the hardware prefetchers)
 *
 * Build and run (x86-64, SSE2 is enough):
 *     gcc -O2 -fopenmp benchmarks/read_patterns.c -o /tmp/read_patterns
 *     OMP_NUM_THREADS=2 /tmp/read_patterns 512        # MiB streamed per pass
 * It prints the best of 9 passes for each pattern, in GB/s, in alternating order.
 * Compare with `python -m fastattn bench`'s read bandwidth (sgemv).
 */
#include <emmintrin.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#define ROW_BYTES 512
#define ROWS 32
#define BLOCK_BYTES (ROWS * ROW_BYTES)
#define STRIP 16

enum { SEQ, STRIPS, STRIPS_PF, COPY, NPATTERNS };
static const char* const NAMES[NPATTERNS] = {"seq", "strips", "strips-pf", "copy"};

static double now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + 1e-9 * t.tv_nsec;
}

/* strips of STRIP rows, 16 bytes of each row per step; pf: the next block to prefetch */
static __m128 read_strips(const char* blk, const char* pf, __m128 acc)
{
    const int steps = (ROWS / STRIP) * (ROW_BYTES / 16);
    const int lines_per_step = (BLOCK_BYTES / 64) / steps;   /* 256 lines over 64 steps */
    __m128 a1 = _mm_setzero_ps();
    for (int s0 = 0; s0 < ROWS; s0 += STRIP)
        for (int c = 0; c < ROW_BYTES; c += 16) {
            if (pf) {
                for (int i = 0; i < lines_per_step; i++) _mm_prefetch(pf + 64 * i, _MM_HINT_T0);
                pf += 64 * lines_per_step;
            }
            for (int r = s0; r < s0 + STRIP; r += 2) {
                acc = _mm_add_ps(acc, _mm_load_ps((const float*)(blk + r * ROW_BYTES + c)));
                a1 = _mm_add_ps(a1, _mm_load_ps((const float*)(blk + (r + 1) * ROW_BYTES + c)));
            }
        }
    return _mm_add_ps(acc, a1);
}

static float run(const char* buf, size_t nblocks, int pattern)
{
    float total = 0;
#pragma omp parallel reduction(+ : total)
    {
        int t = 0, nt = 1;
#ifdef _OPENMP
        t = omp_get_thread_num();
        nt = omp_get_num_threads();
#endif
        static __thread float stage[BLOCK_BYTES / 4] __attribute__((aligned(64)));
        const size_t b0 = nblocks * t / nt, b1 = nblocks * (t + 1) / nt;
        __m128 acc = _mm_setzero_ps();
        for (size_t b = b0; b < b1; b++) {
            const char* blk = buf + b * BLOCK_BYTES;
            switch (pattern) {
            case SEQ: {
                __m128 a1 = _mm_setzero_ps();
                for (int off = 0; off < BLOCK_BYTES; off += 32) {
                    acc = _mm_add_ps(acc, _mm_load_ps((const float*)(blk + off)));
                    a1 = _mm_add_ps(a1, _mm_load_ps((const float*)(blk + off + 16)));
                }
                acc = _mm_add_ps(acc, a1);
                break;
            }
            case STRIPS: acc = read_strips(blk, NULL, acc); break;
            case STRIPS_PF: acc = read_strips(blk, blk + BLOCK_BYTES, acc); break;
            case COPY:
                memcpy(stage, blk, BLOCK_BYTES);
                acc = read_strips((const char*)stage, NULL, acc);
                break;
            }
        }
        float o[4];
        _mm_storeu_ps(o, acc);
        total += o[0] + o[1] + o[2] + o[3];
    }
    return total;
}

int main(int argc, char** argv)
{
    const size_t mib = argc > 1 ? (size_t)atol(argv[1]) : 512;
    const size_t nblocks = mib * 1024 * 1024 / BLOCK_BYTES;
    /* one spare block: strips-pf prefetches one block past the end */
    char* buf = aligned_alloc(4096, (nblocks + 1) * BLOCK_BYTES);
    if (!buf) {
        fprintf(stderr, "cannot allocate %zu MiB\n", mib);
        return 1;
    }
    for (size_t i = 0; i < (nblocks + 1) * BLOCK_BYTES / 4; i++) ((float*)buf)[i] = 1.0f;
    double best[NPATTERNS];
    float check = 0;
    for (int p = 0; p < NPATTERNS; p++) best[p] = 1e30;
    for (int pass = 0; pass < 9; pass++)
        for (int p = 0; p < NPATTERNS; p++) {
            const double t0 = now();
            check += run(buf, nblocks, p);
            const double dt = now() - t0;
            if (dt < best[p]) best[p] = dt;
        }
    int threads = 1;
#ifdef _OPENMP
    threads = omp_get_max_threads();
#endif
    printf("%zu MiB in blocks of %d rows x %d bytes, %d thread(s), best of 9 passes:\n", mib,
           ROWS, ROW_BYTES, threads);
    for (int p = 0; p < NPATTERNS; p++)
        printf("  %-10s %6.1f GB/s\n", NAMES[p], (double)(nblocks * BLOCK_BYTES) / best[p] / 1e9);
    printf("  (checksum %g: printed so that no pass can be optimised away)\n", check);
    free(buf);
    return 0;
}
