# Stage 2, _load_block: a block's K and V rows, read in place or widened (16-bit, quantised,
# paged caches gathered).
# One stage file of the tile pipeline: _tile_pipeline.pxi includes them in order.

# ---------------------------------------------------------------------------- key block

cdef void _load_block(const Problem* P, Tile* t, const Workspace* w,
                      floating* ws) noexcept nogil:
    # The block's K and V rows as the kernels read them.  Stored in the compute type, or
    # in 16 bits where a float kernel widens them in registers (see widen_k), they are
    # read in place.  Otherwise 16-bit rows are widened into the workspace while the
    # next block's rows are prefetched: one pass over the block serves every row of the
    # tile.  Rows in pages or quantised are gathered into the workspace row by row
    # (_gather).  Widening is exact, and dequantising is one multiplication wherever it
    # happens (fa_quant.h), so the kernels compute the same bits whichever way a value
    # arrives.
    cdef Py_ssize_t nxt = max(0, min(FA_BK, t.tile_hi - t.j1))
    t.kblk_kind = t.vblk_kind = FA_STORE_NATIVE
    t.vblk_esz = sizeof(floating)
    if floating is float and t.quant_in_place:
        _gather_quant(P, t, w, ws)
        return
    if t.gather:
        _gather(P, t, w, ws)
    elif not t.widen_k:
        t.kblk, t.kblk_row, t.kblk_sj = t.kb + t.j0 * t.k_row, t.k_row, P.k_sj
        t.kblk_kind = P.k_kind
    else:
        widen_rows(P.k_kind, t.kb + t.j0 * t.k_row, P.k_sj, t.nj, P.D, ws + w.kblk, P.D,
                   t.kb + t.j1 * t.k_row, nxt)
    if t.widen_k:
        t.kblk, t.kblk_row, t.kblk_sj = <const char*> (ws + w.kblk), P.D * sizeof(floating), P.D
    elif t.copy_rows:
        t.kblk, t.kblk_row, t.kblk_sj = NULL, 0, 0      # K read through kptr (copy_rows)
        t.kblk_kind = P.k_kind
    if t.bf16_dot:
        # K read through row pointers; V in pairs of keys, the layout of the bfloat16
        # output tiles (fa_pack_v_pairs)
        if not t.gather:
            _row_pointers(t.kptr, t.kb + t.j0 * t.k_row, t.k_row, t.nj)
            _row_pointers(t.vptr, t.vb + t.j0 * t.v_row, t.v_row, t.nj)
        if floating is float and not P.backward and not t.v_pairs_rows:
            fa_pack_v_pairs(<const uint16_t* const*> t.vptr, t.nj, P.Dv, <uint32_t*> (ws + w.vblk))
            if t.amx:
                _zero_pairs_to(<uint32_t*> (ws + w.vblk), t.nj, _round_up(t.nj, 32), P.Dv)
        t.vblk, t.vblk_row, t.vblk_sj = <const char*> (ws + w.vblk), 0, 0
    elif t.copy_rows:
        t.vblk, t.vblk_row, t.vblk_sj = <const char*> (ws + w.vblk), P.Dv * P.v_isz, P.Dv
        t.vblk_kind, t.vblk_esz = P.v_kind, P.v_isz
    elif not t.widen_v:
        t.vblk, t.vblk_row, t.vblk_sj = t.vb + t.j0 * t.v_row, t.v_row, P.v_sj
        t.vblk_kind, t.vblk_esz = P.v_kind, P.v_isz
    else:
        if not t.gather:
            widen_rows(P.v_kind, t.vb + t.j0 * t.v_row, P.v_sj, t.nj, P.Dv, ws + w.vblk, P.Dv,
                       t.vb + t.j1 * t.v_row, nxt)
        t.vblk, t.vblk_row, t.vblk_sj = <const char*> (ws + w.vblk), P.Dv * sizeof(floating), P.Dv


cdef inline void _row_pointers(const char** ptr, const char* first, Py_ssize_t row,
                               Py_ssize_t n) noexcept nogil:
    cdef Py_ssize_t u
    for u in range(n):
        ptr[u] = first + u * row


cdef struct CacheRows:
    # Walks the rows of kv head g of batch element b in a cache, key after key: the element
    # offsets of K, V and their scales for key j (one division per page, not per row).
    Py_ssize_t j, page_left, k, v, ks, vs


cdef inline void _cache_seek(const Problem* P, const Tile* t, CacheRows* c,
                             Py_ssize_t j) noexcept nogil:
    # Point c at key j.
    _cache_seek_at(P, t.b, t.g, c, j)


cdef inline void _cache_seek_at(const Problem* P, Py_ssize_t b, Py_ssize_t g, CacheRows* c,
                                Py_ssize_t j) noexcept nogil:
    # Point c at key j of kv head g of batch element b.
    cdef Py_ssize_t page, i
    c.j = j
    if P.block_table == NULL:
        c.page_left = -1                         # no pages: rows are evenly spaced
        c.k = P.k_boff[b] + g * P.k_sh + j * P.k_sj
        c.v = P.v_boff[b] + g * P.v_sh + j * P.v_sj
        c.ks = b * P.ks_pst + g * P.ks_sh + j * P.ks_sj
        c.vs = b * P.vs_pst + g * P.vs_sh + j * P.vs_sj
        return
    page = P.block_table[b * P.bt_stride + j // P.page]
    i = j % P.page
    c.page_left = P.page - i
    c.k = page * P.k_pst + g * P.k_sh + i * P.k_sj
    c.v = page * P.v_pst + g * P.v_sh + i * P.v_sj
    c.ks = page * P.ks_pst + g * P.ks_sh + i * P.ks_sj
    c.vs = page * P.vs_pst + g * P.vs_sh + i * P.vs_sj


cdef inline Py_ssize_t _next_tile_keys(const Problem* P, const Tile* t,
                                       Py_ssize_t n) noexcept nogil:
    # Keys of the next tile's first block to request now: when this is the tile's last
    # block, up to n of them (its keys from 0: a hint, which a window may make useless but
    # never wrong); else 0.
    if t.next_b < 0 or t.j1 < t.tile_hi:
        return 0
    return min(n, FA_BK, P.kv_len[t.next_b])


cdef void _row_runs(const Problem* P, Py_ssize_t b, Py_ssize_t g, Py_ssize_t j, Py_ssize_t n,
                    const char** kp, const char** vp) noexcept nogil:
    # The K and V row pointers of keys j .. j + n - 1 of kv head g of batch element b, a
    # run of evenly spaced rows (a page's, or all of them) at a time.
    cdef CacheRows c
    cdef Py_ssize_t u = 0, m, i, kr = P.k_sj * P.k_isz, vr = P.v_sj * P.v_isz
    cdef const char* k
    cdef const char* v
    while u < n:
        _cache_seek_at(P, b, g, &c, j + u)
        m = n - u if c.page_left < 0 else min(n - u, c.page_left)
        k = P.k + c.k * P.k_isz
        v = P.v + c.v * P.v_isz
        for i in range(m):
            kp[u + i] = k + i * kr
            vp[u + i] = v + i * vr
        u += m


cdef inline void _cache_next(const Problem* P, const Tile* t, CacheRows* c) noexcept nogil:
    # Point c at the next key (which must exist: past a page it is looked up).
    c.page_left -= 1
    if c.page_left == 0:
        _cache_seek(P, t, c, c.j + 1)
        return
    c.j += 1
    c.k += P.k_sj
    c.v += P.v_sj
    c.ks += P.ks_sj
    c.vs += P.vs_sj


cdef void _gather(const Problem* P, Tile* t, const Workspace* w, floating* ws) noexcept nogil:
    # The block's K and V rows looked up one by one (pages), into kptr and vptr, and,
    # unless the bfloat16 products read them there, widened (or dequantised) into the
    # workspace; meanwhile the next block's rows are requested into L2, since
    # no hardware prefetcher follows rows across pages (or, spread_next, looked up into
    # kpf and vpf for the kernels to request).
    cdef Py_ssize_t u, nxt = max(0, min(FA_BK, t.tile_hi - t.j1))
    cdef floating* kdst = ws + w.kblk
    cdef floating* vdst = ws + w.vblk
    cdef CacheRows c, n
    if t.spread_next:
        # Row pointers only, a run at a time; the last block of a tile requests the next
        # tile's first rows instead.
        _row_runs(P, t.b, t.g, t.j0, t.nj, t.kptr, t.vptr)
        t.npf = min(nxt, t.nj)
        if t.npf:
            _row_runs(P, t.b, t.g, t.j1, t.npf, t.kpf, t.vpf)
        else:
            t.npf = _next_tile_keys(P, t, t.nj)
            _row_runs(P, t.next_b, t.next_g, 0, t.npf, t.kpf, t.vpf)
        return
    _cache_seek(P, t, &c, t.j0)
    if nxt:
        _cache_seek(P, t, &n, t.j1)
    t.npf = min(nxt, t.nj) if t.spread_next else 0
    for u in range(t.nj):
        t.kptr[u] = P.k + c.k * P.k_isz
        t.vptr[u] = P.v + c.v * P.v_isz
        if u < nxt:
            if t.spread_next:
                # requested as the kernels go: K by the score kernel, V by the output one
                t.kpf[u] = P.k + n.k * P.k_isz
                t.vpf[u] = P.v + n.v * P.v_isz
            else:
                # (a page's last row ends its run: page_left 1)
                fa_prefetch_row(P.k + n.k * P.k_isz, _row_bytes(P.k_kind, P.D, P.k_isz),
                                n.page_left == 1, 2)
                fa_prefetch_row(P.v + n.v * P.v_isz, _row_bytes(P.v_kind, P.Dv, P.v_isz),
                                n.page_left == 1, 2)
            if u + 1 < nxt:   # (never past the last key: its page may be the table's last)
                _cache_next(P, t, &n)
        if t.copy_rows:
            if not t.defer_v and not t.v_in_place:
                memcpy(<char*> vdst + u * P.Dv * P.v_isz, t.vptr[u], P.Dv * P.v_isz)
        elif floating is float and t.int8_dot:
            _key_scales(P, c.ks, <float*> kdst, u)
            if not t.defer_v:
                _gather_row(t.vptr[u], P.v_kind, P.v_scale + c.vs, t.vfs, P.Dv,
                            vdst + u * P.Dv)
        elif not t.bf16_dot:
            _gather_row(t.kptr[u], P.k_kind, P.k_scale + c.ks, t.kfs, P.D, kdst + u * P.D)
            if not t.defer_v:
                _gather_row(t.vptr[u], P.v_kind, P.v_scale + c.vs, t.vfs, P.Dv,
                            vdst + u * P.Dv)
        if u + 1 < t.nj:
            _cache_next(P, t, &c)
    if floating is float and t.int8_dot:
        for u in range(t.nj, _round_up(t.nj, FA_I8_KEYS)):   # padding keys: zero scales
            _key_scales(P, -1, <float*> kdst, u)
    if not nxt:
        _prefetch_next_tile(P, t)


cdef inline void _key_scales(const Problem* P, Py_ssize_t ks, float* ksc,
                             Py_ssize_t u) noexcept nogil:
    # Key u's block scales in float32 where the integer score kernel reads them,
    # transposed as fa_quant_rows lays them out (ksc[b * FA_BK + u]); ks < 0: zeros.
    cdef Py_ssize_t b
    for b in range(P.D // 32):
        ksc[b * FA_BK + u] = fa_f16_to_f32(P.k_scale[ks + b]) if ks >= 0 else 0


cdef void _prefetch_next_tile(const Problem* P, const Tile* t) noexcept nogil:
    # The next tile's first rows requested into L2 (see _next_tile_keys).
    cdef Py_ssize_t u, n = _next_tile_keys(P, t, FA_BK)
    cdef CacheRows c
    if n:
        _cache_seek_at(P, t.next_b, t.next_g, &c, 0)
    for u in range(n):
        fa_prefetch_row(P.k + c.k * P.k_isz, _row_bytes(P.k_kind, P.D, P.k_isz),
                        c.page_left == 1, 2)
        fa_prefetch_row(P.v + c.v * P.v_isz, _row_bytes(P.v_kind, P.Dv, P.v_isz),
                        c.page_left == 1, 2)
        if u + 1 < n:
            c.page_left -= 1
            if c.page_left == 0:
                _cache_seek_at(P, t.next_b, t.next_g, &c, u + 1)
            else:
                c.k += P.k_sj
                c.v += P.v_sj


cdef void _gather_quant(const Problem* P, Tile* t, const Workspace* w,
                        float* ws) noexcept nogil:
    # The block's quantised rows for the decode kernels that read them in place, run by
    # run of evenly spaced rows (a page, or the whole block): their pointers into kptr
    # and vptr, their scales in float32 into the workspace (kblk, vblk; see
    # fa_quant_rows), and the next block's row pointers into kpf and vpf.
    cdef Py_ssize_t u = 0, n, nbk = P.D // 32, nbv = P.Dv // 32, b
    cdef float* ksc = ws + w.kblk
    cdef float* vsc = ws + w.vblk
    cdef CacheRows c
    while u < t.nj:
        _cache_seek(P, t, &c, t.j0 + u)
        n = t.nj - u if c.page_left < 0 else min(t.nj - u, c.page_left)
        fa_quant_rows(P.k_kind, P.k + c.k, P.k_sj, P.k_scale + c.ks, P.ks_sj, nbk, t.kfs,
                      P.v + c.v, P.v_sj, P.v_scale + c.vs, P.vs_sj, nbv, t.vfs, n,
                      t.kptr + u, t.vptr + u, ksc + u, FA_BK, vsc + u * nbv)
        u += n
    for u in range(t.nj, _round_up(t.nj, 2 * t.VL)):   # padding keys' lanes: defined zeros
        for b in range(nbk):
            ksc[b * FA_BK + u] = 0
    t.npf = max(0, min(FA_BK, t.tile_hi - t.j1))
    cdef Py_ssize_t nb = t.b, ng = t.g, j1 = t.j1
    if not t.npf:
        # the tile's last block: the next tile's first rows instead
        t.npf = _next_tile_keys(P, t, FA_BK)
        nb, ng, j1 = t.next_b, t.next_g, 0
    u = 0
    while u < t.npf:
        _cache_seek_at(P, nb, ng, &c, j1 + u)
        n = t.npf - u if c.page_left < 0 else min(t.npf - u, c.page_left)
        fa_quant_next_rows(P.k_kind, P.k + c.k, P.k_sj, P.k_scale + c.ks, P.ks_sj, nbk,
                           P.v + c.v, P.v_sj, P.v_scale + c.vs, P.vs_sj, nbv, n,
                           t.kpf + u, t.vpf + u)
        u += n


cdef void _gather_v(const Problem* P, Tile* t, const Workspace* w,
                    floating* ws) noexcept nogil:
    # The block's V rows widened (or dequantised, or copied: copy_rows) into the
    # workspace, when _gather left them for after the softmax (defer_v).
    cdef Py_ssize_t u
    cdef CacheRows c
    _cache_seek(P, t, &c, t.j0)
    for u in range(t.nj):
        if t.copy_rows:
            memcpy(<char*> (ws + w.vblk) + u * P.Dv * P.v_isz, t.vptr[u], P.Dv * P.v_isz)
        else:
            _gather_row(t.vptr[u], P.v_kind, P.v_scale + c.vs, t.vfs, P.Dv,
                        ws + w.vblk + u * P.Dv)
        if u + 1 < t.nj:
            _cache_next(P, t, &c)


cdef inline Py_ssize_t _row_bytes(int kind, Py_ssize_t n, Py_ssize_t isz) noexcept nogil:
    # The bytes of a row of n values stored as `kind`, isz bytes per stored element.
    return fa_quant_row_bytes(kind, n) if FA_QUANTISED(kind) else n * isz


cdef inline void _gather_row(const char* src, int kind, const uint16_t* bscale, float fscale,
                             Py_ssize_t n, floating* dst) noexcept nogil:
    # One row of n values stored as `kind` in the compute type (bscale: its block scales;
    # fscale: its fp8 scale, see _fp8_scale).
    if kind == FA_STORE_NATIVE:
        memcpy(dst, src, n * sizeof(floating))
    elif FA_QUANTISED(kind):
        dequant_row(kind, src, bscale, fscale, n, dst)
    else:
        widen_rows(kind, src, 0, 1, n, dst, n, NULL, 0)
