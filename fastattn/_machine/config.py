"""What this fastattn runs on, for ``python -m fastattn info`` and :func:`show_config`.

The facts: the package version, Python and NumPy versions, the compiler of the compiled
kernel, the thread count and the thread pool that runs the kernels (fastattn's own pool of
POSIX threads; OpenMP, when the build has it, supplies the default thread count and runs
the calls that ``FASTATTN_POOL`` sends to the calling thread's OpenMP team), the SIMD
variant chosen at import time (see ``fastattn._machine.isa``) with the variants this CPU could
run, whether bfloat16 products run, and what float32 calls multiply in.  They are read from
the running process, so :func:`show_config` shows its settings (``set_num_threads``,
``set_float32_precision``, the kernel's switches) where ``info`` shows a fresh process's.

Every fact is looked up defensively and shown as "unknown" when it cannot be found, so
that ``info`` keeps working -- and stays useful for bug reports -- on a partial or unusual
build.  When the ``fastattn`` that Python imported is not the installed one (a folder named
``fastattn`` in the current directory comes first on ``sys.path``), a "problem:" line says
which folder hides which.  This module imports only the standard library and NumPy at
import time: the command line reaches it from a package that may be broken.
"""

from __future__ import annotations

import importlib
import os
import platform
import sys
import textwrap

import numpy as np

__all__ = ["show_config"]

UNKNOWN = "unknown"
POOLS = {"pthreads": "fastattn's own pool of POSIX threads",
         "openmp": "OpenMP threads on a dynamic schedule",
         "none": "none: a single-threaded build"}


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


def _package_dir(fa):
    """Folder of the imported fastattn package, or None for a namespace package."""
    path = getattr(fa, "__file__", None)
    return os.path.dirname(os.path.abspath(path)) if path else None


def _installed_dir():
    """(version, folder) of the installed fastattn distribution's package, or None.

    An editable install records no package folder of its own (its files stay in the source
    tree), so it gives None: it cannot be hidden by the tree it points to.
    """
    from importlib import metadata
    try:
        dist = metadata.distribution("fastattn")
    except metadata.PackageNotFoundError:
        return None
    for f in dist.files or ():
        if f.as_posix() == "fastattn/__init__.py":
            path = os.path.abspath(str(dist.locate_file(f)))
            if os.path.isfile(path):
                return dist.version, os.path.dirname(path)
    return None


def shadowing_problems(fa):
    """Sentences that explain why the imported ``fastattn`` is not the installed package.

    Two cases: ``fa`` is a namespace package (a folder named fastattn without
    ``__init__.py``, on ``sys.path`` before or instead of the package), or fastattn is
    installed but Python imported another copy first -- typically a source checkout in the
    current directory, which ``python -m`` puts first on ``sys.path``.
    """
    here = _package_dir(fa)
    if here is None:
        folders = ", ".join(str(p) for p in getattr(fa, "__path__", [])) or "?"
        return [f"'import fastattn' found the folder {folders}, which is not the fastattn "
                "package (it has no __init__.py), so fastattn's functions, version and "
                "thread count are missing. A folder named fastattn in the current directory "
                "or on sys.path hides the package (an editable install, too): run from "
                "another directory, or rename that folder."]
    installed = _installed_dir()
    if installed is None:
        return []
    version, there = installed
    if os.path.samefile(here, there):
        return []
    return [f"fastattn is imported from {here}, but the installed fastattn {version} is in "
            f"{there}: the folder {here} comes first on sys.path (the current directory "
            "does, with 'python -m') and hides it. The version shown is the installed "
            "one's. Run from another directory to use the installed package."]


def collect(fa=None):
    """Return a dict of facts about this fastattn installation (JSON-serialisable).

    ``fa`` is the module ``import fastattn`` gives; by default the package this module was
    imported from, as ``sys.modules`` holds it (not imported here: the package imports this
    module).  It is a namespace module when a folder named fastattn hides the package and an
    editable install's finder supplies the submodules.
    """
    info = {
        "version": UNKNOWN, "python": platform.python_version(),
        "python_implementation": platform.python_implementation(),
        "numpy": np.__version__, "platform": platform.platform(),
        "machine": platform.machine(), "compiler": UNKNOWN, "openmp": UNKNOWN,
        "threads": UNKNOWN, "isa": UNKNOWN, "available_variants": UNKNOWN,
    }
    if fa is None:
        fa = sys.modules[__package__.partition(".")[0]]
    problems = shadowing_problems(fa)
    if problems:
        info["problems"] = problems
    info["version"] = getattr(fa, "__version__", UNKNOWN)
    try:
        info["threads"] = int(fa.get_num_threads())
    except Exception:
        pass
    try:
        from . import threads as _threads
        info["pool_choice"] = str(_threads._pool)
        info["openmp_team"] = str(_threads.pool_team())
    except Exception:
        pass
    try:
        from . import isa as _dispatch
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
        _kernel_facts(kernel, info)
    return info


def _kernel_facts(kernel, info):
    """Add the compiled kernel's build facts and thread pool to ``info``."""
    info["kernel_module"] = kernel.__name__
    try:
        build = dict(kernel.build_info())
    except Exception as exc:
        info["build_info_error"] = f"{type(exc).__name__}: {exc}"
        return
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
    try:
        _precision_facts(info)
    except Exception:
        pass
    try:
        info["amx_tiles"] = _amx_fact(kernel)
    except Exception:
        pass
    # Remaining facts (vector width, block sizes, ...) are shown as they come.
    info["build"] = {k: (v if isinstance(v, (bool, int, float, str)) else str(v))
                     for k, v in build.items()}


TEAMS = {"never": "no call", "always": "every call",
         "in torch": "the torch integrations' calls, on torch's threads"}


def _openmp_role(info):
    """What OpenMP does in this build, in the words the documentation uses."""
    if info["openmp"] is True:
        if info.get("thread_pool") == "openmp":
            return "yes: its threads run the kernels"
        return ("yes: the default thread count (honours OMP_NUM_THREADS) and a team for "
                "some calls (below)")
    if info["openmp"] is False:
        return "no (the default thread count still honours OMP_NUM_THREADS)"
    return UNKNOWN


def _team_role(info):
    """Which calls run on the calling thread's OpenMP team instead of the pool."""
    choice, team = info.get("pool_choice"), info.get("openmp_team")
    if choice is None or team is None:
        return UNKNOWN
    if choice == "auto" and team == "never" and info["openmp"] is True \
            and info.get("thread_pool") == "pthreads":
        return ("none yet (FASTATTN_POOL=auto: the torch integrations' calls, once torch is "
                "imported and uses this OpenMP library)")
    return f"{TEAMS.get(team, team)} (FASTATTN_POOL={choice})"


def _precision_facts(info):
    """Add whether bfloat16 products run, and what float32 calls multiply in now."""
    from .._calls import precision as _precision

    runs, how = _precision.bf16_products()
    state = f"yes ({how})" if runs else f"no ({how}: float32 products)"
    switch = os.environ.get("FASTATTN_BF16_DOT")
    info["bf16_products"] = state + (f"; FASTATTN_BF16_DOT={switch}" if switch is not None
                                     else "")
    info["float32_precision"] = _precision.get_float32_precision()
    info["float32_products"] = _precision.float32_products()
    info["quantised_products"] = _precision.quantised_products()


def _amx_fact(kernel):
    """Whether bfloat16 products run on AMX tiles, and why not."""
    switch = os.environ.get("FASTATTN_AMX")
    env = f"FASTATTN_AMX={switch}" if switch is not None else "FASTATTN_AMX unset"
    mode = kernel.amx()
    if mode != "off" and not kernel.bf16_dot():
        return f"no ({env}, but the bfloat16 products are off)"
    if mode == "hw":
        return f"yes: runs on the hardware ({env})"
    if mode == "model":
        return f"on the scalar model of the tile instructions, for tests ({env})"
    if switch == "1":
        return f"no ({env}, but {kernel.amx_why_not()})"
    why_not = kernel.amx_why_not()
    if why_not is not None:
        return f"no ({why_not})"
    return f"no ({env})"


def format_info(info):
    def show(v):
        if isinstance(v, bool):
            return "yes" if v else "no"
        if isinstance(v, list):
            return ", ".join(v) if v else "none"
        return str(v)

    pool = info.get("thread_pool", UNKNOWN)
    rows = [
        ("fastattn", info["version"]),
        ("Python", f"{info['python']} ({info['python_implementation']})"),
        ("NumPy", info["numpy"]),
        ("platform", info["platform"]),
        ("compiler", info["compiler"]),
        ("threads", info["threads"]),
        ("thread pool", POOLS.get(pool, pool)),
        ("OpenMP", _openmp_role(info)),
        ("OpenMP team runs", _team_role(info)),
        ("SIMD variant", info["isa"]),
        ("variants this CPU runs", info["available_variants"]),
        ("bfloat16 products", info.get("bf16_products", UNKNOWN)),
        ("float32 products", info.get("float32_products", UNKNOWN)),
        ("q8_0/q4_0 products", info.get("quantised_products", UNKNOWN)),
        ("AMX tiles", info.get("amx_tiles", UNKNOWN)),
    ]
    rows += [(k.replace("_", " "), v) for k, v in info.get("build", {}).items()]
    rows += [(k.replace("_", " "), info[k]) for k in
             ("kernel_module", "dispatch_error", "build_info_error") if k in info]
    width = max(len(k) for k, _ in rows)
    lines = [f"{k + ':':<{width + 1}} {show(v)}" for k, v in rows]
    for problem in info.get("problems", []):
        # Paths stay whole, so that they can be copied from the terminal.
        lines.append(textwrap.fill(problem, 88, initial_indent="problem: ",
                                   subsequent_indent="         ", break_long_words=False,
                                   break_on_hyphens=False))
    return "\n".join(lines)


def show_config(file=None):
    """Print what this process's fastattn runs: version, compiler, threads and thread pool,
    kernel variant, whether bfloat16 products run and what float32 calls multiply in now
    (after ``set_num_threads``, ``set_float32_precision`` and the like), as
    ``python -m fastattn info`` prints it for a fresh process.

    Parameters
    ----------
    file : file-like, optional
        Where to print (default: ``sys.stdout``).

    Examples
    --------
    >>> with fastattn.num_threads(1):
    ...     fastattn.show_config()              # doctest: +ELLIPSIS
    fastattn: ...
    threads:                1
    ...
    """
    print(format_info(collect()), file=sys.stdout if file is None else file)
