"""A run of the shapes table (or of the backward table, ``--backward``): threads held,
yardsticks measured, each shape measured, the tables printed, the JSON and the figure
written, and the exit status."""

from __future__ import annotations

from ..common import ENVIRONMENT, FAILED, OK
from . import harness, report as rep
from .machine import machine_info, measure_peaks
from .backward import measure_backward_shape
from .measure import REFERENCE_MAX_SAMPLES, measure_shape
from .shapes import SEED


def _settings(repeat, quick, backward):
    if backward:
        return {"table": "backward", "repeat": repeat, "quick": bool(quick),
                "pause_s": harness.PAUSE_S, "seed": SEED}
    return {"table": "shapes", "repeat": repeat,
            "reference_repeat_max": min(repeat, REFERENCE_MAX_SAMPLES),
            "quick": bool(quick), "pause_s": harness.PAUSE_S, "seed": SEED,
            "fastattn_out_preallocated": True}


def _new_report(fa, torch, held, shapes, settings):
    machine = machine_info(fa, torch)
    machine["threads"] = held
    machine["peaks"], peaks_load = measure_peaks(shapes, settings["quick"])
    if peaks_load is not None:
        machine["other_cpu_load_during_peaks"] = peaks_load
    return {"machine": machine, "settings": settings, "results": []}


def _measure_all(fa, shapes, args, threads, repeat, streams):
    stdout, stderr = streams
    from fastattn import reference
    torch = harness.import_torch()
    measure_one = measure_backward_shape if args.backward else measure_shape
    with harness.hold_threads(threads, fa, torch) as held:
        report = _new_report(fa, torch, held, shapes,
                             _settings(repeat, args.quick, args.backward))
        print(rep.format_header(report), file=stdout, flush=True)
        for shape in shapes:
            print(f"  ... {shape.name}", file=stderr, flush=True)
            report["results"].append(measure_one(
                shape, fa=fa, ref_mod=reference, torch=torch, repeat=repeat,
                quick=args.quick))
    return report


def _print_tables(report, fa, args, threads, repeat, stdout):
    if args.backward:
        tables = [rep.format_backward_table(report), rep.format_accuracy_table(report)]
    else:
        tables = [rep.format_shapes_table(report), rep.format_half_table(report),
                  rep.format_cache_table(report)]
    for table in filter(None, tables):
        print(file=stdout)
        print(table, file=stdout, flush=True)
    if not (args.shapes or args.backward):
        from . import variants
        print(file=stdout)
        variants.run(fa, threads, repeat, stdout)
    for note in (rep.peak_note(report), rep.load_warning(report)):
        if note:
            print(note, file=stdout)


def _status(report, stderr):
    failed = [r["name"] for r in report["results"] if not r["check"].get("ok")]
    errors = [f"{r['name']}/{lib}: {o['error']}" for r in report["results"]
              for lib, o in r["libraries"].items() if "error" in o]
    for e in errors:
        print(f"fastattn bench: error: {e}", file=stderr)
    if failed:
        print(f"fastattn bench: correctness check FAILED on: {', '.join(failed)}", file=stderr)
        return FAILED
    return OK


def _write_outputs(report, args, plt, streams):
    stdout, stderr = streams
    if args.json:
        rep.write_json(report, args.json)
        print(f"wrote {args.json}", file=stdout)
    if plt is not None:
        from .plot import write_plot
        try:
            write_plot(report, args.plot, plt)
        except OSError as exc:
            print(f"fastattn bench: cannot write {args.plot}: {exc}", file=stderr)
            return ENVIRONMENT
        print(f"wrote {args.plot}", file=stdout)
    return OK


def run_shapes(fa, shapes, args, threads, repeat, plt, streams):
    """Measure ``shapes`` and report them; return the exit status."""
    report = _measure_all(fa, shapes, args, threads, repeat, streams)
    _print_tables(report, fa, args, threads, repeat, streams[0])
    status = _status(report, streams[1])
    written = _write_outputs(report, args, plt, streams)
    return status or written
