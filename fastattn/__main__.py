"""Command line: ``python -m fastattn {bench,info,demo}``.

Exit status: 0 success; 1 a benchmark correctness check failed (or fastattn raised), or
the reader of the output went away (``| head``); 2 bad command line; 3 an environment
problem (fastattn not importable, matplotlib missing for ``--plot``). ``demo`` returns
whatever ``fastattn.demo.main`` returns.

The subcommand modules are imported only when chosen, so ``info`` stays cheap and ``demo``
does not pay for the benchmark's imports.
"""

from __future__ import annotations

import argparse
import os
import sys

EXIT_USAGE = 2


def _parser():
    from . import bench, info

    # Installed as the `fastattn` console script too; name whichever the user typed.
    script = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    prog = "python -m fastattn" if script in ("", "__main__.py", "-c") else script
    parser = argparse.ArgumentParser(
        prog=prog,
        description="fastattn: fused scaled-dot-product attention for NumPy.")
    sub = parser.add_subparsers(dest="command", metavar="{bench,info,demo}")
    bench.add_arguments(sub.add_parser(
        "bench", help="time fastattn against the NumPy reference and PyTorch",
        description=bench.__doc__.split("\n\n")[0]))
    info.add_arguments(sub.add_parser(
        "info", help="version, compiler, SIMD variant, threads",
        description=info.__doc__.split("\n\n")[0]))
    # demo parses its own arguments (fastattn.demo.main); listed here for --help only.
    sub.add_parser("demo", help="classic self-attention examples with their attention weights",
                   add_help=False)
    return parser


def main(argv=None):
    """Run the command line; return the exit status."""
    try:
        status = _main(argv)
        # Output still in the buffer is written here, so that a reader that has gone away
        # raises below and not in the interpreter's shutdown.
        sys.stdout.flush()
    except BrokenPipeError:
        # `python -m fastattn info | head -3`: the reader closed the pipe. As Python's
        # documentation recommends for SIGPIPE, point stdout at devnull so the flush at exit
        # cannot fail again, and exit quietly with status 1.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1
    return status


def _main(argv):
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "demo":
        from . import demo
        status = demo.main(argv[1:])
        return 0 if status is None else status
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command == "bench":
        from . import bench
        return bench.run(args)
    if args.command == "info":
        from . import info
        return info.run(args)
    parser.print_help(sys.stderr)
    return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
