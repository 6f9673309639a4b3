"""What the bench compares fastattn's throughput with: this machine, measured on the spot.

The yardsticks are the best GFLOP/s of a few 2048 x 2048 NumPy matrix products (sgemm,
and dgemm for float64 shapes) and, for the bandwidth-bound decode shapes, the read
bandwidth of a matrix-vector product (sgemv) streaming a buffer larger than the
last-level cache, all on the bench's thread count. They are what NumPy's OpenBLAS reaches
(its kernels are picked by CPU), not the hardware's theoretical limits.
"""

from __future__ import annotations

import functools
import os
import platform

import numpy as np

from .harness import OtherLoad, timed_batch, warm_up


def measure_matmul_peak(dtype, repeat=5, n=2048):
    """Best GFLOP/s of an n x n NumPy matrix product (OpenBLAS sgemm/dgemm).

    A peak is what the machine *can* do: interference from other processes only ever
    lowers a sample, so the best of a few is the estimate least biased by a busy machine
    (a low peak would flatter every percentage of it).
    """
    rng = np.random.default_rng(0)
    a = rng.standard_normal((n, n)).astype(dtype)
    b = rng.standard_normal((n, n)).astype(dtype)
    c = np.empty((n, n), dtype)
    call = functools.partial(np.matmul, a, b, out=c)
    warm_up(call)
    samples = [timed_batch(call, 1) for _ in range(repeat)]
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
    warm_up(call)
    samples = [timed_batch(call, 1) for _ in range(repeat)]
    return a.nbytes / min(samples) / 1e9


def measure_peaks(shapes, quick):
    """The yardsticks the shapes need, and the other processes' CPU share meanwhile."""
    repeat = 3 if quick else 5
    load = OtherLoad()
    peaks = {"sgemm_gflops": measure_matmul_peak(np.float32, repeat)}
    if any(s.dtype == "float64" for s in shapes):
        peaks["dgemm_gflops"] = measure_matmul_peak(np.float64, repeat)
    if any(s.decode for s in shapes):
        peaks["read_gbs"] = measure_read_bandwidth(repeat, 256 if quick else 512)
    busy = load.fraction()
    return peaks, (busy[0] + busy[1] if busy is not None else None)


def cpu_name():
    """The CPU's model name (/proc/cpuinfo), else what platform knows."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return cpu


#: How torch is held to one instruction set, beside FASTATTN_ISA (``bench --isa``):
#: ATen's kernels, MKL's and oneDNN's, each through its own variable, read at import.
TORCH_ISA = {
    "avx512": {"ATEN_CPU_CAPABILITY": "avx512", "MKL_ENABLE_INSTRUCTIONS": "AVX512",
               "ONEDNN_MAX_CPU_ISA": "AVX512_CORE"},
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2",
             "ONEDNN_MAX_CPU_ISA": "AVX2"},
    "base": {"ATEN_CPU_CAPABILITY": "default", "MKL_ENABLE_INSTRUCTIONS": "SSE4_2",
             "ONEDNN_MAX_CPU_ISA": "SSE41"},
}


def isa_environment(isa):
    """The variables that run fastattn's ``isa`` kernels and hold torch to the same
    instruction set."""
    return {"FASTATTN_ISA": isa, **TORCH_ISA[isa]}


ENV_NAMES = ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE", "OPENBLAS_NUM_THREADS",
             "OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "MKL_NUM_THREADS",
             "FASTATTN_BF16_DOT", "FASTATTN_AMX", "FASTATTN_ISA", *TORCH_ISA["avx2"])


def machine_info(fa, torch):
    """The machine, the versions and the build, for the report's header."""
    from .. import info as info_mod
    try:
        build = info_mod.collect(fa)
    except Exception as exc:  # info is best effort; the benchmark must still run
        build = {"error": f"{type(exc).__name__}: {exc}"}
    return {
        "fastattn": getattr(fa, "__version__", "unknown"),
        "isa": build.get("isa", "unknown"),
        "build": build,
        "cpu": cpu_name(),
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "torch": getattr(torch, "__version__", None) if torch is not None else None,
        "env": {k: os.environ[k] for k in ENV_NAMES if k in os.environ},
    }
