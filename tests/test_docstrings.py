"""The examples in fastattn's docstrings run and print what they show.

Every module of the package is walked (a new module's examples are collected without
listing it here), and each docstring with examples is one test.  Examples may use ``np``
and ``fastattn`` without importing them, as NumPy's do; a module's own names are in scope
too.  An example that imports an optional package (torch, ...) is skipped without it,
or fails under FASTATTN_REQUIRE_INTEGRATIONS=1 (see ``conftest.import_optional``).
Compiled modules carry no examples, and ``fastattn.__main__`` is the command line itself.
"""
import doctest
import importlib
import importlib.util
import io
import pkgutil
import re

import numpy as np
import pytest

import fastattn

from conftest import import_optional

_IMPORT = re.compile(r"^\s*(?:import|from)\s+([A-Za-z_]\w*)", re.MULTILINE)


def _module_names():
    """fastattn and its Python submodules, walked from the package itself."""
    names = ["fastattn"]
    for info in pkgutil.walk_packages(fastattn.__path__, "fastattn."):
        spec = importlib.util.find_spec(info.name)
        if info.name.endswith(".__main__") or not (spec.origin or "").endswith(".py"):
            continue
        names.append(info.name)
    return names


def _docstring_examples():
    """The docstrings with examples, and the modules that need a package not installed."""
    finder = doctest.DocTestFinder(exclude_empty=True)
    cases, unimportable = [], []
    for name in _module_names():
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as e:     # a module of an optional dependency's
            if (e.name or "fastattn").partition(".")[0] == "fastattn":
                raise
            unimportable.append(pytest.param(name, e.name, id=name))
            continue
        for test in finder.find(module, name, extraglobs={"np": np, "fastattn": fastattn}):
            if test.examples:
                cases.append(pytest.param(test, id=test.name))
    return cases, unimportable


EXAMPLES, UNIMPORTABLE = _docstring_examples()


def _needs(test):
    """The packages other than numpy and fastattn that the examples import (and run)."""
    wanted = set()
    for example in test.examples:
        if not example.options.get(doctest.SKIP):
            wanted.update(_IMPORT.findall(example.source))
    return sorted(wanted - {"numpy", "fastattn"})


def test_examples_are_collected():
    # The public API's examples at least: a walk that found nothing would pass vacuously.
    found = {p.values[0].name for p in EXAMPLES}
    for name in ("fastattn._calls.api.attention", "fastattn._calls.api.attention_varlen",
                 "fastattn._machine.threads.num_threads", "fastattn.layers.MultiHeadAttention",
                 "fastattn.layers.self_attention", "fastattn._layers.cache.KVCache",
                 "fastattn.positions.sinusoidal_positions"):
        assert name in found, sorted(found)


# Importing a transformers model registers torch operators, whose source lookup walks
# sys.modules; when an earlier test has imported TabPFN, that touches TabPFN's deprecated
# alias module, which warns.
@pytest.mark.filterwarnings("ignore:Importing from 'tabpfn.model.loading':DeprecationWarning")
@pytest.mark.parametrize("test", EXAMPLES)
def test_docstring_example(test, pytestconfig):
    for package in _needs(test):
        import_optional(package)
    flags = 0
    for name in pytestconfig.getini("doctest_optionflags"):   # pyproject.toml's
        flags |= doctest.OPTIONFLAGS_BY_NAME[name]
    report = io.StringIO()
    runner = doctest.DocTestRunner(optionflags=flags)
    runner.run(test, out=report.write, clear_globs=False)
    assert runner.failures == 0, report.getvalue()
    if runner.tries == 0:
        pytest.skip("every example is marked +SKIP (they need a trained model to download)")


@pytest.mark.parametrize("module, package", UNIMPORTABLE or [
    pytest.param(None, None, marks=pytest.mark.skip(reason="every module imports"))])
def test_modules_without_their_optional_package(module, package):
    # Their examples cannot be collected here: skipped (or failed under
    # FASTATTN_REQUIRE_INTEGRATIONS=1) by asking for the package that is missing.
    import_optional(package)
    pytest.fail(f"{module} did not import, but {package} does")


def test_docstring_parameters_are_parameters():
    # numpydoc reads a loose paragraph inside Parameters as one more parameter, which the
    # API page then shows in bold with literal backticks.
    import inspect

    import fastattn

    docscrape = pytest.importorskip("numpydoc.docscrape")
    for f in (fastattn.attention, fastattn.attention_varlen, fastattn.attention_weights,
              fastattn.self_attention):
        names = set(inspect.signature(f).parameters)
        for p in docscrape.FunctionDoc(f)["Parameters"]:
            assert {n.strip() for n in p.name.split(",")} <= names, (f.__name__, p.name)
            assert ":func:" not in p.type, (f.__name__, p.type)
