/*
 * fa_by_kind.h -- the kernels the tile pipeline calls by storage kind: each picks a kind's
 * instantiation (and a tile size's) with one switch per call.  The kinds come from one list
 * per template: FA_FLOAT_KINDS below (fa_tile_impl.h), FA_QUANT_KINDS (fa_quant.h); a new
 * storage kind is a row in one of them and its loads.  Double compute reads only its own
 * type.  Included last by fa_kernels.h.
 */

/* The storage kinds float compute's template is instantiated for: X(suffix, kind, element). */
#define FA_FLOAT_KINDS(X) \
    X(f, FA_STORE_NATIVE, float) X(fh, FA_STORE_F16, uint16_t) X(fb, FA_STORE_BF16, uint16_t)

/* One decode score pass of nr (8, 4, 2 or 1) query rows over a call of keys (lanes): K rows
 * kr (or kr[0] + i ldk) stored as `kind` (see fa_score_keyrows). */
#define FA_DECODE_SCORES(SUF, KV) \
    if (nr == 8) fa_score_keyrows8_##SUF((const KV* const*)kr, FA_DECODE_SCORES_ARGS); \
    else if (nr == 4) fa_score_keyrows4_##SUF((const KV* const*)kr, FA_DECODE_SCORES_ARGS); \
    else if (nr == 2) fa_score_keyrows2_##SUF((const KV* const*)kr, FA_DECODE_SCORES_ARGS); \
    else fa_score_keyrows1_##SUF((const KV* const*)kr, FA_DECODE_SCORES_ARGS);
#define FA_DECODE_SCORES_ARGS ldk, nk, qt, ldqt, D, scale, s, lds, nstore, pf, pf_bytes
static void fa_decode_scores_f(int kind, int nr, const void* const* kr, ptrdiff_t ldk, int nk,
                               const float* qt, ptrdiff_t ldqt, ptrdiff_t D, float scale,
                               float* s, ptrdiff_t lds, int nstore, const char* const* pf,
                               ptrdiff_t pf_bytes)
{
#define FA_CASE(SUF, KIND, KV) case KIND: FA_DECODE_SCORES(SUF, KV) return;
    switch (kind) { FA_FLOAT_KINDS(FA_CASE) }
#undef FA_CASE
}
static void fa_decode_scores_d(int nr, const void* const* kr, ptrdiff_t ldk, int nk,
                               const double* qt, ptrdiff_t ldqt, ptrdiff_t D, double scale,
                               double* s, ptrdiff_t lds, int nstore, const char* const* pf,
                               ptrdiff_t pf_bytes)
{
    FA_DECODE_SCORES(d, double)
}
#undef FA_DECODE_SCORES_ARGS
#undef FA_DECODE_SCORES

/* npass passes of 4 query rows over a call of 32 16-bit keys (fa_score_gqa4_fh/fb). */
static void fa_decode_scores_gqa4(int kind, const void* const* kr, ptrdiff_t ldk,
                                  const float* qt, ptrdiff_t ldqt, ptrdiff_t D, float scale,
                                  float* s, ptrdiff_t lds, int nstore, const char* const* pf,
                                  ptrdiff_t pf_bytes, int npass)
{
    if (kind == FA_STORE_F16)
        fa_score_gqa4_fh((const uint16_t* const*)kr, ldk, qt, ldqt, D, scale, s, lds, nstore,
                         pf, pf_bytes, npass);
    else
        fa_score_gqa4_fb((const uint16_t* const*)kr, ldk, qt, ldqt, D, scale, s, lds, nstore,
                         pf, pf_bytes, npass);
}

/* One output micro-tile: FA_MR_PV rows (nrows) or a single row, 2 vectors of columns, V
 * rows v + j ldv stored as `kind` (fa_pv_tile, fa_pv_tile1). */
#define FA_OUTPUT_TILE(SUF, KV) \
    if (nrows == FA_MR_PV) fa_pv_tile_##SUF(p, ldp, nj, (const KV*)v, ldv, acc, ldacc, alpha); \
    else fa_pv_tile1_##SUF(p, ldp, nj, (const KV*)v, ldv, acc, ldacc, alpha);
static void fa_output_tile_f(int kind, ptrdiff_t nrows, const float* p, ptrdiff_t ldp,
                             ptrdiff_t nj, const void* v, ptrdiff_t ldv, float* acc,
                             ptrdiff_t ldacc, const float* alpha)
{
#define FA_CASE(SUF, KIND, KV) case KIND: FA_OUTPUT_TILE(SUF, KV) return;
    switch (kind) { FA_FLOAT_KINDS(FA_CASE) }
#undef FA_CASE
}
static void fa_output_tile_d(ptrdiff_t nrows, const double* p, ptrdiff_t ldp, ptrdiff_t nj,
                             const void* v, ptrdiff_t ldv, double* acc, ptrdiff_t ldacc,
                             const double* alpha)
{
    FA_OUTPUT_TILE(d, double)
}
#undef FA_OUTPUT_TILE

/* The wide output tiles: 4 rows x FA_PV4_NV vectors (nr 4) or 1 row x 8 vectors (nr 1),
 * requesting pf_rows rows of pf as they go (fa_pv_rows4, fa_pv_row8). */
#define FA_OUTPUT_WIDE(SUF, KV) \
    if (nr == 4) fa_pv_rows4_##SUF(p, ldp, nj, (const KV*)v, ldv, acc, ldacc, alpha, pf, \
                                   pf_stride, pf_rows, pf_bytes); \
    else fa_pv_row8_##SUF(p, ldp, nj, (const KV*)v, ldv, acc, alpha, pf, pf_stride, pf_rows, \
                          pf_bytes);
static void fa_output_wide_f(int kind, int nr, const float* p, ptrdiff_t ldp, ptrdiff_t nj,
                             const void* v, ptrdiff_t ldv, float* acc, ptrdiff_t ldacc,
                             const float* alpha, const char* pf, ptrdiff_t pf_stride,
                             ptrdiff_t pf_rows, ptrdiff_t pf_bytes)
{
#define FA_CASE(SUF, KIND, KV) case KIND: FA_OUTPUT_WIDE(SUF, KV) return;
    switch (kind) { FA_FLOAT_KINDS(FA_CASE) }
#undef FA_CASE
}
static void fa_output_wide_d(int nr, const double* p, ptrdiff_t ldp, ptrdiff_t nj,
                             const void* v, ptrdiff_t ldv, double* acc, ptrdiff_t ldacc,
                             const double* alpha, const char* pf, ptrdiff_t pf_stride,
                             ptrdiff_t pf_rows, ptrdiff_t pf_bytes)
{
    FA_OUTPUT_WIDE(d, double)
}
#undef FA_OUTPUT_WIDE

/* acc = acc * alpha + P V for nr (1 or 4) rows over all Dv columns, V rows vr[j] stored as
 * `kind` (fa_pv_ptr; quantised kinds: fa_pv_quant with their scales vsc). */
static void fa_output_rows_ptr(int kind, const float* p, ptrdiff_t ldp, ptrdiff_t nj,
                               const void* const* vr, ptrdiff_t Dv, float* acc,
                               ptrdiff_t ldacc, const float* alpha, int nr,
                               const char* const* pf, ptrdiff_t npf)
{
#define FA_CASE(SUF, KIND, KV) \
    case KIND: \
        fa_pv_ptr_##SUF(p, ldp, nj, (const KV* const*)vr, Dv, acc, ldacc, alpha, nr, pf, npf); \
        return;
    switch (kind) { FA_FLOAT_KINDS(FA_CASE) }
#undef FA_CASE
}

/* One score micro-tile of mk (6, or 4 with 2 vectors) keys over nvec (1 or 2) vectors of
 * query rows (fa_score_tile, fa_score_tile4, fa_score_tile1). */
#define FA_SCORE_MICRO(SUF, T) \
    if (nvec == 2 && mk == 4) fa_score_tile4_##SUF((const T* const*)kr, qt, ldqt, D, scale, s, lds); \
    else if (nvec == 2) fa_score_tile_##SUF((const T* const*)kr, qt, ldqt, D, scale, s, lds); \
    else fa_score_tile1_##SUF((const T* const*)kr, qt, ldqt, D, scale, s, lds);
static void fa_score_micro_f(int nvec, ptrdiff_t mk, const void* const* kr, const float* qt,
                             ptrdiff_t ldqt, ptrdiff_t D, float scale, float* s, ptrdiff_t lds)
{
    FA_SCORE_MICRO(f, float)
}
static void fa_score_micro_d(int nvec, ptrdiff_t mk, const void* const* kr, const double* qt,
                             ptrdiff_t ldqt, ptrdiff_t D, double scale, double* s,
                             ptrdiff_t lds)
{
    FA_SCORE_MICRO(d, double)
}
#undef FA_SCORE_MICRO
