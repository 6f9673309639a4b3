"""The bench's text: the header, the shapes table, the 16-bit table, the backward and
accuracy tables (``--backward``), notes and JSON.

Columns: ``fastattn`` is its time per call; ``throughput`` is GFLOP/s for prefill shapes
and GB/s for decode shapes; ``% of measured`` is that throughput as a share of the
yardstick measured at start-up (``sgemm``, ``dgemm`` for float64, ``read bw`` for decode:
see :mod:`.machine`), with the yardstick named in the cell; ``ref f64`` is the NumPy
reference, which computes in float64 and builds the whole score matrix, and ``×`` columns
are the other library's time over fastattn's; ``bg load`` is the CPU share other
processes took while the row ran.
"""

from __future__ import annotations

import json
import math
import textwrap

import numpy as np

from ..common import format_table, format_time, symbols
from .harness import PAUSE_S
from .shapes import GRADIENTS, SHAPES_BY_NAME, is_cache_type

# Above this share of the CPUs used by others, timings say more about the neighbours.
BUSY_WARNING = 0.10

REFERENCE_NOTE = ("ref f64 = fastattn.reference.attention: NumPy in float64, building the "
                  "whole Lq x Lk score matrix, while fastattn computes in the shape's dtype "
                  "without it; {x} = the other library's time / fastattn's (over 1: fastattn "
                  "is faster)")

BACKWARD_NOTE = ("fastattn = fastattn.attention_backward from the forward's out and lse; "
                 "torch = torch.autograd.grad through scaled_dot_product_attention (its "
                 "forward untimed); a backward counts as 2.5 forwards' FLOPs; {x} torch = torch's "
                 "time / fastattn's (over 1: fastattn is faster); {d} vs torch, {d} vs f64 = "
                 "max|g - g_other| / max|g_other| over dq, dk, dv, where g is fastattn's "
                 "gradient and g_other torch's, or the float64 oracle's "
                 "(fastattn.reference.attention_backward)")


def peak_basis(result):
    """The yardstick a shape's throughput is compared with: sgemm, dgemm or read bw."""
    if result["kind"] == "decode":
        return "read bw"
    return "dgemm" if result["dtype"] == "float64" else "sgemm"


def peak_fraction(result, peaks):
    """fastattn's throughput as a share of the measured yardstick, or None.

    Prefill shapes against sgemm (dgemm for float64), decode shapes against the sgemv read
    bandwidth. Over 1 is possible (see :func:`peak_note`) and flagged with "*".
    """
    fa = result["libraries"].get("fastattn", {})
    if "median_s" not in fa:
        return None
    if result["kind"] == "decode":
        rate, peak = fa["gbs"], peaks.get("read_gbs")
    else:
        rate = fa["gflops"]
        peak = peaks.get("dgemm_gflops" if result["dtype"] == "float64" else "sgemm_gflops")
    return rate / peak if peak else None


def _percent(fraction):
    return "<1%" if fraction < 0.01 else f"{100 * fraction:.0f}%"


def format_peak(fraction):
    """"85%", or "108%*" when over 100% (see :func:`peak_note`), or "?"."""
    if fraction is None:
        return "?"
    return _percent(fraction) + ("*" if fraction > 1 else "")


def peak_flagged(report):
    """Names of the shapes whose share of the yardstick is over 100%."""
    peaks = report["machine"]["peaks"]
    return [r["name"] for r in report["results"] if (peak_fraction(r, peaks) or 0) > 1]


def peak_note(report):
    """The footnote for the "*" of shares over 100%, or None when there is none.

    Which explanation holds depends on the load while the yardsticks were measured, not on
    the shapes' own bg load column.
    """
    if not peak_flagged(report):
        return None
    bg = report["machine"].get("other_cpu_load_during_peaks")
    if bg is not None and bg > BUSY_WARNING:
        return (f"* over 100%: other processes used {100 * bg:.0f}% of the CPUs while the "
                "yardsticks were measured at start-up, so they came out too low; rerun when "
                "the machine is idle")
    return ("* over 100%: faster than the yardstick measured at start-up, which is what "
            "NumPy's OpenBLAS reaches here (sgemm on 2048 x 2048; sgemv streaming a buffer "
            "larger than the last-level cache), not the hardware's limit; a decode shape's K "
            "and V that stay partly in the caches between calls read faster than memory")


def _background(entry):
    if entry.get("other_cpu_load") is None:
        return None
    return entry["other_cpu_load"] + (entry.get("cpu_steal") or 0.0)


def load_warning(report):
    """A warning line when other processes used the CPUs during the run, else None."""
    busy = [(r["name"], _background(r)) for r in report["results"]]
    busy = [(n, b) for n, b in busy if b is not None and b > BUSY_WARNING]
    if not busy:
        return None
    worst = max(busy, key=lambda nb: nb[1])
    return (f"WARNING: other processes used > {100 * BUSY_WARNING:.0f}% of the CPUs during "
            f"{len(busy)} of {len(report['results'])} shapes (worst: {worst[0]}, "
            f"{100 * worst[1]:.0f}%); those timings are not this machine's -- rerun when idle")


def _rate(x):
    # Three significant digits: the tiny shape runs at a few hundredths of a GFLOP/s.
    return f"{x:.0f}" if x >= 100 else f"{x:.3g}"


def _fastattn_cells(r, peaks, sym):
    fa = r["libraries"].get("fastattn", {})
    if "median_s" not in fa:
        return ["ERROR", "", ""]
    rate, unit = (fa["gbs"], "GB/s") if r["kind"] == "decode" else (fa["gflops"], "GFLOP/s")
    frac = peak_fraction(r, peaks)
    share = format_peak(frac) + (f" {peak_basis(r)}" if frac is not None else "")
    return [format_time(fa["median_s"], sym), f"{_rate(rate)} {unit}", share]


def _other_cells(r, other, sym):
    o = r["libraries"].get(other, {})
    if "median_s" in o:
        s = r.get(f"speedup_vs_{other}")
        return [format_time(o["median_s"], sym),
                f"{s:.2f}{sym['x']}" if s is not None else sym["dash"]]
    if "error" in o:
        return ["error", sym["dash"]]
    if "skipped" in o and other == "reference":
        return ["skipped", sym["dash"]]
    return ["n/a", sym["dash"]]


def _check_cells(r, diff_keys, sym, separate=False):
    """The largest difference found (or, ``separate``, one per key), the check's verdict
    and the background load."""
    c = r.get("check", {})
    if separate:
        cells = [f"{c[key]:.1e}" if key in c else sym["dash"] for key in diff_keys]
    else:
        diffs = [c[key] for key in diff_keys if key in c]
        cells = [f"{max(diffs):.1e}" if diffs else sym["dash"]]
    # CPU share taken by other processes (or the hypervisor) while this row ran.
    bg = _background(r)
    return cells + ["ok" if c.get("ok") else "FAIL", _percent(bg) if bg is not None else "?"]


def _shape_row(r, peaks, sym, others=("reference", "torch"),
               diff_keys=("vs_torch_max_abs", "vs_reference_max_abs"), separate=False):
    shape = SHAPES_BY_NAME.get(r["name"])
    described = r.get("shape") or (shape.describe() if shape else "?")
    row = [r["name"], described] + _fastattn_cells(r, peaks, sym)
    for other in others:
        row += _other_cells(r, other, sym)
    return row + _check_cells(r, diff_keys, sym, separate)


def format_shapes_table(report):
    """The main table, one row per shape, with its notes underneath."""
    sym = symbols()
    x = sym["x"]
    header = ["shape", "(Hq,Hkv,Lq,Lk,D)", "fastattn", "throughput", "% of measured",
              "ref f64", f"{x} ref f64", "torch", f"{x} torch", f"max|{sym['delta']}|",
              "check", "bg load"]
    rows = [_shape_row(r, report["machine"]["peaks"], sym) for r in report["results"]]
    return (format_table(header, rows, align="ll") + "\n"
            + textwrap.fill(REFERENCE_NOTE.format(x=x), 100))


def format_backward_table(report):
    """The backward table, one row per shape, with its note underneath."""
    sym = symbols()
    x = sym["x"]
    header = ["shape", "(Hq,Hkv,Lq,Lk,D)", "fastattn", "throughput", "% of measured",
              "torch", f"{x} torch", f"{sym['delta']} vs torch", f"{sym['delta']} vs f64",
              "check", "bg load"]
    rows = [_shape_row(r, report["machine"]["peaks"], sym, ("torch",),
                       ("vs_torch_max_rel", "vs_reference_max_rel"), separate=True)
            for r in report["results"]]
    return (format_table(header, rows, align="ll") + "\n"
            + textwrap.fill(BACKWARD_NOTE.format(x=x, d=sym["delta"]), 100))


def _accuracy_cells(check, library, sym):
    errors = check.get("accuracy", {}).get(library)
    if errors is None:
        return [sym["dash"]] * len(GRADIENTS)
    return [f"{errors[g]:.1e}" for g in GRADIENTS]


def format_accuracy_table(report):
    """Each side's gradients against the float64 oracle, and the shapes it skipped."""
    sym = symbols()
    rows, notes = [], []
    for r in report["results"]:
        c = r.get("check", {})
        if "accuracy" in c:
            rows.append([r["name"], r["dtype"]] + _accuracy_cells(c, "fastattn", sym)
                        + _accuracy_cells(c, "torch", sym))
        elif "oracle" in c:
            notes.append(f"{r['name']}: {c['oracle']}")
    header = ["shape", "dtype"] + [f"fastattn {g}" for g in GRADIENTS] + [
        f"torch {g}" for g in GRADIENTS]
    text = ("accuracy against the float64 oracle (fastattn.reference.attention_backward):\n"
            "max|g - g64| / max|g64| of each gradient g\n")
    text += format_table(header, rows, align="ll") if rows else "(no shape checked)"
    return "\n".join([text] + notes)


def _half_row(r, peaks, sym):
    libs = r["libraries"]
    row = [r["name"], r["dtype"]]
    for name in ("fastattn", "fastattn-f32", "torch", "torch-f32"):
        o = libs.get(name, {})
        row.append(format_time(o["median_s"], sym) if "median_s" in o else sym["dash"])
    for key in ("fastattn-f32", "torch", "torch-f32"):
        s = r.get(f"speedup_vs_{key}")
        row.append(f"{s:.2f}{sym['x']}" if s is not None else sym["dash"])
    if r["kind"] == "decode" and peaks.get("read_gbs"):
        row.append(format_peak(peak_fraction(r, peaks)))
    else:
        row.append(sym["dash"])
    check = r.get("check", {})
    for key in ("vs_reference_max_abs", "torch_vs_reference_max_abs"):
        row.append(f"{check[key]:.1e}" if key in check else sym["dash"])
    return row


def format_half_table(report):
    """The 16-bit shapes against the same inputs in float32, or None when none ran."""
    sym = symbols()
    x = sym["x"]
    rows = [_half_row(r, report["machine"]["peaks"], sym) for r in report["results"]
            if r["dtype"] in ("float16", "bfloat16")]
    if not rows:
        return None
    header = ["shape", "dtype", "fastattn", "fastattn f32", "torch", "torch f32",
              f"{x} fastattn f32", f"{x} torch", f"{x} torch f32", "% read bw",
              "fastattn err", "torch err"]
    return ("16-bit storage against the same values in float32 (same rounds; "
            f"{x} = the other's time / fastattn's;\nerr = max|out - ref f64| over the rows "
            "the reference ran on, both libraries in the 16-bit dtype):\n"
            + format_table(header, rows, align="ll"))


def format_cache_table(report):
    """The quantised caches' shapes against fastattn's own float16 cache, or None when
    none ran."""
    sym = symbols()
    x = sym["x"]
    rows = []
    for r in report["results"]:
        if not is_cache_type(r["dtype"]):
            continue
        libs, check = r["libraries"], r.get("check", {})
        row = [r["name"], r["dtype"]] + [format_time(libs[n]["median_s"], sym) if "median_s" in libs.get(
            n, {}) else sym["dash"] for n in ("fastattn", "fastattn-f16")]
        s = r.get("speedup_vs_fastattn-f16")
        row.append(f"{s:.2f}{x}" if s is not None else sym["dash"])
        row.append(format_peak(peak_fraction(r, report["machine"]["peaks"]))
                   if report["machine"]["peaks"].get("read_gbs") else sym["dash"])
        for key in ("vs_reference_max_abs", "vs_float_values_max_abs",
                    "f16_vs_float_values_max_abs"):
            row.append(f"{check[key]:.1e}" if key in check else sym["dash"])
        rows.append(row)
    if not rows:
        return None
    header = ["shape", "cache", "time", "float16", f"{x} float16", "% read bw",
              "err (own values)", "err (float values)", "f16 err (float values)"]
    return ("quantised caches (attention_with_kvcache) against fastattn's float16 cache of "
            f"the same values (same rounds; {x} = float16's time / the cache's);\nerr = "
            "max|out - ref f64| over the values the cache stores (own values) or over the "
            "float32 values quantised:\n"
            + format_table(header, rows, align="l"))


def _peaks_line(m):
    peaks = m["peaks"]
    parts = []
    if "sgemm_gflops" in peaks:
        parts.append(f"sgemm {peaks['sgemm_gflops']:.1f} GFLOP/s")
    if "dgemm_gflops" in peaks:
        parts.append(f"dgemm {peaks['dgemm_gflops']:.1f} GFLOP/s")
    if "read_gbs" in peaks:
        parts.append(f"read bw {peaks['read_gbs']:.1f} GB/s (sgemv)")
    bg = m.get("other_cpu_load_during_peaks")
    return ("measured peaks: " + (", ".join(parts) or "none")
            + (f" (bg load {100 * bg:.0f}%)" if bg is not None else ""))


def _method_line(s):
    reference = (f" (reference: at most {s['reference_repeat_max']}, 1 if a call takes > 2 s)"
                 if "reference_repeat_max" in s else "")
    return (f"method: median of {s['repeat']} batches per library{reference};\n        libraries"
            f" alternate with a {int(PAUSE_S * 1000)} ms pause before each batch (longer until"
            " spinning BLAS/OpenMP workers sleep),\n        then one untimed call"
            + ("; fastattn writes into out=" if s.get("fastattn_out_preallocated") else "")
            + ("; --quick" if s["quick"] else ""))


def format_header(report):
    m = report["machine"]
    sym = symbols()
    th = m["threads"]
    lines = [
        f"fastattn {m.get('fastattn', '?')} bench {sym['dash']} {m['cpu']}, {m['cpus']} CPUs, "
        f"{m['platform']}",
        f"Python {m['python']}, NumPy {m['numpy']}, torch {m.get('torch') or 'not installed'}; "
        f"SIMD variant: {m.get('isa', 'unknown')}",
        f"threads: fastattn {th['fastattn']}, torch {th.get('torch', sym['dash'])}, "
        f"BLAS {th['blas']}",
        _peaks_line(m),
    ]
    if m["env"]:
        lines.append("environment: " + " ".join(f"{k}={v}" for k, v in m["env"].items()))
    lines.append(_method_line(report["settings"]))
    lines.append("columns: % of measured = throughput over the yardstick named beside it"
                 " (sgemm, dgemm, read bw);\n         bg load = CPU share used by other"
                 " processes meanwhile")
    return "\n".join(lines)


def _json_safe(x):
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json_safe(v) for v in x]
    if isinstance(x, np.generic):
        return _json_safe(x.item())
    return x


def write_json(data, path):
    """``data`` as indented JSON, non-finite numbers as null."""
    with open(path, "w") as f:
        json.dump(_json_safe(data), f, indent=2, allow_nan=False)
        f.write("\n")
