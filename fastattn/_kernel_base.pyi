# Type stub of a compiled kernel variant.  fastattn/_kernel_base.pyi, _kernel_avx2.pyi and
# _kernel_avx512.pyi are identical: the three modules are built from one source
# (src/_kernel_impl.pxi) with different compiler flags.  Checked against the compiled
# modules by tests/test_typing.py (mypy.stubtest).
from typing import Any, TypedDict

import numpy as np
import numpy.typing as npt

MASK_NONE: int
MASK_BOOL: int
MASK_ADD: int
CAUSAL_NONE: int
CAUSAL_BOTTOM_RIGHT: int
CAUSAL_TOP_LEFT: int
BLOCK_Q: int
BLOCK_K: int

class _PoolInfo(TypedDict):
    backend: str
    workers: int

class _BuildInfo(TypedDict):
    isa: str
    compiler: str
    openmp: bool
    vector_bytes: int
    block_q: int
    block_k: int

def forward(
    q: npt.NDArray[np.floating[Any]],
    k: npt.NDArray[np.floating[Any]],
    v: npt.NDArray[np.floating[Any]],
    out: npt.NDArray[np.floating[Any]],
    lse: npt.NDArray[np.floating[Any]] | None,
    mask: npt.NDArray[Any] | None,
    mask_kind: int,
    q_boff: npt.NDArray[np.intp],
    k_boff: npt.NDArray[np.intp],
    v_boff: npt.NDArray[np.intp],
    o_boff: npt.NDArray[np.intp],
    lse_boff: npt.NDArray[np.intp],
    m_boff: npt.NDArray[np.intp],
    kv_len: npt.NDArray[np.intp],
    nbatch: int,
    causal: int,
    wl: int,
    wr: int,
    scale: float,
    n_threads: int,
) -> None: ...
def key_intervals(
    Lq: int, kv_len: npt.NDArray[np.intp], causal: int, wl: int, wr: int
) -> tuple[npt.NDArray[np.intp], npt.NDArray[np.intp]]: ...
def vector_exp2(x: npt.NDArray[np.floating[Any]]) -> npt.NDArray[np.floating[Any]]: ...
def build_info() -> _BuildInfo: ...
def omp_max_threads() -> int: ...
def pool_info() -> _PoolInfo: ...
def cpu_supports(isa: str) -> bool: ...
def attention_fast(
    q: object,
    k: object,
    v: object,
    scale: float | None,
    causal: bool | str,
    return_lse: bool,
    out: npt.NDArray[np.floating[Any]] | None,
    n_threads: int,
) -> npt.NDArray[np.floating[Any]] | tuple[npt.NDArray[np.floating[Any]], npt.NDArray[np.floating[Any]]] | None: ...
