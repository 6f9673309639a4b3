"""float32 accuracy of fastattn under FlashAttention's test rules, beside torch's float32.

    python benchmarks/accuracy.py [--full] [--seeds N] [--only SECTION ...]

The cases, the inputs and the rules are those of tests/test_flash_rule.py: FlashAttention's
(Lq, Lk) pairs and head dims, MHA/GQA/MQA, with and without (bottom-right) causal masking
and a sliding window, ALiBi and softcap, packed sequences (attention_varlen), and the
gradients.  fastattn and torch's float32 (scaled_dot_product_attention on its math backend,
or a plain softmax implementation where SDPA has no such variant) are both compared with
float64 on the same float32 inputs.  A forward case misses the rule when fastattn's max
error exceeds twice torch's plus twice the float32 rounding noise of the reference; a
gradient case when one of dq, dk, dv exceeds three times torch's (or its forward misses).

Five tables, one per section (plain, variants, varlen, recipe, backward): per variant and
head dim the worst ratio fastattn error / torch error over the cases (for the backward,
over dq, dk and dv, the worst one named), with the misses counted; the misses are listed
below.  The recipe section is FlashAttention's varlen test as its code draws it (its own
seeds 0-4, whatever --seeds says).

By default the test's own cases run (~1 min); --full runs every head dim on every pair,
adding the 1k-2k pairs at batch 1 to the plain section (~15 min per seed); --seeds N
repeats with N input seeds.  Needs torch.  The kernel variant is the one fastattn imported
(FASTATTN_ISA selects it).
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "tests"))

import torch  # noqa: E402

from fastattn._machine.isa import ISA  # noqa: E402
import test_flash_rule as fr  # noqa: E402

SECTIONS = ("plain", "variants", "varlen", "recipe", "backward")
FULL_DIMS = (32, 64, 96, 128)


def plain_cases(full):
    """(variant, D, args) of the fixed-length cases without modifiers."""
    shapes = fr.SHAPES
    if full:
        shapes = {pair: fr.HEAD_DIMS for pair in [*fr.SHAPES, *fr.LONG_SHAPES]}
    for case in fr.cases(shapes):
        Lq, Lk, D, causal, local, kind = case
        variant = f"{'causal' if causal else 'full'}{'-window' if local else ''}"
        yield variant, D, case


def grid(test_cases, shapes, kinds_variants, full, dims=fr.HEAD_DIMS):
    """(variant, D, case): the test's own cases, or with --full every head dim of ``dims``
    on every pair of ``shapes`` for every (kind, variant)."""
    cases = test_cases
    if full:
        cases = [(Lq, Lk, D, kind, variant) for (Lq, Lk) in shapes for D in dims
                 for kind, variant in kinds_variants]
    for case in cases:
        yield case[4], case[2], case


def run_forward(errors_fn, cases, seeds, rows, misses):
    for seed in range(seeds):
        for variant, D, case in cases:
            err, err_torch, atol = errors_fn(torch, *case, seed=seed)
            _record(rows, misses, variant, D, err / err_torch, "",
                    err > 2 * err_torch + atol, case, seed,
                    f"{err:.3e} > 2 x {err_torch:.3e} + {atol:.2e}")


def run_backward(cases, seeds, rows, misses):
    for seed in range(seeds):
        for variant, D, case in cases:
            errors, atol = fr.grad_errors(torch, *case, seed=seed)
            err, err_torch = errors.pop("out")
            if err > 2 * err_torch + atol:
                _record(rows, misses, variant, D, 0.0, "", True, case, seed,
                        f"out {err:.3e} > 2 x {err_torch:.3e} + {atol:.2e}")
            for name, (err, err_torch) in errors.items():
                _record(rows, misses, variant, D, err / err_torch, name,
                        err > 3 * err_torch, case, seed,
                        f"{name} {err:.3e} > 3 x {err_torch:.3e}")


def _record(rows, misses, variant, D, ratio, what, missed, case, seed, text):
    cell = rows.setdefault(variant, {}).setdefault(D, [0.0, "", 0, 0])
    if ratio > cell[0]:
        cell[0], cell[1] = ratio, what
    cell[2] += 1
    if missed:
        cell[3] += 1
        misses.append(f"{case} seed {seed}: {text}")


def print_table(title, rows):
    dims = sorted({D for cells in rows.values() for D in cells})
    print(f"\n{title}: worst ratio fastattn err / torch f32 err (misses / cases)")
    print(f"{'variant':<24}" + "".join(f"{'D' + str(D):>18}" for D in dims))
    for variant, cells in rows.items():
        line = f"{variant:<24}"
        for D in dims:
            if D in cells:
                worst, what, n, miss = cells[D]
                cell = f"{worst:.2f}{' ' + what if what else ''} ({miss}/{n})"
                line += f"{cell:>18}"
            else:
                line += f"{'-':>18}"
        print(line)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--full", action="store_true",
                    help="every head dim on every pair, and the 1k-2k pairs")
    ap.add_argument("--seeds", type=int, default=1, help="input seeds 0 .. N-1")
    ap.add_argument("--only", nargs="+", choices=SECTIONS, default=SECTIONS,
                    help="run only these sections")
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(f"kernel {ISA}; {'full grid' if args.full else 'the test cases'}, "
          f"{args.seeds} seed(s)")
    misses = []
    variants = [(kind, v) for kind in fr.KV_HEADS for v in fr.VARIANTS]
    varlen = [(kind, v) for kind in fr.KV_HEADS for v in fr.VARLEN_VARIANTS]
    grads = [(kind, v) for kind in fr.KV_HEADS for v in fr.GRAD_VARIANTS]
    for section in args.only:
        rows = {}
        if section == "plain":
            run_forward(lambda t, *c, seed: fr.flash_rule_errors(t, *c, seed=seed),
                        plain_cases(args.full), args.seeds, rows, misses)
        elif section == "variants":
            run_forward(fr.variant_errors, grid(fr.VARIANT_CASES, fr.VARIANT_SHAPES, variants, args.full),
                        args.seeds, rows, misses)
        elif section == "varlen":
            run_forward(fr.varlen_errors, grid(fr.VARLEN_CASES, fr.VARLEN_SHAPES, varlen, args.full),
                        args.seeds, rows, misses)
        elif section == "recipe":
            run_forward(lambda t, *c, seed: fr.recipe_errors(t, *c),
                        [(f"causal-window-alibi {c[3]}", c[2], c) for c in fr.RECIPE_CASES],
                        1, rows, misses)
        else:
            cases = grid(fr.GRAD_CASES, fr.GRAD_SHAPES, grads, args.full, FULL_DIMS)
            run_backward(cases, args.seeds, rows, misses)
        print_table(f"{section} ({'forward' if section != 'backward' else 'dq, dk, dv'})",
                    rows)
    print()
    for line in misses:
        print(f"miss {line}")


if __name__ == "__main__":
    main()
