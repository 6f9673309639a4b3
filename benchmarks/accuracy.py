"""float32 accuracy of fastattn under FlashAttention's test rule, beside torch's float32 math.

    python benchmarks/accuracy.py [--full] [--seeds N]

The cases, the inputs and the rule are those of tests/test_flash_rule.py: FlashAttention's
(Lq, Lk) pairs and head dims, MHA/GQA/MQA, with and without (bottom-right) causal masking
and a sliding window; fastattn and torch's float32 scaled_dot_product_attention (math
backend) are both compared with fastattn.reference in float64 on the same float32 inputs,
and a case misses the rule when fastattn's max error exceeds twice torch's plus twice the
float32 rounding noise of the reference.  Per head dim the table gives both largest errors,
the worst ratio of the two over the cases, and the misses, which are listed below it.

By default the test's own cases run (~20 s); --full runs every head dim on every pair,
adding the 1k-2k pairs at batch 1 (~3 min per seed); --seeds N repeats with N input seeds.
Needs torch.  The kernel variant is the one fastattn imported (FASTATTN_ISA selects it).
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "tests"))

import torch  # noqa: E402

from fastattn._dispatch import ISA  # noqa: E402
from test_flash_rule import (HEAD_DIMS, LONG_SHAPES, SHAPES, case_id, cases,  # noqa: E402
                             flash_rule_errors)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--full", action="store_true",
                    help="every head dim on every pair, and the 1k-2k pairs")
    ap.add_argument("--seeds", type=int, default=1, help="input seeds 0 .. N-1")
    args = ap.parse_args()
    torch.set_num_threads(1)
    shapes = SHAPES
    if args.full:
        shapes = {pair: HEAD_DIMS for pair in [*SHAPES, *LONG_SHAPES]}
    rows, misses = {}, []
    for seed in range(args.seeds):
        for case in cases(shapes):
            err, err_torch, atol = flash_rule_errors(torch, *case, seed=seed)
            row = rows.setdefault(case[2], [0.0, 0.0, 0.0, 0, 0])
            row[0], row[1] = max(row[0], err), max(row[1], err_torch)
            row[2] = max(row[2], err / err_torch)
            row[3] += 1
            if err > 2 * err_torch + atol:
                row[4] += 1
                misses.append((case_id(case), seed, err, err_torch, atol))
    print(f"kernel {ISA}; {'full grid' if args.full else 'the test cases'}, "
          f"{args.seeds} seed(s)")
    print(f"{'D':>4} {'fastattn max err':>17} {'torch f32 max err':>18} "
          f"{'worst ratio':>12} {'misses':>10}")
    for D in sorted(rows):
        e, et, worst, n, miss = rows[D]
        print(f"{D:>4} {e:>17.3e} {et:>18.3e} {worst:>12.2f} {miss:>4} / {n:<4}")
    for name, seed, err, err_torch, atol in misses:
        print(f"miss {name} seed {seed}: {err:.3e} > 2 x {err_torch:.3e} + {atol:.2e}")


if __name__ == "__main__":
    main()
