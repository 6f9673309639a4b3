"""The README's Python examples run as written (docs that drift are bugs)."""
import pathlib
import re

import numpy as np
import pytest

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"


def test_readme_examples_run(capsys):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    assert len(blocks) >= 4
    ns = {}
    for block in blocks:
        exec(compile(block, str(README), "exec"), ns)
    # The first example claims the seed's printed context vector for "cat".
    np.testing.assert_allclose(ns["ctx"].shape, (3, 3))  # re-bound by the layers example
    assert "0.4418" in capsys.readouterr().out


def test_readme_starts_with_the_two_set_up_commands():
    lines = [line for line in README.read_text().splitlines() if line.strip()]
    assert lines[0] == "# fastattn"
    assert lines[1].strip() == "python -m pip install -e . && python -m fastattn bench"
    assert lines[2].strip() == 'python -m pip install -e ".[test]" && python -m pytest'


def test_readme_links_point_to_files_in_the_repository():
    text = README.read_text()
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text)
    local = [link for link in links if "://" not in link]
    assert "docs/performance.md" in local and "docs/how-it-works.md" in local
    for link in local:
        assert (README.parent / link).is_file(), link
    # In-page anchors name a heading that exists.
    headings = {h.strip().lower().replace(" ", "-")
                for h in re.findall(r"^#+ (.*)$", text, re.M)}
    for anchor in re.findall(r"\]\(#([^)]+)\)", text):
        assert anchor in headings, anchor


def test_docs_build_commands_in_readme_match_ci():
    # The README tells users how to build the documentation; CI runs the same command.
    ci_run = README.parent / ".ci" / "run"
    if not ci_run.is_file():
        pytest.skip("no .ci/run here: an unpacked sdist carries no CI script")
    ci = ci_run.read_text()
    command = "python -m sphinx -W --keep-going -b html docs docs/_build/html"
    assert command in README.read_text() and command in ci
    assert "python -m pip install -r docs/requirements.txt" in ci
