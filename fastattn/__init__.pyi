# Type stub of fastattn's public API.  The implementation modules carry no
# annotations; this stub is what type checkers see for ``import fastattn`` /
# ``from fastattn import ...``.  tests/test_typing.py checks it against the runtime with
# mypy.stubtest, so a renamed argument or a new public name fails the test suite.
from contextlib import AbstractContextManager
from collections.abc import Sequence
from typing import Any, Literal, overload

import numpy as np
import numpy.typing as npt

from . import reference as reference

__version__: str
__all__ = [
    "attention", "attention_varlen", "attention_weights", "softmax", "merge_attention",
    "attention_backward", "attention_varlen_backward",
    "attention_with_kvcache", "plan_kvcache", "KVCachePlan", "quantize_q8_0", "dequantize_q8_0",
    "quantize_q4_0", "dequantize_q4_0", "quantize_fp8", "dequantize_fp8",
    "set_num_threads", "get_num_threads", "num_threads",
    "set_float32_precision", "get_float32_precision", "float32_precision",
    "set_int8_dot_products", "get_int8_dot_products",
    "show_config", "reference",
    "self_attention", "MultiHeadAttention", "KVCache",
    "sinusoidal_positions", "rope",
    "__version__",
]

_Causal = bool | Literal["bottom-right", "top-left"]
_Window = tuple[int, int] | None
_Array = npt.NDArray[Any]
_Fp8Name = Literal["float8_e4m3fn", "float8_e5m2"]
_CacheFormat = Literal["q8_0", "q4_0", "float8_e4m3fn", "float8_e5m2"]

# -- core kernel --------------------------------------------------------------------------
@overload
def attention(
    q: npt.ArrayLike, k: npt.ArrayLike, v: npt.ArrayLike, *,
    scale: float | None = None, causal: _Causal = False, window: _Window = None,
    mask: npt.ArrayLike | None = None, kv_lengths: npt.ArrayLike | None = None,
    return_lse: Literal[False] = False, out: _Array | None = None,
    softcap: float | None = None, alibi_slopes: npt.ArrayLike | None = None,
    sinks: npt.ArrayLike | None = None, q_lengths: npt.ArrayLike | None = None,
) -> _Array: ...
@overload
def attention(
    q: npt.ArrayLike, k: npt.ArrayLike, v: npt.ArrayLike, *,
    scale: float | None = None, causal: _Causal = False, window: _Window = None,
    mask: npt.ArrayLike | None = None, kv_lengths: npt.ArrayLike | None = None,
    return_lse: Literal[True], out: _Array | None = None,
    softcap: float | None = None, alibi_slopes: npt.ArrayLike | None = None,
    sinks: npt.ArrayLike | None = None, q_lengths: npt.ArrayLike | None = None,
) -> tuple[_Array, _Array]: ...
@overload
def attention(
    q: npt.ArrayLike, k: npt.ArrayLike, v: npt.ArrayLike, *,
    scale: float | None = None, causal: _Causal = False, window: _Window = None,
    mask: npt.ArrayLike | None = None, kv_lengths: npt.ArrayLike | None = None,
    return_lse: bool = False, out: _Array | None = None,
    softcap: float | None = None, alibi_slopes: npt.ArrayLike | None = None,
    sinks: npt.ArrayLike | None = None, q_lengths: npt.ArrayLike | None = None,
) -> _Array | tuple[_Array, _Array]: ...
@overload
def attention_varlen(
    q: npt.ArrayLike, k: npt.ArrayLike, v: npt.ArrayLike, cu_seqlens_q: npt.ArrayLike,
    cu_seqlens_k: npt.ArrayLike, *, scale: float | None = None, causal: _Causal = False,
    window: _Window = None, softcap: float | None = None,
    alibi_slopes: npt.ArrayLike | None = None, sinks: npt.ArrayLike | None = None,
    return_lse: Literal[False] = False, out: _Array | None = None,
) -> _Array: ...
@overload
def attention_varlen(
    q: npt.ArrayLike, k: npt.ArrayLike, v: npt.ArrayLike, cu_seqlens_q: npt.ArrayLike,
    cu_seqlens_k: npt.ArrayLike, *, scale: float | None = None, causal: _Causal = False,
    window: _Window = None, softcap: float | None = None,
    alibi_slopes: npt.ArrayLike | None = None, sinks: npt.ArrayLike | None = None,
    return_lse: Literal[True], out: _Array | None = None,
) -> tuple[_Array, _Array]: ...
@overload
def attention_varlen(
    q: npt.ArrayLike, k: npt.ArrayLike, v: npt.ArrayLike, cu_seqlens_q: npt.ArrayLike,
    cu_seqlens_k: npt.ArrayLike, *, scale: float | None = None, causal: _Causal = False,
    window: _Window = None, softcap: float | None = None,
    alibi_slopes: npt.ArrayLike | None = None, sinks: npt.ArrayLike | None = None,
    return_lse: bool = False, out: _Array | None = None,
) -> _Array | tuple[_Array, _Array]: ...
def attention_weights(
    q: npt.ArrayLike, k: npt.ArrayLike, *,
    scale: float | None = None, causal: _Causal = False, window: _Window = None,
    mask: npt.ArrayLike | None = None, kv_lengths: npt.ArrayLike | None = None,
    softcap: float | None = None, alibi_slopes: npt.ArrayLike | None = None,
    sinks: npt.ArrayLike | None = None, q_lengths: npt.ArrayLike | None = None,
) -> _Array: ...
def softmax(x: npt.ArrayLike, axis: int = -1) -> _Array: ...
def merge_attention(
    outs: Sequence[npt.ArrayLike], lses: Sequence[npt.ArrayLike]
) -> tuple[_Array, _Array]: ...

# -- serving caches ------------------------------------------------------------------------
@overload
def attention_with_kvcache(
    q: npt.ArrayLike, k_cache: _Array, v_cache: _Array, k: npt.ArrayLike | None = None,
    v: npt.ArrayLike | None = None, *, cache_seqlens: npt.ArrayLike,
    block_table: npt.ArrayLike | None = None, k_scale: _Array | None = None,
    v_scale: _Array | None = None, rotary_cos: npt.ArrayLike | None = None,
    rotary_sin: npt.ArrayLike | None = None, rotary_interleaved: bool = False,
    scale: float | None = None, causal: bool | Literal["bottom-right"] = False,
    window: _Window = None, softcap: float | None = None,
    alibi_slopes: npt.ArrayLike | None = None, sinks: npt.ArrayLike | None = None,
    return_lse: Literal[False] = False, out: _Array | None = None,
) -> _Array: ...
@overload
def attention_with_kvcache(
    q: npt.ArrayLike, k_cache: _Array, v_cache: _Array, k: npt.ArrayLike | None = None,
    v: npt.ArrayLike | None = None, *, cache_seqlens: npt.ArrayLike,
    block_table: npt.ArrayLike | None = None, k_scale: _Array | None = None,
    v_scale: _Array | None = None, rotary_cos: npt.ArrayLike | None = None,
    rotary_sin: npt.ArrayLike | None = None, rotary_interleaved: bool = False,
    scale: float | None = None, causal: bool | Literal["bottom-right"] = False,
    window: _Window = None, softcap: float | None = None,
    alibi_slopes: npt.ArrayLike | None = None, sinks: npt.ArrayLike | None = None,
    return_lse: Literal[True], out: _Array | None = None,
) -> tuple[_Array, _Array]: ...
@overload
def attention_with_kvcache(
    q: npt.ArrayLike, k_cache: _Array, v_cache: _Array, k: npt.ArrayLike | None = None,
    v: npt.ArrayLike | None = None, *, cache_seqlens: npt.ArrayLike,
    block_table: npt.ArrayLike | None = None, k_scale: _Array | None = None,
    v_scale: _Array | None = None, rotary_cos: npt.ArrayLike | None = None,
    rotary_sin: npt.ArrayLike | None = None, rotary_interleaved: bool = False,
    scale: float | None = None, causal: bool | Literal["bottom-right"] = False,
    window: _Window = None, softcap: float | None = None,
    alibi_slopes: npt.ArrayLike | None = None, sinks: npt.ArrayLike | None = None,
    return_lse: bool = False, out: _Array | None = None,
) -> _Array | tuple[_Array, _Array]: ...
class KVCachePlan:
    batch: int
    compiled: bool
    def __init__(
        self, *, cache_seqlens: npt.ArrayLike, block_table: npt.ArrayLike | None = None,
        rotary_cos: npt.ArrayLike | None = None, rotary_sin: npt.ArrayLike | None = None,
        rotary_interleaved: bool = False, scale: float | None = None,
        causal: bool | Literal["bottom-right"] = False, window: _Window = None,
        softcap: float | None = None, alibi_slopes: npt.ArrayLike | None = None,
    ) -> None: ...
    @overload
    def run(
        self, q: npt.ArrayLike, k_cache: _Array, v_cache: _Array,
        k: npt.ArrayLike | None = None, v: npt.ArrayLike | None = None, *,
        k_scale: _Array | None = None, v_scale: _Array | None = None,
        sinks: npt.ArrayLike | None = None, return_lse: Literal[False] = False,
        out: _Array | None = None,
    ) -> _Array: ...
    @overload
    def run(
        self, q: npt.ArrayLike, k_cache: _Array, v_cache: _Array,
        k: npt.ArrayLike | None = None, v: npt.ArrayLike | None = None, *,
        k_scale: _Array | None = None, v_scale: _Array | None = None,
        sinks: npt.ArrayLike | None = None, return_lse: Literal[True],
        out: _Array | None = None,
    ) -> tuple[_Array, _Array]: ...
    @overload
    def run(
        self, q: npt.ArrayLike, k_cache: _Array, v_cache: _Array,
        k: npt.ArrayLike | None = None, v: npt.ArrayLike | None = None, *,
        k_scale: _Array | None = None, v_scale: _Array | None = None,
        sinks: npt.ArrayLike | None = None, return_lse: bool = False,
        out: _Array | None = None,
    ) -> _Array | tuple[_Array, _Array]: ...
def plan_kvcache(
    *, cache_seqlens: npt.ArrayLike, block_table: npt.ArrayLike | None = None,
    rotary_cos: npt.ArrayLike | None = None, rotary_sin: npt.ArrayLike | None = None,
    rotary_interleaved: bool = False, scale: float | None = None,
    causal: bool | Literal["bottom-right"] = False, window: _Window = None,
    softcap: float | None = None, alibi_slopes: npt.ArrayLike | None = None,
) -> KVCachePlan: ...
def quantize_q8_0(x: npt.ArrayLike) -> tuple[npt.NDArray[np.int8], npt.NDArray[np.float16]]: ...
def dequantize_q8_0(values: npt.ArrayLike, scales: npt.ArrayLike) -> npt.NDArray[np.float32]: ...
def quantize_q4_0(x: npt.ArrayLike) -> tuple[npt.NDArray[np.uint8], npt.NDArray[np.float16]]: ...
def dequantize_q4_0(values: npt.ArrayLike, scales: npt.ArrayLike) -> npt.NDArray[np.float32]: ...
def quantize_fp8(x: npt.ArrayLike, scale: float | npt.ArrayLike = 1.0,
                 dtype: _Fp8Name | npt.DTypeLike = "float8_e4m3fn") -> _Array: ...
def dequantize_fp8(values: npt.ArrayLike,
                   scale: float | npt.ArrayLike = 1.0) -> npt.NDArray[np.float32]: ...

# -- gradients ----------------------------------------------------------------------------
# (dq, dk, dv), and dsinks last when sinks are given
def attention_backward(
    dout: npt.ArrayLike, q: npt.ArrayLike, k: npt.ArrayLike, v: npt.ArrayLike,
    out: npt.ArrayLike, lse: npt.ArrayLike, *,
    scale: float | None = None, causal: _Causal = False, window: _Window = None,
    mask: npt.ArrayLike | None = None, kv_lengths: npt.ArrayLike | None = None,
    q_lengths: npt.ArrayLike | None = None, softcap: float | None = None,
    alibi_slopes: npt.ArrayLike | None = None, sinks: npt.ArrayLike | None = None,
    dlse: npt.ArrayLike | None = None,
) -> tuple[_Array, ...]: ...
def attention_varlen_backward(
    dout: npt.ArrayLike, q: npt.ArrayLike, k: npt.ArrayLike, v: npt.ArrayLike,
    out: npt.ArrayLike, lse: npt.ArrayLike, cu_seqlens_q: npt.ArrayLike,
    cu_seqlens_k: npt.ArrayLike, *, scale: float | None = None, causal: _Causal = False,
    window: _Window = None, softcap: float | None = None,
    alibi_slopes: npt.ArrayLike | None = None, sinks: npt.ArrayLike | None = None,
    dlse: npt.ArrayLike | None = None,
) -> tuple[_Array, ...]: ...

# -- threads ------------------------------------------------------------------------------
def set_num_threads(n: int) -> None: ...
def get_num_threads() -> int: ...
def num_threads(n: int) -> AbstractContextManager[int]: ...

# -- precision of float32 calls -----------------------------------------------------------
def set_float32_precision(precision: Literal["float32", "bfloat16"]) -> str: ...
def get_float32_precision() -> str: ...
def set_int8_dot_products(enabled: bool) -> bool: ...
def get_int8_dot_products() -> bool: ...
class float32_precision:
    precision: str
    previous: str | None
    def __init__(self, precision: Literal["float32", "bfloat16"]) -> None: ...
    def __enter__(self) -> float32_precision: ...
    def __exit__(self, *exc: object) -> None: ...

# -- what this process runs ---------------------------------------------------------------
def show_config(file: Any = None) -> None: ...

# -- layers -------------------------------------------------------------------------------
def self_attention(
    x: npt.ArrayLike,
    w_q: npt.ArrayLike | None = None, w_k: npt.ArrayLike | None = None,
    w_v: npt.ArrayLike | None = None, w_o: npt.ArrayLike | None = None,
    *, scale: float | None = None, causal: _Causal = False,
) -> _Array: ...

class KVCache:
    def __init__(self, capacity: int = 64, *, growth: float = 2.0,
                 dtype: npt.DTypeLike | _CacheFormat | None = None,
                 k_scale: float | npt.ArrayLike | None = None,
                 v_scale: float | npt.ArrayLike | None = None) -> None: ...
    def reset(self) -> None: ...
    @property
    def dtype(self) -> np.dtype[Any] | Literal["q8_0", "q4_0"] | None: ...
    @property
    def format(self) -> Literal["q8_0", "q4_0", "fp8"] | None: ...
    @property
    def quantized(self) -> bool: ...
    def dequantized(
        self, length: int | None = None
    ) -> tuple[_Array, _Array] | tuple[None, None]: ...
    def scales(
        self, length: int | None = None
    ) -> tuple[_Array, _Array] | tuple[None, None]: ...
    @property
    def capacity(self) -> int: ...
    @property
    def lengths(self) -> npt.NDArray[np.int64]: ...
    @property
    def max_length(self) -> int: ...
    def __len__(self) -> int: ...
    def keys_values(
        self, length: int | None = None
    ) -> tuple[_Array, _Array] | tuple[None, None]: ...
    @property
    def k(self) -> _Array | None: ...
    @property
    def v(self) -> _Array | None: ...
    @property
    def batch_shape(self) -> tuple[int, ...] | None: ...
    def append(
        self, k: npt.ArrayLike, v: npt.ArrayLike, lengths: npt.ArrayLike | None = None
    ) -> npt.NDArray[np.int64]: ...

class MultiHeadAttention:
    d_model: int
    n_heads: int
    n_kv_heads: int
    d_head: int
    d_value: int
    dtype: np.dtype[Any]
    scale: float | None
    rope: bool
    rope_base: float
    w_q: _Array
    w_k: _Array
    w_v: _Array
    w_o: _Array
    b_q: _Array | None
    b_k: _Array | None
    b_v: _Array | None
    b_o: _Array | None
    window: tuple[int, int] | None
    softcap: float | None
    sinks: _Array | None
    kv_dtype: np.dtype[Any] | Literal["q8_0", "q4_0"] | None
    def __init__(
        self, d_model: int, n_heads: int, *, n_kv_heads: int | None = None,
        d_head: int | None = None, d_value: int | None = None, bias: bool = False,
        dtype: npt.DTypeLike = ..., seed: int | np.random.Generator | None = None,
        scale: float | None = None, rope: bool = False, rope_base: float = 10000.0,
        window: tuple[int, int] | None = None, softcap: float | None = None,
        sinks: bool = False, kv_dtype: npt.DTypeLike | _CacheFormat | None = None,
    ) -> None: ...
    @overload
    def __call__(
        self, x: npt.ArrayLike, *, causal: _Causal = False, mask: npt.ArrayLike | None = None,
        kv_lengths: npt.ArrayLike | None = None, cache: None = None,
        positions: npt.ArrayLike | None = None,
    ) -> _Array: ...
    @overload
    def __call__(
        self, x: npt.ArrayLike, *, causal: _Causal = False, mask: npt.ArrayLike | None = None,
        kv_lengths: npt.ArrayLike | None = None, cache: KVCache,
        positions: npt.ArrayLike | None = None,
    ) -> tuple[_Array, KVCache]: ...
    def attention_weights(
        self, x: npt.ArrayLike, *, causal: _Causal = False, mask: npt.ArrayLike | None = None,
        kv_lengths: npt.ArrayLike | None = None,
    ) -> _Array: ...
    @classmethod
    def from_torch_state_dict(
        cls, state_dict: Any, n_heads: int, *, prefix: str = "",
        dtype: npt.DTypeLike | None = None, **kwargs: Any,
    ) -> MultiHeadAttention: ...

# -- positions ----------------------------------------------------------------------------
def sinusoidal_positions(
    length: int, d_model: int, base: float = 10000.0, *, dtype: npt.DTypeLike = ...
) -> _Array: ...
def rope(
    x: npt.ArrayLike, positions: npt.ArrayLike | None = None, base: float = 10000.0
) -> _Array: ...
