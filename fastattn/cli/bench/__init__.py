"""``python -m fastattn bench``: time fastattn against the NumPy reference and PyTorch.

The modules, each a step of a run:

- ``shapes``     the shapes (batch 1; float32, one float64 shape and four with float16 or
                 bfloat16 q, k and v) and the backward table's, their FLOPs and bytes,
                 inputs and tolerances;
- ``harness``    the one way anything is timed (warm-up, alternating batches, each after
                 a pause and a wake-up call, medians), the thread hold, the load probe;
- ``machine``    the yardsticks measured at start-up (sgemm, dgemm, sgemv read bandwidth)
                 and the machine's description;
- ``measure``    one shape: fastattn, the float64 NumPy reference and torch, timed and
                 checked against each other;
- ``backward``   one shape's backward pass: fastattn and torch timed, both checked
                 against the float64 oracle (``--backward``);
- ``session``    a run of the shapes (or backward) table, from the thread hold to the
                 exit status;
- ``report``     the tables and notes; ``plot`` the figure;
- ``variants``   softcap, ALiBi, sinks and packed sequences against the same calls without
                 them (after a full run, or alone with ``--variants``);
- ``contention`` fastattn on cores shared with BLAS, a second process, a busy neighbour.
"""

from __future__ import annotations

import sys

from ..common import COMMON_STATUSES, ENVIRONMENT, FAILED, GONE, USAGE, pyplot
from .backward import ORACLE_MAX_SCORES, QUICK_ORACLE_MAX_SCORES
from .machine import TORCH_ISA, isa_environment
from .shapes import BACKWARD_SHAPES, BACKWARD_SHAPES_BY_NAME, QUICK_SKIP_REFERENCE, SHAPES, \
    SHAPES_BY_NAME, parse_shapes

HELP = "time fastattn against the NumPy reference (float64) and PyTorch"
EXIT_STATUSES = {**COMMON_STATUSES,
                 FAILED: f"a correctness check failed or fastattn raised an error, or {GONE}",
                 ENVIRONMENT: "fastattn cannot be imported, or --plot without matplotlib "
                              "(checked before anything runs)"}


def add_arguments(parser):
    parser.add_argument("--quick", action="store_true",
                        help="fewer repeats, shorter batches; skip the reference on "
                             + ", ".join(sorted(QUICK_SKIP_REFERENCE)))
    parser.add_argument("--json", metavar="FILE", help="write all numbers and machine info")
    parser.add_argument("--plot", metavar="FILE.png",
                        help="bar chart (needs matplotlib: checked before the run)")
    parser.add_argument("--shapes", metavar="NAME,...",
                        help="comma-separated subset of: " + ", ".join(SHAPES_BY_NAME)
                        + "; with --backward, of: " + ", ".join(BACKWARD_SHAPES_BY_NAME))
    parser.add_argument("--repeat", type=int, metavar="N",
                        help="timed batches per library (default 7, 3 with --quick)")
    table = parser.add_mutually_exclusive_group()
    table.add_argument("--backward", action="store_true",
                       help="instead of the shapes: the backward table, "
                            "fastattn.attention_backward against torch.autograd.grad through "
                            "torch's scaled_dot_product_attention (same dtype), each side's "
                            "gradients against the float64 oracle where Hq*Lq*Lk <= "
                            f"2**{ORACLE_MAX_SCORES.bit_length() - 1} "
                            f"(2**{QUICK_ORACLE_MAX_SCORES.bit_length() - 1} with --quick); "
                            "--json writes its rows, --plot is not drawn")
    table.add_argument("--variants", action="store_true",
                       help="only the variants table: softcap, ALiBi, sinks and packed "
                            "sequences against the same calls without them and against "
                            "torch (a full run prints it after the shapes)")
    table.add_argument("--contention", action="store_true",
                       help="instead of the shapes: time fastattn with the cores shared "
                            "(next to NumPy's BLAS, a second process, a busy neighbour)")
    parser.add_argument("--threads", type=int, metavar="N",
                        help="threads for fastattn, torch and BLAS (default: fastattn's "
                             "default, which honours OMP_NUM_THREADS)")
    parser.add_argument("--isa", choices=sorted(TORCH_ISA),
                        help="both sides on one instruction set: fastattn's kernels of that "
                             "name (FASTATTN_ISA) and torch held to it (ATEN_CPU_CAPABILITY, "
                             "MKL_ENABLE_INSTRUCTIONS, ONEDNN_MAX_CPU_ISA), in a fresh "
                             "process; the first line says so")
    return parser


def _rerun_on_isa(args, stdout, stderr):
    """The run in a child process whose environment holds both sides to ``args.isa``;
    its exit status.  Its output is passed through as it comes."""
    import os
    import subprocess
    env = isa_environment(args.isa)
    print(f"--isa {args.isa}: " + " ".join(f"{k}={v}" for k, v in env.items())
          + " (fastattn's kernels, and torch held to the same instruction set)", file=stdout)
    argv, given = [], list(args.argv)
    while given:
        a = given.pop(0)
        if a == "--isa":
            given.pop(0)
        elif not a.startswith("--isa="):
            argv.append(a)
    child = subprocess.Popen([sys.executable, "-m", "fastattn", *argv],
                             env=dict(os.environ, **env), stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    for line in child.stdout:
        stdout.write(line)
        stdout.flush()
    stderr.write(child.stderr.read())
    return child.wait()


def _runnable_shapes(args, stderr):
    """The shapes to run, or None after a usage error."""
    try:
        shapes = parse_shapes(args.shapes,
                              BACKWARD_SHAPES if args.backward else SHAPES)
    except ValueError as exc:
        print(f"fastattn bench: error: {exc}", file=stderr)
        return None
    for option in ("repeat", "threads"):
        if getattr(args, option) is not None and getattr(args, option) < 1:
            print(f"fastattn bench: error: --{option} must be >= 1", file=stderr)
            return None
    runnable = []
    for shape in shapes:
        try:
            shape.np_dtype()
            runnable.append(shape)
        except TypeError as exc:   # bfloat16 without ml_dtypes
            print(f"fastattn bench: skipping {shape.name}: {exc}", file=stderr)
    return runnable


def run(args, stdout=None, stderr=None):
    """Run the benchmark for parsed ``args``; return the exit status."""
    stdout = stdout or sys.stdout
    stderr = stderr or sys.stderr
    shapes = _runnable_shapes(args, stderr)
    if shapes is None:
        return USAGE
    if getattr(args, "isa", None):
        return _rerun_on_isa(args, stdout, stderr)
    plt = None
    if args.plot and not (args.variants or args.contention or args.backward):
        plt = pyplot("bench", stderr)
        if plt is None:
            return ENVIRONMENT
    try:
        import fastattn as fa
    except Exception as exc:
        print(f"fastattn bench: cannot import fastattn ({type(exc).__name__}: {exc}); "
              "is the extension built?", file=stderr)
        return ENVIRONMENT
    threads = args.threads or fa.get_num_threads()
    repeat = args.repeat or (3 if args.quick else 7)
    if args.variants:
        from . import variants
        return variants.run(fa, threads, repeat, stdout)
    if args.contention:
        from . import contention
        return contention.run(fa, threads, args.quick, args.json, stdout)
    from .session import run_shapes
    return run_shapes(fa, shapes, args, threads, repeat, plt, (stdout, stderr))
