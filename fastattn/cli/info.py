"""``python -m fastattn info``: what this installation of fastattn runs on, in a fresh
process (the facts and their wording: ``fastattn._machine.config``, which ``fastattn.show_config()``
prints for a running one)."""

from __future__ import annotations

import json
import sys

from .._machine.config import collect, format_info
from .common import COMMON_STATUSES, ENVIRONMENT, OK

HELP = "version, compiler, SIMD variant, threads, thread pool and precision"
EXIT_STATUSES = {**COMMON_STATUSES,
                 ENVIRONMENT: "fastattn cannot be imported, or the imported fastattn is not "
                              "the installed one"}


def add_arguments(parser):
    parser.add_argument("--json", action="store_true", help="print the facts as JSON")
    return parser


def run(args, stdout=None):
    """Print the facts; exit status 0, or 3 when fastattn cannot be imported or the
    imported fastattn is not the installed one."""
    stdout = stdout or sys.stdout
    info = collect()
    if getattr(args, "json", False):
        print(json.dumps(info, indent=2), file=stdout)
    else:
        print(format_info(info), file=stdout)
    return ENVIRONMENT if "problems" in info else OK
