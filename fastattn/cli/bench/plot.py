"""The bench's figure (``--plot FILE.png``, needs matplotlib).

Three panels over the shapes, each on its own log axis so that no comparison squashes
another: fastattn's speed-up over torch (the comparison users ask for, on top and the
tallest), the time per call of fastattn and torch with fastattn's share of the measured
yardstick written over its bars ("72% sgemm", "56% read bw"), and fastattn's speed-up
over the NumPy reference, which computes in float64 and builds the whole score matrix.
Where a library was skipped or failed on a shape, the place of its bar says so; the notes
(what "%" means, the footnote of a "*", the background-load warning) are printed under
the figure.
"""

from __future__ import annotations

import math
import textwrap

import numpy as np

from ..common import symbols
from .report import format_peak, load_warning, peak_basis, peak_fraction, peak_note

COLORS = {"fastattn": "#1f77b4", "torch": "#ff7f0e", "reference": "#7f7f7f"}
NAMES = {"fastattn": "fastattn", "torch": "torch",
         "reference": "NumPy reference (float64, whole score matrix)"}
WIDTH = 0.36


def _speedup_ticks(lo, hi):
    """1-2-5 ticks (0.5, 1, 2, 5, 10, 20, ...) covering [lo, hi] on a log axis."""
    ticks = []
    for e in range(math.floor(math.log10(lo)) - 1, math.ceil(math.log10(hi)) + 1):
        ticks += [m * 10.0 ** e for m in (1, 2, 5)]
    inside = [t for t in ticks if lo <= t <= hi]
    below = [t for t in ticks if t < lo]
    above = [t for t in ticks if t > hi]
    # One tick beyond the data on each side, so every bar ends between two labels.
    return (below[-1:] + inside + above[:1]) or [1.0]


def _times_label(x):
    return f"{x:g}{symbols()['x']}"


def _ran(results, lib):
    return any("median_s" in r["libraries"].get(lib, {}) for r in results)


def _why_missing(entry):
    if "--quick" in entry.get("skipped", ""):
        return "skipped\n(--quick)"
    return "error" if "error" in entry else "skipped"


def _mark_missing(ax, x, results, lib, offset, bottom):
    """Say why a bar is missing, at its place."""
    for j, r in enumerate(results):
        entry = r["libraries"].get(lib, {})
        if "median_s" not in entry:
            ax.text(x[j] + offset, bottom * 1.1, _why_missing(entry), rotation=90,
                    ha="center", va="bottom", fontsize=7, color=COLORS[lib])


def _peak_labels(ax, bars, results, peaks):
    for bar, r in zip(bars, results):
        frac = peak_fraction(r, peaks)
        if frac is not None and np.isfinite(bar.get_height()):
            ax.annotate(f"{format_peak(frac)}\n{peak_basis(r)}",
                        (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                        xytext=(0, 2), textcoords="offset points", ha="center", va="bottom",
                        fontsize=6.5, linespacing=0.9,
                        color="#c00000" if frac > 1 else "black")


def _time_panel(ax, x, results, peaks):
    libs = ["fastattn"] + (["torch"] if _ran(results, "torch") else [])
    for i, lib in enumerate(libs):
        offset = (i - (len(libs) - 1) / 2) * WIDTH
        times = np.array([r["libraries"].get(lib, {}).get("median_s", np.nan) * 1e3
                          for r in results])
        bars = ax.bar(x + offset, times, WIDTH, label=lib, color=COLORS[lib])
        if lib == "fastattn":
            _peak_labels(ax, bars, results, peaks)
    ax.set_yscale("log")
    ax.margins(y=0.25)
    for i, lib in enumerate(libs):
        _mark_missing(ax, x, results, lib, (i - (len(libs) - 1) / 2) * WIDTH,
                      ax.get_ylim()[0])
    ax.set_ylabel("time per call\n(ms, log)")
    ax.legend(loc="lower left", bbox_to_anchor=(0, 1), ncols=2, frameon=False, fontsize=8)


def _speedup_panel(ax, x, results, other):
    """fastattn's speed-up over ``other``, bars from 1x, on 1-2-5 ticks."""
    sp = np.array([r.get(f"speedup_vs_{other}", np.nan) for r in results])
    finite = [v for v in sp if np.isfinite(v) and v > 0]
    # Bars start at 1x, so a slow-down points down from the line instead of up.
    ax.bar(x, sp - 1.0, WIDTH, bottom=1.0, color=COLORS[other],
           label=f"fastattn's speed-up over {NAMES[other]}")
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_yscale("log")
    ticks = _speedup_ticks(min(finite + [1.0]), max(finite + [1.0]))
    ax.set_ylim(ticks[0], ticks[-1])
    ax.set_yticks(ticks, [_times_label(t) for t in ticks])
    ax.minorticks_off()
    ax.grid(axis="y", which="major", linewidth=0.4, alpha=0.5)
    ax.set_ylabel(f"speed-up over\n{other} (log)")
    ax.legend(loc="lower left", bbox_to_anchor=(0, 1), frameon=False, fontsize=8)
    _mark_missing(ax, x, results, other, 0.0, ticks[0])


def _title(report, results):
    sym = symbols()
    ran = [lib for lib in ("fastattn", "torch", "reference") if _ran(results, lib)]
    machine = report["machine"]
    return (" vs ".join("NumPy reference (float64)" if lib == "reference" else lib
                        for lib in ran)
            + f" {sym['dash']} {machine['cpu']}, {machine['threads']['fastattn']} threads"
            + (", --quick" if report["settings"].get("quick") else ""))


def _notes(fig, report):
    notes = ["Over fastattn's bars: its throughput as a share of the yardstick named under "
             "the %, measured at start-up on the same threads: sgemm (dgemm for float64) "
             "for prefill shapes, sgemv read bandwidth (read bw) for decode shapes. The "
             "NumPy reference computes in float64 and builds the whole score matrix; "
             "fastattn computes in each shape's dtype."]
    warning = load_warning(report)
    notes += [extra for extra in (peak_note(report), warning) if extra]
    wrap = max(60, int(fig.get_figwidth() * 17))
    lines = [textwrap.wrap(note, wrap) for note in notes]
    height = 0.016 * sum(len(ln) for ln in lines) + 0.01
    fig.tight_layout(rect=(0, height, 1, 0.97))
    y = height - 0.005
    for note, ln in zip(notes, lines):
        fig.text(0.01, y, "\n".join(ln), fontsize=7.5, va="top",
                 color="#c00000" if note is warning else "black")
        y -= 0.016 * len(ln)


def plot_figure(report, plt):
    """The bench's figure for ``report``; see the module's description."""
    results = report["results"]
    x = np.arange(len(results))
    with_torch = _ran(results, "torch")
    panels = (["torch"] if with_torch else []) + ["time", "reference"]
    fig, axes = plt.subplots(len(panels), 1, sharex=True,
                             figsize=(max(8, 1.2 * len(results)), 3.2 * len(panels) + 1),
                             height_ratios=[{"torch": 3, "time": 2.5, "reference": 1.6}[p]
                                            for p in panels])
    for ax, panel in zip(axes, panels):
        if panel == "time":
            _time_panel(ax, x, results, report["machine"]["peaks"])
        else:
            _speedup_panel(ax, x, results, panel)
    axes[-1].set_xticks(x, [r["name"] for r in results], rotation=30, ha="right")
    fig.suptitle(_title(report, results), fontsize=11)
    _notes(fig, report)
    return fig


def write_plot(report, path, plt):
    """Save :func:`plot_figure` as ``path``."""
    fig = plot_figure(report, plt)
    fig.savefig(path, dpi=110)
    plt.close(fig)
