"""Shared fixtures and helpers for the fastattn test suite (``from conftest import ...``).

- results against references: ``assert_close``, ``tolerance``, ``max_error``,
  ``merge_partials``;
- inputs: ``make_qkv`` (with ``qkv_shapes``), the ``rng`` fixture, ``HALVES`` (the
  16-bit dtypes as test parameters);
- error messages: ``names`` / ``names_any`` (the message names the argument);
- fresh interpreters: ``run_python``, ``run_cli`` (the command line), and ``ROOT``, the
  repository root;
- optional packages: ``import_optional``.

Tolerances (``assert_close``) are set per dtype from the arithmetic the kernels do, not
tuned to make tests pass; see ``TOLERANCES``.
"""

import os
import re
import subprocess
import sys
import sysconfig
import warnings
from pathlib import Path

import numpy as np
import pytest

# The repository root: tests read its files and run commands there.  (tools/test_installed.py
# runs the suite from a copy of it without fastattn/, so that the installed package is tested.)
ROOT = Path(__file__).resolve().parent.parent

try:
    from hypothesis import settings as _hypothesis_settings
except ImportError:  # hypothesis is only needed by the randomised tests
    pass
else:
    from hypothesis import HealthCheck as _HealthCheck

    # Profiles (select with `pytest --hypothesis-profile=NAME`):
    #   default   CI: 100 examples per randomised test (hypothesis' own default), no
    #             deadline -- timings on a shared 2-core machine say nothing about bugs.
    #   long      >= 5000 cases over the property tests (1000 per randomised test);
    #             tests/test_properties.py and tests/test_arguments.py scale their own
    #             example counts from max_examples.
    #   thorough  for hunting bugs before a release.
    _quiet = [_HealthCheck.too_slow, _HealthCheck.data_too_large]
    _hypothesis_settings.register_profile(
        "default", max_examples=100, deadline=None, print_blob=True,
        suppress_health_check=_quiet)
    _hypothesis_settings.register_profile(
        "long", max_examples=1000, deadline=None, print_blob=True,
        suppress_health_check=_quiet)
    _hypothesis_settings.register_profile("thorough", max_examples=3000, deadline=None,
                                          suppress_health_check=_quiet)
    _hypothesis_settings.load_profile("default")


def pytest_addoption(parser):
    parser.addoption("--run-slow", action="store_true", default=False,
                     help="also run tests marked slow (each takes a minute or more)")


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "slow: takes a minute or more; skipped unless --run-slow is given")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--run-slow"):
        return
    skip = pytest.mark.skip(reason="slow: run with --run-slow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)

# (rtol, atol) for comparing a kernel result with the float64 reference, per result dtype.
#
# float64: both sides compute in float64. They differ only in summation order (blocked
#   online softmax vs one matmul) and in exp(s - m) being rescaled by exp(m_old - m_new)
#   along the way: a few ulps per operation over O(log Lk) levels of partial sums, so
#   relative errors stay ~1e-14; 1e-12 leaves two orders of margin and still catches any
#   real bug (a wrong key, a missed rescale) by many orders of magnitude.
# float32: eps = 1.2e-7. A score of D products carries ~sqrt(D)*eps*|s| error, exp turns an
#   absolute score error into a relative weight error, and the weighted sum of up to a few
#   thousand values of size O(1) adds ~sqrt(Lk)*eps. For the test shapes (|s| <~ 10,
#   D <= 128, Lk <= 2k) that stays below 1e-5 relative; near-zero outputs (cancelling
#   values) need the absolute floor 2e-6 (~16 eps of an O(1) value).
# float16: computed in float32 and rounded once to float16, whose ulp is 2**-10 ~ 9.8e-4
#   relative; the reference rounds its float64 result once too. The two roundings can
#   land on neighbouring float16 values when the float32 error straddles a rounding
#   boundary: one ulp, i.e. rtol 1e-3. The atol 1e-3 covers the same one-ulp flip for
#   outputs of size ~1 that sit next to zero after cancellation.
TOLERANCES = {
    np.dtype(np.float64): (1e-12, 1e-12),
    np.dtype(np.float32): (1e-5, 2e-6),
    np.dtype(np.float16): (1e-3, 1e-3),
}
# bfloat16 (ml_dtypes): the float16 argument with bfloat16's 8 significant bits, whose ulp is
#   at most 2**-7 ~ 7.8e-3 relative: one ulp is rtol 8e-3, and atol 8e-3 for outputs of size
#   ~1 next to zero. Keyed by name, since ml_dtypes is optional.
BFLOAT16_TOLERANCE = (8e-3, 8e-3)


def tolerance(dtype):
    """(rtol, atol) for results of this dtype (integer inputs give float64 results)."""
    dtype = np.dtype(dtype)
    if dtype.kind in "biu":
        dtype = np.dtype(np.float64)
    if dtype.name == "bfloat16":
        return BFLOAT16_TOLERANCE
    return TOLERANCES[dtype]


def assert_close(actual, expected, dtype=None, *, scale=1.0, err_msg=""):
    """Assert ``actual`` matches the reference ``expected`` within the tolerance of ``dtype``.

    ``dtype`` defaults to ``actual.dtype``; when given, ``actual.dtype`` must equal it (the
    contract fixes result dtypes). ``scale`` multiplies the absolute tolerance for values
    that are larger than O(1) (e.g. unscaled integer inputs). Infinite entries (lse = -inf)
    must match exactly; NaN never passes.
    """
    actual = np.asarray(actual)
    expected = np.asarray(expected)
    if dtype is None:
        dtype = actual.dtype
    else:
        assert actual.dtype == np.dtype(dtype), f"dtype {actual.dtype} != {np.dtype(dtype)}"
    assert actual.shape == expected.shape, f"shape {actual.shape} != {expected.shape}"
    assert not np.isnan(actual).any(), "result contains NaN"
    rtol, atol = tolerance(dtype)
    np.testing.assert_allclose(
        actual.astype(np.float64), expected.astype(np.float64),
        rtol=rtol, atol=atol * scale, err_msg=err_msg,
    )


def max_error(actual, expected):
    """Largest absolute difference over finite entries, for failure messages/reports."""
    a = np.asarray(actual, dtype=np.float64)
    e = np.asarray(expected, dtype=np.float64)
    finite = np.isfinite(a) & np.isfinite(e)
    return float(np.abs(a[finite] - e[finite]).max(initial=0.0))


def _bfloat16():
    try:
        import ml_dtypes
    except ImportError:
        return None
    return np.dtype(ml_dtypes.bfloat16)


# The 16-bit storage dtypes, as test parameters: bfloat16 skips without ml_dtypes.
HALVES = [pytest.param(np.dtype(np.float16), id="float16"),
          pytest.param(_bfloat16(), id="bfloat16",
                       marks=pytest.mark.skipif(_bfloat16() is None,
                                                reason="bfloat16 needs ml_dtypes"))]


def qkv_shapes(batch, Hq, Hkv, Lq, Lk, D, Dv=None):
    """The shapes of q, k and v: ``(*batch, Hq, Lq, D)``, ``(*batch, Hkv, Lk, D)`` and
    ``(*batch, Hkv, Lk, Dv)`` (``Dv`` defaults to ``D``), for :func:`make_qkv`."""
    batch = tuple(batch)
    return (*batch, Hq, Lq, D), (*batch, Hkv, Lk, D), (*batch, Hkv, Lk, D if Dv is None else Dv)


def make_qkv(rng, q_shape=None, k_shape=None, v_shape=None, dtype=np.float32, kv_dtype=None,
             *, batch=(), Hq=1, Hkv=None, Lq=None, Lk=None, D=None, Dv=None):
    """Random q, k, v: standard normal for floats, small ints otherwise, drawn in the order
    q, k, v.

    ``rng`` is a generator, or an int seed for a fresh one.  The shapes are given whole
    (``q_shape, k_shape, v_shape``) or by dimension, as :func:`qkv_shapes` lays them out:
    ``batch`` (a tuple), ``Hq`` query heads, ``Hkv`` key/value heads (default ``Hq``; fewer
    for GQA/MQA), ``Lq`` and ``Lk`` (default ``Lq``), ``D`` and ``Dv`` (default ``D``).
    ``kv_dtype`` (default ``dtype``) is k's and v's dtype.
    """
    if not isinstance(rng, np.random.Generator):
        rng = np.random.default_rng(rng)
    if q_shape is None:
        Hkv = Hq if Hkv is None else Hkv
        q_shape, k_shape, v_shape = qkv_shapes(batch, Hq, Hkv, Lq, Lq if Lk is None else Lk,
                                               D, Dv)
    out = []
    kv_dtype = dtype if kv_dtype is None else kv_dtype
    for shape, dt in ((q_shape, dtype), (k_shape, kv_dtype), (v_shape, kv_dtype)):
        dt = np.dtype(dt)
        if dt == bool:
            a = rng.random(shape) < 0.5
        elif dt.kind in "iu":
            a = rng.integers(-3, 4, size=shape).astype(dt)
        else:
            a = rng.standard_normal(shape).astype(dt)
        out.append(a)
    return tuple(out)


def merge_partials(out1, lse1, out2, lse2):
    """Combine attention over two disjoint key sets into attention over their union.

    With lse = logaddexp(lse1, lse2), each part's softmax denominator is exp(lse_i), so
    out = exp(lse1 - lse) * out1 + exp(lse2 - lse) * out2. A row empty in both parts stays
    zero with lse = -inf (the weights are defined as 0 there instead of NaN).
    """
    out1 = np.asarray(out1, dtype=np.float64)
    out2 = np.asarray(out2, dtype=np.float64)
    lse1 = np.asarray(lse1, dtype=np.float64)
    lse2 = np.asarray(lse2, dtype=np.float64)
    lse = np.logaddexp(lse1, lse2)
    finite = np.isfinite(lse)
    safe = np.where(finite, lse, 0.0)
    w1 = np.where(finite, np.exp(lse1 - safe), 0.0)
    w2 = np.where(finite, np.exp(lse2 - safe), 0.0)
    return w1[..., None] * out1 + w2[..., None] * out2, lse


@pytest.fixture
def rng():
    """A fresh generator with a fixed seed: every test sees the same numbers on every run."""
    return np.random.default_rng(20240611)


@pytest.fixture
def strict_warnings():
    """Turn every warning (RuntimeWarning from NaN/overflow in particular) into an error."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        yield


def import_optional(name):
    """Import an optional dependency, or skip the test module when it is absent.

    With ``FASTATTN_REQUIRE_INTEGRATIONS=1`` (the CI stage that installs torch,
    transformers and tabpfn) a missing package fails the run instead of skipping it, so
    those tests cannot silently stop running.
    """
    import importlib
    import os

    if os.environ.get("FASTATTN_REQUIRE_INTEGRATIONS") == "1":
        return importlib.import_module(name)
    return pytest.importorskip(name)


def names(arg):
    """A regex matching ``arg`` as a word (``q`` in "q.shape=(3, 4)", not in "sequence"):
    the check that an error message names the argument concerned."""
    return rf"(?<![A-Za-z_]){re.escape(arg)}(?![A-Za-z_])"


def names_any(message, args):
    """Whether ``message`` mentions one of ``args`` as a word (see :func:`names`)."""
    return any(re.search(names(a), message) for a in args)


def run_python(*args, env=None, cwd=None, timeout=600, check=True):
    """Run ``python *args`` in a fresh interpreter; returns the CompletedProcess (text output).

    The child imports the same fastattn as this process (an in-place build or the installed
    package, whatever the working directory): a source tree holding it comes first on the
    child's PYTHONPATH.  ``env`` adds variables to this process's environment (a value of
    None removes one).  With ``check``, an exit status other than 0 fails the test and
    shows the end of the child's stderr.
    """
    import fastattn

    home = os.path.dirname(os.path.dirname(os.path.abspath(fastattn.__file__)))
    child_env = dict(os.environ)
    # An installed package is found through site-packages, which must not go before the
    # standard library; a source tree goes first.
    if home not in {sysconfig.get_paths()[k] for k in ("purelib", "platlib")}:
        child_env["PYTHONPATH"] = os.pathsep.join(
            p for p in (home, os.environ.get("PYTHONPATH")) if p)
    for name, value in (env or {}).items():
        if value is None:
            child_env.pop(name, None)
        else:
            child_env[name] = value
    proc = subprocess.run([sys.executable, *map(str, args)], env=child_env, cwd=cwd,
                          capture_output=True, text=True, timeout=timeout)
    if check:
        assert proc.returncode == 0, (
            f"exit status {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    return proc


def run_cli(*args, timeout=600):
    """``python -m fastattn *args`` in a fresh interpreter from the repository root, as a user
    runs it; the caller checks the exit status."""
    return run_python("-m", "fastattn", *args, cwd=ROOT, timeout=timeout, check=False)
