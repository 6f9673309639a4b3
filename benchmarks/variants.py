"""The attention variants against the same call without them, and against torch: the rows
of ``python -m fastattn bench --variants`` (see fastattn/bench_variants.py).

    python benchmarks/variants.py [--threads 2] [--repeat 7]
"""
import argparse
import sys

from fastattn import bench_variants

if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--quick", action="store_true")
    sys.exit(bench_variants.run(ap.parse_args(), sys.stdout))
