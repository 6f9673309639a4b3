"""TabPFN v3.5 end to end: predict_proba with TabPFN's own attention against fastattn's backend.

    python benchmarks/tabpfn_e2e.py [--rows 3000] [--test-rows 1000] [--features 20]
                                    [--rounds 3] [--threads 2] [--estimators 1]
                                    [--float32-precision float32|bfloat16]
    python benchmarks/tabpfn_e2e.py --small          # a tiny model on a few rows: a quick check

What it measures: the wall time of ``TabPFNClassifier.predict_proba`` (preprocessing of the
test rows, then the model's forward over the training and test rows) for a TabPFN v3.5
model, once with TabPFN's attention (torch's SDPA, TabPFN's standard path) and once with
fastattn's TabPFN backend (``fastattn.integrations.tabpfn.register()``); everything else
in the forward is torch's.  The model is built from tabpfn's own architecture
(``tabpfn.architectures.tabpfn_v3_5``, its default config: about 218M parameters) with
random, seeded weights (no checkpoint is needed), and handed to the classifier in memory
(``tabpfn.base.ModelSpecs``).  The data are random (seeded), three classes.  Inference
runs in float32 (``inference_precision=torch.float32``, no autocast) on ``--threads``
torch threads, which fastattn's backend uses too.

The two backends run in turn, ``--rounds`` times (the order alternating), after one
warm-up call of each; the table gives the median time of each, the ratio (torch time /
fastattn time: above 1 when fastattn makes the whole forward faster), the time spent in
attention calls (TabPFN's SDPA wrapper, timed by wrapping it; its share of the forward)
and the largest difference of the probabilities.  torch runs at its default float32
matmul precision; fastattn at ``--float32-precision`` (its own setting,
``fastattn.set_float32_precision``): ``float32``, exact, by default, or ``bfloat16``, which
runs float32 calls whose head dims suit the kernel through bfloat16 products where the CPU
has AVX512-BF16 (elsewhere it changes nothing).
"""
import argparse
import os
import statistics
import textwrap
import time
from contextlib import contextmanager

import numpy as np

from fastattn.cli.bench.machine import cpu_name

FULL_CONFIG = {}  # tabpfn's v3.5 defaults: 24 ICL layers of width 1024, 16 heads of 64
SMALL_CONFIG = dict(embed_dim=32, dist_embed_num_blocks=1, dist_embed_num_heads=2,
                    dist_embed_num_inducing_points=16, feat_agg_num_blocks=1,
                    feat_agg_num_heads=2, feat_agg_num_cls_tokens=4, nlayers=2,
                    icl_num_heads=4, decoder_head_dim=32, decoder_num_heads=2,
                    cell_ecdf_num_buckets=256)
SMALL_SIZES = dict(rows=300, test_rows=100, features=8)
CLASSES = 3
BACKENDS = ("torch", "fastattn")
PRECISIONS = ("float32", "bfloat16")


def cpu_has_avx512_bf16():
    try:
        with open("/proc/cpuinfo") as f:
            return any(line.startswith("flags") and " avx512_bf16" in line for line in f)
    except OSError:
        return False


def build_model(overrides, seed=0):
    """A TabPFN v3.5 architecture with random weights, wrapped for the classifier."""
    import torch
    from tabpfn.architectures import tabpfn_v3_5
    from tabpfn.base import ModelSpecs
    from tabpfn.inference_config import InferenceConfig
    from tabpfn.settings import ModelVersion

    # The head sizes are what a checkpoint carries; 10 classes and 5000 regression
    # buckets are TabPFN's usual ones.
    config, _ = tabpfn_v3_5.parse_config(dict(max_num_classes=10, num_buckets=5000, **overrides))
    torch.manual_seed(seed)
    model = tabpfn_v3_5.get_architecture(config).eval()
    # Checkpoints from v2.6 on carry their preprocessing settings; v2.5's defaults are
    # the newest that tabpfn ships without a checkpoint.
    inference = InferenceConfig.get_default("multiclass", ModelVersion.V2_5)
    return ModelSpecs(model=model, architecture_config=config, inference_config=inference)


def random_table(rows, test_rows, features, seed=0):
    rng = np.random.default_rng(seed)
    X = rng.standard_normal((rows + test_rows, features)).astype(np.float32)
    # Classes that depend on the features, so that the table is not pure noise.
    score = X[:, : max(1, features // 2)].sum(axis=1) + rng.standard_normal(len(X))
    y = np.digitize(score, np.quantile(score, [1 / 3, 2 / 3]))
    return X[:rows], y[:rows], X[rows:]


class AttentionTimer:
    """Wraps TabPFN v3.5's SDPA wrapper (the one function its attention layers call,
    whichever backend then takes the call) and sums the time spent inside it."""

    def __init__(self):
        from tabpfn.architectures import tabpfn_v3_5
        self.module = tabpfn_v3_5
        self.inner = tabpfn_v3_5.scaled_dot_product_attention
        self.seconds, self.calls = 0.0, 0

    def __call__(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return self.inner(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - start
            self.calls += 1

    @contextmanager
    def installed(self):
        self.module.scaled_dot_product_attention = self
        try:
            yield self
        finally:
            self.module.scaled_dot_product_attention = self.inner


def predict(clf, X_test, backend, timer):
    """(seconds, attention seconds, probabilities, backends the attention calls ran on)."""
    import torch
    from tabpfn.architectures.shared.attention_backends import recorded_attention_backends

    import fastattn.integrations.tabpfn as fa_tabpfn

    if backend == "fastattn":
        fa_tabpfn.register()
    try:
        timer.seconds = 0.0
        with torch.no_grad(), recorded_attention_backends() as ran:
            start = time.perf_counter()
            proba = clf.predict_proba(X_test)
            seconds = time.perf_counter() - start
    finally:
        fa_tabpfn.unregister()
    return seconds, timer.seconds, np.asarray(proba, dtype=np.float64), ran


def check_backends(backend, ran):
    """Every attention call ran where the comparison says it did."""
    names = {getattr(b, "name", None) for b in ran}
    expected = {"fastattn"} if backend == "fastattn" else {None}
    if not ran or names != expected:
        raise RuntimeError(f"{backend}: attention calls ran on {sorted(map(str, names))}, "
                           f"expected {sorted(map(str, expected))} ({len(ran)} calls)")


def run_rounds(clf, X_test, rounds, timer):
    """Per backend: the times, attention times and the first round's probabilities."""
    results = {b: dict(seconds=[], attention=[], proba=None) for b in BACKENDS}
    for r in range(rounds):
        for backend in BACKENDS if r % 2 == 0 else BACKENDS[::-1]:
            seconds, attention, proba, ran = predict(clf, X_test, backend, timer)
            check_backends(backend, ran)
            res = results[backend]
            res["seconds"].append(seconds)
            res["attention"].append(attention)
            if res["proba"] is None:
                res["proba"], res["calls"] = proba, len(ran)
    return results


def max_diff(a, b):
    return float(np.max(np.abs(a - b)))


def report(results):
    print(f"{'backend':<10}{'median s':>10}{'attention s':>13}{'share':>7}{'calls':>7}"
          f"{'max|dP| vs torch':>18}")
    med = {}
    for backend, res in results.items():
        med[backend] = statistics.median(res["seconds"])
        att = statistics.median(res["attention"])
        diff = ("-" if backend == "torch"
                else f"{max_diff(res['proba'], results['torch']['proba']):.2e}")
        print(f"{backend:<10}{med[backend]:>10.3f}{att:>13.3f}{att / med[backend]:>7.0%}"
              f"{res['calls']:>7}{diff:>18}")
    print()
    print(f"ratio torch / fastattn: {med['torch'] / med['fastattn']:.2f}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=3000, help="training rows (default 3000)")
    p.add_argument("--test-rows", type=int, default=1000, help="test rows (default 1000)")
    p.add_argument("--features", type=int, default=20, help="features (default 20)")
    p.add_argument("--rounds", type=int, default=3, help="timed calls per backend (default 3)")
    p.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    p.add_argument("--estimators", type=int, default=1,
                   help="TabPFN's ensemble size: forward passes per predict (default 1)")
    p.add_argument("--float32-precision", choices=PRECISIONS, default="float32",
                   help="fastattn's float32 precision (fastattn.set_float32_precision): "
                        "float32, exact (default), or bfloat16 products where the CPU has "
                        "AVX512-BF16")
    p.add_argument("--small", action="store_true",
                   help=f"a tiny model (2 ICL layers of width 128) on "
                        f"{SMALL_SIZES['rows']}+{SMALL_SIZES['test_rows']} rows of "
                        f"{SMALL_SIZES['features']} features: a quick check, not a measurement")
    args = p.parse_args(argv)
    if args.small:
        for name, value in SMALL_SIZES.items():
            setattr(args, name, value)
    for name in ("rows", "test_rows", "features", "rounds", "threads", "estimators"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")

    try:
        import torch
        from tabpfn import TabPFNClassifier
    except ImportError as e:
        raise SystemExit(f"tabpfn_e2e.py needs torch and tabpfn >= 9.2: {e}") from None

    import fastattn
    from fastattn._machine.isa import ISA

    torch.set_num_threads(args.threads)
    for paragraph in __doc__.split("\n\n")[2:4]:  # what it measures, what the table shows
        print(textwrap.fill(" ".join(paragraph.split()), width=92), end="\n\n")
    print(f"CPU: {cpu_name()} (AVX512-BF16: {'yes' if cpu_has_avx512_bf16() else 'no'}); "
          f"torch {torch.__version__}; {args.threads} threads")
    print(f"fastattn {fastattn.__version__}, {ISA} kernel, from "
          f"{os.path.dirname(os.path.abspath(fastattn.__file__))}; float32 precision "
          f"{args.float32_precision} (torch's matmul precision: "
          f"{torch.get_float32_matmul_precision()})")

    start = time.perf_counter()
    specs = build_model(SMALL_CONFIG if args.small else FULL_CONFIG)
    params = sum(t.numel() for t in specs.model.parameters())
    cfg = specs.architecture_config
    print(f"model: TabPFN v3.5{' (small)' if args.small else ''}, {params / 1e6:.1f}M parameters, "
          f"{cfg.nlayers} ICL layers of width {cfg.embed_dim * cfg.feat_agg_num_cls_tokens}, "
          f"random weights (built in {time.perf_counter() - start:.1f} s)")
    print(f"data: {args.rows} training rows, {args.test_rows} test rows, {args.features} "
          f"features, {CLASSES} classes; {args.estimators} estimator(s); "
          f"{args.rounds} round(s) after a warm-up")
    print()

    X_train, y_train, X_test = random_table(args.rows, args.test_rows, args.features)
    clf = TabPFNClassifier(model_path=specs, n_estimators=args.estimators, device="cpu",
                           inference_precision=torch.float32, ignore_pretraining_limits=True,
                           random_state=0)
    clf.fit(X_train, y_train)

    timer = AttentionTimer()
    old = fastattn.set_float32_precision(args.float32_precision)
    try:
        with timer.installed():
            for backend in BACKENDS:
                predict(clf, X_test, backend, timer)
            results = run_rounds(clf, X_test, args.rounds, timer)
    finally:
        fastattn.set_float32_precision(old)
    report(results)


if __name__ == "__main__":
    main()
