"""The examples in the public docstrings run and print what they show."""
import doctest

import numpy as np

import fastattn
from fastattn import _api


def test_attention_docstring_example():
    finder = doctest.DocTestFinder()
    runner = doctest.DocTestRunner(optionflags=doctest.NORMALIZE_WHITESPACE)
    tests = finder.find(_api.attention, "attention", globs={"np": np, "fastattn": fastattn})
    assert tests and tests[0].examples
    for t in tests:
        runner.run(t)
    assert runner.failures == 0
