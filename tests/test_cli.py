"""The command line: ``python -m fastattn info`` and ``python -m fastattn bench``.

The CLI runs in a subprocess from the repository root, as a user would run it. Timings are
never asserted (they depend on the machine and its load); their structure, sign and
finiteness are, and so are the numbers that can be computed independently (FLOP and byte
counts, correctness differences against the reference).
"""
import argparse
import importlib.machinery
import importlib.util
import io
import json
import math
import os
import re
import subprocess
import sys

import numpy as np
import pytest

import fastattn
from fastattn.cli import common, info
from fastattn.cli.main import main
from fastattn.cli.bench import harness, measure, plot, report, shapes

from conftest import ROOT, run_python

HAVE_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None


def run_cli(*args, timeout=600):
    return run_python("-m", "fastattn", *args, cwd=ROOT, timeout=timeout, check=False)


def positive_finite(x):
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


# --------------------------------------------------------------------------- info

def test_info_text():
    proc = run_cli("info")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    for label in ("fastattn:", "Python:", "NumPy:", "compiler:", "OpenMP:", "threads:",
                  "SIMD variant:"):
        assert label in out
    assert fastattn.__version__ in out


def test_info_says_what_the_thread_pool_is():
    # The kernels run on fastattn's own pool of POSIX threads; OpenMP, when linked, gives
    # the default thread count and a team for the calls FASTATTN_POOL sends to it. "OpenMP:
    # yes" alone read as "runs on OpenMP".
    facts = {"version": "0", "python": "3", "python_implementation": "CPython", "numpy": "2",
             "platform": "p", "compiler": "c", "threads": 2, "isa": "avx2",
             "available_variants": ["avx2"], "openmp": True, "thread_pool": "pthreads"}
    lines = dict(line.split(":", 1) for line in info.format_info(facts).splitlines())
    assert lines["thread pool"].strip() == "fastattn's own pool of POSIX threads"
    assert lines["OpenMP"].strip().startswith("yes: the default thread count")
    assert lines["OpenMP team runs"].strip() == "unknown"
    facts.update(pool_choice="auto", openmp_team="never")
    lines = dict(line.split(":", 1) for line in info.format_info(facts).splitlines())
    assert lines["OpenMP team runs"].strip().startswith("none yet (FASTATTN_POOL=auto")
    facts.update(pool_choice="auto", openmp_team="in torch")
    lines = dict(line.split(":", 1) for line in info.format_info(facts).splitlines())
    assert lines["OpenMP team runs"].strip() == ("the torch integrations' calls, on torch's "
                                                 "threads (FASTATTN_POOL=auto)")
    facts.update(openmp=False)
    lines = dict(line.split(":", 1) for line in info.format_info(facts).splitlines())
    assert lines["OpenMP"].strip().startswith("no")


def test_info_json_matches_the_package():
    proc = run_cli("info", "--json")
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout)
    assert info["version"] == fastattn.__version__
    assert info["numpy"] == np.__version__
    assert info["threads"] == fastattn.get_num_threads()
    from fastattn import _dispatch
    assert info["isa"] == _dispatch.ISA
    assert info["isa"] in info["available_variants"]
    assert isinstance(info["openmp"], bool)
    assert info["compiler"] != "unknown"


# --------------------------------------------------------------------------- bench

@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bench")
    json_path, png_path = tmp / "tmp.json", tmp / "bench.png"
    plot_args = ("--plot", str(png_path)) if HAVE_MATPLOTLIB else ()
    proc = run_cli("bench", "--quick", "--shapes", "tiny,small", "--json", str(json_path),
                   *plot_args)
    return proc, json_path, png_path


def test_bench_quick_exit_status_and_table(quick_run):
    proc, _, _ = quick_run
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    rows = {line.split()[0]: line for line in lines if line.split()[:1] in (["tiny"], ["small"])}
    assert set(rows) == {"tiny", "small"}
    for row in rows.values():
        check, bg_load = row.split()[-2:]
        assert check == "ok"
        assert bg_load.endswith("%") or bg_load == "?"
    assert "GFLOP/s" in proc.stdout
    assert "measured peaks: sgemm" in proc.stdout


def test_bench_quick_json(quick_run):
    _, json_path, _ = quick_run
    report = json.loads(json_path.read_text())
    machine = report["machine"]
    assert machine["fastattn"] == fastattn.__version__
    assert machine["threads"]["fastattn"] == fastattn.get_num_threads()
    assert positive_finite(machine["peaks"]["sgemm_gflops"])
    assert "read_gbs" not in machine["peaks"]          # no decode shape was asked for
    assert report["settings"]["quick"] is True
    assert [r["name"] for r in report["results"]] == ["tiny", "small"]

    # Independently computed work: 4 * Hq * Lq * Lk * D multiply-adds-as-flops.
    expected_flops = {"tiny": 4 * 1 * 6 * 6 * 3, "small": 4 * 8 * 128 * 128 * 64}
    for r in report["results"]:
        assert r["flops"] == expected_flops[r["name"]]
        fa = r["libraries"]["fastattn"]
        assert positive_finite(fa["median_s"])
        assert all(positive_finite(t) for t in fa["samples_s"])
        assert len(fa["samples_s"]) == report["settings"]["repeat"]
        assert fa["gflops"] == pytest.approx(r["flops"] / fa["median_s"] / 1e9)
        ref = r["libraries"]["reference"]
        assert positive_finite(ref["median_s"])
        assert r["speedup_vs_reference"] == pytest.approx(ref["median_s"] / fa["median_s"])
        torch_entry = r["libraries"]["torch"]
        if "skipped" in torch_entry:
            assert "speedup_vs_torch" not in r
        else:
            assert positive_finite(torch_entry["median_s"])
            assert positive_finite(r["speedup_vs_torch"])
            assert 0 <= r["check"]["vs_torch_max_abs"] <= r["check"]["tolerance"]
        if "other_cpu_load" in r:    # Linux: measured from /proc/stat
            assert 0 <= r["other_cpu_load"] <= 1 and 0 <= r["cpu_steal"] <= 1
        check = r["check"]
        assert check["ok"] is True
        assert check["reference_slice"] == "whole output"
        assert 0 <= check["vs_reference_max_abs"] <= 1e-4


def test_bench_plot(quick_run):
    proc, _, png_path = quick_run
    if not HAVE_MATPLOTLIB:
        pytest.skip("matplotlib is not installed")
    assert png_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("command", [["bench", "--shapes", "tiny"], ["demo"]])
def test_plot_without_matplotlib_fails_before_the_run(command, monkeypatch, tmp_path, capsys):
    # Nothing is measured or printed: the missing dependency is reported at once, with
    # how to install it, and the environment's exit status.
    monkeypatch.setitem(sys.modules, "matplotlib", None)   # makes `import matplotlib` fail
    target = tmp_path / "plots"
    assert main([*command, "--plot", str(target)]) == common.ENVIRONMENT
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "--plot needs matplotlib" in captured.err and "pip install matplotlib" in captured.err
    assert not target.exists()


def test_bench_threads_and_decode(tmp_path):
    json_path = tmp_path / "one.json"
    proc = run_cli("bench", "--quick", "--repeat", "1", "--threads", "1",
                   "--shapes", "decode-4k", "--json", str(json_path))
    assert proc.returncode == 0, proc.stderr
    report = json.loads(json_path.read_text())
    assert report["machine"]["threads"]["fastattn"] == 1
    if report["machine"]["torch"] is not None:
        assert report["machine"]["threads"]["torch"] == 1
    (r,) = report["results"]
    assert r["kind"] == "decode"
    # K and V (32 heads x 4096 x 128 each) plus q and out (32 x 128 each), float32.
    assert r["bytes"] == (2 * 32 * 4096 * 128 + 2 * 32 * 128) * 4
    assert positive_finite(report["machine"]["peaks"]["read_gbs"])
    assert len(r["libraries"]["fastattn"]["samples_s"]) == 1
    assert r["check"]["ok"] is True
    assert "GB/s" in proc.stdout


def _log_harness(monkeypatch):
    """A list to which the harness adds "pause" for each pause and "batch" at the end of
    each timed batch; the callables add their own events."""
    events = []
    monkeypatch.setattr(harness, "settle", lambda: events.append("pause"))
    timed = harness.timed_batch

    def logged_batch(fn, n):
        seconds = timed(fn, n)
        events.append("batch")
        return seconds

    monkeypatch.setattr(harness, "timed_batch", logged_batch)
    return events


def _timed_samples(events):
    """Each timed sample's events since its pause: the wake-up call, then the batch."""
    segments = " ".join(events).split("batch")[:-1]
    return [seg.split("pause")[-1].split() for seg in segments]


def test_bench_each_timed_batch_follows_an_untimed_call(monkeypatch):
    # After the pause before a batch, one untimed call wakes the library's threads, so the
    # batch times back-to-back calls only; the reference's batches (long calls) go as is.
    events = _log_harness(monkeypatch)

    class Logged:
        def __init__(self, mod, tag):
            self.mod, self.tag = mod, tag

        def attention(self, *args, **kwargs):
            events.append(self.tag)
            return self.mod.attention(*args, **kwargs)

    result = measure.measure_shape(shapes.SHAPES_BY_NAME["tiny"], fa=Logged(fastattn, "fa"),
                               ref_mod=Logged(fastattn.reference, "ref"), torch=None,
                               repeat=2, quick=True)
    calls = {tag: result["libraries"][name]["calls_per_sample"]
             for tag, name in (("fa", "fastattn"), ("ref", "reference"))}
    # Each timed sample: a pause, the calls, then the batch ends.
    samples = _timed_samples(events)
    assert sorted(s[0] for s in samples) == ["fa", "fa", "ref", "ref"]
    for s in samples:
        assert len(set(s)) == 1
        assert len(s) == calls[s[0]] + (1 if s[0] == "fa" else 0)


@pytest.mark.parametrize("args, message", [
    (["bench", "--shapes", "tiny,nope"], "unknown shape(s) nope"),
    (["bench", "--repeat", "0"], "--repeat must be >= 1"),
    (["bench", "--threads", "0"], "--threads must be >= 1"),
    (["bench", "--repeat", "many"], "invalid int value"),
    (["frobnicate"], "invalid choice"),
])
def test_usage_errors_exit_2(args, message):
    proc = run_cli(*args)
    assert proc.returncode == 2
    assert message in proc.stderr


def test_no_command_prints_help_and_exits_2():
    proc = run_cli()
    assert proc.returncode == 2
    assert "bench" in proc.stderr and "info" in proc.stderr and "demo" in proc.stderr


# --------------------------------------------------------------------------- helpers

def test_flop_count_causal_counts_visible_pairs_only():
    # Lq = Lk = 4 causal: rows see 1, 2, 3, 4 keys -> 10 pairs.
    shape = shapes.Shape("t", 2, 1, 4, 4, 8, causal=True)
    assert shapes.visible_pairs(shape) == 10
    assert shapes.flops(shape) == 4 * 8 * 2 * 10
    # Bottom-right alignment with Lq < Lk: 2 queries against 5 keys see 4 and 5 keys.
    assert shapes.visible_pairs(shapes.Shape("t", 1, 1, 2, 5, 8, causal=True)) == 9
    # Every bench shape with Lq == Lk causal counts L(L+1)/2 pairs per head.
    s = shapes.SHAPES_BY_NAME["prefill-1k-causal"]
    assert shapes.flops(s) == 4 * 64 * 12 * (1024 * 1025 // 2)


def test_spec_shapes():
    got = [(s.name, s.hq, s.hkv, s.lq, s.lk, s.d, s.causal, s.dtype) for s in shapes.SHAPES]
    assert got == [
        ("tiny", 1, 1, 6, 6, 3, False, "float32"),
        ("small", 8, 8, 128, 128, 64, False, "float32"),
        ("prefill-1k", 12, 12, 1024, 1024, 64, False, "float32"),
        ("prefill-1k-causal", 12, 12, 1024, 1024, 64, True, "float32"),
        ("prefill-4k-causal", 4, 4, 4096, 4096, 64, True, "float32"),
        ("long-8k", 1, 1, 8192, 8192, 64, False, "float32"),
        ("decode-4k", 32, 32, 1, 4096, 128, False, "float32"),
        ("decode-gqa-8k", 32, 8, 1, 8192, 128, False, "float32"),
        ("prefill-1k-f64", 12, 12, 1024, 1024, 64, True, "float64"),
        ("decode-4k-f16", 32, 32, 1, 4096, 128, False, "float16"),
        ("decode-4k-bf16", 32, 32, 1, 4096, 128, False, "bfloat16"),
        ("decode-gqa-8k-f16", 32, 8, 1, 8192, 128, False, "float16"),
        ("decode-4k-q8_0", 32, 32, 1, 4096, 128, False, "q8_0"),
        ("decode-gqa-8k-q8_0", 32, 8, 1, 8192, 128, False, "q8_0"),
        ("prefill-1k-f16", 12, 12, 1024, 1024, 64, False, "float16"),
        ("prefill-1k-bf16", 12, 12, 1024, 1024, 64, False, "bfloat16"),
        ("prefill-1k-causal-bf16", 12, 12, 1024, 1024, 64, True, "bfloat16"),
        ("prefill-4k-causal-bf16", 4, 4, 4096, 4096, 64, True, "bfloat16"),
    ]


def test_reference_slice_keeps_causal_alignment_and_gqa_mapping():
    # The slice the bench checks on big shapes must give the same rows as the full problem.
    from fastattn import reference
    shape = shapes.Shape("t", 4, 2, 80, 96, 8, causal=True)
    q, k, v = shapes.make_inputs(shape)
    full = reference.attention(q, k, v, causal=True)
    (qs, ks, vs), (heads, rows) = shapes.reference_slice(shape, q, k, v)
    assert heads == [0, 3] and rows == 64
    part = reference.attention(qs, ks, vs, causal=True)
    # Same rows and keys; only BLAS blocking may differ, far below float32 resolution.
    np.testing.assert_allclose(part, full[:, heads, shape.lq - rows:], rtol=1e-6, atol=1e-7)


def test_format_time_units():
    sym = {"mu": "u", "x": "x", "delta": "d", "dash": "-"}
    assert common.format_time(2.5e-6, sym) == "2.5 us"
    assert common.format_time(0.0123, sym) == "12.30 ms"
    assert common.format_time(12.0, sym) == "12.0 s"


# --------------------------------------------------------------------------- closed pipe

@pytest.mark.parametrize("command", [["info"], ["demo"], ["bench", "--shapes", "tiny"]])
def test_closed_pipe_ends_quietly(command):
    # `python -m fastattn info | head -3`: the reader goes away. Closing our end before the
    # child writes its first line makes the broken pipe certain rather than a race.
    proc = subprocess.Popen([sys.executable, "-m", "fastattn", *command], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    proc.stdout.close()
    err = proc.stderr.read()
    proc.wait(timeout=300)
    assert "Traceback" not in err and "BrokenPipeError" not in err, err
    assert proc.returncode == 1


# --------------------------------------------------------------------------- shadowing

def test_info_in_an_unbuilt_source_tree_says_so(tmp_path):
    # A copy of the package's Python files without the compiled kernel, in the current
    # directory, hides the working package that PYTHONPATH points to.  The child runs
    # without site (-S), with NumPy's directory on PYTHONPATH: an editable install's import
    # hook (a .pth file) would otherwise supply the kernel modules to the copy.
    shadow = tmp_path / "fastattn"
    shadow.mkdir()
    package = os.path.dirname(os.path.abspath(fastattn.__file__))
    for name in os.listdir(package):
        if name.endswith(".py"):
            (shadow / name).write_bytes(open(os.path.join(package, name), "rb").read())
    numpy_dir = os.path.dirname(os.path.dirname(os.path.abspath(np.__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(package), numpy_dir]))
    proc = subprocess.run([sys.executable, "-S", "-m", "fastattn", "info"], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert f"fastattn in {shadow} has no compiled kernel" in proc.stderr
    assert "run from another directory" in proc.stderr
    assert "circular import" not in proc.stderr


def _fake_installed(root, version="9.9.9"):
    """A distribution 'fastattn' installed in ``root``, as pip leaves it (RECORD lists the
    package's files)."""
    dist = root / f"fastattn-{version}.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: fastattn\nVersion: {version}\n")
    (dist / "RECORD").write_text("fastattn/__init__.py,,\n"
                                 f"fastattn-{version}.dist-info/METADATA,,\n")
    (root / "fastattn").mkdir()
    (root / "fastattn" / "__init__.py").write_text("")
    return str(root / "fastattn")


def test_info_names_the_folder_that_hides_the_installed_package(tmp_path, monkeypatch):
    installed = _fake_installed(tmp_path / "site")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))    # found first by importlib.metadata
    assert info._installed_dir() == ("9.9.9", installed)
    here = os.path.dirname(os.path.abspath(fastattn.__file__))
    facts = info.collect()
    (problem,) = facts["problems"]
    assert here in problem and installed in problem and "9.9.9" in problem
    text = info.format_info(facts)
    assert text.splitlines()[-1].startswith("         ")      # wrapped under "problem: "
    assert "problem: fastattn is imported from" in text
    assert info.run(argparse.Namespace(json=False), stdout=io.StringIO()) == 3


def test_info_without_an_installed_copy_has_no_problem(monkeypatch):
    monkeypatch.setattr(info, "_installed_dir", lambda: None)
    assert info.shadowing_problems(fastattn) == []
    assert "problems" not in info.collect()


def test_info_explains_a_namespace_folder(tmp_path):
    # `import fastattn` resolving to a folder without __init__.py: a namespace package with
    # no version, no threads and no kernel.
    folder = tmp_path / "fastattn"
    folder.mkdir()
    spec = importlib.machinery.ModuleSpec("fastattn", None, is_package=True)
    spec.submodule_search_locations = [str(folder)]
    namespace = importlib.util.module_from_spec(spec)
    facts = info.collect(namespace)
    assert facts["version"] == "unknown" and facts["threads"] == "unknown"
    (problem,) = facts["problems"]
    assert str(folder) in problem and "no __init__.py" in problem
    assert "problem: 'import fastattn' found the folder" in info.format_info(facts)


# --------------------------------------------------------------------------- bench plot

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


def test_table_says_the_reference_is_float64_and_materialised():
    table = report.format_shapes_table(_report())
    header = table.splitlines()[0]
    assert "ref f64" in header
    note = " ".join(table.split("ref f64 = ", 1)[1].split())
    assert "float64" in note and "whole Lq x Lk score matrix" in note


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


def test_info_from_beside_a_folder_named_fastattn(tmp_path):
    # A checkout cloned into ./fastattn (no __init__.py at its top) next to an editable
    # install: Python's path finder takes the folder as a namespace package before the
    # editable install's finder is asked, yet `python -m fastattn info` still runs,
    # because that finder supplies the submodules. Simulated with the same kind of finder.
    package = os.path.dirname(os.path.abspath(fastattn.__file__))
    probe = subprocess.run([sys.executable, "-c", "import sys; print(sys.path)"],
                           cwd=tmp_path, capture_output=True, text=True)
    if repr(os.path.dirname(package)) in probe.stdout:
        pytest.skip("fastattn is installed on sys.path, where it wins over a namespace folder")
    (tmp_path / "fastattn").mkdir()
    code = f"""
import importlib.machinery, runpy, sys
class EditableFinder:
    @staticmethod
    def find_spec(name, path=None, target=None):
        if name.startswith("fastattn."):
            return importlib.machinery.PathFinder.find_spec(name, [{package!r}])
sys.meta_path.append(EditableFinder)
sys.argv = ["fastattn", "info"]
runpy.run_module("fastattn", run_name="__main__", alter_sys=True)
"""
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 3, proc.stderr
    out = proc.stdout
    assert "fastattn:               unknown" in out and "threads:                unknown" in out
    problem = " ".join(out.split("problem:", 1)[1].split())    # unwrapped
    assert problem.startswith(f"'import fastattn' found the folder {tmp_path / 'fastattn'},")


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


def test_check_outputs_gives_both_libraries_error_against_the_reference():
    # The 16-bit table's error columns: fastattn's and torch's own distance from the
    # float64 reference, on the same rows.
    shape = shapes.Shape("t", 2, 2, 3, 5, 4)
    q, k, v = shapes.make_inputs(shape)
    ref = np.zeros((1, 2, 3, 4))
    outputs = {"reference": ref, "fastattn": ref + 1e-6, "torch": ref - 3e-6}
    check = measure.check_outputs(shape, None, outputs, q, k, v)
    assert check["vs_reference_max_abs"] == pytest.approx(1e-6)
    assert check["torch_vs_reference_max_abs"] == pytest.approx(3e-6)
    assert check["vs_torch_max_abs"] == pytest.approx(4e-6)


# --------------------------------------------------------------------------- layout

def test_help_lists_the_exit_statuses(capsys):
    for command in ([], ["bench"], ["info"], ["demo"]):
        assert main([*command, "--help"]) == 0
        out = capsys.readouterr().out
        assert "exit status:" in out
        for status in (common.OK, common.FAILED, common.USAGE, common.ENVIRONMENT):
            assert f"\n  {status}  " in out


def _help_statuses(command, capsys):
    assert main([command, "--help"]) == 0
    statuses = {}
    for line in capsys.readouterr().out.split("exit status:")[1].splitlines():
        m = re.match(r"  (\d)  (.*)", line)
        if m:
            status = int(m.group(1))
            statuses[status] = m.group(2)
        elif line.strip():
            statuses[status] += " " + line.strip()
    return statuses


def test_info_and_demo_help_list_only_what_they_can_return(capsys):
    # info and demo check nothing: their 1 is only a closed stdout; their 3 only their
    # own environment failure.
    info_statuses = _help_statuses("info", capsys)
    demo_statuses = _help_statuses("demo", capsys)
    for statuses in (info_statuses, demo_statuses):
        assert set(statuses) == {0, 1, 2, 3}
        assert "correctness" not in statuses[1] and "went away" in statuses[1]
    assert "matplotlib" not in info_statuses[3] and "installed one" in info_statuses[3]
    assert "matplotlib" in demo_statuses[3] and "imported" not in demo_statuses[3]
    assert "correctness" in _help_statuses("bench", capsys)[1]


def test_version_prints_the_version_and_exits_0():
    proc = run_cli("--version")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().endswith(fastattn.__version__)


def test_the_library_never_imports_the_command_line():
    # Run in a fresh interpreter: every library module imported, no fastattn.cli module.
    code = ("import sys, fastattn, fastattn.reference, fastattn.layers, fastattn.positions, "
            "fastattn.integrations.transformers, fastattn.integrations.tabpfn; "
            "print([m for m in sys.modules if m.startswith(('fastattn.cli', 'fastattn.__main__'))])")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def _cli_imports():
    """{module: fastattn.cli modules it imports anywhere in its code}, from the source."""
    import ast
    import pkgutil
    import fastattn.cli as cli

    graph = {}
    for mod in pkgutil.walk_packages(cli.__path__, "fastattn.cli."):
        spec = importlib.util.find_spec(mod.name)
        is_pkg = spec.submodule_search_locations is not None
        package = mod.name if is_pkg else mod.name.rsplit(".", 1)[0]
        tree = ast.parse(open(spec.origin).read())
        targets = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                base = (importlib.util.resolve_name("." * node.level + (node.module or ""),
                                                    package) if node.level else node.module)
                # `from . import harness` imports a module; `from .x import f` imports x.
                targets |= {f"{base}.{a.name}" if _is_module(f"{base}.{a.name}") else base
                            for a in node.names}
            elif isinstance(node, ast.Import):
                targets |= {a.name for a in node.names}
        graph[mod.name] = {t for t in targets if t.startswith("fastattn.cli.") and t != mod.name}
    return graph


def _is_module(name):
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, AttributeError, ValueError):
        return False


def test_no_import_cycles_in_the_command_line():
    graph = _cli_imports()
    assert "fastattn.cli.bench.harness" in graph["fastattn.cli.bench.measure"]
    state = {}

    def visit(node, path):
        if state.get(node) == "done":
            return
        assert state.get(node) != "open", f"import cycle: {' -> '.join(path + [node])}"
        state[node] = "open"
        for nxt in sorted(graph.get(node, ())):
            visit(nxt, path + [node])
        state[node] = "done"

    for node in sorted(graph):
        visit(node, [])


def test_variants_table_times_as_the_shapes_table_does(monkeypatch):
    # The same harness: a pause, then an untimed wake-up call, before every timed batch.
    from fastattn.cli.bench import variants
    events = []
    monkeypatch.setattr(harness, "settle", lambda: events.append("pause"))
    timed = harness.timed_batch

    def logged_batch(fn, n):
        events.append(f"batch of {n}")
        return timed(fn, n)

    monkeypatch.setattr(harness, "timed_batch", logged_batch)
    monkeypatch.setattr(variants, "BATCH_S", 1e-4)
    medians = variants._time({"variant": lambda: events.append("call"),
                              "plain": lambda: events.append("call")}, 2)
    assert set(medians) == {"variant", "plain"}
    batches = [i for i, e in enumerate(events) if e.startswith("batch")]
    assert len(batches) == 4
    for i in batches:
        assert events[i - 2:i] == ["pause", "call"], events[i - 3:i + 1]


# --------------------------------------------------------------------------- bench --backward

@pytest.fixture(scope="module")
def backward_run(tmp_path_factory):
    json_path = tmp_path_factory.mktemp("backward") / "backward.json"
    proc = run_cli("bench", "--backward", "--quick", "--repeat", "2", "--shapes", "tiny,small",
                   "--json", str(json_path))
    return proc, json_path


def _rows(text, names):
    """{name: the cells of the first line that starts with each name}."""
    rows = {}
    for line in text.splitlines():
        cells = line.split()
        if cells[:1] and cells[0] in names and cells[0] not in rows:
            rows[cells[0]] = cells
    return rows


def test_bench_backward_prints_its_rows(backward_run):
    proc, _ = backward_run
    assert proc.returncode == 0, proc.stderr
    timing, accuracy = proc.stdout.split("accuracy against the float64 oracle")
    rows = _rows(timing, {"tiny", "small"})
    assert set(rows) == {"tiny", "small"}
    for cells in rows.values():
        assert cells[-2] == "ok"
        assert "sgemm" in cells
    assert "GFLOP/s" in timing and "attention_backward" in timing
    # The accuracy table: six errors per shape (dq, dk, dv of each side), or dashes for
    # torch when it is absent.
    for cells in _rows(accuracy, {"tiny", "small"}).values():
        assert cells[1] == "float32" and len(cells) == 8
        assert all(0 <= float(c) <= 1e-4 for c in cells[2:5])


def test_bench_backward_json(backward_run):
    _, json_path = backward_run
    report = json.loads(json_path.read_text())
    assert report["settings"]["table"] == "backward"
    assert [r["name"] for r in report["results"]] == ["tiny", "small"]
    # A backward counts 2.5 forwards: 2.5 * 4 * Hq * Lq * Lk * D.
    expected_flops = {"tiny": 10 * 1 * 6 * 6 * 3, "small": 10 * 8 * 128 * 128 * 64}
    for r in report["results"]:
        assert r["pass"] == "backward" and r["flops"] == expected_flops[r["name"]]
        fa = r["libraries"]["fastattn"]
        assert len(fa["samples_s"]) == 2 and positive_finite(fa["median_s"])
        assert fa["gflops"] == pytest.approx(r["flops"] / fa["median_s"] / 1e9)
        check = r["check"]
        assert check["ok"] is True
        assert set(check["accuracy"]["fastattn"]) == {"dq", "dk", "dv"}
        assert 0 <= check["vs_reference_max_rel"] <= check["tolerance"] == 1e-4
        if "skipped" in r["libraries"]["torch"]:
            assert "speedup_vs_torch" not in r and "torch" not in check["accuracy"]
        else:
            assert positive_finite(r["speedup_vs_torch"])
            assert 0 <= check["vs_torch_max_rel"] <= check["tolerance"]
            assert max(check["accuracy"]["torch"].values()) <= check["tolerance"]


def test_backward_shapes():
    got = [(s.name, s.hq, s.hkv, s.lq, s.lk, s.d, s.causal, s.dtype)
           for s in shapes.BACKWARD_SHAPES]
    assert got == [
        ("tiny", 1, 1, 6, 6, 3, False, "float32"),
        ("small", 8, 8, 128, 128, 64, False, "float32"),
        ("prefill-1k", 12, 12, 1024, 1024, 64, False, "float32"),
        ("prefill-1k-causal", 12, 12, 1024, 1024, 64, True, "float32"),
        ("prefill-4k-causal", 4, 4, 4096, 4096, 64, True, "float32"),
        ("prefill-gqa-1k-causal", 16, 4, 1024, 1024, 128, True, "float32"),
        ("prefill-1k-causal-bf16", 12, 12, 1024, 1024, 64, True, "bfloat16"),
    ]
    # Causal: 2.5 forwards over the visible pairs only.
    s = shapes.BACKWARD_SHAPES_BY_NAME["prefill-1k-causal"]
    assert shapes.backward_flops(s) == 10 * 64 * 12 * (1024 * 1025 // 2)


@pytest.mark.parametrize("args, message", [
    (["bench", "--backward", "--shapes", "long-8k"], "unknown shape(s) long-8k"),
    (["bench", "--backward", "--variants"], "not allowed with argument"),
    (["bench", "--backward", "--repeat", "0"], "--repeat must be >= 1"),
])
def test_bench_backward_usage_errors_exit_2(args, message):
    proc = run_cli(*args)
    assert proc.returncode == 2
    assert message in proc.stderr


def _wrong_backward(backward):
    """``backward`` with a dk 1% too large."""
    def wrong(*args, **kwargs):
        dq, dk, dv = backward(*args, **kwargs)
        return dq, dk * np.float32(1.01), dv
    return wrong


@pytest.mark.parametrize("torch_installed", [True, False])
def test_bench_backward_fails_on_wrong_gradients(monkeypatch, capsys, torch_installed):
    # The check compares with the oracle (and torch when installed); a wrong dk fails the
    # run with exit status 1. Without torch the table shows fastattn only.
    if not torch_installed:
        monkeypatch.setattr(harness, "import_torch", lambda: None)
    monkeypatch.setattr(fastattn, "attention_backward",
                        _wrong_backward(fastattn.attention_backward))
    assert main(["bench", "--backward", "--quick", "--repeat", "1", "--shapes", "tiny"]) \
        == common.FAILED
    out, err = capsys.readouterr()
    assert "correctness check FAILED on: tiny" in err and "error" not in err
    cells = _rows(out.split("accuracy against")[0], {"tiny"})["tiny"]
    assert cells[-2] == "FAIL"
    if not torch_installed:
        assert "n/a" in cells
        accuracy = _rows(out.split("accuracy against")[1], {"tiny"})["tiny"]
        assert accuracy[5:] == [common.symbols()["dash"]] * 3


def test_bench_backward_names_the_shapes_the_oracle_skips(monkeypatch):
    from fastattn.cli.bench import backward
    monkeypatch.setattr(backward, "QUICK_ORACLE_MAX_SCORES", 10)
    inputs = shapes.make_backward_inputs(shapes.SHAPES_BY_NAME["tiny"])
    exact, why = backward.oracle_gradients(shapes.SHAPES_BY_NAME["tiny"], fastattn.reference,
                                           inputs, quick=True)
    assert exact is None
    assert why == "skipped: the float64 oracle would build 1 x 6 x 6 matrices; run without --quick"
    check = backward.check_gradients(shapes.SHAPES_BY_NAME["tiny"],
                                     {"fastattn": [np.zeros(1)] * 3}, None, why)
    assert check["ok"] is True and check["oracle"] == why
    rep = {"results": [{"name": "tiny", "dtype": "float32", "check": check}]}
    assert report.format_accuracy_table(rep).endswith("\n(no shape checked)\n" + "tiny: " + why)
    failed = backward.check_gradients(shapes.SHAPES_BY_NAME["tiny"],
                                      {"fastattn": [np.zeros(1)] * 3}, None, "error: boom")
    assert failed["ok"] is False


def test_bench_backward_alternates_batches_after_a_pause_and_a_wake_up_call(monkeypatch):
    # fastattn's and torch's backward batches alternate through the one harness, each after
    # a pause and one untimed call, as the shapes table's do.
    from types import SimpleNamespace
    from fastattn.cli.bench import backward
    events = _log_harness(monkeypatch)

    def logged(tag, make):
        def call_maker(shape, lib, inputs):
            call = make(shape, fastattn, inputs)
            return lambda: events.append(tag) or call()
        return call_maker

    real = backward.fastattn_backward_call
    monkeypatch.setattr(backward, "fastattn_backward_call", logged("fa", real))
    monkeypatch.setattr(backward, "torch_backward_call", logged("torch", real))
    result = backward.measure_backward_shape(
        shapes.SHAPES_BY_NAME["tiny"], fa=fastattn, ref_mod=fastattn.reference,
        torch=SimpleNamespace(Tensor=type(None)), repeat=2, quick=True)
    calls = {tag: result["libraries"][name]["calls_per_sample"]
             for tag, name in (("fa", "fastattn"), ("torch", "torch"))}
    samples = _timed_samples(events)
    assert [s[0] for s in samples] == ["fa", "torch", "torch", "fa"]    # the order rotates
    for s in samples:
        assert len(set(s)) == 1 and len(s) == calls[s[0]] + 1
    assert result["check"]["vs_torch_max_rel"] == 0.0 and result["check"]["ok"] is True


# --------------------------------------------------------------------------- contention

@pytest.mark.parametrize("train", [False, True])
def test_contention_torch_calls_compute_the_same_attention(train):
    torch = pytest.importorskip("torch")
    from fastattn.cli.bench import contention

    _, attend, attend_sdpa = contention.torch_step_calls(torch, train)
    with torch.inference_mode():
        ours, theirs = attend(), attend_sdpa()
    assert ours.shape == theirs.shape
    np.testing.assert_allclose(ours.numpy(), theirs.numpy(), atol=1e-5, rtol=1e-5)


def test_contention_torch_scenarios_report_fastattn_and_sdpa(monkeypatch):
    pytest.importorskip("torch")
    from fastattn.cli.bench import contention

    monkeypatch.setattr(contention, "settle", lambda: None)
    results = contention.run_scenarios(["torch", "torch-train"], threads=2, seconds=0.02)
    assert [r["name"] for r in results] == ["torch", "torch-train"]
    for r in results:
        assert r["ratio"] == pytest.approx(r["shared_s"] / r["fair_s"])
        assert r["fair_s"] == pytest.approx(sum(r["fair_parts_s"].values()))
        sdpa = r["sdpa"]
        assert sdpa["ratio"] == pytest.approx(sdpa["shared_s"] / sdpa["fair_s"])
        assert r["pool"] in ("own pool", "OpenMP team")
    lines = contention.format_scenarios(results).splitlines()
    assert [line.split()[0] for line in lines[2:]] == ["torch", "torch,", "torch-train",
                                                       "torch-train,"]
    assert "torch SDPA" in lines[3] and "torch SDPA" in lines[5]


def test_contention_without_torch_leaves_out_the_torch_scenarios(monkeypatch):
    from fastattn.cli.bench import contention

    monkeypatch.setattr(contention, "import_torch", lambda: None)
    assert contention.available_scenarios() == ("blas", "processes", "neighbour")


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
