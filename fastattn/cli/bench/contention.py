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
``torch``
    As ``blas`` in torch: ``x @ W`` on torch tensors, then the same decode step through
    fastattn's torch operation (``fastattn.integrations.torch.attention``), as a model
    written in torch with fastattn's attention does. torch's OpenMP threads spin for
    milliseconds after each of its parallel operations, so the attention call meets them
    on the cores. Fair: the product alone plus the attention call alone.
``torch-train``
    The same with a training step's sizes: ``x(2048,128) @ W(128,384)`` (a block's
    q, k, v projection for 16 sequences of 128 tokens) in torch, then a causal
    ``attention`` of 16 x 4 heads, 128 x 128, D 32.

The torch scenarios run when torch is installed, and each has a second row in which torch's
own ``scaled_dot_product_attention`` takes fastattn's place in the same alternation, with
its own fair share (the product alone plus SDPA alone), to compare with. Each figure is the
mean time per call (per pair for ``blas`` and the torch scenarios) over a window of a few
seconds; ``ratio`` is shared / fair, and 1.5 or less is what fastattn aims for. Every
library uses the same thread count. The table names the threads that ran fastattn's work
items: its own pool, or the calling thread's OpenMP team, which it shares with torch (see
``FASTATTN_POOL`` in fastattn/_machine/threads.py).
"""

from __future__ import annotations

import contextlib
import functools
import os
import subprocess
import sys
import time

import numpy as np

from ..common import OK, format_table, symbols
from .harness import blas_threads, import_torch, mean_call_seconds, settle
from .report import write_json

#: Scenario names, in the order they run; TORCH_SCENARIOS need torch.
SCENARIOS = ("blas", "processes", "neighbour", "torch", "torch-train")
TORCH_SCENARIOS = ("torch", "torch-train")
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


def torch_step_calls(torch, train=False):
    """The torch scenarios' calls: ``x @ W`` in torch (into a buffer), the attention call
    of fastattn's torch operation and the same call of torch's SDPA (each returns a new
    tensor)."""
    g = torch.Generator().manual_seed(0)
    if train:
        x, w = torch.randn(2048, 128, generator=g), torch.randn(128, 384, generator=g) / 11
        q = k = v = torch.randn(16, 4, 128, 32, generator=g)
        causal = True
    else:
        x, w = torch.randn(1, 1024, generator=g), torch.randn(1024, 2816, generator=g) / 32
        q = torch.randn(1, 16, 1, 64, generator=g)
        k, v = torch.randn(1, 4, 520, 64, generator=g), torch.randn(1, 4, 520, 64, generator=g)
        causal = False
    y = torch.empty(x.shape[0], w.shape[1])
    sdpa = torch.nn.functional.scaled_dot_product_attention
    from fastattn.integrations import torch as fa_torch

    def product():
        torch.matmul(x, w, out=y)

    def attend():
        return fa_torch.attention(q, k, v, causal=causal)

    def attend_sdpa():
        return sdpa(q, k, v, is_causal=causal, enable_gqa=True)

    return product, attend, attend_sdpa


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

def _alternation(product, attend, seconds):
    """fair_s, shared_s and the parts of the fair share for ``product`` alternating with
    ``attend``."""
    settle()
    t_product = mean_call_seconds(product, seconds / 2)
    settle()
    t_attend = mean_call_seconds(attend, seconds / 2)
    settle()
    shared = mean_call_seconds(lambda: (product(), attend()), seconds)
    return {"fair_s": t_product + t_attend, "shared_s": shared,
            "fair_parts_s": {"matmul": t_product, "attention": t_attend}}


def scenario_blas(fa, threads, seconds):
    product, attend, _ = decoder_step_calls(fa)
    with fa.num_threads(threads):
        return _alternation(product, attend, seconds)


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


@contextlib.contextmanager
def _torch_threads(torch, n):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def scenario_torch(fa, threads, seconds, train=False):
    torch = import_torch()
    product, attend, attend_sdpa = torch_step_calls(torch, train)
    with fa.num_threads(threads), _torch_threads(torch, threads), torch.inference_mode():
        r = _alternation(product, attend, seconds)
        sdpa = _alternation(product, attend_sdpa, seconds)
    sdpa["ratio"] = sdpa["shared_s"] / sdpa["fair_s"]
    return dict(r, sdpa=sdpa)


DESCRIPTIONS = {
    "blas": "x(1,1024) @ W(1024,2816) then attention(q(1,16,1,64), k/v(1,4,520,64))",
    "processes": "two processes, each running small (8 heads, 128x128, D 64)",
    "neighbour": "small beside a process running NumPy sgemm",
    "torch": "as blas, the product in torch",
    "torch-train": "torch x(2048,128) @ W(128,384) then causal attention(16x4 heads, "
                   "128x128, D 32)",
}
FAIR = {
    "blas": "matmul alone + attention alone",
    "processes": "2 x one process alone",
    "neighbour": "fastattn on 1 thread beside the same process",
    "torch": "matmul alone + attention alone",
    "torch-train": "matmul alone + attention alone",
}
_RUN = {"blas": scenario_blas, "processes": scenario_processes,
        "neighbour": scenario_neighbour, "torch": scenario_torch,
        "torch-train": functools.partial(scenario_torch, train=True)}


def _pool_used(name):
    """What ran fastattn's work items in scenario ``name`` (asked after it ran: a torch
    scenario imports torch, which can change the answer)."""
    from fastattn._machine import threads as _threads

    team = _threads.pool_team()
    if team == "always" or (team == "in torch" and name in TORCH_SCENARIOS):
        return "OpenMP team"
    return "own pool"


def available_scenarios():
    """SCENARIOS without the torch ones when torch cannot be imported."""
    if import_torch() is None:
        return tuple(n for n in SCENARIOS if n not in TORCH_SCENARIOS)
    return SCENARIOS


def run_scenarios(names=None, threads=None, seconds=WINDOW_S):
    """Run the named scenarios (default: the available ones); return a list of result
    dicts (times in seconds)."""
    import fastattn as fa

    names = available_scenarios() if names is None else names
    threads = threads or fa.get_num_threads()
    results = []
    with blas_threads(threads):
        for name in names:
            r = _RUN[name](fa, threads, seconds)
            r.update(name=name, threads=threads, window_s=seconds, pool=_pool_used(name),
                     ratio=r["shared_s"] / r["fair_s"])
            results.append(r)
    return results


def format_scenarios(results):
    def ms(s):
        return f"{s * 1e3:.3f} ms"

    header = ("scenario", "what runs", "fastattn on", "fair share", "shared", "ratio")
    rows = []
    for r in results:
        rows.append((r["name"], DESCRIPTIONS[r["name"]], r["pool"],
                     f"{ms(r['fair_s'])} ({FAIR[r['name']]})", ms(r["shared_s"]),
                     f"{r['ratio']:.2f}"))
        if "sdpa" in r:
            c = r["sdpa"]
            rows.append((f"{r['name']}, torch SDPA", "the same with torch's SDPA for "
                         "fastattn", "", f"{ms(c['fair_s'])} (matmul alone + SDPA alone)",
                         ms(c["shared_s"]), f"{c['ratio']:.2f}"))
    return format_table(header, rows, align="llll")


def run(fa, threads, quick, json_path, stdout):
    """``bench --contention``: the scenarios as a table (and JSON); the exit status."""
    seconds = 1.0 if quick else WINDOW_S
    print(f"fastattn {fa.__version__} bench --contention {symbols()['dash']} {os.cpu_count()}"
          f" CPUs; {threads} threads for fastattn and BLAS; mean per call over {seconds:g} s",
          file=stdout, flush=True)
    names = available_scenarios()
    results = run_scenarios(names, threads=threads, seconds=seconds)
    print(file=stdout)
    print(format_scenarios(results), file=stdout)
    print("ratio = shared / fair share; fastattn aims for 1.5 or less", file=stdout)
    if names != SCENARIOS:
        print("torch is not installed: no torch scenarios", file=stdout)
    if json_path:
        write_json({"threads": threads, "window_s": seconds, "scenarios": results}, json_path)
        print(f"wrote {json_path}", file=stdout)
    return OK
