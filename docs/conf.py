"""Sphinx configuration of fastattn's documentation.

Build: ``python -m sphinx -W --keep-going -b html docs docs/_build/html`` from the
repository root, with fastattn importable (built in place or installed) and
``docs/requirements.txt`` installed.

Choices:

- Sphinx with autodoc and numpydoc, because the docstrings are written in the numpydoc
  style NumPy users read every day; MyST lets the narrative pages be Markdown like the
  README.
- The furo theme: light (a few small pure-Python packages), quick to build, readable on
  a phone, and it lays out long signatures such as ``attention(q, k, v, *, ...)`` well.
- The examples page is generated at build time by ``fastattn.cli.demo`` (its printed tables
  and heatmaps), so the page shows what the code computes today and cannot drift from it.
"""

import os
import sys
import warnings
from pathlib import Path

DOCS = Path(__file__).resolve().parent
# The repository root, so that an in-place build is importable without installing.
sys.path.insert(0, str(DOCS.parent))

import fastattn  # noqa: E402
from fastattn.cli import demo  # noqa: E402

project = "fastattn"
author = "fastattn contributors"
copyright = "fastattn contributors"
release = fastattn.__version__
version = release.split("+")[0]

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.mathjax",
    "sphinx.ext.viewcode",
    "numpydoc",
]
source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
exclude_patterns = ["_build", "_generated", "requirements.txt"]
myst_enable_extensions = ["dollarmath"]
myst_heading_anchors = 3

autodoc_member_order = "bysource"
autodoc_typehints = "none"          # the signatures and the numpydoc sections say it
numpydoc_show_class_members = False
numpydoc_class_members_toctree = False
# numpydoc reports a section it does not know through Python's warnings and then drops
# the section's text; with -W that must fail the build like any other warning.
warnings.filterwarnings("error", message="Unknown section", category=UserWarning)

html_theme = "furo"
html_title = f"fastattn {version}"
html_static_path = []
pygments_style = "sphinx"


def _generate_examples(app):
    """Write the demo's tables (``_generated/exampleN.txt``) and heatmaps (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    out = Path(app.srcdir) / "_generated"
    out.mkdir(exist_ok=True)
    figures = []
    for n, (text, figs) in enumerate(demo.examples(), 1):
        (out / f"example{n}.txt").write_text(text.strip("\n") + "\n", encoding="utf-8")
        figures += figs
    demo.save_heatmaps(figures, os.fspath(out))


def setup(app):
    app.connect("builder-inited", _generate_examples)
