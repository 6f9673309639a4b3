"""What every command shares: the exit statuses, the text table, units and matplotlib."""

from __future__ import annotations

import sys
import textwrap

OK = 0
FAILED = 1        # a benchmark's correctness check failed or fastattn raised; or stdout closed
USAGE = 2         # bad command line (argparse's own status for it too)
ENVIRONMENT = 3   # something the command needs is missing or not what it seems

# What every command can return: main() turns a closed stdout into FAILED, argparse a bad
# command line into USAGE.
GONE = "the reader of the output went away (as with `| head`)"
COMMON_STATUSES = {OK: "success", FAILED: GONE, USAGE: "bad command line"}


def epilog(statuses):
    """The ``--help`` text listing the exit statuses ``{status: meaning}``, in order."""
    lines = ["exit status:"]
    for status, meaning in sorted(statuses.items()):
        wrapped = textwrap.wrap(meaning, 82)
        lines.append(f"  {status}  {wrapped[0]}")
        lines += ["     " + w for w in wrapped[1:]]
    return "\n".join(lines) + "\n"


# The top-level parser's: every command's statuses together.
EPILOG = epilog({
    **COMMON_STATUSES,
    FAILED: f"a benchmark's correctness check failed or fastattn raised an error (bench), "
            f"or {GONE}",
    ENVIRONMENT: "the environment: fastattn cannot be imported, the imported fastattn is not "
                 "the installed one (info), or --plot without matplotlib (checked before "
                 "anything runs)",
})


def symbols():
    """µ, × and Δ when the terminal can print them, ASCII otherwise."""
    enc = getattr(sys.stdout, "encoding", None) or "ascii"
    try:
        "µ×Δ—".encode(enc)
    except (UnicodeEncodeError, LookupError):
        return {"mu": "u", "x": "x", "delta": "d", "dash": "-"}
    return {"mu": "µ", "x": "×", "delta": "Δ", "dash": "—"}


def format_time(seconds, sym=None):
    """``2.5 µs``, ``12.30 ms`` or ``12.0 s``."""
    sym = sym or symbols()
    if seconds < 1e-3:
        return f"{seconds * 1e6:.1f} {sym['mu']}s"
    if seconds < 10:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds:.1f} s"


def format_table(header, rows, align="l"):
    """Columns two spaces apart under a dashed rule. ``align`` gives the first columns'
    alignment, "l" or "r" each (names left); the columns after them (numbers) align right."""
    rows = [[str(c) for c in row] for row in rows]
    header = [str(c) for c in header]
    widths = [max(len(c) for c in col) for col in zip(header, *rows)]
    align = align.ljust(len(widths), "r")

    def line(row):
        return "  ".join(c.ljust(w) if a == "l" else c.rjust(w)
                         for c, w, a in zip(row, widths, align)).rstrip()
    return "\n".join([line(header), "  ".join("-" * w for w in widths)]
                     + [line(row) for row in rows])


def pyplot(command, stderr=None):
    """matplotlib.pyplot on the file-only backend, or None after telling ``stderr`` how to
    install it. Commands call this before any work, so a missing matplotlib costs nothing."""
    try:
        import matplotlib
        matplotlib.use("Agg")      # files only; never needs a display
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"fastattn {command}: --plot needs matplotlib, which is not installed; nothing "
              "was run.\nInstall it with:  pip install matplotlib   (or run without --plot)",
              file=stderr or sys.stderr)
        return None
    return plt
