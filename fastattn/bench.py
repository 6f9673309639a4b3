"""``python -m fastattn bench``: time fastattn against the NumPy reference and PyTorch.

What is measured
----------------
For every shape of ``SHAPES`` (batch 1; float32, one float64 shape and four with float16 or
bfloat16 q, k and v) the same three calls are timed on the same inputs and the same number
of threads:

* ``fastattn.attention`` -- writing into a preallocated ``out=`` array;
* ``fastattn.reference.attention`` -- the pure-NumPy oracle, which materialises the score
  matrix in float64; it is slow on large shapes, so it gets fewer repeats, and ``--quick``
  skips it on the two largest shapes (the table says so; nothing is estimated);
* ``torch.nn.functional.scaled_dot_product_attention`` when torch can be imported
  (``torch.set_num_threads`` to the same count, ``enable_gqa=True`` for grouped heads,
  ``is_causal`` for causal shapes, under ``torch.inference_mode``).

How it is measured
------------------
Inputs are drawn once from a fixed seed, outside the timed region. Each library first runs
once untimed (warm-up; its output is kept for the correctness check). A *sample* is the
wall time of a batch of ``n`` back-to-back calls divided by ``n``, with ``n`` chosen so a
batch lasts a few tens of milliseconds (one call for the big shapes), so that the microsecond
shapes are not dominated by timer resolution. The libraries alternate batch by batch, and
the order rotates each round, with a pause (50 ms) before every batch, extended until the
process uses no CPU: OpenMP and OpenBLAS worker threads keep spinning for a while after a
parallel region ends (an OpenBLAS worker for about 135 ms after each matrix product), and
without the pause the idle workers of one library would compete for the two cores with the
next one's. The reported time is the median of the samples.

Throughput is reported against what this machine can do, measured at start-up with the same
thread count: the best GFLOP/s of a few 2048 x 2048 NumPy matrix products (sgemm, and dgemm
for the float64 shape), and for the bandwidth-bound decode shapes the read bandwidth of a
matrix-vector product streaming a buffer larger than the last-level cache. NumPy's OpenBLAS
picks its kernels by CPU (AVX-512 ones where available, unless OPENBLAS_CORETYPE says
otherwise), so "% peak" is relative to that library, not to the FMA units' theoretical rate.

FLOPs are ``2 * (D + Dv)`` per visible (query, key) pair -- ``4 * D`` when ``Dv == D`` --
counting only the pairs a causal mask leaves visible. Decode bytes are everything the call
must read or write once: K, V, Q and the output.

A fast but wrong kernel must not hide behind its speed: every shape also reports the largest
absolute difference between fastattn's output and torch's (whole output) and the reference's
(whole output where the reference was timed; otherwise two heads x the last 64 query rows,
which keeps the bottom-right causal alignment), and the run fails (exit status 1) when a
difference exceeds the tolerance.

The 16-bit shapes time two more calls in the same rounds: fastattn and torch on float32
copies of the same inputs.  The second table gives their ratios: what a float16 or bfloat16
cache gains over keeping it in float32 (bfloat16 shapes need ``ml_dtypes`` and are skipped
without it; torch gets its bfloat16 tensors as a zero-copy view).

A full run (no ``--shapes``) then times the attention variants -- softcap, ALiBi, sinks
and packed sequences -- against the same calls without them and against torch
(``fastattn.bench_variants``); ``--variants`` prints that table alone.

``--contention`` times something else: fastattn on cores it shares with NumPy's BLAS, with a
second process and with a busy neighbour, against its fair share of the machine (see
``fastattn.contention``).
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import platform
import re
import sys
import textwrap
import time
from dataclasses import dataclass

import numpy as np

__all__ = ["Shape", "SHAPES", "QUICK_SKIP_REFERENCE", "make_inputs", "flops", "bytes_moved",
           "add_arguments", "run", "main"]

EXIT_OK = 0
EXIT_CHECK_FAILED = 1     # a correctness check failed, or fastattn raised
EXIT_USAGE = 2            # bad command line (argparse uses 2 as well)
EXIT_ENVIRONMENT = 3      # an output that was asked for could not be produced (e.g. no matplotlib)

SEED = 20240607
# Pause before every timed batch so spinning OpenMP/OpenBLAS workers of the previous
# library have gone to sleep.  libgomp spins for well under 50 ms by default, but an
# OpenBLAS worker spins for 2**28 TSC ticks after each BLAS call (about 135 ms measured
# here), so after the pause _settle() also waits until this process stops using CPU.
PAUSE_S = 0.05
SETTLE_POLL_S = 0.02      # quiet = under 10% of one core used during a poll
SETTLE_MAX_S = 1.0


@dataclass(frozen=True)
class Shape:
    """One benchmark case (batch 1)."""

    name: str
    hq: int
    hkv: int
    lq: int
    lk: int
    d: int
    causal: bool = False
    dtype: str = "float32"

    @property
    def dv(self):
        return self.d

    @property
    def decode(self):
        # One query row against a long cache: bandwidth-bound, reported in GB/s.
        return self.lq == 1

    @property
    def half(self):
        # q, k, v stored in 16 bits (float16 or bfloat16), computed in float32.
        return self.dtype in ("float16", "bfloat16")

    def np_dtype(self):
        """The NumPy dtype of the inputs (bfloat16 needs ml_dtypes: TypeError without)."""
        from ._args import storage_dtype
        return storage_dtype(self.dtype)

    def describe(self):
        tag = {"float64": " f64", "float16": " f16", "bfloat16": " bf16"}.get(self.dtype, "")
        return (f"({self.hq},{self.hkv},{self.lq},{self.lk},{self.d})"
                f"{' causal' if self.causal else ''}{tag}")


SHAPES = (
    Shape("tiny", 1, 1, 6, 6, 3),
    Shape("small", 8, 8, 128, 128, 64),
    Shape("prefill-1k", 12, 12, 1024, 1024, 64),
    Shape("prefill-1k-causal", 12, 12, 1024, 1024, 64, causal=True),
    Shape("prefill-4k-causal", 4, 4, 4096, 4096, 64, causal=True),
    Shape("long-8k", 1, 1, 8192, 8192, 64),
    Shape("decode-4k", 32, 32, 1, 4096, 128),
    Shape("decode-gqa-8k", 32, 8, 1, 8192, 128),
    Shape("prefill-1k-f64", 12, 12, 1024, 1024, 64, causal=True, dtype="float64"),
    Shape("decode-4k-f16", 32, 32, 1, 4096, 128, dtype="float16"),
    Shape("decode-4k-bf16", 32, 32, 1, 4096, 128, dtype="bfloat16"),
    Shape("decode-gqa-8k-f16", 32, 8, 1, 8192, 128, dtype="float16"),
    Shape("prefill-1k-f16", 12, 12, 1024, 1024, 64, dtype="float16"),
)
SHAPES_BY_NAME = {s.name: s for s in SHAPES}

# The reference materialises (Hq, Lq, Lk) float64 scores: seconds per call on these.
QUICK_SKIP_REFERENCE = frozenset({"long-8k", "prefill-4k-causal"})


def visible_pairs(shape):
    """Number of (query, key) pairs the mask leaves visible, per head."""
    if not shape.causal:
        return shape.lq * shape.lk
    # Bottom-right alignment: query i sees keys j <= i + (Lk - Lq).
    offset = shape.lk - shape.lq
    return sum(min(shape.lk, max(0, i + offset + 1)) for i in range(shape.lq))


def flops(shape, batch=1):
    """Floating-point operations of one call: a multiply-add per element of both products."""
    return 2 * (shape.d + shape.dv) * batch * shape.hq * visible_pairs(shape)


def bytes_moved(shape, batch=1):
    """Bytes one call must read or write at least once: K, V, Q and the output."""
    itemsize = 2 if shape.half else np.dtype(shape.dtype).itemsize
    kv = batch * shape.hkv * shape.lk * (shape.d + shape.dv)
    qo = batch * shape.hq * shape.lq * (shape.d + shape.dv)
    return (kv + qo) * itemsize


def make_inputs(shape, seed=SEED):
    """q, k, v of ``shape`` (batch 1), standard normal, C-contiguous, fixed seed."""
    rng = np.random.default_rng(seed)
    dt = shape.np_dtype()
    q = rng.standard_normal((1, shape.hq, shape.lq, shape.d)).astype(dt)
    k = rng.standard_normal((1, shape.hkv, shape.lk, shape.d)).astype(dt)
    v = rng.standard_normal((1, shape.hkv, shape.lk, shape.dv)).astype(dt)
    return q, k, v


# --------------------------------------------------------------------------- threads

def _loaded_openblas():
    """Paths of the OpenBLAS libraries loaded in this process (Linux only)."""
    try:
        with open("/proc/self/maps") as f:
            maps = f.read()
    except OSError:
        return []
    return sorted(set(re.findall(r"(/\S*openblas\S*\.so\S*)", maps)))


@contextlib.contextmanager
def blas_threads(n):
    """Limit NumPy's BLAS to ``n`` threads, so the reference and the matmul peak use the
    same thread count as fastattn. Yields a short description of what was done."""
    try:
        import threadpoolctl
    except ImportError:
        threadpoolctl = None
    if threadpoolctl is not None:
        with threadpoolctl.threadpool_limits(limits=n, user_api="blas"):
            yield f"{n} (threadpoolctl)"
        return
    # Without threadpoolctl, call OpenBLAS's own setter, as threadpoolctl would.
    import ctypes
    for path in _loaded_openblas():
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for prefix, suffix in (("scipy_", "64_"), ("", "64_"), ("", ""), ("scipy_", "")):
            setter = getattr(lib, f"{prefix}openblas_set_num_threads{suffix}", None)
            getter = getattr(lib, f"{prefix}openblas_get_num_threads{suffix}", None)
            if setter is not None and getter is not None:
                old = getter()
                setter(n)
                try:
                    yield f"{n} (OpenBLAS)"
                finally:
                    setter(old)
                return
    yield "default (could not set: no threadpoolctl, no OpenBLAS found)"


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
    machine's; the table shows it so nobody trusts them by mistake."""

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


def _to_torch(torch, a):
    """A torch tensor sharing ``a``'s memory (bfloat16 through an int16 view)."""
    if a.dtype.name == "bfloat16":
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)


def _import_torch():
    try:
        import torch
        import torch.nn.functional  # noqa: F401
    except Exception:  # ImportError, or a broken install raising OSError/RuntimeError
        return None
    return torch


# --------------------------------------------------------------------------- timing

def _settle():
    """Pause, then wait (at most SETTLE_MAX_S) until no thread of ours burns CPU.

    The reference's matrix products and the peak measurements leave OpenBLAS workers
    spinning for ~135 ms; a batch started meanwhile would share the two cores with them.
    """
    time.sleep(PAUSE_S)
    deadline = time.perf_counter() + SETTLE_MAX_S
    while time.perf_counter() < deadline:
        c0 = time.process_time()
        time.sleep(SETTLE_POLL_S)
        if time.process_time() - c0 < 0.1 * SETTLE_POLL_S:
            return


def _timed_batch(fn, n):
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n


def _iterations(first_call_s, target_s):
    """Calls per batch so that a batch lasts about ``target_s``."""
    if first_call_s >= target_s:
        return 1
    return int(min(100_000, max(1, math.ceil(target_s / max(first_call_s, 1e-7)))))


def _warm_call_seconds(call, budget_s):
    """Seconds per call of ``call`` once warm: the mean over about ``budget_s``."""
    call()
    n, t0 = 0, time.perf_counter()
    while True:
        call()
        n += 1
        elapsed = time.perf_counter() - t0
        if elapsed >= budget_s or n >= 100_000:
            return elapsed / n


def _median(xs):
    return float(np.median(np.asarray(xs, dtype=np.float64)))


def _warm_up(call, seconds=0.3):
    """Run ``call`` for a while untimed: starts BLAS threads, faults pages in, and lets the
    CPU clock ramp up (the first measurement of a fresh process is otherwise often low)."""
    end = time.perf_counter() + seconds
    call()
    while time.perf_counter() < end:
        call()


def measure_matmul_peak(dtype, repeat=5, n=2048):
    """Best GFLOP/s of an n x n NumPy matrix product (OpenBLAS sgemm/dgemm).

    A peak is what the machine *can* do: interference from other processes only ever
    lowers a sample, so the best of a few is the estimate least biased by a busy machine
    (a low peak would flatter every "% peak" figure).
    """
    rng = np.random.default_rng(0)
    a = rng.standard_normal((n, n)).astype(dtype)
    b = rng.standard_normal((n, n)).astype(dtype)
    c = np.empty((n, n), dtype)
    call = functools.partial(np.matmul, a, b, out=c)
    _warm_up(call)
    samples = [_timed_batch(call, 1) for _ in range(repeat)]
    return 2.0 * n ** 3 / min(samples) / 1e9


def measure_read_bandwidth(repeat=5, mib=512):
    """Best GB/s of a float32 matrix-vector product streaming ``mib`` MiB.

    sgemv reads the matrix once with all BLAS threads and does two flops per element, so it
    is limited by memory reads; the buffer is larger than the last-level cache of common
    CPUs so the data comes from DRAM. Best of a few, as for the matmul peak.
    """
    cols = 4096
    rows = mib * 1024 * 1024 // 4 // cols
    a = np.ones((rows, cols), np.float32)
    x = np.ones(cols, np.float32)
    y = np.empty(rows, np.float32)
    call = functools.partial(np.matmul, a, x, out=y)
    _warm_up(call)
    samples = [_timed_batch(call, 1) for _ in range(repeat)]
    return a.nbytes / min(samples) / 1e9


# --------------------------------------------------------------------------- one shape

def _tolerance(dtype):
    # float32 kernels reorder sums (online softmax, blocking): ~1e-6 relative error is
    # normal, 1e-4 catches any real mistake. float64 is checked accordingly tighter; 16-bit
    # results are float32 results rounded once: two ulps of float16 (2**-10) or bfloat16
    # (2**-7) leave room for the other library's rounding.
    return {"float32": 1e-4, "float64": 1e-9, "float16": 2e-3, "bfloat16": 1.6e-2}[
        str(dtype)]


def _reference_slice(shape, q, k, v):
    """Two heads (first and last, keeping the GQA head mapping) x the last <= 64 query rows.

    Taking the *last* rows keeps the bottom-right causal alignment: with Lq' = m rows, row i'
    sees j <= i' + Lk - m, the same keys as row i' + Lq - m of the full problem.
    """
    heads_q = [0] if shape.hq == 1 else [0, shape.hq - 1]
    heads_kv = [0] if shape.hkv == 1 else [0, shape.hkv - 1]
    rows = min(shape.lq, 64)
    qs = q[:, heads_q, shape.lq - rows:, :]
    ks = k[:, heads_kv]
    vs = v[:, heads_kv]
    return (qs, ks, vs), (heads_q, rows)


def bench_shape(shape, *, fa, ref_mod, torch, repeat, quick):
    """Time and check one shape; return a JSON-ready dict."""
    load = OtherLoad()
    q, k, v = make_inputs(shape)
    result = {
        "name": shape.name, "dtype": shape.dtype, "hq": shape.hq, "hkv": shape.hkv,
        "lq": shape.lq, "lk": shape.lk, "d": shape.d, "dv": shape.dv, "causal": shape.causal,
        "batch": 1, "kind": "decode" if shape.decode else "prefill",
        "flops": flops(shape), "bytes": bytes_moved(shape), "libraries": {},
    }
    libs = {}   # name -> callable, only libraries that will be timed
    outputs = {}
    target_s = 0.01 if quick else 0.04

    # fastattn
    out = np.empty((1, shape.hq, shape.lq, shape.dv), q.dtype)
    fa_call = functools.partial(fa.attention, q, k, v, causal=shape.causal, out=out)
    libs["fastattn"] = fa_call
    if shape.half:
        # the same values in float32, timed in the same rounds
        q32, k32, v32 = (a.astype(np.float32) for a in (q, k, v))
        out32 = np.empty(out.shape, np.float32)
        libs["fastattn-f32"] = functools.partial(fa.attention, q32, k32, v32,
                                                 causal=shape.causal, out=out32)

    # reference
    if quick and shape.name in QUICK_SKIP_REFERENCE:
        result["libraries"]["reference"] = {
            "skipped": "skipped with --quick (seconds per call); run without --quick"}
    else:
        libs["reference"] = functools.partial(ref_mod.attention, q, k, v, causal=shape.causal)

    # torch
    if torch is None:
        result["libraries"]["torch"] = {"skipped": "torch is not installed"}
    else:
        tq, tk, tv = (_to_torch(torch, a) for a in (q, k, v))
        sdpa = torch.nn.functional.scaled_dot_product_attention
        kwargs = {"is_causal": shape.causal}
        if shape.hq != shape.hkv:
            kwargs["enable_gqa"] = True
        libs["torch"] = functools.partial(sdpa, tq, tk, tv, **kwargs)
        if shape.half:
            libs["torch-f32"] = functools.partial(
                sdpa, *(torch.from_numpy(a) for a in (q32, k32, v32)), **kwargs)

    def context(name):
        if name.startswith("torch"):
            return torch.inference_mode()
        return contextlib.nullcontext()

    # Warm-up: first call of each library, untimed; its output feeds the checks and its
    # duration sizes the batches.
    first = {}
    for name in list(libs):
        _settle()
        try:
            with context(name):
                t0 = time.perf_counter()
                res = libs[name]()
                first[name] = time.perf_counter() - t0
        except Exception as exc:  # report, do not abort the whole run
            result["libraries"][name] = {"error": f"{type(exc).__name__}: {exc}"}
            del libs[name]
            continue
        if name.startswith("torch"):
            # NumPy has no bfloat16: that one result is compared in float32
            res = (res.float() if res.dtype == torch.bfloat16 else res).numpy()
        outputs[name] = np.array(res, copy=True)
        # The first call of a process pays for thread-pool start-up, page faults and a
        # cold cache (4 ms for a 0.3 ms call was seen): size the batches from warm calls
        # instead, else a batch of a fast shape is a handful of calls dominated by wake-up.
        if first[name] < target_s:
            with context(name):
                first[name] = _warm_call_seconds(libs[name], target_s)

    plan = {}
    for name in libs:
        if name == "reference":
            # The oracle is slow: a few samples are enough for a speed-up ratio.
            n_samples = 1 if first[name] > 2.0 else min(repeat, 3)
        else:
            n_samples = repeat
        plan[name] = (n_samples, _iterations(first[name], target_s))
    samples = {name: [] for name in libs}
    order = list(libs)
    for round_ in range(max((p[0] for p in plan.values()), default=0)):
        rotated = order[round_ % len(order):] + order[:round_ % len(order)]
        for name in rotated:
            if len(samples[name]) >= plan[name][0]:
                continue
            _settle()
            with context(name):
                if name != "reference":
                    # After the pause a library's threads are asleep, and waking them (and
                    # the idle cores under them) can cost milliseconds: one untimed call
                    # first, so that the batch times back-to-back calls.  The reference's
                    # calls take long enough for that not to matter.
                    libs[name]()
                samples[name].append(_timed_batch(libs[name], plan[name][1]))

    for name in libs:
        med = _median(samples[name])
        result["libraries"][name] = {
            "median_s": med, "samples_s": samples[name], "calls_per_sample": plan[name][1],
            "gflops": result["flops"] / med / 1e9, "gbs": result["bytes"] / med / 1e9,
        }

    # Correctness: fastattn against torch and the reference (whole output or a slice).
    tol = _tolerance(shape.dtype)
    check = {"tolerance": tol, "ok": "fastattn" in outputs}
    if "fastattn" in outputs:
        got = outputs["fastattn"].astype(np.float64)
        if not np.all(np.isfinite(got)):
            check["ok"] = False
            check["non_finite"] = True
        if "torch" in outputs:
            want = outputs["torch"].astype(np.float64)
            diff = float(np.max(np.abs(got - want)))
            check["vs_torch_max_abs"] = diff
            check["ok"] = check["ok"] and diff <= tol * max(1.0, float(np.max(np.abs(want))))
        if "reference" in outputs:
            # The reference ran on the whole problem anyway: compare everything.
            want = outputs["reference"].astype(np.float64)
            diff = float(np.max(np.abs(got - want)))
            check["reference_slice"] = "whole output"
        else:
            (qs, ks, vs), (heads_q, rows) = _reference_slice(shape, q, k, v)
            try:
                want = np.asarray(ref_mod.attention(qs, ks, vs, causal=shape.causal),
                                  np.float64)
                diff = float(np.max(np.abs(got[:, heads_q, shape.lq - rows:, :] - want)))
                check["reference_slice"] = f"heads {heads_q}, last {rows} query rows"
            except Exception as exc:
                check["reference_error"] = f"{type(exc).__name__}: {exc}"
                want, diff = None, None
        if diff is None:
            check["ok"] = False
        else:
            check["vs_reference_max_abs"] = diff
            check["ok"] = check["ok"] and diff <= tol * max(1.0, float(np.max(np.abs(want))))
    result["check"] = check
    busy = load.fraction()
    if busy is not None:
        result["other_cpu_load"], result["cpu_steal"] = busy

    fa_res = result["libraries"].get("fastattn", {})
    for other in ("reference", "torch", "fastattn-f32", "torch-f32"):
        o = result["libraries"].get(other, {})
        if "median_s" in fa_res and "median_s" in o:
            result[f"speedup_vs_{other}"] = o["median_s"] / fa_res["median_s"]
    return result


# --------------------------------------------------------------------------- output

def _symbols():
    """Use µ, × and Δ when the terminal can print them, ASCII otherwise."""
    enc = getattr(sys.stdout, "encoding", None) or "ascii"
    try:
        "µ×Δ—".encode(enc)
    except (UnicodeEncodeError, LookupError):
        return {"mu": "u", "x": "x", "delta": "d", "dash": "-"}
    return {"mu": "µ", "x": "×", "delta": "Δ", "dash": "—"}


def format_time(seconds, sym=None):
    sym = sym or _symbols()
    if seconds < 1e-3:
        return f"{seconds * 1e6:.1f} {sym['mu']}s"
    if seconds < 10:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds:.1f} s"


def _rate(x):
    # Three significant digits: the tiny shape runs at a few hundredths of a GFLOP/s.
    return f"{x:.0f}" if x >= 100 else f"{x:.3g}"


def _percent(fraction):
    return "<1%" if fraction < 0.01 else f"{100 * fraction:.0f}%"


def peak_fraction(result, peaks):
    """fastattn's throughput as a share of the measured peak, or None.

    Prefill shapes against sgemm (dgemm for float64), decode shapes against the sgemv read
    bandwidth. Above 1 means the peak was measured low -- under load from other processes
    -- not that fastattn beats it; the table and the plot flag such figures.
    """
    fa = result["libraries"].get("fastattn", {})
    if "median_s" not in fa:
        return None
    if result["kind"] == "decode":
        rate, peak = fa["gbs"], peaks.get("read_gbs")
    else:
        rate = fa["gflops"]
        peak = peaks.get("dgemm_gflops" if result["dtype"] == "float64" else "sgemm_gflops")
    return rate / peak if peak else None


def format_peak(fraction):
    """"85%", or "108%*" when over 100% (see ``PEAK_NOTE``), or "?"."""
    if fraction is None:
        return "?"
    return _percent(fraction) + ("*" if fraction > 1 else "")


PEAK_NOTE = ("* over 100%: the peak was measured under load (other processes took CPU time "
             "while it ran), so it is too low; rerun when the machine is idle")


def peak_flagged(report):
    """Names of the shapes whose "% peak" is over 100% (flagged with PEAK_NOTE)."""
    peaks = report["machine"]["peaks"]
    return [r["name"] for r in report["results"] if (peak_fraction(r, peaks) or 0) > 1]


def _background(entry):
    if entry.get("other_cpu_load") is None:
        return None
    return entry["other_cpu_load"] + (entry.get("cpu_steal") or 0.0)


# Above this share of the CPUs used by others, timings say more about the neighbours.
BUSY_WARNING = 0.10


def load_warning(report):
    """A warning line when other processes used the CPUs during the run, else None."""
    busy = [(r["name"], _background(r)) for r in report["results"]]
    busy = [(n, b) for n, b in busy if b is not None and b > BUSY_WARNING]
    if not busy:
        return None
    worst = max(busy, key=lambda nb: nb[1])
    return (f"WARNING: other processes used > {100 * BUSY_WARNING:.0f}% of the CPUs during "
            f"{len(busy)} of {len(report['results'])} shapes (worst: {worst[0]}, "
            f"{100 * worst[1]:.0f}%); those timings are not this machine's -- rerun when idle")


def format_table(report):
    sym = _symbols()
    peaks = report["machine"]["peaks"]
    header = ["shape", "(Hq,Hkv,Lq,Lk,D)", "fastattn", "throughput", "% peak",
              "reference", f"{sym['x']} ref", "torch", f"{sym['x']} torch",
              f"max|{sym['delta']}|", "check", "bg load"]
    rows = []
    for r in report["results"]:
        libs = r["libraries"]
        shape = SHAPES_BY_NAME.get(r["name"])
        fa = libs.get("fastattn", {})
        row = [r["name"], shape.describe() if shape else "?"]
        if "median_s" in fa:
            row.append(format_time(fa["median_s"], sym))
            rate, unit = (fa["gbs"], "GB/s") if r["kind"] == "decode" else (fa["gflops"],
                                                                           "GFLOP/s")
            row.append(f"{_rate(rate)} {unit}")
            row.append(format_peak(peak_fraction(r, peaks)))
        else:
            row += ["ERROR", "", ""]
        for other in ("reference", "torch"):
            o = libs.get(other, {})
            if "median_s" in o:
                row.append(format_time(o["median_s"], sym))
                s = r.get(f"speedup_vs_{other}")
                row.append(f"{s:.2f}{sym['x']}" if s is not None else sym["dash"])
            elif "error" in o:
                row += ["error", sym["dash"]]
            elif "skipped" in o and other == "reference":
                row += ["skipped", sym["dash"]]
            else:
                row += ["n/a", sym["dash"]]
        c = r.get("check", {})
        diffs = [c[key] for key in ("vs_torch_max_abs", "vs_reference_max_abs") if key in c]
        row.append(f"{max(diffs):.1e}" if diffs else sym["dash"])
        row.append("ok" if c.get("ok") else "FAIL")
        # CPU share taken by other processes (or the hypervisor) while this row ran.
        bg = _background(r)
        row.append(_percent(bg) if bg is not None else "?")
        rows.append(row)
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    left = {0, 1}

    def fmt(row):
        return "  ".join(str(x).ljust(w) if i in left else str(x).rjust(w)
                         for i, (x, w) in enumerate(zip(row, widths)))
    lines = [fmt(header), "  ".join("-" * w for w in widths)] + [fmt(r) for r in rows]
    return "\n".join(lines)


def format_half_table(report):
    """The 16-bit shapes against the same inputs in float32, or None when none ran."""
    sym = _symbols()
    x = sym["x"]
    rows = []
    for r in report["results"]:
        if r["dtype"] not in ("float16", "bfloat16"):
            continue
        libs = r["libraries"]
        row = [r["name"], r["dtype"]]
        for name in ("fastattn", "fastattn-f32", "torch", "torch-f32"):
            o = libs.get(name, {})
            row.append(format_time(o["median_s"], sym) if "median_s" in o else sym["dash"])
        for key in ("fastattn-f32", "torch", "torch-f32"):
            s = r.get(f"speedup_vs_{key}")
            row.append(f"{s:.2f}{x}" if s is not None else sym["dash"])
        if r["kind"] == "decode" and report["machine"]["peaks"].get("read_gbs"):
            row.append(format_peak(peak_fraction(r, report["machine"]["peaks"])))
        else:
            row.append(sym["dash"])
        rows.append(row)
    if not rows:
        return None
    header = ["shape", "dtype", "fastattn", "fastattn f32", "torch", "torch f32",
              f"{x} fastattn f32", f"{x} torch", f"{x} torch f32", "% read bw"]
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows)]

    def fmt(row):
        return "  ".join(str(c).ljust(w) if i < 2 else str(c).rjust(w)
                         for i, (c, w) in enumerate(zip(row, widths)))
    lines = ["16-bit storage against the same values in float32 (same rounds; "
             f"{x} = the other's time / fastattn's):",
             fmt(header), "  ".join("-" * w for w in widths)] + [fmt(r) for r in rows]
    return "\n".join(lines)


def format_header(report):
    m = report["machine"]
    sym = _symbols()
    peaks = m["peaks"]
    lines = [
        f"fastattn {m.get('fastattn', '?')} bench {sym['dash']} {m['cpu']}, {m['cpus']} CPUs, "
        f"{m['platform']}",
        f"Python {m['python']}, NumPy {m['numpy']}, torch {m.get('torch') or 'not installed'}; "
        f"SIMD variant: {m.get('isa', 'unknown')}",
    ]
    th = m["threads"]
    lines.append(f"threads: fastattn {th['fastattn']}, torch {th.get('torch', sym['dash'])}, "
                 f"BLAS {th['blas']}")
    parts = []
    if "sgemm_gflops" in peaks:
        parts.append(f"sgemm {peaks['sgemm_gflops']:.1f} GFLOP/s")
    if "dgemm_gflops" in peaks:
        parts.append(f"dgemm {peaks['dgemm_gflops']:.1f} GFLOP/s")
    if "read_gbs" in peaks:
        parts.append(f"read bandwidth {peaks['read_gbs']:.1f} GB/s (sgemv)")
    bg = m.get("other_cpu_load_during_peaks")
    lines.append("measured peaks: " + (", ".join(parts) or "none")
                 + (f" (bg load {100 * bg:.0f}%)" if bg is not None else ""))
    if m["env"]:
        lines.append("environment: " + " ".join(f"{k}={v}" for k, v in m["env"].items()))
    s = report["settings"]
    lines.append(
        f"method: median of {s['repeat']} batches per library (reference: at most"
        f" {s['reference_repeat_max']}, 1 if a call takes > 2 s);\n        libraries alternate"
        f" with a {int(PAUSE_S * 1000)} ms pause before each batch (longer until spinning"
        f" BLAS/OpenMP workers sleep),\n        then one untimed call; fastattn writes into out="
        + ("; --quick" if s["quick"] else ""))
    lines.append("columns: % peak = of measured sgemm (dgemm for float64), of read bandwidth"
                 " for decode;\n         bg load = CPU share used by other processes meanwhile")
    return "\n".join(lines)


def machine_info(fa, torch):
    try:
        from . import info as info_mod
        build = info_mod.collect(fa)
    except Exception as exc:  # info is best effort; the benchmark must still run
        build = {"error": f"{type(exc).__name__}: {exc}"}
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    env_names = ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE", "OPENBLAS_NUM_THREADS",
                 "OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "MKL_NUM_THREADS")
    return {
        "fastattn": getattr(fa, "__version__", "unknown"),
        "isa": build.get("isa", "unknown"),
        "build": build,
        "cpu": cpu,
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "torch": getattr(torch, "__version__", None) if torch is not None else None,
        "env": {k: os.environ[k] for k in env_names if k in os.environ},
    }


def _json_safe(x):
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json_safe(v) for v in x]
    if isinstance(x, np.generic):
        return _json_safe(x.item())
    return x


def _speedup_ticks(lo, hi):
    """1-2-5 ticks (0.5, 1, 2, 5, 10, 20, ...) covering [lo, hi] on a log axis."""
    ticks = []
    for e in range(math.floor(math.log10(lo)) - 1, math.ceil(math.log10(hi)) + 1):
        ticks += [m * 10.0 ** e for m in (1, 2, 5)]
    inside = [t for t in ticks if lo <= t <= hi]
    below = [t for t in ticks if t < lo]
    above = [t for t in ticks if t > hi]
    # One tick beyond the data on each side, so every bar ends between two labels.
    return (below[-1:] + inside + above[:1]) or [1.0]


def _times_label(x):
    return f"{x:g}{_symbols()['x']}"


def plot_figure(report, plt):
    """The bench's figure: time per call (log) and fastattn's speed-ups (log, 1-2-5 ticks).

    The title names only the libraries that ran; a library skipped on a shape (the
    reference with ``--quick``) is marked where its bar would be; "% peak" is written over
    fastattn's bars, flagged "*" over 100% (``PEAK_NOTE``); the background-load warning,
    when there is one, is printed on the figure.
    """
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

    sym = _symbols()
    results = report["results"]
    names = [r["name"] for r in results]
    libs = ("fastattn", "torch", "reference")
    colors = {"fastattn": "#1f77b4", "torch": "#ff7f0e", "reference": "#7f7f7f"}
    ran = [lib for lib in libs
           if any("median_s" in r["libraries"].get(lib, {}) for r in results)]
    others = [lib for lib in ("torch", "reference") if lib in ran]
    x = np.arange(len(names))
    fig, (ax_t, ax_s) = plt.subplots(2, 1, figsize=(max(8, 1.2 * len(names)), 8.5),
                                     sharex=True)
    width = 0.27

    def offset(lib, group):
        # Bars of the libraries that ran, centred on the shape's tick.
        return (group.index(lib) - (len(group) - 1) / 2) * width

    peaks = report["machine"]["peaks"]
    all_times = []
    for lib in ran:
        times = np.array([r["libraries"].get(lib, {}).get("median_s", np.nan) * 1e3
                          for r in results])
        all_times += [t for t in times if np.isfinite(t)]
        bars = ax_t.bar(x + offset(lib, ran), times, width, label=lib, color=colors[lib])
        if lib == "fastattn":
            for bar, r in zip(bars, results):
                frac = peak_fraction(r, peaks)
                if frac is not None and np.isfinite(bar.get_height()):
                    ax_t.annotate(format_peak(frac), (bar.get_x() + width / 2,
                                  bar.get_height()), xytext=(0, 2),
                                  textcoords="offset points", ha="center", va="bottom",
                                  fontsize=7, color="#c00000" if frac > 1 else "black")
    ax_t.set_yscale("log")
    ax_t.set_ylabel("time per call (ms, log)")
    ax_t.legend(loc="lower left", bbox_to_anchor=(0, 1), ncols=3, frameon=False, fontsize=8)
    machine = report["machine"]
    names_ran = {"fastattn": "fastattn", "torch": "torch", "reference": "NumPy reference"}
    fig.suptitle(" vs ".join(names_ran[lib] for lib in ran)
                 + f" {sym['dash']} {machine['cpu']}, {machine['threads']['fastattn']}"
                 " threads" + (", --quick" if report["settings"].get("quick") else ""),
                 fontsize=11)

    all_sp = []
    for other in others:
        sp = np.array([r.get(f"speedup_vs_{other}", np.nan) for r in results])
        all_sp += [v for v in sp if np.isfinite(v) and v > 0]
        # Bars start at 1x, so a slow-down points down from the line instead of up.
        ax_s.bar(x + offset(other, others), sp - 1.0, width, bottom=1.0,
                 label=f"over {names_ran[other]}", color=colors[other])
    ax_s.axhline(1.0, color="black", linewidth=0.8)
    ax_s.set_yscale("log")
    lo, hi = (min(all_sp), max(all_sp)) if all_sp else (1.0, 1.0)
    ticks = _speedup_ticks(min(lo, 1.0), max(hi, 1.0))
    ax_s.set_ylim(ticks[0], ticks[-1])
    ax_s.yaxis.set_major_locator(FixedLocator(ticks))
    ax_s.yaxis.set_major_formatter(FuncFormatter(lambda v, _pos: _times_label(v)))
    ax_s.yaxis.set_minor_locator(NullLocator())
    ax_s.grid(axis="y", which="major", linewidth=0.4, alpha=0.5)
    ax_s.set_ylabel("fastattn speed-up (log)")
    if all_sp:
        ax_s.legend(loc="lower left", bbox_to_anchor=(0, 1), ncols=2, frameon=False,
                    fontsize=8)

    # Where a library was skipped on a shape, say so at the place of its missing bar.
    for j, r in enumerate(results):
        for lib in ran:
            entry = r["libraries"].get(lib, {})
            if "median_s" in entry:
                continue
            why = "skipped\n(--quick)" if "--quick" in entry.get("skipped", "") else \
                ("error" if "error" in entry else "skipped")
            bottom = ax_t.get_ylim()[0]
            ax_t.text(x[j] + offset(lib, ran), bottom * 1.15, why, rotation=90, ha="center",
                      va="bottom", fontsize=7, color=colors[lib])
            if lib != "fastattn":
                ax_s.text(x[j] + offset(lib, others), ticks[0] * 1.1, why, rotation=90,
                          ha="center", va="bottom", fontsize=7, color=colors[lib])
    ax_s.set_xticks(x)
    ax_s.set_xticklabels(names, rotation=30, ha="right")

    notes = ["Over the fastattn bars: % of the measured peak (sgemm, dgemm for float64, "
             "read bandwidth for decode shapes)."]
    if peak_flagged(report):
        notes.append(PEAK_NOTE)
    warning = load_warning(report)
    if warning:
        notes.append(warning)
    wrap = max(60, int(fig.get_figwidth() * 17))
    lines = [textwrap.wrap(note, wrap) for note in notes]
    height = 0.018 * sum(len(ln) for ln in lines) + 0.01
    fig.tight_layout(rect=(0, height, 1, 1))
    y = height - 0.005
    for note, ln in zip(notes, lines):
        fig.text(0.01, y, "\n".join(ln), fontsize=7.5, va="top",
                 color="#c00000" if note is warning else "black")
        y -= 0.018 * len(ln)
    return fig


def write_plot(report, path):
    """Save :func:`plot_figure` as ``path``. Returns an error message or None."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: no plot written (pip install matplotlib)"
    fig = plot_figure(report, plt)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


# --------------------------------------------------------------------------- CLI

def add_arguments(parser):
    parser.add_argument("--quick", action="store_true",
                        help="fewer repeats, shorter batches; skip the reference on "
                             + ", ".join(sorted(QUICK_SKIP_REFERENCE)))
    parser.add_argument("--json", metavar="FILE", help="write all numbers and machine info")
    parser.add_argument("--plot", metavar="FILE.png", help="bar chart (needs matplotlib)")
    parser.add_argument("--shapes", metavar="NAME,...",
                        help="comma-separated subset of: " + ", ".join(SHAPES_BY_NAME))
    parser.add_argument("--repeat", type=int, metavar="N",
                        help="timed batches per library (default 7, 3 with --quick)")
    parser.add_argument("--variants", action="store_true",
                        help="only the variants table: softcap, ALiBi, sinks and packed "
                             "sequences against the same calls without them and against "
                             "torch (a full run prints it after the shapes)")
    parser.add_argument("--contention", action="store_true",
                        help="instead of the shapes: time fastattn with the cores shared "
                             "(next to NumPy's BLAS, a second process, a busy neighbour)")
    parser.add_argument("--threads", type=int, metavar="N",
                        help="threads for fastattn, torch and BLAS (default: fastattn's "
                             "default, which honours OMP_NUM_THREADS)")
    return parser


def _parse_shapes(text):
    if not text:
        return list(SHAPES)
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in SHAPES_BY_NAME]
    if unknown or not names:
        raise ValueError(f"unknown shape(s) {', '.join(unknown) or '(none given)'}; "
                         f"choose from {', '.join(SHAPES_BY_NAME)}")
    return [SHAPES_BY_NAME[n] for n in names]


def run(args, stdout=None, stderr=None):
    """Run the benchmark for parsed ``args``; return the exit status."""
    stdout = stdout or sys.stdout
    stderr = stderr or sys.stderr
    try:
        shapes = _parse_shapes(args.shapes)
    except ValueError as exc:
        print(f"fastattn bench: error: {exc}", file=stderr)
        return EXIT_USAGE
    runnable = []
    for shape in shapes:
        try:
            shape.np_dtype()
            runnable.append(shape)
        except TypeError as exc:   # bfloat16 without ml_dtypes
            print(f"fastattn bench: skipping {shape.name}: {exc}", file=stderr)
    shapes = runnable
    if args.repeat is not None and args.repeat < 1:
        print("fastattn bench: error: --repeat must be >= 1", file=stderr)
        return EXIT_USAGE
    if args.threads is not None and args.threads < 1:
        print("fastattn bench: error: --threads must be >= 1", file=stderr)
        return EXIT_USAGE
    repeat = args.repeat or (3 if args.quick else 7)
    if getattr(args, "variants", False):
        from . import bench_variants
        return bench_variants.run(args, stdout)
    if getattr(args, "contention", False):
        return run_contention(args, stdout)

    try:
        import fastattn as fa
        from fastattn import reference as ref_mod
    except Exception as exc:
        print(f"fastattn bench: cannot import fastattn ({type(exc).__name__}: {exc}); "
              "is the extension built?", file=stderr)
        return EXIT_ENVIRONMENT
    torch = _import_torch()
    threads = args.threads or fa.get_num_threads()

    with contextlib.ExitStack() as stack:
        stack.enter_context(fa.num_threads(threads))
        blas_desc = stack.enter_context(blas_threads(threads))
        if torch is not None:
            old_torch_threads = torch.get_num_threads()
            torch.set_num_threads(threads)
            stack.callback(torch.set_num_threads, old_torch_threads)

        machine = machine_info(fa, torch)
        machine["threads"] = {"fastattn": fa.get_num_threads(), "blas": blas_desc}
        if torch is not None:
            machine["threads"]["torch"] = torch.get_num_threads()
        peak_repeat = 3 if args.quick else 5
        peak_load = OtherLoad()
        peaks = {"sgemm_gflops": measure_matmul_peak(np.float32, peak_repeat)}
        if any(s.dtype == "float64" for s in shapes):
            peaks["dgemm_gflops"] = measure_matmul_peak(np.float64, peak_repeat)
        if any(s.decode for s in shapes):
            peaks["read_gbs"] = measure_read_bandwidth(peak_repeat, 256 if args.quick else 512)
        machine["peaks"] = peaks
        busy = peak_load.fraction()
        if busy is not None:
            machine["other_cpu_load_during_peaks"] = busy[0] + busy[1]
        report = {
            "machine": machine,
            "settings": {"repeat": repeat, "reference_repeat_max": min(repeat, 3),
                         "quick": bool(args.quick), "pause_s": PAUSE_S, "seed": SEED,
                         "fastattn_out_preallocated": True},
            "results": [],
        }
        print(format_header(report), file=stdout, flush=True)
        for shape in shapes:
            print(f"  ... {shape.name}", file=stderr, flush=True)
            report["results"].append(bench_shape(
                shape, fa=fa, ref_mod=ref_mod, torch=torch, repeat=repeat,
                quick=args.quick))
    print(file=stdout)
    print(format_table(report), file=stdout, flush=True)
    half = format_half_table(report)
    if half:
        print(file=stdout)
        print(half, file=stdout, flush=True)
    if not args.shapes:
        from . import bench_variants
        print(file=stdout)
        bench_variants.run(args, stdout)
    if peak_flagged(report):
        print(PEAK_NOTE, file=stdout)
    warning = load_warning(report)
    if warning:
        print(warning, file=stdout)

    status = EXIT_OK
    failed = [r["name"] for r in report["results"] if not r["check"].get("ok")]
    errors = [f"{r['name']}/{lib}: {o['error']}" for r in report["results"]
              for lib, o in r["libraries"].items() if "error" in o]
    for e in errors:
        print(f"fastattn bench: error: {e}", file=stderr)
    if failed:
        print(f"fastattn bench: correctness check FAILED on: {', '.join(failed)}", file=stderr)
        status = EXIT_CHECK_FAILED
    if args.json:
        with open(args.json, "w") as f:
            json.dump(_json_safe(report), f, indent=2, allow_nan=False)
            f.write("\n")
        print(f"wrote {args.json}", file=stdout)
    if args.plot:
        problem = write_plot(report, args.plot)
        if problem:
            print(f"fastattn bench: {problem}", file=stderr)
            status = status or EXIT_ENVIRONMENT
        else:
            print(f"wrote {args.plot}", file=stdout)
    return status


def run_contention(args, stdout):
    """``--contention``: the shared-core scenarios of fastattn.contention, as a table."""
    from . import contention
    import fastattn as fa

    threads = args.threads or fa.get_num_threads()
    seconds = 1.0 if args.quick else contention.WINDOW_S
    print(f"fastattn {fa.__version__} bench --contention {_symbols()['dash']} {os.cpu_count()}"
          f" CPUs; {threads} threads for fastattn and BLAS; mean per call over {seconds:g} s",
          file=stdout, flush=True)
    results = contention.run_scenarios(threads=threads, seconds=seconds)
    print(file=stdout)
    print(contention.format_table(results), file=stdout)
    print("ratio = shared / fair share; fastattn aims for 1.5 or less", file=stdout)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(_json_safe({"threads": threads, "window_s": seconds,
                                  "scenarios": results}), f, indent=2, allow_nan=False)
            f.write("\n")
        print(f"wrote {args.json}", file=stdout)
    return EXIT_OK


def main(argv=None):
    import argparse
    parser = add_arguments(argparse.ArgumentParser(
        prog="python -m fastattn bench", description=__doc__.split("\n\n")[0]))
    return run(parser.parse_args(argv))
