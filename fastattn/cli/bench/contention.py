"""``python -m fastattn bench --contention``: does fastattn keep its speed on shared cores?

fastattn's calls rarely have the machine to themselves. This runs three situations that
real programs create and compares each with what the call would cost if it had its fair
share of the machine:

``blas``
    One process alternates a NumPy matrix product ``x(1,1024) @ W(1024,2816)`` (OpenBLAS)
    with a decode step ``attention(q(1,16,1,64), k/v(1,4,520,64))``, as a decoder written
    with NumPy projections does. Fair: the time of the product alone plus the time of the
    attention call alone.
``processes``
    Two processes each run ``small`` (8 heads, 128 x 128, D 64) at once, as Dask or
    multiprocessing workers do. Fair: twice the time of one process alone.
``neighbour``
    ``small`` runs beside another process that runs NumPy sgemm on the same number of
    threads. Fair: fastattn with one thread beside the same neighbour.

Each figure is the mean time per call (per pair for ``blas``) over a window of a few
seconds; ``ratio`` is shared / fair, and 1.5 or less is what fastattn aims for. Every
library uses the same thread count.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import numpy as np

from ..common import OK, format_table, symbols
from .harness import blas_threads, mean_call_seconds, settle
from .report import write_json

#: Scenario names, in the order they run.
SCENARIOS = ("blas", "processes", "neighbour")
WINDOW_S = 4.0


def small_inputs():
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 8, 128, 64)).astype(np.float32) for _ in range(3))
    return q, k, v


def decoder_step_calls(fa):
    """The blas scenario's calls: ``x @ W`` (a decoder's projection), one GQA decode step
    of ``fa.attention``, and the pair of them; each writes into its own buffer."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, 1024)).astype(np.float32)
    w = (rng.standard_normal((1024, 2816)) / 32).astype(np.float32)
    q = rng.standard_normal((1, 16, 1, 64)).astype(np.float32)
    k = rng.standard_normal((1, 4, 520, 64)).astype(np.float32)
    v = rng.standard_normal((1, 4, 520, 64)).astype(np.float32)
    y = np.empty((1, w.shape[1]), np.float32)
    out = np.empty_like(q)

    def product():
        np.matmul(x, w, out=y)

    def attend():
        fa.attention(q, k, v, out=out)

    def pair():
        product()
        attend()

    return product, attend, pair


# --------------------------------------------------------------------------- processes

def _child_env():
    # The children import the same fastattn as this process.
    import fastattn
    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.abspath(fastattn.__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _spawn(role, threads, seconds=0.0):
    code = (f"from fastattn.cli.bench.contention import _child; "
            f"_child({role!r}, {threads}, {seconds})")
    return subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env=_child_env())


def _wait_ready(proc):
    line = proc.stdout.readline()
    if line.strip() != "ready":
        raise RuntimeError(f"contention child failed to start (said {line!r})")


def _child(role, threads, seconds):
    """Entry point of the helper processes (``role``: "small" or "sgemm")."""
    import fastattn

    with blas_threads(threads), fastattn.num_threads(threads):
        if role == "sgemm":
            rng = np.random.default_rng(1)
            a = rng.standard_normal((1024, 1024)).astype(np.float32)
            c = np.empty_like(a)
            np.matmul(a, a, out=c)
            print("ready", flush=True)
            while True:        # until the parent terminates us
                np.matmul(a, a, out=c)
        q, k, v = small_inputs()
        out = np.empty_like(q)
        fastattn.attention(q, k, v, out=out)
        print("ready", flush=True)
        if role == "small-forever":
            while True:        # until the parent terminates us
                fastattn.attention(q, k, v, out=out)
        sys.stdin.readline()   # "go": both processes start their window together
        mean = mean_call_seconds(lambda: fastattn.attention(q, k, v, out=out), seconds)
        print(repr(mean), flush=True)


def _run_small_processes(n_procs, threads, seconds):
    procs = [_spawn("small", threads, seconds) for _ in range(n_procs)]
    try:
        for p in procs:
            _wait_ready(p)
        for p in procs:
            p.stdin.write("go\n")
            p.stdin.flush()
        return [float(p.stdout.readline()) for p in procs]
    finally:
        for p in procs:
            p.stdin.close()
            p.wait()


class Neighbour:
    """Another process that runs NumPy sgemm (``role="sgemm"``) or fastattn on ``small``
    (``role="small-forever"``) on ``threads`` threads until the block ends."""

    def __init__(self, threads, role="sgemm"):
        self.threads = threads
        self.role = role

    def __enter__(self):
        self.proc = _spawn(self.role, self.threads)
        _wait_ready(self.proc)
        time.sleep(0.2)
        return self

    def __exit__(self, *exc):
        self.proc.terminate()
        self.proc.wait()
        self.proc.stdout.close()
        self.proc.stdin.close()


# --------------------------------------------------------------------------- scenarios

def scenario_blas(fa, threads, seconds):
    product, attend, pair = decoder_step_calls(fa)
    with fa.num_threads(threads):
        settle()
        t_product = mean_call_seconds(product, seconds / 2)
        settle()
        t_attend = mean_call_seconds(attend, seconds / 2)
        settle()
        shared = mean_call_seconds(pair, seconds)
    return {"fair_s": t_product + t_attend, "shared_s": shared,
            "fair_parts_s": {"matmul": t_product, "attention": t_attend}}


def scenario_processes(fa, threads, seconds):
    alone = _run_small_processes(1, threads, seconds)[0]
    shared = _run_small_processes(2, threads, seconds)
    return {"fair_s": 2 * alone, "shared_s": float(np.mean(shared)),
            "fair_parts_s": {"one process alone": alone}, "shared_each_s": shared}


def scenario_neighbour(fa, threads, seconds):
    q, k, v = small_inputs()
    out = np.empty_like(q)

    def attend():
        fa.attention(q, k, v, out=out)

    with Neighbour(threads):
        with fa.num_threads(1):
            fair = mean_call_seconds(attend, seconds)
        with fa.num_threads(threads):
            shared = mean_call_seconds(attend, seconds)
    return {"fair_s": fair, "shared_s": shared}


DESCRIPTIONS = {
    "blas": "x(1,1024) @ W(1024,2816) then attention(q(1,16,1,64), k/v(1,4,520,64))",
    "processes": "two processes, each running small (8 heads, 128x128, D 64)",
    "neighbour": "small beside a process running NumPy sgemm",
}
FAIR = {
    "blas": "matmul alone + attention alone",
    "processes": "2 x one process alone",
    "neighbour": "fastattn on 1 thread beside the same process",
}
_RUN = {"blas": scenario_blas, "processes": scenario_processes,
        "neighbour": scenario_neighbour}


def run_scenarios(names=SCENARIOS, threads=None, seconds=WINDOW_S):
    """Run the named scenarios; return a list of result dicts (times in seconds)."""
    import fastattn as fa

    threads = threads or fa.get_num_threads()
    results = []
    with blas_threads(threads):
        for name in names:
            r = _RUN[name](fa, threads, seconds)
            r.update(name=name, threads=threads, window_s=seconds,
                     ratio=r["shared_s"] / r["fair_s"])
            results.append(r)
    return results


def format_scenarios(results):
    def ms(s):
        return f"{s * 1e3:.3f} ms"

    header = ("scenario", "what runs", "fair share", "shared", "ratio")
    rows = [(r["name"], DESCRIPTIONS[r["name"]], f"{ms(r['fair_s'])} ({FAIR[r['name']]})",
             ms(r["shared_s"]), f"{r['ratio']:.2f}") for r in results]
    return format_table(header, rows, align="lll")


def run(fa, threads, quick, json_path, stdout):
    """``bench --contention``: the scenarios as a table (and JSON); the exit status."""
    seconds = 1.0 if quick else WINDOW_S
    print(f"fastattn {fa.__version__} bench --contention {symbols()['dash']} {os.cpu_count()}"
          f" CPUs; {threads} threads for fastattn and BLAS; mean per call over {seconds:g} s",
          file=stdout, flush=True)
    results = run_scenarios(threads=threads, seconds=seconds)
    print(file=stdout)
    print(format_scenarios(results), file=stdout)
    print("ratio = shared / fair share; fastattn aims for 1.5 or less", file=stdout)
    if json_path:
        write_json({"threads": threads, "window_s": seconds, "scenarios": results}, json_path)
        print(f"wrote {json_path}", file=stdout)
    return OK
