"""fastattn, the NumPy reference and PyTorch side by side, one benchmark group per bench
shape (see fastattn/cli/bench/shapes.py for the shapes and `python -m fastattn bench` for
the table with GFLOP/s and speed-ups); and the backward pass of fastattn and torch, one
group per shape of `python -m fastattn bench --backward` (named "<shape> backward").

Inputs are made once per shape (cached), outside the timed region; every library runs on
the same thread count. pytest-benchmark runs its rounds back to back after a warm-up
round, which plays the part of the bench's untimed wake-up call.
"""
import functools

import numpy as np
import pytest

import fastattn
from fastattn import reference
from fastattn.cli.bench.backward import fastattn_backward_call, oracle_gradients, \
    relative_errors, torch_backward_call
from fastattn.cli.bench.harness import to_torch
from fastattn.cli.bench.measure import torch_keywords
from fastattn.cli.bench.shapes import BACKWARD_SHAPES, SHAPES, make_backward_inputs, \
    make_inputs, reference_slice, tolerance

# Shapes that finish in well under a second for every library, the reference included;
# the others are marked "big" and skipped by --bench-quick.
QUICK_SHAPES = frozenset({"tiny", "small", "decode-4k"})


def _runnable(shape):
    try:
        shape.np_dtype()
    except TypeError as exc:   # bfloat16 without ml_dtypes
        return [pytest.mark.skip(reason=str(exc))]
    return []


def shape_params(shapes=SHAPES, group=""):
    """One pytest.param per shape (the float16/bfloat16 ones too), each its own group: the
    shape's name followed by ``group``."""
    return [pytest.param(s, id=s.name,
                         marks=[pytest.mark.benchmark(group=s.name + group, warmup=True,
                                                      warmup_iterations=1)]
                         + _runnable(s) + ([] if s.name in QUICK_SHAPES else [pytest.mark.big]))
            for s in shapes]


@functools.lru_cache(maxsize=None)
def _inputs(shape):
    # Made once per shape (all of them together are < 50 MB), outside any timed region.
    return make_inputs(shape)


# Reference: float64 score matrix of (Hq, Lq, Lk). long-8k is skipped (several seconds and
# ~2 GB per call); prefill-4k-causal runs a single round.
REFERENCE_SKIP = {"long-8k": "reference materialises an 8192x8192 float64 score matrix "
                             "(seconds and GBs per call); see `python -m fastattn bench`"}
REFERENCE_ROUNDS = {"prefill-4k-causal": 1, "prefill-1k": 2, "prefill-1k-causal": 2,
                    "prefill-1k-f64": 2}


@pytest.mark.parametrize("shape", shape_params())
def test_fastattn(benchmark, shape, threads):
    q, k, v = _inputs(shape)
    out = np.empty((1, shape.hq, shape.lq, shape.dv), q.dtype)
    benchmark.extra_info.update(threads=threads, shape=shape.describe())
    with fastattn.num_threads(threads):
        result = benchmark(fastattn.attention, q, k, v, causal=shape.causal, out=out)
    # A fast but wrong kernel must not pass: check a slice against the reference.
    (qs, ks, vs), (heads_q, rows) = reference_slice(shape, q, k, v)
    want = reference.attention(qs, ks, vs, causal=shape.causal)
    np.testing.assert_allclose(result[:, heads_q, shape.lq - rows:].astype(np.float64),
                               want.astype(np.float64), atol=tolerance(shape.dtype), rtol=0)


@pytest.mark.parametrize("shape", shape_params())
def test_reference(benchmark, shape, threads):
    if shape.name in REFERENCE_SKIP:
        pytest.skip(REFERENCE_SKIP[shape.name])
    q, k, v = _inputs(shape)
    benchmark.extra_info.update(threads=threads, shape=shape.describe())
    rounds = REFERENCE_ROUNDS.get(shape.name, 3)
    benchmark.pedantic(reference.attention, args=(q, k, v), kwargs={"causal": shape.causal},
                       rounds=rounds, iterations=1, warmup_rounds=1 if rounds > 1 else 0)


@pytest.mark.parametrize("shape", shape_params())
def test_torch(benchmark, shape, threads):
    torch = pytest.importorskip("torch")
    q, k, v = (to_torch(torch, a) for a in _inputs(shape))
    sdpa = torch.nn.functional.scaled_dot_product_attention
    benchmark.extra_info.update(threads=torch.get_num_threads(), shape=shape.describe(),
                                torch=torch.__version__)
    with torch.inference_mode():
        benchmark(sdpa, q, k, v, **torch_keywords(shape))


@functools.lru_cache(maxsize=None)
def _backward_inputs(shape):
    return make_backward_inputs(shape)


@pytest.mark.parametrize("shape", shape_params(BACKWARD_SHAPES, " backward"))
def test_fastattn_backward(benchmark, shape, threads):
    inputs = _backward_inputs(shape)
    benchmark.extra_info.update(threads=threads, shape=shape.describe())
    with fastattn.num_threads(threads):
        grads = benchmark(fastattn_backward_call(shape, fastattn, inputs))
    # A fast but wrong kernel must not pass: the gradients against the float64 oracle,
    # where building its score matrices is affordable.
    exact, why_not = oracle_gradients(shape, reference, inputs, quick=False)
    if exact is None:
        assert why_not.startswith("skipped"), why_not
        return
    errors = relative_errors([g.astype(np.float64) for g in grads], exact)
    assert max(errors.values()) <= tolerance(shape.dtype), errors


@pytest.mark.parametrize("shape", shape_params(BACKWARD_SHAPES, " backward"))
def test_torch_backward(benchmark, shape, threads):
    torch = pytest.importorskip("torch")
    benchmark.extra_info.update(threads=torch.get_num_threads(), shape=shape.describe(),
                                torch=torch.__version__)
    benchmark(torch_backward_call(shape, torch, _backward_inputs(shape)))
