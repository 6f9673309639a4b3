# Describing a call to the kernel: the C Problem (pipeline/_tile_state.pxi) of one call.
#
#   _fill_problem       THE filler: the Problem of a call the front end describes (a
#                       fastattn._calls.args.Problem, or varlen_problem's namespace), on the
#                       operands fastattn/_calls/glue.py prepared; every validated entry point
#                       (_entry_points.pxi) calls it
#   _fill_description   the fields of the call's description, read by name, one a line:
#                       a new keyword of the front end is an attribute of its Problem and a
#                       line here, never a new argument of the entry points
#   _fill_layout        where the arrays are: pointers, strides, storage kinds and the
#                       element offset of every batch element (also the lean gate's)
#   kernel_layout       the rule for an array the kernel addresses in place
#
# The kernel's codes of the normalised arguments (MASK_*, CAUSAL_*) are exported for the
# front end, which checks that fastattn._calls.args' codes are these when it loads the module
# (fastattn/_machine/isa.py).

MASK_NONE = 0
MASK_BOOL = 1
MASK_ADD = 2
CAUSAL_NONE = FA_CAUSAL_NONE
CAUSAL_BOTTOM_RIGHT = FA_CAUSAL_BOTTOM_RIGHT
CAUSAL_TOP_LEFT = FA_CAUSAL_TOP_LEFT

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


# Whether the decode kernels request the rows they read soon into L1 or into L2, chosen
# once from the CPU (fa_prefetch_init).
DECODE_PREFETCH_L1 = bool(fa_prefetch_init())


# Integer products for the scores over q8_0 and q4_0 caches (fa_int8dot.h): off unless
# asked for (fastattn.set_int8_dot_products), and only where this build has them and the
# CPU runs them.
INT8_DOT_BUILT = bool(FA_HAVE_INT8DOT)
_int8_way = fa_int8dot_init()
INT8_DOT_CPU = _int8_way != FA_I8_NONE
# the instruction that takes a block's products: VNNI's vpdpbusd, else AVX2's vpmaddubsw
INT8_DOT_VNNI = _int8_way == FA_I8_VNNI
cdef bint _int8_dot = False


def int8_dot():
    """Whether calls over q8_0 and q4_0 caches take q.k in integers."""
    return _int8_dot


def set_int8_dot(bint on):
    """Turn the integer products on or off (on only where built and supported); returns
    the previous setting."""
    global _int8_dot
    old = _int8_dot
    _int8_dot = on and INT8_DOT_BUILT and INT8_DOT_CPU
    return old


cdef inline bint _int8_dot_takes(const Problem* P) noexcept nogil:
    # A forward call over q8_0 or q4_0 K and V of the same kind, whole blocks of dims.
    return (_int8_dot and not P.backward and P.v_kind == P.k_kind
            and (P.k_kind == FA_STORE_Q8_0 or P.k_kind == FA_STORE_Q4_0)
            and P.D % 32 == 0 and P.Dv % 32 == 0)


# ... and on AMX tiles (fa_amx.h), for head dims that are multiples of 32, wherever the
# CPU and OS allow them (FASTATTN_AMX=0 turns them off); FASTATTN_AMX=model runs the same
# kernels on the scalar model of the tile instructions, on any CPU with bfloat16 products.
AMX_BUILT = bool(FA_HAVE_AMX)
AMX_VERIFIED = True             # the hardware path has run its tests on an AMX CPU
AMX_MODES = {"off": 0, "hw": FA_AMX_HW, "model": FA_AMX_MODEL}
cdef int _amx = 0


def amx_cpu():
    """Whether this process may run AMX-BF16 tiles: the CPU has them, the OS saves their
    state and (Linux) granted the permission, which this asks for once."""
    return fa_amx_status() == FA_AMX_OK


def amx_why_not():
    """Why this process runs no AMX-BF16 tiles, in words (None where it may)."""
    cdef int code = fa_amx_status()
    if code == FA_AMX_OK:
        return None
    if code == FA_AMX_NOT_BUILT:
        return "this build has no AMX code"
    if code == FA_AMX_NO_CPU:
        return "this CPU has no AMX-BF16"
    if code == FA_AMX_NO_OS:
        return "the OS does not enable the tile state"
    return (f"Linux refused the tile permission: {__import__('os').strerror(code)} "
            f"(errno {code})")


def amx():
    """The backend of the AMX tile kernels: "off", "hw" or "model"."""
    return {v: k for k, v in AMX_MODES.items()}[_amx]


def set_amx(str mode):
    """Run bfloat16 products on AMX tiles: "hw" (where amx_cpu()), "model" (the scalar
    model, where bfloat16 products run) or "off"; returns the previous mode.  A mode
    this build or CPU cannot run is refused with ValueError."""
    global _amx
    if mode not in AMX_MODES:
        raise ValueError(f"AMX mode must be one of {sorted(AMX_MODES)}, got {mode!r}")
    if mode == "hw" and not amx_cpu():
        raise ValueError("AMX mode 'hw': this build or CPU cannot run AMX-BF16 tiles")
    if mode == "model" and not (BF16_DOT_BUILT and BF16_DOT_CPU):
        raise ValueError("AMX mode 'model': the tile kernels need bfloat16 products "
                         "(an AVX512-BF16 CPU and the avx512 build)")
    old = amx()
    _amx = AMX_MODES[mode]
    return old


def _amx_from_environment():
    # FASTATTN_AMX: 0 off; 1 the hardware where the CPU and OS allow it; model the scalar
    # model.  Unset: the hardware once verified.  A value this machine cannot run is off.
    choice = __import__("os").environ.get("FASTATTN_AMX", "auto")
    if choice == "model":
        mode = "model"
    elif choice == "1" or choice == "auto" and AMX_VERIFIED:
        mode = "hw"
    else:
        mode = "off"
    try:
        set_amx(mode)
    except ValueError:
        set_amx("off")


_amx_from_environment()


cdef inline bint _gqa_fits(Py_ssize_t Hq, Py_ssize_t Hkv) noexcept:
    # GQA: query head h reads key/value head h // (Hq // Hkv) (fastattn._calls.args.check_gqa
    # refuses the rest with its message).
    return Hkv != 0 and Hq % Hkv == 0


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


cdef int _NPY_E4M3 = -1, _NPY_E5M2 = -1   # ml_dtypes' fp8 type numbers, once seen


cdef int _byte_kind(cnp.ndarray a):
    # The storage kind of an array of one byte per element: int8 (q8_0), uint8 (q4_0),
    # ml_dtypes' float8_e4m3fn or float8_e5m2 (fp8), else -1.  The fp8 type numbers are
    # learnt from the first array of each (ml_dtypes is not imported here).
    global _NPY_E4M3, _NPY_E5M2
    cdef int t = cnp.PyArray_TYPE(a)
    if t == cnp.NPY_INT8:
        return FA_STORE_Q8_0
    if t == cnp.NPY_UINT8:
        return FA_STORE_Q4_0
    if t == _NPY_E4M3:
        return FA_STORE_E4M3
    if t == _NPY_E5M2:
        return FA_STORE_E5M2
    if a.dtype.type.__module__.split(".")[0] != "ml_dtypes":
        return -1
    if a.dtype.name == "float8_e4m3fn":
        _NPY_E4M3 = t
        return FA_STORE_E4M3
    if a.dtype.name == "float8_e5m2":
        _NPY_E5M2 = t
        return FA_STORE_E5M2
    return -1


cdef inline int _store_kind(cnp.ndarray a):
    # How the kernel reads (or writes) an array's elements: the compute type itself, one
    # of the 16-bit types, or for a cache one of _byte_kind's (the front end passes
    # nothing else).
    if cnp.PyArray_ITEMSIZE(a) == 1:
        return _byte_kind(a)
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


# Batch offsets (8 per batch element, see _fill_layout) of up to 8 batch elements live in
# the caller's frame, not on the heap.
cdef enum:
    SMALL_OFFSETS = 64


cdef inline void _free_offsets(Py_ssize_t* offs, Py_ssize_t* small) noexcept:
    if offs != small:
        PyMem_RawFree(offs)


cdef Py_ssize_t* _fill_layout(Problem* P, cnp.ndarray q, cnp.ndarray k, cnp.ndarray v,
                              cnp.ndarray out, object lse, object mask, int nb,
                              const Py_ssize_t* bshape, const Py_ssize_t* kv_len,
                              Py_ssize_t* small) except NULL:
    # The arrays of a call, which the kernel can address in place: q, k, v, out with
    # (heads, rows, columns) last (heads may be missing: one head), lse (heads, rows) last,
    # mask (heads, rows, keys) last, all broadcasting over the batch shape bshape[:nb].
    # kv_len: one length per batch element, or NULL for Lk everywhere.  The description
    # (causal, window, scale, modifiers) is left "off", scale 1: _fill_description or the
    # lean gate sets it.  Returns the block of batch offsets, 8 per batch element (q, k,
    # v, out, lse, mask, kv_len, and packed sequences' q_len): `small` (the caller's
    # SMALL_OFFSETS elements) when they fit, else one it allocates (the caller frees it
    # with _free_offsets).
    cdef Py_ssize_t nbatch = 1, d
    for d in range(nb):
        nbatch *= bshape[d]
    cdef Py_ssize_t n = max(nbatch, 1)
    cdef Py_ssize_t* offs = small
    if 8 * n > SMALL_OFFSETS:
        offs = <Py_ssize_t*> PyMem_RawMalloc(8 * n * sizeof(Py_ssize_t))
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
    P.mask_kind = 0              # MASK_NONE until _fill_description reads the call's
    P.m_sh = P.m_si = P.m_sj = 0
    if mask is not None:
        mask_a = mask
        _fill_offsets(mask_a, 3, nb, bshape, nbatch, offs + 5 * n)
        P.mask = <char*> cnp.PyArray_DATA(mask_a)
        P.m_sh, P.m_si, P.m_sj = _estride(mask_a, -3), _estride(mask_a, -2), _estride(mask_a, -1)
    P.causal = FA_CAUSAL_NONE
    P.wl = P.wr = -1
    P.scale = 1
    P.softcap = 0
    P.alibi = P.sinks = NULL
    P.q_len = NULL
    P.packed = False
    P.backward = False
    P.block_table = NULL
    P.bt_stride = P.page = P.k_pst = P.v_pst = 0
    P.k_scale = P.v_scale = NULL
    P.ks_pst = P.ks_sh = P.ks_sj = P.vs_pst = P.vs_sh = P.vs_sj = 0
    P.k_fscale = P.v_fscale = NULL
    P.kfs_sh = P.vfs_sh = 0
    P.bf16_dot = (P.q_kind == FA_STORE_BF16 and P.k_kind == FA_STORE_BF16
                  and P.v_kind == FA_STORE_BF16 and _bf16_dot_takes(P.D, P.Dv))
    P.amx = _amx if P.bf16_dot and P.D % 32 == 0 and P.Dv % 32 == 0 else 0
    P.int8_dot = False           # the forward's _run decides (_int8_dot_takes)
    return offs


cdef const void* _data_or_null(object a):
    # The data of a C-contiguous array prepared by the front end, or NULL for None.
    cdef cnp.ndarray arr
    if a is None:
        return NULL
    arr = a
    return cnp.PyArray_DATA(arr)


cdef int _batch_shape(object p, Py_ssize_t* bshape) except -1:
    # The batch shape of the call p describes into bshape[:32]; returns its length.  A
    # packed call is one batch axis of n_seq sequences.
    cdef int nb, d
    if p.packed:
        bshape[0] = p.n_seq
        return 1
    nb = len(p.batch)
    if nb > 32:   # the offsets' odometer (_fill_offsets) has 32 axes
        raise ValueError(f"fastattn: at most 32 batch dimensions, got {nb}")
    for d in range(nb):
        bshape[d] = p.batch[d]
    return nb


cdef int _fill_description(Problem* P, object p) except -1:
    # The call's description, each field read by name from the front end's Problem.
    P.mask_kind = p.mask_code
    P.causal = p.causal_code
    P.wl = p.wl
    P.wr = p.wr
    P.scale = p.scale
    P.softcap = 0 if p.softcap is None else p.softcap
    P.alibi = <const double*> _data_or_null(p.alibi)
    P.sinks = <const double*> _data_or_null(p.sinks)
    return 0


cdef Py_ssize_t* _fill_problem(Problem* P, object p, cnp.ndarray q, cnp.ndarray k,
                               cnp.ndarray v, cnp.ndarray out, object lse, object mask,
                               Py_ssize_t* small) except NULL:
    # The Problem of the call that p describes (a fastattn._calls.args.Problem, or the namespace
    # of varlen_problem when p.packed), on its operands as fastattn/_calls/glue.py prepared them:
    # q, k, v, out, lse and mask (None for packed sequences) as _fill_layout takes them.
    # Returns the block of batch offsets (the caller frees it with _free_offsets).
    cdef Py_ssize_t bshape[32]
    cdef int nb = _batch_shape(p, bshape)
    cdef const Py_ssize_t* kv_len = NULL
    if not p.packed:
        kv_len = <const Py_ssize_t*> _data_or_null(p.kv_len)
    cdef Py_ssize_t* offs = _fill_layout(P, q, k, v, out, lse, mask, nb, bshape, kv_len, small)
    try:
        if p.packed:
            _pack_sequences(P, p.cu_q, p.cu_k, offs)
        else:
            P.q_len = <const Py_ssize_t*> _data_or_null(p.q_len)
        _fill_description(P, p)
    except BaseException:
        _free_offsets(offs, small)
        raise
    return offs


cdef void _pack_sequences(Problem* P, cnp.ndarray cu_q, cnp.ndarray cu_k,
                          Py_ssize_t* offs) noexcept:
    # Packed sequences (attention_varlen): batch element s is sequence s, its rows and keys
    # starting at cu_q[s] and cu_k[s] of the (heads, total, columns) arrays, its kv and q
    # lengths (offs' last two rows) its own.  Lq and Lk become the longest sequence's.
    cdef Py_ssize_t n = P.nbatch, m = max(n, 1), s, Lq = 0, Lk = 0
    cdef const Py_ssize_t* cq = <const Py_ssize_t*> cnp.PyArray_DATA(cu_q)
    cdef const Py_ssize_t* ck = <const Py_ssize_t*> cnp.PyArray_DATA(cu_k)
    cdef Py_ssize_t* kv_len = offs + 6 * m
    cdef Py_ssize_t* q_len = offs + 7 * m
    for s in range(n):
        kv_len[s] = ck[s + 1] - ck[s]
        q_len[s] = cq[s + 1] - cq[s]
        Lq = max(Lq, q_len[s])
        Lk = max(Lk, kv_len[s])
        offs[s] = cq[s] * P.q_si
        offs[m + s] = ck[s] * P.k_sj
        offs[2 * m + s] = ck[s] * P.v_sj
        offs[3 * m + s] = cq[s] * P.o_si
        offs[4 * m + s] = cq[s] * P.lse_si
    P.Lq, P.Lk = Lq, Lk
    P.q_len = q_len
    P.packed = True
