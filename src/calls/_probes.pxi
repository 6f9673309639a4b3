# What tests and `python -m fastattn info` ask the compiled module, besides attention:
#
#   vector_tanh, vector_exp2,   the kernel's own vector functions on arrays, for the
#   vector_widen, vector_narrow accuracy tests
#   build_info, cpu_supports    facts fixed when this variant was compiled, and whether
#                               the running CPU can execute a variant
#   omp_max_threads, pool_*     the thread pool behind the kernels, and its settings
#   amx_model_dp, amx_hw_dp,    one AMX tile instruction on the scalar model and on the
#   amx_peak                    hardware, and a plain tile loop's multiply-adds a second


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


def amx_model_dp(object c, object a, object b, bint sequential=False):
    """One TDPBF16PS on the scalar tile model, in place: c (16 x 16 float32) += a (16 x 32
    bfloat16 bits, uint16) . b (16 x 32 uint16, pairs of rows interleaved).  For tests."""
    _check_tile_operands(c, a, b)
    fa_amx_model_dp_test(<float*> cnp.PyArray_DATA(c), <const uint16_t*> cnp.PyArray_DATA(a),
                         <const uint16_t*> cnp.PyArray_DATA(b), sequential)


def amx_hw_dp(object c, object a, object b):
    """amx_model_dp on the hardware's tiles (where amx_cpu())."""
    _check_tile_operands(c, a, b)
    if not amx_cpu():
        raise ValueError("amx_hw_dp: this build or CPU cannot run AMX-BF16 tiles")
    fa_amx_hw_dp_test(<float*> cnp.PyArray_DATA(c), <const uint16_t*> cnp.PyArray_DATA(a),
                      <const uint16_t*> cnp.PyArray_DATA(b))


def amx_peak(long steps):
    """Multiply-adds a second of a plain loop of independent tdpbf16ps on one thread."""
    if not amx_cpu():
        raise ValueError("amx_peak: this build or CPU cannot run AMX-BF16 tiles")
    cdef timespec t0, t1
    clock_gettime(CLOCK_MONOTONIC, &t0)
    cdef double macs = fa_amx_hw_peak_loop(steps)
    clock_gettime(CLOCK_MONOTONIC, &t1)
    return macs / ((t1.tv_sec - t0.tv_sec) + 1e-9 * (t1.tv_nsec - t0.tv_nsec))


cdef _check_tile_operands(object c, object a, object b):
    for name, x in (("c", c), ("a", a), ("b", b)):
        if not isinstance(x, np.ndarray):
            raise TypeError(f"{name} must be a NumPy array, got {type(x).__name__}")
    if (c.dtype != np.float32 or tuple(c.shape) != (16, 16) or not c.flags.c_contiguous
            or not c.flags.writeable):
        raise ValueError(f"c must be a writable C-contiguous 16 x 16 float32 array, got "
                         f"{c.dtype} {tuple(c.shape)}")
    for name, x in (("a", a), ("b", b)):
        if x.dtype != np.uint16 or tuple(x.shape) != (16, 32) or not x.flags.c_contiguous:
            raise ValueError(f"{name} must be a C-contiguous 16 x 32 uint16 array, got "
                             f"{x.dtype} {tuple(x.shape)}")
