# Type stub of a compiled kernel variant.  The three variants (_kernel_base, _kernel_avx2,
# _kernel_avx512) are built from one Cython source (src/) with different compiler flags, so
# this file holds the signatures of all three: the other two stubs import everything from
# it.  Checked against each compiled module this CPU runs by tests/test_typing.py
# (mypy.stubtest).
from typing import Any, TypedDict

from typing_extensions import disjoint_base

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
BF16_DOT_BUILT: bool
BF16_DOT_CPU: bool
INT8_DOT_BUILT: bool
INT8_DOT_CPU: bool
INT8_DOT_VNNI: bool
DECODE_PREFETCH_L1: bool
AMX_BUILT: bool
AMX_VERIFIED: bool
AMX_MODES: dict[str, int]
POOL_TEAMS: tuple[str, ...]

class _PoolInfo(TypedDict):
    backend: str
    workers: int
    team: str

class _BuildInfo(TypedDict):
    isa: str
    compiler: str
    openmp: bool
    vector_bytes: int
    block_q: int
    block_k: int
    fma: bool

def kernel_layout(a: npt.NDArray[Any]) -> bool: ...
def forward(
    p: Any,
    *,
    q: npt.NDArray[np.floating[Any]],
    k: npt.NDArray[np.floating[Any]],
    v: npt.NDArray[np.floating[Any]],
    out: npt.NDArray[np.floating[Any]],
    lse: npt.NDArray[np.floating[Any]] | None,
    mask: npt.NDArray[Any] | None,
    n_threads: int,
) -> None: ...
def backward(
    p: Any,
    *,
    q: npt.NDArray[np.floating[Any]],
    k: npt.NDArray[np.floating[Any]],
    v: npt.NDArray[np.floating[Any]],
    out: npt.NDArray[np.floating[Any]],
    dout: npt.NDArray[np.floating[Any]],
    lse: npt.NDArray[np.floating[Any]],
    dlse: npt.NDArray[np.floating[Any]] | None,
    delta: npt.NDArray[np.floating[Any]],
    dq: npt.NDArray[np.floating[Any]],
    dk: npt.NDArray[np.floating[Any]],
    dv: npt.NDArray[np.floating[Any]],
    mask: npt.NDArray[Any] | None,
    n_threads: int,
) -> None: ...
def forward_kvcache(
    p: Any,
    *,
    q: npt.NDArray[Any],
    k_cache: npt.NDArray[Any],
    v_cache: npt.NDArray[Any],
    out: npt.NDArray[Any],
    lse: npt.NDArray[np.floating[Any]] | None,
    block_table: npt.NDArray[np.int32] | None,
    k_scale: npt.NDArray[np.uint16] | None,
    v_scale: npt.NDArray[np.uint16] | None,
    n_threads: int,
) -> None: ...
def kernel_clock(on: bool | None = None) -> float: ...
def quantize_rows(x: npt.NDArray[Any], values: npt.NDArray[Any],
                  scales: npt.NDArray[np.float16] | npt.NDArray[np.float32]) -> bool: ...
def storage_kinds() -> tuple[dict[str, Any], ...]: ...
def bf16_dot() -> bool: ...
def set_bf16_dot(on: bool) -> bool: ...
def bf16_dot_takes(D: int, Dv: int) -> bool: ...
def int8_dot() -> bool: ...
def set_int8_dot(on: bool) -> bool: ...
def amx_cpu() -> bool: ...
def amx_why_not() -> str | None: ...
def amx() -> str: ...
def set_amx(mode: str) -> str: ...
def amx_model_dp(c: npt.NDArray[np.float32], a: npt.NDArray[np.uint16],
                 b: npt.NDArray[np.uint16], sequential: bool = False) -> None: ...
def amx_hw_dp(c: npt.NDArray[np.float32], a: npt.NDArray[np.uint16],
              b: npt.NDArray[np.uint16]) -> None: ...
def amx_peak(steps: int) -> float: ...
def key_intervals(p: Any) -> tuple[npt.NDArray[np.intp], npt.NDArray[np.intp]]: ...
def lean_causal_codes(if_false: int, if_true: int) -> None: ...
def vector_tanh(x: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]: ...
def vector_exp2(x: npt.NDArray[np.floating[Any]], lanes8: bool = False) -> npt.NDArray[np.floating[Any]]: ...
def vector_widen(x: npt.NDArray[np.uint16], kind: str) -> npt.NDArray[np.float32]: ...
def vector_narrow(x: npt.NDArray[np.float32], kind: str) -> npt.NDArray[np.uint16]: ...
def build_info() -> _BuildInfo: ...
def omp_max_threads() -> int: ...
def pool_info() -> _PoolInfo: ...
def pool_set_team(team: str) -> None: ...
def pool_set_in_torch(on: bool) -> int: ...
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
    sinks: object = None,
) -> npt.NDArray[np.floating[Any]] | tuple[npt.NDArray[np.floating[Any]], npt.NDArray[np.floating[Any]]] | None: ...
@disjoint_base
class KVCachePlanBase:
    batch: int
    compiled: bool
    def _configure(
        self, seqlens: npt.NDArray[np.intp], block_table: npt.NDArray[np.int32] | None,
        causal: int, wl: int, wr: int, scale: float | None, softcap: float | None,
        cos32: npt.NDArray[np.float32] | None, sin32: npt.NDArray[np.float32] | None,
        interleaved: bool, rotate_q_per_row: bool, has_alibi: bool, n_threads: Any,
        precision: Any, compiled: bool,
    ) -> None: ...
    def _set_batch(self, seqlens: npt.NDArray[np.intp],
                   block_table: npt.NDArray[np.int32] | None) -> None: ...
    def _set_alibi(self, alibi: npt.NDArray[np.float64]) -> None: ...
    def _remember_pages(self, page: int, lnew: int, lo: int, hi: int) -> None: ...
    def run(
        self, q: Any, k_cache: Any, v_cache: Any, k: Any = None, v: Any = None, *,
        k_scale: Any = None, v_scale: Any = None, sinks: Any = None, return_lse: bool = False,
        out: Any = None,
    ) -> Any: ...
