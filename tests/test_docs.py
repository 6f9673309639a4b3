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
    # The first example claims the context vector an independent torch implementation
    # printed for "cat".
    np.testing.assert_allclose(ns["ctx"].shape, (3, 3))  # re-bound by the layers example
    assert "0.4418" in capsys.readouterr().out


def test_readme_starts_with_the_two_set_up_commands():
    lines = [line for line in README.read_text().splitlines() if line.strip()]
    assert lines[0] == "# fastattn"
    # A virtual environment's python: Debian has python3 on PATH and no python.
    assert lines[1].strip() == ("python3 -m venv .venv && .venv/bin/python -m pip install -e . "
                                "&& .venv/bin/python -m fastattn bench")
    assert lines[2].strip() == ('.venv/bin/python -m pip install -e ".[test]" && '
                                '.venv/bin/python -m pytest')
    # CI runs the test command verbatim, in the venv it makes.
    ci_run = README.parent / ".ci" / "run"
    if ci_run.is_file():
        assert lines[2].strip() in ci_run.read_text()


def test_readme_offers_the_extra_that_installs_what_the_tests_skip_without():
    tomllib = pytest.importorskip("tomllib")   # Python 3.11+
    extras = tomllib.loads((README.parent / "pyproject.toml").read_text())[
        "project"]["optional-dependencies"]
    names = {re.split(r"[<>=\[]", r)[0] for r in extras["full"]}
    assert {"fastattn", "torch", "ml_dtypes", "threadpoolctl", "dask", "matplotlib",
            "numpydoc"} <= names
    assert "fastattn[test]" in extras["full"]
    assert '".[full]"' in README.read_text()


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


def test_ci_scripts_name_only_test_files_that_exist():
    # CI stages and tools/*.sh run some test files by name (or glob): a renamed or merged
    # file must not drop out of them unnoticed.
    root = README.parent
    if not (root / ".ci" / "run").is_file():
        pytest.skip("no .ci/run here: an unpacked sdist carries no CI script")
    scripts = [root / ".ci" / "run", *sorted((root / "tools").glob("*.sh"))]
    named = {m for p in scripts for m in re.findall(r"tests/test_[\w*]+\.py", p.read_text())}
    assert "tests/test_arguments.py" in named
    missing = sorted(n for n in named if not list(root.glob(n)))
    assert not missing, f"CI names test files that do not exist: {missing}"


def test_readme_is_the_front_door_only():
    # Details live in docs/; the README stays short enough to read at once.
    assert len(README.read_text().splitlines()) <= 170


def test_readme_says_the_in_place_build_needs_cython():
    text = " ".join(README.read_text().split())
    sentence = text.split("build_ext --inplace", 1)[1].split(".")[0]
    assert "Cython" in sentence


def test_readme_says_what_cached_decoding_keeps_bitwise():
    # The attention step is bitwise; the projections around it only agree to rounding.
    text = " ".join(README.read_text().split())
    paragraph = text.split("KVCache` a call returns", 1)[1].split("```")[0]
    assert "attention step gives bitwise" in paragraph and "to rounding" in paragraph


def test_api_reference_lists_every_public_function_and_class():
    import fastattn
    api = (README.parent / "docs" / "api.rst").read_text()
    documented = set(re.findall(r"^\.\. auto(?:function|class):: (\w+)", api, re.M))
    public = {name for name in fastattn.__all__ if callable(getattr(fastattn, name))}
    assert public <= documented, sorted(public - documented)


def test_docs_say_what_the_thread_pool_is():
    # The kernels run on fastattn's own pool of POSIX threads, as `info` says; OpenMP
    # gives the default thread count and runs only the calls FASTATTN_POOL sends to it.
    for page in (README, *sorted((README.parent / "docs").glob("*.md"))):
        text = " ".join(page.read_text().split())
        assert "on OpenMP threads" not in text, page.name
        assert "Threads and OpenMP" not in text, page.name
