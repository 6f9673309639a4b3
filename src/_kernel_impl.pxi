# The fused attention kernel.  Included by one tiny .pyx per instruction set
# (_kernel_sse2.pyx, _kernel_avx2.pyx, ...), each compiled with its own flags; the
# Python front end (fastattn/_api.py) validates everything and picks the module.
#
# Work decomposition
#   One work item = (batch element b, key/value head g, block of FA_BQ query rows).
#   The query rows of a work item are the rows of all Hq/Hkv query heads that share the
#   kv head g (row R -> head g*group + R // Lq, position R % Lq), so a GQA/MQA group reads
#   its K/V once and decode steps of a group fill one tile.  Items are spread over OpenMP
#   threads with a dynamic schedule (causal tiles have unequal work).  When there are
#   fewer items than threads and several key chunks (a decode step of batch 1 with few kv
#   heads), every (item, key chunk) pair is a work item instead (flash-decoding).
#
# Per work item (flash-attention forward, online softmax):
#   pack Q^T                                       qt   (D x FA_BQ)
#   for each chunk of FA_KCHUNK keys, in key order, that any row of the tile can see:
#     m, l, acc = empty state
#     for each key block of FA_BK keys in the chunk, in key order:
#       S^T = scale * K_blk Q^T      score micro-tiles, hidden ones skipped   s (BK x BQ)
#       hide keys outside each row's interval, apply the user mask
#       online softmax step: m, l, alpha; S^T -> P^T (in place)
#       acc = acc * alpha + P V_blk  output micro-tiles, only over keys the rows can see
#     merge (m, l, acc) into the running (M, L, ACC)
#   out = ACC / L, lse = M + log(L); rows that saw nothing -> 0 and -inf.
# Extra memory: one workspace per thread, O(FA_BQ * (D + Dv + FA_BK)); never O(Lq * Lk).
# Flash-decoding adds one chunk state per (item, chunk): O(items * Lk / FA_KCHUNK * rows
# * Dv), with fewer items than threads.

from libc.string cimport memset
from cpython.mem cimport PyMem_RawMalloc, PyMem_RawFree
from libc.math cimport log, sqrt, isfinite, INFINITY

cimport numpy as cnp
import numpy as np

cnp.import_array()

ctypedef fused floating:
    float
    double

cdef extern from "fa_kernels.h" nogil:
    enum:
        FA_BK
        FA_KCHUNK
        FA_BQ
        FA_MR_K
        FA_MR_PV
        FA_DEC_NR_MAX
        FA_DEC_KEYS_F
        FA_DEC_SCORES_PREFETCH_K_ROWS_F
        FA_CAUSAL_NONE
        FA_CAUSAL_BOTTOM_RIGHT
        FA_CAUSAL_TOP_LEFT
    const Py_ssize_t FA_VL_F
    const Py_ssize_t FA_VL_D
    const char* FA_COMPILER
    const char* FA_ISA
    void fa_key_interval(Py_ssize_t i, Py_ssize_t Lq, Py_ssize_t kv_len, int causal,
                         Py_ssize_t wl, Py_ssize_t wr, Py_ssize_t* lo, Py_ssize_t* hi)
    void fa_score_tile_f(const float** kr, const float* qt, Py_ssize_t ldqt, Py_ssize_t D,
                         float scale, float* s, Py_ssize_t lds)
    void fa_score_tile_d(const double** kr, const double* qt, Py_ssize_t ldqt, Py_ssize_t D,
                         double scale, double* s, Py_ssize_t lds)
    void fa_score_tile1_f(const float** kr, const float* qt, Py_ssize_t ldqt, Py_ssize_t D,
                          float scale, float* s, Py_ssize_t lds)
    void fa_score_tile1_d(const double** kr, const double* qt, Py_ssize_t ldqt, Py_ssize_t D,
                          double scale, double* s, Py_ssize_t lds)
    void fa_score_keyrows1_f(const float** kr, Py_ssize_t ldk, int nk, const float* qt, Py_ssize_t ldqt,
                             Py_ssize_t D, float scale, float* s, Py_ssize_t lds, int nstore,
                             const char** pf, Py_ssize_t pf_bytes)
    void fa_score_keyrows2_f(const float** kr, Py_ssize_t ldk, int nk, const float* qt, Py_ssize_t ldqt,
                             Py_ssize_t D, float scale, float* s, Py_ssize_t lds, int nstore,
                             const char** pf, Py_ssize_t pf_bytes)
    void fa_score_keyrows4_f(const float** kr, Py_ssize_t ldk, int nk, const float* qt, Py_ssize_t ldqt,
                             Py_ssize_t D, float scale, float* s, Py_ssize_t lds, int nstore,
                             const char** pf, Py_ssize_t pf_bytes)
    void fa_score_keyrows8_f(const float** kr, Py_ssize_t ldk, int nk, const float* qt, Py_ssize_t ldqt,
                             Py_ssize_t D, float scale, float* s, Py_ssize_t lds, int nstore,
                             const char** pf, Py_ssize_t pf_bytes)
    void fa_score_keyrows1_d(const double** kr, Py_ssize_t ldk, int nk, const double* qt, Py_ssize_t ldqt,
                             Py_ssize_t D, double scale, double* s, Py_ssize_t lds, int nstore,
                             const char** pf, Py_ssize_t pf_bytes)
    void fa_score_keyrows2_d(const double** kr, Py_ssize_t ldk, int nk, const double* qt, Py_ssize_t ldqt,
                             Py_ssize_t D, double scale, double* s, Py_ssize_t lds, int nstore,
                             const char** pf, Py_ssize_t pf_bytes)
    void fa_score_keyrows4_d(const double** kr, Py_ssize_t ldk, int nk, const double* qt, Py_ssize_t ldqt,
                             Py_ssize_t D, double scale, double* s, Py_ssize_t lds, int nstore,
                             const char** pf, Py_ssize_t pf_bytes)
    void fa_score_keyrows8_d(const double** kr, Py_ssize_t ldk, int nk, const double* qt, Py_ssize_t ldqt,
                             Py_ssize_t D, double scale, double* s, Py_ssize_t lds, int nstore,
                             const char** pf, Py_ssize_t pf_bytes)
    void fa_score_hidden_f(float* s, Py_ssize_t lds, int nk, int nvec)
    void fa_score_hidden_d(double* s, Py_ssize_t lds, int nk, int nvec)
    void fa_score_tile4_f(const float** kr, const float* qt, Py_ssize_t ldqt, Py_ssize_t D,
                          float scale, float* s, Py_ssize_t lds)
    void fa_score_tile4_d(const double** kr, const double* qt, Py_ssize_t ldqt, Py_ssize_t D,
                          double scale, double* s, Py_ssize_t lds)
    void fa_softmax_step_f(float* s, Py_ssize_t lds, Py_ssize_t nj, Py_ssize_t jlo, Py_ssize_t jhi,
                           float* m, float* l, float* alpha)
    void fa_softmax_step_d(double* s, Py_ssize_t lds, Py_ssize_t nj, Py_ssize_t jlo, Py_ssize_t jhi,
                           double* m, double* l, double* alpha)
    void fa_softmax_step2_f(float* s, Py_ssize_t lds, Py_ssize_t nj, Py_ssize_t jlo, Py_ssize_t jhi,
                            float* m, float* l, float* alpha)
    void fa_softmax_step2_d(double* s, Py_ssize_t lds, Py_ssize_t nj, Py_ssize_t jlo, Py_ssize_t jhi,
                            double* m, double* l, double* alpha)
    void fa_merge_stats_f(float* M, float* L, const float* m, const float* l, float* fa, float* fb)
    void fa_merge_stats_d(double* M, double* L, const double* m, const double* l, double* fa, double* fb)
    void fa_merge_acc_f(float* ACC, const float* acc, Py_ssize_t n, float a, float b)
    void fa_merge_acc_d(double* ACC, const double* acc, Py_ssize_t n, double a, double b)
    void fa_pv_tile_f(const float* p, Py_ssize_t ldp, Py_ssize_t nj, const float* v, Py_ssize_t ldv,
                      float* acc, Py_ssize_t ldacc, const float* alpha)
    void fa_pv_tile_d(const double* p, Py_ssize_t ldp, Py_ssize_t nj, const double* v, Py_ssize_t ldv,
                      double* acc, Py_ssize_t ldacc, const double* alpha)
    void fa_pv_tile1_f(const float* p, Py_ssize_t ldp, Py_ssize_t nj, const float* v, Py_ssize_t ldv,
                       float* acc, Py_ssize_t ldacc, const float* alpha)
    void fa_pv_tile1_d(const double* p, Py_ssize_t ldp, Py_ssize_t nj, const double* v, Py_ssize_t ldv,
                       double* acc, Py_ssize_t ldacc, const double* alpha)
    void fa_pv_rows4_f(const float* p, Py_ssize_t ldp, Py_ssize_t nj, const float* v, Py_ssize_t ldv,
                       float* acc, Py_ssize_t ldacc, const float* alpha, const char* pf,
                       Py_ssize_t pf_stride, Py_ssize_t pf_rows, Py_ssize_t pf_bytes)
    void fa_pv_rows4_d(const double* p, Py_ssize_t ldp, Py_ssize_t nj, const double* v, Py_ssize_t ldv,
                       double* acc, Py_ssize_t ldacc, const double* alpha, const char* pf,
                       Py_ssize_t pf_stride, Py_ssize_t pf_rows, Py_ssize_t pf_bytes)
    void fa_pv_row8_f(const float* p, Py_ssize_t ldp, Py_ssize_t nj, const float* v, Py_ssize_t ldv,
                      float* acc, const float* alpha, const char* pf, Py_ssize_t pf_stride,
                      Py_ssize_t pf_rows, Py_ssize_t pf_bytes)
    void fa_pv_row8_d(const double* p, Py_ssize_t ldp, Py_ssize_t nj, const double* v, Py_ssize_t ldv,
                      double* acc, const double* alpha, const char* pf, Py_ssize_t pf_stride,
                      Py_ssize_t pf_rows, Py_ssize_t pf_bytes)
    void fa_exp2_array_f(const float* x, float* y, Py_ssize_t n)
    void fa_exp2_array_d(const double* x, double* y, Py_ssize_t n)
    int fa_have_openmp()
    int fa_omp_max_threads()
    int fa_cpu_supports(const char* isa)

cdef extern from "fa_pool.h" nogil:
    ctypedef void (*fa_work_fn)(void* ctx, Py_ssize_t w, int tid) noexcept nogil
    const char* FA_POOL_BACKEND
    void fa_pool_run(int n_threads, Py_ssize_t n_work, fa_work_fn fn, void* ctx)
    int fa_pool_workers()


MASK_NONE = 0
MASK_BOOL = 1
MASK_ADD = 2
CAUSAL_NONE = FA_CAUSAL_NONE
CAUSAL_BOTTOM_RIGHT = FA_CAUSAL_BOTTOM_RIGHT
CAUSAL_TOP_LEFT = FA_CAUSAL_TOP_LEFT
BLOCK_Q = FA_BQ
BLOCK_K = FA_BK


cdef struct Problem:
    # Base pointers of element [0, ..., 0] of each array (compute dtype; mask: its own).
    char* q
    char* k
    char* v
    char* out
    char* lse
    char* mask
    # Per flattened batch element: element offsets into each array, and kv length.
    const Py_ssize_t* q_boff
    const Py_ssize_t* k_boff
    const Py_ssize_t* v_boff
    const Py_ssize_t* o_boff
    const Py_ssize_t* lse_boff
    const Py_ssize_t* m_boff
    const Py_ssize_t* kv_len
    Py_ssize_t nbatch, Hq, Hkv, group, Lq, Lk, D, Dv
    # Element strides (the last axis of q, k, v, out is contiguous).
    Py_ssize_t q_sh, q_si, k_sh, k_sj, v_sh, v_sj, o_sh, o_si, lse_sh, lse_si
    Py_ssize_t m_sh, m_si, m_sj
    int mask_kind
    int causal
    Py_ssize_t wl, wr
    double scale


# Tiles with at most this many rows (decode steps, small GQA groups) compute scores with
# keys as the SIMD lanes (K transposed in registers) and prefetch V and the next K block
# as they go, see _decode_scores.  Above it, query rows fill the lanes and the
# broadcast-FMA tiles win.
cdef Py_ssize_t FA_DECODE_ROWS = 8
cdef double LOG2E = 1.4426950408889634074
cdef double LN2 = 0.69314718055994530942


cdef inline Py_ssize_t _round_up(Py_ssize_t x, Py_ssize_t m) noexcept nogil:
    return ((x + m - 1) // m) * m


cdef inline Py_ssize_t _lanes(floating* dummy) noexcept nogil:
    # Two vectors of query rows per score micro-tile.
    if floating is float:
        return 2 * FA_VL_F
    else:
        return 2 * FA_VL_D


cdef Py_ssize_t _workspace_elems(Py_ssize_t D, Py_ssize_t Dv, Py_ssize_t n_lanes) noexcept nogil:
    return (D * FA_BQ                         # qt
            + (FA_BK + FA_MR_K) * FA_BQ       # s (a score micro-tile may run past nj)
            + 2 * FA_BQ * _round_up(Dv, n_lanes)  # acc, ACC (columns padded to whole tiles)
            + 7 * FA_BQ                       # m, l, alpha; M, L, merge factors fa, fb
            + FA_BK * n_lanes                 # vtail
            + D + 1)                          # zero key row for micro-tiles past the end


cdef inline void _score(const floating** krows, const floating* qt, Py_ssize_t D,
                        floating scale, floating* s, int nvec, Py_ssize_t mk) noexcept nogil:
    # One score micro-tile of mk (6, or 4 with 2 vectors) keys over 1 or 2 vectors of query
    # rows (identical per-lane arithmetic).
    if floating is float:
        if nvec == 2 and mk == 4:
            fa_score_tile4_f(krows, qt, FA_BQ, D, scale, s, FA_BQ)
        elif nvec == 2:
            fa_score_tile_f(krows, qt, FA_BQ, D, scale, s, FA_BQ)
        else:
            fa_score_tile1_f(krows, qt, FA_BQ, D, scale, s, FA_BQ)
    else:
        if nvec == 2 and mk == 4:
            fa_score_tile4_d(krows, qt, FA_BQ, D, scale, s, FA_BQ)
        elif nvec == 2:
            fa_score_tile_d(krows, qt, FA_BQ, D, scale, s, FA_BQ)
        else:
            fa_score_tile1_d(krows, qt, FA_BQ, D, scale, s, FA_BQ)


cdef inline void _pv(const floating* p, Py_ssize_t nj, const floating* v, Py_ssize_t ldv,
                     floating* acc, Py_ssize_t ldacc, const floating* alpha,
                     Py_ssize_t nrows) noexcept nogil:
    # One output micro-tile of FA_MR_PV rows or of a single row.
    if floating is float:
        if nrows == FA_MR_PV:
            fa_pv_tile_f(p, FA_BQ, nj, v, ldv, acc, ldacc, alpha)
        else:
            fa_pv_tile1_f(p, FA_BQ, nj, v, ldv, acc, ldacc, alpha)
    else:
        if nrows == FA_MR_PV:
            fa_pv_tile_d(p, FA_BQ, nj, v, ldv, acc, ldacc, alpha)
        else:
            fa_pv_tile1_d(p, FA_BQ, nj, v, ldv, acc, ldacc, alpha)


cdef inline void _pv_columns(const floating* p, Py_ssize_t nj, const floating* vrow0,
                             Py_ssize_t ldv, const floating* vtail, floating* acc_row,
                             Py_ssize_t ldacc, const floating* alpha, Py_ssize_t nrows,
                             Py_ssize_t c, Py_ssize_t dv_main, Py_ssize_t dv_tail,
                             Py_ssize_t NL) noexcept nogil:
    # Output micro-tiles (_pv) of value columns [c, dv_main) in strips of NL, then the
    # zero-padded tail strip (vtail) when Dv is not a multiple of NL.
    while c < dv_main:
        _pv(p, nj, vrow0 + c, ldv, acc_row + c, ldacc, alpha, nrows)
        c += NL
    if dv_tail:
        _pv(p, nj, vtail, NL, acc_row + dv_main, ldacc, alpha, nrows)


cdef inline void _pv_wide(Py_ssize_t nr, const floating* p, Py_ssize_t nj, const floating* v,
                          Py_ssize_t ldv, floating* acc, Py_ssize_t ldacc,
                          const floating* alpha, const char* pf, Py_ssize_t pf_stride,
                          Py_ssize_t pf_rows, Py_ssize_t pf_bytes) noexcept nogil:
    # The wide output tiles: 4 rows x 4 vectors (nr == 4) or 1 row x 8 vectors (nr == 1),
    # prefetching pf_rows rows of pf as they go (see fa_tile_impl.h).
    if floating is float:
        if nr == 4:
            fa_pv_rows4_f(p, FA_BQ, nj, v, ldv, acc, ldacc, alpha, pf, pf_stride, pf_rows, pf_bytes)
        else:
            fa_pv_row8_f(p, FA_BQ, nj, v, ldv, acc, alpha, pf, pf_stride, pf_rows, pf_bytes)
    else:
        if nr == 4:
            fa_pv_rows4_d(p, FA_BQ, nj, v, ldv, acc, ldacc, alpha, pf, pf_stride, pf_rows, pf_bytes)
        else:
            fa_pv_row8_d(p, FA_BQ, nj, v, ldv, acc, alpha, pf, pf_stride, pf_rows, pf_bytes)


cdef inline Py_ssize_t _keyrows_pass(Py_ssize_t left) noexcept nogil:
    # Rows per fa_score_keyrows pass for `left` remaining rows: 8 (AVX-512) or 4 cover
    # 3..8 rows at once (the extra rows read qt's zero padding), 2 and 1 exactly.
    if left > 4 and FA_DEC_NR_MAX >= 8:
        return 8
    if left > 2:
        return 4
    return left


cdef inline void _score_keyrows(Py_ssize_t nr, const floating** krows, Py_ssize_t ldk, int nk,
                                const floating* qt, Py_ssize_t ldqt, Py_ssize_t D, floating scale,
                                floating* s, int nstore, const char** pf,
                                Py_ssize_t pf_bytes) noexcept nogil:
    # One fa_score_keyrows pass of nr (8, 4, 2 or 1) rows; see fa_tile_impl.h.
    if floating is float:
        if nr == 8:
            fa_score_keyrows8_f(krows, ldk, nk, qt, ldqt, D, scale, s, FA_BQ, nstore, pf, pf_bytes)
        elif nr == 4:
            fa_score_keyrows4_f(krows, ldk, nk, qt, ldqt, D, scale, s, FA_BQ, nstore, pf, pf_bytes)
        elif nr == 2:
            fa_score_keyrows2_f(krows, ldk, nk, qt, ldqt, D, scale, s, FA_BQ, nstore, pf, pf_bytes)
        else:
            fa_score_keyrows1_f(krows, ldk, nk, qt, ldqt, D, scale, s, FA_BQ, nstore, pf, pf_bytes)
    else:
        if nr == 8:
            fa_score_keyrows8_d(krows, ldk, nk, qt, ldqt, D, scale, s, FA_BQ, nstore, pf, pf_bytes)
        elif nr == 4:
            fa_score_keyrows4_d(krows, ldk, nk, qt, ldqt, D, scale, s, FA_BQ, nstore, pf, pf_bytes)
        elif nr == 2:
            fa_score_keyrows2_d(krows, ldk, nk, qt, ldqt, D, scale, s, FA_BQ, nstore, pf, pf_bytes)
        else:
            fa_score_keyrows1_d(krows, ldk, nk, qt, ldqt, D, scale, s, FA_BQ, nstore, pf, pf_bytes)


cdef inline void _decode_scores(const floating* kb, Py_ssize_t k_sj, Py_ssize_t j0,
                                Py_ssize_t j1, Py_ssize_t D, const floating* zrow,
                                const floating** krows, const floating* qt, Py_ssize_t ldqt,
                                floating* s, const floating* vb, Py_ssize_t v_sj, Py_ssize_t Dv,
                                const char** vrows, floating scale, Py_ssize_t nrows,
                                const Py_ssize_t* lo, const Py_ssize_t* hi,
                                bint pf_v) noexcept nogil:
    # Scores of a decode-sized tile, keys as the lanes: KC keys per call (zero keys pad
    # the last call), each against the rows in passes of 8/4/2/1 (fa_score_keyrows);
    # written to S^T like the lane-group path, keys outside a row's interval hidden.
    # Padding lanes [nrows, nlanes) are not written: _attend_tile zeroes them once, like
    # the zero scores the lane-group path computes for its padding rows.
    # Passes may compute rows past nrows from qt's zero padding (up to nlanes); only
    # rows < nrows are stored.  The first pass prefetches the V rows of its keys.
    # KC, keys per fa_score_keyrows call: one vector of lanes, or 32 (4 groups of 8)
    # with 32-byte float vectors (fa_score_keys32_f in fa_kernels.h).
    cdef Py_ssize_t KC = FA_DEC_KEYS_F if floating is float else FA_VL_D
    cdef Py_ssize_t nj = j1 - j0
    cdef Py_ssize_t t, r, j, jb, ig, nr, pf_bytes, ldk
    cdef int nk
    cdef floating ninf = -INFINITY
    for ig in range((nj + KC - 1) // KC):
        jb = ig * KC
        nk = <int> min(KC, nj - jb)
        for t in range(KC):
            krows[t] = kb + (j0 + jb + t) * k_sj if jb + t < nj else zrow
            vrows[t] = <const char*> (vb + (j0 + jb + t) * v_sj if jb + t < nj else zrow)
        # A whole call of keys is evenly spaced rows of K: say so (kernels may use it).
        ldk = k_sj if nk == KC and k_sj != 0 else 0
        pf_bytes = Dv * sizeof(floating)
        r = 0
        while r < nrows:
            nr = _keyrows_pass(nrows - r)
            _score_keyrows(nr, krows, ldk, nk, qt + r, ldqt, D, scale, s + jb * FA_BQ + r,
                           <int> (nrows - r), vrows if pf_v else NULL, pf_bytes)
            r += nr
            pf_bytes = 0
    for r in range(nrows):
        if lo[r] > j0 or hi[r] < j1:
            for j in range(nj):
                if j0 + j < lo[r] or j0 + j >= hi[r]:
                    s[j * FA_BQ + r] = ninf


cdef inline Py_ssize_t _rows_cap(const Problem* P, Py_ssize_t VL) noexcept nogil:
    # Rows a work item's state can have (its lanes, padded to whole vectors).
    return min(FA_BQ, _round_up(P.group * P.Lq, VL))


cdef inline void _merge_chunk(floating* M, floating* L, floating* ACC, const floating* m,
                              const floating* l, const floating* acc, floating* fa,
                              floating* fb, Py_ssize_t nrows, Py_ssize_t nlanes,
                              Py_ssize_t VL, Py_ssize_t dv_pad) noexcept nogil:
    # Merge one key chunk's state (m, l, acc) into the running state (M, L, ACC) of the
    # rows (fa_merge_stats / fa_merge_acc in fa_tile_impl.h: the one merge every path uses).
    cdef Py_ssize_t c, r, iv
    for iv in range(nlanes // VL):
        c = iv * VL
        if floating is float:
            fa_merge_stats_f(M + c, L + c, m + c, l + c, fa + c, fb + c)
        else:
            fa_merge_stats_d(M + c, L + c, m + c, l + c, fa + c, fb + c)
    for r in range(nrows):
        if floating is float:
            fa_merge_acc_f(ACC + r * dv_pad, acc + r * dv_pad, dv_pad, fa[r], fb[r])
        else:
            fa_merge_acc_d(ACC + r * dv_pad, acc + r * dv_pad, dv_pad, fa[r], fb[r])


cdef inline void _reset_state(floating* m, floating* l, floating* acc, Py_ssize_t nlanes,
                              Py_ssize_t dv_pad) noexcept nogil:
    # The empty softmax state: m = -inf, l = 0, acc = 0.
    cdef Py_ssize_t r
    for r in range(nlanes):
        m[r] = -INFINITY
        l[r] = 0
    memset(acc, 0, nlanes * dv_pad * sizeof(floating))


cdef void _write_rows(const Problem* P, Py_ssize_t b, Py_ssize_t g, Py_ssize_t r0,
                      Py_ssize_t nrows, const floating* M, const floating* L,
                      const floating* ACC, Py_ssize_t dv_pad) noexcept nogil:
    # out = ACC / L and lse = M ln 2 + log L for the rows of a work item; rows that saw
    # nothing (L == 0) get zeros and -inf.
    cdef Py_ssize_t r, R, h, i, c
    cdef floating inv_l
    cdef floating* orow
    for r in range(nrows):
        R = r0 + r
        h = g * P.group + R // P.Lq
        i = R % P.Lq
        orow = (<floating*> P.out) + P.o_boff[b] + h * P.o_sh + i * P.o_si
        # L == 0 exactly iff no key was visible (the max key alone contributes p = 1);
        # a NaN or +inf score makes L NaN, and the row NaN, as in the reference.
        if L[r] != 0:
            inv_l = 1 / L[r]
            for c in range(P.Dv):
                orow[c] = ACC[r * dv_pad + c] * inv_l
        else:
            for c in range(P.Dv):
                orow[c] = 0
        if P.lse != NULL:
            (<floating*> P.lse)[P.lse_boff[b] + h * P.lse_sh + i * P.lse_si] = (
                M[r] * LN2 + log(L[r]) if L[r] != 0 else -INFINITY)


cdef void _attend_tile(const Problem* P, Py_ssize_t b, Py_ssize_t g, Py_ssize_t r0,
                       Py_ssize_t chunk, floating* partial,
                       floating* buf, Py_ssize_t* lo, Py_ssize_t* hi) noexcept nogil:
    # One work item: rows [r0, r0 + nrows) of kv head g of batch element b.
    #   chunk < 0:  all key chunks, merged in order, and the rows written out;
    #   chunk >= 0: only that chunk's keys; its state (m, l, acc) goes to partial, laid out
    #               [m | l | acc] with _rows_cap rows (flash-decoding, see _forward).
    cdef Py_ssize_t NL = _lanes(buf)
    cdef Py_ssize_t VL = NL // 2
    cdef Py_ssize_t D = P.D, Dv = P.Dv, Lq = P.Lq
    cdef Py_ssize_t nrows = min(FA_BQ, P.group * Lq - r0)
    cdef Py_ssize_t nlanes = _round_up(nrows, VL)   # rows the score kernel touches (padded)
    cdef Py_ssize_t n6 = (nrows // FA_MR_PV) * FA_MR_PV   # rows in 6-row output tiles
    cdef Py_ssize_t dv_pad = _round_up(Dv, NL)
    cdef Py_ssize_t dv_main = (Dv // NL) * NL
    cdef Py_ssize_t dv_tail = Dv - dv_main
    # Scores are kept in base 2 (scale * log2 e folded into the score kernel): the softmax
    # then needs 2^x, one multiply cheaper than e^x.  lse is converted back at the end.
    cdef floating scale = <floating> (P.scale * LOG2E)
    cdef floating log2e = <floating> LOG2E
    cdef floating ninf = -INFINITY

    # Carve the workspace (see _workspace_elems).
    cdef floating* qt = buf
    cdef floating* s = qt + D * FA_BQ
    cdef floating* acc = s + (FA_BK + FA_MR_K) * FA_BQ
    cdef floating* m = acc + FA_BQ * dv_pad
    cdef floating* l = m + FA_BQ
    cdef floating* alpha = l + FA_BQ
    cdef floating* ACC = alpha + FA_BQ           # running state over merged chunks
    cdef floating* M = ACC + FA_BQ * dv_pad
    cdef floating* L = M + FA_BQ
    cdef floating* fa = L + FA_BQ
    cdef floating* fb = fa + FA_BQ
    cdef floating* vtail = fb + FA_BQ
    cdef floating* zrow = vtail + FA_BK * NL
    cdef const floating* krows[32]      # FA_MR_K (6) or FA_DEC_KEYS_F (<= 32) key rows
    cdef const char* vrows[32]          # decode: the V rows of krows, to prefetch
    cdef Py_ssize_t vec_lo[FA_BQ]       # per vector of rows: keys [vec_lo, vec_hi) visible
    cdef Py_ssize_t vec_hi[FA_BQ]       # to some row of it (FA_BQ / VL <= 24 entries used)

    cdef Py_ssize_t kv_len = P.kv_len[b]
    cdef floating* qb = (<floating*> P.q) + P.q_boff[b]
    cdef const floating* kb = (<floating*> P.k) + P.k_boff[b] + g * P.k_sh
    cdef const floating* vb = (<floating*> P.v) + P.v_boff[b] + g * P.v_sh
    cdef const floating* qrow
    cdef const floating* vrow
    cdef char* mrow
    cdef Py_ssize_t r, R, h, i, d, c, t, j, j0, j1, nj, blk, jj, ja, rg, na, ib, ic
    cdef Py_ssize_t tile_lo = kv_len, tile_hi = 0
    cdef Py_ssize_t g_minlo, g_maxhi, g_maxlo, g_minhi, rend, nr, pf_rows, cw, vj0, vj1
    cdef Py_ssize_t kc, kc0, kc1, c_lo, c_hi, cap, mk, pf_stride, pf_cols
    cdef const char* pf_base
    cdef bint decode = nrows <= FA_DECODE_ROWS
    # Q^T's row stride: FA_BQ for the prefill's score tiles; the padded row count for a
    # decode tile, so that its D x nlanes values take D/2 (8 lanes of floats) cache lines
    # instead of D -- the decode score kernels read a line per dimension, beside 32 K
    # rows and the prefetched V rows in L1.
    cdef Py_ssize_t ldqt = nlanes if decode else FA_BQ
    # Decode prefetching: K and V are read 8 rows at a time, which the hardware
    # prefetchers do not follow, so the kernels prefetch them in software.  A single row
    # (float): the score kernel streams the next 32 K rows and the output kernel the next
    # block's V rows, so that requests go out during both kernels (decode-4k 7-19% faster
    # in three sets of 7-9 alternating runs on 2 threads).  GQA groups keep the V rows of the
    # score kernel's own keys there: the same split made them 1.5x slower (their output
    # kernel is too short to carry a stream).  Otherwise the output kernel streams the
    # next block's K rows when the score kernel does not (FA_DEC_SCORES_PREFETCH_K_ROWS_F).
    cdef bint pv_next_v = decode and floating is float and nrows == 1
    cdef bint first_blk = True
    cdef int nvec

    # --- rows: visibility interval, packed Q^T, softmax state ---
    for r in range(nlanes):
        if r < nrows:
            R = r0 + r
            h = g * P.group + R // Lq
            i = R % Lq
            fa_key_interval(i, Lq, kv_len, P.causal, P.wl, P.wr, &lo[r], &hi[r])
            if lo[r] < hi[r]:
                tile_lo = min(tile_lo, lo[r])
                tile_hi = max(tile_hi, hi[r])
            qrow = qb + h * P.q_sh + i * P.q_si
            for d in range(D):
                qt[d * ldqt + r] = qrow[d]
        else:
            # Padding rows: zero queries that see nothing; never written out.
            lo[r] = 0
            hi[r] = 0
            for d in range(D):
                qt[d * ldqt + r] = 0
    # Per vector of VL rows: the union of its rows' key intervals (rows that see nothing
    # do not count), for the softmax step.
    for ic in range(nlanes // VL):
        vec_lo[ic] = kv_len
        vec_hi[ic] = 0
        for r in range(ic * VL, min(ic * VL + VL, nrows)):
            if lo[r] < hi[r]:
                vec_lo[ic] = min(vec_lo[ic], lo[r])
                vec_hi[ic] = max(vec_hi[ic], hi[r])
    if decode:
        # Padding lanes of S^T hold finite values from here on (0, then the softmax's p):
        # their m, l, acc are never read, and no stale NaN or denormal reaches the exp.
        # Only the keys a block can hold for this tile (a block's scores start at s's first
        # row, key max(blk, tile_lo)); rows outer: a short contiguous inner loop compiled
        # to one memset call per key.
        nj = min(FA_BK, tile_hi - tile_lo) if tile_lo < tile_hi else 0
        for r in range(nrows, nlanes):
            for j in range(nj):
                s[j * FA_BQ + r] = 0
    memset(zrow, 0, D * sizeof(floating))

    # --- key chunks in key order, each reduced from the empty state over its key blocks
    #     (multiples of FA_BK from key 0), then merged into the running state ---
    _reset_state(M, L, ACC, nlanes, dv_pad)
    kc0 = tile_lo // FA_KCHUNK if tile_lo < tile_hi else 0
    kc1 = (tile_hi + FA_KCHUNK - 1) // FA_KCHUNK if tile_lo < tile_hi else 0
    if chunk >= 0:
        kc0 = chunk
        kc1 = chunk + 1
    for kc in range(kc0, kc1):
        _reset_state(m, l, acc, nlanes, dv_pad)
        c_lo = max(tile_lo, kc * FA_KCHUNK)
        c_hi = min(tile_hi, kc * FA_KCHUNK + FA_KCHUNK)
        for ib in range(c_lo // FA_BK, (c_hi + FA_BK - 1) // FA_BK if c_lo < c_hi else 0):
            blk = ib * FA_BK
            j0 = max(blk, tile_lo)
            j1 = min(blk + FA_BK, tile_hi)
            nj = j1 - j0
            if decode:
                # V rows: prefetched by the score kernel for the first block only when the
                # output kernel streams the next block's V (pv_next_v).
                _decode_scores(kb, P.k_sj, j0, j1, D, zrow, krows, qt, ldqt, s, vb, P.v_sj, Dv,
                               vrows, scale, nrows, lo, hi, not pv_next_v or first_blk)
                first_blk = False
            # Scores, one lane group (2 vectors of rows, or 1 for the last) at a time.
            for ic in range((nlanes + NL - 1) // NL if not decode else 0):
                c = ic * NL
                nvec = <int> min(2, (nlanes - c) // VL)
                rend = min(c + nvec * VL, nrows)
                g_minlo = kv_len
                g_maxhi = 0
                g_maxlo = 0
                g_minhi = kv_len
                for r in range(c, rend):
                    g_maxlo = max(g_maxlo, lo[r])
                    g_minhi = min(g_minhi, hi[r])
                    if lo[r] < hi[r]:
                        g_minlo = min(g_minlo, lo[r])
                        g_maxhi = max(g_maxhi, hi[r])
                # Micro-tiles of FA_MR_K (6) keys; the last 4 or fewer keys of a block
                # in a 4-key tile (64 = 10 x 6 + 4: no scores computed for padding keys).
                jj = 0
                while jj < nj:
                    mk = FA_MR_K if nj - jj > 4 or nvec == 1 else 4
                    ja = j0 + jj
                    if ja + mk <= g_minlo or ja >= g_maxhi:
                        # Hidden from every row of the group (causal / window skipping).
                        if floating is float:
                            fa_score_hidden_f(s + jj * FA_BQ + c, FA_BQ, <int> mk, nvec)
                        else:
                            fa_score_hidden_d(s + jj * FA_BQ + c, FA_BQ, <int> mk, nvec)
                        jj += mk
                        continue
                    for t in range(mk):
                        krows[t] = kb + (ja + t) * P.k_sj if ja + t < j1 else zrow
                    _score(krows, qt + c, D, scale, s + jj * FA_BQ + c, nvec, mk)
                    if ja < g_maxlo or ja + mk > g_minhi:
                        # The micro-tile straddles some row's interval edge: hide per key.
                        for t in range(min(mk, j1 - ja)):
                            for r in range(c, rend):
                                if ja + t < lo[r] or ja + t >= hi[r]:
                                    s[(jj + t) * FA_BQ + r] = ninf
                    jj += mk
                # end: while jj
            # end: for ic

            if P.mask_kind != 0:
                for r in range(nrows):
                    R = r0 + r
                    h = g * P.group + R // Lq
                    i = R % Lq
                    mrow = P.mask + (P.m_boff[b] + h * P.m_sh + i * P.m_si) * (
                        1 if P.mask_kind == 1 else <Py_ssize_t> sizeof(floating))
                    for j in range(max(j0, lo[r]), min(j1, hi[r])):
                        if P.mask_kind == 1:
                            if not (<const unsigned char*> mrow)[j * P.m_sj]:
                                s[(j - j0) * FA_BQ + r] = ninf
                        else:
                            s[(j - j0) * FA_BQ + r] += (<const floating*> mrow)[j * P.m_sj] * log2e

            # Softmax step, two vectors of rows per call (one for an odd last vector).
            ic = 0
            while ic < nlanes // VL:
                c = ic * VL
                nvec = <int> min(2, nlanes // VL - ic)
                # Keys of this block that some row of the vector(s) can see (the rest get
                # p = 0 without an exp; an empty range leaves the rows' state unchanged).
                vj0 = min(max(min(vec_lo[ic], vec_lo[ic + nvec - 1]), j0), j1) - j0
                vj1 = max(min(max(vec_hi[ic], vec_hi[ic + nvec - 1]), j1) - j0, vj0)
                if floating is float:
                    if nvec == 2:
                        fa_softmax_step2_f(s + c, FA_BQ, nj, vj0, vj1, m + c, l + c, alpha + c)
                    else:
                        fa_softmax_step_f(s + c, FA_BQ, nj, vj0, vj1, m + c, l + c, alpha + c)
                else:
                    if nvec == 2:
                        fa_softmax_step2_d(s + c, FA_BQ, nj, vj0, vj1, m + c, l + c, alpha + c)
                    else:
                        fa_softmax_step_d(s + c, FA_BQ, nj, vj0, vj1, m + c, l + c, alpha + c)
                ic += nvec

            if dv_tail:
                # The last partial chunk of value columns, zero-padded to NL lanes, so the
                # output kernel has a single variant (and never reads past a row of V).
                for j in range(nj):
                    vrow = vb + (j0 + j) * P.v_sj + dv_main
                    for t in range(NL):
                        vtail[j * NL + t] = vrow[t] if t < dv_tail else 0

            # Output tiles: rows in 6-row tiles, then single rows; decode tiles of several
            # rows (a GQA group) 4 rows at a time, each V vector loaded once for all of
            # them (rows past nrows, up to nlanes, are zero-initialised padding and never
            # written out).  A single row reads whole V rows, 8 vectors at a time.
            rg = 0
            while rg < nrows:
                if decode and nrows >= 2:
                    nr = 4
                else:
                    nr = FA_MR_PV if rg < n6 else 1
                # Keys any of these rows can see; the rest have p == 0 exactly.
                g_minlo = j1
                g_maxhi = j0
                for r in range(rg, rg + nr):
                    if lo[r] < hi[r]:
                        g_minlo = min(g_minlo, lo[r])
                        g_maxhi = max(g_maxhi, hi[r])
                ja = max(j0, g_minlo)
                na = max(0, min(j1, g_maxhi) - ja)
                # Decode: the first row group also prefetches the next block's V rows
                # (pv_next_v) or K rows (unless the score kernel streams the next K rows
                # itself: fa_score_keys32_f), row ja+j+FA_BK beside V row ja+j, the same
                # columns as it reads of V.
                pf_rows = 0
                if decode and rg == 0 and (pv_next_v or not (
                        floating is float and nrows <= FA_DEC_SCORES_PREFETCH_K_ROWS_F)):
                    pf_rows = max(0, min(na, tile_hi - (ja + FA_BK)))
                if pv_next_v:
                    pf_base = <const char*> (vb + (ja + FA_BK) * P.v_sj)
                    pf_stride = P.v_sj * sizeof(floating)
                    pf_cols = Dv
                else:
                    pf_base = <const char*> (kb + (ja + FA_BK) * P.k_sj)
                    pf_stride = P.k_sj * sizeof(floating)
                    pf_cols = D
                c = 0
                if nr == 4 or nr == 1:
                    cw = 2 * NL if nr == 4 else 4 * NL      # columns per wide call
                    while c + cw <= dv_main:
                        _pv_wide(nr, s + (ja - j0) * FA_BQ + rg, na, vb + ja * P.v_sj + c, P.v_sj,
                                 acc + rg * dv_pad + c, dv_pad, alpha + rg,
                                 pf_base + c * sizeof(floating), pf_stride,
                                 pf_rows if c < pf_cols else 0,
                                 min(cw, pf_cols - c) * sizeof(floating))
                        c += cw
                if nr == 4:
                    for r in range(rg, min(rg + 4, nrows)):
                        _pv_columns(s + (ja - j0) * FA_BQ + r, na, vb + ja * P.v_sj, P.v_sj,
                                    vtail + (ja - j0) * NL, acc + r * dv_pad, dv_pad, alpha + r,
                                    1, c, dv_main, dv_tail, NL)
                else:
                    _pv_columns(s + (ja - j0) * FA_BQ + rg, na, vb + ja * P.v_sj, P.v_sj,
                                vtail + (ja - j0) * NL, acc + rg * dv_pad, dv_pad, alpha + rg,
                                nr, c, dv_main, dv_tail, NL)
                rg += nr
            # end: for rg
        # end: for blk
        if chunk >= 0:
            cap = _rows_cap(P, VL)
            for r in range(nlanes):
                partial[r] = m[r]
                partial[cap + r] = l[r]
            for r in range(nrows):
                for c in range(dv_pad):
                    partial[2 * cap + r * dv_pad + c] = acc[r * dv_pad + c]
            return
        _merge_chunk(M, L, ACC, m, l, acc, fa, fb, nrows, nlanes, VL, dv_pad)
    # end: for kc

    _write_rows(P, b, g, r0, nrows, M, L, ACC, dv_pad)


cdef void _merge_partials(const Problem* P, Py_ssize_t b, Py_ssize_t g, Py_ssize_t r0,
                          const floating* partial, Py_ssize_t nchunk,
                          floating* buf) noexcept nogil:
    # Flash-decoding, second phase: merge a work item's chunk states in key order, exactly
    # as _attend_tile merges them when it walks all chunks itself, and write the rows.
    cdef Py_ssize_t NL = _lanes(buf)
    cdef Py_ssize_t VL = NL // 2
    cdef Py_ssize_t nrows = min(FA_BQ, P.group * P.Lq - r0)
    cdef Py_ssize_t nlanes = _round_up(nrows, VL)
    cdef Py_ssize_t dv_pad = _round_up(P.Dv, NL)
    cdef Py_ssize_t cap = _rows_cap(P, VL)
    cdef Py_ssize_t pst = cap * (dv_pad + 2)
    cdef floating* ACC = buf
    cdef floating* M = ACC + FA_BQ * dv_pad
    cdef floating* L = M + FA_BQ
    cdef floating* fa = L + FA_BQ
    cdef floating* fb = fa + FA_BQ
    cdef Py_ssize_t kc
    cdef const floating* pc
    _reset_state(M, L, ACC, nlanes, dv_pad)
    for kc in range(nchunk):
        pc = partial + kc * pst
        _merge_chunk(M, L, ACC, pc, pc + cap, pc + 2 * cap, fa, fb, nrows, nlanes, VL, dv_pad)
    _write_rows(P, b, g, r0, nrows, M, L, ACC, dv_pad)


cdef struct Job:
    # One call's work items, as _forward hands them to the thread pool.
    const Problem* P
    void* workspace             # one block of ws_elems per thread (floating)
    Py_ssize_t ws_elems
    Py_ssize_t* row_idx         # 2 * FA_BQ per thread
    void* partial               # flash-decoding chunk states (floating), or NULL
    Py_ssize_t pst, nchunk, n_rblk


cdef inline void _job_item(const Job* J, floating* workspace, Py_ssize_t w,
                           int tid) noexcept nogil:
    cdef const Problem* P = J.P
    cdef floating* partial = <floating*> J.partial
    cdef Py_ssize_t* idx = J.row_idx + tid * 2 * FA_BQ
    cdef Py_ssize_t item, rb, bg
    if partial != NULL:
        # Flash-decoding: w is an (item, key chunk) pair; its chunk state goes to partial.
        item = w // J.nchunk
        rb = item % J.n_rblk
        bg = item // J.n_rblk
        _attend_tile(P, bg // P.Hkv, bg % P.Hkv, rb * FA_BQ, w % J.nchunk, partial + w * J.pst,
                     workspace + tid * J.ws_elems, idx, idx + FA_BQ)
    else:
        # Last row blocks first: under causal masking they see the most keys, and the
        # dynamic claiming then ends on the cheap ones instead of waiting on a big one.
        rb = J.n_rblk - 1 - w % J.n_rblk
        bg = w // J.n_rblk
        _attend_tile(P, bg // P.Hkv, bg % P.Hkv, rb * FA_BQ, -1, NULL,
                     workspace + tid * J.ws_elems, idx, idx + FA_BQ)


cdef void _job_item_f(void* ctx, Py_ssize_t w, int tid) noexcept nogil:
    _job_item(<const Job*> ctx, <float*> (<const Job*> ctx).workspace, w, tid)


cdef void _job_item_d(void* ctx, Py_ssize_t w, int tid) noexcept nogil:
    _job_item(<const Job*> ctx, <double*> (<const Job*> ctx).workspace, w, tid)


cdef void _forward(const Problem* P, floating* workspace, Py_ssize_t ws_elems,
                   Py_ssize_t* row_idx, floating* partial, Py_ssize_t nchunk,
                   int n_threads) noexcept nogil:
    cdef Py_ssize_t n_rblk = (P.group * P.Lq + FA_BQ - 1) // FA_BQ
    cdef Py_ssize_t n_items = P.nbatch * P.Hkv * n_rblk
    cdef Py_ssize_t item, rb, bg
    cdef Job J
    J.P = P
    J.workspace = workspace
    J.ws_elems = ws_elems
    J.row_idx = row_idx
    J.partial = partial
    J.pst = 0
    J.nchunk = nchunk
    J.n_rblk = n_rblk
    if partial != NULL:
        # Flash-decoding (fewer work items than threads, several key chunks): every
        # (item, chunk) pair is a work item whose chunk state goes to `partial`; then each
        # item's chunks are merged in key order, the same merge _attend_tile does inline.
        J.pst = _rows_cap(P, _lanes(workspace) // 2) * (_round_up(P.Dv, _lanes(workspace)) + 2)
        fa_pool_run(n_threads, n_items * nchunk,
                    _job_item_f if floating is float else _job_item_d, &J)
        for item in range(n_items):
            rb = item % n_rblk
            bg = item // n_rblk
            _merge_partials(P, bg // P.Hkv, bg % P.Hkv, rb * FA_BQ, partial + item * nchunk * J.pst,
                            nchunk, workspace)
        return
    fa_pool_run(n_threads, n_items, _job_item_f if floating is float else _job_item_d, &J)


cdef int _run(Problem* P, bint is_float, int n_threads) except -1:
    """Allocate per-thread workspaces, release the GIL and run the kernel."""
    cdef Py_ssize_t n_rblk = (P.group * P.Lq + FA_BQ - 1) // FA_BQ
    cdef Py_ssize_t n_items = P.nbatch * P.Hkv * n_rblk
    if n_items == 0:
        return 0
    cdef Py_ssize_t vl = FA_VL_F if is_float else FA_VL_D
    cdef Py_ssize_t nchunk = (P.Lk + FA_KCHUNK - 1) // FA_KCHUNK
    # Fewer work items than threads and several key chunks: split the keys (flash-decoding).
    cdef bint split = n_threads > 1 and n_items < n_threads and nchunk >= 2
    # "Not using less, not using more": no idle threads on small problems.
    n_threads = <int> max(1, min(<Py_ssize_t> n_threads, n_items * nchunk if split else n_items))
    cdef Py_ssize_t itemsize = sizeof(float) if is_float else sizeof(double)
    cdef Py_ssize_t n_lanes = 2 * vl
    # Rounded to 64 bytes so that threads' workspaces never share a cache line.
    cdef Py_ssize_t ws_elems = _round_up(_workspace_elems(P.D, P.Dv, n_lanes), 16)
    cdef size_t ws_bytes = n_threads * ws_elems * itemsize
    cdef size_t idx_bytes = n_threads * 2 * FA_BQ * sizeof(Py_ssize_t)
    # Flash-decoding: one chunk state (m, l, acc of _rows_cap rows) per (item, chunk).
    cdef size_t part_bytes = 0
    if split:
        part_bytes = (n_items * nchunk * min(FA_BQ, _round_up(P.group * P.Lq, vl))
                      * (_round_up(P.Dv, n_lanes) + 2) * itemsize)
    # Allocated here, with the GIL, so that a failure is a MemoryError before any work.
    cdef char* mem = <char*> PyMem_RawMalloc(ws_bytes + part_bytes + idx_bytes + 64)
    if mem == NULL:
        raise MemoryError(f"fastattn: cannot allocate {ws_bytes + part_bytes + idx_bytes} bytes"
                          " of workspace")
    cdef char* aligned = <char*> ((<size_t> mem + 63) & ~(<size_t> 63))
    cdef char* part = aligned + ws_bytes if split else NULL
    try:
        with nogil:
            if is_float:
                _forward[float](P, <float*> aligned, ws_elems,
                                <Py_ssize_t*> (aligned + ws_bytes + part_bytes),
                                <float*> part, nchunk, n_threads)
            else:
                _forward[double](P, <double*> aligned, ws_elems,
                                 <Py_ssize_t*> (aligned + ws_bytes + part_bytes),
                                 <double*> part, nchunk, n_threads)
    finally:
        PyMem_RawFree(mem)
    return 0


cdef inline Py_ssize_t _estride(cnp.ndarray a, int axis):
    # Element stride of an axis counted from the end (-1 = last).
    return cnp.PyArray_STRIDES(a)[cnp.PyArray_NDIM(a) + axis] // cnp.PyArray_ITEMSIZE(a)


def forward(cnp.ndarray q, cnp.ndarray k, cnp.ndarray v, cnp.ndarray out, object lse,
            object mask, int mask_kind,
            cnp.ndarray q_boff, cnp.ndarray k_boff, cnp.ndarray v_boff,
            cnp.ndarray o_boff, cnp.ndarray lse_boff, cnp.ndarray m_boff,
            cnp.ndarray kv_len, Py_ssize_t nbatch,
            int causal, Py_ssize_t wl, Py_ssize_t wr, double scale, int n_threads):
    """Run the fused kernel on validated arrays (called only by fastattn._api).

    q, k, v, out: compute dtype (float32/float64), at least 3-D (heads, rows, cols) with a
    contiguous last axis; batch dims are addressed through the *_boff element offsets
    (int64, one per flattened batch element).  lse: None or an array of the compute dtype;
    mask: None, a uint8 view of a bool mask or an array of the compute dtype, broadcast
    with zero strides.  No validation happens here.
    """
    cdef Problem P
    cdef cnp.ndarray lse_a, mask_a
    P.q = <char*> cnp.PyArray_DATA(q)
    P.k = <char*> cnp.PyArray_DATA(k)
    P.v = <char*> cnp.PyArray_DATA(v)
    P.out = <char*> cnp.PyArray_DATA(out)
    P.q_boff = <const Py_ssize_t*> cnp.PyArray_DATA(q_boff)
    P.k_boff = <const Py_ssize_t*> cnp.PyArray_DATA(k_boff)
    P.v_boff = <const Py_ssize_t*> cnp.PyArray_DATA(v_boff)
    P.o_boff = <const Py_ssize_t*> cnp.PyArray_DATA(o_boff)
    P.lse_boff = <const Py_ssize_t*> cnp.PyArray_DATA(lse_boff)
    P.m_boff = <const Py_ssize_t*> cnp.PyArray_DATA(m_boff)
    P.kv_len = <const Py_ssize_t*> cnp.PyArray_DATA(kv_len)
    P.nbatch = nbatch
    P.Hq = q.shape[q.ndim - 3]
    P.Hkv = k.shape[k.ndim - 3]
    P.group = P.Hq // P.Hkv
    P.Lq = q.shape[q.ndim - 2]
    P.Lk = k.shape[k.ndim - 2]
    P.D = q.shape[q.ndim - 1]
    P.Dv = v.shape[v.ndim - 1]
    P.q_sh = _estride(q, -3)
    P.q_si = _estride(q, -2)
    P.k_sh = _estride(k, -3)
    P.k_sj = _estride(k, -2)
    P.v_sh = _estride(v, -3)
    P.v_sj = _estride(v, -2)
    P.o_sh = _estride(out, -3)
    P.o_si = _estride(out, -2)
    P.lse = NULL
    P.lse_sh = P.lse_si = 0
    if lse is not None:
        lse_a = lse
        P.lse = <char*> cnp.PyArray_DATA(lse_a)
        P.lse_sh = _estride(lse_a, -2)
        P.lse_si = _estride(lse_a, -1)
    P.mask = NULL
    P.mask_kind = mask_kind
    P.m_sh = P.m_si = P.m_sj = 0
    if mask is not None:
        mask_a = mask
        P.mask = <char*> cnp.PyArray_DATA(mask_a)
        P.m_sh = _estride(mask_a, -3)
        P.m_si = _estride(mask_a, -2)
        P.m_sj = _estride(mask_a, -1)
    P.causal = causal
    P.wl = wl
    P.wr = wr
    P.scale = scale

    _run(&P, q.dtype == np.float32, n_threads)


def key_intervals(Py_ssize_t Lq, cnp.ndarray kv_len, int causal, Py_ssize_t wl, Py_ssize_t wr):
    """Visible key interval [lo, hi) of every query row, shape (len(kv_len), Lq) each.

    The kernel's own rule (fa_key_interval), exported for attention_weights.
    """
    cdef Py_ssize_t nb = kv_len.shape[0], b, i
    cdef cnp.ndarray lo = np.empty((nb, Lq), dtype=np.intp)
    cdef cnp.ndarray hi = np.empty((nb, Lq), dtype=np.intp)
    cdef Py_ssize_t* plo = <Py_ssize_t*> cnp.PyArray_DATA(lo)
    cdef Py_ssize_t* phi = <Py_ssize_t*> cnp.PyArray_DATA(hi)
    cdef const Py_ssize_t* pkv = <const Py_ssize_t*> cnp.PyArray_DATA(kv_len)
    for b in range(nb):
        for i in range(Lq):
            fa_key_interval(i, Lq, pkv[b], causal, wl, wr, &plo[b * Lq + i], &phi[b * Lq + i])
    return lo, hi


def vector_exp2(cnp.ndarray x):
    """The kernel's vector 2**x on a contiguous float32/float64 array (for accuracy tests)."""
    cdef cnp.ndarray y = np.empty_like(x)
    if x.dtype == np.float32:
        fa_exp2_array_f(<const float*> cnp.PyArray_DATA(x), <float*> cnp.PyArray_DATA(y), x.size)
    else:
        fa_exp2_array_d(<const double*> cnp.PyArray_DATA(x), <double*> cnp.PyArray_DATA(y), x.size)
    return y


def build_info():
    """Facts fixed when this variant was compiled."""
    return {
        "isa": FA_ISA.decode(),
        "compiler": FA_COMPILER.decode(),
        "openmp": bool(fa_have_openmp()),
        "vector_bytes": int(FA_VL_F * 4),
        "block_q": FA_BQ,
        "block_k": FA_BK,
    }


def omp_max_threads():
    """OpenMP's default team size (honours OMP_NUM_THREADS); 1 without OpenMP."""
    return fa_omp_max_threads()


def pool_info():
    """The thread pool behind the kernels: its backend and how many workers it started."""
    return {"backend": FA_POOL_BACKEND.decode(), "workers": fa_pool_workers()}


def cpu_supports(str isa):
    """Whether the running CPU can execute the named variant ("sse2", "avx2", "avx512")."""
    return bool(fa_cpu_supports(isa.encode()))


# ---------------------------------------------------------------------------------------
# The lean call path.  fastattn.attention() first offers its arguments here: the common
# case (ndarrays of one float dtype, no mask / window / kv_lengths, no broadcasting of the
# batch dims) is validated and run without leaving C, in about a microsecond of overhead.
# Anything else -- including every *invalid* call -- returns None, and the Python front end
# takes over and does the full validation with its error messages.  So this path never
# raises for bad input and never accepts an input the front end would reject.
# ---------------------------------------------------------------------------------------

cdef inline bint _extent_overlap(cnp.ndarray a, cnp.ndarray b):
    # Whether the byte ranges spanned by two arrays intersect (conservative).
    cdef char* a_lo = <char*> cnp.PyArray_DATA(a)
    cdef char* a_hi = a_lo
    cdef char* b_lo = <char*> cnp.PyArray_DATA(b)
    cdef char* b_hi = b_lo
    cdef int d
    cdef Py_ssize_t n, st
    if cnp.PyArray_SIZE(a) == 0 or cnp.PyArray_SIZE(b) == 0:
        return False
    for d in range(cnp.PyArray_NDIM(a)):
        n = cnp.PyArray_DIMS(a)[d]
        st = cnp.PyArray_STRIDES(a)[d]
        if st < 0:
            a_lo += (n - 1) * st
        else:
            a_hi += (n - 1) * st
    for d in range(cnp.PyArray_NDIM(b)):
        n = cnp.PyArray_DIMS(b)[d]
        st = cnp.PyArray_STRIDES(b)[d]
        if st < 0:
            b_lo += (n - 1) * st
        else:
            b_hi += (n - 1) * st
    a_hi += cnp.PyArray_ITEMSIZE(a)
    b_hi += cnp.PyArray_ITEMSIZE(b)
    return a_lo < b_hi and b_lo < a_hi


cdef inline bint _kernel_layout(cnp.ndarray a):
    # Contiguous last axis and whole-element strides: the kernel can read it in place.
    cdef int d, nd = cnp.PyArray_NDIM(a)
    cdef Py_ssize_t isz = cnp.PyArray_ITEMSIZE(a)
    if cnp.PyArray_DIMS(a)[nd - 1] > 1 and cnp.PyArray_STRIDES(a)[nd - 1] != isz:
        return False
    for d in range(nd):
        if cnp.PyArray_STRIDES(a)[d] % isz:
            return False
    return True


cdef void _fill_offsets(cnp.ndarray a, int nb, Py_ssize_t nbatch, Py_ssize_t* off) noexcept:
    # Element offsets of the nb leading (batch) axes, in C order (an odometer).
    cdef Py_ssize_t idx[32]
    cdef Py_ssize_t cur = 0, b
    cdef Py_ssize_t isz = cnp.PyArray_ITEMSIZE(a)
    cdef int d
    for d in range(nb):
        idx[d] = 0
    for b in range(nbatch):
        off[b] = cur
        d = nb - 1
        while d >= 0:
            idx[d] += 1
            cur += cnp.PyArray_STRIDES(a)[d] // isz
            if idx[d] < cnp.PyArray_DIMS(a)[d]:
                break
            cur -= idx[d] * (cnp.PyArray_STRIDES(a)[d] // isz)
            idx[d] = 0
            d -= 1


def attention_fast(q, k, v, scale, causal, bint return_lse, out, int n_threads):
    """The lean path of fastattn.attention (see above); None means "not handled here"."""
    if type(q) is not np.ndarray or type(k) is not np.ndarray or type(v) is not np.ndarray:
        return None
    cdef cnp.ndarray qa = q, ka = k, va = v, oa, la = None
    cdef int typenum = cnp.PyArray_TYPE(qa)
    if typenum != cnp.NPY_FLOAT32 and typenum != cnp.NPY_FLOAT64:
        return None
    if cnp.PyArray_TYPE(ka) != typenum or cnp.PyArray_TYPE(va) != typenum:
        return None
    cdef int nd = cnp.PyArray_NDIM(qa), d
    if nd < 2 or nd > 32 or cnp.PyArray_NDIM(ka) != nd or cnp.PyArray_NDIM(va) != nd:
        return None
    cdef cnp.npy_intp* qs = cnp.PyArray_DIMS(qa)
    cdef cnp.npy_intp* ks = cnp.PyArray_DIMS(ka)
    cdef cnp.npy_intp* vs = cnp.PyArray_DIMS(va)
    cdef int nb = nd - 3 if nd >= 3 else 0
    for d in range(nb):
        if ks[d] != qs[d] or vs[d] != qs[d]:
            return None
    cdef Py_ssize_t Hq = qs[nd - 3] if nd >= 3 else 1
    cdef Py_ssize_t Hkv = ks[nd - 3] if nd >= 3 else 1
    cdef Py_ssize_t Lq = qs[nd - 2], Lk = ks[nd - 2], D = qs[nd - 1], Dv = vs[nd - 1]
    if ks[nd - 1] != D or vs[nd - 2] != Lk or (nd >= 3 and vs[nd - 3] != Hkv):
        return None
    if Hkv == 0 or Hq % Hkv:
        return None
    if not (_kernel_layout(qa) and _kernel_layout(ka) and _kernel_layout(va)):
        return None

    cdef double sc
    if scale is None:
        if D == 0:
            return None
        sc = 1.0 / sqrt(<double> D)
    elif type(scale) is float:
        sc = scale
        if not isfinite(sc):
            return None
    elif type(scale) is int and -2**53 <= scale <= 2**53:
        sc = scale
    else:
        return None
    cdef int causal_mode
    if causal is False:
        causal_mode = FA_CAUSAL_NONE
    elif causal is True:
        causal_mode = FA_CAUSAL_BOTTOM_RIGHT
    else:
        return None

    cdef cnp.npy_intp oshape[32]
    for d in range(nd - 1):
        oshape[d] = qs[d]
    oshape[nd - 1] = Dv
    if out is None:
        oa = cnp.PyArray_EMPTY(nd, oshape, typenum, 0)
    else:
        if type(out) is not np.ndarray:
            return None
        oa = out
        if cnp.PyArray_TYPE(oa) != typenum or cnp.PyArray_NDIM(oa) != nd:
            return None
        for d in range(nd):
            if cnp.PyArray_DIMS(oa)[d] != oshape[d]:
                return None
        if not cnp.PyArray_ISWRITEABLE(oa) or not _kernel_layout(oa):
            return None
        if _extent_overlap(oa, qa) or _extent_overlap(oa, ka) or _extent_overlap(oa, va):
            return None
    if return_lse:
        la = cnp.PyArray_EMPTY(nd - 1, oshape, typenum, 0)

    cdef Problem P
    cdef Py_ssize_t nbatch = 1
    for d in range(nb):
        nbatch *= qs[d]
    # One block: offsets of q, k, v, out, lse per batch element, and the kv lengths.
    cdef Py_ssize_t* offs = <Py_ssize_t*> PyMem_RawMalloc(6 * max(nbatch, 1) * sizeof(Py_ssize_t))
    if offs == NULL:
        raise MemoryError("fastattn: cannot allocate batch offsets")
    cdef Py_ssize_t isz = cnp.PyArray_ITEMSIZE(qa)
    try:
        _fill_offsets(qa, nb, nbatch, offs)
        _fill_offsets(ka, nb, nbatch, offs + nbatch)
        _fill_offsets(va, nb, nbatch, offs + 2 * nbatch)
        _fill_offsets(oa, nb, nbatch, offs + 3 * nbatch)
        if la is not None:
            _fill_offsets(la, nb, nbatch, offs + 4 * nbatch)
        for d in range(nbatch):
            offs[5 * nbatch + d] = Lk
        P.q = <char*> cnp.PyArray_DATA(qa)
        P.k = <char*> cnp.PyArray_DATA(ka)
        P.v = <char*> cnp.PyArray_DATA(va)
        P.out = <char*> cnp.PyArray_DATA(oa)
        P.lse = NULL if la is None else <char*> cnp.PyArray_DATA(la)
        P.mask = NULL
        P.q_boff = offs
        P.k_boff = offs + nbatch
        P.v_boff = offs + 2 * nbatch
        P.o_boff = offs + 3 * nbatch
        P.lse_boff = offs + 4 * nbatch
        P.m_boff = offs
        P.kv_len = offs + 5 * nbatch
        P.nbatch, P.Hq, P.Hkv, P.group = nbatch, Hq, Hkv, Hq // Hkv
        P.Lq, P.Lk, P.D, P.Dv = Lq, Lk, D, Dv
        P.q_sh = cnp.PyArray_STRIDES(qa)[nd - 3] // isz if nd >= 3 else 0
        P.q_si = cnp.PyArray_STRIDES(qa)[nd - 2] // isz
        P.k_sh = cnp.PyArray_STRIDES(ka)[nd - 3] // isz if nd >= 3 else 0
        P.k_sj = cnp.PyArray_STRIDES(ka)[nd - 2] // isz
        P.v_sh = cnp.PyArray_STRIDES(va)[nd - 3] // isz if nd >= 3 else 0
        P.v_sj = cnp.PyArray_STRIDES(va)[nd - 2] // isz
        P.o_sh = cnp.PyArray_STRIDES(oa)[nd - 3] // isz if nd >= 3 else 0
        P.o_si = cnp.PyArray_STRIDES(oa)[nd - 2] // isz
        if la is not None:
            P.lse_sh = cnp.PyArray_STRIDES(la)[nd - 3] // isz if nd >= 3 else 0
            P.lse_si = cnp.PyArray_STRIDES(la)[nd - 2] // isz
        else:
            P.lse_sh = P.lse_si = 0
        P.m_sh = P.m_si = P.m_sj = 0
        P.mask_kind = 0
        P.causal = causal_mode
        P.wl = P.wr = -1
        P.scale = sc
        _run(&P, typenum == cnp.NPY_FLOAT32, n_threads)
    finally:
        PyMem_RawFree(offs)
    return (oa, la) if return_lse else oa
