# Plan once, run every layer: the compiled half of fastattn's KVCachePlan
# (fastattn/_serving/kvcache.py).
#
# A decode step calls attention once per layer over caches that share everything but
# their arrays: the lengths, the block table, the rotary tables and the score modifiers.
# The Python plan checks those once and hands them here (_configure); KVCachePlanBase.run
# then checks only what may differ between layers -- the arrays' types, shapes, strides
# and writability, the pool's size against the pages in use, the new values -- appends
# the new rows (rotated, rounded or quantised: fa_append.h) and runs the kernel, all in
# C.  Like the lean gate of attention(), it is a gate: anything it does not take,
# including every invalid call, goes to the plan's checked path (_run_checked) before
# anything is written, and that path raises the clear error or computes the same bits.
#
# The run decides nothing that the checked path decides: a batch of another size, or pages
# not yet checked for a page size and a count of new rows, are resolved in Python (the
# batch's lengths, the span of the pages in use: KVCachePlan._resolve) once, before the
# gate is tried again; what still does not fit goes to the checked path.  The kernel and
# the appends never call back into Python.
#
# Thread safety: run reads the plan's arrays into locals (references) with the GIL held,
# and the kernel runs without it, so several Python threads may run one plan at once.

cdef extern from "fa_append.h" nogil:
    void fa_load_row(int kind, const char* src, Py_ssize_t stride, Py_ssize_t n, float* dst)
    void fa_rotate_row(float* x, const float* cos, const float* sin, Py_ssize_t half,
                       int interleaved)
    void fa_round_row(int kind, float* x, Py_ssize_t n)
    int fa_store_row(int kind, const float* x, Py_ssize_t n, char* dst)
    void fa_prefetch_for_store(char* p, Py_ssize_t bytes)
    int fa_quantize_row(int kind, const float* x, Py_ssize_t n, char* qs, uint16_t* ds,
                        float fscale)


cdef struct Rows:
    # New rows of one array (k or v): (B, Hkv, Lnew, cols) at `data` with byte strides,
    # in storage kind `kind`; `dst` the cache, `scale` its float16 block scales (q8_0,
    # q4_0) or NULL, `fscale` its fp8 scales (one per kv head, fs_sh elements apart).
    const char* data
    Py_ssize_t sb, sh, si, sc
    int kind
    Py_ssize_t cols
    char* dst
    Py_ssize_t db, dh, di                 # the cache's byte strides (page or batch, head, row)
    int dst_kind                          # FA_STORE_NATIVE (float32), F16, BF16, or quantised
    Py_ssize_t dst_row                    # bytes of one stored row
    char* scale
    Py_ssize_t ssb, ssh, ssi              # the scales' byte strides
    const float* fscale
    Py_ssize_t fs_sh


cdef inline int _float_kind(cnp.ndarray a) noexcept:
    # The storage kind of a float32 / float16 / bfloat16 array in native order, or -1
    # (float64 and everything else go to the checked path).
    cdef int t = _lean_type(a)
    if t == cnp.NPY_FLOAT32:
        return FA_STORE_NATIVE
    if t == cnp.NPY_FLOAT16:
        return FA_STORE_F16
    if t >= 0 and t == _NPY_BFLOAT16:
        return FA_STORE_BF16
    return -1


cdef int _cache_kind(cnp.ndarray a):
    # The storage kind of a cache in native order: float32 / float16 / bfloat16, or one
    # byte a value (_byte_kind: q8_0, q4_0, fp8); else -1.
    if cnp.PyArray_ITEMSIZE(a) != 1:
        return _float_kind(a)
    return _byte_kind(a)


cdef inline Py_ssize_t _row_values(int kind, cnp.ndarray cache) noexcept:
    # The values in a row of a cache of storage kind `kind` (q4_0 holds two a byte).
    return cnp.PyArray_DIM(cache, 3) * fa_kinds[kind].per_item


cdef inline bint _is_array(object a) noexcept:
    return type(a) is cnp.ndarray


cdef bint _shape_is(cnp.ndarray a, Py_ssize_t d0, Py_ssize_t d1, Py_ssize_t d2,
                    Py_ssize_t d3) noexcept:
    # a is 4-d of shape (d0, d1, d2, d3); -1 takes any length on that axis.
    cdef const cnp.npy_intp* s = cnp.PyArray_DIMS(a)
    if cnp.PyArray_NDIM(a) != 4:
        return False
    return ((d0 < 0 or s[0] == d0) and (d1 < 0 or s[1] == d1) and (d2 < 0 or s[2] == d2)
            and (d3 < 0 or s[3] == d3))


cdef bint _scales_fit(object s, cnp.ndarray cache, int kind, bint write) noexcept:
    # The block scales of a q8_0 or q4_0 cache: float16 of shape cache.shape[:-1] +
    # (D // block,), rows the kernel reads in place, writeable when rows are appended.
    cdef cnp.ndarray a
    cdef Py_ssize_t D = _row_values(kind, cache), block = fa_kinds[kind].block
    if not _is_array(s):
        return False
    a = s
    if cnp.PyArray_TYPE(a) != cnp.NPY_FLOAT16 or not cnp.PyArray_ISNOTSWAPPED(a):
        return False
    if D % block or not _shape_is(a, cnp.PyArray_DIM(cache, 0), cnp.PyArray_DIM(cache, 1),
                                  cnp.PyArray_DIM(cache, 2), D // block):
        return False
    return _kernel_layout(a) and (not write or cnp.PyArray_ISWRITEABLE(a))


cdef object _fp8_scales(object s, Py_ssize_t Hkv, float top):
    # An fp8 cache's scales as the kernel reads them, float32 (Hkv,) (a () scale broadcast),
    # from a float32 array of shape () or (Hkv,) in native order, an np.float32 or a Python
    # float; each > 0 with top (the largest fp8 value) times it finite.  None when the
    # checked path must take them.
    cdef cnp.ndarray a
    cdef Py_ssize_t n, i, st
    if type(s) is float or type(s) is np.float32:
        a = np.array(s, dtype=np.float32)
    elif _is_array(s):
        a = s
    else:
        return None
    if cnp.PyArray_TYPE(a) != cnp.NPY_FLOAT32 or not cnp.PyArray_ISNOTSWAPPED(a):
        return None
    if cnp.PyArray_NDIM(a) == 0:
        n, st = 1, 0
    elif cnp.PyArray_NDIM(a) == 1 and cnp.PyArray_DIM(a, 0) == Hkv:
        n, st = Hkv, cnp.PyArray_STRIDE(a, 0)
    else:
        return None
    cdef const char* p = <const char*> cnp.PyArray_DATA(a)
    cdef float x
    for i in range(n):
        x = (<const float*> (p + i * st))[0]
        if not (x > 0 and isfinite(x * top)):
            return None
    return a if n == Hkv and cnp.PyArray_NDIM(a) == 1 else np.broadcast_to(a, (Hkv,))


cdef object _sinks_table(object sinks, Py_ssize_t B, Py_ssize_t Hq):
    # Sink logits as the kernel reads them, float64 (B, Hq) C-contiguous, from a native
    # float32 / float64 array of shape (Hq,) or (B, Hq) of finite or -inf values; None when
    # the checked path must take them.
    cdef cnp.ndarray s, res
    cdef Py_ssize_t b, h, n
    if not _is_array(sinks):
        return None
    s = sinks
    if not cnp.PyArray_ISNOTSWAPPED(s) or (cnp.PyArray_TYPE(s) != cnp.NPY_FLOAT64
                                           and cnp.PyArray_TYPE(s) != cnp.NPY_FLOAT32):
        return None
    if cnp.PyArray_NDIM(s) == 1 and cnp.PyArray_DIM(s, 0) == Hq:
        n = 1
    elif cnp.PyArray_NDIM(s) == 2 and cnp.PyArray_DIM(s, 0) == B and cnp.PyArray_DIM(s, 1) == Hq:
        n = B
    else:
        return None
    s = np.ascontiguousarray(s, dtype=np.float64)
    cdef const double* x = <const double*> cnp.PyArray_DATA(s)
    for h in range(n * Hq):
        if x[h] != x[h] or x[h] == INFINITY:   # NaN, +inf: the checked path's error
            return None
    cdef cnp.npy_intp dims[2]
    dims[0], dims[1] = B, Hq
    res = cnp.PyArray_EMPTY(2, dims, cnp.NPY_FLOAT64, 0)
    cdef double* y = <double*> cnp.PyArray_DATA(res)
    for b in range(B):
        memcpy(y + b * Hq, x + (b * Hq if n > 1 else 0), Hq * sizeof(double))
    return res


cdef void _set_rows(Rows* r, cnp.ndarray x, cnp.ndarray cache, object scales) noexcept:
    # Where the new rows x of one array come from and go to (see Rows).
    r.data = <const char*> cnp.PyArray_DATA(x)
    r.sb, r.sh, r.si, r.sc = (cnp.PyArray_STRIDE(x, 0), cnp.PyArray_STRIDE(x, 1),
                              cnp.PyArray_STRIDE(x, 2), cnp.PyArray_STRIDE(x, 3))
    r.kind = _float_kind(x)
    r.cols = cnp.PyArray_DIM(x, 3)
    r.dst = <char*> cnp.PyArray_DATA(cache)
    r.db, r.dh, r.di = (cnp.PyArray_STRIDE(cache, 0), cnp.PyArray_STRIDE(cache, 1),
                        cnp.PyArray_STRIDE(cache, 2))
    r.dst_kind = _cache_kind(cache)
    r.dst_row = cnp.PyArray_DIM(cache, 3) * cnp.PyArray_ITEMSIZE(cache)
    r.scale = NULL
    r.ssb = r.ssh = r.ssi = 0
    r.fscale = NULL
    r.fs_sh = 0
    cdef cnp.ndarray s
    if FA_BLOCK_SCALED(r.dst_kind):
        s = scales
        r.scale = <char*> cnp.PyArray_DATA(s)
        r.ssb, r.ssh, r.ssi = (cnp.PyArray_STRIDE(s, 0), cnp.PyArray_STRIDE(s, 1),
                               cnp.PyArray_STRIDE(s, 2))
    elif FA_QUANTISED(r.dst_kind):          # fp8: float32 (Hkv,), see _fp8_scales
        s = scales
        r.fscale = <const float*> cnp.PyArray_DATA(s)
        r.fs_sh = cnp.PyArray_STRIDE(s, 0) // 4


cdef int _stage_row(const Rows* r, Py_ssize_t b, Py_ssize_t h, Py_ssize_t i, const float* cos,
                    const float* sin, Py_ssize_t half, int interleaved, float* x,
                    char* staged) noexcept nogil:
    # New row (b, h, i) in the cache's format at `staged` (the row's bytes, then for q8_0
    # its block scales), rotated first when cos is given (and rounded back to its own
    # dtype, as the front end's rotation is).  -1 for a value the cache refuses.
    fa_load_row(r.kind, r.data + b * r.sb + h * r.sh + i * r.si, r.sc, r.cols, x)
    if cos != NULL:
        fa_rotate_row(x, cos, sin, half, interleaved)
        fa_round_row(r.kind, x, r.cols)
    if FA_QUANTISED(r.dst_kind):
        return fa_quantize_row(r.dst_kind, x, r.cols, staged, <uint16_t*> (staged + r.dst_row),
                               r.fscale[h * r.fs_sh] if r.fscale != NULL else 0)
    return fa_store_row(r.dst_kind, x, r.cols, staged)


cdef inline Py_ssize_t _staged_bytes(const Rows* r) noexcept nogil:
    # One staged row: its values, and for q8_0 and q4_0 its float16 scales (2 bytes per
    # 32 values).
    return r.dst_row + (r.cols // 16 if FA_BLOCK_SCALED(r.dst_kind) else 0)


cdef void _store_new_row(const Rows* r, Py_ssize_t first, Py_ssize_t h, Py_ssize_t row,
                         const char* staged) noexcept nogil:
    # A staged row into the cache: row `row` of page (or sequence) `first`, head h; or,
    # with staged NULL, that row's lines requested for writing.
    cdef char* dst = r.dst + first * r.db + h * r.dh + row * r.di
    cdef char* scale = r.scale + first * r.ssb + h * r.ssh + row * r.ssi if r.scale != NULL else NULL
    if staged == NULL:
        fa_prefetch_for_store(dst, r.dst_row)
        if scale != NULL:
            fa_prefetch_for_store(scale, r.cols // 16)
        return
    memcpy(dst, staged, r.dst_row)
    if scale != NULL:
        memcpy(scale, staged + r.dst_row, r.cols // 16)


cdef int _caches_kind(cnp.ndarray kc, cnp.ndarray vc, Py_ssize_t B, Py_ssize_t Hq,
                      Py_ssize_t Lq, Py_ssize_t D) noexcept:
    # The storage kind of the two caches (_cache_kind), when they are 4-d, of one dtype in
    # native order, agree with each other and with q's head dim D and heads Hq, and have
    # rows the kernel reads in place; else -1.  (Empty calls go to the checked path too.)
    if cnp.PyArray_NDIM(kc) != 4 or cnp.PyArray_NDIM(vc) != 4:
        return -1
    if (cnp.PyArray_TYPE(kc) != cnp.PyArray_TYPE(vc) or not cnp.PyArray_ISNOTSWAPPED(kc)
            or not cnp.PyArray_ISNOTSWAPPED(vc)):
        return -1
    cdef int kind = _cache_kind(kc)
    if kind < 0 or _row_values(kind, kc) != D:
        return -1
    cdef Py_ssize_t Hkv = cnp.PyArray_DIM(kc, 1), Dv = cnp.PyArray_DIM(vc, 3)
    if (B == 0 or Lq == 0 or D == 0 or Dv == 0 or not _gqa_fits(Hq, Hkv)
            or not _shape_is(vc, cnp.PyArray_DIM(kc, 0), Hkv, cnp.PyArray_DIM(kc, 2), Dv)):
        return -1
    if not (_kernel_layout(kc) and _kernel_layout(vc)):
        return -1
    return kind


cdef Py_ssize_t _new_rows(object k, object v, cnp.ndarray kc, cnp.ndarray vc, int kind,
                          Py_ssize_t B) noexcept:
    # Lnew: 0 without new rows; k and v's rows when both are float32 / 16-bit arrays of
    # shapes (B, Hkv, Lnew, D) and (B, Hkv, Lnew, Dv) for writeable caches of storage kind
    # `kind`; else -1.
    cdef cnp.ndarray ka, va
    if k is None and v is None:
        return 0
    if not (_is_array(k) and _is_array(v)):
        return -1
    ka, va = k, v
    if _float_kind(ka) < 0 or _float_kind(va) < 0:
        return -1
    cdef Py_ssize_t Hkv = cnp.PyArray_DIM(kc, 1), Lnew
    if not _shape_is(ka, B, Hkv, -1, _row_values(kind, kc)):
        return -1
    Lnew = cnp.PyArray_DIM(ka, 2)
    if not _shape_is(va, B, Hkv, Lnew, _row_values(kind, vc)):
        return -1
    if not (cnp.PyArray_ISWRITEABLE(kc) and cnp.PyArray_ISWRITEABLE(vc)):
        return -1
    return Lnew


cdef int _cmp_slots(const void* a, const void* b) noexcept nogil:
    cdef Py_ssize_t x = (<const Py_ssize_t*> a)[0], y = (<const Py_ssize_t*> b)[0]
    return (x > y) - (x < y)


cdef int _pages_span(const Py_ssize_t* seq, Py_ssize_t B, const int32_t* bt, Py_ssize_t width,
                     Py_ssize_t page, Py_ssize_t lnew, Py_ssize_t* lo,
                     Py_ssize_t* hi) noexcept nogil:
    # The smallest and largest page in use (the first ceil((seq[b] + lnew) / page) entries
    # of each row of the block table; lo 0, hi -1 where none is), as the checked path's
    # _pages_in_use finds them: 1; 0 where a sequence needs more pages than the table's
    # width or two new rows share a cache row (page * page size + row); -1 out of memory.
    cdef Py_ssize_t b, j, i, used, x, key, n = 0
    cdef Py_ssize_t* slots = NULL
    lo[0], hi[0] = 0, -1
    if lnew:
        slots = <Py_ssize_t*> PyMem_RawMalloc(max(B * lnew, 1) * sizeof(Py_ssize_t))
        if slots == NULL:
            return -1
    for b in range(B):
        used = (seq[b] + lnew + page - 1) // page
        if used > width:
            PyMem_RawFree(slots)
            return 0
        for j in range(used):
            x = bt[b * width + j]
            if hi[0] < lo[0]:
                lo[0], hi[0] = x, x
            else:
                lo[0], hi[0] = min(lo[0], x), max(hi[0], x)
        for i in range(lnew):
            key = seq[b] + i
            slots[n] = bt[b * width + key // page] * page + key % page
            n += 1
    if n > 1:
        qsort(slots, n, sizeof(Py_ssize_t), _cmp_slots)
    for i in range(1, n):
        if slots[i] == slots[i - 1]:
            PyMem_RawFree(slots)
            return 0
    PyMem_RawFree(slots)
    return 1


# What _run_compiled gives for a run it can take only once the plan has resolved its batch
# or pages.
cdef object _UNRESOLVED = object()


@cython.auto_pickle(False)     # a plan is a step's: it is made again, never stored
cdef class KVCachePlanBase:
    """The compiled half of :class:`fastattn.KVCachePlan`: what it checked once, and
    ``run``, which checks each layer's arrays, appends and attends in C (see _plan.pxi)."""
    cdef readonly Py_ssize_t batch          # B, or -1 until a batch is set
    cdef cnp.ndarray _seqlens               # intp (B,)
    cdef Py_ssize_t _top                    # max(cache_seqlens)
    cdef object _block_table                # int32 (B, max_pages), C-contiguous, or None
    cdef Py_ssize_t _bt_width               # max_pages
    cdef int _causal
    cdef Py_ssize_t _wl, _wr
    cdef object _scale                      # float, or None: 1 / sqrt(D)
    cdef double _softcap
    cdef object _cos32, _sin32              # float32 (max_pos, half), C-contiguous, or None
    cdef bint _interleaved, _rotate_q_per_row
    cdef bint _has_alibi
    cdef object _alibi                      # float64 (B, Hq) for _alibi_hq heads
    cdef Py_ssize_t _alibi_hq
    cdef object _n_threads                  # fastattn's thread count, a function
    cdef object _precision                  # fastattn._calls.precision: its `active` flag
    cdef public bint compiled               # False: every run takes the checked path
    # The pages in use for one (page size, Lnew): their smallest and largest index.
    cdef Py_ssize_t _memo_page, _memo_lnew, _memo_lo, _memo_hi

    def _configure(self, seqlens, block_table, int causal, Py_ssize_t wl, Py_ssize_t wr,
                   scale, softcap, cos32, sin32, bint interleaved, bint rotate_q_per_row,
                   bint has_alibi, n_threads, precision, bint compiled):
        """Set what the plan checked (fastattn/_serving/kvcache.py; nothing is checked here)."""
        self._set_batch(seqlens, block_table)
        self._causal, self._wl, self._wr = causal, wl, wr
        self._scale = scale
        self._softcap = 0 if softcap is None else softcap
        self._cos32, self._sin32 = cos32, sin32
        self._interleaved, self._rotate_q_per_row = interleaved, rotate_q_per_row
        self._has_alibi = has_alibi
        self._alibi, self._alibi_hq = None, -1
        self._n_threads, self._precision, self.compiled = n_threads, precision, compiled

    def _set_batch(self, seqlens, block_table):
        """Set the lengths (intp (B,), C-contiguous) and block table (int32 (B, max_pages),
        C-contiguous, or None) of a batch of B sequences."""
        self._seqlens = seqlens
        cdef cnp.ndarray lengths = seqlens
        cdef const Py_ssize_t* n = <const Py_ssize_t*> cnp.PyArray_DATA(lengths)
        cdef Py_ssize_t b
        self._block_table = block_table
        self._bt_width = 0 if block_table is None else block_table.shape[1]
        self.batch = cnp.PyArray_DIM(lengths, 0)
        self._top = 0
        for b in range(self.batch):
            self._top = max(self._top, n[b])
        self._memo_page = -1

    def _set_alibi(self, alibi):
        """Set the ALiBi slopes as the kernel reads them, float64 (B, Hq)."""
        self._alibi, self._alibi_hq = alibi, alibi.shape[1]

    def _resolve_pages(self, Py_ssize_t page, Py_ssize_t lnew):
        """Resolve the pages in use for a page size and ``lnew`` new rows in C (see
        _pages_span): True, and remembered, where the block table is wide enough and gives
        each new row a cache row of its own; else False, and the checked path says why."""
        if self._block_table is None or page <= 0 or lnew < 0:
            return False
        cdef cnp.ndarray table = self._block_table, seqlens = self._seqlens
        cdef Py_ssize_t lo, hi
        cdef int ok
        ok = _pages_span(<const Py_ssize_t*> cnp.PyArray_DATA(seqlens), self.batch,
                         <const int32_t*> cnp.PyArray_DATA(table), self._bt_width, page, lnew,
                         &lo, &hi)
        if ok < 0:
            raise MemoryError("fastattn: cannot allocate the new rows' places")
        if ok:
            self._remember_pages(page, lnew, lo, hi)
        return ok == 1

    def _remember_pages(self, Py_ssize_t page, Py_ssize_t lnew, Py_ssize_t lo, Py_ssize_t hi):
        """Remember that the pages in use for (page, lnew) are checked (new rows in rows of
        their own) and span indices lo .. hi."""
        self._memo_page, self._memo_lnew, self._memo_lo, self._memo_hi = page, lnew, lo, hi

    def run(self, q, k_cache, v_cache, k=None, v=None, *, k_scale=None, v_scale=None,
            sinks=None, return_lse=False, out=None):
        """Attend over one layer's caches (appending ``k`` and ``v`` first): exactly
        :func:`fastattn.attention_with_kvcache` with these arguments and the plan's.

        Parameters
        ----------
        q : ndarray, shape (B, Hq, Lq, D)
        k_cache, v_cache : ndarray
            ``(B, Hkv, Lmax, D / Dv)``, or pages ``(num_pages, Hkv, page, D / Dv)`` with
            the plan's block table; float32, float64, float16, bfloat16, or int8 (q8_0)
            with ``k_scale`` and ``v_scale``.
        k, v : ndarray, shape (B, Hkv, Lnew, D / Dv), optional
            New rows, written at ``cache_seqlens[b] + i`` before attending.
        k_scale, v_scale, sinks, return_lse, out : optional
            As in :func:`fastattn.attention_with_kvcache`.

        Returns
        -------
        out : ndarray, shape (B, Hq, Lq, Dv); and lse, shape (B, Hq, Lq), with
        ``return_lse=True``.
        """
        if not self.compiled:
            return self._run_checked(q, k_cache, v_cache, k, v, k_scale, v_scale, sinks,
                                     return_lse, out)
        res = self._run_compiled(q, k_cache, v_cache, k, v, k_scale, v_scale, sinks,
                                 return_lse, out)
        if res is _UNRESOLVED:  # the first run of a batch or page size: resolved, then again
            self._resolve(q, k_cache, k)
            res = self._run_compiled(q, k_cache, v_cache, k, v, k_scale, v_scale, sinks,
                                     return_lse, out)
        if res is None or res is _UNRESOLVED:
            return self._run_checked(q, k_cache, v_cache, k, v, k_scale, v_scale, sinks,
                                     return_lse, out)
        return res

    cdef object _run_compiled(self, q, k_cache, v_cache, k, v, k_scale, v_scale, sinks,
                              return_lse, out):
        # The run in C; _UNRESOLVED for a batch or pages the plan has not resolved, or None
        # for the checked path (see the top of this file).
        if not (_is_array(q) and _is_array(k_cache) and _is_array(v_cache)):
            return None
        if type(return_lse) is not bool or self._precision.active:
            return None
        cdef cnp.ndarray qa = q, kc = k_cache, vc = v_cache, ka = None, va = None
        cdef int q_kind = _float_kind(qa), c_kind
        cdef float top            # the largest fp8 value
        if q_kind < 0 or cnp.PyArray_NDIM(qa) != 4:
            return None
        if self._cos32 is None and not _kernel_layout(qa):
            # The kernel reads q's rows in place only where each row is contiguous; q is
            # small beside the caches, so any other view is read through a copy (the
            # rotation below reads any strides and writes a copy of its own).
            qa = np.ascontiguousarray(qa)
        if cnp.PyArray_DIM(qa, 0) != self.batch:
            return _UNRESOLVED  # a new batch: its lengths
        cdef Py_ssize_t B = self.batch, Hq = cnp.PyArray_DIM(qa, 1), Lq = cnp.PyArray_DIM(qa, 2)
        cdef Py_ssize_t D = cnp.PyArray_DIM(qa, 3)
        c_kind = _caches_kind(kc, vc, B, Hq, Lq, D)
        if c_kind < 0:
            return None
        cdef Py_ssize_t Lnew = _new_rows(k, v, kc, vc, c_kind, B)
        if Lnew < 0:
            return None
        if k is not None:
            ka, va = k, v
        if FA_BLOCK_SCALED(c_kind):
            if not (_scales_fit(k_scale, kc, c_kind, k is not None)
                    and _scales_fit(v_scale, vc, c_kind, k is not None)):
                return None
        elif FA_QUANTISED(c_kind):
            top = fa_kinds[c_kind].largest
            k_scale = _fp8_scales(k_scale, cnp.PyArray_DIM(kc, 1), top)
            v_scale = _fp8_scales(v_scale, cnp.PyArray_DIM(kc, 1), top)
            if k_scale is None or v_scale is None:
                return None
        elif k_scale is not None or v_scale is not None:
            return None
        if self._block_table is not None and (self._memo_page != cnp.PyArray_DIM(kc, 2)
                                              or self._memo_lnew != Lnew):
            return _UNRESOLVED  # pages not checked for this page size and Lnew
        if not self._fits(kc, Lnew, Lq, D):
            return None
        cdef double scale = 1.0 / sqrt(<double> D) if self._scale is None else self._scale
        cdef object alibi = None
        if self._has_alibi:
            if self._alibi_hq != Hq:
                return None
            alibi = self._alibi
        cdef object sinks64 = None
        if sinks is not None:
            sinks64 = _sinks_table(sinks, B, Hq)
            if sinks64 is None:
                return None
        # The result: 16-bit only when q and the caches share that 16-bit dtype.
        cdef bint like_q = q_kind != FA_STORE_NATIVE and c_kind == q_kind
        oa = _lean_out(out, qa, kc, vc, cnp.PyArray_TYPE(qa) if like_q else cnp.NPY_FLOAT32,
                       (k_scale, v_scale), _row_values(c_kind, vc))
        if oa is None:
            return None
        cdef cnp.ndarray seqlens = self._seqlens
        block_table = self._block_table
        if Lnew and self._append(ka, va, kc, vc, k_scale, v_scale, seqlens, block_table) < 0:
            return None
        if self._cos32 is not None:
            qa = self._rotated_q(qa, seqlens)
        cdef cnp.ndarray la = None
        cdef cnp.npy_intp ldims[3]
        if return_lse:
            ldims[0], ldims[1], ldims[2] = B, Hq, Lq
            la = cnp.PyArray_EMPTY(3, ldims, cnp.NPY_FLOAT32, 0)
        self._attend(qa, kc, vc, oa, la, k_scale, v_scale, Lnew, seqlens, block_table, scale,
                     alibi, sinks64)
        return (oa, la) if return_lse else oa

    cdef int _fits(self, cnp.ndarray kc, Py_ssize_t Lnew, Py_ssize_t Lq,
                   Py_ssize_t D) except -1:
        # The cache holds every sequence's keys and new rows, the pages in use exist (the
        # pages' check for this page size and Lnew done once), and the rotary tables
        # cover every position rotated.
        cdef Py_ssize_t capacity, page
        if self._cos32 is not None:
            if Lnew == 0 or 2 * self._cos32.shape[1] > D:
                return False
            if self._top + max(Lnew, Lq) - 1 >= self._cos32.shape[0]:
                return False
        if self._block_table is None:
            return self._top + Lnew <= cnp.PyArray_DIM(kc, 2)
        page = cnp.PyArray_DIM(kc, 2)
        capacity = page * self._bt_width
        if page == 0 or self._top + Lnew > capacity:
            return False
        if self._memo_page != page or self._memo_lnew != Lnew:
            return False        # pages not checked for this page size and Lnew: see above
        return self._memo_lo >= 0 and self._memo_hi < cnp.PyArray_DIM(kc, 0)

    cdef int _append(self, cnp.ndarray k, cnp.ndarray v, cnp.ndarray kc, cnp.ndarray vc,
                     object k_scale, object v_scale, cnp.ndarray seqlens,
                     object block_table) except -2:
        # The new rows rotated, rounded or quantised into a staging block, every value
        # checked, and only then written: 0, or -1 (nothing written) for a value the cache
        # refuses.
        cdef Rows rk, rv
        _set_rows(&rk, k, kc, k_scale)
        _set_rows(&rv, v, vc, v_scale)
        cdef Py_ssize_t B = self.batch, Hkv = cnp.PyArray_DIM(kc, 1), Lnew = cnp.PyArray_DIM(k, 2)
        cdef Py_ssize_t kb = _staged_bytes(&rk), vb = _staged_bytes(&rv)
        cdef Py_ssize_t n = B * Hkv * Lnew, page = cnp.PyArray_DIM(kc, 2)
        cdef Py_ssize_t cols = max(rk.cols, rv.cols)
        cdef char* mem = <char*> PyMem_RawMalloc(n * (kb + vb) + cols * sizeof(float) + 64)
        if mem == NULL:
            raise MemoryError("fastattn: cannot allocate the new rows' staging block")
        cdef float* x = <float*> mem
        cdef char* staged = mem + cols * sizeof(float)
        cdef const Py_ssize_t* seq = <const Py_ssize_t*> cnp.PyArray_DATA(seqlens)
        cdef const int32_t* bt = NULL
        cdef Py_ssize_t bt_stride = 0
        if block_table is not None:
            bt = <const int32_t*> cnp.PyArray_DATA(block_table)
            bt_stride = block_table.shape[1]
        cdef const float* cos = NULL
        cdef const float* sin = NULL
        cdef Py_ssize_t half = 0, b, h, i, w, pos, first, row
        if self._cos32 is not None:
            cos = <const float*> cnp.PyArray_DATA(self._cos32)
            sin = <const float*> cnp.PyArray_DATA(self._sin32)
            half = self._cos32.shape[1]
        cdef int bad = 0, interleaved = self._interleaved
        with nogil:
            for w in range(n):
                b, h, i = w // (Hkv * Lnew), (w // Lnew) % Hkv, w % Lnew
                pos = seq[b] + i
                first, row = b, pos
                if bt != NULL:
                    first, row = bt[b * bt_stride + pos // page], pos % page
                _store_new_row(&rk, first, h, row, NULL)
                _store_new_row(&rv, first, h, row, NULL)
            for w in range(n):
                b, h, i = w // (Hkv * Lnew), (w // Lnew) % Hkv, w % Lnew
                pos = seq[b] + i
                bad = (_stage_row(&rk, b, h, i, cos + pos * half if cos != NULL else NULL,
                                  sin + pos * half if sin != NULL else NULL, half,
                                  interleaved, x, staged + w * (kb + vb)) < 0
                       or _stage_row(&rv, b, h, i, NULL, NULL, 0, 0, x,
                                     staged + w * (kb + vb) + kb) < 0)
                if bad:
                    break
            if not bad:
                for w in range(n):
                    b, h, i = w // (Hkv * Lnew), (w // Lnew) % Hkv, w % Lnew
                    pos = seq[b] + i
                    first, row = b, pos
                    if bt != NULL:
                        first, row = bt[b * bt_stride + pos // page], pos % page
                    _store_new_row(&rk, first, h, row, staged + w * (kb + vb))
                    _store_new_row(&rv, first, h, row, staged + w * (kb + vb) + kb)
        PyMem_RawFree(mem)
        return -1 if bad else 0

    cdef cnp.ndarray _rotated_q(self, cnp.ndarray q, cnp.ndarray seqlens):
        # q rotated, a new C-contiguous array of q's dtype: row i of sequence b at position
        # cache_seqlens[b] + i when causal or windowed, else at cache_seqlens[b].
        cdef cnp.ndarray res = np.empty_like(q, order="C")
        cdef Py_ssize_t B = q.shape[0], H = q.shape[1], Lq = q.shape[2], D = q.shape[3]
        cdef Py_ssize_t half = self._cos32.shape[1], b, h, i, pos
        cdef int kind = _float_kind(q), interleaved = self._interleaved
        cdef bint per_row = self._rotate_q_per_row
        cdef const Py_ssize_t* seq = <const Py_ssize_t*> cnp.PyArray_DATA(seqlens)
        cdef const float* cos = <const float*> cnp.PyArray_DATA(self._cos32)
        cdef const float* sin = <const float*> cnp.PyArray_DATA(self._sin32)
        cdef const char* src = <const char*> cnp.PyArray_DATA(q)
        cdef char* dst = <char*> cnp.PyArray_DATA(res)
        cdef Py_ssize_t sb = q.strides[0], sh = q.strides[1], si = q.strides[2], sc = q.strides[3]
        cdef Py_ssize_t row_bytes = D * cnp.PyArray_ITEMSIZE(q)
        cdef float* x = <float*> PyMem_RawMalloc(D * sizeof(float) + 64)
        if x == NULL:
            raise MemoryError("fastattn: cannot allocate a row of q")
        with nogil:
            for b in range(B):
                for h in range(H):
                    for i in range(Lq):
                        pos = seq[b] + (i if per_row else 0)
                        fa_load_row(kind, src + b * sb + h * sh + i * si, sc, D, x)
                        fa_rotate_row(x, cos + pos * half, sin + pos * half, half,
                                      interleaved)
                        fa_store_row(kind, x, D, dst + ((b * H + h) * Lq + i) * row_bytes)
        PyMem_RawFree(x)
        return res

    cdef int _attend(self, cnp.ndarray q, cnp.ndarray kc, cnp.ndarray vc, cnp.ndarray out,
                     object lse, object k_scale, object v_scale, Py_ssize_t Lnew,
                     cnp.ndarray seqlens, object block_table, double scale, object alibi,
                     object sinks) except -1:
        # The kernel over the caches in place, each sequence over its cache_seqlens[b] +
        # Lnew keys: the Problem the checked path's forward_kvcache fills, filled here.
        cdef Problem P
        cdef Py_ssize_t small[SMALL_OFFSETS]
        cdef Py_ssize_t bshape[1]
        cdef Py_ssize_t B = self.batch, b
        bshape[0] = B
        cdef Py_ssize_t* seen = <Py_ssize_t*> PyMem_RawMalloc(max(B, 1) * sizeof(Py_ssize_t))
        if seen == NULL:
            raise MemoryError("fastattn: cannot allocate the sequences' lengths")
        cdef const Py_ssize_t* seq = <const Py_ssize_t*> cnp.PyArray_DATA(seqlens)
        for b in range(B):
            seen[b] = seq[b] + Lnew
        cdef Py_ssize_t* offs = NULL
        try:
            offs = _fill_layout(&P, q, kc, vc, out, lse, None, 1, bshape, seen, small)
            P.causal, P.wl, P.wr = self._causal, self._wl, self._wr
            P.scale, P.softcap = scale, self._softcap
            P.alibi = <const double*> _data_or_null(alibi)
            P.sinks = <const double*> _data_or_null(sinks)
            _fill_caches(&P, offs, kc, vc, block_table, k_scale, v_scale)
            _run(&P, True, self._n_threads)
        finally:
            if offs != NULL:
                _free_offsets(offs, small)
            PyMem_RawFree(seen)
        return 0


def quantize_rows(cnp.ndarray x, cnp.ndarray values, cnp.ndarray scales):
    """Quantise rows (fastattn._storage.quant): ``x`` float32, float16 or bfloat16
    ``(n, D)``, D a multiple of 32 for q8_0 and q4_0, into ``values`` ``(n, row bytes)`` of
    a quantised cache's dtype (int8: q8_0, uint8: q4_0, D / 2 bytes a row, ml_dtypes'
    float8_e4m3fn / float8_e5m2: fp8) and ``scales``: float16 ``(n, D // 32)`` written for
    q8_0 and q4_0, float32 ``(n,)`` read for fp8 (each row divided by its scale).  All
    C-contiguous; nothing is checked here.  False, with the rows up to the refused one
    written, when a value is not finite or too large for a finite float16 block scale."""
    cdef Py_ssize_t n = cnp.PyArray_DIM(x, 0), D = cnp.PyArray_DIM(x, 1), r
    cdef int kind = _float_kind(x), dst = _cache_kind(values), bad = 0
    cdef Py_ssize_t isz = cnp.PyArray_ITEMSIZE(x), row = cnp.PyArray_DIM(values, 1)
    cdef const char* src = <const char*> cnp.PyArray_DATA(x)
    cdef char* qs = <char*> cnp.PyArray_DATA(values)
    cdef uint16_t* ds = NULL
    cdef const float* fs = NULL
    if FA_BLOCK_SCALED(dst):
        ds = <uint16_t*> cnp.PyArray_DATA(scales)
    else:
        fs = <const float*> cnp.PyArray_DATA(scales)
    cdef float* buf = <float*> PyMem_RawMalloc(D * sizeof(float) + 64)
    if buf == NULL:
        raise MemoryError("fastattn: cannot allocate a row")
    with nogil:
        for r in range(n):
            fa_load_row(kind, src + r * D * isz, isz, D, buf)
            if fa_quantize_row(dst, buf, D, qs + r * row, ds + r * (D // 32) if ds != NULL else NULL,
                               fs[r] if fs != NULL else 0) < 0:
                bad = 1
                break
    PyMem_RawFree(buf)
    return not bad


_SCALE_NAMES = {FA_SCALE_NONE: None, FA_SCALE_F16_BLOCK: "float16 per block",
                FA_SCALE_F32_HEAD: "float32 per tensor or kv head"}


def storage_kinds():
    """The storage kinds' table (src/kinds/fa_kinds.h) as a tuple of dicts, one a kind, in the
    order of their numbers: ``kind``, ``name``, ``dtype``, ``per_item``, ``block``,
    ``scale``, ``largest`` and ``quantisable``."""
    cdef int i
    return tuple(dict(kind=i, name=fa_kinds[i].name.decode(), dtype=fa_kinds[i].dtype.decode(),
                      per_item=fa_kinds[i].per_item, block=fa_kinds[i].block,
                      scale=_SCALE_NAMES[fa_kinds[i].scale], largest=fa_kinds[i].largest,
                      quantisable=fa_kinds[i].quantisable)
                 for i in range(FA_N_KINDS))
