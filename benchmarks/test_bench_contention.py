"""fastattn on shared cores: the three situations of ``python -m fastattn bench --contention``
(see fastattn/cli/bench/contention.py), one benchmark group each.

Each test times the shared situation with pytest-benchmark and records in ``extra_info``
the fair share (the same work with the machine to itself, or on one thread beside the same
neighbour) and the ratio mean / fair share, which fastattn keeps at 1.5 or less.
"""
import numpy as np
import pytest

import fastattn
from fastattn.cli.bench.contention import Neighbour, decoder_step_calls, small_inputs
from fastattn.cli.bench.harness import mean_call_seconds

FAIR_WINDOW_S = 1.0


def _record(benchmark, fair, **info):
    benchmark.extra_info.update(fair_share_s=fair, **info)
    mean = benchmark.stats.stats.mean
    benchmark.extra_info["ratio"] = mean / fair


@pytest.mark.benchmark(group="contention-blas")
def test_alternating_with_blas(benchmark, threads):
    product, attend, pair = decoder_step_calls(fastattn)
    with fastattn.num_threads(threads):
        fair = mean_call_seconds(product, FAIR_WINDOW_S / 2)
        fair += mean_call_seconds(attend, FAIR_WINDOW_S / 2)
        benchmark(pair)
    _record(benchmark, fair, what="x @ W then a GQA decode step, alternating")


@pytest.mark.benchmark(group="contention-processes")
def test_two_processes(benchmark, threads):
    q, k, v = small_inputs()
    out = np.empty_like(q)

    def attend():
        fastattn.attention(q, k, v, out=out)

    with fastattn.num_threads(threads):
        fair = 2 * mean_call_seconds(attend, FAIR_WINDOW_S)
        with Neighbour(threads, role="small-forever"):
            benchmark(attend)
    _record(benchmark, fair, what="small, with a second process running small")


@pytest.mark.benchmark(group="contention-neighbour")
def test_beside_sgemm(benchmark, threads):
    q, k, v = small_inputs()
    out = np.empty_like(q)

    def attend():
        fastattn.attention(q, k, v, out=out)

    with Neighbour(threads, role="sgemm"):
        with fastattn.num_threads(1):
            fair = mean_call_seconds(attend, FAIR_WINDOW_S)
        with fastattn.num_threads(threads):
            benchmark(attend)
    _record(benchmark, fair, what="small beside a process running NumPy sgemm")
