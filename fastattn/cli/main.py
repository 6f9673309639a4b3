"""The command line's one parser: ``python -m fastattn {bench,info,demo}`` and the
``fastattn`` console script. The exit statuses are in :mod:`.common` and in ``--help``."""

from __future__ import annotations

import argparse
import os
import sys

from . import bench, demo, info
from .common import EPILOG, FAILED, USAGE, epilog

COMMANDS = {"bench": bench, "info": info, "demo": demo}


def _prog():
    # Installed as the `fastattn` console script too; name whichever the user typed.
    script = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    return "python -m fastattn" if script in ("", "__main__.py", "-c") else script


def build_parser():
    """The argparse tree: one subparser per command, each with the exit statuses."""
    raw = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(
        prog=_prog(), description="fastattn: fused scaled-dot-product attention for NumPy.",
        epilog=EPILOG, formatter_class=raw)
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="{" + ",".join(COMMANDS) + "}")
    for name, module in COMMANDS.items():
        module.add_arguments(sub.add_parser(
            name, help=module.HELP,
            description=module.__doc__.split("\n\n")[0].replace("``", ""),
            epilog=epilog(module.EXIT_STATUSES), formatter_class=raw))
    return parser


def _version():
    """fastattn's version, or why there is none (the command line runs without it)."""
    try:
        import fastattn
    except ImportError as exc:
        return f"(fastattn cannot be imported: {exc})"
    # a folder named fastattn on sys.path (a namespace package) has no version
    return getattr(fastattn, "__version__", "(unknown: fastattn is not the package here)")


def _run(argv):
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:        # --help (0) or a usage error (2): a status, not a raise
        return int(exc.code or 0)
    if args.command is None:
        parser.print_help(sys.stderr)
        return USAGE
    args.argv = argv                 # the command line as given (bench --isa reruns it)
    return COMMANDS[args.command].run(args)


def main(argv=None):
    """Run the command line on ``argv`` (default: ``sys.argv[1:]``); return the exit status."""
    try:
        status = _run(sys.argv[1:] if argv is None else list(argv))
        # Output still in the buffer is written here, so that a reader that has gone away
        # raises below and not in the interpreter's shutdown.
        sys.stdout.flush()
    except BrokenPipeError:
        # `python -m fastattn info | head -3`: the reader closed the pipe. As Python's
        # documentation recommends for SIGPIPE, point stdout at devnull so the flush at exit
        # cannot fail again, and exit quietly.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return FAILED
    return status
