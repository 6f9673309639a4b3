"""The bench's tables and plot (fastattn.cli.bench.report, plot), from a made-up report."""
import pytest

from fastattn.cli import common
from fastattn.cli.bench import plot, report, shapes


# -------------------------------------------------------------------- tables

def _report(torch=True, quick_skip=True, load=0.01, peak_gflops=100.0):
    """A bench report of three shapes, as bench.run builds it (the fields the table and the
    plot read), with fastattn at 108 GFLOP/s on the prefill shapes."""
    def lib(seconds, flop):
        return {"median_s": seconds, "samples_s": [seconds], "calls_per_sample": 1,
                "gflops": flop / seconds / 1e9, "gbs": 1e6 / seconds / 1e9}
    results = []
    for name, seconds, ref_s, torch_s in (("tiny", 3e-6, 2e-4, 1.5e-5),
                                          ("small", 3.4e-4, 4e-3, 5e-4),
                                          ("long-8k", 0.15, 2.0, 0.16)):
        shape = shapes.SHAPES_BY_NAME[name]
        flop = shapes.flops(shape)
        fa = lib(seconds, flop)
        fa["gflops"] = 108.0 if name != "tiny" else 0.1
        libs = {"fastattn": fa}
        r = {"name": name, "kind": "prefill", "dtype": "float32", "flops": flop,
             "bytes": shapes.bytes_moved(shape), "libraries": libs,
             "check": {"ok": True, "tolerance": 1e-4, "vs_reference_max_abs": 1e-7},
             "other_cpu_load": load, "cpu_steal": 0.0}
        if quick_skip and name in shapes.QUICK_SKIP_REFERENCE:
            libs["reference"] = {"skipped": "skipped with --quick (seconds per call); "
                                            "run without --quick"}
        else:
            libs["reference"] = lib(ref_s, flop)
            r["speedup_vs_reference"] = ref_s / seconds
        if torch:
            libs["torch"] = lib(torch_s, flop)
            r["speedup_vs_torch"] = torch_s / seconds
        else:
            libs["torch"] = {"skipped": "torch is not installed"}
        results.append(r)
    return {"machine": {"cpu": "Test CPU", "threads": {"fastattn": 2},
                        "peaks": {"sgemm_gflops": peak_gflops}},
            "settings": {"quick": quick_skip}, "results": results}


def test_format_time_units():
    sym = {"mu": "u", "x": "x", "delta": "d", "dash": "-"}
    assert common.format_time(2.5e-6, sym) == "2.5 us"
    assert common.format_time(0.0123, sym) == "12.30 ms"
    assert common.format_time(12.0, sym) == "12.0 s"


def test_table_says_the_reference_is_float64_and_materialised():
    table = report.format_shapes_table(_report())
    header = table.splitlines()[0]
    assert "ref f64" in header
    note = " ".join(table.split("ref f64 = ", 1)[1].split())
    assert "float64" in note and "whole Lq x Lk score matrix" in note


def test_half_table_gives_the_ratios_against_float32():
    # The 16-bit rows' second table: each time, and the float32 twins' time over fastattn's.
    rep = _report()
    assert report.format_half_table(rep) is None       # no 16-bit shape ran
    shape = shapes.SHAPES_BY_NAME["decode-4k-f16"]
    lib = lambda s: {"median_s": s, "gbs": shapes.bytes_moved(shape) / s / 1e9}  # noqa: E731
    rep["machine"]["peaks"]["read_gbs"] = 30.0
    rep["results"].append({
        "name": shape.name, "kind": "decode", "dtype": "float16", "bytes": shapes.bytes_moved(shape),
        "libraries": {"fastattn": lib(4e-3), "fastattn-f32": lib(8e-3), "torch": lib(3e-2),
                      "torch-f32": lib(9e-3)},
        "speedup_vs_fastattn-f32": 2.0, "speedup_vs_torch": 7.5, "speedup_vs_torch-f32": 2.25,
        "check": {"ok": True, "vs_reference_max_abs": 6.1e-5,
                  "torch_vs_reference_max_abs": 2.4e-4}})
    table = report.format_half_table(rep)
    row = [line for line in table.splitlines() if line.startswith("decode-4k-f16")][0]
    assert row.replace("×", "x").split()[1:] == [
        "float16", "4.00", "ms", "8.00", "ms", "30.00", "ms", "9.00", "ms", "2.00x", "7.50x",
        "2.25x", "56%", "6.1e-05", "2.4e-04"]


def test_backward_table_says_what_each_error_is_measured_against():
    r = {"machine": {"peaks": {}}, "results": [{
        "name": "small", "shape": "(8,8,128,128,64)", "dtype": "float32", "libraries": {},
        "check": {"ok": True, "vs_torch_max_rel": 1.25e-7, "vs_reference_max_rel": 3.5e-7}}]}
    text = report.format_backward_table(r)
    sym = common.symbols()
    header, _, row = text.splitlines()[:3]
    assert f"{sym['delta']} vs torch" in header and f"{sym['delta']} vs f64" in header
    assert "1.2e-07" in row and "3.5e-07" in row     # each error in its own column
    note = " ".join(text.splitlines()[3:])
    assert "torch's" in note and "float64 oracle" in note


# ---------------------------------------------------------------------- plot

@pytest.fixture
def plt():
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    yield plt
    plt.close("all")


def _texts(fig):
    return [t.get_text() for t in fig.texts] + [t.get_text() for ax in fig.axes
                                                for t in ax.texts]


def test_plot_title_names_only_what_ran(plt):
    with_torch = plot.plot_figure(_report(torch=True), plt)._suptitle.get_text()
    without = plot.plot_figure(_report(torch=False), plt)._suptitle.get_text()
    assert with_torch.startswith("fastattn vs torch vs NumPy reference")
    assert without.startswith("fastattn vs NumPy reference")
    assert "torch" not in without


def _axis(fig, label):
    (ax,) = [ax for ax in fig.axes if ax.get_ylabel().startswith(label)]
    return ax


def test_plot_speedup_ticks_are_readable(plt):
    fig = plot.plot_figure(_report(), plt)
    fig.canvas.draw()
    x = common.symbols()["x"]
    # Over torch the speed-ups run from 1.07x (long-8k) to 5x (tiny): their own axis, which
    # the reference's 66.7x (tiny) does not stretch.
    for label, ticks in (("speed-up over\ntorch", ("0.5", "1", "2", "5", "10")),
                         ("speed-up over\nreference",
                          ("0.5", "1", "2", "5", "10", "20", "50", "100"))):
        ax = _axis(fig, label)
        assert [t.get_text() for t in ax.get_yticklabels()] == [f"{v}{x}" for v in ticks]
        assert ax.get_yscale() == "log"


def test_plot_leads_with_torch_and_names_the_float64_reference(plt):
    fig = plot.plot_figure(_report(), plt)
    assert fig.axes[0].get_ylabel().startswith("speed-up over\ntorch")
    reference = _axis(fig, "speed-up over\nreference")
    (legend,) = [t.get_text() for t in reference.get_legend().get_texts()]
    assert "float64" in legend and "whole score matrix" in legend
    assert "(float64)" in fig._suptitle.get_text()
    # The time panel holds fastattn and torch only.
    time_legend = _axis(fig, "time per call").get_legend().get_texts()
    assert [t.get_text() for t in time_legend] == ["fastattn", "torch"]


def test_speedup_ticks():
    assert plot._speedup_ticks(1.0, 1.0) == [0.5, 1.0, 2.0]
    assert plot._speedup_ticks(0.61, 56.1) == [0.5, 1, 2, 5, 10, 20, 50, 100]
    assert plot._speedup_ticks(1.2, 3.0) == [1, 2, 5]


def test_plot_marks_shapes_skipped_by_quick(plt):
    texts = _texts(plot.plot_figure(_report(quick_skip=True), plt))
    # long-8k's reference, where its bar would be in the reference's speed-up panel
    assert sum("skipped\n(--quick)" == t for t in texts) == 1
    texts = _texts(plot.plot_figure(_report(quick_skip=False), plt))
    assert not any("skipped" in t for t in texts)


def test_plot_carries_the_load_warning(plt):
    busy = _report(load=0.4)
    texts = _texts(plot.plot_figure(busy, plt))
    warning = report.load_warning(busy)
    assert warning and any(warning.split(";")[0][:40] in t.replace("\n", " ") for t in texts)
    quiet = _texts(plot.plot_figure(_report(load=0.01), plt))
    assert not any("WARNING" in t for t in quiet)


def test_peak_over_100_percent_is_flagged(plt):
    low_peak = _report(peak_gflops=100.0)         # 108 GFLOP/s measured against 100
    assert report.peak_flagged(low_peak) == ["small", "long-8k"]
    table = report.format_shapes_table(low_peak)
    assert "108%* sgemm" in table
    texts = _texts(plot.plot_figure(low_peak, plt))
    assert texts.count("108%*\nsgemm") == 2
    note = report.peak_note(low_peak)
    assert note and any(note[:30] in t.replace("\n", " ") for t in texts)

    fine = _report(peak_gflops=150.0)
    assert report.peak_flagged(fine) == [] and report.peak_note(fine) is None
    assert "*" not in report.format_shapes_table(fine)
    texts = _texts(plot.plot_figure(fine, plt))
    assert "72%\nsgemm" in texts and not any("over 100%" in t for t in texts)


@pytest.mark.parametrize("peaks_load, blames_load", [(0.0, False), (None, False), (0.4, True)])
def test_over_100_percent_note_agrees_with_the_load(peaks_load, blames_load):
    # A "*" beside a quiet machine must not be blamed on other processes.
    low_peak = _report(peak_gflops=100.0, load=0.0)
    if peaks_load is not None:
        low_peak["machine"]["other_cpu_load_during_peaks"] = peaks_load
    note = report.peak_note(low_peak)
    assert ("other processes used 40%" in note) == blames_load
    assert ("not the hardware's limit" in note) == (not blames_load)


def test_percent_labels_name_their_yardstick(plt):
    # A prefill shape's share is of sgemm, a decode shape's of the read bandwidth.
    rep = _report(peak_gflops=150.0)
    shape = shapes.SHAPES_BY_NAME["decode-4k"]
    rep["machine"]["peaks"]["read_gbs"] = 30.0
    nbytes = shapes.bytes_moved(shape)
    rep["results"].append({
        "name": shape.name, "kind": "decode", "dtype": "float32", "bytes": nbytes,
        "libraries": {"fastattn": {"median_s": nbytes / 15e9, "gbs": 15.0}},
        "check": {"ok": True}})
    texts = _texts(plot.plot_figure(rep, plt))
    assert "50%\nread bw" in texts and "72%\nsgemm" in texts
    row = [ln for ln in report.format_shapes_table(rep).splitlines()
           if ln.startswith("decode-4k")][0]
    assert "50% read bw" in row
