"""``python -m fastattn bench --contention``: the torch scenarios and the calls they time."""
import numpy as np
import pytest


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
