"""The compiled gates against the checked path, over random calls and views.

``tests/fuzz_paths.py`` draws the calls (see its docstring); here it runs in a child
process, so that a crash is reported with the case that caused it and the command that
reproduces it.  ``FASTATTN_FUZZ_CASES`` sets the budget (2,000 cases by default; the
sanitizer stage runs fewer, a bug hunt more) and ``FASTATTN_FUZZ_SEED`` the seed (fixed,
so that CI is repeatable).
"""
import os
import subprocess
import sys

from conftest import ROOT

FUZZER = ROOT / "tests" / "fuzz_paths.py"


def _budget():
    return int(os.environ.get("FASTATTN_FUZZ_CASES", "2000"))


def test_compiled_and_checked_paths_agree_on_random_calls_and_views():
    seed = int(os.environ.get("FASTATTN_FUZZ_SEED", "0"))
    cases = _budget()
    proc = subprocess.run([sys.executable, str(FUZZER), "--seed", str(seed), "--cases",
                           str(cases)], capture_output=True, text=True, cwd=ROOT)
    lines = proc.stdout.splitlines()
    if proc.returncode < 0 or (proc.returncode and not any(l.startswith("MISMATCH")
                                                           for l in lines)):
        started = [l for l in lines if l.startswith("case ")]
        last = started[-1].split()[1] if started else "?"
        raise AssertionError(
            f"the fuzzer's process ended with code {proc.returncode} in case {last}; "
            f"reproduce: python tests/fuzz_paths.py --seed {seed} --case {last}\n"
            f"{proc.stderr[-3000:]}")
    summary = [l for l in lines if not l.startswith("case ")]
    assert proc.returncode == 0, "\n".join(summary)
    assert f"{cases} cases, 0 mismatches" in proc.stdout, "\n".join(summary)
    # Every kind of call ran, and both outcomes of the serving call (a refused call must
    # leave the caches as they were, which only a refused call can show).
    for name in ("attention ", "attention_varlen", "attention_weights", "attention_backward",
                 "attention_with_kvcache", "plan_kvcache/run"):
        assert any(l.startswith(name) for l in summary), (name, summary)
    if cases >= 500:
        assert any(l.startswith("attention_with_kvcache") and " error " in l for l in summary)


def test_the_fuzzer_sees_a_misread_view():
    # The comparison can fail: a row read backwards (a view taken as if it were
    # contiguous) differs from its copy, and every layout the fuzzer draws holds q's values.
    sys.path.insert(0, str(FUZZER.parent))
    import numpy as np

    import fuzz_paths

    rng = np.random.default_rng(0)
    q = rng.standard_normal((2, 2, 3, 8)).astype(np.float32)
    for layout in fuzz_paths.LAYOUTS:
        if layout != "broadcast":
            assert np.array_equal(fuzz_paths.view_of(q, layout, rng), q), layout
    misread = np.ascontiguousarray(q[..., ::-1])
    try:
        fuzz_paths.same_bits(misread, q, "q")
    except fuzz_paths.Mismatch:
        return
    raise AssertionError("a reversed row compared equal to its copy")
