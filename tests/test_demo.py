"""Tests of ``python -m fastattn demo`` (fastattn.cli.demo) and its table formatting."""

import sys

import numpy as np
import pytest

from fastattn.cli import common, demo
from fastattn.cli.main import main

from conftest import ROOT, run_python


def test_demo_prints_its_sentences_and_weights(capsys):
    assert main(["demo"]) == 0
    out = capsys.readouterr().out
    for text in ['"A cat sat on the mat"', '"I love you today"',
                 "each session has a chair", "each person has a chair"]:
        assert text in out
    # Example 1: the weights of "cat" over "A cat sat on the mat", raw embeddings, no
    # learned weights (softmax of the scaled dot products, 0.1385 0.2379 0.2333 0.1240
    # 0.1082 0.1581 to four places).
    assert "cat   0.139   0.238   0.233   0.124   0.108   0.158" in out
    # Example 1: the context vector of "cat", those weights times the embeddings.
    assert "0.4419   0.6515   0.5683" in out
    # Example 3: "chair" contextualised in "each session has a chair" and in "each person
    # has a chair" (the two vectors hold the same values in reverse order).
    assert "3.4882   3.3862   3.1256" in out and "3.1256   3.3862   3.4882" in out
    # Masked (causal) keys print as '.', and all 5 heads of the multi-head example appear.
    assert "each    1.000        .        .        .        ." in out
    assert all(f"head {h}:" in out for h in range(5))


def test_demo_weight_tables_are_probabilities(capsys):
    main(["demo"])
    rows = [line.split()[1:] for line in capsys.readouterr().out.splitlines()
            if line.strip().startswith(("cat ", "love ", "chair "))]
    numeric = [[float(c) for c in r if c != "."] for r in rows if r and r[0][0] in "0123456789."]
    assert len(numeric) == 9           # cat, love (5 heads), chair (2 sentences + learned)
    assert all(abs(sum(r) - 1) < 6e-3 for r in numeric)


def test_demo_has_help_and_usage_errors(capsys):
    assert main(["demo"]) == 0
    assert "A cat sat" in capsys.readouterr().out
    assert main(["demo", "--help"]) == 0
    text = capsys.readouterr().out
    assert "--plot" in text
    # It describes what the demo shows, not where its examples came from.
    assert "notebook" not in text.lower() and "seed" not in text.lower()
    assert main(["demo", "--bogus"]) == 2


def test_demo_plot_without_matplotlib(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)   # makes `import matplotlib` fail
    assert main(["demo", "--plot", str(tmp_path / "plots")]) == common.ENVIRONMENT
    captured = capsys.readouterr()
    assert "pip install matplotlib" in captured.err
    assert captured.out == ""                               # fails before printing tables
    assert not (tmp_path / "plots").exists()


def test_demo_plot_writes_heatmaps(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    assert main(["demo", "--plot", str(tmp_path)]) == 0
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["01_cat_sat_on_the_mat.png", "02_i_love_you_today.png",
                     "03_each_person_has_a_chair.png", "03_each_session_has_a_chair.png",
                     "03b_learned_projections.png"]
    assert all((tmp_path / f).read_bytes()[:4] == b"\x89PNG" for f in files)
    assert "saved 5 heatmaps" in capsys.readouterr().out


def test_format_weights_labels_and_hidden_cells():
    text = demo.format_weights(np.array([[1.0, 0.0], [0.25, 0.75]]), ["a", "bb"],
                             hidden=np.array([[False, True], [False, False]]), decimals=2)
    lines = text.splitlines()
    assert lines[0].split() == ["query", "\\", "key", "a", "bb"]
    assert lines[1].split() == ["a", "1.00", "."]
    assert lines[2].split() == ["bb", "0.25", "0.75"]
    with pytest.raises(ValueError, match="weights"):
        demo.format_weights(np.ones((2, 3)), ["a", "b"])


def test_python_m_fastattn_demo_runs():
    proc = run_python("-m", "fastattn", "demo", cwd=ROOT, timeout=120)   # asserts exit 0
    assert "each person has a chair" in proc.stdout


def _section(out, start, end=None):
    text = out.split(start, 1)[1]
    return text.split(end, 1)[0] if end else text


def _table(text, tokens):
    """The printed weight table under ``text``: {query: [weights, None for '.']}."""
    rows = {}
    for line in text.splitlines():
        cells = line.split()
        if len(cells) == len(tokens) + 1 and cells[0] in tokens and cells[0] not in rows:
            try:
                rows[cells[0]] = [None if c == "." else float(c) for c in cells[1:]]
            except ValueError:
                continue
    return rows


def test_demo_3b_text_agrees_with_its_table(capsys):
    main(["demo"])
    section = _section(capsys.readouterr().out, "== 3b.")
    tokens = ["each", "session", "has", "a", "chair"]
    table = _table(section, tokens)
    assert list(table) == tokens
    prose = " ".join(section.split("query \\ key")[0].split())
    for query, row in table.items():
        weights = [w if w is not None else -1 for w in row]
        top = int(np.argmax(weights))
        if tokens[top] == query:
            assert f"'{query}'" in prose.split("attend almost only to themselves")[0]
        else:
            assert f"'{query}' puts {row[top]:.3f} of its weight on '{tokens[top]}'" in prose
    # What the table shows: 'session' looks at 'each', not at itself.
    assert "'session' puts 1.000 of its weight on 'each'" in prose
    assert "each word attends almost only to itself" not in prose


def test_describe_peaks():
    w = np.array([[1.0, 0.0, 0.0], [0.3, 0.7, 0.0], [0.1, 0.6, 0.3]])
    assert demo.describe_peaks(w, ["a", "b", "c"]) == (
        "The largest weight of each row: 'a' and 'b' attend most to themselves; "
        "'c' puts 0.600 of its weight on 'b'.")
    assert demo.describe_peaks(np.eye(2), ["x", "y"]) == (
        "Every row is nearly one-hot (largest weight >= 0.99): 'x' and 'y' attend almost "
        "only to themselves.")


def test_demo_text_and_titles_have_no_notebook_jargon(capsys):
    main(["demo"])
    out = capsys.readouterr().out
    titles = [title for _, figures in demo.examples() for _, title, _ in figures]
    assert len(titles) == 5
    for text in [out] + titles:
        assert "seed 0" not in text.lower() and "notebook" not in text.lower()


def test_examples_are_what_the_demo_prints(capsys):
    main(["demo"])
    out = capsys.readouterr().out
    assert out == "".join(text + "\n" for text, _ in demo.examples())
