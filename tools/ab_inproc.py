"""Time two builds of fastattn against each other inside one process, alternating.

    python tools/ab_inproc.py OLD_DIR NEW_DIR [--threads 1] [--rounds 11]
                              [--shapes prefill-1k,prefill-1k-causal,...]

OLD_DIR and NEW_DIR each hold an importable ``fastattn`` package (a checkout with the
extension built in place, or a copy of one).  The old package is imported first and its
modules renamed to ``fastattn_old``, then the new one is imported beside it, so both run
on the same arrays, in the same process, with the same heap and the same state of the
machine, each on its own extension modules (checked); the batches alternate (old first,
then new first), timed by the bench's harness (tools/abtime.py loads it from this
checkout): each batch of ~0.15 s after the pause and the wake-up call.  Per shape the
table gives both builds' fastest batch, their ratio, and
the median of the per-round ratios.

This resolves differences of 1-2%, where separate processes (tools/ab_bench.py) carry
a bias of their own of up to several percent.  As a control, time the old build against a
second build of the same code (another directory, or other alignment flags) the same way.
With OpenMP builds on several threads, set OMP_WAIT_POLICY=passive, so that one
build's spinning team does not take the cores from the other's threads.
"""
import argparse
import importlib
import os
import sys

import abtime

DEFAULT_SHAPES = ("tiny,small,prefill-1k,prefill-1k-causal,prefill-4k-causal,long-8k,"
                  "decode-4k,decode-gqa-8k,prefill-1k-f64")


def _load_both(old_dir, new_dir):
    """Import OLD_DIR's fastattn, rename it and its modules to fastattn_old, then import
    NEW_DIR's fastattn; return (old, new), after checking each runs its own extension."""
    old_dir, new_dir = os.path.abspath(old_dir), os.path.abspath(new_dir)
    sys.path.insert(0, old_dir)
    old = importlib.import_module("fastattn")
    # Every module of the old package moves to a fastattn_old name, and its relative
    # imports (also those a function makes when called) resolve there; the extension
    # modules keep their code from OLD_DIR's files.
    for name in [n for n in sys.modules if n == "fastattn" or n.startswith("fastattn.")]:
        mod = sys.modules.pop(name)
        renamed = "fastattn_old" + name[len("fastattn"):]
        sys.modules[renamed] = mod
        mod.__package__ = renamed if name == "fastattn" else "fastattn_old"
        if getattr(mod, "__spec__", None) is not None:
            mod.__spec__.name = renamed
    sys.path.remove(old_dir)
    sys.path.insert(0, new_dir)
    importlib.invalidate_caches()
    new = importlib.import_module("fastattn")
    for prefix, root in (("fastattn_old.", old_dir), ("fastattn.", new_dir)):
        for name, mod in list(sys.modules.items()):
            f = getattr(mod, "__file__", None) or ""
            if name.startswith(prefix) and f and not f.startswith(root + os.sep):
                sys.exit(f"{name} was loaded from {f}, not from {root}")
    return old, new


def _time_shape(old, new, name, threads, rounds):
    import numpy as np
    harness, shapes = abtime.load("bench/harness"), abtime.load("bench/shapes")
    shape = shapes.SHAPES_BY_NAME[name]
    q, k, v = shapes.make_inputs(shape)
    entries = {tag: harness.Timed(lambda m=m: m.attention(q, k, v, causal=shape.causal),
                                  rounds, context=lambda m=m: m.num_threads(threads))
               for tag, m in (("old", old), ("new", new))}
    harness.first_calls(entries, 0.15)
    times = harness.alternate(entries)
    o, w = np.array(times["old"]), np.array(times["new"])
    return o.min(), w.min(), float(np.median(w / o))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("old")
    p.add_argument("new")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=11)
    p.add_argument("--shapes", default=DEFAULT_SHAPES)
    args = p.parse_args(argv)
    old, new = _load_both(args.old, args.new)
    rows = []
    for name in args.shapes.split(","):
        o, w, med = _time_shape(old, new, name, args.threads, args.rounds)
        rows.append([name, f"{o * 1e3:.3f} ms", f"{w * 1e3:.3f} ms", f"{w / o:.3f}",
                     f"{med:.3f}"])
        print(f"  ... {name}", file=sys.stderr, flush=True)
    print(abtime.load("common").format_table(
        ["shape", "old (min)", "new (min)", "new/old", "median of round ratios"], rows))


if __name__ == "__main__":
    main()
