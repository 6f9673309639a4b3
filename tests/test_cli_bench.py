"""``python -m fastattn bench`` and ``bench --backward``: runs, JSON, harness, shapes, checks."""
# Timings are never asserted (they depend on the machine and its load); their structure, sign
# and finiteness are, and so are the numbers that can be computed independently (FLOP and
# byte counts, correctness differences against the reference).
import importlib.util
import json
import math

import numpy as np
import pytest

import fastattn
from fastattn.cli import common
from fastattn.cli.bench import harness, measure, report, shapes
from fastattn.cli.main import main

from conftest import run_cli

HAVE_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None


def positive_finite(x):
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


# ------------------------------------------------------------- bench --quick

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


# -------------------------------------------------------- the timing harness

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


# --------------------------------------------------------- shapes and checks

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
        ("decode-4k-q4_0", 32, 32, 1, 4096, 128, False, "q4_0"),
        ("decode-gqa-8k-q4_0", 32, 8, 1, 8192, 128, False, "q4_0"),
        ("decode-4k-fp8", 32, 32, 1, 4096, 128, False, "fp8"),
        ("decode-gqa-8k-fp8", 32, 8, 1, 8192, 128, False, "fp8"),
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


# ---------------------------------------------------------- bench --backward

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


def test_bench_isa_runs_both_sides_on_one_instruction_set(tmp_path):
    # a variant every x86-64 CPU runs (and the portable one elsewhere)
    from fastattn._machine.isa import available_variants
    isa = "avx2" if "avx2" in available_variants() else "base"
    json_path = tmp_path / "isa.json"
    proc = run_cli("bench", "--quick", "--repeat", "1", "--shapes", "tiny", "--isa", isa,
                   "--json", str(json_path))
    assert proc.returncode == 0, proc.stderr
    first = proc.stdout.splitlines()[0]
    assert first.startswith(f"--isa {isa}: FASTATTN_ISA={isa} ATEN_CPU_CAPABILITY=")
    assert "ONEDNN_MAX_CPU_ISA=" in first
    machine = json.loads(json_path.read_text())["machine"]
    assert machine["isa"] == isa
    assert machine["env"]["FASTATTN_ISA"] == isa
    assert machine["env"]["MKL_ENABLE_INSTRUCTIONS"] == \
        fastattn.cli.bench.machine.TORCH_ISA[isa]["MKL_ENABLE_INSTRUCTIONS"]


def test_variants_torch_softcap_is_the_same_function():
    # The softcap row's torch call must compute what fastattn's softcap does: checked
    # against the float64 reference on a small case.
    torch = pytest.importorskip("torch")
    from fastattn import reference
    from fastattn.cli.bench import variants
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 2, 17, 8)).astype(np.float32) * 4 for _ in range(3))
    got = variants._softcap_torch_call(torch, q, k, v, 5.0)().numpy()
    want = reference.attention(q.astype(np.float64), k.astype(np.float64),
                               v.astype(np.float64), softcap=5.0)
    np.testing.assert_allclose(got, want, atol=2e-5)
