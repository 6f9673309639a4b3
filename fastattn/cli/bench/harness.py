"""The one timing harness: every table of ``python -m fastattn bench``, the fixtures of
``benchmarks/`` and ``tools/ab_*.py`` measure through it.

How a figure is measured
------------------------
1. **Warm-up** (:func:`first_calls`): each callable runs once untimed; its output is kept
   for the correctness checks. The first call of a process pays for thread start-up, page
   faults and a cold cache, so the batch size comes from warm calls: calls per batch such
   that a batch lasts about ``target_s``.
2. **Alternating rounds** (:func:`alternate`): the callables take turns batch by batch,
   in an order that rotates each round, so that a slow phase of a shared machine hits all
   of them alike. Before every batch the harness pauses until this process uses no CPU
   (:func:`settle`): OpenMP and OpenBLAS workers keep spinning after a parallel region (an
   OpenBLAS worker for about 135 ms after each product), and one library's spinning
   workers would take the cores from the next one's. After the pause a library's threads
   are asleep too, and waking them can cost milliseconds, so one untimed *wake-up* call
   precedes each batch (not for callables that take long enough not to care, such as
   the NumPy reference). A sample is the batch's wall time divided by its calls.
3. **The figure** is the median of the samples.

Why not pyperf or pytest-benchmark here
---------------------------------------
pyperf runs each benchmark in worker processes of its own, calibrated and timed one after
the other, so two libraries (or two builds) are never measured in the same seconds of the
machine's life; the bench reports *ratios*, and alternating the callables batch by batch
in one process is what keeps the machine's slow phases out of them. pyperf has no place
for the pause until the cores are quiet or for the wake-up call either. pytest-benchmark
serves ``benchmarks/`` well (saved runs, ``compare`` across commits, a group per shape),
and its fixtures there take this module's thread hold and pause; it too times one
callable at a time, so the tables do not use it.

No relative imports: ``tools/ab_*.py`` load this file on its own beside an older build.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

# Pause before every timed batch so spinning OpenMP/OpenBLAS workers of the previous
# library have gone to sleep.  libgomp spins for well under 50 ms by default, but an
# OpenBLAS worker spins for 2**28 TSC ticks after each BLAS call (about 135 ms measured
# here), so after the pause settle() also waits until this process stops using CPU.
PAUSE_S = 0.05
SETTLE_POLL_S = 0.02      # quiet = under 10% of one core used during a poll
SETTLE_MAX_S = 1.0


# --------------------------------------------------------------------------- timing

def settle():
    """Pause, then wait (at most SETTLE_MAX_S) until no thread of ours burns CPU."""
    time.sleep(PAUSE_S)
    deadline = time.perf_counter() + SETTLE_MAX_S
    while time.perf_counter() < deadline:
        c0 = time.process_time()
        time.sleep(SETTLE_POLL_S)
        if time.process_time() - c0 < 0.1 * SETTLE_POLL_S:
            return


def timed_batch(fn, n):
    """Seconds per call of ``n`` back-to-back calls of ``fn``."""
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n


def calls_per_batch(call_s, target_s):
    """Calls per batch so that a batch lasts about ``target_s``."""
    if call_s >= target_s:
        return 1
    return int(min(100_000, max(1, math.ceil(target_s / max(call_s, 1e-7)))))


def warm_call_seconds(call, budget_s):
    """Seconds per call of ``call`` once warm: the mean over about ``budget_s``."""
    call()
    n, t0 = 0, time.perf_counter()
    while True:
        call()
        n += 1
        elapsed = time.perf_counter() - t0
        if elapsed >= budget_s or n >= 100_000:
            return elapsed / n


def warm_up(call, seconds=0.3):
    """Run ``call`` for a while untimed: starts BLAS threads, faults pages in, and lets the
    CPU clock ramp up (the first measurement of a fresh process is otherwise often low)."""
    end = time.perf_counter() + seconds
    call()
    while time.perf_counter() < end:
        call()


def mean_call_seconds(call, seconds):
    """Mean wall time per call of ``call`` over a window of about ``seconds``, after a
    short warm-up: for measurements beside another load, where one long window is the
    figure (the contention scenarios)."""
    warm_up(call, min(0.2, seconds / 4))
    n, t0 = 0, time.perf_counter()
    while True:
        call()
        n += 1
        elapsed = time.perf_counter() - t0
        if elapsed >= seconds:
            return elapsed / n


def median(xs):
    return float(np.median(np.asarray(xs, dtype=np.float64)))


@dataclass
class Timed:
    """One callable in the alternation.

    ``context`` makes the context manager entered around its calls (torch's inference
    mode, a thread count); ``wake`` is False for callables long enough to need no wake-up
    call; ``samples`` is how many timed batches it gets.
    """

    call: Callable[[], object]
    samples: int = 7
    context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    wake: bool = True
    calls_per_sample: int = field(default=1, init=False)


def first_calls(entries, target_s):
    """Run each entry once untimed and size its batches from warm calls.

    Returns ``(outputs, first_s, errors)``: each entry's first result, its seconds per
    warm call, and the exceptions of entries that raised (removed from ``entries``, so
    that one failing library does not stop the others).
    """
    outputs, first_s, errors = {}, {}, {}
    for name in list(entries):
        entry = entries[name]
        settle()
        try:
            with entry.context():
                t0 = time.perf_counter()
                outputs[name] = entry.call()
                first_s[name] = time.perf_counter() - t0
                if first_s[name] < target_s:
                    first_s[name] = warm_call_seconds(entry.call, target_s)
        except Exception as exc:  # report, do not abort the whole run
            errors[name] = exc
            del entries[name]
            outputs.pop(name, None)
            continue
        entry.calls_per_sample = calls_per_batch(first_s[name], target_s)
    return outputs, first_s, errors


def alternate(entries):
    """Timed batches of the entries, alternating; returns ``{name: [seconds per call]}``."""
    samples = {name: [] for name in entries}
    order = list(entries)
    for round_ in range(max((e.samples for e in entries.values()), default=0)):
        rotated = order[round_ % len(order):] + order[:round_ % len(order)]
        for name in rotated:
            entry = entries[name]
            if len(samples[name]) >= entry.samples:
                continue
            settle()
            with entry.context():
                if entry.wake:
                    entry.call()
                samples[name].append(timed_batch(entry.call, entry.calls_per_sample))
    return samples


def measure(entries, target_s):
    """:func:`first_calls` then :func:`alternate`: ``({name: median s}, outputs, errors)``."""
    outputs, _, errors = first_calls(entries, target_s)
    samples = alternate(entries)
    return {name: median(s) for name, s in samples.items()}, outputs, errors


# --------------------------------------------------------------------------- threads

def blas_threads(n):
    """A context that limits NumPy's BLAS to ``n`` threads, so that the reference and the
    measured peaks use fastattn's thread count; it yields what was done, for the report.

    threadpoolctl (in the ``bench`` extra) does it; without it BLAS keeps its default.
    """
    try:
        import threadpoolctl
    except ImportError:
        return contextlib.nullcontext(
            "default (threadpoolctl is not installed: pip install threadpoolctl)")
    limits = threadpoolctl.threadpool_limits(limits=n, user_api="blas")
    return _Described(limits, f"{n} (threadpoolctl)")


class _Described(contextlib.AbstractContextManager):
    def __init__(self, inner, description):
        self.inner, self.description = inner, description

    def __enter__(self):
        self.inner.__enter__()
        return self.description

    def __exit__(self, *exc):
        return self.inner.__exit__(*exc)


@contextlib.contextmanager
def hold_threads(n, fa, torch=None):
    """fastattn, BLAS and (when given) torch on ``n`` threads for the block; yields
    ``{"fastattn": n, "blas": how, "torch": n}`` as the report shows them."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(fa.num_threads(n))
        held = {"fastattn": fa.get_num_threads(),
                "blas": stack.enter_context(blas_threads(n))}
        if torch is not None:
            stack.callback(torch.set_num_threads, torch.get_num_threads())
            torch.set_num_threads(n)
            held["torch"] = torch.get_num_threads()
        yield held


def import_torch():
    """torch with its functional module, or None when it is absent or broken."""
    try:
        import torch
        import torch.nn.functional  # noqa: F401
    except Exception:  # ImportError, or a broken install raising OSError/RuntimeError
        return None
    return torch


def to_torch(torch, a):
    """A torch tensor sharing ``a``'s memory (bfloat16 through an int16 view)."""
    if a.dtype.name == "bfloat16":
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)


# --------------------------------------------------------------------------- load

def _system_cpu_seconds():
    """(busy, steal) CPU seconds of the whole machine since boot, from /proc/stat (Linux)."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    hz = os.sysconf("SC_CLK_TCK")
    user, nice, system, _idle, _iowait, irq, softirq = fields[:7]
    steal = fields[7] if len(fields) > 7 else 0
    return (user + nice + system + irq + softirq) / hz, steal / hz


class OtherLoad:
    """Share of the CPUs used by *other* processes (and stolen by the hypervisor) while we
    measure: machine-wide busy time minus this process's own CPU time (all its threads,
    spinning OpenMP workers included). Timings taken while this is high are not the
    machine's; the tables show it so nobody trusts them by mistake."""

    def __init__(self):
        self.cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") \
            else (os.cpu_count() or 1)
        self._start = (time.perf_counter(), time.process_time(), _system_cpu_seconds())

    def fraction(self):
        """(other processes' share, stolen share) of all CPUs since creation, or None."""
        wall0, own0, sys0 = self._start
        sys1 = _system_cpu_seconds()
        if sys0 is None or sys1 is None:
            return None
        capacity = (time.perf_counter() - wall0) * self.cpus
        own = time.process_time() - own0
        other = max(0.0, (sys1[0] - sys0[0]) - own)
        return min(1.0, other / capacity), min(1.0, (sys1[1] - sys0[1]) / capacity)
