"""pytest-benchmark suite settings.

Run everything:        python -m pytest benchmarks/
Small shapes only:     python -m pytest benchmarks/ --bench-quick
                       (or FASTATTN_BENCH_QUICK=1, or -m "not big")
Compare saved runs:    python -m pytest benchmarks/ --benchmark-autosave, then
                       pytest-benchmark compare

The CI command is ``pytest tests/``, which never collects this folder.
"""
import os

import pytest


def pytest_addoption(parser):
    parser.addoption("--bench-quick", action="store_true", default=False,
                     help="fastattn benchmarks: skip the shapes marked 'big'")


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "big: a benchmark shape that takes seconds (skipped by --bench-quick)")


def _quick(config):
    env = os.environ.get("FASTATTN_BENCH_QUICK", "")
    return config.getoption("--bench-quick") or env not in ("", "0")


def pytest_collection_modifyitems(config, items):
    if not _quick(config):
        return
    skip = pytest.mark.skip(reason="big shape skipped by --bench-quick / FASTATTN_BENCH_QUICK")
    for item in items:
        if "big" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def threads():
    """One thread count for fastattn, BLAS and torch: fastattn's default (honours
    OMP_NUM_THREADS), held as the bench holds it."""
    import fastattn
    from fastattn.cli.bench.harness import hold_threads, import_torch

    n = fastattn.get_num_threads()
    with hold_threads(n, fastattn, import_torch()):
        yield n


@pytest.fixture(autouse=True)
def _pause():
    # Setup, outside the timed region: the bench's pause, until the previous test's idle
    # OpenMP/OpenBLAS workers stop spinning (see fastattn/cli/bench/harness.py).
    from fastattn.cli.bench.harness import settle
    settle()
    yield
