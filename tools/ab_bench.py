"""Time two builds of fastattn against each other, alternating, on the benchmark shapes.

    python tools/ab_bench.py OLD_DIR NEW_DIR [--rounds 3] [--shapes tiny,small,...]

OLD_DIR and NEW_DIR each hold an importable ``fastattn`` package (a checkout with the
extension built in place, or a copy of one).  Each round runs one subprocess per build,
which one first alternating from round to round, and each subprocess times every shape
(median of 5 batches of ~0.2 s after a warm-up).  The table gives, per shape, the median over rounds of each build's time and the
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

CHILD = r"""
import json, os, sys, time
import numpy as np
import fastattn
from fastattn import bench
assert os.path.dirname(os.path.dirname(fastattn.__file__)) == os.getcwd(), fastattn.__file__
names = sys.argv[1].split(",")
load = bench.OtherLoad()
res = {}
for name in names:
    shape = bench.SHAPES_BY_NAME[name]
    q, k, v = bench.make_inputs(shape)
    call = lambda: fastattn.attention(q, k, v, causal=shape.causal)
    bench._warm_up(call, 0.3)
    n = bench._iterations(bench._warm_call_seconds(call, 0.05), 0.2)
    res[name] = float(np.median([bench._timed_batch(call, n) for _ in range(5)]))
frac = load.fraction()
print(json.dumps({"times": res, "bg": frac[0] if frac else None}))
"""


def run_build(path, shapes):
    # Run inside the build's directory: `python -c` puts the working directory first on
    # sys.path, so from anywhere else a fastattn there would shadow the one under test.
    env = dict(os.environ, PYTHONPATH=path)
    out = subprocess.run([sys.executable, "-c", CHILD, ",".join(shapes)], env=env, cwd=path,
                         check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


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
    med = lambda xs: sorted(xs)[len(xs) // 2]
    print(f"{'shape':<20}{'old':>11}{'new':>11}{'new/old':>9}  per-round ratios")
    for s in shapes:
        o = med([t[s] for t in old])
        n = med([t[s] for t in new])
        ratios = [b[s] / a[s] for a, b in zip(old, new)]
        print(f"{s:<20}{o * 1e3:>9.3f}ms{n * 1e3:>9.3f}ms{n / o:>9.3f}  "
              f"{min(ratios):.3f}-{max(ratios):.3f}")
    known = [b for b in bg if b is not None]
    if known:
        print(f"bg load (other processes' CPU share) per run: "
              + " ".join(f"{100 * b:.0f}%" for b in known))


if __name__ == "__main__":
    main()
