"""One shape of the backward table (``bench --backward``): fastattn's backward pass and
torch's, timed and checked.

The calls, on the same inputs and thread count, timed through the harness as the shapes
table's are (alternating batches, each after a pause and an untimed wake-up call):

* ``fastattn.attention_backward(dout, q, k, v, out, lse)``, with ``out`` and ``lse``
  from fastattn's forward on the same inputs, run once beforehand;
* ``torch.autograd.grad`` of ``torch.nn.functional.scaled_dot_product_attention``'s
  output with respect to q, k and v, on CPU tensors that share the arrays' memory (same
  dtype), the graph kept between calls so that only the backward is timed; when torch
  can be imported.

A backward counts 2.5 times the forward's FLOPs (:func:`.shapes.backward_flops`).

Accuracy: each side's dq, dk and dv against the float64 oracle
``fastattn.reference.attention_backward`` on the same inputs, as the largest error
relative to the largest gradient.  The oracle builds several (Hq, Lq, Lk) float64
matrices (a second and about a gigabyte at 2**24 scores), so it runs on shapes up to
``ORACLE_MAX_SCORES`` (``QUICK_ORACLE_MAX_SCORES`` with ``--quick``).  A shape fails its
check when fastattn's gradients differ from torch's or the oracle's by more than the
tolerance of its dtype, relative to the largest gradient.
"""

from __future__ import annotations

import functools

import numpy as np

from . import harness
from .measure import as_numpy, batch_seconds, record_libraries, record_load, \
    torch_keywords
from .shapes import GRADIENTS, backward_bytes, backward_flops, make_backward_inputs, \
    tolerance

ORACLE_MAX_SCORES = 1 << 24
QUICK_ORACLE_MAX_SCORES = 1 << 20


def fastattn_backward_call(shape, fa, inputs):
    """fastattn's backward on ``inputs`` (q, k, v, dout), its forward run now."""
    q, k, v, dout = inputs
    out, lse = fa.attention(q, k, v, causal=shape.causal, return_lse=True)
    return functools.partial(fa.attention_backward, dout, q, k, v, out, lse,
                             causal=shape.causal)


def torch_backward_call(shape, torch, inputs):
    """torch's backward through SDPA on ``inputs`` (q, k, v, dout), its forward run now
    and its graph kept between calls."""
    q, k, v, dout = (harness.to_torch(torch, a) for a in inputs)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, **torch_keywords(shape))
    return functools.partial(torch.autograd.grad, out, (q, k, v), dout, retain_graph=True)


def _entries(shape, fa, torch, inputs, repeat):
    """The calls to time, the libraries skipped (with why), and the setup errors."""
    makers = {"fastattn": functools.partial(fastattn_backward_call, shape, fa)}
    skipped = {}
    if torch is None:
        skipped["torch"] = {"skipped": "torch is not installed"}
    else:
        makers["torch"] = functools.partial(torch_backward_call, shape, torch)
    entries, errors = {}, {}
    for name, make in makers.items():
        try:   # a library whose forward fails does not stop the other
            entries[name] = harness.Timed(make(inputs), repeat)
        except Exception as exc:
            errors[name] = exc
    return entries, skipped, errors


def oracle_gradients(shape, ref_mod, inputs, quick):
    """``(float64 gradients, None)``, or ``(None, why there are none)``."""
    scores = shape.hq * shape.lq * shape.lk
    if scores > (QUICK_ORACLE_MAX_SCORES if quick else ORACLE_MAX_SCORES):
        later = "; run without --quick" if scores <= ORACLE_MAX_SCORES else ""
        return None, (f"skipped: the float64 oracle would build {shape.hq} x {shape.lq} x "
                      f"{shape.lk} matrices{later}")
    q, k, v, dout = inputs
    try:
        return ref_mod.attention_backward(dout, q, k, v, causal=shape.causal), None
    except Exception as exc:
        return None, f"error: {type(exc).__name__}: {exc}"


def relative_errors(got, want):
    """``{gradient: max |g - w| / max |w|}`` over dq, dk, dv."""
    return {name: float(np.max(np.abs(g - w)) / max(float(np.max(np.abs(w))), 1e-300))
            for name, g, w in zip(GRADIENTS, got, want)}


def check_gradients(shape, grads, exact, why_not):
    """fastattn's float64-converted gradients against torch's and the oracle's, within
    ``tolerance``, and each side's accuracy against the oracle (or why it has none)."""
    check = {"tolerance": tolerance(shape.dtype), "ok": "fastattn" in grads}
    if "fastattn" not in grads:
        return check
    ours = grads["fastattn"]
    check["ok"] = all(np.all(np.isfinite(g)) for g in ours)
    if "torch" in grads:
        check["vs_torch_max_rel"] = max(relative_errors(ours, grads["torch"]).values())
    if exact is None:
        check["oracle"] = why_not
        check["ok"] = check["ok"] and not why_not.startswith("error")
    else:
        check["accuracy"] = {name: relative_errors(g, exact) for name, g in grads.items()}
        check["vs_reference_max_rel"] = max(check["accuracy"]["fastattn"].values())
    check["ok"] = check["ok"] and all(
        check.get(key, 0.0) <= check["tolerance"]
        for key in ("vs_torch_max_rel", "vs_reference_max_rel"))
    return check


def measure_backward_shape(shape, *, fa, ref_mod, torch, repeat, quick):
    """Time and check one shape's backward; return a JSON-ready dict."""
    load = harness.OtherLoad()
    inputs = make_backward_inputs(shape)
    result = {
        "name": shape.name, "shape": shape.describe(), "pass": "backward",
        "dtype": shape.dtype, "hq": shape.hq, "hkv": shape.hkv, "lq": shape.lq,
        "lk": shape.lk, "d": shape.d, "dv": shape.dv, "causal": shape.causal, "batch": 1,
        "kind": "prefill", "flops": backward_flops(shape), "bytes": backward_bytes(shape),
    }
    entries, skipped, errors = _entries(shape, fa, torch, inputs, repeat)
    outputs, _, failed = harness.first_calls(entries, batch_seconds(quick))
    samples = harness.alternate(entries)
    record_libraries(result, entries, samples, skipped, {**errors, **failed})
    grads = {name: [np.asarray(as_numpy(torch, g), np.float64) for g in res]
             for name, res in outputs.items()}
    exact, why_not = oracle_gradients(shape, ref_mod, inputs, quick)
    result["check"] = check_gradients(shape, grads, exact, why_not)
    record_load(result, load)
    return result
