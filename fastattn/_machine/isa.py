"""Import-time choice of the compiled kernel variant.

setup.py builds the same kernel source once per instruction set (``_kernel_base``: the
portable baseline, plain x86-64 / SSE2 or the platform default; ``_kernel_avx2``: AVX2+FMA;
``_kernel_avx512``: AVX-512 F, BW, DQ and VL, which every AVX-512 CPU since Skylake-SP
and Zen 4 has).  We probe the running CPU with the baseline module (which every CPU can
execute) and import the best variant it supports.  A variant that is missing
from the build, or fails to import, is skipped, so the baseline is always the fallback.

``FASTATTN_ISA=base|avx2|avx512`` forces a variant (e.g. to test the fallback on a new CPU);
forcing one the CPU cannot run raises ImportError rather than crashing later with SIGILL.
tests/test_dispatch.py uses it to check every variant the running CPU supports.
"""
import importlib
import os

from .._calls import args as _args


def _not_built(here):
    """An ImportError that says why the baseline kernel is missing and what to do."""
    return ImportError(
        f"fastattn in {here} has no compiled kernel (no _kernel_base extension module in "
        "that folder). This is a source tree that "
        "has not been built: build it with 'python setup.py build_ext --inplace' or "
        "'pip install .'. If you meant an installed fastattn, this folder hides it (Python "
        "looks in the current directory first): run from another directory.")


try:
    from .. import _kernel_base
except ImportError:
    # A missing extension gets the diagnosis (Python's own message blames a circular
    # import); one that exists but fails to load keeps its own message.
    _here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # the package
    if any(name.startswith("_kernel_base.") and not name.endswith((".pyx", ".pyi", ".c"))
           for name in os.listdir(_here)):
        raise
    raise _not_built(_here) from None

#: Variants in order of preference.  The AVX-512 build runs the same register tiles as the
#: AVX2 build on vectors twice as wide: on compute-bound (prefill) shapes it is expected to
#: do at least as well, and up to twice the work per cycle on CPUs with two 512-bit FMA
#: units; decode steps are bound by memory bandwidth either way.  That is an expectation,
#: not a measurement: the two builds have not been timed against each other, and the
#: AVX-512 build runs only on CPUs that have AVX-512, where tests/test_dispatch.py checks
#: it (and the whole suite runs on it, being the default there).  Where its clock penalty
#: outweighs the wider vectors, FASTATTN_ISA=avx2 selects the AVX2 build.
PREFERENCE = ("avx512", "avx2", "base")


def _load(isa):
    """The variant's module, ready: its codes of the normalised arguments checked against
    fastattn._calls.args' (which every Problem carries), and its lean gate given the codes of
    ``causal=False`` and ``causal=True`` from fastattn._calls.args, the one normaliser of causal."""
    mod = importlib.import_module(f"fastattn._kernel_{isa}")
    theirs = ({"none": mod.CAUSAL_NONE, "bottom-right": mod.CAUSAL_BOTTOM_RIGHT,
               "top-left": mod.CAUSAL_TOP_LEFT},
              {None: mod.MASK_NONE, "bool": mod.MASK_BOOL, "add": mod.MASK_ADD})
    if theirs != (_args.CAUSAL_CODES, _args.MASK_CODES):
        raise ImportError(f"fastattn._kernel_{isa}'s codes {theirs} are not fastattn._calls.args' "
                          f"{(_args.CAUSAL_CODES, _args.MASK_CODES)}: rebuild it")
    mod.lean_causal_codes(*(_args.CAUSAL_CODES[_args.check_causal(c)] for c in (False, True)))
    return mod


def available_variants():
    """Variants that are built *and* runnable on this CPU, best first."""
    found = []
    for isa in PREFERENCE:
        if isa != "base" and not _kernel_base.cpu_supports(isa):
            continue
        try:
            _load(isa)
        except ImportError:
            continue
        found.append(isa)
    return found


def _choose():
    forced = os.environ.get("FASTATTN_ISA", "").strip().lower()
    if forced:
        if forced not in PREFERENCE:
            raise ImportError(f"FASTATTN_ISA={forced!r}: expected one of {', '.join(PREFERENCE)}")
        if forced != "base" and not _kernel_base.cpu_supports(forced):
            raise ImportError(f"FASTATTN_ISA={forced!r}: this CPU does not support it")
        return forced, _load(forced)
    isa = available_variants()[0]
    return isa, _load(isa)


#: Name of the variant in use ("avx2", "avx512" or "base") and its module.
ISA, kernel = _choose()
