"""The bench's shapes, their work (FLOPs, bytes), their inputs and their tolerances.

No relative imports: ``tools/ab_*.py`` load this file on its own beside an older build.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

SEED = 20240607

# The quantised cache types (see caches.py) and their stored bytes per value: q8_0 and
# q4_0 add a float16 scale per 32 values; fp8 is float8_e4m3fn with a scale per kv head.
CACHE_BYTES_PER_VALUE = {"q8_0": 34 / 32, "q4_0": 18 / 32, "fp8": 1.0}


def is_cache_type(dtype):
    return dtype in CACHE_BYTES_PER_VALUE


@dataclass(frozen=True)
class Shape:
    """One benchmark case (batch 1)."""

    name: str
    hq: int
    hkv: int
    lq: int
    lk: int
    d: int
    causal: bool = False
    dtype: str = "float32"

    @property
    def dv(self):
        return self.d

    @property
    def decode(self):
        # One query row against a long cache: bandwidth-bound, reported in GB/s.
        return self.lq == 1

    @property
    def half(self):
        # q, k, v stored in 16 bits (float16 or bfloat16), computed in float32.
        return self.dtype in ("float16", "bfloat16")

    @property
    def quantized(self):
        # K and V in a quantised cache (attention_with_kvcache: q8_0, q4_0 or fp8, see
        # caches.py), q and the output in float32.
        return is_cache_type(self.dtype)

    def np_dtype(self):
        """The NumPy dtype of the inputs (bfloat16 needs ml_dtypes: TypeError without); a
        quantised cache's inputs are float32, quantised by the measurement."""
        from fastattn._calls.args import storage_dtype
        if self.dtype == "fp8":
            try:
                import ml_dtypes  # noqa: F401  (the cache's float8_e4m3fn)
            except ImportError:
                raise TypeError("an fp8 cache needs ml_dtypes (pip install ml_dtypes)") from None
        return storage_dtype("float32" if self.quantized else self.dtype)

    def describe(self):
        tag = {"float64": " f64", "float16": " f16", "bfloat16": " bf16"}.get(
            self.dtype, f" {self.dtype}" if self.quantized else "")
        return (f"({self.hq},{self.hkv},{self.lq},{self.lk},{self.d})"
                f"{' causal' if self.causal else ''}{tag}")


SHAPES = (
    Shape("tiny", 1, 1, 6, 6, 3),
    Shape("small", 8, 8, 128, 128, 64),
    Shape("prefill-1k", 12, 12, 1024, 1024, 64),
    Shape("prefill-1k-causal", 12, 12, 1024, 1024, 64, causal=True),
    Shape("prefill-4k-causal", 4, 4, 4096, 4096, 64, causal=True),
    Shape("long-8k", 1, 1, 8192, 8192, 64),
    Shape("decode-4k", 32, 32, 1, 4096, 128),
    Shape("decode-gqa-8k", 32, 8, 1, 8192, 128),
    Shape("prefill-1k-f64", 12, 12, 1024, 1024, 64, causal=True, dtype="float64"),
    Shape("decode-4k-f16", 32, 32, 1, 4096, 128, dtype="float16"),
    Shape("decode-4k-bf16", 32, 32, 1, 4096, 128, dtype="bfloat16"),
    Shape("decode-gqa-8k-f16", 32, 8, 1, 8192, 128, dtype="float16"),
    Shape("decode-4k-q8_0", 32, 32, 1, 4096, 128, dtype="q8_0"),
    Shape("decode-gqa-8k-q8_0", 32, 8, 1, 8192, 128, dtype="q8_0"),
    Shape("decode-4k-q4_0", 32, 32, 1, 4096, 128, dtype="q4_0"),
    Shape("decode-gqa-8k-q4_0", 32, 8, 1, 8192, 128, dtype="q4_0"),
    Shape("decode-4k-fp8", 32, 32, 1, 4096, 128, dtype="fp8"),
    Shape("decode-gqa-8k-fp8", 32, 8, 1, 8192, 128, dtype="fp8"),
    Shape("prefill-1k-f16", 12, 12, 1024, 1024, 64, dtype="float16"),
    Shape("prefill-1k-bf16", 12, 12, 1024, 1024, 64, dtype="bfloat16"),
    Shape("prefill-1k-causal-bf16", 12, 12, 1024, 1024, 64, causal=True, dtype="bfloat16"),
    Shape("prefill-4k-causal-bf16", 4, 4, 4096, 4096, 64, causal=True, dtype="bfloat16"),
)
SHAPES_BY_NAME = {s.name: s for s in SHAPES}

# The backward table's shapes (``bench --backward``); tiny checks the tool itself.
BACKWARD_SHAPES = tuple(SHAPES_BY_NAME[n] for n in (
    "tiny", "small", "prefill-1k", "prefill-1k-causal", "prefill-4k-causal")) + (
    Shape("prefill-gqa-1k-causal", 16, 4, 1024, 1024, 128, causal=True),
    SHAPES_BY_NAME["prefill-1k-causal-bf16"],
)
BACKWARD_SHAPES_BY_NAME = {s.name: s for s in BACKWARD_SHAPES}
GRADIENTS = ("dq", "dk", "dv")      # what a backward call returns, in this order

# The reference materialises (Hq, Lq, Lk) float64 scores: seconds per call on these.
QUICK_SKIP_REFERENCE = frozenset({"long-8k", "prefill-4k-causal", "prefill-4k-causal-bf16"})


def parse_shapes(text, catalogue=SHAPES):
    """The shapes of ``catalogue`` named in ``"a,b,..."`` (all of them for an empty text);
    ValueError naming the unknown ones."""
    if not text:
        return list(catalogue)
    by_name = {s.name: s for s in catalogue}
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in by_name]
    if unknown or not names:
        raise ValueError(f"unknown shape(s) {', '.join(unknown) or '(none given)'}; "
                         f"choose from {', '.join(by_name)}")
    return [by_name[n] for n in names]


def visible_pairs(shape):
    """Number of (query, key) pairs the mask leaves visible, per head."""
    if not shape.causal:
        return shape.lq * shape.lk
    # Bottom-right alignment: query i sees keys j <= i + (Lk - Lq).
    offset = shape.lk - shape.lq
    return sum(min(shape.lk, max(0, i + offset + 1)) for i in range(shape.lq))


def flops(shape, batch=1):
    """Floating-point operations of one call: a multiply-add per element of both products."""
    return 2 * (shape.d + shape.dv) * batch * shape.hq * visible_pairs(shape)


def bytes_moved(shape, batch=1):
    """Bytes one call must read or write at least once: K, V, Q and the output."""
    itemsize = 2 if shape.half else np.dtype(shape.np_dtype()).itemsize
    kv_itemsize = CACHE_BYTES_PER_VALUE[shape.dtype] if shape.quantized else itemsize
    kv = batch * shape.hkv * shape.lk * (shape.d + shape.dv)
    qo = batch * shape.hq * shape.lq * (shape.d + shape.dv)
    return int(kv * kv_itemsize + qo * itemsize)


def backward_flops(shape):
    """Floating-point operations of one backward call, counted as 2.5 forwards: its five
    products (S, dP, dV, dQ, dK) against the forward's two."""
    return 5 * flops(shape) // 2


def backward_bytes(shape):
    """Bytes one backward call must read or write at least once: q, k, v, out and dout
    read, dq, dk and dv written (the per-row lse aside), twice a forward's."""
    return 2 * bytes_moved(shape)


def make_inputs(shape, seed=SEED):
    """q, k, v of ``shape`` (batch 1), standard normal, C-contiguous, fixed seed."""
    rng = np.random.default_rng(seed)
    dt = shape.np_dtype()
    q = rng.standard_normal((1, shape.hq, shape.lq, shape.d)).astype(dt)
    k = rng.standard_normal((1, shape.hkv, shape.lk, shape.d)).astype(dt)
    v = rng.standard_normal((1, shape.hkv, shape.lk, shape.dv)).astype(dt)
    return q, k, v


def make_backward_inputs(shape, seed=SEED):
    """q, k, v as :func:`make_inputs` gives them, and a standard normal ``dout`` of the
    output's shape (its own seed)."""
    rng = np.random.default_rng(seed + 1)
    dout = rng.standard_normal((1, shape.hq, shape.lq, shape.dv)).astype(shape.np_dtype())
    return make_inputs(shape, seed) + (dout,)


def tolerance(dtype):
    """Largest difference from torch or the reference that passes, relative to max|want|."""
    # float32 kernels reorder sums (online softmax, blocking): ~1e-6 relative error is
    # normal, 1e-4 catches any real mistake. float64 is checked accordingly tighter; 16-bit
    # results are float32 results rounded once: two ulps of float16 (2**-10) or bfloat16
    # (2**-7) leave room for the other library's rounding.  A quantised cache is checked
    # against the reference over its stored values, which it computes in float32.
    if is_cache_type(str(dtype)):
        return 1e-4
    return {"float32": 1e-4, "float64": 1e-9, "float16": 2e-3, "bfloat16": 1.6e-2}[str(dtype)]


def reference_slice(shape, q, k, v):
    """Two heads (first and last, keeping the GQA head mapping) x the last <= 64 query rows.

    Taking the *last* rows keeps the bottom-right causal alignment: with Lq' = m rows, row i'
    sees j <= i' + Lk - m, the same keys as row i' + Lq - m of the full problem.
    """
    heads_q = [0] if shape.hq == 1 else [0, shape.hq - 1]
    heads_kv = [0] if shape.hkv == 1 else [0, shape.hkv - 1]
    rows = min(shape.lq, 64)
    qs = q[:, heads_q, shape.lq - rows:, :]
    ks = k[:, heads_kv]
    vs = v[:, heads_kv]
    return (qs, ks, vs), (heads_q, rows)
