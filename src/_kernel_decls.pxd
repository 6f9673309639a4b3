# The C side of the kernel (fa_kernels.h) as Cython sees it, and one fused-type wrapper
# per micro-kernel, so that the tile pipeline (_tile_pipeline.pxi) calls `score_tile(...)`
# once instead of choosing between the _f and _d instantiations at every call site.
#
# K and V rows reach the micro-kernels as `const char*` in the compute type: read in place
# when stored in it, else widened block by block from their 16-bit storage type
# (fa_half.h, the tile pipeline's _load_block).

from libc.stdint cimport int8_t, int32_t, uint8_t, uint16_t, uint32_t

ctypedef fused floating:
    float
    double

cdef extern from "fa_kinds.h" nogil:
    # The storage kinds' table (its columns are described there).
    enum:
        FA_N_KINDS
        FA_SCALE_NONE
        FA_SCALE_F16_BLOCK
        FA_SCALE_F32_HEAD
    ctypedef struct fa_kind_info:
        const char* name
        const char* dtype
        int per_item, block, scale
        double largest, quantisable
    const fa_kind_info fa_kinds[]

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
        FA_HAVE_GQA4_16
        FA_HAVE_F16C
        FA_HAVE_SOFTMAX_PAIRS
        FA_KT8_MAX_D
        FA_CAUSAL_NONE
        FA_CAUSAL_BOTTOM_RIGHT
        FA_CAUSAL_TOP_LEFT
        FA_STORE_NATIVE
        FA_STORE_F16
        FA_STORE_BF16
        FA_STORE_Q8_0
        FA_STORE_Q4_0
        FA_STORE_E4M3
        FA_STORE_E5M2
        FA_E4M3_UNIT
    const Py_ssize_t FA_VL_F
    const Py_ssize_t FA_VL_D
    const char* FA_COMPILER
    const char* FA_ISA
    const int FA_HAS_FMA
    void fa_key_interval(Py_ssize_t i, Py_ssize_t Lq, Py_ssize_t kv_len, int causal,
                         Py_ssize_t wl, Py_ssize_t wr, Py_ssize_t* lo, Py_ssize_t* hi)

    # the micro-kernels by storage kind and tile size (fa_by_kind.h)
    void fa_score_micro_f(int nvec, Py_ssize_t mk, const void** kr, const float* qt,
                          Py_ssize_t ldqt, Py_ssize_t D, float scale, float* s, Py_ssize_t lds)
    void fa_score_micro_d(int nvec, Py_ssize_t mk, const void** kr, const double* qt,
                          Py_ssize_t ldqt, Py_ssize_t D, double scale, double* s,
                          Py_ssize_t lds)
    void fa_decode_scores_f(int kind, int nr, const void** kr, Py_ssize_t ldk, int nk,
                            const float* qt, Py_ssize_t ldqt, Py_ssize_t D, float scale,
                            float* s, Py_ssize_t lds, int nstore, const char** pf,
                            Py_ssize_t pf_bytes)
    void fa_decode_scores_d(int nr, const void** kr, Py_ssize_t ldk, int nk, const double* qt,
                            Py_ssize_t ldqt, Py_ssize_t D, double scale, double* s,
                            Py_ssize_t lds, int nstore, const char** pf, Py_ssize_t pf_bytes)
    void fa_decode_scores_gqa4(int kind, const void** kr, Py_ssize_t ldk, const float* qt,
                               Py_ssize_t ldqt, Py_ssize_t D, float scale, float* s,
                               Py_ssize_t lds, int nstore, const char** pf, Py_ssize_t pf_bytes,
                               int npass)
    void fa_output_tile_f(int kind, Py_ssize_t nrows, const float* p, Py_ssize_t ldp,
                          Py_ssize_t nj, const void* v, Py_ssize_t ldv, float* acc,
                          Py_ssize_t ldacc, const float* alpha)
    void fa_output_tile_d(Py_ssize_t nrows, const double* p, Py_ssize_t ldp, Py_ssize_t nj,
                          const void* v, Py_ssize_t ldv, double* acc, Py_ssize_t ldacc,
                          const double* alpha)
    void fa_output_wide_f(int kind, int nr, const float* p, Py_ssize_t ldp, Py_ssize_t nj,
                          const void* v, Py_ssize_t ldv, float* acc, Py_ssize_t ldacc,
                          const float* alpha, const char* pf, Py_ssize_t pf_stride,
                          Py_ssize_t pf_rows, Py_ssize_t pf_bytes)
    void fa_output_wide_d(int nr, const double* p, Py_ssize_t ldp, Py_ssize_t nj,
                          const void* v, Py_ssize_t ldv, double* acc, Py_ssize_t ldacc,
                          const double* alpha, const char* pf, Py_ssize_t pf_stride,
                          Py_ssize_t pf_rows, Py_ssize_t pf_bytes)
    void fa_output_rows_ptr(int kind, const float* p, Py_ssize_t ldp, Py_ssize_t nj,
                            const void* const* vr, Py_ssize_t Dv, float* acc,
                            Py_ssize_t ldacc, const float* alpha, int nr, const char* const* pf,
                            Py_ssize_t npf)

    void fa_hide_keys_f(float* s, Py_ssize_t lds, Py_ssize_t nk, int nvec)
    void fa_hide_keys_d(double* s, Py_ssize_t lds, Py_ssize_t nk, int nvec)

    void fa_softmax_step_f(float* s, Py_ssize_t lds, Py_ssize_t nj, Py_ssize_t jlo,
                           Py_ssize_t jhi, float* m, float* l, float* alpha)
    void fa_softmax_step_d(double* s, Py_ssize_t lds, Py_ssize_t nj, Py_ssize_t jlo,
                           Py_ssize_t jhi, double* m, double* l, double* alpha)
    void fa_softmax_step2_f(float* s, Py_ssize_t lds, Py_ssize_t nj, Py_ssize_t jlo,
                            Py_ssize_t jhi, float* m, float* l, float* alpha)
    # with FA_HAVE_SOFTMAX_PAIRS only
    void fa_softmax_pairs_f(float* s, Py_ssize_t lds, Py_ssize_t nj, Py_ssize_t jlo,
                            Py_ssize_t jhi, float* m, float* l, float* alpha)
    void fa_softmax_step2_d(double* s, Py_ssize_t lds, Py_ssize_t nj, Py_ssize_t jlo,
                            Py_ssize_t jhi, double* m, double* l, double* alpha)
    void fa_merge_stats_f(float* M, float* L, const float* m, const float* l, float* fa,
                          float* fb)
    void fa_merge_stats_d(double* M, double* L, const double* m, const double* l, double* fa,
                          double* fb)
    void fa_merge_acc_f(float* ACC, const float* acc, Py_ssize_t n, float a, float b)
    void fa_merge_acc_d(double* ACC, const double* acc, Py_ssize_t n, double a, double b)
    void fa_pack_qt_f(const float* const* rows, Py_ssize_t D, float* qt, Py_ssize_t ldqt)
    void fa_pack_qt_d(const double* const* rows, Py_ssize_t D, double* qt, Py_ssize_t ldqt)

    void fa_softcap_f(float* s, Py_ssize_t lds, Py_ssize_t nk, int nvec, float c)
    void fa_softcap_d(double* s, Py_ssize_t lds, Py_ssize_t nk, int nvec, double c)
    void fa_alibi_f(float* s, Py_ssize_t lds, Py_ssize_t j0, Py_ssize_t nk, const float* nslope,
                    const float* diag, int nvec)
    void fa_alibi_d(double* s, Py_ssize_t lds, Py_ssize_t j0, Py_ssize_t nk,
                    const double* nslope, const double* diag, int nvec)
    void fa_tanh_array_f(const float* x, float* y, Py_ssize_t n)
    void fa_exp2_array_f(const float* x, float* y, Py_ssize_t n)
    void fa_exp2_array_d(const double* x, double* y, Py_ssize_t n)
    void fa_exp2_array_f8(const float* x, float* y, Py_ssize_t n)
    # requests for rows (fa_kernels.h), in the forms a compiler keeps where they are all
    # a function does
    void fa_prefetch_l2 "fa_prefetch_l2_kept" (const char* p, Py_ssize_t nbytes)
    void fa_prefetch_l1 "fa_prefetch_l1_kept" (const char* p, Py_ssize_t nbytes)
    void fa_prefetch_row "fa_prefetch_row_kept" (const char* p, Py_ssize_t nbytes,
                                                 int run_ends, int loc)
    int fa_prefetch_init()
    # K and V stored in a byte per value or less (fa_quant.h): rows dequantised, and the
    # decode kernels that read them in place
    bint FA_QUANTISED(int kind)
    bint FA_BLOCK_SCALED(int kind)
    Py_ssize_t fa_quant_row_bytes(int kind, Py_ssize_t n)
    void fa_dequant_row_f(int kind, const uint8_t* x, const uint16_t* bscale, float fscale,
                          Py_ssize_t n, float* y)
    void fa_dequant_row_d(int kind, const uint8_t* x, const uint16_t* bscale, float fscale,
                          Py_ssize_t n, double* y)
    void fa_pack_qt4_f(const float* const* rows, Py_ssize_t D, float* qt, Py_ssize_t ldqt)
    void fa_score_quant(int kind, int nr, const uint8_t** kr, const float* ksc,
                        Py_ssize_t ldksc, int nk, const float* qt, Py_ssize_t ldqt, Py_ssize_t D,
                        float scale, float* s, Py_ssize_t lds, int nstore, const char** pf,
                        int npf, const char** l1, int nl1)
    int fa_score_quant_keys(int nr)
    void fa_quant_rows(int kind, const char* k, Py_ssize_t k_row, const uint16_t* ks,
                       Py_ssize_t ks_row, Py_ssize_t nbk, float kfs, const char* v,
                       Py_ssize_t v_row, const uint16_t* vs, Py_ssize_t vs_row, Py_ssize_t nbv,
                       float vfs, Py_ssize_t n, const char** kptr, const char** vptr,
                       float* ksc, Py_ssize_t ldksc, float* vsc)
    void fa_quant_next_rows(int kind, const char* k, Py_ssize_t k_row, const uint16_t* ks,
                            Py_ssize_t ks_row, Py_ssize_t nbk, const char* v, Py_ssize_t v_row,
                            const uint16_t* vs, Py_ssize_t vs_row, Py_ssize_t nbv,
                            Py_ssize_t n, const char** kpf, const char** vpf)
    void fa_pv_quant(int kind, const float* p, Py_ssize_t ldp, Py_ssize_t nj,
                     const uint8_t** vr, const float* vsc, Py_ssize_t Dv, float* acc,
                     Py_ssize_t ldacc, const float* alpha, int nr, const char** pf,
                     Py_ssize_t npf)
    # 16-bit storage (fa_half.h): a block's rows widened, single elements, output rows
    void fa_widen_rows_f(int kind, const uint16_t* src, Py_ssize_t ld, Py_ssize_t nrows,
                         Py_ssize_t n, float* dst, Py_ssize_t ldd, const uint16_t* pf,
                         Py_ssize_t pf_rows)
    void fa_widen_rows_d(int kind, const uint16_t* src, Py_ssize_t ld, Py_ssize_t nrows,
                         Py_ssize_t n, double* dst, Py_ssize_t ldd, const uint16_t* pf,
                         Py_ssize_t pf_rows)
    float fa_f16_to_f32(uint16_t h)
    float fa_bf16_to_f32(uint16_t h)
    void fa_narrow_f(int kind, const float* src, Py_ssize_t n, uint16_t* dst)
    void fa_widen_array_f(int kind, const uint16_t* x, float* y, Py_ssize_t n)
    void fa_narrow_array_f(int kind, const float* x, uint16_t* y, Py_ssize_t n)
    int fa_have_openmp()
    int fa_omp_max_threads()
    int fa_cpu_supports(const char* isa)


# bfloat16 dot products (fa_bf16dot.h): the avx512 build's, called only where
# fa_cpu_has_bf16dot() (FA_HAVE_BF16DOT 0: stubs that are never called)
cdef extern from "fa_kernels.h" nogil:
    enum:
        FA_HAVE_BF16DOT
    int fa_cpu_has_bf16dot()
    void fa_score_tile_bdp(const uint16_t** kr, const uint32_t* qt, Py_ssize_t ldqt,
                           Py_ssize_t D, float scale, float* s, Py_ssize_t lds)
    void fa_score_tile4_bdp(const uint16_t** kr, const uint32_t* qt, Py_ssize_t ldqt,
                            Py_ssize_t D, float scale, float* s, Py_ssize_t lds)
    void fa_score_tile1_bdp(const uint16_t** kr, const uint32_t* qt, Py_ssize_t ldqt,
                            Py_ssize_t D, float scale, float* s, Py_ssize_t lds)
    void fa_score_keys16x1_bdp(const uint16_t** kr, int nk, const uint32_t* qt,
                               Py_ssize_t ldqt, Py_ssize_t D, float scale, float* s,
                               Py_ssize_t lds)
    void fa_score_keys16x2_bdp(const uint16_t** kr, int nk, const uint32_t* qt,
                               Py_ssize_t ldqt, Py_ssize_t D, float scale, float* s,
                               Py_ssize_t lds)
    void fa_score_keys16x4_bdp(const uint16_t** kr, int nk, const uint32_t* qt,
                               Py_ssize_t ldqt, Py_ssize_t D, float scale, float* s,
                               Py_ssize_t lds)
    void fa_pack_qt_pairs(const uint16_t* const* rows, Py_ssize_t D, uint32_t* qt,
                          Py_ssize_t ldqt)
    void fa_pack_p_pairs(const float* s, Py_ssize_t lds, Py_ssize_t nj, Py_ssize_t nlanes,
                         uint32_t* pp, Py_ssize_t ldp)
    void fa_pack_v_pairs(const uint16_t* const* rows, Py_ssize_t nj, Py_ssize_t Dv,
                         uint32_t* vp)
    void fa_pv_tile_bdp(const uint32_t* pp, Py_ssize_t ldp, Py_ssize_t npairs,
                        const uint32_t* vp, Py_ssize_t ldv, float* acc, Py_ssize_t ldacc,
                        const float* alpha)
    void fa_pv_tile1_bdp(const uint32_t* pp, Py_ssize_t ldp, Py_ssize_t npairs,
                         const uint32_t* vp, Py_ssize_t ldv, float* acc, Py_ssize_t ldacc,
                         const float* alpha)
    void fa_pv_rows_bdp(int nr, const uint32_t* pp, Py_ssize_t ldp, Py_ssize_t npairs,
                        const uint16_t* const* rows, Py_ssize_t nj, Py_ssize_t Dv,
                        float* acc, Py_ssize_t ldacc, const float* alpha)


# Integer dot products over q8_0 and q4_0 keys (fa_int8dot.h): the avx512 and avx2 builds',
# called only where fa_int8dot_init() found a way (FA_HAVE_INT8DOT 0: a stub never called)
cdef extern from "fa_kernels.h" nogil:
    enum:
        FA_HAVE_INT8DOT
        FA_I8_KEYS
        FA_I8_MAX_ROWS
        FA_I8_NONE
        FA_I8_MADD
        FA_I8_VNNI
    int fa_int8dot_init()
    void fa_int8_quant_row(const float* x, Py_ssize_t D, int8_t* qi, float* qd, int32_t* qs)
    void fa_score_int8(int kind, int nr, const uint8_t** kr, const float* ksc,
                       Py_ssize_t ldksc, int nk, const int8_t* qi, const float* qd,
                       const int32_t* qs, Py_ssize_t D, float scale, float* s, Py_ssize_t lds,
                       int nstore, const char** pf, int npf, const char** l1, int nl1)

# AMX tiles (fa_amx.h): kernels on the hardware (FA_AMX_HW, where fa_amx_status() is
# FA_AMX_OK) or on the
# scalar model of the tile instructions (FA_AMX_MODEL); both in builds with FA_HAVE_BF16DOT
cdef extern from "fa_kernels.h" nogil:
    enum:
        FA_HAVE_AMX
        FA_AMX_HW
        FA_AMX_MODEL
        FA_AMX_OK
        FA_AMX_NO_CPU
        FA_AMX_NO_OS
        FA_AMX_NOT_BUILT
    int fa_amx_status()
    void fa_amx_model_dp_test(float* c, const uint16_t* a, const uint16_t* b, int sequential)
    void fa_amx_hw_dp_test(float* c, const uint16_t* a, const uint16_t* b)
    double fa_amx_hw_peak_loop(long n)
    void fa_pack_p_rows(const float* s, Py_ssize_t lds, Py_ssize_t nj, Py_ssize_t nlanes,
                        uint16_t* pr, Py_ssize_t ldpr)
    void fa_amx_scores(int backend, const uint16_t* const* kr, Py_ssize_t nj,
                       const uint32_t* qt, Py_ssize_t ldqt, Py_ssize_t nlanes, Py_ssize_t D,
                       float scale, float* s, Py_ssize_t lds, uint16_t* kst,
                       const uint16_t* zrow)
    void fa_pack_bf16_cols(const float* s, Py_ssize_t lds, Py_ssize_t nrows,
                           Py_ssize_t nrows_pad, Py_ssize_t ncols, Py_ssize_t ncols_pad,
                           uint16_t* dst, Py_ssize_t ldd)
    void fa_amx_begin(int backend)
    void fa_amx_end(int backend)
    void fa_amx_gemm(int backend, const uint16_t* a, Py_ssize_t lda, Py_ssize_t M,
                     Py_ssize_t nchunks, const uint32_t* b, Py_ssize_t ldb, Py_ssize_t N,
                     float* c, Py_ssize_t ldc)
    void fa_amx_pv(int backend, const uint16_t* pr, Py_ssize_t ldpr, Py_ssize_t nchunks,
                   Py_ssize_t nlanes, Py_ssize_t nrows, const uint32_t* vp, Py_ssize_t Dv,
                   float* acc, Py_ssize_t ldacc, const float* alpha)

# ---- fused-type wrappers (scores are S^T: s[j * FA_BQ + r]) ----

cdef inline Py_ssize_t vec_lanes(floating* like) noexcept nogil:
    # Lanes of one SIMD vector of the compute type.
    if floating is float:
        return FA_VL_F
    else:
        return FA_VL_D


cdef inline void score_tile(const char** krows, const floating* qt, Py_ssize_t D,
                            floating scale, floating* s, int nvec, Py_ssize_t mk) noexcept nogil:
    # One score micro-tile of mk (6, or 4 with 2 vectors) keys over 1 or 2 vectors of query
    # rows (identical per-lane arithmetic).
    if floating is float:
        fa_score_micro_f(nvec, mk, <const void**> krows, qt, FA_BQ, D, scale, s, FA_BQ)
    else:
        fa_score_micro_d(nvec, mk, <const void**> krows, qt, FA_BQ, D, scale, s, FA_BQ)


cdef inline void score_tile_bdp(const char** krows, const uint32_t* qt, Py_ssize_t D,
                                float scale, float* s, int nvec, Py_ssize_t mk) noexcept nogil:
    # score_tile's micro-tile with bfloat16 products (q in pairs, K rows bfloat16).
    if nvec == 2 and mk == 4:
        fa_score_tile4_bdp(<const uint16_t**> krows, qt, FA_BQ, D, scale, s, FA_BQ)
    elif nvec == 2:
        fa_score_tile_bdp(<const uint16_t**> krows, qt, FA_BQ, D, scale, s, FA_BQ)
    else:
        fa_score_tile1_bdp(<const uint16_t**> krows, qt, FA_BQ, D, scale, s, FA_BQ)

cdef inline void score_keyrows(Py_ssize_t nr, const char** krows, Py_ssize_t ldk, int nk,
                               const floating* qt, Py_ssize_t ldqt, Py_ssize_t D,
                               floating scale, floating* s, int nstore, const char** pf,
                               Py_ssize_t pf_bytes, int kind) noexcept nogil:
    # One decode score pass of nr (8, 4, 2 or 1) query rows over a call of keys (lanes),
    # K stored as `kind` (16-bit kinds with float compute only).
    if floating is float:
        fa_decode_scores_f(kind, <int> nr, <const void**> krows, ldk, nk, qt, ldqt, D, scale,
                           s, FA_BQ, nstore, pf, pf_bytes)
    else:
        fa_decode_scores_d(<int> nr, <const void**> krows, ldk, nk, qt, ldqt, D, scale, s,
                           FA_BQ, nstore, pf, pf_bytes)


cdef inline void pv_ptr(const float* p, Py_ssize_t nj, const char* const* vr, Py_ssize_t Dv,
                        float* acc, Py_ssize_t ldacc, const float* alpha, int nr,
                        int kind, const char* const* pf, Py_ssize_t npf) noexcept nogil:
    # acc = acc * alpha + P V for nr (1 or 4) rows over all Dv columns, V rows vr[j]
    # stored as `kind` (float32, float16 or bfloat16); requests the npf rows pf (the next
    # block's V) into L2 as it goes.
    fa_output_rows_ptr(kind, p, FA_BQ, nj, <const void* const*> vr, Dv, acc, ldacc, alpha, nr,
                       pf, npf)


cdef inline void score_gqa4(const char** krows, Py_ssize_t ldk, const float* qt,
                            Py_ssize_t ldqt, Py_ssize_t D, float scale, float* s, int nstore,
                            const char** pf, Py_ssize_t pf_bytes, int kind,
                            int npass) noexcept nogil:
    # npass decode score passes of 4 query rows of Q^T (qt[d * ldqt + r]) over a call of
    # 32 16-bit keys, which the passes transpose once: krows[0] + i ldk elements when ldk
    # != 0, else the rows krows[i].
    fa_decode_scores_gqa4(kind, <const void**> krows, ldk, qt, ldqt, D, scale, s, FA_BQ,
                          nstore, pf, pf_bytes, npass)


cdef inline void hide_keys(floating* s, Py_ssize_t nk, int nvec) noexcept nogil:
    # -inf for nk keys of 1 or 2 whole vectors of rows.
    if floating is float:
        fa_hide_keys_f(s, FA_BQ, nk, nvec)
    else:
        fa_hide_keys_d(s, FA_BQ, nk, nvec)


cdef inline void softcap(floating* s, Py_ssize_t nk, int nvec, double c) noexcept nogil:
    # s <- c (tanh(s / c) - 1), the capped score less c (see fa_softcap_f), on nk keys
    # of 1 or 2 whole vectors of rows.
    if floating is float:
        fa_softcap_f(s, FA_BQ, nk, nvec, <float> c)
    else:
        fa_softcap_d(s, FA_BQ, nk, nvec, c)


cdef inline void alibi(floating* s, Py_ssize_t j0, Py_ssize_t nk, const floating* nslope,
                       const floating* diag, int nvec) noexcept nogil:
    # s[j] += nslope * |diag - j| per lane, keys j0 .. j0 + nk - 1.
    if floating is float:
        fa_alibi_f(s, FA_BQ, j0, nk, nslope, diag, nvec)
    else:
        fa_alibi_d(s, FA_BQ, j0, nk, nslope, diag, nvec)


cdef inline void softmax_step(floating* s, Py_ssize_t nj, Py_ssize_t jlo, Py_ssize_t jhi,
                              floating* m, floating* l, floating* alpha,
                              int nvec) noexcept nogil:
    # The online-softmax step of 1 or 2 vectors of rows over a block's nj keys.
    if floating is float:
        if nvec == 2:
            fa_softmax_step2_f(s, FA_BQ, nj, jlo, jhi, m, l, alpha)
        else:
            fa_softmax_step_f(s, FA_BQ, nj, jlo, jhi, m, l, alpha)
    else:
        if nvec == 2:
            fa_softmax_step2_d(s, FA_BQ, nj, jlo, jhi, m, l, alpha)
        else:
            fa_softmax_step_d(s, FA_BQ, nj, jlo, jhi, m, l, alpha)


cdef inline void merge_stats(floating* M, floating* L, const floating* m, const floating* l,
                             floating* fa, floating* fb) noexcept nogil:
    if floating is float:
        fa_merge_stats_f(M, L, m, l, fa, fb)
    else:
        fa_merge_stats_d(M, L, m, l, fa, fb)


cdef inline void merge_acc(floating* ACC, const floating* acc, Py_ssize_t n, floating a,
                           floating b) noexcept nogil:
    if floating is float:
        fa_merge_acc_f(ACC, acc, n, a, b)
    else:
        fa_merge_acc_d(ACC, acc, n, a, b)


cdef inline void pack_qt(const char* const* rows, Py_ssize_t D, floating* qt,
                         Py_ssize_t ldqt) noexcept nogil:
    # Q^T of one vector of rows stored in the compute type (a vector's lanes of row pointers).
    if floating is float:
        fa_pack_qt_f(<const float* const*> rows, D, qt, ldqt)
    else:
        fa_pack_qt_d(<const double* const*> rows, D, qt, ldqt)


cdef inline void pv_tile(const floating* p, Py_ssize_t nj, const char* v, Py_ssize_t ldv,
                         floating* acc, Py_ssize_t ldacc, const floating* alpha,
                         Py_ssize_t nrows, int kind) noexcept nogil:
    # One output micro-tile of FA_MR_PV rows or of a single row, 2 vectors of columns; V
    # stored as `kind` (16-bit kinds with float compute only).
    if floating is float:
        fa_output_tile_f(kind, nrows, p, FA_BQ, nj, v, ldv, acc, ldacc, alpha)
    else:
        fa_output_tile_d(nrows, p, FA_BQ, nj, v, ldv, acc, ldacc, alpha)


cdef inline void pv_tile_ld(const floating* p, Py_ssize_t ldp, Py_ssize_t nj,
                            const floating* v, Py_ssize_t ldv, floating* acc,
                            Py_ssize_t ldacc, const floating* alpha,
                            Py_ssize_t nrows) noexcept nogil:
    # pv_tile on values in the compute type, p with stride ldp:
    # acc rows r += sum_j p[j * ldp + r] v[j * ldv].
    if floating is float:
        fa_output_tile_f(FA_STORE_NATIVE, nrows, p, ldp, nj, v, ldv, acc, ldacc, alpha)
    else:
        fa_output_tile_d(nrows, p, ldp, nj, v, ldv, acc, ldacc, alpha)
cdef inline void pv_tile_widened(const floating* p, Py_ssize_t nj, const floating* v,
                                 Py_ssize_t ldv, floating* acc, Py_ssize_t ldacc,
                                 const floating* alpha, Py_ssize_t nrows) noexcept nogil:
    # pv_tile on values already in the compute type (V's zero-padded tail strip).
    pv_tile_ld(p, FA_BQ, nj, v, ldv, acc, ldacc, alpha, nrows)


cdef inline void pv_wide(Py_ssize_t nr, const floating* p, Py_ssize_t nj, const char* v,
                         Py_ssize_t ldv, floating* acc, Py_ssize_t ldacc,
                         const floating* alpha, const char* pf, Py_ssize_t pf_stride,
                         Py_ssize_t pf_rows, Py_ssize_t pf_bytes, int kind) noexcept nogil:
    # The wide output tiles: 4 rows x 4 vectors (nr == 4) or 1 row x 8 vectors (nr == 1),
    # prefetching pf_rows rows of pf as they go; V stored as `kind`.
    if floating is float:
        fa_output_wide_f(kind, <int> nr, p, FA_BQ, nj, v, ldv, acc, ldacc, alpha, pf, pf_stride,
                         pf_rows, pf_bytes)
    else:
        fa_output_wide_d(<int> nr, p, FA_BQ, nj, v, ldv, acc, ldacc, alpha, pf, pf_stride,
                         pf_rows, pf_bytes)


cdef inline floating load_elem(const char* row, Py_ssize_t c, int kind,
                               floating* like) noexcept nogil:
    # Element c of a row stored as `kind` (the compute type, float16 or bfloat16), widened.
    if kind == FA_STORE_F16:
        return fa_f16_to_f32((<const uint16_t*> row)[c])
    if kind == FA_STORE_BF16:
        return fa_bf16_to_f32((<const uint16_t*> row)[c])
    return (<const floating*> row)[c]


cdef inline void dequant_row(int kind, const char* x, const uint16_t* bscale, float fscale,
                             Py_ssize_t n, floating* y) noexcept nogil:
    # A row of n values stored as `kind` (q8_0, q4_0, fp8) in the compute type: block
    # scales bscale, or the row's kv head's fp8 scale fscale (see fa_dequant_row_f).
    if floating is float:
        fa_dequant_row_f(kind, <const uint8_t*> x, bscale, fscale, n, y)
    else:
        fa_dequant_row_d(kind, <const uint8_t*> x, bscale, fscale, n, y)


cdef inline void widen_rows(int kind, const char* src, Py_ssize_t ld, Py_ssize_t nrows,
                            Py_ssize_t n, floating* dst, Py_ssize_t ldd, const char* pf,
                            Py_ssize_t pf_rows) noexcept nogil:
    # nrows rows of n 16-bit elements (ld elements apart) widened to rows ldd apart,
    # prefetching pf_rows rows of pf (the next block) meanwhile.
    if floating is float:
        fa_widen_rows_f(kind, <const uint16_t*> src, ld, nrows, n, dst, ldd,
                        <const uint16_t*> pf, pf_rows)
    else:
        fa_widen_rows_d(kind, <const uint16_t*> src, ld, nrows, n, dst, ldd,
                        <const uint16_t*> pf, pf_rows)


cdef inline void narrow_row(int kind, const floating* src, Py_ssize_t n,
                            char* dst) noexcept nogil:
    # n results rounded once to a 16-bit kind (float16 or bfloat16 results are computed in
    # float32 only).
    if floating is float:
        fa_narrow_f(kind, src, n, <uint16_t*> dst)


# ---- the backward pass's own micro-kernels (fa_backward.h) ----

cdef extern from "fa_backward.h" nogil:
    enum:
        FA_BKV_MAX
    void fa_bwd_ds_f(float* s, float* dp, const float* slope, Py_ssize_t lds, Py_ssize_t nj,
                     Py_ssize_t ja, Py_ssize_t jz, int nvec, const float* lse2,
                     const float* delta, float* psum)
    void fa_bwd_ds_d(double* s, double* dp, const double* slope, Py_ssize_t lds,
                     Py_ssize_t nj, Py_ssize_t ja, Py_ssize_t jz, int nvec,
                     const double* lse2, const double* delta, double* psum)
    void fa_softcap_slope_f(const float* s, float* g, Py_ssize_t lds, Py_ssize_t nk, int nvec,
                            float c)
    void fa_softcap_slope_d(const double* s, double* g, Py_ssize_t lds, Py_ssize_t nk,
                            int nvec, double c)
    float fa_bwd_dot_f(const float* a, const float* b, Py_ssize_t n)
    double fa_bwd_dot_d(const double* a, const double* b, Py_ssize_t n)
    void fa_bwd_transpose_f(const float* src, Py_ssize_t lds, Py_ssize_t nj, Py_ssize_t nj_pad,
                            Py_ssize_t nrows, float* dst, Py_ssize_t ldd)
    void fa_bwd_transpose_d(const double* src, Py_ssize_t lds, Py_ssize_t nj,
                            Py_ssize_t nj_pad, Py_ssize_t nrows, double* dst, Py_ssize_t ldd)


cdef inline void bwd_ds(floating* s, floating* dp, const floating* slope, Py_ssize_t nj,
                        Py_ssize_t ja, Py_ssize_t jz, int nvec, const floating* lse2,
                        const floating* delta, floating* psum) noexcept nogil:
    # P and dS of 1 or 2 vectors of rows over a block's nj keys, [ja, jz) seen, and P added
    # to the rows' sums psum (fa_bwd_ds).
    if floating is float:
        fa_bwd_ds_f(s, dp, slope, FA_BQ, nj, ja, jz, nvec, lse2, delta, psum)
    else:
        fa_bwd_ds_d(s, dp, slope, FA_BQ, nj, ja, jz, nvec, lse2, delta, psum)


cdef inline floating bwd_dot(const floating* a, const floating* b, Py_ssize_t n) noexcept nogil:
    # a . b in one fixed order (fa_bwd_dot).
    if floating is float:
        return fa_bwd_dot_f(a, b, n)
    else:
        return fa_bwd_dot_d(a, b, n)


cdef inline void softcap_slope(const floating* s, floating* g, Py_ssize_t nk, int nvec,
                               double c) noexcept nogil:
    # g <- 1 - tanh^2 on nk keys of 1 or 2 whole vectors of capped scores (as softcap
    # leaves them).
    if floating is float:
        fa_softcap_slope_f(s, g, FA_BQ, nk, nvec, <float> c)
    else:
        fa_softcap_slope_d(s, g, FA_BQ, nk, nvec, c)


cdef inline void bwd_transpose(const floating* src, Py_ssize_t nj, Py_ssize_t nj_pad,
                               Py_ssize_t nrows, floating* dst, Py_ssize_t ldd) noexcept nogil:
    # A block of S^T (rows as lanes) as rows of keys, zero-padded to nj_pad keys.
    if floating is float:
        fa_bwd_transpose_f(src, FA_BQ, nj, nj_pad, nrows, dst, ldd)
    else:
        fa_bwd_transpose_d(src, FA_BQ, nj, nj_pad, nrows, dst, ldd)


