# The lean call path.  fastattn.attention() first offers its arguments here.  This path
# is a gate: it only answers "is this the common case?" -- ndarrays in native byte order
# of float32, float16 or bfloat16 in any mix, or all float64; causal a bool; no mask,
# window, lengths or score modifier (attention sinks of one batch element are taken); no
# broadcasting of the batch dims; layouts the kernel reads in place -- and runs such a
# call through the same layout filler (_fill_layout) and run step (_run) as the validated
# path, in about a microsecond of overhead, without building a Python object.  Anything
# else, including every *invalid* call, returns None, and the Python front end checks it
# with its error messages.  So it never raises for bad input; tests check that whatever it
# takes gives the validated path's bits.
#
# The gate normalises nothing itself: the kernel codes of causal=False and causal=True are
# fastattn._calls.args' (the one normaliser), handed over by fastattn/_machine/isa.py when it loads
# the module (lean_causal_codes); until then the gate takes no call.

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
    if not _gqa_fits(Hq, Hkv):
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


cdef int _lean_causal_codes[2]    # the codes of causal=False and causal=True, or -1
_lean_causal_codes[0] = _lean_causal_codes[1] = -1


def lean_causal_codes(int if_false, int if_true):
    """Give the lean gate the kernel codes of causal=False and causal=True, as the front
    end's normaliser (fastattn._calls.args) has them."""
    _lean_causal_codes[0], _lean_causal_codes[1] = if_false, if_true


cdef inline bint _lean_causal(object causal, int* mode):
    # Only the bools themselves; the strings and NumPy bools go to the front end.
    if causal is False:
        mode[0] = _lean_causal_codes[0]
    elif causal is True:
        mode[0] = _lean_causal_codes[1]
    else:
        return False
    return mode[0] >= 0


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
                            int typenum, object more=None, Py_ssize_t dv=-1):
    # The result array, q's shape with v's last axis (or dv, where given: the values of a
    # q4_0 row): a new one, or the caller's `out` when it is exactly the result's type and
    # shape, writeable, addressable in place and clear of the inputs (and of the arrays in
    # `more`, where given); None when `out` needs the front end.
    cdef int nd = cnp.PyArray_NDIM(q), d
    cdef cnp.npy_intp shape[32]
    cdef cnp.ndarray oa
    memcpy(shape, cnp.PyArray_DIMS(q), (nd - 1) * sizeof(cnp.npy_intp))
    shape[nd - 1] = cnp.PyArray_DIMS(v)[nd - 1] if dv < 0 else dv
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
    if more is not None:
        for a in more:
            if a is not None and _extent_overlap(oa, a):
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
    _run_lean(qa, ka, va, oa, la, nb, bshape, causal_mode, sc, sinks64, n_threads)
    return (oa, la) if return_lse else oa


cdef int _run_lean(cnp.ndarray q, cnp.ndarray k, cnp.ndarray v, cnp.ndarray out, object lse,
                   int nb, const Py_ssize_t* bshape, int causal, double scale, object sinks,
                   object n_threads) except -1:
    # The run step of the lean path: the layout as for every call, the three fields of the
    # description the gate takes (the rest stay off), then the kernel.
    cdef Problem P
    cdef Py_ssize_t small[SMALL_OFFSETS]
    cdef Py_ssize_t* offs = _fill_layout(&P, q, k, v, out, lse, None, nb, bshape, NULL, small)
    P.causal = causal
    P.scale = scale
    P.sinks = <const double*> _data_or_null(sinks)
    try:
        _run(&P, _computes_float(q, k, v), n_threads)
    finally:
        _free_offsets(offs, small)
    return 0
