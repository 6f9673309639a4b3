"""``python -m fastattn info``: what this installation of fastattn runs on.

Prints the package version, Python and NumPy versions, the compiler and OpenMP support of
the compiled kernel, the thread count and the thread pool that runs the kernels, and the
SIMD variant chosen at import time (see ``fastattn._dispatch``) with the variants this CPU
could run. Every fact is looked up defensively and shown as "unknown" when it cannot be
found, so that ``info`` keeps working -- and stays useful for bug reports -- on a partial
or unusual build.
"""

from __future__ import annotations

import importlib
import json
import platform
import sys

import numpy as np

__all__ = ["collect", "format_info", "add_arguments", "run", "main"]

UNKNOWN = "unknown"


def _kernel_module(dispatch):
    """The compiled kernel module that ``_dispatch`` selected, or None."""
    for attr in ("kernel", "_kernel", "KERNEL", "module", "_module"):
        mod = getattr(dispatch, attr, None)
        if mod is not None and hasattr(mod, "build_info"):
            return mod
    isa = getattr(dispatch, "ISA", None)
    if isinstance(isa, str):
        # The variants are built as fastattn._kernel_<isa> (src/_kernel_<isa>.pyx).
        for name in (f"fastattn._kernel_{isa}", "fastattn._kernel"):
            try:
                mod = importlib.import_module(name)
            except ImportError:
                continue
            if hasattr(mod, "build_info"):
                return mod
    return None


def collect(fa=None):
    """Return a dict of facts about this fastattn installation (JSON-serialisable)."""
    info = {
        "version": UNKNOWN, "python": platform.python_version(),
        "python_implementation": platform.python_implementation(),
        "numpy": np.__version__, "platform": platform.platform(),
        "machine": platform.machine(), "compiler": UNKNOWN, "openmp": UNKNOWN,
        "threads": UNKNOWN, "isa": UNKNOWN, "available_variants": UNKNOWN,
    }
    if fa is None:
        try:
            import fastattn as fa
        except Exception as exc:  # e.g. the extension is not built
            info["import_error"] = f"{type(exc).__name__}: {exc}"
            return info
    info["version"] = getattr(fa, "__version__", UNKNOWN)
    try:
        info["threads"] = int(fa.get_num_threads())
    except Exception:
        pass
    try:
        from fastattn import _dispatch
    except Exception as exc:
        info["dispatch_error"] = f"{type(exc).__name__}: {exc}"
        return info
    isa = getattr(_dispatch, "ISA", None)
    if isa is not None:
        info["isa"] = str(isa)
    variants = getattr(_dispatch, "available_variants", None)
    if callable(variants):
        try:
            info["available_variants"] = [str(v) for v in variants()]
        except Exception:
            pass
    kernel = _kernel_module(_dispatch)
    if kernel is not None:
        info["kernel_module"] = kernel.__name__
        try:
            build = dict(kernel.build_info())
        except Exception as exc:
            info["build_info_error"] = f"{type(exc).__name__}: {exc}"
        else:
            info["compiler"] = str(build.pop("compiler", UNKNOWN))
            if "openmp" in build:
                info["openmp"] = bool(build.pop("openmp"))
            if info["isa"] == UNKNOWN and "isa" in build:
                info["isa"] = str(build.pop("isa"))
            else:
                build.pop("isa", None)
            try:
                info["thread_pool"] = str(kernel.pool_info()["backend"])
            except Exception:
                pass
            # Remaining facts (vector width, block sizes, ...) are shown as they come.
            info["build"] = {k: (v if isinstance(v, (bool, int, float, str)) else str(v))
                             for k, v in build.items()}
    return info


def format_info(info):
    def show(v):
        if isinstance(v, bool):
            return "yes" if v else "no"
        if isinstance(v, list):
            return ", ".join(v) if v else "none"
        return str(v)

    rows = [
        ("fastattn", info["version"]),
        ("Python", f"{info['python']} ({info['python_implementation']})"),
        ("NumPy", info["numpy"]),
        ("platform", info["platform"]),
        ("compiler", info["compiler"]),
        ("OpenMP", info["openmp"]),
        ("threads", info["threads"]),
        ("thread pool", info.get("thread_pool", UNKNOWN)),
        ("SIMD variant", info["isa"]),
        ("variants this CPU runs", info["available_variants"]),
    ]
    rows += [(k.replace("_", " "), v) for k, v in info.get("build", {}).items()]
    rows += [(k.replace("_", " "), info[k]) for k in
             ("kernel_module", "import_error", "dispatch_error", "build_info_error") if k in info]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k + ':':<{width + 1}} {show(v)}" for k, v in rows)


def add_arguments(parser):
    parser.add_argument("--json", action="store_true", help="print the facts as JSON")
    return parser


def run(args, stdout=None):
    """Print the facts; exit status 0, or 3 when fastattn itself cannot be imported."""
    stdout = stdout or sys.stdout
    info = collect()
    if getattr(args, "json", False):
        print(json.dumps(info, indent=2), file=stdout)
    else:
        print(format_info(info), file=stdout)
    return 3 if "import_error" in info else 0


def main(argv=None):
    import argparse
    parser = add_arguments(argparse.ArgumentParser(prog="python -m fastattn info",
                                                   description=__doc__.split("\n\n")[0]))
    return run(parser.parse_args(argv))
