"""The command line: ``python -m fastattn info`` and ``python -m fastattn bench``.

The CLI runs in a subprocess from the repository root, as a user would run it. Timings are
never asserted (they depend on the machine and its load); their structure, sign and
finiteness are, and so are the numbers that can be computed independently (FLOP and byte
counts, correctness differences against the reference).
"""
import importlib.util
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

import fastattn
from fastattn import bench

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HAVE_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None


def run_cli(*args, timeout=600):
    return subprocess.run([sys.executable, "-m", "fastattn", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


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
    proc = run_cli("bench", "--quick", "--shapes", "tiny,small", "--json", str(json_path),
                   "--plot", str(png_path))
    return proc, json_path, png_path


def test_bench_quick_exit_status_and_table(quick_run):
    proc, _, _ = quick_run
    # 3 = the plot could not be drawn because matplotlib is missing; nothing else may fail.
    assert proc.returncode == (0 if HAVE_MATPLOTLIB else 3), proc.stderr
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
    if HAVE_MATPLOTLIB:
        assert png_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    else:
        assert not png_path.exists()
        assert "matplotlib is not installed" in proc.stderr


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
    shape = bench.Shape("t", 2, 1, 4, 4, 8, causal=True)
    assert bench.visible_pairs(shape) == 10
    assert bench.flops(shape) == 4 * 8 * 2 * 10
    # Bottom-right alignment with Lq < Lk: 2 queries against 5 keys see 4 and 5 keys.
    assert bench.visible_pairs(bench.Shape("t", 1, 1, 2, 5, 8, causal=True)) == 9
    # Every SPEC shape with Lq == Lk causal counts L(L+1)/2 pairs per head.
    s = bench.SHAPES_BY_NAME["prefill-1k-causal"]
    assert bench.flops(s) == 4 * 64 * 12 * (1024 * 1025 // 2)


def test_spec_shapes():
    got = [(s.name, s.hq, s.hkv, s.lq, s.lk, s.d, s.causal, s.dtype) for s in bench.SHAPES]
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
    ]


def test_reference_slice_keeps_causal_alignment_and_gqa_mapping():
    # The slice the bench checks on big shapes must give the same rows as the full problem.
    from fastattn import reference
    shape = bench.Shape("t", 4, 2, 80, 96, 8, causal=True)
    q, k, v = bench.make_inputs(shape)
    full = reference.attention(q, k, v, causal=True)
    (qs, ks, vs), (heads, rows) = bench._reference_slice(shape, q, k, v)
    assert heads == [0, 3] and rows == 64
    part = reference.attention(qs, ks, vs, causal=True)
    # Same rows and keys; only BLAS blocking may differ, far below float32 resolution.
    np.testing.assert_allclose(part, full[:, heads, shape.lq - rows:], rtol=1e-6, atol=1e-7)


def test_format_time_units():
    sym = {"mu": "u", "x": "x", "delta": "d", "dash": "-"}
    assert bench.format_time(2.5e-6, sym) == "2.5 us"
    assert bench.format_time(0.0123, sym) == "12.30 ms"
    assert bench.format_time(12.0, sym) == "12.0 s"
