"""Time two builds of fastattn against each other, alternating, on the benchmark shapes.

    python tools/ab_bench.py OLD_DIR NEW_DIR [--rounds 3] [--shapes tiny,small,...]

OLD_DIR and NEW_DIR each hold an importable ``fastattn`` package (a checkout with the
extension built in place, or a copy of one).  Each round runs one subprocess per build,
which one first alternating from round to round, and each subprocess times every shape
with the bench's harness (median of 5 batches of ~0.2 s after a warm-up, each batch after
the pause and the wake-up call; tools/abtime.py loads it from this checkout, so both
builds are timed by the same code).  The table gives, per shape, the median over rounds of each build's time and the
new/old ratio, plus the range of the per-round ratios, and the share of the CPUs other
processes used meanwhile (trust only rounds where it is low).

Run a build against a copy of itself the same way, as a control: two processes of
identical builds started from different directories can differ by about 2% on some
shapes (prefill-1k-f64 among them), so a ratio means something only beside the control's.
For differences of about 1%, tools/ab_inproc.py times both builds in one process.
"""
import argparse
import json
import os
import subprocess
import sys

import abtime

TOOLS = os.path.dirname(os.path.abspath(__file__))

CHILD = r"""
import json, os, sys
sys.path.append(sys.argv[2])      # tools/, after the build: it holds no fastattn
import abtime
harness, shapes = abtime.load("bench/harness"), abtime.load("bench/shapes")
import fastattn
assert os.path.dirname(os.path.dirname(fastattn.__file__)) == os.getcwd(), fastattn.__file__
load = harness.OtherLoad()
res = {}
for name in sys.argv[1].split(","):
    shape = shapes.SHAPES_BY_NAME[name]
    q, k, v = shapes.make_inputs(shape)
    call = lambda: fastattn.attention(q, k, v, causal=shape.causal)
    harness.warm_up(call, 0.3)
    medians, _, _ = harness.measure({name: harness.Timed(call, 5)}, 0.2)
    res[name] = medians[name]
frac = load.fraction()
print(json.dumps({"times": res, "bg": frac[0] if frac else None}))
"""


def run_build(path, shapes):
    # Run inside the build's directory: `python -c` puts the working directory first on
    # sys.path, so from anywhere else a fastattn there would shadow the one under test.
    env = dict(os.environ, PYTHONPATH=path)
    out = subprocess.run([sys.executable, "-c", CHILD, ",".join(shapes), TOOLS], env=env,
                         cwd=path, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def table(shapes, old, new):
    """Per shape: each build's median over rounds, new/old, and the per-round ratios."""
    common = abtime.load("common")
    med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    rows = []
    for s in shapes:
        o = med([t[s] for t in old])
        n = med([t[s] for t in new])
        ratios = [b[s] / a[s] for a, b in zip(old, new)]
        rows.append([s, f"{o * 1e3:.3f} ms", f"{n * 1e3:.3f} ms", f"{n / o:.3f}",
                     f"{min(ratios):.3f}-{max(ratios):.3f}"])
    return common.format_table(["shape", "old", "new", "new/old", "per-round ratios"], rows)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("old")
    p.add_argument("new")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--shapes", default="tiny,small,prefill-1k,prefill-1k-causal,"
                   "prefill-4k-causal,long-8k,decode-4k,decode-gqa-8k,prefill-1k-f64")
    args = p.parse_args()
    shapes = args.shapes.split(",")
    old, new, bg = [], [], []
    for r in range(args.rounds):
        # Old first in even rounds, new first in odd ones: the second process of a round
        # runs measurably slower on some shapes (an old-vs-old run shows it), so a fixed
        # order would bias the ratio.
        runs = ((args.old, old), (args.new, new))
        for path, acc in (runs if r % 2 == 0 else runs[::-1]):
            res = run_build(os.path.abspath(path), shapes)
            acc.append(res["times"])
            bg.append(res["bg"])
        print(f"round {r + 1}/{args.rounds} done", file=sys.stderr)
    print(table(shapes, old, new))
    known = [b for b in bg if b is not None]
    if known:
        print(f"bg load (other processes' CPU share) per run: "
              + " ".join(f"{100 * b:.0f}%" for b in known))


if __name__ == "__main__":
    main()
