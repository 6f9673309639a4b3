"""The README's Python examples run as written (docs that drift are bugs)."""
import pathlib
import re

import numpy as np

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
