# Work items over threads: one forward call's C Problem cut into work items, handed to
# fastattn's thread pool (fa_pool.h), and the workspace that the threads share out.
#
#   _forward          the work items of one call, over the pool (flash-decoding included)
#   _take_block,      the last call's workspace block, kept for the next small call
#   _return_block
#   _run              allocate the workspaces, release the GIL, run _forward
#
# Work decomposition
#   One work item = (batch element b, key/value head g, block of FA_BQ query rows).
#   The query rows of a work item are the rows of all Hq/Hkv query heads that share the
#   kv head g (row R -> head g*group + R // Lq, position R % Lq), so a GQA/MQA group reads
#   its K/V once and decode steps of a group fill one tile.  The threads of fastattn's
#   pool (fa_pool.h) claim items one at a time (causal tiles have unequal work).  When
#   there are fewer items than threads and several key chunks (a decode step of batch 1
#   with few kv heads), every (item, key chunk) pair is a work item instead
#   (flash-decoding).
#   A decode step of many short sequences has many small tiles: a work item is then a run
#   of `per` consecutive tiles (_tiles_per_item), so that each tile requests the next
#   one's first rows as it ends, and a thread's reads run on from tile to tile.  Which
#   thread runs a tile never changes its bits.
# Extra memory: one workspace per thread, O(FA_BQ * (D + Dv + FA_BK) + FA_BK * (D + Dv)),
# the last term a key block of 16-bit K/V widened; never O(Lq * Lk), nor a copy of K or V.
# Flash-decoding adds one chunk state per (item, chunk): O(items * Lk / FA_KCHUNK * rows
# * Dv), with fewer items than threads.

cdef extern from "fa_pool.h" nogil:
    ctypedef void (*fa_work_fn)(void* ctx, Py_ssize_t w, int tid) noexcept nogil
    const char* FA_POOL_BACKEND
    void fa_pool_run(int n_threads, Py_ssize_t n_work, fa_work_fn fn, void* ctx)
    int fa_pool_workers()
    void fa_pool_set_team(int team)
    int fa_pool_team()
    int fa_pool_set_in_torch(int on)

BLOCK_Q = FA_BQ
BLOCK_K = FA_BK


cdef struct Job:
    # One call's work items, as _forward hands them to the thread pool.
    const Problem* P
    void* workspace             # one block of ws_elems per thread (floating)
    Py_ssize_t ws_elems
    Py_ssize_t* row_idx         # 2 * FA_BQ per thread
    void* partial               # flash-decoding chunk states (floating), or NULL
    Py_ssize_t pst, nchunk, n_rblk
    Py_ssize_t per, n_tiles     # tiles per work item (_tiles_per_item), tiles in all
    Py_ssize_t ahead            # how many tiles ahead a tile requests rows (_tiles_ahead)


@cython.cdivision(True)   # every operand here is >= 0: C's division is Python's
cdef inline void _job_item(const Job* J, floating* workspace, Py_ssize_t w,
                           int tid) noexcept nogil:
    cdef const Problem* P = J.P
    cdef floating* partial = <floating*> J.partial
    cdef Py_ssize_t* idx = J.row_idx + tid * 2 * FA_BQ
    cdef Py_ssize_t item, rb, bg, tile, last
    if partial != NULL:
        # Flash-decoding: w is an (item, key chunk) pair; its chunk state goes to partial.
        item = w // J.nchunk
        rb = item % J.n_rblk
        bg = item // J.n_rblk
        _attend_tile(P, bg // P.Hkv, bg % P.Hkv, rb * FA_BQ, w % J.nchunk, partial + w * J.pst,
                     workspace + tid * J.ws_elems, idx, idx + FA_BQ, -1)
    else:
        # Last row blocks first: under causal masking they see the most keys, and the
        # dynamic claiming then ends on the cheap ones instead of waiting on a big one.
        last = min(w * J.per + J.per, J.n_tiles)
        for tile in range(w * J.per, last):
            rb = J.n_rblk - 1 - tile % J.n_rblk
            bg = tile // J.n_rblk
            _attend_tile(P, bg // P.Hkv, bg % P.Hkv, rb * FA_BQ, -1, NULL,
                         workspace + tid * J.ws_elems, idx, idx + FA_BQ,
                         bg + J.ahead if tile + J.ahead < last else -1)


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
    J.per = J.ahead = 1
    J.n_tiles = n_items
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
    J.per = _tiles_per_item(P, n_items, n_rblk, n_threads)
    J.ahead = _tiles_ahead(P)
    fa_pool_run(n_threads, (n_items + J.per - 1) // J.per,
                _job_item_f if floating is float else _job_item_d, &J)


cdef enum:
    # Keys a work item of short decode tiles covers at least, where the tiles allow it:
    # a few blocks of keys, enough for one tile's requests of the next one's rows to be
    # answered before it starts.
    ITEM_KEYS = 512
    # Work items per thread at least, so that the dynamic claiming still balances the
    # threads.
    ITEMS_PER_THREAD = 8


cdef inline Py_ssize_t _tiles_ahead(const Problem* P) noexcept nogil:
    # Whose rows a tile of a run requests as it ends: the next tile's; the one after it
    # where a tile is a single block of keys, too short for its requests to be answered
    # before the next one starts.
    return 2 if P.Lk <= FA_BK else 1


cdef inline Py_ssize_t _tiles_per_item(const Problem* P, Py_ssize_t n_tiles, Py_ssize_t n_rblk,
                                       int n_threads) noexcept nogil:
    # One tile a work item, except in decode steps (one row block per kv head): there runs
    # of tiles (consecutive kv heads of a sequence, then sequences), at least two and
    # ITEM_KEYS keys where the threads keep ITEMS_PER_THREAD items each.
    if n_rblk != 1:
        return 1
    return max(1, min(max(2, ITEM_KEYS // max(P.Lk, 1)),
                      n_tiles // (ITEMS_PER_THREAD * n_threads)))


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


cdef inline int _threads_for(Py_ssize_t n_threads, Py_ssize_t n_items) noexcept nogil:
    # "Not using less, not using more": a pass runs on no more threads than it has work
    # items, and on one at least (the forward, the backward and each backward pass).
    return <int> max(1, min(n_threads, n_items))


cdef int _run(Problem* P, bint is_float, object threads) except -1:
    """Allocate per-thread workspaces, release the GIL and run the kernel.

    threads: the thread count, or a function returning it, called only when the call has
    more than one work item to share (a single tile of rows and keys runs on one thread).
    """
    global _clock_ns
    P.int8_dot = _int8_dot_takes(P)
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
    n_threads = _threads_for(n_threads, n_items * nchunk if split else n_items)
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
    cdef timespec t0, t1
    if _clocked:
        clock_gettime(CLOCK_MONOTONIC, &t0)
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
        if _clocked:
            clock_gettime(CLOCK_MONOTONIC, &t1)
            _clock_ns += (t1.tv_sec - t0.tv_sec) * 1e9 + (t1.tv_nsec - t0.tv_nsec)
    return 0


# The time forward calls spend in the kernels (workspace, threads, tiles: _run), summed
# while the clock is on: a benchmark splits a serving step's time with it.
cdef bint _clocked = False
cdef double _clock_ns = 0


def kernel_clock(on=None):
    """The seconds forward calls have spent in the kernels since the clock was turned on;
    ``on`` turns it on (from zero) or off.  Off by default."""
    global _clocked, _clock_ns
    if on:
        _clock_ns = 0
    if on is not None:
        _clocked = bool(on)
    return _clock_ns * 1e-9
