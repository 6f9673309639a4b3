"""fastattn -- scaled-dot-product attention for NumPy, as fused Cython/SIMD kernels.

How the house is laid out
-------------------------
``attention(q, k, v, ...)`` is the product: one fused pass per block of query rows computes
scores, an online softmax and the weighted sum of values, with causal / sliding-window /
length / mask visibility, never materialising the Lq x Lk score matrix.

- ``fastattn/_api.py``      validates every argument (clear ValueError/TypeError before any
                            work), picks the compute dtype, maps broadcasting to offsets.
- ``src/_kernel_impl.pxi``  the Cython kernel: work items, the online-softmax loop.
- ``src/fa_pool.h``         the thread pool that runs the work items (shares cores politely).
- ``src/fa_kernels.h``      the visibility rule (one definition) and the SIMD micro-kernels
  ``src/fa_tile_impl.h``    (score tile, softmax step, output tile), compiled once per ISA.
- ``fastattn/_dispatch.py`` imports the best compiled variant for the running CPU.
- ``fastattn/_merge.py``    ``merge_attention``: partial results over disjoint keys, merged
                            exactly through their lse (sharded caches, dask).
- ``fastattn/reference.py`` the plain-NumPy oracle the tests and benchmarks compare with.
- ``fastattn/layers.py``, ``positions.py``: self-attention, multi-head attention with a KV
  cache, sinusoidal and rotary positions, all on the fused kernel.
"""
from importlib import metadata as _metadata

from ._api import attention, attention_varlen, attention_weights, softmax
from ._merge import merge_attention
from ._threads import get_num_threads, num_threads, set_num_threads
from . import reference
from .layers import KVCache, MultiHeadAttention, self_attention
from .positions import rope, sinusoidal_positions

try:
    __version__ = _metadata.version("fastattn")
except _metadata.PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0.1.0+unknown"

__all__ = [
    "attention", "attention_varlen", "attention_weights", "softmax", "merge_attention",
    "set_num_threads", "get_num_threads", "num_threads",
    "reference",
    "self_attention", "MultiHeadAttention", "KVCache",
    "sinusoidal_positions", "rope",
    "__version__",
]
