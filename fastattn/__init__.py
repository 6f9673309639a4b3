"""fastattn -- scaled-dot-product attention for NumPy, as fused Cython/SIMD kernels.

Design
------
Attention is ``softmax(scale * q @ k.T + mask) @ v``.  Written as three NumPy calls it
stores the whole ``Lq x Lk`` score matrix and reads it three times; fastattn never stores
it.  One work item takes a block of query rows (all the query heads that share a key/value
head, so a GQA group reads its keys once) and streams over blocks of keys: a score tile,
the "finish scores" stage (softcap, ALiBi, float mask, then which keys the rows may see),
an online-softmax step that rescales what it has summed so far, and the weighted sum of
the values.  Memory beyond the result is a few tiles per thread.  The backward pass runs
the same stages from the forward's ``lse``: a pass over key blocks sums dK and dV, a pass
over query blocks sums dQ, each in a fixed order, so gradients are reproducible bit for
bit like the forward.

Every call has two halves.  The Python half decides whether the call is legal and what it
means: each argument has one rule, in :mod:`fastattn._calls.args`, which builds the whole call's
``Problem`` (dtypes, shapes, broadcast batch, normalised keywords) for every entry point
-- the kernels' front end, the NumPy oracle, ``attention_weights``, the backward and the
layers.  The compiled half never re-validates; it addresses the arrays in place (any
strides, broadcast batch dims, 16-bit K/V widened in registers) and runs the work items on
its own thread pool.  The commonest call skips the Python half: a gate in C recognises it
(plain float arrays, no mask or modifier) and hands anything else back, so both paths run
the same kernel on the same problem description and give the same bits.

The house
---------
Both call paths::

    attention(q, k, v, ...)            fastattn/_calls/api.py
      |-- lean gate (C) -----------+     src/calls/_lean_gate.pxi: attention_fast
      |-- Problem (args.py) -------+     one rule per argument; glue.py prepares the
      |   -> kernel.forward(p, ...)|     arrays; src/calls/_problem.pxi fills the C struct
                                   v     from the Problem's fields, by name
                        run step: Problem struct -> work items on the pool
                                   |     src/pipeline/_jobs.pxi, src/pool/fa_pool.h
                                   v
                        tile pipeline    src/pipeline/_tile_pipeline.pxi, fa_tile_impl.h
                        score tile -> finish scores -> softmax step -> output tile
                                         (visibility: fa_key_interval, one definition)

The package, a folder per concern:

- ``_calls/``      call resolution, the checked path of every call: ``api.py`` (``attention``,
                   ``attention_varlen``, ``attention_weights``, ``softmax``), ``args.py``
                   (every argument rule and the ``Problem`` of a call), ``glue.py`` (the
                   arrays as the kernel reads them), ``backward.py``, ``merge.py``
                   (``merge_attention``), ``precision.py`` (bfloat16 products and the
                   float32 opt-in; the int8 products' opt-in).
- ``_storage/``    storage kinds: ``kinds.py`` (the table the C kernels share,
                   src/kinds/fa_kinds.h) and ``quant.py`` (q8_0, q4_0, fp8).
- ``_serving/``    ``kvcache.py``: ``attention_with_kvcache`` and ``plan_kvcache`` (paged and
                   quantised caches, appended in place; a plan per decode step, run per
                   layer, its compiled half in src/calls/_plan.pxi).
- ``_machine/``    ``isa.py`` (the kernel variant the CPU runs), ``threads.py``
                   (``set_num_threads``, threadpoolctl), ``config.py`` (``show_config`` and
                   ``info``), ``version.py``.
- ``_layers/``     what ``layers.py`` keeps: ``cache.py`` (``KVCache``), ``state_dict.py``
                   (torch state dicts).
- ``reference.py`` the plain-NumPy oracle (float64, materialised scores), public for users
                   and tests; no other function computes through it.
- ``layers.py``, ``positions.py``: self-attention, ``MultiHeadAttention``, positions.
- ``integrations/`` torch (differentiable operations), transformers, TabPFN, Dask; each
                   imports its framework only when used.
- ``cli/``         ``python -m fastattn bench | info | demo``: imports the library, never
                   imported by it.

``src/`` is the kernel, compiled once per instruction set (``_kernel_<isa>.pyx`` include
``_kernel_impl.pxi``): ``calls/`` the compiled doors (the lean gate, the plan's run, the
entry points and the Problem struct), ``pipeline/`` the tile pipeline and its
micro-kernels, ``kinds/`` the storage kinds (the table, 16-bit and quantised loads, the
appends, the kernels by kind), ``isa/`` the instruction-set primitives (SIMD, bfloat16
dot products, AMX), ``pool/`` the thread pool.
"""
from ._machine.version import __version__
from ._calls.api import attention, attention_varlen, attention_weights, softmax
from ._calls.backward import attention_backward, attention_varlen_backward
from ._serving.kvcache import KVCachePlan, attention_with_kvcache, plan_kvcache
from ._storage.quant import (dequantize_fp8, dequantize_q4_0, dequantize_q8_0,
                             quantize_fp8, quantize_q4_0, quantize_q8_0)
from ._calls.merge import merge_attention
from ._machine.threads import get_num_threads, num_threads, set_num_threads
from ._calls.precision import (float32_precision, get_float32_precision, get_int8_dot_products,
                               set_float32_precision, set_int8_dot_products)
from ._machine.config import show_config
from . import reference
from .layers import KVCache, MultiHeadAttention, self_attention
from .positions import rope, sinusoidal_positions

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
