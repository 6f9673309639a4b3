"""The README and docs/*.md: their Python blocks run as written, and what they state holds.

The rules of a page's Python blocks (``run_page`` applies them; run as a script, this file
runs the page given):

- Each page runs in one fresh interpreter, in a scratch folder, its blocks in order, each
  as ``__main__``.
- A block starts from an empty namespace, as it does for a user who copies it alone.  A
  block that uses what an earlier block of its page defined says so on its first line,
  ``# continues the block above (the names it uses)``, and runs in that block's namespace.
- A block that needs a download (a model from a hub) says so on its first line,
  ``# needs a download: what``, and is skipped, with the blocks that continue it.
- A block that imports an optional package (torch, transformers, dask, tabpfn, or
  fastattn's integration of one) is skipped where that package is missing, with the blocks
  that continue it; under FASTATTN_REQUIRE_INTEGRATIONS=1 (CI's integrations stage) it runs.
"""
import ast
import importlib.util
import json
import os
import pathlib
import re
import sys

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
CONTINUES = "# continues"
DOWNLOAD = "# needs a download"
# fastattn's integration modules, by the package each needs.
INTEGRATIONS = {"torch": "torch", "transformers": "transformers", "tabpfn": "tabpfn",
                "dask": "dask"}
REPORT = "docs-runner report: "


def python_blocks(text):
    """(first line, code) of each ```python block of a Markdown text, lines from 1."""
    return [(text.count("\n", 0, m.start(1)) + 1, m.group(1)) for m in BLOCK.finditer(text)]


def optional_packages(code):
    """The packages other than NumPy and fastattn that a block imports."""
    modules = []
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Import):
            modules += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            modules += [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
    needed = set()
    for parts in (m.split(".") for m in modules):
        if parts[:2] == ["fastattn", "integrations"] and len(parts) > 2:
            needed.add(INTEGRATIONS.get(parts[2].lstrip("_")))
        elif parts[0] not in ("fastattn", "numpy"):
            needed.add(parts[0])
    return sorted(needed - {None})


def why_skipped(first_line, code):
    """Why a block that starts a namespace is not run here, or None."""
    if first_line.startswith(DOWNLOAD):
        return "needs a download"
    if os.environ.get("FASTATTN_REQUIRE_INTEGRATIONS") == "1":
        return None
    missing = [p for p in optional_packages(code) if importlib.util.find_spec(p) is None]
    return f"needs {', '.join(missing)}" if missing else None


def run_page(page):
    """Run a page's Python blocks by the rules above; print and return what each did:
    ``{"line", "skipped"}`` or ``{"line", "arrays"}`` (the shapes of the namespace's
    arrays after the block)."""
    page = pathlib.Path(page)
    report, namespace, skipped = [], None, None
    for line, code in python_blocks(page.read_text(encoding="utf-8")):
        first = code.split("\n", 1)[0]
        if first.startswith(CONTINUES):
            if namespace is None and skipped is None:
                raise ValueError(f"{page.name}:{line} continues no earlier block")
            # skipped with the block it continues, or for a package of its own
            why = skipped or why_skipped(first, code)
        else:
            namespace = {"__name__": "__main__"}
            why = why_skipped(first, code)
        skipped = why
        if why:
            report.append({"line": line, "skipped": why})
            continue
        # Padded with blank lines so that a traceback gives the line in the page.
        exec(compile("\n" * (line - 1) + code, str(page), "exec"), namespace)
        report.append({"line": line, "arrays": {
            k: list(v.shape) for k, v in namespace.items() if isinstance(v, np.ndarray)}})
    print(REPORT + json.dumps(report), flush=True)
    return report


_runs = {}


def page_run(page):
    """(stdout, report) of ``run_page(page)`` in a fresh interpreter, run once per session."""
    if page not in _runs:
        import tempfile
        from conftest import run_python
        with tempfile.TemporaryDirectory() as scratch:     # what a block writes goes there
            proc = run_python(__file__, page, cwd=scratch, timeout=300)
        out, _, report = proc.stdout.rpartition(REPORT)
        _runs[page] = out, json.loads(report)
    return _runs[page]


@pytest.mark.parametrize("page", [p for p in PAGES if python_blocks(p.read_text())],
                         ids=lambda p: p.name)
def test_python_blocks_run_as_written(page):
    _, report = page_run(page)
    skipped = [b for b in report if "skipped" in b]
    if os.environ.get("FASTATTN_REQUIRE_INTEGRATIONS") == "1":
        assert all(b["skipped"] == "needs a download" for b in skipped), skipped
    if len(skipped) == len(report):
        pytest.skip("; ".join(f"line {b['line']}: {b['skipped']}" for b in skipped))


def test_the_runner_holds_blocks_to_the_rules(tmp_path, capsys):
    page = tmp_path / "page.md"
    def write(*blocks):
        page.write_text("".join(f"Text.\n\n```python\n{b}\n```\n\n" for b in blocks))
    write("x = 1", "y = x + 1")
    with pytest.raises(NameError, match="'x'"):
        run_page(page)                    # the second block does not say it continues
    write("x = 1", "# continues the block above (x)\nassert x == 1")
    assert [sorted(b) for b in run_page(page)] == [["arrays", "line"]] * 2
    write("# needs a download: a model\nraise SystemExit(1)",
          "# continues the block above\nraise SystemExit(1)", "import numpy as np")
    report = run_page(page)
    assert [b.get("skipped") for b in report] == ["needs a download"] * 2 + [None]
    assert report[0]["line"] == 4 and report[2]["line"] == 18
    write("import not_a_package_anywhere", "# continues the block above\nraise SystemExit(1)")
    if os.environ.get("FASTATTN_REQUIRE_INTEGRATIONS") != "1":
        assert [b["skipped"] for b in run_page(page)] == ["needs not_a_package_anywhere"] * 2
    assert optional_packages("from fastattn.integrations import dask as d\nimport torch.nn") \
        == ["dask", "torch"]


def test_only_python_fences_hold_python():
    # A block fenced as ```py or ```python3 would escape the runner.
    for page in PAGES:
        fences = re.findall(r"^```(\S+)", page.read_text(), re.M)
        assert not [f for f in fences if f != "python" and f.lower().startswith("py")], page.name


def test_readme_examples_run():
    out, blocks = page_run(README)
    assert len(blocks) >= 4
    # The first example claims the context vector an independent torch implementation
    # printed for "cat".
    np.testing.assert_allclose(blocks[2]["arrays"]["ctx"], (3, 3))  # the layers example's
    assert "0.4418" in out


def test_readme_states_no_count_that_goes_stale():
    text = " ".join(README.read_text().split())
    # Test and skip counts change with every test added.
    assert not re.search(r"\d[\d,]* (of (about )?[\d,]+ )?tests", text)
    # The torch version the README names is the one the full extra pins.
    pins = re.findall(r'"torch==([\d.]+)"', (ROOT / "pyproject.toml").read_text())
    named = re.search(r"extra installs them \(torch ([\d.]+)", text).group(1)
    assert pins == [named]


def test_readme_starts_with_the_two_set_up_commands():
    lines = [line for line in README.read_text().splitlines() if line.strip()]
    assert lines[0] == "# fastattn"
    # A virtual environment's python: Debian has python3 on PATH and no python.  The first
    # command installs what the tests need, so the second compiles nothing.
    assert lines[1].strip() == ('python3 -m venv .venv && .venv/bin/python -m pip install -e '
                                '".[test]" && .venv/bin/python -m fastattn bench --quick')
    assert lines[2].strip() == ".venv/bin/python -m pytest"
    # CI runs the set-up without its benchmark (the CLI tests run that), then the test
    # command verbatim, on a line of its own.
    ci_run = ROOT / ".ci" / "run"
    if ci_run.is_file():
        ci = ci_run.read_text().splitlines()
        assert lines[1].strip().removesuffix(" && .venv/bin/python -m fastattn bench --quick") in ci
        assert lines[2].strip() in ci


def test_readme_offers_the_extra_that_installs_what_the_tests_skip_without():
    tomllib = pytest.importorskip("tomllib")   # Python 3.11+
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())[
        "project"]["optional-dependencies"]
    names = {re.split(r"[<>=\[]", r)[0] for r in extras["full"]}
    assert {"fastattn", "torch", "ml_dtypes", "threadpoolctl", "dask", "matplotlib",
            "numpydoc", "gguf", "tabpfn"} <= names
    assert {"fastattn[test]", "fastattn[transformers]"} <= set(extras["full"])
    # By name, not as ".[full]": pip takes the installed build's metadata and installs the
    # extra's packages without building fastattn again.
    assert '.venv/bin/python -m pip install "fastattn[full]"' in README.read_text()


def test_the_transformers_range_is_stated_where_users_read_before_installing():
    # pyproject.toml's transformers extra is the one statement of the range; the README
    # and the integrations page name the same one.
    tomllib = pytest.importorskip("tomllib")
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())[
        "project"]["optional-dependencies"]
    (requirement,) = extras["transformers"]
    stated = requirement.removeprefix("transformers")
    assert re.fullmatch(r">=[\d.]+,<[\d.]+", stated), requirement
    for page in (README, ROOT / "docs" / "integrations.md"):
        text = " ".join(page.read_text().split())
        assert f"transformers {stated}" in text, page.name
        assert not set(re.findall(r"transformers (>=[\d.]+,<[\d.]+)", text)) - {stated}, page.name


def test_readme_links_point_to_files_in_the_repository():
    text = README.read_text()
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text)
    local = [link for link in links if "://" not in link]
    assert "docs/performance.md" in local and "docs/how-it-works.md" in local
    for link in local:
        assert (ROOT / link).is_file(), link
    # In-page anchors name a heading that exists.
    headings = {h.strip().lower().replace(" ", "-")
                for h in re.findall(r"^#+ (.*)$", text, re.M)}
    for anchor in re.findall(r"\]\(#([^)]+)\)", text):
        assert anchor in headings, anchor


def test_docs_build_commands_in_readme_match_ci():
    # The README tells users how to build the documentation; CI runs the same command.
    ci_run = ROOT / ".ci" / "run"
    if not ci_run.is_file():
        pytest.skip("no .ci/run here: an unpacked sdist carries no CI script")
    ci = ci_run.read_text()
    command = "python -m sphinx -W --keep-going -b html docs docs/_build/html"
    assert command in README.read_text() and command in ci
    assert "python -m pip install -r docs/requirements.txt" in ci


def test_ci_scripts_name_only_test_files_that_exist():
    # CI stages and tools/*.sh run some test files by name (or glob): a renamed or merged
    # file must not drop out of them unnoticed.
    root = ROOT
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
    api = (ROOT / "docs" / "api.rst").read_text()
    documented = set(re.findall(r"^\.\. auto(?:function|class):: (\w+)", api, re.M))
    public = {name for name in fastattn.__all__ if callable(getattr(fastattn, name))}
    assert public <= documented, sorted(public - documented)


def test_docs_say_what_the_thread_pool_is():
    # The kernels run on fastattn's own pool of POSIX threads, as `info` says; OpenMP
    # gives the default thread count and runs only the calls FASTATTN_POOL sends to it.
    for page in (README, *sorted((ROOT / "docs").glob("*.md"))):
        text = " ".join(page.read_text().split())
        assert "on OpenMP threads" not in text, page.name
        assert "Threads and OpenMP" not in text, page.name


if __name__ == "__main__":
    run_page(sys.argv[1])
