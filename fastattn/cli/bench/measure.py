"""One shape of the bench: fastattn, the NumPy reference and torch timed and checked.

The calls, on the same inputs and thread count:

* ``fastattn.attention`` writing into a preallocated ``out=`` array, in the shape's dtype;
* ``fastattn.reference.attention``, the NumPy oracle, which computes in float64 and builds
  the whole (Hq, Lq, Lk) score matrix; slow on large shapes, so it gets at most 3 samples
  (1 when a call takes over 2 s), and ``--quick`` skips it on the two largest shapes;
* ``torch.nn.functional.scaled_dot_product_attention`` when torch can be imported
  (``enable_gqa=True`` for grouped heads, ``is_causal`` for causal shapes, under
  ``torch.inference_mode``);
* for 16-bit shapes, fastattn and torch once more on float32 copies of the inputs.

A fast but wrong kernel must not hide behind its speed: fastattn's output is compared
with torch's (whole output) and the reference's (whole output where the reference was
timed; otherwise two heads x the last 64 query rows, which keeps the bottom-right causal
alignment), and the shape fails its check when a difference exceeds the tolerance.
"""

from __future__ import annotations

import functools

import numpy as np

from . import caches, harness
from .shapes import QUICK_SKIP_REFERENCE, bytes_moved, flops, make_inputs, reference_slice, \
    tolerance

# The oracle's calls are long: a few samples are enough for a speed-up ratio.
REFERENCE_MAX_SAMPLES = 3
REFERENCE_ONE_SAMPLE_S = 2.0


def _cache_entries(shape, fa, q, k, v, repeat):
    # the quantised cache, and fastattn's own float16 cache of the same values (q in
    # float16 too, as the float16 rows have it), timed in the same rounds
    out = np.empty((1, shape.hq, shape.lq, shape.dv), np.float32)
    cache = caches.store(fa, shape.dtype, k, v)
    entries = {"fastattn": harness.Timed(functools.partial(
        fa.attention_with_kvcache, q, **cache, cache_seqlens=np.array([shape.lk]),
        causal=shape.causal, out=out), repeat)}
    q16, k16, v16 = (a.astype(np.float16) for a in (q, k, v))
    out16 = np.empty(out.shape, np.float16)
    entries["fastattn-f16"] = harness.Timed(functools.partial(
        fa.attention, q16, k16, v16, causal=shape.causal, out=out16), repeat)
    return entries


def _fastattn_entries(shape, fa, q, k, v, repeat):
    if shape.quantized:
        return _cache_entries(shape, fa, q, k, v, repeat)
    out = np.empty((1, shape.hq, shape.lq, shape.dv), q.dtype)
    entries = {"fastattn": harness.Timed(functools.partial(
        fa.attention, q, k, v, causal=shape.causal, out=out), repeat)}
    if shape.half:
        # the same values in float32, timed in the same rounds
        q32, k32, v32 = (a.astype(np.float32) for a in (q, k, v))
        out32 = np.empty(out.shape, np.float32)
        entries["fastattn-f32"] = harness.Timed(functools.partial(
            fa.attention, q32, k32, v32, causal=shape.causal, out=out32), repeat)
    return entries


def torch_keywords(shape):
    """The keywords that make torch's scaled_dot_product_attention compute ``shape``."""
    kwargs = {"is_causal": shape.causal}
    if shape.hq != shape.hkv:
        kwargs["enable_gqa"] = True
    return kwargs


def _torch_entries(shape, torch, q, k, v, repeat):
    sdpa = torch.nn.functional.scaled_dot_product_attention
    kwargs = torch_keywords(shape)
    arrays = {"torch": (q, k, v)}
    if shape.half:
        arrays["torch-f32"] = tuple(a.astype(np.float32) for a in (q, k, v))
    return {name: harness.Timed(
        functools.partial(sdpa, *(harness.to_torch(torch, a) for a in qkv), **kwargs),
        repeat, context=torch.inference_mode) for name, qkv in arrays.items()}


def _entries(shape, libs, q, k, v, repeat, quick):
    """The calls to time, and ``{library: {"skipped": why}}`` for those that are not."""
    fa, ref_mod, torch = libs
    entries = _fastattn_entries(shape, fa, q, k, v, repeat)
    skipped = {}
    if shape.quantized:
        # the reference runs once, in the check (over the dequantised cache)
        skipped["reference"] = {
            "skipped": f"{shape.dtype}: checked against the reference, not timed"}
        skipped["torch"] = {"skipped": f"torch has no {shape.dtype} cache"}
        return entries, skipped
    if quick and shape.name in QUICK_SKIP_REFERENCE:
        skipped["reference"] = {
            "skipped": "skipped with --quick (seconds per call); run without --quick"}
    else:
        entries["reference"] = harness.Timed(
            functools.partial(ref_mod.attention, q, k, v, causal=shape.causal),
            REFERENCE_MAX_SAMPLES, wake=False)
    if torch is None:
        skipped["torch"] = {"skipped": "torch is not installed"}
    else:
        entries.update(_torch_entries(shape, torch, q, k, v, repeat))
    return entries, skipped


def as_numpy(torch, res):
    if torch is not None and isinstance(res, torch.Tensor):
        # NumPy has no bfloat16: that one result is compared in float32
        return (res.float() if res.dtype == torch.bfloat16 else res).numpy()
    return np.array(res, copy=True)


def _max_diff(got, want):
    """Largest absolute difference, and the scale the tolerance is relative to."""
    diff = float(np.max(np.abs(got - want)))
    return diff, float(np.max(np.abs(want)))


def _reference_output(shape, ref_mod, outputs, q, k, v, check):
    """The reference's output (or the slice it is computed on) and the rows of fastattn's
    output it covers; None after noting an error in ``check``."""
    if "reference" in outputs:
        # The reference ran on the whole problem anyway: compare everything.
        check["reference_slice"] = "whole output"
        return outputs["reference"].astype(np.float64), np.s_[:]
    (qs, ks, vs), (heads_q, rows) = reference_slice(shape, q, k, v)
    try:
        want = np.asarray(ref_mod.attention(qs, ks, vs, causal=shape.causal), np.float64)
    except Exception as exc:
        check["reference_error"] = f"{type(exc).__name__}: {exc}"
        return None, None
    check["reference_slice"] = f"heads {heads_q}, last {rows} query rows"
    return want, np.s_[:, heads_q, shape.lq - rows:, :]


def check_outputs(shape, ref_mod, outputs, q, k, v):
    """fastattn's output against torch's and the reference's, within ``tolerance``."""
    tol = tolerance(shape.dtype)
    check = {"tolerance": tol, "ok": "fastattn" in outputs}
    if "fastattn" not in outputs:
        return check
    got = outputs["fastattn"].astype(np.float64)
    if not np.all(np.isfinite(got)):
        check["ok"] = False
        check["non_finite"] = True
    if "torch" in outputs:
        diff, scale = _max_diff(got, outputs["torch"].astype(np.float64))
        check["vs_torch_max_abs"] = diff
        check["ok"] = check["ok"] and diff <= tol * max(1.0, scale)
    want, rows = _reference_output(shape, ref_mod, outputs, q, k, v, check)
    if want is None:
        check["ok"] = False
    else:
        diff, scale = _max_diff(got[rows], want)
        check["vs_reference_max_abs"] = diff
        check["ok"] = check["ok"] and diff <= tol * max(1.0, scale)
        if "torch" in outputs:
            # torch's own error on the same rows: what fastattn's is to be judged against
            check["torch_vs_reference_max_abs"] = _max_diff(
                outputs["torch"].astype(np.float64)[rows], want)[0]
    return check


def check_cache(shape, fa, ref_mod, outputs, q, k, v):
    """A quantised cache's row against the float64 reference over the values it stores
    (the kernel's own error, within the float32 tolerance) and over the float values it
    quantised (what the cache costs), beside the float16 cache's error against the
    latter."""
    stored = caches.stored_values(fa, shape.dtype, caches.store(fa, shape.dtype, k, v))
    check = check_outputs(shape, ref_mod, {n: o for n, o in outputs.items()
                                           if n == "fastattn"}, q, *stored)
    (qs, ks, vs), (heads_q, rows) = reference_slice(shape, q, k, v)
    want = np.asarray(ref_mod.attention(qs, ks, vs, causal=shape.causal), np.float64)
    sel = np.s_[:, heads_q, shape.lq - rows:, :]
    for name, key in (("fastattn", "vs_float_values_max_abs"),
                      ("fastattn-f16", "f16_vs_float_values_max_abs")):
        if name in outputs:
            check[key] = _max_diff(outputs[name].astype(np.float64)[sel], want)[0]
    return check


def _library_results(entries, samples, work):
    flop, nbytes = work
    out = {}
    for name, entry in entries.items():
        med = harness.median(samples[name])
        out[name] = {"median_s": med, "samples_s": samples[name],
                     "calls_per_sample": entry.calls_per_sample,
                     "gflops": flop / med / 1e9, "gbs": nbytes / med / 1e9}
    return out


def batch_seconds(quick):
    """How long a timed batch lasts (the harness sizes batches from warm calls)."""
    return 0.01 if quick else 0.04


def record_libraries(result, entries, samples, skipped, errors):
    """``result["libraries"]``: each timed entry's figures, then the skipped and failed
    libraries (each with why); and fastattn's speed-ups over the others."""
    libraries = _library_results(entries, samples, (result["flops"], result["bytes"]))
    libraries.update(skipped)
    libraries.update({name: {"error": f"{type(exc).__name__}: {exc}"}
                      for name, exc in errors.items()})
    result["libraries"] = libraries
    result.update(_speedups(libraries))


def record_load(result, load):
    """The other processes' CPU share (and the stolen share) since ``load`` began."""
    busy = load.fraction()
    if busy is not None:
        result["other_cpu_load"], result["cpu_steal"] = busy


def _speedups(libraries):
    """The other library's time over fastattn's, for each that ran."""
    fa = libraries.get("fastattn", {})
    return {f"speedup_vs_{other}": libraries[other]["median_s"] / fa["median_s"]
            for other in ("reference", "torch", "fastattn-f32", "fastattn-f16", "torch-f32")
            if "median_s" in fa and "median_s" in libraries.get(other, {})}


def measure_shape(shape, *, fa, ref_mod, torch, repeat, quick):
    """Time and check one shape; return a JSON-ready dict."""
    load = harness.OtherLoad()
    q, k, v = make_inputs(shape)
    result = {
        "name": shape.name, "dtype": shape.dtype, "hq": shape.hq, "hkv": shape.hkv,
        "lq": shape.lq, "lk": shape.lk, "d": shape.d, "dv": shape.dv, "causal": shape.causal,
        "batch": 1, "kind": "decode" if shape.decode else "prefill",
        "flops": flops(shape), "bytes": bytes_moved(shape),
    }
    entries, skipped = _entries(shape, (fa, ref_mod, torch), q, k, v, repeat, quick)
    outputs, first_s, errors = harness.first_calls(entries, batch_seconds(quick))
    if "reference" in entries:
        entries["reference"].samples = (1 if first_s["reference"] > REFERENCE_ONE_SAMPLE_S
                                        else min(repeat, REFERENCE_MAX_SAMPLES))
    samples = harness.alternate(entries)
    record_libraries(result, entries, samples, skipped, errors)
    outputs = {name: as_numpy(torch, res) for name, res in outputs.items()}
    if shape.quantized:
        result["check"] = check_cache(shape, fa, ref_mod, outputs, q, k, v)
    else:
        result["check"] = check_outputs(shape, ref_mod, outputs, q, k, v)
    record_load(result, load)
    return result
