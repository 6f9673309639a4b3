# The kernel's entry points for the validated front end (fastattn/_calls/api.py, _backward.py,
# through fastattn/_calls/glue.py): each takes the front end's description of the call, `p` (a
# fastattn._calls.args.Problem, or varlen_problem's namespace for packed sequences), and the
# arrays it prepared, by name, as scikit-learn's dispatcher hands its arguments to the
# typed code.  _fill_problem (_problem.pxi) turns p into the C Problem; nothing is
# validated here.
#
#   forward         out (and lse) of attention and attention_varlen
#   forward_kvcache out (and lse) of attention_with_kvcache, over caches read in place
#   backward        dq, dk, dv (and Delta) of both
#   key_intervals   the kernel's visibility rule, row by row (attention_weights, Dask)


def forward(p, *, cnp.ndarray q, cnp.ndarray k, cnp.ndarray v, cnp.ndarray out, object lse,
            object mask, int n_threads):
    """Run the fused kernel on the call ``p`` describes (called only by fastattn._calls.api).

    q, k, v, out: the compute dtype (float32/float64) or, read and written in place,
    float16 / bfloat16 (out only with float32 compute), with a contiguous last axis
    (kernel_layout): (..., heads, rows, cols) with batch axes broadcasting to ``p.batch``,
    or (heads, total, cols) for packed sequences.  lse: None or (..., Hq, Lq) / (Hq, total_q)
    of the compute dtype; mask: None, a uint8 view of a bool mask or an array of the compute
    dtype, (..., Hq, Lq, Lk) broadcasting likewise.  No validation happens here.
    """
    cdef Problem P
    cdef Py_ssize_t small[SMALL_OFFSETS]
    cdef Py_ssize_t* offs = _fill_problem(&P, p, q, k, v, out, lse, mask, small)
    try:
        _run(&P, _computes_float(q, k, v), n_threads)
    finally:
        _free_offsets(offs, small)


def forward_kvcache(p, *, cnp.ndarray q, cnp.ndarray k_cache, cnp.ndarray v_cache,
                    cnp.ndarray out, object lse, object block_table, object k_scale,
                    object v_scale, int n_threads):
    """Run the fused kernel over KV caches (called only by fastattn._serving.kvcache).

    p: the call's Problem, whose kv_lengths are the keys each sequence attends over; q
    (B, Hq, Lq, D), out and lse as for ``forward``.  The caches: (B, Hkv, Lmax, D / Dv),
    or with block_table (int32 (B, max_pages), C-contiguous) pages (num_pages, Hkv, page,
    D / Dv); any strides with a contiguous last axis; float32 (float64 with float64 q),
    float16, bfloat16; int8 (q8_0) or uint8 (q4_0, D / 2 bytes a row) with k_scale /
    v_scale uint16 views of their float16 scales, shaped like the cache with D / 32 in
    the last axis (contiguous); or ml_dtypes' float8_e4m3fn / float8_e5m2 with k_scale /
    v_scale float32 (Hkv,), one scale per kv head (any stride).
    No validation happens here.
    """
    cdef Problem P
    cdef Py_ssize_t small[SMALL_OFFSETS]
    cdef Py_ssize_t* offs = _fill_problem(&P, p, q, k_cache, v_cache, out, lse, None, small)
    try:
        _fill_caches(&P, offs, k_cache, v_cache, block_table, k_scale, v_scale)
        _run(&P, _computes_float(q, k_cache, v_cache), n_threads)
    finally:
        _free_offsets(offs, small)


cdef int _fill_caches(Problem* P, Py_ssize_t* offs, cnp.ndarray k_cache, cnp.ndarray v_cache,
                      object block_table, object k_scale, object v_scale) except -1:
    # The serving caches' fields of the Problem (see forward_kvcache): pages, scales, and
    # Lk as the longest sequence's keys (a paged cache's rows are a page's).
    cdef Py_ssize_t b, m = max(P.nbatch, 1)
    cdef cnp.ndarray bt, sc
    P.Lk = 0
    for b in range(P.nbatch):
        P.Lk = max(P.Lk, P.kv_len[b])
    if block_table is not None:
        bt = block_table
        P.block_table = <const int32_t*> cnp.PyArray_DATA(bt)
        P.bt_stride = cnp.PyArray_DIMS(bt)[1]
        P.page = _dim(k_cache, -2)
        P.k_pst = cnp.PyArray_STRIDES(k_cache)[0] // P.k_isz
        P.v_pst = cnp.PyArray_STRIDES(v_cache)[0] // P.v_isz
        for b in range(P.nbatch):   # unused: pages come from the block table
            offs[m + b] = offs[2 * m + b] = 0
    if P.v_kind == FA_STORE_Q4_0:   # two values a byte
        P.Dv = 2 * _dim(v_cache, -1)
    if FA_BLOCK_SCALED(P.k_kind):
        sc = k_scale
        P.k_scale = <const uint16_t*> cnp.PyArray_DATA(sc)
        P.ks_pst, P.ks_sh, P.ks_sj = (cnp.PyArray_STRIDES(sc)[0] // 2, _estride(sc, -3),
                                      _estride(sc, -2))
    elif FA_QUANTISED(P.k_kind):
        sc = k_scale
        P.k_fscale = <const float*> cnp.PyArray_DATA(sc)
        P.kfs_sh = cnp.PyArray_STRIDES(sc)[0] // 4
    if FA_BLOCK_SCALED(P.v_kind):
        sc = v_scale
        P.v_scale = <const uint16_t*> cnp.PyArray_DATA(sc)
        P.vs_pst, P.vs_sh, P.vs_sj = (cnp.PyArray_STRIDES(sc)[0] // 2, _estride(sc, -3),
                                      _estride(sc, -2))
    elif FA_QUANTISED(P.v_kind):
        sc = v_scale
        P.v_fscale = <const float*> cnp.PyArray_DATA(sc)
        P.vfs_sh = cnp.PyArray_STRIDES(sc)[0] // 4
    return 0


def backward(p, *, cnp.ndarray q, cnp.ndarray k, cnp.ndarray v, cnp.ndarray out,
             cnp.ndarray dout, cnp.ndarray lse, object dlse, cnp.ndarray delta,
             cnp.ndarray dq, cnp.ndarray dk, cnp.ndarray dv, object mask, int n_threads):
    """The gradients of the call ``p`` describes (called only by fastattn._calls.backward).

    q, k, v, out, mask: as for ``forward``, the call whose out and lse these are; dout:
    out's shape and dtype, laid out likewise.  lse, dlse (or None), delta: C-contiguous
    compute dtype, lse's shape; delta is written (rowsum(dout * out) - dlse, 0 for rows
    without a gradient).  dq, dk, dv: C-contiguous compute dtype with q's, k's and v's
    shapes over the full broadcast batch, all written.  No validation happens here.
    """
    cdef Problem P
    cdef Grads G
    cdef Py_ssize_t small[SMALL_OFFSETS]
    cdef Py_ssize_t* offs = _fill_problem(&P, p, q, k, v, out, lse, mask, small)
    P.backward = True
    cdef cnp.ndarray boffs = np.empty(4 * max(P.nbatch, 1), dtype=np.intp)
    try:
        _fill_grads(&G, &P, p, dout, delta, dlse, dq, dk, dv,
                    <Py_ssize_t*> cnp.PyArray_DATA(boffs))
        # S and dP in bfloat16 pairs when the forward's were, and dO is bfloat16 too
        P.bf16_dot = P.bf16_dot and G.do_kind == FA_STORE_BF16
        P.amx = P.amx if P.bf16_dot else 0
        _run_backward(&P, &G, _computes_float(q, k, v), n_threads)
    finally:
        _free_offsets(offs, small)


cdef int _fill_grads(Grads* G, const Problem* P, object p, cnp.ndarray dout, object delta,
                     object dlse, cnp.ndarray dq, cnp.ndarray dk, cnp.ndarray dv,
                     Py_ssize_t* bo) except -1:
    # Pointers, strides and batch offsets (into bo, 4 per batch element) of the backward's
    # arrays, laid out as the call's out (dout), q (dq), k (dk) and v (dv).
    cdef Py_ssize_t n = max(P.nbatch, 1), s
    cdef Py_ssize_t bshape[32]
    cdef int nb
    cdef const Py_ssize_t* cq
    cdef const Py_ssize_t* ck
    G.dout = <char*> cnp.PyArray_DATA(dout)
    G.do_kind = _store_kind(dout)
    G.do_isz = cnp.PyArray_ITEMSIZE(dout)
    G.do_sh, G.do_si = _estride(dout, -3), _estride(dout, -2)
    G.delta = <char*> _data_or_null(delta)
    G.dlse = <const char*> _data_or_null(dlse)
    G.dq, G.dk, G.dv = (<char*> cnp.PyArray_DATA(dq), <char*> cnp.PyArray_DATA(dk),
                        <char*> cnp.PyArray_DATA(dv))
    G.dq_sh, G.dq_si = _estride(dq, -3), _estride(dq, -2)
    G.dk_sh, G.dk_sj = _estride(dk, -3), _estride(dk, -2)
    G.dv_sh, G.dv_sj = _estride(dv, -3), _estride(dv, -2)
    if p.packed:
        cq = <const Py_ssize_t*> cnp.PyArray_DATA(p.cu_q)
        ck = <const Py_ssize_t*> cnp.PyArray_DATA(p.cu_k)
        for s in range(P.nbatch):
            bo[s] = cq[s] * G.do_si
            bo[n + s] = cq[s] * G.dq_si
            bo[2 * n + s] = ck[s] * G.dk_sj
            bo[3 * n + s] = ck[s] * G.dv_sj
    else:
        nb = _batch_shape(p, bshape)
        _fill_offsets(dout, 3, nb, bshape, P.nbatch, bo)
        _fill_offsets(dq, 3, nb, bshape, P.nbatch, bo + n)
        _fill_offsets(dk, 3, nb, bshape, P.nbatch, bo + 2 * n)
        _fill_offsets(dv, 3, nb, bshape, P.nbatch, bo + 3 * n)
    G.do_boff, G.dq_boff, G.dk_boff, G.dv_boff = bo, bo + n, bo + 2 * n, bo + 3 * n
    return 0


def key_intervals(p):
    """Visible key interval [lo, hi) of every query row of the call ``p`` describes (a
    fastattn._calls.args.Problem), intp arrays of shape (p.nbatch, p.Lq) each.

    The kernel's own rule (fa_key_interval) on the Problem's own description
    (_fill_description): causal, window, kv_lengths and q_lengths (alignment uses them;
    rows past q_lengths see nothing).
    """
    cdef Problem P
    _fill_description(&P, p)
    cdef Py_ssize_t nb = p.nbatch, Lq = p.Lq, Lk = p.Lk, b, i, ql, kl
    cdef cnp.ndarray lo = np.empty((nb, Lq), dtype=np.intp)
    cdef cnp.ndarray hi = np.empty((nb, Lq), dtype=np.intp)
    cdef Py_ssize_t* plo = <Py_ssize_t*> cnp.PyArray_DATA(lo)
    cdef Py_ssize_t* phi = <Py_ssize_t*> cnp.PyArray_DATA(hi)
    cdef const Py_ssize_t* pkv = <const Py_ssize_t*> _data_or_null(p.kv_len)
    cdef const Py_ssize_t* pql = <const Py_ssize_t*> _data_or_null(p.q_len)
    for b in range(nb):
        ql = pql[b] if pql != NULL else Lq
        kl = pkv[b] if pkv != NULL else Lk
        for i in range(Lq):
            if i < ql:
                fa_key_interval(i, ql, kl, P.causal, P.wl, P.wr, &plo[b * Lq + i],
                                &phi[b * Lq + i])
            else:
                plo[b * Lq + i] = phi[b * Lq + i] = 0
    return lo, hi
