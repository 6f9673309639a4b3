# The fused attention kernel.  Included by one tiny .pyx per instruction set
# (_kernel_base.pyx, _kernel_avx2.pyx, _kernel_avx512.pyx), each compiled with its own
# flags; the Python front end (fastattn/_api.py) validates everything and picks the module.
#
# Files:
#   _kernel_decls.pxd    the C micro-kernels (fa_kernels.h) and their fused-type wrappers
#   _tile_pipeline.pxi   one work item through the stages of the fused loop
#   this file            work items over threads, and the Python entry points
#
# Work decomposition
#   One work item = (batch element b, key/value head g, block of FA_BQ query rows).
#   The query rows of a work item are the rows of all Hq/Hkv query heads that share the
#   kv head g (row R -> head g*group + R // Lq, position R % Lq), so a GQA/MQA group reads
#   its K/V once and decode steps of a group fill one tile.  The threads of fastattn's
#   pool (fa_pool.h) claim items one at a time (causal tiles have unequal work).  When
#   there are fewer items than threads and several key chunks (a decode step of batch 1 with few kv
#   heads), every (item, key chunk) pair is a work item instead (flash-decoding).
# Extra memory: one workspace per thread, O(FA_BQ * (D + Dv + FA_BK) + FA_BK * (D + Dv)),
# the last term a key block of 16-bit K/V widened; never O(Lq * Lk), nor a copy of K or V.
# Flash-decoding adds one chunk state per (item, chunk): O(items * Lk / FA_KCHUNK * rows
# * Dv), with fewer items than threads.

from libc.string cimport memset, memcpy
from cpython.mem cimport PyMem_RawMalloc, PyMem_RawFree
from libc.math cimport log, exp2, sqrt, isfinite, INFINITY

cimport numpy as cnp
import numpy as np

from _kernel_decls cimport *

cnp.import_array()

include "_tile_pipeline.pxi"

cdef extern from "fa_pool.h" nogil:
    ctypedef void (*fa_work_fn)(void* ctx, Py_ssize_t w, int tid) noexcept nogil
    const char* FA_POOL_BACKEND
    void fa_pool_run(int n_threads, Py_ssize_t n_work, fa_work_fn fn, void* ctx)
    int fa_pool_workers()
    void fa_pool_set_team(int team)
    int fa_pool_team()
    int fa_pool_set_in_torch(int on)

MASK_NONE = 0
MASK_BOOL = 1
MASK_ADD = 2
CAUSAL_NONE = FA_CAUSAL_NONE
CAUSAL_BOTTOM_RIGHT = FA_CAUSAL_BOTTOM_RIGHT
CAUSAL_TOP_LEFT = FA_CAUSAL_TOP_LEFT
BLOCK_Q = FA_BQ
BLOCK_K = FA_BK

# bfloat16 products for calls whose q, k and v are bfloat16 (fa_bf16dot.h): on where this
# build has them and the CPU runs them, unless FASTATTN_BF16_DOT=0.  Head dims: D even,
# Dv a multiple of two vectors; other calls multiply in float32.
BF16_DOT_BUILT = bool(FA_HAVE_BF16DOT)
BF16_DOT_CPU = bool(fa_cpu_has_bf16dot())
cdef bint _bf16_dot = (BF16_DOT_BUILT and BF16_DOT_CPU
                       and __import__("os").environ.get("FASTATTN_BF16_DOT", "1") != "0")


cdef inline bint _bf16_dot_takes(Py_ssize_t D, Py_ssize_t Dv) noexcept nogil:
    # Pairs of dimensions for the scores, whole 2-vector strips for the output tiles.
    return _bf16_dot and D % 2 == 0 and Dv % (2 * FA_VL_F) == 0


def bf16_dot_takes(Py_ssize_t D, Py_ssize_t Dv):
    """Whether a call whose q, k and v are bfloat16, with head dims D and Dv, multiplies
    in bfloat16 pairs."""
    return _bf16_dot_takes(D, Dv)


def bf16_dot():
    """Whether calls whose q, k and v are bfloat16 multiply in bfloat16 pairs."""
    return _bf16_dot


def set_bf16_dot(bint on):
    """Turn the bfloat16 products on or off (on only where built and supported); returns
    the previous setting."""
    global _bf16_dot
    old = _bf16_dot
    _bf16_dot = on and BF16_DOT_BUILT and BF16_DOT_CPU
    return old


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
        J.pst = _partial_elems(P, vec_lanes(workspace))
        fa_pool_run(n_threads, n_items * nchunk,
                    _job_item_f if floating is float else _job_item_d, &J)
        for item in range(n_items):
            rb = item % n_rblk
            bg = item // n_rblk
            _merge_partials(P, bg // P.Hkv, bg % P.Hkv, rb * FA_BQ, partial + item * nchunk * J.pst,
                            nchunk, workspace)
        return
    fa_pool_run(n_threads, n_items, _job_item_f if floating is float else _job_item_d, &J)


# The last call's workspace block, kept for the next (up to SPARE_MAX bytes): a loop of
# small calls, a decode loop's steps, allocates nothing.  Calls take and return it with the
# GIL held, which makes the hand-over safe (the module does not declare itself safe without
# a GIL, so a free-threaded interpreter keeps one for it); a call that finds it taken or
# too small allocates its own.
cdef enum:
    SPARE_MAX = 1 << 20
cdef char* _spare = NULL
cdef size_t _spare_bytes = 0


cdef char* _take_block(size_t* nbytes) noexcept:
    # A block of at least nbytes[0] bytes (nbytes[0] becomes its size), or NULL.
    global _spare
    cdef char* mem
    if _spare != NULL and _spare_bytes >= nbytes[0]:
        mem, _spare = _spare, NULL
        nbytes[0] = _spare_bytes
        return mem
    return <char*> PyMem_RawMalloc(nbytes[0])


cdef void _return_block(char* mem, size_t nbytes) noexcept:
    # Keep the larger of mem and the spare block within SPARE_MAX; free the other.
    global _spare, _spare_bytes
    if nbytes > SPARE_MAX or (_spare != NULL and _spare_bytes >= nbytes):
        PyMem_RawFree(mem)
        return
    PyMem_RawFree(_spare)
    _spare, _spare_bytes = mem, nbytes


cdef int _run(Problem* P, bint is_float, object threads) except -1:
    """Allocate per-thread workspaces, release the GIL and run the kernel.

    threads: the thread count, or a function returning it, called only when the call has
    more than one work item to share (a single tile of rows and keys runs on one thread).
    """
    cdef Py_ssize_t n_rblk = (P.group * P.Lq + FA_BQ - 1) // FA_BQ
    cdef Py_ssize_t n_items = P.nbatch * P.Hkv * n_rblk
    if n_items == 0:
        return 0
    cdef Py_ssize_t vl = FA_VL_F if is_float else FA_VL_D
    cdef Py_ssize_t nchunk = (P.Lk + FA_KCHUNK - 1) // FA_KCHUNK
    cdef int n_threads = 1
    if type(threads) is int:
        n_threads = threads
    elif n_items * nchunk > 1:
        n_threads = threads()
    # Fewer work items than threads and several key chunks: split the keys (flash-decoding).
    cdef bint split = n_threads > 1 and n_items < n_threads and nchunk >= 2
    # "Not using less, not using more": no idle threads on small problems.
    n_threads = <int> max(1, min(<Py_ssize_t> n_threads, n_items * nchunk if split else n_items))
    cdef Py_ssize_t itemsize = sizeof(float) if is_float else sizeof(double)
    cdef Workspace w
    _carve(&w, P, vl)
    cdef Py_ssize_t ws_elems = w.elems
    cdef size_t ws_bytes = n_threads * ws_elems * itemsize
    cdef size_t idx_bytes = n_threads * 2 * FA_BQ * sizeof(Py_ssize_t)
    # Flash-decoding: one chunk state per (item, chunk).
    cdef size_t part_bytes = 0
    if split:
        part_bytes = n_items * nchunk * _partial_elems(P, vl) * itemsize
    # Allocated here, with the GIL, so that a failure is a MemoryError before any work.
    cdef size_t nbytes = ws_bytes + part_bytes + idx_bytes + 64
    cdef char* mem = _take_block(&nbytes)
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
        _return_block(mem, nbytes)
    return 0


# ---------------------------------------------------------------------------------------
# Describing a call to the kernel.  Both entry points below -- `forward`, for calls the
# Python front end has validated, and `attention_fast`, the lean path of the common case --
# fill the Problem with _fill_problem, addressing arrays in place through kernel_layout's
# rule and the batch offsets of _fill_offsets.
# ---------------------------------------------------------------------------------------

cdef inline bint _kernel_layout(cnp.ndarray a):
    # Contiguous last axis and whole-element strides: the kernel can read it in place.
    cdef int d, nd = cnp.PyArray_NDIM(a)
    cdef Py_ssize_t isz = cnp.PyArray_ITEMSIZE(a)
    if nd == 0:
        return True
    if cnp.PyArray_DIMS(a)[nd - 1] > 1 and cnp.PyArray_STRIDES(a)[nd - 1] != isz:
        return False
    for d in range(nd):
        if cnp.PyArray_STRIDES(a)[d] % isz:
            return False
    return True


def kernel_layout(cnp.ndarray a):
    """Whether the kernel can address ``a`` in place: a contiguous last axis and strides
    that are whole elements (any others, negative or zero included, are fine)."""
    return _kernel_layout(a)


cdef void _fill_offsets(cnp.ndarray a, int n_core, int nb, const Py_ssize_t* bshape,
                        Py_ssize_t nbatch, Py_ssize_t* off) noexcept:
    # Element offset of every flattened batch element of `a` (C order, an odometer over
    # the batch shape bshape[:nb]).  a's axes before its last n_core broadcast against the
    # batch shape: missing or length-1 axes contribute stride 0.
    cdef Py_ssize_t idx[32]
    cdef Py_ssize_t st[32]
    cdef Py_ssize_t cur = 0, b
    cdef Py_ssize_t isz = cnp.PyArray_ITEMSIZE(a)
    cdef int d, ax, own = cnp.PyArray_NDIM(a) - n_core
    for d in range(nb):
        idx[d] = 0
        ax = d - (nb - own)
        st[d] = (cnp.PyArray_STRIDES(a)[ax] // isz
                 if ax >= 0 and cnp.PyArray_DIMS(a)[ax] > 1 else 0)
    for b in range(nbatch):
        off[b] = cur
        d = nb - 1
        while d >= 0:
            idx[d] += 1
            cur += st[d]
            if idx[d] < bshape[d]:
                break
            cur -= idx[d] * st[d]
            idx[d] = 0
            d -= 1


cdef inline int _store_kind(cnp.ndarray a):
    # How the kernel reads (or writes) an array's elements: the compute type itself, or one
    # of the 16-bit types (the front end passes nothing else).
    if cnp.PyArray_ITEMSIZE(a) == 1:
        return FA_STORE_Q8_0
    if cnp.PyArray_ITEMSIZE(a) != 2:
        return FA_STORE_NATIVE
    return FA_STORE_F16 if cnp.PyArray_TYPE(a) == cnp.NPY_FLOAT16 else FA_STORE_BF16


cdef inline bint _computes_float(cnp.ndarray q, cnp.ndarray k, cnp.ndarray v):
    # The compute type of a call: float32 unless an input is float64 (the others are then
    # float64 or 16-bit).
    return not (cnp.PyArray_TYPE(q) == cnp.NPY_FLOAT64 or cnp.PyArray_TYPE(k) == cnp.NPY_FLOAT64
                or cnp.PyArray_TYPE(v) == cnp.NPY_FLOAT64)


cdef inline Py_ssize_t _estride(cnp.ndarray a, int axis):
    # Element stride of an axis counted from the end (-3: heads, -2: rows, -1: columns).
    if cnp.PyArray_NDIM(a) + axis < 0:
        return 0
    return cnp.PyArray_STRIDES(a)[cnp.PyArray_NDIM(a) + axis] // cnp.PyArray_ITEMSIZE(a)


cdef inline Py_ssize_t _dim(cnp.ndarray a, int axis):
    # Length of an axis counted from the end; 1 for a missing heads axis.
    if cnp.PyArray_NDIM(a) + axis < 0:
        return 1
    return cnp.PyArray_DIMS(a)[cnp.PyArray_NDIM(a) + axis]


# Batch offsets of up to 8 batch elements live in the caller's frame, not on the heap.
cdef enum:
    SMALL_OFFSETS = 56


cdef inline void _free_offsets(Py_ssize_t* offs, Py_ssize_t* small) noexcept:
    if offs != small:
        PyMem_RawFree(offs)


cdef Py_ssize_t* _fill_problem(Problem* P, cnp.ndarray q, cnp.ndarray k, cnp.ndarray v,
                               cnp.ndarray out, object lse, object mask, int mask_kind,
                               int nb, const Py_ssize_t* bshape, const Py_ssize_t* kv_len,
                               int causal, Py_ssize_t wl, Py_ssize_t wr,
                               double scale, Py_ssize_t* small) except NULL:
    # The Problem of a call on arrays the kernel can address in place: q, k, v, out with
    # (heads, rows, columns) last (heads may be missing: one head), lse (heads, rows) last,
    # mask (heads, rows, keys) last, all broadcasting over the batch shape bshape[:nb].
    # kv_len: one length per batch element, or NULL for Lk everywhere.  Returns the block
    # of batch offsets: `small` (the caller's SMALL_OFFSETS elements) when they fit, else
    # one it allocates (the caller frees it with _free_offsets).
    cdef Py_ssize_t nbatch = 1, d
    for d in range(nb):
        nbatch *= bshape[d]
    cdef Py_ssize_t n = max(nbatch, 1)
    cdef Py_ssize_t* offs = small
    if 7 * n > SMALL_OFFSETS:
        offs = <Py_ssize_t*> PyMem_RawMalloc(7 * n * sizeof(Py_ssize_t))
        if offs == NULL:
            raise MemoryError("fastattn: cannot allocate batch offsets")
    cdef cnp.ndarray lse_a, mask_a
    _fill_offsets(q, 3, nb, bshape, nbatch, offs)
    _fill_offsets(k, 3, nb, bshape, nbatch, offs + n)
    _fill_offsets(v, 3, nb, bshape, nbatch, offs + 2 * n)
    _fill_offsets(out, 3, nb, bshape, nbatch, offs + 3 * n)
    memset(offs + 4 * n, 0, 2 * n * sizeof(Py_ssize_t))
    P.q = <char*> cnp.PyArray_DATA(q)
    P.k = <char*> cnp.PyArray_DATA(k)
    P.v = <char*> cnp.PyArray_DATA(v)
    P.out = <char*> cnp.PyArray_DATA(out)
    P.q_boff, P.k_boff, P.v_boff, P.o_boff = offs, offs + n, offs + 2 * n, offs + 3 * n
    P.lse_boff, P.m_boff, P.kv_len = offs + 4 * n, offs + 5 * n, offs + 6 * n
    for d in range(nbatch):
        offs[6 * n + d] = kv_len[d] if kv_len != NULL else _dim(k, -2)
    P.nbatch = nbatch
    P.Hq, P.Hkv = _dim(q, -3), _dim(k, -3)
    P.group = P.Hq // P.Hkv
    P.Lq, P.Lk, P.D, P.Dv = _dim(q, -2), _dim(k, -2), _dim(q, -1), _dim(v, -1)
    P.q_isz, P.k_isz = cnp.PyArray_ITEMSIZE(q), cnp.PyArray_ITEMSIZE(k)
    P.v_isz, P.o_isz = cnp.PyArray_ITEMSIZE(v), cnp.PyArray_ITEMSIZE(out)
    P.q_kind, P.k_kind, P.v_kind, P.o_kind = (_store_kind(q), _store_kind(k), _store_kind(v),
                                              _store_kind(out))
    P.q_sh, P.q_si = _estride(q, -3), _estride(q, -2)
    P.k_sh, P.k_sj = _estride(k, -3), _estride(k, -2)
    P.v_sh, P.v_sj = _estride(v, -3), _estride(v, -2)
    P.o_sh, P.o_si = _estride(out, -3), _estride(out, -2)
    P.lse = NULL
    P.lse_sh = P.lse_si = 0
    if lse is not None:
        lse_a = lse
        _fill_offsets(lse_a, 2, nb, bshape, nbatch, offs + 4 * n)
        P.lse = <char*> cnp.PyArray_DATA(lse_a)
        P.lse_sh, P.lse_si = _estride(lse_a, -2), _estride(lse_a, -1)
    P.mask = NULL
    P.mask_kind = mask_kind
    P.m_sh = P.m_si = P.m_sj = 0
    if mask is not None:
        mask_a = mask
        _fill_offsets(mask_a, 3, nb, bshape, nbatch, offs + 5 * n)
        P.mask = <char*> cnp.PyArray_DATA(mask_a)
        P.m_sh, P.m_si, P.m_sj = _estride(mask_a, -3), _estride(mask_a, -2), _estride(mask_a, -1)
    P.causal = causal
    P.wl, P.wr = wl, wr
    P.scale = scale
    P.softcap = 0
    P.alibi = P.sinks = NULL
    P.q_len = NULL
    P.packed = False
    P.backward = False
    P.block_table = NULL
    P.bt_stride = P.page = P.k_pst = P.v_pst = 0
    P.k_scale = P.v_scale = NULL
    P.ks_pst = P.ks_sh = P.ks_sj = P.vs_pst = P.vs_sh = P.vs_sj = 0
    P.bf16_dot = (P.q_kind == FA_STORE_BF16 and P.k_kind == FA_STORE_BF16
                  and P.v_kind == FA_STORE_BF16 and _bf16_dot_takes(P.D, P.Dv))
    return offs


cdef const void* _data_or_null(object a):
    # The data of a C-contiguous array prepared by the front end, or NULL for None.
    cdef cnp.ndarray arr
    if a is None:
        return NULL
    arr = a
    return cnp.PyArray_DATA(arr)


def forward(cnp.ndarray q, cnp.ndarray k, cnp.ndarray v, cnp.ndarray out, object lse,
            object mask, int mask_kind, tuple batch, cnp.ndarray kv_len,
            int causal, Py_ssize_t wl, Py_ssize_t wr, double scale, int n_threads,
            double softcap=0, object alibi=None, object sinks=None, object q_len=None):
    """Run the fused kernel on validated arrays (called only by fastattn._api).

    q, k, v, out: the compute dtype (float32/float64) or, read and written in place,
    float16 / bfloat16 (out only with float32 compute), (..., heads, rows, cols) with a
    contiguous last axis (kernel_layout), their batch axes broadcasting to ``batch``.
    lse: None or (..., Hq, Lq) of the compute dtype; mask: None, a uint8 view of a bool
    mask or an array of the compute dtype, (..., Hq, Lq, Lk) broadcasting likewise.
    kv_len: intp, one length per flattened batch element.  softcap: 0 for none.  alibi,
    sinks: None or C-contiguous float64 (nbatch, Hq); q_len: None or intp (nbatch,).
    No validation happens here.
    """
    cdef Py_ssize_t bshape[32]
    cdef int nb = len(batch), d
    for d in range(nb):
        bshape[d] = batch[d]
    _execute(q, k, v, out, lse, mask, mask_kind, nb, bshape,
             <const Py_ssize_t*> cnp.PyArray_DATA(kv_len), causal, wl, wr, scale, n_threads,
             softcap, alibi, sinks, q_len)


cdef inline int _execute(cnp.ndarray q, cnp.ndarray k, cnp.ndarray v, cnp.ndarray out, object lse,
                  object mask, int mask_kind, int nb, const Py_ssize_t* bshape,
                  const Py_ssize_t* kv_len, int causal, Py_ssize_t wl, Py_ssize_t wr,
                  double scale, object n_threads, double softcap, object alibi, object sinks,
                  object q_len) except -1:
    # The run step of both call paths: the Problem of prepared arrays, then the kernel.
    cdef Problem P
    cdef Py_ssize_t small[SMALL_OFFSETS]
    cdef Py_ssize_t* offs = _fill_problem(&P, q, k, v, out, lse, mask, mask_kind, nb, bshape,
                                          kv_len, causal, wl, wr, scale, small)
    P.softcap = softcap
    P.alibi = <const double*> _data_or_null(alibi)
    P.sinks = <const double*> _data_or_null(sinks)
    P.q_len = <const Py_ssize_t*> _data_or_null(q_len)
    try:
        _run(&P, _computes_float(q, k, v), n_threads)
    finally:
        _free_offsets(offs, small)
    return 0


def forward_packed(cnp.ndarray q, cnp.ndarray k, cnp.ndarray v, cnp.ndarray out, object lse,
                   cnp.ndarray cu_q, cnp.ndarray cu_k, int causal, Py_ssize_t wl, Py_ssize_t wr,
                   double scale, int n_threads, double softcap=0, object alibi=None,
                   object sinks=None):
    """Run the fused kernel on packed sequences (called only by fastattn._api).

    q (Hq, total_q, D), k (Hkv, total_k, D), v (Hkv, total_k, Dv), out (Hq, total_q, Dv),
    lse None or (Hq, total_q), in the compute dtype (q, k, v, out may be 16-bit, as in
    forward) with a contiguous last axis; cu_q, cu_k:
    intp (n_seq + 1,) offsets.  Sequence s is a batch element whose rows and keys start at
    cu_q[s] and cu_k[s]; its q_len and kv_len are its lengths.  alibi, sinks: None or
    float64 (n_seq, Hq).  No validation happens here.
    """
    cdef Problem P
    cdef Py_ssize_t small[SMALL_OFFSETS]
    cdef cnp.ndarray lens = np.empty(2 * max(cu_q.shape[0] - 1, 1), dtype=np.intp)
    cdef Py_ssize_t* offs = _fill_packed(&P, q, k, v, out, lse, cu_q, cu_k, causal, wl, wr,
                                         scale, softcap, alibi, sinks, lens, small)
    try:
        _run(&P, _computes_float(q, k, v), n_threads)
    finally:
        _free_offsets(offs, small)


cdef Py_ssize_t* _fill_packed(Problem* P, cnp.ndarray q, cnp.ndarray k, cnp.ndarray v,
                              cnp.ndarray out, object lse, cnp.ndarray cu_q, cnp.ndarray cu_k,
                              int causal, Py_ssize_t wl, Py_ssize_t wr, double scale,
                              double softcap, object alibi, object sinks, cnp.ndarray lens,
                              Py_ssize_t* small) except NULL:
    # The Problem of a call on packed sequences (see forward_packed); lens: intp, 2 per
    # sequence (at least 2), kept alive by the caller, gets their kv and q lengths.
    cdef Py_ssize_t n = cu_q.shape[0] - 1, s, Lq = 0, Lk = 0
    cdef const Py_ssize_t* cq = <const Py_ssize_t*> cnp.PyArray_DATA(cu_q)
    cdef const Py_ssize_t* ck = <const Py_ssize_t*> cnp.PyArray_DATA(cu_k)
    cdef Py_ssize_t* kv_len = <Py_ssize_t*> cnp.PyArray_DATA(lens)
    cdef Py_ssize_t* q_len = kv_len + max(n, 1)
    for s in range(n):
        kv_len[s] = ck[s + 1] - ck[s]
        q_len[s] = cq[s + 1] - cq[s]
        Lq = max(Lq, q_len[s])
        Lk = max(Lk, kv_len[s])
    cdef Py_ssize_t bshape[1]
    bshape[0] = n
    cdef Py_ssize_t* offs = _fill_problem(P, q, k, v, out, lse, None, 0, 1, bshape, kv_len,
                                          causal, wl, wr, scale, small)
    cdef Py_ssize_t m = max(n, 1)
    for s in range(n):
        offs[s] = cq[s] * P.q_si
        offs[m + s] = ck[s] * P.k_sj
        offs[2 * m + s] = ck[s] * P.v_sj
        offs[3 * m + s] = cq[s] * P.o_si
        offs[4 * m + s] = cq[s] * P.lse_si
    P.Lq, P.Lk = Lq, Lk
    P.q_len = q_len
    P.packed = True
    P.softcap = softcap
    P.alibi = <const double*> _data_or_null(alibi)
    P.sinks = <const double*> _data_or_null(sinks)
    return offs


def forward_kvcache(cnp.ndarray q, cnp.ndarray k_cache, cnp.ndarray v_cache, cnp.ndarray out,
                    object lse, cnp.ndarray kv_len, object block_table, object k_scale,
                    object v_scale, int causal, Py_ssize_t wl, Py_ssize_t wr, double scale,
                    int n_threads, double softcap=0, object alibi=None, object sinks=None):
    """Run the fused kernel over KV caches (called only by fastattn._kvcache_attn).

    q (B, Hq, Lq, D) and out (B, Hq, Lq, Dv) as in forward; lse None or (B, Hq, Lq).  The
    caches: (B, Hkv, Lmax, D / Dv), or with block_table (int32 (B, max_pages), rows
    contiguous) pages (num_pages, Hkv, page, D / Dv), any strides with a contiguous last
    axis; float32 (float64 with float64 q), float16, bfloat16, or int8 for q8_0 with
    k_scale / v_scale: uint16 views of their float16 scales, shaped like the cache with
    D / 32 in the last axis (contiguous).  kv_len: intp (B,), the keys each sequence
    attends over.  No validation happens here.
    """
    cdef Problem P
    cdef Py_ssize_t small[SMALL_OFFSETS]
    cdef Py_ssize_t bshape[1]
    cdef Py_ssize_t nb = cnp.PyArray_DIMS(q)[0], b
    cdef cnp.ndarray bt, sc
    cdef const Py_ssize_t* lens = <const Py_ssize_t*> cnp.PyArray_DATA(kv_len)
    bshape[0] = nb
    cdef Py_ssize_t* offs = _fill_problem(&P, q, k_cache, v_cache, out, lse, None, 0, 1,
                                          bshape, lens, causal, wl, wr, scale, small)
    try:
        P.softcap = softcap
        P.alibi = <const double*> _data_or_null(alibi)
        P.sinks = <const double*> _data_or_null(sinks)
        P.Lk = 0
        for b in range(nb):
            P.Lk = max(P.Lk, lens[b])
        if block_table is not None:
            bt = block_table
            P.block_table = <const int32_t*> cnp.PyArray_DATA(bt)
            P.bt_stride = cnp.PyArray_DIMS(bt)[1]
            P.page = _dim(k_cache, -2)
            P.k_pst = cnp.PyArray_STRIDES(k_cache)[0] // P.k_isz
            P.v_pst = cnp.PyArray_STRIDES(v_cache)[0] // P.v_isz
            for b in range(nb):   # unused: pages come from the block table
                offs[max(nb, 1) + b] = offs[2 * max(nb, 1) + b] = 0
        if k_scale is not None:
            sc = k_scale
            P.k_scale = <const uint16_t*> cnp.PyArray_DATA(sc)
            P.ks_pst, P.ks_sh, P.ks_sj = (cnp.PyArray_STRIDES(sc)[0] // 2, _estride(sc, -3),
                                          _estride(sc, -2))
        if v_scale is not None:
            sc = v_scale
            P.v_scale = <const uint16_t*> cnp.PyArray_DATA(sc)
            P.vs_pst, P.vs_sh, P.vs_sj = (cnp.PyArray_STRIDES(sc)[0] // 2, _estride(sc, -3),
                                          _estride(sc, -2))
        _run(&P, _computes_float(q, k_cache, v_cache), n_threads)
    finally:
        _free_offsets(offs, small)


include "_backward.pxi"


def key_intervals(Py_ssize_t Lq, cnp.ndarray kv_len, int causal, Py_ssize_t wl, Py_ssize_t wr,
                  object q_len=None):
    """Visible key interval [lo, hi) of every query row, shape (len(kv_len), Lq) each.

    The kernel's own rule (fa_key_interval), exported for attention_weights.  q_len: None
    or intp (len(kv_len),), the real query rows of each batch element (alignment uses it;
    rows past it see nothing).
    """
    cdef Py_ssize_t nb = kv_len.shape[0], b, i, ql
    cdef cnp.ndarray lo = np.empty((nb, Lq), dtype=np.intp)
    cdef cnp.ndarray hi = np.empty((nb, Lq), dtype=np.intp)
    cdef Py_ssize_t* plo = <Py_ssize_t*> cnp.PyArray_DATA(lo)
    cdef Py_ssize_t* phi = <Py_ssize_t*> cnp.PyArray_DATA(hi)
    cdef const Py_ssize_t* pkv = <const Py_ssize_t*> cnp.PyArray_DATA(kv_len)
    cdef const Py_ssize_t* pql = <const Py_ssize_t*> _data_or_null(q_len)
    for b in range(nb):
        ql = pql[b] if pql != NULL else Lq
        for i in range(Lq):
            if i < ql:
                fa_key_interval(i, ql, pkv[b], causal, wl, wr, &plo[b * Lq + i], &phi[b * Lq + i])
            else:
                plo[b * Lq + i] = phi[b * Lq + i] = 0
    return lo, hi


def vector_tanh(cnp.ndarray x):
    """The kernel's float32 vector tanh (softcap) on a contiguous float32 array."""
    cdef cnp.ndarray y = np.empty_like(x)
    fa_tanh_array_f(<const float*> cnp.PyArray_DATA(x), <float*> cnp.PyArray_DATA(y), x.size)
    return y


def vector_exp2(cnp.ndarray x, bint lanes8=False):
    """The kernel's vector 2**x on a contiguous float32/float64 array (for accuracy tests);
    lanes8: float32 through the 8-lane version of the decode kernels instead."""
    cdef cnp.ndarray y = np.empty_like(x)
    if x.dtype == np.float32 and lanes8:
        fa_exp2_array_f8(<const float*> cnp.PyArray_DATA(x), <float*> cnp.PyArray_DATA(y), x.size)
    elif x.dtype == np.float32:
        fa_exp2_array_f(<const float*> cnp.PyArray_DATA(x), <float*> cnp.PyArray_DATA(y), x.size)
    else:
        fa_exp2_array_d(<const double*> cnp.PyArray_DATA(x), <double*> cnp.PyArray_DATA(y), x.size)
    return y


def vector_widen(cnp.ndarray x, str kind):
    """The kernel's widening of a contiguous uint16 array of float16 or bfloat16 bits
    (kind "float16" / "bfloat16") to float32 (for tests)."""
    cdef cnp.ndarray y = np.empty(x.size, dtype=np.float32)
    fa_widen_array_f(FA_STORE_F16 if kind == "float16" else FA_STORE_BF16,
                     <const uint16_t*> cnp.PyArray_DATA(x), <float*> cnp.PyArray_DATA(y), x.size)
    return y


def vector_narrow(cnp.ndarray x, str kind):
    """The kernel's rounding of a contiguous float32 array to float16 or bfloat16 bits,
    returned as uint16 (for tests)."""
    cdef cnp.ndarray y = np.empty(x.size, dtype=np.uint16)
    fa_narrow_array_f(FA_STORE_F16 if kind == "float16" else FA_STORE_BF16,
                      <const float*> cnp.PyArray_DATA(x), <uint16_t*> cnp.PyArray_DATA(y), x.size)
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
        "fma": bool(FA_HAS_FMA),
    }


def omp_max_threads():
    """OpenMP's default team size (honours OMP_NUM_THREADS); 1 without OpenMP."""
    return fa_omp_max_threads()


def pool_info():
    """The thread pool behind the kernels: its backend, how many workers it started, and
    which calls run on an OpenMP team instead (see pool_set_team)."""
    return {"backend": FA_POOL_BACKEND.decode(), "workers": fa_pool_workers(),
            "team": POOL_TEAMS[fa_pool_team()]}


POOL_TEAMS = ("never", "always", "in torch")


def pool_set_team(str team):
    """Which calls run on the calling thread's OpenMP team instead of the pool: one of
    POOL_TEAMS (the pthreads pool in a build with OpenMP; elsewhere always "never")."""
    fa_pool_set_team(POOL_TEAMS.index(team))


def pool_set_in_torch(bint on):
    """Mark this thread's next calls as made from fastattn's torch integrations (or not);
    returns the previous mark."""
    return fa_pool_set_in_torch(on)


def cpu_supports(str isa):
    """Whether the running CPU can execute the named variant ("sse2", "avx2", "avx512")."""
    return bool(fa_cpu_supports(isa.encode()))


# ---------------------------------------------------------------------------------------
# The lean call path.  fastattn.attention() first offers its arguments here.  This path
# is a gate: it only answers "is this the common case?" -- ndarrays in native byte order
# of float32, float16 or bfloat16 in any mix, or all float64; no mask, window, lengths or
# score modifier (attention sinks of one batch element are taken); no broadcasting of the
# batch dims; layouts the kernel reads in place -- and runs such a call through the same
# run step as the validated path (_execute), in about a microsecond of overhead.  Anything
# else, including every *invalid* call, returns None, and the Python front end checks it
# with its error messages.  So it never raises for bad input; tests check that whatever it
# takes gives the validated path's bits.
# ---------------------------------------------------------------------------------------

cdef inline bint _extent_overlap(cnp.ndarray a, cnp.ndarray b):
    # Whether the byte ranges spanned by two arrays intersect (conservative).
    cdef char* a_lo
    cdef char* a_hi
    cdef char* b_lo
    cdef char* b_hi
    if cnp.PyArray_SIZE(a) == 0 or cnp.PyArray_SIZE(b) == 0:
        return False
    _extent(a, &a_lo, &a_hi)
    _extent(b, &b_lo, &b_hi)
    return a_lo < b_hi and b_lo < a_hi


cdef inline void _extent(cnp.ndarray a, char** lo, char** hi):
    # The first byte of an array's span and one past its last.
    cdef int d
    cdef Py_ssize_t n, st
    lo[0] = hi[0] = <char*> cnp.PyArray_DATA(a)
    for d in range(cnp.PyArray_NDIM(a)):
        n = cnp.PyArray_DIMS(a)[d]
        st = cnp.PyArray_STRIDES(a)[d]
        if st < 0:
            lo[0] += (n - 1) * st
        else:
            hi[0] += (n - 1) * st
    hi[0] += cnp.PyArray_ITEMSIZE(a)


cdef int _NPY_BFLOAT16 = -1   # ml_dtypes.bfloat16's type number, once an array has it


cdef inline int _lean_type(cnp.ndarray a):
    # The type number of an array the lean path takes (float32/64, float16, bfloat16 in
    # native byte order), or -1.  bfloat16 is a user-defined type whose number is learnt
    # from the first array of that dtype (without importing ml_dtypes).
    global _NPY_BFLOAT16
    cdef int t = cnp.PyArray_TYPE(a)
    if not cnp.PyArray_ISNOTSWAPPED(a):
        return -1
    if t == cnp.NPY_FLOAT32 or t == cnp.NPY_FLOAT64 or t == cnp.NPY_FLOAT16:
        return t
    if t == _NPY_BFLOAT16:
        return t
    if _NPY_BFLOAT16 < 0 and cnp.PyArray_ITEMSIZE(a) == 2 and a.dtype.kind == "V":
        if a.dtype.name == "bfloat16" and a.dtype.type.__module__.split(".")[0] == "ml_dtypes":
            _NPY_BFLOAT16 = t
            return t
    return -1


cdef inline bint _lean_dtypes(cnp.ndarray q, cnp.ndarray k, cnp.ndarray v, int* result,
                              int* compute):
    # q, k, v all float64, or each float32 / float16 / bfloat16 (computed in float32; the
    # result is 16-bit only when all three share that dtype).
    cdef int tq = _lean_type(q), tk = _lean_type(k), tv = _lean_type(v)
    if tq < 0 or tk < 0 or tv < 0:
        return False
    cdef int n64 = (tq == cnp.NPY_FLOAT64) + (tk == cnp.NPY_FLOAT64) + (tv == cnp.NPY_FLOAT64)
    if n64 != 0 and n64 != 3:
        return False
    result[0] = tq if tq == tk == tv else cnp.NPY_FLOAT32
    compute[0] = cnp.NPY_FLOAT64 if n64 else cnp.NPY_FLOAT32
    return True


cdef inline bint _lean_shapes(cnp.ndarray q, cnp.ndarray k, cnp.ndarray v):
    # Same batch dims everywhere (no broadcasting), consistent (H, L, D) and GQA heads,
    # and rows the kernel addresses in place.
    cdef int nd = cnp.PyArray_NDIM(q), d
    if nd < 2 or nd > 32 or cnp.PyArray_NDIM(k) != nd or cnp.PyArray_NDIM(v) != nd:
        return False
    cdef cnp.npy_intp* qs = cnp.PyArray_DIMS(q)
    cdef cnp.npy_intp* ks = cnp.PyArray_DIMS(k)
    cdef cnp.npy_intp* vs = cnp.PyArray_DIMS(v)
    for d in range(nd - 3):
        if ks[d] != qs[d] or vs[d] != qs[d]:
            return False
    cdef Py_ssize_t Hq = qs[nd - 3] if nd >= 3 else 1
    cdef Py_ssize_t Hkv = ks[nd - 3] if nd >= 3 else 1
    if ks[nd - 1] != qs[nd - 1] or vs[nd - 2] != ks[nd - 2] or (nd >= 3 and vs[nd - 3] != Hkv):
        return False
    if Hkv == 0 or Hq % Hkv:
        return False
    return _kernel_layout(q) and _kernel_layout(k) and _kernel_layout(v)


cdef inline bint _lean_scale(object scale, Py_ssize_t D, double* sc):
    # A Python float or int that the front end would take as it is; None is 1/sqrt(D).
    if scale is None:
        if D == 0:
            return False
        sc[0] = 1.0 / sqrt(<double> D)
    elif type(scale) is float:
        sc[0] = scale
        return isfinite(sc[0])
    elif type(scale) is int and -2**53 <= scale <= 2**53:
        sc[0] = scale
    else:
        return False
    return True


cdef inline bint _lean_causal(object causal, int* mode):
    # Only the bools themselves; the strings and NumPy bools go to the front end.
    if causal is False:
        mode[0] = FA_CAUSAL_NONE
    elif causal is True:
        mode[0] = FA_CAUSAL_BOTTOM_RIGHT
    else:
        return False
    return True


cdef object _lean_sinks(object sinks, Py_ssize_t Hq, int nb, const cnp.npy_intp* qs):
    # Attention sinks the lean path takes: a native float32/float64 array of Hq finite or
    # -inf logits, one batch element; as contiguous float64, or None when not taken.
    cdef cnp.ndarray s
    cdef const double* x
    cdef Py_ssize_t h
    cdef int d
    if type(sinks) is not np.ndarray:
        return None
    s = sinks
    if cnp.PyArray_NDIM(s) != 1 or cnp.PyArray_DIMS(s)[0] != Hq or not cnp.PyArray_ISNOTSWAPPED(s):
        return None
    if cnp.PyArray_TYPE(s) != cnp.NPY_FLOAT64 and cnp.PyArray_TYPE(s) != cnp.NPY_FLOAT32:
        return None
    for d in range(nb):
        if qs[d] != 1:
            return None
    s = np.ascontiguousarray(s, dtype=np.float64)
    x = <const double*> cnp.PyArray_DATA(s)
    for h in range(Hq):
        if x[h] != x[h] or x[h] == INFINITY:   # NaN, +inf: the front end's error
            return None
    return s


cdef inline object _lean_out(object out, cnp.ndarray q, cnp.ndarray k, cnp.ndarray v,
                            int typenum):
    # The result array: a new one, or the caller's `out` when it is exactly the result's
    # type and shape, writeable, addressable in place and clear of the inputs; None when
    # `out` needs the front end.
    cdef int nd = cnp.PyArray_NDIM(q), d
    cdef cnp.npy_intp shape[32]
    cdef cnp.ndarray oa
    memcpy(shape, cnp.PyArray_DIMS(q), (nd - 1) * sizeof(cnp.npy_intp))
    shape[nd - 1] = cnp.PyArray_DIMS(v)[nd - 1]
    if out is None:
        if typenum == _NPY_BFLOAT16:
            return np.empty([shape[d] for d in range(nd)], dtype=q.dtype)
        return cnp.PyArray_EMPTY(nd, shape, typenum, 0)
    if type(out) is not cnp.ndarray:
        return None
    oa = out
    if cnp.PyArray_TYPE(oa) != typenum or cnp.PyArray_NDIM(oa) != nd:
        return None
    for d in range(nd):
        if cnp.PyArray_DIMS(oa)[d] != shape[d]:
            return None
    if not (cnp.PyArray_ISWRITEABLE(oa) and cnp.PyArray_ISNOTSWAPPED(oa) and _kernel_layout(oa)):
        return None
    if _extent_overlap(oa, q) or _extent_overlap(oa, k) or _extent_overlap(oa, v):
        return None
    return oa


def attention_fast(q, k, v, scale, causal, bint return_lse, out, n_threads, sinks=None):
    """The lean path of fastattn.attention (see above); None means "not handled here".

    n_threads: the thread count, or a function returning it (see _run).
    """
    # cnp.ndarray is the C type object: no module attribute lookups.
    if type(q) is not cnp.ndarray or type(k) is not cnp.ndarray or type(v) is not cnp.ndarray:
        return None
    cdef cnp.ndarray qa = q, ka = k, va = v, oa, la = None
    cdef int typenum, compute, causal_mode, nd = cnp.PyArray_NDIM(qa), d
    cdef double sc
    if not (_lean_dtypes(qa, ka, va, &typenum, &compute) and _lean_shapes(qa, ka, va)):
        return None
    cdef int nb = nd - 3 if nd >= 3 else 0
    cdef cnp.npy_intp* qs = cnp.PyArray_DIMS(qa)
    if not (_lean_scale(scale, qs[nd - 1], &sc) and _lean_causal(causal, &causal_mode)):
        return None
    cdef object sinks64 = None
    if sinks is not None:
        sinks64 = _lean_sinks(sinks, qs[nd - 3] if nd >= 3 else 1, nb, qs)
        if sinks64 is None:
            return None
    res = _lean_out(out, qa, ka, va, typenum)
    if res is None:
        return None
    oa = res
    if return_lse:
        la = cnp.PyArray_EMPTY(nd - 1, qs, compute, 0)
    cdef Py_ssize_t bshape[32]
    for d in range(nb):
        bshape[d] = qs[d]
    _execute(qa, ka, va, oa, la, None, 0, nb, bshape, NULL, causal_mode, -1, -1, sc,
             n_threads, 0.0, None, sinks64, None)
    return (oa, la) if return_lse else oa
