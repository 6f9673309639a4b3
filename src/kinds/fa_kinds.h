/*
 * fa_kinds.h -- the storage kinds of q, K, V and the output: one table, read by the
 * kernels, the compiled gates (src/calls/_plan.pxi) and Python (fastattn/_storage/kinds.py,
 * through the extension's storage_kinds()).  Adding a kind is a row here, its loads and stores
 * (fa_half.h, fa_quant.h), and the type number its arrays carry (src/calls/_problem.pxi).
 *
 * Columns:
 *   id            the kind's number in the kernels' switches
 *   name          the kind as users name it (a cache dtype: "q8_0", or a NumPy dtype name)
 *   dtype         the NumPy dtype of the stored array (ml_dtypes' for bfloat16 and fp8)
 *   per_item      values per stored element: q4_0 packs two to a byte, so a row of D
 *                 values is D / 2 bytes
 *   block         values that share one scale (0: no block scales)
 *   scale         FA_SCALE_NONE, FA_SCALE_F16_BLOCK (a float16 scale per block, written
 *                 with the rows), or FA_SCALE_F32_HEAD (a float32 scale per tensor or kv
 *                 head, the caller's)
 *   largest       the largest finite value a stored element holds: fp8's saturation
 *                 point, a block format's largest level, a float format's largest finite
 *   quantisable   the largest |x| a block format stores with a finite float16 scale
 *                 (its largest level times float16's largest); 0 for the others
 */
#ifndef FA_KINDS_H
#define FA_KINDS_H

#define FA_SCALE_NONE 0
#define FA_SCALE_F16_BLOCK 1
#define FA_SCALE_F32_HEAD 2

/*  X(id, number, name,       dtype,           per_item, block, scale,            largest,               quantisable) */
#define FA_STORAGE_KINDS(X) \
    X(FA_STORE_NATIVE, 0, "float32",       "float32",       1, 0,  FA_SCALE_NONE,      3.4028234663852886e38, 0.0) \
    X(FA_STORE_F16,    1, "float16",       "float16",       1, 0,  FA_SCALE_NONE,      65504.0,               0.0) \
    X(FA_STORE_BF16,   2, "bfloat16",      "bfloat16",      1, 0,  FA_SCALE_NONE,      3.3895313892515355e38, 0.0) \
    X(FA_STORE_Q8_0,   3, "q8_0",          "int8",          1, 32, FA_SCALE_F16_BLOCK, 127.0,                 127.0 * 65504.0) \
    X(FA_STORE_Q4_0,   4, "q4_0",          "uint8",         2, 32, FA_SCALE_F16_BLOCK, 8.0,                   8.0 * 65504.0) \
    X(FA_STORE_E4M3,   5, "float8_e4m3fn", "float8_e4m3fn", 1, 0,  FA_SCALE_F32_HEAD,  448.0,                 0.0) \
    X(FA_STORE_E5M2,   6, "float8_e5m2",   "float8_e5m2",   1, 0,  FA_SCALE_F32_HEAD,  57344.0,               0.0)

/* The ids, as constants the preprocessor and switch statements take. */
#define FA_KIND_ID(id, number, ...) enum { id = number };
FA_STORAGE_KINDS(FA_KIND_ID)
#undef FA_KIND_ID
#define FA_N_KINDS 7

typedef struct {
    const char* name;
    const char* dtype;
    int per_item, block, scale;
    double largest, quantisable;
} fa_kind_info;

#define FA_KIND_ROW(id, number, name, dtype, per_item, block, scale, largest, quantisable) \
    {name, dtype, per_item, block, scale, largest, quantisable},
static const fa_kind_info fa_kinds[FA_N_KINDS] = {FA_STORAGE_KINDS(FA_KIND_ROW)};
#undef FA_KIND_ROW

/* Whether a kind is quantised (K or V only), and whether its scales are float16 blocks:
 * the table's scale column, as expressions the compiler folds in the kernels' switches. */
#define FA_QUANTISED(kind) ((kind) >= FA_STORE_Q8_0)
#define FA_BLOCK_SCALED(kind) ((kind) == FA_STORE_Q8_0 || (kind) == FA_STORE_Q4_0)

/* The stored elements of a row of n values. */
static inline ptrdiff_t fa_kind_row_items(int kind, ptrdiff_t n) { return n / fa_kinds[kind].per_item; }

#endif
